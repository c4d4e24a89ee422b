"""The kernel benchmark's pure parts on the CPU (fast): the timing helpers, the block lists, the
targets section and the plots, on synthetic measurements. The benchmark itself runs on a GPU;
`python benchmarks/kernels.py --dry-run` exercises all of its code paths in interpret mode (~3
minutes, not part of the suite)."""

from __future__ import annotations

import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

import rand  # noqa: E402
from benchmarks._targets import compute_targets, format_targets  # noqa: E402
from benchmarks._timing import max_abs_err, num_calls_for, time_loop  # noqa: E402

READ_BW = 3000.0                                                        # GB/s


def _entry(kernel, impl, role, b, s, tq, us, nbytes, **extra):
  gb = nbytes / us / 1e3
  return dict(kernel=kernel, impl=impl, role=role, B=b, S=s, Tq=tq, bytes=nbytes,
              us_per_call=us, gb_per_s=gb, read_bw_gb_per_s=READ_BW,
              fraction_of_read_bw=gb / READ_BW, **extra)


def synthetic_measurements() -> list[dict]:
  """Plausible H100-like numbers for every kernel (B = 1, 8; a few S and Tq)."""
  ms = []
  for b in (1, 8):
    for s in (4096, 16384, 65536):
      kv = 2 * b * 8 * s * 128 * 2
      for tq in (1, 16):
        ms.append(_entry("decode", "decode_attention", "kernel", b, s, tq,
                         kv / (0.88 * READ_BW * 1e3) + 5, kv, max_err=2e-3, ok=True))
        ms.append(_entry("decode", "jnp_reference", "reference", b, s, tq,
                         kv / (0.7 * READ_BW * 1e3) * tq ** 0.5 + 8, kv))
        ms.append(_entry("decode", "jax.nn.dot_product_attention[cudnn]", "reference", b, s, tq,
                         kv / (0.8 * READ_BW * 1e3) + 10, kv, max_err=0.5, ok=False))
      for bits, speed in ((4, 3.6), (8, 1.9)):
        for tq in (1, 16):
          dec = kv / (0.88 * READ_BW * 1e3) + 5
          ms.append(_entry("quant", f"quant_attention[{bits}bit]", "kernel", b, s, tq,
                           dec / speed, kv * (bits / 16 + 0.02), bits=bits, ok=True,
                           max_err=1e-3))
          ms.append(_entry("quant", f"jnp_reference[{bits}bit]", "reference", b, s, tq,
                           dec * 3, kv * (bits / 16 + 0.02), bits=bits))
    for s in (16384, 65536):
      kv = 2 * b * 8 * s * 128 * 2
      for tq in (1, 16):
        for listed_fraction in (1 / 64, 1 / 16, 1 / 4, 1.0):
          listed = listed_fraction * kv
          ideal = listed / READ_BW / 1e3
          extra = dict(listed_fraction=listed_fraction, listed_blocks=int(listed_fraction * s / 64),
                       listed_kv_bytes=listed, ideal_read_us=ideal, ok=True, max_err=1e-3)
          ms.append(_entry("sparse", "sparse_attention", "kernel", b, s, tq, 1.2 * ideal + 0.5,
                           listed, **extra))
          ms.append(_entry("sparse", "jnp_reference", "reference", b, s, tq, 3 * ideal + 20,
                           listed, **extra))
  kv = 2 * 8 * 16384 * 128 * 2
  for impl, us in (("sparse_attention (two segments)", 60.0), ("jnp_reference", 300.0),
                   ("decode_attention (all queries on the full cache)", 45.0)):
    ms.append(_entry("fafo", impl, "kernel", 1, 16384, 80, us, kv, sparse_queries=64,
                     full_queries=16))
  return ms


