"""GPTQ for QuantSpec's 4-bit draft (`sparsedec.model.gptq`): RTN exactly when the Hessian is the
identity, a lower output error than RTN on correlated inputs, calibration Hessians equal to a
direct computation across chunk boundaries, and QuantSpec decoding with the draft the params
carry (still token-identical to its INT8 reference; the draft it ran is GPTQ's)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsedec
from sparsedec import prompts as prompt_sets
from sparsedec import testing
from sparsedec.decode import loop
from sparsedec.decode.prefill import prefill
from sparsedec.decode.quantspec import QuantSpec
from sparsedec.errors import InputError
from sparsedec.model import gptq
from sparsedec.model.linear import rms_norm
from sparsedec.model import quant_weights
from sparsedec.model.quant_weights import QUANTIZED_LINEARS, quantize_weight

METHOD = QuantSpec(gamma=3, quant_group=8, weight_group=32)     # stories260K: head_dim 8, Dm 64


def _output_error(q, w, h):
  d = np.asarray(q.dequantize(), np.float64) - w
  return float(np.trace(d.T @ h @ d))


@pytest.mark.parametrize("layout,act_order", [("packed", False), ("int4_t", False),
                                              ("packed", True)])
def test_identity_hessian_gives_rtn_bit_for_bit(layout, act_order):
  """No correlation between inputs: no error moves, so GPTQ's codes, grids and stored bytes are
  RTN's (200 rows: padded to 256 as RTN pads them), in either row order."""
  w = np.random.default_rng(0).normal(size=(200, 128)).astype(np.float32)
  got = gptq.gptq_quantize_weight(w, np.eye(200), group=64, layout=layout, act_order=act_order)
  ref = quantize_weight(jnp.asarray(w), 64, layout)
  for a, b in ((got.codes, ref.codes), (got.scale, ref.scale), (got.zero, ref.zero)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert (got.in_features, got.group, got.layout) == (200, 64, layout)


def test_correlated_inputs_get_a_lower_output_error_than_rtn():
  rng = np.random.default_rng(1)
  w = rng.normal(size=(192, 96)).astype(np.float32)
  x = rng.normal(size=(4000, 192)) @ rng.normal(size=(192, 192)) * 0.3 + rng.normal(
      size=(4000, 192))
  h = x.T @ x
  got = gptq.gptq_quantize_weight(w, h, group=64, act_order=False)
  rtn = quantize_weight(jnp.asarray(w), 64)
  assert _output_error(got, w, h) < 0.7 * _output_error(rtn, w, h)
  # The same grids' semantics: every code in [0, 15] and every weight within its group's range.
  deq = np.asarray(got.dequantize())
  lo = np.repeat(np.asarray(got.zero, np.float32), 64, 0)[:192]
  hi = lo + 15 * np.repeat(np.asarray(got.scale, np.float32), 64, 0)[:192]
  assert np.all((deq >= lo - 1e-6) & (deq <= hi + 1e-6))


def test_act_order_keeps_rtn_grids_and_beats_rtn_on_correlated_inputs():
  """Rows by decreasing H_ii on static grids: the grids are exactly RTN's (so the group layout and
  the kernels' reads are unchanged), the codes are not, and the output error is lower than RTN's.
  Inputs of very unequal scale make the order matter: it differs from the index order."""
  rng = np.random.default_rng(2)
  w = rng.normal(size=(192, 96)).astype(np.float32)
  x = (rng.normal(size=(4000, 192)) @ rng.normal(size=(192, 192)) * 0.3
       + rng.normal(size=(4000, 192))) * rng.uniform(0.1, 3.0, size=192)
  h = x.T @ x
  assert not np.all(np.diff(np.diag(h)) <= 0)
  got = gptq.gptq_quantize_weight(w, h, group=64, act_order=True)
  rtn = quantize_weight(jnp.asarray(w), 64)
  np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(rtn.scale))
  np.testing.assert_array_equal(np.asarray(got.zero), np.asarray(rtn.zero))
  assert not np.array_equal(np.asarray(got.codes), np.asarray(rtn.codes))
  assert _output_error(got, w, h) < 0.7 * _output_error(rtn, w, h)


