"""Session 48: the split-planner model sketched in benchmarks/NOTES.md, on the sparse A/B cells of
`sparse_slots_ab_s48_h200.json` (S 16K, 4 / 16 listed 64-slot blocks, Hkv 8, one q block).

Model: items are dealt to the SMs in launch order, two resident an SM (one wave only here); an
SM's time is its longest item's tiles plus the fixed per-item overhead times its items (the
tiles of co-resident items overlap, their prologues and partial writes do not). Prints, per
(B, Tq, listed blocks), each split count's modelled time and the count it would pick. CPU.

  PYTHONPATH=$PWD python benchmarks/results/s48/planner_model.py
"""

from pallas_kernels.hopper import SM_COUNT
from pallas_kernels.split_plan import OVERHEAD_TILES, split_tiles


def sm_makespan(items, copies, per_sm=2, overhead=OVERHEAD_TILES):
  """Modelled time of `copies` repeats of `items` (tiles per item), or None past one wave."""
  every = [t for _ in range(copies) for t in items]
  if len(every) > SM_COUNT * per_sm:
    return None
  loads = [[] for _ in range(SM_COUNT)]
  for i, tiles in enumerate(every):
    loads[i % SM_COUNT].append(tiles)
  return max(max(load) + overhead * len(load) for load in loads if load)


for b, tq, listed in [(8, 1, 4), (8, 1, 16), (8, 16, 4), (8, 16, 16),
                      (1, 1, 4), (1, 1, 16), (1, 16, 4), (1, 16, 16)]:
  times = {s: sm_makespan(tuple(split_tiles(listed, s)), copies=b * 8)
           for s in (1, 2, 4, 8, 16) if s <= listed}
  pick = min((t, s) for s, t in times.items() if t is not None)[1]
  print(f"B {b} Tq {tq} listed {listed}: {times} -> {pick} splits")
