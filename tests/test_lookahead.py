"""Lookahead Decoding: exact against dense decoding, stop tokens and limits inside multi-token
steps, the attention layout, distribution-preserving verification, and the CLI."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsedec
from sparsedec import cli, testing
from sparsedec.decode import api
from sparsedec.decode.lookahead import Lookahead, lookahead_layout
from sparsedec.decode.methods import get_method
from sparsedec.decode.sampling import SamplingConfig, probabilities
from sparsedec.decode.verify import draw_from, verify, verify_greedy, verify_sampled
from sparsedec.weights.checkpoint import load_model

from pool_items import assert_pools_equal, insert_items
import row_figures

# One method, batch and cache capacity for every stories test, so they share compiled functions.
METHOD = Lookahead()                      # the defaults: W=7, N=5, G=7
CACHE = 384
NEW = 256
TEXTS = ["Once upon a time", "The cat sat on the mat and looked at the big red ball", "Lily"]


@pytest.fixture(scope="module")
def stories():
  cfg, params, tok = load_model(cli.default_model())
  assert cfg.dtype == "float32"
  prompts = [tok.encode(t) for t in TEXTS]
  assert len({len(p) for p in prompts}) == len(prompts), "ragged prompts wanted"
  return cfg, params, prompts


@pytest.fixture(scope="module")
def dense(stories):
  cfg, params, prompts = stories
  return sparsedec.generate(cfg, params, prompts, max_new_tokens=NEW, stop_tokens=(),
                            cache_size=CACHE).tokens


@pytest.fixture(scope="module")
def step_sizes(stories):
  """Tokens appended per step and row, [steps, B] (the first 96 tokens of each row)."""
  cfg, params, prompts = stories
  state, run = api.start(cfg, params, prompts, max_new_tokens=96, stop_tokens=(),
                         method=METHOD, cache_size=CACHE)
  counts = [np.asarray(state.num_tokens)]
  while not bool(state.done.all()):
    state = run.advance(params, state, 1)
    counts.append(np.asarray(state.num_tokens))
  return np.diff(np.stack(counts), axis=0)                           # [steps, B]


def test_greedy_equals_dense_for_256_tokens(stories, dense):
  cfg, params, prompts = stories
  result = testing.assert_matches_dense(cfg, params, prompts, method=METHOD, max_new_tokens=NEW,
                                        expected=dense, stop_tokens=(), cache_size=CACHE)
  assert all(len(t) == NEW for t in result.tokens)
  stats = result.stats()
  assert stats["tau"] > 1.3, stats                 # several tokens per step on this model
  assert result.steps < NEW / 1.3
  for key in ("guesses_per_step", "pool_hit_rate", "accept_rate", "accepted_guesses_per_step"):
    assert key in stats
  assert 0 < stats["pool_hit_rate"] <= 1 and 0 < stats["accept_rate"] <= stats["pool_hit_rate"]
  # Each step appends its accepted guesses and the model's token, but a row's last step, cut by
  # max_new_tokens, may append guesses only: up to one guess per row more than tau - 1 gives.
  extra = stats["accepted_guesses_per_step"] - (stats["tau"] - 1)
  assert -1e-3 <= extra <= len(prompts) / sum(result.active_steps) + 1e-3, stats


def _multi_token_step(step_sizes, dense, avoid_repeat=True):
  """(row, generated-before, size) of a step that appended >= 3 tokens, whose second token does
  not occur earlier in the row's output (so a stop on it ends the row inside that step)."""
  for row in range(step_sizes.shape[1]):
    before = 1                                                       # the prefill token
    for size in step_sizes[:, row]:
      if size >= 3 and (not avoid_repeat or dense[row][before + 1] not in dense[row][:before + 1]):
        return row, before, int(size)
      before += int(size)
  pytest.fail("no step accepted 3 or more tokens: the test needs one")


