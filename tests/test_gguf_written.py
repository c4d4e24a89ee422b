"""GGUF loading checked on files this test writes itself with `gguf.GGUFWriter`.

No GGUF of a model we also have in HF form ships with the repository, so the files are made
here the way llama.cpp's converter makes them:

- stories260K (real HF llama checkpoint) -> llama-architecture GGUF: q/k rows permuted into
  llama.cpp's interleaved RoPE order, tensors stored as a mix of F32 / F16 / BF16 / Q8_0 / Q4_0,
  and the SentencePiece vocabulary (pieces, scores, types) read from tokenizer.model;
- a tiny random Qwen2 (numpy) -> HF dir (config.json + safetensors) and a qwen2-architecture
  GGUF (q/k not permuted, q/k/v biases, untied output, byte-level "gpt2" vocabulary);
- broken files: an unsupported architecture, a missing tensor, a missing metadata key.

The GGUF side is compared with `load_hf` on the same weights, with `Tokenizer.from_dir`, and
(when the transformers env is present) with transformers' own GGUF loader.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess

import gguf
import hf_harness
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from safetensors.numpy import save_file

from sparsedec.errors import CheckpointError, UnsupportedConfigError
from sparsedec.model.config import ModelConfig
from sparsedec.tokenizer import Tokenizer
from sparsedec.weights.gguf_file import exact_4bit_grid, load_gguf, load_gguf_tokenizer
from sparsedec.weights.hf import load_hf, params_from_hf_tensors

STORIES_SENTENCES = [
    "Once upon a time, there was a little girl named Lily.",
    "She loved to play outside in the park with her dog, Max!",
    "\"Can I have 12 apples?\" asked Tom. Mom said: \"Yes.\"",
    "The big red ball rolled down the hill and into the pond",
    "naïve café ☃ 日本",                 # bytes the vocabulary lacks: byte fallback
]


# ------------------------------------------------------------------------------- helpers
def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """HF half-split q/k rows -> llama.cpp's interleaved rows (convert_hf_to_gguf.py permute)."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def readme_unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """The inverse, exactly as ../shared/README.md states it (kept independent of the loader)."""
  d_out, d_in = w.shape
  return w.reshape(n_heads, d_out // n_heads // 2, 2, d_in).transpose(0, 2, 1, 3).reshape(
      d_out, d_in)


def stored(w: np.ndarray, qtype: Q) -> np.ndarray:
  """What a `qtype` tensor in the file holds, in the form GGUFWriter.add_tensor takes."""
  if qtype == Q.F32:
    return np.ascontiguousarray(w, np.float32)
  if qtype == Q.F16:
    return np.ascontiguousarray(w, np.float16)
  if qtype in (Q.F64, Q.I32):          # written from the numpy dtype (gguf cannot dequantize them)
    return np.ascontiguousarray(w, np.float64 if qtype == Q.F64 else np.int32)
  return gguf.quants.quantize(np.ascontiguousarray(w, np.float32), qtype)


def round_trip(w: np.ndarray, qtype: Q) -> np.ndarray:
  """w as a reader of the file sees it (float32, same shape)."""
  return np.asarray(gguf.quants.dequantize(stored(w, qtype), qtype), np.float32).reshape(w.shape)


def quant_bound(w: np.ndarray, qtype: Q) -> np.ndarray:
  """Elementwise bound on |round_trip(w) - w| for each storage type (w: [Out, In])."""
  mag = np.abs(w)
  if qtype == Q.F32:
    return np.zeros_like(w)
  if qtype == Q.F16:
    return mag * 2.0 ** -11 + 2.0 ** -24
  if qtype == Q.BF16:
    return mag * 2.0 ** -8
  block = np.repeat(mag.reshape(w.shape[0], -1, 32).max(-1), 32, axis=-1)   # per 32-block max
  if qtype == Q.Q8_0:                   # step amax/127: half a step, plus the f16 block scale
    return block / 127 * 0.6
  # Q4_0: step amax/8 with levels -8..7 signed so that the extreme value is exact; values of the
  # other sign near -amax clamp at 7 steps, so up to one full step.
  return block / 8 * 1.1


def write_gguf(path: pathlib.Path, arch: str, kv: dict, tensors: list[tuple[str, np.ndarray, Q]]
               ) -> pathlib.Path:
  """kv: writer method name -> argument(s); tensors: (GGUF name, [Out, In] float array, type)."""
  writer = gguf.GGUFWriter(str(path), arch)
  for method, value in kv.items():
    getattr(writer, method)(*(value if isinstance(value, tuple) else (value,)))
  for name, w, qtype in tensors:
    data = stored(w, qtype)
    writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def hf_named(cfg, params) -> dict[str, np.ndarray]:
  """Our fused params split back into HF-named tensors ([Out, In] for linear weights)."""
  hq, hkv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
  out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
  if "lm_head" in params:
    out["lm_head.weight"] = params["lm_head"].T
  for i, layer in enumerate(params["layers"]):
    p = f"model.layers.{i}."
    wqkv, gu = layer["wqkv"], layer["w_gate_up"]
    out.update({p + "self_attn.q_proj.weight": wqkv[:, :hq].T,
                p + "self_attn.k_proj.weight": wqkv[:, hq:hq + hkv].T,
                p + "self_attn.v_proj.weight": wqkv[:, hq + hkv:].T,
                p + "self_attn.o_proj.weight": layer["wo"].T,
                p + "mlp.gate_proj.weight": gu[:, :f].T, p + "mlp.up_proj.weight": gu[:, f:].T,
                p + "mlp.down_proj.weight": layer["w_down"].T,
                p + "input_layernorm.weight": layer["attn_norm"],
                p + "post_attention_layernorm.weight": layer["mlp_norm"]})
    if "bqkv" in layer:
      b = layer["bqkv"]
      out.update({p + "self_attn.q_proj.bias": b[:hq], p + "self_attn.k_proj.bias": b[hq:hq + hkv],
                  p + "self_attn.v_proj.bias": b[hq + hkv:]})
  return {k: np.asarray(v) for k, v in out.items()}


