"""The Mosaic GPU block-sparse attention kernel against its jnp reference, in GPU interpret mode
(CPU), including the selected queries' per-slot softmax weights (score_queries); the reference
against `sparsedec.attention.reference_attention` and `decode_attention`; and a check that the
kernel lowers to the Mosaic GPU custom call for the cuda platform. On a GPU backend the same
tests run the compiled kernels (warp-specialized blocks included, which the interpreter does
not run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rand
from kernel_mode import INTERPRET, cuda_text
from pallas_kernels.hopper import SM_COUNT
from pallas_kernels.decode_attention import (
  DecodeConfig,
  decode_attention,
  decode_attention_reference,
)
from pallas_kernels.sparse_attention import (
  SparseConfig,
  sparse_attention,
  sparse_attention_reference,
)
from sparsedec.attention import reference_attention

TOLERANCE = {jnp.bfloat16: 3e-2, jnp.float16: 4e-3}
f32 = lambda x: x.astype(jnp.float32)
# The references run jitted: one compile per shape instead of an XLA:CPU compile per eager op.
sparse_reference = jax.jit(sparse_attention_reference,
                           static_argnames=("block_size", "sparse_queries", "return_lse",
                                            "score_queries"))
dense_reference = jax.jit(decode_attention_reference, static_argnames=("return_lse",))
row_mask_reference = jax.jit(reference_attention, static_argnames=("return_lse",))


def _inputs(seed, *, batch, num_queries, num_q_heads, num_kv_heads, head_dim, capacity, dtype):
  keys = jax.random.split(jax.random.key(seed), 5)
  normal = lambda key, shape: rand.normal(key, shape, dtype)
  q = normal(keys[0], (batch, num_queries, num_q_heads, head_dim))             # [B, Tq, Hq, D]
  k_cache = normal(keys[1], (batch, num_kv_heads, capacity, head_dim))         # [B, Hkv, S, D]
  v_cache = normal(keys[2], (batch, num_kv_heads, capacity, head_dim))         # [B, Hkv, S, D]
  k_new = normal(keys[3], (batch, num_queries, num_kv_heads, head_dim))        # [B, Tq, Hkv, D]
  v_new = normal(keys[4], (batch, num_queries, num_kv_heads, head_dim))        # [B, Tq, Hkv, D]
  return q, k_cache, v_cache, k_new, v_new


def _random_tables(rng, batch, num_kv_heads, table_len, cache_blocks):
  """Duplicate-free random block lists [B, Hkv, NB] and counts [B, Hkv] in [0, NB]."""
  tables = np.stack([np.stack([rng.permutation(cache_blocks)[:table_len]
                               for _ in range(num_kv_heads)]) for _ in range(batch)])
  counts = rng.integers(0, table_len + 1, size=(batch, num_kv_heads))
  return (jnp.asarray(tables.reshape(batch, num_kv_heads, table_len), jnp.int32),
          jnp.asarray(counts, jnp.int32))


def _assert_close(out, lse, ref_out, ref_lse, dtype):
  tol = TOLERANCE[jnp.dtype(dtype).type]
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                             atol=tol, rtol=tol)
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-4)


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


def _slots_read(tables, counts, lengths, *, capacity, block_size, group, sparse_queries,
                score_queries):
  """[B, n, Hq, S] bool: the cache slots each selected query reads (numpy)."""
  tables = np.clip(np.asarray(tables), 0, capacity // block_size - 1)
  counts, lengths = np.asarray(counts), np.asarray(lengths)
  b, hkv, _ = tables.shape
  valid = np.arange(capacity)[None] < lengths[:, None]                     # [B, S]
  listed = np.zeros((b, hkv, capacity), bool)
  for row in range(b):
    for h in range(hkv):
      for block in tables[row, h, :counts[row, h]]:
        listed[row, h, block * block_size:(block + 1) * block_size] = True
  per_query = [listed if t < sparse_queries else np.ones_like(listed) for t in score_queries]
  read = np.stack(per_query, 1) & valid[:, None, None]                     # [B, n, Hkv, S]
  return np.repeat(read, group, axis=2)


def _check(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, mask, *, block_size,
           sparse_queries=None, config=SparseConfig(), score_queries=()):
  """Runs the kernel (interpret mode), compares with the fp32 reference, returns (out, lse)."""
  out, lse, *probs = sparse_attention(
      q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, mask, block_size=block_size,
      sparse_queries=sparse_queries, return_lse=True, score_queries=score_queries,
      config=config, interpret=INTERPRET)
  # fp32 copies: XLA:CPU has no bf16 x bf16 -> f32 dot, and fp32 is the exact oracle.
  ref_out, ref_lse, *ref_probs = sparse_reference(
      f32(q), f32(k_cache), f32(v_cache), tables, counts, lengths, f32(k_new), f32(v_new), mask,
      block_size=block_size, sparse_queries=sparse_queries, return_lse=True,
      score_queries=score_queries)
  if score_queries:
    probs, ref_probs = np.asarray(probs[0]), np.asarray(ref_probs[0])
    assert probs.shape == (q.shape[0], len(score_queries), q.shape[2], k_cache.shape[2])
    # The kernel's scores are the fp32 products of the same bf16/fp16 values: probs are as
    # close as lse (atol 2e-3 in log space, i.e. relative).
    np.testing.assert_allclose(probs, ref_probs, atol=1e-5, rtol=5e-3)
    read = _slots_read(tables, counts, lengths, capacity=k_cache.shape[2], block_size=block_size,
                       group=q.shape[2] // k_cache.shape[1],
                       sparse_queries=q.shape[1] if sparse_queries is None else sparse_queries,
                       score_queries=score_queries)
    assert np.all(probs[~read] == 0.0)
    # With the in-flight part a whole softmax (a duplicate-free list): 1, or 0 for no key at all.
    total = probs.sum(-1) + _inflight_weights(q, k_new, mask, lse, score_queries).sum(-1)
    np.testing.assert_allclose(total, np.where(total > 0.5, 1.0, 0.0), atol=2e-3)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
  _assert_close(out, lse, ref_out, ref_lse, q.dtype)
  return out, lse


@st.composite
def _cases(draw):
  # The interpreter runs grid points one after another (~0.1-0.5 s each): the grid is
  # (q blocks x splits of both segments, Hkv, B), so keep B * Hkv and the split counts small.
  # Hypothesis shrinks towards the first value of each `sampled_from`: those come first that make
  # a case informative (a strict subset of the blocks listed, both segments, ragged lengths).
  batch = draw(st.sampled_from([1, 2]))
  num_kv_heads = draw(st.sampled_from([2, 1])) if batch == 1 else 1
  group = draw(st.sampled_from([2, 1, 4, 8]))
  num_queries = draw(st.sampled_from([3, 1, 2, 5]))
  block_size = draw(st.sampled_from([64, 128]))
  block_kv = draw(st.sampled_from([None, 64]))
  cache_blocks = draw(st.sampled_from([3, 2, 1]))
  capacity = block_size * cache_blocks
  table_len = draw(st.sampled_from(sorted({max(1, cache_blocks - 1), cache_blocks, 0},
                                          key=lambda n: (n == 0, n))))
  count_kind = draw(st.sampled_from(["whole table", "random"]))
  length_kind = st.sampled_from(["random", "capacity", "zero"])
  lengths = [{"random": 1 + draw(st.integers(0, 2 ** 16)) % capacity, "capacity": capacity,
               "zero": 0}[kind]
             for kind in draw(st.lists(length_kind, min_size=batch, max_size=batch))]
  segments = draw(st.sampled_from(["split", "all listed", "all full"]))
  sparse_queries = {"split": draw(st.integers(1, max(1, num_queries - 1))),
                    "all listed": None, "all full": 0}[segments]
  mask_kind = draw(st.sampled_from(["causal", "random", "none"]))
  if mask_kind == "causal":
    mask = np.tril(np.ones((num_queries, num_queries), bool))
  elif mask_kind == "none":
    mask = np.zeros((num_queries, num_queries), bool)
  else:
    bits = draw(st.lists(st.booleans(), min_size=num_queries ** 2, max_size=num_queries ** 2))
    mask = np.array(bits, bool).reshape(num_queries, num_queries)
  # A few selected queries, in any order, from either segment (none half the time).
  score_queries = ()
  if draw(st.booleans()):
    score_queries = tuple(draw(st.permutations(range(num_queries)))[:draw(st.integers(1, 2))])
  return dict(
      score_queries=score_queries,
      shape=dict(batch=batch, num_queries=num_queries, num_q_heads=num_kv_heads * group,
                 num_kv_heads=num_kv_heads, head_dim=64, capacity=capacity,
                 dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float16]))),
      table_len=table_len, cache_blocks=cache_blocks, block_size=block_size,
      whole_table=count_kind == "whole table",
      lengths=np.array(lengths, np.int32), mask=mask, sparse_queries=sparse_queries,
      config=SparseConfig(block_kv=block_kv, num_stages=draw(st.sampled_from([2, 1, 3])),
                          num_splits=draw(st.sampled_from([2, None, 1])),
                          num_splits_full=draw(st.sampled_from([None, 1, 2])),
                          # on a GPU: True runs warp-specialized blocks (the interpreter: plain)
                          warp_specialized=draw(st.sampled_from([None, True]))),
      seed=draw(st.integers(0, 2 ** 16)),
  )


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_kernel_matches_reference(case):
  shape = case["shape"]
  q, k_cache, v_cache, k_new, v_new = _inputs(case["seed"], **shape)
  tables, counts = _random_tables(np.random.default_rng(case["seed"]), shape["batch"],
                                  shape["num_kv_heads"], case["table_len"], case["cache_blocks"])
  if case["whole_table"]:
    counts = jnp.full_like(counts, case["table_len"])
  _check(q, k_cache, v_cache, tables, counts, jnp.asarray(case["lengths"]), k_new, v_new,
         jnp.asarray(case["mask"]), block_size=case["block_size"],
         sparse_queries=case["sparse_queries"], config=case["config"],
         score_queries=case["score_queries"])


def test_single_query_ragged_lengths_and_empty_lists():
  """Tq = 1, GQA 8:1, D = 128, 2 KV heads: per (row, head) an empty list, a list whose block lies
  wholly past the row's length, and lists ending in a partial block; one row of length 0."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      1, batch=3, num_queries=1, num_q_heads=16, num_kv_heads=2, head_dim=128, capacity=256,
      dtype=jnp.bfloat16)
  tables = jnp.array([[[0, 2, 1], [3, 1, 0]],
                      [[1, 0, 3], [2, 3, 0]],          # row 1 has length 77: blocks 2, 3 unused
                      [[3, 2, 1], [0, 1, 2]]], jnp.int32)
  counts = jnp.array([[0, 2], [3, 1], [2, 3]], jnp.int32)
  lengths = jnp.array([0, 77, 256], jnp.int32)
  out, _ = _check(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new,
                  jnp.ones((1, 1), bool), block_size=64,
                  config=SparseConfig(num_splits=2, num_stages=2))
  # Row 1, head 1 lists only block 2 (slots 128..191 >= 77): only the in-flight key counts,
  # so the output is v_new exactly (up to bf16) and lse the in-flight score.
  np.testing.assert_allclose(np.asarray(out[1, 0, 8:], np.float32),
                             np.broadcast_to(np.asarray(v_new[1, 0, 1], np.float32), (8, 128)),
                             atol=1e-2)


