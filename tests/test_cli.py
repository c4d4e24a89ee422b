"""The command line, end to end through `sparsedec.cli.main`."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

import sparsedec
from sparsedec import cli
from sparsedec.weights.checkpoint import load_model


def run_cli(capsys, *argv) -> tuple[int, str, str]:
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


@pytest.fixture(scope="module")
def default_model():
  return load_model(cli.default_model())


def test_generate_json_equals_library_call(capsys, default_model):
  cfg, params, tok = default_model
  code, out, _ = run_cli(capsys, "generate", "--prompt", "Once upon a time",
                         "--max-new-tokens", "24", "--json")
  assert code == 0
  result = json.loads(out)
  expected = sparsedec.generate(cfg, params, [tok.encode("Once upon a time")], max_new_tokens=24)
  assert result["tokens"] == expected.tokens[0]
  assert result["text"] == tok.decode(expected.tokens[0], skip_special_tokens=True)
  assert result["stats"]["generated_tokens"] == len(expected.tokens[0])
  assert result["stats"]["tokens_per_second"] > 0


def test_generate_text_on_stdout_stats_on_stderr_and_stream_agrees(capsys):
  code, out, err = run_cli(capsys, "generate", "--prompt", "Once upon a time",
                           "--max-new-tokens", "40", "--ignore-eos")
  assert code == 0 and out.startswith(", there was a little girl named Lily")
  assert json.loads(err.strip().splitlines()[-1])["generated_tokens"] == 40
  code, streamed, err = run_cli(capsys, "generate", "--prompt", "Once upon a time",
                                "--max-new-tokens", "40", "--ignore-eos", "--stream")
  assert code == 0 and streamed == out
  # The stream's stats are the same record as generate's (they were only the token count).
  stats = json.loads(err.strip().splitlines()[-1])
  assert stats["generated_tokens"] == 40 and stats["steps"] == 39 and stats["tau"] == 1.0
  assert stats["tokens_per_second"] > 0 and stats["method"] == "dense"


def test_python_dash_m_runs_the_command_line():
  """`python -m sparsedec` is the `sparsedec` script (there was no __main__ module)."""
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, "-m", "sparsedec", "generate", "--help"],
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("usage: sparsedec generate") and "--method" in proc.stdout


def test_sampled_generation_is_reproducible_by_seed(capsys):
  args = ("generate", "--prompt", "Lily", "--max-new-tokens", "20", "--temperature", "1.0",
          "--top-k", "50", "--top-p", "0.95", "--json")
  a = json.loads(run_cli(capsys, *args, "--seed", "1")[1])["tokens"]
  b = json.loads(run_cli(capsys, *args, "--seed", "1")[1])["tokens"]
  c = json.loads(run_cli(capsys, *args, "--seed", "2")[1])["tokens"]
  assert a == b and a != c


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    # Sampling-only flags at temperature 0 did nothing and said nothing.
    (["--top-k", "40"], "--top-k applies only when sampling, and --temperature is 0"),
    (["--top-k", "40", "--top-p", "0.9", "--temperature", "0"], "--top-k, --top-p apply only"),
    (["--method", "quantspec", "--draft-sampling", "argmax"], "--draft-sampling applies only"),
    (["--method", "speculative"], "--method speculative needs --draft-model PATH"),
    (["--draft-model", "checkpoints/stories260K"], "--draft-model does not apply to --method dense"),
    (["--method", "speculative", "--draft-model", "/nonexistent/draft"], "/nonexistent/draft"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--cache-size", "8", "--max-new-tokens", "16"], "does not fit in the KV cache of 8"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--model", ""], "--model is empty"),           # `--model "$UNSET"` ran the default model
    (["--chat", "hi"], "has no chat_template"),
    (["--system", "be brief"], "--system goes with --chat"),
    (["--stream", "--json"], "--stream and --json do not go together"),
    (["--method", "fafo", "--policy", "quest", "--recent-blocks", "3"],
     "--recent-blocks applies to --policy snapkv / retrieval, not quest"),
    (["--method", "triforce"], "--method triforce needs --draft-model PATH"),
    (["--method", "triforce", "--draft-model", "checkpoints/stories260K", "--draft-gamma", "0"],
     "triforce draft_gamma must be an integer >= 1"),
    (["--method", "speculative", "--draft-model", "checkpoints/stories260K", "--draft-gamma",
      "2"],
     "--draft-gamma does not apply to --method speculative"),
    (["--method", "fafo", "--sink-blocks", "2", "--policy", "snapkv"],
     "--sink-blocks applies to --policy streaming, not snapkv"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
  base = ["generate"] + ([] if "--chat" in argv else ["--prompt", "Once"])
  code, out, err = run_cli(capsys, *base, *argv)
  assert code == 2 and out == ""
  assert message in err


def test_speculative_with_a_draft_model_equals_dense(capsys):
  """--method speculative --draft-model: the embedded model drafting for itself gives dense's
  text with every draft accepted, and reports its acceptance."""
  base = ["generate", "--prompt", "Once upon a time", "--max-new-tokens", "40", "--json",
          "--ignore-eos"]
  _, dense, _ = run_cli(capsys, *base)
  code, out, _ = run_cli(capsys, *base, "--method", "speculative", "--draft-model",
                         cli.default_model(), "--gamma", "3")
  got = json.loads(out)
  assert code == 0 and got["tokens"] == json.loads(dense)["tokens"]
  assert got["stats"]["acceptance_rate"] == 1.0 and got["stats"]["draft_layers"] == 5


def test_triforce_with_a_draft_model_equals_dense(capsys):
  """--method triforce --draft-model: the embedded model drafting for itself, the middle level
  reading 2 retrieved and 2 newest blocks of 16 slots, gives dense's text; its stats report both
  levels."""
  base = ["generate", "--prompt", "Once upon a time there was a little girl named Lily. She "
          "loved to play outside", "--max-new-tokens", "60", "--json", "--ignore-eos"]
  _, dense, _ = run_cli(capsys, *base)
  code, out, _ = run_cli(capsys, *base, "--method", "triforce", "--draft-model",
                         cli.default_model(), "--gamma", "4", "--draft-gamma", "1",
                         "--budget-blocks", "4", "--block-size", "16", "--recent-blocks", "2",
                         "--draft-budget-blocks", "2")
  got = json.loads(out)
  assert code == 0 and got["tokens"] == json.loads(dense)["tokens"]
  stats = got["stats"]
  assert stats["retrieval_budget_tokens"] == 64 and stats["draft_view_budget_tokens"] == 32
  assert 0.0 < stats["acceptance_rate"] <= 1.0 and 0.0 < stats["draft_acceptance_rate"] <= 1.0


def test_sfi_takes_the_tokenizers_sentence_ends(capsys):
  """--method sfi: the sentence-ending tokens come from the tokenizer; a memory of every block
  gives dense's text, with slow and fast steps in its stats."""
  base = ["generate", "--prompt", "Once upon a time there was a little girl named Lily.",
          "--max-new-tokens", "80", "--json", "--ignore-eos"]
  _, dense, _ = run_cli(capsys, *base)
  code, out, _ = run_cli(capsys, *base, "--method", "sfi", "--budget-blocks", "16",
                         "--block-size", "16", "--max-fast-steps", "8")
  got = json.loads(out)
  assert code == 0 and got["tokens"] == json.loads(dense)["tokens"]
  assert got["stats"]["slow_steps"] > 0 and got["stats"]["fast_steps"] > 0
  ends = got["stats"]["method_config"]["boundary_tokens"]
  assert len(ends) == 7 and 13 in ends                        # ".", "!", "?", "\\n", ...


