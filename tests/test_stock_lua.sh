#!/usr/bin/env bash
# test_stock_lua.sh - every shipped script module from stock lua5.4: the built C
# module on package.cpath, the scripts embedded in it (KILN_PATH empty), no global
# `kiln` (only the kiln program sets one). Runs each public module's entry points,
# txt2img included on the bundled demo model. $1 = the kiln binary; the module is
# $(dirname $1)/lua/kiln.so. Prints PASS/FAIL/SKIP lines.
set -u
cd "$(dirname "$0")/.."
KILN=${1:-build/kiln}
BUILD=$(dirname "$KILN")
MOD=$BUILD/lua/kiln.so
LUA=$(command -v lua5.4 || true)

if [ -z "$LUA" ]; then echo "SKIP stock lua5.4: lua5.4 is not installed"; exit 0; fi
if [ ! -f "$MOD" ]; then echo "FAIL stock lua5.4: $MOD not built (make all builds it)"; exit 1; fi

# a sanitized module needs the sanitizers' runtimes loaded first in a plain host
if [ "${SAN:-0}" = 1 ]; then
  pre=
  for lib in libasan.so libubsan.so; do
    f=$(${CC:-cc} -print-file-name=$lib 2>/dev/null)
    if [ ! -f "$f" ]; then echo "SKIP stock lua5.4: SAN=1 and no $lib to preload"; exit 0; fi
    pre=${pre:+$pre:}$f
  done
  export LD_PRELOAD=$pre
  export ASAN_OPTIONS=${ASAN_OPTIONS:-}${ASAN_OPTIONS:+:}detect_leaks=0 # lua5.4 is not ours to check
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export KILN_PATH= KILN_TOKENIZER=
export KILN_OUT=$tmp

# the Lua side prints the PASS/FAIL/SKIP lines (tests/lua/harness.lua)
# every module of scripts/kiln: the embedded copies, which are the same files
mods=$(cd scripts/kiln && ls *.lua | sed 's/\.lua$//')
"$LUA" - "$MOD" $mods <<'EOF'
local mod = ...
local modules = { select(2, ...) }
package.cpath = mod:gsub("kiln%.so$", "?.so") .. ";" .. package.cpath
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local test = H.test
local globals = {}
for k in pairs(_G) do globals[k] = true end
globals.arg = true -- set below for kiln.cli, as lua5.4 sets it for a script
globals.lfs = true -- LuaFileSystem's luaopen_lfs sets it; kiln's modules define none

local kiln
test("require 'kiln' from stock lua5.4", function()
  H.truthy(rawget(_G, "kiln") == nil, "a global kiln before require")
  kiln = require "kiln"
  H.eq(type(kiln), "table")
  H.eq(type(kiln.version), "string")
  H.eq(package.loaded.kiln, kiln)
end)
if not kiln then H.done() end
kiln.set_quiet(true)

