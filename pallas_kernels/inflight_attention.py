"""The in-flight part of a decode / verification step as split partials (Mosaic GPU / Hopper).

A step's T in-flight queries attend to the committed cache (`decode_attention`,
`sparse_attention`: one partial per split) AND to the step's own T in-flight keys under an
arbitrary boolean mask (causal, n-gram columns, FAFO's subsequences, trees). This kernel computes
the second part in ONE launch, as one more partial in the cache kernels' format, so the wrapper's
merge is a plain log-sum-exp reduction (no einsum, mask or softmax ops of its own: on a 135M
model those jnp ops were ~10 launches per layer, more than the kernels they served).

Contract:

  inflight_partials(q_rows [B, Hkv, QB * 64, D], k_rows [B, Hkv, U_pad, D],
                    v_rows [B, Hkv, U_pad, D], mask: InflightMask, *, rows_out)
    -> acc [B, Hkv, QB, rows_out, D] fp32 (un-normalised), m [B, Hkv, QB, 64] fp32 (row max of
       the scaled scores in log2 units, -inf for a row that sees no key), l [B, Hkv, QB, 64] fp32

Rows are the cache kernels' q rows (row r of q block j holds query head g of query t, r = t * G +
g within its segment, zero padding to whole 64-row blocks); key u is in-flight token u (U_pad: T
rounded up to a multiple of 64, zero keys). `mask_bias` turns the [T, T] mask into an
`InflightMask`:
  bias   [QB * 64, U_pad] bf16: 0 where the row's query sees key u, -inf elsewhere (keys past T
         are -inf; padding rows see every real key: their outputs are never read);
  tiles  [QB, NT] int32: per q block the 64-key tiles any of its rows sees, those ALL its rows see
         first, then the partly seen ones (then the unseen ones, never read);
  counts [QB, 2] int32: (fully seen tiles, seen tiles) per q block.
Grid (QB, Hkv, B): one thread block per q block of one KV head. From two tiles on (T > 64) it
visits only its seen tiles (a causal mask at T = 256 leaves 40 of 64 (q block, tile) pairs,
FAFO's 8B step 41 of 90) and loads and adds a bias tile only for the partly seen ones (none for
the 24 fully seen causal pairs); a single tile is visited with its bias, no table read. K, V and
bias tiles come through a `num_stages`-deep TMA ring; QK^T and PV on wgmma, online softmax in
registers (exp2). The fp32 output tile shares the ring's SMEM (written after the loop), so two
blocks fit an SM at D = 128 (~97 KiB each).
H200, kernel device us, same run (`benchmarks/results/s28/inflight_ab_s28_h200.json`), session
27's kernel (every tile, an fp32 bias tile each, one block per SM) -> this one: causal T = 256,
B = 8 (Hkv 8, G 4, D 128): 50.4 -> 27.0; FAFO's 8B step (T = 283) 13.7 -> 9.1; Lookahead's
(T = 282) 13.8 -> 9.1; causal T = 16 / 64: 3.2 / 3.3 -> 3.1 / 3.3. Outputs identical but for
the summation order.

The merged form, `inflight_merged(q_rows, k_rows, v_rows, mask, acc, m2, l, *, segments, group)
-> out [B, T, Hq, D] (q's dtype), lse [B, T, Hq] fp32`: the same launch also takes the cache
kernel's split partials (its work items: acc [B, Hkv, W, rows_out, D], m2, l [B, Hkv, W, 64])
and finishes the call, so there is no combine. After its in-flight tiles each block fetches its
q block's partials (`segments`: which items and queries each q block's segment holds; a TMA ring
of `merge_slots` slots in the ring's SMEM), folds them in by log-sum-exp, normalises and writes
its rows: with 64 % G == 0 straight into out [B, T, Hq, D] (one [G, D] TMA per query), else in
the rows' layout [B, Hkv, QB * 64, D], which the wrapper transposes. The partials and the
combine's read of them (fp32, 32 KiB a q block and split) are not written and read again, nor is
the combine's fp32 output. `combine.inflight_merges` decides where the wrappers use it (the rule
and H200 figures there): sparse B 8 16K Tq 256 101.6 -> 82.2 us per call, FAFO's 8B call
42.2 -> 38.1 (4K). The partials are read in the WGMMA layout from SMEM tiles stored swizzled (an
unswizzled fp32 tile put a warp's 8 rows on the same banks; swizzling it made the merged kernel
6-12% faster, session 31). With few blocks the fetches queue on few SMs (B 1 decode: 8 blocks of
33 splits, ~1 MiB each), so a launch of fewer than MERGE_FILL_BLOCKS blocks splits each q
block's D columns over 2, 4 or 8 blocks (`merge_chunks`, `d_chunks`; each recomputes the q
block's scores, which is cheap, and reads and writes only its columns of V, the partials and
out). Narrower slots make a deeper ring (64 KiB: 2 slots of 128 columns, 8 of 32 or 16), a
fold step takes half the ring's partials at once (`merge_fold_width`: one rescale, the loads
independent; one partial a step cost ~0.1 us of dependent latency whatever its size), and the
q block's m and l rows come in one copy each before its partials (`merge_stat_rows`: a third of
the copies). H200, merged in-flight kernel us: B 1 16K decode Tq 16 10.8 (one block a q block)
-> 6.6 (4 chunks, 2 slots, `results/s31/inflight_chunks_s31_h200.json`) -> 5.9 (8 chunks,
8 slots, 4 a step) -> 5.2 (m and l once), SmolLM2's FAFO call 8.1 -> 6.6 (2 chunks) -> 5.8
(4 chunks, 8 slots, 4 a step) -> 5.0 (`results/s33/inflight_{fold,stats}_s33_h200.json`).

`pack_keys` and `mask_bias` prepare the inputs; `inflight_partials_reference` (pure jnp, reading
only the bias) sits at the bottom.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels.combine import check_counts, check_mask, interpret_mode, normalised
from pallas_kernels.hopper import MAX_HEAD_DIM
from pallas_kernels.register_operand import a_staging, softmax_pv_step, swizzled

BLOCK_M = 64                      # q rows per thread block (one warpgroup's wgmma M)
BLOCK_U = 64                      # in-flight keys per tile
LOG2E = float(np.log2(np.e))
LN2 = float(np.log(2.0))


class InflightMask(NamedTuple):
  """The in-flight mask as the kernel reads it (`mask_bias`; shapes in the module docstring)."""
  bias: jax.Array      # [QB * 64, U_pad] bf16, 0 or -inf (exact in bf16)
  tiles: jax.Array     # [QB, NT] int32, fully seen tiles, then partly seen, then unseen
  counts: jax.Array    # [QB, 2] int32, (fully seen, seen)


def padded_keys(num_keys: int) -> int:
  """U_pad: the in-flight key count rounded up to whole tiles."""
  return max(1, -(-num_keys // BLOCK_U)) * BLOCK_U


def pack_keys(x: jax.Array) -> jax.Array:
  """In-flight K or V [B, T, Hkv, D] -> [B, Hkv, U_pad, D] (zero keys past T)."""
  t = x.shape[1]
  x = x.transpose(0, 2, 1, 3)
  return jnp.pad(x, ((0, 0), (0, 0), (0, padded_keys(t) - t), (0, 0)))


def tile_lists(bias: jax.Array) -> tuple[jax.Array, jax.Array]:
  """bias [QB * 64, U_pad] -> (tiles [QB, NT] int32, counts [QB, 2] int32), as `InflightMask`."""
  rows, u_pad = bias.shape
  seen = (bias == 0).reshape(rows // BLOCK_M, BLOCK_M, u_pad // BLOCK_U, BLOCK_U)
  any_seen = seen.any(axis=(1, 3))                                          # [QB, NT]
  all_seen = seen.all(axis=(1, 3))                                          # [QB, NT]
  kind = jnp.where(all_seen, 0, jnp.where(any_seen, 1, 2)).astype(jnp.int32)
  tiles = jnp.argsort(kind, axis=1, stable=True).astype(jnp.int32)
  counts = jnp.stack([all_seen.sum(1), any_seen.sum(1)], axis=1).astype(jnp.int32)
  return tiles, counts


def mask_bias(mask: jax.Array, row_query: np.ndarray) -> InflightMask:
  """mask [T, U] bool (query t sees in-flight key u); row_query [R] static ints, the query each
  kernel row holds (-1: a padding row, which sees every key < U). Returns the `InflightMask`."""
  check_mask("mask [T, U]", mask)
  if mask.ndim != 2:
    raise ValueError(f"mask must be [T, U], got shape {tuple(mask.shape)}")
  row_query = np.asarray(row_query)
  if (row_query.ndim != 1 or not row_query.size or row_query.size % BLOCK_M
      or not np.issubdtype(row_query.dtype, np.integer)
      or not np.all((-1 <= row_query) & (row_query < mask.shape[0]))):
    # A query >= T read query T - 1's row (jnp's clamped gather), one < -1 was padding: silent;
    # R not whole q blocks was a reshape TypeError.
    raise ValueError(f"row_query must be [R] ints in [-1, T={mask.shape[0]}) with R a positive "
                     f"multiple of {BLOCK_M} (whole q blocks), got {row_query.dtype}"
                     f"{list(row_query.shape)}")
  u = mask.shape[1]
  rows = jnp.asarray(mask, bool)[np.maximum(row_query, 0)]                  # [R, U]
  rows = rows | jnp.asarray(row_query < 0)[:, None]
  bias = jnp.where(rows, 0.0, -jnp.inf).astype(jnp.bfloat16)
  bias = jnp.pad(bias, ((0, 0), (0, padded_keys(u) - u)), constant_values=-jnp.inf)
  return InflightMask(bias, *tile_lists(bias))


@normalised(interpret=interpret_mode)
@functools.partial(jax.jit, static_argnames=("rows_out", "num_stages", "interpret"))
def inflight_partials(q_rows: jax.Array, k_rows: jax.Array, v_rows: jax.Array,
                      mask: InflightMask, *, rows_out: int, num_stages: int = 2,
                      interpret: Any = None):
  """See the module docstring. q_rows [B, Hkv, QB * 64, D] bf16/fp16; k_rows, v_rows
  [B, Hkv, U_pad, D] (q's dtype); mask from `mask_bias` (bias [QB * 64, U_pad], 0 / -inf)."""
  _check_args(q_rows, k_rows, v_rows, mask)
  _check_rows_out(rows_out)
  check_counts(num_stages=num_stages)
  return _inflight_kernel(q_rows, k_rows, v_rows, mask, rows_out=int(rows_out),
                          num_stages=int(num_stages), interpret=interpret)


def _check_rows_out(rows_out):
  if not 0 < rows_out <= BLOCK_M or rows_out % 8:
    raise ValueError(f"rows_out must be a multiple of 8 in (0, 64], got {rows_out}")


def _check_args(q_rows, k_rows, v_rows, mask):
  if not isinstance(mask, InflightMask):
    raise ValueError(f"mask must be an InflightMask (`mask_bias(mask [T, U] bool, row_query)`), "
                     f"got {type(mask).__name__}")
  if q_rows.ndim != 4 or k_rows.ndim != 4:
    raise ValueError(f"q_rows [B, Hkv, QB * 64, D] and k_rows [B, Hkv, U_pad, D] must be 4-D, got "
                     f"{q_rows.shape} and {k_rows.shape}")
  if jnp.dtype(q_rows.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"q_rows must be bfloat16 or float16, got {q_rows.dtype}")
  if k_rows.dtype != q_rows.dtype or v_rows.dtype != q_rows.dtype:
    raise ValueError(f"k_rows and v_rows must be in q_rows' dtype {q_rows.dtype}, got "
                     f"{k_rows.dtype} and {v_rows.dtype}")
  batch, num_kv_heads, m_total, head_dim = q_rows.shape
  if head_dim % 64 or not 0 < head_dim <= MAX_HEAD_DIM:
    # D = 96 was a bare AssertionError (SMEM tiling); D = 320 passed, past the wgmma's N <= 256.
    raise ValueError(f"head dim D={head_dim} must be a multiple of 64 in [64, {MAX_HEAD_DIM}]")
  u_pad = k_rows.shape[2]
  bias, tiles, counts = mask
  if m_total % BLOCK_M or u_pad % BLOCK_U or u_pad == 0:
    raise ValueError(f"q rows {m_total} and keys {u_pad} must be positive multiples of "
                     f"{BLOCK_M} / {BLOCK_U}")
  if k_rows.shape != (batch, num_kv_heads, u_pad, head_dim) or v_rows.shape != k_rows.shape:
    raise ValueError(f"k_rows / v_rows must be [B, Hkv, U_pad, D] = "
                     f"{(batch, num_kv_heads, u_pad, head_dim)}, got {k_rows.shape}, "
                     f"{v_rows.shape}")
  if bias.shape != (m_total, u_pad):
    raise ValueError(f"bias must be [QB * 64, U_pad] = {(m_total, u_pad)}, got {bias.shape}")
  if bias.dtype != jnp.bfloat16 or tiles.dtype != jnp.int32 or counts.dtype != jnp.int32:
    raise ValueError(f"mask bias, tiles and counts must be bfloat16, int32 and int32 "
                     f"(`mask_bias`), got {bias.dtype}, {tiles.dtype}, {counts.dtype}")
  q_blocks, num_tiles = m_total // BLOCK_M, u_pad // BLOCK_U
  if tiles.shape != (q_blocks, num_tiles) or counts.shape != (q_blocks, 2):
    raise ValueError(f"mask tiles / counts must be [QB, NT] = {(q_blocks, num_tiles)} / "
                     f"[QB, 2], got {tiles.shape} / {counts.shape}")


def _inflight_kernel(q_rows, k_rows, v_rows, mask, *, rows_out, num_stages, interpret,
                     merge: "_MergePlan | None" = None, partials=None):
  """The launch. merge None: the partials of the module docstring. Else (`inflight_merged`) the
  cache kernels' split partials (acc [B, Hkv, W, rows_out, D], m, l [B, Hkv, W, 64]) are merged
  in and the block writes its normalised rows: out [B, T, Hq, D] in q's dtype (merge.direct) or
  [B, Hkv, QB * 64, D], and lse [B, Hkv, QB, 64] fp32 (natural log)."""
  batch, num_kv_heads, m_total, head_dim = q_rows.shape
  u_pad = k_rows.shape[2]
  bias, tiles, counts = mask
  q_blocks = m_total // BLOCK_M
  chunks = 1 if merge is None else merge.d_chunks   # blocks per q block, each D / chunks columns
  d_out = head_dim // chunks                          # the columns of V, acc and out a block owns
  num_tiles = u_pad // BLOCK_U
  stages = max(1, min(num_stages, num_tiles))
  listed = num_tiles > 1           # a single tile: visited with its bias, no table read
  dtype = q_rows.dtype
  scale = head_dim ** -0.5 * LOG2E

  def body(tiles_ref,       # [QB, NT] int32                            GMEM
           counts_ref,      # [QB, 2] int32                             GMEM
           q_ref,           # [B, Hkv, QB * 64, D]                      GMEM
           k_ref,           # [B, Hkv, U_pad, D]                        GMEM
           v_ref,           # [B, Hkv, U_pad, D]                        GMEM
           bias_ref,        # [QB * 64, U_pad] bf16                     GMEM
           outs,            # partials: acc [B, Hkv, QB, rows_out, D] fp32, m, l [B, Hkv, QB, 64]
                            # merged: (acc, m, l) items in, out and lse out (`_merge_epilogue`)
           q_smem,          # [64, D]                                   SMEM (tiled, swizzled)
           k_smem,          # [stages, 64, D]                           SMEM (tiled, swizzled)
           v_smem,          # [stages, 64, D / chunks]                  SMEM (tiled, swizzled)
           b_smem,          # [stages, 64, 64] bf16                     SMEM (union: ring)
           epilogue_smem,   # partials: o [64, D] fp32; merged: `_merge_scratch`  (union: output)
           m_smem,          # [64] fp32                                 SMEM
           l_smem,          # [64] fp32                                 SMEM
           q_barrier, k_barriers, b_barriers, v_barriers,
           *merge_barriers,  # merged only: [slots] barriers (+ the stats' barrier, stat_rows)
           a_smem=None):    # [64, 64] (interpret mode only)            SMEM (tiled, swizzled)
    qb = lax.axis_index("qblock")
    chunk = None
    if chunks > 1:                                 # chunk-minor: a q block's chunks run together
      qb, chunk = lax.div(qb, jnp.int32(chunks)), lax.rem(qb, jnp.int32(chunks))
    h = lax.axis_index("head")
    b = lax.axis_index("batch")
    if listed:
      num_full = jnp.clip(counts_ref[qb, 0], 0, num_tiles)    # tiles without a bias
      num_seen = jnp.clip(counts_ref[qb, 1], num_full, num_tiles)
    else:
      num_full, num_seen = jnp.int32(0), jnp.int32(1)

    def fetch(step, slot):
      """The ring's loads of visit `step`: its tile's K and V, and its bias if partly seen."""
      tile = jnp.clip(tiles_ref[qb, step], 0, num_tiles - 1) if listed else jnp.int32(0)
      keys = pl.ds(tile * BLOCK_U, BLOCK_U)
      plgpu.copy_gmem_to_smem(k_ref.at[b, h, keys], k_smem.at[slot], k_barriers.at[slot])
      @pl.when(step >= num_full)
      def _():
        plgpu.copy_gmem_to_smem(bias_ref.at[pl.ds(qb * BLOCK_M, BLOCK_M), keys],
                                b_smem.at[slot], b_barriers.at[slot])
      v_src = v_ref.at[b, h, keys] if chunk is None else v_ref.at[b, h, keys, pl.ds(chunk * d_out,
                                                                                 d_out)]
      plgpu.copy_gmem_to_smem(v_src, v_smem.at[slot], v_barriers.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(qb * BLOCK_M, BLOCK_M)], q_smem, q_barrier)
    for step in range(stages):                     # prologue: fill the ring
      pl.when(step < num_seen)(functools.partial(fetch, step, step))
    plgpu.barrier_wait(q_barrier)

    acc = plgpu.layout_cast(jnp.zeros((BLOCK_M, d_out), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))

    def visit(step, carry, partly_seen):
      acc, m_i, l_i = carry
      slot = lax.rem(step, jnp.int32(stages))
      plgpu.barrier_wait(k_barriers.at[slot])
      def qk_scope(s_ref):                         # [64, 64] fp32 accumulator
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        return s_ref[...]
      s = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_M, BLOCK_U), jnp.float32)) * scale
      if partly_seen:
        plgpu.barrier_wait(b_barriers.at[slot])
        bias = plgpu.load(b_smem.at[slot], layout=plgpu.Layout.WGMMA, optimized=False)
        s = s + bias.astype(jnp.float32)

      # A row may see no key of this tile (or none at all): `empty_rows`. acc [64, D / chunks].
      acc, m_new, l_i = softmax_pv_step(s, (acc, m_i, l_i), v_smem.at[slot], dtype=dtype,
                                        a_smem=a_smem, v_barrier=v_barriers.at[slot],
                                        empty_rows=partly_seen)

      nxt = step + stages
      pl.when(nxt < num_seen)(lambda: fetch(nxt, slot))
      return acc, m_new, l_i

    # Fully seen tiles first (every row sees a key there, so the max is finite from the first
    # one on), then the partly seen ones with their bias.
    carry = (acc, m_i, l_i)
    if listed:
      carry = lax.fori_loop(0, num_full, functools.partial(visit, partly_seen=False), carry)
    acc, m_i, l_i = lax.fori_loop(num_full, num_seen, functools.partial(visit, partly_seen=True),
                                  carry)
    # Every fetch issued was waited for and every wgmma on the ring is done: o_smem, the ring's
    # union partner, may be written.

    if merge is not None:
      _merge_epilogue(merge, outs, epilogue_smem, merge_barriers, acc, m_i, l_i, b, h, qb, chunk,
                      rows_out=rows_out, dtype=dtype)
      return
    acc_out_ref, m_out_ref, l_out_ref = outs
    o_smem = epilogue_smem
    o_smem[...] = acc
    m_smem[...] = m_i
    l_smem[...] = l_i
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_out)], acc_out_ref.at[b, h, qb])
    plgpu.copy_smem_to_gmem(m_smem, m_out_ref.at[b, h, qb])
    plgpu.copy_smem_to_gmem(l_smem, l_out_ref.at[b, h, qb])
    plgpu.wait_smem_to_gmem(0)

  operand_layout = _swizzled_rows(BLOCK_U, dtype)   # q, K and the staged P: 64-column rows
  ring = (plgpu.SMEM((stages, BLOCK_U, head_dim), dtype, **operand_layout),
          plgpu.SMEM((stages, BLOCK_U, d_out), dtype, **_swizzled_rows(d_out, dtype)),
          plgpu.SMEM((stages, BLOCK_M, BLOCK_U), jnp.bfloat16))
  epilogue = (plgpu.SMEM((BLOCK_M, head_dim), jnp.float32) if merge is None
              else _merge_scratch(d_out, dtype, merge.stat_rows))
  scratch = [
      plgpu.SMEM((BLOCK_M, head_dim), dtype, **operand_layout),
      plgpu.RefUnion(ring, epilogue),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.Barrier(),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
  ]
  if merge is not None:
    # Per ring slot: a partial's acc (and its m and l, unless they come once for the q block:
    # one more barrier for those two copies).
    once = merge.stat_rows > 0
    scratch.append(plgpu.Barrier(num_arrivals=1 if once else 3, num_barriers=merge_slots(d_out)))
    if once:
      scratch.append(plgpu.Barrier(num_arrivals=2))
  part = (batch, num_kv_heads, q_blocks)
  if merge is None:
    out_type = (jax.ShapeDtypeStruct((*part, rows_out, head_dim), jnp.float32),
                jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32),
                jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32))
    inputs = ()
  else:
    out_shape = ((batch, merge.num_queries, num_kv_heads * merge.group, head_dim) if merge.direct
                 else (batch, num_kv_heads, m_total, head_dim))
    out_type = (jax.ShapeDtypeStruct(out_shape, dtype),
                jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32))
    inputs = tuple(partials)

  def inflight_attention_kernel(tiles_ref, counts_ref, q_ref, k_ref, v_ref, bias_ref, *refs):
    def scoped(q_smem, union, *refs_smem, a_smem=None):
      (k_smem, v_smem, b_smem), epilogue_smem = union     # the union's two views
      body(tiles_ref, counts_ref, q_ref, k_ref, v_ref, bias_ref, refs, q_smem,
           k_smem, v_smem, b_smem, epilogue_smem, *refs_smem, a_smem=a_smem)
    pl.run_scoped(scoped, *scratch,
                  **a_staging((BLOCK_M, BLOCK_U), dtype, interpret, **operand_layout))

  return plgpu.kernel(
      inflight_attention_kernel,
      out_type=out_type,
      grid=(q_blocks * chunks, num_kv_heads, batch),
      grid_names=("qblock", "head", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(tiles.astype(jnp.int32), counts.astype(jnp.int32), q_rows, k_rows, v_rows,
    bias.astype(jnp.bfloat16), *inputs)


# ----------------------------------------------------------------------------------------------
# The merged form: the cache kernels' split partials folded in, the call's output written.
# ----------------------------------------------------------------------------------------------

class MergeSegment(NamedTuple):
  """Where one query segment of a cache kernel's call lives (all static)."""
  first_qblock: int    # its q blocks in the in-flight kernel's q-block axis
  q_blocks: int
  first_item: int      # its split partials: item first_item + j * num_splits + s (q block j)
  num_splits: int
  first_query: int     # its queries in out's T axis (row r = t * G + g of its q blocks)
  num_queries: int


class _MergePlan(NamedTuple):
  segments: tuple[MergeSegment, ...]
  group: int           # G query heads per KV head
  num_queries: int     # T
  direct: bool         # out written as [B, T, Hq, D] (64 % G == 0), else in the rows' layout
  d_chunks: int        # blocks per q block, each merging and writing D / d_chunks columns
  stat_rows: int       # m / l rows a block fetches at once (`merge_stat_rows`), 0: per partial


def _swizzled_rows(columns: int, dtype) -> dict:
  """`swizzled` for a [rows, columns] tile: the widest swizzle (<= 128 bytes) its rows fill
  (columns * itemsize is 32 or 64 bytes or a multiple of 128 here: D / chunks >= 16)."""
  itemsize = jnp.dtype(dtype).itemsize
  return swizzled(min(128, columns * itemsize), 8 * itemsize)


def merge_slots(d_out: int) -> int:
  """Depth of the merge's TMA ring of split partials for a block owning d_out columns: as many
  [64, d_out] fp32 slots as MERGE_RING_BYTES hold, 2 to MERGE_MAX_SLOTS. A fold step is short, so
  with narrow chunks the ring's depth (the fetches in flight) sets the fold rate."""
  return max(2, min(MERGE_MAX_SLOTS, MERGE_RING_BYTES // (BLOCK_M * d_out * 4)))


def merge_fold_width(slots: int) -> int:
  """Partials folded per step of the merge: half the ring (so the next group's fetches are in
  flight while one is folded), at most MERGE_FOLD_WIDTH."""
  return max(1, min(MERGE_FOLD_WIDTH, slots // 2))


def merge_stat_rows(segments) -> int:
  """Rows of m and l a merged block fetches at once, in one copy each before its partials: the
  most splits of any segment (a q block's items are consecutive), or 0 (each partial's m and l
  come with its acc) when MERGE_STATS_ONCE is off or that exceeds MERGE_STATS_MAX_ROWS (64 KiB
  of SMEM for the two; B 1 decode at Tq 16 has 33 splits a q block)."""
  rows = max(seg.num_splits for seg in segments)
  return rows if MERGE_STATS_ONCE and 0 < rows <= MERGE_STATS_MAX_ROWS else 0


def _merge_scratch(d_out, dtype, stat_rows):
  """The epilogue's SMEM (the ring's union partner): `merge_slots` slots of a split partial
  (acc fp32, swizzled: the fold reads it in the WGMMA layout), m and l (per slot, or
  `stat_rows` rows for all the q block's partials), the output tile in q's dtype and the lse row.
  d_out: the block's columns."""
  slots = merge_slots(d_out)
  stats = stat_rows or slots
  return (plgpu.SMEM((slots, BLOCK_M, d_out), jnp.float32, **_swizzled_rows(d_out, jnp.float32)),
          plgpu.SMEM((stats, BLOCK_M), jnp.float32),
          plgpu.SMEM((stats, BLOCK_M), jnp.float32),
          plgpu.SMEM((BLOCK_M, d_out), dtype),
          plgpu.SMEM((BLOCK_M,), jnp.float32))


def _merge_epilogue(plan: _MergePlan, refs, scratch, barriers, acc, m_i, l_i, b, h, qb, chunk,
                    *, rows_out, dtype):
  """Folds the block's split partials (a `merge_slots`-deep TMA ring) into its in-flight part (acc
  [64, D / chunks]: columns chunk * D / chunks on, all of them when chunk is None; m_i, l_i [64],
  log2 units), normalises and writes its columns of out (and, chunk 0 or None, lse)."""
  acc_ref, m_ref, l_ref, out_ref, lse_ref = refs
  pa_smem, pm_smem, pl_smem, out_smem, lse_smem = scratch
  barriers, *stats_barrier = barriers             # the stats' barrier only with stat_rows
  stat_rows = plan.stat_rows
  row = plgpu.Layout.WGMMA.reduce(1)
  # This q block's segment (static ranges; at most a few segments).
  first_item, n_items = jnp.int32(0), jnp.int32(0)
  token0, seg_end = jnp.int32(0), jnp.int32(0)
  per_block = BLOCK_M // plan.group if plan.direct else 0
  for seg in plan.segments:
    inside = (qb >= seg.first_qblock) & (qb < seg.first_qblock + seg.q_blocks)
    local = qb - seg.first_qblock
    first_item = jnp.where(inside, seg.first_item + local * seg.num_splits, first_item)
    n_items = jnp.where(inside, seg.num_splits, n_items)
    token0 = jnp.where(inside, seg.first_query + local * per_block, token0)
    seg_end = jnp.where(inside, seg.first_query + seg.num_queries, seg_end)

  d_out = acc.shape[1]
  cols = ((lambda ref: ref) if chunk is None                     # [rows, D] -> the block's columns
          else (lambda ref: ref.at[:, pl.ds(chunk * d_out, d_out)]))

  if stat_rows:
    # m and l of the q block's items, one box each: stat_rows rows from `stat_start`, inside W
    # (a segment with fewer splits reads some of the next q block's rows, never used).
    stat_start = jnp.minimum(first_item, m_ref.shape[2] - stat_rows)
    stat_offset = first_item - stat_start
    for ref, smem in ((m_ref, pm_smem), (l_ref, pl_smem)):
      plgpu.copy_gmem_to_smem(ref.at[b, h, pl.ds(stat_start, stat_rows)], smem, *stats_barrier)

  def load(i, slot):
    item = first_item + i
    plgpu.copy_gmem_to_smem(cols(acc_ref.at[b, h, item]), pa_smem.at[slot, pl.ds(0, rows_out)],
                            barriers.at[slot])
    if not stat_rows:
      plgpu.copy_gmem_to_smem(m_ref.at[b, h, item], pm_smem.at[slot], barriers.at[slot])
      plgpu.copy_gmem_to_smem(l_ref.at[b, h, item], pl_smem.at[slot], barriers.at[slot])

  slots = pa_smem.shape[0]
  for slot in range(slots):
    pl.when(slot < n_items)(functools.partial(load, slot, slot))

  def fold(first, width, carry):
    """Folds partials first .. first + width - 1 (width static): their loads are independent,
    so one step waits on, rescales by and refills `width` slots at once."""
    acc, m_i, l_i = carry
    items = []
    for j in range(width):
      slot = lax.rem(first + j, jnp.int32(slots))
      stat = stat_offset + first + j if stat_rows else slot
      plgpu.barrier_wait(barriers.at[slot])
      items.append((plgpu.load(pa_smem.at[slot], layout=plgpu.Layout.WGMMA),
                    plgpu.load(pm_smem.at[stat], layout=row, optimized=False),
                    plgpu.load(pl_smem.at[stat], layout=row, optimized=False)))
    m_new = functools.reduce(jnp.maximum, [m_s for _, m_s, _ in items], m_i)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # a row seeing nothing yet stays at 0
    alpha = jnp.exp2(m_i - m_use)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    l_i = l_i * alpha
    for part, m_s, l_s in items:
      beta = jnp.exp2(m_s - m_use)
      # Rows >= rows_out of a slot were never written: padding rows, whose outputs are not read.
      acc = acc + part * lax.broadcast_in_dim(beta, acc.shape, [0])
      l_i = l_i + l_s * beta
    for j in range(width):
      i = first + j
      refill = functools.partial(lambda i, slot: load(i + slots, slot), i,
                                 lax.rem(i, jnp.int32(slots)))
      pl.when(i + slots < n_items)(refill)
    return acc, m_new, l_i

  width = merge_fold_width(slots)
  carry = (acc, m_i, l_i)
  if stat_rows:
    plgpu.barrier_wait(*stats_barrier)
  if width > 1:
    groups = lax.div(n_items, jnp.int32(width))
    carry = lax.fori_loop(0, groups, lambda g, c: fold(g * width, width, c), carry)
    start = groups * width
  else:
    start = jnp.int32(0)
  acc, m_i, l_i = lax.fori_loop(start, n_items, lambda i, c: fold(i, 1, c), carry)
  seen = l_i > 0
  inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
  out_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
  m_use = jnp.where(m_i == -jnp.inf, 0.0, m_i)
  lse_smem[...] = jnp.where(seen, (m_use + jnp.log2(jnp.where(seen, l_i, 1.0))) * LN2,
                            -jnp.inf)
  plgpu.commit_smem()
  if plan.direct:
    g = plan.group
    for i in range(per_block):                     # one [G, D] box per query of the block
      token = token0 + i
      @pl.when(token < seg_end)
      def _():
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(i * g, g)],
                                cols(out_ref.at[b, token, pl.ds(h * g, g)]))
  else:
    plgpu.copy_smem_to_gmem(out_smem, cols(out_ref.at[b, h, pl.ds(qb * BLOCK_M, BLOCK_M)]))
  if chunk is None:
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, qb])
  else:
    pl.when(chunk == 0)(lambda: plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, qb]))
  plgpu.wait_smem_to_gmem(0)


