"""How the kernel tests run the Pallas Mosaic GPU kernels: in the Mosaic GPU interpreter on the
CPU (CI), compiled on a GPU backend (`python -m pytest tests/test_kernel_*.py` on a Hopper
machine also runs what the interpreter cannot: the warp-specialized blocks)."""

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

INTERPRET = None if jax.default_backend() == "gpu" else plgpu.InterpretGPUParams()
