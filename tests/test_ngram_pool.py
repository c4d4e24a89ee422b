"""The device n-gram pool against a plain-Python model: inserts, longest-suffix lookups, LRU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsedec.errors import InputError
from sparsedec.ngram import pool as ngram_pool
from sparsedec.ngram.pool import PoolConfig

from pool_items import insert_items

MASK32 = 0xFFFFFFFF


def py_hash(key: tuple[int, ...], key_len: int) -> int:
  """Plain-Python re-implementation of pool.key_hash (uint32 arithmetic)."""
  h = (len(key) * ngram_pool.HASH_SEED) & MASK32
  tokens = list(key) + [-1] * (key_len - len(key))
  for t in tokens:
    h = ((h ^ (t & MASK32)) * ngram_pool.HASH_MUL) & MASK32
    h ^= h >> 15
  h ^= h >> 16
  h = (h * ngram_pool.FMIX_MUL1) & MASK32
  h ^= h >> 13
  h = (h * ngram_pool.FMIX_MUL2) & MASK32
  return h ^ (h >> 16)


class ModelPool:
  """The pool's specification in plain Python: buckets of key slots, LRU keys and entries."""

  def __init__(self, cfg: PoolConfig):
    self.cfg = cfg
    # bucket -> list of ways: None or [key, key_stamp, entries: list of None | [value, stamp]]
    self.buckets = [[None] * cfg.bucket_ways for _ in range(cfg.num_buckets)]
    self.clock = 0

  def _bucket(self, key):
    return self.buckets[py_hash(key, self.cfg.key_len) % self.cfg.num_buckets]

  def insert(self, key: tuple, value: tuple) -> None:
    self.clock += 1
    ways = self._bucket(key)
    slot = next((w for w in ways if w is not None and w[0] == key), None)
    if slot is None:
      free = [i for i, w in enumerate(ways) if w is None]
      i = free[0] if free else min(range(len(ways)), key=lambda i: ways[i][1])
      slot = ways[i] = [key, 0, [None] * self.cfg.entries_per_key]
    slot[1] = self.clock
    entries = slot[2]
    same = [i for i, e in enumerate(entries) if e is not None and e[0] == value]
    free = [i for i, e in enumerate(entries) if e is None]
    i = (same or free or [min(range(len(entries)), key=lambda i: entries[i][1])])[0]
    entries[i] = [value, self.clock]

  def lookup(self, suffix: tuple, num: int) -> list[tuple]:
    out = []
    for k in range(min(len(suffix), self.cfg.key_len), 0, -1):
      key = tuple(suffix[-k:])
      slot = next((w for w in self._bucket(key) if w is not None and w[0] == key), None)
      if slot is None:
        continue
      for value, _ in sorted((e for e in slot[2] if e is not None), key=lambda e: -e[1]):
        if value not in out and len(out) < num:
          out.append(value)
    return out


ROWS = 2           # every device call uses 2 rows, ...
INSERT_WIDTH = 8   # ... 8 items per insert (padded with invalid ones) ...
NUM = 4            # ... and 4 lookup slots, so each config compiles insert and lookup once


@functools.cache
def jitted_lookup(num: int):
  return jax.jit(functools.partial(ngram_pool.lookup, num=num))


def device_insert(pool, *rows: list[tuple[tuple, tuple] | None]):
  """rows[b]: the items (key, value) or None (invalid) for row b; missing rows get none."""
  return insert_items(pool, *rows, width=INSERT_WIDTH)


def device_lookup(pool, *suffixes: tuple, num: int = NUM, width: int | None = None
                  ) -> list[list[tuple]]:
  """Candidates per row for suffixes[b] (rows beyond them look up a dummy); `width` defaults to
  the key length, the results are cut to `num` on the host unless num > NUM."""
  b = pool.batch_size
  width = width or pool.config.key_len
  suffix = np.full((b, width), -1, np.int32)
  slen = np.ones((b,), np.int32)
  for r, s in enumerate(suffixes):
    s = s[-width:]
    suffix[r, width - len(s):] = s
    slen[r] = len(s)
  cands, ok = jitted_lookup(max(num, NUM))(pool, suffix, slen)
  cands, ok = np.asarray(cands), np.asarray(ok)
  out = []
  for r in range(len(suffixes)):
    n = int(ok[r].sum())
    assert ok[r, :n].all(), "valid candidates must come first"
    assert (cands[r, n:] == -1).all()
    out.append([tuple(int(t) for t in c) for c in cands[r, :n]][:num])
  return out


