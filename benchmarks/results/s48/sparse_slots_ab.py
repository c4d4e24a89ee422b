"""Session 48: sparse_attention's split plan with one place per SM (`SparseConfig(target_blocks=
SM_COUNT)`) against the default (two resident plain blocks an SM), S = 16K, Llama-3.1-8B heads,
4 and 16 listed 64-slot blocks, B 1 / 8, Tq 1 / 16 / 64, device us a call (GPU).

  PYTHONPATH=$PWD python benchmarks/results/s48/sparse_slots_ab.py $OUT/sparse_slots_ab.json
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import time_loop
from benchmarks.inflight_ab import D, HKV, HQ, arrays
from pallas_kernels.hopper import SM_COUNT
from pallas_kernels.sparse_attention import SparseConfig, sparse_attention

S = 16384
rows = []
for b in (8, 1):
  for tq in (1, 16, 64):
    q, k, v, kn, vn = arrays(b, tq, HQ, HKV, D, S)
    lengths = jnp.full((b,), S)
    mask = jnp.tril(jnp.ones((tq, tq), bool))
    for listed in (4, 16):
      blocks = np.linspace(0, S // 64 - 1, listed).astype(np.int32)
      tables = jnp.broadcast_to(jnp.asarray(blocks), (b, HKV, listed))
      counts = jnp.full((b, HKV), listed, jnp.int32)
      outs = {}
      for name, cfg in (("default", SparseConfig()),
                        ("one_per_sm", SparseConfig(target_blocks=SM_COUNT))):
        fn = jax.jit(lambda q, k, v, kn, vn, cfg=cfg: sparse_attention(
            q, k, v, tables, counts, lengths, kn, vn, mask, block_size=64, config=cfg))
        outs[name] = fn(q, k, v, kn, vn)
        r = time_loop(fn, q, k, v, kn, vn, num_calls=400, unroll=8, profile=True)
        row = dict(B=b, Tq=tq, listed=listed, plan=name, us=r["min_s"] * 1e6,
                   device_us=r.get("device_s", 0) * 1e6,
                   kernels={n[:30]: round(s * 1e6, 2)
                            for n, s in r.get("device_time_by_kernel", {}).items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
      rows[-1]["out_max_diff"] = float(jnp.max(jnp.abs(
          outs["default"].astype(jnp.float32) - outs["one_per_sm"].astype(jnp.float32))))
json.dump(dict(device=str(jax.devices()[0]), rows=rows), open(sys.argv[1], "w"), indent=1)
