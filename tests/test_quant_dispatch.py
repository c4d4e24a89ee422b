"""QuantView segments dispatched to `pallas_kernels.quant_attention` (kernel in the Mosaic GPU
interpreter on the CPU) against the jnp reference `_quant_view_attention`: attention outputs
(4-bit draft with its in-flight scratch, 8-bit verification windows crossing a flush, rows
with an empty quantized prefix), QuantSpec greedy generation, and the configurations the kernel
does not serve (refused by name when forced, the reference in "auto"). Then the W4A16 draft
weight layouts (quant_weights.LAYOUTS): the same quantized weight, the same logits, and draft /
verification forwards that lower for cuda with the kernel in them."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rand
import sparsedec
from kernel_mode import KERNEL  # the compiled kernel on a GPU, the interpreter on the CPU
from sparsedec.attention import (AttentionPlan, FullView, QuantView, Segment, attend, causal_plan,
                                 kernel_choice)
from sparsedec.decode.quantspec import QuantSpec
from sparsedec.errors import UnsupportedConfigError
from sparsedec.kv import quantized as qkv
from sparsedec.kv.dense import KVCache, init_cache
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.linear import linear
from sparsedec.model import quant_weights
from sparsedec.model.params import cast_params, init_random
from sparsedec.model.quant_weights import (params_to_layout, quantize_params, quantize_weight,
                                           weights_bytes)

G, CAP, B, HQ, HKV, D, T = 64, 256, 3, 4, 2, 64, 5
# Row 0: quant_len 64, positions 190..194 cross the next flush (quantized_length(193) = 128), so
# its last queries read CF1 re-quantized; row 1: quant_len 64, no crossing; row 2: nothing
# quantized yet (the kernel's share is empty).
LENGTHS = (190, 140, 50)

# head_dim 64, bf16: what quant_attention takes (stories260K, fp32 with head_dim 8, does not).
KERNEL_SHAPED = ModelConfig(family="llama", vocab_size=61, hidden_size=128, intermediate_size=128,
                            num_layers=1, num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                            max_position_embeddings=1024, dtype="bfloat16")


def _bf16_normal(key, shape, scale=1.0):
  return (scale * rand.normal(key, shape)).astype(jnp.bfloat16)


@pytest.fixture(scope="module")
def window():
  """A quantized cache of one layer (bf16 K/V, G = 64) and a T-token window after it."""
  ks = jax.random.split(jax.random.key(0), 6)
  lengths = jnp.asarray(LENGTHS, jnp.int32)
  dense = KVCache(k=(_bf16_normal(ks[0], (B, HKV, CAP, D)),),
                  v=(_bf16_normal(ks[1], (B, HKV, CAP, D)),), lengths=lengths)
  qc = jax.jit(qkv.from_dense, static_argnums=1)(dense, G)
  np.testing.assert_array_equal(np.asarray(qc.quant_len), [64, 64, 0])
  q = _bf16_normal(ks[2], (B, T, HQ, D), 2.0)
  k_new = _bf16_normal(ks[3], (B, T, HKV, D))
  v_new = _bf16_normal(ks[4], (B, T, HKV, D))
  extra = _bf16_normal(ks[5], (2, B, T, HKV, D))
  return qc, q, k_new, v_new, lengths, extra


def _attend(impl, qc, q, k_new, v_new, q_pos, view_kw, bits, t):
  view = QuantView(qc, bits=bits, **view_kw)
  plan = AttentionPlan(causal_plan(t).inflight_mask, (Segment(view, 0, t),)).at_layer(0)
  empty = qc.buf_k[0][:, :, :0]                   # QuantSpec's int8 mode: no dense cache
  lengths = qc.lengths
  return attend(q, empty, empty, lengths, k_new, v_new, q_pos, plan, impl=impl)


def _close(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  # bf16 outputs of size ~2: the kernel's share is rounded to bf16 once more before the merge.
  np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
  return np.abs(want).max()


@pytest.mark.parametrize("bits", [8, 4])
def test_verification_window_across_a_flush_equals_reference(window, bits):
  qc, q, k_new, v_new, lengths, _ = window
  q_pos = lengths[:, None] + jnp.arange(T)[None]
  run = jax.jit(_attend, static_argnums=(0, 7, 8))
  want = run("reference", qc, q, k_new, v_new, q_pos, {}, bits, T)
  got = run(KERNEL, qc, q, k_new, v_new, q_pos, {}, bits, T)
  assert _close(got, want) > 0.5
  # The flush rule matters here: the same queries without it (all at the window's first
  # position) read CF1 in full precision, and only row 0's last queries change; at 4 bits by
  # much more than the kernel's error.
  flat = run("reference", qc, q, k_new, v_new, jnp.broadcast_to(lengths[:, None], (B, T)), {},
             bits, T)
  moved = np.abs(np.asarray(flat, np.float32) - np.asarray(want, np.float32))
  assert moved[1:].max() == 0 and moved[0, 3:].max() > 0
  err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))[0, 3:].max()
  if bits == 4:
    assert moved[0, 3:].max() > 4 * err


def test_draft_token_with_in_flight_scratch_equals_reference(window):
  """The draft's 4-bit read: one token at position N + 3 with draft K/V of N .. N + 2 in the
  `extra` scratch (W = T slots, 3 valid); row 0 crosses the flush there too."""
  qc, q, k_new, v_new, lengths, extra = window
  view_kw = dict(extra_k=(extra[0],), extra_v=(extra[1],),
                 extra_len=jnp.full((B,), 3, jnp.int32))
  q_pos = lengths[:, None] + 3
  run = jax.jit(_attend, static_argnums=(0, 7, 8))
  args = (qc, q[:, :1], k_new[:, :1], v_new[:, :1], q_pos)
  want = run("reference", *args, view_kw, 4, 1)
  got = run(KERNEL, *args, view_kw, 4, 1)
  _close(got, want)
  without = run("reference", *args, {}, 4, 1)
  assert np.abs(np.asarray(without, np.float32) - np.asarray(want, np.float32)).max() > 5e-2


def test_a_quant_views_extra_arrays_are_checked_by_name(window):
  """The reference broadcast a batch-1 scratch or a [1] extra_len over B rows silently."""
  qc, q, k_new, v_new, lengths, extra = window
  q_pos = lengths[:, None] + 3
  args = (qc, q[:, :1], k_new[:, :1], v_new[:, :1], q_pos)
  ok_len = jnp.full((B,), 3, jnp.int32)
  cases = [(dict(extra_k=(extra[0][:1],), extra_v=(extra[1][:1],), extra_len=ok_len),
            r"extra_k must be \[B=3, W, Hkv=2, D=64\]"),
           (dict(extra_k=(extra[0],), extra_v=(extra[1][:, :2],), extra_len=ok_len),
            r"extra_v must be \[B=3, W, Hkv=2, D=64\] \(k and v alike\)"),
           (dict(extra_k=(extra[0],), extra_v=(extra[1],), extra_len=ok_len[:1]),
            r"extra_len must be \[B=3\] integer"),
           (dict(extra_k=(extra[0],), extra_v=(extra[1],), extra_len=ok_len + 0.5),
            r"extra_len must be \[B=3\] integer")]
  for view_kw, needle in cases:
    for impl in ("reference", KERNEL):
      with pytest.raises(ValueError, match=needle):
        _attend(impl, *args, view_kw, 4, 1)


def test_the_drafts_view_bf16_tail_and_stacked_scratch_equal_the_fp32_reference(window):
  """QuantSpec's draft view (`draft_view`: the tail precomputed in the cache's bf16) with the
  scratch stacked over layers ([L, B, W, Hkv, D], `write_draft_kv`) reads, through the kernel,
  what the fp32 reference reads from per-layer tuples; the stacked scratch is the tuple one."""
  from sparsedec.decode.quantspec import draft_view, write_draft_kv
  qc, q, k_new, v_new, lengths, extra = window
  base = draft_view(qc)
  assert base.tail_k[0].dtype == jnp.bfloat16 and base.tail_bits == 4
  stacked_k = write_draft_kv(jnp.zeros((1,) + extra[0].shape, extra.dtype), (extra[0],), 0)
  stacked_v = write_draft_kv(jnp.zeros((1,) + extra[1].shape, extra.dtype), (extra[1],), 0)
  np.testing.assert_array_equal(np.asarray(stacked_k[0, :, :1], np.float32),
                                np.asarray(extra[0][:, :1], np.float32))
  # Slots 1.. of the stacked scratch are zeros, not extra's: only slot 0 is valid (extra_len 1).
  extra_len = jnp.ones((B,), jnp.int32)
  q_pos = lengths[:, None] + 1
  args = (q[:, :1], k_new[:, :1], v_new[:, :1], q_pos)

  @jax.jit
  def run(view, q, k_new, v_new, q_pos, impl_kernel):
    plan = AttentionPlan(causal_plan(1).inflight_mask, (Segment(view, 0, 1),)).at_layer(0)
    empty = qc.buf_k[0][:, :, :0]
    return attend(q, empty, empty, qc.lengths, k_new, v_new, q_pos, plan,
                  impl=KERNEL if impl_kernel else "reference")

  run = jax.jit(run.__wrapped__, static_argnums=5)
  want = run(QuantView(qc, (extra[0],), (extra[1],), extra_len, bits=4), *args, False)
  got = run(base.replace(extra_k=stacked_k, extra_v=stacked_v, extra_len=extra_len), *args, True)
  _close(got, want)
  same = run(base.replace(extra_k=stacked_k, extra_v=stacked_v, extra_len=extra_len), *args,
             False)
  _close(same, want)
  # The scratch slot is read: without it (extra_len 0) the output moves.
  moved = run(base.replace(extra_k=stacked_k, extra_v=stacked_v, extra_len=0 * extra_len),
              *args, True)
  assert np.abs(np.asarray(moved, np.float32) - np.asarray(want, np.float32)).max() > 2e-2


@pytest.mark.parametrize("impl", ["reference", KERNEL])
def test_precomputed_tail_is_what_the_view_reads(window, impl):
  """`QuantView.with_tail()` (the tail computed once for a step's drafts) gives the very outputs
  of computing it in the forward; a tail computed from another cache is what gets read (so the
  precomputed arrays are used, not recomputed), and one computed at other bits is refused."""
  qc, q, k_new, v_new, lengths, extra = window
  q_pos = lengths[:, None] + jnp.arange(T)[None]

  def run(view):
    plan = AttentionPlan(causal_plan(T).inflight_mask, (Segment(view, 0, T),)).at_layer(0)
    empty = qc.buf_k[0][:, :, :0]
    return attend(q, empty, empty, qc.lengths, k_new, v_new, q_pos, plan, impl=impl)

  run = jax.jit(run)
  view = QuantView(qc, bits=4)
  np.testing.assert_array_equal(np.asarray(run(view.with_tail()), np.float32),
                                np.asarray(run(view), np.float32))
  other = qc.replace(buf_k=(qc.buf_k[0] * 2,))
  stale = view.replace(**{f: getattr(QuantView(other, bits=4).with_tail(), f)
                          for f in ("tail_k", "tail_v", "tail_bits")})
  assert np.abs(np.asarray(run(stale), np.float32) - np.asarray(run(view), np.float32)).max() > 0.1
  with pytest.raises(ValueError, match="tail was computed at 4 bits"):
    run(view.with_tail().replace(bits=8))


def test_quantspec_greedy_kernel_equals_reference():
  """Prefill (decode_attention), gamma = 2 drafts (4-bit weights, QuantView bits 4 + scratch) and
  the INT8 verification (QuantView bits 8) all in kernels: the same tokens as the reference.
  Row 0 (186-token prompt) flushes its second group during the run, row 1 (124) quantizes its
  first (an empty quantized prefix before). Whether a window reads CF1 re-quantized depends on
  the acceptances; the attend-level tests above pin that rule down."""
  cfg = KERNEL_SHAPED
  params = cast_params(init_random(cfg, jax.random.key(1), scale=0.5), cfg.dtype)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (186, 124)]
  method = QuantSpec(gamma=2, quant_group=G, weight_group=64)
  runs = {impl: sparsedec.generate(cfg.replace(attention=impl), params, prompts,
                                   max_new_tokens=8, stop_tokens=(), method=method)
          for impl in ("reference", KERNEL)}
  assert runs[KERNEL].tokens == runs["reference"].tokens
  assert runs[KERNEL].method_stats == runs["reference"].method_stats


def _plan(qc, bits=8, t=1, extra_views=()):
  segments = (Segment(QuantView(qc, bits=bits), 0, t),) + tuple(extra_views)
  return AttentionPlan(causal_plan(t).inflight_mask, segments).at_layer(0)


def _small_cache(group, d, dtype=jnp.bfloat16, capacity=CAP):
  k = jnp.ones((1, HKV, capacity, d), dtype)
  return qkv.from_dense(KVCache(k=(k,), v=(k,), lengths=jnp.asarray([capacity // 2], jnp.int32)),
                        group)


@pytest.mark.parametrize("q_dtype, d, group, needle", [
    (jnp.float32, 64, 64, "dtype float32"),
    (jnp.bfloat16, 32, 64, "head_dim 32"),
    (jnp.bfloat16, 64, 32, "quant group 32"),
])
def test_kernel_choice_names_what_quant_attention_does_not_take(q_dtype, d, group, needle):
  qc = _small_cache(group, d)
  q = jnp.ones((1, 1, HQ, d), q_dtype)
  empty = qc.buf_k[0][:, :, :0]
  kind, why = kernel_choice(q, empty, _plan(qc))
  assert kind is None and needle in why
  k_new = jnp.ones((1, 1, HKV, d), q_dtype)
  pos = qc.lengths[:, None]
  with pytest.raises(UnsupportedConfigError, match=needle):
    attend(q, empty, empty, qc.lengths, k_new, k_new, pos, _plan(qc), impl="pallas")
  # "auto" (here on the CPU, and on a GPU with a warning): the reference.
  got = attend(q, empty, empty, qc.lengths, k_new, k_new, pos, _plan(qc), impl="auto")
  want = attend(q, empty, empty, qc.lengths, k_new, k_new, pos, _plan(qc), impl="reference")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kernel_choice_accepts_the_8b_shapes_and_refuses_mixed_plans():
  qc = _small_cache(128, 128, capacity=256)
  q = jnp.ones((1, 1, 32, 128), jnp.bfloat16)
  empty = qc.buf_k[0][:, :, :0]
  assert kernel_choice(q, empty, _plan(qc)) == ("quant", "")
  kind, why = kernel_choice(q[:, :1].repeat(2, 1), empty,
                            _plan(qc, t=2, extra_views=(Segment(FullView(), 1, 2),)))
  assert kind is None and "mixing" in why


def test_stories260k_is_refused_by_name_in_interpret_mode():
  """stories260K (fp32, head_dim 8) has no kernel: forcing one names why (auto = reference)."""
  from sparsedec.weights.checkpoint import load_model
  cfg, params, _ = load_model("checkpoints/stories260K")
  with pytest.raises(UnsupportedConfigError, match="dtype float32"):
    sparsedec.generate(cfg.replace(attention="interpret"), params, [[1, 2, 3]], max_new_tokens=2,
                       method=QuantSpec(gamma=2, quant_group=8, weight_group=32))


# ------------------------------------------------------------------------------------------------
# W4A16 draft weights.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["int4", "int4_grouped", "int4_reduce"])
def test_weight_layouts_hold_the_same_quantized_weight(layout):
  """The int4 layouts hold the packed weight's codes and multiply to its product, at widths
  where XLA:GPU's jitted product of the "int4" layout was wrong unpadded (16-40 columns on an
  H200; benchmarks/NOTES.md, sessions 56-57)."""
  for n_out in (16, 24, 40):
    check_layout_product(layout, n_out)


def dot_widths(fn, *args, platform: str) -> list[int]:
  """The output widths of the dot_generals of jit(fn)(*args) lowered for `platform`."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  return [int(m) for m in re.findall(r"stablehlo\.dot_general.*x(\d+)x\w+>$", text, re.M)]


