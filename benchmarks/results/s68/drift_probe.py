"""Session 68: does a dense loop run slower after FAFO and Lookahead loops ran in the same process
(sessions 38 and 68 saw ~14% in ngram_decoding.py's dense_after rows)? SmolLM2-135M shapes with
random bf16 weights, a random 300-token prompt, 256 new tokens, B 1. Phases in one process:
dense, FAFO 40 x 4, Lookahead W 40, dense, FAFO, dense; each phase `reps` timed generate calls
after one warm call. Writes tokens/s per call with wall-clock stamps (to line up with an
nvidia-smi clock log). Usage: python drift_probe.py OUT.json [reps]"""
import argparse, json, sys, time
import jax
import numpy as np
from sparsedec.decode.api import generate
from sparsedec.model.config import ModelConfig
from sparsedec.model.params import init_random
sys.path.insert(0, ".")
from benchmarks.ngram_decoding import make_method  # noqa: E402

out_path = sys.argv[1]; reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
cfg = ModelConfig(   # SmolLM2-135M-Instruct's shapes (as benchmarks/ngram_step_profile.py)
    family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True, dtype="bfloat16")
params = init_random(cfg, jax.random.key(0))
ids = [list(np.random.default_rng(0).integers(3, 2000, 300))]
knobs = argparse.Namespace(policy="streaming", budget_blocks=4, block_size=64, length=4, candidates=7)
rows = []
for phase, name in enumerate(["dense", "fafo", "lookahead", "dense", "fafo", "dense"]):
  method = make_method(name, 40, knobs)
  generate(cfg, params, ids, method=method, max_new_tokens=256, stop_tokens=())
  for r in range(reps):
    res = generate(cfg, params, ids, method=method, max_new_tokens=256, stop_tokens=())
    rows.append({"phase": phase, "method": name, "rep": r, "stamp": time.time(),
                 "tokens_per_second": (res.num_generated - 1) / res.decode_seconds,
                 "steps": int(sum(res.active_steps))})
    print(rows[-1], flush=True)
json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, open(out_path, "w"), indent=1)
