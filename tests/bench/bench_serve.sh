#!/usr/bin/env bash
# tests/bench/bench_serve.sh - kiln serve under load, with the demo model:
#   rss N        N sequential A1111 txt2img requests (1 step, 64x64); the server's RSS
#                (VmRSS of /proc/PID/status) every N/10 requests, and the drift from
#                request N/10 to N in percent
#   latency C R  C clients x R requests each at once, every request a 1-step txt2img;
#                all answered?, then p50 / p99 of the time in the server over the bare
#                pipeline (the median of the same request sent alone)
# Usage: bash tests/bench/bench_serve.sh [build/kiln] rss 1000 | latency 16 50
set -u
KILN=${1:-build/kiln}
MODE=${2:-rss}
CLIENT=$(dirname "$KILN")/tests/serve_client
[ -x "$CLIENT" ] || { echo "bench_serve: $CLIENT is not built (make build/tests/serve_client)"; exit 2; }
tmp=$(mktemp -d)
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$tmp"' EXIT
mkdir -p "$tmp/models/checkpoints"
ln -s "$(pwd)/examples/models/kiln-shapes.safetensors" "$tmp/models/checkpoints/demo.safetensors"
"$KILN" serve --models "$tmp/models" --output "$tmp/out" --port 0 --quiet --max-queue 100000 >"$tmp/log" 2>&1 &
pid=$!
for _ in $(seq 100); do
  port=$(sed -n 's/^kiln serve: listening on http:\/\/127\.0\.0\.1:\([0-9]*\)$/\1/p' "$tmp/log")
  [ -n "$port" ] && break
  sleep 0.1
done
URL="http://127.0.0.1:$port/sdapi/v1/txt2img"
BODY='{"prompt": "a red circle on a blue background", "steps": 1, "seed": 1, "width": 64, "height": 64}'
rss() { awk '/^VmRSS/{print $2}' /proc/$pid/status; }
one() { "$CLIENT" http POST "$URL" -d "$BODY" -o /dev/null | head -1; }
now() { date +%s.%N; }

if [ "$MODE" = rss ]; then
  N=${3:-1000}
  step=$((N / 10))
  first=
  for i in $(seq 1 "$N"); do
    st=$(one)
    [ "$st" = "STATUS 200" ] || { echo "request $i: $st"; exit 1; }
    if [ $((i % step)) = 0 ]; then
      r=$(rss)
      [ -z "$first" ] && first=$r
      echo "request $i: RSS $r KiB"
    fi
  done
  awk -v a="$first" -v b="$(rss)" -v s="$step" -v n="$N" \
    'BEGIN{printf "RSS from request %d to %d: %d -> %d KiB, %+.2f %%\n", s, n, a, b, (b - a) * 100 / a}'
else
  C=${3:-16}
  R=${4:-50}
  for _ in 1 2 3; do one >/dev/null; done    # warm: the checkpoint opened
  # the bare pipeline: the same request alone, end to end, 21 times (median)
  for _ in $(seq 21); do
    t0=$(now); one >/dev/null; t1=$(now)
    echo "$t0 $t1" | awk '{printf "%.6f\n", $2 - $1}'
  done | sort -n | sed -n 11p >"$tmp/alone"
  alone=$(cat "$tmp/alone")
  # C clients at once: each request's time minus the time the requests queued ahead of
  # it took is not observable from outside; what is: the wall time of each request,
  # and the server's overhead = wall / (requests served meanwhile) - alone
  start=$(now)
  for c in $(seq "$C"); do
    (for r in $(seq "$R"); do
      t0=$(now); st=$(one); t1=$(now)
      echo "$st $t0 $t1"
    done >"$tmp/c$c") &
  done
  wait $(jobs -p | grep -v "^$pid$") 2>/dev/null
  end=$(now)
  total=$((C * R))
  ok=$(cat "$tmp"/c* | grep -c "^STATUS 200")
  echo "$ok of $total answered 200"
  # one generation at a time: the throughput cost per request over the bare one
  awk -v s="$start" -v e="$end" -v n="$total" -v a="$alone" \
    'BEGIN{per=(e - s) / n; printf "bare request alone (median of 21): %.2f ms; under %s concurrent: %.2f ms per request, overhead %.2f ms\n", a * 1000, "load", per * 1000, (per - a) * 1000}'
  # each request's wait beyond its own service: latency - alone x (queue position); the
  # p50 / p99 of latency / (concurrency) - alone, a per-request overhead estimate
  cat "$tmp"/c* | awk -v a="$alone" -v c="$C" '{print ($3 - $2) / c - a}' | sort -n >"$tmp/over"
  n=$(wc -l <"$tmp/over")
  p50=$(sed -n "$(( (n + 1) / 2 ))p" "$tmp/over")
  p99=$(sed -n "$(( (n * 99 + 99) / 100 ))p" "$tmp/over")
  awk -v p="$p50" -v q="$p99" 'BEGIN{printf "per-request overhead over the bare pipeline: p50 %.2f ms, p99 %.2f ms\n", p * 1000, q * 1000}'
fi
