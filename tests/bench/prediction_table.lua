-- tests/bench/prediction_table.lua - the meta device's prediction against the real run,
-- pipeline by pipeline: each pipeline of the test suite (txt2img, img2img, hires fix,
-- inpaint, an upscale model, a ControlNet, ComfyUI graphs) on the demo model (the
-- ControlNet on the tiny SD 1.x checkpoint) at 64x64, 2 steps, on sim with a budget,
-- in modes high, normal and low: the dry run (kiln.dry_run modelling sim, same budget
-- and mode) then the real run, as a user runs them (the collector running, prefetches
-- on the copy thread), repeated; prints pipeline, mode, predicted, measured (the
-- highest of the repeats) and the ratio. The target: measured <= predicted <= 1.03 x
-- measured on every row.
--
-- --sd15 PATH adds the SD 1.5 piece (tests/lua/prediction.lua's sd15_case: two prompts
-- encoded, one step with CFG, a tiled decode) on that SD 1.5-shaped checkpoint
-- (bench_sd.lua writes one) at --sd15_size px, in low mode (--sd15_low MiB budget) and
-- normal mode (--sd15_normal MiB); --only sd15 runs those rows alone. Over 4 GiB of
-- RAM: run it under the bigmem lock.
--
--   build/kiln tests/bench/prediction_table.lua [--repeat N] [--only NAME,...] [--budget MIB]
--     [--sd15 PATH [--sd15_size PX] [--sd15_low MIB] [--sd15_normal MIB]]
package.path = "tests/lua/?.lua;" .. package.path
local kiln = require "kiln"
local util = require "kiln.util"
local P = require "prediction"

local opts = util.parse_args(arg or {}, { ["repeat"] = 3, only = "", budget = 32, sd15 = "", sd15_size = 256,
  sd15_low = 512, sd15_normal = 2560 })
kiln.set_quiet(true)
local only = {}
for w in opts.only:gmatch("[^,]+") do only[w] = true end

local reps = math.max(1, math.floor(opts["repeat"]))
local rows = {}
local sd15_only = only.sd15 and true
only.sd15 = nil
if not (sd15_only and not next(only)) then
  rows = P.table({ ["repeat"] = reps, budget = math.floor(opts.budget * P.MiB), only = next(only) and only or nil,
    progress = function(r) print(P.format_row(r)) end })
end
if opts.sd15 ~= "" then
  local case = P.sd15_case(opts.sd15, math.floor(opts.sd15_size))
  for _, mb in ipairs({ { "low", opts.sd15_low }, { "normal", opts.sd15_normal } }) do
    local r = P.row(case, mb[1], math.floor(mb[2] * P.MiB), reps)
    rows[#rows + 1] = r
    print(P.format_row(r))
  end
end
print()
print(P.format(rows))
P.cleanup()
