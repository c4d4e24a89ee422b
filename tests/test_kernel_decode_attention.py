"""The Mosaic GPU decode-attention kernel against its jnp reference, in GPU interpret mode (CPU),
including the selected queries' per-slot softmax weights (score_queries), plus a check that it
lowers to the Mosaic GPU custom call for the cuda platform. On a GPU backend the same tests run
the compiled kernels (the warp-specialized blocks included, which the interpreter does not run):
`python -m pytest tests/test_kernel_decode_attention.py` on the GPU machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rand
from kernel_mode import INTERPRET, cuda_text
from pallas_kernels.decode_attention import (DecodeConfig, decode_attention, in_kernel_tile,
                                             resident_blocks, decode_attention_reference,
                                             ws_smem_bytes)

TOLERANCE = {jnp.bfloat16: 3e-2, jnp.float16: 4e-3}


def _inputs(seed, *, batch, num_queries, num_q_heads, num_kv_heads, head_dim, capacity, dtype):
  keys = jax.random.split(jax.random.key(seed), 5)
  normal = lambda key, shape: rand.normal(key, shape, dtype)
  q = normal(keys[0], (batch, num_queries, num_q_heads, head_dim))             # [B, Tq, Hq, D]
  k_cache = normal(keys[1], (batch, num_kv_heads, capacity, head_dim))         # [B, Hkv, S, D]
  v_cache = normal(keys[2], (batch, num_kv_heads, capacity, head_dim))         # [B, Hkv, S, D]
  k_new = normal(keys[3], (batch, num_queries, num_kv_heads, head_dim))        # [B, Tq, Hkv, D]
  v_new = normal(keys[4], (batch, num_queries, num_kv_heads, head_dim))        # [B, Tq, Hkv, D]
  return q, k_cache, v_cache, k_new, v_new


def _inflight_weights(q, k_new, mask, lse, score_queries):
  """Softmax weights [B, n, Hq, U] of the selected queries on the in-flight keys (numpy, fp32),
  normalised with `lse` [B, Tq, Hq]."""
  q, k_new = np.asarray(q, np.float32), np.asarray(k_new, np.float32)
  b, tq, hq, d = q.shape
  k = np.repeat(k_new, hq // k_new.shape[2], axis=2)                      # [B, U, Hq, D]
  sel = list(score_queries)
  s = np.einsum("bthd,buhd->bthu", q[:, sel], k) * d ** -0.5             # [B, n, Hq, U]
  w = np.exp(s - np.asarray(lse)[:, sel, :, None])
  return np.where(np.asarray(mask)[sel][None, :, None, :], w, 0.0)


def _check_probs(probs, ref_probs, rest, read):
  """probs [B, n, Hq, S] of the kernel against the reference's; 0 exactly where the query does
  not read the slot (read [B, 1 or n, 1 or Hq, S] bool); with the rest of the softmax (rest
  [B, n, Hq]: the in-flight weights' sum) a whole softmax: 1, or 0 for a query that sees no key.
  """
  probs, ref_probs = np.asarray(probs), np.asarray(ref_probs)
  assert probs.shape == ref_probs.shape and probs.dtype == np.float32
  # The kernel's scores are the fp32 products of the same bf16/fp16 values: probs are as close
  # as lse (atol 2e-3 in log space, i.e. relative).
  np.testing.assert_allclose(probs, ref_probs, atol=1e-5, rtol=5e-3)
  assert np.all(probs[np.broadcast_to(~read, probs.shape)] == 0.0)
  total = probs.sum(-1) + rest
  np.testing.assert_allclose(total, np.where(total > 0.5, 1.0, 0.0), atol=2e-3)


# One compiled program per shape instead of an XLA compile per op of the eager reference.
_reference = jax.jit(decode_attention_reference, static_argnames=("return_lse", "score_queries"))


def _check(q, k_cache, v_cache, lengths, k_new, v_new, mask, config, score_queries=()):
  """Runs the kernel (interpret mode), compares with the reference, returns (out, lse)."""
  out, lse, *probs = decode_attention(q, k_cache, v_cache, lengths, k_new, v_new, mask,
                                      return_lse=True, score_queries=score_queries,
                                      config=config, interpret=INTERPRET)
  # The reference runs on fp32 copies: XLA:CPU has no bf16 x bf16 -> f32 dot for these
  # einsums, and the fp32 reference is the exact oracle the kernel's bf16 P is measured against.
  f32 = lambda x: x.astype(jnp.float32)
  ref_out, ref_lse, *ref_probs = _reference(
      f32(q), f32(k_cache), f32(v_cache), lengths, f32(k_new), f32(v_new), mask,
      return_lse=True, score_queries=score_queries)
  if score_queries:
    read = (np.arange(k_cache.shape[2]) < np.asarray(lengths)[:, None])[:, None, None]
    rest = _inflight_weights(q, k_new, mask, lse, score_queries).sum(-1)
    _check_probs(probs[0], ref_probs[0], rest, read)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
  tol = TOLERANCE[q.dtype.type]
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out), atol=tol, rtol=tol)
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-4)
  return out, lse


@st.composite
def _cases(draw):
  # The interpreter runs grid points one after another (~0.1-0.5 s each): keep B * Hkv * splits
  # small, and spend the examples on GQA ratio, Tq, lengths, masks and pipeline depth.
  batch = draw(st.sampled_from([1, 2]))
  num_kv_heads = draw(st.sampled_from([1, 2])) if batch == 1 else 1
  group = draw(st.sampled_from([1, 2, 4, 8]))
  num_queries = draw(st.sampled_from([1, 1, 2, 3, 5]))
  block_kv = 64
  capacity = block_kv * draw(st.integers(1, 4))
  # Ragged lengths, with 0 and the full capacity as likely edge values.
  length = st.one_of(st.just(0), st.just(capacity), st.integers(0, capacity))
  lengths = draw(st.lists(length, min_size=batch, max_size=batch))
  mask_kind = draw(st.sampled_from(["causal", "random", "none"]))
  if mask_kind == "causal":
    mask = np.tril(np.ones((num_queries, num_queries), bool))
  elif mask_kind == "none":
    mask = np.zeros((num_queries, num_queries), bool)
  else:
    bits = draw(st.lists(st.booleans(), min_size=num_queries ** 2, max_size=num_queries ** 2))
    mask = np.array(bits, bool).reshape(num_queries, num_queries)
  # A few selected queries, in any order (none half the time).
  score_queries = ()
  if draw(st.booleans()):
    score_queries = tuple(draw(st.permutations(range(num_queries)))[:draw(st.integers(1, 2))])
  return dict(
      shape=dict(batch=batch, num_queries=num_queries, num_q_heads=num_kv_heads * group,
                 num_kv_heads=num_kv_heads, head_dim=64,
                 capacity=capacity, dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float16]))),
      lengths=np.array(lengths, np.int32),
      mask=mask,
      # warp_specialized=True: on a GPU, one compute warpgroup and a producer (the interpreter
      # runs plain blocks either way).
      config=DecodeConfig(block_kv=block_kv, num_stages=draw(st.sampled_from([1, 2, 3])),
                          num_splits=draw(st.sampled_from([1, 2, 3])),
                          warp_specialized=draw(st.sampled_from([None, True]))),
      score_queries=score_queries,
      seed=draw(st.integers(0, 2 ** 16)),
  )


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_kernel_matches_reference(case):
  q, k_cache, v_cache, k_new, v_new = _inputs(case["seed"], **case["shape"])
  _check(q, k_cache, v_cache, jnp.asarray(case["lengths"]), k_new, v_new,
         jnp.asarray(case["mask"]), case["config"], case["score_queries"])


@pytest.mark.parametrize("case", ["two splits, an empty row", "two q blocks"])
def test_score_queries_probs(case):
  """The selected queries' softmax weights over the cache: equal to the reference's, 0 past the
  row's length, a whole softmax with the in-flight part; out and lse in the original query order.
  "two splits": queries picked out of order (2, 0), GQA 4:1, ragged lengths with an empty row.
  "two q blocks": G * Tq = 8 * 9 = 72 rows; the selected rows lead q block 0, q block 1 writes
  no scores; default 128-row tiles, fp16."""
  if case == "two splits, an empty row":
    q, k_cache, v_cache, k_new, v_new = _inputs(
        7, batch=2, num_queries=3, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=192,
        dtype=jnp.bfloat16)
    _check(q, k_cache, v_cache, jnp.array([150, 0], jnp.int32), k_new, v_new,
           jnp.tril(jnp.ones((3, 3), bool)), DecodeConfig(block_kv=64, num_splits=2),
           score_queries=(2, 0))
  else:
    q, k_cache, v_cache, k_new, v_new = _inputs(
        8, batch=1, num_queries=9, num_q_heads=8, num_kv_heads=1, head_dim=64, capacity=128,
        dtype=jnp.float16)
    _check(q, k_cache, v_cache, jnp.array([100], jnp.int32), k_new, v_new,
           jnp.tril(jnp.ones((9, 9), bool)), DecodeConfig(num_splits=1), score_queries=(8, 4))


def test_score_queries_are_checked():
  q, k_cache, v_cache, k_new, v_new = _inputs(
      0, batch=1, num_queries=9, num_q_heads=8, num_kv_heads=1, head_dim=64, capacity=128,
      dtype=jnp.bfloat16)
  args = (q, k_cache, v_cache, jnp.array([1]), k_new, v_new, jnp.ones((9, 9), bool))
  with pytest.raises(ValueError, match="in \\[0, Tq=9\\)"):
    decode_attention(*args, score_queries=(9,))
  with pytest.raises(ValueError, match="distinct"):
    decode_attention(*args, score_queries=(1, 1))
  with pytest.raises(ValueError, match="more than 64"):
    decode_attention(*args, score_queries=tuple(range(9)))
  # 8 queries x G = 8 = 64 rows: exactly one q block, taken (traced only).
  out, probs = jax.eval_shape(
      lambda *a: decode_attention(*a, score_queries=tuple(range(8)), interpret=INTERPRET), *args)
  assert out.shape == q.shape and probs.shape == (1, 8, 8, 128)


def test_score_queries_take_any_sequence_of_ints():
  """score_queries as a list, a numpy or a JAX array equals the tuple (a list raised JAX's
  'Non-hashable static arguments are not supported' at the jit boundary); MHA (G = 1)."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      5, batch=1, num_queries=2, num_q_heads=1, num_kv_heads=1, head_dim=64, capacity=64,
      dtype=jnp.bfloat16)
  args = (q, k_cache, v_cache, jnp.array([40]), k_new, v_new, jnp.tril(jnp.ones((2, 2), bool)))
  call = lambda sel: decode_attention(*args, score_queries=sel, interpret=INTERPRET)
  out, probs = call((1, 0))
  for sel in ([1, 0], np.array([1, 0]), jnp.array([1, 0])):
    got_out, got_probs = call(sel)
    np.testing.assert_array_equal(np.asarray(got_out), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(got_probs), np.asarray(probs))
  with pytest.raises(ValueError, match="distinct"):
    call([1, 1])


