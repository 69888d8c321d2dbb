-- kiln.comfy.conditioning: ComfyUI's "conditioning" nodes: prompts through the text
-- encoder (with the LoRAs of the CLIP value on for the call), combining, areas, zeroing,
-- ControlNets and the inpainting model's conditioning. Input specs from nodes.py and
-- comfy_extras/nodes_clip_sdxl.py.
local kiln = require "kiln"
local inpaint = require "kiln.inpaint"
local registry = require "kiln.comfy.registry"
local V = require "kiln.comfy.values"

local M = {}
-- the node definitions, by name (registered at the end)
M.nodes = {}
local N = M.nodes
local MAX = V.MAX_RESOLUTION
local cond_value, copy_entry = V.conditioning, V.copy_entry

N.CLIPSetLastLayer = {
  category = "conditioning",
  inputs = { { "clip", "CLIP" }, { "stop_at_clip_layer", "INT", default = -1, min = -24, max = -1, step = 1 } },
  outputs = { "CLIP" },
  run = function(ctx, a)
    local fields = { ckpt = a.clip.ckpt, part = a.clip.part, loras = a.clip.loras, clip_skip = -a.stop_at_clip_layer,
      device = a.clip.device }
    return { ctx:value("CLIP", fields, nil, a.clip.res) }
  end,
}

-- the text encoder of a CLIP value with its LoRAs on, for fn(clip)
local function with_clip(ctx, clip, fn)
  local ckpt = clip.ckpt
  local hs = {}
  for _, l in ipairs(clip.loras) do hs[#hs + 1] = V.add_lora(ckpt, l.path, { unet = 0, clip = l.strength }) end
  ctx:use(clip.part, { device = clip.device })
  local ok, a, b = pcall(fn, clip.part)
  for i = #hs, 1, -1 do hs[i]:remove() end
  if not ok then error(a, 0) end
  return a, b
end

local function encode(ctx, clip, text)
  local F = require("kiln.family").get(clip.ckpt.family)
  if F and F.comfy then -- a family with its own ComfyUI encoding (SD 3.5: kiln.comfy.sd3)
    local e = require(F.comfy).encode_text(ctx, clip, text)
    return e.cond, e.pooled
  end
  if rawget(clip.ckpt, "t5") then -- Flux: T5 and CLIP-L (kiln.comfy.flux)
    local e = require("kiln.comfy.flux").encode_text(ctx, clip, text)
    return e.cond, e.pooled
  end
  return with_clip(ctx, clip, function(part)
    return part:encode(text, { clip_skip = clip.clip_skip, weighting = "comfy" })
  end)
end

N.CLIPTextEncode = {
  category = "conditioning",
  inputs = { { "text", "STRING", multiline = true }, { "clip", "CLIP" } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    local cond, pooled = encode(ctx, a.clip, a.text)
    return { cond_value(ctx, { { cond = cond, pooled = pooled } }) }
  end,
}

local function size(name, default) return { name, "INT", default = default, min = 0, max = MAX } end

N.CLIPTextEncodeSDXL = {
  category = "advanced/conditioning",
  inputs = { { "clip", "CLIP" }, size("width", 1024), size("height", 1024), size("crop_w", 0), size("crop_h", 0),
    size("target_width", 1024), size("target_height", 1024),
    { "text_g", "STRING", multiline = true }, { "text_l", "STRING", multiline = true } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    if a.text_g ~= a.text_l then
      V.fail(ctx, "different text_g and text_l are not supported yet (kiln encodes one text with both encoders)")
    end
    local cond, pooled = encode(ctx, a.clip, a.text_g)
    local sz = { width = a.width, height = a.height, orig_width = a.width, orig_height = a.height,
      crop_left = a.crop_w, crop_top = a.crop_h, target_width = a.target_width, target_height = a.target_height }
    return { cond_value(ctx, { { cond = cond, pooled = pooled, size = sz } }) }
  end,
}

N.ConditioningCombine = {
  category = "conditioning",
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
  category = "conditioning",
  inputs = { { "conditioning", "CONDITIONING" },
    { "width", "INT", default = 64, min = 64, max = MAX, step = 8 },
    { "height", "INT", default = 64, min = 64, max = MAX, step = 8 },
    { "x", "INT", default = 0, min = 0, max = MAX, step = 8 },
    { "y", "INT", default = 0, min = 0, max = MAX, step = 8 },
    { "strength", "FLOAT", default = 1.0, min = 0.0, max = 10.0, step = 0.01 } },
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
  category = "advanced/conditioning",
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

local STRENGTH = { "strength", "FLOAT", default = 1.0, min = 0.0, max = 10.0, step = 0.01 }

N.ControlNetApply = {
  category = "conditioning/controlnet",
  inputs = { { "conditioning", "CONDITIONING" }, { "control_net", "CONTROL_NET" }, { "image", "IMAGE" }, STRENGTH },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    return { apply_control(ctx, a.conditioning.entries, a.control_net.net, a.image.t, a.strength, 0, 1) }
  end,
}

N.ControlNetApplyAdvanced = {
  category = "conditioning/controlnet",
  inputs = { { "positive", "CONDITIONING" }, { "negative", "CONDITIONING" }, { "control_net", "CONTROL_NET" },
    { "image", "IMAGE" }, STRENGTH,
    { "start_percent", "FLOAT", default = 0.0, min = 0.0, max = 1.0, step = 0.001 },
    { "end_percent", "FLOAT", default = 1.0, min = 0.0, max = 1.0, step = 0.001 },
    { "vae", "VAE", optional = true } },
  outputs = { "CONDITIONING", "CONDITIONING" },
  run = function(ctx, a)
    local net, img = a.control_net.net, a.image.t
    return {
      apply_control(ctx, a.positive.entries, net, img, a.strength, a.start_percent, a.end_percent),
      apply_control(ctx, a.negative.entries, net, img, a.strength, a.start_percent, a.end_percent),
    }
  end,
}

N.InpaintModelConditioning = {
  category = "conditioning/inpaint",
  inputs = { { "positive", "CONDITIONING" }, { "negative", "CONDITIONING" }, { "vae", "VAE" }, { "pixels", "IMAGE" },
    { "mask", "MASK" }, { "noise_mask", "BOOLEAN", default = true } },
  outputs = { "CONDITIONING", "CONDITIONING", "LATENT" },
  run = function(ctx, a)
    -- ComfyUI crops to 8 here, then its VAE's encode to the VAE's own factor
    local px = V.crop_to(V.crop_to(V.rgb(a.pixels.t), 8), V.compression(a.vae.part)):contiguous()
    local m = V.mask_at(a.mask.t, px.shape[3], px.shape[4])
    local grey = inpaint.grey_fill(px, m)
    V.use(ctx, a.vae.part)
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
    local lat = V.latent(ctx, orig, a.noise_mask and m or nil)
    return { pos, neg, lat }
  end,
}

for name, def in pairs(N) do registry.add_node(name, def) end
return M
