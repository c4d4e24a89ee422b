"""Verification of several guessed continuations in one forward, preserving the target distribution.

The guesses are deterministic (n-gram candidates: a draft distribution that is one-hot on the
guessed token). Given the model's logits at the current token and at every candidate token,
`verify` emits the accepted guessed tokens plus one token from the model, so that the emitted text
is distributed exactly as dense sampling (greedy: token-identical to dense greedy).

Sampling (multi-candidate rejection sampling, SpecInfer-style, for one-hot drafts): at depth i the
target distribution is p (at depth 0 the model's distribution after the current token). The
candidates still alive (their first i tokens equal the accepted ones) are tried in order: a
candidate's token t is accepted with probability min(1, p(t) / 1) = p(t); if rejected, p becomes
the residual max(p - onehot(t), 0), renormalised, and the next alive candidate is tried (a
candidate repeating a rejected token has residual probability 0). On acceptance the candidates not
continuing with t die and p becomes the model's distribution after t. When no candidate is
accepted, the step's last token is drawn from the residual; when all depths are accepted, from
the distribution after the last one. Each emitted token is therefore distributed as p (token t
accepted at the j-th distinct try has probability p(t); any other token (1 - sum of the tried
p) * p(x) / (1 - sum of the tried p) = p(x)).

The tries at one depth are computed at once: with the distinct tokens' masses in try order,
s_j = p(t_1) + ... + p(t_{j-1}), the j-th try accepts with p(t_j) / (1 - s_j), drawn with
independent uniforms; the first success wins (the same law as trying one after the other).

Greedy (temperature 0) is the special case where p is one-hot on the argmax: the longest candidate
prefix that matches the model's argmax tokens is accepted. `verify_greedy` computes it directly
(no random draws); `verify_sampled` with one-hot distributions gives the same tokens.

Sampled drafts (`verify_drafted`, Leviathan et al. 2023, one chain d_1 .. d_L drawn from a draft
model's distributions q_1 .. q_L): d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i));
at the first rejection the token is drawn from the residual norm(max(0, p_i - q_i)); when all L
are accepted a bonus token is drawn from p_{L+1}. Each emitted token is distributed as p_i:
P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) max(0, p(x) - q(x)) / Z
     = min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x), since Z = sum_y max(0, p(y) - q(y)) is the
rejection probability. One-hot q (deterministic guesses) reduces to `verify_sampled`'s rule.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsedec.decode.sampling import SamplingConfig, probabilities


@struct.dataclass
class Verdict:
  tokens: jax.Array       # [B, L+1] int32: the accepted guessed tokens, then the model's token
  num_tokens: jax.Array   # [B] int32: accepted + 1 (entries past it are unspecified)
  accepted: jax.Array     # [B] int32: guessed tokens accepted, 0..L
  candidate: jax.Array    # [B] int32: a candidate whose first `accepted` tokens were accepted

  def accepted_of(self, appended: jax.Array) -> jax.Array:
    """[B] guessed tokens accepted among the `appended` ([B]) the step kept of `tokens`: a step
    the token budget or a stop token cut short kept fewer than num_tokens, all of them guessed
    (they come first), so each kept one counts; an inactive row (0 appended) counts 0."""
    return jnp.where(appended < self.num_tokens, appended, self.accepted)


def _emit(cand_tokens: jax.Array, best: jax.Array, accepted: jax.Array,
          last: jax.Array) -> Verdict:
  """tokens = cand_tokens[best, :accepted] then `last`."""
  b = cand_tokens.shape[0]
  chosen = jnp.take_along_axis(cand_tokens, best[:, None, None], axis=1)[:, 0]    # [B, L]
  tokens = jnp.concatenate([chosen, jnp.zeros((b, 1), jnp.int32)], axis=1)        # [B, L+1]
  tokens = tokens.at[jnp.arange(b), accepted].set(last)
  return Verdict(tokens=tokens.astype(jnp.int32), num_tokens=(accepted + 1).astype(jnp.int32),
                 accepted=accepted.astype(jnp.int32), candidate=best.astype(jnp.int32))


def verify_greedy(root_logits: jax.Array, cand_tokens: jax.Array, cand_valid: jax.Array,
                  cand_logits: jax.Array) -> Verdict:
  """Longest candidate prefix equal to the model's argmax tokens, then the model's next argmax.

  root_logits [B, V] at the current token; cand_tokens [B, G, L]; cand_valid [B, G];
  cand_logits [B, G, L, V] at each candidate token (what follows it). Ties between equally long
  prefixes go to the first candidate.
  """
  b, g, _ = cand_tokens.shape
  root = jnp.argmax(root_logits, axis=-1).astype(jnp.int32)                       # [B]
  after = jnp.argmax(cand_logits, axis=-1).astype(jnp.int32)                      # [B, G, L]
  target = jnp.concatenate([jnp.broadcast_to(root[:, None, None], (b, g, 1)), after[:, :, :-1]],
                           axis=2)                                                # [B, G, L]
  match = (cand_tokens == target) & cand_valid[:, :, None]
  prefix = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=2), axis=2)          # [B, G]
  best = jnp.argmax(prefix, axis=1).astype(jnp.int32)                             # [B]
  accepted = jnp.max(prefix, axis=1)
  after_best = jnp.take_along_axis(after, best[:, None, None], axis=1)[:, 0]      # [B, L]
  prev = jnp.take_along_axis(after_best, jnp.maximum(accepted - 1, 0)[:, None], axis=1)[:, 0]
  return _emit(cand_tokens, best, accepted, jnp.where(accepted == 0, root, prev))


def verify_sampled(root_logits: jax.Array, cand_tokens: jax.Array, cand_valid: jax.Array,
                   cand_logits: jax.Array, keys: jax.Array,
                   to_probs: Callable[[jax.Array], jax.Array]) -> Verdict:
  """Multi-candidate rejection sampling (module docstring). Shapes as `verify_greedy`; keys [B]
  (one PRNG key per row); to_probs maps logits [B, V] to the target distribution [B, V]."""
  b, g, length = cand_tokens.shape
  rows = jnp.arange(b)
  # All uniforms of the step in one draw per row (one PRNG call compiles and runs faster than
  # several): [B, L, G] for the tries, [B] for the last token (inverse-CDF sampling). fp32 also
  # under jax_enable_x64 (float64 draws take other bits of the key: a seed would give other text).
  draws = jax.vmap(lambda k: jax.random.uniform(k, (length * g + 1,), jnp.float32))(keys)
  tries = draws[:, : length * g].reshape(b, length, g)
  earlier = jnp.asarray(np.tri(g, k=-1, dtype=bool))                              # [g, g'] g' < g

  def depth(carry, xs):
    # p [B, V]: the target at this depth; final [B, V]: what the last token is drawn from.
    p, final, alive, going, accepted, best = carry
    tok, u, logits = xs                                              # [B, G], [B, G], [B, G, V]
    repeat = jnp.any((tok[:, :, None] == tok[:, None, :]) & alive[:, None, :] & earlier[None],
                     axis=2)
    first = alive & ~repeat & going[:, None]                                      # distinct tries
    mass = jnp.where(first, jnp.take_along_axis(p, tok, axis=1), 0.0)             # [B, G]
    before = jnp.cumsum(mass, axis=1) - mass
    success = first & (mass > 0) & (u * (1.0 - before) < mass)
    hit = jnp.any(success, axis=1)                                                # [B]
    pick = jnp.argmax(success, axis=1).astype(jnp.int32)
    token = tok[rows, pick]
    tried = jnp.zeros_like(p, dtype=bool).at[rows[:, None], tok].max(first)       # [B, V]
    residual = jnp.where(tried, 0.0, p)
    total = jnp.sum(residual, axis=1, keepdims=True)
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p)
    p = jnp.where(hit[:, None], to_probs(logits[rows, pick]), p)
    final = jnp.where(hit[:, None], p, jnp.where((going & ~hit)[:, None], residual, final))
    return (p, final, alive & (tok == token[:, None]) & hit[:, None], hit, accepted + hit,
            jnp.where(hit, pick, best)), None

  p = to_probs(root_logits)                                                       # [B, V]
  init = (p, p, cand_valid, jnp.ones((b,), bool), jnp.zeros((b,), jnp.int32),
          jnp.zeros((b,), jnp.int32))
  xs = (jnp.moveaxis(cand_tokens, 2, 0), jnp.moveaxis(tries, 1, 0),
        jnp.moveaxis(cand_logits, 2, 0))                 # one depth per iteration (compiled once)
  (_, final, _, _, accepted, best), _ = jax.lax.scan(depth, init, xs)
  return _emit(cand_tokens, best, accepted, draw_from(final, draws[:, -1]))


def draw_from(probs: jax.Array, u: jax.Array) -> jax.Array:
  """Inverse-CDF draw: tokens [B] from probs [B, V] (unnormalised, >= 0) with uniforms u [B] in
  [0, 1): the first token of positive probability whose CDF exceeds u*total (the last such token
  if rounding leaves none). A token of probability 0 is never drawn: XLA's cumsum re-associates
  its sums, so the CDF is not monotone to the last bit and wiggles inside the flat runs of
  removed tokens, where a plain count of `cdf <= u*total` could land."""
  cdf = jnp.cumsum(probs, axis=-1)                                                # [B, V]
  target = u * cdf[:, -1]
  positive = probs > 0                                                            # [B, V]
  above = positive & (cdf > target[:, None])
  last = jnp.max(jnp.where(positive, jnp.arange(probs.shape[-1]), 0), axis=-1)    # [B]
  idx = jnp.where(jnp.any(above, axis=-1), jnp.argmax(above, axis=-1), last)
  return idx.astype(jnp.int32)


def verify(root_logits: jax.Array, cand_tokens: jax.Array, cand_valid: jax.Array,
           cand_logits: jax.Array, keys: jax.Array, sampling: SamplingConfig) -> Verdict:
  """Accept guessed tokens against the model: greedy when sampling.greedy, else distribution-
  preserving rejection sampling from `probabilities(logits, sampling)` (temperature, top-k, top-p).

  root_logits [B, V]: logits at the current token; cand_tokens [B, G, L] candidate continuations
  of it; cand_valid [B, G]; cand_logits [B, G, L, V]: logits at each candidate token; keys [B].
  """
  if sampling.greedy:
    return verify_greedy(root_logits, cand_tokens, cand_valid, cand_logits)
  return verify_sampled(root_logits, cand_tokens, cand_valid, cand_logits, keys,
                        lambda logits: probabilities(logits, sampling))


def speculative_accept(p: jax.Array, q: jax.Array, token: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
  """One Leviathan accept/residual step (module docstring). p, q [..., V]: the target's and the
  draft's distributions; token [...] int: the draft's token, drawn from q.

  Returns the acceptance probability min(1, p(t) / q(t)) [...] (1 where q(t) = 0 < p(t), 0 where
  both are 0) and the residual norm(max(0, p - q)) [..., V], which is p where p - q has no positive
  mass (then p == q and a rejection has probability 0). A q holding a NaN is no distribution (a
  draft of NaN weights: its token is drawn from nothing, token 0): its token is rejected and the
  residual is p, so the emitted token is still drawn from p (a NaN q(t) was taken as 0 and the
  token accepted: a NaN draft's token 0, every time)."""
  pt = jnp.take_along_axis(p, token[..., None], axis=-1)[..., 0]
  qt = jnp.take_along_axis(q, token[..., None], axis=-1)[..., 0]
  excess = jnp.maximum(p - q, 0.0)                       # a NaN in q stays NaN (jnp.maximum)
  total = jnp.sum(excess, axis=-1, keepdims=True)
  broken = jnp.isnan(total)                               # [..., 1]: q held a NaN
  alpha = jnp.where(qt > 0, jnp.minimum(1.0, pt / jnp.where(qt > 0, qt, 1.0)),
                    (pt > 0).astype(p.dtype))
  alpha = jnp.where(broken[..., 0], 0.0, alpha)
  residual = jnp.where((total > 0) & ~broken, excess / jnp.where(total > 0, total, 1.0), p)
  return alpha, residual


def verify_drafted(target_probs: jax.Array, drafts: jax.Array, draft_probs: jax.Array,
                   valid: jax.Array, uniforms: jax.Array) -> Verdict:
  """Speculative sampling of one drafted chain (module docstring).

  target_probs [B, L+1, V]: p_1 .. p_{L+1}, the target after the current token and after each
  draft; drafts [B, L] with drafts[:, i] drawn from draft_probs[:, i] ([B, L, V], q_{i+1});
  valid [B] (an invalid row accepts nothing); uniforms [B, L+1] in [0, 1), independent of the
  drafts: L acceptance tests, then the draw of the last token (inverse CDF).
  """
  b, length = drafts.shape
  # alpha [B, L], residual [B, L, V]
  alpha, residual = speculative_accept(target_probs[:, :-1], draft_probs, drafts)
  ok = (uniforms[:, :length] < alpha) & valid[:, None]
  accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)           # [B]
  finals = jnp.concatenate([residual, target_probs[:, -1:]], axis=1)              # [B, L+1, V]
  final = jnp.take_along_axis(finals, accepted[:, None, None], axis=1)[:, 0]      # [B, V]
  last = draw_from(final, uniforms[:, length])
  return _emit(drafts[:, None], jnp.zeros((b,), jnp.int32), accepted, last)


