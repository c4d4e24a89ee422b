"""Session 51: decode_attention at 2 <= Tq (one q block) with the in-flight keys in split 0's
block of the cache kernel ("auto" now) against the in-flight kernel's two forms ("merged",
"kernel") and the combine's jnp ("jnp"); device us a call (kernels listed), wall us, and the
largest difference from the fp32 reference (GPU). Two cache copies in turn (no L2 reuse).

  PYTHONPATH=$PWD python benchmarks/results/s51/inflight_tile_ab.py $OUT/inflight_tile_ab.json
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import time_loop
from benchmarks.inflight_ab import D, HKV, HQ, arrays
from pallas_kernels import decode_attention as da

rows = []
for b, s, tq in ((1, 16384, 16), (1, 65536, 16), (1, 16384, 4), (1, 65536, 2), (1, 4096, 16),
                 (8, 16384, 16), (1, 131072, 16)):
  q, k, v, kn, vn = arrays(b, tq, HQ, HKV, D, s)
  _, k2, v2, _, _ = arrays(b, tq, HQ, HKV, D, s, seed=1)
  lengths = jnp.full((b,), s, jnp.int32)
  mask = jnp.tril(jnp.ones((tq, tq), bool))
  ref = jax.jit(da.decode_attention_reference)(
      *(x.astype(jnp.float32) for x in (q, k, v)), lengths,
      *(x.astype(jnp.float32) for x in (kn, vn)), mask)
  for mode in ("auto", "merged", "kernel", "jnp"):
    cfg = da.DecodeConfig(inflight=mode)
    fn = lambda q, k, v, cfg=cfg: da.decode_attention(q, k, v, lengths, kn, vn, mask, config=cfg)
    row = dict(B=b, S=s, Tq=tq, mode=mode,
               tiled=bool(da.in_kernel_tile(cfg, q, k, kn, vn, None)))
    try:
      out = jax.jit(fn)(q, k, v)
      row["max_err"] = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(ref))))
      r = time_loop(fn, q, k, v, rotate=[(k2, v2)], num_calls=max(64, int(8e9 // (4 * b * s * HKV * D))),
                    unroll=8, profile=True)
      kern = r.get("device_time_by_kernel", {})
      row.update(device_us=r.get("device_s", 0) * 1e6, us=r["min_s"] * 1e6,
                 kernels_per_call=r.get("kernels_per_call"),
                 kernels={k_[:40]: round(t * 1e6, 2) for k_, t in kern.items()})
    except Exception as e:                                     # noqa: BLE001
      row["error"] = repr(e)[:300]
    print(json.dumps(row), flush=True)
    rows.append(row)
  json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), open(sys.argv[1], "w"), indent=1)
