"""Linear layers and norms shared by every forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsedec.model.quant_weights import QuantWeight, quant_matmul


def linear(x: jax.Array, w) -> jax.Array:
  """x [..., In] @ w [In, Out] in x's dtype with fp32 accumulation (full fp32 precision on GPU).

  w may be a `quant_weights.QuantWeight` (4-bit, W4A16): multiplied as its layout says ("packed":
  dequantized, then multiplied, the reference; "int4": the dequantization fused into the dot's
  operand; "int4_grouped": per-group dots on the codes, scaled after; "int4_reduce": a fused
  multiply-and-sum, the GEMV form; "int4_t": transposed codes for the W4A16 Pallas GEMV
  `pallas_kernels.w4a16_gemv` on a GPU, the "int4_grouped" math elsewhere)."""
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  if isinstance(w, QuantWeight):
    return quant_matmul(x, w, precision)
  return jnp.dot(x, w.astype(x.dtype), precision=precision)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """HF RMSNorm: normalise in fp32, cast back, then scale by the weight."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * xf.astype(x.dtype)
