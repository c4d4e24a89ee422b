"""Per-row method figures against each prompt decoded alone: the FAFO, Lookahead and QuantSpec
tests check a batch's row_tau / row_method_stats / api.method_stats(rows=...) the same way."""

from __future__ import annotations

import json

import sparsedec
from sparsedec.decode import api


def assert_rows_are_their_prompts_alone(cfg, params, prompts, method, per_step, batch_wide=(),
                                        alone_rows=None, **kwargs):
  """Decode `prompts` as one batch and each alone (B = 1, the same `kwargs`; only the rows
  `alone_rows` where given, e.g. rows of one prompt bucket, a prefill compile less): each row's
  figures (row_tau, row_method_stats, api.method_stats(rows=[r])) equal its prompt's alone but
  the `batch_wide` ones (e.g. cache bytes), which are the batch's in every row; and the rows'
  counters add up to the batch's figures: each `per_step` figure times its rows' active steps
  (rounded to 4 digits each) sums to the batch's over every active step. Returns the batch's
  GenerationResult."""
  batch = sparsedec.generate(cfg, params, prompts, method=method, return_state=True, **kwargs)
  rows = list(range(len(prompts)) if alone_rows is None else alone_rows)
  alone = [sparsedec.generate(cfg, params, [prompts[r]], method=method, **kwargs) for r in rows]
  # The premise: rows are independent, the tokens and steps a prompt's alone.
  assert [batch.tokens[r] for r in rows] == [a.tokens[0] for a in alone]
  assert [batch.active_steps[r] for r in rows] == [a.active_steps[0] for a in alone]
  own = lambda stats: {k: v for k, v in stats.items() if k not in batch_wide}  # noqa: E731
  want = [own(a.method_stats) for a in alone]
  assert want[0] != want[1], want                    # the rows differ: batch figures would not do
  assert [own(batch.row_method_stats[r]) for r in rows] == want
  got = [api.method_stats(method, batch.state, rows=[r]) for r in range(len(prompts))]
  assert got == batch.row_method_stats
  for key in batch_wide:
    assert [m[key] for m in got] == [batch.method_stats[key]] * len(prompts), key
  assert [batch.row_tau[r] for r in rows] == [a.tau for a in alone]
  # Every row asked for by index is the batch (None).
  assert api.method_stats(method, batch.state, rows=range(len(prompts))) == batch.method_stats
  steps = batch.active_steps
  for key in per_step:
    total = sum(m[key] * s for m, s in zip(batch.row_method_stats, steps))
    assert abs(total - batch.method_stats[key] * sum(steps)) <= 1e-4 * sum(steps), key
  assert abs(sum(t * s for t, s in zip(batch.row_tau, steps)) - batch.tau * sum(steps)) < 1e-9
  rows = batch.stats(per_row=True)["rows"]                 # JSON-ready, a dict per row
  assert json.loads(json.dumps(rows)) == rows
  assert [r["tau"] for r in rows] == [round(t, 4) for t in batch.row_tau]
  return batch
