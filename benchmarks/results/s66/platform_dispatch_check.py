"""Session 66 (GPU): dispatch by lowering platform (lax.platform_dependent) against the old
jax.default_backend() dispatch. Run once per source tree (the new one, and a copy with the old
sparsedec/attention.py and sparsedec/model/quant_weights.py): for SmolLM2-135M-shaped bf16
forwards (30 layers, random weights) -- a dense step (T 1), a 3-token step, a draft forward with
"int4_t" 4-bit weights at T 1 (dp4a GEMVs) and T 5 (W4A16 GEMVs) -- it compiles for the GPU and
records the optimized HLO's opcode counts, conditionals left, Mosaic GPU custom calls, and the
device time per call (a jitted loop of calls, profiler kernel time).

  python platform_dispatch_check.py TAG OUT.json
"""
import collections
import json
import re
import sys

import jax
import jax.numpy as jnp

from benchmarks._timing import time_loop
from sparsedec.kv.dense import commit, init_cache
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.params import cast_params, init_random
from sparsedec.model.quant_weights import quantize_params

tag, out_path = sys.argv[1], sys.argv[2]
cfg = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                  max_position_embeddings=8192, tie_word_embeddings=True, dtype="bfloat16")
params = cast_params(init_random(cfg, jax.random.key(0), scale=0.05), cfg.dtype)
draft = quantize_params(params, 64, "int4_t")
B, CAP, CTX = 1, 4096, 3000
cache = init_cache(cfg, B, CAP)
fill = jax.random.normal(jax.random.key(1), (B, CTX, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
from sparsedec.kv.dense import InflightKV
cache = commit(cache, InflightKV(tuple(fill for _ in range(cfg.num_layers)),
                                 tuple(fill for _ in range(cfg.num_layers))),
               jnp.full((B,), CTX, jnp.int32))
rows = {}
for name, p, t in (("dense T1", params, 1), ("dense T3", params, 3), ("int4_t draft T1", draft, 1),
                   ("int4_t draft T5", draft, 5)):
  tokens = jnp.ones((B, t), jnp.int32)
  positions = CTX + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))

  def call(tokens, p, positions, cache, t=t):
    logits, _ = forward(cfg, p, tokens, positions, cache)
    return jnp.argmax(logits, -1).astype(jnp.int32) % 7 + tokens   # [B, T]: the next call's x

  text = jax.jit(call).lower(tokens, p, positions, cache).compile().as_text()
  ops = collections.Counter(re.findall(r"=\s*\S+\s+(\w[\w-]*)\(", text))
  timing = time_loop(call, tokens, p, positions, cache, num_calls=200, profile=True)
  rows[name] = {"conditionals": text.count(" conditional("),
                "mosaic_custom_calls": len(re.findall(r'custom_call_target="mosaic_gpu', text)),
                "opcode_counts": dict(sorted(ops.items())), "hlo_chars": len(text),
                "call_us_median": timing["median_s"] * 1e6,
                "device_us": timing.get("device_s", float("nan")) * 1e6,
                "kernels_per_call": timing.get("kernels_per_call")}
  print(tag, name, {k: v for k, v in rows[name].items() if k != "opcode_counts"}, flush=True)
json.dump({"tag": tag, "device": jax.devices()[0].device_kind, "rows": rows},
          open(out_path, "w"), indent=1)
