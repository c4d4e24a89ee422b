"""The A/B switch for the draft's one-row 4-bit GEMVs, shared by the QuantSpec benchmarks, and
`draft_matmul`: their arithmetic emulated where they do not run (the CPU).

`quant_weights._int4_t_matmul` sends a one-row "int4_t" product on a GPU to the dp4a kernel
(`pallas_kernels.w4a8_gemv`) when it takes the shape; `--one-row-gemv wgmma` makes it refuse every
shape, so the same call runs the W4A16 wgmma kernel instead (both sides of an A/B in one build).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

CHOICES = ("dp4a", "wgmma")


def add_one_row_gemv_arg(ap) -> None:
  ap.add_argument("--one-row-gemv", default="dp4a", choices=CHOICES,
                  help="the int4_t draft's one-row GEMVs: the dp4a kernel (w4a8_gemv, as "
                       "quant_matmul dispatches) or the W4A16 wgmma kernel (the A/B)")


def apply_one_row_gemv(choice: str) -> None:
  """Call before anything is traced: with "wgmma" the dp4a kernel refuses every call."""
  if choice not in CHOICES:
    raise ValueError(f"one-row GEMV must be one of {CHOICES}, got {choice!r}")
  if choice == "wgmma":
    import pallas_kernels.w4a8_gemv as w4a8
    w4a8.unsupported_reason = lambda *a: "--one-row-gemv wgmma"


DRAFT_WEIGHTS = ("layout", "exact", "dtype")


@contextlib.contextmanager
def draft_matmul(planes: int = 0, weights: str = "layout"):
  """Within: every QuantWeight linear (only the draft has them) multiplies what one of the GPU's
  draft kernels multiplies instead of what its layout's jnp path does ("packed" rounds the
  dequantized weights to x's dtype; "int4_t" multiplies the exact 4-bit weights in fp32).
  planes > 0: x^, x in `planes` int8 planes per row and block of 32 inputs (`w4a8_gemv`'s;
  2 = the one-row dp4a kernel, 1 = llama.cpp-style Q8 activations). weights "exact": the exact
  dequantized weights, fp32 products and sums (the dp4a kernel's); "dtype": the weights rounded
  to x's dtype, fp32 products and sums (the W4A16 wgmma kernel's operands: in bf16, a bf16
  target's own weights when the draft's grid is exact); "layout": the layout's path."""
  from pallas_kernels import w4a8_gemv
  from sparsedec.model import linear
  if weights not in DRAFT_WEIGHTS:
    raise ValueError(f"weights must be one of {DRAFT_WEIGHTS}, got {weights!r}")
  plain = linear.quant_matmul

  def emulated(x, w, precision=None):
    if planes:
      n = x.shape[-1]
      x = w4a8_gemv.dequantized_activations(
          x, -(-n // w4a8_gemv.BLOCK) * w4a8_gemv.BLOCK, planes)[..., :n].astype(x.dtype)
    if weights == "layout":
      return plain(x, w, precision)
    wx = w.dequantize(jnp.float32)                                          # [In, Out]
    if weights == "dtype":
      wx = wx.astype(x.dtype).astype(jnp.float32)
    return jnp.dot(x.astype(jnp.float32), wx, precision="highest").astype(x.dtype)

  patched = bool(planes) or weights != "layout"
  if not patched:
    yield
    return
  linear.quant_matmul = emulated
  try:
    # The emulation is part of every jit cache key within: no forward traced with the plain
    # product is reused (nor one traced here after the exit), without clearing the process's
    # caches (its eager ops' compiles included).
    with _EMULATED((planes, weights)):
      yield
  finally:
    linear.quant_matmul = plain


_EMULATED = jax.make_user_context(None)     # (planes, weights) within draft_matmul, else None


# What each GPU one-row kernel multiplies, for `draft_matmul` on any backend: (x planes,
# weights); and the dp4a kernel's two departures from the W4A16 one taken one at a time.
EMULATIONS = {"dp4a": (2, "exact"), "wgmma": (0, "dtype"),
              "dp4a-x-only": (2, "dtype"), "dp4a-weights-only": (0, "exact")}
