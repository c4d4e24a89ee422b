"""Insert a separately prefilled request into a free row of a running state."""

from __future__ import annotations

import operator
import re

import jax
import pytest

import sparsedec
from sparsedec.decode import api
from sparsedec.decode.serving import insert_row


def test_inserted_request_generates_what_it_would_alone(stories):
  cfg, params, tok = stories
  kw = dict(max_new_tokens=24, stop_tokens=(), cache_size=128)
  first = [tok.encode("Once upon a time"), tok.encode("The little dog")]
  later = [tok.encode("Lily and Tom went to the park to play"), tok.encode("One day")]
  state, run = api.start(cfg, params, first, **kw)
  state = run.advance(params, state)                     # both rows finish
  assert bool(state.done.all())
  compiles = []
  for i, (row, prompt) in enumerate(zip((1, 0), later)):
    request, _ = api.start(cfg, params, [prompt], **kw)
    if i == 1:
      jax.monitoring.register_event_duration_secs_listener(
          lambda event, d, **k: compiles.append(event) if "backend_compile" in event else None)
    state = insert_row(state, request, row)
  jax.monitoring.clear_event_listeners()
  assert compiles == [], "a second insert recompiled"
  state = run.advance(params, state, 100)
  tokens, _ = api.collect(state, ())
  for row, prompt in zip((1, 0), later):
    alone = sparsedec.generate(cfg, params, [prompt], **kw).tokens[0]
    assert tokens[row] == alone


def test_insert_rejects_mismatched_states(stories):
  cfg, params, tok = stories
  state, _ = api.start(cfg, params, [[1, 2], [3, 4]], max_new_tokens=4, cache_size=128)
  other, _ = api.start(cfg, params, [[5, 6]], max_new_tokens=4, cache_size=256)
  with pytest.raises(sparsedec.InputError, match="cache capacities differ"):
    insert_row(state, other, 0)
  two, _ = api.start(cfg, params, [[5], [6]], max_new_tokens=4, cache_size=128)
  with pytest.raises(sparsedec.InputError, match="batch size 1"):
    insert_row(state, two, 0)
  one, _ = api.start(cfg, params, [[5]], max_new_tokens=4, cache_size=128)
  for row in (2, -1):           # -1 is no Python-style last row: the write would clamp to row 0
    with pytest.raises(sparsedec.InputError, match=f"row {row} is outside"):
      insert_row(state, one, row, replace_running=True)
  # Both rows are still decoding: inserting would drop a running request unless asked to.
  assert not bool(state.done.any())
  with pytest.raises(sparsedec.InputError, match=r"row 1 is still decoding.*replace_running"):
    insert_row(state, one, 1)
  state = insert_row(state, one, 1, replace_running=True)
  assert state.prompt_lengths.tolist() == [2, 1]


def test_a_request_of_another_dtype_is_refused_naming_the_model(stories):
  """The message told the user to use the same max_new_tokens, which a request may choose."""
  from sparsedec.model.params import cast_params
  cfg, params, tok = stories
  state, _ = api.start(cfg, params, [[1, 2]], max_new_tokens=1, cache_size=128)
  request, _ = api.start(cfg.replace(dtype="bfloat16"), cast_params(params, "bfloat16"), [[5]],
                         max_new_tokens=3, cache_size=128)
  with pytest.raises(sparsedec.InputError, match=r"cache.k\[0\] is bfloat16.*float32") as err:
    insert_row(state, request, 0)
  assert "same model (config, dtype), cache_size and method" in str(err.value)
  assert "max_new_tokens" not in str(err.value)


def test_quantspec_insert_keeps_the_shared_draft_weights(stories):
  """QuantSpec's extras hold its 4-bit draft weights, the same for every row (not batch-major):
  an insert leaves them as they are (a per-row copy wrote the request's row 0 into row `row` of
  every weight), the inserted row drafts as it would alone, and an int8 state (no dense cache)
  with another quantized capacity is refused by name."""
  import numpy as np
  from sparsedec.decode.quantspec import QuantSpec
  cfg, params, tok = stories
  method = QuantSpec(gamma=3, quant_group=16, weight_group=32)
  kw = dict(max_new_tokens=40, stop_tokens=(), cache_size=128, method=method)
  state, run = api.start(cfg, params, [tok.encode("Once upon a time"), tok.encode("The dog")],
                         **kw)
  state = run.advance(params, state)
  before = jax.device_get(state.extras.draft_params)
  prompt = tok.encode("Lily and Tom went to the park to play")
  request, _ = api.start(cfg, params, [prompt], **kw)
  state = insert_row(state, request, 1)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.extras.draft_params), before)
  state = run.advance(params, state, 100)
  tokens, _ = api.collect(state, ())
  alone = sparsedec.generate(cfg, params, [prompt], **kw, return_state=True)
  assert tokens[1] == alone.tokens[0]
  assert int(state.extras.drafted[1]) == int(alone.state.extras.drafted[0])
  assert int(state.extras.accepted_drafts[1]) == int(alone.state.extras.accepted_drafts[0])
  other, _ = api.start(cfg, params, [[5, 6]], **{**kw, "cache_size": 256})
  with pytest.raises(sparsedec.InputError,
                     match=r"request state's .* start both with the same model .*cache_size"):
    insert_row(state, other, 0)


