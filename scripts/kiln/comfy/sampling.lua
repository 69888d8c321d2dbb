-- kiln.comfy.sampling: ComfyUI's "sampling" nodes, KSampler and KSamplerAdvanced, on
-- kiln.pipeline.sample_latents (so the same seed and settings give the pipelines'
-- latents), and the general path for combined or area conditioning (ComfyUI's
-- calc_cond_batch). The sampler and scheduler combos are kiln.sample's registries.
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"
local inpaint = require "kiln.inpaint"
local sample = require "kiln.sample"
local registry = require "kiln.comfy.registry"
local V = require "kiln.comfy.values"

local M = {}
-- the node definitions, by name (registered at the end)
M.nodes = {}
local N = M.nodes
local fail, latent_value, add_lora = V.fail, V.latent, V.add_lora

-- round(x) for x in [0, 1] as torch.round (half to even: 0.5 -> 0)
local function round01(t) return inpaint.grow_mask(t, 0) end


-- Does a conditioning need the general sampler path (several entries, an area, a
-- strength other than 1)?
local function is_plain(c)
  if #c.entries ~= 1 then return false end
  local e = c.entries[1]
  return not e.area and (e.strength or 1) == 1
end

-- ComfyUI's weight of an area entry over its crop [1, 1, h, w]: strength, faded over
-- 8 rows / columns at each side that does not touch the picture's edge
local function area_mult(area, H, W, strength)
  local rr = 8
  local vals = {}
  for i = 0, area.h - 1 do
    for j = 0, area.w - 1 do
      local m = strength
      for t = 0, rr - 1 do
        local f = (t + 1) / rr
        if area.y ~= 0 and i == t then m = m * f end
        if area.y + area.h < H and i == area.h - 1 - t then m = m * f end
        if area.x ~= 0 and j == t then m = m * f end
        if area.x + area.w < W and j == area.w - 1 - t then m = m * f end
      end
      vals[#vals + 1] = m
    end
  end
  return kiln.tensor(vals):reshape({ 1, 1, area.h, area.w })
end

-- The denoised prediction of a list of entries as ComfyUI's calc_cond_batch combines
-- them: each entry's prediction (on its area's crop of x) times its weight, summed and
-- divided by the summed weights. preds: {fn = denoiser of one cond, area, strength}.
local function mixed(preds, x, sigma)
  local H, W = x.shape[3], x.shape[4]
  local sum, count = kiln.zeros(x.shape), kiln.full({ 1, 1, H, W }, 1e-37)
  for _, p in ipairs(preds) do
    local a = p.area
    if a then
      local xin = x:narrow(3, a.y + 1, a.h):narrow(4, a.x + 1, a.w):contiguous()
      local out = p.fn(xin, sigma)
      xin:free()
      local m = area_mult(a, H, W, p.strength)
      local pad = { a.x, W - a.x - a.w, a.y, H - a.y - a.h }
      local wo = out * m
      local fo, fm = kiln.nn.pad(wo, pad), kiln.nn.pad(m, pad)
      local s2, c2 = sum + fo, count + fm
      for _, t in ipairs({ out, m, wo, fo, fm, sum, count }) do t:free() end
      sum, count = s2, c2
    else
      local out = p.fn(x, sigma)
      local wo = out * p.strength
      local s2, c2 = sum + wo, count + p.strength
      for _, t in ipairs({ out, wo, sum, count }) do t:free() end
      sum, count = s2, c2
    end
  end
  local r = sum / count
  sum:free(); count:free()
  return r
end

