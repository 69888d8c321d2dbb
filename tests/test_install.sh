#!/usr/bin/env bash
# tests/test_install.sh - `make install` into a temporary prefix, then what a user of
# the installed kiln does: build the embedding example (examples/embed/art_tool.c)
# with `pkg-config --cflags --libs kiln` alone and run it (an image, progress, a
# cancel after N steps), run the kiln program and `require "kiln"` from lua5.4 away
# from the source tree, read the man page; then `make uninstall` removes it all.
#   bash tests/test_install.sh [build/kiln]      (the argument is not needed)
# MAKE may name another make command (e.g. "make -f other.mk").
set -u
cd "$(dirname "$0")/.."
root=$(pwd)
failed=0
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1: $2"; failed=1; }
skip() { echo "SKIP $1: $2"; }

if [ "${SAN:-0}" = 1 ]; then
  skip install "runs in the normal build (a sanitized libkiln needs a sanitized host)"
  exit 0
fi
for tool in pkg-config cc; do
  if ! command -v $tool >/dev/null; then skip install "$tool is not installed"; exit 0; fi
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
work=$tmp/work
mkdir -p "$work"

# ---- install ------------------------------------------------------------------
if ${MAKE:-make} -s install PREFIX="$prefix" >"$work/install.log" 2>&1; then
  pass "make install"
else
  fail "make install" "$(tail -5 "$work/install.log")"
  exit 1
fi
missing=""
version=$(sed -n 's/^#define KILN_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' bindings/kiln.h | paste -sd.)
somajor=${version%%.*}
for f in bin/kiln lib/libkiln.a lib/libkiln.so.$version include/kiln.h include/kiln_status.h lib/pkgconfig/kiln.pc \
         lib/lua/5.4/kiln.so share/man/man1/kiln.1 share/kiln/kiln.meta.lua; do
  [ -f "$prefix/$f" ] || missing="$missing $f"
done
if [ -z "$missing" ]; then pass "installed files"; else fail "installed files" "missing:$missing"; fi
if [ "$(readlink "$prefix/lib/libkiln.so.$somajor")" = "libkiln.so.$version" ] &&
   [ "$(readlink "$prefix/lib/libkiln.so")" = "libkiln.so.$somajor" ]; then
  pass "libkiln.so -> libkiln.so.$somajor -> libkiln.so.$version installed"
else
  fail "library links" "$(ls -l "$prefix"/lib/libkiln.so* 2>&1)"
fi
headers=$(cd "$prefix/include" && ls | paste -sd' ')
if [ "$headers" = "kiln.h kiln_status.h" ]; then pass "kiln.h and the kiln_status.h it includes are the headers"
else fail "headers" "$headers"; fi

# ---- build the example with pkg-config alone --------------------------------------
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
if flags=$(pkg-config --cflags --libs kiln 2>&1) && [ "$(pkg-config --modversion kiln)" != "" ]; then
  pass "pkg-config kiln ($(pkg-config --modversion kiln))"
else
  fail "pkg-config kiln" "$flags"
  exit 1
fi
if cc -std=c11 -Wall -Wextra -Werror examples/embed/art_tool.c $flags -o "$work/art_tool" 2>"$work/cc.log"; then
  pass "build art_tool with pkg-config --cflags --libs kiln"
else
  fail "build art_tool" "$(head -20 "$work/cc.log")"
  exit 1
fi
if LD_LIBRARY_PATH=$prefix/lib ldd "$work/art_tool" 2>/dev/null | grep -q "libkiln.so.$somajor => $prefix/lib/libkiln.so.$somajor"; then
  pass "art_tool links the installed libkiln.so.$somajor (its SONAME)"
else
  fail "libkiln.so" "$(LD_LIBRARY_PATH=$prefix/lib ldd "$work/art_tool" 2>&1 | grep kiln)"