def test_targets_on_synthetic_measurements():
  targets = compute_targets(synthetic_measurements())
  summary = targets["summary"]
  assert summary["decode_read_bw"]["measured"] == 8        # B x S >= 16K x Tq
  by = {(c["target"], c["B"], c["S"], c["Tq"]): c for c in targets["checks"]}
  big = by[("decode_read_bw", 8, 65536, 1)]
  assert big["passed"] and 0.85 < big["ratio"] < 0.88
  # The cudnn entry did not match its reference: it does not count as the best reference.
  vs_ref = by[("decode_vs_best_reference", 1, 16384, 1)]
  assert vs_ref["best_reference"] == "jnp_reference" and vs_ref["passed"]
  assert by[("quant4_vs_decode", 1, 65536, 1)]["ratio"] == pytest.approx(3.6)
  assert by[("quant8_vs_decode", 8, 65536, 1)]["passed"]
  assert ("quant4_vs_decode", 1, 65536, 16) not in by     # Tq = 1 only
  sparse = by[("sparse_vs_listed_read", 1, 16384, 1)]
  assert sparse["ratio"] > 1.3 and not sparse["passed"]    # the 0.5 us launch cost dominates
  assert by[("sparse_vs_decode", 8, 16384, 16)]["ratio"] > 20
  assert ("sparse_vs_decode", 1, 65536, 1) not in by       # S = 16K only
  assert len(format_targets(targets)) == len(summary) + len(targets["checks"])


def test_a_kernel_that_did_not_match_fails_its_targets_and_none_measured_is_not_passed():
  """A kernel whose output did not match its reference (ok False) fails every target it is
  measured on however fast it is, with a note; a target with no measurement is not all_passed."""
  ms = synthetic_measurements()
  for m in ms:
    if m["kernel"] == "quant" and m["role"] == "kernel" and m["bits"] == 4:
      m["ok"] = False
  targets = compute_targets(ms)
  quant4 = [c for c in targets["checks"] if c["target"] == "quant4_vs_decode"]
  assert quant4 and all(c["ratio"] > 3.5 and not c["passed"] for c in quant4)
  assert all(c["note"] == "kernel output did not match its reference" for c in quant4)
  assert not targets["summary"]["quant4_vs_decode"]["all_passed"]
  assert targets["summary"]["quant8_vs_decode"]["all_passed"]
  none = compute_targets([m for m in ms if m["kernel"] != "sparse"])["summary"]
  assert none["sparse_vs_decode"]["measured"] == 0 and not none["sparse_vs_decode"]["all_passed"]


def test_targets_read_the_chosen_time_key():
  ms = synthetic_measurements()
  assert compute_targets(ms, "device_us_per_call")["checks"] == []     # none has a device time
  for m in ms:
    m["device_us_per_call"] = m["us_per_call"] / 2                     # no launch gaps: faster
  wall = {(c["target"], c["B"], c["S"], c["Tq"]): c for c in compute_targets(ms)["checks"]}
  device = compute_targets(ms, "device_us_per_call")
  assert device["time_key"] == "device_us_per_call" and len(device["checks"]) == len(wall)
  for c in device["checks"]:
    w = wall[(c["target"], c["B"], c["S"], c["Tq"])]
    if c["target"] == "decode_read_bw":
      assert c["ratio"] == pytest.approx(2 * w["ratio"])
    if c["target"] == "sparse_vs_listed_read":
      assert c["ratio"] == pytest.approx(w["ratio"] / 2)
    if c["target"] in ("quant4_vs_decode", "sparse_vs_decode"):
      assert c["ratio"] == pytest.approx(w["ratio"])                     # both halved


