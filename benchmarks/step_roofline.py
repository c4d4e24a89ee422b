"""One dense decode step at Llama-3.1-8B shapes against the bandwidth roofline (GPU).

Random bf16 weights and a random KV cache are generated on the device (nothing large travels).
The step is timed inside one jit (a fori_loop of N steps, no Python dispatch per step), and the
roofline is (weight bytes + KV bytes of the context) / the device's read bandwidth measured in
the same run (a reduction over a multi-GiB array).

  python benchmarks/step_roofline.py --contexts 1024 8192 32768 --out results.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparsedec.bench import device_description, log
from sparsedec.decode.api import CAPACITY_ALIGN
from sparsedec.decode.dense import Dense
from sparsedec.decode.loop import StepContext
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.decode.state import DecodeState
from sparsedec.kv.dense import KVCache
from sparsedec.model.config import ModelConfig, RopeScaling
from sparsedec.model.params import num_bytes, param_shapes

LLAMA_31_8B = ModelConfig(
    family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
    eos_token_ids=(128001,), dtype="bfloat16")
# SmolLM2-135M-Instruct's shapes (what load_model reads from its GGUF): 30 layers, 576 wide,
# 9 / 3 heads of 64, tied embeddings.
SMOLLM2_135M = ModelConfig(
    family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True, dtype="bfloat16")




def time_fn(fn, *args, repeats: int = 5) -> float:
  """Median wall time of fn(*args) after one warm-up (fn blocks on its result)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def read_bandwidth(gib: float = 4.0, iters: int = 20) -> float:
  """Bytes/s of a reduction over a `gib` GiB bf16 array (iters reductions inside one jit)."""
  n = int(gib * 2**30) // 2
  x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), jnp.bfloat16)

  @jax.jit
  def many(x):
    def body(i, acc):
      return acc + jnp.sum(x * (1 + i).astype(x.dtype), dtype=jnp.float32)
    return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

  seconds = time_fn(many, x)
  del x
  return n * 2 * iters / seconds


def random_params(cfg: ModelConfig, key) -> dict:
  """Random params built per layer by one small jitted function (compiled once, called L times):
  a single jit over all 8B weights spent minutes compiling its RNG on the GPU."""
  shapes = param_shapes(cfg)

  @functools.partial(jax.jit, static_argnums=0)
  def normal(shape, key):
    return 0.02 * jax.random.normal(key, shape, jnp.bfloat16)

  keys = iter(jax.random.split(key, 4 + 16 * cfg.num_layers))
  params = {name: normal(shape, next(keys)) for name, shape in shapes.items() if name != "layers"}
  params["final_norm"] = jnp.ones(shapes["final_norm"], jnp.bfloat16)
  params["layers"] = []
  for layer in shapes["layers"]:
    lp = {name: normal(shape, next(keys)) for name, shape in layer.items()}
    for name in ("attn_norm", "mlp_norm"):
      lp[name] = jnp.ones(layer[name], jnp.bfloat16)
    params["layers"].append(lp)
  return params


def random_state(cfg: ModelConfig, context: int, steps: int, key) -> DecodeState:
  """A decode state whose cache holds `context` random entries, room for `steps` more. The
  capacity is aligned to 128 slots as `generate` aligns it (an unaligned capacity makes XLA pad,
  i.e. copy, the whole cache in every attention dot: 360 us/step at 8K on an H200)."""
  capacity = -(-(context + steps + 1) // CAPACITY_ALIGN) * CAPACITY_ALIGN
  shape = (1, cfg.num_kv_heads, capacity, cfg.head_dim)
  normal = jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16))
  keys = jax.random.split(key, 2 * cfg.num_layers)
  ks = tuple(normal(k) for k in keys[: cfg.num_layers])
  vs = tuple(normal(k) for k in keys[cfg.num_layers:])
  cache = KVCache(k=ks, v=vs, lengths=jnp.full((1,), context, jnp.int32))
  tokens = jnp.asarray(np.random.default_rng(context).integers(0, cfg.vocab_size,
                                                               (1, capacity + 1)), jnp.int32)
  return DecodeState(tokens=tokens, num_tokens=jnp.full((1,), context + 1, jnp.int32),
                     prompt_lengths=jnp.full((1,), context, jnp.int32),
                     limits=jnp.full((1,), capacity + 1, jnp.int32),
                     done=jnp.zeros((1,), bool), cache=cache,
                     keys=jax.random.split(key, 1), step=jnp.zeros((), jnp.int32),
                     active_steps=jnp.zeros((1,), jnp.int32))


