"""QuantSpec hierarchical INT4/INT8 KV quantizer and the Mosaic GPU quant_attention kernel,
in GPU interpret mode (CPU) against dequantize-then-attend (with the selected queries' per-slot
softmax weights, score_queries), plus the cuda lowering check."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rand
from kernel_mode import INTERPRET
from pallas_kernels.combine import f32_einsum
from pallas_kernels.register_operand import unpack_words
from pallas_kernels.quant_attention import (AUTO_DEQUANT_MIN_TOKENS, AUTO_DEQUANT_ROWS,
                                            DEQUANT_MAX_BYTES, QuantAttentionConfig, QuantKV,
                                            _block_kv, _dequantizes, _num_splits, _q_blocks,
                                            bytes_per_token, codes8,
                                            dequantize, exact_keys, fake_quantize, quant_attention,
                                            quant_attention_reference, quant_attention_with_keys,
                                            quantize_kv)

TOLERANCE = {jnp.bfloat16: 3e-2, jnp.float16: 4e-3}


# ----------------------------------------------------------------------------------------------
# Quantizer.
# ----------------------------------------------------------------------------------------------

def _int8_reference(x, axis):
  """Independent plain asymmetric 8-bit quantizer (numpy), groups reduced over `axis`:
  zero = group min rounded down to fp16; step = (max - zero) / 240 rounded up to fp16 (computed
  as the fp16 4-bit step / 16, exact); code = clip(round_half_even((x - zero) / step), 0, 240),
  x - zero in fp32 (the 1/15 as an fp32 constant multiply), the quotient in float64 (exact
  enough: its ties and roundings are the exact quotient's); x and the extremes clipped to fp16's
  +-65504, and the step capped so that zero + 15 * step <= 65504. Returns (code int32, zero
  fp16, 4-bit step fp16)."""
  x = np.asarray(x, np.float32)
  lo, hi = (np.clip(x.min(axis, keepdims=True), -65504, 65504),
            np.clip(x.max(axis, keepdims=True), -65504, 65504))
  zero = lo.astype(np.float16)
  with np.errstate(over="ignore"):       # nextafter(-65504) -> -inf where np.where drops it
    zero = np.where(zero.astype(np.float32) > lo, np.nextafter(zero, np.float16(-np.inf)), zero)
  want = (hi - zero.astype(np.float32)) * np.float32(1 / 15)
  step4 = want.astype(np.float16)
  step4 = np.where(step4.astype(np.float32) < want, np.nextafter(step4, np.float16(np.inf)), step4)
  # The grid's top stays <= 65504: else the step rounded down from (65504 - zero) / 15.
  cap = (np.float32(65504) - zero.astype(np.float32)) * np.float32(1 / 15)
  cap16 = cap.astype(np.float16)
  cap16 = np.where(cap16.astype(np.float32) > cap, np.nextafter(cap16, np.float16(0)), cap16)
  over = zero.astype(np.float32) + np.float32(15) * step4.astype(np.float32) > 65504
  step4 = np.where(over, cap16, step4)
  step4 = np.where(step4 > 0, step4, np.float16(1))
  step8 = step4.astype(np.float32) * np.float32(1 / 16)
  diff = (np.clip(x, -65504, 65504) - zero.astype(np.float32)).astype(np.float64)
  code = np.clip(np.rint(diff / step8.astype(np.float64)), 0, 240).astype(np.int32)
  return code, zero, step4


def _kv(seed, b, hkv, s, d, dtype, spread):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  # Per-channel outliers in K (the reason keys are grouped per channel), a per-token offset in V.
  # Combined in numpy (fp32): as jnp operations each new shape compiled each of them.
  normal = lambda key, shape: np.asarray(rand.normal(key, shape))          # noqa: E731
  k = normal(k1, (b, hkv, s, d)) * np.exp(np.float32(spread) * normal(k3, (d,)))
  v = normal(k2, (b, hkv, s, d)) + np.float32(spread) * normal(k3, (s, 1))
  return jnp.asarray(k).astype(dtype), jnp.asarray(v).astype(dtype)


# Inspection helpers jitted (one program per shape, not one per operation and shape).
_codes8 = jax.jit(codes8)
_unpack_words = jax.jit(unpack_words)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 16), s_groups=st.integers(1, 3), d=st.sampled_from([8, 64, 128]),
       group=st.sampled_from([8, 16, 128]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       spread=st.sampled_from([0.0, 1.0, 3.0]))
def test_int8_code_is_16_upper_plus_lower_bit_for_bit(seed, s_groups, d, group, dtype, spread):
  b, hkv, s = 1, 2, s_groups * group
  k, v = _kv(seed, b, hkv, s, d, dtype, spread)
  qkv = quantize_kv(k, v, group=group)
  k8, v8 = _codes8(qkv)
  kx = np.asarray(k, np.float32).reshape(b, hkv, s_groups, group, d)
  ref_k, ref_kz, ref_ks = _int8_reference(kx, axis=3)
  ref_v, ref_vz, ref_vs = _int8_reference(np.asarray(v, np.float32), axis=3)
  np.testing.assert_array_equal(np.asarray(k8), ref_k.reshape(b, hkv, s, d))
  np.testing.assert_array_equal(np.asarray(v8), ref_v)
  np.testing.assert_array_equal(np.asarray(qkv.k_zero), ref_kz[:, :, :, 0])
  np.testing.assert_array_equal(np.asarray(qkv.k_scale), ref_ks[:, :, :, 0])
  np.testing.assert_array_equal(np.asarray(qkv.v_zero), ref_vz[..., 0])
  np.testing.assert_array_equal(np.asarray(qkv.v_scale), ref_vs[..., 0])
  # The planes (signed 4-bit): plane 0 = upper - 8, plane 1 = lower; K as [.., plane, D/C, S, C]
  # (64-channel chunks), V in channel-major token tiles [.., plane, S/T, D, T], each row of codes
  # stored as words of 8 (`pack_words`). upper = nearest multiple of 16 of c8 (ties up).
  assert qkv.k_codes.dtype == jnp.uint32 and qkv.v_codes.dtype == jnp.uint32
  kc = np.asarray(_unpack_words(qkv.k_codes))
  vc = np.asarray(_unpack_words(qkv.v_codes))
  k_planes = np.moveaxis(kc, 3, 4).reshape(b, hkv, 2, s, d)                 # [B, Hkv, 2, S, D]
  v_planes = np.swapaxes(vc, -1, -2).reshape(b, hkv, 2, s, d)             # [B, Hkv, 2, S, D]
  for planes, c8 in ((k_planes, ref_k.reshape(b, hkv, s, d)), (v_planes, ref_v)):
    upper, lower = planes[:, :, 0] + 8, planes[:, :, 1]
    np.testing.assert_array_equal(upper, (c8 + 8) // 16)
    np.testing.assert_array_equal(16 * upper + lower, c8)
    assert lower.min() >= -8 and lower.max() <= 7


def test_values_exactly_halfway_between_codes_round_to_the_even_code():
  """Values exactly half a step between two 8-bit codes, on a grid whose step has no exact fp32
  reciprocal (4-bit step ~3, the 8-bit step ~3/16): the guessed quotient d * (1 / step8) may land
  on either side of the half; the settlement must give the even code (round half to even, as the
  numpy reference), for K (grids per channel over the group) and V (per token). Random inputs
  almost never sit on a tie, so the hypothesis test above does not see a broken tie rule."""
  g, d = 8, 8
  edges = np.zeros((g, d), np.float32)
  edges[1] = 45.0                              # every channel's group spans [0, 45]: step4 ~ 3
  s4 = np.asarray(quantize_kv(jnp.asarray(edges)[None, None], jnp.asarray(edges)[None, None],
                              group=g).k_scale, np.float32)[0, 0, 0, 0]
  step8 = np.float32(s4) * np.float32(1 / 16)
  halves = (np.arange(2, 2 + (g - 2) * d, dtype=np.float32).reshape(g - 2, d) * 2 + 1) / 2
  k = edges.copy()
  k[2:] = halves * step8                       # exact in fp32: (c + 1/2) * step8, c = 2 .. 97
  assert np.all(k[2:] % step8 == step8 / 2) and k.max() == 45.0
  v = k.T.copy()                               # per token: channels 0 and 1 hold 0 and 45
  kx, vx = jnp.asarray(k)[None, None], jnp.asarray(v)[None, None]   # [1, 1, G, D]
  qkv = quantize_kv(kx, vx, group=g)
  k8, v8 = _codes8(qkv)
  ref_k, _, ref_ks = _int8_reference(k[None, None, None], axis=3)
  ref_v, _, _ = _int8_reference(v[None, None], axis=3)
  assert float(ref_ks.max()) == s4
  np.testing.assert_array_equal(np.asarray(k8)[0, 0], ref_k.reshape(g, d))
  np.testing.assert_array_equal(np.asarray(v8)[0, 0], ref_v[0, 0])
  assert (ref_k.reshape(g, d)[2:] % 2 == 0).all()           # the even neighbour, every time


def test_values_beyond_fp16_range_saturate_instead_of_poisoning_their_group():
  """A bf16 K/V value past fp16's +-65504 (the scales' and zeros' type) gets a finite grid for its
  group, clipped to that range: codes and grid are the numpy reference's bit for bit, nothing is
  NaN or infinite, the outliers dequantize to the range's ends, and the other groups are as
  without them."""
  k, v = _kv(5, 1, 2, 64, 64, jnp.float32, 1.0)
  k_big = k.at[0, 0, 3, 5].set(-1e5).at[0, 1, 40, 7].set(3e6)          # group 0 / 1 of 32 keys
  v_big = v.at[0, 1, 9, 2].set(-7e4).at[0, 0, 20, :].set(1e6)          # tokens 9 and 20
  k_big, v_big = k_big.astype(jnp.bfloat16), v_big.astype(jnp.bfloat16)
  qkv = quantize_kv(k_big, v_big, group=32)
  for x in (qkv.k_scale, qkv.k_zero, qkv.v_scale, qkv.v_zero):
    assert np.isfinite(np.asarray(x, np.float32)).all()
  k8, v8 = _codes8(qkv)
  ref_k = _int8_reference(np.asarray(k_big, np.float32).reshape(1, 2, 2, 32, 64), axis=3)[0]
  np.testing.assert_array_equal(np.asarray(k8), ref_k.reshape(1, 2, 64, 64))
  np.testing.assert_array_equal(np.asarray(v8), _int8_reference(np.asarray(v_big, np.float32),
                                                                axis=3)[0])
  dk, dv = (np.asarray(x) for x in dequantize(qkv, 8))
  assert np.isfinite(dk).all() and np.isfinite(dv).all()
  assert dk[0, 0, 3, 5] == -65504 and dv[0, 1, 9, 2] == -65504
  assert 65504 - 16 * 65504 / 240 < dk[0, 1, 40, 7] <= 65504
  assert 65504 - 16 * 65504 / 240 < dv[0, 0, 20, 0] <= 65504
  # Groups without an outlier: as quantized without any.
  dk0, dv0 = (np.asarray(x) for x in dequantize(quantize_kv(k.astype(jnp.bfloat16),
                                                            v.astype(jnp.bfloat16), group=32), 8))
  np.testing.assert_array_equal(dk[0, 0, 32:], dk0[0, 0, 32:])
  np.testing.assert_array_equal(dk[0, 1, :32], dk0[0, 1, :32])
  untouched = np.setdiff1d(np.arange(64), [9, 20])
  np.testing.assert_array_equal(dv[0, :, untouched], dv0[0, :, untouched])


def test_a_group_spanning_fp16s_range_dequantizes_to_finite_fp16():
  """Finite fp16 extremes used to give a grid whose top, zero + 15 * s4 (s4 rounded up), was
  65520 / 65536: infinite once dequantized to fp16. The top now stays <= 65504 (s4 rounded
  down there) and the codes are the numpy reference's."""
  s, d = 64, 64
  k = jnp.zeros((1, 1, s, d)).at[0, 0, 0, :].set(-65504.).at[0, 0, 1, :].set(65504.)
  v = jnp.zeros((1, 1, s, d)).at[0, 0, :, 0].set(-65504.).at[0, 0, :, 1].set(65504.)
  v = v.at[0, 0, 3, :].set(0.).at[0, 0, 3, 5].set(65504.)            # zero 0: s4 4368 before
  qkv = quantize_kv(k.astype(jnp.float16), v.astype(jnp.float16), group=64)
  top = lambda z, st: z.astype(np.float32) + 15 * st.astype(np.float32)
  assert top(np.asarray(qkv.k_zero), np.asarray(qkv.k_scale)).max() <= 65504
  assert top(np.asarray(qkv.v_zero), np.asarray(qkv.v_scale)).max() <= 65504
  k8, v8 = _codes8(qkv)
  np.testing.assert_array_equal(np.asarray(v8), _int8_reference(np.asarray(v, np.float32), 3)[0])
  np.testing.assert_array_equal(np.asarray(k8), _int8_reference(np.asarray(k, np.float32), 2)[0])
  for bits in (4, 8):
    for x in dequantize(qkv, bits, jnp.float16):
      assert np.isfinite(np.asarray(x, np.float32)).all(), bits


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 16), d=st.sampled_from([8, 64, 128]),
       group=st.sampled_from([16, 128]), spread=st.sampled_from([0.0, 2.0]))