def test_inputs_never_seen_get_rtn_codes():
  """An input that is always zero (H_ii = 0) gets H_ii = 1: a Hessian of zeros (a linear whose
  calibration inputs were all zero) is the identity, so GPTQ is RTN bit for bit, in either row
  order (left at 0, the damped diagonal was 0 too and the factorization failed)."""
  w = np.random.default_rng(4).normal(size=(128, 64)).astype(np.float32)
  ref = quantize_weight(jnp.asarray(w), 64)
  for act_order in (False, True):
    got = gptq.gptq_quantize_weight(w, np.zeros((128, 128)), group=64, act_order=act_order)
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(ref.codes))


def _textbook_gptq(w, h, group, act_order, damp=0.01):
  """Frantar et al.'s algorithm as written, float64, no lazy blocks: every row's error moves all
  later rows at once. Same grids and code rounding as the library (static RTN grids under
  act_order, else each group's grid from its rows when its first row is reached)."""
  n_in, n_out = w.shape
  w, h = w.astype(np.float64).copy(), h.astype(np.float64).copy()
  h[np.diag_indices(n_in)] += damp * np.mean(np.diag(h))
  grouped = jnp.asarray(w, jnp.float32).reshape(-1, group, n_out)
  zeros, steps = (np.array(x) for x in quant_weights.group_grid(grouped))
  order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(n_in)
  w, h = w[order], h[np.ix_(order, order)]
  u = np.linalg.cholesky(np.linalg.inv(h)).T
  codes = np.zeros((n_in, n_out))
  for i in range(n_in):
    g = order[i] // group
    if not act_order and i % group == 0:
      zeros[g], steps[g] = (np.asarray(x) for x in quant_weights.group_grid(
          jnp.asarray(w[i:i + group], jnp.float32)))
    z, s = zeros[g].astype(np.float64), steps[g].astype(np.float64)
    c = np.clip(np.round((w[i].astype(np.float32) - z.astype(np.float32))
                         / s.astype(np.float32)), 0, 15)
    codes[order[i]] = c
    w[i + 1:] -= np.outer(u[i, i + 1:] / u[i, i], w[i] - (z + c * s))
  return codes, zeros, steps


@pytest.mark.parametrize("act_order,group", [(False, 64), (True, 64), (False, 32)])
def test_device_gptq_equals_the_textbook_algorithm_in_float64(act_order, group):
  """The lazy-block fp32 device computation against the row-by-row float64 algorithm (320 rows:
  three blocks of 128, the last one padded with inert rows): the same grids, the same codes up to
  rare fp32 rounding ties, the same output error."""
  rng = np.random.default_rng(3)
  w = rng.normal(size=(320, 80)).astype(np.float32)
  x = (rng.normal(size=(3000, 320)) @ rng.normal(size=(320, 320)) * 0.3
       + rng.normal(size=(3000, 320))) * rng.uniform(0.2, 2.0, size=320)
  h = x.T @ x
  got = gptq.gptq_quantize_weight(w, h, group=group, act_order=act_order)
  codes, zeros, steps = _textbook_gptq(w, h, group, act_order)
  deq = np.asarray(got.dequantize(), np.float64)
  ref = (np.repeat(zeros.astype(np.float64), group, 0)
         + codes * np.repeat(steps.astype(np.float64), group, 0))
  assert np.mean(deq == ref) > 0.995
  np.testing.assert_allclose(_output_error(got, w, h), float(np.trace((ref - w).T @ h @ (ref - w))),
                             rtol=2e-3)
  if act_order:
    np.testing.assert_array_equal(np.asarray(got.zero), zeros)
    np.testing.assert_array_equal(np.asarray(got.scale), steps)


def _calibration(tok, n):
  ids = np.asarray(tok.encode(prompt_sets.book()[20000:40000]), np.int32)
  assert len(ids) >= n
  return ids[:n]


