"""StreamingLLM (Xiao et al. 2024): attention sinks + a recent window; static, no statistics.

At block granularity: the first `sink_blocks` blocks and the most recent blocks of the row, in all
`budget_blocks` blocks (the newest block is partly filled; the kernel and the reference both mask
slots >= length). While the row holds no more than `budget_blocks` blocks, all of them are listed
(the compressed view then equals the full cache).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparsedec.attention import BlockListView
from sparsedec.compress.base import capped_budget, check_budget
from sparsedec.errors import InputError, is_int
from sparsedec.kv.dense import KVCache


def streaming_tables(lengths: jax.Array, num_kv_heads: int, *, block_size: int,
                     budget_blocks: int, sink_blocks: int) -> tuple[jax.Array, jax.Array]:
  """tables [B, Hkv, NB] int32 and counts [B, Hkv] int32 of sinks + recent blocks."""
  used = -(-lengths.astype(jnp.int32) // block_size)                        # [B] blocks in use
  i = jnp.arange(budget_blocks, dtype=jnp.int32)[None, :]                   # [1, NB]
  recent_first = used[:, None] - (budget_blocks - sink_blocks)             # [B, 1]
  compressed = jnp.where(i < sink_blocks, i, recent_first + (i - sink_blocks))
  tables = jnp.where(used[:, None] <= budget_blocks, i, compressed)         # [B, NB]
  counts = jnp.minimum(used, budget_blocks)                                 # [B]
  b = lengths.shape[0]
  return (jnp.broadcast_to(tables[:, None, :], (b, num_kv_heads, budget_blocks)),
          jnp.broadcast_to(counts[:, None], (b, num_kv_heads)))


@dataclasses.dataclass(frozen=True)
class StreamingLLM:
  budget_blocks: int = 16     # NB: blocks listed (budget in tokens = NB * block_size)
  block_size: int = 64
  sink_blocks: int = 1
  name: str = "streaming"

  def __post_init__(self):
    check_budget("StreamingLLM", self.block_size, self.budget_blocks)
    if not is_int(self.sink_blocks) or self.sink_blocks < 0:
      raise InputError(f"StreamingLLM: sink_blocks must be an integer >= 0, got "
                       f"{self.sink_blocks!r}")
    if self.sink_blocks >= self.budget_blocks:
      raise InputError(f"StreamingLLM: budget_blocks={self.budget_blocks} with sink_blocks="
                       f"{self.sink_blocks!r} leaves no recent block (needs an integer 0 <= "
                       f"sink_blocks < budget_blocks: a larger budget or fewer sink blocks)")

  def init(self, cfg, params, state):
    return None

  def view(self, pstate, cache: KVCache) -> BlockListView:
    # A budget past the cache's blocks lists every block (tables as long as the cache has
    # blocks, not budget_blocks entries: --budget-blocks 4194304 took 3.8 GiB and 3x the time).
    tables, counts = streaming_tables(cache.lengths, cache.k[0].shape[1],
                                      block_size=self.block_size,
                                      budget_blocks=capped_budget(self, cache),
                                      sink_blocks=self.sink_blocks)
    return BlockListView(tables, counts, self.block_size)

  def update(self, pstate, cache: KVCache, queries):
    return pstate
