"""The split-merge Mosaic GPU kernel (`pallas_kernels.merge_partials`) in GPU interpret mode (CPU)
against its jnp reference and against a float64 log-sum-exp merge, plus the cuda lowering check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rand
from kernel_mode import INTERPRET
from pallas_kernels.merge_partials import (MAX_SLOTS, merge_partials, merge_partials_in_ranges,
                                           merge_partials_reference, splits_per_chunk)



def _partials(seed, *, b, hkv, qb, ns, d, n, empty=0.2):
  """Random partials as a split kernel leaves them: acc [B, Hkv, QB, NS, D, N], m2 / l
  [B, Hkv, QB, NS, NP]; a fraction `empty` of (split, row) pairs saw no key (m = -inf, l = 0,
  acc = 0), and column 1 of every q block sees nothing at all (when N > 1)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  n_pad = max(n, 32)
  m2 = 3.0 * rand.normal(ks[0], (b, hkv, qb, ns, n_pad))
  m2 = jnp.where(rand.bernoulli(ks[1], empty, m2.shape), -jnp.inf, m2)
  m2 = m2.at[..., 1].set(-jnp.inf)
  l = jnp.where(m2 == -jnp.inf, 0.0, jnp.abs(rand.normal(ks[2], m2.shape)) + 0.5)
  acc = rand.normal(ks[3], (b, hkv, qb, ns, d, n))
  acc = jnp.where((m2 == -jnp.inf)[..., None, :n], 0.0, acc)
  return acc, m2, l


def _float64_merge(acc, m2, l):
  """The merge in numpy float64: out [B, Hkv, QB, D, N], lse [B, Hkv, QB, N] (natural log)."""
  acc, m2, l = (np.asarray(x, np.float64) for x in (acc, m2, l))
  n = acc.shape[-1]
  m = m2[..., :n]
  top = np.max(m, axis=3)
  top = np.where(np.isfinite(top), top, 0.0)
  w = np.exp2(m - top[:, :, :, None])                                      # [B, Hkv, QB, NS, N]
  l_tot = np.sum(w * l[..., :n], axis=3)
  o = np.sum(acc * w[:, :, :, :, None], axis=3)
  with np.errstate(divide="ignore", invalid="ignore"):
    out = np.where(l_tot[:, :, :, None] > 0, o / l_tot[:, :, :, None], 0.0)
    lse = np.where(l_tot > 0, top * np.log(2.0) + np.log(l_tot), -np.inf)
  return out, lse


def _check(got, want, tol=1e-5):
  out, lse = got
  want_out, want_lse = want
  n = np.asarray(out).shape[-1]
  lse = np.asarray(lse)[..., :n]
  want_lse = np.asarray(want_lse)
  assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
  assert np.isneginf(want_lse).any()                     # the all-masked column is exercised
  np.testing.assert_allclose(np.where(np.isneginf(lse), 0, lse),
                             np.where(np.isneginf(want_lse), 0, want_lse), atol=tol, rtol=tol)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=tol, rtol=tol)


@pytest.mark.parametrize("ns, n", [(1, 8), (7, 24)])
def test_reference_equals_the_float64_merge(ns, n):
  """The jnp reference alone (no kernel: fast) against the float64 merge, empty splits and
  columns included: an exp for exp2, or lse in log2 units, shows here in a second (through the
  kernel test, 2.5 minutes of interpreter and hypothesis shrinking)."""
  args = _partials(11, b=2, hkv=2, qb=2, ns=ns, d=64, n=n)
  _check(jax.jit(merge_partials_reference)(*args), _float64_merge(*args))


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16), b=st.integers(1, 2), hkv=st.integers(1, 2),
       qb=st.integers(1, 2), ns=st.integers(1, 24), d=st.sampled_from([64, 128]),
       n=st.sampled_from([8, 24, 64]))
def test_matches_reference_and_float64(seed, b, hkv, qb, ns, d, n):
  args = _partials(seed, b=b, hkv=hkv, qb=qb, ns=ns, d=d, n=n)
  got = merge_partials(*args, interpret=INTERPRET)
  _check(got, merge_partials_reference(*args))
  _check(got, _float64_merge(*args))


def test_chunks_beyond_the_slots_and_a_partial_last_chunk():
  """More chunks than SMEM slots (refills) and a last chunk shorter than the others."""
  n, d = 64, 64
  chunk = splits_per_chunk(1000, n)
  ns = chunk * (MAX_SLOTS + 2) + 1
  assert ns > chunk * MAX_SLOTS and ns % chunk
  args = _partials(3, b=1, hkv=1, qb=1, ns=ns, d=d, n=n)
  got = merge_partials(*args, interpret=INTERPRET)
  _check(got, _float64_merge(*args))
  # Every split counts: a different last split changes the output.
  acc, m2, l = args
  bumped = merge_partials(acc.at[:, :, :, -1].add(10.0), m2, l, interpret=INTERPRET)[0]
  live = np.isfinite(np.asarray(m2)[0, 0, 0, -1, :n])
  assert np.abs(np.asarray(bumped - got[0])[..., live]).max() > 1e-3


