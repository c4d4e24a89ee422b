"""`sparsedec.attention.attend` dispatch: the Pallas decode kernel inside the model forward equals
the jnp reference (the kernel in the Mosaic GPU interpreter on the CPU, compiled on a GPU: at 3
tokens a step the in-flight keys go through the cache kernel's tile), and the cases the kernel does
not cover are refused by name when the kernel is forced, and fall back in "auto"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rand
from kernel_mode import KERNEL, cuda_text
import sparsedec
from sparsedec.attention import attend, causal_plan, kernel_choice
from sparsedec.compress.quest import Quest
from sparsedec.decode.api import start
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.lookahead import Lookahead
from sparsedec.decode.loop import decode
from sparsedec.decode.quantspec import QuantSpec
from sparsedec.errors import UnsupportedConfigError
from sparsedec.kv.dense import commit, init_cache
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.params import cast_params, init_random

# head_dim 64 and a capacity that is a multiple of 128: what the kernel takes.
KERNEL_SHAPED = ModelConfig(family="llama", vocab_size=61, hidden_size=128, intermediate_size=128,
                            num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
                            max_position_embeddings=512, dtype="bfloat16")


def _prefilled(cfg, params, prompt_lengths, capacity=128):
  """A cache holding ragged prompts, built with the reference attention."""
  ref_cfg = cfg.replace(attention="reference")
  b = len(prompt_lengths)
  t = max(prompt_lengths)
  tokens = rand.randint(jax.random.key(3), (b, t), 0, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  cache = init_cache(cfg, b, capacity)
  _, kv = forward(ref_cfg, params, tokens, positions, cache)
  return commit(cache, kv, jnp.asarray(prompt_lengths, jnp.int32))


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_forward_with_kernel_equals_reference(num_tokens):
  cfg = KERNEL_SHAPED
  params = cast_params(init_random(cfg, jax.random.key(0), scale=0.5), cfg.dtype)
  cache = _prefilled(cfg, params, [5, 0, 17])
  tokens = rand.randint(jax.random.key(4), (3, num_tokens), 0, cfg.vocab_size)
  positions = cache.lengths[:, None] + jnp.arange(num_tokens)[None]
  run = jax.jit(forward, static_argnums=0)
  ref_logits, ref_kv = run(cfg.replace(attention="reference"), params, tokens, positions, cache)
  got_logits, got_kv = run(cfg.replace(attention=KERNEL), params, tokens, positions, cache)
  np.testing.assert_array_equal(np.asarray(got_kv.k[0], np.float32),
                                np.asarray(ref_kv.k[0], np.float32))
  # bf16 activations: the two attentions round differently (one bf16 ulp of a hidden value moves
  # a logit of size ~10 by ~0.06); logits agree to bf16 precision of their scale.
  scale = float(np.abs(np.asarray(ref_logits)).max())
  np.testing.assert_allclose(got_logits, ref_logits, atol=1e-2 * scale, rtol=2e-2)
  assert np.abs(np.asarray(ref_logits)).max() > 0.5   # the comparison is not between zeros


def test_decode_loop_with_kernel_matches_reference_greedy():
  cfg = KERNEL_SHAPED
  params = cast_params(init_random(cfg, jax.random.key(1), scale=0.5), cfg.dtype)
  prompts = [[1, 2, 3, 4, 5], [7, 8]]
  ref = sparsedec.generate(cfg.replace(attention="reference"), params, prompts,
                           max_new_tokens=6, stop_tokens=())
  got = sparsedec.generate(cfg.replace(attention=KERNEL), params, prompts,
                           max_new_tokens=6, stop_tokens=())
  ref_logits = [np.asarray(x) for x in ref.tokens]
  assert [list(x) for x in got.tokens] == [list(x) for x in ref_logits]


@pytest.mark.parametrize("change, needle", [
    (dict(dtype="float32"), "dtype float32"),
    (dict(head_dim=32, hidden_size=64), "head_dim 32"),
    (dict(family="mistral", sliding_window=4), "sliding window 4"),
])
def test_forced_kernel_names_what_it_does_not_cover(change, needle):
  cfg = KERNEL_SHAPED.replace(attention="pallas", **change)
  params = init_random(cfg, jax.random.key(0))
  if cfg.dtype == "bfloat16":
    params = cast_params(params, cfg.dtype)
  cache = init_cache(cfg, 1, 128)
  with pytest.raises(UnsupportedConfigError, match=needle):
    forward(cfg, params, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache)


def test_unaligned_capacity_is_refused_when_forced_and_falls_back_in_auto():
  b, t, hq, hkv, d, s = 1, 1, 4, 2, 64, 100
  q = jnp.ones((b, t, hq, d), jnp.bfloat16)
  kc = jnp.ones((b, hkv, s, d), jnp.bfloat16)
  kn = jnp.ones((b, t, hkv, d), jnp.bfloat16)
  lengths = jnp.asarray([7], jnp.int32)
  pos = lengths[:, None]
  with pytest.raises(UnsupportedConfigError, match="capacity 100"):
    attend(q, kc, kc, lengths, kn, kn, pos, causal_plan(t), impl="pallas")
  out = attend(q, kc, kc, lengths, kn, kn, pos, causal_plan(t), impl="auto")   # CPU: reference
  np.testing.assert_allclose(np.asarray(out, np.float32), 1.0)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_auto_picks_the_kernel_by_the_platform_it_is_lowered_for(num_tokens):
  """attention="auto" is decided where the call is lowered, not by the default backend: lowered
  for cuda the model forward's attention is the decode kernel (a Mosaic GPU custom call), lowered
  for the CPU the jnp reference (no custom call), and it runs on a CPU device whatever the default
  backend is (a GPU host's CPU device ran the kernel before and failed)."""
  cfg = KERNEL_SHAPED
  params = cast_params(init_random(cfg, jax.random.key(0), scale=0.5), cfg.dtype)
  cache = init_cache(cfg, 2, 128)
  tokens = jnp.ones((2, num_tokens), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(num_tokens), (2, num_tokens))
  call = lambda p, x, pos, c: forward(cfg, p, x, pos, c)[0]
  assert cuda_text(call, params, tokens, positions, cache).count("@mosaic_gpu") == 1
  cpu_text = jax.jit(call).trace(params, tokens, positions, cache).lower(
      lowering_platforms=("cpu",)).as_text()
  assert "custom_call" not in cpu_text
  on_cpu = jax.device_put((params, tokens, positions, cache), jax.devices("cpu")[0])
  ref_cfg = cfg.replace(attention="reference")
  want = jax.jit(lambda p, x, pos, c: forward(ref_cfg, p, x, pos, c)[0])(*on_cpu)
  np.testing.assert_array_equal(np.asarray(jax.jit(call)(*on_cpu)), np.asarray(want))


@pytest.mark.parametrize("method,kernels", [
    (Lookahead(window=4, ngram=3, guesses=2), 1), (Lookahead(window=7, ngram=5, guesses=7), 2),
    (Fafo(subsequences=2, length=2, candidates=2, policy=Quest(budget_blocks=2)), 2),
    (QuantSpec(gamma=8, verify_precision="full", quant_group=64, weight_layout="int4_t"), 7),
    (QuantSpec(gamma=2, verify_precision="int8", quant_group=64, weight_layout="int4_t"), 8)],
    ids=["lookahead-w4n3g2", "lookahead-w7n5g7", "fafo-quest", "quantspec-g8-full",
         "quantspec-g2-int8"])
def test_method_decode_loops_lower_for_cuda(method, kernels):
  """A method's whole decode loop lowered for cuda (bf16, SmolLM2's heads: Hq 9, Hkv 3, D 64;
  two layers) runs its attention, QuantSpec's draft GEMVs and quantizer on Mosaic GPU kernels
  (`kernels` custom calls in the lowered text). Lookahead W 4, N 3, G 2 (13 tokens a step) and
  QuantSpec's verification of 9 tokens on its full-precision cache (gamma 8, "full") failed to
  lower on the GPU (the in-flight tile's TMA at 9..15 rows; session 70): the interpreter the CPU
  tests run the kernels in does not check what Mosaic GPU's lowering rejects."""
  cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=576, intermediate_size=256,
                    num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                    max_position_embeddings=1024, dtype="bfloat16")
  params = cast_params(init_random(cfg, jax.random.key(0)), cfg.dtype)
  prompt = [list(np.random.default_rng(0).integers(3, 250, 150))]
  state, run = start(cfg, params, prompt, max_new_tokens=40, method=method, cache_size=512)
  text = decode.trace(cfg, params, state, jnp.int32(4), method=run.method, ctx=run.ctx).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu_v2") == kernels


