-- kiln.families.flux: Black Forest Labs' Flux.1 ([dev], [schnell]; ComfyUI's Flux and
-- FluxSchnell): a rectified-flow transformer (kiln.flux) conditioned on T5-XXL states
-- and CLIP-L's pooled vector, the 16-channel autoencoder at scale 0.3611, shift 0.1159.
-- [dev] is guidance-distilled (its file has guidance_in.*), [schnell] timestep-
-- distilled (no guidance_in). A diffusion-model file alone (BFL's flux1-dev.safetensors,
-- or ComfyUI's with the model.diffusion_model. prefix) loads as a checkpoint whose
-- `dit` works; the parts it lacks say which file to pass. The file layouts (ComfyUI's
-- whole checkpoints, fp8, GGUF, diffusers folders) are kiln.families.flux_files'.
local mf = require "kiln.model_files"
local files = require "kiln.families.flux_files"

local KEY = files.KEY

-- "dev" when the file has the guidance embedder, else "schnell".
local function variant(shapes, prefix)
  return mf.has_prefix(shapes, (prefix or "") .. "guidance_in.") and "dev" or "schnell"
end

local M = {
  name = "flux",
  label = "Flux.1",

  recognise = {
    -- names no UNet has (the second still there when block 0 is missing; the third a
    -- transformer saved in diffusers' names)
    unet_names = { KEY, "img_in.weight", "single_transformer_blocks.0.proj_mlp.weight" },
    gguf_architectures = { "flux" },
    diffusers_class = files.DIFFUSERS_CLASS,   -- transformer/config.json's _class_name
  },

  -- a whole ComfyUI checkpoint's parts (the names, maps and file handling are
  -- kiln.families.flux_files'); the text encoders and VAE are taken when present
  parts = {
    ldm = { find_unet = files.find_dit, vae = files.VAE_PREFIX, clip = { { prefix = files.CLIP_PREFIX, role = "l" } },
      t5 = files.T5_PREFIX, layout = files.single_layout },
    diffusers = { transformer = "transformer", vae = "vae", clip = { { folder = "text_encoder", role = "l" } },
      t5 = "text_encoder_2", layout = files.diffusers_layout, meta = files.diffusers_meta,
      names_hint = files.DIFFUSERS_HINT },
  },
  unet = {},
  dit = "kiln.flux",      -- the module that builds the network (config, expected, new)
  variant = variant,
  check_parts = files.check_parts,   -- the variant asked for, the text encoders' widths
  lora = "kiln.lora_flux",           -- the names LoRAs give the transformer's weights

  -- CLIP-L gives the pooled vector (y), T5-XXL the context; roles as the loaders name them
  conditioning = {
    encoders = {
      { role = "l", options = { "clip", "clip_l" }, meta = "clip", layer = -1, final_norm = true, pad = nil,
        pooled = true },
      { role = "t5", options = { "t5" }, meta = "t5" },
    },
    pooled = true, size = false,
  },

  -- BFL's cli: 50 steps with guidance for [dev], 4 without for [schnell]; DESIGN.md's
  -- default guidance 3.5 (the cli's is 2.5); no negative pass (cfg 1); prompts padded
  -- to 512 T5 tokens on [dev], 256 on [schnell]
  defaults = { sampler = "euler", scheduler = "simple", cfg = 1.0, steps = 50, image_size = 1024,
    prediction = "flow", guidance = 3.5, t5_length = 512, shift = true },
  variants = {
    dev = { steps = 50, guidance = 3.5, t5_length = 512, shift = true },
    schnell = { steps = 4, guidance = nil, t5_length = 256, shift = false },
  },
  latent = { channels = 16, scale_factor = 0.3611, shift_factor = 0.1159 },

  -- what a file without the part says (kiln.checkpoint puts these in the part's place)
  missing = {
    vae = "this Flux checkpoint has no autoencoder: pass BFL's ae.safetensors as " ..
        "kiln.load_checkpoint(path, {vae = PATH})",
    clip = "this Flux checkpoint has no CLIP-L text encoder: pass clip_l.safetensors as " ..
        "kiln.load_checkpoint(path, {clip = PATH})",
    t5 = "this Flux checkpoint has no T5-XXL text encoder: pass t5xxl_fp16.safetensors (or the fp8 one) as " ..
        "kiln.load_checkpoint(path, {t5 = PATH})",
  },
}

return M
