#!/usr/bin/env bash
# For session 71 (H200, no GGUF): issue 3's quick cells and the sparse B 8 cell on the current code
# (last run in session 60; session 70's tile padding touches only Tq 9..15 / 17..21, not the
# grid's Tq 1 / 16 / 64 / 256), then the two method configurations session 70's GPU sweep did not
# reach in its time (QuantSpec gamma 11, "full": method_sweep_gpu.py with SWEEP_LIMIT unset runs
# all 42; here only the tail, via SWEEP_FROM).
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python benchmarks/kernels.py --quick --refs dpa --out $OUT/kernels_quick_s71_h200.json \
  > $OUT/kernels_quick_s71_h200.log 2>&1; echo "quick rc $?"
timeout 120 python benchmarks/kernels.py --kernels decode,sparse --batch 8 --seq 16384 --tq 1 \
  --sparse-seq 16384 --fractions 0.016 --refs jnp --max-seconds 150 \
  --out $OUT/kernels_sparse_b8_s71_h200.json > $OUT/kernels_sparse_b8_s71_h200.log 2>&1; echo "b8 rc $?"
grep -h "ratio" $OUT/kernels_*_s71_h200.log | sort | uniq
SWEEP_FROM=40 timeout 150 python benchmarks/results/s70/method_sweep_gpu.py $OUT/method_sweep_tail_s71_h200.json 2>&1 \
  | grep -v -i warn | tail -3
