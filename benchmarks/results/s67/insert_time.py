"""Session 67: one jitted ngram_pool.insert on the CPU, FAFO-shaped (B rows, M = n k + (k + 1) k
items of k-token keys and values from a small vocabulary, so keys repeat), the pool pre-filled
by 20 such calls; median seconds a call. Usage: python insert_time.py n k [B]"""
import sys, time
import numpy as np
import jax, jax.numpy as jnp
from sparsedec.ngram import pool as P

n, k = int(sys.argv[1]), int(sys.argv[2]); b = int(sys.argv[3]) if len(sys.argv) > 3 else 4
m = n * k + (k + 1) * k
cfg = P.PoolConfig(key_len=k, value_len=k, entries_per_key=7, num_buckets=1024, bucket_ways=4)
rng = np.random.default_rng(0)
def items():
  keys = rng.integers(0, 30, (b, m, k)).astype(np.int32)
  lens = rng.integers(1, k + 1, (b, m)).astype(np.int32)
  return keys, lens, rng.integers(0, 30, (b, m, k)).astype(np.int32), rng.random((b, m)) < 0.9
ins = jax.jit(P.insert)
pool = P.init_pool(cfg, b)
for _ in range(20):
  pool = ins(pool, *items())
jax.block_until_ready(pool)
args = items(); times = []
for _ in range(5):
  t0 = time.perf_counter(); jax.block_until_ready(ins(pool, *args)); times.append(time.perf_counter() - t0)
print(f"n {n} k {k} B {b} M {m}: {np.median(times) * 1e3:.1f} ms a call")