def test_out_of_range_entries_counts_and_lengths_are_clipped_in_the_kernel():
  """The kernel clips what the wrapper passes through unchanged: table entries below 0 or past
  the last cache block, counts below 0 or above NB, lengths below 0 or above S (both segments),
  as the reference does; an in-range copy of the same inputs gives the same output."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      6, batch=2, num_queries=2, num_q_heads=4, num_kv_heads=2, head_dim=64, capacity=256,
      dtype=jnp.bfloat16)
  tables = jnp.array([[[-3, 9], [2, 1]], [[3, -1], [7, 0]]], jnp.int32)    # 4 cache blocks
  counts = jnp.array([[5, -2], [2, 9]], jnp.int32)                          # NB = 2
  lengths = jnp.array([-7, 1000], jnp.int32)
  mask = jnp.tril(jnp.ones((2, 2), bool))
  out, lse = _check(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, mask,
                    block_size=64, sparse_queries=1, config=SparseConfig(num_splits=2))
  clipped = sparse_attention(
      q, k_cache, v_cache, jnp.clip(tables, 0, 3), jnp.clip(counts, 0, 2),
      jnp.clip(lengths, 0, 256), k_new, v_new, mask, block_size=64, sparse_queries=1,
      return_lse=True, config=SparseConfig(num_splits=2), interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clipped[0], np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(clipped[1]))


def test_unsigned_lengths_past_int32_read_every_slot():
  """A uint32 length past int32's range means every slot (it wrapped to a negative length that
  read none), in the kernel and the reference, the listed and the full segment alike."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      8, batch=2, num_queries=2, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=256,
      dtype=jnp.bfloat16)
  tables, counts = jnp.array([[[3, 0]], [[1, 2]]], jnp.int32), jnp.array([[2], [2]], jnp.int32)
  mask = jnp.tril(jnp.ones((2, 2), bool))
  kw = dict(block_size=64, sparse_queries=1, config=SparseConfig(num_splits=2),
            score_queries=(0, 1))
  wide = _check(q, k_cache, v_cache, tables, counts, jnp.array([2**32 - 9, 150], jnp.uint32),
                k_new, v_new, mask, **kw)
  clipped = _check(q, k_cache, v_cache, tables, counts, jnp.array([256, 150], jnp.int32),
                   k_new, v_new, mask, **kw)
  for a, b in zip(wide, clipped):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_unsigned_table_entries_and_counts_past_int32_are_clipped_not_wrapped():
  """uint32 block ids and counts past int32's range mean the last block and the whole table (as
  the clip of an in-range value does); a cast first wrapped them to -1 / -2: block 0 and no
  blocks. Kernel and reference alike."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      9, batch=2, num_queries=2, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=256,
      dtype=jnp.bfloat16)
  mask = jnp.tril(jnp.ones((2, 2), bool))
  lengths = jnp.array([256, 200], jnp.int32)
  kw = dict(block_size=64, sparse_queries=1, config=SparseConfig(num_splits=2),
            score_queries=(0,))
  wide = _check(q, k_cache, v_cache, jnp.array([[[2**32 - 1, 0]], [[1, 2**31 + 5]]], jnp.uint32),
                jnp.array([[2**32 - 2], [2]], jnp.uint32), lengths, k_new, v_new, mask, **kw)
  clipped = _check(q, k_cache, v_cache, jnp.array([[[3, 0]], [[1, 3]]], jnp.int32),
                   jnp.array([[2], [2]], jnp.int32), lengths, k_new, v_new, mask, **kw)
  for a, b in zip(wide, clipped):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_full_list_equals_decode_attention():
  """A list of every block (in shuffled order) = dense decode attention: the reference equals
  decode_attention's reference, and the kernel equals the decode kernel."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      4, batch=2, num_queries=3, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=256,
      dtype=jnp.bfloat16)
  lengths = jnp.array([256, 150], jnp.int32)
  mask = jnp.tril(jnp.ones((3, 3), bool))
  tables = jnp.array([[[2, 0, 3, 1]], [[1, 3, 2, 0]]], jnp.int32)
  counts = jnp.array([[4], [4]], jnp.int32)
  ref_args = (f32(q), f32(k_cache), f32(v_cache))
  ref_out, ref_lse = sparse_reference(*ref_args, tables, counts, lengths, f32(k_new),
                                                f32(v_new), mask, block_size=64, return_lse=True)
  dense_out, dense_lse = dense_reference(*ref_args, lengths, f32(k_new), f32(v_new),
                                                    mask, return_lse=True)
  np.testing.assert_allclose(np.asarray(ref_out), np.asarray(dense_out), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(ref_lse), np.asarray(dense_lse), atol=1e-5, rtol=1e-5)

  out, lse = _check(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, mask,
                    block_size=64, config=SparseConfig(num_splits=2))
  dec_out, dec_lse = decode_attention(q, k_cache, v_cache, lengths, k_new, v_new, mask,
                                      return_lse=True, interpret=INTERPRET,
                                      config=DecodeConfig(block_kv=64, num_splits=2))
  _assert_close(out, lse, dec_out, dec_lse, q.dtype)


