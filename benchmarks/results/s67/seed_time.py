"""Session 67: ngram_pool.insert_sequence_ngrams on the CPU, one jitted call on a B-row text of L
tokens (a 50-token vocabulary) into FAFO's pool (K = V = 4, 1024 x 4 ways, 7 entries) and
Lookahead's (K 1, V 4), at 1 span start a call (the old loop's shape) and at the default;
seconds a call (compile excluded). Usage: python seed_time.py L [B]"""
import sys, time
import numpy as np
import jax
from sparsedec.ngram import pool as P

length = int(sys.argv[1]); b = int(sys.argv[2]) if len(sys.argv) > 2 else 1
text = np.random.default_rng(0).integers(0, 50, (b, length)).astype(np.int32)
lens = np.full((b,), length, np.int32)
seed = jax.jit(P.insert_sequence_ngrams, static_argnames="starts_per_call")
for name, cfg in [("fafo", P.PoolConfig(4, 4, 7, 1024, 4)), ("lookahead", P.PoolConfig(1, 4, 7, 1024, 4))]:
  for per_call in (1, None):
    pool = P.init_pool(cfg, b)
    jax.block_until_ready(seed(pool, text, lens, starts_per_call=per_call))
    t0 = time.perf_counter(); jax.block_until_ready(seed(pool, text, lens, starts_per_call=per_call))
    print(f"{name} L {length} B {b} starts_per_call {per_call}: {time.perf_counter() - t0:.3f} s", flush=True)
