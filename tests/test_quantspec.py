"""QuantSpec: the hierarchical quantized cache's double buffer, the 4-bit weights, and the
self-speculative method (greedy "full" == dense greedy; greedy "int8" == a dense decoder whose
cache holds the dequantized INT8 values, on stories260K and SmolLM2; speculative sampling, both
draft modes, distributed as dense sampling)."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rand
import sparsedec
from pallas_kernels.quant_attention import code_planes, dequantize, quantize_kv
from sparsedec import prompts as prompt_sets
from sparsedec import testing
from sparsedec.decode.loop import StepContext, finish_step
from sparsedec.decode.methods import get_method
from sparsedec.decode.quantspec import QuantSpec
from sparsedec.decode.sampling import SamplingConfig, sample, split_keys
from sparsedec.decode.state import DecodeState, append_tokens
from sparsedec.decode.verify import draw_from, speculative_accept, verify_drafted
from sparsedec.errors import InputError
from sparsedec.kv import quantized as qkv
from sparsedec.kv.dense import InflightKV, KVCache
from sparsedec.kv.dense import commit as dense_commit
from sparsedec.model import gptq
from sparsedec.model.forward import forward
from sparsedec.model.quant_weights import quantize_weight

G = 4            # quant group of the cache tests
GAMMA = 3
LAYERS, B, HKV, D, CAP = 2, 2, 2, 8, 64
METHOD = QuantSpec(gamma=3, quant_group=8, weight_group=32)   # stories260K: head_dim 8


# ------------------------------------------------------------------------------------------------
# The quantized cache.
# ------------------------------------------------------------------------------------------------

def _tokens_kv(seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Per layer K, V of CAP token positions: [L, B, Hkv, CAP, D]."""
  rng = np.random.default_rng(seed)
  shape = (LAYERS, B, HKV, CAP, D)
  return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)


def _dense(k, v, lengths) -> KVCache:
  keep = (np.arange(CAP)[None, :] < np.asarray(lengths)[:, None])[None, :, None, :, None]
  return KVCache(k=tuple(jnp.asarray(np.where(keep, k, 0))[i] for i in range(LAYERS)),
                 v=tuple(jnp.asarray(np.where(keep, v, 0))[i] for i in range(LAYERS)),
                 lengths=jnp.asarray(lengths, jnp.int32))


@jax.jit
def _commit_window(cache: qkv.QuantizedCache, k, v, accepted):
  """A gamma window at each row's next positions: the true K/V for the accepted prefix + one,
  garbage for the rejected rest; commit accepted + 1 entries. k, v [L, B, Hkv, CAP, D]."""
  n = cache.lengths
  pos = jnp.minimum(n[:, None] + jnp.arange(GAMMA + 1)[None], CAP - 1)      # [B, W]
  keep = (jnp.arange(GAMMA + 1)[None] <= accepted[:, None])[:, :, None, None]

  def window(x):  # [B, Hkv, CAP, D] -> [B, W, Hkv, D]
    got = jnp.take_along_axis(x, pos[:, None, :, None], axis=2).transpose(0, 2, 1, 3)
    return jnp.where(keep, got, 1e3)                                        # rejected: garbage

  new = InflightKV(tuple(window(k[i]) for i in range(LAYERS)),
                   tuple(window(v[i]) for i in range(LAYERS)))
  return qkv.commit(cache, new, accepted + 1)


def _assert_same_cache(got: qkv.QuantizedCache, want: qkv.QuantizedCache):
  np.testing.assert_array_equal(np.asarray(got.quant_len), np.asarray(want.quant_len))
  np.testing.assert_array_equal(np.asarray(got.buf_len), np.asarray(want.buf_len))
  for layer in range(LAYERS):
    np.testing.assert_array_equal(np.asarray(got.buf_k[layer]), np.asarray(want.buf_k[layer]))
    np.testing.assert_array_equal(np.asarray(got.buf_v[layer]), np.asarray(want.buf_v[layer]))
    a, b = got.codes[layer], want.codes[layer]
    for row in range(B):
      ql = int(got.quant_len[row])
      for got_planes, want_planes in zip(code_planes(a), code_planes(b)):   # [B, Hkv, 2, S, D]
        np.testing.assert_array_equal(np.asarray(got_planes)[row, :, :, :ql],
                                      np.asarray(want_planes)[row, :, :, :ql])
      for name in ("v_scale", "v_zero"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name))[row, :, :ql],
                                      np.asarray(getattr(b, name))[row, :, :ql])
      for name in ("k_scale", "k_zero"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name))[row, :, :ql // G],
                                      np.asarray(getattr(b, name))[row, :, :ql // G])


def test_split_rule_keeps_more_than_g_recent_tokens():
  n = jnp.arange(0, 40)
  ql = np.asarray(qkv.quantized_length(n, G))
  assert (ql % G == 0).all() and (ql >= 0).all()
  recent = np.asarray(n) - ql
  assert (recent[np.asarray(n) > G] >= G + 1).all() and (recent <= 2 * G).all()
  assert (ql[np.asarray(n) <= G] == 0).all()


def test_prefill_quantizes_whole_groups_bit_identical_to_quantize_kv():
  k, v = _tokens_kv(0)
  lengths = [13, 30]
  cache = qkv.from_dense(_dense(k, v, lengths), G)
  # Slots past a row's length hold whatever the dense cache has there (here other tokens' K/V,
  # not zeros): the buffer still holds exactly the row's own tokens, zeros after them.
  stale = qkv.from_dense(KVCache(k=tuple(map(jnp.asarray, k)), v=tuple(map(jnp.asarray, v)),
                                 lengths=jnp.asarray(lengths, jnp.int32)), G)
  for got, want in zip(stale.buf_k + stale.buf_v, cache.buf_k + cache.buf_v):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(cache.quant_len), [8, 24])      # recent: 5 and 6
  direct = quantize_kv(jnp.asarray(k[0]), jnp.asarray(v[0]), group=G)
  for row, n in enumerate(lengths):
    ql = int(cache.quant_len[row])
    for got_planes, want_planes in zip(code_planes(cache.codes[0]), code_planes(direct)):
      np.testing.assert_array_equal(np.asarray(got_planes)[row, :, :, :ql],
                                    np.asarray(want_planes)[row, :, :, :ql])
    np.testing.assert_array_equal(np.asarray(cache.buf_k[0])[row, :, : n - ql], k[0, row, :, ql:n])
    assert not np.asarray(cache.buf_k[0])[row, :, n - ql:].any()


@pytest.mark.parametrize("capacity", [0, 64.0, "64", True])
def test_prefill_refuses_a_quantized_capacity_that_is_not_a_positive_integer(capacity):
  """from_dense's quant_capacity is None (the default) or an integer: 0 was silently taken as
  "the default" (`quant_capacity or ...`), 64.0 failed inside jnp.pad with a TypeError about
  pad_width, "64" with a string-formatting TypeError, True was reported as a capacity of True."""
  k, v = _tokens_kv(0)
  with pytest.raises(InputError, match="quantized capacity must be None"):
    qkv.from_dense(_dense(k, v, [13, 30]), G, quant_capacity=capacity)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, GAMMA), st.integers(0, GAMMA)), min_size=1,
                max_size=12),
       st.integers(1, 9), st.integers(1, 9))
def test_commits_with_any_rejections_equal_decoding_only_the_accepted(pattern, p0, p1):
  """Prefill, then gamma windows rejected at any position (per row): the cache equals (a) the
  same tokens quantized directly and (b) decoding the accepted tokens one at a time."""
  k, v = _tokens_kv(1)
  lengths = np.array([p0, p1], np.int32)
  cache = qkv.from_dense(_dense(k, v, lengths), G)
  for accepted in pattern:
    cache = _commit_window(cache, k, v, jnp.asarray(accepted, jnp.int32))
  total = lengths + np.array([sum(a[r] + 1 for a in pattern) for r in range(B)])
  _assert_same_cache(cache, qkv.from_dense(_dense(k, v, total), G))
  one_by_one = qkv.from_dense(_dense(k, v, [0, 0]), G)
  for _ in range(int(total.max())):
    step = jnp.asarray((np.asarray(one_by_one.lengths) < total).astype(np.int32))
    one_by_one = _commit_one(one_by_one, k, v, step)
  _assert_same_cache(cache, one_by_one)


