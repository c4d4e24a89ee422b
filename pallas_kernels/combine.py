"""The log-sum-exp combine of decode_attention and sparse_attention (plain jnp, small).

A kernel leaves, per (row, KV head, q block, split), an un-normalised partial output `acc`, its
row max `m2` (log2 units) and row sum `l`. `combine_partials` merges those (and the in-flight
kernel's partial, passed as `extra`) with key sets that are attended exactly here (the
step's in-flight tokens on the jnp path), into one softmax over everything. (quant_attention
attends its exact keys in its own launch and merges with a kernel, `merge_partials`.)

The merge has two forms with the same results. With few partials per row and few exact keys (a
Tq = 1 decode step: the splits and the token's own key) it is written per output element, so XLA
emits it as ONE loop fusion; with reductions over the splits XLA emitted two (the row statistics,
then the output). H100, `benchmarks/combine_ab.py`: one launch fewer per call at B = 1, device
time 34.7 -> 32.7 us at S = 16K, 100.8 -> 98.3 at 64K, 189.3 -> 187.0 at 128K (Tq = 1); the FAFO
case (80 queries, two segments) 8.65 -> 6.65 launches, 48.9 -> 47.3 us; B = 8 unchanged.

The selectors' per-slot weights (`score_queries`): the kernels write the selected queries' raw
scores (log2 units) for the slots they visit; `scores_to_probs` turns them into final softmax
weights with the combined lse and zeroes the slots a query does not read.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)
# From this many in-flight queries on, the in-flight part is its own kernel (`inflight_choice`);
# below, a few jnp ops inside the combine are cheaper than a launch.
INFLIGHT_KERNEL_MIN_QUERIES = 2
MAX_SCORE_ROWS = 64               # the selected rows live in q block 0 (one wgmma M tile)


def f32_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """jnp.einsum accumulating in fp32, at full precision whenever jax computes the product in fp32
  or wider: either operand fp32 (an fp32 query against bf16 K/V, as the benchmarks pass the
  references, is promoted too), or fp16 with bf16. jax's default precision multiplies fp32 in
  TF32 on recent GPUs: the references' fp32 results then moved by ~1e-4 against an fp32 model's.
  A bf16 or fp16 pair (one dtype) is exact either way."""
  full = jnp.dtype(jnp.result_type(a.dtype, b.dtype)).itemsize >= 4
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST if full else None)


def check_sizes(**sizes: int) -> None:
  """Refuses an empty axis by name (a kernel grid or split plan has no empty form): B=0, Tq=0,
  S=0, ..."""
  empty = [f"{name}={size}" for name, size in sizes.items() if size < 1]
  if empty:
    raise ValueError(f"{', '.join(empty)}: every axis of an attention call needs size >= 1")


def check_arrays(**arrays) -> None:
  """Each named argument is an array (has a shape and a dtype): a nested list raised
  AttributeError ('list' object has no attribute 'ndim')."""
  for name, x in arrays.items():
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be an array, got {type(x).__name__}")


def check_lengths(name: str, lengths: jax.Array, batch: int) -> None:
  """A per-row length array: [B] and integer (a float length was silently truncated)."""
  if not hasattr(lengths, "shape") or not hasattr(lengths, "dtype"):
    raise ValueError(f"{name} must be a [B={batch}] integer array, got {type(lengths).__name__}")
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must be [B={batch}], got shape {lengths.shape}")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{name} must be integer, got {lengths.dtype}")


def int32_clipped(x: jax.Array, upper: int, *, kernel_clips: bool = False) -> jax.Array:
  """An integer array (per-row lengths, `check_lengths`; block-table entries and counts) clipped
  to [0, upper] as int32. The clip happens in x's own dtype, so a uint32 or int64 value past
  int32's range reads as `upper` instead of wrapping to a negative one (a length that reads no
  slot, a block id clipped to block 0). kernel_clips: the array goes to a kernel that clips it
  itself, so an int32 one passes through (no XLA op per call)."""
  if kernel_clips and x.dtype == jnp.int32:
    return x
  return jnp.clip(x, 0, upper).astype(jnp.int32)


def is_int(value) -> bool:
  """A Python or numpy integer, not a bool (`sparsedec.errors.is_int`, whose package imports
  these modules)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_counts(optional: Sequence[str] = (), **counts) -> None:
  """Static counts are ints >= 1 (numpy integers too; not bools or floats: 2.0 stages reached the
  kernel as a shape error, 0 stages ran as 1); the names in `optional` may also be None."""
  for name, value in counts.items():
    if name in optional and value is None:
      continue
    if not is_int(value) or value < 1:
      none = " or None" if name in optional else ""
      raise ValueError(f"{name} must be >= 1 (an int){none}, got {value!r}")


