"""Session 45 (CPU, fp32): FAFO and Lookahead tau per prompt beside the share of the text that loops
(`sparsedec.bench.repeated_ngram_share`); writes /tmp/tau_loops_G.json.  PYTHONPATH=. python tau_vs_loops.py 40"""
import json, sys, time
from benchmarks.ngram_decoding import prompt_ids
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF, repeated_ngram_share
from sparsedec.compress import POLICIES
from sparsedec.decode.api import generate
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.lookahead import Lookahead
from sparsedec.weights.checkpoint import load_model
cfg, params, tok = load_model(DEFAULT_SMOLLM2_GGUF, dtype="float32")
g = int(sys.argv[1]) if len(sys.argv) > 1 else 40
methods = {"fafo": Fafo(subsequences=g, length=4, candidates=7,
                        policy=POLICIES["streaming"](budget_blocks=4, block_size=64)),
           "lookahead": Lookahead(window=g, ngram=5, guesses=7)}
rows = []
for set_name in ("mt_bench", "humaneval"):
  for i, ids in enumerate(prompt_ids(tok, set_name, 10)):
    row = {"set": set_name, "prompt": i}
    for name, m in methods.items():
      t = time.time()
      res = generate(cfg, params, [ids], method=m, max_new_tokens=256, stop_tokens=())
      row[name] = res.tau
      row["share"] = repeated_ngram_share(res.tokens[0])
      row[name + "_s"] = round(time.time() - t, 1)
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(rows, open(f"/tmp/tau_loops_{g}.json", "w"))