def assert_same_tree(a, b):
  """Same nested dict/list structure, dtypes and values (exact)."""
  if isinstance(a, dict):
    assert isinstance(b, dict) and sorted(a) == sorted(b), (sorted(a), sorted(b))
    for k in a:
      assert_same_tree(a[k], b[k])
  elif isinstance(a, list):
    assert isinstance(b, list) and len(a) == len(b)
    for x, y in zip(a, b):
      assert_same_tree(x, y)
  else:
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def read_sentencepiece_model(path: pathlib.Path) -> list[tuple[str, float, int]]:
  """(piece, score, type) of a sentencepiece tokenizer.model, without `sentencepiece`.

  ModelProto field 1 is `repeated SentencePiece pieces`; SentencePiece has piece=1 (string),
  score=2 (float) and type=3 (enum NORMAL=1 UNKNOWN=2 CONTROL=3 USER_DEFINED=4 UNUSED=5 BYTE=6,
  default NORMAL), the same numbering as gguf.TokenType.
  """
  def varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
      b = buf[i]
      i += 1
      value |= (b & 0x7F) << shift
      shift += 7
      if b < 0x80:
        return value, i

  def fields(buf: bytes):
    i = 0
    while i < len(buf):
      key, i = varint(buf, i)
      num, wire = key >> 3, key & 7
      if wire == 0:
        value, i = varint(buf, i)
      elif wire == 1:
        value, i = buf[i:i + 8], i + 8
      elif wire == 2:
        n, i = varint(buf, i)
        value, i = buf[i:i + n], i + n
      elif wire == 5:
        value, i = buf[i:i + 4], i + 4
      else:
        raise ValueError(f"protobuf wire type {wire} not expected in tokenizer.model")
      yield num, value

  pieces = []
  for num, value in fields(path.read_bytes()):
    if num != 1:
      continue
    piece, score, kind = "", 0.0, 1
    for n, v in fields(value):
      if n == 1:
        piece = v.decode("utf-8")
      elif n == 2:
        score = struct.unpack("<f", v)[0]
      elif n == 3:
        kind = v
    pieces.append((piece, score, kind))
  return pieces


# -------------------------------------------------------------------- stories260K as GGUF
STORIES_TYPES = (Q.F32, Q.F16, Q.Q8_0, Q.BF16, Q.Q4_0)
STORIES_LAYER = {  # GGUF name in a block -> HF name after "model.layers.N."
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def stories_tensor_plan(hf: dict[str, np.ndarray], heads: int, kv_heads: int):
  """[(GGUF name, HF name, array as stored (permuted for q/k), type)] for stories260K.

  Norms stay F32 (as llama.cpp writes them), the embedding is Q8_0, and each layer's matrices
  cycle through STORIES_TYPES; a matrix whose input width is no multiple of 32 (ffn_down, 172)
  cannot be block-quantized and falls back to F16.
  """
  plan = [("token_embd.weight", "model.embed_tokens.weight", hf["model.embed_tokens.weight"],
           Q.Q8_0),
          ("output_norm.weight", "model.norm.weight", hf["model.norm.weight"], Q.F32)]
  for i in range(5):
    for j, (short, hf_short) in enumerate(STORIES_LAYER.items()):
      hf_name = f"model.layers.{i}.{hf_short}"
      w = hf[hf_name]
      if w.ndim == 1:
        qtype = Q.F32
      else:
        qtype = STORIES_TYPES[(i + j) % len(STORIES_TYPES)]
        if qtype in (Q.Q8_0, Q.Q4_0) and w.shape[1] % 32:
          qtype = Q.F16
      if short == "attn_q.weight":
        w = llama_cpp_permute(w, heads)
      elif short == "attn_k.weight":
        w = llama_cpp_permute(w, kv_heads)
      plan.append((f"blk.{i}.{short}", hf_name, w, qtype))
  return plan


def stories_kv(pieces, head_count=8, head_count_kv=4, block_count=5) -> dict:
  """llama.* metadata and the SentencePiece vocabulary as llama.cpp's converter writes them."""
  return {
      "add_name": "stories260K",
      "add_vocab_size": 512, "add_context_length": 512, "add_embedding_length": 64,
      "add_feed_forward_length": 172, "add_block_count": block_count,
      "add_head_count": head_count, "add_head_count_kv": head_count_kv,
      "add_rope_dimension_count": 8, "add_rope_freq_base": 10000.0,
      "add_layer_norm_rms_eps": 1e-5, "add_file_type": 1,
      "add_tokenizer_model": "llama", "add_tokenizer_pre": "default",
      "add_token_list": [p for p, _, _ in pieces], "add_token_scores": [s for _, s, _ in pieces],
      "add_token_types": [t for _, _, t in pieces],
      "add_bos_token_id": 1, "add_eos_token_id": 2, "add_unk_token_id": 0,
      "add_add_bos_token": True, "add_add_eos_token": False,
  }


@pytest.fixture(scope="module")
def stories_hf_tensors(stories_hf_dir) -> dict[str, np.ndarray]:
  with safe_open(str(stories_hf_dir / "model.safetensors"), framework="numpy") as f:
    return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)


