#!/usr/bin/env bash
# Session 68, device call 7 (H200, a fresh machine): drift_probe.py (3 reps a phase) with XLA's GPU
# command buffers (CUDA graphs) off, then with WHILE and CONDITIONAL added to the default types:
# is the dense loop's ~17% drop after the FAFO / Lookahead loops (call 6) a command-buffer effect?
here=benchmarks/results/s68
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
export XLA_PYTHON_CLIENT_PREALLOCATE=false
for mode in off while; do
  if [ $mode = off ]; then flags="--xla_gpu_enable_command_buffer="
  else flags="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"; fi
  XLA_FLAGS="$flags" PYTHONPATH=$PWD timeout 110 python $here/drift_probe.py $OUT/drift_cmdbuf_${mode}_s68_h200.json 3 2>&1 \
    | grep -v -i warn | tail -2
  echo "rc=${PIPESTATUS[0]} $mode"
done
for f in $OUT/drift_cmdbuf_*_s68_h200.json; do python -c "
import json, collections; d = json.load(open('$f')); by = collections.defaultdict(list)
for r in d['rows']: by[(r['phase'], r['method'])].append(r['tokens_per_second'])
print('$f'.split('/')[-1], ' '.join(f'{p}{m[:2]} {sum(v)/len(v):.0f}' for (p, m), v in sorted(by.items())))"; done
