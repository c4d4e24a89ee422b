"""GPU benchmark of the W4A16 GEMV kernel (`pallas_kernels.w4a16_gemv`) at QuantSpec's draft
matmul shapes: Llama-3.1-8B's wqkv 4096->6144, wo 4096->4096, w_gate_up 4096->28672 and
w_down 14336->4096 (and lm_head 4096->128256: a 4-bit draft lm_head, measured and not kept, see
NOTES session 17), x with M in {1, 4} bf16 rows, quant group 128 (`--group`).

Per shape and M, three implementations:
  pallas       `w4a16_matmul` on the "int4_t" codes [In/64, Out, 8] words (the kernel + its
               wrapper's x padding / xsum and split-K sum: what `quant_matmul` runs for "int4_t")
  int4_reduce  `quant_matmul` on the "int4_reduce" layout (XLA: one fused multiply-and-reduce
               over the int4 codes [In, Out]; the draft's current best path)
  dense_bf16   jnp.dot(x, w) with the dequantized weight in bf16 (what the draft replaces)
  w4a8         `w4a8_gemv.w4a8_matmul` (M = 1 only; what `quant_matmul` runs for one row): the
               same codes, x in two int8 planes per 32 inputs, dp4a on CUDA cores (its error
               against `w4a8_reference`, the planes' product; `x_quant_err` that product's
               difference from the bf16 x's)
--sweep adds the kernel under further tilings (block_out, groups_per_stage, stages, target
blocks), and w4a8 under W4A8_SWEEP. The weights are random codes / scales / zeros generated on the device; every
implementation multiplies the same quantized weight (dense: its bf16 rounding).

Each entry: us per call (min over repeats of a timed loop of calls chained inside one jit,
`benchmarks._timing.time_loop`; also the median and the
profiler's GPU busy time per call `device_us_per_call`), the bytes the implementation must read
per call (int4: codes In_pad * Out / 2 + fp16 scales and zeros + x; dense: the bf16 weight + x),
achieved GB/s, its fraction of the device's read bandwidth (measured in the same run,
`read_bandwidth`), and max |y - reference| (fp32 dequantize-then-matmul) with the reference's
max |y| beside it. A weight smaller than --rotate-mb is cycled through copies so consecutive
calls do not hit in L2 (50 MB on an H200). The JSON is rewritten after every measurement.

  PYTHONPATH=$PWD python benchmarks/w4a16_gemv.py              # -> $OUT/w4a16_gemv.json
  PYTHONPATH=$PWD python benchmarks/w4a16_gemv.py --quick      # M = 1 only
  PYTHONPATH=$PWD python benchmarks/w4a16_gemv.py --sweep      # + kernel tilings
  PYTHONPATH=$PWD python benchmarks/w4a16_gemv.py --interpret  # CPU smoke: tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._timing import (add_loop_args, default_out_dir, loop_fields,  # noqa: E402
                                loop_summary, max_abs_err, read_bandwidth, time_loop, write_json)
from pallas_kernels.w4a16_gemv import (CHUNK, W4A16Config, dequantize,  # noqa: E402
                                       from_chunked, plan, w4a16_matmul, w4a16_reference)
from pallas_kernels import w4a8_gemv  # noqa: E402
from sparsedec.model.quant_weights import QuantWeight, quant_matmul  # noqa: E402

DTYPE = jnp.bfloat16
LLAMA_8B = {"wqkv": (4096, 6144), "wo": (4096, 4096), "w_gate_up": (4096, 28672),
            "w_down": (14336, 4096), "lm_head": (4096, 128256)}   # lm_head: the largest GEMV shape
TINY = {"tiny_a": (256, 128), "tiny_b": (200, 256)}          # --interpret (CPU)
IMPLS = ("pallas", "int4_reduce", "dense_bf16", "w4a8")
# --sweep, w4a8: (block_out, rows_per_stage, num_stages) beside the default.
W4A8_SWEEP = ((256, 128, 4), (128, 256, 4), (128, 128, 2), (128, 128, 6), (256, 256, 2))
# --sweep: (block_out, groups_per_stage, num_stages, target_blocks) beside the default.
SWEEP = ((64, 1, 2, 528), (64, 1, 8, 528), (64, 2, 4, 528), (64, 4, 4, 528), (128, 1, 4, 528),
         (128, 2, 3, 528), (128, 2, 4, 264), (256, 1, 4, 528), (256, 2, 3, 132), (64, 1, 4, 264),
         (64, 1, 4, 1056), (64, 1, 4, 132))


# ----------------------------------------------------------------------------------------------
# Data.
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def random_weight(key, n_in, n_out, group):
  """(codes_t [In_pad/64, Out, 8] uint32, scale, zero [In_pad/G, Out] fp16): codes uniform in
  [-8, 7] (random words), steps in [0.005, 0.02], zeros about -8 steps (a weight centred on 0)."""
  k1, k2, k3 = jax.random.split(key, 3)
  in_pad = -(-n_in // group) * group
  codes = jax.random.bits(k1, (in_pad // CHUNK, n_out, CHUNK // 8), jnp.uint32)
  scale = jax.random.uniform(k2, (in_pad // group, n_out), jnp.float32, 0.005, 0.02)
  zero = -8 * scale + 0.01 * jax.random.normal(k3, scale.shape)
  return codes, scale.astype(jnp.float16), zero.astype(jnp.float16)


def _dense(codes_t, scale, zero, n_in, group):
  """The dequantized weight [In, Out] in bf16 (the dense_bf16 operand)."""
  return dequantize(codes_t, scale, zero, in_features=n_in, group=group).astype(DTYPE)


_dense_jit = jax.jit(_dense, static_argnums=(3, 4))
_kn_jit = jax.jit(from_chunked)


def w4_bytes(m: int, n_in: int, n_out: int, group: int) -> int:
  """Bytes a W4A16 call must read: codes + fp16 scales and zeros + bf16 x."""
  in_pad = -(-n_in // group) * group
  return in_pad * n_out // 2 + 2 * 2 * (in_pad // group) * n_out + m * n_in * 2


def dense_bytes(m: int, n_in: int, n_out: int) -> int:
  return n_in * n_out * 2 + m * n_in * 2


# ----------------------------------------------------------------------------------------------
# Implementations: fn(x, *weights) -> y [M, Out].
# ----------------------------------------------------------------------------------------------

def pallas_fn(n_in: int, group: int, config: W4A16Config, interpret):
  def fn(x, codes_t, scale, zero):
    return w4a16_matmul(x, codes_t, scale, zero, in_features=n_in, group=group, config=config,
                        interpret=interpret)
  return fn


def w4a8_fn(n_in: int, group: int, config, interpret):
  def fn(x, codes_t, scale, zero):
    return w4a8_gemv.w4a8_matmul(x, codes_t, scale, zero, in_features=n_in, group=group,
                                 config=config, interpret=interpret)
  return fn


def int4_reduce_fn(n_in: int, group: int):
  def fn(x, codes_kn, scale, zero):
    w = QuantWeight(codes=codes_kn, scale=scale, zero=zero, in_features=n_in, group=group,
                    layout="int4_reduce")
    return quant_matmul(x, w)
  return fn


def dense_fn(x, w):
  return jnp.dot(x, w)


# ----------------------------------------------------------------------------------------------
# Harness.
# ----------------------------------------------------------------------------------------------

def _error(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}"[:2000]


@dataclasses.dataclass
class Bench:
  out_path: str
  interpret: object
  repeats: int
  target_bytes: float
  min_calls: int
  max_calls: int
  rotate_bytes: float
  max_copies: int
  unroll: int
  profile: bool
  max_seconds: float | None
  verbose: bool
  results: dict = dataclasses.field(default_factory=dict)
  read_bw: float | None = None
  t0: float = dataclasses.field(default_factory=time.perf_counter)

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def save(self):
    self.results["elapsed_s"] = round(self.elapsed(), 2)
    write_json(self.out_path, self.results)

  def log(self, text: str):
    print(f"[{self.elapsed():7.1f}s] {text}", flush=True)

  def copies_for(self, nbytes: float) -> int:
    if self.rotate_bytes <= 0:
      return 1
    return int(min(self.max_copies, max(1, math.ceil(self.rotate_bytes / nbytes))))

  def record(self, entry: dict) -> dict:
    entry["t_s"] = round(self.elapsed(), 2)
    self.results["measurements"].append(entry)
    self.log(_progress(entry))
    self.save()
    return entry

  def measure(self, base: dict, impl: str, fn, x, weight_sets, *, nbytes: int, ref,
              extra: dict | None = None) -> dict:
    """Checks fn(x, *weight_sets[0]) against ref, then times it cycling through weight_sets."""
    entry = dict(base, impl=impl, bytes=nbytes, **(extra or {}))
    if self.max_seconds is not None and self.elapsed() > self.max_seconds:
      entry["skipped"] = "time budget (--max-seconds) spent"
      return self.record(entry)
    t_start = time.perf_counter()
    try:
      y = jax.block_until_ready(jax.jit(fn)(x, *weight_sets[0]))
      entry["max_abs_err"] = max_abs_err(y, ref)
      entry["ref_max_abs"] = float(jnp.max(jnp.abs(ref)))
      entry["rel_err"] = entry["max_abs_err"] / max(entry["ref_max_abs"], 1e-30)
      n = int(np.clip(self.target_bytes / nbytes, self.min_calls, self.max_calls))
      t = time_loop(fn, x, *weight_sets[0], num_calls=n, repeats=self.repeats,
                    rotate=[tuple(w) for w in weight_sets[1:]], unroll=self.unroll,
                    profile=self.profile)
      entry.update(copies=len(weight_sets), **loop_fields(t, nbytes, self.read_bw))
    except Exception as e:                                               # noqa: BLE001
      if self.verbose:
        traceback.print_exc()
      entry["error"] = _error(e)
    entry["seconds"] = round(time.perf_counter() - t_start, 2)
    return self.record(entry)


def _progress(e: dict) -> str:
  line = f"{e['shape']} M={e['M']} {e['impl']}"
  if "config" in e:
    c = e["plan"]
    line += (f" [bo={c['block_out']} gps={c['groups_per_stage']} st={c['num_stages']} "
             f"splits={c['splits']} blocks={e['blocks']}]")
  line += ": " + loop_summary(e)
  if "skipped" in e or "error" in e:
    return line
  if "device_us_per_call" in e:
    line += f"; device {e['device_us_per_call']:.2f} us"
    if e.get("device_fraction_of_read_bw") is not None:
      line += f" ({100 * e['device_fraction_of_read_bw']:.1f}%)"
  return line + f", n={e['num_calls']} x{e['copies']}, err {e['max_abs_err']:.2e} " \
      f"(|ref| {e['ref_max_abs']:.2e})"


def run_shape(bench: Bench, name: str, n_in: int, n_out: int, ms, impls, configs, group: int,
              w4a8_configs=(w4a8_gemv.W4A8Config(),)):
  """All implementations and M for one weight shape (its copies generated once)."""
  w4 = w4_bytes(1, n_in, n_out, group)
  copies = bench.copies_for(w4)
  keys = jax.random.split(jax.random.key(n_in * 7 + n_out), copies)
  t4 = [random_weight(k, n_in, n_out, group) for k in keys]                    # int4_t sets
  jax.block_until_ready(t4)
  bench.log(f"{name}: In={n_in} Out={n_out}, {w4 / 1e6:.1f} MB of W4 per call, {copies} copies")
  kn = [(_kn_jit(c), s, z) for c, s, z in t4] if "int4_reduce" in impls else None
  dense = None
  if "dense_bf16" in impls:
    n_dense = bench.copies_for(dense_bytes(1, n_in, n_out))
    dense = [(_dense_jit(*t4[i % copies], n_in, group),) for i in range(n_dense)]
  for m in ms:
    base = dict(shape=name, In=n_in, Out=n_out, M=m, group=group, dtype="bfloat16",
                w4_bytes=w4_bytes(m, n_in, n_out, group), dense_bytes=dense_bytes(m, n_in, n_out))
    x = jax.random.normal(jax.random.key(m), (m, n_in), jnp.float32).astype(DTYPE)
    codes_t, scale, zero = t4[0]
    ref = jax.block_until_ready(jax.jit(functools.partial(
        w4a16_reference, in_features=n_in, group=group))(x, codes_t, scale, zero))
    if "pallas" in impls:
      for cfg in configs:
        p = plan(m, n_out, -(-n_in // group), group, cfg)
        extra = dict(config=dataclasses.asdict(cfg), plan=dataclasses.asdict(p),
                     blocks=p.out_tiles * p.splits)
        bench.measure(base, "pallas", pallas_fn(n_in, group, cfg, bench.interpret), x, t4,
                      nbytes=base["w4_bytes"], ref=ref, extra=extra)
    if "w4a8" in impls and m == 1 and not w4a8_gemv.unsupported_reason(m, n_out, group, DTYPE):
      ref8 = jax.block_until_ready(jax.jit(functools.partial(
          w4a8_gemv.w4a8_reference, in_features=n_in, group=group))(x, codes_t, scale, zero))
      for cfg in w4a8_configs:
        p = w4a8_gemv.plan(n_out, -(-n_in // group), group, cfg)
        extra = dict(config=dataclasses.asdict(cfg), plan=dataclasses.asdict(p),
                     blocks=p.out_tiles * p.splits, x_quant_err=max_abs_err(ref8, ref))
        bench.measure(base, "w4a8", w4a8_fn(n_in, group, cfg, bench.interpret), x, t4,
                      nbytes=base["w4_bytes"], ref=ref8, extra=extra)
    if kn is not None:
      bench.measure(base, "int4_reduce", int4_reduce_fn(n_in, group), x, kn,
                    nbytes=base["w4_bytes"],
                    ref=ref)
    if dense is not None:
      bench.measure(base, "dense_bf16", dense_fn, x, dense, nbytes=base["dense_bytes"], ref=ref)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default=None, help=f"subset of {','.join(LLAMA_8B)}")
  p.add_argument("--rows", default=None, help="M values (default 1,4; --quick 1)")
  p.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
  p.add_argument("--quick", action="store_true", help="M = 1 only, 2 repeats")
  p.add_argument("--sweep", action="store_true", help="also the kernel under the SWEEP tilings")
  p.add_argument("--group", type=int, default=128, help="quant group G (input rows)")
  p.add_argument("--groups-per-stage", type=int, default=None,
                 help="the default tiling's groups a pipeline step (default: 128 rows' worth)")
  p.add_argument("--interpret", action="store_true",
                 help="CPU smoke run: Mosaic GPU interpret mode, tiny shapes, 1 call per loop")
  p.add_argument("--out", help="JSON path (default $OUT/w4a16_gemv.json, else "
                 "benchmarks/results/; --interpret: a temp dir)")
  p.add_argument("--max-seconds", type=float, default=540.0,
                 help="start no measurement after this many seconds")
  add_loop_args(p, target_gb=2.0, min_calls=50, max_copies=16, copies_of="the weight")
  p.add_argument("--max-calls", type=int, default=5000)
  p.add_argument("--bw-gib", type=float, default=4.0, help="array size of the read-BW test")
  p.add_argument("--verbose", action="store_true", help="print tracebacks")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  shapes = TINY if args.interpret else LLAMA_8B
  if args.shapes:
    shapes = {k: shapes[k] for k in args.shapes.split(",")}
  ms = [int(t) for t in (args.rows or ("1" if args.quick else "1,4")).split(",")]
  impls = tuple(args.impls.split(","))
  configs = [W4A16Config(groups_per_stage=args.groups_per_stage)]
  w4a8_configs = [w4a8_gemv.W4A8Config()]
  if args.sweep:
    configs += [W4A16Config(block_out=b, groups_per_stage=g, num_stages=s, target_blocks=t)
                for b, g, s, t in SWEEP]
    w4a8_configs += [w4a8_gemv.W4A8Config(block_out=b, rows_per_stage=r, num_stages=s)
                     for b, r, s in W4A8_SWEEP]
  if args.out:
    out_path = args.out
  elif args.interpret:
    out_path = os.path.join(os.environ.get("OUT") or tempfile.gettempdir(),
                            "w4a16_gemv_interpret.json")
  else:
    out_path = os.path.join(default_out_dir(), "w4a16_gemv.json")
  bench = Bench(out_path=out_path,
                interpret=plgpu.InterpretGPUParams() if args.interpret else None,
                repeats=1 if args.interpret else (2 if args.quick else args.repeats),
                target_bytes=args.target_gb * 1e9,
                min_calls=1 if args.interpret else args.min_calls,
                max_calls=1 if args.interpret else args.max_calls,
                rotate_bytes=1e15 if args.interpret else args.rotate_mb * 1e6,
                max_copies=2 if args.interpret else args.max_copies,
                # One call per argument tuple a loop under the interpreter: unrolled 8 times,
                # its 2 copies made 16 interpreted calls a run (and 16 inlined kernels to compile).
                unroll=1 if args.interpret else args.unroll,
                profile=not args.no_profile and not args.interpret,
                max_seconds=None if args.interpret else args.max_seconds, verbose=args.verbose)
  dev = jax.devices()[0]
  bench.results = dict(
      device=dev.device_kind, platform=dev.platform, jax=jax.__version__, argv=list(argv or []),
      group=args.group, dtype="bfloat16", shapes={k: list(v) for k, v in shapes.items()}, rows=ms,
      impls=list(impls), interpret=args.interpret,
      bytes="must-read bytes per call: int4 = codes In_pad*Out/2 + fp16 scales and zeros + bf16 "
            "x; dense_bf16 = the bf16 weight + x",
      timing="us_per_call: min over repeats of (timed loop / calls), calls chained in one jit, "
             "cycling through `copies` weight copies; device_us_per_call: the profiler's GPU "
             "busy time per call (kernels only, no launch gaps)",
      measurements=[])
  bench.log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}; "
            f"writing {out_path}")
  try:
    bw = read_bandwidth(2 ** 24 if args.interpret else args.bw_gib * 2 ** 30,
                        **(dict(iters=1, repeats=1) if args.interpret else {}))
    bench.read_bw = bw["gb_per_s"]
  except Exception as e:                                                 # noqa: BLE001
    bw = dict(error=_error(e))
  bench.results["read_bandwidth"] = bw
  bench.log(f"read bandwidth: {bw}")
  try:
    x0 = jnp.zeros((1, 128), DTYPE)
    t = time_loop(lambda x: x, x0, num_calls=2 if args.interpret else 2000, repeats=bench.repeats,
                  unroll=args.unroll)
    bench.results["loop_overhead_us_per_call"] = t["min_s"] * 1e6
  except Exception as e:                                                 # noqa: BLE001
    bench.results["loop_overhead_us_per_call"] = _error(e)
  bench.log(f"loop overhead: {bench.results['loop_overhead_us_per_call']} us per call")
  bench.save()

  for name, (n_in, n_out) in shapes.items():
    try:
      run_shape(bench, name, n_in, n_out, ms, impls, configs, args.group, w4a8_configs)
    except Exception as e:                                               # noqa: BLE001
      if args.verbose:
        traceback.print_exc()
      bench.record(dict(shape=name, In=n_in, Out=n_out, M=None, impl="(setup)", error=_error(e)))
  bench.results["summary"] = summary(bench.results["measurements"])
  bench.save()
  for line in bench.results["summary"]:
    print(line, flush=True)
  return bench.results


def summary(measurements) -> list[str]:
  """One line per (shape, M): each implementation's best us per call and the kernel's speedup."""
  best = {}
  for e in measurements:
    if "us_per_call" not in e:
      continue
    key = (e["shape"], e["M"], e["impl"])
    if key not in best or e["us_per_call"] < best[key]["us_per_call"]:
      best[key] = e
  lines = []
  for shape, m in sorted({(k[0], k[1]) for k in best}, key=str):
    parts = []
    for impl in IMPLS:
      e = best.get((shape, m, impl))
      if e is not None:
        frac = e.get("fraction_of_read_bw")
        parts.append(f"{impl} {e['us_per_call']:.2f} us"
                     + (f" ({100 * frac:.0f}% BW)" if frac is not None else ""))
    k, r = best.get((shape, m, "pallas")), best.get((shape, m, "int4_reduce"))
    if k and r:
      parts.append(f"pallas vs int4_reduce x{r['us_per_call'] / k['us_per_call']:.2f}")
    a8 = best.get((shape, m, "w4a8"))
    if k and a8:
      parts.append(f"w4a8 vs pallas x{k['us_per_call'] / a8['us_per_call']:.2f}")
      if "device_us_per_call" in k and "device_us_per_call" in a8:
        parts.append(f"device {k['device_us_per_call']:.2f} -> {a8['device_us_per_call']:.2f} us")
    lines.append(f"{shape} M={m}: " + ", ".join(parts))
  return lines


if __name__ == "__main__":
  main(sys.argv[1:])
