"""Lookahead Decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"): lossless, no draft model.

Each step is ONE forward over T = (N-1)·W + G·(N-1) tokens, all reading the full committed cache:

  [ lookahead branch: N-1 levels x W columns | verification branch: G candidates x (N-1) tokens ]

* The lookahead branch is a 2D Jacobi window. Level 0 is the current token (column 0, the newest
  token, its K/V not yet committed) followed by W-1 guessed tokens; level l (1..N-2) holds W
  tokens. Token (l, j) sits at position p + l + j (p: the current token's position) and attends to
  level-0 tokens 0..j and to its own column j in levels 1..l: each query sees a consecutive run of
  positions p .. p + l + j (`lookahead_mask`). The model's argmax at the last level (N-2) gives W
  new tokens R; column j then forms the n-gram (level0[j], level1[j], .., level_{N-2}[j], R[j]),
  stored in the pool under its first token. The window then moves up one level: level l takes
  level l+1, the last level takes R (stop tokens in R are replaced by random context tokens, as
  the authors do, so the window does not fill with end-of-text).
* The verification branch holds up to G n-gram candidates (N-1 tokens each) retrieved from the
  pool under the current token; candidate token i sits at position p + 1 + i and attends to the
  current token and causally to its own earlier tokens. `verify.verify` accepts the longest
  matching candidate prefix (greedy) or runs distribution-preserving multi-candidate rejection
  sampling, then adds one token from the model: 1 .. N tokens per step. The accepted tokens' K/V
  (the current token and the accepted candidate tokens) are committed with `commit(take=...)`.

Choices where the paper leaves one (following the authors' implementation unless said):
* Level 0 column 0 is the current token itself (the authors' layout), so T has no separate slot
  for it and column 0's n-gram is keyed by the current token.
* The window always moves by one level per step, however many tokens were accepted (the authors'
  default); the positions of its tokens are recomputed from the new current position.
* The window starts filled with random tokens of the prompt; its n-grams enter the pool once every
  level above 0 comes from the model (after N-2 steps), as in the authors' warm-up. Shapes stay
  fixed during warm-up (the authors run smaller forwards instead).
* The pool (`sparsedec.ngram.pool`) keeps `guesses` (G) n-grams per key, LRU, and is looked up
  with G slots: the authors' GUESS_SET_SIZE. Its hash table holds `pool_keys` keys per row.
* `prompt_ngrams`: seed the pool with every N-gram of the prompt (and the first generated token);
  `output_ngrams`: store the N-gram ending at every accepted token (the authors' POOL_FROM_PROMPT
  does both; off by default there, on by default here: it costs little and repeats in the prompt
  or the output are the most reliable guesses). Window n-grams are inserted before output n-grams,
  so the latter are the most recent.
* Logits are computed only where needed (current token, last level, candidates).

Stats (counters per row in `LookaheadExtras`; `stats` sums those of the rows asked for, every
row by default): guesses per step (candidates verified), pool hit rate (steps whose lookup
returned a candidate), accept rate (steps that accepted at least one guessed token), accepted
guessed tokens per step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsedec.attention import AttentionPlan, FullView, Segment
from sparsedec.decode.guesses import context_tokens, row_salt
from sparsedec.decode.loop import StepContext, finish_step, row_counters
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
_WINDOW_SEED = 0x10A4   # salt of the pseudo-random picks that fill the window


@functools.cache
def lookahead_layout(window: int, ngram: int, guesses: int) -> tuple[np.ndarray, np.ndarray]:
  """(mask [T, T] bool, position offsets [T] int32) of one Lookahead step.

  Token index: window token (level l, column j) at l*W + j; candidate g token i at
  (N-1)*W + g*(N-1) + i. Offsets are relative to the current token's position.
  """
  w, lv, g = window, ngram - 1, guesses
  t = lv * w + g * lv
  mask = np.zeros((t, t), bool)
  offsets = np.zeros((t,), np.int32)
  for level in range(lv):
    for j in range(w):
      q = level * w + j
      offsets[q] = level + j
      mask[q, : j + 1] = True                       # level 0, columns 0..j
      for up in range(1, level + 1):
        mask[q, up * w + j] = True                  # own column, levels 1..level
  for c in range(g):
    for i in range(lv):
      q = lv * w + c * lv + i
      offsets[q] = 1 + i
      mask[q, 0] = True                             # the current token
      mask[q, lv * w + c * lv: q + 1] = True        # own earlier tokens and itself
  return mask, offsets


@struct.dataclass
class LookaheadExtras:
  window: jax.Array            # [B, N-1, W] int32 levels; level 0 column 0 is the current token
  window_age: jax.Array        # [B] int32: steps since the window was seeded
  pool: ngram_pool.NgramPool   # key: 1 token, value: N-1 tokens
  guesses: jax.Array           # [B] int32: candidates verified, summed over steps
  hit_steps: jax.Array         # [B] int32: steps whose pool lookup returned a candidate
  accept_steps: jax.Array      # [B] int32: steps that accepted >= 1 guessed token
  accepted_guesses: jax.Array  # [B] int32: guessed tokens accepted (and appended)


@dataclasses.dataclass(frozen=True)
class Lookahead:
  window: int = 7            # W: columns of the Jacobi window
  ngram: int = 5             # N: n-gram size (guesses are N-1 tokens; up to N tokens per step)
  guesses: int = 7           # G: candidates verified per step (and n-grams kept per key)
  pool_keys: int = 4096      # pool hash-table keys per row (buckets x 4 ways)
  prompt_ngrams: bool = True
  output_ngrams: bool = True
  name: str = "lookahead"

  def __post_init__(self):
    for field, low in (("window", 1), ("ngram", 2), ("guesses", 1),
                       ("pool_keys", POOL_BUCKET_WAYS)):
      value = getattr(self, field)
      if not is_int(value) or value < low:
        raise InputError(f"lookahead {field} must be an integer >= {low}, got {value!r}")
    if self.pool_keys % POOL_BUCKET_WAYS:
      raise InputError(f"lookahead pool_keys must be a multiple of {POOL_BUCKET_WAYS}, "
                       f"got {self.pool_keys}")
    for field in ("prompt_ngrams", "output_ngrams"):
      if not isinstance(getattr(self, field), bool):
        raise InputError(f"lookahead {field} must be True or False, got "
                         f"{getattr(self, field)!r}")

  @property
  def tokens_per_forward(self) -> int:
    return (self.ngram - 1) * (self.window + self.guesses)

  @property
  def pool_config(self) -> ngram_pool.PoolConfig:
    return ngram_pool.PoolConfig(key_len=1, value_len=self.ngram - 1,
                                 entries_per_key=self.guesses,
                                 num_buckets=self.pool_keys // POOL_BUCKET_WAYS,
                                 bucket_ways=POOL_BUCKET_WAYS)

  def max_steps(self, max_new_tokens: int) -> int:
    return max_new_tokens   # at least one token per step

  def init(self, cfg: ModelConfig, params: Params, state: DecodeState) -> DecodeState:
    b = state.batch_size
    levels = self.ngram - 1
    window = context_tokens(row_salt(state, _WINDOW_SEED), state.tokens, state.num_tokens,
                             (levels, self.window))
    pool = ngram_pool.init_pool(self.pool_config, b)
    if self.prompt_ngrams:
      pool = ngram_pool.insert_sequence_ngrams(pool, state.tokens, state.num_tokens)
    zeros = jnp.zeros((b,), jnp.int32)
    return state.replace(extras=LookaheadExtras(
        window=window, window_age=zeros, pool=pool, guesses=zeros, hit_steps=zeros,
        accept_steps=zeros, accepted_guesses=zeros))

  def step(self, cfg: ModelConfig, params: Params, state: DecodeState,
           ctx: StepContext) -> DecodeState:
    w, lv, g = self.window, self.ngram - 1, self.guesses
    x: LookaheadExtras = method_extras(state, LookaheadExtras, self.name)
    b = state.batch_size
    mask, offsets = lookahead_layout(w, self.ngram, g)
    t = mask.shape[0]
    active = ~state.done                                                  # [B]
    current = state.last_tokens()                                         # [B, 1]
    cands, cand_ok = ngram_pool.lookup(x.pool, current, jnp.ones((b,), jnp.int32), g)
    cand_ok &= active[:, None]                                            # [B, G]
    cands = jnp.where(cand_ok[:, :, None], cands, 0)                      # [B, G, N-1]
    window = x.window.at[:, 0, 0].set(current[:, 0])                      # [B, N-1, W]
    tokens = jnp.concatenate([window.reshape(b, lv * w), cands.reshape(b, g * lv)], axis=1)
    positions = state.cache.lengths[:, None] + jnp.asarray(offsets)[None]  # [B, T]
    plan = AttentionPlan(jnp.asarray(mask), (Segment(FullView(), 0, t),))
    last_level = (lv - 1) * w + np.arange(w)
    cand_idx = lv * w + np.arange(g * lv)
    logits_at = np.concatenate([[0], last_level, cand_idx]).astype(np.int32)
    logits, kv = forward(cfg, params, tokens, positions, state.cache, plan,
                         logits_at=jnp.broadcast_to(jnp.asarray(logits_at), (b, len(logits_at))))
    root_logits = logits[:, 0]                                            # [B, V]
    new_level = jnp.argmax(logits[:, 1: 1 + w], axis=-1).astype(jnp.int32)  # [B, W]
    cand_logits = logits[:, 1 + w:].reshape(b, g, lv, -1)                 # [B, G, N-1, V]

    keys, step_keys = split_keys(state.keys)
    verdict = verify(root_logits, cands, cand_ok, cand_logits, step_keys, ctx.sampling)
    state = finish_step(state.replace(keys=keys))
    state, n = append_tokens(state, verdict.tokens, verdict.num_tokens, ctx.stop_ids)
    take = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                            lv * w + verdict.candidate[:, None] * lv + jnp.arange(lv)], axis=1)
    cache = commit(state.cache, kv, n, take)                              # current + accepted

    window_ready = active & (x.window_age >= lv - 1)      # levels 1.. all came from the model
    pool = self._store_ngrams(x.pool, window, new_level, state, n, window_ready)
    if ctx.stop_ids:
      is_stop = jnp.isin(new_level, jnp.asarray(ctx.stop_ids, jnp.int32))
      fill = context_tokens(row_salt(state, _WINDOW_SEED), state.tokens, state.num_tokens, (w,))
      new_level = jnp.where(is_stop, fill, new_level)
    moved = jnp.concatenate([window[:, 1:], new_level[:, None]], axis=1)  # [B, N-1, W]
    accepted = verdict.accepted_of(n)
    extras = x.replace(
        window=jnp.where(active[:, None, None], moved, x.window),
        window_age=x.window_age + active,
        pool=pool,
        guesses=x.guesses + jnp.sum(cand_ok, axis=1, dtype=jnp.int32),
        hit_steps=x.hit_steps + jnp.any(cand_ok, axis=1),
        accept_steps=x.accept_steps + (accepted > 0),
        accepted_guesses=x.accepted_guesses + accepted)
    return state.replace(cache=cache, extras=extras)

  def _store_ngrams(self, pool: ngram_pool.NgramPool, window: jax.Array, new_level: jax.Array,
                    state: DecodeState, appended: jax.Array,
                    window_ready: jax.Array) -> ngram_pool.NgramPool:
    """Insert the window's W column n-grams (where window_ready [B]), then the N-grams ending at
    each of the `appended` [B] new tokens of state.tokens (when output_ngrams)."""
    b, _, w = window.shape
    keys = window[:, 0, :, None]                                          # [B, W, 1]
    values = jnp.concatenate([jnp.swapaxes(window[:, 1:], 1, 2), new_level[:, :, None]],
                             axis=2)                                      # [B, W, N-1]
    valid = jnp.broadcast_to(window_ready[:, None], (b, w))
    if self.output_ngrams:
      n = self.ngram
      i = jnp.arange(n, dtype=jnp.int32)[None, :]                         # new token i of up to N
      end = state.num_tokens[:, None] - appended[:, None] + i             # [B, N]: its index
      span = end[:, :, None] - (n - 1) + jnp.arange(n)[None, None, :]     # [B, N, N]
      grams = jnp.take_along_axis(state.tokens, jnp.clip(span, 0).reshape(b, n * n), axis=1)
      grams = grams.reshape(b, n, n)
      keys = jnp.concatenate([keys, grams[:, :, :1]], axis=1)
      values = jnp.concatenate([values, grams[:, :, 1:]], axis=1)
      valid = jnp.concatenate([valid, (i < appended[:, None]) & (span[:, :, 0] >= 0)], axis=1)
    return ngram_pool.insert(pool, keys, jnp.ones(valid.shape, jnp.int32), values, valid)

  def stats(self, state: DecodeState, rows: Sequence[int] | None = None) -> dict:
    """Host-side summary of the counters of `rows` (row indices, `loop.row_index`; None: every
    row), per-step figures over those rows' active steps: guesses_per_step, candidate n-grams
    verified per step (<= `guesses`, G); pool_hit_rate, the share of steps whose pool lookup
    found any; accept_rate, the share of steps that accepted at least one guessed token (not
    QuantSpec's acceptance_rate, a share of drafted tokens); accepted_guesses_per_step, guessed
    tokens accepted per step."""
    x: LookaheadExtras = state.extras
    active, guesses, hits, accepts, accepted = row_counters(
        state, rows, x.guesses, x.hit_steps, x.accept_steps, x.accepted_guesses)
    steps = int(np.sum(active))
    def per(v):
      return round(float(np.sum(v)) / steps, 4) if steps else 0.0
    return {"guesses_per_step": per(guesses), "pool_hit_rate": per(hits),
            "accept_rate": per(accepts), "accepted_guesses_per_step": per(accepted)}
