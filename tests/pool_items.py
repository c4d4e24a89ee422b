"""The n-gram pool driven by plain (key, value) tuples: the pool, FAFO and Lookahead tests insert
the items they expect and compare pools array by array."""

from __future__ import annotations

import jax
import numpy as np

from sparsedec.ngram import pool as ngram_pool

_insert = jax.jit(ngram_pool.insert)


def insert_items(pool, *rows: list[tuple[tuple, tuple] | None], width: int | None = None):
  """ngram_pool.insert of rows[b] = [(key, value) or None (an invalid item)], in order, for row b
  (rows past the given ones insert nothing); `width` items per row per call (default the longest
  row's count; the rest padded with invalid items)."""
  cfg = pool.config
  m = width if width is not None else max([1] + [len(items) for items in rows])
  keys = np.full((pool.batch_size, m, cfg.key_len), -1, np.int32)
  lens = np.ones((pool.batch_size, m), np.int32)
  values = np.zeros((pool.batch_size, m, cfg.value_len), np.int32)
  valid = np.zeros((pool.batch_size, m), bool)
  for r, items in enumerate(rows):
    for i, item in enumerate(items):
      if item is not None:
        key, value = item
        keys[r, i, : len(key)], lens[r, i], values[r, i], valid[r, i] = key, len(key), value, True
  return _insert(pool, keys, lens, values, valid)


def assert_pools_equal(got, want, label: str = "") -> None:
  """The two pools' keys and entries, array for array."""
  np.testing.assert_array_equal(np.asarray(got.keys), np.asarray(want.keys), label)
  np.testing.assert_array_equal(np.asarray(got.entries), np.asarray(want.entries), label)
