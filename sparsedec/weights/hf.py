"""Hugging Face checkpoints: config.json + model.safetensors (single or sharded) -> params.

Maps HF tensor names onto the params layout of `sparsedec.model.params` (x @ w, fused wqkv and
w_gate_up, per-layer list). HF stores nn.Linear weights as [Out, In]; we transpose to [In, Out].
"""

from __future__ import annotations

import os
import re
from typing import Callable, Mapping

import ml_dtypes  # registers bfloat16 with numpy (safetensors reads it); its dtype is checked below
import numpy as np
from safetensors import safe_open

from sparsedec.errors import CheckpointError, UnsupportedConfigError, read_json
from sparsedec.model.config import ModelConfig
from sparsedec.model.params import Params, check_params
from sparsedec.tokenizer import read_generation_config

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# HF per-layer tensor (after "model.layers.N.") -> (our key, part). Parts of one fused tensor are
# concatenated along the output axis in the order given by FUSED_PARTS.
LAYER_TENSORS = {
    "self_attn.q_proj.weight": ("wqkv", "q"),
    "self_attn.k_proj.weight": ("wqkv", "k"),
    "self_attn.v_proj.weight": ("wqkv", "v"),
    "self_attn.q_proj.bias": ("bqkv", "q"),
    "self_attn.k_proj.bias": ("bqkv", "k"),
    "self_attn.v_proj.bias": ("bqkv", "v"),
    "self_attn.o_proj.weight": ("wo", None),
    "self_attn.o_proj.bias": ("bo", None),
    "self_attn.q_norm.weight": ("q_norm", None),
    "self_attn.k_norm.weight": ("k_norm", None),
    "input_layernorm.weight": ("attn_norm", None),
    "post_attention_layernorm.weight": ("mlp_norm", None),
    "mlp.gate_proj.weight": ("w_gate_up", "gate"),
    "mlp.up_proj.weight": ("w_gate_up", "up"),
    "mlp.down_proj.weight": ("w_down", None),
}
FUSED_PARTS = {"wqkv": ("q", "k", "v"), "bqkv": ("q", "k", "v"), "w_gate_up": ("gate", "up")}
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
_IGNORED_RE = re.compile(r".*rotary_emb\.inv_freq$")


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every HF tensor name `cfg` needs -> its HF shape ([Out, In] for linear weights)."""
  dm, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
  q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, dm), "model.norm.weight": (dm,)}
  if not cfg.tie_word_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, dm)
  per_layer = {
      "self_attn.q_proj.weight": (q, dm),
      "self_attn.k_proj.weight": (kv, dm),
      "self_attn.v_proj.weight": (kv, dm),
      "self_attn.o_proj.weight": (dm, q),
      "input_layernorm.weight": (dm,),
      "post_attention_layernorm.weight": (dm,),
      "mlp.gate_proj.weight": (f, dm),
      "mlp.up_proj.weight": (f, dm),
      "mlp.down_proj.weight": (dm, f),
  }
  if cfg.qkv_bias:
    per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,)})
  if cfg.o_bias:
    per_layer["self_attn.o_proj.bias"] = (dm,)
  if cfg.qk_norm:
    per_layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
  for i in range(cfg.num_layers):
    for name, shape in per_layer.items():
      shapes[f"model.layers.{i}.{name}"] = shape
  return shapes


def params_from_hf_tensors(cfg: ModelConfig, names: list[str],
                           read: Callable[[str], np.ndarray],
                           progress: Callable[[str, int], None] | None = None) -> Params:
  """Assemble params from HF-named tensors. `read(name)` returns the [Out, In] numpy array.

  Checks every name and shape against `cfg`; raises CheckpointError naming the HF tensor.
  Tied checkpoints may still carry an lm_head identical to the embedding: it is dropped.
  progress(name, total) is called after each tensor is read.
  """
  expected = hf_tensor_shapes(cfg)
  present = [n for n in names if not _IGNORED_RE.match(n)]
  tied_head = cfg.tie_word_embeddings and "lm_head.weight" in present
  extra = sorted(set(present) - set(expected) - ({"lm_head.weight"} if tied_head else set()))
  if extra:
    raise CheckpointError(f"unexpected tensor {extra[0]!r} in the checkpoint (not used by a "
                          f"{cfg.family} model with this config); {len(extra)} unexpected in all")
  missing = sorted(set(expected) - set(present), key=_natural_key)
  if missing:
    raise CheckpointError(f"tensor {missing[0]!r} is missing from the checkpoint "
                          f"({len(missing)} missing in all)")
  dtype = np.dtype(ml_dtypes.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(np.float32)

  def get(name: str) -> np.ndarray:
    arr = read(name)
    if tuple(arr.shape) != expected[name]:
      raise CheckpointError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected "
                            f"{expected[name]} for this config")
    if arr.dtype.kind != "f" and arr.dtype != np.dtype(ml_dtypes.bfloat16):
      raise CheckpointError(f"tensor {name!r} has dtype {arr.dtype}, expected a floating-point "
                            "dtype (float32, float16, bfloat16)")
    if progress is not None:
      progress(name, len(expected))
    return np.asarray(arr).astype(dtype)

  embed = get("model.embed_tokens.weight")                                 # [V, Dm]
  if tied_head:
    head = read("lm_head.weight")
    if tuple(head.shape) != embed.shape or not np.array_equal(head.astype(dtype), embed):
      raise CheckpointError("config says tie_word_embeddings=true but tensor 'lm_head.weight' "
                            "differs from 'model.embed_tokens.weight'")
  params: Params = {"embed": embed, "final_norm": get("model.norm.weight")}  # final_norm [Dm]
  if not cfg.tie_word_embeddings:
    params["lm_head"] = np.ascontiguousarray(get("lm_head.weight").T)                         # [Dm, V]
  layers = []
  for i in range(cfg.num_layers):
    parts: dict[str, dict[str, np.ndarray]] = {}
    layer: dict[str, np.ndarray] = {}
    for hf_name, (key, part) in LAYER_TENSORS.items():
      full = f"model.layers.{i}.{hf_name}"
      if full not in expected:
        continue
      arr = get(full)
      arr = np.ascontiguousarray(arr.T) if arr.ndim == 2 else arr                              # [In, Out] or [Out]
      if part is None:
        layer[key] = arr
      else:
        parts.setdefault(key, {})[part] = arr
    for key, pieces in parts.items():
      layer[key] = np.concatenate([pieces[p] for p in FUSED_PARTS[key]], axis=-1)
    layers.append(layer)
  params["layers"] = layers
  check_params(cfg, params)
  return params


def load_hf_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
  """ModelConfig from `path/config.json`; generation_config.json's bos / eos ids (where it has
  them) replace config.json's, as in transformers, whose generate reads that file alone when it
  exists."""
  config_file = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(config_file):
    raise CheckpointError(f"{CONFIG_FILE} not found in HF checkpoint directory {path}")
  try:
    cfg = ModelConfig.from_hf(read_json(config_file), dtype)
  except UnsupportedConfigError as e:
    raise UnsupportedConfigError(f"{config_file}: {e}") from e
  gen = read_generation_config(path)
  eos = _as_ids(gen.get("eos_token_id")) if gen.get("eos_token_id") is not None else None
  bos = gen["bos_token_id"] if gen.get("bos_token_id") is not None else cfg.bos_token_id
  return cfg.replace(eos_token_ids=cfg.eos_token_ids if eos is None else tuple(dict.fromkeys(eos)),
                     bos_token_id=bos)


def _safetensors(file: str):
  """safe_open(file), a file safetensors cannot read (truncated, not safetensors) raising a
  CheckpointError that names it."""
  try:
    return safe_open(file, framework="numpy")
  except Exception as e:                  # safetensors raises its own SafetensorError
    raise CheckpointError(f"cannot read {file}: {e}") from e


def safetensors_files(path: str | os.PathLike) -> dict[str, str]:
  """HF tensor name -> the safetensors file holding it (single file or sharded index; the single
  file where both are present, as transformers' from_pretrained does)."""
  index_file = os.path.join(path, INDEX_FILE)
  single = os.path.join(path, SINGLE_FILE)
  if os.path.isfile(single):
    with _safetensors(single) as f:
      return {name: single for name in f.keys()}
  if os.path.isfile(index_file):
    index = read_json(index_file)
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if not isinstance(weight_map, Mapping) or not all(
        isinstance(shard, str) for shard in weight_map.values()):
      raise CheckpointError(f"{index_file} has no 'weight_map' (an object of tensor name -> "
                            "shard file name)")
    for shard in sorted(set(weight_map.values())):
      if not os.path.isfile(os.path.join(path, shard)):
        raise CheckpointError(f"shard file {shard} listed in {INDEX_FILE} is missing from {path}")
    return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
  raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in HF checkpoint directory {path}")


def load_hf(path: str | os.PathLike, dtype: str | None = None,
            progress: Callable[[str, int], None] | None = None) -> tuple[ModelConfig, Params]:
  """Load an HF checkpoint directory into (ModelConfig, params) as numpy arrays.

  dtype: "float32" | "bfloat16" | None (None: from config.json's dtype/torch_dtype: bfloat16 for
  "bfloat16" and "float16", whose weights are then rounded to bfloat16, else float32).
  progress: optional callback (HF tensor name, number of tensors) called after each read.
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(f"HF checkpoint directory not found: {path}")
  cfg = load_hf_config(path, dtype)
  files = safetensors_files(path)
  with _Readers(files) as read:
    for name in files:
      read.check_listed(name)
    params = params_from_hf_tensors(cfg, list(files), read, progress)
  return cfg, params


class _Readers:
  """Open safetensors files lazily; `self(name)` reads one tensor as numpy."""

  def __init__(self, files: Mapping[str, str]):
    self._files = files
    self._open: dict[str, object] = {}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for handle in self._open.values():
      handle.__exit__(None, None, None)
    self._open.clear()

  def _handle(self, file: str):
    if file not in self._open:
      handle = _safetensors(file)
      self._open[file] = handle.__enter__()
    return self._open[file]

  def check_listed(self, name: str) -> None:
    file = self._files[name]
    if name not in self._handle(file).keys():
      raise CheckpointError(f"tensor {name!r} is listed in {INDEX_FILE} for "
                            f"{os.path.basename(file)} but that file does not hold it")

  def __call__(self, name: str) -> np.ndarray:
    file = self._files[name]
    try:
      return self._handle(file).get_tensor(name)
    except CheckpointError:
      raise
    except Exception as e:                # a truncated file fails here, not at open
      raise CheckpointError(f"cannot read tensor {name} from {file}: {e}") from e


def _as_ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    return tuple(int(v) for v in value)
  return (int(value),)


def _natural_key(name: str) -> list:
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