def step_time(cfg: ModelConfig, params, state: DecodeState, steps: int) -> float:
  ctx = StepContext(SamplingConfig(), ())
  method = Dense()

  @functools.partial(jax.jit, donate_argnums=1)
  def run(params, state):
    return jax.lax.fori_loop(0, steps, lambda i, s: method.step(cfg, params, s, ctx), state)

  # the state is donated: thread it through so every call reads the same context length
  compiled = run.lower(params, state).compile()
  log("step loop compiled")
  state = compiled(params, state)
  jax.block_until_ready(state)
  log("first run done")
  run = compiled
  times = []
  for _ in range(3):
    state = state.replace(cache=state.cache.replace(lengths=state.cache.lengths - steps),
                          num_tokens=state.num_tokens - steps)
    t = time.perf_counter()
    state = run(params, state)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t)
  return float(np.median(times)) / steps


def profile_steps(cfg: ModelConfig, params, state: DecodeState, steps: int, out: str) -> None:
  """A perfetto trace (Chrome JSON) of `steps` decode steps in one jitted loop, copied to
  `out`.json.gz (kernel names and durations, for per-kernel accounting)."""
  import glob
  import shutil
  import tempfile
  ctx = StepContext(SamplingConfig(), ())
  run = jax.jit(lambda p, s: jax.lax.fori_loop(0, steps, lambda i, x: Dense().step(cfg, p, x, ctx),
                                               s))
  jax.block_until_ready(run(params, state))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      jax.block_until_ready(run(params, state))
    traces = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
    if traces:
      shutil.copy(traces[0], out + ".json.gz")
      log(f"trace written to {out}.json.gz")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
  ap.add_argument("--steps", type=int, default=64)
  ap.add_argument("--attention", nargs="+", default=["auto", "reference"],
                  help="ModelConfig.attention choices to time (auto = Pallas kernel on a GPU)")
  ap.add_argument("--layers", type=int, default=None, help="fewer layers (CPU smoke test)")
  ap.add_argument("--profile", action="store_true",
                  help="also write a perfetto trace of a few steps per context beside --out")
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                "step_roofline.json"))
  args = ap.parse_args()
  cfg = LLAMA_31_8B if args.layers is None else LLAMA_31_8B.replace(num_layers=args.layers)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  bw = read_bandwidth(4.0 if jax.devices()[0].platform == "gpu" else 0.25)
  log(f"read bandwidth {bw / 1e12:.2f} TB/s")
  params = random_params(cfg, jax.random.key(1))
  jax.block_until_ready(params)
  weight_bytes = num_bytes(params)
  log(f"random weights: {weight_bytes / 2**30:.2f} GiB")
  rows = []
  result = {"benchmark": "dense decode step, Llama-3.1-8B shapes, bf16, B=1",
            "read_bandwidth_bytes_per_s": bw, "steps_per_timing": args.steps,
            "layers": cfg.num_layers, "device": device_description(), "rows": rows}
  for context in args.contexts:
    for attention in args.attention:
      run_cfg = cfg.replace(attention=attention)
      state = random_state(run_cfg, context, args.steps * 2, jax.random.key(context))
      jax.block_until_ready(state)
      log(f"state for context {context} ready (attention={attention})")
      seconds = step_time(run_cfg, params, state, args.steps)
      del state
      if args.profile:
        profile_steps(run_cfg, params, random_state(run_cfg, context, 8, jax.random.key(1)), 4,
                      os.path.join(os.path.dirname(args.out), f"trace_{context}_{attention}"))
      kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * context * cfg.head_dim * 2
      roofline = (weight_bytes + kv_bytes) / bw
      rows.append({"context": context, "attention": attention, "step_seconds": seconds,
                   "roofline_seconds": roofline, "fraction_of_roofline": roofline / seconds,
                   "weight_bytes": weight_bytes, "kv_bytes": kv_bytes})
      print(f"context {context:6d} {attention:9s}: step {seconds * 1e3:7.3f} ms, roofline "
            f"{roofline * 1e3:7.3f} ms -> {100 * roofline / seconds:5.1f}%", flush=True)
      with open(args.out, "w") as f:                  # rewritten per row: a timeout keeps data
        json.dump(result, f, indent=2)
  print(f"read bandwidth {bw / 1e12:.2f} TB/s; wrote {args.out}")


if __name__ == "__main__":
  main()