def test_hessians_equal_a_direct_computation_across_chunks(stories):
  cfg, params, tok = stories
  ids = _calibration(tok, 150)
  chunked = gptq.linear_input_hessians(cfg, params, ids, chunk=64)      # 64 + 64 + 22 tokens
  whole = gptq.linear_input_hessians(cfg, params, ids, chunk=150)
  assert len(chunked) == cfg.num_layers
  for a, b in zip(chunked, whole):
    for name in QUANTIZED_LINEARS:
      np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=1e-5 * np.abs(b[name]).max())
  # Layer 0's wqkv input, computed directly: the first norm of the embeddings.
  x = rms_norm(params["embed"][ids], params["layers"][0]["attn_norm"], cfg.rms_norm_eps)
  x = np.asarray(x, np.float64)
  np.testing.assert_allclose(chunked[0]["wqkv"], x.T @ x, rtol=1e-5, atol=1e-5)
  # A subset of layers: the same sums.
  part = gptq.linear_input_hessians(cfg, params, ids, chunk=64, layers=[2, 4])
  for got, i in zip(part, (2, 4)):
    for name in QUANTIZED_LINEARS:
      np.testing.assert_array_equal(got[name], chunked[i][name])


def _compiles(fn):
  """Names of the programs XLA compiled while fn() ran."""
  names = []
  listener = lambda event, duration, **kw: (
      names.append(kw.get("fun_name")) if event.endswith("backend_compile_duration") else None)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    fn()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return names


def test_calibration_walks_compile_each_step_once(stories):
  """A second calibration of the same shapes compiles nothing, and a walk compiles its step once,
  not again when the carried cache and hidden states turn from eager-made (uncommitted) arrays
  into step outputs (committed): linear_input_hessians compiled its step twice per call, and a
  jit defined inside it again on every call; LayerCalibration's chunk twice per walk; GPTQ on a
  numpy Hessian again after one from the walk."""
  cfg, params, tok = stories
  ids = _calibration(tok, 150)                                 # chunks of 64: 64 + 64 + 22
  gptq._hessian_chunk.clear_cache()
  first = _compiles(lambda: gptq.linear_input_hessians(cfg, params, ids, chunk=64))
  assert first.count("jit(_hessian_chunk)") == 1, first
  assert _compiles(lambda: gptq.linear_input_hessians(cfg, params, ids, chunk=64)) == []
  gptq._calibration_chunk.clear_cache()
  cal = gptq.LayerCalibration(cfg, params, ids, chunk=64)
  h0 = cal.hessians(params["layers"][0], advance=True)
  cal.hessians(params["layers"][1])
  assert gptq._calibration_chunk._cache_size() == 1
  gptq._gptq_codes.clear_cache()
  w = params["layers"][0]["wo"]
  gptq.gptq_quantize_weight(w, h0["wo"], group=32)
  gptq.gptq_quantize_weight(w, np.asarray(h0["wo"]), group=32)
  assert gptq._gptq_codes._cache_size() == 1


def _codes(layers):
  return [{name: np.asarray(lp[name].codes) for name in QUANTIZED_LINEARS} for lp in layers]


def _assert_hessians_close(a, b):
  for name in QUANTIZED_LINEARS:
    np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=1e-5 * np.abs(b[name]).max())


def test_layer_calibration_matches_whole_forwards_and_sequential_feeds_the_draft(stories):
  """LayerCalibration walks hidden states layer by layer: advanced through the full-precision
  layers, its Hessians equal `linear_input_hessians`' (whole forwards). gptq_quantize_params is
  GPTQ on those Hessians; sequential, layer 0 is the same (its inputs are the embeddings either
  way), and layer 1 is GPTQ on the Hessians of a model whose layer 0 is the quantized one (the
  draft's own inputs), which differ from the full-precision model's."""
  cfg, params, tok = stories
  ids = _calibration(tok, 200)                               # chunks of 64: 64 + 64 + 64 + 8
  whole = gptq.linear_input_hessians(cfg, params, ids, chunk=64)
  cal = gptq.LayerCalibration(cfg, params, ids, chunk=64)
  walked = [cal.hessians(lp, advance=True) for lp in params["layers"]]     # one pass a layer
  for a, b in zip(walked, whole):
    _assert_hessians_close(a, b)
  # Not sequential: every layer is GPTQ on the full-precision model's Hessians (those just walked).
  flat = gptq.gptq_quantize_params(cfg, params, ids, group=32, chunk=64, sequential=False)
  for name in QUANTIZED_LINEARS:
    want = gptq.gptq_quantize_weight(params["layers"][1][name], walked[1][name], 32)
    np.testing.assert_array_equal(np.asarray(flat[1][name].codes), np.asarray(want.codes))

  seq = gptq.gptq_quantize_params(cfg, params, ids, group=32, chunk=64, act_order=False,
                                  sequential=True)
  cal = gptq.LayerCalibration(cfg, params, ids, chunk=64)
  h0 = cal.hessians(params["layers"][0])
  cal.advance(seq[0])
  h1 = cal.hessians(params["layers"][1])
  for name in QUANTIZED_LINEARS:
    for hs, i in ((h0, 0), (h1, 1)):
      want = gptq.gptq_quantize_weight(params["layers"][i][name], hs[name], 32, act_order=False)
      np.testing.assert_array_equal(np.asarray(seq[i][name].codes), np.asarray(want.codes))
  fed = {**params, "layers": [seq[0]] + list(params["layers"][1:])}
  _assert_hessians_close(h1, gptq.linear_input_hessians(cfg, fed, ids, chunk=64, layers=[1])[0])
  assert not np.allclose(h1["wqkv"], whole[1]["wqkv"], rtol=1e-3)


