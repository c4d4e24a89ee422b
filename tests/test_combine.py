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
