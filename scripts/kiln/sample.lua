-- kiln.sample: samplers and noise schedules with the arithmetic of k-diffusion
-- (Katherine Crowson's k-diffusion, sampling.py) and the names ComfyUI uses, plus
-- the discrete noise schedule of Stable Diffusion (sigma <-> timestep).
--
-- A sampler is run(denoise, x, sigmas, opts): denoise(x, sigma) returns the
-- denoised prediction for tensor x at the Lua number sigma; sigmas is a 1-D tensor
-- (or a Lua list) ending in 0. Ancestral and SDE samplers draw noise from
-- opts.noise(shape, sigma, sigma_next) (the sigmas it bridges; ancestral
-- samplers pass none): by default kiln.randn with a seeded counter, and for the
-- SDE samplers the increments of a Brownian tree seeded by opts.seed. Every step
-- calls opts.callback({i=, n=, sigma=, x=, denoised=}) when given; returning
-- false from it (or kiln.cancel) stops at the step boundary.
--
-- This file is the one registry of samplers and schedulers: each is added once,
-- below its function, with the label A1111 writes in a PNG's "parameters" text
-- (and, for samplers, whether it draws noise). The pipelines, the CLI's help, the
-- PNG parameters, the editor definitions (bindings/kiln.meta.lua, checked by
-- tests/lua/test_meta.lua) and the tests all read it.
local kiln = require "kiln"

local M = {}

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
M.ancestral_step = ancestral_step

-- a double rounded to f32 (as PyTorch front ends store sigmas)
local function f32(v) return string.unpack("f", string.pack("f", v)) end

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

-- The Brownian noise of the SDE samplers, as ComfyUI draws it: k-diffusion's
-- BrownianTreeNoiseSampler over torchsde's BrownianTree (a BrownianInterval with
-- halfway_tree = true, tol = 1e-6, pool_size = 24, no Levy area), rebuilt here
-- step for step so that a seed gives the same draws:
-- - times are rounded to 6 decimals (Python's round(t, 6));
-- - the root [t0, t1] holds W ~ sqrt(t1 - t0) N(0, 1); a node splits at its
--   rounded halfway point, and its left child's increment is the Brownian bridge
--   l/h W + sqrt(l r / h) N(0, 1), the right child's W minus that;
-- - every normal draw is torch.manual_seed(s); torch.randn(shape) (kiln.randn),
--   s the first word of numpy's SeedSequence(entropy = seed, spawn_key = (path
--   bits, depth), pool_size = 24) for a node (no spawn key for the root);
-- - the increment over [ta, tb] is the sum, left to right, of the nodes that
--   tile it.

