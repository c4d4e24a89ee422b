"""Dense greedy tokens/s of sparsedec against HF transformers on SmolLM2-135M-Instruct.

Same token ids for both (MT-Bench turn 1 through the model's chat template), EOS ignored so every
prompt generates exactly --max-new-tokens tokens. Ours runs in this process (JAX); HF runs in a
subprocess with --hf-python. The greedy outputs are compared too (fp32: they must agree).

  CPU:  .venv/bin/python benchmarks/dense_vs_hf.py --dtype float32
  GPU:  python3 benchmarks/dense_vs_hf.py --dtype bfloat16 --hf-python python3 --hf-device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from sparsedec.bench import DEFAULT_SMOLLM2_GGUF, encode_prompts, run_bench
from sparsedec.prompts import mt_bench
from sparsedec.weights.checkpoint import load_model



def default_hf_python() -> str:
  here = os.path.join(os.path.dirname(__file__), "..", ".hfenv", "bin", "python")
  return os.environ.get("SPARSEDEC_HF_PYTHON",
                        here if os.path.exists(here) else "/work/.hfenv/bin/python")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--gguf", default=DEFAULT_SMOLLM2_GGUF)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--num-prompts", type=int, default=10)
  ap.add_argument("--max-new-tokens", type=int, default=256)
  ap.add_argument("--hf-python", default=default_hf_python())
  ap.add_argument("--hf-device", default="cpu")
  ap.add_argument("--skip-hf", action="store_true")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()

  cfg, params, tok = load_model(args.gguf, dtype=args.dtype)
  texts = mt_bench(turn=1)[: args.num_prompts]
  ids = encode_prompts(tok, texts, chat_template=True)
  ours = run_bench(cfg, params, tok, prompts="mt_bench", num_prompts=args.num_prompts,
                   max_new_tokens=args.max_new_tokens, chat_template=True, ignore_eos=True,
                   model_name=os.path.basename(args.gguf))
  print(f"sparsedec dense: {ours['tokens_per_second']:.1f} tokens/s", flush=True)
  result = {"benchmark": "dense greedy, SmolLM2-135M-Instruct, MT-Bench turn 1",
            "max_new_tokens": args.max_new_tokens, "num_prompts": len(ids),
            "dtype": args.dtype, "sparsedec": {k: v for k, v in ours.items() if k != "runs"}}
  if not args.skip_hf:
    with tempfile.TemporaryDirectory() as tmp:
      job = {"model_dir": os.path.dirname(os.path.abspath(args.gguf)),
             "gguf_file": os.path.basename(args.gguf), "prompts": ids,
             "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
             "device": args.hf_device}
      with open(os.path.join(tmp, "job.json"), "w") as f:
        json.dump(job, f)
      script = os.path.join(os.path.dirname(__file__), "hf_generate.py")
      subprocess.run([args.hf_python, script, os.path.join(tmp, "job.json"),
                      os.path.join(tmp, "hf.json")], check=True)
      with open(os.path.join(tmp, "hf.json")) as f:
        hf = json.load(f)
    print(f"HF transformers:  {hf['tokens_per_second']:.1f} tokens/s", flush=True)
    result["hf"] = {k: v for k, v in hf.items() if k != "runs"}
    result["speedup_vs_hf"] = ours["tokens_per_second"] / hf["tokens_per_second"]
    from sparsedec.decode.api import generate
    ours_tokens = generate(cfg, params, ids, max_new_tokens=args.max_new_tokens,
                           stop_tokens=()).tokens
    from sparsedec.testing import find_divergences
    hf_tokens = [r["generated"] for r in hf["runs"]]
    divs = find_divergences(ours_tokens, hf_tokens, cfg, params, ids)
    result["greedy_identical_rows"] = len(ids) - len(divs)
    # where outputs differ: position, tokens, and our model's logit margin between the two
    # tokens there (a near-tie that a last-bit difference in the arithmetic can flip).
    result["divergences"] = [vars(d) for d in divs]
    print(f"greedy outputs identical in {len(ids) - len(divs)}/{len(ids)} prompts", flush=True)
    for d in divs:
      print("  " + d.describe(), flush=True)
  out = args.out or os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                 f"dense_vs_hf_{ours['device']['platform']}_{args.dtype}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {out}")


if __name__ == "__main__":
  sys.exit(main())
