"""Random test inputs drawn by numpy, seeded by a JAX PRNG key (or an int).

`jax.random.normal` and friends compile a threefry (+ inverse-erf) program for every new shape:
246 of them, 344 s of compilation (~1.4 s each) in a profiled run of the suite that shared the
2-core machine with other work (the kernel tests draw inputs of hypothesis-chosen shapes). numpy
draws the same distributions without compiling anything. The key only seeds the draw: the values
differ from jax.random's, and are as deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _rng(key) -> np.random.Generator:
  """A numpy generator seeded by an int or a JAX key (its raw key data)."""
  if isinstance(key, (int, np.integer)):
    return np.random.default_rng(int(key))
  data = np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                    else key, np.uint32)
  return np.random.default_rng(data.ravel().tolist())


def normal(key, shape, dtype=jnp.float32) -> jax.Array:
  """Standard normal samples of `shape` (drawn in fp32, then cast to dtype)."""
  return jnp.asarray(_rng(key).standard_normal(shape, np.float32)).astype(dtype)


def uniform(key, shape, dtype=jnp.float32, minval=0.0, maxval=1.0) -> jax.Array:
  """Uniform samples in [minval, maxval)."""
  return jnp.asarray(_rng(key).uniform(minval, maxval, shape).astype(np.float32)).astype(dtype)


def bernoulli(key, p, shape) -> jax.Array:
  """Booleans, True with probability p."""
  return jnp.asarray(_rng(key).random(shape) < p)


def randint(key, shape, minval, maxval, dtype=jnp.int32) -> jax.Array:
  """Integers in [minval, maxval)."""
  return jnp.asarray(_rng(key).integers(minval, maxval, shape), dtype)