def test_dequantized_error_bounds(seed, d, group, spread):
  """|x - x8| <= s8 / 2 and |x - x4| <= 17/32 s4 (upper rounds up from 15/32 of a step), per
  element with its own group's step, plus fp32 rounding slack."""
  k, v = _kv(seed, 1, 2, 2 * group, d, jnp.float32, spread)
  qkv = quantize_kv(k, v, group=group)
  ks = np.repeat(np.asarray(qkv.k_scale, np.float32), group, axis=2)
  kz = np.repeat(np.asarray(qkv.k_zero, np.float32), group, axis=2)
  vs = np.asarray(qkv.v_scale, np.float32)[..., None]
  vz = np.asarray(qkv.v_zero, np.float32)[..., None]
  for bits, bound in ((8, 1 / 32), (4, 17 / 32)):
    dk, dv = dequantize(qkv, bits)
    for x, dx, step, zero in ((k, dk, ks, kz), (v, dv, vs, vz)):
      err = np.abs(np.asarray(x) - np.asarray(dx))
      slack = 1e-6 * (np.abs(zero) + 16 * step)
      assert np.all(err <= bound * step + slack), (bits, float((err / step).max()))
  # And the 8-bit view is the better one.
  e4 = np.abs(np.asarray(dequantize(qkv, 4)[0]) - np.asarray(k)).mean()
  e8 = np.abs(np.asarray(dequantize(qkv, 8)[0]) - np.asarray(k)).mean()
  assert e8 < e4 / 8


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fake_quantize_is_dequantize_of_quantize_kv_bit_for_bit(bits, dtype):
  """What QuantSpec's views read for the buffer's CF1 (no word packing) equals the stored path,
  to the bit, and is not the input (it does quantize)."""
  k, v = _kv(3, 2, 2, 128, 64, dtype, 2.0)
  want_k, want_v = dequantize(quantize_kv(k, v, group=64), bits)
  got_k, got_v = jax.jit(fake_quantize, static_argnums=(2, 3))(k, v, 64, bits)
  np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
  np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
  assert np.abs(np.asarray(got_k) - np.asarray(k, np.float32)).max() > 0


