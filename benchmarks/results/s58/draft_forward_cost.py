import time, sys, jax, jax.numpy as jnp, numpy as np
from sparsedec.weights.gguf_file import load_gguf
from sparsedec.model.forward import forward
from sparsedec.model.quant_weights import quantize_params
from sparsedec.kv.dense import init_cache
cfg, params, tok = load_gguf(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")
params = jax.tree.map(jnp.asarray, params)
draft = quantize_params(params, 32, "packed")
cache = init_cache(cfg, 2, 512).replace(lengths=jnp.array([300, 300], jnp.int32))
tokens = jnp.ones((2, 1), jnp.int32); pos = jnp.full((2, 1), 300, jnp.int32)
f = jax.jit(lambda p, c: forward(cfg, p, tokens, pos, c)[0])
for name, p in (("target", params), ("packed", draft)):
  y = f(p, cache).block_until_ready()
  t = time.perf_counter()
  for _ in range(10): y = f(p, cache).block_until_ready()
  print(name, (time.perf_counter() - t) / 10 * 1e3, "ms", flush=True)
print(f.lower(draft, cache).compile().as_text().count("fusion"), "fusions")
txt = f.lower(draft, cache).compile().as_text()
open("/tmp/draft_hlo.txt", "w").write(txt)
