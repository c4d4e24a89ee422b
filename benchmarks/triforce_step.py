"""TriForce's step by its parts against one dense step, at Llama-3.1-8B shapes (GPU), and the
speedup they project.

Random bf16 weights and a random KV cache of `context` entries are generated on the device (as in
step_roofline.py), with a Llama-68M-shaped draft (TriForce's draft: 2 layers of 768, 12 heads;
Llama-3.1-8B's vocabulary). Timed, each `--steps` times inside one jitted fori_loop:
* dense: one dense step (`Dense.step`);
* round: one middle round (`TriForce._round`): the draft model drafts `--draft-gamma` tokens
  through its StreamingLLM view (`--draft-budget` entries), the 8B model verifies them in one
  forward reading the chunk-retrieval view (`--budget` entries);
* verify: the 8B model's forward over gamma + 1 tokens reading the full cache, the verification
  and the commit: a `Speculative` step whose draft is a one-layer, 64-wide model of the same
  vocabulary (its gamma forwards cost ~nothing beside the 8B model: `TriForce.step` less its
  rounds).
One round is timed per `--draft-gammas` value (the projection is made for each).

Random weights accept nothing, so the speedup is projected, and labelled so: for per-token
acceptance alpha1 (draft model -> middle level) and alpha2 (middle level -> full target), the
expected middle rounds a step R (simulated: rounds of draft_gamma drafts, each round emitting
its accepted prefix plus one token, until gamma tokens) and tokens a step
(1 - alpha2^(gamma + 1)) / (1 - alpha2) give speedup = tokens * t_dense / (R * t_round + t_verify).

  python benchmarks/triforce_step.py --contexts 32768 131072 --out $OUT/triforce_step.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import fresh_executables
from benchmarks.method_step import method_step_time
from benchmarks.step_roofline import LLAMA_31_8B, log, random_params, random_state, read_bandwidth
from sparsedec.bench import device_description
from sparsedec.compress import ChunkRetrieval, StreamingLLM
from sparsedec.decode.dense import Dense
from sparsedec.decode.loop import StepContext
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.decode.speculative import Speculative, with_draft_model
from sparsedec.decode.triforce import TriForce, _Middle

# Llama-68M's shapes (JackFram/llama-68m, TriForce's draft) with Llama-3.1-8B's vocabulary.
LLAMA_68M = LLAMA_31_8B.replace(hidden_size=768, intermediate_size=3072, num_layers=2,
                                num_heads=12, num_kv_heads=12, head_dim=64)
# A draft that costs ~nothing, for timing the verification side of a step.
NEGLIGIBLE = LLAMA_31_8B.replace(hidden_size=64, intermediate_size=64, num_layers=1, num_heads=1,
                                 num_kv_heads=1, head_dim=64)
ALPHA1 = (0.5, 0.7, 0.9)
ALPHA2 = (0.8, 0.9, 0.95)


def expected_rounds(alpha1: float, gamma: int, draft_gamma: int, trials: int = 20000) -> float:
  """Mean middle rounds until gamma tokens, each round emitting its accepted prefix of
  draft_gamma iid drafts (acceptance alpha1 each) plus one token (simulated)."""
  rng = np.random.default_rng(0)
  rounds = np.zeros(trials)
  count = np.zeros(trials)
  while (count < gamma).any():
    going = count < gamma
    ok = rng.random((trials, draft_gamma)) < alpha1
    count += going * (np.cumprod(ok, axis=1).sum(axis=1) + 1)
    rounds += going
  return float(rounds.mean())


def projected(t_dense: float, t_round: float, t_verify: float, gamma: int,
              draft_gamma: int) -> dict:
  out = {}
  for a1 in ALPHA1:
    r = expected_rounds(a1, gamma, draft_gamma)
    for a2 in ALPHA2:
      tokens = (1 - a2 ** (gamma + 1)) / (1 - a2)
      out[f"alpha1={a1},alpha2={a2}"] = {
          "rounds": r, "tokens_per_step": tokens,
          "speedup": tokens * t_dense / (r * t_round + t_verify)}
  return out


def round_time(cfg, params, state, method: TriForce, steps: int) -> float:
  """Seconds per middle round (`steps` rounds in one jitted loop, every row short of tokens)."""
  state = jax.jit(lambda p, s: method.init(cfg, p, s))(params, state)
  x = state.extras
  b = state.batch_size
  zeros = jnp.zeros((b,), jnp.int32)
  width = method.gamma + method.draft_gamma + 1
  sampling = SamplingConfig()
  active = jnp.ones((b,), bool)

  @functools.partial(jax.jit, donate_argnums=1)
  def loop(params, m):
    def body(i, m):
      m = m.replace(count=zeros, round=jnp.zeros((), jnp.int32))
      return method._round(cfg, params, x, state.cache.lengths, active, state.keys, sampling,
                           m)
    return jax.lax.fori_loop(0, steps, body, m)

  fresh = lambda: jnp.zeros((b,), jnp.int32)   # noqa: E731 - distinct buffers (donated)
  start = _Middle(round=jnp.zeros((), jnp.int32), seq=state.tokens,
                  emitted=jnp.zeros((b, width), jnp.int32), count=fresh(), p2=None,
                  cache=state.cache, draft_cache=x.draft_cache, small_drafted=fresh(),
                  small_accepted=fresh(), rounds=fresh())
  compiled = loop.lower(params, start).compile()
  times = []
  m = start
  for _ in range(4):
    t = time.perf_counter()
    m = compiled(params, m)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t)
  return float(np.median(times[1:])) / steps


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--gamma", type=int, default=6)
  ap.add_argument("--draft-gammas", type=int, nargs="+", default=[2])
  ap.add_argument("--budget", type=int, default=4096, help="retrieval view entries (TriForce: 4K)")
  ap.add_argument("--draft-budget", type=int, default=512, help="draft's StreamingLLM entries")
  ap.add_argument("--block-size", type=int, default=64)
  ap.add_argument("--layers", type=int, default=None, help="fewer layers (CPU smoke test)")
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                "triforce_step.json"))
  args = ap.parse_args()
  cfg = LLAMA_31_8B if args.layers is None else LLAMA_31_8B.replace(num_layers=args.layers)
  on_gpu = jax.devices()[0].platform == "gpu"
  bw = read_bandwidth(4.0 if on_gpu else 0.25)
  target = random_params(cfg, jax.random.key(1))
  params = with_draft_model(target, random_params(LLAMA_68M, jax.random.key(2)))
  verify_params = with_draft_model(target, random_params(NEGLIGIBLE, jax.random.key(3)))
  jax.block_until_ready((params, verify_params))
  bs = args.block_size
  triforce = {g: TriForce(draft=LLAMA_68M, gamma=args.gamma, draft_gamma=g,
                          retrieval=ChunkRetrieval(budget_blocks=args.budget // bs, block_size=bs),
                          draft_view=StreamingLLM(budget_blocks=args.draft_budget // bs,
                                                  block_size=bs))
              for g in args.draft_gammas}
  verifier = Speculative(draft=NEGLIGIBLE, gamma=args.gamma)
  rows = []
  result = {"benchmark": "TriForce step parts / dense step, Llama-3.1-8B shapes (68M-shaped "
                         "draft), bf16, B=1; speedup projected",
            "device": device_description(), "read_bandwidth_bytes_per_s": bw,
            "args": vars(args), "rows": rows}
  for context in args.contexts:
    row = {"context": context}
    rows.append(row)
    room = args.steps * (args.gamma + max(args.draft_gammas) + 2) * 2
    for part in ("dense", *(f"round_g{g}" for g in args.draft_gammas), "verify"):
      state = random_state(cfg, context, room, jax.random.key(context))
      fresh_executables()
      try:
        if part == "dense":
          t = method_step_time(cfg, params, state, Dense(), args.steps)["step_seconds"]
        elif part.startswith("round"):
          t = round_time(cfg, params, state, triforce[int(part[7:])], args.steps)
        else:
          t = method_step_time(cfg, verify_params, state, verifier, args.steps)["step_seconds"]
      except Exception as e:  # noqa: BLE001 - record and go on
        row[f"{part}_error"] = repr(e)[:2000]
        log(f"{part} at {context}: {e!r}"[:500])
        continue
      row[f"{part}_seconds"] = t
      log(f"context {context} {part}: {t * 1e3:.3f} ms")
      del state
    for g in args.draft_gammas:
      if {"dense_seconds", f"round_g{g}_seconds", "verify_seconds"} <= set(row):
        row[f"round_g{g}_over_dense"] = row[f"round_g{g}_seconds"] / row["dense_seconds"]
        row["verify_over_dense"] = row["verify_seconds"] / row["dense_seconds"]
        row[f"projected_g{g}"] = projected(row["dense_seconds"], row[f"round_g{g}_seconds"],
                                           row["verify_seconds"], args.gamma, g)
        log(f"context {context}: round (draft_gamma {g}) {row[f'round_g{g}_over_dense']:.3f}x "
            f"dense, verify {row['verify_over_dense']:.3f}x dense")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  log(f"wrote {args.out}")


if __name__ == "__main__":
  main()
