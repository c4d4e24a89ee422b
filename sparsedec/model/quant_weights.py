"""4-bit group-wise weight-only quantization (W4A16) of the linear layers, for QuantSpec's draft.

A weight w [In, Out] (x @ w convention) is cut into groups of `group` consecutive input rows
(In zero-padded up to a multiple of the group); each (group, output column) gets an asymmetric
round-to-nearest grid: zero z = group min, step s = (max - z) / 15 (1 for a constant group),
code c = clip(round((w - z) / s), 0, 15), w ~ z + c * s. Scales and zeros are stored in fp16
(rounded like the KV quantizer: zero down, step up, so no code ever clips). That is the "minmax"
grid; it reproduces a GGUF Q4_1 weight (blocks of 32: w = d q + m) exactly at group 32. The
"absmax" grid is GGUF Q4_0's (w = d (q - 8), d = -(the group's largest-magnitude value) / 8, so
that value sits at code 0 and the step may be negative): it reproduces a Q4_0 weight exactly at
group 32 (`GRIDS`).

Code storage (`QuantWeight.layout`; every layout holds the same codes, scales and zeros, so the
dequantized values are bit-identical, and `to_layout` converts between them exactly):
  * "packed": uint8 [In_pad / 2, Out], two codes per byte along In (row 2i in the low nibble,
    row 2i + 1 in the high one). `linear` dequantizes the whole weight, then multiplies (the
    reference W4A16 matmul; on a GPU XLA materialises the bf16 weight first).
  * "int4": jnp.int4 [In_pad, Out] holding c - 8 (XLA packs 4-bit arrays two per byte: the same
    bytes). `linear` writes the dequantization as an elementwise function of the int4 operand
    ((c + 8) * s + z, the scales broadcast over each group's rows), which XLA:GPU can fuse into
    the GEMM's operand load (its Triton GEMM takes int4 operands).
  * "int4_grouped": the "int4" storage, multiplied per group: y = sum_g s_g * (x_g @ (c - 8)_g)
    + sum_g (z_g + 8 s_g) * sum(x_g), so the dot's operand is a bare int4 -> bf16 convert (the
    most fusable form) and the scales apply to the [groups, M, Out] fp32 partial products. Not
    bit-identical to dequantize-then-multiply (no bf16 rounding of the weight), just as exact.
  * "int4_reduce": the "int4" storage, multiplied as an elementwise product with x summed over In
    (fp32): for the draft's GEMV (M = batch rows) XLA emits one reduction kernel that reads the
    codes once instead of materialising the bf16 weight (measured: benchmarks/NOTES.md).
  * "int4_t": uint32 [In_pad / 64, Out, 8] holding c - 8, the codes TRANSPOSED in 64-input
    chunks (row (k, o) holds c[64 k + i, o] - 8, i = 0..63, as 8 words of 8 codes in wgmma
    fragment order; the group a multiple of 64, or 16 or 32 (64 / G groups a chunk: GGUF's
    Q4_0 / Q4_1 blocks), In_pad then padded with whole groups of zero weights to a multiple of
    64), the layout of the Mosaic GPU W4A16 GEMV kernel (`pallas_kernels.w4a16_gemv`: each
    [64 out, 64 in] tile is 2 KiB contiguous, its bytes per thread already a wgmma register
    fragment). Lowered for a CUDA GPU, one row of x (bf16/fp16, groups a multiple of 32, Out a
    multiple of 128) goes through `pallas_kernels.w4a8_gemv` (the same codes on CUDA cores: x as
    two int8 planes per 32 inputs, within max|x| / 64516 of x, dotted by dp4a), up to 64 rows (Out
    a multiple of 64) through the W4A16 kernel; anything else through the "int4_grouped" math in
    jnp on the chunks (all: per-group fp32 products, scaled after).

A params pytree from `quantize_params` is a drop-in for the forward. Quantized: wqkv, wo,
w_gate_up, w_down of every layer; embeddings, lm_head, norms and biases stay as they are (the paper
quantizes the transformer's linear layers; the vocabulary projection is a small share of a large
model's bytes and the most sensitive to rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# A module, not names: pallas_kernels.w4a16_gemv imports sparsedec (its errors), which imports
# this module, so either may be first; the names are looked up at call time.
import pallas_kernels.w4a16_gemv as w4a16
import pallas_kernels.w4a8_gemv as w4a8
from pallas_kernels.quant_attention import META_MAX, round_to_meta
from pallas_kernels.register_operand import unpack_words
from sparsedec.errors import InputError, is_int

QUANTIZED_LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
META_DTYPE = jnp.float16
LAYOUTS = ("packed", "int4", "int4_grouped", "int4_reduce", "int4_t")
_INT4_KN = ("int4", "int4_grouped", "int4_reduce")   # the same [In_pad, Out] int4 storage
CODE_OFFSET = 8          # int4 layouts store c - 8 in [-8, 7]
INT4_MIN_OUT = 64        # "int4" products narrower than this are computed padded to it
GRIDS = ("minmax", "absmax")   # how a group's (zero, step) are chosen (module docstring)


@struct.dataclass
class QuantWeight:
  codes: jax.Array   # "packed": [In_pad / 2, Out] uint8; "int4", "int4_grouped", "int4_reduce":
                     # [In_pad, Out] int4 (c - 8); "int4_t": [In_pad / 64, Out, 8] uint32
  scale: jax.Array   # [In_pad / G, Out] fp16
  zero: jax.Array    # [In_pad / G, Out] fp16
  in_features: int = struct.field(pytree_node=False)
  group: int = struct.field(pytree_node=False)
  layout: str = struct.field(pytree_node=False, default="packed")

  @property
  def shape(self) -> tuple[int, int]:
    return (self.in_features, self.scale.shape[1])

  @property
  def in_padded(self) -> int:
    return self.scale.shape[0] * self.group

  def unsigned_codes(self) -> jax.Array:
    """[In_pad, Out] int32 codes c in [0, 15]."""
    if self.layout == "packed":
      c = self.codes.astype(jnp.int32)
      return jnp.stack([c & 15, c >> 4], axis=1).reshape(-1, c.shape[1])
    codes = w4a16.from_chunked(self.codes) if self.layout == "int4_t" else self.codes
    return codes.astype(jnp.int32) + CODE_OFFSET

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """[In, Out] in `dtype` (computed in fp32; one jitted program per layout and shape)."""
    return _dequantize(self, jnp.dtype(dtype))

  def to_layout(self, layout: str) -> "QuantWeight":
    """The same quantized weight stored as `layout` (exact)."""
    _check_layout(layout, self.group)
    if layout == self.layout:
      return self
    if layout in _INT4_KN and self.layout in _INT4_KN:   # the same arrays
      return self.replace(layout=layout)
    return _convert_layout(self, layout)

  def num_bytes(self) -> int:
    return sum(array_bytes(x) for x in (self.codes, self.scale, self.zero))


def array_bytes(x) -> int:
  """Bytes of an array as the device stores it (4-bit dtypes: two values per byte)."""
  bits = 4 if jnp.dtype(x.dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else \
      8 * jnp.dtype(x.dtype).itemsize
  return -(-int(np.prod(x.shape)) * bits // 8)


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(w: QuantWeight, dtype) -> jax.Array:
  """QuantWeight.dequantize (jitted: op by op, each operation compiled on its own per shape)."""
  scale = jnp.repeat(w.scale.astype(jnp.float32), w.group, axis=0)
  zero = jnp.repeat(w.zero.astype(jnp.float32), w.group, axis=0)
  dense = w.unsigned_codes().astype(jnp.float32) * scale + zero
  return dense[: w.in_features].astype(dtype)


@functools.partial(jax.jit, static_argnums=1)
def _convert_layout(w: QuantWeight, layout: str) -> QuantWeight:
  """QuantWeight.to_layout's re-storage of the codes (jitted, as `_dequantize`)."""
  c, scale, zero = _whole_chunks(w.unsigned_codes(), w.scale, w.zero, w.group, layout)
  return w.replace(codes=_store_codes(c, layout), scale=scale, zero=zero, layout=layout)