@pytest.fixture(scope="module")
def stories_gguf(stories_hf_dir, stories_hf_tensors, tmp_path_factory):
  """(path, plan) of stories260K written as a llama GGUF (mixed F32/F16/BF16/Q8_0/Q4_0)."""
  pieces = read_sentencepiece_model(stories_hf_dir / "tokenizer.model")
  plan = stories_tensor_plan(stories_hf_tensors, 8, 4)
  path = tmp_path_factory.mktemp("gguf") / "stories260K.gguf"
  write_gguf(path, "llama", stories_kv(pieces), [(g, w, q) for g, _, w, q in plan])
  return path, plan


@pytest.fixture(scope="module")
def stories_loaded(stories_gguf):
  return load_gguf(stories_gguf[0])


def test_sentencepiece_model_reader_agrees_with_tokenizer_json(stories_hf_dir):
  pieces = read_sentencepiece_model(stories_hf_dir / "tokenizer.model")
  vocab = json.loads((stories_hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
  assert len(pieces) == len(vocab) == 512
  assert all(vocab[p] == i for i, (p, _, _) in enumerate(pieces))
  kinds = [t for _, _, t in pieces]
  assert kinds[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
  assert set(kinds[3:259]) == {gguf.TokenType.BYTE} and pieces[3][0] == "<0x00>"
  assert set(kinds[259:]) == {gguf.TokenType.NORMAL}
  assert len({s for _, s, _ in pieces[259:]}) > 200            # real, distinct merge scores


def test_readme_unpermutation_inverts_llama_cpp_permutation():
  w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
  for heads in (1, 2, 6):
    np.testing.assert_array_equal(readme_unpermute(llama_cpp_permute(w, heads), heads), w)
  assert not np.array_equal(llama_cpp_permute(w, 6), w)


def test_stories_gguf_config_matches_hf(stories_hf_dir, stories_loaded, stories_gguf):
  cfg_hf, _ = load_hf(stories_hf_dir)
  cfg, params, _ = stories_loaded
  # GGUF stores the RMSNorm epsilon as float32, so 1e-5 comes back as 9.99999974738e-06: the
  # same float32 the forward uses, a different Python float.
  assert np.float32(cfg.rms_norm_eps) == np.float32(cfg_hf.rms_norm_eps)
  assert cfg.replace(rms_norm_eps=cfg_hf.rms_norm_eps) == cfg_hf
  assert cfg.tie_word_embeddings and "lm_head" not in params
  assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.dtype) == (1, (2,), "float32")
  cfg16, params16, _ = load_gguf(stories_gguf[0], dtype="bfloat16")
  assert cfg16 == cfg.replace(dtype="bfloat16")
  assert params16["layers"][2]["wqkv"].dtype == ml_dtypes.bfloat16



def test_gguf_end_of_turn_tokens_stop_generation(stories_hf_dir, stories_hf_tensors, tmp_path):
  """tokenizer.ggml.eot_token_id / eom_token_id (Llama 3.1's <|eot_id|>, <|eom_id|>) are
  end-of-generation tokens in llama.cpp (special_eog_ids): they join the eos id in the default
  stop set (cfg.eos_token_ids) and the tokenizer's eos_ids, as generation_config.json's eos list
  does for an HF directory."""
  pieces = read_sentencepiece_model(stories_hf_dir / "tokenizer.model")
  plan = stories_tensor_plan(stories_hf_tensors, 8, 4)
  kv = dict(stories_kv(pieces), add_eot_token_id=5, add_eom_token_id=6)
  path = write_gguf(tmp_path / "eot.gguf", "llama", kv, [(g, w, q) for g, _, w, q in plan])
  cfg, _, tok = load_gguf(path)
  assert cfg.eos_token_ids == (2, 5, 6) and tok.eos_ids == (2, 5, 6)
  assert load_gguf_tokenizer(path).eos_ids == (2, 5, 6)
  kv = dict(stories_kv(pieces), add_eot_token_id=2)              # eot == eos: listed once
  path = write_gguf(tmp_path / "eot2.gguf", "llama", kv, [(g, w, q) for g, _, w, q in plan])
  cfg, _, tok = load_gguf(path)
  assert cfg.eos_token_ids == (2,) and tok.eos_ids == (2,)

def test_stories_gguf_params_match_hf(stories_hf_dir, stories_hf_tensors, stories_gguf,
                                      stories_loaded):
  cfg, params, _ = stories_loaded
  _, plan = stories_gguf
  cfg_hf, params_hf = load_hf(stories_hf_dir)
  ours, theirs = hf_named(cfg, params), hf_named(cfg_hf, params_hf)
  assert sorted(ours) == sorted(theirs) == sorted(stories_hf_tensors)
  seen = set()
  for gguf_name, hf_name, _, qtype in plan:
    w, ref = ours[hf_name], theirs[hf_name]
    np.testing.assert_array_equal(ref, stories_hf_tensors[hf_name])
    if qtype == Q.F32:
      np.testing.assert_array_equal(w, ref, err_msg=gguf_name)
    else:
      err = np.abs(w.astype(np.float64) - ref)
      assert (err <= quant_bound(ref, qtype)).all(), (gguf_name, qtype.name, err.max())
      assert not np.array_equal(w, ref), (gguf_name, qtype.name)     # it really was rounded
    seen.add((hf_name.split(".")[-2], qtype))
  assert {q for _, q in seen} == set(STORIES_TYPES)
  assert {("q_proj", q) for q in STORIES_TYPES} <= seen     # q rows un-permuted in every format

  # Exactly what the file holds: each tensor dequantized, un-permuted with the README's formula.
  expected = {}
  for gguf_name, hf_name, w, qtype in plan:
    got = round_trip(w, qtype)
    if gguf_name.endswith("attn_q.weight"):
      got = readme_unpermute(got, cfg.num_heads)
    elif gguf_name.endswith("attn_k.weight"):
      got = readme_unpermute(got, cfg.num_kv_heads)
    expected[hf_name] = got
  assert_same_tree(params, params_from_hf_tensors(cfg, list(expected), expected.__getitem__))


def test_stories_gguf_tokenizer_matches_tokenizer_json(stories_hf_dir, stories_loaded,
                                                        stories_gguf):
  _, _, tok = stories_loaded
  ref = Tokenizer.from_dir(stories_hf_dir)
  assert (tok.bos_id, tok.eos_ids, tok.add_bos, tok.add_eos) == (1, (2,), True, False)
  assert tok.vocab_size == ref.vocab_size == 512
  for text in STORIES_SENTENCES:
    ids = tok.encode(text)
    assert ids == ref.encode(text), text
    assert ids[0] == 1 and len(ids) > 3
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=True) == text
  assert tok.decode([1, 400, 2]) == ref.decode([1, 400, 2])
  assert any(3 <= i < 259 for i in tok.encode(STORIES_SENTENCES[-1]))  # byte-fallback pieces
  # the tokenizer alone, without dequantizing a tensor
  assert load_gguf_tokenizer(stories_gguf[0]).encode(STORIES_SENTENCES[0]) == ref.encode(
      STORIES_SENTENCES[0])


def test_llama_attention_biases_are_unpermuted_like_weights(stories_hf_dir, stories_hf_tensors,
                                                             tmp_path):
  """llama.cpp's converter permutes q_proj.bias / k_proj.bias rows along with the weights
  (LlamaModel.modify_tensors): a llama GGUF with attention_bias must un-permute them too."""
  rng = np.random.default_rng(3)
  hf = dict(stories_hf_tensors)
  for i in range(5):
    for proj, n in (("q", 64), ("k", 32), ("v", 32), ("o", 64)):
      hf[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = rng.standard_normal(n).astype(
          np.float32)
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  save_file(hf, str(hf_dir / "model.safetensors"))
  config = json.loads((stories_hf_dir / "config.json").read_text())
  (hf_dir / "config.json").write_text(json.dumps(dict(config, attention_bias=True)))
  gguf_names = {v: k for k, v in STORIES_LAYER.items()}
  gguf_names.update({f"self_attn.{p}_proj.bias": f"attn_{s}.bias"
                     for p, s in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))})
  tensors = [("token_embd.weight", hf["model.embed_tokens.weight"], Q.F32),
             ("output_norm.weight", hf["model.norm.weight"], Q.F32)]
  for name, w in hf.items():
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      if rest.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):
        w = llama_cpp_permute(w, 8 if ".q_proj." in rest else 4)
      tensors.append((f"blk.{i}.{gguf_names[rest]}", w, Q.F32))
  pieces = read_sentencepiece_model(stories_hf_dir / "tokenizer.model")
  path = write_gguf(tmp_path / "biased.gguf", "llama", stories_kv(pieces), tensors)
  cfg_hf, params_hf = load_hf(hf_dir)
  cfg, params, _ = load_gguf(path)
  assert cfg.qkv_bias and cfg.o_bias and cfg_hf.qkv_bias and cfg_hf.o_bias
  assert_same_tree(params, params_hf)


