-- Models through the Lua API: kiln.model, names and lookups, load with dtype
-- conversion, offload / unload, residency and summaries, lifetimes (:close,
-- <close>, __gc), repeated load/use/unload cycles, bad input. On cpu and sim.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p '" .. dir .. "'"))

-- n f32 tensors "blk.<i>.w" of `size` elements (values from seed) and an i64 "ids".
local function make_model(name, n, size, seed)
  local t = { ids = kiln.arange(8) }
  for i = 0, n - 1 do t[("blk.%d.w"):format(i)] = kiln.randn({ size }, { seed = seed * 100 + i }) end
  local path = dir .. "/" .. name .. ".safetensors"
  kiln.save_safetensors(path, t, {})
  for _, v in pairs(t) do v:free() end
  return path
end

local function alloc(dev) return kiln.mem.stats(dev).allocated end

local A = make_model("alpha", 4, 4096, 1)
local B = make_model("beta", 2, 4096, 2)

test("open: names, tensor, m[name], overrides", function()
  local m <close> = kiln.model(A)
  eq(m.name, "alpha")
  eq(#m, 5)
  local names = m:names()
  eq(table.concat(names, ","), "blk.0.w,blk.1.w,blk.2.w,blk.3.w,ids")
  local t = m:tensor("blk.2.w")
  eq(t.device, "cpu"); eq(t.dtype, "f32"); eq(t.shape[1], 4096)
  eq(m["ids"]:table()[3], 2)
  eq(m:where("blk.0.w"), "mapped")
  truthy(m:has("ids") and not m:has("nope"))
  local r = m.residency
  eq(r.mapped, 5); eq(r.device, 0); eq(r.host, 0)
  eq(tostring(m), "model(alpha, 5 tensors, 64.1 KiB, mapped)")
  -- a later file replaces tensors of the same name
  local both <close> = kiln.model({ A, B }, { name = "both" })
  eq(both.name, "both"); eq(#both, 5)
  local want = kiln.load_safetensors(B)["blk.1.w"]
  eq(H.maxdiff(both["blk.1.w"], want), 0)
end)

test("prefix keeps one part of a file", function()
  local m <close> = kiln.model(A, { name = "part", prefix = { "blk.1.", "blk.3." } })
  eq(table.concat(m:names(), ","), "blk.1.w,blk.3.w")
  eq(kiln.model(A, { prefix = "ids" }):names()[1], "ids")
  raises(function() kiln.model(A, { prefix = "vae." }) end, "no tensor of", "starts with 'vae.'")
  raises(function() kiln.model(A, { prefix = 3 }) end, "option 'prefix'")
end)

test("missing tensor names the model and the closest names", function()
  local m <close> = kiln.model(A)
  raises(function() return m:tensor("blk.1.weight") end, "model 'alpha'", "'blk.1.weight'", "closest: 'blk.1.w'")
  raises(function() return m.blk end, "no tensor 'blk'")
  raises(function() m:fetch({ "blk.0.w", "nope" }) end, "nope")
end)

test("load to sim with dtype conversion, bytes, residency, tostring", function()
  local sim0 = alloc("sim")
  local m <close> = kiln.model(A)
  eq(m:load("sim", { dtype = "f16" }), m)
  eq(m.device, "sim")
  eq(m.residency.device, 5)
  eq(m:bytes("sim"), 4 * 4096 * 2 + 64)
  truthy(alloc("sim") - sim0 >= m:bytes("sim"), "allocator counts the copies")
  local w = m:tensor("blk.3.w")
  eq(w.device, "sim"); eq(w.dtype, "f16")
  local src = kiln.load_safetensors(A)["blk.3.w"]
  eq(H.maxdiff(w:to("cpu"):to("f32"), src:to("f16"):to("f32")), 0)
  eq(m.ids.dtype, "i64", "integer tensors keep their dtype")
  eq(tostring(m), "model(alpha, 5 tensors, 32.1 KiB, resident on sim)")
  m:pin()
  truthy(m.pinned)
  truthy(tostring(m):find("pinned", 1, true))
  m:unpin()
  raises(function() m:unpin() end, "unpin without a matching pin")
end)

test("offload keeps host copies on the cpu allocator; unload drops them", function()
  collectgarbage()
  local cpu0, sim0 = alloc("cpu"), alloc("sim")
  local m <close> = kiln.model(B)
  m:load("sim")
  local b = m:bytes("sim")
  eq(b, 2 * 4096 * 4 + 64)
  m:offload()
  eq(m:bytes("sim"), 0); eq(alloc("sim"), sim0)
  eq(m:bytes("cpu"), b)
  truthy(alloc("cpu") - cpu0 >= b, "host copies are in kiln.mem.stats('cpu')")
  eq(m:where("blk.0.w"), "host")
  eq(tostring(m), "model(beta, 3 tensors, 32.1 KiB, on host)")
  m:load("sim")
  eq(alloc("cpu"), cpu0, "host copies freed once on the device")
  m:unload()
  eq(m:bytes(), 0); eq(alloc("sim"), sim0); eq(alloc("cpu"), cpu0)
  eq(m.device, nil)
  eq(m.residency.mapped, 3)
end)

test("memory mode none loads to the cpu", function()
  local m <close> = kiln.model(B)
  local old = kiln.memory_mode("none")
  eq(old, "none")
  m:load("sim")
  eq(m:bytes("sim"), 0); eq(m:bytes("cpu"), 2 * 4096 * 4 + 64)
  eq(m:tensor("blk.0.w").device, "cpu")
end)
kiln.memory_mode("normal")

test("close, <close> and __gc release memory; use after close says where", function()
  collectgarbage()
  local sim0 = alloc("sim")
  local closed_line
  do
    local m <close> = kiln.model(A)
    m:load("sim")
    truthy(alloc("sim") > sim0)
  end
  eq(alloc("sim"), sim0, "<close>")
  local m = kiln.model(A)
  m:load("sim")
  m = nil
  collectgarbage(); collectgarbage()
  eq(alloc("sim"), sim0, "__gc")
  local m2 = kiln.model(A)
  m2:load("sim")
  local t = m2:tensor("blk.0.w") -- a tensor handed out keeps its storage
  m2:close(); closed_line = debug.getinfo(1, "l").currentline
  m2:close() -- idempotent
  eq(alloc("sim") - sim0, t:nbytes())
  eq(t:sum() == t:sum(), true)
  t:free()
  eq(alloc("sim"), sim0)
  raises(function() return m2:tensor("ids") end, "model 'alpha' was closed at", "test_model.lua:" .. (closed_line))
  raises(function() m2:load("sim") end, "was closed")
  eq(tostring(m2), "model(alpha, closed)")
  eq(m2.closed, true)
end)

test("bad input gives clear errors", function()
  raises(function() kiln.model({}) end, "empty")
  raises(function() kiln.model(42) end, "file name or list")
  raises(function() kiln.model({ A, 3 }) end, "file 2")
  raises(function() kiln.model(dir .. "/missing.safetensors") end, "missing.safetensors")
  local m <close> = kiln.model(A)
  raises(function() m:load("gpu7") end, "unknown device 'gpu7'", "cpu", "sim")
  raises(function() m:load("sim", { dtype = "f99" }) end, "invalid dtype 'f99'", "f16")
  raises(function() m:fetch(42) end, "tensor name or list")
  raises(function() m:fetch("ids") end, "call load(device) first")
  raises(function() kiln.memory_mode("turbo") end, "invalid memory mode 'turbo'", "high", "normal", "low", "none")
  local junk = dir .. "/junk.safetensors"
  local f = assert(io.open(junk, "wb")); f:write("not a safetensors file"); f:close()
  raises(function() kiln.model(junk) end, "junk.safetensors")
end)

test("200 load/use/unload cycles leave device and host allocation where they started", function()
  collectgarbage()
  local sim0, cpu0 = alloc("sim"), alloc("cpu")
  local m <close> = kiln.model(B)
  for i = 1, 200 do
    local dev = i % 2 == 0 and "sim" or "cpu"
    m:load(dev, i % 3 == 0 and { dtype = "f16" } or nil)
    local w <close> = m:tensor("blk.1.w")
    local y <close> = w * 2
    if i % 7 == 0 then m:offload() end
    m:unload()
  end
  collectgarbage()
  eq(alloc("sim"), sim0); eq(alloc("cpu"), cpu0)
end)

os.execute("rm -rf '" .. dir .. "'")
H.done()