@pytest.mark.parametrize("cut", [1, 2])
def test_max_new_tokens_inside_a_multi_token_step(stories, dense, step_sizes, cut):
  cfg, params, prompts = stories
  _, before, _ = _multi_token_step(step_sizes, dense, avoid_repeat=False)
  limit = before + cut                        # the step accepts >= 3 but only `cut` fit
  result = sparsedec.generate(cfg, params, prompts, max_new_tokens=limit, stop_tokens=(),
                              method=METHOD, cache_size=CACHE, return_state=True)
  assert [len(t) for t in result.tokens] == [limit] * len(prompts)
  testing.assert_tokens_equal(result.tokens, [d[:limit] for d in dense])
  state = result.state
  assert (np.asarray(state.cache.lengths) == np.asarray(state.num_tokens) - 1).all()


def accepted_guesses_by_hand(sizes: np.ndarray, limit: int) -> int:
  """Guessed tokens a row appends under max_new_tokens=limit, from its uncut run's tokens per step
  ([steps]): a whole step appends its accepted guesses and the model's token (size - 1 guessed);
  the step that the limit cuts appends guessed tokens only (they come first)."""
  made, accepted = 1, 0                                              # the prefill token
  for size in sizes:
    if made >= limit:
      break
    appended = min(int(size), limit - made)
    accepted += appended if appended < size else appended - 1
    made += appended
  return accepted


def test_a_step_cut_by_max_new_tokens_counts_its_appended_guesses(stories, step_sizes, dense):
  """The step that max_new_tokens cuts after one token appended one accepted guess: the stats
  counted it as none (accepted - 1 of what was appended, as if the model's token were there)."""
  cfg, params, prompts = stories
  _, before, _ = _multi_token_step(step_sizes, dense, avoid_repeat=False)
  limit = before + 1
  result = sparsedec.generate(cfg, params, prompts, max_new_tokens=limit, stop_tokens=(),
                              method=METHOD, cache_size=CACHE, return_state=True)
  expected = [accepted_guesses_by_hand(step_sizes[:, r], limit) for r in range(len(prompts))]
  assert np.asarray(result.state.extras.accepted_guesses).tolist() == expected
  steps = sum(result.active_steps)
  assert result.method_stats["accepted_guesses_per_step"] == round(sum(expected) / steps, 4)


def test_each_rows_figures_are_its_prompt_decoded_alone(stories, step_sizes):
  """A batch's per-row figures (row_tau, row_method_stats, api.method_stats(rows=[r])) are each
  prompt's decoded alone, and they add up to the batch's (stats only summed every row).
  step_sizes' batch and 96 tokens (its compiles); alone, the two prompts of one bucket."""
  cfg, params, prompts = stories
  row_figures.assert_rows_are_their_prompts_alone(
      cfg, params, prompts, METHOD, ("guesses_per_step", "pool_hit_rate", "accept_rate",
                                     "accepted_guesses_per_step"),
      alone_rows=(0, 2), max_new_tokens=96, stop_tokens=(), cache_size=CACHE)


def test_stop_token_inside_a_multi_token_step(stories, dense, step_sizes):
  """A stop token that arrives as the second token of a multi-token step ends the row there: the
  tokens accepted after it are dropped and their K/V are not committed."""
  cfg, params, prompts = stories
  row, before, _ = _multi_token_step(step_sizes, dense)
  stop = dense[row][before + 1]
  state, run = api.start(cfg, params, prompts, max_new_tokens=NEW, stop_tokens=(stop,),
                         method=METHOD, cache_size=CACHE)
  lengths = [int(state.num_tokens[row])]
  while not bool(state.done.all()):
    state = run.advance(params, state, 1)
    lengths.append(int(state.num_tokens[row]))
  tokens, stopped = api.collect(state, (stop,))
  expected = [d[: d.index(stop) + 1] if stop in d else d for d in dense]
  testing.assert_tokens_equal(tokens, expected, label="lookahead with a stop token")
  assert len(tokens[row]) == before + 2 and stopped[row]
  # (the stop set also filters the window, so the steps may differ from the unstopped run's)
  last_step = np.diff(lengths)[np.nonzero(np.diff(lengths))[0][-1]]
  assert last_step >= 2, "the stop token should come inside a multi-token step"
  assert (np.asarray(state.cache.lengths) == np.asarray(state.num_tokens) - 1).all()


