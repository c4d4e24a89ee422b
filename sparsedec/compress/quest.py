"""Quest (Tang et al. 2024): query-aware page selection, re-chosen every step; dynamic.

Per layer, row and KV head, each page (a block of `block_size` slots) keeps the channel-wise
minimum and maximum of its keys. A query q bounds its score on the page by
sum_d max(q_d * min_d, q_d * max_d); the `budget_blocks` pages with the highest bound (summed
over the query heads of the KV head) are read. The newest page is always read.

The query statistics are the current token's queries of the previous step, per layer (the FAFO
step records them); the first selection uses the last prompt token's queries. Page bounds are
computed once for the prompt and then refreshed only for the pages the step's commit touched.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from sparsedec.attention import BlockListView
from sparsedec.compress.base import check_budget, prompt_window_queries
from sparsedec.errors import InputError, is_int
from sparsedec.kv.dense import KVCache


@struct.dataclass
class QuestState:
  # Per layer first ([L, B, ...]): serving's insert_row copies a row along axis 1.
  BATCH_AXES: ClassVar[dict[str, int]] = {"page_min": 1, "page_max": 1, "tables": 1, "counts": 1}
  page_min: jax.Array      # [L, B, Hkv, P, D] channel-wise min of each page's valid keys
  page_max: jax.Array      # [L, B, Hkv, P, D]
  tables: jax.Array        # [L, B, Hkv, min(NB, P)] int32 selected pages
  counts: jax.Array        # [L, B, Hkv] int32
  seen: jax.Array          # [B] int32: cache length the page bounds are up to date with


def _page_bounds(k: jax.Array, lengths: jax.Array, block_size: int):
  """k [B, Hkv, S, D] -> (min, max) [B, Hkv, P, D] over slots < lengths (empty pages: 0)."""
  b, h, s, d = k.shape
  pages = k.reshape(b, h, s // block_size, block_size, d).astype(jnp.float32)
  valid = (jnp.arange(s) < lengths[:, None]).reshape(b, 1, s // block_size, block_size, 1)
  lo = jnp.where(valid, pages, jnp.inf).min(3)
  hi = jnp.where(valid, pages, -jnp.inf).max(3)
  any_valid = valid.any(3)
  return jnp.where(any_valid, lo, 0.0), jnp.where(any_valid, hi, 0.0)


def _select(q: jax.Array, page_min: jax.Array, page_max: jax.Array, lengths: jax.Array,
            block_size: int, budget: int):
  """q [B, Hq, D]; page bounds [B, Hkv, P, D] -> tables [B, Hkv, min(NB, P)], counts [B, Hkv]."""
  b, hq, d = q.shape
  hkv, p = page_min.shape[1], page_min.shape[2]
  qg = q.reshape(b, hkv, hq // hkv, 1, d).astype(jnp.float32)              # [B, Hkv, G, 1, D]
  bound = jnp.maximum(qg * page_min[:, :, None], qg * page_max[:, :, None]).sum((-1, 2))
  used = -(-lengths // block_size)                                          # [B]
  page = jnp.arange(p)
  bound = jnp.where(page[None, None] < used[:, None, None], bound, -jnp.inf)  # [B, Hkv, P]
  bound = jnp.where(page[None, None] == used[:, None, None] - 1, jnp.inf, bound)
  # A budget past the P pages lists them all: tables [B, Hkv, min(budget, P)] (padding them to
  # the budget made QuestState [L, B, Hkv, budget]: 3.8 GiB at budget_blocks 2**22).
  _, tables = jax.lax.top_k(bound, min(budget, p))
  counts = jnp.broadcast_to(jnp.minimum(used, budget)[:, None], (b, hkv))
  return tables.astype(jnp.int32), counts.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Quest:
  budget_blocks: int = 16
  block_size: int = 64
  max_commit: int = 64        # most cache entries one step commits (bounds the pages refreshed)
  name: str = "quest"
  needs_queries: ClassVar[bool] = True   # FAFO captures each step's queries for update()

  def __post_init__(self):
    check_budget("Quest", self.block_size, self.budget_blocks)
    if not is_int(self.max_commit) or self.max_commit < 1:
      raise InputError(f"Quest: max_commit must be an integer >= 1, got {self.max_commit!r}")

  def init(self, cfg, params, state) -> QuestState:
    cache = state.cache
    bounds = [_page_bounds(k, cache.lengths, self.block_size) for k in cache.k]
    page_min = jnp.stack([lo for lo, _ in bounds])
    page_max = jnp.stack([hi for _, hi in bounds])
    queries, _, _ = prompt_window_queries(cfg, params, state, 1)
    return self._reselect(QuestState(page_min, page_max, None, None, cache.lengths),
                          [q[:, -1] for q in queries], cache.lengths)

  def _reselect(self, st: QuestState, queries, lengths) -> QuestState:
    picked = [_select(q, st.page_min[i], st.page_max[i], lengths, self.block_size,
                      self.budget_blocks) for i, q in enumerate(queries)]
    return st.replace(tables=jnp.stack([t for t, _ in picked]),
                      counts=jnp.stack([c for _, c in picked]))

  def view(self, st: QuestState, cache: KVCache) -> BlockListView:
    return BlockListView(st.tables, st.counts, self.block_size, per_layer=True)

  def update(self, st: QuestState, cache: KVCache, queries) -> QuestState:
    """Refresh the bounds of the pages written since `st.seen` (at most `max_commit` slots per
    step), then reselect with `queries` (per layer [B, Hq, D])."""
    bs = self.block_size
    num_pages = st.page_min.shape[3]
    first = st.seen // bs                                          # [B] first page touched
    bidx = jnp.arange(first.shape[0])
    page_min, page_max = st.page_min, st.page_max
    for j in range(1 + -(-self.max_commit // bs)):
      page = jnp.minimum(first + j, num_pages - 1)                 # [B]
      slot = page[:, None] * bs + jnp.arange(bs)[None]             # [B, bs]
      ok = (slot < cache.lengths[:, None])[:, None, :, None]       # [B, 1, bs, 1]
      los, his = [], []
      for k in cache.k:                                            # k [B, Hkv, S, D]
        rows = jax.vmap(lambda kb, pg: jax.lax.dynamic_slice_in_dim(kb, pg * bs, bs, axis=1))(
            k, page).astype(jnp.float32)                           # [B, Hkv, bs, D]
        los.append(jnp.where(ok.any(2), jnp.where(ok, rows, jnp.inf).min(2), 0.0))
        his.append(jnp.where(ok.any(2), jnp.where(ok, rows, -jnp.inf).max(2), 0.0))
      page_min = page_min.at[:, bidx, :, page].set(jnp.stack(los, axis=1))   # [B, L, Hkv, D]
      page_max = page_max.at[:, bidx, :, page].set(jnp.stack(his, axis=1))
    st = st.replace(page_min=page_min, page_max=page_max, seen=cache.lengths)
    return self._reselect(st, queries, cache.lengths)
