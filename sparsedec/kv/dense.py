"""The dense, fixed-capacity KV cache and the commit of accepted in-flight entries.

Cache index equals token position: row b holds positions 0 .. lengths[b]-1 in slots
0 .. lengths[b]-1. Per-layer arrays (a tuple), so the unrolled forward touches each layer's
buffer in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from sparsedec.model.config import ModelConfig


@struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]   # per layer [B, Hkv, S, D]
  v: tuple[jax.Array, ...]   # per layer [B, Hkv, S, D]
  lengths: jax.Array         # [B] int32: committed entries per row

  @property
  def batch_size(self) -> int:
    return self.lengths.shape[0]

  @property
  def capacity(self) -> int:
    return self.k[0].shape[2]

  def num_bytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in self.k + self.v)


@struct.dataclass
class InflightKV:
  """K/V of the tokens of one forward, not yet committed (and, when asked for, their queries)."""
  k: tuple[jax.Array, ...]   # per layer [B, T, Hkv, D]
  v: tuple[jax.Array, ...]   # per layer [B, T, Hkv, D]
  q: tuple[jax.Array, ...] | None = None   # per layer [B, T, Hq, D] (RoPE applied), or None


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=None) -> KVCache:
  dtype = jnp.dtype(dtype or cfg.dtype)
  shape = (batch_size, cfg.num_kv_heads, capacity, cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
  return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                 lengths=jnp.zeros((batch_size,), jnp.int32))


def commit(cache: KVCache, new: InflightKV, count: jax.Array,
           take: jax.Array | None = None) -> KVCache:
  """Append `count[b]` in-flight entries to row b.

  take: [B, C] indices into the forward's T tokens, in commit order (default: 0..T-1, i.e. an
  accepted prefix). Entries c >= count[b] are not written. Slots past capacity are dropped (callers
  check capacity up front).
  """
  b, t = new.k[0].shape[:2]
  if take is None:
    take = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  c = take.shape[1]
  col = jnp.arange(c, dtype=jnp.int32)[None, :]                               # [1, C]
  pos = jnp.where(col < count[:, None], cache.lengths[:, None] + col, cache.capacity)  # [B, C]
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, c))                     # [B, C]

  def write(buf, src):  # buf [B, Hkv, S, D], src [B, T, Hkv, D]
    vals = jnp.take_along_axis(src, take[:, :, None, None], axis=1).astype(buf.dtype)  # [B,C,Hkv,D]
    return buf.at[rows, :, pos].set(vals, mode="drop")

  return KVCache(k=tuple(write(x, y) for x, y in zip(cache.k, new.k)),
                 v=tuple(write(x, y) for x, y in zip(cache.v, new.v)),
                 lengths=cache.lengths + count.astype(jnp.int32))
