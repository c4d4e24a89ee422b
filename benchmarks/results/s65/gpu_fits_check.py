"""Session 65, device call: api.start's memory check on a real GPU (the allocator's
bytes_limit / bytes_in_use branch of sparsedec.decode.fits), SmolLM2-sized random weights.
Writes $OUT/gpu_fits_check_s65.json."""
import json
import os
import time

import jax

import sparsedec
from sparsedec.decode import fits
from sparsedec.decode.methods import get_method
from sparsedec.model.config import ModelConfig
from sparsedec.model.params import init_random

out = {"device": str(jax.devices()[0]), "memory_stats": {
    k: int(v) for k, v in (jax.devices()[0].memory_stats() or {}).items()
    if k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}}
cfg = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                  max_position_embeddings=8192, dtype="bfloat16")
params = init_random(cfg, jax.random.key(0))
out["device_memory_bytes"] = fits.device_memory_bytes(jax.devices()[0])
rows = []
for name, method, kw in [
    ("dense B 8, 4K", "dense", dict(max_new_tokens=4, cache_size=4096)),
    ("fafo 40x6 + 7 candidates", get_method("fafo", subsequences=40, length=6, candidates=7),
     dict(max_new_tokens=4)),
    ("lookahead window 100000", get_method("lookahead", window=100000), dict(max_new_tokens=4)),
    ("fafo 100000 subsequences", get_method("fafo", subsequences=100000), dict(max_new_tokens=4)),
]:
  t0 = time.perf_counter()
  try:
    r = sparsedec.generate(cfg, params, [[1, 2, 3]] * 8, method=method, stop_tokens=(), **kw)
    rows.append({"run": name, "ran": True, "tokens": len(r.tokens[0]),
                 "seconds": time.perf_counter() - t0})
  except sparsedec.InputError as e:
    rows.append({"run": name, "ran": False, "error": str(e), "seconds": time.perf_counter() - t0})
  print(rows[-1], flush=True)
out["runs"] = rows
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gpu_fits_check_s65.json"), "w"),
          indent=1)
