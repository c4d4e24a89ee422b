"""Register A operands for Mosaic GPU wgmma, shared by quant_attention and w4a16_gemv.

`int4_tile`: an int4 code tile in SMEM -> registers in the WGMMA layout as exact integers in a
float dtype, through Mosaic's cheap 4-bit upcast (`WGMMA_UPCAST_4X`: 8 codes per 32-bit load, two
shuffles to the wgmma layout, then the lop3 / sub.bf16x2 conversion). The tile's minor dimension
must be the wgmma K dimension (contiguous).

`wgmma_register_a`: acc += a @ b with `a` in registers. The Mosaic GPU interpreter's wgmma takes
no register A operand, so with an SMEM staging buffer (`a_smem`, given in interpret mode only) `a`
goes through it, then the wgmma is awaited.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


def int4_tile(ref, dtype) -> jax.Array:
  """ref: [64, K] int4 SMEM tile -> [64, K] `dtype` registers (WGMMA layout), exact integers."""
  x = plgpu.load(ref, layout=plgpu.Layout.WGMMA_UPCAST_4X)
  return plgpu.layout_cast(x, plgpu.Layout.WGMMA).astype(dtype)


def wgmma_register_a(acc_ref, a: jax.Array, b_ref, a_smem=None) -> None:
  """acc_ref += a @ b_ref; a [64, K] in registers (via `a_smem` when given: interpret mode)."""
  if a_smem is None:
    plgpu.wgmma(acc_ref, a, b_ref)
    return
  a_smem[...] = a
  plgpu.commit_smem()
  plgpu.wgmma(acc_ref, a_smem, b_ref)
  plgpu.wgmma_wait(0)
