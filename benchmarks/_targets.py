"""The kernel benchmark's targets (kernels issue), computed from its measurements.

Pure Python (no jax), shared by benchmarks/kernels.py (its JSON's "targets" section) and
benchmarks/plot_kernels.py (recomputed over merged JSONs). Each measurement carries its own run's
read bandwidth (`read_bw_gb_per_s`), so runs from several invocations can be merged.
"""

from __future__ import annotations

from typing import Sequence

# name: (threshold, comparison, what the ratio is)
TARGETS = {
    "decode_read_bw": (0.85, ">=", "decode_attention GB/s / measured read GB/s (S >= 16K)"),
    "decode_vs_best_reference": (1.0, ">=", "fastest reference's time / decode_attention time "
                                 "(same B, S, Tq; references that ran and matched)"),
    "quant4_vs_decode": (3.5, ">=", "decode_attention (bf16) time / quant_attention 4-bit time "
                         "(S = 64K, Tq = 1)"),
    "quant8_vs_decode": (1.8, ">=", "decode_attention (bf16) time / quant_attention 8-bit time "
                         "(S = 64K, Tq = 1)"),
    "sparse_vs_decode": (20.0, ">=", "decode_attention time / sparse_attention time (S = 16K, "
                         "~1.6% of blocks listed)"),
    "sparse_vs_listed_read": (1.3, "<=", "sparse_attention time / (listed K/V bytes / measured "
                              "read GB/s) (S = 16K, ~1.6% of blocks listed)"),
}
HEADLINE_FRACTION = (0.01, 0.025)           # what counts as "~1.6% of blocks listed"


def _check(name: str, m: dict, ratio: float, **info) -> dict:
  threshold, cmp, _ = TARGETS[name]
  met = ratio >= threshold if cmp == ">=" else ratio <= threshold
  correct = m.get("ok") is not False
  out = dict(target=name, B=m["B"], S=m["S"], Tq=m["Tq"], ratio=ratio, threshold=threshold,
             comparison=cmp, passed=bool(met and correct), **info)
  if not correct:
    out["note"] = "kernel output did not match its reference"
  return out


def _same_shape(a: dict, b: dict) -> bool:
  return all(a.get(k) == b.get(k) for k in ("B", "S", "Tq"))


TIME_KEYS = {
    "us_per_call": "timed loop: wall time per call of calls chained in one jit (launch gaps and "
                   "the loop's own select included)",
    "device_us_per_call": "profiler: GPU busy time per call (the summed durations of the call's "
                          "kernels; no launch gaps)",
}


def compute_targets(measurements: Sequence[dict], time_key: str = "us_per_call") -> dict:
  """Each target's ratio and pass/fail per (B, S, Tq) measured (see TARGETS), and a summary,
  with times read from `time_key` (one of TIME_KEYS)."""
  timed = [m for m in measurements if m.get(time_key)]

  def decode_us(m):
    found = [r[time_key] for r in timed
             if r["impl"] == "decode_attention" and _same_shape(m, r)]
    return min(found, default=None)

  checks = []
  for m in timed:
    us = m[time_key]
    if m["kernel"] == "decode" and m["impl"] == "decode_attention" and m["S"] >= 16384:
      if m.get("read_bw_gb_per_s"):
        gb_per_s = m["bytes"] / us / 1e3
        checks.append(_check("decode_read_bw", m, gb_per_s / m["read_bw_gb_per_s"],
                             us_per_call=us, gb_per_s=gb_per_s,
                             read_bw_gb_per_s=m["read_bw_gb_per_s"]))
      refs = [r for r in timed if r["kernel"] == "decode" and r["role"] == "reference"
              and _same_shape(m, r) and r.get("ok") is not False]
      if refs:
        best = min(refs, key=lambda r: r[time_key])
        checks.append(_check("decode_vs_best_reference", m, best[time_key] / us,
                             us_per_call=us, best_reference=best["impl"],
                             best_reference_us=best[time_key]))
    if m["kernel"] == "quant" and m["role"] == "kernel" and m["S"] == 65536 and m["Tq"] == 1:
      dec = decode_us(m)
      if dec is not None:
        checks.append(_check(f"quant{m['bits']}_vs_decode", m, dec / us,
                             us_per_call=us, decode_us=dec))
    if (m["kernel"] == "sparse" and m["impl"] == "sparse_attention" and m["S"] == 16384
        and HEADLINE_FRACTION[0] <= m["listed_fraction"] <= HEADLINE_FRACTION[1]):
      info = dict(us_per_call=us, listed_blocks=m["listed_blocks"],
                  listed_fraction=m["listed_fraction"])
      dec = decode_us(m)
      if dec is not None:
        checks.append(_check("sparse_vs_decode", m, dec / us, decode_us=dec, **info))
      if m.get("read_bw_gb_per_s"):
        ideal = m["listed_kv_bytes"] / m["read_bw_gb_per_s"] / 1e3
        checks.append(_check("sparse_vs_listed_read", m, us / ideal,
                             ideal_read_us=ideal, **info))

  summary = {}
  for name, (threshold, cmp, what) in TARGETS.items():
    mine = [c for c in checks if c["target"] == name]
    summary[name] = dict(what=what, threshold=threshold, comparison=cmp, measured=len(mine),
                         passed=sum(c["passed"] for c in mine),
                         all_passed=bool(mine) and all(c["passed"] for c in mine))
  return dict(time_key=time_key, statistic=TIME_KEYS[time_key], summary=summary, checks=checks)


def format_targets(targets: dict) -> list[str]:
  """Human-readable lines: one per target, then one per check."""
  lines = []
  for name, s in targets["summary"].items():
    lines.append(f"target {name}: {s['passed']}/{s['measured']} passed "
                 f"({s['comparison']} {s['threshold']}; {s['what']})")
  for c in targets["checks"]:
    note = f" ({c['note']})" if "note" in c else ""
    lines.append(f"  {c['target']} B={c['B']} S={c['S']} Tq={c['Tq']}: ratio {c['ratio']:.3f} "
                 f"{'PASS' if c['passed'] else 'FAIL'}{note}")
  return lines
