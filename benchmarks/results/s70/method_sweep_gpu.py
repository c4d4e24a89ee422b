"""Session 70 (GPU): every method configuration of loop_lower.py run end to end on the GPU
(compiled kernels, not only lowered): SmolLM2's heads, 2 layers, random weights, bf16, a
150-token prompt, 40 greedy tokens. Records whether it ran, its tau, and whether its tokens equal
dense greedy's (bf16: a different step shape may round differently, so a mismatch is reported,
not failed). Usage: python method_sweep_gpu.py OUT.json"""
import json, os, sys, time, traceback
import jax, numpy as np
sys.argv, out = sys.argv[:1] + ["__none__"], sys.argv[1]
sys.path.insert(0, ".")
import importlib.util
spec = importlib.util.spec_from_file_location("ll", "benchmarks/results/s70/loop_lower.py")
ll = importlib.util.module_from_spec(spec); spec.loader.exec_module(ll)   # builds cfg, params, methods
from sparsedec.decode.api import generate
rows, dense = [], None
for m in ll.methods[:int(os.environ.get("SWEEP_LIMIT", "1000"))]:
  name = m if isinstance(m, str) else repr(m)[:160]
  t = time.time()
  try:
    res = generate(ll.cfg, ll.params, ll.prompt, method=m, max_new_tokens=40, stop_tokens=(), cache_size=512)
    ids = [list(map(int, r)) for r in res.tokens]
    if dense is None:
      dense = ids
    steps = int(np.sum(res.active_steps)) if hasattr(res, "active_steps") else None
    rows.append(dict(method=name, ok=True, identical_to_dense=ids == dense, steps=steps,
                     seconds=time.time() - t))
  except Exception as e:  # noqa: BLE001
    rows.append(dict(method=name, ok=False, error="".join(traceback.format_exception_only(e))[-600:]))
  print(rows[-1], flush=True)
json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, open(out, "w"), indent=1)