def test_bench_writes_json(capsys, tmp_path):
  out_file = tmp_path / "bench.json"
  code, out, _ = run_cli(capsys, "bench", "--num-prompts", "2", "--max-new-tokens", "8",
                         "--ignore-eos", "--output", str(out_file))
  assert code == 0
  result = json.loads(out_file.read_text())
  assert result == json.loads(out)
  assert result["generated_tokens"] == 16 and result["tokens_per_second"] > 0
  assert result["device"]["platform"] == jax.default_backend()
  assert "host_peak_rss_bytes" in result["memory"]


def test_bench_tau_weights_each_run_by_its_steps(monkeypatch, stories):
  """bench reported only `mean_tau`, the plain mean of the runs' tau: a run of 8 tokens in 2
  steps (tau 4) and one of 1 token in 1 step (tau 1) gave 2.5, where 9 tokens in 3 steps is 3."""
  from sparsedec import bench
  from sparsedec.decode.api import GenerationResult
  made = iter([[9, 2], [2, 1]] * 2)          # (tokens incl. prefill's first, steps), warm-up too

  def fake_generate(cfg, params, ids, **kw):
    tokens, steps = next(made)
    return GenerationResult(tokens=[[5] * tokens], prompt_lengths=[len(ids[0])],
                            stopped=[False], steps=steps, active_steps=[steps],
                            prefill_seconds=0.1, decode_seconds=1.0)
  monkeypatch.setattr(bench, "generate", fake_generate)
  cfg, params, tok = stories
  result = bench.run_bench(cfg, params, tok, num_prompts=2, max_new_tokens=8)
  assert [r["tau"] for r in result["runs"]] == [4.0, 1.0]
  assert result["tau"] == 3.0 and result["mean_tau"] == 2.5
  # Tokens per second of the decode loop: each row's first token is prefill's, not the loop's
  # (8 and 1 loop tokens in 1 s each: 4.5 a second, not 11 / 2).
  assert [r["tokens_per_second"] for r in result["runs"]] == [8.0, 1.0]
  assert result["tokens_per_second"] == 4.5 and result["median_tokens_per_second"] == 4.5


