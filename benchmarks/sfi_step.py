"""Slow-Fast Inference's fast and slow steps against one dense step, at Llama-3.1-8B shapes (GPU),
and the speedup they give at a share of slow steps.

Random bf16 weights and a random KV cache of `context` entries are generated on the device (as in
step_roofline.py). Timed, each `--steps` times inside one jitted fori_loop (`method_step_time`):
* dense: one dense step;
* fast: a SlowFast step that stays fast (no sentence-end tokens, max_fast_steps 64 > --steps):
  the sinks, `--budget` selected tokens per KV head and layer, the recent region, on
  sparse_attention;
* slow: a SlowFast step that is always slow (max_fast_steps 0): every block listed, then the
  Selector over the whole cache (the attention mass of the step's queries, top blocks).
Speedup at a slow-step share s: t_dense / ((1 - s) t_fast + s t_slow) (s from a real run: e.g.
SmolLM2's sentence ends, sfi_quality.py). Random weights: the tokens mean nothing, the times do.

  python benchmarks/sfi_step.py --contexts 32768 131072 --out $OUT/sfi_step.json
"""

from __future__ import annotations

import argparse
import json
import os

import jax

from benchmarks._timing import fresh_executables
from benchmarks.method_step import method_step_time
from benchmarks.step_roofline import LLAMA_31_8B, log, random_params, random_state, read_bandwidth
from sparsedec.bench import device_description
from sparsedec.decode.dense import Dense
from sparsedec.decode.sfi import SlowFast

SHARES = (0.02, 0.05, 0.1, 0.2)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--budget", type=int, default=2048, help="selected tokens per KV head")
  ap.add_argument("--block-size", type=int, default=64)
  ap.add_argument("--layers", type=int, default=None, help="fewer layers (CPU smoke test)")
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                "sfi_step.json"))
  args = ap.parse_args()
  cfg = LLAMA_31_8B if args.layers is None else LLAMA_31_8B.replace(num_layers=args.layers)
  on_gpu = jax.devices()[0].platform == "gpu"
  bw = read_bandwidth(4.0 if on_gpu else 0.25)
  params = random_params(cfg, jax.random.key(1))
  jax.block_until_ready(params)
  bs = args.block_size
  methods = {"dense": Dense(),
             "fast": SlowFast(budget_blocks=args.budget // bs, block_size=bs, max_fast_steps=64),
             "slow": SlowFast(budget_blocks=args.budget // bs, block_size=bs, max_fast_steps=0)}
  rows = []
  result = {"benchmark": "SlowFast fast / slow step vs dense step, Llama-3.1-8B shapes, bf16, B=1",
            "device": device_description(), "read_bandwidth_bytes_per_s": bw,
            "args": vars(args), "rows": rows}
  for context in args.contexts:
    row = {"context": context}
    rows.append(row)
    for name, method in methods.items():
      state = random_state(cfg, context, args.steps * 2 + 8, jax.random.key(context))
      fresh_executables()
      try:
        row[f"{name}_seconds"] = method_step_time(cfg, params, state, method,
                                                  args.steps)["step_seconds"]
      except Exception as e:  # noqa: BLE001 - record and go on
        row[f"{name}_error"] = repr(e)[:2000]
        log(f"{name} at {context}: {e!r}"[:500])
        continue
      log(f"context {context} {name}: {row[f'{name}_seconds'] * 1e3:.3f} ms")
      del state
    if all(f"{n}_seconds" in row for n in methods):
      d, f, s = row["dense_seconds"], row["fast_seconds"], row["slow_seconds"]
      row["fast_over_dense"], row["slow_over_dense"] = f / d, s / d
      row["speedup_by_slow_share"] = {str(x): d / ((1 - x) * f + x * s) for x in SHARES}
      log(f"context {context}: fast {f / d:.3f}x dense, slow {s / d:.3f}x dense; speedup at "
          + ", ".join(f"{x}: {v:.2f}x" for x, v in row["speedup_by_slow_share"].items()))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  log(f"wrote {args.out}")


if __name__ == "__main__":
  main()
