"""The TMA-only floor of quant_attention's reads: one warpgroup per block streams the int4 K/V
code planes of an S = 64K, Hkv = 8, D = 128 cache with TMA and nothing else (2 stages), so the
time is what the copy engine needs for these boxes. Layouts:
  cm    the kernel's boxes: K [64 tokens, 64 channels] (32-byte rows), V channel-major
        (session-6 storage [2, D, S]; a [D, 64] box is 128 rows of 32 B, S/2 bytes apart);
  tc    as cm with V in contiguous [D, 64] tiles (session-7 storage [2, S/64, D, 64]);
  wide  the same bytes as boxes of 128-byte rows: K [tokens / 4, 256] of a chunk's contiguous
        codes, V contiguous [D, 64] tiles as [D / 4, 256];
touch adds one int4 register tile load per stage (the WGMMA_UPCAST_4X path). Every call depends
on the loop carry (the `dep` input) and two cache copies alternate (no L2 reuse).

  python benchmarks/tma_stream.py            # GPU; writes $OUT/tma_stream_h200.json
  python benchmarks/tma_stream.py --lower    # CPU: check the kernels lower for cuda
"""
import itertools
import os
import sys

import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import read_bandwidth, time_loop, write_json  # noqa: E402

B, HKV, D, S = 1, 8, 128, 65536
T = 64

