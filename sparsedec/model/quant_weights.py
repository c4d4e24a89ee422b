"""4-bit group-wise weight-only quantization (W4A16) of the linear layers, for QuantSpec's draft.

A weight w [In, Out] (x @ w convention) is cut into groups of `group` consecutive input rows
(In zero-padded up to a multiple of the group); each (group, output column) gets an asymmetric
round-to-nearest grid: zero z = group min, step s = (max - z) / 15 (1 for a constant group),
code c = clip(round((w - z) / s), 0, 15), w ~ z + c * s. Scales and zeros are stored in fp16
(rounded like the KV quantizer: zero down, step up, so no code ever clips); codes are packed two
per byte along In (row 2i in the low nibble, row 2i + 1 in the high one).

`linear` (sparsedec.model.linear) dequantizes a `QuantWeight` and multiplies: the reference
W4A16 matmul. A params pytree from `quantize_params` is a drop-in for the forward. Quantized:
wqkv, wo, w_gate_up, w_down of every layer; embeddings, lm_head, norms and biases stay as they
are (the paper quantizes the transformer's linear layers; the vocabulary projection is a small
share of a large model's bytes and the most sensitive to rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from sparsedec.errors import InputError

QUANTIZED_LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
META_DTYPE = jnp.float16


@struct.dataclass
class QuantWeight:
  codes: jax.Array   # [In_pad / 2, Out] uint8: rows 2i (low nibble) and 2i + 1 (high nibble)
  scale: jax.Array   # [In_pad / G, Out] fp16
  zero: jax.Array    # [In_pad / G, Out] fp16
  in_features: int = struct.field(pytree_node=False)
  group: int = struct.field(pytree_node=False)

  @property
  def shape(self) -> tuple[int, int]:
    return (self.in_features, self.codes.shape[1])

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """[In, Out] in `dtype` (computed in fp32)."""
    c = self.codes.astype(jnp.int32)
    codes = jnp.stack([c & 15, c >> 4], axis=1).reshape(-1, c.shape[1])     # [In_pad, Out]
    scale = jnp.repeat(self.scale.astype(jnp.float32), self.group, axis=0)
    zero = jnp.repeat(self.zero.astype(jnp.float32), self.group, axis=0)
    w = codes.astype(jnp.float32) * scale + zero
    return w[: self.in_features].astype(dtype)

  def num_bytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in (self.codes, self.scale, self.zero))


def _to_meta(x: jax.Array, direction: int) -> jax.Array:
  r = x.astype(META_DTYPE)
  rf = r.astype(jnp.float32)
  toward = jnp.array(-jnp.inf if direction < 0 else jnp.inf, META_DTYPE)
  off = rf > x if direction < 0 else rf < x
  return jnp.where(off, jnp.nextafter(r, toward), r)


def quantize_weight(w: jax.Array, group: int = 128) -> QuantWeight:
  """w [In, Out] -> QuantWeight (4-bit, asymmetric RTN, groups of `group` input rows)."""
  if w.ndim != 2:
    raise InputError(f"a weight to quantize must be [In, Out], got shape {w.shape}")
  if not isinstance(group, int) or group < 2 or group % 2:
    raise InputError(f"weight quant group must be an even integer >= 2, got {group!r}")
  n_in, n_out = w.shape
  pad = -n_in % group
  wf = jnp.pad(w.astype(jnp.float32), ((0, pad), (0, 0)))
  if pad:   # padded rows copy the group's last real row, so they never widen its range
    wf = wf.at[n_in:].set(jnp.broadcast_to(wf[n_in - 1], (pad, n_out)))
  grouped = wf.reshape(-1, group, n_out)                                   # [In_pad/G, G, Out]
  zero = _to_meta(grouped.min(1), -1)
  step = _to_meta((grouped.max(1) - zero.astype(jnp.float32)) * jnp.float32(1 / 15), +1)
  step = jnp.where(step > 0, step, jnp.ones_like(step))
  c = jnp.round((grouped - zero.astype(jnp.float32)[:, None]) / step.astype(jnp.float32)[:, None])
  c = jnp.clip(c, 0, 15).astype(jnp.uint8).reshape(-1, n_out)              # [In_pad, Out]
  packed = c[0::2] | (c[1::2] << 4)
  return QuantWeight(codes=packed, scale=step, zero=zero, in_features=n_in, group=group)


def quantize_params(params: dict, group: int = 128) -> dict:
  """A copy of the params pytree with every layer's linear weights as QuantWeight."""
  layers = [{name: quantize_weight(x, group) if name in QUANTIZED_LINEARS else x
             for name, x in lp.items()} for lp in params["layers"]]
  return {**params, "layers": layers}


def weights_bytes(params: dict) -> int:
  """Bytes of a params pytree (QuantWeight leaves count their codes and scales)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
