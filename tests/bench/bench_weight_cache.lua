-- tests/bench/bench_weight_cache.lua - what the CPU's caches of weights in bf16's product
-- form (the linear layers' pair slivers, the few-tiles Winograd U: README, "Weights kept
-- in the products' form") buy: one SD 1.5-shaped UNet evaluation (bench_sd.lua's random
-- f16 file) in f32 and in bf16, alternating, first with the caches off
-- (kiln.mem.set_weight_cache_limit("cpu", 0)), then with the default limit; the median of
-- the repeats' bf16 / f32 ratios and the best times of each phase, the bytes the caches
-- hold and the outputs' agreement (the caches change no bit).
--
--   build/kiln tests/bench/bench_weight_cache.lua WEIGHTS [--size 64] [--batch 1] [--repeat 5]
--       [--txt2img STEPS]
-- --txt2img: instead, a bf16 txt2img at 8x the size (CFG 7, euler), caches off then on, each
-- with its seconds per step (the first with the text encoder and the caches' filling).
local kiln = require "kiln"
local util = require "kiln.util"

local weights = assert(arg[1], "usage: bench_weight_cache.lua WEIGHTS [--size S] [--batch B] [--repeat N]")
local opts = util.parse_args({ table.unpack(arg, 2) }, { size = 64, batch = 1, ["repeat"] = 5, txt2img = 0 })
kiln.set_quiet(true)
local S, B = opts.size, opts.batch

local ck <close> = kiln.load_checkpoint(weights)
local x = kiln.randn({ B, 4, S, S }, { seed = 11 })
local t = kiln.full({ B }, 500)
local ctx = kiln.randn({ B, 77, 768 }, { seed = 12 })
local default_limit = kiln.mem.stats("cpu").weight_cache_limit

local function median(v)
  local s = { table.unpack(v) }
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) // 2] or (s[n // 2] + s[n // 2 + 1]) / 2
end

local function eval(prec)
  kiln.precision(prec)
  collectgarbage(); collectgarbage()
  local t0 = kiln.time()
  local out = ck.unet:forward(x, t, ctx):to("f32")
  return kiln.time() - t0, out
end

local outs = {}
local function phase(label, limit)
  kiln.mem.set_weight_cache_limit("cpu", limit)
  eval("f32")
  local _, warm = eval("bf16") -- fills the caches where they are on
  warm:free()
  local best, ratios = { f32 = math.huge, bf16 = math.huge }, {}
  for _ = 1, opts["repeat"] do
    local sf, of = eval("f32")
    local sb, ob = eval("bf16")
    best.f32, best.bf16 = math.min(best.f32, sf), math.min(best.bf16, sb)
    ratios[#ratios + 1] = sb / sf
    of:free()
    if outs[label] then outs[label]:free() end
    outs[label] = ob
  end
  local held = kiln.mem.stats("cpu").weight_caches
  io.write(string.format("%-22s unet %dx%d batch %d: f32 best %.3f s, bf16 best %.3f s (x%.3f); median of %d ratios x%.3f; caches hold %.1f MiB\n",
    label, S, S, B, best.f32, best.bf16, best.bf16 / best.f32, #ratios, median(ratios), held / 2 ^ 20))
  return best.bf16, median(ratios)
end

io.write(string.format("# bench_weight_cache: %d threads, load average %s\n", kiln.threads(),
  (io.open("/proc/loadavg") and io.open("/proc/loadavg"):read("l") or "?")))
if opts.txt2img > 0 then
  local pipeline = require "kiln.pipeline"
  kiln.precision("bf16")
  local total = {}
  for _, phase in ipairs({ { "caches off", 0 }, { "caches on", default_limit } }) do
    kiln.mem.set_weight_cache_limit("cpu", phase[2])
    collectgarbage(); collectgarbage()
    local steps, last = {}, kiln.time()
    local o = { prompt = "a photograph of an astronaut riding a horse", seed = 1, steps = opts.txt2img, cfg = 7,
      sampler = "euler", scheduler = "normal", width = 8 * S, height = 8 * S,
      callback = function() local now = kiln.time(); steps[#steps + 1] = now - last; last = now end }
    kiln.mem.reset_peak("cpu")
    local t0 = kiln.time()
    local img = pipeline.txt2img(ck, o)
    total[phase[1]] = kiln.time() - t0
    local rest = { table.unpack(steps, 2) }
    io.write(string.format("txt2img %dx%d %d steps, bf16, %-10s %.1f s; first step %.2f s, the others median %.2f s; peak %.0f MiB\n",
      8 * S, 8 * S, opts.txt2img, phase[1] .. ":", total[phase[1]], steps[1], median(rest), kiln.mem.stats("cpu").peak / 2 ^ 20))
    img:free()
  end
  io.write(string.format("caches on against off: txt2img x%.3f\n", total["caches on"] / total["caches off"]))
  kiln.mem.set_weight_cache_limit("cpu", default_limit)
  x:free(); t:free(); ctx:free()
  kiln.precision("auto")
  return
end
local off_s, off_r = phase("bf16, caches off", 0)
local on_s, on_r = phase("bf16, caches on", default_limit)
io.write(string.format("caches on against off: bf16 evaluation x%.3f (best times), ratio to f32 x%.3f -> x%.3f (medians)\n",
  on_s / off_s, off_r, on_r))
local same = (outs["bf16, caches on"] - outs["bf16, caches off"]):abs():max()
io.write(string.format("outputs with and without the caches: max |difference| %.3g (the same bits: %s)\n", same,
  same == 0 and "yes" or "NO"))
for _, o in pairs(outs) do o:free() end
x:free(); t:free(); ctx:free()
kiln.precision("auto")
