"""The in-flight-part Mosaic GPU kernel against its jnp reference (GPU interpret mode, CPU), the
cache kernels' wrappers with the in-flight part in the kernel and in jnp, and lowering for cuda."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rand
from kernel_mode import INTERPRET
from pallas_kernels.decode_attention import (DecodeConfig, decode_attention,
                                             decode_attention_reference)
from pallas_kernels.combine import MERGE_MAX_SPLITS, MERGE_MIN_BLOCKS, inflight_merges
import pallas_kernels.inflight_attention as inflight_module
from pallas_kernels.inflight_attention import (BLOCK_M, InflightMask, MergeSegment,
                                               inflight_merged, inflight_partials,
                                               inflight_partials_reference, mask_bias,
                                               merge_chunks, merge_fold_width, merge_slots,
                                               merge_stat_rows, pack_keys, tile_lists)
from pallas_kernels.sparse_attention import (SparseConfig, sparse_attention,
                                             sparse_attention_reference)



def _rows(q, num_kv_heads):
  """q [B, T, Hq, D] -> q rows [B, Hkv, QB * 64, D] (r = t * G + g) and each row's query."""
  b, t, hq, d = q.shape
  g = hq // num_kv_heads
  n = t * g
  qb = -(-n // BLOCK_M)
  rows = q.reshape(b, t, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, n, d)
  rows = jnp.pad(rows, ((0, 0), (0, 0), (0, qb * BLOCK_M - n), (0, 0)))
  row_query = np.full(qb * BLOCK_M, -1)
  row_query[:n] = np.arange(n) // g
  return rows, row_query


# One compiled program per shape instead of an XLA compile per op of the eager reference.
_reference = jax.jit(inflight_partials_reference, static_argnames=("rows_out",))


def _case(seed, batch, num_kv_heads, group, tokens, head_dim, density, dtype):
  """density: the chance a query sees a key, or "causal"."""
  keys = jax.random.split(jax.random.key(seed), 4)
  normal = lambda k, shape: rand.normal(k, shape, dtype)
  q = normal(keys[0], (batch, tokens, num_kv_heads * group, head_dim))     # [B, T, Hq, D]
  k_new = normal(keys[1], (batch, tokens, num_kv_heads, head_dim))         # [B, T, Hkv, D]
  v_new = normal(keys[2], (batch, tokens, num_kv_heads, head_dim))         # [B, T, Hkv, D]
  if density == "causal":
    mask = np.tril(np.ones((tokens, tokens), bool))                         # [T, T]
  else:
    mask = np.asarray(rand.bernoulli(keys[3], density, (tokens, tokens)))   # [T, T]
  return q, k_new, v_new, mask


def _compare(got, ref, atol):
  for name, g, r in zip(("acc", "m", "l"), got, ref):
    g, r = np.asarray(g), np.asarray(r)
    assert g.shape == r.shape, name
    assert np.array_equal(np.isneginf(g), np.isneginf(r)), name
    np.testing.assert_allclose(np.where(np.isneginf(g), 0, g), np.where(np.isneginf(r), 0, r),
                               atol=atol, rtol=atol, err_msg=name)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16), batch=st.integers(1, 2), num_kv_heads=st.integers(1, 2),
       group=st.sampled_from([1, 3, 4]), tokens=st.integers(1, 90),
       head_dim=st.sampled_from([64, 128]), density=st.sampled_from([0.0, 0.3, 1.0, "causal"]),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float16]))
