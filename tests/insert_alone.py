"""A request inserted into a running batch decodes as it would alone: the check the per-row
methods' serving tests share (test_speculative, test_triforce, test_sfi)."""

from __future__ import annotations

import sparsedec
from sparsedec.decode import api
from sparsedec.decode.serving import insert_row


def assert_insert_decodes_as_alone(cfg, params, tok, method, counters: tuple[str, ...],
                                   prompt: str = "Lily and Tom went to the park to play") -> None:
  """Two rows run 8 tokens and finish; a request for `prompt` started on its own (40 tokens) is
  inserted into row 1 and run to its end: its tokens, and each of `counters` (per-row fields of
  the method's extras), equal what the request gives alone."""
  kw = dict(max_new_tokens=40, stop_tokens=(), cache_size=128, method=method)
  state, run = api.start(cfg, params, [tok.encode("Once upon a time"), tok.encode("The dog")],
                         **{**kw, "max_new_tokens": 8})
  state = run.advance(params, state)
  ids = tok.encode(prompt)
  request, _ = api.start(cfg, params, [ids], **kw)
  state = run.advance(params, insert_row(state, request, 1), 100)
  tokens, _ = api.collect(state, ())
  alone = sparsedec.generate(cfg, params, [ids], **kw, return_state=True)
  assert tokens[1] == alone.tokens[0]
  for counter in counters:
    assert int(getattr(state.extras, counter)[1]) == int(getattr(alone.state.extras, counter)[0])
