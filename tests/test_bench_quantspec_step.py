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


def test_reproject_matches_acceptance_to_the_draft_weight_group(tmp_path):
  """--reproject: projections from an earlier run's rows and acceptance measured elsewhere; with
  acceptance files of two weight groups, each draft takes its own group's rows, and best_gamma
  holds the fastest gamma per draft and source."""
  step = tmp_path / "step.json"
  bench.main(["--smoke", "--no-isolate", "--gammas", "1", "2", "--layouts", "int4",
              "--out", str(step)])
  rows = json.loads(step.read_text())["rows"]
  assert {r["weight_group"] for r in rows if r["kind"] == "draft"} == {64}
  files = []
  for group, rates in ((64, {1: 0.9, 2: 0.8}), (128, {1: 0.5, 2: 0.4})):
    path = tmp_path / f"acceptance_wg{group}.json"
    path.write_text(json.dumps({"args": {"weight_group": group}, "acceptance": [
        {"prompts": "mt_bench", "gamma": g, "acceptance_rate": r, "tau": 1 + g * r,
         "weight_group": group} for g, r in rates.items()]}))
    files.append(str(path))
  out = tmp_path / "projected.json"
  result = bench.main(["--reproject", str(step), str(step), "--acceptance-json", *files,
                       "--out", str(out)])     # a second run's dense and verify rows: not doubled
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  projected = result["projected"]
  assert len(projected) == 2 * 2 and {p["weight_group"] for p in projected} == {64}
  assert all(p["source"] == "acceptance_wg64.json:mt_bench" for p in projected)
  for p in projected:
    g = p["gamma"]
    rate = {1: 0.9, 2: 0.8}[g]
    assert p["expected_tokens_per_step"] == pytest.approx(1 + g * rate)
    assert p["projected_speedup"] == pytest.approx(
        p["t_dense_s"] * (1 + g * rate) / (g * p["t_draft_s"] + p["t_verify_s"]))
  best = result["best_gamma"]
  assert len(best) == 1 and best[0]["projected_speedup"] == max(
      p["projected_speedup"] for p in projected)
  other = tmp_path / "acceptance_gamma5.json"         # rows at no gamma the run timed
  other.write_text(json.dumps({"acceptance": [{"prompts": "book", "gamma": 5,
                                               "acceptance_rate": 0.7}]}))
  with pytest.raises(SystemExit, match="no \\(dense, draft, verify, acceptance\\)"):
    bench.main(["--reproject", str(step), "--acceptance-json", str(other), "--out", str(out)])


@pytest.mark.parametrize("bad, message", [
    (["--acceptance", "-0.5"], "--acceptance is a per-token acceptance probability in [0, 1]"),
    (["--acceptance", "1.5"], "--acceptance is a per-token acceptance probability in [0, 1]"),
    (["--acceptance-json", "missing.json"], "--acceptance-json: no file at missing.json"),
    (["--gammas", "2", "0"], "--gammas: must be an integer >= 1"),
    (["--steps", "0"], "--steps: must be an integer >= 1"),
])
def test_bad_projection_arguments_refused_by_name(bad, message, capsys, tmp_path):
  """--acceptance -0.5 projected 0.75 tokens per step (E < 1) and 1.5 was taken as 1; a missing
  --acceptance-json was skipped (no projections at all, or --reproject's error about rows)."""
  step = tmp_path / "step.json"
  step.write_text(json.dumps({"rows": [
      {"kind": "dense", "context": 300, "step_seconds": 0.01},
      {"kind": "draft", "context": 300, "layout": "int4", "step_seconds": 0.004},
      {"kind": "verify", "context": 300, "gamma": 2, "step_seconds": 0.012}]}))
  with pytest.raises(SystemExit):
    bench.main(["--reproject", str(step), *bad, "--out", str(tmp_path / "out.json")])
  assert message in capsys.readouterr().err
  assert not (tmp_path / "out.json").exists()
