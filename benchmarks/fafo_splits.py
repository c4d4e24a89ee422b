"""FAFO's Llama-3.1-8B attention call (`sparse_attention`: 240 fumble queries on a 1K StreamingLLM
list, 43 verification queries on the full cache; Hq 32, Hkv 8, D 128, B 1) under chosen
(fumble, verification) split counts against the planner's own plan (GPU; device us of the
sparse kernel and the whole call).

  python benchmarks/fafo_splits.py --contexts 16384 32768 --splits 1,12 2,8 1,8 \
      --out $OUT/fafo_splits.json
  python benchmarks/fafo_splits.py --plan-only      # the planner's plans, no GPU needed

Session 28's sweeps (H200, `results/s28/fafo_splits_*_s28_h200.json`) are what
`split_plan.split_counts`'s `wave_tiles` rule rests on: (2, 8) was the fastest from 16K to 128K.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from benchmarks._timing import time_loop, write_json
from pallas_kernels.sparse_attention import SparseConfig, _layout, sparse_attention
from sparsedec.decode.fafo import fafo_layout

HQ, HKV, D, TOKENS, FUMBLE, BUDGET = 32, 8, 128, 283, 240, 1024


def planned(context: int, block_size: int, cfg: SparseConfig = SparseConfig(),
            warp_specialized: bool = True) -> tuple[list[int], bool]:
  """(split counts per segment, warp-specialized?) the wrapper uses for this call on a GPU."""
  segments, *_, ws = _layout((1, TOKENS, HQ, D), (1, HKV, context, D), BUDGET // block_size,
                             block_size=block_size, sparse_queries=FUMBLE, config=cfg,
                             num_score_queries=(0, 0), interpret=not warp_specialized)
  return [seg.num_splits for seg in segments], ws


def parse_splits(text: str) -> tuple[int, int]:
  try:
    fumble, full = (int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"--splits takes FUMBLE,FULL pairs like 2,8, got {text!r}")
  if fumble < 1 or full < 1:
    raise argparse.ArgumentTypeError(f"split counts must be >= 1, got {text!r}")
  return fumble, full


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
  p.add_argument("--block-sizes", type=int, nargs="+", default=[64])
  p.add_argument("--splits", type=parse_splits, nargs="*", default=[(2, 8)],
                 help="FUMBLE,FULL split counts timed beside the planner's plan")
  p.add_argument("--calls", type=int, default=200)
  p.add_argument("--plan-only", action="store_true", help="print the planner's plans and stop")
  p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                               "fafo_splits.json"))
  args = p.parse_args(argv)
  mask = jnp.asarray(fafo_layout(40, 6, 7)[0])
  rows = []
  for context in args.contexts:
    for block_size in args.block_sizes:
      plan, ws = planned(context, block_size)
      if args.plan_only:
        row = dict(S=context, block_size=block_size, planned=plan, warp_specialized=ws)
        print(json.dumps(row), flush=True)
        rows.append(row)
        continue
      keys = jax.random.split(jax.random.key(0), 5)
      rand = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16)
      q = rand(keys[0], (1, TOKENS, HQ, D))
      k, v = rand(keys[1], (1, HKV, context, D)), rand(keys[2], (1, HKV, context, D))
      kn, vn = rand(keys[3], (1, TOKENS, HKV, D)), rand(keys[4], (1, TOKENS, HKV, D))
      lengths = jnp.array([context])
      blocks = BUDGET // block_size
      tables = jnp.broadcast_to(jnp.arange(blocks, dtype=jnp.int32), (1, HKV, blocks))
      counts = jnp.full((1, HKV), blocks, jnp.int32)
      for splits in [None] + [s for s in args.splits if list(s) != plan]:
        cfg = SparseConfig(num_splits=splits and splits[0], num_splits_full=splits and splits[1])
        fn = lambda q, k, v, kn, vn, cfg=cfg: sparse_attention(
            q, k, v, tables, counts, lengths, kn, vn, mask, block_size=block_size,
            sparse_queries=FUMBLE, config=cfg)
        r = time_loop(fn, q, k, v, kn, vn, num_calls=args.calls, unroll=8, profile=True)
        by_kernel = r.get("device_time_by_kernel", {})
        row = dict(S=context, block_size=block_size, splits=list(splits or plan),
                   planned=splits is None, call_device_us=r.get("device_s", 0) * 1e6,
                   sparse_kernel_us=sum(t for name, t in by_kernel.items()
                                        if name.startswith("sparse")) * 1e6,
                   kernels={name[:40]: round(t * 1e6, 2) for name, t in by_kernel.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
  result = dict(device=jax.devices()[0].device_kind, rows=rows)
  if not args.plan_only:
    write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
