#!/usr/bin/env bash
# Session 65, device call (H200): the memory check against a real GPU allocator
# (gpu_fits_check.py), then every test function this session added or changed
# (touched_tests.txt) compiled on the GPU. The HF reference environment does not travel.
export PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
[ -e ../shared ] || cp -r .devcarry/shared ../shared
here=benchmarks/results/s65
log=$OUT/gpu_tests_s65_h200.txt; nvidia-smi -L > $log
timeout 200 python $here/gpu_fits_check.py >> $log 2>&1; echo "rc=$? fits_check" >> $log
timeout 330 python -m pytest -q -p no:cacheprovider -rfEs --durations=10 $(cat $here/touched_tests.txt) >> $log 2>&1
echo "rc=$? tests" >> $log
grep -E "passed|failed|rc=|FAIL|Error|'run'" $log | tail -30