def test_sampled_path_with_one_hot_target_equals_dense_greedy(stories, dense):
  """top_k=1 makes the sampling target one-hot: the whole sampled path (rejection sampling,
  residuals, final draw) must then reproduce dense greedy exactly."""
  cfg, params, prompts = stories
  result = sparsedec.generate(cfg, params, prompts, max_new_tokens=128, stop_tokens=(),
                              method=METHOD, cache_size=CACHE,
                              sampling=SamplingConfig(temperature=1.0, top_k=1), seed=[3, 4, 5])
  testing.assert_tokens_equal(result.tokens, [d[:128] for d in dense], cfg=cfg, params=params,
                              prompts=prompts, label="lookahead sampling with top_k=1")
  assert result.tau > 1.3


@pytest.mark.parametrize("window, ngram, guesses", [(7, 5, 7), (3, 2, 2), (1, 3, 1), (4, 4, 3)])
def test_layout_every_query_sees_a_consecutive_run_of_positions(window, ngram, guesses):
  mask, offsets = lookahead_layout(window, ngram, guesses)
  lv = ngram - 1
  assert mask.shape == (lv * (window + guesses),) * 2
  for q in range(mask.shape[0]):
    seen = sorted(offsets[mask[q]].tolist())
    assert seen == list(range(offsets[q] + 1)), f"query {q}"   # one token per position 0..own
    assert mask[q, q] and mask[q, 0]
  cand = lv * window
  for c in range(guesses):                                        # candidates see no other branch
    rows = slice(cand + c * lv, cand + (c + 1) * lv)
    visible = np.nonzero(mask[rows].any(axis=0))[0].tolist()
    assert visible == [0] + list(range(cand + c * lv, cand + (c + 1) * lv))


def test_bad_knobs_are_errors():
  with pytest.raises(sparsedec.InputError, match="window must be an integer >= 1"):
    get_method("lookahead", window=0)
  with pytest.raises(sparsedec.InputError, match="ngram must be an integer >= 2"):
    Lookahead(ngram=1)
  with pytest.raises(sparsedec.InputError, match="no knob 'windows'"):
    get_method("lookahead", windows=3)
  with pytest.raises(sparsedec.InputError, match="no knob 'ngram'"):
    get_method("dense", ngram=3)
  # a method object jit cannot hash (a non-frozen dataclass) failed after prefill, with jax's
  # "Non-hashable static arguments are not supported"
  @dataclasses.dataclass
  class MyMethod:
    name: str = "mine"
    init = Lookahead.init
    step = Lookahead.step
    max_steps = Lookahead.max_steps
  with pytest.raises(sparsedec.InputError, match="method MyMethod is not hashable"):
    get_method(MyMethod())


# ---------------------------------------------------------------- verification (verify.py)

V = 6
CANDIDATES = [(1, 2), (1, 4), (3, 3), (1, 2), (0, 5)]     # a shared prefix, a duplicate, ...
VALID = [True, True, True, True, False]                   # ... and an invalid one


def _toy_logits(seed: int = 0):
  """Root logits [V] and, per candidate prefix, the logits of what follows it [G, L, V]
  (candidates with equal prefixes get equal logits, as a real model gives them)."""
  rng = np.random.default_rng(seed)
  root = rng.normal(0, 1.0, V)
  table = {}
  cand_logits = np.zeros((len(CANDIDATES), 2, V))
  for g, cand in enumerate(CANDIDATES):
    for i in range(2):
      cand_logits[g, i] = table.setdefault(cand[: i + 1], rng.normal(0, 1.0, V))
  return root, cand_logits, table


