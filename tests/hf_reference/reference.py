"""Hugging Face transformers reference for sparsedec's equivalence tests.

Runs under the HF python (Python 3.11 + torch CPU + transformers; see scripts/setup.sh), never
under the JAX env, so it imports nothing from sparsedec. Everything is float32 with
attn_implementation="eager".

  python reference.py run JOB.json OUT_DIR
      JOB = {"tasks": [TASK, ...]}. Each TASK:
        name            output stem: OUT_DIR/NAME.npz and OUT_DIR/NAME.json
        model           {"path": DIR} | {"path": DIR, "gguf_file": NAME}
                        | {"random": {"kind": K, "tied": bool, "seed": int}, "save_to": DIR}
                        random may also hold "config": {attribute: value} replacing the
                        kind's (head_dim, attention_bias, sliding_window, rope_parameters, ...),
                        "save_dtype" ("float16" | "bfloat16": the saved weights' dtype) and
                        "max_shard_size" (e.g. "40KB": sharded safetensors with an index)
        prompts         [[token ids], ...]                      (token ids as given), and/or
        chat_prompts    [user message, ...]   tokenised by HF with the chat template and the
                                              generation prompt
        max_new_tokens  N: greedy continuation length (generate(do_sample=False))
        ignore_eos      true: never stop at EOS, so every continuation has exactly N tokens
      NAME.npz holds, for prompt i:
        prompt_i        [T] int64  the prompt's token ids
        tokens_i        [N] int64  HF greedy continuation
        logits_i        [T+N-1, V] float32: logits of ONE forward over prompt + continuation[:-1]
                        (rows 0..T-1 are the prompt forward; row T-1+j predicts tokens_i[j])
        margins_i       [N] float32: top1 - top2 of generate()'s raw logits at each step
      NAME.json holds the model's saved directory (random models) and the prompt count.

  python reference.py make-random --kind {llama3,mistral,qwen2,qwen3} [--tied] [--seed S] OUT_DIR
      Builds a tiny random-weight model with transformers and saves it (config.json +
      model.safetensors) with save_pretrained(safe_serialization=True).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import transformers

# --------------------------------------------------------------------------- random configs
# Tiny (2 layers, hidden 64, vocab 256), GQA (4 query / 2 KV heads). Each exercises the part of
# the forward its family adds:
#   llama3   rope_type llama3 with original_max_position_embeddings 32, so the short-wavelength,
#            ramp and long-wavelength branches all occur at head_dim 16 and test lengths
#   mistral  sliding_window 16, shorter than prompt + continuation
#   qwen2    q/k/v bias (randomised: HF initialises biases to zero)
#   qwen3    q/k RMSNorm and head_dim 32 != hidden / heads
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=1, eos_token_id=2,
               pad_token_id=0, initializer_range=0.25)
RANDOM_KINDS = ("llama3", "mistral", "qwen2", "qwen3")


def random_config(kind: str, tied: bool, overrides: dict | None = None
                  ) -> transformers.PretrainedConfig:
  c = dict(_COMMON, tie_word_embeddings=tied)
  if kind == "llama3":
    cls, own = transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})
  elif kind == "mistral":
    cls, own = transformers.MistralConfig, dict(
        sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
  elif kind == "qwen2":
    cls, own = transformers.Qwen2Config, dict(
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
  elif kind == "qwen3":
    cls, own = transformers.Qwen3Config, dict(
        head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
  else:
    raise SystemExit(f"unknown random kind {kind!r} (known: {RANDOM_KINDS})")
  return cls(**{**c, **own, **(overrides or {})})


def make_random(kind: str, tied: bool, seed: int, out_dir: str, overrides: dict | None = None,
                save_dtype: str | None = None, max_shard_size: str | None = None) -> str:
  cfg = random_config(kind, tied, overrides)
  cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(
      cfg, dtype=torch.float32, attn_implementation="eager")
  # HF initialises norms to one and biases to zero; randomise them so they are tested.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.copy_(0.5 * torch.randn_like(p))
  if save_dtype:
    model = model.to(getattr(torch, save_dtype))
  model.save_pretrained(out_dir, safe_serialization=True,
                        **({"max_shard_size": max_shard_size} if max_shard_size else {}))
  return out_dir


# ------------------------------------------------------------------------------- reference run
def load_model(spec: dict):
  """-> (model, tokenizer or None, saved dir)."""
  if "random" in spec:
    r = spec["random"]
    path = make_random(r["kind"], bool(r.get("tied", False)), int(r.get("seed", 0)),
                       spec["save_to"], r.get("config"), r.get("save_dtype"),
                       r.get("max_shard_size"))
    kwargs = {}
  else:
    path = spec["path"]
    kwargs = {"gguf_file": spec["gguf_file"]} if spec.get("gguf_file") else {}
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager", **kwargs)
  model.eval()
  tokenizer = None
  if kwargs or os.path.exists(os.path.join(path, "tokenizer.json")):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **kwargs)
  return model, tokenizer, path


def chat_ids(tokenizer, message: str) -> list[int]:
  out = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                      add_generation_prompt=True, tokenize=True)
  if isinstance(out, dict) or hasattr(out, "keys"):   # BatchEncoding in transformers 5
    out = out["input_ids"]
  return [int(t) for t in out]


@torch.no_grad()
def greedy(model, prompt: list[int], n: int, ignore_eos: bool):
  """HF greedy continuation of exactly n tokens (or up to EOS) and its top-2 margins."""
  ids = torch.tensor([prompt], dtype=torch.long)
  if ignore_eos:
    # generate() fills unset fields from model.generation_config (which names the EOS).
    model.generation_config.eos_token_id = None
  gen = transformers.GenerationConfig(
      do_sample=False, max_new_tokens=n, num_beams=1,
      min_new_tokens=0, repetition_penalty=1.0, output_logits=True,
      return_dict_in_generate=True, pad_token_id=model.config.pad_token_id or 0,
      eos_token_id=None if ignore_eos else model.config.eos_token_id)
  out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
  tokens = out.sequences[0, len(prompt):].numpy()
  raw = torch.stack(out.logits, 0)[:, 0].float()                         # [N, V]
  top2 = torch.topk(raw, 2, dim=-1).values
  # Self-check: with no logits processors active, greedy is the argmax of the raw logits.
  if not torch.equal(raw.argmax(-1), torch.as_tensor(tokens)):
    raise SystemExit("HF generate() applied a logits processor: greedy != argmax(raw logits)")
  if ignore_eos and len(tokens) != n:
    raise SystemExit(f"HF generate() stopped after {len(tokens)} of {n} tokens")
  return tokens.astype(np.int64), (top2[:, 0] - top2[:, 1]).numpy().astype(np.float32)


@torch.no_grad()
def run_task(task: dict, out_dir: str) -> None:
  model, tokenizer, path = load_model(task["model"])
  prompts = [list(map(int, p)) for p in task.get("prompts", [])]
  for message in task.get("chat_prompts", []):
    if tokenizer is None:
      raise SystemExit(f"task {task['name']}: chat_prompts need a tokenizer")
    prompts.append(chat_ids(tokenizer, message))
  n = int(task.get("max_new_tokens", 0))
  arrays = {}
  for i, prompt in enumerate(prompts):
    arrays[f"prompt_{i}"] = np.asarray(prompt, np.int64)
    tokens, margins = (greedy(model, prompt, n, bool(task.get("ignore_eos", True))) if n else
                       (np.zeros(0, np.int64), np.zeros(0, np.float32)))
    arrays[f"tokens_{i}"] = tokens
    arrays[f"margins_{i}"] = margins
    seq = torch.tensor([prompt + tokens[:-1].tolist() if n else prompt], dtype=torch.long)
    arrays[f"logits_{i}"] = model(seq).logits[0].float().numpy()         # [T+N-1, V]
  np.savez(os.path.join(out_dir, f"{task['name']}.npz"), **arrays)
  with open(os.path.join(out_dir, f"{task['name']}.json"), "w") as f:
    json.dump({"name": task["name"], "model_dir": path, "num_prompts": len(prompts),
               "transformers": transformers.__version__, "torch": torch.__version__}, f)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="cmd", required=True)
  run = sub.add_parser("run")
  run.add_argument("job")
  run.add_argument("out_dir")
  mk = sub.add_parser("make-random")
  mk.add_argument("--kind", choices=RANDOM_KINDS, required=True)
  mk.add_argument("--tied", action="store_true")
  mk.add_argument("--seed", type=int, default=0)
  mk.add_argument("out_dir")
  args = parser.parse_args(argv)
  # One thread: with 2 OpenMP threads on a busy 2-core machine (pytest-xdist runs JAX beside
  # us) a 135M forward ran 28x slower (8.6 s vs 0.3 s) from thread contention.
  torch.set_num_threads(int(os.environ.get("SPARSEDEC_HF_THREADS", "1")))
  if args.cmd == "make-random":
    print(make_random(args.kind, args.tied, args.seed, args.out_dir))
    return
  with open(args.job) as f:
    job = json.load(f)
  os.makedirs(args.out_dir, exist_ok=True)
  for task in job["tasks"]:
    run_task(task, args.out_dir)


if __name__ == "__main__":
  main(sys.argv[1:])
