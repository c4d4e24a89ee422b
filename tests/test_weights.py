"""Weights: HF safetensors and GGUF loading, orbax checkpoints, conversion."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from sparsedec.errors import CheckpointError, UnsupportedConfigError
from sparsedec.model.config import ModelConfig
from sparsedec.weights.checkpoint import (convert, load_checkpoint, load_model,
                                          save_checkpoint)
from sparsedec.weights.gguf_file import (hf_config_from_metadata, load_gguf,
                                         unpermute_rope_rows)
from sparsedec.weights.hf import load_hf

ROOT = pathlib.Path(__file__).resolve().parent.parent


def assert_same_params(a, b):
  assert jax.tree.structure(jax.tree.map(np.asarray, a)) == jax.tree.structure(
      jax.tree.map(np.asarray, b))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def read_tensors(path) -> dict[str, np.ndarray]:
  with safe_open(str(path), framework="numpy") as f:
    return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture
def hf_copy(stories_hf_dir, tmp_path) -> pathlib.Path:
  """A writable copy of the stories260K HF directory."""
  dst = tmp_path / "hf"
  shutil.copytree(stories_hf_dir, dst)
  return dst


# ------------------------------------------------------------------------------ HF loading
def test_hf_load_and_checkpoint_round_trip(stories_hf_dir, tmp_path):
  cfg, params = load_hf(stories_hf_dir)
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (5, 64, 8, 4)
  assert cfg.tie_word_embeddings and "lm_head" not in params
  out = convert(stories_hf_dir, tmp_path / "ckpt", show_progress=False)
  for name in ("sparsedec_config.json", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json"):
    assert (pathlib.Path(out) / name).is_file(), name
  cfg2, params2 = load_checkpoint(out)
  assert cfg2 == cfg
  assert_same_params(params, params2)
  # the fused layout: wqkv columns are q, k, v rows of the HF tensors
  hf = read_tensors(stories_hf_dir / "model.safetensors")
  q = hf["model.layers.1.self_attn.q_proj.weight"]
  v = hf["model.layers.1.self_attn.v_proj.weight"]
  np.testing.assert_array_equal(params["layers"][1]["wqkv"][:, :q.shape[0]], q.T)
  np.testing.assert_array_equal(params["layers"][1]["wqkv"][:, -v.shape[0]:], v.T)
  up = hf["model.layers.1.mlp.up_proj.weight"]
  np.testing.assert_array_equal(params["layers"][1]["w_gate_up"][:, up.shape[0]:], up.T)


def test_checkpoint_restore_does_not_read_source(stories_hf_dir, tmp_path):
  src = tmp_path / "src"
  shutil.copytree(stories_hf_dir, src)
  out = convert(src, tmp_path / "ckpt", show_progress=False)
  shutil.rmtree(src)
  cfg, params, tok = load_model(out)
  assert cfg.num_layers == 5 and tok.bos_id == 1
  cfg16, params16 = load_checkpoint(out, dtype="bfloat16")
  assert cfg16.dtype == "bfloat16" and params16["embed"].dtype == ml_dtypes.bfloat16


def test_a_dtype_given_as_a_numpy_or_jax_dtype_is_stored_by_name(tmp_path):
  """dtype=np.dtype("bfloat16") passed ModelConfig's check (a dtype equals its name) and was kept
  as the object: the config then failed to save ('Object of type dtype[bfloat16] is not JSON
  serializable', after the whole load). jnp.bfloat16 / np.float32 (scalar types, as
  torch_dtype=torch.bfloat16 is in transformers) were refused. All are stored as the name now."""
  import jax.numpy as jnp
  stories = ROOT / "checkpoints" / "stories260K"
  for dtype in (jnp.dtype("bfloat16"), jnp.bfloat16, ml_dtypes.bfloat16):
    cfg, params, tok = load_model(stories, dtype=dtype)
    assert cfg.dtype == "bfloat16" and isinstance(cfg.dtype, str)
    assert params["embed"].dtype == jnp.bfloat16
  assert hash(cfg) == hash(cfg.replace(dtype="bfloat16"))             # one jit cache entry
  out = save_checkpoint(tmp_path / "bf16", cfg, params, tok)
  assert load_checkpoint(out)[0].dtype == "bfloat16"
  assert cfg.replace(dtype=np.float32).dtype == "float32"
  for dtype in (np.float16, np.dtype("float16"), "bf16", None):
    with pytest.raises(UnsupportedConfigError, match=r"dtype .* is not supported \(supported"):
      cfg.replace(dtype=dtype)


def test_embedded_default_checkpoint_matches_source(stories_hf_dir):
  cfg, params = load_hf(stories_hf_dir)
  cfg2, params2 = load_checkpoint(ROOT / "checkpoints" / "stories260K")
  assert cfg2 == cfg and cfg2.dtype == "float32"
  assert_same_params(params, params2)


def test_load_model_accepts_each_kind(stories_hf_dir):
  cfg, params, tok = load_model(stories_hf_dir)
  assert tok.encode("Once upon a time")[0] == tok.bos_id
  with pytest.raises(CheckpointError, match="not found"):
    load_model("/nonexistent/model")
  with pytest.raises(CheckpointError, match="not found"):
    load_checkpoint("/nonexistent/ckpt")


# Run with four host devices (the flag must be set before jax starts: a subprocess).
ON_THE_DEFAULT_DEVICE = """
import jax
from sparsedec.weights.checkpoint import load_model
devices = jax.devices()
assert len(devices) == 4, devices
for dtype in (None, "bfloat16"):
  with jax.default_device(devices[2]):
    cfg, params, tok = load_model(CHECKPOINT, dtype=dtype)
  placed = {d for x in jax.tree.leaves(params) for d in x.devices()}
  assert placed == {devices[2]}, (dtype, placed)
with jax.default_device("cpu"):            # a platform name: its first device
  cfg, params, tok = load_model(CHECKPOINT)
