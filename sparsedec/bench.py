"""`sparsedec bench`: tokens/s, steps, tau and peak memory of a method over a prompt set."""

from __future__ import annotations

import os
import platform
import resource
import time

import jax
import numpy as np

from sparsedec.decode.api import generate
from sparsedec.decode.fits import run_devices
from sparsedec.decode.loop import DecodeMethod
from sparsedec.decode.methods import method_config
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.errors import InputError, is_int
from sparsedec.model.config import ModelConfig
from sparsedec.model.params import Params, num_bytes
from sparsedec.prompts import load_prompt_set
from sparsedec.tokenizer import Tokenizer

# The SmolLM2-135M-Instruct GGUF the benchmarks read by default (fetched by scripts/setup.sh).
DEFAULT_SMOLLM2_GGUF = os.environ.get(
    "SPARSEDEC_SMOLLM2_GGUF",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache",
                 "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
_T0 = time.perf_counter()


def log(msg: str) -> None:
  """A progress line with the seconds since import (benchmark logs)."""
  print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def device_description(device: jax.Device | None = None) -> dict:
  """The device a run used (default: the default backend's first) and the host."""
  dev = device or jax.devices()[0]
  return {"platform": dev.platform, "device_kind": dev.device_kind,
          "num_devices": jax.device_count(dev.platform), "cpu_count": os.cpu_count(),
          "host": platform.node(), "jax": jax.__version__}


def peak_memory_bytes(device: jax.Device | None = None) -> dict:
  """Peak memory of `device` (accelerators; default: the default backend's first) and peak host
  RSS."""
  out = {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
  stats = (device or jax.devices()[0]).memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    out["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
  return out


def encode_prompts(tok: Tokenizer, texts: list[str], chat_template: bool) -> list[list[int]]:
  if not chat_template:
    return [tok.encode(t) for t in texts]
  return [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]


REPEAT_NGRAM = 8            # a generated token "repeats" when the 8-gram it ends occurred before


def repeated_ngram_share(tokens, n: int = REPEAT_NGRAM) -> float:
  """Share of a row's tokens, from its n-th on, that end an n-gram already ended earlier in the
  row: how much of a greedy continuation is a loop. In a loop an n-gram guess or a draft that
  matches once matches every cycle, and one near-tie disagreement recurs every cycle, so
  acceptance and tau over looping text are neither typical nor made of independent draws
  (benchmarks/NOTES.md, session 45)."""
  tokens = list(tokens)
  seen, repeats = set(), 0
  for i in range(n - 1, len(tokens)):
    gram = tuple(tokens[i - n + 1: i + 1])
    repeats += gram in seen
    seen.add(gram)
  return repeats / (len(tokens) - n + 1) if len(tokens) >= n else 0.0


def mean_repeated_ngram_share(rows) -> float:
  """repeated_ngram_share averaged over rows (each a token list), rounded to 4 places."""
  rows = list(rows)
  return round(float(np.mean([repeated_ngram_share(r) for r in rows])), 4) if rows else 0.0


def bench_prompts(prompts: str, num_prompts: int, batch_size: int) -> list[str]:
  """The first num_prompts texts of the prompt set, after checking the counts: what run_bench
  reads, and what the CLI checks before it loads a model (a misspelt --prompts was refused only
  after the model, and any GPTQ draft, had been built)."""
  for name, value in (("num_prompts", num_prompts), ("batch_size", batch_size)):
    if not is_int(value) or value < 1:
      raise InputError(f"bench {name} must be an integer >= 1, got {value!r}")
  texts = load_prompt_set(prompts)[:num_prompts]
  if not texts:
    raise InputError(f"prompt set {prompts!r} holds no prompts")
  return texts


def run_bench(cfg: ModelConfig, params: Params, tok: Tokenizer, *, prompts: str = "mt_bench",
              num_prompts: int = 10, batch_size: int = 1, max_new_tokens: int = 256,
              sampling: SamplingConfig | None = None, seed: int = 0,
              method: str | DecodeMethod = "dense",
              chat_template: bool = False, ignore_eos: bool = False,
              model_name: str = "", cache_size: int | None = None) -> dict:
  texts = bench_prompts(prompts, num_prompts, batch_size)
  ids = encode_prompts(tok, texts, chat_template)
  device = min(run_devices(params["embed"]), key=lambda d: d.id)   # where the run's arrays go
  stop = () if ignore_eos else None
  kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, method=method,
            stop_tokens=stop, cache_size=cache_size)
  # Warm-up with the very same arguments (same buckets, same cache capacity): every compile
  # happens here, outside the timed runs.
  t0 = time.perf_counter()
  for i in range(0, len(ids), batch_size):
    generate(cfg, params, ids[i: i + batch_size], **kw)
  compile_seconds = time.perf_counter() - t0
  runs = []
  for i in range(0, len(ids), batch_size):
    r = generate(cfg, params, ids[i: i + batch_size], **kw)
    runs.append({"prompt_tokens": r.prompt_lengths, "generated_tokens": r.num_generated,
                 "steps": r.steps, "active_steps": sum(r.active_steps), "tau": r.tau,
                 "prefill_seconds": r.prefill_seconds,
                 "decode_seconds": r.decode_seconds, "tokens_per_second": r.tokens_per_second,
                 **r.method_stats})
  gen = sum(r["generated_tokens"] for r in runs)
  dec = sum(r["decode_seconds"] for r in runs)
  return {
      "model": model_name, "method": method if isinstance(method, str) else method.name,
      "method_config": method_config(method),
      "dtype": cfg.dtype,
      "param_bytes": num_bytes(params), "prompt_set": prompts, "num_prompts": len(ids),
      "batch_size": batch_size, "max_new_tokens": max_new_tokens, "cache_size": cache_size,
      "sampling": None if sampling is None else vars(sampling),
      # The decode loop's tokens per second of it (each row's first token is prefill's).
      "tokens_per_second": (gen - len(ids)) / dec if dec else 0.0,
      "median_tokens_per_second": float(np.median([r["tokens_per_second"] for r in runs])),
      "generated_tokens": gen, "decode_seconds": dec,
      # Accepted tokens per row-step over every run (each run's tau weighted by its steps),
      # and beside it the plain mean of the runs' tau.
      "tau": ((gen - sum(len(r["prompt_tokens"]) for r in runs))
              / max(sum(r["active_steps"] for r in runs), 1)),
      "mean_tau": float(np.mean([r["tau"] for r in runs])),
      "warmup_seconds": compile_seconds, "memory": peak_memory_bytes(device),
      "device": device_description(device), "runs": runs,
  }
