"""benchmarks/quantspec_step.py in its --smoke mode (tiny Llama-shaped model, reference attention,
CPU): every code path of the GPU benchmark runs (device-side random weights and quantized cache,
the three draft weight layouts, the verification forward, QuantSpec.step, the JSON with memory
and projections), so the script cannot rot. The numbers themselves mean nothing on a CPU."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks import quantspec_step as bench  # noqa: E402


def test_smoke_run_writes_rows_memory_and_projections(tmp_path):
  out = tmp_path / "quantspec_step.json"
  result = bench.main(["--smoke", "--no-isolate", "--full-step", "--layouts", "packed", "int4",
                       "int4_reduce", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  rows = result["rows"]
  assert not [r for r in rows if "error" in r], rows
  kinds = sorted({(r["kind"], r.get("layout")) for r in rows})
  assert kinds == [("dense", None), ("draft", "int4"), ("draft", "int4_reduce"),
                   ("draft", "packed"), ("quantspec_step", "int4_reduce"), ("verify", None)]
  assert all(r["step_seconds"] > 0 for r in rows)
  assert {m["kind"] for m in result["memory"]} == {"dense", "quantspec"}
  # One projection per draft layout and acceptance source (book, MT-Bench) at gamma 2.
  projected = result["projected"]
  assert len(projected) == 3 * 2 and all(p["label"] == "projected" for p in projected)
  for p in projected:
    assert p["expected_tokens_per_step"] == pytest.approx(1 + 2 * p["acceptance_rate"])
    assert p["projected_speedup"] > 0
  assert any("full_step_projected_speedup" in p for p in projected)
  for kind in ("dense", "quantspec"):        # the per-kind files a killed run leaves behind
    assert (tmp_path / f"quantspec_step.{kind}.json").exists()


def test_acceptance_model():
  for gamma in (1, 2, 4, 6):
    for rate in (0.3, 0.74, 0.95):
      a = bench.per_token_acceptance(rate, gamma)
      assert bench.expected_tokens(a, gamma) == pytest.approx(1 + rate * gamma, rel=1e-6)
  assert bench.expected_tokens(1.0, 4) == 5.0
  assert bench.quant_capacity(8192, 100, 128) == 8320


def test_kv_only_draft_reads_the_full_weights(tmp_path):
  """--layouts none: a KV-only draft (QuantSpec's weight_bits=None) keeps the full linears, so
  it reads the verifier's weight bytes and stores no 4-bit copy, and gets a projection."""
  out = tmp_path / "quantspec_step.json"
  result = bench.main(["--smoke", "--no-isolate", "--kinds", "quantspec", "--layouts", "none",
                       "int4", "--out", str(out)])
  rows = {r.get("layout"): r for r in result["rows"] if r["kind"] == "draft"}
  assert set(rows) == {"none", "int4"} and not [r for r in result["rows"] if "error" in r]
  kv_only, four_bit = rows["none"]["bytes"], rows["int4"]["bytes"]
  assert kv_only["draft_weight_bytes_read"] == kv_only["verify_weight_bytes_read"]
  assert kv_only["draft_linear_bytes"] == 0
  assert four_bit["draft_weight_bytes_read"] < four_bit["verify_weight_bytes_read"]
  assert kv_only["draft_cache_bytes_read"] == four_bit["draft_cache_bytes_read"]
