"""The Mosaic GPU W4A16 GEMV kernel (pallas_kernels.w4a16_gemv) in GPU interpret mode (CPU)
against its fp32 dequantize-then-multiply reference, its cuda lowering at Llama-3.1-8B shapes,
and the "int4_t" weight layout of sparsedec.model.quant_weights (exact conversions, the same
products as the other layouts, the kernel dispatch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rand
from kernel_mode import INTERPRET
from pallas_kernels import w4a16_gemv as w4
from pallas_kernels.register_operand import unpack_words
from pallas_kernels.w4a16_gemv import (CODE_OFFSET, W4A16Config, dequantize, plan, w4a16_matmul,
                                       w4a16_reference)
from sparsedec.errors import InputError
from sparsedec.model.quant_weights import LAYOUTS, quant_matmul, quantize_weight



def _weight(seed, n_in, n_out, group=128, layout="int4_t", grid="minmax"):
  k1, k2 = jax.random.split(jax.random.key(seed))
  # Per-output offsets and spreads, so that zeros and scales differ between columns and groups.
  w = (rand.normal(k1, (n_in, n_out)) * jnp.exp(rand.normal(k2, (n_out,)))
       + rand.normal(k2, (n_in // 2 + 1, 1)).repeat(2, 0)[:n_in])
  return quantize_weight(w, group, layout, grid)


def _run_kernel(x, q, config=W4A16Config()):
  return w4a16_matmul(x, q.codes, q.scale, q.zero, in_features=q.in_features, group=q.group,
                      config=config, interpret=INTERPRET)


# One compiled program per shape instead of an XLA compile per op of the eager reference.
_reference = jax.jit(w4a16_reference, static_argnames=("in_features", "group"))


def _check_close(got, x, q):
  want = np.asarray(_reference(x, q.codes, q.scale, q.zero, in_features=q.in_features,
                               group=q.group))
  got = np.asarray(got.astype(jnp.float32))
  assert got.shape == want.shape
  # The kernel dequantizes in x's dtype, w = (c - 8) * s + (z + 8 s): s and z + 8 s rounded
  # once, the product and the sum once each, so |dw| <= eps * (|w| + |z + 8 s| + 16 |s|)
  # (eps = 2**-9 for bf16, 2**-11 for fp16, doubled for slack); fp32 accumulation; one rounding
  # of y to x's dtype at the end.
  eps = 2.0 ** -8 if x.dtype == jnp.bfloat16 else 2.0 ** -10
  s = np.asarray(q.scale, np.float32)                                       # [In_pad / G, Out]
  z = np.asarray(q.zero, np.float32) + CODE_OFFSET * s
  w = np.asarray(dequantize(q.codes, q.scale, q.zero, in_features=q.in_features, group=q.group))
  w_abs = np.abs(w) + np.repeat(np.abs(z) + 16 * np.abs(s), q.group, 0)[:q.in_features]
  x_abs = np.abs(np.asarray(x, np.float32))
  bound = eps * (x_abs @ w_abs + np.abs(want)) + 1e-6
  assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


# ----------------------------------------------------------------------------------------------
# Kernel (interpret mode) against the reference.
# ----------------------------------------------------------------------------------------------

# (M, In, Out): every M in {1, 3, 8}, Out in {64, 192} and In in {128, 256, 200 (padded)}.
SHAPES = [(1, 128, 64), (3, 256, 192), (8, 200, 64), (1, 200, 192), (3, 128, 64),
          (8, 256, 64)]


@pytest.mark.parametrize("m,n_in,n_out", SHAPES)
def test_kernel_matches_reference_bf16(m, n_in, n_out):
  q = _weight(m + n_in + n_out, n_in, n_out)
  x = rand.normal(jax.random.key(m), (m, n_in), jnp.bfloat16)
  _check_close(_run_kernel(x, q), x, q)


@pytest.mark.parametrize("m,n_in,n_out,config", [
    # Split-K (two splits of one group each), several stages.
    (3, 256, 64, W4A16Config(num_splits=2, num_stages=2)),
    # Three register tiles per block, two groups per pipeline step, one stage.
    (8, 256, 192, W4A16Config(block_out=192, groups_per_stage=2, num_stages=1)),
    # Ragged split-K (3 steps over 2 splits), 2 stages; 17 rows (N = 24).
    (17, 384, 64, W4A16Config(num_splits=2, num_stages=2)),
])
def test_kernel_tilings(m, n_in, n_out, config):
  q = _weight(7, n_in, n_out)
  x = rand.normal(jax.random.key(1), (m, n_in), jnp.bfloat16)
  _check_close(_run_kernel(x, q, config), x, q)


def test_kernel_fp16_group_64():
  q = _weight(3, 256, 128, group=64)
  x = rand.normal(jax.random.key(2), (2, 256), jnp.float16)
  assert plan(2, 128, 4, 64, W4A16Config()).groups_per_stage == 2     # two groups a step
  got = _run_kernel(x, q)
  assert got.dtype == jnp.float16
  _check_close(got, x, q)


@pytest.mark.parametrize("group,m,n_in,n_out,config,grid", [
    (32, 1, 256, 64, W4A16Config(), "minmax"),              # 4 groups (2 chunks) a step
    (32, 3, 200, 192, W4A16Config(groups_per_stage=3, num_stages=2), "minmax"),  # In_pad 256
    (32, 8, 384, 64, W4A16Config(num_splits=2, num_stages=2), "minmax"),   # split-K, 2 stages
    (16, 2, 256, 128, W4A16Config(block_out=128), "minmax"),  # 4 groups a chunk, 2 tiles a block
    (32, 2, 256, 128, W4A16Config(), "absmax"),             # GGUF Q4_0's grid: negative steps
])
def test_kernel_groups_below_a_chunk(group, m, n_in, n_out, config, grid):
  """Groups of 32 (GGUF Q4_0 / Q4_1 blocks) and 16: several groups share each 64-input chunk,
  each group's scale and zero applied to its own columns of the code tile."""
  q = _weight(group + m, n_in, n_out, group=group, grid=grid)
  assert grid == "minmax" or (np.asarray(q.scale) < 0).any()
  assert q.in_padded % 64 == 0 and q.scale.shape[0] * group == q.in_padded
  p = plan(m, n_out, q.scale.shape[0], group, config)
  assert p.groups_per_stage % (64 // group) == 0                     # whole chunks a step
  x = rand.normal(jax.random.key(m), (m, n_in), jnp.bfloat16)
  got = _run_kernel(x, q, config)
  _check_close(got, x, q)
  # Each group's grid matters: the same codes with group j's scales swapped for its neighbour's
  # give another product (a kernel applying one scale per chunk would not see the difference).
  swapped = q.replace(scale=q.scale.reshape(-1, 2, n_out)[:, ::-1].reshape(q.scale.shape))
  assert np.abs(np.asarray(_run_kernel(x, swapped, config), np.float32)
                - np.asarray(got, np.float32)).max() > 1e-2


def test_plan():
  p = plan(1, 4096, 32, 128, W4A16Config())          # wo: 64 tiles, 32 steps
  assert (p.block_out, p.out_tiles, p.steps) == (64, 64, 32)
  assert p.splits * p.steps_per_split >= 32 > (p.splits - 1) * p.steps_per_split
  # The default fills one wave of resident blocks (8 per SM at this tiling) and no more.
  wave = w4.wave_blocks(p.smem_bytes)
  assert wave == 8 * w4.SM_COUNT
  for n_in, n_out in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
    p = plan(1, n_out, n_in // 128, 128, W4A16Config())
    assert p.out_tiles * p.splits <= wave, (n_in, n_out, p)
    assert p.out_tiles * (p.splits + 1) > wave or p.steps_per_split <= 2, (n_in, n_out, p)
  assert plan(1, 4096, 112, 128, W4A16Config()).splits == 16        # w_down: 7 steps a split
  assert plan(1, 28672, 32, 128, W4A16Config()).splits == 2         # w_gate_up: 448 tiles
  assert plan(1, 128256, 32, 128, W4A16Config()).splits == 1        # lm_head: 2004 tiles
  # An explicit target_blocks is the budget instead of the wave: at most that many blocks.
  assert plan(1, 4096, 112, 128, W4A16Config(target_blocks=528)).splits == 8
  assert plan(1, 28672, 32, 128, W4A16Config(target_blocks=132)).splits == 1
  # The default step is 128 input rows: one group of 128, two of 64, one of 256.
  for group, gps in ((128, 1), (64, 2), (256, 1)):
    p = plan(1, 4096, 4096 // group, group, W4A16Config())
    assert p.groups_per_stage == gps and p.steps_per_split * p.splits >= 4096 // group // gps
  assert plan(1, 4096, 64, 64, W4A16Config(groups_per_stage=1)).groups_per_stage == 1
  assert plan(1, 4096, 3, 64, W4A16Config()).groups_per_stage == 1      # a divisor of 3 groups
  p = plan(4, 192, 3, 128, W4A16Config(block_out=128, groups_per_stage=2, num_stages=8))
  assert (p.block_out, p.groups_per_stage, p.num_stages) == (64, 1, 3)   # divisors; <= steps
  p = plan(64, 4096, 8, 1024, W4A16Config(block_out=256, groups_per_stage=4, num_stages=8))
  assert p.smem_bytes <= w4.SMEM_PER_SM
  with pytest.raises(InputError, match="shared memory"):
    plan(64, 4096, 1, 4096, W4A16Config())
  # Groups below a chunk: 128 rows a step (4 groups of 32, 8 of 16), always whole chunks.
  assert plan(1, 4096, 128, 32, W4A16Config()).groups_per_stage == 4
  assert plan(1, 4096, 256, 16, W4A16Config()).groups_per_stage == 8
  assert plan(1, 4096, 128, 32, W4A16Config(groups_per_stage=3)).groups_per_stage == 2
  assert plan(1, 4096, 128, 32, W4A16Config(groups_per_stage=1)).groups_per_stage == 2
  assert plan(1, 4096, 6, 32, W4A16Config()).groups_per_stage == 2       # 3 chunks: 1 a step


def test_refuses_unsupported_shapes():
  q = _weight(0, 128, 64)
  x = jnp.zeros((1, 128), jnp.bfloat16)
  run = lambda x, **kw: w4a16_matmul(x, q.codes, q.scale, q.zero, **{
      "in_features": 128, "group": 128, "interpret": INTERPRET, **kw})
  with pytest.raises(InputError, match="1..64 rows"):
    run(jnp.zeros((65, 128), jnp.bfloat16))
  with pytest.raises(InputError, match="bfloat16 or float16"):
    run(x.astype(jnp.float32))
  with pytest.raises(InputError, match="x must be"):
    run(jnp.zeros((1, 100), jnp.bfloat16))
  with pytest.raises(InputError, match="multiple of 64"):
    run(x, group=48)
  with pytest.raises(InputError, match="scale must be"):
    run(x, group=32)                                  # grids of 128 rows, not 4 x 32
  q96 = quantize_weight(jnp.ones((128, 96)), 128, "int4_t")
  with pytest.raises(InputError, match="Out=96"):
    w4a16_matmul(x, q96.codes, q96.scale, q96.zero, in_features=128, group=128)
  with pytest.raises(InputError, match="block_out"):
    W4A16Config(block_out=96)
  with pytest.raises(InputError, match="block_out"):
    W4A16Config(block_out=512)
  with pytest.raises(InputError, match="num_stages"):
    W4A16Config(num_stages=0)
  with pytest.raises(InputError, match="target_blocks must be None or a positive integer"):
    W4A16Config(target_blocks=0)
  # Counts are ints, numpy's too, not bools (num_splits=True ran one split; np.int64 stages
  # were refused as 'not a positive integer'), as W4A8Config takes them.
  with pytest.raises(InputError, match="num_splits must be None or a positive integer"):
    W4A16Config(num_splits=True)
  np_config = W4A16Config(num_stages=np.int64(2), block_out=np.int64(128))
  assert type(np_config.num_stages) is int and type(np_config.block_out) is int   # Barrier
  with pytest.raises(InputError, match="in_features must be a positive integer"):
    run(x, in_features=0)
  # A numpy integer group is an integer (it was refused as "must be a positive integer").
  sds = jax.ShapeDtypeStruct
  jax.jit(lambda *a: w4a16_matmul(*a, in_features=128, group=np.int64(128))).trace(
      sds((1, 128), jnp.bfloat16), q.codes, q.scale, q.zero).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("m,n_in,n_out,config,dtype,group", [
    (1, 4096, 6144, W4A16Config(), jnp.bfloat16, 128),                            # wqkv
    (4, 14336, 4096, W4A16Config(), jnp.bfloat16, 128),                           # w_down
    (8, 4096, 28672, W4A16Config(block_out=128, groups_per_stage=2), jnp.bfloat16, 128),
    (64, 4096, 4096, W4A16Config(block_out=256, num_stages=2), jnp.bfloat16, 128),  # most rows
    (3, 4096, 4096, W4A16Config(), jnp.float16, 128),
    (1, 4096, 28672, W4A16Config(), jnp.bfloat16, 64),              # two groups of 64 a step
    (1, 4096, 28672, W4A16Config(), jnp.bfloat16, 32),              # two groups a chunk
    (4, 14336, 4096, W4A16Config(), jnp.float16, 16),               # four groups a chunk
])
def test_lowers_to_mosaic_gpu_for_cuda(m, n_in, n_out, config, dtype, group):
  sds = jax.ShapeDtypeStruct
  args = (sds((m, n_in), dtype), sds((n_in // 64, n_out, 8), jnp.uint32),
          sds((n_in // group, n_out), jnp.float16), sds((n_in // group, n_out), jnp.float16))
  f = lambda x, c, s, z: w4a16_matmul(x, c, s, z, in_features=n_in, group=group, config=config)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu_v2" in text


# ----------------------------------------------------------------------------------------------
# The "int4_t" layout.
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_t_layout_holds_the_same_quantized_weight(group):
  w = rand.normal(jax.random.key(0), (172, 24), jnp.float32)   # In_pad 192 or 256
  t = quantize_weight(w, group=group, layout="int4_t")
  in_pad = -(-172 // group) * group
  assert t.layout == "int4_t" and t.codes.dtype == jnp.uint32
  assert t.codes.shape == (in_pad // 64, 24, 8)
  assert t.shape == (172, 24) and t.in_padded == in_pad
  for layout in LAYOUTS:
    other = quantize_weight(w, group=group, layout=layout)
    assert other.num_bytes() == t.num_bytes()
    np.testing.assert_array_equal(np.asarray(other.unsigned_codes()),
                                  np.asarray(t.unsigned_codes()))
    np.testing.assert_array_equal(np.asarray(other.dequantize()), np.asarray(t.dequantize()))
    np.testing.assert_array_equal(np.asarray(other.to_layout("int4_t").codes),
                                  np.asarray(t.codes))
    np.testing.assert_array_equal(np.asarray(t.to_layout(layout).codes),
                                  np.asarray(other.codes))
  codes = np.asarray(unpack_words(t.codes))                          # [In_pad / 64, Out, 64]
  c = np.asarray(quantize_weight(w, group=group, layout="int4").codes.astype(jnp.int32))
  np.testing.assert_array_equal(codes[1, 5, 7], c[64 + 7, 5])       # row (k, o), i: c[64k+i, o]


def test_int4_t_layout_refuses_groups_that_are_not_whole_chunks():
  with pytest.raises(InputError, match="multiple of 64"):
    quantize_weight(jnp.ones((30, 8)), group=10, layout="int4_t")
  with pytest.raises(InputError, match=r"multiple of 64 .* or one of \(16, 32\)"):
    quantize_weight(jnp.ones((128, 8)), group=48, layout="int4").to_layout("int4_t")


@pytest.mark.parametrize("group", [16, 32])
def test_int4_t_pads_small_groups_to_whole_chunks(group):
  """In = 96 at groups of 16 / 32: "int4_t" adds whole groups of zero weights up to 128 rows
  (2 chunks); the weight, its products and the conversions back are unchanged."""
  w = rand.normal(jax.random.key(3), (96, 64), jnp.float32)
  packed = quantize_weight(w, group=group)
  t = quantize_weight(w, group=group, layout="int4_t")
  assert packed.in_padded == 96 and t.in_padded == 128 and t.codes.shape == (2, 64, 8)
  assert t.scale.shape == (128 // group, 64) and t.shape == (96, 64)
  np.testing.assert_array_equal(np.asarray(packed.to_layout("int4_t").codes), np.asarray(t.codes))
  np.testing.assert_array_equal(np.asarray(t.dequantize()), np.asarray(packed.dequantize()))
  np.testing.assert_array_equal(np.asarray(t.to_layout("packed").dequantize()),
                                np.asarray(packed.dequantize()))
  x = rand.normal(jax.random.key(4), (3, 96))
  hi = jax.lax.Precision.HIGHEST
  np.testing.assert_allclose(np.asarray(quant_matmul(x, t, hi)),
                             np.asarray(quant_matmul(x, packed, hi)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_int4_t_matmul_equals_the_int4_layout(group):
  w = rand.normal(jax.random.key(0), (172, 64), jnp.float32)
  t = quantize_weight(w, group=group, layout="int4_t")
  int4 = t.to_layout("int4")
  x = rand.normal(jax.random.key(1), (2, 3, 172))
  hi = jax.lax.Precision.HIGHEST
  want = np.asarray(quant_matmul(x, int4, hi))
  got = np.asarray(jax.jit(quant_matmul, static_argnums=2)(x, t, hi))
  assert got.shape == (2, 3, 64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  grouped = np.asarray(quant_matmul(x, t.to_layout("int4_grouped"), hi))
  np.testing.assert_allclose(got, grouped, rtol=1e-5, atol=1e-4)   # fp32 sums, another order
  xb = x.astype(jnp.bfloat16)
  want = np.asarray(quant_matmul(xb, int4), np.float32)
  got = np.asarray(quant_matmul(xb, t), np.float32)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-2 * np.abs(want).max())


def test_quant_matmul_dispatches_int4_t_to_the_kernel_on_gpu():
  """Lowered for CUDA (whatever the default backend), quant_matmul on "int4_t" calls the one-row
  dp4a kernel (w4a8_gemv) for one row, the W4A16 kernel for 2..64 bf16 rows (and for one row where
  the dp4a kernel cannot: Out not a multiple of 128) and the jnp math otherwise; lowered for the
  CPU, the jnp math always."""
  t = quantize_weight(jnp.ones((256, 128)), 128, "int4_t")
  sds = jax.ShapeDtypeStruct

  def lowered(batch, rows, dtype=jnp.bfloat16, w=t, platform="cuda"):
    return jax.jit(quant_matmul).trace(sds((batch, rows, 256), dtype), w).lower(
        lowering_platforms=(platform,)).as_text()

  kernels = lambda text: ("w4a8_gemv_kernel" in text, "w4a16_gemv_kernel" in text)
  assert kernels(lowered(1, 1)) == (True, False)        # one row: dp4a
  assert kernels(lowered(2, 32)) == (False, True)       # 64 rows
  assert kernels(lowered(2, 33)) == (False, False)      # 66 rows: the jnp math
  assert kernels(lowered(1, 1, jnp.float32)) == (False, False)
  t64 = quantize_weight(jnp.ones((256, 64)), 128, "int4_t")
  assert kernels(lowered(1, 1, w=t64)) == (False, True)  # Out = 64
  assert kernels(lowered(1, 1, platform="cpu")) == (False, False)
  assert kernels(lowered(2, 32, platform="cpu")) == (False, False)


def test_forward_with_int4_t_draft_weights():
  """A forward with "int4_t" draft weights: the logits of the "int4" layout on the CPU (jnp
  math), and lowered for cuda all four quantized linears of the layer are a Mosaic GPU kernel
  (the one-row dp4a kernel: one token)."""
  from sparsedec.kv.dense import init_cache
  from sparsedec.model.config import ModelConfig
  from sparsedec.model.forward import forward
  from sparsedec.model.params import cast_params, init_random
  from sparsedec.model.quant_weights import params_to_layout, quantize_params

  cfg = ModelConfig(family="llama", vocab_size=61, hidden_size=128, intermediate_size=128,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
                    max_position_embeddings=1024, dtype="float32", attention="reference")
  params = init_random(cfg, jax.random.key(2), scale=0.5)
  tokens = jnp.asarray([[3, 5, 7]], jnp.int32)
  positions = jnp.arange(3)[None]
  run = jax.jit(forward, static_argnums=0)
  int4 = quantize_params(params, 64, "int4")
  want, _ = run(cfg, int4, tokens, positions, init_cache(cfg, 1, 128))
  got, _ = run(cfg, params_to_layout(int4, "int4_t"), tokens, positions,
               init_cache(cfg, 1, 128))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)

  cfg = cfg.replace(dtype="bfloat16")
  draft = quantize_params(cast_params(params, cfg.dtype), 64, "int4_t")
  text = jax.jit(forward, static_argnums=0).trace(
      cfg, draft, tokens[:, :1], positions[:, :1], init_cache(cfg, 1, 128)).lower(
          lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 4      # wqkv, wo, gate_up, down
  assert "w4a8_gemv_kernel" in text and "w4a16_gemv_kernel" not in text
