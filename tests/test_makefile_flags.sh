#!/usr/bin/env bash
# tests/test_makefile_flags.sh - the Makefile computes the package-dependent flags
# (Lua, libpng, hiredis) after `make deps`, not when make first reads it: on a fresh
# machine the packages, and their pkg-config files, only appear once deps has run.
# Simulated here with a pkg-config that sees no .pc file until the deps check has
# touched its mark, in a build folder of its own. (Argument: the kiln program; unused.)
set -u
cd "$(dirname "$0")/.."
unset MAKEFLAGS MFLAGS MAKELEVEL  # not the options or variables of the `make test` above us

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
real_pc=$(command -v pkg-config || true)
if [ -z "$real_pc" ] || ! pkg-config --exists lua5.4 libpng; then
  echo "SKIP makefile_flags: pkg-config, lua5.4.pc or libpng.pc missing (make deps)"; exit 0
fi
build=$tmp/build
mark=$build/.deps-ok
mkdir -p "$tmp/bin" "$tmp/empty"
cat >"$tmp/bin/pkg-config" <<EOF
#!/bin/sh
# pkg-config as on a machine whose packages the deps check has not installed yet
if [ -f "$mark" ]; then exec "$real_pc" "\$@"; fi
PKG_CONFIG_LIBDIR="$tmp/empty" PKG_CONFIG_PATH= exec "$real_pc" "\$@"
EOF
chmod +x "$tmp/bin/pkg-config"
export PATH="$tmp/bin:$PATH"
mk() { make --no-print-directory CUDA=0 BUILD="$build" DEPS_OK="$mark" "$@"; }

fails=0
ok()   { echo "PASS $1"; }
bad()  { echo "FAIL $1: $2"; fails=$((fails + 1)); }

# the simulation hides what it should: before the mark, no lua5.4 for pkg-config
if pkg-config --cflags lua5.4 >/dev/null 2>&1; then
  bad hidden "the stand-in pkg-config still finds lua5.4 before the deps check"
else ok hidden; fi

# the deps check itself (dpkg); when packages are missing and we are not root it fails
mkdir -p "$build"
if ! mk deps >"$tmp/deps.out" 2>&1; then
  if grep -q '^deps: missing' "$tmp/deps.out"; then
    echo "SKIP makefile_flags: $(grep '^deps: missing' "$tmp/deps.out")"; exit 0
  fi
  echo "FAIL deps: $(tail -2 "$tmp/deps.out" | tr '\n' ' ')"; exit 1
fi
rm -f "$mark"

lua_cflags=$("$real_pc" --cflags lua5.4); lua_libs=$("$real_pc" --libs lua5.4)
png_cflags=$("$real_pc" --cflags libpng)

# dry run of the whole build from nothing: the deps check runs (for real, as make does
# for the makefiles it reads), then every compile line must carry the packages' flags
mk -n "$build/kiln" >"$tmp/dry.out" 2>&1
rc=$?
compiles=$(grep -E ' -c (runtime|kernels|bindings)/[a-z0-9_/]*\.c -o ' "$tmp/dry.out")
n=$(printf '%s\n' "$compiles" | grep -c . || true)
if [ "$rc" != 0 ] || [ "$n" -lt 20 ]; then
  bad dry_run "make -n exited $rc with $n compile lines: $(tail -3 "$tmp/dry.out")"
else ok dry_run; fi
[ -f "$mark" ] && ok deps_ran || bad deps_ran "the dry run did not run the deps check"
missing=$(printf '%s\n' "$compiles" | grep -v -F -- "$lua_cflags" | head -1)
[ -z "$missing" ] && ok lua_cflags || bad lua_cflags "a compile without $lua_cflags: $missing"
missing=$(printf '%s\n' "$compiles" | grep -v -F -- "$png_cflags" | head -1)
[ -z "$missing" ] && ok png_cflags || bad png_cflags "a compile without $png_cflags: $missing"
link=$(grep -E -- "-o $build/kiln " "$tmp/dry.out" | head -1)
case " $link " in
  *" $lua_libs "*) ok lua_libs ;;
  *) bad lua_libs "the kiln link line lacks $lua_libs: $link" ;;
esac
if "$real_pc" --exists hiredis; then
  hiredis_cflags=$("$real_pc" --cflags hiredis)
  q=$(grep -E -- '-c runtime/queue\.c ' "$tmp/dry.out")
  case "$q" in
    *"-DKILN_HIREDIS $hiredis_cflags"*) ok hiredis ;;
    *) bad hiredis "queue.c compiled without -DKILN_HIREDIS $hiredis_cflags: $q" ;;
  esac
fi

# a real compile of a file that includes lua.h, from an empty build folder, in one run
rm -rf "$build"; mkdir -p "$build"
if mk "$build/obj/bindings/l_scripts.o" >"$tmp/cc.out" 2>&1 && [ -f "$build/obj/bindings/l_scripts.o" ]; then
  ok compile_after_deps
else
  bad compile_after_deps "$(grep -m1 -E 'error|Error' "$tmp/cc.out")"
fi

# goals that compile nothing neither run the deps check nor write the flags
rm -rf "$build"
mk clean -n >/dev/null 2>&1
[ ! -e "$mark" ] && [ ! -e "$build/flags.mk" ] && ok clean_no_deps \
  || bad clean_no_deps "make -n clean ran the deps check or wrote the flags"
[ "$fails" = 0 ]