def test_bench_reports_the_device_the_params_are_on(monkeypatch, stories):
  """bench read the device and its peak memory from jax.devices()[0], whatever device the params
  (and so the run) were on."""
  from sparsedec import bench
  from sparsedec.decode.api import GenerationResult

  class Device:                      # where run_devices says the params are
    platform, device_kind, id = "cpu", "the params' device", 7
    memory_stats = staticmethod(lambda: {"peak_bytes_in_use": 1234})

  cfg, params, tok = stories
  asked = []
  monkeypatch.setattr(bench, "run_devices", lambda like: asked.append(like) or {Device()})
  monkeypatch.setattr(bench, "generate", lambda cfg, params, ids, **kw: GenerationResult(
      tokens=[[5, 5]], prompt_lengths=[len(ids[0])], stopped=[False], steps=1,
      active_steps=[1], prefill_seconds=0.1, decode_seconds=1.0))
  result = bench.run_bench(cfg, params, tok, num_prompts=1, max_new_tokens=2)
  assert asked == [params["embed"]]
  assert result["device"]["device_kind"] == "the params' device"
  assert result["memory"]["device_peak_bytes"] == 1234


def test_bench_refuses_no_prompts_and_empty_batches(capsys, tmp_path):
  """A negative count sliced the set from the end, 0 prompts wrote NaN into the JSON and a batch
  size of 0 crashed: each is refused by name."""
  for flag, value, message in (("--num-prompts", "0", "num_prompts must be an integer >= 1"),
                               ("--num-prompts", "-1", "num_prompts must be an integer >= 1"),
                               ("--batch-size", "0", "batch_size must be an integer >= 1")):
    code, _, err = run_cli(capsys, "bench", flag, value, "--max-new-tokens", "2")
    assert code == 2 and message in err, (flag, value, err)
  empty = tmp_path / "prompts.txt"
  empty.write_text("\n")
  code, _, err = run_cli(capsys, "bench", "--prompts", str(empty), "--max-new-tokens", "2")
  assert code == 2 and "holds no prompts" in err, err


def test_bench_says_when_the_set_holds_fewer_prompts_than_asked(capsys, tmp_path):
  """--num-prompts 5 on a 2-prompt file ran 2 without a word (the JSON's num_prompts said 2)."""
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("Once upon a time\nThe dog\n")
  code, out, err = run_cli(capsys, "bench", "--prompts", str(prompts), "--num-prompts", "5",
                           "--max-new-tokens", "2")
  assert code == 0 and json.loads(out)["num_prompts"] == 2
  assert "holds 2 prompts: running 2, not --num-prompts 5" in err, err
  code, _, err = run_cli(capsys, "bench", "--prompts", str(prompts), "--num-prompts", "2",
                         "--max-new-tokens", "2")
  assert code == 0 and "note:" not in err, err


def test_bench_refuses_bad_prompts_counts_and_sampling_before_loading(capsys, tmp_path,
                                                                     monkeypatch):
  """A misspelt --prompts, a count < 1 and a sampling flag at temperature 0 were refused only
  after the model (and a --draft-calibration GPTQ draft) had been built."""
  def no_load(args):
    raise AssertionError("the model was loaded before the arguments were checked")
  monkeypatch.setattr(cli, "_load", no_load)
  for argv, message in ((("--prompts", "mt_bnech"), "unknown prompt set 'mt_bnech'"),
                        (("--prompts", str(tmp_path / "none.txt")), "prompt file not found"),
                        (("--num-prompts", "0"), "num_prompts must be an integer >= 1"),
                        (("--batch-size", "-2"), "batch_size must be an integer >= 1"),
                        (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1, got 0"),
                        (("--top-k", "5"), "--top-k applies only when sampling")):
    code, _, err = run_cli(capsys, "bench", "--max-new-tokens", "2", *argv)
    assert code == 2 and message in err, (argv, err)


def test_bench_checks_its_output_first_and_uses_the_cache_size(capsys, tmp_path, monkeypatch):
  """An --output that cannot be written used to fail after the whole run (the results lost: the
  file was written before they were printed); --cache-size used to be ignored by bench."""
  from sparsedec import bench
  runs = []
  monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: runs.append(kw) or {"ok": 1})
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  for target, message in ((blocker / "bench.json", "is not a directory"),
                          (tmp_path, "it is a directory")):
    code, out, err = run_cli(capsys, "bench", "--max-new-tokens", "2", "--output", str(target))
    assert code == 2 and out == "" and message in err, err
  assert runs == []                                      # refused before any run
  code, out, _ = run_cli(capsys, "bench", "--max-new-tokens", "2", "--cache-size", "300")
  assert code == 0 and runs[-1]["cache_size"] == 300
  monkeypatch.undo()                                     # the real bench: the capacity applies
  code, _, err = run_cli(capsys, "bench", "--num-prompts", "1", "--max-new-tokens", "4",
                         "--cache-size", "10")
  assert code == 2 and "does not fit in the KV cache of 10 tokens" in err, err


