"""Register A operands for Mosaic GPU wgmma, shared by quant_attention and w4a16_gemv, and the
SMEM tile layout every wgmma operand tile uses (`swizzled`).

`word_tile`: a [64, 64] code tile stored as 32-bit words in *fragment order* (`pack_words`):
each thread's 16 codes of a row are the two words it loads with one 8-byte shared load, their
nibbles already where the wgmma register fragment wants them. So no shuffle and no permute:
per pair of codes one lop3 (nibble -> bf16 / fp16 with a magic exponent, the sign flip folded
in), per word three shifts. An 8-bit tile (two planes) in fp16 is integer work only: a second
lop3 puts the upper nibble under the lower one (fp16's 10-bit significand holds the whole 8-bit
code), so per pair two lop3 and no arithmetic; in bf16 (7-bit significand) the two planes are
combined by one fma and one add per pair. The values are the stored codes plus a constant
(`word_offset`: 136 in bf16; 1032 in fp16, 1160 for an fp16 two-plane tile), which the caller
folds into its sums (an offset on every code adds offset * sum(b) to each product).

`wgmma_register_a`: acc += a @ b with `a` in registers. The Mosaic GPU interpreter's wgmma takes
no register A operand, so with an SMEM staging buffer (`a_smem`, given in interpret mode only) `a`
goes through it, then the wgmma is awaited.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector
from jaxlib.mlir.dialects import math as mlir_math
import numpy as np

TILE = 64                    # rows and codes per row of a word tile (wgmma M and K)
CODES_PER_WORD = 8
WORDS_PER_ROW = TILE // CODES_PER_WORD
SMEM_ROW_WORDS = 32          # a tile's words as [16, 32] in SMEM (128-byte rows: TMA-friendly)


def swizzled(minor_bytes: int, bits: int) -> dict:
  """SMEM transforms (keyword scratch) of a tile read by wgmma, TMA or in the WGMMA layout:
  8-row tiles `minor_bytes` (16..128, a power of 2) wide, swizzled over that span, so a warp's
  rows spread over the banks. `bits`: the element width."""
  return dict(transforms=(plgpu.TilingTransform((8, minor_bytes * 8 // bits)),
                          plgpu.SwizzleTransform(minor_bytes)))


def a_staging(shape: tuple[int, int], dtype, interpret, **transforms) -> dict:
  """The scratch `wgmma_register_a` stages a registers A operand through, as keyword scratch:
  {"a_smem": SMEM(shape)} in interpret mode (the interpreter's wgmma takes no registers
  operand), {} on the GPU (nothing allocated)."""
  return {} if interpret is None else {"a_smem": plgpu.SMEM(shape, dtype, **transforms)}


def wgmma_register_a(acc_ref, a: jax.Array, b_ref, a_smem=None) -> None:
  """acc_ref += a @ b_ref; a [64, K] in registers (via `a_smem` when given: interpret mode)."""
  if a_smem is None:
    plgpu.wgmma(acc_ref, a, b_ref)
    return
  a_smem[...] = a
  plgpu.commit_smem()
  plgpu.wgmma(acc_ref, a_smem, b_ref)
  plgpu.wgmma_wait(0)


def softmax_pv_step(s: jax.Array, carry: tuple, v_tile, *, dtype, a_smem=None, v_barrier=None,
                    empty_rows: bool = False) -> tuple:
  """One online-softmax step of a plain (single-warpgroup) attention block: carry = (acc
  [64, D] fp32, m [64], l [64]; m in log2 units) after the rows also see the keys of a tile
  with scores s [64, N] fp32 (scaled, log2 units; -inf where masked) and values v_tile
  [N, D] (SMEM). P (rounded to `dtype`) is the wgmma's registers operand (`wgmma_register_a`;
  through a_smem in interpret mode), into a fresh (zeroed) accumulator that is added to the
  rescaled running one (`pl.run_state(...)(ACC.init(acc))` would skip that, but the Mosaic GPU
  interpreter of jax 0.11.2 does not run it). v_barrier: waited for after the softmax, before
  PV. empty_rows: a row may have seen only -inf so far, also after this tile (a finite
  stand-in for its max keeps alpha and p at 0, not NaN; a finite max stays: alpha 1, p 0)."""
  acc, m_i, l_i = carry
  m_new = jnp.maximum(m_i, s.max(axis=1))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if empty_rows else m_new
  alpha = jnp.exp2(m_i - m_use)
  p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_use, s.shape, [0]))
  l_i = l_i * alpha + p.sum(axis=1)
  if v_barrier is not None:
    plgpu.barrier_wait(v_barrier)

  def pv_scope(pv_ref):                            # [64, D] fp32 accumulator
    wgmma_register_a(pv_ref, p.astype(dtype), v_tile, a_smem=a_smem)
    return pv_ref[...]                             # waits for the wgmma
  pv = pl.run_scoped(pv_scope, plgpu.ACC((s.shape[0], acc.shape[1]), jnp.float32))
  return acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l_i


# ----------------------------------------------------------------------------------------------
# Codes as words in fragment order.
# ----------------------------------------------------------------------------------------------
#
# The WGMMA register layout of a [64, 64] 16-bit A tile: thread (warp w, lane l) holds rows
# r = 16 w + l // 4 and r + 8, and of each row the pairs of columns 8 g + 2 (l % 4) + {0, 1},
# g = 0..7. A row of 64 codes is stored as 8 words; word j = 2 c + h, nibble n = k + 4 e (bits
# 4n .. 4n + 3) holds column 32 h + 8 k + 2 c + e. The thread with l % 4 = c loads words 2c and
# 2c + 1 of its row (8 contiguous bytes; a warp's loads are 256 contiguous bytes), and
# word h >> 4k masked to bits {0..3, 16..19} is its register pair g = 4 h + k.

def _to_fragment_order(x):
  """[..., 64] columns -> [..., 64] stored positions 8 j + n (see above): an axis permutation,
  column 32 h + 8 k + 2 c + e <-> position 8 (2 c + h) + (k + 4 e)."""
  x = x.reshape(*x.shape[:-1], 2, 4, 4, 2)                 # (h, k, c, e)
  return jnp.moveaxis(x, (-4, -3, -2, -1), (-3, -1, -4, -2)).reshape(*x.shape[:-4], TILE)


def _from_fragment_order(x):
  """The inverse of `_to_fragment_order`."""
  x = x.reshape(*x.shape[:-1], 4, 2, 2, 4)                 # (c, h, e, k)
  return jnp.moveaxis(x, (-4, -3, -2, -1), (-2, -4, -1, -3)).reshape(*x.shape[:-4], TILE)


def _check_row(length: int) -> None:
  if length % CODES_PER_WORD:
    raise ValueError(f"a row of {length} codes is not a whole number of 8-code words")


def pack_words(codes: jax.Array) -> jax.Array:
  """codes [..., L] (integers in [-8, 7]) -> [..., L / 8] uint32 (4-bit two's complement,
  fragment order when L = 64, plain order otherwise)."""
  length = codes.shape[-1]
  _check_row(length)
  x = (codes.astype(jnp.int32) & 0xF).astype(jnp.uint8)          # 1 byte a code while permuted
  if length == TILE:
    x = _to_fragment_order(x)
  x = x.reshape(*codes.shape[:-1], length // CODES_PER_WORD, CODES_PER_WORD).astype(jnp.uint32)
  shifts = jnp.arange(CODES_PER_WORD, dtype=jnp.uint32) * 4
  return (x << shifts).sum(-1, dtype=jnp.uint32)          # disjoint bits: the sum is an OR


def unpack_words(words: jax.Array) -> jax.Array:
  """[..., L / 8] uint32 -> codes [..., L] int32 in [-8, 7] (the inverse of `pack_words`)."""
  length = words.shape[-1] * CODES_PER_WORD
  nib = jnp.stack([(words >> (4 * n)) & 0xF for n in range(CODES_PER_WORD)], axis=-1)
  stored = ((nib.astype(jnp.int32) ^ 8) - 8).reshape(*words.shape[:-1], length)
  return _from_fragment_order(stored) if length == TILE else stored


def word_offset(dtype, planes: int = 1) -> int:
  """The constant `word_tile` adds to every code of a `planes`-plane tile: 128 + 8 (bf16) or
  1024 + 8 (fp16), the magic exponent's integer base plus the sign flip's bias; an fp16
  two-plane tile, built from integers, holds 1024 + 16 (upper + 8) + (lower + 8), i.e. its code
  16 upper + lower plus 1024 + 8 + 128 = 1160."""
  dtype = jnp.dtype(dtype)
  offset = {jnp.dtype(jnp.bfloat16): 136, jnp.dtype(jnp.float16): 1032}[dtype]
  if planes == 2 and dtype == jnp.dtype(jnp.float16):
    return offset + 16 * 8                   # the upper nibble's sign flip, 16 times over
  return offset


_MAGIC = {jnp.dtype(jnp.bfloat16): 0x4308, jnp.dtype(jnp.float16): 0x6408}   # with bit 3 flip
# An fp16 two-plane pair: the lower nibble under 0x6400 with its bit 3 flipped (l + 8), and bit 7
# set for the flip of the upper nibble XORed in above it (u = (u - 8) ^ 8).
_MAGIC_FP16_PLANES = 0x6488


def word_tile(refs, dtype, *, centered: bool = False, interpret: bool = False) -> jax.Array:
  """refs: one plane (4 bits) or two (upper, lower; 8 bits), each a [16, 32] uint32 SMEM tile
  (a [64, 64] code tile packed by `pack_words`, rows of 8 words, row-major) -> [64, 64] `dtype`
  in the WGMMA layout, exact integers: code + offset (one plane) or 16 upper + lower + offset
  (two), offset = `word_offset(dtype, len(refs))`; with `centered` the offset is subtracted in
  registers (one more sub per pair of codes) and the values are the codes themselves."""
  dtype = jnp.dtype(dtype)
  if dtype not in _MAGIC:
    raise ValueError(f"word_tile needs bfloat16 or float16, got {dtype}")
  if interpret:
    return _word_tile_reference(refs, dtype, centered)
  return _word_tile_mgpu(len(refs), dtype, centered)(*refs)


def _word_tile_reference(refs, dtype, centered):
  """The same values in plain jnp (the Mosaic GPU interpreter runs no inline_mgpu)."""
  planes = [unpack_words(r[...].reshape(TILE, WORDS_PER_ROW)).astype(jnp.float32) for r in refs]
  value = planes[0] if len(planes) == 1 else 16 * planes[0] + planes[1]
  return (value + (0 if centered else word_offset(dtype, len(refs)))).astype(dtype)


def _word_tile_mgpu(num_planes, dtype, centered):
  out = plgpu.ShapeDtypeStruct((TILE, TILE), dtype, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * num_planes, return_type=out)
  def tile(ctx, *refs):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    half = mgpu.utils.dtype_to_ir_type(dtype)
    pair = ir.VectorType.get((2,), half)
    c = lambda v: arith.constant(i32, v)
    tid = arith.remui(mgpu.utils.thread_idx(), c(128))
    lane, warp = arith.remui(tid, c(32)), arith.divui(tid, c(32))
    # Flat word offset of the thread's pair of words in row r = 16 w + l // 4 (8 r + 2 (l % 4)
    # = 128 w + 2 l); row r + 8 is 64 words on.
    base = arith.addi(arith.muli(warp, c(128)), arith.muli(lane, c(2)))
    # lop3 (a & b) ^ c: the nibbles at bits 0..3 and 16..19 under the magic exponent, bit 3
    # flipped (two's complement -> offset binary: v + 8).
    lop3 = f"lop3.b32 $0, $1, 0x000F000F, {_MAGIC[dtype] * 0x10001:#010x}, 0x6a;"

    def nibble_pair(word, k):
      x = word if k == 0 else arith.shrui(word, c(4 * k))
      return mgpu.utils.bitcast(llvm.inline_asm(i32, [x], lop3, "=r,r"), pair)

    # fp16, two planes: (upper_k << 4 & 0x00F000F0) ^ (lower_k & 0x000F000F ^ 0x6488 6488), the
    # upper nibble k of the word moved to bits 4..7 (and 20..23) by one shift (none for k = 1).
    lower_lop3 = f"lop3.b32 $0, $1, 0x000F000F, {_MAGIC_FP16_PLANES * 0x10001:#010x}, 0x6a;"
    upper_lop3 = "lop3.b32 $0, $1, 0x00F000F0, $2, 0x6a;"

    def code_pair_fp16(upper, lower, k):
      lo = lower if k == 0 else arith.shrui(lower, c(4 * k))
      lo = llvm.inline_asm(i32, [lo], lower_lop3, "=r,r")
      hi = (arith.shli(upper, c(4)) if k == 0 else upper if k == 1
            else arith.shrui(upper, c(4 * k - 4)))
      return mgpu.utils.bitcast(llvm.inline_asm(i32, [hi, lo], upper_lop3, "=r,r,r"), pair)

    integer_planes = num_planes == 2 and dtype == jnp.dtype(jnp.float16)
    splat = lambda v: arith.constant(pair, ir.DenseElementsAttr.get_splat(
        pair, ir.FloatAttr.get(half, float(v))))
    # A nibble pair holds code + offset; 16 (upper + offset) - 16 offset = 16 upper, exact.
    offset, sixteen, minus_16_offset = (splat(v) for v in (
        word_offset(dtype, num_planes), 16, -16 * word_offset(dtype)))

    registers = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((TILE, TILE)), dtype=object)
    for hr in range(2):
      flat = arith.addi(base, c(64 * hr))
      idx = [arith.index_cast(index, arith.divui(flat, c(SMEM_ROW_WORDS))),
             arith.index_cast(index, arith.remui(flat, c(SMEM_ROW_WORDS)))]
      words = [vector.load(ir.VectorType.get((2,), i32), ref, idx) for ref in refs]
      for h in range(2):
        w = [vector.extract(ws, dynamic_position=[], static_position=[h]) for ws in words]
        for k in range(4):
          if num_planes == 1:                              # code + offset
            value = nibble_pair(w[0], k)
          elif integer_planes:                             # 16 upper + lower + offset
            value = code_pair_fp16(w[0], w[1], k)
          else:                                            # the same in bf16
            value = arith.addf(mlir_math.fma(nibble_pair(w[0], k), sixteen, minus_16_offset),
                               nibble_pair(w[1], k))
          if centered:
            value = arith.subf(value, offset)              # exact: integers below 256 / 2048
          registers[0, 4 * h + k, 0, 0, hr, 0, 0, 0, 0] = value
    return mgpu.FragmentedArray(_registers=registers, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

  return tile


def word_tile_kernel(planes: int, dtype, interpret=None, centered: bool = False):
  """A one-tile Mosaic GPU kernel: words [planes, 16, 32] uint32 -> `word_tile`'s [64, 64]
  values as fp32 (for tests, and for checking the compiled path on a GPU)."""
  def body(w_ref, o_ref, w_smem, o_smem, barrier):
    plgpu.copy_gmem_to_smem(w_ref, w_smem, barrier)
    plgpu.barrier_wait(barrier)
    a = word_tile([w_smem.at[p] for p in range(planes)], dtype, centered=centered,
                  interpret=interpret is not None)
    o_smem[...] = a.astype(jnp.float32)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  def entry(w_ref, o_ref):
    pl.run_scoped(lambda *scratch: body(w_ref, o_ref, *scratch),
                  plgpu.SMEM((planes, 16, SMEM_ROW_WORDS), jnp.uint32),
                  plgpu.SMEM((TILE, TILE), jnp.float32), plgpu.Barrier(num_arrivals=1))

  return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((TILE, TILE), jnp.float32),
                      grid=(1,), grid_names=("x",), interpret=interpret)
