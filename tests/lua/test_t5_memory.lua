-- T5 and the memory budget: t5:encode's cache of encodings (hits and misses by ids,
-- length, precision, device and model; ownership of what it returns; its size limit;
-- t5:clear_cache; eviction by a tight sim budget through the allocators' pressure
-- handler, and the out-of-memory error without it), kiln.encoders.release (the encoders
-- leave the device after encoding unless the mode or the budget keeps them), the meta
-- device's prediction of a low-mode encode's peak, and the planner's row for T5.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local t5 = require "kiln.t5"
local cache = require "kiln.encoding_cache"
local encoders = require "kiln.encoders"
local test, eq, truthy = H.test, H.eq, H.truthy

kiln.set_quiet(true)
local GOLD = "tests/golden/t5/"
local FILE = GOLD .. "comfy.safetensors" -- 3 blocks, d_model 32, vocabulary of 100
local MiB = 1024 * 1024

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

-- The tiny vocabulary has no real words: prompts map to ids it has (what t5.ids returns
-- is what encode keys and encodes; test_t5 checks the real t5.ids).
local real_ids = t5.ids
t5.ids = function(text, length)
  local ids = {}
  for i = 1, #text do ids[i] = 2 + text:byte(i) % 98 end
  ids[#ids + 1] = 1
  if length then
    for i = #ids + 1, length do ids[i] = 0 end
    while #ids > length do table.remove(ids) end
  end
  return ids
end

-- encoder with its forward passes counted
local function counted(path, opts)
  local enc = kiln.load_t5(path or FILE, opts)
  local n = { 0 }
  local fwd = t5.Encoder.forward
  rawset(enc, "forward", function(self, ids) n[1] = n[1] + 1 return fwd(self, ids) end)
  return enc, n
end

test("t5 cache: the same prompt is encoded once; length, precision and model are part of the key", function()
  local enc <close>, n = counted()
  local a = enc:encode("a cat", { length = 8 })
  local b = enc:encode("a cat", { length = 8 })
  eq(n[1], 1, "second encode is a hit")
  eq((a - b):abs():max(), 0)
  local want = enc:forward({ t5.ids("a cat", 8) })
  eq((b - want):abs():max(), 0, "a hit is the encoding")
  eq(n[1], 2)
  local c = enc:encode("a cat", { length = 12 })
  eq(n[1], 3, "another length is a miss")
  eq(c.shape[2], 12)
  local d = enc:encode("a dog", { length = 8 })
  eq(n[1], 4, "another prompt is a miss")
  local e = kiln.with_precision("bf16", enc.encode, enc, "a cat", { length = 8 })
  eq(n[1], 5, "another precision is a miss")
  local f = enc:encode("a cat", { length = 8, cache = false })
  eq(n[1], 6, "cache = false encodes")
  local st = enc.encodings:stats()
  eq(st.hits, 1); eq(st.misses, 4); eq(st.entries, 4)
  local other <close>, m = counted()
  local g = other:encode("a cat", { length = 8 })
  eq(m[1], 1, "another encoder (model) is a miss")
  for _, t in ipairs({ a, b, c, d, e, f, g, want }) do t:free() end
end)

test("t5 cache: a caller may free what it gets; the cache keeps its own reference", function()
  local enc <close>, n = counted()
  local a = enc:encode("tree", { length = 6 })
  local copy = a:clone()
  a:free()
  local b = enc:encode("tree", { length = 6 })
  eq(n[1], 1)
  eq((b - copy):abs():max(), 0, "the entry outlives the caller's handle")
  enc:clear_cache()
  eq(enc.encodings:stats().entries, 0)
  eq((b - copy):abs():max(), 0, "the caller's handle outlives the entry")
  b:free()
  local c = enc:encode("tree", { length = 6 })
  eq(n[1], 2, "cleared: encoded again")
  c:free(); copy:free()
end)

test("t5 cache: its size limit keeps the most recently used; 0 keeps nothing", function()
  local one = 6 * 32 * 4 -- [1, 6, 32] f32
  local enc <close>, n = counted(FILE, { cache = 2 * one })
  for _, p in ipairs({ "a", "b", "a", "c" }) do enc:encode(p, { length = 6 }):free() end
  eq(n[1], 3)
  local st = enc.encodings:stats()
  eq(st.entries, 2); eq(st.bytes, 2 * one)
  enc:encode("a", { length = 6 }):free()
  eq(n[1], 3, "a was used last: kept")
  enc:encode("b", { length = 6 }):free()
  eq(n[1], 4, "b was the least recently used: dropped")
  enc:encode("x", { length = 64 }):free()
  eq(enc.encodings:stats().entries, 2, "larger than the limit: not kept")
  enc.encodings:set_limit(0)
  eq(enc.encodings:stats().entries, 0)
  enc:encode("a", { length = 6 }):free()
  enc:encode("a", { length = 6 }):free()
  eq(n[1], 7, "limit 0: no cache")
  H.raises(function() kiln.load_t5(FILE, { cache = -1 }) end)
  H.raises(function() kiln.load_t5(FILE, { cache = "lots" }) end)
end)

test("encoding cache: several results are one entry (CLIP's conditioning and pooled vector)", function()
  local c = cache.new({ what = "clip" })
  local calls = 0
  local function encode(text)
    calls = calls + 1
    return kiln.full({ 1, 4, 8 }, #text), kiln.full({ 1, 8 }, 2 * #text), nil
  end
  local a, ap, an = c:fetch("k", encode, "abc")
  local b, bp, bn = c:fetch("k", encode, "abc")
  eq(calls, 1)
  eq(b:table()[1][1][1], 3); eq(bp:table()[1][1], 6)
  truthy(an == nil and bn == nil, "a nil result stays nil")
  eq(c:stats().bytes, (32 + 8) * 4)
  c:put("bad", a, "not a tensor")
  eq(c:stats().entries, 1, "a result that is not a tensor is not kept")
  for _, t in ipairs({ a, ap, b, bp }) do t:free() end
  eq(cache.evict("cpu"), (32 + 8) * 4, "evict frees the device's entries")
  eq(c:stats().entries, 0)
end)

test("t5 cache: a tight sim budget evicts it before failing; without the handler it fails", function()
  if not has_sim then H.skip("no sim device in this build") end
  local enc <close>, n = counted()
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
  local base = kiln.mem.stats("sim")
  eq(base.allocated, 0, "nothing on sim before")
  enc:load("sim")
  for _, p in ipairs({ "one", "two", "three" }) do enc:encode(p, { length = 64 }):free() end
  enc:unload()
  eq(n[1], 3)
  local held = enc.encodings:stats().bytes
  local st = kiln.mem.stats("sim")
  truthy(st.allocated >= held and held > 0, "the entries are on sim, counted")
  -- a budget with no room beside the entries' segment: a 1.5 MiB tensor needs a new one
  local ok, err = pcall(function()
    kiln.mem.set_budget("sim", st.reserved + MiB)
    kiln._on_pressure(nil)
    local fail_ok, e = pcall(kiln.empty, { 3 * MiB // 8 }, { device = "sim", dtype = "f32" })
    kiln._on_pressure(cache.on_pressure)
    truthy(not fail_ok and type(e) == "table" and e.kind == "oom", "without the handler: out of memory")
    eq(enc.encodings:stats().entries, 3, "the GC alone frees no entry")
    local t = kiln.empty({ 3 * MiB // 8 }, { device = "sim", dtype = "f32" })
    eq(enc.encodings:stats().entries, 0, "the budget evicted the entries")
    truthy(enc.encodings:stats().evicted == 3)
    truthy(kiln.mem.stats("sim").reserved <= st.reserved + MiB, "within the budget")
    t:free()
    enc:load("sim")
    enc:encode("one", { length = 64 }):free()
    eq(n[1], 4, "an evicted prompt is encoded again")
    enc:unload()
  end)
  kiln._on_pressure(cache.on_pressure)
  kiln.mem.set_budget("sim", 0)
  enc:clear_cache()
  assert(ok, err)
end)

test("encoders.release: off the device after encoding unless mode high or the next stage fits", function()
  if not has_sim then H.skip("no sim device in this build") end
  local enc <close> = kiln.load_t5(FILE)
  local old = kiln.memory_mode()
  local ok, err = pcall(function()
    kiln.memory_mode("normal")
    enc:load("sim")
    local total = enc:bytes("sim")
    truthy(total > 0)
    eq(encoders.release({ enc, nil, n = 2 }, "sim"), 1)
    eq(enc:bytes("sim"), 0, "normal: unloaded")
    enc:load("sim")
    kiln.memory_mode("high")
    eq(encoders.release({ enc }, "sim"), 0)
    eq(enc:bytes("sim"), total, "high: stays")
    kiln.memory_mode("normal")
    local st = kiln.mem.stats("sim")
    kiln.mem.set_budget("sim", st.reserved + 4 * MiB)
    eq(encoders.release({ enc }, "sim", { need = MiB }), 0)
    eq(enc:bytes("sim"), total, "the next stage fits beside it: stays")
    eq(encoders.release({ enc }, "sim", { need = 64 * MiB }), 1)
    eq(enc:bytes("sim"), 0, "the next stage needs its room: unloaded")
    H.raises(function() encoders.release({ enc }, "sim", { need = -1 }) end)
  end)
  kiln.mem.set_budget("sim", 0)
  kiln.memory_mode(old)
  enc:unload()
  assert(ok, err)
end)

-- measured against predicted as tests/lua/test_meta_device.lua does: the collector
-- stopped in both, prefetches copied at once as a dry run counts them
test("t5: a dry run's peak of a low-mode encode is the measured one or up to 3% above", function()
  if not has_sim then H.skip("no sim device in this build") end
  local enc <close> = kiln.load_t5(FILE)
  local function encode()
    enc:load("sim")
    local y = enc:encode("a lighthouse at dusk, oil on canvas", { length = 96 })
    y:free()
    enc:unload()
  end
  local r = kiln.dry_run(function()
    collectgarbage("stop")
    local ok, err = pcall(encode)
    collectgarbage("restart")
    if not ok then error(err, 0) end
  end, { device = "sim", mode = "low" })
  truthy(r.fits, "fits")
  eq(enc.encodings:stats().entries, 0, "a dry run keeps nothing in the cache")
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
  local old = kiln.memory_mode()
  kiln.memory_mode("low")
  kiln.mem.reset_peak("sim")
  local base = kiln.mem.stats("sim").allocated
  kiln.mem.prefetch_at_once(true)
  collectgarbage("stop")
  local ok, err = pcall(encode)
  collectgarbage("restart")
  kiln.mem.prefetch_at_once(false)
  kiln.memory_mode(old)
  assert(ok, err)
  local real = kiln.mem.stats("sim").peak_allocated - base
  eq(enc.encodings:stats().entries, 1, "the real run cached its encoding")
  enc:clear_cache()
  print(("# low-mode encode of 96 tokens: predicted %d, measured %d bytes"):format(r.peak, real))
  truthy(real > 0 and r.peak >= real and r.peak <= 1.03 * real, ("predicted %d, measured %d"):format(r.peak, real))
end)

test("encoders.plan: T5's weights, low-mode window and the work of an encode", function()
  if not has_sim then H.skip("no sim device in this build") end
  local enc <close> = kiln.load_t5(FILE)
  local row = encoders.plan(enc, "sim", { tokens = 96 })
  eq(row.bytes, enc.streamer:total_bytes(enc.model))
  eq(row.window, select(2, enc.streamer:_sizes(enc.model)))
  truthy(row.work and row.work > 0, tostring(row.why))
  local long = encoders.plan(enc, "sim", { tokens = 384 })
  truthy(long.work > row.work, "more tokens, more work")
  eq(enc:bytes("sim"), 0, "planning leaves nothing loaded")
  eq(kiln.memory_mode(), "normal")
  truthy(encoders.plan(enc, "sim", {}).why, "no token count: no work")
end)

test("planner: a checkpoint's T5 is a row of the plan, its encode's work measured", function()
  if not has_sim then H.skip("no sim device in this build") end
  local path = os.getenv("KILN_DEMO_MODEL") or "examples/models/kiln-shapes.safetensors"
  if not io.open(path, "rb") then H.skip(path .. " is missing") end
  local demo <close> = kiln.load_checkpoint(path)
  local enc <close> = kiln.load_t5(FILE)
  local ck = setmetatable({ t5 = enc }, { __index = demo })
  local planner = require "kiln.planner"
  kiln.mem.set_budget("sim", 1024 * MiB)
  local ok, plan = pcall(planner.choose, ck, { device = "sim", width = 64, height = 64 })
  local ok2, plan2 = pcall(planner.choose, demo, { device = "sim", width = 64, height = 64 })
  kiln.mem.set_budget("sim", 0)
  assert(ok, plan); assert(ok2, plan2)
  local row
  for _, l in ipairs(plan.lines) do row = row or l:match("^%s+t5%s.*") end
  truthy(row, "a t5 line: " .. table.concat(plan.lines, "\n"))
  truthy(not row:find("?", 1, true), "its work measured: " .. row)
  local t5_row = encoders.plan(enc, "sim", { tokens = 512 })
  truthy(t5_row.work > 0)
  truthy(plan.need.high >= plan2.need.high + t5_row.bytes, "high: the T5's weights count")
  truthy(plan.need.low >= t5_row.window + t5_row.work, "low: its window and work count")
  truthy(plan.need.normal >= t5_row.bytes + t5_row.work, "normal: its stage counts")
end)

t5.ids = real_ids
H.done()
