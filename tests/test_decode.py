"""Dense decoding: cache + while_loop equal full recompute; batching; compile-once; bad input."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsedec
from sparsedec import testing
from sparsedec.attention import causal_plan
from sparsedec.decode.api import prompt_bucket
from sparsedec.kv.dense import init_cache
from sparsedec.model.config import ModelConfig, RopeScaling
from sparsedec.model.forward import forward
from sparsedec.model.params import init_random


TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, max_position_embeddings=512)
CONFIGS = {
    "llama3": ModelConfig(family="llama", rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16),
                          **TINY),
    "mistral_window": ModelConfig(family="mistral", sliding_window=6, **TINY),
    "qwen2": ModelConfig(family="qwen2", qkv_bias=True, tie_word_embeddings=True, **TINY),
    "qwen3": ModelConfig(family="qwen3", qk_norm=True, **{**TINY, "head_dim": 16}),
}


def recompute_greedy(cfg, params, prompt, n):
  """Greedy by re-running the whole sequence each token, no cache: the simplest reference.
  The sequence is right-padded to one length (causal attention ignores the padding)."""
  width = len(prompt) + n
  fwd = jax.jit(forward, static_argnums=0)
  seq = list(prompt)
  for _ in range(n):
    padded = jnp.asarray([seq + [0] * (width - len(seq))])
    logits, _ = fwd(cfg, params, padded, jnp.arange(width)[None], init_cache(cfg, 1, 1),
                    causal_plan(width))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_decode_equals_full_recompute(name):
  cfg = CONFIGS[name]
  params = init_random(cfg, jax.random.key(1), scale=0.3)
  prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
  result = sparsedec.generate(cfg, params, prompts, max_new_tokens=12, stop_tokens=(),
                              prefill_chunk=4)
  for prompt, got in zip(prompts, result.tokens):
    assert got == recompute_greedy(cfg, params, prompt, 12)


def test_stories_batch_rows_equal_single_rows(stories):
  cfg, params, tok = stories
  texts = ["Once upon a time", "The cat sat on the mat and looked at the big red ball",
           "Lily"]
  prompts = [tok.encode(t) for t in texts]
  assert len({len(p) for p in prompts}) == 3
  batched = sparsedec.generate(cfg, params, prompts, max_new_tokens=64, stop_tokens=())
  for i, prompt in enumerate(prompts):
    single = sparsedec.generate(cfg, params, [prompt], max_new_tokens=64, stop_tokens=())
    testing.assert_tokens_equal([batched.tokens[i]], single.tokens, label=f"batch row {i}")
  assert all(len(t) == 64 for t in batched.tokens)


def test_method_stats_refuses_bad_rows_by_name_and_a_stats_without_rows(stories):
  """api.method_stats(method, state, rows): rows that are not integer indices of the batch,
  repeated or none are refused naming the problem; a user method whose stats(state) takes no
  rows still reports the batch (rows None, and generate's result, without per-row figures) and
  is refused by name when rows are asked for. The previous test's batch (its compiles)."""
  import dataclasses
  from sparsedec.decode import api
  from sparsedec.decode.dense import Dense
  from sparsedec.errors import InputError
  cfg, params, tok = stories
  texts = ["Once upon a time", "The cat sat on the mat and looked at the big red ball", "Lily"]
  prompts = [tok.encode(t) for t in texts]
  result = sparsedec.generate(cfg, params, prompts, max_new_tokens=64, stop_tokens=(),
                              return_state=True)
  state, dense = result.state, Dense()
  assert result.row_method_stats == [{}] * 3 and result.row_tau == [1.0] * 3
  rows = result.stats(per_row=True)["rows"]
  assert rows == [{"generated_tokens": 64, "active_steps": 63, "tau": 1.0}] * 3
  assert "rows" not in result.stats()                        # what the CLI prints: unchanged
  assert api.method_stats(dense, state, rows=np.array([2, 0])) == {}
  for rows, match in [([3], "row 3 is outside the batch of 3"), ([-1], "row -1 is outside"),
                      ([0.0], "integer row indices .* got 0.0"), (["1"], "integer row indices"),
                      ([True], "integer row indices"), (1, "a sequence of row indices"),
                      ("01", "a sequence of row indices"), ([], "rows is empty"),
                      ([1, 0, 1], "row 1 is given twice")]:
    with pytest.raises(InputError, match=match):
      api.method_stats(dense, state, rows=rows)

  @dataclasses.dataclass(frozen=True)
  class OldStats(Dense):
    name: str = "old_stats"

    def stats(self, state):
      return {"rows_seen": int(state.batch_size)}

  old = OldStats()
  assert api.method_stats(old, state) == {"rows_seen": 3}
  with pytest.raises(InputError, match="method 'old_stats''s stats.state. takes no rows"):
    api.method_stats(old, state, rows=[0])
  with pytest.raises(InputError, match="row 3 is outside"):       # bad rows first, any method
    api.method_stats(old, state, rows=[3])
  run = api.Run(cfg, old, state.built_for[1], 64)
  got = api._result(state, run, prefill_seconds=0.0, decode_seconds=0.0, compile_seconds=0.0)
  assert got.method_stats == {"rows_seen": 3} and got.row_method_stats == []
  assert "rows" in got.stats(per_row=True)


def test_stories_chunked_prefill_equals_one_chunk(stories):
  cfg, params, tok = stories
  prompt = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play "
                      "outside in the park with her friends every day.")
  assert len(prompt) > 16
  one = sparsedec.generate(cfg, params, [prompt], max_new_tokens=32, stop_tokens=())
  chunked = sparsedec.generate(cfg, params, [prompt], max_new_tokens=32, stop_tokens=(),
                               prefill_chunk=8)
  assert one.tokens == chunked.tokens


def _drain(slices):
  """A stream run to its end: (each row's tokens joined, each slice's sizes per row, the
  generator's return value)."""
  got, sizes = None, []
  while True:
    try:
      new = next(slices)
    except StopIteration as end:
      return got, sizes, end.value
    got = got or [[] for _ in new]
    sizes.append([len(t) for t in new])
    for row, tokens in zip(got, new):
      row.extend(tokens)


def test_stop_token_ends_row_and_is_kept():
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(2), scale=0.3)
  free = sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=16, stop_tokens=())
  stop = free.tokens[0][5]
  first = free.tokens[0].index(stop)
  stopped = sparsedec.generate(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=16,
                               stop_tokens=(stop,), return_state=True)
  assert stopped.tokens[0] == free.tokens[0][: first + 1]
  assert stopped.stopped[0]
  # A finished row's cache stops growing: it holds every token but the last (not yet forwarded),
  # not the forwards the loop ran for the other row after it stopped.
  state = stopped.state
  assert len(stopped.tokens[0]) < len(stopped.tokens[1])
  np.testing.assert_array_equal(np.asarray(state.cache.lengths), np.asarray(state.num_tokens) - 1)
  # Row 1 ran to max_new_tokens, not onto the stop token: stopped says which row ended how, and
  # a finished row is not counted in the steps after it stopped (dense: one token a step).
  assert len(stopped.tokens[1]) == 16 and stop not in stopped.tokens[1]
  assert stopped.stopped == [True, False]
  assert stopped.active_steps == [len(t) - 1 for t in stopped.tokens] and stopped.steps == 15
  assert stopped.tau == 1.0
  assert stopped.stats()["generated_tokens"] == first + 1 + 16
  # stream, in slices of 3 steps: prefill's token first, then at most 3 tokens a row a slice, []
  # for the stopped row, until the longer row ends (not when the first row does); the slices
  # joined are generate's tokens, no token yielded twice or skipped at a slice's edge.
  from sparsedec.decode.api import stream
  slices = stream(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=16,
                  stop_tokens=(stop,), interval=3)
  got, sizes, result = _drain(slices)
  assert got == result.tokens == stopped.tokens and result.stopped == [True, False]
  assert sizes[0] == [1, 1] and len(sizes) == 6 and all(n[1] == 3 for n in sizes[1:])
  assert sizes[-1][0] == 0 and result.active_steps == stopped.active_steps