SMALL = PoolConfig(key_len=3, value_len=2, entries_per_key=2, num_buckets=2, bucket_ways=2)

tokens = st.integers(0, 2)
keys = st.lists(tokens, min_size=1, max_size=SMALL.key_len).map(tuple)
values = st.lists(tokens, min_size=SMALL.value_len, max_size=SMALL.value_len).map(tuple)
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), keys, values, st.booleans()),
    st.tuples(st.just("lookup"), st.lists(tokens, min_size=1, max_size=4).map(tuple),
              st.integers(1, 4)),
), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
def test_pool_matches_python_model(ops):
  """Random inserts and lookups over a 3-token vocabulary in a 2x2-slot table: keys collide in
  buckets, keys and entries get evicted. Row 1 gets the same operations as row 0 except that
  inserts flagged False are invalid there (skipped by the model of row 1)."""
  pool = ngram_pool.init_pool(SMALL, ROWS)
  models = [ModelPool(SMALL), ModelPool(SMALL)]
  for op in ops:
    if op[0] == "insert":
      _, key, value, in_row1 = op
      pool = device_insert(pool, [(key, value)], [(key, value) if in_row1 else None])
      models[0].insert(key, value)
      if in_row1:
        models[1].insert(key, value)
    else:
      _, suffix, num = op
      got = device_lookup(pool, suffix, suffix, num=num, width=4)
      assert got == [m.lookup(suffix, num) for m in models]


@settings(max_examples=20, deadline=None)
@given(items=st.lists(st.tuples(keys, values), min_size=1, max_size=INSERT_WIDTH))
def test_one_call_with_many_items_equals_one_call_per_item(items):
  """M items in one insert call behave as M sequential inserts (duplicates in one call included)."""
  batched = device_insert(ngram_pool.init_pool(SMALL, ROWS), items)
  model = ModelPool(SMALL)
  for key, value in items:
    model.insert(key, value)
  for suffix in [(0,), (1,), (2,), (0, 1, 2), (2, 1, 0), (1, 1, 1), (0, 0, 0)]:
    assert device_lookup(batched, suffix) == [model.lookup(suffix, NUM)]


# Three one-token keys of bucket 0 (two ways): drawn often, they evict each other within a call.
busy_keys = st.sampled_from([(t,) for t in range(100)
                             if py_hash((t,), SMALL.key_len) % SMALL.num_buckets == 0][:3])


def pool_contents(pool, row: int) -> dict:
  """Row `row` of a device pool as its meaning: {bucket: {key: (key stamp, [(value, stamp), ...]
  most recent first)}} (positions inside a bucket and a key's entries carry no meaning)."""
  c = pool.config
  keys, entries = np.asarray(pool.keys[row]), np.asarray(pool.entries[row])
  out = {}
  for b in range(c.num_buckets):
    for w in range(c.bucket_ways):
      length, stamp = int(keys[b, w, c.key_len]), int(keys[b, w, c.key_len + 1])
      if length == 0:
        continue
      held = sorted(((tuple(int(t) for t in e[:c.value_len]), int(e[c.value_len]))
                     for e in entries[b, w] if e[c.value_len] > 0), key=lambda e: -e[1])
      out.setdefault(b, {})[tuple(int(t) for t in keys[b, w, :length])] = (stamp, held)
  return out


def model_contents(model: ModelPool) -> dict:
  return {b: {w[0]: (w[1], sorted((tuple(e) for e in w[2] if e is not None), key=lambda e: -e[1]))
              for w in ways if w is not None}
          for b, ways in enumerate(model.buckets) if any(w is not None for w in ways)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(st.lists(st.one_of(st.tuples(st.one_of(keys, busy_keys), values), st.none()),
                               min_size=1, max_size=INSERT_WIDTH), min_size=1, max_size=5))
def test_calls_of_many_items_keep_the_stamps_of_one_by_one_inserts(calls):
  """Calls of up to 8 items (invalid ones among them) into a 2x2-way table of 2-entry keys, many
  under three keys of one bucket: keys are evicted and come back within one call (or stay, a key
  inserted into twice in between counting once), old continuations survive or not. After each call
  every key, its stamp and its continuations with their stamps equal those of the sequential
  model; row 1 inserts nothing and stays empty."""
  pool, model = ngram_pool.init_pool(SMALL, ROWS), ModelPool(SMALL)
  for items in calls:
    pool = device_insert(pool, items)
    for item in items:
      if item is not None:
        model.insert(*item)
    assert pool_contents(pool, 0) == model_contents(model)
    assert pool_contents(pool, 1) == {}
    np.testing.assert_array_equal(np.asarray(pool.clock), [model.clock, 0])


