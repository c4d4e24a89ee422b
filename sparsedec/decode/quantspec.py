"""QuantSpec: self-speculative decoding with a hierarchical INT4/INT8 KV cache (lossless).

One step, with N committed tokens and the current token x_N (its K/V not yet committed):
  1. Draft: gamma forwards of one token each (a `lax.fori_loop`), the SAME model with 4-bit
     weights (`quant_weights`, unless weight_bits=None) reading the 4-bit view of the quantized
     cache + the full-precision double buffer (`QuantView(bits=4)`). Draft i reads the draft K/V of
     x_N, d_1 .. d_{i-1} from a small in-flight scratch ([L, B, gamma, Hkv, D], every layer in
     one array, the QuantView's `extra`); nothing of the draft is ever committed. The view's
     tail (the buffer, and its first half quantized as the next flush will) is computed once for
     the gamma drafts, in the cache's dtype (`draft_view`, `QuantView.with_tail`). d_i is the
     draft's argmax when greedy (or draft_sampling="argmax"), else drawn from the draft's
     distribution q_i (below).
  2. Verify: ONE forward over [x_N, d_1 .. d_gamma] with the full model, reading
     verify_precision="int8": the 8-bit view of the same codes + the buffer (`QuantView(bits=8)`);
     verify_precision="full": a full-precision dense cache kept alongside the codes
     (`FullView`; it costs the dense cache's memory on top of the codes, reported in stats).
  3. Greedy: `verify.verify` with the drafts as one candidate accepts the longest prefix equal to
     the verifier's argmax. Sampling: distribution-preserving rejection sampling (below). The
     accepted tokens' K/V (from the verify forward) are committed to the double buffer
     (`kv.quantized.commit`; the flush runs there) and, in "full" mode, to the dense cache.

Sampling (temperature > 0), two lossless modes (`draft_sampling`); p_i and q_i are the verifier's
and the draft's distributions after the SAME temperature / top-k / top-p processing dense sampling
uses (`sampling.probabilities`), so the output is distributed exactly as dense sampling:
  * "sample" (default; Leviathan et al. 2023): d_i is drawn from q_i and the rows q_i [B, gamma, V]
    are kept; `verify.verify_drafted` accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)),
    draws the first rejected position's token from norm(max(0, p_i - q_i)), and the bonus token
    from p_{gamma+1} when all are accepted.
  * "argmax": d_i is the draft's argmax, treated by `verify.verify` as a deterministic guess
    (accepted with probability p_i(d_i), else the token is drawn from p_i with d_i removed). Also
    exact, but it usually accepts less often: p_i(argmax q_i) against sum_t min(p_i(t), q_i(t))
    (stories260K, temperature 1.6, first step: ~0.65 of "sample"'s accepted drafts).

What is exact (tests/test_quantspec.py proves both in fp32: greedy on stories260K and
SmolLM2-135M, sampling on stories260K (chi-square, both draft modes) and on toy distributions):
  * "full": greedy output is token-identical to dense greedy; sampling has dense's distribution.
  * "int8": the output is that of the model whose attention reads every token older than the
    recent buffer at INT8, i.e. a one-token-per-step decoder whose cache slots < quantized_length(N)
    hold the dequantized INT8 values (QuantView's per-query flush rule makes a verification window
    that crosses a flush read exactly what that decoder reads).

Choices where the paper leaves one:
  * One PRNG draw per row and step gives the gamma draft uniforms, the gamma acceptance tests
    and the last token's uniform ("sample" mode); all are independent.
  * The lm_head, embeddings and norms of the draft stay full precision (see quant_weights): they
    are the target's params, which the step has; the state holds only the draft's 4-bit linears.
  * Prefill fills a dense cache in chunks, then quantizes it (`from_dense`); in "int8" mode the
    dense cache is then dropped (replaced by a placeholder of one unread slot that carries the
    lengths: `PLACEHOLDER_SLOTS`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import pallas_kernels.w4a16_gemv as w4a16
from sparsedec.attention import AttentionPlan, QuantView, Segment, causal_plan
from sparsedec.decode.loop import StepContext, finish_step, row_counters
from sparsedec.decode.sampling import SamplingConfig, probabilities, split_keys
from sparsedec.decode.state import DecodeState, append_tokens, method_extras
from sparsedec.decode.verify import chain_uniforms, draw_from, drafts_counted, verify_chain
from sparsedec.errors import InputError, is_int
from sparsedec.kv import quantized as qkv
from sparsedec.kv.dense import KVCache, commit
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.params import Params
from sparsedec.model.gptq import DRAFT_KEY, with_draft
from sparsedec.model.quant_weights import (GRIDS, LAYOUTS, QUANTIZED_LINEARS, params_to_layout,
                                           quantize_params, weights_bytes)

VERIFY_PRECISIONS = ("int8", "full")
# Slots of the dense cache an int8 state keeps (the codes replace it; nothing reads them): one,
# not zero, so the state has no zero-size arrays, which orbax refuses to save ("Cannot save
# arrays with zero size": a serving state could not be checkpointed).
PLACEHOLDER_SLOTS = 1
DRAFT_SAMPLINGS = ("sample", "argmax")


def draft_view(qcache: qkv.QuantizedCache) -> QuantView:
  """The draft's view of the cache (4 bits), its tail computed now in the cache's dtype
  (`QuantView.with_tail`: one computation for the gamma draft forwards of a step)."""
  return QuantView(qcache, bits=4).with_tail(qcache.buf_k[0].dtype)


def verify_view(qcache: qkv.QuantizedCache) -> QuantView:
  """The verifier's view of the cache (8 bits, verify_precision="int8"), its tail in the cache's
  dtype (what the kernel path attends: `quant_attention`'s key sets are in q's dtype)."""
  return QuantView(qcache, bits=8).with_tail(qcache.buf_k[0].dtype)


def draft_model(params: Params, draft: dict) -> Params:
  """The draft's params: params with every layer's entries that `draft["layers"]` holds (its
  4-bit linears) replaced by them; the embeddings, norms, biases and lm_head are params' own."""
  layers = [{**lp, **dl} for lp, dl in zip(params["layers"], draft["layers"], strict=True)]
  return {**params, "layers": layers}


