"""Split-KV decode attention (flash-decoding) as a Pallas Mosaic GPU kernel for Hopper.

Contract (what `sparsedec.attention` calls):

  decode_attention(q [B, Tq, Hq, D], k_cache [B, Hkv, S, D], v_cache [B, Hkv, S, D],
                   lengths [B] int32, k_new [B, Tq, Hkv, D], v_new [B, Tq, Hkv, D],
                   inflight_mask [Tq, Tq] bool) -> out [B, Tq, Hq, D]  (+ lse [B, Tq, Hq] fp32)

Query t of row b reads cache slots s < lengths[b] and in-flight keys u with inflight_mask[t, u];
one softmax over both parts, scale D**-0.5, fp32 accumulation.

Two steps:
  1. The Mosaic GPU kernel (`_cache_partials`), grid (num_splits, Hkv * q_blocks, B). One thread
     block takes one KV head of one row and a contiguous run of KV tiles of that row's *valid*
     prefix (the valid tiles are divided among the splits at run time, so a short row does not
     pay for the capacity S). The G query heads of the KV head times the Tq queries form the M
     dimension of the tile (rows r = t * G + g, zero-padded to a multiple of 64), so each K/V
     tile is loaded once (TMA, `num_stages`-deep ring of SMEM buffers and barriers) for all of
     them. QK^T and PV run on wgmma; the online softmax keeps (acc, m, l) in registers. Each block
     writes its un-normalised partial acc [R, D] and its row max m and sum l (fp32).
  2. A small jnp step (`pallas_kernels.combine.combine_partials`) computes the in-flight part
     (Tq x Tq, tiny) and merges it with the split partials by log-sum-exp.

The pure-jnp reference `decode_attention_reference` sits at the bottom of this file.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.combine import combine_partials

LOG2E = math.log2(math.e)
BLOCK_M = 64                      # wgmma M of one warpgroup
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiling of the kernel. `num_splits=None` picks a split count that fills the GPU."""
  # Defaults: the best of a small sweep on an H100 (Hq=32, Hkv=8, D=128, B=1, S 4K..64K,
  # Tq 1 and 16); see benchmarks/kernels_decode_smoke.py. SMEM: Q 16 KiB + 2 x 2 x 32 KiB K/V +
  # P 16 KiB + fp32 out 32 KiB = 192 KiB, one block per SM.
  block_kv: int = 128             # KV rows per tile (a multiple of 64: wgmma K of PV)
  num_stages: int = 2             # SMEM ring depth for K/V tiles
  num_splits: int | None = None   # thread blocks along S per (row, KV head, q block)
  target_blocks: int = 132        # what `num_splits=None` aims at (one wave on H100 / H200)
  min_tiles_per_split: int = 2

  def __post_init__(self):
    if self.block_kv % 64 or self.block_kv <= 0:
      raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv}")
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


