"""QuantSpec step costs at Llama-3.1-8B shapes (GPU): dense step vs draft and verification
forwards, peak memory, and the PROJECTED speedup per generated token.

Random bf16 weights (`step_roofline.random_params`, generated on the device per layer) are jit
arguments, never closure constants. B = 1. Per context (ascending):
  (i)   dense: one `Dense` decode step (bf16 cache, `attention=auto`: decode_attention on a GPU),
        timed by `step_roofline.step_time` (a fori_loop of --steps steps in one jit).
  (ii)  draft: one-token forwards with the 4-bit draft weights (`quantize_params`, per --layouts:
        "packed" = dequantize then matmul, the current path; "int4" = XLA-fusable int4 codes;
        "int4_grouped" = per-group dots on the codes; "none" = the full bf16 weights, a KV-only
        draft, QuantSpec's `weight_bits=None`) reading `QuantView(bits=4)` of a random
        hierarchical cache (quant_attention on a GPU) plus the in-flight draft scratch, argmax
        fed back. One loop iteration is one draft phase as `QuantSpec.step` runs it: the view's
        tail once (`quantspec.draft_view`), then gamma_max forwards (extra_len 0 .. gamma_max - 1);
        reported per forward (the phase / gamma_max); --steps forwards in one jit.
  (iii) verify: (gamma + 1)-token forwards with the full weights reading `QuantView(bits=8)`,
        per --gammas, argmax fed back; --steps forwards in one jit.
Times are the median of --repeats runs after a warm-up, divided by --steps. The quantized cache is
random codes / scales / buffer generated on the device per layer (no bf16 cache of the context is
ever built for it): quant_len = quantized_length(context), buf_len = context - quant_len.

Projection, per gamma, draft layout and acceptance source (labelled "projected": the draft and
verify forwards are timed separately; commit, flush and sampling are not in it; --full-step
times QuantSpec.step itself as a check):
  per token, dense = t_dense; quantspec = (gamma * t_draft + t_verify) / E,
  E = (1 - a^(gamma + 1)) / (1 - a) for a per-token acceptance a. The acceptance JSON
  (quantspec_quality.py) records r = accepted / drafted at each gamma; under the i.i.d. model
  r * gamma = a + ... + a^gamma, which is solved for a (then E = 1 + r * gamma). --acceptance A
  uses a = A for every gamma instead.

--reproject RUN.json ... times nothing: it projects from earlier runs' rows with --acceptance-json
files measured elsewhere (each draft matched to its weight group's acceptance where the files hold
several groups) and lists the best gamma per context, draft and acceptance source.

Memory: each kind (dense, quantspec) runs in its own process (unless --no-isolate), contexts in
ascending order, so the device's peak_bytes_in_use after a context is that context's peak
(weights + cache + temporaries; JAX cannot reset the peak). Analytical bytes (weights, caches,
bytes read per forward, the read roofline at the measured read bandwidth) sit beside it.

  python benchmarks/quantspec_step.py --contexts 8192 32768 131072 --gammas 2 4 6 \\
      --out $OUT/quantspec_step.json
  python benchmarks/quantspec_step.py --smoke --out /tmp/quantspec_step_smoke.json   # CPU, tiny

Writes --out (merged rows, memory, projections) and, per kind, --out with suffix
.dense.json / .quantspec.json (each rewritten after every measurement: a timeout keeps data).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._args import count  # noqa: E402
from benchmarks._gemv_choice import add_one_row_gemv_arg, apply_one_row_gemv  # noqa: E402
from benchmarks._timing import device_time, fresh_executables  # noqa: E402
from benchmarks.step_roofline import (LLAMA_31_8B, log, random_params, random_state,  # noqa: E402
                                      read_bandwidth, step_time)
from sparsedec.attention import (AttentionPlan, QuantView, Segment, causal_plan,  # noqa: E402
                                 kernel_choice)
from sparsedec.decode.quantspec import (draft_scratch, draft_view, verify_view,  # noqa: E402
                                        write_draft_kv)
from sparsedec.kv import quantized as qkv  # noqa: E402
from sparsedec.kv.dense import KVCache  # noqa: E402
from sparsedec.model.config import ModelConfig  # noqa: E402
from sparsedec.model.forward import forward  # noqa: E402
from sparsedec.model.params import num_bytes  # noqa: E402
from sparsedec.model.quant_weights import (LAYOUTS, QUANTIZED_LINEARS, QuantWeight,  # noqa: E402
                                           params_to_layout, quantize_weight)
from pallas_kernels.quant_attention import QuantKV  # noqa: E402

KINDS = ("dense", "quantspec")
KV_ONLY = "none"          # --layouts entry: the draft keeps the full weights (weight_bits=None)
DEFAULT_ACCEPTANCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                  "quantspec_quality_cpu.json")
# --smoke: Llama-shaped but tiny (head_dim 64 so the kernels' shape rules are the same).
SMOKE_CFG = LLAMA_31_8B.replace(num_layers=2, hidden_size=256, intermediate_size=512,
                                num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=512)
SMOKE_ARGS = dict(contexts=[300], gammas=[2], steps=2, repeats=1, group=64, weight_group=64,
                  attention="reference")


# ------------------------------------------------------------------------------------------------
# Device-side construction.
# ------------------------------------------------------------------------------------------------

def empty_cache(cfg: ModelConfig, lengths: jax.Array) -> KVCache:
  """A zero-capacity dense cache carrying `lengths` [B] (QuantSpec's int8 mode holds no other)."""
  b = lengths.shape[0]
  shape = (b, cfg.num_kv_heads, 0, cfg.head_dim)
  dtype = jnp.dtype(cfg.dtype)
  return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                 v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                 lengths=lengths)


