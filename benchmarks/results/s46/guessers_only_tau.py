"""Session 46 (CPU, fp32): FAFO's fumbles against Lookahead's Jacobi window as guessers alone: both
pools filled only by their own guesser (prompt_ngrams = output_ngrams = False), 40 guesses, k 4
(N 5), m = G = 7, StreamingLLM 4 x 64, the 20 prompts of session 45's `tau_vs_loops.py`; writes
/tmp/guessers_only_<method>.json.   PYTHONPATH=. python benchmarks/results/s46/guessers_only_tau.py fafo"""
import json, sys, time
from benchmarks.ngram_decoding import prompt_ids
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF
from sparsedec.compress import POLICIES
from sparsedec.decode.api import generate
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.lookahead import Lookahead
from sparsedec.weights.checkpoint import load_model
cfg, params, tok = load_model(DEFAULT_SMOLLM2_GGUF, dtype="float32")
name = sys.argv[1]
method = {"fafo": Fafo(subsequences=40, length=4, candidates=7, prompt_ngrams=False, output_ngrams=False,
                       policy=POLICIES["streaming"](budget_blocks=4, block_size=64)),
          "lookahead": Lookahead(window=40, ngram=5, guesses=7, prompt_ngrams=False,
                                 output_ngrams=False)}[name]
rows = []
for set_name in ("mt_bench", "humaneval"):
  for i, ids in enumerate(prompt_ids(tok, set_name, 10)):
    t = time.time()
    res = generate(cfg, params, [ids], method=method, max_new_tokens=256, stop_tokens=())
    rows.append({"set": set_name, "prompt": i, name: res.tau, "s": round(time.time() - t, 1)})
    print(json.dumps(rows[-1]), flush=True)
    json.dump(rows, open(f"/tmp/guessers_only_{name}.json", "w"))
