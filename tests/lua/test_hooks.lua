-- The hooks C calls back into scripts (bindings/l_aux.c): each script module registers
-- its callback when it loads (kiln._register_hook), so the bindings never look a
-- module's fields up by name. kiln.tiling registers "mem_estimate" (kiln.mem.estimate
-- loads it on first use and says so when it did not register), kiln.stream registers
-- "stream_adapt" (kiln.suspend_point calls it for a budget lowered live, and does
-- nothing while kiln.stream never loaded), and bad registrations are refused by name.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, eq, truthy, raises = H.test, H.eq, H.truthy, H.raises

local MiB = 1024 * 1024
local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

local function net(x) return (x * 2):relu() end

test("kiln.mem.estimate names the module when it loads without registering its hook", function()
  if package.loaded["kiln.tiling"] then H.skip("kiln.tiling was loaded before this test") end
  eq(kiln._hook("mem_estimate"), nil, "nothing registered before kiln.tiling loads")
  package.loaded["kiln.tiling"] = {} -- a provider that registers nothing
  local ok, err = pcall(kiln.mem.estimate, net, kiln.randn({ 1, 2, 8, 8 }))
  package.loaded["kiln.tiling"] = nil
  eq(ok, false)
  truthy(tostring(err):find("hook 'mem_estimate' is not registered: kiln.tiling did not call", 1, true), tostring(err))
  eq(kiln._hook("mem_estimate"), nil)
end)

test("kiln.tiling registers mem_estimate when kiln.mem.estimate first needs it", function()
  local bytes, info = kiln.mem.estimate(net, kiln.randn({ 1, 2, 8, 8 }))
  truthy(math.type(bytes) == "integer" and bytes > 0, "an estimate in bytes")
  truthy(info.method, "details come back too")
  local tiling = package.loaded["kiln.tiling"]
  truthy(type(tiling) == "table", "kiln.mem.estimate loaded kiln.tiling")
  eq(kiln._hook("mem_estimate"), tiling.estimate, "the registered function is tiling.estimate")
end)

test("kiln.stream registers stream_adapt when it loads", function()
  local loaded = package.loaded["kiln.stream"] ~= nil
  if not loaded then eq(kiln._hook("stream_adapt"), nil, "nothing registered before kiln.stream loads") end
  local stream = require "kiln.stream"
  eq(kiln._hook("stream_adapt"), stream.adapt)
end)

test("kiln.suspend_point calls the registered stream_adapt for a budget lowered live", function()
  if not has_sim then H.skip("no sim device") end
  local stream = require "kiln.stream"
  local calls = {}
  kiln._register_hook("stream_adapt", function(dev, excess) calls[#calls + 1] = { dev = dev, excess = excess } end)
  local ok, err = pcall(function()
    kiln.mem.set_budget("sim", 0)
    local held = kiln.zeros({ 4 * MiB // 4 }, { device = "sim" }) -- more than the budget below
    kiln.mem.set_budget("sim", 1 * MiB, { live = true })
    kiln.suspend_point()
    held:free()
  end)
  kiln._register_hook("stream_adapt", stream.adapt)
  kiln.mem.set_budget("sim", 0)
  if not ok then error(err, 0) end
  eq(#calls, 1, "called once")
  eq(calls[1].dev, "sim")
  truthy(math.type(calls[1].excess) == "integer" and calls[1].excess >= 3 * MiB, "the excess " .. calls[1].excess)
  eq(kiln.mem.budget_watch("sim").grace, false, "the grace ended")
end)

test("kiln._register_hook refuses unknown names and non-functions", function()
  raises(function() kiln._register_hook("stream_adpat", print) end,
    "invalid hook 'stream_adpat' (expected one of: stream_adapt, mem_estimate)")
  raises(function() kiln._register_hook("stream_adapt", 42) end, "function expected")
  raises(function() kiln._hook("nope") end, "invalid hook 'nope'")
end)

H.done()
