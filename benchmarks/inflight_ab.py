"""The in-flight kernel (`pallas_kernels.inflight_attention`) against another version of it, in
one run (GPU): the kernel alone and whole decode_attention / sparse_attention calls, device us
from the profiler, and how far the outputs move.

The other version is a copy of the module's file, e.g. session 27's kernel:

  git show 05c2f35:pallas_kernels/inflight_attention.py > /tmp/inflight_base.py
  python benchmarks/inflight_ab.py --baseline /tmp/inflight_base.py --cases kernel calls smol \
      --out $OUT/inflight_ab.json

Cases (Llama-3.1-8B heads: Hq 32, Hkv 8, D 128): `kernel` the kernel alone under causal masks
(T 16 / 64 / 256, B 1 / 8) and FAFO's / Lookahead's 8B step masks (T 283 / 282); `calls` decode
and sparse (4 listed 64-slot blocks) at B 8, 16K, Tq 64 / 256 and FAFO's / Lookahead's 8B calls
at 4K / 32K, and issue 3's Tq 16 and Tq 1 cells (`--match 'Tq1 '`: the Tq 1 ones); `smol`
SmolLM2's FAFO and Lookahead calls (T 109 / 108), each timed twice.
`--modes merged kernel` times every call with each in-flight mode; `--match` picks calls by
name; `--variant MERGE_MAX_CHUNKS=4` adds the current file with constants set. Whole calls
swap the module's `inflight_partials` / `mask_bias` (and `inflight_merged`, `merge_chunks`,
where it has them) into the cache kernels' wrappers, so every version must keep that interface
(a mask_bias result passed through). Session 28's figures (H200):
`results/s28/inflight_ab_s28_h200.json`, `inflight_ab_smol_s28_h200.json`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import time_loop, write_json
import pallas_kernels.decode_attention as decode_module
import pallas_kernels.inflight_attention as current
import pallas_kernels.sparse_attention as sparse_module
from sparsedec.decode.fafo import fafo_layout
from sparsedec.decode.lookahead import lookahead_layout

HQ, HKV, D = 32, 8, 128
G = HQ // HKV


def load_module(path: str, name: str = "inflight_attention_baseline"):
  """A module object from a file holding a version of inflight_attention.py."""
  if not os.path.isfile(path):
    raise SystemExit(f"--baseline: no file at {path}")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for attr in ("inflight_partials", "mask_bias", "pack_keys"):
    if not hasattr(module, attr):
      raise SystemExit(f"--baseline {path} has no {attr}: not an inflight_attention module")
  return module


def variant(spec: str, name: str = "inflight_attention_variant"):
  """The current inflight_attention.py loaded anew with module constants set: spec
  "NAME=INT[,NAME=INT]" (`--variant`)."""
  module = load_module(current.__file__, name)
  for setting in spec.split(","):
    attr, _, value = setting.partition("=")
    if not hasattr(module, attr) or not value.lstrip("-").isdigit():
      raise SystemExit(f"--variant {spec}: not NAME=INT[,NAME=INT] of constants of "
                       f"{current.__file__}")
    setattr(module, attr, int(value))
  return module


_SWAPPED = ("inflight_partials", "mask_bias", "inflight_merged", "merge_chunks")


def _routed():
  return tuple(getattr(w, attr, None) for w in (decode_module, sparse_module) for attr in _SWAPPED)


# The functions the wrappers are routed to (None: the imported ones), a jit cache key: traces made
# with one version are not reused with another (without clearing the process's caches).
_ROUTED = jax.make_user_context(None)
_IMPORTED = _routed()


def use(module) -> None:
  """Route the cache kernels' wrappers to `module`'s in-flight kernel (retraced afterwards)."""
  for wrapper in (decode_module, sparse_module):
    wrapper.inflight_partials = module.inflight_partials
    wrapper.mask_bias = module.mask_bias
    if hasattr(module, "inflight_merged"):        # versions from session 30 on
      wrapper.inflight_merged = module.inflight_merged
    if hasattr(module, "merge_chunks"):           # versions from session 31 on
      wrapper.merge_chunks = module.merge_chunks
  routed = _routed()
  _ROUTED.set_global(None if routed == _IMPORTED else routed)


def normal(key, shape):
  return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def arrays(b, t, hq, hkv, d, s, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  return (normal(ks[0], (b, t, hq, d)), normal(ks[1], (b, hkv, s, d)),
          normal(ks[2], (b, hkv, s, d)), normal(ks[3], (b, t, hkv, d)),
          normal(ks[4], (b, t, hkv, d)))


def timed(case, impl, fn, *args, calls):
  try:
    r = time_loop(fn, *args, num_calls=calls, unroll=8, profile=True)
    return dict(case=case, impl=impl, us=r["min_s"] * 1e6, device_us=r.get("device_s", 0) * 1e6,
                kernels={k[:40]: round(v * 1e6, 2)
                         for k, v in r.get("device_time_by_kernel", {}).items()})
  except Exception as e:                                             # noqa: BLE001
    traceback.print_exc()
    return dict(case=case, impl=impl, error=repr(e)[:500])


def kernel_cases(versions, rows):
  masks = {"causal256": np.tril(np.ones((256, 256), bool)),
           "causal64": np.tril(np.ones((64, 64), bool)),
           "causal16": np.tril(np.ones((16, 16), bool)),
           "fafo283": fafo_layout(40, 6, 7)[0], "lookahead282": lookahead_layout(40, 7, 7)[0]}
  for name, mask in masks.items():
    for b in ([1] if name in ("fafo283", "lookahead282") else [1, 8]):
      t = mask.shape[0]
      n = t * G
      qb = -(-n // 64)
      ks = jax.random.split(jax.random.key(1), 3)
      q_rows = normal(ks[0], (b, HKV, qb * 64, D))
      k_rows = current.pack_keys(normal(ks[1], (b, t, HKV, D)))
      v_rows = current.pack_keys(normal(ks[2], (b, t, HKV, D)))
      row_query = np.full(qb * 64, -1)
      row_query[:n] = np.arange(n) // G
      real = row_query >= 0
      m = jnp.asarray(mask)
      outs = {}
      for impl, mod in versions.items():
        fn = lambda q, k, v, mod=mod: mod.inflight_partials(q, k, v, mod.mask_bias(m, row_query),
                                                            rows_out=64)
        acc, m2, _ = fn(q_rows, k_rows, v_rows)
        outs[impl] = (np.asarray(acc).reshape(b, HKV, -1, D)[:, :, real],
                      np.isneginf(np.asarray(m2).reshape(b, HKV, -1)[:, :, real]))
        row = timed(f"kernel {name} B{b}", impl, fn, q_rows, k_rows, v_rows, calls=400)
        if impl != "baseline" and "baseline" in outs:
          row["acc_max_diff"] = float(np.max(np.abs(outs[impl][0] - outs["baseline"][0])))
          row["m_inf_same"] = bool(np.array_equal(outs[impl][1], outs["baseline"][1]))
        print(json.dumps(row), flush=True)
        rows.append(row)


def call_cases(versions, rows, smol, modes=("auto",), match=None):
  """Whole calls per version and per in-flight mode (`DecodeConfig.inflight` /
  `SparseConfig.inflight`: "merged" the in-flight kernel merges the splits and writes the output,
  "kernel" it leaves a partial for the combine, "auto" the rule of `combine.inflight_merges`)."""
  calls = []
  if smol:
    mask = jnp.asarray(fafo_layout(20, 4, 7)[0])
    args = arrays(1, 109, 9, 3, 64, 1024)
    lengths = jnp.array([400])
    tables, counts = jnp.array([[[0, 4, 5, 6]] * 3], jnp.int32), jnp.full((1, 3), 4, jnp.int32)
    calls.append(("smol fafo T109", lambda q, k, v, kn, vn, mode: sparse_module.sparse_attention(
        q, k, v, tables, counts, lengths, kn, vn, mask, block_size=64, sparse_queries=80,
        config=sparse_module.SparseConfig(inflight=mode)), args))
    mask2 = jnp.asarray(lookahead_layout(20, 5, 7)[0])
    calls.append(("smol lookahead T108", lambda q, k, v, kn, vn, mode:
                  decode_module.decode_attention(q, k, v, lengths, kn, vn, mask2,
                                                 config=decode_module.DecodeConfig(inflight=mode)),
                  arrays(1, 108, 9, 3, 64, 1024)))
    repeats = 2
  else:
    dcfg = lambda mode: decode_module.DecodeConfig(inflight=mode)
    scfg = lambda mode: sparse_module.SparseConfig(inflight=mode)
    for b, s, t in ((8, 16384, 256), (8, 16384, 64), (8, 16384, 16), (1, 16384, 16),
                    (1, 65536, 16), (8, 16384, 1), (1, 16384, 1), (1, 65536, 1)):
      lb = jnp.array([s] * b)
      mk = jnp.asarray(np.tril(np.ones((t, t), bool)))
      args = arrays(b, t, HQ, HKV, D, s)
      calls.append((f"decode B{b} {s // 1024}K Tq{t}", lambda q, k, v, kn, vn, mode, mk=mk, lb=lb:
                    decode_module.decode_attention(q, k, v, lb, kn, vn, mk, config=dcfg(mode)),
                    args))
      if s > 16384:
        continue
      tables = jnp.broadcast_to(jnp.array([0, 50, 100, 200], jnp.int32), (b, HKV, 4))
      counts = jnp.full((b, HKV), 4, jnp.int32)
      calls.append((f"sparse B{b} 16K Tq{t} 4x64", lambda q, k, v, kn, vn, mode, mk=mk,
                    tables=tables, counts=counts, lb=lb: sparse_module.sparse_attention(
                        q, k, v, tables, counts, lb, kn, vn, mk, block_size=64,
                        config=scfg(mode)), args))
    for s in (4096, 32768):
      length = jnp.array([s])
      mk = jnp.asarray(fafo_layout(40, 6, 7)[0])
      tables = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (1, 8, 16))
      counts = jnp.full((1, 8), 16, jnp.int32)
      calls.append((f"fafo8b S{s}", lambda q, k, v, kn, vn, mode, mk=mk, length=length,
                    tables=tables, counts=counts: sparse_module.sparse_attention(
                        q, k, v, tables, counts, length, kn, vn, mk, block_size=64,
                        sparse_queries=240, config=scfg(mode)), arrays(1, 283, HQ, HKV, D, s)))
      mk2 = jnp.asarray(lookahead_layout(40, 7, 7)[0])
      calls.append((f"lookahead8b S{s}", lambda q, k, v, kn, vn, mode, mk2=mk2, length=length:
                    decode_module.decode_attention(q, k, v, length, kn, vn, mk2,
                                                   config=dcfg(mode)),
                    arrays(1, 282, HQ, HKV, D, s)))
    repeats = 1
  for name, call, args in calls:
    if match and not any(m in f"{name} " for m in match):     # "Tq1 ": Tq1, not Tq16
      continue
    outs = {}
    for _ in range(repeats):
      for version, mod in versions.items():
        use(mod)
        for mode in modes:
          impl = version if mode == "auto" else f"{version}:{mode}"
          fn = jax.jit(lambda *a, mode=mode, call=call: call(*a, mode))
          outs[impl] = fn(*args)
          row = timed(name, impl, fn, *args, calls=800 if smol else 200)
          first = next(iter(outs))
          if impl != first:
            row["vs"] = first
            row["out_max_diff"] = float(jnp.max(jnp.abs(
                outs[impl].astype(jnp.float32) - outs[first].astype(jnp.float32))))
          print(json.dumps(row), flush=True)
          rows.append(row)
  use(current)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--baseline", help="a file holding another inflight_attention.py (optional)")
  p.add_argument("--cases", nargs="+", default=["kernel", "calls"],
                 choices=["kernel", "calls", "smol"])
  p.add_argument("--modes", nargs="+", default=["auto"],
                 choices=["auto", "merged", "kernel", "jnp"],
                 help="in-flight modes the whole calls run with (each its own row)")
  p.add_argument("--match", nargs="+",
                 help="only the whole calls whose name contains one of these (a trailing space "
                      "ends a word: 'Tq1 ')")
  p.add_argument("--variant", action="append", default=[], metavar="NAME=INT[,NAME=INT]",
                 help="also time the current file with module constants set, e.g. "
                      "MERGE_MAX_CHUNKS=4 (repeatable: one version each)")
  p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                               "inflight_ab.json"))
  args = p.parse_args(argv)
  versions = ({"baseline": load_module(args.baseline)} if args.baseline else {})
  for i, spec in enumerate(args.variant):
    versions[spec] = variant(spec, f"inflight_attention_variant{i}")
  versions["current"] = current
  rows = []
  if "kernel" in args.cases:
    kernel_cases(versions, rows)
  for smol in (False, True):
    if ("smol" if smol else "calls") in args.cases:
      call_cases(versions, rows, smol, tuple(args.modes), args.match)
  result = dict(device=jax.devices()[0].device_kind, baseline=args.baseline,
                modes=args.modes, rows=rows)
  write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
