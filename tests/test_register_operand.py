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
  offset = 0 if centered else word_offset(dtype)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(value + offset, np.float32))
  text = jax.jit(word_tile_kernel(planes, dtype, centered=centered)).trace(
      jax.ShapeDtypeStruct(words.shape, jnp.uint32)).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu_v2" in text
