"""Tiling sweep of `quant_attention` against `decode_attention`, one run, one device (GPU).

The issue-3 shape (Hq = 32, Hkv = 8, D = 128, bf16, B = 1, Tq = 1 or --tq) at one context S: the
bf16 decode_attention call, then quant_attention at 4 and 8 bits for each tiling in the grid
(block_kv x num_stages x target_blocks), each timed whole (the call: kernel, merge kernel and
relayouts), as the quantized splits alone (`_quant_partials`, "kernel_only"), with the blocks
that attend the full-precision keys beside them ("kernel_exact"), and the merge kernel alone
("merge"), next to the device read bandwidth measured in the same run.
`--module` names an alternative implementation (e.g. the previous kernel saved to a file) to
time beside the current one. Writes JSON incrementally.

  python benchmarks/quant_sweep.py --seq 65536 --out $OUT/quant_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import itertools
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import loop_fields, read_bandwidth, time_loop, write_json  # noqa: E402
from pallas_kernels import quant_attention as qa  # noqa: E402
from pallas_kernels.dequantize_kv import dequantize_kv, dequantize_kv_reference  # noqa: E402
from pallas_kernels.decode_attention import decode_attention  # noqa: E402
from pallas_kernels.merge_partials import merge_partials  # noqa: E402

HQ, HKV, D, GROUP, RECENT, RECENT_CAPACITY = 32, 8, 128, 128, 192, 256


def normal_bf16(key, shape):
  """Standard normal values in bf16 from the integer seed `key`."""
  return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(jnp.bfloat16)


def _inputs(b: int, s: int, tq: int):
  k = normal_bf16(1, (b, HKV, s, D))                                     # [B, Hkv, S, D]
  v = normal_bf16(2, (b, HKV, s, D))
  qkv = qa.quantize_kv(k, v, group=GROUP)
  x = dict(q=normal_bf16(3, (b, tq, HQ, D)), k_new=normal_bf16(4, (b, tq, HKV, D)),
           v_new=normal_bf16(5, (b, tq, HKV, D)), mask=jnp.tril(jnp.ones((tq, tq), bool)),
           k_full=normal_bf16(6, (b, HKV, RECENT_CAPACITY, D)),
           v_full=normal_bf16(7, (b, HKV, RECENT_CAPACITY, D)))
  return k, v, qkv, x


def load_module(path: str, name: str = "alt_quant_attention"):
  """The module in the file `path` (another version of a kernel file), registered as `name`."""
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod              # dataclasses look their module up while defined
  spec.loader.exec_module(mod)
  return mod


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--seq", type=int, default=65536)
  p.add_argument("--length", type=int, default=0,
                 help="tokens each row holds (0: --seq, the capacity); bytes count this length")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--tq", type=int, default=1, help="queries per call (in-flight mask causal)")
  p.add_argument("--block-kv", default="64,128,256",
                 help="keys per pipeline stage (0: the default for the call's rows)")
  p.add_argument("--stages", default="2,4")
  p.add_argument("--target-blocks", default="0,528,1056", help="0: the default (one wave)")
  p.add_argument("--bits", default="4,8")
  p.add_argument("--block-m", default="auto",
                 help="query rows per q block at most (block_m; auto: the planner's, None)")
  p.add_argument("--path", default="fused",
                 help="QuantAttentionConfig.path values (fused,dequantize,auto); the kernel-only "
                      "parts are timed for fused only")
  p.add_argument("--calls-only", action="store_true",
                 help="time the whole call only (not the kernel / exact / merge parts)")
  p.add_argument("--calls", type=int, default=200)
  p.add_argument("--module", help="another quant_attention.py to time with its default config")
  p.add_argument("--interpret", action="store_true", help="CPU dry run (Mosaic interpreter)")
  p.add_argument("--profile", action="store_true",
                 help="also record each call's GPU busy time by kernel (profiler)")
  p.add_argument("--profile-top", type=int, default=6, help="kernels listed by the profile")
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  b, s, tq = a.batch, a.seq, a.tq
  n_tok = a.length or s                          # tokens held per row (<= the capacity s)
  if not RECENT < n_tok <= s:
    p.error(f"--length must be in ({RECENT}, --seq={s}], got {n_tok}")
  t0 = time.time()
  res = dict(device=str(jax.devices()[0].device_kind), B=b, S=s, length=n_tok, Tq=tq, Hq=HQ,
             Hkv=HKV, D=D, group=GROUP, recent=RECENT, rows=[])

  def save():
    write_json(a.out, res)

  ip = plgpu.InterpretGPUParams() if a.interpret else None
  res["read_bandwidth"] = read_bandwidth(2e7 if a.interpret else 4 * 2 ** 30)
  bw = res["read_bandwidth"]["gb_per_s"] * 1e9
  save()
  k, v, qkv, x = _inputs(b, s, tq)
  lengths = jnp.full((b,), n_tok, jnp.int32)
  lq = jnp.full((b,), n_tok - RECENT, jnp.int32)
  lf = jnp.full((b,), RECENT, jnp.int32)

  def record(row, t, nbytes):
    row.update(us=round(t["min_s"] * 1e6, 2), median_us=round(t["median_s"] * 1e6, 2),
               bytes=nbytes, gb_per_s=round(nbytes / t["min_s"] / 1e9, 1),
               frac_read_bw=round(nbytes / t["min_s"] / bw, 3))
    res["rows"].append(row)
    print(row, flush=True)
    save()

  dense_bytes = 2 * b * HKV * n_tok * D * 2
  fn = jax.jit(lambda q, k, v, lengths, kn, vn, m: decode_attention(q, k, v, lengths, kn, vn, m,
                                                                     interpret=ip))
  t = time_loop(fn, x["q"], k, v, lengths, x["k_new"], x["v_new"], x["mask"], num_calls=a.calls)
  record(dict(impl="decode_attention"), t, dense_bytes)
  decode_us = res["rows"][-1]["us"]

  def quant_bytes(bits):
    return b * HKV * ((n_tok - RECENT) * qa.bytes_per_token(D, bits, GROUP) + RECENT * D * 2 * 2)

  bits_list = [int(x) for x in a.bits.split(",")]
  if "dequantize" in a.path.split(","):
    # The dequantize path's first kernel alone: codes read at `bits`, bf16 K and V written, the
    # slots s < lq (rounded up to 128) of each row.
    bound = min(s, -(-(n_tok - RECENT) // 128) * 128)
    for bits in bits_list:
      f = jax.jit(functools.partial(dequantize_kv, bits=bits, lengths=lq, round_to=128,
                                    interpret=ip))
      got, want = f(qkv), dequantize_kv_reference(qkv, bits)
      mismatches = sum(int(jnp.sum(x[:, :, :bound] != y[:, :, :bound])) for x, y in zip(got, want))
      del got, want
      # time_loop threads its loop dependency through the first argument: the value scales.
      t = time_loop(lambda vs, qkv: f(dataclasses.replace(qkv, v_scale=vs))[1], qkv.v_scale, qkv,
                    num_calls=a.calls)
      read = b * HKV * bound * qa.bytes_per_token(D, bits, GROUP)
      written = 2 * b * HKV * bound * D * 2
      record(dict(impl="dequantize_kv", bits=bits, part="kernel", mismatches=mismatches,
                  read_bytes=read, write_bytes=written), t, read + written)

  impls = [("current", qa)]
  if a.module:
    impls.append((os.path.basename(a.module), load_module(a.module)))
  for name, mod in impls:
    if name != "current":
      for bits in bits_list:
        f = jax.jit(functools.partial(mod.quant_attention, bits=bits, interpret=ip))
        # The other module's own storage layout.
        args = (mod.quantize_kv(k, v, group=GROUP), lq, x["k_full"], x["v_full"], lf, x["k_new"], x["v_new"], x["mask"])
        try:
          t = time_loop(f, x["q"], *args, num_calls=a.calls)
          record(dict(impl=name, bits=bits, part="call"), t, quant_bytes(bits))
        except Exception as e:  # noqa: BLE001 - record and go on
          res["rows"].append(dict(impl=name, bits=bits, error=repr(e)[:500]))
      continue
    grid = itertools.product([int(x) for x in a.block_kv.split(",")],
                             [int(x) for x in a.stages.split(",")],
                             [int(x) for x in a.target_blocks.split(",")], bits_list,
                             [None if x == "auto" else int(x) for x in a.block_m.split(",")],
                             a.path.split(","))
    for bkv, stages, tb, bits, block_m, path in grid:
      cfg = qa.QuantAttentionConfig(block_kv=bkv or None, num_stages=stages, target_blocks=tb or None,
                                    block_m=block_m, path=path)
      base = dict(impl=name, bits=bits, block_kv=bkv, num_stages=stages, target_blocks=tb,
                  block_m=block_m, path=path)
      f = jax.jit(functools.partial(qa.quant_attention, bits=bits, config=cfg,
                                      interpret=ip))
      args = (qkv, lq, x["k_full"], x["v_full"], lf, x["k_new"], x["v_new"], x["mask"])
      try:
        out = f(x["q"], *args)
        ref = qa.quant_attention_reference(x["q"].astype(jnp.float32), qkv, bits, lq,
                                           x["k_full"], x["v_full"], lf, x["k_new"],
                                           x["v_new"], x["mask"])
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
        t = time_loop(f, x["q"], *args, num_calls=a.calls, profile=a.profile,
                      profile_top=a.profile_top)
        prof = {k: v for k, v in loop_fields(t, quant_bytes(bits), None).items()
                if k.startswith(("device_", "kernels_"))}
        record(dict(base, part="call", max_abs_err=err, **prof,
                    speedup_vs_decode=round(decode_us / (t["min_s"] * 1e6), 3)),
               t, quant_bytes(bits))
        if a.calls_only or path != "fused":
          continue
        nqb, n = qa._q_blocks(tq * HQ // HKV, block_m)
        bkv = bkv or qa._block_kv(cfg, n, GROUP, s, bits, batch=b)
        q_t = jnp.zeros((b, HKV, nqb, D // 64, 64, n), jnp.float32)   # [B,Hkv,NQB,D/64,64,N]
        ns = qa._num_splits(cfg, bkv, b, HKV, nqb, s, bits=bits, rows=n)[0]
        kern = jax.jit(functools.partial(qa._quant_partials, bits=bits, num_splits=ns,
                                         dtype=jnp.bfloat16, cfg=cfg, block_kv=bkv,
                                         interpret=ip))
        t = time_loop(lambda qt, qkv, lq: kern(qt, qkv, lq)[1], q_t, qkv, lq,
                      num_calls=a.calls)
        record(dict(base, part="kernel_only", num_splits=ns), t,
               b * HKV * (n_tok - RECENT) * qa.bytes_per_token(D, bits, GROUP))
        # The kernel as the call runs it (the exact blocks beside the quantized splits), then
        # the merge kernel alone on partials of that shape.
        q_rows = jnp.zeros((b, HKV, nqb, n, D), jnp.bfloat16)
        key_sets = qa.full_and_inflight_keys(x["k_full"], x["v_full"], lf, x["k_new"],
                                             x["v_new"], x["mask"])
        exact = qa.exact_keys(q_rows, key_sets, group=HQ // HKV, num_queries=tq)

        def kernel_exact(qt, qkv, lq, exact):
          return qa._quant_partials(qt, qkv, lq, bits=bits, num_splits=ns, dtype=jnp.bfloat16,
                                    cfg=cfg, block_kv=bkv, exact=exact, interpret=ip)[1]
        t = time_loop(kernel_exact, q_t, qkv, lq, exact, num_calls=a.calls)
        record(dict(base, part="kernel_exact", num_splits=ns, exact_blocks=exact.num_blocks), t,
               b * HKV * (n_tok - RECENT) * qa.bytes_per_token(D, bits, GROUP))
        parts = ns + exact.num_blocks
        acc = jnp.zeros((b, HKV, nqb, parts, D, n), jnp.float32)
        ml = jnp.zeros((b, HKV, nqb, parts, max(n, 32)), jnp.float32)
        t = time_loop(lambda acc, ml: merge_partials(acc, ml, ml + 1.0, interpret=ip)[0],
                      acc, ml, num_calls=a.calls, profile=a.profile, profile_top=a.profile_top)
        prof = {k: v for k, v in loop_fields(t, 1.0, None).items()
                if k.startswith(("device_", "kernels_"))}
        record(dict(base, part="merge", partials=parts, **prof), t,
               acc.size * 4 + 2 * ml.size * 4)
      except Exception as e:  # noqa: BLE001 - record and go on
        res["rows"].append(dict(base, error=repr(e)[:500]))
        print(base, repr(e)[:300], flush=True)
        save()
  res["seconds"] = round(time.time() - t0, 1)
  save()


if __name__ == "__main__":
  main()
