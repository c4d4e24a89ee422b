"""QuantSpec hierarchical INT4/INT8 KV cache and a Mosaic GPU split-KV decode kernel reading it.

Quantizer (`quantize_kv`, QuantSpec's hierarchical scheme). Each group of values x shares one
asymmetric grid: zero z (= group min, rounded *down* to fp16) and 4-bit step s4 (= (max - z)/15,
rounded *up* to fp16), so every x of the group lies in [z, z + 15 * s4]. The 8-bit step is
s8 = s4 / 16 and the 8-bit code is the plain asymmetric round-to-nearest code

    c8 = clip(round_half_even((x - z) / s8), 0, 240)     (x - z in fp32, the quotient exact)

It is split into an upper 4-bit code u = (c8 + 8) >> 4 in [0, 15] (round-to-nearest of x on the
s4 grid; it rounds up from 15/32 instead of 16/32 of a step, so |x - (z + u s4)| <= 17/32 s4) and a
lower 4-bit code l = c8 - 16 u in [-8, 7] (the symmetric round-to-nearest of the upper code's
residual x - z - u s4 at step s4 / 16; no clipping ever happens), so 16 u + l == c8 exactly.
  * 4-bit view:  x4 = z + u * s4                  (upper nibbles only)
  * 8-bit view:  x8 = z + (16 u + l) * s8         (both nibbles)
Groups: KEYS per channel over G = `group` consecutive tokens (scale, zero [B, Hkv, S/G, D]);
VALUES per token over the D channels (scale, zero [B, Hkv, S]).

Storage (`QuantKV`), 4-bit two's complement codes, eight to a uint32 word, two planes per tensor:
plane 0 holds u - 8, plane 1 holds l, both in [-8, 7], so INT8 = 16 * upper + lower with
upper = plane0 + 8. A 4-bit read touches plane 0 only; an 8-bit read both.
  k_codes [B, Hkv, 2, D/C, S, C/8]: (plane, channel chunk, token, words of the chunk's channels),
          C = 64 channels per chunk (C = D when D is not a multiple of 64);
  v_codes [B, Hkv, 2, S/T, D, T/8]: (plane, token tile, channel, words of the tile's tokens) with
          T = 64 tokens per tile (T = S when S is not a multiple of 64).
Each row of 64 codes (a key's chunk, a channel's tile) is stored in *wgmma fragment order*
(`register_operand.pack_words`): the 8 bytes a thread loads are the 16 codes of its register
fragment, nibbles where the bf16 pairs want them. A 64-row code tile is 2 KiB contiguous and
travels as 16 rows of 128 bytes. Scales and zeros are fp16: a K/V value beyond +-65504 saturates
at that range (its group's grid is clipped to it, `_grid`).

Kernel (`quant_attention`), grid (E + num_splits, Hkv * q_blocks, B), one warpgroup per block,
split-KV as decode_attention.py. The KEYS are the wgmma M dimension and the N = Tq * Hq / Hkv
query rows (padded to a multiple of 8, at most `block_m` per q block: by default one block up to
40 rows, else blocks of 32; <= 64; each q block re-reads the codes) the N dimension, so a
4-query-head decode step computes a [64, 8] score tile, not a [64, 64] one:
  S^T [64, N] = codes_K @ (q * s_K)^T + bias          A = the key codes, from registers
  O^T [D, N] += codes_V^T @ (p * s_V)^T                A = the value codes, from registers
  zsum  [N]  += sum_t p_t (z_t + 8 s4_t)               (added to every channel at the end)
The code words come into SMEM by TMA (128-byte rows, no swizzle) and go to registers with one
8-byte shared load per thread and row half, already in the wgmma fragment layout
(`register_operand.word_tile`): per pair of codes one lop3 puts the nibbles under a bf16 (fp16)
magic exponent, per word three shifts; the 8-bit view multiplies fp16 operands whatever q's dtype
(`CODE_DTYPE_8BIT`), its tiles built from the two planes by a second lop3 per pair (integer work
only; in bf16 it took an fma and an add more); no shuffle, no permute. The tile values are exact
integers offset by a constant (`word_offset`): the 4-bit view u - 8 + 136 in bf16 (+ 1032 in
fp16), the 8-bit view c8 - 128 + 1160 in fp16. Nothing is dequantized element-wise:
the per-channel key scale is folded into q once per key group of a stage (q^T * s_K, one
rounding, stored transposed as the B operand), the key zero points (z + 8 s4, the plane offset
folded in) enter as a per-(key group, query row) score bias q . (z + 8 s4) less the code offset
times sum_d (q * s_K)_d (the very B operand), summed per thread over the channel chunks in the
same pass that writes the B operand and reduced across the warps once per key group of a stage
(the zeros come in by TMA with the scales); the per-token value scale multiplies p, and the
value zeros less the code offset times the rounded p * s_V add zsum. No dequantized tile is ever
written to SMEM. A pipeline stage holds
`block_kv` keys (1, 2 or 4 key tiles of 64; one TMA per plane and channel chunk for K, one per
plane for V, whose tiles are stored contiguously): the stage's tiles get one online-softmax
update, their statistics combined element-wise before the one cross-warp reduction a stage needs
(the row max): the row sum l and the value-zero sum zsum stay per thread in [64, N] accumulators
of the score fragment's layout, rescaled with acc, and are reduced over the keys once after the
loop. The keys held in full precision (the recent segment and the in-flight tokens; generally any
`key_sets`, see `quant_attention_with_keys`) are attended in the same launch by E more blocks per
(row, KV head, q block), one 64-key tile each (`ExactKeys`, `exact_keys`: bf16/fp16 wgmma with
both operands from SMEM, K and V read by TMA straight from token-major [B, U, Hkv, D] pieces,
a piece's last tile past its end zero-filled by the TMA, per-query masks as a 0/-inf bias; their
SMEM is a sibling scope of a split's and no larger, so as many blocks stay resident): they leave
partials in the splits' format, and ONE more kernel (`pallas_kernels.merge_partials`) merges all
partials by log-sum-exp and normalises; past AUTO_MERGE_SPLITS partials it runs twice, ranges of
splits in parallel and then the ranges (`merge_partials_in_ranges`). A call is thus two (or
three) Mosaic launches plus the q / mask / output relayouts. The kernel is compiled without
Mosaic's automatic barriers (`pallas_kernels.sync`: one `bar.sync` before each ring refill
instead of 15-18 a stage; 3-6% per call on an H200).

Wide calls (`QuantAttentionConfig.path`, "auto" by default): from AUTO_DEQUANT_ROWS[bits] query
rows per KV head on (128 at 4 and 8 bits: Tq = 32 with 4 query heads per KV head; at 4 bits below
256 rows only when B * S >= AUTO_DEQUANT_MIN_TOKENS), where the q blocks' repeated
dequantization costs more than one pass, the call dequantizes the quantized region once into q's
dtype (`pallas_kernels.dequantize_kv`, a Mosaic kernel; only the tiles up to each row's length,
rounded up to decode's key tile) and runs decode_attention's split kernel on the copy, the key
sets merged by its jnp combine; while the transient copy stays <= DEQUANT_MAX_BYTES (4 GiB).
H200, S = 128K, B = 1: Tq = 64 at 4 / 8 bits 934 -> 535 / 1663 -> 578 us per call
(decode_attention on bf16: 365 us); a row holding 16K of a 128K capacity, Tq = 64: 144 -> 106 /
238 -> 114 us (session 19).

Measured (H200, S = 64K, B = 1, `benchmarks/quant_sweep.py`, session 16,
`results/quant_sweep_s16_tq{1,5}_h200.json`): Tq = 1, 4-bit 45.0 us per call (device: kernel
30.5, merge 4.7, ~6 of XLA relayouts: the in-flight keys' padded piece 2.7, the mask bias, q and
the output; session 14's jnp combine: 58.7; session 23, the pieces read in place and no automatic
barriers: 40.6 us device, 7 launches), 8-bit 69.5 us (was 82.0; session 23: 63.6),
decode_attention on the bf16 cache 76.1 us (so 1.69x / 1.10x); Tq = 5: 71.7 us at 4 bits (was
93.5), 98.5 at 8 (was 117.5). The zero-point bias moved in-kernel costs the kernel ~2 us at Tq = 1
and saved the wrapper's reduction (6.3 us at Tq = 1, 17.9 at Tq = 5; 19 us a layer in QuantSpec's
128K verification). Session 14 (jnp combine): Tq = 1, 4-bit 58.7 us per call (kernel alone
34.3 us, 28.2 us in the profiler). ptxas (session 13): 160 / 167 registers a thread at 4 / 8
bits (N = 8, 128 keys a stage). Tried and reverted in session 14:
removing the code offset in-kernel with a constant-A wgmma (the bias loses its offset term):
4-bit Tq = 1 kernel 28.2 -> 37.3 us. Session 8's Nsight Compute profile of the int4 kernel before
the fragment-order storage: half of the 19.4 M warp instructions were the int4 -> bf16 chain and
its shuffles, at 3 blocks of 4 warps per SM. Wide steps are slow (Tq = 16, N = 64: ~245 us at 64K,
4 bits, against 94 us for decode_attention; 255 registers and spills): the row max becomes a
cross-warp reduction over a [64, 64] tile. Session 37 (H100, the session-36 file timed in the same
process, `results/s37/`): the fp16 code tiles of 8-bit reads and one-round reductions took the
8-bit call from 71.6 to 67.6 us at 64K, Tq = 1 (device: kernel 53.5, merge 3.7) and from 161.6 to
129.8 us at 128K, Tq = 5 (QuantSpec's 8B verification forward 10.85 -> 9.88 ms); 4 bits unchanged
(46.5 / 46.9). See benchmarks/NOTES.md.

Contract:

  quant_attention(q [B, Tq, Hq, D], qkv: QuantKV (capacity S), lengths_quantized [B],
                  k_full [B, Hkv, Rf, D], v_full [B, Hkv, Rf, D], lengths_full [B],
                  k_new [B, Tq, Hkv, D], v_new [B, Tq, Hkv, D], inflight_mask [Tq, Tq], *,
                  bits=8, return_lse=False, score_queries=())
    -> out [B, Tq, Hq, D]  (+ lse [B, Tq, Hq] fp32 with return_lse)
                           (+ probs [B, len(score_queries), Hq, S] fp32 with score_queries)

One softmax over the quantized slots s < lengths_quantized[b], the full-precision slots
r < lengths_full[b] and the in-flight keys u with inflight_mask[t, u]. What selectors read
(SnapKV, H2O, the SFI selector), as in `pallas_kernels.decode_attention`: lse, the per query and
query head log-sum-exp of that softmax; probs, for the queries t = score_queries[i] (static,
distinct, len(score_queries) * G <= 64), the final softmax weight exp(score - lse) of each query
head on each *quantized* slot s (S = the quantized capacity; 0 for s >= lengths_quantized[b]):
probs summed over S plus the query's full-precision and in-flight weights is 1. The kernel
writes q block 0's score tiles (queries permuted so the selected ones come first; outputs
permuted back) through SMEM and a TMA to a [B, Hkv, S, N] fp32 output; the wrapper converts them
with the combined lse. score_queries=() builds exactly the kernel without any of this.

  quant_attention_with_keys(q, qkv, lengths_quantized,
                            key_sets: sequence of (k [B, U, Hkv, D], v [B, U, Hkv, D],
                                                   mask [B or 1, Tq or 1, U] bool), *,
                            bits=8, return_lse=False, score_queries=())
The same softmax with the exactly-attended keys given as key sets (what `sparsedec.attention`
uses for QuantSpec's tail, draft scratch and in-flight tokens, each with its own per-row mask),
attended by the kernel's exact blocks in q's dtype (a key set in another dtype is rounded to it;
products and sums fp32); `quant_attention` builds its two key sets (full segment, in-flight) and
calls it.

`quant_attention_reference` = dequantize, then exact fp32 attention (pure jnp).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels.combine import (check_config_ints, check_lengths, check_mask,
                                    check_score_queries, check_sizes, combine_partials, f32_einsum,
                                    int32_clipped, interpret_mode, is_int, normalised, python_ints,
                                    score_rows, scores_to_probs, selected_first, static_ints,
                                    wrapper_outputs)

from pallas_kernels.decode_attention import (BLOCK_M, LOG2E, DecodeConfig, num_q_blocks,
                                             split_partials)
from pallas_kernels.hopper import SM_COUNT, tma_rows
from pallas_kernels.merge_partials import MAX_SPLITS as MERGE_MAX_SPLITS
from pallas_kernels.merge_partials import merge_partials_in_ranges
from pallas_kernels.register_operand import (CODES_PER_WORD, SMEM_ROW_WORDS, a_staging,
                                             pack_words, swizzled, unpack_words,
                                             wgmma_register_a, word_offset, word_tile)
from pallas_kernels.sync import compiler_params, warpgroup_barrier

META_DTYPE = jnp.float16
# The MMA input type of an 8-bit read, whatever q's dtype: fp16's 10-bit significand holds the
# whole 8-bit code, so `word_tile` builds its tiles from the two planes with integer ops alone
# (two lop3 per pair of codes, against two lop3, an fma and an add in bf16), and q * s8 and
# p * s8_V are rounded to fp16 (3 more significand bits than bf16; they must stay below 65504:
# |q_d| * s4_d / 16, with s4 the 4-bit key step).
CODE_DTYPE_8BIT = jnp.float16
META_MAX = float(jnp.finfo(META_DTYPE).max)   # 65504: the grid's extremes are clipped to +-this
# Mosaic GPU's cross-warp reductions stage 4 warps x 32 lanes x 2 fp32 (1 KiB) per register of a
# [64, N] WGMMA tile (N / 8 registers); the default room (2 KiB) takes two at once.
REDUCTION_BYTES_PER_REGISTER = 1024
DEFAULT_REDUCTION_BYTES = plgpu.CompilerParams().reduction_scratch_bytes
UPPER_LEVELS = 15                 # 4-bit upper code u in [0, 15]
CODE8_MAX = 16 * UPPER_LEVELS     # 8-bit code c8 = 16 u + l in [0, 240]
UPPER_OFFSET = 8                  # plane 0 stores u - 8 (two's-complement int4)
CHANNEL_CHUNK = 64                # K channels per stored chunk (and per key-side wgmma)
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ----------------------------------------------------------------------------------------------
# The quantized cache.
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero"),
                   meta_fields=("group",))
@dataclasses.dataclass(frozen=True)
class QuantKV:
  """Hierarchical INT4/INT8 K/V (see the module docstring)."""
  k_codes: jax.Array   # [B, Hkv, 2, D/C, S, C/8] uint32 (plane 0: u - 8, plane 1: l; C channels)
  v_codes: jax.Array   # [B, Hkv, 2, S/T, D, T/8] uint32 (plane; T-token tiles, channel-major)
  k_scale: jax.Array   # [B, Hkv, S/G, D] fp16, 4-bit step s4 per channel and token group
  k_zero: jax.Array    # [B, Hkv, S/G, D] fp16
  v_scale: jax.Array   # [B, Hkv, S] fp16, 4-bit step s4 per token
  v_zero: jax.Array    # [B, Hkv, S] fp16
  group: int = 128     # tokens per key group

  @classmethod
  def abstract(cls, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
               group: int = 128) -> "QuantKV":
    """A QuantKV of jax.ShapeDtypeStruct leaves (for tracing or lowering without data);
    head_dim a multiple of 64, capacity a multiple of 64 and of group."""
    sds, b, h, s, d = jax.ShapeDtypeStruct, batch, num_kv_heads, capacity, head_dim
    w = CHANNEL_CHUNK // CODES_PER_WORD
    return cls(sds((b, h, 2, d // CHANNEL_CHUNK, s, w), jnp.uint32),
               sds((b, h, 2, s // KEY_TILE, d, w), jnp.uint32),
               sds((b, h, s // group, d), META_DTYPE), sds((b, h, s // group, d), META_DTYPE),
               sds((b, h, s), META_DTYPE), sds((b, h, s), META_DTYPE), group=group)

  @property
  def capacity(self) -> int:
    return self.k_codes.shape[4]

  @property
  def head_dim(self) -> int:
    return self.k_codes.shape[3] * self.k_codes.shape[5] * CODES_PER_WORD


def _meta_neighbour(r, direction):
  """The META_DTYPE (fp16) value next to r towards -inf (direction < 0) or +inf, by its bits
  (integer ops only: no fp16 arithmetic for XLA:GPU to carry out in fp32)."""
  bits = lax.bitcast_convert_type(r, jnp.uint16).astype(jnp.int32)
  negative, magnitude = bits >> 15, bits & 0x7FFF
  away = negative == (1 if direction < 0 else 0)          # the step grows the magnitude
  magnitude = jnp.where(away, magnitude + 1, jnp.maximum(magnitude - 1, 0))
  crosses = jnp.logical_and(~away, (bits & 0x7FFF) == 0)  # a zero steps to the other sign
  negative = jnp.where(crosses, 1 - negative, negative)
  magnitude = jnp.where(crosses, 1, magnitude)
  out = ((negative << 15) | magnitude).astype(jnp.uint16)
  return lax.bitcast_convert_type(out, META_DTYPE)


def round_to_meta(x, direction):
  """fp32 -> META_DTYPE, rounded down (direction < 0) or up (> 0), never to nearest. The
  optimization barrier keeps XLA from dropping the fp32 -> fp16 -> fp32 round trip the
  comparison needs (XLA:GPU allows excess precision by default). On an H100 the zeros and steps
  differed from the numpy reference's until this barrier and `_meta_neighbour` were in."""
  r = lax.optimization_barrier(x.astype(META_DTYPE))
  rf = r.astype(jnp.float32)
  if direction < 0:
    return jnp.where(rf > x, _meta_neighbour(r, -1), r)
  return jnp.where(rf < x, _meta_neighbour(r, +1), r)


