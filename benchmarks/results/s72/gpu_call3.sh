#!/usr/bin/env bash
# Session 72, device call 3 (H200, no GGUF): Slow-Fast Inference.
# (1) its fast and slow steps against a dense step at Llama-3.1-8B shapes, 32K / 128K, a 2K-token
# selected memory (sfi_step.py; random weights); (2) test_sfi.py and the two new lowering tests
# compiled on the GPU (stories260K in fp32 runs the jnp reference there; the lowering tests lower
# for cuda as on the CPU).
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false SPARSEDEC_SHARED=$PWD/.devcarry/shared
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl .devcarry/wtest/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python benchmarks/sfi_step.py --contexts 32768 131072 \
  --out $OUT/sfi_step_s72_h200.json > $OUT/sfi_step_s72_h200.log 2>&1
echo "step rc $?"; grep -E " ms|x dense|Error|error" $OUT/sfi_step_s72_h200.log | cut -c1-300
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_sfi.py \
  "tests/test_attention_dispatch.py::test_sfi_decode_loop_lowers_for_cuda" \
  "tests/test_attention_dispatch.py::test_triforce_decode_loop_lowers_for_cuda" \
  > $OUT/gpu_tests_sfi_s72_h200.txt 2>&1; echo "tests rc $?"; tail -3 $OUT/gpu_tests_sfi_s72_h200.txt
