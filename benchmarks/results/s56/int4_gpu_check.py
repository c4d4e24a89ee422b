"""Session 56: the "int4" weight layout's product against "packed" on a GPU (the compiled test
test_weight_layouts_hold_the_same_quantized_weight[int4] failed on an H200: odd output columns
wrong). Variants: x dtype, precision, jit or not, shapes; writes JSON to argv[1]."""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from sparsedec.model.linear import linear
from sparsedec.model.quant_weights import quantize_weight

rows = []
rng = np.random.default_rng(0)
for (n_in, n_out, group) in [(172, 24, 64), (256, 64, 64), (576, 1536, 64), (4096, 4096, 128)]:
  w = jnp.asarray(rng.normal(size=(n_in, n_out)).astype(np.float32))
  packed = quantize_weight(w, group=group)
  qw = quantize_weight(w, group=group, layout="int4")
  for dtype in ("float32", "bfloat16"):
    x = jnp.asarray(rng.normal(size=(2, 3, n_in)).astype(np.float32)).astype(dtype)
    want = np.asarray(linear(x, packed).astype(jnp.float32))
    for how, fn in (("jit", jax.jit(linear)), ("eager", linear)):
      got = np.asarray(fn(x, qw).astype(jnp.float32))
      err = np.abs(got - want) / (np.abs(want).max() + 1e-30)
      bad_cols = sorted(set(np.nonzero(err.max(axis=(0, 1)) > 1e-2)[0].tolist()))
      rows.append(dict(n_in=n_in, n_out=n_out, group=group, dtype=dtype, how=how,
                       max_rel_err=float(err.max()), bad_columns=len(bad_cols),
                       first_bad=bad_cols[:8]))
      print(rows[-1], flush=True)
# the dequantized weight alone (no dot)
w = jnp.asarray(rng.normal(size=(172, 24)).astype(np.float32))
qw = quantize_weight(w, group=64, layout="int4")
packed = quantize_weight(w, group=64)
d1 = np.asarray(jax.jit(lambda q: q.dequantize())(qw)); d2 = np.asarray(packed.dequantize())
rows.append(dict(check="dequantize only, jit", max_abs=float(np.abs(d1 - d2).max())))
print(rows[-1])
json.dump(dict(device=str(jax.devices()[0]), rows=rows), open(sys.argv[1], "w"), indent=1)