def test_triforce_decode_loop_lowers_for_cuda():
  """TriForce's whole decode loop lowered for cuda (bf16, SmolLM2's heads, two layers; a
  one-layer draft of the same heads): each of its attentions is a Mosaic GPU kernel, none falls
  back: sparse_attention in the draft's catch-up and one-token forwards (its StreamingLLM block
  list) and in the middle level's forward (the retrieval block list), decode_attention in the
  verification (the full cache): 4 kernels (a forward's layers call one lowered function)."""
  from sparsedec.compress import ChunkRetrieval, StreamingLLM
  from sparsedec.decode.speculative import with_draft_model
  from sparsedec.decode.triforce import TriForce
  cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=576, intermediate_size=256,
                    num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                    max_position_embeddings=1024, dtype="bfloat16")
  params = cast_params(init_random(cfg, jax.random.key(0)), cfg.dtype)
  dcfg = cfg.replace(num_layers=1)
  both = with_draft_model(params, {**params, "layers": params["layers"][:1]})
  method = TriForce(draft=dcfg, gamma=5, draft_gamma=3,
                    retrieval=ChunkRetrieval(budget_blocks=3, block_size=64, recent_blocks=1),
                    draft_view=StreamingLLM(budget_blocks=2, block_size=64))
  prompt = [list(np.random.default_rng(0).integers(3, 250, 150))]
  state, run = start(cfg, both, prompt, max_new_tokens=40, method=method, cache_size=512)
  text = decode.trace(cfg, both, state, jnp.int32(4), method=run.method, ctx=run.ctx).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu_v2") == 4
  assert text.count("func.func private @sparse_attention") == 3