def _linears(layers: list[dict]) -> dict:
  """{"layers": each layer's QUANTIZED_LINEARS only} (what the state keeps of a draft)."""
  return {"layers": [{name: lp[name] for name in QUANTIZED_LINEARS} for lp in layers]}


def draft_scratch(cfg: ModelConfig, batch: int, width: int, dtype) -> jax.Array:
  """The draft's in-flight K (or V) scratch, every layer in one array [L, B, width, Hkv, D]
  (a QuantView's `extra`, indexed by layer): one update per draft forward, not one per layer."""
  return jnp.zeros((cfg.num_layers, batch, width, cfg.num_kv_heads, cfg.head_dim), dtype)


def write_draft_kv(scratch: jax.Array, new: tuple[jax.Array, ...], i) -> jax.Array:
  """scratch [L, B, W, Hkv, D] with every layer's new [B, 1, Hkv, D] at slot i."""
  return jax.lax.dynamic_update_slice_in_dim(scratch, jnp.stack(new).astype(scratch.dtype), i,
                                             axis=2)


@struct.dataclass
class QuantSpecExtras:
  # The draft weights are the same for every row: serving's insert_row leaves them as they are.
  SHARED_FIELDS: ClassVar[tuple[str, ...]] = ("draft_params",)
  qcache: qkv.QuantizedCache   # the hierarchical codes + full-precision double buffer
  draft_params: Any            # {"layers": L x {name: QuantWeight}}: the draft's 4-bit linears
                               # (`draft_model` adds the target's other params), or None (the
                               # draft uses params)
  drafted: jax.Array           # [B] int32: draft tokens proposed, summed over steps (a step cut
                               # short by the budget or a stop token: its appended drafts only)
  accepted_drafts: jax.Array   # [B] int32: draft tokens accepted (and appended)

  def request_params(self, params: Params) -> Params:
    """`serving.request_params`: params carrying this batch's 4-bit draft (`gptq.with_draft`),
    which a request's init takes instead of quantizing every linear again."""
    return params if self.draft_params is None else with_draft(params,
                                                               self.draft_params["layers"])


