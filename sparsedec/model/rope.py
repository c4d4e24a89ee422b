"""Rotary position embeddings in the Hugging Face (rotate-half) convention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sparsedec.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
  """[D/2] float32 inverse frequencies, with the config's rope scaling applied."""
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
  s = cfg.rope_scaling
  if s is None:
    return inv.astype(np.float32)
  if s.kind == "linear":
    return (inv / s.factor).astype(np.float32)
  if s.kind == "freq_factors":                     # llama.cpp's rope_freqs: theta_i / factor_i
    return (inv / np.asarray(s.freq_factors, np.float32)).astype(np.float32)
  # llama3: long wavelengths divided by factor, short kept, a smooth ramp between.
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: ModelConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """cos, sin tables [B, T, 1, D] for positions [B, T], computed in fp32 then cast."""
  inv = jnp.asarray(inverse_frequencies(cfg))                      # [D/2]
  freqs = positions.astype(jnp.float32)[..., None] * inv            # [B, T, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]     # [B, T, 1, D]
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, H, D] rotated by cos/sin [B, T, 1, D]."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin
