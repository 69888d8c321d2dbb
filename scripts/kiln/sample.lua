-- kiln.sample: samplers and noise schedules with the arithmetic of k-diffusion
-- (Katherine Crowson's k-diffusion, sampling.py) and the names ComfyUI uses, plus
-- the discrete noise schedule of Stable Diffusion (sigma <-> timestep).
--
-- A sampler is run(denoise, x, sigmas, opts): denoise(x, sigma) returns the
-- denoised prediction for tensor x at the Lua number sigma; sigmas is a 1-D tensor
-- (or a Lua list) ending in 0. Ancestral and SDE samplers draw noise from
-- opts.noise(shape) (kiln.randn with a seeded counter by default). Every step
-- calls opts.callback({i=, n=, sigma=, x=, denoised=}) when given; returning
-- false from it (or kiln.cancel) stops at the step boundary.
--
-- This file is the one registry of samplers and schedulers: each is added once,
-- below its function, with the label A1111 writes in a PNG's "parameters" text
-- (and, for samplers, whether it draws noise). The pipelines, the CLI's help, the
-- PNG parameters, the editor definitions (bindings/kiln.meta.lua, checked by
-- tests/lua/test_meta.lua) and the tests all read it.
local kiln = require "kiln"

local sample = {}

---------------------------------------------------------------------------
-- helpers
---------------------------------------------------------------------------
local function list_of(sigmas)
  if type(sigmas) == "table" then return sigmas end
  return sigmas:table()
end

local function to_d(x, sigma, denoised)     -- (x - denoised) / sigma
  return (x - denoised) / sigma
end

-- sigma_down, sigma_up of an ancestral step (k-diffusion get_ancestral_step)
local function ancestral_step(sigma_from, sigma_to, eta)
  eta = eta or 1
  if eta == 0 then return sigma_to, 0 end
  local up = math.min(sigma_to,
    eta * math.sqrt(sigma_to ^ 2 * (sigma_from ^ 2 - sigma_to ^ 2) / sigma_from ^ 2))
  local down = math.sqrt(sigma_to ^ 2 - up ^ 2)
  return down, up
end
sample.ancestral_step = ancestral_step

local function expm1(x)
  if math.abs(x) < 1e-5 then return x + x * x / 2 + x * x * x / 6 end
  return math.exp(x) - 1
end

-- Default noise source: kiln.randn from a seed that advances per call, so a run
-- is reproducible from opts.seed.
local function default_noise(opts)
  local seed = opts.seed or 0
  local k = 0
  return function(shape)
    k = k + 1
    return kiln.randn(shape, { seed = seed + 1000003 * k })
  end
end

-- Per step: report progress to an embedding host (kiln.progress raises a
-- "cancelled" error when the host asked to stop; opts.progress = false when the
-- caller reports itself), then the user's callback.
local function stepper(opts, n)
  local cb = opts.callback
  local report = opts.progress ~= false and kiln.progress
  return function(i, sigma, x, denoised)
    if report then report(i, n, "sample") end
    if cb and cb({ i = i, n = n, sigma = sigma, x = x, denoised = denoised }) == false then
      error({ kind = "cancelled", message = "sampling cancelled at step " .. i }, 0)
    end
  end
end

-- Churn of euler/heun/dpm_2 (s_churn, s_tmin, s_tmax, s_noise as k-diffusion)
local function churn(x, sigma, n, opts, noise)
  local s_churn, s_tmin, s_tmax = opts.s_churn or 0, opts.s_tmin or 0, opts.s_tmax or math.huge
  local gamma = 0
  if s_churn > 0 and sigma >= s_tmin and sigma <= s_tmax then
    gamma = math.min(s_churn / n, 2 ^ 0.5 - 1)
  end
  local sigma_hat = sigma * (gamma + 1)
  if gamma > 0 then
    x = x + noise(x.shape) * ((opts.s_noise or 1) * math.sqrt(sigma_hat ^ 2 - sigma ^ 2))
  end
  return x, sigma_hat
end

---------------------------------------------------------------------------
-- samplers
---------------------------------------------------------------------------

-- A registry: name -> function, name -> entry {name, fn, label, [flag] = boolean},
-- and the names in the order they were added; `add` puts one in (or replaces it).
local function registry(what, flag)
  local fns, info, order = {}, {}, {}
  local usage = ("sample.add_%s(name, fn, label, %s)"):format(what, flag)
  local function add(name, fn, label, on)
    assert(type(name) == "string" and type(fn) == "function" and type(label) == "string", usage)
    if not info[name] then order[#order + 1] = name end
    fns[name] = fn
    info[name] = { name = name, fn = fn, label = label, [flag] = on and true or false }
  end
  return fns, info, order, add
end

-- name -> function(denoise, x, s, opts, noise, step); and name -> registry entry
local samplers, sampler_info, sampler_order, add_sampler = registry("sampler", "noise")

--- Adds a sampler to the registry: name (k-diffusion / ComfyUI), fn, the A1111
-- label, and whether it draws noise at every step (ancestral and SDE samplers;
-- the others draw none unless s_churn asks for it).
function sample.add_sampler(name, fn, label, noise) add_sampler(name, fn, label, noise) end

function samplers.euler(denoise, x, s, opts, noise, step)
  local n = #s - 1
  for i = 1, n do
    local sigma_hat
    x, sigma_hat = churn(x, s[i], n, opts, noise)
    local denoised = denoise(x, sigma_hat)
    step(i, s[i], x, denoised)
    x = x + to_d(x, sigma_hat, denoised) * (s[i + 1] - sigma_hat)
  end
  return x
end
sample.add_sampler("euler", samplers.euler, "Euler", false)

function samplers.euler_ancestral(denoise, x, s, opts, noise, step)
  local n, eta, s_noise = #s - 1, opts.eta or 1, opts.s_noise or 1
  for i = 1, n do
    local denoised = denoise(x, s[i])
    step(i, s[i], x, denoised)
    local down, up = ancestral_step(s[i], s[i + 1], eta)
    x = x + to_d(x, s[i], denoised) * (down - s[i])
    if s[i + 1] > 0 then x = x + noise(x.shape) * (s_noise * up) end
  end
  return x
end
sample.add_sampler("euler_ancestral", samplers.euler_ancestral, "Euler a", true)

function samplers.heun(denoise, x, s, opts, noise, step)
  local n = #s - 1
  for i = 1, n do
    local sigma_hat
    x, sigma_hat = churn(x, s[i], n, opts, noise)
    local denoised = denoise(x, sigma_hat)
    step(i, s[i], x, denoised)
    local d = to_d(x, sigma_hat, denoised)
    local dt = s[i + 1] - sigma_hat
    if s[i + 1] == 0 then
      x = x + d * dt
    else
      local x2 = x + d * dt
      local d2 = to_d(x2, s[i + 1], denoise(x2, s[i + 1]))
      x = x + (d + d2) * (dt / 2)
    end
  end
  return x
end
sample.add_sampler("heun", samplers.heun, "Heun", false)

function samplers.dpm_2(denoise, x, s, opts, noise, step)
  local n = #s - 1
  for i = 1, n do
    local sigma_hat
    x, sigma_hat = churn(x, s[i], n, opts, noise)
    local denoised = denoise(x, sigma_hat)
    step(i, s[i], x, denoised)
    local d = to_d(x, sigma_hat, denoised)
    if s[i + 1] == 0 then
      x = x + d * (s[i + 1] - sigma_hat)
    else
      local sigma_mid = math.exp((math.log(sigma_hat) + math.log(s[i + 1])) / 2)
      local x2 = x + d * (sigma_mid - sigma_hat)
      local d2 = to_d(x2, sigma_mid, denoise(x2, sigma_mid))
      x = x + d2 * (s[i + 1] - sigma_hat)
    end
  end
  return x
end
sample.add_sampler("dpm_2", samplers.dpm_2, "DPM2", false)

function samplers.dpm_2_ancestral(denoise, x, s, opts, noise, step)
  local n, eta, s_noise = #s - 1, opts.eta or 1, opts.s_noise or 1
  for i = 1, n do
    local denoised = denoise(x, s[i])
    step(i, s[i], x, denoised)
    local down, up = ancestral_step(s[i], s[i + 1], eta)
    local d = to_d(x, s[i], denoised)
    if down == 0 then
      x = x + d * (down - s[i])
    else
      local sigma_mid = math.exp((math.log(s[i]) + math.log(down)) / 2)
      local x2 = x + d * (sigma_mid - s[i])
      local d2 = to_d(x2, sigma_mid, denoise(x2, sigma_mid))
      x = x + d2 * (down - s[i])
      x = x + noise(x.shape) * (s_noise * up)
    end
  end
  return x
end
sample.add_sampler("dpm_2_ancestral", samplers.dpm_2_ancestral, "DPM2 a", true)

-- Integral over [a, b] of the Lagrange basis polynomial j of the nodes t[i-k]
-- (k-diffusion's linear_multistep_coeff). The integrand is a polynomial of degree
-- < 4, so 5-point Gauss-Legendre is exact.
local GL_X = { 0, -0.5384693101056831, 0.5384693101056831, -0.9061798459386640, 0.9061798459386640 }
local GL_W = { 0.5688888888888889, 0.4786286704993665, 0.4786286704993665, 0.2369268850561891, 0.2369268850561891 }
local function lms_coeff(order, t, i, j)
  local function fn(tau)
    local prod = 1
    for k = 0, order - 1 do
      if k ~= j then prod = prod * (tau - t[i - k]) / (t[i - j] - t[i - k]) end
    end
    return prod
  end
  local a, b = t[i], t[i + 1]
  local half, mid, acc = (b - a) / 2, (a + b) / 2, 0
  for q = 1, 5 do acc = acc + GL_W[q] * fn(mid + half * GL_X[q]) end
  return acc * half
end

function samplers.lms(denoise, x, s, opts, noise, step)
  local n, order = #s - 1, opts.order or 4
  local ds = {}
  for i = 1, n do
    local denoised = denoise(x, s[i])
    step(i, s[i], x, denoised)
    table.insert(ds, to_d(x, s[i], denoised))
    if #ds > order then table.remove(ds, 1) end
    local cur = math.min(i, order)
    for j = 0, cur - 1 do
      x = x + ds[#ds - j] * lms_coeff(cur, s, i, j)
    end
  end
  return x
end
sample.add_sampler("lms", samplers.lms, "LMS", false)

local function t_fn(sigma) return -math.log(sigma) end
local function sigma_fn(t) return math.exp(-t) end

function samplers.dpmpp_2s_ancestral(denoise, x, s, opts, noise, step)
  local n, eta, s_noise = #s - 1, opts.eta or 1, opts.s_noise or 1
  for i = 1, n do
    local denoised = denoise(x, s[i])
    step(i, s[i], x, denoised)
    local down, up = ancestral_step(s[i], s[i + 1], eta)
    if down == 0 then
      x = x + to_d(x, s[i], denoised) * (down - s[i])
    else
      local t, t_next = t_fn(s[i]), t_fn(down)
      local h = t_next - t
      local sm = t + h / 2
      local x2 = x * (sigma_fn(sm) / sigma_fn(t)) - denoised * expm1(-h / 2)
      local denoised2 = denoise(x2, sigma_fn(sm))
      x = x * (sigma_fn(t_next) / sigma_fn(t)) - denoised2 * expm1(-h)
    end
    if s[i + 1] > 0 then x = x + noise(x.shape) * (s_noise * up) end
  end
  return x
end
sample.add_sampler("dpmpp_2s_ancestral", samplers.dpmpp_2s_ancestral, "DPM++ 2S a", true)

function samplers.dpmpp_2m(denoise, x, s, opts, noise, step)
  local n = #s - 1
  local old
  for i = 1, n do
    local denoised = denoise(x, s[i])
    step(i, s[i], x, denoised)
    local t, t_next = t_fn(s[i]), (s[i + 1] > 0 and t_fn(s[i + 1]) or math.huge)
    local h = t_next - t
    local ratio = s[i + 1] / s[i]
    if old == nil or s[i + 1] == 0 then
      x = x * ratio - denoised * expm1(-h)
    else
      local h_last = t - t_fn(s[i - 1])
      local r = h_last / h
      local dd = denoised * (1 + 1 / (2 * r)) - old * (1 / (2 * r))
      x = x * ratio - dd * expm1(-h)
    end
    old = denoised
  end
  return x
end
sample.add_sampler("dpmpp_2m", samplers.dpmpp_2m, "DPM++ 2M", false)

-- DPM-Solver++(2S) SDE step pair. k-diffusion draws the noise from a Brownian
-- tree; kiln draws it from opts.noise (seeded, independent per call), which keeps
-- each increment standard normal but not correlated across the two half steps.
function samplers.dpmpp_sde(denoise, x, s, opts, noise, step)
  local n, eta, s_noise, r = #s - 1, opts.eta or 1, opts.s_noise or 1, opts.r or 0.5
  for i = 1, n do
    local denoised = denoise(x, s[i])
    step(i, s[i], x, denoised)
    if s[i + 1] == 0 then
      x = x + to_d(x, s[i], denoised) * (s[i + 1] - s[i])
    else
      local t, t_next = t_fn(s[i]), t_fn(s[i + 1])
      local h = t_next - t
      local sm = t + h * r
      local fac = 1 / (2 * r)
      local sd, su = ancestral_step(sigma_fn(t), sigma_fn(sm), eta)
      local s_ = t_fn(sd)
      local x2 = x * (sigma_fn(s_) / sigma_fn(t)) - denoised * expm1(t - s_)
      x2 = x2 + noise(x.shape) * (s_noise * su)
      local denoised2 = denoise(x2, sigma_fn(sm))
      sd, su = ancestral_step(sigma_fn(t), sigma_fn(t_next), eta)
      local tn_ = t_fn(sd)
      local dd = denoised * (1 - fac) + denoised2 * fac
      x = x * (sigma_fn(tn_) / sigma_fn(t)) - dd * expm1(t - tn_)
      x = x + noise(x.shape) * (s_noise * su)
    end
  end
  return x
end
sample.add_sampler("dpmpp_sde", samplers.dpmpp_sde, "DPM++ SDE", true)

-- ComfyUI's "ddim" is Euler in sigma space (identical to DDIM with eta = 0).
sample.add_sampler("ddim", samplers.euler, "DDIM", false)

-- Latent consistency models: jump to the prediction, re-noise to the next sigma.
function samplers.lcm(denoise, x, s, opts, noise, step)
  local n = #s - 1
  for i = 1, n do
    local denoised = denoise(x, s[i])
    step(i, s[i], x, denoised)
    x = denoised
    if s[i + 1] > 0 then x = x + noise(x.shape) * s[i + 1] end
  end
  return x
end
sample.add_sampler("lcm", samplers.lcm, "LCM", true)

sample.samplers = samplers

local function sorted(t)
  local r = {}
  for i = 1, #t do r[i] = t[i] end
  table.sort(r)
  return r
end

--- The sampler names, sorted.
function sample.names() return sorted(sampler_order) end

--- The registry entry of a sampler: {name, fn, label, noise}, or nil.
function sample.sampler_info(name)
  local e = sampler_info[name]
  return e and { name = e.name, fn = e.fn, label = e.label, noise = e.noise }
end

--- Runs sampler `name` (k-diffusion / ComfyUI names) from x over sigmas.
function sample.run(name, denoise, x, sigmas, opts)
  opts = opts or {}
  local fn = sampler_info[name] and sampler_info[name].fn
  if not fn then
    error(("unknown sampler '%s' (known: %s)"):format(tostring(name), table.concat(sample.names(), ", ")), 2)
  end
  if type(denoise) ~= "function" then error("sample.run: denoise must be a function(x, sigma)", 2) end
  local s = list_of(sigmas)
  if #s < 2 then error("sample.run: need at least 2 sigmas (steps + 1, ending in 0)", 2) end
  local noise = opts.noise or default_noise(opts)
  return fn(denoise, x, s, opts, noise, stepper(opts, #s - 1))
end

---------------------------------------------------------------------------
-- schedules
---------------------------------------------------------------------------

-- Stable Diffusion's discrete schedule: scaled-linear betas 0.00085..0.012 over
-- 1000 steps; sigmas[t+1] = sqrt((1 - abar_t) / abar_t), computed in double and
-- rounded to f32 as PyTorch front ends store them.
--
-- opts.zsnr rescales it to zero terminal SNR (Lin et al. 2024, "Common Diffusion
-- Noise Schedules and Sample Steps are Flawed", Algorithm 1: sqrt(abar) shifted
-- and scaled so that abar_0 is kept and abar_T = 0), for v-prediction models
-- trained that way (the bundled demo model; ComfyUI's ModelSamplingDiscrete
-- zsnr). abar_T = 0 would make sigma_max infinite, so it is replaced by
-- 4.8973451890853435e-08 (sigma_max ~ 4519), the value ComfyUI uses.
local function f32(v) return string.unpack("f", string.pack("f", v)) end

local ZSNR_LAST = 4.8973451890853435e-08

function sample.discrete_schedule(opts)
  opts = opts or {}
  local n = opts.timesteps or 1000
  local b0, b1 = math.sqrt(opts.linear_start or 0.00085), math.sqrt(opts.linear_end or 0.012)
  local abars, abar = {}, 1
  for t = 0, n - 1 do
    local beta = (b0 + (b1 - b0) * t / (n - 1)) ^ 2
    abar = abar * (1 - beta)
    abars[t + 1] = abar
  end
  if opts.zsnr then
    local s0, sT = math.sqrt(abars[1]), math.sqrt(abars[n])
    for i = 1, n do abars[i] = ((math.sqrt(abars[i]) - sT) * s0 / (s0 - sT)) ^ 2 end
    abars[n] = ZSNR_LAST
  end
  local sig, log_sig = {}, {}
  for i = 1, n do
    sig[i] = f32(math.sqrt((1 - abars[i]) / abars[i]))
    log_sig[i] = math.log(sig[i])
  end
  local ms = { sigmas = sig, log_sigmas = log_sig, sigma_min = sig[1], sigma_max = sig[n],
    prediction = opts.prediction or "eps", zsnr = opts.zsnr and true or false }
  -- nearest discrete timestep of sigma (ComfyUI's ModelSamplingDiscrete.timestep)
  function ms.timestep(sigma)
    local ls, best, bi = math.log(sigma), math.huge, 0
    for i = 1, n do
      local d = math.abs(ls - log_sig[i])
      if d < best then best, bi = d, i - 1 end
    end
    return bi
  end
  -- sigma at a (fractional) timestep, interpolating log sigma
  function ms.sigma(t)
    t = math.max(0, math.min(n - 1, t))
    local lo, hi = math.floor(t), math.ceil(t)
    local w = t - lo
    return math.exp((1 - w) * log_sig[lo + 1] + w * log_sig[hi + 1])
  end
  return ms
end

local function with_zero(list)
  list[#list + 1] = 0
  return kiln.tensor(list)
end

-- name -> function(steps, opts); and name -> registry entry
local schedules, schedule_info, schedule_order, add_scheduler = registry("scheduler", "needs_model")

--- Adds a scheduler to the registry: name (ComfyUI's), fn(steps, opts) -> sigmas,
-- the A1111 label ("Schedule type"), and whether it reads the model's discrete
-- schedule (opts.model_sampling) rather than sigma_min / sigma_max alone.
function sample.add_scheduler(name, fn, label, needs_model) add_scheduler(name, fn, label, needs_model) end

function schedules.karras(steps, o)
  local rho = o.rho or 7
  local min_inv, max_inv = o.sigma_min ^ (1 / rho), o.sigma_max ^ (1 / rho)
  local out = {}
  for i = 0, steps - 1 do
    local ramp = steps > 1 and i / (steps - 1) or 0
    out[#out + 1] = (max_inv + ramp * (min_inv - max_inv)) ^ rho
  end
  return with_zero(out)
end
sample.add_scheduler("karras", schedules.karras, "Karras", false)

function schedules.exponential(steps, o)
  local a, b = math.log(o.sigma_max), math.log(o.sigma_min)
  local out = {}
  for i = 0, steps - 1 do
    local r = steps > 1 and i / (steps - 1) or 0
    out[#out + 1] = math.exp(a + (b - a) * r)
  end
  return with_zero(out)
end
sample.add_scheduler("exponential", schedules.exponential, "Exponential", false)

local function need_model(o, name)
  local ms = o.model_sampling
  if not ms then error(("schedule '%s' needs opts.model_sampling (kiln.sample.discrete_schedule())"):format(name), 3) end
  return ms
end

local function normal_like(steps, o, sgm)
  local ms = need_model(o, sgm and "sgm_uniform" or "normal")
  local start, stop = ms.timestep(o.sigma_max or ms.sigma_max), ms.timestep(o.sigma_min or ms.sigma_min)
  local n = sgm and steps + 1 or steps
  local out = {}
  for i = 0, steps - 1 do
    local t = n > 1 and start + (stop - start) * i / (n - 1) or start
    out[#out + 1] = ms.sigma(t)
  end
  return with_zero(out)
end

function schedules.normal(steps, o) return normal_like(steps, o, false) end
sample.add_scheduler("normal", schedules.normal, "Normal", true)
function schedules.sgm_uniform(steps, o) return normal_like(steps, o, true) end
sample.add_scheduler("sgm_uniform", schedules.sgm_uniform, "SGM Uniform", true)

function schedules.simple(steps, o)
  local s = need_model(o, "simple").sigmas
  local ss = #s / steps
  local out = {}
  for x = 0, steps - 1 do out[#out + 1] = s[#s - math.floor(x * ss)] end
  return with_zero(out)
end
sample.add_scheduler("simple", schedules.simple, "Simple", true)

function schedules.ddim_uniform(steps, o)
  local s = need_model(o, "ddim_uniform").sigmas
  local ss = math.max(#s // steps, 1)
  local out, x = {}, 1
  while x < #s do
    table.insert(out, 1, s[x + 1])
    x = x + ss
  end
  return with_zero(out)
end
sample.add_scheduler("ddim_uniform", schedules.ddim_uniform, "DDIM", true)

sample.schedules = schedules

-- The beta distribution's quantile function for the "beta" schedule: the regularized
-- incomplete beta function I_x(a, b) by its continued fraction (modified Lentz), log
-- Gamma by Lanczos' approximation (g = 7, 9 terms), and the inverse by bisection to
-- double precision (60 halvings of [0, 1]).
local LANCZOS = { 0.99999999999980993, 676.5203681218851, -1259.1392167224028, 771.32342877765313,
  -176.61502916214059, 12.507343278686905, -0.13857109526572012, 9.9843695780195716e-6,
  1.5056327351493116e-7 }

local function lgamma(x)
  if x < 0.5 then return math.log(math.pi / math.abs(math.sin(math.pi * x))) - lgamma(1 - x) end
  x = x - 1
  local a, t = LANCZOS[1], x + 7.5
  for i = 2, 9 do a = a + LANCZOS[i] / (x + i - 1) end
  return 0.5 * math.log(2 * math.pi) + (x + 0.5) * math.log(t) - t + math.log(a)
end

local function beta_cf(a, b, x)
  local tiny = 1e-300
  local qab, qap, qam = a + b, a + 1, a - 1
  local c, d = 1, 1 - qab * x / qap
  if math.abs(d) < tiny then d = tiny end
  d = 1 / d
  local h = d
  for m = 1, 300 do
    local m2 = 2 * m
    local aa = m * (b - m) * x / ((qam + m2) * (a + m2))
    d = 1 + aa * d; if math.abs(d) < tiny then d = tiny end
    c = 1 + aa / c; if math.abs(c) < tiny then c = tiny end
    d = 1 / d
    h = h * d * c
    aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
    d = 1 + aa * d; if math.abs(d) < tiny then d = tiny end
    c = 1 + aa / c; if math.abs(c) < tiny then c = tiny end
    d = 1 / d
    local del = d * c
    h = h * del
    if math.abs(del - 1) < 1e-16 then break end
  end
  return h
end

local function beta_cdf(x, a, b)
  if x <= 0 then return 0 end
  if x >= 1 then return 1 end
  local lbt = lgamma(a + b) - lgamma(a) - lgamma(b) + a * math.log(x) + b * math.log(1 - x)
  if x < (a + 1) / (a + b + 2) then return math.exp(lbt) * beta_cf(a, b, x) / a end
  return 1 - math.exp(lbt) * beta_cf(b, a, 1 - x) / b
end

local function beta_ppf(q, a, b)
  if q <= 0 then return 0 end
  if q >= 1 then return 1 end
  local lo, hi = 0, 1
  for _ = 1, 60 do
    local mid = 0.5 * (lo + hi)
    if beta_cdf(mid, a, b) < q then lo = mid else hi = mid end
  end
  return 0.5 * (lo + hi)
end
sample.beta_ppf = beta_ppf

-- numpy.rint: to the nearest integer, halves to even
local function rint(x)
  local f = math.floor(x)
  local d = x - f
  if d > 0.5 or (d == 0.5 and f % 2 == 1) then f = f + 1 end
  return f
end

-- ComfyUI's "beta" schedule (after Lee et al. 2024, arXiv:2407.12173): the model's
-- discrete sigmas at the timesteps rint(ppf_Beta(alpha, beta)(1 - i/steps) * 999),
-- i = 0 .. steps-1, repeated timesteps dropped; alpha = beta = 0.6 unless opts say.
function schedules.beta(steps, o)
  local s = need_model(o, "beta").sigmas
  local a, b = o.alpha or 0.6, o.beta or 0.6
  local total = #s - 1
  local out, last = {}, -1
  for i = 0, steps - 1 do
    local t = rint(beta_ppf(1 - i / steps, a, b) * total)
    if t ~= last then out[#out + 1] = s[t + 1] end
    last = t
  end
  return with_zero(out)
end
sample.add_scheduler("beta", schedules.beta, "Beta", true)

--- The scheduler names, sorted.
function sample.scheduler_names() return sorted(schedule_order) end

--- The registry entry of a scheduler: {name, fn, label, needs_model}, or nil.
function sample.scheduler_info(name)
  local e = schedule_info[name]
  return e and { name = e.name, fn = e.fn, label = e.label, needs_model = e.needs_model }
end

--- sigmas(name, steps, opts) -> 1-D f32 tensor of steps + 1 values ending in 0.
-- karras / exponential take sigma_min, sigma_max (and rho); the schedulers that
-- need the model take opts.model_sampling (defaults: SD's schedule).
function sample.sigmas(name, steps, opts)
  opts = opts or {}
  local info = schedule_info[name]
  if not info then
    error(("unknown schedule '%s' (known: %s)"):format(tostring(name),
      table.concat(sample.scheduler_names(), ", ")), 2)
  end
  local fn = info.fn
  if math.type(steps) ~= "integer" or steps < 1 then error("sample.sigmas: steps must be a positive integer", 2) end
  if not info.needs_model and not (opts.sigma_min and opts.sigma_max) then
    local ms = opts.model_sampling or sample.discrete_schedule()
    opts = setmetatable({ sigma_min = opts.sigma_min or ms.sigma_min, sigma_max = opts.sigma_max or ms.sigma_max },
      { __index = opts })
  end
  if info.needs_model and not opts.model_sampling then
    opts = setmetatable({ model_sampling = sample.discrete_schedule() }, { __index = opts })
  end
  return fn(steps, opts)
end

return sample
