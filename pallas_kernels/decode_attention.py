"""Split-KV decode attention (flash-decoding) as a Pallas Mosaic GPU kernel for Hopper.

Contract (what `sparsedec.attention` calls):

  decode_attention(q [B, Tq, Hq, D], k_cache [B, Hkv, S, D], v_cache [B, Hkv, S, D],
                   lengths [B] int32, k_new [B, Tq, Hkv, D], v_new [B, Tq, Hkv, D],
                   inflight_mask [Tq, Tq] bool, *, return_lse=False, score_queries=())
    -> out [B, Tq, Hq, D]  (+ lse [B, Tq, Hq] fp32 with return_lse)
                           (+ probs [B, len(score_queries), Hq, S] fp32 with score_queries)

Query t of row b reads cache slots s < lengths[b] and in-flight keys u with inflight_mask[t, u];
one softmax over both parts, scale D**-0.5, fp32 accumulation.

What selectors read (SnapKV, H2O, the SFI selector):
  * lse: per query and query head, the log-sum-exp (natural log) of that softmax (-inf when the
    query sees no key at all);
  * probs: for the few queries t = score_queries[i] (a static tuple of distinct indices into Tq,
    len(score_queries) * G <= 64), the final softmax weight of each query head on each cache
    slot s, exp(score - lse): probs[b, i, :, s] for s < lengths[b], 0 for every other slot. So
    probs summed over S plus the query's in-flight weights is 1.
    The scores are written by the kernel itself, from the tile it computes anyway (no second
    pass over K): the selected queries' rows are packed first into q block 0 (queries permuted
    to score_queries + the others, the in-flight mask rows alike; outputs permuted back), and
    the thread blocks of q block 0 store the first `score_rows` rows of each scaled score tile
    (log2 units, -inf past the length) through SMEM and a TMA to a [B, Hkv, score_rows, S]
    fp32 output. The wrapper turns them into exp2(s - lse * log2 e) and zeroes the slots the
    kernel never visits (s >= lengths[b]). score_queries=() builds exactly the kernel without
    any of this.

Two steps:
  1. The Mosaic GPU kernel (`_cache_partials`), grid (num_splits, Hkv * q_blocks, B). One thread
     block takes one KV head of one row and a contiguous run of KV tiles of that row's *valid*
     prefix (the valid tiles are divided among the splits at run time, so a short row does not
     pay for the capacity S). The G query heads of the KV head times the Tq queries form the M
     dimension of the tile (rows r = t * G + g, zero-padded to a multiple of 64), so each K/V
     tile is loaded once (TMA, `num_stages`-deep ring of SMEM buffers and barriers) for all of
     them. QK^T and PV run on wgmma; the online softmax keeps (acc, m, l) in registers. Each block
     writes its un-normalised partial acc [R, D] and its row max m and sum l (fp32), and, with
     score_queries, q block 0's blocks the selected rows' scores of each tile they visit.
     Wide calls on the GPU (from WS_MIN_Q_BLOCKS q blocks per KV head on;
     `DecodeConfig.warp_specialized`) run warp-specialized blocks, FlashAttention-3's
     structure (`decode_attention_kernel_ws`): a producer warpgroup issues every K/V TMA into
     one ring of 128-key tiles; two compute warpgroups take q blocks 2j and 2j + 1 of the same
     KV head and split, release a slot's K after QK and its V after PV (barriers of two
     arrivals), and alternate on a schedule barrier so that one's softmax runs while the
     other's wgmmas do; PV accumulates in place. H100 (`benchmarks/results/s27/`): B 8, 16K,
     Tq 256 1237.8 -> 930.1 us for the split kernel, Tq 64 at B 1 16K 40.2 -> 33.3 us. The
     Mosaic GPU interpreter does not run them: CI tests them only as far as lowering; on a
     GPU the kernel tests run them (`tests/test_kernel_decode_attention.py`).
  2. The in-flight part (Tq x Tq under the mask): from 2 queries on (`DecodeConfig.inflight`,
     `combine.inflight_choice`) its own Mosaic GPU kernel (`pallas_kernels.inflight_attention`,
     one more partial per q block), else jnp inside the combine; then
     `pallas_kernels.combine.combine_partials` merges everything by log-sum-exp. On an H200 the
     kernel path took a SmolLM2 Lookahead step's attention (Tq = 108) from 17.0 to 13.5 us per
     call and 9.4 to 6.6 launches; at Tq = 1 jnp is cheaper (7.0 against 9.8 us), hence "auto".
     Where `combine.inflight_merges` says so (few splits and many blocks; or few blocks, then
     splitting D over blocks) the in-flight kernel merges the split partials itself and writes
     the output (`inflight_attention.inflight_merged`, no combine): Lookahead's 8B call at 4K
     64.2 -> 60.1 us, B 8 16K Tq 64 259.0 -> 249.2, B 1 16K Tq 16 32.1 -> 30.1 (H200).
     At Tq = 1 ("auto", k_new in q's dtype, plain blocks) the score q . k_new comes from the
     cache kernel: split 0's block TMAs k_new's row as an [8, D] tile (rows past it
     zero-filled), multiplies it with its q tile in one [64, 8] wgmma and writes the row
     scores beside its partials (`store_inflight_score`); the combine applies the mask and adds
     v_new as before, with no XLA reduction launch for the score. H200, device us a call
     (`benchmarks/results/s48/`): B 1 16K 24.17 -> 22.85, B 1 64K 68.49 -> 67.31, B 8 16K
     126.64 -> 125.14; the split kernel +0.0-0.1 us.
     At 2 <= Tq with one q block (Tq * G <= 64, plain blocks; "auto", `in_kernel_tile`) the
     cache kernel takes the whole in-flight part: split 0's block first attends its q block to a
     64-key tile of k_new / v_new read in place (a [64, D] TMA box of head h's columns; rows past
     Tq zero-filled; a Tq above 8 that is not a multiple of 8 padded to one first, as Mosaic
     GPU's TMA lowering needs, `hopper.tma_rows`; SmolLM2's heads at 16K, Tq 8 / 9: 13.10 /
     13.21 us, session 70) under the mask's bias tile, then carries that softmax state into
     its cache tiles (`inflight_tile_step`). The combine only merges splits; no in-flight kernel, no
     packing of k_new / v_new. H200, device us a call against the in-flight kernel merging the
     splits ("merged", the faster of the two former choices in every cell;
     `benchmarks/results/s51/inflight_tile_ab_s51_h200.json`): B 1
     64K Tq 16 70.93 -> 69.74, 16K Tq 16 27.15 -> 25.95, 16K Tq 4 25.67 -> 23.94, 64K Tq 2
     69.15 -> 66.96, B 8 16K Tq 16 129.28 -> 127.43.

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
import numpy as np

from pallas_kernels.combine import (check_arrays, check_config_ints, check_inflight_mode,
                                    check_lengths, check_mask, check_score_queries, check_sizes,
                                    combine_partials, f32_einsum, in_kernel_score, inflight_choice,
                                    inflight_merges, int32_clipped, interpret_mode, normalised,
                                    permute_queries, score_rows, scores_to_probs, selected_first,
                                    static_ints, wrapper_outputs)
from pallas_kernels.inflight_attention import (MergeSegment, inflight_merged, inflight_partials,
                                               mask_bias, merge_chunks, pack_keys)
from pallas_kernels.hopper import MAX_HEAD_DIM, SM_COUNT, SMEM_PER_SM, tma_rows
from pallas_kernels.register_operand import a_staging, softmax_pv_step, swizzled
from pallas_kernels.split_plan import split_counts

LOG2E = math.log2(math.e)
BLOCK_M = 64                      # wgmma M of one warpgroup
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# The SMEM layout of every wgmma operand tile: (8, 64) tiles, 128-byte swizzle.
SWIZZLED = swizzled(128, 16)     # bf16 / fp16 tiles of 64-column (128-byte) rows


def check_plain_smem(block_kv: int, num_stages: int, head_dim: int, *, dtype,
                     score_rows: int = 0) -> None:
  """Refuses, naming the knobs, a plain block whose SMEM would not fit an SM (an explicit config
  such as 128-key tiles x 4 stages at D = 128; the defaults choose tiles that fit)."""
  need = smem_bytes(block_kv, num_stages, head_dim, jnp.dtype(dtype).itemsize)
  if score_rows:                                   # the score staging tile beside the rings
    need += BLOCK_M * block_kv * 4
  if need > SMEM_PER_SM:
    raise ValueError(f"block_kv={block_kv} x num_stages={num_stages} at head dim D={head_dim} "
                     f"needs ~{need} bytes of shared memory a block (> {SMEM_PER_SM}): use "
                     f"64-key tiles or fewer stages")


def smem_bytes(block_kv: int, num_stages: int, head_dim: int, itemsize: int = 2) -> int:
  """SMEM of one thread block of decode / sparse attention on the GPU, a slight overestimate
  (`loop_scratch` plus q, m, l and 4 KiB for barriers and alignment; Mosaic reported 2.6 KiB
  more than the buffers for 128-key tiles, 3 stages; P stays in registers): D = 128, bf16,
  2 stages: 84.5 KiB with 64-key tiles, 148.5 KiB with 128-key tiles."""
  rings = 2 * num_stages * block_kv * head_dim * itemsize
  out = BLOCK_M * head_dim * 4                     # the fp32 output tile shares the rings
  return BLOCK_M * head_dim * itemsize + max(rings, out) + 2 * BLOCK_M * 4 + 4096


# Warp-specialized blocks (`DecodeConfig.warp_specialized`) from this many q blocks per KV head on.
# H100, device us of the split kernel, plain -> warp-specialized (`benchmarks/results/s27/`):
# Tq 1 and 16 (one q block) even (25.4 -> 25.6 at B 1 16K Tq 1, 92.3 -> 92.6 at B 1 64K Tq 16);
# Tq 32 (two) mixed (B 1 16K 28.3 -> 31.1, B 8 16K 193.3 -> 185.6); Tq 64 at B 1 16K
# 40.2 -> 33.3; Tq 256 at B 8 16K 1237.8 -> 930.1.
WS_MIN_Q_BLOCKS = 3


def compute_warpgroups(q_blocks: int) -> int:
  """Compute warpgroups of a warp-specialized block: two (q blocks 2j and 2j + 1 of one KV
  head) from two q blocks on, else one."""
  return 2 if q_blocks >= 2 else 1


def ws_smem_bytes(block_kv: int, num_stages: int, head_dim: int, compute_wgs: int = 2,
                  itemsize: int = 2) -> int:
  """SMEM of a warp-specialized block (a q tile per compute warpgroup; the K/V ring in a union
  with their fp32 output tiles; m, l; 4 KiB for barriers and alignment): D = 128, bf16, two
  compute warpgroups: 165 KiB with 128-key tiles x 2 stages (or 64-key tiles x 3)."""
  rings = 2 * num_stages * block_kv * head_dim * itemsize
  return (compute_wgs * BLOCK_M * head_dim * itemsize
          + max(rings, compute_wgs * BLOCK_M * head_dim * 4) + 2 * compute_wgs * BLOCK_M * 4
          + 4096)


def resident_blocks(block_kv: int, num_stages: int, head_dim: int) -> int:
  """Thread blocks the split plan counts per SM: two with 64-key tiles when two fit in its SMEM
  (measured on an H200 at D = 128: 12-20% faster on the wide path), else one (128-key tiles
  keep one: two of them were not measured)."""
  two_fit = 2 * smem_bytes(block_kv, num_stages, head_dim) <= SMEM_PER_SM
  return 2 if block_kv == 64 and two_fit else 1


def loop_scratch(num_stages: int, block_kv: int, head_dim: int, dtype, score_rows: int):
  """The K and V rings [num_stages, block_kv, D] (and, with score_rows, the fp32 [64, block_kv]
  score staging tile), live in the tile loop, in one union with the fp32 [64, D] output tile,
  written after the loop when the rings are dead."""
  ring = lambda: plgpu.SMEM((num_stages, block_kv, head_dim), dtype, **SWIZZLED)
  loop_refs = (ring(), ring())
  if score_rows:
    loop_refs += (plgpu.SMEM((BLOCK_M, block_kv), jnp.float32),)
  return plgpu.RefUnion(loop_refs, plgpu.SMEM((BLOCK_M, head_dim), jnp.float32))


# ----------------------------------------------------------------------------------------------
# The Tq = 1 in-flight score in the cache kernel (decode_attention and sparse_attention): the
# block of split 0 also computes q . k_new for its rows and writes it beside the partials, so the
# combine takes the score as given (`combine_partials`' `given_scores`) and no XLA reduction
# launch computes it (session 48: that launch cost 1.2-1.5 us a call on an H200).
# ----------------------------------------------------------------------------------------------

KN_ROWS = 8                      # the key tile of the in-flight score: wgmma's smallest N


def inflight_score_scratch(head_dim: int, dtype) -> list:
  """SMEM of `fetch_inflight_key` / `store_inflight_score`: the step's key as a [KN_ROWS, D]
  tile (row 0; the TMA zero-fills the rows past k_new's one), the [64] fp32 score rows on their
  way to GMEM, and the key's barrier."""
  return [plgpu.SMEM((KN_ROWS, head_dim), dtype, **SWIZZLED),
          plgpu.SMEM((BLOCK_M,), jnp.float32), plgpu.Barrier()]


def fetch_inflight_key(kn_rows, smem) -> None:
  """Starts the TMA of kn_rows (GMEM [1, D] view of k_new[b, 0, h], sliced [KN_ROWS, D] from a
  dynamic start 0: rows past the array are zero-filled, as q's rows at Tq = 1)."""
  kn_smem, _, barrier = smem
  plgpu.copy_gmem_to_smem(kn_rows, kn_smem, barrier)


def store_inflight_score(q_smem, smem, sn_out) -> None:
  """sn_out (GMEM [64] fp32) <- q_r . k_new for each of the q block's rows r (unscaled, fp32
  accumulation of q's dtype, as the combine's einsum), by one [64, KN_ROWS] wgmma whose
  column 0 is the step's key. The block's epilogue waits for the TMA."""
  kn_smem, sn_smem, barrier = smem
  plgpu.barrier_wait(barrier)

  def scope(s_ref):                                # [64, KN_ROWS] fp32 accumulator
    plgpu.wgmma(s_ref, q_smem, kn_smem.transpose((1, 0)))
    return s_ref[...]
  s = pl.run_scoped(scope, plgpu.ACC((BLOCK_M, KN_ROWS), jnp.float32))
  col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, KN_ROWS), 1, layout=plgpu.Layout.WGMMA)
  sn_smem[...] = jnp.where(col == 0, s, 0.0).sum(axis=1)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(sn_smem, sn_out)