def _expected_sequences(root, table, sampling):
  """Probability of each emitted token sequence under the target: the sequence continues while it
  is a prefix of a valid candidate, then ends with one token from the model (L + 1 at most)."""
  dist = lambda logits: np.asarray(probabilities(jnp.asarray(logits)[None], sampling))[0]
  prefixes = {c[: i + 1] for c, ok in zip(CANDIDATES, VALID) if ok for i in range(2)}
  out = {}

  def walk(seq, p, prob):
    for t in range(V):
      q = prob * float(p[t])
      if q == 0:
        continue
      s = seq + (t,)
      if s in prefixes and len(s) <= 2:
        walk(s, dist(table[s]), q)
      else:
        out[s] = q
  walk((), dist(root), 1.0)
  return out


def test_sampling_first_three_tokens_distributed_as_dense(stories):
  """Joint law of the first 3 sampled tokens over many per-row seeds, Lookahead vs dense (the
  verify-level tests below check the rule on toy laws; this one the whole method on the model):
  chi-square test of homogeneity, false-alarm rate alpha = 1e-3, as FAFO's and QuantSpec's."""
  cfg, params, _ = stories
  tok = load_model(cli.default_model())[2]
  prompt = tok.encode("Lily and Tom went to the park. Lily and Tom went to the")
  got = testing.assert_sampling_matches_dense(
      cfg, params, prompt, method=Lookahead(window=4, ngram=3, guesses=4),
      sampling=SamplingConfig(temperature=1.6, top_k=12), rows=600, stop_tokens=())
  assert got.result.method_stats["accepted_guesses_per_step"] > 0.2   # guesses were accepted
  assert got.table.shape[1] >= 5, got.table


def test_verify_sampled_emits_the_target_distribution():
  """Chi-square goodness of fit of the emitted sequences over 20000 keys (false-alarm rate 1e-3),
  against the exact law: first token ~ target, each next token ~ target given the ones before.
  The target is processed (temperature, top-k, top-p) as dense sampling processes it."""
  from scipy import stats
  sampling = SamplingConfig(temperature=0.8, top_k=5, top_p=0.95)
  n = 20_000
  root, cand_logits, table = _toy_logits()
  bcast = lambda x: jnp.broadcast_to(jnp.asarray(x), (n,) + np.shape(x))
  verdict = jax.jit(verify, static_argnames="sampling")(
      bcast(root.astype(np.float32)), bcast(np.asarray(CANDIDATES, np.int32)),
      bcast(np.asarray(VALID)), bcast(cand_logits.astype(np.float32)),
      jax.random.split(jax.random.key(0), n), sampling=sampling)
  tokens, num = np.asarray(verdict.tokens), np.asarray(verdict.num_tokens)
  seqs = [tuple(tokens[i, : num[i]].tolist()) for i in range(n)]
  expected = _expected_sequences(root, table, sampling)
  assert sum(expected.values()) == pytest.approx(1.0, abs=1e-5)
  unknown = set(seqs) - set(expected)
  assert not unknown, f"emitted sequences the target never produces: {sorted(unknown)[:5]}"
  big = [s for s, p in expected.items() if p * n >= 5]
  counts = {s: 0 for s in big}
  other = 0
  for s in seqs:
    if s in counts:
      counts[s] += 1
    else:
      other += 1
  observed = [counts[s] for s in big] + [other]
  exp = [expected[s] * n for s in big] + [n - sum(expected[s] * n for s in big)]
  if exp[-1] < 5:                              # fold a tiny remainder bin into the largest one
    observed, exp = observed[:-1], exp[:-1]
    observed[int(np.argmax(exp))] += other
  assert len(big) >= 8, "the test needs a spread-out law to mean anything"
  assert max(len(s) for s in big) == 3          # full acceptance plus the bonus token is tested
  exp = np.asarray(exp, np.float64)
  assert stats.chisquare(observed, exp * (sum(observed) / exp.sum())).pvalue > 1e-3


