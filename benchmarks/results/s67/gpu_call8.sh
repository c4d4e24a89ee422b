#!/usr/bin/env bash
# Session 67, device call 8 (H200, a fresh machine; calls 6-7 brought GGUF parts 0-1 as calls
# 1-2 did): the sort-based pool insert of 4c05b23 (v2_pool.diff rebuilds it from the final
# pool.py) on issue 4's tokens/s and the step profile. Not kept: the final code is 8b51d2a's
# (calls 3-4) with one comparison made smaller. Its two JSONs were renamed *_v2_* afterwards.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cp .devcarry/gg/part_02 /root/smol/ && cat /root/smol/part_00 /root/smol/part_01 /root/smol/part_02 > /root/smol/smol.gguf
md5sum /root/smol/smol.gguf
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
export SPARSEDEC_SHARED=$PWD/.devcarry/shared PYTHONPATH=$PWD
log=$OUT/gpu_call8_s67_h200.txt; nvidia-smi -L > $log
timeout 100 python benchmarks/ngram_step_profile.py --gguf /root/smol/smol.gguf --top 40 \
  --out $OUT/ngram_step_profile_final_s67_h200.json >> $log 2>&1; echo "rc=$? profile" >> $log
timeout 380 python benchmarks/ngram_decoding.py --gguf /root/smol/smol.gguf --dtype bfloat16 --speed \
  --guesses 10 40 --speed-prompts 5 --num-prompts 5 --out $OUT/ngram_speed_g10_g40_final_s67_h200.json >> $log 2>&1
echo "rc=$? speed" >> $log
grep -E "rc=|tokens/s|per step" $log | cut -c1-250