def test_segment_split_fumble_and_verification_queries():
  """FAFO's plan in one launch: queries [0, 2) read a 1-block list, queries [2, 5) the full
  cache. The full segment equals dense decode attention of those queries; the listed segment
  differs from it (it reads less)."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      5, batch=1, num_queries=5, num_q_heads=4, num_kv_heads=2, head_dim=64, capacity=256,
      dtype=jnp.bfloat16)
  lengths = jnp.array([200], jnp.int32)
  mask = jnp.tril(jnp.ones((5, 5), bool))
  tables = jnp.array([[[1, 0], [3, 0]]], jnp.int32)
  counts = jnp.array([[1, 1]], jnp.int32)
  out, _ = _check(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, mask,
                  block_size=128, sparse_queries=2,
                  config=SparseConfig(block_kv=64, num_splits=1, num_splits_full=2))
  dense = dense_reference(f32(q), f32(k_cache), f32(v_cache), lengths, f32(k_new),
                                     f32(v_new), mask)
  np.testing.assert_allclose(np.asarray(out[:, 2:], np.float32), np.asarray(dense[:, 2:]),
                             atol=3e-2, rtol=3e-2)
  assert np.abs(np.asarray(out[:, :2], np.float32) - np.asarray(dense[:, :2])).max() > 0.1


def test_wide_segments_in_pairs_of_q_blocks():
  """FAFO's shape, small: 40 fumble queries on a 3-block list (one block past the length of
  row 1), 11 on the full cache, GQA 4:1 (160 and 44 rows: three q blocks and one; on the GPU
  warp-specialized pairs, the odd blocks' second warpgroups idle), two rows, selected queries
  in both segments."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      12, batch=2, num_queries=51, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=512,
      dtype=jnp.bfloat16)
  tables = jnp.array([[[0, 5, 7]], [[1, 6, 2]]], jnp.int32)
  _check(q, k_cache, v_cache, tables, jnp.array([[3], [3]], jnp.int32),
         jnp.array([512, 300], jnp.int32), k_new, v_new, jnp.tril(jnp.ones((51, 51), bool)),
         block_size=64, sparse_queries=40, config=SparseConfig(num_splits=1, num_splits_full=2),
         score_queries=(41, 2))


