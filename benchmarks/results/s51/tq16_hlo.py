"""Session 51: the optimized HLO of decode_attention at B 1, Tq 16 (one q block, the in-flight
tile) and the per-call kernel list, to see the combine's fusions (GPU; run with
XLA_FLAGS=--xla_dump_to=$OUT/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*)."""
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks._timing import time_loop
from benchmarks.inflight_ab import D, HKV, HQ, arrays
from pallas_kernels import decode_attention as da

s, tq = 16384, 16
q, k, v, kn, vn = arrays(1, tq, HQ, HKV, D, s)
lengths = jnp.full((1,), s, jnp.int32)
mask = jnp.tril(jnp.ones((tq, tq), bool))
fn = jax.jit(lambda q, k, v, kn, vn, mask: da.decode_attention(q, k, v, lengths, kn, vn, mask))
print(fn.lower(q, k, v, kn, vn, mask).compile().as_text()[:200000], file=open(sys.argv[1], "w"))
r = time_loop(lambda q, k, v: fn(q, k, v, kn, vn, mask), q, k, v, num_calls=64, unroll=8,
              profile=True, profile_top=12)
print(json.dumps({k_: v_ for k_, v_ in r.items()
                  if k_ in ("device_s", "kernels_per_call", "device_time_by_kernel")},
                 default=str))
