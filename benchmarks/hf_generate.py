"""HF transformers greedy `generate` throughput on the same token ids (the baseline).

Run with a Python that has torch + transformers (on the GPU machine: python3; here: the 3.11
reference env). Reads a JSON job {model_dir, gguf_file, prompts: [[ids]], max_new_tokens, dtype,
device}; writes a JSON result with tokens/s and the generated ids.
"""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main(job_path: str, out_path: str) -> None:
  with open(job_path) as f:
    job = json.load(f)
  dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[job["dtype"]]
  kw = {"gguf_file": job["gguf_file"]} if job.get("gguf_file") else {}
  model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype, **kw)
  model = model.to(job["device"]).eval()
  # Ignore EOS by clearing it, not with min_new_tokens: that processor sets the EOS logit to -inf,
  # so HF would stop being plain greedy exactly where the model's argmax is EOS.
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  torch.set_num_threads(max(1, torch.get_num_threads()))
  n = job["max_new_tokens"]
  runs = []
  with torch.inference_mode():
    warm = torch.tensor([job["prompts"][0]], device=job["device"])
    model.generate(warm, max_new_tokens=4, do_sample=False)
    for ids in job["prompts"]:
      x = torch.tensor([ids], device=job["device"])
      if job["device"] != "cpu":
        torch.cuda.synchronize()
      t = time.perf_counter()
      out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                           do_sample=False)
      assert out.shape[1] == len(ids) + n, "HF stopped early"
      if job["device"] != "cpu":
        torch.cuda.synchronize()
      seconds = time.perf_counter() - t
      runs.append({"seconds": seconds, "generated": out[0, len(ids):].tolist()})
  total = sum(len(r["generated"]) for r in runs)
  secs = sum(r["seconds"] for r in runs)
  result = {"backend": "hf-transformers", "torch": torch.__version__,
            "device": job["device"] if job["device"] == "cpu" else torch.cuda.get_device_name(),
            "threads": torch.get_num_threads(), "dtype": job["dtype"],
            "tokens_per_second": total / secs, "generated_tokens": total, "seconds": secs,
            "runs": runs}
  with open(out_path, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
