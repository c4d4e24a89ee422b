"""Serving shape: prefill a request on its own, insert it into a free row of a running state.

Every DecodeState leaf holds one entry per row along its batch axis: axis 0, or the axis its
class gives the field in `BATCH_AXES` (the compression policies' per-layer states, [L, B, ...]),
except the fields a class names in `SHARED_FIELDS`, the same for every row: the loop counter
`step`, QuantSpec's 4-bit draft weights. Moving a request between states is a per-leaf copy
of its row along that axis. The row index is traced: inserting into any row reuses one compiled
function.

  state, run = api.start(cfg, params, prompts, cache_size=C, ...)   # the running batch
  new, _ = api.start(cfg, params, [request], cache_size=C, ...)     # B = 1, same capacity,
  #   method, sampling and stop_tokens (else an InputError); its own max_new_tokens and seed
  state = insert_row(state, new, row)     # a row where state.done[row] (else an InputError)
  state = run.advance(params, state, steps)

Inside a caller's own jit (a serving step that inserts and advances in one compiled call), use
`insert_row_traced(state, request, row)`: the same checks, those of the row made on the device,
returning (state, inserted) with the state unchanged where the row may not take the request.

Start requests with `request_params(params, state)`: for QuantSpec, params carrying the running
batch's 4-bit draft, which the request's init then takes instead of quantizing the weights again
(insert_row keeps the batch's draft and drops the request's).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from sparsedec.decode.loop import describe_build
from sparsedec.decode.state import DecodeState, beside_step, check_state
from sparsedec.errors import InputError
from sparsedec.model.params import Params


def request_params(params: Params, state: DecodeState) -> Params:
  """The params to `api.start` a request with that will be inserted into the running `state`:
  for QuantSpec with a 4-bit draft, params carrying the batch's draft layers (`gptq.with_draft`),
  so the request's init takes them instead of quantizing every linear again, only for
  insert_row to drop the result (SmolLM2-135M on a CPU: api.start 1.7 -> 0.4 s a request);
  params as they are otherwise. The same params advance the batch (the loop ignores the draft)."""
  check_state(state, "request_params' state")
  reuse = getattr(state.extras, "request_params", None)   # a method's extras may define it
  return params if reuse is None else reuse(params)


def _batch_axes(state: DecodeState) -> list[int | None]:
  """Per leaf of `state` (flattened order), its batch axis, or None for a leaf that is the same
  for every row: walks each leaf's path from the root, taking the `SHARED_FIELDS` and
  `BATCH_AXES` ({field: axis}) of the classes it passes."""
  axes = []
  for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
    node, axis = state, 0
    for key in path:
      if isinstance(key, jax.tree_util.GetAttrKey):
        if key.name in getattr(node, "SHARED_FIELDS", ()):
          axis = None
          break
        axis = getattr(node, "BATCH_AXES", {}).get(key.name, axis)
        node = getattr(node, key.name)
      else:
        node = node[key.idx if isinstance(key, jax.tree_util.SequenceKey) else key.key]
    axes.append(axis)
  return axes


def _put_row(big: jax.Array, one: jax.Array, row: jax.Array, axis: int | None,
             ok: jax.Array | None = None) -> jax.Array:
  """big with its entry `row` along `axis` set to one's only entry (None: big unchanged); where
  ok ([] bool) is False, the row keeps big's entry (a select over that row only)."""
  if axis is None:
    return big
  one = one.astype(big.dtype)
  if ok is not None:
    one = jnp.where(ok, one, jax.lax.dynamic_slice_in_dim(big, row, 1, axis))
  return jax.lax.dynamic_update_slice_in_dim(big, one, row, axis)


def _insert_rows(state: DecodeState, request: DecodeState, row: jax.Array,
                 ok: jax.Array | None = None) -> DecodeState:
  # Every per-row leaf is the request's, its counters included (a request advanced before it is
  # inserted keeps its step count beside its method's counters, which it carries too).
  leaves, treedef = jax.tree.flatten(state)
  return jax.tree.unflatten(treedef, [
      _put_row(big, one, row, axis, ok)
      for big, one, axis in zip(leaves, jax.tree.leaves(request), _batch_axes(state))])


@functools.partial(jax.jit, donate_argnames=("state",))
def _insert(state: DecodeState, request: DecodeState, row: jax.Array) -> DecodeState:
  return _insert_rows(state, request, row)


