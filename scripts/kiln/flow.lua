-- kiln.flow: flow matching (rectified flow) for the transformer families (Flux, SD 3.x):
-- x_t = (1 - t) x0 + t noise, the network predicts the velocity v = noise - x0, and
-- sigma = t. This file owns the schedules (BFL's get_schedule with its time shift
-- from the image's token count; a constant shift as SD 3's), a model-sampling object
-- kiln.sample's schedulers read (as ComfyUI's ModelSamplingFlux / ModelSamplingDiscreteFlow),
-- and the denoiser that makes a velocity network what the samplers call:
-- denoised = x - sigma * v, so kiln.sample's euler is BFL's loop (x + (t_next - t) v).
local kiln = require "kiln"
local guidance = require "kiln.guidance"

local M = {}
local fmt = string.format

-- BFL's defaults: the shift mu grows linearly with the image's token count from
-- base_shift at 256 tokens to max_shift at 4096.
M.BASE_SHIFT, M.MAX_SHIFT = 0.5, 1.15
M.BASE_TOKENS, M.MAX_TOKENS = 256, 4096
-- the length of the table of sigmas the model-sampling object carries ("simple",
-- "beta" and the other table-reading schedulers pick from it), as ComfyUI's
M.TABLE = 10000

--- BFL's time_shift(mu, 1, t): exp(mu) / (exp(mu) + (1/t - 1)); 0 at 0, 1 at 1.
function M.time_shift(mu, t)
  if t <= 0 then return 0 end
  if t >= 1 then return 1 end
  local e = math.exp(mu)
  return e / (e + (1 / t - 1))
end

--- SD 3's constant shift (ComfyUI's time_snr_shift): s t / (1 + (s - 1) t).
function M.snr_shift(s, t)
  if s == 1 then return t end
  return s * t / (1 + (s - 1) * t)
end

--- BFL's get_lin_function: mu for an image of `tokens` packed tokens.
function M.mu(tokens, base_shift, max_shift)
  base_shift, max_shift = base_shift or M.BASE_SHIFT, max_shift or M.MAX_SHIFT
  local m = (max_shift - base_shift) / (M.MAX_TOKENS - M.BASE_TOKENS)
  return m * tokens + (base_shift - m * M.BASE_TOKENS)
end

