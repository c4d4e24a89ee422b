"""Session 47 (CPU, fp32): FAFO's pool with the fumble guesses never stored (prompt and output
n-grams only; the forward still runs the fumble subsequences), session 45's setting otherwise."""
import json, time
from benchmarks.ngram_decoding import prompt_ids
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF
from sparsedec.compress import POLICIES
from sparsedec.decode import fafo as fafo_mod
from sparsedec.decode.api import generate
from sparsedec.decode.fafo import Fafo
from sparsedec.ngram import pool as ngram_pool
from sparsedec.weights.checkpoint import load_model
orig_insert = ngram_pool.insert
N_CHAIN = 40 * 4
def insert(pool, keys, lens, values, ok):
  ok = ok.at[:, :N_CHAIN].set(False)      # the fumble guesses come first in Fafo._store
  return orig_insert(pool, keys, lens, values, ok)
class P:                                   # fafo.py calls ngram_pool.insert through the module
  def __getattr__(self, name):
    return insert if name == "insert" else getattr(ngram_pool, name)
fafo_mod.ngram_pool = P()
cfg, params, tok = load_model(DEFAULT_SMOLLM2_GGUF, dtype="float32")
method = Fafo(subsequences=40, length=4, candidates=7,
              policy=POLICIES["streaming"](budget_blocks=4, block_size=64))
rows = []
for set_name in ("mt_bench", "humaneval"):
  for i, ids in enumerate(prompt_ids(tok, set_name, 10)):
    t = time.time()
    res = generate(cfg, params, [ids], method=method, max_new_tokens=256, stop_tokens=())
    rows.append({"set": set_name, "prompt": i, "tau": res.tau, "s": round(time.time() - t, 1)})
    print(json.dumps(rows[-1]), flush=True)
    json.dump(rows, open("/tmp/seed_only.json", "w"))