assert {d for x in jax.tree.leaves(params) for d in x.devices()} == {devices[0]}
print("ok")
"""


def test_a_checkpoint_loads_onto_the_default_device():
  """load_model / load_checkpoint under `jax.default_device(d)` restore onto d, as a GGUF or HF
  load does (the restore committed every array to jax.devices()[0], whatever the caller's
  default device: the model then ran on device 0)."""
  from host_devices import run_script
  run_script(ON_THE_DEFAULT_DEVICE)


def test_sharded_safetensors_load_identically(stories_hf_dir, hf_copy):
  tensors = read_tensors(hf_copy / "model.safetensors")
  os.remove(hf_copy / "model.safetensors")
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
  for shard, shard_names in shards.items():
    save_file({n: tensors[n] for n in shard_names}, hf_copy / shard)
  index = {"metadata": {}, "weight_map": {n: s for s, ns in shards.items() for n in ns}}
  (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
  assert_same_params(load_hf(stories_hf_dir)[1], load_hf(hf_copy)[1])

  os.remove(hf_copy / "model-00002-of-00002.safetensors")
  with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
    load_hf(hf_copy)



def test_single_safetensors_file_wins_over_index(stories_hf_dir, hf_copy):
  """A directory with both model.safetensors and model.safetensors.index.json: transformers'
  from_pretrained loads the single file (it checks SAFE_WEIGHTS_NAME before the index)."""
  tensors = read_tensors(hf_copy / "model.safetensors")
  save_file({n: np.zeros_like(t) for n, t in tensors.items()}, hf_copy / "zeros.safetensors")
  index = {"metadata": {}, "weight_map": {n: "zeros.safetensors" for n in tensors}}
  (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
  assert_same_params(load_hf(stories_hf_dir)[1], load_hf(hf_copy)[1])

def test_missing_config_is_named(hf_copy):
  os.remove(hf_copy / "config.json")
  with pytest.raises(CheckpointError, match="config.json"):
    load_hf(hf_copy)


def test_wrong_shape_names_tensor_and_shapes(hf_copy):
  tensors = read_tensors(hf_copy / "model.safetensors")
  name = "model.layers.3.mlp.down_proj.weight"
  tensors[name] = np.zeros((64, 171), np.float32)
  save_file(tensors, hf_copy / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.down_proj\.weight.*"
                     r"\(64, 171\).*\(64, 172\)"):
    load_hf(hf_copy)



def test_non_float_tensor_is_named(hf_copy):
  """An integer (or bool) tensor where a float weight belongs is refused, naming the tensor and
  its dtype, not silently converted to float."""
  tensors = read_tensors(hf_copy / "model.safetensors")
  name = "model.layers.2.self_attn.k_proj.weight"
  tensors[name] = np.round(tensors[name] * 100).astype(np.int32)
  save_file(tensors, hf_copy / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight.*int32"):
    load_hf(hf_copy)

def test_unknown_and_missing_tensors(hf_copy):
  tensors = read_tensors(hf_copy / "model.safetensors")
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # ignored
  save_file(tensors, hf_copy / "model.safetensors")
  load_hf(hf_copy)
  tensors["model.layers.0.mlp.extra.weight"] = np.ones(4, np.float32)
  save_file(tensors, hf_copy / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
    load_hf(hf_copy)
  del tensors["model.layers.0.mlp.extra.weight"]
  del tensors["model.layers.4.input_layernorm.weight"]
  save_file(tensors, hf_copy / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"model\.layers\.4\.input_layernorm\.weight"):
    load_hf(hf_copy)


def test_tied_lm_head_must_equal_embedding(stories_hf_dir, hf_copy):
  tensors = read_tensors(hf_copy / "model.safetensors")
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  save_file(tensors, hf_copy / "model.safetensors")
  assert_same_params(load_hf(stories_hf_dir)[1], load_hf(hf_copy)[1])
  tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
  save_file(tensors, hf_copy / "model.safetensors")
  with pytest.raises(CheckpointError, match="lm_head.weight"):
    load_hf(hf_copy)


def test_bf16_safetensors_and_generation_eos(stories_hf_dir, hf_copy):
  tensors = read_tensors(hf_copy / "model.safetensors")
  save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()},
            hf_copy / "model.safetensors")
  config = json.loads((hf_copy / "config.json").read_text())
  config["torch_dtype"] = "bfloat16"
  (hf_copy / "config.json").write_text(json.dumps(config))
  (hf_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
  cfg, params = load_hf(hf_copy)
  assert cfg.dtype == "bfloat16" and cfg.eos_token_ids == (2, 5)
  ref = load_hf(stories_hf_dir, dtype="bfloat16")[1]
  assert_same_params(ref, params)


def test_generation_config_eos_ids_replace_config_json_ones(hf_copy):
  """transformers' generate stops on generation_config.json's eos_token_id alone when that file
  exists (config.json's is not read); we stopped on the union, so an id only config.json names
  ended generation early. Without the file, or with no eos id in it, config.json's stand."""
  config = json.loads((hf_copy / "config.json").read_text())
  (hf_copy / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
  for gen, expected in (({"eos_token_id": [5, 7]}, (5, 7)), ({"eos_token_id": 9}, (9,)),
                        ({"bos_token_id": 1}, (2,)), ({"eos_token_id": None}, (2,))):
    (hf_copy / "generation_config.json").write_text(json.dumps(gen))
    assert load_hf(hf_copy)[0].eos_token_ids == expected, gen
  (hf_copy / "generation_config.json").write_text(json.dumps({"bos_token_id": 7}))
  assert load_hf(hf_copy)[0].bos_token_id == 7                # config.json's is 1


def test_unsupported_architecture_is_named(hf_copy):
  config = json.loads((hf_copy / "config.json").read_text())
  config["architectures"] = ["GPT2LMHeadModel"]
  (hf_copy / "config.json").write_text(json.dumps(config))
  with pytest.raises(UnsupportedConfigError, match="GPT2LMHeadModel"):
    load_hf(hf_copy)
  with pytest.raises(UnsupportedConfigError, match="gemma2"):
    hf_config_from_metadata({"general.architecture": "gemma2"}, set())


def test_gguf_without_attention_heads_is_named():
  meta = {"general.architecture": "llama", "llama.vocab_size": 32, "llama.embedding_length": 64,
          "llama.attention.head_count": 0, "llama.feed_forward_length": 128,
          "llama.block_count": 1}
  with pytest.raises(CheckpointError, match="llama.attention.head_count' is 0"):
    hf_config_from_metadata(meta, set())


def test_gguf_per_layer_head_counts_are_read_or_refused_by_name():
  """A converter may write a head count per layer (a list). Equal in every layer, it is the
  model's count; different (a model of varying layers), a named refusal (int() of the list
  raised a bare TypeError)."""
  meta = {"general.architecture": "llama", "llama.vocab_size": 32, "llama.embedding_length": 64,
          "llama.attention.head_count": [4, 4], "llama.attention.head_count_kv": [2, 2],
          "llama.feed_forward_length": 128, "llama.block_count": 2}
  hf = hf_config_from_metadata(meta, set())
  assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (4, 2, 16)
  meta["llama.attention.head_count_kv"] = [2, 1]
  with pytest.raises(UnsupportedConfigError, match=r"head_count_kv' differs between layers"):
    hf_config_from_metadata(meta, set())


# ---------------------------------------------------------------------------------- HF config
LLAMA_HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256,
                   "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 100, "rope_theta": 500000.0}


def test_hidden_act_swish_is_silu_and_others_are_refused():
  """transformers maps hidden_act "swish" to SiLU (it was refused); gelu is not ours."""
  assert ModelConfig.from_hf({**LLAMA_HF_CONFIG, "hidden_act": "swish"}) == \
      ModelConfig.from_hf({**LLAMA_HF_CONFIG, "hidden_act": "silu"})
  with pytest.raises(UnsupportedConfigError, match="hidden_act 'gelu' is not supported"):
    ModelConfig.from_hf({**LLAMA_HF_CONFIG, "hidden_act": "gelu"})


@pytest.mark.parametrize("change", [
    {"rope_theta": 0}, {"rope_theta": -10000.0}, {"rope_theta": float("nan")},
    {"rope_scaling": {"rope_type": "linear", "factor": float("nan")}},
], ids=["theta-0", "theta-negative", "theta-nan", "factor-nan"])
def test_rope_theta_and_factor_must_be_finite_positive(change):
  """A rope_theta <= 0 or NaN (or a NaN scaling factor) was accepted and made the RoPE tables
  inf/NaN: every logit NaN, with no error naming the attribute."""
  with pytest.raises(UnsupportedConfigError, match="rope_theta|factor"):
    ModelConfig.from_hf({**LLAMA_HF_CONFIG, **change})


@pytest.mark.parametrize("change, needle", [
    ({"hidden_size": 256.5}, "hidden_size must be an integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer"),
    ({"eos_token_id": [2, 2.5]}, "eos_token_id must be an integer"),
    ({"bos_token_id": "<s>"}, "bos_token_id must be a number"),
])
def test_non_integer_config_counts_and_ids_are_named(change, needle):
  """int() truncated a fractional count or id (hidden_size 256.5 ran as 256, eos 2.5 as 2, true
  as 1 layer) and bos_token_id was taken unchecked (a string reached generation)."""
  with pytest.raises(UnsupportedConfigError, match=needle):
    ModelConfig.from_hf({**LLAMA_HF_CONFIG, **change})
  assert ModelConfig.from_hf({**LLAMA_HF_CONFIG, "hidden_size": 256.0}).hidden_size == 256


def test_rope_scaling_wins_over_rope_parameters_like_transformers():
  """A config.json with both `rope_parameters` (5.x) and `rope_scaling` (4.x) is read by
  transformers 4.x and 5.x (`rope_scaling or rope_parameters`) with rope_scaling and the theta
  beside it; we took rope_parameters and silently dropped the scaling (logits off by 4e-3 of
  their scale on a tiny random Llama, checked against transformers 5)."""
  cfg = ModelConfig.from_hf({
      **{k: v for k, v in LLAMA_HF_CONFIG.items() if k != "rope_theta"},
      "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
      "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
  assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear"
  assert cfg.rope_scaling.factor == 4.0 and cfg.rope_theta == 10000.0


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                         "partial_rotary_factor": 0.5}},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "partial_rotary_factor": 0.25}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.5}},
], ids=["linear-parameters", "llama3-scaling", "default-parameters"])
def test_partial_rotary_factor_inside_the_rope_dict_is_refused(rope):
  """transformers 5 reads partial_rotary_factor from rope_parameters (a top-level one is moved
  there) and rotates only that part of each head; only a top-level factor was refused, one
  inside the rope dict ran as full rotation: other logits, no error."""
  config = {**{k: v for k, v in LLAMA_HF_CONFIG.items() if k != "rope_theta"}, **rope}
  with pytest.raises(UnsupportedConfigError, match="rope_parameters / rope_scaling "
                                                   "partial_rotary_factor=0"):
    ModelConfig.from_hf(config)
  whole = {k: {**v, "partial_rotary_factor": 1.0} for k, v in rope.items()}
  assert ModelConfig.from_hf({**config, **whole}).rope_theta == 1e4


