-- Samplers and schedules against an independent NumPy implementation of the
-- k-diffusion algorithms (tests/golden/gen_samplers.py) on a toy denoiser with
-- injected noise.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local sample = kiln.sample

local G = kiln.load_safetensors("tests/golden/samplers.safetensors")

-- the toy denoiser of the generator: 0.8 x / (1 + s^2) + 0.1 tanh(x) s / (1 + s)
local function denoise(x, s)
  return x * (0.8 / (1 + s * s)) + x:tanh() * (0.1 * s / (1 + s))
end

local function injected()
  local k = 0
  return function(shape)
    k = k + 1
    return G.noise:select(1, k):reshape(shape):contiguous()
  end
end

local function maxdiff(a, b) return (a - b):abs():max() end

-- Every sampler of the registry: against its golden output, or, when it shares
-- another's function (ComfyUI's ddim is euler), against that one's.
for _, name in ipairs(sample.names()) do
  local info = sample.sampler_info(name)
  local same
  for _, other in ipairs(sample.names()) do
    if other ~= name and G["out_" .. other] and sample.sampler_info(other).fn == info.fn then same = other end
  end
  if G["out_" .. name] then
    H.test("sampler " .. name .. " matches k-diffusion (NumPy)", function()
      local x = sample.run(name, denoise, G.x0, G.sched_karras, { noise = injected() })
      local d = maxdiff(x, G["out_" .. name])
      if d > 1e-5 then error(("max difference %g > 1e-5"):format(d)) end
    end)
  elseif same then
    H.test(("sampler %s is %s (ComfyUI)"):format(name, same), function()
      local a = sample.run(name, denoise, G.x0, G.sched_karras)
      H.eq(maxdiff(a, sample.run(same, denoise, G.x0, G.sched_karras)), 0)
    end)
  else
    H.test("sampler " .. name .. " matches k-diffusion (NumPy)", function()
      error("no golden output: add it to tests/golden/gen_samplers.py and regenerate", 0)
    end)
  end
  H.test(("sampler %s: registry entry (A1111 label, draws noise = %s)"):format(name, tostring(info.noise)), function()
    H.truthy(info.label ~= "" and info.label ~= name, "an A1111 label such as \"DPM++ 2M\"")
    local draws = 0
    sample.run(name, denoise, G.x0, G.sched_karras, { noise = function(shape)
      draws = draws + 1
      return kiln.zeros(shape)
    end })
    H.eq(draws > 0, info.noise, "draws noise")
  end)
end

local ms = sample.discrete_schedule()
local cases = {
  { "karras", { sigma_min = ms.sigma_min, sigma_max = ms.sigma_max }, 10 },
  { "exponential", { sigma_min = ms.sigma_min, sigma_max = ms.sigma_max }, 10 },
  { "normal", {}, 10 }, { "sgm_uniform", {}, 10 }, { "simple", {}, 10 }, { "ddim_uniform", {}, 10 },
  { "beta", {}, 10 }, { "beta", {}, 40, "beta_40" }, { "beta", { alpha = 0.5, beta = 0.7 }, 25, "beta_custom" },
  { "trailing", {}, 4 }, { "trailing", {}, 6, "trailing_6" }, { "trailing", {}, 16, "trailing_16" },
}
H.test("every scheduler of the registry is checked here", function()
  local listed = {}
  for _, c in ipairs(cases) do listed[c[1]] = true end
  for _, name in ipairs(sample.scheduler_names()) do
    H.truthy(listed[name], "no golden case for scheduler " .. name)
    local info = sample.scheduler_info(name)
    H.truthy(info.label ~= "" and info.label ~= name, name .. ": an A1111 label such as \"Karras\"")
  end
end)

for _, c in ipairs(cases) do
  H.test("schedule " .. (c[4] or c[1]) .. " matches ComfyUI (NumPy, SciPy)", function()
    local s = sample.sigmas(c[1], c[3], c[2])
    local want = G["sched_" .. (c[4] or c[1])]
    H.eq(s:numel(), want:numel(), "length")
    local d = ((s - want):abs() / (want:abs() + 1e-3)):max()
    if d > 2e-5 then error(("max relative difference %g"):format(d)) end
    H.eq(s:table()[s:numel()], 0, "ends in 0")
  end)
end

