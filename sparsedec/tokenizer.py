"""Tokenizer: a `tokenizers.Tokenizer` plus the HF tokenizer_config bits decoding needs.

- encode/decode with the BOS/EOS policy of tokenizer_config.json (`add_bos_token`, ...) or,
  where it has none, of tokenizer.json's post-processor (as transformers encodes);
- `apply_chat_template` renders the config's Jinja chat template the way transformers does
  (sandboxed, trim_blocks, lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`, the
  `{% generation %}` assistant-mask blocks, `continue_final_message`, its defaults; checked
  against transformers 5.24 on the supported families' templates in tests/test_tokenizer.py);
- `StreamDecoder` turns a growing list of ids into text pieces for streaming.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from sparsedec.errors import CheckpointError, InputError, is_int, read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# The named special tokens (transformers' SPECIAL_TOKENS_ATTRIBUTES): template variables too.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _token_text(value: Any) -> str | None:
  """tokenizer_config stores a special token as a string or as {"content": ...}."""
  if isinstance(value, Mapping):
    return value.get("content")
  return value


class Tokenizer:
  """Text <-> token ids, chat template, special ids. Wraps a `tokenizers.Tokenizer`."""

  def __init__(self, backend: BackendTokenizer, config: Mapping[str, Any] | None = None,
               extra_eos_ids: Iterable[int] = ()):
    """backend: the tokenizers object. config: tokenizer_config.json as a dict (bos_token,
    eos_token, add_bos_token, add_eos_token, chat_template, ...). extra_eos_ids: more ids that
    end generation (e.g. generation_config.json's eos_token_id list)."""
    self.backend = backend
    self.config = dict(config or {})
    self.special_tokens = {k: _token_text(self.config.get(k)) for k in SPECIAL_TOKEN_KEYS}
    self.bos_id = self._id_of(self.special_tokens["bos_token"])
    eos = self._id_of(self.special_tokens["eos_token"])
    self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(
        ([eos] if eos is not None else []) + [int(i) for i in extra_eos_ids]))
    # The config's add_bos_token / add_eos_token where it has them; else what tokenizer.json's
    # post-processor adds (Llama 3 ships no add_bos_token: its TemplateProcessing puts
    # <|begin_of_text|> first, and transformers' encode runs it). What it puts before a text and
    # what after is read around a probe text's ids: from "" alone a token that is both BOS and
    # EOS could not be placed, and "$A <eos>" was taken for a BOS (prepended; transformers
    # appends it).
    added = backend.encode("", add_special_tokens=True).ids
    frame = _post_processor_frame(backend, len(added))
    head, tail = frame if frame is not None else (added, added)
    post_bos = self.bos_id is not None and head[:1] == [self.bos_id]
    post_eos = bool(self.eos_ids) and tail[-1:] == [self.eos_ids[0]] and (
        frame is not None or len(added) > 1 or not post_bos)
    self.add_bos = bool(self.config.get("add_bos_token", post_bos))
    self.add_eos = bool(self.config.get("add_eos_token", post_eos))
    self.chat_template: str | None = self.config.get("chat_template")
    # Byte-fallback tokens (<0x41>) are decoded in runs: a following byte can still turn an
    # emitted character into U+FFFD, so streaming holds text that ends in one of them.
    byte_fallback = json.loads(backend.to_str()).get("model", {}).get("byte_fallback", False)
    self.byte_token_ids = frozenset(
        i for t, i in backend.get_vocab().items() if _BYTE_TOKEN.fullmatch(t)
    ) if byte_fallback else frozenset()
    self.special_ids = frozenset(
        i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    # Named templates ([{"name": "default", "template": ...}, {"name": "tool_use", ...}]):
    # chat_template is the default one; apply_chat_template picks "tool_use" when given tools.
    self.chat_templates: dict[str, str] = {}
    if isinstance(self.chat_template, list):
      self.chat_templates = {t.get("name"): t.get("template") for t in self.chat_template}
      self.chat_template = self.chat_templates.get("default")

  def _id_of(self, token: str | None) -> int | None:
    if token is None:
      return None
    token_id = self.backend.token_to_id(token)
    if token_id is None:
      raise CheckpointError(f"special token {token!r} from the tokenizer config is not in the "
                            "vocabulary")
    return token_id

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  # ------------------------------------------------------------------------- encode / decode
  def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None
             ) -> list[int]:
    """Token ids of `text`. add_bos/add_eos default to the tokenizer config's policy.
    Special-token strings in the text (e.g. "<|im_start|>") become their single ids."""
    if not isinstance(text, str):
      raise InputError(f"encode expects a str, got {type(text).__name__}")
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id] + ids
    if (self.add_eos if add_eos is None else add_eos) and self.eos_ids:
      ids = ids + [self.eos_ids[0]]
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
    return StreamDecoder(self, skip_special_tokens)

  # --------------------------------------------------------------------------- chat template
  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = False, tools: Sequence | None = None,
                          documents: Sequence | None = None, chat_template: str | None = None,
                          continue_final_message: bool | str = False, **kwargs: Any) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template, as
    transformers' apply_chat_template(tokenize=False) does (its defaults too:
    add_generation_prompt=False; `encode_chat` adds the generation prompt).
    tools (JSON schemas), documents and extra keyword arguments (enable_thinking=...,
    date_string=...) are passed to the template with the special tokens (bos_token, ...);
    tools and documents are always defined there, None when not given.
    continue_final_message: the text ends where the final message's "content" (or the field it
    names, e.g. "reasoning_content") ends, so generation continues that message (not with
    add_generation_prompt). The template, as transformers chooses it: `chat_template` (the name of
    one of the tokenizer's named templates, or a template's text), else the tokenizer's, its
    "tool_use" one when it has named templates and tools are given."""
    source = self.chat_template
    if chat_template is not None:
      source = self.chat_templates.get(chat_template, chat_template)
    elif tools is not None and self.chat_templates.get("tool_use"):
      source = self.chat_templates["tool_use"]
    if not source:
      if self.chat_templates:
        raise InputError(f"this tokenizer's chat templates {sorted(map(str, self.chat_templates))} "
                         "include no 'default' one")
      raise InputError("this tokenizer has no chat_template")
    if continue_final_message and add_generation_prompt:
      raise InputError("continue_final_message and add_generation_prompt are not compatible: the "
                       "first continues the final message, the second starts a new assistant one")
    template = _compile_template(source)
    variables = {k: v for k, v in self.special_tokens.items() if v is not None}
    variables.update(_plain(kwargs))
    chat = _plain(_chat_messages(messages))
    final = _tag_final_message(chat, continue_final_message, source) if continue_final_message \
        else None
    text = template.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                           add_generation_prompt=add_generation_prompt, **variables)
    return text if final is None else _cut_at_tag(text, final)

  def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                  add_generation_prompt: bool | None = None, **kwargs: Any) -> list[int]:
    """Token ids of the rendered chat to generate from: unlike `apply_chat_template`, with the
    generation prompt unless told otherwise or continuing the final message
    (`continue_final_message`). As transformers' apply_chat_template(tokenize=True), the
    template writes every special token it wants (BOS included), so encode adds neither BOS nor
    EOS (a tokenizer whose encode appends EOS must not end the prompt with it)."""
    if add_generation_prompt is None:
      add_generation_prompt = not kwargs.get("continue_final_message", False)
    text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    return self.encode(text, add_bos=False, add_eos=False)

  # ------------------------------------------------------------------------------- files
  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    """Read tokenizer.json, tokenizer_config.json (optional), chat_template.jinja (optional;
    where present it replaces the config's chat_template, as in transformers) and
    generation_config.json's eos ids (optional) from an HF-style directory."""
    tok_file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(tok_file):
      raise CheckpointError(f"{TOKENIZER_FILE} not found in {path}")
    try:
      backend = BackendTokenizer.from_file(tok_file)
    except Exception as e:       # tokenizers raises a bare Exception ("EOF while parsing ...")
      raise CheckpointError(f"cannot read {tok_file}: {e}") from e
    config = _read_json(os.path.join(path, TOKENIZER_CONFIG_FILE))
    template_file = os.path.join(path, CHAT_TEMPLATE_FILE)
    if os.path.isfile(template_file):   # as transformers: the file wins over the config's entry
      with open(template_file, encoding="utf-8") as f:
        config["chat_template"] = f.read()
    eos = read_generation_config(path).get("eos_token_id")
    extra = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
    return cls(backend, config, extra)

  def save(self, path: str | os.PathLike) -> None:
    """Write tokenizer.json and tokenizer_config.json (chat template included) into `path`."""
    os.makedirs(path, exist_ok=True)
    self.backend.save(os.path.join(path, TOKENIZER_FILE))
    config = dict(self.config)
    if self.chat_templates:               # the named templates, the default as it is now
      config["chat_template"] = [{"name": name, "template": template} for name, template in
                                 {**self.chat_templates, "default": self.chat_template}.items()
                                 if template is not None]
    elif self.chat_template is not None:
      config["chat_template"] = self.chat_template
    with open(os.path.join(path, TOKENIZER_CONFIG_FILE), "w") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)
    template_file = os.path.join(path, CHAT_TEMPLATE_FILE)
    if self.chat_template is not None and os.path.isfile(template_file):   # it would win on load
      with open(template_file, "w", encoding="utf-8") as f:
        f.write(self.chat_template)