def _pick_num_splits(cfg: DecodeConfig, batch: int, num_kv_heads: int, q_blocks: int,
                     capacity: int) -> int:
  if cfg.num_splits is not None:
    return cfg.num_splits
  tiles = capacity // cfg.block_kv
  per_head = max(1, cfg.target_blocks // (batch * num_kv_heads * q_blocks))
  return max(1, min(per_head, tiles // cfg.min_tiles_per_split))


# ----------------------------------------------------------------------------------------------
# Step 1: the Mosaic GPU kernel over the cache.
# ----------------------------------------------------------------------------------------------

def _cache_partials(q_rows: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    lengths: jax.Array, *, rows_out: int, num_splits: int, cfg: DecodeConfig,
                    interpret: Any = None):
  """Split partials of the cache part.

  q_rows [B, Hkv, NQB * 64, D] (row r of q block j is query row j * 64 + r, r = t * G + g);
  k_cache, v_cache [B, Hkv, S, D]; lengths [B] int32 (already clipped to [0, S]).
  Returns acc [B, Hkv, NQB, NS, rows_out, D] fp32 (un-normalised), m [B, Hkv, NQB, NS, 64] fp32
  (row max of the scaled scores, in log2 units, -inf for an empty split) and
  l [B, Hkv, NQB, NS, 64] fp32 (sum of exp2(score - m)).
  """
  batch, num_kv_heads, m_total, head_dim = q_rows.shape
  capacity = k_cache.shape[2]
  q_blocks = m_total // BLOCK_M
  block_kv, num_stages = cfg.block_kv, cfg.num_stages
  dtype = q_rows.dtype
  score_scale = head_dim ** -0.5 * LOG2E       # scores kept in log2 units (exp2 in the loop)

  def body(lengths_ref,     # [B] int32                                 GMEM
           q_ref,           # [B, Hkv, NQB * 64, D]                     GMEM
           k_ref,           # [B, Hkv, S, D]                            GMEM
           v_ref,           # [B, Hkv, S, D]                            GMEM
           acc_out_ref,     # [B, Hkv, NQB, NS, rows_out, D] fp32       GMEM
           m_out_ref,       # [B, Hkv, NQB, NS, 64] fp32                GMEM
           l_out_ref,       # [B, Hkv, NQB, NS, 64] fp32                GMEM
           q_smem,          # [64, D]                                   SMEM (tiled, swizzled)
           k_smem,          # [num_stages, block_kv, D]                 SMEM (tiled, swizzled)
           v_smem,          # [num_stages, block_kv, D]                 SMEM (tiled, swizzled)
           p_smem,          # [64, block_kv]                            SMEM (tiled, swizzled)
           o_smem,          # [64, D] fp32                              SMEM
           m_smem,          # [64] fp32                                 SMEM
           l_smem,          # [64] fp32                                 SMEM
           q_barrier,       # 1 barrier
           k_barriers,      # [num_stages] barriers
           v_barriers):     # [num_stages] barriers
    split = lax.axis_index("split")
    head_qblock = lax.axis_index("head_qblock")
    b = lax.axis_index("batch")
    h = lax.div(head_qblock, jnp.int32(q_blocks))
    qb = lax.rem(head_qblock, jnp.int32(q_blocks))

    # The valid tiles of this row are shared out among the splits at run time.
    length = lengths_ref[b]
    num_tiles = lax.div(length + (block_kv - 1), jnp.int32(block_kv))
    tiles_per_split = lax.div(num_tiles + (num_splits - 1), jnp.int32(num_splits))
    first_tile = split * tiles_per_split
    my_tiles = jnp.maximum(jnp.minimum(tiles_per_split, num_tiles - first_tile), 0)

    def fetch(step, slot):
      rows = pl.ds((first_tile + step) * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(k_ref.at[b, h, rows], k_smem.at[slot], k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, h, rows], v_smem.at[slot], v_barriers.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(qb * BLOCK_M, BLOCK_M)], q_smem, q_barrier)
    for step in range(num_stages):                 # prologue: fill the ring
      pl.when(step < my_tiles)(functools.partial(fetch, step, step))
    plgpu.barrier_wait(q_barrier)

    acc = plgpu.layout_cast(jnp.zeros((BLOCK_M, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))

    def kv_step(step, carry):
      acc, m_i, l_i = carry
      slot = lax.rem(step, jnp.int32(num_stages))

      plgpu.barrier_wait(k_barriers.at[slot])
      def qk_scope(s_ref):                         # [64, block_kv] fp32 accumulator
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        return s_ref[...]
      s = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_M, block_kv), jnp.float32))
      s = s * score_scale

      slot_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, block_kv), 1,
                                        layout=plgpu.Layout.WGMMA)
      s = jnp.where(slot_ids + (first_tile + step) * block_kv < length, s, -jnp.inf)

      # Every tile holds at least one valid slot, so m_new is finite.
      m_new = jnp.maximum(m_i, s.max(axis=1))
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l_i = l_i * alpha + p.sum(axis=1)

      plgpu.barrier_wait(v_barriers.at[slot])
      # P goes through SMEM and PV into a fresh (zeroed) accumulator that is added to the
      # rescaled running one. Registers-operand wgmma and `pl.run_state(...)(ACC.init(acc))`
      # would skip both, but the Mosaic GPU interpreter of jax 0.11.2 supports neither (wgmma
      # operands must be SMEM refs; run_state is not interpreted), and this loop is bandwidth
      # bound: the extra SMEM round trip of the 64 x block_kv P tile is cheap.
      p_smem[...] = p.astype(dtype)
      plgpu.commit_smem()
      def pv_scope(pv_ref):                        # [64, D] fp32 accumulator
        plgpu.wgmma(pv_ref, p_smem, v_smem.at[slot])
        return pv_ref[...]                         # waits for the wgmma
      pv = pl.run_scoped(pv_scope, plgpu.ACC((BLOCK_M, head_dim), jnp.float32))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv

      # Both wgmmas that read this slot are done: refill it with the tile num_stages ahead.
      nxt = step + num_stages
      pl.when(nxt < my_tiles)(lambda: fetch(nxt, slot))
      return acc, m_new, l_i

    acc, m_i, l_i = lax.fori_loop(0, my_tiles, kv_step, (acc, m_i, l_i))

    o_smem[...] = acc
    m_smem[...] = m_i
    l_smem[...] = l_i
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_out)], acc_out_ref.at[b, h, qb, split])
    plgpu.copy_smem_to_gmem(m_smem, m_out_ref.at[b, h, qb, split])
    plgpu.copy_smem_to_gmem(l_smem, l_out_ref.at[b, h, qb, split])
    plgpu.wait_smem_to_gmem(0)

  swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
  scratch = [
      plgpu.SMEM((BLOCK_M, head_dim), dtype, **swizzled),
      plgpu.SMEM((num_stages, block_kv, head_dim), dtype, **swizzled),
      plgpu.SMEM((num_stages, block_kv, head_dim), dtype, **swizzled),
      plgpu.SMEM((BLOCK_M, block_kv), dtype, **swizzled),
      plgpu.SMEM((BLOCK_M, head_dim), jnp.float32),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.Barrier(),
      plgpu.Barrier(num_barriers=num_stages),
      plgpu.Barrier(num_barriers=num_stages),
  ]
  part = (batch, num_kv_heads, q_blocks, num_splits)
  out_type = (
      jax.ShapeDtypeStruct((*part, rows_out, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32),
      jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32),
  )

  def entry(lengths_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref):
    def scoped(q_smem, k_smem, v_smem, p_smem, o_smem, m_smem, l_smem, q_bar, k_bars, v_bars):
      body(lengths_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref,
           q_smem, k_smem, v_smem, p_smem, o_smem, m_smem, l_smem, q_bar, k_bars, v_bars)
    pl.run_scoped(scoped, *scratch)

  del capacity
  return plgpu.kernel(
      entry,
      out_type=out_type,
      grid=(num_splits, num_kv_heads * q_blocks, batch),
      grid_names=("split", "head_qblock", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(lengths, q_rows, k_cache, v_cache)


# ----------------------------------------------------------------------------------------------
# Wrapper.
# ----------------------------------------------------------------------------------------------

def _check_inputs(q, k_cache, v_cache, lengths, k_new, v_new, inflight_mask, cfg):
  if q.ndim != 4:
    raise ValueError(f"q must be [B, Tq, Hq, D], got shape {q.shape}")
  b, tq, hq, d = q.shape
  if k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[3] != d:
    raise ValueError(f"k_cache must be [B={b}, Hkv, S, D={d}], got shape {k_cache.shape}")
  hkv, capacity = k_cache.shape[1], k_cache.shape[2]
  if v_cache.shape != k_cache.shape:
    raise ValueError(f"v_cache shape {v_cache.shape} differs from k_cache shape {k_cache.shape}")
  if hq % hkv:
    raise ValueError(f"Hq={hq} query heads is not a multiple of Hkv={hkv} KV heads")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B={b}], got shape {lengths.shape}")
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.shape != (b, tq, hkv, d):
      raise ValueError(f"{name} must be [B, Tq, Hkv, D] = {(b, tq, hkv, d)}, got {x.shape}")
  if inflight_mask.shape != (tq, tq):
    raise ValueError(f"inflight_mask must be [Tq, Tq] = {(tq, tq)}, got {inflight_mask.shape}")
  for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
    if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
      raise ValueError(f"{name} must be bfloat16 or float16, got {x.dtype}")
  if not (q.dtype == k_cache.dtype == v_cache.dtype):
    raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, "
                     f"{v_cache.dtype}")
  if d % 64:
    raise ValueError(f"head dim D={d} must be a multiple of 64 (128-byte swizzle)")
  if capacity % cfg.block_kv:
    raise ValueError(f"cache capacity S={capacity} must be a multiple of block_kv="
                     f"{cfg.block_kv}")


