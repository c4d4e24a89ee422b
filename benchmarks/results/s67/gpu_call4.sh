#!/usr/bin/env bash
# Session 67, device call 4 (H200, after call 3 on the same machine): HumanEval at 40 guesses
# (call 3 ran out of time there), then issue 4's 8B step at 4K (dense, FAFO, Lookahead); "new"
# = 8b51d2a's pool.py, "old" = 7990ef8's, as in gpu_call3.sh.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
root=$PWD; export SPARSEDEC_SHARED=$root/.devcarry/shared
log=$OUT/gpu_call4_s67_h200.txt; nvidia-smi -L > $log
for run in new old; do
  dir=$root; [ $run = old ] && dir=/tmp/old
  (cd $dir && PYTHONPATH=$dir timeout 115 python benchmarks/ngram_decoding.py --gguf /root/smol/smol.gguf \
     --dtype bfloat16 --speed --prompt-sets humaneval --guesses 40 --speed-prompts 5 --num-prompts 5 \
     --out $OUT/ngram_speed_humaneval_g40_${run}_s67_h200.json) >> $log 2>&1; echo "rc=$? speed $run" >> $log
done
for run in new old; do
  dir=$root; [ $run = old ] && dir=/tmp/old
  (cd $dir && PYTHONPATH=$dir timeout 165 python benchmarks/method_step.py --contexts 4096 \
     --methods dense fafo lookahead --out $OUT/method_step_4k_${run}_s67_h200.json) >> $log 2>&1
  echo "rc=$? step $run" >> $log
done
grep -E "rc=|ms/step|tokens/s" $log | cut -c1-300
