"""Prefill: fill the cache with the prompts, in chunks, and draw each row's first new token."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sparsedec.decode.sampling import SamplingConfig, sample, split_keys
from sparsedec.decode.state import DecodeState, append_tokens
from sparsedec.errors import InputError, is_int
from sparsedec.kv.dense import KVCache, commit, init_cache
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.params import Params


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty_cache(cfg: ModelConfig, batch_size: int, capacity: int) -> KVCache:
  return init_cache(cfg, batch_size, capacity)


@functools.lru_cache(maxsize=16)
def _sharded_empty_cache(cfg: ModelConfig, batch_size: int, capacity: int,
                         kv: NamedSharding):
  """A jitted maker of the empty cache with K / V laid out as `kv` and lengths replicated over
  kv's mesh (one per config, size and sharding: jit's out_shardings are fixed at definition)."""
  rows = NamedSharding(kv.mesh, P())
  layers = (kv,) * cfg.num_layers
  return jax.jit(functools.partial(init_cache, cfg, batch_size, capacity),
                 out_shardings=KVCache(k=layers, v=layers, lengths=rows))


def committed_devices(like) -> set | None:
  """The devices `like` (a params array) is committed to; None for anything else (an
  uncommitted or host array, a tracer): a run on such params goes to the default device."""
  if isinstance(like, jax.Array) and not isinstance(like, jax.core.Tracer) and like.committed:
    return set(like.sharding.device_set)
  return None


def cache_sharding(cfg: ModelConfig, params: Params) -> NamedSharding | None:
  """How the K / V of an empty cache [B, Hkv, S, D] are laid out for params committed to several
  devices; None for params on one device (or not committed: the default device).

  The KV heads are split over the mesh axes that split wqkv's columns (the usual tensor-parallel
  layout, `NamedSharding(mesh, P(None, "model"))` on the linears' output columns) where those
  axes' size divides Hkv: the layout the prefill gives the cache it writes. Otherwise the cache is
  replicated over the params' devices (`P()` on their mesh). Either way no device holds a copy
  the run does not use: an empty cache made on the default device was replicated to every device
  by the prefill's call (each of them held the whole cache, device 0 twice), so a sharded model's
  cache could be no larger than one device's memory."""
  devices = committed_devices(params["embed"])
  if devices is None or len(devices) == 1:
    return None
  wqkv = getattr(params["layers"][0].get("wqkv"), "sharding", None)
  if isinstance(wqkv, NamedSharding) and set(wqkv.device_set) == devices:
    cols = wqkv.spec[1] if len(wqkv.spec) > 1 else None
    axes = cols if isinstance(cols, tuple) else (cols,)
    if cols is not None and cfg.num_kv_heads % math.prod(wqkv.mesh.shape[a] for a in axes) == 0:
      return NamedSharding(wqkv.mesh, P(None, cols))
  embed = params["embed"].sharding
  if isinstance(embed, NamedSharding):
    return NamedSharding(embed.mesh, P())
  return NamedSharding(Mesh(np.array(sorted(devices, key=lambda d: d.id)), ("devices",)), P())


def empty_cache(cfg: ModelConfig, batch_size: int, capacity: int,
                params: Params | None = None) -> KVCache:
  """An empty cache for `prefill` where `params` are: on the one device they are committed to
  (made on the default device, it was copied to params placed elsewhere by the prefill's call: a
  whole cache held on device 0 for a model on device 1), laid out by `cache_sharding` over
  params on several devices, else (params None or not committed) on the default device."""
  if params is None:
    return _empty_cache(cfg, batch_size, capacity)
  sharding = cache_sharding(cfg, params)
  if sharding is not None:
    return _sharded_empty_cache(cfg, batch_size, capacity, sharding)()
  devices = committed_devices(params["embed"])
  if devices is None:
    return _empty_cache(cfg, batch_size, capacity)
  with jax.default_device(next(iter(devices))):
    return _empty_cache(cfg, batch_size, capacity)


