#!/usr/bin/env bash
# Session 59's device runs of the test files not yet run compiled on a GPU (phases 1, 2, 3 in
# consecutive calls on one warm machine; phase 4, after session 59's fixes, on its own). The 98 MB
# SmolLM2 GGUF travels in three ~33 MB parts, one per call, gathered in /tmp/gg and joined in
# phase 3. The transformers reference runs in the
# device's own Python (torch + transformers there; gguf from the carried wheels).
# Output: $OUT/gpu_tests_<phase>_s59_h200.txt.
set -u
phase="$1"; limit="${2:-470}"
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD SPARSEDEC_HF_PYTHON="$(which python)"
[ -e ../shared ] || cp -r .devcarry/shared ../shared
mkdir -p /tmp/gg && cp .devcarry/gguf/p* /tmp/gg/ 2>/dev/null; ls -la /tmp/gg
log="$OUT/gpu_tests_${phase}_s59_h200.txt"
nvidia-smi -L > "$log"
run() { timeout "$limit" python -m pytest -v -p no:cacheprovider -rfEs --durations=15 "$@" >> "$log" 2>&1; echo "pytest rc=$?" >> "$log"; }
case "$phase" in
  1) run tests/test_bench_*.py -k "not gptq_time" ;;
  2) run tests/test_combine.py tests/test_kernel_dequantize_kv.py tests/test_kernel_decode_attention.py \
       tests/test_kernel_sparse_attention.py tests/test_kernel_quant_attention.py ;;
  3) cat /tmp/gg/p0 /tmp/gg/p1 /tmp/gg/p2 > /tmp/gg/smollm2.gguf && sha256sum /tmp/gg/smollm2.gguf >> "$log"
     export SPARSEDEC_SMOLLM2_GGUF=/tmp/gg/smollm2.gguf
     run tests/test_hf_equivalence.py tests/test_tokenizer.py tests/test_bench_gptq_time.py -k "smollm2 or gguf or tokenizer or gptq_time" ;;
  4) run tests/test_bench_merge_splits.py tests/test_combine.py \
       tests/test_kernel_sparse_attention.py::test_unsigned_table_entries_and_counts_past_int32_are_clipped_not_wrapped \
       tests/test_kernel_sparse_attention.py::test_out_of_range_entries_counts_and_lengths_are_clipped_in_the_kernel \
       tests/test_kernel_quant_attention.py -k "row_kind or merge or combine or f32_einsum or clipped or lowers_to_mosaic_gpu_custom_call_for_cuda and (8-16-score_queries5 or 8-5 or 256 or auto or dequantize or 8-9 or 4-12 or 4-1-score_queries4)" ;;
esac
tail -5 "$log"