def test_quantize_params_passes_damp_and_act_order_to_each_weight(stories):
  """gptq_quantize_params' damp and act_order reach every weight's GPTQ (its layer 0 is GPTQ on
  the embeddings' Hessians with them), and with_draft refuses layers that are not 4-bit."""
  cfg, params, tok = stories
  ids = _calibration(tok, 64)
  got = gptq.gptq_quantize_params(cfg, params, ids, group=32, chunk=64, damp=1.0,
                                  act_order=False, sequential=False)
  h0 = gptq.LayerCalibration(cfg, params, ids, chunk=64).hessians(params["layers"][0])
  differs = set()
  for name in QUANTIZED_LINEARS:
    w = params["layers"][0][name]
    want = gptq.gptq_quantize_weight(w, h0[name], 32, damp=1.0, act_order=False)
    np.testing.assert_array_equal(np.asarray(got[0][name].codes), np.asarray(want.codes))
    for other in (dict(damp=gptq.DEFAULT_DAMP, act_order=False), dict(damp=1.0, act_order=True)):
      if not np.array_equal(np.asarray(gptq.gptq_quantize_weight(w, h0[name], 32, **other).codes),
                            np.asarray(want.codes)):
        differs.add(tuple(other.items()))
  assert len(differs) == 2, differs              # each setting changes some weight's codes
  with pytest.raises(InputError, match="no 4-bit wqkv"):
    gptq.with_draft(params, list(params["layers"]))


def test_true_sequential_calibrates_each_linear_on_the_layer_with_its_earlier_linears_quantized(
    stories):
  """true_sequential: within a layer, each linear's Hessian comes from the layer with the linears
  before it (wqkv, wo, w_gate_up, w_down) already quantized. Checked against whole forwards
  (`linear_input_hessians`) of models whose layer 1 is quantized up to that linear: layer 1's
  codes are GPTQ on those Hessians; wqkv (inputs before any of the layer's linears) is the plain
  sequential one's, and the later linears' Hessians differ from it."""
  cfg, params, tok = stories
  ids = _calibration(tok, 200)
  seq = gptq.gptq_quantize_params(cfg, params, ids, group=32, chunk=64, act_order=False)
  true = gptq.gptq_quantize_params(cfg, params, ids, group=32, chunk=64, act_order=False,
                                   true_sequential=True)
  layer = dict(params["layers"][1])
  plain = None
  for name in QUANTIZED_LINEARS:
    fed = {**params, "layers": [true[0], layer] + list(params["layers"][2:])}
    h = gptq.linear_input_hessians(cfg, fed, ids, chunk=64, layers=[1])[0]
    plain = plain or h                          # the first: layer 1 still full precision
    want = gptq.gptq_quantize_weight(params["layers"][1][name], h[name], 32, act_order=False)
    got = np.asarray(true[1][name].codes)
    assert np.mean(got == np.asarray(want.codes)) > 0.995, name   # fp32 device vs fp64 host H
    if name != "wqkv":
      assert not np.allclose(h[name], plain[name], rtol=1e-3), name
    layer[name] = true[1][name]
  np.testing.assert_array_equal(np.asarray(true[0]["wqkv"].codes),
                                np.asarray(seq[0]["wqkv"].codes))
  assert any(not np.array_equal(np.asarray(true[1][n].codes), np.asarray(seq[1][n].codes))
             for n in QUANTIZED_LINEARS[1:])
  with pytest.raises(InputError, match="true_sequential must be a bool"):
    gptq.gptq_quantize_params(cfg, params, ids, group=32, true_sequential=1)


