"""The decode state every method carries through its while_loop, and token bookkeeping.

Invariant per row b: tokens[b, :num_tokens[b]] is prompt + generated text; the KV entries of all
but the last of them are committed (cache.lengths[b] == num_tokens[b] - 1).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from sparsedec.errors import InputError
from sparsedec.kv.dense import KVCache


@struct.dataclass
class DecodeState:
  # The loop counter is one for the batch (serving's insert_row leaves it as it is).
  SHARED_FIELDS: ClassVar[tuple[str, ...]] = ("step",)
  tokens: jax.Array          # [B, L] int32: prompt + generated, L = cache capacity + 1
  num_tokens: jax.Array      # [B] int32
  prompt_lengths: jax.Array  # [B] int32
  limits: jax.Array          # [B] int32: num_tokens may not exceed this (prompt + max_new)
  done: jax.Array            # [B] bool: stop token seen or limit reached
  cache: KVCache
  keys: jax.Array            # [B] PRNG keys, one stream per row
  step: jax.Array            # [] int32: loop iterations so far (wraps past int32's top)
  active_steps: jax.Array    # [B] int32: iterations in which the row was not done
  extras: Any = None         # method-specific arrays (n-gram pool, draft caches, ...)
  # (method, StepContext) that `init_method` attached this state for (None: a state built by
  # hand). Static, so part of the tree structure: `Run.advance` and `serving.insert_row` refuse
  # a state of another method, sampling or stop tokens by name instead of failing inside the
  # trace or decoding it under other settings.
  built_for: Any = struct.field(pytree_node=False, default=None)

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  def last_tokens(self) -> jax.Array:
    """[B, 1] the newest token of each row (its KV not yet committed)."""
    return jnp.take_along_axis(self.tokens, (self.num_tokens - 1)[:, None], axis=1)

  def generated(self) -> jax.Array:
    """[B] tokens generated so far."""
    return self.num_tokens - self.prompt_lengths


def check_state(value: Any, what: str) -> None:
  """Refuse a `value` that is not a DecodeState by name (`what`: the argument), with the usual
  slips spelled out: api.start's (state, run) pair, a GenerationResult, swapped arguments."""
  if isinstance(value, DecodeState):
    return
  hint = ""
  if isinstance(value, tuple) and any(isinstance(v, DecodeState) for v in value):
    hint = ": api.start returns a (state, run) pair, unpack it (state, run = api.start(...))"
  elif hasattr(value, "tokens") and hasattr(value, "state"):
    hint = (": a GenerationResult holds its state in .state when generated with "
            "return_state=True")
  elif isinstance(value, dict):
    hint = " (the model's params? they come first: run.advance(params, state))"
  raise InputError(f"{what} must be a DecodeState (from api.start), got "
                   f"{type(value).__name__}{hint}")


def method_extras(state: DecodeState, cls: type, method_name: str) -> Any:
  """state.extras, checked to be the `cls` a method's init attaches: a state its init has not
  been run on (a prefilled one: extras None) or another method's is refused by name, not met
  by an AttributeError inside the step's trace."""
  if not isinstance(state.extras, cls):
    got = "none" if state.extras is None else type(state.extras).__name__
    raise InputError(f"{method_name}'s step needs the {cls.__name__} its init attaches to "
                     f"state.extras, got {got}: pass the prefilled state through "
                     f"sparsedec.decode.loop.init_method(cfg, params, state, method=..., ctx=...) "
                     f"with this method before stepping it")
  return state.extras


def beside_step(state: DecodeState, value):
  """A host scalar put where the state's step counter is, for a jitted call on the state:
  explicitly (an implicit host-to-device copy is refused under jax.transfer_guard("disallow"),
  and one made on the default device was copied again to a state placed elsewhere), committed
  only where the state is (a committed argument commits the call's outputs: the next call on
  them compiles again). Under a caller's trace, value as it is."""
  if isinstance(state.step, jax.core.Tracer):
    return value
  return jax.device_put(value, state.step.sharding if state.step.committed else None)


def append_tokens(state: DecodeState, new_tokens: jax.Array, count: jax.Array,
                  stop_ids: tuple[int, ...]) -> tuple[DecodeState, jax.Array]:
  """Append up to count[b] of new_tokens[b] ([B, A]) to each row that is not done.

  Stops at (and keeps) the first stop token and at the row's limit; a count outside [0, A] is
  clipped to it (more than A counted zeros past the A tokens as appended, a negative count took
  tokens off the row). Returns the new state and the number appended per row [B].
  """
  b, a = new_tokens.shape
  col = jnp.arange(a, dtype=jnp.int32)[None, :]                                 # [1, A]
  n = jnp.where(state.done, 0, jnp.clip(count.astype(jnp.int32), 0, a))
  if stop_ids:
    is_stop = jnp.isin(new_tokens, jnp.asarray(stop_ids, jnp.int32)) & (col < n[:, None])
    has_stop = is_stop.any(axis=1)
    n = jnp.where(has_stop, jnp.argmax(is_stop, axis=1).astype(jnp.int32) + 1, n)
  else:
    has_stop = jnp.zeros((b,), bool)
  room = state.limits - state.num_tokens
  hit_limit = n >= room
  n = jnp.minimum(n, room)
  pos = jnp.where(col < n[:, None], state.num_tokens[:, None] + col, state.tokens.shape[1])
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, a))
  tokens = state.tokens.at[rows, pos].set(new_tokens.astype(jnp.int32), mode="drop")
  done = state.done | (has_stop & (n > 0)) | hit_limit
  return state.replace(tokens=tokens, num_tokens=state.num_tokens + n, done=done), n
