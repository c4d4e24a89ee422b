#!/usr/bin/env bash
# Session 66, device call 4 (H200): issue 4's 8B method step at 4K, old dispatch (a copy with the
# old attention.py / quant_weights.py) against the new one in one run: old, new, old.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
root=$PWD; here=$root/benchmarks/results/s66
rm -rf /tmp/old && mkdir /tmp/old && cp -r sparsedec pallas_kernels benchmarks /tmp/old/
# The old files (72a0704's). The recorded run copied them whole from old/; that folder is now
# this patch, which turns the final code's two files into byte-identical copies of them.
patch -s -p1 -d /tmp/old < $here/old_dispatch.diff
log=$OUT/gpu_call4_s66_h200.txt; nvidia-smi -L > $log
for run in old new old2; do
  dir=$root; [ ${run:0:3} = old ] && dir=/tmp/old
  (cd $dir && PYTHONPATH=$dir timeout 150 python benchmarks/method_step.py --contexts 4096 \
     --methods dense fafo --out $OUT/method_step_4k_${run}_s66_h200.json) >> $log 2>&1
  echo "rc=$? $run" >> $log
done
grep -E "rc=|ms/step" $log | cut -c1-300