MERGE_FILL_BLOCKS = 128   # merged launches with fewer blocks split D over up to 8 blocks a q block
MERGE_MAX_CHUNKS = 8      # blocks per q block at most
MERGE_MIN_COLUMNS = 16    # columns a block at least (a 64-byte fp32 row, wgmma N = 16)
MERGE_RING_BYTES = 64 * 1024   # the merge ring's partial slots (`merge_slots`)
MERGE_MAX_SLOTS = 8
MERGE_FOLD_WIDTH = 4      # partials folded per step at most (`merge_fold_width`)
MERGE_STATS_ONCE = 1      # a block's m and l in one copy each (`merge_stat_rows`)
MERGE_STATS_MAX_ROWS = 128


def _chunk_counts() -> tuple[int, ...]:
  """The chunk counts a merged launch may use: the powers of two up to MERGE_MAX_CHUNKS."""
  return tuple(1 << i for i in range(MERGE_MAX_CHUNKS.bit_length()) if 1 << i <= MERGE_MAX_CHUNKS)


def chunks_fit(chunks: int, head_dim: int, group: int, itemsize: int) -> bool:
  """Whether a merged launch can split D over `chunks` blocks: a power of two up to
  MERGE_MAX_CHUNKS with >= MERGE_MIN_COLUMNS columns a block and, with the direct output write,
  each query's [G, D / chunks] box starting 128-byte aligned in SMEM (a TMA's requirement: G = 1
  at D = 64 in 2 chunks is 64 bytes and faults)."""
  direct = BLOCK_M % group == 0
  return (chunks in _chunk_counts()
          and head_dim % (MERGE_MIN_COLUMNS * chunks) == 0
          and (not direct or group * head_dim // chunks * itemsize % 128 == 0))


def merge_chunks(blocks: int, head_dim: int, group: int, itemsize: int = 2) -> int:
  """Blocks per q block of a merged launch of `blocks` q blocks (B * Hkv * QB): with few blocks,
  the partials' reads (32 KiB a split at D = 128) queue on few SMs, so each q block's columns are
  split over 2, 4 or 8 blocks (<= MERGE_FILL_BLOCKS blocks in all, as `chunks_fit` allows), which
  recompute its scores (cheap: T keys) and read only their columns of V and of the partials."""
  chunks = 1
  while (chunks_fit(2 * chunks, head_dim, group, itemsize)
         and blocks * chunks * 2 <= MERGE_FILL_BLOCKS):
    chunks *= 2
  return chunks


def merge_layout(segments: tuple[MergeSegment, ...], group: int, num_queries: int,
                 d_chunks: int) -> _MergePlan:
  return _MergePlan(tuple(segments), group, num_queries, BLOCK_M % group == 0, d_chunks,
                    merge_stat_rows(segments))


def _rows_to_queries(x, plan: _MergePlan):
  """[B, Hkv, QB * 64 (, D)] per-row values -> [B, T, Hq (, D)] (each segment's real rows)."""
  b, hkv = x.shape[:2]
  tail = x.shape[3:]
  g = plan.group
  pieces = []
  for seg in plan.segments:
    rows = x[:, :, seg.first_qblock * BLOCK_M:seg.first_qblock * BLOCK_M
             + seg.num_queries * g]                                       # [B, Hkv, n * G, ...]
    rows = rows.reshape(b, hkv, seg.num_queries, g, *tail)
    pieces.append(jnp.moveaxis(rows, 1, 2).reshape(b, seg.num_queries, hkv * g, *tail))
  return jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]


def merge_segments(segments):
  """`inflight_merged`'s static segments as a hashable tuple of MergeSegment (a list of them, or
  of 6-tuples, raised JAX's 'Non-hashable static arguments'); anything else is passed on."""
  try:
    return tuple(MergeSegment(*seg) for seg in segments)
  except TypeError:
    return segments


@normalised(segments=merge_segments, interpret=interpret_mode)
@functools.partial(jax.jit, static_argnames=("segments", "group", "num_stages", "d_chunks",
                                             "interpret"))
def inflight_merged(q_rows: jax.Array, k_rows: jax.Array, v_rows: jax.Array,
                    mask: InflightMask, acc: jax.Array, m2: jax.Array, l: jax.Array, *,
                    segments: tuple[MergeSegment, ...], group: int, num_stages: int = 2,
                    d_chunks: int | None = None, interpret: Any = None):
  """The in-flight part with the cache kernel's split partials merged in: the whole call's
  output in ONE launch after the cache kernel (no combine).

  q_rows, k_rows, v_rows, mask as `inflight_partials`; acc [B, Hkv, W, rows_out, D] fp32,
  m2, l [B, Hkv, W, 64] fp32: the cache kernel's work items (un-normalised, m2 in log2 units);
  segments: which items and queries each q block's segment holds (every q block of q_rows in
  exactly one segment; the segments' queries tile [0, T)). Returns out [B, T, Hq, D] in q's
  dtype (query t, head h * G + g: row t * G + g of its segment) and lse [B, T, Hq] fp32.
  d_chunks: blocks per q block, each merging and writing D / d_chunks (>= 16) columns (None:
  `merge_chunks`; `chunks_fit` says which are allowed)."""
  _check_args(q_rows, k_rows, v_rows, mask)
  # group 0: ZeroDivisionError; d_chunks 2.0 or np.int64(2): a bare AssertionError in the build.
  check_counts(("d_chunks",), num_stages=num_stages, group=group, d_chunks=d_chunks)
  num_stages, group = int(num_stages), int(group)
  b, hkv, m_total, d = q_rows.shape
  w, rows_out = acc.shape[2], acc.shape[3]
  if acc.shape != (b, hkv, w, rows_out, d):
    raise ValueError(f"acc must be [B, Hkv, W, rows_out, D] = {(b, hkv, w, rows_out, d)}, got "
                     f"{acc.shape}")
  _check_rows_out(rows_out)
  if any(x.dtype != jnp.float32 for x in (acc, m2, l)):
    raise ValueError(f"acc, m2 and l must be float32, got {acc.dtype}, {m2.dtype}, {l.dtype}")
  if m2.shape != (b, hkv, w, BLOCK_M) or l.shape != m2.shape:
    raise ValueError(f"m2 and l must be [B, Hkv, W, 64] = {(b, hkv, w, BLOCK_M)}, got "
                     f"{m2.shape} and {l.shape}")
  if not segments or not all(isinstance(seg, MergeSegment) for seg in segments):
    raise ValueError(f"segments must be a non-empty sequence of MergeSegment, got {segments!r}")
  num_queries = sum(seg.num_queries for seg in segments)
  covered = sorted((seg.first_qblock, seg.first_qblock + seg.q_blocks) for seg in segments)
  if (covered[0][0] != 0 or covered[-1][1] != m_total // BLOCK_M
      or any(a[1] != c[0] for a, c in zip(covered, covered[1:]))
      or any(seg.num_queries * group > seg.q_blocks * BLOCK_M
             or seg.first_item + seg.q_blocks * seg.num_splits > w for seg in segments)):
    raise ValueError(f"segments {segments} must cover the {m_total // BLOCK_M} q blocks once, "
                     f"hold their queries' rows and name items < {w}")
  itemsize = jnp.dtype(q_rows.dtype).itemsize
  if d_chunks is None:
    d_chunks = merge_chunks(b * hkv * (m_total // BLOCK_M), d, group, itemsize)
  d_chunks = int(d_chunks)
  if not chunks_fit(d_chunks, d, group, itemsize):
    raise ValueError(f"d_chunks must be one of {_chunk_counts()} with D / d_chunks a multiple "
                     f"of {MERGE_MIN_COLUMNS} and, where 64 % G == 0, G * D / d_chunks * "
                     f"itemsize a multiple of 128 bytes; got {d_chunks} at D = {d}, G = {group}")
  plan = merge_layout(segments, group, num_queries, d_chunks)
  out, lse_rows = _inflight_kernel(q_rows, k_rows, v_rows, mask, rows_out=rows_out,
                                   num_stages=num_stages, interpret=interpret, merge=plan,
                                   partials=(acc, m2, l))
  if not plan.direct:
    out = _rows_to_queries(out, plan)
  return out, _rows_to_queries(lse_rows.reshape(b, hkv, m_total), plan)


# ----------------------------------------------------------------------------------------------
# Reference (pure jnp, fp32).
# ----------------------------------------------------------------------------------------------

def inflight_partials_reference(q_rows: jax.Array, k_rows: jax.Array, v_rows: jax.Array,
                                mask: InflightMask, *, rows_out: int):
  """The kernel's partials in fp32 jnp from the mask's bias alone (its tile lists unused): same
  shapes and conventions (P rounded to the input dtype before PV, as the kernel's wgmma operand
  is)."""
  b, hkv, m_total, d = q_rows.shape
  qb = m_total // BLOCK_M
  s = jnp.einsum("bhrd,bhud->bhru", q_rows.astype(jnp.float32), k_rows.astype(jnp.float32))
  s = s * (d ** -0.5 * LOG2E) + mask.bias.astype(jnp.float32)[None, None]   # [B, Hkv, R, U]
  m = s.max(-1)                                                              # [B, Hkv, R]
  m_use = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.exp2(s - m_use[..., None])
  l = p.sum(-1)
  acc = jnp.einsum("bhru,bhud->bhrd", p.astype(q_rows.dtype).astype(jnp.float32),
                   v_rows.astype(jnp.float32))                              # [B, Hkv, R, D]
  acc = acc.reshape(b, hkv, qb, BLOCK_M, d)[:, :, :, :rows_out]
  return acc, m.reshape(b, hkv, qb, BLOCK_M), l.reshape(b, hkv, qb, BLOCK_M)
