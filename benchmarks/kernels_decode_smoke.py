"""GPU smoke test and timing of the Mosaic GPU decode-attention kernel (H100 / H200).

Checks `pallas_kernels.decode_attention.decode_attention` against its jnp reference on random
bf16 data (Hq=32, Hkv=8, D=128; ragged lengths, lengths 0, Tq in {1, 16}), then times it at B=1,
S in {4K, 16K, 64K}, Tq in {1, 16} (full cache) next to the jnp reference under XLA and
`jax.nn.dot_product_attention` (xla and cudnn; cache part only, cache pre-transposed to BSHD).
Each timing runs many calls inside one jit (lax.fori_loop with a data dependency between calls).
Reports time per call, the bytes that must be read (K + V of the valid length), achieved GB/s and
the device's read bandwidth measured in the same run (jnp.sum over a ~4 GiB bf16 array).

Writes JSON to $OUT/kernels_decode_smoke.json (or benchmarks/results/ when $OUT is unset).
Run: PYTHONPATH=$PWD python3 benchmarks/kernels_decode_smoke.py
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks._timing import default_out_dir, max_abs_err, read_bandwidth, time_loop
from pallas_kernels.decode_attention import (DecodeConfig, decode_attention,
                                             decode_attention_reference, split_partials)

HQ, HKV, D = 32, 8, 128
CAPACITIES = (16384, 65536)
NUM_QUERIES = (1, 16)
KERNEL_CONFIGS = {
    "default": DecodeConfig(),                  # resolved per call (DecodeConfig.resolve)
    "bkv128_st2_132_min1": DecodeConfig(block_kv=128, num_stages=2, min_tiles_per_split=1),
    "bkv128_st2_264_min1": DecodeConfig(block_kv=128, num_stages=2, target_blocks=264,
                                        min_tiles_per_split=1),
    "bkv64_st4_132": DecodeConfig(block_kv=64, num_stages=4, target_blocks=132),
    "bkv64_st4_264_min1": DecodeConfig(block_kv=64, num_stages=4, target_blocks=264,
                                       min_tiles_per_split=1),
}
TARGET_BYTES_PER_TIMING = 6e9        # bytes read per timed loop (sets the call count)
TOL = 3e-2


def _out_path() -> str:
  return os.path.join(default_out_dir(), "kernels_decode_smoke.json")


def _inputs(seed, b, tq, s):
  keys = jax.random.split(jax.random.key(seed), 5)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
  return dict(
      q=normal(keys[0], (b, tq, HQ, D)),                  # [B, Tq, Hq, D]
      k_cache=normal(keys[1], (b, HKV, s, D)),            # [B, Hkv, S, D]
      v_cache=normal(keys[2], (b, HKV, s, D)),            # [B, Hkv, S, D]
      k_new=normal(keys[3], (b, tq, HKV, D)),             # [B, Tq, Hkv, D]
      v_new=normal(keys[4], (b, tq, HKV, D)),             # [B, Tq, Hkv, D]
      inflight_mask=jnp.tril(jnp.ones((tq, tq), bool)),   # [Tq, Tq]
  )


def _kernel_fn(config):
  return jax.jit(functools.partial(decode_attention, return_lse=True, config=config))


def _time_loop(fn, x, *rest, num_calls: int, repeats: int = 3) -> float:
  """Seconds per call (min over repeats) of fn(x, *rest), num_calls calls inside one jit."""
  return time_loop(fn, x, *rest, num_calls=num_calls, repeats=repeats)["min_s"]


def _correctness(results: dict):
  """Ragged rows (0, partial tile, full), both Tq, every kernel config, vs the bf16 reference."""
  checks = []
  s = 4096
  lengths = jnp.array([0, 777, s], jnp.int32)
  ref_fn = jax.jit(functools.partial(decode_attention_reference, return_lse=True))
  for tq in NUM_QUERIES:
    x = _inputs(1, 3, tq, s)
    args = (x["q"], x["k_cache"], x["v_cache"], lengths, x["k_new"], x["v_new"],
            x["inflight_mask"])
    ref_out, ref_lse = ref_fn(*args)
    for name, config in KERNEL_CONFIGS.items():
      entry = dict(case=f"B=3 S={s} Tq={tq} lengths=[0,777,{s}]", config=name)
      try:
        out, lse = _kernel_fn(config)(*args)
        entry.update(max_abs_err_out=max_abs_err(out, ref_out),
                     max_abs_err_lse=max_abs_err(lse, ref_lse))
        entry["ok"] = bool(entry["max_abs_err_out"] < TOL and entry["max_abs_err_lse"] < 1e-2)
      except Exception as e:                                             # noqa: BLE001
        entry.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        traceback.print_exc()
      print(entry, flush=True)
      checks.append(entry)
  results["correctness"] = checks


def _timings(results: dict, out_path: str):
  rows = []
  results["timings"] = rows
  ref_fn = jax.jit(decode_attention_reference)
  for s in CAPACITIES:
    for tq in NUM_QUERIES:
      x = _inputs(2, 1, tq, s)
      lengths = jnp.array([s], jnp.int32)
      valid_bytes = 2 * 1 * HKV * s * D * 2                  # K + V of the valid length, bf16
      num_calls = int(min(2000, max(10, TARGET_BYTES_PER_TIMING // valid_bytes)))
      args = (x["k_cache"], x["v_cache"], lengths, x["k_new"], x["v_new"], x["inflight_mask"])
      ref_out = ref_fn(x["q"], *args)
      base = dict(B=1, S=s, Tq=tq, Hq=HQ, Hkv=HKV, D=D, length=s, bytes=valid_bytes,
                  num_calls=num_calls)

      def record(impl, fn, *fn_args, check=None):
        entry = dict(base, impl=impl)
        try:
          if check is not None:
            entry["max_abs_err_vs_reference"] = check()
          sec = _time_loop(fn, *fn_args, num_calls=num_calls)
          entry.update(us_per_call=sec * 1e6, gb_per_s=valid_bytes / sec / 1e9,
                       fraction_of_read_bw=valid_bytes / sec / 1e9
                       / results["read_bandwidth"]["gb_per_s"])
        except Exception as e:                                           # noqa: BLE001
          entry["error"] = f"{type(e).__name__}: {e}"[:2000]
          traceback.print_exc()
        print(entry, flush=True)
        rows.append(entry)
        with open(out_path, "w") as f:
          json.dump(results, f, indent=1)

      for name, config in KERNEL_CONFIGS.items():
        kfn = _kernel_fn(config)
        record(f"mosaic_gpu_kernel[{name}]", kfn, x["q"], *args,
               check=lambda kfn=kfn: max_abs_err(kfn(x["q"], *args)[0], ref_out))
      # Step 1 alone (q packing + the Mosaic GPU kernel, no combine): the glue's share.
      record("mosaic_gpu_split_partials_only[default]",
             jax.jit(functools.partial(split_partials, config=DecodeConfig())),
             x["q"], x["k_cache"], x["v_cache"], lengths)
      record("jnp_reference_xla", ref_fn, x["q"], *args)

      # Cache part only: no in-flight tokens (the reference with an all-False in-flight mask).
      k_bshd = jnp.swapaxes(x["k_cache"], 1, 2)               # [B, S, Hkv, D], outside the loop
      v_bshd = jnp.swapaxes(x["v_cache"], 1, 2)
      no_inflight = jnp.zeros((tq, tq), bool)
      cache_ref = ref_fn(x["q"], x["k_cache"], x["v_cache"], lengths, x["k_new"], x["v_new"],
                         no_inflight)
      for impl in ("xla", "cudnn"):
        dpa = jax.jit(lambda q, k, v, lens, impl=impl: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lens, implementation=impl))
        record(f"jax.nn.dot_product_attention[{impl}] (cache only)", dpa, x["q"], k_bshd,
               v_bshd, lengths,
               check=lambda dpa=dpa: max_abs_err(dpa(x["q"], k_bshd, v_bshd, lengths), cache_ref))
      del x, k_bshd, v_bshd


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="JSON path (default $OUT/kernels_decode_smoke.json, "
                                               "else benchmarks/results/)")
  args = ap.parse_args(argv)
  if jax.default_backend() != "gpu":
    sys.exit(f"kernels_decode_smoke.py times the compiled kernel and needs a GPU backend, not "
             f"{jax.default_backend()!r} (nothing written)")
  out_path = args.out or _out_path()
  t_start = time.time()
  dev = jax.devices()[0]
  results = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                 kernel_configs={k: dataclasses.asdict(v) for k, v in KERNEL_CONFIGS.items()})
  print(results, flush=True)
  results["read_bandwidth"] = read_bandwidth(2 ** 32)
  print("read bandwidth", results["read_bandwidth"], flush=True)
  _correctness(results)
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1)
  _timings(results, out_path)
  results["total_seconds"] = time.time() - t_start
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1)
  print("wrote", out_path, f"in {results['total_seconds']:.1f} s")
  ok = all(c.get("ok") for c in results["correctness"])
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
