#!/usr/bin/env bash
# Session 62, device call 2 (H200): the files review round 11 changed, compiled on the GPU: the
# policies' capped block lists and FAFO's view check (the sparse kernel reads them), method_capacity
# and the methods' early checks, the params' dtype check, +inf sampling, the weight grids' fp16
# saturation, insert_row's batch-axis naming.
set -u
export PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
[ -e ../shared ] || cp -r .devcarry/shared ../shared
log=$OUT/gpu_tests_s62_h200.txt
nvidia-smi -L > $log
run() { timeout "$1" python -m pytest -q -p no:cacheprovider -rfEs "${@:2}" >> $log 2>&1;
        echo "pytest rc=$?: ${*:2}" >> $log; }
run 200 tests/test_fafo.py -k "stories260k or budget_past or malformed or do_not_tile or whole_policy_blocks or max_commit or only_the_compressed"
run 180 tests/test_serving.py tests/test_attention_dispatch.py
run 150 tests/test_decode.py
run 120 tests/test_quantspec.py -k "before_prefill or sliding or saturate or head_dim or dequantized_int8_dense and not smollm2"
grep -E "passed|failed|rc=" $log
