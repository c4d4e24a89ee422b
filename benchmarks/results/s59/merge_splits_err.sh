#!/usr/bin/env bash
# Session 59: merge_splits' one-cell error (quant_attention 4-bit, 1 KV head, 1024 slots, Tq 1)
# against the fp32 reference on the H200: the compiled kernel, then the Mosaic GPU interpreter
# (the smoke test's mode, whose "current" call read 1.2e-2 there against 7e-4 on the CPU).
set -u
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
printf 'from pallas_kernels import merge_partials as _m\nMAX_SPLITS = _m.MAX_SPLITS\ndef merge_partials(acc, m2, l, *, interpret=None):\n  out, lse = _m.merge_partials(acc, m2, l, interpret=interpret)\n  return 2.0 * out, lse\n' > /tmp/doubled.py
for mode in "" "--interpret"; do
  python benchmarks/merge_splits.py $mode --cells 1:1024:4:1,1:1024:8:1,2:4096:4:1 --splits 1 --cap 8 \
    --calls 1 --repeats 1 --old-merge /tmp/doubled.py --out "$OUT/merge_splits_err${mode:+_interp}_s59_h200.json" > /dev/null 2>&1
  python -c "import json,sys; [print(sys.argv[1] or 'compiled', r['cell'], r['impl'], r['part'], r.get('num_splits'), r.get('max_abs_err'), r.get('error','')[:200]) for r in json.load(open(sys.argv[2]))['rows']]" "$mode" "$OUT/merge_splits_err${mode:+_interp}_s59_h200.json"
done
