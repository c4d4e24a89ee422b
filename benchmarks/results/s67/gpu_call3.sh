#!/usr/bin/env bash
# Session 67, device call 3 (H200): the one-pass pool insert against the round-based one, same
# machine: SmolLM2 step profiles (MT-Bench prompt 0, 20 guesses) and issue 4's tokens/s (bf16,
# B 1, 5 prompts a set, 10 and 40 guesses). "new" was 8b51d2a's pool.py, "old" 7990ef8's (a
# tree with the old_pool.diff of the time applied, v1 -> old; the committed old_pool.diff and
# v1_pool.diff rebuild both from the final pool.py).
set -x
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cp .devcarry/gg/part_02 /root/smol/ && cat /root/smol/part_00 /root/smol/part_01 /root/smol/part_02 > /root/smol/smol.gguf
md5sum /root/smol/smol.gguf
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
root=$PWD; here=$root/benchmarks/results/s67
rm -rf /tmp/old && mkdir /tmp/old && cp -r sparsedec pallas_kernels benchmarks /tmp/old/
patch -s -p1 -d /tmp/old < $here/old_pool.diff && grep -c "_insert_round" /tmp/old/sparsedec/ngram/pool.py
export SPARSEDEC_SHARED=$root/.devcarry/shared
for run in new old; do
  dir=$root; [ $run = old ] && dir=/tmp/old
  (cd $dir && PYTHONPATH=$dir timeout 200 python benchmarks/ngram_step_profile.py --gguf /root/smol/smol.gguf \
     --top 40 --out $OUT/ngram_step_profile_${run}_s67_h200.json) 2>&1 | grep -v -i warn | tail -8
done
for run in new old; do
  dir=$root; [ $run = old ] && dir=/tmp/old
  (cd $dir && PYTHONPATH=$dir timeout 260 python benchmarks/ngram_decoding.py --gguf /root/smol/smol.gguf \
     --dtype bfloat16 --speed --guesses 10 40 --speed-prompts 5 --num-prompts 5 \
     --out $OUT/ngram_speed_g10_g40_${run}_s67_h200.json) 2>&1 | grep -v -i warn | grep -v "attn = attend" | tail -12
done
