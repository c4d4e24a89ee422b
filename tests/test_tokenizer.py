"""Tokenizer: encode/decode, GGUF tokenizer and chat template parity with transformers,
incremental (streaming) detokenization."""

import gzip
import json
import pathlib
import subprocess

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsedec.errors import InputError
from sparsedec.tokenizer import StreamDecoder, Tokenizer
from sparsedec.weights.gguf_file import load_gguf_tokenizer

SHARED = pathlib.Path(__file__).resolve().parent.parent.parent / "shared"
MT_BENCH = SHARED / "prompts" / "mt_bench" / "question.jsonl"
HUMANEVAL = SHARED / "prompts" / "humaneval" / "HumanEval.jsonl.gz"


def sample_texts() -> list[str]:
  texts = ["Once upon a time", "Hello world!", "émoji 🤖 中文 текст", "tabs\tand\nnew lines\r\n",
           "<|im_start|>user\nhi<|im_end|>", "", " leading space", "1234567 89"]
  # SmolLM2's byte-level vocabulary lacks some bytes (0xF1, 0x04, ...): such characters are
  # dropped by transformers too, so parity holds but the round trip is lossy.
  lossy = ["plane 1 \U00040000 and \x04"]
  if MT_BENCH.is_file():
    for line in MT_BENCH.read_text().splitlines()[::8]:
      texts += json.loads(line)["turns"][:1]
  if HUMANEVAL.is_file():
    with gzip.open(HUMANEVAL, "rt") as f:
      texts += [json.loads(line)["prompt"] for line in f][::20]
  return texts + lossy


CHATS = [
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Write a haiku about JAX."}],
]

# What a template sees of each message: None-valued keys (dropped by transformers 5.x) and
# reasoning under its three names (each given one is copied to "thinking" and "reasoning_content").
PROBE_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}|{{ m.content if m.content is defined else 'NO' }}|"
    "{{ 'TC' if m.tool_calls is defined else 'no-tc' }}|"
    "{{ m.reasoning_content if m.reasoning_content is defined else '-' }}|"
    "{{ m.thinking if m.thinking is defined else '-' }}|"
    "{{ m.reasoning if m.reasoning is defined else '-' }}]{% endfor %}")
PROBE_CHATS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": None}],
    [{"role": "assistant", "content": "x", "reasoning": "why"}],
    [{"role": "assistant", "content": "x", "reasoning_content": "rc", "thinking": "own"}],
    [{"role": "assistant", "content": "x", "reasoning_content": None, "thinking": "t"}],
]

