"""pallas_kernels.dequantize_kv: the Mosaic GPU dequantization of a QuantKV (interpret mode on
the CPU) against its jnp reference, bit for bit; lowering for cuda; bad inputs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rand
from kernel_mode import INTERPRET
from pallas_kernels.dequantize_kv import dequantize_kv, dequantize_kv_reference
from pallas_kernels.quant_attention import QuantKV, quantize_kv



@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 16), batch=st.sampled_from([1, 2]),
       num_kv_heads=st.sampled_from([1, 2]), tiles=st.integers(1, 3),
       head_dim=st.sampled_from([64, 128]), group=st.sampled_from([64, 128]),
       bits=st.sampled_from([4, 8]), dtype=st.sampled_from([jnp.bfloat16, jnp.float16]))
def test_kernel_equals_the_reference_bit_for_bit(seed, batch, num_kv_heads, tiles, head_dim,
                                                 group, bits, dtype):
  """Every slot of k and v, over token tiles, key groups spanning one or two tiles, both head
  dims, both read widths and output types (K spread per channel, V per token, both offset)."""
  capacity = 64 * tiles * (group // 64)
  keys = jax.random.split(jax.random.key(seed), 4)
  shape = (batch, num_kv_heads, capacity, head_dim)
  k = rand.normal(keys[0], shape) * rand.uniform(keys[1], shape[:2] + (1, head_dim),
                                                  minval=0.1, maxval=4.0)
  v = rand.normal(keys[2], shape) * 2.0 + rand.normal(keys[3], shape[:3] + (1,))
  qkv = quantize_kv(k, v, group=group)
  got = dequantize_kv(qkv, bits, dtype, interpret=INTERPRET)
  want = dequantize_kv_reference(qkv, bits, dtype)
  for x, y in zip(got, want):
    assert x.shape == shape and x.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_4bit_read_ignores_the_lower_plane_and_8bit_reads_it():
  k = rand.normal(jax.random.key(0), (1, 1, 64, 64))
  qkv = quantize_kv(k, k + 1.0, group=64)
  scrambled = dataclasses.replace(qkv, k_codes=qkv.k_codes.at[:, :, 1].set(0x12345678),
                                  v_codes=qkv.v_codes.at[:, :, 1].set(0x9ABCDEF0))
  for bits, same in ((4, True), (8, False)):
    a = dequantize_kv(qkv, bits, interpret=INTERPRET)
    b = dequantize_kv(scrambled, bits, interpret=INTERPRET)
    for x, y in zip(a, b):
      assert bool(jnp.array_equal(x, y)) == same


@pytest.mark.parametrize("round_to,dtype",
                         [(64, jnp.int32), (128, jnp.int32), (64, jnp.uint32)])
def test_lengths_bound_the_tiles_written(round_to, dtype):
  """With lengths, the tiles below round_up(length, round_to) are the reference's bit for bit and
  the rest are never written: the interpreter fills unwritten output with NaN, so a kernel that
  wrote (or read) past the bound would show here (on a GPU unwritten memory holds anything, so
  there only the written part is checked). Lengths past the capacity are clipped, a uint32 one
  past int32's range too (it wrapped to a negative length that wrote nothing)."""
  k = rand.normal(jax.random.key(1), (3, 2, 256, 64))
  qkv = quantize_kv(k, 0.5 * k + 1.0, group=64)
  lengths = jnp.array([70, 0, 999 if dtype == jnp.int32 else 2**32 - 2], dtype)
  got = dequantize_kv(qkv, 8, lengths=lengths, round_to=round_to, interpret=INTERPRET)
  want = dequantize_kv_reference(qkv, 8)
  for x, y in zip(got, want):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    for row, bound in enumerate((-(-70 // round_to) * round_to, 0, 256)):
      np.testing.assert_array_equal(x[row, :, :bound], y[row, :, :bound])
      if INTERPRET is not None:
        assert np.isnan(x[row, :, bound:]).all(), (row, bound)


@pytest.mark.parametrize("bits,head_dim,dtype", [(4, 128, jnp.bfloat16), (8, 128, jnp.bfloat16),
                                                 (8, 64, jnp.float16)])
def test_lowers_to_mosaic_gpu_custom_call_for_cuda(bits, head_dim, dtype):
  f = jax.jit(lambda qkv: dequantize_kv(qkv, bits, dtype))
  text = f.trace(QuantKV.abstract(1, 8, 4096, head_dim)).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu_v2" in text
  assert "dequantize_kv_kernel" in text


def test_bad_inputs_are_rejected_in_plain_words():
  qkv = quantize_kv(jnp.ones((1, 1, 64, 64)), jnp.ones((1, 1, 64, 64)), group=64)
  with pytest.raises(ValueError, match="bits must be 4 or 8"):
    dequantize_kv(qkv, 6)
  with pytest.raises(ValueError, match="bits must be 4 or 8, got 4.0"):   # 4.0 in (4, 8): was taken
    dequantize_kv(qkv, 4.0)
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    dequantize_kv(qkv, 4, jnp.float32)
  narrow = quantize_kv(jnp.ones((1, 1, 64, 32)), jnp.ones((1, 1, 64, 32)), group=64)
  with pytest.raises(ValueError, match="head_dim 32 must be a multiple of 64"):
    dequantize_kv(narrow, 4)
  # D = 512 passed and failed Mosaic's lowering on a GPU (a TMA box of <= 256 elements).
  with pytest.raises(ValueError, match="head_dim 512 must be a multiple of 64 and at most 256"):
    jax.jit(lambda x: dequantize_kv(x, 4)).trace(QuantKV.abstract(1, 1, 128, 512, group=64))
  with pytest.raises(ValueError, match="round_to must be a positive multiple of 64"):
    dequantize_kv(qkv, 4, lengths=jnp.array([64]), round_to=96)
  with pytest.raises(ValueError, match="round_to must be .* got 64.0"):   # was lax.div's error
    dequantize_kv(qkv, 4, lengths=jnp.array([64]), round_to=64.0)
  # A v_codes of another capacity: was a reshape TypeError.
  with pytest.raises(ValueError, match="qkv.v_codes must be"):
    dequantize_kv(dataclasses.replace(qkv, v_codes=qkv.v_codes[:, :, :1]), 4)
  with pytest.raises(ValueError, match="Hkv=0"):
    dequantize_kv(jax.tree_util.tree_map(lambda x: x[:, :0], qkv), 4)
  with pytest.raises(ValueError, match=r"lengths must be \[B=1\]"):
    dequantize_kv(qkv, 4, lengths=jnp.array([64, 64]))
  with pytest.raises(ValueError, match="lengths must be integer"):
    dequantize_kv(qkv, 4, lengths=jnp.array([64.5]))
  # Scales and zeros in another dtype reached Mosaic as a raw error.
  wide = dataclasses.replace(qkv, v_scale=qkv.v_scale.astype(jnp.float32))
  with pytest.raises(ValueError, match="qkv.v_scale must be float16"):
    dequantize_kv(wide, 4)
  # A capacity that is not whole key groups (S = 192, G = 128: k_scale [.., S // G = 1, D]
  # matched): slots 128..191 read scales past the array, silent wrong keys. Likewise G > S.
  odd = quantize_kv(jnp.ones((1, 1, 192, 64)), jnp.ones((1, 1, 192, 64)), group=64)
  odd = dataclasses.replace(odd, k_scale=odd.k_scale[:, :, :1], k_zero=odd.k_zero[:, :, :1],
                            group=128)
  with pytest.raises(ValueError, match="qkv.group must be a positive int dividing .* S=192"):
    dequantize_kv(odd, 8, interpret=INTERPRET)
  big = dataclasses.replace(qkv, k_scale=qkv.k_scale[:, :, :0], k_zero=qkv.k_zero[:, :, :0],
                            group=128)
  with pytest.raises(ValueError, match="qkv.group must be a positive int dividing .* S=64"):
    dequantize_kv(big, 8, interpret=INTERPRET)
