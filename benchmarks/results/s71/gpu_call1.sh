#!/usr/bin/env bash
# Session 71, device call 1 (H200): GGUF part 0 to /root/smol; then session 70's prepared
# next_gpu_call.sh: issue 3's quick cells and the sparse B 8 cell on the current code, and the two
# method configurations session 70's GPU sweep did not reach (QuantSpec gamma 11, "full").
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /root/smol && cp .devcarry/gg/part_00 /root/smol/
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 270 python benchmarks/kernels.py --quick --refs dpa --out $OUT/kernels_quick_s71_h200.json \
  > $OUT/kernels_quick_s71_h200.log 2>&1; echo "quick rc $?"
timeout 110 python benchmarks/kernels.py --kernels decode,sparse --batch 8 --seq 16384 --tq 1 \
  --sparse-seq 16384 --fractions 0.016 --refs jnp --max-seconds 100 \
  --out $OUT/kernels_sparse_b8_s71_h200.json > $OUT/kernels_sparse_b8_s71_h200.log 2>&1; echo "b8 rc $?"
grep -h "ratio" $OUT/kernels_*_s71_h200.log | sort | uniq | cut -c1-220
SWEEP_FROM=40 timeout 150 python benchmarks/results/s70/method_sweep_gpu.py $OUT/method_sweep_tail_s71_h200.json 2>&1 \
  | grep -v -i warn | tail -3 | cut -c1-400
