"""GGUF files -> (ModelConfig, params, Tokenizer), through the `gguf` package.

The metadata is turned into an HF-like config dict and goes through `ModelConfig.from_hf`, so an
unsupported model is refused the same way as an HF checkpoint. Tensors are dequantized with
`gguf.quants.dequantize`, renamed to HF names and assembled by `weights.hf`; llama-architecture
files store q/k rows in interleaved RoPE order, which is undone here. Llama-3.1/3.2 files carry
their llama3 RoPE scaling as the `rope_freqs.weight` tensor (per-frequency factors), which
becomes the config's `RopeScaling("freq_factors")`.

The tokenizer is rebuilt from `tokenizer.ggml.*` the way transformers builds it when it loads
the same file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`).
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from sparsedec.errors import CheckpointError, UnsupportedConfigError
from sparsedec.model.config import ModelConfig, RopeScaling
from sparsedec.model.params import Params
from sparsedec.tokenizer import Tokenizer
from sparsedec.weights.hf import params_from_hf_tensors

# general.architecture -> HF architectures entry. GGUF "llama" also covers Mistral-style files.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# Architectures whose q/k rows are stored in llama.cpp's interleaved RoPE order.
PERMUTED_QK = frozenset({"llama"})

# GGUF tensor name -> HF tensor name.
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")

# The ids llama.cpp ends generation on (its special_eog_ids; eot/eom: Llama 3.1's <|eot_id|>,
# <|eom_id|>): the GGUF counterpart of generation_config.json's eos_token_id list.
END_OF_GENERATION_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                          "tokenizer.ggml.eom_token_id")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> the split regex its BPE merges were learned with. Other pre-tokenizer
# names fall back to GPT-2's ByteLevel regex, as transformers does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                        "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
                        "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


# --------------------------------------------------------------------------------- metadata
def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
  """Every metadata field as a Python value (strings, numbers, lists)."""
  return {name: field.contents() for name, field in reader.fields.items()
          if not name.startswith("GGUF.")}


def end_of_generation_ids(meta: dict[str, Any]) -> list[int]:
  """The eos, eot and eom token ids the metadata has, in that order, each once."""
  return list(dict.fromkeys(int(meta[k]) for k in END_OF_GENERATION_KEYS
                            if meta.get(k) is not None))


def hf_config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
  """An HF config.json-like dict from GGUF metadata; refuses unknown architectures."""
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise UnsupportedConfigError(
        f"GGUF general.architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})")

  def key(name: str, default: Any = None, required: bool = False) -> Any:
    full = f"{arch}.{name}"
    if full not in meta:
      if required:
        raise CheckpointError(f"GGUF metadata {full!r} is missing")
      return default
    return meta[full]

  def int_key(name: str, default: Any = None, required: bool = False) -> Any:
    """An integer field; a per-layer list (some converters write head counts so) is taken only
    when every layer has the same value."""
    value = key(name, default, required)
    if isinstance(value, (list, tuple)):
      if not value or len(set(value)) != 1:
        raise UnsupportedConfigError(
            f"GGUF metadata '{arch}.{name}' differs between layers ({list(value)}): only "
            f"models whose layers all have the same shape are supported")
      value = value[0]
    return None if value is None else int(value)

  tokens = meta.get("tokenizer.ggml.tokens")
  vocab_size = key("vocab_size", len(tokens) if tokens else None)
  if vocab_size is None:
    raise CheckpointError("GGUF has neither a vocab_size nor a tokenizer.ggml.tokens list")
  hidden = int_key("embedding_length", required=True)
  num_heads = int_key("attention.head_count", required=True)
  if num_heads < 1:
    raise CheckpointError(f"GGUF metadata '{arch}.attention.head_count' is {num_heads}: a model "
                          f"needs at least one attention head")
  head_dim = int_key("attention.key_length", hidden // num_heads)
  hf: dict[str, Any] = {
      "architectures": [ARCHITECTURES[arch]],
      "model_type": arch,
      "vocab_size": int(vocab_size),
      "hidden_size": hidden,
      "intermediate_size": int_key("feed_forward_length", required=True),
      "num_hidden_layers": int_key("block_count", required=True),
      "num_attention_heads": num_heads,
      "num_key_value_heads": int_key("attention.head_count_kv", num_heads),
      "head_dim": head_dim,
      "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
      "rope_theta": float(key("rope.freq_base", 10000.0)),
      "max_position_embeddings": int_key("context_length", 2048),
      "tie_word_embeddings": "output.weight" not in tensor_names,
      "attention_bias": "blk.0.attn_output.bias" in tensor_names,
      "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": end_of_generation_ids(meta),
  }
  if key("attention.value_length", head_dim) != head_dim:
    raise UnsupportedConfigError(f"{arch}.attention.value_length {key('attention.value_length')} "
                                 f"!= key_length {head_dim} is not supported")
  # The refusals below name the GGUF keys: through from_hf they named HF attributes the file has
  # not (partial_rotary_factor, num_experts, rope_scaling) and told to edit a config.json.
  rope_dims = key("rope.dimension_count", head_dim)
  if rope_dims != head_dim:
    raise UnsupportedConfigError(f"GGUF metadata '{arch}.rope.dimension_count' {rope_dims} != "
                                 f"head dim {head_dim}: partial RoPE is not supported")
  scaling = key("rope.scaling.type", "none")
  if scaling not in ("none", None, "linear"):
    raise UnsupportedConfigError(f"GGUF metadata '{arch}.rope.scaling.type' {scaling!r} is not "
                                 f"supported (supported: none, linear)")
  if scaling == "linear":
    hf["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor", 1.0)}
  if ROPE_FREQS in tensor_names and "rope_scaling" in hf:
    raise UnsupportedConfigError(f"GGUF has both {arch}.rope.scaling.type {scaling!r} and a "
                                 f"{ROPE_FREQS!r} tensor: one RoPE scaling is supported")
  # Qwen's is left aside, as before (HF reads a Qwen sliding_window only with use_sliding_window).
  if arch == "llama" and key("attention.sliding_window"):
    raise UnsupportedConfigError(f"GGUF metadata '{arch}.attention.sliding_window' "
                                 f"({key('attention.sliding_window')}) is not supported")
  if key("expert_count"):
    raise UnsupportedConfigError(f"GGUF metadata '{arch}.expert_count' ({key('expert_count')}): "
                                 f"mixture-of-experts models are not supported")
  return hf


# ---------------------------------------------------------------------------------- tensors
# llama.cpp's converter writes llama3 RoPE scaling as this tensor of per-frequency factors [D/2]
# (theta_i / factor_i): read into the config (`RopeScaling("freq_factors")`), not a parameter.
ROPE_FREQS = "rope_freqs.weight"


def hf_tensor_name(gguf_name: str) -> str:
  if gguf_name in GLOBAL_NAMES:
    return GLOBAL_NAMES[gguf_name]
  m = _BLOCK_RE.fullmatch(gguf_name)
  if m and m.group(2) in LAYER_NAMES:
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
  raise CheckpointError(f"GGUF tensor {gguf_name!r} is not supported (unknown name)")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's interleaved q/k row order -> HF's half-split order. w: [n_heads * D, In]
  (a weight) or [n_heads * D] (a bias)."""
  d_out = w.shape[0]
  head_dim = d_out // n_heads
  rest = w.shape[1:]
  return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(d_out, *rest)


