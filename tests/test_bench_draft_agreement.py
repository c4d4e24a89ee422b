"""benchmarks/draft_agreement.py on the embedded stories260K checkpoint (CPU, fp32): the
teacher-forced agreement of a GPTQ draft (mixed calibration) with the INT8 target runs end to end
(rows, counted positions, calibration sequences), so the GPU benchmark cannot rot, and calibration
prompts that overlap the evaluated ones are refused."""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks import draft_agreement  # noqa: E402

STORIES = pathlib.Path(__file__).resolve().parents[1] / "checkpoints" / "stories260K"


def test_agreement_rows(tmp_path):
  out = tmp_path / "agreement.json"
  result = draft_agreement.main([
      "--gguf", str(STORIES), "--chat-template", "0", "--group", "16", "--weight-group", "32",
      "--chunk", "16", "--eval-tokens", "64", "--eval-prompts", "2", "--new-tokens", "12",
      "--calibration-tokens", "96", "--calibration-offset", "2000", "--calibration-prompts", "2",
      "5", "--variants", "gptq-act-seq", "--calibration-sources", "mixed", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  assert [(r["variant"], r["calibration"]) for r in result["rows"]] == [("gptq-act-seq", "mixed")]
  assert result["positions"] == {"book": 64, "mt_bench": 24}
  assert result["calibration_sequences"]["mixed"] >= 2       # the book slice + answers
  for row in result["rows"]:
    for name in ("book", "mt_bench"):
      assert 0.0 < row[name]["agreement"] <= 1.0
      assert row[name]["standard_error"] >= 0.0
  try:
    draft_agreement.main(["--gguf", str(STORIES), "--eval-prompts", "8",
                          "--calibration-prompts", "4", "9", "--out", str(out)])
  except SystemExit as e:
    assert "overlap" in str(e)
  else:
    raise AssertionError("overlapping calibration prompts were accepted")
