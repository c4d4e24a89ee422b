#!/usr/bin/env bash
# Session 71, device call 4 (H200, fresh machine, no GGUF): the draft-model speculative baseline.
# (1) one Speculative step (Llama-3.2-1B-shaped draft, gamma 4) against one dense step at
# Llama-3.1-8B shapes, 4K / 32K (method_step.py; random weights, so the speedup is projected
# from the step ratio over per-draft acceptance rates); (2) test_speculative.py compiled on the
# GPU (stories260K; the SmolLM2 test needs the GGUF, which did not travel).
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false SPARSEDEC_SHARED=$PWD/.devcarry/shared
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl .devcarry/wtest/*.whl .devcarry/wheels/scipy*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python benchmarks/method_step.py --contexts 4096 32768 --methods dense speculative \
  --out $OUT/method_step_speculative_s71_h200.json > $OUT/method_step_speculative_s71_h200.log 2>&1
echo "step rc $?"; grep -E "ms/step|Error|error" $OUT/method_step_speculative_s71_h200.log | cut -c1-300
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_speculative.py -k "not smollm2" \
  > $OUT/gpu_tests_speculative_s71_h200.txt 2>&1; echo "tests rc $?"; tail -3 $OUT/gpu_tests_speculative_s71_h200.txt
