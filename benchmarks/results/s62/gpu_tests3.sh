#!/usr/bin/env bash
# Session 62, device call 4 (H200): test_decode and test_serving whole, and the Qwen sliding-window
# config test, on the final code (review round 12: plan_capacity's messages, the warm-call compile
# time, the prefill waited for before the init in generate / stream, the params' dtype fast path).
export PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
[ -e ../shared ] || cp -r .devcarry/shared ../shared
log=$OUT/gpu_tests3_s62_h200.txt; nvidia-smi -L > $log
(timeout 280 python -m pytest -q -p no:cacheprovider -rfEs tests/test_serving.py tests/test_weights.py -k "not smollm2" >> $log 2>&1
 echo "rc=$? serving+weights" >> $log) &
timeout 300 python -m pytest -q -p no:cacheprovider -rfEs tests/test_decode.py >> $log 2>&1
echo "rc=$? decode" >> $log; wait; grep -E "passed|failed|rc=|FAIL" $log
