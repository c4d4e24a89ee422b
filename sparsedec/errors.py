"""Errors raised for the user: each names the bad value in plain words."""

import json

import numpy as np


class SparsedecError(ValueError):
  """Base class of every error sparsedec raises for bad input."""


class UnsupportedConfigError(SparsedecError):
  """A model config attribute or value that sparsedec does not implement."""


class CheckpointError(SparsedecError):
  """A checkpoint that is missing, incomplete, or holds tensors of the wrong shape."""


class InputError(SparsedecError):
  """A bad argument to generation: prompt too long, bad sampling parameter, ..."""


def is_int(value) -> bool:
  """A Python or numpy integer, not a bool (nor a float holding an integer): what the integer
  knobs accept."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def read_json(path, error: type[SparsedecError] | None = None):
  """The JSON document in file `path`; a file that does not parse raises `error` (default
  CheckpointError) naming the file, not a bare JSONDecodeError."""
  try:
    with open(path) as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise (error or CheckpointError)(f"{path} is not valid JSON: {e}") from e
