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

-- ---------------------------------------------------------------- Kontext

--- The resolutions Kontext [dev] was trained at, {width, height} (BFL's
-- PREFERED_KONTEXT_RESOLUTIONS, ComfyUI's FluxKontextImageScale's).
M.KONTEXT_RESOLUTIONS = {
  { 672, 1568 }, { 688, 1504 }, { 720, 1456 }, { 752, 1392 }, { 800, 1328 }, { 832, 1248 },
  { 880, 1184 }, { 944, 1104 }, { 1024, 1024 }, { 1104, 944 }, { 1184, 880 }, { 1248, 832 },
  { 1328, 800 }, { 1392, 752 }, { 1456, 720 }, { 1504, 688 }, { 1568, 672 },
}

--- The preferred Kontext resolution for a picture W x H: the one whose aspect ratio is
-- nearest (ties to the smaller width, as Python's min over (distance, w, h)).
function M.kontext_size(W, H)
  local ar = W / H
  local best, bd
  for _, r in ipairs(M.KONTEXT_RESOLUTIONS) do
    local d = math.abs(ar - r[1] / r[2])
    if not bd or d < bd or (d == bd and r[1] < best[1]) then best, bd = r, d end
  end
  return best[1], best[2]
end

--- image [1, C, H, W] in [0, 1] resized as ComfyUI's FluxKontextImageScale does: to the
-- preferred resolution of its aspect ratio, cut to that ratio at the centre, Lanczos.
-- A new tensor (a copy when the size is already one of them).
function M.kontext_scale(image)
  local W, H = M.kontext_size(image.shape[4], image.shape[3])
  if image.shape[3] == H and image.shape[4] == W then return image:clone() end
  return require("kiln.image").resize(image, W, H, { mode = "lanczos", crop = "center" })
end

--- The latents of a run's reference pictures (opts.reference: an image [1, 3, H, W] in
-- [0, 1] or a list of them; Kontext [dev]): each resized to its preferred Kontext
-- resolution unless scale is false (then as given: sides a multiple of 16, the 2x2
-- patches of the autoencoder's latent), encoded by ckpt.vae on dev. A list of latents
-- [1, 16, h, w], the caller's to free.
function M.reference_latents(ckpt, refs, scale, dev, tile)
  if type(refs) == "userdata" then refs = { refs } end
  if type(refs) ~= "table" then
    error("reference must be an image tensor [1, 3, H, W] or a list of them, got " .. type(refs), 0)
  end
  local out = {}
  local ok, err = pcall(function()
    for i, img in ipairs(refs) do
      if type(img) ~= "userdata" or not img.shape or #img.shape ~= 4 or img.shape[1] ~= 1 or img.shape[2] < 3 then
        error(string.format("reference[%d] must be an image [1, 3, H, W] in [0, 1], got %s", i,
          type(img) == "userdata" and img.shape and ("[" .. table.concat(img.shape, ", ") .. "]") or type(img)), 0)
      end
      local rgb = img.shape[2] == 3 and img or img:narrow(2, 1, 3)
      local src = scale ~= false and M.kontext_scale(rgb) or nil
      if not src and (img.shape[3] % 16 ~= 0 or img.shape[4] % 16 ~= 0) then
        error(string.format("reference[%d] is %dx%d: with reference_scale = false its sides must be multiples " ..
          "of 16 (the autoencoder's 8 times the 2x2 patches)", i, img.shape[4], img.shape[3]), 0)
      end
      if i == 1 then ckpt.vae:load(dev) end
      out[i] = ckpt.vae:encode(src or rgb, { tile = tile })
      if src then src:free() end
    end
  end)
  if not ok then
    for _, t in ipairs(out) do t:free() end
    error(err, 0)
  end
  if #out == 0 then error("reference is an empty list", 0) end
  return out
end

-- ---------------------------------------------------------------- planning

--- The {width, height} of each reference picture as reference_latents will encode it
-- (the nearest Kontext resolution, or as given with scale == false); entries that are
-- not images are left to reference_latents to refuse.
function M.reference_sizes(refs, scale)
  if type(refs) == "userdata" then refs = { refs } end
  local out = {}
  for _, img in ipairs(type(refs) == "table" and refs or {}) do
    if type(img) == "userdata" and img.shape and #img.shape == 4 then
      local W, H = img.shape[4], img.shape[3]
      if scale ~= false then W, H = M.kontext_size(W, H) end
      out[#out + 1] = { W, H }
    end
  end
  return out
end

--- The transformer's stage for kiln.planner: fn and its inputs (every tensor an
-- argument, made on dev, for the dry run to replace) for one evaluation at this run's
-- size: the latent [B, 16, lh, lw], the run's T5 length of text tokens and, with
-- Kontext references, their latents as extra image tokens at the size the reference
-- stage will give them. B: the batch, twice with true CFG (the larger of the two ways
-- the denoiser may call it).
function M.plan_work(ckpt, o, lw, lh, dev)
  local kiln = require "kiln"
  local dit = ckpt.dit
  local cfg = dit.config
  local B = ((o.cfg or 1) ~= 1 and 2 or 1) * (math.tointeger(o.batch or 1) or 1)
  local flow = o._flow or M.run_options(ckpt, o)
  local f = ckpt.vae.factor or 8
  local inputs = {
    kiln.zeros({ B, cfg.latent_channels, lh, lw }):to(dev),
    kiln.full({ B }, 0.5),
    kiln.zeros({ B, flow.t5_length, cfg.context_dim }):to(dev),
    kiln.zeros({ B, cfg.vec_dim }):to(dev),
  }
  for _, s in ipairs(M.reference_sizes(o.reference, o.reference_scale)) do
    inputs[#inputs + 1] = kiln.zeros({ 1, cfg.latent_channels, s[2] // f, s[1] // f }):to(dev)
  end
  inputs.n = #inputs
  local function fn(x, t, ctx, y, ...)
    local refs = { ... }
    local v = dit:forward(x, t, ctx, y, (flow.guidance or #refs > 0) and
      { guidance = flow.guidance, reference = #refs > 0 and refs or nil } or nil)
    v:free()
  end
  return fn, inputs
end

return M