def hf_llama3_inv_freq(theta, dim, factor, low, high, old_context_len):
  """transformers' _compute_llama3_parameters, one frequency at a time (float64)."""
  out = []
  for i in range(0, dim, 2):
    inv = 1.0 / theta ** (i / dim)
    wavelen = 2 * np.pi / inv
    if wavelen < old_context_len / high:
      out.append(inv)
    elif wavelen > old_context_len / low:
      out.append(inv / factor)
    else:
      smooth = (old_context_len / wavelen - low) / (high - low)
      out.append((1 - smooth) * inv / factor + smooth * inv)
  return np.asarray(out)


def test_llama3_rope_without_original_max_position_embeddings():
  """transformers (>= 5) falls back to max_position_embeddings when the llama3 rope_scaling has
  no original_max_position_embeddings (4.x refused it); 8192 matched neither."""
  from sparsedec.model.config import ModelConfig
  from sparsedec.model.rope import inverse_frequencies
  scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0}
  for omp in (1024, None):
    rope = dict(scaling, **({"original_max_position_embeddings": omp} if omp else {}))
    cfg = ModelConfig.from_hf(dict(LLAMA_HF_CONFIG, max_position_embeddings=1024,
                                   rope_scaling=rope))
    assert cfg.rope_scaling.original_max_position_embeddings == 1024
    np.testing.assert_allclose(inverse_frequencies(cfg),
                               hf_llama3_inv_freq(500000.0, 64, 8.0, 1.0, 4.0, 1024), rtol=1e-5)