def inflight_key_rows(k_new: jax.Array) -> jax.Array:
  """k_new [B, 1, Hkv, D] -> [B, Hkv, 1, D], a bitcast (the moved axis has size 1)."""
  b, _, hkv, d = k_new.shape
  return k_new.reshape(b, hkv, 1, d)


# ----------------------------------------------------------------------------------------------
# The whole in-flight part in the cache kernel (decode_attention and sparse_attention with one
# segment, 2 <= Tq, Tq * G <= 64; `inflight_tile_choice`): the block of split 0 (sparse: work
# item 0) first attends its q block to the step's own keys, one 64-key tile (k_new and v_new
# read in place: rows t of head h, the TMA zero-filling the rows past Tq) under the mask's bias
# tile, and carries that softmax state into its cache tiles. The split partials then hold
# everything and the combine only merges them: no in-flight kernel, no packing of k_new / v_new.
# ----------------------------------------------------------------------------------------------

INFLIGHT_TILE = 64               # in-flight keys of the tile (Tq * G <= 64, so Tq <= 64)


def inflight_tile_scratch(head_dim: int, dtype, interpret: Any) -> list:
  """SMEM of the in-flight tile: k_new's and v_new's rows [64, D] (wgmma operands), the mask's
  bias [64 rows, 64 keys] bf16, one barrier for the three TMAs, and in interpret mode the
  staging of P [64, 64] (`register_operand.wgmma_register_a`)."""
  tile = lambda: plgpu.SMEM((INFLIGHT_TILE, head_dim), dtype, **SWIZZLED)
  staging = a_staging((BLOCK_M, INFLIGHT_TILE), dtype, interpret, **SWIZZLED)
  return [tile(), tile(), plgpu.SMEM((BLOCK_M, INFLIGHT_TILE), jnp.bfloat16),
          plgpu.Barrier(num_arrivals=3), *staging.values()]


