"""FAFO: greedy token-identical to dense greedy on real checkpoints (each compression policy),
sampling distribution equal to dense sampling, and the fumble tokens read only C(kv)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rand
import sparsedec
from sparsedec import prompts as prompt_sets
from sparsedec import testing
from sparsedec.attention import BlockListView
from sparsedec.compress import Quest, SnapKV, StreamingLLM
from sparsedec.compress.base import prompt_window_queries
from sparsedec.decode import api
from sparsedec.decode.fafo import Fafo, fafo_layout
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.errors import InputError
from sparsedec.kv.dense import KVCache
from sparsedec.model.forward import forward

from pool_items import assert_pools_equal, insert_items
import row_figures


# Library functions these tests call outside a decode loop, jitted: run op by op, each of their
# operations was compiled on its own for every shape (a forward or a SnapKV init: 100-260
# compiles, 5-20 s of a test on a CPU core).
_forward = jax.jit(forward, static_argnums=0)
_window_queries = jax.jit(prompt_window_queries, static_argnums=(0, 3))


def _policy_init(policy, cfg, params, state):
  return jax.jit(policy.init, static_argnums=0)(cfg, params, state)


# Small blocks and budgets so the compressed view is much smaller than the cache in every test.
POLICIES = {
    "streaming": StreamingLLM(budget_blocks=3, block_size=8, sink_blocks=1),
    "quest": Quest(budget_blocks=3, block_size=8),
    "snapkv": SnapKV(budget_blocks=3, block_size=8, recent_blocks=1, window=4, pool=3),
}


def test_layout_masks_follow_the_paper():
  n, k, m = 3, 2, 2
  mask, offsets = fafo_layout(n, k, m)
  f = n * k
  assert mask.shape == (f + 1 + m * k,) * 2
  # fumble (j=1, i=1) at index 1*n+1 sees (j=1, i=0) and itself, nothing else (not the current)
  assert sorted(np.flatnonzero(mask[n + 1])) == [1, n + 1]
  assert offsets[n + 1] == 1 + 1 + 1
  # candidate 1 token 1 sees the current token, its own token 0 and itself
  q = f + 1 + k + 1
  assert sorted(np.flatnonzero(mask[q])) == [f, f + 1 + k, q]
  assert offsets[q] == 2 and offsets[f] == 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_equals_dense_on_stories260k(stories, policy):
  cfg, params, tok = stories
  prompts = [tok.encode("Once upon a time, there was a little girl named Lily. She liked to"),
             tok.encode("The dog")]
  method = Fafo(subsequences=8, length=4, candidates=5, policy=POLICIES[policy])
  result = testing.assert_matches_dense(cfg, params, prompts, method=method, max_new_tokens=256,
                                        stop_tokens=())
  assert result.tau > 1.2, result.tau          # guesses were accepted, not just one per step


@pytest.fixture(scope="module")
def sliding_window_dense(stories):
  """stories260K as a Mistral with a window of 12, two prompts and dense greedy's 96 tokens (the
  window binds: without it the output differs)."""
  cfg, params, tok = stories
  cfg = cfg.replace(family="mistral", sliding_window=12)
  prompts = [tok.encode("Once upon a time, there was a little girl named Lily. She liked to"),
             tok.encode("The dog")]
  kw = dict(max_new_tokens=96, stop_tokens=())
  dense = sparsedec.generate(cfg, params, prompts, **kw)
  full = sparsedec.generate(cfg.replace(sliding_window=None), params, prompts, **kw)
  assert dense.tokens != full.tokens
  return cfg, prompts, dense


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_equals_dense_on_a_sliding_window_model_past_its_window(stories,
                                                                        sliding_window_dense,
                                                                        policy):
  """FAFO ran no sliding-window model (InputError "fafo does not support sliding-window
  attention models"), not even a Mistral whose window (4096 by default) is longer than the whole
  cache. `attend` masks every query's view by position, so the candidates read what dense
  decoding reads: here a window of 12, far exceeded by the prompt and the 96 new tokens, with
  guesses accepted."""
  _, params, _ = stories
  cfg, prompts, dense = sliding_window_dense
  method = Fafo(subsequences=8, length=4, candidates=5, policy=POLICIES[policy])
  result = testing.assert_matches_dense(cfg, params, prompts, method=method, expected=dense,
                                        max_new_tokens=96, stop_tokens=())
  assert result.tau > 1.2, result.tau


@pytest.fixture(scope="module")
def smollm2_dense(smollm2):
  """Two real prompts (an MT-Bench chat turn, a HumanEval prompt) and dense greedy's 256 tokens."""
  cfg, params, tok = smollm2
  chat = tok.apply_chat_template([{"role": "user", "content": prompt_sets.mt_bench()[0]}],
                                 add_generation_prompt=True)
  texts = [tok.encode(chat, add_bos=False), tok.encode(prompt_sets.humaneval()[0])]
  dense = sparsedec.generate(cfg, params, texts, max_new_tokens=256, stop_tokens=())
  return texts, dense.tokens


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_equals_dense_on_smollm2_mt_bench_and_humaneval(smollm2, smollm2_dense, policy):
  cfg, params, _ = smollm2
  texts, expected = smollm2_dense
  small = {"streaming": StreamingLLM(budget_blocks=4, block_size=16),
           "quest": Quest(budget_blocks=4, block_size=16),
           "snapkv": SnapKV(budget_blocks=4, block_size=16, recent_blocks=2, window=8)}
  # Few tokens per forward (2 x 3 fumble + 1 + 2 x 3 candidate = 13): each of these steps streams
  # all of SmolLM2's fp32 weights and runs its matmuls at a few rows, so the knobs set the CPU
  # time (6 x 4 + 1 + 4 x 4 = 41 tokens cost 1.45x as much for the same 256 tokens). The
  # stories260K tests above cover the larger knobs.
  method = Fafo(subsequences=2, length=3, candidates=2, policy=small[policy])
  result = testing.assert_matches_dense(cfg, params, texts, method=method, max_new_tokens=256,
                                        stop_tokens=(), expected=expected)
  assert result.tau > 1.0


def test_lookahead_greedy_equals_dense_on_smollm2(smollm2, smollm2_dense):
  """Lookahead, the baseline FAFO is compared against, on the same real prompts (kept here to
  share the dense run). Small knobs, as FAFO's above: (3 + 3) x 2 + 1 = 13 tokens per forward
  (W 6, N 5, G 4 ran 41 at 1.7x the CPU time: 97.9 -> 58.6 s, tau 1.68 -> 1.45);
  tests/test_lookahead.py covers the default knobs on stories260K."""
  from sparsedec.decode.lookahead import Lookahead
  cfg, params, _ = smollm2
  texts, expected = smollm2_dense
  result = testing.assert_matches_dense(cfg, params, texts, method=Lookahead(window=3, ngram=3,
                                                                             guesses=3),
                                        max_new_tokens=256, stop_tokens=(), expected=expected)
  assert result.tau > 1.0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fumble_tokens_read_only_the_compressed_view(stories, policy):
  """Poison every cache entry outside C(kv): fumble logits stay bit-identical, verification
  logits change."""
  cfg, params, tok = stories
  method = Fafo(subsequences=4, length=3, candidates=2, policy=POLICIES[policy])
  prompt = tok.encode("Once upon a time, there was a little girl named Lily. She liked to play")
  result = sparsedec.generate(cfg, params, [prompt], max_new_tokens=40, stop_tokens=(),
                              method=method, return_state=True)
  state = result.state
  cache = state.cache
  view = method.policy.view(state.extras.policy_state, cache)
  inside = view.at_layer(0).slot_mask(cache.lengths, cache.capacity)       # [B, Hkv, S]
  assert int(inside.sum()) < int(cache.lengths[0]) * cfg.num_kv_heads      # really compressed
  noise = rand.normal(jax.random.key(7), cache.k[0].shape) * 5.0
  poison = lambda x: jnp.where(inside[..., None], x, noise.astype(x.dtype))  # noqa: E731
  poisoned = KVCache(k=tuple(map(poison, cache.k)), v=tuple(map(poison, cache.v)),
                     lengths=cache.lengths)
  n, k, m = method.subsequences, method.length, method.candidates
  _, offsets = fafo_layout(n, k, m)
  tokens = rand.randint(jax.random.key(1), (1, len(offsets)), 0, cfg.vocab_size)
  positions = cache.lengths[:, None] + jnp.asarray(offsets)[None]
  plan = method.plan(view)
  if view.per_layer:                    # every layer's list is compressed, and they differ
    per_layer = [view.at_layer(i).slot_mask(cache.lengths, cache.capacity)
                 for i in range(cfg.num_layers)]
    assert all(int(m.sum()) < int(cache.lengths[0]) * cfg.num_kv_heads for m in per_layer)
    inside = jnp.stack(per_layer)                                         # [L, B, Hkv, S]
    noise_k = [jnp.where(inside[i][..., None], cache.k[i], noise.astype(cache.k[i].dtype))
               for i in range(cfg.num_layers)]
    noise_v = [jnp.where(inside[i][..., None], cache.v[i], noise.astype(cache.v[i].dtype))
               for i in range(cfg.num_layers)]
    poisoned = KVCache(k=tuple(noise_k), v=tuple(noise_v), lengths=cache.lengths)
  clean_logits, _ = _forward(cfg, params, tokens, positions, cache, plan)
  dirty_logits, _ = _forward(cfg, params, tokens, positions, poisoned, plan)
  f = n * k
  np.testing.assert_array_equal(np.asarray(dirty_logits[:, :f]), np.asarray(clean_logits[:, :f]))
  assert np.abs(np.asarray(dirty_logits[:, f:] - clean_logits[:, f:])).max() > 1e-2


def test_sampling_first_three_tokens_distributed_as_dense(stories):
  """Joint distribution of the first 3 sampled tokens over many per-row seeds: FAFO vs dense,
  a chi-square test of homogeneity (`testing.assert_sampling_matches_dense`). False-alarm rate:
  alpha = 1e-3 (the test fails when the two samples differ at p < 1e-3, which happens by chance
  once in a thousand runs)."""
  cfg, params, tok = stories
  prompt = tok.encode("Lily and Tom went to the park. Lily and Tom went to the")
  method = Fafo(subsequences=6, length=3, candidates=6,
                policy=StreamingLLM(budget_blocks=2, block_size=8))
  got = testing.assert_sampling_matches_dense(
      cfg, params, prompt, method=method, sampling=SamplingConfig(temperature=1.6, top_k=12),
      rows=600, stop_tokens=())
  assert got.result.method_stats["accepted_guesses_per_step"] > 0.2   # guesses were accepted
  assert got.table.shape[1] >= 5, got.table     # a real distribution, not a near-constant


@pytest.mark.parametrize("policy", [
    StreamingLLM(budget_blocks=12, block_size=8),
    Quest(budget_blocks=12, block_size=8),
    SnapKV(budget_blocks=12, block_size=8, recent_blocks=1, window=4, pool=3),
    SnapKV(budget_blocks=6, block_size=8, recent_blocks=1, window=4, pool=3),
], ids=["streaming", "quest", "snapkv", "snapkv-short-prompt"])
def test_a_budget_larger_than_the_prompt_is_filled_with_the_newest_blocks(stories, policy):
  """A 3-block prompt (20 tokens) and 60 new tokens (10 blocks in use): every policy lists
  min(used, budget_blocks) distinct blocks, the newest among them. SnapKV listed its 2 prompt
  blocks + 1 recent block (3 of the 10 in use, budget 12 or 6) whatever the room: the blocks
  between the prompt and the sliding recent window were never read."""
  cfg, params, tok = stories
  prompt = tok.encode("Once upon a time, there was a little girl named Lily. She liked to")
  result = sparsedec.generate(cfg, params, [prompt], max_new_tokens=60, stop_tokens=(),
                              method=Fafo(subsequences=3, length=3, candidates=2, policy=policy),
                              return_state=True)
  state = result.state
  cache = state.cache
  view = policy.view(state.extras.policy_state, cache)
  used = -(-int(cache.lengths[0]) // 8)
  assert used == 10
  want = min(used, policy.budget_blocks)
  for layer in range(cfg.num_layers):
    lv = view.at_layer(layer)
    for h in range(cfg.num_kv_heads):
      listed = np.asarray(lv.tables[0, h, : int(lv.counts[0, h])]).tolist()
      assert len(listed) == len(set(listed)) == want, (layer, h, listed)
      assert all(0 <= b < used for b in listed), listed
      assert used - 1 in listed, listed


def test_observation_window_longer_than_the_prompt_gives_the_prompts_own_queries(stories):
  """SnapKV's observation-window queries of a row shorter than the window equal those of a
  window exactly as long as the row. The window was padded in front with copies of the first
  token at position 0, which every later query attended to as well (the first token weighed
  9 times in a 6-token row with a 13-token window): every query but the first was wrong from
  layer 1 on, so SnapKV selected from wrong scores for every prompt shorter than its window."""
  from sparsedec.decode.api import start
  cfg, params, tok = stories
  prompt = tok.encode("Once upon a time, there was a little girl")
  state, _ = start(cfg, params, [prompt[:5], prompt[:9]], max_new_tokens=4)
  lengths = [int(n) for n in state.num_tokens]                   # 6 and 10: with the first token
  exact = {}
  for row, n in enumerate(lengths):                              # each row's own length
    q, pos, valid = _window_queries(cfg, params, state, n)
    for layer, ql in enumerate(q):
      for i in np.flatnonzero(np.asarray(valid[row])):
        exact[row, layer, int(pos[row, i])] = np.asarray(ql[row, i])
  q, pos, valid = _window_queries(cfg, params, state, 13)
  for row, n in enumerate(lengths):
    assert sorted(int(p) for p in np.asarray(pos[row])[np.asarray(valid[row])]) == list(range(n))
    for layer, ql in enumerate(q):
      for i in np.flatnonzero(np.asarray(valid[row])):
        np.testing.assert_allclose(np.asarray(ql[row, i]), exact[row, layer, int(pos[row, i])],
                                   atol=1e-5, err_msg=f"row {row} layer {layer} slot {i}")


def test_an_observation_window_past_the_token_buffer_is_cut_to_it(stories):
  """SnapKV's window is a static width: one past the token buffer (every token a row can hold)
  only added invalid queries to the init forward, and 2**40 failed at run time. It is cut to the
  buffer: the same selection, so FAFO with it is still dense greedy."""
  from sparsedec.decode.api import start
  cfg, params, tok = stories
  prompt = tok.encode("Once upon a time, there was a little girl")
  state, _ = start(cfg, params, [prompt], max_new_tokens=8)
  q, pos, valid = _window_queries(cfg, params, state, 2 ** 40)
  assert pos.shape == valid.shape == (1, state.tokens.shape[1])
  assert q[0].shape[1] == state.tokens.shape[1] and int(valid.sum()) == len(prompt) + 1
  method = Fafo(subsequences=2, length=3, candidates=2,
                policy=SnapKV(budget_blocks=2, block_size=64, window=2 ** 40, recent_blocks=1))
  testing.assert_matches_dense(cfg, params, [prompt], method=method, max_new_tokens=8)


def test_bad_knobs_and_unsupported_models_are_refused(stories):
  cfg, params, tok = stories
  with pytest.raises(InputError, match="subsequences"):
    Fafo(subsequences=0)
  with pytest.raises(InputError, match="not a CompressionPolicy"):
    Fafo(policy="streaming")
  with pytest.raises(InputError, match=r"policy object, e.g. StreamingLLM\(\)"):
    Fafo(policy=StreamingLLM)                      # the class, not an instance
  with pytest.raises(InputError, match="pool must be an integer >= 1, got 2.5"):
    SnapKV(pool=2.5)
  # were TypeErrors from a comparison with None, or accepted (a bool block size, a None
  # max_commit that failed later in Fafo's check)
  with pytest.raises(InputError, match="recent_blocks must be an integer >= 1, got None"):
    SnapKV(recent_blocks=None)
  with pytest.raises(InputError, match="sink_blocks"):
    StreamingLLM(sink_blocks=None)
  with pytest.raises(InputError, match="block_size"):
    StreamingLLM(block_size=True)
  # a budget too small for the policy's fixed part (these named the empty range "[1, 1)")
  with pytest.raises(InputError, match="budget_blocks=1 with sink_blocks=1 leaves no recent"):
    StreamingLLM(budget_blocks=1)
  with pytest.raises(InputError, match="budget_blocks=2 with recent_blocks=2 leaves no block"):
    SnapKV(budget_blocks=2, recent_blocks=2)
  with pytest.raises(InputError, match="max_commit"):
    Quest(max_commit=None)
  with pytest.raises(TypeError, match="needs_queries"):
    Quest(needs_queries=False)        # not a knob (it was, and failed inside the first step)
  # were accepted: "no" (truthy) turned the output n-grams on, None turned them off (Lookahead
  # refused both)
  with pytest.raises(InputError, match="output_ngrams must be True or False"):
    Fafo(output_ngrams="no")
  with pytest.raises(InputError, match="prompt_ngrams must be True or False"):
    Fafo(prompt_ngrams=None)
  # a user's policy written as a plain (non-frozen, so unhashable) dataclass makes the method
  # unhashable: refused before prefill (get_method), not after it with jax's "Non-hashable
  # static arguments are not supported"
  @dataclasses.dataclass
  class MyPolicy:
    budget_blocks: int = 2
    block_size: int = 8
    init = StreamingLLM.init
    view = StreamingLLM.view
    update = StreamingLLM.update
  with pytest.raises(InputError, match=r"method Fafo is not hashable \(unhashable type: "
                                       r"'MyPolicy'\)"):
    sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=2, method=Fafo(policy=MyPolicy()))


def test_the_default_cache_capacity_is_whole_policy_blocks(stories):
  """Without a cache_size, start's capacity (prompt bucket + max_new_tokens, in 128s) is also
  rounded to the policy's block_size: a block of 256 or 96 was refused by FAFO's own init ('cache
  capacity 128 is not a multiple of the policy's block_size 256 (pass a cache_size ...)'), a
  capacity the caller never chose."""
  cfg, params, _ = stories
  prompts = [[1, 400, 300], [1, 401]]
  for block in (256, 96):
    method = Fafo(subsequences=2, length=2, candidates=2, pool_keys=64,
                  policy=StreamingLLM(budget_blocks=2, block_size=block))
    state, _ = api.start(cfg, params, prompts, max_new_tokens=3, method=method)
    assert state.cache.capacity == math.lcm(128, block), (block, state.cache.capacity)


def test_a_negative_or_non_integer_sink_blocks_is_named_as_what_it_is():
  """StreamingLLM(sink_blocks=-1) or a float said the budget "leaves no recent block", as if the
  budget were too small: the message now names the bad value itself; a sink count that fills the
  budget keeps the budget message."""
  for bad in (-1, 1.0, "1"):
    with pytest.raises(InputError, match=r"sink_blocks must be an integer >= 0, got "
                                         + repr(bad).replace(".", r"\.")):
      StreamingLLM(sink_blocks=bad)
  with pytest.raises(InputError, match="budget_blocks=2 with sink_blocks=2 leaves no recent"):
    StreamingLLM(budget_blocks=2, sink_blocks=2)
  assert StreamingLLM(budget_blocks=2, sink_blocks=0).sink_blocks == 0


def test_snapkv_names_the_one_bad_knob():
  """SnapKV(window=0) said "window, pool and recent_blocks must be integers >= 1, got 0, 7, 2":
  the user matched the values to the names by position. Each knob is now named alone."""
  for field in ("window", "pool", "recent_blocks"):
    with pytest.raises(InputError, match=rf"^SnapKV: {field} must be an integer >= 1, got 0$"):
      SnapKV(**{field: 0})


def test_a_user_policy_with_a_bad_block_size_or_budget_is_refused_by_name():
  """A policy of the user's own (the built-in ones check their knobs) with block_size 0 failed
  after prefill with a bare ZeroDivisionError (capacity % block_size); Fafo now checks
  the two knobs it reads itself, naming the policy and the knob."""
  @dataclasses.dataclass(frozen=True)
  class MyPolicy:
    budget_blocks: object = 2
    block_size: object = 8
    init = StreamingLLM.init
    view = StreamingLLM.view
    update = StreamingLLM.update
  for knobs, needle in (({"block_size": 0}, "block_size must be a positive integer, got 0"),
                        ({"budget_blocks": None}, "budget_blocks must be a positive integer")):
    with pytest.raises(InputError, match="fafo policy MyPolicy: " + needle):
      Fafo(policy=MyPolicy(**knobs))


def test_cli_generate_fafo_equals_dense_and_reports_stats(capsys, stories):
  import json
  from sparsedec import cli
  cfg, params, tok = stories
  argv = ["generate", "--prompt", "Once upon a time", "--max-new-tokens", "48", "--ignore-eos",
          "--json"]
  assert cli.main(argv + ["--method", "fafo", "--subsequences", "6", "--fafo-length", "3",
                          "--candidates", "4", "--policy", "snapkv", "--budget-blocks", "3",
                          "--block-size", "8"]) == 0
  got = json.loads(capsys.readouterr()[0])
  dense = sparsedec.generate(cfg, params, [tok.encode("Once upon a time")], max_new_tokens=48,
                             stop_tokens=())
  assert got["tokens"] == dense.tokens[0]
  stats = got["stats"]
  assert stats["method"] == "fafo" and stats["policy"] == "snapkv"
  assert stats["tau"] >= 1.0 and 0.0 <= stats["pool_hit_rate"] <= 1.0
  # a FAFO knob with another method is refused by name
  assert cli.main(["generate", "--prompt", "Once", "--subsequences", "4"]) == 2
  assert "--subsequences does not apply to --method dense" in capsys.readouterr()[1]


def test_a_step_cut_by_max_new_tokens_counts_its_appended_guesses(stories):
  """The step that max_new_tokens cuts appends guessed tokens only (they come first): each is an
  accepted guess. The stats counted one fewer (as if the model's token were among them)."""
  from sparsedec.decode import api
  cfg, params, tok = stories
  method = Fafo(subsequences=8, length=4, candidates=5, policy=POLICIES["streaming"])
  prompt = tok.encode("Once upon a time, there was a little girl named Lily. She liked to")
  state, run = api.start(cfg, params, [prompt], max_new_tokens=64, stop_tokens=(), method=method)
  sizes = []                                                 # tokens appended per step
  while not bool(state.done[0]):
    made = int(state.num_tokens[0])
    state = run.advance(params, state, 1)
    sizes.append(int(state.num_tokens[0]) - made)
  cut = next(i for i, size in enumerate(sizes) if size >= 3)
  limit = 1 + sum(sizes[:cut]) + 2                     # step `cut` appends 2 of its >= 3 tokens
  result = sparsedec.generate(cfg, params, [prompt], max_new_tokens=limit, stop_tokens=(),
                              method=method, return_state=True)
  assert result.active_steps == [cut + 1]
  expected = sum(size - 1 for size in sizes[:cut]) + 2
  assert int(result.state.extras.accepted_guesses[0]) == expected
  assert result.method_stats["accepted_guesses_per_step"] == round(expected / (cut + 1), 4)


def test_each_rows_figures_are_its_prompt_decoded_alone(stories):
  """A batch's per-row figures (row_tau, row_method_stats, api.method_stats(rows=[r])) are each
  prompt's decoded alone, and they add up to the batch's: stats only summed every row, so one
  request's tau or pool hit rate could not be read. The previous test's method and 64 tokens (its
  B = 1 compile)."""
  cfg, params, tok = stories
  prompts = [tok.encode("Once upon a time, there was a little girl named Lily. She liked to"),
             tok.encode("The dog")]
  method = Fafo(subsequences=8, length=4, candidates=5, policy=POLICIES["streaming"])
  row_figures.assert_rows_are_their_prompts_alone(
      cfg, params, prompts, method, ("guesses_per_step", "pool_hit_rate",
                                     "accepted_guesses_per_step"),
      max_new_tokens=64, stop_tokens=())


def test_a_stop_token_fumble_is_stored_as_the_model_guessed_it(stories):
  """A fumble token that is a stop token goes into the pool as the model's token (a candidate may
  then propose the stop) and is replaced by a context token in the subsequence only, as
  Lookahead's window does (the pool held the random replacement)."""
  from sparsedec.decode import api
  cfg, params, tok = stories
  method = Fafo(subsequences=6, length=3, candidates=2, output_ngrams=False)
  prompt = tok.encode("Once upon a time, there was a little girl named Lily.")
  state, run = api.start(cfg, params, [prompt], max_new_tokens=8, stop_tokens=(), method=method)
  guessed = np.asarray(run.advance(params, state, 1).extras.fumble[0, :, -1])   # the model's
  stop = next(int(t) for t in guessed if int(t) not in prompt)
  state, run = api.start(cfg, params, [prompt], max_new_tokens=8, stop_tokens=(stop,),
                         method=method)
  pool_before = np.asarray(state.extras.pool.values)
  state = run.advance(params, state, 1)
  assert not bool(state.done[0])                          # the row goes on
  assert stop not in pool_before
  values = np.asarray(state.extras.pool.values)           # [B, NB, A, E, V]
  stamps = np.asarray(state.extras.pool.value_stamps)
  assert (values[stamps > 0][:, -1] == stop).any()        # stored with the model's token
  fumble = np.asarray(state.extras.fumble[0, :, -1])
  assert stop not in fumble                                # replaced in the subsequences ...
  kept = guessed != stop                                   # ... and only where it was guessed
  assert kept.any() and (fumble[kept] == guessed[kept]).all(), (fumble, guessed)


def _snapkv_scores_whole_window(q, q_pos, q_valid, k, lengths, block_size, pool):
  """SnapKV's block scores as first written: the window's [B, Hkv, G, w, S] scores at once."""
  b, w, hq, d = q.shape
  hkv, s = k.shape[1], k.shape[2]
  qg = q.reshape(b, w, hkv, hq // hkv, d).astype(jnp.float32)
  scores = jnp.einsum("bwhgd,bhsd->bhgws", qg, k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * d ** -0.5
  slot = jnp.arange(s)
  ok = (slot[None, None, :] <= q_pos[:, :, None]) & (slot[None, None, :] < lengths[:, None, None])
  scores = jnp.where(ok[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(jnp.isfinite(scores), probs, 0.0) * q_valid[:, None, None, :, None]
  mass = probs.sum((2, 3))
  if pool > 1:
    mass = jax.lax.reduce_window(mass, 0.0, jax.lax.add, (1, 1, pool), (1, 1, 1), "SAME") / pool
  return mass.reshape(b, hkv, s // block_size, block_size).sum(-1)


def test_snapkv_scores_one_window_query_at_a_time_equal_the_whole_window_and_stay_small():
  """SnapKV's init scored the whole observation window at once: [B, Hkv, G, w, S] fp32 scores
  plus an fp32 copy of K, 1.5 GiB of XLA temporaries per row and layer at Llama-3.1-8B shapes,
  128K. One query a step gives the same scores (ragged lengths, invalid window entries, GQA) in
  a fraction of the memory."""
  from sparsedec.compress.snapkv import _block_scores
  rng = np.random.default_rng(0)
  b, w, hq, hkv, d, s, bs = 2, 6, 4, 2, 16, 64, 8
  q = jnp.asarray(rng.normal(size=(b, w, hq, d)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32)
  lengths = jnp.array([40, 9], jnp.int32)
  q_pos = jnp.array([[34, 35, 36, 37, 38, 39], [6, 7, 8, 9, 10, 11]], jnp.int32)
  q_valid = jnp.array([[True] * 6, [True] * 4 + [False] * 2])
  for pool in (1, 3):
    np.testing.assert_allclose(_block_scores(q, q_pos, q_valid, k, lengths, bs, pool),
                               _snapkv_scores_whole_window(q, q_pos, q_valid, k, lengths, bs,
                                                           pool), rtol=1e-5, atol=1e-6)
  # Memory at a longer cache (compiled, not run): bf16, G 4, window 32, S 16K.
  args = (jax.ShapeDtypeStruct((1, 32, 8, 64), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, 32), jnp.int32), jax.ShapeDtypeStruct((1, 32), jnp.bool_),
          jax.ShapeDtypeStruct((1, 2, 16384, 64), jnp.bfloat16),
          jax.ShapeDtypeStruct((1,), jnp.int32))
  whole_window_scores = 2 * 4 * 32 * 16384 * 4                            # bytes, fp32
  temp = jax.jit(_block_scores, static_argnums=(5, 6)).lower(*args, 64, 7).compile()
  assert temp.memory_analysis().temp_size_in_bytes < whole_window_scores / 8


@pytest.mark.parametrize("policy_type", [StreamingLLM, Quest, SnapKV])
def test_a_budget_past_the_cache_lists_every_block_in_tables_the_cache_s_length(stories,
                                                                              policy_type):
  """budget_blocks was not capped: a budget past the cache's blocks made every view (and Quest's
  and SnapKV's states) that many entries long, to list the few blocks the cache has
  (--budget-blocks 4194304 on a 16-block cache: Quest 3.8 GiB and 3x the time; a larger one ran
  out of memory). The lists are now at most the cache's blocks long, the same blocks listed."""
  from sparsedec.decode.api import start
  cfg, params, tok = stories
  prompt = tok.encode("Once upon a time, there was a little girl named Lily. She liked to")
  state, _ = start(cfg, params, [prompt], max_new_tokens=8, cache_size=64)   # 8 blocks of 8
  knobs = dict(recent_blocks=1, window=4, pool=3) if policy_type is SnapKV else {}
  listed = {}
  for budget in (8, 10 ** 5):
    policy = policy_type(budget_blocks=budget, block_size=8, **knobs)
    view = policy.view(_policy_init(policy, cfg, params, state), state.cache)
    assert view.tables.shape[-1] == 8, (budget, view.tables.shape)
    lv = view.at_layer(0)
    listed[budget] = [sorted(np.asarray(lv.tables[0, h, : int(lv.counts[0, h])]).tolist())
                      for h in range(cfg.num_kv_heads)]
  assert listed[8] == listed[10 ** 5] and listed[8][0] == [0, 1, 2], listed


def test_a_user_policy_s_malformed_view_is_refused_naming_the_policy(stories):
  """A policy of the user's own whose view() lists per-layer blocks for fewer layers than the
  model has decoded silently (jnp indexing clamped: every later layer read the last list); a
  view of the wrong type, shape or dtype failed inside attend ('unknown cache view tuple', or a
  ValueError naming no policy). Each is refused when the step is traced, naming the policy."""
  cfg, params, tok = stories
  streaming = StreamingLLM(budget_blocks=2, block_size=8)

  @dataclasses.dataclass(frozen=True)
  class MyPolicy:
    budget_blocks: int = 2
    block_size: int = 8
    mode: str = "layers"
    init = StreamingLLM.init
    update = StreamingLLM.update

    def view(self, pstate, cache):
      v = streaming.view(pstate, cache)
      if self.mode == "layers":            # lists for 2 of the model's layers
        return BlockListView(jnp.stack([v.tables] * 2), jnp.stack([v.counts] * 2), 8,
                             per_layer=True)
      if self.mode == "tuple":
        return v.tables, v.counts
      if self.mode == "heads":
        return BlockListView(v.tables[:, 0], v.counts, 8)
      return BlockListView(v.tables.astype(jnp.float32), v.counts, 8)

  prompt = tok.encode("Once upon a time")
  for mode, needle in (
      ("layers", rf"tables must be \[L, B, Hkv, NB\] \(L={cfg.num_layers}, B=1, "
                 rf"Hkv={cfg.num_kv_heads}, per_layer=True\), got shape \(2, 1, "),
      ("tuple", "returned a tuple, not a BlockListView"),
      ("heads", r"tables must be \[B, Hkv, NB\] .*got shape \(1, 2\)"),
      ("float", "tables must be integer \\(int32\\), got float32")):
    with pytest.raises(InputError, match=r"fafo policy MyPolicy\.view.*" + needle):
      sparsedec.generate(cfg, params, [prompt], max_new_tokens=4, cache_size=64,
                         method=Fafo(subsequences=2, length=2, candidates=2,
                                     policy=MyPolicy(mode=mode)))


def test_a_capacity_the_blocks_do_not_tile_is_refused_before_prefill(stories, monkeypatch):
  """The cache capacity against the policy's block_size was checked in FAFO's init, after prefill
  had compiled and run (a long prompt's prefill on a real model, for nothing); the CLI's bench
  refused it at the first batch whose capacity did not fit, after the earlier batches' warm-up."""
  from sparsedec import bench, cli
  from sparsedec.decode import api
  cfg, params, tok = stories

  def no_prefill(*args, **kwargs):
    raise AssertionError("prefill ran before the knobs were checked")
  monkeypatch.setattr(api, "prefill", no_prefill)
  method = Fafo(subsequences=2, length=2, candidates=2, policy=StreamingLLM(block_size=64))
  with pytest.raises(InputError, match="cache capacity 100 is not a multiple of the policy's "
                                       "block_size 64"):
    sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=4, cache_size=100, method=method)

  def no_generate(*args, **kwargs):
    raise AssertionError("bench ran a batch before the knobs were checked")
  monkeypatch.setattr(bench, "generate", no_generate)
  argv = ["bench", "--prompts", "humaneval", "--num-prompts", "2", "--max-new-tokens", "8",
          "--method", "fafo", "--block-size", "192", "--budget-blocks", "2"]
  with pytest.raises(InputError, match="cache capacity 640 is not a multiple of the policy's "
                                       "block_size 192"):
    cli.cmd_bench(cli._parser().parse_args(argv + ["--cache-size", "640"]))
  # Without --cache-size the CLI's check plans start's own capacities (whole 192-token blocks:
  # 384 and 768): plain plan_capacity's 384 and 640 refused the second batch that start runs.
  seen = []
  monkeypatch.setattr(bench, "generate", lambda *args, **kwargs: seen.append(1) or no_generate())
  with pytest.raises(AssertionError, match="bench ran a batch"):
    cli.cmd_bench(cli._parser().parse_args(argv))
  assert seen == [1]


def test_a_length_past_the_policys_max_commit_names_the_length_that_fits(capsys):
  """Quest's max_commit is no CLI flag: the refusal of --fafo-length 64 said only that the
  policy's max_commit is 64, not what to give instead."""
  from sparsedec import cli
  assert cli.main(["generate", "--prompt", "Once", "--method", "fafo", "--policy", "quest",
                   "--fafo-length", "64"]) == 2
  err = capsys.readouterr()[1]
  assert "length + 1 = 65 entries per step; the policy's max_commit is 64: a length " \
         "(--fafo-length) of at most 63, or a policy with max_commit >= 65" in err, err
  Fafo(length=63, policy=Quest())                   # the largest it takes


# Which blocks each policy lists, pinned on small hand-made inputs (no model: the tests above hold
# whatever the lists say, FAFO being lossless whatever its fumbles read).

def test_streaming_lists_the_sink_blocks_then_the_newest_blocks():
  """Sinks + the newest blocks, exactly: the boundary between them, a partial newest block, a row
  exactly budget_blocks long, a short row (all its blocks) and an empty row."""
  from sparsedec.compress.streaming import streaming_tables
  lengths = jnp.asarray([77, 24, 33, 32, 0], jnp.int32)          # blocks of 8: 10, 3, 5, 4, 0
  want = {1: [[0, 7, 8, 9], [0, 1, 2], [0, 2, 3, 4], [0, 1, 2, 3], []],
          2: [[0, 1, 8, 9], [0, 1, 2], [0, 1, 3, 4], [0, 1, 2, 3], []],
          0: [[6, 7, 8, 9], [0, 1, 2], [1, 2, 3, 4], [0, 1, 2, 3], []]}
  for sinks, rows in want.items():
    tables, counts = streaming_tables(lengths, 2, block_size=8, budget_blocks=4, sink_blocks=sinks)
    assert tables.shape == (5, 2, 4) and counts.shape == (5, 2)
    for b, row in enumerate(rows):
      for h in range(2):
        got = np.asarray(tables[b, h, : int(counts[b, h])]).tolist()
        assert got == row, (sinks, b, h, got, row)


def _quest_bound(q, page_min, page_max):
  """Quest's page score, written out: per (row, KV head, page) the sum over the KV head's query
  heads and the channels of max(q * min, q * max). q [B, Hq, D]; bounds [B, Hkv, P, D]."""
  b, hq, d = q.shape
  hkv = page_min.shape[1]
  qg = q.reshape(b, hkv, hq // hkv, 1, d)
  return np.maximum(qg * page_min[:, :, None], qg * page_max[:, :, None]).sum(axis=(2, 4))


def test_quest_page_bounds_are_per_channel_min_and_max_of_the_valid_slots():
  from sparsedec.compress.quest import _page_bounds
  rng = np.random.default_rng(0)
  k = rng.normal(size=(2, 2, 24, 3)).astype(np.float32)           # 3 pages of 8
  k[:, :, 20:] = 50.0                                              # past row 0's length: not read
  lengths = jnp.asarray([20, 5], jnp.int32)
  lo, hi = _page_bounds(jnp.asarray(k), lengths, 8)
  for b, n in enumerate([20, 5]):
    for p in range(3):
      slots = [s for s in range(p * 8, p * 8 + 8) if s < n]
      want_lo = k[b, :, slots].min(0) if slots else np.zeros((2, 3))
      want_hi = k[b, :, slots].max(0) if slots else np.zeros((2, 3))
      np.testing.assert_array_equal(np.asarray(lo[b, :, p]), want_lo, err_msg=f"{b} {p}")
      np.testing.assert_array_equal(np.asarray(hi[b, :, p]), want_hi, err_msg=f"{b} {p}")


def test_quest_selects_the_top_bound_pages_and_always_the_newest():
  """The budget_blocks pages of highest bound (summed over a KV head's query heads), the newest
  page whatever its bound, no page past the row's length; GQA 2:1, ragged rows, bounds that are
  not symmetric (min and max read apart)."""
  from sparsedec.compress.quest import _select
  rng = np.random.default_rng(0)
  b, hq, hkv, p, d = 2, 4, 2, 8, 5
  q = rng.normal(size=(b, hq, d)).astype(np.float32)
  page_min = rng.normal(size=(b, hkv, p, d)).astype(np.float32)
  page_max = page_min + rng.uniform(0, 6, size=(b, hkv, p, d)).astype(np.float32)
  top = lambda lo, hi: [sorted(np.argsort(-_quest_bound(q, lo, hi)[0, h, :6])[:2].tolist())  # noqa
                        for h in range(hkv)]
  # Both bounds decide here (the min alone or the max alone would pick other pages), and so does
  # the sum over the query heads (their largest bound would).
  g = q.reshape(b, hkv, hq // hkv, 1, d)
  by_max_head = np.maximum(g * page_min[:, :, None], g * page_max[:, :, None]).sum(4).max(2)
  assert top(page_min, page_max) not in (top(page_min, page_min), top(page_max, page_max),
                                         [sorted(np.argsort(-by_max_head[0, h, :6])[:2].tolist())
                                          for h in range(hkv)])
  lengths = np.array([8 * 7 - 2, 8 * 3], np.int32)               # 7 and 3 pages in use
  for row, used in enumerate([7, 3]):       # the newest page scores lowest: listed as the newest
    qsum = q[row].reshape(hkv, hq // hkv, d).sum(1)                   # [Hkv, D]
    page_min[row, :, used - 1] = page_max[row, :, used - 1] = -100.0 * np.sign(qsum)
  bound = _quest_bound(q, page_min, page_max)
  tables, counts = _select(jnp.asarray(q), jnp.asarray(page_min), jnp.asarray(page_max),
                           jnp.asarray(lengths), 8, 3)
  assert tables.shape == (b, hkv, 3)
  for row, used in enumerate([7, 3]):
    assert bound[row, :, used - 1].max() < bound[row, :, : used - 1].min()
    for h in range(hkv):
      got = sorted(np.asarray(tables[row, h, : int(counts[row, h])]).tolist())
      rest = sorted(range(used - 1), key=lambda pg: -bound[row, h, pg])[:2]
      assert got == sorted([used - 1, *rest]), (row, h, got, bound[row, h, :used])


def test_quest_update_refreshes_every_page_the_commit_touched():
  """After a commit of up to max_commit entries from `seen` on (here 12 entries across three
  pages of 8), every page's bounds are those of the cache as it is now, and the pages before
  untouched."""
  from sparsedec.compress.quest import QuestState, _page_bounds
  rng = np.random.default_rng(2)
  k = jnp.asarray(rng.normal(size=(2, 2, 32, 4)).astype(np.float32))   # 4 pages of 8
  seen = jnp.asarray([7, 16], jnp.int32)
  now = jnp.asarray([19, 16], jnp.int32)                              # row 1 committed nothing
  old = jnp.where(jnp.arange(32)[None, None, :, None] < seen[:, None, None, None], k, 0.0)
  lo, hi = _page_bounds(old, seen, 8)
  policy = Quest(budget_blocks=2, block_size=8, max_commit=12)
  st = QuestState(lo[None], hi[None], jnp.zeros((1, 2, 2, 2), jnp.int32),
                  jnp.zeros((1, 2, 2), jnp.int32), seen)
  cache = KVCache(k=(k,), v=(k,), lengths=now)
  queries = [jnp.asarray(rng.normal(size=(2, 4, 4)).astype(np.float32))]
  new = jax.jit(policy.update)(st, cache, queries)
  want_lo, want_hi = _page_bounds(k, now, 8)
  np.testing.assert_array_equal(np.asarray(new.page_min[0]), np.asarray(want_lo))
  np.testing.assert_array_equal(np.asarray(new.page_max[0]), np.asarray(want_hi))
  assert np.asarray(new.seen).tolist() == [19, 16]


def _snapkv_selection(q, pos, valid, k, lengths, bs, pool, keep, recent):
  """SnapKV's choice written out in numpy (float64): each valid window query's softmax over the
  slots it sees (<= its position, < the length), summed over the window and the KV head's query
  heads, averaged over `pool` neighbouring slots (zero past the ends), summed per block; the
  `keep` best blocks before the `recent` newest. -> per (row, KV head) the sorted block list."""
  b, w, hq, d = q.shape
  hkv, s = k.shape[1], k.shape[2]
  out = {}
  for row in range(b):
    used = -(-int(lengths[row]) // bs)
    for h in range(hkv):
      mass = np.zeros(s)
      for i in range(w):
        if not valid[row, i]:
          continue
        for g in range(hq // hkv):
          sc = k[row, h].astype(np.float64) @ q[row, i, h * (hq // hkv) + g] / np.sqrt(d)
          ok = (np.arange(s) <= pos[row, i]) & (np.arange(s) < lengths[row])
          e = np.where(ok, np.exp(sc - sc[ok].max()), 0.0)
          mass += e / e.sum()
      padded = np.concatenate([np.zeros(pool // 2), mass, np.zeros(pool - 1 - pool // 2)])
      pooled = np.array([padded[j:j + pool].sum() / pool for j in range(s)])
      block = pooled.reshape(s // bs, bs).sum(1)
      cands = max(used - recent, 0)
      out[row, h] = sorted(sorted(range(cands), key=lambda j: -block[j])[:keep])
  return out


def test_snapkv_keeps_the_blocks_of_most_pooled_window_attention(monkeypatch):
  """SnapKV's init asks for its `window` last queries, scores the blocks before the recent ones
  by pooled (width `pool`) window attention and keeps the best budget_blocks - recent_blocks;
  its view lists them, then the newest blocks. Written-out numpy selection, ragged rows (one
  with fewer candidates than the budget), an invalid window entry, GQA 2:1."""
  import types
  from sparsedec.compress import snapkv as snapkv_module
  from sparsedec.compress.snapkv import SnapKV
  rng = np.random.default_rng(21)
  b, w, hq, hkv, d, s, bs = 2, 3, 4, 2, 4, 64, 8
  lengths = np.array([45, 20], np.int32)                       # 6 and 3 blocks in use
  k = rng.normal(size=(b, hkv, s, d)).astype(np.float32) * 2
  q = rng.normal(size=(b, w, hq, d)).astype(np.float32) * 2
  pos = np.array([[42, 43, 44], [18, 19, 20]], np.int32)
  valid = np.array([[True, True, False], [True, True, False]])   # the last: not a window query
  asked = []

  def window_queries(cfg, params, state, window):
    asked.append(window)
    return (jnp.asarray(q),), jnp.asarray(pos), jnp.asarray(valid)
  monkeypatch.setattr(snapkv_module, "prompt_window_queries", window_queries)
  policy = SnapKV(budget_blocks=4, block_size=bs, recent_blocks=1, window=w, pool=3)
  cache = KVCache(k=(jnp.asarray(k),), v=(jnp.asarray(k),), lengths=jnp.asarray(lengths))
  st = policy.init(None, None, types.SimpleNamespace(cache=cache))
  assert asked == [w]
  want = _snapkv_selection(q, pos, valid, k, lengths, bs, 3, 3, 1)
  unpooled = _snapkv_selection(q, pos, valid, k, lengths, bs, 1, 3, 1)
  counted = _snapkv_selection(q, pos, np.ones_like(valid), k, lengths, bs, 3, 3, 1)
  assert want != unpooled and want != counted    # the pooling and the invalid entry decide here
  view = policy.view(st, cache).at_layer(0)
  for (row, h), chosen in want.items():
    listed = np.asarray(view.tables[row, h, : int(view.counts[row, h])]).tolist()
    newest = [5] if row == 0 else [2]          # row 1: 2 candidates, both kept; then block 2
    assert sorted(listed[:-1]) == chosen and listed[-1:] == newest, (row, h, listed, chosen)


def test_each_step_s_fumbles_pool_and_candidates_follow_the_algorithm_by_hand(stories):
  """Lossless output does not show how well FAFO guesses: a fumble fed the wrong tokens, a guess
  stored under the wrong key or a lookup under a shorter suffix only lower tau. Step by step, from
  the state before it, recomputed here with plain calls:
  * each subsequence's new token is the model's argmax after its own k tokens, placed at
    p + 1 + j .. p + j + k, reading C(kv) and nothing else in flight (one small forward per
    subsequence); the subsequence drops its oldest token into the discarded buffer;
  * the pool afterwards equals the pool before plus, in order, each subsequence's new guess under
    every suffix of its discarded buffer (longest first, as many tokens as active steps, at most
    k), then the k-token spans ending at each appended token under up to k tokens before them;
  * the step's candidates are the pool's lookup under the last k decoded tokens: the step counts
    them (guesses, hit_steps) and appends 1 + the longest prefix of one that dense greedy takes."""
  from sparsedec.attention import AttentionPlan, Segment
  from sparsedec.ngram import pool as ngram_pool
  cfg, params, tok = stories
  method = Fafo(subsequences=8, length=4, candidates=5, policy=POLICIES["streaming"])
  n, k, m = method.subsequences, method.length, method.candidates
  prompt = tok.encode("Once upon a time, there was a little girl named Lily. She liked to")
  truth = sparsedec.generate(cfg, params, [prompt], max_new_tokens=64, stop_tokens=(),
                             return_state=True).state
  truth = np.asarray(truth.tokens[0, : int(truth.num_tokens[0])]).tolist()
  state, run = api.start(cfg, params, [prompt], max_new_tokens=64, stop_tokens=(), method=method)
  causal = AttentionPlan(jnp.asarray(np.tril(np.ones((k, k), bool))), ())
  lookup = jax.jit(ngram_pool.lookup, static_argnames="num")
  hits, sizes = 0, []
  for step in range(12):
    x = jax.tree.map(np.array, state.extras)        # (advance donates the state's buffers)
    num = int(state.num_tokens[0])
    seq = np.asarray(state.tokens[0, :num]).tolist()
    cands, ok = lookup(x.pool, jnp.asarray([seq[-k:]], jnp.int32), jnp.asarray([min(num, k)]),
                       num=m)
    cands = np.asarray(cands[0])[np.asarray(ok[0])].tolist()
    view = method.policy.view(x.policy_state, state.cache)
    plan = causal.replace(segments=(Segment(view, 0, k),))
    fumble = np.asarray(x.fumble[0]).tolist()
    new = []
    for j in range(n):
      positions = state.cache.lengths[:, None] + 1 + j + jnp.arange(k)[None]
      logits, _ = _forward(cfg, params, jnp.asarray([fumble[j]], jnp.int32), positions,
                           state.cache, plan)
      new.append(int(jnp.argmax(logits[0, -1])))

    after = run.advance(params, state, 1)
    y = after.extras
    appended = int(after.num_tokens[0]) - num
    assert seq + np.asarray(after.tokens[0, num: num + appended]).tolist() == truth[:num + appended]
    longest = max([next((i for i in range(k) if c[i] != truth[num + i]), k) for c in cands],
                  default=0)
    assert appended == 1 + longest, (step, appended, cands, truth[num: num + k])
    assert int(y.guesses[0] - x.guesses[0]) == len(cands), step
    assert int(y.hit_steps[0] - x.hit_steps[0]) == int(bool(cands)), step
    hits, sizes = hits + bool(cands), sizes + [appended]
    guess = [f[1:] + [t] for f, t in zip(fumble, new)]
    discarded = [d[1:] + [f[0]] for d, f in zip(np.asarray(x.discarded[0]).tolist(), fumble)]
    assert np.asarray(y.fumble[0]).tolist() == guess, step
    assert np.asarray(y.discarded[0]).tolist() == discarded, step
    real = min(step + 1, k)                                  # discarded tokens so far
    items = [(tuple(d[k - length:]), tuple(g)) for d, g in zip(discarded, guess)
             for length in range(real, 0, -1)]
    full = seq + np.asarray(after.tokens[0, num: num + appended]).tolist()
    for last in range(num, num + appended):                   # output n-grams
      start = last - k + 1
      items += [(tuple(full[start - length: start]), tuple(full[start: last + 1]))
                for length in range(min(start, k), 0, -1)]
    assert_pools_equal(y.pool, insert_items(x.pool, items), str(step))
    state = after
  assert hits >= 4 and max(sizes) >= 3, (hits, sizes)      # lookups hit, guesses were taken


def test_candidates_come_from_the_longest_suffix_key_first(stories):
  """The step looks candidates up under the last k decoded tokens, longest key first: a pool whose
  k-token key holds the right continuation and whose 1-token key holds more (newer) wrong ones
  than there are candidate slots accepts all k guessed tokens. Under one-token keys only, the
  same text came out (lossless) with fewer tokens per step: no equality test saw it."""
  cfg, params, tok = stories
  method = Fafo(subsequences=8, length=4, candidates=5, policy=POLICIES["streaming"])
  k, m = method.length, method.candidates
  prompt = tok.encode("Once upon a time, there was a little girl named Lily. She liked to")
  truth = sparsedec.generate(cfg, params, [prompt], max_new_tokens=8, stop_tokens=(),
                             return_state=True).state
  truth = np.asarray(truth.tokens[0, : int(truth.num_tokens[0])]).tolist()
  state, run = api.start(cfg, params, [prompt], max_new_tokens=64, stop_tokens=(), method=method)
  num = int(state.num_tokens[0])
  wrong = [t for t in range(3, 100) if t != truth[num]][: m + 1]
  items = [(tuple(truth[num - k: num]), tuple(truth[num: num + k]))]
  items += [((truth[num - 1],), (t,) * k) for t in wrong]           # newer, shorter key, wrong
  pool = insert_items(jax.tree.map(np.array, state.extras.pool), items)
  state = state.replace(extras=state.extras.replace(pool=pool))
  after = run.advance(params, state, 1)
  assert int(after.num_tokens[0]) - num == k + 1
  assert np.asarray(after.tokens[0, num: num + k + 1]).tolist() == truth[num: num + k + 1]
  assert int(after.extras.accepted_guesses[0]) == k
