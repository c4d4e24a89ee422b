"""Where the time of FAFO's attention call goes (GPU): per-kernel device time of one
`sparse_attention` call at Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128, bf16, B = 1; 240 fumble
queries on a 16-block StreamingLLM list of 64-slot blocks + 43 verification queries on the full
cache, T = 283, causal in-flight mask), beside `decode_attention` for the 43 full-cache queries
alone, and the sparse call under other split counts of its two segments (`num_splits` for the
list, `num_splits_full` for the full cache; the default is `pallas_kernels.split_plan`'s).
The profiler names every Mosaic GPU kernel `entry_mosaic_gpu_kernel`: the sparse kernel and the
in-flight kernel are summed under it.

  PYTHONPATH=. python benchmarks/fafo_attention_profile.py --out $OUT/fafo_attention_profile.json
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp

from benchmarks._timing import default_out_dir, time_loop, write_json
from benchmarks.attention_tiling import BLOCK_SIZE, inputs, streaming_tables
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.sparse_attention import SparseConfig, sparse_attention

N_LIST, N_BLOCKS, TQ = 240, 16, 283
CONFIGS = {"default": SparseConfig(), "list_splits_2": SparseConfig(num_splits=2),
           "list_splits_4": SparseConfig(num_splits=4),
           "list_1_full_13": SparseConfig(num_splits=1, num_splits_full=13),
           "list_4_full_54": SparseConfig(num_splits=4, num_splits_full=54)}


def _profile(fn, q, k, v) -> dict:
  t = time_loop(fn, q, k, v, num_calls=200, profile=True, unroll=4)
  by_kernel = {name: round(s * 1e6, 2) for name, s in
               sorted(t.get("device_time_by_kernel", {}).items(), key=lambda kv: -kv[1])}
  return dict(call_us=t["min_s"] * 1e6, device_us=t["device_s"] * 1e6,
              kernels_per_call=t.get("kernels_per_call"), device_us_by_kernel=by_kernel)


def _rows(contexts):
  for s in contexts:
    q, k, v, kn, vn = inputs(1, s, TQ, s)
    lengths = jnp.full((1,), s, jnp.int32)
    tables, counts = streaming_tables(1, s, N_BLOCKS)
    mask = jnp.tril(jnp.ones((TQ, TQ), bool))
    n_full = TQ - N_LIST
    fkn, fvn = kn[:, N_LIST:], vn[:, N_LIST:]
    fmask = mask[N_LIST:, N_LIST:]
    row = dict(case="decode_full_queries_only", S=s, Tq=n_full)
    row.update(_profile(lambda q_, k_, v_: decode_attention(q_[:, N_LIST:], k_, v_, lengths,
                                                            fkn, fvn, fmask), q, k, v))
    print(row, flush=True)
    yield row
    ref = None
    for name, cfg in CONFIGS.items():
      f = functools.partial(sparse_attention, block_size=BLOCK_SIZE, sparse_queries=N_LIST,
                            config=cfg)
      row = dict(case="sparse_fafo", S=s, Tq=TQ, config=name)
      try:
        out = jax.jit(f)(q, k, v, tables, counts, lengths, kn, vn, mask).astype(jnp.float32)
        ref = out if ref is None else ref
        row["max_abs_diff_vs_default"] = float(jnp.abs(out - ref).max())
        row.update(_profile(lambda q_, k_, v_: f(q_, k_, v_, tables, counts, lengths, kn, vn,
                                                 mask), q, k, v))
      except Exception as e:  # noqa: BLE001  (a config that fails is a result too)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      print(row, flush=True)
      yield row
    del k, v


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
  p.add_argument("--out", default=os.path.join(default_out_dir(), "fafo_attention_profile.json"))
  args = p.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit("fafo_attention_profile.py times Mosaic GPU kernels: it needs a GPU")
  result = dict(device=jax.devices()[0].device_kind, rows=[])
  for row in _rows(args.contexts):
    result["rows"].append(row)
    write_json(args.out, result)


if __name__ == "__main__":
  main()
