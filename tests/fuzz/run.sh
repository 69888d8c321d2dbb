#!/usr/bin/env bash
# tests/fuzz/run.sh - the running half of `make fuzz`: each libFuzzer harness of
# $FUZZ_BUILD/fuzz runs $FUZZ_SECONDS seconds on one core, from a working corpus
# ($FUZZ_BUILD/corpus/<name>, kept between runs) and the seeds of
# tests/fuzz/corpus/<name>; prints the executions of each and the total. A crash
# leaves its input as $FUZZ_BUILD/crashes/<name>-crash-* and fails the run: fix the
# parser, then copy the input to tests/fuzz/regressions/<name>/ so `make test`
# replays it. FUZZ_ONLY=json,png runs only those harnesses; tests/fuzz/<name>.options
# holds extra libFuzzer flags for one harness. FUZZ_RUNS=N stops each harness after N
# executions instead (with $FUZZ_SECONDS, default then a day, as the time limit).
set -u
cd "$(dirname "$0")/../.."
B=${FUZZ_BUILD:-build-fuzz}
RUNS=${FUZZ_RUNS:-}
if [ -n "$RUNS" ]; then N=${FUZZ_SECONDS:-86400}; else N=${FUZZ_SECONDS:-10}; fi
ONLY=${FUZZ_ONLY:-}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
mkdir -p "$B/crashes"
total=0
failed=()
for bin in "$B"/fuzz/fuzz_*; do
  [ -x "$bin" ] || continue
  name=${bin##*/fuzz_}
  if [ -n "$ONLY" ]; then case ",$ONLY," in *",$name,"*) ;; *) continue ;; esac; fi
  mkdir -p "$B/corpus/$name"
  opts=()
  [ -f "tests/fuzz/$name.options" ] && read -r -a opts < "tests/fuzz/$name.options"
  [ -n "$RUNS" ] && opts+=("-runs=$RUNS")
  start=$SECONDS
  log="$B/fuzz_$name.log"
  "$bin" -max_total_time="$N" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
    -artifact_prefix="$B/crashes/$name-" "${opts[@]}" "$B/corpus/$name" "tests/fuzz/corpus/$name" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -1)
  [ -n "$execs" ] || execs=$(sed -n 's/^#\([0-9]*\).*/\1/p' "$log" | tail -1)
  execs=${execs:-0}
  total=$((total + execs))
  if [ "$rc" = 0 ]; then
    printf 'fuzz %-12s %12d executions in %ss\n' "$name" "$execs" "$((SECONDS - start))"
  else
    failed+=("$name")
    printf 'fuzz %-12s %12d executions, CRASH (exit %d): see %s\n' "$name" "$execs" "$rc" "$log"
    grep -E '^(==[0-9]+==ERROR|SUMMARY|artifact_prefix|Test unit written|invariant broken|.*runtime error)' "$log" | head -8 | sed 's/^/    /'
  fi
done
printf 'fuzz total        %12d executions\n' "$total"
if [ ${#failed[@]} -gt 0 ]; then
  echo "crashed: ${failed[*]}"
  exit 1
fi
