"""Session 47 (CPU, fp32): FAFO's fumble subsequences at other positions: token i of subsequence j at
p + offset, offset 1 + i (aligned), 1 + j + i (the diagonal, fafo_layout's), 1 + j // 2 + i (half),
1 + 2 j + i (double); session 45's setting otherwise (40 guesses, k 4, m 7, StreamingLLM 4 x 64, seeded
pools, the first 10 prompts of each set). Writes /tmp/fumble_positions_MODE.json.
  PYTHONPATH=. python benchmarks/results/s47/fumble_positions_tau.py aligned"""
import json, sys, time
from benchmarks.ngram_decoding import prompt_ids
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF
from sparsedec.compress import POLICIES
from sparsedec.decode import fafo as fafo_mod
from sparsedec.decode.api import generate
from sparsedec.decode.fafo import Fafo
from sparsedec.weights.checkpoint import load_model
mode = sys.argv[1]
orig = fafo_mod.fafo_layout
def layout(n, k, m):
  mask, off = orig(n, k, m)
  off = off.copy()
  for i in range(k):
    for j in range(n):
      off[i * n + j] = {"aligned": 1 + i, "diagonal": 1 + j + i, "half": 1 + j // 2 + i,
                        "double": 1 + 2 * j + i}[mode]
  return mask, off
fafo_mod.fafo_layout = layout
cfg, params, tok = load_model(DEFAULT_SMOLLM2_GGUF, dtype="float32")
method = Fafo(subsequences=40, length=4, candidates=7,
              policy=POLICIES["streaming"](budget_blocks=4, block_size=64))
rows = []
n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
for set_name in ("mt_bench", "humaneval"):
  for i, ids in enumerate(prompt_ids(tok, set_name, n)):
    t = time.time()
    res = generate(cfg, params, [ids], method=method, max_new_tokens=256, stop_tokens=())
    rows.append({"set": set_name, "prompt": i, "tau": res.tau, "s": round(time.time() - t, 1)})
    print(json.dumps(rows[-1]), flush=True)
    json.dump(rows, open(f"/tmp/fumble_positions_{mode}.json", "w"))
