"""Issue 3's Tq = 1 sparse cell (S = 16K, 4 listed 64-slot blocks, Llama-3.1-8B heads) under
other launch plans, in one run (GPU): split counts (the planner's, 1, 2, 4) x in-flight modes
("auto": the cache kernel's q . k_new, the combine's jnp term; "jnp": the combine's einsum;
"merged": the in-flight kernel merges the splits) x ring depths (2, 4), at B 8 and B 1; wall and
device us per call, the costliest kernels, and how far each output moves from the first plan's.

  python benchmarks/sparse_tq1_plans.py --out $OUT/sparse_tq1_plans.json
  python benchmarks/sparse_tq1_plans.py --batches 8 --modes auto --stages 2   # a subset

Session 35's figures (H200): `results/s35/sparse_tq1_plans_s35_h200.json`; session 48's ("auto",
B 8): `results/s48/sparse_tq1_plans_auto_s48_h200.json`. Those runs read one block list in every
call, so at B 8 most calls' 8.5 MB came from L2 (session 53); since session 54 every call reads
its own random list (`kernels.random_table_sets`, the lists together cover the cache) from one of
two cache copies in turn, as issue 3's grid does.
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
from benchmarks.inflight_ab import D, HKV, HQ, arrays
from benchmarks.kernels import _pick, random_table_sets
from pallas_kernels.sparse_attention import SparseConfig, sparse_attention

CAPACITY = 16384
BLOCK_SIZE = 64
LISTED = 4                        # 4 of 256 blocks of 64 slots: 1.6%


def plan_rows(batch: int, modes=("jnp", "merged"), stage_counts=(2, 4)) -> list[dict]:
  """Every plan of one batch size, timed; the first plan's output is the comparison's."""
  q, k, v, kn, vn = arrays(batch, 1, HQ, HKV, D, CAPACITY)
  k2, v2 = k + 1, v - 1                                 # a second cache copy, read in turn
  lengths = jnp.full((batch,), CAPACITY)
  sets = random_table_sets(batch, batch, HKV, CAPACITY // BLOCK_SIZE, LISTED)  # [N, B, Hkv, 4]
  counts = jnp.full((batch, HKV), LISTED, jnp.int32)
  mask = jnp.ones((1, 1), bool)
  rows, first = [], None
  for splits in (None, 1, 2, 4):
    for mode in modes:
      for stages in stage_counts:
        cfg = SparseConfig(inflight=mode, num_splits=splits, num_stages=stages)
        fn = jax.jit(lambda q, it, k, v, sets, kn, vn, cfg=cfg: sparse_attention(
            q, k, v, _pick(sets, it), counts, lengths, kn, vn, mask, block_size=BLOCK_SIZE,
            config=cfg))
        row = dict(B=batch, splits=splits, mode=mode, stages=stages)
        out = fn(q, 0, k, v, sets, kn, vn)
        first = out if first is None else first
        r = time_loop(fn, q, k, v, sets, kn, vn, rotate=[(k2, v2, sets, kn, vn)],
                      with_index=True, num_calls=800, unroll=8, profile=True)
        row.update(us=r["min_s"] * 1e6, device_us=r.get("device_s", 0) * 1e6,
                   out_max_diff=float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                                      - first.astype(jnp.float32)))),
                   kernels={name[:30]: round(s * 1e6, 2)
                            for name, s in r.get("device_time_by_kernel", {}).items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                               "sparse_tq1_plans.json"))
  p.add_argument("--batches", type=int, nargs="+", default=[8, 1])
  p.add_argument("--modes", nargs="+", default=["auto", "jnp", "merged"],
                 choices=["auto", "jnp", "merged", "kernel"])
  p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
  args = p.parse_args(argv)
  rows = [row for batch in args.batches for row in plan_rows(batch, args.modes, args.stages)]
  write_json(args.out, dict(device=str(jax.devices()[0]), rows=rows))


if __name__ == "__main__":
  main()
