#!/usr/bin/env bash
# Session 70, device call 1 (H200): GGUF part 0 to /root/smol; session 69's prepared probes:
# (1) does loading Mosaic GPU kernels set off the process slowdown (drop_profile.py's mosaic:N
# between dense phases)? (2) issue 4's 8B step ratios, each method from empty compilation caches
# (method_step.py calls fresh_executables() per method); (3) the CUDA plugins' driver calls.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /root/smol && cp .devcarry/gg/part_00 /root/smol/
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
log=$OUT/gpu_call1_s70_h200.txt; nvidia-smi -L > $log
p=benchmarks/results/s69/drop_profile.py
PYTHONPATH=$PWD timeout 200 python $p $OUT/drop_profile_mosaic_s70_h200.json dense:0,mosaic:4,dense:0,mosaic:12,dense:0 >> $log 2>&1
echo "rc=$? drop_profile" >> $log
PYTHONPATH=$PWD timeout 330 python benchmarks/method_step.py --contexts 4096 32768 \
  --out $OUT/method_step_fresh_s70_h200.json >> $log 2>&1
echo "rc=$? method_step" >> $log
for so in $(python -c "import os, jax_plugins; print(' '.join(os.path.dirname(p) for p in jax_plugins.__path__))" 2>/dev/null) \
          $(python -c "import os, jax_cuda13_plugin as m; print(os.path.dirname(m.__file__))" 2>/dev/null); do
  find $so -name "*.so*" | while read f; do
    strings $f | grep -E "^cu(FuncSetAttribute|FuncSetCacheConfig|CtxSetLimit|CtxSetCacheConfig|ModuleLoad[A-Za-z]*|LibraryLoad[A-Za-z]*|GraphUpload)$" \
      | sort -u | sed "s|^|$(basename $f): |"
  done
done > $OUT/plugin_driver_calls_s70_h200.txt
python -c "
import json; d = json.load(open('$OUT/drop_profile_mosaic_s70_h200.json'))
for r in d['rows'] if isinstance(d, dict) else d: print({k: r[k] for k in r if k in ('phase','method','spec','tokens_per_second','busy_us','span_us','gap_median_ns')})" 2>&1 | tail -12
grep -E "rc=|ms/step|ratio|wrote" $log | grep -v -i warn | cut -c1-250
head -30 $OUT/plugin_driver_calls_s70_h200.txt
