-- Tiling: kiln.tile.map against untiled runs (identity, nearest x8, average-pool /8,
-- a small conv net with SiLU) with PSNR and a seam check, bad fns and options, the
-- peak on sim for three image sizes, OOM recovery forced through two halvings by a
-- sim budget, tile = "auto" under a tight budget, kiln.mem.estimate against measured
-- peaks, MultiDiffusion-style tiled denoising, tiled VAE decode/encode on a stand-in
-- VAE, cancel.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local tiling = require "kiln.tiling"
local test, eq, truthy, raises = H.test, H.eq, H.truthy, H.raises

kiln.set_quiet(true) -- OOM retries are checked through kiln.mem.events
local KiB, MiB = 1024, 1024 * 1024
local report = {}
local function note(fmt, ...) report[#report + 1] = fmt:format(...) end

-- ---------------------------------------------------------------- helpers

local imgcmp = require "imgcmp"
local psnr, seam_check = imgcmp.psnr, imgcmp.seam_check

local function maxdiff(a, b) return (a - b):abs():max() end

-- Two 3x3 convs with random weights and SiLU (receptive field 5x5); intermediates
-- are closed as soon as they are used, so the peak is deterministic.
local function conv_net(cin, mid, cout, seed, dev)
  local w1 = (kiln.randn({ mid, cin, 3, 3 }, { seed = seed }) * (1 / math.sqrt(cin * 9))):to(dev)
  local b1 = (kiln.randn({ mid }, { seed = seed + 1 }) * 0.1):to(dev)
  local w2 = (kiln.randn({ cout, mid, 3, 3 }, { seed = seed + 2 }) * (1 / math.sqrt(mid * 9))):to(dev)
  local b2 = (kiln.randn({ cout }, { seed = seed + 3 }) * 0.1):to(dev)
  return function(x)
    local a <close> = kiln.nn.conv2d(x, w1, b1, { padding = 1 })
    local s <close> = kiln.nn.silu(a)
    local c <close> = kiln.nn.conv2d(s, w2, b2, { padding = 1 })
    return kiln.nn.silu(c)
  end
end

local function avg_pool8(c, dev)
  local w = (kiln.ones({ c, 1, 8, 8 }) / 64):to(dev)
  return function(x) return kiln.nn.conv2d(x, w, nil, { stride = 8, groups = c }) end
end

local function fresh(dev)
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache(dev)
end

-- ---------------------------------------------------------------- plans and options

test("plan: grid, 1-based rectangles, scale", function()
  local p = kiln.tile.plan(100, 37, { tile = 32, overlap = 8 })
  eq(p.rows, 4); eq(p.cols, 2); eq(p.count, 8)
  -- rows: 4 tiles shortened to 31 (starts 0 23 46 69); columns: 2 tiles of 23 (0, 14)
  eq(p[1].input.y, 1); eq(p[3].input.y, 24); eq(p[8].input.y, 70); eq(p[8].input.x, 15)
  eq(p[8].input.h, 31); eq(p[8].input.w, 23); eq(p.out_h, 100)
  local d = kiln.tile.plan(256, 192, { tile = 64, overlap = 16, scale = 0.125 })
  eq(d.scale_num, 1); eq(d.scale_den, 8); eq(d.out_h, 32); eq(d.out_w, 24)
  eq(d[2].output.x, d[2].input.x // 8 + 1)
  local e = kiln.tile.plan(256, 192, { tile = 64, overlap = 16, scale = "1/8" })
  eq(e.count, d.count)
  local u = kiln.tile.plan(20, 20, { tile = 8, overlap = 2, scale = 8, blend = "cosine" })
  eq(u.out_h, 160); eq(u[1].output.h, 64)
end)

test("options: clear errors", function()
  local x = kiln.randn({ 1, 2, 16, 16 }, { seed = 1 })
  local id = function(t) return t end
  raises(function() kiln.tile.map(x, id, { tile = 8, overlap = 8 }) end, "overlap", "[0, 8)")
  raises(function() kiln.tile.map(x, id, { tile = 8, bogus = 1 }) end, "unknown option 'bogus'")
  raises(function() kiln.tile.map(x, id, { tile = 8, blend = "gauss" }) end, "invalid blend 'gauss'", "linear, cosine")
  raises(function() kiln.tile.map(x, id, { tile = 8, scale = 0.3 }) end, "not a multiple of 10")
  raises(function() kiln.tile.map(x, id, { tile = 8, scale = -1 }) end, "scale")
  raises(function() kiln.tile.map(x, id, { tile = 8, scale = "a/b" }) end, "num/den")
  raises(function() kiln.tile.map(x, 42) end, "function")
  raises(function() kiln.tile.map(kiln.randn({ 5 }), id) end, "at least 2 dims")
  raises(function() kiln.tile.map(x, id, { tile = 3, overlap = 0, scale = 0.125 }) end, "smaller than the required multiple 8")
  raises(function() kiln.tile.map(kiln.randn({ 1, 1, 12, 16 }), id, { tile = 8, overlap = 0, scale = 0.125 }) end,
    "input size 12x16 is not a multiple of 8")
end)

test("fn output checks and errors", function()
  local x = kiln.randn({ 1, 3, 32, 32 }, { seed = 2 })
  raises(function() kiln.tile.map(x, function() return 1 end, { tile = 16, overlap = 4 }) end,
    "fn must return a kiln.Tensor for tile 1 of 9, got number")
  raises(function() kiln.tile.map(x, function(t) return kiln.nn.upsample_nearest(t, 2) end, { tile = 16, overlap = 4, scale = 8 }) end,
    "fn returned [1,3,28,28] for tile 1 of 9 (input rows 1-14, cols 1-14 of [1,3,32,32]); expected [1,C,112,112] (scale 8/1)")
  local n = 0
  raises(function()
    kiln.tile.map(x, function(t)
      n = n + 1
      return n == 2 and t:narrow(2, 1, 2):contiguous() or t:clone()
    end, { tile = 16, overlap = 4 })
  end, "fn returned [1,2,14,14] for tile 2 of 9", "expected [1,3,14,14]")
  -- fn's own error value comes back unchanged (tables too: typed OOM errors)
  local e = { kind = "oom", device = "sim", requested = 1, free = 0, budget = 1 }
  local ok, got = pcall(kiln.tile.map, x, function() error(e) end, { tile = 16, overlap = 4 })
  truthy(not ok and got == e, "error value passed through")
  -- the tile input lives only during fn; the returned tensor is consumed
  local keep, out
  kiln.tile.map(x, function(t) keep = t; out = t:clone(); return out end, { tile = 16, overlap = 4 })
  raises(function() return keep + 1 end, "freed at kiln.tile.map (a tile input lives only during fn")
  raises(function() return out + 1 end, "consumed by the blend")
  -- fn may free x itself: the map holds its own reference
  local y = kiln.randn({ 1, 1, 16, 16 }, { seed = 3 })
  local r = kiln.tile.map(y, function(t) if not y:is_contiguous() then error("?") end; return t:clone() end, { tile = 8, overlap = 2 })
  eq(r.shape[4], 16)
end)

test("fn gets each tile's index in the plan, in order", function()
  local x = kiln.randn({ 1, 2, 20, 28 }, { seed = 3 })
  local opts = { tile = 12, overlap = 4 }
  local plan = kiln.tile.plan(20, 28, opts)
  local seen = {}
  local y = kiln.tile.map(x, function(t, i)
    seen[#seen + 1] = i
    local r = plan[i].input
    eq(t.shape[3] .. "x" .. t.shape[4], r.h .. "x" .. r.w, "tile " .. i .. " shape")
    return t:clone()
  end, opts)
  eq(#seen, plan.count)
  for k, i in ipairs(seen) do eq(i, k) end
  truthy(maxdiff(y, x) < 1e-6, "identity tiles blend back to x")
end)

test("cancel stops between tiles", function()
  local x = kiln.randn({ 1, 1, 32, 32 }, { seed = 4 })
  local calls = 0
  local ok, err = pcall(kiln.tile.map, x, function(t)
    calls = calls + 1
    if calls == 2 then kiln.cancel(true) end
    return t:clone()
  end, { tile = 16, overlap = 4 })
  kiln.cancel(false)
  truthy(not ok and type(err) == "table" and err.kind == "cancelled", "cancelled error: " .. tostring(err))
  truthy(tostring(err):find("after tile 2 of 9", 1, true), tostring(err))
  eq(calls, 2)
  local steps = {}
  kiln.on_progress(function(i, n, label) steps[#steps + 1] = label .. i .. "/" .. n end)
  kiln.tile.map(x, function(t) return t:clone() end, { tile = 16, overlap = 4, progress = "decode" })
  kiln.on_progress(nil)
  eq(#steps, 9); eq(steps[9], "decode9/9")
end)

-- ---------------------------------------------------------------- against untiled

for _, dev in ipairs({ "cpu", "sim" }) do
  test("identity on " .. dev .. ": exact", function()
    local x = kiln.randn({ 2, 3, 80, 112 }, { seed = 5 }):to(dev)
    local id = function(t) return t:clone() end
    local r = kiln.tile.map(x, id, { tile = 32, overlap = 8 })
    truthy(maxdiff(r, x) <= 1e-6 * x:abs():max(), "overlapping: max diff " .. maxdiff(r, x))
    eq(r.device, dev)
    local c = kiln.tile.map(x, id, { tile = 32, overlap = 8, blend = "cosine" })
    truthy(maxdiff(c, x) <= 1e-6 * x:abs():max(), "cosine: max diff " .. maxdiff(c, x))
    local a = kiln.tile.map(x, id, { tile = 16, overlap = 0 })
    eq(maxdiff(a, x), 0, "abutting tiles: bit exact")
  end)

  test("nearest x8 and average-pool /8 on " .. dev, function()
    local x = kiln.randn({ 1, 3, 48, 64 }, { seed = 6 }):to(dev)
    local up = function(t) return kiln.nn.upsample_nearest(t, 8) end
    local full = up(x)
    local r = kiln.tile.map(x, up, { tile = 16, overlap = 4, scale = 8 })
    local p = psnr(r, full)
    local b, i = seam_check(r, full, kiln.tile.plan(48, 64, { tile = 16, overlap = 4, scale = 8 }))
    truthy(p >= 40, "psnr " .. p)
    truthy(b <= math.max(i, 1e-6), ("seam: border %g elsewhere %g"):format(b, i))
    note("nearest x8 (%s): PSNR %s, max diff border %.2g / elsewhere %.2g", dev, p == math.huge and "inf" or ("%.1f"):format(p), b, i)
    local img = kiln.randn({ 1, 3, 256, 192 }, { seed = 7 }):to(dev)
    local pool = avg_pool8(3, dev)
    local pf = pool(img)
    local pr = kiln.tile.map(img, pool, { tile = 64, overlap = 16, scale = 1 / 8 })
    local pp = psnr(pr, pf)
    b, i = seam_check(pr, pf, kiln.tile.plan(256, 192, { tile = 64, overlap = 16, scale = 1 / 8 }))
    truthy(pp >= 40, "pool psnr " .. pp)
    truthy(b <= math.max(i, 1e-6), ("pool seam: border %g elsewhere %g"):format(b, i))
    note("avg-pool /8 (%s): PSNR %.1f, max diff border %.2g / elsewhere %.2g", dev, pp, b, i)
  end)
end

test("conv net (3x3, SiLU, 3x3, SiLU): PSNR >= 40 dB with overlap, feathered borders", function()
  local net = conv_net(4, 16, 4, 10, "cpu")
  local x = kiln.randn({ 1, 4, 96, 128 }, { seed = 11 })
  local full = net(x)
  -- control: abutting tiles show the zero padding at their edges as seams
  local o0 = { tile = 32, overlap = 0 }
  local r0 = kiln.tile.map(x, net, o0)
  local b0, i0 = seam_check(r0, full, kiln.tile.plan(96, 128, o0))
  truthy(b0 > 100 * math.max(i0, 1e-6), ("without overlap the border (%g) must be worse than elsewhere (%g)"):format(b0, i0))
  note("conv net, tile 32 overlap 0 (control): PSNR %.1f dB, max diff at tile borders %.3g / elsewhere %.3g", psnr(r0, full), b0, i0)
  -- the receptive field (2 px) still differs near tile edges, but feathering weighs
  -- those pixels down: the border error is a fraction of the control's
  for _, blend in ipairs({ "linear", "cosine" }) do
    local o = { tile = 32, overlap = 8, blend = blend }
    local r = kiln.tile.map(x, net, o)
    local p = psnr(r, full)
    local b, i = seam_check(r, full, kiln.tile.plan(96, 128, o))
    truthy(p >= 40, blend .. " psnr " .. p)
    truthy(b <= b0 / 4, ("%s: border %g not well below the control's %g"):format(blend, b, b0))
    note("conv net, tile 32 overlap 8 %s: PSNR %.1f dB, max diff at tile borders %.3g / elsewhere %.3g", blend, p, b, i)
  end
end)

-- ---------------------------------------------------------------- memory on sim

test("peak of a tiled map on sim does not grow with the image", function()
  local net = conv_net(4, 16, 4, 20, "sim")
  local extra = {}
  local line = {}
  for _, n in ipairs({ 96, 160, 224 }) do
    local x = kiln.randn({ 1, 4, n, n }, { seed = n }):to("sim")
    fresh("sim")
    local base = kiln.mem.stats("sim").allocated
    kiln.mem.reset_peak("sim")
    local r = kiln.tile.map(x, net, { tile = 64, overlap = 16 })
    local peak = kiln.mem.stats("sim").peak - base
    extra[#extra + 1] = peak - r:nbytes()
    local rb = r:nbytes()
    r:free()
    fresh("sim")
    base = kiln.mem.stats("sim").allocated
    kiln.mem.reset_peak("sim")
    local u = net(x)
    local upeak = kiln.mem.stats("sim").peak - base
    u:free(); x:free()
    line[#line + 1] = ("%dx%d: tiled %s (result %s + %s), untiled %s"):format(n, n, kiln.format_bytes(peak), kiln.format_bytes(rb),
      kiln.format_bytes(peak - rb), kiln.format_bytes(upeak))
  end
  note("peak over the input on sim, tile 64 overlap 16: %s", table.concat(line, "; "))
  -- 160 px takes 3 full tiles of 64; 96 px (2 tiles of 56) and 224 px (5 of 58) take
  -- shortened ones: the overhead is one tile's, never more than a full tile's
  truthy(extra[1] <= extra[2] and extra[3] <= extra[2], ("tile overhead %d, %d, %d"):format(extra[1], extra[2], extra[3]))
end)

test("OOM recovery: a sim budget forces exactly two halvings; same result as tiled up front", function()
  fresh("sim")
  -- fn's scratch grows with the tile: 512 channels of f32 per pixel (64x64: 8 MiB,
  -- 32x32: 2 MiB in a new segment, 16x16: 512 KiB in the segment already there)
  local calls = {}
  local function fn(t)
    calls[#calls + 1] = t.shape[3]
    local s <close> = kiln.zeros({ 1, 512, t.shape[3], t.shape[4] }, { device = "sim" })
    return t * 2
  end
  local x = kiln.randn({ 1, 4, 64, 64 }, { seed = 30 }):to("sim")
  local st = kiln.mem.stats("sim")
  local old_budget = st.budget
  kiln.mem.set_budget("sim", st.reserved + MiB)
  kiln.mem.reset_peak("sim")
  local seq = (function() local e = kiln.mem.events(); return #e > 0 and e[#e].seq or 0 end)()
  local ooms0 = kiln.mem.stats("sim").ooms
  local ok, r, info = pcall(function()
    local run = function(t)
      if not t then return fn(x) end
      return kiln.tile.map(x, fn, tiling.map_opts(t, 4, 1, 1))
    end
    return tiling.with_oom_retry(run, { size = 64, what = "test" })
  end)
  local marks = {}
  for _, e in ipairs(kiln.mem.events(seq)) do
    if e.kind == "mark" and e.owner == "tiling" then marks[#marks + 1] = e.detail end
  end
  local peak, budget = kiln.mem.stats("sim").peak, kiln.mem.stats("sim").budget
  kiln.mem.set_budget("sim", old_budget)
  truthy(ok, "retry failed: " .. tostring(r))
  eq(info.tile, 16, "final tile")
  eq(#info.attempts, 2, "failed attempts")
  eq(info.attempts[1].tile, nil); eq(info.attempts[2].tile, 32)
  eq(#marks, 2, "logged events")
  truthy(marks[1]:find("out of memory on sim untiled", 1, true) and marks[1]:find("retrying with tile 32", 1, true), marks[1])
  truthy(marks[2]:find("with tile 32", 1, true) and marks[2]:find("retrying with tile 16", 1, true), marks[2])
  truthy(kiln.mem.stats("sim").ooms > ooms0, "the budget was hit")
  truthy(peak <= budget, "peak within the budget")
  local up_front = kiln.tile.map(x, fn, tiling.map_opts(16, 4, 1, 1))
  eq(maxdiff(r, up_front), 0, "same as tiled up front")
  note("OOM retry on sim (budget reserved + 1 MiB): untiled -> tile 32 -> tile 16 succeeded; events: %s | %s", marks[1], marks[2])
  -- apply() does the same through its own options; a budget too small for the
  -- minimum tile gives up with the typed error
  kiln.mem.set_budget("sim", kiln.mem.stats("sim").reserved + MiB)
  local r2 = tiling.apply(fn, x, { overlap = 4, what = "apply" })
  eq(maxdiff(r2, up_front), 0, "apply: same result")
  kiln.mem.set_budget("sim", kiln.mem.stats("sim").reserved + 64 * KiB)
  local ok3, e3 = pcall(tiling.apply, function(t)
    local s <close> = kiln.zeros({ 1, 16384, t.shape[3], t.shape[4] }, { device = "sim" })
    return t * 2
  end, x, { overlap = 4, what = "apply" })
  kiln.mem.set_budget("sim", old_budget)
  truthy(not ok3 and type(e3) == "table" and e3.kind == "oom", "gives up with the OOM error: " .. tostring(e3))
  truthy(#calls >= 5, "calls")
end)

test("tile = \"auto\" under a tight sim budget: no OOM, peak <= budget", function()
  fresh("sim")
  local net = conv_net(4, 16, 4, 40, "sim")
  local n = 0
  local counted = function(t) n = n + 1; return net(t) end
  local x = kiln.randn({ 1, 4, 192, 192 }, { seed = 41 }):to("sim")
  local full = net(x)
  -- untiled: 16 channels at 192x192 = 2.25 MiB per intermediate
  fresh("sim")
  local base = kiln.mem.stats("sim").allocated
  local old = kiln.mem.stats("sim").budget
  local budget = base + 3 * MiB
  kiln.mem.set_budget("sim", budget)
  local ooms = kiln.mem.stats("sim").ooms
  local owner = {}
  kiln.mem.reset_peak("sim")
  local ok, tile, model = pcall(tiling.auto_tile, counted, x, { cache = owner, key = "net", multiple = 8 })
  local ok2, r = false, nil
  if ok then
    ok2, r = pcall(tiling.apply, counted, x, { tile = "auto", cache = owner, key = "net", overlap = 8, retry = false })
  end
  local st = kiln.mem.stats("sim")
  kiln.mem.set_budget("sim", old)
  truthy(ok, "auto_tile: " .. tostring(tile))
  truthy(ok2, "apply: " .. tostring(r))
  truthy(tile < 192, "auto tiled: " .. tile)
  eq(st.ooms, ooms, "no out-of-memory on the way")
  truthy(st.peak <= budget, ("peak %d > budget %d"):format(st.peak - base, budget - base))
  local p = psnr(r, full)
  truthy(p >= 40, "psnr " .. p)
  note("auto tile on sim, budget %s over the input: tile %d, peak %s, model %.0f + %.1f B/px, PSNR %.1f dB",
    kiln.format_bytes(budget - base), tile, kiln.format_bytes(st.peak - base), model.a, model.b, p)
  -- the fit is cached per owner and key: no more probes
  local before = n
  tiling.auto_tile(counted, x, { cache = owner, key = "net", multiple = 8 })
  eq(n, before, "cached")
end)

-- On cpu the allocator passes every request through, so the measured peak is the
-- demand; sim's caching allocator hands out large blocks in 2 MiB grains, which the
-- small probes cannot see: there the networks have tensors of several MiB.
test("kiln.mem.estimate is within 25% of the measured peak", function()
  local cases = {
    { "cpu", 4, 16, 4, 160 }, { "cpu", 3, 8, 3, 200 }, { "cpu", 4, 32, 8, 96 },
    { "sim", 4, 32, 4, 256 }, { "sim", 3, 16, 3, 320 },
  }
  for _, case in ipairs(cases) do
    local dev = case[1]
    local net = conv_net(case[2], case[3], case[4], 50, dev)
    local x = kiln.randn({ 1, case[2], case[5], case[5] }, { seed = 51 }):to(dev)
    local est, info = kiln.mem.estimate(net, x)
    fresh(dev)
    local base = kiln.mem.stats(dev).allocated
    kiln.mem.reset_peak(dev)
    local y = net(x)
    local real = kiln.mem.stats(dev).peak - base
    y:free()
    local err = math.abs(est - real) / real
    eq(info.method, "measured")
    truthy(err <= 0.25, ("%s: estimate %d, measured %d (%.1f%%)"):format(table.concat(case, "/"), est, real, 100 * err))
    note("estimate %s conv %d-%d-%d at %dx%d (probes 8/16/24): predicted %s, measured %s (%+.1f%%)", dev, case[2], case[3],
      case[4], case[5], case[5], kiln.format_bytes(est), kiln.format_bytes(real), 100 * (est - real) / real)
  end
  -- memory quadratic in the pixels (a materialized attention matrix): opts.quadratic
  local function attn_like(x)
    local L = x.shape[3] * x.shape[4]
    local s <close> = kiln.zeros({ 1, 1, L, L })
    return x * 2
  end
  local x = kiln.randn({ 1, 1, 40, 40 })
  local est, info = kiln.mem.estimate(attn_like, x, { quadratic = true, meta = false }) -- the probes' fit
  fresh("cpu")
  local base = kiln.mem.stats("cpu").allocated
  kiln.mem.reset_peak("cpu")
  attn_like(x):free()
  local real = kiln.mem.stats("cpu").peak - base
  truthy(info.c > 0, "quadratic term")
  truthy(math.abs(est - real) / real <= 0.25, ("quadratic: estimate %d, real %d"):format(est, real))
  note("estimate with quadratic = true, L x L scores at 40x40: predicted %s, measured %s", kiln.format_bytes(est), kiln.format_bytes(real))
  -- by default a dry run at the real size answers: exact
  local est2, info2 = kiln.mem.estimate(attn_like, x)
  eq(info2.method, "meta")
  eq(est2, real, "the dry run's peak")
  -- a small input is simply run: exact
  local net = conv_net(2, 4, 2, 60, "cpu")
  local _, info = kiln.mem.estimate(net, kiln.randn({ 1, 2, 8, 8 }))
  eq(info.method, "exact")
  raises(function() kiln.mem.estimate(42, kiln.randn({ 1, 2, 8, 8 })) end, "expected a function")
  raises(function() kiln.mem.estimate(net, { 1, 2 }) end, "no 4-d tensor")
end)

-- ---------------------------------------------------------------- MultiDiffusion

test("multidiffusion: tiled denoiser matches untiled; sampler runs with it", function()
  local net = conv_net(4, 16, 4, 70, "cpu")
  local function denoise(x, sigma)
    local y <close> = net(x)
    return x / (1 + sigma * sigma) + y * 0.1
  end
  local calls = 0
  local function counted(x, sigma) calls = calls + 1; return denoise(x, sigma) end
  local md = tiling.multidiffusion(counted, { tile = 32, overlap = 16 })
  local x = kiln.randn({ 1, 4, 80, 96 }, { seed = 71 })
  local a, b = md(x, 2.0), denoise(x, 2.0)
  truthy(calls > 1, "tiles: " .. calls)
  local p = psnr(a, b)
  truthy(p >= 40, "psnr " .. p)
  -- one tile or less: called as is
  calls = 0
  local small = kiln.randn({ 1, 4, 24, 32 }, { seed = 72 })
  eq(maxdiff(md(small, 1.0), denoise(small, 1.0)), 0)
  eq(calls, 1)
  -- a few Euler steps
  local sigmas = kiln.sample.sigmas("karras", 4, { sigma_min = 0.1, sigma_max = 10 })
  local xt = x * 10
  local s1 = kiln.sample.run("euler", md, xt, sigmas)
  local s2 = kiln.sample.run("euler", denoise, xt, sigmas)
  local ps = psnr(s1, s2)
  truthy(ps >= 40, "sampled psnr " .. ps)
  note("multidiffusion tile 32 overlap 16 on 80x96 latents: one call PSNR %.1f dB, 4 Euler steps PSNR %.1f dB", p, ps)
  raises(function() tiling.multidiffusion(denoise, { tile = 4 }) end, "tile must be an integer >= 8")
end)

-- ---------------------------------------------------------------- tiled VAE

-- A stand-in VAE with the interface tiling.decode/encode expect; like a real one it
-- spends most memory at image resolution: the decoder upsamples x8 (nearest) and
-- runs a conv net there, the encoder runs a conv net on the image and pools by 8.
local function fake_vae(dev)
  local dec, enc, pool = conv_net(4, 8, 3, 80, dev), conv_net(3, 8, 4, 90, dev), avg_pool8(4, dev)
  return {
    factor = 8,
    _decode_untiled = function(self, z)
      local u <close> = kiln.nn.upsample_nearest(z, 8)
      return dec(u)
    end,
    _encode_untiled = function(self, img)
      local h <close> = enc(img)
      return pool(h)
    end,
  }
end

test("tiled VAE decode / encode (stand-in VAE), tile = N and \"auto\"", function()
  local vae = fake_vae("sim")
  local z = kiln.randn({ 1, 4, 48, 40 }, { seed = 81 }):to("sim")
  local full = vae:_decode_untiled(z)
  local untiled = tiling.decode(vae, z)
  eq(maxdiff(untiled, full), 0, "no tile: untiled")
  local t = tiling.decode(vae, z, { tile = 16, overlap = 4 })
  eq(table.concat(t.shape, ","), "1,3,384,320")
  local p = psnr(t, full)
  truthy(p >= 40, "decode psnr " .. p)
  local img = kiln.rand({ 1, 3, 384, 320 }, { seed = 82 }):to("sim")
  local efull = vae:_encode_untiled(img)
  local e = tiling.encode(vae, img, { tile = 24, overlap = 8 })
  eq(table.concat(e.shape, ","), "1,4,48,40")
  local pe = psnr(e, efull)
  truthy(pe >= 40, "encode psnr " .. pe)
  -- auto under a budget that the untiled decode does not fit
  fresh("sim")
  local old = kiln.mem.stats("sim").budget
  local budget = kiln.mem.stats("sim").allocated + 6 * MiB
  kiln.mem.set_budget("sim", budget)
  local ooms = kiln.mem.stats("sim").ooms
  kiln.mem.reset_peak("sim")
  local ok, a, info = pcall(tiling.decode, vae, z, { tile = "auto", retry = false })
  local st = kiln.mem.stats("sim")
  kiln.mem.set_budget("sim", old)
  truthy(ok, "auto decode: " .. tostring(a))
  eq(st.ooms, ooms, "no OOM")
  truthy(st.peak <= budget, "peak within the budget")
  local pa = psnr(a, full)
  truthy(pa >= 40, "auto psnr " .. pa)
  local chosen = info.tile
  truthy(chosen and chosen < 48, "auto tiled: " .. tostring(chosen))
  note("stand-in VAE 48x40 latents: decode tile 16 PSNR %.1f dB, encode tile 24 PSNR %.1f dB, auto decode under %s: tile %d, PSNR %.1f dB",
    p, pe, kiln.format_bytes(6 * MiB), chosen, pa)
  raises(function() tiling.encode(vae, kiln.rand({ 1, 3, 60, 64 }), { tile = 8 }) end, "not a multiple of 8")
  raises(function() tiling.decode(vae, z, { tile = 0 }) end, "tile must be a positive integer")
end)

for _, line in ipairs(report) do print("  " .. line) end
H.done()
