#!/usr/bin/env bash
# Session 69, device call 1 (H200): GGUF part 0 to /root/smol; XLA's GPU flags with their defaults
# (XLA_FLAGS=--help through the CUDA plugin); the step profile at 40 guesses with random weights,
# the final code (this tree) and 8b51d2a (session 67's GPU-measured pool; git archive).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /root/smol && cp .devcarry/gg/part_00 /root/smol/
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
XLA_FLAGS=--help timeout 60 python -c "import jax; print(jax.devices())" > $OUT/xla_flags_help_s69_h200.txt 2>&1
cp $OUT/xla_flags_help_s69_h200.txt /root/smol/xla_help.txt
grep -i -E "command_buffer|graph" $OUT/xla_flags_help_s69_h200.txt | cut -c1-400
root=$PWD; log=$OUT/gpu_call1_s69_h200.txt; nvidia-smi -L > $log
rm -rf /tmp/8b51d2a && mkdir /tmp/8b51d2a && tar xf .devcarry/trees/8b51d2a.tar -C /tmp/8b51d2a
for run in final 8b51d2a; do
  dir=$root; [ $run != final ] && dir=/tmp/$run
  (cd $dir && PYTHONPATH=$dir timeout 200 python benchmarks/ngram_step_profile.py --random-weights --guesses 40 \
     --top 40 --out $OUT/ngram_step_profile_rw_g40_${run}_s69_h200.json) >> $log 2>&1; echo "rc=$? profile $run" >> $log
done
for run in final 8b51d2a; do python -c "
import json; d = json.load(open('$OUT/ngram_step_profile_rw_g40_${run}_s69_h200.json'))
print('$run', {m: (round(d[m]['device_per_step_us'], 1), round(d[m]['wall_per_step_us'], 1), d[m]['kernels_per_step'], d[m]['steps']) for m in ('dense', 'fafo', 'lookahead') if m in d})"; done
grep rc= $log
