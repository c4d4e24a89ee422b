"""Session 49: decode_attention's split count at B 1 (the read-bandwidth misses of issue 3: 16K
Tq 1 / 16, 64K Tq 16) swept around the planner's choice, 64- and 128-key tiles, device us a
call with the kernel / combine split (GPU).

  PYTHONPATH=$PWD python benchmarks/results/s49/decode_splits.py $OUT/decode_splits.json
"""
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks._timing import time_loop
from benchmarks.inflight_ab import D, HKV, HQ, arrays
from pallas_kernels import decode_attention as da

rows = []
for s, tq, splits in ((16384, 1, (None, 4, 8, 12, 24, 32)), (16384, 16, (None, 8, 16, 24, 48)),
                      (65536, 16, (None, 16, 24, 48, 64)), (65536, 1, (None, 8, 32))):
  q, k, v, kn, vn = arrays(1, tq, HQ, HKV, D, s)
  lengths = jnp.full((1,), s)
  mask = jnp.tril(jnp.ones((tq, tq), bool))
  for block_kv in (None, 64):
    for n in splits:
      cfg = da.DecodeConfig(num_splits=n, block_kv=block_kv)
      fn = jax.jit(lambda q, k, v, kn, vn, cfg=cfg: da.decode_attention(
          q, k, v, lengths, kn, vn, mask, config=cfg))
      try:
        r = time_loop(fn, q, k, v, kn, vn, num_calls=240, unroll=8, profile=True)
      except Exception as e:                                   # noqa: BLE001
        print(json.dumps(dict(S=s, Tq=tq, splits=n, block_kv=block_kv, error=str(e)[:200])))
        continue
      resolved = cfg.resolve(-(-tq * HQ // HKV // 64), s, D)
      chosen = n or da._pick_num_splits(resolved, 1, HKV, -(-tq * HQ // HKV // 64), s, D)
      kern = r.get("device_time_by_kernel", {})
      row = dict(S=s, Tq=tq, splits=n, chosen=chosen, block_kv=resolved.block_kv,
                 device_us=r.get("device_s", 0) * 1e6, us=r["min_s"] * 1e6,
                 kernel_us=sum(t for k_, t in kern.items() if "decode_attention" in k_) * 1e6,
                 kernels={k_[:32]: round(t * 1e6, 2) for k_, t in kern.items()})
      print(json.dumps(row), flush=True)
      rows.append(row)
json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), open(sys.argv[1], "w"), indent=1)