@pytest.mark.parametrize("drop", [("low_freq_factor",), ("low_freq_factor", "high_freq_factor"),
                                  ("factor",)])
def test_a_llama3_rope_without_a_key_transformers_requires_is_refused_by_name(drop):
  """transformers 5.24 refuses a llama3 rope_scaling / rope_parameters without factor,
  low_freq_factor or high_freq_factor ('Missing required keys'); the two frequency factors were
  taken as Llama 3.1's 1.0 / 4.0, loading a model transformers does not, and a missing factor
  was named as 'a required attribute of a Llama-family config'. A missing
  original_max_position_embeddings is max_position_embeddings, the family's default where that
  is absent too (transformers' standardize_rope_params); a null one is named."""
  from sparsedec.errors import UnsupportedConfigError
  from sparsedec.model.config import ModelConfig
  scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0}
  rope = {k: v for k, v in scaling.items() if k not in drop}
  with pytest.raises(UnsupportedConfigError,
                     match=rf"rope_type 'llama3' has no {', '.join(sorted(drop))} \("):
    ModelConfig.from_hf(dict(LLAMA_HF_CONFIG, rope_scaling=rope))
  with pytest.raises(UnsupportedConfigError, match=r"rope_type 'llama3' has no"):
    ModelConfig.from_hf(dict(LLAMA_HF_CONFIG, rope_parameters=dict(rope, rope_theta=1e4)))
  mistral = {k: v for k, v in LLAMA_HF_CONFIG.items() if k != "max_position_embeddings"}
  cfg = ModelConfig.from_hf(dict(mistral, architectures=["MistralForCausalLM"],
                                 rope_scaling=scaling))
  assert cfg.rope_scaling.original_max_position_embeddings == 131072 == cfg.max_position_embeddings
  with pytest.raises(UnsupportedConfigError, match="^max_position_embeddings must be"):
    ModelConfig.from_hf(dict(LLAMA_HF_CONFIG, max_position_embeddings=None, rope_scaling=scaling))


def test_mistral_sliding_window_defaults_like_transformers():
  """MistralConfig's sliding_window defaults to 4096: a config.json without the key gets that
  window in transformers (4.x and 5.x); an explicit null is full attention."""
  from sparsedec.model.config import ModelConfig
  mistral = dict(LLAMA_HF_CONFIG, architectures=["MistralForCausalLM"])
  assert ModelConfig.from_hf(mistral).sliding_window == 4096
  assert ModelConfig.from_hf(dict(mistral, sliding_window=None)).sliding_window is None
  assert ModelConfig.from_hf(dict(mistral, sliding_window=16)).sliding_window == 16


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_use_sliding_window_on_every_layer_or_none_loads_like_transformers(arch):
  """transformers' Qwen2 / Qwen3 put the window on the layers from max_window_layers (default 28)
  on, or on those layer_types names "sliding_attention": with use_sliding_window=true a window
  on every layer, or on none, is one plain attention (checked against transformers 5.24's
  generate: greedy tokens equal for dense, Lookahead and FAFO, logits within 2.4e-6); both were
  refused as 'per-layer windows'. A window on some layers only still is."""
  from sparsedec.errors import UnsupportedConfigError
  from sparsedec.model.config import ModelConfig
  n = LLAMA_HF_CONFIG["num_hidden_layers"]
  qwen = dict(LLAMA_HF_CONFIG, architectures=[arch], use_sliding_window=True, sliding_window=8)
  assert ModelConfig.from_hf(dict(qwen, max_window_layers=0)).sliding_window == 8
  assert ModelConfig.from_hf(dict(qwen, max_window_layers=n)).sliding_window is None
  assert ModelConfig.from_hf(dict(qwen, max_window_layers=0, sliding_window=None)
                             ).sliding_window is None
  # transformers 5 saves layer_types, which then decide (max_window_layers aside).
  assert ModelConfig.from_hf(dict(qwen, max_window_layers=n,
                                  layer_types=["sliding_attention"] * n)).sliding_window == 8
  assert ModelConfig.from_hf(dict(qwen, layer_types=["full_attention"] * n)).sliding_window is None
  assert ModelConfig.from_hf(dict(qwen, use_sliding_window=False,
                                  max_window_layers=0)).sliding_window is None
  with pytest.raises(UnsupportedConfigError, match=r"window on some layers only .* "
                     r"max_window_layers=1 .* \(per-layer windows\)"):
    ModelConfig.from_hf(dict(qwen, max_window_layers=1))


