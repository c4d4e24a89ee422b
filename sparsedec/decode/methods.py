"""Registry of decoding methods by name (the CLI's --method)."""

from __future__ import annotations

from sparsedec.decode.dense import Dense
from sparsedec.decode.loop import DecodeMethod
from sparsedec.errors import InputError

_METHODS: dict[str, type] = {"dense": Dense}


def register(name: str, cls: type) -> None:
  _METHODS[name] = cls


def method_names() -> list[str]:
  return sorted(_METHODS)


def get_method(name_or_method: str | DecodeMethod, **knobs) -> DecodeMethod:
  if not isinstance(name_or_method, str):
    return name_or_method
  if name_or_method not in _METHODS:
    raise InputError(f"unknown method {name_or_method!r} (available: {method_names()})")
  return _METHODS[name_or_method](**knobs)
