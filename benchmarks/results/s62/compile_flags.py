"""XLA:CPU flags against the suite's compile time (session 62). One configuration per process:
  python compile_flags.py run LABEL OUT.json      (XLA_FLAGS from the environment)
  python compile_flags.py sweep OUTDIR            (every configuration, 2 cores each, in parallel)
Each process builds a SmolLM2-135M-shaped random fp32 model (30 layers; compile time does not
depend on the weights' values) and times, per method, generate's first call (compile + run) and a
second identical call (run only): dense 128 tokens, QuantSpec int8 (gamma 4, G 32) 128 tokens,
FAFO (StreamingLLM) 64 tokens, two prompts. Tokens are recorded so numerics can be compared."""

import json
import os
import subprocess
import sys
import time

CONFIGS = {
    "base": "",
    "no_verifier": "--xla_disable_hlo_passes=hlo-verifier",
    "region_copy": "--xla_cpu_copy_insertion_use_region_analysis=true",
    "no_unroll": "--xla_cpu_disable_loop_unrolling=true",
    "no_fusion_emitters": "--xla_cpu_use_fusion_emitters=false",
    "split1": "--xla_cpu_parallel_codegen_split_count=1",
    "combo": ("--xla_disable_hlo_passes=hlo-verifier "
              "--xla_cpu_copy_insertion_use_region_analysis=true "
              "--xla_cpu_disable_loop_unrolling=true"),
}


def run(label: str, out: str) -> None:
  import jax
  import numpy as np
  import sparsedec
  from sparsedec.compress.streaming import StreamingLLM
  from sparsedec.decode.fafo import Fafo
  from sparsedec.decode.quantspec import QuantSpec
  from sparsedec.model.config import ModelConfig
  from sparsedec.model.params import init_random

  cfg = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, dtype="float32")
  params = init_random(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 49152, 61).tolist(), rng.integers(0, 49152, 93).tolist()]
  rows = {}
  for name, method, n in (("dense", "dense", 128),
                          ("quantspec_int8", QuantSpec(gamma=4, quant_group=32), 128),
                          ("fafo", Fafo(subsequences=8, length=4, candidates=5,
                                        policy=StreamingLLM(budget_blocks=3, block_size=8,
                                                            sink_blocks=1)), 64)):
    times, toks = [], None
    for _ in range(2):
      t0 = time.perf_counter()
      r = sparsedec.generate(cfg, params, prompts, max_new_tokens=n, stop_tokens=(),
                             method=method)
      times.append(time.perf_counter() - t0)
      toks = [list(map(int, t)) for t in r.tokens]
    rows[name] = {"first_s": times[0], "second_s": times[1],
                  "compile_s_est": times[0] - times[1], "tokens": toks}
    print(label, name, times, flush=True)
  json.dump({"label": label, "xla_flags": os.environ.get("XLA_FLAGS", ""),
             "cpus": sorted(os.sched_getaffinity(0)), "rows": rows}, open(out, "w"))


def sweep(outdir: str) -> None:
  os.makedirs(outdir, exist_ok=True)
  procs = []
  for i, (label, flags) in enumerate(CONFIGS.items()):
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    cmd = ["taskset", "-c", f"{2 * i},{2 * i + 1}", sys.executable, __file__, "run", label,
           os.path.join(outdir, f"{label}.json")]
    procs.append(subprocess.Popen(cmd, env=env))
  for p in procs:
    p.wait()
  merged = {}
  for label in CONFIGS:
    path = os.path.join(outdir, f"{label}.json")
    if os.path.exists(path):
      merged[label] = json.load(open(path))
  base = merged.get("base", {}).get("rows", {})
  for label, m in merged.items():
    for name, r in m["rows"].items():
      r["tokens_equal_base"] = name in base and r["tokens"] == base[name]["tokens"]
      del r["tokens"]
  json.dump(merged, open(os.path.join(outdir, "compile_flags.json"), "w"), indent=1)
  for label, m in merged.items():
    print(label, {n: (round(r["first_s"], 1), round(r["second_s"], 1), r["tokens_equal_base"])
                  for n, r in m["rows"].items()})


if __name__ == "__main__":
  {"run": run, "sweep": sweep}[sys.argv[1]](*sys.argv[2:])