def test_llama_sliding_window_is_refused_with_the_reason():
  """A Llama config.json with a window: transformers attends to the whole prompt in its forward
  but its generation cache keeps only the last window - 1 tokens (checked against transformers
  5.24 in session 55: prompt logits equal full attention, the continuation diverges at its second
  token), so no one attention matches it; refused by name. A null window is full attention."""
  from sparsedec.errors import UnsupportedConfigError
  from sparsedec.model.config import ModelConfig
  assert ModelConfig.from_hf(dict(LLAMA_HF_CONFIG, sliding_window=None)).sliding_window is None
  with pytest.raises(UnsupportedConfigError, match=r"sliding_window=8 is not supported for "
                     r"llama: .* keeps only the last 8 - 1 tokens"):
    ModelConfig.from_hf(dict(LLAMA_HF_CONFIG, sliding_window=8))


@pytest.mark.parametrize("arch, want", [
    ("LlamaForCausalLM", {False: (False, False), True: (True, True)}),
    ("Qwen3ForCausalLM", {False: (False, False), True: (True, True)}),
    ("Qwen2ForCausalLM", {False: (True, False), True: (True, False)}),
    ("MistralForCausalLM", {False: (False, False), True: (False, False)})])
def test_attention_bias_per_family_like_transformers(arch, want):
  """(qkv_bias, o_bias) for attention_bias false / true, as transformers 5.24's attention
  modules build their projections: Llama and Qwen3 put the flag on q, k, v and o; Qwen2 always
  has q/k/v biases and never an o bias; Mistral has none (it ignores the key)."""
  from sparsedec.model.config import ModelConfig
  for flag, (qkv, o) in want.items():
    cfg = ModelConfig.from_hf(dict(LLAMA_HF_CONFIG, architectures=[arch], attention_bias=flag))
    assert (cfg.qkv_bias, cfg.o_bias) == (qkv, o), (arch, flag)
    assert cfg.qk_norm == (arch == "Qwen3ForCausalLM")


def test_qwen3_head_dim_defaults_like_transformers():
  """Qwen3Config's head_dim defaults to 128 (transformers 4.x and 5.x), not hidden/heads; Llama
  and Qwen2 configs without it still derive hidden/heads."""
  from sparsedec.model.config import ModelConfig
  qwen3 = dict(LLAMA_HF_CONFIG, architectures=["Qwen3ForCausalLM"])
  assert ModelConfig.from_hf(qwen3).head_dim == 128
  assert ModelConfig.from_hf(dict(qwen3, head_dim=32)).head_dim == 32
  for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
    assert ModelConfig.from_hf(dict(LLAMA_HF_CONFIG, architectures=[arch])).head_dim == 64


@pytest.mark.parametrize("arch, context, kv_heads", [
    ("LlamaForCausalLM", 2048, 32), ("MistralForCausalLM", 131072, 8),
    ("Qwen2ForCausalLM", 32768, 32), ("Qwen3ForCausalLM", 32768, 32)])
def test_absent_context_and_kv_heads_default_like_transformers(arch, context, kv_heads):
  """A config.json without max_position_embeddings / num_key_value_heads gets its family's
  transformers default (MistralConfig 131072 and 8 KV heads, Qwen2/Qwen3Config 32768 and 32),
  checked against transformers' classes in .hfenv: it got 2048 and num_attention_heads for
  every family, so a Qwen prompt past 2048 tokens was refused, and a Mistral config without
  num_key_value_heads was read as multi-head attention (its k_proj refused as wrongly shaped).
  A null num_key_value_heads still means num_attention_heads, as in transformers."""
  hf = {k: v for k, v in LLAMA_HF_CONFIG.items() if k != "num_key_value_heads"}
  hf = dict(hf, architectures=[arch], num_attention_heads=32, hidden_size=512)
  cfg = ModelConfig.from_hf(hf)
  assert (cfg.max_position_embeddings, cfg.num_kv_heads) == (context, kv_heads)
  assert ModelConfig.from_hf(dict(hf, num_key_value_heads=None)).num_kv_heads == 32
  assert ModelConfig.from_hf(dict(hf, max_position_embeddings=64)).max_position_embeddings == 64
  # The defaults every family's config class shares (transformers 5.24): rms_norm_eps 1e-6,
  # rope theta 10000 (default_theta), untied embeddings.
  assert "rms_norm_eps" not in hf and "tie_word_embeddings" not in hf
  assert (cfg.rms_norm_eps, cfg.tie_word_embeddings) == (1e-6, False)
  assert ModelConfig.from_hf({k: v for k, v in hf.items() if k != "rope_theta"}).rope_theta == 1e4
  if not arch.startswith("Qwen"):
    return
  with pytest.raises(UnsupportedConfigError, match="no num_key_value_heads.*default of 32: not "
                                                   r"a divisor of num_attention_heads \(4\)"):
    ModelConfig.from_hf(dict(hf, num_attention_heads=4, hidden_size=256))


@pytest.mark.parametrize("arch, bos, eos", [
    ("LlamaForCausalLM", 1, (2,)), ("MistralForCausalLM", 1, (2,)),
    ("Qwen2ForCausalLM", None, ()), ("Qwen3ForCausalLM", None, ())])
def test_absent_bos_and_eos_ids_default_like_transformers(arch, bos, eos):
  """LlamaConfig and MistralConfig default bos_token_id / eos_token_id to 1 / 2 (Qwen2/Qwen3Config
  to None), and transformers' generate stops on that eos where no generation_config.json says
  otherwise; a Llama config.json without the keys generated past token 2. An explicit null
  still means none, as in transformers."""
  hf = {k: v for k, v in LLAMA_HF_CONFIG.items() if k not in ("bos_token_id", "eos_token_id")}
  cfg = ModelConfig.from_hf(dict(hf, architectures=[arch]))
  assert (cfg.bos_token_id, cfg.eos_token_ids) == (bos, eos)
  cfg = ModelConfig.from_hf(dict(hf, architectures=[arch], bos_token_id=None, eos_token_id=None))
  assert (cfg.bos_token_id, cfg.eos_token_ids) == (None, ())


