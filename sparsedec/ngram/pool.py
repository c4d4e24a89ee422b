"""An n-gram pool held in device arrays: suffix keys of 1..K tokens -> recent V-token continuations.

Every operation is a jittable array op batched over B rows, each row its own pool (no host round
trip), so a decode step can look up guesses and store new n-grams inside its while_loop.

Layout (per row; every array has a leading batch axis B):
  * a set-associative hash table of `num_buckets` buckets x `bucket_ways` key slots. A key is 1..K
    tokens, stored left-aligned (oldest first), padded with -1, together with its length; it hashes
    (`key_hash`, tokens and length) to one bucket and lives in one of that bucket's ways. Lookups
    compare the stored key tokens and length, so a hash collision never returns another key's
    continuations. A new key takes a free way, else evicts the way whose key was inserted into
    least recently (with its continuations).
  * each key slot holds up to `entries_per_key` continuations of `value_len` tokens with an LRU
    stamp each: inserting a continuation the key already holds refreshes its stamp; a new one takes
    a free entry, else replaces the least recently used one. (Which way or entry slot a key or
    continuation occupies carries no meaning: `insert` rewrites a bucket most recent first.)
  * stamps come from a per-row clock that advances once per (valid) insert, so they are unique.
  * storage: one int32 record per key slot (tokens, length, stamp) and one per continuation
    (tokens, stamp): `NgramPool.keys` [B, NB, A, K+2] and `NgramPool.entries` [B, NB, A, E, V+1].

`insert` takes M items per row and gives exactly the result of inserting them one by one (as
lookups see it), in one pass: [M, M] comparisons find each item's earlier accesses, and the
touched buckets are rewritten whole (keys and continuations most recent first).

Lookups do not change the pool (they are pure reads: a guess that is retrieved but never
re-inserted ages out). `lookup` tries the keys of a decoded suffix longest first (K down to 1),
each key's continuations most recent first, drops duplicates and keeps the first `num`.

Lookahead Decoding keys n-grams by one token (key_len 1, value_len N-1); FAFO stores a guess under
every suffix of a discarded-token buffer (key lengths 1..K): `suffix_items` turns buffers and their
values into `insert`'s items (FAFO's step, `insert_sequence_ngrams`, `insert_under_suffixes`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsedec.errors import InputError, is_int

EMPTY = -1   # padding of keys and of invalid lookup results

# Hash constants (multiplicative mixing and the murmur3 32-bit finaliser). tests/test_ngram_pool.py
# re-implements the hash in plain Python: change both together.
HASH_SEED = 0x9E3779B1
HASH_MUL = 0x85EBCA6B
FMIX_MUL1 = 0x85EBCA6B
FMIX_MUL2 = 0xC2B2AE35


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """Static shape of a pool (hashable: part of the pool's treedef)."""

  key_len: int               # K: longest key, in tokens
  value_len: int             # V: tokens per continuation
  entries_per_key: int       # E: continuations kept per key (LRU)
  num_buckets: int = 256     # hash buckets per row
  bucket_ways: int = 4       # key slots per bucket (keys kept per bucket, LRU)

  def __post_init__(self):
    for name in ("key_len", "value_len", "entries_per_key", "num_buckets", "bucket_ways"):
      value = getattr(self, name)
      if not is_int(value) or value < 1:
        raise InputError(f"PoolConfig.{name} must be an integer >= 1, got {value!r}")

  @property
  def num_keys(self) -> int:
    return self.num_buckets * self.bucket_ways

  def num_bytes(self, batch_size: int) -> int:
    per_key = self.key_len + 2 + self.entries_per_key * (self.value_len + 1)
    return 4 * batch_size * (self.num_keys * per_key + 1)


@struct.dataclass
class NgramPool:
  """Per row: key records and continuation records (one int32 array each, so an insert writes
  two records, not five arrays; the named views below read them)."""
  keys: jax.Array            # [B, NB, A, K+2] int32: K tokens (left-aligned, -1 padded),
                             #   length (0 = free way), stamp of the last insert under the key
  entries: jax.Array         # [B, NB, A, E, V+1] int32: V tokens, stamp (0 = free entry)
  clock: jax.Array           # [B] int32, inserts so far
  config: PoolConfig = struct.field(pytree_node=False)

  @property
  def batch_size(self) -> int:
    return self.clock.shape[0]

  @property
  def key_tokens(self) -> jax.Array:     # [B, NB, A, K]
    return self.keys[..., : self.config.key_len]

  @property
  def key_lens(self) -> jax.Array:       # [B, NB, A]
    return self.keys[..., self.config.key_len]

  @property
  def key_stamps(self) -> jax.Array:     # [B, NB, A]
    return self.keys[..., self.config.key_len + 1]

  @property
  def values(self) -> jax.Array:         # [B, NB, A, E, V]
    return self.entries[..., : self.config.value_len]

  @property
  def value_stamps(self) -> jax.Array:   # [B, NB, A, E]
    return self.entries[..., self.config.value_len]


def init_pool(config: PoolConfig, batch_size: int) -> NgramPool:
  c = config
  nb, a = c.num_buckets, c.bucket_ways
  key_record = np.array([EMPTY] * c.key_len + [0, 0], np.int32)
  entry_record = np.array([EMPTY] * c.value_len + [0], np.int32)
  return NgramPool(
      keys=jnp.broadcast_to(jnp.asarray(key_record), (batch_size, nb, a, c.key_len + 2)),
      entries=jnp.broadcast_to(jnp.asarray(entry_record),
                               (batch_size, nb, a, c.entries_per_key, c.value_len + 1)),
      clock=jnp.zeros((batch_size,), jnp.int32), config=config)


def normalize_keys(keys: jax.Array, lengths: jax.Array) -> jax.Array:
  """keys [..., K] left-aligned with lengths [...]: tokens past the length set to -1."""
  col = jnp.arange(keys.shape[-1], dtype=jnp.int32)
  return jnp.where(col < lengths[..., None], keys, EMPTY).astype(jnp.int32)


def key_hash(keys: jax.Array, lengths: jax.Array) -> jax.Array:
  """uint32 hash [...] of normalized keys [..., K] (see `normalize_keys`) and lengths [...]."""
  u32 = jnp.uint32
  h = lengths.astype(u32) * u32(HASH_SEED)
  tokens = jax.lax.bitcast_convert_type(keys.astype(jnp.int32), u32)      # -1 -> 0xFFFFFFFF
  for i in range(keys.shape[-1]):
    h = (h ^ tokens[..., i]) * u32(HASH_MUL)
    h = h ^ (h >> u32(15))
  h = h ^ (h >> u32(16))
  h = h * u32(FMIX_MUL1)
  h = h ^ (h >> u32(13))
  h = h * u32(FMIX_MUL2)
  return h ^ (h >> u32(16))


def bucket_index(config: PoolConfig, keys: jax.Array, lengths: jax.Array) -> jax.Array:
  """int32 bucket [...] of normalized keys [..., K] with lengths [...]."""
  return (key_hash(keys, lengths) % jnp.uint32(config.num_buckets)).astype(jnp.int32)


def _row_arrays(pool: NgramPool) -> tuple[jax.Array, ...]:
  return (pool.keys, pool.entries, pool.clock)


def _insert_row(config: PoolConfig, row: tuple, items: tuple) -> tuple:
  """One row's (keys, entries) tables (no batch axis) after inserting M items in order, in one
  pass: no loop over the items or over rounds of them.

  items: keys [M, K] normalized, lengths [M], values [M, V], valid [M], buckets [M], stamps [M]
  (strictly increasing over the valid items).

  A bucket is an LRU set of `bucket_ways` keys and a key an LRU set of `entries_per_key`
  continuations, every insert an access of both, so after any sequence of inserts:
    * a bucket holds the A most recently inserted-into of its keys, a key the E most recently
      inserted of its continuations since the key last entered the bucket (its residency);
    * a key is in the bucket just before an insert under it iff it was inserted into before and
      fewer than A other keys of the bucket have been since (fewer than A keys more recent).
  The table's contents (keys and stamps) stand for the accesses before this call. Positions
  inside a bucket and inside a key's entries are not part of the pool's meaning (lookups compare
  every way and order continuations by stamp): the written bucket holds its keys most recent
  first, each key's continuations most recent first.
  """
  table, entry_table = row                                 # [NB, A, K+2], [NB, A, E, V+1]
  key, length, value, valid, bucket, now = items
  kk, v = config.key_len, config.value_len
  a, e, nb = config.bucket_ways, config.entries_per_key, config.num_buckets
  m = key.shape[0]
  after = jnp.asarray(np.triu(np.ones((m, m), bool), k=1))                     # [i, j]: j > i
  before = after.T                                                             # [i, j]: j < i
  same_bucket = valid[:, None] & valid[None, :] & (bucket[:, None] == bucket[None, :])  # [M, M]
  same_key = (same_bucket & (length[:, None] == length[None, :])
              & jnp.all(key[:, None, :] == key[None, :, :], axis=-1))          # [M, M]
  same_value = same_key & jnp.all(value[:, None, :] == value[None, :, :], axis=-1)

  # The item's bucket before the call, and its key there (if it is).
  records, held = table[bucket], entry_table[bucket]       # [M, A, K+2], [M, A, E, V+1]
  way_len, way_stamp = records[..., kk], records[..., kk + 1]                  # [M, A]
  match = ((way_len == length[:, None]) & (way_len > 0)
           & jnp.all(records[..., :kk] == key[:, None, :], axis=-1))           # [M, A]
  in_table = jnp.any(match, axis=-1)                                           # [M]
  # Previous access of the item's key: its last earlier item, else its stamp in the table (0:
  # never), and whether the key is still in the bucket then (fewer than A other keys since).
  prev = jnp.max(jnp.where(same_key & before, now[None, :], 0), axis=-1)
  prev = jnp.where(prev > 0, prev, jnp.sum(jnp.where(match, way_stamp, 0), axis=-1))   # [M]
  others = (jnp.sum(same_bucket & ~same_key & before & (now[None, :] > prev[:, None])
                    & (prev[None, :] <= prev[:, None]), axis=-1)   # items first since prev
            + jnp.sum((way_len > 0) & ~match & (way_stamp > prev[:, None]), axis=-1))
  enters = valid & ((prev == 0) | (others >= a))           # the key (re)enters the bucket here
  last_of_key = valid & ~jnp.any(same_key & after, axis=-1)
  last_of_bucket = valid & ~jnp.any(same_bucket & after, axis=-1)
  since = jnp.max(jnp.where(same_key & enters[None, :], now[None, :], 0), axis=-1)  # [M]: 0 =
  #   the key's residency began before the call (its entries in the table stay candidates)

  # Keys after the call, most recent first: the items' keys (their last items), then the ways
  # no item inserted into.
  newer = now[None, :] > now[:, None]                                          # [i, j]
  key_rank = jnp.sum(same_bucket & last_of_key[None, :] & newer, axis=-1)      # [M]
  item_keys = jnp.sum(same_bucket & last_of_key[None, :], axis=-1)             # [M]
  refreshed_way = jnp.any(same_bucket[:, :, None] & match[None, :, :], axis=1)   # [M, A]
  untouched = (way_len > 0) & ~refreshed_way
  way_rank = item_keys[:, None] + jnp.sum(
      untouched[:, None, :] & (way_stamp[:, None, :] > way_stamp[:, :, None]), axis=-1)  # [M, A]
  final_way = jnp.sum(jnp.where(same_key & last_of_key[None, :], key_rank[None, :], 0), axis=-1)

  # A key's continuations after the call, most recent first: its items' values since it entered
  # (each value's last item), then (if it never left) its entries in the table not inserted again.
  fresh = valid & ~jnp.any(same_value & after, axis=-1) & (now >= since)      # [M]
  entry_rank = jnp.sum(same_key & fresh[None, :] & newer, axis=-1)             # [M]
  fresh_count = jnp.sum(same_key & fresh[None, :], axis=-1)                    # [M]
  old = held[jnp.arange(m), jnp.argmax(match, axis=-1)]                        # [M, E, V+1]
  old_stamp = old[..., v]                                                      # [M, E]
  # Items of one key share its old entries: compare each item's value with its own key's.
  hits_old = jnp.all(old[..., :v] == value[:, None, :], axis=-1)               # [M, E]
  inserted_again = jnp.any(same_key[:, :, None] & hits_old[None, :, :], axis=1)  # [M, E]
  keep_old = (in_table & (since == 0))[:, None] & (old_stamp > 0) & ~inserted_again
  old_rank = fresh_count[:, None] + jnp.sum(
      keep_old[:, None, :] & (old_stamp[:, None, :] > old_stamp[:, :, None]), axis=-1)  # [M, E]

  # Write: the touched buckets emptied, then every kept record at its rank. Each destination is
  # written once (out-of-range buckets are dropped).
  def where_bucket(ok):
    return jnp.where(ok, jnp.broadcast_to(bucket.reshape(bucket.shape + (1,) * (ok.ndim - 1)),
                                          ok.shape), nb)
  empty_key = jnp.asarray(np.array([EMPTY] * kk + [0, 0], np.int32))
  empty_entry = jnp.asarray(np.array([EMPTY] * v + [0], np.int32))
  table = table.at[where_bucket(last_of_bucket)].set(empty_key, mode="drop")
  entry_table = entry_table.at[where_bucket(last_of_bucket)].set(empty_entry, mode="drop")
  moved = where_bucket(last_of_bucket[:, None] & untouched & (way_rank < a))    # [M, A]
  table = table.at[moved, way_rank].set(records, mode="drop")
  entry_table = entry_table.at[moved, way_rank].set(held, mode="drop")
  key_record = jnp.concatenate([key, length[:, None], now[:, None]], axis=-1)  # [M, K+2]
  table = table.at[where_bucket(last_of_key & (key_rank < a)), key_rank].set(key_record,
                                                                             mode="drop")
  entry = jnp.concatenate([value, now[:, None]], axis=-1)                      # [M, V+1]
  entry_table = entry_table.at[where_bucket(fresh & (entry_rank < e) & (final_way < a)),
                               final_way, entry_rank].set(entry, mode="drop")
  kept = where_bucket(last_of_key[:, None] & keep_old & (old_rank < e) & (key_rank < a)[:, None])
  entry_table = entry_table.at[kept, key_rank[:, None], old_rank].set(old, mode="drop")
  return table, entry_table


def insert(pool: NgramPool, keys: jax.Array, key_lens: jax.Array, values: jax.Array,
           valid: jax.Array) -> NgramPool:
  """Insert M items per row, in order (a later item sees the earlier ones).

  keys [B, M, K'] left-aligned (K' <= K; tokens past key_lens are ignored), key_lens [B, M] in
  1..K', values [B, M, V] int32, valid [B, M] bool (invalid items change nothing).

  The result is exactly that of inserting the items one after the other (as lookups see it),
  computed in one pass of [M, M] comparisons and scatters (`_insert_row`): no loop, so no
  data-dependent trip count (which costs a device-to-host copy per iteration on a GPU).
  """
  c = pool.config
  b, m, kw = keys.shape
  if kw > c.key_len:
    raise InputError(f"keys of {kw} tokens do not fit a pool with key_len {c.key_len}")
  if values.shape != (b, m, c.value_len):
    raise InputError(f"values must have shape {(b, m, c.value_len)}, got {values.shape}")
  if m == 0:                     # nothing to insert
    return pool
  if kw < c.key_len:
    keys = jnp.pad(keys, ((0, 0), (0, 0), (0, c.key_len - kw)), constant_values=EMPTY)
  key_lens = key_lens.astype(jnp.int32)
  valid = valid & (key_lens >= 1) & (key_lens <= kw)
  keys = normalize_keys(keys, key_lens)
  buckets = bucket_index(c, keys, key_lens)                                    # [B, M]
  stamps = pool.clock[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32)    # [B, M]
  values = values.astype(jnp.int32)
  table, entry_table = jax.vmap(lambda row, items: _insert_row(c, row, items))(
      (pool.keys, pool.entries), (keys, key_lens, values, valid, buckets, stamps))
  clock = pool.clock + jnp.sum(valid, axis=1, dtype=jnp.int32)
  return NgramPool(table, entry_table, clock, config=c)


def suffix_keys(suffix: jax.Array, suffix_len: jax.Array, max_len: int) -> tuple[jax.Array, ...]:
  """Every suffix key of a decoded suffix, longest first.

  suffix [B, S] right-aligned (suffix[:, -1] newest), suffix_len [B] valid tokens at its end.
  Returns keys [B, Kx, max_len] left-aligned and -1 padded, lengths [B, Kx] (Kx down to 1) and
  valid [B, Kx] (length <= suffix_len), Kx = min(S, max_len).
  """
  s = suffix.shape[1]
  kx = min(s, max_len)
  lengths = np.arange(kx, 0, -1, dtype=np.int32)                              # [Kx]
  col = np.arange(max_len, dtype=np.int32)
  src = s - lengths[:, None] + col[None, :]                                   # [Kx, max_len]
  inside = col[None, :] < lengths[:, None]
  keys = jnp.where(jnp.asarray(inside)[None], suffix[:, np.clip(src, 0, s - 1)], EMPTY)
  lens = jnp.broadcast_to(jnp.asarray(lengths)[None], (suffix.shape[0], kx))
  return keys.astype(jnp.int32), lens, lens <= suffix_len[:, None]


def suffix_items(buffers: jax.Array, buffer_lens: jax.Array, values: jax.Array,
                 valid: jax.Array, max_len: int) -> tuple[jax.Array, ...]:
  """The insert items that store values[b, p] under every suffix key of buffers[b, p].

  buffers [B, P, S] right-aligned with buffer_lens [B, P] valid tokens, values [B, P, V], valid
  [B, P]. Returns `insert`'s keys [B, P*Kx, max_len], key_lens [B, P*Kx], values [B, P*Kx, V] and
  valid [B, P*Kx], Kx = min(S, max_len): buffer after buffer, each buffer's longest key first (so
  its shortest key is inserted last, most recent).
  """
  b, p, _ = buffers.shape
  v = values.shape[-1]
  keys, lens, ok = jax.vmap(suffix_keys, in_axes=(1, 1, None), out_axes=1)(
      buffers, buffer_lens, max_len)                                          # [B, P, Kx, K], ...
  kx = keys.shape[2]
  ok &= valid[:, :, None]
  spread = jnp.broadcast_to(values[:, :, None, :], (b, p, kx, v))
  m = p * kx
  return (keys.reshape(b, m, max_len), lens.reshape(b, m), spread.reshape(b, m, v),
          ok.reshape(b, m))


def insert_under_suffixes(pool: NgramPool, suffix: jax.Array, suffix_len: jax.Array,
                          value: jax.Array, valid: jax.Array) -> NgramPool:
  """Store value [B, V] under every suffix (lengths 1..min(S, K)) of suffix [B, S] (right-aligned,
  suffix_len [B] valid tokens), where valid [B]. Shorter keys are inserted last (most recent)."""
  return insert(pool, *suffix_items(suffix[:, None], suffix_len[:, None], value[:, None],
                                    valid[:, None], pool.config.key_len))


def _lookup_one(config: PoolConfig, num: int, row: tuple, keys: jax.Array, lengths: jax.Array,
                usable: jax.Array) -> tuple[jax.Array, jax.Array]:
  key_table, entry_table, _ = row
  kx = keys.shape[0]
  kk, e, v = config.key_len, config.entries_per_key, config.value_len
  buckets = bucket_index(config, keys, lengths)                               # [Kx]
  records = key_table[buckets]                                                # [Kx, A, K+2]
  match = ((records[..., kk] == lengths[:, None])
           & jnp.all(records[..., :kk] == keys[:, None, :], axis=-1) & usable[:, None])  # [Kx, A]
  found = jnp.any(match, axis=-1)
  way = jnp.argmax(match, axis=-1)
  held = entry_table[buckets, way]                                            # [Kx, E, V+1]
  entries = held[..., :v].reshape(kx * e, v)                                  # [C, V], C = Kx*E
  stamps = jnp.where(found[:, None], held[..., v], 0)                         # [Kx, E]
  # Order: longer keys first, then most recent first (stamps are unique); no sort needed.
  newer = jnp.sum(stamps[:, None, :] > stamps[:, :, None], axis=-1)           # [Kx, E]
  ok = (stamps > 0).reshape(kx * e)                                           # [C]
  order = (jnp.arange(kx)[:, None] * e + newer).reshape(kx * e)
  order = jnp.where(ok, order, kx * e + jnp.arange(kx * e))                   # [C], unique
  before = order[None, :] < order[:, None]                                    # [c, c'] c' first
  same = jnp.all(entries[:, None, :] == entries[None, :, :], axis=-1)         # [C, C]
  keep = ok & ~jnp.any(same & before & ok[None, :], axis=-1)
  rank = jnp.sum(before & keep[None, :], axis=-1)
  dest = jnp.where(keep & (rank < num), rank, num)
  out = jnp.full((num, v), EMPTY, jnp.int32).at[dest].set(entries, mode="drop")
  out_ok = jnp.zeros((num,), bool).at[dest].set(True, mode="drop")
  return out, out_ok


def lookup(pool: NgramPool, suffix: jax.Array, suffix_len: jax.Array,
           num: int) -> tuple[jax.Array, jax.Array]:
  """Up to `num` distinct continuations of a decoded suffix.

  suffix [B, S] right-aligned (suffix[:, -1] is the newest token), suffix_len [B] how many of its
  last tokens are real (>= 1). Keys of length min(S, K) down to 1 are tried in turn; each key's
  continuations come most recently used first. Returns candidates [B, num, V] int32 (-1 where
  invalid) and valid [B, num] bool (valid entries first).
  """
  keys, lens, usable = suffix_keys(suffix.astype(jnp.int32), suffix_len, pool.config.key_len)
  def one_row(row, k, n, u):
    return _lookup_one(pool.config, num, row, k, n, u)
  return jax.vmap(one_row)(_row_arrays(pool), keys, lens, usable)


SEED_ITEMS = 128   # items per insert call when storing a text's n-grams (span starts x keys)


def insert_sequence_ngrams(pool: NgramPool, tokens: jax.Array, num_tokens: jax.Array,
                           starts_per_call: int | None = None) -> NgramPool:
  """Store every n-gram of tokens[b, :num_tokens[b]] ([B, L], [B]): each V-token span is stored
  under every key (1..K tokens) that ends right before it, in text order (later n-grams are more
  recent). One insert call takes `starts_per_call` consecutive span starts (default: SEED_ITEMS
  items, SEED_ITEMS // K starts), exactly as one call per start would: a prompt of L tokens
  takes about L / starts_per_call loop iterations."""
  c = pool.config
  b = tokens.shape[0]
  kk, v = c.key_len, c.value_len
  per_call = max(1, SEED_ITEMS // kk) if starts_per_call is None else starts_per_call
  if not is_int(per_call) or per_call < 1:
    raise InputError(f"starts_per_call must be an integer >= 1, got {starts_per_call!r}")
  # Padded so that a call's window never runs past the end (dynamic_slice would move it back).
  padded = jnp.pad(tokens.astype(jnp.int32), ((0, 0), (kk, v + per_call)), constant_values=EMPTY)
  span = np.arange(per_call)[:, None] + np.arange(kk + v)[None, :]            # [P, K+V]

  def body(i, pool):     # span starts first .. first + P - 1; span j's value is
    first = 1 + i * per_call                      # tokens[:, first + j : first + j + V]
    window = jax.lax.dynamic_slice_in_dim(padded, first, per_call + kk + v - 1, axis=1)
    spans = window[:, span]                                                   # [B, P, K+V]
    start = first + jnp.arange(per_call, dtype=jnp.int32)                     # [P]
    key_len = jnp.broadcast_to(jnp.minimum(start, kk), (b, per_call))         # [B, P]
    whole = start[None, :] + v <= num_tokens[:, None]                         # [B, P]
    return insert(pool, *suffix_items(spans[..., :kk], key_len, spans[..., kk:], whole, kk))

  starts = jnp.maximum(jnp.max(num_tokens) - v, 0)          # span starts 1 .. last - V
  return jax.lax.fori_loop(0, (starts + per_call - 1) // per_call, body, pool)
