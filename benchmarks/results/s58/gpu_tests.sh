#!/usr/bin/env bash
# Session 58's device runs of the test files compiled on the H200 (phase 1, 2, 3 in consecutive
# calls on one warm machine). The 98 MB SmolLM2 GGUF travels in three ~33 MB parts, one per call,
# gathered in /tmp/gg and joined in phase 3. Output: $OUT/gpu_tests_<phase>_s58_h200.txt.
set -u
phase="$1"; limit="${2:-470}"
python -m pip install -q --no-index --no-deps .devcarry/wheels/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
[ -e ../shared ] || cp -r .devcarry/shared ../shared
mkdir -p /tmp/gg && cp .devcarry/gguf/p* /tmp/gg/ 2>/dev/null; ls -la /tmp/gg
log="$OUT/gpu_tests_${phase}_s58_h200.txt"
nvidia-smi -L > "$log"
run() { timeout "$limit" python -m pytest -v -p no:cacheprovider -rfEs --durations=15 "$@" >> "$log" 2>&1; echo "pytest rc=$?" >> "$log"; }
case "$phase" in
  1) run tests/test_decode.py tests/test_serving.py ;;
  2) run tests/test_lookahead.py tests/test_cli.py tests/test_gptq.py -k "not smollm2" ;;
  3) cat /tmp/gg/p0 /tmp/gg/p1 /tmp/gg/p2 > /tmp/gg/smollm2.gguf && sha256sum /tmp/gg/smollm2.gguf >> "$log"
     export SPARSEDEC_SMOLLM2_GGUF=/tmp/gg/smollm2.gguf
     run tests/test_quantspec.py tests/test_fafo.py tests/test_cli.py tests/test_w4a8_gemv.py \
       tests/test_gguf_written.py tests/test_weights.py -k "smollm2 or gguf_with_its_own or exact_4bit" ;;
esac
tail -5 "$log"