def test_each_rows_quantspec_figures_are_its_request_s_alone_before_and_after_an_insert(stories):
  """Per-row figures (row_method_stats, api.method_stats(rows=[r]), row_tau) of a QuantSpec batch
  of two prompts are each prompt's decoded alone and add up to the batch's (the drafted and
  accepted counts exactly); stats only summed every row, so a serving stack could not report one
  request's acceptance. A finished row's figures, read before its row is reused, are its
  request's; after an insert that row reports the new request's, as it would alone, and the
  other row's stay its own. The cache bytes stay the batch's. The previous test's method, cache
  and 40 tokens (its compiles, B = 2 and 1)."""
  from sparsedec.decode.quantspec import QuantSpec
  import row_figures
  cfg, params, tok = stories
  method = QuantSpec(gamma=3, quant_group=16, weight_group=32)
  kw = dict(max_new_tokens=40, stop_tokens=(), cache_size=128)
  batch_wide = ("quantized_cache_bytes", "dense_cache_bytes", "cache_bytes",
                "dense_equivalent_cache_bytes")
  batch = row_figures.assert_rows_are_their_prompts_alone(
      cfg, params, [tok.encode("Once upon a time"), tok.encode("The dog")], method,
      ("accepted_drafts_per_step",), batch_wide=batch_wide, **kw)
  for key in ("drafted_tokens", "accepted_drafts"):
    assert sum(m[key] for m in batch.row_method_stats) == batch.method_stats[key], key
  state = batch.state
  prompt = tok.encode("Lily and Tom went to the park to play")
  request, run = api.start(cfg, params, [prompt], method=method, **kw)
  state = insert_row(state, request, 1)
  state = run.advance(params, state)
  alone = sparsedec.generate(cfg, params, [prompt], method=method, **kw)
  own = lambda stats: {k: v for k, v in stats.items() if k not in batch_wide}  # noqa: E731
  assert own(api.method_stats(method, state, rows=[1])) == own(alone.method_stats)
  assert own(alone.method_stats) != own(batch.row_method_stats[1])   # the row's figures changed
  assert api.method_stats(method, state, rows=[0]) == batch.row_method_stats[0]


def test_a_quantspec_request_started_with_request_params_takes_the_batch_s_draft(stories,
                                                                                 monkeypatch):
  """Each QuantSpec request api.start-ed for serving quantized the draft weights again, which
  insert_row then dropped (SmolLM2 on a CPU: api.start 1.7 s, 0.4 s without): with
  request_params its init takes the running batch's draft (nothing quantized), and the inserted
  row decodes as it would alone."""
  import sparsedec.decode.quantspec as quantspec
  from sparsedec.decode.serving import request_params
  cfg, params, tok = stories
  method = quantspec.QuantSpec(gamma=3, quant_group=16, weight_group=32)
  kw = dict(max_new_tokens=40, stop_tokens=(), cache_size=128, method=method)
  state, run = api.start(cfg, params, [tok.encode("Once upon a time"), tok.encode("The dog")],
                         **kw)
  state = run.advance(params, state)
  prompt = tok.encode("Lily and Tom went to the park to play")

  def no_quantizing(*args, **kwargs):
    raise AssertionError("the request's init quantized the draft weights again")

  with monkeypatch.context() as patch:
    patch.setattr(quantspec, "quantize_params", no_quantizing)
    request, _ = api.start(cfg, request_params(params, state), [prompt], **kw)
  state = insert_row(state, request, 1)
  tokens, _ = api.collect(run.advance(params, state, 100), ())
  assert tokens[1] == sparsedec.generate(cfg, params, [prompt], **kw).tokens[0]
  assert request_params(params, request) is not params
  dense, _ = api.start(cfg, params, [prompt], max_new_tokens=4, cache_size=128)
  assert request_params(params, dense) is params


