# Session 51, H200 (device tool). PYTHONPATH=$PWD; pytest from .devcarry/wheels.
python benchmarks/read_floor.py --seqs 16384,65536 --batches 1 --out $OUT/read_floor_full_b1.json
python benchmarks/read_floor.py --quick --seqs 256,4096,131072 --batches 1 --out $OUT/read_floor_quick_b1.json
python benchmarks/read_floor.py --quick --seqs 256,4096,16384,65536 --batches 8 --out $OUT/read_floor_quick_b8_s51_h200.json
python benchmarks/results/s51/inflight_tile_ab.py $OUT/inflight_tile_ab_s51_h200.json
python -m pytest -q tests/test_kernel_decode_attention.py          # gpu_tests_decode*_s51_h200.txt
python benchmarks/kernels.py --kernels decode --batch 1 --seq 16384,65536 --tq 1,16 --refs dpa --out $OUT/kernels_decode_b1_s51_h200.json
python benchmarks/kernels.py --quick --refs dpa --out $OUT/kernels_quick_s51_h200.json
python -m pytest -q tests/test_attention_dispatch.py   # gpu_tests_attention_dispatch_s51_h200.txt (compiled kernel through the model forward)