def test_bytes_per_token_vs_bf16():
  bf16 = 2 * 128 * 2
  assert bytes_per_token(128, 4) == 136 and bf16 / bytes_per_token(128, 4) > 3.7
  assert bytes_per_token(128, 8) == 264 and bf16 / bytes_per_token(128, 8) > 1.9


def test_bad_inputs_are_rejected_in_plain_words():
  k = jnp.zeros((1, 1, 100, 64))
  with pytest.raises(ValueError, match="multiple of group"):
    quantize_kv(k, k, group=128)
  with pytest.raises(ValueError, match="bits must be 4 or 8"):
    dequantize(quantize_kv(k[:, :, :64], k[:, :, :64], group=64), bits=2)


# ----------------------------------------------------------------------------------------------
# Kernel (interpret mode) against dequantize-then-attend.
# ----------------------------------------------------------------------------------------------

def _inputs(seed, *, batch, num_queries, num_q_heads, num_kv_heads, head_dim, capacity,
            full_capacity, group, dtype):
  keys = jax.random.split(jax.random.key(seed), 8)
  normal = lambda key, shape: rand.normal(key, shape, dtype)
  q = normal(keys[0], (batch, num_queries, num_q_heads, head_dim))            # [B, Tq, Hq, D]
  k, v = _kv(seed + 1, batch, num_kv_heads, capacity, head_dim, dtype, 1.0)  # [B, Hkv, S, D]
  qkv = quantize_kv(k, v, group=group)
  k_full = normal(keys[1], (batch, num_kv_heads, full_capacity, head_dim))   # [B, Hkv, Rf, D]
  v_full = normal(keys[2], (batch, num_kv_heads, full_capacity, head_dim))
  k_new = normal(keys[3], (batch, num_queries, num_kv_heads, head_dim))      # [B, Tq, Hkv, D]
  v_new = normal(keys[4], (batch, num_queries, num_kv_heads, head_dim))
  return q, qkv, k_full, v_full, k_new, v_new


def _exact_weights(q, k, lse, score_queries, read):
  """Softmax weights [B, n, Hq, U] of the selected queries on exactly attended keys k
  [B, U, Hkv, D] (numpy, fp32), normalised with `lse` [B, Tq, Hq]; read [B or 1, n, U] bool."""
  q, k = np.asarray(q, np.float32), np.asarray(k, np.float32)
  d, hq = q.shape[3], q.shape[2]
  k = np.repeat(k, hq // k.shape[2], axis=2)                              # [B, U, Hq, D]
  sel = list(score_queries)
  s = np.einsum("bthd,buhd->bthu", q[:, sel], k) * d ** -0.5             # [B, n, Hq, U]
  return np.where(read[:, :, None], np.exp(s - np.asarray(lse)[:, sel, :, None]), 0.0)


# One compiled program per shape instead of an XLA compile per op of the eager reference.
_reference = jax.jit(quant_attention_reference,
                     static_argnames=("bits", "return_lse", "score_queries"))


def _check(q, qkv, bits, lq, k_full, v_full, lf, k_new, v_new, mask, config, ref_qkv=None,
           score_queries=()):
  out, lse, *probs = quant_attention(q, qkv, lq, k_full, v_full, lf, k_new, v_new, mask,
                                     bits=bits, return_lse=True, score_queries=score_queries,
                                     config=config, interpret=INTERPRET)
  # fp32 reference copies: XLA:CPU has no bf16 x bf16 -> f32 dot.
  f32 = lambda x: x.astype(jnp.float32)
  ref_out, ref_lse, *ref_probs = _reference(
      f32(q), qkv if ref_qkv is None else ref_qkv, bits, lq, f32(k_full), f32(v_full), lf,
      f32(k_new), f32(v_new), mask, return_lse=True, score_queries=score_queries)
  if score_queries:
    probs = np.asarray(probs[0])
    assert probs.shape == (q.shape[0], len(score_queries), q.shape[2], qkv.capacity)
    # The kernel attends the bf16/fp16 dequantized K, the reference the fp32 one: as out.
    tol = TOLERANCE[q.dtype.type]
    np.testing.assert_allclose(probs, np.asarray(ref_probs[0]), atol=tol / 10, rtol=tol)
    unread = np.arange(qkv.capacity)[None] >= np.asarray(lq)[:, None]       # [B, S]
    assert np.all(probs.transpose(0, 3, 1, 2)[unread] == 0.0)
    # With the full-precision and in-flight parts a whole softmax: 1, or 0 for no key at all.
    n = len(score_queries)
    full_read = np.arange(k_full.shape[2])[None, None] < np.asarray(lf)[:, None, None]
    rest = (_exact_weights(q, np.swapaxes(np.asarray(k_full, np.float32), 1, 2), lse,
                           score_queries, np.repeat(full_read, n, 1)).sum(-1)
            + _exact_weights(q, k_new, lse, score_queries,
                             np.asarray(mask)[list(score_queries)][None]).sum(-1))
    total = probs.sum(-1) + rest
    np.testing.assert_allclose(total, np.where(total > 0.5, 1.0, 0.0), atol=2e-3)
  assert out.shape == q.shape and out.dtype == q.dtype
  tol = TOLERANCE[q.dtype.type]
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out), atol=tol, rtol=tol)
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  finite = np.isfinite(ref_lse)
  # The kernel's scores carry one bf16/fp16 rounding of q * s_K (the reference is exact fp32):
  # about one ulp of the input type relative to the score.
  lse_rtol = {jnp.bfloat16: 3e-3, jnp.float16: 1e-3}[q.dtype.type]
  np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=5e-3, rtol=lse_rtol)
  return out, lse


@st.composite
def _cases(draw):
  # Interpreter: ~0.1-0.5 s per grid point; keep B * Hkv * splits small.
  batch = draw(st.sampled_from([1, 2]))
  num_kv_heads = draw(st.sampled_from([1, 2])) if batch == 1 else 1
  group = draw(st.sampled_from([1, 4, 8]))
  num_queries = draw(st.sampled_from([1, 1, 3]))
  capacity = 64 * draw(st.integers(1, 3))
  length = st.one_of(st.just(0), st.just(capacity), st.integers(0, capacity))
  full_capacity = draw(st.sampled_from([8, 16]))
  mask = (np.tril(np.ones((num_queries, num_queries), bool)) if draw(st.booleans())
          else np.array(draw(st.lists(st.booleans(), min_size=num_queries ** 2,
                                      max_size=num_queries ** 2)), bool).reshape(
                                          num_queries, num_queries))
  return dict(
      shape=dict(batch=batch, num_queries=num_queries, num_q_heads=num_kv_heads * group,
                 num_kv_heads=num_kv_heads, head_dim=64, capacity=capacity,
                 full_capacity=full_capacity, group=64,
                 dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float16]))),
      bits=draw(st.sampled_from([4, 8])),
      lq=np.array(draw(st.lists(length, min_size=batch, max_size=batch)), np.int32),
      lf=np.array(draw(st.lists(st.integers(0, full_capacity), min_size=batch,
                                max_size=batch)), np.int32),
      mask=mask,
      config=QuantAttentionConfig(block_kv=64, num_stages=draw(st.sampled_from([1, 2])),
                                  num_splits=draw(st.sampled_from([1, 2]))),
      seed=draw(st.integers(0, 2 ** 16)),
  )


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_kernel_matches_dequantize_then_attend(case):
  q, qkv, k_full, v_full, k_new, v_new = _inputs(case["seed"], **case["shape"])
  _check(q, qkv, case["bits"], jnp.asarray(case["lq"]), k_full, v_full, jnp.asarray(case["lf"]),
         k_new, v_new, jnp.asarray(case["mask"]), case["config"])


