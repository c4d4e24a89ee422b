"""QuantSpec hierarchical INT4/INT8 KV cache and a Mosaic GPU split-KV decode kernel reading it.

Quantizer (`quantize_kv`, QuantSpec's hierarchical scheme). Each group of values x shares one
asymmetric grid: zero z (= group min, rounded *down* to fp16) and 4-bit step s4 (= (max - z)/15,
rounded *up* to fp16), so every x of the group lies in [z, z + 15 * s4]. The 8-bit step is
s8 = s4 / 16 and the 8-bit code is the plain asymmetric round-to-nearest code

    c8 = clip(round_half_even((x - z) / s8), 0, 240)                (fp32 arithmetic)

It is split into an upper 4-bit code u = (c8 + 8) >> 4 in [0, 15] (round-to-nearest of x on the
s4 grid; it rounds up from 15/32 instead of 16/32 of a step, so |x - (z + u s4)| <= 17/32 s4) and a
lower 4-bit code l = c8 - 16 u in [-8, 7] (the symmetric round-to-nearest of the upper code's
residual x - z - u s4 at step s4 / 16; no clipping ever happens), so 16 u + l == c8 exactly.
  * 4-bit view:  x4 = z + u * s4                  (upper nibbles only)
  * 8-bit view:  x8 = z + (16 u + l) * s8         (both nibbles)
Groups: KEYS per channel over G = `group` consecutive tokens (scale, zero [B, Hkv, S/G, D]);
VALUES per token over the D channels (scale, zero [B, Hkv, S]).

Storage (`QuantKV`): codes [B, Hkv, 2, S, D/2] uint8 for K and for V. Plane 0 holds the upper
nibbles, plane 1 the lower nibbles (stored as l + 8). In a plane, byte j of a token packs channel
j (low nibble) and channel j + D/2 (high nibble), so one byte-tile unpacks by `& 15` and `>> 4`
into the two column halves of the head dim, each a wgmma-ready [tokens, D/2] tile. A 4-bit read
TMA-loads plane 0 only (D/2 bytes per token per tensor); an 8-bit read loads planes 0 and 1 in one
copy. Scales and zeros are fp16 (finite K/V required: |x| < 65504).

Kernel (`quant_attention`), grid (num_splits, Hkv * q_blocks, B), as decode_attention.py: one
thread block per (split, KV head x q block, row) walks its share of the row's valid quantized
tiles through a TMA ring that brings each tile's uint8 codes together with its scale/zero rows,
dequantizes them in registers (integer nibble extraction, the exact int -> fp32 conversion by bit
pattern, one fp32 FMA with the group's scale/zero, then bf16/fp16) into SMEM, and runs QK^T and PV
on wgmma as two D/2-wide halves with an online softmax. The full-precision recent segment and the
in-flight tokens are merged with the split partials in jnp
(`pallas_kernels.combine.combine_partials`), by log-sum-exp. The dequantized K and V tiles share
one SMEM buffer and the epilogue's output buffer reuses the loop's, so two blocks fit on an SM
(`target_blocks` 264 = 2 per SM of an H100/H200).

Measured (H200, S = 64K, Tq = 1, `benchmarks/quant_sweep.py`): 4-bit 129 us, 8-bit 149 us, against
78 us for decode_attention on the bf16 cache: the kernel is bound by instruction issue, not by
memory (~5 instructions per dequantized element, plus a softmax over a 64-row wgmma tile of which
Tq * Hq / Hkv = 4 rows are real). See benchmarks/NOTES.md for what would close the gap.

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
writes the selected queries' scores (packed first into q block 0; queries permuted, the in-flight
mask rows alike, outputs permuted back) from the tiles it computes, through SMEM and a TMA, to
a [B, Hkv, score_rows, S] fp32 output; the wrapper converts them with the combined lse.
score_queries=() builds exactly the kernel without any of this.

`quant_attention_reference` = dequantize, then exact fp32 attention (pure jnp).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels.combine import (check_score_queries, combine_partials, permute_queries,
                                    score_rows, scores_to_probs, selected_first, wrapper_outputs)

from pallas_kernels.decode_attention import BLOCK_M, LOG2E

META_DTYPE = jnp.float16
UPPER_LEVELS = 15                 # 4-bit upper code in [0, 15]
CODE8_MAX = 16 * UPPER_LEVELS     # 8-bit code in [0, 240]
MAGIC = 0x4B000000                # fp32 bits of 2^23: (MAGIC | c) as fp32 = 2^23 + c, c < 2^23
MAGIC_VALUE = float(2 ** 23)
CODE_BIAS = {4: 0.0, 8: 8.0}      # what the kernel's code tile carries on top of u / c8
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
  k_codes: jax.Array   # [B, Hkv, 2, S, D/2] uint8 (plane 0: upper nibbles, 1: lower + 8)
  v_codes: jax.Array   # [B, Hkv, 2, S, D/2] uint8
  k_scale: jax.Array   # [B, Hkv, S/G, D] fp16, 4-bit step s4 per channel and token group
  k_zero: jax.Array    # [B, Hkv, S/G, D] fp16
  v_scale: jax.Array   # [B, Hkv, S] fp16, 4-bit step s4 per token
  v_zero: jax.Array    # [B, Hkv, S] fp16
  group: int = 128     # tokens per key group

  @property
  def capacity(self) -> int:
    return self.k_codes.shape[3]

  @property
  def head_dim(self) -> int:
    return 2 * self.k_codes.shape[4]


def _round_to_meta(x, direction):
  """fp32 -> META_DTYPE, rounded down (direction < 0) or up (> 0), never to nearest."""
  r = x.astype(META_DTYPE)
  rf = r.astype(jnp.float32)
  if direction < 0:
    return jnp.where(rf > x, jnp.nextafter(r, jnp.array(-jnp.inf, META_DTYPE)), r)
  return jnp.where(rf < x, jnp.nextafter(r, jnp.array(jnp.inf, META_DTYPE)), r)


def _grid(lo, hi):
  """Group min / max (fp32) -> stored (zero, s4) with lo >= zero, hi <= zero + 15 * s4."""
  zero = _round_to_meta(lo, -1)
  # A multiply by the fp32 constant 1/15 (not a division, which XLA may rewrite): the grid is
  # then bit-reproducible by any fp32 implementation.
  step = _round_to_meta((hi - zero.astype(jnp.float32)) * jnp.float32(1 / UPPER_LEVELS), +1)
  step = jnp.where(step > 0, step, jnp.ones_like(step))   # constant group: any step works
  return zero, step


def _codes8(x, zero, step4):
  """The 8-bit code c8 in [0, 240] (int32) of x on the grid (zero, step4 / 16); all fp32."""
  step8 = step4.astype(jnp.float32) * (1.0 / 16.0)
  c = jnp.round((x - zero.astype(jnp.float32)) / step8)
  return jnp.clip(c, 0, CODE8_MAX).astype(jnp.int32)


def _pack_planes(c8):
  """c8 [..., S, D] int32 -> [..., 2, S, D/2] uint8 (upper plane, lower plane)."""
  upper = (c8 + 8) >> 4                                     # [0, 15]
  lower = c8 - 16 * upper + 8                               # l + 8, l in [-8, 7]
  half = c8.shape[-1] // 2
  pack = lambda c: (c[..., :half] | (c[..., half:] << 4)).astype(jnp.uint8)
  return jnp.stack([pack(upper), pack(lower)], axis=-3)


def _unpack_planes(codes):
  """[..., 2, S, D/2] uint8 -> (upper [..., S, D], lower [..., S, D]) int32, lower in [-8, 7]."""
  c = codes.astype(jnp.int32)
  full = jnp.concatenate([c & 15, c >> 4], axis=-1)         # [..., 2, S, D]
  return full[..., 0, :, :], full[..., 1, :, :] - 8


@functools.partial(jax.jit, static_argnames=("group",))
def quantize_kv(k: jax.Array, v: jax.Array, group: int = 128) -> QuantKV:
  """k, v [B, Hkv, S, D] (any float dtype; S a multiple of `group`, D even) -> QuantKV."""
  if k.ndim != 4 or v.shape != k.shape:
    raise ValueError(f"k and v must both be [B, Hkv, S, D], got {k.shape} and {v.shape}")
  b, hkv, s, d = k.shape
  if group <= 0 or s % group:
    raise ValueError(f"capacity S={s} must be a positive multiple of group={group}")
  if d % 2:
    raise ValueError(f"head dim D={d} must be even (two 4-bit codes per byte)")
  kf = k.astype(jnp.float32).reshape(b, hkv, s // group, group, d)   # [B, Hkv, S/G, G, D]
  k_zero, k_scale = _grid(kf.min(3), kf.max(3))                       # [B, Hkv, S/G, D]
  k_c8 = _codes8(kf, k_zero[:, :, :, None], k_scale[:, :, :, None]).reshape(b, hkv, s, d)
  vf = v.astype(jnp.float32)
  v_zero, v_scale = _grid(vf.min(3), vf.max(3))                       # [B, Hkv, S]
  v_c8 = _codes8(vf, v_zero[..., None], v_scale[..., None])
  return QuantKV(_pack_planes(k_c8), _pack_planes(v_c8), k_scale, k_zero, v_scale, v_zero,
                 group=group)


def codes8(qkv: QuantKV):
  """The reassembled 8-bit codes 16 * upper + lower, (K, V) each [B, Hkv, S, D] int32."""
  ku, kl = _unpack_planes(qkv.k_codes)
  vu, vl = _unpack_planes(qkv.v_codes)
  return 16 * ku + kl, 16 * vu + vl


@functools.partial(jax.jit, static_argnames=("bits", "dtype"))
def dequantize(qkv: QuantKV, bits: int = 8, dtype=jnp.float32):
  """(k, v) [B, Hkv, S, D] from the 4-bit (upper nibbles) or 8-bit (both) view."""
  if bits not in (4, 8):
    raise ValueError(f"bits must be 4 or 8, got {bits}")
  ku, kl = _unpack_planes(qkv.k_codes)
  vu, vl = _unpack_planes(qkv.v_codes)
  b, hkv, s, d = ku.shape
  ks = jnp.repeat(qkv.k_scale.astype(jnp.float32), qkv.group, axis=2)   # [B, Hkv, S, D]
  kz = jnp.repeat(qkv.k_zero.astype(jnp.float32), qkv.group, axis=2)
  vs = qkv.v_scale.astype(jnp.float32)[..., None]                        # [B, Hkv, S, 1]
  vz = qkv.v_zero.astype(jnp.float32)[..., None]
  if bits == 4:
    k = ku.astype(jnp.float32) * ks + kz
    v = vu.astype(jnp.float32) * vs + vz
  else:
    k = (16 * ku + kl).astype(jnp.float32) * (ks * (1 / 16)) + kz
    v = (16 * vu + vl).astype(jnp.float32) * (vs * (1 / 16)) + vz
  return k.astype(dtype), v.astype(dtype)


def bytes_per_token(head_dim: int, bits: int, group: int = 128) -> float:
  """Bytes one token of one KV head (K and V) costs a read at `bits` (codes + scales/zeros)."""
  codes = 2 * head_dim * bits // 8
  meta = 2 * 2 * head_dim / group + 2 * 2   # K: scale+zero per channel per group; V: per token
  return codes + meta


# ----------------------------------------------------------------------------------------------
# Step 1: the Mosaic GPU kernel over the quantized region.
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class QuantAttentionConfig:
  """Tiling. `block_kv` must divide the key group (a tile uses one row of key scales)."""
  block_kv: int = 64
  num_stages: int = 2
  num_splits: int | None = None
  target_blocks: int = 264       # 2 thread blocks per SM on an H100/H200 (fits SMEM/registers)
  min_tiles_per_split: int = 2
  share_dequant: bool = True     # one SMEM buffer for the dequantized K, then V, tile

  def __post_init__(self):
    if self.block_kv % 64 or self.block_kv <= 0:
      raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv}")
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


def _num_splits(cfg, batch, num_kv_heads, q_blocks, capacity):
  if cfg.num_splits is not None:
    return cfg.num_splits
  per_head = max(1, cfg.target_blocks // (batch * num_kv_heads * q_blocks))
  return max(1, min(per_head, (capacity // cfg.block_kv) // cfg.min_tiles_per_split))


def _swizzled(minor_bytes, itemsize):
  return dict(transforms=(plgpu.TilingTransform((8, minor_bytes // itemsize)),
                          plgpu.SwizzleTransform(minor_bytes)))


def _quant_partials(q_halves, qkv: QuantKV, lengths, *, bits, rows_out, num_splits,
                    cfg: QuantAttentionConfig, score_rows: int = 0, interpret: Any = None):
  """Split partials of the quantized region.

  q_halves [B, Hkv, 2, NQB * 64, D/2] (half 0: channels < D/2); lengths [B] int32 in [0, S].
  Returns acc [B, Hkv, NQB, NS, 2, rows_out, D/2] fp32 (un-normalised, by channel half),
  m [B, Hkv, NQB, NS, 64] fp32 (log2 units, -inf for an empty split), l [B, Hkv, NQB, NS, 64];
  with score_rows > 0 (a multiple of 8, <= 64) also scores [B, Hkv, score_rows, S] fp32: rows
  [0, score_rows) of q block 0, the scaled scores (log2 units) of the slots s < lengths[b], -inf
  for the rest of their last tile; the other slots are never written (undefined).
  """
  batch, num_kv_heads, _, m_total, half = q_halves.shape
  q_blocks = m_total // BLOCK_M
  block_kv, num_stages, group = cfg.block_kv, cfg.num_stages, qkv.group
  dtype = q_halves.dtype
  head_dim = 2 * half
  score_scale = head_dim ** -0.5 * LOG2E
  planes = 1 if bits == 4 else 2                  # the 4-bit read never touches plane 1
  col = plgpu.Layout.WGMMA.reduce(0)              # a vector along the tile's columns
  row = plgpu.Layout.WGMMA.reduce(1)              # a vector along the tile's rows

  def body(lengths_ref, q_ref, kc_ref, vc_ref, ks_ref, kz_ref, vs_ref, vz_ref,
           acc_out_ref, m_out_ref, l_out_ref,
           q_smem,        # [2, 64, D/2] dtype            (tiled, swizzled)
           kc_smem,       # [stages, planes, bkv, D/2] u8 (tiled, swizzled)
           vc_smem,       # [stages, planes, bkv, D/2] u8
           kd_smem,       # [2, bkv, D/2] dtype: the dequantized K halves
           vd_smem,       # [2, bkv, D/2] dtype: the V halves (kd_smem itself with share_dequant)
           p_smem,        # [64, bkv] dtype
           o_smem,        # [2, 64, D/2] fp32 (epilogue only; may alias kd, vd and p)
           m_smem, l_smem,
           kmeta_smem,    # [stages, 2, D] fp16: the tile's key scale (0) and zero (1) rows
           vmeta_smem,    # [stages, 2, bkv] fp16: the tile's value scales (0) and zeros (1)
           q_barrier, k_barriers, v_barriers,
           scores_ref=None,  # [B, Hkv, score_rows, S] fp32  GMEM (score_rows > 0)
           s_smem=None):    # [64, bkv] fp32, aliases o_smem (score_rows > 0)
    split = lax.axis_index("split")
    head_qblock = lax.axis_index("head_qblock")
    b = lax.axis_index("batch")
    h = lax.div(head_qblock, jnp.int32(q_blocks))
    qb = lax.rem(head_qblock, jnp.int32(q_blocks))

    length = lengths_ref[b]
    num_tiles = lax.div(length + (block_kv - 1), jnp.int32(block_kv))
    tiles_per_split = lax.div(num_tiles + (num_splits - 1), jnp.int32(num_splits))
    first_tile = split * tiles_per_split
    my_tiles = jnp.maximum(jnp.minimum(tiles_per_split, num_tiles - first_tile), 0)

    def fetch(step, slot):
      rows = pl.ds((first_tile + step) * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(kc_ref.at[b, h, pl.ds(0, planes), rows], kc_smem.at[slot],
                              k_barriers.at[slot])
      grp = lax.div((first_tile + step) * block_kv, jnp.int32(group))
      plgpu.copy_gmem_to_smem(ks_ref.at[b, h, grp], kmeta_smem.at[slot, 0], k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(kz_ref.at[b, h, grp], kmeta_smem.at[slot, 1], k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(vc_ref.at[b, h, pl.ds(0, planes), rows], vc_smem.at[slot],
                              v_barriers.at[slot])
      plgpu.copy_gmem_to_smem(vs_ref.at[b, h, rows], vmeta_smem.at[slot, 0], v_barriers.at[slot])
      plgpu.copy_gmem_to_smem(vz_ref.at[b, h, rows], vmeta_smem.at[slot, 1], v_barriers.at[slot])

    def store_scores(s, start):
      """Rows [0, score_rows) of the score tile s [64, bkv] (registers, WGMMA layout) to
      scores[b, h, :, start:start + bkv], through s_smem and a TMA (the whole tile goes to
      SMEM: a WGMMA-layout array slices at 64-row granularity only)."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous tile's TMA has read it
      s_smem[...] = s
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(s_smem.at[pl.ds(0, score_rows)],
                              scores_ref.at[b, h, :, pl.ds(start, block_kv)])

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, :, pl.ds(qb * BLOCK_M, BLOCK_M)], q_smem, q_barrier)
    for step in range(num_stages):
      pl.when(step < my_tiles)(functools.partial(fetch, step, step))
    plgpu.barrier_wait(q_barrier)

    def codes(codes_smem, slot):
      """The code tiles [bkv, D/2] fp32 of the two channel halves, offset by CODE_BIAS[bits]:
      u (4-bit) or 16 u + l + 8 (8-bit; the lower plane stores l + 8). Each plane is read from
      SMEM once for both halves; integer ops, then the exact int -> fp32 conversion by bits
      (MAGIC | c read as fp32 is 2^23 + c): no I2F instructions."""
      # Mosaic GPU has no 8-bit shifts: widen the bytes first (zero-extended; < 256).
      upper = codes_smem[slot, 0].astype(jnp.int32)                # [bkv, D/2]
      halves = [upper & 15, upper >> 4]
      if bits == 8:
        lower = codes_smem[slot, 1].astype(jnp.int32)
        halves = [(halves[0] << 4) + (lower & 15), (halves[1] << 4) + (lower >> 4)]
      bias = MAGIC_VALUE + CODE_BIAS[bits]
      return [lax.bitcast_convert_type(c | MAGIC, jnp.float32) - bias for c in halves]

    step_mult = 1.0 if bits == 4 else 1.0 / 16.0

    def dequant_k(slot):
      for hf, c in enumerate(codes(kc_smem, slot)):
        cols = pl.ds(hf * half, half)
        sc = plgpu.load(kmeta_smem.at[slot, 0, cols], layout=col, optimized=False)
        zr = plgpu.load(kmeta_smem.at[slot, 1, cols], layout=col, optimized=False)
        sc = sc.astype(jnp.float32) * step_mult
        zr = zr.astype(jnp.float32)
        x = (c * lax.broadcast_in_dim(sc, (block_kv, half), [1])
             + lax.broadcast_in_dim(zr, (block_kv, half), [1]))
        kd_smem[hf] = x.astype(dtype)

    def dequant_v(slot):
      sc = plgpu.load(vmeta_smem.at[slot, 0], layout=row, optimized=False)
      zr = plgpu.load(vmeta_smem.at[slot, 1], layout=row, optimized=False)
      sc = lax.broadcast_in_dim(sc.astype(jnp.float32) * step_mult, (block_kv, half), [0])
      zr = lax.broadcast_in_dim(zr.astype(jnp.float32), (block_kv, half), [0])
      for hf, c in enumerate(codes(vc_smem, slot)):
        vd_smem[hf] = (c * sc + zr).astype(dtype)

    acc0 = plgpu.layout_cast(jnp.zeros((BLOCK_M, half), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), row)
    l_i = plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), row)

    def kv_step(step, carry):
      acc_lo, acc_hi, m_i, l_i = carry
      slot = lax.rem(step, jnp.int32(num_stages))
      tile = first_tile + step

      plgpu.barrier_wait(k_barriers.at[slot])
      dequant_k(slot)
      plgpu.commit_smem()
      def qk_scope(s_ref):                      # [64, bkv] fp32; two D/2-deep wgmmas
        plgpu.wgmma(s_ref, q_smem.at[0], kd_smem.at[0].transpose((1, 0)))
        plgpu.wgmma(s_ref, q_smem.at[1], kd_smem.at[1].transpose((1, 0)))
        return s_ref[...]                       # waits: kd_smem is free for V after this
      s = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_M, block_kv), jnp.float32))
      s = s * score_scale
      slot_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, block_kv), 1,
                                        layout=plgpu.Layout.WGMMA)
      s = jnp.where(slot_ids + tile * block_kv < length, s, -jnp.inf)
      if score_rows:
        pl.when(qb == 0)(lambda: store_scores(s, tile * block_kv))

      m_new = jnp.maximum(m_i, s.max(axis=1))
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l_i = l_i * alpha + p.sum(axis=1)

      plgpu.barrier_wait(v_barriers.at[slot])
      dequant_v(slot)
      p_smem[...] = p.astype(dtype)
      plgpu.commit_smem()                       # also: every thread is done with this slot
      def pv_scope(lo_ref, hi_ref):
        plgpu.wgmma(lo_ref, p_smem, vd_smem.at[0])
        plgpu.wgmma(hi_ref, p_smem, vd_smem.at[1])
        return lo_ref[...], hi_ref[...]
      pv_lo, pv_hi = pl.run_scoped(pv_scope, plgpu.ACC((BLOCK_M, half), jnp.float32),
                                   plgpu.ACC((BLOCK_M, half), jnp.float32))
      a = lax.broadcast_in_dim(alpha, (BLOCK_M, half), [0])
      acc_lo = acc_lo * a + pv_lo
      acc_hi = acc_hi * a + pv_hi

      nxt = step + num_stages
      pl.when(nxt < my_tiles)(lambda: fetch(nxt, slot))
      return acc_lo, acc_hi, m_new, l_i

    acc_lo, acc_hi, m_i, l_i = lax.fori_loop(0, my_tiles, kv_step, (acc0, acc0, m_i, l_i))

    if score_rows:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last score TMA has read s_smem
    o_smem[0] = acc_lo
    o_smem[1] = acc_hi
    m_smem[...] = m_i
    l_smem[...] = l_i
    plgpu.commit_smem()
    for hf in range(2):        # one TMA per half: a [2, rows, D/2] SMEM slice is not contiguous
      plgpu.copy_smem_to_gmem(o_smem.at[hf, pl.ds(0, rows_out)],
                              acc_out_ref.at[b, h, qb, split, hf])
    plgpu.copy_smem_to_gmem(m_smem, m_out_ref.at[b, h, qb, split])
    plgpu.copy_smem_to_gmem(l_smem, l_out_ref.at[b, h, qb, split])
    plgpu.wait_smem_to_gmem(0)

  itemsize = jnp.dtype(dtype).itemsize
  half_sw = _swizzled(half * itemsize, itemsize)
  code_sw = _swizzled(half, 1)
  kvd = plgpu.SMEM((2, block_kv, half), dtype, **half_sw)
  p_buf = plgpu.SMEM((BLOCK_M, block_kv), dtype, **_swizzled(128, itemsize))
  loop_bufs = (kvd, p_buf) if cfg.share_dequant else (kvd, kvd, p_buf)
  o_buf = plgpu.SMEM((2, BLOCK_M, half), jnp.float32)
  scratch = [
      plgpu.SMEM((2, BLOCK_M, half), dtype, **half_sw),
      plgpu.SMEM((num_stages, planes, block_kv, half), jnp.uint8, **code_sw),
      plgpu.SMEM((num_stages, planes, block_kv, half), jnp.uint8, **code_sw),
      # The epilogue's o buffer reuses the loop's dequantization and p buffers (idle by then);
      # with scores it shares memory with the score tile instead (which the loop uses).
      plgpu.RefUnion(o_buf, plgpu.SMEM((BLOCK_M, block_kv), jnp.float32)) if score_rows
      else plgpu.RefUnion(o_buf, loop_bufs),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.SMEM((num_stages, 2, head_dim), META_DTYPE),
      plgpu.SMEM((num_stages, 2, block_kv), META_DTYPE),
      plgpu.Barrier(),
      # Three TMAs land on each: the codes, the scales, the zeros.
      plgpu.Barrier(num_arrivals=3, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=3, num_barriers=num_stages),
  ]
  if score_rows:
    scratch[3:3] = loop_bufs
  part = (batch, num_kv_heads, q_blocks, num_splits)
  out_type = [
      jax.ShapeDtypeStruct((*part, 2, rows_out, half), jnp.float32),
      jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32),
      jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32),
  ]
  if score_rows:               # only then: score_rows == 0 builds the plain kernel
    out_type.append(jax.ShapeDtypeStruct((batch, num_kv_heads, score_rows, qkv.capacity),
                                         jnp.float32))

  def entry(*refs):
    def scoped(q_smem, kc_smem, vc_smem, *scr):
      n = len(loop_bufs)
      if score_rows:
        bufs, (o_smem, s_smem), rest = scr[:n], scr[n], scr[n + 1:]
      else:
        (o_smem, bufs), rest, s_smem = scr[0], scr[1:], None
      kd_smem, vd_smem, p_smem = bufs if n == 3 else (bufs[0], *bufs)
      tail = dict(scores_ref=refs[-1], s_smem=s_smem) if score_rows else {}
      outs = refs[:-1] if score_rows else refs
      return body(*outs, q_smem, kc_smem, vc_smem, kd_smem, vd_smem, p_smem, o_smem, *rest,
                  **tail)
    pl.run_scoped(scoped, *scratch)

  return plgpu.kernel(
      entry,
      out_type=tuple(out_type),
      grid=(num_splits, num_kv_heads * q_blocks, batch),
      grid_names=("split", "head_qblock", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(lengths, q_halves, qkv.k_codes, qkv.v_codes, qkv.k_scale, qkv.k_zero, qkv.v_scale,
    qkv.v_zero)


# ----------------------------------------------------------------------------------------------
# Wrapper.
# ----------------------------------------------------------------------------------------------

def _check_inputs(q, qkv, bits, lengths_quantized, k_full, v_full, lengths_full, k_new, v_new,
                  inflight_mask, cfg):
  if bits not in (4, 8):
    raise ValueError(f"bits must be 4 or 8, got {bits}")
  if q.ndim != 4:
    raise ValueError(f"q must be [B, Tq, Hq, D], got shape {q.shape}")
  b, tq, hq, d = q.shape
  if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
    raise ValueError(f"q must be bfloat16 or float16, got {q.dtype}")
  if d not in (64, 128):
    raise ValueError(f"head dim D={d} must be 64 or 128 (D/2-wide swizzled halves)")
  kc = qkv.k_codes
  if kc.ndim != 5 or kc.shape[0] != b or kc.shape[2] != 2 or 2 * kc.shape[4] != d:
    raise ValueError(f"qkv.k_codes must be [B={b}, Hkv, 2, S, D/2={d // 2}], got {kc.shape}")
  hkv, capacity = kc.shape[1], kc.shape[3]
  if hq % hkv:
    raise ValueError(f"Hq={hq} query heads is not a multiple of Hkv={hkv} KV heads")
  if qkv.group % cfg.block_kv:
    raise ValueError(f"key group {qkv.group} must be a multiple of block_kv={cfg.block_kv}")
  if capacity % cfg.block_kv:
    raise ValueError(f"quantized capacity S={capacity} must be a multiple of block_kv="
                     f"{cfg.block_kv}")
  for name, x in (("lengths_quantized", lengths_quantized), ("lengths_full", lengths_full)):
    if x.shape != (b,):
      raise ValueError(f"{name} must be [B={b}], got shape {x.shape}")
  if k_full.ndim != 4 or k_full.shape[:2] != (b, hkv) or k_full.shape[3] != d:
    raise ValueError(f"k_full must be [B={b}, Hkv={hkv}, R, D={d}], got {k_full.shape}")
  if v_full.shape != k_full.shape:
    raise ValueError(f"v_full shape {v_full.shape} differs from k_full shape {k_full.shape}")
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.shape != (b, tq, hkv, d):
      raise ValueError(f"{name} must be [B, Tq, Hkv, D] = {(b, tq, hkv, d)}, got {x.shape}")
  if inflight_mask.shape != (tq, tq):
    raise ValueError(f"inflight_mask must be [Tq, Tq] = {(tq, tq)}, got {inflight_mask.shape}")


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
  score_queries (a tuple of distinct query indices, static) probs [B, len(score_queries), Hq, S]
  fp32: those queries' final softmax weights on the quantized slots (0 where
  s >= lengths_quantized[b]).
  """
  _check_inputs(q, qkv, bits, lengths_quantized, k_full, v_full, lengths_full, k_new, v_new,
                inflight_mask, config)
  b, tq, hq, d = q.shape
  hkv, capacity = qkv.k_codes.shape[1], qkv.capacity
  group = hq // hkv
  sel = check_score_queries(score_queries, tq, group)
  mask = inflight_mask.astype(bool)
  # The selected queries go first (their rows lead q block 0); q and the in-flight mask's rows
  # follow that order, out and lse are put back below.
  order = selected_first(sel, range(tq))
  q, mask = permute_queries(order, q, mask)
  n_rows = tq * group
  q_blocks = -(-n_rows // BLOCK_M)
  rows_out = BLOCK_M if q_blocks > 1 else -(-n_rows // 8) * 8
  num_splits = _num_splits(config, b, hkv, q_blocks, capacity)

  q_rows = q.reshape(b, tq, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, n_rows, d)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, q_blocks * BLOCK_M - n_rows), (0, 0)))
  q_halves = q_rows.reshape(b, hkv, -1, 2, d // 2).transpose(0, 1, 3, 2, 4)  # [B,Hkv,2,M,D/2]
  lengths = jnp.clip(lengths_quantized.astype(jnp.int32), 0, capacity)
  acc, m2, l, *scores = _quant_partials(
      q_halves, qkv, lengths, bits=bits, rows_out=rows_out, num_splits=num_splits, cfg=config,
      score_rows=score_rows(len(sel), group), interpret=interpret)
  # acc [B, Hkv, NQB, NS, 2, R, D/2] (two column halves) -> [B, Hkv, NQB, NS, R, D]
  acc = jnp.moveaxis(acc, 4, 5).reshape(*acc.shape[:4], acc.shape[5], d)
  n_full = jnp.clip(lengths_full.astype(jnp.int32), 0, k_full.shape[2])
  full_mask = jnp.arange(k_full.shape[2])[None, None, :] < n_full[:, None, None]  # [B, 1, Rf]
  exact = [(k_full.transpose(0, 2, 1, 3), v_full.transpose(0, 2, 1, 3), full_mask),
           (k_new, v_new, mask[None])]
  out, lse = combine_partials(acc, m2, l, q, exact, group=group)
  probs = None
  if sel:
    read = (jnp.arange(capacity)[None] < lengths[:, None])[:, None]        # [B, 1, S]
    probs = scores_to_probs(scores[0], lse[:, :len(sel)], read, group=group)
  return wrapper_outputs(out.astype(q.dtype), lse, probs, order, return_lse=return_lse)


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
      [jnp.arange(s_q)[None, :] < lengths_quantized[:, None],
       jnp.arange(k_full.shape[2])[None, :] < lengths_full[:, None]], axis=1)   # [B, S+Rf]
  qg = q.reshape(b, tq, hkv, hq // hkv, d)
  scale = d ** -0.5
  s_c = jnp.einsum("bthgd,bhsd->bhgts", qg, k_c, preferred_element_type=jnp.float32) * scale
  s_n = jnp.einsum("bthgd,buhd->bhgtu", qg, k_new, preferred_element_type=jnp.float32) * scale
  s_c = jnp.where(cache_mask[:, None, None, None, :], s_c, -jnp.inf)
  s_n = jnp.where(inflight_mask[None, None, None], s_n, -jnp.inf)
  m = jnp.maximum(s_c.max(-1), s_n.max(-1))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p_c = jnp.exp(s_c - m[..., None])
  p_n = jnp.exp(s_n - m[..., None])
  denom = p_c.sum(-1) + p_n.sum(-1)
  o = (jnp.einsum("bhgts,bhsd->bthgd", p_c.astype(v_c.dtype), v_c,
                  preferred_element_type=jnp.float32)
       + jnp.einsum("bhgtu,buhd->bthgd", p_n.astype(v_new.dtype), v_new,
                    preferred_element_type=jnp.float32))
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