-- numpy.random.SeedSequence(entropy, spawn_key, pool_size).generate_state(n),
-- uint32 words (numpy's bit_generator.pyx: hashmix, mix and the output hash).
local M32 = 0xFFFFFFFF
local function u32_words(v, out)          -- a non-negative integer, low word first
  out[#out + 1] = v & M32
  v = v >> 32
  while v ~= 0 do
    out[#out + 1] = v & M32
    v = v >> 32
  end
  return out
end

function M.seed_sequence(entropy, spawn_key, pool_size, n)
  local ent = u32_words(entropy, {})
  local spawn = {}
  for _, k in ipairs(spawn_key or {}) do u32_words(k, spawn) end
  if #spawn > 0 then for i = #ent + 1, pool_size do ent[i] = 0 end end
  for _, w in ipairs(spawn) do ent[#ent + 1] = w end
  local hc = 0x43b0d7e5
  local function hashmix(v)
    v = v ~ hc
    hc = (hc * 0x931e8875) & M32
    v = (v * hc) & M32
    return v ~ (v >> 16)
  end
  local function mix(x, y)
    local r = (0xca01f9dd * x - 0x4973f715 * y) & M32
    return r ~ (r >> 16)
  end
  local pool = {}
  for i = 1, pool_size do pool[i] = hashmix(ent[i] or 0) end
  for s = 1, pool_size do
    for d = 1, pool_size do
      if s ~= d then pool[d] = mix(pool[d], hashmix(pool[s])) end
    end
  end
  for s = pool_size + 1, #ent do
    for d = 1, pool_size do pool[d] = mix(pool[d], hashmix(ent[s])) end
  end
  local out, hb = {}, 0x8b51f9dd
  for i = 1, n do
    local v = pool[(i - 1) % pool_size + 1] ~ hb
    hb = (hb * 0x58f38ded) & M32
    v = (v * hb) & M32
    out[i] = v ~ (v >> 16)
  end
  return out
end

local function round6(t) return tonumber(("%.6f"):format(t)) end

--- A Brownian tree over [t0, t1] (torchsde's BrownianTree(t0, 0, t1, entropy =
-- seed), see above): returns increment(ta, tb) = W(tb) - W(ta), t0 <= ta <= tb <= t1.
function M.brownian_tree(shape, t0, t1, seed)
  assert(t1 > t0, "sample.brownian_tree: need t0 < t1")
  local POOL = 24
  local function draw(state) return kiln.randn(shape, { seed = state }) end
  local root = { s = round6(t0), e = round6(t1), key = 0, depth = 0 }
  root.W = draw(M.seed_sequence(seed, nil, POOL, 1)[1]) * math.sqrt(t1 - t0)
  local function split(node)
    if node.left then return end
    local m = round6(0.5 * (node.e + node.s))
    node.m = m
    node.seed = M.seed_sequence(seed, { node.key, node.depth }, POOL, 1)[1]
    node.left = { s = node.s, e = m, parent = node, is_left = true, key = 2 * node.key, depth = node.depth + 1 }
    node.right = { s = m, e = node.e, parent = node, is_left = false, key = 2 * node.key + 1, depth = node.depth + 1 }
  end
  -- the W of nodes away from the root: recent ones are kept in two generations
  -- (a query reuses its neighbours' ancestors; when the young one fills up it
  -- becomes the old one), the rest recomputed from their parents. A parent's
  -- draw gives both children, so both are kept together.
  local young, old, count, GEN = {}, {}, 0, 96
  local function keep(node, w)
    if count >= GEN then young, old, count = {}, young, 0 end
    young[node], count = w, count + 1
  end
  local function W(node)
    if node.W then return node.W end
    local w = young[node]
    if w then return w end
    w = old[node]
    if w then keep(node, w) return w end
    local p = node.parent
    local pw = W(p)
    local h_rec = 1 / (p.e - p.s)
    local l, r = p.m - p.s, p.e - p.m
    local left = pw * l * h_rec + draw(p.seed) * math.sqrt(l * r * h_rec)
    local right = pw - left
    keep(p.left, left)
    keep(p.right, right)
    return node.is_left and left or right
  end
  -- the nodes that tile [ta, tb], left to right
  local function tile(node, ta, tb, out)
    while true do
      if ta == node.s and tb == node.e then out[#out + 1] = node return out end
      split(node)
      if tb <= node.m then node = node.left
      elseif ta >= node.m then node = node.right
      else
        tile(node.left, ta, node.m, out)
        node, ta = node.right, node.m
      end
    end
  end
  return function(ta, tb)
    ta = round6(math.min(math.max(ta, root.s), root.e))
    tb = round6(math.min(math.max(tb, root.s), root.e))
    assert(ta <= tb, "brownian tree: need ta <= tb")
    if ta == tb then return kiln.zeros(shape) end
    local nodes = tile(root, ta, tb, {})
    local w = W(nodes[1])
    for i = 2, #nodes do w = w + W(nodes[i]) end
    return w
  end
end

--- The SDE samplers' noise: noise(shape, sigma, sigma_next) =
-- (W(sigma_next) - W(sigma)) / sqrt(|sigma_next - sigma|), W the Brownian tree
-- over [smallest sigma > 0, largest sigma] seeded by seed, as ComfyUI's
-- BrownianTreeNoiseSampler(x, sigma_min, sigma_max, seed).
function M.brownian_noise(shape, sigmas, seed)
  local s = list_of(sigmas)
  local lo, hi = math.huge, -math.huge
  for _, v in ipairs(s) do
    if v > 0 then lo, hi = math.min(lo, v), math.max(hi, v) end
  end
  if not (hi > lo) then hi = lo + 1 end
  local increment = M.brownian_tree(shape, lo, hi, seed)
  return function(_, sigma, sigma_next)
    assert(sigma and sigma_next, "the Brownian noise needs the two sigmas it bridges")
    if sigma == sigma_next then return kiln.zeros(shape) end
    local w
    if sigma <= sigma_next then w = increment(sigma, sigma_next) else w = -increment(sigma_next, sigma) end
    return w / f32(math.sqrt(f32(math.abs(sigma_next - sigma))))
  end
end

-- Per step: report progress to an embedding host (kiln.progress raises a
-- "cancelled" error when the host asked to stop; opts.progress = false when the
-- caller reports itself), then the user's callback; then a suspend point (a host may
-- park the run between two steps; a lowered budget takes effect).
local function stepper(opts, n)
  local cb = opts.callback
  local report = opts.progress ~= false and kiln.progress
  local suspend = kiln.suspend_point
  return function(i, sigma, x, denoised)
    if report then report(i, n, "sample") end
    if suspend then suspend() end
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
    info[name] = { name = name, fn = fn, label = label, [flag] = on and true or false, brownian = on == "brownian" }
  end
  return fns, info, order, add
end

-- name -> function(denoise, x, s, opts, noise, step); and name -> registry entry
local samplers, sampler_info, sampler_order, add_sampler = registry("sampler", "noise")

--- Adds a sampler to the registry: name (k-diffusion / ComfyUI), fn, the A1111
-- label, and whether it draws noise at every step (ancestral and SDE samplers;
-- the others draw none unless s_churn asks for it): true, or "brownian" for the
-- SDE samplers whose default noise is the Brownian tree (sample.brownian_noise).
function M.add_sampler(name, fn, label, noise) add_sampler(name, fn, label, noise) end

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
M.add_sampler("euler", samplers.euler, "Euler", false)

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
M.add_sampler("euler_ancestral", samplers.euler_ancestral, "Euler a", true)

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
M.add_sampler("heun", samplers.heun, "Heun", false)

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
M.add_sampler("dpm_2", samplers.dpm_2, "DPM2", false)

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
M.add_sampler("dpm_2_ancestral", samplers.dpm_2_ancestral, "DPM2 a", true)

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
M.add_sampler("lms", samplers.lms, "LMS", false)

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
M.add_sampler("dpmpp_2s_ancestral", samplers.dpmpp_2s_ancestral, "DPM++ 2S a", true)

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
M.add_sampler("dpmpp_2m", samplers.dpmpp_2m, "DPM++ 2M", false)

-- DPM-Solver++(2S) SDE step pair; the noise of each half step is the Brownian
-- increment between its two sigmas (noise(shape, sigma, sigma_next)).
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
      x2 = x2 + noise(x.shape, sigma_fn(t), sigma_fn(sm)) * (s_noise * su)
      local denoised2 = denoise(x2, sigma_fn(sm))
      sd, su = ancestral_step(sigma_fn(t), sigma_fn(t_next), eta)
      local tn_ = t_fn(sd)
      local dd = denoised * (1 - fac) + denoised2 * fac
      x = x * (sigma_fn(tn_) / sigma_fn(t)) - dd * expm1(t - tn_)
      x = x + noise(x.shape, sigma_fn(t), sigma_fn(t_next)) * (s_noise * su)
    end
  end
  return x
end
M.add_sampler("dpmpp_sde", samplers.dpmpp_sde, "DPM++ SDE", "brownian")

-- DPM-Solver++(2M) SDE (k-diffusion's sample_dpmpp_2m_sde, midpoint solver):
-- the 2M update with eta of each step's log-SNR change spent on fresh noise.
function samplers.dpmpp_2m_sde(denoise, x, s, opts, noise, step)
  local n, eta, s_noise = #s - 1, opts.eta or 1, opts.s_noise or 1
  local old, h_last
  for i = 1, n do
    local denoised = denoise(x, s[i])
    step(i, s[i], x, denoised)
    local h
    if s[i + 1] == 0 then
      x = denoised
    else
      h = t_fn(s[i + 1]) - t_fn(s[i])
      local eta_h = eta * h
      x = x * (s[i + 1] / s[i] * math.exp(-eta_h)) - denoised * expm1(-h - eta_h)
      if old then
        x = x - (denoised - old) * (0.5 * expm1(-h - eta_h) * h / h_last)
      end
      if eta ~= 0 then
        x = x + noise(x.shape, s[i], s[i + 1]) * (s[i + 1] * math.sqrt(-expm1(-2 * eta_h)) * s_noise)
      end
    end
    old, h_last = denoised, h
  end
  return x
end
M.add_sampler("dpmpp_2m_sde", samplers.dpmpp_2m_sde, "DPM++ 2M SDE", "brownian")

-- DPM-Solver++(3M) SDE (k-diffusion's sample_dpmpp_3m_sde): third-order
-- multistep in log sigma from the last three denoised predictions.
function samplers.dpmpp_3m_sde(denoise, x, s, opts, noise, step)
  local n, eta, s_noise = #s - 1, opts.eta or 1, opts.s_noise or 1
  local d_1, d_2, h, h_1, h_2
  for i = 1, n do
    local denoised = denoise(x, s[i])
    step(i, s[i], x, denoised)
    if s[i + 1] == 0 then
      x = denoised
    else
      h = t_fn(s[i + 1]) - t_fn(s[i])
      local h_eta = h * (eta + 1)
      x = x * math.exp(-h_eta) - denoised * expm1(-h_eta)
      local phi_2 = expm1(-h_eta) / h_eta + 1
      if h_2 then
        local r0, r1 = h_1 / h, h_2 / h
        local d1_0 = (denoised - d_1) / r0
        local d1_1 = (d_1 - d_2) / r1
        local d1 = d1_0 + (d1_0 - d1_1) * (r0 / (r0 + r1))
        local d2 = (d1_0 - d1_1) / (r0 + r1)
        local phi_3 = phi_2 / h_eta - 0.5
        x = x + d1 * phi_2 - d2 * phi_3
      elseif h_1 then
        x = x + (denoised - d_1) * (phi_2 * h / h_1)
      end
      if eta ~= 0 then
        x = x + noise(x.shape, s[i], s[i + 1]) * (s[i + 1] * math.sqrt(-expm1(-2 * h * eta)) * s_noise)
      end
    end
    d_1, d_2 = denoised, d_1
    h_1, h_2 = h, h_1
  end
  return x
end
M.add_sampler("dpmpp_3m_sde", samplers.dpmpp_3m_sde, "DPM++ 3M SDE", "brownian")

-- Solves the small dense system A y = b (Gaussian elimination, partial pivoting).
local function solve(A, b)
  local n = #b
  local aug = {}
  for i = 1, n do
    aug[i] = {}
    for j = 1, n do aug[i][j] = A[i][j] end
    aug[i][n + 1] = b[i]
  end
  for c = 1, n do
    local p = c
    for r = c + 1, n do if math.abs(aug[r][c]) > math.abs(aug[p][c]) then p = r end end
    aug[c], aug[p] = aug[p], aug[c]
    for r = c + 1, n do
      local f = aug[r][c] / aug[c][c]
      for j = c, n + 1 do aug[r][j] = aug[r][j] - f * aug[c][j] end
    end
  end
  local y = {}
  for i = n, 1, -1 do
    local acc = aug[i][n + 1]
    for j = i + 1, n do acc = acc - aug[i][j] * y[j] end
    y[i] = acc / aug[i][i]
  end
  return y
end

-- UniPC (Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework"),
-- multistep, data prediction, B(h) = h ("bh1") or e^h - 1 ("bh2"), order
-- min(3, steps - 1) lowered at the first and last steps, as ComfyUI runs it
-- (sample_unipc). ComfyUI works on VP-scaled x; in sigma space the scalings
-- cancel and each update is x_t = (sigma_t / sigma_s) x - expm1(-h) m0 - B(h) res.
-- A final sigma of 0 is replaced by 0.001, as there.
local function unipc_update(variant, denoise, x, ms, ts, t, order, corrector)
  local m0, tp = ms[#ms], ts[#ts]
  local h = math.log(tp) - math.log(t)
  local rks, D1s = {}, {}
  for i = 1, order - 1 do
    rks[i] = (math.log(tp) - math.log(ts[#ts - i])) / h
    D1s[i] = (ms[#ms - i] - m0) / rks[i]
  end
  rks[order] = 1
  local hh = -h
  local h_phi_1 = expm1(hh)
  local h_phi_k = h_phi_1 / hh - 1
  local B_h = variant == "bh2" and expm1(hh) or hh
  local R, b, fact = {}, {}, 1
  for i = 1, order do
    R[i] = {}
    for c = 1, order do R[i][c] = rks[c] ^ (i - 1) end
    b[i] = h_phi_k * fact / B_h
    fact = fact * (i + 1)
    h_phi_k = h_phi_k / hh - 1 / fact
  end
  local x_t_ = x * (t / tp) - m0 * h_phi_1
  local x_t = x_t_
  if order > 1 then
    local rhos_p
    if order == 2 then
      rhos_p = { 0.5 }
    else
      local Rp, bp = {}, {}
      for i = 1, order - 1 do
        Rp[i] = { table.unpack(R[i], 1, order - 1) }
        bp[i] = b[i]
      end
      rhos_p = solve(Rp, bp)
    end
    local res = D1s[1] * rhos_p[1]
    for k = 2, order - 1 do res = res + D1s[k] * rhos_p[k] end
    x_t = x_t_ - res * B_h
  end
  local model_t
  if corrector then
    local rhos_c = order == 1 and { 0.5 } or solve(R, b)
    model_t = denoise(x_t, t)
    local res = (model_t - m0) * rhos_c[order]
    for k = 1, order - 1 do res = res + D1s[k] * rhos_c[k] end
    x_t = x_t_ - res * B_h
  end
  return x_t, model_t
end

local function unipc(variant)
  return function(denoise, x, s, opts, noise, step)
    local n = #s - 1
    local ts = {}
    for i = 1, n + 1 do ts[i] = s[i] end
    if ts[n + 1] == 0 then ts[n + 1] = 0.001 end
    -- (one step, where ComfyUI's order would be 0 and fail: a first-order step)
    local order = math.max(1, math.min(3, n - 1))
    local m = denoise(x, ts[1])
    local ms, tl = { m }, { ts[1] }
    for j = 1, n do            -- from ts[j] to ts[j + 1]
      step(j, s[j], x, ms[#ms])
      local model_x
      if j < order then
        x, model_x = unipc_update(variant, denoise, x, ms, tl, ts[j + 1], j, true)
        ms[#ms + 1], tl[#tl + 1] = model_x, ts[j + 1]
      else
        local last = j == n
        x, model_x = unipc_update(variant, denoise, x, ms, tl, ts[j + 1], math.min(order, n + 1 - j), not last)
        for i = 1, #ms - 1 do ms[i], tl[i] = ms[i + 1], tl[i + 1] end
        tl[#tl] = ts[j + 1]
        if not last then ms[#ms] = model_x or denoise(x, ts[j + 1]) end
      end
    end
    return x
  end
end
samplers.uni_pc = unipc("bh1")
M.add_sampler("uni_pc", samplers.uni_pc, "UniPC", false)
samplers.uni_pc_bh2 = unipc("bh2")
M.add_sampler("uni_pc_bh2", samplers.uni_pc_bh2, "UniPC BH2", false)

-- ComfyUI's "ddim" is Euler in sigma space (identical to DDIM with eta = 0).
M.add_sampler("ddim", samplers.euler, "DDIM", false)

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
M.add_sampler("lcm", samplers.lcm, "LCM", true)

M.samplers = samplers

local function sorted(t)
  local r = {}
  for i = 1, #t do r[i] = t[i] end
  table.sort(r)
  return r
end

--- The sampler names, sorted.
function M.names() return sorted(sampler_order) end

--- The registry entry of a sampler: {name, fn, label, noise}, or nil.
function M.sampler_info(name)
  local e = sampler_info[name]
  return e and { name = e.name, fn = e.fn, label = e.label, noise = e.noise }
end

--- Runs sampler `name` (k-diffusion / ComfyUI names) from x over sigmas.
function M.run(name, denoise, x, sigmas, opts)
  opts = opts or {}
  local fn = sampler_info[name] and sampler_info[name].fn
  if not fn then
    error(("unknown sampler '%s' (known: %s)"):format(tostring(name), table.concat(M.names(), ", ")), 2)
  end
  if type(denoise) ~= "function" then error("sample.run: denoise must be a function(x, sigma)", 2) end
  local s = list_of(sigmas)
  if #s < 2 then error("sample.run: need at least 2 sigmas (steps + 1, ending in 0)", 2) end
  local noise = opts.noise
  if not noise and sampler_info[name].brownian then
    noise = M.brownian_noise(x.shape, s, opts.seed or 0)
  end
  noise = noise or default_noise(opts)
  -- every evaluation starts with a full collection: the previous step's temporaries
  -- that the samplers leave to the collector are gone before the network's peak, at the
  -- same point in a real run and in a dry run (kiln.dry_run holds the collector between)
  local function evaluate(...)
    collectgarbage()
    return denoise(...)
  end
  return fn(evaluate, x, s, opts, noise, stepper(opts, #s - 1))
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

local ZSNR_LAST = 4.8973451890853435e-08

function M.discrete_schedule(opts)
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
  -- host data, read back with :table(): on the cpu whatever the default device
  return kiln.tensor(list, { device = "cpu" })
end

-- name -> function(steps, opts); and name -> registry entry
local schedules, schedule_info, schedule_order, add_scheduler = registry("scheduler", "needs_model")

--- Adds a scheduler to the registry: name (ComfyUI's), fn(steps, opts) -> sigmas,
-- the A1111 label ("Schedule type"), and whether it reads the model's discrete
-- schedule (opts.model_sampling) rather than sigma_min / sigma_max alone.
function M.add_scheduler(name, fn, label, needs_model) add_scheduler(name, fn, label, needs_model) end

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
M.add_scheduler("karras", schedules.karras, "Karras", false)

function schedules.exponential(steps, o)
  local a, b = math.log(o.sigma_max), math.log(o.sigma_min)
  local out = {}
  for i = 0, steps - 1 do
    local r = steps > 1 and i / (steps - 1) or 0
    out[#out + 1] = math.exp(a + (b - a) * r)
  end
  return with_zero(out)
end
M.add_scheduler("exponential", schedules.exponential, "Exponential", false)

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
M.add_scheduler("normal", schedules.normal, "Normal", true)
function schedules.sgm_uniform(steps, o) return normal_like(steps, o, true) end
M.add_scheduler("sgm_uniform", schedules.sgm_uniform, "SGM Uniform", true)

function schedules.simple(steps, o)
  local s = need_model(o, "simple").sigmas
  local ss = #s / steps
  local out = {}
  for x = 0, steps - 1 do out[#out + 1] = s[#s - math.floor(x * ss)] end
  return with_zero(out)
end
M.add_scheduler("simple", schedules.simple, "Simple", true)

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
M.add_scheduler("ddim_uniform", schedules.ddim_uniform, "DDIM", true)

M.schedules = schedules

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
M.beta_ppf = beta_ppf

local rint = require("kiln.util").round_half_even -- numpy.rint

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
M.add_scheduler("beta", schedules.beta, "Beta", true)

--- The scheduler names, sorted.
function M.scheduler_names() return sorted(schedule_order) end

--- The registry entry of a scheduler: {name, fn, label, needs_model}, or nil.
function M.scheduler_info(name)
  local e = schedule_info[name]
  return e and { name = e.name, fn = e.fn, label = e.label, needs_model = e.needs_model }
end

--- sigmas(name, steps, opts) -> 1-D f32 tensor of steps + 1 values ending in 0.
-- karras / exponential take sigma_min, sigma_max (and rho); the schedulers that
-- need the model take opts.model_sampling (defaults: SD's schedule).
function M.sigmas(name, steps, opts)
  opts = opts or {}
  local info = schedule_info[name]
  if not info then
    error(("unknown schedule '%s' (known: %s)"):format(tostring(name),
      table.concat(M.scheduler_names(), ", ")), 2)
  end
  local fn = info.fn
  if math.type(steps) ~= "integer" or steps < 1 then error("sample.sigmas: steps must be a positive integer", 2) end
  if not info.needs_model and not (opts.sigma_min and opts.sigma_max) then
    local ms = opts.model_sampling or M.discrete_schedule()
    opts = setmetatable({ sigma_min = opts.sigma_min or ms.sigma_min, sigma_max = opts.sigma_max or ms.sigma_max },
      { __index = opts })
  end
  if info.needs_model and not opts.model_sampling then
    opts = setmetatable({ model_sampling = M.discrete_schedule() }, { __index = opts })
  end
  return fn(steps, opts)
end

-- the few-step models' sampler (tcd) and schedule (trailing), kept in their own module
require("kiln.few_step").register(M, need_model)

return M
