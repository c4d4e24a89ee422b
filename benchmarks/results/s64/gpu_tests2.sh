#!/usr/bin/env bash
# Session 64, device call 2 (H200): the kernel-body audit's new tests (an outlier key or split that
# a softmax max skipping it would overflow on) and the two in-flight hypothesis tests, now
# derandomized, on the compiled kernels (touched_tests2.txt).
export PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
log=$OUT/gpu_tests2_s64_h200.txt; nvidia-smi -L > $log
timeout 540 python -m pytest -q -p no:cacheprovider -rfEs --durations=10 \
  $(cat benchmarks/results/s64/touched_tests2.txt) >> $log 2>&1
echo "rc=$?" >> $log
grep -E "passed|failed|rc=|FAIL|Error" $log | tail -20
