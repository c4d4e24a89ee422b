#!/usr/bin/env bash
# Session 62, device call 3 (H200, warm after gpu_tests.sh): test_serving, test_decode and
# test_attention_dispatch whole (gpu_tests.sh's limits had cut them short with no failure).
export PYTHONPATH=$PWD; log=$OUT/gpu_tests2_s62_h200.txt; nvidia-smi -L > $log
(timeout 260 python -m pytest -q -p no:cacheprovider -rfEs tests/test_serving.py >> $log 2>&1
 echo "rc=$? serving" >> $log) &
timeout 300 python -m pytest -q -p no:cacheprovider -rfEs tests/test_decode.py tests/test_attention_dispatch.py >> $log 2>&1
echo "rc=$? decode+dispatch" >> $log; wait; grep -E "passed|failed|rc=|FAIL" $log