def test_sfi_decode_loop_lowers_for_cuda():
  """SlowFast's decode loop lowered for cuda (bf16, SmolLM2's heads, two layers): the fast branch
  and the slow branch (every block listed) each run sparse_attention, a Mosaic GPU kernel; none
  falls back."""
  from sparsedec.decode.sfi import SlowFast
  cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=576, intermediate_size=256,
                    num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                    max_position_embeddings=1024, dtype="bfloat16")
  params = cast_params(init_random(cfg, jax.random.key(0)), cfg.dtype)
  method = SlowFast(budget_blocks=2, block_size=64, boundary_tokens=(13,), max_fast_steps=8)
  prompt = [list(np.random.default_rng(0).integers(3, 250, 300))]
  state, run = start(cfg, params, prompt, max_new_tokens=40, method=method, cache_size=512)
  text = decode.trace(cfg, params, state, jnp.int32(4), method=run.method, ctx=run.ctx).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu_v2") == 2
  assert text.count("func.func private @sparse_attention") == 2


def test_a_block_list_over_a_capacity_not_a_multiple_of_its_block_size():
  """The sparse kernel refuses it by name; "auto" falls back to the reference, which reads the
  listed blocks, the last one partial (it failed on a [.., 16] vs [.., 20] broadcast)."""
  from sparsedec.attention import AttentionPlan, BlockListView, Segment, reference_attention
  b, t, hq, hkv, d, s = 1, 1, 2, 1, 64, 20
  q, kc, vc, kn, vn = (rand.normal(jax.random.key(i), shape, jnp.bfloat16) for i, shape in
                       enumerate([(b, t, hq, d), (b, hkv, s, d), (b, hkv, s, d), (b, t, hkv, d),
                                  (b, t, hkv, d)]))
  lengths = jnp.asarray([19], jnp.int32)
  view = BlockListView(jnp.asarray([[[2, 0]]], jnp.int32), jnp.asarray([[2]], jnp.int32), 8)
  plan = AttentionPlan(jnp.ones((t, t), bool), (Segment(view, 0, t),))
  wide = AttentionPlan(plan.inflight_mask, (Segment(view.replace(block_size=64), 0, t),))
  with pytest.raises(UnsupportedConfigError, match="capacity 20 is not a multiple of block_size"):
    attend(q, kc, vc, lengths, kn, vn, lengths[:, None], wide, impl="pallas")
  assert np.asarray(view.slot_mask(lengths, s)).nonzero()[-1].tolist() == [*range(8), 16, 17, 18]
  out = attend(q, kc, vc, lengths, kn, vn, lengths[:, None], plan, impl="auto")   # CPU: reference
  mask = np.zeros((b, t, s), bool)
  mask[..., [*range(8), 16, 17, 18]] = True                  # blocks 0 and 2 (slots 16..19), < 19
  want = reference_attention(q, kc, vc, jnp.asarray(mask), kn, vn, jnp.ones((b, t, t), bool))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_a_cache_in_another_dtype_than_q_is_not_a_kernel_call():
  """q bf16 over an fp32 cache: the kernels take one dtype, so "auto" falls back (it raised
  decode_attention's ValueError on a GPU) and "pallas" refuses by name."""
  b, t, hq, hkv, d, s = 1, 1, 4, 2, 64, 128
  q = jnp.ones((b, t, hq, d), jnp.bfloat16)
  kc = jnp.ones((b, hkv, s, d), jnp.float32)
  kn = jnp.ones((b, t, hkv, d), jnp.bfloat16)
  lengths = jnp.asarray([7], jnp.int32)
  kind, why = kernel_choice(q, kc, causal_plan(t))
  assert kind is None and "cache dtype float32 differs" in why
  with pytest.raises(UnsupportedConfigError, match="cache dtype float32"):
    attend(q, kc, kc, lengths, kn, kn, lengths[:, None], causal_plan(t), impl="pallas")


