#!/usr/bin/env bash
# Session 68, device call 6 (H200): drift_probe.py twice with XLA_PYTHON_CLIENT_PREALLOCATE=false
# (as every benchmark call of sessions 63-68) and twice with the default (preallocate 75%),
# alternating, with nvidia-smi logging SM / memory clocks, temperature and power every 200 ms.
here=benchmarks/results/s68
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
  --format=csv -lms 200 > $OUT/smi_clocks_s68_h200.csv 2>&1 &
smi=$!
for i in 1 2; do
  for alloc in false default; do
    echo "$(date +%s.%N) start $alloc $i" >> $OUT/drift_phases_s68_h200.txt
    if [ $alloc = false ]; then export XLA_PYTHON_CLIENT_PREALLOCATE=false; else unset XLA_PYTHON_CLIENT_PREALLOCATE; fi
    PYTHONPATH=$PWD timeout 130 python $here/drift_probe.py $OUT/drift_${alloc}_${i}_s68_h200.json 5 2>&1 \
      | grep -v -i warn | tail -1
    echo "rc=${PIPESTATUS[0]} $alloc $i"
  done
done
kill $smi
for f in $OUT/drift_*_s68_h200.json; do python -c "
import json, sys; d = json.load(open('$f')); import collections
by = collections.defaultdict(list)
for r in d['rows']: by[(r['phase'], r['method'])].append(r['tokens_per_second'])
print('$f'.split('/')[-1], ' '.join(f'{p}{m[:2]} {sum(v)/len(v):.0f}' for (p, m), v in sorted(by.items())))"; done
