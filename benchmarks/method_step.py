"""One decode step of FAFO / Lookahead / draft-model speculative decoding against one dense step,
at Llama-3.1-8B shapes (GPU).

Random bf16 weights and a random KV cache of `context` entries are generated on the device (as in
step_roofline.py). Each method's `step` (the whole step: pool lookup, one forward over its T
tokens, verification, commit, pool insert) runs `--steps` times inside one jitted fori_loop; the
time per step is divided by the dense step's time from the same run.

Defaults are the issue's setting: FAFO with 40 subsequences, k = 6, m = 7 candidates and a
StreamingLLM budget of 1K entries (16 blocks of 64; `--block-size`); Lookahead at the same
guess count (W = 40, N = 7, G = 7). Pools start empty (no prompt n-grams: seeding from a 32K
random context is not what is being timed). "speculative" (not in the default --methods): a
Llama-3.2-1B-shaped draft (same vocabulary) proposing --gamma tokens a step, the 8B model
verifying them; its row also gives the speedup projected for per-draft acceptance rates alpha
(expected tokens a step (1 - alpha^(gamma+1)) / (1 - alpha), over the step ratio), labelled
projected: random weights accept nothing.

  python benchmarks/method_step.py --contexts 4096 32768 --out $OUT/method_step.json
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

from benchmarks._timing import device_time, fresh_executables
from benchmarks.step_roofline import LLAMA_31_8B, log, random_params, random_state, read_bandwidth
from sparsedec.bench import device_description
from sparsedec.compress import StreamingLLM
from sparsedec.decode.dense import Dense
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.lookahead import Lookahead
from sparsedec.decode.loop import StepContext
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.decode.speculative import Speculative, with_draft_model

# Llama-3.2-1B's shapes: Llama-3.1-8B's vocabulary and RoPE, 16 layers of 2048, 32 / 8 heads of 64,
# tied embeddings.
LLAMA_32_1B = LLAMA_31_8B.replace(hidden_size=2048, intermediate_size=8192, num_layers=16,
                                  head_dim=64, tie_word_embeddings=True)
ALPHAS = (0.6, 0.7, 0.8, 0.9)


def methods(args) -> dict:
  return {
      "dense": Dense(),
      "fafo": Fafo(subsequences=args.subsequences, length=args.length,
                   candidates=args.candidates, prompt_ngrams=False,
                   policy=StreamingLLM(budget_blocks=args.budget // args.block_size,
                                       block_size=args.block_size)),
      "lookahead": Lookahead(window=args.subsequences, ngram=args.length + 1,
                             guesses=args.candidates, prompt_ngrams=False),
      "speculative": Speculative(draft=draft_config(args), gamma=args.gamma),
  }


def draft_config(args):
  return LLAMA_32_1B if args.layers is None else LLAMA_32_1B.replace(num_layers=args.layers)


def projected(step_ratio: float, gamma: int) -> dict:
  """{alpha: projected speedup over dense} of a speculative step `step_ratio` dense steps long."""
  return {str(a): (1 - a ** (gamma + 1)) / (1 - a) / step_ratio for a in ALPHAS}


def method_step_time(cfg, params, state, method, steps: int, profile: bool = False) -> dict:
  """Seconds per step (median of 3 timed runs of `steps` steps after a warm-up run); with
  `profile` (GPU) also the profiler's busy time per step and its costliest kernels."""
  ctx = StepContext(SamplingConfig(), ())
  state = jax.jit(lambda p, s: method.init(cfg, p, s))(params, state)
  lengths0 = np.asarray(state.cache.lengths)
  num0 = np.asarray(state.num_tokens)

  @functools.partial(jax.jit, donate_argnums=1)
  def loop(params, state):
    return jax.lax.fori_loop(0, steps, lambda i, s: method.step(cfg, params, s, ctx), state)

  compiled = loop.lower(params, state).compile()
  log(f"{method.name}: compiled")

  def rewound(state):
    return state.replace(cache=state.cache.replace(lengths=jnp.asarray(lengths0)),
                         num_tokens=jnp.asarray(num0), done=jnp.zeros_like(state.done))

  times = []
  for _ in range(4):
    state = rewound(state)
    t = time.perf_counter()
    state = compiled(params, state)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t)
  out = {"step_seconds": float(np.median(times[1:])) / steps}
  if profile and jax.default_backend() == "gpu":
    box = [rewound(state)]

    def run():
      box[0] = compiled(params, box[0])
      jax.block_until_ready(box[0])

    out.update(device_time(run, steps, top=24))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
  ap.add_argument("--methods", nargs="+", default=["dense", "fafo", "lookahead"])
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--subsequences", type=int, default=40)
  ap.add_argument("--length", type=int, default=6)
  ap.add_argument("--candidates", type=int, default=7)
  ap.add_argument("--gamma", type=int, default=4, help="speculative: draft tokens a step")
  ap.add_argument("--budget", type=int, default=1024, help="StreamingLLM entries")
  ap.add_argument("--block-size", type=int, default=64, help="FAFO's cache block (C(kv) unit)")
  ap.add_argument("--profile", action="store_true",
                  help="GPU: also the profiler's busy time per step and its costliest kernels")
  ap.add_argument("--layers", type=int, default=None, help="fewer layers (CPU smoke test)")
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                "method_step.json"))
  args = ap.parse_args()
  cfg = LLAMA_31_8B if args.layers is None else LLAMA_31_8B.replace(num_layers=args.layers)
  on_gpu = jax.devices()[0].platform == "gpu"
  bw = read_bandwidth(4.0 if on_gpu else 0.25)
  params = random_params(cfg, jax.random.key(1))
  if "speculative" in args.methods:
    params = with_draft_model(params, random_params(draft_config(args), jax.random.key(2)))
  jax.block_until_ready(params)
  all_methods = methods(args)
  rows = []
  result = {"benchmark": "method step / dense step, Llama-3.1-8B shapes, bf16, B=1",
            "device": device_description(), "read_bandwidth_bytes_per_s": bw,
            "args": vars(args), "rows": rows}
  for context in args.contexts:
    times = {}
    for name in args.methods:
      method = all_methods[name]
      room = args.steps * (args.length + 2) * 5
      state = random_state(cfg, context, room, jax.random.key(context))
      fresh_executables()         # on a GPU: no earlier method's programs beside this one's
      try:
        timed = method_step_time(cfg, params, state, method, args.steps, args.profile)
        times[name] = timed.pop("step_seconds")
      except Exception as e:  # noqa: BLE001 - record and go on
        rows.append({"context": context, "method": name, "error": repr(e)[:2000]})
        log(f"{name} at {context}: {e!r}"[:500])
        continue
      del state
      t_fwd = getattr(method, "tokens_per_forward", 1)
      row = {"context": context, "method": name, "step_seconds": times[name],
             "tokens_per_forward": t_fwd, **timed}
      if "dense" in times:
        row["ratio_to_dense"] = times[name] / times["dense"]
        if isinstance(method, Speculative):
          row["projected_speedup_by_alpha"] = projected(row["ratio_to_dense"], method.gamma)
      rows.append(row)
      log(f"context {context} {name}: {times[name] * 1e3:.3f} ms/step (T={t_fwd})"
          + (f", {row['ratio_to_dense']:.3f}x dense" if "ratio_to_dense" in row else "")
          + (f", GPU busy {row['device_s'] * 1e3:.3f} ms in {row['kernels_per_call']:.0f} kernels"
             if "device_s" in row else ""))
      os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
      with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
  log(f"wrote {args.out}")


if __name__ == "__main__":
  main()
