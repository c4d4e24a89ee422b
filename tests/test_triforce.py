"""TriForce (sparsedec.decode.triforce) and its chunk retrieval (sparsedec.compress.retrieval):
lossless against dense greedy on stories260K and SmolLM2-135M-Instruct (fp32, 256 tokens), both
levels' caches, the sampling law, serving inserts, bad input refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsedec
from sparsedec import prompts as prompt_sets
from sparsedec import testing
from sparsedec.compress import Quest
from sparsedec.compress.retrieval import ChunkRetrieval, chunk_scores
from sparsedec.compress.streaming import StreamingLLM
from sparsedec.decode import api
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.decode.speculative import DRAFT_MODEL_KEY, with_draft_model
from sparsedec.decode.triforce import TriForce
from sparsedec.kv.dense import KVCache
from test_speculative import other_shapes, truncated

# Views that read a fraction of stories260K's cache: 64 of up to ~300 tokens for the middle
# level (2 retrieved 16-slot blocks, the sink among them, and the 2 newest), 48 for the draft.
RETRIEVAL = ChunkRetrieval(budget_blocks=4, block_size=16, recent_blocks=2)
DRAFT_VIEW = StreamingLLM(budget_blocks=3, block_size=16)
# Views past every cache here: the middle level is then the target itself, the draft its model.
WHOLE = dict(retrieval=ChunkRetrieval(budget_blocks=64, block_size=16),
             draft_view=StreamingLLM(budget_blocks=64, block_size=16))


@pytest.fixture(scope="module")
def stories_prompts(stories):
  _, _, tok = stories
  story = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
           "the park with her friends. One day")
  return [tok.encode(story), tok.encode("The little dog ran to the park and saw a")]


@pytest.fixture(scope="module")
def stories_dense(stories, stories_prompts):
  cfg, params, _ = stories
  return sparsedec.generate(cfg, params, stories_prompts, max_new_tokens=256, stop_tokens=(),
                            cache_size=320).tokens


@pytest.mark.parametrize("draft", ["itself, whole views", "3 layers", "other shapes"])
def test_greedy_equals_dense_on_stories260k(stories, stories_prompts, stories_dense, draft):
  """256 tokens, two prompts (38 and 12 tokens) in one batch, gamma 6 from rounds of 2 drafts,
  fp32: token-identical to dense greedy. The model drafting for itself through views of its
  whole cache has every token accepted at both levels, and both caches then equal the target's
  committed entries (a slot the middle scratch or the draft's catch-up left stale, shifted or
  doubled fails this). The 3-layer draft reads 48 tokens, the middle level 64 of ~300: tokens
  accepted and rejected at both levels."""
  cfg, params, _ = stories
  dcfg, dparams = {"itself, whole views": (cfg, params), "3 layers": truncated(cfg, params, 3),
                   "other shapes": other_shapes(cfg)}[draft]
  views = WHOLE if draft.endswith("whole views") else dict(retrieval=RETRIEVAL,
                                                           draft_view=DRAFT_VIEW)
  # gamma 6 from rounds of 3 tokens: the last middle token is a draft the draft model never
  # consumed, which the next step's catch-up must cover (a catch-up of 2 tokens left it stale).
  method = TriForce(draft=dcfg, gamma=6, draft_gamma=2, **views)
  result = testing.assert_matches_dense(cfg, with_draft_model(params, dparams), stories_prompts,
                                        method=method, max_new_tokens=256, stop_tokens=(),
                                        cache_size=320, expected=stories_dense,
                                        return_state=True)
  stats = result.method_stats
  if draft.endswith("whole views"):
    assert stats["acceptance_rate"] == 1.0 and stats["draft_acceptance_rate"] == 1.0, stats
    assert stats["middle_rounds_per_step"] == 2.0, stats        # 3 tokens a round, 6 needed
    state = jax.device_get(result.state)
    for dk, tk in zip(state.extras.draft_cache.k + state.extras.draft_cache.v,
                      state.cache.k + state.cache.v):
      for b, n in enumerate(state.num_tokens):
        np.testing.assert_allclose(dk[b, :, :n - 3], tk[b, :, :n - 3], rtol=1e-4, atol=1e-5)
  elif draft == "3 layers":
    assert 0.0 < stats["acceptance_rate"] < 1.0, stats
    assert 0.0 < stats["draft_acceptance_rate"] < 1.0, stats
  assert stats["draft_layers"] == dcfg.num_layers
  assert stats["drafted_tokens"] >= stats["accepted_drafts"] > 0


def test_greedy_equals_dense_on_smollm2(smollm2):
  """SmolLM2-135M-Instruct (fp32), an MT-Bench chat turn and a HumanEval prompt in one batch, 256
  tokens: its first 10 of 30 layers draft through a 64-token StreamingLLM view, the middle level
  reads 128 retrieved and newest slots of up to ~380: token-identical to dense greedy."""
  cfg, params, tok = smollm2
  chat = tok.apply_chat_template([{"role": "user", "content": prompt_sets.mt_bench()[2]}],
                                 add_generation_prompt=True)
  prompts = [tok.encode(chat, add_bos=False), tok.encode(prompt_sets.humaneval()[2])]
  dcfg, dparams = truncated(cfg, params, 10)
  method = TriForce(draft=dcfg, gamma=4, draft_gamma=2,
                    retrieval=ChunkRetrieval(budget_blocks=8, block_size=16, recent_blocks=3),
                    draft_view=StreamingLLM(budget_blocks=4, block_size=16))
  result = testing.assert_matches_dense(cfg, with_draft_model(params, dparams), prompts,
                                        method=method, max_new_tokens=256, stop_tokens=())
  stats = result.method_stats
  assert 0.0 < stats["acceptance_rate"] < 1.0, stats
  assert result.tau > 1.0


SAMPLE_ROWS = 600
SAMPLING = SamplingConfig(temperature=1.6, top_k=12, top_p=0.95)


@pytest.mark.parametrize("draft_sampling", ["sample", "argmax"])
def test_sampling_first_three_tokens_distributed_as_dense(stories, draft_sampling):
  """Joint law of the first 3 sampled tokens over many per-row seeds, a 4-layer draft and both
  views compressed against dense: chi-square test of homogeneity at false-alarm rate alpha =
  1e-3 (`testing.assert_sampling_matches_dense`)."""
  cfg, params, tok = stories
  prompt = tok.encode("Lily and Tom went to the park. They played with a ball and a kite. Lily "
                      "and Tom went to the")
  dcfg, dparams = truncated(cfg, params, 4)
  method = TriForce(draft=dcfg, gamma=3, draft_gamma=2, draft_sampling=draft_sampling,
                    retrieval=ChunkRetrieval(budget_blocks=2, block_size=16, recent_blocks=1),
                    draft_view=StreamingLLM(budget_blocks=2, block_size=16))
  got = testing.assert_sampling_matches_dense(cfg, with_draft_model(params, dparams), prompt,
                                              method=method, sampling=SAMPLING,
                                              rows=SAMPLE_ROWS, stop_tokens=(), cache_size=64)
  stats = got.result.method_stats
  assert stats["accepted_drafts_per_step"] > 0.3 and stats["draft_sampling"] == draft_sampling
  assert 0.0 < stats["draft_acceptance_rate"] < 1.0, stats
  assert got.table.shape[1] >= 5, got.table                     # a spread-out law


def test_chunk_scores_and_the_retrieval_view():
  """chunk_scores against a plain loop (mean key of each block's valid slots, summed over the KV
  head's query heads; block 0 forced first); the view lists the sink, the best other blocks
  before the recent region and the newest blocks, each once."""
  rng = np.random.default_rng(0)
  b, hkv, groups, s, d, bs = 2, 2, 3, 128, 8, 16
  q = rng.standard_normal((b, hkv * groups, d)).astype(np.float32)
  k = rng.standard_normal((b, hkv, s, d)).astype(np.float32)
  lengths = np.array([100, 37], np.int32)
  got = np.asarray(chunk_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(lengths), bs))
  for r in range(b):
    for h in range(hkv):
      for p in range(1, s // bs):
        valid = k[r, h, p * bs:min((p + 1) * bs, lengths[r])]
        mean = valid.mean(0) if len(valid) else np.zeros(d, np.float32)
        want = sum(q[r, h * groups + g] @ mean for g in range(groups))
        np.testing.assert_allclose(got[r, h, p], want, rtol=1e-5, atol=1e-5)
      assert got[r, h, 0] == np.inf
  policy = ChunkRetrieval(budget_blocks=5, block_size=bs, recent_blocks=2)
  from sparsedec.compress.snapkv import top_blocks
  scores = [jnp.asarray(got)]
  candidates = jnp.maximum(-(-jnp.asarray(lengths) // bs) - 2, 0)     # 5 and 1 blocks
  st = top_blocks(scores, candidates, 3)
  cache = KVCache(k=[jnp.asarray(k)], v=[jnp.asarray(k)], lengths=jnp.asarray(lengths) + 20)
  view = policy.view(st, cache)
  tables, counts = np.asarray(view.tables[0]), np.asarray(view.counts[0])
  for r in range(b):
    for h in range(hkv):
      listed = list(tables[r, h, :counts[r, h]])
      assert len(set(listed)) == len(listed) and 0 in listed, listed
      used = -(-(lengths[r] + 20) // bs)
      assert used - 1 in listed and used - 2 in listed, listed        # the newest blocks
      best = 1 + np.argsort(-got[r, h, 1:candidates[r]])[:2]          # and the best others
      assert set(best) <= set(listed) or candidates[r] <= 1, (listed, best)


def test_fafo_reads_the_chunk_retrieval_too(stories, stories_prompts, stories_dense):
  """ChunkRetrieval is a CompressionPolicy: FAFO's fumbles read it, greedy output unchanged."""
  cfg, params, _ = stories
  method = Fafo(subsequences=6, length=3, candidates=4, policy=RETRIEVAL)
  result = testing.assert_matches_dense(cfg, params, stories_prompts, method=method,
                                        max_new_tokens=256, stop_tokens=(), cache_size=320,
                                        expected=stories_dense)
  assert result.method_stats["policy"] == "retrieval"


def test_an_inserted_request_decodes_as_alone(stories):
  """Serving: a request inserted into a running batch's finished row decodes its tokens and
  counts both levels' drafts as it would alone."""
  from insert_alone import assert_insert_decodes_as_alone
  cfg, params, tok = stories
  dcfg, dparams = truncated(cfg, params, 3)
  assert_insert_decodes_as_alone(
      cfg, with_draft_model(params, dparams), tok,
      TriForce(draft=dcfg, gamma=4, retrieval=RETRIEVAL, draft_view=DRAFT_VIEW),
      ("drafted", "accepted_drafts", "small_drafted", "small_accepted", "middle_rounds"))

def test_bad_input_is_refused_by_name(stories):
  cfg, params, _ = stories
  dcfg, dparams = truncated(cfg, params, 2)
  both = with_draft_model(params, dparams)
  run = lambda p, m, **kw: sparsedec.generate(cfg, p, [[1, 2, 3]], max_new_tokens=4,  # noqa
                                              method=m, **kw)
  with pytest.raises(sparsedec.InputError, match=r"triforce needs the draft model's config"):
    sparsedec.decode.methods.get_method("triforce")
  for knob in ("gamma", "draft_gamma"):
    with pytest.raises(sparsedec.InputError, match=rf"triforce {knob} must be an integer >= 1"):
      TriForce(draft=dcfg, **{knob: 0})
  with pytest.raises(sparsedec.InputError, match=r"draft_sampling must be one of"):
    TriForce(draft=dcfg, draft_sampling="greedy")
  with pytest.raises(sparsedec.InputError, match=r"retrieval must be a CompressionPolicy object"):
    TriForce(draft=dcfg, retrieval=ChunkRetrieval)
  with pytest.raises(sparsedec.InputError, match=r"Quest\) does not apply"):
    TriForce(draft=dcfg, retrieval=Quest())
  with pytest.raises(sparsedec.InputError, match=r"leaves no block to retrieve"):
    ChunkRetrieval(budget_blocks=2, recent_blocks=2)
  with pytest.raises(sparsedec.InputError, match=rf"triforce drafts with a second model.*"
                                                 rf"have no '{DRAFT_MODEL_KEY}'"):
    run(params, TriForce(draft=dcfg))
  with pytest.raises(sparsedec.InputError, match=r"vocabulary \(600 tokens\) is not the target"):
    run(both, TriForce(draft=dcfg.replace(vocab_size=600)))
  with pytest.raises(sparsedec.InputError, match=r"capacity 100 is not a multiple of the views"):
    run(both, TriForce(draft=dcfg), cache_size=100)
  state, run_ = api.start(cfg, both, [[1, 2, 3]], max_new_tokens=4, method=TriForce(draft=dcfg))
  with pytest.raises(sparsedec.InputError, match=r"advance the state with the params it was"):
    run_.advance(params, state)
