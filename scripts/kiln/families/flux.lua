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
      -- BFL's HFEmbedder takes CLIPTextModel's pooler_output: the final norm at the
      -- end token, without the text projection
      { role = "l", options = { "clip", "clip_l" }, meta = "clip", layer = -1, final_norm = true, pad = nil,
        pooled = "unprojected" },
      { role = "t5", options = { "t5" }, meta = "t5" },
    },
    pooled = true, size = false,
  },

  -- BFL's cli: 50 steps with guidance for [dev], 4 without for [schnell]; DESIGN.md's
  -- default guidance 3.5 (the cli's is 2.5); no negative pass (cfg 1); prompts padded
  -- to 512 T5 tokens on [dev], 256 on [schnell]
  defaults = { sampler = "euler", scheduler = "simple", cfg = 1.0, steps = 50, image_size = 1024,
    prediction = "flow", guidance = 3.5, t5_length = 512, shift = true, base_shift = 0.5, max_shift = 1.15 },
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

-- ---------------------------------------------------------------- pipelines

-- The options only [dev] takes (a [schnell] file has no guidance embedder).
local DEV_ONLY = { "guidance" }

--- Checks a run's Flux options against the checkpoint (o: the caller's options) and
-- returns the values the run uses: {guidance, t5_length}.
function M.run_options(ckpt, o)
  local v = M.variants[ckpt.variant] or M.variants.dev
  if ckpt.variant == "schnell" then
    for _, k in ipairs(DEV_ONLY) do
      if o[k] ~= nil then
        error(string.format("%s is a [dev] option: this Flux.1 checkpoint is [schnell] (no guidance_in.* " ..
          "tensors: timestep-distilled, it takes no distilled guidance)", k), 0)
      end
    end
  end
  local g = o.guidance
  if g == nil then g = v.guidance end
  if g ~= nil and type(g) ~= "number" then error("guidance must be a number, got " .. type(g), 0) end
  local n = o.t5_length or v.t5_length
  if math.type(n) ~= "integer" or n < 1 then
    error(string.format("t5_length must be a positive integer, got %s", tostring(o.t5_length)), 0)
  end
  return { guidance = g, t5_length = n }
end

--- The conditioning of prompts as BFL's prepare builds it: for each, the T5 states of
-- its ids at t5_length tokens (ckpt.t5:encode) [1, L, d] and CLIP-L's pooled output
-- over 77 tokens [1, d_clip] (the prompt as typed: no emphasis syntax, as BFL's
-- tokenizers). T5 (the larger) runs and is unloaded before CLIP loads, and CLIP is
-- unloaded after: the sampling that follows has the device to itself. Returns two
-- lists (contexts, pooled vectors) in the prompts' order.
function M.encode_prompts(ckpt, prompts, t5_length, dev)
  local _ = ckpt.t5.encode, ckpt.clip.encode -- a missing encoder says which file to pass, before any work
  local ctx, pooled = {}, {}
  local ok, err = pcall(function()
    ckpt.t5:load(dev)
    for i, p in ipairs(prompts) do ctx[i] = ckpt.t5:encode(p, { length = t5_length }) end
    ckpt.t5:unload()
    ckpt.clip:load(dev)
    for i, p in ipairs(prompts) do
      local c, pl = ckpt.clip:encode(p, { emphasis = false })
      c:free()
      if not pl then error("Flux: the CLIP text encoder gave no pooled vector", 0) end
      pooled[i] = pl
    end
    ckpt.clip:unload()
  end)
  if not ok then
    for _, t in pairs(ctx) do t:free() end
    for _, t in pairs(pooled) do t:free() end
    pcall(ckpt.t5.unload, ckpt.t5)
    pcall(ckpt.clip.unload, ckpt.clip)
    error(err, 0)
  end
  return ctx, pooled
end

return M