def test_convert_refuses_an_unwritable_output_before_loading(capsys, tmp_path, stories_hf_dir,
                                                             monkeypatch):
  from sparsedec.weights import checkpoint
  monkeypatch.setattr(checkpoint, "_load_source", lambda *a: pytest.fail("loaded the source"))
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  code, _, err = run_cli(capsys, "convert", str(stories_hf_dir), str(blocker / "out"))
  assert code == 2 and f"{blocker} is not a directory" in err, err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]      # nothing written


def test_sampling_must_be_a_sampling_config(default_model):
  cfg, params, tok = default_model
  with pytest.raises(sparsedec.InputError, match="sampling must be a SamplingConfig"):
    sparsedec.generate(cfg, params, [tok.encode("Once")], max_new_tokens=2,
                       sampling={"temperature": 0.5})


def test_convert_then_chat_with_smollm2(capsys, tmp_path, smollm2_gguf):
  out_dir = tmp_path / "smollm2"
  code, _, _ = run_cli(capsys, "convert", str(smollm2_gguf), str(out_dir))
  assert code == 0 and (out_dir / "sparsedec_config.json").is_file()
  code, out, _ = run_cli(capsys, "generate", "--model", str(out_dir), "--chat",
                         "What is the capital of France?", "--max-new-tokens", "12")
  assert code == 0
  assert "Paris" in out
  code, _, err = run_cli(capsys, "convert", str(smollm2_gguf), str(out_dir))
  assert code == 2 and "exists" in err


def test_a_closed_stdout_ends_quietly(tmp_path):
  """`sparsedec generate --stream ... | head -c 5`: once the reader is gone, the next write
  raised BrokenPipeError and the command ended on a traceback."""
  import os
  import subprocess
  import sys
  read, write = os.pipe()
  os.close(read)                                   # the reader is gone before the first write
  try:
    proc = subprocess.run([sys.executable, "-m", "sparsedec", "generate", "--prompt", "Once",
                           "--max-new-tokens", "4", "--stream"], stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=300, check=False)
  finally:
    os.close(write)
  assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
  assert proc.returncode == 1


def test_ctrl_c_ends_on_one_line_and_the_sigint_code(capsys, monkeypatch):
  """Ctrl-C during a command printed Python's traceback; now one line and exit code 130."""
  def interrupted(args):
    raise KeyboardInterrupt
  monkeypatch.setattr(cli, "cmd_generate", interrupted)
  try:
    code, out, err = run_cli(capsys, "generate", "--prompt", "Once")
  except KeyboardInterrupt:        # not caught by main (which would also stop pytest's session)
    pytest.fail("KeyboardInterrupt escaped cli.main")
  assert code == 130 and out == ""
  assert err == "sparsedec: interrupted\n"


def test_policy_knobs_reach_the_policy():
  """--sink-blocks (StreamingLLM) and --recent-blocks (SnapKV) set their policy's fields; a SnapKV
  budget of 2 blocks needs --recent-blocks 1 (the default 2 is refused below the budget)."""
  def parse(*args):
    argv = ["generate", "--prompt", "x", "--method", "fafo", *args]
    return cli._method(cli._parser().parse_args(argv))
  assert parse("--sink-blocks", "3").policy.sink_blocks == 3
  policy = parse("--policy", "snapkv", "--budget-blocks", "2", "--recent-blocks", "1").policy
  assert (policy.name, policy.budget_blocks, policy.recent_blocks) == ("snapkv", 2, 1)


def test_mt_bench_turn_is_1_or_2():
  """mt_bench(turn=0) returned the second turns (turns[-1]) and turn 3 an IndexError."""
  from sparsedec import prompts
  first, second = prompts.mt_bench(1), prompts.mt_bench(2)
  assert len(first) == len(second) == 80 and first[0] != second[0]
  for turn in (0, 3, -1, True):
    with pytest.raises(sparsedec.InputError, match="MT-Bench turn must be 1 or 2"):
      prompts.mt_bench(turn)


