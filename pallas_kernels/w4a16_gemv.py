"""W4A16 GEMV on Mosaic GPU: x [M, In] (bf16/fp16, M <= 64 rows) @ a 4-bit group-quantized
weight [In, Out], reading the 4-bit codes once (QuantSpec's draft matmuls).

Quantization (`sparsedec.model.quant_weights`): groups of G consecutive input rows per output
column, w ~ zero + c * scale with c in [0, 15] and scale, zero fp16 [In_pad / G, Out].

Code layout ("int4_t" in quant_weights), the codes TRANSPOSED, cut into 64-input chunks, and each
chunk row of 64 codes packed into 8 uint32 words in wgmma fragment order
(`register_operand.pack_words`):

  codes_t [In_pad / 64, Out, 8] uint32, the row (k, o) holding c[64 k + i, o] - 8, i = 0..63

so a chunk k and 64 consecutive outputs form one contiguous [64 out, 64 in] code tile (2 KiB),
whose 8 bytes per thread and row half are its wgmma register fragment (the layout of
quant_attention's key codes, k_codes [..., D/64, S, 8]). Scales and zeros stay
[In_pad / G, Out] fp16.

Kernel (`w4a16_matmul`), grid (Out / block_out, splits), one warpgroup per block; the output
columns are the wgmma M dimension and x's rows the N dimension (M padded to N, a multiple of 8):

  per 64-input chunk k of the block's input range (quant group g = k * 64 / G):
    W_k  [64 out, 64] = (C_k - 8) * scale_g[out] + (zero_g[out] + 8 scale_g[out])   (x's dtype)
    acc  [64, N]     += W_k @ x_k^T [64, N]                 (fp32, one accumulator per 64 outputs)

A = the code tile, TMA'd into SMEM as 128-byte rows of words (no swizzle), loaded to registers
already in the wgmma fragment layout (`register_operand.word_tile`, centered: per pair of codes
one lop3 and one sub, no shuffles) as exact integers c - 8, then dequantized in registers in x's
dtype (one multiply-add per pair, the group's scale and zero broadcast along the row); B = x^T
of the chunk: the wrapper lays x out as chunks xc [In_pad / 64, N, 64] (zero-padded; one small
XLA fusion), TMA'd with swizzle 128 and used transposed. The accumulators live across the whole
input range: one chunk's wgmmas stay in flight while the next chunk is dequantized (a wait
leaving m_tiles groups pending), and the previous pipeline step's SMEM slot is refilled as soon as
the first chunk of a step has been issued.
Rounding: the dequantized weight is rounded to x's dtype (bf16: 2**-9 relative, like a bf16
weight), as Marlin-style kernels do; products and sums are fp32.

Session 9 replaced a per-group design (fresh fp32 accumulators per quant group, scale applied to
the fp32 product, an all-ones wgmma for the zero points, then a wait per group): the H200 A/B
(`benchmarks/results/w4a16_s9_{old,new}_h200.json`) has this kernel 3-17% faster (w_down, M = 1:
21.7 -> 17.9 us), calls 20% faster to 3% slower (wo, whose call is wrapper-bound). Nsight
Compute (`results/ncu_s9/`, w_gate_up, M = 1): the kernel is instruction-issue bound (66% of issue
slots, 63 registers, 8 blocks per SM possible), about 5 warp instructions per weight: the int4
upcast and its shuffles about half, the dequantizing HFMA2 10%, wgmma descriptor setup ~20%.
Session 13 stored the codes in fragment order (`register_operand.word_tile`: no shuffles); H200,
M = 1, device time per call against the previous WGMMA_UPCAST_4X kernel in the same session
(`benchmarks/results/w4a16_s13_{new,old}_h200.json`): wqkv 10.3 vs 12.2 us, wo 8.0 vs 9.1,
w_gate_up 26.0 vs 32.9 (54% of read bandwidth), w_down 17.2 vs 21.0.

The input range is split into pipeline steps of `groups_per_stage` groups; each step arrives by
four TMAs on one barrier (its codes [G/64 * gps, block_out / 4, 32] words, x chunks
[G/64 * gps, N, 64], scales and zeros [gps, block_out]; Mosaic GPU puts a warpgroup barrier
before every TMA issue, so they are few and large), `num_stages` steps in flight. Split-K: the
steps are dealt to `splits` blocks per output tile (contiguous ranges), each writing fp32
partials [splits, Out, N] that the wrapper sums (XLA, fused with the transpose to [M, Out] and
the cast). By default the number of splits fills ONE wave of resident blocks and no more
(`wave_blocks`: 8 blocks per SM at the default tiling's 63 registers and ~28 KiB of SMEM, x 132
SMs = 1056; splits = wave // out tiles, rounded down): Llama-8B's Out / 64 tiles alone are 64..448
blocks, and shorter chains of steps per block, more of them resident, hide each step's load
latency better. H200, M = 1, device us per call against the earlier rule (about 528 blocks,
splits rounded up; `benchmarks/w4a16_gemv.py --sweep`, session 32): w_down 17.27 -> 15.58 (16
splits of 7 steps instead of 9 of 13), wqkv 10.27 -> 9.41 (11 of 3 instead of 6 of 6), wo 7.95
-> 8.10 (16 of 2 instead of 8 of 4), w_gate_up 26.19 / 26.26 (the same plan). An int
`target_blocks` replaces the wave as the budget. A call is thus three launches: the x relayout,
the kernel, the split sum.

Groups smaller than a chunk (G = 16 or 32: GGUF's Q4_0 / Q4_1 blocks are 32 inputs): one 64-input
chunk then spans 64 / G groups, so the [64, 64] scale and zero operands take group j's values in
columns [j G, (j + 1) G) of the tile (a select on a column iota). A pipeline step then holds a
multiple of 64 / G groups (whole chunks). H200, M = 1, Llama-8B's four linears of a layer
(session 42, `benchmarks/results/s42/`): 65.2 us at G = 32 against 58.9 at 128 for 18% more bytes
(fp16 scale and zero per 32 codes), 58% of read bandwidth on w_gate_up against 54%.

Limits (InputError otherwise): x bf16 or fp16 with 1..64 rows; Out a multiple of 64; G a multiple
of 64, or 16 or 32; codes uint32 [In_pad / 64, Out, 8] with In_pad = (In_pad / G) * G >= in_features
and a multiple of 64.

Interpret mode (`interpret=plgpu.InterpretGPUParams()`, CPU): its wgmma takes no register A
operand, so the code tile goes through an SMEM buffer there (as in quant_attention).

`w4a16_reference` = dequantize in fp32, then an fp32 matmul (pure jnp).
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

from pallas_kernels.combine import interpret_mode, normalised, python_ints
from pallas_kernels.hopper import SM_COUNT, SMEM_PER_SM, SMEM_RESERVED_PER_BLOCK
from pallas_kernels.register_operand import (CODES_PER_WORD, SMEM_ROW_WORDS, a_staging,
                                             pack_words, swizzled, unpack_words,
                                             wgmma_register_a, word_tile)
from sparsedec.errors import InputError, is_int

CHUNK = 64              # inputs per stored code chunk: one 128-byte bf16 wgmma K step
TILE_OUT = 64           # wgmma M: output columns per register tile
TILE_ROWS = TILE_OUT // 4   # a 64-output code tile in SMEM: 16 rows of 32 words
MAX_ROWS = 64           # x rows per call (the wgmma N dimension)
MAX_BLOCK_OUT = 256     # a TMA box dimension holds at most 256 elements
CODE_OFFSET = 8         # the int4 codes store c - 8
META_DTYPE = jnp.float16
ROWS_PER_STAGE = 128      # the default step: 128 input rows (H200 session 41: groups of 64 at one
                          # group a step took 8-20% longer per draft forward than groups of 128)
SMALL_GROUPS = (16, 32)    # groups below a chunk: 64 / G groups share each code chunk
MAX_BLOCKS_PER_SM = 8     # 128 threads x 63 registers (ncu, session 9): 8 blocks fill 64K registers
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class W4A16Config:
  """Tiling knobs. block_out and groups_per_stage are upper bounds: the kernel uses the largest
  multiple of 64 dividing Out (resp. the largest divisor of In_pad / G) not above them."""
  block_out: int = 64            # output columns per block (a multiple of 64)
  groups_per_stage: int | None = None  # quant groups per pipeline step; None: ROWS_PER_STAGE
                                      # input rows a step (1 group of 128, 2 of 64)
  num_stages: int = 4            # pipeline steps in flight
  num_splits: int | None = None  # split-K blocks per output tile (None: from target_blocks)
  target_blocks: int | None = None  # at most this many blocks (splits rounded down); None: one
                                    # wave of resident blocks (`wave_blocks`)
  min_steps_per_split: int = 2

  def __post_init__(self):
    # is_int: numpy integers too, not bools (num_splits=True ran one split; np.int64(2) stages
    # were refused as not an integer), as W4A8Config and the attention configs take them.
    if not is_int(self.block_out) or not TILE_OUT <= self.block_out <= MAX_BLOCK_OUT \
        or self.block_out % TILE_OUT:
      raise InputError(f"block_out must be a multiple of {TILE_OUT} in [{TILE_OUT}, "
                       f"{MAX_BLOCK_OUT}], got {self.block_out!r}")
    for name in ("num_stages", "min_steps_per_split"):
      v = getattr(self, name)
      if not is_int(v) or v < 1:
        raise InputError(f"{name} must be a positive integer, got {v!r}")
    for name in ("groups_per_stage", "num_splits", "target_blocks"):
      v = getattr(self, name)
      if v is not None and (not is_int(v) or v < 1):
        raise InputError(f"{name} must be None or a positive integer, got {v!r}")
    python_ints(self, ("block_out", "num_stages", "min_steps_per_split", "groups_per_stage",
                       "num_splits", "target_blocks"))


# ----------------------------------------------------------------------------------------------
# Layout helpers (shared with quant_weights' "int4_t").
# ----------------------------------------------------------------------------------------------

def to_chunked(codes: jax.Array) -> jax.Array:
  """[In_pad, Out] codes c - 8 (integers in [-8, 7]) -> [In_pad / 64, Out, 8] uint32: transposed
  64-input chunks, each row packed in wgmma fragment order (`pack_words`)."""
  n_in, n_out = codes.shape
  if n_in % CHUNK:
    raise InputError(f"the chunked code layout needs In_pad a multiple of {CHUNK}, got {n_in}")
  return pack_words(codes.reshape(n_in // CHUNK, CHUNK, n_out).transpose(0, 2, 1))


def from_chunked(codes_t: jax.Array) -> jax.Array:
  """[In_pad / 64, Out, 8] uint32 -> [In_pad, Out] int4 codes (the inverse of to_chunked)."""
  x = unpack_words(codes_t)                                         # [In_pad / 64, Out, 64]
  n_chunks, n_out, c = x.shape
  return x.transpose(0, 2, 1).reshape(n_chunks * c, n_out).astype(jnp.int4)


def unsupported_reason(n_rows: int, n_out: int, group: int, dtype) -> str | None:
  """Why the kernel cannot take this call (None: it can, with any W4A16Config's plan)."""
  if jnp.dtype(dtype) not in _SUPPORTED_DTYPES:
    return f"x must be bfloat16 or float16, got {jnp.dtype(dtype)}"
  if not 1 <= n_rows <= MAX_ROWS:
    return f"x must have 1..{MAX_ROWS} rows (the wgmma N dimension), got {n_rows}"
  if n_out < 1 or n_out % TILE_OUT:
    return f"Out={n_out} must be a positive multiple of {TILE_OUT} (the wgmma M tile)"
  if not group_supported(group):
    return (f"quant group {group} must be a multiple of {CHUNK} (the code chunk) or one of "
            f"{SMALL_GROUPS}")
  smallest = smem_bytes(n_rows, group, block_out=TILE_OUT,
                        groups_per_stage=groups_per_chunk(group), num_stages=1,
                        itemsize=jnp.dtype(dtype).itemsize)
  if smallest > SMEM_PER_SM:
    return (f"quant group {group} needs {smallest} bytes of shared memory per block even with "
            f"one stage (> {SMEM_PER_SM})")
  return None


def group_supported(group) -> bool:
  """Whether the code layout and the kernel take quant groups of `group` input rows: a multiple
  of the 64-input chunk, or one of SMALL_GROUPS (several groups a chunk)."""
  return is_int(group) and (group in SMALL_GROUPS or (group >= CHUNK and group % CHUNK == 0))


def groups_per_chunk(group: int) -> int:
  """Quant groups in one 64-input code chunk (1 for groups of 64 or more): a pipeline step holds
  a multiple of this many groups."""
  return max(1, CHUNK // group)


def smem_bytes(n_rows: int, group: int, *, block_out: int, groups_per_stage: int,
               num_stages: int, itemsize: int = 2) -> int:
  """Shared memory of one block (interpret mode's A buffer not counted)."""
  n = -(-n_rows // 8) * 8
  cps = groups_per_stage * group // CHUNK
  per_stage = (cps * (block_out * CHUNK // 2 + n * CHUNK * itemsize)     # codes, x chunks
               + 2 * groups_per_stage * block_out * 2)                   # scales, zeros
  return num_stages * (per_stage + 8) + block_out * n * 4                # + barriers, o_smem


def wave_blocks(block_smem: int) -> int:
  """Blocks resident at once on the whole GPU for a block of `block_smem` bytes of SMEM: per SM
  at most MAX_BLOCKS_PER_SM (registers) and what SMEM_PER_SM holds (each block also reserves
  SMEM_RESERVED_PER_BLOCK), times SM_COUNT."""
  per_sm = min(MAX_BLOCKS_PER_SM, SMEM_PER_SM // (block_smem + SMEM_RESERVED_PER_BLOCK))
  return SM_COUNT * max(1, per_sm)


def _largest_divisor(n: int, at_most: int, step: int = 1) -> int:
  """The largest multiple of `step` dividing n and <= at_most (>= step: n % step == 0)."""
  best = step
  for d in range(step, min(n, at_most) + 1, step):
    if n % d == 0:
      best = d
  return best


@dataclasses.dataclass(frozen=True)
class Plan:
  """The tiling of one call (`plan`): grid (out_tiles, splits)."""
  block_out: int
  groups_per_stage: int
  num_stages: int
  steps: int              # pipeline steps over In_pad
  steps_per_split: int    # (the last split may have fewer)
  splits: int
  out_tiles: int
  smem_bytes: int


def plan(n_rows: int, n_out: int, n_groups: int, group: int, cfg: W4A16Config,
         itemsize: int = 2) -> Plan:
  """The tiling the kernel uses for x [n_rows, In], Out outputs and In_pad / G groups: the
  config's block_out / groups_per_stage reduced to divisors (groups_per_stage: multiples of
  `groups_per_chunk`, so a step is whole chunks), no more stages than a split has
  steps, and stages, then groups per stage, then block_out reduced while the block's shared
  memory is over SMEM_PER_SM (InputError when even the smallest tiling is)."""
  block_out = _largest_divisor(n_out, cfg.block_out, TILE_OUT)
  gpc = groups_per_chunk(group)
  wanted = cfg.groups_per_stage or max(1, ROWS_PER_STAGE // group)
  gps = _largest_divisor(n_groups, max(wanted, gpc), gpc)
  stages = cfg.num_stages
  smem = functools.partial(smem_bytes, n_rows, group, itemsize=itemsize)
  while smem(block_out=block_out, groups_per_stage=gps, num_stages=stages) > SMEM_PER_SM:
    if stages > 1:
      stages -= 1
    elif gps > gpc:
      gps = _largest_divisor(n_groups, gps - gpc, gpc)
    elif block_out > TILE_OUT:
      block_out = _largest_divisor(n_out, block_out - TILE_OUT, TILE_OUT)
    else:
      raise InputError(f"w4a16_matmul: quant group {group} with {n_rows} rows needs more than "
                       f"{SMEM_PER_SM} bytes of shared memory per block")
  steps = n_groups // gps
  out_tiles = n_out // block_out
  if cfg.num_splits is not None:
    splits = min(cfg.num_splits, steps)
  else:
    budget = cfg.target_blocks or wave_blocks(
        smem(block_out=block_out, groups_per_stage=gps, num_stages=stages))
    splits = min(budget // out_tiles, steps // cfg.min_steps_per_split)
  splits = max(1, splits)
  per_split = -(-steps // splits)
  splits = -(-steps // per_split)             # no empty split
  stages = min(stages, per_split)
  return Plan(block_out, gps, stages, steps, per_split, splits, out_tiles,
              smem(block_out=block_out, groups_per_stage=gps, num_stages=stages))


# ----------------------------------------------------------------------------------------------
# The kernel.
# ----------------------------------------------------------------------------------------------

def _partials(xc, codes_t, scale, zero, *, group: int, p: Plan, interpret: Any = None):
  """Split-K partial products.

  xc [In_pad / 64, N, 64] bf16/fp16: x zero-padded to [N, In_pad], in 64-input chunks;
  codes_t [In_pad / 64, Out, 8] uint32 (c - 8, fragment order); scale, zero [In_pad / G, Out]
  fp16. Returns [splits, Out, N] fp32 whose sum over splits is (x @ w)^T.
  """
  _, n, _ = xc.shape
  n_out = codes_t.shape[1]
  dtype = xc.dtype
  block_out, gps, num_stages = p.block_out, p.groups_per_stage, p.num_stages
  m_tiles = block_out // TILE_OUT
  gpc = groups_per_chunk(group)               # groups per chunk (1 unless G < 64)
  cpg = max(1, group // CHUNK)                # chunks per group (1 if G < 64)
  cps = gps * group // CHUNK                  # chunks per pipeline step
  row = plgpu.Layout.WGMMA.reduce(1)          # a vector along a tile's rows (outputs)

  def body(x_ref,        # [In_pad / 64, N, 64] dtype
           codes_ref,    # [In_pad / 64, Out / 4, 32] uint32: per output 8 words
           scale_ref,    # [In_pad / G, Out] fp16
           zero_ref,     # [In_pad / G, Out] fp16
           out_ref,      # [splits, Out, N] fp32
           *,
           c_smem,       # [stages, cps, block_out / 4, 32] uint32: code tiles
           x_smem,       # [stages, cps, N, 64] dtype (swizzled): x chunks (B^T)
           meta_smem,    # [stages, 2, gps, block_out] fp16: scales (0) and zeros (1)
           o_smem,       # [block_out, N] fp32 (epilogue)
           barriers,     # [stages]: all TMAs of one step
           a_smem=None):  # [64, 64] dtype (swizzled): interpret mode only
    tile = lax.axis_index("out")
    split = lax.axis_index("split")
    o0 = tile * block_out
    first = split * p.steps_per_split
    my_steps = jnp.minimum(jnp.int32(p.steps_per_split), p.steps - first)

    def fetch(step, slot):
      g0 = (first + step) * gps                 # first group of the step
      c0 = (first + step) * cps                 # its first chunk
      bar = barriers.at[slot]
      plgpu.copy_gmem_to_smem(
          codes_ref.at[pl.ds(c0, cps), pl.ds(tile * (block_out // 4), block_out // 4)],
          c_smem.at[slot], bar)
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(c0, cps)], x_smem.at[slot], bar)
      plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(g0, gps), pl.ds(o0, block_out)],
                              meta_smem.at[slot, 0], bar)
      plgpu.copy_gmem_to_smem(zero_ref.at[pl.ds(g0, gps), pl.ds(o0, block_out)],
                              meta_smem.at[slot, 1], bar)

    for s in range(num_stages):
      pl.when(s < my_steps)(functools.partial(fetch, s, s))

    def codes(ref):                             # [16, 32] words -> [64, 64] c - 8 in registers
      return word_tile([ref], dtype, centered=True, interpret=interpret is not None)
    mma = functools.partial(wgmma_register_a, a_smem=a_smem)   # acc += a [64, 64] @ b

    def group_meta(slot, g):
      """The group's scales and zeros as [64, 64] `dtype` operands, one per output tile:
      w = (c - 8) * s + (zero + 8 s), the storage offset folded into the zero."""
      metas = []
      for mt in range(m_tiles):
        cols = pl.ds(mt * TILE_OUT, TILE_OUT)
        s = plgpu.load(meta_smem.at[slot, 0, g, cols], layout=row, optimized=False)  # [64]
        z = plgpu.load(meta_smem.at[slot, 1, g, cols], layout=row, optimized=False)
        s = s.astype(jnp.float32)
        z = z.astype(jnp.float32) + CODE_OFFSET * s
        metas.append(tuple(lax.broadcast_in_dim(v.astype(dtype), (TILE_OUT, CHUNK), [0])
                           for v in (s, z)))
      return metas

    def chunk_meta(slot, cc):
      """G < 64: chunk cc's operands, group j's values in the tile's columns [j G, (j + 1) G)."""
      if interpret is None:
        col = plgpu.broadcasted_iota(jnp.int32, (TILE_OUT, CHUNK), 1, layout=plgpu.Layout.WGMMA)
      else:
        col = lax.broadcasted_iota(jnp.int32, (TILE_OUT, CHUNK), 1)
      per_group = [group_meta(slot, cc * gpc + j) for j in range(gpc)]
      metas = []
      for mt in range(m_tiles):
        s, z = per_group[-1][mt]
        for j in reversed(range(gpc - 1)):
          in_j = col < (j + 1) * group
          s = jnp.where(in_j, per_group[j][mt][0], s)
          z = jnp.where(in_j, per_group[j][mt][1], z)
        metas.append((s, z))
      return metas

    def main_scope(*acc_refs):                  # [64, N] fp32 per output tile, all steps
      def step_fn(step, carry):
        slot = lax.rem(step, jnp.int32(num_stages))
        plgpu.barrier_wait(barriers.at[slot])
        for cc in range(cps):
          if gpc > 1:
            metas = chunk_meta(slot, cc)
          elif cc % cpg == 0:
            metas = group_meta(slot, cc // cpg)
          for mt, acc_ref in enumerate(acc_refs):
            s, z = metas[mt]
            a = codes(c_smem.at[slot, cc, pl.ds(mt * TILE_ROWS, TILE_ROWS)]) * s + z
            mma(acc_ref, a, x_smem.at[slot, cc].transpose((1, 0)))
          # One chunk's wgmmas stay in flight while the next chunk is dequantized; all
          # earlier ones (their A registers, and the previous step's SMEM) are done.
          plgpu.wgmma_wait(m_tiles)
          if cc == 0 and num_stages > 1:               # the previous step's slot is free
            prev, nxt = step - 1, step - 1 + num_stages
            pl.when((step > 0) & (nxt < my_steps))(
                lambda: fetch(nxt, lax.rem(prev, jnp.int32(num_stages))))
        if num_stages == 1:                     # one slot: refill it once it is read
          plgpu.wgmma_wait(0)
          pl.when(step + 1 < my_steps)(lambda: fetch(step + 1, slot))
        return carry

      lax.fori_loop(0, my_steps, step_fn, jnp.int32(0))
      return tuple(acc_ref[...] for acc_ref in acc_refs)

    ys = pl.run_scoped(main_scope, *[plgpu.ACC((TILE_OUT, n), jnp.float32)] * m_tiles)

    for mt, y in enumerate(ys):
      o_smem[pl.ds(mt * TILE_OUT, TILE_OUT)] = y
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[split, pl.ds(o0, block_out)])
    plgpu.wait_smem_to_gmem(0)

  itemsize = jnp.dtype(dtype).itemsize
  mma_sw = swizzled(CHUNK * itemsize, 8 * itemsize)
  # TMA SMEM ends must be 128-byte aligned, swizzled buffers 1 KiB-aligned: the swizzled
  # buffers go first (every tile a multiple of 1 KiB), the small ones after (multiples of 128 B).
  scratch = dict(
      c_smem=plgpu.SMEM((num_stages, cps, block_out // 4, SMEM_ROW_WORDS), jnp.uint32),
      x_smem=plgpu.SMEM((num_stages, cps, n, CHUNK), dtype, **mma_sw),
  )
  scratch.update(a_staging((TILE_OUT, CHUNK), dtype, interpret, **mma_sw))
  scratch.update(
      meta_smem=plgpu.SMEM((num_stages, 2, gps, block_out), META_DTYPE),
      o_smem=plgpu.SMEM((block_out, n), jnp.float32),
      # TMAs landing on each: the step's codes, x chunks, scales and zeros.
      barriers=plgpu.Barrier(num_arrivals=4, num_barriers=num_stages),
  )
  return split_k_kernel(
      "w4a16_gemv_kernel", body, scratch,
      jax.ShapeDtypeStruct((p.splits, n_out, n), jnp.float32), p, interpret,
  )(xc, codes_t.reshape(codes_t.shape[0], n_out // 4, SMEM_ROW_WORDS), scale, zero)


# ----------------------------------------------------------------------------------------------
# Wrapper.
# ----------------------------------------------------------------------------------------------

def check_operands(x, codes_t, scale, zero, in_features, group, *, caller: str,
                   reason=None) -> None:
  """InputError unless x [M, In] and the "int4_t" weight (codes_t, scale, zero, in_features,
  group) fit each other; `reason(M, Out, G, dtype)` (a kernel's `unsupported_reason`, default
  this kernel's) is asked once the shapes are known. Shared with `w4a8_gemv`."""
  reason = reason or unsupported_reason
  if x.ndim != 2:
    raise InputError(f"x must be [M, In], got shape {x.shape}")
  if not is_int(group) or group < 1:
    raise InputError(f"group must be a positive integer, got {group!r}")
  if not is_int(in_features) or in_features < 1:
    raise InputError(f"in_features must be a positive integer, got {in_features!r}")
  words = CHUNK // CODES_PER_WORD
  if codes_t.ndim != 3 or codes_t.shape[2] != words:
    raise InputError(f"codes_t must be [In_pad / {CHUNK}, Out, {words}] words, got "
                     f"{codes_t.shape}")
  if jnp.dtype(codes_t.dtype) != jnp.dtype(jnp.uint32):
    raise InputError(f"codes_t must be uint32 words of 8 codes c - 8 (`to_chunked`), got "
                     f"{codes_t.dtype}")
  n_chunks, n_out, _ = codes_t.shape
  in_pad = n_chunks * CHUNK
  why = reason(x.shape[0], n_out, group, x.dtype)
  if why:
    raise InputError(f"{caller}: {why}")
  if in_pad % group:
    raise InputError(f"In_pad={in_pad} (codes_t) is not a multiple of group={group}")
  for name, a in (("scale", scale), ("zero", zero)):
    if a.shape != (in_pad // group, n_out):
      raise InputError(f"{name} must be [In_pad / G, Out] = {(in_pad // group, n_out)}, "
                       f"got {a.shape}")
    if jnp.dtype(a.dtype) != jnp.dtype(META_DTYPE):
      raise InputError(f"{name} must be float16, got {a.dtype}")
  if not in_pad - max(group, CHUNK) < in_features <= in_pad:    # whole groups, whole chunks
    raise InputError(f"in_features={in_features} does not fit In_pad={in_pad} (group {group})")
  if x.shape[1] != in_features:
    raise InputError(f"x must be [M, In={in_features}], got shape {x.shape}")


def split_k_kernel(name: str, body, scratch: dict, out_type, p, interpret):
  """The plgpu.kernel over grid (p.out_tiles, p.splits) ("out", "split") whose
  body(*refs, **scratch) gets the `scratch` buffers by name; `name` names the kernel (what the
  profiler shows). Shared with `w4a8_gemv`."""
  names = tuple(scratch)

  def kernel(*refs):
    pl.run_scoped(lambda *scr: body(*refs, **dict(zip(names, scr))), *scratch.values())

  kernel.__name__ = kernel.__qualname__ = name
  return plgpu.kernel(kernel, out_type=out_type, grid=(p.out_tiles, p.splits),
                      grid_names=("out", "split"), interpret=interpret)


@normalised(interpret=interpret_mode)
@functools.partial(jax.jit, static_argnames=("in_features", "group", "config", "interpret"))
def w4a16_matmul(x: jax.Array, codes_t: jax.Array, scale: jax.Array, zero: jax.Array, *,
                 in_features: int, group: int, config: W4A16Config = W4A16Config(),
                 interpret: Any = None) -> jax.Array:
  """x [M, In] (bf16/fp16, M <= 64) @ the 4-bit weight -> [M, Out] in x's dtype.

  codes_t [In_pad / 64, Out, 8] uint32 (c - 8, the module docstring's layout); scale, zero
  [In_pad / G, Out] fp16; in_features = In; group = G (a multiple of 64, or 16 or 32: several
  groups a chunk, `group_supported`). fp32 accumulation.
  """
  check_operands(x, codes_t, scale, zero, in_features, group, caller="w4a16_matmul")
  group = int(group)                               # a numpy integer is one too
  m = x.shape[0]
  n_groups, n_out = scale.shape
  in_pad = n_groups * group
  p = plan(m, n_out, n_groups, group, config, jnp.dtype(x.dtype).itemsize)
  n = -(-m // 8) * 8
  xp = jnp.pad(x, ((0, n - m), (0, in_pad - in_features)))                   # [N, In_pad]
  xc = xp.reshape(n, in_pad // CHUNK, CHUNK).transpose(1, 0, 2)             # [In_pad/64, N, 64]
  part = _partials(xc, codes_t, scale, zero, group=group, p=p,
                   interpret=interpret)                                     # [S, Out, N]
  return part.sum(0).T[:m].astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Reference.
# ----------------------------------------------------------------------------------------------

def dequantize(codes_t: jax.Array, scale: jax.Array, zero: jax.Array, *, in_features: int,
               group: int) -> jax.Array:
  """The weight [In, Out] in fp32: c * scale + zero per group of G input rows."""
  c = from_chunked(codes_t).astype(jnp.float32) + CODE_OFFSET               # [In_pad, Out]
  s = jnp.repeat(scale.astype(jnp.float32), group, axis=0)                  # [In_pad, Out]
  z = jnp.repeat(zero.astype(jnp.float32), group, axis=0)
  return (c * s + z)[:in_features]


def w4a16_reference(x: jax.Array, codes_t: jax.Array, scale: jax.Array, zero: jax.Array, *,
                    in_features: int, group: int) -> jax.Array:
  """x [M, In] @ dequantize(codes_t, scale, zero) [In, Out], all fp32 (HIGHEST); fp32 result."""
  w = dequantize(codes_t, scale, zero, in_features=in_features, group=group)  # [In, Out]
  return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
