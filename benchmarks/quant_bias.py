"""How to compute quant_attention's per-(key group, query row) score bias fastest under XLA:GPU.

The wrapper of `pallas_kernels.quant_attention` computes, per KV head, q block, key group g and
query row n,
    bias[g, n] = sum_d q[n, d] * z_eff[g, d]  -  offset * sum_d rp(q[n, d] * s_K[g, d])
(rp: the bf16 rounding the kernel's B operand gets). Session 13's profile put this reduction at
6.3 us of a 61 us call at S = 64K, Tq = 1, and session 14's at 15.2 us of 93 us at Tq = 5. This
times candidate formulations in one run (calls chained in one jit, `_timing.time_loop`) and
reports each one's largest deviation from a float64 evaluation of the same sum:
  current       the wrapper's multiply-and-sum (both terms in one reduction);
  split_highest term 1 as an fp32 HIGHEST-precision dot, term 2 a reduction;
  split_bf16x3  term 1 as one bf16 dot against z_eff split into three bf16 parts (fp32
                accumulation), term 2 a reduction;
  zero_only_*   term 1 alone (what is left if the kernel's code tiles are centred,
                `word_tile(centered=True)`, so the offset term vanishes), as a reduction or as
                the bf16x3 dot.
Findings (H200, S = 64K, session 14, results/quant_bias_s14_h200.json; device us of the bias
kernels at Tq = 1 / Tq = 5): current 5.3 / 13.7 (one reduce fusion); split_highest 12.5 / 21.7
(the HIGHEST dot plus a reduction cost more than the fused reduction); split_bf16x3 wrong
(error 0.045: XLA elides the f32 -> bf16 -> f32 round trip that splits z_eff, so the parts are
not bf16; `lax.reduce_precision` is the way to round); zero_only_reduce 3.9 / 9.4, the only form
faster than current, and it needs the offset removed in-kernel, which cost more there (see
quant_attention's docstring). The wrapper keeps `current`.
Usage: python benchmarks/quant_bias.py --out results/quant_bias.json [--seq 65536 --tq 1,5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import time_loop, write_json  # noqa: E402

HKV, G_Q, D, GROUP = 8, 4, 128, 128          # Llama-3.1-8B: 32 query heads on 8 KV heads
OFFSET = 136.0                                # word_offset(bf16)


def _rows(tq):
  n_rows = tq * G_Q
  return -(-n_rows // 8) * 8


def _term2(qf, ks):
  qs = lax.reduce_precision(qf * ks, exponent_bits=8, mantissa_bits=7)
  return qs.sum(-1)


def current(q, z, ks):
  """q [B, Hkv, N, D] bf16; z, ks [B, Hkv, S/G, D] fp32 -> [B, Hkv, S/G, N] fp32."""
  qf = q.astype(jnp.float32)[:, :, None]                 # [B, Hkv, 1, N, D]
  zz, kk = z[:, :, :, None], ks[:, :, :, None]          # [B, Hkv, S/G, 1, D]
  qs = lax.reduce_precision(qf * kk, exponent_bits=8, mantissa_bits=7)
  return (qf * zz - OFFSET * qs).sum(-1)


def _bf16x3(x):
  hi = x.astype(jnp.bfloat16)
  r1 = x - hi.astype(jnp.float32)
  mid = r1.astype(jnp.bfloat16)
  lo = (r1 - mid.astype(jnp.float32)).astype(jnp.bfloat16)
  return hi, mid, lo


def _term1_highest(q, z):
  return jnp.einsum("bhnd,bhgd->bhgn", q.astype(jnp.float32), z,
                    precision=lax.Precision.HIGHEST)


def _term1_bf16x3(q, z):
  parts = jnp.concatenate(_bf16x3(z), axis=2)            # [B, Hkv, 3 S/G, D] bf16
  t = jnp.einsum("bhnd,bhgd->bhgn", q, parts, preferred_element_type=jnp.float32)
  g = z.shape[2]
  return t[:, :, :g] + t[:, :, g:2 * g] + t[:, :, 2 * g:]


def _term1_reduce(q, z):
  return (q.astype(jnp.float32)[:, :, None] * z[:, :, :, None]).sum(-1)


def split_highest(q, z, ks):
  return _term1_highest(q, z) - OFFSET * _term2(q.astype(jnp.float32)[:, :, None],
                                                ks[:, :, :, None])


def split_bf16x3(q, z, ks):
  return _term1_bf16x3(q, z) - OFFSET * _term2(q.astype(jnp.float32)[:, :, None],
                                               ks[:, :, :, None])


def zero_only_reduce(q, z, ks):
  del ks
  return _term1_reduce(q, z)


def zero_only_bf16x3(q, z, ks):
  del ks
  return _term1_bf16x3(q, z)


FORMS = dict(current=current, split_highest=split_highest, split_bf16x3=split_bf16x3,
             zero_only_reduce=zero_only_reduce, zero_only_bf16x3=zero_only_bf16x3)


def _exact(q, z, ks, with_offset):
  q64 = np.asarray(q.astype(jnp.float32), np.float64)[:, :, None]
  z64 = np.asarray(z, np.float64)[:, :, :, None]
  out = (q64 * z64).sum(-1)
  if with_offset:
    qs = np.asarray(lax.reduce_precision(q.astype(jnp.float32)[:, :, None] * ks[:, :, :, None],
                                         exponent_bits=8, mantissa_bits=7), np.float64)
    out = out - OFFSET * qs.sum(-1)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--seq", type=int, default=65536)
  p.add_argument("--tq", default="1,5")
  p.add_argument("--calls", type=int, default=400)
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  t0 = time.time()
  res = dict(device=str(jax.devices()[0].device_kind), S=a.seq, Hkv=HKV, D=D, group=GROUP,
             rows=[])
  key = jax.random.key(0)
  for tq in (int(t) for t in a.tq.split(",")):
    n = _rows(tq)
    k1, k2, k3 = jax.random.split(jax.random.fold_in(key, tq), 3)
    q = jax.random.normal(k1, (1, HKV, n, D), jnp.float32).astype(jnp.bfloat16)
    ks = jnp.abs(jax.random.normal(k2, (1, HKV, a.seq // GROUP, D), jnp.float32)) * 0.05 + 0.01
    z = jax.random.normal(k3, (1, HKV, a.seq // GROUP, D), jnp.float32) * 0.5
    ref_full, ref_zero = _exact(q, z, ks, True), _exact(q, z, ks, False)
    for name, fn in FORMS.items():
      out = np.asarray(jax.jit(fn)(q, z, ks), np.float64)
      ref = ref_zero if name.startswith("zero_only") else ref_full
      err = float(np.max(np.abs(out - ref)))
      t = time_loop(fn, q, z, ks, num_calls=a.calls, profile=True)
      row = dict(tq=tq, rows=n, form=name, us=round(t["min_s"] * 1e6, 2),
                 device_us=round(t.get("device_s", float("nan")) * 1e6, 2),
                 kernels_per_call=t.get("kernels_per_call"),
                 by_kernel={k: round(v * 1e6, 2)
                            for k, v in t.get("device_time_by_kernel", {}).items()},
                 max_abs_err_vs_f64=err, ref_scale=float(np.max(np.abs(ref))))
      res["rows"].append(row)
      print(row, flush=True)
      write_json(a.out, res)
  res["seconds"] = round(time.time() - t0, 1)
  write_json(a.out, res)


if __name__ == "__main__":
  main()