def test_bench_names_a_missing_prompt_file_and_the_shared_dir_it_read(capsys, tmp_path,
                                                                      monkeypatch):
  """A --prompts path that does not exist was called an 'unknown prompt set' that offered 'a file
  path' as the remedy; a directory read the same; with SPARSEDEC_SHARED set, a missing set
  pointed at ../shared and told the user to set the variable they had set."""
  missing = tmp_path / "my_prompts.txt"
  code, _, err = run_cli(capsys, "bench", "--prompts", str(missing), "--max-new-tokens", "2")
  assert code == 2 and f"prompt file not found: {missing}" in err, err
  code, _, err = run_cli(capsys, "bench", "--prompts", str(tmp_path), "--max-new-tokens", "2")
  assert code == 2 and "is a directory" in err, err
  code, _, err = run_cli(capsys, "bench", "--prompts", "mt_bnech", "--max-new-tokens", "2")
  assert code == 2 and "unknown prompt set 'mt_bnech'" in err, err
  monkeypatch.setenv("SPARSEDEC_SHARED", str(tmp_path / "nowhere"))
  code, _, err = run_cli(capsys, "bench", "--prompts", "mt_bench", "--max-new-tokens", "2")
  assert code == 2 and f"SPARSEDEC_SHARED={tmp_path / 'nowhere'}" in err, err
  assert "set SPARSEDEC_SHARED to" not in err, err


def test_an_empty_system_message_is_kept():
  """`--chat hi --system ""` is how a user drops a template's default system prompt (SmolLM2's
  "You are a helpful AI assistant named SmolLM..."); the empty string was taken for no --system
  at all, so the default one came back silently."""
  seen = []

  class Tok:
    def encode_chat(self, messages, add_generation_prompt):
      seen.append(messages)
      return [1]

  args = cli._parser().parse_args(["generate", "--chat", "hi", "--system", ""])
  cli._prompt_ids(args, Tok())
  assert seen == [[{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]]


def test_a_text_file_that_is_not_utf8_is_a_clear_error(capsys, tmp_path):
  """A --prompts, --draft-calibration or --draft-calibration-prompts file holding bytes that are
  not UTF-8 (a Latin-1 export, a binary picked by mistake) ended the command on a
  UnicodeDecodeError traceback instead of an error naming the file."""
  bad = tmp_path / "latin1.txt"
  bad.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
  code, out, err = run_cli(capsys, "bench", "--prompts", str(bad), "--max-new-tokens", "2")
  assert code == 2 and out == "" and f"prompt file {bad} is not UTF-8 text" in err, err
  for flag, what in (("--draft-calibration", "calibration text file"),
                     ("--draft-calibration-prompts", "calibration prompts file")):
    code, out, err = run_cli(capsys, "generate", "--prompt", "Once", "--method", "quantspec",
                             flag, str(bad), "--max-new-tokens", "2")
    assert code == 2 and out == "" and f"{what} {bad} is not UTF-8 text" in err, (flag, err)


def test_bench_output_write_failure_leaves_no_partial_file(capsys, tmp_path, monkeypatch):
  """A write of --output that fails (a full disk) left its half-written `.NAME.tmp-PID` beside
  the target and ended on an OSError traceback; now the temporary file is removed, a file
  already there is kept as it was, and the error names --output."""
  import errno
  import pathlib
  from sparsedec import bench
  monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: {"ok": 1})
  real_write = pathlib.Path.write_text

  def disk_full(self, data, *args, **kwargs):
    real_write(self, data[:3])
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(pathlib.Path, "write_text", disk_full)
  target = tmp_path / "bench.json"
  target.write_bytes(b"previous run\n")
  code, out, err = run_cli(capsys, "bench", "--max-new-tokens", "2", "--output", str(target))
  assert code == 2 and json.loads(out) == {"ok": 1}
  assert f"--output {target}: cannot write there: No space left on device" in err, err
  assert "Traceback" not in err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
  assert target.read_bytes() == b"previous run\n"


def test_a_prompt_that_is_not_utf8_is_a_clear_error(capsys):
  """`--prompt $'caf\\xe9'` (a Latin-1 terminal): Python hands the byte over as a lone surrogate
  and the tokenizer ended the command on "TypeError: TextInputSequence must be str"."""
  for flag in ("--prompt", "--chat"):
    code, out, err = run_cli(capsys, "generate", flag, "caf\udce9", "--max-new-tokens", "2")
    assert code == 2 and out == "", err
    assert f"{flag} is not UTF-8 text (byte 0xe9 at character 3)" in err, err
  code, _, err = run_cli(capsys, "generate", "--chat", "hi", "--system", "\udcff",
                         "--max-new-tokens", "2")
  assert code == 2 and "--system is not UTF-8 text (byte 0xff at character 0)" in err, err


