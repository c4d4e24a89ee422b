"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023): the baseline.

A separate, smaller model with the target's vocabulary drafts gamma tokens autoregressively on
its own KV cache; the target verifies them in ONE forward over [current token, d_1 .. d_gamma]
(T = gamma + 1, causal, the full cache) and the longest accepted prefix plus the target's next
token is appended. Lossless: greedy output equals the target's dense greedy output token for
token, and sampled output has its distribution (`verify.verify_drafted`, as QuantSpec's).

    draft_cfg, draft_params, _ = load_model("path/to/small-model")
    generate(cfg, with_draft_model(params, draft_params), prompts,
             method=Speculative(draft=draft_cfg, gamma=4))

The draft's params travel with the target's under DRAFT_MODEL_KEY (`with_draft_model`): the
prefill and the checks take the target's own (`target_params`), the loop gets both, so the state
holds no copy of the draft's weights (a serving batch and its requests share the caller's).

The draft's cache (state.extras.draft_cache) is a dense cache of the draft model, indexed by
position like the target's. Its invariant at a step's start: slots 0 .. n - 3 hold the draft's
K/V of the row's tokens (n = num_tokens). The step's first draft forward goes over the last TWO
tokens (positions n - 2 and n - 1; the first may already be there, written again with the same
token), so whatever the previous step accepted (up to gamma drafts, whose last one the draft
never consumed, plus the target's token) is caught up in one forward of fixed shape; the next
gamma - 1 forwards take one token each. Rejected drafts' entries stay past the row's length and
are overwritten before they are read (cache index = position; the lengths are reset each step).

Stats: acceptance_rate (accepted / drafted tokens), accepted_drafts_per_step, drafted_tokens,
accepted_drafts, gamma, draft_layers, draft_cache_bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsedec.attention import causal_plan
from sparsedec.decode.loop import StepContext, finish_step, row_counters
from sparsedec.decode.prefill import prefill_cache
from sparsedec.decode.sampling import SamplingConfig, probabilities, split_keys
from sparsedec.decode.state import DecodeState, append_tokens, method_extras
from sparsedec.decode.verify import chain_uniforms, draw_from, drafts_counted, verify_chain
from sparsedec.errors import CheckpointError, InputError, is_int
from sparsedec.kv.dense import KVCache, commit, init_cache
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.params import Params, check_params, check_params_dtype

DRAFT_MODEL_KEY = "draft_model"   # params[DRAFT_MODEL_KEY]: the draft model's params
DRAFT_SAMPLINGS = ("sample", "argmax")
DRAFT_PREFILL_CHUNK = 64          # tokens per forward of the draft's prefill (init)


def with_draft_model(params: Params, draft_params: Params) -> Params:
  """params carrying a draft model's params (DRAFT_MODEL_KEY), which `Speculative` drafts with."""
  if not isinstance(draft_params, dict) or "layers" not in draft_params:
    raise InputError(f"the draft model's params must be a params dict (load_model's), got "
                     f"{type(draft_params).__name__}")
  return {**params, DRAFT_MODEL_KEY: draft_params}


def target_params(params: Params) -> Params:
  """params without the draft model they may carry (`with_draft_model`)."""
  if isinstance(params, dict) and DRAFT_MODEL_KEY in params:
    return {k: v for k, v in params.items() if k != DRAFT_MODEL_KEY}
  return params


def check_draft_model(method: str, draft_cfg: ModelConfig, cfg: ModelConfig,
                      params: Params) -> None:
  """Refuse params without a draft model (DRAFT_MODEL_KEY) that fits `draft_cfg` (shapes and
  dtype), or a draft of another vocabulary than the target's `cfg`. `method` names the caller."""
  draft = params.get(DRAFT_MODEL_KEY) if isinstance(params, dict) else None
  if draft is None:
    raise InputError(f"{method} drafts with a second model: pass params carrying its "
                     f"params (sparsedec.decode.speculative.with_draft_model(params, "
                     f"draft_params)); these params have no {DRAFT_MODEL_KEY!r}")
  if draft_cfg.vocab_size != cfg.vocab_size:
    raise InputError(f"the draft model's vocabulary ({draft_cfg.vocab_size} tokens) is not "
                     f"the target's ({cfg.vocab_size}): a draft must share the tokenizer")
  try:
    check_params(draft_cfg, draft)
  except CheckpointError as e:
    raise InputError(f"the draft model's params do not fit the method's draft config: "
                     f"{e}") from None
  check_params_dtype(draft_cfg, draft, "the draft model's params")


def check_draft_knobs(method, *counts: str) -> None:
  """A draft-model method's own knobs (`method.name` in the errors): `draft` a ModelConfig, each
  of `counts` (field names) an integer >= 1, `draft_sampling` one of DRAFT_SAMPLINGS."""
  if not isinstance(method.draft, ModelConfig):
    cls = type(method).__name__
    raise InputError(f"{method.name} needs the draft model's config: {cls}(draft=cfg) (its "
                     f"params go with the target's: with_draft_model(params, draft_params)), "
                     f"got draft={method.draft!r:.80}")
  for field in counts:
    value = getattr(method, field)
    if not is_int(value) or value < 1:
      raise InputError(f"{method.name} {field} must be an integer >= 1, got {value!r}")
  if method.draft_sampling not in DRAFT_SAMPLINGS:
    raise InputError(f"{method.name} draft_sampling must be one of {DRAFT_SAMPLINGS}, "
                     f"got {method.draft_sampling!r}")


def draft_params_of(method_name: str, params: Params) -> Params:
  """The draft model's params a step drafts with (params[DRAFT_MODEL_KEY]), refused by name when
  a state is advanced with the target's params alone."""
  if not isinstance(params, dict) or DRAFT_MODEL_KEY not in params:
    raise InputError(f"{method_name}'s step drafts with the params' {DRAFT_MODEL_KEY!r}: advance "
                     f"the state with the params it was started with (with_draft_model(params, "
                     f"draft_params)), not the target's alone")
  return params[DRAFT_MODEL_KEY]


def samples_drafts(draft_sampling: str, sampling: SamplingConfig) -> bool:
  """Whether a draft's tokens are drawn from its distribution (Leviathan) this run."""
  return draft_sampling == "sample" and not sampling.greedy


def prefill_draft(draft_cfg: ModelConfig, draft_params: Params, state: DecodeState) -> KVCache:
  """A draft model's cache [B, Hkv_draft, S, D_draft] (S the state's capacity), prefilled with
  every row's tokens but its last (num_tokens - 1), in chunks of DRAFT_PREFILL_CHUNK up to the
  longest row (a bound traced, not the capacity)."""
  chunk = DRAFT_PREFILL_CHUNK
  lengths = state.num_tokens - 1                                          # [B] >= 1
  width = -(-state.tokens.shape[1] // chunk) * chunk
  tokens = jnp.pad(state.tokens, ((0, 0), (0, width - state.tokens.shape[1])))  # [B, width]
  cache = init_cache(draft_cfg, state.batch_size, state.cache.capacity)
  cache, _ = prefill_cache(draft_cfg, draft_params, tokens, lengths, cache, chunk,
                           num_chunks=-(-jnp.max(lengths) // chunk))
  return cache


def draft_chain(draft_cfg: ModelConfig, draft_params: Params, cache: KVCache,
                tokens: jax.Array, num_tokens: jax.Array, gamma: int, sampling: SamplingConfig,
                uniforms: jax.Array | None, catch_up: int = 2, view: Any = None
                ) -> tuple[jax.Array, jax.Array | None, KVCache]:
  """gamma tokens a draft model proposes after each row's sequence tokens[b, :num_tokens[b]]
  ([B, L], [B] >= 2), on its cache whose slots 0 .. num_tokens - 1 - catch_up hold the K/V of
  those tokens: its argmax tokens (uniforms None), or drawn with uniforms [B, gamma] from its
  processed distributions q, also returned ([B, gamma, V] fp32; None for argmax drafts); and the
  cache holding their K/V (its lengths past the row's tokens: reset them before reading).

  The first forward goes over the last `catch_up` tokens (fewer in a row shorter than that: the
  rest of the forward's inputs are padding, not committed), which catches up whatever was
  appended since the cache was last written, in one forward of fixed shape; gamma - 1 one-token
  forwards follow. `view` is what the draft's queries read of its cache (None: all of it; a
  `BlockListView` made from the cache, e.g. StreamingLLM's: view(cache))."""
  b, g = tokens.shape[0], gamma
  n = num_tokens
  first = jnp.maximum(n - catch_up, 0)                                    # [B]
  idx = jnp.minimum(first[:, None] + jnp.arange(catch_up)[None], (n - 1)[:, None])
  recent = jnp.take_along_axis(tokens, idx, axis=1)                       # [B, catch_up]
  cache = cache.replace(lengths=first.astype(jnp.int32))

  def next_token(logits, i, q):                   # logits [B, V] -> [B] token, q updated
    if uniforms is None:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32), q
    qi = probabilities(logits, sampling)                                  # [B, V]
    tok = draw_from(qi, jax.lax.dynamic_index_in_dim(uniforms, i, axis=1, keepdims=False))
    return tok, jax.lax.dynamic_update_slice_in_dim(q, qi[:, None], i, axis=1)

  def run(cache, toks, start, count):             # toks [B, T] at positions start + t
    t = toks.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    plan = causal_plan(t, None if view is None else view(cache))
    logits, kv = forward(draft_cfg, draft_params, toks, positions, cache, plan,
                         logits_at=(count - 1)[:, None])
    return logits[:, 0], commit(cache, kv, count)

  q = None if uniforms is None else jnp.zeros((b, g, draft_cfg.vocab_size), jnp.float32)
  logits, cache = run(cache, recent, first, n - first)
  tok, q = next_token(logits, 0, q)
  drafts = jnp.zeros((b, g), jnp.int32).at[:, 0].set(tok)

  def body(i, carry):                              # draft i + 1 from draft i
    cache, drafts, q = carry
    prev = jax.lax.dynamic_index_in_dim(drafts, i - 1, axis=1)            # [B, 1]
    logits, cache = run(cache, prev, n - 1 + i, jnp.ones((b,), jnp.int32))
    tok, q = next_token(logits, i, q)
    return cache, jax.lax.dynamic_update_slice_in_dim(drafts, tok[:, None], i, axis=1), q

  cache, drafts, q = jax.lax.fori_loop(1, g, body, (cache, drafts, q))
  return drafts, q, cache


@struct.dataclass
class SpeculativeExtras:
  draft_cache: KVCache         # the draft model's cache, per layer [B, Hkv_draft, S, D_draft]
  drafted: jax.Array           # [B] int32: draft tokens proposed, summed over steps (a step cut
                               # short by the budget or a stop token: its appended drafts only)
  accepted_drafts: jax.Array   # [B] int32: draft tokens accepted (and appended)


@dataclasses.dataclass(frozen=True)
class Speculative:
  draft: ModelConfig | None = None   # the draft model's config (its params: with_draft_model)
  gamma: int = 4                     # draft tokens per step
  draft_sampling: str = "sample"     # when sampling: "sample" drafts from q (Leviathan), "argmax"
  name: str = "speculative"

  def __post_init__(self):
    check_draft_knobs(self, "gamma")

  @property
  def tokens_per_forward(self) -> int:
    return self.gamma + 1

  def max_steps(self, max_new_tokens: int) -> int:
    return max_new_tokens

  def check(self, cfg: ModelConfig, params: Params, capacity: int) -> None:
    """Refuse params without a fitting draft model, or a draft of another vocabulary (api.start:
    before prefill; init checks again)."""
    check_draft_model(self.name, self.draft, cfg, params)

  def init(self, cfg: ModelConfig, params: Params, state: DecodeState) -> DecodeState:
    """The draft's cache, prefilled with every row's tokens but its last (`prefill_draft`)."""
    self.check(cfg, params, state.cache.capacity)
    b = state.batch_size
    return state.replace(extras=SpeculativeExtras(
        draft_cache=prefill_draft(self.draft, params[DRAFT_MODEL_KEY], state),
        drafted=jnp.zeros((b,), jnp.int32), accepted_drafts=jnp.zeros((b,), jnp.int32)))

  def step(self, cfg: ModelConfig, params: Params, state: DecodeState,
           ctx: StepContext) -> DecodeState:
    x: SpeculativeExtras = method_extras(state, SpeculativeExtras, self.name)
    draft = draft_params_of(self.name, params)
    g = self.gamma
    active = ~state.done                                                    # [B]
    keys, step_keys = split_keys(state.keys)
    draft_u = verify_u = None
    if samples_drafts(self.draft_sampling, ctx.sampling):   # one draw: gamma drafts, gamma tests, the last token
      draft_u, verify_u = chain_uniforms(step_keys, g)                    # [B, g], [B, g + 1]
    drafts, q, draft_cache = draft_chain(self.draft, draft, x.draft_cache,
                                         state.tokens, state.num_tokens, g, ctx.sampling,
                                         draft_u)
    tokens = jnp.concatenate([state.last_tokens(), drafts], axis=1)         # [B, gamma + 1]
    positions = state.cache.lengths[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None]
    logits, kv = forward(cfg, params, tokens, positions, state.cache, causal_plan(g + 1))
    verdict = verify_chain(logits, drafts, q, active, step_keys, verify_u, ctx.sampling)
    state = finish_step(state.replace(keys=keys))
    state, appended = append_tokens(state, verdict.tokens, verdict.num_tokens, ctx.stop_ids)
    accepted, proposed = drafts_counted(verdict, appended, active, g)
    extras = x.replace(draft_cache=draft_cache, drafted=x.drafted + proposed,
                       accepted_drafts=x.accepted_drafts + accepted)
    return state.replace(cache=commit(state.cache, kv, appended), extras=extras)

  def stats(self, state: DecodeState, rows: Sequence[int] | None = None) -> dict:
    """Host-side figures: acceptance over `rows` (row indices, `loop.row_index`; None: every
    row), as QuantSpec's; the knobs and the draft cache's bytes (every row's)."""
    x: SpeculativeExtras = state.extras
    active, drafted, accepted = row_counters(state, rows, x.drafted, x.accepted_drafts)
    steps, proposed = int(np.sum(active)), int(np.sum(drafted))
    return {
        "acceptance_rate": round(int(np.sum(accepted)) / proposed, 4) if proposed else 0.0,
        "accepted_drafts_per_step": round(int(np.sum(accepted)) / steps, 4) if steps else 0.0,
        "drafted_tokens": proposed, "accepted_drafts": int(np.sum(accepted)),
        "gamma": self.gamma, "draft_sampling": self.draft_sampling,
        "draft_layers": self.draft.num_layers,
        "draft_cache_bytes": x.draft_cache.num_bytes(),
    }