def test_interpret_true_and_false(monkeypatch):
  """interpret=False builds the compiled kernel as None does (it planned and built the
  interpreter's variant, the wrappers testing `interpret is not None`); interpret=True runs the
  Mosaic GPU interpreter as plgpu.InterpretGPUParams() does (it reached the generic Pallas
  interpreter: 'No state discharge rule implemented for primitive: copy_gmem_to_smem')."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  import pallas_kernels.decode_attention as module
  q, k_cache, v_cache, k_new, v_new = _inputs(
      9, batch=1, num_queries=1, num_q_heads=2, num_kv_heads=1, head_dim=64, capacity=64,
      dtype=jnp.bfloat16)
  args = (q, k_cache, v_cache, jnp.array([40]), k_new, v_new, jnp.ones((1, 1), bool))
  seen, kernel = [], module._cache_partials
  monkeypatch.setattr(module, "_cache_partials",
                      lambda *a, **kw: seen.append(kw["interpret"]) or kernel(*a, **kw))
  decode_attention.__wrapped__.clear_cache()       # trace again, through the spy
  jax.eval_shape(lambda *a: decode_attention(*a, interpret=False), *args)
  assert seen == [None]
  np.testing.assert_array_equal(
      np.asarray(decode_attention(*args, interpret=True)),
      np.asarray(decode_attention(*args, interpret=plgpu.InterpretGPUParams())))


def test_single_query_decode_ragged_lengths_including_zero():
  """Tq = 1 (plain decode), GQA 8:1, D = 128, one row empty, one partial tile, one full cache."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      1, batch=3, num_queries=1, num_q_heads=8, num_kv_heads=1, head_dim=128, capacity=192,
      dtype=jnp.bfloat16)
  _check(q, k_cache, v_cache, jnp.array([0, 77, 192], jnp.int32), k_new, v_new,
         jnp.ones((1, 1), bool), DecodeConfig(block_kv=64, num_splits=2, num_stages=2))


