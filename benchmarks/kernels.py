"""GPU benchmark of the three Mosaic GPU Pallas kernels (decode, sparse, quant attention).

Shapes: Hq = 32, Hkv = 8, D = 128, bf16; B in {1, 8}; cache capacity S in {4K, 16K, 64K, 128K}
(every row valid up to S); Tq in {1, 16, 64, 256}. Each measurement records the time per call,
the bytes that must be read, the achieved GB/s and its fraction of the device's read bandwidth
(measured in the same run: a fused elementwise + sum over a 4 GiB bf16 array).

  decode  `decode_attention` next to the references: the jnp reference under XLA,
          `jax.nn.dot_product_attention` (implementation "cudnn" and "xla"; the implementation
          seen in the lowered program is recorded), and jax's bundled Pallas GPU decode op
          (`jax.experimental.pallas.ops.gpu.decode_attention.gqa`, Tq = 1 only; once as called,
          on k/v [B, S, Hkv, D] pre-transposed outside the timed loop, once vmapped directly over
          [B, Hkv, S, D] without gqa's internal transposes). dot_product_attention and the bundled
          op attend the cache only (no in-flight tokens) and are checked against the reference
          with an all-False in-flight mask. Bytes: K + V of the valid length, plus q.
  sparse  `sparse_attention` over a block list of random distinct blocks per (row, KV head), the
          listed fraction swept (default 1.6%, 6.25%, 25%, 100% of S / block_size); next to its
          jnp reference (gather) and `decode_attention` at the same S. Bytes: the listed blocks'
          K + V, plus q. Consecutive calls cycle through block lists that together cover the
          cache, so a short list is not served from L2.
  fafo    FAFO's two-segment launch once: Tq = 64 fumble queries on the block list + 16
          verification queries on the full cache (S = 16K), next to decode_attention with all
          80 queries on the full cache. Bytes: K + V of the full cache (the union), plus q.
  quant   `quant_attention` reading the QuantSpec INT4/INT8 cache at 4 and 8 bits: the quantized
          region holds S - 192 tokens, a full-precision recent segment the last 192 (capacity
          256); next to its jnp reference (dequantize, then attend) and `decode_attention` on the
          bf16 cache. Bytes: codes + scales/zeros (`bytes_per_token`) + the recent segment, + q.

Timing: `benchmarks._timing.time_loop`, many calls chained inside one jit (no Python dispatch
between calls); about --target-gb of reads per timed loop, at least --min-calls calls (a loop of
slow calls is cut to ~1 s), 3 timed runs; `us_per_call` is the min over runs (also recorded:
the median). When a call reads less than --rotate-mb, the loop cycles through up to
--max-copies copies of the cache so consecutive calls do not hit in L2. Every measurement is
checked against its reference first (`max_err`, `ok` at bf16 tolerance 3e-2), is wrapped in
try/except (an error or a skip is recorded and the run goes on), and rewrites the JSON
(default $OUT/kernels.json). A reference whose estimated working set exceeds
--max-working-set-gb is skipped (its correctness check then runs row by row where that fits).
The "targets" section holds each target's ratio and pass/fail.

  PYTHONPATH=$PWD python benchmarks/kernels.py --quick
  PYTHONPATH=$PWD python benchmarks/kernels.py --kernels decode --batch 1
  PYTHONPATH=$PWD python benchmarks/kernels.py --dry-run        # CPU, interpret mode, tiny shapes
  python benchmarks/plot_kernels.py $OUT/kernels.json           # PNGs (CPU)
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
import warnings
from importlib import metadata
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks._targets import TARGETS, compute_targets, format_targets  # noqa: E402
from benchmarks._timing import (CHAINS, add_loop_args, call_seconds, default_out_dir,  # noqa: E402
                                loop_fields, loop_summary, max_abs_err, num_calls_for,
                                read_bandwidth,
                                time_loop, write_json)
from pallas_kernels.decode_attention import (DecodeConfig, decode_attention,  # noqa: E402
                                             decode_attention_reference)
from pallas_kernels.decode_attention import (  # noqa: E402
  split_partials as decode_split_partials)
from pallas_kernels.quant_attention import (QuantAttentionConfig, _dequantizes,  # noqa: E402
                                            bytes_per_token,
                                            quant_attention, quant_attention_reference,
                                            quantize_kv)
from pallas_kernels.sparse_attention import (SparseConfig, sparse_attention,  # noqa: E402
                                             sparse_attention_reference)
from pallas_kernels.sparse_attention import (  # noqa: E402
  split_partials as sparse_split_partials)

DTYPE = jnp.bfloat16
ITEMSIZE = 2
DECODE_CONFIG = DecodeConfig()
SPARSE_CONFIG = SparseConfig()
QUANT_CONFIG = QuantAttentionConfig()
QUANT_GROUP = 128                 # tokens per key group (QuantSpec)
RECENT = 192                      # full-precision recent tokens (QuantSpec keeps 128..256)
RECENT_CAPACITY = 256
BUNDLED_CONFIG = dict(block_h=16, block_k=128, k_splits=16, num_stages=2, num_warps=None)
TOL = 3e-2                        # bf16 output tolerance

FULL = dict(kernels="decode,sparse,quant,fafo", batch="1,8", seq="4096,16384,65536,131072",
            tq="1,16,64,256", sparse_seq="16384,65536", fractions="0.016,0.0625,0.25,1",
            bits="4,8", fafo="64,16", fafo_seq="16384", heads="32,8,128")
QUICK = dict(batch="1", seq="16384,65536", tq="1,16", sparse_seq="16384", fractions="0.016,0.25")
DRY_RUN = dict(batch="1", seq="256", tq="1,16", sparse_seq="256", fractions="0.016,1",
               fafo="8,4", fafo_seq="256", heads="8,2,128")

@dataclasses.dataclass(frozen=True)
class Settings:
  hq: int = 32
  hkv: int = 8
  d: int = 128
  interpret: bool = False           # Mosaic GPU interpreter (CPU dry run)
  target_bytes: float = 4e9         # reads per timed loop
  min_calls: int = 20
  max_calls: int = 2000
  max_loop_seconds: float = 1.0
  repeats: int = 3
  calibrate: bool = True            # time one call first, to cut loops of slow calls
  max_working_set: float = 20e9     # bytes of temporaries a reference may need
  rotate_bytes: float = 200e6       # cycle through cache copies below this many bytes per call
  max_copies: int = 4
  max_seconds: float | None = None  # stop starting measurements after this much wall time
  partials: bool = True             # also time the kernels without their jnp combine
  refs: tuple[str, ...] = ("jnp", "dpa", "bundled")
  unroll: int = 8                   # calls per timed-loop iteration (spreads its host sync)
  chain: str = "auto"               # how a call waits for the previous one (`time_loop`)
  profile: bool = True              # also the profiler's GPU busy time per call
  verbose: bool = False


# ----------------------------------------------------------------------------------------------
# Sizes.
# ----------------------------------------------------------------------------------------------

def kv_bytes(st: Settings, b: int, tokens: int) -> int:
  """K + V bytes of `tokens` slots of every KV head of b rows (bf16)."""
  return 2 * b * st.hkv * tokens * st.d * ITEMSIZE


def q_bytes(st: Settings, b: int, tq: int) -> int:
  return b * tq * st.hq * st.d * ITEMSIZE


def score_bytes(st: Settings, b: int, tq: int, keys: int) -> int:
  """One fp32 score tensor [B, Hq, Tq, keys]."""
  return b * st.hq * tq * keys * 4


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------------------------
# The measurement harness.
# ----------------------------------------------------------------------------------------------

def _error(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}"[:2000]


def _slice_rows(args: Sequence, batched: dict[int, int], i: int) -> tuple:
  """args with row i (kept as a batch of 1) of every argument at a `batched` position, along
  that position's batch axis (every leaf of a pytree argument has it there)."""
  def row(x, axis):
    return lax.slice_in_dim(x, i, i + 1, axis=axis)
  return tuple(jax.tree.map(functools.partial(row, axis=batched[pos]), a) if pos in batched
               else a for pos, a in enumerate(args))


