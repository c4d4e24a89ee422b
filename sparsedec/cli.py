"""Command line: `sparsedec generate | convert | bench`.

generate prints only the generated text on stdout; stats go to stderr, or with --json one JSON
object (text, tokens, stats) goes to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "stories260K"


def default_model() -> str:
  return os.environ.get("SPARSEDEC_DEFAULT_MODEL", str(DEFAULT_MODEL))


def _model_path(args) -> str:
  """--model, or the default model when it is left out; an empty --model (`--model "$UNSET"`)
  is refused, not taken for the default."""
  from sparsedec.errors import InputError
  if args.model is None:
    return default_model()
  if not args.model:
    raise InputError("--model is empty (leave it out for the default model)")
  return args.model


def _add_generation_args(p: argparse.ArgumentParser) -> None:
  from sparsedec.decode.methods import method_names
  p.add_argument("--model", default=None,
                 help="converted checkpoint dir, HF dir or .gguf file (default: embedded "
                      "stories260K)")
  p.add_argument("--method", default="dense", choices=method_names())
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=None,
                 help="keep the k most likely tokens when sampling (default 0 = off)")
  p.add_argument("--top-p", type=float, default=None,
                 help="keep the smallest set of tokens of probability >= p when sampling "
                      "(default 1.0 = off)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
  p.add_argument("--cache-size", type=int, default=None, help="KV cache capacity in tokens")
  p.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens tokens")
  la = p.add_argument_group("lookahead (--method lookahead)")
  la.add_argument("--lookahead-window", type=int, default=None,
                  help="W: columns of the Jacobi window (default 7)")
  la.add_argument("--ngram", type=int, default=None,
                  help="N: n-gram size; up to N tokens per step (default 5)")
  la.add_argument("--guesses", type=int, default=None,
                  help="G: n-gram candidates verified per step (default 7)")
  fa = p.add_argument_group("fafo (--method fafo)")
  fa.add_argument("--subsequences", type=int, default=None,
                  help="n: fumble subsequences, i.e. guesses made per step (default 16)")
  fa.add_argument("--fafo-length", type=int, default=None,
                  help="k: tokens per subsequence / guess / candidate (default 4)")
  fa.add_argument("--candidates", type=int, default=None,
                  help="m: candidates verified per step (default 7)")
  fa.add_argument("--policy", default=None, choices=("streaming", "quest", "snapkv", "retrieval"),
                  help="compression policy C(kv) the fumble tokens read (default streaming)")
  fa.add_argument("--budget-blocks", type=int, default=None,
                  help="blocks in C(kv) per KV head (default 16)")
  fa.add_argument("--block-size", type=int, default=None,
                  help="cache slots per block (default 64)")
  fa.add_argument("--sink-blocks", type=int, default=None,
                  help="--policy streaming (and --method sfi): leading blocks always listed "
                       "(default 1)")
  fa.add_argument("--recent-blocks", type=int, default=None,
                  help="--policy snapkv / retrieval (and --method triforce): newest blocks "
                       "listed beside the prompt's selection (default 2; below --budget-blocks)")
  tf = p.add_argument_group("triforce (--method triforce, with --draft-model, --gamma, "
                            "--draft-sampling; --budget-blocks, --block-size and --recent-blocks "
                            "shape the middle level's chunk retrieval)")
  tf.add_argument("--draft-gamma", type=int, default=None,
                  help="draft-model tokens per verification of the middle level (default 2)")
  tf.add_argument("--draft-budget-blocks", type=int, default=None,
                  help="blocks of --block-size slots in the draft model's StreamingLLM view "
                       "(default 16)")
  sf = p.add_argument_group("sfi (--method sfi, with --budget-blocks: selected blocks per KV "
                            "head, --block-size, --sink-blocks, --recent-blocks; slow steps "
                            "after the tokenizer's sentence-ending tokens)")
  sf.add_argument("--max-fast-steps", type=int, default=None,
                  help="fast steps before a slow (dense) step even without a sentence end "
                       "(default 64)")
  qs = p.add_argument_group("quantspec / speculative / triforce (--method quantspec, "
                            "speculative, triforce)")
  qs.add_argument("--gamma", type=int, default=None,
                  help="draft tokens per step (default 4; triforce: the middle level's tokens "
                       "the full target verifies a step, default 6)")
  qs.add_argument("--draft-model", default=None, metavar="PATH",
                  help="--method speculative / triforce: the draft model (a converted "
                       "checkpoint dir, HF "
                       "dir or .gguf file) with the target's vocabulary, loaded in --dtype")
  qs.add_argument("--verify-precision", default=None, choices=("int8", "full"),
                  help="what the verifier reads: the 8-bit view of the quantized cache, or a "
                       "full-precision cache kept alongside it (default int8)")
  qs.add_argument("--quant-group", type=int, default=None,
                  help="G: tokens per key quantization group; 2G recent tokens stay in full "
                       "precision (default 128)")
  qs.add_argument("--draft-weight-group", type=int, default=None,
                  help="input rows per group of the draft's 4-bit weights (default 128, or 32 "
                       "for a GGUF whose linears are all Q4_1 or Q4_0: its own weights, "
                       "exactly, unless --draft-calibration asks for GPTQ's); 64 "
                       "is accepted more often (SmolLM2 MT-Bench, GPTQ: 0.89 against 0.85 at "
                       "gamma 1) for ~3%% more draft time (8B shapes, 8K, H200); 16, 32 or a "
                       "multiple of 64 keeps the W4A16 kernel on a GPU")
  qs.add_argument("--draft-weight-grid", default=None, choices=("minmax", "absmax"),
                  help="the round-to-nearest draft's grid per weight group: minmax (default; "
                       "GGUF Q4_1's) or absmax (symmetric, GGUF Q4_0's); a GGUF whose linears "
                       "are all Q4_1 or all Q4_0 gets its own (with group 32) unless the draft "
                       "is GPTQ's (--draft-calibration: minmax only)")
  qs.add_argument("--draft-sampling", default=None, choices=("sample", "argmax"),
                  help="when sampling (--temperature > 0): draw the drafts from the draft's "
                       "distribution and accept with min(1, p/q) (sample, Leviathan et al.), or "
                       "propose the draft's argmax as deterministic guesses (argmax); both are "
                       "lossless (default sample)")
  qs.add_argument("--draft-calibration", default=None, metavar="TEXT_FILE", nargs="+",
                  help="choose the draft's 4-bit weights by GPTQ calibrated on these texts, each "
                       "file its own sequence (default: round to nearest; sparsedec.model.gptq)")
  qs.add_argument("--draft-calibration-prompts", default=None, metavar="PROMPTS_FILE",
                  help="calibrate the GPTQ draft (also) on the model's own greedy answers to "
                       "these prompts, one a line, in the chat template when the tokenizer has "
                       "one; up to --draft-calibration-tokens tokens in all")
  qs.add_argument("--draft-calibration-tokens", type=int, default=None,
                  help="calibration tokens taken from the start of each --draft-calibration "
                       "file (default 4096, at most the model's context)")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="sparsedec", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)

  gen = sub.add_parser("generate", help="generate text from a prompt")
  src = gen.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="raw text prompt")
  src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
  gen.add_argument("--system", default=None, help="system message (with --chat)")
  _add_generation_args(gen)
  gen.add_argument("--stream", action="store_true", help="print text as it is generated")
  gen.add_argument("--json", action="store_true", help="one JSON object on stdout")

  conv = sub.add_parser("convert", help="convert an HF dir or GGUF file to a checkpoint")
  conv.add_argument("src", help="an HF checkpoint directory or a .gguf file")
  conv.add_argument("out", help="the checkpoint directory to write")
  conv.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="default: float32 from a GGUF file; from an HF directory, its config's "
                         "dtype, with float16 weights rounded to bfloat16 (float32 keeps them "
                         "exactly)")
  conv.add_argument("--overwrite", action="store_true",
                    help="replace an existing checkpoint directory at OUT")

  bench = sub.add_parser("bench", help="tokens/s, steps and peak memory over a prompt set")
  _add_generation_args(bench)
  bench.add_argument("--prompts", default="mt_bench",
                     help="mt_bench, humaneval, or a text file with one prompt per line")
  bench.add_argument("--num-prompts", type=int, default=10,
                     help="run the set's first N prompts (all of them if it holds fewer)")
  bench.add_argument("--batch-size", type=int, default=1)
  bench.add_argument("--chat-template", action="store_true",
                     help="wrap each prompt in the model's chat template")
  bench.add_argument("--output", default=None, help="write the JSON result here too")
  return parser


def _sampling(args):
  """The SamplingConfig of --temperature / --top-k / --top-p. A sampling-only flag given at
  --temperature 0 (greedy) is refused by name, as flags of another method are: it had no effect
  and said nothing."""
  from sparsedec.decode.sampling import SamplingConfig
  from sparsedec.errors import InputError
  cfg = SamplingConfig(temperature=args.temperature,
                       top_k=0 if args.top_k is None else args.top_k,
                       top_p=1.0 if args.top_p is None else args.top_p)
  if cfg.greedy:
    draft = (getattr(args, "draft_sampling", None)
             if "draft_sampling" in _METHOD_KNOBS.get(args.method, {}) else None)
    given = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p),
                                      ("--draft-sampling", draft)) if value is not None]
    if given:
      verb, them = ("applies", "it") if len(given) == 1 else ("apply", "them")
      raise InputError(f"{', '.join(given)} {verb} only when sampling, and --temperature is 0 "
                       f"(greedy): give --temperature > 0, or leave {them} out")
  return cfg


_METHOD_KNOBS = {"lookahead": {"lookahead_window": "window", "ngram": "ngram",
                               "guesses": "guesses"},
                 "fafo": {"subsequences": "subsequences", "fafo_length": "length",
                          "candidates": "candidates", "policy": "policy",
                          "budget_blocks": "budget_blocks", "block_size": "block_size",
                          "sink_blocks": "sink_blocks", "recent_blocks": "recent_blocks"},
                 "quantspec": {"gamma": "gamma", "verify_precision": "verify_precision",
                               "quant_group": "quant_group",
                               "draft_weight_group": "weight_group",
                               "draft_weight_grid": "weight_grid",
                               "draft_sampling": "draft_sampling"},
                 "speculative": {"gamma": "gamma", "draft_sampling": "draft_sampling"},
                 "triforce": {"gamma": "gamma", "draft_gamma": "draft_gamma",
                              "draft_sampling": "draft_sampling",
                              "budget_blocks": "budget_blocks", "block_size": "block_size",
                              "recent_blocks": "recent_blocks",
                              "draft_budget_blocks": "draft_budget_blocks"},
                 "sfi": {"budget_blocks": "budget_blocks", "block_size": "block_size",
                         "sink_blocks": "sink_blocks", "recent_blocks": "recent_blocks",
                         "max_fast_steps": "max_fast_steps"}}
_POLICY_KNOBS = ("budget_blocks", "block_size")
# Knobs of one policy only: --sink-blocks with another policy is refused by name.
_OWN_POLICY_KNOBS = {"sink_blocks": ("streaming",), "recent_blocks": ("snapkv", "retrieval")}


def _with_draft_model(params, draft):
  """params carrying `draft`'s ((cfg, params) of --draft-model), or params when it is None."""
  from sparsedec.decode.speculative import with_draft_model
  return params if draft is None else with_draft_model(params, draft[1])