def test_attention_choice_is_validated_and_not_saved():
  with pytest.raises(UnsupportedConfigError, match="attention 'cuda'"):
    KERNEL_SHAPED.replace(attention="cuda")
  assert "attention" not in KERNEL_SHAPED.replace(attention="reference").to_dict()


def test_attend_refuses_a_misspelt_impl_and_segments_that_do_not_cover_the_queries():
  """attend's own checks: an impl typo ("interpet" ran as "pallas") and a plan whose segments
  leave a query out (the reference dropped it) or repeat one (it returned extra rows)."""
  from sparsedec.attention import AttentionPlan, FullView, Segment
  b, t, hkv, d = 1, 2, 2, 64
  q = jnp.zeros((b, t, 4, d), jnp.float32)
  kv = jnp.zeros((b, hkv, 64, d), jnp.float32)
  new = jnp.zeros((b, t, hkv, d), jnp.float32)
  args = (q, kv, kv, jnp.array([3]), new, new, jnp.arange(t)[None] + 3)
  with pytest.raises(UnsupportedConfigError, match="'interpet' is not one of"):
    attend(*args, causal_plan(t), impl="interpet")
  mask = causal_plan(t).inflight_mask
  for segments in ([(0, 1)], [(0, 2), (0, 2)], [(0, 0), (0, 2)], [(1, 2)]):
    plan = AttentionPlan(mask, tuple(Segment(FullView(), s, e) for s, e in segments))
    with pytest.raises(ValueError, match="must cover the queries"):
      attend(*args, plan, impl="reference")
  assert attend(*args, causal_plan(t), impl="reference").shape == q.shape


def test_model_single_query_calls_keep_the_combine_score():
  """At Tq = 1 the model's kernel call computes q . k_new in the combine (an XLA dot: inflight
  "jnp"), not in the cache kernel ("auto"): a model's k_new is a RoPE product XLA fuses into the
  cache write, and the kernel's score would need it copied out (session 48). The kernel call
  alone, in "auto", has no dot."""
  from pallas_kernels.decode_attention import decode_attention
  b, hq, hkv, d, s = 1, 4, 2, 64, 128
  q, kc, kn = (jnp.zeros((b, 1, hq, d), jnp.bfloat16), jnp.zeros((b, hkv, s, d), jnp.bfloat16),
               jnp.zeros((b, 1, hkv, d), jnp.bfloat16))
  lengths, pos = jnp.zeros((b,), jnp.int32), jnp.zeros((b, 1), jnp.int32)
  model = cuda_text(lambda q, kc, lengths, kn, pos: attend(q, kc, kc, lengths, kn, kn, pos,
                                                           causal_plan(1), impl="pallas"),
                    q, kc, lengths, kn, pos)
  assert "stablehlo.custom_call @mosaic_gpu" in model and "stablehlo.dot_general" in model
  alone = cuda_text(lambda q, kc, lengths, kn: decode_attention(q, kc, kc, lengths, kn, kn,
                                                                jnp.ones((1, 1), bool)),
                    q, kc, lengths, kn)
  assert "stablehlo.dot_general" not in alone


