"""Session 52: sparse_attention at 2 <= Tq with one segment of one q block, the in-flight keys in
work item 0's block of the cache kernel ("auto" where `tile_fits`; "tile" here forces it past
`tile_fits` by patching it) against the in-flight kernel ("merged", "kernel"). Device us a call
(kernels listed), wall us, largest difference from the fp32 reference. The listed blocks change
every call (`with_index`: one of N disjoint lists), so no call reads what the last one did.

  PYTHONPATH=$PWD python benchmarks/results/s52/sparse_tile_ab.py $OUT/sparse_tile_ab.json
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import time_loop
from benchmarks.inflight_ab import D, HKV, HQ, arrays
from benchmarks.kernels import random_table_sets
from pallas_kernels import decode_attention as da
from pallas_kernels import sparse_attention as sa

fits = da.tile_fits
rows = []
for b, s, tq, block_size, frac in ((1, 16384, 16, 64, 0.016), (1, 16384, 4, 64, 0.016),
                                   (8, 16384, 16, 64, 0.016), (1, 16384, 16, 128, 0.016),
                                   (1, 16384, 16, 64, 0.0625), (1, 65536, 16, 64, 0.25)):
  q, k, v, kn, vn = arrays(b, tq, HQ, HKV, D, s)
  lengths = jnp.full((b,), s, jnp.int32)
  mask = jnp.tril(jnp.ones((tq, tq), bool))
  cache_blocks = s // block_size
  listed = max(1, round(frac * cache_blocks))
  sets = random_table_sets(s + b + tq, b, HKV, cache_blocks, listed)      # [N, B, Hkv, NB]
  counts = jnp.full((b, HKV), listed, jnp.int32)
  ref = jax.jit(sa.sparse_attention_reference, static_argnames=("block_size",))(
      *(x.astype(jnp.float32) for x in (q, k, v)), sets[0], counts, lengths,
      *(x.astype(jnp.float32) for x in (kn, vn)), mask, block_size=block_size)
  for mode in ("auto", "tile", "merged", "kernel"):
    cfg = sa.SparseConfig(inflight="auto" if mode == "tile" else mode)
    jax.clear_caches()          # "tile" and "auto" are the same static config: trace again
    da.tile_fits = (lambda *a: True) if mode == "tile" else fits
    def fn(q, it, k, v, sets, cfg=cfg):
      table = sets[it % sets.shape[0]]
      return sa.sparse_attention(q, k, v, table, counts, lengths, kn, vn, mask,
                                 block_size=block_size, config=cfg)
    layout = sa._layout(q.shape, k.shape, listed, block_size=block_size, sparse_queries=tq,
                        config=cfg, num_score_queries=(0, 0), interpret=False)
    row = dict(B=b, S=s, Tq=tq, block_size=block_size, listed=listed, mode=mode,
               tiled=bool(sa.in_kernel_tile(cfg, q, kn, vn, layout, block_size)))
    try:
      out = jax.jit(lambda q, k, v, t: sa.sparse_attention(
          q, k, v, t, counts, lengths, kn, vn, mask, block_size=block_size, config=cfg))(
              q, k, v, sets[0])
      row["max_err"] = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(ref))))
      r = time_loop(fn, q, k, v, sets, num_calls=256, unroll=8, with_index=True, profile=True)
      kern = r.get("device_time_by_kernel", {})
      row.update(device_us=r.get("device_s", 0) * 1e6, us=r["min_s"] * 1e6,
                 kernels_per_call=r.get("kernels_per_call"),
                 kernels={k_[:40]: round(t * 1e6, 2) for k_, t in kern.items()})
    except Exception as e:                                     # noqa: BLE001
      row["error"] = repr(e)[:400]
    da.tile_fits = fits
    print(json.dumps(row), flush=True)
    rows.append(row)
  json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), open(sys.argv[1], "w"), indent=1)