def test_lengths_outside_the_capacity_are_clipped_in_the_kernel():
  """A negative length reads no slot and one past S reads all S (the reference's semantics)."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      4, batch=2, num_queries=1, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=128,
      dtype=jnp.bfloat16)
  _check(q, k_cache, v_cache, jnp.array([-5, 1000], jnp.int32), k_new, v_new,
         jnp.ones((1, 1), bool), DecodeConfig(num_splits=2))


def test_unsigned_lengths_past_int32_read_every_slot():
  """A uint32 length past int32's range means every slot (it wrapped to a negative length that
  read none): the kernel and the reference give what int32 lengths at the capacity give."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      5, batch=2, num_queries=1, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=128,
      dtype=jnp.bfloat16)
  mask, config = jnp.ones((1, 1), bool), DecodeConfig(num_splits=2)
  wide = _check(q, k_cache, v_cache, jnp.array([2**32 - 5, 7], jnp.uint32), k_new, v_new, mask,
                config, score_queries=(0,))
  clipped = _check(q, k_cache, v_cache, jnp.array([128, 7], jnp.int32), k_new, v_new, mask,
                   config, score_queries=(0,))
  for a, b in zip(wide, clipped):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_empty_cache_and_empty_mask_row_gives_zero_output():
  """lengths = 0 and a query that sees no in-flight key: out 0 and lse -inf, as the reference."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      2, batch=1, num_queries=2, num_q_heads=2, num_kv_heads=1, head_dim=64, capacity=64,
      dtype=jnp.bfloat16)
  mask = jnp.array([[False, False], [True, True]])
  out, lse = _check(q, k_cache, v_cache, jnp.array([0], jnp.int32), k_new, v_new, mask,
                    DecodeConfig(block_kv=64))
  assert np.all(np.asarray(out[:, 0], np.float32) == 0.0)
  assert np.all(np.isneginf(np.asarray(lse[:, 0])))


@pytest.mark.parametrize("num_queries", [9, 17])
def test_more_than_64_query_rows_uses_several_q_blocks(num_queries):
  """G * Tq = 8 * 9 = 72 rows: two 64-row q blocks per KV head, default 128-row KV tiles;
  8 * 17 = 136 rows: three q blocks, default 64-row tiles (two per 128-slot cache)."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      3, batch=1, num_queries=num_queries, num_q_heads=8, num_kv_heads=1, head_dim=64,
      capacity=128, dtype=jnp.bfloat16)
  mask = jnp.tril(jnp.ones((num_queries, num_queries), bool))
  _check(q, k_cache, v_cache, jnp.array([100], jnp.int32), k_new, v_new, mask,
         DecodeConfig(num_splits=1))