@pytest.mark.parametrize("path", ["fused", "dequantize"])
def test_unsigned_lengths_past_int32_read_every_slot(path):
  """uint32 lengths past int32's range (both segments) mean every slot, as int32 lengths at the
  capacities do (they wrapped to negative lengths that read none), in the kernel and the
  reference, with the selected query's scores."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      9, batch=2, num_queries=1, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=128,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  args = (k_new, v_new, jnp.ones((1, 1), bool), QuantAttentionConfig(num_splits=2, path=path))
  wide = _check(q, qkv, 8, jnp.array([2**32 - 3, 70], jnp.uint32), k_full, v_full,
                jnp.array([5, 2**32 - 1], jnp.uint32), *args, score_queries=(0,))
  clipped = _check(q, qkv, 8, jnp.array([128, 70], jnp.int32), k_full, v_full,
                   jnp.array([5, 8], jnp.int32), *args, score_queries=(0,))
  for a, b in zip(wide, clipped):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_gqa_ragged_d128_group128(bits):
  """Tq = 1, GQA 4:1, D = 128, G = 128 (2 tiles per key group); rows: empty, partial tile, full
  capacity."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      7, batch=3, num_queries=1, num_q_heads=4, num_kv_heads=1, head_dim=128, capacity=256,
      full_capacity=16, group=128, dtype=jnp.bfloat16)
  _check(q, qkv, bits, jnp.array([0, 77, 256], jnp.int32), k_full, v_full,
         jnp.array([3, 16, 0], jnp.int32), k_new, v_new, jnp.ones((1, 1), bool),
         QuantAttentionConfig(num_splits=2))


@pytest.mark.parametrize("bits", [4, 8])
def test_multi_query_gqa_causal(bits):
  """Tq = 5 with a causal in-flight mask, GQA 2:1 on 2 KV heads, 3 tiles over 2 splits."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      11, batch=1, num_queries=5, num_q_heads=4, num_kv_heads=2, head_dim=64, capacity=192,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  _check(q, qkv, bits, jnp.array([150], jnp.int32), k_full, v_full, jnp.array([8], jnp.int32),
         k_new, v_new, jnp.tril(jnp.ones((5, 5), bool)),
         QuantAttentionConfig(block_kv=64, num_splits=2, num_stages=2))


def test_partials_merged_in_ranges_equal_the_reference(monkeypatch):
  """Past AUTO_MERGE_SPLITS partials the planner merges in ranges (two merge launches): with the
  threshold lowered to 4, 6 wanted splits and 2 exact blocks (16 full-precision slots, 1
  in-flight token) become 4 splits + 2 in 2 ranges of 3; out, lse and the probs equal the
  reference's. Rows: a full, a partial and an empty quantized length."""
  import pallas_kernels.quant_attention as qa
  monkeypatch.setattr(qa, "AUTO_MERGE_SPLITS", 4)
  config = QuantAttentionConfig(block_kv=64, min_tiles_per_split=1)
  assert qa._num_splits(config, 64, 3, 1, 1, 384, bits=4, rows=8, exact_blocks=2) == (4, 2)
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      17, batch=3, num_queries=1, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=384,
      full_capacity=16, group=64, dtype=jnp.bfloat16)
  q = q * 4.0                                     # peaked weights: the ranges' lse matter
  _check(q, qkv, 4, jnp.array([384, 200, 0], jnp.int32), k_full, v_full,
         jnp.array([16, 3, 0], jnp.int32), k_new, v_new, jnp.ones((1, 1), bool), config,
         score_queries=(0,))


@pytest.mark.parametrize("bits", [4, 8])
def test_score_queries_probs(bits):
  """Queries (3, 1) of 5 (out of order, causal in-flight mask), GQA 4:1, rows of
  quantized length 150 and 0, 3 tiles over 2 splits: probs over the quantized slots equal the
  reference's, are 0 past the quantized length, and with the full-precision and in-flight parts
  sum to 1; out and lse stay in query order."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      13, batch=2, num_queries=5, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=192,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  _check(q, qkv, bits, jnp.array([150, 0], jnp.int32), k_full, v_full,
         jnp.array([5, 8], jnp.int32), k_new, v_new, jnp.tril(jnp.ones((5, 5), bool)),
         QuantAttentionConfig(block_kv=64, num_splits=2), score_queries=(3, 1))


def test_score_queries_take_any_sequence_of_ints():
  """score_queries as a list or a numpy array equals the tuple, in quant_attention and
  quant_attention_with_keys (a list raised JAX's 'Non-hashable static arguments are not
  supported' at the jit boundary)."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      14, batch=1, num_queries=2, num_q_heads=1, num_kv_heads=1, head_dim=64, capacity=64,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  mask = jnp.tril(jnp.ones((2, 2), bool))
  args = (q, qkv, jnp.array([40]), k_full, v_full, jnp.array([3]), k_new, v_new, mask)
  key_sets = ((k_new, v_new, mask[None]),)
  calls = (lambda sel: quant_attention(*args, bits=4, score_queries=sel, interpret=INTERPRET),
           lambda sel: quant_attention_with_keys(q, qkv, jnp.array([40]), key_sets, bits=4,
                                                 score_queries=sel, interpret=INTERPRET))
  for call in calls:
    out, probs = call((1, 0))
    for sel in ([1, 0], np.array([1, 0])):
      got_out, got_probs = call(sel)
      np.testing.assert_array_equal(np.asarray(got_out), np.asarray(out))
      np.testing.assert_array_equal(np.asarray(got_probs), np.asarray(probs))


@pytest.mark.parametrize("bits", [4, 8])
def test_several_q_blocks_equal_the_reference(bits):
  """3 queries x G = 8 = 24 rows cut into q blocks of block_m = 8 (three per KV head, each
  reading the codes, the full-precision and the in-flight keys on its own; rows of quantized
  length 150 and 0): out and lse equal the reference's."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      19, batch=2, num_queries=3, num_q_heads=8, num_kv_heads=1, head_dim=64, capacity=192,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  _check(q, qkv, bits, jnp.array([150, 0], jnp.int32), k_full, v_full, jnp.array([8, 3], jnp.int32),
         k_new, v_new, jnp.tril(jnp.ones((3, 3), bool)),
         QuantAttentionConfig(block_m=8, num_splits=2))


def test_score_queries_beyond_one_default_q_block():
  """12 queries x G = 4 = 48 rows: two q blocks of block_m = 32 rows by default, but 10 selected
  queries (40 rows) must all sit in q block 0 (the one whose scores the kernel writes), so that
  call cuts 40-row blocks; probs and out equal the reference's."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      17, batch=1, num_queries=12, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=128,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  _check(q, qkv, 4, jnp.array([100], jnp.int32), k_full, v_full, jnp.array([6], jnp.int32),
         k_new, v_new, jnp.tril(jnp.ones((12, 12), bool)), QuantAttentionConfig(),
         score_queries=(11, 0, 2, 3, 4, 5, 6, 7, 8, 9))


