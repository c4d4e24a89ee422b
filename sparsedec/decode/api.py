"""Host-side generation API: validate, bucket, prefill, run the jitted loop, unpack results."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import time
from typing import Generator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparsedec.decode.fits import check_run_fits
from sparsedec.decode.loop import (DecodeMethod, StepContext, decode, describe_build,
                                   init_method, row_index, stop_id_tuple)
from sparsedec.decode.methods import get_method
from sparsedec.decode.prefill import cache_sharding, empty_cache, prefill
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.decode.state import DecodeState, beside_step, check_state
from sparsedec.errors import CheckpointError, InputError, is_int
from sparsedec.model.config import ModelConfig
from sparsedec.decode.speculative import target_params
from sparsedec.model.gptq import without_draft
from sparsedec.model.params import Params, check_params, check_params_dtype

MIN_BUCKET = 16
CAPACITY_ALIGN = 128


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


@contextlib.contextmanager
def compile_timer():
  """Seconds spent tracing, lowering and compiling inside the block (jax.monitoring events), so
  speed figures can leave compilation out: `with compile_timer() as t: ...; t[0]`."""
  total = [0.0]

  def listener(event: str, duration: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS:
      total[0] += duration

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield total
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


@dataclasses.dataclass
class GenerationResult:
  """What `generate` returns (and `stream`, as its generator's return value).

  Each row's first token comes from prefill; every later one from a loop step (one iteration:
  one forward of the model over the step's tokens, plus QuantSpec's gamma draft forwards).
  Timings are wall time with tracing and compiling left out; the first call of a compiled
  program still pays the runtime's one-time start (on the CPU tens of ms, more than a short
  stories260K decode itself: `sparsedec bench` times after a warm-up run).
  Sampling: a row's tokens depend on its prompt, its seed and the run's settings, not on the
  other rows of the batch, and the same seed gives the same tokens run to run. Up to
  floating-point rounding: the batch's size sets the shapes the backend computes a row in, and
  XLA:CPU rounds a row's sums differently in the last bits alone and in a batch (stories260K
  fp32: the same prompt's cached keys up to 4e-6 apart alone and beside any other row, itself
  included), so a near-tie, greedy or sampled, can go the other way (none did: stories260K's
  rows, greedy and sampled, every method, and SmolLM2's dense greedy rows gave the same tokens
  alone and in batches).
  One int seed gives every row that seed, so equal prompts in one batch give equal tokens: pass
  one seed per row (e.g. list(range(B))) for independent samples.
  Figures: tau and method_stats are the batch's (every row's counters summed, per-step figures
  over every row's active steps), so they change with the batchmates; row_tau and
  row_method_stats are each row's alone, which rows being independent are the figures of its
  prompt decoded by itself (up to the rounding above)."""
  tokens: list[list[int]]          # generated tokens per row (a final stop token included)
  prompt_lengths: list[int]        # each row's prompt tokens
  stopped: list[bool]              # row ended on a stop token (not on max_new_tokens)
  steps: int                       # loop iterations of the batch (its longest-running row's)
  active_steps: list[int]          # iterations each row was still generating in
  prefill_seconds: float            # wall time of prefill and the method's init (QuantSpec's
                                    #   quantizes the cache and, unless the params carry a
                                    #   draft, the draft's weights), compilation excluded
  decode_seconds: float             # wall time of the decode loop, compilation excluded
  compile_seconds: float = 0.0      # tracing + compiling during this call (first calls only)
  state: DecodeState | None = None  # the final decode state, when asked for
  method_stats: dict = dataclasses.field(default_factory=dict)  # the method's own figures
  row_method_stats: list[dict] = dataclasses.field(default_factory=list)
  # ^ the method's figures of each row alone (`method_stats(method, state, rows=[r])`); [] for a
  #   method whose stats takes no rows (a user method's), or a result built by hand

  @property
  def num_generated(self) -> int:
    """Tokens generated over all rows, each row's first (prefill's) included."""
    return sum(len(t) for t in self.tokens)

  @property
  def tau(self) -> float:
    """Accepted tokens per step, over all rows (the first token comes from prefill)."""
    steps = sum(self.active_steps)
    return (self.num_generated - len(self.tokens)) / steps if steps else 0.0

  @property
  def row_tau(self) -> list[float]:
    """Accepted tokens per step of each row alone: its generated tokens but prefill's first,
    over its active steps (0.0 for a row that took no step). Derived from tokens and
    active_steps, like tau, so it holds for a result built by hand too."""
    return [(len(t) - 1) / a if a else 0.0 for t, a in zip(self.tokens, self.active_steps)]

  @property
  def tokens_per_second(self) -> float:
    """Tokens the decode loop generated per second of it (each row's first token comes from
    prefill, which decode_seconds does not time)."""
    made = self.num_generated - len(self.tokens)
    return made / self.decode_seconds if self.decode_seconds > 0 else 0.0

  def stats(self, per_row: bool = False) -> dict:
    """The figures above as a JSON-ready dict (what the CLI prints): generated_tokens is
    num_generated (prefill's first tokens included, as tau and tokens_per_second leave them
    out), then the method's own figures (method_stats). per_row=True adds "rows": per row a
    dict of its generated_tokens, active_steps, tau (row_tau) and the method's figures for it
    alone (row_method_stats; those that are the batch's, as the knobs, repeat in every row).
    Off by default: the CLI decodes one prompt, whose one row would repeat the batch's figures."""
    out = {"generated_tokens": self.num_generated, "steps": self.steps,
           "tau": round(self.tau, 4), "prefill_seconds": round(self.prefill_seconds, 6),
           "decode_seconds": round(self.decode_seconds, 6),
           "compile_seconds": round(self.compile_seconds, 3),
           "tokens_per_second": round(self.tokens_per_second, 2),
           "stopped": self.stopped, "prompt_lengths": self.prompt_lengths,
           **self.method_stats}
    if per_row:
      methods = self.row_method_stats or [{}] * len(self.tokens)
      out["rows"] = [{"generated_tokens": len(t), "active_steps": a, "tau": round(tau, 4), **m}
                     for t, a, tau, m in zip(self.tokens, self.active_steps, self.row_tau,
                                             methods)]
    return out


def prompt_bucket(length: int) -> int:
  """Padded prompt length: the next power of two (at least 16), so similar prompts share a jit."""
  return max(MIN_BUCKET, 1 << (max(length, 1) - 1).bit_length())


def _what_fits(max_prompt: int, room: int, where: str) -> str:
  """What a run of a `max_prompt`-token prompt can ask for in `room` tokens (context or cache)."""
  if max_prompt >= room:
    return f"the prompt alone fills {where} ({max_prompt} >= {room} tokens): shorten it"
  return f"max_new_tokens of at most {room - max_prompt} fits"


def plan_capacity(cfg: ModelConfig, max_prompt: int, max_new_tokens: int,
                  cache_size: int | None, multiple: int = 1, limit: int | None = None) -> int:
  """The KV cache capacity: cache_size as given, else the prompt bucket plus max_new_tokens
  rounded up to a multiple of CAPACITY_ALIGN and of `multiple` (the method's
  `capacity_multiple`, e.g. FAFO's policy block_size, whose blocks must tile the cache), and cut
  to `limit` (the method's `max_capacity(cfg)`, e.g. QuantSpec's under a sliding window) where
  the prompt and max_new_tokens fit in it."""
  need = max_prompt + max_new_tokens
  if need > cfg.max_position_embeddings:
    raise InputError(
        f"prompt ({max_prompt} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
        f"model's context of {cfg.max_position_embeddings} tokens (max_position_embeddings): "
        f"{_what_fits(max_prompt, cfg.max_position_embeddings, 'the context')}")
  if cache_size is not None:
    if not is_int(cache_size) or cache_size <= 0:
      raise InputError(f"cache_size must be an integer > 0, got {cache_size!r}")
    if need > cache_size:
      raise InputError(
          f"prompt ({max_prompt} tokens) + max_new_tokens ({max_new_tokens}) = {need} does not "
          f"fit in the KV cache of {cache_size} tokens: "
          f"{_what_fits(max_prompt, cache_size, 'the cache')}, or pass a larger cache_size "
          f"(--cache-size)")
    return cache_size
  bucket = prompt_bucket(max_prompt)
  align = math.lcm(CAPACITY_ALIGN, multiple)
  capacity = -(-(bucket + max_new_tokens) // align) * align
  if limit is not None and need <= limit // multiple * multiple < capacity:
    capacity = limit // multiple * multiple
  return capacity


def method_capacity(cfg: ModelConfig, params: Params, method: DecodeMethod, max_prompt: int,
                    max_new_tokens: int, cache_size: int | None) -> int:
  """The KV cache capacity `start` gives a run of `method` (plan_capacity with the method's
  optional `capacity_multiple` and `max_capacity(cfg)`), after the method's optional
  `check(cfg, params, capacity)`: what start refuses before prefill, for callers (the CLI) that
  check a run before they build anything costly."""
  max_capacity = getattr(method, "max_capacity", None)
  capacity = plan_capacity(cfg, max_prompt, max_new_tokens, cache_size,
                           multiple=getattr(method, "capacity_multiple", 1),
                           limit=max_capacity(cfg) if max_capacity is not None else None)
  check = getattr(method, "check", None)
  if check is not None:
    check(cfg, params, capacity)
  return capacity


def _python(x):
  """A numpy / JAX array (or scalar) as Python lists / ints; anything else as it is."""
  return x.tolist() if hasattr(x, "tolist") and not isinstance(x, (list, tuple)) else x


def _check_prompts(cfg: ModelConfig, prompts) -> list[list[int]]:
  prompts = _python(prompts)
  if not isinstance(prompts, (list, tuple)) or not prompts:
    raise InputError("prompts must be a non-empty list of token-id lists")
  if all(isinstance(t, (int, np.integer)) for t in prompts):
    raise InputError("prompts must be a list of token-id lists (got a flat list: wrap it in [])")
  out = []
  for i, p in enumerate(prompts):
    if hasattr(p, "tolist"):                      # numpy / jax arrays
      p = p.tolist()
    if not isinstance(p, (list, tuple, range)) or not all(is_int(t) for t in p):
      raise InputError(f"prompt {i} must be a list of integer token ids, got {p!r:.80}")
    p = [int(t) for t in p]
    if not p:
      raise InputError(f"prompt {i} is empty")
    bad = [t for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
      raise InputError(f"prompt {i} has token id {bad[0]} outside the vocabulary "
                       f"[0, {cfg.vocab_size})")
    out.append(p)
  return out


def _seeds(seed, batch: int) -> np.ndarray:
  """[B] int32 seeds: any Python / numpy integer, taken modulo 2**32 (so 2**31, 2**40 or a
  getrandbits(32) value work; seeds within int32 are unchanged)."""
  seed = _python(seed)                         # numpy / jax arrays (0-d: one seed)
  if is_int(seed):
    seed = [int(seed)] * batch
  if isinstance(seed, (str, bytes)):           # iterable, but not ints
    raise InputError(f"seed must be an int or one int per prompt ({batch}), got {seed!r}")
  if hasattr(seed, "__iter__"):
    seed = list(seed)       # once: a generator or map would be empty for the bool/float check
  try:
    seeds = np.asarray([int(s) % 2 ** 32 for s in seed], np.uint32).view(np.int32)
  except (TypeError, ValueError):
    raise InputError(f"seed must be an int or one int per prompt ({batch}), "
                     f"got {seed!r}") from None
  if seeds.shape != (batch,) or any(isinstance(s, (bool, float)) for s in seed):
    raise InputError(f"seed must be an int or one int per prompt ({batch}), got {seed!r}")
  return seeds


def start(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], *,
          max_new_tokens: int = 128, sampling: SamplingConfig | None = None,
          seed: int | Sequence[int] = 0, stop_tokens: Sequence[int] | None = None,
          method: str | DecodeMethod = "dense", cache_size: int | None = None,
          prefill_chunk: int = 256, wait_for_prefill: bool = False
          ) -> tuple[DecodeState, "Run"]:
  """Validate, prefill and attach the method: the state the decode loop starts from (the
  keywords are `generate`'s). By default nothing waits for the device (a caller may queue it
  behind slices of a running batch); `wait_for_prefill` blocks until the prefill has run before
  the method's init, whose first call compiles: generate and stream do, so that compile does not
  overlap the prefill they time (its whole compile time is taken off the wall time: a first call
  of a method reported 0.02 s for a 0.24 s prefill)."""
  if sampling is not None and not isinstance(sampling, SamplingConfig):
    raise InputError(f"sampling must be a SamplingConfig (or None: greedy), got "
                     f"{type(sampling).__name__} {sampling!r}")
  # Greedy ignores top_k / top_p: one static config for all of them (no recompilation).
  sampling = SamplingConfig() if sampling is None or sampling.greedy else sampling
  if not is_int(max_new_tokens) or max_new_tokens < 1:
    raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  if not is_int(prefill_chunk) or prefill_chunk < 1 or prefill_chunk & (prefill_chunk - 1):
    raise InputError(f"prefill_chunk must be a power of two, got {prefill_chunk!r}")
  rows = _check_prompts(cfg, prompts)
  method = get_method(method)
  own = target_params(without_draft(params))
  try:                            # hand-built params: a missing or misshapen tensor by name
    check_params(cfg, own)
  except CheckpointError as e:
    raise InputError(f"params do not fit the config: {e}") from None
  check_params_dtype(cfg, own)                       # before prefill compiles anything
  stop_ids = stop_id_tuple(cfg.eos_token_ids if stop_tokens is None else stop_tokens,
                           "stop_tokens")
  if stop_tokens is not None:
    bad = [t for t in stop_ids if not 0 <= t < cfg.vocab_size]
    if bad:
      raise InputError(f"stop token {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
  lengths = np.array([len(p) for p in rows], np.int32)
  capacity = method_capacity(cfg, params, method, int(lengths.max()), int(max_new_tokens),
                             cache_size)
  check_run_fits(cfg, method, len(rows), capacity, like=params["embed"],
                 cache_sharding=cache_sharding(cfg, params))
  bucket = prompt_bucket(int(lengths.max()))
  padded = np.zeros((len(rows), bucket), np.int32)
  for i, p in enumerate(rows):
    padded[i, : len(p)] = p
  b = len(rows)
  ctx = StepContext(sampling=sampling, stop_ids=stop_ids)
  # A draft the params carry (`gptq.with_draft`) is read only by the method's init (QuantSpec
  # moves it into the state); prefill and the loop get the params without it, so jit does not
  # compile them again for that params structure. A draft model (`speculative.with_draft_model`)
  # is read by the loop, which gets it; prefill does not.
  cache = empty_cache(cfg, b, capacity, params)      # where the params are (`cache_sharding`)
  state = prefill(cfg, own, cache, padded, lengths,
                  np.full((b,), max_new_tokens, np.int32), _seeds(seed, b),
                  chunk=min(prefill_chunk, bucket),
                  sampling=sampling, stop_ids=stop_ids)
  if wait_for_prefill:
    jax.block_until_ready(state)
  state = init_method(cfg, params, state, method=method, ctx=ctx)
  return state, Run(cfg, method, ctx, method.max_steps(int(max_new_tokens)))


@dataclasses.dataclass(frozen=True)
class Run:
  """What the decode loop needs besides the state (all static)."""
  cfg: ModelConfig
  method: DecodeMethod
  ctx: StepContext
  max_steps: int

  def advance(self, params: Params, state: DecodeState, steps: int | None = None) -> DecodeState:
    """Run the loop until every row is done, or for at most `steps` more iterations (an integer,
    not a traced value; taken as given, not capped). The default bound is enough for every row
    to finish: max_steps, or the method's worst case for the row with the most tokens still to
    make, if more (a request inserted with a larger max_new_tokens than this run's,
    `serving.insert_row`). Bounds count from the state's current step, so inserted rows get a
    full budget."""
    check_state(state, "Run.advance's state")
    if isinstance(steps, jax.core.Tracer):
      raise InputError("steps is traced: Run.advance takes a Python int (or a concrete integer "
                       "scalar) for it; for a bound computed inside jit call "
                       "sparsedec.decode.loop.decode with that many steps")
    if steps is not None and not is_int(steps) and getattr(steps, "shape", None) == () and (
        np.issubdtype(steps.dtype, np.integer)):
      steps = int(steps)                       # a 0-d numpy / jax integer array
    if steps is not None and (not is_int(steps) or steps < 1):
      raise InputError(f"steps must be None or an integer >= 1, got {steps!r}")
    if state.built_for is not None and state.built_for != (self.method, self.ctx):
      raise InputError(f"the state was built for {describe_build(state.built_for)}, this run is "
                       f"for {describe_build((self.method, self.ctx))}: advance a state with the "
                       f"Run that api.start returned with it")
    k, cfg = state.cache.k, self.cfg                  # per layer [B, Hkv, S, D]
    if state.built_for is not None and (
        len(k) != cfg.num_layers or (k[0].shape[1], k[0].shape[3], jnp.dtype(k[0].dtype))
        != (cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))):
      raise InputError(f"the state's cache is {len(k)} layers of {k[0].dtype}[B, {k[0].shape[1]}, "
                       f"S, {k[0].shape[3]}], this run's model {cfg.num_layers} layers of "
                       f"{cfg.dtype}[B, {cfg.num_kv_heads}, S, {cfg.head_dim}]: the state was "
                       f"started for another model; advance it with the Run that api.start "
                       f"returned with it")
    check_params_dtype(cfg, target_params(without_draft(params)), "Run.advance's params")
    if steps is None:
      if isinstance(state.done, jax.core.Tracer):
        raise InputError("Run.advance(params, state) inside jit cannot read the rows' token "
                         "counts to size its bound: pass steps=N (a Python int) when tracing it")
      limits, num, done = jax.device_get((state.limits, state.num_tokens, state.done))
      left = int(np.max(np.where(done, 0, limits - num), initial=0))             # [B] -> []
      budget = max(self.max_steps, self.method.max_steps(max(left, 1)))
    else:
      budget = int(steps)
    # The bound is a count of iterations from the state's step (`decode`; at most int32's top):
    # with `steps` given, nothing is read back, so a caller can queue several slices without
    # waiting for the first.
    count = np.int32(min(budget, np.iinfo(np.int32).max))
    return decode(self.cfg, without_draft(params), state, beside_step(state, count),
                  method=self.method, ctx=self.ctx)


def collect(state: DecodeState, stop_ids: tuple[int, ...]) -> tuple[list[list[int]], list[bool]]:
  """Each row's generated token ids so far (a final stop token included) and whether the row
  ended on one of `stop_ids` (pass `run.ctx.stop_ids`). Reads the state back from the device."""
  tokens, num, plen = jax.device_get((state.tokens, state.num_tokens, state.prompt_lengths))
  generated = [tokens[i, plen[i]: num[i]].tolist() for i in range(tokens.shape[0])]
  return generated, [bool(g) and g[-1] in stop_ids for g in generated]


def method_stats(method: DecodeMethod, state: DecodeState,
                 rows: Sequence[int] | None = None) -> dict:
  """The method's figures (tau-like acceptance counters, ...), {} when it reports none: of
  every row (rows None), or of `rows` alone (distinct row indices of the state's batch), their
  counters summed and per-step figures over their active steps. In a serving batch,
  `rows=[r]` gives one request's figures: read them when the row finishes, before insert_row
  reuses it (the new request's counters replace the row's). Figures that are the batch's
  (knobs, QuantSpec's cache and draft weight bytes) are the same whatever the rows. Bad rows
  (not integers, outside the batch, repeated, none) are refused by name; so are rows for a
  user method whose stats(state) takes none (rows=None still calls it as stats(state))."""
  stats = getattr(method, "stats", None)
  if rows is None:
    return dict(stats(state)) if stats is not None else {}
  rows = [int(r) for r in row_index(rows, state.batch_size)]        # bad rows, for any method
  if stats is None:
    return {}
  if not stats_take_rows(method):
    raise InputError(f"method {getattr(method, 'name', type(method).__name__)!r}'s stats(state) "
                     f"takes no rows: it reports the whole batch only (pass rows=None, or give "
                     f"its stats a rows=None parameter)")
  return dict(stats(state, rows=rows))


def stats_take_rows(method: DecodeMethod) -> bool:
  """Whether the method's `stats` takes `rows` (a parameter of that name, or **kwargs): the
  library's methods do; a user method written for stats(state) alone may not."""
  stats = getattr(method, "stats", None)
  try:
    params = inspect.signature(stats).parameters.values()
  except (TypeError, ValueError):        # no stats, or a callable without a signature
    return False
  return any((p.name == "rows" and p.kind != p.POSITIONAL_ONLY) or p.kind == p.VAR_KEYWORD
             for p in params)


def generate(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int = 128, sampling: SamplingConfig | None = None,
             seed: int | Sequence[int] = 0, stop_tokens: Sequence[int] | None = None,
             method: str | DecodeMethod = "dense", cache_size: int | None = None,
             prefill_chunk: int = 256, return_state: bool = False) -> GenerationResult:
  """Generate up to `max_new_tokens` per prompt (a batch of any size, any prompt lengths).

  Greedy unless `sampling` has a temperature > 0. `seed`: one int for all rows (each row
  gets it: equal prompts give equal samples) or one per row.
  `stop_tokens` default to the model's EOS ids; pass () to never stop early. `method`: a name
  ("dense", "lookahead", "fafo", "quantspec") or a method object
  (`sparsedec.decode.methods.get_method(name, **knobs)`).
  `cache_size`: the KV cache capacity in tokens (default: the padded prompt length plus
  max_new_tokens, rounded up); it must hold the longest prompt plus max_new_tokens.
  `prefill_chunk`: the prompts are prefilled in forwards of this many tokens (a power of two; at
  most the padded prompt length, the next power of two >= 16): a smaller chunk lowers prefill's
  peak memory on long prompts; outputs do not depend on it beyond floating-point rounding.
  `return_state`: keep the final DecodeState in the result (`.state`). Everything after prefill
  runs in one jitted while_loop.
  """
  with compile_timer() as prefill_compile:
    t0 = time.perf_counter()
    state, run = start(cfg, params, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                       seed=seed, stop_tokens=stop_tokens, method=method, cache_size=cache_size,
                       prefill_chunk=prefill_chunk, wait_for_prefill=True)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
  with compile_timer() as decode_compile:
    state = run.advance(params, state)
    jax.block_until_ready(state)
    t2 = time.perf_counter()
  return _result(state, run, prefill_seconds=t1 - t0 - prefill_compile[0],
                 decode_seconds=t2 - t1 - decode_compile[0],
                 compile_seconds=prefill_compile[0] + decode_compile[0],
                 return_state=return_state)


def _result(state: DecodeState, run: Run, *, prefill_seconds: float, decode_seconds: float,
            compile_seconds: float, return_state: bool = False) -> GenerationResult:
  """The GenerationResult of a finished (or stopped) state."""
  generated, stopped = collect(state, run.ctx.stop_ids)
  return GenerationResult(
      tokens=generated, prompt_lengths=[int(x) for x in jax.device_get(state.prompt_lengths)],
      stopped=stopped, steps=int(jax.device_get(state.step)),
      active_steps=[int(a) for a in jax.device_get(state.active_steps)],
      prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
      compile_seconds=compile_seconds, state=state if return_state else None,
      method_stats=method_stats(run.method, state),
      row_method_stats=[method_stats(run.method, state, rows=[r])
                        for r in range(state.batch_size)] if stats_take_rows(run.method) else [])


def stream(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], *,
           interval: int = 8, return_state: bool = False,
           **kwargs) -> Generator[list[list[int]], None, GenerationResult]:
  """Like `generate` (the same arguments), yielding each row's newly generated tokens: first
  prefill's token, then after every `interval` loop steps (the loop runs on device in slices; no
  host round trip inside a slice); a row with nothing new gets []. A row's yielded lists joined
  are generate's tokens for the same call. Nothing runs before the first next(), and nothing
  after a consumer stops (a break, close()): the run ends there, without a result.
  The generator's return value (`StopIteration.value`, or `result = yield from stream(...)`) is
  the run's GenerationResult; its decode_seconds time the slices only, not what the caller does
  between them."""
  if not is_int(interval) or interval < 1:
    raise InputError(f"interval must be an integer >= 1, got {interval!r}")
  with compile_timer() as prefill_compile:
    t0 = time.perf_counter()
    state, run = start(cfg, params, prompts, wait_for_prefill=True, **kwargs)
    jax.block_until_ready(state)
    prefill_seconds = time.perf_counter() - t0 - prefill_compile[0]
  decode_seconds, compile_seconds = 0.0, prefill_compile[0]
  seen = [0] * len(prompts)
  while True:
    generated, _ = collect(state, run.ctx.stop_ids)
    yield [g[s:] for g, s in zip(generated, seen)]
    seen = [len(g) for g in generated]
    if bool(jax.device_get(state.done).all()) or int(jax.device_get(state.step)) >= run.max_steps:
      return _result(state, run, prefill_seconds=prefill_seconds,
                     decode_seconds=decode_seconds, compile_seconds=compile_seconds,
                     return_state=return_state)
    with compile_timer() as slice_compile:
      t0 = time.perf_counter()
      state = run.advance(params, state, interval)
      jax.block_until_ready(state)
      decode_seconds += time.perf_counter() - t0 - slice_compile[0]
    compile_seconds += slice_compile[0]
