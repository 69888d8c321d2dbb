-- kiln.tiling: staying inside the memory budget by working in tiles. Built on
-- kiln.tile.map (the C tile primitive: overlapping tiles, feathered blending, one
-- tile's intermediates alive at a time).
--
--   tiling.decode(vae, z [, opts]) -> img, info   tiled / auto-tiled / OOM-recovering
--                                      VAE decode (info.tile: the tile used, nil untiled)
--   tiling.encode(vae, img [, opts]) -> z, info   the same for the encoder
--   tiling.apply(fn, x, opts) -> y, info   the same for any network fn(x) -> y whose
--                                      output is `scale` times the input (upscalers: 4)
--   tiling.with_oom_retry(run, opts)   run(nil) untiled; on OOM run(tile) halving
--   tiling.multidiffusion(denoise, opts)  denoise(x, sigma, ...) over blended tiles
--   tiling.auto_tile(fn, x, opts)      the largest tile that fits the free budget
--   tiling.estimate(fn, inputs, opts)  = kiln.mem.estimate: a peak predicted from
--                                      small measured probes
--
-- The VAE interface. `vae` is any object with
--   vae:_decode_untiled(z)   latents [B, c, h, w] -> images [B, C, f*h, f*w]
--   vae:_decode_tiles(z, map_opts), vae:_encode_tiles(img, map_opts)  (optional) a
--                            tiled run done its own way (kiln.vae's: image-wide
--                            GroupNorm statistics, kiln.lockstep)
--   vae:_encode_untiled(img) images [B, C, H, W] (H, W multiples of f) -> latents
--                            [B, c, H/f, W/f]
--   vae.factor or vae.config.factor   f, the spatial factor (default 8)
-- and vae:decode(z, opts) is expected to be `return tiling.decode(self, z, opts)`.
-- opts (sizes in latent units, as vae:decode / vae:encode take them):
--   tile     nil: untiled, and on an out-of-memory error retried tiled from half the
--            latent size, halving until it fits or min_tile is reached;
--            an integer: tiled (and halved likewise on OOM); "auto": chosen from the
--            free budget of the device with the network's measured per-pixel cost
--   overlap  default 8 (tile/4 instead when 2*overlap >= tile, as for the smaller
--            tiles a retry picks)
--   blend    "cosine" (default for decode / encode: it gives the pixels next to a
--            tile's inner edge, where zero padding distorts the network, almost no
--            weight: +15 dB on the demo VAE) or "linear" (apply's default);
--            min_tile  default 8
--   retry    false: an OOM is raised as is (no tiled retry)
--
-- Every OOM retry is logged to stderr (unless kiln.quiet()) and as a "mark" event
-- with owner "tiling" in kiln.mem.events (and the trace when one runs).
--
-- Measuring. tile = "auto" first dry-runs the whole map on the meta device at the
-- real size (kiln.dry_run.peak_of: the candidate tiles by bisection, each run exactly
-- as it would run, the VAE's lockstep tiles included) and takes the largest tile whose
-- predicted peak fits; only where no dry run can answer (inside a dry run, a build
-- without meta) does it measure. Measuring (and kiln.mem.estimate's fallback) runs the
-- network on small crops of the real input (probes, default 8, 16 and 24 pixels of the
-- input's grid) on the target device, read the peak of kiln.mem.stats around each run and fit
-- peak(px) = a + b*px (+ c*px^2 with opts.quadratic) over the probes' pixel counts;
-- the prediction for the full size is that fit, never below the largest probe.
-- This is measured-and-extrapolated, not computed from shapes: it sees what the
-- kernels really allocate on this device (workspaces, casts, the allocator's
-- rounding) at the cost of running a few small probes once. One blind spot: a
-- caching allocator (sim, cuda) hands out blocks over 1 MiB in 2 MiB grains, which
-- probes with smaller tensors do not see; relative to tensors of tens of MiB (any
-- real VAE or UNet stage) that is a few percent. Probes reset the
-- device's peak counter (kiln.mem.reset_peak). auto_tile caches the fit per vae
-- (or opts.cache object), stage, device, batch, channels, dtype and the device's
-- activation dtype (kiln.activation_dtype: the precision changes a network's cost).
local kiln = require "kiln"
local util = require "kiln.util"

local M = {}
local fmt = string.format

local is_oom = util.is_oom

-- an OOM error from an older runtime may lack a field: "?" rather than a crash
local function human(b) return b == nil and "?" or kiln.format_bytes(b) end

-- Logs a tiling event: stderr (unless quiet) and the event log / trace.
local function log_event(detail)
  if kiln.trace and kiln.trace.mark then pcall(kiln.trace.mark, "tiling", detail) end
  if not (kiln.quiet and kiln.quiet()) then io.stderr:write("kiln: ", detail, "\n") end
end
M.log_event = log_event

local function factor_of(vae)
  local f = vae.factor or (vae.config and vae.config.factor) or 8
  f = math.tointeger(f) or f -- 2^(levels-1) is a float
  if math.type(f) ~= "integer" or f < 1 then error(fmt("tiling: vae factor must be a positive integer, got %s", tostring(f)), 3) end
  return f
end

-- ---------------------------------------------------------------- measuring

local function is_tensor(v)
  local mt = type(v) == "userdata" and getmetatable(v)
  return type(mt) == "table" and mt.__name == "kiln.Tensor"
end

-- Peak bytes allocated on dev while f() runs, above what was allocated before; the
-- value f returns (a tensor or nothing) is freed after the reading.
local function measure_peak(dev, f)
  collectgarbage(); collectgarbage()
  local base = kiln.mem.stats(dev).allocated
  kiln.mem.reset_peak(dev)
  local r = f()
  local peak = kiln.mem.stats(dev).peak
  if is_tensor(r) then r:free() end
  collectgarbage()
  return math.max(0, peak - base), r
end

-- Least-squares fit of y = a + b*x (+ c*x^2) with nonnegative terms.
local function fit(points, quadratic)
  local n = #points
  if n == 1 then
    local p = points[1]
    return { a = 0, b = p.peak / math.max(p.px, 1), c = 0 }
  end
  if quadratic and n >= 3 then
    -- normal equations of [1 x x^2] (x scaled for conditioning)
    local s = points[n].px
    local S = {}
    for i = 0, 4 do S[i] = 0 end
    local T = { [0] = 0, 0, 0 }
    for _, p in ipairs(points) do
      local x = p.px / s
      for i = 0, 4 do S[i] = S[i] + x ^ i end
      for i = 0, 2 do T[i] = T[i] + p.peak * x ^ i end
    end
    local A = { { S[0], S[1], S[2], T[0] }, { S[1], S[2], S[3], T[1] }, { S[2], S[3], S[4], T[2] } }
    for c = 1, 3 do
      local piv = c
      for r = c + 1, 3 do if math.abs(A[r][c]) > math.abs(A[piv][c]) then piv = r end end
      A[c], A[piv] = A[piv], A[c]
      for r = 1, 3 do
        if r ~= c and A[c][c] ~= 0 then
          local k = A[r][c] / A[c][c]
          for j = c, 4 do A[r][j] = A[r][j] - k * A[c][j] end
        end
      end
    end
    local a, b, c = A[1][4] / A[1][1], A[2][4] / A[2][2] / s, A[3][4] / A[3][3] / (s * s)
    if a < 0 and a > -0.01 * points[1].peak then a = 0 end -- rounding around a true 0
    if a >= 0 and b >= 0 and c >= 0 then return { a = a, b = b, c = c } end
    if a < 0 then -- through the origin: least squares of [x x^2]
      local s11, s12, s22, t1, t2 = 0, 0, 0, 0, 0
      for _, p in ipairs(points) do
        local x = p.px / s
        s11, s12, s22 = s11 + x * x, s12 + x ^ 3, s22 + x ^ 4
        t1, t2 = t1 + p.peak * x, t2 + p.peak * x * x
      end
      local d = s11 * s22 - s12 * s12
      if d > 0 then
        b, c = (t1 * s22 - t2 * s12) / d / s, (s11 * t2 - s12 * t1) / d / (s * s)
        if b >= 0 and c >= 0 then return { a = 0, b = b, c = c } end
      end
    end
  end
  local sx, sy, sxx, sxy = 0, 0, 0, 0
  for _, p in ipairs(points) do
    sx, sy, sxx, sxy = sx + p.px, sy + p.peak, sxx + p.px * p.px, sxy + p.px * p.peak
  end
  local d = n * sxx - sx * sx
  local b = d > 0 and (n * sxy - sx * sy) / d or 0
  local a = (sy - b * sx) / n
  if b < 0 then b = 0; a = sy / n end
  if a < 0 then -- through the origin
    a = 0
    b = sxy / sxx
  end
  return { a = a, b = b, c = 0 }
end

local function predict(m, px) return m.a + m.b * px + (m.c or 0) * px * px end
M.predict = predict

-- The inputs of an estimate as a list, and which are spatial (4-d tensors).
local function input_list(inputs)
  if type(inputs) == "userdata" then return { inputs, n = 1 } end
  if type(inputs) ~= "table" then error("kiln.mem.estimate: inputs must be a tensor or a list of arguments", 3) end
  local l = { n = inputs.n or #inputs }
  for i = 1, l.n do l[i] = inputs[i] end
  return l
end


-- Measures fn on probes of the inputs and fits the model. Returns the model with
-- .probes and .px (the full size's pixels of the first spatial input).
-- opts: device, probes (edges in units of the first spatial input), multiple (probe
-- edges are multiples of it; default 8), quadratic.
function M.measure(fn, inputs, opts)
  opts = opts or {}
  if type(fn) ~= "function" and not (getmetatable(fn) or {}).__call then
    error("kiln.mem.estimate: expected a function (or a callable) as the first argument", 2)
  end
  local args = input_list(inputs)
  local ref, dev
  for i = 1, args.n do
    local v = args[i]
    if is_tensor(v) then
      dev = dev or v.device
      if not ref and #v.shape == 4 then ref = v end
    end
  end
  dev = opts.device or dev or kiln.default_device()
  if not ref then error("kiln.mem.estimate: no 4-d tensor [B, C, H, W] among the inputs to scale", 2) end
  local H, W = ref.shape[3], ref.shape[4]
  local mult = opts.multiple or 8
  local sizes = {}
  for _, p in ipairs(opts.probes or { 8, 16, 24 }) do
    if math.type(p) ~= "integer" or p < 1 then error("kiln.mem.estimate: probes must be positive integers", 2) end
    p = math.max(mult, p - p % mult)
    sizes[#sizes + 1] = p
  end
  table.sort(sizes)
  local points, seen = {}, {}
  local exact = false
  for _, p in ipairs(sizes) do
    local ph, pw = math.min(p, H), math.min(p, W)
    local key = ph .. "x" .. pw
    if not seen[key] then
      seen[key] = true
      -- crops of every spatial input in proportion to its size
      local call = { n = args.n }
      for i = 1, args.n do
        local v = args[i]
        if is_tensor(v) and #v.shape == 4 and (v.shape[3] ~= 1 or v.shape[4] ~= 1) then
          local h = math.max(1, v.shape[3] * ph // H)
          local w = math.max(1, v.shape[4] * pw // W)
          call[i] = (h == v.shape[3] and w == v.shape[4]) and v or v:narrow(3, 1, h):narrow(4, 1, w):contiguous()
        else
          call[i] = v
        end
      end
      local ok, peak = pcall(measure_peak, dev, function() return fn(table.unpack(call, 1, call.n)) end)
      for i = 1, args.n do
        if call[i] ~= args[i] and is_tensor(call[i]) then call[i]:free() end
      end
      if not ok then
        if is_oom(peak) and #points > 0 then break end -- use the probes that fit
        error(peak, 0)
      end
      points[#points + 1] = { h = ph, w = pw, px = ph * pw, peak = peak }
      if ph == H and pw == W then exact = true; break end
    end
  end
  local m = fit(points, opts.quadratic)
  m.probes, m.px, m.device, m.exact = points, H * W, dev, exact
  if exact then m.full = points[#points].peak end
  return m
end

-- kiln.mem.estimate(fn, inputs [, opts]) -> bytes, details
-- The peak bytes fn(inputs...) adds on the device (its intermediates and output),
-- predicted from small measured probes (see the top of this file); details has the
-- fit (a, b, c), the probes ({h, w, px, peak}) and method "meta" (a dry run at the
-- real size: exact; no probes), "measured" or "exact" (the input was no larger than a
-- probe, so it was run as is), and activation_dtype:
-- the dtype the networks kept their activations in on the device while measured
-- (kiln.activation_dtype: f16 / bf16 on a GPU under a half precision, which halves
-- what they allocate; a precision changed afterwards needs a new estimate).
function M.estimate(fn, inputs, opts)
  -- exact where a dry run can answer (the inputs' real size on the shape-only device);
  -- probes where it cannot (fn reads weights already resident on the device)
  if not (opts and (opts.probes or opts.meta == false)) then
    local args = input_list(inputs)
    local dev = opts and opts.device
    for i = 1, args.n do dev = dev or (is_tensor(args[i]) and args[i].device) or nil end
    dev = dev or kiln.default_device()
    local bytes = require("kiln.dry_run").peak_of(fn, args, dev)
    if bytes then
      return bytes, { device = dev, method = "meta", activation_dtype = kiln.activation_dtype(dev),
        probes = {}, a = 0, b = 0, c = 0 }
    end
  end
  local m = M.measure(fn, inputs, opts)
  local bytes
  if m.exact then bytes = m.full
  else bytes = math.max(predict(m, m.px), m.probes[#m.probes].peak) end
  bytes = math.floor(bytes + 0.5)
  return bytes, { a = m.a, b = m.b, c = m.c, probes = m.probes, px = m.px, device = m.device,
    method = m.exact and "exact" or "measured", activation_dtype = kiln.activation_dtype(m.device) }
end
kiln._register_hook("mem_estimate", M.estimate) -- kiln.mem.estimate calls it

-- ---------------------------------------------------------------- auto tile

-- The kiln.tile.map options for a tile of t units.
local function map_opts(t, overlap, unit, scale, blend)
  local o = overlap
  if 2 * o >= t then o = t // 4 end
  return { tile = t * unit, overlap = o * unit, scale = scale, multiple = unit, blend = blend }
end
M.map_opts = map_opts

local cache = setmetatable({}, { __mode = "k" })

-- Bytes of the result of a map over x with scale s and a probe's output.
local function result_bytes(x, probe_out_bytes_per_px, scale)
  local n = x.shape[3] * x.shape[4] * scale * scale * probe_out_bytes_per_px
  -- a large block occupies whole 2 MiB grains of the allocator
  if n > 1024 * 1024 then n = math.ceil(n / (2 * 1024 * 1024)) * 2 * 1024 * 1024 end
  return n
end

-- Free bytes of a device's budget now (math.huge when it has none).
local function free_bytes(dev)
  local s = kiln.mem.stats(dev)
  if not s.budget or s.budget == 0 then return math.huge end
  return s.budget - s.allocated
end
M.free_bytes = free_bytes

-- The largest tile (units) whose whole map over x peaks within plan bytes, each
-- candidate's peak from a dry run of the map at the real size (exact: the result, the
-- tile copies, the blend, what the network allocates, its weights' residency as it
-- is); nil where a dry run cannot answer (inside a dry run, no meta device), and the
-- probes decide. A tiled run of the caller's own (the VAE's lockstep tiles, with
-- image-wide GroupNorm statistics) is replayed on meta through opts.tiled_x(x, mo).
-- m.need is the predicted peak of the chosen tile's run (bytes above what was
-- allocated before it).
local function meta_tile(fn, x, opts, dev, plan, size, mult)
  if opts.tiled and not opts.tiled_x then return nil end
  local dry = require "kiln.dry_run"
  local unit, scale = opts.unit or 1, opts.scale or 1
  local function need(t)
    return dry.peak_of(function(xx)
      local r
      if t >= size then r = fn(xx) -- one tile: apply runs it untiled
      else
        local mo = map_opts(t, opts.overlap or 8, unit, scale, opts.blend)
        if opts.tiled_x then r = opts.tiled_x(xx, mo) else r = kiln.tile.map(xx, fn, mo) end
      end
      if r and r.free then r:free() end
    end, { x, n = 1 }, dev)
  end
  local full = need(size)
  if not full then return nil end
  local m = { method = "meta", device = dev, full = full, need = full }
  if full <= plan then return size, m end
  local min_tile = opts.min_tile or 8
  local lo, hi = 0, (size - 1) // mult -- in multiples of mult: lo fits (or is the floor), hi not known to
  local needs = {}
  while lo < hi do
    local mid = (lo + hi + 1) // 2
    local t = math.max(mid * mult, min_tile)
    local b = need(t)
    if not b then return nil end
    needs[t] = b
    if b <= plan then lo = mid else hi = mid - 1 end
  end
  local t = math.max(lo * mult, min_tile)
  m.need = needs[t] or need(t)
  return t, m
end

-- tiling.auto_tile(fn, x, opts) -> tile (units), model
-- The largest tile whose map over x fits what is free on x's device. opts: scale
-- (output/input), unit (input pixels per tile unit), min_tile, multiple (units),
-- probes (units), safety (fraction of the free bytes to plan with, 0.85), cache
-- (an object to cache the measured fit under, weakly) and key (a string naming the
-- stage), overlap (units).
function M.auto_tile(fn, x, opts)
  opts = opts or {}
  local unit, scale = opts.unit or 1, opts.scale or 1
  local dev = x.device
  local H, W = x.shape[3] // unit, x.shape[4] // unit
  local size = math.max(H, W)
  local free = free_bytes(dev)
  if free == math.huge then return size, nil end -- no budget: nothing to fit
  local mult = opts.multiple or 8
  -- the activations' dtype too: a network's cost halves under a half precision on a GPU
  local key = fmt("%s|%s|%d|%d|%s|%s", opts.key or "fn", dev, x.shape[1], x.shape[2], x.dtype,
    kiln.activation_dtype(dev))
  local owner = opts.cache
  local m = owner and cache[owner] and cache[owner][key]
  -- first a dry run at the real size (exact), unless a fit is cached already
  if not m and not opts.probes and opts.meta ~= false then
    local t, mm = meta_tile(fn, x, opts, dev, free * (opts.safety or 0.85), size, mult)
    if t then return t, mm end
  end
  if not m then
    -- probe: a one-tile map of a crop, so the tile input copy and the blend count too
    local function probe_fn(crop)
      local t = math.max(crop.shape[3], crop.shape[4])
      return kiln.tile.map(crop, fn, { tile = t, overlap = 0, scale = scale, multiple = unit })
    end
    local probes = {}
    for i, p in ipairs(opts.probes or { 8, 16, 24 }) do probes[i] = p * unit end
    m = M.measure(probe_fn, { x }, { probes = probes, multiple = unit * math.min(mult, 8), device = dev })
    -- output bytes per output pixel, from the smallest probe's shape
    local first = m.probes[1]
    local crop = x:narrow(3, 1, first.h):narrow(4, 1, first.w):contiguous()
    local out = probe_fn(crop)
    m.out_bytes_per_px = out:nbytes() / (out.shape[3] * out.shape[4])
    out:free(); crop:free()
    if owner then
      cache[owner] = cache[owner] or {}
      cache[owner][key] = m
    end
  end
  local plan = free * (opts.safety or 0.85)
  if predict(m, H * W * unit * unit) <= plan then return size, m end -- fits untiled
  local avail = plan - result_bytes(x, m.out_bytes_per_px, scale)
  local min_tile = opts.min_tile or 8
  local t = size - size % mult
  if t == size then t = t - mult end
  while t > min_tile do
    if predict(m, math.min(t, H) * math.min(t, W) * unit * unit) <= avail then break end
    t = t - mult
  end
  return math.max(t, min_tile), m
end

-- Forgets the measured fits of an object (after its weights changed device/dtype).
function M.forget(owner) cache[owner] = nil end

-- ---------------------------------------------------------------- OOM recovery

-- tiling.with_oom_retry(run, opts) -> result, info
-- run(tile) computes the result untiled when tile is nil, else tiled with that tile
-- (in the caller's units). The first call uses opts.tile (nil: untiled). When it
-- raises the typed OOM error, the tile is halved (from opts.size, the largest
-- spatial size in units, for an untiled first try) and run again, until a call
-- succeeds or the tile would fall below opts.min_tile (default 8): then the last OOM
-- error is raised. Every retry is logged (see log_event). info = {tile = the tile
-- that succeeded (nil: untiled), attempts = {{tile =, error =}, ...}}.
function M.with_oom_retry(run, opts)
  opts = opts or {}
  local what = opts.what or "tiled run"
  local min_tile = opts.min_tile or 8
  local tile = opts.tile
  local info = { attempts = {} }
  while true do
    local ok, r = pcall(run, tile)
    if ok then
      info.tile = tile
      return r, info
    end
    if not is_oom(r) then error(r, 0) end
    info.attempts[#info.attempts + 1] = { tile = tile, error = r }
    local from = (math.type(tile) == "integer" and tile) or opts.size
    if not from then error(r, 0) end
    if from <= min_tile then
      log_event(fmt("%s: out of memory on %s with tile %d (requested %s, free %s); the minimum tile is %d: giving up",
        what, tostring(r.device), from, human(r.requested), human(r.free), min_tile))
      error(r, 0)
    end
    local nxt = math.max(from // 2, min_tile)
    log_event(fmt("%s: out of memory on %s %s (requested %s, free %s of budget %s); retrying with tile %d",
      what, tostring(r.device), tile and ("with tile " .. tile) or "untiled", human(r.requested), human(r.free),
      r.budget and r.budget > 0 and human(r.budget) or "unlimited", nxt))
    collectgarbage(); collectgarbage() -- what the failed attempt left
    tile = nxt
  end
end

-- ---------------------------------------------------------------- tiled runs


-- tiling.apply(fn, x, opts) -> y, info
-- info = {tile = the tile used (units; nil: untiled), attempts = failed tries}.
-- fn(x) -> y untiled (y's spatial size = x's times opts.scale); opts: scale, unit
-- (input pixels per tile unit: 8 for an encoder whose tiles are given in latent
-- units), tile (units, nil or "auto"), overlap (units, default 8), blend, min_tile,
-- retry (default true), what (label for logs), cache / key (auto's fit cache),
-- tiled (a function(map_opts) -> y doing a tiled run its own way; default
-- kiln.tile.map(x, fn, map_opts)), tiled_x (the same over a given input,
-- function(x, map_opts) -> y: tile = "auto" dry-runs it on meta; without it a `tiled`
-- run's tile is chosen by the probes).
function M.apply(fn, x, opts)
  opts = opts or {}
  local unit, scale = opts.unit or 1, opts.scale or 1
  local what = opts.what or "tiling.apply"
  if type(x) ~= "userdata" or #x.shape ~= 4 then error(what .. ": expected a 4-d tensor [B, C, H, W]", 2) end
  local tile, overlap = opts.tile, opts.overlap or 8
  if tile ~= nil and tile ~= "auto" and (math.type(tile) ~= "integer" or tile < 1) then
    error(fmt("%s: tile must be a positive integer (units of %d px) or \"auto\", got %s", what, unit, tostring(tile)), 2)
  end
  if math.type(overlap) ~= "integer" or overlap < 0 then
    error(fmt("%s: overlap must be an integer >= 0, got %s", what, tostring(overlap)), 2)
  end
  if x.shape[3] % unit ~= 0 or x.shape[4] % unit ~= 0 then
    error(fmt("%s: input %s is not a multiple of %d", what, util.shape_str(x), unit), 2)
  end
  local size = math.max(x.shape[3], x.shape[4]) // unit
  if tile == "auto" then
    tile = M.auto_tile(fn, x, { scale = scale, unit = unit, min_tile = opts.min_tile, cache = opts.cache,
      key = opts.key or what, overlap = overlap, blend = opts.blend, tiled = opts.tiled, tiled_x = opts.tiled_x })
  end
  if tile and tile >= size then tile = nil end -- one tile: run it untiled
  local function run(t)
    if not t then return fn(x) end
    if t >= size then return fn(x) end
    local mo = map_opts(t, overlap, unit, scale, opts.blend)
    if opts.tiled then return opts.tiled(mo) end
    -- each tile starts at a suspend point (a park, a lowered budget); a network run
    -- by the tiles has its own between blocks
    return kiln.tile.map(x, function(tx) kiln.suspend_point(); return fn(tx) end, mo)
  end
  if opts.retry == false then return run(tile), { tile = tile, attempts = {} } end
  return M.with_oom_retry(run, { tile = tile, size = size, min_tile = opts.min_tile, what = what })
end

-- M.apply's options for a VAE stage: the caller's, with the stage's scale and tile
-- unit, the VAE as the owner of the measured fit, cosine blending by default, and
-- the VAE's own tiled run when it has one (tiled(map_opts)).
local function vae_opts(vae, opts, key, scale, unit, tiled_x, x)
  local o = {}
  for k, v in pairs(opts or {}) do o[k] = v end
  o.scale, o.unit, o.cache, o.key = scale, unit, vae, key
  o.what = o.what or ("vae:" .. key)
  o.blend = o.blend or "cosine"
  -- the tiled run over x, and over any input (tile = "auto" replays it on meta)
  o.tiled_x = tiled_x
  o.tiled = tiled_x and function(mo) return tiled_x(x, mo) end
  return o
end

function M.decode(vae, z, opts)
  local f = factor_of(vae)
  local mid = (opts or {}).mid
  local tiled_x = vae._decode_tiles and function(zz, mo) return vae:_decode_tiles(zz, mo, mid) end
  return M.apply(function(t) return vae:_decode_untiled(t) end, z, vae_opts(vae, opts, "decode", f, 1, tiled_x, z))
end

function M.encode(vae, img, opts)
  local f = factor_of(vae)
  local tiled_x = vae._encode_tiles and function(xx, mo) return vae:_encode_tiles(xx, mo) end
  return M.apply(function(t) return vae:_encode_untiled(t) end, img,
    vae_opts(vae, opts, "encode", 1 / f, f, tiled_x, img))
end

-- ---------------------------------------------------------------- MultiDiffusion

-- tiling.multidiffusion(denoise, opts) -> denoise'
-- Wraps a denoiser denoise(x, sigma, ...) -> x0 so that each call denoises
-- overlapping latent tiles of x and blends them with feathered weights
-- (MultiDiffusion, Bar-Tal et al. 2023, with feathering in place of the plain
-- average), so a sampler step over a latent larger than the budget allows needs
-- memory for one tile only. opts (latent units): tile (default 64, or "auto"),
-- overlap (default 16), blend (default "cosine"), multiple (tile edges, default 8
-- for the UNet's three downsamplings). Extra arguments of denoise are passed to
-- every tile unchanged (conditioning is not spatial). A latent no larger than one
-- tile is denoised as is. opts.tileable ("x" | "y" | "xy", the UNet's own mode for
-- the untiled case): the tiles wrap around on those axes (kiln.seamless.map: border
-- tiles take their context from the other side; the UNet pads them with zeros).
function M.multidiffusion(denoise, opts)
  opts = opts or {}
  local seamless = require "kiln.seamless"
  local wrap = seamless.check(opts.tileable, "tiling.multidiffusion: tileable")
  local tile, overlap = opts.tile or 64, opts.overlap or 16
  if tile ~= "auto" and (math.type(tile) ~= "integer" or tile < 8) then
    error(fmt("tiling.multidiffusion: tile must be an integer >= 8 (latent units) or \"auto\", got %s", tostring(tile)), 2)
  end
  if math.type(overlap) ~= "integer" or overlap < 0 or (tile ~= "auto" and overlap >= tile) then
    error(fmt("tiling.multidiffusion: overlap must be an integer in [0, tile), got %s", tostring(overlap)), 2)
  end
  local mult = opts.multiple or 8
  local owner = {} -- auto's cache for this wrapper
  return function(x, sigma, ...)
    local extra = table.pack(...)
    local function one(t) return denoise(t, sigma, table.unpack(extra, 1, extra.n)) end
    local t = tile
    if t == "auto" then
      t = M.auto_tile(one, x, { scale = 1, unit = 1, multiple = mult, min_tile = mult, cache = owner, key = "denoise" })
    end
    if x.shape[3] <= t and x.shape[4] <= t then return denoise(x, sigma, ...) end
    local o = overlap
    if o >= t then o = t // 4 end
    local mo = { tile = t, overlap = o, scale = 1, multiple = mult, blend = opts.blend or "cosine" }
    if wrap then return seamless.map(x, one, mo, wrap, seamless.margin(o, mult)) end
    return kiln.tile.map(x, one, mo)
  end
end

return M
