"""Registry of decoding methods by name (the CLI's --method)."""

from __future__ import annotations

import dataclasses

from sparsedec.decode.dense import Dense
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.lookahead import Lookahead
from sparsedec.decode.loop import DecodeMethod
from sparsedec.decode.quantspec import QuantSpec
from sparsedec.decode.sfi import SlowFast
from sparsedec.decode.speculative import Speculative
from sparsedec.decode.triforce import TriForce
from sparsedec.errors import InputError

_METHODS: dict[str, type] = {"dense": Dense, "lookahead": Lookahead, "fafo": Fafo,
                             "quantspec": QuantSpec, "speculative": Speculative,
                             "triforce": TriForce, "sfi": SlowFast}


def register(name: str, cls: type) -> None:
  _METHODS[name] = cls


def method_names() -> list[str]:
  return sorted(_METHODS)


def get_method(name_or_method: str | DecodeMethod, **knobs) -> DecodeMethod:
  """A method object by name, built with its knobs (e.g. get_method("lookahead", window=5))."""
  if not isinstance(name_or_method, str):
    if isinstance(name_or_method, type):
      raise InputError(f"method must be a method object, e.g. {name_or_method.__name__}(), or a "
                       f"name, got the class {name_or_method.__name__}")
    if not all(hasattr(name_or_method, a) for a in ("init", "step", "max_steps")):
      raise InputError(f"method must be a name ({method_names()}) or a decoding method object "
                       f"(init, step, max_steps), got {name_or_method!r:.80}")
    if knobs:
      raise InputError(f"knobs {sorted(knobs)} given with a method object: set them on it")
    try:
      hash(name_or_method)
    except TypeError as err:
      raise InputError(f"method {type(name_or_method).__name__} is not hashable ({err}): the "
                       f"jitted loop takes the method as a static argument (make it a frozen "
                       f"dataclass, as the built-in methods are)") from None
    return name_or_method
  if name_or_method not in _METHODS:
    raise InputError(f"unknown method {name_or_method!r} (available: {method_names()})")
  cls = _METHODS[name_or_method]
  if not dataclasses.is_dataclass(cls):
    return cls(**knobs)
  fields = {f.name for f in dataclasses.fields(cls)} - {"name"}
  unknown = sorted(set(knobs) - fields)
  if unknown:
    raise InputError(f"method {name_or_method!r} has no knob {unknown[0]!r} "
                     f"(its knobs: {sorted(fields) or 'none'})")
  return cls(**knobs)


def method_config(method: str | DecodeMethod) -> dict:
  """A method's knobs as a JSON-ready dict (for stats and benchmark records; knobs that are not
  plain values are given by their repr); {} for a bare name."""
  if isinstance(method, str) or not dataclasses.is_dataclass(method):
    return {}
  plain = (bool, int, float, str, type(None))

  def rendered(v):
    if isinstance(v, plain):
      return v
    if isinstance(v, tuple) and all(isinstance(t, int) for t in v):   # token ids (SFI's ends)
      return list(v) if len(v) <= 8 else f"{len(v)} token ids"
    return repr(v)
  return {f.name: rendered(getattr(method, f.name))
          for f in dataclasses.fields(method) if f.name != "name"}
