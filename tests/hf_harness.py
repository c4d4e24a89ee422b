"""Helpers for comparing sparsedec against Hugging Face transformers (not a test module).

The HF side runs in its own Python 3.11 env (torch CPU + transformers, made by
scripts/setup.sh) through tests/hf_reference/reference.py; the JAX side runs here. Locations:

  SPARSEDEC_HF_PYTHON     default <repo>/.hfenv/bin/python, else <repo>/../.hfenv/bin/python
  SPARSEDEC_SMOLLM2_GGUF  default <repo>/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf

A missing HF env or model skips the tests that need it, except under CI (env CI set and not
false/0), where it fails them: CI must never pass by skipping.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
REFERENCE_SCRIPT = Path(__file__).resolve().parent / "hf_reference" / "reference.py"
STORIES260K = SHARED / "models" / "stories260K"
MT_BENCH = SHARED / "prompts" / "mt_bench" / "question.jsonl"
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def in_ci() -> bool:
  return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str):
  """Skip the calling test, or fail it under CI."""
  if in_ci():
    pytest.fail(f"{reason} (CI is set: run scripts/setup.sh; missing references fail under CI)",
                pytrace=False)
  pytest.skip(f"{reason} (run scripts/setup.sh)")


def hf_python_candidates() -> list[Path]:
  env = os.environ.get("SPARSEDEC_HF_PYTHON")
  if env:
    return [Path(env)]
  return [REPO / ".hfenv" / "bin" / "python", REPO.parent / ".hfenv" / "bin" / "python"]


def find_hf_python() -> Path | None:
  for p in hf_python_candidates():
    if p.is_file() and os.access(p, os.X_OK):
      return p
  return None


def smollm2_gguf_path() -> Path:
  return Path(os.environ.get("SPARSEDEC_SMOLLM2_GGUF",
                             REPO / ".cache" / "models" / SMOLLM2_NAME))


# ------------------------------------------------------------------------------ HF reference
@dataclasses.dataclass(frozen=True)
class Reference:
  """HF results for one task (see reference.py): per prompt, ids, greedy tokens, logits."""
  name: str
  model_dir: str
  prompts: list[np.ndarray]        # [T] int64 each
  tokens: list[np.ndarray]         # [N] int64 each: HF greedy continuation
  logits: list[np.ndarray]         # [T+N-1, V] float32 each: one forward over prompt+tokens[:-1]
  margins: list[np.ndarray]        # [N] float32 each: HF top1 - top2 at each greedy step


class HFReference:
  """Runs reference.py jobs with the HF python; results cached per session by job name."""

  def __init__(self, python: Path, work_dir: Path):
    self.python = python
    self.work_dir = work_dir
    self._done: dict[str, dict[str, Reference]] = {}

  def run(self, job_name: str, tasks: list[dict], timeout: float = 900) -> dict[str, Reference]:
    if job_name in self._done:
      return self._done[job_name]
    out_dir = self.work_dir / job_name
    out_dir.mkdir(parents=True, exist_ok=True)
    job_file = out_dir / "job.json"
    job_file.write_text(json.dumps({"tasks": tasks}, indent=1))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    proc = subprocess.run([str(self.python), str(REFERENCE_SCRIPT), "run", str(job_file),
                           str(out_dir)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if proc.returncode:
      raise RuntimeError(f"HF reference job {job_name} failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-6000:]}")
    results = {t["name"]: load_reference(out_dir, t["name"]) for t in tasks}
    self._done[job_name] = results
    return results


def load_reference(out_dir: Path, name: str) -> Reference:
  meta = json.loads((out_dir / f"{name}.json").read_text())
  with np.load(out_dir / f"{name}.npz") as z:
    n = meta["num_prompts"]
    return Reference(name=name, model_dir=meta["model_dir"],
                     prompts=[z[f"prompt_{i}"] for i in range(n)],
                     tokens=[z[f"tokens_{i}"] for i in range(n)],
                     logits=[z[f"logits_{i}"] for i in range(n)],
                     margins=[z[f"margins_{i}"] for i in range(n)])


# ------------------------------------------------------------------------------------ prompts
def mt_bench_turn1(count: int) -> list[str]:
  with open(MT_BENCH) as f:
    questions = [json.loads(line) for line in f if line.strip()]
  return [q["turns"][0] for q in questions[:count]]


def random_prompts(seed: int, lengths: list[int], vocab: int, low: int = 3) -> list[list[int]]:
  """Token ids in [low, vocab) (skipping pad/BOS/EOS ids 0..2)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(low, vocab, size=n).tolist() for n in lengths]


