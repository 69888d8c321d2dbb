-- kiln.pipeline: the staged workflows (txt2img, img2img, hires fix) built from
-- the checkpoint's networks, the samplers and the memory primitives. Each stage
-- says what it needs resident and releases what the next stage does not need,
-- so a workflow's peak is the largest stage, not the sum.
--
--   local ckpt <close> = kiln.load_checkpoint(path)
--   local img = kiln.pipeline.txt2img(ckpt, { prompt = "a red circle", steps = 20, seed = 1 })
local kiln = require "kiln"
local lfs = require "lfs"
local sample = require "kiln.sample"
local progress = require "kiln.progress"
local extra_networks = require "kiln.extra_networks"
local seamless = require "kiln.seamless"
local util = require "kiln.util"
local family = require "kiln.family"
local flow = require "kiln.flow"
local guidance = require "kiln.guidance"
local step_cache = require "kiln.step_cache"
local few_step_kind = require "kiln.few_step_kind"

local M = {}

local DEFAULTS = {
  prompt = "", negative = "", seed = 0, steps = 20, cfg = nil, sampler = "euler", -- cfg: default_cfg
  scheduler = "normal", width = nil, height = nil, denoise = 1.0, device = nil,
  batch_cfg = nil, -- nil: one batched UNet call for cond+uncond unless mode is "low"
  batch = 1,        -- images per run, their noise drawn from one seed as randn([N, 4, h, w])
  clip_skip = nil,  -- 1 the text encoder's last layer, 2 the penultimate...; nil the family's
  weighting = nil,  -- prompt weights as "a1111" (nil) or "comfy" computes them (clip:encode)
}

-- The options each pipeline knows, in one table: any other key is a mistake, an error
-- naming it and the nearest known name (a misspelt "stpes" would otherwise run with
-- the default steps). The helpers a pipeline hands its options on to read theirs from
-- here too: the samplers (sampler, scheduler, eta, s_noise, sigmas, add_noise,
-- callback), the previews (preview, previewer, preview_every, preview_precision),
-- the planner (mode), the VAE's tiling (tile, overlap), MultiDiffusion (unet_tile,
-- unet_overlap), seamless (tileable), LoRAs (lora and the prompt's tags), ControlNets
-- (control, its entries checked by check_controls) and TAESD (vae).
local COMMON_OPTIONS = {
  "prompt", "negative", "seed", "steps", "cfg", "sampler", "scheduler", "width", "height",
  "denoise", "device", "batch_cfg", "batch", "clip_skip", "weighting",
  "eta", "s_noise", "sigmas", "add_noise", "callback",
  "preview", "previewer", "preview_every", "preview_precision",
  "mode", "tile", "overlap", "unet_tile", "unet_overlap", "tileable", "lora", "control", "vae",
  "guidance", "t5_length", -- flow-matching families (Flux): distilled guidance, T5's padded length
  "reference", "reference_scale", -- Flux Kontext: reference pictures (scaled to Kontext's sizes unless false)
  "skip_layer_guidance",    -- SD 3.5: true or {layers, scale, start, stop} (kiln.flow.denoiser)
  "cache", -- kiln.step_cache: {mode = "fbcache" | "teacache" | "deepcache", threshold = ...}
}
local function option_set(...)
  local set = {}
  for _, list in ipairs({ COMMON_OPTIONS, ... }) do
    for _, k in ipairs(list) do set[k] = true end
  end
  return set
end
M.OPTIONS = {
  txt2img = option_set(),
  -- denoise_mask, concat_mask, concat_latent: inpainting's (kiln.inpaint sets them)
  img2img = option_set({ "denoise_mask", "concat_mask", "concat_latent" }),
  hires_fix = option_set({ "scale", "upscale", "hires_denoise", "hires_steps", "hires_tile" }),
  inpaint = option_set({ "mask_blur", "grow_mask" }),
}

--- Raises "kiln.pipeline.NAME: unknown option 'stpes' (did you mean 'steps'?)" at
-- the pipeline's caller when opts has a key pipeline NAME does not know.
function M.check_options(name, opts)
  util.check_options(opts, M.OPTIONS[name], "kiln.pipeline." .. name, 4) -- not a tail call: the level counts this
end

--- The options of pipeline NAME among o (a larger table, such as the command line's
-- with its --out and --model): a new table of the keys the pipeline knows.
function M.options_of(name, o)
  local r = {}
  for k in pairs(M.OPTIONS[name]) do r[k] = o[k] end
  return r
end

--- The guidance scale a checkpoint is sampled with when the caller gives none: its
-- metadata's kiln.cfg (the demo model: 3), else a flow family's variant's (SD 3.5
-- Large 4.5, Turbo 1), else 7 (A1111's and ComfyUI's usual).
function M.default_cfg(ckpt)
  local m = ckpt and ckpt.metadata and tonumber(ckpt.metadata["kiln.cfg"])
  if m then return m end
  local F = M.flow_family(ckpt)
  if F then return (F.variants and F.variants[ckpt.variant] or {}).cfg or F.defaults.cfg end
  return 7.0
end

local check_controls -- below, with the ControlNet pieces
local lowered_between_steps -- below, with the sampling

--- The family definition of a checkpoint when it samples by flow matching (Flux), else nil.
function M.flow_family(ckpt)
  local F = ckpt and family.get(ckpt.family)
  if F and F.defaults.prediction == "flow" then return F end
  return nil
end

--- The network a run samples with: the transformer of a flow family (ckpt.dit), else the UNet.
function M.net(ckpt) return rawget(ckpt, "dit") or ckpt.unet end

-- A flow family's defaults (then its variant's: [schnell] 4 steps) under the caller's
-- options; the family checks its own options (F.run_options: o._flow).
local FLOW_DEFAULTS = { "sampler", "scheduler", "cfg", "steps" }
local function flow_defaults(o, opts, ckpt, F)
  local v = F.variants and F.variants[ckpt.variant] or {}
  for _, k in ipairs(FLOW_DEFAULTS) do
    local d = v[k]
    if d == nil then d = F.defaults[k] end
    if (opts or {})[k] == nil then o[k] = d end
  end
  o._flow = F.run_options(ckpt, opts or {})
  flow.check_sampler(o.sampler)
