#!/usr/bin/env bash
# Session 64, device call (H200): every test function review round 14 added or changed
# (touched_tests.txt, from `git diff c1a22a4 -- tests`), compiled on the GPU: the FAFO / Lookahead
# by-hand step replays compare argmaxes of differently shaped forwards, QuantSpec's draft check
# compares q to 2e-5, the kernel-file tests run the compiled kernels. SmolLM2's tests are left
# out (the GGUF does not travel in this call); the HF reference environment does not travel.
export PYTHONPATH=$PWD
export XLA_PYTHON_CLIENT_PREALLOCATE=false      # three pytest processes share the GPU
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
[ -e ../shared ] || cp -r .devcarry/shared ../shared
here=benchmarks/results/s64
log=$OUT/gpu_tests_s64_h200.txt; nvidia-smi -L > $log
T=${T:-540}
grep -E "test_(fafo|lookahead|ngram_pool|quantspec)\.py" $here/touched_tests.txt > /tmp/a.ids
grep -E "test_kernel_|test_combine|test_split_plan|test_attention_dispatch|test_gptq" $here/touched_tests.txt > /tmp/b.ids
grep -v -x -F -f /tmp/a.ids $here/touched_tests.txt | grep -v -x -F -f /tmp/b.ids > /tmp/c.ids
wc -l /tmp/a.ids /tmp/b.ids /tmp/c.ids >> $log
run() {  # run NAME IDS
  timeout $T python -m pytest -q -p no:cacheprovider -rfEs --durations=10 $(cat $2) -k "not smollm2" > $OUT/$1.txt 2>&1
  echo "rc=$? $1" >> $OUT/$1.txt
}
run methods /tmp/a.ids & run kernels /tmp/b.ids & run api /tmp/c.ids; wait
cat $OUT/methods.txt $OUT/kernels.txt $OUT/api.txt >> $log; rm $OUT/methods.txt $OUT/kernels.txt $OUT/api.txt
grep -E "passed|failed|rc=|FAIL|Error" $log | tail -40
