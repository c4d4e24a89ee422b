# Session 50 device commands (H200). The GGUF came over in three 36 MiB parts: cat part_00 part_01 part_02 > /root/smol/smol.gguf (md5 a1231443440b107ff29f02bdb38c9d0a).
# SPARSEDEC_SHARED pointed at a copy of ../shared/prompts/{mt_bench,humaneval}.

set -x
mkdir -p /root/smol && cp .devcarry/gg00/part_00 /root/smol/ && ls -la /root/smol
python -m pip install --no-index --no-deps .devcarry/wheels/*.whl .devcarry/wheels2/*.whl -q 2>&1 | tail -2
python -c "import jax; print(jax.devices()[0].device_kind)"
timeout 480 python -m pytest -q -p no:cacheprovider tests/test_kernel_quant_attention.py tests/test_kernel_dequantize_kv.py tests/test_quant_dispatch.py 2>&1 | tail -15 | tee $OUT/gpu_tests_quant_s50_h200.txt

python -c "import pytest" 2>/dev/null || python -m pip install --no-index --no-deps .devcarry/wheels/*.whl .devcarry/wheels2/*.whl -q 2>&1 | tail -2
F="tests/test_quant_dispatch.py::test_verification_window_across_a_flush_equals_reference tests/test_quant_dispatch.py::test_draft_token_with_in_flight_scratch_equals_reference tests/test_quant_dispatch.py::test_the_drafts_view_bf16_tail_and_stacked_scratch_equal_the_fp32_reference tests/test_quant_dispatch.py::test_quantspec_greedy_interpret_equals_reference tests/test_quant_dispatch.py::test_precomputed_tail_is_what_the_view_reads"
echo "== compiled kernel (KERNEL=pallas on the GPU)"
timeout 250 python -m pytest -p no:cacheprovider -rf --tb=short -q $F > $OUT/gpu_tests_quant_dispatch_pallas_s50_h200.txt 2>&1
tail -c 3000 $OUT/gpu_tests_quant_dispatch_pallas_s50_h200.txt
echo "== the interpreter on the GPU at highest matmul precision (was: default TF32)"
sed -i 's/^KERNEL = "pallas" if .*/KERNEL = "interpret"/' tests/test_quant_dispatch.py
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 python -m pytest -p no:cacheprovider -rf --tb=line -q tests/test_quant_dispatch.py::test_verification_window_across_a_flush_equals_reference tests/test_quant_dispatch.py::test_draft_token_with_in_flight_scratch_equals_reference > $OUT/gpu_tests_quant_dispatch_interp_highest_s50_h200.txt 2>&1
tail -c 1500 $OUT/gpu_tests_quant_dispatch_interp_highest_s50_h200.txt

export SPARSEDEC_SHARED=$PWD/.devcarry/shared PYTHONPATH=$PWD JAX_DEFAULT_MATMUL_PRECISION=highest
ls -la /root/smol/smol.gguf
for K in 4 6; do
timeout 270 python benchmarks/ngram_decoding.py --gguf /root/smol/smol.gguf --dtype float32 --sweep --guesses 40 --length $K --num-prompts 10 --out $OUT/tau_k${K}_g40_fp32_s50_h200.json 2>&1 | grep -v -i warn | tail -9
done

export SPARSEDEC_SHARED=$PWD/.devcarry/shared PYTHONPATH=$PWD
timeout 440 python benchmarks/ngram_decoding.py --gguf /root/smol/smol.gguf --dtype bfloat16 --speed --guesses 10 40 --speed-prompts 5 --num-prompts 5 --out $OUT/ngram_speed_g10_g40_s50_h200.json 2>&1 | grep -v -i warn | grep -v "attn = attend" | tail -14
