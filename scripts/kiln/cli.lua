-- kiln.cli: the command-line options every example workflow shares, and the
-- runtime settings they imply (device, memory mode, budget).
local util = require "kiln.util"

local cli = {}

local COMMON = {
  prompt = "", negative = "", seed = 0, steps = 20, cfg = 0.0, sampler = "euler", -- cfg 0: the model's
  scheduler = "normal", width = 0, height = 0, denoise = 1.0, out = "", model = "",
  device = "", mode = "", vram = "", quiet = false, tile = 0, overlap = 0,
}

--- Parses a size such as 6G, 512M, 1.5GiB, 300000000 into bytes.
function cli.parse_size(s)
  local num, unit = tostring(s):match("^%s*([%d%.]+)%s*([KkMmGgTt]?)[iI]?[Bb]?%s*$")
  if not num then error(("invalid size '%s' (examples: 6G, 512M, 1.5GiB)"):format(s), 2) end
  local mult = ({ [""] = 1, k = 1024, m = 1024 ^ 2, g = 1024 ^ 3, t = 1024 ^ 4 })[unit:lower()]
  return math.floor(tonumber(num) * mult)
end

--- The folder of the running script (for paths relative to the example).
function cli.script_dir()
  local s = arg and arg[0] or ""
  return s:match("^(.*)/[^/]*$") or "."
end

--- The bundled demo model.
function cli.default_model()
  local here = cli.script_dir()
  for _, p in ipairs({ here .. "/models/kiln-shapes.safetensors", "examples/models/kiln-shapes.safetensors" }) do
    local f = io.open(p, "rb")
    if f then f:close(); return p end
  end
  return "examples/models/kiln-shapes.safetensors"
end

local HELP = {
  prompt = "what to draw", negative = "what not to draw", seed = "noise seed", steps = "sampling steps",
  cfg = "classifier-free guidance scale (default: the model's kiln.cfg, else 7)", sampler = "euler, euler_ancestral, heun, dpm_2, dpmpp_2m, lms, ddim, ...",
  scheduler = "normal, karras, exponential, simple, sgm_uniform, ddim_uniform, beta",
  width = "image width (default: the model's size)", height = "image height (default: the model's size)",
  denoise = "strength below 1 keeps part of the input", out = "PNG to write",
  model = "checkpoint (.safetensors) or diffusers folder (default: the bundled demo model)",
  device = "cpu, sim or cuda[:N]", mode = "memory mode: high, normal, low, none, auto",
  vram = "memory budget of the device (6G, 512M)", quiet = "no progress, no summary",
  tile = "tiled VAE: tile size in latent units", overlap = "tile overlap in latent units",
}

--- The usage text of a script: its header comment's first lines and the options.
function cli.usage(defaults)
  local lines = { ("usage: kiln %s [options]"):format(arg and arg[0] or "script.lua"), "options:" }
  local keys = {}
  for k in pairs(defaults) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v = defaults[k]
    local d = (v == "" or v == 0 or v == false) and "" or (" (default %s)"):format(tostring(v))
    lines[#lines + 1] = ("  --%-10s %s%s"):format(k, HELP[k] or "", d)
  end
  return table.concat(lines, "\n")
end

--- Parses args with the common options plus `extra` defaults; applies --device,
-- --mode, --vram and --quiet to the runtime. Returns the options table. --help (or
-- -h) prints the usage and exits.
function cli.parse(args, extra)
  local defaults = {}
  for k, v in pairs(COMMON) do defaults[k] = v end
  for k, v in pairs(extra or {}) do defaults[k] = v end
  for _, a in ipairs(args or {}) do
    if a == "--help" or a == "-h" then
      print(cli.usage(defaults))
      os.exit(0)
    end
  end
  local o = util.parse_args(args, defaults)
  if o.quiet then kiln.set_quiet(true) end
  if o.device ~= "" then kiln.set_default_device(o.device) end
  -- "auto" is decided per run by kiln.planner (the pipelines call it), the others now
  if o.mode ~= "" and o.mode ~= "auto" then kiln.memory_mode(o.mode) end
  if o.vram ~= "" then kiln.mem.set_budget(kiln.default_device(), cli.parse_size(o.vram)) end
  if o.model == "" then o.model = cli.default_model() end
  for _, k in ipairs({ "width", "height", "tile", "overlap", "cfg" }) do
    if o[k] == 0 then o[k] = nil end
  end
  if o.tile == nil then o.overlap = nil
  elseif o.overlap == nil then o.overlap = o.tile // 4 end
  o.device = kiln.default_device()
  return o
end

--- Prints what a run wrote and where the memory went (unless quiet).
function cli.report(path, o)
  print(("wrote %s"):format(path))
  if not kiln.quiet() then
    if o and o._seconds_per_step then print(("%.3f s per step"):format(o._seconds_per_step)) end
    print(kiln.mem.summary())
  end
end

return cli