def test_a_prompt_ending_on_a_chunks_first_token_draws_from_its_logits():
  """Prompts of 1, 5 and 9 tokens prefilled in chunks of 4: each one's last token is the first of
  a chunk, where the first new token's logits are taken (a `>` for `>=` there drew every such
  row's first token from zero logits: token 0)."""
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(3), scale=0.3)
  prompts = [[7], [5, 6, 7, 8, 9], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
  padded = jnp.asarray([p + [0] * (9 - len(p)) for p in prompts])
  logits, _ = jax.jit(forward, static_argnums=0)(
      cfg, params, padded, jnp.broadcast_to(jnp.arange(9), (3, 9)), init_cache(cfg, 3, 1),
      causal_plan(9))
  want = [int(jnp.argmax(logits[i, len(p) - 1])) for i, p in enumerate(prompts)]
  assert 0 not in want          # else zero logits' argmax would pass
  got = sparsedec.generate(cfg, params, prompts, max_new_tokens=1, stop_tokens=(),
                           prefill_chunk=4)
  assert [t[0] for t in got.tokens] == want


def test_bf16_rope_tables_take_the_angles_in_fp32():
  """cos / sin for a bf16 model are the fp32 tables rounded to bf16: angles from bf16 positions
  (8 significant bits: position 4097 is 4096) rotate long-context keys by the wrong angle."""
  from sparsedec.model.rope import rope_tables
  cfg = CONFIGS["llama3"]
  positions = jnp.asarray([[0, 1, 257, 4097, 30001, 131071]], jnp.int32)
  want = [np.asarray(t.astype(jnp.bfloat16), np.float32)
          for t in rope_tables(cfg, positions, jnp.float32)]
  got = [np.asarray(t, np.float32)
         for t in rope_tables(cfg.replace(dtype="bfloat16"), positions, jnp.bfloat16)]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


def test_second_prompt_in_same_bucket_does_not_recompile(stories):
  cfg, params, tok = stories
  a, b = tok.encode("Once upon a time"), tok.encode("The dog ran to the park")
  assert len(a) != len(b) and prompt_bucket(len(a)) == prompt_bucket(len(b))
  sparsedec.generate(cfg, params, [a], max_new_tokens=24)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None)
  try:
    sparsedec.generate(cfg, params, [b], max_new_tokens=24)
  finally:
    jax.monitoring.clear_event_listeners()
  assert compiles == [], f"recompiled: {compiles}"


def test_sampling_and_stop_tokens_do_not_compile_the_method_init_again(stories):
  """The method's init reads neither the sampling config nor the stop tokens: a run that
  changes only those reuses the compiled init (it took them as static arguments and compiled
  it again, ~5-12 s for QuantSpec's on CPU)."""
  from sparsedec.decode import api, loop
  cfg, params, tok = stories
  prompt = [tok.encode("Once upon a time")]
  api.start(cfg, params, prompt, max_new_tokens=4)
  before = loop._init_method._cache_size()
  api.start(cfg, params, prompt, max_new_tokens=4, stop_tokens=(),
            sampling=sparsedec.SamplingConfig(temperature=0.7), seed=1)
  assert loop._init_method._cache_size() == before


def test_stream_takes_generate_arguments(stories):
  """stream is "like generate": return_state=True gives the final state with the result (it
  raised a TypeError from start), and the streamed tokens are generate's."""
  from sparsedec.decode import api
  cfg, params, tok = stories
  prompts = [tok.encode("Once upon a time"), tok.encode("Lily")]
  kw = dict(max_new_tokens=12, stop_tokens=(), return_state=True)
  want = sparsedec.generate(cfg, params, prompts, **kw)
  slices = api.stream(cfg, params, prompts, interval=5, **kw)
  got, _, result = _drain(slices)
  assert got == result.tokens == want.tokens
  assert result.state is not None
  np.testing.assert_array_equal(result.state.tokens, want.state.tokens)


def test_sampling_first_token_distribution_matches_processed_probs(stories):
  """Draws of the first token over many seeds follow softmax(top-k/top-p(logits / T))."""
  from scipy import stats
  cfg, params, tok = stories
  prompt = tok.encode("Lily and Tom went to the")
  sampling = sparsedec.SamplingConfig(temperature=1.3, top_k=12, top_p=0.9)
  n = 1000
  result = sparsedec.generate(cfg, params, [prompt] * n, max_new_tokens=1, sampling=sampling,
                              seed=list(range(n)))
  draws = np.array([t[0] for t in result.tokens])
  logits = testing.dense_logits(cfg, params, prompt)[-1]
  # independent numpy top-k / top-p
  x = logits.astype(np.float64) / 1.3
  x[x < np.sort(x)[-12]] = -np.inf
  order = np.argsort(-x)
  p = np.exp(x[order] - x[order[0]])
  p /= p.sum()
  keep = (np.cumsum(p) - p) < 0.9
  probs = np.zeros_like(x)
  probs[order[keep]] = p[keep] / p[keep].sum()
  support = np.nonzero(probs)[0]
  assert len(support) >= 5, "the test needs a spread-out distribution to mean anything"
  assert set(draws) <= set(support), "drew a token outside top-k/top-p"
  observed = np.array([(draws == t).sum() for t in support])
  # chi-square goodness of fit, false-alarm rate 1e-3
  expected = probs[support].astype(np.float64) / probs[support].sum() * n
  assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_each_sampled_token_draws_with_a_fresh_key():
  """Near-uniform logits (a near-zero model) at T = 1: consecutive tokens of a row are
  independent draws, equal about 1 / V of the time. A step reusing its row's key (prefill's or
  the previous step's) draws every token with the same Gumbel noise: the same token again."""
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(4), scale=1e-4)
  n = 200
  result = sparsedec.generate(cfg, params, [[1, 2, 3]] * n, max_new_tokens=4, stop_tokens=(),
                              sampling=sparsedec.SamplingConfig(temperature=1.0),
                              seed=list(range(n)))
  toks = np.array(result.tokens)                                          # [n, 4]
  assert len(set(toks[:, 0])) > 50                  # spread over the vocabulary, per-row seeds
  for j in range(3):
    same = float((toks[:, j] == toks[:, j + 1]).mean())
    assert same < 0.1, f"tokens {j} and {j + 1} equal in {same:.0%} of rows"


def test_each_row_samples_with_its_own_seed():
  """seed=[a, b]: row 0 draws with a and row 1 with b, as each prompt alone with its seed (the
  seeds given to the rows in another order passed every test of sampled distributions, whose
  rows had equal prompts)."""
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(4), scale=1e-4)
  kw = dict(max_new_tokens=6, stop_tokens=(), sampling=sparsedec.SamplingConfig(temperature=1.0))
  prompts = [[1, 2, 3], [4, 5]]
  both = sparsedec.generate(cfg, params, prompts, seed=[5, 9], **kw).tokens
  alone = [sparsedec.generate(cfg, params, [p], seed=s, **kw).tokens[0]
           for p, s in zip(prompts, (5, 9))]
  assert both == alone
  assert sparsedec.generate(cfg, params, prompts, seed=[9, 5], **kw).tokens != both


@pytest.mark.parametrize("temperature", [1e-10, 1e-30])
def test_tiny_temperatures_give_the_argmax_under_jit(stories, temperature):
  """At T -> 0 the distribution is the argmax one-hot. Computed as l / T - max(l / T) under jit,
  XLA rounded the two terms differently and exp overflowed (NaN probabilities: FAFO, Lookahead
  and QuantSpec's argmax draft drew token 0 at T = 1e-10)."""
  from sparsedec.decode.sampling import probabilities
  cfg, params, tok = stories
  logits = jnp.asarray(testing.dense_logits(cfg, params, tok.encode("Once upon a time")))  # [T, V]
  sampling = sparsedec.SamplingConfig(temperature=temperature)
  probs = np.asarray(jax.jit(lambda x: probabilities(x, sampling))(logits))
  np.testing.assert_array_equal(probs, np.eye(logits.shape[-1])[np.argmax(logits, -1)])


