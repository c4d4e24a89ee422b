"""Slow-Fast Inference (SFI; Xie et al. 2026): dense "slow" steps near sentence boundaries refresh
a per-head selected memory; cheap "fast" steps attend to sinks + selected + recent. Near-lossless
(not token-identical to dense decoding: a fast step reads part of the cache).

One token per step, as dense decoding. Per row:
* A step is SLOW when the row's current token ends a sentence (`boundary_tokens`) or when
  `max_fast_steps` fast steps have run since its last slow step (the refresh budget). It reads
  the whole cache, and its Selector turns the step's dense attention into the
  row's memory for the fast steps after it: per layer and KV head, the `budget_blocks` blocks of
  `block_size` slots with the most attention mass of the current token's query heads (softmax over
  the whole cache, summed over the KV head's query heads and the block's slots), among the blocks
  that are neither sinks nor in the recent region.
* A step is FAST otherwise: it reads, per layer and KV head, the first `sink_blocks` blocks, the
  selected blocks, and the recent region: the `recent_blocks` newest blocks at the last slow step
  and every block since (where the text generated since the selection lands; at most
  max_fast_steps tokens) - a `BlockListView` (`sparse_attention` on a GPU). With a budget that
  holds every block a fast step reads the whole cache: the output is dense decoding's.
A batch where any row is slow runs the slow branch (`lax.cond`): its slow rows list every block
and the Selector runs; its fast rows read their memory as in the fast branch, so a row's tokens do
not depend on its batchmates.

Choices where the paper leaves one:
* Memory at block granularity (the GPU kernel's unit) selected by attention mass (the paper's
  Selector is "alpha-fair" over heads; here each KV head takes its own top blocks). The memory is
  a list of blocks of the one cache, not a compacted copy (the paper's CUDA path copies it into
  a compact segment): a fast step's block table has a fixed shape, no copy is made.
* The first memory is selected at init from the last prompt token's queries (the prefill's dense
  attention as the first slow step's evidence).

Stats: slow_steps, fast_steps, slow_step_share, memory_tokens (per KV head a fast step reads at
most (sink_blocks + budget_blocks + recent_blocks) * block_size slots plus the text generated
since its row's last slow step).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.combine import f32_einsum
from sparsedec.attention import BlockListView, causal_plan
from sparsedec.compress.base import check_budget, pack_tables, prompt_window_queries
from sparsedec.decode.loop import StepContext, finish_step, row_counters
from sparsedec.decode.sampling import sample, split_keys
from sparsedec.decode.state import DecodeState, append_tokens, method_extras
from sparsedec.errors import InputError, is_int
from sparsedec.kv.dense import KVCache, commit
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.params import Params

SENTENCE_ENDS = (".", "!", "?", "\n")


def sentence_boundary_tokens(tokenizer) -> tuple[int, ...]:
  """The ids of the tokens whose text ends a sentence (ends in . ! ? or a newline once trailing
  spaces and quotes are stripped): SlowFast's `boundary_tokens` for a tokenizer."""
  ids = []
  for i in range(tokenizer.vocab_size):
    text = tokenizer.decode([i]).rstrip(" \"')")
    if text and text.endswith(SENTENCE_ENDS):
      ids.append(i)
  return tuple(ids)


@struct.dataclass
class SlowFastExtras:
  # Per layer first ([L, B, ...]): serving's insert_row copies a row along axis 1.
  BATCH_AXES: ClassVar[dict[str, int]] = {"selected": 1, "counts": 1}
  selected: jax.Array      # [L, B, Hkv, K] int32: the memory's blocks, ascending (K budget_blocks)
  counts: jax.Array        # [L, B, Hkv] int32: how many of them are valid
  recent_from: jax.Array   # [B] int32: the recent region's first block (at the last selection)
  fast_run: jax.Array      # [B] int32: fast steps since the row's last slow step
  slow_steps: jax.Array    # [B] int32
  fast_steps: jax.Array    # [B] int32


