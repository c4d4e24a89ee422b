"""How many splits (thread blocks) each query block's KV range is cut into (flash-decoding).

Shared by `decode_attention` and `sparse_attention`. A kernel launch is a list of work items:
per copy (one (row, KV head) pair; `copies` of them, all alike) and per segment, `q_blocks` query
blocks times `splits` contiguous runs of that segment's `tiles` KV tiles. The GPU hands thread
blocks to its `slots` resident places (SMs x blocks per SM) in launch order, each as soon as one
is free, so the time of a launch is the makespan of that list schedule. Each item costs its tiles
plus a fixed `overhead` (in tiles: the prologue's loads before the first tile arrives, writing the
partial and reading it back in the combine). Blocks resident on one SM stream their tiles side by
side but pay their overheads one after another (`makespan`'s sms; session 49).

`split_counts` picks, per segment, the split count whose simulated makespan is the smallest
(ties: fewer items). One rule covers the cases a fixed "fill one wave" rule got wrong: a short
list segment beside a long full-cache one (FAFO's step: 15 q blocks on a 1K list and 3 on a 32K
cache got one split each, so 24 blocks streamed the whole cache while the rest of the GPU idled),
and more q blocks than slots (Lookahead's 18 q blocks x 8 heads: one split each left a second,
nearly empty wave of full-length items).
"""

from __future__ import annotations

import functools
import heapq

OVERHEAD_TILES = 2.0     # per work item, in KV tiles (prologue latency + partial write/read)
MAX_WAVES = 16           # candidates with more items than this many waves are not simulated


