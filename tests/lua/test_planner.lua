-- --mode auto (kiln.planner) on the demo model and the sim device: the chosen mode
-- follows the budget (none / large -> high, medium -> normal, small -> low with the
-- VAE tiled), every run stays inside its budget, and the pictures agree.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"
local imgcmp = require "imgcmp"

local MODEL = H.demo_model("--mode auto")

kiln.set_quiet(true)
local MiB = 1024 * 1024
local ckpt <close> = kiln.load_checkpoint(MODEL)
local report = {}

local function run(budget)
  kiln.mem.set_budget("sim", budget)
  kiln.mem.reset_peak("sim")
  local o = { prompt = "a red circle on a blue background", seed = 3, steps = 4, width = 128, height = 128,
    device = "sim", mode = "auto" }
  local ok, img = pcall(pipeline.txt2img, ckpt, o)
  local peak = kiln.mem.stats("sim").peak
  local mode = kiln.memory_mode()
  kiln.mem.set_budget("sim", 0)
  kiln.memory_mode("normal")
  if not ok then error(img, 0) end
  report[#report + 1] = ("budget %s: mode %s, peak %.2f MiB"):format(
    budget == 0 and "none" or ("%.1f MiB"):format(budget / MiB), mode, peak / MiB)
  return img, mode, peak
end

-- Budgets sized from what the planner measures here (thread counts and kernels change
-- the work of a stage from machine to machine): the budget whose planning room is
-- halfway between what two modes need must give the cheaper one.
local function budgets()
  kiln.mem.set_budget("sim", 1024 * MiB)
  local plan = require("kiln.planner").choose(ckpt, { device = "sim", width = 128, height = 128, cfg = 3 })
  kiln.mem.set_budget("sim", 0)
  local base = kiln.mem.stats("sim").allocated
  local function room(bytes) return math.floor(base + (bytes + 2 * MiB) / 0.9) end
  local n = plan.need
  return room(n.high * 2), room((n.high + n.normal) / 2), room((n.normal + n.low) / 2), n
end

local ref
H.test("the mode follows the budget; every run stays inside it", function()
  local high, normal, low, need = budgets()
  report[#report + 1] = ("needs measured: high %.2f MiB, normal %.2f MiB, low %.2f MiB"):format(
    need.high / MiB, need.normal / MiB, need.low / MiB)
  H.truthy(need.high > need.normal and need.normal > need.low, "the modes need less and less")
  local cases = { { 0, "high" }, { high, "high" }, { normal, "normal" }, { low, "low" } }
  for _, c in ipairs(cases) do
    local img, mode, peak = run(c[1])
    H.eq(mode, c[2], ("budget %d"):format(c[1]))
    if c[1] > 0 then H.truthy(peak <= c[1], ("peak %d over the budget %d"):format(peak, c[1])) end
    if not ref then ref = img
    else
      local p = imgcmp.psnr(img, ref)
      H.truthy(p >= 30, ("mode %s: PSNR %.1f dB against the unbudgeted picture"):format(mode, p))
      report[#report] = report[#report] .. (", PSNR %.1f dB vs unbudgeted"):format(p)
      img:free()
    end
  end
end)

H.test("the plan names every model with its bytes", function()
  local _, _, low = budgets()
  kiln.mem.set_budget("sim", low)
  local plan = require("kiln.planner").choose(ckpt, { device = "sim", width = 128, height = 128, cfg = 3 })
  kiln.mem.set_budget("sim", 0)
  local text = table.concat(plan.lines, "\n")
  for _, name in ipairs({ "clip", "unet", "vae", "-> mode low" }) do
    H.truthy(text:find(name, 1, true), name .. " missing from:\n" .. text)
  end
end)

for _, l in ipairs(report) do print("  " .. l) end
H.done()
