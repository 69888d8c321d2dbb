-- kiln.families.sd2: Stable Diffusion 2.x (ComfyUI's SD20): an OpenCLIP ViT-H text
-- encoder (the penultimate layer, padded with 0), a UNet of 64-wide heads with context
-- 1024 and linear projections, the SD VAE; 768-pixel models predict v, told by
-- ComfyUI's heuristic when the file does not say.
local sd = require "kiln.families.sd"

local M = {
  name = "sd2",
  label = "SD 2.x",

  recognise = {
    prefixes = { "cond_stage_model.model." },
    context_dim = 1024,
    context_of = sd.context_dim,
    gguf_architectures = { "sd2" },
    text_activation = "gelu",
    text_encoders = function(cfgs)
      return #cfgs == 1 and (cfgs[1].layout == "openclip" or cfgs[1].width == 1024)
    end,
  },

  parts = {
    ldm = {
      find_unet = sd.find_unet, vae = "first_stage_model.",
      clip = { { prefix = "cond_stage_model.model.", role = "h" } },
    },
    diffusers = {
      unet = "unet", vae = "vae", unet_map = sd.diffusers_unet_map, vae_map = sd.diffusers_vae_map,
      clip = { { folder = "text_encoder", role = "h" } },
    },
  },
  unet = { head_dim = 64 },

  conditioning = {
    encoders = {
      { role = "h", options = { "clip", "clip_l" }, meta = "clip", layer = -2, layer_from_metadata = true,
        final_norm = true, pad = 0, pooled = false },
    },
    pooled = false, size = false,
  },

  defaults = { sampler = "euler", scheduler = "normal", cfg = 7.0, steps = 20, image_size = 512, prediction = "eps",
    image_size_v = 768 },
  latent = { channels = 4, scale_factor = 0.18215, shift_factor = 0 },
  taesd = "taesd",

  -- The prediction type when the file does not say (ComfyUI's heuristic for SD 2.x):
  -- v-prediction models have a large spread in one LayerNorm bias of the last output
  -- block. src: a kiln.model_files source; prefix: the UNet's.
  guess_prediction = function(src, prefix)
    local t = src.tensors[prefix .. "output_blocks.11.1.transformer_blocks.0.norm1.bias"]
    if not t then return nil end
    local f = t:to("f32")
    local m = f:mean()
    local d = f - m
    local var = (d * d):mean()
    return math.sqrt(var) > 0.09 and "v" or nil
  end,
}

return M
