#!/usr/bin/env bash
# Session 63, device call 1 (H200): the test files this session's changes touch, compiled on the
# GPU: QuantSpec (the int8 state's placeholder slot, init_key, the NaN draft rejection, the jitted
# 4-bit weight quantizer / dequantizer / layout conversion), its kernel dispatch, serving (device
# placement, request_params), decode (the cache on the params' device), weights (checkpoint's
# default device, rope keys) and the W4A16 GEMV file (the jitted quantizer under the kernels).
# SmolLM2's tests are left out (the GGUF does not travel in this call).
export PYTHONPATH=$PWD
# Three pytest processes share the GPU: none preallocates (each took 75% of it: the first call's
# run of this script ran out of memory in the W4A16 file's autotuning and aborted test_decode).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
[ -e ../shared ] || cp -r .devcarry/shared ../shared
log=$OUT/gpu_tests_s63_h200.txt; nvidia-smi -L > $log
(timeout 540 python -m pytest -q -p no:cacheprovider -rfEs tests/test_quantspec.py tests/test_quant_dispatch.py -k "not smollm2" > $OUT/a.txt 2>&1
 echo "rc=$? quantspec+quant_dispatch" >> $OUT/a.txt) &
(timeout 540 python -m pytest -q -p no:cacheprovider -rfEs tests/test_w4a16_gemv.py tests/test_weights.py -k "not smollm2" > $OUT/b.txt 2>&1
 echo "rc=$? w4a16+weights" >> $OUT/b.txt) &
timeout 540 python -m pytest -q -p no:cacheprovider -rfEs tests/test_decode.py tests/test_serving.py -k "not smollm2" > $OUT/c.txt 2>&1
echo "rc=$? decode+serving" >> $OUT/c.txt; wait
cat $OUT/a.txt $OUT/b.txt $OUT/c.txt >> $log; rm $OUT/a.txt $OUT/b.txt $OUT/c.txt
grep -E "passed|failed|rc=|FAIL|Error" $log | tail -30