@pytest.mark.parametrize("knobs", [dict(temperature=1e39, top_k=1),
                                   dict(temperature=1e300, top_k=1),
                                   dict(temperature=1e39, top_p=1e-6),
                                   dict(temperature=1.0, top_p=1e-300),
                                   dict(temperature=1e-5, top_p=1e-300)])
def test_top_k_1_and_tiny_top_p_give_the_argmax_at_any_temperature(stories, knobs):
  """top_k=1 and a top_p below the top token's mass keep only the argmax whatever T is. Top-k /
  top-p compared the scaled logits, and a T past float32's largest is inf there: every scaled
  logit 0, all tied, the whole vocabulary kept (top_k=1 at T = 1e39 drew uniformly). A top_p
  below float32's smallest positive number is 0 in fp32: no token kept, NaN probabilities
  (every draw token 0)."""
  from sparsedec.decode.sampling import probabilities
  cfg, params, tok = stories
  logits = jnp.asarray(testing.dense_logits(cfg, params, tok.encode("Once upon a time")))  # [T, V]
  sampling = sparsedec.SamplingConfig(**knobs)
  probs = np.asarray(jax.jit(lambda x: probabilities(x, sampling))(logits))
  np.testing.assert_array_equal(probs, np.eye(logits.shape[-1])[np.argmax(logits, -1)])


def test_a_huge_temperature_is_uniform_over_the_top_k(stories):
  """T past float32's largest (inf in fp32): the limit, uniform over the top-k tokens, not NaN
  (-inf / inf) nor the whole vocabulary."""
  from sparsedec.decode.sampling import probabilities
  cfg, params, tok = stories
  logits = jnp.asarray(testing.dense_logits(cfg, params, tok.encode("Once upon a time")))
  sampling = sparsedec.SamplingConfig(temperature=1e39, top_k=5)
  probs = np.asarray(jax.jit(lambda x: probabilities(x, sampling))(logits))
  top5 = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
  want = np.zeros_like(probs)
  np.put_along_axis(want, top5, 0.2, axis=-1)
  np.testing.assert_allclose(probs, want, rtol=1e-6)


@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                   dict(temperature=2.0, top_p=0.5)])
def test_inf_logits_share_the_mass_in_the_speculative_methods_as_in_sample(knobs):
  """+inf logits (a model whose logits overflowed float32): `sample` (dense decoding) draws the
  inf tokens, but `probabilities` (what Lookahead, FAFO and QuantSpec verify and draw from) was
  NaN everywhere (inf - inf), and their inverse-CDF draw then gave token 0, a token dense
  sampling never gives. Now the inf tokens share the mass, softmax's limit, in both."""
  from sparsedec.decode.sampling import probabilities, sample
  from sparsedec.decode.verify import draw_from
  sampling = sparsedec.SamplingConfig(**knobs)
  logits = jnp.asarray([[1.0, jnp.inf, 2.0, 0.5, jnp.inf, -jnp.inf],
                        [1.0, 3.0, 2.0, 0.5, 0.0, -1.0]])                  # [2, V]
  probs = np.asarray(jax.jit(lambda x: probabilities(x, sampling))(logits))
  np.testing.assert_array_equal(probs[0], [0, 0.5, 0, 0, 0.5, 0])
  assert np.isfinite(probs[1]).all() and abs(probs[1].sum() - 1) < 1e-6 and probs[1, 1] > 0
  assert int(draw_from(probs[:1], jnp.asarray([0.7]))[0]) == 4
  drawn = {int(sample(logits[:1], jax.random.split(jax.random.key(i), 1), sampling)[0])
           for i in range(40)}
  assert drawn == {1, 4}


@pytest.mark.parametrize("kwargs, message", [
    (dict(sampling_kw=dict(top_p=0.0)), "top_p"),
    (dict(sampling_kw=dict(top_p=1.5)), "top_p"),
    (dict(sampling_kw=dict(temperature=-1.0)), "temperature"),
    (dict(sampling_kw=dict(top_k=-3)), "top_k"),
    (dict(sampling_kw=dict(temperature=float("inf"))), "temperature"),   # top-k then kept all
    (dict(sampling_kw=dict(temperature=1e-40)), "temperature"),          # logits / T overflowed
    (dict(sampling_kw=dict(top_k=True)), "top_k"),
    (dict(sampling_kw=dict(temperature=10 ** 400)), "temperature"),     # was an OverflowError
])
def test_bad_sampling_parameters(kwargs, message):
  with pytest.raises(sparsedec.InputError, match=message):
    sparsedec.SamplingConfig(**kwargs["sampling_kw"])


def test_jax_scalars_are_taken_as_numpy_ones_and_traced_knobs_refused_by_name():
  """A concrete jax scalar (jnp.float32(0.5)) was refused as "temperature must be >= 0 ..., got
  Array(0.5)"; it is taken as a numpy scalar is. A traced one cannot set a static config: refused
  by name, not with jax's ConcretizationTypeError."""
  got = sparsedec.SamplingConfig(temperature=jnp.float32(0.5), top_k=jnp.int32(5),
                                 top_p=jnp.asarray(0.9))
  assert got == sparsedec.SamplingConfig(temperature=0.5, top_k=5, top_p=float(np.float32(0.9)))
  assert type(got.temperature) is float and type(got.top_k) is int
  with pytest.raises(sparsedec.InputError, match="top_k"):
    sparsedec.SamplingConfig(top_k=jnp.asarray(True))
  with pytest.raises(sparsedec.InputError, match="temperature is traced"):
    jax.jit(lambda t: sparsedec.SamplingConfig(temperature=t).top_k)(0.5)


def test_numpy_scalars_and_wide_seeds_are_taken_and_loop_slices_checked():
  """numpy scalars as sampling knobs (stored as Python numbers: one jit cache key); seeds past
  int32 (2**31, a getrandbits(32) value) taken modulo 2**32 instead of an OverflowError; a
  stream interval or advance of 0 steps refused (it looped forever); and tokens/s counts the
  decode loop's tokens only (with max_new_tokens = 1 the loop makes none)."""
  from sparsedec.decode import api
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  numpy_cfg = sparsedec.SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(5))
  assert numpy_cfg == sparsedec.SamplingConfig(temperature=0.5, top_k=5)
  sampling = sparsedec.SamplingConfig(temperature=1.0)
  wide = sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=6, sampling=sampling,
                            seed=2 ** 32 + 7)
  assert wide.tokens == sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=6,
                                           sampling=sampling, seed=7).tokens
  sparsedec.generate(cfg, params, [[1, 2, 3]] * 2, max_new_tokens=2, seed=[2 ** 31, 2 ** 40])
  with pytest.raises(sparsedec.InputError, match="seed must be an int"):
    sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=2, seed=1.5)
  with pytest.raises(sparsedec.InputError, match="interval must be an integer >= 1"):
    next(api.stream(cfg, params, [[1, 2, 3]], interval=0, max_new_tokens=4))
  state, run = api.start(cfg, params, [[1, 2, 3]], max_new_tokens=4)
  with pytest.raises(sparsedec.InputError, match="steps must be None or an integer >= 1"):
    run.advance(params, state, 0)
  one = sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=1)
  assert one.num_generated == 1 and one.tokens_per_second == 0.0
  for kwargs, message in ((dict(stop_tokens=2), "stop_tokens must be a sequence of token ids"),
                          (dict(cache_size=64.0), "cache_size must be an integer > 0"),
                          (dict(prefill_chunk=4.0), "prefill_chunk must be a power of two")):
    with pytest.raises(sparsedec.InputError, match=message):
      sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=2, **kwargs)
  sparsedec.generate(cfg, params, [np.array([1, 2, 3])], max_new_tokens=2, stop_tokens={5, 6})


