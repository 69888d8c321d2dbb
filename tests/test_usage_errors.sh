#!/usr/bin/env bash
# test_usage_errors.sh - a mistake on an example's command line (unknown option, bad
# value, missing file, a size the model cannot take) is one line "kiln: message" on
# stderr and exit status 2, with no traceback and nothing written; a script's own bug
# keeps its traceback. $1 = the kiln binary. Prints PASS/FAIL/SKIP lines.
set -u
cd "$(dirname "$0")/.."
KILN=${1:-build/kiln}
MODEL=examples/models/kiln-shapes.safetensors
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export KILN_PATH=

# usage NAME EXPECTED_SUBSTRING ARGS...: kiln ARGS must exit 2 with exactly one
# stderr line "kiln: ...EXPECTED...", and write no $tmp/out.png
usage() {
  local name=$1 want=$2; shift 2
  rm -f "$tmp/out.png"
  timeout 60 "$KILN" "$@" >"$tmp/stdout" 2>"$tmp/stderr" </dev/null
  local rc=$? lines
  lines=$(wc -l <"$tmp/stderr")
  if [ "$rc" = 2 ] && [ "$lines" = 1 ] && grep -q "^kiln: " "$tmp/stderr" \
    && grep -qF -- "$want" "$tmp/stderr" && [ ! -e "$tmp/out.png" ]; then
    echo "PASS $name"
  else
    echo "FAIL $name: expected status 2 and one line 'kiln: ...$want...', got status $rc:"
    sed 's/^/    /' "$tmp/stderr" | head -8
  fi
}

T="examples/txt2img.lua --quiet --steps 1 --out $tmp/out.png"
usage "unknown option lists the known ones" "unknown option '--bogus' (known: --batch --cache --cfg" $T --bogus 1
usage "unknown step cache lists the modes" "--cache fastcache: unknown mode 'fastcache' (known: fbcache, teacache, deepcache)" $T --cache fastcache
usage "a step cache's number" "--cache deepcache:x: 'x' is not a number" $T --cache deepcache:x
usage "option without its value" "option '--seed' needs a value" $T --seed
usage "a number option given a word" "--steps many: not a number" $T --steps many
usage "a whole number" "--seed 1.5: must be a whole number" $T --seed 1.5
usage "steps at least 1" "--steps 0: must be at least 1" $T --steps 0
usage "denoise out of range" "--denoise 2: must be between 0 and 1" $T --denoise 2
usage "unknown sampler lists the registry" "--sampler nope: unknown (known: ddim, dpm_2" $T --sampler nope
usage "unknown scheduler lists the registry" "--scheduler nope: unknown (known: beta" $T --scheduler nope
usage "unknown memory mode" "--mode fast: unknown" $T --mode fast
usage "unknown device" "--device nope:" $T --device nope
usage "malformed --vram" "--vram 6X:" $T --vram 6X
usage "missing --model file" "--model $tmp/none.safetensors: no such file or folder" $T --model "$tmp/none.safetensors"
usage "stray argument" "unexpected argument 'extra'" $T extra
usage "batch at least 1" "--batch 0: must be at least 1" $T --batch 0
usage "batch a whole number" "--batch 2.5: must be a whole number" $T --batch 2.5
usage "batch a number" "--batch many: not a number" $T --batch many
usage "clip skip not negative" "--clip-skip -1: must be at least 0" $T --clip-skip -1
usage "clip skip a whole number" "--clip-skip 1.5: must be a whole number" $T --clip-skip 1.5
usage "unknown weighting" "--weighting auto: must be a1111 or comfy" $T --weighting auto
usage "img2img without --input" "img2img needs --input IMAGE.png" examples/img2img.lua --quiet --out "$tmp/out.png"
usage "img2img --input missing" "--input $tmp/none.png: no such file or folder" \
  examples/img2img.lua --quiet --input "$tmp/none.png" --out "$tmp/out.png"

if [ -f "$MODEL" ]; then
  # the demo model's sizes are multiples of its VAE factor, 4 pixels (the UNet takes
  # any latent size)
  usage "width in pixels" "--width 102: must be a multiple of 4 (100 or 104 would do)" $T --width 102
  usage "height smaller than a block" "--height 2: must be a multiple of 4 (4 would do)" $T --height 2
  usage "hires fix: the scaled size" "--width 64 at --scale 1.3 is 83 pixels: must be a multiple of 4" \
    examples/hires_fix.lua --quiet --steps 1 --scale 1.3 --out "$tmp/out.png"
  usage "clip skip past the text encoder" "--clip-skip 40: the text encoder has" $T --clip-skip 40
  usage "hires fix: unknown upscaler" "--upscale bicubic: unknown" \
    examples/hires_fix.lua --quiet --steps 1 --upscale bicubic --out "$tmp/out.png"
else
  echo "SKIP sizes in pixels: $MODEL is missing"
fi

# a script of one's own raises the same error through kiln.util
printf 'require("kiln.util").usage_error("--colour: pick red or blue")\nprint("not reached")\n' >"$tmp/own.lua"
usage "util.usage_error from any script" "kiln: --colour: pick red or blue" "$tmp/own.lua"

# a bug is not a usage error: status 1 and a traceback
printf 'local function f(t) return t.x end\nf(nil)\n' >"$tmp/bug.lua"
timeout 20 "$KILN" "$tmp/bug.lua" >/dev/null 2>"$tmp/stderr" </dev/null
rc=$?
if [ "$rc" = 1 ] && grep -q "attempt to index" "$tmp/stderr" && grep -q "stack traceback" "$tmp/stderr"; then
  echo "PASS a script bug keeps its traceback"
else
  echo "FAIL a script bug keeps its traceback: status $rc"; sed 's/^/    /' "$tmp/stderr" | head -8
fi
