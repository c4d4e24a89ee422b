"""Errors raised for the user: each names the bad value in plain words."""

import json
import os
import tempfile

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


def read_text(path, what: str) -> str:
  """The text of file `path` (UTF-8); one that cannot be read or decoded raises InputError
  naming it as `what` (e.g. "prompt file"), not a bare UnicodeDecodeError / OSError traceback."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except UnicodeDecodeError as e:
    raise InputError(f"{what} {path} is not UTF-8 text: {e}") from e
  except OSError as e:
    raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from e


def unwritable_reason(path) -> str | None:
  """Why `path` (a file or directory to create or replace) could not be written, checked before
  a long run: its nearest existing ancestor is not a directory or takes no new entry; None if
  it can be."""
  parent = os.path.dirname(os.path.abspath(os.fspath(path)))
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    return f"{parent} is not a directory"
  try:                                   # a probe, not os.access: root passes that everywhere
    os.rmdir(tempfile.mkdtemp(prefix=".sparsedec-probe-", dir=parent))
  except OSError as e:
    return f"{parent} does not take new entries ({e.strerror})"
  return None
