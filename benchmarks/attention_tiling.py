"""Tiling A/B for decode_attention and sparse_attention on the GPU: each case timed under each
named config in one run (profiler device time per call, calls chained inside one jit).

  PYTHONPATH=. python benchmarks/attention_tiling.py --out $OUT/attention_tiling.json

Configs: "default" (what the kernels pick: DecodeConfig.resolve, SparseConfig.slots) and
"one_per_sm" (128-key tiles where the block size allows, one thread block per SM: the tiling
before two blocks per SM); for decode with Tq * G <= 64 also deeper K/V rings. Shapes: Llama-3.1-8B attention (Hq 32, Hkv 8, D 128, bf16), B = 1 and
8. The sparse cases are FAFO's step (a 1K-slot StreamingLLM region of 64-slot blocks for the
fumble queries, then the verification queries on the full cache) and a Quest-like Tq = 1 read of
1.6% of the blocks.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import default_out_dir, read_bandwidth, time_loop, write_json
from pallas_kernels.decode_attention import DecodeConfig, decode_attention
from pallas_kernels.sparse_attention import SparseConfig, sparse_attention

HQ, HKV, D = 32, 8, 128
DECODE_CASES = ((1, 16384, 1), (1, 65536, 1), (1, 16384, 16), (1, 32768, 32), (1, 32768, 43),
                (1, 16384, 64), (1, 65536, 64), (1, 65536, 256), (8, 16384, 16), (8, 16384, 64))
# (B, S, Tq, list queries, listed 64-slot blocks)
SPARSE_CASES = ((1, 4096, 283, 240, 16), (1, 32768, 283, 240, 16), (1, 32768, 108, 84, 16),
                (1, 16384, 1, 1, 4), (8, 16384, 1, 1, 4))
BLOCK_SIZE = 64
DECODE_CONFIGS = {"default": DecodeConfig(),
                  "one_per_sm": DecodeConfig(block_kv=128, target_blocks=132)}
# Deeper K/V rings, tried on the narrow (Tq * G <= 64) decode cases only: more bytes in flight
# during the ramp (128-key tiles with 3 stages exceed the SMEM by 1 KiB; 64-key tiles with 6
# stages take 216 KiB).
NARROW_CONFIGS = {"bk64_4_stages": DecodeConfig(block_kv=64, num_stages=4, target_blocks=132),
                  "bk64_6_stages": DecodeConfig(block_kv=64, num_stages=6, target_blocks=132)}
SPARSE_CONFIGS = {"default": SparseConfig(), "one_per_sm": SparseConfig(target_blocks=132)}


def inputs(b: int, s: int, tq: int, seed: int):
  """Random bf16 q [B, Tq, Hq, D], k, v [B, Hkv, S, D], k_new, v_new [B, Tq, Hkv, D]."""
  ks = jax.random.split(jax.random.key(seed), 5)
  k = jax.random.normal(ks[0], (b, HKV, s, D), jnp.bfloat16)
  v = jax.random.normal(ks[1], (b, HKV, s, D), jnp.bfloat16)
  q = jax.random.normal(ks[2], (b, tq, HQ, D), jnp.bfloat16)
  kn = jax.random.normal(ks[3], (b, tq, HKV, D), jnp.bfloat16)
  vn = jax.random.normal(ks[4], (b, tq, HKV, D), jnp.bfloat16)
  return q, k, v, kn, vn


def streaming_tables(b: int, s: int, n_blocks: int):
  """A StreamingLLM-like list of 64-slot blocks, the first and the last n_blocks - 1, for every
  (row, KV head): tables [B, Hkv, n_blocks] int32, counts [B, Hkv] int32."""
  ids = np.r_[0, np.arange(s // BLOCK_SIZE - n_blocks + 1, s // BLOCK_SIZE)]
  tables = jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (b, HKV, n_blocks))
  return tables, jnp.full((b, HKV), n_blocks, jnp.int32)


def _time(fn, q, k, v, nbytes: float, bw: float) -> dict:
  t = time_loop(fn, q, k, v, num_calls=max(20, int(2e9 / max(nbytes, 1e6))), profile=True,
                unroll=4)
  dev = t.get("device_s")
  mosaic = t.get("device_time_by_kernel", {}).get("entry_mosaic_gpu_kernel")
  return dict(call_us=t["min_s"] * 1e6, device_us=dev * 1e6 if dev else None,
              mosaic_us=mosaic * 1e6 if mosaic else None,
              kernels_per_call=t.get("kernels_per_call"),
              frac_read_bw=nbytes / dev / bw if dev else None)


def _rows(bw: float):
  for b, s, tq in DECODE_CASES:
    q, k, v, kn, vn = inputs(b, s, tq, s + tq)
    lengths = jnp.full((b,), s, jnp.int32)
    mask = jnp.tril(jnp.ones((tq, tq), bool))
    ref = None
    configs = dict(DECODE_CONFIGS, **(NARROW_CONFIGS if tq * HQ // HKV <= 64 else {}))
    for name, cfg in configs.items():
      f = functools.partial(decode_attention, config=cfg)
      row = dict(kernel="decode", B=b, S=s, Tq=tq, config=name)
      try:
        out = jax.jit(f)(q, k, v, lengths, kn, vn, mask).astype(jnp.float32)
        ref = out if ref is None else ref
        row.update(max_abs_diff_vs_first=float(jnp.abs(out - ref).max()),
                   **_time(lambda q_, k_, v_: f(q_, k_, v_, lengths, kn, vn, mask), q, k, v,
                           2 * k.nbytes, bw))
      except Exception as e:  # noqa: BLE001  (a config that does not compile is a result too)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      print(row, flush=True)
      yield row
    del k, v
  for b, s, tq, n_list, n_blocks in SPARSE_CASES:
    q, k, v, kn, vn = inputs(b, s, tq, s + tq + 1)
    lengths = jnp.full((b,), s, jnp.int32)
    tables, counts = streaming_tables(b, s, n_blocks)
    mask = jnp.tril(jnp.ones((tq, tq), bool))
    listed = 2 * k.nbytes * n_blocks * BLOCK_SIZE / s
    nbytes = listed if n_list == tq else 2 * k.nbytes + listed
    ref = None
    for name, cfg in SPARSE_CONFIGS.items():
      f = functools.partial(sparse_attention, block_size=BLOCK_SIZE, sparse_queries=n_list,
                            config=cfg)
      out = jax.jit(f)(q, k, v, tables, counts, lengths, kn, vn, mask).astype(jnp.float32)
      ref = out if ref is None else ref
      row = dict(kernel="sparse", B=b, S=s, Tq=tq, list_queries=n_list, listed_blocks=n_blocks,
                 config=name, max_abs_diff_vs_first=float(jnp.abs(out - ref).max()),
                 **_time(lambda q_, k_, v_: f(q_, k_, v_, tables, counts, lengths, kn, vn, mask),
                         q, k, v, nbytes, bw))
      print(row, flush=True)
      yield row
    del k, v


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=os.path.join(default_out_dir(), "attention_tiling.json"))
  args = p.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit("attention_tiling.py times Mosaic GPU kernels: it needs a GPU")
  bw = read_bandwidth()["gb_per_s"] * 1e9
  result = dict(device=jax.devices()[0].device_kind, read_bw_gb_per_s=bw / 1e9, rows=[])
  for row in _rows(bw):
    result["rows"].append(row)
    write_json(args.out, result)


if __name__ == "__main__":
  main()
