-- kiln.families.sd1: Stable Diffusion 1.x (ComfyUI's SD15): a CLIP ViT-L text encoder
-- (its last layer, final LayerNorm applied), a UNet of 8 heads with context 768, the
-- 4-channel VAE at scale 0.18215, eps prediction. A family is data plus a few
-- functions; kiln.family reads the fields (see its header for what each means).
local sd = require "kiln.families.sd"

local M = {
  name = "sd1",
  label = "SD 1.x",

  -- how a file is told to be this family (kiln.family tries the kinds of evidence in
  -- the order given there, the families in registry order within each)
  recognise = {
    prefixes = { "cond_stage_model.transformer." }, -- a single file's text encoder
    context_dim = 768,                               -- the UNet's cross-attention width
    context_of = sd.context_dim,                     -- how it is measured
    gguf_architectures = { "sd1" },                  -- general.architecture
    text_activation = "quick_gelu",                  -- a diffusers text_encoder's hidden_act
    -- text-encoder files alone: one CLIP-L shaped encoder
    text_encoders = function(cfgs)
      return #cfgs == 1 and cfgs[1].layout ~= "openclip" and cfgs[1].width ~= 1024
    end,
  },

  -- its parts and where each layout keeps them: the original single file (ldm; a
  -- ComfyUI or GGUF UNet alone has the UNet's names bare), diffusers folders (their
  -- names mapped by kiln.families.sd), and the text encoders
  parts = {
    ldm = {
      find_unet = sd.find_unet, vae = "first_stage_model.",
      clip = { { prefix = "cond_stage_model.transformer.", role = "l" } },
    },
    diffusers = {
      unet = "unet", vae = "vae", unet_map = sd.diffusers_unet_map, vae_map = sd.diffusers_vae_map,
      clip = { { folder = "text_encoder", role = "l" } },
    },
  },
  unet = { heads = 8 }, -- heads the shapes cannot tell (kiln.heads.unet overrides)

  -- conditioning: each encoder's role, the option that replaces it, the metadata key
  -- of its heads / activation, the hidden layer it gives (kiln.clip.layer overrides
  -- when layer_from_metadata), the final norm, the padding token (nil: the end token)
  -- and whether it gives the pooled vector; size = SDXL's size conditioning.
  conditioning = {
    encoders = {
      { role = "l", options = { "clip", "clip_l" }, meta = "clip", layer = -1, layer_from_metadata = true,
        final_norm = true, pad = nil, pooled = false },
    },
    pooled = false, size = false,
  },

  defaults = { sampler = "euler", scheduler = "normal", cfg = 7.0, steps = 20, image_size = 512, prediction = "eps" },
  latent = { channels = 4, scale_factor = 0.18215, shift_factor = 0 },
  taesd = "taesd", -- the stem of its TAESD files (taesd_decoder.safetensors)
}

return M