def test_bench_output_is_written_when_stdout_is_closed(capsys, tmp_path, monkeypatch):
  """`sparsedec bench --output run.json | head -1`: the result was printed first and the reader
  being gone ended the command there (exit 1, quietly), so run.json was never written and the
  run was lost; an empty --output (`--output "$UNSET"`) wrote no file and said nothing."""
  import os
  import sys
  from sparsedec import bench
  monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: {"ok": 1})
  code, out, err = run_cli(capsys, "bench", "--max-new-tokens", "2", "--output", "")
  assert code == 2 and out == "" and "--output is empty" in err, err
  read, write = os.pipe()

  class ClosedStdout:                    # a pipe whose reader is gone
    def write(self, text):
      raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
      pass

    def fileno(self):
      return write                       # what main points at /dev/null

  monkeypatch.setattr(sys, "stdout", ClosedStdout())
  target = tmp_path / "run.json"
  try:
    code = cli.main(["bench", "--max-new-tokens", "2", "--output", str(target)])
  finally:
    os.close(read)
    os.close(write)
  assert code == 1
  assert json.loads(target.read_text()) == {"ok": 1}


def test_empty_paths_are_refused_by_name(capsys, tmp_path, stories_hf_dir, monkeypatch):
  """`convert SRC "$UNSET"` was told the current directory 'already exists', and with
  --overwrite in an empty directory replaced the current directory by the checkpoint (exit 0);
  `bench --prompts ""` was told "prompt set '' is a directory"."""
  monkeypatch.chdir(tmp_path)
  for argv, message in ((("convert", str(stories_hf_dir), "", "--overwrite"),
                         "convert's out is empty"),
                        (("convert", str(stories_hf_dir), ""), "convert's out is empty"),
                        (("convert", "", "out"), "convert's src is empty"),
                        (("bench", "--prompts", "", "--max-new-tokens", "2"),
                         "--prompts is empty")):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and message in err, (argv, err)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_chat_template_is_refused_before_the_gptq_draft(capsys, monkeypatch):
  """--chat / --chat-template on a model without a chat template (stories260K) were refused
  only when the prompts were encoded: after a --draft-calibration GPTQ draft had been built
  (minutes on a real model), and the message named neither flag."""
  monkeypatch.setattr(cli, "_with_draft", lambda *a: pytest.fail("built the draft first"))
  quantspec = ("--method", "quantspec", "--draft-calibration", "README.md")
  for argv, message in (
      (("generate", "--chat", "hi", *quantspec),
       "--chat needs a chat template, and the tokenizer of "),
      (("bench", "--chat-template", *quantspec),
       "--chat-template needs a chat template, and the tokenizer of ")):
    code, out, err = run_cli(capsys, *argv, "--max-new-tokens", "2")
    assert code == 2 and out == "" and message in err, (argv, err)
    assert "has no chat_template" in err


def test_a_run_that_cannot_fit_is_refused_before_the_gptq_draft(capsys, monkeypatch):
  """A prompt + --max-new-tokens past the model's context or --cache-size was refused by the
  first generate call: after a --draft-calibration GPTQ draft had been built."""
  monkeypatch.setattr(cli, "_with_draft", lambda *a: pytest.fail("built the draft first"))
  quantspec = ("--method", "quantspec", "--draft-calibration", "README.md")
  for argv, message in (
      (("generate", "--prompt", "Once", "--max-new-tokens", "600"),
       "= 602 exceeds the model's context of 512 tokens"),
      (("generate", "--prompt", "Once", "--max-new-tokens", "8", "--cache-size", "8"),
       "= 10 does not fit in the KV cache of 8 tokens"),
      (("bench", "--max-new-tokens", "600"), "exceeds the model's context of 512 tokens"),
      (("bench", "--max-new-tokens", "4", "--cache-size", "8"),
       "does not fit in the KV cache of 8 tokens")):
    code, out, err = run_cli(capsys, *argv, *quantspec)
    assert code == 2 and out == "" and message in err, (argv, err)


# ------------------------------------------ round 14: a flag parsed must reach what it sets