def chain_uniforms(step_keys: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
  """The uniforms of one step of a sampled drafted chain, one draw per row: [B, L] for drawing
  the L drafts, [B, L + 1] for `verify_drafted` (L acceptance tests, the last token); fp32 under
  jax_enable_x64 too."""
  u = jax.vmap(lambda k: jax.random.uniform(k, (2 * length + 1,), jnp.float32))(step_keys)
  return u[:, :length], u[:, length:]


def verify_chain(logits: jax.Array, drafts: jax.Array, draft_probs: jax.Array | None,
                 valid: jax.Array, keys: jax.Array, uniforms: jax.Array | None,
                 sampling: SamplingConfig, probs: jax.Array | None = None) -> Verdict:
  """One drafted chain (QuantSpec's, a draft model's) against the target's logits [B, L + 1, V]
  over [current token, d_1 .. d_L]: drafts [B, L]; with draft_probs [B, L, V] (drafts drawn from
  them) and uniforms [B, L + 1], `verify_drafted`; with draft_probs None (argmax drafts, or
  greedy), the chain as one deterministic candidate (`verify`, keys [B]); valid [B]. probs: the
  caller's `probabilities(logits, sampling)` when it has them (not computed again)."""
  if draft_probs is None:
    return verify(logits[:, 0], drafts[:, None], valid[:, None], logits[:, None, 1:], keys,
                  sampling)
  probs = probabilities(logits, sampling) if probs is None else probs
  return verify_drafted(probs, drafts, draft_probs, valid, uniforms)


def drafts_counted(verdict: Verdict, appended: jax.Array, active: jax.Array,
                   length: int) -> tuple[jax.Array, jax.Array]:
  """(accepted [B], proposed [B]) drafts of a step of one drafted chain of `length` tokens, for
  the acceptance counters: a step the token budget or a stop token cut short appended fewer
  tokens than the verdict holds, all of them drafts (the accepted drafts come first), so only
  those count, as proposed and accepted (the last step does not count drafts never used as
  rejections); an inactive row appends nothing and counts 0."""
  cut = appended < verdict.num_tokens
  accepted = jnp.where(cut, appended, verdict.accepted)
  return accepted, jnp.where(cut, accepted, length) * active
