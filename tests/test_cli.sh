#!/usr/bin/env bash
# test_cli.sh - tests of the kiln command-line program (bindings/kiln_main.c, a host
# of kiln.h), its REPL and result printer (scripts/kiln/repl.lua), usage errors, and
# the embedded-script searcher (bindings/l_scripts.c). Run from the repository root:
#   tests/test_cli.sh [path/to/kiln]      (default build/kiln)
# Prints PASS/FAIL/SKIP lines and "# N passed, N failed, N skipped" as tests/test.h does;
# exits non-zero when a test fails.

KILN=${1:-build/kiln}
case $KILN in /*) ;; *) KILN=$PWD/$KILN ;; esac
REPO=$PWD
LUA=$(command -v lua5.4 || true)

n_pass=0 n_fail=0 n_skip=0
pass() { echo "PASS $1"; n_pass=$((n_pass + 1)); }
fail() { echo "FAIL $1: $2"; n_fail=$((n_fail + 1)); }
skip() { echo "SKIP $1: $2"; n_skip=$((n_skip + 1)); }
summary() {
  echo "# $n_pass passed, $n_fail failed, $n_skip skipped"
  [ "$n_fail" -eq 0 ]
  exit
}

if [ ! -x "$KILN" ]; then
  fail cli_binary "$KILN not found or not executable (build it first)"
  summary
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/kiln_cli.XXXXXX") || exit 1
trap 'rm -rf "$TMP"' EXIT
# run outside the source tree unless a test says otherwise, and never touch ~
export KILN_HISTORY=
unset KILN_PATH
cd "$TMP" || exit 1

# run NAME ARGS...: runs kiln with stdin from /dev/null unless STDIN is set;
# sets $out, $err, $rc. Time-limited so a hang fails instead of blocking.
run() {
  local input=${STDIN:-/dev/null}
  timeout 20 "$KILN" "$@" <"$input" >"$TMP/out" 2>"$TMP/err"
  rc=$?
  out=$(cat "$TMP/out")
  err=$(cat "$TMP/err")
}

# one_line: stderr is exactly one line (a usage error, no traceback)
one_line() { [ -n "$err" ] && [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ]; }

# expect NAME COND MESSAGE: PASS when COND (a shell test string) holds
expect() {
  if eval "$2"; then pass "$1"; else fail "$1" "$3 (rc=$rc, stdout='${out:0:300}', stderr='${err:0:300}')"; fi
}

# --- version and help
run --version
expect version '[ $rc -eq 0 ] && [[ $out =~ ^kiln\ [0-9]+\.[0-9]+\.[0-9]+.*\ \(Lua\ 5\.4\)$ ]]' \
  "expected 'kiln X.Y.Z (Lua 5.4)'"
run -v
expect version_short '[ $rc -eq 0 ] && [[ $out == kiln\ * ]]' "-v should print the version"
run --help
expect help '[ $rc -eq 0 ] && [[ $out == *"usage: kiln"* ]] && [[ $out == *--vram* ]] && [[ $out == *--device* ]] && [[ $out == *" -e "* ]]' \
  "usage with the options on stdout"
run --no-such-option
expect bad_option '[ $rc -eq 2 ] && one_line && [[ $err == "kiln: unrecognized option '"'"'--no-such-option'"'"'"* ]]' \
  "status 2 and one line naming the option"
run -e
expect e_needs_argument '[ $rc -eq 2 ] && one_line && [[ $err == *"needs argument"* ]]' "'-e' alone is a usage error"
run --vram 6X -e 'print(1)'
expect bad_vram '[ $rc -eq 2 ] && one_line && [[ $err == *"6X"* ]] && [ -z "$out" ]' "a bad --vram size stops before running"
run --threads nine -e 'print(1)'
expect bad_threads '[ $rc -eq 2 ] && one_line && [[ $err == *"nine"* ]]' "a bad --threads count stops before running"
run --threads 9999 -e 'print(1)'
expect threads_range '[ $rc -eq 2 ] && one_line && [[ $err == "kiln: --threads: 9999"* ]] && [ -z "$out" ]' \
  "an out-of-range --threads count is named"
run --device warp9 -e 'print(1)'
expect bad_device '[ $rc -eq 2 ] && one_line && [[ $err == "kiln: --device: unknown device '"'"'warp9'"'"'"* ]] && [[ $err == *cpu* ]] && [ -z "$out" ]' \
  "an unknown --device lists the devices"
run --mode turbo -e 'print(1)'
expect bad_mode '[ $rc -eq 2 ] && one_line && [[ $err == "kiln: --mode: "*turbo*normal* ]]' "an unknown --mode lists the modes"

# --- -e, the kiln global, exit status
run -e 'print(1 + 1)'
expect e_print '[ $rc -eq 0 ] && [ "$out" = 2 ]' "expected 2"
run -e 'print(type(kiln), package.loaded.kiln == kiln, type(kiln.version))'
expect kiln_global '[ $rc -eq 0 ] && [ "$out" = "table	true	string" ]' "kiln preloaded as a global and in package.loaded"
run -e 'x = 1' -e 'print(x + 1)'
expect e_twice '[ $rc -eq 0 ] && [ "$out" = 2 ]' "-e options run in order"
run -l s=string -e 'print(s.rep("ab", 2))'
expect l_option '[ $rc -eq 0 ] && [ "$out" = abab ]' "-l g=mod"
run -e 'os.exit(3)'
expect exit_code '[ $rc -eq 3 ]' "os.exit(3) gives status 3"
run --threads 1 --quiet -e 'print("ok")'
expect runtime_options '[ $rc -eq 0 ] && [ "$out" = ok ]' "--threads/--quiet accepted before -e"

# --- script files and arg
cat >"$TMP/args.lua" <<'EOF'
local lo = 0
while arg[lo - 1] ~= nil do lo = lo - 1 end
local parts = {}
for i = lo, #arg do parts[#parts + 1] = i .. "=" .. (i == lo and "<prog>" or arg[i]) end
parts[#parts + 1] = "n=" .. select("#", ...)
for i = 1, select("#", ...) do parts[#parts + 1] = "v" .. i .. "=" .. select(i, ...) end
print(table.concat(parts, "|"))
EOF
check_args() { # check_args NAME EXPECTED ARGS...
  local name=$1 want=$2
  shift 2
  run "$@"
  local got=$out
  if [ -n "$LUA" ]; then
    want=$(cd "$TMP" && "$LUA" "$@" 2>&1 </dev/null)
  fi
  if [ $rc -eq 0 ] && [ "$got" = "$want" ]; then pass "$name"; else fail "$name" "arg '$got', lua5.4 gives '$want' (rc=$rc, stderr='$err')"; fi
}
check_args arg_script '-1=<prog>|0=args.lua|1=a|2=|3=b c|n=3|v1=a|v2=|v3=b c' args.lua a '' 'b c'
check_args arg_options '-3=<prog>|-2=-e|-1=x=1|0=args.lua|1=a|n=1|v1=a' -e 'x=1' args.lua a
check_args arg_dashdash '-2=<prog>|-1=--|0=args.lua|1=-x|n=1|v1=-x' -- args.lua -x
run --device cpu args.lua z
expect arg_kiln_options '[ $rc -eq 0 ] && [ "$out" = "-3=<prog>|-2=--device|-1=cpu|0=args.lua|1=z|n=1|v1=z" ]' \
  "kiln options count among the negative indices, as lua5.4's do"
run -e 'print(arg[0] ~= nil, #arg)'
expect arg_no_script '[ $rc -eq 0 ] && [ "$out" = "true	2" ]' "without a script arg[0] is the program, as lua5.4"

# --- stdin
printf 'print("stdin", ...)\n' >"$TMP/in.lua"
STDIN=$TMP/in.lua run - a b
expect stdin_dash '[ $rc -eq 0 ] && [ "$out" = "stdin	a	b" ]' "'-' runs stdin with the arguments"
STDIN=$TMP/in.lua run
expect stdin_noargs '[ $rc -eq 0 ] && [ "$out" = stdin ]' "no arguments and stdin not a terminal: run stdin"

# --- errors
printf 'local a = 1\nlocal b = = 2\n' >"$TMP/syntax.lua"
run syntax.lua
expect syntax_error '[ $rc -ne 0 ] && [[ $err == "kiln: syntax.lua:2:"* ]]' "non-zero exit and 'kiln: syntax.lua:2:'"
printf 'local function f()\n  local x = nil\n  return x.field\nend\nf()\n' >"$TMP/runtime.lua"
run runtime.lua
expect runtime_error '[ $rc -ne 0 ] && [[ $err == "kiln: runtime.lua:3: attempt to index"* ]] && [[ $err == *"stack traceback:"* ]] && [[ $err == *"runtime.lua:5: in main chunk"* ]]' \
  "non-zero exit, file:line and a traceback"
printf 'error(setmetatable({}, {__tostring = function() return "typed error" end}))\n' >"$TMP/obj.lua"
run obj.lua
expect error_object '[ $rc -ne 0 ] && [[ $err == "kiln: typed error"* ]] && [[ $err == *"stack traceback:"* ]]' \
  "an error object's __tostring is the message"
run missing.lua
expect missing_script '[ $rc -eq 2 ] && one_line && [[ $err == "kiln: cannot open missing.lua"* ]]' \
  "a missing script: status 2, one line naming the file"
run runtime.lua
expect script_bug_status '[ $rc -eq 1 ]' "a script's bug exits with status 1"

# --- usage errors raised by scripts (util.usage_error, kiln.configure): one line, status 2
printf 'require("kiln.util").usage_error("--width 100: must be a multiple of 8")\n' >"$TMP/usage.lua"
run usage.lua
expect usage_error '[ $rc -eq 2 ] && [ "$err" = "kiln: --width 100: must be a multiple of 8" ]' \
  "util.usage_error: one line, no traceback"
run -e 'error({kind = "usage", message = "plain table"})'
expect usage_table '[ $rc -eq 2 ] && [ "$err" = "kiln: plain table" ]' "a table with kind = usage is a usage error"
run -e 'kiln.configure{device = "warp9"}'
expect configure_usage '[ $rc -eq 2 ] && one_line && [[ $err == "kiln: device: unknown device"* ]]' \
  "kiln.configure names the bad field"
run -e 'kiln.configure{devcie = "cpu"}'
expect configure_unknown_field '[ $rc -eq 2 ] && one_line && [[ $err == *devcie*device* ]]' "a misspelt field lists the fields"
printf 'error({kind = "usage", message = "bad value"})\nprint("after")\n' >"$TMP/usage_repl.txt"
STDIN=$TMP/usage_repl.txt run -i
expect usage_in_repl '[ $rc -eq 0 ] && [ "$out" = after ] && [ "$err" = "bad value" ]' "the REPL reports a usage error and goes on"

# --- REPL through a pipe (no terminal: no banner, no prompts)
printf '1+1\nx = 20\nx + 1\nfor i = 1, 2 do\nprint("i" .. i)\nend\nerror("oops")\n"a", nil, 3\n=x\n' >"$TMP/repl.txt"
STDIN=$TMP/repl.txt run -i
want=$(printf '2\n21\ni1\ni2\na\tnil\t3\n20')
expect repl_pipe '[ $rc -eq 0 ] && [ "$out" = "$want" ] && [[ $err == *"stdin:1: oops"* ]]' \
  "expressions printed, statements run, multi-line statements continued, errors reported"
printf 'print(1\n' >"$TMP/eof.txt"
STDIN=$TMP/eof.txt run -i
expect repl_incomplete_at_eof '[ $rc -eq 0 ] && [ -z "$out" ] && [[ $err == *"stdin:1:"*"<eof>"* ]]' \
  "an unfinished statement at the end of input is reported as a syntax error"
printf 'x * 2\n' >"$TMP/x2.txt"
printf 'x = 21\n' >"$TMP/setx.lua"
STDIN=$TMP/x2.txt run -i setx.lua
expect repl_after_script '[ $rc -eq 0 ] && [ "$out" = 42 ]' "-i enters the REPL after the script"

# --- the REPL's result printer (kiln.repl)
cat >"$TMP/printer.txt" <<'EOF'
x = kiln.tensor({{1, 2}, {3, 4}})
x
x:table()
{a = 1, b = {"s"}}
t = {} t.t = t
t
kiln.randn({50, 50}, {seed = 1})
EOF
STDIN=$TMP/printer.txt run -i
want=$(printf 'tensor(f32, cpu, [2,2], 16 B)\n[[1, 2],\n [3, 4]]\n{{1.0, 2.0}, {3.0, 4.0}}\n{a = 1, b = {"s"}}\n{t = <cycle>}')
expect repl_printer '[ $rc -eq 0 ] && [[ $out == "$want"* ]] && [[ $out == *"..."* ]] && [[ $out == *"min "*", max "*", mean "* ]]' \
  "tensors with values, tables with contents, cycles marked, big tensors elided with statistics"

# --- runtime options go through kiln_config (kiln.configure)
run --device sim --vram 10M -e 'for i = 1, 40 do local t = kiln.zeros({1024, 1024}) end print(kiln.default_device(), kiln.mem.stats("sim").budget)'
expect pressure_gc '[ $rc -eq 0 ] && [ "$out" = "sim	10485760" ]' \
  "garbage tensors are collected under the budget (the pressure hook of the kiln program's state)"
run --quiet -e 'print(kiln.quiet())'
expect quiet_option '[ $rc -eq 0 ] && [ "$out" = true ]' "--quiet sets kiln.quiet()"
run -e 'print(kiln.quiet())'
expect not_quiet '[ $rc -eq 0 ] && [ "$out" = false ]' "without --quiet the program shows progress"
run --trace "$TMP/trace.json" -e 'local t = kiln.zeros({4}) print(kiln.trace.active())'
expect trace_option '[ $rc -eq 0 ] && [ "$out" = true ] && [ -s "$TMP/trace.json" ]' "--trace writes its file at exit"
run --trace /nonexistent-dir/trace.json -e 'print(1)'
expect trace_unwritable '[ $rc -eq 2 ] && one_line && [[ $err == "kiln: --trace: "* ]] && [ -z "$out" ]' "an unwritable --trace is a usage error"
run -W -e 'warn("careful")'
expect warnings_on '[ $rc -eq 0 ] && [[ $err == *"Lua warning: careful"* ]]' "-W turns Lua's warnings on"
run -e 'warn("careful")'
expect warnings_off '[ $rc -eq 0 ] && [ -z "$err" ]' "warnings are off by default, as lua5.4"

# stock lua5.4 with require "kiln": the same setup path and its own pressure hook
MODULE=$(dirname "$KILN")/lua/kiln.so
preload= # a sanitized module needs the sanitizers' runtimes loaded first in lua5.4
if [ "${SAN:-0}" = 1 ]; then
  for lib in libasan.so libubsan.so; do
    f=$(${CC:-cc} -print-file-name=$lib 2>/dev/null)
    [ -f "$f" ] && preload=${preload:+$preload:}$f
  done
fi
if [ -n "$LUA" ] && [ -f "$MODULE" ]; then
  out=$(cd "$TMP" && LD_PRELOAD=$preload ASAN_OPTIONS=${ASAN_OPTIONS:-}${ASAN_OPTIONS:+:}detect_leaks=0 \
    timeout 20 "$LUA" -e "package.cpath = '$(dirname "$MODULE")/?.so;' .. package.cpath
    local kiln = require 'kiln'
    kiln.configure{device = 'sim', budget = '10M'}
    for i = 1, 40 do local t = kiln.zeros({1024, 1024}) end
    print(kiln.default_device(), kiln.mem.stats('sim').budget, kiln.parse_size('1.5GiB'))" 2>&1 </dev/null)
  rc=$? err=
  expect stock_lua_configure '[ $rc -eq 0 ] && [ "$out" = "sim	10485760	1610612736" ]' \
    "kiln.configure and the pressure hook from stock lua5.4"
else
  skip stock_lua_configure "no lua5.4 or no $MODULE"
fi

# --- Ctrl-C: the running script stops with "interrupted!"
printf 'local f = io.open(arg[1], "w") f:close()\nwhile true do end\n' >"$TMP/loop.lua"
# --foreground: timeout then passes the SIGINT to kiln once; without it, it also
# signals its whole process group, kiln gets a second SIGINT, and a second Ctrl-C
# kills at once (as lua5.4 does) - before the message, when the two arrive together
timeout --foreground 20 "$KILN" loop.lua "$TMP/started" </dev/null >"$TMP/out" 2>"$TMP/err" &
pid=$!
for _ in $(seq 1 100); do [ -e "$TMP/started" ] && break; sleep 0.1; done
sleep 0.2
kill -INT $pid 2>/dev/null
wait $pid
rc=$?
err=$(cat "$TMP/err") out=
expect sigint '[ $rc -ne 0 ] && [ $rc -ne 124 ] && [[ $err == *"interrupted!"* ]]' "SIGINT stops the script with 'interrupted!'"

# --- embedded scripts and KILN_PATH
run -e 'print(#package.searchers)' -e 'print(package.searchers[2]("kiln.no_such_module"))'
expect searcher_installed '[ $rc -eq 0 ] && [[ $out == 5* ]] && [[ $out == *"no embedded script '"'"'kiln.no_such_module'"'"'"* ]]' \
  "kiln's searcher sits at package.searchers[2]"
mkdir -p "$TMP/dev/kiln"
printf 'return { answer = 42, name = ... }\n' >"$TMP/dev/kiln/cli_test_mod.lua"
KILN_PATH="$TMP/nowhere;$TMP/dev" run -e 'local m, where = require "kiln.cli_test_mod"; print(m.answer, m.name, where)'
expect kiln_path '[ $rc -eq 0 ] && [ "$out" = "42	kiln.cli_test_mod	$TMP/dev/kiln/cli_test_mod.lua" ]' "KILN_PATH loads kiln.xxx from disk"
KILN_PATH="$TMP/dev" run -E -e 'print(pcall(require, "kiln.cli_test_mod"))'
expect kiln_path_E '[ $rc -eq 0 ] && [[ $out == false* ]]' "-E ignores KILN_PATH"

# the first script of the source tree, if there is one: embedded outside the tree,
# from disk inside it (unless KILN_PATH is set, even empty)
first=$(cd "$REPO" && ls scripts/kiln/*.lua 2>/dev/null | head -n 1)
if [ -z "$first" ]; then
  skip embedded_script "no scripts/kiln/*.lua in $REPO"
  skip source_tree_script "no scripts/kiln/*.lua in $REPO"
else
  mod=${first#scripts/}
  mod=${mod%.lua}
  mod=${mod//\//.}
  probe="local f, where = package.searchers[2]('$mod') print(type(f), where)"
  run -e "$probe"
  expect embedded_script '[ $rc -eq 0 ] && [ "$out" = "function	embedded:$first" ]' "$mod served from the binary (a stale build? rebuild after adding scripts)"
  (cd "$REPO" && timeout 20 "$KILN" -e "$probe" >"$TMP/out" 2>"$TMP/err" </dev/null)
  rc=$? out=$(cat "$TMP/out") err=$(cat "$TMP/err")
  expect source_tree_script '[ $rc -eq 0 ] && [ "$out" = "function	scripts/${first#scripts/}" ]' "$mod read from disk in the source tree"
  (cd "$REPO" && KILN_PATH= timeout 20 "$KILN" -e "$probe" >"$TMP/out" 2>"$TMP/err" </dev/null)
  rc=$? out=$(cat "$TMP/out") err=$(cat "$TMP/err")
  expect source_tree_forced_embedded '[ $rc -eq 0 ] && [ "$out" = "function	embedded:$first" ]' "KILN_PATH= forces the embedded copy"
fi

summary
