"""Slow-Fast Inference (sparsedec.decode.sfi): dense greedy's output when the memory holds every
block, slow steps exactly at sentence ends and the refresh budget, fast steps reading only their
memory, serving inserts, the CLI's sentence ends, bad input refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsedec
from sparsedec import testing
from sparsedec.decode import api
from sparsedec.decode.loop import StepContext
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.decode.sfi import SlowFast, sentence_boundary_tokens


@pytest.fixture(scope="module")
def ends(stories):
  return sentence_boundary_tokens(stories[2])


@pytest.fixture(scope="module")
def stories_prompts(stories):
  _, _, tok = stories
  story = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
           "the park with her friends. One day")
  return [tok.encode(story), tok.encode("The little dog ran to the park and saw a")]


def test_sentence_boundary_tokens(stories, ends):
  _, _, tok = stories
  texts = {tok.decode([t]) for t in ends}
  assert {".", "!", "?", "\n"} <= texts and all(t.rstrip(" \"')")[-1] in ".!?\n" for t in texts)
  assert tok.encode("Lily")[-1] not in ends


def test_a_memory_of_every_block_gives_dense_greedy(stories, stories_prompts, ends):
  """256 tokens, two prompts in one batch, fp32: with a budget that holds every block of the cache
  a fast step reads what dense decoding reads, so the tokens are dense greedy's, through both
  slow and fast steps."""
  cfg, params, _ = stories
  method = SlowFast(budget_blocks=32, block_size=16, boundary_tokens=ends, max_fast_steps=16)
  result = testing.assert_matches_dense(cfg, params, stories_prompts, method=method,
                                        max_new_tokens=256, stop_tokens=(), cache_size=320)
  stats = result.method_stats
  assert stats["slow_steps"] > 0 and stats["fast_steps"] > stats["slow_steps"], stats


def test_slow_steps_come_at_sentence_ends_and_the_refresh_budget(stories, stories_prompts,
                                                                 ends):
  """A compressed memory (48 + recent tokens): each row's slow steps are exactly the steps whose
  current token ends a sentence or that follow max_fast_steps fast steps (replayed from the
  tokens), and the text stays close to dense greedy's (near-lossless: here the first 40 tokens
  of each row are dense's)."""
  cfg, params, _ = stories
  method = SlowFast(budget_blocks=2, block_size=16, recent_blocks=1, boundary_tokens=ends,
                    max_fast_steps=8)
  got = sparsedec.generate(cfg, params, stories_prompts, method=method, max_new_tokens=200,
                           stop_tokens=(), cache_size=256, return_state=True)
  dense = sparsedec.generate(cfg, params, stories_prompts, max_new_tokens=200, stop_tokens=(),
                             cache_size=256)
  for row, (tokens, prompt) in enumerate(zip(got.tokens, stories_prompts)):
    sequence = list(prompt) + list(tokens)
    slow = fast = run = 0
    for j in range(len(tokens) - 1):          # step j's current token: the prefill's, then each
      current = sequence[len(prompt) + j]
      if current in ends or run >= method.max_fast_steps:
        slow, run = slow + 1, 0
      else:
        fast, run = fast + 1, run + 1
    stats = got.row_method_stats[row]
    assert (stats["slow_steps"], stats["fast_steps"]) == (slow, fast), (row, stats)
    assert 0 < slow < fast
    assert list(tokens[:40]) == list(dense.tokens[row][:40])