--- The packed token count of a latent h x w (2x2 patches), as BFL's image_seq_len.
function M.tokens(h, w) return (h // 2) * (w // 2) end

-- a double rounded to f32 (BFL's schedule is a float32 tensor)
local function f32(v) return (string.unpack("f", string.pack("f", v))) end

--- BFL's get_schedule(steps, tokens, base_shift, max_shift, shift): steps + 1 times from
-- 1 down to 0, shifted (opts.shift ~= false) by mu of the token count. A Lua list.
function M.get_schedule(steps, tokens, opts)
  opts = opts or {}
  if math.type(steps) ~= "integer" or steps < 1 then
    error(fmt("kiln.flow.get_schedule: steps must be a positive integer, got %s", tostring(steps)), 2)
  end
  local mu = opts.shift ~= false and M.mu(tokens, opts.base_shift, opts.max_shift) or nil
  local r = {}
  for i = 0, steps do
    local t = f32(1 - i / steps)
    r[i + 1] = f32(mu and M.time_shift(mu, t) or t)
  end
  return r
end

--- A model-sampling object for a flow model, the shape kiln.sample's schedulers read:
-- {sigmas (ascending table), sigma_min, sigma_max, timestep(sigma), sigma(t), prediction
-- = "flow", flow = true}. opts: mu (BFL's exponential shift; nil for none) or shift (a
-- constant shift, SD 3's 3.0), multiplier (the network's time for sigma 1: 1 for Flux,
-- 1000 for SD 3). timestep(sigma) is what the network is given (sigma * multiplier);
-- sigma(t) shifts t / multiplier, as ComfyUI's.
function M.model_sampling(opts)
  opts = opts or {}
  local mult = opts.multiplier or 1
  local shift
  if opts.mu then
    local mu = opts.mu
    shift = function(t) return M.time_shift(mu, t) end
  else
    local s = opts.shift or 1
    shift = function(t) return M.snr_shift(s, t) end
  end
  local n = opts.table or M.TABLE
  local sig = {}
  for i = 1, n do sig[i] = shift(i / n) end
  local ms = { sigmas = sig, sigma_min = sig[1], sigma_max = sig[n], prediction = "flow", flow = true,
    mu = opts.mu, shift = opts.shift, multiplier = mult, discrete = opts.table ~= nil }
  function ms.timestep(sigma) return sigma * mult end
  function ms.sigma(t) return shift(t / mult) end
  -- ComfyUI's percent_to_sigma (the ends of a guidance window)
  function ms.percent_to_sigma(p)
    if p <= 0 then return 1.0 end
    if p >= 1 then return 0.0 end
    return shift(1 - p)
  end
  --- the times of BFL's schedule: steps + 1 values from 1 to 0 (exact; ComfyUI's
  -- "simple" picks the same from its table when steps divides it)
  function ms.schedule(steps)
    local r = {}
    for i = 0, steps do r[i + 1] = f32(shift(f32(1 - i / steps))) end
    return r
  end
  return ms
end

--- The model sampling of a flow family's checkpoint for a latent h x w: Flux [dev]
-- shifts by mu of the token count (BFL's get_schedule with shift), [schnell] does not
-- (the family's variant's `shift`). opts.mu / opts.shift override (ComfyUI's
-- ModelSamplingFlux / ModelSamplingSD3 nodes).
function M.for_checkpoint(F, variant, h, w, opts)
  opts = opts or {}
  local v = F.variants and F.variants[variant] or {}
  local d = F.defaults
  -- a family trained on a discrete table of times (SD 3: 1000) gives its length
  local mult, tab = F.flow and F.flow.multiplier or 1, F.flow and F.flow.table
  if opts.mu or opts.shift then
    return M.model_sampling({ mu = opts.mu, shift = opts.shift, multiplier = mult, table = tab })
  end
  local shifts = v.shift
  if shifts == nil then shifts = d.shift end
  if shifts == true then
    return M.model_sampling({ mu = M.mu(M.tokens(h, w), d.base_shift, d.max_shift), multiplier = mult, table = tab })
  elseif type(shifts) == "number" then
    return M.model_sampling({ shift = shifts, multiplier = mult, table = tab })
  end
  return M.model_sampling({ multiplier = mult, table = tab })
end

--- The sigmas of a run: `steps` steps of scheduler `name` at denoise d (< 1: the last
-- steps + 1 of a schedule of steps / d steps, as ComfyUI's BasicScheduler). "simple" is
-- BFL's schedule exactly (on a discrete model, SD 3's, ComfyUI's pick from its table);
-- the others are kiln.sample's over ms.
function M.sigmas(ms, name, steps, d)
  local sample = require "kiln.sample"
  d = d or 1
  if d <= 0 then return kiln.tensor({ 0 }, { device = "cpu" }) end
  local total = d < 1 and math.floor(steps / d) or steps
  local s
  if name == "simple" and not ms.discrete then
    if math.type(total) ~= "integer" or total < 1 then error("kiln.flow: steps must be a positive integer", 3) end
    s = kiln.tensor(ms.schedule(total), { device = "cpu" })
  else
    s = sample.sigmas(name, total, { model_sampling = ms })
  end
  if total > steps then
    local c = s:narrow(1, total - steps + 1, steps + 1)
    s = c:contiguous()
    c:free()
  end
  return s
end

--- Samplers whose noise is made for SD's (variance-exploding) sigmas: refused on a flow
-- model rather than run with the wrong noise level.
function M.check_sampler(name)
  local info = require("kiln.sample").sampler_info(name)
  if info and info.noise then
    error(fmt("sampler '%s' adds noise scaled for SD's schedules; with a flow-matching model (Flux, SD 3) use " ..
      "a deterministic one (euler, heun, dpm_2, lms, dpmpp_2m, uni_pc, ddim)", name), 0)
  end
end

--- The starting point of a run at the first sigma s: noise * s + x0 * (1 - s) (noise
-- alone from pure noise, s = 1), ComfyUI's CONST.noise_scaling.
function M.noise_scaling(s, noise, x0)
  local n = noise * s
  if not x0 then return n end
  local k = x0 * (1 - s)
  local r = n + k
  n:free(); k:free()
  return r
end

--- The denoiser the samplers call, around a velocity network:
-- forward(x, t, ctx, y, n [, skip_layers]) -> v (the caller's network call; t a Lua
-- number), o: {ms, cond, uncond, y_cond, y_uncond, cfg, batch, skip_layer_guidance}.
-- Returns function(x, sigma) -> x - sigma * v, with true classifier-free guidance
-- u + (c - u) * cfg when cfg ~= 1 (cond and uncond in one batched call when o.batch,
-- else two). o.skip_layer_guidance = {layers, scale, start, stop}: ComfyUI's
-- SkipLayerGuidanceDiT / SkipLayerGuidanceSD3, + (c - c_skip) * scale where c_skip is
-- the positive pass without those blocks, while sigma is within the window of
-- percent_to_sigma(start) .. percent_to_sigma(stop).
function M.denoiser(forward, o)
  local ms, cfg = o.ms, o.cfg or 1
  local cond, uncond, y_c, y_u = o.cond, o.uncond, o.y_cond, o.y_uncond
  local slg = o.skip_layer_guidance
  local slg_hi = slg and ms.percent_to_sigma(slg.start)
  local slg_lo = slg and ms.percent_to_sigma(slg.stop)
  local batch = o.batch and cfg ~= 1
  local ctx_both = batch and kiln.cat({ uncond, cond }, 1) or nil
  local y_both = batch and kiln.cat({ y_u, y_c }, 1) or nil

  local function predict(x, sigma, ctx, y, n, skip)
    local v = forward(x, ms.timestep(sigma), ctx, y, n, skip)
    if v.device ~= x.device then
      local c = v:to(x.device)
      v:free()
      v = c
    end
    local sv = v * sigma
    v:free()
    local den = x - sv
    sv:free()
    return den
  end

  -- the skip-layer term on the guided result r (the positive prediction c)
  local function skip_guided(x, sigma, r, c)
    if not slg or slg.scale <= 0 or sigma > slg_hi or sigma < slg_lo then return r end
    local s = predict(x, sigma, cond, y_c, x.shape[1], slg.layers)
    local d = c - s
    local ds = d * slg.scale
    local r2 = r + ds
    s:free(); d:free(); ds:free(); r:free()
    return r2
  end

  local den = guidance.cfg(predict, cfg, cond, uncond, y_c, y_u,
    batch and { ctx = ctx_both, y = y_both } or nil, slg and skip_guided or nil)
  -- the batched copies live as long as the denoiser: freed by closing it
  return den, function()
    if ctx_both then ctx_both:free() end
    if y_both then y_both:free() end
  end
end

return M
