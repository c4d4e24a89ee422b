"""What session 47's CPU tau runs share: SmolLM2-135M-Instruct in fp32, session 45's FAFO
setting (40 subsequences, k 4, m 7, StreamingLLM 4 x 64, seeded pools), the first `num` prompts
of MT-Bench turn 1 and HumanEval at batch 1, 256 tokens, EOS ignored."""
import json
import time

from benchmarks.ngram_decoding import prompt_ids
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF
from sparsedec.compress import POLICIES
from sparsedec.decode import fafo as fafo_mod
from sparsedec.decode.api import generate
from sparsedec.decode.fafo import Fafo
from sparsedec.weights.checkpoint import load_model

# Offset from the current token's position p of token i of fumble subsequence j.
OFFSETS = {"aligned": lambda j, i: 1 + i, "diagonal": lambda j, i: 1 + j + i,   # fafo_layout's
           "half": lambda j, i: 1 + j // 2 + i, "double": lambda j, i: 1 + 2 * j + i}


def patch_fumble_offsets(mode: str) -> None:
  """Every later FAFO step puts its fumble tokens at OFFSETS[mode] (the mask unchanged)."""
  layout = fafo_mod.fafo_layout

  def patched(n, k, m):
    mask, off = layout(n, k, m)
    off = off.copy()
    for i in range(k):
      for j in range(n):
        off[i * n + j] = OFFSETS[mode](j, i)
    return mask, off
  fafo_mod.fafo_layout = patched


def model():
  return load_model(DEFAULT_SMOLLM2_GGUF, dtype="float32")          # cfg, params, tokenizer


def fafo(cls=Fafo) -> Fafo:
  return cls(subsequences=40, length=4, candidates=7,
             policy=POLICIES["streaming"](budget_blocks=4, block_size=64))


def prompts(tok, num: int = 10):
  """(set name, index, token ids) of the first `num` prompts of each set."""
  return [(name, i, ids) for name in ("mt_bench", "humaneval")
          for i, ids in enumerate(prompt_ids(tok, name, num))]


def per_prompt_taus(method, out_path: str, num: int = 10) -> list[dict]:
  """tau of `method` on each prompt, printed and written to out_path as it goes."""
  cfg, params, tok = model()
  rows = []
  for set_name, i, ids in prompts(tok, num):
    t = time.time()
    res = generate(cfg, params, [ids], method=method, max_new_tokens=256, stop_tokens=())
    rows.append({"set": set_name, "prompt": i, "tau": res.tau, "s": round(time.time() - t, 1)})
    print(json.dumps(rows[-1]), flush=True)
    with open(out_path, "w") as f:
      json.dump(rows, f)
  return rows
