cd /work/main
T=tests/test_quantspec.py::test_greedy_int8_verify_equals_dequantized_int8_dense_on_smollm2
for flags in "" "--xla_backend_optimization_level=0" "--xla_llvm_disable_expensive_passes=true"; do
  s=$(date +%s); XLA_FLAGS="$flags" CI=true .venv/bin/python -m pytest -q -p no:cacheprovider $T > /tmp/ft.log 2>&1; rc=$?
  echo "flags=[$flags] rc=$rc $(( $(date +%s) - s )) s $(tail -1 /tmp/ft.log)"
done
