"""merge_partials' split count on a GPU: the looped merge against another merge_partials.py (e.g.
the unrolled one it replaced, saved to a file), and quant_attention's calls with the splits and
merge ranges its planner picks against a one-launch merge of fewer splits (session 35's cap),
one run, one device.

Cells are "Hkv:S:bits:Tq" (Hq = 4 Hkv, D = 128, bf16, B = 1, a QuantSpec-like call: a 192-token
full-precision recent segment and Tq causal in-flight tokens, the rest quantized). For each:
  * call rows: quant_attention with the planner's splits and merge ranges ("current"), with
    the other merge module swapped in where the plan merges in one launch within its split cap
    ("old_merge"), with `--cap` minus the exact blocks splits merged in one launch where the
    planner picks more partials ("capped"), and with each of `--splits` ("forced", one launch);
  * merge rows: the merge alone on partials of the call's shape: the current module in the
    plan's ranges, the other module in one launch.
Device time per call from the profiler; the max error of each call against the jnp reference.

  python benchmarks/merge_splits.py --old-merge /tmp/merge_partials_old.py --out $OUT/m.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import loop_fields, read_bandwidth, time_loop, write_json  # noqa: E402
from pallas_kernels import merge_partials as merge_mod  # noqa: E402
from benchmarks.quant_sweep import load_module, normal_bf16  # noqa: E402
from pallas_kernels import quant_attention as qa  # noqa: E402

D, GROUP, RECENT, RECENT_CAPACITY = 128, 128, 192, 256
CELLS = "8:65536:4:1,8:65536:8:1,8:131072:8:5,2:32768:4:1,2:131072:4:1,1:131072:4:1"


# The merge swapped into quant_attention (None: its own), a jit cache key: traces made with one
# merge are not reused with another (without clearing the process's caches).
_SWAPPED_MERGE = jax.make_user_context(None)


def _plan(hkv: int, s: int, bits: int, tq: int, cfg: qa.QuantAttentionConfig):
  """(splits, merge ranges, exact blocks, N) the call plans: exact blocks for the recent
  segment and Tq."""
  rows = tq * 4
  nqb, n = qa._q_blocks(rows)
  bkv = qa._block_kv(cfg, n, GROUP, s, bits)
  exact = -(-RECENT_CAPACITY // 64) + -(-tq // 64)
  splits, ranges = qa._num_splits(cfg, bkv, 1, hkv, nqb, s, bits=bits, rows=n, exact_blocks=exact)
  return splits, ranges, exact, n


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cells", default=CELLS, help="Hkv:S:bits:Tq,...")
  p.add_argument("--old-merge", help="another merge_partials.py, timed beside the current one")
  p.add_argument("--cap", type=int, default=128,
                 help="partials (splits + exact blocks) of the one-launch 'capped' rows")
  p.add_argument("--splits", default="",
                 help="further split counts timed per cell (forced; those past a cell's keys "
                      "or past MAX_SPLITS with its exact blocks are left out)")
  p.add_argument("--skip-merge", action="store_true", help="no merge-alone rows")
  p.add_argument("--calls", type=int, default=200)
  p.add_argument("--repeats", type=int, default=3, help="timed runs per row (min and median)")
  p.add_argument("--interpret", action="store_true", help="CPU dry run (Mosaic interpreter)")
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  ip = plgpu.InterpretGPUParams() if a.interpret else None
  old = load_module(a.old_merge, "old_merge_partials") if a.old_merge else None
  res = dict(device=str(jax.devices()[0].device_kind), D=D, group=GROUP, recent=RECENT,
             read_bandwidth=read_bandwidth(2e7 if a.interpret else 4 * 2 ** 30), rows=[])
  bw = res["read_bandwidth"]["gb_per_s"]

  def record(row, t, nbytes):
    row.update(loop_fields(t, nbytes, bw))
    res["rows"].append(row)
    print({k: row[k] for k in row if k in ("cell", "impl", "part", "num_splits", "merge_ranges",
                                           "max_abs_err",
                                           "us_per_call", "device_us_per_call")}, flush=True)
    write_json(a.out, res)

  for cell in a.cells.split(","):
    hkv, s, bits, tq = map(int, cell.split(":"))
    hq = 4 * hkv
    k, v = normal_bf16(1, (1, hkv, s, D)), normal_bf16(2, (1, hkv, s, D))
    qkv = qa.quantize_kv(k, v, group=GROUP)
    del k, v
    q = normal_bf16(3, (1, tq, hq, D))
    args = (qkv, jnp.array([s - RECENT], jnp.int32), normal_bf16(6, (1, hkv, RECENT_CAPACITY, D)),
            normal_bf16(7, (1, hkv, RECENT_CAPACITY, D)), jnp.array([RECENT], jnp.int32),
            normal_bf16(4, (1, tq, hkv, D)), normal_bf16(5, (1, tq, hkv, D)),
            jnp.tril(jnp.ones((tq, tq), bool)))
    ref = qa.quant_attention_reference(q.astype(jnp.float32), args[0], bits, *args[1:])
    nbytes = hkv * ((s - RECENT) * qa.bytes_per_token(D, bits, GROUP) + RECENT * D * 4)
    splits, ranges, exact, n = _plan(hkv, s, bits, tq, qa.QuantAttentionConfig())
    variants = [("current", None, None)]
    if old is not None and ranges == 1 and splits + exact <= old.MAX_SPLITS:
      variants.append(("old_merge", lambda acc, m2, l, ranges, interpret: old.merge_partials(
          acc, m2, l, interpret=interpret), None))
    if splits + exact > a.cap:
      variants.append(("capped", None, a.cap - exact))
    tiles = (s - RECENT) // 128
    variants += [("forced", None, int(x)) for x in a.splits.split(",") if x
                 and int(x) not in (splits, a.cap - exact) and int(x) <= tiles
                 and int(x) + exact <= merge_mod.MAX_SPLITS]
    for impl, merge, forced in variants:
      saved = qa.merge_partials_in_ranges
      try:
        if merge is not None:
          qa.merge_partials_in_ranges = merge
        # quant_attention is jitted with the config static: a cached trace of an equal config
        # (the "current" row's) would keep the merge it was traced with, so the swapped-in merge
        # is part of every jit cache key while it is in place (None: the module's own).
        with _SWAPPED_MERGE(merge):
          cfg = qa.QuantAttentionConfig(num_splits=forced)
          f = jax.jit(functools.partial(qa.quant_attention, bits=bits, config=cfg, interpret=ip))
          err = float(jnp.max(jnp.abs(f(q, *args).astype(jnp.float32) - ref)))
          t = time_loop(f, q, *args, num_calls=a.calls, repeats=a.repeats, profile=True)
        record(dict(cell=cell, impl=impl, part="call", num_splits=forced or splits,
                    merge_ranges=1 if forced else ranges, exact_blocks=exact, max_abs_err=err),
               t, nbytes)
      except Exception as e:  # noqa: BLE001 - record and go on
        res["rows"].append(dict(cell=cell, impl=impl, part="call", error=repr(e)[:500]))
        write_json(a.out, res)
      finally:
        qa.merge_partials_in_ranges = saved
    if a.skip_merge:
      continue
    ns, n_pad = splits + exact, max(n, 32)
    key = jax.random.split(jax.random.key(9), 3)
    acc = jax.random.normal(key[0], (1, hkv, 1, ns, D, n), jnp.float32)
    m2 = jax.random.normal(key[1], (1, hkv, 1, ns, n_pad), jnp.float32)
    l = jnp.abs(jax.random.normal(key[2], (1, hkv, 1, ns, n_pad), jnp.float32)) + 1.0
    merges = [("current", functools.partial(merge_mod.merge_partials_in_ranges, ranges=ranges,
                                            interpret=ip))]
    if old is not None and ns <= old.MAX_SPLITS:
      merges.append(("old_merge", functools.partial(old.merge_partials, interpret=ip)))
    want = merge_mod.merge_partials_reference(acc, m2, l)[0]
    for impl, merge in merges:
      err = float(jnp.max(jnp.abs(merge(acc, m2, l)[0] - want)))
      t = time_loop(lambda acc, m2, l: merge(acc, m2, l), acc, m2, l, num_calls=a.calls,
                    repeats=a.repeats, profile=True)
      record(dict(cell=cell, impl=impl, part="merge", num_splits=ns,
                  merge_ranges=ranges if impl == "current" else 1, max_abs_err=err), t,
             acc.nbytes + m2.nbytes + l.nbytes)
  return res


if __name__ == "__main__":
  main()
