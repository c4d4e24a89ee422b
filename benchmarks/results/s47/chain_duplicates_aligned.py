"""Session 47: chain_duplicates.py with every fumble subsequence at p + 1 + i (aligned).
  PYTHONPATH=. python benchmarks/results/s47/chain_duplicates_aligned.py"""
import runpy
from sparsedec.decode import fafo as fafo_mod
orig = fafo_mod.fafo_layout
def layout(n, k, m):
  mask, off = orig(n, k, m)
  off = off.copy()
  for i in range(k):
    for j in range(n):
      off[i * n + j] = 1 + i
  return mask, off
fafo_mod.fafo_layout = layout
runpy.run_path("benchmarks/results/s47/chain_duplicates.py", run_name="__main__")