-- The general sampler path (combined or area conditioning): one denoiser per entry
-- (kiln.pipeline.denoiser at guidance 1 is the conditional prediction), mixed per side,
-- then classifier-free guidance; the noise, schedule and mask as sample_latents's.
local function sample_mixed(ctx, ckpt, a, o, x0, made)
  local unet = ckpt.unet
  local H, W = x0.shape[3], x0.shape[4]
  local function preds_of(c, what)
    local list = {}
    for _, e in ipairs(c.entries) do
      if #e.control > 0 then fail(ctx, what .. ": a ControlNet with combined or area conditioning is not supported yet") end
      local od = setmetatable({}, { __index = o })
      if unet.config.adm_in_channels then
        if not e.pooled then fail(ctx, "this UNet needs a pooled text vector (SDXL)") end
        od.y_cond = unet:sdxl_vector(e.pooled, e.size or { width = W * 8, height = H * 8 })
        made[#made + 1] = od.y_cond
      end
      local area = e.area
      if area then  -- cut to the picture, as slicing does
        local y, x = math.min(area.y, H - 1), math.min(area.x, W - 1)
        area = { y = y, x = x, h = math.max(1, math.min(area.h, H - y)), w = math.max(1, math.min(area.w, W - x)) }
      end
      list[#list + 1] = { fn = pipeline.denoiser(ckpt, e.cond, e.cond, 1, od), area = area, strength = e.strength or 1 }
    end
    return list
  end
  if unet.config.in_channels == 9 then fail(ctx, "an inpainting model with combined or area conditioning is not supported yet") end
  local pos, neg = preds_of(a.positive, "positive"), preds_of(a.negative, "negative")
  local cfg = o.cfg
  local function den(x, sigma)
    local c = mixed(pos, x, sigma)
    if cfg == 1 then return c end
    local u = mixed(neg, x, sigma)
    local r = u + (c - u) * cfg
    c:free(); u:free()
    return r
  end
  local sigmas = o.sigmas or pipeline.sigmas(ckpt, o.scheduler, o.steps, o.denoise)
  local s = sigmas:table()
  local noise = o.add_noise == false and kiln.zeros(x0.shape) or kiln.randn(x0.shape, { seed = o.seed })
  local x = x0 + noise * s[1]
  local fn = den
  if o.denoise_mask then fn = inpaint.masked_denoiser(den, o.denoise_mask, x0, noise) end
  local out = sample.run(o.sampler, fn, x, sigmas, { seed = o.seed })
  noise:free()
  if sigmas ~= o.sigmas then sigmas:free() end
  return out
end

-- cond and uncond padded to one length by repeating the shorter one's last chunk,
-- as kiln.pipeline.encode_prompts does
local function same_length(cond, uncond, made)
  local lc, lu = cond.shape[2], uncond.shape[2]
  if lc == lu then return cond, uncond end
  local function grow(t, n)
    local parts, last, have = { t }, t:narrow(2, t.shape[2] - 76, 77), t.shape[2]
    while have < n do parts[#parts + 1] = last; have = have + 77 end
    local r = kiln.cat(parts, 2)
    made[#made + 1] = r
    return r
  end
  if lc < lu then return grow(cond, lu), uncond end
  return cond, grow(uncond, lc)
end

-- KSampler and KSamplerAdvanced: kiln.pipeline.sample_latents with the graph's
-- conditioning, so that the same seed and settings give the pipelines' latents
local function ksample(ctx, a, adv)
  local model, lat = a.model, a.latent_image
  local ckpt = model.ckpt
  local plain = is_plain(a.positive) and is_plain(a.negative)
  local pe, ne = a.positive.entries[1], a.negative.entries[1]
  if not (pe and ne) then fail(ctx, "a sampler needs at least one positive and one negative conditioning") end
  local x0 = lat.samples
  local made = {}
  local o = { seed = a.noise_seed or a.seed, steps = a.steps, cfg = a.cfg, sampler = a.sampler_name,
    scheduler = a.scheduler, denoise = a.denoise or 1, device = ctx.device,
    cache = model.cache }  -- a step cache node's (kiln.comfy.step_cache)
  local cond, uncond = same_length(pe.cond, ne.cond, made)
  -- ControlNets: the positive side's (ControlNetApplyAdvanced puts the same on both;
  -- kiln's denoiser adds them to cond and uncond alike)
  if #pe.control > 0 then o.control = pe.control end
  local unet = model.part
  local lh, lw = x0.shape[3], x0.shape[4]
  local flux = require "kiln.comfy.flux"
  if flux.is_flux(ckpt) then -- guidance, pooled vectors and the model's schedule (kiln.comfy.flux)
    if not plain then fail(ctx, "combined or area conditioning with a Flux model is not supported yet") end
    flux.ksampler_options(ctx, model, pe, ne, o, made)
  elseif unet.config.adm_in_channels then
    if not (pe.pooled and ne.pooled) then fail(ctx, "this UNet needs a pooled text vector (SDXL)") end
    local size = pe.size or { width = lw * 8, height = lh * 8 }
    o.y_cond, o.y_uncond = unet:sdxl_vector(pe.pooled, size), unet:sdxl_vector(ne.pooled, ne.size or size)
    made[#made + 1] = o.y_cond; made[#made + 1] = o.y_uncond
  end
  if lat.noise_mask then
    o.denoise_mask = inpaint.latent_mask(lat.noise_mask, lh, lw)
    made[#made + 1] = o.denoise_mask
  end
  if unet.config.in_channels == 9 then
    if not o.denoise_mask then fail(ctx, "an inpainting model needs a latent with a mask (VAEEncodeForInpaint, SetLatentNoiseMask)") end
    local m = pe.concat_mask and inpaint.latent_mask(pe.concat_mask, lh, lw) or o.denoise_mask
    o.concat_mask = round01(m)
    if m ~= o.denoise_mask then m:free() end
    made[#made + 1] = o.concat_mask
    o.concat_latent = pe.concat_latent
  end
  if adv then
    -- KSamplerAdvanced: the whole schedule's steps start_at_step..end_at_step; without
    -- leftover noise a schedule cut short ends at sigma 0
    local full = o.sigmas and o.sigmas:clone() or pipeline.sigmas(ckpt, a.scheduler, a.steps, 1) -- Flux: the model's
    local n = a.steps
    local first, last = math.max(0, a.start_at_step), math.min(n, a.end_at_step)
    if first >= last then
      full:free()
      for _, t in ipairs(made) do t:free() end
      return { latent_value(ctx, x0, lat.noise_mask) }
    end
    local vals = full:narrow(1, first + 1, last - first + 1):table()
    full:free()
    if last < n and a.return_with_leftover_noise ~= "enable" then vals[#vals] = 0 end
    o.sigmas = kiln.tensor(vals, { device = "cpu" }) -- a schedule: host data
    made[#made + 1] = o.sigmas
    o.add_noise = a.add_noise == "enable"
  end
  local hs = {}
  for _, l in ipairs(model.loras) do hs[#hs + 1] = add_lora(ckpt, l.path, { unet = l.strength, clip = 0 }) end
  ctx:use(unet, { dtype = model.dtype })
  for _, c in ipairs(o.control or {}) do ctx:note_use(c.net) end
  -- the latents where the pipeline makes its noise: the default device (the host,
  -- unless the run's default is another, as `kiln --device sim comfy ...` makes it)
  local home = kiln.default_device()
  local x = x0.device == home and x0 or x0:to(home)
  local ok, out
  if plain then
    ok, out = pcall(pipeline.sample_latents, ckpt, cond, uncond, o, x, x.shape)
  else
    ok, out = pcall(sample_mixed, ctx, ckpt, a, o, x, made)
  end
  if x ~= x0 then x:free() end
  for i = #hs, 1, -1 do hs[i]:remove() end
  for _, t in ipairs(made) do t:free() end
  if not ok then error(out, 0) end
  local v = latent_value(ctx, out, lat.noise_mask)
  return { v }
end

local SEED_MAX = 18446744073709551615.0   -- ComfyUI's 0xffffffffffffffff
local function samplers() return sample.names() end
local function schedulers() return sample.scheduler_names() end
local STEPS = { "steps", "INT", default = 20, min = 1, max = 10000 }
local CFG = { "cfg", "FLOAT", default = 8.0, min = 0.0, max = 100.0, step = 0.1, round = 0.01 }
local SAMPLER = { "sampler_name", "COMBO", choices = samplers, default = "euler" }
local SCHEDULER = { "scheduler", "COMBO", choices = schedulers, default = "normal" }

N.KSampler = {
  category = "sampling",
  inputs = { { "model", "MODEL" }, { "seed", "INT", default = 0, min = 0, max = SEED_MAX }, STEPS, CFG,
    SAMPLER, SCHEDULER, { "positive", "CONDITIONING" }, { "negative", "CONDITIONING" }, { "latent_image", "LATENT" },
    { "denoise", "FLOAT", default = 1.0, min = 0.0, max = 1.0, step = 0.01 } },
  outputs = { "LATENT" },
  run = function(ctx, a) return ksample(ctx, a, false) end,
}

N.KSamplerAdvanced = {
  category = "sampling",
  inputs = { { "model", "MODEL" }, { "add_noise", { "enable", "disable" } },
    { "noise_seed", "INT", default = 0, min = 0, max = SEED_MAX }, STEPS, CFG, SAMPLER, SCHEDULER,
    { "positive", "CONDITIONING" }, { "negative", "CONDITIONING" }, { "latent_image", "LATENT" },
    { "start_at_step", "INT", default = 0, min = 0, max = 10000 },
    { "end_at_step", "INT", default = 10000, min = 0, max = 10000 },
    { "return_with_leftover_noise", { "disable", "enable" } } },
  outputs = { "LATENT" },
  run = function(ctx, a) return ksample(ctx, a, true) end,
}

for name, def in pairs(N) do registry.add_node(name, def) end
return M
