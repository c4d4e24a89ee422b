"""Session 48: what runs beside the sparse kernel in issue 3's B 8, S 16K, Tq 1, 1.6% cell.

Builds the cell exactly as `benchmarks/kernels.py` does (its Settings, block lists and queries),
writes the optimized HLO of one call and of kernels.py's timed loop around it, and profiles the
loop with the kernel sequence of one call. GPU only.

  PYTHONPATH=$PWD python benchmarks/results/s48/sparse_tq1_hlo.py $OUT [B] [fraction]
"""
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.getcwd())
from benchmarks import kernels as K                                    # noqa: E402
from benchmarks._timing import time_loop                               # noqa: E402

out_dir = sys.argv[1]
b = int(sys.argv[2]) if len(sys.argv) > 2 else 8
fraction = float(sys.argv[3]) if len(sys.argv) > 3 else 0.016
s, tq, block_size = 16384, 1, 64
st = K.Settings()
x = K.make_queries(st, b, tq, seed=1000 * b + tq)
k = K._normal(b * 7 + s, (b, st.hkv, s, st.d))
v = K._normal(b * 7 + s + 1, (b, st.hkv, s, st.d))
lst = K._listing(st, b, s, block_size, fraction, seed=s + 31 * b + tq)
lengths = jnp.full((b,), s, jnp.int32)
fn = K._sparse_fn(block_size, None, None)
args = (x["q"], jnp.int32(0), k, v, lst["sets"], lst["counts"], lengths, x["k_new"], x["v_new"],
        x["causal"])
tag = f"b{b}_f{fraction}"
compiled = jax.jit(fn).lower(*args).compile()
with open(os.path.join(out_dir, f"sparse_tq1_{tag}_call.hlo.txt"), "w") as f:
  f.write(compiled.as_text())

# The timed loop's body, as time_loop builds it (unroll 1 here, for a readable module).
callee = jax.jit(fn)
def loop(q, rest):
  def body(it, q):
    out = lax.optimization_barrier(callee(q, it, *rest))
    return jnp.where(out.reshape(-1)[0] == 12345.0, q + 1, q)
  return lax.fori_loop(0, 100, body, q)
rest = args[2:]
with open(os.path.join(out_dir, f"sparse_tq1_{tag}_loop.hlo.txt"), "w") as f:
  f.write(jax.jit(loop).lower(args[0], rest).compile().as_text())

t = time_loop(fn, x["q"], *rest, num_calls=4000, repeats=3, with_index=True, unroll=8,
              profile=True, profile_top=12)
from benchmarks._timing import device_time                             # noqa: E402
seq = device_time(lambda: jax.block_until_ready(jax.jit(loop)(args[0], rest)), 100, top=12,
                  sequence=16)
json.dump(dict(cell=dict(B=b, S=s, Tq=tq, fraction=fraction, listed=lst["listed"]),
               loop=t, unroll1_sequence=seq), open(os.path.join(out_dir, f"sparse_tq1_{tag}.json"), "w"),
          indent=1, default=str)
print(json.dumps(dict(t=t, seq=seq), indent=1, default=str))