# -------------------------------------------------------------------------------- our forward
def relative_logit_error(ours: np.ndarray, theirs: np.ndarray) -> float:
  """max |ours - theirs| / max |theirs|: the error relative to the logit scale."""
  ours = np.asarray(ours, np.float64)
  theirs = np.asarray(theirs, np.float64)
  return float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-30))


@functools.lru_cache(maxsize=None)
def compiled_steps(cfg):
  """jit-compiled (prefill, step) for a config (compiled once per shape and reused)."""
  import jax
  import jax.numpy as jnp

  from sparsedec.attention import causal_plan
  from sparsedec.kv.dense import commit
  from sparsedec.model.forward import forward

  @jax.jit
  def prefill(params, tokens, length, cache):
    """tokens [1, P]: a prompt of `length` tokens padded at the end (padding is causal-only
    visible to later padding and never committed). Returns logits [P, V] and the cache."""
    p = tokens.shape[1]
    positions = jnp.arange(p, dtype=jnp.int32)[None]                    # [1, P]
    logits, kv = forward(cfg, params, tokens, positions, cache, causal_plan(p))
    cache = commit(cache, kv, jnp.reshape(length, (1,)).astype(jnp.int32))
    return logits[0], cache                                              # [P, V]

  @jax.jit
  def step(params, token, cache):
    """token [1, 1] at position lengths[0]. Returns logits [V] and the cache."""
    positions = cache.lengths[:, None]                                   # [1, 1]
    logits, kv = forward(cfg, params, token, positions, cache, causal_plan(1))
    cache = commit(cache, kv, jnp.ones((1,), jnp.int32))
    return logits[0, 0], cache                                           # [V]

  return prefill, step


def greedy_with_forward(cfg, params, prompt, num_new: int, prompt_bucket: int | None = None,
                        capacity: int | None = None):
  """Our reference greedy loop: prefill the prompt in one forward, then one token per forward.

  prompt_bucket / capacity: pad the prompt to this length and size the cache so that prompts of
  different lengths share one compiled prefill and step. Returns (tokens [N] int64,
  logits [T+N-1, V] float32): the prompt forward's logits then each decode step's logits,
  aligned with Reference.logits.
  """
  import jax.numpy as jnp

  from sparsedec.kv.dense import init_cache

  prefill, step = compiled_steps(cfg)
  t = len(prompt)
  bucket = max(prompt_bucket or t, t)
  capacity = max(capacity or 0, bucket + num_new)
  padded = np.zeros((1, bucket), np.int32)                               # [1, P]
  padded[0, :t] = prompt
  logits, cache = prefill(params, jnp.asarray(padded), jnp.int32(t), init_cache(cfg, 1, capacity))
  rows = [np.asarray(logits)[:t]]                                        # [T, V]
  token = int(np.argmax(rows[0][-1]))
  tokens = [token]
  for _ in range(num_new - 1):
    logits, cache = step(params, jnp.full((1, 1), token, jnp.int32), cache)
    row = np.asarray(logits)                                             # [V]
    rows.append(row[None])
    token = int(np.argmax(row))
    tokens.append(token)
  return np.asarray(tokens, np.int64), np.concatenate(rows, 0)


def forward_logits(cfg, params, tokens) -> np.ndarray:
  """Logits [T, V] of one forward over `tokens` [T] from an empty cache."""
  import jax.numpy as jnp

  from sparsedec.kv.dense import init_cache

  prefill, _ = compiled_steps(cfg)
  t = len(tokens)
  logits, _ = prefill(params, jnp.asarray(np.asarray(tokens, np.int32))[None], jnp.int32(t),
                      init_cache(cfg, 1, t))
  return np.asarray(logits)


def first_divergence(ours: np.ndarray, theirs: np.ndarray) -> int | None:
  n = min(len(ours), len(theirs))
  diff = np.nonzero(ours[:n] != theirs[:n])[0]
  if len(diff):
    return int(diff[0])
  return None if len(ours) == len(theirs) else n
