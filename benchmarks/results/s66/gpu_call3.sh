#!/usr/bin/env bash
# Session 66, device call 3 (H200): the fixed narrow-int4 test (call 2 ran it with the GPU's TF32
# default precision), then issue 4's 8B method step (dense / FAFO / Lookahead at 4K) on the new
# dispatch: FAFO's sparse kernel and decode kernel reached through lax.platform_dependent.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
log=$OUT/gpu_call3_s66_h200.txt; nvidia-smi -L > $log
timeout 100 python -m pytest -q -p no:cacheprovider -rfEs tests/test_quant_dispatch.py -k narrow >> $log 2>&1
echo "rc=$? narrow test" >> $log
timeout 400 python benchmarks/method_step.py --contexts 4096 --out $OUT/method_step_4k_s66_h200.json >> $log 2>&1
echo "rc=$? method_step" >> $log
grep -E "passed|failed|rc=|FAIL|Error|ratio|step" $log | cut -c1-300 | tail -30