def _rotations(args: Sequence, alts: Sequence[dict]) -> list[tuple]:
  """For each copy (a {position: replacement} dict), args[1:] with those positions replaced."""
  return [tuple(alt.get(pos, a) for pos, a in enumerate(args))[1:] for alt in alts]


def _jitted(fn: Callable) -> Callable:
  """fn itself when it is a jitted function (or a partial of one: its compile cache is reused),
  else jax.jit(fn)."""
  inner = fn.func if isinstance(fn, functools.partial) else fn
  return fn if hasattr(inner, "lower") else jax.jit(fn)


def _copy(tree):
  return jax.tree.map(lambda x: x.copy(), tree)


def _progress(entry: dict) -> str:
  keys = ("B", "S", "Tq", "listed_blocks", "bits", "sparse_queries")
  where = " ".join(f"{k}={entry[k]}" for k in keys if k in entry)
  line = (f"[{entry.get('t_s', 0):7.1f}s] {entry['kernel']} {where} | {entry['impl']}: "
          + loop_summary(entry))
  if "skipped" in entry or "error" in entry:
    return line
  line += f", n={entry['num_calls']} x{entry['copies']}"
  if "max_err" in entry:
    line += f", err={entry['max_err']:.2e} {'ok' if entry['ok'] else 'MISMATCH'}"
  elif "check" in entry:
    line += f", check: {entry['check']}"
  return line


