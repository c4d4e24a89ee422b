#!/usr/bin/env bash
# Session 68, device call 3 (H200, after calls 1-2 brought GGUF parts 0-1): the final code (this
# tree) against 8b51d2a (session 67's GPU-measured one-pass pool) and 7990ef8 (the round-based
# pool): prompt seeding time (seed_time.py), then the SmolLM2 step profiles (MT-Bench prompt 0,
# 20 guesses) of final and 8b51d2a. Trees: git archive of sparsedec, pallas_kernels, benchmarks.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cp .devcarry/gg/part_02 /root/smol/ && cat /root/smol/part_00 /root/smol/part_01 /root/smol/part_02 > /root/smol/smol.gguf
md5sum /root/smol/smol.gguf
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
root=$PWD; here=$root/benchmarks/results/s68; export SPARSEDEC_SHARED=$root/.devcarry/shared
for c in 7990ef8 8b51d2a; do rm -rf /tmp/$c && mkdir /tmp/$c && tar xf .devcarry/trees/$c.tar -C /tmp/$c; done
log=$OUT/gpu_call3_s68_h200.txt; nvidia-smi -L > $log
for run in final 8b51d2a 7990ef8; do
  dir=$root; [ $run != final ] && dir=/tmp/$run
  (cd $dir && PYTHONPATH=$dir timeout 60 python $here/seed_time.py $run $OUT/seed_time_${run}_s68_h200.json 512 4096) >> $log 2>&1
  echo "rc=$? seed $run" >> $log
done
for run in final 8b51d2a; do
  dir=$root; [ $run != final ] && dir=/tmp/$run
  (cd $dir && PYTHONPATH=$dir timeout 120 python benchmarks/ngram_step_profile.py --gguf /root/smol/smol.gguf \
     --top 40 --out $OUT/ngram_step_profile_${run}_s68_h200.json) >> $log 2>&1; echo "rc=$? profile $run" >> $log
done
grep -E "rc=|seconds|per step|us" $log | grep -v -i warn | cut -c1-250 | tail -40