@pytest.mark.parametrize("change, needle", [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"vocab_size": None}, "vocab_size"),
    ({"hidden_size": "wide"}, "hidden_size"),
    ({"rope_scaling": "linear"}, "rope_scaling"),
    ({"rope_scaling": [8.0]}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "linear", "factor": None}}, "factor"),
    (None, "not a JSON object"),
])
def test_malformed_config_is_named(hf_copy, change, needle):
  """Malformed config.json values raise UnsupportedConfigError naming the field and the file (they
  were ZeroDivisionError, TypeError, ValueError, AttributeError)."""
  config = json.loads((hf_copy / "config.json").read_text())
  config = [config] if change is None else dict(config, **change)
  (hf_copy / "config.json").write_text(json.dumps(config))
  with pytest.raises(UnsupportedConfigError, match=rf"config\.json.*{needle}"):
    load_hf(hf_copy)


@pytest.mark.parametrize("index", [["model.safetensors"], "x", {"metadata": {}},
                                   {"weight_map": ["model.safetensors"]},
                                   {"weight_map": {"lm_head.weight": 1}}])
def test_malformed_safetensors_index_is_named(hf_copy, index):
  os.remove(hf_copy / "model.safetensors")              # else the single file is loaded
  (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json .*'weight_map'"):
    load_hf(hf_copy)


# ----------------------------------------------------------------------------- conversion
def leftovers(parent: pathlib.Path) -> list[str]:
  return sorted(os.listdir(parent)) if parent.exists() else []


def test_failed_conversion_leaves_nothing(hf_copy, tmp_path):
  tensors = read_tensors(hf_copy / "model.safetensors")
  tensors["model.layers.2.self_attn.k_proj.weight"] = np.zeros((3, 64), np.float32)
  save_file(tensors, hf_copy / "model.safetensors")
  parent = tmp_path / "checkpoints"
  with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight"):
    convert(hf_copy, parent / "bad", show_progress=False)
  assert leftovers(parent) == []


def test_failed_save_cleans_temporary_dir(stories_hf_dir, tmp_path):
  cfg, params = load_hf(stories_hf_dir)
  parent = tmp_path / "checkpoints"
  with pytest.raises(CheckpointError, match="plain file name"):
    save_checkpoint(parent / "bad", cfg, params, {"../evil.json": "{}"})
  assert leftovers(parent) == []


def test_existing_checkpoint_needs_overwrite(stories_hf_dir, tmp_path):
  out = convert(stories_hf_dir, tmp_path / "ckpt", show_progress=False)
  with pytest.raises(CheckpointError, match="already exists .*--overwrite"):
    convert(stories_hf_dir, out, show_progress=False)
  (tmp_path / ".ckpt.tmp-deadbeef").mkdir()            # what an interrupted save left
  convert(stories_hf_dir, out, overwrite=True, show_progress=False)
  assert leftovers(tmp_path) == ["ckpt"]
  load_checkpoint(out)


def test_a_concurrent_saves_temporary_is_left_alone(stories_hf_dir, tmp_path):
  """Every save removed all `.NAME.tmp-*` siblings as left by interrupted saves, including the
  one a concurrent save of the same name was still writing (its rename then failed). Only
  temporaries whose process is gone are removed now."""
  import subprocess
  import sys
  done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  live = tmp_path / f".ckpt.tmp-{os.getpid()}-0123abcd"           # a save still running
  dead = tmp_path / f".ckpt.tmp-{int(done.stdout)}-4567cdef"     # its process has exited
  live.mkdir()
  dead.mkdir()
  convert(stories_hf_dir, tmp_path / "ckpt", show_progress=False)
  assert leftovers(tmp_path) == sorted(["ckpt", live.name])


def test_a_failed_swap_puts_the_old_checkpoint_back(stories_hf_dir, tmp_path, monkeypatch):
  """overwrite moves the old checkpoint aside, then the new one in: when the second move fails,
  the old one goes back (it was left under a hidden name and the checkpoint was gone)."""
  out = convert(stories_hf_dir, tmp_path / "ckpt", show_progress=False)
  before = (pathlib.Path(out) / "sparsedec_config.json").read_text()
  rename = os.rename

  def failing_rename(src, dst):
    if os.path.basename(src).startswith(".ckpt.tmp-"):
      raise OSError("disk full")
    rename(src, dst)
  monkeypatch.setattr(os, "rename", failing_rename)
  with pytest.raises(OSError, match="disk full"):
    convert(stories_hf_dir, out, dtype="bfloat16", overwrite=True, show_progress=False)
  assert leftovers(tmp_path) == ["ckpt"]
  assert (pathlib.Path(out) / "sparsedec_config.json").read_text() == before   # float32, not bf16


@pytest.mark.parametrize("field, value, needle", [
    ("vocab_size", 256, r"tensor embed has shape \(512, 64\), expected \(256, 64\)"),
    ("intermediate_size", 100, r"tensor layers\[0\]\.w_gate_up has shape \(64, 344\)"),
    ("num_layers", 3, "layers: expected 3 layers, got 5"),
    ("tie_word_embeddings", False, r"missing tensor lm_head \(expected shape \(64, 512\)\)"),
])
def test_params_saved_with_another_config_are_named(tmp_path, capfd, field, value, needle):
  """A sparsedec_config.json that does not fit the saved params (edited, or copied from another
  checkpoint) failed inside orbax's restore: no field named, advice to pass orbax's `strict=False`
  / `partial_restore=True`, and a screenful of asyncio 'Event loop is closed' tracebacks."""
  ckpt = shutil.copytree(ROOT / "checkpoints" / "stories260K", tmp_path / "ckpt")
  config = ckpt / "sparsedec_config.json"
  config.write_text(json.dumps({**json.loads(config.read_text()), field: value}))
  capfd.readouterr()
  with pytest.raises(CheckpointError, match=rf"params saved in params/ do not fit its "
                                            rf"sparsedec_config.json: {needle}") as err:
    load_checkpoint(ckpt)
  assert "strict" not in str(err.value) and "partial_restore" not in str(err.value)
  assert "Event loop is closed" not in capfd.readouterr().err


def test_overwrite_replaces_only_a_checkpoint(hf_copy, tmp_path):
  """overwrite deletes what it replaces: never a directory that is not a checkpoint (say, the one
  holding the source, or the working directory), nor a plain file; and an HF directory without
  tokenizer.json (which the checkpoint could not be loaded without) is refused before loading."""
  notes = tmp_path / "mine"
  notes.mkdir()
  (notes / "notes.txt").write_text("keep me")
  with pytest.raises(CheckpointError, match="not a sparsedec checkpoint"):
    convert(hf_copy, notes, overwrite=True, show_progress=False)
  assert (notes / "notes.txt").read_text() == "keep me"
  (tmp_path / "file").write_text("x")
  with pytest.raises(CheckpointError, match="not a sparsedec checkpoint"):
    convert(hf_copy, tmp_path / "file", overwrite=True, show_progress=False)
  with pytest.raises(CheckpointError, match="not a sparsedec checkpoint"):
    convert(hf_copy, hf_copy.parent, overwrite=True, show_progress=False)
  (tmp_path / "empty").mkdir()
  ckpt = convert(hf_copy, tmp_path / "empty", overwrite=True, show_progress=False)  # empty: fine
  inner = shutil.copytree(hf_copy, pathlib.Path(ckpt) / "hf")
  with pytest.raises(CheckpointError, match="would hold the source"):
    convert(inner, ckpt, overwrite=True, show_progress=False)
  assert (inner / "model.safetensors").exists() and (hf_copy / "model.safetensors").exists()
  (hf_copy / "tokenizer.json").unlink()
  with pytest.raises(CheckpointError, match="no tokenizer.json"):
    convert(hf_copy, tmp_path / "untokenized", show_progress=False)
  assert not (tmp_path / "untokenized").exists()


def test_load_model_names_a_missing_tokenizer_before_reading_weights(hf_copy, tmp_path,
                                                                     monkeypatch):
  """load_model read every weight and then failed on the missing tokenizer.json; now the
  tokenizer comes first, for an HF directory and for a converted checkpoint."""
  from sparsedec.weights import checkpoint
  ckpt = convert(hf_copy, tmp_path / "ckpt", show_progress=False)
  for src in (hf_copy, pathlib.Path(ckpt)):
    (src / "tokenizer.json").unlink()

  def weights_read(*args, **kwargs):
    raise AssertionError("the weights were read before the tokenizer was found missing")
  monkeypatch.setattr(checkpoint, "load_hf", weights_read)
  monkeypatch.setattr(checkpoint, "load_checkpoint", weights_read)
  with pytest.raises(CheckpointError, match="no tokenizer.json"):
    load_model(hf_copy)
  with pytest.raises(CheckpointError, match="tokenizer.json not found"):
    load_model(ckpt)


def test_corrupt_files_raise_errors_that_name_them(hf_copy, tmp_path):
  """What a broken download looks like: each raises a CheckpointError / UnsupportedConfigError
  naming the file or key (they were SafetensorError, JSONDecodeError, KeyError, IndexError and
  orbax's bare Exception)."""
  ckpt = convert(hf_copy, tmp_path / "ckpt", show_progress=False)
  weights = hf_copy / "model.safetensors"
  data = weights.read_bytes()
  weights.write_bytes(data[:len(data) // 2])
  with pytest.raises(CheckpointError, match="model.safetensors"):
    load_hf(hf_copy)
  weights.write_bytes(data[:6])
  with pytest.raises(CheckpointError, match="cannot read .*model.safetensors"):
    load_hf(hf_copy)
  weights.write_bytes(data)
  config = hf_copy / "config.json"
  good = json.loads(config.read_text())
  config.write_text("{not json")
  with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
    load_hf(hf_copy)
  config.write_text(json.dumps({k: v for k, v in good.items() if k != "num_attention_heads"}))
  with pytest.raises(UnsupportedConfigError, match="no 'num_attention_heads'"):
    load_hf(hf_copy)
  config.write_text(json.dumps(good))
  (hf_copy / "generation_config.json").write_text("[")
  with pytest.raises(CheckpointError, match="generation_config.json is not valid JSON"):
    load_hf(hf_copy)
  for i, blob in enumerate((b"GGUF", b"GGUF" + bytes(range(40)))):
    bad = tmp_path / f"bad{i}.gguf"
    bad.write_bytes(blob)
    with pytest.raises(CheckpointError, match=f"cannot read GGUF file .*bad{i}.gguf"):
      load_gguf(bad)
  shutil.rmtree(pathlib.Path(ckpt) / "params" / "ocdbt.process_0")
  with pytest.raises(CheckpointError, match="cannot restore params"):
    load_checkpoint(ckpt)


@pytest.mark.parametrize("content", ["[]", "null", '{"eos_token_id": "2"}',
                                     '{"eos_token_id": [2, null]}', '{"bos_token_id": 1.5}'])
def test_malformed_generation_config_is_named(hf_copy, content):
  """generation_config.json that is valid JSON but not an object, or whose ids are not ints,
  was a bare AttributeError / ValueError / TypeError (or a str bos id taken as is) from both
  the config and the tokenizer readers, naming neither the file nor the key."""
  (hf_copy / "generation_config.json").write_text(content)
  for load in (load_model, lambda d: load_hf(d)):
    with pytest.raises(CheckpointError, match="generation_config.json"):
      load(hf_copy)


@pytest.mark.parametrize("change", [
    lambda c: {k: v for k, v in c.items() if k != "family"},
    lambda c: {**c, "eos_token_ids": 2},
    lambda c: {**c, "rope_scaling": {"kind": "linear", "factor": 2.0, "scale": 1.0}},
    lambda c: {**c, "rope_scaling": [2.0]},
    lambda c: list(c),
], ids=["missing-field", "eos-not-a-list", "unknown-rope-field", "rope-not-object", "a-list"])
def test_malformed_checkpoint_config_is_named(tmp_path, change):
  """A hand-edited or damaged sparsedec_config.json (a field missing or of the wrong type) was a
  bare TypeError from the dataclass constructor, naming neither the file nor the checkpoint."""
  good = json.loads((ROOT / "checkpoints" / "stories260K" / "sparsedec_config.json").read_text())
  (tmp_path / "sparsedec_config.json").write_text(json.dumps(change(good)))
  with pytest.raises(CheckpointError, match="sparsedec_config.json"):
    load_checkpoint(tmp_path)


# -------------------------------------------------------------------------------------- GGUF
def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """HF half-split q/k rows -> llama.cpp interleaved rows (as llama.cpp's converter writes)."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def test_unpermute_inverts_llama_cpp_permutation():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((3 * 8, 5)).astype(np.float32)
  np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)
  # RoPE property: interleaved pairs (2i, 2i+1) of the GGUF rows become pairs (i, i + D/2).
  g = llama_cpp_permute(w, 3)
  h = unpermute_rope_rows(g, 3)
  np.testing.assert_array_equal(h[8 + 1], g[8 + 2])       # head 1, pair 1, first half
  np.testing.assert_array_equal(h[8 + 4 + 1], g[8 + 3])   # head 1, pair 1, second half


HF_QK_SCRIPT = r"""
import json, sys
import gguf, numpy as np
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
job = json.loads(sys.argv[1])
reader = gguf.GGUFReader(job["gguf"])
processor = LlamaTensorProcessor(config={"num_attention_heads": job["heads"],
                                         "num_key_value_heads": job["kv_heads"]})
out = {}
for t in reader.tensors:
  if t.name in job["names"]:
    out[t.name] = processor.process(weights=gguf.dequantize(t.data, t.tensor_type),
                                    name=t.name).weights
np.savez(job["out"], **out)
"""
QK_LAYERS = (0, 29)


@pytest.fixture(scope="module")
def hf_qk_reference(hf_python, smollm2_gguf, tmp_path_factory):
  """Start transformers' GGUF q/k processing in the background; returns a waiter."""
  out = tmp_path_factory.mktemp("hf") / "qk.npz"
  names = [f"blk.{i}.attn_{p}.weight" for i in QK_LAYERS for p in "qk"]
  job = json.dumps({"gguf": str(smollm2_gguf), "heads": 9, "kv_heads": 3, "names": names,
                    "out": str(out)})
  proc = subprocess.Popen([hf_python, "-c", HF_QK_SCRIPT, job], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)

  def wait():
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return dict(np.load(out))

  yield wait
  if proc.poll() is None:
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
  return load_gguf(smollm2_gguf)


def test_gguf_qk_unpermutation_matches_transformers(hf_qk_reference, smollm2):
  cfg, params, _ = smollm2
  ref = hf_qk_reference()
  hq, hkv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
  for i in QK_LAYERS:
    wqkv = params["layers"][i]["wqkv"]                                  # [Dm, (Hq+2Hkv) D]
    np.testing.assert_array_equal(wqkv[:, :hq], ref[f"blk.{i}.attn_q.weight"].T)
    np.testing.assert_array_equal(wqkv[:, hq:hq + hkv], ref[f"blk.{i}.attn_k.weight"].T)
  assert d == 64


def test_gguf_smollm2_config(smollm2):
  cfg, params, tok = smollm2
  assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim, cfg.vocab_size, cfg.intermediate_size) == (
              "llama", 30, 576, 9, 3, 64, 49152, 1536)
  assert cfg.tie_word_embeddings and "lm_head" not in params
  assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
  assert cfg.dtype == "float32" and params["embed"].dtype == np.float32
  assert tok.eos_ids == (2,) and cfg.eos_token_ids == (2,)
  assert np.isfinite(params["layers"][29]["w_down"]).all()


def test_truncated_tokenizer_json_is_named_before_the_weights(hf_copy, tmp_path, monkeypatch):
  """A truncated tokenizer.json (a broken download) raised tokenizers' bare Exception ("EOF
  while parsing a list at line 54 column 7", no file named: a traceback from the CLI), and
  `convert` only after loading every weight; now a CheckpointError naming the file, before the
  weights are read, and nothing written."""
  import sparsedec.weights.checkpoint as checkpoint
  tok_file = hf_copy / "tokenizer.json"
  tok_file.write_bytes(tok_file.read_bytes()[:1000])

  def no_weights(*args, **kwargs):
    raise AssertionError("the weights were loaded before the tokenizer was read")

  monkeypatch.setattr(checkpoint, "load_hf", no_weights)
  for load in (lambda: load_model(hf_copy),
               lambda: convert(hf_copy, tmp_path / "out" / "ckpt", show_progress=False)):
    with pytest.raises(CheckpointError, match=r"cannot read .*tokenizer\.json"):
      load()
  assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("key, needle", [("num_key_value_heads", "num_kv_heads must be a positive"),
                                         ("head_dim", "head_dim must be a positive")])
def test_zero_kv_heads_or_head_dim_is_refused_not_defaulted(key, needle):
  """`"num_key_value_heads": 0` ran as multi-head attention and `"head_dim": 0` as hidden / heads
  (a falsy value took the default meant for a missing key); transformers takes the 0 and fails
  inside attention. A missing or null key still gets the default."""
  with pytest.raises(UnsupportedConfigError, match=needle):
    ModelConfig.from_hf({**LLAMA_HF_CONFIG, key: 0})
  cfg = ModelConfig.from_hf({**LLAMA_HF_CONFIG, key: None})
  assert (cfg.num_kv_heads, cfg.head_dim) == ((4, 64) if key == "num_key_value_heads" else (2, 64))
