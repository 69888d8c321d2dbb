-- Memory policy through the Lua API: LRU eviction, pinned models, mode "high" giving
-- typed OOM errors, the event log, kiln.mem.summary's model section, Chrome trace
-- files (parsed with a small JSON reader), low-mode streaming on the copy thread,
-- a randomized stress under a small budget, and the CLI's --trace.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local KiB, MiB = 1024, 1024 * 1024
local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p '" .. dir .. "'"))

local function make_model(name, n, size, seed)
  local t = { ids = kiln.arange(8) }
  for i = 0, n - 1 do t[("blk.%d.w"):format(i)] = kiln.randn({ size }, { seed = seed * 100 + i }) end
  local path = dir .. "/" .. name .. ".safetensors"
  kiln.save_safetensors(path, t, {})
  for _, v in pairs(t) do v:free() end
  return path
end

local function alloc(dev) return kiln.mem.stats(dev).allocated end
local function events_since(seq, kind)
  local out = {}
  for _, e in ipairs(kiln.mem.events(seq)) do
    if not kind or e.kind == kind then out[#out + 1] = e end
  end
  return out
end
local function last_seq()
  local ev = kiln.mem.events()
  return #ev > 0 and ev[#ev].seq or 0
end
local function reset()
  kiln.memory_mode("normal")
  kiln.mem.empty_cache("sim")
  kiln.mem.set_budget("sim", 8 * 1024 * MiB)
  collectgarbage(); collectgarbage()
end

-- A small strict JSON reader (objects, arrays, strings, numbers, literals).
local function json_decode(s)
  local pos = 1
  local function ws() pos = s:find("[^ \t\r\n]", pos) or #s + 1 end
  local function err(what) error(("JSON: %s at byte %d"):format(what, pos), 0) end
  local value
  local function str()
    local out, i = {}, pos + 1
    while true do
      local c = s:sub(i, i)
      if c == "" then err("unterminated string") end
      if c == '"' then pos = i + 1; return table.concat(out) end
      if c == "\\" then
        local e = s:sub(i + 1, i + 1)
        local map = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }
        if map[e] then out[#out + 1] = map[e]; i = i + 2
        elseif e == "u" then
          local hex = s:sub(i + 2, i + 5)
          if not hex:match("^%x%x%x%x$") then err("bad \\u escape") end
          out[#out + 1] = utf8.char(tonumber(hex, 16)); i = i + 6
        else err("bad escape") end
      else
        if c:byte() < 32 then err("control character in string") end
        out[#out + 1] = c; i = i + 1
      end
    end
  end
  function value()
    ws()
    local c = s:sub(pos, pos)
    if c == "{" then
      local obj = {}
      pos = pos + 1; ws()
      if s:sub(pos, pos) == "}" then pos = pos + 1; return obj end
      while true do
        ws()
        if s:sub(pos, pos) ~= '"' then err("expected a key") end
        local k = str(); ws()
        if s:sub(pos, pos) ~= ":" then err("expected ':'") end
        pos = pos + 1
        obj[k] = value(); ws()
        local d = s:sub(pos, pos); pos = pos + 1
        if d == "}" then return obj end
        if d ~= "," then err("expected ',' or '}'") end
      end
    elseif c == "[" then
      local arr = {}
      pos = pos + 1; ws()
      if s:sub(pos, pos) == "]" then pos = pos + 1; return arr end
      while true do
        arr[#arr + 1] = value(); ws()
        local d = s:sub(pos, pos); pos = pos + 1
        if d == "]" then return arr end
        if d ~= "," then err("expected ',' or ']'") end
      end
    elseif c == '"' then return str()
    elseif s:find("^true", pos) then pos = pos + 4; return true
    elseif s:find("^false", pos) then pos = pos + 5; return false
    elseif s:find("^null", pos) then pos = pos + 4; return nil
    else
      local num = s:match("^-?%d+%.?%d*[eE]?[-+]?%d*", pos)
      if not num or num == "" then err("unexpected character") end
      pos = pos + #num
      return tonumber(num) or err("bad number")
    end
  end
  local v = value(); ws()
  if pos <= #s then err("trailing data") end
  return v
end

local function read_file(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

-- four models of 4 x 256 KiB (+ ids): a 4 MiB budget on sim holds three
local P = {}
for i = 1, 4 do P[i] = make_model("m" .. i, 4, 64 * 1024, i) end

test("eviction: least recently used first, pinned never, mode high raises a typed OOM", function()
  reset()
  local sim0 = alloc("sim")
  eq(sim0, 0)
  kiln.mem.set_budget("sim", 4 * MiB)
  local m = {}
  for i = 1, 4 do m[i] = kiln.model(P[i]) end
  local seq = last_seq()
  m[1]:load("sim"); m[2]:load("sim"); m[3]:load("sim")
  do local touch <close> = m[1]["blk.0.w"] end -- touch m1: m2 is now the least recently used
  m[4]:load("sim")
  eq(m[2]:bytes("sim"), 0, "m2 evicted")
  truthy(m[1]:bytes("sim") > 0 and m[3]:bytes("sim") > 0 and m[4]:bytes("sim") > 0)
  local ev = events_since(seq, "evict")
  eq(#ev, 1); eq(ev[1].owner, "model:m2"); eq(ev[1].device, "sim")
  eq(ev[1].bytes, 4 * 256 * KiB + 64)
  eq(m[2]:where("blk.0.w"), "mapped", "evicted weights fall back to the file")
  eq(m[2].residency.mapped, 5)
  -- pinned: m3 is now the LRU, pin it; reloading m2 must evict m1 instead
  m[3]:pin()
  m[2]:load("sim")
  truthy(m[3]:bytes("sim") > 0, "pinned m3 kept")
  eq(m[1]:bytes("sim"), 0, "m1 evicted instead")
  truthy(kiln.mem.stats("sim").peak <= 4 * MiB)
  -- high: nothing is evicted; the error is a table with the fields of the contract
  eq(kiln.memory_mode("high"), "high")
  seq = last_seq()
  local ok, err = pcall(m[1].load, m[1], "sim")
  eq(ok, false)
  eq(type(err), "table")
  eq(err.kind, "oom"); eq(err.device, "sim")
  eq(err.requested, 256 * KiB); eq(err.budget, 4 * MiB)
  truthy(math.type(err.free) == "integer" and err.free < err.requested)
  local msg = tostring(err)
  for _, s in ipairs({ "model 'm1'", "memory mode high", "pinned: m3", "resident on sim:", "model:m2", "model:m3", "model:m4" }) do
    truthy(msg:find(s, 1, true), ("%q missing from %q"):format(s, msg))
  end
  eq(#events_since(seq, "evict"), 0)
  local ooms = events_since(seq, "oom")
  truthy(#ooms >= 1 and ooms[1].owner == "model:m1" and ooms[1].bytes == 256 * KiB)
  eq(m[1]:bytes("sim"), 0, "failed load leaves nothing behind")
  -- a raw allocation in high mode fails the same way, listing what is resident
  local ok2, err2 = pcall(kiln.zeros, { 512 * 1024 }, { device = "sim" })
  eq(ok2, false); eq(err2.kind, "oom")
  truthy(tostring(err2):find("model:m3", 1, true))
  kiln.memory_mode("normal")
  local t = kiln.zeros({ 128 * 1024 }, { device = "sim" }) -- normal: evicts for a plain tensor too
  eq(t.device, "sim")
  t:free()
  m[3]:unpin()
  for i = 1, 4 do m[i]:close() end
  eq(alloc("sim"), 0)
  reset()
end)

test("summary lists models per device", function()
  reset()
  local a <close> = kiln.model(P[1], { name = "unet" })
  local b <close> = kiln.model(P[2], { name = "vae" })
  a:load("sim", { dtype = "f16" })
  b:load("sim")
  local s = kiln.mem.summary()
  truthy(s:find("models (most recently used first)", 1, true), s)
  truthy(s:find("\n  vae%s+sim%s+1%.00 MiB%s+5/5%s+resident"), s)
  truthy(s:find("\n  unet%s+sim%s+512 KiB%s+5/5%s+resident"), s)
  truthy(s:find("model:unet", 1, true) and s:find("model:vae", 1, true), s)
  truthy(s:find("mode normal", 1, true))
  b:offload()
  s = kiln.mem.summary()
  truthy(s:find("\n  vae%s+cpu%s+1%.00 MiB"), s)
  b:unload()
  s = kiln.mem.summary()
  truthy(s:find("\n  vae%s+%-%s+%-%s+%-%s+mapped"), s)
end)

test("trace file: replaced only when complete; a folder that is missing is named", function()
  local path = dir .. "/kept.json"
  local f = assert(io.open(path, "wb")); f:write("earlier trace"); f:close()
  kiln.trace.start(path)
  eq(read_file(path), "earlier trace") -- the old file stays until stop
  local lfs = require "lfs"
  local temps = 0
  for name in lfs.dir(dir) do if name:find("kept.json", 1, true) and name ~= "kept.json" then temps = temps + 1 end end
  eq(temps, 1) -- the one temporary, beside the target
  eq(kiln.trace.stop(), true)
  truthy(read_file(path):find("traceEvents", 1, true))
  for name in lfs.dir(dir) do truthy(name:find("%.tmp$") == nil, "temporary left: " .. name) end
  raises(function() kiln.trace.start(dir .. "/no/such/folder/t.json") end, "no/such/folder/t.json")
  truthy(not kiln.trace.active())
end)

test("trace file: valid JSON with counters, model events and spans", function()
  reset()
  local path = dir .. "/trace.json"
  kiln.trace.start(path)
  truthy(kiln.trace.active())
  raises(function() kiln.trace.start(path) end, "already")
  kiln.mem.set_budget("sim", 2 * MiB)
  local a <close> = kiln.model(make_model("ta", 2, 64 * 1024, 7))
  local b <close> = kiln.model(make_model("tb", 2, 64 * 1024, 8))
  local x, y = kiln.trace.span("load", function(p, q)
    a:load("sim")
    b:load("sim", { dtype = "f16" })
    return p + q, "ok"
  end, 1, 2)
  eq(x, 3); eq(y, "ok")
  local ok, err = pcall(kiln.trace.span, "decode", function()
    local big <close> = kiln.zeros({ 400 * 1024 }, { device = "sim" }) -- evicts
    error("boom")
  end)
  eq(ok, false); truthy(tostring(err):find("boom", 1, true))
  local ok2 = pcall(kiln.zeros, { 1024 * 1024 }, { device = "sim" }) -- 4 MiB: OOM
  eq(ok2, false)
  kiln.trace.mark("checkpoint", "half way")
  b:offload(); b:unload()
  eq(kiln.trace.stop(), true)
  eq(kiln.trace.stop(), nil)
  local f = io.open(path .. ".tmp", "rb"); eq(f, nil) -- no temporary left
  local doc = json_decode(read_file(path))
  local evs = doc.traceEvents
  truthy(type(evs) == "table" and #evs > 10)
  local function find(ph, name)
    for _, e in ipairs(evs) do
      if e.ph == ph and e.name:sub(1, #name) == name then return e end
    end
  end
  local c = find("C", "memory sim")
  truthy(c and c.args.allocated and c.args.reserved and c.args.budget, "sim counters")
  truthy(find("C", "memory cpu"), "cpu counters")
  truthy(find("i", "load model:ta") and find("i", "load model:tb"), "load instants")
  truthy(find("i", "evict model:ta"), "evict instant")
  local oom = find("i", "oom")
  truthy(oom and oom.args.bytes == 4 * MiB and oom.args.device == "sim", "oom instant")
  truthy(find("i", "offload model:tb") and find("i", "unload model:tb"), "offload/unload instants")
  truthy(find("i", "mark checkpoint"), "mark")
  local span = find("X", "load")
  truthy(span and span.dur > 0 and span.ts >= 0, "span")
  local dspan = find("X", "decode")
  truthy(dspan and dspan.args and dspan.args.error:find("boom", 1, true), "span closed on error")
  local top = 0
  for _, e in ipairs(evs) do
    if e.ph == "C" and e.name == "memory sim" then top = math.max(top, e.args.reserved) end
  end
  truthy(top > 0 and top <= 2 * MiB, "counter peak within the budget: " .. top)
  reset()
end)

test("low mode: fetch, prefetch on the copy thread, release", function()
  reset()
  local path = make_model("low", 4, 512 * 1024, 9) -- 2 MiB per tensor
  local src = kiln.load_safetensors(path)
  local m <close> = kiln.model(path)
  eq(kiln.memory_mode("low"), "low")
  local seq = last_seq()
  m:load("sim", { dtype = "f16" })
  eq(m:bytes("sim"), 0)
  eq(m:bytes("cpu"), 4 * 1024 * 1024, "host copies in f16")
  truthy(tostring(m):find("streamed to sim", 1, true), tostring(m))
  local load_thread = events_since(seq, "load")[1].thread
  m:fetch("blk.0.w")
  m:prefetch({ "blk.1.w", "blk.2.w" })
  -- the copy runs on its own thread while we compute
  local x = kiln.randn({ 64, 64 }, { seed = 1 })
  local t0 = os.clock()
  while m:where("blk.2.w") ~= "device" and os.clock() - t0 < 5 do x = (x:matmul(x) * 0.01):tanh() end
  eq(m:where("blk.2.w"), "device", "prefetched without fetch")
  local st = m:stats()
  truthy(st.prefetch_thread ~= 0 and st.prefetch_thread ~= load_thread, "prefetch on another thread")
  eq(st.prefetches, 2)
  m:fetch({ "blk.1.w", "blk.2.w" })
  eq(m:stats().prefetch_hits, 2)
  local w = m["blk.2.w"]
  eq(w.device, "sim"); eq(w.dtype, "f16")
  eq(H.maxdiff(w:to("cpu"), src["blk.2.w"]:to("f16")), 0, "prefetched tensor equals the source")
  w:free()
  m:prefetch("blk.3.w")
  m:fetch("blk.3.w") -- waits for the copy in flight
  eq(m.residency.device, 4)
  m:release({ "blk.0.w", "blk.1.w", "blk.2.w", "blk.3.w" })
  eq(m:bytes("sim"), 0)
  eq(alloc("sim"), 0, "device bytes back to 0 after release")
  m:prefetch({ "blk.0.w", "blk.1.w" })
  m:release("blk.1.w") -- cancels or waits
  m:close()           -- waits for the rest
  eq(alloc("sim"), 0)
  reset()
end)

test("randomized stress on sim: peak within budget, everything freed", function()
  reset()
  local budget = 5 * MiB
  kiln.mem.set_budget("sim", budget)
  kiln.mem.reset_peak("sim")
  local models = {}
  for i = 1, 4 do models[i] = kiln.model(P[i]) end
  local held = {}
  local rng = 4242
  local function rand(n) rng = (rng * 1103515245 + 12345) % 2147483648; return rng % n + 1 end
  local ooms, loads = 0, 0
  for it = 1, 400 do
    if it == 200 then kiln.memory_mode("low") end
    local r, m, slot = rand(100), models[rand(4)], rand(6)
    local ok, err = pcall(function()
      if r <= 30 then loads = loads + 1; m:load("sim", rand(2) == 1 and { dtype = "f16" } or nil)
      elseif r <= 40 then m:unload()
      elseif r <= 45 then m:offload()
      elseif r <= 50 then m:pin()
      elseif r <= 58 then if m.pinned then m:unpin() end
      elseif r <= 75 then
        if held[slot] then held[slot]:free() end
        held[slot] = nil
        held[slot] = kiln.zeros({ rand(512) * 256 }, { device = "sim" })
      elseif r <= 85 then if held[slot] then held[slot]:free(); held[slot] = nil end
      elseif r <= 90 then m:prefetch("blk." .. (rand(4) - 1) .. ".w")
      elseif r <= 95 then m:fetch("blk." .. (rand(4) - 1) .. ".w")
      else m:release({ "blk.0.w", "blk.1.w", "blk.2.w", "blk.3.w" }) end
    end)
    if not ok then
      if type(err) == "table" and err.kind == "oom" then ooms = ooms + 1
      elseif not tostring(err):find("load(device) first", 1, true) then error(err) end
    end
    local s = kiln.mem.stats("sim")
    truthy(s.reserved <= budget and s.allocated <= budget, "over budget at iteration " .. it)
  end
  kiln.memory_mode("normal")
  local s = kiln.mem.stats("sim")
  truthy(s.peak <= budget and s.peak_reserved <= budget, "peak " .. s.peak_reserved)
  for _, t in pairs(held) do t:free() end
  for _, m in ipairs(models) do m:close() end
  collectgarbage(); collectgarbage()
  for _, d in ipairs(kiln.devices()) do eq(alloc(d), 0, d .. " allocated at the end") end
  reset()
end)

test("allocation events above a threshold", function()
  local seq = last_seq()
  eq(kiln.mem.event_threshold(100 * KiB), 100 * KiB)
  local a = kiln.zeros({ 1000 }, { device = "sim" })
  local b = kiln.zeros({ 64 * 1024 }, { device = "sim" })
  a:free(); b:free()
  kiln.mem.event_threshold(0)
  local al, fr = events_since(seq, "alloc"), events_since(seq, "free")
  eq(#al, 1); eq(#fr, 1); eq(al[1].bytes, 256 * KiB); eq(al[1].device, "sim")
end)

test("the CLI's --trace writes a trace", function()
  local exe = arg and arg[-1] or "build/kiln"
  local path = dir .. "/cli.json"
  local code = [[local k = require 'kiln'; k.trace.span('work', function() local t = k.zeros({4096}, {device='sim'}) end)]]
  local ok = os.execute(("%s --trace '%s' -e \"%s\""):format(exe, path, code))
  truthy(ok, "kiln --trace ran")
  local doc = json_decode(read_file(path))
  local found
  for _, e in ipairs(doc.traceEvents) do found = found or (e.ph == "X" and e.name == "work") end
  truthy(found, "span from the CLI run")
end)

test("host cache: reused between operations, given back by unload and empty_cache", function()
  local MODEL = "examples/models/kiln-shapes.safetensors"
  local f = io.open(MODEL, "rb")
  if not f then H.skip(MODEL .. " is missing") end
  f:close()
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("cpu")
  local base = kiln.mem.stats("cpu").reserved
  -- a freed activation stays cached: the next one of its size reuses it
  local a = kiln.zeros({ 1024, 1024 })
  a:free()
  local cached = kiln.mem.stats("cpu")
  truthy(cached.reserved >= base + 4 * 1024 * 1024, "freed block kept")
  local segs = cached.segments
  truthy(segs and segs > 0, "segments counted")
  local b = kiln.zeros({ 1024, 1024 })
  eq(kiln.mem.stats("cpu").segments, segs, "no new segment for the same size")
  b:free()
  -- weights loaded as f32 on the host, then unloaded: the memory goes back
  local ck <close> = kiln.load_checkpoint(MODEL)
  ck.unet:load("cpu", { dtype = "f32" })
  truthy(kiln.mem.stats("cpu").allocated > base + 5 * 1024 * 1024, "f32 copy on the host")
  ck.unet:unload() -- gives the host cache back by itself
  truthy(kiln.mem.stats("cpu").reserved <= base + 64 * 1024, ("reserved %d after unload, %d before"):format(
    kiln.mem.stats("cpu").reserved, base))
end)

os.execute("rm -rf '" .. dir .. "'")
H.done()
