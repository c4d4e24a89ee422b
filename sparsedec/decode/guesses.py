"""Cheap per-row pseudo-random picks for guess buffers (Lookahead's window, FAFO's fumble
subsequences): tokens drawn from each row's own context, without a PRNG stream (which compiles
slowly) and independent of the other rows of the batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparsedec.decode.state import DecodeState


def mix32(x: jax.Array) -> jax.Array:
  """A 32-bit integer mixer (lowbias32): cheap pseudo-random numbers without a PRNG key."""
  u32 = jnp.uint32
  x = x.astype(u32)
  x = (x ^ (x >> u32(16))) * u32(0x7FEB352D)
  x = (x ^ (x >> u32(15))) * u32(0x846CA68B)
  return x ^ (x >> u32(16))


def row_salt(state: DecodeState, seed: int) -> jax.Array:
  """[B] uint32 from each row's own PRNG key and length: a row's window picks do not depend on
  the other rows of the batch (nor on its row index), so neither does its sampled output."""
  b = state.batch_size
  data = jax.random.key_data(state.keys).reshape(b, -1).astype(jnp.uint32)
  salt = state.num_tokens.astype(jnp.uint32) ^ jnp.uint32(seed)
  for i in range(data.shape[1]):
    salt = mix32(salt ^ data[:, i])
  return salt


def context_tokens(salt: jax.Array, tokens: jax.Array, num_tokens: jax.Array,
                   shape: tuple[int, ...]) -> jax.Array:
  """Pseudo-random tokens [B, *shape] picked from each row's tokens[b, :num_tokens[b]]; salt [B]
  varies the pick (window filling is a heuristic: no PRNG stream, which also compiles slowly)."""
  b = tokens.shape[0]
  cell = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
  expand = (b,) + (1,) * len(shape)
  h = mix32(salt.astype(jnp.uint32).reshape(expand) ^ cell)                     # [B, *shape]
  idx = h % jnp.maximum(num_tokens, 1).astype(jnp.uint32).reshape(expand)
  flat = jnp.take_along_axis(tokens, idx.astype(jnp.int32).reshape(b, -1), axis=1)
  return flat.reshape((b,) + shape)