def test_attend_checks_shapes_and_dtypes_before_either_path():
  """The reference path broadcast what the kernels refuse, silently wrong: a cache, k_new /
  v_new, block list or q_pos of batch 1 against B rows, lengths [1], an inflight mask [T] (every
  query's row), a float 0 / -inf bias mask (nonzero read as True: its inverse; the kernel path
  cast it to bool before the kernel's own check could see it). Refused by name, on both paths."""
  from sparsedec.attention import AttentionPlan, BlockListView, FullView, Segment
  b, t, hq, hkv, d, s = 2, 3, 4, 2, 64, 64
  q = jnp.zeros((b, t, hq, d), jnp.float32)
  kv = jnp.zeros((b, hkv, s, d), jnp.float32)
  new = jnp.zeros((b, t, hkv, d), jnp.float32)
  lengths = jnp.array([10, 20], jnp.int32)
  pos = lengths[:, None] + jnp.arange(t)
  plan = causal_plan(t)
  full = lambda mask: AttentionPlan(mask, (Segment(FullView(), 0, t),))  # noqa: E731
  bias = jnp.where(plan.inflight_mask, 0.0, -jnp.inf)
  cases = [
      ((q, kv[:1], kv[:1], lengths, new, new, pos, plan), r"k_cache must be \[B=2, Hkv, S, D=64\]"),
      ((q, kv, kv[:1], lengths, new, new, pos, plan), "v_cache shape .* differs"),
      ((q, kv, kv, lengths, new[:1], new, pos, plan), r"k_new must be \[B, T, Hkv, D\]"),
      ((q, kv, kv, lengths, new, new[:, :, :1], pos, plan), r"v_new must be \[B, T, Hkv, D\]"),
      ((q, kv, kv, lengths[:1], new, new, pos, plan), r"lengths must be \[B=2\] integer"),
      ((q, kv, kv, lengths + 0.5, new, new, pos, plan), r"lengths must be \[B=2\] integer"),
      ((q, kv, kv, lengths, new, new, pos, full(jnp.ones((t,), bool))),
       r"inflight_mask must be \[T, T\] = \[3, 3\], got shape \(3,\)"),
      ((q, kv, kv, lengths, new, new, pos, full(bias)), "inflight_mask must be bool"),
      ((q[:, :, :3], kv, kv, lengths, new, new, pos, plan), "Hq=3 .* not a multiple of Hkv=2"),
      ((q, kv, kv, lengths, new, new, pos[:1], plan), r"q_pos must be \[B, T\] = \(2, 3\)"),
      ((q, kv, kv, lengths, new, new, pos[:, 0], plan), r"q_pos must be \[B, T\] = \(2, 3\)"),
      ((q, kv, kv, lengths, new, new, pos + 0.5, plan), "q_pos must be .* integer"),
  ]
  for args, needle in cases:
    for impl in ("reference", "auto", KERNEL):
      with pytest.raises(ValueError, match=needle):
        attend(*args, impl=impl)
  view = BlockListView(jnp.zeros((1, hkv, 1), jnp.int32), jnp.ones((1, hkv), jnp.int32), 64)
  with pytest.raises(ValueError, match=r"tables must be \[B=2, Hkv=2, NB\]"):
    attend(q, kv, kv, lengths, new, new, pos, AttentionPlan(plan.inflight_mask,
                                                          (Segment(view, 0, t),)))
  view = BlockListView(jnp.zeros((b, hkv, 1), jnp.int32), jnp.ones((b,), jnp.int32), 64)
  with pytest.raises(ValueError, match=r"counts must be \[B, Hkv\] = \(2, 2\)"):
    attend(q, kv, kv, lengths, new, new, pos, AttentionPlan(plan.inflight_mask,
                                                          (Segment(view, 0, t),)))
  # An integer 0 / 1 mask is a mask, as the kernels take it.
  got = attend(q, kv, kv, lengths, new, new, pos, full(plan.inflight_mask.astype(jnp.int32)),
               impl="reference")
  assert got.shape == q.shape


