#!/usr/bin/env bash
# tests/test_leak_check.sh - the kiln program's check after a Lua test file
# (KILN_CHECK_LEAKS, which tests/run.sh sets) fails where it must: a script that leaves
# a tensor or a model alive (in a global) fails with a FAIL line naming what was left,
# and a clean one passes. (tests/test_invariants.c does the same for test.h's check.)
#   bash tests/test_leak_check.sh [BUILD/kiln]
set -u
cd "$(dirname "$0")/.."
KILN=${1:-build/kiln}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export KILN_CHECK_LEAKS=1

expect() { # name, want ("ok" or a text the FAIL line holds), script
  local name=$1 want=$2
  printf '%s\n' "$3" > "$tmp/$name.lua"
  local out rc
  out=$("$KILN" "$tmp/$name.lua" 2>&1); rc=$?
  if [ "$want" = ok ]; then
    if [ $rc = 0 ] && ! grep -q '^FAIL' <<<"$out"; then echo "PASS leak_check_$name"
    else echo "FAIL leak_check_$name: a clean script failed the check (exit $rc): $(head -3 <<<"$out")"; fi
  elif [ $rc != 0 ] && grep -q "^FAIL leak check: .*$want" <<<"$out"; then
    echo "PASS leak_check_$name"
  else
    echo "FAIL leak_check_$name: expected a failed check naming '$want', got exit $rc: $(head -3 <<<"$out" | sed 's/^FAIL/fail/')"
  fi
}

expect clean ok 'local t = kiln.zeros({4, 4}); assert(t:sum() == 0)
local m <close> = kiln.model("tests/golden/lora/sd1_kohya.safetensors", {name = "closed"})'
expect tensor_in_global "1 tensor(s) still alive.*tensor on cpu (1 storage, 64 bytes)" 'KEEP = kiln.zeros({4, 4})'
expect model_in_global "models still open after the script ended: left_open" \
  'M = kiln.model("tests/golden/lora/sd1_kohya.safetensors", {name = "left_open"})'
expect tensor_in_module "tensor(s) still alive" 'package.loaded.leaky = {kiln.ones({2})}'