def llama_cpp_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                           high_freq_factor: float, original_max_position_embeddings: int
                           ) -> np.ndarray:
  """[D/2] float32: the `rope_freqs.weight` llama.cpp's converter writes for llama3 scaling
  (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors; kept independent of the loader)."""
  freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  low_wavelen = original_max_position_embeddings / low_freq_factor
  high_wavelen = original_max_position_embeddings / high_freq_factor
  factors = []
  for freq in freqs:
    wavelen = 2 * np.pi / freq
    if wavelen < high_wavelen:
      factors.append(1.0)
    elif wavelen > low_wavelen:
      factors.append(factor)
    else:
      smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
          high_freq_factor - low_freq_factor)
      factors.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(factors, np.float32)


def test_llama3_rope_freqs_tensor_equals_the_hf_llama3_config(stories_hf_dir, stories_hf_tensors,
                                                               tmp_path):
  """Llama-3.1/3.2 GGUFs carry llama3 RoPE scaling as a `rope_freqs.weight` tensor, not as
  metadata. stories260K given llama3 scaling (original context 16: of its 4 frequencies one is
  smoothed, three divided by 8) both ways: its logits over 40 positions equal the HF config's;
  without the tensor they do not. The factors survive a config round trip (`convert`); factors
  of the wrong length, or beside a rope.scaling.type, are refused, naming the tensor."""
  scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 16}
  config = json.loads((stories_hf_dir / "config.json").read_text())
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  save_file(dict(stories_hf_tensors), str(hf_dir / "model.safetensors"))
  (hf_dir / "config.json").write_text(json.dumps(dict(config, rope_scaling=dict(
      scaling, rope_type="llama3"))))
  cfg_hf, params_hf = load_hf(hf_dir)
  factors = llama_cpp_rope_factors(8, 10000.0, **scaling)
  assert factors[0] == pytest.approx(1.736, abs=1e-3) and factors[1:].tolist() == [8.0] * 3
  pieces = read_sentencepiece_model(stories_hf_dir / "tokenizer.model")
  tensors = [(g, w, Q.F32) for g, _, w, _ in stories_tensor_plan(stories_hf_tensors, 8, 4)]
  path = write_gguf(tmp_path / "llama3.gguf", "llama", stories_kv(pieces),
                    tensors + [("rope_freqs.weight", factors, Q.F32)])
  cfg, params, _ = load_gguf(path)
  assert cfg.rope_scaling.kind == "freq_factors"
  assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
  ids = list(range(3, 43))
  logits = hf_harness.forward_logits(cfg, params, ids)
  ref = hf_harness.forward_logits(cfg_hf, params_hf, ids)
  np.testing.assert_allclose(logits, ref, atol=2e-4, rtol=1e-4)
  unscaled = hf_harness.forward_logits(cfg.replace(rope_scaling=None), params, ids)
  assert np.abs(unscaled - ref).max() > 0.1
  short = write_gguf(tmp_path / "short.gguf", "llama", stories_kv(pieces),
                     tensors + [("rope_freqs.weight", factors[:3], Q.F32)])
  with pytest.raises(UnsupportedConfigError, match=r"rope_freqs\.weight.*3 freq_factors"):
    load_gguf(short)
  both = write_gguf(tmp_path / "both.gguf", "llama",
                    dict(stories_kv(pieces), add_rope_scaling_type=gguf.RopeScalingType.LINEAR,
                         add_rope_scaling_factor=2.0),
                    tensors + [("rope_freqs.weight", factors, Q.F32)])
  with pytest.raises(UnsupportedConfigError, match="one RoPE scaling"):
    load_gguf(both)


