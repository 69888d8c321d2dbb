-- The meta device never under-predicts: each pipeline of the test suite (txt2img, a
-- tiled decode, img2img, inpaint, hires fix, an upscale model, a ControlNet, ComfyUI
-- graphs node by node) on sim in modes high, normal and low under a budget, dry-run
-- (kiln.dry_run) and then run as a user runs it: the collector running, prefetches on
-- the copy thread. measured <= predicted <= 1.03 x measured, for the whole run and for
-- each ComfyUI node (tests/lua/prediction.lua; tests/bench/prediction_table.lua prints it).
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, truthy = H.test, H.truthy

H.demo_model("prediction table")
H.need_devices("prediction table", "sim", "meta")
kiln.set_quiet(true)
local P = require "prediction"

local function check(r)
  print("# " .. P.format_row(r):gsub("\n", "\n# "))
  truthy(r.predicted >= r.measured, ("%s (%s, budget %d): predicted %d < measured %d bytes"):format(r.name, r.mode,
    r.budget, r.predicted, r.measured))
  truthy(r.predicted <= 1.03 * r.measured, ("%s (%s): predicted %d > 1.03 x measured %d bytes"):format(r.name,
    r.mode, r.predicted, r.measured))
  -- the kernels' host scratch, outside sim's allocator: the dry run's bound holds
  truthy(r.scratch_measured > 0 and r.scratch_predicted >= r.scratch_measured,
    ("%s (%s): kernel scratch predicted %d < measured %d bytes"):format(r.name, r.mode, r.scratch_predicted,
      r.scratch_measured))
  for _, n in ipairs(r.nodes or {}) do
    truthy(n.predicted >= n.measured and n.predicted <= 1.03 * n.measured,
      ("%s (%s): node %s %s predicted %d, measured %d bytes"):format(r.name, r.mode, n.id, n.class_type, n.predicted,
        n.measured))
  end
end

test("every pipeline, modes high / normal / low, 32 MiB budget: measured <= predicted <= 1.03 x measured", function()
  P.table({ budget = 32 * P.MiB, progress = check })
end)

-- budgets that make the runs evict (normal) and stream inside a few MiB (low)
test("tight budgets: eviction and streaming decisions predicted as they fall", function()
  P.table({ budget = 11 * P.MiB, modes = { "normal" }, only = { ["hires fix"] = true, ["comfy hires"] = true },
    progress = check })
  P.table({ budget = 9 * P.MiB, modes = { "low" }, only = { ["hires fix"] = true, ["txt2img 128 tiled"] = true,
    controlnet = true }, progress = check })
end)

-- precisions int8 and bf16 keep each weight's form for their products (int8's packed
-- panels; bf16's pair slivers and few-tiles Winograd transforms) as caches beside it
-- (allocated from sim's allocator): the dry run takes them where the real run does
local function cached_precision(prec, why)
  test("precision " .. prec .. ": the weight caches predicted (txt2img 128², normal and low)", function()
    local pipeline = require "kiln.pipeline"
    local opts = { prompt = "a red circle", steps = 2, seed = 1, width = 128, height = 128, device = "sim", cfg = 3 }
    local budget = 64 * P.MiB
    local function run(with, mode)
      local old_prec, old_mode, old_budget = kiln.precision(), kiln.memory_mode(), kiln.mem.stats("sim").budget
      kiln.precision(with)
      local ck = kiln.load_checkpoint(P.MODEL)
      collectgarbage()
      local r = kiln.dry_run(function() pipeline.txt2img(ck, opts) end, { device = "sim", budget = budget, mode = mode })
      ck:close()
      collectgarbage()
      kiln.memory_mode(mode)
      kiln.mem.set_budget("sim", budget)
      ck = kiln.load_checkpoint(P.MODEL)
      kiln.mem.reset_peak("sim")
      local ok, err = pcall(pipeline.txt2img, ck, opts)
      local peak = kiln.mem.stats("sim").peak
      ck:close()
      collectgarbage()
      kiln.precision(old_prec)
      kiln.memory_mode(old_mode)
      kiln.mem.set_budget("sim", old_budget)
      assert(ok, err)
      return r.peak, peak
    end
    local kept = false
    for _, mode in ipairs({ "normal", "low" }) do
      local _, f32 = run("f32", mode)
      local predicted, measured = run(prec, mode)
      print(("# %s %s: predicted %d, measured %d bytes (f32 %d)"):format(prec, mode, predicted, measured, f32))
      kept = kept or measured > f32
      truthy(predicted >= measured and predicted <= 1.03 * measured,
        ("%s %s: predicted %d, measured %d bytes"):format(prec, mode, predicted, measured))
    end
    if not kept then H.skip("no " .. prec .. " cache was kept: " .. why) end
  end)
end
cached_precision("int8", "this CPU has no AVX512-VNNI (the int8 product falls back)")
cached_precision("bf16", "this CPU has no AVX-512 (the bf16 products run in f32)")

P.cleanup()
H.done()
