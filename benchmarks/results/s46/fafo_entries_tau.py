"""Session 46 (CPU, fp32): FAFO's tau against its pool's per-key capacity (`entries_per_key`, LRU;
default 7) in session 45's setting (40 guesses, k 4, m 7, StreamingLLM 4 x 64, pools seeded), the
20 prompts of `tau_vs_loops.py`; writes /tmp/fafo_entries_<E>.json.
  PYTHONPATH=. python benchmarks/results/s46/fafo_entries_tau.py 14"""
import json, sys, time
from benchmarks.ngram_decoding import prompt_ids
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF
from sparsedec.compress import POLICIES
from sparsedec.decode.api import generate
from sparsedec.decode.fafo import Fafo
from sparsedec.weights.checkpoint import load_model
cfg, params, tok = load_model(DEFAULT_SMOLLM2_GGUF, dtype="float32")
entries = int(sys.argv[1])
method = Fafo(subsequences=40, length=4, candidates=7, entries_per_key=entries,
              policy=POLICIES["streaming"](budget_blocks=4, block_size=64))
rows = []
for set_name in ("mt_bench", "humaneval"):
  for i, ids in enumerate(prompt_ids(tok, set_name, 10)):
    t = time.time()
    res = generate(cfg, params, [ids], method=method, max_new_tokens=256, stop_tokens=())
    rows.append({"set": set_name, "prompt": i, f"fafo_e{entries}": res.tau, "s": round(time.time() - t, 1)})
    print(json.dumps(rows[-1]), flush=True)
    json.dump(rows, open(f"/tmp/fafo_entries_{entries}.json", "w"))