def _draft_model(args):
  """(cfg, params) of --draft-model (loaded in --dtype), or None without one; the flag is
  refused by name with any method but speculative, and that method without it."""
  from sparsedec.errors import InputError
  from sparsedec.weights.checkpoint import load_model
  if args.method not in ("speculative", "triforce"):
    if args.draft_model is not None:
      raise InputError(f"--draft-model does not apply to --method {args.method}")
    return None
  if not args.draft_model:
    raise InputError(f"--method {args.method} needs --draft-model PATH (a smaller model with "
                     f"the target's vocabulary)")
  cfg, params, _ = load_model(args.draft_model, dtype=args.dtype)
  return cfg, params


def _method(args, draft=None):
  """The decoding method object, with the knobs given on the command line (and the draft
  model's config: `_draft_model`)."""
  from sparsedec.decode.methods import get_method
  from sparsedec.errors import InputError
  given = {flag: getattr(args, flag) for knobs in _METHOD_KNOBS.values() for flag in knobs
           if getattr(args, flag) is not None}
  mine = _METHOD_KNOBS.get(args.method, {})
  stray = sorted(set(given) - set(mine))
  if stray:
    raise InputError(f"--{stray[0].replace('_', '-')} does not apply to --method {args.method}")
  knobs = {mine[flag]: value for flag, value in given.items()}
  if args.method == "fafo":
    from sparsedec.compress import POLICIES
    policy = knobs.pop("policy", "streaming")
    for name, owner in _OWN_POLICY_KNOBS.items():
      if name in knobs and policy not in owner:
        raise InputError(f"--{name.replace('_', '-')} applies to --policy {' / '.join(owner)}, "
                         f"not {policy}")
    policy_knobs = {name: knobs.pop(name) for name in (*_POLICY_KNOBS, *_OWN_POLICY_KNOBS)
                    if name in knobs}
    knobs["policy"] = POLICIES[policy](**policy_knobs)
  if args.method == "triforce":
    from sparsedec.compress import ChunkRetrieval, StreamingLLM
    views = {name: knobs.pop(name) for name in ("budget_blocks", "block_size", "recent_blocks",
                                                "draft_budget_blocks") if name in knobs}
    size = {"block_size": views["block_size"]} if "block_size" in views else {}
    knobs["retrieval"] = ChunkRetrieval(**size, **{k: v for k, v in views.items()
                                                   if k in ("budget_blocks", "recent_blocks")})
    knobs["draft_view"] = StreamingLLM(**size, **({"budget_blocks": views["draft_budget_blocks"]}
                                                  if "draft_budget_blocks" in views else {}))
  if draft is not None:
    knobs["draft"] = draft[0]
  return get_method(args.method, **knobs)