def test_empty_pool_returns_nothing():
  pool = ngram_pool.init_pool(SMALL, ROWS)
  for suffix in [(0,), (1, 2), (2, 2, 2)]:
    assert device_lookup(pool, suffix, suffix) == [[], []]


# One-token keys, 8 buckets of 2 ways, 3 continuations per key.
ONE = PoolConfig(key_len=1, value_len=2, entries_per_key=3, num_buckets=8, bucket_ways=2)


def colliding_keys(cfg: PoolConfig, count: int) -> list[tuple[int]]:
  """`count` one-token keys that hash to bucket 0."""
  out = [(t,) for t in range(10_000) if py_hash((t,), cfg.key_len) % cfg.num_buckets == 0]
  assert len(out) >= count
  return out[:count]


def test_colliding_keys_share_a_bucket_without_mixing_up():
  a, b, c = colliding_keys(ONE, 3)
  def both(pool, items):            # the same items in both rows
    return device_insert(pool, items, items)
  pool = both(ngram_pool.init_pool(ONE, ROWS), [(a, (1, 1)), (b, (2, 2))])
  assert device_lookup(pool, a, b) == [[(1, 1)], [(2, 2)]]
  # A third key in the full bucket evicts the least recently inserted-into key (a) ...
  pool = both(pool, [(c, (3, 3))])
  assert device_lookup(pool, a, b) == [[], [(2, 2)]]   # the key check: a finds nothing, not c's
  assert device_lookup(pool, c) == [[(3, 3)]]
  # ... and inserting under b refreshes b, so the next eviction takes c.
  pool = both(pool, [(b, (4, 4)), (a, (5, 5))])
  assert device_lookup(pool, b, a) == [[(4, 4), (2, 2)], [(5, 5)]]
  assert device_lookup(pool, c) == [[]]


def test_direct_mapped_collision_is_a_miss_not_a_wrong_hit():
  cfg = PoolConfig(key_len=1, value_len=1, entries_per_key=1, num_buckets=4, bucket_ways=1)
  a, b = colliding_keys(cfg, 2)
  items = [(a, (7,)), (b, (8,))]
  pool = device_insert(ngram_pool.init_pool(cfg, ROWS), items, items)
  assert device_lookup(pool, a, b) == [[], [(8,)]]


def test_full_key_evicts_its_least_recently_used_continuation():
  pool = ngram_pool.init_pool(ONE, ROWS)
  pool = device_insert(pool, [((5,), (1, 1)), ((5,), (2, 2)), ((5,), (3, 3))])
  assert device_lookup(pool, (5,)) == [[(3, 3), (2, 2), (1, 1)]]
  pool = device_insert(pool, [((5,), (1, 1))])             # refresh: now most recent
  assert device_lookup(pool, (5,)) == [[(1, 1), (3, 3), (2, 2)]]
  pool = device_insert(pool, [((5,), (4, 4))])             # full: evicts (2, 2)
  assert device_lookup(pool, (5,)) == [[(4, 4), (1, 1), (3, 3)]]


def test_rows_are_independent_pools():
  pool = device_insert(ngram_pool.init_pool(ONE, ROWS), [((1,), (5, 5))], [((1,), (6, 6))])
  assert device_lookup(pool, (1,), (1,)) == [[(5, 5)], [(6, 6)]]


# Keys of up to 3 tokens in a table large enough that nothing is evicted.
WIDE = PoolConfig(key_len=3, value_len=2, entries_per_key=3, num_buckets=64, bucket_ways=4)


def test_lookup_goes_longest_suffix_first_and_dedupes():
  pool = device_insert(ngram_pool.init_pool(WIDE, ROWS),
                       [((9,), (1, 1)), ((9,), (2, 2)), ((8, 9), (3, 3)), ((7, 8, 9), (2, 2)),
                        ((6, 9), (5, 5)), ((9,), (4, 4))])
  # suffix ... 7 8 9: key (7,8,9) -> (2,2); (8,9) -> (3,3); (9,) -> (4,4), (2,2) dup, (1,1)
  assert device_lookup(pool, (7, 8, 9)) == [[(2, 2), (3, 3), (4, 4), (1, 1)]]
  # the device's own `num` cut (not the host's) and a narrower lookup width capping key length
  cands, ok = jitted_lookup(2)(pool, np.asarray([[7, 8, 9], [0, 0, 0]], np.int32),
                               np.asarray([3, 3], np.int32))
  assert np.asarray(cands)[0].tolist() == [[2, 2], [3, 3]] and np.asarray(ok)[0].all()
  assert device_lookup(pool, (7, 8, 9), width=1) == [[(4, 4), (2, 2), (1, 1)]]
  # a suffix of one real token only tries the one-token key
  assert device_lookup(pool, (9,)) == [[(4, 4), (2, 2), (1, 1)]]


