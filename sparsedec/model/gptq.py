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
`linear_input_hessians` computes them in whole forwards). One layer's Hessians are held at a time,
fp32 on the device, and GPTQ itself runs there as one jitted computation per weight shape
(`_gptq_codes`; fp32 with HIGHEST-precision products; the same codes as the float64 row-by-row
algorithm up to rare fp32 rounding ties). Times: benchmarks/gptq_time.py and NOTES, session 40.

QuantSpec uses a precomputed draft when the params carry one: `with_draft(params, draft)` adds it
under DRAFT_KEY, and `QuantSpec.init` takes it instead of RTN-quantizing the params.

  hessians = linear_input_hessians(cfg, params, calibration_tokens)        # [layers] {name: H}
  draft = gptq_quantize_params(cfg, params, calibration_tokens, group=128)  # quantized layers
  generate(cfg, with_draft(params, draft), prompts, method=QuantSpec(...))
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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
DEFAULT_TRUE_SEQUENTIAL = False
BLOCK_ROWS = 128                # rows per lazy-update block (a multiple of the group)
CALIBRATION_BATCH = 16          # calibration sequences of one length bucket walked together


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
  """x [B, T, In] -> sum over each row's first `valid` tokens (valid: [B], or one count for
  all rows) of x x^T, fp32 [In, In]."""
  mask = jnp.arange(x.shape[1])[None, :] < jnp.reshape(valid, (-1, 1))            # [B | 1, T]
  x = jnp.where(mask[:, :, None], x, 0).astype(jnp.float32)
  return jnp.einsum("bti,btj->ij", x, x, precision=jax.lax.Precision.HIGHEST)


def _committed(tree, like: jax.Array):
  """tree's arrays committed to the device `like` is on. jit compiles a function again for an
  argument that is committed where it was not: an array made eagerly (jnp.zeros, jnp.asarray of
  numpy) is not, a jitted step's output on committed params is. A walk whose carried arrays start
  eager-made and go on as step outputs compiled each step twice; committed from the start they
  compile once. `like` on several devices (sharded): tree as it is."""
  sharding = like.sharding
  return jax.device_put(tree, sharding) if len(sharding.device_set) == 1 else tree