def test_several_calibration_sequences_sum_their_hessians(stories):
  """Several sequences are separate causal contexts: their Hessians are the sum of each one's
  alone (and not the Hessians of their concatenation, where the second sees the first)."""
  cfg, params, tok = stories
  a, b = _calibration(tok, 150), _calibration(tok, 300)[200:]
  lp = params["layers"][1]

  def layer1(tokens):
    cal = gptq.LayerCalibration(cfg, params, tokens, chunk=64)
    cal.advance(params["layers"][0])
    return cal.hessians(lp)
  both, alone_a, alone_b = layer1([a, b]), layer1(a), layer1(b)
  _assert_hessians_close(both, {k: alone_a[k] + alone_b[k] for k in alone_a})
  # Batched: c and d have a's number of chunks (3), so with batch 2 a and c walk as one batch and
  # d beside an empty row; b (2 chunks) alone. Still each sequence's own sums, added.
  c, d = _calibration(tok, 460)[250:390], _calibration(tok, 460)[300:440]
  cal = gptq.LayerCalibration(cfg, params, [a, b, c, d], chunk=64, batch=2)
  assert [lengths.tolist() for lengths, _ in cal.batches] == [[100], [150, 140], [140, 0]]
  cal.advance(params["layers"][0])
  batched = cal.hessians(lp)
  parts = [alone_a, alone_b, layer1(c), layer1(d)]
  _assert_hessians_close(batched, {k: sum(p[k] for p in parts) for k in alone_a})
  joined = layer1(np.concatenate([a, b]))
  assert not np.allclose(both["wo"], joined["wo"], rtol=1e-3)
  with pytest.raises(InputError, match="token ids"):
    gptq.LayerCalibration(cfg, params, [a, np.array([cfg.vocab_size])])


def test_self_generated_calibration_is_each_prompt_and_its_greedy_answer(stories):
  cfg, params, tok = stories
  prompts = [tok.encode("Once upon a time"), tok.encode("Tom and Lily")]
  dense = sparsedec.generate(cfg, params, prompts, max_new_tokens=20)
  seqs = gptq.self_generated_calibration(cfg, params, prompts, max_new_tokens=20)
  assert [s.tolist() for s in seqs] == [p + a for p, a in zip(prompts, dense.tokens)]
  cut = gptq.self_generated_calibration(cfg, params, prompts, max_new_tokens=20,
                                        max_tokens=len(seqs[0]) + 3)
  assert [s.tolist() for s in cut] == [seqs[0].tolist(), seqs[1][:3].tolist()]
  with pytest.raises(InputError, match="non-empty prompt"):
    gptq.self_generated_calibration(cfg, params, [prompts[0], []])
  with pytest.raises(InputError, match="max_new_tokens"):
    gptq.self_generated_calibration(cfg, params, prompts, max_new_tokens=0)
  with pytest.raises(InputError, match="max_tokens"):
    gptq.self_generated_calibration(cfg, params, prompts, max_tokens=0)
  # Batched a prompt at a time: the same sequences; once max_tokens is spent, nothing more decodes.
  alone = gptq.self_generated_calibration(cfg, params, prompts, max_new_tokens=20, batch_size=1)
  assert [s.tolist() for s in alone] == [s.tolist() for s in seqs]
  first = gptq.self_generated_calibration(cfg, params, prompts, max_new_tokens=20,
                                          max_tokens=len(seqs[0]), batch_size=1)
  assert [s.tolist() for s in first] == [seqs[0].tolist()]
  with pytest.raises(InputError, match="batch_size"):
    gptq.self_generated_calibration(cfg, params, prompts, batch_size=0)