def sw(minor_bytes, bits):
  return dict(transforms=(plgpu.TilingTransform((8, minor_bytes * 8 // bits)),
                          plgpu.SwizzleTransform(minor_bytes)))

def make(layout, planes, splits, stages, tiles_per_stage, touch):
  bkv = T * tiles_per_stage
  wide = layout == "wide"
  def body(dep_ref, kc_ref, vc_ref, out_ref, kc_smem, vc_smem, kb, vb, o_smem):
    if wide:
      kc_load, kc_smem = kc_smem[1], kc_smem[0]
      vc_smem = vc_smem
    split = lax.axis_index("split"); h = lax.axis_index("h"); b = lax.axis_index("b")
    n_st = S // bkv
    per = n_st // splits
    first = split * per
    def fetch(step, slot):
      start = (first + step) * bkv
      for pn, hf in itertools.product(range(planes), range(D // 64)):
        if wide:
          plgpu.copy_gmem_to_smem(kc_ref.at[b, h, pn, hf, pl.ds(lax.div(start, 4), bkv // 4)],
                                  kc_smem.at[slot, pn, hf], kb.at[slot])
        else:
          plgpu.copy_gmem_to_smem(kc_ref.at[b, h, pn, hf, pl.ds(start, bkv)],
                                  kc_smem.at[slot, pn, hf], kb.at[slot])
      for t, pn in itertools.product(range(tiles_per_stage), range(planes)):
        if wide:
          src = vc_ref.at[b, h, pn, lax.div(start, jnp.int32(T)) + t]
        elif layout == "cm":
          src = vc_ref.at[b, h, pn, :, pl.ds(start + t * T, T)]
        else:
          src = vc_ref.at[b, h, pn, lax.div(start, jnp.int32(T)) + t]
        plgpu.copy_gmem_to_smem(src, vc_smem.at[slot, t, pn], vb.at[slot])
    for st in range(stages):
      fetch(st, st)
    def step(i, acc):
      slot = lax.rem(i, jnp.int32(stages))
      plgpu.barrier_wait(kb.at[slot]); plgpu.barrier_wait(vb.at[slot])
      if touch:
        src = kc_load if wide else kc_smem
        x = plgpu.load(src.at[slot, 0, 0, pl.ds(0, 64)], (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
        acc = acc + plgpu.layout_cast(x, plgpu.Layout.WGMMA).astype(jnp.float32)
      nxt = i + stages
      pl.when(nxt < per)(lambda: fetch(nxt, slot))
      return acc
    acc0 = plgpu.layout_cast(jnp.zeros((64, 64), jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, per, step, acc0)
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, h, split])
    plgpu.wait_smem_to_gmem(0)
  if wide:
    kscr = plgpu.RefUnion(plgpu.SMEM((stages, planes, D // 64, bkv // 4, 256), jnp.int4),
                          plgpu.SMEM((stages, planes, D // 64, bkv, 64), jnp.int4,
                                     transforms=(plgpu.TilingTransform((8, 64)),)))
    vscr = plgpu.SMEM((stages, tiles_per_stage, planes, D // 4, 256), jnp.int4)
  else:
    kscr = plgpu.SMEM((stages, planes, D // 64, bkv, 64), jnp.int4, **sw(32, 4))
    vscr = plgpu.SMEM((stages, tiles_per_stage, planes, D, T), jnp.int4, **sw(32, 4))
  scratch = [kscr, vscr,
             plgpu.Barrier(num_arrivals=planes * (D // 64), num_barriers=stages),
             plgpu.Barrier(num_arrivals=planes * tiles_per_stage, num_barriers=stages),
             plgpu.SMEM((64, 64), jnp.float32)]
  def entry(dep, kc, vc, out):
    pl.run_scoped(lambda *s: body(dep, kc, vc, out, *s), *scratch)
  return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((B, HKV, splits, 64, 64), jnp.float32),
                      grid=(splits, HKV, B), grid_names=("split", "h", "b"))

if "--lower" in sys.argv:
  for layout in ("wide",):
    for args in ((1, 128, 2, 1, False), (2, 128, 2, 2, True)):
      f = make(layout, *args)
      v = jax.ShapeDtypeStruct((B, HKV, 2, S // T, D // 4, 256), jnp.int4)
      kc = jax.ShapeDtypeStruct((B, HKV, 2, D // 64, S // 4, 256), jnp.int4)
      jax.jit(f).trace(jax.ShapeDtypeStruct((1,), jnp.float32), kc, v).lower(
          lowering_platforms=("cuda",))
      print("lowered", layout, args)
  sys.exit()
res = dict(rows=[], read_bandwidth=read_bandwidth(4 * 2 ** 30))
key = jax.random.key(0)
kc = jax.random.randint(key, (B, HKV, 2, D // 64, S, 64), -8, 8).astype(jnp.int4)
v_cm = jax.random.randint(key, (B, HKV, 2, D, S), -8, 8).astype(jnp.int4)
v_tc = jax.random.randint(key, (B, HKV, 2, S // T, D, T), -8, 8).astype(jnp.int4)
kc_w = kc.reshape(B, HKV, 2, D // 64, S // 4, 256)
v_w = v_tc.reshape(B, HKV, 2, S // T, D // 4, 256)

for layout, planes, splits, stages, tps, touch in [
    ("wide", 1, 128, 2, 1, False), ("wide", 1, 64, 2, 2, False), ("wide", 1, 32, 2, 4, False),
    ("wide", 1, 128, 2, 1, True), ("wide", 2, 128, 2, 1, False), ("wide", 2, 64, 2, 2, False),
    ("cm", 1, 128, 2, 1, False), ("cm", 2, 128, 2, 1, False),
    ("tc", 1, 128, 2, 1, False), ("tc", 2, 128, 2, 1, False)]:
  row = dict(layout=layout, planes=planes, splits=splits, stages=stages, tiles_per_stage=tps,
             touch=touch)
  try:
    f = make(layout, planes, splits, stages, tps, touch)
    v = {"cm": v_cm, "tc": v_tc, "wide": v_w}[layout]
    kk = kc_w if layout == "wide" else kc
    kc2 = jax.random.randint(jax.random.key(5), kk.shape, -8, 8).astype(jnp.int4)
    v2 = jax.random.randint(jax.random.key(6), v.shape, -8, 8).astype(jnp.int4)
    t = time_loop(lambda x, kc, v: f(x.reshape(1), kc, v), jnp.zeros((), jnp.float32), kk, v,
                  rotate=[(kc2, v2)], num_calls=400, unroll=8)
    nbytes = B * HKV * S * D * planes   # K + V at 4 bits/plane: 2 * S*D/2 per plane
    row.update(us=round(t["min_s"] * 1e6, 2), gb_per_s=round(nbytes / t["min_s"] / 1e9, 1))
  except Exception as e:
    row["error"] = repr(e)[:400]
  print(row, flush=True)
  res["rows"].append(row)
  write_json(os.path.join(os.environ.get("OUT", "/tmp"), "tma_stream_h200.json"), res)