def _with_sentence_ends(method, tok):
  """SlowFast without boundary tokens: the method with the tokenizer's sentence-ending tokens
  (`sfi.sentence_boundary_tokens`); any other method as it is."""
  from sparsedec.decode.sfi import SlowFast, sentence_boundary_tokens
  if not isinstance(method, SlowFast) or method.boundary_tokens:
    return method
  return dataclasses.replace(method, boundary_tokens=sentence_boundary_tokens(tok))


def _exact_draft_group(args, method):
  """QuantSpec with neither --draft-weight-group nor --draft-weight-grid on a GGUF whose linears
  are all Q4_1 (or all Q4_0): the method with weight_group 32 and that type's grid, which
  reproduce the checkpoint's weights exactly (noted on stderr). That is round to nearest's
  draft: a GPTQ draft (--draft-calibration, --draft-calibration-prompts) chooses its own codes,
  on the minmax grid only, so the method is left as it is."""
  from sparsedec.decode.quantspec import QuantSpec
  from sparsedec.weights.checkpoint import source_kind
  from sparsedec.weights.gguf_file import exact_4bit_grid
  if not isinstance(method, QuantSpec) or method.weight_bits is None \
      or args.draft_weight_group is not None or args.draft_weight_grid is not None \
      or args.draft_calibration is not None or args.draft_calibration_prompts is not None:
    return method
  model = _model_path(args)
  if source_kind(model) != "gguf":
    return method
  exact = exact_4bit_grid(model)
  if exact is None:
    return method
  group, grid = exact
  print(f"quantspec: every linear of {model} is 4-bit in blocks of {group}: the draft uses "
        f"weight_group={group}, weight_grid={grid} (the checkpoint's own weights, exactly; "
        f"--draft-weight-group / --draft-weight-grid override)", file=sys.stderr)
  return dataclasses.replace(method, weight_group=group, weight_grid=grid)


