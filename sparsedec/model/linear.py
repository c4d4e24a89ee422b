"""Linear layers and norms shared by every forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsedec.model.quant_weights import QuantWeight


def linear(x: jax.Array, w) -> jax.Array:
  """x [..., In] @ w [In, Out] in x's dtype with fp32 accumulation (full fp32 precision on GPU).

  w may be a `quant_weights.QuantWeight` (4-bit): dequantized, then multiplied (the reference
  W4A16 matmul)."""
  if isinstance(w, QuantWeight):
    w = w.dequantize(x.dtype)
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  return jnp.dot(x, w.astype(x.dtype), precision=precision)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """HF RMSNorm: normalise in fp32, cast back, then scale by the weight."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * xf.astype(x.dtype)
