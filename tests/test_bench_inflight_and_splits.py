"""benchmarks/fafo_splits.py and benchmarks/inflight_ab.py without a GPU: the split plans the
sparse wrapper makes for FAFO's 8B call (what the GPU sweep times against), and the A/B
harness's loading and swapping of another in-flight kernel version."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks import fafo_splits, inflight_ab  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_plan_only_reports_the_one_wave_plans():
  result = fafo_splits.main(["--plan-only", "--contexts", "4096", "32768", "131072"])
  plans = {row["S"]: (row["planned"], row["warp_specialized"]) for row in result["rows"]}
  assert plans == {4096: ([1, 4], True), 32768: ([2, 8], True), 131072: ([2, 8], True)}
  # The interpreter's plain blocks keep the model's plan (no wave rule there).
  assert fafo_splits.planned(32768, 64, warp_specialized=False)[0] != [2, 8]


def test_splits_arguments_are_checked():
  assert fafo_splits.parse_splits("2,8") == (2, 8)
  for bad in ("2", "0,8", "a,b"):
    with pytest.raises(Exception, match="splits|split counts"):
      fafo_splits.parse_splits(bad)


def test_baseline_module_loads_and_swaps_into_the_wrappers(tmp_path):
  import pallas_kernels.decode_attention as decode_module
  import pallas_kernels.sparse_attention as sparse_module
  copy = tmp_path / "inflight_copy.py"
  copy.write_text((ROOT / "pallas_kernels" / "inflight_attention.py").read_text())
  baseline = inflight_ab.load_module(str(copy))
  try:
    inflight_ab.use(baseline)
    assert decode_module.inflight_partials is baseline.inflight_partials
    assert sparse_module.mask_bias is baseline.mask_bias
    assert sparse_module.merge_chunks is baseline.merge_chunks    # the chunk rule travels too
  finally:
    inflight_ab.use(inflight_ab.current)
  assert decode_module.inflight_partials is inflight_ab.current.inflight_partials
  (tmp_path / "other.py").write_text("x = 1\n")
  with pytest.raises(SystemExit, match="not an inflight_attention module"):
    inflight_ab.load_module(str(tmp_path / "other.py"))
  with pytest.raises(SystemExit, match="no file"):
    inflight_ab.load_module(str(tmp_path / "missing.py"))


def test_variant_is_the_current_file_with_constants_set():
  fewer = inflight_ab.variant("MERGE_MAX_CHUNKS=4,MERGE_FOLD_WIDTH=1")
  assert fewer is not inflight_ab.current
  assert (fewer.MERGE_MAX_CHUNKS, fewer.MERGE_FOLD_WIDTH) == (4, 1)
  assert fewer.merge_chunks(8, 128, 4) == 4 and inflight_ab.current.merge_chunks(8, 128, 4) == 8
  assert inflight_ab.current.MERGE_FOLD_WIDTH == 4                 # the current module untouched
  for bad in ("NO_SUCH_CONSTANT=1", "MERGE_MAX_CHUNKS=four", "MERGE_MAX_CHUNKS"):
    with pytest.raises(SystemExit, match="not NAME=INT"):
      inflight_ab.variant(bad)
