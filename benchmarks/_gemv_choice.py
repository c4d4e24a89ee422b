"""The A/B switch for the draft's one-row 4-bit GEMVs, shared by the QuantSpec benchmarks.

`quant_weights._int4_t_matmul` sends a one-row "int4_t" product on a GPU to the dp4a kernel
(`pallas_kernels.w4a8_gemv`) when it takes the shape; `--one-row-gemv wgmma` makes it refuse every
shape, so the same call runs the W4A16 wgmma kernel instead (both sides of an A/B in one build).
"""

from __future__ import annotations

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