def check_config_ints(config, counts: Sequence[str] = (), optional: Sequence[str] = ()) -> None:
  """A kernel config's integer knobs (`check_counts`): `counts` positive ints, `optional` None or
  positive ints, numpy integers stored as Python ints (`python_ints`). Its `warp_specialized`,
  where it has one, None or a bool."""
  check_counts(optional, **{name: getattr(config, name) for name in (*counts, *optional)})
  python_ints(config, (*counts, *optional))
  ws = getattr(config, "warp_specialized", None)
  if ws is not None and not isinstance(ws, (bool, np.bool_)):
    raise ValueError(f"warp_specialized must be None, True or False, got {ws!r}")


def python_ints(config, names: Sequence[str]) -> None:
  """Stores a frozen config's integer fields `names` (checked, or None) as Python ints: a numpy
  integer (np.int64(2) stages, splits, block_kv) passed the checks and failed deep in the
  kernel build (Mosaic's Barrier: 'numpy.int64' object is not iterable; a bare AssertionError
  for the split count)."""
  for name in names:
    value = getattr(config, name)
    if value is not None:
      object.__setattr__(config, name, int(value))


def check_mask(name: str, mask, shape: tuple[int, ...] | None = None) -> None:
  """A boolean key mask (True: the query sees the key): an array of `shape` (where given), bool
  or integer. A float mask is refused: cast to bool, an additive 0 / -inf bias mask read as its
  inverse (0 -> closed, -inf -> open), a silent wrong answer."""
  if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
    raise ValueError(f"{name} must be a bool array, got {type(mask).__name__}")
  if shape is not None and tuple(mask.shape) != shape:
    raise ValueError(f"{name} must be {list(shape)}, got shape {tuple(mask.shape)}")
  if not (jnp.dtype(mask.dtype) == jnp.dtype(bool) or jnp.issubdtype(mask.dtype, jnp.integer)):
    raise ValueError(f"{name} must be bool (True: the query sees the key), got {mask.dtype} (a "
                     f"0 / -inf bias mask would read as its inverse)")


def static_ints(value):
  """A static sequence of ints (`score_queries`) as a hashable tuple, for the jit boundary (jit
  hashes its static arguments: a list raised JAX's 'Non-hashable static arguments are not
  supported'): any iterable becomes a tuple, its numpy / concrete JAX integers Python ints.
  Anything else (a bare int, a str, bools, floats) is passed on for the wrapper's own check to
  name."""
  if isinstance(value, (str, bytes)):
    return value
  try:
    items = tuple(value)
  except TypeError:
    return value
  def index(t):
    if isinstance(t, (bool, np.bool_)):
      return t
    try:
      return operator.index(t)
    except TypeError:
      return t
  return tuple(index(t) for t in items)


def interpret_mode(interpret):
  """A kernel wrapper's `interpret` as the wrappers read it (`interpret is not None`: the
  interpreter's kernel variant and plan): None or False compile the kernel, True or
  plgpu.InterpretGPUParams() (or other params) run the Mosaic GPU interpreter. (False planned
  and built the interpreter's variant, compiled on a GPU; True reached the generic Pallas
  interpreter, 'No state discharge rule implemented for primitive: copy_gmem_to_smem'.)"""
  if isinstance(interpret, (bool, np.bool_)):
    return plgpu.InterpretGPUParams() if interpret else None
  return interpret


def normalised(**normalisers: Callable) -> Callable:
  """Decorates a jitted public entry point: each named keyword argument, where given, goes
  through its normaliser (`static_ints`, ...) before the call reaches the jit boundary."""
  def wrap(jitted):
    @functools.wraps(jitted)
    def call(*args, **kwargs):
      for name, normalise in normalisers.items():
        if name in kwargs:
          kwargs[name] = normalise(kwargs[name])
      return jitted(*args, **kwargs)
    return call
  return wrap


