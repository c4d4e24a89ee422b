"""QuantSpec's hierarchical INT4/INT8 KV cache with a full-precision double buffer.

Per layer, a row's committed tokens 0 .. N-1 are split at `quant_len[b]` (a multiple of G):

  slots [0, quant_len)       quantized, `pallas_kernels.quant_attention.QuantKV` (capacity Sq, a
                             multiple of G): upper INT4 + lower INT4 codes, INT8 = 16*upper + lower;
                             keys per channel over G-token groups, values per token
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

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.quant_attention import QuantKV, code_planes, quantize_kv
from sparsedec.model.quant_weights import array_bytes
from pallas_kernels.quant_attention import bytes_per_token as _quant_bytes
from sparsedec.errors import InputError
from sparsedec.kv.dense import InflightKV, KVCache


def quantized_length(num_tokens: jax.Array, group: int) -> jax.Array:
  """Tokens quantized when `num_tokens` are committed: G * max(0, (N - G - 1) // G) ([B] int32)."""
  n = jnp.asarray(num_tokens, jnp.int32)
  return group * jnp.maximum(0, (n - group - 1) // group)


def check_group(group: int, head_dim: int) -> None:
  if not isinstance(group, int) or isinstance(group, bool) or group < 1:
    raise InputError(f"quant group must be an integer >= 1, got {group!r}")
  if head_dim % 2:
    raise InputError(f"head_dim {head_dim} must be even (two 4-bit codes per byte)")


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


def from_dense(cache: KVCache, group: int, quant_capacity: int | None = None) -> QuantizedCache:
  """The quantized cache of a dense cache's committed entries (prefill): whole groups below
  `quantized_length(lengths)` quantized, the rest (G + 1 .. 2G tokens, or all when <= G) kept in
  full precision. quant_capacity: default the dense capacity rounded up to a multiple of G."""
  s, d = cache.k[0].shape[2:]
  check_group(group, d)
  cap = quant_capacity or -(-s // group) * group
  if cap % group:
    raise InputError(f"quantized capacity {cap} is not a multiple of the quant group {group}")
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


def _write_group(qkv: QuantKV, new: QuantKV, start: jax.Array, on: jax.Array) -> QuantKV:
  """Write the one-group QuantKV `new` (capacity G) at slot start[b] of rows with on[b]."""
  g = qkv.group
  b = start.shape[0]
  cap = qkv.capacity
  vt = qkv.v_codes.shape[-1]                                                 # V tile tokens
  rows = jnp.arange(b)[:, None]                                              # [B, 1]
  slots = jnp.where(on[:, None], start[:, None] + jnp.arange(g)[None, :], cap)  # [B, G]
  grp = jnp.where(on, start // g, cap // g)                                  # [B]
  return QuantKV(
      # k [B, Hkv, 2, D/C, S, C] indexed at (rows, slots) -> [B, G, Hkv, 2, D/C, C]
      k_codes=qkv.k_codes.at[rows, :, :, :, slots].set(
          new.k_codes.transpose(0, 4, 1, 2, 3, 5), mode="drop"),
      # v [B, Hkv, 2, S/T, D, T] indexed at (rows, slot tile, slot offset) -> [B, G, Hkv, 2, D]
      v_codes=qkv.v_codes.at[rows, :, :, slots // vt, :, slots % vt].set(
          code_planes(new)[1].transpose(0, 3, 1, 2, 4), mode="drop"),
      k_scale=qkv.k_scale.at[rows[:, 0], :, grp].set(new.k_scale[:, :, 0], mode="drop"),
      k_zero=qkv.k_zero.at[rows[:, 0], :, grp].set(new.k_zero[:, :, 0], mode="drop"),
      v_scale=qkv.v_scale.at[rows, :, slots].set(new.v_scale.transpose(0, 2, 1), mode="drop"),
      v_zero=qkv.v_zero.at[rows, :, slots].set(new.v_zero.transpose(0, 2, 1), mode="drop"),
      group=g)


def _cf2_to_cf1(buf: jax.Array, g: int) -> jax.Array:
  """[B, Hkv, 2G, D]: CF2 moved into CF1, CF2 zeroed."""
  return jnp.concatenate([buf[:, :, g:], jnp.zeros_like(buf[:, :, g:])], axis=2)


def flush(cache: QuantizedCache, on: jax.Array) -> QuantizedCache:
  """For rows with on[b] (CF1 full): quantize CF1 into the next group, CF2 -> CF1."""
  g = cache.group
  codes, buf_k, buf_v = [], [], []
  shift = on[:, None, None, None]
  for qkv, k, v in zip(cache.codes, cache.buf_k, cache.buf_v):
    cf1 = quantize_kv(k[:, :, :g], v[:, :, :g], group=g)                     # capacity G
    codes.append(_write_group(qkv, cf1, cache.quant_len, on))
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