def _load(args, chat_flag: str | None = None):
  """(cfg, params, tok) of --model. chat_flag: the flag (--chat, --chat-template) that needs a
  chat template, refused here when the tokenizer has none: before a GPTQ draft is built (it
  was refused after, when the prompts were encoded)."""
  from sparsedec.errors import InputError
  from sparsedec.weights.checkpoint import load_model
  cfg, params, tok = load_model(_model_path(args), dtype=args.dtype)
  if chat_flag is not None and not tok.chat_template:
    raw = " (give the text as --prompt)" if chat_flag == "--chat" else ""
    raise InputError(f"{chat_flag} needs a chat template, and the tokenizer of "
                     f"{_model_path(args)} has no chat_template{raw}")
  return cfg, params, tok


DEFAULT_CALIBRATION_TOKENS = 4096


def _draft_tokens(args, method) -> int | None:
  """Calibration tokens of the GPTQ draft asked for (--draft-calibration), or None; checked
  before the model loads."""
  from sparsedec.errors import InputError, read_text
  if args.draft_calibration is None and args.draft_calibration_prompts is None:
    if args.draft_calibration_tokens is not None:
      raise InputError("--draft-calibration-tokens goes with --draft-calibration or "
                       "--draft-calibration-prompts")
    return None
  flag = "--draft-calibration" if args.draft_calibration else "--draft-calibration-prompts"
  if args.method != "quantspec":
    raise InputError(f"{flag} does not apply to --method {args.method}")
  if method.weight_bits is None:
    raise InputError(f"{flag} needs a 4-bit draft (quantspec weight_bits=4)")
  if args.draft_weight_grid not in (None, "minmax"):
    raise InputError(f"--draft-weight-grid {args.draft_weight_grid} applies to the "
                     f"round-to-nearest draft; the GPTQ draft of {flag} is on the minmax grid")
  n = DEFAULT_CALIBRATION_TOKENS if args.draft_calibration_tokens is None else \
      args.draft_calibration_tokens
  if n < 1:
    raise InputError(f"--draft-calibration-tokens must be >= 1, got {n}")
  for path in args.draft_calibration or ():
    if not Path(path).is_file():
      raise InputError(f"calibration text file not found: {path}")
    if not read_text(path, "calibration text file").strip():
      raise InputError(f"calibration text file is empty: {path}")
  if args.draft_calibration_prompts is not None:
    path = Path(args.draft_calibration_prompts)
    if not path.is_file():
      raise InputError(f"calibration prompts file not found: {path}")
    if not read_text(path, "calibration prompts file").strip():
      raise InputError(f"calibration prompts file is empty: {path}")
  return n


