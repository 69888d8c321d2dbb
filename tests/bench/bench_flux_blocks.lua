-- tests/bench/bench_flux_blocks.lua - one Flux.1 double-stream block and one single-stream
-- block at full width in kiln (bf16 arithmetic, bf16 weights resident) against PyTorch f32
-- on the same weights (tests/bench/torch_flux_blocks.py, run by this script after kiln's
-- runs), and the machine's bf16 GEMM rate measured in the same run (a [tokens, 3072] x
-- [3072, 3072] product), from which a whole step's arithmetic time is estimated.
--
--   build/kiln tests/bench/bench_flux_blocks.lua [--img 1024] [--txt 512] [--repeat 3]
--       [--threads 2] [--dir /tmp/fluxbench] [--no-torch] [--step-seconds S] [--int8]
--
-- The weights (one double + one single block, bf16, 1.1 GB) are written by
-- tests/bench/flux_weights.lua into DIR when missing. --step-seconds: a measured step
-- time (bench_flux_step.lua) to set against the step's FLOPs / the GEMM rate. --int8: the
-- same blocks under kiln.precision("int8") too (W8A8 products, the weights packed once
-- and kept with the model), runs alternating with bf16's, with each one's output
-- error against kiln's f32 blocks.
-- Timing to report: under flock /tmp/kiln-bench.lock.
local kiln = require "kiln"
local util = require "kiln.util"
local flux = require "kiln.flux"
local fw = dofile("tests/bench/flux_weights.lua")

local o = util.parse_args(arg or {}, { img = 1024, txt = 512, ["repeat"] = 3, threads = 2, dir = "/tmp/fluxbench",
  no_torch = false, step_seconds = 0, int8 = false })
local fmt = string.format
local ps = dofile("tests/bench/proc_stats.lua")
local say, loadavg = ps.say, ps.loadavg

kiln.set_quiet(true)
kiln.set_threads(o.threads)
kiln.precision("bf16")
os.execute("mkdir -p '" .. o.dir .. "'")
local path = o.dir .. "/flux-blocks-bf16.safetensors"
local f = io.open(path, "rb")
if f then f:close() else
  local bytes, s = fw.write("bf16", path, fw.config(1, 1))
  say("wrote %s: %.2f GB in %.1f s", path, bytes / 1e9, s)
end

local best_of = ps.best_of

-- ---------------------------------------------------------------- the GEMM rate

local H = 3072
local L = o.img + o.txt
local rate, g = fw.gemm_rate(L, 5)
say("bf16 GEMM [%d, %d] x [%d, %d]: best %.1f ms = %.1f GFLOP/s (%d threads; load %s)", L, H, H, H, g * 1e3,
  rate / 1e9, kiln.threads(), loadavg())

-- ---------------------------------------------------------------- kiln's blocks

