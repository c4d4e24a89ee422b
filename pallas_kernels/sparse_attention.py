"""Block-sparse split-KV decode attention (flash-decoding over a block list), Mosaic GPU / Hopper.

Contract (what `sparsedec.attention` will call for block-list cache views):

  sparse_attention(q [B, Tq, Hq, D], k_cache [B, Hkv, S, D], v_cache [B, Hkv, S, D],
                   block_tables [B, Hkv, NB] int32, num_blocks [B, Hkv] int32, lengths [B] int32,
                   k_new [B, Tq, Hkv, D], v_new [B, Tq, Hkv, D], inflight_mask [Tq, Tq] bool,
                   *, block_size, sparse_queries=None, return_lse=False, score_queries=())
    -> out [B, Tq, Hq, D]  (+ lse [B, Tq, Hq] fp32 with return_lse)
                           (+ probs [B, len(score_queries), Hq, S] fp32 with score_queries)

The cache is cut into S / block_size blocks of `block_size` slots. Query segments:
  * queries [0, sparse_queries) read the listed blocks: entries i < num_blocks[b, h] of
    block_tables[b, h] (entries are clipped to [0, S / block_size - 1]; list each block once, a
    duplicate counts twice, in the kernel and in the reference alike);
  * queries [sparse_queries, Tq) read the full cache (every block < cdiv(lengths[b], block_size)).
    `sparse_queries=None` means Tq (every query reads the list). This is FAFO's plan: fumble
    tokens read the compressed region, verification tokens the full cache, in one launch.
In both segments slots >= lengths[b] never count, even inside a listed block. Every query also
reads the in-flight keys u with inflight_mask[t, u]; one softmax over both parts, scale D**-0.5,
fp32 accumulation (the semantics of `sparsedec.attention.reference_attention`).

What selectors read (SnapKV, H2O, the SFI selector), as in `pallas_kernels.decode_attention`:
  * lse: per query and query head, the log-sum-exp (natural log) of that softmax;
  * probs: for the queries t = score_queries[i] (static, distinct, len(score_queries) * G <= 64),
    the final softmax weight exp(score - lse) of each query head on each cache slot s, times the
    number of times the query reads the slot: for a listed-segment query, the count of entries
    i < num_blocks[b, h] of block_tables[b, h] naming s's block (1 for a duplicate-free list),
    for a full-segment query 1; 0 for s >= lengths[b]. So probs summed over S plus the query's
    in-flight weights is 1. The kernel writes the scores from the tiles it computes (no second
    pass): within each segment the selected queries' rows come first (queries permuted, the
    in-flight mask rows alike, outputs permuted back), and the work items of a segment's first q
    block store the first `score_rows` rows of each scaled score tile (log2 units) through SMEM
    and a TMA to a [B, Hkv, segments with selected queries, score_rows, S] fp32 output; the
    wrapper converts them with the combined lse and zeroes the slots not read (never written).
    score_queries=() builds exactly the kernel without any of this.

Two steps, as `pallas_kernels.decode_attention`:
  1. The Mosaic GPU kernel (`_cache_partials`), grid (work, Hkv, B). The G query heads of a KV
     head times a segment's queries form the M rows of 64-row q blocks (r = t * G + g, zero
     padded), so each K/V tile is loaded once for all of them. A "work item" is one (q block,
     split) pair; each segment has its own static split count, chosen for all segments together
     from their tile bounds (NB * block_size / block_kv for the list, S / block_kv for the full
     segment) by `pallas_kernels.split_plan` (the shortest simulated launch), so a short list
     gets few thread blocks and a long full segment many. At run time, the
     segment's tiles (num_blocks[b, h] * tiles_per_block, or cdiv(lengths[b], block_kv)) are
     shared out among its splits; tile i of the list is rows
     block_tables[b, h, i // tiles_per_block] * block_size + (i % tiles_per_block) * block_kv.
     K/V tiles go through a `num_stages`-deep TMA ring; QK^T and PV on wgmma; online softmax in
     registers (exp2, log2 units). Time scales with the listed blocks, not S. With
     score_queries, the first q block's work items also store the selected rows' scores.
  2. The in-flight part (Tq x Tq under the mask) of every q block of both segments in one
     launch of `pallas_kernels.inflight_attention` (from 2 queries on, `SparseConfig.inflight`;
     else jnp inside the combine), then `pallas_kernels.combine.combine_partials` per segment
     merges it with the split partials by log-sum-exp. On an H200 a SmolLM2 FAFO step's attention
     (T = 109) went from 24.5 to 18.8 us per call and 15.6 to 10.9 launches. Where
     `combine.inflight_merges` says so (few splits and many blocks, or few blocks) the in-flight
     kernel merges the split partials of both segments itself and writes the output
     (`inflight_attention.inflight_merged`, no combine): 4 listed blocks at B 8 16K, Tq 256
     101.6 -> 82.2 us, Tq 16 16.1 -> 13.2, B 1 Tq 16 10.1 -> 9.3; FAFO's 8B call 42.2 -> 37.4
     (4K), 112.9 -> 105.3 (32K); SmolLM2's FAFO call 14.6 -> 14.4 (H200).
     At Tq = 1 work item 0 computes q . k_new in the cache kernel and the combine takes it
     (decode_attention's `store_inflight_score`; no XLA reduction launch): 4 listed blocks of
     16K, device us a call on an H200 (`benchmarks/results/s48/`), B 8 7.34 -> 6.26, B 1
     5.57 -> 4.34.
     At 2 <= Tq with one segment (every query on the list, or every query on the full cache) of
     one q block (Tq * G <= 64, plain blocks; "auto", `in_kernel_tile`) the cache kernel takes
     the whole in-flight part, as decode_attention's does: work item 0 first attends its q
     block to a 64-key tile of k_new / v_new read in place under the mask's bias tile
     (`inflight_tile_step`), then carries that softmax state into its cache tiles (also with
     none: an empty list, a row of length 0). The combine only merges splits; no in-flight
     kernel, no packing of k_new / v_new. Only where the tile costs no resident block: its
     SMEM fits beside the block's (`tile_fits`: at D = 64 yes; at D = 128 with 128-key tiles,
     block_size a multiple of 128, yes, with 64-key tiles, two blocks an SM without it, no),
     or the launch has at most one thread block an SM anyway. H200, device us a call, in-flight
     kernel -> tile (`benchmarks/results/s52/`): B 1 16K, 4 listed 64-slot blocks, Tq 16 8.52
     -> 7.50, Tq 4 7.67 -> 6.82; B 8 Tq 16 11.25 -> 9.62; 2 listed 128-slot blocks 8.96 ->
     8.09; at B 1 64K with 256 listed blocks (256 thread blocks) the tile would cost 31.05 ->
     32.90, so it is not taken there.

The pure-jnp reference `sparse_attention_reference` (gather the listed blocks, mask, two-part
softmax) sits at the bottom of this file.
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

from pallas_kernels.combine import (check_arrays, check_config_ints, check_inflight_mode,
                                    check_score_queries, combine_partials, f32_einsum,
                                    in_kernel_score, inflight_choice, inflight_merges,
                                    int32_clipped, interpret_mode, is_int, normalised,
                                    permute_queries, score_rows, scores_to_probs, selected_first,
                                    static_ints, wrapper_outputs)
from pallas_kernels.inflight_attention import (MergeSegment, inflight_merged, inflight_partials,
                                               mask_bias, merge_chunks, pack_keys)
from pallas_kernels.register_operand import a_staging, softmax_pv_step
from pallas_kernels.split_plan import split_counts

from pallas_kernels.decode_attention import _q_rows as decode_q_rows
from pallas_kernels.decode_attention import (BLOCK_M, INFLIGHT_TILE, KN_ROWS, LOG2E, SWIZZLED,
                                             WS_MIN_Q_BLOCKS, check_cache_call,
                                             check_plain_smem, fetch_inflight_key,
                                             fetch_inflight_tile, heads_merged,
                                             inflight_key_rows, inflight_score_scratch,
                                             inflight_tile_bias, inflight_tile_choice,
                                             inflight_tile_scratch, inflight_tile_step,
                                             loop_scratch, resident_blocks, smem_bytes,
                                             store_inflight_score, run_ws_block, ws_loop,
                                             ws_produce, ws_scores, ws_smem_bytes,
                                             ws_softmax_pv)
from pallas_kernels.hopper import SM_COUNT, SMEM_PER_SM


# Warp-specialized blocks only where a segment may run this many tiles or more. H100, device us
# of the sparse kernel, plain -> warp-specialized (`benchmarks/results/s27/sparse_ws_s27_h100.json`):
# FAFO's 8B call (240 queries on 16 listed blocks, 43 on the full cache) 23.1 -> 22.1 at 4K,
# 151.7 -> 118.4 at 32K; 4 listed 64-slot blocks at Tq 64 / 256 4.0 -> 5.3 / 7.0 -> 7.7 (B 1).
WS_MIN_TILES = 8
# A warp-specialized segment whose splits would each still read this many keys gets exactly one
# wave of items (`split_plan.split_counts`, wave_tiles).
WAVE_KEYS = 2048


@dataclasses.dataclass(frozen=True)
class SparseConfig:
  """Tiling of the kernel.

  block_kv: KV rows per tile, a multiple of 64 dividing block_size (None: 128 when it divides
    block_size, else 64). num_splits / num_splits_full: thread blocks per q block for the listed
    segment / the full segment (None: the counts with the shortest simulated launch on
    `target_blocks` resident thread blocks, `pallas_kernels.split_plan`, at least
    `min_tiles_per_split` tiles each). target_blocks None: SM_COUNT * `resident_blocks` (two
    per SM with 64-key tiles and at most 2 stages, as in decode_attention; SM_COUNT for
    warp-specialized blocks).
  warp_specialized: on the GPU, blocks of a producer warpgroup and two compute warpgroups
    (q blocks 2j and 2j + 1 of one segment and split; decode_attention's FlashAttention-3
    structure). None: where a segment has WS_MIN_Q_BLOCKS q blocks or more and one may run
    WS_MIN_TILES tiles or more; True: always (on the GPU); False: never. The Mosaic GPU
    interpreter runs plain blocks.
  """
  block_kv: int | None = None
  num_stages: int = 2
  num_splits: int | None = None
  num_splits_full: int | None = None
  target_blocks: int | None = None
  min_tiles_per_split: int = 1    # a 2-block list on 16 thread blocks beats one on 8: latency
  # The in-flight part: "merged", "kernel", "jnp", "auto" (combine.inflight_choice; at Tq = 1
  # "auto" has the cache kernel compute q . k_new, combine.in_kernel_score, "jnp" the combine;
  # at 2 <= Tq with one segment of one q block "auto" has the cache kernel attend to the keys,
  # in_kernel_tile).
  inflight: str = "auto"
  warp_specialized: bool | None = None

  def __post_init__(self):
    check_inflight_mode(self.inflight)
    check_config_ints(self, ("num_stages", "min_tiles_per_split"),
                      ("block_kv", "num_splits", "num_splits_full", "target_blocks"))
    if self.block_kv is not None and self.block_kv % 64:
      raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv}")

  def tile_rows(self, block_size: int, head_dim: int = 128) -> int:
    """KV rows per tile: block_kv, or 128 where the block size and a plain block's SMEM allow
    (not at D = 256 with 2 stages: 292 KiB), else 64."""
    if self.block_kv is not None:
      return self.block_kv
    fits = smem_bytes(128, self.num_stages, head_dim) <= SMEM_PER_SM
    return 128 if block_size % 128 == 0 and fits else 64

  def slots(self, block_size: int, head_dim: int = 128, ws: bool = False) -> int:
    """Resident thread blocks the split plan fills (ws: warp-specialized blocks)."""
    if self.target_blocks is not None:
      return self.target_blocks
    if ws:
      return SM_COUNT
    return SM_COUNT * resident_blocks(self.tile_rows(block_size, head_dim), self.num_stages,
                                      head_dim)

  def specialized(self, max_q_blocks: int, block_size: int, head_dim: int,
                  interpret: bool = False, max_tiles: int = WS_MIN_TILES) -> bool:
    """Whether a call whose largest segment has `max_q_blocks` q blocks, and whose longest
    segment at most `max_tiles` tiles, runs warp-specialized blocks: on the GPU, where wanted
    and the SMEM fits."""
    wanted = (self.warp_specialized if self.warp_specialized is not None
              else max_q_blocks >= WS_MIN_Q_BLOCKS and max_tiles >= WS_MIN_TILES)
    return (wanted and not interpret and ws_smem_bytes(
        self.tile_rows(block_size, head_dim), self.num_stages, head_dim) <= SMEM_PER_SM)


@dataclasses.dataclass(frozen=True)
class _Segment:
  """Static layout of one query segment inside the kernel's work axis."""
  full: bool            # reads the full cache (True) or the block list (False)
  first_query: int      # queries [first_query, first_query + num_queries)
  num_queries: int
  first_qblock: int     # its q blocks in q_rows: [first_qblock, first_qblock + q_blocks)
  q_blocks: int
  num_splits: int
  first_work: int       # its work items: [first_work, first_work + q_blocks * num_splits)
  score_slot: int = -1  # its index in the kernel's score output, -1: no selected queries

  @property
  def num_work(self) -> int:
    return self.q_blocks * self.num_splits

  @property
  def num_pair_work(self) -> int:
    """Thread blocks of a warp-specialized launch: (pair of q blocks, split) items."""
    return -(-self.q_blocks // 2) * self.num_splits


def _segment_q_blocks(group: int, num_queries: int, sparse_queries: int) -> list[int]:
  """64-row q blocks of the list and full segments (those with queries), in that order."""
  return [-(-n * group // BLOCK_M) for n in (sparse_queries, num_queries - sparse_queries) if n]


def _plan_segments(cfg: SparseConfig, *, batch, num_kv_heads, group, num_queries, sparse_queries,
                   list_tiles, full_tiles, slots, tile_keys, ws=False
                   ) -> tuple[_Segment, ...]:
  """Segments in query order, with q blocks and split counts (static); ws: the thread blocks
  are pairs of q blocks, planned a wave at a time (`split_plan.split_counts`'s wave_tiles:
  WAVE_KEYS keys of `tile_keys`-key tiles)."""
  parts = [(False, 0, sparse_queries), (True, sparse_queries, num_queries - sparse_queries)]
  parts = [p for p in parts if p[2] > 0]
  q_blocks = _segment_q_blocks(group, num_queries, sparse_queries)
  plan = tuple((-(-qb // 2) if ws else qb, max(1, full_tiles if full else list_tiles),
                cfg.num_splits_full if full else cfg.num_splits)
               for (full, _, _), qb in zip(parts, q_blocks))
  splits = split_counts(plan, copies=batch * num_kv_heads, slots=slots,
                        min_tiles=cfg.min_tiles_per_split,
                        wave_tiles=WAVE_KEYS // tile_keys if ws else 0, sms=SM_COUNT)
  segments, qblock, work = [], 0, 0
  for (full, first, n), qb, s in zip(parts, q_blocks, splits):
    segments.append(_Segment(full, first, n, qblock, qb, s, work))
    qblock += qb
    work += qb * s
  return tuple(segments)


# ----------------------------------------------------------------------------------------------
# Step 1: the Mosaic GPU kernel over the cache.
# ----------------------------------------------------------------------------------------------

def _cache_partials(q_rows, k_cache, v_cache, block_tables, num_blocks, lengths, *,
                    segments: tuple[_Segment, ...], rows_out: int, block_size: int,
                    cfg: SparseConfig, score_rows: int = 0, ws: bool = False,
                    inflight_key: jax.Array | None = None,
                    inflight_tile: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                    interpret: Any = None):
  """Split partials of the cache part, all segments in one launch.

  q_rows [B, Hkv, QB * 64, D] (at Tq = 1 [B, Hkv, G, D]: rows past G read as zeros);
  k_cache, v_cache [B, Hkv, S, D]; block_tables [B, Hkv, NB] int32, num_blocks [B, Hkv] int32,
  lengths [B] int32, each clipped in the kernel (entries to valid block ids, counts to [0, NB],
  lengths to [0, S]). Returns, with W = sum of the segments' work items,
  acc [B, Hkv, W, rows_out, D] fp32 (un-normalised), m [B, Hkv, W, 64] fp32 (row max of the
  scaled scores in log2 units, -inf when the split saw no valid slot), l [B, Hkv, W, 64] fp32.
  With score_rows > 0 (a multiple of 8, <= 64) also scores [B, Hkv, NSS, score_rows, S] fp32,
  NSS = the segments with score_slot >= 0: rows [0, score_rows) of the segment's first q block,
  the scaled scores (log2 units) of the slots its tiles visit, -inf for those >= lengths[b];
  the other slots are never written (undefined).
  ws: warp-specialized blocks (GPU only): grid items are (pair of q blocks, split) per segment,
  a producer warpgroup issues the K/V TMAs, two compute warpgroups take the pair's q blocks
  (decode_attention's `decode_attention_kernel_ws`); the outputs are laid out as above.
  inflight_key: at Tq = 1 (one segment of one q block, plain blocks) k_new [B, Hkv, 1, D] in
  q's dtype: work item 0 (split 0) also returns, last, the in-flight scores [B, Hkv, 64] fp32,
  q_r . k_new unscaled (decode_attention's `store_inflight_score`).
  inflight_tile: at 2 <= Tq (one segment of one q block, plain blocks) (k_new, v_new
  [B, Tq, Hkv * D] in q's dtype, `heads_merged`; bias [64, 64] bf16, `inflight_tile_bias`):
  work item 0 (split 0) first attends to the in-flight keys (decode_attention's
  `inflight_tile_step`), so the partials are the whole attention once merged.
  """
  batch, num_kv_heads, _, head_dim = q_rows.shape
  capacity = k_cache.shape[2]
  table_len = block_tables.shape[2]
  block_kv = cfg.tile_rows(block_size, head_dim)
  tiles_per_block = block_size // block_kv
  num_stages = cfg.num_stages
  dtype = q_rows.dtype
  if not ws:
    check_plain_smem(block_kv, num_stages, head_dim, dtype=dtype, score_rows=score_rows)
  score_scale = head_dim ** -0.5 * LOG2E
  num_work = sum(seg.num_work for seg in segments)
  score_slots = sum(seg.score_slot >= 0 for seg in segments)
  keyed = inflight_key is not None
  tiled = inflight_tile is not None
  if (keyed or tiled) and (ws or len(segments) != 1 or segments[0].q_blocks != 1):
    raise ValueError("the in-flight score or tile needs one segment of one q block on plain "
                     "(not warp-specialized) blocks")
  i32 = lambda x: jnp.int32(x)

  def locate(work):
    """(full?, q block, split, num_splits) of a work item; scalars, selected over segments."""
    full = jnp.bool_(segments[0].full)
    qblock, split, splits = i32(0), i32(0), i32(segments[0].num_splits)
    for seg in segments:
      local = work - seg.first_work
      mine = jnp.logical_and(local >= 0, local < seg.num_work)
      full = jnp.where(mine, jnp.bool_(seg.full), full)
      qblock = jnp.where(mine, seg.first_qblock + lax.div(local, i32(seg.num_splits)), qblock)
      split = jnp.where(mine, lax.rem(local, i32(seg.num_splits)), split)
      splits = jnp.where(mine, i32(seg.num_splits), splits)
    return full, qblock, split, splits

  pair_starts = np.cumsum([0] + [seg.num_pair_work for seg in segments])

  def locate_ws(item, wg):
    """Warp-specialized: (full?, q block to load, split, num_splits, output work item, writes?)
    of compute warpgroup wg in grid item `item` = split * pairs + j of the segment: q block
    2j + wg; past the segment's last q block it loads that one again and writes nothing."""
    full = jnp.bool_(segments[0].full)
    qblock, split, splits, out, valid = i32(0), i32(0), i32(segments[0].num_splits), i32(0), \
        jnp.bool_(False)
    for seg, start in zip(segments, pair_starts):
      local = item - int(start)
      mine = jnp.logical_and(local >= 0, local < seg.num_pair_work)
      # Pairs fastest: a split's pairs are launched side by side and read its K/V tiles at about
      # the same time, so the second read hits L2 (FAFO's 8B call at 32K, 2 pairs x 29 splits:
      # kernel 100.0 -> 91.7 us on an H200; `results/s28/fafo_pair_order_s28_h200.json`).
      pairs = i32(-(-seg.q_blocks // 2))
      seg_split, q_local = lax.div(local, pairs), lax.rem(local, pairs) * 2 + wg
      full = jnp.where(mine, jnp.bool_(seg.full), full)
      qblock = jnp.where(mine, seg.first_qblock + jnp.minimum(q_local, seg.q_blocks - 1), qblock)
      split = jnp.where(mine, seg_split, split)
      splits = jnp.where(mine, i32(seg.num_splits), splits)
      out = jnp.where(mine, seg.first_work + q_local * seg.num_splits + seg_split, out)
      valid = jnp.where(mine, q_local < seg.q_blocks, valid)
    return full, qblock, split, splits, out, valid

  def split_tiles(tables_ref, counts_ref, lengths_ref, b, h, full, split, num_splits):
    """(length, first tile, tile count, tile_start) of one split. The lengths, counts and table
    entries are clipped here (to their valid ranges), not by XLA ops before the launch;
    tile_start(step) is the first cache slot of the split's tile `step` (a scalar)."""
    length = jnp.clip(lengths_ref[b], 0, capacity)
    list_tiles = jnp.clip(counts_ref[b, h], 0, table_len) * tiles_per_block
    full_tiles = lax.div(length + (block_kv - 1), i32(block_kv))
    num_tiles = jnp.where(full, full_tiles, list_tiles)
    tiles_per_split = lax.div(num_tiles + (num_splits - 1), num_splits)
    first_tile = split * tiles_per_split
    my_tiles = jnp.maximum(jnp.minimum(tiles_per_split, num_tiles - first_tile), 0)

    def tile_start(step):
      tile = first_tile + step
      if tiles_per_block == 1:
        entry, within = tile, i32(0)
      else:
        entry = lax.div(tile, i32(tiles_per_block))
        within = lax.rem(tile, i32(tiles_per_block)) * block_kv
      # The full segment never reads the table; the index is clamped so the load stays in bounds.
      block = jnp.clip(tables_ref[b, h, jnp.minimum(entry, i32(table_len - 1))], 0,
                       capacity // block_size - 1)
      return jnp.where(full, tile * block_kv, block * block_size + within)
    return length, first_tile, my_tiles, tile_start

  def score_slot_of(work):
    """The score output slot a work item writes (a scalar), -1 for none: the work items of the
    first q block of a segment with selected queries (local work index < num_splits)."""
    slot = i32(-1)
    for seg in segments:
      if seg.score_slot >= 0:
        local = work - seg.first_work
        first_qblock = jnp.logical_and(local >= 0, local < seg.num_splits)
        slot = jnp.where(first_qblock, i32(seg.score_slot), slot)
    return slot

  def body(tables_ref,      # [B, Hkv, NB] int32                        GMEM
           counts_ref,      # [B, Hkv] int32                            GMEM
           lengths_ref,     # [B] int32                                 GMEM
           q_ref,           # [B, Hkv, QB * 64 (or G at Tq = 1), D]     GMEM
           k_ref,           # [B, Hkv, S, D]                            GMEM
           v_ref,           # [B, Hkv, S, D]                            GMEM
           acc_out_ref,     # [B, Hkv, W, rows_out, D] fp32             GMEM
           m_out_ref,       # [B, Hkv, W, 64] fp32                      GMEM
           l_out_ref,       # [B, Hkv, W, 64] fp32                      GMEM
           q_smem,          # [64, D]                                   SMEM (tiled, swizzled)
           k_smem,          # [num_stages, block_kv, D]                 SMEM (tiled, swizzled)
           v_smem,          # [num_stages, block_kv, D]                 SMEM (tiled, swizzled)
           o_smem,          # [64, D] fp32, shares the rings' memory     SMEM
           m_smem,          # [64] fp32                                 SMEM
           l_smem,          # [64] fp32                                 SMEM
           q_barrier, k_barriers, v_barriers,
           scores_ref=None,  # [B, Hkv, NSS, score_rows, S] fp32          GMEM (score_rows > 0)
           s_smem=None,     # [64, block_kv] fp32 (score_rows > 0)      SMEM
           a_smem=None,     # [64, block_kv] (interpret mode only)      SMEM (tiled, swizzled)
           wg=0,            # warp-specialized: this compute warpgroup (0 or 1)
           ws_barriers=None,  # warp-specialized: (k_consumed, v_consumed, schedule, done)
           kn_ref=None,     # [B, Hkv, 1, D] (inflight_key)             GMEM
           sn_out_ref=None,  # [B, Hkv, 64] fp32 (inflight_key)          GMEM
           kn_smem=None,    # `inflight_score_scratch` (inflight_key)   SMEM
           tile_refs=None,  # (k_new, v_new [B, Tq, Hkv * D], bias [64, 64]) GMEM (inflight_tile)
           tile_smem=None):  # `inflight_tile_scratch` (inflight_tile)   SMEM
    h = lax.axis_index("head")
    b = lax.axis_index("batch")
    if ws_barriers is None:
      work = lax.axis_index("work")
      full, qb, split, num_splits = locate(work)
      writes = None
    else:
      full, qb, split, num_splits, work, writes = locate_ws(lax.axis_index("work"), wg)
    length, first_tile, my_tiles, tile_start = split_tiles(
        tables_ref, counts_ref, lengths_ref, b, h, full, split, num_splits)

    def fetch(step, slot):
      rows = pl.ds(tile_start(step), block_kv)
      plgpu.copy_gmem_to_smem(k_ref.at[b, h, rows], k_smem.at[slot], k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, h, rows], v_smem.at[slot], v_barriers.at[slot])

    def store_scores(s, start, slot):
      """Rows [0, score_rows) of the score tile s [64, block_kv] (registers, WGMMA layout) to
      scores[b, h, slot, :, start:start + block_kv], through s_smem and a TMA (the whole tile
      goes to SMEM: a WGMMA-layout array slices at 64-row granularity only)."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous tile's TMA has read it
      s_smem[...] = s
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(s_smem.at[pl.ds(0, score_rows)],
                              scores_ref.at[b, h, slot, :, pl.ds(start, block_kv)])

    score_slot = score_slot_of(work) if score_rows else None
    if writes is not None and score_rows:          # an idle warpgroup writes no scores
      score_slot = jnp.where(writes, score_slot, -1)
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(qb * BLOCK_M, BLOCK_M)], q_smem, q_barrier)
    if kn_ref is not None:
      pl.when(work == 0)(lambda: fetch_inflight_key(
          kn_ref.at[b, h, pl.ds(qb * BLOCK_M, KN_ROWS)], kn_smem))   # qb is 0 here
    if tile_refs is not None:       # work is 0 there: a traced zero start, a multiple of 64
      pl.when(work == 0)(lambda: fetch_inflight_tile(tile_refs, tile_smem, b, h,
                                                     work * INFLIGHT_TILE))
    if ws_barriers is None:
      for step in range(num_stages):               # prologue: fill the ring
        pl.when(step < my_tiles)(functools.partial(fetch, step, step))
    plgpu.barrier_wait(q_barrier)
    if kn_ref is not None:
      pl.when(work == 0)(lambda: store_inflight_score(q_smem, kn_smem, sn_out_ref.at[b, h]))

    acc = plgpu.layout_cast(jnp.zeros((BLOCK_M, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    if tile_refs is not None:      # work item 0: the in-flight keys first (also with no tiles)
      acc, m_i, l_i = lax.fori_loop(
          0, (work == 0).astype(jnp.int32),
          lambda _, carry: inflight_tile_step(q_smem, tile_smem, carry, scale=score_scale,
                                              dtype=dtype), (acc, m_i, l_i))

    def kv_step(step, carry):
      acc, m_i, l_i = carry
      slot = lax.rem(step, i32(num_stages))
      start = tile_start(step)                     # scalar load overlaps the TMA wait

      plgpu.barrier_wait(k_barriers.at[slot])
      def qk_scope(s_ref):                         # [64, block_kv] fp32 accumulator
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        return s_ref[...]
      s = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_M, block_kv), jnp.float32))
      s = s * score_scale

      slot_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, block_kv), 1,
                                        layout=plgpu.Layout.WGMMA)
      s = jnp.where(slot_ids + start < length, s, -jnp.inf)
      if score_rows:
        pl.when(score_slot >= 0)(lambda: store_scores(s, start, score_slot))

      # A listed block may lie wholly past lengths[b]: then the tile is all -inf, and so may be
      # m_new (m_i is -inf until a row sees a key: also a row of the in-flight tile that saw no
      # in-flight key): `empty_rows`.
      acc, m_new, l_i = softmax_pv_step(s, (acc, m_i, l_i), v_smem.at[slot], dtype=dtype,
                                        a_smem=a_smem, v_barrier=v_barriers.at[slot],
                                        empty_rows=True)

      nxt = step + num_stages
      pl.when(nxt < my_tiles)(lambda: fetch(nxt, slot))
      return acc, m_new, l_i

    def ws_step(step, carry, masked):
      """One tile of a warp-specialized block (decode_attention's `ws_scores` and
      `ws_softmax_pv`); every tile is masked (`masked` is always True here): a listed block may
      straddle or pass the length."""
      k_consumed, v_consumed, schedule, _ = ws_barriers
      slot = lax.rem(step, i32(num_stages))
      start = tile_start(step)
      s = ws_scores(q_smem, k_smem.at[slot], k_consumed.at[slot], schedule)
      slot_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, block_kv), 1,
                                        layout=plgpu.Layout.WGMMA)
      s = jnp.where(slot_ids + start < length, s, -jnp.inf)
      if score_rows:
        pl.when(score_slot >= 0)(lambda: store_scores(s * score_scale, start, score_slot))
      def wait_next():                             # the next K tile (inside the PV scope)
        nxt = step + 1
        pl.when(nxt < my_tiles)(
            lambda: plgpu.barrier_wait(k_barriers.at[lax.rem(nxt, i32(num_stages))]))
      return ws_softmax_pv(s, carry, scale=score_scale, v_tile=v_smem.at[slot],
                           v_barrier=v_barriers.at[slot], v_consumed=v_consumed.at[slot],
                           schedule=schedule, wait_next=wait_next, empty_rows=True)

    if ws_barriers is None:
      acc, m_i, l_i = lax.fori_loop(0, my_tiles, kv_step, (acc, m_i, l_i))
    else:
      acc, m_i, l_i = ws_loop(ws_step, (acc, m_i, l_i), my_tiles, k_barriers, ws_barriers, wg,
                              2)

    if score_rows:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last score TMA has read s_smem
    o_smem[...] = acc
    m_smem[...] = m_i
    l_smem[...] = l_i
    plgpu.commit_smem()

    def write_out():
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_out)], acc_out_ref.at[b, h, work])
      plgpu.copy_smem_to_gmem(m_smem, m_out_ref.at[b, h, work])
      plgpu.copy_smem_to_gmem(l_smem, l_out_ref.at[b, h, work])
      plgpu.wait_smem_to_gmem(0)
    if writes is None:
      write_out()
    else:
      pl.when(writes)(write_out)

  scratch = [
      plgpu.SMEM((BLOCK_M, head_dim), dtype, **SWIZZLED),
      loop_scratch(num_stages, block_kv, head_dim, dtype, score_rows),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.Barrier(),
      plgpu.Barrier(num_barriers=num_stages),
      plgpu.Barrier(num_barriers=num_stages),
  ]
  part = (batch, num_kv_heads, num_work)
  out_type = [
      jax.ShapeDtypeStruct((*part, rows_out, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32),
      jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32),
  ]
  if score_rows:               # only then: score_rows == 0 builds the plain kernel
    out_type.append(jax.ShapeDtypeStruct(
        (batch, num_kv_heads, score_slots, score_rows, k_cache.shape[2]), jnp.float32))
  if keyed:                    # only then: the plain kernel has no in-flight score
    scratch.append(inflight_score_scratch(head_dim, dtype))
    out_type.append(jax.ShapeDtypeStruct((batch, num_kv_heads, BLOCK_M), jnp.float32))
  if tiled:                    # only then: the plain kernel has no in-flight tile
    scratch.append(inflight_tile_scratch(head_dim, dtype, interpret))
  extra_inputs = (inflight_key,) if keyed else tuple(inflight_tile) if tiled else ()

  def sparse_attention_kernel(tables_ref, counts_ref, lengths_ref, q_ref, k_ref, v_ref, *refs):
    n_in = len(extra_inputs)
    in_refs, (acc_ref, m_ref, l_ref, *outs) = refs[:n_in], refs[n_in:]
    kn_ref = in_refs[0] if keyed else None
    scores_ref, sn_ref = outs[:len(outs) - keyed], (outs[-1] if keyed else None)

    def scoped(q_smem, union, *rest, a_smem=None):
      (k_smem, v_smem, *s_smem), o_smem = union    # the union's two views
      rest, more_smem = (rest[:-1], rest[-1]) if keyed or tiled else (rest, None)
      extra = (scores_ref[0], s_smem[0]) if score_rows else ()
      body(tables_ref, counts_ref, lengths_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref,
           q_smem, k_smem, v_smem, o_smem, *rest, *extra, a_smem=a_smem, kn_ref=kn_ref,
           sn_out_ref=sn_ref, kn_smem=more_smem if keyed else None,
           tile_refs=in_refs if tiled else None, tile_smem=more_smem if tiled else None)
    pl.run_scoped(scoped, *scratch,
                  **a_staging((BLOCK_M, block_kv), dtype, interpret, **SWIZZLED))

  def sparse_attention_kernel_ws(tables_ref, counts_ref, lengths_ref, q_ref, k_ref, v_ref,
                                 acc_ref, m_ref, l_ref, *scores_ref):
    """Warp-specialized (decode_attention's `run_ws_block`): warpgroups 0 and 1 compute, 2
    produces."""
    def compute(wg, q_smem, k_smem, v_smem, o_smem, m_smem, l_smem, q_bar, k_bars, v_bars,
                ws_barriers, s_smem):
      extra = (scores_ref[0], s_smem) if score_rows else ()
      body(tables_ref, counts_ref, lengths_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref,
           q_smem, k_smem, v_smem, o_smem, m_smem, l_smem, q_bar, k_bars, v_bars, *extra,
           wg=wg, ws_barriers=ws_barriers)

    def produce(k_smem, v_smem, k_bars, v_bars, k_consumed, v_consumed):
      h, b = lax.axis_index("head"), lax.axis_index("batch")
      full, _, split, num_splits, _, _ = locate_ws(lax.axis_index("work"), 0)
      _, _, my_tiles, tile_start = split_tiles(tables_ref, counts_ref, lengths_ref, b, h, full,
                                               split, num_splits)
      ws_produce(my_tiles, tile_start, k_ref.at[b, h], v_ref.at[b, h], k_smem, v_smem, k_bars,
                 v_bars, k_consumed, v_consumed)
    run_ws_block(2, num_stages, block_kv, head_dim, dtype, score_rows, compute, produce)

  return plgpu.kernel(
      sparse_attention_kernel_ws if ws else sparse_attention_kernel,
      out_type=tuple(out_type),
      grid=(int(pair_starts[-1]) if ws else num_work, num_kv_heads, batch),
      grid_names=("work", "head", "batch"),
      **(dict(num_threads=3, thread_name="wg") if ws else {}),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(block_tables, num_blocks, lengths, q_rows, k_cache, v_cache, *extra_inputs)


# ----------------------------------------------------------------------------------------------
# Wrapper.
# ----------------------------------------------------------------------------------------------

def _check_inputs(q, k_cache, v_cache, block_tables, num_blocks, lengths, k_new, v_new,
                  inflight_mask, block_size, sparse_queries, cfg):
  b, tq, _, d, hkv, capacity = check_cache_call(q, k_cache, v_cache, lengths, k_new, v_new,
                                                inflight_mask)
  check_arrays(block_tables=block_tables, num_blocks=num_blocks)
  if block_tables.ndim != 3 or block_tables.shape[:2] != (b, hkv):
    raise ValueError(f"block_tables must be [B={b}, Hkv={hkv}, NB], got {block_tables.shape}")
  if num_blocks.shape != (b, hkv):
    raise ValueError(f"num_blocks must be [B, Hkv] = {(b, hkv)}, got {num_blocks.shape}")
  for name, x in (("block_tables", block_tables), ("num_blocks", num_blocks)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be integer, got {x.dtype}")
  if not isinstance(block_size, (int, np.integer)) or block_size <= 0 or block_size % 64:
    raise ValueError(f"block_size must be a positive multiple of 64 (an int), got {block_size!r}")
  block_kv = cfg.tile_rows(block_size, d)
  if block_size % block_kv:
    raise ValueError(f"block_kv={block_kv} must divide block_size={block_size}")
  if capacity % block_size:
    raise ValueError(f"cache capacity S={capacity} must be a multiple of block_size="
                     f"{block_size}")
  if not is_int(sparse_queries) or not 0 <= sparse_queries <= tq:
    raise ValueError(f"sparse_queries must be an int in [0, Tq={tq}] or None, got "
                     f"{sparse_queries!r}")


def _q_rows(q: jax.Array, segments: tuple[_Segment, ...], num_kv_heads: int,
            whole_blocks: bool = False) -> jax.Array:
  """q [B, Tq, Hq, D] -> [B, Hkv, QB * 64, D]: each segment's rows t * G + g per KV head,
  zero-padded to whole 64-row q blocks; at Tq = 1 without whole_blocks (which the in-flight
  kernel needs) q itself reshaped, [B, Hkv, G, D] (no copy: the kernel's 64-row q TMA reads
  past it, zero-filled; decode_attention's `_q_rows`)."""
  b, tq, hq, d = q.shape
  if tq == 1 and not whole_blocks:
    return decode_q_rows(q, num_kv_heads)
  group = hq // num_kv_heads
  q_rows = q.reshape(b, tq, num_kv_heads, group, d).transpose(0, 2, 1, 3, 4)  # [B,Hkv,Tq,G,D]
  pieces = []
  for seg in segments:
    rows = q_rows[:, :, seg.first_query:seg.first_query + seg.num_queries]
    rows = rows.reshape(b, num_kv_heads, seg.num_queries * group, d)
    pieces.append(jnp.pad(rows, ((0, 0), (0, 0),
                                 (0, seg.q_blocks * BLOCK_M - seg.num_queries * group), (0, 0))))
  return jnp.concatenate(pieces, axis=2) if len(pieces) > 1 else pieces[0]


def _row_queries(segments: tuple[_Segment, ...], group: int) -> np.ndarray:
  """[QB * 64] int: the query each of `_q_rows`' rows holds, -1 for padding."""
  rows = []
  for seg in segments:
    held = seg.first_query + np.arange(seg.num_queries * group) // group
    rows.append(np.pad(held, (0, seg.q_blocks * BLOCK_M - held.size), constant_values=-1))
  return np.concatenate(rows)


def split_partials(q, k_cache, v_cache, block_tables, num_blocks, lengths, *, block_size: int,
                   sparse_queries: int, config: SparseConfig = SparseConfig(),
                   num_score_queries: tuple[int, int] = (0, 0), interpret: Any = None):
  """The cache part only (step 1). Returns (segments, acc, m, l): the static segment layout
  and the partials of `_cache_partials`. With num_score_queries = (n_list, n_full) != (0, 0),
  also the scores [B, Hkv, NSS, R, S] of the first n queries of each segment (slot
  segments[i].score_slot; rows r = t * G + g < n * G; R the larger n * G rounded up to 8)."""
  layout = _layout(q.shape, k_cache.shape, block_tables.shape[2], block_size=block_size,
                   sparse_queries=sparse_queries, config=config,
                   num_score_queries=num_score_queries, interpret=interpret is not None)
  return (layout[0],) + _rows_partials(
      _q_rows(q, layout[0], k_cache.shape[1]), k_cache, v_cache, block_tables, num_blocks,
      lengths, layout, block_size=block_size, config=config, interpret=interpret)


def _layout(q_shape, cache_shape, table_len: int, *, block_size: int, sparse_queries: int,
            config: SparseConfig, num_score_queries: tuple[int, int], interpret: bool = False
            ) -> tuple[tuple[_Segment, ...], int, int, bool]:
  """The static layout of a call: (segments with their score slots, rows_out, score rows,
  warp-specialized?)."""
  b, tq, hq, d = q_shape
  hkv, capacity = cache_shape[1], cache_shape[2]
  group = hq // hkv
  block_kv = config.tile_rows(block_size, d)
  list_tiles = table_len * (block_size // block_kv)
  full_tiles = capacity // block_kv
  max_tiles = max(list_tiles if sparse_queries else 0, full_tiles if sparse_queries < tq else 0)
  ws = config.specialized(max(_segment_q_blocks(group, tq, sparse_queries)), block_size, d,
                          interpret, max_tiles)
  segments = _plan_segments(
      config, batch=b, num_kv_heads=hkv, group=group, num_queries=tq,
      sparse_queries=sparse_queries, list_tiles=list_tiles, full_tiles=full_tiles,
      slots=config.slots(block_size, d, ws), ws=ws, tile_keys=block_kv)
  selected = dict(zip((False, True), num_score_queries))       # full? -> selected queries
  slot_ids = iter(range(len(segments)))
  segments = tuple(dataclasses.replace(seg, score_slot=next(slot_ids)) if selected[seg.full]
                   else seg for seg in segments)
  rows_out = BLOCK_M
  if all(seg.q_blocks == 1 for seg in segments):
    rows_out = max(-(-seg.num_queries * group // 8) * 8 for seg in segments)
  return segments, rows_out, score_rows(max(num_score_queries), group), ws


def in_kernel_tile(config: SparseConfig, q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                   layout, block_size: int) -> bool:
  """Whether the cache kernel takes the whole in-flight part (work item 0 attends to the
  in-flight keys first, decode_attention's `inflight_tile_step`): one segment (every query
  reads the list, or every query the full cache) of one q block, and decode_attention's
  `inflight_tile_choice` for it ("auto", 2 <= Tq, plain blocks, k_new and v_new in q's dtype,
  the tile's SMEM beside this tiling's without a lost resident block, or once an SM in a launch
  of at most one thread block an SM). layout: `_layout`'s."""
  segments, _, rows_score, ws = layout
  return len(segments) == 1 and inflight_tile_choice(
      config.inflight, q, k_new, v_new, q_blocks=segments[0].q_blocks, specialized=ws,
      block_kv=config.tile_rows(block_size, q.shape[3]), num_stages=config.num_stages,
      num_score_rows=rows_score,
      launch_blocks=q.shape[0] * k_new.shape[2] * segments[0].num_work)


def _rows_partials(q_rows, k_cache, v_cache, block_tables, num_blocks, lengths, layout, *,
                   block_size: int, config: SparseConfig, interpret: Any,
                   inflight_key: jax.Array | None = None,
                   inflight_tile: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> tuple:
  """The kernel's outputs (acc, m, l, *scores, + the in-flight scores with inflight_key) from q
  rows packed by `_q_rows` for `layout`; inflight_tile: (k_new, v_new, bias) for
  `_cache_partials` (the caller checked `in_kernel_tile`)."""
  segments, rows_out, rows_score, ws = layout
  b, hkv = k_cache.shape[0], k_cache.shape[1]
  if block_tables.shape[2] == 0:              # one (never used) entry for the loads, no blocks
    block_tables = jnp.zeros((b, hkv, 1), jnp.int32)
    num_blocks = jnp.zeros((b, hkv), jnp.int32)
  # The kernel clips the entries, counts and lengths itself: no XLA op per call for that.
  return tuple(_cache_partials(
      q_rows, k_cache, v_cache,
      int32_clipped(block_tables, k_cache.shape[2] // block_size - 1, kernel_clips=True),
      int32_clipped(num_blocks, block_tables.shape[2], kernel_clips=True),
      int32_clipped(lengths, k_cache.shape[2], kernel_clips=True), segments=segments,
      rows_out=rows_out, block_size=block_size, cfg=config, score_rows=rows_score, ws=ws,
      inflight_key=inflight_key, inflight_tile=inflight_tile, interpret=interpret))


def _read_counts(block_tables, num_blocks, lengths, *, block_size: int, capacity: int):
  """How often a listed-segment query reads each cache slot: [B, Hkv, S] int32 (the number of
  entries i < num_blocks[b, h] naming the slot's block; 0 for slots >= lengths[b])."""
  table_len = block_tables.shape[2]
  n_cache_blocks = capacity // block_size
  tables = int32_clipped(block_tables, n_cache_blocks - 1)                      # [B, Hkv, NB]
  counts = int32_clipped(num_blocks, table_len)                                 # [B, Hkv]
  listed = jnp.arange(table_len) < counts[..., None]                            # [B, Hkv, NB]
  hits = (tables[..., None] == jnp.arange(n_cache_blocks)) & listed[..., None]  # [.., NB, S/bs]
  per_block = hits.sum(2, dtype=jnp.int32)                                      # [B, Hkv, S/bs]
  per_slot = jnp.repeat(per_block, block_size, axis=2)                          # [B, Hkv, S]
  return jnp.where(jnp.arange(capacity) < lengths[:, None, None], per_slot, 0)


@normalised(score_queries=static_ints, interpret=interpret_mode)
@functools.partial(jax.jit, static_argnames=("block_size", "sparse_queries", "return_lse",
                                             "score_queries", "config", "interpret"))
def sparse_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     block_tables: jax.Array, num_blocks: jax.Array, lengths: jax.Array,
                     k_new: jax.Array, v_new: jax.Array, inflight_mask: jax.Array, *,
                     block_size: int, sparse_queries: int | None = None,
                     return_lse: bool = False, score_queries: tuple[int, ...] = (),
                     config: SparseConfig = SparseConfig(), interpret: Any = None):
  """Block-list decode attention plus in-flight tokens (see the module docstring).

  q [B, Tq, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; block_tables [B, Hkv, NB] int32;
  num_blocks [B, Hkv] int32; lengths [B] int32; k_new, v_new [B, Tq, Hkv, D];
  inflight_mask [Tq, Tq] bool. Queries [0, sparse_queries) read the listed blocks, the rest the
  full cache. Returns out [B, Tq, Hq, D] (q's dtype), then with return_lse lse [B, Tq, Hq] fp32,
  then with score_queries (distinct query indices, static; any sequence of ints) probs
  [B, len(score_queries), Hq, S] fp32: those queries' final softmax weights on the cache slots
  (0 on the slots they do not read). `interpret=plgpu.InterpretGPUParams()` (or True) runs the
  kernel in the Mosaic GPU interpreter (CPU); None or False compile it.
  """
  tq, hq = q.shape[1:3]
  capacity = k_cache.shape[2]
  sparse_queries = tq if sparse_queries is None else sparse_queries
  _check_inputs(q, k_cache, v_cache, block_tables, num_blocks, lengths, k_new, v_new,
                inflight_mask, block_size, sparse_queries, config)
  # A numpy integer sparse_queries reached the kernel's grid (a bare AssertionError in Pallas).
  block_size, sparse_queries = int(block_size), int(sparse_queries)
  group = hq // k_cache.shape[1]
  sel = check_score_queries(score_queries, tq, group)
  mask = inflight_mask.astype(bool)
  # Within each segment its selected queries go first (their rows lead the segment's first q
  # block); q and the in-flight mask's rows follow that order, out and lse are put back below.
  sel_list = tuple(t for t in sel if t < sparse_queries)
  sel_full = tuple(t for t in sel if t >= sparse_queries)
  order = (selected_first(sel_list, range(sparse_queries))
           + selected_first(sel_full, range(sparse_queries, tq)))
  q, mask = permute_queries(order, q, mask)
  layout = _layout(q.shape, k_cache.shape, block_tables.shape[2], block_size=block_size,
                   sparse_queries=sparse_queries, config=config,
                   num_score_queries=(len(sel_list), len(sel_full)),
                   interpret=interpret is not None)
  segments = layout[0]
  # At 2 <= Tq with one segment of one q block the cache kernel attends to the in-flight keys.
  tiled = in_kernel_tile(config, q, k_new, v_new, layout, block_size)
  use_kernel = inflight_choice(config.inflight, tq) and not tiled
  # At Tq = 1 the cache kernel computes q . k_new itself (plain blocks; see combine_partials).
  keyed = (in_kernel_score(config.inflight, q, k_new) and not layout[3]
           and all(seg.q_blocks == 1 for seg in segments))
  q_rows = _q_rows(q, segments, k_cache.shape[1], whole_blocks=use_kernel)
  acc, m2, l, *scores = _rows_partials(
      q_rows, k_cache, v_cache, block_tables, num_blocks, lengths, layout,
      block_size=block_size, config=config, interpret=interpret,
      inflight_key=inflight_key_rows(k_new) if keyed else None,
      inflight_tile=((heads_merged(k_new), heads_merged(v_new),
                      inflight_tile_bias(mask, group)) if tiled else None))
  given = scores.pop() if keyed else None
  launch_blocks = q_rows.shape[0] * q_rows.shape[1] * q_rows.shape[2] // BLOCK_M
  d_chunks = merge_chunks(launch_blocks, q.shape[3], group, q.dtype.itemsize)
  merged = use_kernel and inflight_merges(
      config.inflight, tq, max(seg.num_splits for seg in segments), launch_blocks, group,
      d_chunks > 1)
  if use_kernel:                   # the in-flight part of every q block, one launch
    inflight = (q_rows, pack_keys(k_new).astype(q.dtype), pack_keys(v_new).astype(q.dtype),
                mask_bias(mask, _row_queries(segments, group)))
  if merged:                       # ... which also merges the splits and writes the output
    plan = tuple(MergeSegment(seg.first_qblock, seg.q_blocks, seg.first_work, seg.num_splits,
                              seg.first_query, seg.num_queries) for seg in segments)
    out, lse = inflight_merged(*inflight, acc, m2, l, segments=plan, group=group,
                               d_chunks=d_chunks, interpret=interpret)
  elif use_kernel:
    extra = inflight_partials(*inflight, rows_out=acc.shape[3], interpret=interpret)
  outs, lses, probs = [], [], []
  for seg in segments:
    queries = slice(seg.first_query, seg.first_query + seg.num_queries)
    if merged:
      lse_s = lse[:, queries]
    else:
      # This segment's work items [B, Hkv, W_seg, ...] -> [B, Hkv, NQB, NS, ...].
      acc_s, m2_s, l_s = (
          x[:, :, seg.first_work:seg.first_work + seg.num_work].reshape(
              *x.shape[:2], seg.q_blocks, seg.num_splits, *x.shape[3:])
          for x in (acc, m2, l))
      if use_kernel:
        blocks = slice(seg.first_qblock, seg.first_qblock + seg.q_blocks)
        out_s, lse_s = combine_partials(acc_s, m2_s, l_s, q[:, queries], [], group=group,
                                        extra=tuple(x[:, :, blocks] for x in extra))
      elif tiled:                  # the partials cover the in-flight keys
        out_s, lse_s = combine_partials(acc_s, m2_s, l_s, q[:, queries], [], group=group)
      else:
        out_s, lse_s = combine_partials(acc_s, m2_s, l_s, q[:, queries],
                                        [(k_new, v_new, mask[queries][None])], group=group,
                                        given_scores=given)
      outs.append(out_s.astype(q.dtype))           # concatenated in q's dtype: half the bytes
      lses.append(lse_s)
    if seg.score_slot >= 0:
      lengths_c = int32_clipped(lengths, capacity)
      if seg.full:
        reads = (jnp.arange(capacity) < lengths_c[:, None])[:, None]              # [B, 1, S]
      else:
        reads = _read_counts(block_tables, num_blocks, lengths_c, block_size=block_size,
                             capacity=capacity)                                 # [B, Hkv, S]
      n_sel = len(sel_full if seg.full else sel_list)
      probs.append(scores_to_probs(scores[0][:, :, seg.score_slot], lse_s[:, :n_sel], reads,
                                   group=group))                          # [B, n_sel, Hq, S]
  if not merged:
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses, axis=1) if len(lses) > 1 else lses[0]
  probs = jnp.concatenate(probs, axis=1) if len(probs) > 1 else (probs[0] if probs else None)
  computed = sel_list + sel_full                   # the segments' order -> score_queries order
  if probs is not None and computed != sel:
    probs = probs[:, np.array([computed.index(t) for t in sel])]
  return wrapper_outputs(out, lse, probs, order, return_lse=return_lse)


# ----------------------------------------------------------------------------------------------
# Reference (pure jnp): gather the listed blocks, mask, two-part softmax.
# ----------------------------------------------------------------------------------------------

def _gathered_attention(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new,
                        inflight_mask, block_size, score_queries=()):
  """q [B, T, Hq, D]; tables [B, Hkv, NB] (clipped ids); counts [B, Hkv]; inflight_mask [T, U];
  score_queries: indices into T. Returns out [B, T, Hq, D] fp32, lse [B, T, Hq] fp32 and probs
  [B, len(score_queries), Hq, S] fp32 (the softmax weights scattered back onto the slots)."""
  b, t, hq, d = q.shape
  hkv, capacity = k_cache.shape[1], k_cache.shape[2]
  table_len = tables.shape[2]
  blocks = lambda x: x.reshape(b, hkv, capacity // block_size, block_size, d)
  gather = lambda x: jnp.take_along_axis(blocks(x), tables[..., None, None], axis=2).reshape(
      b, hkv, table_len * block_size, d)                                   # [B, Hkv, L, D]
  k_sel, v_sel = gather(k_cache), gather(v_cache)
  slots = (tables[..., None] * block_size + jnp.arange(block_size)).reshape(b, hkv, -1)
  listed = jnp.repeat(jnp.arange(table_len)[None, None] < counts[..., None], block_size, axis=2)
  cache_mask = listed & (slots < lengths[:, None, None])                   # [B, Hkv, L]

  qg = q.reshape(b, t, hkv, hq // hkv, d)                                  # [B, T, Hkv, G, D]
  scale = d ** -0.5
  s_c = f32_einsum("bthgd,bhld->bhgtl", qg, k_sel) * scale                # [B, Hkv, G, T, L]
  s_n = f32_einsum("bthgd,buhd->bhgtu", qg, k_new) * scale                # [B, Hkv, G, T, U]
  s_c = jnp.where(cache_mask[:, :, None, None], s_c, -jnp.inf)
  s_n = jnp.where(inflight_mask[None, None, None], s_n, -jnp.inf)
  m = jnp.maximum(s_c.max(-1, initial=-jnp.inf), s_n.max(-1))              # [B, Hkv, G, T]
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p_c = jnp.exp(s_c - m[..., None])
  p_n = jnp.exp(s_n - m[..., None])
  denom = p_c.sum(-1) + p_n.sum(-1)                                        # [B, Hkv, G, T]
  o = (f32_einsum("bhgtl,bhld->bthgd", p_c.astype(v_sel.dtype), v_sel)
       + f32_einsum("bhgtu,buhd->bthgd", p_n.astype(v_new.dtype), v_new))   # [B, T, Hkv, G, D]
  inv = jnp.where(denom > 0, 1.0 / denom, 0.0)                             # [B, Hkv, G, T]
  out = (o * inv.transpose(0, 3, 1, 2)[..., None]).reshape(b, t, hq, d)
  lse = (m + jnp.log(denom)).transpose(0, 3, 1, 2).reshape(b, t, hq)
  if not score_queries:
    return out, lse, None
  sel = np.array(score_queries, np.int32)
  p_sel = (p_c * inv[..., None])[:, :, :, sel]                             # [B, Hkv, G, n, L]
  # Scatter-add the gathered slots back onto the cache (a block listed twice counts twice).
  scatter = lambda p, idx: jnp.zeros(p.shape[:-1] + (capacity,), p.dtype).at[..., idx].add(p)
  probs = jax.vmap(jax.vmap(scatter))(p_sel, slots)                        # [B, Hkv, G, n, S]
  probs = probs.transpose(0, 3, 1, 2, 4).reshape(b, len(sel), hq, capacity)
  return out, lse, probs


def sparse_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               block_tables: jax.Array, num_blocks: jax.Array, lengths: jax.Array,
                               k_new: jax.Array, v_new: jax.Array, inflight_mask: jax.Array, *,
                               block_size: int, sparse_queries: int | None = None,
                               return_lse: bool = False, score_queries: tuple[int, ...] = ()):
  """Pure-jnp `sparse_attention`. Shapes, semantics and outputs as there (probs straight from
  the softmax over the gathered slots). (On CPU pass fp32 arrays: XLA:CPU has no
  bf16 x bf16 -> fp32 dot.)"""
  b, tq = q.shape[:2]
  hkv, capacity = k_cache.shape[1], k_cache.shape[2]
  n_cache_blocks = capacity // block_size
  sparse_queries = tq if sparse_queries is None else sparse_queries
  lengths = int32_clipped(lengths, capacity)
  mask = inflight_mask.astype(bool)
  tables = int32_clipped(block_tables, n_cache_blocks - 1)
  counts = int32_clipped(num_blocks, block_tables.shape[2])
  full_tables = jnp.broadcast_to(jnp.arange(n_cache_blocks, dtype=jnp.int32),
                                 (b, hkv, n_cache_blocks))
  full_counts = jnp.broadcast_to(-(-lengths // block_size)[:, None], (b, hkv))
  outs, lses, probs, computed = [], [], [], []
  for start, stop, tab, cnt in ((0, sparse_queries, tables, counts),
                                (sparse_queries, tq, full_tables, full_counts)):
    if stop > start:
      local = tuple(t - start for t in score_queries if start <= t < stop)
      out, lse, p = _gathered_attention(q[:, start:stop], k_cache, v_cache, tab, cnt, lengths,
                                        k_new, v_new, mask[start:stop], block_size, local)
      outs.append(out)
      lses.append(lse)
      if local:
        probs.append(p)
        computed += [t + start for t in local]
  results = [jnp.concatenate(outs, axis=1).astype(q.dtype)]
  if return_lse:
    results.append(jnp.concatenate(lses, axis=1))
  if score_queries:
    probs = jnp.concatenate(probs, axis=1)
    results.append(probs[:, np.array([computed.index(t) for t in score_queries])])
  return results[0] if len(results) == 1 else tuple(results)
