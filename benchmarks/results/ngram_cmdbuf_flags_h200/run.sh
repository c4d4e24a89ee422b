#!/bin/bash
# Usage: devtmp/flags_speed.sh  (on the device; GGUF at /root/smol/smol.gguf)
export PYTHONUNBUFFERED=1 SPARSEDEC_SHARED=$PWD/.devcarry/shared PYTHONPATH=$PWD
CB=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN
i=0
for flags in "" "--xla_gpu_enable_command_buffer=$CB,WHILE,CONDITIONAL" "--xla_gpu_enable_command_buffer="; do
  i=$((i+1))
  echo "=== run $i XLA_FLAGS='$flags'" | tee -a $OUT/flags_speed.log
  XLA_FLAGS="$flags" timeout 200 python benchmarks/ngram_decoding.py --gguf /root/smol/smol.gguf \
    --prompt-sets mt_bench --num-prompts 2 --speed --speed-guesses 20 --speed-prompts 2 \
    --out $OUT/flags_speed_$i.json >> $OUT/flags_speed.log 2>&1
  echo "rc $?" >> $OUT/flags_speed.log
done