def test_score_queries_probs_in_both_segments():
  """Selected queries (3, 1, 0) out of order: 1 and 0 read the list (queries [0, 2)), 3 the full
  cache. Head 0 lists block 1 only, head 1 block 3 (wholly past the length 180) and block 0.
  probs equal the reference's, are 0 off the slots read and with the in-flight part sum to 1;
  out and lse stay in query order."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      5, batch=1, num_queries=5, num_q_heads=4, num_kv_heads=2, head_dim=64, capacity=256,
      dtype=jnp.bfloat16)
  _check(q, k_cache, v_cache, jnp.array([[[1, 0], [3, 0]]], jnp.int32),
         jnp.array([[1, 2]], jnp.int32), jnp.array([180], jnp.int32), k_new, v_new,
         jnp.tril(jnp.ones((5, 5), bool)), block_size=64, sparse_queries=2,
         config=SparseConfig(block_kv=64, num_splits=1, num_splits_full=2),
         score_queries=(3, 1, 0))


def test_score_queries_probs_zero_from_the_length_at_a_tile_boundary():
  """Length 128, a multiple of the 64-key tile: no split of either segment visits slot 128 (its
  score is never written), so the wrapper's read mask must stop before the length for the
  full-cache query (1) as for the listed one (0): probs 0 from slot 128 on."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      11, batch=1, num_queries=2, num_q_heads=2, num_kv_heads=1, head_dim=64, capacity=256,
      dtype=jnp.bfloat16)
  _check(q, k_cache, v_cache, jnp.array([[[1, 0]]], jnp.int32), jnp.array([[2]], jnp.int32),
         jnp.array([128], jnp.int32), k_new, v_new, jnp.tril(jnp.ones((2, 2), bool)),
         block_size=64, sparse_queries=1,
         config=SparseConfig(block_kv=64, num_splits=1, num_splits_full=2),
         score_queries=(1, 0))