@pytest.mark.parametrize("policy", ["quest", "snapkv", "lookahead"])
def test_insert_with_per_layer_policy_states(stories, policy):
  """FAFO's Quest and SnapKV states are per layer first ([L, B, ...]): an insert copies the
  request's row along axis 1 (a copy along axis 0 overwrote layer `row` of every row, and the
  shape check then refused the insert), leaving the other rows' states as they were; and the
  inserted row generates what it would alone (Lookahead too)."""
  import numpy as np
  from sparsedec.compress import Quest, SnapKV
  from sparsedec.decode.fafo import Fafo
  from sparsedec.decode.lookahead import Lookahead
  cfg, params, tok = stories
  method = (Lookahead() if policy == "lookahead" else Fafo(subsequences=4, length=3, candidates=3,
            policy=(Quest if policy == "quest" else SnapKV)(budget_blocks=3, block_size=16)))
  kw = dict(max_new_tokens=24, stop_tokens=(), cache_size=128, method=method)
  state, run = api.start(cfg, params, [tok.encode("Once upon a time"), tok.encode("The dog")],
                         **kw)
  state = run.advance(params, state)
  prompt = tok.encode("Lily and Tom went to the park to play")
  request, _ = api.start(cfg, params, [prompt], **kw)
  if policy != "lookahead":
    before = jax.device_get(state.extras.policy_state.tables)             # [L, B, Hkv, NB]
    want = jax.device_get(request.extras.policy_state.tables)
  state = insert_row(state, request, 1)
  if policy != "lookahead":
    tables = jax.device_get(state.extras.policy_state.tables)
    np.testing.assert_array_equal(tables[:, 0], before[:, 0])
    np.testing.assert_array_equal(tables[:, 1], want[:, 0])
  state = run.advance(params, state, 100)
  tokens, _ = api.collect(state, ())
  assert tokens[1] == sparsedec.generate(cfg, params, [prompt], **kw).tokens[0]


def test_advance_runs_an_inserted_longer_request_to_its_end(stories):
  """A request with a larger max_new_tokens than the running batch's (its row limit is its own)
  finishes: advance(steps=N) runs N steps (it capped N at the run's max_steps without a word,
  leaving the row unfinished), and advance() without steps runs until every row is done."""
  cfg, params, tok = stories
  kw = dict(stop_tokens=(), cache_size=128)
  prompt = tok.encode("Lily and Tom went to the park")
  alone = sparsedec.generate(cfg, params, [prompt], max_new_tokens=40, **kw).tokens[0]
  for steps in (100, None):
    state, run = api.start(cfg, params, [tok.encode("Once upon a time"), tok.encode("The dog")],
                           max_new_tokens=8, **kw)
    state = run.advance(params, state)
    assert run.max_steps == 8 and bool(state.done.all())
    request, _ = api.start(cfg, params, [prompt], max_new_tokens=40, **kw)
    state = insert_row(state, request, 1)
    state = run.advance(params, state, steps)
    tokens, _ = api.collect(state, ())
    assert bool(state.done[1]), f"advance(steps={steps}) left the inserted row unfinished"
    assert tokens[1] == alone
  state = run.advance(params, state, 2 ** 40)           # past int32: the bound is clamped
  assert bool(state.done.all())


def test_a_state_of_another_method_or_settings_is_refused_by_name(stories):
  """Run.advance with a state started for another method failed inside the trace ('NoneType'
  object has no attribute 'pool', a reshape error for another Lookahead window) or decoded it
  silently under the run's method; insert_row took a request started with other sampling or
  stop tokens and decoded all but its first token under the running batch's. Both now name
  the two builds."""
  from sparsedec.decode.lookahead import Lookahead
  cfg, params, tok = stories
  kw = dict(max_new_tokens=4, cache_size=128)
  dense, dense_run = api.start(cfg, params, [[1, 2]], **kw)
  ahead, ahead_run = api.start(cfg, params, [[1, 2]], method=Lookahead(), **kw)
  narrow, _ = api.start(cfg, params, [[1, 2]], method=Lookahead(window=3), **kw)
  for run, state in ((ahead_run, dense), (dense_run, ahead), (ahead_run, narrow)):
    with pytest.raises(sparsedec.InputError,
                       match=r"state was built for method .*this run is for method"):
      run.advance(params, state)
  state = dense_run.advance(params, dense)
  assert bool(state.done.all())
  sampled, _ = api.start(cfg, params, [[3]], sampling=sparsedec.SamplingConfig(temperature=0.8),
                         **kw)
  no_stops, _ = api.start(cfg, params, [[3]], stop_tokens=(), **kw)
  for request, what in ((sampled, "temperature=0.8"), (no_stops, r"stop_tokens \(\)")):
    with pytest.raises(sparsedec.InputError, match=f"request state was built for .*{what}.*"
                       f"running state for .*same method, sampling and stop_tokens"):
      insert_row(state, request, 0)
  same, _ = api.start(cfg, params, [[3]], **kw)
  assert insert_row(state, same, 0).prompt_lengths.tolist() == [1]