def test_time_loop_counts_rotations_and_index():
  calls = []

  def fn(x, it, a):                      # x [4]; a [4]; it the loop iteration
    calls.append(1)                      # traced once: one jitted callee for every call site
    return x * 0 + a + it

  x, a, a2 = jnp.zeros(4), jnp.ones(4), 2 * jnp.ones(4)
  t = time_loop(fn, x, a, num_calls=5, repeats=2, rotate=[(a2,)], with_index=True)
  assert t["num_calls"] == 6 and len(t["runs_s"]) == 2 and t["min_s"] <= t["median_s"]
  assert t["unroll"] == 1 and "device_s" not in t          # no profile asked (and no GPU here)
  assert len(calls) == 1
  t = time_loop(fn, x, a, num_calls=7, repeats=1, rotate=[(a2,)], with_index=True, unroll=3)
  assert t["num_calls"] == 12 and t["unroll"] == 3       # rounded up to 2 iterations of 3 x 2
  with pytest.raises(ValueError, match="unroll"):
    time_loop(fn, x, a, num_calls=1, unroll=0)


def test_time_loop_index_differs_between_unrolled_calls():
  # kernels.py's sparse cases pick block list `index % N` per call, so that consecutive calls
  # read different blocks (a short list is not served from L2): an unrolled loop must not hand
  # its `unroll` repetitions the same index.
  import jax
  seen = []

  def fn(x, it, a):
    jax.debug.callback(lambda i: seen.append(int(i)), it)
    return x * 0 + a

  x, a, a2 = jnp.zeros(4), jnp.ones(4), 2 * jnp.ones(4)
  t = time_loop(fn, x, a, num_calls=12, repeats=1, rotate=[(a2,)], with_index=True, unroll=3)
  assert t["num_calls"] == 12                        # 2 iterations of 3 repetitions x 2 copies
  jax.effects_barrier()
  # per run: indices 0..5, each once per copy (the copies of one repetition share it)
  assert sorted(set(seen)) == list(range(6))
  assert len(seen) == 2 * 12 and all(seen.count(i) == 4 for i in range(6))


def test_time_loop_chains_through_the_output_where_it_matches_the_carry():
  x, a = jnp.zeros(4), jnp.ones(4)
  same = lambda x, a: x * 0.5 + a                      # out [4] float32, as x
  other = lambda x, a: (x * 0.5 + a)[:2]               # out [2]
  assert time_loop(same, x, a, num_calls=2, repeats=1)["chain"] == "output"
  assert time_loop(other, x, a, num_calls=2, repeats=1)["chain"] == "select"
  assert time_loop(same, x, a, num_calls=2, repeats=1, chain="select")["chain"] == "select"
  with pytest.raises(ValueError, match="first output to match"):
    time_loop(other, x, a, num_calls=1, chain="output")
  with pytest.raises(ValueError, match="chain must be"):
    time_loop(same, x, a, num_calls=1, chain="barrier")


def test_helpers():
  assert num_calls_for(1e6, None, target_bytes=4e9, min_calls=20, max_calls=2000,
                       max_loop_seconds=1.0) == 2000
  assert num_calls_for(4e9, None, target_bytes=4e9, min_calls=20, max_calls=2000,
                       max_loop_seconds=1.0) == 20
  assert num_calls_for(4e9, 0.2, target_bytes=4e9, min_calls=20, max_calls=2000,
                       max_loop_seconds=1.0) == 5
  assert max_abs_err(np.array([1.0, -np.inf]), np.array([1.5, -np.inf])) == 0.5
  assert max_abs_err(np.array([np.nan]), np.array([0.0])) == np.inf
  # An infinity where the reference has a finite value or the other infinity is a mismatch.
  assert max_abs_err(np.array([1.0, np.inf]), np.array([1.0, 2.0])) == np.inf
  assert max_abs_err(np.array([2.0]), np.array([-np.inf])) == np.inf
  assert max_abs_err(np.array([np.inf]), np.array([-np.inf])) == np.inf
  # A loop of calls slower than max_loop_seconds still times 3 of them (not 0).
  assert num_calls_for(4e9, 2.0, target_bytes=4e9, min_calls=20, max_calls=2000,
                       max_loop_seconds=1.0) == 3