@dataclasses.dataclass(frozen=True)
class QuantSpec:
  gamma: int = 4                   # draft tokens per step
  verify_precision: str = "int8"   # "int8": 8-bit view of the codes; "full": dense cache too
  quant_group: int = 128           # G: key group (tokens); the buffer holds 2G tokens
  weight_bits: int | None = 4      # draft weights: 4 (group-wise RTN, or the params' own draft
                                   # layers: `sparsedec.model.gptq`) or None (unquantized)
  weight_group: int = 128          # input rows per weight group
  weight_grid: str = "minmax"      # the RTN draft's grids (quant_weights.GRIDS): "minmax", or
                                   # "absmax" (GGUF Q4_0's; a GPTQ draft keeps its own grids)
  weight_layout: str = "auto"      # how the draft multiplies its 4-bit weights (quant_weights);
                                   # "auto": the W4A16 Pallas kernel's "int4_t" on a GPU (groups
                                   # a multiple of 64, or 16 or 32), else "packed"
  draft_sampling: str = "sample"   # when sampling: "sample" drafts from q (Leviathan), "argmax"
  name: str = "quantspec"

  def __post_init__(self):
    for field, low in (("gamma", 1), ("quant_group", 2), ("weight_group", 2)):
      value = getattr(self, field)
      if not is_int(value) or value < low:
        raise InputError(f"quantspec {field} must be an integer >= {low}, got {value!r}")
    if self.verify_precision not in VERIFY_PRECISIONS:
      raise InputError(f"quantspec verify_precision must be one of {VERIFY_PRECISIONS}, "
                       f"got {self.verify_precision!r}")
    if not qkv.fits_value_tiles(self.quant_group):
      raise InputError(f"quantspec quant_group must divide 64 or be a multiple of 64 (the value "
                       f"codes are stored in 64-token tiles), got {self.quant_group}")
    if self.gamma + 1 > self.quant_group:
      raise InputError(f"quantspec commits up to gamma + 1 = {self.gamma + 1} entries per step, "
                       f"more than quant_group = {self.quant_group}")
    if self.draft_sampling not in DRAFT_SAMPLINGS:
      raise InputError(f"quantspec draft_sampling must be one of {DRAFT_SAMPLINGS}, "
                       f"got {self.draft_sampling!r}")
    if self.weight_bits not in (4, None):
      raise InputError(f"quantspec weight_bits must be 4 or None, got {self.weight_bits!r}")
    if self.weight_group % 2:
      raise InputError(f"quantspec weight_group must be even, got {self.weight_group}")
    if self.weight_grid not in GRIDS:
      raise InputError(f"quantspec weight_grid must be one of {GRIDS}, got {self.weight_grid!r}")
    if self.weight_layout not in ("auto",) + LAYOUTS:
      raise InputError(f"quantspec weight_layout must be 'auto' or one of {LAYOUTS}, "
                       f"got {self.weight_layout!r}")
    if self.weight_layout == "int4_t" and not w4a16.group_supported(self.weight_group):
      raise InputError(f"quantspec weight_layout 'int4_t' needs weight_group a multiple of 64 "
                       f"or one of {w4a16.SMALL_GROUPS}, got {self.weight_group}")

  def resolved_weight_layout(self, platform: str | None = None) -> str:
    """The draft's weight layout: weight_layout, with "auto" resolved for `platform` (a jax
    device platform, e.g. that of the params' devices; None: the default backend)."""
    if self.weight_layout != "auto":
      return self.weight_layout
    gpu = (platform or jax.default_backend()) == "gpu"
    return "int4_t" if gpu and w4a16.group_supported(self.weight_group) else "packed"

  @property
  def tokens_per_forward(self) -> int:
    return self.gamma + 1

  def max_steps(self, max_new_tokens: int) -> int:
    return max_new_tokens

  def max_capacity(self, cfg: ModelConfig) -> int | None:
    """The largest cache capacity init takes for this model: under a sliding window, one whose
    keys and the step's in-flight tokens stay within it (api.start's default capacity is cut to
    it); None without a window."""
    if cfg.sliding_window is None:
      return None
    return cfg.sliding_window - self.tokens_per_forward

  def check(self, cfg: ModelConfig, params: Params, capacity: int) -> None:
    """Refuse a model, cache capacity or params' draft this method cannot run (api.start:
    before prefill)."""
    window, reach = cfg.sliding_window, capacity + self.tokens_per_forward
    if window is not None and window < reach:
      raise InputError(
          f"quantspec cannot apply sliding_window={window}: its quantized cache views read "
          f"every committed key, and the cache capacity {capacity} plus the step's "
          f"{self.tokens_per_forward} in-flight tokens ({reach}) reach past the window; a "
          f"cache_size (--cache-size) <= {window - self.tokens_per_forward} keeps every key "
          f"within it (the window then changes nothing) where the prompt + max_new_tokens fit "
          f"in it; a longer run is one the window binds, which quantspec cannot decode "
          f"(dense, lookahead and fafo honour the window)")
    if cfg.head_dim % 8:
      raise InputError(f"quantspec needs a head_dim that is a multiple of 8 (the KV cache's "
                       f"4-bit codes are stored in words of 8), got {cfg.head_dim}")
    layers = params.get(DRAFT_KEY)
    if layers is not None:
      if self.weight_bits is None:
        raise InputError(f"the params carry a 4-bit draft ({DRAFT_KEY!r}) but quantspec "
                         f"weight_bits is None")
      groups = sorted({lp[name].group for lp in layers for name in QUANTIZED_LINEARS})
      if groups != [self.weight_group]:
        raise InputError(f"the params' draft ({DRAFT_KEY!r}) has weight groups {groups}, "
                         f"quantspec weight_group is {self.weight_group}")

  def init_key(self, platform: str | None = None) -> "QuantSpec":
    """The method init is compiled for (loop.init_method, which passes the platform of the
    params' devices): draft_sampling, which only the step reads, at its default, so runs that
    differ only in it share the init's compile; weight_layout "auto" resolved for `platform`
    (params on the CPU of a GPU host get the CPU's layout; None: the default backend)."""
    return dataclasses.replace(self, draft_sampling=DRAFT_SAMPLINGS[0],
                               weight_layout=self.resolved_weight_layout(platform))

  def init(self, cfg: ModelConfig, params: Params, state: DecodeState) -> DecodeState:
    self.check(cfg, params, state.cache.capacity)
    b = state.batch_size
    qcache = qkv.from_dense(state.cache, self.quant_group)
    cache = state.cache
    if self.verify_precision == "int8":      # the codes replace the dense cache
      cache = KVCache(k=tuple(x[:, :, :PLACEHOLDER_SLOTS] for x in cache.k),
                      v=tuple(x[:, :, :PLACEHOLDER_SLOTS] for x in cache.v), lengths=cache.lengths)
    draft = self._draft_params(params)
    # Two arrays, not one shared leaf: a state whose leaves alias cannot be donated.
    return state.replace(cache=cache, extras=QuantSpecExtras(
        qcache=qcache, draft_params=draft, drafted=jnp.zeros((b,), jnp.int32),
        accepted_drafts=jnp.zeros((b,), jnp.int32)))

  def _draft_params(self, params: Params):
    """The draft's 4-bit linears (`QuantSpecExtras.draft_params`): None (weight_bits=None: the
    draft uses params), those of the draft layers the params carry (params[DRAFT_KEY], e.g.
    GPTQ's: `sparsedec.model.gptq.with_draft`; `check` refused one that does not fit), else every
    linear RTN-quantized now; in the resolved weight layout."""
    layers = params.get(DRAFT_KEY)
    if layers is None:
      return (_linears(quantize_params(params, self.weight_group, self.resolved_weight_layout(),
                                       self.weight_grid)["layers"])
              if self.weight_bits == 4 else None)
    return params_to_layout(_linears(layers), self.resolved_weight_layout())

  def samples_drafts(self, sampling: SamplingConfig) -> bool:
    """Whether the drafts are drawn from the draft's distribution (Leviathan) this run."""
    return self.draft_sampling == "sample" and not sampling.greedy

  def _draft(self, cfg: ModelConfig, params: Params, state: DecodeState, sampling: SamplingConfig,
             uniforms: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """The draft's tokens after the current one, [B, gamma]: its argmax tokens (uniforms None), or
    drawn with uniforms [B, gamma] from its processed distributions q, also returned
    ([B, gamma, V] fp32; None for argmax drafts)."""
    x: QuantSpecExtras = state.extras
    b, g = state.batch_size, self.gamma
    draft_params = params if x.draft_params is None else draft_model(params, x.draft_params)
    n0 = x.qcache.lengths                                                   # [B]
    scratch = draft_scratch(cfg, b, g, x.qcache.buf_k[0].dtype)          # [L, B, gamma, Hkv, D]
    plan_mask = jnp.ones((1, 1), bool)
    base = draft_view(x.qcache)                    # the tail once for all gamma drafts

    def put(buf, new, i):   # buf [B, gamma, ...] <- new [B, 1, ...] at slot i
      return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), i, axis=1)

    def body(i, carry):
      tok, ek, ev, drafts, q = carry                                        # tok [B, 1]
      view = base.replace(extra_k=ek, extra_v=ev, extra_len=jnp.full((b,), i, jnp.int32))
      plan = AttentionPlan(plan_mask, (Segment(view, 0, 1),))
      logits, kv = forward(cfg, draft_params, tok, (n0 + i)[:, None], state.cache, plan)
      if uniforms is None:
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)           # [B]
      else:
        qi = probabilities(logits[:, 0], sampling)                          # [B, V]
        nxt = draw_from(qi, jax.lax.dynamic_index_in_dim(uniforms, i, axis=1, keepdims=False))
        q = put(q, qi[:, None], i)
      ek, ev = write_draft_kv(ek, kv.k, i), write_draft_kv(ev, kv.v, i)
      return nxt[:, None], ek, ev, put(drafts, nxt[:, None], i), q

    q0 = None if uniforms is None else jnp.zeros((b, g, cfg.vocab_size), jnp.float32)
    init = (state.last_tokens(), scratch, scratch, jnp.zeros((b, g), jnp.int32), q0)
    _, _, _, drafts, q = jax.lax.fori_loop(0, g, body, init)
    return drafts, q

  def verify_plan(self, qcache: qkv.QuantizedCache) -> AttentionPlan:
    t = self.gamma + 1
    if self.verify_precision == "full":
      return causal_plan(t)
    plan = causal_plan(t)
    return AttentionPlan(plan.inflight_mask, (Segment(verify_view(qcache), 0, t),))

  def step(self, cfg: ModelConfig, params: Params, state: DecodeState,
           ctx: StepContext) -> DecodeState:
    x: QuantSpecExtras = method_extras(state, QuantSpecExtras, self.name)
    g = self.gamma
    # init admits a sliding window only where it never binds (window >= capacity + gamma + 1):
    # attention without it is the same, and the QuantView reads take no window.
    cfg = cfg.replace(sliding_window=None)
    active = ~state.done                                                    # [B]
    keys, step_keys = split_keys(state.keys)
    draft_u = verify_u = None
    if self.samples_drafts(ctx.sampling):   # one draw: gamma drafts, gamma tests, the last token
      draft_u, verify_u = chain_uniforms(step_keys, g)                    # [B, g], [B, g + 1]
    drafts, q = self._draft(cfg, params, state, ctx.sampling, draft_u)      # [B, gamma]
    tokens = jnp.concatenate([state.last_tokens(), drafts], axis=1)         # [B, gamma + 1]
    positions = x.qcache.lengths[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None]
    logits, kv = forward(cfg, params, tokens, positions, state.cache, self.verify_plan(x.qcache))
    verdict = verify_chain(logits, drafts, q, active, step_keys, verify_u, ctx.sampling)
    state = finish_step(state.replace(keys=keys))
    state, appended = append_tokens(state, verdict.tokens, verdict.num_tokens, ctx.stop_ids)
    accepted, proposed = drafts_counted(verdict, appended, active, g)
    extras = x.replace(qcache=qkv.commit(x.qcache, kv, appended),
                       drafted=x.drafted + proposed,
                       accepted_drafts=x.accepted_drafts + accepted)
    if self.verify_precision == "full":
      cache = commit(state.cache, kv, appended)
    else:      # the placeholder slot holds nothing: only the lengths move (no scatter per layer)
      cache = state.cache.replace(lengths=state.cache.lengths + appended.astype(jnp.int32))
    return state.replace(cache=cache, extras=extras)

  def stats(self, state: DecodeState, rows: Sequence[int] | None = None) -> dict:
    """Host-side figures: acceptance over `rows` (row indices, `loop.row_index`; None: every
    row): acceptance_rate, accepted drafts / drafted tokens, summed over those rows and their
    steps; accepted_drafts_per_step over their active steps; drafted_tokens, accepted_drafts.
    The rest are the batch's whatever the rows: the knobs, and memory (bytes of the caches
    actually held, every row's: quantized_cache_bytes the codes and buffer, dense_cache_bytes
    the full-precision cache QuantSpec keeps beside them, 0 with int8 verification;
    dense_equivalent_cache_bytes what dense decoding's cache holds; draft_weight_bytes, the
    draft every row shares)."""
    x: QuantSpecExtras = state.extras
    active, drafted, accepted = row_counters(state, rows, x.drafted, x.accepted_drafts)
    steps, proposed = int(np.sum(active)), int(np.sum(drafted))
    qc = x.qcache
    # What dense decoding's cache holds for this run: the run's capacity (state.tokens holds
    # capacity + 1 tokens), not the codes' capacity, which rounds it up to whole quant groups
    # (G = 192 at the default capacity of 128: 384 slots, a dense figure 1.5x too large).
    capacity = state.tokens.shape[1] - 1
    dense_equiv = sum(2 * k.shape[0] * k.shape[1] * capacity * k.shape[3] * k.dtype.itemsize
                      for k in qc.buf_k)
    # int8: the dense cache's placeholder slot holds no cache (PLACEHOLDER_SLOTS).
    dense_bytes = state.cache.num_bytes() if self.verify_precision == "full" else 0
    return {
        "acceptance_rate": round(int(np.sum(accepted)) / proposed, 4) if proposed else 0.0,
        "accepted_drafts_per_step": round(int(np.sum(accepted)) / steps, 4) if steps else 0.0,
        "drafted_tokens": proposed, "accepted_drafts": int(np.sum(accepted)),
        "gamma": self.gamma, "verify_precision": self.verify_precision,
        "draft_sampling": self.draft_sampling,
        "quant_group": self.quant_group,
        "quantized_cache_bytes": qc.num_bytes(),
        "dense_cache_bytes": dense_bytes,
        "cache_bytes": qc.num_bytes() + dense_bytes,
        "dense_equivalent_cache_bytes": dense_equiv,
        "draft_weight_bytes": weights_bytes(x.draft_params) if x.draft_params is not None else 0,
    }
