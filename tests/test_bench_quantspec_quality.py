"""benchmarks/quantspec_quality.py on the embedded stories260K checkpoint (CPU, fp32): the
acceptance sweep over book windows decoded one at a time pools their counts, runs with the draft's
linears emulating a GPU kernel where asked, and windows that do not fit the book are refused
before any decoding."""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks import quantspec_quality  # noqa: E402
from conftest import STORIES  # noqa: E402  (the embedded stories260K)


def test_pooled_stats_sum_counts_over_runs():
  run = lambda drafted, accepted, steps, made: SimpleNamespace(
      method_stats={"drafted_tokens": drafted, "accepted_drafts": accepted, "gamma": 2,
                    "acceptance_rate": accepted / drafted},
      active_steps=[steps], tokens=[[0] * (made + 1)], num_generated=made + 1)
  row = quantspec_quality.pooled_stats([run(10, 9, 5, 14), run(30, 15, 15, 30)])
  assert row["runs"] == 2 and row["gamma"] == 2
  assert (row["drafted_tokens"], row["accepted_drafts"]) == (40, 24)
  assert row["acceptance_rate"] == 0.6                   # pooled, not the mean of 0.9 and 0.5
  assert row["tau"] == pytest.approx(44 / 20)
  assert row["accepted_drafts_per_step"] == pytest.approx(24 / 20)
  assert [(r["drafted_tokens"], r["accepted_drafts"]) for r in row["per_run"]] == [(10, 9),
                                                                                 (30, 15)]
  # 15 and 31 zeros: every 8-gram but the first repeats
  assert [r["repeated_8gram_share"] for r in row["per_run"]] == [round(7 / 8, 4),
                                                                 round(23 / 24, 4)]


def test_repeated_ngram_share_counts_tokens_that_end_a_seen_ngram():
  from sparsedec.bench import mean_repeated_ngram_share, repeated_ngram_share as share
  assert share(list(range(20))) == 0.0
  assert share([1, 2, 3] * 4, n=3) == 7 / 10             # the first cycle's three are new
  assert share([5, 6, 7, 8, 5, 6, 7, 9], n=3) == 1 / 6   # only "5 6 7" comes back
  assert share([1, 2], n=3) == 0.0
  assert mean_repeated_ngram_share([list(range(20)), [0] * 15]) == round(7 / 16, 4)
  assert mean_repeated_ngram_share([]) == 0.0


def test_book_windows_one_at_a_time(tmp_path, monkeypatch):
  out = tmp_path / "quality.json"
  result = quantspec_quality.main([
      "--gguf", str(STORIES), "--skip-ppl", "--sets", "book", "--book-prompts", "2",
      "--prompt-tokens", "64", "--new-tokens", "10", "--gammas", "2", "--group", "16",
      "--weight-group", "32", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  (row,) = result["acceptance"]
  assert row["prompts"] == "book" and row["gamma"] == 2 and row["runs"] == 2
  assert 0 < row["accepted_drafts"] <= row["drafted_tokens"]
  assert row["acceptance_rate"] == round(row["accepted_drafts"] / row["drafted_tokens"], 4)
  assert 1.0 <= row["tau"] <= 3.0
  assert [r["drafted_tokens"] for r in row["per_run"]] != [] and sum(
      r["drafted_tokens"] for r in row["per_run"]) == row["drafted_tokens"]
  # The same sweep with the draft's linears multiplying as the GPU's dp4a kernel does: the
  # emulation is in place while the sweep runs and gone after it.
  from sparsedec.model import linear
  plain, real, seen = linear.quant_matmul, quantspec_quality.draft_matmul, []

  @contextlib.contextmanager
  def spying(*args):
    with real(*args):
      seen.append((args, linear.quant_matmul is not plain))
      yield
  monkeypatch.setattr(quantspec_quality, "draft_matmul", spying)
  emulated = quantspec_quality.main([
      "--gguf", str(STORIES), "--skip-ppl", "--sets", "book", "--book-prompts", "1",
      "--prompt-tokens", "64", "--new-tokens", "6", "--gammas", "2", "--group", "16",
      "--weight-group", "32", "--emulate-one-row-gemv", "dp4a", "--out", str(out)])
  assert seen == [((2, "exact"), True)] and linear.quant_matmul is plain
  assert emulated["args"]["emulate_one_row_gemv"] == "dp4a"
  assert 0 <= emulated["acceptance"][0]["accepted_drafts"] <= emulated["acceptance"][0][
      "drafted_tokens"]
  with pytest.raises(SystemExit, match="do not fit"):
    quantspec_quality.main(["--gguf", str(STORIES), "--skip-ppl", "--book-prompts", "10000",
                            "--out", str(out)])


@pytest.mark.parametrize("bad, message", [
    # ran the KV-only draft and labelled its rows weight_quantizer "gptq"
    (["--weight-bits", "none", "--weight-quantizer", "gptq"],
     "--weight-quantizer gptq chooses the draft's 4-bit weights"),
    # these three were checked only after the perplexity pass
    (["--weight-quantizer", "gptq", "--calibration-offset", "100"],
     "--calibration-offset overlaps the book prompts"),
    (["--weight-quantizer", "gptq", "--calibration-source", "self-chat",
      "--calibration-prompts", "2", "9"], "--calibration-prompts overlap the evaluated"),
    (["--weight-quantizer", "gptq", "--calibration-source", "mixed", "--calibration-turns", "3"],
     "--calibration-turns must be distinct turns among 1 and 2"),
    (["--weight-quantizer", "gptq", "--calibration-source", "self-chat",
      "--calibration-prompts", "40", "40"], "FIRST < STOP"),      # calibrated on nothing
    (["--mt-bench-prompts", "-1"], "--mt-bench-prompts: must be an integer >= 1"),  # took 79
    (["--gammas", "2", "0"], "--gammas: must be an integer >= 1"),
    (["--chunk", "0"], "--chunk: must be an integer >= 1"),
])
def test_bad_arguments_refused_before_the_model_loads(bad, message, monkeypatch, capsys,
                                                       tmp_path):
  def no_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the arguments were checked")
  monkeypatch.setattr(quantspec_quality, "load_model", no_load)
  with pytest.raises(SystemExit) as e:
    quantspec_quality.main(["--gguf", str(STORIES), *bad, "--out", str(tmp_path / "x.json")])
  assert message in f"{e.value} {capsys.readouterr().err}"
