"""TriForce's chunk retrieval (Sun et al. 2024): the prompt's chunks whose mean key best matches
the last prompt token's query, chosen once after prefill; static.

Per layer, row and KV head, each block (a chunk of `block_size` slots) of the prompt before the
recent region is scored by the dot product of the mean of its valid keys with the last prompt
token's queries (summed over the KV head's query heads); block 0 (the attention sink) is always
kept, as TriForce keeps its first chunk. The best `budget_blocks - recent_blocks` are read for the
whole generation, with the newest blocks of the row (which slide as text is generated: TriForce's
retrieval cache appends the generated tokens) in the rest of the budget (`selected_and_recent`,
SnapKV's view). TriForce's middle level (`sparsedec.decode.triforce`) drafts with the target
model reading this view; as a `CompressionPolicy` it serves FAFO's fumbles as well.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.combine import f32_einsum
from sparsedec.attention import BlockListView
from sparsedec.compress.base import check_budget, prompt_window_queries
from sparsedec.compress.snapkv import SnapKVState, selected_and_recent, top_blocks
from sparsedec.errors import InputError, is_int
from sparsedec.kv.dense import KVCache


def chunk_scores(q: jax.Array, k: jax.Array, lengths: jax.Array, block_size: int) -> jax.Array:
  """q [B, Hq, D] (one query per head); k [B, Hkv, S, D] -> [B, Hkv, S / block_size] fp32: the
  query heads of each KV head against the mean of each block's keys at slots < lengths (an empty
  block scores 0), summed over the heads. Block 0 scores +inf."""
  b, hq, d = q.shape
  hkv, s = k.shape[1], k.shape[2]
  valid = (jnp.arange(s) < lengths[:, None]).reshape(b, 1, s // block_size, block_size, 1)
  blocks = k.reshape(b, hkv, s // block_size, block_size, d)
  total = jnp.sum(jnp.where(valid, blocks.astype(jnp.float32), 0.0), axis=3)   # [B, Hkv, P, D]
  mean = total / jnp.maximum(jnp.sum(valid, axis=3), 1)
  qg = q.reshape(b, hkv, hq // hkv, d)                                          # [B, Hkv, G, D]
  score = f32_einsum("bhgd,bhpd->bhp", qg, mean)                                # [B, Hkv, P]
  return score.at[:, :, 0].set(jnp.inf)


@dataclasses.dataclass(frozen=True)
class ChunkRetrieval:
  budget_blocks: int = 16
  block_size: int = 64
  recent_blocks: int = 2
  name: str = "retrieval"

  def __post_init__(self):
    check_budget("ChunkRetrieval", self.block_size, self.budget_blocks)
    if not is_int(self.recent_blocks) or not 1 <= self.recent_blocks < self.budget_blocks:
      raise InputError(f"ChunkRetrieval: budget_blocks={self.budget_blocks} with recent_blocks="
                       f"{self.recent_blocks!r} leaves no block to retrieve (needs an integer 1 "
                       f"<= recent_blocks < budget_blocks)")

  def init(self, cfg, params, state) -> SnapKVState:
    cache = state.cache
    bs, keep = self.block_size, self.budget_blocks - self.recent_blocks
    candidates = jnp.maximum(-(-cache.lengths // bs) - self.recent_blocks, 0)   # [B] before recent
    queries, _, _ = prompt_window_queries(cfg, params, state, 1)   # per layer [B, 1, Hq, D]
    scores = [chunk_scores(q[:, -1], k, cache.lengths, bs) for q, k in zip(queries, cache.k)]
    return top_blocks(scores, candidates, keep)

  def view(self, st: SnapKVState, cache: KVCache) -> BlockListView:
    return selected_and_recent(self, st, cache)

  def update(self, st: SnapKVState, cache: KVCache, queries) -> SnapKVState:
    return st