def test_prompt_longer_than_cache_is_an_error():
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  with pytest.raises(sparsedec.InputError, match="does not fit in the KV cache of 32"):
    sparsedec.generate(cfg, params, [list(range(30))], max_new_tokens=8, cache_size=32)
  with pytest.raises(sparsedec.InputError, match="max_position_embeddings"):
    sparsedec.generate(cfg, params, [list(range(90))] , max_new_tokens=500)


@pytest.mark.parametrize("method", [sparsedec.decode.methods.get_method("lookahead", window=100000),
                                    sparsedec.decode.methods.get_method("fafo", subsequences=100000)],
                         ids=["lookahead", "fafo"])
def test_a_step_that_cannot_fit_in_memory_is_refused_before_prefill(method, monkeypatch):
  """A Lookahead window or FAFO subsequence count of 100000 (T = 400028 tokens a forward) ran
  prefill, then died inside the step's trace with a bare MemoryError (its [T, T] mask); now
  api.start refuses it by name before prefill runs."""
  from sparsedec.decode import api
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  monkeypatch.setattr(api, "prefill", lambda *a, **k: pytest.fail("prefill ran"))
  with pytest.raises(sparsedec.InputError,
                     match=r"cannot fit in memory.*\[40002[89], 40002[89]\] in-flight mask"):
    sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=8, method=method)


def test_memory_bounds_count_the_cache_and_the_reference_scores_against_the_device(monkeypatch):
  """A device reporting its allocator (a GPU) offers its limit less what is in use; a CPU device
  the host's memory; one that reports neither is not checked. The KV cache always counts, the
  reference path's scores only where that path is certain (not with attention="interpret")."""
  from sparsedec.decode import fits

  class Device:
    def __init__(self, platform, stats):
      self.platform, self._stats = platform, stats

    def memory_stats(self):
      return self._stats

  monkeypatch.setattr(fits, "host_memory_bytes", lambda: 5000)
  assert fits.device_memory_bytes(Device("gpu", {"bytes_limit": 10, "bytes_in_use": 4})) == 6
  assert fits.device_memory_bytes(Device("cpu", None)) == 5000
  assert fits.device_memory_bytes(Device("tpu", {})) is None
  cpu = jax.devices("cpu")[0]
  with jax.default_device("cpu"):                  # a platform name, as jax.default_device takes
    assert fits.run_devices(None) == {cpu}
  assert fits.run_devices(jax.device_put(np.zeros(2), cpu)) == {cpu}
  # 2 layers, 2 KV heads, head_dim 8, fp32: 256 bytes a cache slot; the jnp reference path.
  cfg = dataclasses.replace(CONFIGS["llama3"], attention="reference")
  params = init_random(cfg, jax.random.key(0))
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: 5000)
  # 4 rows x 128 slots: a 131072-byte cache, over the 5000 bytes the device has.
  with pytest.raises(sparsedec.InputError, match=r"the KV cache \(4 rows x 128 slots\) 0.125 MiB"
                     r".*attention scores \[4, 4, 1, 129\]"):
    sparsedec.generate(cfg, params, [[1, 2, 3]] * 4, max_new_tokens=8)
  need = fits.run_lower_bounds(cfg, 1, 4, 128, reference_path=False)
  assert sum(need.values()) == 4 * 128 * 256 + 1 and not any("scores" in k for k in need)
  dense = sparsedec.decode.methods.get_method("dense")
  exact = 4 * 128 * 256 + 1 + 4 * 4 * 129 * 4          # cache, [1, 1] mask, scores
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: exact)
  fits.check_run_fits(cfg, dense, 4, 128, None)                       # fits exactly
  with pytest.raises(sparsedec.InputError, match="cannot fit"):
    fits.check_run_fits(cfg, dense, 4, 129, None)
  # "auto" on a CPU device counts the scores (the reference is its only path there);
  # "interpret" runs the kernel, which holds no scores.
  on_cpu = jax.device_put(np.zeros(2), cpu)
  with pytest.raises(sparsedec.InputError, match="cannot fit"):
    fits.check_run_fits(dataclasses.replace(cfg, attention="auto"), dense, 4, 129, on_cpu)
  fits.check_run_fits(dataclasses.replace(cfg, attention="interpret"), dense, 4, 129, on_cpu)


def test_max_new_tokens_and_cache_size_at_their_bounds():
  """A prompt plus max_new_tokens filling the cache exactly is taken and decodes as with the
  default capacity; one token more is refused; max_new_tokens 0 is refused (it would run and give
  empty rows under a check of < 0), 1 gives prefill's token alone."""
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0), scale=0.3)
  prompt = list(range(1, 25))
  kw = dict(stop_tokens=())
  full = sparsedec.generate(cfg, params, [prompt], max_new_tokens=8, cache_size=32, **kw)
  assert full.tokens == sparsedec.generate(cfg, params, [prompt], max_new_tokens=8, **kw).tokens
  assert len(full.tokens[0]) == 8
  with pytest.raises(sparsedec.InputError, match="= 33 does not fit in the KV cache of 32"):
    sparsedec.generate(cfg, params, [prompt], max_new_tokens=9, cache_size=32, **kw)
  with pytest.raises(sparsedec.InputError, match="max_new_tokens must be an integer >= 1"):
    sparsedec.generate(cfg, params, [prompt], max_new_tokens=0, **kw)
  one = sparsedec.generate(cfg, params, [prompt], max_new_tokens=1, **kw)
  assert one.tokens == [full.tokens[0][:1]] and one.steps == 0


def test_generate_s_docstring_names_every_keyword():
  """help(sparsedec.generate) says what each keyword does: method, cache_size, prefill_chunk and
  return_state were named nowhere (prefill_chunk nowhere user-facing: what it is, which values it
  takes, whether the output depends on it)."""
  import inspect
  doc = sparsedec.generate.__doc__
  for name in list(inspect.signature(sparsedec.generate).parameters)[3:]:
    assert f"`{name}`" in doc, f"generate's docstring does not name `{name}`"
  assert "power of two" in doc and "do not depend on it" in doc


def test_a_run_past_the_context_or_cache_says_what_fits():
  """The refusal says how many new tokens the longest prompt leaves room for, or that the prompt
  alone fills the context / cache (it named only the sum, and the CLI's default --max-new-tokens
  128 left a user with a 401-token prompt on a 512-token model to do the arithmetic)."""
  cfg = CONFIGS["llama3"]                                      # max_position_embeddings 512
  params = init_random(cfg, jax.random.key(0))
  with pytest.raises(sparsedec.InputError,
                     match=r"= 529 exceeds .* 512 tokens .*: max_new_tokens of at most 111 fits"):
    sparsedec.generate(cfg, params, [[5] * 30, [5] * 401], max_new_tokens=128)
  with pytest.raises(sparsedec.InputError,
                     match=r"the prompt alone fills the context \(600 >= 512 tokens\): shorten it"):
    sparsedec.generate(cfg, params, [[5] * 600], max_new_tokens=1)
  with pytest.raises(sparsedec.InputError,
                     match=r"KV cache of 32 tokens: max_new_tokens of at most 2 fits, or pass "
                           r"a larger cache_size \(--cache-size\)"):
    sparsedec.generate(cfg, params, [list(range(30))], max_new_tokens=8, cache_size=32)
  with pytest.raises(sparsedec.InputError, match=r"the prompt alone fills the cache \(40 >= 32"):
    sparsedec.generate(cfg, params, [list(range(40))], max_new_tokens=8, cache_size=32)


@pytest.mark.parametrize("prompts, message", [
    ([], "non-empty"),
    ([[]], "prompt 0 is empty"),
    ([1, 2, 3], "flat list"),
    ([[1, 2, 500]], "token id 500 outside the vocabulary"),
    ([[1, 2, 97]], "token id 97 outside the vocabulary"),       # vocab_size itself
    ([[3, -1]], "token id -1 outside the vocabulary"),
    ([[1, 2.7, 3]], "prompt 0 must be a list of integer token ids"),    # was truncated to 2
    (["hello"], "prompt 0 must be a list of integer token ids"),
])
def test_bad_prompts(prompts, message):
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  with pytest.raises(sparsedec.InputError, match=message):
    sparsedec.generate(cfg, params, prompts, max_new_tokens=4)


