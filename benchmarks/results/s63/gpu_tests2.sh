#!/usr/bin/env bash
# Session 63, device call 2 (H200): the files of call 1 that ran out of GPU memory or ran on the
# GPU's one device (the 4-host-device subprocess tests now ask for JAX_PLATFORMS=cpu): W4A16 GEMV,
# weights, decode, serving; no preallocation (two pytest processes share the GPU).
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
[ -e ../shared ] || cp -r .devcarry/shared ../shared
log=$OUT/gpu_tests2_s63_h200.txt; nvidia-smi -L > $log
(timeout 500 python -m pytest -q -p no:cacheprovider -rfEs tests/test_w4a16_gemv.py tests/test_weights.py -k "not smollm2" > $OUT/b.txt 2>&1
 echo "rc=$? w4a16+weights" >> $OUT/b.txt) &
timeout 500 python -m pytest -q -p no:cacheprovider -rfEs tests/test_decode.py tests/test_serving.py -k "not smollm2" > $OUT/c.txt 2>&1
echo "rc=$? decode+serving" >> $OUT/c.txt; wait
cat $OUT/b.txt $OUT/c.txt >> $log; rm $OUT/b.txt $OUT/c.txt
grep -E "passed|failed|rc=|^FAILED|^ERROR" $log | tail -30