def test_verify_sampled_with_one_hot_target_is_greedy():
  """With a one-hot target the sampled rule accepts exactly the longest argmax-matching prefix."""
  rng = np.random.default_rng(1)
  b, g, length, v = 64, 4, 3, 11
  root = rng.normal(size=(b, v)).astype(np.float32)
  # Candidates mostly follow the argmax chain (so prefixes of every length match); the logits
  # after a candidate token depend only on the row and the prefix, as a model's do.
  cands = np.zeros((b, g, length), np.int64)
  cand_logits = np.zeros((b, g, length, v), np.float32)
  table = {}
  for i in range(length):
    for r in range(b):
      for c in range(g):
        before = root[r] if i == 0 else cand_logits[r, c, i - 1]
        follow = rng.random() < 0.7
        cands[r, c, i] = before.argmax() if follow else rng.integers(0, v)
        prefix = (r,) + tuple(cands[r, c, : i + 1])
        cand_logits[r, c, i] = table.setdefault(prefix, rng.normal(size=v).astype(np.float32))
  valid = rng.random((b, g)) < 0.8
  args = (jnp.asarray(root), jnp.asarray(cands, jnp.int32), jnp.asarray(valid),
          jnp.asarray(cand_logits))
  greedy = jax.jit(verify_greedy)(*args)
  one_hot = lambda x: jax.nn.one_hot(jnp.argmax(x, -1), v)
  sampled = jax.jit(verify_sampled, static_argnums=5)(
      *args, jax.random.split(jax.random.key(2), b), one_hot)
  acc = np.asarray(greedy.accepted)
  assert len(set(acc.tolist())) == length + 1, "want every acceptance length 0..L"
  np.testing.assert_array_equal(np.asarray(sampled.accepted), acc)
  np.testing.assert_array_equal(np.asarray(sampled.num_tokens), acc + 1)
  for i in range(b):
    assert (np.asarray(sampled.tokens)[i, : acc[i] + 1]
            == np.asarray(greedy.tokens)[i, : acc[i] + 1]).all()
    if acc[i]:
      assert int(sampled.candidate[i]) == int(greedy.candidate[i])
  # plain numpy: the longest valid prefix equal to the argmax chain, then the argmax after it
  target = np.concatenate([np.broadcast_to(root.argmax(-1)[:, None, None], (b, g, 1)),
                           cand_logits.argmax(-1)[:, :, :-1]], axis=2)
  prefix = np.cumprod((cands == target) & valid[:, :, None], axis=2).sum(axis=2)   # [b, g]
  np.testing.assert_array_equal(acc, prefix.max(axis=1))
  for i in range(b):
    c = int(greedy.candidate[i])
    assert prefix[i, c] == acc[i]
    after = root[i].argmax() if acc[i] == 0 else cand_logits[i, c, acc[i] - 1].argmax()
    assert np.asarray(greedy.tokens)[i, : acc[i] + 1].tolist() == (
        cands[i, c, : acc[i]].tolist() + [int(after)])


