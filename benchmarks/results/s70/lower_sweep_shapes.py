"""Session 70 (CPU): lower_sweep.py at other heads (Hq, Hkv, D): Qwen2-0.5B's (14, 2, 64),
Qwen3's (16, 8, 128), MHA (4, 4, 64), G 5 at D 128 (10, 2, 128), G 16 (16, 1, 64) and D 256
(12, 2, 256), at Tq 2, 9, 13, 17, 33, 65, 100: lowers decode_attention, sparse_attention (one and
two segments) and quant_attention (4 / 8 bits) for the cuda platform; prints the failures."""
import functools, sys, jax, jax.numpy as jnp
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.quant_attention import quant_attention, QuantKV
sds = jax.ShapeDtypeStruct
def low(fn, *args):
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)); return "ok"
  except Exception as e:
    return "FAIL " + str(e).splitlines()[0][:120]
tqs = [2, 9, 13, 17, 33, 65, 100]
for hq, hkv, d in ((14, 2, 64), (16, 8, 128), (4, 4, 64), (10, 2, 128), (16, 1, 64), (12, 2, 256)):
  b, s = 1, 1024
  for tq in tqs:
    q = sds((b, tq, hq, d), jnp.bfloat16); kc = sds((b, hkv, s, d), jnp.bfloat16)
    kn = sds((b, tq, hkv, d), jnp.bfloat16); ln = sds((b,), jnp.int32); m = sds((tq, tq), jnp.bool_)
    r = {}
    r["decode"] = low(lambda *a: decode_attention(*a), q, kc, kc, ln, kn, kn, m)
    tab = sds((b, hkv, 4), jnp.int32); nb = sds((b, hkv), jnp.int32)
    r["sparse1"] = low(lambda *a: sparse_attention(*a, block_size=64), q, kc, kc, tab, nb, ln, kn, kn, m)
    if tq > 1:
      r["sparse2"] = low(lambda *a: sparse_attention(*a, block_size=64, sparse_queries=tq // 2), q, kc, kc, tab, nb, ln, kn, kn, m)
    qkv = QuantKV.abstract(b, hkv, s, d, group=128); full = sds((b, hkv, 256, d), jnp.bfloat16)
    for bits in (4, 8):
      r[f"quant{bits}"] = low(functools.partial(quant_attention, bits=bits), q, qkv, ln, full, full, ln, kn, kn, m)
    bad = {k: v for k, v in r.items() if v != "ok"}
    print(hq, hkv, d, tq, "all ok" if not bad else bad, flush=True)