def _grid(lo, hi):
  """Group min / max (fp32) -> stored (zero, s4) with lo >= zero, hi <= zero + 15 * s4, the
  extremes first clipped to META_DTYPE's finite range (+-65504): a group holding a value beyond
  it gets a finite grid and that value is coded as the range's end (`_codes8` clips it too),
  instead of an infinite zero or step turning the whole group into NaN. The grid's top, zero +
  15 * s4, never passes 65504 either (s4 rounded up could put it at 65520 or 65536, infinite once
  dequantized to fp16): where it would, s4 is rounded down instead and the group's highest
  values saturate at code 240. (A constant group's step of 1 may put the top past 65504; its
  codes are all 0.)"""
  lo = jnp.clip(lo, -META_MAX, META_MAX)
  hi = jnp.clip(hi, -META_MAX, META_MAX)
  zero = round_to_meta(lo, -1)
  zero_f = zero.astype(jnp.float32)
  # A multiply by the fp32 constant 1/15 (not a division, which XLA may rewrite): the grid is
  # then bit-reproducible by any fp32 implementation.
  fifteenth = jnp.float32(1 / UPPER_LEVELS)
  step = round_to_meta((hi - zero_f) * fifteenth, +1)
  below_top = round_to_meta((META_MAX - zero_f) * fifteenth, -1)
  step = jnp.where(zero_f + UPPER_LEVELS * step.astype(jnp.float32) > META_MAX, below_top, step)
  step = jnp.where(step > 0, step, jnp.ones_like(step))   # constant group: any step works
  return zero, step


def _codes8(x, zero, step4):
  """The 8-bit code c8 in [0, 240] (int32) of x on the grid (zero, step4 / 16): d = x - zero
  (one fp32 subtraction) rounded half-to-even at the exact quotient d / step8. The quotient is
  only guessed (the fp32 quotient XLA:GPU computes is not always IEEE's: on an H100 codes came
  out one off numpy's); the guess g is then settled by comparing d with (g +- 1/2) * step8,
  products that are exact in fp32 (a 10-bit by an 11-bit significand), so every backend gives
  the same codes."""
  step8 = step4.astype(jnp.float32) * (1.0 / 16.0)
  d = jnp.clip(x, -META_MAX, META_MAX) - zero.astype(jnp.float32)   # as the grid's extremes
  g = jnp.round(d * (1.0 / step8))
  above, below = (g + 0.5) * step8, (g - 0.5) * step8
  odd = jnp.mod(g, 2.0) == 1.0
  c = (g + (d > above).astype(jnp.float32) - (d < below).astype(jnp.float32)
       + ((d == above) & odd).astype(jnp.float32) - ((d == below) & odd).astype(jnp.float32))
  return jnp.clip(c, 0, CODE8_MAX).astype(jnp.int32)


def _planes(c8):
  """c8 [..., S, D] int32 -> [..., 2, S, D] int32: (u - 8, l), both in [-8, 7]."""
  upper = (c8 + 8) >> 4                                     # u in [0, 15]
  lower = c8 - 16 * upper                                   # l in [-8, 7]
  return jnp.stack([upper - UPPER_OFFSET, lower], axis=-3)


def _chunk(head_dim):
  """Channels per K chunk: 64 (one 128-byte bf16 wgmma K step), or all of a smaller D."""
  return CHANNEL_CHUNK if head_dim % CHANNEL_CHUNK == 0 else head_dim


