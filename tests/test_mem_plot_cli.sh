#!/usr/bin/env bash
# test_mem_plot_cli.sh - `kiln --memory-plot FILE.png`: the picture of the run is
# written when the script ends, finished or failed, with its stage table on stderr.
# Run from the repository root: tests/test_mem_plot_cli.sh [path/to/kiln]
# Prints PASS/FAIL/SKIP lines; exits non-zero when a test fails.

KILN=${1:-build/kiln}
case $KILN in /*) ;; *) KILN=$PWD/$KILN ;; esac
MODEL=${KILN_DEMO_MODEL:-examples/models/kiln-shapes.safetensors}

n_fail=0
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1: $2"; n_fail=$((n_fail + 1)); }
skip() { echo "SKIP $1: $2"; }

TMP=$(mktemp -d "${TMPDIR:-/tmp}/kiln_mem_plot.XXXXXX") || exit 1
trap 'rm -rf "$TMP"' EXIT

# size_of FILE: "W H" of a PNG, read back by kiln
echo 'local t <close> = kiln.load_png(arg[1]); print(t.shape[4], t.shape[3])' >"$TMP/size.lua"
size_of() { "$KILN" "$TMP/size.lua" "$1" 2>/dev/null; }

if [ -f "$MODEL" ]; then
  timeout 120 "$KILN" --device sim --quiet --memory-plot "$TMP/run.png" examples/txt2img.lua \
    --prompt "a red circle on a blue background" --steps 2 --model "$MODEL" --out "$TMP/out.png" \
    >"$TMP/out" 2>"$TMP/err"
  rc=$?
  if [ $rc -ne 0 ]; then
    fail cli_plot_txt2img "exit status $rc: $(tail -3 "$TMP/err")"
  elif [ "$(size_of "$TMP/run.png")" != "960	540" ]; then
    fail cli_plot_txt2img "no 960x540 picture at $TMP/run.png ($(size_of "$TMP/run.png"))"
  elif ! grep -q '^memory on sim: peak' "$TMP/err" || ! grep -q '^sample ' "$TMP/err" || ! grep -q '^decode ' "$TMP/err"; then
    fail cli_plot_txt2img "stage table missing from stderr: $(cat "$TMP/err")"
  else
    pass cli_plot_txt2img
  fi
else
  skip cli_plot_txt2img "$MODEL is missing"
fi

timeout 60 "$KILN" --device sim --memory-plot "$TMP/err.png" \
  -e 'kiln.trace.span("boom", function() local t = kiln.zeros({ 1000 }) error("bang") end)' >"$TMP/out" 2>"$TMP/err"
rc=$?
if [ $rc -ne 1 ]; then
  fail cli_plot_on_error "exit status $rc (expected 1)"
elif [ ! -s "$TMP/err.png" ]; then
  fail cli_plot_on_error "no picture written after the error"
elif ! grep -q 'boom (error)' "$TMP/err" || ! grep -q 'bang' "$TMP/err"; then
  fail cli_plot_on_error "stderr lacks the error or the failed stage: $(cat "$TMP/err")"
else
  pass cli_plot_on_error
fi

timeout 20 "$KILN" --memory-plot >"$TMP/out" 2>"$TMP/err"
rc=$?
if [ $rc -eq 2 ] && grep -q "'--memory-plot' needs an argument" "$TMP/err"; then
  pass cli_plot_needs_file
else
  fail cli_plot_needs_file "exit status $rc: $(cat "$TMP/err")"
fi

timeout 20 "$KILN" --memory-plot "$TMP/no/such/dir/x.png" -e 'local x = 1' >"$TMP/out" 2>"$TMP/err"
rc=$?
if [ $rc -eq 1 ] && grep -q -- '--memory-plot' "$TMP/err"; then
  pass cli_plot_unwritable
else
  fail cli_plot_unwritable "exit status $rc: $(cat "$TMP/err")"
fi

[ "$n_fail" -eq 0 ]
