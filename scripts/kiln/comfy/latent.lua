-- kiln.comfy.latent: ComfyUI's "latent" nodes that make, scale and mask latents (the
-- VAE's way in and out is kiln.comfy.vae). EmptyLatentImage divides by 8 whatever the
-- VAE, as ComfyUI's does. Input specs from nodes.py.
local kiln = require "kiln"
local registry = require "kiln.comfy.registry"
local V = require "kiln.comfy.values"

local M = {}
-- the node definitions, by name (registered at the end)
M.nodes = {}
local N = M.nodes
local MAX = V.MAX_RESOLUTION
local latent_value, pyround = V.latent, V.pyround

N.EmptyLatentImage = {
  category = "latent",
  inputs = { { "width", "INT", default = 512, min = 16, max = MAX, step = 8 },
    { "height", "INT", default = 512, min = 16, max = MAX, step = 8 },
    { "batch_size", "INT", default = 1, min = 1, max = 4096 } },
  outputs = { "LATENT" },
  run = function(ctx, a)
    return { latent_value(ctx, kiln.zeros({ a.batch_size, 4, a.height // 8, a.width // 8 })) }
  end,
}

local function scaled_latent(ctx, l, w, h, method, crop)
  return latent_value(ctx, V.resize(l.samples, w, h, method, crop), l.noise_mask)
end

N.LatentUpscale = {
  category = "latent",
  inputs = { { "samples", "LATENT" }, { "upscale_method", V.LATENT_METHODS },
    { "width", "INT", default = 512, min = 0, max = MAX, step = 8 },
    { "height", "INT", default = 512, min = 0, max = MAX, step = 8 }, { "crop", V.CROP_METHODS } },
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
  category = "latent",
  inputs = { { "samples", "LATENT" }, { "upscale_method", V.LATENT_METHODS },
    { "scale_by", "FLOAT", default = 1.5, min = 0.01, max = 8.0, step = 0.01 } },
  outputs = { "LATENT" },
  run = function(ctx, a)
    local s = a.samples.samples
    local w, h = pyround(s.shape[4] * a.scale_by), pyround(s.shape[3] * a.scale_by)
    return { scaled_latent(ctx, a.samples, w, h, a.upscale_method) }
  end,
}

N.SetLatentNoiseMask = {
  category = "latent/inpaint",
  inputs = { { "samples", "LATENT" }, { "mask", "MASK" } },
  outputs = { "LATENT" },
  run = function(ctx, a) return { latent_value(ctx, a.samples.samples, a.mask.t) } end,
}

for name, def in pairs(N) do registry.add_node(name, def) end
return M
