-- kiln.few_step: the sampler and schedule that few-step models need beyond k-diffusion's
-- (kiln.sample keeps those): TCD's sampler with its gamma, and the "trailing" schedule
-- that SDXL-Lightning and Hyper-SD are sampled with. kiln.sample registers them at load
-- (M.register); "lcm" and "sgm_uniform" live in kiln.sample with the others.
local kiln = require "kiln"

local M = {}

-- f32 rounding, as the published code's tensors hold these numbers
local function f32(v) return string.unpack("f", string.pack("f", v)) end

-- numpy's round (half to even), which diffusers' timestep spacing uses
local function round_even(v)
  local f = math.floor(v)
  local d = v - f
  if d > 0.5 or (d == 0.5 and f % 2 == 1) then return f + 1 end
  return f
end

--- TCD (Zheng et al. 2024, "Trajectory Consistency Distillation"), as its authors'
-- ComfyUI node (ComfyUI-TCD's sample_tcd) computes it: each step predicts x0, moves
-- to the earlier timestep s = floor((1 - gamma) t) of the next sigma (0 at the end),
-- and adds noise back up to that sigma; gamma = 0 is deterministic. Timesteps are the
-- model's (opts.model_sampling, else SD's discrete schedule), alphas_cumprod rebuilt
-- from its linear betas as the node does (a zero-SNR rescale is not applied there). gamma is
-- opts.gamma, else opts.eta (the node's name for it), else 0.3.
-- alphas_cumprod as TCD's node builds them: the linear betas in double, their
-- complements rounded to f32 and multiplied in f32 one after another (torch.cumprod
-- with dtype float32)
local function alphas_cumprod(n, lo, hi)
  local b0, b1 = math.sqrt(lo), math.sqrt(hi)
  local r, ac = 1, {}
  for t = 0, n - 1 do
    local beta = (b0 + (b1 - b0) * t / (n - 1)) ^ 2
    r = f32(r * f32(1 - beta))
    ac[t + 1] = r
  end
  return ac
end

function M.tcd(denoise, x, s, opts, noise, step, sample)
  local ms = opts.model_sampling or sample.discrete_schedule()
  local gamma = opts.gamma or opts.eta or 0.3
  local n = #s - 1
  local ac = alphas_cumprod(#ms.sigmas, ms.linear_start or 0.00085, ms.linear_end or 0.012)
  local a = {}
  for i = 1, n + 1 do
    local t = i == n + 1 and 0 or math.floor((1 - gamma) * ms.timestep(s[i]))
    a[i] = ac[t + 1]
  end
  for i = 1, n do
    local den = denoise(x, s[i])
    local d = x - den
    local eps = d * (1 / s[i])
    d:free()
    local p1, p2 = den * math.sqrt(a[i + 1]), eps * math.sqrt(1 - a[i + 1])
    local x0 = p1 + p2
    p1:free(); p2:free(); eps:free(); den:free()
    step(i, s[i], x, x0)
    if gamma > 0 and s[i + 1] > 0 then
      local z = noise(x0.shape)
      local u = x0 * (1 / math.sqrt(a[i + 1]))
      local zn = z * math.sqrt(math.max(0, s[i + 1] * s[i + 1] + 1 - 1 / a[i + 1]))
      x = u + zn
      u:free(); zn:free()
    else
      x = x0 * math.sqrt(s[i + 1] * s[i + 1] + 1)
    end
    x0:free()
  end
  return x
end

--- diffusers' "trailing" timestep spacing (EulerDiscreteScheduler, timestep_spacing =
-- "trailing"): timesteps round(T - i T/steps) - 1 for i = 0 .. steps - 1, the sigmas of
-- the model's discrete schedule at them, then 0.
function M.trailing(steps, o, need_model)
  local ms = need_model(o, "trailing")
  local T = #ms.sigmas
  local out = {}
  for i = 0, steps - 1 do
    local t = math.max(0, round_even(T - i * T / steps) - 1)
    out[#out + 1] = ms.sigmas[t + 1]
  end
  out[#out + 1] = 0
  return kiln.tensor(out, { device = "cpu" })
end

--- Adds the sampler and the schedule to kiln.sample's registries (sample: the module).
function M.register(sample, need_model)
  sample.add_sampler("tcd", function(denoise, x, s, opts, noise, step)
    return M.tcd(denoise, x, s, opts, noise, step, sample)
  end, "TCD", true)
  sample.add_scheduler("trailing", function(steps, o) return M.trailing(steps, o, need_model) end, "Trailing", true)
end

return M
