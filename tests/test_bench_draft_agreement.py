"""benchmarks/draft_agreement.py on the embedded stories260K checkpoint (CPU, fp32): the
teacher-forced agreement of a GPTQ draft (mixed calibration) with the INT8 target runs end to end
(rows, counted positions, calibration sequences), so the GPU benchmark cannot rot, and calibration
prompts that overlap the evaluated ones are refused."""

from __future__ import annotations

import json
import pathlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks import draft_agreement  # noqa: E402
from conftest import STORIES  # noqa: E402  (the embedded stories260K)


def test_agreement_rows(tmp_path):
  out = tmp_path / "agreement.json"
  # Shapes chosen so that nothing compiles twice for another size: the MT-Bench text (prompts
  # of 88 and 162 tokens, 12-token answers) is 274 tokens, so 273 book positions give both texts
  # the same quantized-cache capacity and the same chunks (17 of 16 tokens, then a partial one of
  # 1): each bit width's pass compiles 2 chunk shapes, not 3 per text (one compile is ~7 s on
  # CPU). The calibration prompts [2, 4) are, like the evaluated ones, 2 prompts in one 256-token
  # bucket, so their answers reuse the evaluated answers' prefill and loop.
  result = draft_agreement.main([
      "--gguf", str(STORIES), "--chat-template", "0", "--group", "16", "--weight-group", "32",
      "--chunk", "16", "--eval-tokens", "273", "--eval-prompts", "2", "--new-tokens", "12",
      "--calibration-tokens", "96", "--calibration-offset", "2000", "--calibration-prompts", "2",
      "4", "--variants", "gptq-act-seq", "--calibration-sources", "mixed", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  assert [(r["variant"], r["calibration"]) for r in result["rows"]] == [("gptq-act-seq", "mixed")]
  assert result["positions"] == {"book": 273, "mt_bench": 24}
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


def test_rtn_alone_builds_no_calibration_and_bad_calibration_is_refused_first(tmp_path,
                                                                             monkeypatch):
  """--variants rtn generated the self-chat calibration answers anyway (minutes on SmolLM2) and
  reported calibration it never used; --calibration-turns 3 was refused only after the
  evaluated texts' passes."""
  def unused(*args, **kwargs):
    raise AssertionError("self-chat calibration built for --variants rtn")
  monkeypatch.setattr(draft_agreement, "self_chat_calibration", unused)
  # The passes and the answers are not what is tested here (test_agreement_rows runs them).
  monkeypatch.setattr(draft_agreement, "quantized_pass",
                      lambda cfg, params, ids, *rest: (0.0, np.zeros(len(ids) - 1, np.int32)))
  monkeypatch.setattr(draft_agreement, "generate", lambda cfg, params, prompts, max_new_tokens:
                      SimpleNamespace(tokens=[[1] * max_new_tokens for _ in prompts]))
  out = tmp_path / "agreement.json"
  result = draft_agreement.main([
      "--gguf", str(STORIES), "--chat-template", "0", "--group", "16", "--weight-group", "32",
      "--chunk", "16", "--eval-tokens", "32", "--eval-prompts", "1", "--new-tokens", "4",
      "--variants", "rtn", "--out", str(out)])
  assert [r["variant"] for r in result["rows"]] == ["rtn"]
  assert result["calibration_tokens"] == {} and result["calibration_sequences"] == {}

  def no_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the arguments were checked")
  monkeypatch.setattr(draft_agreement, "load_model", no_load)
  for bad, message in ((["--calibration-turns", "3"], "--calibration-turns must be distinct"),
                       (["--calibration-prompts", "50", "50"], "FIRST < STOP"),
                       (["--eval-prompts", "0"], None)):
    with pytest.raises(SystemExit) as e:
      draft_agreement.main(["--gguf", str(STORIES), *bad, "--out", str(out)])
    assert message is None or message in str(e.value)


def test_draft_matmul_replaces_only_the_quantized_linears_product():
  """Within `draft_matmul(P)` a QuantWeight linear multiplies x^ (x in P int8 planes per 32
  inputs, as the GPU's one-row dp4a GEMV does); within `draft_matmul(weights=...)` it
  multiplies (weights="dtype") the dequantized weights rounded to x's dtype (the W4A16 kernel's
  operands) or (weights="exact") the exact ones in fp32 (the dp4a kernel's), whatever the
  layout's own path does; a plain weight is untouched; on exit the layout's product again."""
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels.w4a8_gemv import dequantized_activations
  from sparsedec.model.linear import linear
  from sparsedec.model.quant_weights import quant_matmul, quantize_weight

  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((96, 64)), jnp.float32)
  qw = quantize_weight(w, 32)
  x = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32)
  plain = np.asarray(linear(x, qw))
  for planes in (1, 2):
    with draft_agreement.draft_matmul(planes):
      got = np.asarray(linear(x, qw))
      np.testing.assert_array_equal(np.asarray(linear(x, w)), np.asarray(
          jnp.dot(x, w, precision="highest")))
    want = np.asarray(quant_matmul(dequantized_activations(x, 96, planes), qw,
                                   precision="highest"))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.abs(got - plain).max() > 0
  np.testing.assert_array_equal(np.asarray(linear(x, qw)), plain)

  xb = jnp.asarray(rng.standard_normal((3, 1024)), jnp.bfloat16)
  w32 = jnp.asarray(rng.standard_normal((1024, 256)), jnp.float32)
  got = {}
  for layout in ("packed", "int4_t"):                  # packed's path rounds; int4_t's is exact
    qw = quantize_weight(w32, 32, layout)
    plain = np.asarray(linear(xb, qw), np.float32)
    for weights in ("dtype", "exact"):
      with draft_agreement.draft_matmul(weights=weights):
        got[layout, weights] = np.asarray(linear(xb, qw), np.float32)
    np.testing.assert_array_equal(np.asarray(linear(xb, qw), np.float32), plain)
  for weights, dtype in (("dtype", jnp.bfloat16), ("exact", jnp.float32)):
    wx = qw.dequantize(jnp.float32).astype(dtype).astype(jnp.float32)
    want = np.asarray(jnp.dot(xb.astype(jnp.float32), wx, precision="highest")
                      .astype(jnp.bfloat16), np.float32)
    for layout in ("packed", "int4_t"):
      np.testing.assert_array_equal(got[layout, weights], want)
  assert np.abs(got["int4_t", "dtype"] - got["int4_t", "exact"]).max() > 0
  with pytest.raises(ValueError, match="weights must be one of"):
    with draft_agreement.draft_matmul(weights="bf16"):
      pass