end

--- A few-step model's sampling (kiln.few_step_kind: an LCM-LoRA applied, an SDXL-Turbo
-- checkpoint...) in o where the caller's opts give none; o.info.few_step names the kind
-- and where it was read. Called again once a run's own LoRAs are applied.
local function few_step_defaults(o, opts, ckpt)
  local p, from = few_step_kind.fill(o, opts, ckpt, M.flow_family(ckpt) ~= nil)
  if o.info then o.info.few_step = p and ("%s (%s: %s)"):format(p.label, from, p.evidence) or nil end
end

local function opts_with_defaults(opts, ckpt)
  local o = {}
  for k, v in pairs(DEFAULTS) do o[k] = v end
  for k, v in pairs(opts or {}) do o[k] = v end
  local F = M.flow_family(ckpt)
  if F then
    flow_defaults(o, opts, ckpt, F)
  else
    for _, k in ipairs({ "guidance", "t5_length", "reference", "skip_layer_guidance" }) do
      if o[k] ~= nil then
        error(("%s is an option of the flow-matching families (Flux); this is an %s checkpoint"):format(k,
          family.label(ckpt and ckpt.family)), 0)
      end
    end
  end
  if o.cfg == nil then o.cfg = M.default_cfg(ckpt) end
  check_controls(o.control, ckpt)
  o.tileable = seamless.check(o.tileable, "kiln.pipeline: tileable")
  M.cache_spec(o, ckpt)
  few_step_defaults(o, opts, ckpt)
  return o
end

-- opts.tileable = "x" | "y" | "xy": the run's UNet, VAE and ControlNets pad circularly
-- on those axes (kiln.seamless), so the picture tiles; closing the result (the end of
-- the run, or an error) gives them back their previous mode.
local function run_tileable(ckpt, o)
  local nets = { M.net(ckpt), ckpt.vae }
  for _, c in ipairs(type(o.control) == "table" and o.control or {}) do
    if type(c) == "table" and type(c.net) == "table" then nets[#nets + 1] = c.net end
  end
  return seamless.use(nets, o.tileable, "kiln.pipeline: tileable")
end

-- opts.vae = "taesd" (found beside the checkpoint), a TAESD file or a kiln.load_taesd
-- object: the run decodes and encodes with TAESD, a fast low-memory VAE, in place of
-- the checkpoint's; closing the result puts the checkpoint's back.
local function run_vae(ckpt, o)
  if o.vae == nil or o.vae == false then return nil end
  return require("kiln.taesd").swap(ckpt, o.vae)
end

--- The native image size of a checkpoint: its metadata's kiln.image_size, else
-- the family's (SD 1.x 512, SD 2.x 768 for v-prediction else 512, SDXL 1024).
function M.image_size(ckpt)
  local m = ckpt.metadata and tonumber(ckpt.metadata["kiln.image_size"])
  if m then return m end
  local F = M.flow_family(ckpt)
  if F then return F.defaults.image_size end
  if ckpt.family == "sdxl" then return 1024 end
  if ckpt.family == "sd2" and ckpt.prediction == "v" then return 768 end
  return 512
end

--- A1111's model hash (first 10 hex digits of the file's SHA-256), computed once
-- per checkpoint; skipped for files over 512 MiB unless forced (hashing a 7 GB
-- file costs seconds).
function M.model_hash(ckpt, force)
  if ckpt._hash == nil and ckpt.path then
    local a = lfs.attributes(ckpt.path)   -- nil when missing; a diffusers folder has no hash
    if a and a.mode == "file" and (force or a.size <= 512 * 1024 * 1024) then
      ckpt._hash = kiln.sha256_file(ckpt.path):sub(1, 10)
    else
      ckpt._hash = false
    end
  end
  return ckpt._hash or nil
end

--- The device stages run on: opts.device, else kiln's default device.
local function device_of(o) return o.device or kiln.default_device() end

--- The device a run on dev computes on: dev, but the CPU in memory mode "none" ("cpu"),
-- where the networks run on the CPU whatever the device.
function M.run_device(dev)
  local mode = kiln.memory_mode()
  if mode == "none" or mode == "cpu" then return "cpu" end
  return dev or kiln.default_device()
end

--- A run computes on opts.device alone: for its length the device it computes on
-- (M.run_device) is the default one, so every tensor the run and its helpers make
-- (the starting noise, a sampler's noise, masks, temporaries) lands beside the latents
-- whatever the caller's default; closing the result gives the caller's default back,
-- on an error too.
function M.on_device(dev)
  dev = M.run_device(dev)
  local old = kiln.default_device()
  if dev == nil or dev == old then return nil end
  kiln.set_default_device(dev)
  return setmetatable({}, { __close = function() kiln.set_default_device(old) end })
end

--- The run's step cache spec (opts.cache checked, defaults filled; nil without one)
-- and its record o.info: the network calls the run made (`calls`), how many of them
-- were full evaluations (`evals`: fewer than calls where a step cache replaced part
-- of the network) and the sampler steps (`steps`). The pipelines return o.info as
-- their third value.
function M.cache_spec(o, ckpt)
  o.info = o.info or { evals = 0, calls = 0, steps = 0 }
  o._cache_spec = step_cache.spec(o.cache, ckpt and ckpt.dit and "flux" or "unet", "kiln.pipeline: cache")
  return o._cache_spec
end

--- Model sampling of a checkpoint: SD's discrete schedule with its prediction type
-- (and zero terminal SNR where the checkpoint was trained so).
function M.model_sampling(ckpt)
  ckpt._ms = ckpt._ms or sample.discrete_schedule({ prediction = ckpt.prediction or "eps", zsnr = ckpt.zsnr })
  return ckpt._ms
end

--- The model sampling of a flow family's run on latents of `shape` (Flux [dev] shifts
-- its schedule by the image's token count; kiln.flow).
function M.flow_sampling(ckpt, shape)
  return flow.for_checkpoint(M.flow_family(ckpt), ckpt.variant, shape[3], shape[4])
end

--- Sigmas for `steps` steps at denoise strength d (< 1 starts part-way, as
-- ComfyUI: the schedule of steps/d steps, keeping its last steps + 1 values).
-- shape: the latents' (a flow family's schedule depends on their size).
function M.sigmas(ckpt, scheduler, steps, d, shape)
  if M.flow_family(ckpt) then
    if not shape then error("kiln.pipeline.sigmas: a flow-matching model's schedule needs the latent shape", 2) end
    return flow.sigmas(M.flow_sampling(ckpt, shape), scheduler, steps, d)
  end
  local ms = M.model_sampling(ckpt)
  d = d or 1
  if d <= 0 then return kiln.tensor({ 0 }, { device = "cpu" }) end -- host data, as the schedules
  local total = d < 1 and math.floor(steps / d) or steps
  local s = sample.sigmas(scheduler, total, { model_sampling = ms })
  if total > steps then s = s:narrow(1, total - steps + 1, steps + 1):contiguous() end
  return s