def test_the_same_stop_tokens_in_another_order_are_the_same_build(stories):
  """stop_tokens are a set: a request started with them in another order (or repeated) is
  inserted, not refused as another build, and shares the running batch's compiled loop."""
  cfg, params, tok = stories
  kw = dict(max_new_tokens=4, cache_size=128)
  state, run = api.start(cfg, params, [[1, 2], [3]], stop_tokens=[7, 2], **kw)
  request, request_run = api.start(cfg, params, [[5, 6]], stop_tokens=(2, 7, 7), **kw)
  assert request_run.ctx == run.ctx and run.ctx.stop_ids == (2, 7)
  state = insert_row(state, request, 1, replace_running=True)
  state = run.advance(params, state)
  assert bool(state.done.all())


def test_insert_row_takes_only_an_integer_row(stories):
  """A float row was truncated to an int and the request written there (row=0.9 into row 0),
  with replace_running=True without a word; numpy and 0-d jax integers are rows."""
  import jax.numpy as jnp
  import numpy as np
  cfg, params, _ = stories
  kw = dict(max_new_tokens=4, cache_size=128)
  state, _ = api.start(cfg, params, [[1, 2], [3, 4]], **kw)
  request, _ = api.start(cfg, params, [[5, 6, 7]], **kw)
  for row in (0.9, 1.5, True, np.bool_(False), "1", np.array([1]), jnp.array(1.0)):
    pattern = "row must be an integer .*got " + re.escape(repr(row))
    with pytest.raises(sparsedec.InputError, match=pattern):
      insert_row(state, request, row, replace_running=True)
  for row, lengths in ((np.int64(1), [2, 3]), (jnp.int32(0), [3, 3]), (np.array(1), [3, 3])):
    state = insert_row(state, request, row, replace_running=True)
    assert state.prompt_lengths.tolist() == lengths


def test_advance_by_a_given_number_of_steps_reads_nothing_back(stories):
  """advance(steps=N) forms its bound on the device: it read state.step back to the host, so a
  serving loop could not queue a second slice before the first had finished. Traced under jit
  (where any read of a device value to the host fails), slices of 4 steps give the tokens of one
  uninterrupted run."""
  cfg, params, tok = stories
  kw = dict(max_new_tokens=16, stop_tokens=(), cache_size=128)
  prompts = [tok.encode("Once upon a time"), tok.encode("The little dog")]
  state, run = api.start(cfg, params, prompts, **kw)
  advance_4 = jax.jit(lambda p, s: run.advance(p, s, 4))
  for _ in range(4):
    state = advance_4(params, state)
  assert bool(state.done.all()) and int(state.step) == 15   # the prefill made the first token
  assert api.collect(state, ())[0] == sparsedec.generate(cfg, params, prompts, **kw).tokens


def test_advance_traced_without_steps_is_refused_by_name(stories):
  """Run.advance may be traced inside a caller's jit with steps=N; without steps it reads the
  token counts back, which under jit was a TracerArrayConversionError about `s.done`, not a
  word about passing steps."""
  cfg, params, _ = stories
  state, run = api.start(cfg, params, [[1], [5, 6]], max_new_tokens=4, cache_size=128)
  with pytest.raises(sparsedec.InputError, match="pass steps=N"):
    jax.jit(lambda p, s: run.advance(p, s))(params, state)
  state = jax.jit(lambda p, s: run.advance(p, s, steps=8))(params, state)
  assert bool(state.done.all())


