"""Device-time breakdown of B=1 greedy decoding on SmolLM2-135M-Instruct (GPU): for dense, FAFO
and Lookahead at 20 guesses, wall and GPU-busy time per step, kernels launched per step and the
costliest kernels (profiler trace of one 128-token decode of the first MT-Bench prompt).

  python benchmarks/ngram_step_profile.py [--gguf PATH]   ->  $OUT/ngram_step_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks._timing import default_out_dir, device_time  # noqa: E402
from benchmarks.ngram_decoding import make_method  # noqa: E402
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF, encode_prompts  # noqa: E402
from sparsedec.decode.api import generate, start  # noqa: E402
from sparsedec.prompts import mt_bench  # noqa: E402
from sparsedec.weights.checkpoint import load_model  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--gguf", default=DEFAULT_SMOLLM2_GGUF)
ap.add_argument("--guesses", type=int, default=20)
ap.add_argument("--length", type=int, default=4, help="FAFO k = Lookahead N - 1")
args = ap.parse_args()
cfg, params, tok = load_model(args.gguf, dtype="bfloat16")
ids = encode_prompts(tok, mt_bench(turn=1)[:1], chat_template=True)
a = argparse.Namespace(policy="streaming", budget_blocks=4, block_size=64, length=args.length,
                       candidates=7)
out = {"device": jax.devices()[0].device_kind, "guesses": args.guesses, "length": args.length}
for name in ["dense", "fafo", "lookahead"]:
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
  dt = device_time(lambda: jax.block_until_ready(run.advance(params, state)), steps, top=25)
  out[name] = dict(steps=steps, wall_per_step_us=wall / steps * 1e6,
                   device_per_step_us=dt.get("device_s", 0) * 1e6,
                   kernels_per_step=dt.get("kernels_per_call"),
                   top_us={k: v * 1e6 for k, v in dt.get("device_time_by_kernel", {}).items()})
  print(name, json.dumps(out[name], indent=1), flush=True)
  with open(os.path.join(default_out_dir(), "ngram_step_profile.json"), "w") as f:
    json.dump(out, f, indent=1)
