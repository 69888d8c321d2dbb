#!/usr/bin/env bash
# Every example in examples/ runs against the bundled demo model with short step
# counts, so the examples never rot. Prints PASS/FAIL/SKIP lines; $1 = kiln binary.
set -u
KILN=${1:-build/kiln}
BUILD=$(dirname "$KILN")
MODEL=examples/models/kiln-shapes.safetensors
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

check() { # name, expected output file, command...
  local name=$1 out=$2; shift 2
  if "$@" >"$tmp/log" 2>&1 && [ -s "$out" ]; then echo "PASS $name"
  else echo "FAIL $name: $*"; tail -15 "$tmp/log" | sed 's/^/    /'; fi
}

check demo "$tmp/demo.png" "$KILN" examples/demo.lua --out "$tmp/demo.png" --size 64
check "canny edges of the demo picture" "$tmp/edges.png" "$KILN" examples/canny.lua --input "$tmp/demo.png" \
  --low 0.1 --high 0.3 --out "$tmp/edges.png"
"$KILN" examples/canny.lua --input "$tmp/demo.png" --low 0.9 --high 0.2 >"$tmp/log" 2>&1
if [ $? -eq 2 ] && grep -q "^kiln: --low 0.9 is above --high 0.2" "$tmp/log"; then echo "PASS canny --low above --high is a usage error"
else echo "FAIL canny --low above --high is a usage error"; sed 's/^/    /' "$tmp/log"; fi
if [ ! -f "$MODEL" ]; then
  echo "SKIP examples on the demo model: $MODEL is missing"
  exit 0
fi
Q="--quiet --steps 3"
check txt2img "$tmp/t.png" "$KILN" examples/txt2img.lua $Q --prompt "a red circle on a blue background" --out "$tmp/t.png"
check "txt2img on sim, low mode, small budget, tiled VAE" "$tmp/s.png" "$KILN" examples/txt2img.lua $Q \
  --prompt "a green star" --device sim --mode low --vram 64M --tile 8 --out "$tmp/s.png"
check "txt2img --mode auto on sim with a 6M budget" "$tmp/a.png" "$KILN" examples/txt2img.lua $Q \
  --prompt "a red star" --device sim --mode auto --vram 6M --out "$tmp/a.png"
if "$KILN" examples/txt2img.lua --help >"$tmp/help" 2>&1 && grep -q "^usage: kiln examples/txt2img.lua" "$tmp/help" \
  && grep -q -- "--mode" "$tmp/help"; then echo "PASS txt2img --help"
else echo "FAIL txt2img --help"; sed 's/^/    /' "$tmp/help"; fi
check "txt2img dpmpp_2m karras" "$tmp/k.png" "$KILN" examples/txt2img.lua $Q --sampler dpmpp_2m --scheduler karras \
  --prompt "a white ring on a black background" --out "$tmp/k.png"
check img2img "$tmp/i.png" "$KILN" examples/img2img.lua $Q --input "$tmp/t.png" --prompt "a green circle" --out "$tmp/i.png"
check "hires fix (latent)" "$tmp/h.png" "$KILN" examples/hires_fix.lua $Q --prompt "a yellow square" --out "$tmp/h.png"
check "hires fix (image)" "$tmp/h2.png" "$KILN" examples/hires_fix.lua $Q --upscale image --prompt "a blue triangle" \
  --out "$tmp/h2.png"
# inpainting: a mask half the picture's size (resized, with a note); outpainting grows it
"$KILN" -e "local k = require 'kiln'; local m = k.zeros({ 1, 1, 32, 32 }); m:narrow(3, 9, 16):narrow(4, 9, 16):fill(1); k.save_png(m, '$tmp/m.png')"
check inpaint "$tmp/ip.png" "$KILN" examples/inpaint.lua $Q --input "$tmp/t.png" --mask "$tmp/m.png" --prompt "a green star" \
  --out "$tmp/ip.png"
check outpaint "$tmp/op.png" "$KILN" examples/outpaint.lua $Q --input "$tmp/t.png" --right 32 --top 8 --feather 8 \
  --prompt "a green star" --out "$tmp/op.png"
"$KILN" examples/inpaint.lua --input "$tmp/t.png" --mask examples/inpaint.lua >"$tmp/log" 2>&1
if [ $? -eq 2 ] && grep -q "^kiln: --mask examples/inpaint.lua: not a PNG image" "$tmp/log"; then echo "PASS inpaint --mask not a PNG is a usage error"
else echo "FAIL inpaint --mask not a PNG is a usage error"; sed 's/^/    /' "$tmp/log"; fi
"$KILN" examples/outpaint.lua --input "$tmp/t.png" >"$tmp/log" 2>&1
if [ $? -eq 2 ] && grep -q "^kiln: outpaint needs at least one of" "$tmp/log"; then echo "PASS outpaint without a side is a usage error"
else echo "FAIL outpaint without a side is a usage error"; sed 's/^/    /' "$tmp/log"; fi
if [ -x "$BUILD/examples/art_tool" ]; then
  check "embedding host (art_tool)" "$tmp/a.png" "$BUILD/examples/art_tool" --out "$tmp/a.png"
else
  echo "SKIP embedding host: $BUILD/examples/art_tool not built"
fi
# the saved PNG carries the A1111 parameters
if "$KILN" -e "local t = io.open('$tmp/t.png','rb'):read('a'); assert(t:find('Steps: 3, Sampler: Euler', 1, true))" 2>/dev/null; then
  echo "PASS txt2img PNG carries A1111 parameters"
else
  echo "FAIL txt2img PNG carries A1111 parameters"
fi
