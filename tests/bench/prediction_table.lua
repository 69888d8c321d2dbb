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
--   build/kiln tests/bench/prediction_table.lua [--repeat N] [--only NAME,...] [--budget MIB]
package.path = "tests/lua/?.lua;" .. package.path
local kiln = require "kiln"
local util = require "kiln.util"
local P = require "prediction"

local opts = util.parse_args(arg or {}, { ["repeat"] = 3, only = "", budget = 32 })
kiln.set_quiet(true)
local only = {}
for w in opts.only:gmatch("[^,]+") do only[w] = true end

local rows = P.table({ ["repeat"] = math.max(1, math.floor(opts["repeat"])), budget = math.floor(opts.budget * P.MiB),
  only = next(only) and only or nil, progress = function(r) print(P.format_row(r)) end })
print()
print(P.format(rows))
P.cleanup()
