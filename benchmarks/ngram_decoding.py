"""FAFO vs Lookahead vs dense on SmolLM2-135M-Instruct: tau against the number of guesses, and
wall-clock tokens/s (the FAFO paper's Figure 1 setting: greedy, 256 new tokens).

Guesses per step: FAFO's fumble subsequences n, Lookahead's window W (each makes that many n-gram
guesses per step). Same guess length (FAFO k = Lookahead N - 1) and the same number of verified
candidates (FAFO m = Lookahead G). EOS is ignored so every prompt generates --max-new-tokens.
The dense rows carry the share of the greedy text's tokens that end an 8-gram seen before in the
row (`repeated_8gram_share`): SmolLM2's 256-token answers partly loop, and both methods' tau is
highest there (benchmarks/NOTES.md, session 45).

  --sweep: tau (and aggregate tokens/s) per method and guess count, each prompt set decoded as one
           batch (tau is per row; rows are independent).
  --speed: tokens/s and tau at batch size 1, prompt by prompt, for dense (once per set) and for
           FAFO / Lookahead at each of --speed-guesses (default: --guesses); decode time only,
           compilation excluded. With every guess count this is the paper's Figure 1 (tau and
           wall-clock speedup against guesses per step); `plot_ngram.py` draws it. Measured
           first, every set's dense before any other loop (`speed_plan`), then the sweep. On a
           GPU every row (--speed and --sweep) starts from empty compilation caches
           (`--fresh-executables`):
           an H200 ran every loop ~15% slower once several decode loops had been compiled in the
           process, and dropping the executables restored it (benchmarks/NOTES.md, session 69).

  python benchmarks/ngram_decoding.py --gguf PATH --dtype bfloat16 --sweep --speed
Writes $OUT/ngram_decoding.json (rewritten after every measurement).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from benchmarks._args import count
from benchmarks._timing import fresh_executables
from sparsedec.bench import (DEFAULT_SMOLLM2_GGUF, device_description, encode_prompts, log,
                             mean_repeated_ngram_share)
from sparsedec.compress import POLICIES
from sparsedec.decode.api import generate
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.lookahead import Lookahead
from sparsedec.prompts import humaneval, mt_bench
from sparsedec.testing import find_divergences
from sparsedec.weights.checkpoint import load_model



PROMPT_SETS = ("mt_bench", "humaneval")


def prompt_ids(tok, name: str, num: int) -> list[list[int]]:
  if name == "mt_bench":
    return encode_prompts(tok, mt_bench(turn=1)[:num], chat_template=True)
  if name == "humaneval":
    return encode_prompts(tok, humaneval()[:num], chat_template=False)
  raise ValueError(f"unknown prompt set {name!r}")


def make_method(name: str, guesses: int, args):
  if name == "fafo":
    policy = POLICIES[args.policy](budget_blocks=args.budget_blocks, block_size=args.block_size)
    return Fafo(subsequences=guesses, length=args.length, candidates=args.candidates,
                policy=policy)
  if name == "lookahead":
    return Lookahead(window=guesses, ngram=args.length + 1, guesses=args.candidates)
  return "dense"


def run(cfg, params, ids, method, max_new_tokens):
  generate(cfg, params, ids, method=method, max_new_tokens=max_new_tokens, stop_tokens=())  # warm
  return generate(cfg, params, ids, method=method, max_new_tokens=max_new_tokens, stop_tokens=())


def speed_plan(set_names, methods, guesses) -> list[tuple[str, str, int]]:
  """--speed's rows, (prompt set, method, guesses), in the order they are measured: dense for
  every set first, before any other decode loop has run in the process; then each method at each
  guess count, set after set; then dense again for every set ("dense_after"), to show drift. On
  an H200 every loop ran ~15% slower once several decode loops had been compiled in the process
  (sessions 38, 68 and 69: kernels no longer overlap; gone after jax.clear_caches(), which
  --fresh-executables does before each row), which made a row, and so its speedups, depend on
  what ran before it."""
  plan = [(s, "dense", 0) for s in set_names]
  plan += [(s, m, g) for s in set_names for g in guesses for m in methods]
  return plan + [(s, "dense_after", 0) for s in set_names]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser()
  ap.add_argument("--gguf", default=DEFAULT_SMOLLM2_GGUF,
                  help="the model: a .gguf file (SmolLM2 by default), an HF dir or a checkpoint")
  ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
  ap.add_argument("--prompt-sets", nargs="+", default=["mt_bench", "humaneval"],
                  choices=PROMPT_SETS)
  ap.add_argument("--num-prompts", type=count, default=10)
  ap.add_argument("--max-new-tokens", type=count, default=256)
  ap.add_argument("--guesses", type=count, nargs="+", default=[10, 20, 30, 40, 50, 60])
  ap.add_argument("--methods", nargs="+", default=["fafo", "lookahead"],
                  choices=("fafo", "lookahead"), help="compared with dense (always run)")
  ap.add_argument("--length", type=count, default=4, help="FAFO k = Lookahead N - 1")
  ap.add_argument("--candidates", type=count, default=7, help="FAFO m = Lookahead G")
  ap.add_argument("--policy", default="streaming", choices=sorted(POLICIES))
  ap.add_argument("--budget-blocks", type=count, default=4)
  ap.add_argument("--block-size", type=count, default=64)
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--speed", action="store_true")
  ap.add_argument("--speed-guesses", type=count, nargs="+", default=None,
                  help="guess counts of --speed (default: --guesses)")
  ap.add_argument("--speed-prompts", type=count, default=5)
  ap.add_argument("--fresh-executables", action=argparse.BooleanOptionalAction, default=None,
                  help="jax.clear_caches() before each --speed and --sweep row, so no row runs "
                       "beside other rows' compiled loops (default: on a GPU)")
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                "ngram_decoding.json"))
  args = ap.parse_args(argv)
  if not (args.sweep or args.speed):
    ap.error("nothing to measure: give --sweep, --speed or both")
  cfg, params, tok = load_model(args.gguf, dtype=args.dtype)
  result = {"benchmark": "FAFO vs Lookahead vs dense, SmolLM2-135M-Instruct, greedy",
            "device": device_description(), "dtype": args.dtype, "args": vars(args),
            "sweep": [], "speed": []}

  def save():
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)

  ids_of = {name: prompt_ids(tok, name, args.num_prompts) for name in args.prompt_sets}
  dense_tokens = {}
  for set_name, name, guesses in (speed_plan(args.prompt_sets, args.methods,
                                             args.speed_guesses or args.guesses)
                                  if args.speed else []):
    ids = ids_of[set_name]
    method = make_method(name, guesses, args)
    fresh_executables(args.fresh_executables)    # this row's loops alone (compiled again)
    first = generate(cfg, params, ids[:1], method=method, max_new_tokens=args.max_new_tokens,
                     stop_tokens=())                                   # compile once
    made, secs, steps, outputs = 0, 0.0, 0, []
    for one in ids[: args.speed_prompts]:
      res = generate(cfg, params, [one], method=method, max_new_tokens=args.max_new_tokens,
                     stop_tokens=())
      made += res.num_generated - 1          # the loop's tokens (the first is prefill's)
      secs += res.decode_seconds
      steps += sum(res.active_steps)
      outputs.append(list(res.tokens[0]))
    row = {"prompt_set": set_name, "method": name, "guesses": guesses, "batch_size": 1,
           "tokens_per_second": made / secs, "tau": made / steps, "steps": steps,
           "decode_seconds": secs, "compile_seconds": first.compile_seconds,
           "prompts": len(outputs)}
    if name == "dense":
      dense_tokens[set_name] = outputs
      # How much of the greedy text (every lossless method's) loops: n-gram guesses are
      # cheap to verify there, so tau over looping text overstates typical text's.
      row["repeated_8gram_share"] = mean_repeated_ngram_share(outputs)
    else:
      # Where a prompt's output first differs from dense greedy, and the dense model's top-1
      # minus top-2 logit there: a near-tie that another shape's rounding flips, or not.
      divs = find_divergences(outputs, dense_tokens[set_name], cfg, params,
                              ids[: len(outputs)])
      row["identical_to_dense_prompts"] = len(outputs) - len(divs)
      row["divergences"] = [{"prompt": d.row, "position": d.position,
                             "dense_top2_margin": d.top2_margin} for d in divs]
    result["speed"].append(row)
    log(f"{set_name} speed {name} guesses={guesses}: {row['tokens_per_second']:.1f} "
        f"tokens/s, tau {row['tau']:.3f}, compile {first.compile_seconds:.1f} s"
        + (f", identical to dense {row['identical_to_dense_prompts']}/{len(outputs)}"
           if name != "dense" else ""))
    save()
  for set_name in args.prompt_sets if args.sweep else []:
    ids = ids_of[set_name]
    fresh_executables(args.fresh_executables)
    dense = run(cfg, params, ids, "dense", args.max_new_tokens)
    result["sweep"].append({"prompt_set": set_name, "method": "dense", "guesses": 0, "tau": 1.0,
                            "tokens_per_second": dense.tokens_per_second,
                            "repeated_8gram_share": mean_repeated_ngram_share(dense.tokens)})
    log(f"{set_name} dense: {dense.tokens_per_second:.1f} tokens/s (B={len(ids)})")
    for guesses in args.guesses:
      for name in args.methods:
        fresh_executables(args.fresh_executables)
        res = run(cfg, params, ids, make_method(name, guesses, args), args.max_new_tokens)
        same = sum(list(a) == list(b) for a, b in zip(res.tokens, dense.tokens))
        row = {"prompt_set": set_name, "method": name, "guesses": guesses, "tau": res.tau,
               "tokens_per_second": res.tokens_per_second,
               "speedup_vs_dense_batched": res.tokens_per_second / dense.tokens_per_second,
               "identical_to_dense_rows": same, "rows": len(ids), **res.method_stats}
        result["sweep"].append(row)
        log(f"{set_name} {name} guesses={guesses}: tau {res.tau:.3f}, "
            f"{res.tokens_per_second:.1f} tokens/s, identical {same}/{len(ids)}")
        save()
  dense_speed = {r["prompt_set"]: r["tokens_per_second"] for r in result["speed"]
                 if r["method"] == "dense"}
  for r in result["speed"]:
    r["speedup_vs_dense"] = r["tokens_per_second"] / dense_speed.get(r["prompt_set"], np.nan)
  save()
  log(f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()
