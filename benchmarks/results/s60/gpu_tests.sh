#!/usr/bin/env bash
# Session 60, device call 2 (H200): the kernel test files touched by review round 9 (wrapper
# checks, numpy-int configs, an empty full-precision segment), compiled on the GPU: whole files
# for the small ones, the changed tests of the decode / sparse / quant files.
set -u
export PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
log=$OUT/gpu_tests_kernels_s60_h200.txt
nvidia-smi -L > $log
run() { timeout "$1" python -m pytest -q -p no:cacheprovider -rfEs --durations=10 "${@:2}" >> $log 2>&1; echo "pytest rc=$?" >> $log; }
run 380 tests/test_combine.py tests/test_kernel_merge_partials.py tests/test_kernel_dequantize_kv.py \
  tests/test_w4a16_gemv.py tests/test_w4a8_gemv.py tests/test_kernel_inflight_attention.py
run 170 tests/test_kernel_decode_attention.py tests/test_kernel_sparse_attention.py tests/test_kernel_quant_attention.py \
  -k "empty_full_precision or bad_inputs or rejects_bad_inputs or numpy_integer or refuses_unsupported or dequantize_path_equals or more_than_64_query_rows"
grep -E "passed|failed|rc=" $log
