"""Session 57: QuantSpec's flush alone at SmolLM2 shapes (30 layers, B 2, Hkv 3, D 64, 512 slots) on
this CPU: StableHLO ops, compile and run time, and a hash of every output leaf (bit-identity
across code versions). argv: group, JSON path."""
import json, time, sys, re
import jax, jax.numpy as jnp, numpy as np
from sparsedec.kv import quantized as qkv
from sparsedec.kv.dense import KVCache
L, B, HKV, D, S, G = 30, 2, 3, 64, 512, int(sys.argv[1]) if len(sys.argv) > 1 else 32
rng = np.random.default_rng(0)
k = tuple(jnp.asarray(rng.normal(size=(B, HKV, S, D)).astype(np.float32)) for _ in range(L))
v = tuple(jnp.asarray(rng.normal(size=(B, HKV, S, D)).astype(np.float32)) for _ in range(L))
dense = KVCache(k=k, v=v, lengths=jnp.asarray([200, 300], jnp.int32))
qc = qkv.from_dense(dense, G)
on = jnp.asarray([True, False])
f = jax.jit(qkv.flush)
txt = f.lower(qc, on).as_text()
ops = len(re.findall(r"= stablehlo\.|stablehlo\.\w+ ", txt))
t0 = time.perf_counter(); c = f.lower(qc, on).compile(); t1 = time.perf_counter(); compile_s = t1 - t0
out = c(qc, on)
leaves = [np.asarray(x) for x in jax.tree.leaves(out)]
import hashlib
h = hashlib.sha1(b"".join(x.tobytes() for x in leaves)).hexdigest()
print(f"G={G} ops={ops} compile={t1-t0:.2f}s hash={h}")
import collections
cnt = collections.Counter(re.findall(r"stablehlo\.(\w+)", txt))
print(cnt.most_common(15))
run_ms = None
out = c(qc, on); jax.block_until_ready(out)
t0 = time.perf_counter()
for _ in range(50): out = c(qc, on)
jax.block_until_ready(out); run_ms = (time.perf_counter()-t0)/50*1e3; print(f"run {run_ms:.2f} ms")
import subprocess
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump(dict(device="this CPU (2 cores)", code=rev, group=G, layers=L, batch=B, ops=ops, compile_s=round(compile_s, 2), run_ms=round(run_ms, 2), output_sha1=h, op_kinds=dict(cnt.most_common(15))), open(sys.argv[2], "w"), indent=1)
