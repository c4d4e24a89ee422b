"""Insert a separately prefilled request into a free row of a running state."""

from __future__ import annotations

import jax
import pytest

import sparsedec
from sparsedec.decode import api
from sparsedec.decode.serving import insert_row
from sparsedec.weights.checkpoint import load_model
from conftest import STORIES_HF


@pytest.fixture(scope="module")
def stories():
  return load_model(STORIES_HF)


def test_inserted_request_generates_what_it_would_alone(stories):
  cfg, params, tok = stories
  kw = dict(max_new_tokens=24, stop_tokens=(), cache_size=128)
  first = [tok.encode("Once upon a time"), tok.encode("The little dog")]
  later = [tok.encode("Lily and Tom went to the park to play"), tok.encode("One day")]
  state, run = api.start(cfg, params, first, **kw)
  state = run.advance(params, state)                     # both rows finish
  assert bool(state.done.all())
  compiles = []
  for i, (row, prompt) in enumerate(zip((1, 0), later)):
    request, _ = api.start(cfg, params, [prompt], **kw)
    if i == 1:
      jax.monitoring.register_event_duration_secs_listener(
          lambda event, d, **k: compiles.append(event) if "backend_compile" in event else None)
    state = insert_row(state, request, row)
  jax.monitoring.clear_event_listeners()
  assert compiles == [], "a second insert recompiled"
  state = run.advance(params, state, 100)
  tokens, _ = api.collect(state, ())
  for row, prompt in zip((1, 0), later):
    alone = sparsedec.generate(cfg, params, [prompt], **kw).tokens[0]
    assert tokens[row] == alone


def test_insert_rejects_mismatched_states(stories):
  cfg, params, tok = stories
  state, _ = api.start(cfg, params, [[1, 2], [3, 4]], max_new_tokens=4, cache_size=128)
  other, _ = api.start(cfg, params, [[5, 6]], max_new_tokens=4, cache_size=256)
  with pytest.raises(sparsedec.InputError, match="cache capacities differ"):
    insert_row(state, other, 0)
  two, _ = api.start(cfg, params, [[5], [6]], max_new_tokens=4, cache_size=128)
  with pytest.raises(sparsedec.InputError, match="batch size 1"):
    insert_row(state, two, 0)
  one, _ = api.start(cfg, params, [[5]], max_new_tokens=4, cache_size=128)
  with pytest.raises(sparsedec.InputError, match="row 2 is outside"):
    insert_row(state, one, 2)
