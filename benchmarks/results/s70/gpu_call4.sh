#!/usr/bin/env bash
# Session 70, device call 4 (H200): (1) the in-flight tile at Tq above 8 and not a multiple of 8
# (k_new / v_new now padded, `hopper.tma_rows`): the new tests compiled on the GPU, and the tile
# timed against the in-flight kernel (tile_rows_probe.py); (2) session 69's trigger question
# again: dense, 4 then 12 Mosaic GPU decode kernels (Tq 1..12, which crashed call 1 at Tq 9), dense.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl .devcarry/wtest/*.whl 2>&1 | tail -2
log=$OUT/gpu_call4_s70_h200.txt; nvidia-smi -L > $log
PYTHONPATH=$PWD timeout 240 python -m pytest -q -p no:cacheprovider tests/test_kernel_decode_attention.py \
  tests/test_kernel_sparse_attention.py -k "row_counts_the_tma or in_kernel_tile_choice or few_queries_in_flight" >> $log 2>&1
echo "rc=$? pytest" >> $log
PYTHONPATH=$PWD timeout 200 python benchmarks/results/s70/tile_rows_probe.py $OUT/tile_rows_probe_s70_h200.json >> $log 2>&1
echo "rc=$? tile_rows_probe" >> $log
PYTHONPATH=$PWD timeout 150 python benchmarks/results/s69/drop_profile.py $OUT/drop_profile_mosaic_s70_h200.json \
  dense:0,mosaic:4,dense:0,mosaic:12,dense:0 >> $log 2>&1
echo "rc=$? drop_profile" >> $log
grep -v -i warn $log | grep -E "rc=|passed|failed|ERROR|smollm2|llama8b|^[0-9] " | cut -c1-220
