#!/usr/bin/env bash
# Session 61, device call 1 (H200): the test suite's on-disk compilation cache (tests/conftest.py)
# on a GPU. A: the decode kernel's test file compiled on the GPU, into a fresh cache directory;
# B: the same file again over that directory (every compile a load); C: the decode API, weights and
# config files with the default per-run cache (the controller's temporary directory).
set -u
export PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
log=$OUT/gpu_tests_s61_h200.txt
nvidia-smi -L > $log
python -c "import filelock, jax; print('filelock', filelock.__version__, jax.devices())" >> $log 2>&1
run() { timeout "$1" python -m pytest -q -p no:cacheprovider -rfEs "${@:2}" >> $log 2>&1;
        echo "pytest rc=$?: ${*:2}" >> $log; }
rm -rf /tmp/jc
SPARSEDEC_TEST_COMPILE_CACHE=/tmp/jc run 200 tests/test_kernel_decode_attention.py
echo "cache entries after A: $(ls /tmp/jc | grep -c cache)" >> $log
SPARSEDEC_TEST_COMPILE_CACHE=/tmp/jc run 200 tests/test_kernel_decode_attention.py
run 250 tests/test_decode.py tests/test_weights.py
ls -d /tmp/sparsedec-compiled-* >> $log 2>&1 || echo "no per-run cache directory left behind" >> $log
grep -E "passed|failed|rc=|entries|left behind|filelock" $log
