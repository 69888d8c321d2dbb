#!/usr/bin/env bash
# tests/bench/bench_serve.sh - kiln serve under load, with the demo model:
#   rss N        N sequential A1111 txt2img requests (1 step, 64x64); the server's RSS
#                (VmRSS of /proc/PID/status) every N/10 requests, and the drift from
#                request N/10 to N in percent
#   latency C R  C clients x R requests each at once (threads of serve_client load),
#                every request a 1-step 64x64 txt2img: all answered?, then p50 / p99 of
#                each request's latency over its bare pipeline (the client's latency less
#                the answer's Server-Timing queue and run), also for one client alone
#   resident CKPT [SIZE]
#                CKPT (an SD 1.5-shaped checkpoint, e.g. the random one of bench_sd.lua) under
#                two names, on sim with a 2 GiB budget: A1111 txt2img (1 step, SIZE px,
#                default 128) on a, a, b, b, a; after each, the bytes copied onto sim during
#                the request and each checkpoint's bytes resident
# Usage: bash tests/bench/bench_serve.sh [build/kiln] rss 1000 | latency 16 50 | resident CKPT
set -u
KILN=${1:-build/kiln}
MODE=${2:-rss}
CLIENT=$(dirname "$KILN")/tests/serve_client
[ -x "$CLIENT" ] || { echo "bench_serve: $CLIENT is not built (make build/tests/serve_client)"; exit 2; }
tmp=$(mktemp -d)
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$tmp"' EXIT
mkdir -p "$tmp/models/checkpoints"
FLAGS=
if [ "$MODE" = resident ]; then
  CKPT=$(realpath "$3")
  ln -s "$CKPT" "$tmp/models/checkpoints/a.safetensors"
  ln -s "$CKPT" "$tmp/models/checkpoints/b.safetensors"
  FLAGS="--device sim --vram 2G"
else
  ln -s "$(pwd)/examples/models/kiln-shapes.safetensors" "$tmp/models/checkpoints/demo.safetensors"
fi
"$KILN" serve --models "$tmp/models" --output "$tmp/out" --port 0 --quiet --max-queue 100000 $FLAGS >"$tmp/log" 2>&1 &
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

if [ "$MODE" = resident ]; then
  SIZE=${4:-128}
  B="http://127.0.0.1:$port"
  cat >"$tmp/show.lua" <<'EOF'
local j = kiln.json.decode(io.open(arg[1]):read("a"))
local r, m = j.kiln.checkpoints_resident, 1048576
local function res(n) return ((r[n] or {}).sim or 0) / m end
print(string.format("txt2img on %s (%.1f s): copied onto sim %.1f MiB; resident: a %.1f MiB, b %.1f MiB; " ..
  "sim allocated %.1f MiB of a %.0f MiB budget", arg[2], tonumber(arg[3]), j.kiln.last_run_memory.copied_in.sim / m,
  res("a.safetensors"), res("b.safetensors"), j.kiln.devices.sim.allocated / m, j.kiln.devices.sim.budget / m))
EOF
  for ck in a a b b a; do
    "$CLIENT" http POST "$B/sdapi/v1/options" -d "{\"sd_model_checkpoint\": \"$ck\"}" -o /dev/null >/dev/null
    t0=$(now)
    st=$("$CLIENT" http POST "$URL" -d "{\"prompt\": \"a red circle\", \"steps\": 1, \"seed\": 1, \"width\": $SIZE, \"height\": $SIZE}" -o "$tmp/answer" | head -1)
    t1=$(now)
    [ "$st" = "STATUS 200" ] || { echo "txt2img on $ck: $st $(head -c 300 "$tmp/answer")"; cat "$tmp/log"; exit 1; }
    "$CLIENT" http GET "$B/system_stats" -o "$tmp/stats" >/dev/null
    "$KILN" "$tmp/show.lua" "$tmp/stats" "$ck" "$(echo "$t1 - $t0" | bc)"
  done
elif [ "$MODE" = rss ]; then
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
  # per request, from the answer's Server-Timing (ms): queue = its arrival until its
  # generation started (behind the others), run = its own pipeline call (the bare
  # pipeline), wait = arrival until the server's loop took it; over = the client's
  # latency - queue - run: what the server adds to the bare pipeline once its turn
  # comes (the answer: PNG, base64, JSON, HTTP). Alone (1 client) queue is the server's
  # own hand-over, so there over + queue is counted: everything but the pipeline.
  stats() { # file label
    awk -v label="$2" -v alone="$3" '
      /^REQ/ { n++; if ($4 == 200) ok++
        q = 0; r = 0; w = 0
        for (i = 6; i <= NF; i++) {
          split($i, kv, ";dur="); gsub(/,/, "", kv[2]); v = kv[2] + 0   # numbers, not strings, for the sort
          if (kv[1] == "queue") q = v; else if (kv[1] == "run") r = v; else if (kv[1] == "wait") w = v
        }
        over[n] = $5 - r - (alone ? 0 : q) + 0; waits[n] = w; runs[n] = r; sumrun += r }
      /^WALL/ { wall = $2 }
      function pct(a, p,   k, m, i, j, t) { m = n; for (i = 1; i <= m; i++) s[i] = a[i]
        for (i = 2; i <= m; i++) { t = s[i]; for (j = i - 1; j >= 1 && s[j] > t; j--) s[j + 1] = s[j]; s[j + 1] = t }
        k = int((m * p + 99) / 100); if (k < 1) k = 1; return s[k] }
      END { printf "%s: %d of %d answered 200 in %.2f s; bare pipeline (run) p50 %.2f ms; over the bare pipeline: p50 %.2f ms, p99 %.2f ms, max %.2f ms; wait for the loop p50 %.2f ms, p99 %.2f ms; (wall - sum of runs) / requests %.2f ms\n",
        label, ok, n, wall, pct(runs, 50), pct(over, 50), pct(over, 99), pct(over, 100), pct(waits, 50), pct(waits, 99), (wall * 1000 - sumrun) / n }' "$1"
  }
  "$CLIENT" load POST "$URL" 1 21 -d "$BODY" --timeout 600 >"$tmp/alone"
  stats "$tmp/alone" "1 client x 21" 1
  "$CLIENT" load POST "$URL" "$C" "$R" -d "$BODY" --timeout 600 >"$tmp/load"
  stats "$tmp/load" "$C clients x $R" 0
  [ "$(grep -c '^REQ .* 200 ' "$tmp/load")" = $((C * R)) ] || { echo "not every request was answered 200"; exit 1; }
fi
