"""Timing helpers shared by the GPU kernel benchmarks (kernels.py, kernels_decode_smoke.py).

`time_loop` runs many calls inside one jit: a lax.fori_loop whose carry (the first argument, e.g.
q) depends on each call's output, so no call is hoisted, dropped or sliced and no Python
dispatch sits between calls. Where the call's (first) output has the carry's shape and dtype (an
attention call's out and q) that output is the next call's carry; elsewhere a select on the
output's first element makes the dependency (see `time_loop`'s `chain`). `read_bandwidth`
measures the device's read bandwidth the same way (a fused elementwise + reduction over a
multi-GiB bf16 array).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_SENTINEL = 12345.0           # an output value that never occurs: the dependency is never taken
CHAINS = ("auto", "output", "select")


def time_loop(fn: Callable, x: jax.Array, *rest: Any, num_calls: int, repeats: int = 3,
              rotate: Sequence[tuple] = (), with_index: bool = False, unroll: int = 1,
              profile: bool = False, profile_top: int = 6, chain: str = "auto") -> dict:
  """Seconds per call of fn(x, *rest), calls chained inside one jit.

  rotate: further argument tuples (copies of the large arrays) used in turn with `rest`, so that
    consecutive calls read different buffers and do not hit in L2; the loop body calls fn once per
    argument tuple (statically unrolled).
  unroll: the loop body repeats that `unroll` times. Each iteration of an XLA:GPU while loop copies
    its predicate to the host, which drains the GPU's queue; unrolling spreads that stall (the
    loop's own per-call cost is measured and reported by the callers) over more calls.
  num_calls is rounded up to a multiple of unroll * (1 + len(rotate)).
  with_index: call fn(x, it, *rest) with `it` the call's repetition number, iteration * unroll +
    repetition (int32 scalar; the same for the argument tuples of one repetition, different
    between the `unroll` repetitions of an iteration), e.g. to pick one of several block tables.
  profile: also run the loop once under the profiler and report `device_s`, the GPU's busy time per
    call (the summed durations of the kernels on the device's streams; no launch gaps), with
    `kernels_per_call` and the `profile_top` costliest kernels (`device_time_by_kernel`). GPU
    only; elsewhere these keys are absent.
  chain: how a call's carry depends on the previous call's output. "output": the output's first
    leaf IS the next carry (it must have x's shape and dtype): no device work beyond the calls.
    "select": x + 1 where the output's first element equals a value it never takes, else x; an
    XLA select, fused into the next call's first fusion that reads x where there is one, else
    one more small kernel a call (the harness of sessions 8-47; at Tq = 1 it rode on the
    in-flight score's reduction, `results/s48/`). "auto": "output" where the shapes allow.
  Returns {"min_s", "median_s", "runs_s", "num_calls", "repeats", "unroll", "chain"} (+ the
  profile keys): per-call seconds, min and median over `repeats` timed runs after one warm-up
  (compile) run; "chain" is the one used.
  """
  if unroll < 1:
    raise ValueError(f"unroll must be >= 1, got {unroll}")
  if chain not in CHAINS:
    raise ValueError(f"chain must be one of {CHAINS}, got {chain!r}")
  arg_sets = (tuple(rest), *map(tuple, rotate))
  per_iteration = unroll * len(arg_sets)
  iterations = -(-num_calls // per_iteration)
  # One jitted callee: its lowering (a Pallas kernel's compilation included) is reused by every
  # unrolled call site.
  callee = jax.jit(fn)
  used = []                                            # the chain, decided while tracing

  def call(x, it, args):
    out = callee(x, it, *args) if with_index else callee(x, *args)
    # The barrier keeps XLA from shrinking the call to the part of it the dependency reads.
    out = lax.optimization_barrier(out)
    first = jax.tree.leaves(out)[0]
    same = (first.shape, first.dtype) == (x.shape, x.dtype)
    if chain == "output" and not same:
      raise ValueError(f"chain='output' needs the call's first output to match the carry: "
                       f"{first.shape} {first.dtype} vs {x.shape} {x.dtype}")
    used.append("output" if chain == "output" or (chain == "auto" and same) else "select")
    if used[-1] == "output":
      return first
    return jnp.where(first.reshape(-1)[0] == _SENTINEL, x + 1, x)

  @jax.jit
  def loop(x, arg_sets):
    def body(it, x):
      for u in range(unroll):
        for args in arg_sets:
          x = call(x, it * unroll + u, args)
      return x
    return lax.fori_loop(0, iterations, body, x)

  jax.block_until_ready(loop(x, arg_sets))            # compile + warm up
  runs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(x, arg_sets))
    runs.append((time.perf_counter() - t0) / (iterations * per_iteration))
  result = dict(min_s=min(runs), median_s=statistics.median(runs), runs_s=runs,
                num_calls=iterations * per_iteration, repeats=repeats, unroll=unroll,
                chain=used[0])
  if profile and jax.default_backend() == "gpu":
    result.update(device_time(lambda: jax.block_until_ready(loop(x, arg_sets)),
                              iterations * per_iteration, top=profile_top))
  return result


def add_loop_args(p, *, target_gb: float, min_calls: int, max_copies: int,
                  copies_of: str = "the large arrays") -> None:
  """The timed-loop options shared by the GPU benchmarks (argparse parser `p`)."""
  p.add_argument("--target-gb", type=float, default=target_gb, help="reads per timed loop (GB)")
  p.add_argument("--min-calls", type=int, default=min_calls)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--rotate-mb", type=float, default=200.0,
                 help=f"cycle through copies of {copies_of} while a call reads less (0: never)")
  p.add_argument("--max-copies", type=int, default=max_copies)
  p.add_argument("--unroll", type=int, default=8,
                 help="calls per timed-loop iteration (default 8; 1 = one call per iteration)")
  p.add_argument("--no-profile", action="store_true",
                 help="skip the profiler's GPU busy time per call")


def loop_fields(t: dict, nbytes: float, read_bw_gb_per_s: float | None) -> dict:
  """A measurement's fields from a time_loop result `t` for a call that must read `nbytes`:
  calls, us per call (min and median), GB/s and its fraction of the read bandwidth, and the
  profiler's GPU busy time (with the costliest kernels) when `t` has it."""
  out = dict(num_calls=t["num_calls"], repeats=t["repeats"], unroll=t["unroll"],
             chain=t.get("chain"),
             us_per_call=t["min_s"] * 1e6, us_per_call_median=t["median_s"] * 1e6,
             gb_per_s=nbytes / t["min_s"] / 1e9, read_bw_gb_per_s=read_bw_gb_per_s)
  if read_bw_gb_per_s:
    out["fraction_of_read_bw"] = out["gb_per_s"] / read_bw_gb_per_s
  if "device_s" in t:
    out.update(device_us_per_call=t["device_s"] * 1e6,
               device_gb_per_s=nbytes / t["device_s"] / 1e9,
               kernels_per_call=t["kernels_per_call"],
               device_us_by_kernel={k: v * 1e6 for k, v in t["device_time_by_kernel"].items()})
    if read_bw_gb_per_s:
      out["device_fraction_of_read_bw"] = out["device_gb_per_s"] / read_bw_gb_per_s
  elif "device_error" in t:
    out["device_error"] = t["device_error"]
  return out


def loop_summary(entry: dict) -> str:
  """One progress-line piece for a benchmark entry with `loop_fields`: "skipped (...)",
  "ERROR ..." (first line), or "<us> us, <GB/s> GB/s (<%> of read BW)"."""
  if "skipped" in entry:
    return f"skipped ({entry['skipped']})"
  if "error" in entry:
    return "ERROR " + entry["error"].splitlines()[0][:300]
  line = f"{entry['us_per_call']:.2f} us, {entry['gb_per_s']:.0f} GB/s"
  if entry.get("fraction_of_read_bw") is not None:
    line += f" ({100 * entry['fraction_of_read_bw']:.1f}% of read BW)"
  return line


def device_time(run: Callable[[], Any], num_calls: int, top: int = 6, sequence: int = 0) -> dict:
  """GPU busy time per call of `run()` (which makes `num_calls` calls), from a profiler trace:
  the summed durations of the events on the GPU planes' stream lines (kernels and copies).
  Returns {"device_s", "kernels_per_call", "device_time_by_kernel": {name: seconds per call},
  "launches_by_kernel": {name: launches per call}} (the `top` costliest kernels); with
  `sequence` > 0 also "kernel_sequence": the first `sequence` events after the first call's
  worth (skipping a call's warm-up effects), in start order, as [name, microseconds] pairs."""
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    try:
      run()
    finally:
      jax.profiler.stop_trace()
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
      return dict(device_error="the profiler wrote no trace")
    data = jax.profiler.ProfileData.from_file(paths[0])
  total_ns, count, by_name, launches = 0.0, 0, collections.Counter(), collections.Counter()
  ordered = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU:"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue
      for event in line.events:
        total_ns += event.duration_ns
        count += 1
        by_name[event.name[:80]] += event.duration_ns
        launches[event.name[:80]] += 1
        if sequence:
          ordered.append((event.start_ns, event.name[:80], event.duration_ns))
  if not count:
    return dict(device_error="no GPU stream events in the trace")
  result = dict(device_s=total_ns * 1e-9 / num_calls, kernels_per_call=count / num_calls,
                device_time_by_kernel={k: v * 1e-9 / num_calls
                                       for k, v in by_name.most_common(top)},
                launches_by_kernel={k: launches[k] / num_calls
                                    for k, _ in by_name.most_common(top)})
  if sequence:
    ordered.sort()
    skip = count // num_calls if num_calls > 1 else 0
    result["kernel_sequence"] = [[name, round(ns * 1e-3, 3)]
                                 for _, name, ns in ordered[skip:skip + sequence]]
  return result


def fresh_executables(on: bool | None = None) -> None:
  """Drop every compiled program (`jax.clear_caches()`) before timing the next configuration
  (on None: only on a GPU). On an H200 every loop of a process ran ~15% slower once several decode
  loops had been compiled in it (the same GPU-busy time, kernels no longer overlapping; SmolLM2
  dense 935 -> 790 tokens/s), and clearing the caches restored it (benchmarks/NOTES.md, session
  69), so a configuration's time depended on what had been compiled before it. The next call
  compiles its program again."""
  if on is None:
    on = jax.default_backend() == "gpu"
  if on:
    jax.clear_caches()


def read_bandwidth(num_bytes: float = 4 * 2 ** 30, iters: int = 10, repeats: int = 5) -> dict:
  """Read bandwidth of a fused elementwise + sum over a `num_bytes` bf16 array, `iters`
  reductions inside one jit (each scaled by the loop index, so none is hoisted)."""
  n = int(num_bytes) // 2 // 4096 * 4096
  x = jnp.ones((n // 4096, 4096), jnp.bfloat16)                            # [n / 4096, 4096]

  @jax.jit
  def many(x):
    def body(i, acc):
      return acc + jnp.sum(x * (1 + i).astype(x.dtype), dtype=jnp.float32)
    return lax.fori_loop(0, iters, body, jnp.float32(0))

  jax.block_until_ready(many(x))
  runs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(many(x))
    runs.append((time.perf_counter() - t0) / iters)
  del x
  best = min(runs)
  return dict(bytes=2 * n, seconds=best, median_seconds=statistics.median(runs),
              gb_per_s=2 * n / best / 1e9, iters=iters, repeats=repeats,
              statistic="min over repeats of (loop time / iters)")


def call_seconds(fn: Callable, *args) -> float:
  """Wall time of one already-compiled call, Python dispatch included (a calibration only)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def num_calls_for(bytes_per_call: float, est_seconds: float | None, *, target_bytes: float,
                  min_calls: int, max_calls: int, max_loop_seconds: float) -> int:
  """Calls per timed loop: about `target_bytes` of reads, within [min_calls, max_calls], but a
  loop of slow calls (est_seconds each) is cut to ~max_loop_seconds (never below 3 calls)."""
  n = int(np.clip(target_bytes / max(bytes_per_call, 1.0), min_calls, max_calls))
  if est_seconds is not None and est_seconds * n > max_loop_seconds:
    n = max(min(3, n), int(max_loop_seconds / est_seconds))
  return n


def max_abs_err(a, b) -> float:
  """Max |a - b| in fp32; equal infinities count 0, a NaN counts inf."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  same_inf = np.isinf(a) & (a == b)
  with np.errstate(invalid="ignore"):                     # inf - inf: masked just below
    diff = np.where(same_inf, 0.0, np.abs(a - b))
  return float(np.max(np.where(np.isnan(diff), np.inf, diff), initial=0.0))


def default_out_dir() -> str:
  """$OUT when set (device runs), else benchmarks/results/."""
  out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
  os.makedirs(out_dir, exist_ok=True)
  return out_dir


def write_json(path: str, obj) -> None:
  """Writes atomically (a kill mid-write leaves the previous file)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)
