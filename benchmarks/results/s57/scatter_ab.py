import time, re, sys
import jax, jax.numpy as jnp
from jax import lax
L, B, H, S, D, C = 30, 2, 3, 1024, 64, 5
bufs = tuple(jnp.zeros((B, H, S, D)) for _ in range(L))
news = tuple(jnp.ones((B, C, H, D)) for _ in range(L))
lengths = jnp.array([100, 200], jnp.int32); count = jnp.array([3, 5], jnp.int32)
def at_version(bufs, news, lengths, count):
  col = jnp.arange(C)[None]
  pos = jnp.where(col < count[:, None], lengths[:, None] + col, S)
  rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, C))
  return tuple(b.at[rows, :, pos].set(n, mode="drop") for b, n in zip(bufs, news))
def scatter_version(bufs, news, lengths, count):
  col = jnp.arange(C)[None]
  pos = jnp.where(col < count[:, None], lengths[:, None] + col, S)
  rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, C))
  idx = jnp.stack([rows, pos], axis=-1)
  dn = lax.ScatterDimensionNumbers(update_window_dims=(2, 3), inserted_window_dims=(0, 2),
                                   scatter_dims_to_operand_dims=(0, 2))
  return tuple(lax.scatter(b, idx, n, dn, mode=lax.GatherScatterMode.FILL_OR_DROP) for b, n in zip(bufs, news))
for f in (at_version, scatter_version):
  j = jax.jit(f); low = j.lower(bufs, news, lengths, count)
  ops = len(re.findall(r"stablehlo\.\w+", low.as_text()))
  t0 = time.perf_counter(); c = low.compile(); t = time.perf_counter() - t0
  out = c(bufs, news, lengths, count)
  print(f.__name__, ops, f"{t:.2f}s", float(sum(o.sum() for o in out)))