def test_a_warm_serving_loop_copies_nothing_implicitly(stories):
  """A warm serving loop runs under jax.transfer_guard("disallow"), as a serving stack checks
  that nothing is copied behind its back: advance's bound and insert_row's row were numpy /
  eager scalars, an implicit host-to-device copy on every call (refused there), and
  insert_row's done check an implicit read. They are explicit now, put beside the state."""
  cfg, params, tok = stories
  kw = dict(max_new_tokens=8, stop_tokens=(), cache_size=128)
  state, run = api.start(cfg, params, [tok.encode("Once upon a time"), [1, 5]], **kw)
  requests = [api.start(cfg, params, [tok.encode("The little dog")], **kw)[0] for _ in range(2)]
  state = insert_row(run.advance(params, run.advance(params, state, 2)), requests[0], 0)
  jax.block_until_ready(state)                                   # every program compiled
  with jax.transfer_guard("disallow"):
    state = run.advance(params, state, 2)
    state = run.advance(params, state)
    state = insert_row(state, requests[1], 1)
    state = run.advance(params, state)
    tokens, _ = api.collect(state, ())
  assert tokens[1] == sparsedec.generate(cfg, params, [tok.encode("The little dog")],
                                         **kw).tokens[0]


def test_advance_keeps_decoding_past_int32_steps(stories):
  """A serving state's step is one counter for the batch that inserts leave as it is; a server
  that had run 2**31 - 1 loop iterations got an absolute bound saturated at int32's top, and
  every later advance returned at once: the inserted row never finished, silently. The bound
  counts iterations from the state's step, so the step wraps and decoding goes on."""
  import jax.numpy as jnp
  cfg, params, tok = stories
  kw = dict(max_new_tokens=8, stop_tokens=(), cache_size=128)
  state, run = api.start(cfg, params, [[1, 2, 3], [4]], **kw)
  state = run.advance(params, state)
  state = state.replace(step=jnp.int32(2 ** 31 - 3))       # a long-running server
  prompt = tok.encode("The little dog")
  for steps in (4, None):
    request, _ = api.start(cfg, params, [prompt], **kw)
    state = insert_row(state, request, 0)
    state = run.advance(params, state, steps)
    if steps is not None:
      assert int(jax.device_get(state.num_tokens[0] - state.prompt_lengths[0])) == 5
      state = run.advance(params, state)
    assert bool(state.done.all())
    assert api.collect(state, ())[0][0] == sparsedec.generate(cfg, params, [prompt], **kw).tokens[0]


def test_a_state_that_is_not_a_decode_state_is_refused_by_name(stories):
  """insert_row given api.start's (state, run) pair or a GenerationResult, and Run.advance given
  its arguments swapped, failed on AttributeErrors ("'tuple' object has no attribute
  'batch_size'", "'dict' object has no attribute 'built_for'")."""
  cfg, params, _ = stories
  kw = dict(max_new_tokens=2, cache_size=128)
  state, run = api.start(cfg, params, [[1, 2], [3]], **kw)
  pair = api.start(cfg, params, [[5, 6]], **kw)
  result = sparsedec.generate(cfg, params, [[5, 6]], **kw)
  cases = ((lambda: insert_row(state, pair, 0), r"request must be a Decode.*got tuple.*unpack"),
           (lambda: insert_row(pair, pair[0], 0), r"insert_row's state must be .*got tuple"),
           (lambda: insert_row(state, result, 0),
            r"got GenerationResult.*\.state .*return_state=True"),
           (lambda: run.advance(state, params), r"advance's state must be .*got dict.*params"),
           (lambda: run.advance(params, pair), r"advance's state must be .*got tuple.*unpack"))
  for call, pattern in cases:
    with pytest.raises(sparsedec.InputError, match=pattern):
      call()
  state = run.advance(params, state)
  assert bool(state.done.all())


def test_a_state_of_another_model_is_refused_by_name(stories):
  """Run.advance checked the state's method, sampling and stop tokens, not its model: a bfloat16
  model's state advanced by a float32 run of the same method decoded silently, a float32 model
  over a bfloat16 cache."""
  from sparsedec.model.params import cast_params
  cfg, params, _ = stories
  kw = dict(max_new_tokens=4, cache_size=128)
  half, _ = api.start(cfg.replace(dtype="bfloat16"), cast_params(params, "bfloat16"), [[1, 2]],
                      **kw)
  state, run = api.start(cfg, params, [[1, 2]], **kw)
  assert half.built_for == state.built_for
  with pytest.raises(sparsedec.InputError,
                     match=r"state's cache is 5 layers of bfloat16.*run's model 5 layers of "
                           r"float32.*another model"):
    run.advance(params, half)
  assert bool(run.advance(params, state).done.all())