def _reader(path: str) -> "gguf.GGUFReader":
  """gguf.GGUFReader(path); a file it cannot parse (truncated, corrupt) raises a CheckpointError
  naming it."""
  try:
    return gguf.GGUFReader(path)
  except (ValueError, IndexError, KeyError, OSError) as e:
    raise CheckpointError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


def _dequantize(tensor, path: str) -> np.ndarray:
  """The tensor's values as float32 (flat GGUF order); a type `gguf.quants.dequantize` has no
  code for (F64, I8..I64, Q8_1, Q8_K) raises an UnsupportedConfigError naming the tensor."""
  try:
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
  except NotImplementedError:
    raise UnsupportedConfigError(f"{path}: GGUF tensor {tensor.name!r} has type "
                                 f"{tensor.tensor_type.name}, which cannot be dequantized "
                                 f"(not a float or block-quantized type)") from None


def _with_rope_freqs(cfg: ModelConfig, tensor, path: str) -> ModelConfig:
  """cfg with the `rope_freqs.weight` tensor as its "freq_factors" RopeScaling; factors that are
  not D/2 finite positive numbers are refused, naming the file and the tensor."""
  factors = _dequantize(tensor, path).reshape(-1)
  try:
    return cfg.replace(rope_scaling=RopeScaling("freq_factors",
                                                freq_factors=tuple(factors.tolist())))
  except UnsupportedConfigError as e:
    raise UnsupportedConfigError(f"{path}: tensor {ROPE_FREQS!r}: {e}") from e


