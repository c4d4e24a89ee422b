"""Session 71 (GPU): draft-model speculative decoding on the real SmolLM2-135M-Instruct (GGUF,
bf16), tokens/s against dense, B 1, MT-Bench turn 1 in the chat template and HumanEval, greedy,
256 tokens (EOS ignored), `sparsedec.bench.run_bench` (warm-up, then timed runs), each row from
empty compilation caches (`fresh_executables`). SmolLM2 has no smaller sibling in ../shared, so
the drafts are its own first L layers (with its embeddings, final norm and head): a weak draft,
the baseline's figure on this model, not the method's best. Also dense_after (dense again last).
Usage: python smol_speculative_gpu.py GGUF OUT.json [NUM_PROMPTS] (env SPEC_ROWS: the rows'
"L:gamma" list, default "8:3 15:3 15:5")"""
import json, os, sys
import jax
sys.path.insert(0, os.getcwd())
from benchmarks._timing import fresh_executables
from sparsedec.bench import run_bench
from sparsedec.decode.speculative import Speculative, with_draft_model
from sparsedec.weights.checkpoint import load_model

gguf, out = sys.argv[1], sys.argv[2]
num = int(sys.argv[3]) if len(sys.argv) > 3 else 5
cfg, params, tok = load_model(gguf, dtype=os.environ.get("SPEC_DTYPE", "bfloat16"))
tokens = int(os.environ.get("SPEC_TOKENS", "256"))
rows = []
specs = [tuple(map(int, r.split(":"))) for r in os.environ.get("SPEC_ROWS", "8:3 15:3 15:5").split()]
for prompts, chat in (("mt_bench", True), ("humaneval", False)):
  configs = [("dense", params, "dense")]
  for layers, gamma in specs:
    draft = cfg.replace(num_layers=layers)
    configs.append((f"speculative L{layers} g{gamma}",
                    with_draft_model(params, {**params, "layers": params["layers"][:layers]}),
                    Speculative(draft=draft, gamma=gamma)))
  configs.append(("dense_after", params, "dense"))
  for name, p, method in configs:
    fresh_executables()
    r = run_bench(cfg, p, tok, prompts=prompts, num_prompts=num, max_new_tokens=tokens,
                  method=method, chat_template=chat, ignore_eos=True)
    row = {"set": prompts, "row": name, "tokens_per_second": r["tokens_per_second"],
           "tau": r["tau"], "acceptance_rate": (sum(x.get("accepted_drafts", 0) for x in r["runs"])
                                                / max(sum(x.get("drafted_tokens", 0) for x in r["runs"]), 1)),
           "warmup_seconds": r["warmup_seconds"]}
    rows.append(row)
    print(row, flush=True)
    json.dump({"device": jax.devices()[0].device_kind, "num_prompts": num, "max_new_tokens": tokens,
               "rows": rows}, open(out, "w"), indent=1)