def test_score_queries_take_any_sequence_of_ints():
  """score_queries as a list or a numpy array equals the tuple (a list raised JAX's
  'Non-hashable static arguments are not supported' at the jit boundary)."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      6, batch=1, num_queries=2, num_q_heads=1, num_kv_heads=1, head_dim=64, capacity=128,
      dtype=jnp.bfloat16)
  args = (q, k_cache, v_cache, jnp.array([[[1]]], jnp.int32), jnp.array([[1]], jnp.int32),
          jnp.array([100]), k_new, v_new, jnp.tril(jnp.ones((2, 2), bool)))
  call = lambda sel: sparse_attention(*args, block_size=64, sparse_queries=1, score_queries=sel,
                                      interpret=INTERPRET)
  out, probs = call((1, 0))
  for sel in ([1, 0], np.array([1, 0])):
    got_out, got_probs = call(sel)
    np.testing.assert_array_equal(np.asarray(got_out), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(got_probs), np.asarray(probs))


def test_score_queries_probs_count_a_duplicate_block_twice():
  """A block listed twice is read twice, in the kernel and the reference alike: its slots'
  probs are twice the single weight, and the whole still sums to 1 with the in-flight part."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      9, batch=1, num_queries=2, num_q_heads=2, num_kv_heads=1, head_dim=64, capacity=256,
      dtype=jnp.float16)
  tables, counts = jnp.array([[[2, 0, 2]]], jnp.int32), jnp.array([[3]], jnp.int32)
  lengths, mask = jnp.array([160], jnp.int32), jnp.ones((2, 2), bool)
  out, lse, probs = sparse_attention(
      q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, mask, block_size=64,
      return_lse=True, score_queries=(1,), config=SparseConfig(num_splits=1),
      interpret=INTERPRET)
  ref_probs = sparse_reference(
      f32(q), f32(k_cache), f32(v_cache), tables, counts, lengths, f32(k_new), f32(v_new), mask,
      block_size=64, score_queries=(1,))[1]
  probs = np.asarray(probs)
  np.testing.assert_allclose(probs, np.asarray(ref_probs), atol=1e-5, rtol=5e-3)
  # Slot s of block 2 (128..159 < 160) weighs 2 exp(score - lse); block 0 once; the rest 0.
  qf, kf = np.asarray(q, np.float32)[0, 1], np.asarray(k_cache, np.float32)[0, 0]
  single = np.exp(qf @ kf.T * 64 ** -0.5 - np.asarray(lse)[0, 1][:, None])   # [Hq, S]
  expected = np.zeros_like(single)
  expected[:, :64] = single[:, :64]
  expected[:, 128:160] = 2 * single[:, 128:160]
  np.testing.assert_allclose(probs[0, 0], expected, atol=1e-5, rtol=5e-3)
  total = probs.sum(-1) + _inflight_weights(q, k_new, mask, lse, (1,)).sum(-1)
  np.testing.assert_allclose(total, 1.0, atol=2e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_references_multiply_fp32_at_full_precision(dtype):
  """The sparse and decode references' einsums ask for HIGHEST precision on fp32 operands (as
  sparsedec's reference_attention does since session 53) and leave bf16 at the default: on an
  H200 their fp32 outputs were TF32 products, 2e-4 off the test below's fp32 reference, which
  failed there (session 56)."""
  b, tq, hq, hkv, d, s, bs = 1, 2, 2, 1, 64, 128, 64
  q, k_cache, v_cache, k_new, v_new = _inputs(0, batch=b, num_queries=tq, num_q_heads=hq,
                                              num_kv_heads=hkv, head_dim=d, capacity=s,
                                              dtype=dtype)
  lengths, mask = jnp.array([100], jnp.int32), jnp.tril(jnp.ones((tq, tq), bool))
  tables, counts = jnp.zeros((b, hkv, 1), jnp.int32), jnp.ones((b, hkv), jnp.int32)
  texts = [sparse_reference.lower(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, mask,
                                  block_size=bs, sparse_queries=1).as_text(),
           dense_reference.lower(q, k_cache, v_cache, lengths, k_new, v_new, mask).as_text()]
  for text in texts:
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) >= 4
    highest = ["precision = [HIGHEST, HIGHEST]" in line for line in dots]
    assert all(highest) if dtype == jnp.float32 else not any(highest), dots


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_reference_matches_sparsedec_reference_attention(num_kv_heads):
  """The gather reference = reference_attention with the block list written as a [B, T, S]
  cache mask (the same list for every KV head, as reference_attention's mask is per row)."""
  b, tq, hq, d, s, bs = 2, 4, 2 * num_kv_heads, 64, 512, 64
  q, k_cache, v_cache, k_new, v_new = _inputs(
      6, batch=b, num_queries=tq, num_q_heads=hq, num_kv_heads=num_kv_heads, head_dim=d,
      capacity=s, dtype=jnp.float32)
  rng = np.random.default_rng(0)
  row_tables = np.stack([rng.permutation(s // bs)[:5] for _ in range(b)])       # [B, NB]
  counts = np.array([3, 5])
  lengths = np.array([300, 512], np.int32)
  mask = np.tril(np.ones((tq, tq), bool))
  sparse_queries = 3
  listed = np.zeros((b, s), bool)
  for row in range(b):
    for block in row_tables[row, :counts[row]]:
      listed[row, block * bs:(block + 1) * bs] = True
  valid = np.arange(s)[None] < lengths[:, None]
  cache_mask = np.concatenate([np.repeat((listed & valid)[:, None], sparse_queries, 1),
                               np.repeat(valid[:, None], tq - sparse_queries, 1)], 1)
  expected = row_mask_reference(q, k_cache, v_cache, jnp.asarray(cache_mask), k_new, v_new,
                                 jnp.broadcast_to(jnp.asarray(mask), (b, tq, tq)),
                                 return_lse=True)
  tables = jnp.asarray(np.repeat(row_tables[:, None], num_kv_heads, 1), jnp.int32)
  got = sparse_reference(
      q, k_cache, v_cache, tables, jnp.asarray(np.repeat(counts[:, None], num_kv_heads, 1)),
      jnp.asarray(lengths), k_new, v_new, jnp.asarray(mask), block_size=bs,
      sparse_queries=sparse_queries, return_lse=True)
  for x, y in zip(got, expected):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_rejected_in_plain_words():
  q, k_cache, v_cache, k_new, v_new = _inputs(
      0, batch=1, num_queries=2, num_q_heads=2, num_kv_heads=2, head_dim=64, capacity=192,
      dtype=jnp.bfloat16)
  args = lambda tables: (q, k_cache, v_cache, tables, jnp.ones((1, 2), jnp.int32),
                         jnp.array([1]), k_new, v_new, jnp.ones((2, 2), bool))
  good = jnp.zeros((1, 2, 1), jnp.int32)
  with pytest.raises(ValueError, match="multiple of block_size"):
    sparse_attention(*args(good), block_size=128)
  with pytest.raises(ValueError, match="positive multiple of 64"):
    sparse_attention(*args(good), block_size=32)
  with pytest.raises(ValueError, match=r"positive multiple of 64 \(an int\), got 64.0"):
    sparse_attention(*args(good), block_size=64.0)
  # numpy integers stored as ints (np.int64 stages failed in Mosaic's Barrier, np.int64 splits
  # or block_kv on a bare AssertionError; test_numpy_integer_config_knobs_run runs one).
  # ... and numpy integer block_size / sparse_queries (the latter a bare AssertionError in the
  # kernel's grid).
  out = sparse_attention(*args(good), block_size=np.int64(64), sparse_queries=np.int64(1),
                         interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(sparse_attention(
      *args(good), block_size=64, sparse_queries=1, interpret=INTERPRET), np.float32))
  np_config = SparseConfig(block_kv=np.int64(64), num_stages=np.int64(2),
                           num_splits=np.int64(2), num_splits_full=np.int64(2))
  assert all(type(getattr(np_config, name)) is int
             for name in ("block_kv", "num_stages", "num_splits", "num_splits_full"))
  with pytest.raises(ValueError, match="block_tables must be"):
    sparse_attention(*args(jnp.zeros((1, 1, 1), jnp.int32)), block_size=64)
  with pytest.raises(ValueError, match="block_tables must be an array, got list"):
    sparse_attention(*args([[[0], [0]]]), block_size=64)      # was an AttributeError
  with pytest.raises(ValueError, match="sparse_queries"):
    sparse_attention(*args(good), block_size=64, sparse_queries=3)
  with pytest.raises(ValueError, match="must divide block_size"):
    sparse_attention(*args(good), block_size=64, config=SparseConfig(block_kv=128))
  with pytest.raises(ValueError, match="target_blocks must be >= 1"):
    SparseConfig(target_blocks=0)
  with pytest.raises(ValueError, match="num_splits_full must be >= 1 .*, got 0.5"):
    SparseConfig(num_splits_full=0.5)
  with pytest.raises(ValueError, match=r"sparse_queries must be an int .*, got 1.0"):
    sparse_attention(*args(good), block_size=64, sparse_queries=1.0)   # was range()'s TypeError
  lengths = lambda values: (q, k_cache, v_cache, good, jnp.ones((1, 2), jnp.int32), values,
                            k_new, v_new, jnp.ones((2, 2), bool))
  with pytest.raises(ValueError, match="lengths must be integer"):
    sparse_attention(*lengths(jnp.array([1.5])), block_size=64)
  with pytest.raises(ValueError, match="B=0"):
    sparse_attention(q[:0], k_cache[:0], v_cache[:0], good[:0], jnp.ones((0, 2), jnp.int32),
                     jnp.zeros((0,), jnp.int32), k_new[:0], v_new[:0], jnp.ones((2, 2), bool),
                     block_size=64)
  q, k_cache, v_cache, k_new, v_new = _inputs(
      0, batch=1, num_queries=2, num_q_heads=2, num_kv_heads=2, head_dim=320, capacity=64,
      dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="head dim D=320 must be at most 256"):  # a Mosaic error
    sparse_attention(q, k_cache, v_cache, good, jnp.ones((1, 2), jnp.int32), jnp.array([1]),
                     k_new, v_new, jnp.ones((2, 2), bool), block_size=64)
  assert SparseConfig().tile_rows(128, 256) == 64 and SparseConfig().tile_rows(128, 128) == 128


def test_split_plan_fills_two_blocks_per_sm_with_64_key_tiles():
  """64-key tiles with <= 2 stages: two thread blocks per SM (88 KiB of SMEM each); 128-key
  tiles or deeper rings: one; an explicit target_blocks wins."""
  assert SparseConfig().slots(block_size=64) == 264
  assert SparseConfig().slots(block_size=128) == 132
  assert SparseConfig(num_stages=3).slots(block_size=64) == 132
  assert SparseConfig(block_kv=64).slots(block_size=128) == 264
  assert SparseConfig(target_blocks=5).slots(block_size=64) == 5
  # Warp-specialized blocks (the GPU, a segment of three q blocks or more): one per SM.
  assert SparseConfig().slots(block_size=64, ws=True) == 132
  assert SparseConfig().specialized(3, 64, 128) and not SparseConfig().specialized(2, 64, 128)
  assert not SparseConfig().specialized(3, 64, 128, max_tiles=4)          # a short list
  assert not SparseConfig().specialized(3, 64, 128, interpret=True)
  assert SparseConfig(warp_specialized=True).specialized(1, 64, 128)


@pytest.mark.parametrize("num_queries,sparse_queries,block_size,table_len,score_queries",
                         [(1, None, 128, 2, ()), (16, 8, 64, 4, ()), (16, 16, 256, 4, ()),
                          (1, None, 128, 2, (0,)), (16, 8, 64, 4, (12, 3)),
                          (16, 16, 256, 4, (12, 3)), (16, 0, 128, 4, ()), (16, 16, 64, 4, ()),
                          (283, 240, 64, 16, ()), (283, 240, 64, 16, (0, 250))])
def test_lowers_to_mosaic_gpu_custom_call_for_cuda(num_queries, sparse_queries, block_size,
                                                   table_len, score_queries):
  """The H100 benchmark shapes (S = 16K, 1.6% of the blocks listed) and FAFO's 8B step (240
  fumble queries on 16 blocks, 43 on the full cache) lower to the Mosaic GPU custom call on a
  CPU-only machine, also with the score output (both segments; its SMEM must fit), and with
  the in-flight tile (one segment of 16 x 4 = 64 rows; with the score output too); PTX generation happens later, in XLA:GPU."""
  b, hq, hkv, d, s, tq = 1, 32, 8, 128, 16384, num_queries
  sds = jax.ShapeDtypeStruct
  args = (sds((b, tq, hq, d), jnp.bfloat16), sds((b, hkv, s, d), jnp.bfloat16),
          sds((b, hkv, s, d), jnp.bfloat16), sds((b, hkv, table_len), jnp.int32),
          sds((b, hkv), jnp.int32), sds((b,), jnp.int32),
          sds((b, tq, hkv, d), jnp.bfloat16), sds((b, tq, hkv, d), jnp.bfloat16),
          sds((tq, tq), jnp.bool_))
  fn = lambda *a: sparse_attention(*a, block_size=block_size, sparse_queries=sparse_queries,
                                   score_queries=score_queries)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu_v2" in text
  # Warp-specialized blocks where a segment has three q blocks or more (Tq * G > 128 rows) and
  # one may run 8 tiles or more (FAFO's 8B call; not 4 listed blocks).
  wide = max(sparse_queries or tq, tq - (sparse_queries or tq)) * hq // hkv > 128
  long = max(table_len, s // block_size if (sparse_queries or tq) < tq else 0) >= 8
  assert ("sparse_attention_kernel_ws" in text) == (wide and long)
  # The in-flight tile (one segment of one q block; at D = 128 with 128-key tiles, which keep
  # one block an SM, or in a launch of at most one block an SM) replaces the in-flight kernel
  # of 2 <= Tq.
  from pallas_kernels.sparse_attention import _layout
  segments = _layout(args[0].shape, args[1].shape, table_len, block_size=block_size,
                     sparse_queries=tq if sparse_queries is None else sparse_queries,
                     config=SparseConfig(), num_score_queries=(0, 0), interpret=False)[0]
  tiled = (2 <= tq and tq * hq // hkv <= 64 and len(segments) == 1
           and (block_size % 128 == 0 or b * hkv * segments[0].num_work <= SM_COUNT))
  assert ("inflight_attention_kernel" in text) == (tq >= 2 and not tiled)


@pytest.mark.parametrize("on", [True, False])
def test_single_query_in_flight_score_from_the_cache_kernel(on):
  """Tq = 1 ("auto"): work item 0 computes q . k_new in the cache kernel (decode_attention's
  `store_inflight_score`), so the call has no XLA dot (lowered for cuda); B x Hkv = 6, the
  mask's one entry on and off, an empty list beside full ones; the same outputs as the jnp
  mode's and the reference's."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      22, batch=2, num_queries=1, num_q_heads=6, num_kv_heads=3, head_dim=128, capacity=256,
      dtype=jnp.bfloat16)
  tables = jnp.array([[[0, 2, 3], [1, 3, 0], [2, 2, 1]],
                      [[0, 1, 2], [3, 0, 1], [1, 2, 3]]], jnp.int32)
  counts = jnp.array([[3, 2, 1], [0, 3, 2]], jnp.int32)
  lengths, mask = jnp.array([200, 37], jnp.int32), jnp.full((1, 1), on)
  args = (q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, mask)
  out, lse = _check(*args, block_size=64)
  out_jnp, lse_jnp = _check(*args, block_size=64, config=SparseConfig(inflight="jnp"))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_jnp, np.float32),
                             atol=1e-2)
  np.testing.assert_allclose(lse, lse_jnp, atol=1e-5, rtol=1e-6)
  text = lambda mode: cuda_text(lambda *a: sparse_attention(
      *a, block_size=64, config=SparseConfig(inflight=mode)), *args)
  assert "stablehlo.dot_general" not in text("auto")
  assert "stablehlo.dot_general" in text("jnp")


# The in-flight tile (2 <= Tq, one segment of one q block): work item 0 attends to the in-flight
# keys first (decode_attention's `inflight_tile_step`), so no in-flight kernel runs.
def _tile_case():
  """Tq 16 x G 4 = 64 rows (one q block), B x Hkv = 4, 256 slots in 64-slot blocks. Row 0
  (length 150): head 0 lists blocks 1 and 3 (3 wholly past the length), head 1 an empty list
  (num_blocks 0); row 1 (length 0): head 0 lists block 0, head 1 blocks 2 and 0 (all wholly past
  the length). Query 5 sees no in-flight key."""
  tq, hq, hkv = 16, 8, 2
  q, k_cache, v_cache, k_new, v_new = _inputs(
      41, batch=2, num_queries=tq, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, capacity=256,
      dtype=jnp.bfloat16)
  mask = np.tril(np.ones((tq, tq), bool))
  mask[5] = False
  tables = jnp.array([[[1, 3], [2, 0]], [[0, 1], [2, 0]]], jnp.int32)
  counts = jnp.array([[2, 0], [1, 2]], jnp.int32)
  lengths = jnp.array([150, 0], jnp.int32)
  return q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, jnp.asarray(mask)


@pytest.mark.parametrize("sparse_queries", [None, 0])
def test_few_queries_in_flight_keys_in_the_cache_kernel(sparse_queries):
  """One segment (every query on the list, or every query on the full cache) of one q block:
  against the reference with selected queries and lse, through splits with no tile at all (an
  empty list, a row of length 0: work item 0 holds only the in-flight keys) and tiles wholly
  past the length (all -inf after the in-flight tile's finite or -inf row max). Query 5 sees no
  in-flight key: where it sees no cache slot either, out 0 and lse -inf."""
  args = _tile_case()
  out, lse = _check(*args, block_size=64, sparse_queries=sparse_queries,
                    config=SparseConfig(num_splits=2), score_queries=(5, 0))
  lse = np.asarray(lse)
  assert np.all(np.isneginf(lse[1, 5]))                          # length 0: nothing at all
  assert np.all(np.asarray(out[1, 5], np.float32) == 0.0)
  assert np.all(np.isfinite(lse[1, :5])) and np.all(np.isfinite(lse[1, 6:]))
  assert np.all(np.isfinite(lse[0, 5, :4]))                      # head 0 reads slots < 150
  # Head 1 of row 0: an empty list (nothing for query 5), or the full cache.
  assert np.all(np.isneginf(lse[0, 5, 4:]) == (sparse_queries is None))


def test_in_flight_tile_with_an_empty_table():
  """NB = 0 (no list at all; one unused entry inside the wrapper): no work item has a cache
  tile and the output is the in-flight part alone, as the reference's. Tq 3 x G 2 = 6 rows
  (rows_out 8, the tile's rows past Tq zero-filled), fp16, query 1 sees no key at all."""
  tq = 3
  q, k_cache, v_cache, k_new, v_new = _inputs(
      42, batch=2, num_queries=tq, num_q_heads=4, num_kv_heads=2, head_dim=64, capacity=128,
      dtype=jnp.float16)
  mask = np.tril(np.ones((tq, tq), bool))
  mask[1] = False
  out, lse = _check(q, k_cache, v_cache, jnp.zeros((2, 2, 0), jnp.int32),
                    jnp.zeros((2, 2), jnp.int32), jnp.array([100, 128], jnp.int32), k_new,
                    v_new, jnp.asarray(mask), block_size=64, config=SparseConfig(num_splits=2),
                    score_queries=(1,))
  assert np.all(np.isneginf(np.asarray(lse[:, 1])))
  assert np.all(np.asarray(out[:, 1], np.float32) == 0.0)


@pytest.mark.parametrize("tq", [11, 21])
def test_in_flight_tile_at_row_counts_the_tma_rejects_read_in_place(tq):
  """SmolLM2's heads (Hq 9, Hkv 3, D 64): one segment of Tq 11 / 21 (above 8, not a multiple of
  8; the TMA of k_new / v_new read in place failed to lower for cuda there, session 70) lowers
  to one cache kernel with the tile (zero rows up to a multiple of 8, `tma_rows`), and equals
  the reference in interpret mode."""
  q, k_cache, v_cache, k_new, v_new = _inputs(
      tq, batch=1, num_queries=tq, num_q_heads=9, num_kv_heads=3, head_dim=64, capacity=256,
      dtype=jnp.bfloat16)
  mask = jnp.asarray(np.tril(np.ones((tq, tq), bool)))
  tables = jnp.array([[[3, 0], [1, 2], [0, 0]]], jnp.int32)
  counts = jnp.array([[2, 2, 1]], jnp.int32)
  args = (q, k_cache, v_cache, tables, counts, jnp.array([200], jnp.int32), k_new, v_new, mask)
  text = cuda_text(lambda *a: sparse_attention(*a, block_size=64), *args)
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 1
  assert "inflight_attention" not in text
  _check(*args, block_size=64)


def test_in_kernel_tile_choice():
  """Where the cache kernel takes the in-flight keys: "auto", 2 <= Tq, one segment of one q
  block of plain blocks, k_new and v_new in q's dtype, and the tile's SMEM without a lost
  resident block (decode_attention's `tile_fits`); not with two segments, at Tq = 1, past 64
  rows, with another mode or dtype, with 64-key tiles at D = 128 or warp-specialized blocks.
  Lowered for cuda, the tiled call is one kernel (no in-flight kernel); the others keep it."""
  from pallas_kernels.sparse_attention import _layout, in_kernel_tile

  def tiled(tq=4, hq=4, sparse_queries=None, dtype=jnp.bfloat16, head_dim=64, block_size=64,
            config=SparseConfig(), interpret=INTERPRET, score_queries=0):
    q, k_cache, _, k_new, v_new = _inputs(0, batch=1, num_queries=tq, num_q_heads=hq,
                                          num_kv_heads=1, head_dim=head_dim,
                                          capacity=2 * block_size, dtype=jnp.bfloat16)
    sparse_queries = tq if sparse_queries is None else sparse_queries
    layout = _layout(q.shape, k_cache.shape, 2, block_size=block_size,
                     sparse_queries=sparse_queries, config=config,
                     num_score_queries=((score_queries, 0) if sparse_queries else
                                        (0, score_queries)),
                     interpret=interpret is not None)
    return in_kernel_tile(config, q, k_new.astype(dtype), v_new, layout, block_size)

  assert tiled() and tiled(sparse_queries=0) and tiled(tq=2) and tiled(tq=16)  # 16 x 4 = 64 rows
  assert tiled(score_queries=2)
  assert not tiled(sparse_queries=2)                             # two segments
  assert not tiled(tq=1)                                         # the Tq = 1 score path
  assert not tiled(tq=17)                                        # 68 rows: two q blocks
  assert not tiled(dtype=jnp.float32)
  for mode in ("kernel", "merged", "jnp"):
    assert not tiled(config=SparseConfig(inflight=mode))
  # D = 128: 128-key tiles (one block an SM) fit the tile; 64-key tiles (two an SM) take it
  # only in a launch of at most one thread block an SM (here 1 x 1 x 2 splits).
  assert tiled(head_dim=128, block_size=128)
  assert tiled(head_dim=128, block_size=64)
  assert tiled(head_dim=128, block_size=128, config=SparseConfig(block_kv=64))
  def launch(batch, listed, block_size=64, head_dim=128, hkv=8, capacity=16384):
    """(thread blocks, tiled?) of a Tq 16 call with G 4 (shapes only)."""
    q = jax.ShapeDtypeStruct((batch, 16, 4 * hkv, head_dim), jnp.bfloat16)
    kn = jax.ShapeDtypeStruct((batch, 16, hkv, head_dim), jnp.bfloat16)
    layout = _layout(q.shape, (batch, hkv, capacity, head_dim), listed, block_size=block_size,
                     sparse_queries=16, config=SparseConfig(), num_score_queries=(0, 0),
                     interpret=False)
    blocks = batch * hkv * layout[0][0].num_work
    return blocks, in_kernel_tile(SparseConfig(), q, kn, kn, layout, block_size)
  few, many = launch(1, 4), launch(8, 16)
  assert few[0] <= SM_COUNT < many[0]
  assert few[1] and not many[1]
  assert launch(8, 16, block_size=128)[1]                         # 128-key tiles: fits
  # Warp-specialized blocks take no tile (the GPU's choice; the interpreter runs plain blocks).
  assert not tiled(config=SparseConfig(warp_specialized=True), interpret=None)

  # The dispatch: one Mosaic GPU kernel where tiled, the in-flight kernel beside it elsewhere.
  args = _tile_case()
  text = lambda **kw: cuda_text(lambda *a: sparse_attention(*a, block_size=64, **kw), *args)
  for kw in ({}, dict(sparse_queries=0)):
    lowered = text(**kw)
    assert lowered.count("stablehlo.custom_call @mosaic_gpu_v2") == 1
    assert "inflight_attention" not in lowered and "stablehlo.dot_general" not in lowered
  for kw in (dict(sparse_queries=8), dict(config=SparseConfig(inflight="kernel"))):
    assert "inflight_attention" in text(**kw)