-- TCD against its authors' sample_tcd (NumPy port in the generator): gamma 0.3 (the
-- default), 0 (deterministic) and 0.7, and a 4-step sgm_uniform schedule as it is used.
for _, c in ipairs({ { "out_tcd", nil, "sched_karras" }, { "out_tcd_g0", 0, "sched_karras" },
  { "out_tcd_g7", 0.7, "sched_karras" }, { "out_tcd_sgm4", 0.3, "sched_sgm4" } }) do
  H.test(("sampler tcd (gamma %s, %s) matches TCD's within 1e-6 (relative)"):format(tostring(c[2] or 0.3), c[3]), function()
    local sig = c[3] == "sched_sgm4" and sample.sigmas("sgm_uniform", 4, { model_sampling = ms }) or G[c[3]]
    local x = sample.run("tcd", denoise, G.x0, sig, { noise = injected(), gamma = c[2] })
    -- 1e-6 of the output's scale: its early steps divide by sqrt(alphas_cumprod) ~ 0.07,
    -- where one f32 rounding of an intermediate is already ~1e-6 of the final values
    local want = G[c[1]]
    local d = maxdiff(x, want) / math.max(1, want:abs():max())
    if d > 1e-6 then error(("max difference %g > 1e-6 (relative to the largest value)"):format(d)) end
  end)
end
H.test("tcd takes gamma from opts.eta (the ComfyUI node's name), gamma first", function()
  local a = sample.run("tcd", denoise, G.x0, G.sched_karras, { noise = injected(), eta = 0.7 })
  H.truthy(maxdiff(a, G.out_tcd_g7) < 2e-6)
  local b = sample.run("tcd", denoise, G.x0, G.sched_karras, { noise = injected(), eta = 0.7, gamma = 0 })
  H.truthy(maxdiff(b, G.out_tcd_g0) < 1e-6)
end)

