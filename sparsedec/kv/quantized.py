"""QuantSpec's hierarchical INT4/INT8 KV cache with a full-precision double buffer.

Per layer, a row's committed tokens 0 .. N-1 are split at `quant_len[b]` (a multiple of G):

  slots [0, quant_len)       quantized, `pallas_kernels.quant_attention.QuantKV` (capacity Sq, a
                             multiple of lcm(G, 8)): upper INT4 + lower INT4 codes (words of 8),
                             INT8 = 16*upper + lower; keys per channel over G-token groups, values
                             per token
  buffer [0, buf_len)        full precision, [B, Hkv, 2G, D]; slot j holds position quant_len + j.
                             Halves: CF1 = slots [0, G), CF2 = slots [G, 2G).

State machine (the paper's double buffer, with drafts kept in flight instead of written to CF2):
  * commit(count): when buf_len + count > 2G (CF2 would overflow; verification is done, so the
    rejected entries were never written), first FLUSH: quantize CF1 (always full then) into the next
    group of codes, move CF2 to CF1 (buf_len -= G, quant_len += G); then append the accepted
    entries at buf_len. Needs count <= G.
  * prefill (`from_dense`) applies the same rule to the N prompt tokens at once.
Both keep buf_len in [G + 1, 2G] once N > G (all N <= G tokens stay in the buffer), so the split is
a function of N only: `quantized_length(N) = G * max(0, (N - G - 1) // G)`. Consequences a
demanding user relies on: at least G (in fact G + 1) recent tokens are always in full precision;
each token is quantized exactly once, with its whole G-group (quantization happens once per G
tokens); a rejection, or how the accepted tokens were batched into commits, never changes what is
quantized: the codes are bit-identical to `quantize_kv` of the same tokens quantized directly.
(The paper's residual of 256 = 2G; its lower bound of G recent tokens is kept; its prefill keeps
[G, 2G) while we keep [G + 1, 2G] so prefill and decode share one rule.)

Everything is jittable with fixed shapes, per row (ragged lengths across the batch).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from pallas_kernels.quant_attention import (KEY_TILE, QuantKV, QuantPlanes, k_layout,
                                            quantize_kv, quantize_planes, v_layout, v_tile_tokens)
from pallas_kernels.register_operand import pack_words, unpack_words
from sparsedec.model.quant_weights import array_bytes
from pallas_kernels.quant_attention import bytes_per_token as _quant_bytes
from sparsedec.errors import InputError, is_int
from sparsedec.kv.dense import InflightKV, KVCache


def quantized_length(num_tokens: jax.Array, group: int) -> jax.Array:
  """Tokens quantized when `num_tokens` are committed: G * max(0, (N - G - 1) // G) ([B] int32)."""
  n = jnp.asarray(num_tokens, jnp.int32)
  return group * jnp.maximum(0, (n - group - 1) // group)


def check_group(group: int, head_dim: int) -> None:
  if not is_int(group) or group < 1:
    raise InputError(f"quant group must be an integer >= 1, got {group!r}")
  if head_dim % 8:
    raise InputError(f"head_dim {head_dim} must be a multiple of 8 (the codes are stored as "
                     f"words of 8 4-bit codes)")


@struct.dataclass
class QuantizedCache:
  codes: tuple[QuantKV, ...]    # per layer, capacity Sq (multiple of G)
  buf_k: tuple[jax.Array, ...]  # per layer [B, Hkv, 2G, D] full precision (CF1 | CF2)
  buf_v: tuple[jax.Array, ...]  # per layer [B, Hkv, 2G, D]
  quant_len: jax.Array          # [B] int32, a multiple of G
  buf_len: jax.Array            # [B] int32 in [0, 2G]
  group: int = struct.field(pytree_node=False)

  @property
  def lengths(self) -> jax.Array:
    """[B] committed entries per row."""
    return self.quant_len + self.buf_len

  @property
  def quant_capacity(self) -> int:
    return self.codes[0].capacity

  def num_bytes(self) -> int:
    """Bytes held on device (codes, scales/zeros, the full-precision buffer, the counts)."""
    return sum(array_bytes(x) for x in jax.tree_util.tree_leaves(self))


def bytes_per_token(head_dim: int, num_kv_heads: int, num_layers: int, bits: int,
                    group: int) -> float:
  """Bytes one quantized token costs to READ at `bits` over all layers and KV heads (codes +
  scales/zeros); the 8-bit read touches the same bytes as storage."""
  return _quant_bytes(head_dim, bits, group) * num_kv_heads * num_layers


def _quantize_all(k: jax.Array, v: jax.Array, group: int, capacity: int) -> QuantKV:
  """Quantize slots [0, capacity) of k, v [B, Hkv, S, D] (zero padded past S)."""
  s = k.shape[2]
  if s < capacity:
    pad = ((0, 0), (0, 0), (0, capacity - s), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  return quantize_kv(k[:, :, :capacity], v[:, :, :capacity], group=group)


def fits_value_tiles(group: int) -> bool:
  """Whether quant group `group` divides, or is a multiple of, the 64-token value tile: then every
  quantized capacity can store it (`from_dense`); another group fits only a capacity that is not
  a multiple of 64 (whose value codes are one tile)."""
  return KEY_TILE % group == 0 or group % KEY_TILE == 0


def from_dense(cache: KVCache, group: int, quant_capacity: int | None = None) -> QuantizedCache:
  """The quantized cache of a dense cache's committed entries (prefill): whole groups below
  `quantized_length(lengths)` quantized, the rest (G + 1 .. 2G tokens, or all when <= G) kept in
  full precision. quant_capacity: default the dense capacity rounded up to a multiple of
  lcm(G, 8) (whole groups of whole 8-code words); an explicit one may be larger (room for tokens
  committed later), not smaller than the dense capacity (the codes of the cache's own tokens
  would be dropped)."""
  s, d = cache.k[0].shape[2:]
  check_group(group, d)
  unit = math.lcm(group, 8)            # whole groups, whole 8-code words
  if quant_capacity is not None and (not is_int(quant_capacity) or quant_capacity < 1):
    raise InputError(f"quantized capacity must be None (the default) or an integer >= 1, got "
                     f"{quant_capacity!r}")
  cap = -(-s // unit) * unit if quant_capacity is None else int(quant_capacity)
  if cap % unit:
    raise InputError(f"quantized capacity {cap} must be a multiple of the quant group {group} "
                     f"and of 8 (codes are stored as words of 8)")
  tile = v_tile_tokens(cap)
  if group % tile and tile % group:
    raise InputError(f"quant group {group} must divide or be a multiple of the {tile}-token "
                     f"value tile of capacity {cap} (a group is written as whole tiles or inside "
                     f"one)")
  if cap < s:
    raise InputError(f"quantized capacity {cap} is smaller than the dense cache's capacity {s}: "
                     f"the codes of its tokens past {cap} would be dropped")
  quant_len = quantized_length(cache.lengths, group)                         # [B]
  buf_len = cache.lengths - quant_len
  j = jnp.arange(2 * group, dtype=jnp.int32)
  idx = jnp.minimum(quant_len[:, None] + j[None, :], s - 1)                  # [B, 2G]
  valid = (j[None, :] < buf_len[:, None])[:, None, :, None]                  # [B, 1, 2G, 1]

  def gather(x):  # [B, Hkv, S, D] -> [B, Hkv, 2G, D]
    got = jnp.take_along_axis(x, idx[:, None, :, None], axis=2)
    return jnp.where(valid, got, jnp.zeros((), x.dtype))

  codes = tuple(_quantize_all(k, v, group, cap) for k, v in zip(cache.k, cache.v))
  return QuantizedCache(codes=codes, buf_k=tuple(map(gather, cache.k)),
                        buf_v=tuple(map(gather, cache.v)), quant_len=quant_len,
                        buf_len=buf_len, group=group)


def _write_v_tiles(v_codes: jax.Array, planes: jax.Array, start: jax.Array,
                   on: jax.Array) -> jax.Array:
  """v_codes [B, Hkv, 2, S/T, D, T/8] words with the group's value codes planes
  [B, Hkv, 2, G, D] written at token start[b] of rows with on[b]: whole tiles when T divides G,
  else a read-modify-write of the one tile holding the group."""
  b, g = start.shape[0], planes.shape[3]
  n_tiles, t = v_codes.shape[3], v_codes.shape[-1] * 8
  rows = jnp.arange(b)[:, None]                                              # [B, 1]
  if g % t == 0:
    tiles = jnp.where(on[:, None], start[:, None] // t + jnp.arange(g // t)[None], n_tiles)
    new = v_layout(planes)                                                   # [B,Hkv,2,G/T,D,T/8]
    # indexed at (rows, tiles) -> [B, G/T, Hkv, 2, D, T/8]
    return v_codes.at[rows, :, :, tiles].set(new.transpose(0, 3, 1, 2, 4, 5), mode="drop")
  tile = jnp.where(on, start // t, n_tiles)                                  # [B]
  old = v_codes[rows[:, 0], :, :, jnp.minimum(tile, n_tiles - 1)]           # [B, Hkv, 2, D, T/8]
  codes = unpack_words(old)                                                  # [B, Hkv, 2, D, T]
  codes = jax.vmap(lambda c, p, o: lax.dynamic_update_slice_in_dim(c, p, o, axis=-1))(
      codes, planes.swapaxes(-1, -2), start % t)
  return v_codes.at[rows[:, 0], :, :, tile].set(pack_words(codes), mode="drop")


def _write_group(qkv: QuantKV, new: QuantPlanes, start: jax.Array, on: jax.Array) -> QuantKV:
  """Write one quantized group `new` (G tokens) at slot start[b] of rows with on[b]."""
  g = qkv.group
  b = start.shape[0]
  cap = qkv.capacity
  rows = jnp.arange(b)[:, None]                                              # [B, 1]
  slots = jnp.where(on[:, None], start[:, None] + jnp.arange(g)[None, :], cap)  # [B, G]
  grp = jnp.where(on, start // g, cap // g)                                  # [B]
  return QuantKV(
      # k [B, Hkv, 2, D/C, S, C/8] indexed at (rows, slots) -> [B, G, Hkv, 2, D/C, C/8]
      k_codes=qkv.k_codes.at[rows, :, :, :, slots].set(
          k_layout(new.k_planes).transpose(0, 4, 1, 2, 3, 5), mode="drop"),
      v_codes=_write_v_tiles(qkv.v_codes, new.v_planes, start, on),
      k_scale=qkv.k_scale.at[rows[:, 0], :, grp].set(new.k_scale[:, :, 0], mode="drop"),
      k_zero=qkv.k_zero.at[rows[:, 0], :, grp].set(new.k_zero[:, :, 0], mode="drop"),
      v_scale=qkv.v_scale.at[rows, :, slots].set(new.v_scale.transpose(0, 2, 1), mode="drop"),
      v_zero=qkv.v_zero.at[rows, :, slots].set(new.v_zero.transpose(0, 2, 1), mode="drop"),
      group=g)


def _cf2_to_cf1(buf: jax.Array, g: int) -> jax.Array:
  """[B, Hkv, 2G, D]: CF2 moved into CF1, CF2 zeroed."""
  return jnp.concatenate([buf[:, :, g:], jnp.zeros_like(buf[:, :, g:])], axis=2)


def stacked_cf1(bufs, group: int) -> jax.Array:
  """The CF1 halves of per-layer buffers (L x [B, Hkv, 2G, D]) as one batch [L * B, Hkv, G, D],
  layer-major: what the quantizer takes to treat every layer at once (its arithmetic is per
  row, so each layer's codes are bit for bit its own). `unstacked` splits the result back."""
  x = jnp.stack([buf[:, :, :group] for buf in bufs])                      # [L, B, Hkv, G, D]
  return x.reshape(-1, *x.shape[2:])


def unstacked(batch, num_layers: int) -> tuple:
  """The inverse of `stacked_cf1`'s layer-major batching: a pytree whose leaves are
  [L * B, ...] -> L pytrees of [B, ...] leaves (layer i first-axis rows i * B .. (i + 1) * B)."""
  split = jax.tree.map(lambda x: x.reshape(num_layers, -1, *x.shape[1:]), batch)
  return tuple(jax.tree.map(lambda x, i=i: x[i], split) for i in range(num_layers))


def flush(cache: QuantizedCache, on: jax.Array) -> QuantizedCache:
  """For rows with on[b] (CF1 full): quantize CF1 into the next group, CF2 -> CF1. Every layer's
  CF1 is quantized in one batch ([L * B, Hkv, G, D]; per-row arithmetic, the same codes as one
  layer at a time), then written layer by layer."""
  g = cache.group
  planes = quantize_planes(stacked_cf1(cache.buf_k, g), stacked_cf1(cache.buf_v, g), g)
  codes, buf_k, buf_v = [], [], []
  shift = on[:, None, None, None]
  for qkv, new, k, v in zip(cache.codes, unstacked(planes, len(cache.codes)), cache.buf_k,
                            cache.buf_v):
    codes.append(_write_group(qkv, new, cache.quant_len, on))
    buf_k.append(jnp.where(shift, _cf2_to_cf1(k, g), k))
    buf_v.append(jnp.where(shift, _cf2_to_cf1(v, g), v))
  step = jnp.where(on, g, 0).astype(jnp.int32)
  return cache.replace(codes=tuple(codes), buf_k=tuple(buf_k), buf_v=tuple(buf_v),
                       quant_len=cache.quant_len + step, buf_len=cache.buf_len - step)


def commit(cache: QuantizedCache, new: InflightKV, count: jax.Array,
           take: jax.Array | None = None) -> QuantizedCache:
  """Append count[b] <= G in-flight entries (take: [B, C] indices into the forward's T tokens,
  default 0..T-1) to row b, flushing first where CF2 would overflow (module docstring)."""
  g = cache.group
  count = count.astype(jnp.int32)
  cache = flush(cache, cache.buf_len + count > 2 * g)
  b, t = new.k[0].shape[:2]
  if take is None:
    take = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  c = take.shape[1]
  if c > g:
    raise InputError(f"a commit of up to {c} entries exceeds the quant group {g}")
  col = jnp.arange(c, dtype=jnp.int32)[None, :]
  pos = jnp.where(col < count[:, None], cache.buf_len[:, None] + col, 2 * g)   # [B, C]
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, c))

  def write(buf, src):  # buf [B, Hkv, 2G, D], src [B, T, Hkv, D]
    vals = jnp.take_along_axis(src, take[:, :, None, None], axis=1).astype(buf.dtype)
    return buf.at[rows, :, pos].set(vals, mode="drop")

  return cache.replace(buf_k=tuple(map(write, cache.buf_k, new.k)),
                       buf_v=tuple(map(write, cache.buf_v, new.v)),
                       buf_len=cache.buf_len + count)