local ck <close> = kiln.load_checkpoint(path, { variant = "dev" })
local dit = ck.dit
dit:load("cpu")
local cfg = dit.config
local side = math.floor(math.sqrt(o.img) + 0.5)
local dt = "bf16"
local img = kiln.randn({ 1, o.img, H }, { seed = 3 }):to(dt)
local txt = kiln.randn({ 1, o.txt, H }, { seed = 4 }):to(dt)
local vs = kiln.randn({ 1, H }, { seed = 5 }):to(dt)
local cos, sin = flux.rope_tables(flux.position_ids(o.txt, side, o.img // side), cfg.axes_dim, cfg.theta, "cpu", dt)
local xs = kiln.cat({ txt, img }, 2)
local la = loadavg()
local db, dm = best_of(o["repeat"], function()
  local a, b = dit:_double("double_blocks.0.", img, txt, vs, cos, sin)
  a:free(); b:free()
end)
local sb, sm = best_of(o["repeat"], function() dit:_single("single_blocks.0.", xs, vs, cos, sin):free() end)
say("kiln bf16 double block: best %.3f s, median %.3f s; single block: best %.3f s, median %.3f s " ..
  "(%d image + %d text tokens, %d runs; load %s before, %s after)", db, dm, sb, sm, o.img, o.txt, o["repeat"], la,
  loadavg())

if o.int8 then
  -- alternating bf16 / int8 runs (a shared machine's speed drifts), then each one's
  -- error against f32: max |out - out_f32| / max |out_f32| over both streams' outputs
  local I = { img = img, txt = txt, vs = vs, cos = cos, sin = sin, xs = xs }
  local function double() return dit:_double("double_blocks.0.", I.img, I.txt, I.vs, I.cos, I.sin) end
  local function single() return dit:_single("single_blocks.0.", I.xs, I.vs, I.cos, I.sin) end
  local mem_before = kiln.mem.stats("cpu").allocated
  local best = { bf16 = { math.huge, math.huge }, int8 = { math.huge, math.huge } }
  -- each round's bf16 / int8 time, double and single block, wall and process CPU time
  -- (os.clock: on a machine shared with other work the CPU time is the steadier)
  local last, ratios, cpu_ratios = {}, { {}, {} }, { {}, {} }
  for r = 0, o["repeat"] do -- round 0: untimed (int8 packs the weights there, once)
    for _, p in ipairs({ "bf16", "int8" }) do
      kiln.with_precision(p, function()
        collectgarbage(); collectgarbage()
        local t0, c0 = kiln.time(), os.clock()
        local a, b = double()
        local t1, c1 = kiln.time(), os.clock()
        a:free(); b:free()
        local c = single()
        local t2, c2 = kiln.time(), os.clock()
        c:free()
        if r > 0 then
          best[p][1] = math.min(best[p][1], t1 - t0)
          best[p][2] = math.min(best[p][2], t2 - t1)
          if p == "bf16" then last = { t1 - t0, t2 - t1, c1 - c0, c2 - c1 }
          else
            ratios[1][#ratios[1] + 1] = last[1] / (t1 - t0)
            ratios[2][#ratios[2] + 1] = last[2] / (t2 - t1)
            cpu_ratios[1][#cpu_ratios[1] + 1] = last[3] / (c1 - c0)
            cpu_ratios[2][#cpu_ratios[2] + 1] = last[4] / (c2 - c1)
          end
        end
      end)
    end
  end
  local function outputs(p)
    return kiln.with_precision(p, function()
      local a, b = double()
      local c = single()
      local r = { a:to("f32"), b:to("f32"), c:to("f32") }
      a:free(); b:free(); c:free()
      return r
    end)
  end
  -- the reference from the same (bf16) values held in f32, computed in f32 throughout
  local keep = I
  I = {}
  for k, v in pairs(keep) do I[k] = v:to("f32") end
  local ref = outputs("f32")
  for _, v in pairs(I) do v:free() end
  I = keep
  local function err(p)
    local out, e = outputs(p), {}
    for i = 1, 3 do
      local d = (out[i] - ref[i]):abs():max() / ref[i]:abs():max()
      e[i] = d
      out[i]:free()
    end
    return math.max(e[1], e[2]), e[3]
  end
  local eb_d, eb_s = err("bf16")
  local ei_d, ei_s = err("int8")
  for i = 1, 3 do ref[i]:free() end
  local function median(t) table.sort(t); return t[(#t + 1) // 2] end
  say("kiln int8 double block: best %.3f s (bf16 %.3f s: int8 x%.2f faster, median of the rounds' ratios x%.2f; " ..
    "error vs f32 %.1e, bf16 %.1e); single block: best %.3f s (bf16 %.3f s: x%.2f, median x%.2f; error %.1e, " ..
    "bf16 %.1e) (%d alternating runs; load %s)",
    best.int8[1], best.bf16[1], best.bf16[1] / best.int8[1], median(ratios[1]), ei_d, eb_d, best.int8[2],
    best.bf16[2], best.bf16[2] / best.int8[2], median(ratios[2]), ei_s, eb_s, o["repeat"], loadavg())
  say("  process CPU time, median of the rounds' bf16 / int8 ratios: double block x%.2f, single block x%.2f",
    median(cpu_ratios[1]), median(cpu_ratios[2]))
  say("  cpu memory allocated: %.2f GB before the int8 runs, %.2f GB after (the packed int8 weights kept with " ..
    "the model)", mem_before / 1e9, kiln.mem.stats("cpu").allocated / 1e9)
end

local step, dbl, sgl = fw.step_flops(cfg, o.img, o.txt)
step = step - dbl - sgl + 19 * dbl + 38 * sgl -- the file has one block of each: count [dev]'s 19 + 38
step = step - 2 * 15 * H * H + 2 * (12 * 19 + 3 * 38) * H * H
say("FLOPs: double block %.3f T (%.1f s at the GEMM rate: kiln x%.2f of it), single block %.3f T (%.1f s: x%.2f)",
  dbl / 1e12, dbl / rate, db / (dbl / rate), sgl / 1e12, sgl / rate, sb / (sgl / rate))
say("a [dev] step (19 double + 38 single blocks, %d tokens): %.2f TFLOP = %.1f s at the GEMM rate", L, step / 1e12,
  step / rate)
if o.step_seconds > 0 then
  say("  measured step %.1f s = x%.2f of FLOPs / rate", o.step_seconds, o.step_seconds / (step / rate))
end
img:free(); txt:free(); vs:free(); cos:free(); sin:free(); xs:free()
dit:unload()
if o.int8 then
  collectgarbage(); collectgarbage() -- the weight views the blocks took
  say("  after dit:unload(): %.2f GB allocated", kiln.mem.stats("cpu").allocated / 1e9)
end

if not o.no_torch then
  local cmd = fmt("/usr/bin/python3 tests/bench/torch_flux_blocks.py %s --img %d --txt %d --repeat %d --threads %d",
    path, o.img, o.txt, o["repeat"], o.threads)
  say("$ %s   (load %s)", cmd, loadavg())
  local p = assert(io.popen(cmd))
  local out = p:read("a")
  p:close()
  io.write(out)
  local td = tonumber(out:match("double block: best ([%d.]+)"))
  local ts = tonumber(out:match("single block: best ([%d.]+)"))
  if td and ts then
    say("kiln bf16 / torch f32 (best): double block x%.3f, single block x%.3f (load %s)", db / td, sb / ts, loadavg())
  end
end
