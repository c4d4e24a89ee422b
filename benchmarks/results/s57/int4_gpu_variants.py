"""Session 57: the "int4" weight layout's jitted product at narrow output widths on a GPU (wrong,
nondeterministically, at 16-48 columns in session 56). Sweeps widths twice per variant:
  plain       jit(linear) on the layout as stored;
  padded64    the codes / scales / zeros padded to a multiple of 64 output columns, the product
              sliced back (the candidate fix);
Run once per XLA_FLAGS setting by the caller (e.g. --xla_gpu_enable_triton_gemm=false). Also
writes the optimized HLO of the first failing (or the 24-column) case. JSON to argv[1]."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from sparsedec.model.linear import linear
from sparsedec.model.quant_weights import quantize_weight

def padded64(x, w):
  n_out = w.scale.shape[1]
  pad = -n_out % 64
  if not pad:
    return linear(x, w)
  wp = w.replace(codes=jnp.pad(w.codes, ((0, 0), (0, pad))),
                 scale=jnp.pad(w.scale, ((0, 0), (0, pad))),
                 zero=jnp.pad(w.zero, ((0, 0), (0, pad))))
  return linear(x, wp)[..., :n_out]

rows, hlo_done = [], False
rng = np.random.default_rng(0)
for rep in range(2):
  for n_in in (172, 256):
    for n_out in (8, 16, 24, 32, 40, 48, 56, 64, 96):
      w = jnp.asarray(rng.normal(size=(n_in, n_out)).astype(np.float32))
      packed = quantize_weight(w, group=64)
      qw = quantize_weight(w, group=64, layout="int4")
      for dtype in ("float32", "bfloat16"):
        x = jnp.asarray(rng.normal(size=(2, 3, n_in)).astype(np.float32)).astype(dtype)
        want = np.asarray(linear(x, packed).astype(jnp.float32))
        for how, fn in (("plain", jax.jit(linear)), ("padded64", jax.jit(padded64))):
          try:
            got = np.asarray(fn(x, qw).astype(jnp.float32))
            err = float((np.abs(got - want) / (np.abs(want).max() + 1e-30)).max())
          except Exception as e:  # noqa: BLE001
            err = float("nan"); print("error", how, n_in, n_out, dtype, repr(e)[:300])
          ok = err < 1e-2
          rows.append(dict(rep=rep, n_in=n_in, n_out=n_out, dtype=dtype, how=how,
                           max_rel_err=err, ok=ok))
          if how == "plain" and not hlo_done and (not ok or (n_out == 24 and rep == 1)):
            hlo_done = True
            txt = fn.lower(x, qw).compile().as_text()
            open(sys.argv[1].replace(".json", "_hlo.txt"), "w").write(txt)
bad = [r for r in rows if not r["ok"]]
for how in ("plain", "padded64"):
  n = [r for r in rows if r["how"] == how]
  print(how, "bad", sum(not r["ok"] for r in n), "of", len(n),
        sorted({(r["n_out"], r["dtype"], r["rep"]) for r in n if not r["ok"]}))
json.dump(dict(device=str(jax.devices()[0]), xla_flags=os.environ.get("XLA_FLAGS", ""),
               rows=rows), open(sys.argv[1], "w"), indent=1)