def test_numpy_integer_config_knobs_run():
  """DecodeConfig takes numpy integers for its counts, and the kernel runs with them (they passed
  the checks, then np.int64 stages failed in Mosaic's Barrier, "'numpy.int64' object is not
  iterable", and np.int64 splits on a bare AssertionError)."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      0, batch=1, num_queries=1, num_q_heads=2, num_kv_heads=1, head_dim=64, capacity=128,
      dtype=jnp.bfloat16)
  config = DecodeConfig(block_kv=np.int64(64), num_stages=np.int64(2), num_splits=np.int64(2),
                        target_blocks=np.int64(4), min_tiles_per_split=np.int64(1))
  assert all(type(getattr(config, name)) is int for name in (
      "block_kv", "num_stages", "num_splits", "target_blocks", "min_tiles_per_split"))
  _check(q, k_cache, v_cache, jnp.array([100], jnp.int32), k_new, v_new, jnp.ones((1, 1), bool),
         config)


def test_bad_inputs_are_rejected_in_plain_words():
  q, k_cache, v_cache, k_new, v_new = _inputs(
      0, batch=1, num_queries=1, num_q_heads=3, num_kv_heads=2, head_dim=64, capacity=64,
      dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="not a multiple of Hkv"):
    decode_attention(q, k_cache, v_cache, jnp.array([1]), k_new, v_new, jnp.ones((1, 1), bool))
  q, k_cache, v_cache, k_new, v_new = _inputs(
      0, batch=1, num_queries=1, num_q_heads=2, num_kv_heads=2, head_dim=64, capacity=192,
      dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of block_kv=128"):
    decode_attention(q, k_cache, v_cache, jnp.array([1]), k_new, v_new, jnp.ones((1, 1), bool),
                     config=DecodeConfig(block_kv=128))
  q, k_cache, v_cache, k_new, v_new = _inputs(
      0, batch=1, num_queries=1, num_q_heads=2, num_kv_heads=2, head_dim=64, capacity=96,
      dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of block_kv=64"):
    decode_attention(q, k_cache, v_cache, jnp.array([1]), k_new, v_new, jnp.ones((1, 1), bool))
  with pytest.raises(ValueError, match="target_blocks must be >= 1"):
    DecodeConfig(target_blocks=0)
  with pytest.raises(ValueError, match="min_tiles_per_split must be >= 1"):  # was a planner error
    DecodeConfig(min_tiles_per_split=0)
  # Knobs of the wrong type: were Mosaic shape errors ("Shapes must be 1D sequences of concrete
  # values of integer type"), a string-formatting TypeError, or taken as truthy.
  with pytest.raises(ValueError, match=r"num_stages must be >= 1 \(an int\), got 2.0"):
    DecodeConfig(num_stages=2.0)
  with pytest.raises(ValueError, match="num_splits must be >= 1 .*, got 1.5"):
    DecodeConfig(num_splits=1.5)
  with pytest.raises(ValueError, match="block_kv must be >= 1 .*, got '64'"):
    DecodeConfig(block_kv="64")
  with pytest.raises(ValueError, match="warp_specialized must be None, True or False"):
    DecodeConfig(warp_specialized="no")
  assert DecodeConfig(num_stages=np.int64(3)).num_stages == 3
  mask = jnp.ones((1, 1), bool)
  with pytest.raises(ValueError, match="k_new must be floating point, got int32"):  # was silent
    decode_attention(q, k_cache, v_cache, jnp.array([1]), k_new.astype(jnp.int32), v_new, mask)
  with pytest.raises(ValueError, match="lengths must be a \\[B=1\\] integer array, got list"):
    decode_attention(q, k_cache, v_cache, [1], k_new, v_new, mask)      # was an AttributeError
  with pytest.raises(ValueError, match="lengths must be integer"):   # was silently truncated
    decode_attention(q, k_cache, v_cache, jnp.array([1.7]), k_new, v_new, mask)
  # An additive 0 / -inf bias mask was cast to bool: read as its inverse, a silent wrong answer.
  with pytest.raises(ValueError, match="inflight_mask .* must be bool .*, got float32"):
    decode_attention(q, k_cache, v_cache, jnp.array([1]), k_new, v_new,
                     jnp.zeros((1, 1), jnp.float32))
  with pytest.raises(ValueError, match="inflight_mask .* must be a bool array, got list"):
    decode_attention(q, k_cache, v_cache, jnp.array([1]), k_new, v_new, [[True]])
  with pytest.raises(ValueError, match=r"inflight_mask \[Tq, Tq\] must be \[1, 1\]"):
    decode_attention(q, k_cache, v_cache, jnp.array([1]), k_new, v_new, jnp.ones((1,), bool))
  with pytest.raises(ValueError, match="Tq=0"):
    decode_attention(q[:, :0], k_cache, v_cache, jnp.array([1]), k_new[:, :0], v_new[:, :0],
                     jnp.ones((0, 0), bool))
  with pytest.raises(ValueError, match="S=0"):
    decode_attention(q, k_cache[:, :, :0], v_cache[:, :, :0], jnp.array([1]), k_new, v_new, mask)
  # 128-key tiles x 4 stages do not fit an SM's shared memory: named, not a Mosaic error.
  q, k_cache, v_cache, k_new, v_new = _inputs(
      0, batch=1, num_queries=1, num_q_heads=2, num_kv_heads=2, head_dim=128, capacity=256,
      dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="block_kv=128 x num_stages=4 .* shared memory"):
    decode_attention(q, k_cache, v_cache, jnp.array([1]), k_new, v_new, mask,
                     config=DecodeConfig(block_kv=128, num_stages=4))
  # D = 320 (a multiple of 64 past the wgmma's N <= 256): a Mosaic error on the GPU, a bare
  # AssertionError in the interpreter at 2 <= Tq.
  q, k_cache, v_cache, k_new, v_new = _inputs(
      0, batch=1, num_queries=2, num_q_heads=2, num_kv_heads=1, head_dim=320, capacity=64,
      dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="head dim D=320 must be at most 256"):
    decode_attention(q, k_cache, v_cache, jnp.array([1]), k_new, v_new, jnp.ones((2, 2), bool),
                     interpret=INTERPRET)
  # At head dim 256 the default tiles are 64 keys (128 x 2 stages would not fit).
  assert DecodeConfig().resolve(1, 4096, 256).block_kv == 64
  assert DecodeConfig().resolve(1, 4096, 128).block_kv == 128


def test_two_blocks_per_sm_only_where_two_fit():
  """64-key tiles, 2 stages, D <= 128: two blocks; a third stage, D = 256 or 128-key tiles: one."""
  assert resident_blocks(64, 2, 128) == 2 and resident_blocks(64, 2, 64) == 2
  assert resident_blocks(64, 3, 128) == 1
  assert resident_blocks(64, 2, 256) == 1
  assert resident_blocks(128, 2, 64) == 1
  assert DecodeConfig().resolve(q_blocks=3, capacity=4096, head_dim=256).target_blocks == 132


def test_default_tiling_follows_the_query_rows():
  """Plain blocks with 128-key tiles, one per SM, while the rows fit two q blocks; from three
  on, on the GPU warp-specialized blocks (one per SM, 128-key tiles where the capacity allows,
  else 64), in the interpreter (and with warp_specialized=False) 64-key tiles and two plain
  blocks per SM."""
  for q_blocks in (1, 2, 3, 16):
    gpu = DecodeConfig().resolve(q_blocks=q_blocks, capacity=4096)
    assert (gpu.block_kv, gpu.target_blocks) == (128, 132)
    assert gpu.specialized(q_blocks, 128) == (q_blocks >= 3)
  odd = DecodeConfig().resolve(q_blocks=3, capacity=4160)               # not whole 128-key tiles
  assert (odd.block_kv, odd.target_blocks) == (64, 132) and odd.specialized(3, 128)
  for interpret, cfg in ((True, DecodeConfig()), (False, DecodeConfig(warp_specialized=False))):
    narrow = cfg.resolve(q_blocks=2, capacity=4096, interpret=interpret)
    assert (narrow.block_kv, narrow.target_blocks) == (128, 132)
    assert not narrow.specialized(2, 128, interpret)
    wide = cfg.resolve(q_blocks=3, capacity=4096, interpret=interpret)
    assert (wide.block_kv, wide.target_blocks) == (64, 264)
    assert not wide.specialized(3, 128, interpret)
  # The SMEM rule: two compute warpgroups with 128-key tiles fit 2 stages, not 3 (3 stages
  # default to 64-key tiles then).
  assert ws_smem_bytes(128, 2, 128) == 165 * 1024
  deep = DecodeConfig(num_stages=3).resolve(q_blocks=3, capacity=4096)
  assert deep.block_kv == 64 and deep.specialized(3, 128)
  assert not DecodeConfig(block_kv=128, num_stages=3).specialized(3, 128)
  one = DecodeConfig(num_stages=3, warp_specialized=True).resolve(q_blocks=1, capacity=4096)
  assert one.specialized(1, 128) and one.target_blocks == 132   # one compute warpgroup
  d256 = DecodeConfig().resolve(q_blocks=3, capacity=4096, head_dim=256)  # 128 keys: no room
  assert d256.block_kv == 64 and d256.specialized(3, 256)
  assert DecodeConfig().resolve(q_blocks=1, capacity=192).block_kv == 64
  fixed = DecodeConfig(block_kv=128, target_blocks=7).resolve(q_blocks=4, capacity=4096)
  assert (fixed.block_kv, fixed.target_blocks) == (128, 7)


def test_wide_call_ragged_rows_odd_q_blocks_and_scores():
  """43 queries x GQA 4:1 = 172 rows: three q blocks (on the GPU: warp-specialized pairs, the
  second pair's second warpgroup idle), two splits, an empty row and a partial last tile, two
  selected queries' scores."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      11, batch=2, num_queries=43, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=384,
      dtype=jnp.bfloat16)
  _check(q, k_cache, v_cache, jnp.array([0, 300], jnp.int32), k_new, v_new,
         jnp.tril(jnp.ones((43, 43), bool)), DecodeConfig(num_splits=2), score_queries=(5, 0))


