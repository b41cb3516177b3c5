#!/usr/bin/env bash
# One GPU-machine run for the kernels: GPU tests, compute-sanitizer, benchmark. Logs go to $OUT.
#   carry: .whl (apache-tvm-ffi cp312 wheel), .baseline (SGLang's kernel: bench_swap_in.py build-baseline)
#   BENCH_ARGS: a table or sweep invocation of bench_swap_in.py (default: table, the full table),
#     e.g. "sweep --batch 32 64 128 --miss 0 5" or "table --define NAME=1 --tag _variant"
set -uo pipefail
OUT=${OUT:-/tmp/hisparse_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/apache_tvm_ffi-*.whl || exit 1
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1 HISPARSE_CACHE_DIR=/tmp/hisparse_cache
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 tests/gpu/sanitize_swap_in.py \
      > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool exit $?: $(tail -2 "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
  done
fi
timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/bench_swap_in.py ${BENCH_ARGS:-table} --out "$OUT" 2>&1 \
  | tee "$OUT/bench.log" | grep -v "^row "
