#!/usr/bin/env bash
# GPU check of the swap-in kernel's forward progress (issue #27, item 1), in one run from the repo root:
#   1. builds the kernels: the production build, the three test variants (HISPARSE_TEST_LATE_COPIERS_NS,
#      HISPARSE_TEST_LATE_ARRIVALS_NS, HISPARSE_TEST_LATE_PLANNER_NS) and the production build of HEAD's csrc/
#      (the table's "against"), in parallel;
#   2. tests/gpu/test_swap_in.py, test_swap_in_variant.py, test_swap_in_progress.py (the hog tests need CuPy),
#      test_swap_in_positions.py (the verify step's kernels);
#   3. compute-sanitizer memcheck and racecheck on tests/gpu/sanitize_swap_in.py (production and both variants);
#   4. bench_swap_in.py table --against <HEAD's csrc>: 1152-B rows, bs 1 8 32 64 128, 0 5 20 100 % misses, 3 rounds
#      (20 of the 50 cells of the full table; TABLE_ARGS replaces these options);
#   5. the other tests/gpu tests.
# Everything goes to $OUT (default /tmp/hisparse_out); summary.txt has one line per step. About 6-8 min on an H100.
#   OTHER_TESTS=0: skip step 5.
#   AGAINST: the earlier kernel sources (default: `git archive HEAD csrc` when git works here, else .before/csrc).
#   carry: .whl (apache-tvm-ffi wheel) if tvm_ffi is not importable, as for benchmarks/run_gpu_kernels.sh.
set -uo pipefail
OUT=${OUT:-/tmp/hisparse_out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
STARTED=$SECONDS

step() {  # step NAME LIMIT_S LOG COMMAND...: runs COMMAND under a time limit, logs it, records its exit status
  local name=$1 limit=$2 log=$3
  shift 3
  local begun=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local status=$?
  local line="$name: exit $status in $((SECONDS - begun)) s ($(basename "$log"))"
  [ "$status" -eq 124 ] && line="$line, TIMED OUT after $limit s"
  echo "$line" | tee -a "$SUMMARY"
  return "$status"
}

if ! PYTHONPATH=/tmp/site python3 -c "import tvm_ffi" 2>/dev/null && ! python3 -c "import tvm_ffi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/apache_tvm_ffi-*.whl || {
    echo "tvm_ffi is not importable and no .whl/apache_tvm_ffi-*.whl to install" | tee -a "$SUMMARY"; exit 1; }
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HISPARSE_CACHE_DIR=${HISPARSE_CACHE_DIR:-/tmp/hisparse_cache}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" >> "$OUT/gpu.txt" 2>&1
python3 -c "import cupy; print('cupy', cupy.__version__)" >> "$OUT/gpu.txt" 2>&1 || echo "cupy: not importable (hog tests skip)" >> "$OUT/gpu.txt"

# The earlier kernel: HEAD's csrc/ (this tree's kernel before the uncommitted change): $AGAINST if set, else
# `git archive HEAD csrc` if this copy has its git history, else .before/csrc (carried; made the same way).
if [ -z "${AGAINST:-}" ]; then
  if git rev-parse HEAD > "$OUT/against_commit.txt" 2>/dev/null; then
    rm -rf /tmp/hisparse_against_head && mkdir -p /tmp/hisparse_against_head
    git archive HEAD csrc | tar -x -C /tmp/hisparse_against_head && AGAINST=/tmp/hisparse_against_head/csrc
  elif [ -f .before/csrc/swap_in_binding.cu ]; then
    AGAINST=$PWD/.before/csrc
    echo "no git history here: against the carried .before/csrc" > "$OUT/against_commit.txt"
  fi
fi
echo "against: ${AGAINST:-none} ($(cat "$OUT/against_commit.txt" 2>/dev/null || echo 'set by AGAINST'))" | tee -a "$SUMMARY"