@pytest.mark.parametrize("num_queries,score_queries,ws",
                         [(1, (), None), (16, (), None), (1, (0,), None), (16, (9, 2), None),
                          (43, (), None), (43, (0, 5), None), (256, (), None), (1, (0,), True),
                          (16, (9, 2), True), (256, (0,), False)])
def test_lowers_to_mosaic_gpu_custom_call_for_cuda(num_queries, score_queries, ws):
  """The H100 benchmark shape lowers (Pallas -> Mosaic GPU MLIR -> stablehlo custom call) on a
  CPU-only machine, also with the score output (its SMEM, with the default tiling, must fit:
  checked here); PTX generation happens later, in XLA:GPU's compile of the custom call."""
  b, hq, hkv, d, s = 1, 32, 8, 128, 4096
  sds = jax.ShapeDtypeStruct
  args = (sds((b, num_queries, hq, d), jnp.bfloat16), sds((b, hkv, s, d), jnp.bfloat16),
          sds((b, hkv, s, d), jnp.bfloat16), sds((b,), jnp.int32),
          sds((b, num_queries, hkv, d), jnp.bfloat16), sds((b, num_queries, hkv, d), jnp.bfloat16),
          sds((num_queries, num_queries), jnp.bool_))
  fn = lambda *a: decode_attention(*a, score_queries=score_queries,
                                   config=DecodeConfig(warp_specialized=ws))
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "stablehlo.custom_call @mosaic_gpu_v2" in text
  # Warp-specialized blocks (a producer warpgroup, one or two compute ones) by default from
  # three q blocks per KV head on (Tq * G > 128 rows), or when asked for.
  wanted = num_queries * hq // hkv > 128 if ws is None else ws
  assert ("decode_attention_kernel_ws" in text) == wanted