def test_divergence_report_names_position_tokens_and_margin(stories):
  cfg, params, tok = stories
  prompt = tok.encode("Once upon a time")
  dense = sparsedec.generate(cfg, params, [prompt], max_new_tokens=10, stop_tokens=()).tokens[0]
  tampered = dense[:4] + [(dense[4] + 1) % cfg.vocab_size] + dense[5:]
  with pytest.raises(AssertionError) as err:
    testing.assert_tokens_equal([tampered], [dense], cfg=cfg, params=params, prompts=[prompt])
  text = str(err.value)
  assert "position 4" in text and f"got {tampered[4]}, dense gave {dense[4]}" in text
  assert "margin" in text
  # dense gave its argmax there: its margin over the tampered token is positive and at least the
  # top-2 margin (a sign swapped in the report read as the output winning).
  (div,) = testing.find_divergences([tampered], [dense], cfg, params, [prompt])
  assert (div.row, div.position, div.actual, div.expected) == (0, 4, tampered[4], dense[4])
  assert div.margin >= div.top2_margin > 0
  there = testing.dense_logits(cfg, params, prompt + dense[:4])[-1]     # the logits of position 4
  assert div.margin == pytest.approx(float(there[dense[4]] - there[tampered[4]]))
  testing.assert_tokens_equal([dense], [dense])  # equal: no error


def test_divergence_report_says_which_output_ended(stories):
  """An output shorter or longer than dense's was reported as "got None" / "dense gave None"."""
  cfg, params, tok = stories
  prompt = tok.encode("Once upon a time")
  dense = sparsedec.generate(cfg, params, [prompt], max_new_tokens=8, stop_tokens=()).tokens[0]
  with pytest.raises(AssertionError) as err:
    testing.assert_tokens_equal([dense[:5]], [dense])
  assert f"position 5: the output ended after 5 tokens, dense went on with {dense[5]}" in str(
      err.value)
  with pytest.raises(AssertionError) as err:
    testing.assert_tokens_equal([dense], [dense[:5]], cfg=cfg, params=params, prompts=[prompt])
  assert f"position 5: got {dense[5]}, dense had ended after 5 tokens" in str(err.value)
  assert "None" not in str(err.value)


def test_assert_matches_dense_fails_a_method_that_differs_and_counts_every_row(stories):
  """assert_matches_dense against its own dense run (no `expected`) fails a method whose tokens
  differ from dense's, naming the row and position; a row missing from the output (or one too
  many) fails too, where zip alone compared the rows both had."""
  import dataclasses

  from sparsedec.decode.dense import Dense
  cfg, params, tok = stories

  @dataclasses.dataclass(frozen=True)
  class OffByOne(Dense):                      # dense, with every loop token moved one id on
    name: str = "off_by_one"

    def step(self, cfg, params, state, ctx):
      new = super().step(cfg, params, state, ctx)
      rows, last = jnp.arange(new.batch_size), new.num_tokens - 1
      grew = new.num_tokens > state.num_tokens
      tokens = new.tokens.at[rows, last].set(
          jnp.where(grew, (new.tokens[rows, last] + 1) % cfg.vocab_size, new.tokens[rows, last]))
      return new.replace(tokens=tokens)

  prompts = [tok.encode("Once upon a time"), tok.encode("Lily")]
  with pytest.raises(AssertionError,
                     match=r"off_by_one output differs from dense decoding in 2 of 2 rows:"
                           r"\n  row 0: first divergence at generated position 1: .*\n  row 1: "):
    testing.assert_matches_dense(cfg, params, prompts, method=OffByOne(), max_new_tokens=4,
                                 stop_tokens=())
  dense = sparsedec.generate(cfg, params, prompts, max_new_tokens=4, stop_tokens=()).tokens
  for actual, expected in (([dense[0]], dense), (dense, [dense[0]])):
    with pytest.raises(AssertionError, match=f"{len(actual)} rows of output against "
                                             f"{len(expected)} expected"):
      testing.assert_tokens_equal(actual, expected)


def test_sampling_comparison_fails_a_biased_sampler_and_refuses_what_it_cannot_test(stories):
  """assert_sampling_matches_dense fails a method that samples from another law (dense at a
  higher temperature), naming the p-value and the counts; it refuses greedy sampling, bad knobs,
  a dense sample of another size, and a law that is one outcome (nothing to tell apart)."""
  from sparsedec.decode.dense import Dense
  from sparsedec.decode.sampling import SamplingConfig
  cfg, params, tok = stories
  prompt = tok.encode("Lily and Tom went to the park. Lily and Tom went to the")
  sampling = SamplingConfig(temperature=1.6, top_k=12)

  @dataclasses.dataclass(frozen=True)
  class Hotter(Dense):                       # dense, sampling at temperature 3 whatever is asked
    name: str = "hotter"

    def step(self, cfg, params, state, ctx):
      hot = dataclasses.replace(ctx, sampling=SamplingConfig(temperature=3.0, top_k=12))
      return super().step(cfg, params, state, hot)

  dense = sparsedec.generate(cfg, params, [prompt] * 400, max_new_tokens=3, sampling=sampling,
                             seed=list(range(400)), stop_tokens=())
  with pytest.raises(AssertionError, match=r"hotter sampling differs from dense sampling: "
                                           r"chi-square p = .* < alpha 0.001 over 400 rows"):
    testing.assert_sampling_matches_dense(cfg, params, prompt, method=Hotter(),
                                          sampling=sampling, rows=400, expected=dense,
                                          stop_tokens=())
  same = testing.assert_sampling_matches_dense(cfg, params, prompt, method=Dense(),
                                               sampling=sampling, rows=400, expected=dense,
                                               stop_tokens=())
  assert same.pvalue > 1e-3 and same.table.sum() == 800 and same.table.shape[1] >= 5
  # In batches: the same seeds, so the same rows (dense sampling draws each row from its seed).
  batched = testing.assert_sampling_matches_dense(cfg, params, prompt, method=Dense(),
                                                  sampling=sampling, rows=400, batch_size=150,
                                                  expected=dense, stop_tokens=())
  np.testing.assert_array_equal(batched.table, same.table)
  assert len(batched.result.tokens) == 100                      # the last of 150, 150, 100
  for kwargs, message in ((dict(sampling=SamplingConfig()), "non-greedy SamplingConfig"),
                          (dict(alpha=1.0), "alpha"), (dict(rows=1), "rows must be"),
                          (dict(num_tokens=0), "num_tokens must be"),
                          (dict(batch_size=0), "batch_size must be"),
                          (dict(expected=dense.tokens[:10]), "expected holds 10 rows")):
    with pytest.raises(sparsedec.InputError, match=message):
      testing.assert_sampling_matches_dense(cfg, params, prompt, **{
          "method": "dense", "sampling": sampling, "rows": 400, "stop_tokens": (), **kwargs})
  with pytest.raises(sparsedec.InputError, match="one outcome"):
    testing.homogeneity_test([(1, 2)] * 30, [(1, 2)] * 30)


def test_forward_assertion_refuses_a_forward_returning_logits_and_cache(stories):
  """A forward_fn returning sparsedec's (logits, cache) raised numpy's "inhomogeneous shape"."""
  cfg, params, tok = stories
  tokens = np.asarray([tok.encode("Once upon a time")[:4]])

  def with_cache(t):                                                   # [B, T] -> (logits, cache)
    b, n = t.shape
    return forward(cfg, params, t, jnp.broadcast_to(jnp.arange(n)[None], (b, n)),
                   init_cache(cfg, b, 1), causal_plan(n))
  with pytest.raises(sparsedec.InputError, match=r"forward_fn must return the logits.*take its"):
    testing.assert_forward_matches_dense(cfg, params, tokens, with_cache)
  testing.assert_forward_matches_dense(cfg, params, tokens, lambda t: with_cache(t)[0])


