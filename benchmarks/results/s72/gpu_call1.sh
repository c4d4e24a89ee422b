#!/usr/bin/env bash
# Session 72, device call 1 (H200, fresh machine, no GGUF): TriForce.
# (1) its step by parts at Llama-3.1-8B shapes with a Llama-68M-shaped draft, 32K / 128K
# (triforce_step.py: dense step, one middle round, the gamma-6 verification side; random weights,
# so the speedup is projected over acceptance rates); (2) test_triforce.py compiled on the GPU
# (stories260K; the SmolLM2 test needs the GGUF, which did not travel).
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false SPARSEDEC_SHARED=$PWD/.devcarry/shared
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl .devcarry/wtest/*.whl .devcarry/wheels/scipy*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python benchmarks/triforce_step.py --contexts 32768 131072 \
  --out $OUT/triforce_step_s72_h200.json > $OUT/triforce_step_s72_h200.log 2>&1
echo "step rc $?"; grep -E " ms|x dense|Error|error" $OUT/triforce_step_s72_h200.log | cut -c1-300
timeout 220 python -m pytest -q -p no:cacheprovider tests/test_triforce.py -k "not smollm2" \
  > $OUT/gpu_tests_triforce_s72_h200.txt 2>&1; echo "tests rc $?"; tail -3 $OUT/gpu_tests_triforce_s72_h200.txt