def _with_draft(args, cfg, params, tok, method, n: int | None):
  """params carrying a GPTQ draft calibrated on the first n tokens of each --draft-calibration
  file (at most the model's context; each file its own sequence) and on up to n tokens of the
  model's answers to --draft-calibration-prompts, or params when n is None."""
  if n is None:
    return params
  from sparsedec.decode.fits import run_platform
  from sparsedec.errors import read_text
  from sparsedec.model.gptq import gptq_quantize_params, self_generated_calibration, with_draft
  take = min(n, cfg.max_position_embeddings)
  seqs = [tok.encode(read_text(path, "calibration text file"))[:take]
          for path in args.draft_calibration or ()]
  if args.draft_calibration_prompts is not None:
    text = read_text(args.draft_calibration_prompts, "calibration prompts file")
    lines = [x for x in text.splitlines() if x.strip()]
    if tok.chat_template:
      prompts = [tok.encode_chat([{"role": "user", "content": x}]) for x in lines]
    else:
      prompts = [tok.encode(x) for x in lines]
    seqs += self_generated_calibration(cfg, params, prompts, max_tokens=n)
  layout = method.resolved_weight_layout(run_platform(params["embed"]))   # as the init resolves it
  with tqdm(total=cfg.num_layers, desc="GPTQ draft", unit="layer", file=sys.stderr,
            leave=False) as bar:
    draft = gptq_quantize_params(cfg, params, seqs, group=method.weight_group, layout=layout,
                                 on_layer=lambda i, layer: bar.update())
  return with_draft(params, draft)


