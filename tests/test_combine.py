"""The log-sum-exp combine of the split kernels: its elementwise form (few partials, a Tq = 1
step) and its reduction form compute the same merge, empty splits and empty rows included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import combine
from pallas_kernels.combine import combine_partials


def _inputs(seed, b, hkv, group, tq, ns, d, keys, empty_rows):
  """Random partials as a kernel leaves them ([B, Hkv, 1, NS, R, D]; -inf / 0 for empty splits),
  q, and one exact key set of `keys` keys with a random mask (rows in `empty_rows` see nothing)."""
  rng = np.random.default_rng(seed)
  rows = -(-tq * group // 8) * 8
  acc = rng.normal(size=(b, hkv, 1, ns, rows, d)).astype(np.float32)
  m2 = rng.normal(size=(b, hkv, 1, ns, 64)).astype(np.float32) * 3
  l = rng.uniform(0.5, 4.0, size=(b, hkv, 1, ns, 64)).astype(np.float32)
  empty = rng.random(size=(b, hkv, 1, ns, 1)) < 0.3                      # splits that saw nothing
  m2 = np.where(empty, -np.inf, m2)
  l = np.where(empty, 0.0, l)
  acc = np.where(empty[..., :1, None], 0.0, acc)
  q = rng.normal(size=(b, tq, hkv * group, d)).astype(np.float32)
  k = rng.normal(size=(b, keys, hkv, d)).astype(np.float32)
  v = rng.normal(size=(b, keys, hkv, d)).astype(np.float32)
  mask = rng.random(size=(1, tq, keys)) < 0.7
  for t in empty_rows:                    # query t: no key set key, and every split empty
    mask[:, t] = False
    r = [t * group + g for g in range(group)]
    m2[:, :, :, :, r] = -np.inf
    l[:, :, :, :, r] = 0.0
  return [jnp.asarray(x) for x in (acc, m2, l, q)], (jnp.asarray(k), jnp.asarray(v),
                                                     jnp.asarray(mask))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2 ** 16), b=st.integers(1, 2), hkv=st.integers(1, 3),
       group=st.sampled_from([1, 2, 4]), tq=st.integers(1, 3), ns=st.integers(1, 12),
       keys=st.integers(1, 4), empty_row=st.booleans())
def test_elementwise_and_reduced_forms_agree(seed, b, hkv, group, tq, ns, keys, empty_row):
  (acc, m2, l, q), key_set = _inputs(seed, b, hkv, group, tq, ns, 16, keys,
                                     [tq - 1] if empty_row else [])
  def merged(max_partials):     # a fresh jit each time: the form is chosen while tracing
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(combine, "UNROLL_MAX_PARTIALS", max_partials)
      return jax.jit(lambda *a: combine_partials(*a[:4], [a[4:]], group=group))(
          acc, m2, l, q, *key_set)

  wide, reduced = merged(10 ** 6), merged(0)
  for got, want in zip(wide, reduced):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  if empty_row:                           # a row that sees nothing: output 0, lse -inf
    out, lse = wide
    assert np.all(np.asarray(out)[:, -1] == 0) and np.all(np.asarray(lse)[:, -1] == -np.inf)


def _float64_combine(acc, m2, l, q, key_set, group):
  """combine_partials in numpy float64, term by term: every split's partial (m2 in log2 units)
  and every exact key the row's query sees, weighted by exp(m - max) over all of them."""
  acc, m2, l, q = (np.asarray(x, np.float64) for x in (acc, m2, l, q))
  k, v, mask = (np.asarray(x) for x in key_set)
  b, tq, hq, d = q.shape
  hkv, ns = acc.shape[1], acc.shape[3]
  out, lse = np.zeros((b, tq, hq, d)), np.full((b, tq, hq), -np.inf)
  for row, t, head in np.ndindex(b, tq, hq):
    h, r = head // group, t * group + head % group
    terms = [(m2[row, h, 0, i, r] * np.log(2.0), l[row, h, 0, i, r], acc[row, h, 0, i, r])
             for i in range(ns)]
    terms += [(q[row, t, head] @ k[row, u, h].astype(np.float64) / np.sqrt(d), 1.0,
               v[row, u, h].astype(np.float64))
              for u in range(k.shape[1]) if mask[0, t, u]]
    top = max(m for m, _, _ in terms)
    if top == -np.inf:
      continue                                   # sees nothing: out 0, lse -inf
    w = [np.exp(m - top) for m, _, _ in terms]
    denom = sum(wi * li for wi, (_, li, _) in zip(w, terms))
    out[row, t, head] = sum(wi * a for wi, (_, _, a) in zip(w, terms)) / denom
    lse[row, t, head] = top + np.log(denom)
  return out, lse