def test_kernel_matches_reference(seed, batch, num_kv_heads, group, tokens, head_dim, density,
                                  dtype):
  q, k_new, v_new, mask = _case(seed, batch, num_kv_heads, group, tokens, head_dim, density, dtype)
  q_rows, row_query = _rows(q, num_kv_heads)
  args = (q_rows, pack_keys(k_new), pack_keys(v_new), mask_bias(jnp.asarray(mask), row_query))
  rows_out = BLOCK_M if q_rows.shape[2] > BLOCK_M else -(-tokens * group // 8) * 8
  got = inflight_partials(*args, rows_out=rows_out, interpret=INTERPRET)
  ref = _reference(*args, rows_out=rows_out)
  # bf16: P is rounded to bf16 before PV, on the GPU from exp2.approx; an un-normalised sum that
  # cancels (|acc| ~ 0.04 out of terms ~ 1) moved by 0.022 on an H200 (seed 1268, T 82, G 3).
  _compare(got, ref, 3e-2 if dtype == jnp.bfloat16 else 4e-3)


@pytest.mark.parametrize("tokens,group,density", [(90, 1, "causal"), (70, 2, 1.0)])
def test_fully_seen_tiles_skip_the_bias(tokens, group, density):
  """Cases with fully seen (bias-free), partly seen and unseen tiles in one call."""
  q, k_new, v_new, mask = _case(5, 1, 2, group, tokens, 64, density, jnp.bfloat16)
  q_rows, row_query = _rows(q, 2)
  masks = mask_bias(jnp.asarray(mask), row_query)
  counts = np.asarray(masks.counts)
  assert counts[:, 0].max() >= 1 and (counts[:, 1] > counts[:, 0]).any()
  args = (q_rows, pack_keys(k_new), pack_keys(v_new), masks)
  _compare(inflight_partials(*args, rows_out=BLOCK_M, interpret=INTERPRET),
           _reference(*args, rows_out=BLOCK_M), 2e-2)


def test_rows_that_see_nothing_give_empty_partials():
  q, k_new, v_new, _ = _case(1, 1, 1, 4, 10, 64, 0.0, jnp.bfloat16)
  mask = np.tril(np.ones((10, 10), bool))
  mask[3] = False                                              # query 3 sees no in-flight key
  q_rows, row_query = _rows(q, 1)
  acc, m, l = inflight_partials(q_rows, pack_keys(k_new), pack_keys(v_new),
                                mask_bias(jnp.asarray(mask), row_query), rows_out=40,
                                interpret=INTERPRET)
  rows = np.arange(12, 16)                                     # query 3's four heads
  assert np.all(np.isneginf(np.asarray(m)[0, 0, 0, rows]))
  assert np.all(np.asarray(l)[0, 0, 0, rows] == 0) and np.all(np.asarray(acc)[0, 0, 0, rows] == 0)
  assert np.all(np.asarray(l)[0, 0, 0, :12] > 0)
  # Padding rows (40 of them past the 10 queries x 4 heads) see every real key: never read, and
  # so they never force a bias on a tile every query sees.
  assert np.all(np.isfinite(np.asarray(m)[0, 0, 0, 40:]))


def test_tile_lists_visit_seen_tiles_fully_seen_first():
  """Causal at T = 256 with G = 4 (16 queries a q block): q block j sees tiles 0 ..
  (16 j + 15) // 64, all of them fully but the last (the diagonal's)."""
  row_query = np.repeat(np.arange(256), 4)
  mask = mask_bias(jnp.asarray(np.tril(np.ones((256, 256), bool))), row_query)
  tiles, counts = np.asarray(mask.tiles), np.asarray(mask.counts)
  for j in range(16):
    last = (16 * j + 15) // 64
    assert tuple(counts[j]) == (last, last + 1), j
    assert list(tiles[j, :last + 1]) == list(range(last + 1)), j
  assert counts[:, 1].sum() == 40 and counts[:, 0].sum() == 24
  # A row block that sees nothing visits nothing; jnp and a traced mask agree.
  bias = np.zeros((128, 128), np.float32)
  bias[:64] = -np.inf
  bias[64:, 64:70] = -np.inf
  tiles, counts = jax.jit(tile_lists)(jnp.asarray(bias))
  assert np.asarray(counts).tolist() == [[0, 0], [1, 2]]
  assert np.asarray(tiles)[1].tolist() == [0, 1]


def test_a_fully_seen_tile_after_a_partly_seen_one_is_listed_first():
  """Keys 0..63 partly seen (query 5 does not see key 3), keys 64..127 seen by every query: the
  list must put tile 1 first (counts (1, 2): the kernel skips the bias on the first count[0]
  tiles), not keep index order, where tile 0 read without its bias let query 5 see key 3. The
  kernel's partials equal the reference's."""
  mask = np.ones((128, 128), bool)
  mask[5, 3] = False
  q, k_new, v_new, _ = _case(7, 1, 1, 1, 128, 64, 1.0, jnp.bfloat16)
  q_rows, row_query = _rows(q, 1)
  masks = mask_bias(jnp.asarray(mask), row_query)
  assert np.asarray(masks.counts).tolist() == [[1, 2], [2, 2]]
  assert np.asarray(masks.tiles).tolist() == [[1, 0], [0, 1]]
  args = (q_rows, pack_keys(k_new), pack_keys(v_new), masks)
  _compare(inflight_partials(*args, rows_out=BLOCK_M, interpret=INTERPRET),
           _reference(*args, rows_out=BLOCK_M), 2e-2)


@pytest.mark.parametrize("num_queries", [1, 7])
@pytest.mark.parametrize("inflight", ["merged", "kernel", "jnp"])
def test_wrappers_match_reference_with_either_inflight_path(num_queries, inflight):
  """decode_attention and sparse_attention (a listed segment, then a full one) give the
  reference's output with the in-flight part in the kernel (merging the splits itself, or
  leaving a partial for the combine) or in jnp, at Tq = 1 and Tq > 1."""
  b, hkv, g, d, s = 1, 2, 2, 64, 256
  q, k_new, v_new, _ = _case(2, b, hkv, g, num_queries, d, 0.0, jnp.bfloat16)
  keys = jax.random.split(jax.random.key(3), 2)
  k_cache = rand.normal(keys[0], (b, hkv, s, d), jnp.bfloat16)
  v_cache = rand.normal(keys[1], (b, hkv, s, d), jnp.bfloat16)
  lengths = jnp.array([200])
  mask = jnp.asarray(np.tril(np.ones((num_queries, num_queries), bool)))
  out = decode_attention(q, k_cache, v_cache, lengths, k_new, v_new, mask,
                         config=DecodeConfig(block_kv=64, inflight=inflight), interpret=INTERPRET)
  ref = decode_attention_reference(q, k_cache, v_cache, lengths, k_new, v_new, mask)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2)

  tables = jnp.array([[[0, 3], [1, 2]]], jnp.int32)                 # [B, Hkv, NB]
  counts = jnp.array([[2, 1]], jnp.int32)
  sparse = max(1, num_queries // 2)
  out = sparse_attention(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, mask,
                         block_size=64, sparse_queries=sparse,
                         config=SparseConfig(inflight=inflight), interpret=INTERPRET)
  ref = sparse_attention_reference(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new,
                                   mask, block_size=64, sparse_queries=sparse)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2)


