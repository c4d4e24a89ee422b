"""Session 69: where does a dense loop's ~15% drop after FAFO / Lookahead loops go (session 68's
drift probe)? SmolLM2-135M shapes, random bf16 weights, random 300-token prompt, 256 tokens, B 1.
Phases dense / FAFO 40 x 4 / Lookahead W 40 / dense / dense, each: one warm call, 3 timed calls
(tokens/s), then one call under the profiler: GPU busy time (summed stream events), the span from
the first event's start to the last one's end, events, and busy time by kernel name.
If the later dense is slower with the same busy time, the time went to gaps between kernels.
Other phases: trivial:N / graphs:N (N unrelated jitted loops, one-kernel or several-kernel
bodies), mosaic:N (N Mosaic GPU decode_attention kernels, Tq 1..N, outside any loop),
clear:0 (jax.clear_caches()).
Usage: python drop_profile.py OUT.json [PHASES]  (PHASES: comma-separated method:guesses, e.g.
dense:0,lookahead:40,dense:0; default the phases above)"""
import argparse, collections, glob, json, os, sys, tempfile, time
import jax
import jax.numpy as jnp
import numpy as np
from sparsedec.decode.api import generate
from sparsedec.model.params import init_random
sys.path.insert(0, ".")
from benchmarks.ngram_decoding import make_method  # noqa: E402
from benchmarks.step_roofline import SMOLLM2_135M  # noqa: E402

cfg = SMOLLM2_135M
params = init_random(cfg, jax.random.key(0))
ids = [list(np.random.default_rng(0).integers(3, 2000, 300))]
knobs = argparse.Namespace(policy="streaming", budget_blocks=4, block_size=64, length=4, candidates=7)


def profiled(method):
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    res = generate(cfg, params, ids, method=method, max_new_tokens=256, stop_tokens=())
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
  ev = []
  for plane in data.planes:
    if plane.name.startswith("/device:GPU:"):
      for line in plane.lines:
        if line.name.startswith("Stream"):
          ev += [(e.start_ns, e.duration_ns, e.name[:60]) for e in line.events]
  ev.sort()
  by = collections.Counter()
  for _, dur, name in ev:
    by[name] += dur
  gaps = [ev[i + 1][0] - (ev[i][0] + ev[i][1]) for i in range(len(ev) - 1)]
  big = sorted(gaps)[-20:]
  return dict(busy_us=sum(e[1] for e in ev) / 1e3, span_us=(ev[-1][0] + ev[-1][1] - ev[0][0]) / 1e3,
              events=len(ev), gap_median_ns=float(np.median(gaps)), gap_p90_ns=float(np.percentile(gaps, 90)),
              biggest_gaps_us=[g / 1e3 for g in big], steps=int(sum(res.active_steps)),
              top_us={k: v / 1e3 for k, v in by.most_common(25)})


rows = []
phases = sys.argv[2] if len(sys.argv) > 2 else "dense:0,fafo:40,lookahead:40,dense:0,dense:0"
for phase, spec in enumerate(phases.split(",")):
  name, guesses = spec.split(":")
  if name == "clear":     # drop every compiled executable (and its command buffers), then go on
    import gc
    jax.clear_caches(); gc.collect()
    print(phase, spec, flush=True)
    continue
  if name == "mosaic":    # N Mosaic GPU decode_attention kernels (Tq 1..N), each its own compile
    from pallas_kernels.decode_attention import decode_attention
    for i in range(int(guesses)):
      tq, key = 1 + i, jax.random.key(i)
      q = jax.random.normal(key, (1, tq, 9, 64), jnp.bfloat16)
      kc = jax.random.normal(key, (1, 3, 1024, 64), jnp.bfloat16)
      kn = jax.random.normal(key, (1, tq, 3, 64), jnp.bfloat16)
      f = jax.jit(lambda *a: decode_attention(*a, jnp.tril(jnp.ones((tq, tq), bool))))
      jax.block_until_ready(f(q, kc, kc, jnp.array([1000], jnp.int32), kn, kn))
    print(phase, spec, flush=True)
    continue
  if name == "graphs":    # N unrelated executables whose loop bodies are several kernels each
    for i in range(int(guesses)):   # (XLA makes command buffers of >= 5 kernels by default)
      def body(j, y, i=i):
        y = jnp.sin(y @ y.T * 1e-3 + i)
        y = jnp.cumsum(y, axis=0) * 1e-3
        y = jnp.sort(y, axis=1) / (1.0 + jnp.max(jnp.abs(y)))
        return jnp.tanh(y[::-1] + jnp.mean(y, axis=0))
      f = jax.jit(lambda x, i=i: jax.lax.fori_loop(0, 20 + i, body, x))
      jax.block_until_ready(f(jnp.ones((256, 256))))
    print(phase, spec, flush=True)
    continue
  if name == "trivial":   # N unrelated executables: small jitted while loops, one compile each
    for i in range(int(guesses)):
      f = jax.jit(lambda x, i=i: jax.lax.fori_loop(0, 100 + i, lambda j, y: jnp.sin(y) * 1.001 + i, x))
      jax.block_until_ready(f(jnp.ones((1024, 1024))))
    print(phase, spec, flush=True)
    continue
  method = make_method(name, int(guesses) or 40, knobs)
  generate(cfg, params, ids, method=method, max_new_tokens=256, stop_tokens=())
  tps = []
  for r in range(3):
    res = generate(cfg, params, ids, method=method, max_new_tokens=256, stop_tokens=())
    tps.append((res.num_generated - 1) / res.decode_seconds)
  prof = profiled(method)
  rows.append(dict(phase=phase, method=name, guesses=int(guesses), tokens_per_second=tps, **prof))
  print(phase, spec, [round(t) for t in tps], {k: prof[k] for k in ("busy_us", "span_us", "events", "gap_median_ns", "gap_p90_ns", "steps")}, flush=True)
json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, open(sys.argv[1], "w"), indent=1)
