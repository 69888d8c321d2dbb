-- A device that is not clean when a network runs: tensors the caller left to the garbage
-- collector on sim (a GEMM probe's temporaries, the collector stopped for the run, as
-- the Flux step bench does) must not add to the run's peak, which a dry run (it starts
-- with a full collection) predicted without them. A network's load starts with a full
-- collection (scripts/kiln/part.lua). Tiny Flux (tests/golden/flux's recipe) called
-- directly, dit:load + dit:forward, as tests/bench/bench_flux_step.lua does.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local test, eq, truthy = H.test, H.eq, H.truthy

H.need_devices("warm device", "sim", "meta")
kiln.set_quiet(true)

local MiB = 1024 * 1024
local base, META = T.build_recipe("../flux/flux")
local path = T.tmp("warm_flux.safetensors")
kiln.save_safetensors(path, base, META)

local function settle()
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
end

for _, mode in ipairs({ "normal", "low" }) do
  test("tiny Flux step after a probe's garbage on sim (" .. mode .. "): measured = predicted", function()
    local ck <close> = kiln.load_checkpoint(path)
    local cfg = ck.dit.config
    local x = kiln.randn({ 1, 16, 16, 16 }, { seed = 1, device = "cpu" })
    local ctx = kiln.randn({ 1, 8, cfg.context_dim }, { seed = 2, device = "cpu" })
    local y = kiln.randn({ 1, cfg.vec_dim }, { seed = 3, device = "cpu" })
    local function step()
      ck.dit:load("sim")
      ck.dit:forward(x, 0.5, ctx, y, { guidance = 3.5 }):free()
    end
    local old_mode, old_budget = kiln.memory_mode(), kiln.mem.stats("sim").budget
    local budget = 64 * MiB
    local r = kiln.dry_run(function()
      collectgarbage("stop")
      local ok, err = pcall(step)
      collectgarbage("restart")
      if not ok then error(err, 0) end
    end, { device = "sim", budget = budget, mode = mode })
    truthy(r.fits, tostring(r.oom))
    ck.dit:unload()
    settle()
    -- the probe: temporaries left to the collector on sim (0.7 MiB, less than the step)
    kiln.memory_mode(mode)
    kiln.mem.set_budget("sim", budget)
    local keep = {}
    do
      local w = (kiln.randn({ 256, 256 }, { seed = 4, device = "sim" }) * 0.02):to("bf16")
      keep[1] = kiln.nn.linear(kiln.randn({ 64, 256 }, { seed = 5, device = "sim" }):to("bf16"), w)
    end
    keep = nil
    local garbage = kiln.mem.stats("sim").allocated
    truthy(garbage > 0, "the probe left garbage on sim")
    kiln.mem.reset_peak("sim")
    collectgarbage("stop")
    local ok, err = pcall(step)
    collectgarbage("restart")
    local st = kiln.mem.stats("sim")
    kiln.memory_mode(old_mode)
    kiln.mem.set_budget("sim", old_budget)
    ck.dit:unload()
    settle()
    if not ok then error(err, 0) end
    -- the peak counts from the reset (the garbage, freed by the load, was allocated then)
    print(("# %s: garbage %.3f MiB before the step; measured %.3f MiB, predicted %.3f MiB"):format(mode,
      garbage / MiB, st.peak / MiB, r.peak / MiB))
    truthy(st.peak <= r.peak, ("measured %d > predicted %d bytes"):format(st.peak, r.peak))
    truthy(r.peak <= 1.03 * st.peak, ("predicted %d > 1.03 x measured %d bytes"):format(r.peak, st.peak))
  end)
end

H.done()
