"""How long building a GPTQ draft takes (`sparsedec.model.gptq`), on the device it runs on.

GPTQ's cost depends on the weight shapes and the calibration length, not on the values: random
bf16 weights at a model's shapes (`step_roofline.random_params`, generated on the device) and
random calibration tokens stand in for a checkpoint. Two measurements:
  * per weight shape: `gptq_quantize_weight` against a Hessian of random inputs (compile
    excluded; the median of --repeats calls), for each of the four quantized linears;
  * the whole draft: `gptq_quantize_params` (sequential, act-order; the layer walk and GPTQ) over
    the model's layers (--layers caps them), wall time per layer and in all; layer 0 includes the
    compiles, and `steady_layer_s` is the median of the others.

  python benchmarks/gptq_time.py --model llama-3.1-8b --calibration-tokens 2048 --out gptq.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._args import count  # noqa: E402
from benchmarks.step_roofline import LLAMA_31_8B, SMOLLM2_135M, random_params  # noqa: E402
from sparsedec.bench import device_description, log, peak_memory_bytes  # noqa: E402
from sparsedec.model.gptq import gptq_quantize_params, gptq_quantize_weight  # noqa: E402
from sparsedec.model.quant_weights import QUANTIZED_LINEARS  # noqa: E402

MODELS = {
    "llama-3.1-8b": LLAMA_31_8B,
    "smollm2-135m": SMOLLM2_135M,
}


def time_shapes(cfg, group: int, tokens: int, repeats: int) -> list[dict]:
  """gptq_quantize_weight per quantized linear's shape, on a Hessian of `tokens` random inputs."""
  lp = random_params(cfg.replace(num_layers=1), jax.random.key(2))["layers"][0]
  rows = []
  for name in QUANTIZED_LINEARS:
    w = lp[name]
    x = jax.random.normal(jax.random.key(3), (tokens, w.shape[0]), jnp.float32)
    h = jnp.einsum("ti,tj->ij", x, x, precision=jax.lax.Precision.HIGHEST)
    t0 = time.perf_counter()
    jax.block_until_ready(gptq_quantize_weight(w, h, group).codes)
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(gptq_quantize_weight(w, h, group).codes)
      times.append(time.perf_counter() - t0)
    row = {"linear": name, "shape": list(w.shape), "first_call_s": first,
           "median_s": float(np.median(times)) if times else None, "times_s": times}
    log(f"{name} {tuple(w.shape)}: median {row['median_s']} s (first call {first:.2f} s)")
    rows.append(row)
  return rows


def time_draft(cfg, group: int, tokens: int, sequences: int) -> dict:
  params = random_params(cfg, jax.random.key(1))
  rng = np.random.default_rng(0)
  calibration = [rng.integers(0, cfg.vocab_size, tokens // sequences).astype(np.int32)
                 for _ in range(sequences)]
  marks = [time.perf_counter()]

  def on_layer(i, layer):
    jax.block_until_ready(layer)
    marks.append(time.perf_counter())
    log(f"layer {i}: {marks[-1] - marks[-2]:.2f} s")

  draft = gptq_quantize_params(cfg, params, calibration, group=group, on_layer=on_layer)
  jax.block_until_ready(draft)
  per_layer = np.diff(marks).tolist()
  return {"layers": cfg.num_layers, "total_s": marks[-1] - marks[0], "per_layer_s": per_layer,
          "steady_layer_s": float(np.median(per_layer[1:])) if len(per_layer) > 1 else None}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=tuple(MODELS), default="llama-3.1-8b")
  p.add_argument("--layers", type=count, default=None, help="at most this many layers")
  p.add_argument("--group", type=int, default=128)
  p.add_argument("--calibration-tokens", type=count, default=2048)
  p.add_argument("--sequences", type=count, default=1,
                 help="calibration sequences (--calibration-tokens split evenly)")
  p.add_argument("--repeats", type=int, default=3,
                 help="timed calls after the first (0: first only)")
  p.add_argument("--skip-shapes", action="store_true")
  p.add_argument("--skip-draft", action="store_true")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  if args.calibration_tokens % args.sequences:    # the remainder was dropped, yet recorded
    p.error(f"--calibration-tokens {args.calibration_tokens} does not split evenly into "
            f"--sequences {args.sequences}")
  if args.repeats < 0:
    p.error(f"--repeats must be >= 0, got {args.repeats}")
  cfg = MODELS[args.model]
  if args.layers is not None:
    cfg = cfg.replace(num_layers=min(args.layers, cfg.num_layers))
  result = {"device": device_description(), "model": args.model, "config_layers": cfg.num_layers,
            "group": args.group, "calibration_tokens": args.calibration_tokens,
            "sequences": args.sequences}
  if not args.skip_shapes:
    result["shapes"] = time_shapes(cfg, args.group, args.calibration_tokens, args.repeats)
  if not args.skip_draft:
    result["draft"] = time_draft(cfg, args.group, args.calibration_tokens, args.sequences)
    log(f"draft: {result['draft']['total_s']:.1f} s for {cfg.num_layers} layers")
  result["memory"] = peak_memory_bytes()       # session 40's JSONs: "peak_bytes" (device)
  text = json.dumps(result, indent=1)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      f.write(text)
  print(text if not args.out else f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()
