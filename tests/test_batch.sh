#!/usr/bin/env bash
# test_batch.sh - `kiln batch` against a real redis-server (appendonly) on 127.0.0.1
# at a free port in a temporary folder: bad JSONL named, three workers with one
# killed by kill -9 mid-job, Redis restarted mid-run, retries and the dead letter,
# status numbers, deterministic bytes, no temporary file left in the output folder.
#   tests/test_batch.sh [path/to/kiln]      (default build/kiln)
# Uses the bundled demo model at 64x64 with 2 steps so the whole file stays short.

KILN=${1:-build/kiln}
case $KILN in /*) ;; *) KILN=$PWD/$KILN ;; esac

n_pass=0 n_fail=0 n_skip=0
pass() { echo "PASS $1"; n_pass=$((n_pass + 1)); }
fail() { echo "FAIL $1: $2"; n_fail=$((n_fail + 1)); }
skip() { echo "SKIP $1: $2"; n_skip=$((n_skip + 1)); }
summary() {
  echo "# $n_pass passed, $n_fail failed, $n_skip skipped"
  [ "$n_fail" -eq 0 ]
  exit
}

if [ ! -x "$KILN" ]; then fail batch_binary "$KILN not found"; summary; fi
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  skip batch "redis-server not installed (apt-get install redis-server; make deps does)"
  summary
fi
if ! "$KILN" -e 'os.exit(kiln.queue.available() and 0 or 1)' >/dev/null 2>&1; then
  skip batch "kiln was built without hiredis (apt-get install libhiredis-dev and rebuild)"
  summary
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/kiln_batch.XXXXXX") || exit 1
REDIS_PID=
WORKERS=()
cleanup() {
  for p in "${WORKERS[@]}"; do kill -9 "$p" 2>/dev/null; done
  [ -n "$REDIS_PID" ] && kill "$REDIS_PID" 2>/dev/null && wait "$REDIS_PID" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT

# a free port: nothing answers on it
PORT=
for _ in $(seq 50); do
  p=$((20000 + RANDOM % 40000))
  if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then PORT=$p; break; fi
done
[ -n "$PORT" ] || { fail batch_port "no free port found"; summary; }
R="127.0.0.1:$PORT"
rcli() { redis-cli -p "$PORT" "$@"; }

start_redis() {
  redis-server --port "$PORT" --bind 127.0.0.1 --dir "$TMP" --appendonly yes --appendfsync always \
    --save "" --daemonize no --logfile "$TMP/redis.log" &
  REDIS_PID=$!
  for _ in $(seq 100); do rcli ping 2>/dev/null | grep -q PONG && return 0; sleep 0.05; done
  return 1
}
stop_redis() { rcli shutdown >/dev/null 2>&1; wait "$REDIS_PID" 2>/dev/null; REDIS_PID=; }

start_redis || { fail batch_redis "redis-server did not start: $(tail -3 "$TMP/redis.log")"; summary; }

# N jobs "PREFIX1".."PREFIXN" of the demo model, tiny and fast
jobs() { # prefix n [extra json]
  for i in $(seq "$2"); do
    echo "{\"id\":\"$1$i\",\"prompt\":\"a red circle $i\",\"steps\":2,\"width\":64,\"height\":64$3}"
  done
}
status_of() { "$KILN" batch status --redis "$R" --queue "$1" 2>&1; }
field() { echo "$1" | sed -n "s/^$2: //p"; }
no_temps() { ! ls -A "$1" | grep -v '\.png$' | grep -q .; }

# ---- bad JSONL: every bad line named with its number, nothing queued
printf '%s\n' '{"id":"ok1","prompt":"x"}' '{"id":"b 2"}' 'not json' '{"id":"b4","steps":"2"}' \
  '{"prompt":"no id"}' '{"id":"ok1"}' '{"id":"b7","width":65}' > "$TMP/bad.jsonl"
out=$("$KILN" batch enqueue "$TMP/bad.jsonl" --redis "$R" --queue bad 2>&1); rc=$?
st=$(status_of bad)
if [ "$rc" = 2 ] && echo "$out" | grep -q "bad.jsonl:2: id" && echo "$out" | grep -q "bad.jsonl:3: not JSON" \
  && echo "$out" | grep -q 'bad.jsonl:4: steps: a whole number expected, got "2"' \
  && echo "$out" | grep -q 'bad.jsonl:5: no "id"' && echo "$out" | grep -q 'bad.jsonl:6: id "ok1" repeats line 1' \
  && echo "$out" | grep -q 'bad.jsonl:7: width 65' && ! echo "$out" | grep -q 'bad.jsonl:1:' \
  && [ "$(field "$st" pending)" = 0 ] && [ "$(field "$st" total)" = 0 ]; then
  pass batch_bad_jsonl
else
  fail batch_bad_jsonl "rc $rc, output: $out / $st"
fi

# ---- three workers, one killed with kill -9 in the middle of a job
N=12
jobs k $N > "$TMP/k.jsonl"
"$KILN" batch enqueue "$TMP/k.jsonl" --redis "$R" --queue k >/dev/null 2>&1
mkdir -p "$TMP/out_k"
for w in w1 w2 w3; do
  "$KILN" batch worker --redis "$R" --queue k --output "$TMP/out_k" --drain --claim-idle 2 --name "$w" \
    2>"$TMP/$w.log" &
  WORKERS+=($!)
done
victim=${WORKERS[0]}
killed=
{ # (the shell's "Killed" notice goes to /dev/null)
  for _ in $(seq 400); do
    v=$(rcli hget k:workers w1)
    case $v in *" k"*) kill -9 "$victim"; killed=${v##* }; break ;; esac
    sleep 0.02
  done
  wait "${WORKERS[1]}"; rc2=$?
  wait "${WORKERS[2]}"; rc3=$?
  wait "$victim"
} 2>/dev/null
WORKERS=()
st=$(status_of k)
pngs=$(ls "$TMP/out_k" | grep -c '\.png$')
counted=$(( $(rcli hget k:worker_done w1) + $(rcli hget k:worker_done w2) + $(rcli hget k:worker_done w3) ))
if [ -z "$killed" ]; then
  fail batch_kill_worker "w1 never took a job"
elif [ "$rc2" = 0 ] && [ "$rc3" = 0 ] && [ "$pngs" = $N ] && [ "$(field "$st" done)" = $N ] \
  && [ "$(field "$st" pending)" = 0 ] && [ "$(field "$st" failed)" = 0 ] && [ "$counted" = $N ] \
  && grep -q "reclaimed $killed" "$TMP/w2.log" "$TMP/w3.log"; then
  pass batch_kill_worker
else
  fail batch_kill_worker "killed on $killed; rc $rc2 $rc3, $pngs pictures, generated $counted; $st; $(cat "$TMP/w2.log" "$TMP/w3.log" | tail -5)"
fi
if no_temps "$TMP/out_k"; then pass batch_no_temporary_files
else fail batch_no_temporary_files "$(ls -A "$TMP/out_k" | grep -v '\.png$')"; fi
if echo "$st" | grep -q "^in flight: 0" && echo "$st" | grep -q "^throughput: [0-9]" && echo "$st" | grep -q "worker w2: 0 in flight"; then
  pass batch_status_numbers
else
  fail batch_status_numbers "$st"
fi

# ---- the same job run twice writes the same bytes; the parameters are inside
jobs k 1 > "$TMP/d.jsonl"
"$KILN" batch enqueue "$TMP/d.jsonl" --redis "$R" --queue d >/dev/null 2>&1
"$KILN" batch worker --redis "$R" --queue d --output "$TMP/out_d" --drain --quiet >/dev/null 2>&1
if cmp -s "$TMP/out_d/k1.png" "$TMP/out_k/k1.png" && grep -aq "Steps: 2" "$TMP/out_d/k1.png"; then
  pass batch_deterministic
else
  fail batch_deterministic "k1.png differs between two runs (or has no parameters): $("$KILN" -e "
    local a, b = kiln.load_png('$TMP/out_d/k1.png'), kiln.load_png('$TMP/out_k/k1.png')
    io.write('max pixel difference ', (a - b):abs():max())" 2>&1); $(grep -a "Steps:" "$TMP/out_d/k1.png" "$TMP/out_k/k1.png" | tr '\0' ' ')"
fi

# ---- Redis restarted mid-run: the workers reconnect and nothing is lost
N=8
jobs r $N > "$TMP/r.jsonl"
"$KILN" batch enqueue "$TMP/r.jsonl" --redis "$R" --queue r >/dev/null 2>&1
for w in r1 r2; do
  "$KILN" batch worker --redis "$R" --queue r --output "$TMP/out_r" --drain --claim-idle 2 --name "$w" \
    2>"$TMP/$w.log" &
  WORKERS+=($!)
done
for _ in $(seq 400); do [ "$(rcli hlen r:done 2>/dev/null)" -ge 1 ] 2>/dev/null && break; sleep 0.02; done
before=$(rcli hlen r:done)
stop_redis
sleep 1
start_redis || fail batch_redis_restart "redis-server did not come back"
wait "${WORKERS[0]}"; rc1=$?
wait "${WORKERS[1]}"; rc2=$?
WORKERS=()
st=$(status_of r)
pngs=$(ls "$TMP/out_r" | grep -c '\.png$')
if [ "$before" -lt $N ] && [ "$rc1" = 0 ] && [ "$rc2" = 0 ] && [ "$pngs" = $N ] && [ "$(field "$st" done)" = $N ] \
  && [ "$(field "$st" pending)" = 0 ] && no_temps "$TMP/out_r"; then
  pass batch_redis_restart
else
  fail batch_redis_restart "$before done before the restart; rc $rc1 $rc2, $pngs pictures; $st; $(tail -3 "$TMP/r1.log" "$TMP/r2.log")"
fi

# ---- a job that fails: retried, then dead-lettered with its error; status counts it
{ jobs f 2; echo '{"id":"bad1","prompt":"x","steps":2,"model":"/nonexistent/model.safetensors"}'; } > "$TMP/f.jsonl"
"$KILN" batch enqueue "$TMP/f.jsonl" --redis "$R" --queue f >/dev/null 2>&1
"$KILN" batch worker --redis "$R" --queue f --output "$TMP/out_f" --drain --retries 2 2>"$TMP/f.log"; rc=$?
st=$(status_of f)
dead=$(rcli xrange f:dead - + 2>/dev/null)
if [ "$rc" = 0 ] && [ "$(field "$st" done)" = 2 ] && [ "$(field "$st" failed)" = 1 ] && [ "$(field "$st" pending)" = 0 ] \
  && [ "$(grep -c 'failed bad1 (attempt' "$TMP/f.log")" = 2 ] && echo "$dead" | grep -q nonexistent \
  && [ ! -e "$TMP/out_f/bad1.png" ]; then
  pass batch_retry_dead_letter
else
  fail batch_retry_dead_letter "rc $rc; $st; $(tail -4 "$TMP/f.log")"
fi

# ---- img2img and hires fix jobs
printf '%s\n' '{"id":"h1","mode":"hires","prompt":"a red circle","steps":2,"width":64,"height":64,"scale":1.5,"hires_steps":2}' \
  "{\"id\":\"i1\",\"mode\":\"img2img\",\"input\":\"$TMP/out_k/k1.png\",\"prompt\":\"a blue square\",\"steps\":2,\"denoise\":0.5}" \
  > "$TMP/m.jsonl"
"$KILN" batch enqueue "$TMP/m.jsonl" --redis "$R" --queue m >/dev/null 2>&1
"$KILN" batch worker --redis "$R" --queue m --output "$TMP/out_m" --drain --quiet >/dev/null 2>&1
shapes=$("$KILN" -e "for _, f in ipairs{'h1', 'i1'} do
  local ok, t = pcall(kiln.load_png, '$TMP/out_m/' .. f .. '.png')
  io.write(ok and table.concat(t.shape, 'x') or 'missing', ' ') end" 2>&1)
if [ "$shapes" = "1x3x96x96 1x3x64x64 " ]; then pass batch_img2img_hires
else fail batch_img2img_hires "pictures: $shapes; $(status_of m | head -3 | tr '\n' ' ')"; fi

# ---- jobs for two models, interleaved: a worker runs them grouped by model
ln -s "$PWD/examples/models/kiln-shapes.safetensors" "$TMP/other.safetensors"
for i in 1 2 3 4; do
  echo "{\"id\":\"ga$i\",\"prompt\":\"a red circle\",\"steps\":2,\"width\":64,\"height\":64}"
  echo "{\"id\":\"gb$i\",\"prompt\":\"a red circle\",\"steps\":2,\"width\":64,\"height\":64,\"model\":\"$TMP/other.safetensors\"}"
done > "$TMP/g.jsonl"
"$KILN" batch enqueue "$TMP/g.jsonl" --redis "$R" --queue g >/dev/null 2>&1
"$KILN" batch worker --redis "$R" --queue g --output "$TMP/out_g" --drain 2>"$TMP/g.log"
order=$(sed -n 's/.*done g\([ab]\).*/\1/p' "$TMP/g.log" | tr -d '\n')
switches=$(echo "$order" | fold -w1 | uniq | wc -l)
if [ ${#order} = 8 ] && [ "$switches" = 2 ]; then pass batch_groups_by_model; echo "# model order: $order"
else fail batch_groups_by_model "models in the order run: $order"; fi

# ---- enqueue twice: the ids already queued are skipped
out=$("$KILN" batch enqueue "$TMP/f.jsonl" --redis "$R" --queue f 2>&1)
if echo "$out" | grep -q "queued: 0 (3 already queued, skipped)"; then pass batch_enqueue_idempotent
else fail batch_enqueue_idempotent "$out"; fi

summary