test(("every shipped script module loads (%d)"):format(#modules), function()
  H.truthy(#modules > 10, "scripts/kiln/*.lua not found")
  local bad = {}
  for _, m in ipairs(modules) do
    local ok, err = pcall(require, "kiln." .. m)
    if not ok then bad[#bad + 1] = ("kiln.%s: %s"):format(m, tostring(err)) end
  end
  if #bad > 0 then error(table.concat(bad, "\n"), 0) end
end)

test("kiln.sample.sigmas karras", function()
  local s = require "kiln".sample.sigmas("karras", 10, { sigma_min = 0.03, sigma_max = 14.6 })
  H.eq(s:numel(), 11)
  local t = s:table()
  H.near(t[1], 14.6, 1e-4)
  H.near(t[10], 0.03, 1e-6)
  H.eq(t[11], 0)
end)

test("kiln.sample.run with a tiny denoiser", function()
  local sigmas = kiln.sample.sigmas("exponential", 4, { sigma_min = 0.1, sigma_max = 10 })
  local x = kiln.randn({ 1, 2, 3, 3 }, { seed = 1 }) * 10
  local function denoise(xx, sigma) return xx * (1 / (1 + sigma * sigma)) end
  for _, name in ipairs(kiln.sample.names()) do
    local out = kiln.sample.run(name, denoise, x, sigmas, { seed = 2 })
    H.eq(table.concat(out.shape, ","), "1,2,3,3", name)
    H.truthy(out:abs():max() < 1e3, name .. " diverged")
  end
end)

test("kiln.sample registry", function()
  H.eq(kiln.sample.sampler_info("dpmpp_2m").label, "DPM++ 2M")
  H.eq(kiln.sample.sampler_info("euler_ancestral").noise, true)
  H.eq(kiln.sample.scheduler_info("karras").label, "Karras")
end)

test("kiln.util: parse_args and usage errors", function()
  local util = kiln.util
  local o = util.parse_args({ "--n", "3", "--flag" }, { n = 1, flag = false, s = "x" })
  H.eq(o.n, 3); H.eq(o.flag, true); H.eq(o.s, "x")
  local ok, err = pcall(util.parse_args, { "--nope" }, { n = 1 })
  H.truthy(not ok and util.is_usage_error(err), "unknown option is a usage error")
  H.truthy(tostring(err):find("unknown option '--nope'", 1, true), tostring(err))
  H.truthy(util.is_oom({ kind = "oom" }) and not util.is_oom("oom"))
end)

test("kiln.cli: parse, usage, sizes", function()
  local cli = kiln.cli
  arg = { [0] = "examples/txt2img.lua" }
  local o = cli.parse({ "--steps", "2", "--seed", "3", "--quiet" })
  H.eq(o.steps, 2); H.eq(o.seed, 3); H.eq(o.device, kiln.default_device())
  H.truthy(o.model:find("kiln%-shapes"), o.model)
  H.truthy(cli.usage({ steps = 20 }):find("--steps", 1, true))
  H.eq(cli.parse_size("6G"), 6 * 1024 ^ 3)
  local ok, err = pcall(cli.parse, { "--width", "100", "--model", "no/such.safetensors" })
  H.truthy(not ok and kiln.util.is_usage_error(err), tostring(err))
end)

test("kiln.progress", function()
  local bar = require("kiln.progress").start("test", 2)
  bar:step(1); bar:step(2) -- quiet: no output; reaches kiln.progress for a host
end)

local MODEL = "examples/models/kiln-shapes.safetensors"
if not io.open(MODEL, "rb") then
  test("the demo model", function() H.skip(MODEL .. " is missing") end)
  H.done()
end

test("kiln.checkpoint and kiln.pipeline: load_checkpoint, 2-step txt2img", function()
  local ckpt <close> = kiln.load_checkpoint(MODEL)
  H.eq(ckpt.family, "sd1")
  H.eq(require("kiln.checkpoint").load, kiln.load_checkpoint)
  local size = 32
  H.eq(size % kiln.pipeline.size_multiple(ckpt), 0)
  local o = { prompt = "a red circle", steps = 2, seed = 1, width = size, height = size,
    sampler = "dpmpp_2m", scheduler = "karras" }
  local img <close> = kiln.pipeline.txt2img(ckpt, o)
  H.eq(table.concat(img.shape, ","), "1,3," .. size .. "," .. size)
  H.truthy(img:min() >= 0 and img:max() <= 1)
  local p = kiln.pipeline.parameters(o, ckpt)
  H.truthy(p:find("Sampler: DPM++ 2M, Schedule type: Karras", 1, true), p)
  local out = os.getenv("KILN_OUT") .. "/stock.png"
  kiln.pipeline.save(img, out, o, ckpt)
  local back <close> = kiln.load_png(out)
  H.eq(back.shape[4], size)
end)

test("no module defined a global", function()
  local new = {}
  for k in pairs(_G) do if not globals[k] then new[#new + 1] = tostring(k) end end
  H.eq(table.concat(new, ", "), "", "new globals")
end)

H.done()
EOF
