"""Dense decoding: one token per step, reading the full cache. The baseline and the reference."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp

from sparsedec.decode.loop import StepContext, finish_step, row_index
from sparsedec.decode.sampling import sample, split_keys
from sparsedec.decode.state import DecodeState, append_tokens
from sparsedec.kv.dense import commit
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.params import Params


@dataclasses.dataclass(frozen=True)
class Dense:
  name: str = "dense"

  def init(self, cfg: ModelConfig, params: Params, state: DecodeState) -> DecodeState:
    return state

  def max_steps(self, max_new_tokens: int) -> int:
    return max_new_tokens

  def stats(self, state: DecodeState, rows: Sequence[int] | None = None) -> dict:
    """No figures of its own (one token a step: tau is 1), for any rows (checked all the
    same)."""
    row_index(rows, state.batch_size)
    return {}

  def step(self, cfg: ModelConfig, params: Params, state: DecodeState,
           ctx: StepContext) -> DecodeState:
    active = (~state.done).astype(jnp.int32)                              # [B]
    logits, kv = forward(cfg, params, state.last_tokens(), state.cache.lengths[:, None],
                         state.cache)                                     # [B, 1, V]
    cache = commit(state.cache, kv, active)
    keys, step_keys = split_keys(state.keys)
    nxt = sample(logits[:, 0], step_keys, ctx.sampling)                   # [B]
    state = state.replace(cache=cache, keys=keys)
    state = finish_step(state)
    state, _ = append_tokens(state, nxt[:, None], active, ctx.stop_ids)
    return state