@jax.jit
def _commit_one(cache, k, v, count):
  n = jnp.minimum(cache.lengths, CAP - 1)
  new = InflightKV(
      tuple(jnp.take_along_axis(k[i], n[:, None, None, None], axis=2).transpose(0, 2, 1, 3)
            for i in range(LAYERS)),
      tuple(jnp.take_along_axis(v[i], n[:, None, None, None], axis=2).transpose(0, 2, 1, 3)
            for i in range(LAYERS)))
  return qkv.commit(cache, new, count)


def test_memory_accounting():
  k, v = _tokens_kv(2)
  cache = qkv.from_dense(_dense(k, v, [20, 20]), G)
  codes = LAYERS * 2 * B * HKV * CAP * D            # two 4-bit planes = D bytes per token, K and V
  meta = LAYERS * B * HKV * (2 * 2 * (CAP // G) * D + 2 * 2 * CAP)
  buffer = LAYERS * 2 * B * HKV * 2 * G * D * 4
  assert cache.num_bytes() == codes + meta + buffer + 2 * B * 4
  assert qkv.bytes_per_token(D, HKV, LAYERS, 4, G) < qkv.bytes_per_token(D, HKV, LAYERS, 8, G)


# ------------------------------------------------------------------------------------------------
# 4-bit weights.
# ------------------------------------------------------------------------------------------------

def test_weight_quantization_round_trip_and_padding():
  w = rand.normal(jax.random.key(0), (172, 24), jnp.float32)
  qw = quantize_weight(w, group=128)
  assert qw.codes.shape == (128, 24) and qw.scale.shape == (2, 24) and qw.shape == (172, 24)
  err = np.abs(np.asarray(qw.dequantize()) - np.asarray(w))
  step = np.repeat(np.asarray(qw.scale, np.float32), 128, axis=0)[:172]
  assert (err <= step * 0.5 + 1e-6).all()
  x = rand.normal(jax.random.key(1), (3, 172))
  from sparsedec.model.linear import linear
  want = jnp.dot(x, qw.dequantize(), precision=jax.lax.Precision.HIGHEST)   # not TF32 on a GPU
  np.testing.assert_allclose(np.asarray(linear(x, qw)), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_weight_grids_ignore_the_padding_and_ties_round_to_the_even_code():
  """A last group padded to `group` rows has the grid of its real rows (the padded rows copy the
  last real row: zero rows would widen a group of positive weights down to 0, a coarser step);
  and a weight exactly halfway between two codes, on a step with no exact fp32 reciprocal
  (fp16 steps near 2.9), gets the even code (round half to even, as numpy's rint of the exact quotient)."""
  from sparsedec.model.quant_weights import group_grid
  w = 2.0 + jnp.abs(rand.normal(jax.random.key(2), (172, 24), jnp.float32))   # all positive
  qw = quantize_weight(w, group=128)
  zero, step = group_grid(w[None, 128:])                                   # the 44 real rows
  np.testing.assert_array_equal(np.asarray(qw.zero[1]), np.asarray(zero[0]))
  np.testing.assert_array_equal(np.asarray(qw.scale[1]), np.asarray(step[0]))
  steps = np.float16(2.9 + 0.037 * np.arange(24)).astype(np.float32)     # [Out] fp16 steps
  halves = (np.arange(15, dtype=np.float32)[:, None] + np.float32(0.5)) * steps   # exact
  ties = np.zeros((32, 24), np.float32)
  ties[1] = 15 * steps                                                     # the grid: 0 + s c
  ties[2:17], ties[17:] = halves, halves[::-1][:15]
  q = quantize_weight(jnp.asarray(ties), group=32)
  np.testing.assert_array_equal(np.asarray(q.scale, np.float32)[0], steps)
  codes = np.rint(ties.astype(np.float64) / steps).astype(np.int32)        # half to even
  np.testing.assert_array_equal(np.asarray(q.dequantize()), codes * steps)


@pytest.mark.parametrize("grid", ["minmax", "absmax"])
def test_weights_past_fp16_range_saturate_instead_of_making_nan_groups(grid):
  """The grids are stored in fp16: a weight past +-65504 made its group's zero and step infinite
  and every weight of the group NaN once dequantized (a QuantSpec draft of NaN logits; its
  sampled drafts were token 0, all accepted). Clipped as the KV quantizer's: the group is finite,
  the big weights saturate at the range's end and the other groups are untouched."""
  w = rand.normal(jax.random.key(0), (64, 8), jnp.float32)
  big = w.at[3, 1].set(-1e5).at[40, 2].set(7e4).at[41, 2].set(-1e6)
  q, ref = quantize_weight(big, group=32, grid=grid), quantize_weight(w, group=32, grid=grid)
  got = np.asarray(q.dequantize())                                          # [64, 8]
  assert np.isfinite(np.asarray(q.scale, np.float32)).all() and np.isfinite(got).all()
  assert got[3, 1] <= -6e4 and (got[40, 2] >= 6e4 or got[41, 2] <= -6e4)
  touched = np.zeros((2, 8), bool)
  touched[0, 1] = touched[1, 2] = True                                     # the groups changed
  keep = ~np.repeat(touched, 32, axis=0)
  np.testing.assert_array_equal(got[keep], np.asarray(ref.dequantize())[keep])


@pytest.mark.parametrize("qtype,grid", [("Q4_1", "minmax"), ("Q4_0", "absmax")])
def test_group_32_reproduces_gguf_4bit_blocks_exactly(qtype, grid):
  """A Q4_1 weight (GGUF: blocks of 32 inputs, w = d q + m, d and m fp16) on the minmax grid and a
  Q4_0 one (w = d (q - 8)) on the absmax grid, quantized at group 32, get back their own grids
  and codes: the draft's weights equal the target's, bit for bit (an all-zero block too)."""
  import gguf
  from gguf import quants
  x = np.asarray(rand.normal(jax.random.key(5), (48, 256))) * np.exp(
      np.asarray(rand.normal(jax.random.key(6), (48, 1))))                # [Out, In], GGUF order
  x[5, 64:96] = 0.0
  t = gguf.GGMLQuantizationType[qtype]
  w = quants.dequantize(quants.quantize(x.astype(np.float32), t), t).T     # [In, Out]
  for layout in ("packed", "int4_t"):
    q = quantize_weight(jnp.asarray(w), group=32, layout=layout, grid=grid)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), w)
  # Not a property of any grid: at group 64, or on the other grid, the weight is not reproduced.
  other = "absmax" if grid == "minmax" else "minmax"
  for group, g in ((64, grid), (32, other)):
    q = quantize_weight(jnp.asarray(w), group=group, grid=g)
    assert np.abs(np.asarray(q.dequantize()) - w).max() > 0, (group, g)
  with pytest.raises(InputError, match="weight grid must be one of"):
    quantize_weight(jnp.asarray(w), group=32, grid="q4_0")


def test_group_32_draft_of_the_q4_1_smollm2_is_its_own_weights(smollm2):
  """SmolLM2's GGUF stores every linear as Q4_1: its group-32 draft has the target's weights
  exactly (first and last layer checked), so the draft differs only by the 4-bit KV view."""
  _, params, _ = smollm2
  for lp in (params["layers"][0], params["layers"][-1]):
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
      w = np.asarray(lp[name])
      q = quantize_weight(jnp.asarray(w), group=32, layout="int4_t")
      np.testing.assert_array_equal(np.asarray(q.dequantize()), w, err_msg=name)


# ------------------------------------------------------------------------------------------------
# The method.
# ------------------------------------------------------------------------------------------------

def _prompts(tok):
  return [tok.encode("Once upon a time, there was a little girl named Lily. She liked to"),
          tok.encode("The dog")]


def test_greedy_full_precision_verify_equals_dense(stories):
  cfg, params, tok = stories
  method = dataclasses.replace(METHOD, verify_precision="full")
  result = testing.assert_matches_dense(cfg, params, _prompts(tok), method=method,
                                        max_new_tokens=256, stop_tokens=())
  assert result.tau > 1.5, result.tau
  stats = result.method_stats
  assert 0.0 < stats["acceptance_rate"] <= 1.0
  assert stats["cache_bytes"] == stats["quantized_cache_bytes"] + stats["dense_cache_bytes"]
  assert stats["dense_cache_bytes"] > 0


def test_a_sliding_window_that_never_binds_runs_and_one_that_would_is_refused(stories):
  """QuantSpec refused every sliding-window model, even a Mistral whose window (4096 by default)
  is longer than the cache: such a window never binds (every key of the run lies within it), so
  the run is the full-attention one (here dense greedy's tokens). A window that could bind is
  refused naming the cache_size that would keep every key within it."""
  cfg, params, tok = stories
  method = dataclasses.replace(METHOD, verify_precision="full")
  kw = dict(max_new_tokens=64, stop_tokens=(), cache_size=96)
  want = sparsedec.generate(cfg, params, _prompts(tok), **kw).tokens
  windowed = cfg.replace(family="mistral", sliding_window=96 + GAMMA + 1)
  assert sparsedec.generate(windowed, params, _prompts(tok), method=method, **kw).tokens == want
  with pytest.raises(InputError, match=r"quantspec cannot apply sliding_window=99: .* capacity "
                                       r"96 plus the step's 4 in-flight tokens \(100\) .* "
                                       r"cache_size \(--cache-size\) <= 95 keeps"):
    sparsedec.generate(windowed.replace(sliding_window=99), params, _prompts(tok), method=method,
                       **kw)


def test_the_default_capacity_is_cut_to_a_sliding_window_that_then_never_binds(stories):
  """Without a cache_size, start's capacity (prompt bucket + max_new_tokens, in 128s) is cut to
  QuantSpec's max_capacity under a sliding window where the run fits in it: 40 + 8 tokens under a
  window of 64 were refused ('the cache capacity 128 plus the step's 4 in-flight tokens (132)
  reach past the window'), though no key of the run can leave the window."""
  from sparsedec.decode.api import start
  cfg, params, _ = stories
  windowed = cfg.replace(family="mistral", sliding_window=64)
  method = dataclasses.replace(METHOD, weight_bits=None)
  state, _ = start(windowed, params, [list(range(1, 41)), [1, 400]], max_new_tokens=8,
                   method=method)
  # the run's keys then always lie within the window: it decodes as full attention (the test
  # above proves that with dense greedy)
  assert state.tokens.shape[1] - 1 == method.max_capacity(windowed) == 60   # [B, capacity + 1]
  assert method.max_capacity(cfg) is None
  # a run longer than that (58 + 8 tokens) is one the window binds: the refusal says so (it
  # advised only a cache_size <= 60, which such a run cannot fit in)
  with pytest.raises(InputError, match=r"cache_size \(--cache-size\) <= 60 keeps .* a longer "
                                       r"run is one the window binds, which quantspec cannot"):
    start(windowed, params, [list(range(1, 59))], max_new_tokens=8, method=method)


def test_the_state_holds_only_the_drafts_4bit_linears(stories):
  """QuantSpec's state keeps the draft's 4-bit linears and nothing else of it: the draft's
  embeddings, norms and lm_head are the target's params, which the step already has (a full
  params pytree in the state held a second full-precision copy of them on the device: embed +
  lm_head, ~2 GiB at Llama-3.1-8B shapes), and draft_weight_bytes counts the 4-bit codes and
  grids only. The output is unchanged (the int8 tests)."""
  from sparsedec.decode.api import start
  from sparsedec.model.quant_weights import QUANTIZED_LINEARS, QuantWeight
  cfg, params, tok = stories
  state, _ = start(cfg, params, _prompts(tok), max_new_tokens=8, stop_tokens=(), method=METHOD)
  leaves = jax.tree.leaves(state.extras.draft_params, is_leaf=lambda x: isinstance(x, QuantWeight))
  assert all(isinstance(x, QuantWeight) for x in leaves), [type(x).__name__ for x in leaves]
  assert len(leaves) == cfg.num_layers * len(QUANTIZED_LINEARS)
  assert METHOD.stats(state)["draft_weight_bytes"] == sum(x.num_bytes() for x in leaves)


def test_dense_equivalent_bytes_are_the_runs_dense_cache(stories):
  """dense_equivalent_cache_bytes is what dense decoding's cache holds for the run: with "full"
  verification exactly the dense cache QuantSpec keeps (dense_cache_bytes), and the same figure
  with "int8". It was computed at the codes' capacity, which rounds the run's capacity up to whole
  quant groups: cache_size 100 at G = 8 counted 104 slots, G = 192 at the default capacity of 128
  counted 384 (1.5x the dense cache)."""
  from sparsedec.decode.api import start
  cfg, params, tok = stories
  for group, cache_size in ((8, 100), (192, None)):
    full = dataclasses.replace(METHOD, quant_group=group, verify_precision="full")
    figures = []
    for method in (full, dataclasses.replace(full, verify_precision="int8")):
      state, _ = start(cfg, params, [tok.encode("A dog")], max_new_tokens=8, stop_tokens=(),
                       method=method, cache_size=cache_size)
      assert state.extras.qcache.quant_capacity > state.tokens.shape[1] - 1   # rounded up
      figures.append(method.stats(state))
      # Each cache counted once: the codes + buffer, plus the dense cache only where "full"
      # keeps one (int8's one placeholder slot is no cache).
      stats = figures[-1]
      assert stats["quantized_cache_bytes"] == state.extras.qcache.num_bytes()
      held = state.cache.num_bytes() if method.verify_precision == "full" else 0
      assert stats["dense_cache_bytes"] == held
      assert stats["cache_bytes"] == stats["quantized_cache_bytes"] + held
    assert figures[0]["dense_equivalent_cache_bytes"] == figures[0]["dense_cache_bytes"] > 0
    assert figures[1]["dense_equivalent_cache_bytes"] == figures[0]["dense_cache_bytes"]


def test_an_exact_draft_is_always_accepted_even_when_the_budget_cuts_the_last_step(stories):
  """Full draft weights and nothing quantized yet (G = 256: the first flush needs 513 tokens), so
  the draft is the target: every draft is accepted, including the last step's, which the budget
  cuts short (31 new tokens = the prefill's + 7 steps of gamma + 1 = 4 + 2 of an 8th step), so
  the acceptance rate is exactly 1 (it was 22 / 24 when the cut step's unused drafts counted as
  proposed), and the cut step's two appended tokens are two accepted drafts: 7 * 3 + 2 in all
  (it counted one, as if the last appended token were the target's own)."""
  cfg, params, tok = stories
  method = QuantSpec(gamma=3, quant_group=256, weight_bits=None, verify_precision="full")
  result = testing.assert_matches_dense(cfg, params, _prompts(tok)[:1], method=method,
                                        max_new_tokens=31, stop_tokens=())
  stats = result.method_stats
  assert stats["acceptance_rate"] == 1.0, stats
  assert result.tau == pytest.approx(30 / 8), result.tau      # 7 full steps of 4, then 2 tokens
  assert stats["accepted_drafts_per_step"] == pytest.approx((7 * 3 + 2) / 8), stats


@dataclasses.dataclass(frozen=True)
class DequantizedInt8Dense:
  """The int8 reference: dense one-token steps whose forward reads slots < quantized_length(N)
  as the dequantized INT8 values of `quantize_kv` (the raw K/V are what is committed)."""
  group: int
  name: str = "dequantized_int8_dense"

  def init(self, cfg, params, state):
    return state

  def max_steps(self, max_new_tokens):
    return max_new_tokens

  def stats(self, state):
    return {}

  def step(self, cfg, params, state: DecodeState, ctx: StepContext) -> DecodeState:
    active = (~state.done).astype(jnp.int32)
    cache = state.cache
    ql = qkv.quantized_length(cache.lengths, self.group)
    old = (jnp.arange(cache.capacity)[None, :] < ql[:, None])[:, None, :, None]   # [B,1,S,1]
    ks, vs = [], []
    for k, v in zip(cache.k, cache.v):
      dk, dv = dequantize(quantize_kv(k, v, group=self.group), 8, dtype=k.dtype)
      ks.append(jnp.where(old, dk, k))
      vs.append(jnp.where(old, dv, v))
    read = KVCache(k=tuple(ks), v=tuple(vs), lengths=cache.lengths)
    logits, kv = forward(cfg, params, state.last_tokens(), cache.lengths[:, None], read)
    keys, step_keys = split_keys(state.keys)
    nxt = sample(logits[:, 0], step_keys, ctx.sampling)
    state = finish_step(state.replace(cache=dense_commit(cache, kv, active), keys=keys))
    state, _ = append_tokens(state, nxt[:, None], active, ctx.stop_ids)
    return state


def test_greedy_int8_verify_equals_dequantized_int8_dense(stories):
  cfg, params, tok = stories
  prompts = _prompts(tok)
  ref = sparsedec.generate(cfg, params, prompts, max_new_tokens=256, stop_tokens=(),
                           method=DequantizedInt8Dense(group=METHOD.quant_group))
  got = sparsedec.generate(cfg, params, prompts, max_new_tokens=256, stop_tokens=(),
                           method=METHOD)
  assert got.tokens == ref.tokens
  assert got.tau > 1.5, got.tau
  stats = got.method_stats
  assert stats["dense_cache_bytes"] == 0          # the codes replace the dense cache
  assert stats["cache_bytes"] < stats["dense_equivalent_cache_bytes"]


def test_int8_verification_run_shows_no_donation_warning(stories):
  """The int8 method replaces the donated dense cache with codes (XLA frees the buffers it cannot
  reuse); a user's run must not show jax's "donated buffers were not usable" warning. The jitted
  init's cache is cleared first: jax warns while lowering, which an earlier test of the same
  shapes would otherwise have done already. The run has the shapes of the int8 greedy test above
  (its prompts, 256 tokens), so the decode loop compiled there is reused and only the init is
  lowered again (the loop returns the state it is given, so its donation cannot fail; run alone,
  this test lowers it too)."""
  from sparsedec.decode import loop
  cfg, params, tok = stories
  loop._init_method.clear_cache()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = sparsedec.generate(cfg, params, _prompts(tok), max_new_tokens=256, stop_tokens=(),
                             method=METHOD)
  assert [len(t) for t in got.tokens] == [256, 256]
  donated = [str(w.message) for w in caught if "donated buffers" in str(w.message)]
  assert not donated, donated


def test_only_a_method_that_drops_the_dense_cache_has_the_donation_warning_hidden(stories):
  """init_method hides jax's donation warning only where it is expected: QuantSpec with int8
  verification returns no dense K/V (donated buffers without an output to become); with full
  verification and for dense decoding every donated buffer has one, so a warning there would
  still show."""
  from sparsedec.decode import loop
  from sparsedec.decode.api import start
  cfg, params, tok = stories
  state, _ = start(cfg, params, [tok.encode("A dog ran")], max_new_tokens=8)
  drops = lambda method: loop.drops_donated_buffers(cfg, params, state, method=method)
  assert drops(METHOD)                                         # int8 verification
  assert not drops(dataclasses.replace(METHOD, verify_precision="full"))
  assert not drops(get_method("dense"))


def test_bad_knobs_are_refused_by_name(stories):
  cfg, params, _ = stories
  with pytest.raises(InputError, match="gamma"):
    QuantSpec(gamma=0)
  with pytest.raises(InputError, match="verify_precision"):
    QuantSpec(verify_precision="fp16")
  with pytest.raises(InputError, match="quant_group"):
    QuantSpec(gamma=8, quant_group=4)
  # A group the 64-token value tiles cannot hold is refused when built, whatever the capacity
  # (from_dense alone refuses it only at capacities that are a multiple of 64).
  for group in (24, 48, 96):
    with pytest.raises(InputError, match="quant_group must divide 64 or be a multiple of 64"):
      QuantSpec(quant_group=group)
  assert all(QuantSpec(quant_group=g).quant_group == g for g in (8, 64, 192))
  with pytest.raises(InputError, match="weight_bits"):
    QuantSpec(weight_bits=3)
  with pytest.raises(InputError, match="draft_sampling"):
    QuantSpec(draft_sampling="greedy")
  with pytest.raises(InputError, match="weight_layout"):
    QuantSpec(weight_layout="int3")
  with pytest.raises(InputError, match="weight_grid must be one of"):
    QuantSpec(weight_grid="q4_0")
  with pytest.raises(InputError, match="multiple of 64"):
    QuantSpec(weight_layout="int4_t", weight_group=48)
  assert QuantSpec(weight_layout="int4_t", weight_group=32).resolved_weight_layout() == "int4_t"
  on_gpu = jax.default_backend() == "gpu"                         # "auto": the GEMV's layout there
  assert QuantSpec().resolved_weight_layout() == ("int4_t" if on_gpu else "packed")
  assert QuantSpec(weight_group=48).resolved_weight_layout() == "packed"   # no GEMV at 48
  assert QuantSpec(weight_layout="int4_t").resolved_weight_layout() == "int4_t"
  with pytest.raises(InputError, match="knob 'window'"):
    get_method("quantspec", window=3)
  with pytest.raises(InputError, match="sliding"):
    sparsedec.generate(cfg.replace(family="mistral", sliding_window=16), params, [[1, 2, 3]],
                       max_new_tokens=12, method=METHOD)     # 15 tokens: past 16 - 4 in flight


def test_numpy_integer_knobs_build_the_same_draft(stories):
  """QuantSpec accepts numpy integers for its integer knobs (`errors.is_int`, e.g. from a sweep
  over np.arange): its draft is then built as with Python ints (the weight quantizer refused
  np.int64(32) inside QuantSpec.init with "must be an even integer >= 2, got np.int64(32)")."""
  _, params, _ = stories
  method = QuantSpec(gamma=np.int64(3), quant_group=np.int64(8), weight_group=np.int64(32))
  want = METHOD._draft_params(params)
  jax.tree.map(np.testing.assert_array_equal, method._draft_params(params), want)
  w = params["layers"][0]["w_down"]
  jax.tree.map(np.testing.assert_array_equal, quantize_weight(w, np.int64(32), "int4_t"),
               quantize_weight(w, 32, "int4_t"))


def test_auto_weight_layout_follows_the_params_platform(stories, monkeypatch):
  """weight_layout "auto" is chosen for the platform of the params' devices, not the default
  backend: params on the CPU of a GPU host get the CPU's "packed" draft (the default backend is
  made to say "gpu" here). The state and run keep the method as given."""
  from sparsedec.decode import api
  from sparsedec.model.quant_weights import QuantWeight
  cfg, params, tok = stories
  params = jax.device_put(params, jax.devices("cpu")[0])              # committed to the CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert METHOD.resolved_weight_layout() == "int4_t"                  # what "auto" took before
  assert METHOD.init_key("cpu").weight_layout == "packed"
  assert METHOD.init_key("gpu").weight_layout == "int4_t"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")       # attention's "runs the jnp reference on this GPU"
    state, run = api.start(cfg, params, [tok.encode("Once upon")], method=METHOD,
                           max_new_tokens=4, stop_tokens=(), cache_size=128)
  weights = jax.tree.leaves(state.extras.draft_params,
                            is_leaf=lambda x: isinstance(x, QuantWeight))
  assert weights and {w.layout for w in weights} == {"packed"}
  assert state.built_for[0] == run.method == METHOD


def test_draft_sampling_does_not_recompile_the_init(stories):
  """The init does not read draft_sampling (only the step does): a run that changes only it
  compiles no new init (the jitted init took the whole method as its static key: 2-5 s of
  compile on stories260K for a knob it never read). The state and run keep the run's method."""
  from sparsedec.decode import api
  cfg, params, tok = stories
  kw = dict(max_new_tokens=4, stop_tokens=(), cache_size=128,
            sampling=SamplingConfig(temperature=1.0))
  api.start(cfg, params, [tok.encode("Once upon")], method=METHOD, **kw)
  argmax = dataclasses.replace(METHOD, draft_sampling="argmax")
  compiles = []

  def listener(event: str, duration: float, **kwargs) -> None:
    if "backend_compile" in event:
      compiles.append(kwargs.get("fun_name"))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    state, run = api.start(cfg, params, [tok.encode("Once upon")], method=argmax, **kw)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == [], f"recompiled: {compiles}"
  assert state.built_for[0] == run.method == argmax


def test_cli_knobs(capsys):
  from sparsedec import cli
  assert cli.main(["generate", "--prompt", "Once", "--gamma", "2"]) == 2
  assert "--gamma does not apply to --method dense" in capsys.readouterr()[1]
  assert cli.main(["generate", "--prompt", "Once", "--method", "quantspec", "--gamma", "9",
                   "--quant-group", "8"]) == 2
  assert "quant_group" in capsys.readouterr()[1]
  args = cli._parser().parse_args(["generate", "--prompt", "Once", "--method", "quantspec",
                                   "--draft-sampling", "argmax"])
  assert cli._method(args) == QuantSpec(draft_sampling="argmax")
  assert cli.main(["generate", "--prompt", "Once", "--draft-sampling", "argmax"]) == 2
  assert "--draft-sampling does not apply to --method dense" in capsys.readouterr()[1]
  with pytest.raises(SystemExit):
    cli.main(["generate", "--prompt", "Once", "--method", "quantspec", "--draft-sampling", "x"])
  args = cli._parser().parse_args(["generate", "--prompt", "Once", "--method", "quantspec",
                                   "--draft-weight-group", "64"])
  assert cli._method(args) == QuantSpec(weight_group=64)
  assert cli.main(["generate", "--prompt", "Once", "--method", "quantspec",
                   "--draft-weight-group", "7"]) == 2
  assert "weight_group must be even" in capsys.readouterr()[1]
  assert cli.main(["generate", "--prompt", "Once", "--draft-weight-group", "64"]) == 2
  assert "--draft-weight-group does not apply to --method dense" in capsys.readouterr()[1]


def test_cli_drafts_a_q4_1_gguf_with_its_own_weights(capsys, smollm2_gguf):
  """QuantSpec from the CLI on a GGUF whose linears are all Q4_1 takes weight_group 32 (noted on
  stderr) unless --draft-weight-group is given; other methods and sources are untouched."""
  from sparsedec import cli

  def method(*extra):
    args = cli._parser().parse_args(["generate", "--prompt", "Once", *extra])
    return cli._exact_draft_group(args, cli._method(args))

  gguf_qs = ["--model", str(smollm2_gguf), "--method", "quantspec"]
  assert method(*gguf_qs) == QuantSpec(weight_group=32)
  assert "weight_group=32, weight_grid=minmax" in capsys.readouterr()[1]
  assert method(*gguf_qs, "--draft-weight-group", "64") == QuantSpec(weight_group=64)
  assert method(*gguf_qs, "--draft-weight-grid", "absmax") == QuantSpec(weight_grid="absmax")
  assert method(*gguf_qs, "--gamma", "2") == QuantSpec(gamma=2, weight_group=32)
  capsys.readouterr()
  assert method("--model", str(smollm2_gguf)).name == "dense"
  assert method("--method", "quantspec") == QuantSpec()          # stories260K, an HF dir
  assert "weight_group" not in capsys.readouterr()[1]


def test_cli_gptq_draft_takes_no_grid_it_cannot_hold(capsys, tmp_path, monkeypatch,
                                                    smollm2_gguf):
  """A GPTQ draft (--draft-calibration) has its own codes on the minmax grid: the CLI's exact-draft
  choice for a 4-bit GGUF (round to nearest at group 32 on the file's grid) does not apply to it,
  and an explicit --draft-weight-grid absmax is refused by name. On an all-Q4_0 file the CLI set
  weight_grid=absmax, said the draft used "the checkpoint's own weights, exactly", then built a
  minmax GPTQ draft: neither the message nor the run's method_config was true."""
  from sparsedec import cli
  from sparsedec.errors import InputError
  from sparsedec.weights import gguf_file
  text = tmp_path / "calibration.txt"
  text.write_text("Once upon a time there was a dog.")
  gguf = ["generate", "--prompt", "Once", "--model", str(smollm2_gguf), "--method", "quantspec"]

  def method(*extra):
    args = cli._parser().parse_args([*gguf, *extra])
    return args, cli._exact_draft_group(args, cli._method(args))

  monkeypatch.setattr(gguf_file, "exact_4bit_grid", lambda path: (32, "absmax"))   # all Q4_0
  assert method()[1] == QuantSpec(weight_group=32, weight_grid="absmax")          # RTN: exact
  assert "weight_grid=absmax" in capsys.readouterr()[1]
  for flag in ("--draft-calibration", "--draft-calibration-prompts"):
    args, got = method(flag, str(text))
    assert got == QuantSpec(), flag
    assert "exactly" not in capsys.readouterr()[1]
    assert cli._draft_tokens(args, got) == cli.DEFAULT_CALIBRATION_TOKENS
  args, got = method("--draft-calibration", str(text), "--draft-weight-grid", "absmax")
  with pytest.raises(InputError, match="--draft-weight-grid absmax .* round-to-nearest"):
    cli._draft_tokens(args, got)
  args, got = method("--draft-calibration", str(text), "--draft-weight-grid", "minmax")
  assert cli._draft_tokens(args, got) == cli.DEFAULT_CALIBRATION_TOKENS


def test_int8_view_logits_equal_the_dequantized_reference_across_a_flush(stories):
  """Teacher-forced logits: a verify window read through QuantView(bits=8) equals, query by
  query, a forward over a dense cache whose slots < quantized_length(position) hold the INT8
  values, including a window crossing the next flush (row 0); and the quantization is real (the
  logits differ from full precision). The 4-bit draft read with its in-flight scratch equals the
  same window run as one forward."""
  from sparsedec.attention import AttentionPlan, QuantView, Segment, causal_plan
  cfg, params, tok = stories
  g, t = METHOD.quant_group, METHOD.gamma + 1
  fwd = jax.jit(forward, static_argnums=0)
  dense = sparsedec.generate(cfg, params, _prompts(tok), max_new_tokens=256, stop_tokens=(),
                             return_state=True).state.cache   # compiled as in the tests above
  lengths = jnp.asarray([30, 25], jnp.int32)     # row 0: position 33 reads one more group
  raw = dense.replace(lengths=lengths)
  qc = qkv.from_dense(raw, g)
  window = rand.randint(jax.random.key(3), (2, t), 0, cfg.vocab_size)
  positions = lengths[:, None] + jnp.arange(t)[None]
  assert int(qkv.quantized_length(positions[0, -1], g)) > int(qc.quant_len[0])
  plan = causal_plan(t)
  got, _ = fwd(cfg, params, window, positions, raw, AttentionPlan(
      plan.inflight_mask, (Segment(QuantView(qc, bits=8), 0, t),)))
  full, _ = fwd(cfg, params, window, positions, raw)
  committed = raw               # the reference: one token per step, each reading INT8 below
  for i in range(t):            # quantized_length(its position), committing raw K/V
    ql = qkv.quantized_length(positions[:, i], g)
    old = (jnp.arange(raw.capacity)[None, :] < ql[:, None])[:, None, :, None]
    deq = [dequantize(quantize_kv(k, v, group=g), 8) for k, v in zip(committed.k, committed.v)]
    read = committed.replace(k=tuple(jnp.where(old, d[0], k) for d, k in zip(deq, committed.k)),
                             v=tuple(jnp.where(old, d[1], v) for d, v in zip(deq, committed.v)))
    want, kv = fwd(cfg, params, window[:, i:i + 1], positions[:, i:i + 1], read)
    committed = dense_commit(committed, kv, jnp.ones((2,), jnp.int32))
    np.testing.assert_allclose(np.asarray(got[:, i]), np.asarray(want[:, 0]), atol=5e-5)
  assert np.abs(np.asarray(got - full)).max() > 1e-4

  # 4-bit: one window forward == token by token with the in-flight scratch (QuantView.extra)
  whole, _ = fwd(cfg, params, window, positions, raw, AttentionPlan(
      plan.inflight_mask, (Segment(QuantView(qc, bits=4), 0, t),)))
  shape = (2, t, cfg.num_kv_heads, cfg.head_dim)
  # Committed as the updated scratch is (an uncommitted first one compiled the forward twice).
  ek = [jax.device_put(jnp.zeros(shape), raw.k[0].sharding) for _ in range(cfg.num_layers)]
  ev = [jax.device_put(jnp.zeros(shape), raw.k[0].sharding) for _ in range(cfg.num_layers)]
  for i in range(t):
    view = QuantView(qc, tuple(ek), tuple(ev), jnp.full((2,), i, jnp.int32), bits=4)
    one, kv = fwd(cfg, params, window[:, i:i + 1], positions[:, i:i + 1], raw,
                      AttentionPlan(jnp.ones((1, 1), bool), (Segment(view, 0, 1),)))
    np.testing.assert_allclose(np.asarray(one[:, 0]), np.asarray(whole[:, i]), atol=5e-5)
    ek = [e.at[:, i].set(k[:, 0]) for e, k in zip(ek, kv.k)]
    ev = [e.at[:, i].set(v[:, 0]) for e, v in zip(ev, kv.v)]
  assert np.abs(np.asarray(whole - got)).max() > 1e-4     # 4 bits really read less


# ------------------------------------------------------------------------------------------------
# Speculative sampling (draft_sampling="sample", Leviathan et al.): the accept / residual rule.
# ------------------------------------------------------------------------------------------------

def _toy_pairs(v: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
  """(p, q) over v tokens: random; different top-k-like supports; p == q; q one-hot (a
  deterministic guess); disjoint supports."""
  rng = np.random.default_rng(0)

  def dist(zeros=()):
    x = rng.dirichlet(np.full(v, 0.8))
    x[list(zeros)] = 0.0
    return x / x.sum()

  same = dist()
  return [(dist(), dist()), (dist((0, 1)), dist((5, 6))), (dist((2,)), dist((0, 1, 2, 3))),
          (same, same), (dist(), np.eye(v)[3]), (dist((0, 1, 2)), dist((3, 4, 5, 6)))]


def _one_step_law(q: np.ndarray, alpha: np.ndarray, residual: np.ndarray) -> np.ndarray:
  """Exact law [V] of the token one step emits: the draft d ~ q is kept with probability
  alpha[d], else the token is drawn from the residual [V]."""
  return q * alpha + np.sum(q * (1.0 - alpha)) * residual


def test_accept_residual_step_reproduces_the_target_exactly():
  """For every draft token d, `speculative_accept` gives min(1, p(d)/q(d)) and norm(max(0, p-q));
  the exact law of the emitted token (summed over d ~ q) is p to 1e-6. Wrong rules (always
  accept; accept with p(d) as for a deterministic guess; residual p instead of p - q) miss p by
  far more, so the comparison can fail."""
  for p, q in _toy_pairs():
    v = len(p)
    alpha, residual = speculative_accept(jnp.asarray(np.tile(p, (v, 1)), jnp.float32),
                                         jnp.asarray(np.tile(q, (v, 1)), jnp.float32),
                                         jnp.arange(v))                   # [V] per d, [V, V]
    alpha, residual = np.asarray(alpha, np.float64), np.asarray(residual, np.float64)
    assert np.allclose(residual, residual[:1])                     # the residual ignores d
    np.testing.assert_allclose(_one_step_law(q, alpha, residual[0]), p, rtol=0, atol=1e-6)
  p, q = _toy_pairs()[0]
  wrong = [_one_step_law(q, np.ones_like(p), p), _one_step_law(q, p, p),
           _one_step_law(q, np.minimum(1.0, p / q), p)]
  assert all(np.abs(w - p).max() > 1e-2 for w in wrong)


def test_a_nan_draft_distribution_rejects_its_token_and_the_token_comes_from_the_target():
  """A draft of NaN weights (a user's draft layers with a NaN scale, `gptq.with_draft`) gives a
  NaN q: draw_from picks token 0 from it, and speculative_accept took q(0) = NaN as 0 and
  accepted it (probability 1 where p(0) > 0): QuantSpec sampling emitted token 0 gamma times a
  step, acceptance rate 1.0, where dense sampling draws from p. Now the token is rejected and
  the emitted one drawn from p, whatever the draft token."""
  p, _ = _toy_pairs()[0]
  v = len(p)
  q = np.full((v, v), np.nan, np.float32)
  q[1:, 1:] = _toy_pairs()[0][1][1:] / _toy_pairs()[0][1][1:].sum()   # one NaN in rows 1..
  alpha, residual = speculative_accept(jnp.asarray(np.tile(p, (v, 1)), jnp.float32),
                                       jnp.asarray(q), jnp.arange(v))
  np.testing.assert_array_equal(np.asarray(alpha), np.zeros(v))
  np.testing.assert_allclose(np.asarray(residual), np.tile(p, (v, 1)), rtol=1e-6)
  # A chain of 2 NaN drafts: nothing accepted, the token drawn from p_1 by its inverse CDF.
  target = jnp.asarray(np.tile(p, (1, 3, 1)), jnp.float32)                    # [1, 3, V]
  verdict = verify_drafted(target, jnp.zeros((1, 2), jnp.int32),
                           jnp.full((1, 2, v), jnp.nan, jnp.float32), jnp.ones((1,), bool),
                           jnp.asarray([[0.0, 0.0, 0.999]], jnp.float32))
  assert int(verdict.num_tokens[0]) == 1 and int(verdict.accepted[0]) == 0
  assert int(verdict.tokens[0, 0]) == int(np.argmax(np.cumsum(p) > 0.999 * p.sum()))


@jax.jit
def _speculate_toy_chain(p, q, key, accept_all):
  """The first 3 tokens of 3 speculative steps (gamma 3) of a toy Markov target P [V, V] with a
  Markov draft Q [V, V], from token 0, for 20000 rows; accept_all: acceptance uniforms 0 (a
  wrong rule: keep every draft the target gives mass)."""
  rows, gamma = 20_000, 3
  out = jnp.zeros((rows, 3 * (gamma + 1)), jnp.int32)
  n = jnp.zeros((rows,), jnp.int32)
  cur = jnp.zeros((rows,), jnp.int32)
  for _ in range(3):                             # each step emits >= 1 token
    key, sub = jax.random.split(key)
    u = jax.random.uniform(sub, (rows, 2 * gamma + 1))
    drafts, qs, prev = [], [], cur
    for i in range(gamma):
      qs.append(q[prev])
      prev = draw_from(q[prev], u[:, i])
      drafts.append(prev)
    drafts = jnp.stack(drafts, axis=1)                                     # [R, gamma]
    chain = jnp.concatenate([cur[:, None], drafts], axis=1)                # [R, gamma + 1]
    tests = jnp.where(accept_all, 0.0, u[:, gamma:2 * gamma])
    verdict = verify_drafted(p[chain], drafts, jnp.stack(qs, axis=1), jnp.ones((rows,), bool),
                             jnp.concatenate([tests, u[:, -1:]], axis=1))
    col = jnp.arange(gamma + 1)[None]
    pos = jnp.where(col < verdict.num_tokens[:, None], n[:, None] + col, out.shape[1])
    out = out.at[jnp.arange(rows)[:, None], pos].set(verdict.tokens, mode="drop")
    cur = verdict.tokens[jnp.arange(rows), verdict.num_tokens - 1]
    n = n + verdict.num_tokens
  return out[:, :3]


def test_verify_drafted_chain_has_the_target_law_on_a_toy_markov_model():
  """`verify_drafted` over whole steps (sampled drafts, target rows following the drafted
  chain): the joint law of the first 3 emitted tokens is the target chain's, chi-square
  goodness of fit at false-alarm rate alpha = 1e-3; the same statistic rejects the
  always-accept rule."""
  from scipy import stats
  v = 4
  rng = np.random.default_rng(1)
  p = rng.dirichlet(np.full(v, 0.7), size=v)
  q = rng.dirichlet(np.full(v, 0.7), size=v)
  exact = (p[0][:, None, None] * p[:, :, None] * p[None]).reshape(-1)     # P(a, b, c | 0)
  pvalues = []
  for accept_all in (False, True):
    first3 = np.asarray(_speculate_toy_chain(jnp.asarray(p, jnp.float32),
                                             jnp.asarray(q, jnp.float32), jax.random.key(0),
                                             accept_all))
    counts = np.bincount(first3 @ np.array([v * v, v, 1]), minlength=v ** 3)
    expected = exact * len(first3)
    common = expected >= 5                       # pool the rare cells (chi-square validity)
    observed = np.append(counts[common], counts[~common].sum())
    pvalues.append(stats.chisquare(observed, np.append(expected[common],
                                                       expected[~common].sum())).pvalue)
  assert pvalues[0] > 1e-3 and pvalues[1] < 1e-6, pvalues


def test_all_drafts_accepted_draws_the_bonus_token_from_the_last_target_row():
  """When every draft is accepted the last token is drawn from p_{L+1} (the target after the last
  draft), not p_L: the toy chain test above looks at the first 3 tokens only, where no bonus token
  of a gamma 3 step lands. q = p (every draft accepted with probability 1), each p_i a point mass
  on its own token."""
  v, length = 8, 3
  p = jnp.asarray(np.eye(v)[[1, 2, 3, 5]][None], jnp.float32)              # [1, L + 1, V]
  drafts = jnp.asarray([[1, 2, 3]], jnp.int32)
  for u in (0.0, 0.5, 0.999):
    verdict = verify_drafted(p, drafts, p[:, :length], jnp.ones((1,), bool),
                             jnp.full((1, length + 1), u, jnp.float32))
    assert int(verdict.accepted[0]) == length and int(verdict.num_tokens[0]) == length + 1
    assert np.asarray(verdict.tokens)[0].tolist() == [1, 2, 3, 5]


# ------------------------------------------------------------------------------------------------
# Sampling on stories260K: QuantSpec ("full") vs dense.
# ------------------------------------------------------------------------------------------------

SAMPLE_ROWS = 600
SAMPLING = SamplingConfig(temperature=1.6, top_k=12, top_p=0.95)


@pytest.fixture(scope="module")
def stories_sampled(stories):
  """A prompt and dense sampling's tokens over SAMPLE_ROWS per-row seeds (0 ..), shared by the
  two draft modes below."""
  cfg, params, tok = stories
  prompt = tok.encode("Lily and Tom went to the park. Lily and Tom went to the")
  dense = sparsedec.generate(cfg, params, [prompt] * SAMPLE_ROWS, max_new_tokens=3,
                             sampling=SAMPLING, seed=list(range(SAMPLE_ROWS)), stop_tokens=())
  return prompt, dense


@pytest.mark.parametrize("draft_sampling", ["sample", "argmax"])
def test_sampling_first_three_tokens_distributed_as_dense(stories, stories_sampled,
                                                          draft_sampling):
  """Joint law of the first 3 sampled tokens (temperature 1.6, top-k 12, top-p 0.95) over many
  per-row seeds, QuantSpec ("full") vs dense: chi-square test of homogeneity, false-alarm rate
  alpha = 1e-3 (`testing.assert_sampling_matches_dense`). "sample": Leviathan drafts drawn from
  q, accepted with min(1, p/q); "argmax": deterministic guesses."""
  cfg, params, _ = stories
  prompt, dense = stories_sampled
  method = dataclasses.replace(METHOD, verify_precision="full", draft_sampling=draft_sampling)
  got = testing.assert_sampling_matches_dense(cfg, params, prompt, method=method,
                                              sampling=SAMPLING, rows=SAMPLE_ROWS,
                                              expected=dense, stop_tokens=())
  stats = got.result.method_stats
  assert stats["draft_sampling"] == draft_sampling
  assert stats["accepted_drafts_per_step"] > 0.2                 # drafts really were accepted
  assert 0.0 < stats["acceptance_rate"] <= 1.0
  assert got.table.shape[1] >= 5, got.table                     # a spread-out law


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (fp32): MT-Bench and HumanEval prompts, flushes within the generation.
# ------------------------------------------------------------------------------------------------

SMOL = QuantSpec(gamma=4, quant_group=32)     # a flush every 32 tokens; the 4-bit draft


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2):
  """An MT-Bench chat turn and a HumanEval prompt (others than test_fafo's)."""
  _, _, tok = smollm2
  chat = tok.apply_chat_template([{"role": "user", "content": prompt_sets.mt_bench()[1]}],
                                 add_generation_prompt=True)
  return [tok.encode(chat, add_bos=False), tok.encode(prompt_sets.humaneval()[1])]


@pytest.fixture(scope="module")
def smollm2_dense(smollm2, smollm2_prompts):
  """Dense greedy's 256 tokens on smollm2_prompts (one batch): the reference of the two
  full-precision tests below (the second compares its first 64 tokens), computed once."""
  cfg, params, _ = smollm2
  return sparsedec.generate(cfg, params, smollm2_prompts, max_new_tokens=256,
                            stop_tokens=()).tokens


def _assert_flushed_while_generating(result, prompts, new_tokens: int):
  """Each row holds as codes all but the last < 3G tokens: groups were flushed during decoding
  (prefill quantized fewer than its prompt's length)."""
  g = SMOL.quant_group
  quantized = np.asarray(result.state.extras.qcache.quant_len)
  for n, ql in zip(map(len, prompts), quantized.tolist()):
    assert ql >= n + new_tokens - 3 * g > n, (ql, n)


def test_greedy_full_precision_verify_equals_dense_on_smollm2(smollm2, smollm2_prompts,
                                                             smollm2_dense):
  """256 tokens, both prompts in one batch, a GPTQ draft proposing (4-bit cache and 4-bit weights;
  act-order, sequential, calibrated on the model's own answer to another MT-Bench prompt) and the
  full-precision cache verifying: token-identical to dense greedy, with drafts both accepted and
  rejected and groups flushed to codes while decoding. (The RTN weight draft runs in the int8
  test below.)"""
  cfg, params, tok = smollm2
  chat = tok.apply_chat_template([{"role": "user", "content": prompt_sets.mt_bench()[40]}],
                                 add_generation_prompt=True)
  calibration = gptq.self_generated_calibration(cfg, params, [tok.encode(chat, add_bos=False)],
                                                max_new_tokens=96)
  draft = gptq.gptq_quantize_params(cfg, params, calibration, group=SMOL.weight_group)
  method = dataclasses.replace(SMOL, verify_precision="full")
  result = testing.assert_matches_dense(cfg, gptq.with_draft(params, draft), smollm2_prompts,
                                        method=method, max_new_tokens=256, stop_tokens=(),
                                        expected=smollm2_dense, return_state=True)
  assert result.tau > 1.5, result.tau
  assert result.method_stats["acceptance_rate"] < 1.0        # some drafts were rejected
  _assert_flushed_while_generating(result, smollm2_prompts, 256)


def test_group_32_draft_of_the_q4_1_smollm2_is_always_accepted(smollm2, smollm2_prompts,
                                                              smollm2_dense):
  """The group-32 RTN draft of the Q4_1 SmolLM2 has the target's weights exactly; on chats short
  enough to stay in the full-precision buffer (2G = 256 slots) it is the target itself: every draft
  accepted, and the output token-identical to dense greedy (a draft off by any weight would be
  rejected somewhere in 64 tokens, as the GPTQ group-128 draft is in the test above). The prompts
  and the dense reference (its first 64 tokens) are the test above's."""
  cfg, params, _ = smollm2
  method = QuantSpec(gamma=4, weight_group=32, verify_precision="full")   # G = 128
  assert all(len(p) + 64 < 2 * method.quant_group for p in smollm2_prompts)
  result = testing.assert_matches_dense(cfg, params, smollm2_prompts, method=method,
                                        max_new_tokens=64, stop_tokens=(),
                                        expected=[t[:64] for t in smollm2_dense])
  assert result.method_stats["acceptance_rate"] == 1.0, result.method_stats


def test_greedy_int8_verify_equals_dequantized_int8_dense_on_smollm2(smollm2, smollm2_prompts):
  """Both prompts in one batch, 128 tokens (4 flushes), the default 4-bit weight draft. (The
  MT-Bench row brings the rejections: on the HumanEval prompt alone this draft is accepted every
  time over 128 tokens.)"""
  cfg, params, _ = smollm2
  prompts = smollm2_prompts
  ref = sparsedec.generate(cfg, params, prompts, max_new_tokens=128, stop_tokens=(),
                           method=DequantizedInt8Dense(group=SMOL.quant_group))
  got = sparsedec.generate(cfg, params, prompts, max_new_tokens=128, stop_tokens=(),
                           method=SMOL, return_state=True)
  testing.assert_tokens_equal(got.tokens, ref.tokens, label="quantspec int8")
  assert got.tau > 1.5, got.tau
  assert got.method_stats["dense_cache_bytes"] == 0
  assert 0.0 < got.method_stats["acceptance_rate"] < 1.0
  _assert_flushed_while_generating(got, prompts, 128)


def test_layers_quantized_as_one_batch_equal_one_layer_at_a_time():
  """stacked_cf1 + quantize_planes + unstacked (the flush's and the tails' batching) gives each
  layer the planes of quantizing its own CF1 alone, in layer order."""
  from pallas_kernels.quant_attention import quantize_planes
  g, rng = 16, np.random.default_rng(5)
  bufs = [jnp.asarray(rng.normal(scale=1 + i, size=(2, 2, 2 * g, 8)).astype(np.float32))
          for i in range(3)]
  per_layer = qkv.unstacked(quantize_planes(qkv.stacked_cf1(bufs, g), qkv.stacked_cf1(bufs, g),
                                            g), len(bufs))
  assert len(per_layer) == len(bufs)
  for buf, got in zip(bufs, per_layer):
    want = quantize_planes(buf[:, :, :g], buf[:, :, :g], g)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_flushing_whole_value_tiles_equals_quantizing_directly():
  """G = 64 (a whole 64-token value tile per group, the kernel's fragment-order storage): a flush
  through commits writes the same codes as quantizing the tokens directly; and a G that neither
  divides nor is a multiple of the value tile is refused."""
  g, n_tok, step = 64, 256, 16
  rng = np.random.default_rng(3)
  k = jnp.asarray(rng.normal(size=(1, 2, n_tok, 8)).astype(np.float32))
  v = jnp.asarray(rng.normal(size=(1, 2, n_tok, 8)).astype(np.float32))

  def dense(n):
    keep = (jnp.arange(n_tok) < n)[None, None, :, None]
    return KVCache(k=(jnp.where(keep, k, 0),), v=(jnp.where(keep, v, 0),),
                   lengths=jnp.array([n], jnp.int32))

  cache = qkv.from_dense(dense(100), g, quant_capacity=n_tok)
  assert int(cache.quant_len[0]) == 0
  for start in range(100, 228, step):
    new = InflightKV((k[:, :, start:start + step].transpose(0, 2, 1, 3),),
                     (v[:, :, start:start + step].transpose(0, 2, 1, 3),))
    cache = qkv.commit(cache, new, jnp.array([step], jnp.int32))
  direct = qkv.from_dense(dense(228), g, quant_capacity=n_tok)
  ql = int(cache.quant_len[0])
  assert ql == int(direct.quant_len[0]) == 128                          # two flushed groups
  for got, want in zip(code_planes(cache.codes[0]), code_planes(direct.codes[0])):
    np.testing.assert_array_equal(np.asarray(got)[..., :ql, :], np.asarray(want)[..., :ql, :])
  with pytest.raises(InputError, match="must divide or be a multiple of the 64-token value tile"):
    qkv.from_dense(dense(100), 48, quant_capacity=192)
  # An explicit capacity below the dense cache's would drop the codes of its own tokens.
  with pytest.raises(InputError, match=f"quantized capacity 128 is smaller than the dense cache's "
                                       f"capacity {n_tok}"):
    qkv.from_dense(dense(100), g, quant_capacity=128)


def test_top_k_1_at_a_huge_temperature_gives_the_greedy_tokens(stories):
  """top_k=1 keeps only the argmax at any T. Clamped to float32's largest, T's reciprocal (XLA
  multiplies the draft's logits by it inside the draft loop) flushed to 0: -inf * 0 = NaN
  probabilities, draws of token 0, while dense and Lookahead still matched greedy."""
  cfg, params, tok = stories
  prompts = _prompts(tok)[:2]
  kwargs = dict(max_new_tokens=12, stop_tokens=(), method=METHOD)
  greedy = sparsedec.generate(cfg, params, prompts, **kwargs).tokens
  sampled = sparsedec.generate(cfg, params, prompts, seed=3,
                               sampling=SamplingConfig(temperature=1e39, top_k=1), **kwargs)
  assert sampled.tokens == greedy


def test_a_model_or_draft_the_method_cannot_run_is_refused_before_prefill(stories, monkeypatch):
  """A binding sliding window and a params' draft of another weight group were refused in
  QuantSpec's init, after prefill had compiled and run."""
  from sparsedec.decode import api
  from sparsedec.model.quant_weights import QUANTIZED_LINEARS, quantize_params
  cfg, params, _ = stories

  def no_prefill(*args, **kwargs):
    raise AssertionError("prefill ran before the knobs were checked")
  monkeypatch.setattr(api, "prefill", no_prefill)
  with pytest.raises(InputError, match="quantspec cannot apply sliding_window=16"):
    sparsedec.generate(cfg.replace(family="mistral", sliding_window=16), params, [[1, 2, 3]],
                       max_new_tokens=12, method=METHOD)      # a run the window binds
  layers = [{name: lp[name] for name in QUANTIZED_LINEARS}
            for lp in quantize_params(params, 64)["layers"]]
  with pytest.raises(InputError, match=r"has weight groups \[64\], quantspec weight_group is 32"):
    sparsedec.generate(cfg, gptq.with_draft(params, layers), [[1, 2, 3]], max_new_tokens=2,
                       method=METHOD)


def test_a_head_dim_the_codes_cannot_hold_is_refused_before_prefill(monkeypatch):
  """QuantSpec checked for an even head_dim; the codes need a multiple of 8 (head_dim 6 or 12
  passed its check and was refused by kv.quantized in init, after prefill)."""
  from sparsedec.decode import api
  from sparsedec.model.config import ModelConfig
  from sparsedec.model.params import init_random

  def no_prefill(*args, **kwargs):
    raise AssertionError("prefill ran before the knobs were checked")
  monkeypatch.setattr(api, "prefill", no_prefill)
  for head_dim in (6, 12):
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=48, intermediate_size=64,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=head_dim)
    params = init_random(cfg, jax.random.PRNGKey(0))
    with pytest.raises(InputError, match=f"quantspec needs a head_dim that is a multiple of 8 .*"
                                         f"got {head_dim}"):
      sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=2, method=METHOD)


