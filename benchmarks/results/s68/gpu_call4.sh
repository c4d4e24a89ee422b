#!/usr/bin/env bash
# Session 68, device call 4 (H200, after call 3 on the same machine): issue 4's SmolLM2 tokens/s
# at 40 guesses (bf16, B 1, 5 prompts a set, both sets), final code then 8b51d2a.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
root=$PWD; export SPARSEDEC_SHARED=$root/.devcarry/shared
log=$OUT/gpu_call4_s68_h200.txt; nvidia-smi -L > $log
for run in final 8b51d2a; do
  dir=$root; [ $run != final ] && dir=/tmp/$run
  (cd $dir && PYTHONPATH=$dir timeout 280 python benchmarks/ngram_decoding.py --gguf /root/smol/smol.gguf \
     --dtype bfloat16 --speed --guesses 40 --speed-prompts 5 --num-prompts 5 \
     --out $OUT/ngram_speed_g40_${run}_s68_h200.json) >> $log 2>&1; echo "rc=$? speed $run" >> $log
done
grep -E "rc=|tokens/s" $log | grep -v -i warn | cut -c1-250