end

--- Conditioning for a prompt and a negative prompt: cond, uncond (and pooled
-- vectors where the family has them).
function M.encode_prompts(ckpt, prompt, negative, enc_opts)
  local clip = ckpt.clip
  local cond, pooled = clip:encode(prompt, enc_opts)
  local uncond, upooled = clip:encode(negative or "", enc_opts)
  -- different prompt lengths (75-token chunks): pad the shorter with its last chunk
  local lc, lu = cond.shape[2], uncond.shape[2]
  if lc ~= lu then
    local function grow(t, n)
      local parts = { t }
      local last = t:narrow(2, t.shape[2] - 76, 77)
      local have = t.shape[2]
      while have < n do parts[#parts + 1] = last; have = have + 77 end
      return kiln.cat(parts, 2)
    end
    if lc < lu then cond = grow(cond, lu) else uncond = grow(uncond, lc) end
  end
  return cond, uncond, pooled, upooled
end

local function is_tensor(v)
  local mt = type(v) == "userdata" and getmetatable(v)
  return type(mt) == "table" and mt.__name == "kiln.Tensor"
end

--- Checks a run's ControlNets (opts.control): a list of {net = kiln.load_controlnet(..),
-- image = [1, 3|4, H, W] in [0, 1], strength = 1, start = 0, stop = 1}, as ComfyUI's
-- ControlNetApplyAdvanced takes them (one image serves the whole batch).
local CONTROL_OPTIONS = { net = true, image = true, strength = true, start = true, stop = true }
function check_controls(list, ckpt)
  if list == nil then return end
  if type(list) ~= "table" then
    error("kiln.pipeline: control must be a list of {net =, image =, ...}, got " .. type(list), 0)
  end
  for i, c in ipairs(list) do
    local where = ("kiln.pipeline: control[%d]"):format(i)
    if type(c) ~= "table" then error(where .. " must be a table {net =, image =, ...}, got " .. type(c), 0) end
    util.check_options(c, CONTROL_OPTIONS, where, 0)
    local net = c.net
    if not ((type(net) == "table" or type(net) == "userdata") and net.forward) then
      error(where .. ": net must be a ControlNet (kiln.load_controlnet), got " .. type(net), 0)
    end
    -- a ControlNet for another family would fail deep inside the UNet: say so here
    local names = { sd1 = "SD 1.x", sd2 = "SD 2.x", sdxl = "SDXL" }
    local fam, cfam = net.config and net.config.family, ckpt and ckpt.family
    if fam and cfam and fam ~= cfam then
      error(("%s: a ControlNet for %s on an %s checkpoint"):format(where, names[fam] or fam, names[cfam] or cfam), 0)
    end
    local img = c.image
    if not is_tensor(img) or #img.shape ~= 4 or img.shape[1] ~= 1 or (img.shape[2] ~= 3 and img.shape[2] ~= 4) then
      error(where .. ": image must be an image tensor [1, 3, H, W] in [0, 1], got "
        .. (is_tensor(img) and "[" .. table.concat(img.shape, ", ") .. "]" or type(img)), 0)
    end
    for _, k in ipairs({ "strength", "start", "stop" }) do
      if c[k] ~= nil and type(c[k]) ~= "number" then error(("%s: %s must be a number"):format(where, k), 0) end
    end
    for _, k in ipairs({ "start", "stop" }) do
      if c[k] and (c[k] < 0 or c[k] > 1) then error(("%s: %s must lie in [0, 1]"):format(where, k), 0) end
    end
  end
end

-- ComfyUI's ModelSamplingDiscrete.percent_to_sigma: 0 -> above every sigma, 1 -> 0,
-- else the sigma at timestep (1 - p) * 999.
local function percent_to_sigma(ms, p)
  if p <= 0 then return math.huge end
  if p >= 1 then return 0 end
  return ms.sigma((1 - p) * 999)
end