HF_TOKENIZER_SCRIPT = r"""
import json, sys
from transformers import AutoTokenizer
job = json.loads(sys.argv[1])
out = {}
for key, spec in job["tokenizers"].items():
  tok = AutoTokenizer.from_pretrained(spec["dir"], gguf_file=spec.get("gguf_file"))
  ids = [tok(t)["input_ids"] for t in job["texts"]]
  out[key] = {"ids": ids, "decoded": [tok.decode(i) for i in ids],
              "decoded_skip": [tok.decode(i, skip_special_tokens=True) for i in ids]}
  if tok.chat_template:
    out[key]["chats"] = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                         for c in job["chats"]]
  out[key]["probes"] = [tok.apply_chat_template(c, chat_template=job["probe_template"],
                                                tokenize=False, add_generation_prompt=False)
                        for c in job["probe_chats"]]
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def stories_tok(stories_hf_dir) -> Tokenizer:
  return Tokenizer.from_dir(stories_hf_dir)


@pytest.fixture(scope="module")
def hf_tokenizer_reference(hf_python, stories_hf_dir, smollm2_gguf):
  """Start transformers on the same texts in the background; returns a waiter."""
  job = json.dumps({"texts": sample_texts(), "chats": CHATS, "probe_template": PROBE_TEMPLATE,
                    "probe_chats": PROBE_CHATS, "tokenizers": {
      "stories": {"dir": str(stories_hf_dir)},
      "smollm2": {"dir": str(smollm2_gguf.parent), "gguf_file": smollm2_gguf.name}}})
  proc = subprocess.Popen([hf_python, "-c", HF_TOKENIZER_SCRIPT, job], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)

  def wait():
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)

  yield wait
  if proc.poll() is None:
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def smol_tok(smollm2_gguf) -> Tokenizer:
  return load_gguf_tokenizer(smollm2_gguf)


# ------------------------------------------------------------------------ transformers parity
def test_matches_transformers(hf_tokenizer_reference, stories_tok, smol_tok):
  ref = hf_tokenizer_reference()
  texts = sample_texts()
  for name, tok in (("stories", stories_tok), ("smollm2", smol_tok)):
    r = ref[name]
    for text, ids, decoded, decoded_skip in zip(texts, r["ids"], r["decoded"],
                                                r["decoded_skip"]):
      assert tok.encode(text) == ids, (name, text)
      assert tok.decode(ids) == decoded, (name, text)
      assert tok.decode(ids, skip_special_tokens=True) == decoded_skip, (name, text)
  assert "chats" not in ref["stories"]
  assert [smol_tok.apply_chat_template(c) for c in CHATS] == ref["smollm2"]["chats"]
  # Messages as transformers 5.x prepares them: None-valued keys dropped, reasoning aliased.
  probe = Tokenizer(stories_tok.backend, {**stories_tok.config, "chat_template": PROBE_TEMPLATE})
  assert [probe.apply_chat_template(c, add_generation_prompt=False)
          for c in PROBE_CHATS] == ref["stories"]["probes"]


# ------------------------------------------------------------------------- encode / decode
def test_stories_encode_decode(stories_tok):
  assert stories_tok.bos_id == 1 and stories_tok.eos_ids == (2,) and stories_tok.add_bos
  for text in ("Once upon a time, there was a little girl named Lily.", "She said: \"hi!\" 42"):
    ids = stories_tok.encode(text)
    assert ids[0] == 1 and 1 not in ids[1:]
    assert stories_tok.decode(ids, skip_special_tokens=True) == text
    assert stories_tok.encode(text, add_bos=False) == ids[1:]


def test_smollm2_encode_decode(smol_tok):
  assert smol_tok.bos_id == 1 and smol_tok.eos_ids == (2,) and not smol_tok.add_bos
  assert smol_tok.encode("<|im_start|>") == [1]
  for text in sample_texts()[:-1]:
    assert smol_tok.decode(smol_tok.encode(text)) == text
  assert smol_tok.decode(smol_tok.encode("\U00040000")) != "\U00040000"   # missing byte 0xF1


def test_saved_tokenizer_reloads_identically(smol_tok, tmp_path):
  smol_tok.save(tmp_path)
  again = Tokenizer.from_dir(tmp_path)
  assert (again.bos_id, again.eos_ids, again.add_bos) == (1, (2,), False)
  for text in sample_texts()[:10]:
    assert again.encode(text) == smol_tok.encode(text)
  assert again.apply_chat_template(CHATS[0]) == smol_tok.apply_chat_template(CHATS[0])


def test_chat_template_helpers(stories_tok):
  with pytest.raises(InputError, match="chat_template"):
    stories_tok.apply_chat_template(CHATS[0])
  tok = Tokenizer(stories_tok.backend, {**stories_tok.config, "chat_template": (
      "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
      "{{ bos_token }}{{ messages[0] | tojson }}{% if add_generation_prompt %}>{% endif %}")})
  assert tok.apply_chat_template([{"role": "user", "content": "é<"}]) == (
      '<s>{"role": "user", "content": "é<"}>')
  with pytest.raises(jinja2.exceptions.TemplateError, match="one message only"):
    tok.apply_chat_template(CHATS[1])


# ------------------------------------------------------------------------------- streaming
def stream(tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool) -> list[str]:
  dec = StreamDecoder(tok, skip_special_tokens=skip)
  pieces, i = [], 0
  for size in chunks:
    pieces.append(dec.feed(ids[i:i + size]))
    i += size
  pieces.append(dec.feed(ids[i:]))
  pieces.append(dec.finish())
  return pieces


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_stream_decoder_concatenates_to_decode(stories_tok, smol_tok, data, skip):
  tok = data.draw(st.sampled_from([stories_tok, smol_tok]))
  # stories260K ids 3..258 are byte-fallback tokens: draw them often to split characters
  id_strategy = st.one_of(st.integers(0, tok.vocab_size - 1), st.integers(0, 300))
  ids = data.draw(st.lists(id_strategy, max_size=40))
  chunks = data.draw(st.lists(st.integers(0, 4), max_size=12))
  pieces = stream(tok, ids, chunks, skip)
  assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


@SETTINGS
@given(data=st.data(), text=st.text(max_size=30))
def test_stream_decoder_never_emits_partial_characters(stories_tok, smol_tok, data, text):
  tok = data.draw(st.sampled_from([stories_tok, smol_tok]))
  ids = tok.encode(text, add_bos=False)
  pieces = stream(tok, ids, [1] * len(ids), skip=False)
  whole = tok.decode(ids)
  assert "".join(pieces) == whole
  if "\ufffd" not in whole:
    assert all("\ufffd" not in piece for piece in pieces)


def test_stream_decoder_takes_ids_from_arrays(stories_tok):
  """Elements of a numpy or JAX id array are fed as single ids (a numpy integer raised "not
  iterable", a 0-d array "iteration over a 0-d array"), and a whole array as ids."""
  import jax.numpy as jnp
  import numpy as np
  ids = np.asarray(stories_tok.encode("Once upon a time, 😀 é"))
  for array in (ids, jnp.asarray(ids)):
    dec = stories_tok.stream_decoder()
    pieces = [dec.feed(i) for i in array] + [dec.finish()]
    assert "".join(pieces) == stories_tok.decode(ids.tolist())
    dec = stories_tok.stream_decoder()
    assert dec.feed(array) + dec.finish() == stories_tok.decode(ids.tolist())


def test_bos_from_the_post_processor_when_the_config_has_no_add_bos_token():
  """A Llama-3-style tokenizer: tokenizer_config.json without add_bos_token, <|begin_of_text|>
  put first by tokenizer.json's TemplateProcessing post-processor (transformers' encode runs it).
  encode adds that BOS too; an explicit add_bos_token in the config still decides."""
  from tokenizers import Tokenizer as Backend
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers
  backend = Backend(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.train_from_iterator(["Once upon a time there was a cat."] * 4, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  bos, eos = backend.token_to_id("<|begin_of_text|>"), backend.token_to_id("<|end_of_text|>")
  config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
  plain = Tokenizer(backend, config).encode("Once upon")
  assert bos not in plain
  backend.post_processor = processors.TemplateProcessing(
      single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
  tok = Tokenizer(backend, config)
  assert (tok.add_bos, tok.add_eos) == (True, False)
  assert tok.encode("Once upon") == [bos] + plain
  assert tok.encode("Once upon", add_bos=False) == plain
  assert Tokenizer(backend, {**config, "add_bos_token": False}).encode("Once upon") == plain
  backend.post_processor = processors.TemplateProcessing(
      single="$A <|end_of_text|>", special_tokens=[("<|end_of_text|>", eos)])
  assert Tokenizer(backend, config).encode("Once upon") == plain + [eos]


def test_chat_template_file_wins_over_the_config_entry(stories_hf_dir, tmp_path):
  """A directory with both a tokenizer_config.json chat_template and a chat_template.jinja (a
  repo that updated the file): transformers renders the file's ("If independent chat template
  file(s) exist, they take priority over template entries in the tokenizer config"); the
  config's entry was used."""
  import shutil
  shutil.copy(stories_hf_dir / "tokenizer.json", tmp_path)
  config = json.loads((stories_hf_dir / "tokenizer_config.json").read_text())
  config["chat_template"] = "OLD{% for m in messages %}{{ m['content'] }}{% endfor %}"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / "chat_template.jinja").write_text(
      "NEW{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
      "{% if add_generation_prompt %}<gen>{% endif %}", encoding="utf-8")
  tok = Tokenizer.from_dir(tmp_path)
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "NEW[user]hi<gen>"
  # Saved over a directory holding another chat_template.jinja, the saved template still loads.
  again = Tokenizer(tok.backend, {**tok.config, "chat_template": "SAVED"})
  again.save(tmp_path)
  assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == "SAVED"


def test_chat_template_generation_blocks_render_their_body(stories_tok):
  """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag, kept in the
  templates of models fine-tuned with TRL's assistant_only_loss) renders as its body, a `set`
  inside staying inside, as in transformers (it was "chat_template does not parse")."""
  tok = Tokenizer(stories_tok.backend, {**stories_tok.config, "chat_template": (
      "{% for m in messages %}{% set mark = '|' %}<{{ m['role'] }}>"
      "{% if m['role'] == 'assistant' %}{% generation %}{% set mark = '!' %}{{ m['content'] }}"
      "{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ mark }}"
      "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")})
  assert tok.apply_chat_template(CHATS[1]) == (
      "<user>Hi|<assistant>Hello!</s>|<user>Write a haiku about JAX.|<assistant>")


def test_chat_prompts_never_end_in_eos(stories_tok):
  """A tokenizer whose encode appends EOS (add_eos_token true, as SFT recipes set it, or an EOS
  in tokenizer.json's post-processor): transformers' apply_chat_template(tokenize=True) adds no
  special tokens to the rendered chat, but `generate --chat`, the bench's --chat-template
  prompts and the GPTQ calibration prompts ended the prompt with EOS, right after the assistant
  header."""
  import argparse

  from sparsedec import bench, cli
  tok = Tokenizer(stories_tok.backend, {**stories_tok.config, "add_eos_token": True,
                                        "chat_template": "{{ bos_token }}{% for m in messages %}"
                                        "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                                        "{% if add_generation_prompt %}[assistant]{% endif %}"})
  assert tok.encode("Once upon")[-1] == 2                  # the plain-text policy is unchanged
  rendered = tok.apply_chat_template([{"role": "user", "content": "Once upon"}])
  expected = tok.encode(rendered, add_bos=False, add_eos=False)
  assert expected[0] == 1 and expected[-1] != 2
  assert cli._prompt_ids(argparse.Namespace(chat="Once upon", system=None), tok) == expected
  assert bench.encode_prompts(tok, ["Once upon"], chat_template=True) == [expected]
  assert tok.encode_chat([{"role": "user", "content": "Once upon"}]) == expected


def test_named_chat_templates_pick_tool_use_given_tools(stories_tok, tmp_path):
  """tokenizer_config.json's chat_template as named templates (Hermes-2-Pro, Command-R: "default"
  and "tool_use"): given tools, transformers renders "tool_use"; the default one was rendered,
  dropping the tools silently, and `save` kept only the default."""
  tools = [{"name": "add", "description": "adds", "parameters": {"type": "object"}}]
  named = [{"name": "default", "template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
           {"name": "tool_use", "template": "TOOLS {{ tools | map(attribute='name') | join(',') }}"
                                            ": {% for m in messages %}{{ m['content'] }}{% endfor %}"}]
  tok = Tokenizer(stories_tok.backend, {**stories_tok.config, "chat_template": named})
  chat = [{"role": "user", "content": "hi"}]
  assert tok.apply_chat_template(chat) == "hi"
  assert tok.apply_chat_template(chat, tools=tools) == "TOOLS add: hi"       # as transformers
  tok.save(tmp_path)
  again = Tokenizer.from_dir(tmp_path)
  assert again.apply_chat_template(chat, tools=tools) == "TOOLS add: hi"
  assert again.apply_chat_template(chat) == "hi"
  no_default = Tokenizer(stories_tok.backend, {**stories_tok.config, "chat_template": named[1:]})
  with pytest.raises(InputError, match=r"\['tool_use'\] include no 'default'"):
    no_default.apply_chat_template(chat)


def test_a_chat_message_that_is_not_a_mapping_is_refused_by_name(stories_tok):
  tok = Tokenizer(stories_tok.backend, {**stories_tok.config, "chat_template": PROBE_TEMPLATE})
  with pytest.raises(InputError, match="chat messages must be mappings .* got str"):
    tok.apply_chat_template(["hi"])
