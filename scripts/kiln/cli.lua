-- kiln.cli: the command-line options every example workflow shares, the runtime
-- settings they imply (device, memory mode, budget), and the checks that turn a
-- mistake on the command line into one usage line ("kiln: --width 100: ...").
local kiln = require "kiln"
local util = require "kiln.util"
local sample = require "kiln.sample"
local pipeline = require "kiln.pipeline"
local extra_networks = require "kiln.extra_networks"

local M = {}

local COMMON = {
  prompt = "", negative = "", seed = 0, steps = 20, cfg = 0.0, sampler = "euler", -- cfg 0: the model's
  scheduler = "normal", width = 0, height = 0, denoise = 1.0, out = "", model = "",
  device = "", mode = "", vram = "", quiet = false, tile = 0, overlap = 0,
  lora = {}, loras = "", embeddings = "", batch = 1, clip_skip = 0, weighting = "a1111",
  tileable = "",
  preview = "", preview_every = 0, previewer = "latent2rgb", vae = "", precision = "",
  preview_precision = "", cache = "", reference = {},
}

-- Options naming a file or folder that must exist when given.
local PATH_OPTIONS = { model = true, input = true, loras = true, embeddings = true }

--- Parses a size such as 6G, 512M, 1.5GiB, 300000000 into bytes (kiln.parse_size,
-- the one size parser); a usage error when it is not one.
function M.parse_size(s)
  local ok, n = pcall(kiln.parse_size, s)
  if not ok or type(n) ~= "number" then
    util.usage_error(("'%s' is not a size (examples: 6G, 512M, 1.5GiB)"):format(tostring(s)))
  end
  return n
end

--- The folder of the running script (for paths relative to the example).
function M.script_dir()
  local s = arg and arg[0] or ""
  return s:match("^(.*)/[^/]*$") or "."
end

local function exists(p)
  local ok, lfs = pcall(require, "lfs")
  if ok then return lfs.attributes(p, "mode") ~= nil end
  local f = io.open(p, "rb")
  if f then f:close() end
  return f ~= nil
end

--- The bundled demo model.
function M.default_model()
  local here = M.script_dir()
  for _, p in ipairs({ here .. "/models/kiln-shapes.safetensors", "examples/models/kiln-shapes.safetensors" }) do
    if exists(p) then return p end
  end
  return "examples/models/kiln-shapes.safetensors"
end

-- The help line of each option; sampler and scheduler list the registry (kiln.sample).
local function help_of(k)
  if k == "sampler" then return table.concat(sample.names(), ", ") end
  if k == "scheduler" then return table.concat(sample.scheduler_names(), ", ") end
  return ({
    prompt = "what to draw", negative = "what not to draw", seed = "noise seed",
    steps = "sampling steps (default: the model's: 20 for SD, 4 for an LCM-LoRA, Flux [schnell]...)",
    cfg = "classifier-free guidance scale (default: the model's kiln.cfg, else 7)",
    width = "image width in pixels (default: the model's size)",
    height = "image height in pixels (default: the model's size)",
    denoise = "strength below 1 keeps part of the input", out = "PNG to write",
    model = "checkpoint (.safetensors) or diffusers folder (default: the bundled demo model)",
    device = "cpu, sim or cuda[:N]", mode = "memory mode: high, normal, low, none, auto",
    vram = "memory budget of the device (6G, 512M)", quiet = "no progress, no summary",
    precision = "arithmetic of the networks: f32, bf16, f16 or int8 (default: the device's; the CPU's is f32)",
    tile = "tiled VAE: tile size in latent units", overlap = "tile overlap in latent units",
    lora = "NAME[:W] or NAME:TE:UNET, a LoRA of the --loras folder (repeatable; also <lora:NAME:W> in the prompt)",
    loras = "folder of LoRA files (found by name)", embeddings = "folder of embeddings (embedding:NAME in a prompt)",
    batch = "images per run, noise from the one seed; several are written as OUT_1.png, OUT_2.png...",
    clip_skip = "text encoder layer from the end: 1 the last, 2 the penultimate (default: the model family's)",
    weighting = "prompt weights (word:1.2) as a1111 (scale, keep the mean) or comfy (away from the empty prompt)",
    tileable = "x, y or xy: a seamless picture that tiles across its left/right (x), top/bottom (y) or all edges",
    preview = "PNG replaced (atomically) with a preview of the picture while it samples",
    preview_every = "steps between two previews (default 1)",
    previewer = "latent2rgb (free, latent size) or taesd (full size; taesd_decoder.safetensors found as --vae taesd)",
    preview_precision = "arithmetic of the taesd previews: f32, bf16, f16 or run (the run's; default: bf16 on a CPU"
      .. " with native bf16 products, else run)",
    vae = "a VAE file, or taesd: TAESD (beside the model, in its vae_approx/ or ../vae_approx/, or a file) as the VAE",
    cache = "step cache: fbcache[:THRESHOLD], teacache[:THRESHOLD] or deepcache[:INTERVAL] (fewer full evaluations)",
    reference = "PNG to edit or draw from, for Flux Kontext (repeatable: several references); each is resized to"
      .. " the nearest of Kontext's resolutions",
  })[k]