def split_partials(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                   *, config: DecodeConfig = DecodeConfig(), interpret: Any = None):
  """The cache part only (step 1): packs q into 64-row tiles per KV head and runs the kernel.

  q [B, Tq, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; lengths [B]. Returns the split partials
  (acc, m, l) described in `_cache_partials`.
  """
  b, tq, hq, d = q.shape
  hkv, capacity = k_cache.shape[1], k_cache.shape[2]
  group = hq // hkv
  n_rows = tq * group
  q_blocks = -(-n_rows // BLOCK_M)
  rows_out = BLOCK_M if q_blocks > 1 else -(-n_rows // 8) * 8
  num_splits = _pick_num_splits(config, b, hkv, q_blocks, capacity)

  q_rows = q.reshape(b, tq, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, n_rows, d)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, q_blocks * BLOCK_M - n_rows), (0, 0)))
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, capacity)
  return _cache_partials(q_rows, k_cache, v_cache, lengths, rows_out=rows_out,
                         num_splits=num_splits, cfg=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("return_lse", "config", "interpret"))
def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                     k_new: jax.Array, v_new: jax.Array, inflight_mask: jax.Array, *,
                     return_lse: bool = False, config: DecodeConfig = DecodeConfig(),
                     interpret: Any = None):
  """Decode attention over a dense cache plus in-flight tokens (see the module docstring).

  q [B, Tq, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; lengths [B] int32; k_new, v_new
  [B, Tq, Hkv, D]; inflight_mask [Tq, Tq] bool. Returns out [B, Tq, Hq, D] (q's dtype) and,
  with return_lse, lse [B, Tq, Hq] fp32. `interpret=plgpu.InterpretGPUParams()` runs the kernel
  in the Mosaic GPU interpreter (CPU).
  """
  _check_inputs(q, k_cache, v_cache, lengths, k_new, v_new, inflight_mask, config)
  tq, hq = q.shape[1:3]
  group = hq // k_cache.shape[1]
  acc, m2, l = split_partials(q, k_cache, v_cache, lengths, config=config, interpret=interpret)
  out, lse = combine_partials(acc, m2, l, q, [(k_new, v_new, inflight_mask.astype(bool)[None])],
                              group=group)
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# Reference (pure jnp; same semantics as sparsedec.attention.reference_attention).
# ----------------------------------------------------------------------------------------------

