"""benchmarks/w4a16_gemv.py in its --interpret mode (Mosaic GPU interpreter on the CPU, tiny
shapes, one call per timed loop): every code path of the GPU benchmark runs (random weights and
their copies, the W4A16 kernel, the one-row dp4a kernel, the int4_reduce and dense references, the JSON and its summary), so the
script cannot rot. The numbers themselves mean nothing on a CPU."""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # benchmarks/ importable

from benchmarks import w4a16_gemv as bench  # noqa: E402


def test_interpret_run_writes_every_measurement(tmp_path):
  out = tmp_path / "w4a16_gemv.json"
  result = bench.main(["--interpret", "--shapes", "tiny_b", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  rows = result["measurements"]
  assert not [r for r in rows if "error" in r or "skipped" in r], rows
  assert sorted((r["M"], r["impl"]) for r in rows) == sorted(
      (m, impl) for m in (1, 4) for impl in bench.IMPLS if m == 1 or impl != "w4a8")
  for r in rows:
    assert r["us_per_call"] > 0 and r["copies"] == 2
    assert r["num_calls"] == 2 and r["unroll"] == 1     # one call per copy (not unrolled 8 times)
    assert r["max_abs_err"] <= 2 ** -7 * r["ref_max_abs"]           # bf16 output rounding
    want = bench.w4_bytes(r["M"], 200, 256, 128) if r["impl"] != "dense_bf16" else \
        bench.dense_bytes(r["M"], 200, 256)
    assert r["bytes"] == want
  kernel = [r for r in rows if r["impl"] == "pallas"]
  assert all(r["plan"]["block_out"] == 64 and r["blocks"] == 4 for r in kernel)
  dp4a = [r for r in rows if r["impl"] == "w4a8"]                    # the one-row dp4a kernel
  assert len(dp4a) == 1 and dp4a[0]["plan"]["block_out"] == 128 and 0 < dp4a[0]["x_quant_err"]
  assert len(result["summary"]) == 2


def test_bytes():
  # wqkv at M = 1: 4-bit codes, fp16 scale + zero per 128 inputs, bf16 x.
  assert bench.w4_bytes(1, 4096, 6144, 128) == 4096 * 6144 // 2 + 4 * 32 * 6144 + 2 * 4096
  assert bench.w4_bytes(1, 200, 64, 128) == 256 * 64 // 2 + 4 * 2 * 64 + 400
  assert bench.w4_bytes(1, 4096, 6144, 64) == 4096 * 6144 // 2 + 4 * 64 * 6144 + 2 * 4096
  assert bench.dense_bytes(4, 4096, 4096) == 2 * 4096 * 4096 + 8 * 4096