def _check_layout(layout: str, group: int) -> None:
  if layout not in LAYOUTS:
    raise InputError(f"weight layout must be one of {LAYOUTS}, got {layout!r}")
  if layout == "int4_t" and not w4a16.group_supported(group):
    raise InputError(f"weight layout 'int4_t' needs the quant group to be a multiple of "
                     f"{w4a16.CHUNK} (whole groups per code chunk) or one of "
                     f"{w4a16.SMALL_GROUPS}, got {group}")


def _whole_chunks(c: jax.Array, scale: jax.Array, zero: jax.Array, group: int, layout: str):
  """"int4_t" with groups below a chunk: codes c [In_pad, Out] and grids [In_pad / G, Out] padded
  with whole groups of zero weights (code 0, step 1, zero 0; their inputs are zero) until In_pad
  is a multiple of 64. Anything else is returned as it is."""
  pad = -c.shape[0] % w4a16.CHUNK if layout == "int4_t" else 0
  if not pad:
    return c, scale, zero
  rows = pad // group
  return (jnp.pad(c, ((0, pad), (0, 0))),
          jnp.pad(scale, ((0, rows), (0, 0)), constant_values=1),
          jnp.pad(zero, ((0, rows), (0, 0))))


def _store_codes(c: jax.Array, layout: str) -> jax.Array:
  """Codes c [In_pad, Out] (any int dtype, values in [0, 15]) in `layout`'s storage."""
  if layout == "packed":
    c = c.astype(jnp.uint8)
    return c[0::2] | (c[1::2] << 4)
  codes = (c.astype(jnp.int8) - CODE_OFFSET).astype(jnp.int4)
  if layout == "int4_t":           # In_pad: whole groups, a multiple of 64 (_whole_chunks)
    return w4a16.to_chunked(codes)                                     # [In_pad/64, Out, 8]
  return codes


