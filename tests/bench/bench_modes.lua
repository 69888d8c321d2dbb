-- tests/bench/bench_modes.lua - the demo workflow (txt2img with the bundled model)
-- on the sim device in each memory mode, untiled and with a tiled VAE, at two
-- resolutions: peak device memory (kiln.mem.stats("sim").peak) and time, with the
-- ratios against high mode untiled measured in the same run.
--   build/kiln tests/bench/bench_modes.lua [--steps N] [--sizes 64,128]
local util = require "kiln.util"
local pipeline = require "kiln.pipeline"
local o = util.parse_args(arg, { steps = 10, sizes = "64,128", model = "examples/models/kiln-shapes.safetensors" })

kiln.set_quiet(true)
kiln.set_default_device("sim")
local ckpt <close> = kiln.load_checkpoint(o.model)

local function human(b)
  if b >= 1024 * 1024 then return ("%.2f MiB"):format(b / 1048576) end
  return ("%.1f KiB"):format(b / 1024)
end

print(("demo workflow (txt2img, %d euler steps, cfg 6) on sim, %d threads"):format(o.steps, kiln.threads()))
print(("%-6s %-7s %-9s %12s %9s %9s %9s"):format("size", "mode", "vae", "peak sim", "time s", "x peak", "x time"))
for size in o.sizes:gmatch("%d+") do
  size = tonumber(size)
  local base
  for _, mode in ipairs({ "high", "normal", "low" }) do
    for _, tile in ipairs({ false, 8 }) do
      kiln.memory_mode(mode)
      collectgarbage(); collectgarbage()
      kiln.mem.empty_cache("sim")
      kiln.mem.reset_peak("sim")
      local t0 = kiln.time()
      local img = pipeline.txt2img(ckpt, { prompt = "a red circle on a blue background", seed = 1, steps = o.steps,
        cfg = 6, width = size, height = size, tile = tile or nil, overlap = tile and 2 or nil })
      local dt = kiln.time() - t0
      img:free()
      local peak = kiln.mem.stats("sim").peak
      if not base then base = { peak = peak, t = dt } end
      print(("%-6s %-7s %-9s %12s %9.2f %9.2f %9.2f"):format(size .. "px", mode, tile and ("tile " .. tile) or "untiled",
        human(peak), dt, peak / base.peak, dt / base.t))
    end
  end
end
