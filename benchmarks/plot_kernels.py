"""Plots of benchmarks/kernels.py results: one PNG per kernel (runs on the CPU).

  python benchmarks/plot_kernels.py RESULTS.json [MORE.json ...] [--out-dir DIR] [--merged PATH]

  decode.png  GB/s against S, one panel per (B, Tq): decode_attention and the references, the
              measured read bandwidth and 85% of it.
  sparse.png  time against the listed fraction of blocks, one panel per (B, Tq), per S:
              sparse_attention, its jnp reference, decode_attention at that S (horizontal) and
              the time to read just the listed blocks at the measured read bandwidth.
  quant.png   time against S, one panel per (B, Tq): quant_attention at 4 and 8 bits, their jnp
              references, decode_attention on the bf16 cache.
  fafo.png    FAFO's two-segment launch next to its reference and decode_attention.

Several JSONs (e.g. one per device invocation) are merged: measurements are concatenated, a later
file's entry replacing an earlier one of the same kernel, impl and shape (`--exclude
KERNEL:IMPL_PREFIX` leaves some out); the targets are recomputed over the merged set and printed
(and written with --merged).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._targets import compute_targets, format_targets  # noqa: E402

KEY_FIELDS = ("kernel", "impl", "B", "S", "Tq", "bits", "listed_blocks", "sparse_queries",
              "block_size")
KERNEL_STYLE = dict(linewidth=2.4, marker="o", zorder=5)
REF_STYLE = dict(linewidth=1.2, marker=".", alpha=0.85)
BITS_COLORS = {4: "tab:green", 8: "tab:red"}


def load(paths: list[str], exclude: tuple[str, ...] = ()) -> dict:
  """Merged results: the first file's metadata, all measurements (later ones win), less those
  matching an `exclude` entry "KERNEL:IMPL_PREFIX"."""
  merged, by_key = None, {}
  for path in paths:
    with open(path) as f:
      results = json.load(f)
    if not isinstance(results, dict) or not isinstance(results.get("measurements"), list):
      raise SystemExit(f"{path} is not a kernels.py JSON (it has no measurements list)")
    if merged is None:
      merged = {k: v for k, v in results.items()
                if k not in ("measurements", "targets", "targets_device_time")}
      merged["sources"] = []
    merged["sources"].append(dict(path=path, device=results.get("device"),
                                  read_bandwidth=results.get("read_bandwidth"),
                                  argv=results.get("argv")))
    for m in results.get("measurements", []):
      if any(m.get("kernel") == kernel and str(m.get("impl", "")).startswith(impl)
             for kernel, impl in (e.split(":", 1) for e in exclude)):
        continue
      by_key[tuple(m.get(k) for k in KEY_FIELDS)] = m
  merged["measurements"] = list(by_key.values())
  merged["targets"] = compute_targets(merged["measurements"])
  merged["targets_device_time"] = compute_targets(merged["measurements"], "device_us_per_call")
  return merged


def _timed(ms, **keys):
  return [m for m in ms if "us_per_call" in m and all(m.get(k) == v for k, v in keys.items())]


def fastest_decode(ms, b: int, tq: int) -> dict[int, float]:
  """S -> the fastest decode_attention us per call at (B, Tq) over every run merged (the decode
  grid's and the quant and sparse grids' own baselines), the time the targets take."""
  fastest = {}
  for m in _timed(ms, impl="decode_attention", B=b, Tq=tq):
    fastest[m["S"]] = min(fastest.get(m["S"], m["us_per_call"]), m["us_per_call"])
  return fastest


def _grid(ms, title):
  """A figure with one panel per (B, Tq) present in ms; returns (fig, {(B, Tq): axis})."""
  batches = sorted({m["B"] for m in ms})
  tqs = sorted({m["Tq"] for m in ms})
  fig, axes = plt.subplots(len(batches), len(tqs), figsize=(4.2 * len(tqs), 3.4 * len(batches)),
                           squeeze=False)
  fig.suptitle(title)
  panels = {}
  for i, b in enumerate(batches):
    for j, tq in enumerate(tqs):
      ax = axes[i][j]
      ax.set_title(f"B={b}, Tq={tq}", fontsize=10)
      ax.grid(True, which="both", alpha=0.3)
      panels[(b, tq)] = ax
  return fig, panels


def _tokens(s: int) -> str:
  return f"{s // 1024}K" if s >= 1024 and s % 1024 == 0 else str(s)


def _seq_axis(ax, seqs):
  ax.set_xscale("log", base=2)
  ax.set_xticks(seqs)
  ax.set_xticklabels([_tokens(s) for s in seqs])
  ax.set_xlabel("S (cache length)")


def _finish(fig, path):
  handles, labels = {}, {}
  for ax in fig.axes:
    for h, label in zip(*ax.get_legend_handles_labels()):
      labels.setdefault(label, h)
  handles = list(labels.values())
  ncol = max(1, min(len(handles), int(fig.get_figwidth() // 2.8)))
  rows = -(-len(handles) // ncol)
  fig.legend(handles, list(labels), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, min(0.4, 0.24 * rows / fig.get_figheight()), 1, 0.95))
  fig.savefig(path, dpi=110)
  plt.close(fig)
  print("wrote", path)


def _read_bw(ms):
  values = [m["read_bw_gb_per_s"] for m in ms if m.get("read_bw_gb_per_s")]
  return sum(values) / len(values) if values else None


def plot_decode(ms, device, path):
  ms = _timed(ms, kernel="decode")
  if not ms:
    return
  fig, panels = _grid(ms, f"decode_attention vs references ({device}): achieved GB/s")
  bw = _read_bw(ms)
  impls = sorted({m["impl"] for m in ms}, key=lambda i: (i != "decode_attention", i))
  for (b, tq), ax in panels.items():
    for impl in impls:
      pts = sorted((m["S"], m["gb_per_s"]) for m in ms if m["B"] == b and m["Tq"] == tq
                   and m["impl"] == impl)
      if pts:
        style = KERNEL_STYLE if impl == "decode_attention" else REF_STYLE
        ax.plot(*zip(*pts), label=impl, **style)
    if bw:
      ax.axhline(bw, color="black", linestyle="--", linewidth=1, label="measured read BW")
      ax.axhline(0.85 * bw, color="gray", linestyle=":", linewidth=1, label="85% of read BW")
    _seq_axis(ax, sorted({m["S"] for m in ms}))
    ax.set_ylabel("GB/s")
  _finish(fig, path)


def plot_sparse(ms, device, path):
  sparse = _timed(ms, kernel="sparse")
  if not sparse:
    return
  fig, panels = _grid(sparse, f"sparse_attention ({device}): time vs listed blocks")
  seqs = sorted({m["S"] for m in sparse})
  colors = dict(zip(seqs, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  for (b, tq), ax in panels.items():
    for s in seqs:
      here = [m for m in sparse if m["B"] == b and m["Tq"] == tq and m["S"] == s]
      label = _tokens(s)
      for impl, style, name in (("sparse_attention", KERNEL_STYLE, "sparse_attention"),
                                ("jnp_reference", dict(REF_STYLE, linestyle=":"), "jnp reference")):
        pts = sorted((m["listed_fraction"], m["us_per_call"]) for m in here if m["impl"] == impl)
        if pts:
          ax.plot(*zip(*pts), color=colors[s], label=f"{name}, S={label}", **style)
      ideal = sorted((m["listed_fraction"], m["ideal_read_us"]) for m in here
                     if m["impl"] == "sparse_attention" and m.get("ideal_read_us"))
      if ideal:
        ax.plot(*zip(*ideal), color=colors[s], linestyle="--", linewidth=0.8,
                label=f"read listed blocks at read BW, S={label}")
      dec = fastest_decode(ms, b, tq).get(s)
      if dec is not None:
        ax.axhline(dec, color=colors[s], linestyle="-.", linewidth=1,
                   label=f"decode_attention (dense), S={label}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    fractions = sorted({m["listed_fraction"] for m in sparse if "listed_fraction" in m})
    ax.set_xticks(fractions)
    ax.set_xticklabels([f"{100 * f:.3g}%" for f in fractions])
    ax.minorticks_off()
    ax.set_xlabel("listed fraction of blocks")
    ax.set_ylabel("us per call")
  _finish(fig, path)


def plot_quant(ms, device, path):
  quant = _timed(ms, kernel="quant")
  if not quant:
    return
  fig, panels = _grid(quant, f"quant_attention ({device}): time vs S")
  seqs = sorted({m["S"] for m in quant})
  impls = sorted({m["impl"] for m in quant if m["impl"] != "decode_attention"})
  for (b, tq), ax in panels.items():
    dec = sorted((s, us) for s, us in fastest_decode(ms, b, tq).items() if s in seqs)
    if dec:
      ax.plot(*zip(*dec), color="black", label="decode_attention (bf16)", **KERNEL_STYLE)
    for impl in impls:
      pts = sorted((m["S"], m["us_per_call"], m.get("bits")) for m in quant if m["B"] == b
                   and m["Tq"] == tq and m["impl"] == impl)
      if pts:
        kernel = impl.startswith("quant_attention")
        style = KERNEL_STYLE if kernel else dict(REF_STYLE, linestyle=":")
        color = BITS_COLORS.get(pts[0][2])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=impl, color=color, **style)
    _seq_axis(ax, seqs)
    ax.set_yscale("log")
    ax.set_ylabel("us per call")
  _finish(fig, path)


def plot_fafo(ms, device, path):
  fafo = _timed(ms, kernel="fafo")
  if not fafo:
    return
  fafo.sort(key=lambda m: (m["S"], m["impl"]))
  labels = [f"S={_tokens(m['S'])} Tq={m['sparse_queries']}+{m['full_queries']}: {m['impl']}"
            for m in fafo]
  times = [m["us_per_call"] for m in fafo]
  fig, ax = plt.subplots(figsize=(9, 0.5 * len(fafo) + 1.5))
  bars = ax.barh(range(len(fafo)), times, color="tab:blue")
  ax.set_yticks(range(len(fafo)))
  ax.set_yticklabels(labels, fontsize=8)
  ax.bar_label(bars, labels=[f"{t:.1f} us" for t in times], fontsize=8, padding=3)
  ax.set_xlim(0, 1.2 * max(times))
  ax.set_xlabel("us per call")
  ax.set_title(f"FAFO two-segment launch ({device})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  print("wrote", path)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("results", nargs="+", help="kernels.py JSON file(s)")
  p.add_argument("--out-dir", help="where the PNGs go (default: next to the first JSON, or "
                 "benchmarks/results/ when that is not writable)")
  p.add_argument("--merged", help="also write the merged JSON (recomputed targets) here")
  p.add_argument("--exclude", action="append", default=[], metavar="KERNEL:IMPL_PREFIX",
                 help="leave out these measurements (e.g. quant:jnp_reference); repeatable")
  args = p.parse_args(argv)
  for e in args.exclude:
    if ":" not in e:
      p.error(f"--exclude takes KERNEL:IMPL_PREFIX, got {e!r}")
  results = load(args.results, tuple(args.exclude))
  out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.results[0]))
  if not args.out_dir and not os.access(out_dir, os.W_OK):      # e.g. a read-only fetch dir
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
  os.makedirs(out_dir, exist_ok=True)
  ms, device = results["measurements"], results.get("device", "?")
  plot_decode(ms, device, os.path.join(out_dir, "decode.png"))
  plot_sparse(ms, device, os.path.join(out_dir, "sparse.png"))
  plot_quant(ms, device, os.path.join(out_dir, "quant.png"))
  plot_fafo(ms, device, os.path.join(out_dir, "fafo.png"))
  for key in ("targets", "targets_device_time"):
    if key in results:
      print(f"{key} ({results[key].get('statistic', 'us_per_call')}):")
      for line in format_targets(results[key]):
        print("  " + line)
  if args.merged:
    with open(args.merged, "w") as f:
      json.dump(results, f, indent=1)
    print("wrote", args.merged)
  return 0


if __name__ == "__main__":
  sys.exit(main())