def test_quantspec_decodes_with_the_gptq_draft_the_params_carry(stories):
  """Lossless whatever the draft: the output equals the RTN draft's (both equal the INT8
  reference decoder, tests/test_quantspec.py), and with verify_precision="full" it equals dense
  greedy; the draft the run used is GPTQ's (its codes differ from RTN's)."""
  cfg, params, tok = stories
  seen = []
  draft = gptq.gptq_quantize_params(cfg, params, _calibration(tok, 300), group=32, chunk=128,
                                    on_layer=lambda i, layer: seen.append((i, layer)))
  assert [i for i, _ in seen] == list(range(cfg.num_layers))
  assert all(layer is draft[i] for i, layer in seen)
  prompts = [tok.encode("Once upon a time"), tok.encode("Tom and Lily")]
  rtn = sparsedec.generate(cfg, params, prompts, method=METHOD, max_new_tokens=96,
                           stop_tokens=())
  compiled = (prefill._cache_size(), loop.decode._cache_size())
  got = sparsedec.generate(cfg, gptq.with_draft(params, draft), prompts, method=METHOD,
                           max_new_tokens=96, stop_tokens=(), return_state=True)
  assert got.tokens == rtn.tokens
  # Prefill and the loop never read the draft the params carry (only QuantSpec's init does):
  # they get the params without it (`gptq.without_draft`), so the RTN run's compiles serve.
  assert (prefill._cache_size(), loop.decode._cache_size()) == compiled
  assert gptq.without_draft(gptq.with_draft(params, draft)).keys() == params.keys()
  used = got.state.extras.draft_params["layers"]
  assert gptq.DRAFT_KEY not in got.state.extras.draft_params
  for i, lp in enumerate(draft):
    for name in QUANTIZED_LINEARS:   # in the layout the run stores ("int4_t" on a GPU)
      got_w = used[i][name]
      np.testing.assert_array_equal(np.asarray(got_w.codes),
                                    np.asarray(lp[name].to_layout(got_w.layout).codes))
  rtn_codes = quantize_weight(params["layers"][0]["w_down"], 32).codes
  assert not np.array_equal(np.asarray(draft[0]["w_down"].codes), np.asarray(rtn_codes))
  assert 0.0 < got.method_stats["acceptance_rate"] <= 1.0
  # Verifying on the full-precision cache: token-identical to dense greedy on this real
  # checkpoint, with the GPTQ draft proposing.
  testing.assert_matches_dense(cfg, gptq.with_draft(params, draft), prompts,
                               method=dataclasses.replace(METHOD, verify_precision="full"),
                               max_new_tokens=96, stop_tokens=())


def test_bad_inputs_are_refused_by_name(stories):
  cfg, params, tok = stories
  w = np.ones((64, 64), np.float32)
  with pytest.raises(InputError, match="Hessian"):
    gptq.gptq_quantize_weight(w, np.eye(63))
  with pytest.raises(InputError, match="damp"):
    gptq.gptq_quantize_weight(w, np.eye(64), group=32, damp=0.0)
  with pytest.raises(InputError, match="group"):
    gptq.gptq_quantize_weight(w, np.eye(64), group=0)
  with pytest.raises(InputError, match="int4_t"):
    gptq.gptq_quantize_weight(w, np.eye(64), group=16 * 3, layout="int4_t")
  with pytest.raises(InputError, match="non-finite"):
    gptq.gptq_quantize_weight(w, np.full((64, 64), np.nan), group=32)
  with pytest.raises(InputError, match="act_order"):
    gptq.gptq_quantize_weight(w, np.eye(64), group=32, act_order=1)
  with pytest.raises(InputError, match="not positive definite"):       # no x x^T sum is this
    gptq.gptq_quantize_weight(w, -np.eye(64), group=32)
  with pytest.raises(InputError, match="calibration batch"):
    gptq.LayerCalibration(cfg, params, [1, 2], batch=0)
  with pytest.raises(InputError, match="sequential"):
    gptq.gptq_quantize_params(cfg, params, [1, 2], group=32, sequential="yes")
  with pytest.raises(InputError, match="chunk"):
    gptq.LayerCalibration(cfg, params, [1, 2], chunk=0)
  with pytest.raises(InputError, match="token ids"):
    gptq.gptq_quantize_params(cfg, params, [1, cfg.vocab_size], group=32)
  with pytest.raises(InputError, match="token ids"):
    gptq.linear_input_hessians(cfg, params, [1, 2, cfg.vocab_size])
  with pytest.raises(InputError, match="context"):
    gptq.linear_input_hessians(cfg, params, np.ones(cfg.max_position_embeddings + 1, np.int32))
  with pytest.raises(InputError, match="layers"):
    gptq.linear_input_hessians(cfg, params, [1, 2], layers=[cfg.num_layers])
  draft = gptq.gptq_quantize_params(cfg, params, _calibration(tok, 64), group=32)
  with pytest.raises(InputError, match="layers"):
    gptq.with_draft(params, draft[:-1])
  carried = gptq.with_draft(params, draft)
  prompt = [tok.encode("Once upon a time")]
  with pytest.raises(InputError, match="weight groups"):
    sparsedec.generate(cfg, carried, prompt, max_new_tokens=4,
                       method=dataclasses.replace(METHOD, weight_group=64))
  with pytest.raises(InputError, match="weight_bits"):
    sparsedec.generate(cfg, carried, prompt, max_new_tokens=4,
                       method=dataclasses.replace(METHOD, weight_bits=None))