def load_gguf(path: str | os.PathLike, dtype: str | None = None,
              progress: Callable[[str, int], None] | None = None
              ) -> tuple[ModelConfig, Params, Tokenizer]:
  """Load a GGUF file into (ModelConfig, params as numpy, Tokenizer). dtype default float32."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise CheckpointError(f"GGUF file not found: {path}")
  reader = _reader(path)
  meta = read_metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  try:                                    # the errors name the file, as config.json's do
    hf = hf_config_from_metadata(meta, set(tensors))
    cfg = ModelConfig.from_hf(hf, dtype or "float32")
  except (CheckpointError, UnsupportedConfigError) as e:
    raise type(e)(f"{path}: {e}") from e
  if ROPE_FREQS in tensors:
    cfg = _with_rope_freqs(cfg, tensors[ROPE_FREQS], path)
  hf_names = {hf_tensor_name(name): name for name in tensors if name != ROPE_FREQS}
  arch = meta["general.architecture"]

  def read(hf_name: str) -> np.ndarray:
    tensor = tensors[hf_names[hf_name]]
    w = _dequantize(tensor, path)                                     # numpy order: [Out, In]
    w = w.reshape(tuple(int(n) for n in reversed(tensor.shape)))
    # llama.cpp's converter permutes the q/k biases' rows along with the weights' rows. Rows of
    # the wrong count are left as they are, for the shape check to name the tensor.
    if (arch in PERMUTED_QK and hf_name.endswith(("q_proj.weight", "q_proj.bias"))
        and w.shape[0] == cfg.num_heads * cfg.head_dim):
      w = unpermute_rope_rows(w, cfg.num_heads)
    elif (arch in PERMUTED_QK and hf_name.endswith(("k_proj.weight", "k_proj.bias"))
          and w.shape[0] == cfg.num_kv_heads * cfg.head_dim):
      w = unpermute_rope_rows(w, cfg.num_kv_heads)
    return w

  params = params_from_hf_tensors(cfg, list(hf_names), read, progress)
  return cfg, params, tokenizer_from_metadata(meta)


# Block-quantized GGUF types whose blocks 4-bit round-to-nearest reproduces exactly
# (`quant_weights.quantize_weight`): (weight group in input rows, grid).
EXACT_4BIT_GRIDS = {gguf.GGMLQuantizationType.Q4_1: (32, "minmax"),
                    gguf.GGMLQuantizationType.Q4_0: (32, "absmax")}
_LINEAR_TENSOR = re.compile(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight")


def exact_4bit_grid(path: str | os.PathLike) -> tuple[int, str] | None:
  """(weight group, grid) at which 4-bit round-to-nearest reproduces every linear layer of this
  GGUF file exactly ((32, "minmax") when they are all Q4_1, (32, "absmax") when all Q4_0: a draft
  with the checkpoint's own weights), or None (mixed or other types). Reads the tensor table
  only."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise CheckpointError(f"GGUF file not found: {path}")
  types = {t.tensor_type for t in _reader(path).tensors if _LINEAR_TENSOR.fullmatch(t.name)}
  if len(types) != 1:
    return None
  return EXACT_4BIT_GRIDS.get(types.pop())


# -------------------------------------------------------------------------------- tokenizer
def _byte_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def _byte_level_backend(meta: dict[str, Any]) -> tuple[BackendTokenizer, set[str]]:
  table = _byte_alphabet()
  alphabet = set(table.values())
  tokens = meta["tokenizer.ggml.tokens"]
  vocab = {}
  for i, token in enumerate(tokens):
    spelled = token if set(token) <= alphabet else "".join(table[b] for b in token.encode())
    vocab[spelled] = i
  merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
  backend = BackendTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
  split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
  if split is None:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  else:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  return backend, alphabet


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
  """BPE merges implied by a SentencePiece vocabulary: every split of a token into two vocab
  pieces, best-scoring merged token first (ties: shorter left piece, then shorter right)."""
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for token, score in zip(tokens, scores):
    local = [(token[:i], token[i:], score) for i in range(1, len(token))
             if token[:i] in vocab and token[i:] in vocab]
    local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.extend(local)
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(left, right) for left, right, _ in merges]