@pytest.mark.parametrize("on", [True, False])
def test_single_query_in_flight_score_from_the_cache_kernel(on):
  """Tq = 1 ("auto"): split 0's block computes q . k_new (one [64, 8] wgmma on k_new's row,
  the TMA zero-filling the 7 rows past it) and the combine takes it, so the call has no XLA dot
  (lowered for cuda: the jnp mode has one); B x Hkv = 6 (not a multiple of 8), the mask's one
  entry on and off, outputs equal to the jnp mode's and the reference's. A k_new in another
  dtype than q keeps the einsum."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      21, batch=2, num_queries=1, num_q_heads=6, num_kv_heads=3, head_dim=128, capacity=192,
      dtype=jnp.bfloat16)
  lengths, mask = jnp.array([150, 64], jnp.int32), jnp.full((1, 1), on)
  out, lse = _check(q, k_cache, v_cache, lengths, k_new, v_new, mask, DecodeConfig())
  out_jnp, lse_jnp = _check(q, k_cache, v_cache, lengths, k_new, v_new, mask,
                            DecodeConfig(inflight="jnp"))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_jnp, np.float32),
                             atol=1e-2)
  np.testing.assert_allclose(lse, lse_jnp, atol=1e-5, rtol=1e-6)
  args = (q, k_cache, v_cache, lengths, k_new, v_new, mask)
  call = lambda mode: lambda *a: decode_attention(*a, config=DecodeConfig(inflight=mode))
  assert "stablehlo.dot_general" not in cuda_text(call("auto"), *args)
  assert "stablehlo.dot_general" in cuda_text(call("jnp"), *args)
  f32_keys = (q, k_cache, v_cache, lengths, k_new.astype(jnp.float32), v_new, mask)
  assert "stablehlo.dot_general" in cuda_text(call("auto"), *f32_keys)
  # 128 query heads a KV head: two q blocks at Tq = 1, which the kernel's score does not take.
  wide = _inputs(3, batch=1, num_queries=1, num_q_heads=128, num_kv_heads=1, head_dim=128,
                 capacity=128, dtype=jnp.bfloat16)
  wide_args = (*wide[:3], lengths[:1], *wide[3:], mask)
  assert "stablehlo.dot_general" in cuda_text(call("auto"), *wide_args)


def test_few_queries_in_flight_keys_in_the_cache_kernel():
  """2 <= Tq, Tq * G <= 64 ("auto"): split 0's block attends to the in-flight keys first (one
  64-key tile read from k_new / v_new in place, the mask as a bias tile), so the call launches
  no in-flight kernel and the combine only merges splits. Checked against the reference and the
  in-flight kernel's mode ("kernel"): Tq * G = 64 exactly, B x Hkv = 6, a row with no cache
  slot (split 0 has no tile: only the in-flight keys), a query that sees no in-flight key (out
  from the cache alone), one that sees nothing at all (out 0, lse -inf), selected queries."""
  tq, hq, hkv = 16, 12, 3                                          # G = 4: 64 rows
  q, k_cache, v_cache, k_new, v_new = _inputs(
      31, batch=2, num_queries=tq, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, capacity=192,
      dtype=jnp.bfloat16)
  mask = np.tril(np.ones((tq, tq), bool))
  mask[5] = False
  mask = jnp.asarray(mask)
  lengths = jnp.array([150, 0], jnp.int32)
  config = DecodeConfig(num_splits=3)
  out, lse = _check(q, k_cache, v_cache, lengths, k_new, v_new, mask, config,
                    score_queries=(5, 0))
  assert np.all(np.asarray(out[1, 5], np.float32) == 0.0)        # row 1 sees no cache slot
  assert np.all(np.isneginf(np.asarray(lse[1, 5])))
  assert np.all(np.isfinite(np.asarray(lse[0, 5])))
  out_kernel, lse_kernel = _check(q, k_cache, v_cache, lengths, k_new, v_new, mask,
                                  DecodeConfig(num_splits=3, inflight="kernel"))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_kernel, np.float32),
                             atol=2e-2)
  finite = np.isfinite(np.asarray(lse_kernel))
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_kernel)[finite], atol=1e-4)
  # Lowered for cuda: one Mosaic GPU kernel (the cache kernel) and no in-flight kernel.
  args = (q, k_cache, v_cache, lengths, k_new, v_new, mask)
  call = lambda cfg: lambda *a: decode_attention(*a, config=cfg)
  text = cuda_text(call(config), *args)
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 1
  assert "inflight_attention" not in text
  assert "inflight_attention" in cuda_text(call(DecodeConfig(inflight="kernel")), *args)


@pytest.mark.parametrize("tq", [9, 15, 17, 21])
def test_in_flight_tile_at_row_counts_the_tma_rejects_read_in_place(tq):
  """SmolLM2's heads (Hq 9, Hkv 3, D 64: G 3, one q block up to Tq 21): a Tq above 8 and not a
  multiple of 8 (QuantSpec's "full" verification of 9 tokens, a small Lookahead step) lowered
  for cuda to one cache kernel with the tile; Mosaic GPU's TMA lowering rejected k_new / v_new
  read in place at these row counts (found on an H200, session 70; the interpreter does not
  check it), so they get zero rows up to a multiple of 8 (`tma_rows`), which the bias masks:
  the kernel still equals the reference (interpret mode) at Tq 9 and 21."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      tq, batch=1, num_queries=tq, num_q_heads=9, num_kv_heads=3, head_dim=64, capacity=128,
      dtype=jnp.bfloat16)
  mask = jnp.asarray(np.tril(np.ones((tq, tq), bool)))
  lengths = jnp.array([100], jnp.int32)
  assert in_kernel_tile(DecodeConfig(), q, k_cache, k_new, v_new, INTERPRET)
  text = cuda_text(lambda *a: decode_attention(*a), q, k_cache, v_cache, lengths, k_new, v_new,
                   mask)
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 1
  if tq in (9, 21):
    _check(q, k_cache, v_cache, lengths, k_new, v_new, mask, DecodeConfig())