def test_calibration_takes_a_whole_context_and_the_last_token_id(stories):
  """The limits are inclusive: max_position_embeddings tokens, and ids up to vocab_size - 1, are
  a valid calibration (one more of either is refused, test_bad_inputs_are_refused_by_name)."""
  cfg, params, _ = stories
  ids = np.full(cfg.max_position_embeddings, cfg.vocab_size - 1, np.int32)
  cal = gptq.LayerCalibration(cfg, params, ids, chunk=cfg.max_position_embeddings)
  assert [lengths.tolist() for lengths, _ in cal.batches] == [[cfg.max_position_embeddings]]


def test_cli_draft_calibration(tmp_path, capsys):
  from sparsedec import cli
  text = tmp_path / "calibration.txt"
  text.write_text(prompt_sets.book()[20000:24000])
  args = ["generate", "--prompt", "Once upon a time", "--method", "quantspec", "--quant-group",
          "8", "--max-new-tokens", "24", "--ignore-eos", "--json"]
  assert cli.main(args) == 0
  rtn = json.loads(capsys.readouterr()[0])
  chat = tmp_path / "chat.txt"
  chat.write_text("Tom and Lily went to the park. They saw a big dog.")
  questions = tmp_path / "prompts.txt"
  questions.write_text("Once upon a time\n\nThe little bird\n")
  assert cli.main(args + ["--draft-calibration", str(text), str(chat),
                          "--draft-calibration-prompts", str(questions),
                          "--draft-calibration-tokens", "200"]) == 0
  got = json.loads(capsys.readouterr()[0])
  assert got["tokens"] == rtn["tokens"]                  # lossless whatever the draft
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  assert cli.main(args + ["--draft-calibration", str(text), str(empty)]) == 2
  assert "calibration text file is empty" in capsys.readouterr()[1]
  for bad, message in ((["--draft-calibration-prompts", str(tmp_path / "nope.txt")],
                        "calibration prompts file not found"),
                       (["--draft-calibration-prompts", str(empty)],
                        "calibration prompts file is empty")):
    assert cli.main(args + bad) == 2
    assert message in capsys.readouterr()[1]
  for bad, message in (
      (["--draft-calibration", str(tmp_path / "missing.txt")], "calibration text file not found"),
      (["--draft-calibration-tokens", "10"], "goes with --draft-calibration"),
      (["--draft-calibration", str(text), "--draft-calibration-tokens", "0"], ">= 1")):
    assert cli.main(args + bad) == 2
    assert message in capsys.readouterr()[1]
  dense = ["generate", "--prompt", "Once", "--draft-calibration", str(text)]
  assert cli.main(dense) == 2
  assert "does not apply to --method dense" in capsys.readouterr()[1]


