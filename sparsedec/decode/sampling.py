"""Sampling: the processed target distribution (temperature, top-k, top-p) and draws from it.

Speculative methods verify against `probabilities(...)`, the same distribution `sample` draws from,
so acceptance rules preserve exactly what dense sampling would produce.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from sparsedec.errors import InputError, is_int


MIN_TEMPERATURE = 1e-30   # (logits - max) / T: the top one 0, the others finite or -inf
MAX_TEMPERATURE = 1e30   # larger ones are clamped to it (the scaled logits differences are ~1e-28
                         # either way); its reciprocal, which XLA may multiply by, is a normal fp32


def _as_float(value: numbers.Real) -> float:
  """float(value), inf for a number too large for a float (an int or Fraction past 1e308)."""
  try:
    return float(value)
  except OverflowError:
    return math.inf if value > 0 else -math.inf


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0 means greedy (argmax), else finite and >= MIN_TEMPERATURE; top_k 0 means
  off; top_p in (0, 1]. numpy and concrete jax scalars are taken (stored as Python numbers);
  a traced value is refused by name (the config is static)."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    for name in ("temperature", "top_k", "top_p"):
      value = getattr(self, name)
      if isinstance(value, jax.core.Tracer):
        raise InputError(f"{name} is traced: a SamplingConfig is static (part of the compiled "
                         f"program), so build it outside jit from Python or numpy numbers")
      if isinstance(value, jax.Array) and value.ndim == 0:
        object.__setattr__(self, name, value.item())     # a concrete jax scalar, as numpy's
    real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
    if not (real(self.temperature) and (self.temperature == 0 or (
        MIN_TEMPERATURE <= _as_float(self.temperature) < math.inf))):
      raise InputError(f"temperature must be >= 0: 0 (greedy), or finite and >= "
                       f"{MIN_TEMPERATURE} (smaller ones overflow the scaled logits), got "
                       f"{self.temperature!r}")
    if not (is_int(self.top_k) and self.top_k >= 0):
      raise InputError(f"top_k must be an integer >= 0, got {self.top_k!r}")
    if not (real(self.top_p) and 0.0 < self.top_p <= 1.0):
      raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_k", int(self.top_k))
    object.__setattr__(self, "top_p", float(self.top_p))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def processed_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """fp32 logits [..., V] after temperature, top-k and top-p (HF order); removed tokens -inf."""
  x = logits.astype(jnp.float32)
  if cfg.greedy:
    return x
  # The max subtracted before the division: the top token's scaled logit is then exactly 0. As
  # x / T - max(x / T), XLA's rounding of the two terms under jit can differ (a reciprocal
  # multiply against a division), and at T ~ 1e-10 that difference alone overflows exp (the
  # softmax NaN, draws of token 0).
  top = jnp.max(x, axis=-1, keepdims=True)                              # [..., 1]
  # +inf logits (an overflowed model) share all the mass, softmax's limit: inf - inf made every
  # probability NaN, and the speculative methods drew token 0 where `sample` drew the inf one.
  x = jnp.where(top == jnp.inf, jnp.where(x == jnp.inf, 0.0, -jnp.inf),
                x - jnp.where(jnp.isfinite(top), top, 0.0))             # the top one 0
  # Top-k and top-p choose their tokens by the unscaled logits: dividing by T keeps their order
  # but can round distinct ones to one value (a huge T: all of them 0, past float32's largest
  # T itself is inf), and a value test then kept every tied token (top_k=1 at T = 1e39 drew
  # from the whole vocabulary). T is clamped to MAX_TEMPERATURE, so removed tokens stay -inf
  # (-inf / inf is NaN, and so is -inf * 0 where XLA multiplies by a reciprocal flushed to 0).
  temperature = min(cfg.temperature, MAX_TEMPERATURE)
  if 0 < cfg.top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]                      # [..., 1]
    x = jnp.where(x < kth, -jnp.inf, x)
  if cfg.top_p < 1.0:
    sorted_desc = -jnp.sort(-x, axis=-1)                                # [..., V]
    probs = jax.nn.softmax(sorted_desc / temperature, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                         # mass strictly above
    # The top one always (HF's min_tokens_to_keep=1): a top_p below float32's smallest positive
    # number is 0 in fp32, and `before < top_p` then kept none (NaN probabilities, token 0).
    keep = (before < cfg.top_p) | (jnp.arange(x.shape[-1]) == 0)
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < cutoff, -jnp.inf, x)
  return x / temperature


def probabilities(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """The distribution tokens are drawn from, [..., V] fp32 (one-hot argmax when greedy)."""
  if cfg.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(processed_logits(logits, cfg), axis=-1)


def split_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-row keys [B] -> (next keys [B], step keys [B])."""
  pair = jax.vmap(lambda k: jax.random.split(k, 2))(keys)               # [B, 2]
  return pair[:, 0], pair[:, 1]


def sample(logits: jax.Array, step_keys: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """logits [B, V] -> tokens [B] int32 (argmax when greedy, else one draw per row)."""
  if cfg.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  x = processed_logits(logits, cfg)
  return jax.vmap(jax.random.categorical)(step_keys, x).astype(jnp.int32)