fi
static_libs=$(pkg-config --static --libs kiln | sed "s|-lkiln|$prefix/lib/libkiln.a|")
if cc -std=c11 examples/embed/art_tool.c $(pkg-config --cflags kiln) $static_libs -o "$work/art_tool_static" \
     2>"$work/cc_static.log"; then
  pass "build art_tool statically with pkg-config --static --libs kiln"
else
  fail "static build" "$(head -20 "$work/cc_static.log")"
fi

# ---- run it: an image with progress, then a cancel ----------------------------------
out=$(LD_LIBRARY_PATH=$prefix/lib "$work/art_tool" --steps 4 --size 64 --out "$work/fox.png" "a red fox" 2>&1)
rc=$?
if [ $rc = 0 ] && [ -s "$work/fox.png" ] && echo "$out" | grep -q "step 4/4" &&
   echo "$out" | grep -q "after close: 0 bytes allocated"; then
  pass "art_tool writes an image, reporting progress"
else
  fail "art_tool" "exit $rc: $out"
fi
if [ "$(head -c 8 "$work/fox.png" 2>/dev/null | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ]; then
  pass "the image is a PNG"
else
  fail "png" "$work/fox.png has no PNG signature"
fi
out=$(LD_LIBRARY_PATH=$prefix/lib "$work/art_tool" --steps 10 --size 64 --cancel-after 3 --device sim "a red fox" 2>&1)
rc=$?
if [ $rc = 2 ] && echo "$out" | grep -q "cancelled after 3 steps" && ! echo "$out" | grep -q "step 4/10" &&
   echo "$out" | grep -q "after close: 0 bytes allocated on sim"; then
  pass "art_tool --cancel-after 3 stops at step 3 (KILN_ERR_CANCELLED)"
else
  fail "art_tool cancel" "exit $rc: $out"
fi
if [ -x "$work/art_tool_static" ]; then
  out=$("$work/art_tool_static" --steps 2 --size 32 --out "$work/static.png" 2>&1)
  if [ $? = 0 ] && [ -s "$work/static.png" ]; then pass "static art_tool runs"; else fail "static art_tool" "$out"; fi
fi

# ---- the program and the Lua module, away from the source tree -------------------------
cd "$work"
v=$(KILN_PATH= "$prefix/bin/kiln" -e 'local s = kiln.sample; print(kiln.version, type(s))' 2>&1)
if echo "$v" | grep -q "^[0-9].*table"; then pass "installed kiln runs its built-in scripts"; else fail "kiln" "$v"; fi
if command -v lua5.4 >/dev/null; then
  v=$(LUA_CPATH="$prefix/lib/lua/5.4/?.so" lua5.4 -e 'local k = require "kiln"; print(k.version, k.zeros({2}):sum())' 2>&1)
  if echo "$v" | grep -q "^[0-9].*0"; then pass "lua5.4 require \"kiln\" from the installed module"
  else fail "lua5.4 require" "$v"; fi
else
  skip "lua5.4 require" "lua5.4 is not installed"
fi
if command -v man >/dev/null; then
  warn=$(LC_ALL=C.UTF-8 MANWIDTH=80 man --warnings -l "$prefix/share/man/man1/kiln.1" 2>&1 >"$work/man.txt")
  if [ -z "$warn" ] && grep -q "memory budget" "$work/man.txt"; then pass "man page"; else fail "man page" "$warn"; fi
else
  skip "man page" "man is not installed"
fi
cd "$root"

# ---- uninstall -----------------------------------------------------------------
if ${MAKE:-make} -s uninstall PREFIX="$prefix" >"$work/uninstall.log" 2>&1; then
  left=$(find "$prefix" -type f -o -type l | sed "s|^$prefix/||")
  if [ -z "$left" ]; then pass "make uninstall"; else fail "make uninstall" "left behind: $left"; fi
else
  fail "make uninstall" "$(tail -5 "$work/uninstall.log")"
fi
exit $failed
