"""Session 68: ngram_pool.insert_sequence_ngrams, one jitted call (default arguments of whichever
pool.py is on PYTHONPATH) on a B-row text of L tokens (a 50-token vocabulary) into FAFO's pool
(K = V = 4, 1024 x 4 ways, 7 entries) and Lookahead's (K 1, V 4); median of 5 calls, compile
excluded. Usage: python seed_time.py TAG OUT.json L..."""
import json, sys, time
import numpy as np
import jax
from sparsedec.ngram import pool as P

tag, out, lengths = sys.argv[1], sys.argv[2], [int(a) for a in sys.argv[3:]]
seed = jax.jit(P.insert_sequence_ngrams)
rows = []
for length in lengths:
  text = np.random.default_rng(0).integers(0, 50, (1, length)).astype(np.int32)
  lens = np.full((1,), length, np.int32)
  for name, cfg in [("fafo", P.PoolConfig(4, 4, 7, 1024, 4)), ("lookahead", P.PoolConfig(1, 4, 7, 1024, 4))]:
    pool = P.init_pool(cfg, 1)
    jax.block_until_ready(seed(pool, text, lens))
    times = []
    for _ in range(5):
      t0 = time.perf_counter(); jax.block_until_ready(seed(pool, text, lens))
      times.append(time.perf_counter() - t0)
    rows.append({"code": tag, "pool": name, "tokens": length, "seconds": float(np.median(times))})
    print(rows[-1], flush=True)
json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, open(out, "w"), indent=1)
