-- Step caching (kiln.step_cache, opts.cache): each policy's decisions against the
-- published rules reimplemented in tests/golden/gen_step_cache.py on recorded
-- trajectories; the UNet and Flux hook points (a cache that never reuses gives the
-- uncached output bit for bit; one that reuses counts fewer full evaluations); the
-- pipelines in every memory mode (evaluations counted, the picture near the uncached
-- one, a streamed UNet copying fewer bytes); option errors by name. The harness checks
-- that no cached tensor outlives its run.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local step_cache = require "kiln.step_cache"
local test, eq, truthy, raises = H.test, H.eq, H.truthy, H.raises

if kiln.set_quiet then kiln.set_quiet(true) end
local G = kiln.load_safetensors("tests/golden/step_cache.safetensors")
local FLUX = step_cache.COEFFICIENTS.flux

-- the case a golden entry's name encodes
local function case_of(name)
  local thr, mh = name:match("^fb_([%d.]+)_(%-?%d+)$")
  if thr then return { mode = "fbcache", threshold = tonumber(thr), max_hits = tonumber(mh) } end
  local tag, t2 = name:match("^tea_(%a+)_([%d.]+)$")
  if tag then
    return { mode = "teacache", threshold = tonumber(t2), coefficients = tag == "flux" and FLUX or { 1, 0 } }
  end
  return { mode = "deepcache", interval = tonumber(name:match("^deep_(%d+)$")) }
end

-- Feeds a trajectory through a cache's decision path as the forwards do, one call per
-- step; returns the list of decisions (true = reuse) and the per-step values.
local function replay(spec, traj)
  local cs <close> = step_cache.new(spec, "unet")
  local n = traj and traj.shape[1] or G.dec_deep_2:numel()
  local shape = { 2, 3, 4, 4 }
  local dec = {}
  for i = 1, n do
    cs:begin(1000 - i, shape)
    local h = kiln.zeros(shape)
    local r
    if spec.mode == "fbcache" then
      r = cs:residual_or_anchor(cs:fb_first(traj:select(1, i):contiguous()), h)
    elseif spec.mode == "teacache" then
      r = cs:residual_or_anchor(cs:tea_input(traj:select(1, i):contiguous()), h)
    else
      r = cs.skip and kiln.zeros(shape) or nil
      if r then cs.full = false end
    end
    dec[i] = r ~= nil
    if r then r:free() else
      local o = h + 1
      cs:store_residual(o)
      o:free()
    end
    h:free()
    cs:finish()
  end
  eq(cs.calls, n, "calls")
  local full = 0
  for _, d in ipairs(dec) do if not d then full = full + 1 end end
  eq(cs.evals, full, "evals = the steps that ran in full")
  return dec, cs.trace
end

