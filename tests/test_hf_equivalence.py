"""Our forward against Hugging Face transformers (float32, eager attention, CPU).

Models: stories260K (real Llama, HF safetensors), SmolLM2-135M-Instruct (real Llama, GGUF Q4_1,
dequantised by both sides), and tiny random-weight Llama-3 (llama3 RoPE scaling), Mistral
(sliding window 16), Qwen2 (q/k/v bias) and Qwen3 (q/k norm, head_dim != hidden / heads)
models built by transformers itself, each untied and tied.

For each prompt:
  * logits: ours vs HF over the prompt (one prefill forward) and over every greedy decode step
    (one token per forward against our KV cache) vs one HF forward over prompt + continuation.
    Tolerance: max |ours - HF| <= LOGIT_RTOL * max |HF logits| (fp32 on both sides).
  * greedy continuation of NEW_TOKENS tokens, EOS ignored: identical token for token.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import hf_harness as hf

LOGIT_RTOL = 1e-4     # max abs diff relative to the logit scale (observed <= 5e-6)
NEW_TOKENS = 64
RANDOM_KINDS = ("llama3", "mistral", "qwen2", "qwen3")
RANDOM_VOCAB = 256    # reference.py's tiny configs
RANDOM_PROMPT_LENGTHS = [20, 5]
STORY_PROMPTS = ["Once upon a time", "Lily and Ben went to the park. They saw a big"]
SMOLLM2_QUESTIONS = 2


# ----------------------------------------------------------------------------------- helpers
def assert_matches_hf(cfg, params, ref: hf.Reference, label: str) -> None:
  bucket = max(len(p) for p in ref.prompts)    # one compiled prefill and step for all prompts
  for i, (prompt, tokens, logits, margins) in enumerate(
      zip(ref.prompts, ref.tokens, ref.logits, ref.margins)):
    assert len(tokens) == NEW_TOKENS, f"{label}[{i}]: HF returned {len(tokens)} tokens"
    ours_tokens, ours_logits = hf.greedy_with_forward(cfg, params, prompt, NEW_TOKENS,
                                                      prompt_bucket=bucket)
    t = len(prompt)
    where = f"{label} prompt {i} (T={t})"
    err_prompt = hf.relative_logit_error(ours_logits[:t], logits[:t])
    assert err_prompt <= LOGIT_RTOL, (
        f"{where}: prompt logits differ from HF by {err_prompt:.2e} of the logit scale "
        f"(tolerance {LOGIT_RTOL:.0e}); worst position "
        f"{int(np.abs(ours_logits[:t] - logits[:t]).max(-1).argmax())}")
    j = hf.first_divergence(ours_tokens, tokens)
    assert j is None, (
        f"{where}: greedy continuation diverges from HF at new token {j}: ours "
        f"{ours_tokens[j]} vs HF {tokens[j]} (HF top-2 margin there {margins[j]:.3g}); "
        f"ours {ours_tokens[:j + 1].tolist()}, HF {tokens[:j + 1].tolist()}")
    err_decode = hf.relative_logit_error(ours_logits[t:], logits[t:])
    assert err_decode <= LOGIT_RTOL, (
        f"{where}: decode-step logits differ from HF by {err_decode:.2e} of the logit scale "
        f"(tolerance {LOGIT_RTOL:.0e}); first bad step "
        f"{int(np.argmax(np.abs(ours_logits[t:] - logits[t:]).max(-1) > LOGIT_RTOL * np.abs(logits[t:]).max()))}")


def assert_generate_matches_hf(cfg, params, ref: hf.Reference, label: str) -> None:
  """sparsedec.generate (dense, greedy, batched with per-row prompt lengths) == HF greedy."""
  import sparsedec
  result = sparsedec.generate(cfg, params, [p.tolist() for p in ref.prompts],
                              max_new_tokens=NEW_TOKENS, stop_tokens=())
  for i, (ours, theirs) in enumerate(zip(result.tokens, ref.tokens)):
    j = hf.first_divergence(np.asarray(ours), theirs)
    assert j is None, (f"{label} prompt {i}: sparsedec.generate diverges from HF greedy at new "
                       f"token {j}: ours {ours[:(j or 0) + 1]}, HF {theirs[:(j or 0) + 1].tolist()}")


def jax_params(params):
  import jax
  import jax.numpy as jnp
  return jax.tree.map(jnp.asarray, params)


# --------------------------------------------------------------------------------- stories260K
@pytest.fixture(scope="module")
def stories(hf_reference, stories_hf_dir):
  from tokenizers import Tokenizer

  from sparsedec.weights.hf import load_hf
  tok_cfg = json.loads((stories_hf_dir / "tokenizer_config.json").read_text())
  assert tok_cfg.get("add_bos_token") is True
  tokenizer = Tokenizer.from_file(str(stories_hf_dir / "tokenizer.json"))
  bos = tokenizer.token_to_id(tok_cfg["bos_token"])
  prompts = [[bos] + tokenizer.encode(s, add_special_tokens=False).ids for s in STORY_PROMPTS]
  ref = hf_reference.run("stories260k", [{
      "name": "stories260k", "model": {"path": str(stories_hf_dir)}, "prompts": prompts,
      "max_new_tokens": NEW_TOKENS, "ignore_eos": True}])["stories260k"]
  cfg, params = load_hf(stories_hf_dir, dtype="float32")
  return cfg, jax_params(params), ref


def test_stories260k_forward_matches_hf(stories):
  cfg, params, ref = stories
  assert_matches_hf(cfg, params, ref, "stories260K")


def test_stories260k_generate_matches_hf(stories):
  cfg, params, ref = stories
  assert_generate_matches_hf(cfg, params, ref, "stories260K")


# ---------------------------------------------------------------------------- SmolLM2 (GGUF)
@pytest.fixture(scope="module")
def smollm2(hf_reference, smollm2_gguf):
  from sparsedec.weights.gguf_file import load_gguf
  ref = hf_reference.run("smollm2", [{
      "name": "smollm2",
      "model": {"path": str(smollm2_gguf.parent), "gguf_file": smollm2_gguf.name},
      "chat_prompts": hf.mt_bench_turn1(SMOLLM2_QUESTIONS),
      "max_new_tokens": NEW_TOKENS, "ignore_eos": True}])["smollm2"]
  cfg, params, _ = load_gguf(smollm2_gguf, dtype="float32")
  return cfg, jax_params(params), ref


def test_smollm2_gguf_forward_matches_hf(smollm2):
  cfg, params, ref = smollm2
  assert cfg.num_layers == 30 and cfg.tie_word_embeddings
  assert_matches_hf(cfg, params, ref, "SmolLM2-135M-Instruct (GGUF)")


# ------------------------------------------------------------------------ random-weight models
RANDOM_CASES = [(kind, tied) for kind in RANDOM_KINDS for tied in (False, True)]


def _case_name(kind: str, tied: bool) -> str:
  return f"{kind}_{'tied' if tied else 'untied'}"


@pytest.fixture(scope="module")
def random_refs(hf_reference, tmp_path_factory):
  models = tmp_path_factory.mktemp("random_models")
  tasks = []
  for seed, (kind, tied) in enumerate(RANDOM_CASES):
    name = _case_name(kind, tied)
    tasks.append({"name": name,
                  "model": {"random": {"kind": kind, "tied": tied, "seed": seed},
                            "save_to": str(models / name)},
                  "prompts": hf.random_prompts(seed, RANDOM_PROMPT_LENGTHS, RANDOM_VOCAB),
                  "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
  return hf_reference.run("random", tasks)


def _load_random(random_refs, kind, tied):
  from sparsedec.weights.hf import load_hf
  ref = random_refs[_case_name(kind, tied)]
  cfg, params = load_hf(ref.model_dir, dtype="float32")
  return cfg, jax_params(params), ref


def _check_feature(cfg, kind: str, tied: bool) -> None:
  """The loaded config has the feature the case is about (else the comparison proves little)."""
  assert cfg.tie_word_embeddings == tied
  assert cfg.num_kv_heads < cfg.num_heads                                   # GQA
  if kind == "llama3":
    assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3"
    assert cfg.rope_scaling.original_max_position_embeddings == 32
  if kind == "mistral":
    assert cfg.sliding_window == 16
  if kind == "qwen2":
    assert cfg.qkv_bias
  if kind == "qwen3":
    assert cfg.qk_norm and cfg.head_dim * cfg.num_heads != cfg.hidden_size


@pytest.mark.parametrize("kind,tied", RANDOM_CASES, ids=[_case_name(*c) for c in RANDOM_CASES])
def test_random_model_forward_matches_hf(random_refs, kind, tied):
  cfg, params, ref = _load_random(random_refs, kind, tied)
  _check_feature(cfg, kind, tied)
  assert_matches_hf(cfg, params, ref, _case_name(kind, tied))


@pytest.mark.parametrize("kind", RANDOM_KINDS)
def test_random_model_generate_matches_hf(random_refs, kind):
  cfg, params, ref = _load_random(random_refs, kind, False)
  assert_generate_matches_hf(cfg, params, ref, _case_name(kind, False))


# The comparison is sensitive: dropping the feature a case is about breaks the match.
ABLATIONS = {
    "llama3": {"rope_scaling": None},
    "mistral": {"sliding_window": None},
    "qwen2": {"qkv_bias": False},
    "qwen3": {"qk_norm": False},
}


@pytest.mark.parametrize("kind", sorted(ABLATIONS))
def test_random_model_feature_is_exercised(random_refs, kind):
  from sparsedec.model.params import layer_shapes
  cfg, params, ref = _load_random(random_refs, kind, False)
  ablated = cfg.replace(**ABLATIONS[kind])
  keep = layer_shapes(ablated)                        # drops bqkv / q_norm, k_norm as needed
  params = dict(params, layers=[{k: v for k, v in lp.items() if k in keep}
                                for lp in params["layers"]])
  seq = np.concatenate([ref.prompts[0], ref.tokens[0][:-1]])             # [T+N-1]
  err = hf.relative_logit_error(hf.forward_logits(ablated, params, seq), ref.logits[0])
  assert err > 100 * LOGIT_RTOL, f"{kind} without {ABLATIONS[kind]} still matches HF ({err:.2e})"


# ------------------------------------------------------------- configurations off the beaten path
# Each: (kind, tied, extra "random" spec for reference.py, what the loaded config must show).
# Features no case above exercises: linear RoPE scaling; Llama's attention_bias (q/k/v and o
# biases) with an explicit head_dim != hidden / heads; Mistral with explicit head_dim and a
# window of 8 (shorter than every prompt + continuation); Qwen2 saved tied, fp16 and sharded by
# save_pretrained (the index transformers writes, no lm_head tensor).
OFF_PATH_CASES = {
    "llama_linear_rope": ("llama3", False, {"config": {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}},
        lambda c: c.rope_scaling is not None and c.rope_scaling.kind == "linear"
        and c.rope_scaling.factor == 4.0),
    "llama_bias_head_dim": ("llama3", False, {"config": {
        "attention_bias": True, "head_dim": 24,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}},
        lambda c: c.qkv_bias and c.o_bias and c.head_dim == 24 and c.rope_scaling is None),
    "mistral_head_dim_window8": ("mistral", False, {"config": {
        "head_dim": 32, "sliding_window": 8}},
        lambda c: c.head_dim == 32 and c.sliding_window == 8),
    "qwen2_fp16_sharded_tied": ("qwen2", True, {"save_dtype": "float16",
                                                "max_shard_size": "40KB"},
                                lambda c: c.tie_word_embeddings and c.qkv_bias),
}


@pytest.fixture(scope="module")
def off_path_refs(hf_reference, tmp_path_factory):
  models = tmp_path_factory.mktemp("off_path_models")
  tasks = []
  for seed, (name, (kind, tied, extra, _)) in enumerate(OFF_PATH_CASES.items()):
    tasks.append({"name": name,
                  "model": {"random": {"kind": kind, "tied": tied, "seed": 100 + seed, **extra},
                            "save_to": str(models / name)},
                  "prompts": hf.random_prompts(100 + seed, RANDOM_PROMPT_LENGTHS, RANDOM_VOCAB),
                  "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
  return hf_reference.run("off_path", tasks)


@pytest.mark.parametrize("name", sorted(OFF_PATH_CASES))
def test_off_path_model_matches_hf(off_path_refs, name):
  import os

  from sparsedec.weights.hf import load_hf
  ref = off_path_refs[name]
  if name == "qwen2_fp16_sharded_tied":
    files = os.listdir(ref.model_dir)
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert load_hf(ref.model_dir)[0].dtype == "bfloat16"       # fp16 runs as bf16 by default
  cfg, params = load_hf(ref.model_dir, dtype="float32")
  assert OFF_PATH_CASES[name][3](cfg), f"{name}: the loaded config lacks the feature: {cfg}"
  assert_matches_hf(cfg, jax_params(params), ref, name)
