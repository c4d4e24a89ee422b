"""How fast can anything read a decode call's K/V? The floor under issue 3's decode target.

Issue 3 asks decode_attention at S >= 16K for >= 85% of the read bandwidth measured over a
multi-GiB array. At B 1, 16K (Hkv 8, D 128, bf16) a call reads 64 MiB: ~15 us at 4.3 TB/s, so a
launch's fixed costs (ramp-up, the last blocks' tail) weigh in a way they do not at 4 GiB. This
script times, per cache size, three reads of the same bytes, each a loop of calls inside one jit
(device time from the profiler, as issue 3's grid reports it, and wall time per call):

  xla      a fused elementwise + sum over K and V (XLA's own reduction; `read_bandwidth`'s op);
  stream   a Mosaic GPU kernel shaped like decode_attention's cache kernel and doing nothing but
           its reads: grid (splits, Hkv, B), each block TMA-streams its contiguous run of
           [block_kv, D] K and V tiles through a `stages`-deep SMEM ring (the decode kernel's
           swizzled tiles), and stores one tile back so the reads count. No math, no partials,
           no combine: what the decode kernel's loads cost on their own;
  decode   decode_attention itself at Tq 1 (default config, in-flight key included).

Consecutive calls read different copies of the cache (no L2 reuse).

  python benchmarks/read_floor.py                 # GPU; writes $OUT/read_floor.json
  python benchmarks/read_floor.py --lower         # CPU: the stream kernel lowers for cuda
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import read_bandwidth, time_loop, write_json  # noqa: E402
from pallas_kernels.decode_attention import SWIZZLED, decode_attention  # noqa: E402

HKV, HQ, D = 8, 32, 128


def stream_kernel(b: int, s: int, block_kv: int, stages: int, splits: int, dtype=jnp.bfloat16,
                  interpret=None):
  """fn(dep, k, v [B, Hkv, S, D]) -> out [B, Hkv, splits, 64, D]: every block's last K tile's
  first 64 rows (the reads must land for the store to have its data). `dep` (out's shape; not
  read) is the timed loop's carry: the previous call's out, so no extra kernel orders the calls."""
  tiles = s // block_kv
  per = -(-tiles // splits)

  def body(dep_ref, k_ref, v_ref, out_ref, k_smem, v_smem, bars):
    del dep_ref                                     # only orders the calls in the timed loop
    split, h, row = lax.axis_index("split"), lax.axis_index("h"), lax.axis_index("b")
    first = split * per
    n = jnp.minimum(per, tiles - first)

    def fetch(step, slot):
      rows = pl.ds((first + step) * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(k_ref.at[row, h, rows], k_smem.at[slot], bars.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[row, h, rows], v_smem.at[slot], bars.at[slot])

    for st in range(stages):
      pl.when(st < n)(functools.partial(fetch, st, st))

    def step(i, carry):
      slot = lax.rem(i, jnp.int32(stages))
      plgpu.barrier_wait(bars.at[slot])
      pl.when(i + stages < n)(lambda: fetch(i + stages, slot))
      return carry
    lax.fori_loop(0, n, step, jnp.int32(0))
    last = lax.rem(jnp.maximum(n - 1, 0), jnp.int32(stages))   # a split past the end: n = 0
    plgpu.copy_smem_to_gmem(k_smem.at[last, pl.ds(0, 64)], out_ref.at[row, h, split])
    plgpu.wait_smem_to_gmem(0)

  ring = lambda: plgpu.SMEM((stages, block_kv, D), dtype, **SWIZZLED)
  scratch = [ring(), ring(), plgpu.Barrier(num_arrivals=2, num_barriers=stages)]

  def entry(dep, k, v, out):
    pl.run_scoped(lambda *refs: body(dep, k, v, out, *refs), *scratch)

  return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((b, HKV, splits, 64, D), dtype),
                      grid=(splits, HKV, b), grid_names=("split", "h", "b"), interpret=interpret)


def stream_configs(b: int, s: int, quick: bool):
  """(block_kv, stages, splits) to try at batch b, cache length s; quick: only split counts
  giving ~1-2 waves of blocks (100..300 of them), or the most there are tiles for."""
  out = []
  for block_kv, stage_opts in ((128, (2, 3)), (64, (2, 4, 6))):
    tiles = s // block_kv
    fits = [n for n in (1, 2, 4, 8, 16, 17, 24, 32, 33, 48, 64) if n <= tiles]
    if quick:
      fits = [n for n in fits if 100 <= n * HKV * b <= 300] or fits[-1:]
    for stages in stage_opts:
      out += [(block_kv, stages, n) for n in fits]
  return out


def lower_only():
  for block_kv, stages, splits in ((128, 2, 16), (64, 4, 33)):
    fn = stream_kernel(1, 16384, block_kv, stages, splits)
    kv = jax.ShapeDtypeStruct((1, HKV, 16384, D), jnp.bfloat16)
    dep = jax.ShapeDtypeStruct((1, HKV, splits, 64, D), jnp.bfloat16)
    jax.jit(fn).trace(dep, kv, kv).lower(
        lowering_platforms=("cuda",))
    print("lowered", dict(block_kv=block_kv, stages=stages, splits=splits), flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lower", action="store_true", help="CPU: check the stream kernel lowers")
  p.add_argument("--seqs", default="4096,16384,65536,131072")
  p.add_argument("--batches", default="1")
  p.add_argument("--quick", action="store_true", help="two split counts per tiling")
  p.add_argument("--calls-gb", type=float, default=20.0, help="GB read per timed loop")
  p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "read_floor.json"))
  args = p.parse_args()
  if args.lower:
    return lower_only()
  if jax.default_backend() != "gpu":
    raise SystemExit("read_floor.py times GPU reads; run it with --lower on the CPU")

  res = dict(device=jax.devices()[0].device_kind, rows=[],
             read_bandwidth=read_bandwidth(4 * 2 ** 30))
  bw = res["read_bandwidth"]["gb_per_s"]
  print("read bandwidth", round(bw, 1), "GB/s", flush=True)
  for b in map(int, args.batches.split(",")):
    for s in map(int, args.seqs.split(",")):
      nbytes = 2 * b * HKV * s * D * 2
      copies = max(2, -(-int(200e6) // nbytes))
      keys = jax.random.split(jax.random.key(s + b), 2 * copies)
      caches = [(jax.random.normal(keys[2 * i], (b, HKV, s, D), jnp.bfloat16),
                 jax.random.normal(keys[2 * i + 1], (b, HKV, s, D), jnp.bfloat16))
                for i in range(copies)]
      calls = max(64, int(args.calls_gb * 1e9 / nbytes))

      def record(kind, t, **extra):
        row = dict(kind=kind, B=b, S=s, bytes=nbytes, num_calls=t["num_calls"],
                   us_per_call=t["min_s"] * 1e6, **extra)
        row["fraction_of_read_bw"] = nbytes / t["min_s"] / 1e9 / bw
        if "device_s" in t:
          row.update(device_us_per_call=t["device_s"] * 1e6,
                     kernels_per_call=t["kernels_per_call"],
                     device_fraction_of_read_bw=nbytes / t["device_s"] / 1e9 / bw,
                     device_us_by_kernel={k: v * 1e6
                                          for k, v in t["device_time_by_kernel"].items()})
        res["rows"].append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
        write_json(args.out, res)

      def xla_read(c, k, v):
        scale = (c[0] + 1).astype(k.dtype)
        return c + jnp.sum(k * scale, dtype=jnp.float32) + jnp.sum(v * scale, dtype=jnp.float32)
      t = time_loop(xla_read, jnp.zeros((1,), jnp.float32), *caches[0], rotate=caches[1:],
                    num_calls=calls, unroll=8, profile=True, chain="output")
      record("xla", t)

      for block_kv, stages, splits in stream_configs(b, s, args.quick):
        try:
          fn = stream_kernel(b, s, block_kv, stages, splits)
          dep = jnp.zeros((b, HKV, splits, 64, D), jnp.bfloat16)
          t = time_loop(fn, dep, *caches[0], rotate=caches[1:], num_calls=calls, unroll=8,
                        profile=True, chain="output")
          record("stream", t, block_kv=block_kv, stages=stages, splits=splits,
                 blocks=splits * HKV * b)
        except Exception as e:                      # a tiling that does not fit: say so, go on
          res["rows"].append(dict(kind="stream", B=b, S=s, block_kv=block_kv, stages=stages,
                                  splits=splits, error=repr(e)[:300]))
          print("stream", block_kv, stages, splits, "ERROR", repr(e)[:200], flush=True)

      kq = jax.random.split(jax.random.key(7), 3)
      q = jax.random.normal(kq[0], (b, 1, HQ, D), jnp.bfloat16)
      k_new = jax.random.normal(kq[1], (b, 1, HKV, D), jnp.bfloat16)
      v_new = jax.random.normal(kq[2], (b, 1, HKV, D), jnp.bfloat16)
      lengths = jnp.full((b,), s, jnp.int32)
      mask = jnp.ones((1, 1), bool)
      fn = lambda q, k, v: decode_attention(q, k, v, lengths, k_new, v_new, mask)
      t = time_loop(fn, q, *caches[0], rotate=caches[1:], num_calls=calls, unroll=8,
                    profile=True)
      record("decode", t)
      del caches


if __name__ == "__main__":
  main()