end

local function flag(k) return "--" .. k:gsub("_", "-") end

--- The usage text of a script: its options with what they do (help: name -> text
-- for a script's own options) and their defaults.
function M.usage(defaults, help)
  local lines = { ("usage: kiln %s [options]"):format(arg and arg[0] or "script.lua"), "options:" }
  local keys = {}
  for k in pairs(defaults) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v = defaults[k]
    local d = (v == "" or v == 0 or v == false or type(v) == "table") and "" or (" (default %s)"):format(tostring(v))
    lines[#lines + 1] = ("  %-15s %s%s"):format(flag(k), help and help[k] or help_of(k) or "", d)
  end
  return table.concat(lines, "\n")
end

-- The checks of the common options' values (the parser checked their types).
local function check_values(o)
  local function whole(k, min)
    local v = math.tointeger(o[k])
    if not v then util.usage_error(("%s %s: must be a whole number"):format(flag(k), tostring(o[k]))) end
    if v < min then util.usage_error(("%s %d: must be at least %d"):format(flag(k), v, min)) end
    o[k] = v
  end
  whole("steps", 1)
  whole("seed", math.mininteger)
  for _, k in ipairs({ "width", "height" }) do whole(k, 0) end
  whole("tile", 0)
  whole("overlap", 0)
  whole("batch", 1)
  whole("clip_skip", 0)
  if o.weighting ~= "a1111" and o.weighting ~= "comfy" then
    util.usage_error(("--weighting %s: must be a1111 or comfy"):format(tostring(o.weighting)))
  end
  if o.tileable ~= "" and o.tileable ~= "x" and o.tileable ~= "y" and o.tileable ~= "xy" then
    util.usage_error(("--tileable %s: must be x, y or xy"):format(tostring(o.tileable)))
  end
  if o.previewer ~= "latent2rgb" and o.previewer ~= "taesd" then
    util.usage_error(("--previewer %s: must be latent2rgb or taesd"):format(tostring(o.previewer)))
  end
  whole("preview_every", 0)
  if o.preview_precision ~= "" and not require("kiln.preview").PRECISIONS[o.preview_precision] then
    util.usage_error(("--preview-precision %s: must be f32, bf16, f16 or run"):format(tostring(o.preview_precision)))
  end
  if o.vae ~= "" and o.vae ~= "taesd" and not exists(o.vae) then
    util.usage_error(("--vae %s: no such file (or taesd)"):format(o.vae))
  end
  if not (o.denoise >= 0 and o.denoise <= 1) then
    util.usage_error(("--denoise %g: must be between 0 and 1"):format(o.denoise))
  end
  if not sample.sampler_info(o.sampler) then
    util.usage_error(("--sampler %s: unknown (known: %s)"):format(o.sampler, table.concat(sample.names(), ", ")))
  end
  if not sample.scheduler_info(o.scheduler) then
    util.usage_error(("--scheduler %s: unknown (known: %s)"):format(o.scheduler,
      table.concat(sample.scheduler_names(), ", ")))
  end
  for _, s in ipairs(o.lora or {}) do
    local ok, err = pcall(extra_networks.parse_option, s)
    if not ok then util.usage_error(tostring(err)) end
  end
  for _, p in ipairs(o.reference or {}) do
    if not exists(p) then util.usage_error(("--reference %s: no such file"):format(p)) end
  end
  for k in pairs(PATH_OPTIONS) do
    local p = o[k]
    if type(p) == "string" and p ~= "" and not exists(p) then
      util.usage_error(("%s %s: no such file or folder"):format(flag(k), p))
    end
  end
end

-- The command-line option of each kiln.configure field (its value is o[option]).
local OPTION_OF = { device = "device", mode = "mode", budget = "vram", precision = "precision", quiet = "quiet" }

-- --device, --mode ("auto": kiln.planner decides per run), --vram, --precision and
-- --quiet applied to the runtime through kiln.configure, the settings route kiln_open
-- takes too. A refusal names its field and reason as data (err.field, err.detail):
-- the command line's mistake, said as the command line said it.
local function apply_runtime(o)
  local cfg = {
    device = o.device ~= "" and o.device or nil,
    mode = o.mode ~= "" and o.mode or nil,
    budget = o.vram ~= "" and o.vram or nil,
    precision = o.precision ~= "" and o.precision or nil,
    quiet = o.quiet or nil,
  }
  local ok, err = pcall(kiln.configure, cfg)
  if not ok then
    local option = type(err) == "table" and OPTION_OF[err.field]
    if not option then error(err, 0) end
    util.usage_error(("%s %s: %s"):format(flag(option), tostring(o[option]), err.detail))
  end
end

-- True when args set option k (--k VALUE or a boolean --k).
local function given(args, k)
  local f = flag(k)
  for _, a in ipairs(args or {}) do
    if a == f then return true end
  end
  return false
end

--- Parses args with the common options plus `extra` defaults; checks their values
-- (a mistake is a usage error: kiln prints "kiln: <message>" and exits with 2),
-- applies --device, --mode, --vram, --precision and --quiet to the runtime. Returns
-- the options table. --help (or -h) prints the usage (help: name -> text of the extra options)
-- and exits.
function M.parse(args, extra, help)
  local defaults = {}
  for k, v in pairs(COMMON) do defaults[k] = v end
  for k, v in pairs(extra or {}) do defaults[k] = v end
  for _, a in ipairs(args or {}) do
    if a == "--help" or a == "-h" then
      print(M.usage(defaults, help))
      os.exit(0)
    end
  end
  local o = util.parse_args(args or {}, defaults)
  check_values(o)
  apply_runtime(o)
  -- steps, sampler and scheduler not given are the model's to choose (the family's, or
  -- a few-step model's: kiln.few_step_kind); the defaults above are what SD runs with
  for _, k in ipairs({ "steps", "sampler", "scheduler" }) do
    if defaults[k] == COMMON[k] and not given(args, k) then o[k] = nil end
  end
  if o.model == "" then o.model = M.default_model() end
  for _, k in ipairs({ "width", "height", "tile", "overlap", "cfg", "clip_skip" }) do
    if o[k] == 0 then o[k] = nil end
  end
  if o.tile == nil then o.overlap = nil
  elseif o.overlap == nil then o.overlap = o.tile // 4 end
  if o.tileable == "" then o.tileable = nil end
  o.cache = M.cache_option(o.cache)
  if o.preview == "" then o.preview = nil end
  if o.preview_every == 0 then o.preview_every = nil end
  if o.preview_precision == "" then o.preview_precision = nil end
  o.reference = M.reference_images(o.reference)
  -- --vae names the checkpoint's VAE (M.checkpoint_options), not a per-run one
  o.checkpoint_vae = o.vae ~= "" and o.vae or nil
  o.vae = nil
  o.device = kiln.default_device()
  return o
end

--- --cache MODE[:N] as opts.cache (nil for ""): N is the threshold of fbcache and
-- teacache, the interval of deepcache; a usage error names what is wrong.
function M.cache_option(s)
  if s == nil or s == "" then return nil end
  local mode, n = tostring(s):match("^(%a+):?(.*)$")
  local c = { mode = mode }
  if n and n ~= "" then
    local v = tonumber(n)
    if not v then util.usage_error(("--cache %s: '%s' is not a number"):format(s, n)) end
    if mode == "deepcache" then c.interval = v else c.threshold = v end
  end
  local ok, err = pcall(require("kiln.step_cache").spec, c, "unet", "--cache " .. tostring(s))
  if not ok then util.usage_error((tostring(err):gsub("^[^:]*:%d+: ", ""))) end
  return c
end

--- The options of kiln.load_checkpoint that the command line sets (--loras,
-- --embeddings: the folders LoRAs and embeddings are found in by name; --vae: a VAE
-- file or "taesd").
function M.checkpoint_options(o)
  return { loras = o.loras ~= "" and o.loras or nil, embeddings = o.embeddings ~= "" and o.embeddings or nil,
    vae = o.checkpoint_vae }
end

--- Fills o.width / o.height with the checkpoint's native size where the command
-- line gave none, and checks them against what its networks need, in pixels (a
-- usage error such as "--width 100: must be a multiple of 8 (96 or 104 would do)").
-- `scale` (hires fix) also checks the sizes scaled by it. Returns o.
function M.image_size(o, ckpt, scale)
  o.width = o.width or pipeline.image_size(ckpt)
  o.height = o.height or pipeline.image_size(ckpt)
  local m = pipeline.size_multiple(ckpt)
  for _, k in ipairs({ "width", "height" }) do
    local v = o[k]
    if v % m ~= 0 then
      local lo = v // m * m
      util.usage_error(("--%s %d: must be a multiple of %d (%s%d would do)"):format(k, v, m,
        lo > 0 and (lo .. " or ") or "", lo + m))
    end
    if scale then
      local s = math.floor(v * scale)
      if s % m ~= 0 then
        util.usage_error(("--%s %d at --scale %g is %d pixels: must be a multiple of %d"):format(k, v, scale, s, m))
      end
    end
  end
  return o
end

--- The --reference PNGs as images [1, C, H, W] in [0, 1] (nil when none given); a
-- file that is not a PNG is a usage error naming it.
function M.reference_images(paths)
  if not paths or #paths == 0 then return nil end
  local list = {}
  for i, p in ipairs(paths) do
    local ok, t = pcall(kiln.load_png, p)
    if not ok then
      util.usage_error(("--reference %s: not a PNG image (%s)"):format(p, tostring(t):gsub("^[^:]*:%d+: ", "")))
    end
    list[i] = t
  end
  return list
end

--- --reference against the checkpoint: only a family that encodes reference pictures
-- (Flux Kontext) takes them; any other is a usage error naming the family. Returns o.
function M.check_reference(o, ckpt)
  if not o.reference then return o end
  local F = pipeline.flow_family(ckpt)
  if not (F and F.reference_latents) then
    util.usage_error(("--reference: reference pictures are for Flux Kontext checkpoints, and this one is %s")
      :format(require("kiln.family").label(ckpt.family)))
  end
  return o
end

--- --clip-skip against the checkpoint's text encoders (a usage error when one has
-- fewer layers). Returns o.
function M.check_clip_skip(o, ckpt)
  local n = o.clip_skip
  if not n then return o end
  for _, e in ipairs(ckpt.clip and ckpt.clip.encoders or {}) do
    local layers = e.enc and e.enc.config and e.enc.config.layers
    if layers and n > layers then
      util.usage_error(("--clip-skip %d: the text encoder has %d layers"):format(n, layers))
    end
  end
  return o
end

--- The files a run of n images writes: out itself for one, else out with _1, _2...
-- before its extension ("out.png" -> "out_1.png", "out_2.png").
function M.out_paths(out, n)
  if n <= 1 then return { out } end
  local stem, ext = out:match("^(.-)(%.[^./]*)$")
  if not stem then stem, ext = out, "" end
  local list = {}
  for i = 1, n do list[i] = ("%s_%d%s"):format(stem, i, ext) end
  return list
end

--- Saves each image of a batch [N, C, H, W] with its parameters (pipeline.save) at
-- M.out_paths(o.out, N). Returns the list of paths.
function M.save(img, o, ckpt, extra)
  local paths = M.out_paths(o.out, img.shape[1])
  for i, p in ipairs(paths) do
    local one = img.shape[1] == 1 and img or img:narrow(1, i, 1)
    pipeline.save(one, p, o, ckpt, extra)
    if one ~= img then one:free() end
  end
  return paths
end

--- Prints what a run wrote and where the memory went (unless quiet).
function M.report(path, o)
  if type(path) == "table" then path = table.concat(path, ", ") end
  if kiln.mem.meta_target() then
    print(("dry run: %s not written (its pixels would be the dry run's zeros)"):format(path))
  else
    print(("wrote %s"):format(path))
  end
  if not kiln.quiet() then
    if o and o._seconds_per_step then print(("%.3f s per step"):format(o._seconds_per_step)) end
    print(kiln.mem.summary())
  end
end

return M