@pytest.mark.parametrize("max_partials", [10 ** 6, 0], ids=["elementwise", "reduced"])
@pytest.mark.parametrize("seed, tq, keys", [(1, 1, 1), (2, 3, 4)])
def test_combine_equals_a_float64_merge_at_large_logits(max_partials, seed, tq, keys):
  """Both forms against an independent float64 merge, with row maxima near 100 (natural log):
  exp(m) alone overflows fp32 there, so a merge that weighted the partials by exp(m_i) and
  divided by exp(m) afterwards (no rescale by exp(m_i - m) first) gives inf / NaN. Empty splits
  and (at 3 queries) a row that sees nothing included."""
  group = 2
  empty = [tq - 1] if tq > 1 else []
  (acc, m2, l, q), (k, v, mask) = _inputs(seed, 2, 2, group, tq, 5, 16, keys, empty)
  m2 = m2 + 150.0                                # log2 units: ~104 natural; -inf stays -inf
  q = q * 60.0                                   # exact-key scores (std 60) as large
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(combine, "UNROLL_MAX_PARTIALS", max_partials)
    out, lse = jax.jit(lambda *a: combine_partials(*a[:4], [a[4:]], group=group))(
        acc, m2, l, q, k, v, mask)
  want_out, want_lse = _float64_combine(acc, m2, l, q, (k, v, mask), group)
  out, lse = np.asarray(out), np.asarray(lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  assert np.isneginf(want_lse).any() == bool(empty)
  live = np.isfinite(want_lse)
  assert np.abs(want_lse[live]).max() > 90       # the overflow regime is exercised
  np.testing.assert_allclose(lse[live], want_lse[live], rtol=1e-6, atol=1e-4)
  np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ns, keys, expect", [(8, 1, "_combine_elementwise"),
                                              (combine.UNROLL_MAX_PARTIALS + 1, 1,
                                               "_combine_reduced"),
                                              (8, combine.UNROLL_MAX_KEYS + 1, "_combine_reduced")])
def test_the_form_follows_the_counts(monkeypatch, ns, keys, expect):
  (acc, m2, l, q), key_set = _inputs(0, 1, 1, 4, 1, ns, 16, keys, [])
  called = []
  for name in ("_combine_elementwise", "_combine_reduced"):
    real = getattr(combine, name)
    monkeypatch.setattr(combine, name,
                        lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
  combine_partials(acc, m2, l, q, [key_set], group=4)
  assert called == [expect]


def test_given_scores_are_checked():
  (acc, m2, l, q), exact = _inputs(0, 1, 2, 4, 1, 3, 64, 1, ())
  for bad in (jnp.zeros((1, 2, 2)), jnp.zeros((1, 1, 64)), jnp.zeros((1, 2, 64), jnp.int32)):
    with pytest.raises(ValueError, match="given_scores must be"):
      combine_partials(acc, m2, l, q, [exact], group=4, given_scores=bad)
  with pytest.raises(ValueError, match="0 exact key sets"):           # was silently ignored
    combine_partials(acc, m2, l, q, [], group=4, given_scores=jnp.zeros((1, 2, 64)))


@pytest.mark.parametrize("a_dtype, b_dtype, full", [
    (jnp.float32, jnp.float32, True), (jnp.float32, jnp.bfloat16, True),
    (jnp.bfloat16, jnp.float32, True), (jnp.bfloat16, jnp.bfloat16, False),
    (jnp.float16, jnp.float16, False), (jnp.float16, jnp.bfloat16, True)])   # fp16 x bf16: fp32
def test_f32_einsum_multiplies_at_full_precision_whenever_the_product_is_fp32(a_dtype, b_dtype,
                                                                              full):
  """An fp32 query against bf16 K/V (as benchmarks pass the references) is promoted to an fp32
  product: it must ask for HIGHEST, as two fp32 operands do (jax's default is TF32 on recent
  GPUs). Low-precision pairs stay at the default."""
  a, b = jnp.ones((2, 3), a_dtype), jnp.ones((3, 4), b_dtype)
  text = jax.jit(lambda x, y: combine.f32_einsum("ij,jk->ik", x, y)).lower(a, b).as_text()
  dots = [line for line in text.splitlines() if "dot_general" in line]
  assert len(dots) == 1
  assert ("precision = [HIGHEST, HIGHEST]" in dots[0]) == full, dots
