#!/usr/bin/env bash
# For session 70 (H200, no GGUF needed): (1) what triggers the process slowdown: dense, then N
# Mosaic GPU decode_attention kernels outside any loop, then dense (drop_profile.py's mosaic:N);
# (2) issue 4's 8B step ratio with every method from empty compilation caches
# (method_step.py now calls fresh_executables() per method; session 60: 1.99x / 2.10x dense).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python -m pip install -q --no-index --no-deps .devcarry/wsmall/*.whl 2>&1 | tail -2
p=benchmarks/results/s69/drop_profile.py
PYTHONPATH=$PWD timeout 200 python $p $OUT/drop_profile_mosaic_s70_h200.json dense:0,mosaic:4,dense:0,mosaic:12,dense:0 2>&1 \
  | grep -v -i warn | tail -5
PYTHONPATH=$PWD timeout 360 python benchmarks/method_step.py --contexts 4096 32768 \
  --out $OUT/method_step_fresh_s70_h200.json 2>&1 | grep -E "ms/step|wrote" | tail -8
# What the Mosaic GPU runtime may change process-wide when it loads a kernel (driver calls named
# in the CUDA plugins' libraries): a lead for the slowdown's trigger.
for so in $(python -c "import os, jax_plugins; print(' '.join(os.path.dirname(p) for p in jax_plugins.__path__))" 2>/dev/null) \
          $(python -c "import os, jax_cuda13_plugin as m; print(os.path.dirname(m.__file__))" 2>/dev/null); do
  find $so -name "*.so*" | while read f; do
    strings $f | grep -E "^cu(FuncSetAttribute|FuncSetCacheConfig|CtxSetLimit|CtxSetCacheConfig|ModuleLoad[A-Za-z]*|LibraryLoad[A-Za-z]*|GraphUpload)$" \
      | sort -u | sed "s|^|$(basename $f): |"
  done
done > $OUT/plugin_driver_calls_s70_h200.txt; cat $OUT/plugin_driver_calls_s70_h200.txt | head -30
