#!/usr/bin/env bash
# tests/test_abi.sh - the public ABI of libkiln.so.0: `nm -D` lists exactly the
# functions kiln.h (and kiln_status.h) declare KILN_API, in both directions; the
# library is libkiln.so.MAJOR.MINOR.PATCH with the SONAME libkiln.so.MAJOR and its
# links; a host built against other headers (another minor version) is refused at
# kiln_open with a message naming both versions, and the same host built against
# these headers runs; the kernels read their tunables only through runtime/tunables.c.
#   bash tests/test_abi.sh [BUILD/kiln]      (the build folder is the argument's)
set -u
cd "$(dirname "$0")/.."
build=$(dirname "${1:-${BUILD:-build}/kiln}")
failed=0
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1: $2"; failed=1; }
skip() { echo "SKIP $1: $2"; }

major=$(sed -n 's/^#define KILN_VERSION_MAJOR \([0-9]*\)$/\1/p' bindings/kiln.h)
minor=$(sed -n 's/^#define KILN_VERSION_MINOR \([0-9]*\)$/\1/p' bindings/kiln.h)
patch=$(sed -n 's/^#define KILN_VERSION_PATCH \([0-9]*\)$/\1/p' bindings/kiln.h)
version="$major.$minor.$patch"
lib="$build/libkiln.so.$version"

# ---- the files and the SONAME ------------------------------------------------------
if [ ! -f "$lib" ]; then
  fail "library file" "$lib is not built"
  exit 1
fi
if [ "$(readlink "$build/libkiln.so.$major")" = "libkiln.so.$version" ] &&
   [ "$(readlink "$build/libkiln.so")" = "libkiln.so.$major" ]; then
  pass "libkiln.so -> libkiln.so.$major -> libkiln.so.$version"
else
  fail "links" "$(ls -l "$build"/libkiln.so* 2>&1)"
fi
if command -v readelf >/dev/null; then
  soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
  if [ "$soname" = "libkiln.so.$major" ]; then pass "readelf -d: SONAME $soname"
  else fail "SONAME" "'$soname', expected libkiln.so.$major"; fi
else
  skip "SONAME" "readelf is not installed"
fi

# ---- exports: exactly the public headers' functions ------------------------------------
if command -v nm >/dev/null; then
  # every `KILN_API <type> name(` of the public headers
  want=$(sed -n 's/^KILN_API [^(]*[ *]\([a-z_0-9]*\)(.*/\1/p' bindings/kiln.h runtime/kiln_status.h | sort -u)
  n=$(echo "$want" | grep -c .)
  if [ "$n" -lt 20 ] || ! echo "$want" | grep -qx luaopen_kiln || ! echo "$want" | grep -qx kiln_open_v; then
    fail "declarations" "read $n from the headers: $(echo $want)"
  fi
  # defined functions of the dynamic table; sanitizer builds add their own (__asan_*)
  have=$(nm -D --defined-only "$build/libkiln.so.$major" | awk '$2 == "T" || $2 == "W" || $2 == "i" {print $3}' |
         grep -v '^_' | sort -u)
  extra=$(comm -13 <(echo "$want") <(echo "$have"))
  missing=$(comm -23 <(echo "$want") <(echo "$have"))
  if [ -z "$extra" ] && [ -z "$missing" ]; then
    pass "nm -D libkiln.so.$major: exactly the $n functions of the public header"
  else
    fail "exports" "exported but not declared KILN_API: $(echo $extra); declared but not exported: $(echo $missing)"
  fi
  data=$(nm -D --defined-only "$build/libkiln.so.$major" | awk '$2 ~ /^[BDGRSV]$/ {print $3}' | grep -v '^_' |
         grep -v '^\(edata\|end\|bss_start\)$')
  if [ -z "$data" ]; then pass "no data symbols exported"; else fail "data symbols" "$(echo $data)"; fi
else
  skip "exports" "nm is not installed"
fi