@pytest.mark.parametrize("block_kv,group,capacity,num_queries,bits", [
    (128, 128, 256, 1, 4),    # 2 key tiles per stage, one key group
    (256, 128, 512, 1, 8),    # 4 tiles, 2 key groups per stage
    (256, 64, 512, 3, 4),     # 4 tiles, 4 key groups per stage, score output
    (128, 256, 512, 1, 8),    # 2 tiles, half a key group per stage
])
def test_stage_sizes(block_kv, group, capacity, num_queries, bits):
  """Several 64-key tiles per pipeline stage (one online-softmax update per stage), nested with
  the key group either way; ragged rows (empty, mid-tile, mid-stage, full)."""
  d = 128 if group == 128 else 64
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      17, batch=3, num_queries=num_queries, num_q_heads=4, num_kv_heads=1, head_dim=d,
      capacity=capacity, full_capacity=16, group=group, dtype=jnp.bfloat16)
  lq = jnp.array([capacity - 1, 77, 0] if num_queries == 1 else [capacity, 129, 1], jnp.int32)
  _check(q, qkv, bits, lq, k_full, v_full, jnp.array([3, 16, 0], jnp.int32), k_new, v_new,
         jnp.tril(jnp.ones((num_queries, num_queries), bool)),
         QuantAttentionConfig(block_kv=block_kv, num_splits=2),
         score_queries=(0,) if num_queries > 1 else ())


def test_stage_max_covers_every_key_tile_of_the_stage():
  """One online-softmax update per stage: its max is over all of the stage's key tiles, not
  only its first. Slot 100 (tile 1 of a 128-key stage) holds 12 q, a score ~138 log2 units
  above tile 0's: weighed against tile 0's max alone its p overflowed (inf, then NaN); the
  random cases' scores are too close for the reference max to matter."""
  d, capacity = 64, 128
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      23, batch=1, num_queries=1, num_q_heads=2, num_kv_heads=1, head_dim=d, capacity=capacity,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  k, v = _kv(24, 1, 1, capacity, d, jnp.bfloat16, 1.0)
  k = k.at[0, 0, 100].set((12 * q[0, 0, 0].astype(jnp.float32)).astype(jnp.bfloat16))
  _check(q, quantize_kv(k, v, group=64), 8, jnp.array([capacity], jnp.int32), k_full, v_full,
         jnp.array([0], jnp.int32), k_new, v_new, jnp.ones((1, 1), bool),
         QuantAttentionConfig(block_kv=128, num_splits=1))


def test_auto_stage_size():
  """block_kv=None: 256 keys for batched 4-bit decode steps (N <= 8, B >= 2), 128 for other
  narrow steps where the capacity and key group allow, else 64; narrow is N <= 40 (the widest
  single q block the planner makes) at 4 and 8 bits."""
  auto = QuantAttentionConfig()
  assert _block_kv(auto, rows=8, group=128, capacity=4096) == 128    # one row
  assert _block_kv(auto, rows=8, group=128, capacity=4096, batch=2) == 256
  assert _block_kv(auto, rows=8, group=32, capacity=4096, batch=8) == 256   # groups nest
  assert _block_kv(auto, rows=8, group=128, capacity=4096, bits=8, batch=8) == 128
  assert _block_kv(auto, rows=16, group=128, capacity=4096, batch=8) == 128  # N > 8
  assert _block_kv(auto, rows=8, group=128, capacity=4224, batch=8) == 128   # 256 does not divide S
  assert _block_kv(auto, rows=24, group=64, capacity=4096, bits=8) == 128
  assert _block_kv(auto, rows=32, group=128, capacity=4096, bits=4) == 128
  assert _block_kv(auto, rows=32, group=128, capacity=4096, bits=8) == 128
  assert _block_kv(auto, rows=40, group=128, capacity=4096, bits=8) == 128
  assert _block_kv(auto, rows=40, group=128, capacity=4096, bits=4) == 128
  assert _block_kv(auto, rows=48, group=128, capacity=4096, bits=8) == 64
  assert _block_kv(auto, rows=8, group=128, capacity=192) == 64      # 128 does not divide S
  assert _block_kv(auto, rows=64, group=128, capacity=4096) == 64    # wide step
  assert _block_kv(QuantAttentionConfig(block_kv=256), rows=64, group=128, capacity=4096) == 256


def test_query_rows_are_cut_into_q_blocks_of_block_m():
  """block_m None (the default): one block of the rows padded to 8 up to 40 rows (QuantSpec's
  gamma-8 verification, 36 rows, reads the codes once), more in blocks of 32; an explicit
  block_m cuts blocks of block_m from block_m + 1 rows on; the selected queries' score rows widen
  the blocks. A bad block_m is refused by name."""
  assert QuantAttentionConfig().block_m is None
  assert _q_blocks(20) == (1, 24)
  assert _q_blocks(32) == (1, 32)
  assert _q_blocks(36) == (1, 40)
  assert _q_blocks(40) == (1, 40)
  assert _q_blocks(41) == (2, 32)
  assert _q_blocks(64) == (2, 32)
  assert _q_blocks(256) == (8, 32)
  assert _q_blocks(36, 32) == (2, 32)
  assert _q_blocks(64, 64) == (1, 64)
  assert _q_blocks(100, 16) == (7, 16)
  assert _q_blocks(48, None, 40) == (2, 40)
  assert _q_blocks(0) == (0, 0)
  for bad in (0, 12, 72, 32.0):
    with pytest.raises(ValueError, match="block_m"):
      QuantAttentionConfig(block_m=bad)


