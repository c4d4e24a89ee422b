"""FAFO ("Fumble Around and Find Out"): draftless, lossless n-gram decoding in ONE forward per step.

Each step is one forward over T = n*k + 1 + m*k in-flight tokens (p: the current token's position):

  [ fumble: n subsequences x k tokens, column-wise | current token | m candidates x k tokens ]
    reads C(kv) (a compressed view)                 reads the FULL cache

* Fumble ("fumble around"): subsequence j holds k guessed tokens; its token i sits at in-flight
  index i*n + j (all first tokens, then all second tokens, ...), at position p + 1 + j + i, and
  attends only to the compressed cache C(kv) (a `CompressionPolicy`'s block list) and to tokens
  0..i of its own subsequence (`fafo_layout`). The model's argmax after its last token is the
  subsequence's new token: the subsequence drops its oldest token into a buffer of discarded
  tokens (the last k kept) and appends the new one; the new k-token guess is stored in the n-gram
  pool under every suffix (1..k tokens) of that discarded buffer.
* Find out: up to m candidates of k tokens are retrieved from the pool by the decoded sequence's
  suffix (longest key first, k down to 1); candidate token i sits at position p + 1 + i and sees
  the full cache, the current token and its own earlier tokens. `verify.verify` accepts the
  longest verified prefix plus one token of the model (greedy: token-identical to dense greedy;
  sampling: distribution-preserving multi-candidate rejection sampling); the K/V of the current
  token and of the accepted candidate tokens are committed (`commit(take=...)`). There is one KV
  cache: fumble tokens are never committed.

On a GPU the fumble segment and the verification segment go to `pallas_kernels.sparse_attention`
in one launch (block-list queries first, then full-cache queries); elsewhere the jnp reference.

Sliding-window models (Mistral): `attend` masks every query's cache view and in-flight keys by
position (q_pos - k_pos < window), so a candidate token reads exactly the keys dense decoding
reads at its position and the fumbles read C(kv) within the window. Where the window is shorter
than the cache capacity plus the in-flight tokens the kernels do not apply (`kernel_choice`) and
the jnp reference runs.

Choices where the paper leaves one:
* C(kv) is a block list over the one cache, not a copied region: the list has a fixed shape
  [B, Hkv, NB] (the kernel reads it directly), so the fumble plan never changes shape and no mask
  is rebuilt per step; policies re-list blocks instead of swapping entries.
* Subsequence j sits j positions further out than subsequence 0 (Lookahead's diagonal). SmolLM2,
  40 subsequences, 20 prompts (benchmarks/NOTES.md, session 47): tau 2.644; with every
  subsequence at p + 1 + i (they then guess alike) 2.436; half the spacing (j // 2) 2.642,
  twice (2 j) 2.585.
* Subsequences start as random tokens of the prompt; the pool is seeded with the prompt's n-grams
  (key: up to k preceding tokens, value: the next k tokens) and, with `output_ngrams`, with the
  n-grams of the accepted text, as Lookahead Decoding does, so the two are compared on equal terms.
* Fumble tokens that are stop tokens are replaced by random context tokens in the subsequence (it
  would otherwise fill with end-of-text), after the new guess went into the pool with the model's
  token, as Lookahead's window does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsedec.attention import AttentionPlan, FullView, Segment
from sparsedec.compress.base import check_budget, check_view
from sparsedec.compress.streaming import StreamingLLM
from sparsedec.decode.loop import StepContext, finish_step, row_counters
from sparsedec.decode.guesses import context_tokens, row_salt
from sparsedec.decode.sampling import split_keys
from sparsedec.decode.state import DecodeState, append_tokens, method_extras
from sparsedec.decode.verify import verify
from sparsedec.errors import InputError, is_int
from sparsedec.kv.dense import commit
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.params import Params
from sparsedec.ngram import pool as ngram_pool

POOL_BUCKET_WAYS = 4
_FUMBLE_SEED = 0x46414641   # "FAFA": the subsequences' random start, separate from sampling keys


def fafo_layout(subsequences: int, length: int, candidates: int) -> tuple[np.ndarray, np.ndarray]:
  """(mask [T, T] bool, position offsets [T] int32) of one FAFO step; offsets are relative to the
  current token's position. Indices: fumble (subsequence j, token i) at i*n + j; the current token
  at n*k; candidate c token i at n*k + 1 + c*k + i."""
  n, k, m = subsequences, length, candidates
  f = n * k
  t = f + 1 + m * k
  mask = np.zeros((t, t), bool)
  offsets = np.zeros((t,), np.int32)
  for i in range(k):
    for j in range(n):
      q = i * n + j
      offsets[q] = 1 + j + i
      mask[q, [i2 * n + j for i2 in range(i + 1)]] = True     # own subsequence, tokens 0..i
  mask[f, f] = True                                           # the current token
  for c in range(m):
    for i in range(k):
      q = f + 1 + c * k + i
      offsets[q] = 1 + i
      mask[q, f] = True                                       # the current token
      mask[q, f + 1 + c * k: q + 1] = True                    # own earlier tokens and itself
  return mask, offsets


@struct.dataclass
class FafoExtras:
  fumble: jax.Array            # [B, n, k] int32: each subsequence's current guess, oldest first
  discarded: jax.Array         # [B, n, k] int32: its last k discarded tokens, right-aligned
                               #   (the real ones: min(active steps, k), one per active step)
  pool: ngram_pool.NgramPool   # key: 1..k tokens, value: k tokens
  policy_state: Any            # the compression policy's own arrays
  guesses: jax.Array           # [B] int32: candidates verified, summed over steps
  hit_steps: jax.Array         # [B] int32: steps whose pool lookup returned a candidate
  accepted_guesses: jax.Array  # [B] int32: guessed tokens accepted (and appended)


@dataclasses.dataclass(frozen=True)
class Fafo:
  subsequences: int = 16       # n: fumble subsequences (guesses made per step)
  length: int = 4              # k: tokens per subsequence, per guess and per candidate
  candidates: int = 7          # m: candidates verified per step
  policy: Any = StreamingLLM()  # C(kv): a CompressionPolicy
  pool_keys: int = 4096        # pool hash-table keys per row (buckets x 4 ways)
  entries_per_key: int = 7     # guesses kept per key (LRU)
  prompt_ngrams: bool = True
  output_ngrams: bool = True
  name: str = "fafo"

  def __post_init__(self):
    for field, low in (("subsequences", 1), ("length", 1), ("candidates", 1),
                       ("pool_keys", POOL_BUCKET_WAYS), ("entries_per_key", 1)):
      value = getattr(self, field)
      if not is_int(value) or value < low:
        raise InputError(f"fafo {field} must be an integer >= {low}, got {value!r}")
    if self.pool_keys % POOL_BUCKET_WAYS:
      raise InputError(f"fafo pool_keys must be a multiple of {POOL_BUCKET_WAYS}, "
                       f"got {self.pool_keys}")
    for field in ("prompt_ngrams", "output_ngrams"):
      if not isinstance(getattr(self, field), bool):
        raise InputError(f"fafo {field} must be True or False, got {getattr(self, field)!r}")
    if isinstance(self.policy, type):
      raise InputError(f"fafo policy must be a policy object, e.g. {self.policy.__name__}(), "
                       f"got the class {self.policy.__name__}")
    for attr in ("init", "view", "update", "block_size", "budget_blocks"):
      if not hasattr(self.policy, attr):
        raise InputError(f"fafo policy {self.policy!r} is not a CompressionPolicy (no {attr})")
    check_budget(f"fafo policy {type(self.policy).__name__}", self.policy.block_size,
                 self.policy.budget_blocks)
    if getattr(self.policy, "max_commit", self.length + 1) < self.length + 1:
      raise InputError(f"fafo commits up to length + 1 = {self.length + 1} entries per step; "
                       f"the policy's max_commit is {self.policy.max_commit}: a length "
                       f"(--fafo-length) of at most {self.policy.max_commit - 1}, or a policy "
                       f"with max_commit >= {self.length + 1}")

  @property
  def capacity_multiple(self) -> int:
    """The cache capacity must be whole policy blocks (api.start rounds its default to it)."""
    return int(self.policy.block_size)

  @property
  def tokens_per_forward(self) -> int:
    return self.subsequences * self.length + 1 + self.candidates * self.length

  @property
  def pool_config(self) -> ngram_pool.PoolConfig:
    return ngram_pool.PoolConfig(key_len=self.length, value_len=self.length,
                                 entries_per_key=self.entries_per_key,
                                 num_buckets=self.pool_keys // POOL_BUCKET_WAYS,
                                 bucket_ways=POOL_BUCKET_WAYS)

  def max_steps(self, max_new_tokens: int) -> int:
    return max_new_tokens   # at least one token per step

  def check(self, cfg: ModelConfig, params: Params, capacity: int) -> None:
    """Refuse a cache capacity the policy's blocks do not tile (api.start: before prefill)."""
    if capacity % self.policy.block_size:
      raise InputError(f"fafo: cache capacity {capacity} is not a multiple of the policy's "
                       f"block_size {self.policy.block_size} (pass a cache_size, --cache-size, "
                       f"that is one)")

  def init(self, cfg: ModelConfig, params: Params, state: DecodeState) -> DecodeState:
    self.check(cfg, params, state.cache.capacity)
    b, n, k = state.batch_size, self.subsequences, self.length
    fumble = context_tokens(row_salt(state, _FUMBLE_SEED), state.tokens, state.num_tokens, (n, k))
    pool = ngram_pool.init_pool(self.pool_config, b)
    if self.prompt_ngrams:
      pool = ngram_pool.insert_sequence_ngrams(pool, state.tokens, state.num_tokens)
    zeros = jnp.zeros((b,), jnp.int32)
    return state.replace(extras=FafoExtras(
        fumble=fumble, discarded=jnp.zeros((b, n, k), jnp.int32),
        pool=pool,
        policy_state=self.policy.init(cfg, params, state), guesses=zeros, hit_steps=zeros,
        accepted_guesses=zeros))

  def plan(self, view) -> AttentionPlan:
    """The step's attention plan: fumble queries read `view`, the rest the full cache."""
    mask, _ = fafo_layout(self.subsequences, self.length, self.candidates)
    f = self.subsequences * self.length
    return AttentionPlan(jnp.asarray(mask), (Segment(view, 0, f),
                                             Segment(FullView(), f, mask.shape[0])))

  def step(self, cfg: ModelConfig, params: Params, state: DecodeState,
           ctx: StepContext) -> DecodeState:
    n, k, m = self.subsequences, self.length, self.candidates
    x: FafoExtras = method_extras(state, FafoExtras, self.name)
    b = state.batch_size
    f = n * k
    _, offsets = fafo_layout(n, k, m)
    active = ~state.done                                                  # [B]
    current = state.last_tokens()                                         # [B, 1]

    # Find-out candidates: the pool under the decoded suffix (up to k tokens, ending at current).
    col = jnp.arange(k, dtype=jnp.int32)[None, :]
    suffix_idx = state.num_tokens[:, None] - k + col                      # [B, k]
    suffix = jnp.take_along_axis(state.tokens, jnp.maximum(suffix_idx, 0), axis=1)
    cands, cand_ok = ngram_pool.lookup(x.pool, suffix, jnp.minimum(state.num_tokens, k), m)
    cand_ok &= active[:, None]                                            # [B, m]
    cands = jnp.where(cand_ok[:, :, None], cands, 0)                      # [B, m, k]

    fumble_cols = jnp.swapaxes(x.fumble, 1, 2).reshape(b, f)              # [B, k*n]: i*n + j
    tokens = jnp.concatenate([fumble_cols, current, cands.reshape(b, m * k)], axis=1)  # [B, T]
    positions = state.cache.lengths[:, None] + jnp.asarray(offsets)[None]  # [B, T]
    view = self.policy.view(x.policy_state, state.cache)
    check_view(f"fafo policy {type(self.policy).__name__}", view, state.cache, cfg.num_layers)
    fumble_last = (k - 1) * n + np.arange(n)
    logits_at = np.concatenate([fumble_last, [f], f + 1 + np.arange(m * k)]).astype(np.int32)
    needs_queries = getattr(self.policy, "needs_queries", False)
    logits, kv = forward(cfg, params, tokens, positions, state.cache, self.plan(view),
                         logits_at=jnp.broadcast_to(jnp.asarray(logits_at), (b, len(logits_at))),
                         capture_queries=needs_queries)
    new_tokens = jnp.argmax(logits[:, :n], axis=-1).astype(jnp.int32)     # [B, n]
    root_logits = logits[:, n]                                            # [B, V]
    cand_logits = logits[:, n + 1:].reshape(b, m, k, -1)                  # [B, m, k, V]

    keys, step_keys = split_keys(state.keys)
    verdict = verify(root_logits, cands, cand_ok, cand_logits, step_keys, ctx.sampling)
    state = finish_step(state.replace(keys=keys))
    state, appended = append_tokens(state, verdict.tokens, verdict.num_tokens, ctx.stop_ids)
    take = jnp.concatenate([jnp.full((b, 1), f, jnp.int32),
                            f + 1 + verdict.candidate[:, None] * k + jnp.arange(k)], axis=1)
    cache = commit(state.cache, kv, appended, take)                       # current + accepted

    # Fumble bookkeeping: drop the oldest token into the discarded buffer, append the new one,
    # store the new guess (the model's tokens) under every suffix of the discarded buffer; a stop
    # token is then replaced in the subsequence only (as Lookahead's window).
    guess = jnp.concatenate([x.fumble[:, :, 1:], new_tokens[:, :, None]], axis=2)   # [B, n, k]
    discarded = jnp.concatenate([x.discarded[:, :, 1:], x.fumble[:, :, :1]], axis=2)
    discarded_len = jnp.broadcast_to(jnp.minimum(state.active_steps, k)[:, None], (b, n))
    pool = self._store(x.pool, discarded, discarded_len, guess, state, appended, active)
    if ctx.stop_ids:
      is_stop = jnp.isin(new_tokens, jnp.asarray(ctx.stop_ids, jnp.int32))
      fill = context_tokens(row_salt(state, _FUMBLE_SEED), state.tokens, state.num_tokens, (n,))
      guess = guess.at[:, :, -1].set(jnp.where(is_stop, fill, new_tokens))
    accepted = verdict.accepted_of(appended)
    keep = active[:, None, None]
    extras = x.replace(
        fumble=jnp.where(keep, guess, x.fumble),
        discarded=jnp.where(keep, discarded, x.discarded),
        pool=pool,
        policy_state=self.policy.update(
            x.policy_state, cache, [q[:, f] for q in kv.q] if needs_queries else None),
        guesses=x.guesses + jnp.sum(cand_ok, axis=1, dtype=jnp.int32),
        hit_steps=x.hit_steps + jnp.any(cand_ok, axis=1),
        accepted_guesses=x.accepted_guesses + accepted)
    return state.replace(cache=cache, extras=extras)

  def _store(self, pool, discarded, discarded_len, guess, state: DecodeState, appended,
             active) -> ngram_pool.NgramPool:
    """One batched insert: each subsequence's guess [B, n, k] under every suffix of its discarded
    buffer; then (output_ngrams) the k-token spans ending at each newly appended token, keyed by
    up to k tokens before them."""
    b, n, k = guess.shape
    items = ngram_pool.suffix_items(discarded, discarded_len, guess,
                                    active[:, None] & (discarded_len > 0), k)
    if self.output_ngrams:
      a = jnp.arange(k + 1, dtype=jnp.int32)[None, :]                     # new token a
      last = state.num_tokens[:, None] - appended[:, None] + a            # [B, k+1] its index
      start = last - k + 1                                                # the span's first
      span = start[:, :, None] + jnp.arange(k)[None, None, :]             # [B, k+1, k]
      before = start[:, :, None] - k + jnp.arange(k)[None, None, :]       # key, right-aligned
      gather = lambda idx: jnp.take_along_axis(                            # noqa: E731
          state.tokens, jnp.maximum(idx, 0).reshape(b, -1), axis=1).reshape(idx.shape)
      span_items = ngram_pool.suffix_items(
          gather(before), jnp.minimum(start, k), gather(span),
          (a < appended[:, None]) & (start >= 1) & active[:, None], k)
      items = [jnp.concatenate(pair, axis=1) for pair in zip(items, span_items)]
    return ngram_pool.insert(pool, *items)

  def stats(self, state: DecodeState, rows: Sequence[int] | None = None) -> dict:
    """Host-side summary of the counters of `rows` (row indices, `loop.row_index`; None: every
    row), per-step figures over those rows' active steps: guesses_per_step, verification
    candidates checked per step (<= `candidates`, m); pool_hit_rate, the share of steps whose
    pool lookup found any; accepted_guesses_per_step, guessed tokens accepted per step. The
    knobs (fumble_guesses_per_step, the fumble subsequences n; tokens_per_forward; policy) are
    the batch's, the same for any rows."""
    x: FafoExtras = state.extras
    active, guesses, hits, accepted = row_counters(state, rows, x.guesses, x.hit_steps,
                                                   x.accepted_guesses)
    steps = int(np.sum(active))
    per = (lambda v: round(float(np.sum(v)) / steps, 4) if steps else 0.0)  # noqa: E731
    return {"guesses_per_step": per(guesses), "fumble_guesses_per_step": float(self.subsequences),
            "pool_hit_rate": per(hits), "accepted_guesses_per_step": per(accepted),
            "tokens_per_forward": self.tokens_per_forward,
            "policy": getattr(self.policy, "name", type(self.policy).__name__)}
