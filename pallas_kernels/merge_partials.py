"""The last launch of a split-KV attention call in the keys-as-M orientation (Mosaic GPU, Hopper):
the split partials merged by log-sum-exp and normalised, in ONE kernel.

`quant_attention`'s kernel leaves one un-normalised partial per split, O^T [D, N] with its row
statistics along N (the quantized splits, and the blocks that attend the keys held in full
precision). Merging them in XLA took a max reduction, a weighted multi-output reduction and an
elementwise pass; this kernel reads each partial once.

Contract:

  merge_partials(acc [B, Hkv, QB, NS, D, N] fp32 (un-normalised O^T; N a multiple of 8, <= 64),
                 m2 [B, Hkv, QB, NS, NP] fp32 (row max, log2 units, -inf for an empty split),
                 l [B, Hkv, QB, NS, NP] fp32 (row sum); NP >= max(N, 32) and a multiple of
                 4, columns >= N ignored)
    -> out [B, Hkv, QB, D, N] fp32 (sum_s 2**(m_s - m) acc_s / sum_s 2**(m_s - m) l_s, 0 for a
       row that sees nothing), lse [B, Hkv, QB, NP] fp32 (natural log, -inf for a row that sees
       nothing; columns >= N undefined)

Grid (Hkv * QB, D / 64, B): one warpgroup per (KV head, q block, 64 channels, row). Two passes:
the row max over every split first (all m and l arrive by one TMA each), then each split's
weight 2**(m_s - m) and its [64, N] slice of acc (in chunks of `splits_per_chunk`, one TMA a
chunk: a [chunk, 64, N] box of acc viewed as [B * Hkv * QB * NS, D, N]; through up to MAX_SLOTS
SMEM slots, every chunk that has a slot issued before the first wait) folded in without a
dependency chain through exp2. Both passes loop over chunks, a chunk's splits unrolled, so the
lowering's size does not grow with NS (an unrolled fold of ~200 splits had overflowed Python's
recursion limit in Mosaic GPU's lowering; 128 took 43 s). One TMA a chunk instead of one a split
(session 46, H200): the merge alone, 54 partials at N = 8 4.38 -> 3.39 us, 38 at N = 24 7.14 ->
5.45 us; in QuantSpec's 8B forwards at 128K (against session 44's run) 4.92 -> 3.66 us a layer in
the draft, 8.21 -> 6.28 in the verification.

`merge_partials_in_ranges` runs it twice for many splits (ranges of splits in parallel, then the
ranges). `merge_partials_reference` (pure jnp) sits at the bottom.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.combine import check_sizes, interpret_mode, normalised
from pallas_kernels.hopper import SMEM_PER_SM

LN2 = math.log(2.0)
TILE = 64                         # channels per block (one [64, N] WGMMA-layout tile)
CHUNK_BYTES = 48 * 1024           # split partials per TMA chunk: about this many bytes
MAX_SLOTS = 4                     # chunks in flight (4 x 48 KiB of SMEM at most)
SMEM_SLACK = 4096                 # barriers and buffer alignment (Mosaic counted 1.7 KiB)
# Splits one merge takes: the m and l tables arrive by one TMA each, and a TMA box has at most
# 256 rows. More go through `merge_partials_in_ranges` (quant_attention's planner does so past
# 128).
MAX_SPLITS = 256


def splits_per_chunk(num_splits: int, n: int) -> int:
  """Split slices ([64, N] fp32) fetched per chunk: ~CHUNK_BYTES, at least 1, at most all."""
  return max(1, min(num_splits, CHUNK_BYTES // (TILE * n * 4)))


def merge_plan(num_splits: int, n: int, n_pad: int) -> tuple[int, int]:
  """(splits per chunk, SMEM slots) of a merge: chunks of ~CHUNK_BYTES, up to MAX_SLOTS of them
  in flight, fewer where the slots would not fit one block's SMEM beside the [NS, NP] tables of
  m and l (one wave of quantized splits at 1-2 KV heads is ~200 splits: 51 KiB of tables at
  NP = 32, and four 48 KiB slots overflowed). Raises a ValueError naming NS when the tables
  leave no room for one [64, N] slice."""
  if num_splits > MAX_SPLITS:
    raise ValueError(f"merge_partials takes at most MAX_SPLITS={MAX_SPLITS} splits (one TMA box "
                     f"of m and l rows), got NS={num_splits}: use fewer splits")
  slice_bytes = TILE * n * 4
  room = SMEM_PER_SM - (2 * num_splits + 1) * n_pad * 4 - SMEM_SLACK
  if room < slice_bytes:
    raise ValueError(f"merge_partials: the statistics of NS={num_splits} splits (N={n}, "
                     f"NP={n_pad}) leave no room in {SMEM_PER_SM} bytes of SMEM for one split's "
                     f"[64, N] slice: use fewer splits")
  chunk = min(splits_per_chunk(num_splits, n), room // slice_bytes)
  n_chunks = -(-num_splits // chunk)
  return chunk, max(1, min(n_chunks, MAX_SLOTS, room // (chunk * slice_bytes)))


def _check(acc, m2, l):
  if acc.ndim != 6:
    raise ValueError(f"acc must be [B, Hkv, QB, NS, D, N], got shape {acc.shape}")
  b, hkv, qb, ns, d, n = acc.shape
  check_sizes(B=b, Hkv=hkv, QB=qb, D=d)        # D = 0 was a ZeroDivisionError in the plan
  if ns < 1 or d % TILE or n % 8 or not 0 < n <= 64:
    raise ValueError(f"acc [B, Hkv, QB, NS, D, N] needs NS >= 1, D a multiple of {TILE} and N a "
                     f"multiple of 8 in (0, 64], got {acc.shape}")
  if acc.dtype != jnp.float32 or m2.dtype != jnp.float32 or l.dtype != jnp.float32:
    raise ValueError(f"acc, m2 and l must be float32, got {acc.dtype}, {m2.dtype}, {l.dtype}")
  if (m2.ndim != 5 or m2.shape[:4] != (b, hkv, qb, ns) or m2.shape[4] < max(n, 32)
      or m2.shape[4] % 4):
    # NP = 33 ran in the interpreter and failed Mosaic's lowering for the GPU ('async_copy
    # requires all GMEM strides except the last one to be a multiple of 16 bytes').
    raise ValueError(f"m2 must be [B={b}, Hkv={hkv}, QB={qb}, NS={ns}, NP >= {max(n, 32)}, a "
                     f"multiple of 4 (16-byte TMA rows)], got {m2.shape}")
  if l.shape != m2.shape:
    raise ValueError(f"l shape {l.shape} differs from m2 shape {m2.shape}")


@normalised(interpret=interpret_mode)
@functools.partial(jax.jit, static_argnames=("interpret",))
def merge_partials(acc: jax.Array, m2: jax.Array, l: jax.Array, *, interpret: Any = None):
  """See the module docstring."""
  _check(acc, m2, l)
  batch, num_kv_heads, q_blocks, num_splits, head_dim, n = acc.shape
  n_pad = m2.shape[4]
  chunk, slots = merge_plan(num_splits, n, n_pad)
  full_chunks, rem = divmod(num_splits, chunk)
  col = plgpu.Layout.WGMMA.reduce(0)           # a vector along a tile's columns (N)

  def body(acc_ref,          # [B * Hkv * QB * NS, D, N] fp32           GMEM (a free reshape)
           m_ref, l_ref,     # [B, Hkv, QB, NS, NP] fp32                GMEM
           out_ref,          # [B, Hkv, QB, D, N] fp32                  GMEM
           lse_ref,          # [B, Hkv, QB, NP] fp32                    GMEM
           acc_smem,         # [slots, chunk, 64, N] fp32 (slot 0, split 0: the output at the end)
           m_smem, l_smem,   # [NS, NP] fp32
           lse_smem,         # [NP] fp32
           ml_barrier, chunk_barriers, rem_barrier=None):
    head_qblock = lax.axis_index("head_qblock")
    mt = lax.axis_index("channels")
    b = lax.axis_index("batch")
    h = lax.div(head_qblock, jnp.int32(q_blocks))
    qb = lax.rem(head_qblock, jnp.int32(q_blocks))
    channels = pl.ds(mt * TILE, TILE)

    first_split = ((b * num_kv_heads + h) * q_blocks + qb) * num_splits   # row of acc_ref

    def fetch(c, slot, count):
      """Chunk c (static or traced) of `count` splits into SMEM slot `slot` (static or traced):
      one TMA, a [count, 64, N] box of the three-dimensional view."""
      barrier = chunk_barriers.at[slot] if count == chunk else rem_barrier
      plgpu.copy_gmem_to_smem(acc_ref.at[pl.ds(first_split + c * chunk, count), channels],
                              acc_smem.at[slot, pl.ds(0, count)], barrier)

    plgpu.copy_gmem_to_smem(m_ref.at[b, h, qb], m_smem, ml_barrier)
    plgpu.copy_gmem_to_smem(l_ref.at[b, h, qb], l_smem, ml_barrier)
    for c in range(slots):                     # slots <= chunks: every slot starts filled
      fetch(c, c, chunk if c < full_chunks else rem)

    def stat(ref, s):                          # split s's [N] row statistic (s static or traced)
      return plgpu.load(ref.at[s, pl.ds(0, n)], layout=col, optimized=False)

    def cols(x):                               # [N] -> [64, N]
      return lax.broadcast_in_dim(x, (TILE, n), [1])

    plgpu.barrier_wait(ml_barrier)
    def chunk_max(c, m):                       # a chunk's splits unrolled: independent loads
      return functools.reduce(jnp.maximum, [stat(m_smem, c * chunk + i) for i in range(chunk)], m)

    m_tot = lax.fori_loop(0, full_chunks, chunk_max, jnp.full((n,), -jnp.inf, jnp.float32))
    m_tot = functools.reduce(jnp.maximum, [stat(m_smem, full_chunks * chunk + i)
                                           for i in range(rem)], m_tot)
    # A row that sees nothing: a finite stand-in keeps every weight at 0 instead of NaN.
    m_use = jnp.where(m_tot == -jnp.inf, 0.0, m_tot)

    def fold(slot, first, count, carry):       # a chunk's splits, unrolled
      acc, l_tot = carry
      for i in range(count):
        w = jnp.exp2(stat(m_smem, first + i) - m_use)
        part = plgpu.load(acc_smem.at[slot, i], layout=plgpu.Layout.WGMMA, optimized=False)
        acc = acc + part * cols(w)
        l_tot = l_tot + w * stat(l_smem, first + i)
      return acc, l_tot

    def full_chunk(c, carry):                  # chunk c < full_chunks, traced
      slot = lax.rem(c, jnp.int32(slots))
      plgpu.barrier_wait(chunk_barriers.at[slot])
      carry = fold(slot, c * chunk, chunk, carry)
      refill = c + slots                       # the chunk that takes this slot next
      pl.when(refill < full_chunks)(lambda: fetch(refill, slot, chunk))
      if rem:
        pl.when(refill == full_chunks)(lambda: fetch(refill, slot, rem))
      return carry

    carry = (plgpu.layout_cast(jnp.zeros((TILE, n), jnp.float32), plgpu.Layout.WGMMA),
             jnp.zeros_like(m_use))
    carry = lax.fori_loop(0, full_chunks, full_chunk, carry)
    if rem:                                    # the last, partial chunk
      plgpu.barrier_wait(rem_barrier)
      carry = fold(full_chunks % slots, full_chunks * chunk, rem, carry)
    acc, l_tot = carry

    seen = l_tot > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l_tot, 1.0), 0.0)
    o_smem = acc_smem.at[0, 0]                 # every chunk is folded in: the slot is free
    o_smem[...] = acc * cols(inv)
    lse_smem[pl.ds(0, n)] = jnp.where(seen, m_use * LN2 + jnp.log(jnp.where(seen, l_tot, 1.0)),
                                      -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, h, qb, channels])

    @pl.when(mt == 0)
    def _():
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, qb])
    plgpu.wait_smem_to_gmem(0)

  scratch = [
      plgpu.SMEM((slots, chunk, TILE, n), jnp.float32),
      plgpu.SMEM((num_splits, n_pad), jnp.float32),
      plgpu.SMEM((num_splits, n_pad), jnp.float32),
      plgpu.SMEM((n_pad,), jnp.float32),
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_barriers=slots),          # one TMA a chunk
  ]
  if rem:
    scratch.append(plgpu.Barrier())               # the last, partial chunk
  part = (batch, num_kv_heads, q_blocks)
  out_type = (jax.ShapeDtypeStruct((*part, head_dim, n), jnp.float32),
              jax.ShapeDtypeStruct((*part, n_pad), jnp.float32))

  def merge_partials_kernel(*refs):
    pl.run_scoped(lambda *scr: body(*refs, *scr), *scratch)

  return plgpu.kernel(
      merge_partials_kernel,
      out_type=out_type,
      grid=(num_kv_heads * q_blocks, head_dim // TILE, batch),
      grid_names=("head_qblock", "channels", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(acc.reshape(-1, head_dim, n), m2, l)


def merge_partials_in_ranges(acc: jax.Array, m2: jax.Array, l: jax.Array, *, ranges: int,
                             interpret: Any = None):
  """merge_partials in two launches for many splits: the NS splits in `ranges` consecutive
  ranges of NS / ranges, merged in parallel (the ranges are extra q blocks of the same kernel,
  a free reshape), then the ranges' normalised outputs weighted by their log-sum-exps (m2 =
  lse * log2 e, l = 1; an empty range has lse = -inf, so weight 0). One launch folds a q
  block's splits in series in one thread block (~0.065 us a split on an H200), so at 1-2 KV
  heads a few blocks carried ~200 splits alone. Same contract and outputs as merge_partials;
  NS must be a multiple of `ranges`; ranges = 1 is merge_partials itself."""
  if not isinstance(ranges, numbers.Integral) or ranges < 1:   # numpy integers too
    raise ValueError(f"ranges must be a positive integer, got {ranges!r}")
  if ranges == 1:
    return merge_partials(acc, m2, l, interpret=interpret)
  _check(acc, m2, l)
  b, hkv, qb, ns, d, n = acc.shape
  ranges = int(ranges)
  if ns % ranges:
    raise ValueError(f"ranges must be a positive divisor of NS={ns}, got {ranges}")
  n_pad = m2.shape[4]
  per_range = lambda x: x.reshape(b, hkv, qb * ranges, ns // ranges, *x.shape[4:])
  out, lse = merge_partials(per_range(acc), per_range(m2), per_range(l), interpret=interpret)
  lse = lse.reshape(b, hkv, qb, ranges, n_pad)     # columns >= N undefined: never read
  seen = lse > -jnp.inf
  return merge_partials(out.reshape(b, hkv, qb, ranges, d, n),
                        jnp.where(seen, lse * (1.0 / LN2), -jnp.inf),
                        seen.astype(jnp.float32), interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Reference (pure jnp, fp32).
# ----------------------------------------------------------------------------------------------

def merge_partials_reference(acc, m2, l):
  """The kernel's outputs in fp32 jnp, same shapes and conventions; lse [B, Hkv, QB, N] (the
  real columns only)."""
  n = acc.shape[-1]
  m_s, l_s = m2[..., :n], l[..., :n]                                        # [B, Hkv, QB, NS, N]
  m_tot = m_s.max(3)
  m_tot = jnp.where(m_tot == -jnp.inf, 0.0, m_tot)
  w = jnp.exp2(m_s - m_tot[:, :, :, None])
  l_tot = (w * l_s).sum(3)
  o = (acc * w[:, :, :, :, None]).sum(3)                                    # [B, Hkv, QB, D, N]
  seen = l_tot > 0
  out = o * jnp.where(seen, 1.0 / jnp.where(seen, l_tot, 1.0), 0.0)[:, :, :, None]
  lse = jnp.where(seen, m_tot * LN2 + jnp.log(jnp.where(seen, l_tot, 1.0)), -jnp.inf)
  return out, lse
