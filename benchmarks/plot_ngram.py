"""Plot the FAFO paper's Figure 1 from ngram_decoding.py JSON files: tau against guesses per step
(FAFO vs Lookahead) and, where the files hold `--speed` rows, the batch-size-1 wall-clock speedup
over dense decoding against guesses per step.

  python benchmarks/plot_ngram.py benchmarks/results/s38/ngram_figure1_s38_h100.json \
      --out benchmarks/results/s38/ngram_figure1.png

tau comes from the `--speed` rows (B = 1) where a file has them, else from the `--sweep` rows.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHODS = (("fafo", "o-"), ("lookahead", "s--"))


def speedups(speed_rows):
  """{(prompt set, method, guesses): tokens/s over the same set's dense tokens/s}."""
  dense = {r["prompt_set"]: r["tokens_per_second"] for r in speed_rows if r["method"] == "dense"}
  return {(r["prompt_set"], r["method"], r["guesses"]): r["tokens_per_second"] / dense[r["prompt_set"]]
          for r in speed_rows if r["method"] != "dense" and r["prompt_set"] in dense}


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("files", nargs="+")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  sweep, speed, device = [], [], ""
  for path in args.files:
    with open(path) as f:
      data = json.load(f)
    if not isinstance(data, dict) or not ({"sweep", "speed"} & set(data)) or not all(
        isinstance(data.get(key, []), list) for key in ("sweep", "speed")):
      ap.error(f"{path} is not an ngram_decoding.py JSON (it has no sweep or speed rows)")
    sweep += data.get("sweep", [])
    speed += data.get("speed", [])
    device = (data.get("device") or {}).get("device_kind", "")
  tau_rows = speed or sweep
  if not tau_rows:             # a run stopped before its first row: no panel to draw
    ap.error(f"no sweep or speed rows in {', '.join(args.files)}: nothing to plot")
  gains = speedups(speed)
  sets = sorted({r["prompt_set"] for r in tau_rows})
  panels = 2 if gains else 1
  fig, axes = plt.subplots(panels, len(sets), figsize=(5 * len(sets), 4 * panels), squeeze=False)
  for col, name in enumerate(sets):
    ax = axes[0][col]
    for method, style in METHODS:
      pts = sorted((r["guesses"], r["tau"]) for r in tau_rows
                   if r["prompt_set"] == name and r["method"] == method)
      if pts:
        ax.plot(*zip(*pts), style, label=method)
    ax.set_title(f"{name}: tau (SmolLM2-135M, greedy, 256 tokens)")
    ax.set_ylabel("tau (tokens per step)")
    if gains:
      ax = axes[1][col]
      for method, style in METHODS:
        pts = sorted((g, v) for (s, m, g), v in gains.items() if s == name and m == method)
        if pts:
          ax.plot(*zip(*pts), style, label=method)
      ax.axhline(1.0, color="gray", lw=0.8)
      ax.set_title(f"{name}: tokens/s over dense, batch 1")
      ax.set_ylabel("speedup over dense")
    for ax in (axes[r][col] for r in range(panels)):
      ax.set_xlabel("guesses per step (FAFO n / Lookahead W)")
      ax.grid(alpha=0.3)
      ax.legend()
  fig.suptitle(f"FAFO vs Lookahead against guesses per step, {device}")
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
