"""How the kernel tests run the Pallas Mosaic GPU kernels: in the Mosaic GPU interpreter on the
CPU (CI), compiled on a GPU backend (`python -m pytest tests/test_kernel_*.py` on a Hopper
machine also runs what the interpreter cannot: the warp-specialized blocks)."""

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

INTERPRET = None if jax.default_backend() == "gpu" else plgpu.InterpretGPUParams()
# The same choice as an `attention=` / `impl=` name of sparsedec's dispatch ("interpret" on a GPU
# backend would run the interpreter there, not the kernel: session 50).
KERNEL = "pallas" if jax.default_backend() == "gpu" else "interpret"


def cuda_text(fn, *args) -> str:
  """The StableHLO text of jit(fn) lowered for the cuda platform (works on a CPU-only machine;
  the Mosaic GPU kernels appear as custom calls) at the shapes and dtypes of args (pytrees)."""
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  return jax.jit(fn).trace(*jax.tree.map(sds, args)).lower(
      lowering_platforms=("cuda",)).as_text()
