-- Prompt length: clip:encode's time is linear in the prompt (four times the chunks
-- take at most 4.5 times as long, for the bracket forms that were quadratic: escapes,
-- colons and unclosed brackets), and a prompt longer than the limit (32 chunks of 75
-- tokens unless raised) is an error naming the limit and how to raise it.
-- Timings use the tiny SD 1.x text encoder (so the text's own processing, where the
-- quadratic was, is most of the time) with the demo model's CLIP tokenizer.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local clip = require "kiln.clip"
local pipeline = require "kiln.pipeline"
local T = require "tiny_sd"
local test, eq, truthy = H.test, H.eq, H.truthy

local MODEL = H.demo_model("demo model present")
local demo <close> = kiln.load_checkpoint(MODEL)
local tiny <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
tiny.clip.tokenizer = demo.clip.tokenizer
tiny.clip:load("cpu")

-- the best of `runs` timings of fn(), in CPU time (os.clock): steadier than the wall
-- clock on a machine whose cores other processes share
local function best(fn, runs)
  local b = math.huge
  for _ = 1, runs or 3 do
    collectgarbage()
    local t0 = os.clock()
    fn()
    b = math.min(b, os.clock() - t0)
  end
  return b
end

-- the best of seven timings of encoding each text, the two taken in turn (a machine
-- busy with other work slows both alike)
local function encode_times(a, na, b, nb)
  for _, t in ipairs({ { a, na }, { b, nb } }) do
    local z = tiny.clip:encode(t[1], { max_chunks = math.huge })
    eq(z.shape[2], 77 * t[2], "chunks")
    z:free()
  end
  local ta, tb = math.huge, math.huge
  for _ = 1, 7 do
    ta = math.min(ta, best(function() tiny.clip:encode(a, { max_chunks = math.huge }):free() end, 1))
    tb = math.min(tb, best(function() tiny.clip:encode(b, { max_chunks = math.huge }):free() end, 1))
  end
  return ta, tb
end

local report = {}
-- group: one repeat unit; n: repeats of the small prompt (the large has 4n)
local function linear(what, group, n)
  local small, large = group:rep(n), group:rep(4 * n)
  local cs = #clip.chunks(clip.parse_emphasis(small), function(s) return demo.clip.tokenizer:encode(s) end)
  local cl = #clip.chunks(clip.parse_emphasis(large), function(s) return demo.clip.tokenizer:encode(s) end)
  truthy(cl >= 4 * cs - 1, ("%s: %d and %d chunks"):format(what, cs, cl))
  -- a busy machine (other processes on its cores) can stretch a whole measurement:
  -- up to five rounds, the best ratio counts (a quadratic encode fails every round)
  local ts, tl
  for _ = 1, 5 do
    local a, b = encode_times(small, cs, large, cl)
    if not ts or b / a < tl / ts then ts, tl = a, b end
    if tl <= 4.5 * ts then break end
  end
  report[#report + 1] = ("%s: %d chunks %.3f s, %d chunks %.3f s (x%.2f)"):format(what, cs, ts, cl, tl, tl / ts)
  truthy(tl <= 4.5 * ts, ("%s: %d chunks took %.3f s, %d chunks %.3f s: x%.2f > 4.5"):format(what, cs, ts, cl, tl, tl / ts))
end

test("encode is linear: escaped brackets", function() linear("escapes", "\\(a\\) ", 500) end)
test("encode is linear: colons", function() linear("colons", "a:b ", 500) end)
test("encode is linear: emphasis groups", function() linear("groups", "(red circle:1.2) [blue] ", 600) end)

test("parse is linear: unclosed brackets", function()
  -- the Lua parse alone: CPU time (os.clock), steadier than the wall clock here
  local small, large = ("(a "):rep(24000), ("(a "):rep(96000)
  local ts, tl
  for _ = 1, 3 do                   -- rounds, as linear() above
    local a, b = math.huge, math.huge
    for _ = 1, 7 do
      collectgarbage()
      local t0 = os.clock()
      clip.parse_emphasis(small)
      local t1 = os.clock()
      clip.parse_emphasis(large)
      a, b = math.min(a, t1 - t0), math.min(b, os.clock() - t1)
    end
    if not ts or b / a < tl / ts then ts, tl = a, b end
    if tl <= 4.5 * ts then break end
  end
  report[#report + 1] = ("unclosed parse: 24000 %.3f s, 96000 %.3f s (x%.2f)"):format(ts, tl, tl / ts)
  truthy(tl <= 4.5 * ts, ("unclosed: x%.2f > 4.5"):format(tl / ts))
  -- the weights are still the brackets' product: ((1.0 * 1.1) * 1.1) ... as A1111
  local p = clip.parse_emphasis("(a (b (c")
  eq(p[1][2], 1.1); eq(p[2][2], 1.1 * 1.1); eq(p[3][2], 1.1 * 1.1 * 1.1)
end)

test("limit: 32 chunks by default; a longer prompt names the limit and how to raise it", function()
  eq(clip.max_chunks, 32)
  local ok32 = ("a "):rep(75 * 32)
  local z = tiny.clip:encode(ok32)
  eq(z.shape[2], 77 * 32)
  z:free()
  local e = H.raises(function() tiny.clip:encode(ok32 .. "a") end,
    "33 chunks of 75 tokens (2401 tokens), over the limit of 32 chunks",
    "clip:encode(text, {max_chunks = N})", 'require("kiln.clip").max_chunks = N')
  truthy(type(e) == "string")
  -- BREAK makes chunks too
  H.raises(function() tiny.clip:encode(("a BREAK "):rep(40)) end, "40 chunks")
  -- raised for one call, or for the module
  local z2 = tiny.clip:encode(ok32 .. "a", { max_chunks = 33 })
  eq(z2.shape[2], 77 * 33)
  z2:free()
  clip.max_chunks = 2
  local ok, err = pcall(tiny.clip.encode, tiny.clip, ("a "):rep(151))
  clip.max_chunks = 32
  truthy(not ok and tostring(err):find("over the limit of 2 chunks", 1, true), tostring(err))
  H.raises(function() tiny.clip:encode("a", { max_chunks = 0 }) end, "max_chunks 0: must be a whole number from 1")
  H.raises(function() tiny.clip:encode("a", { max_chunks = 2.5 }) end, "max_chunks 2.5")
end)

test("limit: a pipeline run with a prompt over the limit fails before sampling", function()
  local t0 = kiln.time()
  H.raises(function()
    pipeline.txt2img(demo, { prompt = ("\\(a\\) "):rep(20000), steps = 2, width = 32, height = 32 })
  end, "over the limit of 32 chunks")
  truthy(kiln.time() - t0 < 5, "refused quickly")
  eq(demo.clip:bytes("cpu") + demo.unet:bytes("cpu"), 0, "the run's parts unloaded")
end)

for _, l in ipairs(report) do print("# " .. l) end
tiny.clip:unload()
T.cleanup()
H.done()
