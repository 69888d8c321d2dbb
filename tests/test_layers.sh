#!/usr/bin/env bash
# tests/test_layers.sh - the layer test: the file-level dependency graph of runtime/,
# kernels/ and bindings/ (the objects' symbols by nm, and the #include lines) has no
# loop, the core reaches neither Lua nor bindings/ nor (from runtime/) kernels/, and
# the memory core keeps the order its files' opening comments declare (tests/layers.lua
# checks; tests/layers_known.txt lists the known breaks being fixed elsewhere). Then the
# checker itself is run over a small tree with one break of each kind, which it must
# name. Called by tests/run.sh with the kiln program (BUILD names the build folder).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-$(dirname "${1:-build/kiln}")}
root=$PWD

if ! command -v nm >/dev/null || ! command -v lua5.4 >/dev/null; then
  echo "SKIP layers: nm and lua5.4 are needed"
  exit 0
fi

lua5.4 tests/layers.lua "$BUILD" tests/layers_known.txt
rc=$?

# ---- the checker over a tree with known faults ----
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/runtime" "$tmp/kernels" "$tmp/bindings" "$tmp/b/obj/runtime" "$tmp/b/obj/kernels"
cd "$tmp"
# a <-> b by calls only; c.c includes c.h, which declares c.c's function (one node)
printf 'void a_fn(void);\n' >runtime/a.h
printf '#include "a.h"\nvoid b_fn(void);\nvoid a_fn(void) { b_fn(); }\n' >runtime/a.c
printf 'void a_fn(void);\nvoid b_fn(void) { a_fn(); }\n' >runtime/b.c
printf 'int c_fn(void);\n' >runtime/c.h
printf '#include "c.h"\nint c_fn(void) { return 1; }\n' >runtime/c.c
# runtime calling into kernels, and a core header with Lua in it
printf 'int k_fn(void) { return 2; }\n' >kernels/k.c
printf 'int k_fn(void);\nint d_fn(void) { return k_fn(); }\n' >runtime/d.c
printf '#include "lua.h"\n' >runtime/e.h
# a declared order broken: layer 0 calls layer 1, which it says it never calls
printf '/* l0.c - bottom.\n * layer 0 of the memory core: uses nothing; never calls l1. */\nint l1_fn(void);\nint l0_fn(void) { return l1_fn(); }\n' >runtime/l0.c
printf '/* l1.c - above.\n * layer 1 of the memory core: uses l0; never calls nothing. */\nint l0_fn(void);\nint l1_fn(void) { return 1; }\n' >runtime/l1.c
printf 'runtime/x -> runtime/y   a fix that landed\n' >known.txt
objs=
for f in runtime/*.c kernels/*.c; do
  cc -c "$f" -o "b/obj/${f%.c}.o" 2>/dev/null
  objs="$objs b/obj/${f%.c}.o"
done
ar rcs b/libkiln.a $objs
out=$(lua5.4 "$root/tests/layers.lua" b known.txt)
self_rc=$?
cd "$root"
expect() { # name, pattern the checker's output must (1) or must not (0) contain
  if printf '%s\n' "$out" | grep -q -- "$3"; then found=1; else found=0; fi
  if [ "$found" = "$2" ]; then echo "PASS layers_checker_$1"
  else echo "FAIL layers_checker_$1: expected $( [ "$2" = 1 ] || echo 'no ')'$3' in:"; printf '%s\n' "$out" | sed 's/^/       /'; fi
}
expect names_call_loop 1 '^     loop: runtime/a -> runtime/b (calls b_fn); runtime/b -> runtime/a (calls a_fn)'
expect c_and_h_one_node 0 'runtime/c'
expect runtime_to_kernels 1 '^FAIL layers_runtime_below_kernels: runtime/d -> kernels/k (calls k_fn)'
expect lua_in_core 1 '^FAIL layers_core_without_lua: runtime/e.h includes lua.h'
expect order 1 '^FAIL layers_memory_core_order: runtime/l0 depends on runtime/l1, which it says it never calls'
expect stale_allowance 1 '^FAIL layers_allowance_current: runtime/x -> runtime/y no longer exists'
if [ "$self_rc" != 0 ]; then echo "PASS layers_checker_exit_status"
else echo "FAIL layers_checker_exit_status: the checker exited 0 on a broken tree"; fi
exit $rc