@pytest.mark.parametrize("bits", [4, 8])
def test_one_forty_row_q_block_equals_the_reference(bits):
  """9 queries x G = 4 = 36 rows: one q block of 40 rows under the default config (4 padding
  rows), with the full-precision and in-flight keys; out and lse equal the reference's."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      23, batch=1, num_queries=9, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=128,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  _check(q, qkv, bits, jnp.array([100], jnp.int32), k_full, v_full, jnp.array([5], jnp.int32),
         k_new, v_new, jnp.tril(jnp.ones((9, 9), bool)), QuantAttentionConfig(num_splits=2))


def test_auto_path_dequantizes_wide_calls_within_the_copy_bound():
  """path="auto": the fused kernel below AUTO_DEQUANT_ROWS[bits][0] query rows per KV head, the
  dequantize path from [1] on, and in between when B * S >= AUTO_DEQUANT_MIN_TOKENS;
  never when the transient K + V copy in q's dtype would exceed DEQUANT_MAX_BYTES; "fused" /
  "dequantize" force a path; a bad path is refused by name."""
  auto = QuantAttentionConfig()
  qkv = QuantKV.abstract(1, 8, 131072, 128)                 # bf16 copy: 512 MiB
  short = QuantKV.abstract(1, 8, 16384, 128)
  assert AUTO_DEQUANT_MIN_TOKENS == 65536
  assert AUTO_DEQUANT_ROWS == {4: (128, 256), 8: (128, 128)}
  for bits in (4, 8):
    some, always = AUTO_DEQUANT_ROWS[bits]
    assert not _dequantizes(auto, some - 8, bits, qkv, jnp.bfloat16)
    assert _dequantizes(auto, some, bits, qkv, jnp.bfloat16)
    assert _dequantizes(auto, some, bits, short, jnp.bfloat16) == (some == always)
    assert not _dequantizes(auto, always - 8, bits, short, jnp.bfloat16)
    assert _dequantizes(auto, always, bits, short, jnp.bfloat16)
    assert _dequantizes(auto, some, bits, QuantKV.abstract(4, 8, 16384, 128), jnp.bfloat16)
    assert not _dequantizes(QuantAttentionConfig(path="fused"), 1024, bits, qkv, jnp.bfloat16)
    assert _dequantizes(QuantAttentionConfig(path="dequantize"), 4, bits, qkv, jnp.bfloat16)
  # B = 16 at 128K: an 8 GiB copy, over the bound.
  big = QuantKV.abstract(16, 8, 131072, 128)
  assert 2 * 16 * 8 * 131072 * 128 * 2 > DEQUANT_MAX_BYTES
  assert not _dequantizes(auto, 1024, 8, big, jnp.bfloat16)
  with pytest.raises(ValueError, match="path must be one of"):
    QuantAttentionConfig(path="dense")


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_path_equals_the_reference(bits):
  """path="dequantize" (the prefix dequantized into q's dtype, decode_attention's split kernel,
  the full-precision and in-flight keys in its combine): out, lse and the selected queries'
  probs equal the reference's, over rows of quantized length 70 and 0 (capacity 192: the
  dequantization writes two tiles of row 0 and none of row 1, the interpreter leaves the rest
  NaN, so a read past them would show)."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      23, batch=2, num_queries=5, num_q_heads=4, num_kv_heads=2, head_dim=64, capacity=192,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  cfg = QuantAttentionConfig(path="dequantize")
  out, _ = _check(q, qkv, bits, jnp.array([70, 0], jnp.int32), k_full, v_full,
                  jnp.array([5, 8], jnp.int32), k_new, v_new, jnp.tril(jnp.ones((5, 5), bool)),
                  cfg, score_queries=(3, 1))
  fused = quant_attention(q, qkv, jnp.array([70, 0], jnp.int32), k_full, v_full,
                          jnp.array([5, 8], jnp.int32), k_new, v_new,
                          jnp.tril(jnp.ones((5, 5), bool)), bits=bits,
                          config=QuantAttentionConfig(path="fused"), interpret=INTERPRET)
  # Two roundings of the same math (the dequantized K in bf16 against q * s_K in bf16): the
  # fused kernel's output is not what this call returned, and both are within the reference's
  # tolerance of it.
  out, fused = np.asarray(out, np.float32), np.asarray(fused, np.float32)
  assert np.abs(out - fused).max() > 0
  tol = 2 * TOLERANCE[jnp.bfloat16]
  np.testing.assert_allclose(out, fused, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["fused", "dequantize"])
def test_an_empty_full_precision_segment(path):
  """k_full / v_full with Rf = 0 slots (no recent segment) and 5 in-flight queries: the
  dequantize path's combine took the max of the empty key set's scores ('zero-size array to
  reduction operation max'), which the wide calls of "auto" reach too."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      31, batch=1, num_queries=5, num_q_heads=2, num_kv_heads=1, head_dim=64, capacity=128,
      full_capacity=0, group=64, dtype=jnp.bfloat16)
  _check(q, qkv, 8, jnp.array([100], jnp.int32), k_full, v_full, jnp.array([0], jnp.int32),
         k_new, v_new, jnp.tril(jnp.ones((5, 5), bool)), QuantAttentionConfig(path=path))


def test_dequantize_path_rounds_to_decodes_128_key_tiles():
  """Capacity 256 with few query rows: decode_attention's kernel reads 128-key tiles, so the
  dequantization must write up to the length rounded to 128, not 64 (a 64-key tile left unwritten
  holds the interpreter's NaN, and p = 0 times NaN would reach the output)."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      29, batch=2, num_queries=1, num_q_heads=4, num_kv_heads=2, head_dim=64, capacity=256,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  _check(q, qkv, 8, jnp.array([70, 140], jnp.int32), k_full, v_full, jnp.array([3, 8], jnp.int32),
         k_new, v_new, jnp.ones((1, 1), bool), QuantAttentionConfig(path="dequantize"))


