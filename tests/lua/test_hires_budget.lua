-- Issue 8's promise on the demo model: hires fix to 1024x1024 inside a sim budget
-- that the untiled run exceeds. Low mode streams the weights, the upscaled pass is
-- sampled in MultiDiffusion tiles and the VAE decodes in tiles; the peak stays
-- under the budget.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"

local MODEL = H.demo_model("hires fix inside a budget")

kiln.set_quiet(true)
kiln.set_default_device("sim")
kiln.memory_mode("low")
local BUDGET = 32 * 1024 * 1024
local ckpt <close> = kiln.load_checkpoint(MODEL)
local function with(extra)
  local t = {}
  for k, v in pairs(extra) do t[k] = v end
  for k, v in pairs({ prompt = "a red circle on a blue background", steps = 2, hires_steps = 2, seed = 1,
  width = 64, height = 64, scale = 16 }) do t[k] = v end
  return t
end

H.test("the untiled 1024x1024 hires fix exceeds a 32 MiB sim budget", function()
  kiln.mem.set_budget("sim", BUDGET)
  local o = with({})
  local ok, err = pcall(pipeline.hires_fix, ckpt, o)
  kiln.mem.set_budget("sim", 0)
  H.truthy(not ok and type(err) == "table" and err.kind == "oom", "expected an out-of-memory error, got " .. tostring(err))
  ckpt.unet:unload(); ckpt.vae:unload(); ckpt.clip:unload()
  collectgarbage(); collectgarbage()
end)

H.test("tiled, the same hires fix to 1024x1024 fits the budget", function()
  kiln.mem.empty_cache("sim")
  kiln.mem.set_budget("sim", BUDGET)
  kiln.mem.reset_peak("sim")
  local o = with({ tile = 16, overlap = 4, hires_tile = 32 })
  local t0 = kiln.time()
  local img = pipeline.hires_fix(ckpt, o)
  local peak = kiln.mem.stats("sim").peak
  kiln.mem.set_budget("sim", 0)
  H.eq(img.shape[3], 1024); H.eq(img.shape[4], 1024)
  H.truthy(peak <= BUDGET, ("peak %d > budget %d"):format(peak, BUDGET))
  print(("# hires fix 64 -> 1024 on sim: peak %.1f MiB of a %.0f MiB budget, %.1f s"):format(peak / 1048576,
    BUDGET / 1048576, kiln.time() - t0))
  img:free()
end)

H.done()
