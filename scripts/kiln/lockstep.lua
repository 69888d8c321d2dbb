-- kiln.lockstep: running a network over the tiles of a picture in lockstep, so that
-- its GroupNorm layers normalize every tile with the statistics of the WHOLE
-- picture, as the untiled network does, while the device holds one tile at a time.
--
-- Why: a GroupNorm normalizes with per-group means and variances over the whole
-- image. A tile that normalizes with its own statistics changes colour (a dark tile
-- is brightened: seams), and statistics estimated on a scaled-down picture differ
-- from the real ones enough to cost ~15 dB of PSNR on a VAE decode. The exact
-- statistics of layer k depend on every pixel of layer k-1, so the tiles must
-- advance together: every tile runs up to its next GroupNorm and stops there
-- (a coroutine yields), reporting the statistics of its core (the part of the tile
-- that is its own in the blend: overlaps split in the middle); the partial
-- statistics are merged (Chan et al.'s pairwise formula: no cancellation), and
-- every tile continues with the image-wide ones.
--
-- Memory: while a tile waits, its live tensors (the GroupNorm input and what the
-- network keeps across it, e.g. a ResBlock's skip) are parked on the host
-- (t:move("cpu")), so the device holds one tile's working set. The host holds the
-- parked tiles - about the size of the activations of the untiled run (when the
-- device IS the cpu that is no saving, only the tile-sized working buffers).
--
-- Protocol with the network: its GroupNorm calls ctx.sync(x, live...) (a network
-- in lockstep mode; see VAE:_gn) which returns {mean = [B, G, 1], var = [B, G, 1]}
-- on x's device to normalize x with (biased variance, as GroupNorm's). Every tile
-- must reach the same GroupNorms in the same order (one network, same code path).
--
--   lockstep.cores(plan)                      -> per tile {y0, y1, x0, x1} (input units,
--                                                relative to the tile, half-open)
--   lockstep.stage(states, fn, ctx)           -> runs fn(state) for every tile
local kiln = require "kiln"

local M = {}
local fmt = string.format
local HOST = "cpu"

-- The part of each tile of a kiln.tile.plan that is its own: overlaps with a
-- neighbour are split in the middle, so the cores partition the input exactly.
function M.cores(plan)
  local function axis(key, len)
    local starts, seen = {}, {}
    for i = 1, plan.count do
      local r = plan[i].input
      if not seen[r[key]] then
        seen[r[key]] = r[len]
        starts[#starts + 1] = r[key]
      end
    end
    table.sort(starts)
    local cut = {}
    for k, s in ipairs(starts) do
      local e = s + seen[s]
      local a = k == 1 and s or (starts[k - 1] + seen[starts[k - 1]] + s) // 2
      local b = k == #starts and e or (e + starts[k + 1]) // 2
      cut[s] = { a - s, b - s }
    end
    return cut
  end
  local cy, cx = axis("y", "h"), axis("x", "w")
  local cores = {}
  for i = 1, plan.count do
    local r = plan[i].input
    local y, x = cy[r.y], cx[r.x]
    cores[i] = { y0 = y[1], y1 = y[2], x0 = x[1], x1 = x[2], h = r.h, w = r.w }
  end
  return cores
end

-- Per-(sample, group) mean, biased variance and count of x [B, C, h, w] over a core
-- given in tile input units (the tile's input is core.h x core.w; x may be at another
-- resolution: the core scales with it).
local function core_stats(x, core, groups)
  local ry, rx = x.shape[3] / core.h, x.shape[4] / core.w
  local y0, y1 = math.floor(core.y0 * ry + 0.5), math.floor(core.y1 * ry + 0.5)
  local x0, x1 = math.floor(core.x0 * rx + 0.5), math.floor(core.x1 * rx + 0.5)
  local a = x:narrow(3, y0 + 1, y1 - y0)
  local b = a:narrow(4, x0 + 1, x1 - x0)
  local c = b:contiguous()
  b:free(); a:free()
  local B = c.shape[1]
  local g = c:reshape({ B, groups, -1 })
  local n = g.shape[3]
  local m, v = g:mean(3), g:var(3, false, false)
  local mt, vt = m:table(), v:table()
  g:free(); c:free(); m:free(); v:free()
  return { n = n, mean = mt, var = vt }
end

-- Merges partial statistics: Chan, Golub & LeVeque's pairwise update, in doubles.
local function merge(acc, s)
  if not acc then
    local m2 = {}
    for b = 1, #s.var do
      m2[b] = {}
      for g = 1, #s.var[b] do m2[b][g] = s.var[b][g] * s.n end
    end
    return { n = s.n, mean = s.mean, m2 = m2 }
  end
  local n = acc.n + s.n
  for b = 1, #s.mean do
    for g = 1, #s.mean[b] do
      local d = s.mean[b][g] - acc.mean[b][g]
      acc.mean[b][g] = acc.mean[b][g] + d * s.n / n
      acc.m2[b][g] = acc.m2[b][g] + s.var[b][g] * s.n + d * d * acc.n * s.n / n
    end
  end
  acc.n = n
  return acc
end

local function finish(acc, dev)
  local mean, var = {}, {}
  for b = 1, #acc.mean do
    mean[b], var[b] = {}, {}
    for g = 1, #acc.mean[b] do
      mean[b][g] = { acc.mean[b][g] }
      var[b][g] = { acc.m2[b][g] / acc.n }
    end
  end
  local m, v = kiln.tensor(mean), kiln.tensor(var)
  if dev ~= m.device then m:move(dev); v:move(dev) end
  return { mean = m, var = v }
end

local function park(list, dev)
  for _, t in ipairs(list) do t:move(dev) end
end

-- lockstep.stage(states, fn, ctx) -> states'
-- states[i]: tile i's input (a tensor on the host); fn(x) -> y runs the network
-- stage on one tile (on ctx.device) and may call ctx.sync(x, ...) at each GroupNorm.
-- Returns the outputs, parked on the host; the inputs are freed. ctx: device,
-- cores (lockstep.cores), groups (32), label (for errors).
function M.stage(states, fn, ctx)
  local dev, groups = ctx.device, ctx.groups or 32
  local n = #states
  local cos, parked, outs = {}, {}, {}
  local cur -- the tile running now
  ctx.sync = function(x, ...)
    local s = core_stats(x, ctx.cores[cur], groups)
    return coroutine.yield(s, { x, ... })
  end
  local function cleanup()
    for i = 1, n do
      if parked[i] then for _, t in ipairs(parked[i]) do pcall(t.free, t) end end
      if outs[i] then outs[i]:free() end
    end
  end
  for i = 1, n do cos[i] = coroutine.create(fn) end
  local stats, round = nil, 0
  -- one round: every unfinished tile runs to its next GroupNorm (or its end)
  local function run_round()
    local acc, live, dead = nil, 0, 0
    round = round + 1
    for i = 1, n do
      if coroutine.status(cos[i]) ~= "dead" then
        cur = i
        local ok, a, b
        if round == 1 then
          local x = states[i]
          states[i] = nil
          x:move(dev)
          ok, a, b = coroutine.resume(cos[i], x)
        else
          park(parked[i], dev)
          parked[i] = nil
          ok, a, b = coroutine.resume(cos[i], stats)
        end
        if not ok then error(a, 0) end
        if coroutine.status(cos[i]) == "dead" then
          a:move(HOST)
          outs[i] = a
          dead = dead + 1
        else
          acc = merge(acc, a)
          parked[i] = b
          park(b, HOST)
          live = live + 1
        end
      end
    end
    if stats then stats.mean:free(); stats.var:free(); stats = nil end
    if live > 0 and dead > 0 then
      error(fmt("%s: tiles reached different numbers of GroupNorms (lockstep broken)", ctx.label or "lockstep"), 0)
    end
    if live > 0 then stats = finish(acc, dev) end
    return live > 0
  end
  -- on any error (a tile's, or no memory to park or to bring a tile back) free what
  -- is held here before raising it again
  local ok, err = pcall(function() while run_round() do end end)
  if not ok then
    if stats then stats.mean:free(); stats.var:free() end
    cleanup()
    error(err, 0)
  end
  return outs
end

return M
