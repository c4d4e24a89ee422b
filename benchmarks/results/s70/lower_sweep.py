"""Session 70 (CPU): lowers decode_attention, sparse_attention (one segment, and two where
Tq > 1) and quant_attention (4 / 8 bits; the cache a multiple of its 128-token group) for the
cuda platform over heads, Tq, batch sizes and cache capacities; prints each cell's failures.
Interpret mode does not check what Mosaic GPU's lowering rejects; this does.

  (defaults: --heads 9,3,64 32,8,128 --tq 1-25 31 33 43 63 65)  lower_sweep_{before,fixed}_cpu.log
  --heads 14,2,64 16,8,128 4,4,64 10,2,128 16,1,64 12,2,256 --tq 2 9 13 17 33 65 100
                                                          lower_sweep_shapes_cpu.log
  --heads 32,8,128 --tq 1 16 --batch 1 3 --capacity 64 192 640 1088 2496 8256 39936 131072
                                                          lower_sweep_capacities_cpu.log
(the capacity run: sparse lists capacity / 64 / 7 blocks, at least 1; the others 4 blocks. That
log came from a first version of the sweep without the two-segment sparse and 8-bit quant cells.)"""
import argparse, functools
import jax, jax.numpy as jnp
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.quant_attention import quant_attention, QuantKV

sds = jax.ShapeDtypeStruct


def low(fn, *args) -> str:
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return "ok"
  except Exception as e:  # noqa: BLE001
    return "FAIL " + str(e).splitlines()[0][:120]


def cell(b, s, tq, hq, hkv, d, table_len) -> dict:
  q = sds((b, tq, hq, d), jnp.bfloat16)
  kc = sds((b, hkv, s, d), jnp.bfloat16)
  kn = sds((b, tq, hkv, d), jnp.bfloat16)
  ln, m = sds((b,), jnp.int32), sds((tq, tq), jnp.bool_)
  tab, nb = sds((b, hkv, table_len), jnp.int32), sds((b, hkv), jnp.int32)
  sparse = lambda sq: lambda *a: sparse_attention(*a, block_size=64, sparse_queries=sq)
  r = {"decode": low(lambda *a: decode_attention(*a), q, kc, kc, ln, kn, kn, m),
       "sparse1": low(sparse(None), q, kc, kc, tab, nb, ln, kn, kn, m)}
  if tq > 1:
    r["sparse2"] = low(sparse(tq // 2), q, kc, kc, tab, nb, ln, kn, kn, m)
  if s % 128 == 0:
    qkv, full = QuantKV.abstract(b, hkv, s, d, group=128), sds((b, hkv, 256, d), jnp.bfloat16)
    for bits in (4, 8):
      r[f"quant{bits}"] = low(functools.partial(quant_attention, bits=bits), q, qkv, ln, full,
                              full, ln, kn, kn, m)
  return {k: v for k, v in r.items() if v != "ok"}


def tq_values(items):
  out = []
  for x in items:
    lo, _, hi = x.partition("-")
    out += list(range(int(lo), int(hi or lo) + 1))
  return out


if __name__ == "__main__":
  p = argparse.ArgumentParser()
  p.add_argument("--heads", nargs="+", default=["9,3,64", "32,8,128"], help="Hq,Hkv,D")
  p.add_argument("--tq", nargs="+", default=["1-25", "31", "33", "43", "63", "65"])
  p.add_argument("--batch", type=int, nargs="+", default=[1])
  p.add_argument("--capacity", type=int, nargs="+", default=None,
                 help="cache capacities (default 1024, with 4 listed blocks)")
  args = p.parse_args()
  for heads in args.heads:
    hq, hkv, d = map(int, heads.split(","))
    for b in args.batch:
      for s in args.capacity or [1024]:
        table_len = max(1, s // 64 // 7) if args.capacity else 4
        for tq in tq_values(args.tq):
          bad = cell(b, s, tq, hq, hkv, d, table_len)
          print(hq, hkv, d, *((b, s) if args.capacity else ()), tq,
                "all ok" if not bad else bad, flush=True)