# 1. Builds, in parallel (each is one nvcc run of ~15-20 s; each its own cache entry and lock).
build() {  # build LOG DEFINES [SOURCES]
  python3 - "$2" "${3:-}" > "$1" 2>&1 <<'EOF'
import sys, time
from hisparse_sglang.ops.jit import load_module
defines = tuple(d for d in sys.argv[1].split(",") if d)
started = time.monotonic()
load_module(defines, sources=sys.argv[2] or None)
print(f"built {defines or 'production'} from {sys.argv[2] or 'csrc/'} in {time.monotonic() - started:.1f} s")
EOF
}
begun=$SECONDS
builds=()
build "$OUT/build_production.log" "" & builds+=($!)
build "$OUT/build_late_copiers.log" "HISPARSE_TEST_LATE_COPIERS_NS=30000" & builds+=($!)
build "$OUT/build_late_arrivals.log" "HISPARSE_TEST_LATE_ARRIVALS_NS=30000" & builds+=($!)
build "$OUT/build_late_planner.log" "HISPARSE_TEST_LATE_PLANNER_NS=30000" & builds+=($!)
if [ -n "${AGAINST:-}" ]; then build "$OUT/build_against.log" "" "$AGAINST" & builds+=($!); fi
failed=0
for pid in "${builds[@]}"; do wait "$pid" || failed=1; done
echo "builds: $([ $failed -eq 0 ] && echo ok || echo FAILED) in $((SECONDS - begun)) s ($(cat "$OUT"/build_*.log | grep -c '^built') built; build_*.log)" \
  | tee -a "$SUMMARY"
[ $failed -eq 0 ] || { tail -30 "$OUT"/build_*.log; exit 1; }

# 2. The swap-in tests.
step "swap-in tests" 480 "$OUT/gpu_tests_swap_in.log" \
  python3 -m pytest -q -rs --durations=10 tests/gpu/test_swap_in.py tests/gpu/test_swap_in_variant.py \
  tests/gpu/test_swap_in_progress.py tests/gpu/test_swap_in_positions.py
tail -3 "$OUT/gpu_tests_swap_in.log"

# 3. compute-sanitizer (the variants are built: nothing compiles under the sanitizer).
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do
  step "compute-sanitizer $tool" 240 "$OUT/sanitizer_$tool.log" \
    "$SANITIZER" --tool "$tool" --error-exitcode 9 python3 tests/gpu/sanitize_swap_in.py
  tail -2 "$OUT/sanitizer_$tool.log"
done

# 4. Before/after table.
if [ -n "${AGAINST:-}" ]; then
  # shellcheck disable=SC2086
  step "table --against HEAD" 300 "$OUT/bench.log" python3 benchmarks/bench_swap_in.py table --against "$AGAINST" \
    ${TABLE_ARGS:---rows 1152 --batch 1 8 32 64 128 --miss 0 5 20 100 --rounds 3} --tag _against_head --out "$OUT"
  grep -A 40 "^Before/after" "$OUT/bench.log" | head -40
else
  echo "table --against: skipped (no git and no .before/csrc; set AGAINST=DIR)" | tee -a "$SUMMARY"
fi

# 5. The other GPU tests (OTHER_TESTS=0 leaves them to another call).
[ "${OTHER_TESTS:-1}" = 0 ] || step "other GPU tests" 300 "$OUT/gpu_tests_other.log" \
  python3 -m pytest -q -rs --durations=10 tests/gpu --ignore=tests/gpu/test_swap_in.py \
  --ignore=tests/gpu/test_swap_in_variant.py --ignore=tests/gpu/test_swap_in_progress.py \
  --ignore=tests/gpu/test_swap_in_positions.py
[ "${OTHER_TESTS:-1}" = 0 ] || tail -3 "$OUT/gpu_tests_other.log"

echo "total: $((SECONDS - STARTED)) s" | tee -a "$SUMMARY"
cat "$SUMMARY"
