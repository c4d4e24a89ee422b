"""QuantSpec's draft weight layouts in the real loop (GPU, SmolLM2-135M-Instruct, bf16, greedy,
gamma 4, verify_precision full, 4 MT-Bench prompts x 128 tokens): "auto" (the W4A16 Pallas
kernel's "int4_t" on a GPU), "packed" and "int4_reduce" should accept alike (the same quantized
weights; only fp rounding differs); tau, acceptance, tokens/s and rows identical to dense greedy.

  python benchmarks/quantspec_weight_layouts.py [--gguf PATH] -> $OUT/quantspec_weight_layouts.json
"""
import argparse
import json
import os
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks._timing import default_out_dir  # noqa: E402
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF, encode_prompts  # noqa: E402
from sparsedec.decode.api import generate  # noqa: E402
from sparsedec.decode.quantspec import QuantSpec  # noqa: E402
from sparsedec.prompts import mt_bench  # noqa: E402
from sparsedec.weights.checkpoint import load_model  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--gguf", default=DEFAULT_SMOLLM2_GGUF)
args = ap.parse_args()
cfg, params, tok = load_model(args.gguf, dtype="bfloat16")
ids = encode_prompts(tok, mt_bench(turn=1)[:4], chat_template=True)
out = {"device": jax.devices()[0].device_kind}
dense = generate(cfg, params, ids, max_new_tokens=128, stop_tokens=())
for layout in ["auto", "packed", "int4_reduce"]:
  m = QuantSpec(gamma=4, verify_precision="full", weight_layout=layout)
  print(layout, "->", m.resolved_weight_layout(), flush=True)
  r = generate(cfg, params, ids, method=m, max_new_tokens=128, stop_tokens=())
  same = sum(list(a) == list(b) for a, b in zip(r.tokens, dense.tokens))
  out[layout] = dict(resolved=m.resolved_weight_layout(), identical_rows=same, rows=len(ids),
                     tau=r.tau, stats=r.method_stats, tokens_per_second=r.tokens_per_second)
  print(layout, json.dumps(out[layout]), flush=True)
  with open(os.path.join(default_out_dir(), "quantspec_weight_layouts.json"), "w") as f:
    json.dump(out, f, indent=1)