def test_a_fast_step_reads_only_its_memory(stories, stories_prompts, ends):
  """Cache entries outside a fast step's block lists (sink, 1 selected block, the recent region
  since the last slow step) are poisoned: the step's committed K/V (of the last layer, which its
  attention feeds) and its token do not change; forced slow (the refresh budget spent), the same
  step reads them and changes."""
  cfg, params, _ = stories
  method = SlowFast(budget_blocks=1, block_size=16, recent_blocks=1, boundary_tokens=(),
                    max_fast_steps=30)
  ctx = StepContext(SamplingConfig(), ())
  state, _ = api.start(cfg, params, stories_prompts[:1], method=method, max_new_tokens=80,
                       cache_size=128, stop_tokens=())
  step = jax.jit(lambda s: method.step(cfg, params, s, ctx))
  for _ in range(34):              # a slow step at 30 (the budget), its memory read 3 times since
    state = step(state)
  x = state.extras
  assert int(x.slow_steps[0]) == 1 and int(x.fast_run[0]) == 3
  tables, counts = method.fast_tables(x, state.cache.lengths, 128 // 16)
  listed = np.zeros((cfg.num_layers, 1, cfg.num_kv_heads, 128), bool)
  t, c = np.asarray(tables), np.asarray(counts)
  for layer in range(cfg.num_layers):
    for h in range(cfg.num_kv_heads):
      for blk in t[layer, 0, h, :c[layer, 0, h]]:
        listed[layer, 0, h, blk * 16:(blk + 1) * 16] = True
  n = int(state.cache.lengths[0])
  assert (~listed[:, :, :, :n]).any()                                    # something unlisted
  poison = lambda buf, i: jnp.where(jnp.asarray(listed[i])[..., None], buf, 50.0)  # noqa: E731
  poisoned = state.replace(cache=state.cache.replace(
      k=[poison(k, i) for i, k in enumerate(state.cache.k)],
      v=[poison(v, i) for i, v in enumerate(state.cache.v)]))

  def after(s):
    out = step(s)
    return np.asarray(out.cache.k[-1][0, :, n]), int(out.num_tokens[0]), np.asarray(out.tokens)

  clean, fast_poisoned = after(state), after(poisoned)
  np.testing.assert_array_equal(clean[0], fast_poisoned[0])
  np.testing.assert_array_equal(clean[2], fast_poisoned[2])
  spent = lambda s: s.replace(extras=s.extras.replace(                     # noqa: E731
      fast_run=jnp.full_like(s.extras.fast_run, 30)))
  slow_clean, slow_poisoned = after(spent(state)), after(spent(poisoned))
  assert not np.allclose(slow_clean[0], slow_poisoned[0])


def test_an_inserted_request_decodes_as_alone(stories, ends):
  """Serving: a request inserted into a running batch's finished row decodes its tokens and
  counts its slow and fast steps as it would alone (the memory is per row, [L, B, ...])."""
  from insert_alone import assert_insert_decodes_as_alone
  cfg, params, tok = stories
  method = SlowFast(budget_blocks=1, block_size=16, recent_blocks=1, boundary_tokens=ends,
                    max_fast_steps=6)
  assert_insert_decodes_as_alone(cfg, params, tok, method, ("slow_steps", "fast_steps"),
                                 "Lily and Tom went to the park to play. They saw a big red ball")

def test_bad_input_is_refused_by_name(stories):
  cfg, params, _ = stories
  for knobs, message in (({"recent_blocks": 0}, "sfi recent_blocks must be an integer >= 1"),
                         ({"sink_blocks": -1}, "sfi sink_blocks must be an integer >= 0"),
                         ({"max_fast_steps": 1.5}, "sfi max_fast_steps must be an integer"),
                         ({"budget_blocks": 0}, "SlowFast: budget_blocks must be a positive"),
                         ({"boundary_tokens": [13]}, "boundary_tokens must be a tuple")):
    with pytest.raises(sparsedec.InputError, match=message):
      SlowFast(**knobs)
  run = lambda m, **kw: sparsedec.generate(cfg, params, [[1, 2, 3]], max_new_tokens=4,  # noqa
                                           method=m, **kw)
  with pytest.raises(sparsedec.InputError, match=r"capacity 100 is not a multiple of block_size"):
    run(SlowFast(block_size=16), cache_size=100)
  with pytest.raises(sparsedec.InputError, match=r"boundary_tokens hold ids past the vocabulary"):
    run(SlowFast(block_size=16, boundary_tokens=(13, 9999)), cache_size=64)
