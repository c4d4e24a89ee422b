"""W4A16 GEMV through the Triton lowering of `pallas_call` (an interim: see "Backend" below).

x [M, In] (bf16/fp16, 1 <= M <= MAX_ROWS rows) @ a 4-bit group-quantized weight [In, Out] for
QuantSpec's draft, on CUDA cores, reading each 4-bit code once.

Quantization as `sparsedec.model.quant_weights` (groups of G consecutive input rows per output
column, w = zero + c * scale, c in [0, 15], scale and zero fp16 [In_pad / G, Out]). Code layout
("int4_words" there):

  words [In_pad / 8, Out] uint32, bits 4j..4j+3 of words[r, o] = c[8 r + j, o]

so a block's tile of 16 word rows x BO outputs is BO-contiguous (coalesced 16-byte loads) and
holds one quant group of 128 inputs.

Kernel (`w4a16_words_matmul`), grid (Out / BO, splits), `num_warps` warps per block. Per quant
group g of the block's input range and per nibble j (a static loop of 8):

  f_j  [R, BO] = bitcast_f32(((words << (19 - 4 j)) & (0xF << 19)) | 0x3F800000)  = 1 + c / 16
  part [R, BO] += f_j * x[8 r + j]                 (R = G / 8 word rows; one FFMA per weight)
  acc  [R, BO] += part * 16 s_g + xs * (z_g - 16 s_g)   (per group; xs [R, 1] = sum_j x[8 r + j])

and y = sum_r acc = sum_g sum_i x_i (z_g + c_i s_g) exactly up to fp32 rounding (the
weight is never rounded to bf16). The code never goes through an int -> float conversion
instruction (a quarter-rate unit): the nibble is moved into the top of an fp32 mantissa of 1.0,
so a weight costs a shift, a lop3 and an FFMA. Split-K: each split writes fp32 partials
[splits, M, Out] that the wrapper sums (XLA, fused with the cast and, under jit, with consumers).

Backend: Triton (`pallas_call` with `pallas.triton.CompilerParams`), deprecated in jax 0.11 in
favour of Mosaic GPU. It is here because the Mosaic GPU kernel (`pallas_kernels.w4a16_gemv`)
cannot reach read bandwidth: its int4 operands go through Mosaic's wgmma upcast path, which Nsight
Compute showed instruction-issue bound at ~5 instructions per weight (32-47% of read bandwidth on
an H200, benchmarks/NOTES.md "Session 9"), and Mosaic GPU has no CUDA-core GEMV form that avoids
it. Measured against it in `benchmarks/w4a16_gemv.py --impls mosaic,triton` (NOTES "Session 12").

`w4a16_words_reference`: dequantize in fp32, fp32 matmul (pure jnp).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from sparsedec.errors import InputError

CODES_PER_WORD = 8
MAX_ROWS = 4                     # x rows per call (each row keeps its own [R, BO] accumulator)
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ONE = 0x3F800000                # fp32 1.0
_NIBBLE_AT_19 = 0xF << 19        # the top 4 bits of an fp32 mantissa


@dataclasses.dataclass(frozen=True)
class TritonW4A16Config:
  """Tiling: BO outputs per block (a power of two dividing Out), split-K chosen so the grid has
  about `target_blocks` blocks, Triton's warps and software-pipeline stages."""
  block_out: int = 128
  target_blocks: int = 264
  num_warps: int = 4
  num_stages: int = 4
  num_splits: int | None = None

  def __post_init__(self):
    bo = self.block_out
    if not isinstance(bo, int) or bo < 16 or bo & (bo - 1):
      raise InputError(f"block_out must be a power of two >= 16, got {bo!r}")
    for name in ("target_blocks", "num_warps", "num_stages"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise InputError(f"{name} must be a positive integer, got {v!r}")
    if self.num_splits is not None and (not isinstance(self.num_splits, int)
                                        or self.num_splits < 1):
      raise InputError(f"num_splits must be None or a positive integer, got {self.num_splits!r}")


# ----------------------------------------------------------------------------------------------
# Layout.
# ----------------------------------------------------------------------------------------------

def to_words(codes: jax.Array) -> jax.Array:
  """Unsigned codes c [In_pad, Out] (values in [0, 15], In_pad a multiple of 8) ->
  words [In_pad / 8, Out] uint32 (code 8 r + j at bits 4 j)."""
  n_in, n_out = codes.shape
  if n_in % CODES_PER_WORD:
    raise InputError(f"the word layout needs In_pad a multiple of {CODES_PER_WORD}, got {n_in}")
  c = codes.astype(jnp.uint32).reshape(n_in // CODES_PER_WORD, CODES_PER_WORD, n_out)
  shifts = (4 * jnp.arange(CODES_PER_WORD, dtype=jnp.uint32))[None, :, None]
  return (c << shifts).sum(axis=1, dtype=jnp.uint32)      # disjoint bits: the sum is an OR


def from_words(words: jax.Array) -> jax.Array:
  """words [In_pad / 8, Out] uint32 -> codes [In_pad, Out] int32 in [0, 15]."""
  n_words, n_out = words.shape
  shifts = (4 * jnp.arange(CODES_PER_WORD, dtype=jnp.uint32))[None, :, None]
  c = (words[:, None, :] >> shifts) & jnp.uint32(15)                    # [In_pad / 8, 8, Out]
  return c.reshape(n_words * CODES_PER_WORD, n_out).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Kernel.
# ----------------------------------------------------------------------------------------------

def unsupported_reason(n_rows: int, n_out: int, group: int, dtype) -> str | None:
  """Why the kernel cannot take this call (None: it can)."""
  if jnp.dtype(dtype) not in _SUPPORTED_DTYPES:
    return f"x must be bfloat16 or float16, got {jnp.dtype(dtype)}"
  if not 1 <= n_rows <= MAX_ROWS:
    return f"x must have 1..{MAX_ROWS} rows, got {n_rows}"
  if n_out % 16:
    return f"Out={n_out} must be a multiple of 16"
  if not isinstance(group, int) or group < 16 or group & (group - 1):
    return f"quant group {group} must be a power of two >= 16 (whole word rows, Triton blocks)"
  return None


def _block_out(n_out: int, at_most: int) -> int:
  bo = at_most
  while n_out % bo:
    bo //= 2
  return bo


def _num_splits(n_groups: int, out_tiles: int, cfg: TritonW4A16Config) -> int:
  if cfg.num_splits is not None:
    if n_groups % cfg.num_splits:
      raise InputError(f"num_splits={cfg.num_splits} must divide the {n_groups} quant groups")
    return cfg.num_splits
  want = max(1, -(-cfg.target_blocks // out_tiles))
  return max(d for d in range(1, n_groups + 1) if n_groups % d == 0 and d <= want)


def _partials(x: jax.Array, words: jax.Array, scale: jax.Array, zero: jax.Array, *, group: int,
              cfg: TritonW4A16Config, interpret: bool = False) -> jax.Array:
  """x [M, In_pad]; words [In_pad / 8, Out] uint32; scale, zero [In_pad / G, Out] fp16.
  Returns fp32 partial products [splits, M, Out]."""
  n_rows, n_in = x.shape
  n_groups, n_out = scale.shape
  rows_per_group = group // CODES_PER_WORD                # word rows of one quant group (R)
  bo = _block_out(n_out, cfg.block_out)
  out_tiles = n_out // bo
  splits = _num_splits(n_groups, out_tiles, cfg)
  groups_per_split = n_groups // splits

  def kernel(x_ref,       # [M, In_pad / splits]             x dtype
             w_ref,       # [In_pad / 8 / splits, BO]        uint32
             s_ref,       # [G_split, BO]                    fp16
             z_ref,       # [G_split, BO]                    fp16
             o_ref):      # [1, M, BO]                       fp32
    def group_step(g, carry):
      accs = carry
      words = w_ref[pl.ds(g * rows_per_group, rows_per_group), :]         # [R, BO] uint32
      s16 = s_ref[pl.ds(g, 1), :].astype(jnp.float32) * 16.0               # [1, BO]
      offset = z_ref[pl.ds(g, 1), :].astype(jnp.float32) - s16             # [1, BO]
      parts = [None] * n_rows
      xsums = [None] * n_rows                     # [R, 1]: sum_j x[8 r + j], no cross-thread sum
      for j in range(CODES_PER_WORD):
        shift = 19 - 4 * j
        moved = (lax.shift_left(words, jnp.uint32(shift)) if shift >= 0
                 else lax.shift_right_logical(words, jnp.uint32(-shift)))
        f = lax.bitcast_convert_type((moved & jnp.uint32(_NIBBLE_AT_19)) | jnp.uint32(_ONE),
                                     jnp.float32)                          # [R, BO], 1 + c / 16
        for m in range(n_rows):
          xj = x_ref[pl.ds(m, 1), pl.ds(g * group + j, rows_per_group, stride=CODES_PER_WORD)]
          xj = xj.astype(jnp.float32).reshape(rows_per_group, 1)          # x[8 r + j], [R, 1]
          term = f * xj
          parts[m] = term if parts[m] is None else parts[m] + term
          xsums[m] = xj if xsums[m] is None else xsums[m] + xj
      return tuple(a + p * s16 + xs * offset for a, p, xs in zip(accs, parts, xsums))

    zeros = tuple(jnp.zeros((rows_per_group, bo), jnp.float32) for _ in range(n_rows))
    accs = lax.fori_loop(0, groups_per_split, group_step, zeros)
    for m in range(n_rows):
      o_ref[0, pl.ds(m, 1), :] = jnp.sum(accs[m], axis=0, keepdims=True)

  words_per_split = n_in // CODES_PER_WORD // splits
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((splits, n_rows, n_out), jnp.float32),
      grid=(out_tiles, splits),
      in_specs=[
          pl.BlockSpec((n_rows, n_in // splits), lambda i, s: (0, s)),
          pl.BlockSpec((words_per_split, bo), lambda i, s: (s, i)),
          pl.BlockSpec((groups_per_split, bo), lambda i, s: (s, i)),
          pl.BlockSpec((groups_per_split, bo), lambda i, s: (s, i)),
      ],
      out_specs=pl.BlockSpec((1, n_rows, bo), lambda i, s: (s, 0, i)),
      compiler_params=pl_triton.CompilerParams(num_warps=cfg.num_warps,
                                               num_stages=cfg.num_stages),
      interpret=interpret,
      name="w4a16_words_gemv",
  )(x, words, scale, zero)


def _check_inputs(x, words, scale, zero, in_features, group):
  if x.ndim != 2:
    raise InputError(f"x must be [M, In], got shape {x.shape}")
  if scale.ndim != 2 or zero.shape != scale.shape:
    raise InputError(f"scale and zero must be equal [In_pad / G, Out], got {scale.shape} and "
                     f"{zero.shape}")
  n_groups, n_out = scale.shape
  reason = unsupported_reason(x.shape[0], n_out, group, x.dtype)
  if reason is not None:
    raise InputError(f"w4a16_words_matmul: {reason}")
  n_in_pad = n_groups * group
  if words.shape != (n_in_pad // CODES_PER_WORD, n_out) or words.dtype != jnp.uint32:
    raise InputError(f"words must be uint32 [In_pad / 8, Out] = "
                     f"{(n_in_pad // CODES_PER_WORD, n_out)}, got {words.dtype} {words.shape}")
  if x.shape[1] != in_features or in_features > n_in_pad:
    raise InputError(f"x has {x.shape[1]} inputs; the weight has in_features={in_features} "
                     f"(padded to {n_in_pad})")


@functools.partial(jax.jit, static_argnames=("in_features", "group", "config", "interpret"))
def w4a16_words_matmul(x: jax.Array, words: jax.Array, scale: jax.Array, zero: jax.Array, *,
                       in_features: int, group: int,
                       config: TritonW4A16Config = TritonW4A16Config(),
                       interpret: bool = False) -> jax.Array:
  """x [M, In] @ W [In, Out] -> [M, Out] in x's dtype (module docstring; fp32 accumulation).
  `interpret=True` runs the kernel body with jnp semantics on the CPU."""
  _check_inputs(x, words, scale, zero, in_features, group)
  pad = scale.shape[0] * group - in_features
  xp = jnp.pad(x, ((0, 0), (0, pad))) if pad else x
  parts = _partials(xp, words, scale, zero, group=group, cfg=config, interpret=interpret)
  return parts.sum(0).astype(x.dtype)


def dequantize(words: jax.Array, scale: jax.Array, zero: jax.Array, *, in_features: int,
               group: int) -> jax.Array:
  """The weight [In, Out] in fp32."""
  c = from_words(words).astype(jnp.float32)
  s = jnp.repeat(scale.astype(jnp.float32), group, axis=0)
  z = jnp.repeat(zero.astype(jnp.float32), group, axis=0)
  return (c * s + z)[:in_features]


def w4a16_words_reference(x: jax.Array, words: jax.Array, scale: jax.Array, zero: jax.Array, *,
                          in_features: int, group: int) -> jax.Array:
  """Pure jnp: dequantize in fp32, fp32 matmul, cast to x's dtype."""
  w = dequantize(words, scale, zero, in_features=in_features, group=group)
  y = jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
  return y.astype(x.dtype)