--- The run's ControlNets ready for a sampling of latents of `shape`: each net loaded
-- to the run's device, its image brought to 8x the latent size as ComfyUI's
-- ControlBase does (cut to the output's aspect ratio about the centre, then
-- nearest-exact), and its sigma range. As ComfyUI's ControlBase (set_cond_hint,
-- timestep_percent_range, get_control): a net applies at a step whose sigma s has
-- percent_to_sigma(stop) <= s <= percent_to_sigma(start), so stop = 0 never applies;
-- strength 0 leaves the conditioning unchanged (ControlNetApplyAdvanced returns it
-- as given), so such a net is dropped. Closing the result frees the resized images
-- and the encoded hints (each net's cache) and unloads the nets.
local function prepare_controls(ckpt, o, shape)
  local list = setmetatable({}, { __close = function(l)
    local seen = {}
    for _, c in ipairs(l) do
      require("kiln.controlnet").free_cache(c.cache)
      c.hint:free()
      if not seen[c.net] then seen[c.net] = true; c.net:unload() end
    end
  end })
  if not o.control then return list end
  local ms, dev = M.model_sampling(ckpt), device_of(o)
  local h, w = 8 * shape[3], 8 * shape[4]
  for _, c in ipairs(o.control) do
    local strength = c.strength or 1
    if strength ~= 0 then
      local img = c.image
      if img.shape[2] ~= 3 then img = img:narrow(2, 1, 3) end
      local hint = require("kiln.image").resize(img, w, h, { mode = "nearest-exact", crop = "center" })
      if hint.device ~= dev then
        local d = hint:to(dev)
        hint:free()
        hint = d
      end
      c.net:load(dev)
      list[#list + 1] = { net = c.net, hint = hint, strength = strength, cache = {},
        sigma_hi = percent_to_sigma(ms, c.start or 0), sigma_lo = percent_to_sigma(ms, c.stop or 1) }
    end
  end
  return list
end

--- The denoiser the samplers call: classifier-free guidance around the UNet.
-- cond and uncond go through one batched UNet call ([uncond; cond]), or two calls
-- when opts.batch_cfg is false (the default in "low" mode, where it lowers the
-- peak). o.controls: ControlNets as prepare_controls readies them ({net, hint,
-- strength, sigma_hi, sigma_lo}), their residuals summed into each UNet call (cond and
-- uncond alike). Returns function(x, sigma) -> denoised.
function M.denoiser(ckpt, cond, uncond, cfg, o)
  local batch_f = o.batch_cfg
  if batch_f == nil then batch_f = kiln.memory_mode() ~= "low" end
  if M.flow_family(ckpt) then
    -- a velocity network (kiln.flow): denoised = x - sigma * v, its distilled guidance
    local dit, g = ckpt.dit, o._flow and o._flow.guidance
    local fopts = (g or o.cache_state or o._reference) and
        { guidance = g, cache_state = o.cache_state, reference = o._reference } or nil
    local info = o.info
    local function forward(x, t, ctx, y, n, skip)
      local tt = kiln.full({ n }, t)
      local fo = fopts
      if skip then -- skip-layer guidance's pass without some blocks (no step cache)
        fo = { guidance = g, skip_layers = skip, reference = o._reference }
      end
      local ok, v = pcall(dit.forward, dit, x, tt, ctx, y, fo)
      if info then info.calls = info.calls + 1 end
      tt:free()
      if not ok then error(v, 0) end
      return v
    end
    return flow.denoiser(forward, { ms = o._ms or M.flow_sampling(ckpt, { 1, 1, 2, 2 }), cond = cond,
      uncond = uncond, y_cond = o.y_cond, y_uncond = o.y_uncond, cfg = cfg, batch = batch_f,
      skip_layer_guidance = o._flow and o._flow.skip_layer_guidance })
  end
  local unet = ckpt.unet
  local ms = M.model_sampling(ckpt)
  local v_pred = ms.prediction == "v"
  local batch = o.batch_cfg
  if batch == nil then batch = kiln.memory_mode() ~= "low" end
  local y_c, y_u = o.y_cond, o.y_uncond
  local ctx_both = batch and cfg ~= 1 and kiln.cat({ uncond, cond }, 1) or nil
  local y_both = batch and cfg ~= 1 and y_c and kiln.cat({ y_u, y_c }, 1) or nil
  -- an inpainting UNet's mask + masked latent [B, 5, h, w], after x's channels (kiln.inpaint)
  local cc = o.concat
  local cc_both = batch and cfg ~= 1 and cc and kiln.cat({ cc, cc }, 1) or nil
  local controls = o.controls or {}

  -- the summed residuals of the ControlNets active at sigma (nil: none), each net
  -- given the scaled x (without an inpainting UNet's extra channels), as the UNet
  local function control_of(xs, sigma, t, ctx, y)
    local sum
    for _, c in ipairs(controls) do
      if sigma <= c.sigma_hi and sigma >= c.sigma_lo then
        -- c.cache: the encoded hint, computed at the first step and reused
        local r = c.net:forward(xs, t, ctx, c.hint, y, { strength = c.strength, cache = c.cache })
        if not sum then
          sum = r
        else
          for i = 1, #sum do
            local s = sum[i] + r[i]
            sum[i]:free(); r[i]:free()
            sum[i] = s
          end
        end
      end
    end
    return sum
  end

  -- Every temporary below is freed where it stops being needed: left to Lua's
  -- collector, a step's latent-sized temporaries (and the UNet output the CFG halves
  -- are views of) stayed allocated for many steps, on the GPU too, since the collector
  -- sees only the small userdata.
  local function predict(xin, sigma, ctx, y, n)
    local t = kiln.full({ n }, ms.timestep(sigma))
    local c_in = 1 / math.sqrt(sigma * sigma + 1)
    local xs = xin * c_in
    local control = #controls > 0 and control_of(xs, sigma, t, ctx, y) or nil
    if cc then
      local xc = kiln.cat({ xs, n == cc.shape[1] and cc or cc_both }, 2)
      xs:free()
      xs = xc
    end
    -- the UNet frees each residual at its last use
    local fo = control and { control = control, free_control = true } or nil
    if o.cache_state then
      fo = fo or {}
      fo.cache_state = o.cache_state
    end
    if o.info then o.info.calls = o.info.calls + 1 end
    local out = unet:forward(xs, t, ctx, y, fo)
    if out ~= xs then xs:free() end
    t:free()
    if out.device ~= xin.device then -- the UNet runs where its weights are (streamed or not)
      local o = out:to(xin.device)
      out:free()
      out = o
    end
    local den, scaled
    if v_pred then   -- v-prediction: x * 1/(s^2+1) - v * s/sqrt(s^2+1)
      local xk = xin * (1 / (sigma * sigma + 1))
      scaled = out * (sigma / math.sqrt(sigma * sigma + 1))
      den = xk - scaled
      xk:free()
    else             -- eps-prediction: x - eps * sigma
      scaled = out * sigma
      den = xin - scaled
    end
    scaled:free()
    out:free()
    return den
  end

  return guidance.cfg(predict, cfg, cond, uncond, y_c, y_u,
    batch and cfg ~= 1 and { ctx = ctx_both, y = y_both } or nil)
end

--- The number of pixels an image's width and height must be a multiple of: the
-- VAE's factor (the UNet takes any latent size, as ComfyUI's: its downsamplers
-- round odd sizes up and its upsamplers meet the skip connection's size; a flow
-- transformer packs 2x2 latent patches, which latent_size checks).
function M.size_multiple(ckpt)
  return math.tointeger(ckpt.vae.factor or 8) or 8
end

--- t [1, ...] repeated to n along the batch (t itself when n is 1 or it has n).
local function repeat_batch(t, n)
  if not t or n == 1 or t.shape[1] == n then return t end
  local parts = {}
  for i = 1, n do parts[i] = t end
  return kiln.cat(parts, 1)