def test_a_policy_state_without_a_batch_axis_is_named_with_batch_axes(stories):
  """A user's compression policy whose state is a 0-d array (a step counter) or [L, B] without
  its class naming the axis: insert_row raised a bare IndexError ('tuple index out of range')
  for the first and told the user to 'start both with the same model' for the second."""
  import dataclasses

  import jax.numpy as jnp

  from sparsedec.compress import StreamingLLM
  from sparsedec.decode.fafo import Fafo
  cfg, params, tok = stories

  @dataclasses.dataclass(frozen=True)
  class Counting:
    budget_blocks: int = 2
    block_size: int = 8
    layers_first: bool = False
    view = StreamingLLM.view

    def init(self, cfg, params, state):
      if self.layers_first:
        return jnp.zeros((cfg.num_layers, state.batch_size), jnp.int32)
      return jnp.int32(0)

    def update(self, pstate, cache, queries):
      return pstate + 1

  prompt = tok.encode("Once upon a time")
  for layers_first, shapes in ((False, r"int32\[\], the running state's int32\[\]"),
                               (True, r"int32\[5, 1\], the running state's int32\[5, 2\]")):
    method = Fafo(subsequences=2, length=2, candidates=2,
                  policy=Counting(layers_first=layers_first))
    kw = dict(max_new_tokens=2, cache_size=64, method=method, stop_tokens=())
    state, _ = api.start(cfg, params, [prompt] * 2, **kw)
    request, _ = api.start(cfg, params, [prompt], **kw)
    with pytest.raises(sparsedec.InputError,
                       match=r"\.extras\.policy_state \(" + shapes + r"\) has no batch axis 0: "
                             r".*SHARED_FIELDS.*BATCH_AXES"):
      insert_row(state, request, 1, replace_running=True)


def test_params_of_another_dtype_than_the_config_are_refused_by_name(stories):
  """generate / api.start / Run.advance ran float32 params under a bfloat16 config (the forward
  cast them to bf16 each step) and bfloat16 params under a float32 config (fp32 compute on
  bf16-rounded weights) without a word. Refused naming the tensor and both dtypes, before
  anything compiles; a QuantSpec draft the params carry keeps its own dtypes."""
  from sparsedec.model.gptq import with_draft
  from sparsedec.model.params import cast_params
  from sparsedec.model.quant_weights import quantize_params
  cfg, params, _ = stories
  cfg16, params16 = cfg.replace(dtype="bfloat16"), cast_params(params, "bfloat16")
  kw = dict(max_new_tokens=4, cache_size=128)
  for c, p, got, want in [(cfg16, params, "float32", "bfloat16"),
                          (cfg, params16, "bfloat16", "float32"),
                          (cfg16, cast_params(params, "float16"), "float16", "bfloat16")]:
    with api.compile_timer() as compiled:
      with pytest.raises(sparsedec.InputError,
                         match=rf"tensor embed is {got}, the config's dtype is {want}: cast"):
        sparsedec.generate(c, p, [[1, 2]], **kw)
    assert compiled[0] == 0.0
  mixed = {**params16, "final_norm": params["final_norm"]}
  with pytest.raises(sparsedec.InputError, match="tensor final_norm is float32"):
    api.start(cfg16, mixed, [[1, 2]], **kw)
  # The draft's 4-bit linears (uint8 codes, fp16 scales) and its fp32 norms are not the model's.
  draft = quantize_params(params, 32)["layers"]
  state, run = api.start(cfg16, with_draft(params16, draft), [[1, 2]], **kw)
  with pytest.raises(sparsedec.InputError,
                     match=r"Run.advance's params: tensor embed is float32.*bfloat16"):
    run.advance(params, state)
  assert bool(run.advance(params16, state).done.all())


def test_hand_built_params_missing_or_misshapen_are_refused_by_name(stories):
  """Params that do not fit the config (built by hand: the loaders check theirs) ended in a bare
  KeyError: 'embed' or a shape error inside the forward's trace. Refused before anything
  compiles, naming the tensor; 4-bit linears (their shape is the weight's) and a draft the params
  carry still pass."""
  from sparsedec.model.gptq import with_draft
  from sparsedec.model.quant_weights import quantize_params
  cfg, params, _ = stories
  kw = dict(max_new_tokens=2, cache_size=64)
  no_embed = {k: v for k, v in params.items() if k != "embed"}
  layers = [dict(layer) for layer in params["layers"]]
  layers[1]["wo"] = layers[1]["wo"][:, :-1]
  for bad, match in [(no_embed, r"missing tensor embed \(expected shape"),
                     ({**params, "layers": layers[:-1]}, rf"layers: expected {cfg.num_layers} layers"),
                     ({**params, "layers": layers}, r"tensor layers\[1\]\.wo has shape")]:
    with api.compile_timer() as compiled:
      with pytest.raises(sparsedec.InputError, match="params do not fit the config: " + match):
        sparsedec.generate(cfg, bad, [[1, 2]], **kw)
    assert compiled[0] == 0.0
  quantized = quantize_params(params, 32)
  state, _ = api.start(cfg, with_draft(quantized, quantized["layers"]), [[1, 2]], **kw)
  assert state.tokens.shape[0] == 1


