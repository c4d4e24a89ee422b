"""QuantSpec on SmolLM2-135M-Instruct: what the INT8 target costs in quality, and how often the
4-bit draft is accepted (CPU or GPU; on a GPU in bf16 the attention and the draft's linears run
the Pallas kernels).

1. Perplexity of the book text (../shared/prompts/books) with the KV cache read at full precision
   versus INT8 (and, for reference, the draft's 4-bit view), teacher-forced in chunks of
   `--chunk` tokens: each chunk reads the hierarchical cache built from everything before it
   exactly as a one-token-per-step QuantSpec verifier would (`QuantView`'s per-query rule), then is
   committed to it. Target (issue): INT8 perplexity within +0.5% of full precision.
2. Draft acceptance rate versus gamma, greedy, continuing long book prompts (`--book-prompts`
   windows of `--prompt-tokens`, each decoded alone) and MT-Bench turn-1 prompts (as one batch,
   or alone with `--mt-bench-one-at-a-time`); accepted and drafted tokens pooled over the
   prompts (each run's counts beside them, with the share of its tokens inside a repeated
   8-gram: a looping continuation repeats its few disagreements every cycle). At batch 1 a GPU
   draft's linears take one row: the dp4a kernel, or with `--one-row-gemv wgmma` the W4A16 one
   (`--emulate-one-row-gemv`: either kernel's arithmetic, or one of the dp4a kernel's two
   departures from the W4A16 one, on any backend). Target (issue): >= 90% at the best gamma.
   The draft's weights are `--weight-bits` 4 (group-wise, `--weight-group` input rows per group;
   the defaults, 4 and 128, are QuantSpec's) or "none" (a KV-only draft: 4-bit KV view, full
   weights), for ablations; rounded to nearest, or with `--weight-quantizer gptq` chosen by GPTQ
   (`sparsedec.model.gptq`) on `--calibration-tokens` tokens of the book from
   `--calibration-offset` (after the prompt).

  .venv/bin/python benchmarks/quantspec_quality.py --out benchmarks/results/quantspec_quality_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._args import count
from benchmarks._gemv_choice import (EMULATIONS, add_one_row_gemv_arg, apply_one_row_gemv,
                                     draft_matmul)
from sparsedec.attention import AttentionPlan, QuantView, Segment, causal_plan
from sparsedec.bench import (DEFAULT_SMOLLM2_GGUF, device_description, encode_prompts, log,
                             mean_repeated_ngram_share)
from sparsedec.decode.api import generate
from sparsedec.decode.quantspec import QuantSpec
from sparsedec.kv import quantized as qkv
from sparsedec.kv.dense import KVCache, init_cache
from sparsedec.model.forward import forward
from sparsedec.model.gptq import gptq_quantize_params, self_generated_calibration, with_draft
from sparsedec.prompts import book, mt_bench
from sparsedec.weights.checkpoint import load_model



BOOK_STRIDE = 8192          # tokens between the starts of the book windows (--book-prompts)


def pooled_stats(runs) -> dict:
  """QuantSpec's figures over several generate() results: acceptance and tau pooled (sums of
  accepted drafts / drafted tokens, of generated tokens / steps), the memory figures of the
  first run (the windows share their shapes), and each run's own counts with the share of its
  generated tokens inside a repeated 8-gram. In a looping continuation one draft disagreement
  recurs every cycle, so the drafts are not independent: compare acceptances across runs, not
  as independent draws (benchmarks/NOTES.md, session 45)."""
  drafted = sum(r.method_stats["drafted_tokens"] for r in runs)
  accepted = sum(r.method_stats["accepted_drafts"] for r in runs)
  steps = sum(sum(r.active_steps) for r in runs)
  made = sum(r.num_generated - len(r.tokens) for r in runs)
  per_run = [{"drafted_tokens": r.method_stats["drafted_tokens"],
              "accepted_drafts": r.method_stats["accepted_drafts"],
              "repeated_8gram_share": mean_repeated_ngram_share(r.tokens)}
             for r in runs]
  return {**runs[0].method_stats, "runs": len(runs), "drafted_tokens": drafted,
          "accepted_drafts": accepted, "tau": made / steps if steps else 0.0,
          "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
          "accepted_drafts_per_step": round(accepted / steps, 4) if steps else 0.0,
          "per_run": per_run}


def _nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """logits [1, T, V], targets [1, T] -> summed negative log-likelihood (fp32)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1).sum()


