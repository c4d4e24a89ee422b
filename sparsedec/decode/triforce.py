"""TriForce (Sun et al. 2024): hierarchical speculative decoding over three levels.

  draft model, StreamingLLM view of its own cache  --drafts draft_gamma tokens-->
  the target, reading a chunk-retrieval view of the ONE cache  --drafts gamma tokens-->
  the target, reading the full cache: verification, lossless.

Each step:
1. The middle level gathers `gamma` tokens in rounds. A round: the draft model drafts
   `draft_gamma` tokens (`speculative.draft_chain`, its queries reading sinks + recent blocks of
   its cache: `draft_view`, a StreamingLLM); the target verifies them in one forward over
   [last token, d_1 .. d_draft_gamma] reading only the retrieved blocks of the cache (`retrieval`,
   a `ChunkRetrieval`: the prompt's best chunks by mean key, then the newest blocks), accepting a
   prefix plus one token of its own (`verify.verify_chain`). Its accepted K/V are written past the
   row's committed length, as scratch the next round's retrieval view reads (its newest blocks);
   rounds go on until every active row has `gamma` tokens (at most gamma rounds; a row that has
   them waits, writing nothing).
2. The target verifies the middle level's first `gamma` tokens in ONE forward over the full cache
   ([current token, e_1 .. e_gamma], causal) and appends the accepted prefix plus its own token;
   its K/V overwrite the scratch. Greedy output equals dense greedy token for token; sampled
   output has dense sampling's distribution: each middle token is distributed as the middle
   level's p2 given the tokens before it (Leviathan's rule between the draft model and the
   middle level), and the full target tests it against p2 (`verify_drafted`).

There is one KV cache of the target (the middle level reads a block list of it, as FAFO's
fumbles do) and one of the draft model (indexed by position, as `Speculative`'s; read through
the StreamingLLM view). Each round's first draft forward goes over the sequence's last THREE
tokens (`draft_chain(catch_up=3)`): when the target accepts all `gamma` middle tokens, the last
round's final draft is one the draft model never consumed, two tokens before the next step's
end.

Choices where the paper leaves one or differs:
* The middle level verifies `draft_gamma` drafts per forward (TriForce's code verifies after
  every single draft: draft_gamma = 1) and hands the target exactly `gamma` tokens (TriForce's
  middle loop hands gamma or gamma + 1).
* The retrieval view is chosen once, from the last prompt token's query (as TriForce builds its
  retrieval cache after prefill), in whole blocks of the cache (TriForce: chunks of 8 tokens;
  here `block_size`, a multiple of 64 for the GPU kernel).
* The draft model's cache is prefilled densely over the prompt; its reads during decoding see
  only the StreamingLLM view (TriForce evicts its draft cache to sinks + recent entries).

Stats: acceptance_rate (middle tokens accepted by the target / proposed),
draft_acceptance_rate (draft-model tokens accepted by the middle level / proposed),
middle_rounds_per_step, gamma, draft_gamma, draft_layers, the views' budgets.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsedec.attention import causal_plan
from sparsedec.compress.base import check_view
from sparsedec.compress.retrieval import ChunkRetrieval
from sparsedec.compress.streaming import StreamingLLM
from sparsedec.decode.loop import StepContext, finish_step, row_counters
from sparsedec.decode.sampling import SamplingConfig, probabilities, split_keys
from sparsedec.decode.speculative import (DRAFT_MODEL_KEY, check_draft_knobs, check_draft_model,
                                          draft_chain, draft_params_of, prefill_draft,
                                          samples_drafts)
from sparsedec.decode.state import DecodeState, append_tokens, method_extras
from sparsedec.decode.verify import chain_uniforms, drafts_counted, verify_chain
from sparsedec.errors import InputError
from sparsedec.kv.dense import KVCache, commit
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.params import Params

CATCH_UP = 3   # tokens of each round's first draft forward (module docstring)


@struct.dataclass
class TriForceExtras:
  draft_cache: KVCache         # the draft model's cache, per layer [B, Hkv_draft, S, D_draft]
  retrieval_state: Any         # the retrieval policy's selection (per layer [L, B, Hkv, ...])
  drafted: jax.Array           # [B] int32: middle tokens proposed to the target (`drafts_counted`)
  accepted_drafts: jax.Array   # [B] int32: middle tokens accepted (and appended)
  small_drafted: jax.Array     # [B] int32: draft-model tokens proposed to the middle level
  small_accepted: jax.Array    # [B] int32: draft-model tokens the middle level accepted
  middle_rounds: jax.Array     # [B] int32: middle-level forwards (rounds the row took part in)


@struct.dataclass
class _Middle:
  """The middle level's carry over its rounds."""
  round: jax.Array             # [] int32
  seq: jax.Array               # [B, L] int32: the row's tokens, then the middle's emitted ones
  emitted: jax.Array           # [B, W] int32: the middle's tokens (W = gamma + draft_gamma + 1)
  count: jax.Array             # [B] int32: how many
  p2: jax.Array | None         # [B, W, V] fp32: the middle's distribution at each (sampling)
  cache: KVCache               # the target's cache, middle scratch past the committed length
  draft_cache: KVCache
  small_drafted: jax.Array     # [B] int32
  small_accepted: jax.Array    # [B] int32
  rounds: jax.Array            # [B] int32