local names = {}
for k in pairs(G) do
  local n = k:match("^dec_(.+)$")
  if n then names[#names + 1] = n end
end
table.sort(names)

for _, name in ipairs(names) do
  test("policy " .. name .. ": same decisions as the published rule (generator)", function()
    local c = case_of(name)
    local traj = c.mode == "fbcache" and G.traj_fb or c.mode == "teacache" and G.traj_tea or nil
    local dec, trace = replay(c, traj)
    local want = G["dec_" .. name]:table()
    local got, exp = {}, {}
    for i = 1, #want do
      got[i] = dec[i] and "1" or "0"
      exp[i] = want[i] == 1 and "1" or "0"
    end
    eq(table.concat(got), table.concat(exp), name .. " decisions")
    local vals = G["val_" .. name]
    if vals then
      vals = vals:table()
      for i = 2, #vals do
        H.near(trace[i].value, vals[i], 1e-5 * math.max(1, math.abs(vals[i])), name .. " value at step " .. i)
      end
    end
  end)
end

test("options: errors name the key, the mode, the number", function()
  truthy(raises(function() step_cache.spec({ mode = "fbcache", treshold = 0.1 }, "unet", "cache") end)
    :find("did you mean 'threshold'", 1, true))
  truthy(raises(function() step_cache.spec({ mode = "fastcache" }, "unet", "cache") end)
    :find("fbcache, teacache, deepcache", 1, true))
  truthy(raises(function() step_cache.spec({ mode = "deepcache" }, "flux", "cache") end):find("UNet", 1, true))
  truthy(raises(function() step_cache.spec({ mode = "fbcache", threshold = -1 }, "unet", "cache") end)
    :find("threshold", 1, true))
  truthy(raises(function() step_cache.spec({ mode = "deepcache", interval = 0 }, "unet", "cache") end)
    :find("interval", 1, true))
  local s = step_cache.spec("teacache", "flux")
  eq(s.threshold, 0.4); eq(s.coefficients, FLUX)
  eq(step_cache.spec(nil, "unet"), nil)
  eq(step_cache.spec({ mode = "deepcache" }, "unet").interval, 3)
end)

-- ---------------------------------------------------------------- the UNet hooks

local function maxdiff(a, b) return (a:to("cpu") - b:to("cpu")):abs():max() end

test("UNet hooks: a cache that never reuses gives the uncached output; reuse counts fewer evaluations", function()
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  ck.unet:load("cpu")
  local x, _, ctx = T.inputs(64)
  for _, spec in ipairs({ { mode = "fbcache", threshold = 0 }, { mode = "teacache", threshold = 0 },
    { mode = "deepcache", interval = 1 } }) do
    local cs <close> = step_cache.new(spec, "unet")
    for k, tv in ipairs({ 900, 800, 700 }) do
      local t = kiln.tensor({ tv })
      local ref = ck.unet:forward(x, t, ctx)
      local got = ck.unet:forward(x, t, ctx, nil, { cache_state = cs })
      eq(maxdiff(got, ref), 0, spec.mode .. " at step " .. k)
      ref:free(); got:free(); t:free()
    end
    eq(cs.evals, 3, spec.mode .. ": every call full")
  end
  -- reuse: the same input twice at close timesteps; the reused call is the full one's
  -- first part plus the cached residual, near the full output
  -- (fbcache and teacache above any distance reuse after the first call; deepcache
  -- every other call)
  for _, spec in ipairs({ { mode = "fbcache", threshold = 10, evals = 1 }, { mode = "teacache", threshold = 10, evals = 1 },
    { mode = "deepcache", interval = 2, evals = 2 }, { mode = "deepcache", interval = 2, branch = 2, evals = 2 } }) do
    local want = spec.evals
    spec.evals = nil
    local cs <close> = step_cache.new(spec, "unet")
    local outs = {}
    for k, tv in ipairs({ 500, 499, 498 }) do
      outs[k] = ck.unet:forward(x, kiln.tensor({ tv }), ctx, nil, { cache_state = cs })
    end
    eq(cs.calls, 3); eq(cs.evals, want, spec.mode .. ": full evaluations")
    local ref = ck.unet:forward(x, kiln.tensor({ 499 }), ctx)
    local scale = ref:abs():max()
    if spec.mode == "deepcache" then
      truthy(maxdiff(outs[2], ref) < 0.1 * scale, spec.mode .. ": reused output near the full one")
    else
      -- the same x: the first part is (nearly) the full call's, so is the output
      truthy(maxdiff(outs[2], outs[1]) < 1e-4 * scale, spec.mode .. ": the full call's part plus its residual")
      truthy(maxdiff(outs[2], ref) > 0, spec.mode .. ": not a full evaluation")
    end
    ref:free()
    for _, o in ipairs(outs) do o:free() end
  end
  ck.unet:unload()
end)

test("UNet hooks: a new run (larger timestep) or another latent size starts over", function()
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  ck.unet:load("cpu")
  local x, _, ctx = T.inputs(64)
  local cs <close> = step_cache.new({ mode = "fbcache", threshold = 10 }, "unet")
  local function call(tv, xx)
    local o = ck.unet:forward(xx or x, kiln.tensor({ tv }), ctx, nil, { cache_state = cs })
    o:free()
  end
  call(500); call(499)
  eq(cs.evals, 1)
  call(900)                      -- a new run: full
  eq(cs.evals, 2)
  local x2 = kiln.randn({ 2, 4, 16, 16 }, { seed = 3 })
  call(899, x2)                  -- another size: full
  eq(cs.evals, 3)
  -- cond and uncond apart (the same timestep twice): the second call follows the first
  call(898, x2); call(898, x2)
  eq(cs.calls, 6); eq(cs.evals, 4, "898's first call reused, its second has no residual of its own yet: full")
  ck.unet:unload()
end)

-- ---------------------------------------------------------------- Flux hooks

test("Flux hooks: fbcache and teacache on the tiny [dev] network", function()
  local base, meta = T.build_recipe("../flux/flux")
  local path = T.tmp("flux-cache.safetensors")
  kiln.save_safetensors(path, base, meta)
  for _, v in pairs(base) do v:free() end
  local IO = kiln.load_safetensors("tests/golden/flux/io.safetensors")
  local ck <close> = kiln.load_checkpoint(path)
  local dit = ck.dit
  local opts = { guidance = IO.guidance }
  for _, mode in ipairs({ "fbcache", "teacache" }) do
    local never <close> = step_cache.new({ mode = mode, threshold = 0 }, "flux")
    local always <close> = step_cache.new({ mode = mode, threshold = 1e9 }, "flux")
    for k, tv in ipairs({ 0.9, 0.8999, 0.8998 }) do
      local t = kiln.tensor({ tv, tv })
      local ref = dit:forward(IO.x, t, IO.context, IO.y, opts)
      opts.cache_state = never
      local a = dit:forward(IO.x, t, IO.context, IO.y, opts)
      opts.cache_state = always
      local b = dit:forward(IO.x, t, IO.context, IO.y, opts)
      opts.cache_state = nil
      eq(maxdiff(a, ref), 0, mode .. ": never reusing is the plain forward")
      if k > 1 then truthy(maxdiff(b, ref) < 0.1 * ref:abs():max(), mode .. ": reused near the full output") end
      ref:free(); a:free(); b:free(); t:free()
    end
    eq(never.evals, 3); eq(always.evals, 1, mode .. ": after the first, every call reused")
  end
  for _, v in pairs(IO) do v:free() end
end)

-- ---------------------------------------------------------------- pipelines, memory modes

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

local function psnr(a, b)
  local d = a - b
  local mse = (d * d):mean()
  d:free()
  return mse == 0 and math.huge or 10 * math.log(1 / mse, 10)
end

local MODES = { "high", "normal", "low", "none" }
test("pipelines: every policy in every memory mode counts its evaluations and stays near the uncached picture", function()
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local dev = has_sim and "sim" or "cpu"
  local base = { prompt = "a red circle", steps = 8, seed = 5, width = 64, height = 64, device = dev }
  local old = kiln.memory_mode()
  local _ <close> = setmetatable({}, { __close = function() kiln.memory_mode(old) end })
  for _, mode in ipairs(MODES) do
    kiln.memory_mode(mode)
    local ref, lat0, info0 = kiln.pipeline.txt2img(ck, base)
    lat0:free()
    eq(info0.evals, info0.calls, mode .. ": uncached, every call is full")
    eq(info0.steps, 8)
    for _, c in ipairs({ { mode = "fbcache", threshold = 0.3 }, { mode = "teacache", threshold = 2 },
      { mode = "deepcache", interval = 2 } }) do
      local o = {}
      for k, v in pairs(base) do o[k] = v end
      o.cache = c
      local img, lat, info = kiln.pipeline.txt2img(ck, o)
      lat:free()
      eq(info.calls, info0.calls, mode .. " " .. c.mode .. ": calls")
      truthy(info.evals < info.calls, ("%s %s: %d full evaluations of %d calls"):format(mode, c.mode, info.evals, info.calls))
      local p = psnr(img:to("cpu"), ref:to("cpu"))
      truthy(p > 20, ("%s %s: PSNR %.1f dB"):format(mode, c.mode, p))
      img:free()
    end
    ref:free()
  end
end)

test("pipelines: a streamed UNet (mode low) copies no block the cache skips", function()
  if not has_sim then H.skip("no sim device") end
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local old = kiln.memory_mode()
  local _ <close> = setmetatable({}, { __close = function() kiln.memory_mode(old) end })
  kiln.memory_mode("low")
  local base = { prompt = "a red circle", steps = 6, seed = 5, width = 64, height = 64, device = "sim" }
  local function copied(cache)
    local o = {}
    for k, v in pairs(base) do o[k] = v end
    o.cache = cache
    kiln.mem.reset_peak("sim")
    local img, lat, info = kiln.pipeline.txt2img(ck, o)
    img:free(); lat:free()
    return kiln.mem.stats("sim").copied_in, info
  end
  local full = copied(nil)
  local deep, info = copied({ mode = "deepcache", interval = 2, branch = 1 })
  truthy(info.evals < info.calls)
  truthy(deep < full, ("deepcache copied %d bytes, uncached %d"):format(deep, full))
  local fb, info2 = copied({ mode = "fbcache", threshold = 10 })
  truthy(info2.evals < info2.calls)
  truthy(fb < deep, ("fbcache copied %d bytes, deepcache %d"):format(fb, deep))
end)

test("pipelines: opts.cache errors name the pipeline and the key", function()
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local err = raises(function() kiln.pipeline.txt2img(ck, { steps = 2, width = 64, height = 64, cache = { mode = "x" } }) end)
  truthy(err:find("kiln.pipeline: cache", 1, true) and err:find("unknown mode 'x'", 1, true), err)
end)

T.cleanup()
H.done()