def test_every_method_knob_reaches_the_method():
  """Each method flag, set away from its default, lands in its own field of the method object
  (a knob dropped from cli._METHOD_KNOBS was parsed, then silently ignored: the run was lossless
  either way, so no output test saw it)."""
  from sparsedec.compress import ChunkRetrieval, SnapKV, StreamingLLM
  from sparsedec.decode.fafo import Fafo
  from sparsedec.decode.lookahead import Lookahead
  from sparsedec.decode.quantspec import QuantSpec
  from sparsedec.decode.speculative import Speculative
  from sparsedec.decode.sfi import SlowFast
  from sparsedec.decode.triforce import TriForce

  def parse(*args):
    return cli._method(cli._parser().parse_args(["generate", "--prompt", "x", *args]))
  qs = QuantSpec(gamma=2, verify_precision="full", quant_group=16, weight_group=64,
                 weight_grid="absmax", draft_sampling="argmax")
  assert parse("--method", "quantspec", "--gamma", "2", "--verify-precision", "full",
               "--quant-group", "16", "--draft-weight-group", "64", "--draft-weight-grid",
               "absmax", "--draft-sampling", "argmax") == qs
  draft = (load_model(cli.default_model())[0], None)
  spec = cli._method(cli._parser().parse_args(
      ["generate", "--prompt", "x", "--method", "speculative", "--gamma", "6",
       "--draft-sampling", "argmax"]), draft)
  assert spec == Speculative(draft=draft[0], gamma=6, draft_sampling="argmax")
  la = Lookahead(window=4, ngram=3, guesses=2)
  assert parse("--method", "lookahead", "--lookahead-window", "4", "--ngram", "3",
               "--guesses", "2") == la
  fa = Fafo(subsequences=6, length=3, candidates=4,
            policy=StreamingLLM(budget_blocks=3, block_size=8, sink_blocks=2))
  assert parse("--method", "fafo", "--subsequences", "6", "--fafo-length", "3", "--candidates",
               "4", "--budget-blocks", "3", "--block-size", "8", "--sink-blocks", "2") == fa
  snap = parse("--method", "fafo", "--policy", "snapkv", "--budget-blocks", "5", "--block-size",
               "16", "--recent-blocks", "1").policy
  assert snap == SnapKV(budget_blocks=5, block_size=16, recent_blocks=1)
  sfi = parse("--method", "sfi", "--budget-blocks", "3", "--block-size", "32", "--sink-blocks",
              "2", "--recent-blocks", "4", "--max-fast-steps", "9")
  assert sfi == SlowFast(budget_blocks=3, block_size=32, sink_blocks=2, recent_blocks=4,
                         max_fast_steps=9)
  tri = cli._method(cli._parser().parse_args(
      ["generate", "--prompt", "x", "--method", "triforce", "--gamma", "3", "--draft-gamma", "4",
       "--draft-sampling", "argmax", "--budget-blocks", "6", "--block-size", "32",
       "--recent-blocks", "3", "--draft-budget-blocks", "5"]), draft)
  assert tri == TriForce(draft=draft[0], gamma=3, draft_gamma=4, draft_sampling="argmax",
                         retrieval=ChunkRetrieval(budget_blocks=6, block_size=32,
                                                  recent_blocks=3),
                         draft_view=StreamingLLM(budget_blocks=5, block_size=32))
  # Not vacuous: every field set above differs from its default.
  for got, default, fields in (
      (qs, QuantSpec(), ("gamma", "verify_precision", "quant_group", "weight_group",
                         "weight_grid", "draft_sampling")),
      (la, Lookahead(), ("window", "ngram", "guesses")),
      (spec, Speculative(draft=draft[0]), ("gamma", "draft_sampling")),
      (fa, Fafo(), ("subsequences", "length", "candidates")),
      (fa.policy, StreamingLLM(), ("budget_blocks", "block_size", "sink_blocks")),
      (snap, SnapKV(), ("budget_blocks", "block_size", "recent_blocks")),
      (tri, TriForce(draft=draft[0]), ("gamma", "draft_gamma", "draft_sampling")),
      (tri.retrieval, ChunkRetrieval(), ("budget_blocks", "block_size", "recent_blocks")),
      (tri.draft_view, StreamingLLM(), ("budget_blocks", "block_size")),
      (sfi, SlowFast(), ("budget_blocks", "block_size", "sink_blocks", "recent_blocks",
                         "max_fast_steps"))):
    assert all(getattr(got, f) != getattr(default, f) for f in fields), (got, default)
  # Every method flag the parser has is one of cli._METHOD_KNOBS (a new flag is wired there).
  import argparse
  parser = argparse.ArgumentParser()
  cli._add_generation_args(parser)
  groups = [g for g in parser._action_groups
            if g.title and g.title.split(" ")[0] in cli._METHOD_KNOBS]
  flags = {a.dest for g in groups for a in g._group_actions} - {
      "draft_calibration", "draft_calibration_prompts", "draft_calibration_tokens",
      "draft_model"}
  assert flags == {k for knobs in cli._METHOD_KNOBS.values() for k in knobs}


