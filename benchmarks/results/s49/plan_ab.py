"""Session 49: the split plans `plan_diff.py` finds changed by the per-SM planner model, timed
against the slots model's plans on the GPU (explicit `SparseConfig(num_splits=,
num_splits_full=)`; the two plans interleaved, each timed `REPEATS` times), device us a call.

  PYTHONPATH=$PWD python benchmarks/results/s49/plan_ab.py benchmarks/results/s49/plan_diff.json \
      $OUT/plan_ab.json
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import time_loop
from benchmarks.inflight_ab import arrays
from pallas_kernels.sparse_attention import SparseConfig, sparse_attention

REPEATS = 2
cells = json.load(open(sys.argv[1]))["changed"]
rows = []
for cell in cells:
  b, s, tq, listed = cell["b"], cell["s"], cell["tq"], cell["listed"]
  hq, hkv, d = cell.get("hq", 32), cell.get("hkv", 8), cell.get("d", 128)
  sq = cell.get("sparse_queries", tq)
  q, k, v, kn, vn = arrays(b, tq, hq, hkv, d, s)
  lengths = jnp.full((b,), s)
  mask = jnp.tril(jnp.ones((tq, tq), bool))
  blocks = np.linspace(0, s // 64 - 1, listed).astype(np.int32)
  tables = jnp.broadcast_to(jnp.asarray(blocks), (b, hkv, listed))
  counts = jnp.full((b, hkv), listed, jnp.int32)
  fns, outs = {}, {}
  for name in ("slots_model", "sm_model"):
    plan = tuple(cell[name])
    cfg = SparseConfig(num_splits=plan[0] if sq else None,
                       num_splits_full=plan[-1] if sq < tq else None)
    fns[name] = jax.jit(lambda q, k, v, kn, vn, cfg=cfg: sparse_attention(
        q, k, v, tables, counts, lengths, kn, vn, mask, block_size=64, sparse_queries=sq,
        config=cfg))
    outs[name] = fns[name](q, k, v, kn, vn)
  diff = float(jnp.max(jnp.abs(outs["slots_model"].astype(jnp.float32)
                               - outs["sm_model"].astype(jnp.float32))))
  for rep in range(REPEATS):
    for name, fn in fns.items():
      r = time_loop(fn, q, k, v, kn, vn, num_calls=400, unroll=8, profile=True)
      kernels = r.get("device_time_by_kernel", {})
      row = dict(cell, plan=name, splits=cell[name], rep=rep, us=r["min_s"] * 1e6,
                 device_us=r.get("device_s", 0) * 1e6,
                 sparse_kernel_us=sum(t for n, t in kernels.items() if "sparse" in n) * 1e6,
                 out_max_diff=diff)
      print(json.dumps(row), flush=True)
      rows.append(row)
json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), open(sys.argv[2], "w"), indent=1)
