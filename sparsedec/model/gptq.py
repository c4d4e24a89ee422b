"""GPTQ (Frantar et al., 2023) for QuantSpec's 4-bit draft weights.

The result is an ordinary `quant_weights.QuantWeight`: the same asymmetric 4-bit codes, fp16
grids (zero rounded down, step up) and storage layouts as round-to-nearest (RTN), so every layout
and the W4A16 GEMV read it unchanged. Only the codes differ: they minimise the layer's output
error on calibration inputs, sum_x |x (W - Q)|^2, instead of each weight's own rounding error.

Per linear w [In, Out] with H = sum_x x x^T over the calibration inputs x [In] of that linear
(damped: H + damp * mean(diag H) * I; an input that is always zero gets H_ii = 1): the input rows
are quantized in order, and each row's rounding error, divided by the matching diagonal entry of
the upper Cholesky factor U of H^-1, is spread over the rows not yet quantized (w_j -= U_ij e for
j > i; lazily, in blocks of rows). With H = I no error moves, and the codes, grids and bytes are
RTN's (`quant_weights.quantize_weight`).

Grids and order (`act_order`):
* False: rows in index order; a group's grid is fixed from its rows as they stand when its first
  row is reached (GPTQ's non-static groups).
* True: rows in order of decreasing H_ii (the inputs that carry the most energy first, so their
  errors can still be compensated by the rest); every group's grid is RTN's, fixed from the
  original weights before any row moves (static groups), so a group is still a run of `group`
  consecutive input rows and the kernels' layouts hold.

Calibration (`gptq_quantize_params`) goes layer by layer over the calibration tokens' hidden
states, in causal chunks against the layer's own KV cache: layer i's Hessians come from its inputs,
then its outputs become layer i + 1's inputs. `sequential`: those outputs are the quantized
layer's (GPTQ's sequential mode: each layer is calibrated on what the draft's earlier layers
really feed it) or the full-precision layer's (every input from the full-precision model, as
`linear_input_hessians` computes them in whole forwards). One layer's float64 Hessians are held
on the host at a time.

QuantSpec uses a precomputed draft when the params carry one: `with_draft(params, draft)` adds it
under DRAFT_KEY, and `QuantSpec.init` takes it instead of RTN-quantizing the params.

  hessians = linear_input_hessians(cfg, params, calibration_tokens)        # [layers] {name: H}
  draft = gptq_quantize_params(cfg, params, calibration_tokens, group=128)  # quantized layers
  generate(cfg, with_draft(params, draft), prompts, method=QuantSpec(...))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparsedec.attention import causal_plan
from sparsedec.errors import InputError
from sparsedec.kv.dense import commit, init_cache
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import decoder_layer, forward
from sparsedec.model.params import Params
from sparsedec.model.rope import rope_tables
from sparsedec.model.quant_weights import (QUANTIZED_LINEARS, QuantWeight, check_group_layout,
                                           from_codes, grid_codes, group_grid, padded_rows)

DRAFT_KEY = "draft_layers"      # params[DRAFT_KEY]: the draft's quantized layers (QuantSpec)
DEFAULT_DAMP = 0.01
DEFAULT_ACT_ORDER = True
DEFAULT_SEQUENTIAL = True
BLOCK_ROWS = 128                # rows per lazy-update block (a multiple of the group)


def _checked_tokens(cfg: ModelConfig, tokens) -> np.ndarray:
  tokens = np.asarray(tokens).reshape(-1)
  n = tokens.shape[0]
  if n < 1 or not np.issubdtype(tokens.dtype, np.integer):
    raise InputError(f"calibration needs at least one integer token id, got {n} of {tokens.dtype}")
  if n > cfg.max_position_embeddings:
    raise InputError(f"{n} calibration tokens exceed the model's context of "
                     f"{cfg.max_position_embeddings}")
  if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
    raise InputError(f"calibration token ids must lie in [0, {cfg.vocab_size}), got "
                     f"[{tokens.min()}, {tokens.max()}]")
  return tokens


def _gram(x: jax.Array, valid) -> jax.Array:
  """x [1, T, In] -> sum over its first `valid` tokens of x x^T, fp32 [In, In]."""
  x = jnp.where((jnp.arange(x.shape[1]) < valid)[None, :, None], x, 0).astype(jnp.float32)
  return jnp.einsum("bti,btj->ij", x, x, precision=jax.lax.Precision.HIGHEST)


def linear_input_hessians(cfg: ModelConfig, params: Params, tokens, *, chunk: int = 512,
                          layers=None) -> list[dict[str, np.ndarray]]:
  """sum_x x x^T (float64 [In, In]) of each quantized linear's inputs over one calibration token
  sequence (tokens [N] int32, N >= 1, at most the model's context), run through the full-precision
  model in causal chunks of `chunk` tokens. layers: the layer indices to return (default all);
  the result has one dict per returned layer, in order, keyed by weight name."""
  tokens = _checked_tokens(cfg, tokens)
  n = tokens.shape[0]
  if not isinstance(chunk, int) or chunk < 1:
    raise InputError(f"calibration chunk must be a positive integer, got {chunk!r}")
  layers = tuple(range(cfg.num_layers)) if layers is None else tuple(layers)
  if not layers or min(layers) < 0 or max(layers) >= cfg.num_layers:
    raise InputError(f"calibration layers must lie in [0, {cfg.num_layers}), got {layers}")
  chunk = min(chunk, n)

  @jax.jit
  def step(params, toks, pos, cache, valid):
    taps = []
    _, kv = forward(cfg, params, toks, pos, cache, causal_plan(chunk), linear_inputs=taps)
    sums = [{name: _gram(taps[i][name], valid) for name in QUANTIZED_LINEARS} for i in layers]
    return sums, commit(cache, kv, jnp.full((1,), valid, jnp.int32))

  cache = init_cache(cfg, 1, -(-n // chunk) * chunk)
  total = [{name: 0.0 for name in QUANTIZED_LINEARS} for _ in layers]
  for start in range(0, n, chunk):
    valid = min(chunk, n - start)
    toks = np.zeros((1, chunk), np.int32)
    toks[0, :valid] = tokens[start:start + valid]
    sums, cache = step(params, jnp.asarray(toks), jnp.arange(start, start + chunk)[None], cache,
                       jnp.int32(valid))
    for acc, got in zip(total, sums):
      for name in QUANTIZED_LINEARS:
        acc[name] = acc[name] + np.asarray(got[name], np.float64)
  return total


def gptq_quantize_weight(w, hessian: np.ndarray, group: int = 128, layout: str = "packed",
                         damp: float = DEFAULT_DAMP,
                         act_order: bool = DEFAULT_ACT_ORDER) -> QuantWeight:
  """w [In, Out] -> QuantWeight by GPTQ against hessian [In, In] (sum of x x^T of its inputs).
  act_order: rows by decreasing H_ii on RTN's (static) grids, else in index order on grids fixed
  as each group is reached (module docstring)."""
  if getattr(w, "ndim", None) != 2:
    raise InputError(f"a weight to quantize must be [In, Out], got shape {np.shape(w)}")
  n_in, n_out = w.shape
  if np.shape(hessian) != (n_in, n_in):
    raise InputError(f"the Hessian of a [{n_in}, {n_out}] weight must be [{n_in}, {n_in}], got "
                     f"{np.shape(hessian)}")
  if not (isinstance(damp, (int, float)) and 0 < damp <= 1):
    raise InputError(f"GPTQ damp must be in (0, 1], got {damp!r}")
  if not isinstance(act_order, bool):
    raise InputError(f"GPTQ act_order must be a bool, got {act_order!r}")
  if not np.all(np.isfinite(hessian)):
    raise InputError("the calibration Hessian has non-finite entries")
  check_group_layout(group, layout)
  padded = padded_rows(jnp.asarray(w), group)                            # [In_pad, Out] fp32
  w = np.asarray(padded, np.float64)
  n_pad = w.shape[0]
  h = np.zeros((n_pad, n_pad))
  h[:n_in, :n_in] = hessian
  dead = np.diag(h) == 0                      # never-seen inputs (and the padded rows)
  h[dead, dead] = 1.0
  h[np.diag_indices(n_pad)] += damp * np.mean(np.diag(h))
  zeros = np.zeros((n_pad // group, n_out), np.float16)
  steps = np.zeros((n_pad // group, n_out), np.float16)
  if act_order:                # static grids: RTN's, from the weights before any row moves
    zeros[:], steps[:] = (np.asarray(x) for x in group_grid(padded.reshape(-1, group, n_out)))
    order = np.argsort(-np.diag(h), kind="stable")
  else:
    order = np.arange(n_pad)
  w, h = w[order], h[np.ix_(order, order)]
  u = np.linalg.cholesky(np.linalg.inv(h)).T                              # upper: H^-1 = U^T U

  codes = np.zeros((n_pad, n_out), np.uint8)
  block = group * max(1, BLOCK_ROWS // group)
  for b0 in range(0, n_pad, block):
    b1 = min(b0 + block, n_pad)
    wb = w[b0:b1].copy()
    err = np.zeros_like(wb)
    for j in range(b1 - b0):
      i = b0 + j
      row, g = order[i], order[i] // group
      if not act_order and i % group == 0:   # the group's grid, from its rows as they stand now
        rows = jnp.asarray(wb[j:j + group], jnp.float32)   # (a block holds whole groups)
        zeros[g], steps[g] = (np.asarray(x) for x in group_grid(rows))
      z, s = zeros[g], steps[g]
      c = grid_codes(wb[j].astype(np.float32), z, s)
      codes[row] = c
      err[j] = (wb[j] - (z.astype(np.float64) + c * s.astype(np.float64))) / u[i, i]
      wb[j + 1:] -= np.outer(u[i, i + 1:b1], err[j])
    w[b1:] -= u[b0:b1, b1:].T @ err
  return from_codes(jnp.asarray(codes), jnp.asarray(steps), jnp.asarray(zeros), n_in, group,
                    layout)


def _checked_sequences(cfg: ModelConfig, tokens) -> list[np.ndarray]:
  """One token sequence [N], or several (a list of sequences, or [B, N]) -> checked 1-D arrays."""
  if isinstance(tokens, np.ndarray) and tokens.ndim == 2:
    tokens = list(tokens)
  several = isinstance(tokens, (list, tuple)) and len(tokens) > 0 and np.ndim(tokens[0]) == 1
  seqs = [_checked_tokens(cfg, t) for t in tokens] if several else [_checked_tokens(cfg, tokens)]
  return seqs


class LayerCalibration:
  """Calibration tokens' hidden states walked through the model one layer at a time, in causal
  chunks against the current layer's own KV cache:

    cal = LayerCalibration(cfg, params, tokens)   # hidden states: the embeddings
    hessians = cal.hessians(lp)                   # {name: float64 [In, In]} of layer lp's linears
    cal.advance(lp)                               # hidden states := layer lp's outputs

  tokens: one sequence [N] or several (a list of sequences, or [B, N]), each its own causal
  context from position 0 (e.g. several documents); the Hessians sum over all of them.
  """

  def __init__(self, cfg: ModelConfig, params: Params, tokens, *, chunk: int = 512):
    seqs = _checked_sequences(cfg, tokens)
    if not isinstance(chunk, int) or chunk < 1:
      raise InputError(f"calibration chunk must be a positive integer, got {chunk!r}")
    self.cfg, self.lengths = cfg, [len(t) for t in seqs]
    self.chunk = min(chunk, max(self.lengths))
    self.dtype = jnp.dtype(cfg.dtype)
    self.xs = []                                   # per sequence, per chunk [1, chunk, Dm]
    for t in seqs:
      padded = np.zeros(-(-len(t) // self.chunk) * self.chunk, np.int32)
      padded[:len(t)] = t
      embed = jnp.take(params["embed"], jnp.asarray(padded), axis=0).astype(self.dtype)
      self.xs.append([embed[None, s:s + self.chunk] for s in range(0, len(t), self.chunk)])
    self._run = jax.jit(self._chunk, static_argnames="grams")

  def _chunk(self, lp, x, start, valid, k_cache, v_cache, grams):
    """Layer lp over one chunk x [1, chunk, Dm] at positions start..: its output, the chunk's
    K/V written into the layer's cache [1, Hkv, S, D], and (grams) its linears' input sums."""
    cfg = self.cfg
    pos = (start + jnp.arange(self.chunk, dtype=jnp.int32))[None]         # [1, chunk]
    cos, sin = rope_tables(cfg, pos, self.dtype)
    taps = {} if grams else None
    y, _, k, v = decoder_layer(cfg, lp, x, cos, sin, pos, k_cache, v_cache,
                               jnp.full((1,), start, jnp.int32), causal_plan(self.chunk), taps)
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.transpose(0, 2, 1, 3), start, 2)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.transpose(0, 2, 1, 3), start, 2)
    sums = {name: _gram(taps[name], valid) for name in QUANTIZED_LINEARS} if grams else None
    return y, k_cache, v_cache, sums

  def _through(self, lp, grams: bool):
    cfg = self.cfg
    out, total = [], {name: 0.0 for name in QUANTIZED_LINEARS}
    for xs, n in zip(self.xs, self.lengths):
      shape = (1, cfg.num_kv_heads, len(xs) * self.chunk, cfg.head_dim)   # one compile a length
      k_cache, v_cache = jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)
      ys = []
      for i, x in enumerate(xs):
        start = i * self.chunk
        y, k_cache, v_cache, sums = self._run(lp, x, jnp.int32(start),
                                              jnp.int32(min(self.chunk, n - start)), k_cache,
                                              v_cache, grams)
        ys.append(y)
        for name in QUANTIZED_LINEARS if grams else ():
          total[name] = total[name] + np.asarray(sums[name], np.float64)
      out.append(ys)
    return out, total

  def hessians(self, lp: dict) -> dict[str, np.ndarray]:
    """sum x x^T (float64 [In, In]) of layer lp's linear inputs, on the current hidden states."""
    return self._through(lp, grams=True)[1]

  def advance(self, lp: dict) -> None:
    """The hidden states become layer lp's outputs (lp full precision, or a quantized layer)."""
    self.xs = self._through(lp, grams=False)[0]


def gptq_quantize_params(cfg: ModelConfig, params: Params, tokens, *, group: int = 128,
                         layout: str = "packed", damp: float = DEFAULT_DAMP, chunk: int = 512,
                         act_order: bool = DEFAULT_ACT_ORDER,
                         sequential: bool = DEFAULT_SEQUENTIAL) -> list[dict]:
  """The draft's layers: every layer's linears (`QUANTIZED_LINEARS`) GPTQ-quantized against
  calibration tokens (one sequence [N] or several, `LayerCalibration`), the rest of each layer as
  it is; layer by layer (sequential: each layer's inputs come from the quantized layers before
  it)."""
  if not isinstance(sequential, bool):
    raise InputError(f"GPTQ sequential must be a bool, got {sequential!r}")
  cal = LayerCalibration(cfg, params, tokens, chunk=chunk)
  out = []
  for lp in params["layers"]:
    hessians = cal.hessians(lp)
    qlp = {name: gptq_quantize_weight(lp[name], hessians[name], group, layout, damp, act_order)
           if name in QUANTIZED_LINEARS else x for name, x in lp.items()}
    cal.advance(qlp if sequential else lp)
    out.append(qlp)
  return out


def self_generated_calibration(cfg: ModelConfig, params: Params, prompts, *,
                               max_new_tokens: int = 160,
                               max_tokens: int | None = None) -> list[np.ndarray]:
  """Calibration sequences from the model itself: each prompt (token ids) followed by the model's
  greedy answer (dense decoding, up to max_new_tokens), at most max_tokens in all. A draft
  calibrated on them sees the text it will be asked to predict: on SmolLM2, MT-Bench answers
  calibrated this way agree with the target 0.81 of the time against 0.72 for round-to-nearest
  (benchmarks/NOTES.md, session 39)."""
  from sparsedec.decode.api import generate       # the decode package imports this module
  prompts = [list(p) for p in prompts]
  if not prompts or not all(prompts):
    raise InputError("self-generated calibration needs at least one non-empty prompt")
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
    raise InputError(f"max_tokens must be a positive integer or None, got {max_tokens!r}")
  answers = generate(cfg, params, prompts, max_new_tokens=max_new_tokens).tokens
  seqs, left = [], np.inf if max_tokens is None else max_tokens
  for p, a in zip(prompts, answers):
    if left > 0:
      seqs.append(np.asarray(p + a, np.int32)[: int(min(left, cfg.max_position_embeddings))])
      left -= len(seqs[-1])
  return seqs


def with_draft(params: Params, draft_layers: list[dict]) -> Params:
  """params carrying the draft's quantized layers (DRAFT_KEY), which QuantSpec then uses."""
  if len(draft_layers) != len(params["layers"]):
    raise InputError(f"the draft has {len(draft_layers)} layers, the model {len(params['layers'])}")
  for i, lp in enumerate(draft_layers):
    for name in QUANTIZED_LINEARS:
      if not isinstance(lp.get(name), QuantWeight):
        raise InputError(f"draft layer {i} has no 4-bit {name} (a QuantWeight)")
  return {**params, DRAFT_KEY: draft_layers}