def _check_utf8(flag: str, value: str | None) -> None:
  """A command-line text that is not UTF-8 (bytes from a Latin-1 terminal reach Python as lone
  surrogates) is refused by name: the tokenizer raised a bare TypeError on it."""
  from sparsedec.errors import InputError
  try:
    if value is not None:
      value.encode("utf-8")
  except UnicodeEncodeError as e:
    bad = ord(value[e.start])
    what = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"U+{bad:04X}"
    raise InputError(f"{flag} is not UTF-8 text ({what} at character {e.start})") from None


def _prompt_ids(args, tok) -> list[int]:
  if args.chat is not None:
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
    messages.append({"role": "user", "content": args.chat})
    return tok.encode_chat(messages, add_generation_prompt=True)
  return tok.encode(args.prompt)


def cmd_generate(args) -> int:
  from sparsedec.decode import api
  from sparsedec.decode.api import method_capacity
  from sparsedec.decode.methods import method_config
  from sparsedec.errors import InputError
  if args.system is not None and args.chat is None:
    raise InputError("--system goes with --chat (a raw --prompt has no chat template to hold a "
                     "system message)")
  if args.stream and args.json:
    raise InputError("--stream and --json do not go together: --json prints one object when "
                     "generation ends")
  for flag, value in (("--prompt", args.prompt), ("--chat", args.chat),
                      ("--system", args.system)):
    _check_utf8(flag, value)
  sampling = _sampling(args)
  draft = _draft_model(args)
  method = _exact_draft_group(args, _method(args, draft))
  calibration = _draft_tokens(args, method)
  cfg, params, tok = _load(args, "--chat" if args.chat is not None else None)
  params = _with_draft_model(params, draft)
  method = _with_sentence_ends(method, tok)
  ids = _prompt_ids(args, tok)
  # Before a GPTQ draft: the capacity and the knobs that depend on it or on the model.
  method_capacity(cfg, params, method, len(ids), args.max_new_tokens, args.cache_size)
  params = _with_draft(args, cfg, params, tok, method, calibration)
  kwargs = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                method=method, cache_size=args.cache_size,
                stop_tokens=() if args.ignore_eos else None)
  if args.stream:
    decoder = tok.stream_decoder(skip_special_tokens=True)
    slices = api.stream(cfg, params, [ids], **kwargs)
    while True:
      try:
        new = next(slices)
      except StopIteration as end:       # the generator returns the run's GenerationResult
        result = end.value
        break
      sys.stdout.write(decoder.feed(new[0]))
      sys.stdout.flush()
    sys.stdout.write(decoder.finish() + "\n")
  else:
    result = api.generate(cfg, params, [ids], **kwargs)
  text = tok.decode(result.tokens[0], skip_special_tokens=True)
  stats = {"method": args.method, "method_config": method_config(method),
           "prompt_tokens": len(ids), **result.stats()}
  if args.stream:
    print(json.dumps(stats), file=sys.stderr)
  elif args.json:
    print(json.dumps({"text": text, "tokens": result.tokens[0], "stats": stats}))
  else:
    print(text)
    print(json.dumps(stats), file=sys.stderr)
  return 0


def cmd_convert(args) -> int:
  from sparsedec.errors import InputError
  from sparsedec.weights.checkpoint import convert
  for name, value in (("src", args.src), ("out", args.out)):
    if not value:             # `convert "$UNSET" ...`: "" is the current directory to os.path
      raise InputError(f"convert's {name} is empty (an HF directory or .gguf file to read, then "
                       f"the checkpoint directory to write)")
  out = convert(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite)
  print(f"wrote {out}", file=sys.stderr)
  return 0


