"""TriForce on SmolLM2-135M-Instruct: how often each level's tokens are accepted on long book
prompts (CPU or GPU), and that the output is dense greedy's.

Greedy, `--prompt-tokens` windows of the book (../shared/prompts/books), each continued by
`--new-tokens` tokens, decoded as one batch. For each retrieval budget (`--budgets`, tokens of
the middle level's ChunkRetrieval view, `--block-size` slots a block, 2 newest blocks among
them): alpha2 (the middle level's tokens accepted by the full target, per token), alpha1 (the
draft model's tokens accepted by the middle level), middle rounds a step, tau; and whether the
tokens equal dense greedy's. alpha2 measures the retrieval view alone: in greedy decoding the
middle level's tokens are its own argmax chain whatever the draft proposed. The draft is the
model's first `--draft-layers` layers (no smaller model of SmolLM2's vocabulary is here) reading
a `--draft-budget`-token StreamingLLM view, so alpha1 is this stand-in draft's, not a trained
68M model's. These acceptances feed triforce_step.py's projection at 8B shapes.

  .venv/bin/python benchmarks/triforce_acceptance.py \
      --out benchmarks/results/triforce_acceptance_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

from sparsedec.bench import DEFAULT_SMOLLM2_GGUF, device_description, log
from sparsedec.compress import ChunkRetrieval, StreamingLLM
from sparsedec.decode.api import generate
from sparsedec.decode.speculative import with_draft_model
from sparsedec.decode.triforce import TriForce
from sparsedec.prompts import book
from sparsedec.weights.checkpoint import load_model

BOOK_STRIDE = 8192          # tokens between the starts of the book windows


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default=str(DEFAULT_SMOLLM2_GGUF))
  ap.add_argument("--dtype", default=None, help="default: float32 on a CPU, bfloat16 on a GPU")
  ap.add_argument("--prompt-tokens", type=int, default=2048)
  ap.add_argument("--prompts", type=int, default=2)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
  ap.add_argument("--block-size", type=int, default=64)
  ap.add_argument("--draft-layers", type=int, default=10)
  ap.add_argument("--draft-budget", type=int, default=256)
  ap.add_argument("--gamma", type=int, default=6)
  ap.add_argument("--draft-gamma", type=int, default=2)
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                "triforce_acceptance.json"))
  args = ap.parse_args(argv)
  dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
  cfg, params, tok = load_model(args.model, dtype=dtype)
  params = jax.device_put(params)
  ids = tok.encode(book(), add_bos=False)
  prompts = [ids[i * BOOK_STRIDE: i * BOOK_STRIDE + args.prompt_tokens]
             for i in range(args.prompts)]
  dcfg = cfg.replace(num_layers=args.draft_layers)
  both = with_draft_model(params, {**params, "layers": params["layers"][:args.draft_layers]})
  kw = dict(max_new_tokens=args.new_tokens, stop_tokens=())
  rows = []
  result = {"benchmark": "TriForce acceptance on SmolLM2-135M-Instruct, book prompts, greedy",
            "device": device_description(), "dtype": dtype, "args": vars(args), "rows": rows}
  t = time.perf_counter()
  dense = generate(cfg, params, prompts, **kw)
  log(f"dense: {time.perf_counter() - t:.1f} s")
  bs = args.block_size
  for budget in args.budgets:
    method = TriForce(draft=dcfg, gamma=args.gamma, draft_gamma=args.draft_gamma,
                      retrieval=ChunkRetrieval(budget_blocks=budget // bs, block_size=bs),
                      draft_view=StreamingLLM(budget_blocks=args.draft_budget // bs,
                                              block_size=bs))
    t = time.perf_counter()
    got = generate(cfg, both, prompts, method=method, **kw)
    stats = got.method_stats
    row = {"retrieval_budget": budget, "alpha2": stats["acceptance_rate"],
           "alpha1": stats["draft_acceptance_rate"],
           "middle_rounds_per_step": stats["middle_rounds_per_step"], "tau": got.tau,
           "equals_dense": [list(a) == list(b) for a, b in zip(got.tokens, dense.tokens)],
           "per_prompt_alpha2": [r["acceptance_rate"] for r in got.row_method_stats],
           "seconds": time.perf_counter() - t}
    rows.append(row)
    log(f"budget {budget}: alpha2 {row['alpha2']}, alpha1 {row['alpha1']}, rounds "
        f"{row['middle_rounds_per_step']}, tau {row['tau']:.3f}, equals dense "
        f"{row['equals_dense']}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  log(f"wrote {args.out}")


if __name__ == "__main__":
  main()