def fetch_inflight_tile(refs, smem, b, h, zero) -> None:
  """Starts the TMAs of the in-flight tile: rows [0, 64) of k_new[b, :, h] and v_new[b, :, h]
  (GMEM [B, Tq, Hkv * D], `heads_merged`; `zero` a traced 0 that Mosaic GPU can prove a
  multiple of 64 for the SMEM tiling, so the box may run past Tq: zero-filled) and the bias
  [64, 64]."""
  kn_ref, vn_ref, bias_ref = refs
  kn_smem, vn_smem, bias_smem, barrier = smem[:4]
  d = kn_smem.shape[1]
  rows, cols = pl.ds(zero, INFLIGHT_TILE), pl.ds(h * d, d)
  plgpu.copy_gmem_to_smem(kn_ref.at[b, rows, cols], kn_smem, barrier)
  plgpu.copy_gmem_to_smem(vn_ref.at[b, rows, cols], vn_smem, barrier)
  plgpu.copy_gmem_to_smem(bias_ref, bias_smem, barrier)


def inflight_tile_step(q_smem, smem, carry, *, scale, dtype):
  """(acc, m, l) after the q block's rows attend to the in-flight tile (the first keys a split
  0 block visits). A row that sees no in-flight key keeps m = -inf, l = 0, acc = 0 (a finite
  stand-in for its max keeps p and alpha at 0, not NaN)."""
  kn_smem, vn_smem, bias_smem, barrier = smem[:4]
  a_smem = smem[4] if len(smem) > 4 else None
  plgpu.barrier_wait(barrier)

  def qk_scope(s_ref):                             # [64, 64] fp32 accumulator
    plgpu.wgmma(s_ref, q_smem, kn_smem.transpose((1, 0)))
    return s_ref[...]
  s = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_M, INFLIGHT_TILE), jnp.float32)) * scale
  bias = plgpu.load(bias_smem, layout=plgpu.Layout.WGMMA, optimized=False)
  s = s + bias.astype(jnp.float32)
  return softmax_pv_step(s, carry, vn_smem, dtype=dtype, a_smem=a_smem, empty_rows=True)


def heads_merged(x: jax.Array) -> jax.Array:
  """k_new or v_new [B, Tq, Hkv, D] -> [B, Tq', Hkv * D], a bitcast where Tq <= 8 or is a
  multiple of 8 (else Tq' rounds it up with zero rows, `tma_rows`, which the bias masks as the
  TMA's fill past Tq): head h's rows are the column range [h * D, (h + 1) * D), one 2-D TMA
  box."""
  b, tq, hkv, d = x.shape
  return tma_rows(x.reshape(b, tq, hkv * d), axis=1)


def row_queries(num_queries: int, group: int, num_rows: int) -> np.ndarray:
  """[num_rows] int: the query each q row r = t * G + g holds, -1 for the padding rows."""
  rows = np.full(num_rows, -1)
  rows[:num_queries * group] = np.arange(num_queries * group) // group
  return rows


def inflight_tile_bias(mask: jax.Array, group: int) -> jax.Array:
  """The in-flight tile's bias [64, 64] bf16 (rows r = t * G + g, 0 / -inf; `mask_bias`)."""
  return mask_bias(mask, row_queries(mask.shape[0], group, BLOCK_M)).bias


# ----------------------------------------------------------------------------------------------
# Warp-specialized blocks (decode_attention and sparse_attention): a producer warpgroup and one
# or two compute warpgroups, FlashAttention-3's structure.
# ----------------------------------------------------------------------------------------------

def sync(barrier):
  """Arrive on a barrier of one arrival per compute warpgroup and wait for the others."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


def ws_produce(my_tiles, tile_start, k_rows, v_rows, k_smem, v_smem, k_barriers, v_barriers,
               k_consumed, v_consumed):
  """The producer warpgroup: tile `step` of a split (first slot `tile_start(step)`) of k_rows,
  v_rows [S, D] (GMEM views of one row and KV head) by TMA into ring slot step % stages, a slot
  refilled once the compute warpgroups released it (K after QK, V after PV)."""
  num_stages, block_kv = k_smem.shape[0], k_smem.shape[1]

  @pl.loop(0, my_tiles)
  def _(step):
    slot = lax.rem(step, jnp.int32(num_stages))
    rows = pl.ds(tile_start(step), block_kv)
    reuse = step >= num_stages
    pl.when(reuse)(lambda: plgpu.barrier_wait(k_consumed.at[slot]))
    plgpu.copy_gmem_to_smem(k_rows.at[rows], k_smem.at[slot], k_barriers.at[slot])
    pl.when(reuse)(lambda: plgpu.barrier_wait(v_consumed.at[slot]))
    plgpu.copy_gmem_to_smem(v_rows.at[rows], v_smem.at[slot], v_barriers.at[slot])


def ws_loop(tile_step, carry, my_tiles, k_barriers, ws_barriers, wg, wgs, peel_last=False):
  """The compute warpgroups' tile loop: `tile_step(step, carry, masked)` over the split's
  my_tiles tiles, the first K tile awaited before it (later ones inside the PV scope); with two
  warpgroups, warpgroup 1 starts half a step behind on the schedule barrier, and both pass
  `done` at the end (the ring is free: the output tiles may take its memory). peel_last: only
  the last tile gets masked=True (else every tile does)."""
  _, _, schedule, done = ws_barriers
  pl.when(my_tiles > 0)(lambda: plgpu.barrier_wait(k_barriers.at[0]))
  if wgs == 2:
    pl.when(wg == 1)(lambda: sync(schedule))
  if peel_last:
    last = jnp.maximum(my_tiles - 1, 0)
    carry = lax.fori_loop(0, last, functools.partial(tile_step, masked=False), carry)
    carry = lax.fori_loop(last, my_tiles, functools.partial(tile_step, masked=True), carry)
  else:
    carry = lax.fori_loop(0, my_tiles, functools.partial(tile_step, masked=True), carry)
  if wgs == 2:
    pl.when(wg == 0)(lambda: sync(schedule))
    sync(done)
  return carry


def run_ws_block(wgs, num_stages, block_kv, head_dim, dtype, score_rows, compute, produce):
  """A warp-specialized block's scratch and warpgroups (inside a `plgpu.kernel` with
  num_threads=wgs + 1, thread_name="wg"): warpgroups 0 .. wgs - 1 run
  compute(wg, q_smem [64, D], k_smem, v_smem [stages, block_kv, D], o_smem [64, D] fp32,
  m_smem, l_smem [64], q_barrier, k_barriers, v_barriers, ws_barriers, s_smem or None) with
  232 / 240 registers, warpgroup wgs runs produce(k_smem, v_smem, k_barriers, v_barriers,
  k_consumed, v_consumed) with 40. ws_barriers = (k_consumed, v_consumed, schedule, done),
  each of wgs arrivals; the fp32 output tiles share the K/V ring's memory."""
  def scoped(q_smem, union, m_smem, l_smem, q_bar, k_bars, v_bars, k_consumed, v_consumed,
             schedule, done, *s_smem):
    (k_smem, v_smem), o_smem = union
    wg = lax.axis_index("wg")

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(232 if wgs == 2 else 240, action="increase")
      compute(wg, q_smem.at[wg], k_smem, v_smem, o_smem.at[wg], m_smem.at[wg], l_smem.at[wg],
              q_bar.at[wg], k_bars, v_bars, (k_consumed, v_consumed, schedule, done),
              s_smem[0] if s_smem else None)

    @pl.when(wg == wgs)
    def _produce():
      plgpu.set_max_registers(40, action="decrease")
      produce(k_smem, v_smem, k_bars, v_bars, k_consumed, v_consumed)
  ring = lambda: plgpu.SMEM((num_stages, block_kv, head_dim), dtype, **SWIZZLED)
  consumed = lambda: plgpu.Barrier(num_arrivals=wgs, num_barriers=num_stages)
  pl.run_scoped(
      scoped,
      plgpu.SMEM((wgs, BLOCK_M, head_dim), dtype, **SWIZZLED),
      plgpu.RefUnion((ring(), ring()), plgpu.SMEM((wgs, BLOCK_M, head_dim), jnp.float32)),
      plgpu.SMEM((wgs, BLOCK_M), jnp.float32), plgpu.SMEM((wgs, BLOCK_M), jnp.float32),
      plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=num_stages),
      plgpu.Barrier(num_barriers=num_stages), consumed(), consumed(),
      plgpu.Barrier(num_arrivals=wgs), plgpu.Barrier(num_arrivals=wgs),
      *([plgpu.SMEM((BLOCK_M, block_kv), jnp.float32)] if score_rows else []),
      collective_axes="wg")