def quant_capacity(context: int, room: int, group: int) -> int:
  """Quantized capacity: the context plus room, aligned to the group and to 128 slots."""
  align = group * 128 // math.gcd(group, 128)
  return -(-(context + room) // align) * align


def random_quantized_cache(cfg: ModelConfig, context: int, capacity: int, group: int,
                           key) -> qkv.QuantizedCache:
  """A hierarchical cache of `context` tokens (B = 1) with random codes, scales, zeros and buffer,
  built per layer by one small jitted function (no bf16 cache of the context exists)."""
  hkv, d = cfg.num_kv_heads, cfg.head_dim
  dtype = jnp.dtype(cfg.dtype)

  @jax.jit
  def layer(key):
    ks = jax.random.split(key, 8)
    words = lambda k, shape: jax.random.bits(k, shape, jnp.uint32)   # 8 random 4-bit codes each
    scale = lambda k, shape: jax.random.uniform(k, shape, jnp.float32, 0.05, 0.3).astype(
        jnp.float16)
    zero = lambda k, shape: (-8 * scale(k, shape).astype(jnp.float32)).astype(jnp.float16)
    k_meta, v_meta = (1, hkv, capacity // group, d), (1, hkv, capacity)
    c = 64 if d % 64 == 0 else d                     # channels per stored K chunk
    codes_kv = QuantKV(words(ks[0], (1, hkv, 2, d // c, capacity, c // 8)),
                       words(ks[1], (1, hkv, 2, capacity // 64, d, 8)), scale(ks[2], k_meta),
                       zero(ks[2], k_meta),
                       scale(ks[3], v_meta), zero(ks[3], v_meta), group=group)
    buf = lambda k: jax.random.normal(k, (1, hkv, 2 * group, d), dtype)
    return codes_kv, buf(ks[4]), buf(ks[5])

  layers = [layer(k) for k in jax.random.split(key, cfg.num_layers)]
  quant_len = qkv.quantized_length(jnp.full((1,), context, jnp.int32), group)
  return qkv.QuantizedCache(codes=tuple(x[0] for x in layers), buf_k=tuple(x[1] for x in layers),
                            buf_v=tuple(x[2] for x in layers), quant_len=quant_len,
                            buf_len=context - quant_len, group=group)


def draft_params_for(params: dict, group: int, layout: str) -> dict:
  """`quantize_params(params, group, layout)`, one jitted quantizer call per weight (compiled
  once per shape)."""
  quantize = jax.jit(quantize_weight, static_argnums=(1, 2))
  layers = [{name: quantize(x, group, layout) if name in QUANTIZED_LINEARS else x
             for name, x in lp.items()} for lp in params["layers"]]
  return {**params, "layers": layers}


# ------------------------------------------------------------------------------------------------
# Timing.
# ------------------------------------------------------------------------------------------------

def timed_loop(body, carry, args, steps: int, repeats: int, donate: bool = False,
               profile: bool = False, profile_top: int = 16, per_iteration: int = 1,
               sequence: int = 0) -> dict:
  """Seconds per iteration of carry = body(i, carry, *args), `steps` iterations in one jitted
  fori_loop (args are jit arguments): compile, one warm-up run, median of `repeats` runs;
  divided by `per_iteration` when an iteration holds that many forwards.
  donate: the carry is donated and each run continues from the previous one's (a large carry,
  e.g. a decode state, is then updated in place instead of copied per run).
  profile (GPU, not with donate): one more run under the profiler, for the GPU busy time per
  iteration and the costliest kernels (`_timing.device_time`); `sequence` > 0: also the first
  `sequence` kernels of one iteration in launch order ("kernel_sequence")."""
  def loop(carry, args):
    return jax.lax.fori_loop(0, steps, lambda i, c: body(i, c, *args), carry)

  jitted = jax.jit(loop, donate_argnums=(0,) if donate else ())
  t0 = time.perf_counter()
  compiled = jitted.lower(carry, args).compile()
  compile_s = time.perf_counter() - t0
  out = compiled(carry, args)
  jax.block_until_ready(out)
  runs = []
  for _ in range(repeats):
    carry = out if donate else carry
    t = time.perf_counter()
    out = compiled(carry, args)
    jax.block_until_ready(out)
    runs.append((time.perf_counter() - t) / (steps * per_iteration))
  result = {"step_seconds": float(np.median(runs)), "runs_s": runs,
            "compile_seconds": compile_s, "xla_memory": xla_memory(compiled)}
  if donate:
    result["final_carry"] = out               # what the donated carry became
  elif profile and jax.default_backend() == "gpu":
    result.update(device_time(lambda: jax.block_until_ready(compiled(carry, args)),
                              steps * per_iteration, top=profile_top, sequence=sequence))
  return result


def xla_memory(compiled) -> dict | None:
  """XLA's static buffer sizes of one compiled loop (arguments, outputs, temporaries)."""
  try:
    m = compiled.memory_analysis()
    return {name: int(getattr(m, name)) for name in (
        "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
        "alias_size_in_bytes", "generated_code_size_in_bytes")}
  except Exception:  # noqa: BLE001 - not every backend reports it
    return None


def draft_body(cfg: ModelConfig, width: int):
  """One draft phase, as in `QuantSpec.step`: the view's tail (`QuantView.with_tail`) once, then
  `width` one-token forwards, token [1, 1] at position N + j reading the 4-bit view and the
  scratch's first j draft entries; its K/V go to scratch slot j."""
  def body(i, carry, draft_params, qcache):
    del i
    base = draft_view(qcache)

    def forward_j(j, carry):
      tok, ek, ev = carry                                    # [B, 1]; [L, B, W, Hkv, D]
      b = tok.shape[0]
      view = base.replace(extra_k=ek, extra_v=ev, extra_len=jnp.full((b,), j, jnp.int32))
      plan = AttentionPlan(jnp.ones((1, 1), bool), (Segment(view, 0, 1),))
      logits, kv = forward(cfg, draft_params, tok, (qcache.lengths + j)[:, None],
                           empty_cache(cfg, qcache.lengths), plan)
      nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)[:, None]
      return nxt, write_draft_kv(ek, kv.k, j), write_draft_kv(ev, kv.v, j)
    return jax.lax.fori_loop(0, width, forward_j, carry)
  return body


def verify_body(cfg: ModelConfig, gamma: int):
  """One verification forward: gamma + 1 tokens reading the 8-bit view (causal), its tail
  computed in it (`quantspec.verify_view`, as `QuantSpec.verify_plan` does once per step)."""
  t = gamma + 1
  mask = causal_plan(t).inflight_mask

  def body(i, tokens, params, qcache):                        # tokens [B, gamma + 1]
    plan = AttentionPlan(mask, (Segment(verify_view(qcache), 0, t),))
    positions = qcache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    logits, _ = forward(cfg, params, tokens, positions, empty_cache(cfg, qcache.lengths), plan)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return body


def time_draft(cfg, draft_params, qcache, width, steps, repeats, profile: int = 0,
               sequence: int = 0) -> dict:
  scratch = draft_scratch(cfg, 1, width, jnp.dtype(cfg.dtype))          # [L, B, W, Hkv, D]
  carry = (jnp.ones((1, 1), jnp.int32), scratch, scratch)
  return timed_loop(draft_body(cfg, width), carry, (draft_params, qcache),
                    max(1, steps // width), repeats, profile=bool(profile),
                    profile_top=profile or 16, per_iteration=width, sequence=sequence)


def time_verify(cfg, params, qcache, gamma, steps, repeats, profile: int = 0,
                sequence: int = 0) -> dict:
  tokens = jnp.ones((1, gamma + 1), jnp.int32)
  return timed_loop(verify_body(cfg, gamma), tokens, (params, qcache), steps, repeats,
                    profile=bool(profile), profile_top=profile or 16, sequence=sequence)


def time_full_step(cfg, params, draft_params, qcache, gamma, steps, repeats
                   ) -> tuple[dict, qkv.QuantizedCache]:
  """QuantSpec.step itself (draft, verify, acceptance, commit, flush) in one jitted fori_loop,
  from a state built around the random cache (QuantSpec.init on a small stand-in, then the
  extras' qcache replaced). Per step, not per token. The cache is donated (updated in place):
  returns the timing and the cache as the steps left it (longer)."""
  from sparsedec.decode.loop import StepContext
  from sparsedec.decode.quantspec import QuantSpec
  from sparsedec.decode.sampling import SamplingConfig
  from sparsedec.decode.state import DecodeState
  group, context = qcache.group, int(qcache.lengths[0])
  method = QuantSpec(gamma=gamma, quant_group=group, weight_bits=None)
  capacity = qcache.quant_capacity
  tiny = KVCache(k=tuple(jnp.zeros((1, cfg.num_kv_heads, 2 * group, cfg.head_dim),
                                   jnp.dtype(cfg.dtype)) for _ in range(cfg.num_layers)),
                 v=tuple(jnp.zeros((1, cfg.num_kv_heads, 2 * group, cfg.head_dim),
                                   jnp.dtype(cfg.dtype)) for _ in range(cfg.num_layers)),
                 lengths=jnp.full((1,), group, jnp.int32))
  one = lambda v: jnp.full((1,), v, jnp.int32)
  state = DecodeState(tokens=jnp.ones((1, capacity + 1), jnp.int32), num_tokens=one(context + 1),
                      prompt_lengths=one(context), limits=one(capacity + 1),
                      done=jnp.zeros((1,), bool), cache=tiny, keys=jax.random.split(
                          jax.random.key(0), 1), step=jnp.zeros((), jnp.int32),
                      active_steps=jnp.zeros((1,), jnp.int32))
  state = method.init(cfg, params, state)
  state = unaliased(state.replace(cache=empty_cache(cfg, qcache.lengths),
                                  extras=state.extras.replace(qcache=qcache)))
  ctx = StepContext(SamplingConfig(), ())

  def body(i, state, params, draft_params):
    # The draft params enter as an argument, not in the donated state (their unquantized leaves
    # are params' own arrays).
    x = state.extras
    state = method.step(cfg, params, state.replace(extras=x.replace(draft_params=draft_params)),
                        ctx)
    return state.replace(extras=state.extras.replace(draft_params=None))

  timing = timed_loop(body, state, (params, draft_params), steps, repeats, donate=True)
  final = timing.pop("final_carry")
  return {**timing, "start_context": context, "end_context": int(final.extras.qcache.lengths[0]),
          "acceptance_rate_random_weights": float(final.extras.accepted_drafts[0]) / max(
              1, int(final.extras.drafted[0]))}, final.extras.qcache


def _pointer(x) -> int | None:
  try:
    return x.unsafe_buffer_pointer()
  except Exception:  # noqa: BLE001 - sharded or deleted arrays: not tracked
    return None


def unaliased(tree):
  """`tree` with every leaf that shares its buffer with an earlier leaf copied (donation refuses
  a buffer passed twice)."""
  seen = set()

  def fresh(x):
    ptr = _pointer(x)
    if ptr is not None and ptr in seen:
      return jnp.copy(x)
    seen.add(ptr)
    return x
  return jax.tree.map(fresh, tree)


# ------------------------------------------------------------------------------------------------
# Analytical bytes, acceptance, projection (pure Python).
# ------------------------------------------------------------------------------------------------

def quantized_linear_bytes(draft_params: dict) -> int:
  """Bytes of the draft's QuantWeights (codes + scales + zeros)."""
  leaves = jax.tree.leaves(draft_params["layers"], is_leaf=lambda x: isinstance(x, QuantWeight))
  return sum(x.num_bytes() for x in leaves if isinstance(x, QuantWeight))


def dense_bytes(cfg: ModelConfig, params: dict, context: int, capacity: int) -> dict:
  per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
  embed = num_bytes({"e": params["embed"]})
  weights = num_bytes(params)
  return {"weight_bytes": weights, "cache_bytes": per_token * capacity,
          "weight_bytes_read": weights - embed, "cache_bytes_read": per_token * context}


def quantspec_bytes(cfg: ModelConfig, params: dict, draft_layer_bytes: int | None,
                    qcache: qkv.QuantizedCache) -> dict:
  """Storage and per-forward reads of QuantSpec: full weights + the draft's 4-bit linears; the
  hierarchical cache (codes, scales/zeros, buffer); the draft reads the draft linears + the rest
  of the full params but the embedding (lm_head, norms) and the 4-bit view + buffer, the verifier
  the full weights and the 8-bit view + buffer. draft_layer_bytes None: a KV-only draft (the
  full linears, no 4-bit copy)."""
  embed = num_bytes({"e": params["embed"]})
  weights = num_bytes(params)
  linear_full = sum(num_bytes({n: lp[n]}) for lp in params["layers"] for n in QUANTIZED_LINEARS)
  quant_len = int(qcache.quant_len[0])
  buffer = sum(int(x.size) * x.dtype.itemsize for x in qcache.buf_k + qcache.buf_v)
  if draft_layer_bytes is None:                       # KV-only: the draft reads the full linears
    draft_layer_bytes, linear_full = 0, 0
  read = lambda bits: int(qkv.bytes_per_token(cfg.head_dim, cfg.num_kv_heads, cfg.num_layers,
                                              bits, qcache.group) * quant_len) + buffer
  return {"weight_bytes": weights + draft_layer_bytes, "full_weight_bytes": weights,
          "draft_linear_bytes": draft_layer_bytes, "cache_bytes": qcache.num_bytes(),
          "draft_weight_bytes_read": weights - embed - linear_full + draft_layer_bytes,
          "verify_weight_bytes_read": weights - embed,
          "draft_cache_bytes_read": read(4), "verify_cache_bytes_read": read(8),
          "quant_len": quant_len, "buffer_bytes": buffer}


def per_token_acceptance(rate: float, gamma: int) -> float:
  """a with a + a^2 + ... + a^gamma = rate * gamma (bisection; the i.i.d. acceptance model)."""
  target = rate * gamma
  lo, hi = 0.0, 1.0
  for _ in range(60):
    mid = (lo + hi) / 2
    if sum(mid ** k for k in range(1, gamma + 1)) < target:
      lo = mid
    else:
      hi = mid
  return (lo + hi) / 2


def expected_tokens(a: float, gamma: int) -> float:
  """E[tokens per step] = (1 - a^(gamma + 1)) / (1 - a)."""
  return float(gamma + 1) if a >= 1.0 else (1 - a ** (gamma + 1)) / (1 - a)


PROJECTION_NOTE = (
    "projected: per token, (gamma * t_draft + t_verify) / E with E = (1 - a^(gamma+1)) / (1 - a); "
    "a solved from the measured accepted/drafted rate r (i.i.d. model, E = 1 + r * gamma) or "
    "--acceptance; commit, flush and sampling are not included (kind quantspec_step with "
    "--full-step times them).")


def load_acceptance(paths: list[str]) -> list[dict]:
  """The acceptance rows of quantspec_quality.py's JSONs (a missing file gives none), each
  labelled with its prompt set and, when the file says, its draft weight group."""
  rows = []
  for path in paths:
    if not os.path.exists(path):
      continue
    with open(path) as f:
      data = json.load(f)
    label = "quantspec_quality" if len(paths) == 1 else os.path.basename(path)
    group = data.get("args", {}).get("weight_group")
    for r in data.get("acceptance", []):
      rows.append({**r, "label": f"{label}:{r.get('prompts', '?')}",
                   "weight_group": r.get("weight_group", group)})
  return rows


def acceptance_sources(acceptance: list[dict], gamma: int, override: float | None,
                       weight_group: int | None = None) -> list[dict]:
  """The acceptance rows measured at gamma; when the rows come from drafts of several weight
  groups, only those of weight_group (else every row stands in for any draft, e.g. SmolLM2's
  acceptance for the 8B-shaped draft)."""
  if override is not None:
    return [{"source": "--acceptance", "a_per_token": override}]
  several = len({r.get("weight_group") for r in acceptance}) > 1
  out = []
  for row in sorted(acceptance, key=lambda r: r["label"]):
    if int(row["gamma"]) == gamma and (not several or row.get("weight_group") == weight_group):
      rate = float(row["acceptance_rate"])
      out.append({"source": row["label"], "acceptance_rate": rate,
                  "measured_tau": row.get("tau"), "a_per_token": per_token_acceptance(rate, gamma)})
  return out


def projections(rows: list[dict], acceptance: list[dict], override: float | None) -> list[dict]:
  """Projected per-token time and speedup for every (context, gamma, draft, source) with a
  dense, a draft and a verify measurement (`acceptance_sources` picks the rows per draft)."""
  timed = [r for r in rows if "step_seconds" in r]
  out = []
  for dense in (r for r in timed if r["kind"] == "dense"):
    ctx = dense["context"]
    drafts = [r for r in timed if r["kind"] == "draft" and r["context"] == ctx]
    verifies = [r for r in timed if r["kind"] == "verify" and r["context"] == ctx]
    for ver in verifies:
      gamma = ver["gamma"]
      for draft in drafts:
        group = draft.get("weight_group")
        for src in acceptance_sources(acceptance, gamma, override, group):
          e = expected_tokens(src["a_per_token"], gamma)
          per_token = (gamma * draft["step_seconds"] + ver["step_seconds"]) / e
          row = {"label": "projected", "context": ctx, "gamma": gamma,
                 "draft_layout": draft["layout"], "weight_group": group, **src,
                 "expected_tokens_per_step": e, "t_dense_s": dense["step_seconds"],
                 "t_draft_s": draft["step_seconds"], "t_verify_s": ver["step_seconds"],
                 "quantspec_seconds_per_token": per_token,
                 "projected_speedup": dense["step_seconds"] / per_token}
          full = [r for r in timed if r["kind"] == "quantspec_step" and r["context"] == ctx
                  and r["gamma"] == gamma and r["layout"] == draft["layout"]
                  and r.get("weight_group") == group]
          if full:      # QuantSpec.step as timed (commit, flush, sampling included)
            row["t_full_step_s"] = full[0]["step_seconds"]
            row["full_step_projected_speedup"] = dense["step_seconds"] * e / row["t_full_step_s"]
          out.append(row)
  return out


def best_gammas(projected: list[dict]) -> list[dict]:
  """The fastest gamma's projection per (context, draft layout, weight group, source)."""
  best = {}
  for p in projected:
    key = (p["context"], p["draft_layout"], p.get("weight_group"), p["source"])
    if key not in best or p["projected_speedup"] > best[key]["projected_speedup"]:
      best[key] = p
  return [best[k] for k in sorted(best, key=str)]


def reproject(args) -> dict:
  """Projections from earlier runs' rows (--reproject: their merged JSONs; a draft or step row
  takes its file's --weight-group; a context's dense and verify rows come from the first file
  that timed them) and --acceptance-json files measured elsewhere."""
  rows, seen = [], set()
  for path in args.reproject:
    with open(path) as f:
      data = json.load(f)
    group = data.get("args", {}).get("weight_group")
    for r in data.get("rows", []):
      if r.get("kind") in ("draft", "quantspec_step") and "weight_group" not in r:
        r = {**r, "weight_group": None if r.get("layout") == KV_ONLY else group}
      if r.get("kind") in ("dense", "verify") and "step_seconds" in r:
        key = (r["kind"], r["context"], r.get("gamma"))
        if key in seen:
          continue
        seen.add(key)
      rows.append(r)
  projected = projections(rows, load_acceptance(args.acceptance_json), args.acceptance)
  if not projected:
    raise SystemExit("--reproject: no (dense, draft, verify, acceptance) combination to project; "
                     "the runs need a dense row and the acceptance files rows at their gammas")
  return {"benchmark": "QuantSpec projected speedup from earlier step timings",
          "reprojected_from": list(args.reproject), "acceptance_json": args.acceptance_json,
          "acceptance": args.acceptance, "projected": projected,
          "best_gamma": best_gammas(projected), "notes": [PROJECTION_NOTE]}


# ------------------------------------------------------------------------------------------------
# Workers.
# ------------------------------------------------------------------------------------------------

def memory_now() -> dict:
  stats = jax.devices()[0].memory_stats() or {}
  return {"device_peak_bytes": stats.get("peak_bytes_in_use"),
          "device_bytes_in_use": stats.get("bytes_in_use")}


class Recorder:
  """Rows written to `path` after every measurement (a timeout keeps what was measured)."""

  def __init__(self, path: str, header: dict):
    self.path, self.result = path, {**header, "rows": []}

  def add(self, row: dict) -> None:
    self.result["rows"].append(row)
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.result, f, indent=1)
    os.replace(tmp, self.path)


def _guarded(rec: Recorder, base: dict, fn) -> dict | None:
  """Runs fn() -> row fields; records an error row instead of raising. On a GPU, from empty
  compilation caches (`fresh_executables`: no earlier row's programs beside this one's)."""
  fresh_executables()
  try:
    row = {**base, **fn()}
  except Exception as e:  # noqa: BLE001 - record and go on
    row = {**base, "error": repr(e)[:2000]}
    log(f"{base}: {e!r}"[:600])
  rec.add({**row, **memory_now()})
  return row


def run_dense(args, cfg: ModelConfig, rec: Recorder, bw: float) -> None:
  params = random_params(cfg, jax.random.key(1))
  jax.block_until_ready(params)
  log(f"dense worker: weights {num_bytes(params) / 2**30:.2f} GiB")
  for context in sorted(args.contexts):
    room = 2 * args.steps * (args.repeats + 2)
    state = random_state(cfg, context, room, jax.random.key(context))
    jax.block_until_ready(state)
    capacity = state.cache.capacity
    bytes_ = dense_bytes(cfg, params, context, capacity)

    def measure():
      seconds = step_time(cfg, params, state, args.steps)
      read = bytes_["weight_bytes_read"] + bytes_["cache_bytes_read"]
      return {"step_seconds": seconds, "roofline_seconds": read / bw, "bytes": bytes_}

    row = _guarded(rec, {"kind": "dense", "context": context, "capacity": capacity,
                         "attention": cfg.attention}, measure)
    if "step_seconds" in row:
      log(f"context {context} dense: {row['step_seconds'] * 1e3:.3f} ms/step")
    state = None                          # freed before the next (larger) context


def _kernel_for(cfg: ModelConfig, qcache, bits: int, t: int) -> dict:
  """Which attention path the forward takes for this QuantView (what `attend` decides)."""
  q = jax.ShapeDtypeStruct((1, t, cfg.num_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
  plan = AttentionPlan(causal_plan(t).inflight_mask, (Segment(QuantView(qcache, bits=bits), 0, t),))
  kind, why = kernel_choice(q, qcache.buf_k[0][:, :, :0], plan.at_layer(0))
  on_gpu = jax.default_backend() == "gpu"
  used = kind if (cfg.attention in ("pallas", "interpret")
                  or (cfg.attention == "auto" and on_gpu)) else None
  return {"attention": cfg.attention, "attention_kernel": used, "kernel_blocker": why or None}


def run_quantspec(args, cfg: ModelConfig, rec: Recorder, bw: float) -> None:
  params = random_params(cfg, jax.random.key(1))
  jax.block_until_ready(params)
  width = max(args.gammas)
  for context in sorted(args.contexts):
    full_steps = len(args.gammas) * (args.repeats + 1) * args.steps if args.full_step else 0
    room = (full_steps + args.steps) * (width + 1) + 2 * args.group
    capacity = quant_capacity(context, room, args.group)
    qcache = random_quantized_cache(cfg, context, capacity, args.group, jax.random.key(context))
    jax.block_until_ready(qcache)
    log(f"context {context}: quantized cache {qcache.num_bytes() / 2**30:.2f} GiB "
        f"(quant_len {int(qcache.quant_len[0])}, capacity {capacity})")
    draft = None
    stored = None
    for layout in args.layouts:
      if layout == KV_ONLY:                  # the draft reads the full weights
        draft_l, linear_bytes = params, None
      else:
        storage = "packed" if layout == "packed" else "int4"
        if stored != storage:                # one 4-bit copy alive at a time
          draft = None
          draft = draft_params_for(params, args.weight_group, storage)
          jax.block_until_ready(draft)
          stored = storage
        draft_l = params_to_layout(draft, layout)
        linear_bytes = quantized_linear_bytes(draft_l)
      b = quantspec_bytes(cfg, params, linear_bytes, qcache)

      def measure_draft():
        t = time_draft(cfg, draft_l, qcache, width, args.steps, args.repeats, args.profile,
                       args.kernel_sequence)
        read = b["draft_weight_bytes_read"] + b["draft_cache_bytes_read"]
        return {**t, "roofline_seconds": read / bw, "bytes": b}

      row = _guarded(rec, {"kind": "draft", "context": context, "layout": layout,
                           "weight_group": None if layout == KV_ONLY else args.weight_group,
                           "scratch_width": width, **_kernel_for(cfg, qcache, 4, 1)},
                     measure_draft)
      if "step_seconds" in row:
        log(f"context {context} draft[{layout}]: {row['step_seconds'] * 1e3:.3f} ms/forward "
            f"(compile {row['compile_seconds']:.1f} s)")
    for gamma in args.gammas:
      def measure_verify():
        t = time_verify(cfg, params, qcache, gamma, args.steps, args.repeats, args.profile,
                        args.kernel_sequence)
        read = b["verify_weight_bytes_read"] + b["verify_cache_bytes_read"]
        return {**t, "roofline_seconds": read / bw, "bytes": b}

      row = _guarded(rec, {"kind": "verify", "context": context, "gamma": gamma,
                           **_kernel_for(cfg, qcache, 8, gamma + 1)}, measure_verify)
      if "step_seconds" in row:
        log(f"context {context} verify[gamma={gamma}]: {row['step_seconds'] * 1e3:.3f} ms/forward"
            f" (compile {row['compile_seconds']:.1f} s)")
    if args.full_step:          # last: each run donates the cache and leaves it longer
      for gamma in args.gammas:
        out = {}

        def measure_step():
          timing, out["qcache"] = time_full_step(cfg, params, draft_l, qcache, gamma,
                                                 args.steps, args.repeats)
          return timing

        row = _guarded(rec, {"kind": "quantspec_step", "context": context, "gamma": gamma,
                             "layout": args.layouts[-1],
                             "weight_group": None if args.layouts[-1] == KV_ONLY
                             else args.weight_group}, measure_step)
        if "qcache" not in out:
          break                               # the cache may be gone: no further full steps
        qcache = out["qcache"]
        log(f"context {context} QuantSpec.step[gamma={gamma}]: "
            f"{row['step_seconds'] * 1e3:.3f} ms/step")
    qcache = draft = draft_l = None       # freed before the next (larger) context


WORKERS = {"dense": run_dense, "quantspec": run_quantspec}


def run_worker(args, kind: str, path: str) -> None:
  from sparsedec.bench import device_description
  apply_one_row_gemv(args.one_row_gemv)
  cfg = (SMOKE_CFG if args.smoke else LLAMA_31_8B).replace(attention=args.attention)
  if args.layers:
    cfg = cfg.replace(num_layers=args.layers)
  on_gpu = jax.default_backend() == "gpu"
  bw = read_bandwidth(4.0 if on_gpu else 0.01)
  log(f"{kind} worker on {jax.devices()[0].device_kind}: read bandwidth {bw / 1e9:.1f} GB/s")
  rec = Recorder(path, {"kind": kind, "device": device_description(),
                        "read_bandwidth_bytes_per_s": bw, "config": cfg.to_dict(),
                        "attention": cfg.attention})
  WORKERS[kind](args, cfg, rec, bw)


# ------------------------------------------------------------------------------------------------
# Driver.
# ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--contexts", type=count, nargs="+", default=[8192, 32768, 131072])
  ap.add_argument("--gammas", type=count, nargs="+", default=[2, 4, 6])
  ap.add_argument("--layouts", nargs="+", default=["packed", "int4", "int4_grouped", "int4_reduce"],
                  choices=LAYOUTS + (KV_ONLY,),
                  help=f"draft weight layouts to time (quant_weights.LAYOUTS; {KV_ONLY!r}: the "
                       "full weights, a KV-only draft)")
  ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
  ap.add_argument("--steps", type=count, default=16, help="forwards / steps per timed loop")
  ap.add_argument("--repeats", type=count, default=3)
  ap.add_argument("--group", type=count, default=128, help="KV quant group G")
  ap.add_argument("--weight-group", type=count, default=128)
  ap.add_argument("--attention", default="auto", choices=("auto", "reference", "pallas"))
  ap.add_argument("--acceptance-json", nargs="+", default=[DEFAULT_ACCEPTANCE],
                  help="quantspec_quality.py JSONs; each acceptance row projects the drafts of its "
                       "weight group (where the files say)")
  ap.add_argument("--acceptance", type=float, default=None,
                  help="per-token acceptance a for every gamma (instead of the JSON)")
  ap.add_argument("--full-step", action="store_true",
                  help="also time QuantSpec.step itself (draft + verify + commit) per gamma")
  ap.add_argument("--layers", type=count, default=None, help="fewer layers")
  ap.add_argument("--profile", type=int, nargs="?", const=16, default=0, metavar="TOP",
                  help="GPU: also the profiler's busy time per draft / verify forward and its "
                       "TOP (16) costliest kernels")
  ap.add_argument("--kernel-sequence", type=int, default=0, metavar="N",
                  help="with --profile: also the first N kernels of one draft phase / verify "
                       "forward in launch order (e.g. with --layers 2, to read one layer's)")
  ap.add_argument("--no-isolate", action="store_true",
                  help="run both kinds in this process (peak memory then cumulative)")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny shapes, reference attention, one context: a CPU check (< 60 s)")
  ap.add_argument("--reproject", nargs="+", default=None, metavar="STEP_JSON",
                  help="time nothing: project from these earlier runs' JSONs (their dense, draft "
                       "and verify rows) with --acceptance-json, and write --out")
  add_one_row_gemv_arg(ap)
  ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                "quantspec_step.json"))
  args = ap.parse_args(argv)
  if args.acceptance is not None and not 0.0 <= args.acceptance <= 1.0:
    ap.error(f"--acceptance is a per-token acceptance probability in [0, 1], got "
             f"{args.acceptance}")       # -0.5 projected 0.75 tokens per step, 1.5 counted as 1
  if args.acceptance is None:
    missing = [path for path in args.acceptance_json if not os.path.isfile(path)]
    if missing:                          # were skipped: no projection, or one misleading error
      ap.error(f"--acceptance-json: no file at {missing[0]}")
  if args.smoke:
    for name, value in SMOKE_ARGS.items():
      if getattr(args, name) == ap.get_default(name):
        setattr(args, name, value)
  return args


def worker_path(out: str, kind: str) -> str:
  stem = out[:-5] if out.endswith(".json") else out
  return f"{stem}.{kind}.json"


def spawn(argv: list[str], kind: str, path: str) -> None:
  """This script as a fresh process for one kind (a clean device memory peak)."""
  cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", kind, "--out", path]
  rc = subprocess.run(cmd, check=False).returncode
  if rc:
    log(f"{kind} worker exited with status {rc} (its rows so far are in {path})")


def merge(args, paths: dict) -> dict:
  parts = {}
  for kind, path in paths.items():
    if os.path.exists(path):
      with open(path) as f:
        parts[kind] = json.load(f)
  rows = [r for part in parts.values() for r in part["rows"]]
  projected = projections(rows, load_acceptance(args.acceptance_json), args.acceptance)
  memory = []
  for kind, part in parts.items():
    for ctx in sorted({r["context"] for r in part["rows"]}):
      last = [r for r in part["rows"] if r["context"] == ctx and r["kind"] != "quantspec_step"][-1]
      analytic = last.get("bytes") or next(
          (r["bytes"] for r in part["rows"] if r["context"] == ctx and "bytes" in r), None)
      memory.append({"kind": kind, "context": ctx, "device_peak_bytes": last["device_peak_bytes"],
                     "analytic_weight_bytes": analytic and analytic["weight_bytes"],
                     "analytic_cache_bytes": analytic and analytic["cache_bytes"]})
  return {
      "benchmark": "QuantSpec draft / verify forwards vs a dense step, Llama-3.1-8B shapes, bf16, "
                   "B=1" + (" (SMOKE: tiny shapes)" if args.smoke else ""),
      "args": {k: v for k, v in vars(args).items() if k != "worker"},
      "workers": {kind: {k: v for k, v in part.items() if k != "rows"}
                  for kind, part in parts.items()},
      "rows": rows, "memory": memory,
      "projected": projected, "best_gamma": best_gammas(projected),
      "notes": [
          PROJECTION_NOTE,
          "acceptance rates come from quantspec_quality.py (SmolLM2-135M, 4-bit weights and KV); "
          "an 8B model's draft acceptance is not measured here.",
          "device_peak_bytes: the worker process's high-water mark (contexts ascending, one "
          "process per kind unless --no-isolate): the peak of the context in that row. The "
          "quantspec peak includes quantizing the draft weights on the device (per weight, from "
          "the bf16 ones, as QuantSpec.init does); memory[] ignores the --full-step rows.",
      ],
  }


def main(argv=None) -> dict | None:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.worker:
    run_worker(args, args.worker, args.out)
    return None
  if args.reproject:
    result = reproject(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
    for p in result["best_gamma"]:
      log(f"best: context {p['context']} weight group {p['weight_group']} {p['source']}: gamma "
          f"{p['gamma']} -> {p['projected_speedup']:.2f}x")
    log(f"wrote {args.out}")
    return result
  paths = {kind: worker_path(args.out, kind) for kind in args.kinds}
  passthrough = [a for a in argv]
  if "--out" in passthrough:
    i = passthrough.index("--out")
    del passthrough[i:i + 2]
  for kind in args.kinds:
    if os.path.exists(paths[kind]):
      os.remove(paths[kind])
    if args.no_isolate:
      run_worker(args, kind, paths[kind])
    else:
      spawn(passthrough, kind, paths[kind])
    result = merge(args, paths)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  for p in result["projected"]:
    log(f"projected: context {p['context']} gamma {p['gamma']} draft {p['draft_layout']} "
        f"{p['source']}: E {p['expected_tokens_per_step']:.2f} tokens/step, "
        f"{p['quantspec_seconds_per_token'] * 1e3:.3f} ms/token vs dense "
        f"{p['t_dense_s'] * 1e3:.3f} -> {p['projected_speedup']:.2f}x")
  for m in result["memory"]:
    log(f"memory {m['kind']} context {m['context']}: peak {m['device_peak_bytes']}, analytic "
        f"weights {m['analytic_weight_bytes']} + cache {m['analytic_cache_bytes']}")
  log(f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()