def test_cli_draft_is_gptq_on_the_files_and_answers_it_was_given(tmp_path, capsys, monkeypatch,
                                                                 stories):
  """--draft-calibration / --draft-calibration-prompts / --draft-calibration-tokens /
  --draft-weight-group reach GPTQ: the first N tokens of each file, then the model's answers to
  the prompts (up to N tokens), at the method's weight group and layout; and the run decodes
  with that draft (the output is lossless whatever the draft, so test_cli_draft_calibration
  could not tell a draft built and then dropped, or files read whole). GPTQ, the answers and
  the decoding are stand-ins here: what is checked is what the CLI hands them."""
  from sparsedec import cli
  from sparsedec.decode import api
  from sparsedec.decode.api import GenerationResult
  cfg, params, tok = stories
  text = tmp_path / "calibration.txt"
  text.write_text(prompt_sets.book()[20000:22000])
  chat = tmp_path / "chat.txt"
  chat.write_text("Tom and Lily went to the park.")
  questions = tmp_path / "prompts.txt"
  questions.write_text("Once upon a time\n\nThe little bird\n")
  seen = {}
  answers = [np.arange(1, 9, dtype=np.int32), np.arange(20, 25, dtype=np.int32)]

  def quantize(cfg, params, seqs, **kw):
    seen["seqs"], seen["kw"] = [np.asarray(s).tolist() for s in seqs], kw
    seen["draft"] = [{**lp, **{name: quantize_weight(lp[name], kw["group"], kw["layout"])
                               for name in QUANTIZED_LINEARS}} for lp in params["layers"]]
    return seen["draft"]

  def self_generated(cfg, params, prompts, **kw):
    seen["prompts"], seen["max_tokens"] = prompts, kw.get("max_tokens")
    return answers

  def generate(cfg, params, prompts, **kw):
    seen["ran_with"], seen["method"] = params.get(gptq.DRAFT_KEY), kw["method"]
    return GenerationResult(tokens=[[5]], prompt_lengths=[len(prompts[0])], stopped=[False],
                            steps=0, active_steps=[0], prefill_seconds=0.0, decode_seconds=0.0)
  monkeypatch.setattr(gptq, "gptq_quantize_params", quantize)
  monkeypatch.setattr(gptq, "self_generated_calibration", self_generated)
  monkeypatch.setattr(api, "generate", generate)
  assert cli.main(["generate", "--prompt", "Once upon a time", "--method", "quantspec",
                   "--quant-group", "8", "--draft-weight-group", "32", "--max-new-tokens", "4",
                   "--json", "--draft-calibration", str(text), str(chat),
                   "--draft-calibration-prompts", str(questions),
                   "--draft-calibration-tokens", "100"]) == 0
  book_ids = tok.encode(text.read_text())
  assert len(book_ids) > 100
  assert seen["prompts"] == [tok.encode("Once upon a time"), tok.encode("The little bird")]
  assert seen["max_tokens"] == 100
  assert seen["seqs"] == [book_ids[:100], tok.encode(chat.read_text())] + [
      a.tolist() for a in answers]
  assert (seen["kw"]["group"], seen["kw"]["layout"]) == (
      32, seen["method"].resolved_weight_layout())
  assert seen["method"].weight_group == 32
  assert seen["ran_with"] is seen["draft"]


def test_cli_draft_layout_follows_the_params_platform(tmp_path, monkeypatch, stories):
  """The CLI's GPTQ draft takes weight_layout "auto" for the platform of the params' devices, as
  the method's init resolves it: params on the CPU of a GPU host (the default backend made to say
  "gpu" here) get the CPU's "packed" draft, not the GPU kernel's "int4_t"."""
  import argparse
  from sparsedec import cli
  cfg, params, tok = stories
  params = jax.device_put(params, jax.devices("cpu")[0])              # committed to the CPU
  text = tmp_path / "calibration.txt"
  text.write_text("Tom and Lily went to the park.")
  seen = {}

  def quantize(cfg, params, seqs, **kw):       # a stand-in: RTN in the layout GPTQ was given
    seen.update(kw)
    return [{**lp, **{name: quantize_weight(lp[name], kw["group"], kw["layout"])
                      for name in QUANTIZED_LINEARS}} for lp in params["layers"]]
  monkeypatch.setattr(gptq, "gptq_quantize_params", quantize)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  method = QuantSpec(quant_group=8, weight_group=32)
  assert method.resolved_weight_layout() == "int4_t"                  # by the default backend
  args = argparse.Namespace(draft_calibration=[str(text)], draft_calibration_prompts=None)
  got = cli._with_draft(args, cfg, params, tok, method, 100)
  assert seen["layout"] == method.init_key("cpu").weight_layout == "packed"
  assert {lp["wqkv"].layout for lp in got[gptq.DRAFT_KEY]} == {"packed"}
