"""Session 70 (CPU): decode / sparse / quant (4-bit) lowered for cuda at Llama-3.1-8B heads over
cache capacities 64..128K (split counts of every size), B 1 and 3, Tq 1 and 16."""
import functools, jax, jax.numpy as jnp
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.quant_attention import quant_attention, QuantKV
sds = jax.ShapeDtypeStruct
def low(fn, *args):
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)); return "ok"
  except Exception as e:
    return "FAIL " + str(e).splitlines()[0][:120]
hq, hkv, d = 32, 8, 128
for b in (1, 3):
  for s in (64, 192, 640, 1088, 2496, 8256, 40000 // 64 * 64, 131072):
    for tq in (1, 16):
      q = sds((b, tq, hq, d), jnp.bfloat16); kc = sds((b, hkv, s, d), jnp.bfloat16)
      kn = sds((b, tq, hkv, d), jnp.bfloat16); ln = sds((b,), jnp.int32); m = sds((tq, tq), jnp.bool_)
      r = {"decode": low(lambda *a: decode_attention(*a), q, kc, kc, ln, kn, kn, m)}
      nb = max(1, s // 64 // 7)
      tab = sds((b, hkv, nb), jnp.int32); cnt = sds((b, hkv), jnp.int32)
      r["sparse"] = low(lambda *a: sparse_attention(*a, block_size=64), q, kc, kc, tab, cnt, ln, kn, kn, m)
      if s % 128 == 0:
        qkv = QuantKV.abstract(b, hkv, s, d, group=128); full = sds((b, hkv, 256, d), jnp.bfloat16)
        r["quant4"] = low(functools.partial(quant_attention, bits=4), q, qkv, ln, full, full, ln, kn, kn, m)
      bad = {k: v for k, v in r.items() if v != "ok"}
      print(b, s, tq, "all ok" if not bad else bad, flush=True)
