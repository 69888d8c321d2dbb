#!/usr/bin/env bash
# tests/comfy_examples.sh - ComfyUI's own API examples (script_examples/basic_api_example.py
# and websockets_api_example.py from a ComfyUI source tree) against `kiln serve` with the
# bundled demo model, unmodified but for the server address. Their graph names
# v1-5-pruned-emaonly.safetensors: here that name is a link to the demo model. Not part of
# `make test` (it needs Python and a ComfyUI checkout): `make comfy-examples COMFYUI=DIR`.
# Needs Debian's python3-websocket (apt-get install python3-websocket).
set -u
KILN=${1:-build/kiln}
COMFYUI=${COMFYUI:-}
PY=${PYTHON:-/usr/bin/python3}
if [ -z "$COMFYUI" ] || [ ! -f "$COMFYUI/script_examples/basic_api_example.py" ]; then
  echo "comfy-examples: COMFYUI=DIR must name a ComfyUI source tree (with script_examples/)"; exit 2
fi
if ! "$PY" -c 'import websocket' 2>/dev/null; then
  echo "comfy-examples: $PY has no websocket module: apt-get install python3-websocket"; exit 2
fi
tmp=$(mktemp -d)
trap 'kill -TERM $pid 2>/dev/null; rm -rf "$tmp"' EXIT
mkdir -p "$tmp/models/checkpoints" "$tmp/out"
ln -s "$(cd "$(dirname examples/models/kiln-shapes.safetensors)" && pwd)/kiln-shapes.safetensors" \
  "$tmp/models/checkpoints/v1-5-pruned-emaonly.safetensors"
"$KILN" serve --models "$tmp/models" --output "$tmp/out" --port 0 --quiet >"$tmp/log" 2>&1 &
pid=$!
port=
for _ in $(seq 100); do
  port=$(sed -n 's/^kiln serve: listening on http:\/\/127\.0\.0\.1:\([0-9]*\)$/\1/p' "$tmp/log")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "comfy-examples: the server did not start:"; cat "$tmp/log"; exit 1; }
# the one change: the server's address
for f in basic_api_example websockets_api_example; do
  sed "s/127\.0\.0\.1:8188/127.0.0.1:$port/" "$COMFYUI/script_examples/$f.py" >"$tmp/$f.py"
  diff "$COMFYUI/script_examples/$f.py" "$tmp/$f.py" | grep -c '^>' | sed "s/^/$f.py: lines changed (the address): /"
done
fail=0
# basic_api_example.py queues the prompt and returns; the picture is the server's to write
(cd "$tmp" && "$PY" basic_api_example.py) || fail=1
for _ in $(seq 600); do
  [ -n "$(ls "$tmp/out" 2>/dev/null)" ] && break
  sleep 0.1
done
n=$(ls "$tmp/out"/*.png 2>/dev/null | wc -l)
if [ "$n" -ge 1 ] && head -c 8 "$tmp/out"/ComfyUI_00001_.png | od -An -c | grep -q 'P   N   G'; then
  echo "PASS basic_api_example.py: kiln serve wrote $(ls "$tmp/out")"
else
  echo "FAIL basic_api_example.py: no picture in the output folder"; fail=1
fi
# websockets_api_example.py waits for 'executing' with node null, reads /history and
# fetches the pictures with /view; its `images` (node id -> list of file bytes) is read
# back from the script's globals, the script itself run as it is
(cd "$tmp" && "$PY" - <<'EOF') || fail=1
import runpy
g = runpy.run_path("websockets_api_example.py")
imgs = [b for lst in g["images"].values() for b in lst]
ok = len(imgs) > 0 and all(b[:8] == b"\x89PNG\r\n\x1a\n" for b in imgs)
print(("PASS" if ok else "FAIL") + " websockets_api_example.py: %d picture(s) through /ws, /history and /view, %s bytes"
      % (len(imgs), ", ".join(str(len(b)) for b in imgs)))
raise SystemExit(0 if ok else 1)
EOF
kill -TERM $pid
wait $pid
rc=$?
[ $rc = 0 ] || { echo "FAIL kiln serve exited with $rc"; fail=1; }
echo "$((fail == 0 ? 2 : 0)) passed, $fail failed"
exit $fail