def test_random_table_sets_cover_the_cache_with_distinct_blocks():
  from benchmarks.kernels import random_table_sets
  sets = np.asarray(random_table_sets(0, 2, 3, cache_blocks=64, listed=4))
  assert sets.shape == (16, 2, 3, 4)
  for b in range(2):
    for h in range(3):
      blocks = sets[:, b, h].reshape(-1)
      assert sorted(blocks) == list(range(64))              # every block once over the lists
  assert (np.diff(sets, axis=-1) > 0).all()                 # each list sorted, distinct


def test_sparse_reference_row_by_row_equals_the_whole_batch():
  """The sparse reference check run row by row (what kernels.py does when a batch's working set
  is over budget) slices each argument along its own batch axis (the table sets' is 1) and gives
  the whole batch's result. (Session 19's B = 8 sweep found it slicing the sets' axis 0.)"""
  import jax
  from benchmarks.kernels import SPARSE_BATCH_AXES, _slice_rows, _sparse_ref_fn, random_table_sets
  b, hkv, hq, s, d, tq, block = 3, 2, 4, 256, 16, 2, 64
  keys = jax.random.split(jax.random.key(0), 5)
  q = rand.normal(keys[0], (b, tq, hq, d))
  k, v = (rand.normal(kk, (b, hkv, s, d)) for kk in keys[1:3])
  k_new, v_new = (rand.normal(kk, (b, tq, hkv, d)) for kk in keys[3:5])
  sets = random_table_sets(0, b, hkv, cache_blocks=s // block, listed=2)       # [2, B, Hkv, 2]
  args = (q, k, v, sets, jnp.full((b, hkv), 2, jnp.int32), jnp.array([256, 200, 90]), k_new,
          v_new, jnp.tril(jnp.ones((tq, tq), bool)))
  ref = _sparse_ref_fn(block, None)
  whole = ref(args[0], 0, *args[1:])
  rows = [ref(a[0], 0, *a[1:]) for a in (_slice_rows(args, SPARSE_BATCH_AXES, i)
                                         for i in range(b))]
  np.testing.assert_allclose(np.concatenate(rows), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_plot_kernels_writes_one_png_per_kernel(tmp_path):
  from benchmarks import plot_kernels
  ms = synthetic_measurements()
  for i, part in enumerate((ms[: len(ms) // 2], ms[len(ms) // 2:])):  # two runs, merged
    (tmp_path / f"run{i}.json").write_text(json.dumps(dict(device="synthetic", measurements=part)))
  merged = tmp_path / "merged.json"
  plot_kernels.main([str(tmp_path / "run0.json"), str(tmp_path / "run1.json"),
                     "--out-dir", str(tmp_path), "--merged", str(merged)])
  for name in ("decode", "sparse", "quant", "fafo"):
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000
  assert len(json.loads(merged.read_text())["measurements"]) == len(ms)


def test_plots_take_one_decode_time_per_shape():
  """A shape's decode_attention timed by two runs (the decode grid and the quant grid's baseline)
  is one point on the plots, the faster (the quant panel drew both, a zigzag, session 47)."""
  from benchmarks import plot_kernels
  row = lambda kernel, s, us: dict(kernel=kernel, impl="decode_attention", B=1, Tq=1, S=s,  # noqa: E731
                                   us_per_call=us)
  ms = [row("decode", 4096, 12.0), row("quant", 4096, 11.0), row("quant", 16384, 30.0),
        dict(row("quant", 16384, 5.0), Tq=16)]
  assert plot_kernels.fastest_decode(ms, 1, 1) == {4096: 11.0, 16384: 30.0}


def test_read_floor_stream_kernel_lowers_and_reads_its_tiles():
  """benchmarks/read_floor.py's TMA-only stream (the floor under issue 3's decode target):
  lowers for cuda, and in the Mosaic GPU interpreter each block stores the first 64 rows of
  the last K tile it streamed, so the reads happened and went to the right split."""
  import jax
  from benchmarks.read_floor import HKV, D, stream_kernel
  s, block_kv, stages, splits = 512, 64, 2, 3                  # 8 tiles: 3 + 3 + 2 a split
  fn = stream_kernel(1, s, block_kv, stages, splits)
  kv = jax.ShapeDtypeStruct((1, HKV, s, D), jnp.bfloat16)
  dep = jax.ShapeDtypeStruct((1, HKV, splits, 64, D), jnp.bfloat16)
  text = jax.jit(fn).trace(dep, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu_v2" in text
  from jax.experimental.pallas import mosaic_gpu as plgpu
  k = rand.normal(jax.random.key(0), (1, HKV, s, D), jnp.bfloat16)
  out = stream_kernel(1, s, block_kv, stages, splits, interpret=plgpu.InterpretGPUParams())(
      jnp.zeros(dep.shape, dep.dtype), k, k)
  last_tile = [2, 5, 7]                                        # each split's last tile
  for split, tile in enumerate(last_tile):
    np.testing.assert_array_equal(np.asarray(out[0, :, split], np.float32),
                                  np.asarray(k[0, :, tile * block_kv:tile * block_kv + 64],
                                             np.float32))


@pytest.mark.parametrize("bad, message", [
    (["--kernels", "decod"], "--kernels takes a comma-separated subset of"),  # measured nothing
    (["--kernels", ""], "--kernels takes a comma-separated subset of"),
    (["--refs", "cudnn"], "--refs takes a comma-separated subset of"),       # timed no reference
    (["--batch", "1,x"], "--batch takes comma-separated integers >= 1, got '1,x'"),
    (["--seq", "0"], "--seq takes comma-separated integers >= 1"),
    (["--tq", ""], "--tq takes comma-separated integers >= 1"),
    (["--bits", "3"], "--bits takes comma-separated read widths among 4 and 8"),
    (["--fractions", "0.016,2"], "--fractions takes comma-separated fractions in (0, 1]"),
    (["--fafo", "64"], "--fafo takes 2 comma-separated query counts"),
    (["--heads", "32,8"], "--heads takes 3 comma-separated sizes"),
    (["--heads", "32,6,128"], "--heads: Hq (32) must be a multiple of Hkv (6)"),
    (["--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["--unroll", "0"], "--unroll must be >= 1, got 0"),
])
def test_kernels_arguments_refused_by_name(bad, message, capsys):
  from benchmarks import kernels
  with pytest.raises(SystemExit):
    kernels.parse_args(["--dry-run", *bad])
  assert message in capsys.readouterr().err


def test_kernels_arguments_accepted():
  from benchmarks import kernels
  args = kernels.parse_args(["--dry-run", "--kernels", "decode,quant", "--refs", ""])
  st = kernels.settings_from(args)
  assert st.refs == () and (st.hq, st.hkv, st.d) == (8, 2, 128)
  assert kernels.parse_args(["--quick"]).fractions == "0.016,0.25"


def test_plot_kernels_refuses_a_json_of_another_benchmark(tmp_path):
  """Another benchmark's JSON (no measurements) drew nothing, printed 0/0 targets and exited 0."""
  from benchmarks import plot_kernels
  other = tmp_path / "ngram.json"
  other.write_text(json.dumps({"device": {"device_kind": "cpu"}, "sweep": [], "speed": []}))
  with pytest.raises(SystemExit, match="ngram.json is not a kernels.py JSON"):
    plot_kernels.main([str(other), "--out-dir", str(tmp_path)])


def test_dry_run_times_one_call_per_copy():
  """--dry-run says one timed call, but the default unroll of 8 made time_loop round every
  measurement up to 8 x 2 copies = 16 interpreted calls; --unroll still applies when given."""
  from benchmarks import kernels
  assert kernels.settings_from(kernels.parse_args(["--dry-run"])).unroll == 1
  assert kernels.settings_from(kernels.parse_args(["--dry-run", "--unroll", "2"])).unroll == 2
  assert kernels.settings_from(kernels.parse_args([])).unroll == 8
