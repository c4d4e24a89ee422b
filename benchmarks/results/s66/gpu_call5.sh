#!/usr/bin/env bash
# Session 66, device call 5 (H200): every test function this session added or changed
# (touched_tests.txt) compiled on the GPU, on the final code.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
[ -e ../shared ] || cp -r .devcarry/shared ../shared
here=benchmarks/results/s66
log=$OUT/gpu_tests_s66_h200.txt; nvidia-smi -L > $log
timeout 480 python -m pytest -q -p no:cacheprovider -rfEs --durations=10 -n 3 \
  $(cat $here/touched_tests.txt) >> $log 2>&1
echo "rc=$? tests" >> $log
grep -E "passed|failed|rc=|FAIL|Error" $log | cut -c1-300 | tail -30
