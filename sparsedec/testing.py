"""Assertions for users' test suites: a decoding method equals dense decoding.

  from sparsedec import testing
  testing.assert_matches_dense(cfg, params, prompts, method="dense", max_new_tokens=64)
  testing.assert_forward_matches_dense(cfg, params, tokens, my_forward, atol=1e-5)
  testing.assert_sampling_matches_dense(cfg, params, prompt, method=..., sampling=...)

On failure the message names, per row, the first divergent position, the two tokens and the
dense model's logit margin between them there (a near-tie in bf16 shows as a tiny margin).
Sampling is compared as a law: a chi-square test of homogeneity over many seeds (needs scipy,
the `test` extra).
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
from typing import Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from sparsedec.attention import causal_plan
from sparsedec.decode.api import GenerationResult, generate
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.errors import InputError, is_int
from sparsedec.kv.dense import init_cache
from sparsedec.model.config import ModelConfig
from sparsedec.model.forward import forward
from sparsedec.model.params import Params


@dataclasses.dataclass(frozen=True)
class Divergence:
  row: int
  position: int            # index into the generated tokens
  actual: int | None       # None: actual ended here
  expected: int | None     # None: expected ended here
  margin: float | None = None     # dense logit[expected] - logit[actual] at that position
  top2_margin: float | None = None  # dense top-1 minus top-2 logit there

  def describe(self) -> str:
    s = f"row {self.row}: first divergence at generated position {self.position}: "
    if self.actual is None:
      s += f"the output ended after {self.position} tokens, dense went on with {self.expected}"
    elif self.expected is None:
      s += f"got {self.actual}, dense had ended after {self.position} tokens"
    else:
      s += f"got {self.actual}, dense gave {self.expected}"
    if self.margin is not None:
      s += f" (dense logit margin expected-actual {self.margin:.6g}"
      s += f", top-2 margin {self.top2_margin:.6g})"
    return s


def first_divergence(actual: Sequence[int], expected: Sequence[int]) -> int | None:
  """Index of the first position where the sequences differ (or one ends), else None."""
  for i, (a, e) in enumerate(zip(actual, expected)):
    if a != e:
      return i
  return None if len(actual) == len(expected) else min(len(actual), len(expected))


def dense_logits(cfg: ModelConfig, params: Params, tokens: Sequence[int]) -> np.ndarray:
  """Teacher-forced fp32 logits [T, V] of the dense model over one token sequence, with the jnp
  reference attention whatever cfg.attention says: the oracle, and no kernel takes the
  one-slot empty cache it runs over ("pallas" refused it; "auto" warned on a GPU for each call,
  i.e. for each divergence `find_divergences` looked at)."""
  t = len(tokens)
  cache = init_cache(cfg, 1, 1)
  logits, _ = jax.jit(forward, static_argnums=0)(
      cfg.replace(attention="reference"), params, jnp.asarray([tokens], jnp.int32),
      jnp.arange(t, dtype=jnp.int32)[None], cache, causal_plan(t))
  return np.asarray(logits[0])


def _token_rows(rows, what: str) -> list[list[int]]:
  """One token-id list per row, from lists / arrays of them or a GenerationResult (its tokens);
  anything else (a flat list of ids, a row of non-integers) raises InputError naming `what`."""
  if isinstance(rows, GenerationResult):
    rows = rows.tokens
  rows = rows.tolist() if hasattr(rows, "tolist") else rows
  out = []
  for row in rows if isinstance(rows, (list, tuple)) else [rows]:
    row = row.tolist() if hasattr(row, "tolist") else row
    if not isinstance(row, (list, tuple)) or not all(is_int(t) for t in row):
      raise InputError(f"{what} must be one list of token ids per row (or a GenerationResult), "
                       f"got {rows!r:.80}")
    out.append([int(t) for t in row])
  return out


def find_divergences(actual, expected, cfg: ModelConfig | None = None,
                     params: Params | None = None,
                     prompts: Sequence[Sequence[int]] | None = None) -> list[Divergence]:
  """Per-row first divergences of `actual` from `expected` (each one token-id list per row, or a
  GenerationResult); with cfg/params/prompts, the dense margins there too."""
  actual, expected = _token_rows(actual, "actual"), _token_rows(expected, "expected")
  if len(actual) != len(expected):
    raise AssertionError(f"{len(actual)} rows of output against {len(expected)} expected")
  out = []
  for row, (a, e) in enumerate(zip(actual, expected)):
    pos = first_divergence(a, e)
    if pos is None:
      continue
    at = a[pos] if pos < len(a) else None
    et = e[pos] if pos < len(e) else None
    margin = top2 = None
    if cfg is not None and params is not None and prompts is not None:
      logits = dense_logits(cfg, params, list(prompts[row]) + list(e[:pos]))[-1]
      top = np.sort(logits)[-2:]
      top2 = float(top[1] - top[0])
      if at is not None and et is not None:
        margin = float(logits[et] - logits[at])
    out.append(Divergence(row, pos, at, et, margin, top2))
  return out


def assert_tokens_equal(actual, expected, *, cfg: ModelConfig | None = None,
                        params: Params | None = None,
                        prompts: Sequence[Sequence[int]] | None = None,
                        label: str = "method") -> None:
  """Raise AssertionError with a per-row report of the first divergence, if any. `actual` and
  `expected`: one token-id list per row, or a GenerationResult."""
  actual = _token_rows(actual, "actual")
  divs = find_divergences(actual, expected, cfg, params, prompts)
  if divs:
    lines = [f"{label} output differs from dense decoding in {len(divs)} of {len(actual)} rows:"]
    lines += ["  " + d.describe() for d in divs]
    raise AssertionError("\n".join(lines))


def assert_matches_dense(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], *,
                         method, max_new_tokens: int,
                         expected: Sequence[Sequence[int]] | GenerationResult | None = None,
                         **generate_kwargs) -> GenerationResult:
  """Generate with `method` and with dense decoding (greedy unless `sampling` is given) and
  assert the tokens are identical. Pass `expected` (a dense GenerationResult or its tokens) to
  reuse a dense result. Returns the method's result.

  Token identity is the claim of greedy decoding. With sampling, the lossless speculative
  methods (FAFO, Lookahead, QuantSpec) keep dense decoding's distribution but draw their random
  numbers differently, so the same seed gives other tokens: compare distributions over many
  seeds instead (`assert_sampling_matches_dense`)."""
  result = generate(cfg, params, prompts, method=method, max_new_tokens=max_new_tokens,
                    **generate_kwargs)
  if expected is None:
    expected = generate(cfg, params, prompts, method="dense", max_new_tokens=max_new_tokens,
                        **generate_kwargs).tokens
  name = method if isinstance(method, str) else getattr(method, "name", type(method).__name__)
  assert_tokens_equal(result.tokens, expected, cfg=cfg, params=params, prompts=prompts,
                      label=name)
  return result


def assert_forward_matches_dense(cfg: ModelConfig, params: Params, tokens: np.ndarray,
                                 forward_fn: Callable[[jax.Array], jax.Array], *,
                                 atol: float = 1e-5, rtol: float = 1e-5) -> None:
  """forward_fn(tokens [B, T]) -> logits [B, T, V] must equal the dense teacher-forced logits
  within atol/rtol (chex.assert_trees_all_close); the message names the worst position."""
  tokens = np.asarray(tokens, np.int32)
  chex.assert_rank(tokens, 2)
  expected = np.stack([dense_logits(cfg, params, row.tolist()) for row in tokens])
  actual = forward_fn(jnp.asarray(tokens))
  if isinstance(actual, (tuple, list)):
    raise InputError(f"forward_fn must return the logits [B, T, V] as one array, got a "
                     f"{type(actual).__name__} of {len(actual)} (sparsedec's forward returns "
                     f"(logits, cache): take its [0])")
  actual = np.asarray(actual, np.float32)
  chex.assert_shape(actual, expected.shape)
  try:
    chex.assert_trees_all_close(actual, expected, atol=atol, rtol=rtol)
  except AssertionError as err:
    err_abs = np.abs(actual - expected)
    b, t, v = np.unravel_index(int(np.argmax(err_abs)), err_abs.shape)
    raise AssertionError(
        f"logits differ from dense: worst at row {b}, position {t}, token {v}: "
        f"{actual[b, t, v]:.6g} vs {expected[b, t, v]:.6g} (|diff| {err_abs[b, t, v]:.3g}, "
        f"atol {atol}, rtol {rtol})\n{err}") from None


@dataclasses.dataclass(frozen=True)
class SamplingComparison:
  """What `assert_sampling_matches_dense` compared: the method's run, the chi-square test's
  p-value and its [2, C] table of counts (row 0 the method, row 1 dense) over the categories
  (the first tokens of each row as a tuple; the last category, "rare", pools the tuples seen
  fewer than `min_count` times in both samples together)."""
  result: GenerationResult
  pvalue: float
  table: np.ndarray
  categories: tuple


def homogeneity_test(a: Sequence[tuple], b: Sequence[tuple], *,
                     min_count: int = 10) -> tuple[float, np.ndarray, tuple]:
  """Chi-square test of homogeneity of two samples of hashable outcomes (token tuples): (p-value,
  [2, C] counts, categories). Outcomes seen fewer than `min_count` times in both samples together
  share one "rare" bin (the chi-square approximation needs cells that are not tiny)."""
  try:
    from scipy import stats
  except ImportError as err:
    raise ImportError("the sampling comparison needs scipy (pip install 'sparsedec[test]')"
                      ) from err
  seen = collections.Counter(a), collections.Counter(b)
  cats = sorted(set(seen[0]) | set(seen[1]))
  counts = np.array([[s[c] for c in cats] for s in seen])                  # [2, C]
  common = counts.sum(0) >= min_count
  table = np.concatenate([counts[:, common], counts[:, ~common].sum(1, keepdims=True)], axis=1)
  names = tuple(c for c, keep in zip(cats, common) if keep) + ("rare",)
  filled = table.sum(0) > 0
  table, names = table[:, filled], tuple(n for n, keep in zip(names, filled) if keep)
  if table.shape[1] < 2:
    raise InputError(f"both samples are one outcome ({names[0]!r}): a test of homogeneity "
                     f"cannot tell two laws apart there (sample a spread-out law: a higher "
                     f"temperature, more tokens or more rows)")
  return float(stats.chi2_contingency(table).pvalue), table, names


def assert_sampling_matches_dense(cfg: ModelConfig, params: Params, prompt: Sequence[int], *,
                                  method, sampling: SamplingConfig, num_tokens: int = 3,
                                  rows: int = 600, seed: int = 0, alpha: float = 1e-3,
                                  min_count: int = 10, batch_size: int | None = None,
                                  expected: Sequence[Sequence[int]] | GenerationResult | None
                                  = None, **generate_kwargs) -> SamplingComparison:
  """Sample `num_tokens` tokens after `prompt` in `rows` rows (per-row seeds) with
  `method` and with dense decoding, and assert that the joint law of those tokens is the same: a
  chi-square test of homogeneity (`homogeneity_test`) fails at p < alpha. For a lossless method
  this fails by chance with probability alpha (the false-alarm rate), for a biased one with a
  probability that grows with `rows`.

  The two runs draw from disjoint seeds (dense: seed .. seed + rows - 1, the method: seed + rows
  .. seed + 2 rows - 1): a speculative method consumes its random numbers differently, so
  equal seeds give unrelated tokens, and disjoint ones keep the samples independent. Pass
  `expected` (dense's result or its tokens, sampled alike from other seeds) to reuse a dense
  sample. batch_size: rows per generate call (default: all `rows` in one batch; a model too big
  for that many rows at once samples them in batches, the same seeds). generate_kwargs go to
  both runs (e.g. stop_tokens=(), so that rows are not cut short). Returns the comparison (its
  table names what was seen; `result` is the method's run, its last batch with batch_size)."""
  if not isinstance(sampling, SamplingConfig) or sampling.greedy:
    raise InputError(f"sampling must be a non-greedy SamplingConfig, got {sampling!r}: greedy "
                     f"output is compared token by token (assert_matches_dense)")
  batch_size = rows if batch_size is None else batch_size
  for name, value, low in (("num_tokens", num_tokens, 1), ("rows", rows, 2),
                           ("min_count", min_count, 1), ("batch_size", batch_size, 1)):
    if not is_int(value) or value < low:
      raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
  if not (isinstance(alpha, numbers.Real) and 0.0 < alpha < 1.0):
    raise InputError(f"alpha (the false-alarm rate) must be in (0, 1), got {alpha!r}")

  def run(m, first: int) -> tuple[GenerationResult, list]:
    """The rows sampled with method m from seeds first .. first + rows - 1: (last run, tokens)."""
    tokens = []
    for start in range(first, first + rows, batch_size):
      n = min(batch_size, first + rows - start)
      out = generate(cfg, params, [list(prompt)] * n, method=m, max_new_tokens=num_tokens,
                     sampling=sampling, seed=list(range(start, start + n)), **generate_kwargs)
      tokens += out.tokens
    return out, tokens

  if expected is not None:
    dense = expected.tokens if isinstance(expected, GenerationResult) else expected
    if len(dense) != rows:
      raise InputError(f"expected holds {len(dense)} rows, not rows={rows}")
  result, tokens = run(method, seed + rows)
  if expected is None:
    dense = run("dense", seed)[1]
  sample = lambda rows_: [tuple(int(t) for t in r[:num_tokens]) for r in rows_]  # noqa: E731
  pvalue, table, cats = homogeneity_test(sample(tokens), sample(dense),
                                         min_count=min_count)
  comparison = SamplingComparison(result, pvalue, table, cats)
  if pvalue < alpha:
    name = method if isinstance(method, str) else getattr(method, "name", type(method).__name__)
    cells = ", ".join(f"{c}: {m} vs {d}" for c, m, d in zip(cats, table[0], table[1]))
    raise AssertionError(f"{name} sampling differs from dense sampling: chi-square p = "
                         f"{pvalue:.3g} < alpha {alpha:g} over {rows} rows each (first "
                         f"{num_tokens} tokens; method vs dense counts: {cells})")
  return comparison
