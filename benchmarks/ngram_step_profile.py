"""Device-time breakdown of B=1 greedy decoding on SmolLM2-135M-Instruct (GPU): for dense, FAFO
and Lookahead at 20 guesses, wall and GPU-busy time per step, kernels launched per step and the
costliest kernels with their time and launches per step (30 launches per step = once per layer),
from a profiler trace of one 128-token decode of the first MT-Bench prompt.

With --random-weights: SmolLM2-shaped random bf16 weights and a random 300-token prompt (no
checkpoint needed). Random weights accept almost no guesses, so the steps' taus and pool contents
are not the real model's; the per-layer kernels are the same.

  python benchmarks/ngram_step_profile.py [--gguf PATH | --random-weights]
      ->  $OUT/ngram_step_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks._timing import default_out_dir, device_time, fresh_executables  # noqa: E402
from benchmarks.ngram_decoding import make_method  # noqa: E402
from benchmarks.step_roofline import SMOLLM2_135M  # noqa: E402
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF, encode_prompts  # noqa: E402
from sparsedec.decode.api import generate, start  # noqa: E402
from sparsedec.model.params import init_random  # noqa: E402
from sparsedec.prompts import mt_bench  # noqa: E402
from sparsedec.weights.checkpoint import load_model  # noqa: E402


ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--gguf", default=DEFAULT_SMOLLM2_GGUF)
ap.add_argument("--random-weights", action="store_true")
ap.add_argument("--out", default=None, help="JSON path (default: $OUT/ngram_step_profile.json)")
ap.add_argument("--guesses", type=int, default=20)
ap.add_argument("--length", type=int, default=4, help="FAFO k = Lookahead N - 1")
ap.add_argument("--top", type=int, default=25, help="kernels listed per method")
args = ap.parse_args()
if jax.default_backend() != "gpu":
  sys.exit("ngram_step_profile.py profiles GPU kernels: run it on a GPU")
if args.random_weights:
  cfg = SMOLLM2_135M
  params = init_random(cfg, jax.random.key(0))
  ids = [list(np.random.default_rng(0).integers(3, 2000, 300))]
else:
  cfg, params, tok = load_model(args.gguf, dtype="bfloat16")
  ids = encode_prompts(tok, mt_bench(turn=1)[:1], chat_template=True)
a = argparse.Namespace(policy="streaming", budget_blocks=4, block_size=64, length=args.length,
                       candidates=7)
out = {"device": jax.devices()[0].device_kind, "guesses": args.guesses, "length": args.length,
       "random_weights": args.random_weights}
for name in ["dense", "fafo", "lookahead"]:
  fresh_executables()       # no earlier method's programs beside this one's (NOTES session 69)
  method = make_method(name, args.guesses, a)
  generate(cfg, params, ids, method=method, max_new_tokens=128, stop_tokens=())
  state, run = start(cfg, params, ids, max_new_tokens=128, stop_tokens=(), method=method)
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  done = jax.block_until_ready(run.advance(params, state))
  wall = time.perf_counter() - t0
  steps = int(jax.device_get(done.step))
  state, run = start(cfg, params, ids, max_new_tokens=128, stop_tokens=(), method=method)
  jax.block_until_ready(state)
  dt = device_time(lambda: jax.block_until_ready(run.advance(params, state)), steps, top=args.top)
  out[name] = dict(steps=steps, wall_per_step_us=wall / steps * 1e6,
                   device_per_step_us=dt.get("device_s", 0) * 1e6,
                   kernels_per_step=dt.get("kernels_per_call"),
                   top_us={k: v * 1e6 for k, v in dt.get("device_time_by_kernel", {}).items()},
                   top_launches=dt.get("launches_by_kernel", {}))
  print(name, json.dumps(out[name], indent=1), flush=True)
  with open(args.out or os.path.join(default_out_dir(), "ngram_step_profile.json"), "w") as f:
    json.dump(out, f, indent=1)