def test_a_quantspec_int8_serving_state_saves_and_restores_with_orbax(stories, tmp_path):
  """A serving state checkpointed with orbax mid-run, restored and advanced to the end, gives the
  tokens of the run that was not interrupted. QuantSpec's int8 state held its dropped dense cache
  as zero-capacity arrays, which orbax refuses ('Cannot save arrays with zero size')."""
  import numpy as np
  import orbax.checkpoint as ocp
  from sparsedec.decode.quantspec import QuantSpec
  cfg, params, tok = stories
  method = QuantSpec(gamma=3, quant_group=16, weight_group=32)          # verify_precision="int8"
  state, run = api.start(cfg, params, [tok.encode("Once upon a time")], max_new_tokens=24,
                         stop_tokens=(), cache_size=128, method=method)
  state = run.advance(params, state, 2)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  host = lambda tree: [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(tree)]
  saved = host(state)
  final = run.advance(params, state)                                    # donates state
  want, want_stats = api.collect(final, ())[0], run.method.stats(final)
  restored = checkpointer.restore(tmp_path / "state", abstract)
  # Every field comes back as saved (keys, counters, extras: a field dropped or left at its
  # initial value would not change these greedy tokens), with the state's static build.
  assert restored.built_for == final.built_for
  for path_leaf, got, old in zip(jax.tree_util.tree_flatten_with_path(restored)[0],
                                 host(restored), saved):
    np.testing.assert_array_equal(got, old, err_msg=jax.tree_util.keystr(path_leaf[0]))
  restored = run.advance(params, restored)
  assert api.collect(restored, ())[0] == want
  assert run.method.stats(restored) == want_stats and want_stats["dense_cache_bytes"] == 0
  np.testing.assert_array_equal(restored.active_steps, final.active_steps)


def test_insert_writes_every_per_row_leaf_of_that_row_only(stories):
  """Continuous batching, leaf by leaf: with row 0 still decoding and row 1 done, an insert into
  row 0 is refused (the done check read another row's flag) and one into row 1 writes the
  request's entry of every per-row leaf there (tokens, cache and its lengths, limits, keys,
  Lookahead's n-gram pool and counters: only the loop counter is shared, a pool wrongly marked
  SHARED kept the old row's), leaves row 0's and the step as they were, and restarts that row's
  active_steps alone. A row that is done then counts no more steps while the other decodes, and
  the inserted row counts the steps of its run alone."""
  import numpy as np
  from sparsedec.decode.lookahead import Lookahead
  from sparsedec.decode.serving import _batch_axes
  cfg, params, tok = stories
  kw = dict(stop_tokens=(), cache_size=128, method=Lookahead())
  state, run = api.start(cfg, params, [tok.encode("Once upon a time"), tok.encode("The dog")],
                         max_new_tokens=4, **kw)
  state = run.advance(params, state)
  prompt = tok.encode("Lily and Tom went to the park to play")
  long_request, _ = api.start(cfg, params, [prompt], max_new_tokens=64, **kw)
  state = run.advance(params, insert_row(state, long_request, 0), 2)
  assert jax.device_get(state.done).tolist() == [False, True]
  request, _ = api.start(cfg, params, [tok.encode("One day")], max_new_tokens=6, **kw)
  with pytest.raises(sparsedec.InputError, match="row 0 is still decoding"):
    insert_row(state, request, 0)

  def host(tree):                               # PRNG keys as their data, to compare on the host
    return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x), tree)

  before, want = host(state), host(request)
  state = insert_row(state, request, 1)
  after = host(state)
  axes = _batch_axes(state)
  paths = jax.tree_util.tree_flatten_with_path(after)[0]
  assert [jax.tree_util.keystr(p) for (p, _), a in zip(paths, axes) if a is None] == [".step"]
  assert len(paths) == len(axes) > 10
  for (path, got), old, new, axis in zip(paths, jax.tree.leaves(before), jax.tree.leaves(want),
                                         axes):
    name = jax.tree_util.keystr(path)
    if axis is None:
      np.testing.assert_array_equal(got, old, err_msg=name)
      continue
    np.testing.assert_array_equal(np.take(got, [1], axis), np.take(new, [0], axis), err_msg=name)
    np.testing.assert_array_equal(np.take(got, [0], axis), np.take(old, [0], axis), err_msg=name)
  assert after.active_steps.tolist() == [before.active_steps[0], 0]
  assert not np.array_equal(before.extras.pool.keys[1], want.extras.pool.keys[0])  # a real copy
  state = run.advance(params, state, 1)
  assert jax.device_get(state.active_steps).tolist() == [before.active_steps[0] + 1, 1]
  while not bool(state.done[1]):
    state = run.advance(params, state, 1)
  assert not bool(state.done[0])              # the long row goes on without the finished one
  finished = int(state.active_steps[1])
  state = run.advance(params, state)
  assert bool(state.done.all()) and int(state.active_steps[1]) == finished
  alone = sparsedec.generate(cfg, params, [tok.encode("One day")], max_new_tokens=6, **kw)
  assert api.collect(state, ())[0][1] == alone.tokens[0]
  assert finished == alone.active_steps[0]