def test_the_draft_reads_the_4bit_view_with_its_4bit_weights(stories):
  """The step's draft distributions q are those of the 4-bit-weight draft reading the 4-bit view
  (teacher-forced over the drafted chain in one forward), and differ from a draft reading the
  8-bit view or using the full-precision weights. The output is lossless whatever the draft reads
  (only the acceptance moves), so the method-level tests cannot tell; this one can."""
  from sparsedec.attention import AttentionPlan, QuantView, Segment, causal_plan
  from sparsedec.decode.api import start
  from sparsedec.decode.quantspec import draft_model
  from sparsedec.decode.sampling import probabilities
  cfg, params, tok = stories
  sampling = SamplingConfig(temperature=1.0)
  prompts = [tok.encode("Once upon a time, there was a little girl named Lily. She liked to play "
                        "with her toys in the park."), tok.encode("The dog ran to the big tree. The cat sat on the mat and looked "
                                                     "at the bird.")]
  state, _ = start(cfg, params, prompts, max_new_tokens=8, stop_tokens=(), method=METHOD,
                   sampling=sampling)
  qc, g = state.extras.qcache, METHOD.gamma
  assert (np.asarray(qc.quant_len) > 0).all()            # the two views differ somewhere
  uniforms = rand.uniform(jax.random.key(7), (len(prompts), g))
  drafts, q = jax.jit(lambda p, s, u: METHOD._draft(cfg, p, s, sampling, u))(params, state,
                                                                              uniforms)
  chain = jnp.concatenate([state.last_tokens(), drafts[:, :-1]], axis=1)    # [B, gamma]
  positions = qc.lengths[:, None] + jnp.arange(g)[None]
  mask = causal_plan(g).inflight_mask

  @jax.jit
  def teacher_forced(p, qc, bits_view):
    plan = AttentionPlan(mask, (Segment(bits_view, 0, g),))
    logits, _ = forward(cfg, p, chain, positions, state.cache, plan)
    return probabilities(logits, sampling)

  draft = draft_model(params, state.extras.draft_params)
  # draft_sampling="argmax" (and greedy runs) take the argmax instead of drawing from q
  assert METHOD.samples_drafts(sampling) and not METHOD.samples_drafts(SamplingConfig())
  assert not dataclasses.replace(METHOD, draft_sampling="argmax").samples_drafts(sampling)
  want = teacher_forced(draft, qc, QuantView(qc, bits=4))
  np.testing.assert_allclose(np.asarray(q), np.asarray(want), atol=2e-5)
  for i in range(g):      # d_i drawn from q_i with the step's i-th draft uniform (inverse CDF)
    np.testing.assert_array_equal(np.asarray(drafts[:, i]),
                                  np.asarray(draw_from(q[:, i], uniforms[:, i])))
  for other in (teacher_forced(draft, qc, QuantView(qc, bits=8)),       # the 8-bit view
                teacher_forced(params, qc, QuantView(qc, bits=4))):     # full weights
    assert np.abs(np.asarray(other) - np.asarray(want)).max() > 1e-3


