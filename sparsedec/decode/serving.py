"""Serving shape: prefill a request on its own, insert it into a free row of a running state.

Every DecodeState field except the loop counter `step` is batch-major ([B, ...], method extras
included), so moving a request between states is a per-leaf row copy. The row index is traced:
inserting into any row reuses one compiled function.

  state, run = api.start(cfg, params, prompts, cache_size=C, ...)   # the running batch
  new, _ = api.start(cfg, params, [request], cache_size=C, ...)     # B = 1, same capacity
  state = insert_row(state, new, row)                               # where state.done[row]
  state = run.advance(params, state, steps)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sparsedec.decode.state import DecodeState
from sparsedec.errors import InputError


@functools.partial(jax.jit, donate_argnames=("state",))
def _insert(state: DecodeState, request: DecodeState, row: jax.Array) -> DecodeState:
  step = state.step   # the only leaf that is not batch-major: set aside (None is no leaf)
  merged = jax.tree.map(lambda big, one: big.at[row].set(one[0]), state.replace(step=None),
                        request.replace(step=None))
  # Counters of the inserted row restart; the loop counter stays the running state's.
  return merged.replace(step=step, active_steps=merged.active_steps.at[row].set(0))


def insert_row(state: DecodeState, request: DecodeState, row: int) -> DecodeState:
  """Copy the single-row `request` state into row `row` of `state` (donated)."""
  if request.batch_size != 1:
    raise InputError(f"the request state must have batch size 1, got {request.batch_size}")
  if request.cache.capacity != state.cache.capacity:
    raise InputError(f"cache capacities differ: request {request.cache.capacity}, running state "
                     f"{state.cache.capacity} (pass the same cache_size to both)")
  if not 0 <= row < state.batch_size:
    raise InputError(f"row {row} is outside the batch of {state.batch_size}")
  if jax.tree.structure(state) != jax.tree.structure(request):
    raise InputError("the request state was built for another method or config")
  return _insert(state, request, jnp.int32(row))
