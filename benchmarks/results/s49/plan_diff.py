"""Session 49: which split plans the per-SM planner model (`split_plan.makespan(sms=SM_COUNT)`:
two resident plain blocks an SM share one serial overhead chain) changes against the slots
model (sms=None: every resident block its own place), over the issue-3 kernel grid and the
model-path calls. CPU, pure Python.

  PYTHONPATH=$PWD python benchmarks/results/s49/plan_diff.py [out.json]
"""
import json
import sys

from pallas_kernels import decode_attention as da
from pallas_kernels import sparse_attention as sa
from pallas_kernels import split_plan
from pallas_kernels.hopper import SM_COUNT

MODEL = {"sms": None}


def planner(segments, **kw):
  return split_plan.split_counts(segments, **dict(kw, sms=MODEL["sms"]))


da.split_counts = sa.split_counts = planner


def decode_plan(b, s, tq, hq=32, hkv=8, d=128):
  q_blocks = -(-tq * (hq // hkv) // 64)
  cfg = da.DecodeConfig().resolve(q_blocks, s, d, False)
  return (da._pick_num_splits(cfg, b, hkv, q_blocks, s, d),)


def sparse_plan(b, s, tq, listed, sparse_queries=None, hq=32, hkv=8, d=128, block_size=64):
  sq = tq if sparse_queries is None else sparse_queries
  segs = sa._layout((b, tq, hq, d), (b, hkv, s, d), listed, block_size=block_size,
                    sparse_queries=sq, config=sa.SparseConfig(), num_score_queries=(0, 0))[0]
  return tuple(seg.num_splits for seg in segs)


cells = []
for b in (1, 8):
  for s in (4096, 16384, 65536, 131072):
    for tq in (1, 16, 64, 256):
      cells.append(("decode", dict(b=b, s=s, tq=tq)))
for b in (1, 8):
  for s in (16384, 65536):
    for tq in (1, 16, 64, 256):
      for frac in (0.016, 0.0625, 0.25, 1.0):
        listed = max(1, round(frac * s / 64))
        cells.append(("sparse", dict(b=b, s=s, tq=tq, listed=listed)))
for s in (4096, 16384, 32768, 65536, 131072):                 # FAFO's 8B call: 240 + 43 queries
  cells.append(("sparse", dict(b=1, s=s, tq=283, listed=16, sparse_queries=240)))
for s in (1024, 4096):                                         # SmolLM2 heads, a FAFO step
  cells.append(("sparse", dict(b=1, s=s, tq=40, listed=4, sparse_queries=30, hq=9, hkv=3, d=64)))
  for tq in (1, 8):
    cells.append(("decode", dict(b=1, s=s, tq=tq, hq=9, hkv=3, d=64)))

rows = []
for kind, kw in cells:
  fn = decode_plan if kind == "decode" else sparse_plan
  MODEL["sms"] = None
  old = fn(**kw)
  MODEL["sms"] = SM_COUNT
  new = fn(**kw)
  rows.append(dict(kernel=kind, **kw, slots_model=old, sm_model=new))
changed = [r for r in rows if r["slots_model"] != r["sm_model"]]
for r in changed:
  print(r)
print(f"{len(changed)} of {len(rows)} plans change")
if len(sys.argv) > 1:
  json.dump(dict(rows=rows, changed=changed), open(sys.argv[1], "w"), indent=1)
