"""A small program for Nsight Compute: a few calls of one kernel, so `ncu` can profile one launch
of it: an attention kernel at the issue-3 shape (Hq 32, Hkv 8, D 128, bf16, B 1), or the
W4A16 GEMV at a Llama-3.1-8B draft shape.

  ncu --clock-control none -k regex:mosaic --launch-skip 2 --launch-count 1 --set full \\
      python benchmarks/ncu_target.py --kernel quant --bits 4 --seq 65536

--kernel quant: quant_attention's split kernel alone (`_quant_partials`, default stage size);
--kernel decode: decode_attention's split kernel alone (--tq queries per row, --batch rows);
--kernel sparse: sparse_attention's split kernel alone over --listed random 64-slot blocks per
  (row, KV head) (--tq queries per row, --batch rows);
--kernel w4a16: `w4a16_matmul` (x relayout, the kernel, the split sum) at --shape, M = 1.
Each runs --calls times (compile first).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels import quant_attention as qa  # noqa: E402
from pallas_kernels.decode_attention import split_partials  # noqa: E402
from pallas_kernels.sparse_attention import split_partials as sparse_partials  # noqa: E402
from benchmarks.w4a16_gemv import LLAMA_8B, random_weight  # noqa: E402
from pallas_kernels.w4a16_gemv import w4a16_matmul  # noqa: E402

HQ, HKV, D, GROUP = 32, 8, 128, 128


def _w4a16_call(shape):
  """w4a16_matmul at a Llama-8B linear, M = 1, the w4a16_gemv benchmark's random weight."""
  n_in, n_out = LLAMA_8B[shape]
  kw, kx = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (1, n_in), jnp.float32).astype(jnp.bfloat16)
  f = jax.jit(functools.partial(w4a16_matmul, in_features=n_in, group=GROUP))
  return f, (x, *random_weight(kw, n_in, n_out))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--kernel", choices=("quant", "decode", "sparse", "w4a16"), default="quant")
  p.add_argument("--shape", choices=tuple(LLAMA_8B), default="w_gate_up", help="--kernel w4a16")
  p.add_argument("--bits", type=int, default=4)
  p.add_argument("--seq", type=int, default=65536)
  p.add_argument("--tq", type=int, default=1, help="--kernel decode / sparse: queries per row")
  p.add_argument("--batch", type=int, default=1, help="--kernel decode / sparse: rows")
  p.add_argument("--listed", type=int, default=4,
                 help="--kernel sparse: 64-slot blocks listed per (row, KV head)")
  p.add_argument("--calls", type=int, default=4)
  a = p.parse_args(argv)
  if a.kernel == "w4a16":
    f, args = _w4a16_call(a.shape)
    for _ in range(a.calls):
      jax.block_until_ready(f(*args))
    print(f"ran {a.calls} calls of w4a16 ({a.shape}, M 1)")
    return
  s, b = a.seq, (1 if a.kernel == "quant" else a.batch)
  key = jax.random.split(jax.random.key(0), 4)
  k = jax.random.normal(key[0], (b, HKV, s, D), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(key[1], (b, HKV, s, D), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.full((b,), s, jnp.int32)
  if a.kernel == "quant":
    qkv = qa.quantize_kv(k, v, group=GROUP)
    del k, v
    nqb, n = qa._q_blocks(HQ // HKV)
    cfg = qa.QuantAttentionConfig()
    bkv = qa._block_kv(cfg, n, GROUP, s, a.bits, batch=1)
    q_t = jax.random.normal(key[2], (1, HKV, nqb, D // 64, 64, n), jnp.float32)
    f = jax.jit(functools.partial(qa._quant_partials, bits=a.bits, dtype=jnp.bfloat16, cfg=cfg,
                                  block_kv=bkv,
                                  num_splits=qa._num_splits(cfg, bkv, 1, HKV, nqb, s,
                                                            bits=a.bits, rows=n)[0]))
    args = (q_t, qkv, lengths)
  elif a.kernel == "sparse":
    q = jax.random.normal(key[2], (b, a.tq, HQ, D), jnp.float32).astype(jnp.bfloat16)
    order = jax.random.uniform(key[3], (b, HKV, s // 64)).argsort(-1)     # distinct blocks
    tables = order[..., :a.listed].astype(jnp.int32)                     # [B, Hkv, listed]
    counts = jnp.full((b, HKV), a.listed, jnp.int32)
    f = jax.jit(lambda *x: sparse_partials(*x, block_size=64, sparse_queries=a.tq)[1:])
    args = (q, k, v, tables, counts, lengths)
  else:
    q = jax.random.normal(key[2], (b, a.tq, HQ, D), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(split_partials)
    args = (q, k, v, lengths)
  for _ in range(a.calls):
    jax.block_until_ready(f(*args))
  print(f"ran {a.calls} calls of {a.kernel} (bits {a.bits}, B {b}, S {s}, Tq {a.tq})")


if __name__ == "__main__":
  main()
