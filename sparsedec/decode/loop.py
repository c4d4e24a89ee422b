"""The decode loop: one jitted `jax.lax.while_loop` over a method's `step`, no host round trips.

A method is a frozen (hashable) object with
  init(cfg, params, state) -> state            # set state.extras (outside the loop, under jit)
  step(cfg, params, state, ctx) -> state       # one forward over T tokens, accept, commit
  max_steps(max_new_tokens) -> int             # worst-case iterations (dense: max_new_tokens)
  stats(state, rows=None) -> dict              # host-side method figures for the result:
                                               #   the counters of `rows` (row indices; None:
                                               #   every row), per-step figures over those
                                               #   rows' active steps (`row_index`)
  capacity_multiple: int (optional)            # the cache capacity must be a multiple of it
  max_capacity(cfg) -> int | None (optional)   # the largest cache capacity init takes
  check(cfg, params, capacity) -> None         # optional: refuse knobs this model or cache
                                               #   capacity cannot take (api.start calls it
                                               #   before prefill; init checks them again)
  init_key() -> method (optional)              # the method init is compiled for: this one
                                               #   with the knobs its init does not read at
                                               #   their defaults (runs differing only in those
                                               #   share the init's compile)
A step may append several tokens per row: `append_tokens` clips them at the row's stop token and
token limit, and the step commits K/V only for the tokens it appended, so a multi-token step
never overflows the token buffer or the cache (plan_capacity needs no slack per method).
The loop bound is a traced argument, so one compiled loop serves every max_new_tokens and a
caller can run it in slices (streaming), each call a number of iterations from where it stands.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparsedec.decode.fits import run_platform
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.decode.state import DecodeState
from sparsedec.errors import InputError, is_int
from sparsedec.model.config import ModelConfig
from sparsedec.model.params import Params


def stop_id_tuple(stops, what: str) -> tuple[int, ...]:
  """`stops` (a sequence of integer token ids; numpy / jax arrays too) sorted without repeats:
  the same stop set is then the same static ctx (one compile; a state and a request with the
  stops in another order are the same build). Anything else is refused, naming `what`."""
  ids = stops.tolist() if hasattr(stops, "tolist") else stops          # numpy / jax arrays
  if not isinstance(ids, (str, bytes)) and hasattr(ids, "__iter__"):
    ids = list(ids)         # once: a generator or map would be empty when read a second time
  if not isinstance(ids, list) or not all(is_int(t) for t in ids):
    raise InputError(f"{what} must be a sequence of token ids (() for none), got {stops!r:.80}")
  return tuple(sorted({int(t) for t in ids}))


def row_index(rows, batch: int) -> slice | np.ndarray:
  """What a method's `stats` indexes its [B] counters with: every row (slice(None)) for None,
  else `rows` (a sequence of distinct row indices of the batch of `batch`, numpy / jax arrays
  too) as an int array. Anything else is refused naming the problem: not a sequence, an entry
  that is not an integer, a row outside the batch, a row given twice (its counters would count
  twice), no rows at all."""
  if rows is None:
    return slice(None)
  ids = rows.tolist() if hasattr(rows, "tolist") else rows            # numpy / jax arrays
  if is_int(ids) or isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
    raise InputError(f"rows must be a sequence of row indices of the batch of {batch} (e.g. "
                     f"[0]; None for every row), got {rows!r:.80}")
  ids = list(ids)                      # once: a generator would be empty when read a second time
  bad = [r for r in ids if not is_int(r)]
  if bad:
    raise InputError(f"rows must be integer row indices of the batch of {batch}, got {bad[0]!r} "
                     f"in {rows!r:.80}")
  if not ids:
    raise InputError(f"rows is empty: name at least one row of the batch of {batch} (None for "
                     f"every row)")
  outside = [r for r in ids if not 0 <= r < batch]
  if outside:
    raise InputError(f"row {outside[0]} is outside the batch of {batch} (rows 0 to {batch - 1})")
  twice = [r for i, r in enumerate(ids) if r in ids[:i]]
  if twice:
    raise InputError(f"row {twice[0]} is given twice in rows: its counters would count twice")
  return np.asarray(ids, np.int64)


def row_counters(state: DecodeState, rows, *counters: jax.Array) -> tuple[np.ndarray, ...]:
  """What a method's `stats` sums: the state's active_steps, then each of `counters` (per-row
  [B] arrays of its extras), read from the device in one transfer and taken at `rows`
  (`row_index`: None for every row)."""
  pick = row_index(rows, state.batch_size)
  return tuple(np.asarray(v)[pick] for v in jax.device_get((state.active_steps, *counters)))


@dataclasses.dataclass(frozen=True)
class StepContext:
  """Static settings every step needs. stop_ids: any integer token ids, stored sorted without
  repeats (`stop_id_tuple`), so a hand-built context is hashable and equal to the one
  `api.start` makes for the same stops."""
  sampling: SamplingConfig
  stop_ids: tuple[int, ...]

  def __post_init__(self):
    if not isinstance(self.sampling, SamplingConfig):
      raise InputError(f"StepContext sampling must be a SamplingConfig, got "
                       f"{type(self.sampling).__name__} {self.sampling!r:.80}")
    object.__setattr__(self, "stop_ids", stop_id_tuple(self.stop_ids, "StepContext stop_ids"))


class DecodeMethod(Protocol):
  name: str

  def init(self, cfg: ModelConfig, params: Params, state: DecodeState) -> DecodeState: ...

  def step(self, cfg: ModelConfig, params: Params, state: DecodeState,
           ctx: StepContext) -> DecodeState: ...

  def max_steps(self, max_new_tokens: int) -> int: ...

  def stats(self, state: DecodeState, rows: Sequence[int] | None = None) -> dict: ...


def describe_build(built_for: tuple["DecodeMethod", StepContext]) -> str:
  """A state's `built_for` (method, ctx) in words, for errors."""
  method, ctx = built_for
  return f"method {method!r} with {ctx.sampling} and stop_tokens {ctx.stop_ids}"


