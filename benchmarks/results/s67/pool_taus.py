"""Session 67: FAFO's and Lookahead's tokens, taus and pool contents (observable: lookups) on
stories260K and SmolLM2 (CPU, fp32), to compare the round-based and the one-pass pool insert.
Usage: python pool_taus.py OUT.json [--smollm2 GGUF]"""
import json, sys, time
import numpy as np
import jax
import sparsedec
from sparsedec import prompts as prompt_sets
from sparsedec.decode.methods import get_method
from sparsedec.weights.checkpoint import load_model

out = {}
def run(tag, cfg, params, prompts, new, methods):
  for name, knobs in methods:
    m = get_method(name, **knobs)
    r = sparsedec.generate(cfg, params, prompts, max_new_tokens=new, stop_tokens=(), method=m)
    t0 = time.perf_counter()
    r = sparsedec.generate(cfg, params, prompts, max_new_tokens=new, stop_tokens=(), method=m)
    wall = time.perf_counter() - t0
    key = f"{tag}/{name}/{json.dumps(knobs, sort_keys=True)}"
    out[key] = dict(tokens=[list(map(int, t)) for t in r.tokens], tau=r.tau,
                    row_tau=[float(x) for x in r.row_tau], steps=int(r.steps), active_steps=list(map(int, r.active_steps)),
                    stats=r.method_stats, wall_s=wall)
    print(key, "tau", r.tau, "wall", round(wall, 2), flush=True)

cfg, params, tok = load_model("checkpoints/stories260K")
stories = [tok.encode(s) for s in ["Once upon a time", "Lily and Tom went to the park. They",
                                   "The little dog was sad because", "One day, a big bird"]]
run("stories", cfg, params, stories, 256, [
    ("fafo", dict(subsequences=40, length=4)), ("fafo", dict(subsequences=20, length=6)),
    ("fafo", dict(subsequences=10, length=20)),
    ("lookahead", dict(window=40)), ("lookahead", dict(window=10))])
if "--smollm2" in sys.argv:
  from sparsedec.weights.gguf_file import load_gguf
  cfg, params, tok = load_gguf(sys.argv[sys.argv.index("--smollm2") + 1], dtype="float32")
  params = jax.device_put(params)
  chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True), add_bos=False)
           for p in prompt_sets.mt_bench()[2:4]] + [tok.encode(prompt_sets.humaneval()[2])]
  run("smollm2", cfg, params, chats, 96, [("fafo", dict(subsequences=40, length=4)),
                                          ("lookahead", dict(window=40))])
json.dump(out, open(sys.argv[1], "w"), indent=1)
