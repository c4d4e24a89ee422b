"""Session 52: a check that a refactor of the attention kernels changes no emitted op. Writes,
per call of a fixed set (decode at Tq 1 / 16 / 40 in each in-flight mode, sparse with one and
two segments, FAFO's 8B shape), the cuda-lowered HLO text without locations and the Mosaic GPU
modules of its kernels as MLIR without debug info (captured before serialisation), to a JSON.
Run on the CPU before and after the change and compare the two files (`dump_basename`, a
per-process counter, aside): `softmax_pv_step` (register_operand.py), shared by four kernels'
loops, left all 11 texts identical.

  PYTHONPATH=$PWD python benchmarks/results/s52/lowered_kernels.py /tmp/before.json
"""
import re, sys, jax, jax.numpy as jnp
from pallas_kernels.decode_attention import decode_attention, DecodeConfig
from pallas_kernels.sparse_attention import sparse_attention, SparseConfig
sds = jax.ShapeDtypeStruct
out = sys.argv[1]
from jax.experimental.mosaic.gpu import core as mgpu_core
captured = []
_orig = mgpu_core._run_serde_pass
def _capture(module, **kw):
  captured.append(module.operation.get_asm(enable_debug_info=False))
  return _orig(module, **kw)
mgpu_core._run_serde_pass = _capture
def lower(fn, *args):
  captured.clear()
  t = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  t = re.sub(r'kernel_hash = "[^"]*"|module = "[^"]*"', "", t)
  t = t + "\n=====KERNELS=====\n" + "\n-----\n".join(captured)
  t = re.sub(r"loc\([^()]*(\([^()]*\)[^()]*)*\)", "", t)
  t = re.sub(r"#loc\d* = .*\n", "", t)
  return t
cases = {}
b, hq, hkv, d, s = 1, 32, 8, 128, 16384
for tq, mode in ((1, "auto"), (16, "auto"), (16, "merged"), (16, "kernel"), (40, "auto")):
  args = (sds((b, tq, hq, d), jnp.bfloat16), sds((b, hkv, s, d), jnp.bfloat16), sds((b, hkv, s, d), jnp.bfloat16),
          sds((b,), jnp.int32), sds((b, tq, hkv, d), jnp.bfloat16), sds((b, tq, hkv, d), jnp.bfloat16), sds((tq, tq), jnp.bool_))
  cases[f"decode_{tq}_{mode}"] = lower(lambda *a, mode=mode: decode_attention(*a, config=DecodeConfig(inflight=mode), score_queries=(0,) if tq == 16 else ()), *args)
for tq, sq, bs, nb, mode in ((1, None, 64, 4, "auto"), (16, None, 64, 4, "auto"), (16, 8, 64, 4, "auto"), (16, None, 64, 4, "merged"), (283, 240, 64, 16, "auto"), (16, 0, 128, 4, "auto")):
  args = (sds((b, tq, hq, d), jnp.bfloat16), sds((b, hkv, s, d), jnp.bfloat16), sds((b, hkv, s, d), jnp.bfloat16),
          sds((b, hkv, nb), jnp.int32), sds((b, hkv), jnp.int32), sds((b,), jnp.int32),
          sds((b, tq, hkv, d), jnp.bfloat16), sds((b, tq, hkv, d), jnp.bfloat16), sds((tq, tq), jnp.bool_))
  cases[f"sparse_{tq}_{sq}_{bs}_{mode}"] = lower(lambda *a, sq=sq, bs=bs, mode=mode: sparse_attention(*a, block_size=bs, sparse_queries=sq, config=SparseConfig(inflight=mode)), *args)
import json; json.dump(cases, open(out, "w"))
print({k: len(v) for k, v in cases.items()})
