"""The log-sum-exp combine shared by the split-KV kernels (plain jnp, small).

A kernel leaves, per (row, KV head, q block, split), an un-normalised partial output `acc`, its
row max `m2` (log2 units) and row sum `l`. `combine_partials` merges those with key sets that are
attended exactly here (the step's in-flight tokens; QuantSpec's full-precision recent segment),
into one softmax over everything.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

LN2 = math.log(2.0)


def combine_partials(acc: jax.Array, m2: jax.Array, l: jax.Array, q: jax.Array,
                     exact: Sequence[tuple[jax.Array, jax.Array, jax.Array]], *, group: int
                     ) -> tuple[jax.Array, jax.Array]:
  """acc [B, Hkv, NQB, NS, R, D] fp32; m2, l [B, Hkv, NQB, NS, 64] (m2 in log2 units; rows
  r = t * G + g of q block j are j * 64 + r); q [B, T, Hq, D];
  exact: (k [B, U, Hkv, D], v [B, U, Hkv, D], mask [B or 1, T, U] bool) key sets.
  Returns out [B, T, Hq, D] fp32 and lse [B, T, Hq] fp32."""
  b, hkv, nqb, ns, rows_out, d = acc.shape
  tq = q.shape[1]
  n_rows = tq * group                                                      # real rows
  # [B, Hkv, NQB, NS, R, ...] -> [B, Hkv, NS, NQB * R, ...]; for NQB > 1, R == 64.
  to_rows = lambda x: jnp.moveaxis(x, 3, 2).reshape(*x.shape[:2], ns, nqb * rows_out,
                                                     *x.shape[5:])[:, :, :, :n_rows]
  acc_r = to_rows(acc)                                                     # [B, Hkv, NS, N, D]
  m_r = to_rows((m2 * LN2)[..., :rows_out])                                # [B, Hkv, NS, N]
  l_r = to_rows(l[..., :rows_out])                                         # [B, Hkv, NS, N]

  qg = q.reshape(b, tq, hkv, group, d)                                     # [B, T, Hkv, G, D]
  scores = []
  for k, _, mask in exact:
    s = jnp.einsum("bthgd,buhd->bhtgu", qg, k,
                   preferred_element_type=jnp.float32) * d ** -0.5        # [B, Hkv, T, G, U]
    s = jnp.where(mask[:, None, :, None, :], s, -jnp.inf)
    scores.append(s.reshape(b, hkv, n_rows, -1))                           # [B, Hkv, N, U]

  m_tot = m_r.max(2)                                                       # [B, Hkv, N]
  for s in scores:
    m_tot = jnp.maximum(m_tot, s.max(-1))
  m_tot = jnp.where(jnp.isfinite(m_tot), m_tot, 0.0)
  w_c = jnp.exp(m_r - m_tot[:, :, None])                                   # [B, Hkv, NS, N]
  denom = (w_c * l_r).sum(2)                                               # [B, Hkv, N]
  o = jnp.einsum("bhsn,bhsnd->bhnd", w_c, acc_r)                           # [B, Hkv, N, D]
  for (_, v, _), s in zip(exact, scores):
    p = jnp.exp(s - m_tot[..., None])                                      # [B, Hkv, N, U]
    denom = denom + p.sum(-1)
    o = o + jnp.einsum("bhnu,buhd->bhnd", p.astype(v.dtype), v,
                       preferred_element_type=jnp.float32)
  o = o * jnp.where(denom > 0, 1.0 / denom, 0.0)[..., None]
  lse = m_tot + jnp.log(denom)                                             # [B, Hkv, N]
  out = o.reshape(b, hkv, tq, group, d).transpose(0, 2, 1, 3, 4).reshape(b, tq, hkv * group, d)
  lse = lse.reshape(b, hkv, tq, group).transpose(0, 2, 1, 3).reshape(b, tq, hkv * group)
  return out, lse
