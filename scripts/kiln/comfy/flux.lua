-- kiln.comfy.flux: ComfyUI's nodes for Flux.1 and the custom-sampling path it runs
-- through (comfy_extras/nodes_flux.py, nodes_model_advanced.py, nodes_sd3.py,
-- nodes_custom_sampler.py): DualCLIPLoader's "flux" type (CLIP-L + T5-XXL, either
-- order), CLIPTextEncodeFlux, FluxGuidance, ModelSamplingFlux, EmptySD3LatentImage, and
-- RandomNoise / KSamplerSelect / BasicScheduler / BasicGuider / CFGGuider /
-- SamplerCustomAdvanced over kiln.pipeline.sample_latents (so the same seed, sigmas and
-- guidance give the pipelines' latents). As ComfyUI's: a Flux model samples with
-- ModelSamplingFlux's shift (1.15 for [dev], 1.0 for [schnell] unless the node sets
-- it), T5 pads the prompt to at least 256 tokens, a conditioning without a guidance
-- value runs [dev] at 3.5. Kontext: ReferenceLatent, FluxKontextImageScale and
-- FluxKontextMultiReferenceLatentMethod; the sampling gives a conditioning's reference
-- latents to the network (dit:forward's opts.reference).
local kiln = require "kiln"
local flow = require "kiln.flow"
local pipeline = require "kiln.pipeline"
local sample = require "kiln.sample"
local t5 = require "kiln.t5"
local registry = require "kiln.comfy.registry"
local V = require "kiln.comfy.values"

local M = {}
-- the node definitions, by name (registered at the end)
M.nodes = {}
local N = M.nodes
local MAX = V.MAX_RESOLUTION
local fail, cond_value, copy_entry, latent_value = V.fail, V.conditioning, V.copy_entry, V.latent

-- ComfyUI's shifts of a Flux model without ModelSamplingFlux (supported_models.py)
local DEFAULT_MU = { dev = 1.15, schnell = 1.0 }
-- ComfyUI's guidance when the conditioning has none (model_base.Flux.extra_conds)
local DEFAULT_GUIDANCE = 3.5
-- ComfyUI's T5 tokenizer for Flux pads to at least this many tokens, and does not cut
M.T5_MIN_LENGTH = 256

local function is_flux(ckpt) return pipeline.flow_family(ckpt) ~= nil end
M.is_flux = is_flux

--- The model sampling of a MODEL value: ModelSamplingFlux's, else ComfyUI's default for
-- the variant (flow families), else nil (SD's discrete schedule). A flow family without
-- Flux's variants (SD 3.5) samples with its own constant shift, or ModelSamplingSD3's
-- (model.flow_shift).
function M.model_sampling(model)
  local ckpt = model.ckpt
  if not is_flux(ckpt) then return nil end
  if model.flow_shift or DEFAULT_MU[ckpt.variant] == nil then
    return flow.for_checkpoint(pipeline.flow_family(ckpt), ckpt.variant, 2, 2, { shift = model.flow_shift })
  end
  return flow.model_sampling({ mu = model.flux_mu or DEFAULT_MU[ckpt.variant] or DEFAULT_MU.dev })
end

-- ------------------------------------------------------------------ text encoders

-- Is this file T5 (its names) rather than CLIP?
local function is_t5_file(path)
  local ok, names = pcall(function() return require("kiln.model_files").source(path).shapes end)
  if not ok or type(names) ~= "table" then return false end
  for k in pairs(names) do
    if type(k) == "string" and (k:match("SelfAttention%.q%.weight$") or k:match("^enc%.blk%.") or
        k == "shared.weight" or k == "encoder.embed_tokens.weight") then
      return true
    end
  end
  return false
end

M.is_t5_file = is_t5_file

--- DualCLIPLoader's "flux": CLIP-L and T5-XXL files in either order, opened once: a
-- checkpoint holding clip (CLIP-L, its pooled output unprojected) and t5.
function M.text_encoders(ctx, paths)
  local key = table.concat(paths, "+") .. "#flux"
  local c = ctx.ckpts[key]
  if c then return c end
  local clip_path, t5_path
  for _, p in ipairs(paths) do
    if is_t5_file(p) then t5_path = t5_path or p else clip_path = clip_path or p end
  end
  if not (clip_path and t5_path) then
    fail(ctx, "type flux needs a CLIP-L file and a T5-XXL file (clip_l.safetensors, t5xxl_fp16.safetensors); got " ..
      table.concat(paths, ", "))
  end
  return M.open_with_t5(ctx, key, "flux", { clip_path }, t5_path)
end

--- The CLIP files and a T5 file of a family as one checkpoint (clip and t5), opened in
-- the graph's context under `key` (closed with it); a T5 that fails to load closes
-- the CLIPs again.
function M.open_with_t5(ctx, key, family, clip_paths, t5_path)
  local o = ctx:adapter_dirs()
  o.family = family
  local c = require("kiln.checkpoint").load_text_encoders(clip_paths, o)
  local ok, enc = pcall(t5.load, t5_path)
  if not ok then
    c:close()
    error(enc, 0)
  end
  c.t5 = enc
  ctx:opened(key, c)
  ctx.names[enc] = t5_path:match("([^/]+)$") .. " t5"
  return c
end

-- the conditioning entry of a Flux prompt: T5 states of t5xxl (padded to at least 256
-- tokens, as ComfyUI) and CLIP-L's pooled output of clip_l
local function flux_entry(ctx, clip, clip_l, t5xxl, guidance)
  local ckpt = clip.ckpt
  if not rawget(ckpt, "t5") then fail(ctx, "this CLIP has no T5 encoder: load it with DualCLIPLoader type flux") end
  ctx:use(ckpt.t5, { device = clip.device })
  local n = #t5.tokenize(t5xxl)
  local context = ckpt.t5:encode(t5xxl, { length = math.max(M.T5_MIN_LENGTH, n) })
  ctx:use(clip.part, { device = clip.device })
  local cond, pooled = clip.part:encode(clip_l, { weighting = "comfy" })
  cond:free()
  return { cond = context, pooled = pooled, guidance = guidance }
end

--- CLIPTextEncode on a Flux CLIP value: the same text to both encoders (kiln.comfy.conditioning
-- calls this for a CLIP value with a T5).
function M.encode_text(ctx, clip, text) return flux_entry(ctx, clip, text, text, nil) end

N.CLIPTextEncodeFlux = {
  category = "advanced/conditioning/flux",
  inputs = { { "clip", "CLIP" }, { "clip_l", "STRING", multiline = true }, { "t5xxl", "STRING", multiline = true },
    { "guidance", "FLOAT", default = 3.5, min = 0.0, max = 100.0, step = 0.1 } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a) return { cond_value(ctx, { flux_entry(ctx, a.clip, a.clip_l, a.t5xxl, a.guidance) }) } end,
}

N.FluxGuidance = {
  category = "advanced/conditioning/flux",
  inputs = { { "conditioning", "CONDITIONING" }, { "guidance", "FLOAT", default = 3.5, min = 0.0, max = 100.0,
    step = 0.1 } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    local list = {}
    for i, e in ipairs(a.conditioning.entries) do
      local r = copy_entry(e)
      r.guidance = a.guidance
      list[i] = r
    end
    return { cond_value(ctx, list) }
  end,
}

-- ------------------------------------------------------------------ model and latents

N.ModelSamplingFlux = {
  category = "advanced/model",
  inputs = { { "model", "MODEL" }, { "max_shift", "FLOAT", default = 1.15, min = 0.0, max = 100.0, step = 0.01 },
    { "base_shift", "FLOAT", default = 0.5, min = 0.0, max = 100.0, step = 0.01 },
    { "width", "INT", default = 1024, min = 16, max = MAX, step = 8 },
    { "height", "INT", default = 1024, min = 16, max = MAX, step = 8 } },
  outputs = { "MODEL" },
  run = function(ctx, a)
    if not is_flux(a.model.ckpt) then fail(ctx, "ModelSamplingFlux needs a Flux model") end
    -- ComfyUI: x = width * height / (8 * 8 * 2 * 2), mu linear from base at 256 to max at 4096
    local tokens = a.width * a.height / 256
    local fields = {}
    for k, v in pairs(a.model) do fields[k] = v end
    fields.flux_mu = flow.mu(tokens, a.base_shift, a.max_shift)
    fields.tensors, fields.res, fields.type = nil, nil, nil
    return { ctx:value("MODEL", fields, nil, a.model.res) }
  end,
}

N.EmptySD3LatentImage = {
  category = "latent/sd3",
  inputs = { { "width", "INT", default = 1024, min = 16, max = MAX, step = 16 },
    { "height", "INT", default = 1024, min = 16, max = MAX, step = 16 },
    { "batch_size", "INT", default = 1, min = 1, max = 4096 } },
  outputs = { "LATENT" },
  run = function(ctx, a)
    return { latent_value(ctx, kiln.zeros({ a.batch_size, 16, a.height // 8, a.width // 8 })) }
  end,
}

-- two lists of tensors hold the same ones (nil as empty)
local function same_list(a, b)
  a, b = a or {}, b or {}
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- The run options of a Flux model's sampling (kiln.pipeline.sample_latents): the
-- distilled guidance of the positive conditioning ([dev]; 3.5 when it has none), the
-- pooled vectors, and the sigmas of the model's sampling (ModelSamplingFlux's or
-- ComfyUI's default shift) unless o.sigmas is given. For KSampler and SamplerCustomAdvanced.
function M.ksampler_options(ctx, model, pe, ne, o, made)
  local ckpt = model.ckpt
  flow.check_sampler(o.sampler)
  if not pe.pooled or (o.cfg ~= 1 and not (ne and ne.pooled)) then
    fail(ctx, "a Flux model needs CLIP-L's pooled output (CLIPTextEncodeFlux or CLIPTextEncode with a flux CLIP)")
  end
  local gd = pe.guidance
  if gd == nil then gd = DEFAULT_GUIDANCE end
  -- model.skip_layer_guidance: SkipLayerGuidanceSD3's (kiln.comfy.sd3)
  o._flow = { guidance = ckpt.variant == "dev" and gd or nil, skip_layer_guidance = model.skip_layer_guidance }
  o.y_cond, o.y_uncond = pe.pooled, o.cfg ~= 1 and ne.pooled or nil
  -- ReferenceLatent's latents (Kontext): kiln's denoiser gives the one list to both passes
  local refs = pe.reference_latents
  if o.cfg ~= 1 and not same_list(refs, ne and ne.reference_latents) then
    fail(ctx, "the negative conditioning has other reference latents than the positive's: with cfg other than 1 " ..
      "both sides must have the same (ReferenceLatent on both, or cfg 1)")
  end
  if refs and #refs > 0 then o._reference = refs end
  if not o.sigmas then
    o.sigmas = flow.sigmas(M.model_sampling(model), o.scheduler, o.steps, o.denoise or 1)
    made[#made + 1] = o.sigmas
  end
end

-- ------------------------------------------------------------------ Kontext (edit models)

-- ComfyUI's ReferenceLatent (comfy_extras/nodes_edit_model.py): the latent appended to
-- each entry's reference_latents (chained nodes give several); without a latent the
-- conditioning passes unchanged. A Flux model reads them as Kontext's reference tokens
-- (kiln.flux); other models ignore them, as ComfyUI's do.
N.ReferenceLatent = {
  category = "advanced/conditioning/edit_models",
  description = "Sets the guiding latent for an edit model; chain several for several reference images.",
  inputs = { { "conditioning", "CONDITIONING" }, { "latent", "LATENT", optional = true } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    -- a new value either way (it holds the tensors its entries share with the input's)
    local list = {}
    for i, e in ipairs(a.conditioning.entries) do
      local r = copy_entry(e)
      if a.latent then
        local refs = {}
        for j, t in ipairs(e.reference_latents or {}) do refs[j] = t end
        refs[#refs + 1] = a.latent.samples
        r.reference_latents = refs
      end
      list[i] = r
    end
    return { cond_value(ctx, list) }
  end,
}

-- ComfyUI's FluxKontextImageScale: the picture at the preferred Kontext resolution of its
-- aspect ratio (Lanczos, cut at the centre; kiln.families.flux.kontext_scale).
N.FluxKontextImageScale = {
  category = "advanced/conditioning/flux",
  description = "Resizes the image to one that is more optimal for flux kontext.",
  inputs = { { "image", "IMAGE" } },
  outputs = { "IMAGE" },
  run = function(ctx, a)
    local F = require "kiln.families.flux"
    local t = a.image.t
    local out = {}
    for i = 1, t.shape[1] do   -- one picture at a time: kontext_scale takes [1, C, H, W]
      local one = t:narrow(1, i, 1)
      out[i] = F.kontext_scale(one)
      one:free()
    end
    local r = #out == 1 and out[1] or kiln.cat(out, 1)
    if #out > 1 then for _, o in ipairs(out) do o:free() end end
    return { V.image(ctx, r) }
  end,
}

-- ComfyUI's FluxKontextMultiReferenceLatentMethod: how several references are placed.
-- kiln places them as ComfyUI's default, "offset"; the others are refused by the combo.
N.FluxKontextMultiReferenceLatentMethod = {
  category = "advanced/conditioning/flux",
  inputs = { { "conditioning", "CONDITIONING" }, { "reference_latents_method", { "offset" } } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    local list = {}
    for i, e in ipairs(a.conditioning.entries) do
      local r = copy_entry(e)
      r.reference_latents_method = a.reference_latents_method
      list[i] = r
    end
    return { cond_value(ctx, list) }
  end,
}

-- ------------------------------------------------------------------ custom sampling

local SEED_MAX = 18446744073709551615.0

N.RandomNoise = {
  category = "sampling/custom_sampling/noise",
  inputs = { { "noise_seed", "INT", default = 0, min = 0, max = SEED_MAX } },
  outputs = { "NOISE" },
  run = function(ctx, a) return { ctx:value("NOISE", { seed = a.noise_seed }) } end,
}

N.DisableNoise = {
  category = "sampling/custom_sampling/noise",
  inputs = {},
  outputs = { "NOISE" },
  run = function(ctx) return { ctx:value("NOISE", { seed = 0, disabled = true }) } end,
}

N.KSamplerSelect = {
  category = "sampling/custom_sampling/samplers",
  inputs = { { "sampler_name", "COMBO", choices = function() return sample.names() end, default = "euler" } },
  outputs = { "SAMPLER" },
  run = function(ctx, a) return { ctx:value("SAMPLER", { name = a.sampler_name }) } end,
}

N.BasicScheduler = {
  category = "sampling/custom_sampling/schedulers",
  inputs = { { "model", "MODEL" },
    { "scheduler", "COMBO", choices = function() return sample.scheduler_names() end, default = "simple" },
    { "steps", "INT", default = 20, min = 1, max = 10000 },
    { "denoise", "FLOAT", default = 1.0, min = 0.0, max = 1.0, step = 0.01 } },
  outputs = { "SIGMAS" },
  run = function(ctx, a)
    local ms = M.model_sampling(a.model)
    local s
    if ms then
      s = flow.sigmas(ms, a.scheduler, a.steps, a.denoise)
    else
      s = pipeline.sigmas(a.model.ckpt, a.scheduler, a.steps, a.denoise)
    end
    return { ctx:value("SIGMAS", { sigmas = s }, { s }) }
  end,
}

-- a guider holds its model and its conditionings' tensors (and their ControlNets)
local function guider(ctx, model, positive, negative, cfg)
  local tensors, res = {}, {}
  for _, r in ipairs(model.res) do res[#res + 1] = r end
  for _, c in ipairs({ positive, negative }) do
    for _, t in ipairs(c and c.tensors or {}) do tensors[#tensors + 1] = t end
    for _, r in ipairs(c and c.res or {}) do res[#res + 1] = r end
  end
  return ctx:value("GUIDER", { model = model, positive = positive, negative = negative, cfg = cfg }, tensors, res)
end

N.BasicGuider = {
  category = "sampling/custom_sampling/guiders",
  inputs = { { "model", "MODEL" }, { "conditioning", "CONDITIONING" } },
  outputs = { "GUIDER" },
  run = function(ctx, a) return { guider(ctx, a.model, a.conditioning, nil, 1.0) } end,
}

N.CFGGuider = {
  category = "sampling/custom_sampling/guiders",
  inputs = { { "model", "MODEL" }, { "positive", "CONDITIONING" }, { "negative", "CONDITIONING" },
    { "cfg", "FLOAT", default = 8.0, min = 0.0, max = 100.0, step = 0.1, round = 0.01 } },
  outputs = { "GUIDER" },
  run = function(ctx, a) return { guider(ctx, a.model, a.positive, a.negative, a.cfg) } end,
}

-- the one plain entry of a conditioning (kiln's custom sampling takes no areas yet)
local function plain_entry(ctx, c, what)
  local e = c and c.entries[1]
  if not e then fail(ctx, what .. ": an empty conditioning") end
  if #c.entries ~= 1 or e.area or (e.strength or 1) ~= 1 or #(e.control or {}) > 0 then
    fail(ctx, what .. ": combined, area or ControlNet conditioning is not supported with SamplerCustomAdvanced yet")
  end
  return e
end

N.SamplerCustomAdvanced = {
  category = "sampling/custom_sampling",
  inputs = { { "noise", "NOISE" }, { "guider", "GUIDER" }, { "sampler", "SAMPLER" }, { "sigmas", "SIGMAS" },
    { "latent_image", "LATENT" } },
  outputs = { "LATENT", "LATENT" },
  run = function(ctx, a)
    local g = a.guider
    local model, ckpt = g.model, g.model.ckpt
    local pe = plain_entry(ctx, g.positive, "positive")
    local ne = g.cfg ~= 1 and plain_entry(ctx, g.negative, "negative") or nil
    local lat = a.latent_image
    local x0 = lat.samples
    local o = { seed = a.noise.seed, sampler = a.sampler.name, sigmas = a.sigmas.sigmas, cfg = g.cfg,
      add_noise = not a.noise.disabled, device = ctx.device, denoise = 1 }
    local made = {}
    if is_flux(ckpt) then
      M.ksampler_options(ctx, model, pe, ne, o, made)
    elseif model.part.config.adm_in_channels then
      fail(ctx, "SDXL with SamplerCustomAdvanced is not supported yet (use KSampler)")
    end
    if lat.noise_mask then
      o.denoise_mask = require("kiln.inpaint").latent_mask(lat.noise_mask, x0.shape[3], x0.shape[4])
      made[#made + 1] = o.denoise_mask
    end
    local hs = {}
    for _, l in ipairs(model.loras) do hs[#hs + 1] = V.add_lora(ckpt, l.path, { unet = l.strength, clip = 0 }) end
    ctx:use(model.part, { dtype = model.dtype })
    local home = kiln.default_device()
    local x = x0.device == home and x0 or x0:to(home)
    local ok, out = pcall(pipeline.sample_latents, ckpt, pe.cond, ne and ne.cond or nil, o, x, x.shape)
    if x ~= x0 then x:free() end
    for i = #hs, 1, -1 do hs[i]:remove() end
    for _, t in ipairs(made) do t:free() end
    if not ok then error(out, 0) end
    -- the denoised output: the last step's prediction, which euler's last step to sigma 0 is
    local den = out:clone()
    return { latent_value(ctx, out, lat.noise_mask), latent_value(ctx, den, lat.noise_mask) }
  end,
}

for name, def in pairs(N) do registry.add_node(name, def) end
return M
