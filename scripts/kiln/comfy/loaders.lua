-- kiln.comfy.loaders: ComfyUI's loader nodes (its "loaders" and "advanced/loaders"
-- categories): checkpoints, a UNet, text encoders or a VAE alone, LoRAs, ControlNets,
-- upscale models. A model file is a FILE:<folder> input, found under the models folder
-- by kiln.comfy; the input specs are ComfyUI's (nodes.py, comfy_extras).
local kiln = require "kiln"
local lfs = require "lfs"
local registry = require "kiln.comfy.registry"
local V = require "kiln.comfy.values"

local M = {}
-- the node definitions, by name (registered at the end)
M.nodes = {}
local N = M.nodes
local fail = V.fail

N.CheckpointLoaderSimple = {
  category = "loaders",
  inputs = { { "ckpt_name", "FILE:checkpoints" } },
  outputs = { "MODEL", "CLIP", "VAE" },
  model_file = "ckpt_name",
  run = function(ctx, a)
    local ckpt = ctx:checkpoint(a.ckpt_name)
    local net = rawget(ckpt, "unet") or rawget(ckpt, "dit") -- a transformer family's (an SD 3.5 all-in-one)
    local enc = { ckpt.clip }
    local t5 = rawget(ckpt, "t5")
    if t5 and not tostring(t5):match("^missing") then enc[2] = t5 end
    return {
      ctx:value("MODEL", { ckpt = ckpt, part = net, loras = {} }, nil, { net }),
      ctx:value("CLIP", { ckpt = ckpt, part = ckpt.clip, loras = {} }, nil, enc),
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

local STRENGTH = { default = 1.0, min = -100.0, max = 100.0, step = 0.01 }
local function strength(name)
  return { name, "FLOAT", default = STRENGTH.default, min = STRENGTH.min, max = STRENGTH.max, step = STRENGTH.step }
end

N.LoraLoader = {
  category = "loaders",
  inputs = { { "model", "MODEL" }, { "clip", "CLIP" }, { "lora_name", "FILE:loras" },
    strength("strength_model"), strength("strength_clip") },
  outputs = { "MODEL", "CLIP" },
  run = function(ctx, a)
    return { with_lora(ctx, a.model, a.lora_name, a.strength_model), with_lora(ctx, a.clip, a.lora_name, a.strength_clip) }
  end,
}

N.LoraLoaderModelOnly = {
  category = "loaders",
  inputs = { { "model", "MODEL" }, { "lora_name", "FILE:loras" }, strength("strength_model") },
  outputs = { "MODEL" },
  run = function(ctx, a) return { with_lora(ctx, a.model, a.lora_name, a.strength_model) } end,
}

N.ControlNetLoader = {
  category = "loaders",
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

-- a UNet alone (safetensors in any dtype kiln reads, fp8, or GGUF): kiln.load_checkpoint
-- of the file gives a checkpoint whose only part is the UNet (the family, prediction and
-- scale factor from its shapes and metadata)
local function unet_value(ctx, path, dtype)
  local ckpt = ctx:checkpoint(path)
  local unet = rawget(ckpt, "unet") or rawget(ckpt, "dit") -- a transformer family's network (Flux)
  if not unet then fail(ctx, path .. ": no UNet in this file") end
  return ctx:value("MODEL", { ckpt = ckpt, part = unet, loras = {}, dtype = dtype or nil }, nil, { unet })
end

N.UNETLoader = {
  category = "advanced/loaders",
  inputs = { { "unet_name", "FILE:diffusion_models|unet" },
    { "weight_dtype", { "default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2" } } },
  outputs = { "MODEL" },
  model_file = "unet_name",
  run = function(ctx, a) return { unet_value(ctx, a.unet_name, WEIGHT_DTYPES[a.weight_dtype]) } end,
}

-- ComfyUI-GGUF's loader (its files sit in unet/ or diffusion_models/)
N.UnetLoaderGGUF = {
  category = "bootleg",
  inputs = { { "unet_name", "FILE:unet|diffusion_models" } },
  outputs = { "MODEL" },
  model_file = "unet_name",
  run = function(ctx, a) return { unet_value(ctx, a.unet_name) } end,
}

-- CLIPLoader's and DualCLIPLoader's types kiln has models for (ComfyUI lists more): the
-- family (false: told by the encoder, SD 1.x or 2.x, as ComfyUI's stable_diffusion does)
local CLIP_TYPES = { stable_diffusion = false }
local DUAL_CLIP_TYPES = { sdxl = "sdxl", flux = "flux" }
local CLIP_DEVICES = { default = false, cpu = "cpu" }

local function clip_value(ctx, paths, family, device)
  local ckpt = ctx:text_encoders(paths, family or nil)
  return ctx:value("CLIP", { ckpt = ckpt, part = ckpt.clip, loras = {}, device = device or nil }, nil, { ckpt.clip })
end

N.CLIPLoader = {
  category = "advanced/loaders",
  inputs = { { "clip_name", "FILE:text_encoders|clip" }, { "type", { "stable_diffusion" } },
    { "device", { "default", "cpu" }, optional = true } },
  outputs = { "CLIP" },
  run = function(ctx, a)
    return { clip_value(ctx, { a.clip_name }, CLIP_TYPES[a.type], CLIP_DEVICES[a.device]) }
  end,
}

N.DualCLIPLoader = {
  category = "advanced/loaders",
  inputs = { { "clip_name1", "FILE:text_encoders|clip" }, { "clip_name2", "FILE:text_encoders|clip" },
    { "type", { "sdxl", "flux" } }, { "device", { "default", "cpu" }, optional = true } },
  outputs = { "CLIP" },
  run = function(ctx, a)
    if a.type == "flux" then -- CLIP-L and T5-XXL (kiln.comfy.flux)
      local ckpt = require("kiln.comfy.flux").text_encoders(ctx, { a.clip_name1, a.clip_name2 })
      return { ctx:value("CLIP", { ckpt = ckpt, part = ckpt.clip, loras = {}, device = CLIP_DEVICES[a.device] or nil },
        nil, { ckpt.clip, ckpt.t5 }) }
    end
    return { clip_value(ctx, { a.clip_name1, a.clip_name2 }, DUAL_CLIP_TYPES[a.type], CLIP_DEVICES[a.device]) }
  end,
}

-- VAELoader's names for the TAESDs in vae_approx/ (ComfyUI lists one when its decoder
-- and encoder are there); the 16-channel ones (taesd3, taef1) have no kiln model to go with
local TAESD_NAMES = { taesd = true, taesdxl = true }
registry.add_file_alias(function(folder, name)
  if folder == "vae" and TAESD_NAMES[name] then
    return "vae_approx", { name .. "_decoder.safetensors", name .. "_decoder.sft" }
  end
end)

N.VAELoader = {
  category = "loaders",
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
      local scale, shift = ctx:latent_scale()
      vae = require("kiln.checkpoint").load_vae(path, { scale_factor = scale, shift_factor = shift })
    end
    ctx:own_model(vae)
    ctx.names[vae] = path:match("([^/]+)$")
    return { ctx:value("VAE", { part = vae }, nil, { vae }) }
  end,
}

N.UpscaleModelLoader = {
  category = "loaders",
  inputs = { { "model_name", "FILE:upscale_models" } },
  outputs = { "UPSCALE_MODEL" },
  run = function(ctx, a)
    local up = ctx:own_model(kiln.load_upscaler(a.model_name))
    return { ctx:value("UPSCALE_MODEL", { up = up }, nil, { up }) }
  end,
}

for name, def in pairs(N) do registry.add_node(name, def) end
return M
