"""Prompt sets shipped in ../shared/prompts (MT-Bench, HumanEval, a long book)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from sparsedec.errors import InputError, read_text

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
  """../shared beside the project root (override with SPARSEDEC_SHARED)."""
  return Path(os.environ.get("SPARSEDEC_SHARED", PROJECT_ROOT.parent / "shared"))


def _require(path: Path) -> Path:
  if not path.is_file():
    where = (f"SPARSEDEC_SHARED={os.environ['SPARSEDEC_SHARED']}" if "SPARSEDEC_SHARED" in os.environ
             else "../shared beside the project; set SPARSEDEC_SHARED to another copy of shared/")
    raise InputError(f"prompt file not found: {path} (prompt sets are read from {where})")
  return path


def mt_bench(turn: int = 1) -> list[str]:
  """MT-Bench questions (80), the given turn (1 or 2)."""
  if turn not in (1, 2) or isinstance(turn, bool):   # 0 read turn 2 (turns[-1]), 3 IndexError
    raise InputError(f"MT-Bench turn must be 1 or 2, got {turn!r}")
  path = _require(shared_dir() / "prompts" / "mt_bench" / "question.jsonl")
  with open(path) as f:
    return [json.loads(line)["turns"][turn - 1] for line in f if line.strip()]


def humaneval() -> list[str]:
  """HumanEval code-completion prompts (164)."""
  path = _require(shared_dir() / "prompts" / "humaneval" / "HumanEval.jsonl.gz")
  with gzip.open(path, "rt") as f:
    return [json.loads(line)["prompt"] for line in f if line.strip()]


def book() -> str:
  """A public-domain book (Moby Dick), for long-context prompts."""
  return _require(shared_dir() / "prompts" / "books" / "moby_dick.txt").read_text()


def load_prompt_set(name: str) -> list[str]:
  """'mt_bench', 'humaneval', or a path to a text file with one prompt per line."""
  if name == "mt_bench":
    return mt_bench()
  if name == "humaneval":
    return humaneval()
  path = Path(name)
  if path.is_dir():
    raise InputError(f"prompt set {name!r} is a directory, not a text file with one prompt per line")
  if not path.is_file():
    if os.sep in name or "/" in name or path.suffix:   # meant as a file: name the missing file
      raise InputError(f"prompt file not found: {name} (--prompts takes mt_bench, humaneval, or "
                       f"an existing text file with one prompt per line)")
    raise InputError(f"unknown prompt set {name!r} (mt_bench, humaneval, or a file path)")
  return [line for line in read_text(path, "prompt file").splitlines() if line.strip()]
