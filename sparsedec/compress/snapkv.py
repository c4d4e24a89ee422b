"""SnapKV (Li et al. 2024): select the prompt's important blocks once, from the attention of an
observation window at the end of prefill; static.

Per layer, row and KV head: the last `window` prompt tokens' softmax attention over the committed
prompt (summed over the window's queries and the KV head's query heads, average-pooled over
`pool` neighbouring slots) scores each block before the recent region; the best
`budget_blocks - recent_blocks` of them are kept for the whole generation. The `recent_blocks`
newest blocks of the row (which slide as text is generated) are always read; a prompt with fewer
candidate blocks than that leaves the rest of the budget to more of the newest blocks.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.combine import f32_einsum
from sparsedec.attention import BlockListView
from sparsedec.compress.base import (capped_budget, check_budget, pack_tables,
                                     prompt_window_queries)
from sparsedec.errors import InputError, is_int
from sparsedec.kv.dense import KVCache


@struct.dataclass
class SnapKVState:
  # Per layer first ([L, B, ...]): serving's insert_row copies a row along axis 1.
  BATCH_AXES: ClassVar[dict[str, int]] = {"tables": 1, "counts": 1}
  tables: jax.Array        # [L, B, Hkv, NS] int32 selected prompt blocks (NS <= blocks of S)
  counts: jax.Array        # [L, B, Hkv] int32


def top_blocks(scores, candidates: jax.Array, keep: int) -> SnapKVState:
  """Per layer, the `keep` best-scored of each row's first `candidates` blocks (fewer where the
  row has fewer): scores, per layer [B, Hkv, P]; candidates [B] int32."""
  tables, counts = [], []
  for score in scores:
    page = jnp.arange(score.shape[-1])
    score = jnp.where(page[None, None] < candidates[:, None, None], score, -jnp.inf)
    _, top = jax.lax.top_k(score, min(keep, score.shape[-1]))        # no more than P blocks
    tables.append(top.astype(jnp.int32))
    counts.append(jnp.broadcast_to(jnp.minimum(candidates, keep)[:, None], top.shape[:2]))
  return SnapKVState(jnp.stack(tables), jnp.stack(counts).astype(jnp.int32))


def selected_and_recent(policy, st: SnapKVState, cache: KVCache) -> BlockListView:
  """The selected prompt blocks, then the newest blocks in the rest of the budget (at least
  `recent_blocks`; more where the prompt had fewer candidates than budget_blocks -
  recent_blocks, which were then all selected: blocks 0 .. counts - 1, so the newest blocks
  start at or after counts and the two lists never overlap). SnapKV's and TriForce's chunk
  retrieval's view (`ChunkRetrieval`): they differ in how the blocks are selected."""
  nb = capped_budget(policy, cache)        # a budget past the cache's blocks: all of them
  used = -(-cache.lengths.astype(jnp.int32) // policy.block_size)[None, :, None]   # [1, B, 1]
  start = jnp.maximum(used - (nb - st.counts), st.counts)                       # [L, B, Hkv]
  recent = jnp.minimum(start[..., None] + jnp.arange(nb, dtype=jnp.int32),
                       cache.k[0].shape[2] // policy.block_size - 1)            # [L, B, Hkv, NB]
  tables, counts = pack_tables(st.tables, st.counts, recent, jnp.maximum(used - start, 0))
  return BlockListView(tables[..., :nb], counts, policy.block_size, per_layer=True)


def _block_scores(q: jax.Array, q_pos: jax.Array, q_valid: jax.Array, k: jax.Array,
                  lengths: jax.Array, block_size: int, pool: int) -> jax.Array:
  """q [B, w, Hq, D] at q_pos [B, w]; k [B, Hkv, S, D] -> pooled attention mass [B, Hkv, S/bs].

  One window query per scan step: its scores are [B, Hkv, G, S] in fp32, and K is read in its
  own dtype (queries and keys share the model's; products accumulated in fp32). The whole
  window's [B, Hkv, G, w, S] scores at once, K converted to fp32 beside them, took XLA:CPU
  1.5 GiB of temporaries per row and layer at Llama-3.1-8B shapes, 128K, window 32 (now
  0.04 GiB)."""
  b, w, hq, d = q.shape
  hkv, s = k.shape[1], k.shape[2]
  qg = q.reshape(b, w, hkv, hq // hkv, d)                                   # [B, w, Hkv, G, D]
  slot = jnp.arange(s)

  def add_query(mass, xs):
    qw, pos, valid = xs                                   # [B, Hkv, G, D], [B], [B]
    scores = f32_einsum("bhgd,bhsd->bhgs", qw, k) * d ** -0.5              # [B, Hkv, G, S]
    ok = (slot[None, :] <= pos[:, None]) & (slot[None, :] < lengths[:, None])   # [B, S]
    probs = jax.nn.softmax(jnp.where(ok[:, None, None], scores, -jnp.inf), axis=-1)
    probs = jnp.where(ok[:, None, None] & valid[:, None, None, None], probs, 0.0)
    return mass + probs.sum(2), None                                         # [B, Hkv, S]

  mass, _ = jax.lax.scan(add_query, jnp.zeros((b, hkv, s), jnp.float32),
                         (jnp.moveaxis(qg, 1, 0), q_pos.T, q_valid.T))
  if pool > 1:
    mass = jax.lax.reduce_window(mass, 0.0, jax.lax.add, (1, 1, pool), (1, 1, 1), "SAME") / pool
  return mass.reshape(b, hkv, s // block_size, block_size).sum(-1)


@dataclasses.dataclass(frozen=True)
class SnapKV:
  budget_blocks: int = 16
  block_size: int = 64
  recent_blocks: int = 2
  window: int = 32            # observation window (prompt tokens)
  pool: int = 7               # average-pooling width over slots
  name: str = "snapkv"

  def __post_init__(self):
    check_budget("SnapKV", self.block_size, self.budget_blocks)
    for field in ("window", "pool", "recent_blocks"):
      value = getattr(self, field)
      if not is_int(value) or value < 1:
        raise InputError(f"SnapKV: {field} must be an integer >= 1, got {value!r}")
    if not 1 <= self.recent_blocks < self.budget_blocks:
      raise InputError(f"SnapKV: budget_blocks={self.budget_blocks} with recent_blocks="
                       f"{self.recent_blocks} leaves no block to select (needs 1 <= "
                       f"recent_blocks < budget_blocks: a larger budget or fewer recent blocks)")

  def init(self, cfg, params, state) -> SnapKVState:
    cache = state.cache
    bs, keep = self.block_size, self.budget_blocks - self.recent_blocks
    candidates = jnp.maximum(-(-cache.lengths // bs) - self.recent_blocks, 0)   # [B] before recent
    queries, q_pos, q_valid = prompt_window_queries(cfg, params, state, self.window)
    scores = [_block_scores(q, q_pos, q_valid, k, cache.lengths, bs, self.pool)  # [B, Hkv, P]
              for q, k in zip(queries, cache.k)]
    return top_blocks(scores, candidates, keep)

  def view(self, st: SnapKVState, cache: KVCache) -> BlockListView:
    return selected_and_recent(self, st, cache)

  def update(self, st: SnapKVState, cache: KVCache, queries) -> SnapKVState:
    return st
