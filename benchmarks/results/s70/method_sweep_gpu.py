"""Session 70 (GPU): every method configuration of loop_lower.py run end to end on the GPU
(compiled kernels, not only lowered): SmolLM2's heads, 2 layers, random weights, bf16, a
150-token prompt, 40 greedy tokens. Records whether it ran, its steps, and whether its tokens equal
dense greedy's (bf16: a different step shape may round differently, so a mismatch is reported,
not failed). SWEEP_FROM / SWEEP_LIMIT pick a slice of the configurations; the JSON is written
after each row (both added after the session-70 run, whose log is `method_sweep_s70_h200.log`).
Usage: python method_sweep_gpu.py OUT.json"""
import json, os, sys, time, traceback
import jax, numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loop_lower as ll  # noqa: E402  (cfg, params, prompt, methods)
out = sys.argv[1]
from sparsedec.decode.api import generate
def tokens(method):
  res = generate(ll.cfg, ll.params, ll.prompt, method=method, max_new_tokens=40, stop_tokens=(),
                 cache_size=512)
  return [list(map(int, r)) for r in res.tokens], int(np.sum(res.active_steps))


rows, dense = [], tokens("dense")[0]       # the reference, whatever slice runs
first, last = int(os.environ.get("SWEEP_FROM", "0")), int(os.environ.get("SWEEP_LIMIT", "1000"))
for m in ll.methods[first:last]:
  name = m if isinstance(m, str) else repr(m)[:160]
  t = time.time()
  try:
    ids, steps = tokens(m)
    rows.append(dict(method=name, ok=True, identical_to_dense=ids == dense, steps=steps,
                     seconds=time.time() - t))
  except Exception as e:  # noqa: BLE001
    rows.append(dict(method=name, ok=False, error="".join(traceback.format_exception_only(e))[-600:]))
  print(rows[-1], flush=True)
  json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, open(out, "w"), indent=1)
