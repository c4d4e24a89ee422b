"""Session 56: which shapes the "int4" layout's jitted product gets wrong on a GPU, and whether
going through int8 first avoids it. Writes JSON to argv[1]."""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from sparsedec.model.linear import linear
from sparsedec.model import quant_weights as qw_mod
from sparsedec.model.quant_weights import quantize_weight, CODE_OFFSET

def via_int8(x, w):
  n_groups, n_out = w.scale.shape
  c = w.codes.astype(jnp.int8).reshape(n_groups, w.group, n_out)
  wf = ((c.astype(jnp.float32) + CODE_OFFSET) * w.scale.astype(jnp.float32)[:, None]
        + w.zero.astype(jnp.float32)[:, None])
  wx = wf.astype(x.dtype).reshape(w.in_padded, n_out)
  return jnp.dot(qw_mod._pad_inputs(x, w), wx, precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)

rows = []
rng = np.random.default_rng(0)
for n_in in (172, 256):
  for n_out in (8, 16, 24, 32, 40, 48, 56, 64, 72, 96, 100, 128, 136, 192, 200):
    w = jnp.asarray(rng.normal(size=(n_in, n_out)).astype(np.float32))
    packed = quantize_weight(w, group=64)
    qw = quantize_weight(w, group=64, layout="int4")
    for dtype in ("float32", "bfloat16"):
      x = jnp.asarray(rng.normal(size=(2, 3, n_in)).astype(np.float32)).astype(dtype)
      want = np.asarray(linear(x, packed).astype(jnp.float32))
      for how, fn in (("int4", jax.jit(linear)), ("int8_first", jax.jit(via_int8))):
        got = np.asarray(fn(x, qw).astype(jnp.float32))
        err = float((np.abs(got - want) / (np.abs(want).max() + 1e-30)).max())
        rows.append(dict(n_in=n_in, n_out=n_out, dtype=dtype, how=how, max_rel_err=err, ok=err < 1e-2))
bad = [r for r in rows if not r["ok"]]
print("bad:", len(bad), "of", len(rows))
for r in bad: print(r)
json.dump(dict(device=str(jax.devices()[0]), rows=rows), open(sys.argv[1], "w"), indent=1)
