"""Attention for one forward: in-flight queries against a committed cache plus in-flight K/V.

One entry point, `attend`. An `AttentionPlan` says what each in-flight query reads:
  * `segments`: consecutive query ranges, each with a cache *view* (`FullView`: every committed
    entry of its row; later methods add block lists and quantized reads),
  * `inflight_mask` [T, T]: which in-flight tokens each query sees (causal, n-gram columns, trees).
Queries always attend with the committed part and the in-flight part normalised together
(a two-part softmax, so the cache is never concatenated with the new entries).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class FullView:
  """Read all committed entries of the row (slots 0 .. lengths[b]-1)."""


@struct.dataclass
class Segment:
  view: Any                                       # FullView | ... (a pytree)
  start: int = struct.field(pytree_node=False)    # first query index (inclusive)
  stop: int = struct.field(pytree_node=False)     # last query index (exclusive)


@struct.dataclass
class AttentionPlan:
  inflight_mask: jax.Array                        # [T, T] bool: query t sees in-flight key u
  segments: tuple[Segment, ...] = struct.field(pytree_node=True)

  @property
  def num_tokens(self) -> int:
    return self.inflight_mask.shape[-1]


def causal_plan(num_tokens: int) -> AttentionPlan:
  """Every query reads the full cache and the in-flight tokens up to itself."""
  mask = jnp.asarray(np.tril(np.ones((num_tokens, num_tokens), dtype=bool)))
  return AttentionPlan(inflight_mask=mask, segments=(Segment(FullView(), 0, num_tokens),))


def _cache_mask(view, lengths: jax.Array, q_pos: jax.Array, capacity: int,
                window: int | None) -> jax.Array:
  """[B, Tseg, S] bool: which cache slots each query of the segment reads."""
  slots = jnp.arange(capacity, dtype=jnp.int32)
  if isinstance(view, FullView):
    mask = slots[None, None, :] < lengths[:, None, None]
  else:
    raise TypeError(f"unknown cache view {type(view).__name__}")
  if window is not None:
    mask &= (q_pos[:, :, None] - slots[None, None, :]) < window
  return jnp.broadcast_to(mask, (lengths.shape[0], q_pos.shape[1], capacity))


def _f32_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """einsum with fp32 accumulation. XLA:CPU cannot run bf16 x bf16 -> f32 dots, so there the
  operands are upcast (the same result; GPUs accumulate bf16 products in fp32 natively)."""
  if jax.default_backend() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def reference_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                        cache_mask: jax.Array, k_new: jax.Array, v_new: jax.Array,
                        inflight_mask: jax.Array, return_lse: bool = False):
  """Pure-jnp attention, fp32 softmax and accumulation.

  q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; cache_mask [B, T, S];
  k_new, v_new [B, U, Hkv, D]; inflight_mask [B, T, U]. Returns out [B, T, Hq, D] (q's dtype)
  and, with return_lse, the log-sum-exp [B, T, Hq] (fp32).
  """
  b, t, hq, d = q.shape
  hkv = k_cache.shape[1]
  qg = q.reshape(b, t, hkv, hq // hkv, d)                                   # [B, T, Hkv, G, D]
  scale = d ** -0.5
  s_c = _f32_einsum("bthgd,bhsd->bhgts", qg, k_cache) * scale             # [B, Hkv, G, T, S]
  s_n = _f32_einsum("bthgd,buhd->bhgtu", qg, k_new) * scale               # [B, Hkv, G, T, U]
  s_c = jnp.where(cache_mask[:, None, None], s_c, -jnp.inf)
  s_n = jnp.where(inflight_mask[:, None, None], s_n, -jnp.inf)
  m = jnp.maximum(s_c.max(-1), s_n.max(-1))                                 # [B, Hkv, G, T]
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p_c = jnp.exp(s_c - m[..., None])
  p_n = jnp.exp(s_n - m[..., None])
  denom = p_c.sum(-1) + p_n.sum(-1)                                         # [B, Hkv, G, T]
  o = (_f32_einsum("bhgts,bhsd->bthgd", p_c.astype(v_cache.dtype), v_cache)
       + _f32_einsum("bhgtu,buhd->bthgd", p_n.astype(v_new.dtype), v_new))  # [B, T, Hkv, G, D]
  inv = jnp.where(denom > 0, 1.0 / denom, 0.0).transpose(0, 3, 1, 2)[..., None]  # [B,T,Hkv,G,1]
  out = (o * inv).reshape(b, t, hq, d).astype(q.dtype)
  if not return_lse:
    return out
  lse = (m + jnp.log(denom)).transpose(0, 3, 1, 2).reshape(b, t, hq)
  return out, lse


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
           k_new: jax.Array, v_new: jax.Array, q_pos: jax.Array, plan: AttentionPlan,
           window: int | None = None) -> jax.Array:
  """Attention of in-flight queries q [B, T, Hq, D] at positions q_pos [B, T].

  k_cache, v_cache [B, Hkv, S, D] with lengths [B]; k_new, v_new [B, T, Hkv, D]. In-flight key u
  has position q_pos[:, u]. Returns [B, T, Hq, D].
  """
  b, t = q.shape[:2]
  capacity = k_cache.shape[2]
  inflight = jnp.broadcast_to(plan.inflight_mask, (b, t, t))
  if window is not None:
    inflight &= (q_pos[:, :, None] - q_pos[:, None, :]) < window
  outs = []
  for seg in plan.segments:
    sl = slice(seg.start, seg.stop)
    mask = _cache_mask(seg.view, lengths, q_pos[:, sl], capacity, window)
    outs.append(reference_attention(q[:, sl], k_cache, v_cache, mask, k_new, v_new,
                                    inflight[:, sl]))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
