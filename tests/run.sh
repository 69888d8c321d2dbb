#!/usr/bin/env bash
# tests/run.sh - runs every test program and Lua test file, and totals their
# "PASS/FAIL/SKIP name" lines into the closing "N passed, N failed, N skipped".
# Called by `make test` (BUILD=build, build-san or build-tsan; T=PATTERN keeps the
# tests whose name contains PATTERN; TSAN=1 only the tests that use threads); exits
# non-zero on any failure.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
export KILN_SHARED=${KILN_SHARED:-../shared}
export KILN_PATH=          # test the scripts embedded in the binary
export KILN_CHECK_LEAKS=1  # the kiln program fails a script that leaves bytes allocated
unset KILN_TOKENIZER      # the tests name their vocabularies themselves
if [ "${SAN:-0}" = 1 ]; then
  # OpenBLAS and libpng are not instrumented; leaks in the runtime are what we look for
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
fi
# ThreadSanitizer: the tests whose work crosses threads (a report fails the program)
THREAD_TESTS="test_soak test_weight_cache test_embed test_model test_alloc test_live test_mem_timeline test_precision_scope test_stream.lua test_residency.lua test_serve.lua"
if [ "${TSAN:-0}" = 1 ]; then
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=0:exitcode=66:second_deadlock_stack=1}
fi

pass=0; fail=0; skip=0; failed_names=()
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT

run_one() { # name, command...
  local name=$1; shift
  case "$name" in *"${T:-}"*) ;; *) return ;; esac  # make test T=PATTERN
  if [ "${TSAN:-0}" = 1 ]; then
    case " $THREAD_TESTS " in *" ${name%.*} "*|*" $name "*) ;; *) return ;; esac
  fi
  local out="$log/$(echo "$name" | tr '/ ' '__').out"
  local start=$(date +%s.%N)
  "$@" >"$out" 2>&1
  local rc=$?
  local secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e-s}')
  local p=$(grep -c '^PASS ' "$out"); local f=$(grep -c '^FAIL ' "$out"); local s=$(grep -c '^SKIP ' "$out")
  if [ "$rc" != 0 ] && [ "$f" = 0 ]; then
    f=1; echo "FAIL $name: exited with status $rc" >>"$out"
  fi
  pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
  printf '%-34s %4d passed %3d failed %3d skipped  (%ss)\n' "$name" "$p" "$f" "$s" "$secs"
  if [ "$f" != 0 ]; then
    failed_names+=("$name")
    grep -v '^PASS ' "$out" | head -40 | sed 's/^/    /'
  fi
  grep '^SKIP ' "$out" | sed 's/^/    /'
}

for t in "$BUILD"/tests/test_*; do
  [ -x "$t" ] || continue
  run_one "$(basename "$t")" "$t"
done
for t in tests/test_*.sh; do
  [ -f "$t" ] || continue
  run_one "$(basename "$t")" bash "$t" "$BUILD/kiln"
done
for t in tests/lua/test_*.lua; do
  [ -f "$t" ] || continue
  run_one "$(basename "$t")" "$BUILD/kiln" "$t"
done

echo
if [ ${#failed_names[@]} -gt 0 ]; then echo "failed: ${failed_names[*]}"; fi
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ]
