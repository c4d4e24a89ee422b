#!/usr/bin/env bash
# Session 60, device call 3 (H200): issue 5's 128K projection (as session 53's, same acceptance
# file) and issue 4's 8B FAFO / Lookahead step against a dense step (last run in session 34), on
# the current code.
set -u
export PYTHONPATH=$PWD
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
A=benchmarks/results/s44/quantspec_acceptance_wg32_bf16_b1_dp4a_s44_h200.json
timeout 200 python benchmarks/quantspec_step.py --contexts 131072 --gammas 4 --layouts int4_t \
  --weight-group 32 --one-row-gemv dp4a --kinds dense quantspec --acceptance-json $A \
  --out $OUT/quantspec_step_128k_s60_h200.json > $OUT/quantspec_step_128k_s60_h200.log 2>&1
echo "proj rc $?"; grep -E "projected|ms/forward" $OUT/quantspec_step_128k_s60_h200.log
timeout 280 python benchmarks/method_step.py --contexts 4096 32768 --out $OUT/method_step_s60_h200.json \
  > $OUT/method_step_s60_h200.log 2>&1
echo "step rc $?"; tail -12 $OUT/method_step_s60_h200.log
