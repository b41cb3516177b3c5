#!/usr/bin/env bash
# One GPU-machine run for the kernels: GPU tests, compute-sanitizer, benchmark. Logs go to $OUT.
#   carry: .whl (apache-tvm-ffi cp312 wheel; or part 1 of the e2e bundle installed into /tmp/site first by
#     tools/gpu-bundle/install_part.sh),
#     .baseline (SGLang's kernel: bench_swap_in.py build-baseline), .before (an earlier commit's csrc/ for
#     BENCH_ARGS="table --against .before/csrc": git archive <commit> csrc | tar -x -C .before)
#   STEPS: any of "tests sanitizer bench" (default all three, in that order)
#   BENCH_ARGS: a table or sweep invocation of bench_swap_in.py (default: table, the full table),
#     e.g. "sweep --batch 32 64 128 --miss 0 5" or "table --define NAME=1 --tag _variant"
set -uo pipefail
OUT=${OUT:-/tmp/hisparse_out}
STEPS=${STEPS:-tests sanitizer bench}
mkdir -p "$OUT"
if ! PYTHONPATH=/tmp/site python3 -c "import tvm_ffi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/apache_tvm_ffi-*.whl || exit 1
fi
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1 HISPARSE_CACHE_DIR=/tmp/hisparse_cache
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
case " $STEPS " in *" tests "*)
  timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -rs tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
esac
case " $STEPS " in *" sanitizer "*)
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 tests/gpu/sanitize_swap_in.py \
      > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool exit $?: $(tail -2 "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
  done ;;
esac
case " $STEPS " in *" bench "*)
  timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/bench_swap_in.py ${BENCH_ARGS:-table} --out "$OUT" 2>&1 \
    | tee "$OUT/bench.log" | grep -v "^row " ;;
esac
