#!/usr/bin/env bash
# Session 70, device call 3 (H200, after calls 1-2 brought GGUF parts 0-1): the GGUF assembled;
# issue 4's SmolLM2 tokens/s with benchmarks/ngram_decoding.py --speed in session 68's order
# (every set's dense first), each row from empty compilation caches (--fresh-executables, the default on a GPU), guesses 10 and 40, bf16, B 1, 5 prompts a set.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cp .devcarry/gg/part_02 /root/smol/ && cat /root/smol/part_00 /root/smol/part_01 /root/smol/part_02 > /root/smol/smol.gguf
md5sum /root/smol/smol.gguf
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
export SPARSEDEC_SHARED=$PWD/.devcarry/shared
log=$OUT/gpu_call3_s70_h200.txt; nvidia-smi -L > $log
timeout 565 python benchmarks/ngram_decoding.py --gguf /root/smol/smol.gguf --dtype bfloat16 --speed \
  --guesses 10 40 --speed-prompts 5 --num-prompts 5 --out $OUT/ngram_speed_s70_h200.json >> $log 2>&1
echo "rc=$? speed" >> $log
grep -E "rc=|tokens/s|dense" $log | grep -v -i warn | cut -c1-250