def decode_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               lengths: jax.Array, k_new: jax.Array, v_new: jax.Array,
                               inflight_mask: jax.Array, *, return_lse: bool = False):
  """Pure-jnp decode attention: fp32 softmax over cache slots < lengths[b] and masked in-flight
  keys together. Shapes as `decode_attention`."""
  b, tq, hq, d = q.shape
  hkv, capacity = k_cache.shape[1], k_cache.shape[2]
  qg = q.reshape(b, tq, hkv, hq // hkv, d)                                 # [B, Tq, Hkv, G, D]
  scale = d ** -0.5
  cache_mask = jnp.arange(capacity)[None, :] < lengths[:, None]            # [B, S]
  s_c = jnp.einsum("bthgd,bhsd->bhgts", qg, k_cache,
                   preferred_element_type=jnp.float32) * scale             # [B, Hkv, G, Tq, S]
  s_n = jnp.einsum("bthgd,buhd->bhgtu", qg, k_new,
                   preferred_element_type=jnp.float32) * scale             # [B, Hkv, G, Tq, U]
  s_c = jnp.where(cache_mask[:, None, None, None, :], s_c, -jnp.inf)
  s_n = jnp.where(inflight_mask[None, None, None], s_n, -jnp.inf)
  m = jnp.maximum(s_c.max(-1), s_n.max(-1))                                # [B, Hkv, G, Tq]
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p_c = jnp.exp(s_c - m[..., None])
  p_n = jnp.exp(s_n - m[..., None])
  denom = p_c.sum(-1) + p_n.sum(-1)                                        # [B, Hkv, G, Tq]
  o = (jnp.einsum("bhgts,bhsd->bthgd", p_c.astype(v_cache.dtype), v_cache,
                  preferred_element_type=jnp.float32)
       + jnp.einsum("bhgtu,buhd->bthgd", p_n.astype(v_new.dtype), v_new,
                    preferred_element_type=jnp.float32))                   # [B, Tq, Hkv, G, D]
  inv = jnp.where(denom > 0, 1.0 / denom, 0.0).transpose(0, 3, 1, 2)[..., None]
  out = (o * inv).reshape(b, tq, hq, d).astype(q.dtype)
  if not return_lse:
    return out
  lse = (m + jnp.log(denom)).transpose(0, 3, 1, 2).reshape(b, tq, hq)
  return out, lse
