"""The params pytree: layout, shapes, random init and shape checks.

Layout (x @ w convention, per-layer arrays in a list so the forward unrolls over layers;
q/k/v and gate/up are fused so a decode step launches fewer, larger matmuls):

  embed       [V, Dm]
  final_norm  [Dm]
  lm_head     [Dm, V]            absent when cfg.tie_word_embeddings
  layers[i]:
    attn_norm [Dm]
    wqkv      [Dm, (Hq + 2 Hkv) D]   columns: q heads, then k heads, then v heads
    bqkv      [(Hq + 2 Hkv) D]       when cfg.qkv_bias
    q_norm    [D], k_norm [D]        when cfg.qk_norm
    wo        [Hq D, Dm]
    bo        [Dm]                   when cfg.o_bias
    mlp_norm  [Dm]
    w_gate_up [Dm, 2 F]              columns: gate, then up
    w_down    [F, Dm]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsedec.errors import CheckpointError, InputError
from sparsedec.model.config import DTYPES, ModelConfig

Params = dict[str, Any]


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  dm, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
  shapes = {
      "attn_norm": (dm,),
      "wqkv": (dm, cfg.qkv_size),
      "wo": (cfg.num_heads * d, dm),
      "mlp_norm": (dm,),
      "w_gate_up": (dm, 2 * f),
      "w_down": (f, dm),
  }
  if cfg.qkv_bias:
    shapes["bqkv"] = (cfg.qkv_size,)
  if cfg.qk_norm:
    shapes["q_norm"] = (d,)
    shapes["k_norm"] = (d,)
  if cfg.o_bias:
    shapes["bo"] = (dm,)
  return shapes


def param_shapes(cfg: ModelConfig) -> Params:
  """The pytree of shapes (tuples) every params pytree for `cfg` must have."""
  shapes: Params = {
      "embed": (cfg.vocab_size, cfg.hidden_size),
      "final_norm": (cfg.hidden_size,),
      "layers": [layer_shapes(cfg) for _ in range(cfg.num_layers)],
  }
  if not cfg.tie_word_embeddings:
    shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
  return shapes


def abstract_params(cfg: ModelConfig) -> Params:
  """ShapeDtypeStructs of the params (restore targets, eval_shape)."""
  dtype = jnp.dtype(cfg.dtype)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(cfg),
                      is_leaf=lambda x: isinstance(x, tuple))


def check_params(cfg: ModelConfig, params: Params) -> None:
  """Raise CheckpointError naming the first missing, extra or wrongly shaped tensor."""
  expected = param_shapes(cfg)

  def walk(exp, got, path):
    if isinstance(exp, tuple):
      shape = tuple(getattr(got, "shape", ()))
      if shape != exp:
        raise CheckpointError(f"tensor {path} has shape {shape}, expected {exp}")
      return
    if isinstance(exp, list):
      if not isinstance(got, (list, tuple)) or len(got) != len(exp):
        n = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
        raise CheckpointError(f"{path}: expected {len(exp)} layers, got {n}")
      for i, (e, g) in enumerate(zip(exp, got)):
        walk(e, g, f"{path}[{i}]")
      return
    if not isinstance(got, dict):
      raise CheckpointError(f"{path}: expected a dict of tensors, got {type(got).__name__}")
    missing = sorted(set(exp) - set(got))
    extra = sorted(set(got) - set(exp))

    def name(k: str) -> str:                         # top-level keys without a leading dot
      return f"{path}.{k}" if path else k

    if missing:
      raise CheckpointError(f"missing tensor {name(missing[0])} (expected shape "
                            f"{exp[missing[0]]})" if not isinstance(exp[missing[0]], list) else
                            f"missing {name(missing[0])}")
    if extra:
      raise CheckpointError(f"unexpected tensor {name(extra[0])} for this config")
    for k in exp:
      walk(exp[k], got[k], name(k))

  walk(expected, params, "")


def check_params_dtype(cfg: ModelConfig, params: Params, what: str = "params") -> None:
  """Raise InputError naming the first parameter array whose dtype is not cfg.dtype.

  The forward computes and caches in cfg.dtype: float32 params under a bfloat16 config ran in
  bf16 silently (each step casting them again, reading twice the bytes), bfloat16 params under
  a float32 config ran fp32 on bf16-rounded weights. Arrays only: 4-bit linears (QuantWeight:
  their own codes and fp16 scales) are not checked, and a QuantSpec draft the params carry
  (`gptq.with_draft`) is for the caller to leave out (`gptq.without_draft`)."""
  want = jnp.dtype(cfg.dtype)
  if all(getattr(x, "dtype", want) == want for x in jax.tree.leaves(params)):
    return                   # the common case, without the paths (Run.advance calls this)
  leaves, _ = jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))
  for path, x in leaves:
    if isinstance(x, (jax.Array, np.ndarray)) and jnp.dtype(x.dtype) != want:
      name = jax.tree_util.keystr(path, simple=True, separator=".")
      got = jnp.dtype(x.dtype).name
      theirs = (f", or run a config of theirs (cfg.replace(dtype={got!r}))" if got in DTYPES
                else "")
      raise InputError(
          f"{what}: tensor {name} is {got}, the config's dtype is {cfg.dtype}: cast the params "
          f"(sparsedec.model.params.cast_params(params, {cfg.dtype!r})) or load them in that "
          f"dtype (load_model(path, dtype={cfg.dtype!r})){theirs}")


def init_random(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
  """Random params (normal * scale, norms at 1). For tests and benchmarks at real shapes."""
  shapes = param_shapes(cfg)
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
  keys = jax.random.split(key, len(leaves))
  dtype = jnp.dtype(cfg.dtype)
  out = []
  for path, shape, k in zip(paths, leaves, keys):
    if "norm" in path:
      out.append(1.0 + 0.1 * jax.random.normal(k, shape, dtype))
    else:
      out.append(scale * jax.random.normal(k, shape, dtype))
  return jax.tree.unflatten(treedef, out)


def cast_params(params: Params, dtype: str) -> Params:
  dt = jnp.dtype(dtype)
  return jax.tree.map(lambda x: jnp.asarray(x, dt), params)


def num_bytes(params: Params) -> int:
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))