def test_a_request_advanced_before_insert_keeps_its_counters(stories):
  """insert_row copies the request's row whole: one advanced alone before it is inserted keeps
  its step count beside its method's counters (active_steps was reset to 0 while Lookahead's
  guess counters came along), so the row finishes with the counts of the run alone."""
  from sparsedec.decode.lookahead import Lookahead
  cfg, params, tok = stories
  kw = dict(stop_tokens=(), cache_size=128, method=Lookahead())
  state, run = api.start(cfg, params, [tok.encode("Once upon a time"), tok.encode("The dog")],
                         max_new_tokens=2, **kw)
  state = run.advance(params, state)
  request, request_run = api.start(cfg, params, [tok.encode("One day")], max_new_tokens=12, **kw)
  request = request_run.advance(params, request, 3)
  assert int(request.active_steps[0]) == 3
  state = run.advance(params, insert_row(state, request, 0))
  alone = sparsedec.generate(cfg, params, [tok.encode("One day")], max_new_tokens=12,
                            return_state=True, **kw).state
  assert api.collect(state, ())[0][0] == api.collect(alone, ())[0][0]
  for name in ("active_steps", "extras.guesses", "extras.hit_steps", "extras.accept_steps",
               "extras.accepted_guesses"):
    got, want = (operator.attrgetter(name)(s) for s in (state, alone))
    assert int(got[0]) == int(want[0]), name


def test_insert_row_traced_inside_a_callers_jit(stories):
  """insert_row_traced in one jitted serving step with the decode: the same state as insert_row
  for a finished row (one compile for every row), the state unchanged and inserted False for a
  running row (unless replace_running) or a row outside the batch, the row-free checks raised at
  trace time, and an inserted request decoding what it would alone."""
  import jax.numpy as jnp
  import numpy as np
  from sparsedec.decode.serving import insert_row_traced
  cfg, params, tok = stories
  kw = dict(max_new_tokens=8, stop_tokens=(), cache_size=128)
  state, run = api.start(cfg, params, [tok.encode("Once upon a time"), tok.encode("The dog")],
                         **kw)
  state = run.advance(params, state)                     # both rows finish
  request, _ = api.start(cfg, params, [tok.encode("One day")], **kw)
  insert = jax.jit(insert_row_traced, static_argnames="replace_running")
  same = lambda a, b: jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.all(x == y)), a, b))  # noqa: E731
  for row in (1, 0):
    got, ok = insert(state, request, row)
    assert bool(ok)
    assert same(got, insert_row(jax.tree.map(jnp.copy, state), request, row))
  assert insert._cache_size() == 1                       # the row is traced
  running, _ = api.start(cfg, params, [[1, 2], [3, 4]], **kw)
  for row, replace in ((0, False), (2, True), (-1, True)):
    got, ok = insert(running, request, row, replace_running=replace)
    assert not bool(ok) and same(got, running)
  got, ok = insert(running, request, 1, replace_running=True)
  assert bool(ok) and got.prompt_lengths.tolist() == [2, 3]
  two, _ = api.start(cfg, params, [[5], [6]], **kw)
  with pytest.raises(sparsedec.InputError, match="batch size 1"):
    insert(state, two, 0)
  with pytest.raises(sparsedec.InputError, match="row must be an integer"):
    insert(state, request, 1.0)
  # One compiled serving step: insert into row 1, then decode every row to its end.
  serve = jax.jit(lambda p, s, r, row: run.advance(p, insert_row_traced(s, r, row)[0], 20),
                  donate_argnums=1)
  tokens, _ = api.collect(serve(params, state, request, np.int32(1)), ())
  assert tokens[1] == sparsedec.generate(cfg, params, [tok.encode("One day")], **kw).tokens[0]