def prefill_cache(cfg: ModelConfig, params: Params, prompts: jax.Array, prompt_lengths: jax.Array,
                  cache: KVCache, chunk: int, num_chunks: jax.Array | None = None
                  ) -> tuple[KVCache, jax.Array]:
  """prompts [B, P] right-padded (P a multiple of chunk), prompt_lengths [B] >= 1.

  Appends every row's prompt to its (empty or partly filled) cache in P // chunk forwards of
  `chunk` tokens, or in the first num_chunks ([] int, traced; <= P // chunk) where the rows' prompts
  end before P (a draft model's prefill over a token buffer of the cache's capacity). Returns the
  cache and fp32 logits [B, V] at each row's last prompt token.
  """
  b, p = prompts.shape
  if not is_int(chunk) or chunk < 1 or p % chunk:
    # P // chunk forwards: a remainder would be dropped (those prompt tokens never reach the
    # cache, and a row ending there is given zero logits: token 0), and a chunk past P is a
    # slice larger than the prompts.
    raise InputError(f"prefill chunk must be an integer >= 1 that divides the padded prompt "
                     f"length P = {p}, got chunk {chunk!r} (pad prompts [B, P] to a multiple of "
                     f"it, or pass a smaller chunk)")
  start = cache.lengths                                                   # [B]

  def body(c, carry):
    cache, last_logits = carry
    offset = c * chunk
    toks = jax.lax.dynamic_slice_in_dim(prompts, offset, chunk, axis=1)   # [B, chunk]
    positions = start[:, None] + offset + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    n_valid = jnp.clip(prompt_lengths - offset, 0, chunk)                 # [B]
    last_idx = jnp.clip(prompt_lengths - 1 - offset, 0, chunk - 1)        # [B]
    logits, kv = forward(cfg, params, toks, positions, cache, logits_at=last_idx[:, None])
    cache = commit(cache, kv, n_valid)
    here = (prompt_lengths - 1 >= offset) & (prompt_lengths - 1 < offset + chunk)
    return cache, jnp.where(here[:, None], logits[:, 0], last_logits)

  init = (cache, jnp.zeros((b, cfg.vocab_size), jnp.float32))
  bound = p // chunk if num_chunks is None else jnp.minimum(num_chunks, p // chunk)
  return jax.lax.fori_loop(0, bound, body, init)


@functools.partial(jax.jit, static_argnames=("cfg", "chunk", "sampling", "stop_ids"),
                   donate_argnames=("cache",))
def prefill(cfg: ModelConfig, params: Params, cache: KVCache, prompts: jax.Array,
            prompt_lengths: jax.Array, max_new_tokens: jax.Array, seeds: jax.Array, *,
            chunk: int, sampling: SamplingConfig, stop_ids: tuple[int, ...]) -> DecodeState:
  """A fresh DecodeState for prompts [B, P] (right-padded, P a multiple of chunk): cache filled,
  first token drawn (greedy or sampled).

  cache: an empty cache (`empty_cache`), passed in (and donated) rather than built here, so XLA
  cannot constant-fold work over it. max_new_tokens, seeds: [B] int32 (per row). Everything is
  traced, so prompts of one bucket (same P, same capacity) reuse the compiled function.
  """
  b = prompts.shape[0]
  capacity = cache.capacity
  cache, logits = prefill_cache(cfg, params, prompts, prompt_lengths, cache, chunk)
  keys = jax.vmap(jax.random.key)(seeds)
  keys, step_keys = split_keys(keys)
  first = sample(logits, step_keys, sampling)                              # [B]
  tokens = jnp.zeros((b, capacity + 1), jnp.int32)
  tokens = jax.lax.dynamic_update_slice(tokens, prompts[:, : min(prompts.shape[1], capacity + 1)],
                                        (0, 0))
  col = jnp.arange(capacity + 1)[None, :]
  tokens = jnp.where(col < prompt_lengths[:, None], tokens, 0)
  state = DecodeState(
      tokens=tokens, num_tokens=prompt_lengths.astype(jnp.int32),
      prompt_lengths=prompt_lengths.astype(jnp.int32),
      limits=(prompt_lengths + max_new_tokens).astype(jnp.int32),
      done=max_new_tokens <= 0, cache=cache, keys=keys,
      step=jnp.zeros((), jnp.int32), active_steps=jnp.zeros((b,), jnp.int32))
  state, _ = append_tokens(state, first[:, None], jnp.ones((b,), jnp.int32), stop_ids)
  return state
