"""A/B of the split combine's two forms (`pallas_kernels.combine`): runs benchmarks/kernels.py with
the elementwise form on (the default) or off (UNROLL_MAX_PARTIALS = 0: every call merges with
reductions, as before session 20).

  python benchmarks/combine_ab.py {elementwise,reduced} OUT.json [kernels.py arguments...]

Session 20 (H100): `--kernels decode,sparse --batch 1,8 --seq 16384,65536,131072 --tq 1
--sparse-seq 16384 --fractions 0.016 --refs dpa` and `--kernels decode,fafo --batch 1,8 --seq 16384
--tq 16,64,256 --refs dpa --no-partials`, both modes in one command
(`results/combine_{reduced,elementwise}_{tq1,wide}_s20_h100.json`).
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import pallas_kernels.combine as combine  # noqa: E402

MODES = ("elementwise", "reduced")


def main() -> None:
  if len(sys.argv) < 3 or sys.argv[1] not in MODES:
    sys.exit(f"usage: {sys.argv[0]} {{{','.join(MODES)}}} OUT.json [kernels.py arguments...]")
  mode, out, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
  if mode == "reduced":
    combine.UNROLL_MAX_PARTIALS = 0
  kernels = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.py")
  sys.argv = [kernels, "--out", out, *rest]
  runpy.run_path(kernels, run_name="__main__")


if __name__ == "__main__":
  main()
