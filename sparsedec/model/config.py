"""Model configuration: a frozen, hashable description of a decoder (static under jit).

`ModelConfig.from_hf(dict)` reads a Hugging Face `config.json` (transformers 4.x layout with
`rope_theta`/`rope_scaling`, or 5.x with `rope_parameters`) and refuses, naming the attribute,
anything the forward pass would not honour.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: np.dtype(jnp.bfloat16))
import numpy as np

from sparsedec.errors import UnsupportedConfigError, read_json

# HF architecture name -> our family name. The family decides which optional parts exist.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
FAMILIES = frozenset(ARCHITECTURES.values())
DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("auto", "reference", "pallas", "interpret")


ROPE_SCALING_KINDS = ("llama3", "linear", "freq_factors")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling. `kind` is "llama3" (Llama 3.1/3.2), "linear", or "freq_factors":
  each inverse frequency divided by its own factor, `freq_factors` [D/2] (what llama.cpp's GGUF
  converter stores as the `rope_freqs.weight` tensor for llama3 scaling; `factor` unused)."""

  kind: str
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  freq_factors: tuple[float, ...] = ()

  def __post_init__(self):
    if self.kind not in ROPE_SCALING_KINDS:
      raise UnsupportedConfigError(
          f"rope_scaling type {self.kind!r} is not supported (supported: "
          f"{', '.join(ROPE_SCALING_KINDS)})")
    object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))
    if (self.kind == "freq_factors") != bool(self.freq_factors):
      raise UnsupportedConfigError(
          "rope_scaling freq_factors are given with kind 'freq_factors' and only then, got kind "
          f"{self.kind!r} with {len(self.freq_factors)} factors")
    if not all(math.isfinite(f) and f > 0 for f in self.freq_factors):
      raise UnsupportedConfigError("rope_scaling freq_factors must be finite and > 0, got "
                                   f"{self.freq_factors}")
    if not (math.isfinite(self.factor) and self.factor > 0):     # NaN passed `<= 0`
      raise UnsupportedConfigError(f"rope_scaling factor must be finite and > 0, got "
                                   f"{self.factor}")
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise UnsupportedConfigError(
          "rope_scaling llama3 needs high_freq_factor > low_freq_factor, got "
          f"{self.high_freq_factor} and {self.low_freq_factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder. Frozen and hashable: pass it as a static jit argument."""

  family: str                      # llama | mistral | qwen2 | qwen3
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int                   # query heads (Hq)
  num_kv_heads: int                # key/value heads (Hkv); Hq % Hkv == 0 (GQA)
  head_dim: int                    # D
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  qkv_bias: bool = False           # bias on q/k/v projections (Qwen2; Llama attention_bias)
  o_bias: bool = False             # bias on the output projection (Llama attention_bias)
  qk_norm: bool = False            # per-head RMSNorm of q and k before RoPE (Qwen3)
  sliding_window: int | None = None  # keys with q_pos - k_pos >= window are not attended
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  dtype: str = "float32"           # parameter and activation dtype; softmax/norms in fp32 (a
                                   # numpy / jax dtype, e.g. jnp.bfloat16, is stored by name)
  # How `sparsedec.attention.attend` computes attention (a runtime choice, not part of the model:
  # not saved with checkpoints). "auto": the Pallas kernels where a call is lowered for a CUDA
  # GPU and they apply, the jnp reference elsewhere; "reference": always jnp; "pallas": always
  # the kernels (an error where they do not apply); "interpret": the kernels in the Mosaic GPU
  # interpreter (CPU tests).
  attention: str = "auto"

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise UnsupportedConfigError(
          f"model family {self.family!r} is not supported (supported: {sorted(FAMILIES)})")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise UnsupportedConfigError(f"{name} must be a positive integer, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise UnsupportedConfigError(
          f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
          f"({self.num_kv_heads})")
    if self.head_dim % 2:
      raise UnsupportedConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
    factors = self.rope_scaling.freq_factors if self.rope_scaling is not None else ()
    if factors and len(factors) != self.head_dim // 2:
      raise UnsupportedConfigError(f"rope_scaling has {len(factors)} freq_factors, head_dim "
                                   f"{self.head_dim} needs {self.head_dim // 2}")
    if self.dtype is not None and not isinstance(self.dtype, str):
      # A numpy / jax dtype or scalar type (jnp.bfloat16) is stored as its name: a dtype object
      # equals the name, so it passed the check below, and a checkpoint save then failed on
      # 'Object of type dtype[bfloat16] is not JSON serializable'.
      try:
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
      except TypeError:
        pass
    if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
      raise UnsupportedConfigError(f"dtype {self.dtype!r} is not supported (supported: {DTYPES})")
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise UnsupportedConfigError(f"sliding_window must be > 0, got {self.sliding_window}")
    if self.attention not in ATTENTION_IMPLS:
      raise UnsupportedConfigError(
          f"attention {self.attention!r} is not one of {ATTENTION_IMPLS}")
    # theta ** (2i / D) of a theta <= 0 or NaN made the RoPE tables inf/NaN: NaN logits, no error.
    if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
      raise UnsupportedConfigError(f"rope_theta must be finite and > 0, got {self.rope_theta}")
    if self.rms_norm_eps <= 0:
      raise UnsupportedConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")

  @property
  def q_per_kv(self) -> int:
    """Query heads sharing one KV head (G)."""
    return self.num_heads // self.num_kv_heads

  @property
  def qkv_size(self) -> int:
    """Output width of the fused q/k/v projection: (Hq + 2 Hkv) * D."""
    return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  # ----------------------------------------------------------------------------- (de)serialise
  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["eos_token_ids"] = list(self.eos_token_ids)
    del d["attention"]               # a runtime choice, not part of the saved model
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    d = dict(d)
    if d.get("rope_scaling") is not None:
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise UnsupportedConfigError(f"unknown sparsedec config fields: {sorted(unknown)}")
    return cls(**d)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], dtype: str | None = None) -> "ModelConfig":
    """Build from a Hugging Face config dict, refusing what the forward does not implement."""
    if not isinstance(hf, Mapping):
      raise UnsupportedConfigError(
          f"the model config is not a JSON object (got a {type(hf).__name__})")
    try:
      return _from_hf(hf, dtype)
    except KeyError as e:
      raise UnsupportedConfigError(f"the model config has no {e.args[0]!r} (a required "
                                   f"attribute of a Llama-family config)") from None

  @classmethod
  def from_hf_file(cls, path: str | os.PathLike, dtype: str | None = None) -> "ModelConfig":
    if not os.path.isfile(path):
      raise UnsupportedConfigError(f"config file not found: {path}")
    try:
      return cls.from_hf(read_json(path, UnsupportedConfigError), dtype)
    except UnsupportedConfigError as e:
      raise UnsupportedConfigError(f"{path}: {e}") from e


