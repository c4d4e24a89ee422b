"""benchmarks/ngram_decoding.py and plot_ngram.py on the embedded stories260K checkpoint (CPU,
fp32): the --speed sweep over guess counts (the FAFO paper's Figure 1 rows) and the --sweep rows
run end to end and the plot is drawn, so the GPU benchmark cannot rot. In fp32 every method is
token-identical to dense greedy, which the rows' own divergence check must report."""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks import ngram_decoding, plot_ngram  # noqa: E402
from conftest import STORIES  # noqa: E402  (the embedded stories260K)


def test_figure1_rows_and_plot(tmp_path, monkeypatch):
  # The first two HumanEval prompts (250 and 329 tokens) fall in two prompt buckets (256, 512):
  # every --speed row compiled its decode loop twice. Cut to their first 100 and 120 tokens they
  # share one bucket (128), still of unequal lengths, so each row compiles once (prompt_ids itself
  # still runs).
  real_prompt_ids = ngram_decoding.prompt_ids
  monkeypatch.setattr(ngram_decoding, "prompt_ids", lambda tok, name, num: [
      p[: 100 + 20 * i] for i, p in enumerate(real_prompt_ids(tok, name, num))])
  # --fresh-executables: each --speed and --sweep row starts from empty compilation caches (the
  # count is checked; clearing itself is jax's, and recompiling every row would only slow this).
  cleared = []
  monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
  out = tmp_path / "ngram.json"
  result = ngram_decoding.main([
      "--gguf", str(STORIES), "--dtype", "float32", "--prompt-sets", "humaneval",
      "--num-prompts", "2", "--speed-prompts", "2", "--max-new-tokens", "12", "--length", "3",
      "--candidates", "2", "--guesses", "2", "--speed", "--speed-guesses", "2", "3",
      "--sweep", "--fresh-executables", "--out", str(out)])
  assert len(cleared) == len(result["speed"]) + len(result["sweep"]) == 6 + 3
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  speed = result["speed"]
  assert [(r["method"], r["guesses"]) for r in speed] == [
      ("dense", 0), ("fafo", 2), ("lookahead", 2), ("fafo", 3), ("lookahead", 3),
      ("dense_after", 0)]
  for r in speed:
    assert r["prompts"] == 2 and r["tokens_per_second"] > 0 and r["steps"] > 0
    # 11 loop tokens a prompt (the first comes from prefill) over the rows' steps.
    assert r["tau"] * r["steps"] == pytest.approx(11 * 2) and r["steps"] <= 11 * 2
    if r["method"] != "dense":
      assert r["identical_to_dense_prompts"] == 2 and r["divergences"] == []
  assert speed[0]["tau"] == 1.0 and speed[0]["speedup_vs_dense"] == 1.0
  assert 0.0 <= speed[0]["repeated_8gram_share"] <= 1.0
  assert result["sweep"][0]["repeated_8gram_share"] == speed[0]["repeated_8gram_share"]  # same text
  assert [r["method"] for r in result["sweep"]] == ["dense", "fafo", "lookahead"]
  assert all(r["identical_to_dense_rows"] == 2 for r in result["sweep"][1:])

  png = tmp_path / "figure1.png"
  plot_ngram.main([str(out), "--out", str(png)])
  assert png.stat().st_size > 10_000
  gains = plot_ngram.speedups(speed)
  assert set(gains) == {("humaneval", m, g) for m in ("fafo", "lookahead", "dense_after")
                        for g in ((2, 3) if m != "dense_after" else (0,))}


def test_speed_plan_measures_every_dense_before_any_other_loop():
  # Every dense row before any other loop (an H200 process ran its loops ~15% slower once several
  # decode loops had been compiled, sessions 68-69): the second set's dense must not come after
  # the first set's methods.
  plan = ngram_decoding.speed_plan(["mt_bench", "humaneval"], ["fafo", "lookahead"], [10, 40])
  assert plan[:2] == [("mt_bench", "dense", 0), ("humaneval", "dense", 0)]
  assert plan[-2:] == [("mt_bench", "dense_after", 0), ("humaneval", "dense_after", 0)]
  assert plan[2:-2] == [(s, m, g) for s in ("mt_bench", "humaneval") for g in (10, 40)
                        for m in ("fafo", "lookahead")]


@pytest.mark.parametrize("bad, message", [
    (["--methods", "fafoo"], "invalid choice: 'fafoo'"),      # ran dense, labelled 'fafoo'
    (["--prompt-sets", "mtbench"], "invalid choice: 'mtbench'"),   # after the first set's runs
    (["--num-prompts", "-1"], "--num-prompts: must be an integer >= 1, got '-1'"),  # 79 prompts
    (["--speed-prompts", "0"], "--speed-prompts: must be an integer >= 1"),  # a 0 / 0 division
    (["--guesses", "0"], "--guesses: must be an integer >= 1"),
    ([], "nothing to measure: give --sweep, --speed or both"),   # an empty JSON, silently
])
def test_bad_arguments_refused_by_name_before_the_model_loads(bad, message, monkeypatch,
                                                               capsys, tmp_path):
  def no_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the arguments were checked")
  monkeypatch.setattr(ngram_decoding, "load_model", no_load)
  sweep = [] if bad == [] else ["--sweep"]
  with pytest.raises(SystemExit):
    ngram_decoding.main(["--gguf", str(STORIES), *sweep, *bad, "--out", str(tmp_path / "x.json")])
  assert message in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()


def test_plot_ngram_refuses_a_json_without_rows(tmp_path, capsys):
  """A JSON with no rows crashed in matplotlib (`Number of columns must be a positive integer`),
  and a kernels.py JSON with an AttributeError on its device string: both refused by name."""
  empty = tmp_path / "empty.json"
  empty.write_text(json.dumps({"device": {"device_kind": "cpu"}, "sweep": [], "speed": []}))
  kernels = tmp_path / "kernels.json"
  kernels.write_text(json.dumps({"device": "NVIDIA H200", "sweep": {"kernels": ["decode"]},
                                 "measurements": []}))
  for path, message in ((empty, "no sweep or speed rows in"),
                        (kernels, "is not an ngram_decoding.py JSON")):
    with pytest.raises(SystemExit):
      plot_ngram.main([str(path), "--out", str(tmp_path / "figure1.png")])
    assert message in capsys.readouterr().err
  assert not (tmp_path / "figure1.png").exists()