def test_narrow_int4_products_are_padded_for_cuda():
  """Lowered for CUDA (whatever the default backend), the "int4" product multiplies a narrow weight
  padded to INT4_MIN_OUT columns; lowered for the CPU, unpadded. The padded product has the same
  values (the padded dot may sum in another order)."""
  w = rand.normal(jax.random.key(0), (172, 24), jnp.float32)
  qw = quantize_weight(w, group=64, layout="int4")
  x = rand.normal(jax.random.key(1), (2, 3, 172))
  assert dot_widths(linear, x, qw, platform="cuda") == [quant_weights.INT4_MIN_OUT]
  assert dot_widths(linear, x, qw, platform="cpu") == [24]
  want = np.asarray(linear(x, quantize_weight(w, group=64)))
  padded = jax.jit(quant_weights._int4_dequant_product, static_argnums=(2, 3))
  got = padded(x, qw, jax.lax.Precision.HIGHEST, quant_weights.INT4_MIN_OUT)   # as `linear`'s
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def check_layout_product(layout: str, n_out: int) -> None:
  w = rand.normal(jax.random.key(n_out), (172, n_out), jnp.float32)
  packed = quantize_weight(w, group=64)
  qw = quantize_weight(w, group=64, layout=layout)
  assert qw.codes.dtype == jnp.int4 and qw.codes.shape == (192, n_out)
  assert qw.num_bytes() == packed.num_bytes()             # 4-bit arrays: two codes per byte
  np.testing.assert_array_equal(np.asarray(qw.dequantize()), np.asarray(packed.dequantize()))
  np.testing.assert_array_equal(np.asarray(packed.to_layout(layout).codes),
                                np.asarray(qw.codes))
  np.testing.assert_array_equal(np.asarray(qw.to_layout("packed").codes),
                                np.asarray(packed.codes))
  x = rand.normal(jax.random.key(1), (2, 3, 172))
  want = np.asarray(linear(x, packed))
  got = np.asarray(jax.jit(linear)(x, qw))
  if layout == "int4":        # the same dequantized weight, the same dot
    np.testing.assert_array_equal(got, want)
  else:                       # per-group dots / an fp32 sum: fp32 rounding only
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  xb = x.astype(jnp.bfloat16)                 # bf16 activations: to bf16 precision of the scale
  want = np.asarray(linear(xb, packed), np.float32)
  np.testing.assert_allclose(np.asarray(linear(xb, qw), np.float32), want, rtol=2e-2,
                             atol=1e-2 * np.abs(want).max())


