#!/usr/bin/env bash
# Session 53, device call 2 (H200): the RoPE tables behind an optimization_barrier (rope_barrier.diff)
# against HEAD: one layer's kernel sequence (2-layer draft / verify, 128K) each, then the 32-layer
# draft and verify forwards A/B/A in separate processes.
set -u
export PYTHONPATH=$PWD
R=benchmarks/results/s53
QS="python benchmarks/quantspec_step.py --contexts 131072 --gammas 4 --layouts int4_t --weight-group 32 --one-row-gemv dp4a --kinds quantspec"
mkdir -p $OUT/hlo
XLA_FLAGS="--xla_dump_to=$OUT/hlo --xla_dump_hlo_module_re=.*loop.*" timeout 150 $QS --layers 2 --profile 40 \
  --kernel-sequence 60 --steps 8 --repeats 2 --out $OUT/seq_head.json > $OUT/seq_head.log 2>&1; echo "seq head $?"
find $OUT/hlo -mindepth 1 -type d -exec rm -rf {} +; ls $OUT/hlo
patch -p1 < $R/rope_barrier.diff && echo patched
timeout 150 $QS --layers 2 --profile 40 --kernel-sequence 60 --steps 8 --repeats 2 --out $OUT/seq_barrier.json > $OUT/seq_barrier.log 2>&1; echo "seq barrier $?"
timeout 120 $QS --no-isolate --out $OUT/full_barrier1.json > $OUT/full_barrier1.log 2>&1; echo "full barrier1 $?"
patch -R -p1 < $R/rope_barrier.diff && echo reverted
timeout 120 $QS --no-isolate --out $OUT/full_head.json > $OUT/full_head.log 2>&1; echo "full head $?"
patch -p1 < $R/rope_barrier.diff && echo patched
timeout 120 $QS --no-isolate --out $OUT/full_barrier2.json > $OUT/full_barrier2.log 2>&1; echo "full barrier2 $?"
grep -h "ms/forward" $OUT/full_*.log