@functools.partial(jax.jit, static_argnames=("cfg", "chunk", "layers"))
def _hessian_chunk(params, toks, pos, cache, valid, *, cfg: ModelConfig, chunk: int,
                   layers: tuple[int, ...]):
  """One causal chunk of `linear_input_hessians`: the input sums of layers' linears over the
  chunk's first `valid` tokens, and the cache with the chunk's K/V. Module-level, so every call
  of a config and chunk shares its compile (a jit defined in the function compiled per call)."""
  taps = []
  _, kv = forward(cfg, params, toks, pos, cache, causal_plan(chunk), linear_inputs=taps)
  sums = [{name: _gram(taps[i][name], valid) for name in QUANTIZED_LINEARS} for i in layers]
  return sums, commit(cache, kv, jnp.full((1,), valid, jnp.int32))


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

  cache = _committed(init_cache(cfg, 1, -(-n // chunk) * chunk), params["embed"])
  total = [{name: 0.0 for name in QUANTIZED_LINEARS} for _ in layers]
  for start in range(0, n, chunk):
    valid = min(chunk, n - start)
    toks = np.zeros((1, chunk), np.int32)
    toks[0, :valid] = tokens[start:start + valid]
    sums, cache = _hessian_chunk(params, jnp.asarray(toks), jnp.arange(start, start + chunk)[None],
                                 cache, jnp.int32(valid), cfg=cfg, chunk=chunk, layers=layers)
    for acc, got in zip(total, sums):
      for name in QUANTIZED_LINEARS:
        acc[name] = acc[name] + np.asarray(got[name], np.float64)
  return total


# XLA's GEMM autotuning took ~13 of the ~15 s that compiling _gptq_codes cost on an H200 (per
# weight shape) and bought little run time (a [4096, 4096] weight: 56 ms with it, 59 without;
# an 8B layer's walk + GPTQ 0.64 -> 0.70 s; results/s40/). Other backends ignore the option. The
# calibration walk keeps autotuning: without it an 8B layer's walk + GPTQ took 0.86 s.
_COMPILER_OPTIONS = {"xla_gpu_autotune_level": "0"}


@functools.partial(jax.jit, static_argnames=("group", "act_order"),
                   compiler_options=_COMPILER_OPTIONS)
def _gptq_codes(w, h, damp, *, group, act_order):
  """GPTQ on the device, fp32 (module docstring).

  w     [In_pad, Out] fp32: the weight, rows padded to a multiple of `group` (padded_rows)
  h     [In, In]: sum x x^T of its inputs (In <= In_pad; the padded rows' inputs are zero)
  damp  (): the damping, a fraction of the mean diagonal
  ->  codes [In_pad, Out] fp32 in [0, 15] (index order), zero and step [In_pad / G, Out] fp16,
      ok (): the factorization of the damped H^-1 is finite.

  The rows are visited in blocks of BLOCK_ROWS (whole groups; the row count padded to whole
  blocks with inert rows: U's diagonal 1, no coupling); inside a block, row by row, each row's
  scaled error moves the block's later rows at once, and the block's errors move every later row
  in one product when the block is done (Frantar et al.'s lazy batch updates)."""
  n_pad, n_out = w.shape
  n_in = h.shape[0]
  block = group * max(1, BLOCK_ROWS // group)
  n_blk = -(-n_pad // block) * block                 # whole blocks; the extra rows are inert
  hp = jnp.zeros((n_pad, n_pad), jnp.float32).at[:n_in, :n_in].set(h.astype(jnp.float32))
  d = jnp.diagonal(hp)
  d = jnp.where(d == 0, 1.0, d)                      # never-seen inputs and the padded rows
  d = d + damp * jnp.mean(d)
  hp = jnp.where(jnp.eye(n_pad, dtype=bool), d, hp)
  if act_order:
    zeros, steps = group_grid(w.reshape(-1, group, n_out))
    order = jnp.argsort(-d, stable=True)
  else:
    zeros = jnp.zeros((n_pad // group, n_out), jnp.float16)
    steps = jnp.ones((n_pad // group, n_out), jnp.float16)
    order = jnp.arange(n_pad)
  hp = hp[order][:, order]
  chol = jnp.linalg.cholesky(hp)
  hinv = jax.scipy.linalg.cho_solve((chol, True), jnp.eye(n_pad, dtype=jnp.float32))
  u = jnp.linalg.cholesky(hinv).T                                        # H^-1 = U^T U
  extra = n_blk - n_pad
  u = jnp.pad(u, ((0, extra), (0, extra)))
  u = u.at[jnp.arange(n_pad, n_blk), jnp.arange(n_pad, n_blk)].set(1.0)
  wp = jnp.pad(w[order], ((0, extra), (0, 0)))
  order = jnp.concatenate([order, jnp.arange(n_pad, n_blk)])
  zeros = jnp.pad(zeros, ((0, extra // group), (0, 0)))
  steps = jnp.pad(steps, ((0, extra // group), (0, 0)), constant_values=1)
  cols = jnp.arange(n_blk)

  def one_block(b, carry):
    wp, zeros, steps, codes = carry
    b0 = b * block
    wb = jax.lax.dynamic_slice_in_dim(wp, b0, block)                    # [block, Out]
    ub = jax.lax.dynamic_slice_in_dim(u, b0, block)                     # [block, n_blk]
    ubb = jax.lax.dynamic_slice_in_dim(ub, b0, block, axis=1)           # [block, block]

    def one_group(gi, carry):
      wb, zeros, steps, err, cb = carry
      if not act_order:         # the group's grid, from its rows as they stand now
        z, s = group_grid(jax.lax.dynamic_slice_in_dim(wb, gi * group, group))
        g = (b0 + gi * group) // group
        zeros = jax.lax.dynamic_update_index_in_dim(zeros, z, g, 0)
        steps = jax.lax.dynamic_update_index_in_dim(steps, s, g, 0)

      def one_row(r, carry):
        wb, err, cb = carry
        j = gi * group + r
        g = order[b0 + j] // group
        z, s = zeros[g], steps[g]
        c = grid_codes(wb[j], z, s)
        e = (wb[j] - (z.astype(jnp.float32) + c * s.astype(jnp.float32))) / ubb[j, j]
        coef = jnp.where(jnp.arange(block) > j, ubb[j], 0.0)
        wb = wb - coef[:, None] * e[None, :]
        return wb, err.at[j].set(e), cb.at[j].set(c)

      wb, err, cb = jax.lax.fori_loop(0, group, one_row, (wb, err, cb))
      return wb, zeros, steps, err, cb

    err = jnp.zeros((block, n_out), jnp.float32)
    cb = jnp.zeros((block, n_out), jnp.float32)
    wb, zeros, steps, err, cb = jax.lax.fori_loop(0, block // group, one_group,
                                                  (wb, zeros, steps, err, cb))
    later = jnp.where(cols >= b0 + block, ub, 0.0)                     # [block, n_blk]
    wp = wp - jnp.einsum("bn,bo->no", later, err, precision=jax.lax.Precision.HIGHEST)
    codes = jax.lax.dynamic_update_slice_in_dim(codes, cb, b0, 0)
    return wp, zeros, steps, codes

  codes = jnp.zeros((n_blk, n_out), jnp.float32)
  wp, zeros, steps, codes = jax.lax.fori_loop(0, n_blk // block, one_block,
                                              (wp, zeros, steps, codes))
  codes = jnp.zeros((n_pad, n_out), jnp.float32).at[order[:n_pad]].set(codes[:n_pad])
  return codes, zeros[: n_pad // group], steps[: n_pad // group], jnp.all(jnp.isfinite(u))


def gptq_quantize_weight(w, hessian, group: int = 128, layout: str = "packed",
                         damp: float = DEFAULT_DAMP,
                         act_order: bool = DEFAULT_ACT_ORDER) -> QuantWeight:
  """w [In, Out] -> QuantWeight by GPTQ against hessian [In, In] (sum of x x^T of its inputs; a
  numpy or device array, used in fp32). act_order: rows by decreasing H_ii on RTN's (static)
  grids, else in index order on grids fixed as each group is reached (module docstring). Runs as
  one jitted computation (`_gptq_codes`) where w is (the default device for a numpy w; sharded
  as w is over several devices)."""
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
  hessian = jnp.asarray(hessian, jnp.float32)
  if not bool(jnp.all(jnp.isfinite(hessian))):
    raise InputError("the calibration Hessian has non-finite entries")
  check_group_layout(group, layout)
  # Both committed: a numpy Hessian and one from the calibration walk share a compile.
  wp = padded_rows(jnp.asarray(w), group)
  wp, hessian = _committed((wp, hessian), wp)
  codes, zeros, steps, ok = _gptq_codes(wp, hessian, jnp.float32(damp), group=group,
                                        act_order=act_order)
  if not bool(ok):
    raise InputError(f"the damped calibration Hessian of a [{n_in}, {n_out}] weight is not "
                     f"positive definite in fp32 (damp {damp}); use a larger damp")
  return from_codes(codes.astype(jnp.uint8), steps, zeros, n_in, group, layout)


def _checked_sequences(cfg: ModelConfig, tokens) -> list[np.ndarray]:
  """One token sequence [N], or several (a list of sequences, or [B, N]) -> checked 1-D arrays."""
  if isinstance(tokens, np.ndarray) and tokens.ndim == 2:
    tokens = list(tokens)
  several = isinstance(tokens, (list, tuple)) and len(tokens) > 0 and np.ndim(tokens[0]) == 1
  seqs = [_checked_tokens(cfg, t) for t in tokens] if several else [_checked_tokens(cfg, tokens)]
  return seqs


@functools.partial(jax.jit, static_argnames=("cfg", "grams"))
def _calibration_chunk(lp, x, start, valid, k_cache, v_cache, *, cfg: ModelConfig,
                       grams: tuple[str, ...]):
  """Layer lp over one chunk x [rows, chunk, Dm] at positions start.. (valid [rows]: how many
  of the chunk's tokens each row has): its output, the chunk's K/V written into the layer's
  cache [rows, Hkv, S, D], and the input sums over the valid tokens of the linears in grams.
  Module-level, so every calibration of a config shares its compiles (a jit per instance
  compiled them again for each one)."""
  rows, chunk = x.shape[:2]
  pos = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (rows, chunk))
  cos, sin = rope_tables(cfg, pos, jnp.dtype(cfg.dtype))
  taps = {} if grams else None
  y, _, k, v = decoder_layer(cfg, lp, x, cos, sin, pos, k_cache, v_cache,
                             jnp.full((rows,), start, jnp.int32), causal_plan(chunk), taps)
  k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.transpose(0, 2, 1, 3), start, 2)
  v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.transpose(0, 2, 1, 3), start, 2)
  sums = {name: _gram(taps[name], valid) for name in grams}
  return y, k_cache, v_cache, sums


class LayerCalibration:
  """Calibration tokens' hidden states walked through the model one layer at a time, in causal
  chunks against the current layer's own KV cache:

    cal = LayerCalibration(cfg, params, tokens)   # hidden states: the embeddings
    hessians = cal.hessians(lp)                   # {name: fp32 [In, In]} of layer lp's linears
    cal.advance(lp)                               # hidden states := layer lp's outputs

  tokens: one sequence [N] or several (a list of sequences, or [B, N]), each its own causal
  context from position 0 (e.g. several documents); the Hessians sum over all of them. Sequences
  of the same number of chunks run as the rows of one batch (at most `batch` rows): 64 answers to
  chat prompts are 4 layer calls a chunk instead of 64.
  """

  def __init__(self, cfg: ModelConfig, params: Params, tokens, *, chunk: int = 512,
               batch: int = CALIBRATION_BATCH):
    seqs = _checked_sequences(cfg, tokens)
    if not isinstance(chunk, int) or chunk < 1:
      raise InputError(f"calibration chunk must be a positive integer, got {chunk!r}")
    if not isinstance(batch, int) or batch < 1:
      raise InputError(f"calibration batch must be a positive integer, got {batch!r}")
    self.cfg = cfg
    self.chunk = min(chunk, max(len(t) for t in seqs))
    self.dtype = jnp.dtype(cfg.dtype)
    # Sequences of the same number of chunks walk together, up to `batch` rows at a time; a
    # bucket's last batch is padded with empty rows (length 0, never counted) so that all of the
    # bucket's batches share one shape (one compile a bucket).
    buckets: dict[int, list[np.ndarray]] = {}
    for t in seqs:
      buckets.setdefault(-(-len(t) // self.chunk), []).append(t)
    self.batches = []              # (lengths [rows] int32, per chunk [rows, chunk, Dm])
    for n, members in sorted(buckets.items()):
      rows = min(batch, len(members))
      for first in range(0, len(members), rows):
        ids = np.zeros((rows, n * self.chunk), np.int32)
        lengths = np.zeros(rows, np.int32)
        for r, t in enumerate(members[first:first + rows]):
          ids[r, :len(t)], lengths[r] = t, len(t)
        embed = jnp.take(params["embed"], jnp.asarray(ids), axis=0).astype(self.dtype)
        # Committed, as the layer outputs that replace them are (`_committed`).
        self.batches.append((lengths, _committed([embed[:, s:s + self.chunk] for s in range(
            0, n * self.chunk, self.chunk)], params["embed"])))

  def _through(self, lp, grams: tuple[str, ...]):
    cfg = self.cfg
    out, total = [], {name: 0.0 for name in grams}
    for lengths, xs in self.batches:
      shape = (len(lengths), cfg.num_kv_heads, len(xs) * self.chunk, cfg.head_dim)
      k_cache, v_cache = _committed((jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)),
                                    xs[0])
      ys = []
      for i, x in enumerate(xs):
        start = i * self.chunk
        valid = jnp.asarray(np.clip(lengths - start, 0, self.chunk), jnp.int32)
        y, k_cache, v_cache, sums = _calibration_chunk(lp, x, jnp.int32(start), valid, k_cache,
                                                       v_cache, cfg=cfg, grams=grams)
        ys.append(y)
        for name in grams:
          total[name] = total[name] + sums[name]
      out.append((lengths, ys))
    return out, total

  def hessians(self, lp: dict, advance: bool = False,
               names: tuple[str, ...] = QUANTIZED_LINEARS) -> dict[str, jax.Array]:
    """sum x x^T (fp32 [In, In], on the device) of the inputs of layer lp's linears `names`, on
    the current hidden states; advance: the hidden states then become lp's outputs (the same
    pass)."""
    out, total = self._through(lp, grams=tuple(names))
    if advance:
      self.batches = out
    return total

  def advance(self, lp: dict) -> None:
    """The hidden states become layer lp's outputs (lp full precision, or a quantized layer)."""
    self.batches = self._through(lp, grams=())[0]


def gptq_quantize_params(cfg: ModelConfig, params: Params, tokens, *, group: int = 128,
                         layout: str = "packed", damp: float = DEFAULT_DAMP, chunk: int = 512,
                         act_order: bool = DEFAULT_ACT_ORDER,
                         sequential: bool = DEFAULT_SEQUENTIAL,
                         true_sequential: bool = DEFAULT_TRUE_SEQUENTIAL,
                         on_layer: Callable[[int, dict], None] | None = None) -> list[dict]:
  """The draft's layers: every layer's linears (`QUANTIZED_LINEARS`) GPTQ-quantized against
  calibration tokens (one sequence [N] or several, `LayerCalibration`), the rest of each layer as
  it is; layer by layer (sequential: each layer's inputs come from the quantized layers before
  it; true_sequential: within a layer too, each linear's inputs come from the layer with its
  earlier linears already quantized: one calibration pass a linear instead of one a layer).
  on_layer(i, quantized_layer) is called as each layer is done (progress, timing)."""
  for name, flag in (("sequential", sequential), ("true_sequential", true_sequential)):
    if not isinstance(flag, bool):
      raise InputError(f"GPTQ {name} must be a bool, got {flag!r}")
  cal = LayerCalibration(cfg, params, tokens, chunk=chunk)
  out = []
  last = len(params["layers"]) - 1                # the last layer's outputs feed nothing
  for i, lp in enumerate(params["layers"]):
    qlp = dict(lp)
    if true_sequential:
      for name in QUANTIZED_LINEARS:             # in the order the layer uses them
        h = cal.hessians(qlp, names=(name,))[name]
        qlp[name] = gptq_quantize_weight(lp[name], h, group, layout, damp, act_order)
        del h
      if not sequential and i < last:
        cal.advance(lp)
    else:
      hessians = cal.hessians(lp, advance=not sequential and i < last)
      qlp.update({name: gptq_quantize_weight(lp[name], hessians[name], group, layout, damp,
                                             act_order) for name in QUANTIZED_LINEARS})
      del hessians
    if on_layer is not None:
      on_layer(i, qlp)
    if sequential and i < last:                   # the next layer sees the quantized one
      cal.advance(qlp)
    out.append(qlp)
  return out


def self_generated_calibration(cfg: ModelConfig, params: Params, prompts, *,
                               max_new_tokens: int = 160,
                               max_tokens: int | None = None,
                               batch_size: int = 8) -> list[np.ndarray]:
  """Calibration sequences from the model itself: each prompt (token ids) followed by the model's
  greedy answer (dense decoding, up to max_new_tokens, batch_size prompts at a time; prompts past
  max_tokens are not decoded), at most max_tokens in all. A draft
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
  if not isinstance(batch_size, int) or batch_size < 1:
    raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
  seqs, left = [], np.inf if max_tokens is None else max_tokens
  for b in range(0, len(prompts), batch_size):
    if left <= 0:
      break
    batch = prompts[b:b + batch_size]
    for p, a in zip(batch, generate(cfg, params, batch, max_new_tokens=max_new_tokens).tokens):
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


def without_draft(params: Params) -> Params:
  """params without the draft layers they may carry (`with_draft`); the same params otherwise."""
  if isinstance(params, dict) and DRAFT_KEY in params:
    return {k: v for k, v in params.items() if k != DRAFT_KEY}
  return params