def k_layout(planes):
  """[..., 2, S, D] codes -> [..., 2, D/C, S, C/8] words (the channel chunks split off, each
  token's chunk one row of words, fragment order: `pack_words`)."""
  d = planes.shape[-1]
  c = _chunk(d)
  x = planes.reshape(*planes.shape[:-1], d // c, c)         # [..., 2, S, D/C, C]
  return pack_words(jnp.moveaxis(x, -2, -3))


def _upper_lower(planes):
  """[..., 2, S, D] codes -> (upper [..., S, D] in [0, 15], lower [..., S, D] in [-8, 7])."""
  return planes[..., 0, :, :] + UPPER_OFFSET, planes[..., 1, :, :]


def _k_planes(k_codes):
  """[B, Hkv, 2, D/C, S, C/8] words -> [B, Hkv, 2, S, D] int32 codes."""
  x = jnp.moveaxis(unpack_words(k_codes), 3, 4)             # [B, Hkv, 2, S, D/C, C]
  return x.reshape(*x.shape[:4], -1)


def v_tile_tokens(capacity):
  """Tokens per stored V tile: the kernel's 64-key tile, or all of a capacity it does not divide."""
  return KEY_TILE if capacity % KEY_TILE == 0 else capacity


def v_layout(planes):
  """[..., 2, S, D] codes -> [..., 2, S/T, D, T/8] words (token tiles, each channel-major: a
  channel's T tokens one row of words, fragment order: `pack_words`)."""
  *lead, s, d = planes.shape
  t = v_tile_tokens(s)
  return pack_words(jnp.swapaxes(planes.reshape(*lead, s // t, t, d), -1, -2))


def _v_planes(v_codes):
  """[..., 2, S/T, D, T/8] words -> [..., 2, S, D] int32 codes."""
  x = jnp.swapaxes(unpack_words(v_codes), -1, -2)           # [..., 2, S/T, T, D]
  return x.reshape(*x.shape[:-3], -1, x.shape[-1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantPlanes:
  """Quantized K/V before storage: the code planes token-major, scales and zeros as `QuantKV`.
  A pytree (every field an array)."""
  k_planes: jax.Array   # [B, Hkv, 2, S, D] int32: (u - 8, l), both in [-8, 7]
  v_planes: jax.Array   # [B, Hkv, 2, S, D] int32
  k_scale: jax.Array    # [B, Hkv, S/G, D] fp16
  k_zero: jax.Array     # [B, Hkv, S/G, D] fp16
  v_scale: jax.Array    # [B, Hkv, S] fp16
  v_zero: jax.Array     # [B, Hkv, S] fp16


def _check_kv(k, v, group):
  if k.ndim != 4 or v.shape != k.shape:
    raise ValueError(f"k and v must both be [B, Hkv, S, D], got {k.shape} and {v.shape}")
  if group <= 0 or k.shape[2] % group:
    raise ValueError(f"capacity S={k.shape[2]} must be a positive multiple of group={group}")


def quantize_planes(k: jax.Array, v: jax.Array, group: int) -> QuantPlanes:
  """k, v [B, Hkv, S, D] (any float dtype; S a multiple of `group`) -> QuantPlanes."""
  _check_kv(k, v, group)
  b, hkv, s, d = k.shape
  kf = k.astype(jnp.float32).reshape(b, hkv, s // group, group, d)   # [B, Hkv, S/G, G, D]
  k_zero, k_scale = _grid(kf.min(3), kf.max(3))                       # [B, Hkv, S/G, D]
  k_c8 = _codes8(kf, k_zero[:, :, :, None], k_scale[:, :, :, None]).reshape(b, hkv, s, d)
  vf = v.astype(jnp.float32)
  v_zero, v_scale = _grid(vf.min(3), vf.max(3))                       # [B, Hkv, S]
  v_c8 = _codes8(vf, v_zero[..., None], v_scale[..., None])
  return QuantPlanes(_planes(k_c8), _planes(v_c8), k_scale, k_zero, v_scale, v_zero)


@functools.partial(jax.jit, static_argnames=("group",))
def quantize_kv(k: jax.Array, v: jax.Array, group: int = 128) -> QuantKV:
  """k, v [B, Hkv, S, D] (any float dtype; S a multiple of `group`, S and D multiples of 8)
  -> QuantKV."""
  _check_kv(k, v, group)
  s, d = k.shape[2:]
  if s % CODES_PER_WORD or d % CODES_PER_WORD:
    raise ValueError(f"head dim D={d} and capacity S={s} must be multiples of 8 (8 4-bit codes "
                     f"per stored word)")
  x = quantize_planes(k, v, group)
  return QuantKV(k_layout(x.k_planes), v_layout(x.v_planes), x.k_scale, x.k_zero, x.v_scale,
                 x.v_zero, group=group)


def code_planes(qkv: QuantKV):
  """The stored planes token-major, (K, V) each [B, Hkv, 2, S, D] int32 (u - 8, l)."""
  return _k_planes(qkv.k_codes), _v_planes(qkv.v_codes)


def codes8(qkv: QuantKV):
  """The reassembled 8-bit codes 16 * upper + lower, (K, V) each [B, Hkv, S, D] int32."""
  ku, kl = _upper_lower(_k_planes(qkv.k_codes))
  vu, vl = _upper_lower(_v_planes(qkv.v_codes))
  return 16 * ku + kl, 16 * vu + vl


def check_bits(bits) -> None:
  """The read precision: the integer 4 (upper nibbles) or 8 (both); 4.0 is refused."""
  if not is_int(bits) or bits not in (4, 8):
    raise ValueError(f"bits must be 4 or 8, got {bits!r}")


def dequantize_planes(x: QuantPlanes, group: int, bits: int, dtype=jnp.float32):
  """(k, v) [B, Hkv, S, D] from code planes (token-major) at 4 bits (upper nibbles) or 8 (both)."""
  check_bits(bits)
  ku, kl = _upper_lower(x.k_planes)
  vu, vl = _upper_lower(x.v_planes)
  ks = jnp.repeat(x.k_scale.astype(jnp.float32), group, axis=2)         # [B, Hkv, S, D]
  kz = jnp.repeat(x.k_zero.astype(jnp.float32), group, axis=2)
  vs = x.v_scale.astype(jnp.float32)[..., None]                          # [B, Hkv, S, 1]
  vz = x.v_zero.astype(jnp.float32)[..., None]
  if bits == 4:
    k = ku.astype(jnp.float32) * ks + kz
    v = vu.astype(jnp.float32) * vs + vz
  else:
    k = (16 * ku + kl).astype(jnp.float32) * (ks * (1 / 16)) + kz
    v = (16 * vu + vl).astype(jnp.float32) * (vs * (1 / 16)) + vz
  return k.astype(dtype), v.astype(dtype)


@functools.partial(jax.jit, static_argnames=("bits", "dtype"))
def dequantize(qkv: QuantKV, bits: int = 8, dtype=jnp.float32):
  """(k, v) [B, Hkv, S, D] from the 4-bit (upper nibbles) or 8-bit (both) view."""
  check_bits(bits)
  k_planes, v_planes = code_planes(qkv)
  planes = QuantPlanes(k_planes, v_planes, qkv.k_scale, qkv.k_zero, qkv.v_scale, qkv.v_zero)
  return dequantize_planes(planes, qkv.group, bits, dtype)


def fake_quantize(k: jax.Array, v: jax.Array, group: int, bits: int, dtype=jnp.float32):
  """k, v [B, Hkv, S, D] -> (k, v) as `dequantize(quantize_kv(k, v, group), bits, dtype)`
  returns them, bit for bit, without packing the codes into words (S and D need not be multiples
  of 8). What QuantSpec's views read for buffer slots that a flush is about to quantize."""
  return dequantize_planes(quantize_planes(k, v, group), group, bits, dtype)


def bytes_per_token(head_dim: int, bits: int, group: int = 128) -> float:
  """Bytes one token of one KV head (K and V) costs a read at `bits` (codes + scales/zeros)."""
  codes = 2 * head_dim * bits // 8
  meta = 2 * 2 * head_dim / group + 2 * 2   # K: scale+zero per channel per group; V: per token
  return codes + meta


# ----------------------------------------------------------------------------------------------
# Step 1: the Mosaic GPU kernel over the quantized region.
# ----------------------------------------------------------------------------------------------

KEY_TILE = 64                     # wgmma M: keys per tile (and A rows from registers)
TILE_ROWS = KEY_TILE // 4         # a 64-row code tile in SMEM: 16 rows of 32 words
BLOCK_KV_CHOICES = (64, 128, 256)  # keys per pipeline stage: 1, 2 or 4 key tiles
# Keys per stage when the config leaves it open, by query rows per q block (N): two key tiles per
# stage halve the per-stage chain (TMA wait, q * s_K, fences, the cross-warp softmax reductions)
# per key. H200, S = 64K (benchmarks/NOTES.md, session 7): kernel 47.0 us with 128 keys against
# 50.8 with 64 at Tq = 1 (4 bits), 72.9 against 95.2 at Tq = 5 (N = 24); 256 keys is slower (52.8).
# Wider q blocks keep one tile. Narrow is N <= 40 at both widths: at 4 bits N = 32 prefers 128
# (260 against 351 us at S = 128K, Tq = 16; session 17), and a 40-row block (H200, 128K, Tq = 9,
# session 45) 199.7 against 218.9 us at 4 bits, 249.1 against 285.7 at 8. At 8 bits N = 32 once
# preferred 64 (446 against 620 us at 128K, Tq = 16; session 17), but since session 37's fp16
# code tiles the two tie (H200, session 45: 355.2 with 64, 353.9 with 128 at Tq = 16; 181.8 /
# 182.4 at Tq = 8); N = 24 prefers 128 (169 against 201 us at Tq = 5).
# A batched 4-bit decode call (N <= 8: one query with up to 8 query heads per KV head, and
# B >= AUTO_DECODE_MIN_BATCH rows) takes four key tiles a stage: the per-stage work (the scale
# folding, the two cross-warp reductions, the P and q * s_K stores and their barriers, ~600 of
# the ~830 instructions a thread spends on a 128-key stage) is paid once per 256 keys. One row
# keeps 128 (three blocks per SM instead of two), where 256 measured no faster.
# H200, Tq = 1, call us, 128 -> 256 keys (`results/s29/quant_sweep_s29_*_h200.json`):
#   B 8: 16K 83.5 -> 70.7, 64K 265.8 -> 216.7 (1.83x -> 2.25x decode_attention);
#   B 4 64K 142.5 -> 116.7; B 2 128K 141.2 -> 115.5;
#   B 1: 16K 22.9 -> 21.7, 64K 42.5 -> 42.9, 128K 65.8 -> 67.3 (QuantSpec's 8B draft forward
#   at 128K 4.51 -> 4.64 ms).
# 8 bits are slower with 256 (B 8 64K 408 -> 786: two code planes a stage).
AUTO_BLOCK_KV_DECODE = 256         # bits 4, N <= AUTO_DECODE_ROWS, B >= AUTO_DECODE_MIN_BATCH
AUTO_DECODE_ROWS = 8
AUTO_DECODE_MIN_BATCH = 2
AUTO_BLOCK_KV_NARROW = 128         # N <= AUTO_NARROW_ROWS, both widths
AUTO_BLOCK_KV_WIDE = 64            # wider N
AUTO_NARROW_ROWS = 40              # query rows a q block (N), 4 and 8 bits alike
# Query rows per q block at most (QuantAttentionConfig.block_m). Rows beyond it are cut into q
# blocks of this many, each re-reading the codes: N = 64 blocks spill (255 registers, ~360 bytes of
# stack) and were 2.5x slower than twice the N = 32 blocks. H200, S = 128K, B = 1, call us, 64-row
# -> 32-row blocks (`quant_sweep_s17_blockm_tq{16,64}_h200.json`): Tq = 16 (64 rows) 4-bit 641.5
# -> 260.1, 8-bit 725.5 -> 445.9; Tq = 64 (256 rows) 4-bit 2459.6 -> 936.7, 8-bit 2710.2 ->
# 1659.6 (16-row blocks: slower than 32 in all four but 8 bits with 128-key stages).
AUTO_BLOCK_M = 32
# ... except that up to AUTO_ONE_BLOCK_ROWS rows stay one q block when block_m is left to the
# planner (None): 33-40 rows (QuantSpec's verification at gamma 8 and 9 with 4 query heads per KV
# head) read the codes once in one 40-row block instead of twice in two. H200, S = 128K, Tq = 9
# (36 rows), call device us (`results/s45/quant_sweep_128k_tq9_blockm_s45_h200.json`), two
# 32-row blocks -> one 40-row block, 128-key stages: 4-bit 244.3 -> 199.7, 8-bit 353.2 -> 249.1
# (64-key stages: 313.6 -> 218.9, 353.8 -> 285.7). One 32-row block (Tq = 8) takes 129.8 /
# 182.4, so 40 rows cost ~1.4-1.6x 32 and two 40-row blocks do not beat three 32-row ones.
AUTO_ONE_BLOCK_ROWS = 40
# Partials the planner merges in one launch: merge_partials folds a (row, KV head, q block)'s
# splits in one thread block, ~0.065 us a split, so past ~128 a one-launch merge outgrows what
# more splits save in the kernel (H200, 4-bit, Tq = 1, 128K, device us per call at 1 / 2 KV
# heads: 28.5 / 32.9 with 123 splits, 33.9 / 36.1 with a whole wave of 251 / 198 in one launch;
# `benchmarks/merge_splits.py`, session 36). More are merged in ranges (`_num_splits`).
AUTO_MERGE_SPLITS = 128
# Wide calls: every q block of the fused kernel dequantizes all the codes again, so from some
# number of query rows per KV head (Tq * Hq / Hkv) on it is cheaper to dequantize the whole
# quantized region once into q's dtype (`pallas_kernels.dequantize_kv`: the codes read at `bits`,
# a [B, Hkv, S, D] copy written) and run decode_attention's kernel on it, the key sets merged by
# its jnp combine (`QuantAttentionConfig.path`; "auto" uses these thresholds). H200, B = 1, call
# us, fused -> dequantize (`quant_sweep_s18_dqkv_*_h200.json`; dequantize_kv alone 204 / 235 us
# at 4 / 8 bits for 128K, 76-79% of read bandwidth for its bytes read + written):
#   128K, 4-bit: 64 rows 256 -> 355, 128 rows 486 -> 413, 256 rows 934 -> 535
#   128K, 8-bit: 64 rows 444 -> 388, 128 rows 843 -> 443, 256 rows 1663 -> 578
#   16K: 64 rows 55.7 -> 74.0 (4-bit), 81.1 -> 81.3 (8-bit); 1024 rows 525 -> 231, 867 -> 238
# Between the two thresholds the path's fixed costs (one more launch, the jnp combine) decide, so
# there it also wants B * S >= AUTO_DEQUANT_MIN_TOKENS. AUTO_DEQUANT_ROWS[bits] = (rows from which
# it dequantizes when B * S >= AUTO_DEQUANT_MIN_TOKENS, rows from which it always does).
# 8 bits since the fp16 code tiles (session 37, H100, B = 1, wall us per call, fused ->
# dequantize, `results/s37/paths_tq*_8bit_*_s37_h100.json`): 64 rows (Tq = 16) 128K 365 -> 521,
# 16K 73.5 -> 96.7; 128 rows 128K 708 -> 533, 16K 126 -> 107. (Before them 64 rows favoured the
# dequantize path from 64K on: H200 128K 449 -> 390, 64K 240 -> 224; 16K 76.7 -> 81.0.)
AUTO_DEQUANT_ROWS = {4: (128, 256), 8: (128, 128)}
AUTO_DEQUANT_MIN_TOKENS = 65536
DEQUANT_MAX_BYTES = 2 ** 32        # "auto" never makes a larger transient K + V copy
PATHS = ("auto", "fused", "dequantize")


@dataclasses.dataclass(frozen=True)
class QuantAttentionConfig:
  """Tiling. A key tile is 64 keys (the wgmma M of the key-side product); a pipeline stage holds
  block_kv keys (1, 2 or 4 tiles), fetched together and put through one online-softmax update.
  block_kv must divide the key group or be a multiple of it, and divide the quantized capacity;
  None picks per call (`_block_kv`). The tiling fields are the fused kernel's: a call on the
  dequantize path (`path`, also where "auto" takes it) runs decode_attention's kernel with its
  default tiling (`DecodeConfig()`) and does not read them."""
  # Defaults: the best of `benchmarks/quant_sweep.py` on an H200 (S = 64K, Tq = 1 and 5).
  block_kv: int | None = None
  num_stages: int = 2
  num_splits: int | None = None
  target_blocks: int | None = None   # thread blocks to fill; None: one wave (`_one_wave`)
  min_tiles_per_split: int = 2
  # Query rows per q block at most (a multiple of 8, <= 64); None: one block up to
  # AUTO_ONE_BLOCK_ROWS rows, else blocks of AUTO_BLOCK_M.
  block_m: int | None = None
  # "fused": the Mosaic kernel reads the codes; "dequantize": the quantized region dequantized
  # into q's dtype by `pallas_kernels.dequantize_kv`, then decode_attention's kernel; "auto":
  # "dequantize" from AUTO_DEQUANT_ROWS[bits] query rows per KV head on (between its two
  # thresholds only when B * S >= AUTO_DEQUANT_MIN_TOKENS) while the transient copy stays
  # <= DEQUANT_MAX_BYTES.
  path: str = "auto"

  def __post_init__(self):
    if self.path not in PATHS:
      raise ValueError(f"path must be one of {PATHS}, got {self.path!r}")
    if self.block_m is not None and (not is_int(self.block_m) or self.block_m % 8
                                     or not 8 <= self.block_m <= BLOCK_M):
      raise ValueError(f"block_m must be None or a multiple of 8 in [8, {BLOCK_M}], got "
                       f"{self.block_m!r}")
    if self.block_kv is not None and (not is_int(self.block_kv)
                                      or self.block_kv not in BLOCK_KV_CHOICES):
      raise ValueError(f"block_kv must be one of {BLOCK_KV_CHOICES} (whole 64-key wgmma "
                       f"tiles) or None, got {self.block_kv!r}")
    check_config_ints(self, ("num_stages", "min_tiles_per_split"),
                      ("num_splits", "target_blocks"))
    python_ints(self, ("block_m", "block_kv"))


def _one_wave(bits, block_kv, rows):
  """Thread blocks an H100 / H200 runs at once: SMs x blocks resident per SM, as registers and
  SMEM bound them (ptxas / ncu, session 8: 163-167 registers a thread and 52 KiB of SMEM at
  4 bits, 128 keys, N = 8 -> 3 blocks; ~210 registers at 8 bits or wider steps -> 2; 128 at
  64 keys -> 4). More blocks leave a partial last wave (ncu: 1056 blocks were 2.67 waves of
  396). H200, S = 64K, kernel alone: 8-bit Tq = 1 73.4 -> 68.3 us with 264 blocks (one wave)
  instead of 1056, 4-bit 45.5 -> 44.6 with 396; Tq = 5 calls 139.6 -> 130.7 (8-bit) and
  107.5 -> 97.4 us (4-bit) with 264. Session 13's word-tile kernel needs 160 / 167 registers at
  4 / 8 bits, but 3 blocks per SM at 8 bits measured slower (75.5 against 62.0 us at 64K)."""
  if rows > 8 or block_kv > 128:
    per_sm = 2
  elif block_kv == KEY_TILE:
    per_sm = 4 if bits == 4 else 3
  else:
    per_sm = 3 if bits == 4 else 2
  return SM_COUNT * per_sm


def _fits(block_kv, group, capacity):
  return capacity % block_kv == 0 and (group % block_kv == 0 or block_kv % group == 0)


def _block_kv(cfg, rows, group, capacity, bits=4, batch=1):
  """Keys per stage: the config's, or the largest choice up to the (N, bits, B)-dependent default
  that divides the capacity and nests with the key group (64 always does, given the checks)."""
  if cfg.block_kv is not None:
    return cfg.block_kv
  if bits == 4 and rows <= AUTO_DECODE_ROWS and batch >= AUTO_DECODE_MIN_BATCH:
    preferred = AUTO_BLOCK_KV_DECODE
  elif rows <= AUTO_NARROW_ROWS:
    preferred = AUTO_BLOCK_KV_NARROW
  else:
    preferred = AUTO_BLOCK_KV_WIDE
  return max(c for c in BLOCK_KV_CHOICES if c <= preferred and (c == KEY_TILE or
                                                                 _fits(c, group, capacity)))


def _q_blocks(n_rows, block_m=None, min_block=0):
  """Query rows (Tq * Hq / Hkv) -> (q blocks, rows per q block N): one block of the rows padded
  to a multiple of 8, or blocks of block_m (at most BLOCK_M = 64). block_m None: one block up to
  AUTO_ONE_BLOCK_ROWS rows, else AUTO_BLOCK_M. A block holds at least `min_block` rows (the
  selected queries' score rows, which must all sit in q block 0)."""
  if block_m is None:
    block_m = AUTO_ONE_BLOCK_ROWS if n_rows <= AUTO_ONE_BLOCK_ROWS else AUTO_BLOCK_M
  block_m = max(block_m, min_block)
  q_blocks = -(-n_rows // block_m)
  return q_blocks, block_m if q_blocks > 1 else -(-n_rows // 8) * 8


def _dequantizes(cfg, n_rows, bits, qkv: QuantKV, dtype) -> bool:
  """Whether a call of n_rows query rows per KV head takes the dequantize path (`cfg.path`)."""
  if cfg.path != "auto":
    return cfg.path == "dequantize"
  b, hkv = qkv.k_codes.shape[:2]
  copy_bytes = 2 * b * hkv * qkv.capacity * qkv.head_dim * jnp.dtype(dtype).itemsize
  some, always = AUTO_DEQUANT_ROWS[bits]
  wide = n_rows >= always or (n_rows >= some and b * qkv.capacity >= AUTO_DEQUANT_MIN_TOKENS)
  return wide and copy_bytes <= DEQUANT_MAX_BYTES


def _num_splits(cfg, block_kv, batch, num_kv_heads, q_blocks, capacity, *, bits, rows,
                exact_blocks: int = 0) -> tuple[int, int]:
  """(splits, merge ranges) per (row, KV head, q block): one wave of blocks. Up to
  AUTO_MERGE_SPLITS partials (the splits and the `exact_blocks` ones) merge in one launch; more
  (1-2 KV heads at long context ask for 198-396 splits) merge in ranges of ~sqrt(partials)
  (`merge_partials_in_ranges`), the splits trimmed so the ranges are equal. An explicit
  `num_splits` merges in one launch, so at most merge_partials' MAX_SPLITS partials."""
  if cfg.num_splits is not None:
    if cfg.num_splits + exact_blocks > MERGE_MAX_SPLITS:
      raise ValueError(f"num_splits={cfg.num_splits} with {exact_blocks} exact-key blocks is more "
                       f"than merge_partials' MAX_SPLITS={MERGE_MAX_SPLITS} partials")
    return cfg.num_splits, 1
  target = cfg.target_blocks or _one_wave(bits, block_kv, rows)
  per_head = max(1, target // (batch * num_kv_heads * q_blocks))
  splits = max(1, min(per_head, (capacity // block_kv) // cfg.min_tiles_per_split))
  total = splits + exact_blocks
  if total <= AUTO_MERGE_SPLITS:
    return splits, 1
  per_range = math.isqrt(total - 1) + 1
  ranges = total // per_range
  if ranges * per_range - exact_blocks < splits // 2:   # the exact blocks are most of it
    return max(1, min(splits, AUTO_MERGE_SPLITS - exact_blocks)), 1
  return ranges * per_range - exact_blocks, ranges


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("q_cols", "sources", "bias"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class ExactKeys:
  """The keys a quant_attention call attends in full precision (a QuantSpec step's double
  buffer, draft scratch and in-flight tokens), as `exact_keys` lays them out for the kernel's
  exact blocks: q_cols [B, Hkv, NQB, N, D] (q's dtype, the B operand of their QK^T); sources,
  the keys in one or more pieces ((k, v) [B, U_i, Hkv, D], q's dtype, token-major, any U_i:
  the last tile of a piece reads past its end, zero-filled; a piece in q's dtype is
  the caller's array, no copy); bias [B or 1, NQB, U, N] fp32 over the pieces' keys in order,
  each piece rounded up to whole tiles, U = sum ceil(U_i / 64) * 64 (0: query row n of q block j
  sees key u; -inf: not)."""
  q_cols: jax.Array
  sources: tuple[tuple[jax.Array, jax.Array], ...]
  bias: jax.Array

  @property
  def num_blocks(self) -> int:
    """Exact blocks per (row, KV head, q block): one per 64-key tile (a piece's last tile may be
    partial)."""
    return sum(-(-k.shape[1] // KEY_TILE) for k, _ in self.sources)


def _quant_partials(q_t, qkv: QuantKV, lengths, *, bits, num_splits, dtype,
                    cfg: QuantAttentionConfig, block_kv: int, with_scores: bool = False,
                    exact: ExactKeys | None = None, interpret: Any = None):
  """Split partials of the quantized region, and of the exactly attended keys.

  q_t [B, Hkv, NQB, D/64, 64, N] fp32: q^T in 64-channel chunks (N query rows per q block, a
  multiple of 8, <= 64); `dtype` q's, the MMA input type of the exact blocks and of 4-bit reads
  (an 8-bit read multiplies fp16 operands: `CODE_DTYPE_8BIT`); lengths [B] int32 (clipped to
  [0, S] in the kernel);
  exact: the keys attended in full precision, or None.
  Grid (E + num_splits, Hkv * NQB, B): the first E = exact.num_blocks blocks of each (KV head,
  q block, row) attend one 64-key tile of the exact keys each (bf16 wgmma, in SMEM no larger than
  a quantized split's, so as many blocks stay resident per SM), running beside the quantized
  splits instead of in a launch of their own (their few microseconds overlap the splits'; at most
  the splits that do not fit the first wave start that much later); the others a split of the
  quantized region.
  Returns acc [B, Hkv, NQB, E + NS, D, N] fp32 (un-normalised O^T), m [B, Hkv, NQB, E + NS, NP]
  fp32 (log2 units, -inf for an empty split; columns >= N undefined), l [B, Hkv, NQB, E + NS,
  NP]; with with_scores also scores [B, Hkv, S, N] fp32 of q block 0: the scaled scores (log2
  units) of the slots s < lengths[b], -inf for the rest of their last tile; the other slots are
  never written (undefined).
  """
  batch, num_kv_heads, q_blocks, n_chunks, chunk, n = q_t.shape
  bkv, num_stages, group = block_kv, cfg.num_stages, qkv.group
  tiles = bkv // KEY_TILE                       # key tiles per stage
  groups = max(1, bkv // group)                 # key groups per stage (one if bkv <= group)
  tile_group = [t * KEY_TILE // group if groups > 1 else 0 for t in range(tiles)]

  head_dim = n_chunks * chunk
  m_tiles = head_dim // KEY_TILE                # 64-channel row tiles of V^T
  score_scale = head_dim ** -0.5 * LOG2E
  planes = 1 if bits == 4 else 2                # the 4-bit read never touches plane 1
  n_pad = max(n, 32)                            # N padded to >= 32 (128-byte TMA rows)
  scale_mult = 1.0 if bits == 4 else 1.0 / 16.0
  code_dtype = jnp.dtype(dtype if bits == 4 else CODE_DTYPE_8BIT)   # the split MMAs' inputs
  offset = float(word_offset(code_dtype, planes))   # added to every code by `word_tile`
  col = plgpu.Layout.WGMMA.reduce(0)            # a vector along a tile's columns (N)
  row = plgpu.Layout.WGMMA.reduce(1)            # a vector along a tile's rows (keys)
  interpreted = interpret is not None

  def body(split, out_split, lengths_ref, q_ref, kc_ref, vc_ref, ks_ref, kz_ref, vs_ref, vz_ref,
           acc_out_ref, m_out_ref, l_out_ref, scores_ref=None, *,
           qs_smem,       # [groups, D/64, N, 64] code_dtype (swizzled): q * s_K per key group
           kc_smem,       # [stages, planes, D/64, bkv/4, 32] uint32: per key 8 words
           vc_smem,       # [stages, planes, tiles, D/4, 32] uint32: per channel 8 words
           p_smem,        # [tiles, N, 64] code_dtype (swizzled): (p * s_V) per key tile
           qt_smem,       # [D/64, 64, N] fp32: q^T
           o_smem,        # [D, N] fp32 (epilogue)
           ks_smem,       # [stages, groups, D] fp16: the stage's key scale rows
           vmeta_smem,    # [stages, 2, bkv] fp16: the stage's value scales (0) and zeros (1)
           kz_smem,       # [stages, groups, D] fp16: the stage's key zero rows
           m_smem, l_smem,  # [NP] fp32
           q_barrier, k_barriers, v_barriers,
           s_smem=None,   # [bkv, N] fp32 (with_scores)
           a_smem=None):  # [64, 64] code_dtype: interpret mode only (wgmma A from SMEM)
    head_qblock = lax.axis_index("head_qblock")
    b = lax.axis_index("batch")
    h = lax.div(head_qblock, jnp.int32(q_blocks))
    qb = lax.rem(head_qblock, jnp.int32(q_blocks))

    length = jnp.minimum(jnp.maximum(lengths_ref[b], 0), qkv.capacity)   # clipped to [0, S]
    num_tiles = lax.div(length + (bkv - 1), jnp.int32(bkv))   # stages of bkv keys
    tiles_per_split = lax.div(num_tiles + (num_splits - 1), jnp.int32(num_splits))
    first_tile = split * tiles_per_split
    my_tiles = jnp.maximum(jnp.minimum(tiles_per_split, num_tiles - first_tile), 0)

    def fetch(step, slot):
      start = (first_tile + step) * bkv
      grp = lax.div(start, jnp.int32(group))
      # One TMA per plane and channel chunk: a TMA box has at most 5 (tiled) dims.
      for pn, hf in itertools.product(range(planes), range(n_chunks)):
        plgpu.copy_gmem_to_smem(kc_ref.at[b, h, pn, hf, pl.ds(lax.div(start, 4), bkv // 4)],
                                kc_smem.at[slot, pn, hf], k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(ks_ref.at[b, h, pl.ds(grp, groups)], ks_smem.at[slot],
                              k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(kz_ref.at[b, h, pl.ds(grp, groups)], kz_smem.at[slot],
                              k_barriers.at[slot])
      # V: the stage's key tiles are contiguous per plane, one TMA each.
      tile0 = lax.div(start, jnp.int32(KEY_TILE))
      for pn in range(planes):
        plgpu.copy_gmem_to_smem(vc_ref.at[b, h, pn, pl.ds(tile0, tiles)], vc_smem.at[slot, pn],
                                v_barriers.at[slot])
      plgpu.copy_gmem_to_smem(vs_ref.at[b, h, pl.ds(start, bkv)], vmeta_smem.at[slot, 0],
                              v_barriers.at[slot])
      plgpu.copy_gmem_to_smem(vz_ref.at[b, h, pl.ds(start, bkv)], vmeta_smem.at[slot, 1],
                              v_barriers.at[slot])

    def store_scores(ss, start):
      """The stage's score tiles ss (each [64, N], registers) to
      scores[b, h, start:start + bkv], through s_smem and a TMA."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous stage's TMA has read it
      warpgroup_barrier(interpreted)                    # (waited for by its issuing thread)
      for t, s in enumerate(ss):
        s_smem[pl.ds(t * KEY_TILE, KEY_TILE)] = s
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(s_smem, scores_ref.at[b, h, pl.ds(start, bkv)])

    for hf in range(n_chunks):   # per chunk: a TMA box has at most 5 dims
      plgpu.copy_gmem_to_smem(q_ref.at[b, h, qb, hf], qt_smem.at[hf], q_barrier)
    for step in range(num_stages):
      pl.when(step < my_tiles)(functools.partial(fetch, step, step))
    plgpu.barrier_wait(q_barrier)

    def codes(tile_refs):
      """A [64, 64] code tile (one [16, 32] word ref per plane read) as exact integers in
      `code_dtype`: u - 8 (4-bit) or 16 (u - 8) + l = c8 - 128 (8-bit), plus `offset`."""
      return word_tile(tile_refs, code_dtype, interpret=interpreted)

    q_regs = [plgpu.load(qt_smem.at[hf], layout=plgpu.Layout.WGMMA, optimized=False)
              for hf in range(n_chunks)]                  # [64, N] fp32 each

    mma = functools.partial(wgmma_register_a, a_smem=a_smem)   # acc += a [64, C] @ b

    acc0 = plgpu.layout_cast(jnp.zeros((KEY_TILE, n), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), col)

    def kv_step(step, carry):
      accs, zacc, m_i, l_acc = carry
      slot = lax.rem(step, jnp.int32(num_stages))
      start = (first_tile + step) * bkv

      plgpu.barrier_wait(k_barriers.at[slot])
      # The key scales folded into q (one rounding of q * s, as a dequantized K would
      # have): qs = (q^T * s_K)^T per key group and 64-channel chunk, stored transposed as the
      # B operand. The key zero points enter as a score bias per key group and query row,
      # sum_d q_d (z_d + 8 s4_d) - offset * sum_d qs_d (the tiles' code offset times the very
      # B operand the wgmma reads): summed per thread over the chunks, then one cross-warp
      # reduction over the channels per group.
      terms = [None] * groups
      for g, (hf, qt) in itertools.product(range(groups), enumerate(q_regs)):
        channels = pl.ds(hf * chunk, chunk)
        s4 = plgpu.load(ks_smem.at[slot, g, channels], layout=row,
                        optimized=False).astype(jnp.float32)
        z = plgpu.load(kz_smem.at[slot, g, channels], layout=row,
                       optimized=False).astype(jnp.float32) + UPPER_OFFSET * s4
        qs = (qt * lax.broadcast_in_dim(s4 * scale_mult, (chunk, n), [0])).astype(code_dtype)
        qs_smem.at[g, hf].transpose((1, 0))[...] = qs
        term = qt * lax.broadcast_in_dim(z, (chunk, n), [0]) - offset * qs.astype(jnp.float32)
        terms[g] = term if terms[g] is None else terms[g] + term
      plgpu.commit_smem()
      biases = [lax.broadcast_in_dim(term.sum(axis=0) * score_scale, (KEY_TILE, n), [1])
                for term in terms]                # [64, N]: the group's bias on every key

      def qk_scope(*s_refs):                    # [64, N] fp32 per key tile
        for t, s_ref in enumerate(s_refs):
          g = tile_group[t]
          for hf in range(n_chunks):            # one wgmma per 64 channels
            keys = [kc_smem.at[slot, pn, hf, pl.ds(t * TILE_ROWS, TILE_ROWS)]
                    for pn in range(planes)]
            mma(s_ref, codes(keys), qs_smem.at[g, hf].transpose((1, 0)))
          if t:   # the previous tile's wgmmas are done: its A registers can be reused
            plgpu.wgmma_wait(n_chunks)
        return tuple(s_ref[...] for s_ref in s_refs)
      ss = pl.run_scoped(qk_scope, *[plgpu.ACC((KEY_TILE, n), jnp.float32)] * tiles)

      key_ids = plgpu.broadcasted_iota(jnp.int32, (KEY_TILE, n), 0, layout=plgpu.Layout.WGMMA)
      valids, scores = [], []
      for t, s in enumerate(ss):
        s = s * score_scale + biases[tile_group[t]]
        valids.append(key_ids + (start + t * KEY_TILE) < length)
        scores.append(jnp.where(valids[-1], s, -jnp.inf))
      if with_scores:
        pl.when(qb == 0)(lambda: store_scores(scores, start))

      # One cross-warp reduction per stage, the row max (the tiles are combined element-wise
      # first, same layout, then reduced over the keys). The row sum and the value zero-point
      # sum stay per thread ([64, N], rescaled by alpha like acc) and are reduced over the keys
      # once, after the loop.
      m_new = jnp.maximum(m_i, functools.reduce(jnp.maximum, scores).max(axis=0))
      alpha = jnp.exp2(m_i - m_new)
      a = lax.broadcast_in_dim(alpha, (KEY_TILE, n), [1])
      ps = [jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1])) for s in scores]
      l_acc = l_acc * a + functools.reduce(jnp.add, ps)

      plgpu.barrier_wait(v_barriers.at[slot])
      zsum = None
      for t, (p, valid) in enumerate(zip(ps, valids)):
        keys = pl.ds(t * KEY_TILE, KEY_TILE)
        vs = plgpu.load(vmeta_smem.at[slot, 0, keys], layout=row, optimized=False)
        vz = plgpu.load(vmeta_smem.at[slot, 1, keys], layout=row, optimized=False)
        vs4 = vs.astype(jnp.float32)
        vz = vz.astype(jnp.float32) + UPPER_OFFSET * vs4    # the value zero, plane offset folded
        vs = lax.broadcast_in_dim(vs4 * scale_mult, p.shape, [0])
        vz = lax.broadcast_in_dim(vz, p.shape, [0])
        # p is 0 past the length; select so a never-written scale there cannot leak a NaN.
        pv = jnp.where(valid, p * vs, 0.0).astype(code_dtype)   # B of PV, one rounding
        # The value codes come offset by `offset`: take offset * sum_t pv_t back out.
        z = jnp.where(valid, p * vz, 0.0) - offset * pv.astype(jnp.float32)
        zsum = z if zsum is None else zsum + z
        p_smem.at[t].transpose((1, 0))[...] = pv
      zacc = zacc * a + zsum
      plgpu.commit_smem()

      def pv_scope(*o_refs):                    # O^T [64 channels, N] per channel tile
        for t in range(tiles):
          for mt, o_ref in enumerate(o_refs):
            a = codes([vc_smem.at[slot, pn, t, pl.ds(mt * TILE_ROWS, TILE_ROWS)]
                       for pn in range(planes)])
            mma(o_ref, a, p_smem.at[t].transpose((1, 0)))
          if t:
            plgpu.wgmma_wait(m_tiles)
        return tuple(o_ref[...] for o_ref in o_refs)
      pv = pl.run_scoped(pv_scope, *[plgpu.ACC((KEY_TILE, n), jnp.float32)] * m_tiles)
      accs = tuple(acc * a + o for acc, o in zip(accs, pv))

      # Every warp is past its reads of this slot (word loads, scale loads, its wgmmas): refill.
      def refill():
        warpgroup_barrier(interpreted)
        fetch(step + num_stages, slot)
      pl.when(step + num_stages < my_tiles)(refill)
      return accs, zacc, m_new, l_acc

    accs, zacc, m_i, l_acc = lax.fori_loop(0, my_tiles, kv_step,
                                           ((acc0,) * m_tiles, acc0, m_i, acc0))
    l_i = l_acc.sum(axis=0)
    zacc = zacc.sum(axis=0)

    if with_scores:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last score TMA has read s_smem
    z = lax.broadcast_in_dim(zacc, (KEY_TILE, n), [1])
    for mt, acc in enumerate(accs):
      o_smem[pl.ds(mt * KEY_TILE, KEY_TILE)] = acc + z
    m_smem[pl.ds(0, n)] = m_i
    l_smem[pl.ds(0, n)] = l_i
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, acc_out_ref.at[b, h, qb, out_split])
    plgpu.copy_smem_to_gmem(m_smem, m_out_ref.at[b, h, qb, out_split])
    plgpu.copy_smem_to_gmem(l_smem, l_out_ref.at[b, h, qb, out_split])
    plgpu.wait_smem_to_gmem(0)

  num_exact = 0 if exact is None else exact.num_blocks
  bias_rows = 0 if exact is None else exact.bias.shape[0]

  def exact_body(e, q_ref, source_refs, kb_ref, out_refs,
                 q_smem,          # [N, D] dtype (swizzled): the query rows, B of QK (transposed)
                 k_smem, v_smem,  # [64, D] dtype (swizzled)
                 b_smem,          # [64, N] fp32: the tile's mask bias
                 p_smem,          # [N, 64] dtype (swizzled): P^T, B of PV (transposed)
                 o_smem,          # [D, N] fp32 (epilogue)
                 m_smem, l_smem,  # [NP] fp32
                 q_barrier, k_barrier, v_barrier):
    """Exact block e: the keys [64 e, 64 e + 64) of q block qb of KV head h of row b (from the
    source piece that holds them), one softmax over them (keys as the wgmma M dimension, the
    quantized splits' orientation), written as one more partial. source_refs: the source
    pieces' k and v refs, in turn; out_refs: the acc, m, l outputs."""
    acc_out_ref, m_out_ref, l_out_ref = out_refs
    head_qblock = lax.axis_index("head_qblock")
    b = lax.axis_index("batch")
    h = lax.div(head_qblock, jnp.int32(q_blocks))
    qb = lax.rem(head_qblock, jnp.int32(q_blocks))
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, qb], q_smem, q_barrier)
    first = 0
    for k_ref, v_ref in zip(source_refs[::2], source_refs[1::2]):
      tiles = -(-k_ref.shape[1] // KEY_TILE)    # the last may run past the piece: zero-filled

      def fetch(k_ref=k_ref, v_ref=v_ref, first=first):
        keys = pl.ds((e - first) * KEY_TILE, KEY_TILE)
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem, k_barrier)
        plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem, v_barrier)
      if len(source_refs) == 2:
        fetch()
      else:
        pl.when((e >= first) & (e < first + tiles))(fetch)
      first += tiles
    plgpu.copy_gmem_to_smem(kb_ref.at[b if bias_rows > 1 else 0, qb,
                                      pl.ds(e * KEY_TILE, KEY_TILE)], b_smem, k_barrier)
    plgpu.barrier_wait(q_barrier)
    plgpu.barrier_wait(k_barrier)

    def qk_scope(s_ref):                        # S^T [64 keys, N] fp32
      plgpu.wgmma(s_ref, k_smem, q_smem.transpose((1, 0)))
      return s_ref[...]
    s = pl.run_scoped(qk_scope, plgpu.ACC((KEY_TILE, n), jnp.float32))
    s = s * score_scale + plgpu.load(b_smem, layout=plgpu.Layout.WGMMA, optimized=False)
    m_e = s.max(axis=0)                                                      # [N]
    # A row that sees none of these keys: a finite stand-in keeps p at 0 instead of NaN.
    m_use = jnp.where(m_e == -jnp.inf, 0.0, m_e)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, (KEY_TILE, n), [1]))
    plgpu.barrier_wait(v_barrier)
    p_smem.transpose((1, 0))[...] = p.astype(dtype)
    plgpu.commit_smem()

    def pv_scope(*o_refs):                      # O^T [64 channels, N] per channel tile
      for mt, o_ref in enumerate(o_refs):
        vt = v_smem.at[:, pl.ds(mt * KEY_TILE, KEY_TILE)].transpose((1, 0))
        plgpu.wgmma(o_ref, vt, p_smem.transpose((1, 0)))
      return tuple(o_ref[...] for o_ref in o_refs)
    accs = pl.run_scoped(pv_scope, *[plgpu.ACC((KEY_TILE, n), jnp.float32)] * m_tiles)
    for mt, acc in enumerate(accs):
      o_smem[pl.ds(mt * KEY_TILE, KEY_TILE)] = acc
    m_smem[pl.ds(0, n)] = m_e
    l_smem[pl.ds(0, n)] = p.sum(axis=0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, acc_out_ref.at[b, h, qb, e])
    plgpu.copy_smem_to_gmem(m_smem, m_out_ref.at[b, h, qb, e])
    plgpu.copy_smem_to_gmem(l_smem, l_out_ref.at[b, h, qb, e])
    plgpu.wait_smem_to_gmem(0)

  itemsize = jnp.dtype(dtype).itemsize          # = code_dtype's: both 16-bit
  mma_sw = swizzled(chunk * itemsize, 8 * itemsize)
  # TMA SMEM ends must be 128-byte aligned: the small per-row vectors are padded to 32 floats.
  # Swizzled buffers first (they need 1 KiB-aligned offsets; all are multiples of 1 KiB).
  scratch = dict(
      qs_smem=plgpu.SMEM((groups, n_chunks, n, chunk), code_dtype, **mma_sw),
      kc_smem=plgpu.SMEM((num_stages, planes, n_chunks, bkv // 4, SMEM_ROW_WORDS), jnp.uint32),
      vc_smem=plgpu.SMEM((num_stages, planes, tiles, head_dim // 4, SMEM_ROW_WORDS),
                         jnp.uint32),
      p_smem=plgpu.SMEM((tiles, n, KEY_TILE), code_dtype,
                        **swizzled(KEY_TILE * itemsize, 8 * itemsize)),
  )
  scratch.update(a_staging((KEY_TILE, chunk), code_dtype, interpret, **mma_sw))
  scratch.update(
      qt_smem=plgpu.SMEM((n_chunks, chunk, n), jnp.float32),
      o_smem=plgpu.SMEM((head_dim, n), jnp.float32),
      ks_smem=plgpu.SMEM((num_stages, groups, head_dim), META_DTYPE),
      vmeta_smem=plgpu.SMEM((num_stages, 2, bkv), META_DTYPE),
      kz_smem=plgpu.SMEM((num_stages, groups, head_dim), META_DTYPE),
      m_smem=plgpu.SMEM((n_pad,), jnp.float32),
      l_smem=plgpu.SMEM((n_pad,), jnp.float32),
      q_barrier=plgpu.Barrier(num_arrivals=n_chunks),
      # TMAs landing on each: K codes (per plane and chunk) + key scales + zeros; V codes (per
      # plane) + value scales + zeros.
      k_barriers=plgpu.Barrier(num_arrivals=n_chunks * planes + 2, num_barriers=num_stages),
      v_barriers=plgpu.Barrier(num_arrivals=planes + 2, num_barriers=num_stages),
  )
  if with_scores:
    scratch["s_smem"] = plgpu.SMEM((bkv, n), jnp.float32)
  part = (batch, num_kv_heads, q_blocks, num_exact + num_splits)
  out_type = [
      jax.ShapeDtypeStruct((*part, head_dim, n), jnp.float32),
      jax.ShapeDtypeStruct((*part, n_pad), jnp.float32),
      jax.ShapeDtypeStruct((*part, n_pad), jnp.float32),
  ]
  if with_scores:              # only then: the plain kernel has no score output at all
    out_type.append(jax.ShapeDtypeStruct((batch, num_kv_heads, qkv.capacity, n), jnp.float32))

  names = tuple(scratch)
  # The codes as rows of 32 words (128 bytes) for the TMA: four keys (K) or four channels (V)
  # a row; a 64-row code tile is 16 of them.
  capacity = qkv.capacity
  kc_rows = qkv.k_codes.reshape(batch, num_kv_heads, 2, n_chunks, capacity // 4, SMEM_ROW_WORDS)
  vc_rows = qkv.v_codes.reshape(batch, num_kv_heads, 2, capacity // KEY_TILE, head_dim // 4,
                                SMEM_ROW_WORDS)

  quant_inputs = (lengths, q_t, kc_rows, vc_rows, qkv.k_scale, qkv.k_zero, qkv.v_scale,
                  qkv.v_zero)
  exact_inputs = () if exact is None else (
      exact.q_cols, *[x for pair in exact.sources for x in pair], exact.bias)
  if exact is not None:
    exact_scratch = (
        plgpu.SMEM((n, head_dim), dtype, **mma_sw),
        plgpu.SMEM((KEY_TILE, head_dim), dtype, **mma_sw),
        plgpu.SMEM((KEY_TILE, head_dim), dtype, **mma_sw),
        plgpu.SMEM((KEY_TILE, n), jnp.float32),
        plgpu.SMEM((n, KEY_TILE), dtype, **swizzled(KEY_TILE * itemsize, 8 * itemsize)),
        plgpu.SMEM((head_dim, n), jnp.float32),
        plgpu.SMEM((n_pad,), jnp.float32),
        plgpu.SMEM((n_pad,), jnp.float32),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=2),           # the K tile + its bias tile
        plgpu.Barrier(),
    )

  def quant_attention_kernel(*refs):
    quant_refs, rest = refs[:len(quant_inputs)], refs[len(quant_inputs):]
    exact_refs, out_refs = rest[:len(exact_inputs)], rest[len(exact_inputs):]
    split = lax.axis_index("split")

    def quant():                                # the two branches' SMEM scopes are siblings:
      pl.run_scoped(                            # they share the same bytes
          lambda *scr: body(split - num_exact, split, *quant_refs, *out_refs,
                            **dict(zip(names, scr))), *scratch.values())
    if exact is None:
      quant()
      return
    pl.when(split >= num_exact)(quant)
    pl.when(split < num_exact)(lambda: pl.run_scoped(
        lambda *scr: exact_body(split, exact_refs[0], exact_refs[1:-1], exact_refs[-1],
                                out_refs[:3], *scr), *exact_scratch))

  return plgpu.kernel(
      quant_attention_kernel,
      out_type=tuple(out_type),
      grid=(num_exact + num_splits, num_kv_heads * q_blocks, batch),
      grid_names=("split", "head_qblock", "batch"),
      # Barriers by hand (sync.py); room for every [64, N] tile register of a cross-warp
      # reduction over the keys (the row max) or channels (the key bias) at once: one round, two
      # barriers, instead of two rounds from N = 24 on (the default room takes two registers).
      compiler_params=compiler_params(
          approx_math=True, reduction_scratch_bytes=max(REDUCTION_BYTES_PER_REGISTER * (n // 8),
                                                        DEFAULT_REDUCTION_BYTES)),
      interpret=interpret,
  )(*quant_inputs, *exact_inputs)


# ----------------------------------------------------------------------------------------------
# Wrapper.
# ----------------------------------------------------------------------------------------------

def _check_quantized(q, qkv, bits, lengths_quantized, cfg) -> int:
  """Checks q, the quantized region and its lengths; returns Hkv."""
  check_bits(bits)
  if q.ndim != 4:
    raise ValueError(f"q must be [B, Tq, Hq, D], got shape {q.shape}")
  b, tq, hq, d = q.shape
  if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
    raise ValueError(f"q must be bfloat16 or float16, got {q.dtype}")
  if d not in (64, 128):
    raise ValueError(f"head dim D={d} must be 64 or 128 (64-channel wgmma chunks)")
  kc, vc = qkv.k_codes, qkv.v_codes
  c = CHANNEL_CHUNK
  w = c // CODES_PER_WORD
  if kc.ndim != 6 or kc.shape[0] != b or kc.shape[2:4] != (2, d // c) or kc.shape[5] != w:
    raise ValueError(f"qkv.k_codes must be [B={b}, Hkv, 2, D/64={d // c}, S, {w}], got "
                     f"{kc.shape}")
  hkv, capacity = kc.shape[1], kc.shape[4]
  check_sizes(B=b, Tq=tq, Hq=hq, Hkv=hkv, S=capacity)
  if capacity % KEY_TILE:
    raise ValueError(f"quantized capacity S={capacity} must be a multiple of the {KEY_TILE}-key "
                     f"tile")
  if vc.shape != (b, hkv, 2, capacity // KEY_TILE, d, w):
    raise ValueError(f"qkv.v_codes must be [B, Hkv, 2, S/64, D, {w}] = "
                     f"{(b, hkv, 2, capacity // KEY_TILE, d, w)}, "
                     f"got {vc.shape}")
  if hq % hkv:
    raise ValueError(f"Hq={hq} query heads is not a multiple of Hkv={hkv} KV heads")
  if qkv.group % KEY_TILE:
    raise ValueError(f"key group {qkv.group} must be a multiple of the {KEY_TILE}-key tile")
  if cfg.block_kv is not None and not _fits(cfg.block_kv, qkv.group, capacity):
    raise ValueError(f"block_kv={cfg.block_kv} must divide the quantized capacity S={capacity} "
                     f"and divide or be a multiple of the key group {qkv.group}")
  check_lengths("lengths_quantized", lengths_quantized, b)
  check_qkv_arrays(qkv)
  return hkv


def check_qkv_arrays(qkv: QuantKV) -> None:
  """The dtypes and shapes the kernels read a QuantKV with (quant_attention, dequantize_kv; D
  and S multiples of 64, checked before): uint32 code words, k_codes [B, Hkv, 2, D/64, S, 8] and
  v_codes [B, Hkv, 2, S/64, D, 8] (dequantize_kv's reshape failed on a mismatched v_codes); fp16
  (META_DTYPE) scales and zeros, keys' [B, Hkv, S/G, D], values' [B, Hkv, S] (a float32 one
  reached Mosaic as a raw dtype error)."""
  kc, vc = qkv.k_codes, qkv.v_codes
  if jnp.dtype(kc.dtype) != jnp.dtype(jnp.uint32) or jnp.dtype(vc.dtype) != jnp.dtype(jnp.uint32):
    raise ValueError(f"qkv codes must be uint32 words of 8 4-bit codes, got {kc.dtype} / "
                     f"{vc.dtype}")
  w = CHANNEL_CHUNK // CODES_PER_WORD
  if kc.ndim != 6 or kc.shape[2] != 2 or kc.shape[5] != w:
    raise ValueError(f"qkv.k_codes must be [B, Hkv, 2, D/64, S, {w}], got {kc.shape}")
  b, hkv, capacity, d = kc.shape[0], kc.shape[1], qkv.capacity, qkv.head_dim
  if not is_int(qkv.group) or qkv.group < 1 or capacity % qkv.group:
    # S = 192 at G = 128 passed (k_scale [.., S // G = 1, D] matched): slots past the last whole
    # group read scales and zeros past the array, silent wrong keys.
    raise ValueError(f"qkv.group must be a positive int dividing the capacity S={capacity}, got "
                     f"{qkv.group!r}")
  if vc.shape != (b, hkv, 2, capacity // KEY_TILE, d, w):
    raise ValueError(f"qkv.v_codes must be [B, Hkv, 2, S/64, D, {w}] = "
                     f"{(b, hkv, 2, capacity // KEY_TILE, d, w)}, got {vc.shape}")
  for name, x in (("k_scale", qkv.k_scale), ("k_zero", qkv.k_zero), ("v_scale", qkv.v_scale),
                  ("v_zero", qkv.v_zero)):
    if jnp.dtype(x.dtype) != jnp.dtype(META_DTYPE):
      raise ValueError(f"qkv.{name} must be {jnp.dtype(META_DTYPE).name}, got {x.dtype}")
  key_shape = (b, hkv, capacity // qkv.group, d)
  if qkv.k_scale.shape != key_shape or qkv.k_zero.shape != key_shape:
    raise ValueError(f"qkv.k_scale and k_zero must be [B, Hkv, S/G, D] = {key_shape}, got "
                     f"{qkv.k_scale.shape} / {qkv.k_zero.shape}")
  if qkv.v_scale.shape != (b, hkv, capacity) or qkv.v_zero.shape != (b, hkv, capacity):
    raise ValueError(f"qkv.v_scale and v_zero must be [B, Hkv, S] = {(b, hkv, capacity)}, got "
                     f"{qkv.v_scale.shape} / {qkv.v_zero.shape}")


def _check_float_keys(**keys) -> None:
  """Exactly attended keys and values are floating point (any float dtype, read in q's): an
  integer array was converted silently, as decode_attention once took an integer k_new."""
  for name, x in keys.items():
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point, got {x.dtype}")


def _check_inputs(q, qkv, bits, lengths_quantized, k_full, v_full, lengths_full, k_new, v_new,
                  inflight_mask, cfg):
  hkv = _check_quantized(q, qkv, bits, lengths_quantized, cfg)
  b, tq, _, d = q.shape
  check_lengths("lengths_full", lengths_full, b)
  if k_full.ndim != 4 or k_full.shape[:2] != (b, hkv) or k_full.shape[3] != d:
    raise ValueError(f"k_full must be [B={b}, Hkv={hkv}, R, D={d}], got {k_full.shape}")
  if v_full.shape != k_full.shape:
    raise ValueError(f"v_full shape {v_full.shape} differs from k_full shape {k_full.shape}")
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.shape != (b, tq, hkv, d):
      raise ValueError(f"{name} must be [B, Tq, Hkv, D] = {(b, tq, hkv, d)}, got {x.shape}")
  _check_float_keys(k_full=k_full, v_full=v_full, k_new=k_new, v_new=v_new)
  check_mask("inflight_mask [Tq, Tq]", inflight_mask, (tq, tq))


@normalised(score_queries=static_ints, interpret=interpret_mode)
@functools.partial(jax.jit, static_argnames=("bits", "return_lse", "score_queries", "config",
                                             "interpret"))
def quant_attention(q: jax.Array, qkv: QuantKV, lengths_quantized: jax.Array,
                    k_full: jax.Array, v_full: jax.Array, lengths_full: jax.Array,
                    k_new: jax.Array, v_new: jax.Array, inflight_mask: jax.Array, *,
                    bits: int = 8, return_lse: bool = False,
                    score_queries: tuple[int, ...] = (),
                    config: QuantAttentionConfig = QuantAttentionConfig(),
                    interpret: Any = None):
  """Decode attention over a quantized region, a full-precision recent segment and in-flight
  tokens, one softmax over all three.

  q [B, Tq, Hq, D] bf16/fp16; qkv: QuantKV with capacity S; lengths_quantized [B] (slots
  s < lengths_quantized[b] are read at `bits`); k_full, v_full [B, Hkv, Rf, D] with
  lengths_full [B]; k_new, v_new [B, Tq, Hkv, D]; inflight_mask [Tq, Tq].
  Returns out [B, Tq, Hq, D] (q's dtype), then with return_lse lse [B, Tq, Hq] fp32, then with
  score_queries (distinct query indices, static; any sequence of ints) probs
  [B, len(score_queries), Hq, S] fp32: those queries' final softmax weights on the quantized
  slots (0 where s >= lengths_quantized[b]).
  """
  _check_inputs(q, qkv, bits, lengths_quantized, k_full, v_full, lengths_full, k_new, v_new,
                inflight_mask, config)
  key_sets = full_and_inflight_keys(k_full, v_full, lengths_full, k_new, v_new, inflight_mask)
  return _with_keys(q, qkv, lengths_quantized, key_sets, bits=bits, return_lse=return_lse,
                    score_queries=score_queries, config=config, interpret=interpret)


def full_and_inflight_keys(k_full, v_full, lengths_full, k_new, v_new, inflight_mask):
  """`quant_attention`'s two key sets: the full-precision segment (token-major, its slots
  r < lengths_full[b]) and the in-flight tokens under the [Tq, Tq] mask."""
  n_full = int32_clipped(lengths_full, k_full.shape[2])
  full_mask = jnp.arange(k_full.shape[2])[None, None, :] < n_full[:, None, None]  # [B, 1, Rf]
  return ((k_full.transpose(0, 2, 1, 3), v_full.transpose(0, 2, 1, 3), full_mask),
          (k_new, v_new, inflight_mask.astype(bool)[None]))


@normalised(score_queries=static_ints, interpret=interpret_mode)
@functools.partial(jax.jit, static_argnames=("bits", "return_lse", "score_queries", "config",
                                             "interpret"))
def quant_attention_with_keys(q: jax.Array, qkv: QuantKV, lengths_quantized: jax.Array,
                              key_sets, *, bits: int = 8, return_lse: bool = False,
                              score_queries: tuple[int, ...] = (),
                              config: QuantAttentionConfig = QuantAttentionConfig(),
                              interpret: Any = None):
  """`quant_attention` with the exactly-attended keys given as key sets: a sequence of
  (k [B, U, Hkv, D], v [B, U, Hkv, D], mask [B or 1, Tq or 1, U] bool: query t sees key u), any
  float dtype (attended by the kernel's exact blocks in q's dtype, fp32 softmax). One softmax
  over the quantized slots s < lengths_quantized[b] and every key set, so a caller whose recent
  keys have per-query masks (QuantSpec's recent buffer across a flush, its draft scratch) needs
  no second softmax and merge. A key set in q's dtype is read where it lies, whatever its
  length (`exact_keys`). Outputs as `quant_attention`."""
  hkv = _check_quantized(q, qkv, bits, lengths_quantized, config)
  b, tq, _, d = q.shape
  for i, (k, v, mask) in enumerate(key_sets):
    check_mask(f"key set {i}: mask", mask)
    if k.ndim != 4 or k.shape[0] != b or k.shape[2:] != (hkv, d) or v.shape != k.shape:
      raise ValueError(f"key set {i}: k and v must be [B={b}, U, Hkv={hkv}, D={d}], got "
                       f"{k.shape} / {v.shape}")
    _check_float_keys(**{f"key set {i}: k": k, f"key set {i}: v": v})
    if (mask.ndim != 3 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, tq)
        or mask.shape[2] != k.shape[1]):
      raise ValueError(f"key set {i}: mask must be [B or 1, Tq={tq} or 1, U={k.shape[1]}], "
                       f"got {mask.shape}")
  key_sets = tuple((k, v, mask.astype(bool)) for k, v, mask in key_sets)
  return _with_keys(q, qkv, lengths_quantized, key_sets, bits=bits, return_lse=return_lse,
                    score_queries=score_queries, config=config, interpret=interpret)


def _with_keys(q, qkv, lengths_quantized, key_sets, *, bits, return_lse, score_queries, config,
               interpret):
  """The wrapper behind both entry points (inputs checked)."""
  b, tq, hq, d = q.shape
  hkv, capacity = qkv.k_codes.shape[1], qkv.capacity
  group = hq // hkv
  sel = check_score_queries(score_queries, tq, group)
  # The selected queries go first (their rows lead q block 0); q and the key sets' mask rows
  # follow that order, out and lse are put back below.
  order = selected_first(sel, range(tq))
  if order != tuple(range(tq)):
    idx = np.array(order)
    q = q[:, idx]
    key_sets = tuple((k, v, mask[:, idx] if mask.shape[1] > 1 else mask)
                     for k, v, mask in key_sets)
  n_rows = tq * group
  if _dequantizes(config, n_rows, bits, qkv, q.dtype):
    return _dequantized_call(q, qkv, lengths_quantized, key_sets, bits=bits, num_selected=len(sel),
                             order=order, return_lse=return_lse, interpret=interpret)
  # q block 0 holds every selected query's rows (its score tiles are the ones written).
  q_blocks, n = _q_blocks(n_rows, config.block_m, score_rows(len(sel), group))
  block_kv = _block_kv(config, n, qkv.group, capacity, bits, batch=b)

  q_rows = q.reshape(b, tq, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, n_rows, d)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, q_blocks * n - n_rows), (0, 0)))
  q_rows = q_rows.reshape(b, hkv, q_blocks, n, d)                            # [B, Hkv, NQB, N, D]
  q_t = q_rows.reshape(b, hkv, q_blocks, n, d // CHANNEL_CHUNK, CHANNEL_CHUNK)
  q_t = q_t.transpose(0, 1, 2, 4, 5, 3).astype(jnp.float32)   # [B, Hkv, NQB, D/64, 64, N]
  exact = exact_keys(q_rows, key_sets, group=group, num_queries=tq) if key_sets else None
  num_splits, merge_ranges = _num_splits(config, block_kv, b, hkv, q_blocks, capacity, bits=bits,
                                         rows=n,
                                         exact_blocks=exact.num_blocks if exact is not None else 0)
  acc, m2, l, *scores = _quant_partials(
      q_t, qkv, int32_clipped(lengths_quantized, capacity, kernel_clips=True), bits=bits,
      num_splits=num_splits, dtype=q.dtype, cfg=config, block_kv=block_kv,
      with_scores=bool(sel), exact=exact, interpret=interpret)
  out_t, lse_t = merge_partials_in_ranges(acc, m2, l, ranges=merge_ranges,
                                          interpret=interpret)             # [B,Hkv,NQB,D,N]
  out = _query_major(out_t.swapaxes(3, 4), n_rows, tq, group)              # [B, Tq, Hq, D]
  lse = _query_major(lse_t[..., :n, None], n_rows, tq, group)[..., 0]      # [B, Tq, Hq]
  probs = None
  if sel:
    read = (jnp.arange(capacity)[None]
            < int32_clipped(lengths_quantized, capacity)[:, None])[:, None]
    # [B, Hkv, S, N] -> the selected rows [B, Hkv, R, S]
    rows = scores[0][..., :score_rows(len(sel), group)].swapaxes(2, 3)
    probs = scores_to_probs(rows, lse[:, :len(sel)], read, group=group)
  return wrapper_outputs(out.astype(q.dtype), lse, probs, order, return_lse=return_lse)


def _dequantized_call(q, qkv, lengths_quantized, key_sets, *, bits, num_selected, order,
                      return_lse, interpret):
  """The dequantize path (`QuantAttentionConfig.path`; q and the key sets' masks already in
  `order`, the selected queries first): the codes read at `bits` into a [B, Hkv, S, D] copy in
  q's dtype (`pallas_kernels.dequantize_kv`), decode_attention's split kernel over its slots
  s < lengths_quantized[b], the key sets attended and everything merged by `combine_partials`
  (jnp). Outputs as `_with_keys`."""
  b, tq, hq, d = q.shape
  group = hq // qkv.k_codes.shape[1]
  from pallas_kernels.dequantize_kv import dequantize_kv   # (it imports this module)
  lengths = int32_clipped(lengths_quantized, qkv.capacity)
  # Only the slots decode_attention's kernel reads are written: whole block_kv tiles up to the
  # length, in the tiling split_partials resolves from this same config.
  decode_cfg = DecodeConfig().resolve(num_q_blocks(tq, group), qkv.capacity, d)
  k, v = dequantize_kv(qkv, bits, q.dtype, lengths, round_to=decode_cfg.block_kv,
                       interpret=interpret)                                  # [B, Hkv, S, D]
  acc, m2, l, *scores = split_partials(q, k, v, lengths, config=decode_cfg,
                                       num_score_queries=num_selected, interpret=interpret)
  out, lse = combine_partials(acc, m2, l, q, key_sets, group=group)        # [B, Tq, Hq(, D)]
  probs = None
  if num_selected:
    read = (jnp.arange(qkv.capacity)[None] < lengths[:, None])[:, None]    # [B, 1, S]
    probs = scores_to_probs(scores[0], lse[:, :num_selected], read, group=group)
  return wrapper_outputs(out.astype(q.dtype), lse, probs, order, return_lse=return_lse)


def exact_keys(q_rows, key_sets, *, group: int, num_queries: int) -> ExactKeys:
  """q_rows [B, Hkv, QB, N, D] (row j * N + n holds query (j * N + n) // G, of Tq =
  num_queries) and key sets (k [B, U_i, Hkv, D], v, mask [B or 1, Tq or 1, U_i] bool: a mask of
  one row holds for every query) -> the kernel's `ExactKeys`. Each
  non-empty key set is one source piece, read where it lies when it is in q's dtype (else
  converted): nothing is padded or concatenated, since the exact blocks' 64-key TMA reads past a
  piece's end, which the TMA unit (and the Mosaic GPU interpreter) fills with zeros, and the bias
  masks those keys off. So a QuantSpec step's 3G-slot tail, draft scratch and in-flight tokens
  all stay where they are. The bias [B or 1, QB, U, N] fp32 over the pieces' keys rounded up to
  whole tiles is 0 where the row's query sees key u, -inf for the keys past a piece and for
  padding rows."""
  q_blocks, rows, dtype = q_rows.shape[2], q_rows.shape[3], q_rows.dtype
  tq = num_queries           # not the masks' Tq: every mask may be one row, broadcast
  bm = max(mask.shape[0] for _, _, mask in key_sets)
  sources, masks = [], []
  for k, v, mask in key_sets:
    num_keys = k.shape[1]
    if num_keys == 0:
      continue
    k, v = k.astype(dtype), v.astype(dtype)                   # no copy when already in dtype
    k, v = tma_rows(k, axis=1), tma_rows(v, axis=1)      # zero keys to a TMA-legal count
    sources.append((k, v))
    pad = -(-num_keys // KEY_TILE) * KEY_TILE - num_keys
    masks.append(jnp.pad(jnp.broadcast_to(mask, (bm, tq, num_keys)), ((0, 0), (0, 0), (0, pad))))
  mask = (jnp.concatenate(masks, axis=2) if masks
          else jnp.zeros((bm, tq, 0), bool))                                  # [Bm, Tq, U]
  row = np.arange(q_blocks * rows)
  query = np.minimum(row // group, tq - 1)
  seen = mask[:, query] & jnp.asarray(row < tq * group)[None, :, None]       # [Bm, QB * N, U]
  bias = jnp.where(seen, 0.0, -jnp.inf).astype(jnp.float32)
  bias = bias.reshape(bm, q_blocks, rows, -1).swapaxes(2, 3)                 # [Bm, QB, U, N]
  return ExactKeys(q_rows, tuple(sources), bias)


def _query_major(x, n_rows, tq, group):
  """[B, Hkv, QB, N, ...] per q-block rows -> [B, Tq, Hkv * G, ...] (row r = t * G + g)."""
  b, hkv, q_blocks, n = x.shape[:4]
  x = x.reshape(b, hkv, q_blocks * n, *x.shape[4:])[:, :, :n_rows]
  x = x.reshape(b, hkv, tq, group, *x.shape[3:])
  return jnp.moveaxis(x, 2, 1).reshape(b, tq, hkv * group, *x.shape[4:])


# ----------------------------------------------------------------------------------------------
# Reference: dequantize, then attend (pure jnp, fp32 softmax).
# ----------------------------------------------------------------------------------------------

def quant_attention_reference(q, qkv: QuantKV, bits, lengths_quantized, k_full, v_full,
                              lengths_full, k_new, v_new, inflight_mask, *,
                              return_lse: bool = False, score_queries: tuple[int, ...] = ()):
  """One softmax over quantized slots s < lengths_quantized[b] (dequantized at `bits`),
  full-precision slots r < lengths_full[b] and in-flight keys u with inflight_mask[t, u].
  Shapes and outputs as `quant_attention` (probs straight from the softmax); computes in q's
  dtype (pass fp32 copies on CPU)."""
  b, tq, hq, d = q.shape
  k_q, v_q = dequantize(qkv, bits, dtype=q.dtype)                          # [B, Hkv, S, D]
  hkv, s_q = k_q.shape[1], k_q.shape[2]
  k_c = jnp.concatenate([k_q, k_full.astype(q.dtype)], axis=2)            # [B, Hkv, S+Rf, D]
  v_c = jnp.concatenate([v_q, v_full.astype(q.dtype)], axis=2)
  cache_mask = jnp.concatenate(
      [jnp.arange(s_q)[None, :] < int32_clipped(lengths_quantized, s_q)[:, None],
       jnp.arange(k_full.shape[2])[None, :]
       < int32_clipped(lengths_full, k_full.shape[2])[:, None]], axis=1)   # [B, S+Rf]
  qg = q.reshape(b, tq, hkv, hq // hkv, d)
  scale = d ** -0.5
  s_c = f32_einsum("bthgd,bhsd->bhgts", qg, k_c) * scale
  s_n = f32_einsum("bthgd,buhd->bhgtu", qg, k_new) * scale
  s_c = jnp.where(cache_mask[:, None, None, None, :], s_c, -jnp.inf)
  s_n = jnp.where(inflight_mask[None, None, None], s_n, -jnp.inf)
  m = jnp.maximum(s_c.max(-1), s_n.max(-1))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p_c = jnp.exp(s_c - m[..., None])
  p_n = jnp.exp(s_n - m[..., None])
  denom = p_c.sum(-1) + p_n.sum(-1)
  o = (f32_einsum("bhgts,bhsd->bthgd", p_c.astype(v_c.dtype), v_c)
       + f32_einsum("bhgtu,buhd->bthgd", p_n.astype(v_new.dtype), v_new))
  inv = jnp.where(denom > 0, 1.0 / denom, 0.0)                             # [B, Hkv, G, Tq]
  out = (o * inv.transpose(0, 3, 1, 2)[..., None]).reshape(b, tq, hq, d).astype(q.dtype)
  results = [out]
  if return_lse:
    results.append((m + jnp.log(denom)).transpose(0, 3, 1, 2).reshape(b, tq, hq))
  if score_queries:
    sel = np.array(score_queries, np.int32)
    probs = (p_c[..., :s_q] * inv[..., None])[:, :, :, sel]                # [B, Hkv, G, n, S]
    results.append(probs.transpose(0, 3, 1, 2, 4).reshape(b, len(sel), hq, s_q))
  return results[0] if len(results) == 1 else tuple(results)
