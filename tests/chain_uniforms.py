"""The uniforms one step of a sampled drafted chain hands out (QuantSpec's, a draft model's):
recorded where the drafts are drawn and where `verify_drafted` tests them, and checked to be
distinct draws. Testing d_i with the uniform it was drawn with (d_i = inverse CDF of q_i at u,
accepted when u < p_i(d_i) / q_i(d_i)) biases the law only a little where the draft is good,
which a chi-square test of the output hardly sees."""

from __future__ import annotations

import jax
import numpy as np


def record(monkeypatch, drafting_module) -> dict:
  """Patch `drafting_module.draw_from` (where the method draws its drafts) and
  `verify.verify_drafted` (what `verify.verify_chain` calls) to record the uniforms they get;
  returns {"draft": [...], "verify": [...]}, filled as the traced step runs."""
  from sparsedec.decode import verify
  seen = {"draft": [], "verify": []}
  draw, drafted = drafting_module.draw_from, verify.verify_drafted

  def draw_from(probs, u):
    jax.debug.callback(lambda x: seen["draft"].append(np.asarray(x)), u)
    return draw(probs, u)

  def verify_drafted(target, drafts, q, valid, uniforms):
    jax.debug.callback(lambda x: seen["verify"].append(np.asarray(x)), uniforms)
    return drafted(target, drafts, q, valid, uniforms)

  monkeypatch.setattr(drafting_module, "draw_from", draw_from)
  monkeypatch.setattr(verify, "verify_drafted", verify_drafted)
  return seen


def assert_one_step_of_distinct_draws(seen: dict, batch: int, gamma: int) -> None:
  """One step's gamma draft uniforms [B, gamma] and gamma + 1 verification uniforms per row are
  2 gamma + 1 distinct draws."""
  assert len(seen["draft"]) == gamma and len(seen["verify"]) == 1, seen   # one step
  draft_u = np.stack(seen["draft"], axis=1)                                # [B, gamma]
  verify_u = seen["verify"][0]                                             # [B, gamma + 1]
  assert draft_u.shape == (batch, gamma) and verify_u.shape == (batch, gamma + 1)
  every = np.concatenate([draft_u, verify_u], axis=1)                      # [B, 2 gamma + 1]
  for row in every:
    assert len(set(row.tolist())) == row.size, every