def test_assertions_take_generation_results_and_refuse_flat_lists(stories):
  """assert_matches_dense's `expected` "reuses a dense result": a GenerationResult raised
  TypeError (no len()); a flat token list raised "'int' object is not iterable"."""
  cfg, params, tok = stories
  prompts = [tok.encode("Once upon a time"), tok.encode("Lily")]
  dense = sparsedec.generate(cfg, params, prompts, max_new_tokens=6)
  got = testing.assert_matches_dense(cfg, params, prompts, method="lookahead", max_new_tokens=6,
                                     expected=dense)
  testing.assert_tokens_equal(got, dense)
  testing.assert_tokens_equal(np.asarray([dense.tokens[0]]), [dense.tokens[0]])
  swapped = dense.tokens[::-1]
  with pytest.raises(AssertionError, match="differs from dense decoding in 2 of 2 rows"):
    testing.assert_tokens_equal(swapped, dense)
  with pytest.raises(sparsedec.InputError, match="actual must be one list of token ids per row"):
    testing.assert_tokens_equal(dense.tokens[0], dense.tokens[0])
  with pytest.raises(sparsedec.InputError, match="expected must be one list of token ids"):
    testing.assert_tokens_equal([dense.tokens[0]], [[1.5]])


def test_dense_logits_runs_the_reference_whatever_the_attention_setting(stories, monkeypatch):
  """dense_logits (teacher-forced over a one-slot empty cache, which no kernel takes) runs the
  jnp reference attention: with the default backend a GPU, "auto" does not warn (find_divergences
  warned at each divergence in session 70's GPU benchmark) and "pallas" does not refuse the
  cache; the logits are the same."""
  import warnings
  cfg, params, tok = stories
  prompt = tok.encode("Once upon a time")
  want = testing.dense_logits(cfg, params, prompt)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for attention in ("auto", "pallas"):
      got = testing.dense_logits(cfg.replace(attention=attention), params, prompt)
      np.testing.assert_array_equal(got, want)


def test_stories_bf16_logits_track_fp32(stories):
  """bf16 compute runs (on CPU too) and stays within bf16 rounding of the fp32 model."""
  from sparsedec.model.params import cast_params
  cfg, params, tok = stories
  prompt = tok.encode("Once upon a time, there was a little girl")
  cfg16 = cfg.replace(dtype="bfloat16")
  ref = testing.dense_logits(cfg, params, prompt)
  got = testing.dense_logits(cfg16, cast_params(params, "bfloat16"), prompt)
  scale = np.abs(ref).max()
  assert np.abs(got - ref).max() / scale < 5e-2
  assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
  r16 = sparsedec.generate(cfg16, cast_params(params, "bfloat16"), [prompt], max_new_tokens=8)
  assert len(r16.tokens[0]) >= 1


@pytest.mark.parametrize("name", ["mistral_window", "qwen3"])
def test_fp32_forward_multiplies_at_full_fp32_precision(name):
  """Every matmul of an fp32 forward asks for HIGHEST precision: the linears did, the reference
  attention's four einsums (the path every fp32 model takes on a GPU: the kernels take bf16/fp16)
  used jax's default, which computes fp32 dots in TF32 on recent GPUs (q . k and p . v with a
  10-bit mantissa, unlike transformers' fp32 and this forward's own linears)."""
  cfg = CONFIGS[name]
  params = init_random(cfg, jax.random.key(0))
  text = jax.jit(forward, static_argnums=0).lower(
      cfg, params, jnp.zeros((2, 3), jnp.int32), jnp.arange(3)[None].repeat(2, 0),
      init_cache(cfg, 2, 8)).as_text()
  dots = [line for line in text.splitlines() if "dot_general" in line]
  assert len(dots) >= cfg.num_layers * 8                  # 4 linears + 4 attention einsums
  assert all("precision = [HIGHEST, HIGHEST]" in line for line in dots), [
      line.strip()[:160] for line in dots if "HIGHEST" not in line]


@pytest.mark.parametrize("method", ["lookahead", "fafo"])
def test_methods_run_with_jax_enable_x64(method):
  """Under jax_enable_x64 the n-gram methods' guess counter was promoted to int64 in the loop
  body (a bool sum) and the while_loop refused the carry: TypeError for every call."""
  from sparsedec.compress import StreamingLLM
  from sparsedec.decode.methods import get_method
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(1), scale=0.3)
  m = (get_method("lookahead", window=3, ngram=3, guesses=2) if method == "lookahead" else
       get_method("fafo", subsequences=2, length=2, candidates=2,
                  policy=StreamingLLM(block_size=16, budget_blocks=2)))
  prompts = [[5, 6, 7, 8, 5, 6, 7], [12, 13]]
  kw = dict(max_new_tokens=8, stop_tokens=(), method=m)
  expected = sparsedec.generate(cfg, params, prompts, **kw).tokens
  with jax.enable_x64(True):
    assert sparsedec.generate(cfg, params, prompts, **kw).tokens == expected


@pytest.mark.parametrize("method", ["lookahead", "quantspec"])
def test_sampled_methods_give_the_same_tokens_under_jax_enable_x64(method):
  """A seed gives the same sampled tokens with jax_enable_x64 as without, as dense sampling
  does: the verification uniforms (verify_sampled's, QuantSpec's draft and acceptance draws)
  were drawn in float64 there, from other bits of the row's key, so every seed gave other text."""
  from sparsedec.decode.methods import get_method
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(1), scale=0.3)
  m = (get_method("lookahead", window=3, ngram=3, guesses=2) if method == "lookahead" else
       get_method("quantspec", gamma=2, quant_group=16, weight_group=16,
                  verify_precision="full"))
  prompts = [[5, 6, 7, 8, 5, 6, 7], [12, 13]]
  kw = dict(max_new_tokens=8, stop_tokens=(), method=m, seed=[1, 2],
            sampling=sparsedec.SamplingConfig(temperature=0.9, top_k=20))
  expected = sparsedec.generate(cfg, params, prompts, **kw).tokens
  with jax.enable_x64(True):
    assert sparsedec.generate(cfg, params, prompts, **kw).tokens == expected


def test_jax_arrays_are_taken_as_prompts_and_stop_tokens():
  """A [B, P] jax array of prompts was refused ("must be a non-empty list") though numpy arrays
  and per-row jax arrays were taken; a jax array of stop tokens, or a jax scalar seed, was
  refused as well."""
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  prompts = [[1, 2, 3], [4, 5, 6]]
  free = sparsedec.generate(cfg, params, prompts, max_new_tokens=6, stop_tokens=())
  stop = free.tokens[0][2]
  expected = sparsedec.generate(cfg, params, prompts, max_new_tokens=6, stop_tokens=(stop,))
  got = sparsedec.generate(cfg, params, jnp.asarray(prompts), max_new_tokens=6,
                           stop_tokens=jnp.asarray([stop]))
  assert got.tokens == expected.tokens and got.stopped == expected.stopped
  with pytest.raises(sparsedec.InputError, match="flat list"):
    sparsedec.generate(cfg, params, jnp.asarray([1, 2, 3]), max_new_tokens=2)
  sampling = sparsedec.SamplingConfig(temperature=1.0)
  seeded = sparsedec.generate(cfg, params, prompts, max_new_tokens=4, sampling=sampling, seed=3)
  for seed in (jnp.int32(3), jnp.asarray([3, 3]), np.array(3)):
    assert sparsedec.generate(cfg, params, prompts, max_new_tokens=4, sampling=sampling,
                              seed=seed).tokens == seeded.tokens