H.test("zero-terminal-SNR schedule matches Lin et al. (NumPy)", function()
  local z = sample.discrete_schedule({ zsnr = true })
  local want = G.zsnr_sigmas:table()
  H.eq(#z.sigmas, #want, "length")
  local d = 0
  for i = 1, #want do d = math.max(d, math.abs(z.sigmas[i] - want[i]) / (want[i] + 1e-3)) end
  if d > 2e-6 then error(("max relative difference %g"):format(d)) end
  H.near(z.sigma_min, ms.sigma_min, 1e-9, "abar_0 is kept")
  H.truthy(z.sigma_max > 4000, "sigma_max is (nearly) infinite")
  H.truthy(z.zsnr and not ms.zsnr)
end)

H.test("karras with explicit rho", function()
  local s = sample.sigmas("karras", 7, { sigma_min = 0.1, sigma_max = 10, rho = 5 })
  H.truthy(maxdiff(s, G.sched_karras_custom) < 1e-5)
end)

H.test("SD discrete schedule endpoints", function()
  H.near(ms.sigma_min, 0.0292, 1e-4)
  H.near(ms.sigma_max, 14.6146, 1e-3)
  H.eq(ms.timestep(ms.sigma_max), 999)
  H.eq(ms.timestep(ms.sigma_min), 0)
  H.near(ms.sigma(999), ms.sigma_max, 1e-4)
end)

-- The Brownian noise of the SDE samplers against ComfyUI's: the generator ports
-- torchsde's BrownianTree over numpy's SeedSequence and torch's seeded randn.
H.test("seed_sequence matches numpy.random.SeedSequence", function()
  local want = {  -- numpy: SeedSequence(entropy, spawn_key, pool_size).generate_state(n)
    { 0, {}, 24, { 4025752534, 2687548107, 2326983537, 1576567101 } },
    { 12345, { 0, 0 }, 24, { 3924261748, 2174456085, 2149736121, 3248841855 } },
    { 2 ^ 40 // 1 | 7, { 5, 3 }, 24, { 274823170, 1995610858, 3082670851 } },
    { 99, { 1, 1 }, 8, { 4154551953, 1846650754 } },
  }
  for _, c in ipairs(want) do
    local got = sample.seed_sequence(c[1], c[2], c[3], #c[4])
    for i = 1, #c[4] do H.eq(got[i], c[4][i], ("entropy %d word %d"):format(c[1], i)) end
  end
end)

H.test("Brownian noise is ComfyUI's (torchsde BrownianTree port), bit for bit", function()
  local noise = sample.brownian_noise(G.x0.shape, G.sched_karras, 42)
  for k, p in ipairs(G.bt_pairs:table()) do
    local d = maxdiff(noise(G.x0.shape, p[1], p[2]), G.bt_noise:select(1, k))
    if d ~= 0 then error(("pair %d (%g, %g): max difference %g"):format(k, p[1], p[2], d)) end
  end
end)

H.test("dpmpp_2m_sde with seed 42 draws ComfyUI's Brownian noise", function()
  local x = sample.run("dpmpp_2m_sde", denoise, G.x0, G.sched_karras, { seed = 42 })
  local d = maxdiff(x, G.out_dpmpp_2m_sde_bt)
  if d > 1e-5 then error(("max difference %g > 1e-5"):format(d)) end
end)

H.test("Brownian tree: a Brownian motion, the same for a seed in any query order", function()
  local shape = { 4096 }
  local inc = sample.brownian_tree(shape, 0.03, 14.6, 7)
  local cuts = { 0.03, 0.2, 0.9, 3.1, 7.5, 14.6 }
  local parts = {}
  for i = 1, #cuts - 1 do
    parts[i] = inc(cuts[i], cuts[i + 1])
    local var = (parts[i] * parts[i]):mean()
    local dt = cuts[i + 1] - cuts[i]
    -- 4096 draws: the sample variance is within 4 standard errors (sqrt(2/n))
    H.truthy(math.abs(var / dt - 1) < 4 * math.sqrt(2 / 4096), ("variance %g over dt %g"):format(var, dt))
  end
  for i = 1, #parts - 1 do       -- disjoint intervals: uncorrelated
    local a, b = parts[i], parts[i + 1]
    local corr = (a * b):mean() / math.sqrt((a * a):mean() * (b * b):mean())
    H.truthy(math.abs(corr) < 4 / math.sqrt(4096), ("correlation %g of neighbours %d, %d"):format(corr, i, i + 1))
  end
  local sum = parts[1]
  for i = 2, #parts do sum = sum + parts[i] end
  H.truthy(maxdiff(sum, inc(cuts[1], cuts[#cuts])) < 1e-4, "increments add up")
  local again = sample.brownian_tree(shape, 0.03, 14.6, 7)   -- other order, fresh tree
  for i = #cuts - 1, 1, -1 do H.eq(maxdiff(again(cuts[i], cuts[i + 1]), parts[i]), 0, "same path") end
  H.truthy(maxdiff(sample.brownian_tree(shape, 0.03, 14.6, 8)(0.2, 0.9), parts[2]) > 0.1, "another seed, another path")
end)

H.test("the SDE samplers' noise follows opts.seed, and opts.noise replaces it", function()
  for _, name in ipairs({ "dpmpp_sde", "dpmpp_2m_sde", "dpmpp_3m_sde" }) do
    local a = sample.run(name, denoise, G.x0, G.sched_karras, { seed = 3 })
    H.eq(maxdiff(a, sample.run(name, denoise, G.x0, G.sched_karras, { seed = 3 })), 0, name .. " same seed")
    H.truthy(maxdiff(a, sample.run(name, denoise, G.x0, G.sched_karras, { seed = 4 })) > 0, name .. " other seed")
  end
end)

H.test("same seed gives bit-identical results", function()
  local a = sample.run("euler_ancestral", denoise, G.x0, G.sched_karras, { seed = 5 })
  local b = sample.run("euler_ancestral", denoise, G.x0, G.sched_karras, { seed = 5 })
  H.eq(maxdiff(a, b), 0)
  local c = sample.run("euler_ancestral", denoise, G.x0, G.sched_karras, { seed = 6 })
  H.truthy(maxdiff(a, c) > 0)
end)

H.test("callback sees every step and can cancel", function()
  local seen = 0
  sample.run("euler", denoise, G.x0, G.sched_karras, { callback = function(s) seen = s.i end })
  H.eq(seen, 10)
  local ok, err = pcall(sample.run, "euler", denoise, G.x0, G.sched_karras,
    { callback = function(s) return s.i < 3 end })
  H.truthy(not ok and type(err) == "table" and err.kind == "cancelled")
end)

H.test("bad input", function()
  H.raises(function() sample.run("nope", denoise, G.x0, G.sched_karras) end, "unknown sampler 'nope'", "euler")
  H.raises(function() sample.sigmas("nope", 10) end, "unknown schedule", "karras")
  H.raises(function() sample.sigmas("karras", 0) end, "steps")
end)

H.done()
