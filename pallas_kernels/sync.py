"""Explicit warpgroup synchronisation for kernels compiled without Mosaic GPU's automatic
barriers (used by quant_attention).

By default Mosaic GPU (Pallas, warpgroup semantics) brackets every vector store to SMEM with two
warpgroup barriers (`bar.sync`) and puts one before every TMA it issues, whether or not another
thread touches that memory. quant_attention's split loop thus ran 15 `bar.sync`s a stage at 4
bits and 18 at 8 (128-key stages: one per TMA of the ring refill, code planes and chunks, scales,
zeros; two per store of the q * s_K and p * s_V operand tiles), each lining the four warps up
again.
`compiler_params` turns them off (`unsafe_no_auto_barriers`), and the kernel places the ones its
data flow needs with `warpgroup_barrier`:
  * before a TMA overwrites an SMEM buffer that threads (or their wgmmas) read: every warp must
    be past its reads, and each warp only waits for its own wgmmas;
  * between `wait_smem_to_gmem(..., wait_read_only=True)` (only the issuing thread's bulk copies
    are waited for) and threads' stores into the buffer that copy read.
A store that another thread's load or a wgmma / TMA then reads is followed by
`plgpu.commit_smem()` anyway (a proxy fence and a warpgroup barrier), and Mosaic's cross-warp
reductions synchronise themselves.

H200, A/B in one run (`benchmarks/quant_sweep.py --module`, wall us per call): S = 64K, Tq = 1,
4-bit 48.9 -> 46.1, 8-bit 71.7 -> 69.8; S = 128K, Tq = 5, 8-bit 170.2 -> 163.8. The same change
in decode_attention, sparse_attention (two TMAs and no stores a tile), the W4A16 GEMV (four TMAs a
step), merge_partials and dequantize_kv left their device times unchanged (within 1-2%), so they
keep the automatic barriers (benchmarks/NOTES.md, session 23).
"""

from __future__ import annotations

from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu


def compiler_params(**params) -> plgpu.CompilerParams:
  """Mosaic GPU compiler params (`params`) without the automatic barriers."""
  return plgpu.CompilerParams(unsafe_no_auto_barriers=True, **params)


@plgpu.inline_mgpu()
def _bar_sync(ctx):
  del ctx
  mgpu.utils.warpgroup_barrier()


def warpgroup_barrier(interpret: bool) -> None:
  """`bar.sync` over the block's warpgroup (the Mosaic GPU interpreter runs a block's threads
  together and has nothing to synchronise: there it is a no-op)."""
  if not interpret:
    _bar_sync()