def check_group_layout(group, layout: str) -> None:
  """InputError unless group is an even integer >= 2 that `layout` can store."""
  if not is_int(group) or group < 2 or group % 2:
    raise InputError(f"weight quant group must be an even integer >= 2, got {group!r}")
  _check_layout(layout, group)


def padded_rows(w: jax.Array, group: int) -> jax.Array:
  """w [In, Out] -> fp32 [In_pad, Out], In_pad a multiple of `group`; the padded rows copy the
  last real row, so they never widen its group's range (their inputs are zero)."""
  n_in, n_out = w.shape
  pad = -n_in % group
  wf = jnp.pad(w.astype(jnp.float32), ((0, pad), (0, 0)))
  if pad:
    wf = wf.at[n_in:].set(jnp.broadcast_to(wf[n_in - 1], (pad, n_out)))
  return wf


def group_grid(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """rows [..., G, Out] (fp32) -> (zero, step) [..., Out] fp16: zero = the min rounded down, step =
  (max - zero) / 15 rounded up (1 for a constant group), so no row's code clips; one fp16 step
  lower when 15 times that still spans the group (the fp32 1/15 can push the quotient of an
  exact multiple over it: a Q4_1 block's grid is then reproduced exactly). The fp16 roundings
  are the KV quantizer's (`round_to_meta`), which XLA:GPU cannot skip: with `jnp.astype` alone a
  jitted grid on an H200 came out one fp16 step off the same grid computed op by op. The extremes
  are clipped to fp16's finite range (+-65504), as the KV quantizer's, and values beyond it are
  coded as its end: a weight past it made the group's zero and step infinite and its 4-bit
  weights NaN (a QuantSpec draft of NaN logits)."""
  zero = round_to_meta(jnp.clip(rows.min(-2), -META_MAX, META_MAX), -1)
  span = jnp.clip(rows.max(-2), -META_MAX, META_MAX) - zero.astype(jnp.float32)
  step = round_to_meta(span * jnp.float32(1 / 15), +1)
  lower = jnp.nextafter(step, jnp.zeros_like(step))
  step = jnp.where(lower.astype(jnp.float32) * 15 >= span, lower, step)
  return zero, jnp.where(step > 0, step, jnp.ones_like(step))


def absmax_grid(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """rows [..., G, Out] (fp32) -> (zero, step) [..., Out] fp16 of GGUF Q4_0's symmetric grid: the
  group's largest-magnitude value m (the first, signed) at code 0, step d = -m / 8, so w ~ d (c -
  8); step 1 for an all-zero group. m is clipped to fp16's finite range, as in `group_grid`."""
  m = jnp.take_along_axis(rows, jnp.abs(rows).argmax(-2)[..., None, :], axis=-2)[..., 0, :]
  m = jnp.clip(m, -META_MAX, META_MAX)
  # The barriers make the fp16 roundings real under jit (XLA:GPU may keep fp16 values in fp32).
  zero = jax.lax.optimization_barrier(m.astype(META_DTYPE))
  step = (zero.astype(jnp.float32) * jnp.float32(-1 / 8)).astype(META_DTYPE)  # exact: a power of 2
  return zero, jax.lax.optimization_barrier(jnp.where(step != 0, step, jnp.ones_like(step)))


def grid_codes(rows, zero, step):
  """rows [..., Out] fp32 on the grid (zero, step) [..., Out] (broadcast) -> codes in [0, 15],
  fp32: the exact quotient (rows - zero) / step rounded half to even. numpy arrays in, numpy out
  (GPTQ's host loop), with the same fp32 arithmetic. As the KV quantizer's codes
  (`pallas_kernels.quant_attention._codes8`), the quotient is only a guess g (XLA:GPU's fp32
  quotient is not always IEEE's), settled by comparing d = rows - zero with (g +- 1/2) * step:
  products exact in fp32 (a <= 6-bit by an 11-bit significand), so every backend, jitted or not,
  gives the same codes."""
  xp = np if isinstance(rows, np.ndarray) else jnp
  s = step.astype(xp.float32)
  d = rows - zero.astype(xp.float32)
  sign = xp.where(s < 0, xp.float32(-1), xp.float32(1))       # Q4_0's steps may be negative
  d, s = d * sign, s * sign                                    # exact
  g = xp.clip(xp.round(d * (xp.float32(1) / s)), -1, 16)     # the guess, near the grid
  above, below = (g + xp.float32(0.5)) * s, (g - xp.float32(0.5)) * s
  odd = xp.mod(g, 2) == 1
  c = (g + (d > above).astype(xp.float32) - (d < below).astype(xp.float32)
       + ((d == above) & odd).astype(xp.float32) - ((d == below) & odd).astype(xp.float32))
  return xp.clip(c, 0, 15)


def from_codes(codes: jax.Array, scale: jax.Array, zero: jax.Array, in_features: int,
               group: int, layout: str = "packed") -> QuantWeight:
  """A QuantWeight from codes [In_pad, Out] in [0, 15] and its fp16 grids [In_pad / G, Out]."""
  check_group_layout(group, layout)
  if codes.shape[0] != scale.shape[0] * group or scale.shape != zero.shape:
    raise InputError(f"codes {codes.shape} do not match grids {scale.shape} / {zero.shape} "
                     f"at group {group}")
  codes, scale, zero = _whole_chunks(codes, scale, zero, group, layout)
  return QuantWeight(codes=_store_codes(codes, layout), scale=scale.astype(META_DTYPE),
                     zero=zero.astype(META_DTYPE), in_features=in_features, group=group,
                     layout=layout)


def check_grid(grid) -> None:
  if grid not in GRIDS:
    raise InputError(f"weight grid must be one of {GRIDS}, got {grid!r}")


def quantize_weight(w: jax.Array, group: int = 128, layout: str = "packed",
                    grid: str = "minmax") -> QuantWeight:
  """w [In, Out] -> QuantWeight (4-bit RTN on `grid`'s grids, groups of `group` input rows)."""
  if w.ndim != 2:
    raise InputError(f"a weight to quantize must be [In, Out], got shape {w.shape}")
  check_group_layout(group, layout)
  check_grid(grid)
  return _quantize_weight(w, group, layout, grid)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_weight(w: jax.Array, group: int, layout: str, grid: str) -> QuantWeight:
  """quantize_weight's computation, as one program per (shape, dtype, group, layout, grid): run
  op by op (the params of a draft quantized outside a jit, GPTQ's grids, the tests) each of its
  ~40 operations compiled on its own for every weight shape (SmolLM2's draft: 376 compiles, 16 s
  on a CPU core). Under a caller's jit (QuantSpec's init) it is inlined as before."""
  wf = padded_rows(w, group)
  grouped = wf.reshape(-1, group, w.shape[1])                              # [In_pad/G, G, Out]
  zero, step = (group_grid if grid == "minmax" else absmax_grid)(grouped)
  c = grid_codes(grouped, zero[:, None], step[:, None])
  return from_codes(c.astype(jnp.uint8).reshape(-1, w.shape[1]), step, zero, w.shape[0], group,
                    layout)


def _pad_inputs(x: jax.Array, w: QuantWeight) -> jax.Array:
  """x [..., In] zero-padded to [..., In_pad] (the padded rows of w are finite: no effect)."""
  pad = w.in_padded - w.in_features
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def _int4_dequant_matmul(x: jax.Array, w: QuantWeight, precision) -> jax.Array:
  """x [..., In] @ w ("int4"): the dequantization as an elementwise function of the int4 codes
  (fusable into the dot's operand); the same values as dequantize(). On a GPU a weight narrower
  than INT4_MIN_OUT columns is multiplied zero-padded to that width and the product sliced back:
  XLA:GPU (jax 0.11.2) computed the jitted product wrong at 16-40 output columns, with cuBLAS and
  with Triton GEMMs alike; both failing programs dequantize the int4 operand in a Triton transpose
  fusion (H200, benchmarks/NOTES.md sessions 56-57)."""
  n_out = w.scale.shape[1]
  if n_out >= INT4_MIN_OUT:
    return _int4_dequant_product(x, w, precision, n_out)
  return jax.lax.platform_dependent(
      cuda=lambda: _int4_dequant_product(x, w, precision, INT4_MIN_OUT),
      default=lambda: _int4_dequant_product(x, w, precision, n_out))


def _int4_dequant_product(x: jax.Array, w: QuantWeight, precision, width: int) -> jax.Array:
  """`_int4_dequant_matmul` with the weight zero-padded to `width` >= Out columns."""
  n_groups, n_out = w.scale.shape
  codes, scale, zero = w.codes, w.scale, w.zero
  if width > n_out:
    codes, scale, zero = (jnp.pad(a, ((0, 0), (0, width - n_out))) for a in (codes, scale, zero))
  c = codes.reshape(n_groups, w.group, width)                              # [In/G, G, W] int4
  wf = ((c.astype(jnp.float32) + CODE_OFFSET) * scale.astype(jnp.float32)[:, None]
        + zero.astype(jnp.float32)[:, None])                               # [In/G, G, W]
  wx = wf.astype(x.dtype).reshape(w.in_padded, width)
  return jnp.dot(_pad_inputs(x, w), wx, precision=precision)[..., :n_out]


def _int4_grouped_matmul(x: jax.Array, w: QuantWeight, precision) -> jax.Array:
  """x [..., In] @ w ("int4_grouped"): per-group dots on the bare int4 codes, scaled after
  (module docstring). fp32 accumulation; the result in x's dtype."""
  n_groups, n_out = w.scale.shape
  lead = x.shape[:-1]
  xg = _pad_inputs(x, w).reshape(-1, n_groups, w.group)                    # [M, In/G, G]
  c = w.codes.reshape(n_groups, w.group, n_out).astype(x.dtype)           # [In/G, G, Out]
  part = _f32_products("mgi,gio->gmo", xg, c, precision)                   # [In/G, M, Out]
  xsum = xg.astype(jnp.float32).sum(-1)                                    # [M, In/G]
  return _scale_group_products(part, xsum, w, precision).astype(x.dtype).reshape(*lead, n_out)


def _scale_group_products(part: jax.Array, xsum: jax.Array, w: QuantWeight,
                          precision) -> jax.Array:
  """part [In/G, M, Out] fp32 (x_g @ (c - 8)_g), xsum [M, In/G] fp32 (sum of x_g) ->
  sum_g s_g * part_g + (z_g + 8 s_g) * xsum_g, [M, Out] fp32."""
  scale = w.scale.astype(jnp.float32)                                      # [In/G, Out]
  offset = w.zero.astype(jnp.float32) + CODE_OFFSET * scale                # [In/G, Out]
  return jnp.einsum("gmo,go->mo", part, scale) + jnp.dot(xsum, offset, precision=precision)


def _f32_products(spec: str, a: jax.Array, b: jax.Array, precision) -> jax.Array:
  """einsum accumulating in fp32. XLA:CPU does not run every bf16 x bf16 -> f32 dot ("Unsupported
  element type for DotThunk::Execute: BF16 x BF16 = F32", jax 0.11.2): where the call is lowered
  for a CPU, 16-bit operands are upcast first (the same products, exact in fp32)."""
  dot = lambda a, b: jnp.einsum(spec, a, b, precision=precision,
                                preferred_element_type=jnp.float32)
  if a.dtype == jnp.float32 and b.dtype == jnp.float32:
    return dot(a, b)
  f32 = lambda x: x.astype(jnp.float32)
  return jax.lax.platform_dependent(cpu=lambda: dot(f32(a), f32(b)), default=lambda: dot(a, b))


def _int4_t_kernel(x2: jax.Array, w: QuantWeight):
  """The Mosaic GPU kernel computing x2 [M, In] @ w ("int4_t") on a CUDA GPU, as a thunk, or None
  where neither takes these shapes: one row by `w4a8_gemv` (groups a multiple of 32, Out of
  128), up to 64 rows by `w4a16_gemv`."""
  n_out = w.scale.shape[1]
  for kernel, matmul in ((w4a8, w4a8.w4a8_matmul), (w4a16, w4a16.w4a16_matmul)):
    if kernel.unsupported_reason(x2.shape[0], n_out, w.group, x2.dtype) is None:
      return lambda: matmul(x2, w.codes, w.scale, w.zero, in_features=w.in_features,
                            group=w.group)
  return None


def _int4_t_matmul(x: jax.Array, w: QuantWeight, precision) -> jax.Array:
  """x [..., In] @ w ("int4_t"), on a GPU by a Mosaic GPU kernel: one row (groups a multiple of
  32, Out of 128) by `w4a8_gemv` (x in two int8 planes per 32 inputs, within max|x| / 64516 of
  x; dp4a), up to 64 rows by `w4a16_gemv`; else the "int4_grouped" math in jnp on the chunked
  codes. fp32 accumulation; the result in x's dtype."""
  n_out = w.scale.shape[1]
  x2 = x.reshape(-1, x.shape[-1])                                          # [M, In]
  kernel = _int4_t_kernel(x2, w)
  jnp_math = lambda: _int4_t_jnp_matmul(x2, w, precision)
  y = jnp_math() if kernel is None else jax.lax.platform_dependent(cuda=kernel, default=jnp_math)
  return y.reshape(*x.shape[:-1], n_out)


def _int4_t_jnp_matmul(x2: jax.Array, w: QuantWeight, precision) -> jax.Array:
  """x2 [M, In] @ w ("int4_t") in jnp: the "int4_grouped" math on the chunked codes."""
  n_groups, n_out = w.scale.shape
  chunk = w4a16.CHUNK
  cpg = max(1, w.group // chunk)                               # whole chunks per group
  sub = min(w.group, chunk)                                    # inputs of a group in a chunk
  c = unpack_words(w.codes)                                    # [In_pad/64, Out, 64]
  if w.group < chunk:                                          # 64 / G groups a chunk
    c = c.reshape(c.shape[0], n_out, chunk // sub, sub).transpose(0, 2, 1, 3)
  c = c.reshape(n_groups, cpg, n_out, sub).astype(x2.dtype)                # [In/G, cpg, Out, sub]
  xg = _pad_inputs(x2, w).reshape(-1, n_groups, cpg, sub)                  # [M, In/G, cpg, sub]
  part = _f32_products("mgki,gkoi->gmo", xg, c, precision)                 # [In/G, M, Out]
  xsum = xg.astype(jnp.float32).sum((-2, -1))                              # [M, In/G]
  return _scale_group_products(part, xsum, w, precision).astype(x2.dtype)


def _int4_reduce_matmul(x: jax.Array, w: QuantWeight, precision) -> jax.Array:
  """x [..., In] @ w ("int4_reduce"), for the draft's few rows (GEMV): a multiply-and-sum over In
  of x against the dequantized codes, written elementwise so that XLA emits ONE reduction kernel
  that reads the 4-bit codes once and never materialises the bf16 weight (a dot would). The
  weight values equal dequantize()'s; fp32 products and sums."""
  del precision                                                  # fp32 elementwise throughout
  n_groups, n_out = w.scale.shape
  lead = x.shape[:-1]
  xg = _pad_inputs(x, w).astype(jnp.float32).reshape(-1, n_groups, w.group)   # [M, In/G, G]
  c = w.codes.reshape(n_groups, w.group, n_out)                           # [In/G, G, Out] int4
  wf = ((c.astype(jnp.float32) + CODE_OFFSET) * w.scale.astype(jnp.float32)[:, None]
        + w.zero.astype(jnp.float32)[:, None])                            # [In/G, G, Out]
  y = jnp.sum(xg[:, :, :, None] * wf[None], axis=(1, 2))                  # [M, Out]
  return y.astype(x.dtype).reshape(*lead, n_out)


def quant_matmul(x: jax.Array, w: QuantWeight, precision=None) -> jax.Array:
  """x [..., In] @ w [In, Out] for a QuantWeight, by its layout (module docstring)."""
  if w.layout == "packed":
    return jnp.dot(x, w.dequantize(x.dtype), precision=precision)
  if w.layout == "int4":
    return _int4_dequant_matmul(x, w, precision)
  if w.layout == "int4_reduce":
    return _int4_reduce_matmul(x, w, precision)
  if w.layout == "int4_t":
    return _int4_t_matmul(x, w, precision)
  return _int4_grouped_matmul(x, w, precision)


def quantize_params(params: dict, group: int = 128, layout: str = "packed",
                    grid: str = "minmax") -> dict:
  """A copy of the params pytree with every layer's linear weights as QuantWeight."""
  layers = [{name: quantize_weight(x, group, layout, grid) if name in QUANTIZED_LINEARS else x
             for name, x in lp.items()} for lp in params["layers"]]
  return {**params, "layers": layers}


def params_to_layout(params: dict, layout: str) -> dict:
  """The params pytree with every QuantWeight stored as `layout` (exact)."""
  return jax.tree.map(lambda x: x.to_layout(layout) if isinstance(x, QuantWeight) else x, params,
                      is_leaf=lambda x: isinstance(x, QuantWeight))


def weights_bytes(params: dict) -> int:
  """Bytes of a params pytree (QuantWeight leaves count their codes and scales; 4-bit arrays
  half a byte per value)."""
  return sum(array_bytes(x) for x in jax.tree_util.tree_leaves(params))