class Bench:
  """Holds the results, times measurements and rewrites the JSON after each one."""

  def __init__(self, settings: Settings, out_path: str, meta: dict):
    self.st = settings
    self.out_path = out_path
    self.t0 = time.perf_counter()
    self.interpret = plgpu.InterpretGPUParams() if settings.interpret else None
    self.read_bw = None                                  # GB/s
    self.results = dict(meta, measurements=[])

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def out_of_time(self) -> bool:
    return self.st.max_seconds is not None and self.elapsed() > self.st.max_seconds

  def save(self):
    self.results["targets"] = compute_targets(self.results["measurements"])
    self.results["targets_device_time"] = compute_targets(self.results["measurements"],
                                                          "device_us_per_call")
    self.results["elapsed_s"] = round(self.elapsed(), 2)
    write_json(self.out_path, self.results)

  def record(self, entry: dict) -> dict:
    entry["t_s"] = round(self.elapsed(), 2)
    self.results["measurements"].append(entry)
    print(_progress(entry), flush=True)
    self.save()
    return entry

  def fail(self, base: dict, impl: str, e: BaseException) -> dict:
    if self.st.verbose:
      traceback.print_exc()
    return self.record(dict(base, impl=impl, role="setup", error=_error(e)))

  def measure_read_bandwidth(self, num_bytes: float):
    try:
      bw = read_bandwidth(num_bytes)
      self.read_bw = bw["gb_per_s"]
    except Exception as e:                                               # noqa: BLE001
      bw = dict(error=_error(e))
    self.results["read_bandwidth"] = bw
    print(f"[{self.elapsed():7.1f}s] read bandwidth: {bw}", flush=True)
    self.save()

  def measure_loop_overhead(self):
    """Per-call cost of the timing loop itself (its counter; with the select chain its select on
    q), for a [1, 1, Hq, D] q."""
    q = jnp.zeros((1, 1, self.st.hq, self.st.d), DTYPE)
    n = 1000 if not self.st.interpret else 2
    try:
      t = time_loop(lambda x: x, q, num_calls=n, repeats=self.st.repeats,
                    unroll=self.st.unroll, chain=self.st.chain)
      self.results["loop_overhead"] = dict(us_per_call=t["min_s"] * 1e6,
                                           us_per_call_median=t["median_s"] * 1e6, num_calls=n,
                                           chain=t["chain"])
    except Exception as e:                                               # noqa: BLE001
      self.results["loop_overhead"] = dict(error=_error(e))
    print(f"[{self.elapsed():7.1f}s] loop overhead: {self.results['loop_overhead']}", flush=True)
    self.save()

  def copies_for(self, cycle_bytes: float) -> int:
    """Copies of the cache to cycle through: enough to read >= rotate_bytes per cycle."""
    if self.st.rotate_bytes <= 0:
      return 1
    return int(min(self.st.max_copies, max(1, math.ceil(self.st.rotate_bytes / cycle_bytes))))

  def reference(self, ref_fn: Callable, args: Sequence, batched: dict[int, int],
                working_set: float) -> tuple[Any, str | None]:
    """(ref_fn(*args), None); row by row when the whole batch's `working_set` (bytes of
    temporaries) exceeds the budget, args[pos] split along axis batched[pos]; (None, why) when
    even a row does not fit or it fails."""
    b = args[0].shape[0]
    budget = self.st.max_working_set
    try:
      if working_set <= budget:
        return jax.block_until_ready(ref_fn(*args)), None
      if working_set / b <= budget:
        rows = [ref_fn(*_slice_rows(args, batched, i)) for i in range(b)]
        return jax.block_until_ready(jnp.concatenate(rows, axis=0)), None
      return None, f"reference skipped: working set {working_set / b / 1e9:.1f} GB per row"
    except Exception as e:                                               # noqa: BLE001
      if self.st.verbose:
        traceback.print_exc()
      return None, "reference failed: " + _error(e)

  def measure(self, base: dict, impl: str, fn: Callable, args: Sequence, *, role: str,
              expect=None, expect_note: str | None = None, skip: str | None = None,
              alts: Sequence[dict] = (), with_index: bool = False,
              extra: dict | None = None) -> dict:
    """Checks fn(*args) against `expect` (when given), then times it.

    args[0] is the loop carry (q); alts: copies of large arguments ({position: array}) cycled
    through by the timed loop; with_index: fn takes the call's index (`time_loop`) after args[0].
    base must hold "bytes" (what must be read per call)."""
    entry = dict(base, impl=impl, role=role, **(extra or {}))
    if skip is None and self.out_of_time():
      skip = "time budget (--max-seconds) spent"
    if skip is not None:
      entry["skipped"] = skip
      return self.record(entry)
    t_start = time.perf_counter()
    try:
      jfn = _jitted(fn)
      call_args = (args[0], jnp.int32(0), *args[1:]) if with_index else tuple(args)
      out = jax.block_until_ready(jfn(*call_args))
      if expect is not None:
        entry["max_err"] = max_abs_err(jax.tree.leaves(out)[0], expect)
        entry["ok"] = bool(entry["max_err"] <= TOL)
      elif expect_note:
        entry["check"] = expect_note
      del out
      est = call_seconds(jfn, *call_args) if self.st.calibrate else None
      n = num_calls_for(entry["bytes"], est, target_bytes=self.st.target_bytes,
                        min_calls=self.st.min_calls, max_calls=self.st.max_calls,
                        max_loop_seconds=self.st.max_loop_seconds)
      t = time_loop(fn, args[0], *args[1:], num_calls=n, repeats=self.st.repeats,
                    rotate=_rotations(args, alts), with_index=with_index,
                    unroll=self.st.unroll, profile=self.st.profile, chain=self.st.chain)
      entry.update(copies=1 + len(alts), **loop_fields(t, entry["bytes"], self.read_bw))
      if est is not None:
        entry["calibration_call_us"] = est * 1e6
    except Exception as e:                                               # noqa: BLE001
      if self.st.verbose:
        traceback.print_exc()
      entry["error"] = _error(e)
    entry["seconds"] = round(time.perf_counter() - t_start, 2)
    return self.record(entry)

  def case_skipped(self, base: dict) -> bool:
    """Records a skip for the whole case when the time budget is spent."""
    if not self.out_of_time():
      return False
    self.record(dict(base, impl="(all)", role="setup", skipped="time budget spent"))
    return True

  def find(self, impl: str, **keys) -> dict | None:
    for m in self.results["measurements"]:
      if m["impl"] == impl and "us_per_call" in m and all(m.get(k) == v for k, v in keys.items()):
        return m
    return None


# ----------------------------------------------------------------------------------------------
# Inputs.
# ----------------------------------------------------------------------------------------------

def _normal(seed: int, shape: tuple) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), shape, DTYPE)


def make_cache(bench: Bench, b: int, s: int, seed: int) -> dict:
  """k, v [B, Hkv, S, D] and the copies the timed loops cycle through."""
  st = bench.st
  k = _normal(seed, (b, st.hkv, s, st.d))                                 # [B, Hkv, S, D]
  v = _normal(seed + 1, (b, st.hkv, s, st.d))                             # [B, Hkv, S, D]
  copies = [(k.copy(), v.copy()) for _ in range(bench.copies_for(kv_bytes(st, b, s)) - 1)]
  return dict(k=k, v=v, copies=copies, bshd=None)


def bshd_sets(cache: dict) -> list[tuple[jax.Array, jax.Array]]:
  """[(k, v) [B, S, Hkv, D]] for the cache and each copy (made once, outside any timed loop)."""
  if cache["bshd"] is None:
    swap = jax.jit(lambda k, v: (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)))
    cache["bshd"] = [swap(k, v) for k, v in [(cache["k"], cache["v"])] + cache["copies"]]
  return cache["bshd"]


def make_queries(st: Settings, b: int, tq: int, seed: int) -> dict:
  return dict(
      q=_normal(seed, (b, tq, st.hq, st.d)),                              # [B, Tq, Hq, D]
      k_new=_normal(seed + 1, (b, tq, st.hkv, st.d)),                     # [B, Tq, Hkv, D]
      v_new=_normal(seed + 2, (b, tq, st.hkv, st.d)),                     # [B, Tq, Hkv, D]
      causal=jnp.tril(jnp.ones((tq, tq), bool)),                          # [Tq, Tq]
      none=jnp.zeros((tq, tq), bool),                                     # [Tq, Tq]
  )


def random_table_sets(seed: int, b: int, hkv: int, cache_blocks: int, listed: int) -> jax.Array:
  """[N, B, Hkv, listed] int32, N = cache_blocks // listed: per (row, KV head) a random
  permutation of the cache's blocks cut into N lists of distinct blocks (each sorted), so the N
  lists together cover (nearly) the whole cache."""
  rng = np.random.default_rng(seed)
  n = cache_blocks // listed
  perms = np.stack([rng.permutation(cache_blocks) for _ in range(b * hkv)])
  sets = np.sort(perms[:, :n * listed].reshape(b, hkv, n, listed), axis=-1)
  return jnp.asarray(np.moveaxis(sets, 2, 0), jnp.int32)


def _pick(sets: jax.Array, it) -> jax.Array:
  """Block list number it % N of sets [N, B, Hkv, NB] -> [B, Hkv, NB]."""
  return lax.dynamic_index_in_dim(sets, it % sets.shape[0], keepdims=False)


def quantize_rows(k: jax.Array, v: jax.Array):
  """quantize_kv row by row (bounds the fp32 temporaries), concatenated."""
  rows = [quantize_kv(k[i:i + 1], v[i:i + 1], group=QUANT_GROUP) for i in range(k.shape[0])]
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *rows)


