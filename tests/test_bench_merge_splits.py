"""benchmarks/merge_splits.py on one tiny cell, one call per timed loop (in its --interpret mode,
the Mosaic GPU interpreter, on the CPU; compiled on a GPU): every row kind runs (the planner's
splits, another merge module swapped in, the capped and forced split counts, the merge alone), so
the script cannot rot, and the swapped-in module is the one the call rows run. The timings mean
nothing on a CPU."""

from __future__ import annotations

import json
import pathlib
import sys

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # benchmarks/ importable

from benchmarks import merge_splits as bench  # noqa: E402


# The "other" merge module: the current one with its output doubled, so a row that really ran it
# is off by |out| (quant_attention is jitted: a swap that a cached trace ignored would pass).
DOUBLED_MERGE = """
from pallas_kernels import merge_partials as _merge
MAX_SPLITS = _merge.MAX_SPLITS

def merge_partials(acc, m2, l, *, interpret=None):
  out, lse = _merge.merge_partials(acc, m2, l, interpret=interpret)
  return 2.0 * out, lse
"""


def test_one_cell_run_writes_every_row_kind(tmp_path):
  out = tmp_path / "merge_splits.json"
  doubled = tmp_path / "doubled_merge.py"
  doubled.write_text(DOUBLED_MERGE)
  # The interpreter on the CPU; the compiled kernels on a GPU backend (the interpreter there is
  # no product path, and its 4-bit call read 1.2e-2 off the reference on an H200 where the
  # compiled kernel and the CPU's interpreter read 7e-4: session 59).
  mode = ["--interpret"] if jax.default_backend() != "gpu" else []
  result = bench.main([*mode, "--cells", "1:1024:4:1", "--splits", "1", "--cap", "8",
                       "--calls", "1", "--repeats", "1", "--old-merge", str(doubled),
                       "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  rows = result["rows"]
  assert not [r for r in rows if "error" in r], rows
  # 1024 slots: the planner's 4 splits (2 stages of 128 keys each at least); 5 exact blocks
  # (256 recent slots, 1 in-flight token), so the cap of 8 leaves 3.
  assert [(r["impl"], r["part"], r["num_splits"]) for r in rows] == [
      ("current", "call", 4), ("old_merge", "call", 4), ("capped", "call", 3),
      ("forced", "call", 1), ("current", "merge", 9), ("old_merge", "merge", 9)]
  for r in rows:
    assert r["us_per_call"] > 0
    if r["impl"] == "old_merge":     # the doubled output, in the call too
      assert r["max_abs_err"] > 0.1, r
    else:
      assert r["max_abs_err"] < (1e-2 if r["part"] == "call" else 1e-5), r
