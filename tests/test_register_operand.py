"""Code tiles as words in wgmma fragment order (`pallas_kernels.register_operand`): the packing
round trip and its column map, and `word_tile` in a small Mosaic GPU kernel, in interpret mode
(values) and lowered for cuda (the inline Mosaic GPU path builds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import mosaic_gpu as plgpu

import rand
from pallas_kernels import register_operand as ro
from pallas_kernels.register_operand import (pack_words, unpack_words, word_offset,
                                             word_tile_kernel)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 16), lead=st.integers(1, 3),
       length=st.sampled_from([8, 16, 64, 128, 192]))
def test_pack_unpack_round_trip(seed, lead, length):
  codes = rand.randint(jax.random.key(seed), (lead, 5, length), -8, 8)
  words = pack_words(codes)
  assert words.dtype == jnp.uint32 and words.shape == (lead, 5, length // 8)
  np.testing.assert_array_equal(unpack_words(words), codes)


def test_a_64_code_row_is_stored_in_fragment_order():
  """Word j = 2c + h, nibble n = k + 4e holds column 32h + 8k + 2c + e (two's complement); a
  row of any other length is stored in plain order."""
  cols = np.arange(64)
  words = np.asarray(pack_words(jnp.asarray(cols % 16 - 8)))          # column c holds c%16 - 8
  j, n = np.divmod(np.arange(64), 8)
  c, h, k, e = j // 2, j % 2, n % 4, n // 4
  stored = (words[j] >> (4 * n)) & 0xF
  np.testing.assert_array_equal(stored, (32 * h + 8 * k + 2 * c + e) % 16 ^ 8)
  plain = np.asarray(pack_words(jnp.arange(16) - 8))
  np.testing.assert_array_equal((plain[j[:16]] >> (4 * n[:16])) & 0xF, (np.arange(16) - 8) & 0xF)
  with pytest.raises(ValueError, match="whole number of 8-code words"):
    pack_words(jnp.zeros((12,), jnp.int32))


@pytest.mark.parametrize("planes,centered", [(1, False), (2, False), (1, True)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_word_tile_values_and_cuda_lowering(planes, centered, dtype):
  """One plane: code + offset; two: 16 upper + lower + offset, exact in the 16-bit dtype;
  centered: without the offset."""
  codes = rand.randint(jax.random.key(planes), (planes, 64, 64), -8, 8)
  words = pack_words(codes).reshape(planes, 16, 32)
  got = word_tile_kernel(planes, dtype, plgpu.InterpretGPUParams(), centered)(words)
  value = codes[0] if planes == 1 else 16 * codes[0] + codes[1]
  offset = 0 if centered else word_offset(dtype, planes)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(value + offset, np.float32))
  text = jax.jit(word_tile_kernel(planes, dtype, centered=centered)).trace(
      jax.ShapeDtypeStruct(words.shape, jnp.uint32)).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu_v2" in text


def _lop3_6a(a, b, c):
  """PTX lop3.b32 with LUT 0x6a: (a & b) ^ c."""
  return (a & b) ^ c


def test_fp16_two_plane_recipe_gives_the_8bit_code_plus_offset():
  """The integer recipe `word_tile` emits for an fp16 two-plane tile, emulated on uint32 words:
  for every (upper, lower) code pair in both halves of a word and every nibble position k, the
  fp16 it builds is 16 upper + lower + word_offset(fp16, 2) exactly (the GPU check compiles it:
  benchmarks/quant_gpu_check.py)."""
  upper, lower = np.meshgrid(np.arange(-8, 8), np.arange(-8, 8), indexing="ij")
  upper, lower = upper.ravel(), lower.ravel()                             # every pair
  mask4 = 0x000F000F
  magic = ro._MAGIC_FP16_PLANES * 0x10001
  for k in range(4):
    # Word halves: codes at nibble k (bits 4k..) and 4 + k (bits 16 + 4k..); others random.
    rng = np.random.default_rng(k)
    up_w = rng.integers(0, 2 ** 32, upper.size, dtype=np.uint64).astype(np.uint32)
    lo_w = rng.integers(0, 2 ** 32, upper.size, dtype=np.uint64).astype(np.uint32)
    for half, (u, l) in enumerate([(upper, lower), (lower, upper)]):
      shift = np.uint32(4 * k + 16 * half)
      clear = ~np.uint32(0xF << (4 * k + 16 * half))
      up_w = (up_w & clear) | ((u & 0xF).astype(np.uint32) << shift)
      lo_w = (lo_w & clear) | ((l & 0xF).astype(np.uint32) << shift)
    lo = _lop3_6a(lo_w >> np.uint32(4 * k), np.uint32(mask4), np.uint32(magic))
    hi = (up_w << np.uint32(4) if k == 0 else up_w if k == 1 else up_w >> np.uint32(4 * k - 4))
    bits = _lop3_6a(hi, np.uint32(0x00F000F0), lo)
    values = bits.view(np.float16).astype(np.float32).reshape(-1, 2)      # (half 0, half 1)
    offset = word_offset(jnp.float16, 2)
    np.testing.assert_array_equal(values[:, 0], 16 * upper + lower + offset)
    np.testing.assert_array_equal(values[:, 1], 16 * lower + upper + offset)
