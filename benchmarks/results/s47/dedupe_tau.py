"""Session 47 (CPU, fp32), tried and not kept: FAFO with each fumble subsequence whose k tokens
equal an earlier subsequence's reseeded with random context tokens after every step (late in a
decode 11-20 of the 40 are such duplicates, `chain_duplicates.py`); session 45's setting otherwise (40 guesses, k 4, m 7,
StreamingLLM 4 x 64, seeded pools, 20 prompts). Writes /tmp/dedupe.json.
  PYTHONPATH=. python benchmarks/results/s47/dedupe_tau.py"""
import json, time
import jax.numpy as jnp
from benchmarks.ngram_decoding import prompt_ids
from sparsedec.bench import DEFAULT_SMOLLM2_GGUF
from sparsedec.compress import POLICIES
from sparsedec.decode.api import generate
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.guesses import context_tokens, row_salt
from sparsedec.weights.checkpoint import load_model

class DedupFafo(Fafo):
  def step(self, cfg, params, state, ctx):
    new = super().step(cfg, params, state, ctx)
    x = new.extras
    f = x.fumble                                                   # [B, n, k]
    n, k = f.shape[1:]
    same = jnp.all(f[:, :, None, :] == f[:, None, :, :], axis=-1)  # [B, n, n]
    earlier = jnp.tril(jnp.ones((n, n), bool), -1)                 # j' < j
    dup = jnp.any(same & earlier[None], axis=-1)                   # [B, n]
    fill = context_tokens(row_salt(new, 0x44555045), new.tokens, new.num_tokens, (n, k))
    dup = dup[:, :, None] & ~new.done[:, None, None]
    return new.replace(extras=x.replace(fumble=jnp.where(dup, fill, f),
                                        discarded=jnp.where(dup, fill, x.discarded)))

cfg, params, tok = load_model(DEFAULT_SMOLLM2_GGUF, dtype="float32")
method = DedupFafo(subsequences=40, length=4, candidates=7,
                   policy=POLICIES["streaming"](budget_blocks=4, block_size=64))
rows = []
for set_name in ("mt_bench", "humaneval"):
  for i, ids in enumerate(prompt_ids(tok, set_name, 10)):
    t = time.time()
    res = generate(cfg, params, [ids], method=method, max_new_tokens=256, stop_tokens=())
    rows.append({"set": set_name, "prompt": i, "tau": res.tau, "s": round(time.time() - t, 1)})
    print(json.dumps(rows[-1]), flush=True)
    json.dump(rows, open("/tmp/dedupe.json", "w"))