# ------------------------------------------------------------------------ tiny Qwen2 as GGUF
QWEN = {"hidden": 64, "inter": 96, "layers": 2, "heads": 4, "kv_heads": 2, "theta": 1e6,
        "eps": 1e-6, "ctx": 256}
QWEN_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ c", "a t", "Ġc at", "o n", "Ġ s"]
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TEXTS = ["the cat sat on the mat", "Hello, world! 123 ünïcode",
              "<|im_start|>user\nhi<|im_end|>"]


def byte_level_vocab() -> list[str]:
  """GPT-2's 256 byte symbols in byte order, then the merged tokens, then the specials."""
  table = {}
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + len([c for c in table.values() if ord(c) >= 256]))
  tokens = [table[b] for b in range(256)] + [m.replace(" ", "") for m in QWEN_MERGES]
  return tokens + QWEN_SPECIAL


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory):
  """(HF dir, GGUF path) of one tiny random Qwen2 (untied head, q/k/v biases, all F32)."""
  tokens = byte_level_vocab()
  c = {**QWEN, "vocab": len(tokens)}
  d = c["hidden"] // c["heads"]
  rng = np.random.default_rng(7)

  def rand(*shape):
    return (rng.standard_normal(shape) * 0.2).astype(np.float32)

  hf = {"model.embed_tokens.weight": rand(c["vocab"], c["hidden"]),
        "model.norm.weight": 1 + rand(c["hidden"]), "lm_head.weight": rand(c["vocab"], c["hidden"])}
  for i in range(c["layers"]):
    p = f"model.layers.{i}."
    hf.update({
        p + "self_attn.q_proj.weight": rand(c["heads"] * d, c["hidden"]),
        p + "self_attn.k_proj.weight": rand(c["kv_heads"] * d, c["hidden"]),
        p + "self_attn.v_proj.weight": rand(c["kv_heads"] * d, c["hidden"]),
        p + "self_attn.q_proj.bias": rand(c["heads"] * d),
        p + "self_attn.k_proj.bias": rand(c["kv_heads"] * d),
        p + "self_attn.v_proj.bias": rand(c["kv_heads"] * d),
        p + "self_attn.o_proj.weight": rand(c["hidden"], c["heads"] * d),
        p + "mlp.gate_proj.weight": rand(c["inter"], c["hidden"]),
        p + "mlp.up_proj.weight": rand(c["inter"], c["hidden"]),
        p + "mlp.down_proj.weight": rand(c["hidden"], c["inter"]),
        p + "input_layernorm.weight": 1 + rand(c["hidden"]),
        p + "post_attention_layernorm.weight": 1 + rand(c["hidden"])})
  root = tmp_path_factory.mktemp("qwen2")
  hf_dir = root / "hf"
  hf_dir.mkdir()
  save_file(hf, str(hf_dir / "model.safetensors"))
  eos = tokens.index("<|im_end|>")
  (hf_dir / "config.json").write_text(json.dumps({
      "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": c["vocab"],
      "hidden_size": c["hidden"], "intermediate_size": c["inter"],
      "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
      "num_key_value_heads": c["kv_heads"], "max_position_embeddings": c["ctx"],
      "rms_norm_eps": c["eps"], "rope_theta": c["theta"], "tie_word_embeddings": False,
      "hidden_act": "silu", "use_sliding_window": False, "eos_token_id": eos,
      "torch_dtype": "float32"}))

  inverse = {v: k for k, v in STORIES_LAYER.items()}
  inverse.update({"self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                  "self_attn.v_proj.bias": "attn_v.bias"})
  tensors = [("token_embd.weight", hf["model.embed_tokens.weight"], Q.F32),
             ("output_norm.weight", hf["model.norm.weight"], Q.F32),
             ("output.weight", hf["lm_head.weight"], Q.F32)]
  for name, w in hf.items():
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      tensors.append((f"blk.{i}.{inverse[rest]}", w, Q.F32))       # q/k NOT permuted
  types = [gguf.TokenType.CONTROL if t in QWEN_SPECIAL else gguf.TokenType.NORMAL for t in tokens]
  kv = {"add_name": "tiny-qwen2", "add_context_length": c["ctx"],
        "add_embedding_length": c["hidden"], "add_feed_forward_length": c["inter"],
        "add_block_count": c["layers"], "add_head_count": c["heads"],
        "add_head_count_kv": c["kv_heads"], "add_rope_freq_base": c["theta"],
        "add_layer_norm_rms_eps": c["eps"], "add_file_type": 0,
        "add_tokenizer_model": "gpt2", "add_tokenizer_pre": "qwen2", "add_token_list": tokens,
        "add_token_types": types, "add_token_merges": QWEN_MERGES,
        "add_eos_token_id": eos, "add_pad_token_id": tokens.index("<|endoftext|>"),
        "add_bos_token_id": tokens.index("<|endoftext|>"), "add_add_bos_token": False}
  path = write_gguf(root / "tiny-qwen2.gguf", "qwen2", kv, tensors)
  return hf_dir, path


def test_qwen2_gguf_params_equal_hf(qwen_files):
  hf_dir, path = qwen_files
  cfg_hf, params_hf = load_hf(hf_dir)
  cfg, params, tok = load_gguf(path)
  assert cfg.family == "qwen2" and cfg.qkv_bias and not cfg.o_bias
  assert not cfg.tie_word_embeddings and "lm_head" in params
  assert "bqkv" in params["layers"][1]
  assert np.float32(cfg.rms_norm_eps) == np.float32(cfg_hf.rms_norm_eps)
  # bos: config.json names none; the GGUF names <|endoftext|>, as Qwen2 GGUFs do.
  assert cfg.replace(rms_norm_eps=cfg_hf.rms_norm_eps, bos_token_id=None) == cfg_hf
  assert_same_tree(params, params_hf)
  # byte-level BPE with the file's merges and the qwen2 split
  the = byte_level_vocab().index("Ġthe")
  ids = tok.encode(QWEN_TEXTS[0])
  assert the in ids and byte_level_vocab().index("Ġcat") in ids
  for text in QWEN_TEXTS:
    assert tok.decode(tok.encode(text)) == text
  assert tok.encode("<|im_start|>")[0] == byte_level_vocab().index("<|im_start|>")
  assert tok.eos_ids == (byte_level_vocab().index("<|im_end|>"),) and not tok.add_bos


@pytest.mark.parametrize("flag", [None, True, False])
def test_gguf_add_bos_token_flag_and_its_default_per_tokenizer_model(stories_gguf, qwen_files,
                                                                     flag):
  """encode adds BOS as transformers 5.24's AutoTokenizer(gguf_file=...) does (probed on these
  two files with the flag removed): tokenizer.ggml.add_bos_token where the file has it, else on
  for a sentencepiece ("llama") vocabulary and off for a byte-level ("gpt2") one, which has a
  bos_token_id here (Qwen's <|endoftext|>) but no BOS in its prompts."""
  from sparsedec.weights.gguf_file import _reader, read_metadata, tokenizer_from_metadata
  for path, default in ((stories_gguf[0], True), (qwen_files[1], False)):
    meta = read_metadata(_reader(str(path)))
    meta.pop("tokenizer.ggml.add_bos_token", None)
    if flag is not None:
      meta["tokenizer.ggml.add_bos_token"] = flag
    tok = tokenizer_from_metadata(meta)
    plain = tok.encode("Once upon", add_bos=False)
    assert tok.bos_id is not None and tok.bos_id not in plain
    want = default if flag is None else flag
    assert tok.encode("Once upon") == ([tok.bos_id] if want else []) + plain, (path.name, flag)


def test_gguf_user_defined_tokens_are_added_but_not_special(qwen_files):
  """tokenizer.ggml.token_type USER_DEFINED (4) tokens are added whole but not special, CONTROL
  (3) ones special, as transformers 5.24's add_gguf_special_tokens does: decoding with
  skip_special_tokens drops <|im_end|> and keeps a user-defined "in" (no written file had one)."""
  from sparsedec.weights.gguf_file import _reader, read_metadata, tokenizer_from_metadata
  meta = read_metadata(_reader(str(qwen_files[1])))
  tokens = meta["tokenizer.ggml.tokens"]
  user, control = tokens.index("in"), tokens.index("<|im_end|>")
  types = list(meta["tokenizer.ggml.token_type"])
  assert (types[user], types[control]) == (1, 3)
  types[user] = 4
  tok = tokenizer_from_metadata(dict(meta, **{"tokenizer.ggml.token_type": types}))
  added = tok.backend.get_added_tokens_decoder()
  assert user in added and not added[user].special and added[control].special
  assert user not in tok.special_ids and control in tok.special_ids
  assert tok.decode([user, control], skip_special_tokens=True) == "in"
  assert tok.decode([user, control]) == "in<|im_end|>"
  assert user in tok.encode("think", add_bos=False)          # matched whole, before the BPE


def test_gguf_byte_level_control_token_outside_the_byte_alphabet_is_skipped(qwen_files):
  """A byte-level vocabulary spells every token in GPT-2's byte alphabet; a CONTROL token with
  another character (a llama.cpp mislabel) is skipped as transformers 5.24 skips it: added as a
  special token it got an id past the vocabulary (more ids than the model has logits)."""
  from sparsedec.weights.gguf_file import _reader, read_metadata, tokenizer_from_metadata
  meta = read_metadata(_reader(str(qwen_files[1])))
  tokens = list(meta["tokenizer.ggml.tokens"]) + ["a b"]               # " " is not in it
  types = list(meta["tokenizer.ggml.token_type"]) + [3]
  tok = tokenizer_from_metadata(dict(meta, **{"tokenizer.ggml.tokens": tokens,
                                              "tokenizer.ggml.token_type": types}))
  assert tok.vocab_size == len(tokens)
  assert len(tokens) - 1 not in tok.special_ids
  assert tok.special_ids == {tokens.index(t) for t in QWEN_SPECIAL}


def test_exact_4bit_grid_reads_the_linears_types(stories_gguf, smollm2_gguf, tmp_path):
  """(32, "minmax") when every linear is Q4_1 (the SmolLM2 file), (32, "absmax") when every one
  is Q4_0, None for mixed types (the written stories260K file) or a 16-bit linear, a named error
  for a missing file. Only the tensor table is read."""
  assert exact_4bit_grid(smollm2_gguf) == (32, "minmax")
  assert exact_4bit_grid(stories_gguf[0]) is None
  w = np.asarray(np.random.default_rng(0).normal(size=(64, 64)), np.float32)
  linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

  def file(name, types):
    tensors = [(f"blk.0.{n}.weight", w, t) for n, t in zip(linears, types)]
    tensors.append(("blk.0.attn_norm.weight", w[0], Q.F32))     # not a linear: any type
    return write_gguf(tmp_path / name, "llama", {}, tensors)

  assert exact_4bit_grid(file("q4_0.gguf", [Q.Q4_0] * 7)) == (32, "absmax")
  assert exact_4bit_grid(file("q4_1.gguf", [Q.Q4_1] * 7)) == (32, "minmax")
  assert exact_4bit_grid(file("mixed.gguf", [Q.Q4_0] * 6 + [Q.Q4_1])) is None
  assert exact_4bit_grid(file("f16.gguf", [Q.F16] * 7)) is None
  with pytest.raises(CheckpointError, match="GGUF file not found"):
    exact_4bit_grid(tmp_path / "absent.gguf")


# -------------------------------------------------------------------------- broken files
def test_unsupported_architecture_is_named(tmp_path):
  path = write_gguf(tmp_path / "g.gguf", "gemma2", {
      "add_block_count": 1, "add_embedding_length": 8, "add_feed_forward_length": 16,
      "add_head_count": 2, "add_tokenizer_model": "llama", "add_token_list": ["<unk>", "a"]},
      [("token_embd.weight", np.zeros((2, 8), np.float32), Q.F32)])
  with pytest.raises(UnsupportedConfigError, match=r"general\.architecture 'gemma2'.*llama"):
    load_gguf(path)


def test_missing_tensor_and_metadata_are_named(stories_hf_dir, stories_hf_tensors, tmp_path):
  pieces = read_sentencepiece_model(stories_hf_dir / "tokenizer.model")
  plan = stories_tensor_plan(stories_hf_tensors, 8, 4)
  tensors = [(g, w, q) for g, _, w, q in plan if g != "blk.3.ffn_down.weight"]
  path = write_gguf(tmp_path / "missing.gguf", "llama", stories_kv(pieces), tensors)
  with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.down_proj\.weight.* missing"):
    load_gguf(path)
  kv = stories_kv(pieces)
  del kv["add_block_count"]
  path = write_gguf(tmp_path / "no_blocks.gguf", "llama", kv, [(g, w, q) for g, _, w, q in plan])
  with pytest.raises(CheckpointError, match=r"'llama\.block_count' is missing"):
    load_gguf(path)
  # one block fewer than the tensors: the extra block's tensors are named
  path = write_gguf(tmp_path / "extra.gguf", "llama", stories_kv(pieces, block_count=4),
                    [(g, w, q) for g, _, w, q in plan])
  with pytest.raises(CheckpointError, match=r"model\.layers\.4\."):
    load_gguf(path)
  with pytest.raises(CheckpointError, match="not found"):
    load_gguf(tmp_path / "absent.gguf")



@pytest.mark.parametrize("extra, needle", [
    ({"add_rope_dimension_count": 4},
     r"'llama\.rope\.dimension_count' 4 != head dim 8: partial RoPE is not supported"),
    ({"add_rope_scaling_type": gguf.RopeScalingType.YARN, "add_rope_scaling_factor": 4.0},
     r"'llama\.rope\.scaling\.type' 'yarn' is not supported \(supported: none, linear\)"),
    ({"add_sliding_window": 16}, r"'llama\.attention\.sliding_window' \(16\) is not supported"),
    ({"add_expert_count": 8}, r"'llama\.expert_count' \(8\): mixture-of-experts"),
    ({"add_layer_norm_rms_eps": 0.0}, "rms_norm_eps must be > 0"),
], ids=["rope-dims", "yarn", "sliding-window", "experts", "eps"])
def test_unsupported_gguf_metadata_is_named_by_its_key_and_file(stories_hf_dir, stories_hf_tensors,
                                                                tmp_path, extra, needle):
  """Refusals of GGUF metadata name the GGUF key and the file: they named HF attributes the file
  has not ("partial_rotary_factor=0.5", "num_experts=8", "rope_scaling type 'yarn'"), told to
  "remove the key" from a config.json, and named no file."""
  pieces = read_sentencepiece_model(stories_hf_dir / "tokenizer.model")
  plan = stories_tensor_plan(stories_hf_tensors, 8, 4)
  path = write_gguf(tmp_path / "odd.gguf", "llama", dict(stories_kv(pieces), **extra),
                    [(g, w, q) for g, _, w, q in plan])
  with pytest.raises(UnsupportedConfigError, match=rf"odd\.gguf: (GGUF metadata )?{needle}") as err:
    load_gguf(path)
  for hf_only in ("partial_rotary_factor", "num_experts", "rope_scaling", "remove the key"):
    assert hf_only not in str(err.value)


def test_wrongly_sized_llama_q_k_rows_are_named(stories_hf_dir, stories_hf_tensors, tmp_path):
  """A llama q/k weight whose row count is not heads * head_dim gets the shape error naming it,
  not a bare ValueError from the RoPE un-permutation's reshape."""
  pieces = read_sentencepiece_model(stories_hf_dir / "tokenizer.model")
  plan = stories_tensor_plan(stories_hf_tensors, 8, 4)
  for short, rows, hf_short in (("attn_q", 63, "q_proj"), ("attn_k", 30, "k_proj")):
    tensors = [(g, w[:rows] if g == f"blk.0.{short}.weight" else w,
                Q.F32 if g == f"blk.0.{short}.weight" else q) for g, _, w, q in plan]
    path = write_gguf(tmp_path / f"{short}.gguf", "llama", stories_kv(pieces), tensors)
    with pytest.raises(CheckpointError, match=rf"model\.layers\.0\.self_attn\.{hf_short}\.weight"
                       rf"' has shape \({rows}, 64\)"):
      load_gguf(path)


@pytest.mark.parametrize("qtype", [Q.F64, Q.I32], ids=lambda q: q.name)
def test_tensor_type_gguf_cannot_dequantize_is_named(stories_hf_dir, stories_hf_tensors, tmp_path,
                                                     qtype):
  """A tensor stored in a type `gguf.quants.dequantize` has no code for raises the
  UnsupportedConfigError naming the tensor, its type and the file (was a bare
  NotImplementedError naming only the type)."""
  pieces = read_sentencepiece_model(stories_hf_dir / "tokenizer.model")
  plan = stories_tensor_plan(stories_hf_tensors, 8, 4)
  tensors = [(g, w, qtype if g == "output_norm.weight" else q) for g, _, w, q in plan]
  path = write_gguf(tmp_path / f"{qtype.name}.gguf", "llama", stories_kv(pieces), tensors)
  with pytest.raises(UnsupportedConfigError,
                     match=rf"{qtype.name}\.gguf: GGUF tensor 'output_norm\.weight' has type "
                           rf"{qtype.name}"):
    load_gguf(path)

# ----------------------------------------------------- transformers' GGUF loader (optional)
HF_GGUF_SCRIPT = r"""
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
job = json.loads(sys.argv[1])
result = {}
for name, task in job.items():
  d, f = task["file"].rsplit("/", 1)
  model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
  with torch.no_grad():
    logits = model(torch.tensor([task["ids"]])).logits[0].float().numpy()
  np.save(task["out"], logits)
  tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
  result[name] = [tok(t, add_special_tokens=False)["input_ids"] for t in task["texts"]]
print("RESULT" + json.dumps(result))
"""
EDGE_TEXTS = ["  two  spaces ", "trailing space ", "new\nline\n\ttab"]


@pytest.fixture(scope="module")
def transformers_gguf(hf_python, stories_gguf, stories_loaded, qwen_files, tmp_path_factory):
  """Logits and token ids from transformers loading the same two written GGUF files."""
  out = tmp_path_factory.mktemp("hf_gguf")
  stories_ids = stories_loaded[2].encode(STORIES_SENTENCES[0])
  job = {"stories": {"file": str(stories_gguf[0]), "ids": stories_ids,
                     "texts": STORIES_SENTENCES + EDGE_TEXTS, "out": str(out / "stories.npy")},
         "qwen": {"file": str(qwen_files[1]), "ids": [5, 256, 258, 40, 262, 11, 99],
                  "texts": QWEN_TEXTS + EDGE_TEXTS, "out": str(out / "qwen.npy")}}
  env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
             TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
  proc = subprocess.run([str(hf_python), "-c", HF_GGUF_SCRIPT, json.dumps(job)],
                        check=False, capture_output=True, text=True, env=env,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  texts = json.loads(proc.stdout.split("RESULT", 1)[1])
  return {name: (task["ids"], np.load(task["out"]), texts[name]) for name, task in job.items()}


@pytest.mark.parametrize("name", ["stories", "qwen"])
def test_transformers_reads_the_written_gguf_like_us(name, transformers_gguf, stories_loaded,
                                                     qwen_files):
  ids, ref_logits, ref_texts = transformers_gguf[name]
  cfg, params, tok = stories_loaded if name == "stories" else load_gguf(qwen_files[1])
  logits = hf_harness.forward_logits(cfg, params, ids)
  assert hf_harness.relative_logit_error(logits, ref_logits) < 1e-5     # measured ~1e-6
  texts = (STORIES_SENTENCES if name == "stories" else QWEN_TEXTS) + EDGE_TEXTS
  for text, ref in zip(texts, ref_texts):
    assert tok.encode(text, add_bos=False) == ref, text