def check_score_queries(score_queries, num_queries: int, group: int) -> tuple[int, ...]:
  """Validates the static `score_queries` (distinct ints in [0, Tq), len * G <= 64)."""
  try:
    sel = tuple(score_queries)
  except TypeError:
    raise ValueError(f"score_queries must be a sequence of query indices, got "
                     f"{score_queries!r}")
  if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in sel):
    raise ValueError(f"score_queries must hold Python ints, got {score_queries!r}")
  sel = tuple(int(t) for t in sel)
  if any(not 0 <= t < num_queries for t in sel):
    raise ValueError(f"score_queries {sel} must be indices in [0, Tq={num_queries})")
  if len(set(sel)) != len(sel):
    raise ValueError(f"score_queries {sel} must be distinct")
  if len(sel) * group > MAX_SCORE_ROWS:
    raise ValueError(f"score_queries: {len(sel)} queries x G={group} query heads per KV head "
                     f"= {len(sel) * group} rows, more than {MAX_SCORE_ROWS} (one q block)")
  return sel


def score_rows(num_selected: int, group: int) -> int:
  """Rows of the kernels' score output: the selected rows, padded to a multiple of 8."""
  return -(-num_selected * group // 8) * 8


def selected_first(selected: Sequence[int], queries: Sequence[int]) -> tuple[int, ...]:
  """`queries` reordered with the `selected` ones (a subset, in that order) first."""
  chosen = set(selected)
  return tuple(selected) + tuple(t for t in queries if t not in chosen)


def permute_queries(order: tuple[int, ...], q: jax.Array, mask: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
  """q [B, T, Hq, D] and the in-flight mask's rows [T, T] in `order` (a permutation of 0..T-1)."""
  if order == tuple(range(len(order))):
    return q, mask
  idx = np.array(order)
  return q[:, idx], mask[idx]


def wrapper_outputs(out: jax.Array, lse: jax.Array, probs: jax.Array | None,
                    order: tuple[int, ...], *, return_lse: bool):
  """A kernel wrapper's results in the caller's query order: out [B, T, Hq, D] and lse [B, T, Hq]
  (computed in `order`) put back; then out, lse if asked, probs if any (already in
  score_queries order)."""
  if order != tuple(range(len(order))):
    inverse = np.argsort(np.array(order))
    out, lse = out[:, inverse], lse[:, inverse]
  results = [out] + ([lse] if return_lse else []) + ([probs] if probs is not None else [])
  return results[0] if len(results) == 1 else tuple(results)


def scores_to_probs(scores: jax.Array, lse: jax.Array, weight: jax.Array, *, group: int
                    ) -> jax.Array:
  """scores [B, Hkv, R, S] fp32: rows r = i * G + g of the selected queries i (R >= n * G),
  scaled scores in log2 units, defined where weight > 0; lse [B, n, Hq] fp32 (natural log) of
  those queries' whole softmax; weight [B, Hkv or 1, S]: how often the query reads slot s (0:
  not at all). Returns probs [B, n, Hq, S] fp32 = weight * exp(score - lse), 0 where weight = 0.
  """
  b, hkv, _, capacity = scores.shape
  n = lse.shape[1]
  s2 = scores[:, :, :n * group].reshape(b, hkv, n, group, capacity)      # [B, Hkv, n, G, S]
  s2 = s2.transpose(0, 2, 1, 3, 4)                                         # [B, n, Hkv, G, S]
  lse2 = lse.reshape(b, n, hkv, group)[..., None] * LOG2E                  # [B, n, Hkv, G, 1]
  w = weight.astype(jnp.float32)[:, None, :, None, :]                      # [B, 1, Hkv, 1, S]
  # Unvisited slots hold whatever the output buffer held (NaN, say): select, don't multiply.
  probs = jnp.where(w > 0, w * jnp.exp2(s2 - lse2), 0.0)                   # [B, n, Hkv, G, S]
  return probs.reshape(b, n, hkv * group, capacity)


INFLIGHT_MODES = ("auto", "merged", "kernel", "jnp")
# "auto" lets the in-flight kernel merge the cache partials itself (`inflight_merged`: no combine)
#   * in a launch of at least MERGE_MIN_BLOCKS thread blocks (B x Hkv x q blocks) where no segment
#     has more than MERGE_MAX_SPLITS splits: each block folds its partials in one after another at
#     its end, and with many splits that chain is not hidden;
#   * in a smaller launch (whose q blocks split D over 2-8 blocks, `merge_chunks`, so the folds
#     spread over more SMs) when it writes [B, T, Hq, D] itself (64 % G == 0) or some segment
#     has more than MERGE_MAX_SPLITS splits. Left to the combine: small launches writing the
#     rows' layout (G = 3: SmolLM2) with few splits, where the wrapper's transpose costs what the
#     combine does.
# H200, device us per call, merged -> partial + combine (session 30,
# `results/s30/inflight_merge_s30_h200.json`): sparse B 8 16K (4 listed blocks) Tq 256 / 64 / 16
# 82.2 / 20.6 / 14.4 against 101.6 / 25.8 / 16.1; FAFO's 8B call 38.1 / 105.3 against 42.2 /
# 112.9 (4K / 32K), Lookahead's 60.1 against 64.2 (4K). With D split over blocks (session 31,
# `results/s31/inflight_chunks_s31_h200.json`): decode B 1 16K / 64K Tq 16 (8 blocks, 4 chunks,
# many splits) 29.9 / 74.7 against 32.1 / 76.9; sparse B 1 16K Tq 16 9.1 against 10.1; SmolLM2's
# FAFO call (18 blocks, G 3, 16 splits) 14.35 against 14.61, its Lookahead call (4 splits) 12.64
# against 12.29 (left to the combine).
MERGE_MAX_SPLITS = 4
MERGE_MIN_BLOCKS = 64


def check_inflight_mode(mode: str) -> None:
  """A kernel config's `inflight` field: one of INFLIGHT_MODES."""
  if mode not in INFLIGHT_MODES:
    raise ValueError(f"inflight must be one of {INFLIGHT_MODES}, got {mode!r}")


def inflight_choice(mode: str, num_queries: int) -> bool:
  """Whether a cache kernel's wrapper computes the in-flight part with
  `pallas_kernels.inflight_attention` ("kernel" or "merged") or in jnp inside the combine
  ("jnp"); "auto": the kernel from INFLIGHT_KERNEL_MIN_QUERIES queries on."""
  check_inflight_mode(mode)
  return mode in ("kernel", "merged") or (mode == "auto"
                                          and num_queries >= INFLIGHT_KERNEL_MIN_QUERIES)


def in_kernel_score(mode: str, q: jax.Array, k_new: jax.Array) -> bool:
  """Whether a cache kernel computes the Tq = 1 in-flight score q . k_new itself
  (`decode_attention.store_inflight_score`; the combine takes it as `given_scores`): "auto" at
  one query whose k_new has q's dtype (so the kernel reads it in place). "jnp" (at Tq = 1 the
  same call otherwise) keeps the combine's einsum, an XLA reduction launch (session 48, H200:
  1.2-1.5 us a call where k_new is an array; where XLA would have to copy k_new out of a fusion
  for the kernel, as in a model, the einsum is as fast: `sparsedec.attention`)."""
  check_inflight_mode(mode)
  return mode == "auto" and q.shape[1] == 1 and k_new.dtype == q.dtype


def inflight_merges(mode: str, num_queries: int, max_splits: int, blocks: int, group: int,
                    chunked: bool) -> bool:
  """Whether the in-flight kernel also merges the cache kernel's split partials and writes the
  call's output (`inflight_attention.inflight_merged`) instead of leaving one more partial for
  `combine_partials`: "merged" always, "auto" with the kernel by the rule above (`max_splits`:
  per q block, the most of any segment; `blocks`: B x Hkv x q blocks; `group`: G; `chunked`:
  whether the merged launch would split D over blocks, `inflight_attention.merge_chunks` > 1;
  a small launch that cannot is left to the combine)."""
  if not inflight_choice(mode, num_queries) or mode == "kernel":
    return False
  if mode == "merged":
    return True
  few_splits = max_splits <= MERGE_MAX_SPLITS
  if blocks >= MERGE_MIN_BLOCKS:
    return few_splits
  return chunked and (64 % group == 0 or not few_splits)


# The combine as one elementwise XLA fusion (`_combine_elementwise`) while it has at most this
# many partials per row and each exact key set at most UNROLL_MAX_KEYS keys; beyond, reductions.
UNROLL_MAX_PARTIALS = 64
UNROLL_MAX_KEYS = 4


def combine_partials(acc: jax.Array, m2: jax.Array, l: jax.Array, q: jax.Array,
                     exact: Sequence[tuple[jax.Array, jax.Array, jax.Array]], *, group: int,
                     extra: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                     given_scores: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array]:
  """acc [B, Hkv, NQB, NS, R, D] fp32; m2, l [B, Hkv, NQB, NS, 64] (m2 in log2 units; rows
  r = t * G + g of q block j are j * 64 + r); q [B, T, Hq, D];
  exact: (k [B, U, Hkv, D], v [B, U, Hkv, D], mask [B or 1, T, U] bool) key sets;
  extra: one more partial per q block (acc [B, Hkv, NQB, R, D], m2, l [B, Hkv, NQB, 64]: the
  in-flight kernel's), or None.
  given_scores: at T = 1, the first exact set's (one key's) unscaled q . k [B, Hkv, 64] fp32
  (rows r = g of q block 0, as the cache kernel's `store_inflight_score` writes them), used
  instead of computing them here; None: the einsum.
  Returns out [B, T, Hq, D] fp32 and lse [B, T, Hq] fp32.

  Everything stays in the kernels' [B, Hkv, NQB, (NS,) R] layout (no transpose or concatenation
  of the partials: XLA reads each partial once). With few partials and few exact keys (a Tq = 1
  decode step: NS splits and the token's own key) the merge is written per output element
  (`_combine_elementwise`), else with reductions over NS (`_combine_reduced`)."""
  b, hkv, nqb, ns, rows_out, d = acc.shape
  tq = q.shape[1]
  if given_scores is not None and (
      not exact or given_scores.ndim != 3 or given_scores.shape[:2] != (b, hkv)
      or given_scores.shape[2] < group or not jnp.issubdtype(given_scores.dtype, jnp.floating)):
    raise ValueError(f"given_scores must be a float [B={b}, Hkv={hkv}, >= G={group}] array for "
                     f"the first exact key set, got {given_scores.dtype}{list(given_scores.shape)}"
                     f" with {len(exact)} exact key sets")
  n_rows = tq * group                                                      # real rows
  rows = nqb * rows_out                                                    # >= n_rows
  parts = [(acc, m2[..., :rows_out] * LN2, l[..., :rows_out])]             # [B, Hkv, NQB, NS, R]
  if extra is not None:
    acc_e, m2_e, l_e = extra
    parts.append((acc_e[:, :, :, None], (m2_e[..., :rows_out] * LN2)[:, :, :, None],
                  l_e[..., :rows_out][:, :, :, None]))
  qg = q.reshape(b, tq, hkv, group, d)                                     # [B, T, Hkv, G, D]
  scores = []
  for i, (k, _, mask) in enumerate(exact):
    if i == 0 and given_scores is not None:
      if tq != 1 or k.shape[1] != 1:
        raise ValueError(f"given_scores need one query and one key, got T={tq}, U={k.shape[1]}")
      s = given_scores[:, :, :group].reshape(b, hkv, 1, group, 1) * d ** -0.5
    else:
      s = f32_einsum("bthgd,buhd->bhtgu", qg, k) * d ** -0.5                # [B, Hkv, T, G, U]
    s = jnp.where(mask[:, None, :, None, :], s, -jnp.inf).reshape(b, hkv, n_rows, -1)
    s = jnp.pad(s, [(0, 0), (0, 0), (0, rows - n_rows), (0, 0)], constant_values=-jnp.inf)
    scores.append(s.reshape(b, hkv, nqb, rows_out, -1))                    # [B, Hkv, NQB, R, U]
  values = [v for _, v, _ in exact]
  elementwise = (sum(a.shape[3] for a, _, _ in parts) <= UNROLL_MAX_PARTIALS
                 and all(s.shape[-1] <= UNROLL_MAX_KEYS for s in scores))
  merge = _combine_elementwise if elementwise else _combine_reduced
  o, lse = merge(parts, scores, values)                                    # [B, Hkv, NQB, R(, D)]
  o = o.reshape(b, hkv, rows, d)[:, :, :n_rows]                            # [B, Hkv, N, D]
  lse = lse.reshape(b, hkv, rows)[:, :, :n_rows]                           # [B, Hkv, N]
  out = o.reshape(b, hkv, tq, group, d).transpose(0, 2, 1, 3, 4).reshape(b, tq, hkv * group, d)
  lse = lse.reshape(b, hkv, tq, group).transpose(0, 2, 1, 3).reshape(b, tq, hkv * group)
  return out, lse


def _combine_reduced(parts, scores, values):
  """The merge with reductions over the splits (NS) and the exact keys (U).
  parts: (acc [B, Hkv, NQB, NS, R, D], m [B, Hkv, NQB, NS, R] natural log, l [..., NS, R]);
  scores: [B, Hkv, NQB, R, U] per exact set, values: its v [B, U, Hkv, D].
  Returns o [B, Hkv, NQB, R, D] and lse [B, Hkv, NQB, R]."""
  # initial: a key set of U = 0 keys (an empty full-precision segment) has no maximum.
  m_tot = functools.reduce(jnp.maximum, [m.max(3) for _, m, _ in parts]
                           + [s.max(-1, initial=-jnp.inf) for s in scores])  # [B, Hkv, NQB, R]
  m_tot = _finite_or_zero(m_tot)
  denom, o = 0.0, 0.0
  for a, m, s in parts:
    w = jnp.exp(m - m_tot[:, :, :, None])                                  # [B, Hkv, NQB, NS, R]
    denom = denom + (w * s).sum(3)                                         # [B, Hkv, NQB, R]
    o = o + (w[..., None] * a).sum(3)                                      # [B, Hkv, NQB, R, D]
  for v, s in zip(values, scores):
    p = jnp.exp(s - m_tot[..., None])                                      # [B, Hkv, NQB, R, U]
    denom = denom + p.sum(-1)
    o = o + f32_einsum("bhjru,buhd->bhjrd", p.astype(v.dtype), v)
  o = o * jnp.where(denom > 0, 1.0 / denom, 0.0)[..., None]
  return o, m_tot + jnp.log(denom)


def _combine_elementwise(parts, scores, values):
  """The merge of `_combine_reduced` (same arguments and results, up to fp32 summation order and
  one rounding: the exact keys' weights multiply v in fp32, not rounded to v's dtype first) written
  per output element [B, Hkv, NQB, R, D]: every row statistic (m, l, the exact keys'
  scores) is broadcast over D first, and the splits and keys are unrolled, so the whole merge is
  elementwise and XLA can emit it as one loop fusion (each thread recomputes its row's max and
  weights, a few dozen exps) instead of a reduction kernel for the row statistics and a second
  one for the output. lse, per row, comes from the same expressions before the broadcast."""
  d = parts[0][0].shape[-1]
  terms = []                                   # (score, row sum or None, value) per element
  for a, m, l in parts:
    for i in range(a.shape[3]):
      terms.append((m[:, :, :, i], l[:, :, :, i], a[:, :, :, i]))          # [.., R], [.., R, D]
  for v, s in zip(values, scores):
    vt = v.astype(jnp.float32).transpose(0, 2, 1, 3)                       # [B, Hkv, U, D]
    for u in range(s.shape[-1]):
      terms.append((s[..., u], None, vt[:, :, None, None, u]))             # [.., R], [.., 1, 1, D]

  def weights(stats):
    """Each term's softmax weight exp(m - max) and the weighted row-sum total, from the terms'
    row statistics as given (per row, or broadcast per element)."""
    m_tot = _finite_or_zero(functools.reduce(jnp.maximum, [m for m, _ in stats]))
    w = [jnp.exp(m - m_tot) for m, _ in stats]
    return m_tot, w, sum(wi if l is None else wi * l for wi, (_, l) in zip(w, stats))

  def wide(x):                                 # [.., R] -> [.., R, D] (None stays None)
    return None if x is None else jnp.broadcast_to(x[..., None], (*x.shape, d))

  _, w, denom = weights([(wide(m), wide(l)) for m, l, _ in terms])         # [.., R, D] each
  o = sum(wi * a for wi, (_, _, a) in zip(w, terms))
  o = o * jnp.where(denom > 0, 1.0 / denom, 0.0)
  m_row, _, denom_row = weights([(m, l) for m, l, _ in terms])             # [.., R] each
  return o, m_row + jnp.log(denom_row)


def _finite_or_zero(m: jax.Array) -> jax.Array:
  """A merged row max, 0 where no key was seen (-inf), so exp(m_s - max) stays defined."""
  return jnp.where(jnp.isfinite(m), m, 0.0)
