"""How often QuantSpec's draft picks the INT8 target's token, teacher-forced, for several 4-bit
weight quantizers of the draft (SmolLM2-135M-Instruct; CPU or GPU, no kernel involved).

Both models read the same hierarchical KV cache (`quantspec_quality.quantized_pass`): the target
its 8-bit view with the full weights, the draft its 4-bit view with 4-bit weights. On a text the
target generated itself, the share of positions where the two argmaxes agree is the draft's
acceptance rate at gamma = 1, measured over thousands of positions instead of one short
generation, so quantizers can be told apart:

* book: `--eval-tokens` tokens of the book from its start (the acceptance benchmark's prompt
  region; teacher-forced on the book's own text);
* mt_bench: MT-Bench turn-1 prompts [0, --eval-prompts) each followed by the model's own greedy
  answer (--new-tokens), concatenated; agreement over the answers' tokens only.

Quantizers (--variants): rtn; gptq (index order, non-static groups, each layer calibrated on the
full-precision model's inputs: session 38's); gptq-act (act_order); gptq-seq (sequential);
gptq-act-seq (both); gptq-act-seq-true (and true_sequential: within a layer, each linear
calibrated on the layer with its earlier linears quantized); --gptq-damp sets GPTQ's damping.
GPTQ calibrates on --calibration-sources: book (--calibration-tokens tokens from
--calibration-offset), self-chat (the model's greedy answers, --calibration-new-tokens long, to
MT-Bench prompts [--calibration-prompts) of --calibration-turns, disjoint from the evaluated ones;
one sequence per conversation, as many tokens) and mixed (both). --draft-input-planes 2 gives the
draft's linears the input a GPU's one-row dp4a GEMV multiplies (`pallas_kernels.w4a8_gemv`);
--draft-weights exact / dtype the weights the dp4a / the W4A16 wgmma kernel multiplies (exact, or
rounded to the model dtype).

  .venv/bin/python benchmarks/draft_agreement.py --out benchmarks/results/draft_agreement_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._args import count  # noqa: E402
from benchmarks._gemv_choice import DRAFT_WEIGHTS, draft_matmul  # noqa: E402
from benchmarks.quantspec_quality import (calibration_questions,  # noqa: E402
                                          check_chat_calibration, quantized_pass,
                                          self_chat_calibration)
from sparsedec.bench import (DEFAULT_SMOLLM2_GGUF, device_description,  # noqa: E402
                             encode_prompts, log)
from sparsedec.decode.api import generate  # noqa: E402
from sparsedec.model.gptq import DEFAULT_DAMP, gptq_quantize_params  # noqa: E402
from sparsedec.model.quant_weights import quantize_params  # noqa: E402
from sparsedec.prompts import book, mt_bench  # noqa: E402
from sparsedec.weights.checkpoint import load_model  # noqa: E402

VARIANTS = {"rtn": None, "gptq": (False, False, False), "gptq-act": (True, False, False),
            "gptq-seq": (False, True, False), "gptq-act-seq": (True, True, False),
            "gptq-act-seq-true": (True, True, True)}


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--gguf", default=DEFAULT_SMOLLM2_GGUF)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--group", type=count, default=128, help="KV quantization group")
  ap.add_argument("--weight-group", type=count, default=128)
  ap.add_argument("--chunk", type=count, default=64)
  ap.add_argument("--eval-tokens", type=count, default=2048)
  ap.add_argument("--eval-prompts", type=count, default=16)
  ap.add_argument("--new-tokens", type=count, default=160)
  ap.add_argument("--chat-template", type=int, choices=(0, 1), default=1,
                  help="wrap the MT-Bench prompts in the tokenizer's chat template")
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  ap.add_argument("--calibration-sources", nargs="+", default=["book", "self-chat", "mixed"],
                  choices=("book", "self-chat", "mixed"))
  ap.add_argument("--calibration-tokens", type=count, default=4096)
  ap.add_argument("--calibration-offset", type=int, default=60000)
  ap.add_argument("--calibration-prompts", type=int, nargs=2, default=[40, 80],
                  metavar=("FIRST", "STOP"))
  ap.add_argument("--calibration-new-tokens", type=count, default=None,
                  help="length of the self-chat calibration answers (default --new-tokens)")
  ap.add_argument("--gptq-damp", type=float, default=DEFAULT_DAMP,
                  help="GPTQ's damping: this fraction of the mean Hessian diagonal is added to it")
  ap.add_argument("--calibration-turns", type=int, nargs="+", default=[1],
                  help="MT-Bench turns whose questions --calibration-prompts are asked (each "
                       "on its own): 1, or 1 2 for twice as many prompts")
  ap.add_argument("--draft-input-planes", type=int, choices=(0, 1, 2), default=0,
                  help="the draft's quantized linears multiply their input as w4a8_gemv's int8 "
                       "planes (2: what a GPU's one-row dp4a kernel multiplies; 1: llama.cpp-style "
                       "Q8 activations; 0: as it is)")
  ap.add_argument("--draft-weights", default="layout", choices=DRAFT_WEIGHTS,
                  help="the weights the draft's quantized linears multiply: exact (fp32, as the "
                       "GPU's dp4a kernel), dtype (rounded to the model dtype, as the W4A16 wgmma "
                       "kernel), layout (the draft layout's jnp path: \"packed\" rounds to the "
                       "dtype)")
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                "draft_agreement.json"))
  args = ap.parse_args(argv)
  # The calibration sources the GPTQ variants read (none for rtn alone): only those are built
  # and checked (the self-chat answers were generated, and --calibration-turns checked, after
  # the evaluated texts' passes, even for --variants rtn).
  sources = args.calibration_sources if any(VARIANTS[v] for v in args.variants) else []
  if any(src in ("book", "mixed") for src in sources) and \
      args.calibration_offset < args.eval_tokens + 1:
    raise SystemExit("--calibration-offset overlaps the evaluated book tokens")
  chat_sources = any(src in ("self-chat", "mixed") for src in sources)
  if chat_sources:
    check_chat_calibration(args.calibration_prompts, args.eval_prompts, args.calibration_turns)
  cfg, params, tok = load_model(args.gguf, dtype=args.dtype)
  book_ids = np.asarray(tok.encode(book()), np.int32)

  # The evaluated texts and where agreement counts.
  chat_template = bool(args.chat_template)
  prompts = encode_prompts(tok, mt_bench(turn=1)[: args.eval_prompts], chat_template)
  answers = generate(cfg, params, prompts, max_new_tokens=args.new_tokens).tokens
  chat = np.concatenate([np.asarray(p + a, np.int32) for p, a in zip(prompts, answers)])
  counted = np.concatenate([np.r_[np.zeros(len(p) - 1, bool), np.ones(len(a), bool),
                                  np.zeros(1, bool)] for p, a in zip(prompts, answers)])[:-1]
  texts = {"book": (book_ids[: args.eval_tokens + 1], None), "mt_bench": (chat, counted)}
  target = {name: quantized_pass(cfg, params, ids, args.chunk, args.group, 8)[1]
            for name, (ids, _) in texts.items()}

  book_cal = [book_ids[args.calibration_offset:args.calibration_offset + args.calibration_tokens]]
  chat_cal = []
  if chat_sources:
    first, stop = args.calibration_prompts
    chat_cal = self_chat_calibration(cfg, params, tok,
                                     calibration_questions(first, stop, args.calibration_turns),
                                     args.calibration_new_tokens or args.new_tokens,
                                     args.calibration_tokens, chat_template)
  calibration = {"book": book_cal, "self-chat": chat_cal, "mixed": book_cal + chat_cal}
  calibration = {k: calibration[k] for k in sources}

  result = {"benchmark": "QuantSpec draft agreement with the INT8 target, teacher-forced",
            "device": device_description(), "args": vars(args),
            "positions": {"book": int(args.eval_tokens), "mt_bench": int(counted.sum())},
            "calibration_tokens": {k: int(sum(len(x) for x in v)) for k, v in calibration.items()},
            "calibration_sequences": {k: len(v) for k, v in calibration.items()}, "rows": []}
  runs = [(v, None) if VARIANTS[v] is None else (v, src)
          for v in args.variants for src in (args.calibration_sources if VARIANTS[v] else [None])]
  with draft_matmul(args.draft_input_planes, args.draft_weights):
    _measure(args, cfg, params, texts, target, calibration, runs, result)
  log(f"wrote {args.out}")
  return result


def _measure(args, cfg, params, texts, target, calibration, runs, result) -> None:
  """Each (variant, calibration source): its draft's agreement on every text, written to
  args.out after each."""
  for variant, source in runs:
    t0 = time.perf_counter()
    if VARIANTS[variant] is None:
      layers = quantize_params(params, args.weight_group)["layers"]
    else:
      act_order, sequential, true_sequential = VARIANTS[variant]
      layers = gptq_quantize_params(cfg, params, calibration[source], group=args.weight_group,
                                    act_order=act_order, sequential=sequential,
                                    true_sequential=true_sequential, damp=args.gptq_damp)
    seconds = time.perf_counter() - t0
    draft = {**params, "layers": layers}
    row = {"variant": variant, "calibration": source, "quantize_seconds": round(seconds, 1)}
    for name, (ids, mask) in texts.items():
      got = quantized_pass(cfg, draft, ids, args.chunk, args.group, 4)[1]
      same = got == target[name]
      same = same if mask is None else same[mask]
      rate = float(same.mean())
      row[name] = {"agreement": rate,
                   "standard_error": float(np.sqrt(rate * (1 - rate) / same.size))}
    result["rows"].append(row)
    log(f"{variant} ({source}): book {row['book']['agreement']:.4f}, "
        f"mt_bench {row['mt_bench']['agreement']:.4f} ({seconds:.0f} s to quantize)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
