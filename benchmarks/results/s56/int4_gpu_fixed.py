"""Session 56: the library's "int4" product against "packed" on a GPU, over the widths
int4_gpu_sweep.py found wrong. Run (twice, the *_fixed_{1,2} JSONs) with a tried fix that is not
kept: `jax.lax.optimization_barrier` on the dequantized weight below 64 output columns, so XLA
could not fuse the dequantization into the dot. Still wrong, and not the same cells in the two
runs. JSON to argv[1]."""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from sparsedec.model.linear import linear
from sparsedec.model.quant_weights import quantize_weight
rows = []
rng = np.random.default_rng(0)
for n_in in (172, 256):
  for n_out in (8, 16, 24, 32, 40, 48, 56, 64, 72, 96):
    w = jnp.asarray(rng.normal(size=(n_in, n_out)).astype(np.float32))
    packed, qw = quantize_weight(w, group=64), quantize_weight(w, group=64, layout="int4")
    for dtype in ("float32", "bfloat16"):
      x = jnp.asarray(rng.normal(size=(2, 3, n_in)).astype(np.float32)).astype(dtype)
      want = np.asarray(linear(x, packed).astype(jnp.float32))
      got = np.asarray(jax.jit(linear)(x, qw).astype(jnp.float32))
      err = float((np.abs(got - want) / (np.abs(want).max() + 1e-30)).max())
      rows.append(dict(n_in=n_in, n_out=n_out, dtype=dtype, max_rel_err=err, ok=err < 1e-2))
print("bad:", sum(not r["ok"] for r in rows), "of", len(rows))
json.dump(dict(device=str(jax.devices()[0]), rows=rows), open(sys.argv[1], "w"), indent=1)
