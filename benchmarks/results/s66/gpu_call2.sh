#!/usr/bin/env bash
# Session 66, device call 2 (H200): the test files the platform-dispatch change touched, compiled on
# the GPU (call 1's run of them was cut by its time limit).
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
[ -e ../shared ] || cp -r .devcarry/shared ../shared
log=$OUT/gpu_call2_s66_h200.txt; nvidia-smi -L > $log
timeout 520 python -m pytest -q -p no:cacheprovider -rfEs --durations=8 -n 3 \
  tests/test_attention_dispatch.py tests/test_quant_dispatch.py tests/test_w4a16_gemv.py \
  "tests/test_cli.py::test_bench_reports_the_device_the_params_are_on" >> $log 2>&1
echo "rc=$? tests" >> $log
grep -E "passed|failed|rc=|FAIL|Error" $log | cut -c1-300 | tail -30
