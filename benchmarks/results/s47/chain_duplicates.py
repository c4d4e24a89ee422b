"""Session 47 (CPU, fp32): how many of FAFO's 40 fumble subsequences hold distinct k-token windows,
step by step (the serving API's `advance(steps=1)`), 3 prompts, session 45's setting.
  PYTHONPATH=. python benchmarks/results/s47/chain_duplicates.py"""
import numpy as np
import jax
from benchmarks.ngram_decoding import prompt_ids
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF
from sparsedec.compress import POLICIES
from sparsedec.decode import api
from sparsedec.decode.fafo import Fafo
from sparsedec.weights.checkpoint import load_model
cfg, params, tok = load_model(DEFAULT_SMOLLM2_GGUF, dtype="float32")
method = Fafo(subsequences=40, length=4, candidates=7,
              policy=POLICIES["streaming"](budget_blocks=4, block_size=64))
for set_name, idx in (("mt_bench", 0), ("mt_bench", 2), ("humaneval", 0)):
  ids = prompt_ids(tok, set_name, idx + 1)[idx]
  state, run = api.start(cfg, params, [ids], method=method, max_new_tokens=256, stop_tokens=())
  distinct, distinct_last2, stream_dupes = [], [], []
  for step in range(60):
    state = run.advance(params, state, steps=1)
    f = np.asarray(jax.device_get(state.extras.fumble))[0]          # [n, k]
    distinct.append(len({tuple(r) for r in f}))
    distinct_last2.append(len({tuple(r[-2:]) for r in f}))
    if bool(np.asarray(state.done)[0]): break
  print(set_name, idx, "steps", step + 1, "distinct windows (of 40) per step, every 5th:",
        distinct[::5], "distinct last-2:", distinct_last2[::5], flush=True)
  print("  last window sample:", [tok.decode(list(map(int, r))) for r in f[:8]], flush=True)