def ws_scores(q_smem, k_tile, k_consumed, schedule=None):
  """QK^T [64, block_kv] fp32 of one tile in a warp-specialized block; with two compute
  warpgroups, `schedule` (a barrier of two arrivals) is passed once the wgmma is issued, so the
  other warpgroup's softmax overlaps it. Releases the K slot (`k_consumed`) afterwards."""
  def qk_scope(s_ref):
    plgpu.wgmma(s_ref, q_smem, k_tile.transpose((1, 0)))
    if schedule is not None:
      sync(schedule)
    return s_ref[...]
  s = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_M, k_tile.shape[0]), jnp.float32))
  plgpu.barrier_arrive(k_consumed)
  return s


def ws_softmax_pv(s, carry, *, scale, v_tile, v_barrier, v_consumed, schedule=None,
                  wait_next=None, empty_rows=False):
  """The rest of a warp-specialized tile: the online softmax of the raw scores s [64, N]
  (scale folded into the exp2: one FMA a score), then acc += P V in place, released V slot.
  carry = (acc [64, D] fp32, m [64] (log2 units), l [64]); with two compute warpgroups the
  `schedule` barrier hands the tensor cores over after the softmax; `wait_next()` runs inside
  the PV scope (the next K tile's barrier); `empty_rows`: a row may have seen only -inf so far
  (a finite stand-in keeps alpha and p at 0, not NaN)."""
  acc, m_i, l_i = carry
  m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if empty_rows else m_new
  alpha = jnp.exp2(m_i - m_use)
  p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
  l_i = l_i * alpha + p.sum(axis=1)
  p16 = p.astype(v_tile.dtype)
  acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
  if schedule is not None:
    plgpu.barrier_arrive(schedule)                 # done with the softmax
  plgpu.barrier_wait(v_barrier)
  if schedule is not None:
    plgpu.barrier_wait(schedule)                   # the other warpgroup's wgmmas are issued
  def pv_scope(acc_ref):                           # acc += P V, then wait for the next K
    plgpu.wgmma(acc_ref, p16, v_tile)
    if wait_next is not None:
      wait_next()
  acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
  plgpu.barrier_arrive(v_consumed)
  return acc, m_new, l_i


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiling of the kernel; `resolve` fills the fields left None for one call.

  block_kv: KV rows per tile, a multiple of 64. None: 128 where the capacity is a multiple of
    128, except plain blocks with three or more q blocks: 64 there. H200, S = 16K..64K
    (`attention_tiling_s11_h200.json`): plain blocks at Tq * G <= 64 are 3-7% faster with 128-key
    tiles; from Tq * G = 172 on, 64-key tiles with two thread blocks per SM are 14-20% faster
    (one warpgroup per SM leaves the tensor cores waiting on its own softmax). Warp-specialized
    blocks fill those gaps themselves: 128-key tiles, one block per SM (H100, B 8 16K Tq 256:
    928 us against 1058 with 64-key tiles).
  target_blocks: resident thread blocks `num_splits=None` plans for (`pallas_kernels.split_plan`,
    the shortest simulated launch). None: SM_COUNT * `resident_blocks`, or SM_COUNT for
    warp-specialized blocks.
  warp_specialized: see the field.
  """
  block_kv: int | None = None
  num_stages: int = 2             # SMEM ring depth for K/V tiles
  num_splits: int | None = None   # thread blocks along S per (row, KV head, q block)
  target_blocks: int | None = None
  min_tiles_per_split: int = 2
  # The in-flight part: "merged", "kernel", "jnp", "auto" (combine.inflight_choice; at Tq = 1
  # "auto" has the cache kernel compute q . k_new, combine.in_kernel_score, "jnp" the combine;
  # at 2 <= Tq with one q block "auto" has the cache kernel attend to the keys, in_kernel_tile).
  inflight: str = "auto"
  # Warp-specialized blocks (FlashAttention-3's structure): a producer warpgroup issues the
  # K/V TMAs, one or two compute warpgroups (`compute_warpgroups`) take a q block each and
  # alternate their softmax with the other's wgmmas. None: on the GPU from WS_MIN_Q_BLOCKS q
  # blocks on; True: on the GPU; False: never. The Mosaic GPU interpreter never runs them (it
  # runs a block's warpgroups as threads, which deadlock on their barriers in a test worker
  # pinned to one core, and has no in-place wgmma accumulator).
  warp_specialized: bool | None = None

  def __post_init__(self):
    check_inflight_mode(self.inflight)
    check_config_ints(self, ("num_stages", "min_tiles_per_split"),
                      ("block_kv", "num_splits", "target_blocks"))
    if self.block_kv is not None and self.block_kv % 64:
      raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv}")

  def resolve(self, q_blocks: int, capacity: int, head_dim: int = 128,
              interpret: bool = False) -> "DecodeConfig":
    """This config with block_kv and target_blocks filled in for a call with `q_blocks` 64-row
    q blocks per KV head over a cache of `capacity` slots (a multiple of 64); `interpret`: for
    the Mosaic GPU interpreter (no warp-specialized blocks there)."""
    block_kv = self.block_kv
    if block_kv is None:
      wide = (q_blocks > 2 and not dataclasses.replace(self, block_kv=128).specialized(
          q_blocks, head_dim, interpret))
      fits = smem_bytes(128, self.num_stages, head_dim) <= SMEM_PER_SM   # not at D = 256
      block_kv = 128 if capacity % 128 == 0 and not wide and fits else 64
    target = self.target_blocks
    if target is None:
      resolved = dataclasses.replace(self, block_kv=block_kv)
      per_sm = (1 if resolved.specialized(q_blocks, head_dim, interpret)
                else resident_blocks(block_kv, self.num_stages, head_dim))
      target = SM_COUNT * per_sm
    return dataclasses.replace(self, block_kv=block_kv, target_blocks=target)

  def specialized(self, q_blocks: int, head_dim: int, interpret: bool = False) -> bool:
    """Whether a call with `q_blocks` q blocks per KV head runs warp-specialized blocks (this
    config resolved: block_kv set): on the GPU, where wanted and the SMEM fits."""
    wanted = (self.warp_specialized if self.warp_specialized is not None
              else q_blocks >= WS_MIN_Q_BLOCKS)
    wgs = compute_warpgroups(q_blocks)
    return (wanted and not interpret
            and ws_smem_bytes(self.block_kv, self.num_stages, head_dim, wgs) <= SMEM_PER_SM)


def _pick_num_splits(cfg: DecodeConfig, batch: int, num_kv_heads: int, q_blocks: int,
                     capacity: int, head_dim: int, interpret: bool = False) -> int:
  """Splits per (row, KV head, q block); cfg resolved."""
  if cfg.num_splits is not None:
    return cfg.num_splits
  tiles = max(1, capacity // cfg.block_kv)
  if cfg.specialized(q_blocks, head_dim, interpret):
    q_blocks = -(-q_blocks // compute_warpgroups(q_blocks))   # thread blocks per KV head
  return split_counts(((q_blocks, tiles, None),), copies=batch * num_kv_heads,
                      slots=cfg.target_blocks, min_tiles=cfg.min_tiles_per_split,
                      sms=SM_COUNT)[0]


# ----------------------------------------------------------------------------------------------
# Step 1: the Mosaic GPU kernel over the cache.
# ----------------------------------------------------------------------------------------------

def _cache_partials(q_rows: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    lengths: jax.Array, *, rows_out: int, num_splits: int, cfg: DecodeConfig,
                    score_rows: int = 0, inflight_key: jax.Array | None = None,
                    inflight_tile: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                    interpret: Any = None):
  """Split partials of the cache part.

  q_rows [B, Hkv, M, D] (row r of q block j is query row j * 64 + r, r = t * G + g; NQB =
  cdiv(M, 64), rows past M read as zeros: a TMA box past the array is zero-filled);
  k_cache, v_cache [B, Hkv, S, D]; lengths [B] int32 (the kernel clips them to [0, S]).
  Returns acc [B, Hkv, NQB, NS, rows_out, D] fp32 (un-normalised), m [B, Hkv, NQB, NS, 64] fp32
  (row max of the scaled scores, in log2 units, -inf for an empty split) and
  l [B, Hkv, NQB, NS, 64] fp32 (sum of exp2(score - m)); with score_rows > 0 (a multiple of 8,
  <= 64) also scores [B, Hkv, score_rows, S] fp32: rows [0, score_rows) of q block 0, the scaled
  scores (log2 units) of the slots s < lengths[b], -inf for the rest of their last tile; the
  other slots are never written (undefined).
  inflight_key: at Tq = 1 (one q block, plain blocks) k_new [B, Hkv, 1, D] in q's dtype
  (`inflight_key_rows`): split 0 also returns, last, the in-flight scores [B, Hkv, 64] fp32,
  q_r . k_new unscaled (`store_inflight_score`).
  inflight_tile: at 2 <= Tq (one q block, plain blocks) (k_new, v_new [B, Tq, Hkv, D] in q's
  dtype, bias [64, 64] bf16 from `inflight_tile_bias`): split 0's partials also cover the
  in-flight keys (`inflight_tile_step`), so they are the whole attention once merged.
  """
  batch, num_kv_heads, m_total, head_dim = q_rows.shape
  capacity = k_cache.shape[2]
  q_blocks = -(-m_total // BLOCK_M)
  ws = cfg.specialized(q_blocks, head_dim, interpret is not None)
  wgs = compute_warpgroups(q_blocks) if ws else 1  # compute warpgroups a block
  groups = -(-q_blocks // wgs)                     # thread blocks per KV head
  block_kv, num_stages = cfg.block_kv, cfg.num_stages
  dtype = q_rows.dtype
  if not ws:
    check_plain_smem(block_kv, num_stages, head_dim, dtype=dtype, score_rows=score_rows)
  if (inflight_key is not None or inflight_tile is not None) and (ws or q_blocks != 1):
    raise ValueError("the in-flight score or tile needs one q block of plain (not "
                     "warp-specialized) blocks")
  score_scale = head_dim ** -0.5 * LOG2E       # scores kept in log2 units (exp2 in the loop)

  def row_tiles(lengths_ref, b, split):
    """(length, first tile, tile count) of this split: the valid tiles of row b are shared
    out among the splits at run time."""
    length = jnp.minimum(jnp.maximum(lengths_ref[b], 0), capacity)     # clipped to [0, S]
    num_tiles = lax.div(length + (block_kv - 1), jnp.int32(block_kv))
    tiles_per_split = lax.div(num_tiles + (num_splits - 1), jnp.int32(num_splits))
    first_tile = split * tiles_per_split
    my_tiles = jnp.maximum(jnp.minimum(tiles_per_split, num_tiles - first_tile), 0)
    return length, first_tile, my_tiles

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
           o_smem,          # [64, D] fp32, shares the rings' memory     SMEM
           m_smem,          # [64] fp32                                 SMEM
           l_smem,          # [64] fp32                                 SMEM
           q_barrier,       # 1 barrier
           k_barriers,      # [num_stages] barriers
           v_barriers,      # [num_stages] barriers
           scores_ref=None,  # [B, Hkv, score_rows, S] fp32               GMEM (score_rows > 0)
           s_smem=None,     # [64, block_kv] fp32 (score_rows > 0)      SMEM
           a_smem=None,     # [64, block_kv] (interpret mode only)      SMEM (tiled, swizzled)
           wg=0,            # this compute warpgroup (warp-specialized: 0 or 1)
           ws=None,         # warp-specialized: (k_consumed, v_consumed, schedule, done)
           kn_ref=None,     # [B, Hkv, 1, D] (inflight_key)             GMEM
           sn_out_ref=None,  # [B, Hkv, 64] fp32 (inflight_key)          GMEM
           kn_smem=None,    # `inflight_score_scratch` (inflight_key)   SMEM
           tile_refs=None,  # (k_new, v_new [B, Tq, Hkv, D], bias [64, 64]) GMEM (inflight_tile)
           tile_smem=None):  # `inflight_tile_scratch` (inflight_tile)   SMEM
    split = lax.axis_index("split")
    head_qblock = lax.axis_index("head_qblock")
    b = lax.axis_index("batch")
    h = lax.div(head_qblock, jnp.int32(groups))    # warpgroup wg takes q block wgs * j + wg
    qb = lax.rem(head_qblock, jnp.int32(groups)) * wgs + wg

    length, first_tile, my_tiles = row_tiles(lengths_ref, b, split)

    def fetch(step, slot):
      rows = pl.ds((first_tile + step) * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(k_ref.at[b, h, rows], k_smem.at[slot], k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, h, rows], v_smem.at[slot], v_barriers.at[slot])

    def store_scores(s, start):
      """Rows [0, score_rows) of the score tile s [64, block_kv] (registers, WGMMA layout) to
      scores[b, h, :, start:start + block_kv], through s_smem and a TMA."""
      # A WGMMA-layout array can only be sliced at 64-row granularity: the whole tile goes to
      # SMEM, the TMA takes its first rows. One buffer (sharing o_smem's memory, idle until the
      # epilogue): the previous tile's TMA must have read it.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      s_smem[...] = s
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(s_smem.at[pl.ds(0, score_rows)],
                              scores_ref.at[b, h, :, pl.ds(start, block_kv)])

    # (An odd count's last warpgroup reads the last q block again and writes nothing.)
    q_first = jnp.minimum(qb, q_blocks - 1) * BLOCK_M
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(q_first, BLOCK_M)], q_smem, q_barrier)
    if kn_ref is not None:
      pl.when(split == 0)(lambda: fetch_inflight_key(
          kn_ref.at[b, h, pl.ds(q_first, KN_ROWS)], kn_smem))     # q_first is 0 here
    if tile_refs is not None:       # split is 0 there: a traced zero start, a multiple of 64
      pl.when(split == 0)(lambda: fetch_inflight_tile(tile_refs, tile_smem, b, h,
                                                      split * INFLIGHT_TILE))
    if ws is None:
      for step in range(num_stages):               # prologue: fill the ring
        pl.when(step < my_tiles)(functools.partial(fetch, step, step))
    plgpu.barrier_wait(q_barrier)
    if kn_ref is not None:
      pl.when(split == 0)(lambda: store_inflight_score(q_smem, kn_smem, sn_out_ref.at[b, h]))

    acc = plgpu.layout_cast(jnp.zeros((BLOCK_M, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    if tile_refs is not None:                      # split 0: the in-flight keys first
      acc, m_i, l_i = lax.fori_loop(
          0, (split == 0).astype(jnp.int32),
          lambda _, carry: inflight_tile_step(q_smem, tile_smem, carry, scale=score_scale,
                                              dtype=dtype), (acc, m_i, l_i))

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
      if score_rows:
        pl.when(qb == 0)(lambda: store_scores(s, (first_tile + step) * block_kv))

      # Every tile holds at least one valid slot, so m_new is finite (m_i may be -inf: a row
      # that saw no in-flight key). PV with P as the wgmma's registers operand (the score
      # accumulator's layout is the A fragment's).
      acc, m_new, l_i = softmax_pv_step(s, (acc, m_i, l_i), v_smem.at[slot], dtype=dtype,
                                        a_smem=a_smem, v_barrier=v_barriers.at[slot])

      # Both wgmmas that read this slot are done: refill it with the tile num_stages ahead.
      nxt = step + num_stages
      pl.when(nxt < my_tiles)(lambda: fetch(nxt, slot))
      return acc, m_new, l_i

    def ws_step(step, carry, masked):
      """One tile with a producer warpgroup (FlashAttention-3's schedule, `ws_scores` and
      `ws_softmax_pv`). Only the split's last tile (`masked`) compares slots with the length."""
      k_consumed, v_consumed, schedule, _ = ws
      schedule = schedule if wgs == 2 else None
      slot = lax.rem(step, jnp.int32(num_stages))
      s = ws_scores(q_smem, k_smem.at[slot], k_consumed.at[slot], schedule)
      if masked:
        slot_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, block_kv), 1,
                                          layout=plgpu.Layout.WGMMA)
        s = jnp.where(slot_ids + (first_tile + step) * block_kv < length, s, -jnp.inf)
      if score_rows:
        pl.when(qb == 0)(lambda: store_scores(s * score_scale,
                                              (first_tile + step) * block_kv))
      def wait_next():                             # the next K tile (inside the PV scope)
        nxt = step + 1
        pl.when(nxt < my_tiles)(
            lambda: plgpu.barrier_wait(k_barriers.at[lax.rem(nxt, jnp.int32(num_stages))]))
      return ws_softmax_pv(s, carry, scale=score_scale, v_tile=v_smem.at[slot],
                           v_barrier=v_barriers.at[slot], v_consumed=v_consumed.at[slot],
                           schedule=schedule, wait_next=wait_next)

    if ws is None:
      acc, m_i, l_i = lax.fori_loop(0, my_tiles, kv_step, (acc, m_i, l_i))
    else:
      acc, m_i, l_i = ws_loop(ws_step, (acc, m_i, l_i), my_tiles, k_barriers, ws, wg, wgs,
                              peel_last=True)

    if score_rows:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last score TMA has read s_smem
    o_smem[...] = acc
    m_smem[...] = m_i
    l_smem[...] = l_i
    plgpu.commit_smem()

    def write_out():
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_out)], acc_out_ref.at[b, h, qb, split])
      plgpu.copy_smem_to_gmem(m_smem, m_out_ref.at[b, h, qb, split])
      plgpu.copy_smem_to_gmem(l_smem, l_out_ref.at[b, h, qb, split])
      plgpu.wait_smem_to_gmem(0)
    pl.when(qb < q_blocks)(write_out)

  scratch = [
      plgpu.SMEM((BLOCK_M, head_dim), dtype, **SWIZZLED),
      loop_scratch(num_stages, block_kv, head_dim, dtype, score_rows),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.Barrier(),
      plgpu.Barrier(num_barriers=num_stages),
      plgpu.Barrier(num_barriers=num_stages),
  ]
  part = (batch, num_kv_heads, q_blocks, num_splits)
  out_type = [
      jax.ShapeDtypeStruct((*part, rows_out, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32),
      jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32),
  ]
  if score_rows:               # only then: score_rows == 0 builds the plain kernel
    out_type.append(jax.ShapeDtypeStruct((batch, num_kv_heads, score_rows, capacity),
                                         jnp.float32))
  keyed = inflight_key is not None
  if keyed:                    # only then: the plain kernel has no in-flight score
    scratch.append(inflight_score_scratch(head_dim, dtype))
    out_type.append(jax.ShapeDtypeStruct((batch, num_kv_heads, BLOCK_M), jnp.float32))
  tiled = inflight_tile is not None
  if tiled:                    # only then: the plain kernel has no in-flight tile
    scratch.append(inflight_tile_scratch(head_dim, dtype, interpret))
  extra_inputs = (inflight_key,) if keyed else tuple(inflight_tile) if tiled else ()

  def decode_attention_kernel(lengths_ref, q_ref, k_ref, v_ref, *refs):
    n_in = len(extra_inputs)
    in_refs, (acc_ref, m_ref, l_ref, *outs) = refs[:n_in], refs[n_in:]
    kn_ref = in_refs[0] if keyed else None
    scores_ref, sn_ref = outs[:len(outs) - keyed], (outs[-1] if keyed else None)

    def scoped(q_smem, union, m_smem, l_smem, q_bar, k_bars, v_bars, *more_smem, a_smem=None):
      (k_smem, v_smem, *s_smem), o_smem = union    # the union's two views
      extra = (scores_ref[0], s_smem[0]) if score_rows else ()
      body(lengths_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref,
           q_smem, k_smem, v_smem, o_smem, m_smem, l_smem, q_bar, k_bars, v_bars, *extra,
           a_smem=a_smem, kn_ref=kn_ref, sn_out_ref=sn_ref,
           kn_smem=more_smem[0] if keyed else None,
           tile_refs=in_refs if tiled else None, tile_smem=more_smem[0] if tiled else None)
    pl.run_scoped(scoped, *scratch,
                  **a_staging((BLOCK_M, block_kv), dtype, interpret, **SWIZZLED))

  def decode_attention_kernel_ws(lengths_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref,
                                 *scores_ref):
    """Warp-specialized (`run_ws_block`): warpgroups 0 .. wgs - 1 compute, each on its own q
    block, warpgroup `wgs` issues every K/V TMA."""
    def compute(wg, q_smem, k_smem, v_smem, o_smem, m_smem, l_smem, q_bar, k_bars, v_bars,
                ws_barriers, s_smem):
      extra = (scores_ref[0], s_smem) if score_rows else ()
      body(lengths_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, q_smem, k_smem, v_smem,
           o_smem, m_smem, l_smem, q_bar, k_bars, v_bars, *extra, wg=wg, ws=ws_barriers)

    def produce(k_smem, v_smem, k_bars, v_bars, k_consumed, v_consumed):
      split, b = lax.axis_index("split"), lax.axis_index("batch")
      h = lax.div(lax.axis_index("head_qblock"), jnp.int32(groups))
      _, first_tile, my_tiles = row_tiles(lengths_ref, b, split)
      ws_produce(my_tiles, lambda step: (first_tile + step) * block_kv, k_ref.at[b, h],
                 v_ref.at[b, h], k_smem, v_smem, k_bars, v_bars, k_consumed, v_consumed)
    run_ws_block(wgs, num_stages, block_kv, head_dim, dtype, score_rows, compute, produce)

  return plgpu.kernel(
      decode_attention_kernel_ws if ws else decode_attention_kernel,
      out_type=tuple(out_type),
      grid=(num_splits, num_kv_heads * groups, batch),
      grid_names=("split", "head_qblock", "batch"),
      **(dict(num_threads=wgs + 1, thread_name="wg") if ws else {}),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(lengths, q_rows, k_cache, v_cache, *extra_inputs)


# ----------------------------------------------------------------------------------------------
# Wrapper.
# ----------------------------------------------------------------------------------------------

def check_cache_call(q, k_cache, v_cache, lengths, k_new, v_new, inflight_mask):
  """The checks decode_attention and sparse_attention share (q, the bf16 / fp16 cache, lengths,
  the in-flight K/V and mask, D a multiple of 64); returns (B, Tq, Hq, D, Hkv, S)."""
  check_arrays(q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
  if q.ndim != 4:
    raise ValueError(f"q must be [B, Tq, Hq, D], got shape {q.shape}")
  b, tq, hq, d = q.shape
  if k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[3] != d:
    raise ValueError(f"k_cache must be [B={b}, Hkv, S, D={d}], got shape {k_cache.shape}")
  hkv, capacity = k_cache.shape[1], k_cache.shape[2]
  if v_cache.shape != k_cache.shape:
    raise ValueError(f"v_cache shape {v_cache.shape} differs from k_cache shape {k_cache.shape}")
  check_sizes(B=b, Tq=tq, Hq=hq, Hkv=hkv, S=capacity)
  if hq % hkv:
    raise ValueError(f"Hq={hq} query heads is not a multiple of Hkv={hkv} KV heads")
  check_lengths("lengths", lengths, b)
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.shape != (b, tq, hkv, d):
      raise ValueError(f"{name} must be [B, Tq, Hkv, D] = {(b, tq, hkv, d)}, got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point, got {x.dtype}")
  check_mask("inflight_mask [Tq, Tq]", inflight_mask, (tq, tq))
  for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
    if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
      raise ValueError(f"{name} must be bfloat16 or float16, got {x.dtype}")
  if not (q.dtype == k_cache.dtype == v_cache.dtype):
    raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, "
                     f"{v_cache.dtype}")
  if d % 64:
    raise ValueError(f"head dim D={d} must be a multiple of 64 (128-byte swizzle)")
  if d > MAX_HEAD_DIM:
    # D = 320 lowered for the GPU failed in Mosaic ("N must be a multiple of 8 and <= 256": the
    # P V wgmma's N is D) and at 2 <= Tq in the interpreter on a bare AssertionError; from 384
    # on the SMEM check below named it.
    raise ValueError(f"head dim D={d} must be at most {MAX_HEAD_DIM} (the P V wgmma's N)")
  return b, tq, hq, d, hkv, capacity


def _check_inputs(q, k_cache, v_cache, lengths, k_new, v_new, inflight_mask, cfg):
  capacity = check_cache_call(q, k_cache, v_cache, lengths, k_new, v_new, inflight_mask)[5]
  block_kv = cfg.block_kv or 64
  if capacity % block_kv:
    raise ValueError(f"cache capacity S={capacity} must be a multiple of block_kv={block_kv}")


def num_q_blocks(num_queries: int, group: int) -> int:
  """64-row q blocks per KV head of a call with num_queries queries and G = group query heads
  per KV head (rows r = t * G + g)."""
  return -(-num_queries * group // BLOCK_M)


def _q_rows(q: jax.Array, num_kv_heads: int, whole_blocks: bool = False) -> jax.Array:
  """q [B, Tq, Hq, D] -> [B, Hkv, M, D]: rows r = t * G + g per KV head, zero-padded to whole
  64-row q blocks (M = NQB * 64), except at Tq = 1 without whole_blocks (which the in-flight
  kernel needs): there the rows are q itself reshaped (M = G, no copy, no launch) and the
  kernel's 64-row TMA of the last q block reads past them, which the TMA unit (and the Mosaic
  GPU interpreter) fills with zeros."""
  b, tq, hq, d = q.shape
  group = hq // num_kv_heads
  n_rows = tq * group
  q_rows = q.reshape(b, tq, num_kv_heads, group, d).transpose(0, 2, 1, 3, 4)
  q_rows = q_rows.reshape(b, num_kv_heads, n_rows, d)
  if tq == 1 and not whole_blocks:
    return q_rows
  padded = num_q_blocks(tq, group) * BLOCK_M
  return jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded - n_rows), (0, 0)))


