#!/usr/bin/env bash
# Session 72, device call 2 (H200): TriForce's step by parts at Llama-3.1-8B shapes with a
# Llama-68M-shaped draft, 32K / 128K, rounds of 2, 4 and 6 drafts, the verification side timed
# with a draft that costs ~nothing (triforce_step.py after call 1; random weights, so the speedup
# is projected over acceptance rates).
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false SPARSEDEC_SHARED=$PWD/.devcarry/shared
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 480 python benchmarks/triforce_step.py --contexts 32768 131072 --draft-gammas 2 4 6 \
  --out $OUT/triforce_step2_s72_h200.json > $OUT/triforce_step2_s72_h200.log 2>&1
echo "step rc $?"; grep -E " ms|x dense|Error|error" $OUT/triforce_step2_s72_h200.log | cut -c1-300
