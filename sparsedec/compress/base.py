"""The one interface of KV compression policies.

A policy turns (cache state, query statistics) into a fixed budget of selected cache blocks per
(row, KV head), as a `BlockListView` of constant shape, so a method's plan never changes shape
and no mask is rebuilt per step:

  init(cfg, params, state) -> pstate                 # after prefill (SnapKV looks at the prompt)
  view(pstate, cache) -> BlockListView               # C(kv) for this step's compressed queries
  update(pstate, cache, queries) -> pstate           # after the step's commit; queries: the
                                                     # step's per-layer query statistics or None

Static policies (StreamingLLM, SnapKV) ignore `queries`; dynamic ones (Quest; later TriForce's
chunk retrieval and the SFI Selector) re-select from them. A policy of one's own:

* is hashable (a frozen dataclass: the method is a static argument of the jitted loop) and has
  `block_size` and `budget_blocks` (positive integers; the cache capacity must be a multiple
  of block_size). `name` is optional (the stats show it; the class name otherwise).
* gets `queries` only with the class attribute `needs_queries: ClassVar[bool] = True`: then
  per layer the current token's queries [B, Hq, D] of the step; otherwise None (FAFO captures
  no queries unless asked). A policy that refreshes per-block summaries from the commit may set
  `max_commit` (the most entries a step commits that it handles); FAFO refuses a smaller one.
* returns from `view` a `BlockListView`: tables [B, Hkv, NB] and counts [B, Hkv] int32 (with
  per_layer=True, [L, B, Hkv, NB] and [L, B, Hkv] for every one of the model's L layers). The
  first counts[b, h] entries of tables[b, h] are distinct block ids in [0, S / block_size);
  entries past counts are not read. Shapes and dtypes are checked (`check_view`); the ids are
  traced values and are not: an id out of range reads nothing in the jnp reference and is
  clipped to a valid block in the GPU kernel, a duplicate is read twice by the kernel (once by
  the reference). FAFO stays lossless whatever the list (only its fumble tokens read it), but
  its guesses then differ between CPU and GPU. NB above the cache's blocks lists nothing more:
  the built-in policies list at most S / block_size blocks whatever budget_blocks says.
* keeps its state a pytree of arrays fixed in shape and dtype: `update` returns the structure,
  shapes and dtypes `init` gave (the loop's carry; jax refuses any other). Each array has the
  batch B on axis 0, unless its class (a flax `struct.dataclass`) names another axis in a
  `BATCH_AXES` ClassVar ({field: axis}, as Quest's [L, B, ...] fields) or the field in
  `SHARED_FIELDS` (the same for every row): serving's `insert_row` copies a request's row along
  that axis.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from sparsedec.attention import BlockListView, FullView
from sparsedec.errors import InputError, is_int
from sparsedec.kv.dense import KVCache


class CompressionPolicy(Protocol):
  name: str
  block_size: int       # cache slots per block (a multiple of 64 for the GPU kernel)
  budget_blocks: int    # NB: blocks listed per (row, KV head)

  def init(self, cfg, params, state) -> Any: ...

  def view(self, pstate: Any, cache: KVCache) -> BlockListView: ...

  def update(self, pstate: Any, cache: KVCache, queries: Any) -> Any: ...


def check_budget(name: str, block_size: int, budget_blocks: int) -> None:
  if not is_int(block_size) or block_size < 1:
    raise InputError(f"{name}: block_size must be a positive integer, got {block_size!r}")
  if not is_int(budget_blocks) or budget_blocks < 1:
    raise InputError(f"{name}: budget_blocks must be a positive integer, got {budget_blocks!r}")


def check_view(name: str, view: Any, cache: KVCache, num_layers: int) -> None:
  """A policy's view(...) as a method reads it (static: shapes and dtypes, so under jit too): a
  BlockListView whose tables / counts are integer [B, Hkv, NB] / [B, Hkv], or with per_layer
  [L, B, Hkv, NB] / [L, B, Hkv] for the model's L layers (a per-layer list of fewer layers was
  read clamped, the last list for every later layer, silently); or a FullView (no compression).
  `name` names the policy in the errors."""
  if isinstance(view, FullView):
    return
  if not isinstance(view, BlockListView):
    raise InputError(f"{name}.view returned a {type(view).__name__}, not a BlockListView "
                     f"(tables [B, Hkv, NB] and counts [B, Hkv] int32, and block_size)")
  b, hkv = cache.lengths.shape[0], cache.k[0].shape[1]
  lead = (num_layers, b, hkv) if view.per_layer else (b, hkv)
  axes = "[L, B, Hkv" if view.per_layer else "[B, Hkv"
  dims = f"L={num_layers}, B={b}, Hkv={hkv}" if view.per_layer else f"B={b}, Hkv={hkv}"
  for field, suffix in (("tables", ", NB]"), ("counts", "]")):
    x = getattr(view, field)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise InputError(f"{name}.view: BlockListView {field} must be an array, got "
                       f"{type(x).__name__}")
    if x.ndim != len(lead) + (field == "tables") or tuple(x.shape[:len(lead)]) != lead:
      per_layer = ", per_layer=True" if view.per_layer else ""
      raise InputError(f"{name}.view: BlockListView {field} must be {axes}{suffix} ({dims}"
                       f"{per_layer}), got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise InputError(f"{name}.view: BlockListView {field} must be integer (int32), got "
                       f"{x.dtype}")
  if not is_int(view.block_size) or view.block_size < 1:
    raise InputError(f"{name}.view: BlockListView block_size must be a positive integer, got "
                     f"{view.block_size!r}")


def capped_budget(policy, cache: KVCache) -> int:
  """The blocks a policy lists per (row, KV head): its budget_blocks, at most the cache's blocks
  (a larger budget reads the whole cache; its tables are no longer than the cache has blocks)."""
  return min(policy.budget_blocks, -(-cache.k[0].shape[2] // policy.block_size))


def prompt_window_queries(cfg, params, state, window: int):
  """Each layer's queries of the last `window` tokens of every row (the current token last, in
  a row at least as long as the window):
  (queries: tuple per layer of [B, w, Hq, D], positions [B, w] int32, valid [B, w] bool).

  One extra forward at init for query-aware policies (SnapKV's observation window, Quest's first
  selection). A row shorter than the window holds its n tokens first (the current token at n - 1),
  then invalid entries: after the valid ones, so that no valid query attends to them (padding in
  front, the causal in-flight mask let every query attend to the padding too)."""
  from sparsedec.model.forward import forward   # compress <- forward <- attention: no cycle
  # No row holds more tokens than the token buffer: a longer window only adds invalid entries
  # (SnapKV(window=2**40) was accepted and failed at run time; window=4096 ran 4096 queries).
  window = min(window, state.tokens.shape[1])
  n = state.num_tokens                                                      # [B]
  first = jnp.maximum(n - window, 0)                                        # [B]
  idx = first[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]       # [B, w]
  valid = idx < n[:, None]
  tokens = jnp.take_along_axis(state.tokens, jnp.minimum(idx, state.tokens.shape[1] - 1), axis=1)
  cache = state.cache.replace(lengths=first.astype(jnp.int32))
  _, kv = forward(cfg, params, tokens, idx, cache, capture_queries=True,
                  logits_at=jnp.zeros((tokens.shape[0], 1), jnp.int32))
  return kv.q, idx, valid


def pack_tables(first: jax.Array, first_counts: jax.Array, second: jax.Array,
                second_counts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Concatenate two block lists per (.., head) so the valid entries are contiguous:
  first [..., N1] with first_counts [...], second [..., N2] with second_counts [...] ->
  tables [..., N1 + N2], counts [...]."""
  n1, n2 = first.shape[-1], second.shape[-1]
  i = jnp.arange(n1 + n2, dtype=jnp.int32)
  c1 = first_counts[..., None]
  if n1 == 0:
    return second.astype(jnp.int32), second_counts.astype(jnp.int32)
  at = jnp.broadcast_to(jnp.clip(i, 0, n1 - 1), first.shape[:-1] + (n1 + n2,))
  from_first = jnp.take_along_axis(first, at, axis=-1)
  from_second = jnp.take_along_axis(second, jnp.clip(i - c1, 0, n2 - 1), axis=-1)
  tables = jnp.where(i < c1, from_first, from_second)
  return tables.astype(jnp.int32), (first_counts + second_counts).astype(jnp.int32)
