"""A 4-bit-weight GEMV for one row on Mosaic GPU, on CUDA cores by integer dot products:
x [1, In] (bf16/fp16) @ a 4-bit group-quantized weight [In, Out], x split into int8 planes per
block of 32 inputs and each plane dotted with the codes by `dp4a` (QuantSpec's batch-1 draft
matmuls; `w4a16_gemv` takes 2..64 rows and groups of 16).

Why not the tensor cores (`w4a16_gemv`): at one row a wgmma m64n8k16 does 1/8 useful work, and
that kernel is bound by issuing instructions, ~2.5 a weight (the code -> bf16 conversion, the
dequantizing fma, the per-wgmma descriptor setup; Nsight Compute, sessions 9 and 38). Here a
weight costs about one thread instruction a plane: per 32-bit word of 8 codes one lop3 (low
nibbles), a shift and a lop3 (high nibbles) and two `dp4a.u32.s32` per plane, and per block of
32 inputs an integer multiply-add, an int-to-float conversion and three fp32 fma/mul. H200,
Llama-8B shapes at group 32 (session 43): the arithmetic costs nothing measurable over the
kernel's own TMA stream (the kernel with its arithmetic removed takes the same time).

Weight: the "int4_t" layout of `sparsedec.model.quant_weights`, unchanged (the codes of
`w4a16_gemv`, its docstring has the fragment order):

  codes_t [In_pad / 64, Out, 8] uint32: nibble n of word j of row (k, o) holds
          c[64 k + 32 h + 8 (n % 4) + 2 c' + n // 4, o] - 8,  j = 2 c' + h
  scale, zero [In_pad / G, Out] fp16: w = zero + c * scale, c in [0, 15], groups of G inputs

Activation, per block b of 32 inputs, in P planes (`planes`, 2 by default; `quantize_activations`
defines it, the kernel computes the same in its prologue): unit_b = max |x| / (127 * 254^(P - 1));
plane 0 rounds x to steps of 254^(P - 1) unit_b, each next plane rounds the remainder to steps
254 times finer, q_p in [-127, 127] (int8), and x^ = unit_b sum_p 254^(P - 1 - p) q_p. So
|x^ - x| <= unit_b / 2: with two planes max |x| / 64516 of the block's largest input, finer than
the rounding of x to bf16 itself (the product equals the bf16 x's within fp32 noise, see the
tests); one plane is llama.cpp's Q4_1 x Q8_1 dot. The planes are stored as the bytes of x words
(`_x_words`): word 2 j + e' of a chunk's plane p holds in byte e the q_p of the input under
nibble 2 e + e' of code word j (low / high nibbles), so one mask of a code word and one x word
make a dp4a.

  out[o] = sum_blocks  s_g[o] unit_b D_bo  +  z_g[o] xs_b       (b in group g, xs_b = sum of x^)
  D_bo = sum_p 254^(P - 1 - p) sum_{i in b} c_io q_pi          (int32, exact: < 15.5M < 2^24)

Kernel (`_partials`), grid (Out / block_out, splits), one warpgroup a block, each thread owning
block_out / 128 outputs over the block's input range (no cross-thread reduction):
  prologue: TMAs bring x over the block's range (one a 256 chunks; the splits are equal:
    `plan`), the first steps' codes are requested, and the warps quantize x into its planes in
    SMEM (warp w blocks w, w + 4, ..., lane l input l: two warp reductions, max |x| and the sum),
    one `bar.sync`;
  steps: a ring of `num_stages` pipeline steps of whole groups (128 input rows by default),
    three TMAs a step on one barrier (codes [chunks, block_out / 4, 32] words, scales and zeros
    [groups, block_out]), the step's dot products in `inline_mgpu` (per thread two 16-byte shared
    loads a chunk and output, four a plane for the chunk's x words, shared by its outputs), the
    thread's sums in an SMEM slot of its own;
  epilogue: fp32 partials [splits, Out] by one TMA, summed by the wrapper.
The wrapper passes x as it is (chunks of 64: a reshape), so a call is two launches (the kernel
and the split sum, which XLA fuses with what follows).

Limits (InputError otherwise, `unsupported_reason`): one row of bf16 / fp16; Out a multiple of
128; G 32 or a multiple of 64 (a block of 32 inputs in one group, and a step whole groups and
whole 64-input code chunks: G = 96 made 1.5-chunk steps, a wrong product; G = 16 takes
`w4a16_gemv`).

Interpret mode (`interpret=plgpu.InterpretGPUParams()`, CPU): the interpreter runs no inline_mgpu,
so the quantization and a step's arithmetic are the same in jnp on the SMEM buffers
(`_quantize_reference`, `_step_reference`); the pipeline, the TMAs and the plan run as compiled.

`w4a8_reference` = x^ (the planes dequantized, fp32) @ the dequantized weight, fp32 (pure jnp);
`w4a16_gemv.w4a16_reference` is the same product with the unquantized x.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, scf, vector
from jaxlib.mlir.dialects import math as mlir_math
import numpy as np

from pallas_kernels.combine import interpret_mode, normalised, python_ints
from pallas_kernels.hopper import SM_COUNT, SMEM_PER_SM, SMEM_RESERVED_PER_BLOCK
from pallas_kernels.register_operand import SMEM_ROW_WORDS
from pallas_kernels.sync import warpgroup_barrier
# A module, not names: w4a16_gemv imports sparsedec, whose quant_weights imports this module.
import pallas_kernels.w4a16_gemv as w4a16
from sparsedec.errors import InputError, is_int

CHUNK = 64                 # inputs per code chunk of the "int4_t" layout (w4a16_gemv.CHUNK)
CODE_OFFSET = 8            # the codes store c - 8 (w4a16_gemv.CODE_OFFSET)
META_DTYPE = jnp.float16   # scales and zeros (w4a16_gemv.META_DTYPE)
BLOCK = 32                 # inputs per int8 x block (and the smallest weight group)
THREADS = 128              # one warpgroup; a thread owns block_out / 128 outputs
X_WORDS = 16               # words of one int8 plane of a 64-input chunk
QMAX = 127
PLANE_BASE = 254           # plane p + 1 holds the residual of plane p in steps / 254
PLANES = (1, 2)
MAX_BLOCKS_PER_SM = 8
ROWS_PER_STAGE = 128       # input rows a pipeline step (whole groups)
TMA_MAX_ROWS = 256         # a TMA box spans at most 256 elements a dimension
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Input offset (within a 64-input chunk) of nibble n of code word j (the fragment order).
_NIBBLE_INPUT = np.array([[32 * (j % 2) + 8 * (n % 4) + 2 * (j // 2) + n // 4 for n in range(8)]
                          for j in range(8)])                                  # [8 words, 8]
# x word 2 j + p (of a chunk's plane), byte e <- the input under nibble 2 e + p of code word j.
_XWORD_INPUT = np.array([[_NIBBLE_INPUT[j, 2 * e + p] for e in range(4)]
                        for j in range(8) for p in range(2)])                  # [16, 4]


@dataclasses.dataclass(frozen=True)
class W4A8Config:
  """Tiling knobs (upper bounds; `plan` reduces them to what the shape allows)."""
  block_out: int = THREADS          # outputs a block: a multiple of 128 (1, 2 a thread)
  rows_per_stage: int = ROWS_PER_STAGE   # input rows a pipeline step (rounded to whole groups)
  num_stages: int = 4
  num_splits: int | None = None     # split-K blocks per output tile (None: one wave)
  min_steps_per_split: int = 2

  def __post_init__(self):
    if not is_int(self.block_out) or self.block_out not in (THREADS, 2 * THREADS):
      raise InputError(f"block_out must be {THREADS} or {2 * THREADS}, got {self.block_out!r}")
    for name in ("rows_per_stage", "num_stages", "min_steps_per_split"):
      v = getattr(self, name)
      if not is_int(v) or v < 1:
        raise InputError(f"{name} must be a positive integer, got {v!r}")
    if self.num_splits is not None and (not is_int(self.num_splits) or self.num_splits < 1):
      raise InputError(f"num_splits must be None or a positive integer, got {self.num_splits!r}")
    python_ints(self, ("block_out", "rows_per_stage", "num_stages", "num_splits",
                       "min_steps_per_split"))


def unsupported_reason(n_rows: int, n_out: int, group: int, dtype) -> str | None:
  """Why the kernel cannot take this call (None: it can)."""
  if jnp.dtype(dtype) not in _SUPPORTED_DTYPES:
    return f"x must be bfloat16 or float16, got {jnp.dtype(dtype)}"
  if n_rows != 1:
    return f"x must have one row, got {n_rows}"
  if n_out < 1 or n_out % THREADS:
    return f"Out={n_out} must be a positive multiple of {THREADS}"
  if not is_int(group) or not (group == BLOCK or (group >= CHUNK and group % CHUNK == 0)):
    return (f"quant group {group} must be {BLOCK} or a multiple of {CHUNK} (one x block in one "
            f"group; whole groups in whole {CHUNK}-input code chunks)")
  return None


@dataclasses.dataclass(frozen=True)
class Plan:
  block_out: int
  groups_per_stage: int
  chunks_per_stage: int
  num_stages: int
  steps: int
  steps_per_split: int
  splits: int
  out_tiles: int
  smem_bytes: int


def smem_bytes(block_out: int, chunks: int, groups: int, num_stages: int, range_chunks: int,
               planes: int = 2, itemsize: int = 2) -> int:
  """One block's shared memory: the ring of code / grid steps, and x of the block's whole input
  range (`range_chunks` chunks) with its int8 planes, units and sums."""
  per_stage = chunks * block_out * CHUNK // 2 + 2 * groups * block_out * 2
  x_range = range_chunks * (CHUNK * itemsize + planes * CHUNK + 16)
  return num_stages * (per_stage + 8) + x_range + 8 + block_out * 4


def plan(n_out: int, n_groups: int, group: int, cfg: W4A8Config, planes: int = 2,
         itemsize: int = 2) -> Plan:
  """Whole groups and whole chunks a step (at least `rows_per_stage` rows when the groups
  divide them), one wave of resident blocks split over the input range in equal splits (a
  split's steps divide the steps: each block quantizes x over one fixed range)."""
  block_out = cfg.block_out if n_out % cfg.block_out == 0 else THREADS
  unit = max(1, CHUNK // group)                     # groups making whole chunks
  gps = unit
  while (gps + unit) * group <= max(cfg.rows_per_stage, group) and n_groups % (gps + unit) == 0:
    gps += unit
  while n_groups % gps:                             # n_groups is a multiple of unit
    gps -= unit
  cps = gps * group // CHUNK
  steps = n_groups // gps
  out_tiles = n_out // block_out
  ring = smem_bytes(block_out, cps, gps, cfg.num_stages, cps, planes, itemsize)
  per_sm = min(MAX_BLOCKS_PER_SM, SMEM_PER_SM // (ring + SMEM_RESERVED_PER_BLOCK))
  if cfg.num_splits is not None:
    want = min(cfg.num_splits, steps)
  else:
    want = min(SM_COUNT * max(1, per_sm) // out_tiles, steps // cfg.min_steps_per_split)
  per_split = next(d for d in range(-(-steps // max(1, want)), steps + 1) if steps % d == 0)
  splits = steps // per_split
  stages = min(cfg.num_stages, per_split)
  smem = smem_bytes(block_out, cps, gps, stages, per_split * cps, planes, itemsize)
  if smem > SMEM_PER_SM:
    raise InputError(f"w4a8_matmul: a block of {per_split} steps of {gps} groups of {group} "
                     f"needs {smem} bytes of shared memory (> {SMEM_PER_SM})")
  return Plan(block_out, gps, cps, stages, steps, per_split, splits, out_tiles, smem)


# ----------------------------------------------------------------------------------------------
# The activation planes: their definition (the reference's, and the kernel's in interpret mode).
# ----------------------------------------------------------------------------------------------

def quantize_activations(x: jax.Array, in_pad: int, planes: int = 2):
  """x [..., In] -> (q [..., planes, In_pad] int32 in [-127, 127], unit [..., In_pad / 32],
  xs [..., In_pad / 32] fp32) per block of 32 inputs (zero-padded): x^ = unit * sum_p
  254^(planes - 1 - p) q_p, the planes' steps 254 apart (plane 0's step max |x| / 127, each next
  plane rounding the previous one's remainder), so |x^ - x| <= unit / 2 (fp32 roundings aside);
  xs = sum of x^ over the block."""
  lead = x.shape[:-1]
  xf = jnp.pad(x.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, in_pad - x.shape[-1])])
  xf = xf.reshape(*lead, in_pad // BLOCK, BLOCK)
  unit = jnp.max(jnp.abs(xf), axis=-1) / (QMAX * PLANE_BASE ** (planes - 1))
  qs, rest = [], xf
  for p in range(planes):
    step = (unit * PLANE_BASE ** (planes - 1 - p))[..., None]
    inv = 1.0 / jnp.where(step > 0, step, 1.0)
    q = jnp.clip(jnp.round(rest * inv), -QMAX, QMAX)
    rest = rest - q * step
    qs.append(q.astype(jnp.int32))
  total = sum(q * PLANE_BASE ** (planes - 1 - p) for p, q in enumerate(qs))   # [..., blocks, 32]
  xs = unit * total.sum(-1).astype(jnp.float32)
  q = jnp.stack(qs, axis=-3).reshape(*lead, planes, in_pad)
  return q, unit, xs


def dequantized_activations(x: jax.Array, in_pad: int, planes: int = 2) -> jax.Array:
  """x^ [..., In_pad] fp32: what the kernel multiplies."""
  q, unit, _ = quantize_activations(x, in_pad, planes)
  weights = jnp.asarray([PLANE_BASE ** (planes - 1 - p) for p in range(planes)], jnp.int32)
  total = jnp.einsum("...pi,p->...i", q, weights)
  return total.astype(jnp.float32) * jnp.repeat(unit, BLOCK, axis=-1)


def _x_words(q: jax.Array) -> jax.Array:
  """q [..., 64] (a chunk's int8 values) -> [..., 16] uint32 x words (static slices only: no
  index-array constant, so a kernel body may call it)."""
  qb = jnp.stack([q[..., int(i)] for i in _XWORD_INPUT.ravel()], axis=-1)
  qb = (qb.reshape(*q.shape[:-1], X_WORDS, 4) & 0xFF).astype(jnp.uint32)
  return (qb << (8 * jnp.arange(4, dtype=jnp.uint32))).sum(-1, dtype=jnp.uint32)


# ----------------------------------------------------------------------------------------------
# A step's arithmetic: inline Mosaic GPU on the GPU, jnp in interpret mode.
# ----------------------------------------------------------------------------------------------

def _step_mgpu(cps: int, group: int, block_out: int, planes: int):
  per_thread = block_out // THREADS

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 5)
  def step(ctx, codes, xq, ux, meta, acc):
    # codes [cps, block_out / 4, 32] u32, xq [cps, planes, 64] i8 (the x words' bytes), ux
    # [cps, 4] f32 (units, sums), meta [2, gps, block_out] f16, acc [block_out] f32 (each
    # thread its own outputs).
    del ctx
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    index = ir.IndexType.get()
    vec4 = ir.VectorType.get((4,), i32)
    c = lambda v: arith.constant(i32, v)
    ix = lambda v: arith.index_cast(index, v) if isinstance(v, ir.Value) else arith.constant(
        index, v)
    asm = lambda text, cons, *args: llvm.inline_asm(i32, list(args), text, cons)
    nibbles = "lop3.b32 $0, $1, 0x0F0F0F0F, 0x08080808, 0x6a;"     # (w & 0x0F..) ^ 0x08..: c
    dp4a = "dp4a.u32.s32 $0, $1, $2, $3;"                           # unsigned c, signed q
    tid = arith.remui(mgpu.utils.thread_idx(), c(THREADS))
    outs = [arith.addi(tid, c(THREADS * r)) for r in range(per_thread)]
    sums = [memref.load(acc, [ix(o)]) for o in outs]
    grid = [None] * per_thread                                      # (scale, zero) in fp32

    def words4(ref, *at):
      v = vector.load(vec4, ref, [ix(a) for a in at])
      return [vector.extract(v, dynamic_position=[], static_position=[e]) for e in range(4)]

    def bytes_as_words4(ref, *at):
      v = vector.load(ir.VectorType.get((16,), ir.IntegerType.get_signless(8)), ref,
                      [ix(a) for a in at])
      v = vector.bitcast(vec4, v)
      return [vector.extract(v, dynamic_position=[], static_position=[e]) for e in range(4)]

    for cc in range(cps):
      xw = [[w for q in range(4) for w in bytes_as_words4(xq, cc, p, 16 * q)]
            for p in range(planes)]
      unit_xs = [memref.load(ux, [ix(cc), ix(k)]) for k in range(4)]
      for r, o in enumerate(outs):
        row, col = arith.divui(o, c(4)), arith.muli(arith.remui(o, c(4)), c(8))
        w = words4(codes, cc, row, col) + words4(codes, cc, row, arith.addi(col, c(4)))
        for h in range(2):
          start = cc * CHUNK + h * BLOCK
          if start % group == 0:                    # a new group: its scale and zero
            g = start // group
            grid[r] = tuple(arith.extf(f32, memref.load(meta, [ix(m), ix(g), ix(o)]))
                            for m in (0, 1))
          total = None                              # sum_p 254^(P - 1 - p) (c . q_p), exact
          for p in range(planes):
            dot = c(0)
            for cq in range(4):
              j = 2 * cq + h
              lo = asm(nibbles, "=r,r", w[j])
              hi = asm(nibbles, "=r,r", arith.shrui(w[j], c(4)))
              dot = asm(dp4a, "=r,r,r,r", lo, xw[p][2 * j], dot)
              dot = asm(dp4a, "=r,r,r,r", hi, xw[p][2 * j + 1], dot)
            total = dot if total is None else arith.addi(arith.muli(total, c(PLANE_BASE)), dot)
          s, z = grid[r]
          su = arith.mulf(s, unit_xs[h])
          sums[r] = mlir_math.fma(su, arith.sitofp(f32, total), sums[r])
          sums[r] = mlir_math.fma(z, unit_xs[2 + h], sums[r])
    for o, v in zip(outs, sums):
      memref.store(v, acc, [ix(o)])

  return step


def _quantize_mgpu(chunks: int, planes: int):
  """x [chunks, 64] (bf16/fp16) -> xq [chunks, planes, 64] i8 (the bytes of `_x_words`' words),
  ux [chunks, 4] f32 (units, then sums, of each chunk's blocks 0 and 1): warp w takes blocks w,
  w + 4, ..., lane l its input l (the arithmetic of `quantize_activations`)."""
  blocks = 2 * chunks

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3)
  def quantize(ctx, x, xq, ux):
    del ctx
    i8, i32, f32 = (ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32),
                    ir.F32Type.get())
    index = ir.IndexType.get()
    c = lambda v: arith.constant(i32, v)
    cf = lambda v: arith.constant(f32, float(v))
    ix = lambda v: arith.index_cast(index, v)
    tid = arith.remui(mgpu.utils.thread_idx(), c(THREADS))
    warp, lane = arith.divui(tid, c(32)), arith.remui(tid, c(32))
    # Lane l = 8 k + 2 c' + e is the input under nibble k + 4 e of code word 2 c' + h: byte
    # k // 2 + 2 e of x word 2 (2 c' + h) + k % 2 (module docstring).
    k, cw, e = (arith.divui(lane, c(8)), arith.divui(arith.remui(lane, c(8)), c(2)),
                arith.remui(lane, c(2)))
    rounds = scf.ForOp(arith.constant(index, 0), arith.constant(index, -(-blocks // 4)),
                       arith.constant(index, 1))
    with ir.InsertionPoint(rounds.body):
      block = arith.addi(warp, arith.muli(arith.index_cast(i32, rounds.induction_variable), c(4)))
      guard = (mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.ult, block, c(blocks)))
               if blocks % 4 else contextlib.nullcontext())
      with guard:
        cc, h = arith.divui(block, c(2)), arith.remui(block, c(2))
        v = arith.extf(f32, memref.load(x, [ix(cc), ix(arith.addi(arith.muli(h, c(BLOCK)),
                                                                      lane))]))
        amax = mgpu.utils.warp_tree_reduce(mlir_math.absf(v), arith.maximumf, 32)
        unit = arith.divf(amax, cf(QMAX * PLANE_BASE ** (planes - 1)))
        word = arith.addi(arith.muli(arith.addi(arith.muli(cw, c(2)), h), c(2)),
                          arith.remui(k, c(2)))
        pos = arith.addi(arith.muli(word, c(4)),
                         arith.addi(arith.divui(k, c(2)), arith.muli(e, c(2))))
        rest, total = v, c(0)
        for p in range(planes):
          step = arith.mulf(unit, cf(PLANE_BASE ** (planes - 1 - p)))
          inv = arith.divf(cf(1), arith.select(
              arith.cmpf(arith.CmpFPredicate.OGT, step, cf(0)), step, cf(1)))
          qf = mlir_math.roundeven(arith.mulf(rest, inv))
          qf = arith.minimumf(arith.maximumf(qf, cf(-QMAX)), cf(QMAX))
          rest = arith.subf(rest, arith.mulf(qf, step))
          qi = arith.fptosi(i32, qf)
          memref.store(arith.trunci(i8, qi), xq, [ix(cc), arith.constant(index, p), ix(pos)])
          total = arith.addi(arith.muli(total, c(PLANE_BASE)), qi)
        total = mgpu.utils.warp_tree_reduce(total, arith.addi, 32)
        xs = arith.mulf(unit, arith.sitofp(f32, total))
        with mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.eq, lane, c(0))):
          memref.store(unit, ux, [ix(cc), ix(h)])
          memref.store(xs, ux, [ix(cc), ix(arith.addi(h, c(2)))])
      scf.yield_([])

  return quantize


def _quantize_reference(x_ref, xq_ref, ux_ref, *, chunks: int, planes: int) -> None:
  """The same in jnp (interpret mode)."""
  q, unit, xs = quantize_activations(x_ref[...].reshape(-1), chunks * CHUNK, planes)
  words = _x_words(q.reshape(planes, chunks, CHUNK)).transpose(1, 0, 2)      # [C, P, 16] u32
  xq_ref[...] = lax.bitcast_convert_type(words, jnp.int8).reshape(chunks, planes, CHUNK)
  ux_ref[...] = jnp.concatenate([unit.reshape(chunks, 2), xs.reshape(chunks, 2)], axis=1)


def _zero_mgpu(block_out: int):
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def zero(ctx, acc):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    tid = arith.remui(mgpu.utils.thread_idx(), arith.constant(i32, THREADS))
    for r in range(block_out // THREADS):
      o = arith.addi(tid, arith.constant(i32, THREADS * r))
      memref.store(arith.constant(ir.F32Type.get(), 0.0), acc,
                   [arith.index_cast(ir.IndexType.get(), o)])

  return zero


def _step_reference(codes_ref, xq_ref, ux_ref, meta_ref, acc_ref, *, cps: int, group: int,
                    block_out: int, planes: int) -> None:
  """The same sums in jnp on the step's buffers (interpret mode)."""
  words = codes_ref[...].reshape(cps, block_out, 8)
  shifts = 4 * jnp.arange(8, dtype=jnp.uint32)
  codes = ((words[..., None] >> shifts) & 0xF).astype(jnp.int32) ^ CODE_OFFSET  # [C, O, 8, 8]
  xq = xq_ref[...].astype(jnp.int32).reshape(cps, planes, 8, 2, 4)      # [C, P, j, e', byte e]
  total = 0
  for p in range(planes):
    x_nib = jnp.stack([xq[:, p, :, n % 2, n // 2] for n in range(8)], axis=-1)  # [C, 8, 8]
    prod = (codes * x_nib[:, None]).reshape(cps, block_out, 4, 2, 8)           # j = 2 c' + h
    total = total * PLANE_BASE + prod.sum((2, 4))                              # [C, O, h]
  ux = ux_ref[...]
  unit, xs = ux[:, :2], ux[:, 2:]                                              # [C, 2]
  meta = meta_ref[...].astype(jnp.float32)                                     # [2, gps, O]
  grid = jnp.stack([jnp.stack([meta[:, (cc * CHUNK + h * BLOCK) // group] for h in range(2)])
                    for cc in range(cps)])                                     # [C, 2, 2, O]
  s, z = grid[:, :, 0], grid[:, :, 1]                                          # [C, 2, O]
  terms = (s * unit[..., None] * total.astype(jnp.float32).transpose(0, 2, 1)
           + z * xs[..., None])
  acc_ref[...] += terms.sum((0, 1))


# ----------------------------------------------------------------------------------------------
# The kernel.
# ----------------------------------------------------------------------------------------------

def _partials(xc, codes_t, scale, zero, *, group: int, planes: int, p: Plan,
              interpret: Any = None):
  """xc [In_pad / 64, 64] bf16/fp16 (x in chunks); codes_t [In_pad / 64, Out, 8] uint32; scale,
  zero [In_pad / G, Out] fp16 -> [splits, Out] fp32 whose sum over splits is x^ @ w."""
  n_out = codes_t.shape[1]
  block_out, gps, cps, num_stages = p.block_out, p.groups_per_stage, p.chunks_per_stage, \
      p.num_stages
  span = p.steps_per_split * cps                # x chunks a block quantizes (its input range)
  pieces = [(a, min(a + TMA_MAX_ROWS, span)) for a in range(0, span, TMA_MAX_ROWS)]
  if interpret is None:
    quantize = _quantize_mgpu(span, planes)
    step_math, zero_acc = _step_mgpu(cps, group, block_out, planes), _zero_mgpu(block_out)
  else:
    quantize = functools.partial(_quantize_reference, chunks=span, planes=planes)
    step_math = functools.partial(_step_reference, cps=cps, group=group, block_out=block_out,
                                  planes=planes)
    zero_acc = lambda acc: acc.__setitem__(..., jnp.zeros_like(acc[...]))

  def body(x_ref,        # [In_pad / 64, 64] bf16/fp16
           codes_ref,    # [In_pad / 64, Out / 4, 32] uint32: per output 8 words
           scale_ref,    # [In_pad / G, Out] fp16
           zero_ref,     # [In_pad / G, Out] fp16
           out_ref,      # [splits, Out] fp32
           *,
           c_smem,       # [stages, cps, block_out / 4, 32] uint32
           meta_smem,    # [stages, 2, gps, block_out] fp16: scales (0) and zeros (1)
           x_smem,       # [span, 64] bf16/fp16: x over the block's input range
           xq_smem,      # [span, planes, 64] int8: its planes (the x words' bytes)
           ux_smem,      # [span, 4] fp32: units and sums of each chunk's two blocks
           acc_smem,     # [block_out] fp32: each thread's sums
           barriers,     # [stages]: a step's codes, scales, zeros
           x_barrier):   # x's range
    tile = lax.axis_index("out")
    split = lax.axis_index("split")
    o0 = tile * block_out
    first = split * p.steps_per_split

    def fetch(step, slot):
      g0 = (first + step) * gps
      c0 = (first + step) * cps
      bar = barriers.at[slot]
      plgpu.copy_gmem_to_smem(
          codes_ref.at[pl.ds(c0, cps), pl.ds(tile * (block_out // 4), block_out // 4)],
          c_smem.at[slot], bar)
      plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(g0, gps), pl.ds(o0, block_out)],
                              meta_smem.at[slot, 0], bar)
      plgpu.copy_gmem_to_smem(zero_ref.at[pl.ds(g0, gps), pl.ds(o0, block_out)],
                              meta_smem.at[slot, 1], bar)

    for a, b in pieces:                         # x's range, <= 256 rows a TMA
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(first * cps + a, b - a)],
                              x_smem.at[pl.ds(a, b - a)], x_barrier.at[0])
    for s in range(num_stages):
      fetch(s, s)
    zero_acc(acc_smem)
    # x's planes once for the whole range, while the first steps' codes are on their way.
    plgpu.barrier_wait(x_barrier.at[0])
    quantize(x_smem, xq_smem, ux_smem)
    warpgroup_barrier(interpret is not None)

    def step_fn(step, carry):
      slot = lax.rem(step, jnp.int32(num_stages))
      plgpu.barrier_wait(barriers.at[slot])
      chunks = pl.ds(step * cps, cps)
      step_math(c_smem.at[slot], xq_smem.at[chunks], ux_smem.at[chunks], meta_smem.at[slot],
                acc_smem)
      # Every thread is past its reads of the slot (Mosaic's barrier before a TMA issue).
      pl.when(step + num_stages < p.steps_per_split)(lambda: fetch(step + num_stages, slot))
      return carry

    lax.fori_loop(0, p.steps_per_split, step_fn, jnp.int32(0))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(acc_smem, out_ref.at[split, pl.ds(o0, block_out)])
    plgpu.wait_smem_to_gmem(0)

  scratch = dict(
      c_smem=plgpu.SMEM((num_stages, cps, block_out // 4, SMEM_ROW_WORDS), jnp.uint32),
      meta_smem=plgpu.SMEM((num_stages, 2, gps, block_out), META_DTYPE),
      x_smem=plgpu.SMEM((span, CHUNK), xc.dtype),
      xq_smem=plgpu.SMEM((span, planes, CHUNK), jnp.int8),
      ux_smem=plgpu.SMEM((span, 4), jnp.float32),
      acc_smem=plgpu.SMEM((block_out,), jnp.float32),
      barriers=plgpu.Barrier(num_arrivals=3, num_barriers=num_stages),
      x_barrier=plgpu.Barrier(num_arrivals=len(pieces), num_barriers=1),
  )
  return w4a16.split_k_kernel(
      "w4a8_gemv_kernel", body, scratch, jax.ShapeDtypeStruct((p.splits, n_out), jnp.float32),
      p, interpret,
  )(xc, codes_t.reshape(codes_t.shape[0], n_out // 4, SMEM_ROW_WORDS), scale, zero)


# ----------------------------------------------------------------------------------------------
# Wrapper and reference.
# ----------------------------------------------------------------------------------------------

@normalised(interpret=interpret_mode)
@functools.partial(jax.jit, static_argnames=("in_features", "group", "planes", "config",
                                             "interpret"))
def w4a8_matmul(x: jax.Array, codes_t: jax.Array, scale: jax.Array, zero: jax.Array, *,
                in_features: int, group: int, planes: int = 2,
                config: W4A8Config = W4A8Config(), interpret: Any = None) -> jax.Array:
  """x [1, In] (bf16/fp16) @ the 4-bit weight -> [1, Out] in x's dtype, x taken as `planes`
  int8 planes per 32 inputs (2: within max|x| / 64516 of x, finer than x's own bf16 rounding;
  1: llama.cpp's Q8 activations). codes_t, scale, zero: the "int4_t" layout (module docstring);
  group = G, 32 or a multiple of 64."""
  w4a16.check_operands(x, codes_t, scale, zero, in_features, group, caller="w4a8_matmul",
                       reason=unsupported_reason)
  if not is_int(planes) or planes not in PLANES:
    # planes=2.0 passed 'in PLANES' and failed as a shape TypeError; True ran one plane.
    raise InputError(f"planes must be one of {PLANES} (an int), got {planes!r}")
  planes, group = int(planes), int(group)
  n_groups, n_out = scale.shape
  in_pad = n_groups * group
  p = plan(n_out, n_groups, group, config, planes, jnp.dtype(x.dtype).itemsize)
  xc = jnp.pad(x[0], (0, in_pad - in_features)).reshape(in_pad // CHUNK, CHUNK)
  part = _partials(xc, codes_t, scale, zero, group=group, planes=planes, p=p,
                   interpret=interpret)
  return part.sum(0)[None].astype(x.dtype)


def w4a8_reference(x: jax.Array, codes_t: jax.Array, scale: jax.Array, zero: jax.Array, *,
                   in_features: int, group: int, planes: int = 2) -> jax.Array:
  """x^ [1, In] (x in `planes` int8 planes per 32 inputs, dequantized; fp32) @ the dequantized
  weight (fp32, HIGHEST); fp32 [1, Out]."""
  w = w4a16.dequantize(codes_t, scale, zero, in_features=in_features, group=group)  # [In, Out]
  xh = dequantized_activations(x[0], codes_t.shape[0] * CHUNK, planes)[:in_features]
  return jnp.dot(xh[None], w, precision=lax.Precision.HIGHEST)
