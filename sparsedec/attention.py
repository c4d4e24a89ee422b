"""Attention for one forward: in-flight queries against a committed cache plus in-flight K/V.

One entry point, `attend`. An `AttentionPlan` says what each in-flight query reads:
  * `segments`: consecutive query ranges, each with a cache *view* (`FullView`: every committed
    entry of its row; `BlockListView`: listed blocks; `QuantView`: QuantSpec's quantized cache
    read at 4 or 8 bits, plus its full-precision buffer and optional extra in-flight K/V),
  * `inflight_mask` [T, T]: which in-flight tokens each query sees (causal, n-gram columns, trees).
Queries always attend with the committed part and the in-flight part normalised together
(a two-part softmax, so the cache is never concatenated with the new entries).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.combine import f32_einsum
from sparsedec.errors import UnsupportedConfigError, is_int
from sparsedec.model.config import ATTENTION_IMPLS


@struct.dataclass
class FullView:
  """Read all committed entries of the row (slots 0 .. lengths[b]-1)."""


@struct.dataclass
class BlockListView:
  """Read the listed cache blocks of each (row, KV head): entries i < counts[b, h] of
  tables[b, h] (distinct block indices; block j is slots [j * block_size, (j + 1) * block_size)),
  and only slots < lengths[b]. A compressed cache C(kv) (StreamingLLM's sinks + recent window,
  Quest's pages, SnapKV's selection, TriForce's chunks) is one of these.

  With `per_layer`, tables/counts carry a leading layer axis ([L, B, Hkv, NB], [L, B, Hkv]) and
  the forward reads layer i's lists (`at_layer`)."""
  tables: jax.Array                               # [(L,) B, Hkv, NB] int32
  counts: jax.Array                               # [(L,) B, Hkv] int32
  block_size: int = struct.field(pytree_node=False)
  per_layer: bool = struct.field(pytree_node=False, default=False)

  def at_layer(self, i: int) -> "BlockListView":
    if not self.per_layer:
      return self
    return BlockListView(self.tables[i], self.counts[i], self.block_size)

  def slot_mask(self, lengths: jax.Array, capacity: int) -> jax.Array:
    """[B, Hkv, S] bool: the slots this view reads (a capacity that is not a multiple of
    block_size ends in a partial block; the kernels refuse it, so "auto" comes here)."""
    n_blocks = -(-capacity // self.block_size)
    listed = jnp.arange(self.tables.shape[-1]) < self.counts[..., None]        # [B, Hkv, NB]
    hit = (self.tables[..., None] == jnp.arange(n_blocks)) & listed[..., None]  # [B,Hkv,NB,S/bs]
    per_slot = jnp.repeat(hit.any(-2), self.block_size, axis=-1)[..., :capacity]  # [B, Hkv, S]
    return per_slot & (jnp.arange(capacity) < lengths[:, None, None])


@struct.dataclass
class QuantView:
  """Read a `sparsedec.kv.quantized.QuantizedCache` instead of the forward's dense cache: the
  quantized prefix dequantized at `bits` (4: upper nibbles, the draft; 8: both, the verifier),
  then the full-precision double buffer, then `extra` K/V (the draft's own earlier in-flight
  tokens, positions lengths[b] + j for j < extra_len[b]), all in one softmax with the forward's
  in-flight tokens. The dense k_cache/v_cache handed to `attend` are not read by this segment.

  Exactness across a flush boundary: a query at position p reads, like a one-token-per-step
  decoder with p committed tokens would, slots < quantized_length(p) quantized. When that is one
  group beyond the cache's quant_len (a verification window crossing the next flush), CF1 is
  quantized on the fly (bit-identical to the later flush) and read at `bits` by that query only.

  The tail (every layer's [CF1 quantized on the fly, read at `bits` | the 2G buffer slots])
  depends on the cache and `bits` only: a caller running several forwards on one cache (the
  gamma drafts of a QuantSpec step) computes it once with `with_tail()`; otherwise each forward
  computes it (fp32).

  The forward reaches it through the plan (`Segment(QuantView(...), 0, T)`); `at_layer(i)` picks
  layer i's arrays. Reference path: dequantize, then `reference_attention` (fp32). Kernel path
  (GPU, bf16/fp16, head_dim 64 or 128, group a multiple of 64): `quant_attention` reads the
  quantized prefix at `bits` and, in the same launch and softmax, the rest as key sets in q's
  dtype (`_quant_kernel_attention`, `quant_attention_with_keys`)."""
  cache: Any                                      # QuantizedCache (every layer)
  # extra_k / extra_v: indexed by layer (a tuple, or one stacked [L, B, W, Hkv, D] array).
  extra_k: Any = None                             # per layer [B, W, Hkv, D] or None
  extra_v: Any = None                             # per layer [B, W, Hkv, D] or None
  extra_len: Any = None                           # [B] int32 or None
  tail_k: Any = None                              # per layer [B, 3G, Hkv, D] or None
  tail_v: Any = None                              # per layer [B, 3G, Hkv, D] or None
  bits: int = struct.field(pytree_node=False, default=8)
  layer: int | None = struct.field(pytree_node=False, default=None)
  tail_bits: int | None = struct.field(pytree_node=False, default=None)

  def __post_init__(self):
    if not is_int(self.bits) or self.bits not in (4, 8):
      raise UnsupportedConfigError(f"QuantView bits must be 4 or 8, got {self.bits!r}")

  def at_layer(self, i: int) -> QuantView:
    return self.replace(layer=i)

  def with_tail(self, dtype=jnp.float32) -> QuantView:
    """This view with every layer's tail computed now (see the class docstring), stored in
    `dtype`: fp32 (the default) is what a forward computes itself; the cache's dtype halves the
    bytes and lets the kernel path attend it with bf16/fp16 dots (fp32 accumulation), the
    re-quantized CF1 values then rounded to that dtype (QuantSpec's draft does this)."""
    tail_k, tail_v = _layer_tails(self.cache, range(len(self.cache.buf_k)), self.bits, dtype)
    return self.replace(tail_k=tail_k, tail_v=tail_v, tail_bits=self.bits)


@struct.dataclass
class Segment:
  view: Any                                       # FullView | ... (a pytree)
  start: int = struct.field(pytree_node=False)    # first query index (inclusive)
  stop: int = struct.field(pytree_node=False)     # last query index (exclusive)


@struct.dataclass
class AttentionPlan:
  inflight_mask: jax.Array                        # [T, T] bool: query t sees in-flight key u
  segments: tuple[Segment, ...] = struct.field(pytree_node=True)

  @property
  def num_tokens(self) -> int:
    return self.inflight_mask.shape[-1]

  def at_layer(self, i: int) -> "AttentionPlan":
    """The plan as layer i reads it (per-layer block lists sliced)."""
    segments = tuple(Segment(seg.view.at_layer(i), seg.start, seg.stop)
                     if hasattr(seg.view, "at_layer") else seg for seg in self.segments)
    return AttentionPlan(inflight_mask=self.inflight_mask, segments=segments)


def check_segments(plan: AttentionPlan, num_tokens: int) -> None:
  """A plan's segments must cover the queries [0, T) in order, each once and none empty (a gap
  dropped queries on the reference path, an overlap duplicated them, and the kernels follow
  their own layout)."""
  bounds = [(seg.start, seg.stop) for seg in plan.segments]
  edges = [0] + [stop for _, stop in bounds]
  if (not bounds or [start for start, _ in bounds] != edges[:-1] or edges[-1] != num_tokens
      or any(start >= stop for start, stop in bounds)):
    raise ValueError(f"plan segments {bounds} must cover the queries [0, {num_tokens}) in order, "
                     f"each query once, none empty")


def causal_plan(num_tokens: int, view: Any = None) -> AttentionPlan:
  """Every query reads the cache through `view` (None: the full cache) and the in-flight tokens
  up to itself."""
  mask = jnp.asarray(np.tril(np.ones((num_tokens, num_tokens), dtype=bool)))
  view = FullView() if view is None else view
  return AttentionPlan(inflight_mask=mask, segments=(Segment(view, 0, num_tokens),))


def _cache_mask(view, lengths: jax.Array, q_pos: jax.Array, capacity: int,
                window: int | None) -> jax.Array:
  """[B, 1 or Hkv, Tseg, S] bool: which cache slots each query of the segment reads."""
  slots = jnp.arange(capacity, dtype=jnp.int32)
  if isinstance(view, FullView):
    mask = (slots[None, :] < lengths[:, None])[:, None, None, :]           # [B, 1, 1, S]
  elif isinstance(view, BlockListView):
    if view.per_layer:
      raise ValueError("a per-layer BlockListView must be sliced with at_layer first")
    mask = view.slot_mask(lengths, capacity)[:, :, None, :]                 # [B, Hkv, 1, S]
  else:
    raise TypeError(f"unknown cache view {type(view).__name__}")
  if window is not None:
    mask = mask & ((q_pos[:, :, None] - slots[None, None, :]) < window)[:, None]
  return jnp.broadcast_to(mask, (lengths.shape[0], mask.shape[1], q_pos.shape[1], capacity))


def _f32_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """einsum with fp32 accumulation. XLA:CPU does not run every bf16 x bf16 -> f32 dot (its
  DotThunk refuses some, jax 0.11.2), so where the call is lowered for a CPU the operands are
  upcast (the same products; GPUs accumulate bf16 products in fp32 natively). fp32 operands are multiplied at full fp32 precision, as `linear` does (jax's
  default precision computes fp32 dots in TF32 on recent GPUs)."""
  if a.dtype == jnp.float32 and b.dtype == jnp.float32:
    return f32_einsum(spec, a, b)
  f32 = lambda x: x.astype(jnp.float32)
  return jax.lax.platform_dependent(cpu=lambda: f32_einsum(spec, f32(a), f32(b)),
                                    default=lambda: f32_einsum(spec, a, b))


def reference_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                        cache_mask: jax.Array, k_new: jax.Array, v_new: jax.Array,
                        inflight_mask: jax.Array, return_lse: bool = False):
  """Pure-jnp attention, fp32 softmax and accumulation.

  q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; cache_mask [B, T, S] or [B, 1|Hkv, T, S];
  k_new, v_new [B, U, Hkv, D]; inflight_mask [B, T, U]. Returns out [B, T, Hq, D] (q's dtype)
  and, with return_lse, the log-sum-exp [B, T, Hq] (fp32).
  """
  b, t, hq, d = q.shape
  hkv = k_cache.shape[1]
  qg = q.reshape(b, t, hkv, hq // hkv, d)                                   # [B, T, Hkv, G, D]
  scale = d ** -0.5
  s_c = _f32_einsum("bthgd,bhsd->bhgts", qg, k_cache) * scale             # [B, Hkv, G, T, S]
  s_n = _f32_einsum("bthgd,buhd->bhgtu", qg, k_new) * scale               # [B, Hkv, G, T, U]
  if cache_mask.ndim == 3:
    cache_mask = cache_mask[:, None]                                        # [B, 1, T, S]
  s_c = jnp.where(cache_mask[:, :, None], s_c, -jnp.inf)
  s_n = jnp.where(inflight_mask[:, None, None], s_n, -jnp.inf)
  m = jnp.maximum(s_c.max(-1), s_n.max(-1))                                 # [B, Hkv, G, T]
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p_c = jnp.exp(s_c - m[..., None])
  p_n = jnp.exp(s_n - m[..., None])
  denom = p_c.sum(-1) + p_n.sum(-1)                                         # [B, Hkv, G, T]
  o = (_f32_einsum("bhgts,bhsd->bthgd", p_c.astype(v_cache.dtype), v_cache)
       + _f32_einsum("bhgtu,buhd->bthgd", p_n.astype(v_new.dtype), v_new))  # [B, T, Hkv, G, D]
  inv = jnp.where(denom > 0, 1.0 / denom, 0.0).transpose(0, 3, 1, 2)[..., None]  # [B,T,Hkv,G,1]
  out = (o * inv).reshape(b, t, hq, d).astype(q.dtype)
  if not return_lse:
    return out
  lse = (m + jnp.log(denom)).transpose(0, 3, 1, 2).reshape(b, t, hq)
  return out, lse


def _layer_tails(cache, layers, bits: int, dtype=jnp.float32
                 ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
  """The listed layers' [CF1 quantized and read at `bits` (G) | buffer (2G)] K/V, each
  [B, 3G, Hkv, D] in `dtype` (the key-set layout of `quant_attention_with_keys`). The layers' CF1
  halves go through the quantizer as one batch (`stacked_cf1`), not one layer at a time: a
  30-layer SmolLM2 QuantSpec decode loop's HLO went from 40,780 to 24,913 instructions (CPU
  compile and run unchanged within noise); H200, 8B shapes at 128K: QuantSpec.step 27.7 -> 27.4
  ms, 8K unchanged (benchmarks/NOTES.md, session 21)."""
  from pallas_kernels.quant_attention import fake_quantize
  from sparsedec.kv.quantized import stacked_cf1, unstacked
  g = cache.group
  bufs_k, bufs_v = [cache.buf_k[i] for i in layers], [cache.buf_v[i] for i in layers]
  k_1, v_1 = fake_quantize(stacked_cf1(bufs_k, g), stacked_cf1(bufs_v, g), g, bits)

  def tail(x_1, bufs):            # x_1 [L * B, Hkv, G, D] -> L x [B, 3G, Hkv, D]
    return tuple(jnp.concatenate([x, buf.astype(jnp.float32)], axis=2).astype(dtype)
                 .transpose(0, 2, 1, 3) for x, buf in zip(unstacked(x_1, len(bufs)), bufs))
  return tail(k_1, bufs_k), tail(v_1, bufs_v)


def _quant_view_tail(view: QuantView, q_pos: jax.Array
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The full-precision side of a QuantView read by the queries at q_pos [B, Tseg] (layer
  view.layer), all but the quantized prefix and the `extra` slots: [CF1 re-quantized G |
  buffer 2G]. Returns k, v [B, 3G, Hkv, D] (fp32, or the dtype `with_tail` stored) and mask
  [B, Tseg, 3G] bool.

  CF1 re-quantized (read at view.bits) replaces the buffer's CF1 for the queries whose
  quantized_length(position) is one group beyond the cache's quant_len (the flush rule)."""
  from sparsedec.kv.quantized import quantized_length
  cache, i = view.cache, view.layer
  g = cache.group
  b, t = q_pos.shape
  if view.tail_k is None:
    (k,), (v,) = _layer_tails(cache, (i,), view.bits)
  elif view.tail_bits != view.bits:
    raise ValueError(f"QuantView tail was computed at {view.tail_bits} bits, the view reads "
                     f"{view.bits}: call with_tail() again")
  else:
    k, v = view.tail_k[i], view.tail_v[i]
  buf_len = cache.buf_len[:, None, None]
  promote = (quantized_length(q_pos, g) > cache.quant_len[:, None])[:, :, None]  # [B, Tseg, 1]
  slot_1 = jnp.arange(g)[None, None, :]
  slot_b = jnp.arange(2 * g)[None, None, :]
  mask = jnp.concatenate([jnp.broadcast_to(promote & (slot_1 < buf_len), (b, t, g)),
                          (slot_b < buf_len) & ~(promote & (slot_b < g))], axis=2)
  return k, v, mask


def _quant_view_extra(view: QuantView, q_pos: jax.Array):
  """The `extra` slots of a QuantView (layer view.layer): k, v [B, W, Hkv, D] in their dtype and
  mask [B, Tseg, W] bool, or None."""
  if view.extra_k is None:
    return None
  i = view.layer
  ek, ev = view.extra_k[i], view.extra_v[i]                                # [B, W, Hkv, D]
  b, t = q_pos.shape
  w = ek.shape[1]
  mask = jnp.broadcast_to(jnp.arange(w)[None, None, :] < view.extra_len[:, None, None], (b, t, w))
  return ek, ev, mask


def _check_quant_view(view: QuantView, window: int | None) -> None:
  if window is not None:
    raise UnsupportedConfigError(f"QuantView does not support sliding windows ({window})")
  if view.layer is None:
    raise ValueError("a QuantView must be sliced with at_layer first")


def _quant_view_attention(q: jax.Array, view: QuantView, k_new: jax.Array, v_new: jax.Array,
                          q_pos: jax.Array, inflight: jax.Array, window: int | None) -> jax.Array:
  """Reference attention of one QuantView segment (see QuantView). q [B, Tseg, Hq, D];
  inflight [B, Tseg, T]. Cache slots: [quantized Sq | CF1 re-quantized G | buffer 2G | extra W],
  all dequantized to fp32 (q's dtype when that is fp32), one fp32 softmax."""
  from pallas_kernels.quant_attention import dequantize
  _check_quant_view(view, window)
  cache = view.cache
  dtype = q.dtype if q.dtype == jnp.float32 else jnp.float32
  k_q, v_q = dequantize(cache.codes[view.layer], view.bits, dtype=dtype)   # [B, Hkv, Sq, D]
  k_t, v_t, mask_t = _quant_view_tail(view, q_pos)                         # [B, 3G, Hkv, D]
  ks, vs, masks = [k_q, k_t.transpose(0, 2, 1, 3)], [v_q, v_t.transpose(0, 2, 1, 3)], [mask_t]
  extra = _quant_view_extra(view, q_pos)
  if extra is not None:
    ks.append(extra[0].transpose(0, 2, 1, 3))
    vs.append(extra[1].transpose(0, 2, 1, 3))
    masks.append(extra[2])
  b, t = q.shape[:2]
  sq = k_q.shape[2]
  mask_q = jnp.broadcast_to(jnp.arange(sq)[None, None, :] < cache.quant_len[:, None, None],
                            (b, t, sq))
  out = reference_attention(q.astype(dtype), jnp.concatenate([x.astype(dtype) for x in ks], 2),
                            jnp.concatenate([x.astype(dtype) for x in vs], 2),
                            jnp.concatenate([mask_q] + masks, axis=2), k_new.astype(dtype),
                            v_new.astype(dtype), inflight)
  return out.astype(q.dtype)


def _quant_kernel_attention(q: jax.Array, view: QuantView, k_new: jax.Array, v_new: jax.Array,
                            q_pos: jax.Array, inflight: jax.Array, interpret) -> jax.Array:
  """One QuantView segment with `pallas_kernels.quant_attention`; equals _quant_view_attention.

  The kernel reads the quantized prefix (slots < quant_len at view.bits); everything else goes
  in as key sets with their per-query masks (`quant_attention_with_keys`), attended by the
  same launch inside the same softmax: the tail [CF1 re-quantized or full precision per query |
  the buffer] (3G keys, precomputed by `QuantView.with_tail` in the cache's dtype, or computed
  here in fp32), the `extra` draft scratch (W) and the in-flight tokens (T). Each is read where
  it lies when in q's dtype (`exact_keys`: a piece's last 64-key tile reads past its end,
  zero-filled and masked off). q [B, Tseg, Hq, D] bf16/fp16; inflight
  [B, Tseg, T]."""
  from pallas_kernels.quant_attention import QuantAttentionConfig, quant_attention_with_keys
  _check_quant_view(view, None)
  key_sets = [_quant_view_tail(view, q_pos)]                               # [B, 3G, Hkv, D]
  extra = _quant_view_extra(view, q_pos)
  if extra is not None:
    key_sets.append(extra)                                                 # [B, W, Hkv, D]
  key_sets.append((k_new, v_new, inflight))                                # [B, T, Hkv, D]
  return quant_attention_with_keys(q, view.cache.codes[view.layer], view.cache.quant_len,
                                   tuple(key_sets), bits=view.bits, config=QuantAttentionConfig(),
                                   interpret=interpret)


def _quant_kernel_choice(q: jax.Array, plan: AttentionPlan,
                         window: int | None) -> tuple[str | None, str]:
  """("quant", "") when every segment is a QuantView the quant_attention kernel can read."""
  views = [seg.view for seg in plan.segments]
  if not all(isinstance(v, QuantView) for v in views):
    return None, "a plan mixing QuantView segments with other cache views"
  if window is not None:
    return None, f"sliding window {window} with a QuantView"
  if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return None, f"dtype {q.dtype} (quant_attention takes bfloat16 or float16)"
  if q.shape[-1] not in (64, 128):
    return None, f"head_dim {q.shape[-1]} (quant_attention takes 64 or 128)"
  from pallas_kernels.quant_attention import KEY_TILE as tile   # the kernel picks its stage
  for view in views:
    group = view.cache.group
    if group % tile:
      return None, f"quant group {group} is not a multiple of the kernel's {tile}-slot tile"
    capacity = view.cache.quant_capacity
    if capacity == 0 or capacity % tile:
      return None, f"quantized capacity {capacity} is not a positive multiple of {tile}"
  return "quant", ""


def _kernel_choice(q: jax.Array, k_cache: jax.Array, plan: AttentionPlan,
                   window: int | None) -> tuple[str | None, str]:
  """("decode" | "sparse" | "quant", "") when a Pallas kernel computes this attention (exactly,
  or for "quant" up to rounding its full-precision keys to q's dtype), else (None, why not).
  decode_attention: every segment reads FullView. sparse_attention: a BlockListView segment
  first, then optionally one FullView segment (FAFO's plan). quant_attention: every segment is
  a QuantView (one kernel call per segment)."""
  if any(isinstance(seg.view, QuantView) for seg in plan.segments):
    return _quant_kernel_choice(q, plan, window)
  if window is not None and window < k_cache.shape[2] + q.shape[1]:
    return None, f"sliding window {window} is shorter than the cache capacity plus in-flight tokens"
  if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return None, f"dtype {q.dtype} (the kernels take bfloat16 or float16)"
  if k_cache.dtype != q.dtype:
    return None, f"cache dtype {k_cache.dtype} differs from q's {q.dtype} (the kernels take one)"
  if q.shape[-1] % 64:
    return None, f"head_dim {q.shape[-1]} is not a multiple of 64"
  views = [seg.view for seg in plan.segments]
  if all(isinstance(v, FullView) for v in views):
    if k_cache.shape[2] % 64:      # decode_attention's smallest tile (DecodeConfig.resolve)
      return None, f"cache capacity {k_cache.shape[2]} is not a multiple of 64"
    return "decode", ""
  if (isinstance(views[0], BlockListView) and all(isinstance(v, FullView) for v in views[1:])
      and plan.segments[0].start == 0):
    block_size = views[0].block_size
    if block_size % 64:
      return None, f"block_size {block_size} is not a multiple of 64"
    if k_cache.shape[2] % block_size:
      return None, f"cache capacity {k_cache.shape[2]} is not a multiple of block_size {block_size}"
    return "sparse", ""
  return None, "the plan's segments are not [block list][full cache] or all full-cache"


def kernel_choice(q: jax.Array, k_cache: jax.Array, plan: AttentionPlan,
                  window: int | None = None) -> tuple[str | None, str]:
  """Which Pallas kernel `attend` would use for this call on a GPU ("decode", "sparse", "quant"),
  or (None, the reason none applies): what "auto" falls back on, "pallas" refuses."""
  return _kernel_choice(q, k_cache, plan, window)


def _interpret_params(impl: str):
  if impl != "interpret":
    return None
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.InterpretGPUParams()


def _kernel_attention(kind, q, k_cache, v_cache, lengths, k_new, v_new, q_pos, plan, impl):
  interpret = _interpret_params(impl)
  mask = plan.inflight_mask.astype(bool)
  if kind == "quant":
    b, t = q.shape[:2]
    inflight = jnp.broadcast_to(mask, (b, t, t))
    outs = [_quant_kernel_attention(q[:, seg.start:seg.stop], seg.view, k_new, v_new,
                                    q_pos[:, seg.start:seg.stop],
                                    inflight[:, seg.start:seg.stop], interpret)
            for seg in plan.segments]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
  # A model's k_new is its RoPE'd keys, which XLA otherwise fuses into the cache write and the
  # combine's q . k_new: the kernels' Tq = 1 score ("auto") would need them as an array, one
  # copy launch for the reduction it saves (SmolLM2-shaped dense step, H200, device us a step:
  # 1151.5 with the einsum, 1167.0 with the kernel's score; `benchmarks/results/s48/`). So at
  # Tq = 1 "jnp", which is "auto" but for that score.
  inflight = "jnp" if q.shape[1] == 1 else "auto"
  if kind == "decode":
    from pallas_kernels.decode_attention import DecodeConfig, decode_attention
    return decode_attention(q, k_cache, v_cache, lengths, k_new, v_new, mask,
                            config=DecodeConfig(inflight=inflight), interpret=interpret)
  from pallas_kernels.sparse_attention import SparseConfig, sparse_attention
  first = plan.segments[0]
  view = first.view
  return sparse_attention(q, k_cache, v_cache, view.tables, view.counts, lengths, k_new, v_new,
                          mask, block_size=view.block_size, sparse_queries=first.stop,
                          config=SparseConfig(inflight=inflight), interpret=interpret)


def _check_quant_view_extra(view: QuantView, b: int, hkv: int, d: int) -> None:
  """A QuantView's `extra` arrays at its layer: k / v [B, W, Hkv, D] floating, extra_len [B]
  integer (the reference broadcast a batch-1 or a [1] length silently)."""
  if view.extra_k is None:
    return
  if view.layer is None or view.extra_v is None or view.extra_len is None:
    return                     # _check_quant_view / the read name what is missing
  ek, ev = view.extra_k[view.layer], view.extra_v[view.layer]
  for name, x in (("extra_k", ek), ("extra_v", ev)):
    if x.ndim != 4 or x.shape[0] != b or x.shape[2:] != (hkv, d) or x.shape != ek.shape:
      raise ValueError(f"attend: QuantView {name} must be [B={b}, W, Hkv={hkv}, D={d}] (k and v "
                       f"alike), got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"attend: QuantView {name} must be floating point, got {x.dtype}")
  n = view.extra_len
  if n.shape != (b,) or not jnp.issubdtype(n.dtype, jnp.integer):
    raise ValueError(f"attend: QuantView extra_len must be [B={b}] integer, got shape "
                     f"{n.shape} {n.dtype}")


def _check_attend_inputs(q, k_cache, v_cache, lengths, k_new, v_new, q_pos, plan) -> None:
  """attend's shapes and dtypes (static: works under jit), checked before either path. The
  reference path broadcast what the kernels refuse: a cache, k_new / v_new or block list of
  batch 1 (or Hkv 1) against B rows, lengths [1], an inflight mask [T] or [1, T] read as every
  query's row, and a float 0 / -inf bias mask read as its inverse (nonzero -> True; on the
  kernel path attend's cast to bool hid it from the kernel's own check): silent wrong numbers."""
  arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, lengths=lengths, k_new=k_new,
                v_new=v_new, q_pos=q_pos, inflight_mask=plan.inflight_mask)
  for name, x in arrays.items():
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"attend: {name} must be an array, got {type(x).__name__}")
  if q.ndim != 4:
    raise ValueError(f"attend: q must be [B, T, Hq, D], got shape {q.shape}")
  b, t, hq, d = q.shape
  if k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[3] != d:
    raise ValueError(f"attend: k_cache must be [B={b}, Hkv, S, D={d}], got shape {k_cache.shape}")
  hkv = k_cache.shape[1]
  if v_cache.shape != k_cache.shape:
    raise ValueError(f"attend: v_cache shape {v_cache.shape} differs from k_cache shape "
                     f"{k_cache.shape}")
  if hkv < 1 or hq % hkv:
    raise ValueError(f"attend: Hq={hq} query heads is not a multiple of Hkv={hkv} KV heads")
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.shape != (b, t, hkv, d):
      raise ValueError(f"attend: {name} must be [B, T, Hkv, D] = {(b, t, hkv, d)}, got "
                       f"{x.shape}")
  for name in ("q", "k_cache", "v_cache", "k_new", "v_new"):
    if not jnp.issubdtype(arrays[name].dtype, jnp.floating):
      raise ValueError(f"attend: {name} must be floating point, got {arrays[name].dtype}")
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"attend: lengths must be [B={b}] integer, got shape {lengths.shape} "
                     f"{lengths.dtype}")
  if q_pos.shape != (b, t) or not jnp.issubdtype(q_pos.dtype, jnp.integer):
    raise ValueError(f"attend: q_pos must be [B, T] = {(b, t)} integer, got shape {q_pos.shape} "
                     f"{q_pos.dtype}")
  mask = plan.inflight_mask
  if tuple(mask.shape) != (t, t):
    raise ValueError(f"attend: plan.inflight_mask must be [T, T] = {[t, t]}, got shape "
                     f"{tuple(mask.shape)}")
  if not (jnp.dtype(mask.dtype) == jnp.dtype(bool) or jnp.issubdtype(mask.dtype, jnp.integer)):
    raise ValueError(f"attend: plan.inflight_mask must be bool (True: the query sees the key), "
                     f"got {mask.dtype} (a 0 / -inf bias mask would read as its inverse)")
  for seg in plan.segments:
    view = seg.view
    if isinstance(view, QuantView):
      _check_quant_view_extra(view, b, hkv, d)
    if not isinstance(view, BlockListView):
      continue
    if view.per_layer:
      raise ValueError("a per-layer BlockListView must be sliced with at_layer first")
    tables, counts = view.tables, view.counts
    if tables.ndim != 3 or tables.shape[:2] != (b, hkv):
      raise ValueError(f"attend: BlockListView tables must be [B={b}, Hkv={hkv}, NB], got "
                       f"shape {tables.shape}")
    if counts.shape != (b, hkv):
      raise ValueError(f"attend: BlockListView counts must be [B, Hkv] = {(b, hkv)}, got shape "
                       f"{counts.shape}")
    for name, x in (("tables", tables), ("counts", counts)):
      if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"attend: BlockListView {name} must be integer, got {x.dtype}")


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
           k_new: jax.Array, v_new: jax.Array, q_pos: jax.Array, plan: AttentionPlan,
           window: int | None = None, impl: str = "auto") -> jax.Array:
  """Attention of in-flight queries q [B, T, Hq, D] at positions q_pos [B, T].

  k_cache, v_cache [B, Hkv, S, D] with lengths [B]; k_new, v_new [B, T, Hkv, D]. In-flight key u
  has position q_pos[:, u]. Returns [B, T, Hq, D].

  impl (`ModelConfig.attention`): "auto" runs a Pallas kernel where the call is lowered for a
  CUDA GPU (the platform of the arrays' devices, not the default backend) and one applies
  (`kernel_choice`: decode_attention when every segment reads FullView; sparse_attention for a
  block-list segment followed by an optional full-cache one; quant_attention when every segment
  is a QuantView; bf16/fp16, head_dim % 64 == 0 (64 or 128 for quant_attention), capacity a
  multiple of the kernel's tile or block size, quant group a multiple of 64, no effective sliding
  window) and the jnp reference otherwise (where no kernel applies, with a warning naming why,
  once per reason, when the default backend is a GPU);
  "reference" always the jnp reference; "pallas" always the kernel (raises
  UnsupportedConfigError naming why where none applies); "interpret" the kernel in the Mosaic GPU
  interpreter (for CPU tests; raises like "pallas").
  """
  if impl not in ATTENTION_IMPLS:
    raise UnsupportedConfigError(f"attention impl {impl!r} is not one of {ATTENTION_IMPLS}")
  _check_attend_inputs(q, k_cache, v_cache, lengths, k_new, v_new, q_pos, plan)
  check_segments(plan, q.shape[1])
  reference = lambda: _reference_attend(q, k_cache, v_cache, lengths, k_new, v_new, q_pos, plan,
                                        window)
  if impl == "reference":
    return reference()
  kind, blocker = _kernel_choice(q, k_cache, plan, window)
  if impl in ("pallas", "interpret") and kind is None:
    raise UnsupportedConfigError(f"attention={impl!r}: no Pallas kernel applies: {blocker}")
  kernel = lambda: _kernel_attention(kind, q, k_cache, v_cache, lengths, k_new, v_new, q_pos,
                                     plan, impl)
  if impl != "auto":
    return kernel()
  if kind is None:
    if jax.default_backend() == "gpu":
      warnings.warn(f"attention='auto' runs the jnp reference on this GPU: {blocker}",
                    stacklevel=2)
    return reference()
  # The platform the call is lowered for picks the branch (the other is traced, not lowered):
  # the Mosaic GPU kernels on CUDA, the reference elsewhere, whatever the default backend is
  # (arrays on a CPU device of a GPU host, user-written jits lowered for another platform).
  return jax.lax.platform_dependent(cuda=kernel, default=reference)


def _reference_attend(q, k_cache, v_cache, lengths, k_new, v_new, q_pos, plan: AttentionPlan,
                      window: int | None) -> jax.Array:
  """`attend`'s jnp reference path (its arguments, checked)."""
  b, t = q.shape[:2]
  capacity = k_cache.shape[2]
  inflight = jnp.broadcast_to(plan.inflight_mask, (b, t, t))
  if window is not None:
    inflight &= (q_pos[:, :, None] - q_pos[:, None, :]) < window
  outs = []
  for seg in plan.segments:
    sl = slice(seg.start, seg.stop)
    if isinstance(seg.view, QuantView):
      outs.append(_quant_view_attention(q[:, sl], seg.view, k_new, v_new, q_pos[:, sl],
                                        inflight[:, sl], window))
      continue
    mask = _cache_mask(seg.view, lengths, q_pos[:, sl], capacity, window)
    outs.append(reference_attention(q[:, sl], k_cache, v_cache, mask, k_new, v_new,
                                    inflight[:, sl]))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