def test_auto_splits_fill_one_wave():
  """target_blocks=None: one wave of resident blocks (3 per SM at 4 bits / 128 keys / N = 8,
  2 at 8 bits or wider steps), split over the (row, KV head, q block) work items."""
  auto = QuantAttentionConfig()
  one_row = dict(batch=1, num_kv_heads=8, q_blocks=1, capacity=65536)
  assert _num_splits(auto, 128, **one_row, bits=4, rows=8) == (3 * 132 // 8, 1)
  assert _num_splits(auto, 128, **one_row, bits=8, rows=8) == (2 * 132 // 8, 1)
  assert _num_splits(auto, 128, **one_row, bits=4, rows=24) == (2 * 132 // 8, 1)
  # Never fewer than min_tiles_per_split stages a split, never below one split.
  assert _num_splits(auto, 128, 1, 8, 1, 512, bits=4, rows=8) == (2, 1)
  assert _num_splits(auto, 128, 64, 8, 1, 65536, bits=4, rows=8) == (1, 1)
  # Up to AUTO_MERGE_SPLITS = 128 partials with the exact blocks' merge in one launch; more are
  # trimmed to equal ranges of ~sqrt(partials): 1056 blocks over 8 heads ask for 132 = 11 x 12,
  # 2 and 1 KV heads at 128K for 198 and 396 (+ 5 exact: 203 -> 195 = 13 x 15, 401 -> 399 =
  # 19 x 21). An explicit split count merges in one launch, up to MAX_SPLITS = 256.
  assert _num_splits(QuantAttentionConfig(target_blocks=1056), 128, **one_row, bits=4,
                     rows=8) == (132, 11)
  assert _num_splits(auto, 128, 1, 2, 1, 131072, bits=4, rows=8, exact_blocks=5) == (190, 13)
  assert _num_splits(auto, 128, 1, 1, 1, 131072, bits=4, rows=8, exact_blocks=5) == (394, 19)
  assert _num_splits(QuantAttentionConfig(num_splits=251), 128, 1, 1, 1, 131072, bits=4,
                     rows=8, exact_blocks=5) == (251, 1)
  # Exact blocks that are most of the partials: equal ranges would leave no split (208 -> 195
  # = 13 x 15 < 200 exact), so one launch with the splits capped (1 here).
  assert _num_splits(auto, 128, 1, 1, 1, 2048, bits=4, rows=8, exact_blocks=200) == (1, 1)
  assert _num_splits(auto, 128, 1, 1, 1, 2048, bits=4, rows=8, exact_blocks=125) == (7, 11)
  with pytest.raises(ValueError, match="num_splits=252 with 5 exact-key blocks"):
    _num_splits(QuantAttentionConfig(num_splits=252), 128, 1, 1, 1, 131072, bits=4, rows=8,
                exact_blocks=5)
  with pytest.raises(ValueError, match="target_blocks must be >= 1"):
    QuantAttentionConfig(target_blocks=0)


def test_4bit_read_ignores_the_lower_plane():
  """Scrambling the whole lower plane leaves the 4-bit read unchanged (it is never loaded)."""
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      5, batch=1, num_queries=1, num_q_heads=2, num_kv_heads=1, head_dim=64, capacity=128,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  noise = lambda c, key: c.at[:, :, 1].set(
      jax.random.bits(key, c[:, :, 1].shape, jnp.uint32))
  k1, k2 = jax.random.split(jax.random.key(0))
  scrambled = QuantKV(noise(qkv.k_codes, k1), noise(qkv.v_codes, k2), qkv.k_scale, qkv.k_zero,
                      qkv.v_scale, qkv.v_zero, group=qkv.group)
  _check(q, scrambled, 4, jnp.array([100], jnp.int32), k_full, v_full, jnp.array([4], jnp.int32),
         k_new, v_new, jnp.ones((1, 1), bool), QuantAttentionConfig(block_kv=64, num_splits=1),
         ref_qkv=qkv)


def _attend_key_sets(q, qkv, bits, lq, key_sets):
  """fp32 jnp: one softmax over the dequantized slots s < lq[b] and key sets (k [B, U, Hkv, D],
  v, mask [B or 1, Tq, U]). Returns out [B, Tq, Hq, D], lse [B, Tq, Hq]."""
  b, tq, hq, d = q.shape
  k_q, v_q = dequantize(qkv, bits, dtype=jnp.float32)                     # [B, Hkv, S, D]
  hkv = k_q.shape[1]
  ks = [k_q.transpose(0, 2, 1, 3)] + [k.astype(jnp.float32) for k, _, _ in key_sets]
  vs = [v_q.transpose(0, 2, 1, 3)] + [v.astype(jnp.float32) for _, v, _ in key_sets]
  quant_read = jnp.arange(k_q.shape[2])[None, None, :] < lq[:, None, None]
  masks = [jnp.broadcast_to(quant_read, (b, tq, k_q.shape[2]))] + [
      jnp.broadcast_to(m, (b, tq, m.shape[2])) for _, _, m in key_sets]
  k, v = jnp.concatenate(ks, axis=1), jnp.concatenate(vs, axis=1)           # [B, U, Hkv, D]
  mask = jnp.concatenate(masks, axis=2)                                    # [B, Tq, U]
  qg = q.astype(jnp.float32).reshape(b, tq, hkv, hq // hkv, d)
  s = f32_einsum("bthgd,buhd->bthgu", qg, k) * d ** -0.5
  s = jnp.where(mask[:, :, None, None], s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  out = f32_einsum("bthgu,buhd->bthgd", jnp.exp(s - lse[..., None]), v)
  return out.reshape(b, tq, hq, d), lse.reshape(b, tq, hq)


@pytest.mark.parametrize("bits", [4, 8])
def test_key_sets_with_per_query_masks(bits):
  """quant_attention_with_keys: key sets whose masks differ per query and per row (what a
  length cannot express), selected queries permuted first, against one fp32 softmax."""
  b, tq, hq, hkv, d, rf = 2, 3, 4, 2, 64, 16
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      5, batch=b, num_queries=tq, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, capacity=128,
      full_capacity=rf, group=64, dtype=jnp.bfloat16)
  key = jax.random.key(11)
  full_mask = rand.bernoulli(key, 0.5, (b, tq, rf))
  new_mask = jnp.tril(jnp.ones((tq, tq), bool))[None] & jnp.array([True, False])[:, None, None]
  new_mask = new_mask | jnp.eye(tq, dtype=bool)[None]                      # [B, Tq, Tq]
  lq = jnp.array([128, 70])
  key_sets = ((k_full.transpose(0, 2, 1, 3), v_full.transpose(0, 2, 1, 3), full_mask),
              (k_new, v_new, new_mask))
  out, lse = quant_attention_with_keys(q, qkv, lq, key_sets, bits=bits, return_lse=True,
                                       score_queries=(2, 0), interpret=INTERPRET)[:2]
  ref_out, ref_lse = _attend_key_sets(q, qkv, bits, lq, key_sets)
  tol = TOLERANCE[jnp.bfloat16]
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out), atol=tol, rtol=tol)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=5e-3, rtol=3e-3)
  # The masks matter: dropping the first key set's mask changes the result.
  open_sets = ((key_sets[0][0], key_sets[0][1], jnp.ones_like(full_mask)), key_sets[1])
  other = quant_attention_with_keys(q, qkv, lq, open_sets, bits=bits, interpret=INTERPRET)
  assert float(jnp.max(jnp.abs(other.astype(jnp.float32) - out.astype(jnp.float32)))) > 3 * tol
  with pytest.raises(ValueError, match="key set 1: mask must be"):
    quant_attention_with_keys(q, qkv, lq, (key_sets[0], (k_new, v_new, new_mask[:, :2])),
                              bits=bits, interpret=INTERPRET)
  with pytest.raises(ValueError, match="key set 0: k and v must be"):
    quant_attention_with_keys(q, qkv, lq, ((k_full, v_full, full_mask),), bits=bits,
                              interpret=INTERPRET)


def test_exact_keys_read_every_set_in_place_past_its_end():
  """Key sets in q's dtype are source pieces as they are, whatever their length (QuantSpec's
  tail, draft scratch and in-flight tokens are not copied per layer): a piece's last 64-key
  tile reads past its end, which the TMA fills with zeros and the bias masks off; a set in
  another dtype is converted, not padded; an empty set is dropped. The kernel's exact blocks
  pick each tile from its piece: with four pieces (whole tiles, 3 keys, 2 keys in fp32, 128
  keys) under per-query masks, the call equals one fp32 softmax over everything."""
  b, tq, hq, hkv, d = 2, 3, 4, 2, 64
  q, qkv, k_a, v_a, k_new, v_new = _inputs(
      21, batch=b, num_queries=tq, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, capacity=128,
      full_capacity=64, group=64, dtype=jnp.bfloat16)
  keys = jax.random.split(jax.random.key(22), 7)
  k_b = rand.normal(keys[0], (b, 128, hkv, d), jnp.bfloat16)          # [B, U, Hkv, D]
  v_b = rand.normal(keys[1], (b, 128, hkv, d), jnp.bfloat16)
  k_c = rand.normal(keys[4], (b, 2, hkv, d))                            # fp32: converted
  v_c = rand.normal(keys[5], (b, 2, hkv, d))
  empty = jnp.zeros((b, 0, hkv, d), jnp.bfloat16)
  key_sets = ((k_a.transpose(0, 2, 1, 3), v_a.transpose(0, 2, 1, 3),
               rand.bernoulli(keys[2], 0.6, (b, tq, 64))),
              (k_new, v_new, jnp.tril(jnp.ones((tq, tq), bool))[None]),
              (empty, empty, jnp.zeros((1, 1, 0), bool)),
              (k_c, v_c, rand.bernoulli(keys[6], 0.5, (b, 1, 2))),
              (k_b, v_b, rand.bernoulli(keys[3], 0.3, (1, tq, 128))))
  q_rows = jnp.zeros((b, hkv, 1, 16, d), jnp.bfloat16)     # N = 16 rows, Tq * G = 6 of them real
  exact = exact_keys(q_rows, key_sets, group=hq // hkv, num_queries=tq)
  assert [k.shape[1] for k, _ in exact.sources] == [64, tq, 2, 128]
  assert exact.sources[0][0] is key_sets[0][0] and exact.sources[1][0] is key_sets[1][0]
  assert exact.sources[3][1] is key_sets[4][1] and exact.sources[2][0].dtype == jnp.bfloat16
  assert exact.num_blocks == 5 and exact.bias.shape == (b, 1, 320, 16)
  bias = np.asarray(exact.bias)
  assert np.isneginf(bias[:, :, 64 + tq:128]).all()             # past the in-flight piece
  assert np.isneginf(bias[:, :, 128 + 2:192]).all()             # past the converted piece
  assert np.isneginf(bias[:, :, :, tq * (hq // hkv):]).all()     # the padding query rows
  lq = jnp.array([100, 128])
  for bits in (4, 8):
    out, lse = quant_attention_with_keys(q, qkv, lq, key_sets, bits=bits, return_lse=True,
                                         interpret=INTERPRET)
    ref_out, ref_lse = _attend_key_sets(q, qkv, bits, lq, key_sets)
    tol = TOLERANCE[jnp.bfloat16]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out), atol=tol,
                               rtol=tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=5e-3, rtol=3e-3)


def test_one_row_masks_hold_for_every_query():
  """A key set's mask may be [B or 1, 1, U], the same for every query: with every mask one row
  and Tq = 3, the bias opens the keys to all three queries' rows (it took Tq from the masks and
  closed every row past query 0's: a silent wrong answer for queries 1 and 2)."""
  tq, group = 3, 2
  k = jnp.zeros((1, 8, 1, 64), jnp.bfloat16)
  q_rows = jnp.zeros((1, 1, 1, 8, 64), jnp.bfloat16)              # N = 8 rows, 6 real
  exact = exact_keys(q_rows, ((k, k, jnp.ones((1, 1, 8), bool)),), group=group, num_queries=tq)
  bias = np.asarray(exact.bias)                                    # [1, QB, U = 64, N]
  assert (bias[0, 0, :8, :tq * group] == 0).all()
  assert np.isneginf(bias[0, 0, :8, tq * group:]).all() and np.isneginf(bias[0, 0, 8:]).all()


def test_kernel_rejects_bad_inputs_in_plain_words():
  q, qkv, k_full, v_full, k_new, v_new = _inputs(
      0, batch=1, num_queries=1, num_q_heads=2, num_kv_heads=1, head_dim=64, capacity=64,
      full_capacity=8, group=64, dtype=jnp.bfloat16)
  args = (q, qkv, jnp.array([1]), k_full, v_full, jnp.array([1]), k_new, v_new,
          jnp.ones((1, 1), bool))
  for bits in (3, 8.0):                                   # 8.0 in (4, 8): it was taken
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
      quant_attention(*args, bits=bits)
  with pytest.raises(ValueError, match="block_kv must be one of"):
    QuantAttentionConfig(block_kv=96)
  with pytest.raises(ValueError, match="block_kv must be one of .*, got 64.0"):
    QuantAttentionConfig(block_kv=64.0)
  with pytest.raises(ValueError, match="min_tiles_per_split must be >= 1"):  # ZeroDivisionError
    QuantAttentionConfig(min_tiles_per_split=0)
  with pytest.raises(ValueError, match="num_stages must be >= 1 .*, got 2.0"):
    QuantAttentionConfig(num_stages=2.0)
  # numpy integers are stored as ints (np.int64 stages failed in Mosaic's Barrier, splits on a
  # bare AssertionError; test_numpy_integer_config_knobs_run runs one in decode_attention).
  np_config = QuantAttentionConfig(block_kv=np.int64(64), num_stages=np.int64(2),
                                   num_splits=np.int64(2), block_m=np.int64(8))
  assert all(type(getattr(np_config, name)) is int
             for name in ("block_kv", "num_stages", "num_splits", "block_m"))
  with pytest.raises(ValueError, match="must divide the quantized capacity S=64"):
    quant_attention(*args, bits=4, config=QuantAttentionConfig(block_kv=128))
  bad = QuantKV(qkv.k_codes.astype(jnp.int32), qkv.v_codes, qkv.k_scale, qkv.k_zero,
                qkv.v_scale, qkv.v_zero, group=qkv.group)
  with pytest.raises(ValueError, match="codes must be uint32 words"):
    quant_attention(q, bad, *args[2:], bits=4)
  with pytest.raises(ValueError, match="lengths_quantized must be integer"):
    quant_attention(q, qkv, jnp.array([1.5]), *args[3:], bits=4)
  # An additive 0 / -inf bias mask was cast to bool: read as its inverse, a silent wrong answer.
  with pytest.raises(ValueError, match="inflight_mask .* must be bool .*, got float32"):
    quant_attention(*args[:-1], jnp.zeros((1, 1), jnp.float32), bits=4)
  with pytest.raises(ValueError, match="k_new must be floating point, got int32"):  # was silent
    quant_attention(*args[:6], k_new.astype(jnp.int32), *args[7:], bits=4)
  with pytest.raises(ValueError, match="key set 0: v must be floating point, got int32"):
    quant_attention_with_keys(q, qkv, jnp.array([1]),
                              ((k_new, v_new.astype(jnp.int32), jnp.ones((1, 1, 1), bool)),),
                              bits=4)
  with pytest.raises(ValueError, match="key set 0: mask must be bool .*, got float32"):
    quant_attention_with_keys(q, qkv, jnp.array([1]),
                              ((k_new, v_new, jnp.zeros((1, 1, 1), jnp.float32)),), bits=4)
  with pytest.raises(ValueError, match="qkv.k_scale must be float16"):
    quant_attention(q, dataclasses.replace(qkv, k_scale=qkv.k_scale.astype(jnp.float32)),
                    *args[2:], bits=4)
  # A key group larger than (or not dividing) the capacity: k_scale [.., S // G = 0, D] matched
  # and the kernel read scales past the array, silent wrong keys.
  big = dataclasses.replace(qkv, k_scale=qkv.k_scale[:, :, :0], k_zero=qkv.k_zero[:, :, :0],
                            group=128)
  with pytest.raises(ValueError, match="qkv.group must be a positive int dividing .* S=64"):
    quant_attention(q, big, *args[2:], bits=4, interpret=INTERPRET)


@pytest.mark.parametrize("bits,num_queries,score_queries,block_kv,path",
                         [(4, 1, (), None, "fused"), (8, 1, (), None, "fused"),
                          (4, 16, (), None, "fused"), (8, 16, (), None, "fused"),
                          (4, 1, (0,), None, "fused"), (8, 16, (9, 2), None, "fused"),
                          (8, 5, (), None, "fused"), (4, 1, (0,), 256, "fused"),
                          (8, 5, (1,), 256, "fused"), (4, 64, (), None, "auto"),
                          (8, 16, (3,), None, "dequantize"), (8, 9, (), None, "fused"),
                          (4, 12, (11, 0, 2, 3, 4, 5, 6, 7, 8, 9), None, "fused")])
def test_lowers_to_mosaic_gpu_custom_call_for_cuda(bits, num_queries, score_queries, block_kv,
                                                   path):
  """The benchmark shape (Hq 32, Hkv 8, D 128, G 128) lowers to the Mosaic GPU custom call, also
  with the score output and at every stage size (SMEM fits); the dequantize path (which "auto"
  takes at Tq = 64) lowers to decode_attention's kernel and no quant_attention kernel. Tq = 9
  and 12: in-flight key sets of 9 and 12 keys, which Mosaic GPU's TMA lowering rejected read in
  place (a key dimension above 8 must be a multiple of 8: found by running the kernel tests on an
  H100); 10 selected queries make one 40-row q block."""
  b, hq, hkv, d, s, r = 1, 32, 8, 128, 4096, 128
  sds = jax.ShapeDtypeStruct
  qkv = QuantKV.abstract(b, hkv, s, d, group=128)
  tok = sds((b, num_queries, hkv, d), jnp.bfloat16)
  full = sds((b, hkv, r, d), jnp.bfloat16)
  args = (sds((b, num_queries, hq, d), jnp.bfloat16), qkv, sds((b,), jnp.int32), full, full,
          sds((b,), jnp.int32), tok, tok, sds((num_queries, num_queries), jnp.bool_))
  f = functools.partial(quant_attention, bits=bits, score_queries=score_queries,
                        config=QuantAttentionConfig(block_kv=block_kv, path=path))
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu_v2" in text
  fused = path == "fused"
  assert ("quant_attention_kernel" in text) == fused
  assert ("decode_attention_kernel" in text) == (not fused)
