-- kiln.families.sdxl: Stable Diffusion XL base (ComfyUI's SDXL): two text encoders,
-- CLIP ViT-L and OpenCLIP bigG (both the penultimate layer without the final norm;
-- bigG also gives the pooled vector), concatenated; the UNet's label_emb takes the
-- pooled vector with the size conditioning; context 2048; the VAE at scale 0.13025.
local mf = require "kiln.model_files"
local sd = require "kiln.families.sd"

local M = {
  name = "sdxl",
  label = "SDXL",

  recognise = {
    prefixes = { "conditioner.embedders.1.model." },
    unet_names = { "label_emb.0.0.weight" }, -- the size-conditioning embedding only SDXL has
    context_dim = 2048,
    context_of = sd.context_dim,
    gguf_architectures = { "sdxl" },
    diffusers_folders = { "text_encoder_2" },
    text_encoders = function(cfgs) return #cfgs == 2 end,
  },

  -- the refiner has only bigG, at embedders.0: kiln does not run it
  refuse = function(shapes)
    if mf.has_prefix(shapes, "conditioner.embedders.0.model.") then
      return "this is an SDXL refiner checkpoint (only the bigG text encoder, at " ..
          "conditioner.embedders.0.model.*); kiln supports SD 1.x, SD 2.x and SDXL base checkpoints"
    end
  end,

  parts = {
    ldm = {
      find_unet = sd.find_unet, vae = "first_stage_model.",
      clip = {
        { prefix = "conditioner.embedders.0.transformer.", role = "l" },
        { prefix = "conditioner.embedders.1.model.", role = "g" },
      },
    },
    diffusers = {
      unet = "unet", vae = "vae", unet_map = sd.diffusers_unet_map, vae_map = sd.diffusers_vae_map,
      clip = { { folder = "text_encoder", role = "l" }, { folder = "text_encoder_2", role = "g" } },
    },
  },
  unet = { head_dim = 64 },

  conditioning = {
    encoders = {
      { role = "l", options = { "clip_l" }, meta = "clip", layer = -2, final_norm = false, pad = nil, pooled = false },
      { role = "g", options = { "clip_g" }, meta = "clip_g", layer = -2, final_norm = false, pad = 0, pooled = true },
    },
    pooled = true, size = true,
  },

  -- Two encoder files alone in either order: bigG is the wider one; at equal widths the
  -- OpenCLIP-shaped or projecting one. encs: {cfg = clip config, ...}, sorted in place.
  order_text_encoders = function(encs)
    local function g_like(c) return (c.layout == "openclip" or c.projection ~= nil) and 1 or 0 end
    local a, b = encs[1].cfg, encs[2].cfg
    if a.width > b.width or (a.width == b.width and g_like(a) > g_like(b)) then encs[1], encs[2] = encs[2], encs[1] end
  end,

  defaults = { sampler = "euler", scheduler = "normal", cfg = 7.0, steps = 20, image_size = 1024, prediction = "eps" },
  latent = { channels = 4, scale_factor = 0.13025, shift_factor = 0 },
  taesd = "taesdxl",
}

return M