def split_partials(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                   *, config: DecodeConfig = DecodeConfig(), num_score_queries: int = 0,
                   interpret: Any = None):
  """The cache part only (step 1): packs q into 64-row tiles per KV head and runs the kernel.

  q [B, Tq, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; lengths [B]. Returns the split partials
  (acc, m, l) described in `_cache_partials`; with num_score_queries = n > 0, also the scores
  [B, Hkv, R, S] of queries [0, n) (rows r = t * G + g < n * G; R = n * G rounded up to 8).
  """
  tq, hq = q.shape[1:3]
  return _rows_partials(_q_rows(q, k_cache.shape[1]), k_cache, v_cache, lengths,
                        num_queries=tq, group=hq // k_cache.shape[1], config=config,
                        num_score_queries=num_score_queries, interpret=interpret)


def _rows_partials(q_rows: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                   lengths: jax.Array, *, num_queries: int, group: int, config: DecodeConfig,
                   num_score_queries: int, interpret: Any, k_new: jax.Array | None = None,
                   inflight_tile: tuple[jax.Array, jax.Array, jax.Array] | None = None):
  """`split_partials` from q rows already packed by `_q_rows` (Tq = num_queries queries).
  k_new: the step's keys [B, 1, Hkv, D] where the kernel may compute the Tq = 1 in-flight
  score (`in_kernel_score`); the partials then end with those scores [B, Hkv, 64], else
  with None. inflight_tile: (k_new, v_new, bias) for `_cache_partials` (the caller checked
  `tile_fits`)."""
  b, hkv, m_total, _ = q_rows.shape
  capacity = k_cache.shape[2]
  q_blocks = -(-m_total // BLOCK_M)
  config = config.resolve(q_blocks, capacity, q_rows.shape[3], interpret is not None)
  keyed = k_new is not None and q_blocks == 1 and not config.specialized(
      q_blocks, q_rows.shape[3], interpret is not None)
  rows_out = BLOCK_M if q_blocks > 1 else -(-num_queries * group // 8) * 8
  num_splits = _pick_num_splits(config, b, hkv, q_blocks, capacity, q_rows.shape[3],
                                interpret is not None)
  lengths = int32_clipped(lengths, capacity, kernel_clips=True)
  parts = _cache_partials(q_rows, k_cache, v_cache, lengths, rows_out=rows_out,
                          num_splits=num_splits, cfg=config,
                          score_rows=score_rows(num_score_queries, group),
                          inflight_key=inflight_key_rows(k_new) if keyed else None,
                          inflight_tile=inflight_tile, interpret=interpret)
  if k_new is None:
    return parts
  return (*parts, None) if not keyed else parts


def in_kernel_tile(config: DecodeConfig, q: jax.Array, k_cache: jax.Array, k_new: jax.Array,
                   v_new: jax.Array, interpret: Any, num_score_queries: int = 0) -> bool:
  """Whether decode_attention's cache kernel takes the whole in-flight part
  (`inflight_tile_step`): `inflight_tile_choice` for this call's q blocks and resolved tiling.
  Elsewhere (and with "kernel", "merged" or "jnp") the in-flight kernel or the combine does.
  Measured in the module docstring (step 2)."""
  _, tq, hq, d = q.shape
  hkv, capacity = k_cache.shape[1], k_cache.shape[2]
  group = hq // hkv
  q_blocks = num_q_blocks(tq, group)
  resolved = config.resolve(q_blocks, capacity, d, interpret is not None)
  splits = _pick_num_splits(resolved, q.shape[0], hkv, q_blocks, capacity, d,
                            interpret is not None)
  return inflight_tile_choice(
      config.inflight, q, k_new, v_new, q_blocks=q_blocks,
      specialized=resolved.specialized(q_blocks, d, interpret is not None),
      block_kv=resolved.block_kv, num_stages=resolved.num_stages,
      num_score_rows=score_rows(num_score_queries, group),
      launch_blocks=q.shape[0] * hkv * q_blocks * splits)


def inflight_tile_choice(mode: str, q: jax.Array, k_new: jax.Array, v_new: jax.Array, *,
                         q_blocks: int, specialized: bool, block_kv: int, num_stages: int,
                         num_score_rows: int, launch_blocks: int) -> bool:
  """Whether a cache kernel (decode_attention's, or sparse_attention's with one segment) takes
  the whole in-flight part: "auto" at 2 <= Tq with one q block (Tq * G <= 64; `q_blocks`: the
  kernel's q blocks per KV head) of plain (not `specialized`) blocks and k_new, v_new in q's
  dtype, where the tile costs no resident block: its SMEM fits beside the block's
  (`block_kv`-key tiles, `num_stages`, `num_score_rows`; `tile_fits`) as many times an SM as
  the block alone, or once where the launch has at most one thread block an SM anyway
  (`launch_blocks` <= SM_COUNT). H200, sparse_attention with
  64-key tiles at D 128 (two blocks an SM without the tile), device us a call, in-flight
  kernel -> tile (`benchmarks/results/s52/sparse_tile_ab_s52_h200.json`): B 1 16K Tq 16, 4
  listed blocks (32 thread blocks) 8.52 -> 7.50, 16 listed (128) 10.54 -> 10.03, B 8 4 listed
  (128) 11.25 -> 9.62; B 1 64K, 256 listed (256 thread blocks) 31.05 -> 32.90."""
  tq, d = q.shape[1], q.shape[3]
  if mode != "auto" or tq < 2 or q_blocks != 1 or specialized:
    return False
  if not (k_new.dtype == v_new.dtype == q.dtype):
    return False
  return tile_fits(block_kv, num_stages, d, q.dtype.itemsize, num_score_rows,
                   blocks_per_sm=1 if launch_blocks <= SM_COUNT else None)


def tile_fits(block_kv: int, num_stages: int, head_dim: int, itemsize: int,
              num_score_rows: int, blocks_per_sm: int | None = None) -> bool:
  """Whether a plain block with the in-flight tile's SMEM (`inflight_tile_scratch`) fits an SM
  `blocks_per_sm` times (None: as many times as one without it, `resident_blocks`): D = 128,
  bf16, 2 stages: 128-key tiles 188.5 of 227 KiB (one block an SM either way); 64-key tiles
  124.5 KiB (two blocks an SM without the tile, one with it: no; with blocks_per_sm = 1 yes)."""
  if blocks_per_sm is None:
    blocks_per_sm = resident_blocks(block_kv, num_stages, head_dim)
  tile = 2 * INFLIGHT_TILE * head_dim * itemsize + BLOCK_M * INFLIGHT_TILE * 2
  block = smem_bytes(block_kv, num_stages, head_dim, itemsize)
  if num_score_rows:
    block += BLOCK_M * block_kv * 4
  return blocks_per_sm * (block + tile) <= SMEM_PER_SM


@normalised(score_queries=static_ints, interpret=interpret_mode)
@functools.partial(jax.jit, static_argnames=("return_lse", "score_queries", "config",
                                             "interpret"))
def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                     k_new: jax.Array, v_new: jax.Array, inflight_mask: jax.Array, *,
                     return_lse: bool = False, score_queries: tuple[int, ...] = (),
                     config: DecodeConfig = DecodeConfig(), interpret: Any = None):
  """Decode attention over a dense cache plus in-flight tokens (see the module docstring).

  q [B, Tq, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; lengths [B] int32; k_new, v_new
  [B, Tq, Hkv, D]; inflight_mask [Tq, Tq] bool. Returns out [B, Tq, Hq, D] (q's dtype), then
  with return_lse lse [B, Tq, Hq] fp32, then with score_queries (distinct query indices, static;
  any sequence of ints, a tuple before the jit boundary) probs [B, len(score_queries), Hq, S]
  fp32: the final softmax weights of those queries on the cache slots (0 where
  s >= lengths[b]). `interpret=plgpu.InterpretGPUParams()` (or True) runs the kernel in the
  Mosaic GPU interpreter (CPU); None or False compile it (`combine.interpret_mode`).
  """
  _check_inputs(q, k_cache, v_cache, lengths, k_new, v_new, inflight_mask, config)
  tq, hq = q.shape[1:3]
  group = hq // k_cache.shape[1]
  sel = check_score_queries(score_queries, tq, group)
  mask = inflight_mask.astype(bool)
  # The selected queries go first (their rows lead q block 0); every per-query input and output
  # follows the same order: q and the in-flight mask's rows here, out and lse back below.
  order = selected_first(sel, range(tq))
  q, mask = permute_queries(order, q, mask)
  tiled = in_kernel_tile(config, q, k_cache, k_new, v_new, interpret, len(sel))
  use_kernel = inflight_choice(config.inflight, tq) and not tiled
  q_rows = _q_rows(q, k_cache.shape[1], whole_blocks=use_kernel)
  scored = in_kernel_score(config.inflight, q, k_new)
  parts = _rows_partials(q_rows, k_cache, v_cache, lengths, num_queries=tq, group=group,
                         config=config, num_score_queries=len(sel), interpret=interpret,
                         k_new=k_new if scored else None,
                         inflight_tile=((heads_merged(k_new), heads_merged(v_new),
                                         inflight_tile_bias(mask, group)) if tiled else None))
  given = parts[-1] if scored else None
  acc, m2, l = parts[:3]
  b, hkv, q_blocks, num_splits = acc.shape[:4]
  if use_kernel:
    inflight = (q_rows, pack_keys(k_new).astype(q.dtype), pack_keys(v_new).astype(q.dtype),
                mask_bias(mask, row_queries(tq, group, q_rows.shape[2])))
  launch_blocks = b * hkv * q_blocks
  d_chunks = merge_chunks(launch_blocks, q.shape[3], group, q.dtype.itemsize)
  if use_kernel and inflight_merges(config.inflight, tq, num_splits, launch_blocks, group,
                                    d_chunks > 1):
    items = lambda x: x.reshape(b, hkv, q_blocks * num_splits, *x.shape[4:])
    segment = MergeSegment(0, q_blocks, 0, num_splits, 0, tq)
    out, lse = inflight_merged(*inflight, items(acc), items(m2), items(l), segments=(segment,),
                               group=group, d_chunks=d_chunks, interpret=interpret)
  elif use_kernel:
    extra = inflight_partials(*inflight, rows_out=acc.shape[4], interpret=interpret)
    out, lse = combine_partials(acc, m2, l, q, [], group=group, extra=extra)
  elif tiled:                                      # the partials cover the in-flight keys
    out, lse = combine_partials(acc, m2, l, q, [], group=group)
  else:
    out, lse = combine_partials(acc, m2, l, q, [(k_new, v_new, mask[None])], group=group,
                                given_scores=given)
  probs = None
  if sel:
    slots = jnp.arange(k_cache.shape[2])
    read = (slots[None] < jnp.clip(lengths, 0, k_cache.shape[2])[:, None])[:, None]  # [B, 1, S]
    probs = scores_to_probs(parts[3], lse[:, :len(sel)], read, group=group)
  return wrapper_outputs(out.astype(q.dtype), lse, probs, order, return_lse=return_lse)


# ----------------------------------------------------------------------------------------------
# Reference (pure jnp; same semantics as sparsedec.attention.reference_attention).
# ----------------------------------------------------------------------------------------------

def decode_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               lengths: jax.Array, k_new: jax.Array, v_new: jax.Array,
                               inflight_mask: jax.Array, *, return_lse: bool = False,
                               score_queries: tuple[int, ...] = ()):
  """Pure-jnp decode attention: fp32 softmax over cache slots < lengths[b] and masked in-flight
  keys together. Shapes and outputs as `decode_attention` (probs straight from the softmax)."""
  b, tq, hq, d = q.shape
  hkv, capacity = k_cache.shape[1], k_cache.shape[2]
  qg = q.reshape(b, tq, hkv, hq // hkv, d)                                 # [B, Tq, Hkv, G, D]
  scale = d ** -0.5
  cache_mask = jnp.arange(capacity)[None, :] < int32_clipped(lengths, capacity)[:, None]  # [B, S]
  s_c = f32_einsum("bthgd,bhsd->bhgts", qg, k_cache) * scale              # [B, Hkv, G, Tq, S]
  s_n = f32_einsum("bthgd,buhd->bhgtu", qg, k_new) * scale                # [B, Hkv, G, Tq, U]
  s_c = jnp.where(cache_mask[:, None, None, None, :], s_c, -jnp.inf)
  s_n = jnp.where(inflight_mask[None, None, None], s_n, -jnp.inf)
  m = jnp.maximum(s_c.max(-1), s_n.max(-1))                                # [B, Hkv, G, Tq]
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p_c = jnp.exp(s_c - m[..., None])
  p_n = jnp.exp(s_n - m[..., None])
  denom = p_c.sum(-1) + p_n.sum(-1)                                        # [B, Hkv, G, Tq]
  o = (f32_einsum("bhgts,bhsd->bthgd", p_c.astype(v_cache.dtype), v_cache)
       + f32_einsum("bhgtu,buhd->bthgd", p_n.astype(v_new.dtype), v_new))   # [B, Tq, Hkv, G, D]
  inv = jnp.where(denom > 0, 1.0 / denom, 0.0)                             # [B, Hkv, G, Tq]
  out = (o * inv.transpose(0, 3, 1, 2)[..., None]).reshape(b, tq, hq, d).astype(q.dtype)
  results = [out]
  if return_lse:
    results.append((m + jnp.log(denom)).transpose(0, 3, 1, 2).reshape(b, tq, hq))
  if score_queries:
    sel = np.array(score_queries, np.int32)
    probs = (p_c * inv[..., None])[:, :, :, sel]                           # [B, Hkv, G, n, S]
    results.append(probs.transpose(0, 3, 1, 2, 4).reshape(b, len(sel), hq, capacity))
  return results[0] if len(results) == 1 else tuple(results)