def test_suffix_items_are_buffer_major_longest_key_first():
  # buffers [B 1, P 2, S 3] right-aligned: buffer 0 holds 2 real tokens (5 6), buffer 1 all three
  # (1 2 3); keys of at most 2 tokens; buffer 1 is not valid.
  keys, lens, values, ok = ngram_pool.suffix_items(
      jnp.asarray([[[0, 5, 6], [1, 2, 3]]]), jnp.asarray([[2, 3]]),
      jnp.asarray([[[7, 7], [8, 8]]]), jnp.asarray([[True, False]]), 2)
  assert keys.tolist() == [[[5, 6], [6, -1], [2, 3], [3, -1]]]
  assert lens.tolist() == [[2, 1, 2, 1]]
  assert values.tolist() == [[[7, 7], [7, 7], [8, 8], [8, 8]]]
  assert ok.tolist() == [[True, True, False, False]]
  # a buffer shorter than its longest key: that key is not valid
  _, lens, _, ok = ngram_pool.suffix_items(jnp.asarray([[[0, 0, 6]]]), jnp.asarray([[1]]),
                                           jnp.asarray([[[7, 7]]]), jnp.asarray([[True]]), 3)
  assert lens.tolist() == [[3, 2, 1]] and ok.tolist() == [[False, False, True]]


def test_insert_under_suffixes_and_sequence_ngrams():
  pool = jax.jit(ngram_pool.insert_under_suffixes)(
      ngram_pool.init_pool(WIDE, ROWS), jnp.asarray([[3, 4], [3, 4]]), jnp.asarray([2, 1]),
      jnp.asarray([[7, 7], [8, 8]]), jnp.asarray([True, True]))
  assert device_lookup(pool, (4,), (4,)) == [[(7, 7)], [(8, 8)]]
  assert device_lookup(pool, (3, 4), (3, 4)) == [[(7, 7)], [(8, 8)]]   # row 1: only key (4,)
  assert device_lookup(pool, (9, 3, 4), (3,)) == [[(7, 7)], []]
  # n-grams of a text: 1 2 3 1 2 4 (rows of different lengths; row 1 has only 1 2 3)
  text = jnp.asarray([[1, 2, 3, 1, 2, 4, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0]])
  pool = jax.jit(ngram_pool.insert_sequence_ngrams)(ngram_pool.init_pool(WIDE, ROWS), text,
                                                    jnp.asarray([6, 3]))
  model = ModelPool(WIDE)
  seq = [1, 2, 3, 1, 2, 4]
  for start in range(1, len(seq) - 1):
    for k in range(min(start, 3), 0, -1):
      model.insert(tuple(seq[start - k: start]), tuple(seq[start: start + 2]))
  for suffix in [(1,), (2,), (1, 2), (3, 1), (2, 3), (3, 1, 2), (9, 9, 1)]:
    assert device_lookup(pool, suffix)[0] == model.lookup(suffix, NUM)
  assert device_lookup(pool, (1,), (1,)) == [[(2, 4), (2, 3)], [(2, 3)]]
  assert device_lookup(pool, (2,), (2,))[1] == []          # 2 3 then nothing: no full span


def test_sequence_ngrams_in_calls_of_many_starts_equal_one_call_per_start():
  """A 300-token text over 6 tokens (n-grams repeat, keys are evicted) stored 20 / 42 (the
  default: SEED_ITEMS 128 items over 3-token keys) / 300 span starts a call: every key, stamp and
  continuation equal the sequential model's, in both rows (the second 137 tokens long, its row
  inserting nothing in the calls past its end)."""
  rng = np.random.default_rng(3)
  text = rng.integers(0, 6, (2, 300)).astype(np.int32)
  lengths = np.array([300, 137], np.int32)
  seed = jax.jit(ngram_pool.insert_sequence_ngrams, static_argnames="starts_per_call")
  models = []
  for row, n in zip(text, lengths):
    model = ModelPool(WIDE)
    for start in range(1, n - WIDE.value_len + 1):
      for k in range(min(start, WIDE.key_len), 0, -1):
        model.insert(tuple(int(t) for t in row[start - k: start]),
                     tuple(int(t) for t in row[start: start + WIDE.value_len]))
    models.append(model_contents(model))
  for per_call in (20, None, 300):
    pool = seed(ngram_pool.init_pool(WIDE, ROWS), text, lengths, starts_per_call=per_call)
    assert [pool_contents(pool, r) for r in range(ROWS)] == models, per_call
  with pytest.raises(InputError, match="starts_per_call"):
    ngram_pool.insert_sequence_ngrams(ngram_pool.init_pool(WIDE, ROWS), text, lengths, 0)


