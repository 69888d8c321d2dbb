-- kiln.comfy_nodes: the ComfyUI node types kiln runs, each with its inputs (name,
-- type, ComfyUI's default), its output types and the function that computes it from
-- kiln's models, pipelines and image helpers. kiln.comfy owns the graph around them.
--
-- A value on a link is a table {type = T, ...}; the tensors and models it holds are
-- listed in v.tensors and v.res, which kiln.comfy counts so that a tensor is freed and
-- a model unloaded when the last value holding it dies (ctx:value makes them).
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"
local inpaint = require "kiln.inpaint"
local image = require "kiln.image"
local sample = require "kiln.sample"
local lfs = require "lfs"

local N = {}
local fmt = string.format

-- ------------------------------------------------------------------ helpers

local function fail(ctx, msg) error(fmt("%s: %s", ctx.where, msg), 0) end

local function to_cpu(t)
  if t.device == "cpu" then return t, false end
  return t:to("cpu"), true
end

-- round(x) for x in [0, 1] as torch.round (half to even: 0.5 -> 0)
local function round01(t) return inpaint.grow_mask(t, 0) end

-- The upscale_method names each kind of node takes, as ComfyUI lists them: latents
-- have bislerp, pictures lanczos (Pillow's, on 8 bits); kiln.image.resize computes all
local LATENT_METHODS = { "nearest-exact", "bilinear", "area", "bicubic", "bislerp" }
local IMAGE_METHODS = { "nearest-exact", "bilinear", "area", "bicubic", "lanczos" }

local function scale_mode(ctx, m, list)
  for _, x in ipairs(list) do if x == m then return m end end
  fail(ctx, fmt("upscale_method '%s' is not one of %s", tostring(m), table.concat(list, ", ")))
end

-- common_upscale of ComfyUI (kiln.image.resize) for latents and images alike
local function resize(ctx, t, w, h, method, crop, list)
  return image.resize(t, w, h, { mode = scale_mode(ctx, method, list), crop = crop or "disabled" })
end

-- ComfyUI rounds a scaled size to the nearest whole number (Python's round)
local pyround = require("kiln.util").round_half_even

local add_lora -- (below, with the conditioning)

-- the model behind a value, loaded to the run's device for this node
local function use(ctx, part) ctx:use(part) return part end

-- ------------------------------------------------------------------ loaders

N.CheckpointLoaderSimple = {
  inputs = { { "ckpt_name", "FILE:checkpoints" } },
  outputs = { "MODEL", "CLIP", "VAE" },
  run = function(ctx, a)
    local ckpt = ctx:checkpoint(a.ckpt_name)
    return {
      ctx:value("MODEL", { ckpt = ckpt, part = ckpt.unet, loras = {} }, nil, { ckpt.unet }),
      ctx:value("CLIP", { ckpt = ckpt, part = ckpt.clip, loras = {} }, nil, { ckpt.clip }),
      ctx:value("VAE", { ckpt = ckpt, part = ckpt.vae }, nil, { ckpt.vae }),
    }
  end,
}

-- a LoRA on a MODEL / CLIP value: a new value with the file added to its list; the
-- patches go on when the model runs (KSampler, CLIPTextEncode) and come off after,
-- so the value the LoRA came from stays as it was
local function with_lora(ctx, v, path, strength)
  local loras = {}
  for i, l in ipairs(v.loras) do loras[i] = l end
  if strength ~= 0 then loras[#loras + 1] = { path = path, strength = strength } end
  local fields = {}
  for k, x in pairs(v) do fields[k] = x end
  fields.loras = loras
  fields.tensors, fields.res, fields.type = nil, nil, nil
  return ctx:value(v.type, fields, nil, v.res)
end

N.LoraLoader = {
  inputs = { { "model", "MODEL" }, { "clip", "CLIP" }, { "lora_name", "FILE:loras" },
    { "strength_model", "FLOAT", 1.0 }, { "strength_clip", "FLOAT", 1.0 } },
  outputs = { "MODEL", "CLIP" },
  run = function(ctx, a)
    return { with_lora(ctx, a.model, a.lora_name, a.strength_model), with_lora(ctx, a.clip, a.lora_name, a.strength_clip) }
  end,
}

N.LoraLoaderModelOnly = {
  inputs = { { "model", "MODEL" }, { "lora_name", "FILE:loras" }, { "strength_model", "FLOAT", 1.0 } },
  outputs = { "MODEL" },
  run = function(ctx, a) return { with_lora(ctx, a.model, a.lora_name, a.strength_model) } end,
}

N.CLIPSetLastLayer = {
  inputs = { { "clip", "CLIP" }, { "stop_at_clip_layer", "INT", -1 } },
  outputs = { "CLIP" },
  run = function(ctx, a)
    local n = a.stop_at_clip_layer
    if n >= 0 then fail(ctx, fmt("stop_at_clip_layer %d: must be -1 (the last layer) or below", n)) end
    local fields = { ckpt = a.clip.ckpt, part = a.clip.part, loras = a.clip.loras, clip_skip = -n,
      device = a.clip.device }
    return { ctx:value("CLIP", fields, nil, a.clip.res) }
  end,
}

N.ControlNetLoader = {
  inputs = { { "control_net_name", "FILE:controlnet" } },
  outputs = { "CONTROL_NET" },
  run = function(ctx, a)
    local net = ctx:own_model(kiln.load_controlnet(a.control_net_name))
    return { ctx:value("CONTROL_NET", { net = net }, nil, { net }) }
  end,
}

-- UNETLoader's weight_dtype: the dtype the weights take on the device ("_fast" is
-- ComfyUI's fp8 matrix multiply; kiln computes in its precision either way)
local WEIGHT_DTYPES = { default = false, fp8_e4m3fn = "f8_e4m3fn", fp8_e4m3fn_fast = "f8_e4m3fn",
  fp8_e5m2 = "f8_e5m2" }

local function one_of(ctx, what, v, t)
  if t[v] == nil then
    local names = {}
    for k in pairs(t) do names[#names + 1] = k end
    table.sort(names)
    fail(ctx, fmt("%s '%s' is not supported (supported: %s)", what, tostring(v), table.concat(names, ", ")))
  end
  return t[v]
end

-- a UNet alone (safetensors in any dtype kiln reads, fp8, or GGUF): kiln.load_checkpoint
-- of the file gives a checkpoint whose only part is the UNet (the family, prediction and
-- scale factor from its shapes and metadata)
local function unet_value(ctx, path, dtype)
  local ckpt = ctx:checkpoint(path)
  local unet = rawget(ckpt, "unet")
  if not unet then fail(ctx, path .. ": no UNet in this file") end
  return ctx:value("MODEL", { ckpt = ckpt, part = unet, loras = {}, dtype = dtype or nil }, nil, { unet })
end

N.UNETLoader = {
  inputs = { { "unet_name", "FILE:diffusion_models|unet" }, { "weight_dtype", "STRING", "default", { "default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2" } } },
  outputs = { "MODEL" },
  run = function(ctx, a)
    return { unet_value(ctx, a.unet_name, one_of(ctx, "weight_dtype", a.weight_dtype, WEIGHT_DTYPES)) }
  end,
}

-- ComfyUI-GGUF's loader (its files sit in unet/ or diffusion_models/)
N.UnetLoaderGGUF = {
  inputs = { { "unet_name", "FILE:unet|diffusion_models" } },
  outputs = { "MODEL" },
  run = function(ctx, a) return { unet_value(ctx, a.unet_name) } end,
}

-- CLIPLoader's and DualCLIPLoader's types kiln has models for: the family (nil: told
-- by the encoder, SD 1.x or 2.x, as ComfyUI's stable_diffusion type does)
local CLIP_TYPES = { stable_diffusion = false }
local DUAL_CLIP_TYPES = { sdxl = "sdxl" }
local CLIP_DEVICES = { default = false, cpu = "cpu" }

local function clip_value(ctx, paths, family, device)
  local ckpt = ctx:text_encoders(paths, family or nil)
  return ctx:value("CLIP", { ckpt = ckpt, part = ckpt.clip, loras = {}, device = device or nil }, nil, { ckpt.clip })
end

N.CLIPLoader = {
  inputs = { { "clip_name", "FILE:text_encoders|clip" }, { "type", "STRING", "stable_diffusion", { "stable_diffusion" } },
    { "device", "STRING", "default", { "default", "cpu" } } },
  outputs = { "CLIP" },
  run = function(ctx, a)
    local fam = one_of(ctx, "type", a.type, CLIP_TYPES)
    return { clip_value(ctx, { a.clip_name }, fam, one_of(ctx, "device", a.device, CLIP_DEVICES)) }
  end,
}

N.DualCLIPLoader = {
  inputs = { { "clip_name1", "FILE:text_encoders|clip" }, { "clip_name2", "FILE:text_encoders|clip" },
    { "type", "STRING", "sdxl", { "sdxl" } }, { "device", "STRING", "default", { "default", "cpu" } } },
  outputs = { "CLIP" },
  run = function(ctx, a)
    local fam = one_of(ctx, "type", a.type, DUAL_CLIP_TYPES)
    return { clip_value(ctx, { a.clip_name1, a.clip_name2 }, fam, one_of(ctx, "device", a.device, CLIP_DEVICES)) }
  end,
}

-- VAELoader's names for the TAESDs in vae_approx/ (ComfyUI lists one when its decoder
-- and encoder are there); the 16-channel ones (taesd3, taef1) have no kiln model to go with
local TAESD_NAMES = { taesd = true, taesdxl = true }

--- The file a loader's name stands for: (folder, candidate file names) or nil.
function N.file_alias(folder, name)
  if folder == "vae" and TAESD_NAMES[name] then
    return "vae_approx", { name .. "_decoder.safetensors", name .. "_decoder.sft" }
  end
end

N.VAELoader = {
  inputs = { { "vae_name", "FILE:vae" } },
  outputs = { "VAE" },
  run = function(ctx, a)
    local path = a.vae_name
    local taesd = require "kiln.taesd"
    local vae
    if taesd.is_file(path) then
      -- a TAESD works on the model's scaled latents as kiln's VAE does: no factor to set
      local enc = path:gsub("_decoder(%.[^/]*)$", "_encoder%1")
      vae = kiln.load_taesd({ decoder = path, encoder = enc ~= path and lfs.attributes(enc, "mode") == "file" and enc or nil })
    else
      vae = require("kiln.checkpoint").load_vae(path, { scale_factor = ctx:latent_scale() })
    end
    ctx:own_model(vae)
    ctx.names[vae] = path:match("([^/]+)$")
    return { ctx:value("VAE", { part = vae }, nil, { vae }) }
  end,
}

-- The loaders whose file is a UNet, with the input naming it (the graph's latent scale
-- factor is theirs: kiln.comfy's latent_scale).
N.MODEL_LOADERS = { CheckpointLoaderSimple = "ckpt_name", UNETLoader = "unet_name", UnetLoaderGGUF = "unet_name" }

N.UpscaleModelLoader = {
  inputs = { { "model_name", "FILE:upscale_models" } },
  outputs = { "UPSCALE_MODEL" },
  run = function(ctx, a)
    local up = ctx:own_model(kiln.load_upscaler(a.model_name))
    return { ctx:value("UPSCALE_MODEL", { up = up }, nil, { up }) }
  end,
}

-- ------------------------------------------------------------------ conditioning

-- ComfyUI's conditioning: a list of entries {cond [1, L, dim], pooled, ...}; an entry
-- is a table {cond =, pooled =, control = {...}, size = {...}, concat_latent =, concat_mask =}
local function cond_value(ctx, entries)
  local tensors = {}
  for _, e in ipairs(entries) do
    e.control = e.control or {}
    for _, k in ipairs({ "cond", "pooled", "concat_latent", "concat_mask" }) do
      if e[k] then tensors[#tensors + 1] = e[k] end
    end
    for _, c in ipairs(e.control or {}) do tensors[#tensors + 1] = c.image end
  end
  local res = {}
  for _, e in ipairs(entries) do
    for _, c in ipairs(e.control or {}) do res[#res + 1] = c.net end
  end
  return ctx:value("CONDITIONING", { entries = entries }, tensors, res)
end

local function copy_entry(e)
  local r = {}
  for k, v in pairs(e) do r[k] = v end
  r.control = {}
  for i, c in ipairs(e.control or {}) do r.control[i] = c end
  return r
end

-- A LoRA on a checkpoint for one use (a handle to remove after). A part loaded alone
-- (UNETLoader, CLIPLoader) has nothing for the other part's keys: a LoRA of only those
-- changes nothing there, as in ComfyUI, instead of failing for matching no weight.
local NO_HANDLE = { remove = function() end }
add_lora = function(ckpt, path, o)
  local alone = not (rawget(ckpt, "unet") and rawget(ckpt, "clip"))
  if not alone then return ckpt:add_lora(path, o) end
  local ok, h = pcall(ckpt.add_lora, ckpt, path, o)
  if ok then return h end
  if tostring(h):match("none of its %d+ keys matches a weight") then return NO_HANDLE end
  error(h, 0)
end

-- the text encoder of a CLIP value with its LoRAs on, for fn(clip)
local function with_clip(ctx, clip, fn)
  local ckpt = clip.ckpt
  local hs = {}
  for _, l in ipairs(clip.loras) do hs[#hs + 1] = add_lora(ckpt, l.path, { unet = 0, clip = l.strength }) end
  ctx:use(clip.part, { device = clip.device })
  local ok, a, b = pcall(fn, clip.part)
  for i = #hs, 1, -1 do hs[i]:remove() end
  if not ok then error(a, 0) end
  return a, b
end

local function encode(ctx, clip, text)
  return with_clip(ctx, clip, function(part)
    return part:encode(text, { clip_skip = clip.clip_skip, weighting = "comfy" })
  end)
end

N.CLIPTextEncode = {
  inputs = { { "text", "STRING" }, { "clip", "CLIP" } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    local cond, pooled = encode(ctx, a.clip, a.text)
    return { cond_value(ctx, { { cond = cond, pooled = pooled } }) }
  end,
}

N.CLIPTextEncodeSDXL = {
  inputs = { { "clip", "CLIP" }, { "width", "INT", 1024 }, { "height", "INT", 1024 }, { "crop_w", "INT", 0 },
    { "crop_h", "INT", 0 }, { "target_width", "INT", 1024 }, { "target_height", "INT", 1024 },
    { "text_g", "STRING" }, { "text_l", "STRING" } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    if a.text_g ~= a.text_l then
      fail(ctx, "different text_g and text_l are not supported yet (kiln encodes one text with both encoders)")
    end
    local cond, pooled = encode(ctx, a.clip, a.text_g)
    local size = { width = a.width, height = a.height, orig_width = a.width, orig_height = a.height,
      crop_left = a.crop_w, crop_top = a.crop_h, target_width = a.target_width, target_height = a.target_height }
    return { cond_value(ctx, { { cond = cond, pooled = pooled, size = size } }) }
  end,
}

N.ConditioningCombine = {
  inputs = { { "conditioning_1", "CONDITIONING" }, { "conditioning_2", "CONDITIONING" } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    local list = {}
    for _, e in ipairs(a.conditioning_1.entries) do list[#list + 1] = copy_entry(e) end
    for _, e in ipairs(a.conditioning_2.entries) do list[#list + 1] = copy_entry(e) end
    return { cond_value(ctx, list) }
  end,
}

N.ConditioningSetArea = {
  inputs = { { "conditioning", "CONDITIONING" }, { "width", "INT", 64 }, { "height", "INT", 64 },
    { "x", "INT", 0 }, { "y", "INT", 0 }, { "strength", "FLOAT", 1.0 } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    local list = {}
    for _, e in ipairs(a.conditioning.entries) do
      local r = copy_entry(e)
      -- in latent units, as ComfyUI stores it (pixels // 8)
      r.area = { h = a.height // 8, w = a.width // 8, y = a.y // 8, x = a.x // 8 }
      r.strength = a.strength
      list[#list + 1] = r
    end
    return { cond_value(ctx, list) }
  end,
}

N.ConditioningZeroOut = {
  inputs = { { "conditioning", "CONDITIONING" } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    local list = {}
    for _, e in ipairs(a.conditioning.entries) do
      local r = copy_entry(e)
      r.cond = kiln.zeros(e.cond.shape)
      if e.pooled then r.pooled = kiln.zeros(e.pooled.shape) end
      list[#list + 1] = r
    end
    return { cond_value(ctx, list) }
  end,
}

local function apply_control(ctx, entries, net, img, strength, start, stop)
  local list = {}
  for _, e in ipairs(entries) do
    local r = copy_entry(e)
    if strength ~= 0 then
      r.control[#r.control + 1] = { net = net, image = img, strength = strength, start = start, stop = stop }
    end
    list[#list + 1] = r
  end
  return cond_value(ctx, list)
end

N.ControlNetApply = {
  inputs = { { "conditioning", "CONDITIONING" }, { "control_net", "CONTROL_NET" }, { "image", "IMAGE" },
    { "strength", "FLOAT", 1.0 } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    return { apply_control(ctx, a.conditioning.entries, a.control_net.net, a.image.t, a.strength, 0, 1) }
  end,
}

N.ControlNetApplyAdvanced = {
  inputs = { { "positive", "CONDITIONING" }, { "negative", "CONDITIONING" }, { "control_net", "CONTROL_NET" },
    { "image", "IMAGE" }, { "strength", "FLOAT", 1.0 }, { "start_percent", "FLOAT", 0.0 },
    { "end_percent", "FLOAT", 1.0 }, { "vae", "VAE", false } },
  outputs = { "CONDITIONING", "CONDITIONING" },
  run = function(ctx, a)
    local net, img = a.control_net.net, a.image.t
    return {
      apply_control(ctx, a.positive.entries, net, img, a.strength, a.start_percent, a.end_percent),
      apply_control(ctx, a.negative.entries, net, img, a.strength, a.start_percent, a.end_percent),
    }
  end,
}

-- ------------------------------------------------------------------ latents

local function latent_value(ctx, samples, mask, extra)
  local fields = { samples = samples, noise_mask = mask }
  for k, v in pairs(extra or {}) do fields[k] = v end
  return ctx:value("LATENT", fields, { samples, mask })
end

N.EmptyLatentImage = {
  inputs = { { "width", "INT", 512 }, { "height", "INT", 512 }, { "batch_size", "INT", 1 } },
  outputs = { "LATENT" },
  run = function(ctx, a)
    local z = kiln.zeros({ a.batch_size, 4, a.height // 8, a.width // 8 })
    local v = latent_value(ctx, z)
    return { v }
  end,
  shape = function(a) return { { a.batch_size, 4, a.height // 8, a.width // 8 } } end,
}

local function scaled_latent(ctx, l, w, h, method, crop)
  local s = resize(ctx, l.samples, w, h, method, crop, LATENT_METHODS)
  local v = latent_value(ctx, s, l.noise_mask)
  return v
end

N.LatentUpscale = {
  inputs = { { "samples", "LATENT" }, { "upscale_method", "STRING", "nearest-exact", LATENT_METHODS }, { "width", "INT", 512 },
    { "height", "INT", 512 }, { "crop", "STRING", "disabled", { "disabled", "center" } } },
  outputs = { "LATENT" },
  run = function(ctx, a)
    local s = a.samples.samples
    local h0, w0 = s.shape[3], s.shape[4]
    local w, h = a.width // 8, a.height // 8
    if a.width == 0 and a.height == 0 then w, h = w0, h0
    elseif a.width == 0 then w = math.max(1, pyround(w0 * h / h0))
    elseif a.height == 0 then h = math.max(1, pyround(h0 * w / w0)) end
    return { scaled_latent(ctx, a.samples, w, h, a.upscale_method, a.crop) }
  end,
}

N.LatentUpscaleBy = {
  inputs = { { "samples", "LATENT" }, { "upscale_method", "STRING", "nearest-exact", LATENT_METHODS }, { "scale_by", "FLOAT", 1.5 } },
  outputs = { "LATENT" },
  run = function(ctx, a)
    local s = a.samples.samples
    local w, h = pyround(s.shape[4] * a.scale_by), pyround(s.shape[3] * a.scale_by)
    return { scaled_latent(ctx, a.samples, w, h, a.upscale_method) }
  end,
}

N.SetLatentNoiseMask = {
  inputs = { { "samples", "LATENT" }, { "mask", "MASK" } },
  outputs = { "LATENT" },
  run = function(ctx, a) return { latent_value(ctx, a.samples.samples, a.mask.t) } end,
}

-- ------------------------------------------------------------------ sampling

local function check_names(ctx, sampler, scheduler)
  if not sample.sampler_info(sampler) then
    fail(ctx, fmt("unknown sampler_name '%s' (known: %s)", tostring(sampler), table.concat(sample.names(), ", ")))
  end
  if not sample.scheduler_info(scheduler) then
    fail(ctx, fmt("unknown scheduler '%s' (known: %s)", tostring(scheduler),
      table.concat(sample.scheduler_names(), ", ")))
  end
end

-- Does a conditioning need the general sampler path (several entries, an area, a
-- strength other than 1)?
local function is_plain(c)
  if #c.entries ~= 1 then return false end
  local e = c.entries[1]
  return not e.area and (e.strength or 1) == 1
end

-- ComfyUI's weight of an area entry over its crop [1, 1, h, w]: strength, faded over
-- 8 rows / columns at each side that does not touch the picture's edge
local function area_mult(area, H, W, strength)
  local rr = 8
  local vals = {}
  for i = 0, area.h - 1 do
    for j = 0, area.w - 1 do
      local m = strength
      for t = 0, rr - 1 do
        local f = (t + 1) / rr
        if area.y ~= 0 and i == t then m = m * f end
        if area.y + area.h < H and i == area.h - 1 - t then m = m * f end
        if area.x ~= 0 and j == t then m = m * f end
        if area.x + area.w < W and j == area.w - 1 - t then m = m * f end
      end
      vals[#vals + 1] = m
    end
  end
  return kiln.tensor(vals):reshape({ 1, 1, area.h, area.w })
end

-- The denoised prediction of a list of entries as ComfyUI's calc_cond_batch combines
-- them: each entry's prediction (on its area's crop of x) times its weight, summed and
-- divided by the summed weights. preds: {fn = denoiser of one cond, area, strength}.
local function mixed(preds, x, sigma)
  local H, W = x.shape[3], x.shape[4]
  local sum, count = kiln.zeros(x.shape), kiln.full({ 1, 1, H, W }, 1e-37)
  for _, p in ipairs(preds) do
    local a = p.area
    if a then
      local xin = x:narrow(3, a.y + 1, a.h):narrow(4, a.x + 1, a.w):contiguous()
      local out = p.fn(xin, sigma)
      xin:free()
      local m = area_mult(a, H, W, p.strength)
      local pad = { a.x, W - a.x - a.w, a.y, H - a.y - a.h }
      local wo = out * m
      local fo, fm = kiln.nn.pad(wo, pad), kiln.nn.pad(m, pad)
      local s2, c2 = sum + fo, count + fm
      for _, t in ipairs({ out, m, wo, fo, fm, sum, count }) do t:free() end
      sum, count = s2, c2
    else
      local out = p.fn(x, sigma)
      local wo = out * p.strength
      local s2, c2 = sum + wo, count + p.strength
      for _, t in ipairs({ out, wo, sum, count }) do t:free() end
      sum, count = s2, c2
    end
  end
  local r = sum / count
  sum:free(); count:free()
  return r
end

-- The general sampler path (combined or area conditioning): one denoiser per entry
-- (kiln.pipeline.denoiser at guidance 1 is the conditional prediction), mixed per side,
-- then classifier-free guidance; the noise, schedule and mask as sample_latents's.
local function sample_mixed(ctx, ckpt, a, o, x0, made)
  local unet = ckpt.unet
  local H, W = x0.shape[3], x0.shape[4]
  local function preds_of(c, what)
    local list = {}
    for _, e in ipairs(c.entries) do
      if #e.control > 0 then fail(ctx, what .. ": a ControlNet with combined or area conditioning is not supported yet") end
      local od = setmetatable({}, { __index = o })
      if unet.config.adm_in_channels then
        if not e.pooled then fail(ctx, "this UNet needs a pooled text vector (SDXL)") end
        od.y_cond = unet:sdxl_vector(e.pooled, e.size or { width = W * 8, height = H * 8 })
        made[#made + 1] = od.y_cond
      end
      local area = e.area
      if area then  -- cut to the picture, as slicing does
        local y, x = math.min(area.y, H - 1), math.min(area.x, W - 1)
        area = { y = y, x = x, h = math.max(1, math.min(area.h, H - y)), w = math.max(1, math.min(area.w, W - x)) }
      end
      list[#list + 1] = { fn = pipeline.denoiser(ckpt, e.cond, e.cond, 1, od), area = area, strength = e.strength or 1 }
    end
    return list
  end
  if unet.config.in_channels == 9 then fail(ctx, "an inpainting model with combined or area conditioning is not supported yet") end
  local pos, neg = preds_of(a.positive, "positive"), preds_of(a.negative, "negative")
  local cfg = o.cfg
  local function den(x, sigma)
    local c = mixed(pos, x, sigma)
    if cfg == 1 then return c end
    local u = mixed(neg, x, sigma)
    local r = u + (c - u) * cfg
    c:free(); u:free()
    return r
  end
  local sigmas = o.sigmas or pipeline.sigmas(ckpt, o.scheduler, o.steps, o.denoise)
  local s = sigmas:table()
  local noise = o.add_noise == false and kiln.zeros(x0.shape) or kiln.randn(x0.shape, { seed = o.seed })
  local x = x0 + noise * s[1]
  local fn = den
  if o.denoise_mask then fn = inpaint.masked_denoiser(den, o.denoise_mask, x0, noise) end
  local out = sample.run(o.sampler, fn, x, sigmas, { seed = o.seed })
  noise:free()
  if sigmas ~= o.sigmas then sigmas:free() end
  return out
end

-- cond and uncond padded to one length by repeating the shorter one's last chunk,
-- as kiln.pipeline.encode_prompts does
local function same_length(cond, uncond, made)
  local lc, lu = cond.shape[2], uncond.shape[2]
  if lc == lu then return cond, uncond end
  local function grow(t, n)
    local parts, last, have = { t }, t:narrow(2, t.shape[2] - 76, 77), t.shape[2]
    while have < n do parts[#parts + 1] = last; have = have + 77 end
    local r = kiln.cat(parts, 2)
    made[#made + 1] = r
    return r
  end
  if lc < lu then return grow(cond, lu), uncond end
  return cond, grow(uncond, lc)
end

-- KSampler and KSamplerAdvanced: kiln.pipeline.sample_latents with the graph's
-- conditioning, so that the same seed and settings give the pipelines' latents
local function ksample(ctx, a, adv)
  check_names(ctx, a.sampler_name, a.scheduler)
  local model, lat = a.model, a.latent_image
  local ckpt = model.ckpt
  local plain = is_plain(a.positive) and is_plain(a.negative)
  local pe, ne = a.positive.entries[1], a.negative.entries[1]
  if not (pe and ne) then fail(ctx, "a sampler needs at least one positive and one negative conditioning") end
  local x0 = lat.samples
  local made = {}
  local o = { seed = a.noise_seed or a.seed, steps = a.steps, cfg = a.cfg, sampler = a.sampler_name,
    scheduler = a.scheduler, denoise = a.denoise or 1, device = ctx.device }
  local cond, uncond = same_length(pe.cond, ne.cond, made)
  -- ControlNets: the positive side's (ControlNetApplyAdvanced puts the same on both;
  -- kiln's denoiser adds them to cond and uncond alike)
  if #pe.control > 0 then o.control = pe.control end
  local unet = model.part
  local lh, lw = x0.shape[3], x0.shape[4]
  if unet.config.adm_in_channels then
    if not (pe.pooled and ne.pooled) then fail(ctx, "this UNet needs a pooled text vector (SDXL)") end
    local size = pe.size or { width = lw * 8, height = lh * 8 }
    o.y_cond, o.y_uncond = unet:sdxl_vector(pe.pooled, size), unet:sdxl_vector(ne.pooled, ne.size or size)
    made[#made + 1] = o.y_cond; made[#made + 1] = o.y_uncond
  end
  if lat.noise_mask then
    o.denoise_mask = inpaint.latent_mask(lat.noise_mask, lh, lw)
    made[#made + 1] = o.denoise_mask
  end
  if unet.config.in_channels == 9 then
    if not o.denoise_mask then fail(ctx, "an inpainting model needs a latent with a mask (VAEEncodeForInpaint, SetLatentNoiseMask)") end
    local m = pe.concat_mask and inpaint.latent_mask(pe.concat_mask, lh, lw) or o.denoise_mask
    o.concat_mask = round01(m)
    if m ~= o.denoise_mask then m:free() end
    made[#made + 1] = o.concat_mask
    o.concat_latent = pe.concat_latent
  end
  if adv then
    -- KSamplerAdvanced: the whole schedule's steps start_at_step..end_at_step; without
    -- leftover noise a schedule cut short ends at sigma 0
    local full = pipeline.sigmas(ckpt, a.scheduler, a.steps, 1)
    local n = a.steps
    local first, last = math.max(0, a.start_at_step), math.min(n, a.end_at_step)
    if first >= last then
      full:free()
      for _, t in ipairs(made) do t:free() end
      return { latent_value(ctx, x0, lat.noise_mask) }
    end
    local vals = full:narrow(1, first + 1, last - first + 1):table()
    full:free()
    if last < n and a.return_with_leftover_noise ~= "enable" then vals[#vals] = 0 end
    o.sigmas = kiln.tensor(vals, { device = "cpu" }) -- a schedule: host data
    made[#made + 1] = o.sigmas
    o.add_noise = a.add_noise == "enable"
  end
  local hs = {}
  for _, l in ipairs(model.loras) do hs[#hs + 1] = add_lora(ckpt, l.path, { unet = l.strength, clip = 0 }) end
  ctx:use(unet, { dtype = model.dtype })
  for _, c in ipairs(o.control or {}) do ctx:note_use(c.net) end
  -- the latents where the pipeline makes its noise: the default device (the host,
  -- unless the run's default is another, as `kiln --device sim comfy ...` makes it)
  local home = kiln.default_device()
  local x = x0.device == home and x0 or x0:to(home)
  local ok, out
  if plain then
    ok, out = pcall(pipeline.sample_latents, ckpt, cond, uncond, o, x, x.shape)
  else
    ok, out = pcall(sample_mixed, ctx, ckpt, a, o, x, made)
  end
  if x ~= x0 then x:free() end
  for i = #hs, 1, -1 do hs[i]:remove() end
  for _, t in ipairs(made) do t:free() end
  if not ok then error(out, 0) end
  local v = latent_value(ctx, out, lat.noise_mask)
  return { v }
end

N.KSampler = {
  inputs = { { "model", "MODEL" }, { "seed", "INT", 0 }, { "steps", "INT", 20 }, { "cfg", "FLOAT", 8.0 },
    { "sampler_name", "STRING", "euler" }, { "scheduler", "STRING", "normal" }, { "positive", "CONDITIONING" },
    { "negative", "CONDITIONING" }, { "latent_image", "LATENT" }, { "denoise", "FLOAT", 1.0 } },
  outputs = { "LATENT" },
  run = function(ctx, a) return ksample(ctx, a, false) end,
}

N.KSamplerAdvanced = {
  inputs = { { "model", "MODEL" }, { "add_noise", "STRING", "enable" }, { "noise_seed", "INT", 0 },
    { "steps", "INT", 20 }, { "cfg", "FLOAT", 8.0 }, { "sampler_name", "STRING", "euler" },
    { "scheduler", "STRING", "normal" }, { "positive", "CONDITIONING" }, { "negative", "CONDITIONING" },
    { "latent_image", "LATENT" }, { "start_at_step", "INT", 0 }, { "end_at_step", "INT", 10000 },
    { "return_with_leftover_noise", "STRING", "disable" } },
  outputs = { "LATENT" },
  run = function(ctx, a) return ksample(ctx, a, true) end,
}

-- ------------------------------------------------------------------ VAE

local function image_value(ctx, t, owned)
  local v = ctx:value("IMAGE", { t = t }, { t })
  return v
end

local function mask_value(ctx, t, owned)
  local v = ctx:value("MASK", { t = t }, { t })
  return v
end

-- ComfyUI crops pixels to a multiple of 8 about the centre before encoding
local function crop8(t)
  local h, w = t.shape[3], t.shape[4]
  local h8, w8 = (h // 8) * 8, (w // 8) * 8
  if h8 == h and w8 == w then return t end
  return t:narrow(3, (h % 8) // 2 + 1, h8):narrow(4, (w % 8) // 2 + 1, w8)
end

local function rgb(t) return t.shape[2] == 3 and t or t:narrow(2, 1, 3) end

local function decode(ctx, a, topts)
  local vae = use(ctx, a.vae.part)
  local img = vae:decode(a.samples.samples, topts)
  return { image_value(ctx, img, true) }
end

local function encode_px(ctx, vae, px, topts)
  use(ctx, vae.part)
  local src = crop8(rgb(px))
  return vae.part:encode(src:contiguous(), topts)
end

N.VAEDecode = {
  inputs = { { "samples", "LATENT" }, { "vae", "VAE" } },
  outputs = { "IMAGE" },
  run = function(ctx, a) return decode(ctx, a) end,
}

N.VAEDecodeTiled = {
  inputs = { { "samples", "LATENT" }, { "vae", "VAE" }, { "tile_size", "INT", 512 }, { "overlap", "INT", 64 },
    { "temporal_size", "INT", 64 }, { "temporal_overlap", "INT", 8 } },
  outputs = { "IMAGE" },
  run = function(ctx, a) return decode(ctx, a, { tile = a.tile_size // 8, overlap = a.overlap // 8 }) end,
}

N.VAEEncode = {
  inputs = { { "pixels", "IMAGE" }, { "vae", "VAE" } },
  outputs = { "LATENT" },
  run = function(ctx, a)
    local z = encode_px(ctx, a.vae, a.pixels.t)
    local v = latent_value(ctx, z)
    return { v }
  end,
}

N.VAEEncodeTiled = {
  inputs = { { "pixels", "IMAGE" }, { "vae", "VAE" }, { "tile_size", "INT", 512 }, { "overlap", "INT", 64 },
    { "temporal_size", "INT", 64 }, { "temporal_overlap", "INT", 8 } },
  outputs = { "LATENT" },
  run = function(ctx, a)
    local z = encode_px(ctx, a.vae, a.pixels.t, { tile = a.tile_size // 8, overlap = a.overlap // 8 })
    local v = latent_value(ctx, z)
    return { v }
  end,
}

-- the mask at the pixels' size (bilinear, as ComfyUI's interpolate of the mask)
local function mask_at(m, h, w)
  if m.shape[3] == h and m.shape[4] == w then return m:clone() end
  return kiln.nn.interpolate(m, { size = { h, w }, mode = "bilinear" })
end

N.VAEEncodeForInpaint = {
  inputs = { { "pixels", "IMAGE" }, { "vae", "VAE" }, { "mask", "MASK" }, { "grow_mask_by", "INT", 6 } },
  outputs = { "LATENT" },
  run = function(ctx, a)
    local px = crop8(rgb(a.pixels.t)):contiguous()
    local m = mask_at(a.mask.t, px.shape[3], px.shape[4])
    local grey = inpaint.grey_fill(px, m)
    local grown = inpaint.grow_mask(m, a.grow_mask_by)
    m:free()
    use(ctx, a.vae.part)
    local z = a.vae.part:encode(grey)
    grey:free()
    local v = latent_value(ctx, z, grown)
    return { v }
  end,
}

N.InpaintModelConditioning = {
  inputs = { { "positive", "CONDITIONING" }, { "negative", "CONDITIONING" }, { "vae", "VAE" }, { "pixels", "IMAGE" },
    { "mask", "MASK" }, { "noise_mask", "BOOLEAN", true } },
  outputs = { "CONDITIONING", "CONDITIONING", "LATENT" },
  run = function(ctx, a)
    local px = crop8(rgb(a.pixels.t)):contiguous()
    local m = mask_at(a.mask.t, px.shape[3], px.shape[4])
    local grey = inpaint.grey_fill(px, m)
    use(ctx, a.vae.part)
    local concat = a.vae.part:encode(grey)
    grey:free()
    local orig = a.vae.part:encode(px)
    local function with_concat(c)
      local list = {}
      for _, e in ipairs(c.entries) do
        local r = copy_entry(e)
        r.concat_latent, r.concat_mask = concat, m
        list[#list + 1] = r
      end
      return cond_value(ctx, list)
    end
    local pos, neg = with_concat(a.positive), with_concat(a.negative)
    local lat = latent_value(ctx, orig, a.noise_mask and m or nil)
    return { pos, neg, lat }
  end,
}

-- ------------------------------------------------------------------ images

N.LoadImage = {
  inputs = { { "image", "FILE:input" } },
  outputs = { "IMAGE", "MASK" },
  run = function(ctx, a)
    local t = kiln.load_png(a.image)
    local c = t.shape[2]
    local img
    if c >= 3 then img = t:narrow(2, 1, 3):contiguous()
    else img = kiln.cat({ t:narrow(2, 1, 1), t:narrow(2, 1, 1), t:narrow(2, 1, 1) }, 2) end
    -- the mask: 1 - alpha where the file has alpha, else 64 x 64 zeros (ComfyUI's)
    local m = (c == 2 or c == 4) and inpaint.mask_of_png(t) or kiln.zeros({ 1, 1, 64, 64 })
    t:free()
    return { image_value(ctx, img, true), mask_value(ctx, m, true) }
  end,
}

N.LoadImageMask = {
  inputs = { { "image", "FILE:input" }, { "channel", "STRING", "alpha" } },
  outputs = { "MASK" },
  run = function(ctx, a)
    local t = kiln.load_png(a.image)
    local c = t.shape[2]
    local idx = ({ red = 1, green = 2, blue = 3, alpha = (c == 2 or c == 4) and c or nil })[a.channel]
    if c < 3 and a.channel ~= "alpha" then idx = 1 end
    local m
    if not idx then
      if a.channel ~= "alpha" then fail(ctx, fmt("channel '%s' (alpha, red, green, blue)", tostring(a.channel))) end
      m = kiln.zeros({ 1, 1, 64, 64 })
    else
      m = t:narrow(2, idx, 1):contiguous()
      if a.channel == "alpha" then local r = 1 - m; m:free(); m = r end
    end
    t:free()
    return { mask_value(ctx, m, true) }
  end,
}

N.ImageScale = {
  inputs = { { "image", "IMAGE" }, { "upscale_method", "STRING", "nearest-exact", IMAGE_METHODS }, { "width", "INT", 512 },
    { "height", "INT", 512 }, { "crop", "STRING", "disabled", { "disabled", "center" } } },
  outputs = { "IMAGE" },
  run = function(ctx, a)
    local t = a.image.t
    local h0, w0 = t.shape[3], t.shape[4]
    local w, h = a.width, a.height
    if w == 0 and h == 0 then w, h = w0, h0
    elseif w == 0 then w = math.max(1, pyround(w0 * h / h0))
    elseif h == 0 then h = math.max(1, pyround(h0 * w / w0)) end
    return { image_value(ctx, resize(ctx, t, w, h, a.upscale_method, a.crop, IMAGE_METHODS), true) }
  end,
}

N.ImageScaleBy = {
  inputs = { { "image", "IMAGE" }, { "upscale_method", "STRING", "nearest-exact", IMAGE_METHODS }, { "scale_by", "FLOAT", 1.0 } },
  outputs = { "IMAGE" },
  run = function(ctx, a)
    local t = a.image.t
    local w, h = pyround(t.shape[4] * a.scale_by), pyround(t.shape[3] * a.scale_by)
    return { image_value(ctx, resize(ctx, t, w, h, a.upscale_method, nil, IMAGE_METHODS), true) }
  end,
}

N.ImagePadForOutpaint = {
  inputs = { { "image", "IMAGE" }, { "left", "INT", 0 }, { "top", "INT", 0 }, { "right", "INT", 0 },
    { "bottom", "INT", 0 }, { "feathering", "INT", 40 } },
  outputs = { "IMAGE", "MASK" },
  run = function(ctx, a)
    local img, m = inpaint.outpaint_pad(to_cpu(a.image.t), { left = a.left, top = a.top, right = a.right,
      bottom = a.bottom, feather = a.feathering })
    return { image_value(ctx, img, true), mask_value(ctx, m, true) }
  end,
}

N.ImageUpscaleWithModel = {
  inputs = { { "upscale_model", "UPSCALE_MODEL" }, { "image", "IMAGE" } },
  outputs = { "IMAGE" },
  run = function(ctx, a)
    local up = use(ctx, a.upscale_model.up)
    local big = up:upscale(a.image.t, { tile = 512, overlap = 32 })
    return { image_value(ctx, big, true) }
  end,
}

-- SaveImage: PREFIX_00001_.png, ... in the output folder (a prefix may name a
-- sub-folder), numbered after the highest number already there, each with the
-- workflow's API JSON in its `prompt` text chunk
N.SaveImage = {
  inputs = { { "images", "IMAGE" }, { "filename_prefix", "STRING", "ComfyUI" } },
  outputs = {},
  output = true,
  run = function(ctx, a)
    local t = a.images.t
    if ctx.dry then return {} end   -- a dry run (shapes only) writes nothing
    for i = 1, t.shape[1] do
      local one = t:narrow(1, i, 1)
      local c, copied = to_cpu(one)
      local path = ctx:next_output(a.filename_prefix)
      local cl = c:clamp(0, 1)
      kiln.save_png(cl, path, { text = { prompt = ctx.prompt_text } })
      cl:free()
      if copied then c:free() end
      ctx.files[#ctx.files + 1] = path
    end
    return {}
  end,
}

-- PreviewImage: ComfyUI shows it in the browser and keeps it in a temporary folder;
-- kiln keeps nothing (the run's result lists its shape)
N.PreviewImage = {
  inputs = { { "images", "IMAGE" } },
  outputs = {},
  output = true,
  run = function(ctx, a)
    ctx.previews[#ctx.previews + 1] = { node = ctx.node_id, shape = a.images.t.shape }
    return {}
  end,
}

-- Node types that exist in ComfyUI which kiln cannot run yet: named, so that a
-- workflow using one fails before anything runs and says why.
N.not_yet = {}

N.LATENT_METHODS, N.IMAGE_METHODS = LATENT_METHODS, IMAGE_METHODS
return N
