#!/usr/bin/env bash
# Session 60, device call 1 (H200): issue 3's quick cells and the sparse B 8 cell on the current
# code (the first kernels.py runs since session 53; sessions 58-59 changed the wrappers' clipping),
# then the SnapKV tests on stories260K compiled there (its init scores one query a step now).
set -u
export PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
[ -e ../shared ] || cp -r .devcarry/shared ../shared
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python benchmarks/kernels.py --quick --refs dpa --out $OUT/kernels_quick_s60_h200.json \
  > $OUT/kernels_quick_s60_h200.log 2>&1; echo "quick rc $?"
timeout 120 python benchmarks/kernels.py --kernels decode,sparse --batch 8 --seq 16384 --tq 1 \
  --sparse-seq 16384 --fractions 0.016 --refs jnp --max-seconds 150 \
  --out $OUT/kernels_sparse_b8_s60_h200.json > $OUT/kernels_sparse_b8_s60_h200.log 2>&1; echo "b8 rc $?"
grep -h "ratio" $OUT/kernels_*_s60_h200.log | sort | uniq
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_fafo.py -k "snapkv and not smollm2" \
  > $OUT/gpu_tests_snapkv_s60_h200.txt 2>&1; echo "snapkv tests rc $?"; tail -2 $OUT/gpu_tests_snapkv_s60_h200.txt
