"""Refuse, before prefill, a run whose arrays cannot fit in its device's memory.

A run holds at least its KV cache, and each step at least its [T, T] in-flight mask (built on the
host and held on the device as a constant) and, on the jnp reference attention path, one layer's
fp32 scores [B, Hq, T, S + T] (an einsum's output, materialised). T is the method's tokens per
forward. These are lower bounds, so a refusal is certain to be right: without it an absurd knob
(a Lookahead window or FAFO subsequence count of 100000) ran prefill and then failed inside the
step's trace with a bare MemoryError. Runs that fit these bounds and still exceed memory fail as
before (activations, weights' temporaries and XLA's buffers are not counted).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from sparsedec.decode.prefill import committed_devices
from sparsedec.errors import InputError
from sparsedec.model.config import ModelConfig

GIB = 2 ** 30
KV_CACHE = "the KV cache"


def _size(n: float) -> str:
  """n bytes, readably: GiB from one GiB up, MiB below."""
  return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / 2 ** 20:,.3g} MiB"


def host_memory_bytes() -> int | None:
  """This machine's physical memory (not what is free: page cache would count against a run that
  can evict it), or None where the OS does not tell."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, OSError, ValueError):
    return None


def device_memory_bytes(device) -> int | None:
  """Bytes a run can still allocate on `device`: the allocator's limit less what is in use where
  the device reports them (GPUs), the host's physical memory for a CPU device, else None."""
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  return host_memory_bytes() if device.platform == "cpu" else None


def run_devices(like) -> set:
  """The devices a run's arrays go to: those `like` (a params array) is committed to, else the
  default device."""
  devices = committed_devices(like)
  if devices:
    return devices
  default = jax.config.jax_default_device            # a Device, a platform name or None
  if isinstance(default, jax.Device):
    return {default}
  return {jax.devices(default)[0] if isinstance(default, str) else jax.devices()[0]}


def run_platform(like) -> str | None:
  """The platform of `run_devices(like)` ("gpu", "cpu", ...); None where they span several."""
  platforms = {d.platform for d in run_devices(like)}
  return platforms.pop() if len(platforms) == 1 else None


def run_lower_bounds(cfg: ModelConfig, tokens_per_forward: int, batch: int, capacity: int,
                     reference_path: bool) -> dict[str, int]:
  """{what: bytes} a run certainly holds at once (module docstring)."""
  t = tokens_per_forward
  need = {
      f"{KV_CACHE} ({batch} rows x {capacity} slots)":
          2 * cfg.num_layers * batch * cfg.num_kv_heads * capacity * cfg.head_dim
          * jnp.dtype(cfg.dtype).itemsize,
      f"a step's [{t}, {t}] in-flight mask": t * t,
  }
  if reference_path:
    need[f"one layer's fp32 attention scores [{batch}, {cfg.num_heads}, {t}, {capacity + t}] "
         f"(the jnp reference attention)"] = 4 * batch * cfg.num_heads * t * (capacity + t)
  return need


def check_run_fits(cfg: ModelConfig, method, batch: int, capacity: int, like,
                   cache_sharding: jax.sharding.Sharding | None = None) -> None:
  """Raise an InputError naming each array when `run_lower_bounds` exceed the memory of the run's
  devices: the KV cache's share of a device as `cache_sharding` lays it out (`prefill.
  cache_sharding`; a replicated cache is whole on each device), the rest split evenly over
  several devices. Devices that do not report their memory pass."""
  devices = run_devices(like)
  limits = [device_memory_bytes(d) for d in devices]
  if any(x is None for x in limits):
    return
  t = int(getattr(method, "tokens_per_forward", 1))
  # The reference path is certain where no kernel can run: attention="reference", or "auto" on
  # a backend without the Pallas kernels.
  reference = cfg.attention == "reference" or (
      cfg.attention == "auto" and all(d.platform != "gpu" for d in devices))
  need = run_lower_bounds(cfg, t, batch, capacity, reference)
  cache_share = 1 / len(devices)
  if cache_sharding is not None:
    shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    cache_share = math.prod(cache_sharding.shard_shape(shape)) / math.prod(shape)
  per_device = sum(size * (cache_share if what.startswith(KV_CACHE) else 1 / len(devices))
                   for what, size in need.items())
  have = min(limits)
  if per_device <= have:
    return
  parts = "; ".join(f"{what} {_size(size)}" for what, size in need.items())
  where = "its device" if len(devices) == 1 else f"each of its {len(devices)} devices"
  raise InputError(
      f"this run cannot fit in memory: it needs at least {_size(per_device)} on {where} "
      f"({parts}), which has {_size(have)}: lower the batch, max_new_tokens or "
      f"cache_size, or the method's tokens per forward (T = {t})")
