#!/usr/bin/env bash
# tests/bench/bench_batch.sh - `kiln batch` costs with the bundled demo model: the
# overhead per job of the farm (queue round trip + PNG write, a worker's time per job
# against the bare pipeline in one process) and the time to reclaim the job of a
# worker killed with kill -9. Needs redis-server (started on a free port here).
#   tests/bench/bench_batch.sh [path/to/kiln] [jobs]
set -u
KILN=${1:-build/kiln}
N=${2:-24}
case $KILN in /*) ;; *) KILN=$PWD/$KILN ;; esac
if ! command -v redis-server >/dev/null || ! "$KILN" -e 'os.exit(kiln.queue.available() and 0 or 1)' 2>/dev/null; then
  echo "skipped: needs redis-server and a kiln built with hiredis (make deps)"; exit 0
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kiln_bench_batch.XXXXXX") || exit 1
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; { wait "$p"; } 2>/dev/null; done; redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1; rm -rf "$TMP"' EXIT
for _ in $(seq 50); do
  PORT=$((20000 + RANDOM % 40000))
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null || break
done
redis-server --port "$PORT" --bind 127.0.0.1 --dir "$TMP" --appendonly yes --save "" --daemonize yes \
  --logfile "$TMP/redis.log" >/dev/null
for _ in $(seq 100); do redis-cli -p "$PORT" ping 2>/dev/null | grep -q PONG && break; sleep 0.05; done
R=127.0.0.1:$PORT
rtime() { redis-cli -p "$PORT" time | paste -sd. | awk -F. '{printf "%.6f", $1 + $2 / 1e6}'; }

for i in $(seq "$N"); do
  echo "{\"id\":\"j$i\",\"prompt\":\"a red circle $i\",\"steps\":2,\"width\":64,\"height\":64}"
done > "$TMP/jobs.jsonl"

# the bare pipeline and a PNG write in one process, and the queue round trip alone
cat > "$TMP/bare.lua" <<'LUA'
local N, port, dir = tonumber(arg[1]), tonumber(arg[2]), arg[3]
local pipeline = require "kiln.pipeline"
kiln.configure{ quiet = true }
local ckpt <close> = kiln.load_checkpoint("examples/models/kiln-shapes.safetensors")
local o = { prompt = "a red circle", steps = 2, width = 64, height = 64, seed = 0 }
local img = pipeline.txt2img(ckpt, o); img:free() -- warm-up
local gen, save = 0, 0
for i = 1, N do
  o.seed, o.prompt = i, "a red circle " .. i
  local t0 = kiln.time()
  local im, lat = pipeline.txt2img(ckpt, o)
  local t1 = kiln.time()
  pipeline.save(im, dir .. "/bare" .. i .. ".png", o, ckpt)
  save = save + kiln.time() - t1
  gen = gen + t1 - t0
  im:free(); lat:free()
end
local q <close> = kiln.queue.connect("127.0.0.1", port)
q:command("XGROUP", "CREATE", "b", "g", "0", "MKSTREAM")
local M = 2000
local t0 = kiln.time()
for i = 1, M do
  q:xadd("b", { "id", "x" .. i, "job", "{}", "attempt", 1 })
  local e = q:xreadgroup("g", "c", { "b" }, { count = 1 })
  q:command("HSET", "b:done", "x" .. i, "1")
  q:xack("b", "g", e[1].id)
end
local rt = (kiln.time() - t0) / M
print(("bare pipeline:         %8.2f ms/job (txt2img 64x64, 2 steps, in one process)"):format(gen / N * 1e3))
print(("PNG write (atomic):    %8.2f ms/job"):format(save / N * 1e3))
print(("queue round trip:      %8.3f ms/job (XADD + XREADGROUP + HSET + XACK, %.0f jobs/s on one connection)"):format(rt * 1e3, 1 / rt))
io.open(dir .. "/bare", "w"):write(gen / N + save / N)
LUA
"$KILN" "$TMP/bare.lua" "$N" "$PORT" "$TMP" || exit 1

# one worker draining N jobs: its time per job from the completions' clock
"$KILN" batch enqueue "$TMP/jobs.jsonl" --redis "$R" --queue o >/dev/null
t0=$(rtime)
"$KILN" batch worker --redis "$R" --queue o --output "$TMP/out" --drain --quiet 2>/dev/null
t1=$(rtime)
first=$(redis-cli -p "$PORT" hvals o:done | awk '{print $1}' | sort -n | head -1)
last=$(redis-cli -p "$PORT" hvals o:done | awk '{print $1}' | sort -n | tail -1)
# the seconds each job spent generating and writing (the done record's third field),
# the first job's left out as the interval is
busy=$(redis-cli -p "$PORT" hvals o:done | sort -n | tail -n +2 | awk '{s += $3} END {printf "%.6f", s}')
awk -v f="$first" -v l="$last" -v n="$N" -v b="$(cat "$TMP/bare")" -v s="$t0" -v e="$t1" -v busy="$busy" 'BEGIN {
  per = (l - f) / (n - 1)
  printf "batch worker:          %8.2f ms/job (steady state over %d jobs; %.2f s with start-up)\n", per * 1e3, n, e - s
  printf "  generate + PNG:      %8.2f ms/job of it (bare pipeline + PNG write above: %.2f ms)\n", busy / (n - 1) * 1e3, b * 1e3
  printf "overhead per job:      %8.2f ms (the worker between two jobs: queue round trips, bookkeeping)\n", (per - busy / (n - 1)) * 1e3 }'

# reclaim: two idle workers, the one that takes the job is killed; the other reclaims it
echo '{"id":"slow","prompt":"a blue square","steps":20,"width":64,"height":64}' > "$TMP/slow.jsonl"
for w in a b; do
  "$KILN" batch worker --redis "$R" --queue rc --output "$TMP/rc" --claim-idle 3 --name "$w" --quiet 2>/dev/null &
  PIDS+=($!)
done
for _ in $(seq 200); do [ "$(redis-cli -p "$PORT" hlen rc:workers)" = 2 ] && break; sleep 0.05; done
"$KILN" batch enqueue "$TMP/slow.jsonl" --redis "$R" --queue rc >/dev/null
victim=
for _ in $(seq 1000); do # the pending entry's owner: a or b
  case $(redis-cli -p "$PORT" xpending rc:jobs: workers - + 1 | sed -n 2p) in
    a) victim=0; break ;;
    b) victim=1; break ;;
  esac
  sleep 0.01
done
[ -n "$victim" ] || { echo "reclaim: no worker took the job: $(redis-cli -p "$PORT" hgetall rc:workers | paste -sd" ") $(redis-cli -p "$PORT" hgetall rc:done | paste -sd" ")"; exit 1; }
idle=$(redis-cli -p "$PORT" xpending rc:jobs: workers - + 1 | sed -n 3p)
tk=$(rtime)
{ kill -9 "${PIDS[$victim]}"; wait "${PIDS[$victim]}"; } 2>/dev/null
for _ in $(seq 1000); do [ "$(redis-cli -p "$PORT" hexists rc:done slow)" = 1 ] && break; sleep 0.02; done
done_rec=$(redis-cli -p "$PORT" hget rc:done slow)
rec=$(redis-cli -p "$PORT" hget rc:reclaims slow)
awk -v k="$tk" -v d="$done_rec" -v r="$rec" -v i="$idle" 'BEGIN { split(d, f, " "); split(r, g, " ");
  printf "reclaim (kill -9):     %8.2f s from the kill to the job reclaimed by the other worker\n", g[1] - k
  printf "                       (--claim-idle 3, the job %.2f s old at the kill; %.2f s from the kill to its picture)\n", i / 1e3, f[1] - k }'
