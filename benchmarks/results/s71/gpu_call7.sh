#!/usr/bin/env bash
# Session 71, device call 7 (H200, after calls 5-6 brought GGUF parts 0-1 to /root/smol): the GGUF
# assembled; draft-model speculative decoding on the real SmolLM2 (bf16) against dense, tokens/s
# (smol_speculative_gpu.py: drafts of its first 10 layers at gamma 3, 20 at gamma 4).
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false SPARSEDEC_SHARED=$PWD/.devcarry/shared
cp .devcarry/gg/part_02 /root/smol/ && cat /root/smol/part_00 /root/smol/part_01 /root/smol/part_02 > /root/smol/smol.gguf
md5sum /root/smol/smol.gguf
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
SPEC_ROWS="10:3 20:4" timeout 400 python benchmarks/results/s71/smol_speculative_gpu.py /root/smol/smol.gguf \
  $OUT/smol_speculative_s71_h200.json 5 > $OUT/smol_speculative_s71_h200.log 2>&1; echo "spec rc $?"
grep "^{" $OUT/smol_speculative_s71_h200.log | cut -c1-300