def split_tiles(tiles: int, splits: int) -> list[int]:
  """Tiles of each split when `tiles` are shared out as the kernels do (cdiv per split)."""
  per = -(-tiles // splits)
  return [max(0, min(per, tiles - i * per)) for i in range(splits)]


def makespan(items: tuple[int, ...], *, copies: int, slots: int, overhead: float,
             sms: int | None = None) -> float:
  """Finish time of `copies` repeats of `items` (tiles per item, launch order) list-scheduled on
  `slots` resident places, each item taking its tiles + `overhead`.

  sms: the SMs the slots sit on, slots // sms resident blocks each (None, or not dividing
  slots: each slot its own place). Co-resident blocks' tiles overlap, their overheads do not:
  an item's overhead waits for those of the items before it on its SM, then its tiles run. The
  first wave is dealt one block an SM at a time. H200, sparse_attention with two 64-key blocks
  an SM (`benchmarks/results/s49/plan_ab_s49_h200.json`, device us a call): the plans this
  changes ran 6.12 -> 5.74 (B 8, 16K, 4 listed blocks, Tq 1), 11.07 -> 9.10 (B 1, 64 blocks),
  16.48 -> 13.13 (SmolLM2's FAFO step at 4K), faster in all 8 cells changed."""
  if slots < 1 or copies < 0:
    raise ValueError(f"makespan needs slots >= 1 and copies >= 0, got {slots}, {copies}")
  if copies == 0 or not items:
    return 0.0
  per_sm = slots // sms if sms and slots % sms == 0 else 1
  places = slots // per_sm
  if copies * len(items) <= places:
    return max(items) + overhead
  # (free time, resident slot, place): at time 0 every place's slot 0 comes before any slot 1.
  free = [(0.0, k, p) for k in range(per_sm) for p in range(places)]
  serial = [0.0] * places               # when each place's overhead chain is next free
  end = 0.0
  for _ in range(copies):
    for tiles in items:
      start, k, p = free[0]
      serial[p] = max(start, serial[p]) + overhead
      done = serial[p] + tiles
      end = max(end, done)
      heapq.heapreplace(free, (done, k, p))
  return end


@functools.lru_cache(maxsize=512)
def split_counts(segments: tuple[tuple[int, int, int | None], ...], *, copies: int, slots: int,
                 min_tiles: int, overhead: float = OVERHEAD_TILES,
                 wave_tiles: int = 0, sms: int | None = None) -> tuple[int, ...]:
  """Split count per segment.

  segments: (q_blocks, tiles, fixed) per segment in launch order, `tiles` the static bound on
  the segment's KV tiles, `fixed` a split count to keep (None: choose). copies: (row, KV head)
  pairs; slots: thread blocks resident at once (on `sms` SMs, `makespan`); min_tiles: a free
  segment gets at most tiles // min_tiles splits (never below one), so its splits average
  min_tiles tiles or more (shared out by `split_tiles`, the last may get fewer). Items run
  segment by segment, q block by q block, split by split (the model's order; warp-specialized
  sparse launches run a segment split by split).

  wave_tiles > 0 (warp-specialized launches, one block an SM, where the model alone ranks plans
  wrongly): a segment whose W = slots // (copies * q_blocks) splits would each still get
  `wave_tiles` tiles or more gets exactly W, one wave of items; the model plans the rest.
  H200, FAFO's 8B call (`benchmarks/results/s28/fafo_splits_*`): the model's (1, 12) / (1, 29)
  / (1, 30) / (3, 33) (fumble, verification) splits at 16K / 32K / 64K / 128K against (2, 8)
  with W = 8: sparse kernel 54.9 -> 52.1, 92.4 -> 86.3, 166.8 -> 159.2, 312.6 -> 300.6 us.
  Capping at W without fixing it is worse: the model then picks (1, 7), 63.4 / 100.9 us.
  """
  if slots < 1 or copies < 1 or min_tiles < 1:
    raise ValueError(f"slots, copies and min_tiles must be >= 1, got {slots}, {copies}, "
                     f"{min_tiles}")
  for qb, tiles, fixed in segments:
    if qb < 1 or tiles < 1 or (fixed is not None and fixed < 1):
      raise ValueError(f"a segment needs q_blocks >= 1, tiles >= 1 and a fixed split count >= 1 "
                       f"or None, got {(qb, tiles, fixed)}")
  if wave_tiles:
    waves = [max(1, slots // (copies * qb)) for qb, _, _ in segments]
    # W splits of cdiv(t, W) tiles, or the fewest splits of that length: cdiv(t, cdiv(t, W)).
    segments = tuple((qb, t, -(-t // -(-t // w)) if f is None and t // w >= wave_tiles else f)
                     for (qb, t, f), w in zip(segments, waves))

  def cap(tiles, fixed):
    return fixed if fixed is not None else max(1, tiles // min_tiles)

  # One item length L for the whole launch: every free segment is cut into items of at most L
  # tiles. Candidate L: each free segment's achievable item lengths.
  lengths = {1 << 62}
  for _, tiles, fixed in segments:
    if fixed is None:
      lengths.update(-(-tiles // s) for s in range(1, cap(tiles, None) + 1))

  def splits_for(length):
    return tuple(fixed if fixed is not None else min(cap(tiles, None), max(1, -(-tiles // length)))
                 for _, tiles, fixed in segments)

  def num_items(splits):
    return copies * sum(qb * s for (qb, _, _), s in zip(segments, splits))

  def key(splits):
    items = tuple(t for (qb, tiles, _), s in zip(segments, splits)
                  for _ in range(qb) for t in split_tiles(tiles, s))
    return (makespan(items, copies=copies, slots=slots, overhead=overhead, sms=sms),
            num_items(splits))

  best, best_key = None, None
  for length in sorted(lengths, reverse=True):
    splits = splits_for(length)
    if best is not None and num_items(splits) > MAX_WAVES * slots:
      break
    k = key(splits)
    if best_key is None or k < best_key:
      best, best_key = splits, k
  # Then one segment at a time (others kept), over the split counts its item lengths give, while
  # that shortens the launch: a common length misses mixes such as a short segment cut finer
  # than a long one's (test_split_plan: 1.33x the best of all vectors before this pass).
  options = [sorted({min(cap(t, None), -(-t // length)) for length in lengths if length < t} | {1})
             if f is None else [f] for _, t, f in segments]
  improved = len(segments) > 1
  while improved:
    improved = False
    for i, choices in enumerate(options):
      for s in choices:
        trial = best[:i] + (s,) + best[i + 1:]
        if num_items(trial) > MAX_WAVES * slots:
          continue
        k = key(trial)
        if k < best_key:
          best, best_key, improved = trial, k, True
  return best
