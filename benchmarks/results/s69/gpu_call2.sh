#!/usr/bin/env bash
# Session 69, device call 2 (H200, after call 1): GGUF part 1 to /root/smol; the dense-drop probe
# (session 68's drift_probe.py: dense / FAFO / Lookahead / dense / FAFO / dense in one process,
# 3 timed calls a phase) under command-buffer variants: the default types, the defaults plus WHILE
# and CONDITIONAL (XLA's "+TYPE" syntax adds to the defaults), and each other
# command-buffer flag call 1's --help listed that is worth a try (below, by name).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cp .devcarry/gg/part_01 /root/smol/
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
probe=benchmarks/results/s68/drift_probe.py
run() {  # name, XLA_FLAGS
  XLA_FLAGS="$2" PYTHONPATH=$PWD timeout 150 python $probe $OUT/drift_$1_s69_h200.json 3 > $OUT/drift_$1_s69_h200.log 2>&1
  echo "rc=$? $1 [$2]"; grep -v -i warn $OUT/drift_$1_s69_h200.log | grep -i -E "error|invalid|unknown" | head -3
}
run default ""
run while "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
for flag in $(grep -o -E "\-\-xla_gpu[a-z_]*(command_buffer|graph)[a-z_]*" /root/smol/xla_help.txt | sort -u); do echo "flag: $flag"; done
if grep -q -- "--xla_gpu_graph_min_graph_size" /root/smol/xla_help.txt; then run min1 "--xla_gpu_graph_min_graph_size=1"; fi
for f in $OUT/drift_*_s69_h200.json; do python -c "
import json, collections; d = json.load(open('$f')); by = collections.defaultdict(list)
for r in d['rows']: by[(r['phase'], r['method'])].append(r['tokens_per_second'])
print('$f'.split('/')[-1], ' '.join(f'{p}{m[:2]} {sum(v)/len(v):.0f}' for (p, m), v in sorted(by.items())))"; done
