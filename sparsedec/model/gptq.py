"""GPTQ (Frantar et al., 2023) for QuantSpec's 4-bit draft weights.

The result is an ordinary `quant_weights.QuantWeight`: the same asymmetric 4-bit codes, fp16
grids (zero rounded down, step up) and storage layouts as round-to-nearest (RTN), so every layout
and the W4A16 GEMV read it unchanged. Only the codes differ: they minimise the layer's output
error on calibration inputs, sum_x |x (W - Q)|^2, instead of each weight's own rounding error.

Per linear w [In, Out] with H = sum_x x x^T over the calibration inputs x [In] of that linear
(damped: H + damp * mean(diag H) * I; an input that is always zero gets H_ii = 1): the input rows
are quantized in order, and each row's rounding error, divided by the matching diagonal entry of
the upper Cholesky factor U of H^-1, is spread over the rows not yet quantized (w_j -= U_ij e for
j > i; lazily, in blocks of rows). A group's grid is fixed from its rows as they stand when its
first row is reached (GPTQ's non-static groups), then every row of the group is rounded on it. With
H = I no error moves, and the codes, grids and bytes are RTN's (`quant_weights.quantize_weight`).

Calibration is not sequential: every linear's inputs come from the full-precision model
(`linear_input_hessians`, the forward's `linear_inputs` taps), not from already-quantized layers.
The Hessians of a pass are held in float64 on the host, so `gptq_quantize_params` takes the layers
in passes that fit `max_hessian_bytes` (one calibration forward per pass).

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
from sparsedec.model.forward import forward
from sparsedec.model.params import Params
from sparsedec.model.quant_weights import (QUANTIZED_LINEARS, QuantWeight, check_group_layout,
                                           from_codes, grid_codes, group_grid, padded_rows)

DRAFT_KEY = "draft_layers"      # params[DRAFT_KEY]: the draft's quantized layers (QuantSpec)
DEFAULT_DAMP = 0.01
BLOCK_ROWS = 128                # rows per lazy-update block (a multiple of the group)


def linear_input_hessians(cfg: ModelConfig, params: Params, tokens, *, chunk: int = 512,
                          layers=None) -> list[dict[str, np.ndarray]]:
  """sum_x x x^T (float64 [In, In]) of each quantized linear's inputs over one calibration token
  sequence (tokens [N] int32, N >= 1, at most the model's context), run through the full-precision
  model in causal chunks of `chunk` tokens. layers: the layer indices to return (default all);
  the result has one dict per returned layer, in order, keyed by weight name."""
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
    mask = (jnp.arange(chunk) < valid)[None, :, None]                    # [1, T, 1]

    def gram(x):                                                         # [1, T, In] -> [In, In]
      x = jnp.where(mask, x, 0).astype(jnp.float32)
      return jnp.einsum("bti,btj->ij", x, x, precision=jax.lax.Precision.HIGHEST)
    sums = [{name: gram(taps[i][name]) for name in QUANTIZED_LINEARS} for i in layers]
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
                         damp: float = DEFAULT_DAMP) -> QuantWeight:
  """w [In, Out] -> QuantWeight by GPTQ against hessian [In, In] (sum of x x^T of its inputs)."""
  if getattr(w, "ndim", None) != 2:
    raise InputError(f"a weight to quantize must be [In, Out], got shape {np.shape(w)}")
  n_in, n_out = w.shape
  if np.shape(hessian) != (n_in, n_in):
    raise InputError(f"the Hessian of a [{n_in}, {n_out}] weight must be [{n_in}, {n_in}], got "
                     f"{np.shape(hessian)}")
  if not (isinstance(damp, (int, float)) and 0 < damp <= 1):
    raise InputError(f"GPTQ damp must be in (0, 1], got {damp!r}")
  if not np.all(np.isfinite(hessian)):
    raise InputError("the calibration Hessian has non-finite entries")
  check_group_layout(group, layout)
  w = np.asarray(padded_rows(jnp.asarray(w), group), np.float64)         # [In_pad, Out]
  n_pad = w.shape[0]
  h = np.zeros((n_pad, n_pad))
  h[:n_in, :n_in] = hessian
  dead = np.diag(h) == 0                      # never-seen inputs (and the padded rows)
  h[dead, dead] = 1.0
  h[np.diag_indices(n_pad)] += damp * np.mean(np.diag(h))
  u = np.linalg.cholesky(np.linalg.inv(h)).T                              # upper: H^-1 = U^T U

  codes = np.zeros((n_pad, n_out), np.uint8)
  zeros = np.zeros((n_pad // group, n_out), np.float16)
  steps = np.zeros((n_pad // group, n_out), np.float16)
  block = group * max(1, BLOCK_ROWS // group)
  for b0 in range(0, n_pad, block):
    b1 = min(b0 + block, n_pad)
    wb = w[b0:b1].copy()
    err = np.zeros_like(wb)
    for j in range(b1 - b0):
      i = b0 + j
      if i % group == 0:       # the group's grid, from its rows as they stand now (a block
        rows = jnp.asarray(wb[j:j + group], jnp.float32)   # holds whole groups)
        z, s = (np.asarray(x) for x in group_grid(rows))
        zeros[i // group], steps[i // group] = z, s
      c = grid_codes(wb[j].astype(np.float32), z, s)
      codes[i] = c
      err[j] = (wb[j] - (z.astype(np.float64) + c * s.astype(np.float64))) / u[i, i]
      wb[j + 1:] -= np.outer(u[i, i + 1:b1], err[j])
    w[b1:] -= u[b0:b1, b1:].T @ err
  return from_codes(jnp.asarray(codes), jnp.asarray(steps), jnp.asarray(zeros), n_in, group,
                    layout)


def gptq_quantize_params(cfg: ModelConfig, params: Params, tokens, *, group: int = 128,
                         layout: str = "packed", damp: float = DEFAULT_DAMP, chunk: int = 512,
                         max_hessian_bytes: int = 2 ** 31) -> list[dict]:
  """The draft's layers: every layer's linears (`QUANTIZED_LINEARS`) GPTQ-quantized against
  calibration tokens [N] (the rest of each layer as it is). Layers go in passes whose float64
  Hessians fit max_hessian_bytes (at least one layer a pass), one calibration forward each."""
  per_layer = 8 * sum(params["layers"][0][name].shape[0] ** 2 for name in QUANTIZED_LINEARS)
  per_pass = max(1, max_hessian_bytes // per_layer)
  out = []
  for first in range(0, cfg.num_layers, per_pass):
    ids = range(first, min(first + per_pass, cfg.num_layers))
    hessians = linear_input_hessians(cfg, params, tokens, chunk=chunk, layers=ids)
    for i, hs in zip(ids, hessians):
      lp = params["layers"][i]
      out.append({name: gptq_quantize_weight(lp[name], hs[name], group, layout, damp)
                  if name in QUANTIZED_LINEARS else x for name, x in lp.items()})
  return out


def with_draft(params: Params, draft_layers: list[dict]) -> Params:
  """params carrying the draft's quantized layers (DRAFT_KEY), which QuantSpec then uses."""
  if len(draft_layers) != len(params["layers"]):
    raise InputError(f"the draft has {len(draft_layers)} layers, the model {len(params['layers'])}")
  for i, lp in enumerate(draft_layers):
    for name in QUANTIZED_LINEARS:
      if not isinstance(lp.get(name), QuantWeight):
        raise InputError(f"draft layer {i} has no 4-bit {name} (a QuantWeight)")
  return {**params, DRAFT_KEY: draft_layers}
