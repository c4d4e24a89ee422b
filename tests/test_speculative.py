"""Draft-model speculative decoding (sparsedec.decode.speculative): lossless against dense greedy
on stories260K and SmolLM2-135M-Instruct (fp32, 256 tokens), the sampling law, the draft cache's
catch-up, serving inserts, and bad input refused by name."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import sparsedec
from sparsedec import prompts as prompt_sets
from sparsedec import testing
from sparsedec.decode import api
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.decode.speculative import DRAFT_MODEL_KEY, Speculative, with_draft_model
from sparsedec.model.params import init_random


def truncated(cfg, params, layers: int):
  """A draft made of the model's first `layers` layers (its embeddings, final norm and head)."""
  return cfg.replace(num_layers=layers), {**params, "layers": params["layers"][:layers]}


def other_shapes(cfg):
  """A random draft of other shapes than the target's (2 layers, 2 query heads over 1 KV head of
  16 channels, another MLP width), the target's vocabulary: its cache is its own."""
  draft = cfg.replace(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                      intermediate_size=96)
  return draft, init_random(draft, jax.random.key(3), scale=0.3)


@pytest.fixture(scope="module")
def stories_prompts(stories):
  _, _, tok = stories
  return [tok.encode("Once upon a time"), tok.encode("The little dog ran to the park and saw a")]


@pytest.fixture(scope="module")
def stories_dense(stories, stories_prompts):
  cfg, params, _ = stories
  return sparsedec.generate(cfg, params, stories_prompts, max_new_tokens=256,
                            stop_tokens=()).tokens