def test_generate_passes_its_flags_to_the_library(capsys, monkeypatch):
  """--temperature / --top-k / --top-p / --seed / --cache-size / --ignore-eos / --max-new-tokens
  reach generate as given (a flag read but not passed on, or a temperature taken as 1.0, gave a
  run of the wrong settings with exit code 0)."""
  from sparsedec.decode import api
  from sparsedec.decode.sampling import SamplingConfig
  calls = []
  real = api.generate

  def spy(cfg, params, prompts, **kw):
    calls.append(kw)
    return real(cfg, params, prompts, **kw)
  monkeypatch.setattr(api, "generate", spy)
  code, _, _ = run_cli(capsys, "generate", "--prompt", "Lily", "--max-new-tokens", "5",
                       "--temperature", "0.7", "--top-k", "20", "--top-p", "0.9", "--seed", "3",
                       "--cache-size", "96", "--ignore-eos", "--json")
  assert code == 0
  (kw,) = calls
  assert kw["sampling"] == SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)
  assert (kw["seed"], kw["cache_size"], kw["max_new_tokens"], kw["stop_tokens"]) == (3, 96, 5, ())
  assert kw["method"] == "dense" or getattr(kw["method"], "name", None) == "dense"
  calls.clear()
  assert run_cli(capsys, "generate", "--prompt", "Lily", "--max-new-tokens", "5")[0] == 0
  assert calls[0]["stop_tokens"] is None and calls[0]["cache_size"] is None


def test_bench_passes_its_flags_to_run_bench_and_generate(capsys, monkeypatch, stories):
  """bench's flags reach run_bench, and run_bench's reach every generate call (warm-up and timed
  runs alike), chat_template through encode_prompts."""
  from types import SimpleNamespace
  from sparsedec import bench
  from sparsedec.decode.api import GenerationResult
  from sparsedec.decode.sampling import SamplingConfig
  seen = []
  monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: seen.append(kw) or {"ok": 1})
  code, _, _ = run_cli(capsys, "bench", "--num-prompts", "3", "--batch-size", "2",
                       "--max-new-tokens", "4", "--temperature", "0.5", "--top-k", "7",
                       "--seed", "9", "--ignore-eos", "--cache-size", "200",
                       "--method", "lookahead", "--guesses", "3")
  assert code == 0
  (kw,) = seen
  assert {k: kw[k] for k in ("num_prompts", "batch_size", "max_new_tokens", "seed",
                             "ignore_eos", "cache_size", "chat_template", "prompts")} == {
      "num_prompts": 3, "batch_size": 2, "max_new_tokens": 4, "seed": 9, "ignore_eos": True,
      "cache_size": 200, "chat_template": False, "prompts": "mt_bench"}
  assert kw["sampling"] == SamplingConfig(temperature=0.5, top_k=7)
  assert kw["method"].name == "lookahead" and kw["method"].guesses == 3
  cfg, params, _ = stories                  # stories260K has no chat template: a tokenizer that has
  chat_tok = SimpleNamespace(chat_template="{{ x }}", encode_chat=lambda messages: [1, 2])
  monkeypatch.setattr(cli, "_load", lambda args, flag=None: (cfg, params, chat_tok))
  assert run_cli(capsys, "bench", "--num-prompts", "1", "--max-new-tokens", "4",
                 "--chat-template")[0] == 0
  assert seen[-1]["chat_template"] is True
  monkeypatch.undo()

  calls = []

  def fake_generate(cfg, params, ids, **kw):
    calls.append((ids, kw))
    return GenerationResult(tokens=[[5, 6]] * len(ids), prompt_lengths=[len(i) for i in ids],
                            stopped=[False] * len(ids), steps=1, active_steps=[1] * len(ids),
                            prefill_seconds=0.1, decode_seconds=1.0)
  monkeypatch.setattr(bench, "generate", fake_generate)
  tok = SimpleNamespace(encode=lambda t: [1, 2],
                        encode_chat=lambda messages: [3, len(messages[0]["content"])])
  cfg, params, _ = stories
  sampling = SamplingConfig(temperature=0.5)
  bench.run_bench(cfg, params, tok, num_prompts=2, batch_size=2, max_new_tokens=4,
                  sampling=sampling, seed=9, method="dense", chat_template=True, ignore_eos=True,
                  cache_size=64)
  texts = bench.bench_prompts("mt_bench", 2, 2)
  assert len(calls) == 2                                         # warm-up, then the timed run
  for ids, kw in calls:
    assert ids == [[3, len(t)] for t in texts]                  # the chat template's encoding
    assert kw == dict(max_new_tokens=4, sampling=sampling, seed=9, method="dense",
                      stop_tokens=(), cache_size=64)


def test_prompt_sets_read_the_question_and_prompt_fields():
  """MT-Bench's turn 1 is each question's turns[0] and turn 2 its turns[1] (swapped turns were
  two lists of 80 distinct prompts, as the turn test checked); HumanEval's prompt is the
  function's signature and docstring (its "prompt"), not the canonical solution or the tests."""
  from sparsedec import prompts
  first, second = prompts.mt_bench(1), prompts.mt_bench(2)
  assert first[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
  assert second[0].startswith("Rewrite your previous response. Start every sentence with")
  he = prompts.humaneval()
  assert len(he) == 164
  assert he[0].startswith("from typing import List") and "def has_close_elements(" in he[0]
  assert all(p.rstrip().endswith('"""') or p.rstrip().endswith("'''") for p in he[:20])
