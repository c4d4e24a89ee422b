"""Plot tau against guesses per step (FAFO vs Lookahead) from ngram_decoding.py JSON files.

  python benchmarks/plot_ngram.py benchmarks/results/ngram_decoding_*_h200.json \
      --out benchmarks/results/ngram_tau_vs_guesses.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("files", nargs="+")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  rows, device = [], ""
  for path in args.files:
    with open(path) as f:
      data = json.load(f)
    rows += data["sweep"]
    device = data["device"].get("device_kind", "")
  sets = sorted({r["prompt_set"] for r in rows})
  fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False)
  for ax, name in zip(axes[0], sets):
    for method, style in (("fafo", "o-"), ("lookahead", "s--")):
      pts = sorted((r["guesses"], r["tau"]) for r in rows
                   if r["prompt_set"] == name and r["method"] == method)
      if pts:
        ax.plot(*zip(*pts), style, label=method)
    ax.set_title(f"{name} (SmolLM2-135M, greedy, 256 tokens)")
    ax.set_xlabel("guesses per step (FAFO n / Lookahead W)")
    ax.set_ylabel("tau (tokens per step)")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(f"tau vs guesses, {device}")
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
