"""The GPU figures the kernels' launch planners size their grids by: an H100 SXM or an H200
(both Hopper: 132 SMs, 228 KiB of shared memory per SM, of which 227 KiB can go to blocks), and
what their TMA copies accept."""

import jax
import jax.numpy as jnp

SM_COUNT = 132                     # streaming multiprocessors
SMEM_PER_SM = 227 * 1024           # shared memory an SM gives its resident blocks; also the most
                                   # one block may take
SMEM_RESERVED_PER_BLOCK = 1024     # what the hardware keeps of an SM's shared memory per block
MAX_HEAD_DIM = 256                 # a wgmma's largest N: the P V product's N is the head dim D
TMA_TILE_ROWS = 8                  # the row tiling of a swizzled SMEM tile a TMA fills


def tma_rows(x: jax.Array, axis: int) -> jax.Array:
  """x with `axis` (the rows of the 2-D boxes a kernel TMAs into a swizzled SMEM tile, read in
  place) zero-padded to a size Mosaic GPU's TMA lowering takes: at most 8 or a multiple of 8 (it
  rejects 9..15, 17..23, ...: "dimension ... must have size smaller or a multiple of its tiling
  8"). The zero rows are what the TMA's out-of-bounds fill would have read; the caller masks
  them. No copy where the size already is one."""
  n = x.shape[axis]
  if n <= TMA_TILE_ROWS or n % TMA_TILE_ROWS == 0:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, -n % TMA_TILE_ROWS)
  return jnp.pad(x, pad)