def _check_request(state: DecodeState, request: DecodeState, name: str) -> None:
  """Everything an insert of `request` into `state` needs that does not depend on the row (all
  static: shapes, dtypes, structure and how the states were built), by name."""
  check_state(state, f"{name}'s state")
  check_state(request, f"{name}'s request")
  if request.batch_size != 1:
    raise InputError(f"the request state must have batch size 1, got {request.batch_size}")
  if request.built_for != state.built_for:
    built = lambda s: "no method (a hand-built state)" if s.built_for is None else describe_build(
        s.built_for)
    raise InputError(f"the request state was built for {built(request)}, the running state for "
                     f"{built(state)}: start both with the same method, sampling and stop_tokens")
  if request.cache.capacity != state.cache.capacity:
    raise InputError(f"cache capacities differ: request {request.cache.capacity}, running state "
                     f"{state.cache.capacity} (pass the same cache_size to both)")
  if jax.tree.structure(state) != jax.tree.structure(request):
    raise InputError("the request state was built for another method or config")
  paths = jax.tree_util.tree_flatten_with_path(state)[0]
  for (path, big), one, axis in zip(paths, jax.tree.leaves(request), _batch_axes(state)):
    if axis is None:
      continue
    where = (f"the request state's {jax.tree_util.keystr(path)} ({one.dtype}{list(one.shape)}, "
             f"the running state's {big.dtype}{list(big.shape)})")
    if one.ndim <= axis or one.shape[axis] != 1:
      # The request has one row: a leaf without a 1 on its batch axis keeps its rows elsewhere
      # (a policy's own state, CompressionPolicy's docstring). A 0-d leaf was an IndexError, one
      # of rows on another axis 'start both with the same model'.
      raise InputError(f"{where} has no batch axis {axis}: its state class names a field the "
                       f"same for every row in SHARED_FIELDS, and a field whose rows lie on "
                       f"another axis in BATCH_AXES ({{field: axis}}, as QuestState)")
    if (big.shape[:axis] + big.shape[axis + 1:]
        != one.shape[:axis] + one.shape[axis + 1:] or big.dtype != one.dtype):
      raise InputError(f"the request state's {jax.tree_util.keystr(path)} is "
                       f"{one.dtype}{list(one.shape)}, the running state's "
                       f"{big.dtype}{list(big.shape)} (batch axis {axis}): start both with the "
                       f"same model (config, dtype), cache_size and method")


def insert_row(state: DecodeState, request: DecodeState, row: int, *,
               replace_running: bool = False) -> DecodeState:
  """Copy the single-row `request` state into row `row` of `state` (donated). The row must have
  finished (`state.done[row]`), so a running request is not dropped by mistake;
  replace_running=True drops it on purpose (preemption)."""
  _check_request(state, request, "insert_row")
  index = None
  if not isinstance(row, (bool, np.bool_)):
    try:
      index = operator.index(row)        # ints, numpy / jax integer scalars and 0-d arrays
    except TypeError:
      pass
  if index is None:
    raise InputError(f"row must be an integer (a row index of the batch of {state.batch_size}), "
                     f"got {row!r}")
  row = index
  if not 0 <= row < state.batch_size:
    raise InputError(f"row {row} is outside the batch of {state.batch_size}")
  # done read explicitly (an implicit read is refused under jax.transfer_guard("disallow")).
  if not replace_running and not bool(jax.device_get(state.done)[row]):
    raise InputError(f"row {row} is still decoding (state.done[{row}] is False): insert into a "
                     f"finished row, e.g. the first of numpy.flatnonzero(state.done), or pass "
                     f"replace_running=True to drop its request")
  return _insert(state, request, beside_step(state, np.int32(row)))


def insert_row_traced(state: DecodeState, request: DecodeState, row, *,
                      replace_running: bool = False) -> tuple[DecodeState, jax.Array]:
  """`insert_row` for a caller's jit (e.g. a serving step that inserts and advances in one
  compiled call): nothing is read back from the device and row may be traced. The row-free checks
  (batch size, how both states were built, capacity, structure, shapes, dtypes) raise an
  InputError at trace time, as insert_row's. The row's own (inside the batch; finished, unless
  replace_running) are made on the device: where they fail the state comes back unchanged.
  Returns (state, inserted [] bool). The state is not donated here (the caller's jit may)."""
  _check_request(state, request, "insert_row_traced")
  try:
    integer = jnp.issubdtype(jnp.result_type(row), jnp.integer)
  except TypeError:                          # not an array-like: a string, None, ...
    integer = False
  if isinstance(row, (bool, np.bool_)) or not integer:
    raise InputError(f"row must be an integer (a row index of the batch of {state.batch_size}), "
                     f"got {row!r}")
  row = jnp.asarray(row, jnp.int32)
  if row.ndim:
    raise InputError(f"row must be a scalar, got an array of shape {row.shape}")
  inside = (row >= 0) & (row < state.batch_size)
  at = jnp.clip(row, 0, state.batch_size - 1)
  ok = inside & (replace_running | state.done[at])
  return _insert_rows(state, request, at, ok), ok
