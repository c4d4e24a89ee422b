"""Per-kernel GPU profile of dense, FAFO and Lookahead decode steps at SmolLM2-135M shapes with
random bf16 weights (no checkpoint needed): per step, wall and GPU-busy time, kernels launched,
and every costly kernel with its time and launches per step (30 per step = once per layer).
Random weights accept almost no guesses, so the pool inserts take more rounds than with the real
model (`ngram_step_profile.py`); the per-layer kernels are the same.

  python benchmarks/ngram_step_kernels.py --tag NAME   ->  $OUT/profile_NAME.json
"""
import argparse, json, os, pathlib, sys, time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import jax, numpy as np
from sparsedec.model.config import ModelConfig
from sparsedec.model.params import init_random
from sparsedec.decode.api import start
from benchmarks._timing import device_time
from benchmarks.ngram_decoding import make_method

ap = argparse.ArgumentParser()
ap.add_argument("--tag", default="default")
ap.add_argument("--methods", default="dense,fafo,lookahead")
ap.add_argument("--steps", type=int, default=96)
args = ap.parse_args()
if jax.default_backend() != "gpu":
  sys.exit("ngram_step_kernels.py profiles GPU kernels: run it on a GPU")
cfg = ModelConfig(family='llama', vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                  rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                  dtype='bfloat16')
params = init_random(cfg, jax.random.key(0))
rng = np.random.default_rng(0)
ids = [list(rng.integers(3, 2000, 300))]
a = argparse.Namespace(policy="streaming", budget_blocks=4, block_size=64, length=4, candidates=7)
out = {"device": jax.devices()[0].device_kind, "tag": args.tag,
       "xla_flags": os.environ.get("XLA_FLAGS", "")}
for name in args.methods.split(","):
  method = make_method(name, 20, a)
  state, run = start(cfg, params, ids, max_new_tokens=args.steps, stop_tokens=(), method=method)
  jax.block_until_ready(run.advance(params, state))
  state, run = start(cfg, params, ids, max_new_tokens=args.steps, stop_tokens=(), method=method)
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  done = jax.block_until_ready(run.advance(params, state))
  wall = time.perf_counter() - t0
  steps = int(jax.device_get(done.step))
  state, run = start(cfg, params, ids, max_new_tokens=args.steps, stop_tokens=(), method=method)
  jax.block_until_ready(state)
  dt = device_time(lambda: jax.block_until_ready(run.advance(params, state)), steps, top=80)
  res = dict(steps=steps, wall_per_step_us=wall / steps * 1e6,
             device_per_step_us=dt["device_s"] * 1e6, kernels_per_step=dt["kernels_per_call"],
             kernels=[(k, round(v * 1e6, 2), round(dt["launches_by_kernel"][k], 2))
                      for k, v in dt["device_time_by_kernel"].items()])
  out[name] = res
  print(name, res["wall_per_step_us"], res["device_per_step_us"], res["kernels_per_step"], flush=True)
od = os.environ.get("OUT", "/tmp")
with open(os.path.join(od, f"profile_{args.tag}.json"), "w") as f:
  json.dump(out, f, indent=1)