def _number(key: str, value: Any, kind: type = int):
  """`value` (config attribute `key`) as `kind`; a value that is no number (null, a string)
  raises an UnsupportedConfigError naming `key`, not a bare TypeError/ValueError."""
  if kind is int and (isinstance(value, bool) or (
      isinstance(value, float) and not value.is_integer())):
    # int() truncated them: hidden_size 16.5 became 16, eos_token_id 2.5 became 2, true 1.
    raise UnsupportedConfigError(f"{key} must be an integer, got {value!r}")
  try:
    return kind(value)
  except (TypeError, ValueError):
    raise UnsupportedConfigError(f"{key} must be a number, got {value!r}") from None


def _family(hf: Mapping[str, Any]) -> str:
  archs = hf.get("architectures") or []
  for arch in archs:
    if arch in ARCHITECTURES:
      return ARCHITECTURES[arch]
  if archs:
    raise UnsupportedConfigError(
        f"unsupported architecture {archs[0]!r} (supported: {sorted(ARCHITECTURES)})")
  model_type = hf.get("model_type")
  if model_type in FAMILIES:
    return model_type
  raise UnsupportedConfigError(
      f"unsupported model_type {model_type!r} (supported: {sorted(FAMILIES)})")


# The keys transformers requires in a rope_scaling / rope_parameters of each type we implement
# (original_max_position_embeddings, which 5.x defaults to max_position_embeddings, is not).
ROPE_REQUIRED_KEYS = {"linear": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  # transformers >= 5 keeps theta and scaling together in `rope_parameters`. A config that has
  # both takes `rope_scaling` (theta beside it, not rope_parameters') as transformers 4.x (which
  # knows no rope_parameters) and 5.x (`rope_scaling or rope_parameters`) both do.
  params = None if hf.get("rope_scaling") else hf.get("rope_parameters")
  if isinstance(params, Mapping) and params and not all(
      isinstance(v, Mapping) for v in params.values()):
    theta = _number("rope_theta", params.get("rope_theta", hf.get("rope_theta", 10000.0)),
                    float)
    scaling = params
  elif isinstance(params, Mapping) and params:
    raise UnsupportedConfigError(
        f"per-layer-type rope_parameters {sorted(params)} are not supported")
  elif params is not None and not isinstance(params, Mapping):
    raise UnsupportedConfigError(f"rope_parameters must be a JSON object, got {params!r}")
  else:
    theta = _number("rope_theta", hf.get("rope_theta", 10000.0), float)
    scaling = hf.get("rope_scaling")
  # transformers 5 moves a top-level partial_rotary_factor into rope_parameters and reads it
  # from there (a factor < 1 rotates only part of each head): refused wherever it is.
  for where, holder in (("", hf), ("rope_parameters / rope_scaling ", scaling)):
    factor = holder.get("partial_rotary_factor", 1.0) if isinstance(holder, Mapping) else 1.0
    if factor not in (None, 1.0):
      raise UnsupportedConfigError(
          f"{where}partial_rotary_factor={factor} is not supported (only 1.0)")
  if not scaling:
    return theta, None
  if not isinstance(scaling, Mapping):
    raise UnsupportedConfigError(f"rope_scaling must be a JSON object, got {scaling!r}")
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return theta, None
  # transformers (5.24's validate_rope) refuses a scaling without these keys; low_freq_factor /
  # high_freq_factor were taken as Llama 3.1's 1.0 / 4.0, loading a model transformers refuses.
  missing = sorted(set(ROPE_REQUIRED_KEYS.get(kind, ())) - set(scaling))
  if missing:
    raise UnsupportedConfigError(
        f"rope_scaling / rope_parameters of rope_type {kind!r} has no {', '.join(missing)} "
        f"(required: {', '.join(ROPE_REQUIRED_KEYS[kind])}; transformers refuses it too)")
  if kind == "linear":
    return theta, RopeScaling("linear", _number("rope_scaling factor", scaling["factor"], float))
  if kind == "llama3":
    return theta, RopeScaling(
        "llama3",
        _number("rope_scaling factor", scaling["factor"], float),
        _number("rope_scaling low_freq_factor", scaling["low_freq_factor"], float),
        _number("rope_scaling high_freq_factor", scaling["high_freq_factor"], float),
        # transformers (>= 5) falls back to max_position_embeddings (the family's default
        # where absent: _from_hf has filled it in), as here.
        _number("rope_scaling original_max_position_embeddings",
                scaling["original_max_position_embeddings"])
        if "original_max_position_embeddings" in scaling else
        _number("max_position_embeddings", hf["max_position_embeddings"]),
    )
  raise UnsupportedConfigError(
      f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def _sliding_window(family: str, hf: Mapping[str, Any]) -> int | None:
  window = hf.get("sliding_window")
  layer_types = hf.get("layer_types")
  if family in ("qwen2", "qwen3"):
    if hf.get("use_sliding_window", False):
      # transformers' Qwen: the window (4096 unless given; null: none) on the layers from
      # max_window_layers (default 28) on, or on those layer_types names "sliding_attention".
      # One window on every layer, or on none, is a plain config; a mix is refused.
      window = hf.get("sliding_window", 4096)
      if not window:
        return None
      if not layer_types:
        first = _number("max_window_layers", hf.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(_number("num_hidden_layers", hf["num_hidden_layers"]))]
      if all(t == "full_attention" for t in layer_types):
        return None
      if all(t == "sliding_attention" for t in layer_types):
        return _number("sliding_window", window)
      raise UnsupportedConfigError(
          f"use_sliding_window=true with a window on some layers only (layer_types "
          f"{list(layer_types)}, from max_window_layers={hf.get('max_window_layers', 28)} when "
          f"not given) is not supported for Qwen models (per-layer windows)")
    if layer_types and any(t != "full_attention" for t in layer_types):
      raise UnsupportedConfigError(f"layer_types {sorted(set(layer_types))} is not supported")
    return None
  if family == "mistral":
    if layer_types and len(set(layer_types)) > 1:
      raise UnsupportedConfigError(
          f"mixed layer_types {sorted(set(layer_types))} are not supported")
    window = hf.get("sliding_window", 4096)     # transformers' MistralConfig default
    return _number("sliding_window", window) if window else None
  if window:
    raise UnsupportedConfigError(
        f"sliding_window={window} is not supported for {family}: transformers' {family} "
        f"attends to the full prompt but keeps only the last {window} - 1 tokens when "
        f"generating, which no consistent attention reproduces (remove the key for full "
        f"attention)")
  return None


def _check_unsupported(hf: Mapping[str, Any]) -> None:
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):     # transformers' ACT2FN: "swish" is SiLU too
    raise UnsupportedConfigError(f"hidden_act {act!r} is not supported (only silu / swish)")
  if hf.get("mlp_bias", False):
    raise UnsupportedConfigError("mlp_bias=true is not supported")
  for key in ("attn_logit_softcapping", "final_logit_softcapping", "num_experts",
              "num_local_experts", "quantization_config", "head_scale"):
    if hf.get(key) not in (None, 0, False):
      raise UnsupportedConfigError(f"{key}={hf[key]!r} is not supported")


# What transformers' config class of each family (4.x and 5.x) gives an attribute config.json
# leaves out. Absent only: a null num_key_value_heads means num_attention_heads in all four.
ABSENT_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
                "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
}


