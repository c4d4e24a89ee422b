#!/usr/bin/env bash
# Session 71, device call 3 (H200, after calls 1-2 brought GGUF parts 0-1): the GGUF assembled;
# the real SmolLM2 (bf16) through the step shapes session 70's tile fix made lower
# (smol_tile_gpu.py: Lookahead W 4 N 3 G 2 / W 3 N 4 G 2, QuantSpec gamma 8 / 11 "full").
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false SPARSEDEC_SHARED=$PWD/.devcarry/shared
cp .devcarry/gg/part_02 /root/smol/ && cat /root/smol/part_00 /root/smol/part_01 /root/smol/part_02 > /root/smol/smol.gguf
md5sum /root/smol/smol.gguf
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
timeout 540 python benchmarks/results/s71/smol_tile_gpu.py /root/smol/smol.gguf $OUT/smol_tile_s71_h200.json \
  > $OUT/smol_tile_s71_h200.log 2>&1; echo "smol rc $?"
grep -v -i warn $OUT/smol_tile_s71_h200.log | tail -8 | cut -c1-600
