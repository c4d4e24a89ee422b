"""Session 71 (GPU): the real SmolLM2-135M-Instruct (GGUF, bf16) through the method shapes whose
decode loops did not lower for cuda before session 70's fix (the in-flight tile at 9..15 / 17..21
query rows): Lookahead W 4 N 3 G 2 (13 tokens a step) and W 3 N 4 G 2 (15), QuantSpec gamma 8 / 11
with verify_precision="full" (9 / 12 tokens through decode_attention), with FAFO (default knobs)
and QuantSpec gamma 4 as controls. Greedy, 4 prompts in one batch (2 MT-Bench chats, 2 HumanEval),
160 new tokens, attention "auto" (the Mosaic GPU kernels). Per method: tokens equal to dense
greedy's, and where not, each row's first divergence with dense's top-2 logit margin there (bf16:
a near-tie may flip between step shapes), the Mosaic GPU custom calls in its lowered loop, and any
warning (e.g. a fallback to the jnp reference). JSON written after each row.
Usage: python smol_tile_gpu.py GGUF OUT.json (SMOL_TOKENS / SMOL_LIMIT: fewer tokens / methods)"""
import json, os, sys, time, traceback, warnings
import jax, jax.numpy as jnp, numpy as np
from sparsedec import prompts as prompt_sets
from sparsedec.decode.api import generate, start
from sparsedec.decode.loop import decode
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.lookahead import Lookahead
from sparsedec.decode.quantspec import QuantSpec
from sparsedec.model.gptq import without_draft
from sparsedec.testing import find_divergences
from sparsedec.weights.checkpoint import load_model

gguf, out = sys.argv[1], sys.argv[2]
cfg, params, tok = load_model(gguf, dtype="bfloat16")
chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                            add_generation_prompt=True), add_bos=False)
         for p in prompt_sets.mt_bench()[:2]]
prompts = chats + [tok.encode(p) for p in prompt_sets.humaneval()[:2]]
KW = dict(max_new_tokens=int(os.environ.get("SMOL_TOKENS", "160")), stop_tokens=(), cache_size=1024)
methods = ["dense", Lookahead(window=4, ngram=3, guesses=2), Lookahead(window=3, ngram=4, guesses=2),
           QuantSpec(gamma=8, verify_precision="full"), QuantSpec(gamma=11, verify_precision="full"),
           QuantSpec(gamma=4, verify_precision="full"), Fafo()]


def mosaic_calls(method) -> int:
  state, run = start(cfg, params, prompts, method=method, **KW)
  text = decode.trace(cfg, without_draft(params), state, jnp.int32(4), method=run.method,
                      ctx=run.ctx).lower().as_text()
  return text.count("mosaic_gpu")


rows, dense = [], None
for m in methods[: int(os.environ.get("SMOL_LIMIT", "99"))]:
  name = m if isinstance(m, str) else repr(m)[:200]
  t = time.time()
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      res = generate(cfg, params, prompts, method=m, **KW)
    ids = [list(map(int, r)) for r in res.tokens]
    if dense is None:
      dense = ids
    divs = find_divergences(ids, dense, cfg, params, prompts)
    rows.append(dict(method=name, ok=True, identical_to_dense=ids == dense, tau=float(res.tau),
                     divergences=[dict(row=d.row, pos=d.position, got=d.actual, dense=d.expected,
                                       top2_margin=d.top2_margin) for d in divs],
                     mosaic_calls_in_loop=mosaic_calls(m),
                     warnings=sorted({str(w.message)[:200] for w in caught}),
                     seconds=round(time.time() - t, 1)))
  except Exception as e:  # noqa: BLE001
    rows.append(dict(method=name, ok=False, error="".join(traceback.format_exception_only(e))[-800:]))
  print(rows[-1], flush=True)
  json.dump({"device": jax.devices()[0].device_kind, "prompt_lengths": list(map(len, prompts)),
             "rows": rows}, open(out, "w"), indent=1)