def test_draw_from_never_draws_a_token_of_probability_zero():
  """The inverse-CDF draw (the last token of verify_sampled / verify_drafted, QuantSpec's sampled
  drafts) with uniforms at and next to every value the CDF takes. XLA's cumsum re-associates its
  sums, so the CDF is not monotone to the last bit: it wiggles by an ulp inside the flat runs of
  top-k-removed tokens, and counting `cdf <= u * total` landed in them (tokens outside the top-k,
  or a rejected guess drawn again from the residual; ~1e-6 of the draws at top-p supports of
  ~1000 tokens)."""
  rng = np.random.default_rng(0)
  b, v = 16, 4096
  logits = jnp.asarray(rng.normal(0, 3, (b, v)).astype(np.float32))
  probs = jax.jit(lambda x: probabilities(x, SamplingConfig(temperature=1.0, top_k=200)))(logits)
  cdf = np.asarray(jax.jit(lambda x: jnp.cumsum(x, axis=-1))(probs))
  at = (cdf / cdf[:, -1:]).astype(np.float32)                                   # [b, v]
  u = np.concatenate([at, np.nextafter(at, np.float32(0)), np.nextafter(at, np.float32(1))], 1)
  u = np.minimum(u, np.float32(1) - np.float32(2 ** -24))                       # in [0, 1)
  drawn = jax.jit(jax.vmap(draw_from, in_axes=(None, 1), out_axes=1))(probs, jnp.asarray(u))
  chosen = np.take_along_axis(np.asarray(probs), np.asarray(drawn), axis=1)     # [b, 3v]
  assert (chosen > 0).all(), f"{int((chosen == 0).sum())} of {chosen.size} draws had probability 0"


# ---------------------------------------------------------------- command line

def test_cli_generate_lookahead_equals_dense_and_reports_stats(capsys, dense):
  assert TEXTS[0] == "Once upon a time"          # dense[0] is its dense continuation
  code = cli.main(["generate", "--prompt", TEXTS[0], "--max-new-tokens", "48", "--ignore-eos",
                   "--json", "--method", "lookahead", "--lookahead-window", "4", "--ngram", "3",
                   "--guesses", "2"])
  out, _ = capsys.readouterr()
  assert code == 0
  la = json.loads(out)
  assert la["tokens"] == dense[0][:48]
  stats = la["stats"]
  assert stats["method"] == "lookahead"
  assert stats["method_config"]["window"] == 4 and stats["method_config"]["ngram"] == 3
  for key in ("tau", "steps", "guesses_per_step", "pool_hit_rate", "accept_rate"):
    assert key in stats
  assert stats["steps"] < 48 and stats["guesses_per_step"] <= 2
  code = cli.main(["generate", "--prompt", "Once", "--ngram", "3"])
  _, err = capsys.readouterr()
  assert code == 2 and "--ngram does not apply to --method dense" in err


# ---------------------------------------------------------------- one step by hand