def test_draft_params_in_every_layout_give_the_same_logits():
  cfg = KERNEL_SHAPED.replace(dtype="float32", attention="reference")
  params = init_random(cfg, jax.random.key(2), scale=0.5)
  tokens = jnp.asarray([[3, 5, 7]], jnp.int32)
  positions = jnp.arange(3)[None]
  cache = init_cache(cfg, 1, 128)
  run = jax.jit(forward, static_argnums=0)
  want, _ = run(cfg, quantize_params(params, 64), tokens, positions, cache)
  int4 = quantize_params(params, 64, "int4")
  assert weights_bytes(int4) == weights_bytes(quantize_params(params, 64))
  got, _ = run(cfg, int4, tokens, positions, cache)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for layout in ("int4_grouped", "int4_reduce"):
    other, _ = run(cfg, params_to_layout(int4, layout), tokens, positions, cache)
    np.testing.assert_allclose(np.asarray(other), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["packed", "int4", "int4_grouped", "int4_reduce"])
def test_draft_and_verify_forwards_lower_for_cuda(layout):
  """At the 8B benchmark's head shapes (Hq 32, Hkv 8, D 128, G 128), the draft forward (W4A16
  weights, QuantView bits 4 with its scratch) and the verification forward (bits 8, 5 tokens)
  lower for cuda with both QuantView reads in the Mosaic GPU kernel; the int4 layouts' codes
  reach the program as i4 arrays."""
  cfg = ModelConfig(family="llama", vocab_size=128, hidden_size=256, intermediate_size=256,
                    num_layers=1, num_heads=32, num_kv_heads=8, head_dim=128,
                    dtype="bfloat16", attention="pallas")
  params = cast_params(init_random(cfg, jax.random.key(0)), cfg.dtype)
  draft = quantize_params(params, 128, layout)
  dense = KVCache(k=(jnp.zeros((1, 8, 512, 128), jnp.bfloat16),),
                  v=(jnp.zeros((1, 8, 512, 128), jnp.bfloat16),), lengths=jnp.asarray([300]))
  qc = qkv.from_dense(dense, 128)
  empty = KVCache(k=(dense.k[0][:, :, :0],), v=(dense.v[0][:, :, :0],), lengths=qc.lengths)
  scratch = (jnp.zeros((1, 4, 8, 128), jnp.bfloat16),)

  def draft_forward(p, qc, tok):
    view = QuantView(qc, scratch, scratch, jnp.asarray([2], jnp.int32), bits=4)
    plan = AttentionPlan(jnp.ones((1, 1), bool), (Segment(view, 0, 1),))
    return forward(cfg, p, tok, qc.lengths[:, None] + 2, empty, plan)[0]

  def verify_forward(p, qc, toks):
    plan = AttentionPlan(causal_plan(5).inflight_mask, (Segment(QuantView(qc, bits=8), 0, 5),))
    return forward(cfg, p, toks, qc.lengths[:, None] + jnp.arange(5)[None], empty, plan)[0]

  for fn, p, t in ((draft_forward, draft, 1), (verify_forward, params, 5)):
    text = jax.jit(fn).trace(p, qc, jnp.zeros((1, t), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.custom_call @mosaic_gpu" in text
  if layout != "packed":
    draft_text = jax.jit(draft_forward).trace(draft, qc, jnp.zeros((1, 1), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xi4>" in draft_text