end

--- The batch size of a run's options, checked.
local function batch_of(o)
  local n = math.tointeger(o.batch or 1)
  if not n or n < 1 then error(("batch %s: must be a whole number from 1"):format(tostring(o.batch)), 3) end
  return n
end

--- Latent size of an image size for the checkpoint's VAE.
local function latent_size(ckpt, w, h)
  local f = M.size_multiple(ckpt)
  if w % f ~= 0 or h % f ~= 0 then
    error(("image size %dx%d pixels: width and height must be multiples of %d"):format(w, h, f), 3)
  end
  if M.flow_family(ckpt) and ((w // f) % 2 ~= 0 or (h // f) % 2 ~= 0) then
    error(("image size %dx%d pixels: %s packs the latent (%dx%d) in 2x2 patches: width and height / %d must be " ..
      "even (multiples of %d pixels)"):format(w, h, family.label(ckpt.family), w // f, h // f, f, 2 * f), 3)
  end
  return w // f, h // f
end

-- A budget the step callback lowered itself (kiln.mem.set_budget without live) below
-- what the run needs (the most it reserved so far): it holds at once, and the run's
-- suspend points adapt only to a live lowering, so the UNet, resident and pinned again
-- by its next pass, would leave no room for that pass's activations. Between steps no
-- network runs: what the run needs beyond the budget is evicted now (the UNet, least
-- recently used and unpinned), and an evicted UNet streams from its next pass. A live
-- lowering (in its grace) is left to the next suspend point, which streams.
function lowered_between_steps(dev, before)
  local s = kiln.mem.stats(dev)
  if s.budget == 0 or (before ~= 0 and s.budget >= before) then return end
  local w = kiln.mem.budget_watch(dev)
  if w.grace then return end
  local need = math.max(s.reserved, w.peak_before)
  if need > s.budget then kiln.mem.evict(dev, need - s.budget) end
end

--- Samples latents: from noise (x0 = nil) or from x0 at denoise < 1.
function M.sample_latents(ckpt, cond, uncond, o, x0, shape)
  -- o.sigmas: a schedule given whole (ComfyUI's KSamplerAdvanced steps); o.add_noise =
  -- false starts from x0 as it is (zero noise), as its add_noise "disable"
  local F = M.flow_family(ckpt)
  local sigmas = o.sigmas or M.sigmas(ckpt, o.scheduler, o.steps, o.denoise, shape)
  local s = sigmas:table()
  local noise = o.add_noise == false and kiln.zeros(shape) or kiln.randn(shape, { seed = o.seed })
  local x
  if F then -- flow matching: (1 - t) x0 + t noise
    x = flow.noise_scaling(s[1], noise, x0)
  else
    x = x0 and (x0 + noise * s[1]) or (noise * s[1])
  end
  -- a batch: the same conditioning for every image (copies freed after sampling)
  local n, copies = shape[1], {}
  local function rep(t)
    local r = repeat_batch(t, n)
    if r ~= t then copies[#copies + 1] = r end
    return r
  end
  cond, uncond = rep(cond), rep(uncond)
  local od = setmetatable({ y_cond = rep(o.y_cond), y_uncond = rep(o.y_uncond),
    _ms = F and M.flow_sampling(ckpt, shape) or nil }, { __index = o })
  if o.concat_mask and x0 then  -- an inpainting UNet (kiln.inpaint): mask and masked latent
    -- o.concat_latent: the masked image's own latent (ComfyUI's InpaintModelConditioning)
    od.concat = kiln.cat({ rep(o.concat_mask), o.concat_latent and rep(o.concat_latent) or x0 }, 2)
    copies[#copies + 1] = od.concat
  end
  local controls <close> = prepare_controls(ckpt, o, shape)
  od.controls = controls
  -- opts.cache: one step cache for this sampling, its tensors freed when it ends
  local cache <close> = step_cache.new(o._cache_spec or (o.cache and M.cache_spec(o, ckpt)) or nil)
  od.cache_state = cache
  local calls0 = o.info and o.info.calls
  local den, den_close = M.denoiser(ckpt, cond, uncond, o.cfg, od)
  local den_copies <close> = den_close and setmetatable({}, { __close = den_close }) or nil
  if o.unet_tile then    -- MultiDiffusion: each step denoises overlapping latent tiles
    den = require("kiln.tiling").multidiffusion(den, { tile = o.unet_tile, overlap = o.unet_overlap or o.unet_tile // 4,
      tileable = o.tileable })
  end
  if o.denoise_mask and x0 then -- inpainting: the kept region follows the input (kiln.inpaint)
    den = require("kiln.inpaint").masked_denoiser(den, o.denoise_mask, x0, noise, F and flow.noise_scaling or nil)
  end
  local bar = progress.start("sample", #s - 1)
  local preview <close> = require("kiln.preview").session(ckpt, o, device_of(o)) -- opts.preview, the host's
  local t0 = kiln.time()
  local out = sample.run(o.sampler, den, x, sigmas, {
    seed = o.seed, eta = o.eta, s_noise = o.s_noise, progress = false, -- the bar reports
    model_sampling = M.model_sampling(ckpt), -- tcd's timesteps
    callback = function(st)
      bar:step(st.i)
      preview(st)
      if kiln.cancelled and kiln.cancelled() then return false end
      if o.callback then
        local dev = device_of(o)
        local budget = kiln.mem.stats(dev).budget
        local r = o.callback(st)
        lowered_between_steps(dev, budget)
        return r
      end
    end,
  })
  o._seconds_per_step = (kiln.time() - t0) / math.max(#s - 1, 1)
  if o.info then
    o.info.steps = o.info.steps + #s - 1
    o.info.evals = o.info.evals + (cache and cache.evals or o.info.calls - calls0)
  end
  noise:free()
  for _, c in ipairs(copies) do c:free() end
  return out
end

--- opts.mode = "auto" (--mode auto): kiln.planner picks the memory mode and the
-- VAE tiling for this run's size from the device's budget, and prints why.
local function plan_memory(ckpt, o, W, H)
  if o.mode ~= "auto" then
    M.net(ckpt).resident_plan = nil          -- a plan of an earlier auto run does not carry over
    return
  end
  o.width, o.height = o.width or W, o.height or H
  o.device = device_of(o)
  require("kiln.planner").apply(ckpt, o)
end

--- The conditioning of a run: cond and uncond, and for a UNet with vector
-- conditioning (SDXL) y = pooled text + the size embeddings of a W x H picture
-- (uncropped, original = target size, as ComfyUI's default) in o.y_cond / o.y_uncond.
local function conditioning(ckpt, o, W, H)
  local F = M.flow_family(ckpt)
  if F then -- the family's encoders, each loaded and unloaded in turn (F.encode_prompts)
    local prompts = { o.prompt }
    if o.cfg ~= 1 then prompts[2] = o.negative or "" end
    local ctx, pooled = F.encode_prompts(ckpt, prompts, o._flow.t5_length, device_of(o))
    o.y_cond, o.y_uncond = pooled[1], pooled[2]
    return ctx[1], ctx[2]
  end
  local cond, uncond, pooled, upooled = M.encode_prompts(ckpt, o.prompt, o.negative,
    { clip_skip = o.clip_skip, weighting = o.weighting })
  if ckpt.unet.config.adm_in_channels then
    if not (pooled and upooled) then
      error("this UNet needs a pooled text vector (SDXL), but the text encoder gave none", 6)
    end
    local size = { width = W, height = H }
    o.y_cond, o.y_uncond = ckpt.unet:sdxl_vector(pooled, size), ckpt.unet:sdxl_vector(upooled, size)
  end
  if pooled then pooled:free() end
  if upooled then upooled:free() end
  return cond, uncond
end

-- A run that fails (an error, an out-of-memory, a cancel) leaves the checkpoint's parts
-- unloaded, as a finished run does: closing the result with an error unloads them.
local function unload_on_error(ckpt)
  return setmetatable({}, { __close = function(_, err)
    if err == nil then return end
    local function unload_all()
      for _, name in ipairs({ "clip", "t5", "unet", "dit", "vae" }) do
        local part = rawget(ckpt, name)
        -- a part the checkpoint lacks stands in as a table that raises on any use
        local ok, unload = pcall(function() return part and part.unload end)
        if ok and unload then part:unload() end
      end
    end
    -- a cancel still requested raises again from the count hook every few thousand
    -- instructions, also in here (a part's methods are Lua): the whole loop is
    -- protected, and a second try runs clear of it (unloading twice is harmless)
    if not pcall(unload_all) then pcall(unload_all) end
  end })
end

-- The run's LoRAs (opts.lora and the prompt's <lora:NAME:W> tags) applied for the
-- run: o.prompt loses the tags; closing the result removes them.
local function run_loras(ckpt, o, opts)
  local prompt, list = extra_networks.of_run(o)
  o.prompt = prompt
  local applied = extra_networks.apply(ckpt, list)
  if #list > 0 then few_step_defaults(o, opts, ckpt) end -- an LCM-LoRA named in the prompt
  return applied
end

local function free_y(o)
  if o.y_cond then o.y_cond:free() end
  if o.y_uncond then o.y_uncond:free() end
  o.y_cond, o.y_uncond = nil, nil
end

-- cond and uncond after sampling (a flow run without a negative pass has no uncond)
local function free_cond(cond, uncond)
  cond:free()
  if uncond then uncond:free() end
end

-- A flow family's encoders load and unload themselves (F.encode_prompts); SD's CLIP
-- is loaded around the conditioning here.
local function encode_stage(ckpt, o, W, H, dev)
  if M.flow_family(ckpt) then return conditioning(ckpt, o, W, H) end
  ckpt.clip:load(dev)
  local c, u = conditioning(ckpt, o, W, H)
  ckpt.clip:unload()                     -- the text encoder is not needed again
  return c, u
end

-- the channels of the run's latents
local function latent_channels(ckpt)
  local F = family.get(ckpt.family)
  if M.flow_family(ckpt) then return F.latent.channels end
  return ckpt.vae.latent_channels or 4
end

-- A stage of a run: a span in traces, and a named stretch of the memory picture
-- (kiln.mem.plot) with its own peak.
-- a stage starts and ends with a full collection: what the previous one left to the
-- collector is not held through it (and a dry run, which holds the collector, sees the
-- same; kiln.dry_run)
local function stage(name, fn)
  collectgarbage()
  return (function(...) collectgarbage() return ... end)(kiln.trace.span(name, fn))
end

-- The last stage of the pipelines: the latents through the VAE decoder.
local function decode(ckpt, dev, lat, o)
  return stage("decode", function()
    ckpt.vae:load(dev)
    local img = ckpt.vae:decode(lat, { tile = o.tile, overlap = o.overlap })
    ckpt.vae:unload()
    return img
  end)
end

-- Flux Kontext: opts.reference's pictures through the VAE encoder before sampling
-- (o._reference, read by the denoiser); closing the result frees them.
local function reference_stage(ckpt, o, dev)
  if o.reference == nil then return nil end
  o._reference = stage("reference encode", function()
    local l = M.flow_family(ckpt).reference_latents(ckpt, o.reference, o.reference_scale, dev, o.tile)
    ckpt.vae:offload()                     -- needed again for the decode; keep it on the host
    return l
  end)
  return setmetatable({}, { __close = function()
    for _, t in ipairs(o._reference or {}) do t:free() end
    o._reference = nil
  end })
end

--- txt2img: text -> images [batch, 3, H, W] in [0, 1] (and the final latents).
function M.txt2img(ckpt, opts)
  M.check_options("txt2img", opts)
  local o = opts_with_defaults(opts, ckpt)
  local n = batch_of(o)
  local W = o.width or M.image_size(ckpt)
  local H = o.height or M.image_size(ckpt)
  local lw, lh = latent_size(ckpt, W, H)
  local dev = device_of(o)
  local vae <close> = run_vae(ckpt, o)
  local loras <close> = run_loras(ckpt, o, opts)  -- before the plan: it lists them
  local tileable <close> = run_tileable(ckpt, o)
  local parts <close> = unload_on_error(ckpt)
  plan_memory(ckpt, o, W, H)
  local on_dev <close> = M.on_device(dev)  -- after the plan: it may choose the CPU
  local refs <close> = reference_stage(ckpt, o, dev)

  local cond, uncond = stage("encode", function() return encode_stage(ckpt, o, W, H, dev) end)

  local lat = stage("sample", function()
    M.net(ckpt):load(dev)
    local l = M.sample_latents(ckpt, cond, uncond, o, nil, { n, latent_channels(ckpt), lh, lw })
    free_cond(cond, uncond); free_y(o)
    M.net(ckpt):unload()                   -- make room for the decoder
    return l
  end)

  return decode(ckpt, dev, lat, o), lat, o.info
end

--- img2img: an input image [1, 3, H, W] in [0, 1] re-generated at o.denoise
-- (o.batch times, each from its own noise of the one seed).
function M.img2img(ckpt, image, opts)
  M.check_options("img2img", opts)
  local o = opts_with_defaults(opts, ckpt)
  local n = batch_of(o)
  if (opts or {}).denoise == nil then o.denoise = 0.6 end
  local dev = device_of(o)
  local H, W = image.shape[3], image.shape[4]
  latent_size(ckpt, W, H)
  local vae <close> = run_vae(ckpt, o)
  local loras <close> = run_loras(ckpt, o, opts)  -- before the plan: it lists them
  local tileable <close> = run_tileable(ckpt, o)
  local parts <close> = unload_on_error(ckpt)
  plan_memory(ckpt, o, W, H)
  local on_dev <close> = M.on_device(dev)  -- after the plan: it may choose the CPU

  local x0 = stage("vae encode", function()
    ckpt.vae:load(dev)
    local x = ckpt.vae:encode(image:narrow(2, 1, 3), { tile = o.tile, overlap = o.overlap })
    if n > 1 and x.shape[1] == 1 then
      local r = repeat_batch(x, n)
      x:free()
      x = r
    end
    ckpt.vae:offload()                     -- needed again for the decode; keep it on the host
    return x
  end)
  local refs <close> = reference_stage(ckpt, o, dev)

  local cond, uncond = stage("encode", function() return encode_stage(ckpt, o, W, H, dev) end)

  local lat = stage("sample", function()
    M.net(ckpt):load(dev)
    local l = M.sample_latents(ckpt, cond, uncond, o, x0, x0.shape)
    x0:free(); free_cond(cond, uncond); free_y(o)
    M.net(ckpt):unload()
    return l
  end)

  return decode(ckpt, dev, lat, o), lat, o.info
end

--- inpainting: image [1, 3, H, W], mask [1, 1, H, W] (1 = repaint); see kiln.inpaint.
function M.inpaint(ckpt, image, mask, opts)
  M.check_options("inpaint", opts)
  local vae <close> = run_vae(ckpt, opts or {})
  return require("kiln.inpaint").run(ckpt, image, mask, opts)
end

--- hires fix: sample small, upscale (latent nearest/bilinear, the decoded image, or
-- the decoded image through an upscale model: opts.upscale = "model:FILE" or an
-- upscaler of kiln.load_upscaler), then sample again at a partial denoise.
function M.hires_fix(ckpt, opts)
  M.check_options("hires_fix", opts)
  local o = opts_with_defaults(opts, ckpt)
  local n = batch_of(o)
  local scale = o.scale or 2
  local upscale = o.upscale or "latent-bilinear"
  local dev = device_of(o)
  local W = o.width or M.image_size(ckpt)
  local H = o.height or M.image_size(ckpt)
  local lw, lh = latent_size(ckpt, W, H)
  local W2, H2 = math.floor(W * scale), math.floor(H * scale)
  local lw2, lh2 = latent_size(ckpt, W2, H2)
  local vae <close> = run_vae(ckpt, o)
  local loras <close> = run_loras(ckpt, o, opts)  -- before the plan: it lists them
  local tileable <close> = run_tileable(ckpt, o)
  local parts <close> = unload_on_error(ckpt)
  plan_memory(ckpt, o, W2, H2)             -- sized for the larger pass
  local on_dev <close> = M.on_device(dev)  -- after the plan: it may choose the CPU
  local refs <close> = reference_stage(ckpt, o, dev)

  -- SDXL: both passes aim at the final size
  local cond, uncond = stage("encode", function() return encode_stage(ckpt, o, W2, H2, dev) end)

  local lat = stage("sample", function()
    M.net(ckpt):load(dev)
    local first = opts_with_defaults(opts, ckpt)
    first.denoise = 1
    first.info = o.info                    -- one record for both passes
    first.y_cond, first.y_uncond = o.y_cond, o.y_uncond
    first._reference = o._reference
    return M.sample_latents(ckpt, cond, uncond, first, nil, { n, latent_channels(ckpt), lh, lw })
  end)

  local up = stage("upscale", function()
    local up
    if upscale == "latent-nearest" or upscale == "latent-bilinear" then
      local mode = upscale == "latent-nearest" and "nearest-exact" or "bilinear"
      up = kiln.nn.interpolate(lat, { size = { lh2, lw2 }, mode = mode })
    elseif upscale == "image" then
      M.net(ckpt):offload()                  -- the decoder/encoder need the room now
      ckpt.vae:load(dev)
      local img = ckpt.vae:decode(lat, { tile = o.tile, overlap = o.overlap })
      local big = kiln.nn.interpolate(img, { size = { H2, W2 }, mode = "bilinear" }):clamp(0, 1)
      img:free()
      up = ckpt.vae:encode(big, { tile = o.tile, overlap = o.overlap })
      big:free()
      ckpt.vae:offload()
      M.net(ckpt):load(dev)
    elseif type(upscale) ~= "string" or upscale:match("^model:") then
      -- an upscale model (kiln.load_upscaler's, or "model:FILE"): the decoded image through
      -- it, resized to the second pass's size, encoded again
      M.net(ckpt):offload()
      ckpt.vae:load(dev)
      local img = ckpt.vae:decode(lat, { tile = o.tile, overlap = o.overlap })
      ckpt.vae:offload()
      local big = require("kiln.upscaler").upscale_to(upscale, img, H2, W2, dev, o.tileable)
      img:free()
      ckpt.vae:load(dev)
      up = ckpt.vae:encode(big, { tile = o.tile, overlap = o.overlap })
      big:free()
      ckpt.vae:offload()
      M.net(ckpt):load(dev)
    else
      error(("unknown upscale '%s' (latent-nearest, latent-bilinear, image, model:FILE or an upscaler)"):format(upscale), 5)
    end
    lat:free()
    return up
  end)

  local second = opts_with_defaults(opts, ckpt)
  second.denoise = o.hires_denoise or 0.5
  second.info = o.info
  second.steps = o.hires_steps or o.steps
  second.seed = o.seed + 1
  second.unet_tile = o.hires_tile   -- large upscale passes: MultiDiffusion tiles (latent units)
  second.y_cond, second.y_uncond = o.y_cond, o.y_uncond
  second._reference = o._reference
  local lat2 = stage("sample hires", function()
    local l = M.sample_latents(ckpt, cond, uncond, second, up, up.shape)
    up:free(); free_cond(cond, uncond); free_y(o)
    M.net(ckpt):unload()
    return l
  end)

  return decode(ckpt, dev, lat2, o), lat2, o.info
end

-- The A1111 label of a registry entry (kiln.sample), else the name as given.
local function label_of(info, name) return info and info.label or tostring(name) end

-- The steps, sampler, scheduler and cfg a run with these opts sampled with where opts
-- give none, found again after the run (its own LoRAs are removed by then: the files
-- the run named are asked what they are): the family's or its variant's, the model's
-- kiln.cfg, a few-step kind's.
local function run_sampling(opts, ckpt)
  local r = { steps = opts.steps, sampler = opts.sampler, scheduler = opts.scheduler, cfg = opts.cfg }
  local F = M.flow_family(ckpt)
  if F then
    local v = F.variants and F.variants[ckpt.variant] or {}
    for _, k in ipairs(FLOW_DEFAULTS) do
      if r[k] == nil then
        r[k] = v[k]
        if r[k] == nil then r[k] = F.defaults[k] end
      end
    end
  end
  if r.cfg == nil then r.cfg = M.default_cfg(ckpt) end
  local later = {}
  if ckpt and ckpt.find_lora ~= nil and (opts.lora or (opts.prompt or ""):find("<lora:", 1, true)) then
    local _, list = extra_networks.of_run(opts)
    for _, e in ipairs(list) do
      local ok, path = pcall(function() return e.path or ckpt:find_lora(e.name) end)
      local okm, _, meta = pcall(kiln.load_safetensors, ok and path or "")
      local fs = okm and few_step_kind.of_file(meta, path) or nil
      later[#later + 1] = { name = e.name, unet = e.unet, few_step = fs or nil }
    end
  end
  few_step_kind.fill(r, opts, ckpt, F ~= nil, later)
  for k, v in pairs(DEFAULTS) do if r[k] == nil then r[k] = v end end
  return r
end

--- The A1111 "parameters" text for a PNG (other tools read it).
function M.parameters(opts, ckpt, extra)
  local sampling = run_sampling(opts, ckpt)
  local o = setmetatable({}, { __index = function(_, k)
    local v = opts[k]
    if v == nil then v = sampling[k] end
    if v == nil then v = DEFAULTS[k] end
    return v
  end })
  local lines = { o.prompt or "" }
  if o.negative and o.negative ~= "" then lines[#lines + 1] = "Negative prompt: " .. o.negative end
  local f = {
    ("Steps: %d"):format(o.steps),
    ("Sampler: %s"):format(label_of(sample.sampler_info(o.sampler), o.sampler)),
    ("Schedule type: %s"):format(label_of(sample.scheduler_info(o.scheduler), o.scheduler)),
    ("CFG scale: %g"):format(o.cfg),
    ("Seed: %d"):format(o.seed),
    ("Size: %dx%d"):format(o.width or 0, o.height or 0),
  }
  local hash = ckpt and M.model_hash(ckpt)
  if hash then f[#f + 1] = "Model hash: " .. hash end
  if ckpt and ckpt.path then
    f[#f + 1] = "Model: " .. ckpt.path:gsub("^.*/", ""):gsub("%.safetensors$", "")
  end
  if o.denoise and o.denoise < 1 then f[#f + 1] = ("Denoising strength: %g"):format(o.denoise) end
  if o.clip_skip then f[#f + 1] = ("Clip skip: %d"):format(o.clip_skip) end
  if o.weighting and o.weighting ~= "a1111" then f[#f + 1] = "Weighting: " .. o.weighting end
  if (o.batch or 1) > 1 then f[#f + 1] = ("Batch size: %d"):format(o.batch) end
  if o.tileable and o.tileable ~= "" then f[#f + 1] = "Tileable: " .. o.tileable end
  f[#f + 1] = "Precision: " .. kiln.precision_of(opts.device or kiln.default_device())
  f[#f + 1] = extra_networks.hashes_field(ckpt, o)
  for _, e in ipairs(extra or {}) do f[#f + 1] = e end
  f[#f + 1] = "Version: kiln " .. kiln.version
  lines[#lines + 1] = table.concat(f, ", ")
  return table.concat(lines, "\n")
end

--- The measured peak of every device that held bytes ("cpu: 80.2 MiB, sim: 459.1 MiB"),
-- since kiln.mem.reset_peak: the PNG's kiln.peak text. nil when none did.
function M.peak_text()
  local parts = {}
  for _, d in ipairs(kiln.devices()) do
    local p = d ~= "meta" and kiln.mem.stats(d).peak or 0
    if p > 0 then parts[#parts + 1] = ("%s: %.1f MiB"):format(d, p / 1048576) end
  end
  return #parts > 0 and table.concat(parts, ", ") or nil
end

--- Saves an image with its generation parameters (extra: more "Key: value" fields) and
-- the peak memory it took (kiln.peak), unless extra.peak == false: a peak varies from
-- run to run, which a file that must be the same bytes every time cannot carry.
function M.save(img, path, o, ckpt, extra)
  local peak = not (extra and extra.peak == false) and M.peak_text() or nil
  return kiln.save_png(img, path, { text = { parameters = M.parameters(o, ckpt, extra),
    Software = "kiln " .. kiln.version, ["kiln.peak"] = peak } })
end

return M
