"""argparse value types shared by the benchmark scripts: a bad value is refused by flag name
before any model loads (argparse: `argument --num-prompts: must be an integer >= 1, got '0'`)."""

from __future__ import annotations

import argparse


def count(text: str) -> int:
  """An integer >= 1 (a number of prompts, tokens, guesses, ...)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
  return value