# ---- the core includes nothing from bindings/, the CLI no private header ---------------------------
core=$(grep -ln '#include "[^"]*bindings/' runtime/*.[ch] kernels/*.[ch] kernels/*/*.[ch] kernels/cuda/*.cu 2>/dev/null)
if [ -z "$core" ]; then pass "runtime/ and kernels/ include nothing from bindings/"
else fail "core includes bindings" "$core"; fi
private=$(grep -h '#include "' bindings/kiln_main.c bindings/repl_input.c bindings/serve_*.c |
         grep -v '"kiln.h"\|"repl_input.h"\|"serve_http.h"\|"serve_ws.h"\|"lua.h"\|"lauxlib.h"')
if [ -z "$private" ]; then pass "the kiln program includes kiln.h and Lua's headers only"
else fail "CLI includes" "$private"; fi

# ---- tunables: one reader ---------------------------------------------------------------
readers=$(grep -ln 'getenv *(' runtime/*.c kernels/*.c kernels/*/*.c kernels/cuda/*.cu 2>/dev/null | grep -v '^runtime/tunables.c$')
if [ -z "$readers" ]; then pass "the core reads the environment only in runtime/tunables.c"
else fail "getenv outside tunables.c" "$readers"; fi
undeclared=""
for name in $(grep -oh 'kiln_tunable_[a-z]*("KILN_[A-Z0-9_]*"' runtime/*.c kernels/*/*.c | sed 's/.*("\(.*\)"/\1/' | sort -u); do
  grep -q "{\"$name\"" runtime/tunables.c || undeclared="$undeclared $name"
done
if [ -z "$undeclared" ]; then pass "every tunable read is in tunables.c's table"
else fail "undeclared tunables" "$undeclared"; fi

# ---- a host of other headers is refused; the same host of these headers runs --------------------
if [ "${SAN:-0}" = 1 ] || [ "${TSAN:-0}" = 1 ]; then
  skip "version check" "runs in the normal build (a sanitized libkiln needs a sanitized host)"
  exit $failed
fi
if ! command -v cc >/dev/null; then skip "version check" "cc is not installed"; exit $failed; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/same" "$tmp/next"
cp bindings/kiln.h runtime/kiln_status.h "$tmp/same/"
cp runtime/kiln_status.h "$tmp/next/"
next="$major.$((minor + 1)).0"
sed "s/^#define KILN_VERSION_MINOR $minor\$/#define KILN_VERSION_MINOR $((minor + 1))/;
     s/^#define KILN_VERSION_PATCH $patch\$/#define KILN_VERSION_PATCH 0/" bindings/kiln.h >"$tmp/next/kiln.h"
cat >"$tmp/host.c" <<'C'
#include <kiln.h>
#include <stdio.h>
int main(void)
{
    kiln_config cfg = KILN_CONFIG_INIT;
    cfg.log_level = KILN_LOG_OFF;
    kiln_ctx *ctx = NULL;
    kiln_status st = kiln_open(&cfg, &ctx);
    printf("%s|%s\n", kiln_status_string(st), st == KILN_OK ? kiln_version() : kiln_last_message(NULL));
    kiln_close(ctx);
    return st == KILN_OK ? 0 : 3;
}
C
for h in same next; do
  if ! cc -std=c99 -Wall -Wextra -Werror -pedantic -I"$tmp/$h" "$tmp/host.c" -o "$tmp/host_$h" -L"$build" -lkiln \
       -Wl,-rpath,"$(cd "$build" && pwd)" 2>"$tmp/cc_$h.log"; then
    fail "build a host of the $h headers" "$(head -20 "$tmp/cc_$h.log")"
    exit 1
  fi
done
if command -v readelf >/dev/null && readelf -d "$tmp/host_same" | grep -q "NEEDED.*\[libkiln.so.$major\]"; then
  pass "a host built with -lkiln needs libkiln.so.$major"
elif command -v readelf >/dev/null; then
  fail "host NEEDED" "$(readelf -d "$tmp/host_same" | grep NEEDED)"
fi
out=$(KILN_PATH= "$tmp/host_same" 2>&1); rc=$?
if [ $rc = 0 ] && [ "$out" = "ok|$version" ]; then pass "a host of the $version headers opens a context"
else fail "same version" "exit $rc: $out"; fi
out=$(KILN_PATH= "$tmp/host_next" 2>&1); rc=$?
if [ $rc = 3 ] && [[ $out == unsupported\|* ]] && [[ $out == *"kiln.h $next"* ]] && [[ $out == *"library it loaded is $version"* ]]; then
  pass "a host of $next headers is refused by the $version library, naming both versions"
else
  fail "mismatched version" "exit $rc: $out"
fi
exit $failed