def test_the_drafts_uniforms_are_not_the_acceptance_tests(stories, monkeypatch):
  """One PRNG draw per row and step gives the gamma draft uniforms, the gamma acceptance tests and
  the last token's uniform: the step hands distinct ones to the draft and to `verify_drafted`
  (`chain_uniforms.py` says why it matters)."""
  import chain_uniforms
  from sparsedec.decode import quantspec
  seen = chain_uniforms.record(monkeypatch, quantspec)
  cfg, params, tok = stories
  method = QuantSpec(gamma=2, quant_group=8, weight_bits=None)    # a config no other test traces
  run = sparsedec.generate(cfg, params, [tok.encode("Once upon"), tok.encode("The dog")],
                           max_new_tokens=2, sampling=SamplingConfig(temperature=1.0),
                           stop_tokens=(), method=method, cache_size=40, return_state=True)
  # The state's invariant holds for the int8 state's placeholder cache too (its lengths move
  # with the codes': cache.lengths == num_tokens - 1).
  state = run.state
  np.testing.assert_array_equal(np.asarray(state.cache.lengths),
                                np.asarray(state.extras.qcache.lengths))
  np.testing.assert_array_equal(np.asarray(state.cache.lengths), np.asarray(state.num_tokens) - 1)
  chain_uniforms.assert_one_step_of_distinct_draws(seen, batch=2, gamma=2)
