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

from pallas_kernels.register_operand import a_staging, wgmma_register_a

BLOCK_M = 64                      # q rows per thread block (one warpgroup's wgmma M)
BLOCK_U = 64                      # in-flight keys per tile
LOG2E = float(np.log2(np.e))


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
  row_query = np.asarray(row_query)
  u = mask.shape[1]
  rows = jnp.asarray(mask, bool)[np.maximum(row_query, 0)]                  # [R, U]
  rows = rows | jnp.asarray(row_query < 0)[:, None]
  bias = jnp.where(rows, 0.0, -jnp.inf).astype(jnp.bfloat16)
  bias = jnp.pad(bias, ((0, 0), (0, padded_keys(u) - u)), constant_values=-jnp.inf)
  return InflightMask(bias, *tile_lists(bias))


@functools.partial(jax.jit, static_argnames=("rows_out", "num_stages", "interpret"))
def inflight_partials(q_rows: jax.Array, k_rows: jax.Array, v_rows: jax.Array,
                      mask: InflightMask, *, rows_out: int, num_stages: int = 2,
                      interpret: Any = None):
  """See the module docstring. q_rows [B, Hkv, QB * 64, D] bf16/fp16; k_rows, v_rows
  [B, Hkv, U_pad, D] (q's dtype); mask from `mask_bias` (bias [QB * 64, U_pad], 0 / -inf)."""
  batch, num_kv_heads, m_total, head_dim = q_rows.shape
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
  q_blocks = m_total // BLOCK_M
  num_tiles = u_pad // BLOCK_U
  if tiles.shape != (q_blocks, num_tiles) or counts.shape != (q_blocks, 2):
    raise ValueError(f"mask tiles / counts must be [QB, NT] = {(q_blocks, num_tiles)} / "
                     f"[QB, 2], got {tiles.shape} / {counts.shape}")
  if not 0 < rows_out <= BLOCK_M or rows_out % 8:
    raise ValueError(f"rows_out must be a multiple of 8 in (0, 64], got {rows_out}")
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
           acc_out_ref,     # [B, Hkv, QB, rows_out, D] fp32            GMEM
           m_out_ref,       # [B, Hkv, QB, 64] fp32                     GMEM
           l_out_ref,       # [B, Hkv, QB, 64] fp32                     GMEM
           q_smem,          # [64, D]                                   SMEM (tiled, swizzled)
           k_smem,          # [stages, 64, D]                           SMEM (tiled, swizzled)
           v_smem,          # [stages, 64, D]                           SMEM (tiled, swizzled)
           b_smem,          # [stages, 64, 64] bf16                     SMEM (union: ring)
           o_smem,          # [64, D] fp32                              SMEM (union: output)
           m_smem,          # [64] fp32                                 SMEM
           l_smem,          # [64] fp32                                 SMEM
           q_barrier, k_barriers, b_barriers, v_barriers,
           a_smem=None):    # [64, 64] (interpret mode only)            SMEM (tiled, swizzled)
    qb = lax.axis_index("qblock")
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
      plgpu.copy_gmem_to_smem(v_ref.at[b, h, keys], v_smem.at[slot], v_barriers.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(qb * BLOCK_M, BLOCK_M)], q_smem, q_barrier)
    for step in range(stages):                     # prologue: fill the ring
      pl.when(step < num_seen)(functools.partial(fetch, step, step))
    plgpu.barrier_wait(q_barrier)

    acc = plgpu.layout_cast(jnp.zeros((BLOCK_M, head_dim), jnp.float32), plgpu.Layout.WGMMA)
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

      # A row may see no key of this tile (or none at all): a finite stand-in for its max keeps
      # alpha and p at 0 instead of NaN.
      m_new = jnp.maximum(m_i, s.max(axis=1))
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if partly_seen else m_new
      alpha = jnp.exp2(m_i - m_use)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
      l_i = l_i * alpha + p.sum(axis=1)

      plgpu.barrier_wait(v_barriers.at[slot])
      def pv_scope(pv_ref):                        # [64, D] fp32 accumulator
        # P as the registers operand (as decode_attention; through a_smem in interpret mode)
        wgmma_register_a(pv_ref, p.astype(dtype), v_smem.at[slot], a_smem=a_smem)
        return pv_ref[...]
      pv = pl.run_scoped(pv_scope, plgpu.ACC((BLOCK_M, head_dim), jnp.float32))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv

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

    o_smem[...] = acc
    m_smem[...] = m_i
    l_smem[...] = l_i
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_out)], acc_out_ref.at[b, h, qb])
    plgpu.copy_smem_to_gmem(m_smem, m_out_ref.at[b, h, qb])
    plgpu.copy_smem_to_gmem(l_smem, l_out_ref.at[b, h, qb])
    plgpu.wait_smem_to_gmem(0)

  swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
  ring = (plgpu.SMEM((stages, BLOCK_U, head_dim), dtype, **swizzled),
          plgpu.SMEM((stages, BLOCK_U, head_dim), dtype, **swizzled),
          plgpu.SMEM((stages, BLOCK_M, BLOCK_U), jnp.bfloat16))
  scratch = [
      plgpu.SMEM((BLOCK_M, head_dim), dtype, **swizzled),
      plgpu.RefUnion(ring, plgpu.SMEM((BLOCK_M, head_dim), jnp.float32)),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.Barrier(),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
  ]
  part = (batch, num_kv_heads, q_blocks)
  out_type = (jax.ShapeDtypeStruct((*part, rows_out, head_dim), jnp.float32),
              jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32),
              jax.ShapeDtypeStruct((*part, BLOCK_M), jnp.float32))

  def inflight_attention_kernel(tiles_ref, counts_ref, q_ref, k_ref, v_ref, bias_ref, acc_ref,
                                m_ref, l_ref):
    def scoped(q_smem, union, *refs, a_smem=None):
      (k_smem, v_smem, b_smem), o_smem = union     # the union's two views
      body(tiles_ref, counts_ref, q_ref, k_ref, v_ref, bias_ref, acc_ref, m_ref, l_ref, q_smem,
           k_smem, v_smem, b_smem, o_smem, *refs, a_smem=a_smem)
    pl.run_scoped(scoped, *scratch, **a_staging((BLOCK_M, BLOCK_U), dtype, interpret, **swizzled))

  return plgpu.kernel(
      inflight_attention_kernel,
      out_type=out_type,
      grid=(q_blocks, num_kv_heads, batch),
      grid_names=("qblock", "head", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(tiles.astype(jnp.int32), counts.astype(jnp.int32), q_rows, k_rows, v_rows,
    bias.astype(jnp.bfloat16))


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
