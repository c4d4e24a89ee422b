#!/usr/bin/env bash
# Session 53, device call 3 (H200): run2's kernel sequences (2-layer draft / verify at 128K), HEAD and
# with rope_barrier.diff, and their optimized HLO (tarred: the dump has too many files to come back).
set -u
export PYTHONPATH=$PWD
R=benchmarks/results/s53
QS="python benchmarks/quantspec_step.py --contexts 131072 --gammas 4 --layouts int4_t --weight-group 32 --one-row-gemv dp4a --kinds quantspec --layers 2 --profile 40 --kernel-sequence 60 --steps 8 --repeats 2"
for v in head barrier; do
  if [ $v = barrier ]; then patch -p1 < $R/rope_barrier.diff; fi
  D=/tmp/hlo_$v; mkdir -p $D
  XLA_FLAGS="--xla_dump_to=$D --xla_dump_hlo_module_re=.*loop.*" timeout 150 $QS --out $OUT/seq_$v.json > $OUT/seq_$v.log 2>&1; echo "seq $v $?"
  (cd $D && tar czf $OUT/hlo_$v.tgz *loop*after_optimizations.txt)
done