def perplexity_full(cfg, params, ids: np.ndarray, chunk: int) -> float:
  n = len(ids) - 1
  cache = init_cache(cfg, 1, -(-n // chunk) * chunk)
  step = jax.jit(functools.partial(forward, cfg), donate_argnums=())
  total = 0.0
  from sparsedec.kv.dense import commit
  for start in range(0, n, chunk):
    stop = min(start + chunk, n)
    toks = jnp.asarray(ids[None, start:stop])
    pos = jnp.arange(start, stop)[None]
    logits, kv = step(params, toks, pos, cache, causal_plan(stop - start))
    total += float(_nll(logits, jnp.asarray(ids[None, start + 1:stop + 1])))
    cache = commit(cache, kv, jnp.asarray([stop - start], jnp.int32))
  return float(np.exp(total / n))


@functools.lru_cache(maxsize=None)
def _quantized_step(cfg, bits: int):
  """One jitted chunk of `quantized_pass` per (model, bits), shared by every call (params are an
  argument: drafts with the same structure reuse the compile)."""

  @jax.jit
  def step(params, toks, pos, qcache):
    t = toks.shape[1]
    plan = causal_plan(t)
    plan = AttentionPlan(plan.inflight_mask, (Segment(QuantView(qcache, bits=bits), 0, t),))
    empty = init_cache(cfg, 1, 0)                                   # lengths only
    dense = KVCache(k=empty.k, v=empty.v, lengths=qcache.lengths)
    logits, kv = forward(cfg, params, toks, pos, dense, plan)
    return logits, qkv.commit(qcache, kv, jnp.full((1,), t, jnp.int32))
  return step


def quantized_pass(cfg, params, ids: np.ndarray, chunk: int, group: int,
                   bits: int) -> tuple[float, np.ndarray]:
  """ids [n + 1] teacher-forced through the model reading the hierarchical cache's `bits`-bit view
  (chunks of `chunk` tokens; see the module docstring) -> (summed NLL of ids[1:], argmax token
  after each of ids[:n], [n])."""
  n = len(ids) - 1
  cap = -(-n // group) * group + 2 * group
  qcache = qkv.from_dense(init_cache(cfg, 1, group), group, quant_capacity=cap)
  # Committed to the device, as every later chunk's cache (step's output) is: jit keys its cache
  # on committedness, so an uncommitted first cache would compile every chunk shape twice.
  qcache = jax.device_put(qcache, jax.devices()[0])
  step = _quantized_step(cfg, bits)
  total, top = 0.0, []
  for start in range(0, n, chunk):
    stop = min(start + chunk, n)
    logits, qcache = step(params, jnp.asarray(ids[None, start:stop]),
                          jnp.arange(start, stop)[None], qcache)
    total += float(_nll(logits, jnp.asarray(ids[None, start + 1:stop + 1])))
    top.append(np.asarray(jnp.argmax(logits[0], axis=-1)))
  return total, np.concatenate(top)


def perplexity_quantized(cfg, params, ids: np.ndarray, chunk: int, group: int,
                         bits: int) -> float:
  return float(np.exp(quantized_pass(cfg, params, ids, chunk, group, bits)[0] / (len(ids) - 1)))


def calibration_questions(first: int, stop: int, turns: list[int]) -> list[str]:
  """MT-Bench questions [first, stop) of each turn in `turns` (turn 1's, then turn 2's, ...). A
  turn-2 question is asked on its own (a new conversation), so it is one more chat prompt of the
  same kind; questions below `first` stay out in every turn (they are the evaluated ones)."""
  check_calibration_turns(turns)
  return [q for t in turns for q in mt_bench(turn=t)[first:stop]]


def self_chat_calibration(cfg, params, tok, questions: list[str], new_tokens: int,
                          max_tokens: int, chat_template: bool = True) -> list[np.ndarray]:
  """The model's own greedy answers to chat prompts, each after its prompt (one sequence per
  conversation, at most max_tokens in all): text drawn from the distribution the draft has to
  predict."""
  return self_generated_calibration(cfg, params,
                                    encode_prompts(tok, questions, chat_template=chat_template),
                                    max_new_tokens=new_tokens, max_tokens=max_tokens)


def check_calibration_turns(turns: list[int]) -> None:
  if not turns or any(t not in (1, 2) for t in turns) or len(set(turns)) != len(turns):
    raise SystemExit(f"--calibration-turns must be distinct turns among 1 and 2, got {turns}")


def check_chat_calibration(prompts: tuple[int, int], evaluated: int, turns: list[int]) -> None:
  """--calibration-prompts FIRST STOP (MT-Bench prompts whose answers calibrate GPTQ) must not
  overlap the `evaluated` first prompts and must be non-empty; --calibration-turns as above."""
  first, stop = prompts
  if first < evaluated:
    raise SystemExit("--calibration-prompts overlap the evaluated MT-Bench prompts")
  if stop <= first:
    raise SystemExit(f"--calibration-prompts FIRST STOP must have FIRST < STOP, got {first} "
                     f"{stop}")
  check_calibration_turns(turns)


def _check_calibration(ap: argparse.ArgumentParser, args) -> None:
  """The GPTQ calibration flags, checked before the model loads (they were checked after the
  perplexity pass, and --weight-quantizer gptq with --weight-bits none ran the KV-only draft
  under the label gptq)."""
  if args.weight_quantizer != "gptq":
    return
  if args.weight_bits == "none":
    ap.error("--weight-quantizer gptq chooses the draft's 4-bit weights; --weight-bits none "
             "keeps them at full precision")
  if args.calibration_source in ("book", "mixed"):
    end = (args.book_prompts - 1) * BOOK_STRIDE + args.prompt_tokens + args.new_tokens
    if args.calibration_offset < end:
      raise SystemExit("--calibration-offset overlaps the book prompts and their continuations")
  if args.calibration_source in ("self-chat", "mixed"):
    check_chat_calibration(args.calibration_prompts, args.mt_bench_prompts,
                           args.calibration_turns)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--gguf", default=DEFAULT_SMOLLM2_GGUF)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--ppl-tokens", type=count, default=2048)
  ap.add_argument("--chunk", type=count, default=64)
  ap.add_argument("--group", type=count, default=128)
  ap.add_argument("--gammas", type=count, nargs="+", default=[1, 2, 4, 6, 8])
  ap.add_argument("--prompt-tokens", type=count, default=4096)
  ap.add_argument("--new-tokens", type=count, default=96)
  ap.add_argument("--mt-bench-prompts", type=count, default=4)
  ap.add_argument("--mt-bench-one-at-a-time", action="store_true",
                  help="decode the MT-Bench prompts one at a time (batch 1) instead of as a batch")
  ap.add_argument("--book-prompts", type=count, default=1,
                  help=f"book windows of --prompt-tokens, {BOOK_STRIDE} tokens apart, each "
                       "decoded on its own (batch 1); acceptance pooled over them")
  ap.add_argument("--sets", nargs="+", default=["book", "mt_bench"], choices=("book", "mt_bench"),
                  help="the prompt sets of the acceptance sweep")
  ap.add_argument("--weight-bits", default="4", choices=("4", "none"),
                  help='draft weight bits: "4" (group-wise) or "none" (full-precision weights)')
  ap.add_argument("--weight-group", type=count, default=128,
                  help="input rows per 4-bit draft weight group")
  ap.add_argument("--weight-quantizer", default="rtn", choices=("rtn", "gptq"),
                  help="the draft's 4-bit weights: round-to-nearest, or GPTQ calibrated on "
                       "--calibration-tokens tokens of the book from --calibration-offset")
  ap.add_argument("--calibration-tokens", type=count, default=4096)
  ap.add_argument("--calibration-source", default="book", choices=("book", "self-chat", "mixed"),
                  help="GPTQ's calibration text: --calibration-tokens of the book from "
                       "--calibration-offset; or as many tokens of the model's own greedy answers "
                       "(with their chat prompts) to MT-Bench turn-1 prompts --calibration-prompts "
                       "(disjoint from the evaluated ones); or both (mixed)")
  ap.add_argument("--calibration-prompts", type=int, nargs=2, default=[40, 80],
                  metavar=("FIRST", "STOP"))
  ap.add_argument("--calibration-new-tokens", type=count, default=160)
  ap.add_argument("--calibration-turns", type=int, nargs="+", default=[1],
                  help="MT-Bench turns whose questions --calibration-prompts are asked (each "
                       "on its own): 1, or 1 2 for twice as many prompts")
  ap.add_argument("--calibration-offset", type=int, default=60000,
                  help="book token where GPTQ's calibration text starts (the book prompt is "
                       "the first --prompt-tokens tokens)")
  ap.add_argument("--gptq-act-order", type=int, choices=(0, 1), default=1,
                  help="GPTQ's rows by decreasing Hessian diagonal on static grids (1) or in order")
  ap.add_argument("--gptq-sequential", type=int, choices=(0, 1), default=1,
                  help="GPTQ calibrates each layer on the quantized earlier layers' outputs (1) "
                       "or on the full-precision model's (0)")
  ap.add_argument("--gptq-true-sequential", type=int, choices=(0, 1), default=0,
                  help="GPTQ calibrates each linear on its layer with the earlier linears "
                       "quantized (1) or on the layer as it is (0)")
  ap.add_argument("--skip-ppl", action="store_true")
  add_one_row_gemv_arg(ap)
  ap.add_argument("--emulate-one-row-gemv", choices=tuple(EMULATIONS), default=None,
                  help="the acceptance sweep's draft linears multiply as that GPU kernel does "
                       "(its x planes and weights, `_gemv_choice.draft_matmul`), on any "
                       "backend; dp4a-x-only / dp4a-weights-only: one of the dp4a kernel's "
                       "two departures from the W4A16 kernel (x in int8 planes; exact weights)")
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                "quantspec_quality.json"))
  args = ap.parse_args(argv)
  _check_calibration(ap, args)
  apply_one_row_gemv(args.one_row_gemv)
  weight_bits = None if args.weight_bits == "none" else int(args.weight_bits)
  cfg, params, tok = load_model(args.gguf, dtype=args.dtype)
  text_ids = np.asarray(tok.encode(book()), np.int32)
  if (args.book_prompts - 1) * BOOK_STRIDE + args.prompt_tokens > len(text_ids):
    raise SystemExit(f"--book-prompts {args.book_prompts} windows of {args.prompt_tokens} tokens "
                     f"do not fit the book's {len(text_ids)} tokens")
  if args.weight_quantizer == "gptq" and args.calibration_source in ("book", "mixed") \
      and args.calibration_offset >= len(text_ids):
    raise SystemExit(f"--calibration-offset {args.calibration_offset} is past the book's "
                     f"{len(text_ids)} tokens")
  result = {"benchmark": "QuantSpec quality and acceptance, SmolLM2-135M-Instruct",
            "device": device_description(), "args": vars(args), "perplexity": {},
            "acceptance": []}

  def save():
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)

  if not args.skip_ppl:
    ids = text_ids[: args.ppl_tokens + 1]
    full = perplexity_full(cfg, params, ids, args.chunk)
    log(f"perplexity full-precision KV: {full:.4f}")
    result["perplexity"]["full"] = full
    for bits in (8, 4):
      ppl = perplexity_quantized(cfg, params, ids, args.chunk, args.group, bits)
      result["perplexity"][f"int{bits}"] = ppl
      result["perplexity"][f"int{bits}_relative_increase"] = ppl / full - 1
      log(f"perplexity INT{bits} KV: {ppl:.4f} ({100 * (ppl / full - 1):+.3f}%)")
      save()

  run_params = params
  if args.weight_quantizer == "gptq" and weight_bits is not None:
    calibration = []
    if args.calibration_source in ("book", "mixed"):
      start = args.calibration_offset
      calibration.append(text_ids[start:start + args.calibration_tokens])
    if args.calibration_source in ("self-chat", "mixed"):
      first, stop = args.calibration_prompts
      calibration += self_chat_calibration(cfg, params, tok,
                                           calibration_questions(first, stop,
                                                                 args.calibration_turns),
                                           args.calibration_new_tokens, args.calibration_tokens)
    result["calibration_tokens_used"] = sum(len(c) for c in calibration)
    t0 = time.perf_counter()
    draft = gptq_quantize_params(cfg, params, calibration,
                                 group=args.weight_group, act_order=bool(args.gptq_act_order),
                                 sequential=bool(args.gptq_sequential),
                                 true_sequential=bool(args.gptq_true_sequential))
    run_params = with_draft(params, draft)
    result["gptq_seconds"] = time.perf_counter() - t0
    log(f"GPTQ draft in {result['gptq_seconds']:.1f} s")
  book_windows = [text_ids[i * BOOK_STRIDE: i * BOOK_STRIDE + args.prompt_tokens].tolist()
                  for i in range(args.book_prompts)]
  # Book windows run one at a time (batch 1: the draft's one-row GEMVs, as in decoding one
  # text); MT-Bench prompts as one batch (the draft's GEMVs then take B rows: on a GPU the W4A16
  # kernel, not the one-row dp4a one), or one at a time with --mt-bench-one-at-a-time.
  prompts = {"book": [[w] for w in book_windows]}
  if "mt_bench" in args.sets:
    chats = encode_prompts(tok, mt_bench(turn=1)[: args.mt_bench_prompts], chat_template=True)
    prompts["mt_bench"] = [[c] for c in chats] if args.mt_bench_one_at_a_time else [chats]
  emulation = (draft_matmul(*EMULATIONS[args.emulate_one_row_gemv]) if args.emulate_one_row_gemv
               else contextlib.nullcontext())
  with emulation:
    _acceptance_sweep(args, cfg, run_params, weight_bits, prompts, result, save)
  log(f"wrote {args.out}")
  return result


def _acceptance_sweep(args, cfg, run_params, weight_bits, prompts, result, save) -> None:
  """One pooled acceptance row per (prompt set, gamma), saved after each."""
  for name, batches in prompts.items():
    if name not in args.sets:
      continue
    for gamma in args.gammas:
      method = QuantSpec(gamma=gamma, quant_group=args.group, verify_precision="int8",
                         weight_bits=weight_bits, weight_group=args.weight_group)
      runs = [generate(cfg, run_params, ids, method=method, max_new_tokens=args.new_tokens,
                       stop_tokens=()) for ids in batches]
      row = {"prompts": name, "gamma": gamma, "weight_bits": weight_bits,
             "weight_group": args.weight_group, "weight_quantizer": args.weight_quantizer,
             **pooled_stats(runs)}
      result["acceptance"].append(row)
      log(f"{name} gamma={gamma}: acceptance {row['acceptance_rate']} "
          f"({row['accepted_drafts']} / {row['drafted_tokens']}), tau {row['tau']:.3f}")
      save()


if __name__ == "__main__":
  main()