def test_each_step_s_window_pool_and_candidates_follow_the_algorithm_by_hand(stories, dense):
  """Lossless output does not show how well Lookahead guesses (a window column fed the wrong
  tokens, an n-gram stored from the wrong level or during warm-up only lower tau). Step by step,
  from the state before it, recomputed with plain calls:
  * column j's new token is dense greedy's next token after the context, level 0 tokens 0..j and
    levels 1..N-2 of column j (a causal forward over the full cache); the window moves up a level;
  * the pool afterwards equals the pool before plus, in order, each column's n-gram (level 0 token
    -> the levels above and the new token) once levels 1.. came from the model (N-2 steps), then
    the N-gram ending at each appended token;
  * the candidates are the pool's lookup under the current token: the step counts them and
    appends 1 + the longest prefix of one that dense greedy takes."""
  from sparsedec.attention import AttentionPlan, FullView, Segment
  from sparsedec.model.forward import forward as model_forward
  from sparsedec.ngram import pool as ngram_pool
  cfg, params, prompts = stories
  w, n, g = METHOD.window, METHOD.ngram, METHOD.guesses
  lv = n - 1
  state, run = api.start(cfg, params, prompts, max_new_tokens=NEW, stop_tokens=(),
                         method=METHOD, cache_size=CACHE)
  b = len(prompts)
  truth = [np.asarray(state.tokens[r, : int(state.prompt_lengths[r])]).tolist() + list(dense[r])
           for r in range(b)]
  width = w + lv - 1                                  # the longest column run, padded to it
  plan = AttentionPlan(jnp.asarray(np.tril(np.ones((width, width), bool))),
                       (Segment(FullView(), 0, width),))
  forward = jax.jit(model_forward, static_argnums=0)
  lookup = jax.jit(ngram_pool.lookup, static_argnames="num")
  hits, sizes = 0, []
  for step in range(8):
    x = jax.tree.map(np.array, state.extras)           # (advance donates the state's buffers)
    num = np.asarray(state.num_tokens).tolist()
    seqs = [np.asarray(state.tokens[r, : num[r]]).tolist() for r in range(b)]
    cands, ok = lookup(x.pool, jnp.asarray([[s[-1]] for s in seqs], jnp.int32),
                       jnp.ones((b,), jnp.int32), num=g)
    cands = [np.asarray(cands[r])[np.asarray(ok[r])].tolist() for r in range(b)]
    window = x.window.copy()
    window[:, 0, 0] = [s[-1] for s in seqs]
    new = np.zeros((b, w), np.int64)
    for j in range(w):
      run_j = np.concatenate([window[:, 0, : j + 1], window[:, 1:, j]], axis=1)   # [B, j + lv]
      padded = np.pad(run_j, ((0, 0), (0, width - run_j.shape[1])))
      positions = state.cache.lengths[:, None] + jnp.arange(width)[None]
      logits, _ = forward(cfg, params, jnp.asarray(padded, jnp.int32), positions, state.cache,
                          plan)
      new[:, j] = np.asarray(jnp.argmax(logits[:, j + lv - 1], axis=-1))

    after = run.advance(params, state, 1)
    y = after.extras
    rows = []
    for r in range(b):
      appended = int(after.num_tokens[r]) - num[r]
      full = seqs[r] + np.asarray(after.tokens[r, num[r]: num[r] + appended]).tolist()
      assert full == truth[r][: len(full)], (step, r)
      longest = max([next((i for i in range(lv) if c[i] != truth[r][num[r] + i]), lv)
                     for c in cands[r]], default=0)
      assert appended == 1 + longest, (step, r, appended, cands[r])
      assert int(y.guesses[r] - x.guesses[r]) == len(cands[r]), (step, r)
      assert int(y.hit_steps[r] - x.hit_steps[r]) == int(bool(cands[r])), (step, r)
      assert int(y.accept_steps[r] - x.accept_steps[r]) == int(longest > 0), (step, r)
      hits, sizes = hits + bool(cands[r]), sizes + [appended]
      items = []
      if step >= lv - 1:
        items += [((int(window[r, 0, j]),), tuple(window[r, 1:, j].tolist()) + (int(new[r, j]),))
                  for j in range(w)]
      for end in range(num[r], num[r] + appended):
        if end - lv >= 0:
          items.append(((full[end - lv],), tuple(full[end - lv + 1: end + 1])))
      rows.append(items)
    moved = np.concatenate([window[:, 1:], new[:, None]], axis=1)
    np.testing.assert_array_equal(np.asarray(y.window), moved, str(step))
    assert_pools_equal(y.pool, insert_items(x.pool, *rows), str(step))
    state = after
  assert hits >= 3 and max(sizes) >= 3, (hits, sizes)     # lookups hit, guesses were taken


def test_a_stop_token_in_the_new_level_is_replaced_there_only(stories):
  """A stop token the last level produces is replaced by a context token as the window moves (it
  would fill with end-of-text); the level's other new tokens are the model's, kept as they are."""
  cfg, params, prompts = stories
  kw = dict(max_new_tokens=8, method=METHOD, cache_size=CACHE)
  state, run = api.start(cfg, params, prompts, stop_tokens=(), **kw)
  made = np.asarray(run.advance(params, state, 1).extras.window[:, -1])        # [B, W]
  stop = next(int(t) for t in made[0] if int(t) not in prompts[0])
  state, run = api.start(cfg, params, prompts, stop_tokens=(stop,), **kw)
  window = np.asarray(run.advance(params, state, 1).extras.window[:, -1])
  assert stop not in window
  kept = made != stop
  assert (~kept).any() and (window[kept] == made[kept]).all(), (window, made)