def _brute_attention(q, kc, vc, kn, vn, visible_cache, visible_new):
  """Softmax attention written out (float64): visible_cache [B, Hkv, T, S], visible_new
  [B, T, U]; a query that sees nothing gives 0."""
  b, t, hq, d = q.shape
  hkv = kc.shape[1]
  out = np.zeros((b, t, hq, d))
  for row in range(b):
    for i in range(t):
      for h in range(hq):
        kh = h // (hq // hkv)
        keys = np.concatenate([kc[row, kh], kn[row, :, kh]]).astype(np.float64)
        vals = np.concatenate([vc[row, kh], vn[row, :, kh]]).astype(np.float64)
        seen = np.concatenate([visible_cache[row, kh, i], visible_new[row, i]])
        if not seen.any():
          continue
        sc = keys[seen] @ q[row, i, h] / np.sqrt(d)
        p = np.exp(sc - sc.max())
        out[row, i, h] = (p / p.sum()) @ vals[seen]
  return out


@pytest.mark.parametrize("window", [None, 2, 6])
def test_reference_attend_against_written_out_masks(window):
  """The reference path's masks, pinned one slot at a time against a written-out softmax: ragged
  lengths (an empty row), a query whose in-flight row is all False over an empty cache (output 0,
  not NaN), a block list with an entry past its count (not read), and a sliding window at its edge
  (a key window - 1 positions back is seen, one window back is not)."""
  from sparsedec.attention import AttentionPlan, BlockListView, FullView, Segment
  b, t, hq, hkv, d, s = 3, 3, 4, 2, 8, 16
  rng = np.random.default_rng(0)
  q, kn, vn = (rng.normal(size=shape).astype(np.float32)
               for shape in [(b, t, hq, d), (b, t, hkv, d), (b, t, hkv, d)])
  kc, vc = (rng.normal(size=(b, hkv, s, d)).astype(np.float32) for _ in range(2))
  lengths = np.array([0, 5, 13], np.int32)
  q_pos = lengths[:, None] + np.arange(t, dtype=np.int32)[None]
  mask = np.array([[False, False, False], [True, True, False], [True, True, True]])
  # Query 0 reads blocks of 4 from its list (block 3 of row 2, head 1, listed past the count).
  tables = np.array([[[0, 1], [1, 0]], [[1, 0], [0, 1]], [[0, 2], [2, 3]]], np.int32)
  counts = np.array([[2, 1], [2, 1], [2, 1]], np.int32)
  plan = AttentionPlan(jnp.asarray(mask), (
      Segment(BlockListView(jnp.asarray(tables), jnp.asarray(counts), 4), 0, 1),
      Segment(FullView(), 1, t)))
  slots = np.arange(s)
  vis_cache = np.broadcast_to(slots < lengths[:, None, None, None], (b, hkv, t, s)).copy()
  for row in range(b):
    for h in range(hkv):
      listed = tables[row, h, : counts[row, h]]
      vis_cache[row, h, 0] &= np.isin(slots // 4, listed)
  vis_new = np.broadcast_to(mask, (b, t, t)).copy()
  if window is not None:
    vis_cache &= (q_pos[:, None, :, None] - slots) < window
    vis_new &= (q_pos[:, :, None] - q_pos[:, None, :]) < window
    # The edges are really in play: row 2's last query (position 15) sees slot 10, not 9 (window
    # 6); in flight, it sees position 14, not 13 (window 2).
    if window == 6:
      assert vis_cache[2, 0, 2, 10] and not vis_cache[2, 0, 2, 9]
    else:
      assert vis_new[2, 2, 1] and not vis_new[2, 2, 0] and vis_cache[1, 0, 0, 4]
  got = attend(*(jnp.asarray(x) for x in (q, kc, vc, lengths, kn, vn, q_pos)), plan,
               window=window, impl="reference")
  want = _brute_attention(q, kc, vc, kn, vn, vis_cache, vis_new)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[0, 0] == 0)                  # sees nothing: 0, not NaN
