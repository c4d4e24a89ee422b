#!/usr/bin/env bash
# Session 61, device call 2 (H200): the decode-API files that review round 10 changed (the loop's
# bound counted from the state's step, Run.advance / insert_row / StepContext / prefill checks,
# Lookahead and FAFO counting a cut step's guesses), run on the GPU with ../shared in place.
set -u
export PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
[ -e ../shared ] || cp -r .devcarry/shared ../shared
log=$OUT/gpu_tests2_s61_h200.txt
nvidia-smi -L > $log
run() { timeout "$1" python -m pytest -q -p no:cacheprovider -rfEs "${@:2}" >> $log 2>&1;
        echo "pytest rc=$?: ${*:2}" >> $log; }
run 330 tests/test_serving.py tests/test_decode.py tests/test_weights.py
run 200 tests/test_lookahead.py tests/test_fafo.py -k "cut_by_max_new_tokens or on_stories260k or not_built or init_did_not"
grep -E "passed|failed|rc=" $log
