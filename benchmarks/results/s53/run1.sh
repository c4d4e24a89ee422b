#!/usr/bin/env bash
# Session 53, device call 1 (H200): issue 5's 128K projection on the current code (dp4a draft,
# group-32 weights, acceptance of session 44) and the 2-layer draft / verify forwards' kernel
# sequence with XLA's optimized HLO (which glue fusions sit between the Pallas kernels).
set -u
export PYTHONPATH=$PWD
A=benchmarks/results/s44/quantspec_acceptance_wg32_bf16_b1_dp4a_s44_h200.json
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python benchmarks/quantspec_step.py --contexts 131072 --gammas 4 --layouts int4_t \
  --weight-group 32 --one-row-gemv dp4a --kinds dense quantspec --acceptance-json $A \
  --out $OUT/quantspec_step_128k_wg32_dp4a_s53_h200.json > $OUT/proj.log 2>&1
echo "proj rc $?"; tail -5 $OUT/proj.log
mkdir -p $OUT/hlo
XLA_FLAGS="--xla_dump_to=$OUT/hlo --xla_dump_hlo_module_re=.*loop.*" timeout 200 \
  python benchmarks/quantspec_step.py --contexts 131072 --gammas 4 --layouts int4_t \
  --weight-group 32 --one-row-gemv dp4a --kinds quantspec --layers 2 --profile 40 \
  --kernel-sequence 120 --steps 8 --repeats 2 --out $OUT/quantspec_seq_128k_2layers_s53_h200.json > $OUT/seq.log 2>&1
echo "seq rc $?"; tail -3 $OUT/seq.log
cd $OUT/hlo && ls | grep -v "after_optimizations.txt$" | xargs rm -f; ls | head; du -sh .