@pytest.mark.parametrize("top", [0, 3])
def test_the_row_max_covers_every_chunk(top):
  """The merge's reference max covers every split, those of the full chunks and of the last,
  partial one: here split `top`'s max lies 200 (log2 units) above the others, so weighing it
  against a max taken without it overflows exp2 (2**197: inf, then NaN; the merge is otherwise
  exact for any reference, so moderate maxima do not show it). 4 splits at N = 64: a chunk of 3
  (split 0 in it) and a partial chunk of 1 (split 3)."""
  n, d, ns = 64, 64, 4
  assert splits_per_chunk(ns, n) == 3
  acc, m2, l = _partials(7, b=1, hkv=1, qb=1, ns=ns, d=d, n=n)
  m2 = m2.at[:, :, :, top].add(200.0)
  _check(merge_partials(acc, m2, l, interpret=INTERPRET), _float64_merge(acc, m2, l))


@pytest.mark.parametrize("ranges", [1, 3, 4])
def test_merged_in_ranges_equals_one_merge(ranges):
  """12 splits merged in ranges (two launches) equal the float64 merge; with 3 ranges, range 1
  (splits 4-7) of row 0 of q block 0 sees nothing (its lse is -inf: weight 0)."""
  acc, m2, l = _partials(5, b=1, hkv=2, qb=2, ns=12, d=64, n=8)
  m2, l, acc = m2.at[0, 0, 0, 4:8].set(-jnp.inf), l.at[0, 0, 0, 4:8].set(0.0), \
      acc.at[0, 0, 0, 4:8].set(0.0)
  _check(merge_partials_in_ranges(acc, m2, l, ranges=ranges, interpret=INTERPRET),
         _float64_merge(acc, m2, l))
  with pytest.raises(ValueError, match="ranges must be a positive divisor of NS=12, got 5"):
    merge_partials_in_ranges(acc, m2, l, ranges=5)


def test_bad_inputs_are_rejected_in_plain_words():
  acc, m2, l = _partials(0, b=1, hkv=1, qb=1, ns=3, d=64, n=8)
  with pytest.raises(ValueError, match="acc must be"):
    merge_partials(acc[0], m2, l, interpret=INTERPRET)
  with pytest.raises(ValueError, match="multiple of 8"):
    merge_partials(acc[..., :6], m2, l, interpret=INTERPRET)
  with pytest.raises(ValueError, match="NP >= 32"):
    merge_partials(acc, m2[..., :16], l[..., :16], interpret=INTERPRET)
  with pytest.raises(ValueError, match="l shape"):
    merge_partials(acc, m2, l[:, :, :, :2], interpret=INTERPRET)
  with pytest.raises(ValueError, match="float32"):
    merge_partials(acc.astype(jnp.bfloat16), m2, l, interpret=INTERPRET)
  with pytest.raises(ValueError, match="B=0"):                     # was a ZeroDivisionError
    merge_partials(acc[:0], m2[:0], l[:0], interpret=INTERPRET)
  with pytest.raises(ValueError, match="D=0"):                     # was a ZeroDivisionError
    merge_partials(acc[..., :0, :], m2, l, interpret=INTERPRET)
  # NP = 33: fine in the interpreter, Mosaic's 'strides ... a multiple of 16 bytes' on a GPU.
  pad = lambda x: jnp.pad(x, ((0, 0),) * 4 + ((0, 1),))
  with pytest.raises(ValueError, match="a multiple of 4"):
    merge_partials(acc, pad(m2), pad(l), interpret=INTERPRET)
  sds = jax.ShapeDtypeStruct
  stats = sds((1, 1, 1, 257, 64), jnp.float32)
  with pytest.raises(ValueError, match="at most MAX_SPLITS=256 splits .* NS=257"):
    jax.jit(merge_partials).trace(sds((1, 1, 1, 257, 64, 64), jnp.float32), stats, stats)


@pytest.mark.parametrize("hkv,n,ns", [
    (8, 8, 24),       # QuantSpec's draft at Llama-3.1-8B shapes (Tq = 1; 54 splits at 64K)
    (8, 24, 38),      # its verification (Tq = 5, 64K)
    (3, 64, 5),       # several q blocks of 64 rows
    (2, 8, 198),      # a 4-bit draft call's wave at 2 KV heads: the m and l tables leave room
                      # for 3 slots (four overflowed SMEM)
    (1, 64, 256),     # the most splits (MAX_SPLITS) at the widest N
])
def test_lowers_to_mosaic_gpu_custom_call_for_cuda(hkv, n, ns):
  sds = jax.ShapeDtypeStruct
  args = (sds((1, hkv, 2, ns, 128, n), jnp.float32), sds((1, hkv, 2, ns, max(n, 32)), jnp.float32),
          sds((1, hkv, 2, ns, max(n, 32)), jnp.float32))
  text = jax.jit(merge_partials).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu_v2" in text