def _sentencepiece_backend(meta: dict[str, Any]) -> tuple[BackendTokenizer, None]:
  tokens = meta["tokenizer.ggml.tokens"]
  vocab = {t: i for i, t in enumerate(tokens)}
  if "tokenizer.ggml.merges" in meta:
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
  else:
    merges = _sentencepiece_merges(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
  backend = BackendTokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
  backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                   split=False)
  backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                       decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  return backend, None


TOKENIZER_BUILDERS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


def tokenizer_from_metadata(meta: dict[str, Any]) -> Tokenizer:
  """The tokenizer a GGUF describes (tokenizer.ggml.model "gpt2" or "llama"), chat template
  included."""
  kind = meta.get("tokenizer.ggml.model")
  if kind not in TOKENIZER_BUILDERS:
    raise UnsupportedConfigError(f"GGUF tokenizer.ggml.model {kind!r} is not supported "
                                 f"(supported: {sorted(TOKENIZER_BUILDERS)})")
  if "tokenizer.ggml.tokens" not in meta:
    raise CheckpointError("GGUF has no tokenizer.ggml.tokens")
  backend, alphabet = TOKENIZER_BUILDERS[kind](meta)
  tokens = meta["tokenizer.ggml.tokens"]
  types = meta.get("tokenizer.ggml.token_type") or []

  def token(key: str) -> str | None:
    i = meta.get(f"tokenizer.ggml.{key}")
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None

  named = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
           "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
  # Named special tokens first (their own ids), then control tokens; a byte-level control token
  # spelled outside the byte alphabet is a mislabel and is skipped, as transformers does.
  special = [t for t in named.values() if t is not None]
  special += [t for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL
              and (alphabet is None or set(t) <= alphabet)]
  backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                              for t in dict.fromkeys(special)])
  vocab = backend.get_vocab()
  user_defined = [AddedToken(t, normalized=False, special=False)
                  for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t in vocab]
  if user_defined:
    backend.add_tokens(user_defined)
  add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
  config = {
      **{k: v for k, v in named.items() if v is not None},
      "add_bos_token": bool(add_bos),
      "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
      "clean_up_tokenization_spaces": False,
  }
  if meta.get("tokenizer.chat_template"):
    config["chat_template"] = meta["tokenizer.chat_template"]
  return Tokenizer(backend, config, end_of_generation_ids(meta))


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """Only the tokenizer of a GGUF file (reads metadata, no tensors are dequantized)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise CheckpointError(f"GGUF file not found: {path}")
  return tokenizer_from_metadata(read_metadata(_reader(path)))
