-- kiln.lockstep on its own: the cores partition the input; a GroupNorm run over tiles
-- in lockstep equals the untiled GroupNorm (statistics merged from the tiles' cores);
-- tiles that wait are parked on the host; an error in one tile comes back unchanged
-- and leaves nothing allocated on the device.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local lockstep = require "kiln.lockstep"

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end
local DEV = has_sim and "sim" or "cpu"

-- a picture whose statistics differ from place to place (tiles' own would be wrong)
local function input()
  local x = kiln.randn({ 1, 64, 40, 36 }, { seed = 5 })
  local ramp = kiln.arange(0, 36):reshape({ 1, 1, 1, 36 }) * 0.2
  local y = x + ramp
  x:free(); ramp:free()
  return y
end

H.test("cores partition the input exactly", function()
  for _, c in ipairs({ { 40, 36, 16, 4 }, { 100, 37, 32, 8 }, { 64, 64, 24, 8 }, { 17, 90, 16, 6 } }) do
    local plan = kiln.tile.plan(c[1], c[2], { tile = c[3], overlap = c[4] })
    local cores = lockstep.cores(plan)
    local cover = {}
    for i = 1, plan.count do
      local r, k = plan[i].input, cores[i]
      H.truthy(k.y0 >= 0 and k.y1 <= r.h and k.x0 >= 0 and k.x1 <= r.w and k.y0 < k.y1 and k.x0 < k.x1, "core inside")
      for y = r.y + k.y0, r.y + k.y1 - 1 do
        for x = r.x + k.x0, r.x + k.x1 - 1 do
          local key = y * 100000 + x
          H.truthy(not cover[key], ("pixel %d,%d in two cores"):format(y, x))
          cover[key] = true
        end
      end
    end
    local n = 0
    for _ in pairs(cover) do n = n + 1 end
    H.eq(n, c[1] * c[2], "every pixel in one core")
  end
end)

H.test("GroupNorm in lockstep over tiles equals the untiled GroupNorm", function()
  local x = input()
  local want = kiln.nn.group_norm(x, 32, nil, nil, 1e-6)
  local opts = { tile = 16, overlap = 4 }
  local plan = kiln.tile.plan(40, 36, opts)
  local ctx = { device = DEV, cores = lockstep.cores(plan), label = "test" }
  local states = {}
  for i = 1, plan.count do
    local r = plan[i].input
    states[i] = x:narrow(3, r.y, r.h):narrow(4, r.x, r.w):contiguous()
  end
  local rounds = 0
  local outs = lockstep.stage(states, function(t)
    local s = ctx.sync(t)
    rounds = rounds + 1
    local g = t:reshape({ 1, 32, -1 })
    local c = g - s.mean
    local n = c / (s.var + 1e-6):sqrt()
    return n:reshape(t.shape)
  end, ctx)
  H.eq(rounds, plan.count, "each tile synced once")
  for i = 1, plan.count do H.eq(outs[i].device, "cpu", "outputs parked on the host") end
  local got = kiln.tile.map(x, function(_, i) return outs[i] end, opts)
  local d = (got - want):abs():max()
  H.truthy(d < 1e-5, "max difference " .. d)
  -- control: each tile normalized with its own statistics is far off
  local own = kiln.tile.map(x, function(t) return kiln.nn.group_norm(t, 32, nil, nil, 1e-6) end, opts)
  H.truthy((own - want):abs():max() > 0.1, "own statistics differ")
end)

H.test("an error in a tile comes back unchanged; nothing stays on the device", function()
  if not has_sim then H.skip("no sim device") end
  local x = input()
  collectgarbage(); collectgarbage()
  local base = kiln.mem.stats("sim").allocated
  local plan = kiln.tile.plan(40, 36, { tile = 16, overlap = 4 })
  local ctx = { device = "sim", cores = lockstep.cores(plan), label = "test" }
  local states = {}
  for i = 1, plan.count do
    local r = plan[i].input
    states[i] = x:narrow(3, r.y, r.h):narrow(4, r.x, r.w):contiguous()
  end
  local calls = 0
  local ok, err = pcall(lockstep.stage, states, function(t)
    calls = calls + 1
    local me = calls
    local s = ctx.sync(t) -- every tile is parked here once
    if me == 2 then error({ kind = "test", message = "tile 2 failed" }) end
    return t * 2
  end, ctx)
  H.truthy(not ok and type(err) == "table" and err.kind == "test", "the tile's own error value")
  for _, t in pairs(states) do t:free() end
  collectgarbage(); collectgarbage()
  H.eq(kiln.mem.stats("sim").allocated, base, "sim bytes after the error")
end)

H.done()