def test_stop_tokens_from_a_one_pass_iterable_stop_the_row():
  """stop_tokens=map(int, flag.split(",")) (or a generator, an iterator) was read twice, once to
  check its ids and once to keep them: the second read found it empty, so the row ran on to
  max_new_tokens with no stop tokens at all, silently."""
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(2), scale=0.3)
  free = sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=8, stop_tokens=())
  stop = free.tokens[0][3]
  want = sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=8, stop_tokens=[stop])
  assert want.stopped == [True]
  for stops in (map(int, [str(stop)]), (t for t in [stop]), iter([stop])):
    got = sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=8, stop_tokens=stops)
    assert got.tokens == want.tokens and got.stopped == want.stopped, type(stops).__name__


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed="12"), "seed must be an int"),      # was split into the seeds 1 and 2
    # Floats / bools one at a time (a map or generator) were truncated to ints, unlike a list's.
    (dict(seed=map(float, "12")), "seed must be an int"),
    (dict(seed=(s for s in [True, 2])), "seed must be an int"),
    (dict(stop_tokens=[2 ** 40]), "stop token 1099511627776 outside the vocabulary"),  # OverflowError
    (dict(stop_tokens=[97]), "stop token 97 outside the vocabulary"),
    (dict(stop_tokens=[5, -1]), "stop token -1 outside the vocabulary"),
])
def test_bad_seeds_and_stop_tokens(kwargs, message):
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  with pytest.raises(sparsedec.InputError, match=message):
    sparsedec.generate(cfg, params, [[1, 2, 3], [4, 5, 6]], max_new_tokens=2, **kwargs)


def test_greedy_ignores_top_k_and_top_p_without_recompiling():
  """Temperature 0 is greedy whatever top_k / top_p say, but each of their values was a new
  static sampling config: prefill and the decode loop compiled again for the same argmax."""
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  kw = dict(max_new_tokens=5, stop_tokens=())
  expected = sparsedec.generate(cfg, params, [[1, 2, 3]], **kw).tokens
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **k: compiles.append(event) if "backend_compile" in event else None)
  try:
    for top_k, top_p in ((5, 1.0), (0, 0.5), (7, 0.9)):
      sampling = sparsedec.SamplingConfig(temperature=0.0, top_k=top_k, top_p=top_p)
      assert sparsedec.generate(cfg, params, [[1, 2, 3]], sampling=sampling,
                                **kw).tokens == expected
  finally:
    jax.monitoring.clear_event_listeners()
  assert compiles == [], f"recompiled: {compiles}"


def test_a_method_class_or_other_object_is_refused_by_name():
  """method=Lookahead (the class, not Lookahead()) failed after prefill with "init() missing 1
  required positional argument", any other object with an AttributeError."""
  from sparsedec.decode.lookahead import Lookahead
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  for method, message in ((Lookahead, r"Lookahead\(\)"), (42, "method must be")):
    with pytest.raises(sparsedec.InputError, match=message):
      sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=2, method=method)


def test_prefill_refuses_a_chunk_that_does_not_divide_the_prompts():
  """prefill runs P // chunk forwards: with P = 24 and chunk 16 the prompt's tokens 16..19 never
  reached the cache and the first token was drawn from zero logits (token 0), silently; a chunk
  past P was a bare TypeError about slice sizes."""
  from sparsedec.decode.prefill import empty_cache, prefill
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0), scale=0.3)
  prompt = list(range(1, 21))                                             # 20 tokens
  padded = np.zeros((1, 24), np.int32)
  padded[0, :20] = prompt
  run = lambda chunk: prefill(                                            # noqa: E731
      cfg, params, empty_cache(cfg, 1, 64), padded, np.array([20], np.int32),
      np.array([4], np.int32), np.zeros((1,), np.int32), chunk=chunk,
      sampling=sparsedec.SamplingConfig(), stop_ids=())
  state = run(8)
  expected = sparsedec.generate(cfg, params, [prompt], max_new_tokens=1, stop_tokens=())
  assert int(state.cache.lengths[0]) == 20
  assert int(state.tokens[0, 20]) == expected.tokens[0][0]
  for chunk in (16, 32, 0):
    with pytest.raises(sparsedec.InputError, match=f"divides the padded prompt length P = 24, "
                                                   f"got chunk {chunk}"):
      run(chunk)


def test_advance_takes_a_concrete_jax_integer_and_refuses_a_traced_steps_by_name():
  """steps=jnp.int32(4) was refused as "steps must be None or an integer >= 1, got Array(4,
  dtype=int32)", and a traced steps inside a caller's jit the same way ("got JitTracer"): the
  concrete one is taken as an int, the traced one is named as traced."""
  from sparsedec.decode import api
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  state, run = api.start(cfg, params, [[1, 2, 3]], max_new_tokens=8, stop_tokens=())
  state = run.advance(params, state, steps=jnp.int32(3))
  assert int(state.step) == 3
  state = run.advance(params, state, steps=np.asarray(2))
  assert int(state.step) == 5
  with pytest.raises(sparsedec.InputError, match="steps is traced"):
    jax.jit(lambda s, n: run.advance(params, s, steps=n))(state, 2)
  with pytest.raises(sparsedec.InputError, match="steps must be None or an integer >= 1"):
    run.advance(params, state, steps=jnp.asarray(True))


def test_a_method_step_on_a_state_its_init_did_not_build_is_refused_by_name():
  """A caller's own loop over a prefilled state (no init_method) or another method's state
  failed inside the trace with "AttributeError: 'NoneType' object has no attribute 'pool'"."""
  from sparsedec.decode import api
  from sparsedec.decode.fafo import Fafo
  from sparsedec.decode.lookahead import Lookahead
  from sparsedec.decode.quantspec import QuantSpec
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  state, run = api.start(cfg, params, [[1, 2, 3]], max_new_tokens=4)
  other = state.replace(extras={"pool": jnp.zeros((1,))})            # another method's extras
  for method, given, got in ((Fafo(), state, "got none"), (QuantSpec(), state, "got none"),
                             (Lookahead(), other, "got dict")):
    with pytest.raises(sparsedec.InputError, match=f"{method.name}'s step needs the "
                                                   f"{type(method).__name__}Extras .*{got}.*"
                                                   f"init_method"):
      jax.eval_shape(lambda s: method.step(cfg, params, s, run.ctx), given)


def test_append_tokens_clips_a_count_outside_the_tokens_given():
  """A custom method's step that counted 5 of 3 new tokens advanced num_tokens by 5 (two zeros
  past its tokens taken as generated text), and a negative count took tokens off the row (below
  its prompt): counts are clipped to [0, A]."""
  from sparsedec.decode.state import DecodeState, append_tokens
  from sparsedec.kv.dense import KVCache
  b = 2
  state = DecodeState(
      tokens=jnp.zeros((b, 12), jnp.int32).at[:, :3].set(7), num_tokens=jnp.full((b,), 3),
      prompt_lengths=jnp.full((b,), 3), limits=jnp.full((b,), 11), done=jnp.zeros((b,), bool),
      cache=KVCache(k=(), v=(), lengths=jnp.full((b,), 2)),
      keys=jax.random.split(jax.random.key(0), b), step=jnp.int32(0),
      active_steps=jnp.zeros((b,), jnp.int32))
  new = jnp.asarray([[11, 12, 13], [21, 22, 23]], jnp.int32)
  state, appended = append_tokens(state, new, jnp.asarray([5, -2]), ())
  assert appended.tolist() == [3, 0]
  assert state.num_tokens.tolist() == [6, 3]
  assert state.tokens[0, :6].tolist() == [7, 7, 7, 11, 12, 13]


def test_append_tokens_stops_only_on_an_appended_stop_token():
  """A stop token among a step's tokens past its count (a rejected guess) or given to a row that
  is already done neither ends the row nor appends anything to it; one within the count is kept
  and ends the row there, and a row reaching its limit is done."""
  from sparsedec.decode.state import DecodeState, append_tokens
  from sparsedec.kv.dense import KVCache
  b = 4
  state = DecodeState(
      tokens=jnp.zeros((b, 12), jnp.int32).at[:, :3].set(7), num_tokens=jnp.full((b,), 3),
      prompt_lengths=jnp.full((b,), 3), limits=jnp.asarray([11, 11, 11, 5]),
      done=jnp.asarray([False, True, False, False]),
      cache=KVCache(k=(), v=(), lengths=jnp.full((b,), 2)),
      keys=jax.random.split(jax.random.key(0), b), step=jnp.int32(0),
      active_steps=jnp.zeros((b,), jnp.int32))
  new = jnp.asarray([[11, 2, 13], [2, 22, 23], [31, 2, 33], [41, 42, 43]], jnp.int32)
  state, appended = append_tokens(state, new, jnp.asarray([1, 3, 3, 2]), (2,))
  assert appended.tolist() == [1, 0, 2, 2]
  assert state.num_tokens.tolist() == [4, 3, 5, 5]
  assert state.done.tolist() == [False, True, True, True]
  assert state.tokens[:, 3:6].tolist() == [[11, 0, 0], [0, 0, 0], [31, 2, 0], [41, 42, 0]]


