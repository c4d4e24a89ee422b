"""benchmarks/gptq_time.py on the CPU at SmolLM2's shapes, two layers: every quantized linear's
shape is timed, the draft's layers each report a time, and the JSON is what main returns (so the
GPU benchmark cannot rot)."""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks import gptq_time  # noqa: E402
from sparsedec.model.quant_weights import QUANTIZED_LINEARS  # noqa: E402


def test_gptq_time_rows(tmp_path):
  out = tmp_path / "gptq.json"
  result = gptq_time.main(["--model", "smollm2-135m", "--layers", "2", "--calibration-tokens", "64",
                           "--sequences", "2", "--repeats", "1", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  assert [r["linear"] for r in result["shapes"]] == list(QUANTIZED_LINEARS)
  assert result["shapes"][3]["shape"] == [1536, 576]                  # w_down [In, Out]
  assert all(r["median_s"] > 0 and len(r["times_s"]) == 1 for r in result["shapes"])
  draft = result["draft"]
  assert draft["layers"] == 2 and len(draft["per_layer_s"]) == 2
  assert draft["total_s"] >= sum(draft["per_layer_s"]) > 0
  assert result["memory"]["host_peak_rss_bytes"] > 0


def test_gptq_time_refuses_bad_counts_by_name(capsys):
  """--calibration-tokens 10 --sequences 3 timed 9 tokens and recorded 10; --sequences 0 or more
  sequences than tokens failed deep in GPTQ ('got 0 of float64'), --layers 0 in ModelConfig."""
  import pytest
  for bad, message in ((["--calibration-tokens", "10", "--sequences", "3"],
                        "--calibration-tokens 10 does not split evenly into --sequences 3"),
                       (["--calibration-tokens", "10", "--sequences", "20"],
                        "does not split evenly"),
                       (["--sequences", "0"], "--sequences: must be an integer >= 1, got '0'"),
                       (["--layers", "0"], "--layers: must be an integer >= 1, got '0'"),
                       (["--repeats", "-1"], "--repeats must be >= 0, got -1")):
    with pytest.raises(SystemExit):
      gptq_time.main(["--model", "smollm2-135m", *bad])
    assert message in capsys.readouterr().err, bad
