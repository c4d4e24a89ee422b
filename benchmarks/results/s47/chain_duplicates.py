"""Session 47 (CPU, fp32): how many of FAFO's 40 fumble subsequences hold distinct k-token windows,
step by step (the serving API's `advance(steps=1)`), 3 prompts, `_setting.py`'s FAFO; with
`aligned`, every subsequence at p + 1 + i.
  PYTHONPATH=. python benchmarks/results/s47/chain_duplicates.py [aligned]"""
import sys

import jax
import numpy as np

import _setting
from sparsedec.decode import api

if sys.argv[1:] == ["aligned"]:
  _setting.patch_fumble_offsets("aligned")
cfg, params, tok = _setting.model()
method = _setting.fafo()
picked = {("mt_bench", 0), ("mt_bench", 2), ("humaneval", 0)}
for set_name, idx, ids in _setting.prompts(tok, 3):
  if (set_name, idx) not in picked:
    continue
  state, run = api.start(cfg, params, [ids], method=method, max_new_tokens=256, stop_tokens=())
  distinct, distinct_last2 = [], []
  for step in range(60):
    state = run.advance(params, state, steps=1)
    f = np.asarray(jax.device_get(state.extras.fumble))[0]          # [n, k]
    distinct.append(len({tuple(r) for r in f}))
    distinct_last2.append(len({tuple(r[-2:]) for r in f}))
    if bool(np.asarray(state.done)[0]):
      break
  print(set_name, idx, "steps", step + 1, "distinct windows (of 40) per step, every 5th:",
        distinct[::5], "distinct last-2:", distinct_last2[::5], flush=True)
  print("  last window sample:", [tok.decode(list(map(int, r))) for r in f[:8]], flush=True)
