"""Session 46 (CPU, fp32): FAFO's tau against its StreamingLLM budget (blocks of 64 slots) at 40
guesses, k 4, m 7, on the 20 prompts of session 45's `tau_vs_loops.py` (whose budget-4 FAFO and
Lookahead taus are the baseline); writes /tmp/fafo_budget_tau.json.
  PYTHONPATH=. python benchmarks/results/s46/fafo_budget_tau.py 2 8"""
import json, sys, time
from benchmarks.ngram_decoding import prompt_ids
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF
from sparsedec.compress import POLICIES
from sparsedec.decode.api import generate
from sparsedec.decode.fafo import Fafo
from sparsedec.weights.checkpoint import load_model
cfg, params, tok = load_model(DEFAULT_SMOLLM2_GGUF, dtype="float32")
budgets = [int(b) for b in sys.argv[1:]] or [2, 8]
rows = []
for set_name in ("mt_bench", "humaneval"):
  for i, ids in enumerate(prompt_ids(tok, set_name, 10)):
    row = {"set": set_name, "prompt": i, "prompt_tokens": len(ids)}
    for b in budgets:
      m = Fafo(subsequences=40, length=4, candidates=7,
               policy=POLICIES["streaming"](budget_blocks=b, block_size=64))
      t = time.time()
      res = generate(cfg, params, [ids], method=m, max_new_tokens=256, stop_tokens=())
      row[f"fafo_b{b}"] = res.tau
      row[f"fafo_b{b}_s"] = round(time.time() - t, 1)
    rows.append(row)
    print(json.dumps(row), flush=True)
    json.dump(rows, open("/tmp/fafo_budget_tau.json", "w"))