def test_a_hand_built_step_context_is_checked_and_its_stops_normalised():
  """StepContext(sampling=None) failed in the trace ("'NoneType' object has no attribute
  'greedy'"), stop_ids=[2] with jax's non-hashable static argument error, stop_ids=(2.5,) never
  stopped a row, silently. The stops are stored as api.start stores them (sorted, no repeats)."""
  from sparsedec.decode import api, loop
  from sparsedec.decode.loop import StepContext
  greedy = sparsedec.SamplingConfig()
  assert StepContext(greedy, [5, np.int64(2), 5]).stop_ids == (2, 5)
  assert StepContext(greedy, jnp.asarray([5, 2])).stop_ids == (2, 5)
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  _, run = api.start(cfg, params, [[1, 2, 3]], max_new_tokens=2, stop_tokens=(5, 2))
  assert StepContext(greedy, [5, 2]) == run.ctx
  for kwargs, message in ((dict(sampling=None, stop_ids=()), "sampling must be a SamplingConfig"),
                          (dict(sampling=greedy, stop_ids=(2.5,)), "stop_ids must be a sequence"),
                          (dict(sampling=greedy, stop_ids=2), "stop_ids must be a sequence")):
    with pytest.raises(sparsedec.InputError, match=message):
      StepContext(**kwargs)
  # init_method stored ctx=None as the state's build; Run.advance then failed describing it
  # ("'NoneType' object has no attribute 'sampling'")
  state, _ = api.start(cfg, params, [[1, 2, 3]], max_new_tokens=2)
  with pytest.raises(sparsedec.InputError, match="ctx must be a StepContext"):
    loop.init_method(cfg, params, state, method=run.method, ctx=None)


def test_a_warm_call_reports_no_compile_time():
  """A call that compiles nothing reports compile_seconds 0: the method init's donation check
  traced a new lambda every call (SmolLM2's QuantSpec: 23-53 ms of 'compilation' a warm call,
  taken off its prefill_seconds)."""
  from sparsedec.decode import api
  cfg = CONFIGS["llama3"]
  params = init_random(cfg, jax.random.key(0))
  kw = dict(max_new_tokens=4, stop_tokens=())
  sparsedec.generate(cfg, params, [[1, 2, 3]], **kw)
  assert sparsedec.generate(cfg, params, [[4, 5]], **kw).compile_seconds == 0.0
  slices = api.stream(cfg, params, [[6, 7]], interval=2, **kw)
  with pytest.raises(StopIteration) as end:
    while True:
      next(slices)
  assert end.value.value.compile_seconds == 0.0


def test_generate_and_stream_wait_for_the_prefill_before_the_method_init(stories, monkeypatch):
  """The init's first call compiles; its compile ran beside the asynchronous prefill and was
  then taken off the wall time in full: a first Lookahead call reported prefill_seconds 0.02
  where its prefill (8 rows of 250 tokens) took 0.24 s. generate and stream now wait for the
  prefill before the init (api.start still does not)."""
  from sparsedec.decode import api
  cfg, params, _ = stories
  ready = []

  def init_method(cfg, params, state, **kwargs):
    ready.append(all(x.is_ready() for x in jax.tree.leaves((state.tokens, state.cache))))
    return loop_init_method(cfg, params, state, **kwargs)

  loop_init_method = api.init_method
  monkeypatch.setattr(api, "init_method", init_method)
  prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, (4, 256)).tolist()
  kw = dict(max_new_tokens=1, prefill_chunk=16)
  sparsedec.generate(cfg, params, prompts, **kw)
  next(api.stream(cfg, params, prompts, **kw))
  assert ready == [True, True]


# Run with four host devices (the flag must be set before jax starts: a subprocess).
ON_THE_PARAMS_DEVICE = """
import jax
import sparsedec
from sparsedec.decode import api
from sparsedec.weights.checkpoint import load_model
made_on, recorded_sharding = [], []
def recorded(*args, **kwargs):
  cache = empty_cache(*args, **kwargs)
  made_on.append({d for x in jax.tree.leaves(cache) for d in x.devices()})
  recorded_sharding.append(cache.k[0].sharding)
  return cache
empty_cache, api.empty_cache = api.empty_cache, recorded
cfg, params, tok = load_model(CHECKPOINT)
prompts = [tok.encode("Once upon a time"), tok.encode("The little dog")]
alone = sparsedec.generate(cfg, params, prompts, max_new_tokens=8).tokens
device = jax.devices()[1]
out = sparsedec.generate(cfg, jax.device_put(params, device), prompts, max_new_tokens=8,
                         return_state=True)
assert made_on[-1] == {device}, made_on
assert out.state.tokens.devices() == {device} and out.tokens == alone, out.tokens
# Params over the 4 devices: wqkv's columns split over "model" (KV heads 4 = the axis size), then
# every array replicated. The empty cache is laid out as the prefill leaves it (no device holds
# a whole copy it does not use), and donating it to the prefill works (no "donated buffers were
# not usable" warning, raised here).
import warnings
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
warnings.simplefilter("error")
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
for spec, split in ((P(None, "model"), True), (P(), False)):
  def put(path, x):
    wqkv = jax.tree_util.keystr(path).endswith("['wqkv']")
    return jax.device_put(x, NamedSharding(mesh, spec if wqkv else P()))
  out = sparsedec.generate(cfg, jax.tree_util.tree_map_with_path(put, params), prompts,
                           max_new_tokens=8, return_state=True)
  made = made_on[-1]
  assert len(made) == 4 and out.tokens == alone, (made, out.tokens)
  shards = {s.data.shape[1] for x in out.state.cache.k for s in x.addressable_shards}
  assert shards == {cfg.num_kv_heads // 2 if split else cfg.num_kv_heads}, (spec, shards)
  assert recorded_sharding[-1] == out.state.cache.k[0].sharding, (spec, recorded_sharding)
# The memory check counts a device's share of the cache as laid out: half of it per device with
# the KV heads split over "model" (2), all of it replicated (it had split it over all 4 devices).
from sparsedec.decode import fits
need = fits.run_lower_bounds(cfg, 1, len(prompts), 256, reference_path=True)
kv = sum(v for k, v in need.items() if k.startswith(fits.KV_CACHE))
fits.device_memory_bytes = lambda device: int(0.75 * kv) + sum(need.values()) - kv
for spec, fits_there in ((P(None, "model"), True), (P(), False)):
  def put(path, x):
    wqkv = jax.tree_util.keystr(path).endswith("['wqkv']")
    return jax.device_put(x, NamedSharding(mesh, spec if wqkv else P()))
  try:
    sparsedec.generate(cfg, jax.tree_util.tree_map_with_path(put, params), prompts,
                       max_new_tokens=8, cache_size=256)
    assert fits_there, spec
  except sparsedec.InputError as e:
    assert not fits_there and "cannot fit" in str(e), (spec, e)
print("ok")
"""


def test_the_cache_is_made_on_the_params_device():
  """api.start makes the empty cache on the device its params are committed to: it was made on
  the default device and copied by the prefill's call (every request of a model on device 1
  held a whole cache on device 0 for a while). The tokens are the single-device run's. Over
  several devices it is laid out as the prefill leaves it (KV heads split like wqkv's columns,
  else replicated): it was made on device 0 and replicated to every device by the prefill's
  call, so a sharded model's cache had to fit one device. The memory check before prefill counts
  a device's share of the cache as laid out (it split every cache over all devices)."""
  from host_devices import run_script
  run_script(ON_THE_PARAMS_DEVICE)
