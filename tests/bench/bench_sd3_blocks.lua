-- tests/bench/bench_sd3_blocks.lua - one SD 3.5 joint block at full width in kiln (bf16
-- arithmetic, bf16 weights resident) against PyTorch f32 on the same weights
-- (tests/bench/torch_sd3_blocks.py, which runs Stability AI's own JointBlock, started by
-- this script after kiln's runs), the machine's bf16 GEMM rate measured in the same run,
-- and where kiln's time goes: every kiln.nn call, tensor operator and copy the block
-- makes, timed and summed by kind (linear products by their weight's shape).
--
--   build/kiln tests/bench/bench_sd3_blocks.lua [--variant large|medium] [--img 4096]
--       [--txt 333] [--repeat 3] [--threads 2] [--dir /tmp/sd3bench] [--ref DIR]
--       [--no-torch] [--no-ops]
--
-- The weights (two blocks of the variant's widths, bf16; block 0 is timed, it is neither
-- pre_only nor, on Large, MMDiT-X) are written by tests/bench/sd3_weights.lua into DIR
-- when missing. --block N times another block (Medium's 0-12 have the second attention).
-- --ref: Stability AI's sd3.5 code extracted outside the tree (default /tmp/sd3.5-ref;
-- `git --git-dir=<mirror of Stability-AI/sd3.5> archive fbf8f48 | tar -x -C /tmp/sd3.5-ref`).
-- Timing to report: under flock /tmp/kiln-bench.lock.
local kiln = require "kiln"
local util = require "kiln.util"
local fw = dofile("tests/bench/flux_weights.lua")
local sw = dofile("tests/bench/sd3_weights.lua")

local o = util.parse_args(arg or {}, { variant = "large", img = 4096, txt = 333, ["repeat"] = 3, threads = 2,
  dir = "/tmp/sd3bench", ref = "/tmp/sd3.5-ref", block = 0, no_torch = false, no_ops = false })
local fmt = string.format
local ps = dofile("tests/bench/proc_stats.lua")
local say, loadavg = ps.say, ps.loadavg

kiln.set_quiet(true)
kiln.set_threads(o.threads)
kiln.precision("bf16")
os.execute("mkdir -p '" .. o.dir .. "'")
local path = fmt("%s/sd3-%s-blocks-bf16.safetensors", o.dir, o.variant)
local f = io.open(path, "rb")
if f then f:close() else
  local bytes, s = sw.write("bf16", path, sw.config(o.variant, math.max(2, o.block + 2)))
  say("wrote %s: %.2f GB in %.1f s", path, bytes / 1e9, s)
end

local best_of = ps.best_of

-- ---------------------------------------------------------------- kiln's block

local ck <close> = kiln.load_checkpoint(path)
local dit = ck.dit
dit:load("cpu")
local cfg = dit.config
local H, L = cfg.hidden, o.img + o.txt
local rate, g = fw.gemm_rate(L, 5, H)
say("bf16 GEMM [%d, %d] x [%d, %d]: best %.1f ms = %.1f GFLOP/s (%d threads; load %s)", L, H, H, H, g * 1e3,
  rate / 1e9, kiln.threads(), loadavg())

local dt = "bf16"
local x = kiln.randn({ 1, o.img, H }, { seed = 3 }):to(dt)
local ctx = kiln.randn({ 1, o.txt, H }, { seed = 4 }):to(dt)
local c = kiln.randn({ 1, H }, { seed = 5 }):to(dt)
local cs = kiln.nn.silu(c)
local function block()
  local a, b = dit:_joint(o.block, ctx, x, cs)
  if a then a:free() end
  b:free()
end
local la = loadavg()
local kb, km = best_of(o["repeat"], block)
local _, joint = sw.step_flops(cfg, o.img, o.txt)
if cfg.x_self_attn[o.block] then joint = joint + 2 * o.img * 4 * H * H + 4 * o.img * o.img * H + 2 * 3 * H * H end
say("kiln bf16 %s joint block %d: best %.3f s, median %.3f s (%d image + %d context tokens, %d runs; load %s " ..
  "before, %s after)", o.variant, o.block, kb, km, o.img, o.txt, o["repeat"], la, loadavg())
say("FLOPs: %.3f T = %.2f s at the GEMM rate: kiln x%.2f of it", joint / 1e12, joint / rate, kb / (joint / rate))

-- ---------------------------------------------------------------- where the time goes

-- Every kiln.nn function, kiln.cat and the tensor operators and copying methods are
-- wrapped by a timer for one more run; only the outermost call is counted, so time spent
-- inside a wrapped call is not counted twice.
if not o.no_ops then
  local acc, order = {}, {}
  local depth = 0
  local function wrap(label, fn)
    return function(...)
      if depth > 0 then return fn(...) end
      depth = 1
      local t0 = kiln.time()
      local r = table.pack(fn(...))
      local s = kiln.time() - t0
      depth = 0
      local key = type(label) == "function" and label(...) or label
      local e = acc[key]
      if not e then e = { 0, 0 }; acc[key] = e; order[#order + 1] = key end
      e[1], e[2] = e[1] + s, e[2] + 1
      return table.unpack(r, 1, r.n)
    end
  end
  local saved_nn, saved_mt, saved_m = {}, {}, {}
  for name, fn in pairs(kiln.nn) do
    if type(fn) == "function" then
      saved_nn[name] = fn
      if name == "linear" then
        kiln.nn[name] = wrap(function(xx, w)
          return fmt("linear [%s] x [%d, %d]", table.concat(xx.shape, ", "), w.shape[1], w.shape[2])
        end, fn)
      elseif name == "attention" then
        kiln.nn[name] = wrap(function(q, k)
          return fmt("attention q [%s] k [%s]", table.concat(q.shape, ", "), table.concat(k.shape, ", "))
        end, fn)
      else
        kiln.nn[name] = wrap("nn." .. name, fn)
      end
    end
  end
  local saved_cat = kiln.cat
  kiln.cat = wrap("cat", saved_cat)
  local mt = getmetatable(x)
  for _, op in ipairs({ "__add", "__sub", "__mul", "__div", "__pow", "__unm" }) do
    saved_mt[op] = mt[op]
    mt[op] = wrap("elementwise " .. op:sub(3), mt[op])
  end
  for _, m in ipairs({ "contiguous", "mean", "sqrt", "to", "clone" }) do
    saved_m[m] = mt.__methods[m]
    mt.__methods[m] = wrap(m == "contiguous" and "contiguous (copies)" or m, mt.__methods[m])
  end
  collectgarbage(); collectgarbage()
  local t0 = kiln.time()
  block()
  local total = kiln.time() - t0
  for name, fn in pairs(saved_nn) do kiln.nn[name] = fn end
  kiln.cat = saved_cat
  for op, fn in pairs(saved_mt) do mt[op] = fn end
  for m, fn in pairs(saved_m) do mt.__methods[m] = fn end
  table.sort(order, function(a, b) return acc[a][1] > acc[b][1] end)
  local sum = 0
  say("where kiln's time goes (one timed run: %.3f s; load %s):", total, loadavg())
  for _, key in ipairs(order) do
    local e = acc[key]
    sum = sum + e[1]
    say("  %7.3f s %5.1f %%  %3d x  %s", e[1], 100 * e[1] / total, e[2], key)
  end
  say("  %7.3f s %5.1f %%        the rest (Lua, views, frees)", total - sum, 100 * (total - sum) / total)
end
x:free(); ctx:free(); c:free(); cs:free()
dit:unload()

-- ---------------------------------------------------------------- PyTorch

if not o.no_torch then
  local cmd = fmt("/usr/bin/python3 tests/bench/torch_sd3_blocks.py %s --ref %s --block %d --img %d --txt %d " ..
    "--repeat %d --threads %d", path, o.ref, o.block, o.img, o.txt, o["repeat"], o.threads)
  say("$ %s   (load %s)", cmd, loadavg())
  local p = assert(io.popen(cmd))
  local out = p:read("a")
  p:close()
  io.write(out)
  local tb = tonumber(out:match("joint block %d+: best ([%d.]+)"))
  if tb then
    say("kiln bf16 / torch f32 (best): joint block x%.3f (load %s)", kb / tb, loadavg())
  else
    say("no PyTorch time: see its output above")
  end
end
