#!/usr/bin/env bash
# Session 53, device call 4 (H200): the dense step (8K, 128K) and QuantSpec's 8K forwards, HEAD
# against rope_barrier.diff, alternating B/A/B/A in separate processes.
set -u
export PYTHONPATH=$PWD
R=benchmarks/results/s53
D="python benchmarks/quantspec_step.py --contexts 8192 131072 --kinds dense"
Q="python benchmarks/quantspec_step.py --contexts 8192 --gammas 4 --layouts int4_t --weight-group 32 --one-row-gemv dp4a --kinds quantspec --no-isolate"
patch -p1 < $R/rope_barrier.diff
for i in 1 2; do
  timeout 100 $D --out $OUT/dense_barrier$i.json > $OUT/dense_barrier$i.log 2>&1; echo "dense barrier$i $?"
  timeout 80 $Q --out $OUT/qs8k_barrier$i.json > $OUT/qs8k_barrier$i.log 2>&1; echo "qs8k barrier$i $?"
  patch -R -p1 < $R/rope_barrier.diff
  timeout 100 $D --out $OUT/dense_head$i.json > $OUT/dense_head$i.log 2>&1; echo "dense head$i $?"
  timeout 80 $Q --out $OUT/qs8k_head$i.json > $OUT/qs8k_head$i.log 2>&1; echo "qs8k head$i $?"
  patch -p1 < $R/rope_barrier.diff
done
for f in $OUT/*.log; do echo "== $(basename $f)"; grep -h "ms/step\|ms/forward" $f; done
rm -f $OUT/*.json.*  # keep the merged JSONs only