# ----------------------------------------------------------------------------------------------
# decode_attention and its references.
# ----------------------------------------------------------------------------------------------

def _dpa(q, k, v, lengths, *, implementation):
  """jax.nn.dot_product_attention on q [B, Tq, Hq, D], k, v [B, S, Hkv, D] (cache only)."""
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                      implementation=implementation)


def _implementation_ran(fn: Callable, args: Sequence) -> str:
  """"cudnn" when the lowered program calls cuDNN's fused attention, else "xla"."""
  try:
    text = jax.jit(fn).lower(*args).as_text()
  except Exception as e:                                                 # noqa: BLE001
    return "lowering failed: " + _error(e)[:200]
  return "cudnn" if "cudnn" in text.lower() else "xla"


def _bundled_module():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import decode_attention as bundled
  return bundled


def _bundled_gqa(q, k, v, lengths, *, interpret):
  """The bundled op as called: q [B, Hq, D]; k, v [B, S, Hkv, D]; lengths [B]."""
  return _bundled_module().gqa(q, k, v, kv_seq_len=lengths, interpret=interpret,
                               **BUNDLED_CONFIG)


def _bundled_gqa_bhsd(q, k, v, lengths, *, interpret):
  """gqa's kernel without its transposes: q [B, Hq, D]; k, v [B, Hkv, S, D]; lengths [B]."""
  bundled = _bundled_module()
  b, hq, d = q.shape
  hkv = k.shape[1]
  inner = functools.partial(bundled.decode_attn_unbatched, sm_scale=d ** -0.5, grid=None,
                            interpret=interpret, debug=False, return_residuals=False,
                            normalize_output=True, **BUNDLED_CONFIG)
  lens = jnp.broadcast_to(lengths[:, None], (b, hkv))                      # [B, Hkv]
  out = jax.vmap(jax.vmap(inner))(q.reshape(b, hkv, hq // hkv, d), k, v, None, lens)
  return out.reshape(b, hq, d)


def decode_baseline(bench: Bench, kernel: str, cache: dict, x: dict, b: int, s: int, tq: int):
  """decode_attention at (B, S, Tq) on this cache, unless this run already timed it."""
  if bench.find("decode_attention", B=b, S=s, Tq=tq) is not None:
    return
  st = bench.st
  lengths = jnp.full((b,), s, jnp.int32)
  args = (x["q"], cache["k"], cache["v"], lengths, x["k_new"], x["v_new"], x["causal"])
  base = dict(kernel=kernel, B=b, S=s, Tq=tq, length=s,
              bytes=kv_bytes(st, b, s) + q_bytes(st, b, tq))
  fn = functools.partial(decode_attention, config=DECODE_CONFIG, interpret=bench.interpret)
  bench.measure(base, "decode_attention", fn, args, role="baseline",
                alts=[{1: k2, 2: v2} for k2, v2 in cache["copies"]],
                expect_note="not checked here (see the decode runs)")


def decode_case(bench: Bench, cache: dict, b: int, s: int, tq: int):
  st = bench.st
  x = make_queries(st, b, tq, seed=1000 * b + tq)
  lengths = jnp.full((b,), s, jnp.int32)                                  # [B]
  k, v = cache["k"], cache["v"]
  args = (x["q"], k, v, lengths, x["k_new"], x["v_new"], x["causal"])
  alts = [{1: k2, 2: v2} for k2, v2 in cache["copies"]]
  base = dict(kernel="decode", B=b, S=s, Tq=tq, length=s,
              bytes=kv_bytes(st, b, s) + q_bytes(st, b, tq))
  if bench.case_skipped(base):
    return
  scores = 3 * score_bytes(st, b, tq, s)        # fp32 scores, probabilities, bf16 copy
  ref_fn = jax.jit(decode_attention_reference)
  batched = dict.fromkeys(range(6), 0)
  ref_out, note = bench.reference(ref_fn, args, batched, scores)
  cache_args = args[:-1] + (x["none"],)        # cache only: no in-flight key counts
  ref_cache, note_cache = bench.reference(ref_fn, cache_args, batched, scores)
  too_big = (f"working set ~{scores / 1e9:.1f} GB > {st.max_working_set / 1e9:.0f} GB"
             if scores > st.max_working_set else None)

  kernel = functools.partial(decode_attention, config=DECODE_CONFIG, interpret=bench.interpret)
  bench.measure(base, "decode_attention", kernel, args, role="kernel", expect=ref_out,
                expect_note=note, alts=alts)
  if st.partials:
    partials = lambda q, k, v, lengths: decode_split_partials(
        q, k, v, lengths, config=DECODE_CONFIG, interpret=bench.interpret)[0]
    bench.measure(base, "decode_attention.split_partials (no combine)", partials, args[:4],
                  role="diagnostic", alts=alts)
  if "jnp" in st.refs:
    bench.measure(base, "jnp_reference", ref_fn, args, role="reference", skip=too_big, alts=alts)

  need_bshd = "dpa" in st.refs or ("bundled" in st.refs and tq == 1)
  sets = bshd_sets(cache) if need_bshd else None
  if "dpa" in st.refs:
    kb, vb = sets[0]
    dargs = (x["q"], kb, vb, lengths)
    dalts = [{1: k2, 2: v2} for k2, v2 in sets[1:]]
    for impl in ("cudnn", "xla"):
      fn = functools.partial(_dpa, implementation=impl)
      extra = dict(cache_only=True, implementation_requested=impl,
                   implementation_ran=_implementation_ran(fn, dargs))
      bench.measure(base, f"jax.nn.dot_product_attention[{impl}]", fn, dargs, role="reference",
                    expect=ref_cache, expect_note=note_cache, alts=dalts, extra=extra,
                    skip=too_big if impl == "xla" else None)
  if "bundled" in st.refs and tq == 1:
    q3 = x["q"][:, 0]                                                     # [B, Hq, D]
    expect = None if ref_cache is None else ref_cache[:, 0]
    kb, vb = sets[0]
    extra = dict(cache_only=True, config=BUNDLED_CONFIG,
                 layout="k, v [B, S, Hkv, D], transposed outside the timed loop")
    bench.measure(base, "pallas.ops.gpu.decode_attention.gqa", functools.partial(
        _bundled_gqa, interpret=st.interpret), (q3, kb, vb, lengths), role="reference",
        expect=expect, expect_note=note_cache, extra=extra,
        alts=[{1: k2, 2: v2} for k2, v2 in sets[1:]])
    extra = dict(extra, layout="k, v [B, Hkv, S, D]: gqa's kernel vmapped directly, without "
                 "the transposes gqa applies inside")
    bench.measure(base, "pallas.ops.gpu.decode_attention.gqa (no transposes)", functools.partial(
        _bundled_gqa_bhsd, interpret=st.interpret), (q3, k, v, lengths), role="reference",
        expect=expect, expect_note=note_cache, extra=extra, alts=alts)


def run_cache_grid(bench: Bench, kernel: str, make, case, batches, seqs, tqs, *case_args):
  """case(bench, cache, B, S, Tq, *case_args) over the grid, one cache = make(bench, B, S, seed)
  per (B, S); a failure is recorded and the grid goes on."""
  for b in batches:
    for s in seqs:
      base = dict(kernel=kernel, B=b, S=s)
      if bench.case_skipped(base):
        continue
      try:
        cache = make(bench, b, s, seed=b * 7 + s)
      except Exception as e:                                             # noqa: BLE001
        bench.fail(base, make.__name__, e)
        continue
      for tq in tqs:
        try:
          case(bench, cache, b, s, tq, *case_args)
        except Exception as e:                                           # noqa: BLE001
          bench.fail(dict(base, Tq=tq), case.__name__, e)
      del cache


def run_decode(bench: Bench, batches, seqs, tqs):
  run_cache_grid(bench, "decode", make_cache, decode_case, batches, seqs, tqs)


# ----------------------------------------------------------------------------------------------
# sparse_attention (and FAFO's two-segment launch).
# ----------------------------------------------------------------------------------------------

# The batch axis of each batched argument of the sparse calls' (q, k, v, table sets, counts,
# lengths, k_new, v_new, mask): the table sets are [N, B, Hkv, NB].
SPARSE_BATCH_AXES = {**dict.fromkeys(range(8), 0), 3: 1}


def _sparse_fn(block_size: int, sparse_queries: int | None, interpret):
  def fn(q, it, k, v, table_sets, counts, lengths, k_new, v_new, mask):
    return sparse_attention(q, k, v, _pick(table_sets, it), counts, lengths, k_new, v_new, mask,
                            block_size=block_size, sparse_queries=sparse_queries,
                            config=SPARSE_CONFIG, interpret=interpret)
  return fn


def _sparse_ref_fn(block_size: int, sparse_queries: int | None):
  def fn(q, it, k, v, table_sets, counts, lengths, k_new, v_new, mask):
    return sparse_attention_reference(q, k, v, _pick(table_sets, it), counts, lengths, k_new,
                                      v_new, mask, block_size=block_size,
                                      sparse_queries=sparse_queries)
  return fn


def _sparse_reference_check(bench: Bench, args, block_size, sparse_queries, working_set):
  """The reference output for the first block list (what the kernel's check call reads)."""
  fn = _sparse_ref_fn(block_size, sparse_queries)
  ref = jax.jit(lambda *a: fn(a[0], 0, *a[1:]))
  return bench.reference(ref, args, SPARSE_BATCH_AXES, working_set)


def _listing(st: Settings, b: int, s: int, block_size: int, fraction: float, seed: int) -> dict:
  cache_blocks = s // block_size
  listed = int(np.clip(round(fraction * cache_blocks), 1, cache_blocks))
  sets = random_table_sets(seed, b, st.hkv, cache_blocks, listed)        # [N, B, Hkv, NB]
  return dict(listed=listed, cache_blocks=cache_blocks, sets=sets,
              counts=jnp.full((b, st.hkv), listed, jnp.int32),            # [B, Hkv]
              kv_bytes=kv_bytes(st, b, listed * block_size))


def sparse_case(bench: Bench, cache: dict, x: dict, b: int, s: int, tq: int, block_size: int,
                fraction: float, first: bool):
  st = bench.st
  lst = _listing(st, b, s, block_size, fraction, seed=s + 31 * b + tq)
  lengths = jnp.full((b,), s, jnp.int32)
  args = (x["q"], cache["k"], cache["v"], lst["sets"], lst["counts"], lengths, x["k_new"],
          x["v_new"], x["causal"])
  alts = [{1: k2, 2: v2} for k2, v2 in cache["copies"]]
  ideal_us = lst["kv_bytes"] / bench.read_bw / 1e3 if bench.read_bw else None
  base = dict(kernel="sparse", B=b, S=s, Tq=tq, length=s, block_size=block_size,
              block_kv=SPARSE_CONFIG.tile_rows(block_size), listed_blocks=lst["listed"],
              cache_blocks=lst["cache_blocks"],
              listed_fraction=lst["listed"] / lst["cache_blocks"],
              block_lists_cycled=int(lst["sets"].shape[0]), listed_kv_bytes=lst["kv_bytes"],
              ideal_read_us=ideal_us, bytes=lst["kv_bytes"] + q_bytes(st, b, tq))
  if bench.case_skipped(base):
    return
  keys = lst["listed"] * block_size
  working_set = lst["kv_bytes"] + 3 * score_bytes(st, b, tq, keys)        # gathered K/V + scores
  ref_out, note = _sparse_reference_check(bench, args, block_size, None, working_set)

  bench.measure(base, "sparse_attention", _sparse_fn(block_size, None, bench.interpret), args,
                role="kernel", expect=ref_out, expect_note=note, alts=alts, with_index=True)
  if st.partials and first:
    def partials(q, it, k, v, table_sets, counts, lengths):
      return sparse_split_partials(q, k, v, _pick(table_sets, it), counts, lengths,
                                   block_size=block_size, sparse_queries=tq,
                                   config=SPARSE_CONFIG, interpret=bench.interpret)[1]
    bench.measure(base, "sparse_attention.split_partials (no combine)", partials, args[:6],
                  role="diagnostic", alts=alts, with_index=True)
  if "jnp" in st.refs:
    skip = (f"working set ~{working_set / 1e9:.1f} GB > {st.max_working_set / 1e9:.0f} GB"
            if working_set > st.max_working_set else None)
    bench.measure(base, "jnp_reference", _sparse_ref_fn(block_size, None), args,
                  role="reference", skip=skip, alts=alts, with_index=True)


def run_sparse(bench: Bench, batches, seqs, tqs, fractions, block_size: int):
  for b in batches:
    for s in seqs:
      base = dict(kernel="sparse", B=b, S=s)
      if bench.case_skipped(base):
        continue
      try:
        cache = make_cache(bench, b, s, seed=b * 7 + s)
      except Exception as e:                                             # noqa: BLE001
        bench.fail(base, "make_cache", e)
        continue
      cache_blocks = s // block_size
      for tq in tqs:
        x = make_queries(bench.st, b, tq, seed=1000 * b + tq)
        try:
          decode_baseline(bench, "sparse", cache, x, b, s, tq)
        except Exception as e:                                           # noqa: BLE001
          bench.fail(dict(base, Tq=tq), "decode_baseline", e)
        seen = set()
        for fraction in fractions:
          listed = int(np.clip(round(fraction * cache_blocks), 1, cache_blocks))
          if listed in seen:
            continue
          try:
            sparse_case(bench, cache, x, b, s, tq, block_size, fraction, first=not seen)
          except Exception as e:                                         # noqa: BLE001
            bench.fail(dict(base, Tq=tq, listed_blocks=listed), "sparse_case", e)
          seen.add(listed)
      del cache


def run_fafo(bench: Bench, s: int, tq_sparse: int, tq_full: int, fraction: float,
             block_size: int):
  """One FAFO launch: tq_sparse queries on the block list, tq_full on the full cache (B = 1)."""
  st = bench.st
  b, tq = 1, tq_sparse + tq_full
  base = dict(kernel="fafo", B=b, S=s, Tq=tq)
  if bench.case_skipped(base):
    return
  try:
    cache = make_cache(bench, b, s, seed=b * 7 + s)
    x = make_queries(st, b, tq, seed=4242)
    lst = _listing(st, b, s, block_size, fraction, seed=77)
  except Exception as e:                                                 # noqa: BLE001
    bench.fail(base, "setup", e)
    return
  lengths = jnp.full((b,), s, jnp.int32)
  args = (x["q"], cache["k"], cache["v"], lst["sets"], lst["counts"], lengths, x["k_new"],
          x["v_new"], x["causal"])
  alts = [{1: k2, 2: v2} for k2, v2 in cache["copies"]]
  full = kv_bytes(st, b, s)
  base.update(length=s, sparse_queries=tq_sparse, full_queries=tq_full, block_size=block_size,
              listed_blocks=lst["listed"], cache_blocks=lst["cache_blocks"],
              listed_fraction=lst["listed"] / lst["cache_blocks"],
              listed_kv_bytes=lst["kv_bytes"], plan_kv_bytes=lst["kv_bytes"] + full,
              bytes=full + q_bytes(st, b, tq))
  working_set = full + 3 * score_bytes(st, b, tq, s)
  ref_out, note = _sparse_reference_check(bench, args, block_size, tq_sparse, working_set)
  bench.measure(base, "sparse_attention (two segments)",
                _sparse_fn(block_size, tq_sparse, bench.interpret), args, role="kernel",
                expect=ref_out, expect_note=note, alts=alts, with_index=True)
  if "jnp" in st.refs:
    skip = "working set too large" if working_set > st.max_working_set else None
    bench.measure(base, "jnp_reference", _sparse_ref_fn(block_size, tq_sparse), args,
                  role="reference", skip=skip, alts=alts, with_index=True)
  fn = functools.partial(decode_attention, config=DECODE_CONFIG, interpret=bench.interpret)
  dargs = (x["q"], cache["k"], cache["v"], lengths, x["k_new"], x["v_new"], x["causal"])
  bench.measure(base, "decode_attention (all queries on the full cache)", fn, dargs,
                role="baseline", alts=alts)


# ----------------------------------------------------------------------------------------------
# quant_attention.
# ----------------------------------------------------------------------------------------------

def _tied_to_q(fn):
  """fn(q, qkv, ...) with qkv's value scales passed through a select on q that never fires. A
  timed loop repeats calls with the same cache (`unroll`); work that reads only the cache (the
  dequantization of the jnp reference and of quant_attention's dequantize path) would otherwise
  be shared between them by XLA's common-subexpression elimination and timed once per `unroll`
  calls. The select costs one pass over v_scale ([B, Hkv, S] fp16)."""
  def tied(q, qkv, *rest):
    never = q.reshape(-1)[0].astype(jnp.float32) == 12345.0
    v_scale = jnp.where(never, qkv.v_scale + 1, qkv.v_scale)
    return fn(q, dataclasses.replace(qkv, v_scale=v_scale), *rest)
  return tied


def _quant_ref_fn(bits: int):
  def fn(q, qkv, lengths_q, k_full, v_full, lengths_full, k_new, v_new, mask):
    return quant_attention_reference(q, qkv, bits, lengths_q, k_full, v_full, lengths_full,
                                     k_new, v_new, mask)
  return jax.jit(_tied_to_q(fn))


def make_quant_cache(bench: Bench, b: int, s: int, seed: int) -> dict:
  """The bf16 cache (for decode_attention), its QuantKV, the recent segment, and copies."""
  st = bench.st
  cache = make_cache(bench, b, s, seed)
  qkv = quantize_rows(cache["k"], cache["v"])
  k_full = _normal(seed + 2, (b, st.hkv, RECENT_CAPACITY, st.d))         # [B, Hkv, Rc, D]
  v_full = _normal(seed + 3, (b, st.hkv, RECENT_CAPACITY, st.d))         # [B, Hkv, Rc, D]
  read4 = b * st.hkv * (s * bytes_per_token(st.d, 4, QUANT_GROUP)
                        + RECENT * st.d * 2 * ITEMSIZE)
  quant_copies = [(_copy(qkv), k_full.copy(), v_full.copy())
                  for _ in range(bench.copies_for(read4) - 1)]
  return dict(cache, qkv=qkv, k_full=k_full, v_full=v_full, quant_copies=quant_copies)


def quant_case(bench: Bench, cache: dict, b: int, s: int, tq: int, bits_list):
  st = bench.st
  x = make_queries(st, b, tq, seed=1000 * b + tq)
  decode_baseline(bench, "quant", cache, x, b, s, tq)
  quantized = max(0, s - RECENT)
  lengths_q = jnp.full((b,), quantized, jnp.int32)                        # [B]
  lengths_full = jnp.full((b,), min(RECENT, s), jnp.int32)                # [B]
  args = (x["q"], cache["qkv"], lengths_q, cache["k_full"], cache["v_full"], lengths_full,
          x["k_new"], x["v_new"], x["causal"])
  alts = [{1: qkv2, 3: kf2, 4: vf2} for qkv2, kf2, vf2 in cache["quant_copies"]]
  dequantized = 2 * kv_bytes(st, b, s + RECENT_CAPACITY)                  # dequantized + concat
  working_set = dequantized + 3 * score_bytes(st, b, tq, s + RECENT_CAPACITY)
  for bits in bits_list:
    read = b * st.hkv * (quantized * bytes_per_token(st.d, bits, QUANT_GROUP)
                         + min(RECENT, s) * st.d * 2 * ITEMSIZE)
    base = dict(kernel="quant", B=b, S=s, Tq=tq, bits=bits, length=s,
                quantized_tokens=quantized, recent_tokens=min(RECENT, s),
                bytes=read + q_bytes(st, b, tq))
    if bench.case_skipped(base):
      return
    ref_fn = _quant_ref_fn(bits)
    ref_out, note = bench.reference(ref_fn, args, dict.fromkeys(range(8), 0), working_set)
    fn = functools.partial(quant_attention, bits=bits, config=QUANT_CONFIG,
                           interpret=bench.interpret)
    path = "fused"
    if _dequantizes(QUANT_CONFIG, tq * st.hq // st.hkv, bits, cache["qkv"], x["q"].dtype):
      fn, path = _tied_to_q(fn), "dequantize"    # (the fused kernel reads q from the start)
    base["path"] = path
    bench.measure(base, f"quant_attention[{bits}bit]", fn, args, role="kernel", expect=ref_out,
                  expect_note=note, alts=alts)
    if "jnp" in st.refs:
      skip = (f"working set ~{working_set / 1e9:.1f} GB > {st.max_working_set / 1e9:.0f} GB"
              if working_set > st.max_working_set else None)
      bench.measure(base, f"jnp_reference[{bits}bit]", ref_fn, args, role="reference",
                    skip=skip, alts=alts)


def run_quant(bench: Bench, batches, seqs, tqs, bits_list):
  run_cache_grid(bench, "quant", make_quant_cache, quant_case, batches, seqs, tqs, bits_list)


# ----------------------------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------------------------

KERNELS = ("decode", "sparse", "quant", "fafo")
REFS = ("jnp", "dpa", "bundled")


def _ints(text: str) -> list[int]:
  return [int(t) for t in text.split(",") if t]


def _floats(text: str) -> list[float]:
  return [float(t) for t in text.split(",") if t]


def _check_args(p: argparse.ArgumentParser, args) -> None:
  """Every sweep list is refused by flag name when malformed, empty, or holding a value the
  sweep cannot take (a misspelt kernel or reference was skipped silently: a run that measured
  nothing; '1,x' or a single --fafo count was a bare ValueError traceback)."""
  def names(flag, text, known, allow_empty=False):
    got = [t for t in text.split(",") if t]
    unknown = [t for t in got if t not in known]
    if unknown or not (got or allow_empty):
      p.error(f"{flag} takes a comma-separated subset of {','.join(known)}, got {text!r}")

  def numbers(flag, text, parse, ok, what, length=None):
    try:
      values = parse(text)
    except ValueError:
      values = None
    if not values or not all(ok(v) for v in values) or length not in (None, len(values)):
      size = f"{length} " if length else ""
      p.error(f"{flag} takes {size}comma-separated {what}, got {text!r}")
    return values

  names("--kernels", args.kernels, KERNELS)
  names("--refs", args.refs, REFS, allow_empty=True)
  for flag in ("batch", "seq", "tq", "sparse_seq", "fafo_seq"):
    numbers(f"--{flag.replace('_', '-')}", getattr(args, flag), _ints, lambda v: v >= 1,
            "integers >= 1")
  numbers("--bits", args.bits, _ints, lambda v: v in (4, 8), "read widths among 4 and 8")
  numbers("--fractions", args.fractions, _floats, lambda v: 0 < v <= 1, "fractions in (0, 1]")
  numbers("--fafo", args.fafo, _ints, lambda v: v >= 1, "query counts >= 1 (sparse,full)",
          length=2)
  hq, hkv, _ = numbers("--heads", args.heads, _ints, lambda v: v >= 1, "sizes >= 1 (Hq,Hkv,D)",
                       length=3)
  if hq % hkv:
    p.error(f"--heads: Hq ({hq}) must be a multiple of Hkv ({hkv}), got {args.heads!r}")
  if args.block_size < 1:
    p.error(f"--block-size must be >= 1, got {args.block_size}")
  if args.unroll is not None and args.unroll < 1:
    p.error(f"--unroll must be >= 1, got {args.unroll}")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--kernels", help=f"subset of {FULL['kernels']}")
  p.add_argument("--batch", help=f"batch sizes (default {FULL['batch']})")
  p.add_argument("--seq", help=f"cache capacities S for decode and quant ({FULL['seq']})")
  p.add_argument("--tq", help=f"queries per row ({FULL['tq']})")
  p.add_argument("--sparse-seq", help=f"S for the sparse sweep ({FULL['sparse_seq']})")
  p.add_argument("--fractions", help=f"listed block fractions ({FULL['fractions']}); the first "
                 "is the headline (~1.6%%)")
  p.add_argument("--block-size", type=int, default=64, help="sparse block size (default 64)")
  p.add_argument("--bits", help=f"quant read widths ({FULL['bits']})")
  p.add_argument("--fafo", help=f"FAFO sparse,full query counts ({FULL['fafo']})")
  p.add_argument("--fafo-seq", help=f"S of the FAFO case ({FULL['fafo_seq']})")
  p.add_argument("--heads", help=f"Hq,Hkv,D ({FULL['heads']})")
  p.add_argument("--refs", default="jnp,dpa,bundled",
                 help="references to time (jnp,dpa,bundled; '' for none)")
  p.add_argument("--no-partials", action="store_true", help="skip the kernel-only timings")
  p.add_argument("--quick", action="store_true",
                 help=f"a short run that still covers every target: {QUICK}")
  p.add_argument("--dry-run", "--interpret", dest="dry_run", action="store_true",
                 help="CPU check: Mosaic GPU interpret mode, tiny shapes, 1 timed call")
  p.add_argument("--out", help="JSON path (default $OUT/kernels.json, else "
                 "benchmarks/results/kernels.json; dry run: a temp dir)")
  p.add_argument("--max-seconds", type=float, default=None,
                 help="start no measurement after this many seconds (default 480; dry run none)")
  p.add_argument("--max-working-set-gb", type=float, default=20.0)
  add_loop_args(p, target_gb=4.0, min_calls=20, max_copies=4, copies_of="the cache")
  p.set_defaults(unroll=None)              # 8, or 1 in a dry run (see settings_from)
  p.add_argument("--bw-gib", type=float, default=4.0, help="array size of the read-BW test")
  p.add_argument("--chain", choices=CHAINS, default="auto",
                 help="how each timed call waits for the previous one: its output as the next "
                 "q (output; auto where shapes match) or a select on it (select, sessions 8-47)")
  p.add_argument("--verbose", action="store_true", help="print tracebacks")
  args = p.parse_args(argv)
  preset = dict(FULL, **(DRY_RUN if args.dry_run else QUICK if args.quick else {}))
  for key, value in preset.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  _check_args(p, args)
  return args


def settings_from(args) -> Settings:
  hq, hkv, d = _ints(args.heads)
  st = Settings(hq=hq, hkv=hkv, d=d, target_bytes=args.target_gb * 1e9, min_calls=args.min_calls,
                repeats=args.repeats, max_working_set=args.max_working_set_gb * 1e9,
                rotate_bytes=args.rotate_mb * 1e6, max_copies=args.max_copies,
                max_seconds=480.0 if args.max_seconds is None else args.max_seconds,
                partials=not args.no_partials, refs=tuple(t for t in args.refs.split(",") if t),
                unroll=args.unroll or 8, chain=args.chain, profile=not args.no_profile,
                verbose=args.verbose)
  if args.dry_run:
    # Interpret mode runs each grid point in Python (~0.5 s): one call per timed run, and two
    # cache copies (always) so the copy-cycling path runs too. Not unrolled unless --unroll asks:
    # time_loop rounds the calls up to unroll x copies, and the default 8 made every dry-run
    # measurement 16 interpreted calls.
    st = dataclasses.replace(st, interpret=True, min_calls=1, max_calls=1, repeats=1,
                             calibrate=False, rotate_bytes=1e15, max_copies=2,
                             max_seconds=args.max_seconds, unroll=args.unroll or 1)
  return st


def main(argv=None) -> int:
  args = parse_args(argv)
  st = settings_from(args)
  if args.out:
    out_path = args.out
  elif args.dry_run:
    out_dir = os.environ.get("OUT") or tempfile.gettempdir()
    out_path = os.path.join(out_dir, "kernels_dryrun.json")
  else:
    out_path = os.path.join(default_out_dir(), "kernels.json")
  kernels = [k for k in args.kernels.split(",") if k]
  dev = jax.devices()[0]
  meta = dict(
      device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
      jaxlib=metadata.version("jaxlib"), argv=sys.argv[1:],
      settings=dataclasses.asdict(st), dtype="bfloat16", Hq=st.hq, Hkv=st.hkv, D=st.d,
      sweep=dict(kernels=kernels, batch=args.batch, seq=args.seq, tq=args.tq,
                 sparse_seq=args.sparse_seq, fractions=args.fractions, bits=args.bits,
                 fafo=args.fafo, fafo_seq=args.fafo_seq, block_size=args.block_size),
      kernel_configs=dict(
          decode=dataclasses.asdict(DECODE_CONFIG),
          sparse=dict(dataclasses.asdict(SPARSE_CONFIG), block_size=args.block_size,
                      block_kv=SPARSE_CONFIG.tile_rows(args.block_size)),
          quant=dict(dataclasses.asdict(QUANT_CONFIG), group=QUANT_GROUP, recent_tokens=RECENT,
                     recent_capacity=RECENT_CAPACITY),
          bundled_gqa=BUNDLED_CONFIG),
      timing=dict(statistic="us_per_call: min over repeats of (timed loop / calls); "
                  "us_per_call_median: the median; device_us_per_call: the profiler's GPU busy "
                  "time per call (one more run of the loop, traced)",
                  loop="calls chained in one jit (lax.fori_loop, `unroll` calls per "
                  "iteration), cycling through `copies` copies of the cache; each entry's "
                  "`chain`: `output` = a call's output is the next call's q, `select` = a select "
                  "on its first element feeds q (sessions 8-47)"),
      bytes="must-read bytes per call: K + V of the valid length (sparse: of the listed blocks; "
            "quant: codes + scales/zeros + the bf16 recent segment), plus q",
      targets_spec={k: dict(threshold=t, comparison=c, what=w)
                    for k, (t, c, w) in TARGETS.items()},
  )
  bench = Bench(st, out_path, meta)
  print(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}; writing {out_path}",
        flush=True)
  bench.measure_read_bandwidth(args.bw_gib * 2 ** 30 if not args.dry_run else 2 ** 24)
  bench.measure_loop_overhead()

  batches, seqs, tqs = _ints(args.batch), _ints(args.seq), _ints(args.tq)
  if "decode" in kernels:
    run_decode(bench, batches, seqs, tqs)
  if "sparse" in kernels:
    run_sparse(bench, batches, _ints(args.sparse_seq), tqs, _floats(args.fractions),
               args.block_size)
  if "fafo" in kernels:
    tq_sparse, tq_full = _ints(args.fafo)
    for s in _ints(args.fafo_seq):
      run_fafo(bench, s, tq_sparse, tq_full, _floats(args.fractions)[0], args.block_size)
  if "quant" in kernels:
    run_quant(bench, batches, seqs, tqs, _ints(args.bits))

  bench.results["total_seconds"] = round(bench.elapsed(), 2)
  bench.save()
  print_summary(bench.results)
  print("wrote", out_path, flush=True)
  return 0


def print_summary(results: dict):
  ms = results["measurements"]
  errors = sum("error" in m for m in ms)
  mismatches = [m for m in ms if m.get("ok") is False]
  print(f"{len(ms)} measurements, {errors} errors, {len(mismatches)} mismatches", flush=True)
  for m in mismatches:
    print(f"  MISMATCH {m['kernel']} B={m.get('B')} S={m.get('S')} Tq={m.get('Tq')} "
          f"{m['impl']}: max_err {m['max_err']:.3g}", flush=True)
  for key in ("targets", "targets_device_time"):
    print(f"  {key} ({results[key]['statistic']}):", flush=True)
    for line in format_targets(results[key]):
      print("    " + line, flush=True)


if __name__ == "__main__":
  sys.exit(main())
