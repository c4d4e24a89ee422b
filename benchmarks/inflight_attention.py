"""decode_attention / sparse_attention per call with the in-flight part as its own kernel
(`pallas_kernels.inflight_attention`) against the same part in jnp inside the combine (GPU):
wall and GPU-busy time per call, kernels per call. Shapes: a SmolLM2 FAFO step (T = 109), a
SmolLM2 Lookahead / dense step (T = 108, 1), Llama-3.1-8B decode at 16K (Tq 1, 16, 64) and a
Llama-3.1-8B FAFO step at 4K (T = 283).

  python benchmarks/inflight_attention.py   ->  $OUT/inflight_bench.json
"""
import json, os, pathlib, sys
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import jax, jax.numpy as jnp, numpy as np
from benchmarks._timing import time_loop
from pallas_kernels.decode_attention import DecodeConfig, decode_attention
from pallas_kernels.sparse_attention import SparseConfig, sparse_attention
from sparsedec.decode.fafo import fafo_layout

def arrays(b, t, hq, hkv, d, s, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  n = lambda k, sh: jax.random.normal(k, sh, jnp.float32).astype(jnp.bfloat16)
  return (n(ks[0], (b, t, hq, d)), n(ks[1], (b, hkv, s, d)), n(ks[2], (b, hkv, s, d)),
          n(ks[3], (b, t, hkv, d)), n(ks[4], (b, t, hkv, d)))

res = []
def rec(name, fn, *args):
  r = time_loop(fn, *args, num_calls=400, unroll=8, profile=True)
  row = dict(name=name, wall_us=r["min_s"] * 1e6, device_us=r.get("device_s", 0) * 1e6,
             kernels=r.get("kernels_per_call"), top={k: v * 1e6 for k, v in r.get("device_time_by_kernel", {}).items()})
  print(json.dumps(row)[:300], flush=True)
  res.append(row)

# SmolLM2 FAFO step attention: T = 109 (20 x 4 fumble, 1 + 7 x 4), cache 1024, 4 blocks of 64.
mask_np, _ = fafo_layout(20, 4, 7)
q, k, v, kn, vn = arrays(1, 109, 9, 3, 64, 1024)
lengths = jnp.array([400]); mask = jnp.asarray(mask_np)
tables = jnp.array([[[0, 4, 5, 6]] * 3], jnp.int32); counts = jnp.full((1, 3), 4, jnp.int32)
for mode in ["kernel", "jnp"]:
  rec(f"smollm2 fafo sparse T=109 inflight={mode}",
      lambda q, k, v, kn, vn, tables, counts, lengths, mode=mode: sparse_attention(
          q, k, v, tables, counts, lengths, kn, vn, mask, block_size=64, sparse_queries=80,
          config=SparseConfig(inflight=mode)), q, k, v, kn, vn, tables, counts, lengths)
# SmolLM2 Lookahead / dense shapes through decode_attention.
for t in [108, 1]:
  q, k, v, kn, vn = arrays(1, t, 9, 3, 64, 1024)
  m = jnp.asarray(np.tril(np.ones((t, t), bool)))
  for mode in ["kernel", "jnp"]:
    rec(f"smollm2 decode T={t} inflight={mode}",
        lambda q, k, v, kn, vn, lengths, mode=mode, m=m: decode_attention(
            q, k, v, lengths, kn, vn, m, config=DecodeConfig(inflight=mode)), q, k, v, kn, vn, lengths)
# Llama-8B shapes: decode Tq 1/16/64 at 16K, FAFO T=283 at 4K.
for t, s in [(1, 16384), (16, 16384), (64, 16384)]:
  q, k, v, kn, vn = arrays(1, t, 32, 8, 128, s)
  m = jnp.asarray(np.tril(np.ones((t, t), bool))); L = jnp.array([s])
  for mode in ["kernel", "jnp"]:
    rec(f"llama decode T={t} S={s} inflight={mode}",
        lambda q, k, v, kn, vn, L, mode=mode, m=m: decode_attention(
            q, k, v, L, kn, vn, m, config=DecodeConfig(inflight=mode)), q, k, v, kn, vn, L)
mask_np, _ = fafo_layout(40, 6, 7)
q, k, v, kn, vn = arrays(1, 283, 32, 8, 128, 4096)
mask = jnp.asarray(mask_np); L = jnp.array([4096])
tables = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (1, 8, 16)); counts = jnp.full((1, 8), 16, jnp.int32)
for mode in ["kernel", "jnp"]:
  rec(f"llama fafo sparse T=283 S=4K inflight={mode}",
      lambda q, k, v, kn, vn, tables, counts, L, mode=mode: sparse_attention(
          q, k, v, tables, counts, L, kn, vn, mask, block_size=64, sparse_queries=240,
          config=SparseConfig(inflight=mode)), q, k, v, kn, vn, tables, counts, L)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "inflight_bench.json"), "w") as f:
  json.dump(dict(device=jax.devices()[0].device_kind, results=res), f, indent=1)