def _post_processor_frame(backend: BackendTokenizer,
                          added: int) -> tuple[list[int], list[int]] | None:
  """(ids the post-processor puts before a text, ids it puts after: `added` in all, as many as
  it adds to ""), found around a probe text's ids; None where no probe has ids that the framed
  encoding holds whole."""
  for probe in ("a", "Hello"):
    plain = backend.encode(probe, add_special_tokens=False).ids
    framed = backend.encode(probe, add_special_tokens=True).ids
    n = len(plain)
    if n and len(framed) == n + added:
      for i in range(added + 1):
        if framed[i:i + n] == plain:
          return framed[:i], framed[i + n:]
  return None


class StreamDecoder:
  """Incremental detokenization: `feed(ids)` returns only newly completed text.

  Text is held back while it ends in U+FFFD (a partial UTF-8 character) or while the last
  decoded id is a byte-fallback token (its run of bytes may still change); `finish()` returns
  whatever is still held. The pieces
  concatenate to `decode(all ids)`. Each call decodes only a short window of recent ids: text
  is taken as new text of the window [prefix, end) minus the text of [prefix, read).
  """

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
    self.tokenizer = tokenizer
    self.skip_special_tokens = skip_special_tokens
    self.ids: list[int] = []
    self._prefix = 0   # window start: the first id of the last emitted chunk
    self._read = 0     # ids before this are already emitted as text

  def _decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(ids, self.skip_special_tokens)

  def feed(self, ids: int | Iterable[int]) -> str:
    # One id: a Python int, a numpy integer or a 0-d array (an element of an id array).
    one = isinstance(ids, int) or getattr(ids, "ndim", None) == 0
    self.ids.extend([int(ids)] if one else [int(i) for i in ids])
    prefix_text = self._decode(self.ids[self._prefix:self._read])
    text = self._decode(self.ids[self._prefix:])
    if len(text) <= len(prefix_text) or text.endswith("\ufffd") or self._in_byte_run():
      return ""
    self._prefix, self._read = self._read, len(self.ids)
    return text[len(prefix_text):]

  def _in_byte_run(self) -> bool:
    skipped = self.tokenizer.special_ids if self.skip_special_tokens else frozenset()
    for token_id in reversed(self.ids):
      if token_id not in skipped:
        return token_id in self.tokenizer.byte_token_ids
    return False

  def finish(self) -> str:
    """The text still held back (e.g. an incomplete character at the very end)."""
    prefix_text = self._decode(self.ids[self._prefix:self._read])
    text = self._decode(self.ids[self._prefix:])
    self._prefix = self._read = len(self.ids)
    return text[len(prefix_text):]


