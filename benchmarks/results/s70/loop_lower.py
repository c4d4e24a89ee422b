"""Session 70: lower every method's decode loop for cuda on the CPU (SmolLM2 heads, 2 layers,
bf16): `methods` below (also run on the GPU by method_sweep_gpu.py). Usage: python loop_lower.py
[SUBSTRING] (only the methods whose repr contains it)."""
import dataclasses, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks.step_roofline import SMOLLM2_135M
from sparsedec.model.params import init_random
from sparsedec.model.gptq import without_draft
from sparsedec.decode.api import start
from sparsedec.decode.loop import decode
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.lookahead import Lookahead
from sparsedec.decode.quantspec import QuantSpec
from sparsedec.compress.streaming import StreamingLLM
from sparsedec.compress.quest import Quest
from sparsedec.compress.snapkv import SnapKV

cfg = dataclasses.replace(SMOLLM2_135M, num_layers=2, vocab_size=1024)
params = init_random(cfg, jax.random.key(0))
prompt = [list(np.random.default_rng(0).integers(3, 1000, 150))]
methods = ["dense"]
methods += [Lookahead(window=w, ngram=n, guesses=g) for w, n, g in ((2, 2, 1), (4, 3, 2), (5, 3, 3), (7, 5, 7), (3, 4, 2), (15, 5, 15))]
for pol in (StreamingLLM(budget_blocks=2), Quest(budget_blocks=2), SnapKV(budget_blocks=2, recent_blocks=1)):
  methods += [Fafo(subsequences=n, length=k, candidates=m, policy=pol) for n, k, m in ((1, 1, 1), (2, 2, 2), (3, 3, 1), (4, 4, 7), (10, 4, 7))]
methods += [QuantSpec(gamma=g, verify_precision=v, quant_group=64, weight_layout=l)
            for g in (1, 2, 5, 8, 11) for v in ("int8", "full") for l in ("packed", "int4_t")]
if __name__ == "__main__":
  only = sys.argv[1] if len(sys.argv) > 1 else ""
  for m in methods:
    name = m if isinstance(m, str) else repr(m)[:150]
    if only not in name:
      continue
    t = time.time()
    try:
      state, run = start(cfg, params, prompt, max_new_tokens=40, method=m, cache_size=512)
      steps = jnp.int32(4)
      text = decode.trace(cfg, without_draft(params), state, steps, method=run.method, ctx=run.ctx).lower(
          lowering_platforms=("cuda",)).as_text()
      r = f"ok ({text.count('custom_call @mosaic_gpu_v2')} mosaic calls)"
    except Exception as e:
      r = "FAIL " + type(e).__name__ + ": " + str(e).splitlines()[0][:200]
    print(f"{time.time() - t:5.1f}s", name, r, flush=True)
