"""Dequantize a hierarchical INT4/INT8 KV cache (`quant_attention.QuantKV`) into dense K/V on
Mosaic GPU: the codes read at 4 bits (upper nibbles) or 8 (both planes), written in q's dtype.

What it is for: quant_attention's fused kernel computes scores with the keys as the wgmma M
dimension and every q block of at most `block_m` query rows dequantizes all the codes again, so
a wide call (many query rows per KV head) pays the dequantization once per q block. For those
calls `quant_attention` dequantizes the read prefix once with this kernel and runs
decode_attention's kernel (64-row q blocks as the wgmma M dimension) on the copy
(`QuantAttentionConfig.path`). The same done by XLA from the word layout was 5-10x slower than
this kernel's bytes allow (session 18: ~850 us at 4 bits, ~2.1 ms at 8 bits for S = 128K, B = 1).

Kernel (`dequantize_kv`), grid (S / 64 key tiles, Hkv, B), one warpgroup per block, one 64-key
tile per block (many small blocks resident per SM hide the TMA latency):

  TMA in   K code words  [planes, D/64, 16, 32] uint32   (the tile's 64 keys, per channel chunk)
           V code words  [planes, D/4, 32] uint32        (the token tile, channel-major)
           key scale / zero [D] fp16 of the tile's key group; value scales / zeros [64] fp16
  K, per channel chunk:  word_tile -> T [64 keys, 64 channels] = code + offset (registers)
           k = (T - offset + base) * (s_K * step)[channel] + z_K[channel]   (fp32) -> dtype
  V, per channel tile:   word_tile -> T [64 channels, 64 keys]
           v = (T - offset + base) * (s_V * step)[key] + z_V[key]          (fp32) -> dtype,
           stored transposed (token-major)
  TMA out  k, v [B, Hkv, S, D] tiles of [64 keys, 64 channels]

with base 8 and step 1 (4 bits: the stored u - 8 back to u) or base 128 and step 1/16 (8 bits:
16 (u - 8) + l + 128 = c8). These are `quant_attention.dequantize`'s formulas (fp32, then one
rounding to the output dtype), which is this kernel's reference.

Given `lengths` [B], a block whose tile starts at or past round_up(lengths[b], round_to) (clipped
to the capacity) returns at once: no TMA in or out, its slots of k and v left unwritten
(undefined). The cost then follows the read length, not the capacity. `round_to` is for the
consumer: decode_attention reads whole `block_kv` tiles (masking the scores of slots past the
length, but multiplying their V rows by p = 0, which a NaN left in an unwritten slot would turn
into NaN), so its caller passes that tile size.

Limits (ValueError otherwise): head_dim a multiple of 64 up to 256, capacity a multiple of 64,
the key group a multiple of 64, output bf16 or fp16.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.combine import (check_lengths, check_sizes, int32_clipped, interpret_mode,
                                    is_int, normalised)
from pallas_kernels.quant_attention import (KEY_TILE, META_DTYPE, TILE_ROWS, QuantKV,
                                            _SUPPORTED_DTYPES, check_bits, check_qkv_arrays,
                                            dequantize)
from pallas_kernels.register_operand import SMEM_ROW_WORDS, swizzled, word_offset, word_tile

CHUNK = 64                        # channels per K chunk / V channel tile
# The key scale / zero row of a tile comes in one TMA box, at most 256 elements a dimension (D =
# 512 passed the checks and failed Mosaic's lowering on a GPU; 1024 overflowed SMEM).
MAX_HEAD_DIM = 256


def _check(qkv: QuantKV, bits: int, dtype) -> None:
  check_bits(bits)
  if jnp.dtype(dtype) not in _SUPPORTED_DTYPES:
    raise ValueError(f"dequantize_kv writes bfloat16 or float16, got {dtype}")
  if qkv.head_dim % CHUNK or qkv.head_dim > MAX_HEAD_DIM:
    raise ValueError(f"head_dim {qkv.head_dim} must be a multiple of {CHUNK} and at most "
                     f"{MAX_HEAD_DIM}")
  check_sizes(B=qkv.k_codes.shape[0], Hkv=qkv.k_codes.shape[1], S=qkv.capacity)
  if qkv.capacity % KEY_TILE or qkv.group % KEY_TILE:
    raise ValueError(f"capacity {qkv.capacity} and key group {qkv.group} must be multiples of "
                     f"the {KEY_TILE}-key tile")
  check_qkv_arrays(qkv)


@normalised(interpret=interpret_mode)
@functools.partial(jax.jit, static_argnames=("bits", "dtype", "round_to", "interpret"))
def dequantize_kv(qkv: QuantKV, bits: int, dtype=jnp.bfloat16, lengths: jax.Array | None = None,
                  *, round_to: int = KEY_TILE, interpret: Any = None
                  ) -> tuple[jax.Array, jax.Array]:
  """(k, v) [B, Hkv, S, D] in `dtype` from the 4-bit (upper nibbles) or 8-bit (both) view of
  qkv: every slot, or with lengths [B] int32 the slots s < round_up(lengths[b], round_to)
  (clipped to [0, S]; the rest left undefined). `interpret=plgpu.InterpretGPUParams()` runs the
  Mosaic GPU interpreter (CPU)."""
  _check(qkv, bits, dtype)
  batch, hkv, _, n_chunks, capacity, _ = qkv.k_codes.shape
  if not is_int(round_to) or round_to <= 0 or round_to % KEY_TILE:
    raise ValueError(f"round_to must be a positive multiple of {KEY_TILE} (an int), got "
                     f"{round_to!r}")
  if lengths is None:
    lengths = jnp.full((batch,), capacity, jnp.int32)
  check_lengths("lengths", lengths, batch)
  lengths = int32_clipped(lengths, capacity, kernel_clips=True)
  head_dim, group = qkv.head_dim, qkv.group
  dtype = jnp.dtype(dtype)
  planes = 1 if bits == 4 else 2
  base, step = (8.0, 1.0) if bits == 4 else (128.0, 1.0 / 16.0)
  offset = float(word_offset(dtype, planes))
  col = plgpu.Layout.WGMMA.reduce(0)            # a vector along a tile's columns

  def body(lengths_ref,  # [B] int32 (GMEM)
           kc_ref, vc_ref, ks_ref, kz_ref, vs_ref, vz_ref, k_out, v_out,
           kc_smem,      # [planes, D/64, 16, 32] uint32: the tile's key codes per chunk
           vc_smem,      # [planes, D/4, 32] uint32: the tile's value codes, channel-major
           kmeta_smem,   # [2, D] fp16: the key group's scale (0) and zero (1) rows
           vmeta_smem,   # [2, 64] fp16: the tile's value scales (0) and zeros (1)
           ko_smem,      # [D/64, 64, 64] dtype (swizzled): k, one [keys, channels] tile a chunk
           vo_smem,      # [D/64, 64, 64] dtype (swizzled): v likewise
           barrier):
    t, h, b = lax.axis_index("tile"), lax.axis_index("head"), lax.axis_index("batch")
    start = t * KEY_TILE
    length = jnp.minimum(jnp.maximum(lengths_ref[b], 0), capacity)
    bound = lax.div(length + (round_to - 1), jnp.int32(round_to)) * round_to

    @pl.when(start < bound)          # tiles past the (rounded) length: nothing in or out
    def _():
      grp = lax.div(start, jnp.int32(group))
      for pn in range(planes):
        for hf in range(n_chunks):
          plgpu.copy_gmem_to_smem(kc_ref.at[b, h, pn, hf, pl.ds(t * TILE_ROWS, TILE_ROWS)],
                                  kc_smem.at[pn, hf], barrier)
        plgpu.copy_gmem_to_smem(vc_ref.at[b, h, pn, t], vc_smem.at[pn], barrier)
      plgpu.copy_gmem_to_smem(ks_ref.at[b, h, grp], kmeta_smem.at[0], barrier)
      plgpu.copy_gmem_to_smem(kz_ref.at[b, h, grp], kmeta_smem.at[1], barrier)
      plgpu.copy_gmem_to_smem(vs_ref.at[b, h, pl.ds(start, KEY_TILE)], vmeta_smem.at[0], barrier)
      plgpu.copy_gmem_to_smem(vz_ref.at[b, h, pl.ds(start, KEY_TILE)], vmeta_smem.at[1], barrier)
      plgpu.barrier_wait(barrier)

      def column_vector(ref):                     # [64] fp16 -> [64, 64] fp32 along the columns
        x = plgpu.load(ref, layout=col, optimized=False).astype(jnp.float32)
        return lax.broadcast_in_dim(x, (KEY_TILE, CHUNK), [1])

      def dequant(tile, scale, zero):             # [64, 64] code + offset -> values in fp32
        return (tile.astype(jnp.float32) + (base - offset)) * (scale * step) + zero

      vs = column_vector(vmeta_smem.at[0])
      vz = column_vector(vmeta_smem.at[1])
      for hf in range(n_chunks):
        channels = pl.ds(hf * CHUNK, CHUNK)
        k = dequant(word_tile([kc_smem.at[pn, hf] for pn in range(planes)], dtype,
                              interpret=interpret is not None),
                    column_vector(kmeta_smem.at[0, channels]),
                    column_vector(kmeta_smem.at[1, channels]))
        ko_smem.at[hf][...] = k.astype(dtype)
        v = dequant(word_tile([vc_smem.at[pn, pl.ds(hf * TILE_ROWS, TILE_ROWS)]
                               for pn in range(planes)], dtype, interpret=interpret is not None),
                    vs, vz)                       # [64 channels, 64 keys]
        vo_smem.at[hf].transpose((1, 0))[...] = v.astype(dtype)
      plgpu.commit_smem()
      for hf in range(n_chunks):
        channels = pl.ds(hf * CHUNK, CHUNK)
        plgpu.copy_smem_to_gmem(ko_smem.at[hf], k_out.at[b, h, pl.ds(start, KEY_TILE), channels])
        plgpu.copy_smem_to_gmem(vo_smem.at[hf], v_out.at[b, h, pl.ds(start, KEY_TILE), channels])
      plgpu.wait_smem_to_gmem(0)

  sw = swizzled(CHUNK * dtype.itemsize, 8 * dtype.itemsize)
  scratch = (
      plgpu.SMEM((n_chunks, KEY_TILE, CHUNK), dtype, **sw),
      plgpu.SMEM((n_chunks, KEY_TILE, CHUNK), dtype, **sw),
      plgpu.SMEM((planes, n_chunks, TILE_ROWS, SMEM_ROW_WORDS), jnp.uint32),
      plgpu.SMEM((planes, head_dim // 4, SMEM_ROW_WORDS), jnp.uint32),
      plgpu.SMEM((2, head_dim), META_DTYPE),
      plgpu.SMEM((2, KEY_TILE), META_DTYPE),
      plgpu.Barrier(num_arrivals=planes * (n_chunks + 1) + 4),
  )

  def dequantize_kv_kernel(*refs):
    ins, outs = refs[:7], refs[7:]
    pl.run_scoped(lambda ko, vo, kc, vc, km, vm, bar: body(*ins, *outs, kc, vc, km, vm, ko, vo,
                                                           bar), *scratch)

  # The codes as rows of 32 words (128 bytes): four keys (K) or four channels (V) a row.
  kc_rows = qkv.k_codes.reshape(batch, hkv, 2, n_chunks, capacity // 4, SMEM_ROW_WORDS)
  vc_rows = qkv.v_codes.reshape(batch, hkv, 2, capacity // KEY_TILE, head_dim // 4,
                                SMEM_ROW_WORDS)
  out = jax.ShapeDtypeStruct((batch, hkv, capacity, head_dim), dtype)
  return plgpu.kernel(
      dequantize_kv_kernel,
      out_type=(out, out),
      grid=(capacity // KEY_TILE, hkv, batch),
      grid_names=("tile", "head", "batch"),
      interpret=interpret,
  )(lengths, kc_rows, vc_rows, qkv.k_scale, qkv.k_zero, qkv.v_scale, qkv.v_zero)


def dequantize_kv_reference(qkv: QuantKV, bits: int, dtype=jnp.bfloat16
                            ) -> tuple[jax.Array, jax.Array]:
  """Pure jnp: `quant_attention.dequantize` (fp32) rounded to `dtype`."""
  _check(qkv, bits, dtype)
  return dequantize(qkv, bits, dtype=dtype)