def cmd_bench(args) -> int:
  from sparsedec.bench import bench_prompts, encode_prompts, run_bench
  from sparsedec.decode.api import method_capacity
  from sparsedec.errors import InputError, unwritable_reason
  if args.output is not None:            # before the run, not after it
    if not args.output:
      raise InputError("--output is empty (leave it out to print the result only)")
    reason = ("it is a directory" if os.path.isdir(args.output)
              else unwritable_reason(args.output))
    if reason:
      raise InputError(f"--output {args.output}: cannot write there: {reason}")
  if not args.prompts:        # "" read as the current directory: "prompt set '' is a directory"
    raise InputError("--prompts is empty (mt_bench, humaneval, or a text file with one prompt "
                     "per line)")
  texts = bench_prompts(args.prompts, args.num_prompts, args.batch_size)  # before the load
  if len(texts) < args.num_prompts:      # the JSON's num_prompts records what ran
    print(f"note: prompt set {args.prompts!r} holds {len(texts)} prompts: running "
          f"{len(texts)}, not --num-prompts {args.num_prompts}", file=sys.stderr)
  if args.max_new_tokens < 1:
    raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  sampling = _sampling(args)
  draft = _draft_model(args)
  method = _exact_draft_group(args, _method(args, draft))
  calibration = _draft_tokens(args, method)
  cfg, params, tok = _load(args, "--chat-template" if args.chat_template else None)
  params = _with_draft_model(params, draft)
  method = _with_sentence_ends(method, tok)
  # Before a GPTQ draft and the warm-up: each batch's capacity (run_bench's batches) and the
  # knobs that depend on it or on the model.
  lengths = [len(ids) for ids in encode_prompts(tok, texts, args.chat_template)]
  for i in range(0, len(lengths), args.batch_size):
    method_capacity(cfg, params, method, max(lengths[i: i + args.batch_size]),
                    args.max_new_tokens, args.cache_size)
  params = _with_draft(args, cfg, params, tok, method, calibration)
  result = run_bench(cfg, params, tok, prompts=args.prompts, num_prompts=args.num_prompts,
                     batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                     sampling=sampling, seed=args.seed, method=method,
                     chat_template=args.chat_template, ignore_eos=args.ignore_eos,
                     model_name=_model_path(args), cache_size=args.cache_size)
  text = json.dumps(result, indent=2)
  gone = None
  try:                                   # first: a write that still fails loses nothing
    print(text)
    sys.stdout.flush()
  except BrokenPipeError as e:           # stdout's reader is gone (`| head`): --output still
    gone = e                             # gets the result, then main ends quietly
  if args.output:                        # whole or not at all: a temporary file, then a rename
    out = Path(args.output)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
      out.parent.mkdir(parents=True, exist_ok=True)
      tmp.write_text(text + "\n")
      os.replace(tmp, out)
    except BaseException as e:           # a full disk, Ctrl-C: no half-written file is left
      tmp.unlink(missing_ok=True)
      if isinstance(e, OSError):
        where = "printed on stdout" if gone is None else "lost: stdout was closed too"
        raise InputError(f"--output {args.output}: cannot write there: {e.strerror or e} (the "
                         f"result was {where})") from e
      raise
  if gone is not None:
    raise gone
  return 0


def main(argv: list[str] | None = None) -> int:
  from sparsedec.errors import SparsedecError
  args = _parser().parse_args(argv)
  try:
    return {"generate": cmd_generate, "convert": cmd_convert, "bench": cmd_bench}[args.command](
        args)
  except SparsedecError as err:
    print(f"sparsedec: error: {err}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:              # Ctrl-C: one line, the shell's code for SIGINT
    print("sparsedec: interrupted", file=sys.stderr)
    return 130
  except BrokenPipeError:                # stdout's reader is gone (`| head`): end quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no 2nd error at exit
    return 1


if __name__ == "__main__":
  sys.exit(main())