def _from_hf(hf: Mapping[str, Any], dtype: str | None) -> ModelConfig:
  family = _family(hf)
  absent = {k: v for k, v in ABSENT_DEFAULTS[family].items() if k not in hf}
  hf = {**hf, **absent}
  _check_unsupported(hf)
  theta, scaling = _rope(hf)
  num_heads = _number("num_attention_heads", hf["num_attention_heads"])
  hidden = _number("hidden_size", hf["hidden_size"])
  if num_heads <= 0:
    raise UnsupportedConfigError(f"num_attention_heads must be a positive integer, got {num_heads}")
  if "num_key_value_heads" in absent and num_heads % absent["num_key_value_heads"]:
    raise UnsupportedConfigError(
        f"the config has no num_key_value_heads, which for {family} means transformers' default "
        f"of {absent['num_key_value_heads']}: not a divisor of num_attention_heads ({num_heads}) "
        f"(add num_key_value_heads to the config)")
  # Qwen3Config defaults head_dim to 128 (transformers 4.x and 5.x); the others derive it.
  head_dim = hf.get("head_dim", 128 if family == "qwen3" else None)
  head_dim = hidden // num_heads if head_dim is None else head_dim    # 0 is refused, not derived
  attention_bias = bool(hf.get("attention_bias", False))
  if family == "qwen2":
    qkv_bias, o_bias = True, False   # Qwen2 always has q/k/v bias, never o bias
  elif family == "mistral":
    qkv_bias = o_bias = False
  else:
    qkv_bias = o_bias = attention_bias
  eos, bos = hf.get("eos_token_id"), hf.get("bos_token_id")
  eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
  if dtype is None:
    src = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = "bfloat16" if src in ("bfloat16", "float16") else "float32"
  return ModelConfig(
      family=family,
      vocab_size=_number("vocab_size", hf["vocab_size"]),
      hidden_size=hidden,
      intermediate_size=_number("intermediate_size", hf["intermediate_size"]),
      num_layers=_number("num_hidden_layers", hf["num_hidden_layers"]),
      num_heads=num_heads,
      num_kv_heads=_number("num_key_value_heads", num_heads if hf.get("num_key_value_heads") is None
                           else hf["num_key_value_heads"]),              # 0 is refused, not MHA
      head_dim=_number("head_dim", head_dim),
      rms_norm_eps=_number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6), float),
      rope_theta=theta,
      rope_scaling=scaling,
      max_position_embeddings=_number("max_position_embeddings",
                                      hf.get("max_position_embeddings", 2048)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=qkv_bias,
      o_bias=o_bias,
      qk_norm=family == "qwen3",
      sliding_window=_sliding_window(family, hf),
      bos_token_id=None if bos is None else _number("bos_token_id", bos),
      eos_token_ids=tuple(_number("eos_token_id", e) for e in eos_ids),
      dtype=dtype,
  )