# ------------------------------------------------------------------------------ jinja helpers
def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


class _GenerationBlocks(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: transformers' tag marking the assistant's text
  (for training masks; TRL's assistant_only_loss templates carry it). Rendered as its body, in a
  call block as transformers does (so a `set` inside stays inside)."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller) -> str:
    return caller()


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
  if source not in _TEMPLATES:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlocks, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
      _TEMPLATES[source] = env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
      raise CheckpointError(f"chat_template does not parse: {e}") from e
  return _TEMPLATES[source]


# Where a message's reasoning may be given; templates read the first (Qwen3) or "thinking".
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
  """The messages as transformers (5.x) hands them to a template: each a mapping, its keys whose
  value is None dropped (APIs return content=None / tool_calls=None; templates test whether a key
  is defined), and a reasoning given under any of REASONING_FIELDS also under "thinking" and
  "reasoning_content"."""
  out = []
  for message in messages:
    if not isinstance(message, Mapping):
      raise InputError(f"chat messages must be mappings (role, content, ...), got "
                       f"{type(message).__name__}")
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  return out


# What `continue_final_message` appends to the final message's text, found again in the rendering.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(chat: list[dict], field: bool | str, source: str) -> str:
  """Mark the end of the final message's `field` ("content" for True) with CONTINUE_TAG, as
  transformers 5.24 does (every copy of a reasoning field; the last text block of a content
  list), in place on `chat` (a plain copy). Returns the final message's text."""
  if not chat:
    raise InputError("continue_final_message is set but the conversation is empty")
  field = field if isinstance(field, str) else "content"
  last = chat[-1]
  final = last.get(field)
  if final is None:
    raise InputError(f'continue_final_message is set but the final message has no "{field}" '
                     "to continue")
  fields = [f for f in REASONING_FIELDS if last.get(f) == final] if field in REASONING_FIELDS \
      else [field]
  if not any(f in source for f in fields):
    raise InputError(f'continue_final_message is set to "{field}", which the chat template never '
                     "reads")
  if isinstance(final, (list, tuple)):
    block = next((b for b in reversed(final) if isinstance(b, dict) and "text" in b), None)
    if block is None or not isinstance(block["text"], str):
      raise InputError("continue_final_message is set but the final message has no text block "
                       "to continue")
    final = block["text"]
    block["text"] = final + CONTINUE_TAG
    return final
  if not isinstance(final, str):
    raise InputError(f'continue_final_message needs the final message\'s "{field}" to be text, '
                     f"got {type(final).__name__}")
  for f in fields:
    last[f] = final + CONTINUE_TAG
  return final


def _cut_at_tag(text: str, final: str) -> str:
  """The rendering cut where CONTINUE_TAG was (the spacing after it trimmed if the template
  trimmed the message)."""
  tag = CONTINUE_TAG.strip()
  if final.strip() not in text or tag not in text:
    raise InputError("continue_final_message is set but the final message does not appear in the "
                     "rendered chat (the template drops part of it)")
  at = text.rindex(tag)
  return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def _plain(value: Any) -> Any:
  """A deep copy made of plain JSON-like types (what the sandboxed template may see), as
  transformers' _plain_template_data makes it: subclasses of str / int / float (str enums,
  numpy scalars) become their base value (a str enum its value, not "Role.USER"), numpy scalars
  their Python value, tuples stay tuples and mapping keys are converted like values."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  for base in (str, int, float):
    if isinstance(value, base):
      return getattr(base, f"__{base.__name__}__")(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_plain(v) for v in value)
  if isinstance(value, np.generic):      # np.int64, np.bool_ (not int / bool subclasses)
    return _plain(value.item())
  raise InputError(f"chat template input of type {type(value).__name__} is not supported "
                   "(use str, numbers, lists and dicts)")


def _read_json(path: str) -> dict:
  return read_json(path) if os.path.isfile(path) else {}


def read_generation_config(path: str | os.PathLike) -> dict:
  """generation_config.json of directory `path` ({} when there is none). Its bos_token_id /
  eos_token_id are checked to be token ids (an int, and for eos a list of ints too): a file
  that is not an object, or ids such as "2" or [2, null], raised a bare AttributeError /
  ValueError / TypeError that named neither the file nor the key."""
  gen_file = os.path.join(path, GENERATION_CONFIG_FILE)
  gen = _read_json(gen_file)
  if not isinstance(gen, Mapping):
    raise CheckpointError(f"{gen_file} is not a JSON object (got a {type(gen).__name__})")
  for key in ("bos_token_id", "eos_token_id"):
    value = gen.get(key)
    ids = value if key == "eos_token_id" and isinstance(value, list) else [value]
    if value is not None and not all(is_int(i) and i >= 0 for i in ids):
      raise CheckpointError(f"{gen_file}: {key} must be a token id (an integer >= 0"
                            f"{', or a list of them' if key == 'eos_token_id' else ''}), "
                            f"got {value!r}")
  return gen
