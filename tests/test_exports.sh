#!/usr/bin/env bash
# tests/test_exports.sh - the public boundary: libkiln.so and the Lua module kiln.so
# export exactly the functions kiln.h declares with KILN_API, plus luaopen_kiln
# (everything else is built hidden); and the version macros of kiln.h are the one
# version: kiln_version(), kiln.version and the Makefile's agree.
#   bash tests/test_exports.sh [BUILD/kiln]      (the build folder is the argument's)
set -u
cd "$(dirname "$0")/.."
build=$(dirname "${1:-${BUILD:-build}/kiln}")
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1: $2"; }
skip() { echo "SKIP $1: $2"; }

if ! command -v nm >/dev/null; then skip exports "nm is not installed"; exit 0; fi

# every `KILN_API <type> name(` of the public header, and the Lua entry point
want=$( (sed -n 's/^KILN_API [^(]*[ *]\([a-z_0-9]*\)(.*/\1/p' bindings/kiln.h; echo luaopen_kiln) | sort -u)
if [ "$(echo "$want" | wc -l)" -lt 10 ]; then
  fail "kiln.h declarations" "found only: $(echo $want)"
  exit 0
fi

for lib in libkiln.so lua/kiln.so; do
  if [ ! -f "$build/$lib" ]; then skip "exports of $lib" "$build/$lib is not built"; continue; fi
  # defined text symbols of the dynamic table; sanitizer builds add their own
  # (__asan_*, __ubsan_*), which are the compiler's, not ours
  have=$(nm -D --defined-only "$build/$lib" | awk '$2 == "T" {print $3}' | grep -v '^_' | sort -u)
  extra=$(comm -13 <(echo "$want") <(echo "$have"))
  missing=$(comm -23 <(echo "$want") <(echo "$have"))
  if [ -z "$extra" ] && [ -z "$missing" ]; then
    pass "exports of $lib ($(echo "$have" | wc -l) functions: kiln.h's and luaopen_kiln)"
  else
    fail "exports of $lib" "not in kiln.h: $(echo $extra); declared but not exported: $(echo $missing)"
  fi
done

# one version: kiln.h's macros
major=$(sed -n 's/^#define KILN_VERSION_MAJOR \([0-9]*\)$/\1/p' bindings/kiln.h)
minor=$(sed -n 's/^#define KILN_VERSION_MINOR \([0-9]*\)$/\1/p' bindings/kiln.h)
patch=$(sed -n 's/^#define KILN_VERSION_PATCH \([0-9]*\)$/\1/p' bindings/kiln.h)
version="$major.$minor.$patch"
if [[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then pass "kiln.h version macros ($version)"
else fail "kiln.h version macros" "read '$version'"; fi
if [ -x "$build/kiln" ]; then
  got=$("$build/kiln" -e 'io.write(kiln.version)' 2>&1)
  if [ "$got" = "$version" ]; then pass "kiln.version is kiln.h's"; else fail "kiln.version" "'$got', kiln.h says $version"; fi
fi
made=$(${MAKE:-make} -s --no-print-directory -f - print-version <<'EOF' 2>&1
include Makefile
print-version: ; @echo $(KILN_VERSION)
EOF
)
made=$(echo "$made" | tail -1)
if [ "$made" = "$version" ]; then pass "the Makefile's version is kiln.h's"; else fail "Makefile version" "'$made', kiln.h says $version"; fi
if grep -n 'KILN_VERSION "' bindings/*.c runtime/*.c >/dev/null 2>&1; then
  fail "one version" "a .c file defines a version string: $(grep -ln 'KILN_VERSION "' bindings/*.c runtime/*.c)"
else
  pass "no .c file carries a version string"
fi
