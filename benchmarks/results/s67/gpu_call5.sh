#!/usr/bin/env bash
# Session 67, device call 5 (H200): the pool's tests and FAFO's / Lookahead's step-by-hand tests
# (each step's pool against insert_items) compiled on the GPU.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python -m pip install -q --no-index --no-deps .devcarry/wtest/*.whl .devcarry/wsmall/*.whl 2>&1 | tail -2
timeout 400 python -m pytest -q -p no:cacheprovider -rf tests/test_ngram_pool.py \
  "tests/test_fafo.py::test_each_step_s_fumbles_pool_and_candidates_follow_the_algorithm_by_hand" \
  "tests/test_lookahead.py::test_each_step_s_window_pool_and_candidates_follow_the_algorithm_by_hand" \
  > $OUT/gpu_tests_s67_h200.txt 2>&1
echo rc=$? >> $OUT/gpu_tests_s67_h200.txt
tail -5 $OUT/gpu_tests_s67_h200.txt