def test_inserting_no_items_leaves_the_pool_unchanged():
  """M = 0 items (and an empty suffix under insert_under_suffixes): a ValueError from a max
  over zero ranks before."""
  pool = device_insert(ngram_pool.init_pool(SMALL, ROWS), [((1,), (2, 2))])
  empty = ngram_pool.insert(pool, jnp.zeros((ROWS, 0, 2), jnp.int32),
                            jnp.zeros((ROWS, 0), jnp.int32),
                            jnp.zeros((ROWS, 0, SMALL.value_len), jnp.int32),
                            jnp.zeros((ROWS, 0), bool))
  assert device_lookup(empty, (1,), (1,)) == [[(2, 2)], []]
  assert int(empty.clock[0]) == 1
  empty = ngram_pool.insert_under_suffixes(pool, jnp.zeros((ROWS, 0), jnp.int32),
                                           jnp.zeros((ROWS,), jnp.int32),
                                           jnp.zeros((ROWS, SMALL.value_len), jnp.int32),
                                           jnp.ones((ROWS,), bool))
  assert device_lookup(empty, (1,), (1,)) == [[(2, 2)], []]


def test_bad_config_and_shapes_are_errors():
  with pytest.raises(InputError, match="entries_per_key"):
    PoolConfig(key_len=1, value_len=2, entries_per_key=0)
  pool = ngram_pool.init_pool(SMALL, 1)
  with pytest.raises(InputError, match="key_len 3"):
    ngram_pool.insert(pool, jnp.zeros((1, 1, 4), jnp.int32), jnp.ones((1, 1), jnp.int32),
                      jnp.zeros((1, 1, 2), jnp.int32), jnp.ones((1, 1), bool))
  with pytest.raises(InputError, match="values must have shape"):
    ngram_pool.insert(pool, jnp.zeros((1, 1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32),
                      jnp.zeros((1, 1, 3), jnp.int32), jnp.ones((1, 1), bool))


def test_lookup_tries_only_keys_within_the_suffix_length():
  """suffix_len says how many of the suffix's last tokens are real: a longer key made of the
  tokens before them (FAFO's suffix at the start of a row repeats token 0 there) is not tried."""
  items = [((8, 9), (3, 3)), ((9,), (4, 4)), ((7, 8, 9), (5, 5))]
  pool = device_insert(ngram_pool.init_pool(WIDE, ROWS), items, items)
  suffix = np.asarray([[7, 8, 9], [7, 8, 9]], np.int32)
  cands, ok = jitted_lookup(NUM)(pool, suffix, np.asarray([1, 2], np.int32))
  cands, ok = np.asarray(cands), np.asarray(ok)
  assert cands[0][ok[0]].tolist() == [[4, 4]]
  assert cands[1][ok[1]].tolist() == [[3, 3], [4, 4]]


def test_insert_under_suffixes_inserts_shorter_keys_last():
  """Shorter keys are inserted last (most recent), so in a full bucket the longest key is the one
  the next insert evicts: one bucket of 2 ways, a 3-token suffix -> the two shortest keys stay."""
  cfg = PoolConfig(key_len=3, value_len=1, entries_per_key=1, num_buckets=1, bucket_ways=2)
  pool = jax.jit(ngram_pool.insert_under_suffixes)(
      ngram_pool.init_pool(cfg, ROWS), jnp.asarray([[1, 2, 3]] * ROWS), jnp.asarray([3] * ROWS),
      jnp.asarray([[7]] * ROWS), jnp.ones((ROWS,), bool))
  held = sorted(tuple(int(t) for t in key[:n]) for key, n in
                zip(np.asarray(pool.key_tokens)[0, 0], np.asarray(pool.key_lens)[0, 0]))
  assert held == [(2, 3), (3,)]
