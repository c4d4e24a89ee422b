"""The GPU figures the kernels' launch planners size their grids by: an H100 SXM or an H200
(both Hopper: 132 SMs, 228 KiB of shared memory per SM, of which 227 KiB can go to blocks)."""

SM_COUNT = 132                     # streaming multiprocessors
SMEM_PER_SM = 227 * 1024           # shared memory an SM gives its resident blocks; also the most
                                   # one block may take
SMEM_RESERVED_PER_BLOCK = 1024     # what the hardware keeps of an SM's shared memory per block
MAX_HEAD_DIM = 256                 # a wgmma's largest N: the P V product's N is the head dim D