@dataclasses.dataclass(frozen=True)
class TriForce:
  draft: ModelConfig | None = None              # the draft model (params: with_draft_model)
  gamma: int = 6                                # middle-level tokens the target verifies a step
  draft_gamma: int = 2                          # draft-model tokens per middle verification
  retrieval: Any = ChunkRetrieval()             # the middle level's view of the cache
  draft_view: Any = StreamingLLM()              # the draft model's view of its cache
  draft_sampling: str = "sample"                # when sampling: draft-model tokens drawn / argmax
  name: str = "triforce"

  def __post_init__(self):
    check_draft_knobs(self, "gamma", "draft_gamma")
    for field in ("retrieval", "draft_view"):
      policy = getattr(self, field)
      if isinstance(policy, type) or not all(
          hasattr(policy, a) for a in ("init", "view", "update", "block_size", "budget_blocks")):
        raise InputError(f"triforce {field} must be a CompressionPolicy object (e.g. "
                         f"{'ChunkRetrieval' if field == 'retrieval' else 'StreamingLLM'}()), "
                         f"got {policy!r:.80}")
    if getattr(self.draft_view, "needs_queries", False) or \
        getattr(self.retrieval, "needs_queries", False):
      raise InputError("triforce's views are static (chosen at init): a policy that needs each "
                       "step's queries (Quest) does not apply")

  @property
  def tokens_per_forward(self) -> int:
    return self.gamma + 1

  @property
  def capacity_multiple(self) -> int:
    """Both views' blocks must tile the cache capacity (api.start rounds its default to it)."""
    return math.lcm(int(self.retrieval.block_size), int(self.draft_view.block_size))

  def max_steps(self, max_new_tokens: int) -> int:
    return max_new_tokens

  def check(self, cfg: ModelConfig, params: Params, capacity: int) -> None:
    """Refuse params without a fitting draft model, or a capacity the views' blocks do not tile
    (api.start: before prefill; init checks again)."""
    check_draft_model(self.name, self.draft, cfg, params)
    if capacity % self.capacity_multiple:
      raise InputError(f"triforce: cache capacity {capacity} is not a multiple of the views' "
                       f"block sizes ({self.retrieval.block_size}, {self.draft_view.block_size}): "
                       f"pass a cache_size (--cache-size) that is one of "
                       f"{self.capacity_multiple}")

  def init(self, cfg: ModelConfig, params: Params, state: DecodeState) -> DecodeState:
    """The draft model's cache prefilled (`prefill_draft`) and the retrieval selection."""
    self.check(cfg, params, state.cache.capacity)
    zeros = jnp.zeros((state.batch_size,), jnp.int32)
    return state.replace(extras=TriForceExtras(
        draft_cache=prefill_draft(self.draft, params[DRAFT_MODEL_KEY], state),
        retrieval_state=self.retrieval.init(cfg, params, state),
        drafted=zeros, accepted_drafts=zeros, small_drafted=zeros, small_accepted=zeros,
        middle_rounds=zeros))

  def _round(self, cfg: ModelConfig, params: Params, x: TriForceExtras, base: jax.Array,
             active: jax.Array, keys: jax.Array, sampling: SamplingConfig,
             m: _Middle) -> _Middle:
    """One middle round: draft_gamma draft-model tokens, verified by the target on the
    retrieval view; the rows still short of gamma tokens append what it accepts."""
    g, b = self.draft_gamma, base.shape[0]
    need = active & (m.count < self.gamma)                                # [B]
    n = base + 1 + m.count                                                # [B] sequence length
    round_keys = jax.vmap(lambda k: jax.random.fold_in(k, m.round))(keys)
    draft_u = verify_u = None
    if samples_drafts(self.draft_sampling, sampling):
      draft_u, verify_u = chain_uniforms(round_keys, g)                   # [B, g], [B, g + 1]
    drafts, q, draft_cache = draft_chain(
        self.draft, params[DRAFT_MODEL_KEY], m.draft_cache, m.seq, n, g, sampling, draft_u,
        catch_up=CATCH_UP, view=lambda c: self.draft_view.view(None, c))
    last = jnp.take_along_axis(m.seq, (n - 1)[:, None], axis=1)           # [B, 1]
    cache = m.cache.replace(lengths=(n - 1).astype(jnp.int32))
    view = self.retrieval.view(x.retrieval_state, cache)
    check_view(f"triforce retrieval {type(self.retrieval).__name__}", view, cache,
               cfg.num_layers)
    positions = (n - 1)[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None]
    logits, kv = forward(cfg, params, jnp.concatenate([last, drafts], axis=1), positions, cache,
                         causal_plan(g + 1, view))                         # [B, g + 1, V]
    probs = None if sampling.greedy else probabilities(logits, sampling)  # [B, g + 1, V]: p2
    verdict = verify_chain(logits, drafts, q, need, round_keys, verify_u, sampling, probs)
    took = jnp.where(need, verdict.num_tokens, 0)                         # [B] a + 1, or 0
    width = m.emitted.shape[1]
    col = jnp.arange(g + 1, dtype=jnp.int32)[None]
    rows = jnp.arange(b)[:, None]
    at = jnp.where(col < took[:, None], m.count[:, None] + col, width)    # [B, g + 1]
    emitted = m.emitted.at[rows, at].set(verdict.tokens, mode="drop")
    seq = m.seq.at[rows, jnp.where(col < took[:, None], n[:, None] + col, m.seq.shape[1])].set(
        verdict.tokens, mode="drop")
    p2 = m.p2 if m.p2 is None else m.p2.at[rows, at].set(probs, mode="drop")
    accepted, proposed = drafts_counted(verdict, took, need, g)
    return m.replace(round=m.round + 1, seq=seq, emitted=emitted, count=m.count + took, p2=p2,
                     cache=commit(cache, kv, took), draft_cache=draft_cache,
                     small_drafted=m.small_drafted + proposed,
                     small_accepted=m.small_accepted + accepted,
                     rounds=m.rounds + need)

  def step(self, cfg: ModelConfig, params: Params, state: DecodeState,
           ctx: StepContext) -> DecodeState:
    x: TriForceExtras = method_extras(state, TriForceExtras, self.name)
    draft_params_of(self.name, params)               # refused by name before the trace
    b, gamma = state.batch_size, self.gamma
    active = ~state.done                                                  # [B]
    base = state.cache.lengths                                            # [B] = num_tokens - 1
    keys, step_keys = split_keys(state.keys)
    top_keys, middle_keys = split_keys(step_keys)
    sampled = not ctx.sampling.greedy
    width = gamma + self.draft_gamma + 1
    zeros = jnp.zeros((b,), jnp.int32)
    start = _Middle(
        round=jnp.zeros((), jnp.int32), seq=state.tokens,
        emitted=jnp.zeros((b, width), jnp.int32), count=zeros,
        p2=jnp.zeros((b, width, cfg.vocab_size), jnp.float32) if sampled else None,
        cache=state.cache, draft_cache=x.draft_cache, small_drafted=zeros,
        small_accepted=zeros, rounds=zeros)
    middle = jax.lax.while_loop(
        lambda m: (m.round < gamma) & jnp.any(active & (m.count < gamma)),
        lambda m: self._round(cfg, params, x, base, active, middle_keys, ctx.sampling, m),
        start)

    drafts = middle.emitted[:, :gamma]                                    # [B, gamma]
    tokens = jnp.concatenate([state.last_tokens(), drafts], axis=1)       # [B, gamma + 1]
    positions = base[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)[None]
    cache = middle.cache.replace(lengths=base)                            # the scratch unread
    logits, kv = forward(cfg, params, tokens, positions, cache, causal_plan(gamma + 1))
    p2 = None if middle.p2 is None else middle.p2[:, :gamma]
    verify_u = chain_uniforms(top_keys, gamma)[1] if sampled else None
    verdict = verify_chain(logits, drafts, p2, active, top_keys, verify_u, ctx.sampling)
    state = finish_step(state.replace(keys=keys))
    state, appended = append_tokens(state, verdict.tokens, verdict.num_tokens, ctx.stop_ids)
    accepted, proposed = drafts_counted(verdict, appended, active, gamma)
    extras = x.replace(
        draft_cache=middle.draft_cache, drafted=x.drafted + proposed,
        accepted_drafts=x.accepted_drafts + accepted,
        small_drafted=x.small_drafted + middle.small_drafted,
        small_accepted=x.small_accepted + middle.small_accepted,
        middle_rounds=x.middle_rounds + middle.rounds)
    return state.replace(cache=commit(cache, kv, appended), extras=extras)

  def stats(self, state: DecodeState, rows: Sequence[int] | None = None) -> dict:
    """Host-side figures over `rows` (row indices, `loop.row_index`; None: every row): both
    levels' acceptance, middle rounds per step; the knobs and the draft cache's bytes."""
    x: TriForceExtras = state.extras
    active, drafted, accepted, small_drafted, small_accepted, rounds = row_counters(
        state, rows, x.drafted, x.accepted_drafts, x.small_drafted, x.small_accepted,
        x.middle_rounds)
    steps = int(np.sum(active))
    ratio = (lambda a, b: round(int(np.sum(a)) / int(np.sum(b)), 4)         # noqa: E731
             if int(np.sum(b)) else 0.0)
    return {
        "acceptance_rate": ratio(accepted, drafted),
        "accepted_drafts_per_step": round(int(np.sum(accepted)) / steps, 4) if steps else 0.0,
        "draft_acceptance_rate": ratio(small_accepted, small_drafted),
        "middle_rounds_per_step": round(int(np.sum(rounds)) / steps, 4) if steps else 0.0,
        "drafted_tokens": int(np.sum(drafted)), "accepted_drafts": int(np.sum(accepted)),
        "gamma": self.gamma, "draft_gamma": self.draft_gamma,
        "draft_sampling": self.draft_sampling, "draft_layers": self.draft.num_layers,
        "retrieval_budget_tokens": self.retrieval.budget_blocks * self.retrieval.block_size,
        "draft_view_budget_tokens": self.draft_view.budget_blocks * self.draft_view.block_size,
        "draft_cache_bytes": x.draft_cache.num_bytes(),
    }