@pytest.mark.parametrize("draft", ["itself", "3 layers", "other shapes"])
def test_greedy_equals_dense_on_stories260k(stories, stories_prompts, stories_dense, draft):
  """256 tokens, two prompts of other lengths in one batch, gamma 3, fp32: token-identical to
  dense greedy with each draft. The model drafting for itself has every draft accepted (tau =
  gamma + 1 but where the token budget cut the last step), and its cache then equals the
  target's below each row's num_tokens - 2 (a stale, shifted or doubled slot left by the
  catch-up fails this). Its first three layers have drafts both accepted and rejected."""
  cfg, params, _ = stories
  dcfg, dparams = {"itself": (cfg, params), "3 layers": truncated(cfg, params, 3),
                   "other shapes": other_shapes(cfg)}[draft]
  method = Speculative(draft=dcfg, gamma=3)
  result = testing.assert_matches_dense(cfg, with_draft_model(params, dparams), stories_prompts,
                                        method=method, max_new_tokens=256, stop_tokens=(),
                                        expected=stories_dense, return_state=True)
  stats = result.method_stats
  if draft == "itself":
    assert stats["acceptance_rate"] == 1.0, stats
    steps = np.asarray(result.state.active_steps)
    assert (steps == -(-255 // 4)).all(), steps     # prefill's token, then 4 a step
    # The draft's cache holds what the target's does at every slot below num_tokens - 2 (the
    # invariant a step starts from): no stale, shifted or doubled entry.
    state = jax.device_get(result.state)
    for dk, tk in zip(state.extras.draft_cache.k + state.extras.draft_cache.v,
                      state.cache.k + state.cache.v):
      for b, n in enumerate(state.num_tokens):
        np.testing.assert_allclose(dk[b, :, :n - 2], tk[b, :, :n - 2], rtol=1e-4, atol=1e-5)
  elif draft == "3 layers":
    assert 0.0 < stats["acceptance_rate"] < 1.0, stats
  assert stats["draft_layers"] == dcfg.num_layers
  assert stats["drafted_tokens"] >= stats["accepted_drafts"]


def test_greedy_equals_dense_on_smollm2(smollm2):
  """SmolLM2-135M-Instruct (fp32), an MT-Bench chat turn and a HumanEval prompt in one batch, 256
  tokens, its first 10 of 30 layers drafting gamma 4: token-identical to dense greedy, drafts
  accepted and rejected."""
  cfg, params, tok = smollm2
  chat = tok.apply_chat_template([{"role": "user", "content": prompt_sets.mt_bench()[2]}],
                                 add_generation_prompt=True)
  prompts = [tok.encode(chat, add_bos=False), tok.encode(prompt_sets.humaneval()[2])]
  dcfg, dparams = truncated(cfg, params, 10)
  result = testing.assert_matches_dense(cfg, with_draft_model(params, dparams), prompts,
                                        method=Speculative(draft=dcfg, gamma=4),
                                        max_new_tokens=256, stop_tokens=())
  assert 0.0 < result.method_stats["acceptance_rate"] < 1.0, result.method_stats
  assert result.tau > 1.0


SAMPLE_ROWS = 600
SAMPLING = SamplingConfig(temperature=1.6, top_k=12, top_p=0.95)


@pytest.mark.parametrize("draft_sampling", ["sample", "argmax"])
def test_sampling_first_three_tokens_distributed_as_dense(stories, draft_sampling):
  """Joint law of the first 3 sampled tokens over many per-row seeds, the 4-layer draft vs dense:
  chi-square test of homogeneity at false-alarm rate alpha = 1e-3
  (`testing.assert_sampling_matches_dense`)."""
  cfg, params, tok = stories
  prompt = tok.encode("Lily and Tom went to the park. Lily and Tom went to the")
  dcfg, dparams = truncated(cfg, params, 4)
  method = Speculative(draft=dcfg, gamma=3, draft_sampling=draft_sampling)
  got = testing.assert_sampling_matches_dense(cfg, with_draft_model(params, dparams), prompt,
                                              method=method, sampling=SAMPLING,
                                              rows=SAMPLE_ROWS, stop_tokens=())
  stats = got.result.method_stats
  assert stats["accepted_drafts_per_step"] > 0.3 and stats["draft_sampling"] == draft_sampling
  assert got.table.shape[1] >= 5, got.table                     # a spread-out law


def test_an_inserted_request_decodes_as_alone(stories):
  """Serving: a request started on its own and inserted into a running batch's finished row
  decodes its tokens and counts its drafts as it would alone (the draft cache is per row)."""
  from insert_alone import assert_insert_decodes_as_alone
  cfg, params, tok = stories
  dcfg, dparams = truncated(cfg, params, 3)
  assert_insert_decodes_as_alone(cfg, with_draft_model(params, dparams), tok,
                                 Speculative(draft=dcfg, gamma=3),
                                 ("drafted", "accepted_drafts"))

def test_bad_input_is_refused_by_name(stories):
  cfg, params, _ = stories
  dcfg, dparams = truncated(cfg, params, 2)
  run = lambda p, m: sparsedec.generate(cfg, p, [[1, 2, 3]], max_new_tokens=4, method=m)  # noqa
  with pytest.raises(sparsedec.InputError, match=r"needs the draft model's config"):
    sparsedec.decode.methods.get_method("speculative")
  with pytest.raises(sparsedec.InputError, match=r"gamma must be an integer >= 1"):
    Speculative(draft=dcfg, gamma=0)
  with pytest.raises(sparsedec.InputError, match=r"draft_sampling must be one of"):
    Speculative(draft=dcfg, draft_sampling="greedy")
  with pytest.raises(sparsedec.InputError, match=rf"have no '{DRAFT_MODEL_KEY}'"):
    run(params, Speculative(draft=dcfg))
  with pytest.raises(sparsedec.InputError, match=r"vocabulary \(600 tokens\) is not the target"):
    run(with_draft_model(params, dparams), Speculative(draft=dcfg.replace(vocab_size=600)))
  with pytest.raises(sparsedec.InputError, match=r"draft model's params do not fit.*expected 3"):
    run(with_draft_model(params, dparams), Speculative(draft=cfg.replace(num_layers=3)))
  with pytest.raises(sparsedec.InputError, match=r"the draft model's params: tensor .* bfloat16"):
    run(with_draft_model(params, jax.tree.map(lambda x: x.astype("bfloat16"), dparams)),
        Speculative(draft=dcfg))
  with pytest.raises(sparsedec.InputError, match=r"must be a params dict"):
    with_draft_model(params, [1, 2])
  # Advanced with the target's params alone: refused by name (was a KeyError inside the trace).
  state, run_ = api.start(cfg, with_draft_model(params, dparams), [[1, 2, 3]], max_new_tokens=4,
                          method=Speculative(draft=dcfg))
  with pytest.raises(sparsedec.InputError, match=r"advance the state with the params it was"):
    run_.advance(params, state)


def test_the_state_holds_no_copy_of_the_draft_weights(stories):
  """The draft's params go to the loop with the target's; the state holds its cache and counters
  only (a serving batch and its requests share the caller's draft weights)."""
  cfg, params, _ = stories
  dcfg, dparams = truncated(cfg, params, 2)
  state, _ = api.start(cfg, with_draft_model(params, dparams), [[1, 2, 3]], max_new_tokens=4,
                       method=Speculative(draft=dcfg))
  assert set(dataclasses.asdict(state.extras)) == {"draft_cache", "drafted", "accepted_drafts"}
  assert len(state.extras.draft_cache.k) == 2
  assert int(state.extras.draft_cache.lengths[0]) == 3          # the prompt's, not prefill's token


def test_the_drafts_uniforms_are_not_the_acceptance_tests(stories, monkeypatch):
  """One PRNG draw per row and step gives the gamma draft uniforms, the gamma acceptance tests and
  the last token's uniform (`verify.chain_uniforms`): the step hands distinct ones to the draft's
  draws and to `verify_drafted` (`chain_uniforms.py` says why it matters)."""
  import chain_uniforms
  from sparsedec.decode import speculative
  seen = chain_uniforms.record(monkeypatch, speculative)
  cfg, params, tok = stories
  dcfg, dparams = truncated(cfg, params, 1)           # a draft no other test traces
  sparsedec.generate(cfg, with_draft_model(params, dparams),
                     [tok.encode("Once upon"), tok.encode("The dog")], max_new_tokens=2,
                     sampling=SamplingConfig(temperature=1.0), stop_tokens=(),
                     method=Speculative(draft=dcfg, gamma=2), cache_size=64)
  chain_uniforms.assert_one_step_of_distinct_draws(seen, batch=2, gamma=2)
