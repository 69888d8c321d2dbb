-- tests/bench/bf16_error.lua - where kiln's bf16 loses accuracy against f32 on the SD 1.5
-- UNet (random f16 weights, bench_sd.lua's file): one evaluation in f32 and in bf16, the
-- error as max |bf16 - f32| / max |f32|, and the same for each class of operation left
-- in bf16 alone (the others forced to f32 through KILN_* tunables set by the caller, see
-- tests/bench/bf16_error.sh). PyTorch's mixed precision on the same weights and input
-- (tests/bench/torch_bf16_error.py) gives the yardstick.
--
--   build/kiln tests/bench/bf16_error.lua WEIGHTS [--size 64] [--out PATH] [--label L]
--       [--repeat N] [--threads N]
-- --repeat: N evaluations in each precision, alternating (after one warm-up of each):
-- the best time of each and the median of the repeats' bf16 / f32 ratios.
local kiln = require "kiln"
local util = require "kiln.util"

local weights = assert(arg[1], "usage: bf16_error.lua WEIGHTS [--size S] [--out PATH]")
local opts = util.parse_args({ table.unpack(arg, 2) }, { size = 64, out = "", label = "kiln", threads = 0, ["repeat"] = 0 })
if opts.threads > 0 then kiln.set_threads(opts.threads) end
kiln.set_quiet(true)
local S = opts.size

local ck <close> = kiln.load_checkpoint(weights)
local x = kiln.randn({ 1, 4, S, S }, { seed = 11 })
local t = kiln.full({ 1 }, 500)
local ctx = kiln.randn({ 1, 77, 768 }, { seed = 12 })

local outs, secs, ratios = {}, {}, {}
for r = 0, opts["repeat"] do
  local last = {}
  for _, p in ipairs({ "f32", "bf16" }) do
    kiln.precision(p)
    if outs[p] then outs[p]:free() end
    collectgarbage(); collectgarbage()
    local t0 = kiln.time()
    outs[p] = ck.unet:forward(x, t, ctx):to("f32")
    last[p] = kiln.time() - t0
    if r > 0 or opts["repeat"] == 0 then secs[p] = math.min(secs[p] or math.huge, last[p]) end
  end
  if r > 0 then ratios[#ratios + 1] = last.bf16 / last.f32 end
end
kiln.precision("auto")
if #ratios > 0 then
  table.sort(ratios)
  local n = #ratios
  local median = n % 2 == 1 and ratios[(n + 1) // 2] or (ratios[n // 2] + ratios[n // 2 + 1]) / 2
  io.write(string.format("%s: unet %dx%d best f32 %.3f s, bf16 %.3f s: x%.3f (median of %d ratios x%.3f)\n",
    opts.label, S, S, secs.f32, secs.bf16, secs.bf16 / secs.f32, n, median))
end
local d = (outs.bf16 - outs.f32):abs():max()
local err = d / outs.f32:abs():max()
io.write(string.format("%s: unet %dx%d bf16 vs f32: max abs %.3e / max |f32| %.3e = %.3e (f32 %.2f s, bf16 %.2f s)\n",
  opts.label, S, S, d, outs.f32:abs():max(), err, secs.f32, secs.bf16))
if opts.out ~= "" then kiln.save_safetensors(opts.out, { f32 = outs.f32, bf16 = outs.bf16 }) end