def block_attention_mass(q: jax.Array, k: jax.Array, lengths: jax.Array,
                         block_size: int) -> jax.Array:
  """q [B, Hq, D] (one query per head), k [B, Hkv, S, D] -> [B, Hkv, S / block_size] fp32: each
  block's softmax attention mass (over slots < lengths) summed over the KV head's query heads."""
  b, hq, d = q.shape
  hkv, s = k.shape[1], k.shape[2]
  qg = q.reshape(b, hkv, hq // hkv, d)
  scores = f32_einsum("bhgd,bhsd->bhgs", qg, k) * d ** -0.5               # [B, Hkv, G, S]
  ok = (jnp.arange(s)[None] < lengths[:, None])[:, None, None]            # [B, 1, 1, S]
  probs = jax.nn.softmax(jnp.where(ok, scores, -jnp.inf), axis=-1)
  probs = jnp.where(ok, probs, 0.0).sum(2)                                # [B, Hkv, S]
  return probs.reshape(b, hkv, s // block_size, block_size).sum(-1)


@dataclasses.dataclass(frozen=True)
class SlowFast:
  budget_blocks: int = 16           # selected blocks per (row, layer, KV head)
  block_size: int = 64
  sink_blocks: int = 1
  recent_blocks: int = 2
  boundary_tokens: tuple[int, ...] = ()   # token ids ending a sentence (`sentence_boundary_tokens`)
  max_fast_steps: int = 64          # the refresh budget: fast steps before a slow step anyway
  name: str = "sfi"

  def __post_init__(self):
    check_budget("SlowFast", self.block_size, self.budget_blocks)
    for field, low in (("sink_blocks", 0), ("recent_blocks", 1), ("max_fast_steps", 0)):
      value = getattr(self, field)
      if not is_int(value) or value < low:
        raise InputError(f"sfi {field} must be an integer >= {low}, got {value!r}")
    if not isinstance(self.boundary_tokens, tuple) or not all(
        is_int(t) and t >= 0 for t in self.boundary_tokens):
      raise InputError(f"sfi boundary_tokens must be a tuple of token ids (ints >= 0), got "
                       f"{self.boundary_tokens!r:.80}")

  @property
  def capacity_multiple(self) -> int:
    """The blocks must tile the cache capacity (api.start rounds its default to it)."""
    return int(self.block_size)

  @property
  def memory_blocks(self) -> int:
    return self.sink_blocks + self.budget_blocks + self.recent_blocks

  def max_steps(self, max_new_tokens: int) -> int:
    return max_new_tokens

  def check(self, cfg: ModelConfig, params: Params, capacity: int) -> None:
    if capacity % self.block_size:
      raise InputError(f"sfi: cache capacity {capacity} is not a multiple of block_size "
                       f"{self.block_size} (pass a cache_size, --cache-size, that is one)")
    if any(t >= cfg.vocab_size for t in self.boundary_tokens):
      raise InputError(f"sfi boundary_tokens hold ids past the vocabulary ({cfg.vocab_size} "
                       f"tokens): {[t for t in self.boundary_tokens if t >= cfg.vocab_size][:5]}")

  def _select(self, queries, cache: KVCache) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Selector: per layer the best budget_blocks blocks by attention mass of `queries`
    (per layer [B, Hq, D]) over `cache`, outside the sinks and the recent region, ascending:
    selected [L, B, Hkv, K], counts [L, B, Hkv], and the recent region's first block [B]."""
    bs = self.block_size
    num_blocks = cache.capacity // bs
    used = -(-cache.lengths // bs)                                        # [B]
    first_recent = jnp.maximum(used - self.recent_blocks, 0).astype(jnp.int32)   # [B]
    block = jnp.arange(num_blocks)[None, None]
    candidate = (block >= self.sink_blocks) & (block < first_recent[:, None, None])
    keep = min(self.budget_blocks, num_blocks)
    selected, counts = [], []
    for q, k in zip(queries, cache.k):
      mass = block_attention_mass(q, k, cache.lengths, bs)                # [B, Hkv, P]
      _, top = jax.lax.top_k(jnp.where(candidate, mass, -jnp.inf), keep)
      n = jnp.broadcast_to(jnp.minimum(jnp.sum(candidate, axis=-1), keep), mass.shape[:2])
      top = jnp.where(jnp.arange(keep) < n[..., None], top, num_blocks)   # invalid last
      selected.append(jnp.sort(top, axis=-1).astype(jnp.int32))
      counts.append(n.astype(jnp.int32))
    pad = self.budget_blocks - keep
    sel = jnp.stack(selected)
    if pad:
      sel = jnp.pad(sel, ((0, 0),) * 3 + ((0, pad),), constant_values=num_blocks)
    return sel, jnp.stack(counts), first_recent

  def recent_width(self, num_blocks: int) -> int:
    """Blocks the recent region can span: recent_blocks at the selection, then max_fast_steps
    tokens (a block more where they straddle one), at most the cache's blocks."""
    return min(self.recent_blocks + -(-self.max_fast_steps // self.block_size) + 1, num_blocks)

  def fast_tables(self, x: SlowFastExtras, lengths: jax.Array, num_blocks: int
                  ) -> tuple[jax.Array, jax.Array]:
    """The fast view per layer: sinks, the selected blocks, the recent region (from
    x.recent_from to the newest block): tables [L, B, Hkv, W], counts [L, B, Hkv]."""
    lead = x.counts.shape                                                 # [L, B, Hkv]
    used = -(-lengths.astype(jnp.int32) // self.block_size)[None, :, None]   # [1, B, 1]
    sinks = jnp.broadcast_to(jnp.arange(self.sink_blocks, dtype=jnp.int32), lead +
                             (self.sink_blocks,))
    sink_count = jnp.broadcast_to(jnp.minimum(used, self.sink_blocks), lead)
    recent_start = jnp.maximum(x.recent_from[None, :, None], sink_count)  # never a sink twice
    recent = jnp.minimum(recent_start[..., None] + jnp.arange(self.recent_width(num_blocks)),
                         num_blocks - 1)
    recent_count = jnp.clip(used - recent_start, 0, recent.shape[-1])
    tables, counts = pack_tables(sinks, sink_count, x.selected, x.counts)
    return pack_tables(tables, counts, recent.astype(jnp.int32), recent_count)

  def init(self, cfg: ModelConfig, params: Params, state: DecodeState) -> DecodeState:
    """The first memory, selected from the last prompt token's queries."""
    self.check(cfg, params, state.cache.capacity)
    queries, _, _ = prompt_window_queries(cfg, params, state, 1)          # per layer [B, 1, ..]
    selected, counts, recent_from = self._select([q[:, -1] for q in queries], state.cache)
    zeros = jnp.zeros((state.batch_size,), jnp.int32)
    return state.replace(extras=SlowFastExtras(selected=selected, counts=counts,
                                               recent_from=recent_from, fast_run=zeros,
                                               slow_steps=zeros, fast_steps=zeros))

  def step(self, cfg: ModelConfig, params: Params, state: DecodeState,
           ctx: StepContext) -> DecodeState:
    x: SlowFastExtras = method_extras(state, SlowFastExtras, self.name)
    active = ~state.done                                                  # [B]
    current = state.last_tokens()                                         # [B, 1]
    boundary = (jnp.isin(current[:, 0], jnp.asarray(self.boundary_tokens, jnp.int32))
                if self.boundary_tokens else jnp.zeros_like(active))
    slow = active & (boundary | (x.fast_run >= self.max_fast_steps))      # [B]
    cache = state.cache
    num_blocks = cache.capacity // self.block_size
    tables, counts = self.fast_tables(x, cache.lengths, num_blocks)       # [L, B, Hkv, W]
    positions = cache.lengths[:, None]

    def run(tables, counts, capture):
      view = BlockListView(tables, counts, self.block_size, per_layer=True)
      return forward(cfg, params, current, positions, cache, causal_plan(1, view),
                     capture_queries=capture)

    def fast(_):
      logits, kv = run(tables, counts, False)
      return (logits, commit(cache, kv, active.astype(jnp.int32)), x.selected, x.counts,
              x.recent_from)

    def slow_branch(_):
      everything = jnp.broadcast_to(jnp.arange(num_blocks, dtype=jnp.int32),
                                    counts.shape + (num_blocks,))
      wide = jnp.pad(tables, ((0, 0),) * 3 + ((0, num_blocks - tables.shape[-1]),)) \
          if num_blocks > tables.shape[-1] else tables[..., :num_blocks]
      used = -(-cache.lengths // self.block_size)[None, :, None]
      rows = slow[None, :, None]
      logits, kv = run(jnp.where(rows[..., None], everything, wide),
                       jnp.where(rows, jnp.broadcast_to(used, counts.shape),
                                 jnp.minimum(counts, num_blocks)), True)
      new_cache = commit(cache, kv, active.astype(jnp.int32))
      selected, sel_counts, recent_from = self._select([q[:, 0] for q in kv.q], new_cache)
      return (logits, new_cache, jnp.where(rows[..., None], selected, x.selected),
              jnp.where(rows, sel_counts, x.counts), jnp.where(slow, recent_from, x.recent_from))

    logits, cache, selected, sel_counts, recent_from = jax.lax.cond(
        jnp.any(slow), slow_branch, fast, None)
    keys, step_keys = split_keys(state.keys)
    nxt = sample(logits[:, 0], step_keys, ctx.sampling)                   # [B]
    state = finish_step(state.replace(cache=cache, keys=keys))
    state, _ = append_tokens(state, nxt[:, None], active.astype(jnp.int32), ctx.stop_ids)
    fast_now = active & ~slow
    extras = x.replace(selected=selected, counts=sel_counts, recent_from=recent_from,
                       fast_run=jnp.where(slow, 0, x.fast_run + fast_now),
                       slow_steps=x.slow_steps + slow, fast_steps=x.fast_steps + fast_now)
    return state.replace(extras=extras)

  def stats(self, state: DecodeState, rows: Sequence[int] | None = None) -> dict:
    """Host-side figures over `rows` (row indices, `loop.row_index`; None: every row)."""
    x: SlowFastExtras = state.extras
    _, slow, fast = row_counters(state, rows, x.slow_steps, x.fast_steps)
    total = int(np.sum(slow)) + int(np.sum(fast))
    return {"slow_steps": int(np.sum(slow)), "fast_steps": int(np.sum(fast)),
            "slow_step_share": round(int(np.sum(slow)) / total, 4) if total else 0.0,
            "memory_tokens": self.memory_blocks * self.block_size,
            "max_fast_steps": self.max_fast_steps}