def finish_step(state: DecodeState) -> DecodeState:
  """Counters every step updates after acceptance."""
  return state.replace(step=state.step + 1, active_steps=state.active_steps + (~state.done))


def init_method(cfg: ModelConfig, params: Params, state: DecodeState, *, method: DecodeMethod,
                ctx: StepContext) -> DecodeState:
  """Attach the method's arrays (state.extras) to a freshly prefilled state (donated).

  A method may replace part of the state: QuantSpec with int8 verification turns the dense
  cache into codes and keeps no dense K/V. Those donated buffers cannot be reused for an output
  of another shape, so XLA frees them after the call and jax warns that "some donated buffers
  were not usable". Only for such a method (`drops_donated_buffers`) is that warning expected
  and not shown; for the others it still surfaces, as a sign of a real donation failure.

  The result records (method, ctx) in its static `built_for`, which `Run.advance` and
  `serving.insert_row` check. The jitted init does not take ctx (no method's init reads it), so
  runs that differ only in sampling or stop tokens share its compile; nor, for a method with an
  `init_key(platform)`, the knobs its init does not read (QuantSpec's draft_sampling: ~2-5 s a
  compile). `init_key` is given the platform of the params' devices (the default device's for
  uncommitted params or under a jit; None for params over several platforms), so a choice by
  platform follows where the params are (QuantSpec's weight_layout "auto"), not the default
  backend. `built_for` keeps the method as given."""
  if not isinstance(ctx, StepContext):
    raise InputError(f"ctx must be a StepContext (the sampling and stop tokens the state will be "
                     f"decoded with), got {type(ctx).__name__} {ctx!r:.80}")
  init_key = method
  if hasattr(method, "init_key"):             # given the platform of the params' devices
    init_key = method.init_key(run_platform(params["embed"]))
  if not drops_donated_buffers(cfg, params, state, method=init_key):
    state = _init_method(cfg, params, state, method=init_key)
  else:
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable",
                              category=UserWarning)
      state = _init_method(cfg, params, state, method=init_key)
  return state.replace(built_for=(method, ctx))


def drops_donated_buffers(cfg: ModelConfig, params: Params, state: DecodeState, *,
                          method: DecodeMethod) -> bool:
  """Whether the method's init returns fewer buffers of some (shape, dtype) than the state it
  is given holds, so that some donated input cannot become an output (abstract evaluation of
  the jitted init: its trace is cached, nothing runs). The jitted function's own eval_shape,
  whose trace jit caches: a lambda around it was a new function each call, traced again every
  time, and that trace counted as compilation in every call's compile_seconds (SmolLM2's
  QuantSpec: 23-53 ms a warm call, taken off its prefill_seconds)."""
  out = _init_method.eval_shape(cfg, params, state, method=method)
  avals = lambda tree: collections.Counter((tuple(x.shape), str(x.dtype))
                                           for x in jax.tree.leaves(tree))
  return bool(avals(state) - avals(out))


@functools.partial(jax.jit, static_argnames=("cfg", "method"), donate_argnames=("state",))
def _init_method(cfg: ModelConfig, params: Params, state: DecodeState, *,
                 method: DecodeMethod) -> DecodeState:
  return method.init(cfg, params, state)


@functools.partial(jax.jit, static_argnames=("cfg", "method", "ctx"), donate_argnames=("state",))
def decode(cfg: ModelConfig, params: Params, state: DecodeState, steps: jax.Array, *,
           method: DecodeMethod, ctx: StepContext) -> DecodeState:
  """Run `method.step` until every row is done or for `steps` ([] int32 >= 0) iterations.

  The bound counts from the state's step by difference, not against an absolute step: a serving
  state's step (one counter for the batch, left as it is by inserts) may pass int32's top and
  wrap, and an absolute limit there (saturated at the top) stopped every later call at once,
  leaving the rows unfinished."""
  first = state.step

  def cond(s: DecodeState):
    return jnp.any(~s.done) & (s.step - first < steps)      # int32 wraps: the difference holds

  return jax.lax.while_loop(cond, lambda s: method.step(cfg, params, s, ctx), state)