def test_in_kernel_tile_choice():
  """Where the cache kernel takes the in-flight keys: "auto", 2 <= Tq, one q block of plain
  blocks, k_new and v_new in q's dtype; not at Tq = 1 (the score path), past 64 rows, with
  another mode, another dtype or warp-specialized blocks (the GPU's choice)."""
  def args(tq, hq, dtype=jnp.bfloat16, head_dim=64, capacity=64):
    q, k_cache, _, k_new, v_new = _inputs(0, batch=1, num_queries=tq, num_q_heads=hq,
                                          num_kv_heads=1, head_dim=head_dim, capacity=capacity,
                                          dtype=jnp.bfloat16)
    return q, k_cache, k_new.astype(dtype), v_new
  auto = DecodeConfig()
  assert in_kernel_tile(auto, *args(2, 4), INTERPRET)
  assert in_kernel_tile(auto, *args(16, 4), INTERPRET)          # 64 rows
  assert not in_kernel_tile(auto, *args(1, 4), INTERPRET)
  assert not in_kernel_tile(auto, *args(17, 4), INTERPRET)      # 68 rows: two q blocks
  assert not in_kernel_tile(auto, *args(4, 4, jnp.float32), INTERPRET)
  for mode in ("kernel", "merged", "jnp"):
    assert not in_kernel_tile(DecodeConfig(inflight=mode), *args(4, 4), INTERPRET)
  # D = 128: with 128-key tiles (one block an SM) the tile fits; with 64-key tiles (a capacity
  # not a multiple of 128) it would cost the SM its second resident block, so it is taken only
  # where the launch has at most one thread block an SM anyway (the GPU's split plan).
  assert in_kernel_tile(auto, *args(4, 4, head_dim=128, capacity=256), INTERPRET)
  assert in_kernel_tile(auto, *args(4, 4, head_dim=128, capacity=192), None)
  def shapes(batch, capacity):                     # Tq 4, 32 query heads on 8 KV heads
    q = jax.ShapeDtypeStruct((batch, 4, 32, 128), jnp.bfloat16)
    kn = jax.ShapeDtypeStruct((batch, 4, 8, 128), jnp.bfloat16)
    return q, jax.ShapeDtypeStruct((batch, 8, capacity, 128), jnp.bfloat16), kn, kn
  assert not in_kernel_tile(auto, *shapes(8, 16384 + 64), None)   # 64-key tiles, many blocks
  assert in_kernel_tile(auto, *shapes(8, 16384), None)            # 128-key tiles
  # D = 256 (64-key tiles): block 160 KiB + tile 72 KiB exceed one SM's 227 KiB, even alone.
  q256 = jax.ShapeDtypeStruct((1, 4, 4, 256), jnp.bfloat16)
  kn256 = jax.ShapeDtypeStruct((1, 4, 1, 256), jnp.bfloat16)
  cache256 = jax.ShapeDtypeStruct((1, 1, 1024, 256), jnp.bfloat16)
  assert not in_kernel_tile(auto, q256, cache256, kn256, kn256, None)
  # Warp-specialized blocks take no in-flight tile; the interpreter never runs them.
  assert not in_kernel_tile(DecodeConfig(warp_specialized=True), *args(4, 4), None)
  assert in_kernel_tile(DecodeConfig(warp_specialized=True), *args(4, 4), INTERPRET) == (
      INTERPRET is not None)