_sparse_reference = jax.jit(sparse_attention_reference,
                            static_argnames=("block_size", "sparse_queries", "return_lse",
                                             "score_queries"))


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16), batch=st.integers(1, 2), group=st.sampled_from([1, 2, 3, 4]),
       tokens=st.integers(2, 40), sparse_frac=st.sampled_from([0.0, 0.5, 1.0]),
       splits=st.integers(1, 3), selected=st.booleans())
def test_merged_inflight_matches_the_combine_and_the_reference(seed, batch, group, tokens,
                                                               sparse_frac, splits, selected):
  """The in-flight kernel that merges the split partials and writes the output (both layouts:
  G dividing 64 writes [B, T, Hq, D] itself, G = 3 its rows), against the in-flight partial plus
  the combine on the same partials, and against the reference: one or two segments, 1-3 splits
  each, rows that see no in-flight key, lse and probs."""
  hkv, d, s, bs = 2, 64, 512, 64
  q, k_new, v_new, mask = _case(seed, batch, hkv, group, tokens, d, "causal", jnp.bfloat16)
  mask[tokens // 2] = False                        # a query that sees no in-flight key
  keys = jax.random.split(jax.random.key(seed + 1), 3)
  k_cache = rand.normal(keys[0], (batch, hkv, s, d), jnp.bfloat16)
  v_cache = rand.normal(keys[1], (batch, hkv, s, d), jnp.bfloat16)
  lengths = jnp.array([s - 61 * i for i in range(batch)], jnp.int32)
  tables = jnp.asarray(np.random.default_rng(seed).integers(0, s // bs, (batch, hkv, 3)),
                       jnp.int32)
  counts = jnp.asarray(np.random.default_rng(seed + 1).integers(0, 4, (batch, hkv)), jnp.int32)
  sparse = int(tokens * sparse_frac)
  score = (0, tokens - 1) if selected else ()
  args = (q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, jnp.asarray(mask))
  kw = dict(block_size=bs, sparse_queries=sparse, return_lse=True, score_queries=score)
  got, combined = (sparse_attention(*args, **kw, config=SparseConfig(
      inflight=mode, num_splits=splits, num_splits_full=splits), interpret=INTERPRET)
      for mode in ("merged", "kernel"))
  ref = _sparse_reference(*(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x
                           for x in args), **kw)     # XLA:CPU has no bf16 x bf16 -> fp32 dot
  for name, g, c, r in zip(("out", "lse", "probs"), got, combined, ref):
    g, c, r = (np.asarray(x, np.float32) for x in (g, c, r))
    np.testing.assert_allclose(g, c, atol=1e-2 if name == "out" else 1e-5, err_msg=name)
    np.testing.assert_allclose(g, r, atol=3e-2 if name == "out" else 2e-3, err_msg=name)


# The merge constants (MERGE_FILL_BLOCKS, MERGE_MAX_SLOTS, MERGE_STATS_ONCE) a test patches, as a
# jit cache key: a trace under other values is not reused (no process-wide jax.clear_caches()).
_MERGE_CONSTANTS = jax.make_user_context(None)


def test_merged_columns_split_over_blocks_give_the_same_output(monkeypatch):
  """A merged launch with few blocks splits each q block's D columns over 2, 4 or 8 blocks
  (`merge_chunks`) and folds the partials through a ring of `merge_slots` slots: D = 128, the
  direct output write (G = 4; the rows' layout in 2 chunks is in the hypothesis test above, G = 3
  at D = 64), a segment of 2 splits and one of 6 (more than the 2, 3 or 4 slots of some rings, so
  they wrap, folding 1 or 2 partials a step; 4 a step in the 8-slot rings), m and l fetched once
  per q block or with each partial. Every split gives the unsplit output and lse to rounding (the
  fold's fp32 sums run in another order, so a bf16 output may move by an ulp), and all equal the
  reference."""
  batch, hkv, group, d, s, bs, tokens = 1, 2, 4, 128, 384, 64, 20
  q, k_new, v_new, mask = _case(5, batch, hkv, group, tokens, d, "causal", jnp.bfloat16)
  keys = jax.random.split(jax.random.key(6), 2)
  k_cache = rand.normal(keys[0], (batch, hkv, s, d), jnp.bfloat16)
  v_cache = rand.normal(keys[1], (batch, hkv, s, d), jnp.bfloat16)
  lengths = jnp.array([s - 37], jnp.int32)
  tables = jnp.array([[[0, 2], [3, 1]]], jnp.int32)
  counts = jnp.array([[2, 1]], jnp.int32)
  args = (q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, jnp.asarray(mask))
  kw = dict(block_size=bs, sparse_queries=tokens // 2, return_lse=True)
  blocks = batch * hkv * 2                       # 10 * G rows per segment: one q block each
  results = {}
  # The last run's full segment has 1 split, fewer than the sparse one's 2: its block's m / l box
  # (2 rows, `merge_stat_rows`) would run past the items, so it starts one row early.
  # One run fetches m and l with each partial (MERGE_STATS_ONCE off: the path of > 128 splits).
  for fill, max_slots, full_splits, once in (
      (0, 8, 6, 1), (2 * blocks, 8, 6, 1), (4 * blocks, 8, 6, 1), (8 * blocks, 8, 6, 1),
      (8 * blocks, 3, 6, 1), (8 * blocks, 8, 1, 1), (8 * blocks, 8, 6, 0)):
    monkeypatch.setattr(inflight_module, "MERGE_FILL_BLOCKS", fill)
    monkeypatch.setattr(inflight_module, "MERGE_MAX_SLOTS", max_slots)
    monkeypatch.setattr(inflight_module, "MERGE_STATS_ONCE", once)
    chunks = merge_chunks(blocks, d, group)
    slots = merge_slots(d // chunks)
    # The constants are read at trace time: keyed into every jit cache, each run traces anew.
    with _MERGE_CONSTANTS((fill, max_slots, once)):
      results[chunks, slots, full_splits, once] = [
          np.asarray(x, np.float32) for x in sparse_attention(
              *args, **kw, config=SparseConfig(inflight="merged", num_splits=2,
                                               num_splits_full=full_splits), interpret=INTERPRET)]
  assert sorted(results) == [(1, 2, 6, 1), (2, 4, 6, 1), (4, 8, 6, 1), (8, 3, 6, 1),
                             (8, 8, 1, 1), (8, 8, 6, 0), (8, 8, 6, 1)]
  ref = _sparse_reference(*(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x
                           for x in args), **kw)
  for key, (out, lse) in results.items():
    if key[2] == 6:                                # the same splits as the unsplit run
      np.testing.assert_allclose(out, results[1, 2, 6, 1][0], rtol=1e-2, atol=1e-5,
                                 err_msg=f"{key}")
      np.testing.assert_allclose(lse, results[1, 2, 6, 1][1], atol=1e-5, err_msg=f"{key}")
    np.testing.assert_allclose(out, np.asarray(ref[0]), atol=3e-2)
    np.testing.assert_allclose(lse, np.asarray(ref[1]), atol=2e-3)


def test_merged_fold_max_covers_every_partial_of_a_step():
  """The merged epilogue folds several split partials a step (`merge_fold_width`): the step's
  max is over all of them. Split 3 of 4 holds a cache key 12 q (a score ~96, i.e. ~138 log2
  units, above the rest), folded in the same step as split 0: weighed against split 0's max
  alone it overflowed exp2 (inf, then NaN); random partials are too close for it to show."""
  tq, g, d, s = 4, 4, 64, 256
  q, k_new, v_new, mask = _case(8, 1, 1, g, tq, d, "causal", jnp.bfloat16)
  keys = jax.random.split(jax.random.key(9), 2)
  k_cache = rand.normal(keys[0], (1, 1, s, d), jnp.bfloat16)
  v_cache = rand.normal(keys[1], (1, 1, s, d), jnp.bfloat16)
  k_cache = k_cache.at[0, 0, 200].set((12 * q[0, 0, 0].astype(jnp.float32)).astype(jnp.bfloat16))
  lengths, mask = jnp.array([s], jnp.int32), jnp.asarray(mask)
  out, lse = decode_attention(q, k_cache, v_cache, lengths, k_new, v_new, mask, return_lse=True,
                              config=DecodeConfig(block_kv=64, num_splits=4, inflight="merged"),
                              interpret=INTERPRET)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  ref_out, ref_lse = decode_attention_reference(f32(q), f32(k_cache), f32(v_cache), lengths,
                                                f32(k_new), f32(v_new), mask, return_lse=True)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out), atol=3e-2)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-3, rtol=1e-4)


def test_merged_segments_take_any_sequence():
  """inflight_merged's segments as a list (of MergeSegment or of 6-tuples) equal the tuple (a
  list raised JAX's 'Non-hashable static arguments are not supported'); none is refused by name
  (was an IndexError)."""
  q, k_new, v_new, mask = _case(1, 1, 1, 2, 5, 64, "causal", jnp.bfloat16)
  q_rows, row_query = _rows(q, 1)
  bias = mask_bias(jnp.asarray(mask), row_query)
  keys = jax.random.split(jax.random.key(2), 2)
  acc = rand.normal(keys[0], (1, 1, 2, 16, 64))
  m2 = rand.normal(keys[1], (1, 1, 2, 64))
  l = jnp.ones((1, 1, 2, 64), jnp.float32)
  call = lambda segments: inflight_merged(q_rows, pack_keys(k_new), pack_keys(v_new), bias, acc,
                                          m2, l, group=2, segments=segments, interpret=INTERPRET)
  segment = MergeSegment(0, 1, 0, 2, 0, 5)
  out, lse = call((segment,))
  for segments in ([segment], [tuple(segment)]):
    got_out, got_lse = call(segments)
    np.testing.assert_array_equal(np.asarray(got_out), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(lse))
  with pytest.raises(ValueError, match="segments must be a non-empty sequence"):
    call(())
  with pytest.raises(ValueError, match=r"group must be >= 1 \(an int\), got 0"):
    inflight_merged(q_rows, pack_keys(k_new), pack_keys(v_new), bias, acc, m2, l, group=0,
                    segments=(segment,), interpret=INTERPRET)


def test_merge_chunks_fill_the_gpu_with_at_least_16_columns_a_block():
  assert merge_chunks(8, 128, 4) == 8 and merge_chunks(18, 64, 3) == 4
  assert merge_chunks(64, 128, 4) == 2 and merge_chunks(40, 128, 4) == 2
  assert merge_chunks(144, 128, 4) == 1 and merge_chunks(65, 128, 4) == 1
  assert merge_chunks(8, 32, 4) == 2 and merge_chunks(8, 16, 4) == 1   # >= 16 columns a block
  # The direct write's [G, D / chunks] boxes start 128-byte aligned: G = 1 at D = 64 cannot split
  # (a GPU fault, not an interpreter one), G = 1 at D = 128 splits in 2, G = 2 at D = 128 in 4.
  assert merge_chunks(8, 64, 1) == 1 and merge_chunks(8, 128, 1) == 2
  assert merge_chunks(8, 128, 2) == 4 and merge_chunks(8, 64, 3) == 4   # G = 3: the rows' layout


def test_merge_ring_holds_64_kib_of_partials_in_2_to_8_slots_folded_half_a_ring_a_step():
  assert [merge_slots(c) for c in (128, 64, 32, 16)] == [2, 4, 8, 8]
  assert merge_slots(256) == 2                        # never fewer than 2
  assert [merge_fold_width(n) for n in (2, 3, 4, 8)] == [1, 1, 2, 4]
  seg = lambda splits: MergeSegment(0, 1, 0, splits, 0, 16)
  assert merge_stat_rows((seg(2), seg(6))) == 6       # m and l: one box of the most splits
  assert merge_stat_rows((seg(128),)) == 128 and merge_stat_rows((seg(129),)) == 0   # SMEM cap


def test_auto_merges_in_the_inflight_kernel_by_splits_blocks_and_layout():
  many, few = MERGE_MIN_BLOCKS, MERGE_MIN_BLOCKS - 1
  auto = lambda tq, splits, blocks, group, chunked=True: inflight_merges(
      "auto", tq, splits, blocks, group, chunked)
  assert not auto(1, 1, many, 4)                     # Tq = 1: jnp in the combine
  assert auto(16, MERGE_MAX_SPLITS, many, 4) and auto(16, MERGE_MAX_SPLITS, many, 3)
  assert not auto(16, MERGE_MAX_SPLITS + 1, many, 4)
  # Small launches (D split over blocks): merged where the kernel writes [B, T, Hq, D] itself or
  # the splits are many; the rows' layout (G = 3) with few splits stays with the combine, and so
  # does a small launch that cannot split D (G = 1 at D = 64).
  assert auto(16, 1, few, 4) and auto(16, 33, few, 4)
  assert auto(109, 16, 18, 3)                        # SmolLM2's FAFO call
  assert not auto(108, MERGE_MAX_SPLITS, 18, 3)      # its Lookahead call
  assert not auto(16, 33, few, 1, chunked=merge_chunks(few, 64, 1) > 1)
  assert inflight_merges("merged", 2, 64, 1, 3, False)
  assert not inflight_merges("kernel", 16, 1, many, 4, True)
  assert not inflight_merges("jnp", 16, 1, many, 4, True)


def test_bad_inputs_are_rejected_in_plain_words():
  q, k_new, v_new, mask = _case(0, 1, 1, 2, 5, 64, 1.0, jnp.bfloat16)
  q_rows, row_query = _rows(q, 1)
  bias = mask_bias(jnp.asarray(mask), row_query)
  # A row's query past T read query T - 1's mask row, silently; one below -1 was padding; rows
  # not whole q blocks were a reshape TypeError.
  for bad in (np.where(row_query == 4, 5, row_query), np.where(row_query == 4, -2, row_query),
              row_query[:60]):
    with pytest.raises(ValueError, match="row_query must be"):
      mask_bias(jnp.asarray(mask), bad)
  with pytest.raises(ValueError, match="rows_out"):
    inflight_partials(q_rows, pack_keys(k_new), pack_keys(v_new), bias, rows_out=12)
  with pytest.raises(ValueError, match="bias must be"):
    inflight_partials(q_rows, pack_keys(k_new), pack_keys(v_new),
                      bias._replace(bias=bias.bias[:, :32]), rows_out=16)
  with pytest.raises(ValueError, match="tiles / counts"):
    inflight_partials(q_rows, pack_keys(k_new), pack_keys(v_new),
                      bias._replace(counts=bias.counts[:, :1]), rows_out=16)
  with pytest.raises(ValueError, match="k_rows / v_rows"):
    inflight_partials(q_rows, pack_keys(k_new)[:, :, :, :32], pack_keys(v_new), bias, rows_out=16)
  # Head dims the kernel cannot tile: D = 96 was a bare AssertionError, D = 320 passed (past the
  # wgmma's N <= 256).
  for d in (96, 320):
    wide = lambda x: jnp.zeros(x.shape[:3] + (d,), x.dtype)  # noqa: E731
    with pytest.raises(ValueError, match=f"head dim D={d} must be a multiple of 64 in"):
      inflight_partials(wide(q_rows), wide(pack_keys(k_new)), wide(pack_keys(v_new)), bias,
                        rows_out=16, interpret=INTERPRET)
  # The [T, T] bool mask itself: was 'not enough values to unpack' (or a bias shape error for
  # T = 3); keys in another dtype than q: Mosaic's 'Expected dtypes to match'; fp32 q rows ran
  # in the interpreter.
  with pytest.raises(ValueError, match="mask must be an InflightMask"):
    inflight_partials(q_rows, pack_keys(k_new), pack_keys(v_new), jnp.asarray(mask),
                      rows_out=16)
  with pytest.raises(ValueError, match="k_rows and v_rows must be in q_rows' dtype"):
    inflight_partials(q_rows, pack_keys(k_new).astype(jnp.float32),
                      pack_keys(v_new).astype(jnp.float32), bias, rows_out=16)
  with pytest.raises(ValueError, match="q_rows must be bfloat16 or float16, got float32"):
    f32 = lambda x: x.astype(jnp.float32)
    inflight_partials(f32(q_rows), f32(pack_keys(k_new)), f32(pack_keys(v_new)), bias,
                      rows_out=16)
  with pytest.raises(ValueError, match="mask bias, tiles and counts must be bfloat16"):
    inflight_partials(q_rows, pack_keys(k_new), pack_keys(v_new),
                      bias._replace(bias=bias.bias.astype(jnp.float32)), rows_out=16)
  # 0 stages ran as 1; a group of 0 divided by zero.
  with pytest.raises(ValueError, match=r"num_stages must be >= 1 \(an int\), got 0"):
    inflight_partials(q_rows, pack_keys(k_new), pack_keys(v_new), bias, rows_out=16,
                      num_stages=0)
  acc = jnp.zeros((1, 1, 2, 16, 64), jnp.float32)
  ml = jnp.zeros((1, 1, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="must cover the 1 q blocks"):
    inflight_merged(q_rows, pack_keys(k_new), pack_keys(v_new), bias, acc, ml, ml, group=2,
                    segments=(MergeSegment(0, 1, 0, 3, 0, 5),))    # items 0..2 of 2
  with pytest.raises(ValueError, match="must be float32"):
    inflight_merged(q_rows, pack_keys(k_new), pack_keys(v_new), bias,
                    acc.astype(jnp.bfloat16), ml, ml, group=2,
                    segments=(MergeSegment(0, 1, 0, 2, 0, 5),))
  with pytest.raises(ValueError, match="m2 and l"):
    inflight_merged(q_rows, pack_keys(k_new), pack_keys(v_new), bias, acc, ml[..., :32], ml,
                    group=2, segments=(MergeSegment(0, 1, 0, 2, 0, 5),))
  with pytest.raises(ValueError, match="d_chunks must be"):
    inflight_merged(q_rows, pack_keys(k_new), pack_keys(v_new), bias, acc, ml, ml, group=2,
                    segments=(MergeSegment(0, 1, 0, 2, 0, 5),), d_chunks=4)   # D = 64
  with pytest.raises(ValueError, match="multiple of 128 bytes"):
    g1 = _case(0, 1, 1, 1, 5, 64, 1.0, jnp.bfloat16)
    q1_rows, row_query1 = _rows(g1[0], 1)
    inflight_merged(q1_rows, pack_keys(g1[1]), pack_keys(g1[2]),
                    mask_bias(jnp.asarray(g1[3]), row_query1), acc, ml, ml, group=1,
                    segments=(MergeSegment(0, 1, 0, 2, 0, 5),), d_chunks=2)
  with pytest.raises(ValueError, match="inflight must be one of"):
    DecodeConfig(inflight="sometimes")
  with pytest.raises(ValueError, match="inflight must be one of"):
    SparseConfig(inflight="never")
  # d_chunks an int (2.0 or np.int64(2) passed chunks_fit's 'in' and failed on a bare
  # AssertionError).
  with pytest.raises(ValueError, match="d_chunks must be >= 1 \\(an int\\) or None, got 2.0"):
    inflight_merged(q_rows, pack_keys(k_new), pack_keys(v_new), bias, acc, ml, ml, group=2,
                    segments=(MergeSegment(0, 1, 0, 2, 0, 5),), d_chunks=2.0)


@pytest.mark.parametrize("tokens,num_kv_heads,group,head_dim", [
    (109, 3, 3, 64),      # a SmolLM2 FAFO step (20 subsequences, k = 4, 7 candidates)
    (283, 8, 4, 128),     # a Llama-3.1-8B FAFO step (40 subsequences, k = 6, 7 candidates)
])
def test_lowers_to_mosaic_gpu_custom_call_for_cuda(tokens, num_kv_heads, group, head_dim):
  q_rows_n = -(-tokens * group // BLOCK_M) * BLOCK_M
  u_pad = -(-tokens // 64) * 64
  sds = jax.ShapeDtypeStruct
  args = (sds((1, num_kv_heads, q_rows_n, head_dim), jnp.bfloat16),
          sds((1, num_kv_heads, u_pad, head_dim), jnp.bfloat16),
          sds((1, num_kv_heads, u_pad, head_dim), jnp.bfloat16),
          InflightMask(sds((q_rows_n, u_pad), jnp.bfloat16),
                       sds((q_rows_n // BLOCK_M, u_pad // 64), jnp.int32),
                       sds((q_rows_n // BLOCK_M, 2), jnp.int32)))
  lowered = jax.jit(lambda *a: inflight_partials(*a, rows_out=BLOCK_M)).trace(*args).lower(
      lowering_platforms=("cuda",))
  assert "stablehlo.custom_call @mosaic_gpu_v2" in lowered.as_text()
  # The merged form (G = 3 writes its rows, G = 4 the [B, T, Hq, D] output), two segments of
  # 2 and 1 splits as FAFO's call has them.
  q_blocks = q_rows_n // BLOCK_M
  first = q_blocks // 2
  fumble = first * BLOCK_M // group
  segments = (MergeSegment(0, first, 0, 2, 0, fumble),
              MergeSegment(first, q_blocks - first, 2 * first, 1, fumble, tokens - fumble))
  items = 2 * first + q_blocks - first
  partials = (sds((1, num_kv_heads, items, BLOCK_M, head_dim), jnp.float32),
              sds((1, num_kv_heads, items, BLOCK_M), jnp.float32),
              sds((1, num_kv_heads, items, BLOCK_M), jnp.float32))
  for d_chunks in (1, 2, 4, 8)[:head_dim // 32]:    # D split over 1, 2, 4 (and 8) blocks
    lowered = jax.jit(lambda *a, c=d_chunks: inflight_merged(
        *a, segments=segments, group=group, d_chunks=c)).trace(*args, *partials).lower(
            lowering_platforms=("cuda",))
    assert "stablehlo.custom_call @mosaic_gpu_v2" in lowered.as_text()


def test_wrappers_with_fafo_and_lookahead_masks_match_reference():
  """The methods' own masks past one tile (T = 109 / 108: SmolLM2's FAFO and Lookahead steps),
  where the kernel visits tile lists with unseen, partly and fully seen tiles: sparse_attention
  (fumble queries on a list, the rest on the full cache) and decode_attention equal their
  references."""
  from sparsedec.decode.fafo import fafo_layout
  from sparsedec.decode.lookahead import lookahead_layout
  b, hkv, g, d, s = 1, 2, 2, 64, 256
  keys = jax.random.split(jax.random.key(7), 2)
  k_cache = rand.normal(keys[0], (b, hkv, s, d), jnp.bfloat16)
  v_cache = rand.normal(keys[1], (b, hkv, s, d), jnp.bfloat16)
  lengths = jnp.array([150])
  fafo_mask = jnp.asarray(fafo_layout(20, 4, 7)[0])
  q, k_new, v_new, _ = _case(8, b, hkv, g, fafo_mask.shape[0], d, 0.0, jnp.bfloat16)
  tables = jnp.array([[[0, 2], [1, 2]]], jnp.int32)
  counts = jnp.array([[2, 2]], jnp.int32)
  out = sparse_attention(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new, fafo_mask,
                         block_size=64, sparse_queries=80, interpret=INTERPRET)
  ref = sparse_attention_reference(q, k_cache, v_cache, tables, counts, lengths, k_new, v_new,
                                   fafo_mask, block_size=64, sparse_queries=80)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2)
  la_mask = jnp.asarray(lookahead_layout(20, 5, 7)[0])
  q, k_new, v_new, _ = _case(9, b, hkv, g, la_mask.shape[0], d, 0.0, jnp.bfloat16)
  out = decode_attention(q, k_cache, v_cache, lengths, k_new, v_new, la_mask,
                         interpret=INTERPRET)
  ref = decode_attention_reference(q, k_cache, v_cache, lengths, k_new, v_new, la_mask)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2)
