-- Partial residency (part:load(dev, {resident = bytes})) on the sim device: the tiny
-- SD 1.x UNet keeps its largest blocks on the device once fetched and streams the
-- rest at each forward, in any memory mode; the output equals the fully loaded one
-- bit for bit; kiln.mem.stats(dev).copied_in counts the bytes each forward copies in
-- (all of them at 0, none at 100 %, the streamed share in between); a size above the
-- budget is lowered with a note; bad values are named.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, eq, truthy, raises = H.test, H.eq, H.truthy, H.raises

local T = require "tiny_sd"

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
local x, t, ctx = T.inputs(64)

-- one forward on sim: the output (on the host) and the bytes copied onto sim for it
local function forward()
  kiln.mem.reset_peak("sim")
  local out = ck.unet:forward(x, t, ctx)
  local copied = kiln.mem.stats("sim").copied_in
  local host = out:to("cpu")
  out:free()
  return host, copied
end

test("residency: 0 / part / all of the UNet; same output, copied_in by the streamed share", function()
  if not has_sim then H.skip("no sim device in this build") end
  kiln.memory_mode("normal")
  ck.unet:load("sim")
  local ref = forward()           -- first forward: loads
  local _, copied_full = forward()
  ck.unet:unload()
  local total = ck.unet.streamer:total_bytes(ck.unet.model)
  local inputs = copied_full      -- x, t and context copied in by every forward
  truthy(inputs < total / 4, ("a loaded UNet copies only its inputs (%d bytes)"):format(inputs))
  for _, frac in ipairs({ 0, 0.25, 0.5, 0.75 }) do
    ck.unet:load("sim", { resident = math.floor(total * frac) })
    eq(ck.unet.streamed, true, "streamed")
    local first, c1 = forward()
    local out, c2 = forward()
    local _, kept = ck.unet.streamer:resident_blocks(ck.unet.model)
    ck.unet:unload()
    truthy(kept <= total * frac, "resident blocks within the bytes asked")
    truthy(kept >= total * frac - total / 4, ("resident %d of %d asked"):format(kept, math.floor(total * frac)))
    eq(H.maxdiff(first, ref), 0, "first forward at " .. frac)
    eq(H.maxdiff(out, ref), 0, "second forward at " .. frac)
    -- the first forward copies every block; later ones only the streamed ones
    truthy(c1 >= total, ("first forward at %.2f copies all (%d of %d)"):format(frac, c1, total))
    eq(c2 - inputs, total - kept, ("second forward at %.2f copies the streamed blocks"):format(frac))
    first:free(); out:free()
  end
  -- at or above the model's bytes: loaded whole, like a plain load
  ck.unet:load("sim", { resident = 2 * total })
  eq(ck.unet.streamed, false, "whole")
  forward()
  local _, c = forward()
  eq(c, inputs, "nothing streamed")
  ck.unet:unload()
  -- a plain load clears the residency
  ck.unet:load("sim", { resident = 0 })
  ck.unet:load("sim")
  eq(ck.unet.streamed, false, "cleared")
  ck.unet:unload()
  ref:free()
end)

test("residency: in low mode too; a size above the budget is lowered", function()
  if not has_sim then H.skip("no sim device in this build") end
  kiln.memory_mode("low")
  local total = ck.unet.streamer:total_bytes(ck.unet.model)
  ck.unet:load("sim", { resident = math.floor(total / 2) })
  local out = ck.unet:forward(x, t, ctx)
  local _, kept = ck.unet.streamer:resident_blocks(ck.unet.model)
  truthy(kept > 0 and kiln.mem.stats("sim").allocated >= kept, "low mode keeps the resident blocks")
  out:free()
  ck.unet:unload()
  -- the budget leaves room for half the weights beside the streaming window
  local _, window = ck.unet.streamer:_sizes(ck.unet.model)
  kiln.mem.set_budget("sim", kiln.mem.stats("sim").allocated + window + math.floor(total / 2))
  local was = kiln.quiet()
  kiln.set_quiet(true)
  ck.unet:load("sim", { resident = total - 1 })
  kiln.set_quiet(was)
  _, kept = ck.unet.streamer:resident_blocks(ck.unet.model)
  truthy(kept <= total / 2, ("lowered under the budget: %d of %d"):format(kept, total))
  ck.unet:unload()
  kiln.mem.set_budget("sim", 0)
  kiln.memory_mode("normal")
end)

test("residency: --mode auto keeps what the budget leaves of the UNet; fewer bytes copied, inside the budget", function()
  if not has_sim then H.skip("no sim device in this build") end
  local pipeline = require "kiln.pipeline"
  local planner = require "kiln.planner"
  local MiB = 1024 * 1024
  local base = { prompt = "a red circle", negative = "blur", steps = 3, width = 32, height = 32, seed = 1, cfg = 5,
    device = "sim" }
  kiln.mem.set_budget("sim", 1024 * MiB)
  local need = planner.choose(ck, base).need
  kiln.mem.set_budget("sim", 0)
  -- a budget between what low and normal need: low mode with part of the UNet resident
  local room = kiln.mem.stats("sim").allocated + math.floor(((need.low + need.normal) / 2 + 2 * MiB) / 0.9)
  local function run(mode)
    local o = {}
    for k, v in pairs(base) do o[k] = v end
    o.mode = mode
    kiln.mem.set_budget("sim", room)
    kiln.mem.reset_peak("sim")
    local was = kiln.quiet()
    kiln.set_quiet(true)
    if mode == "low" then kiln.memory_mode("low"); o.mode = nil end
    local ok, img = pcall(pipeline.txt2img, ck, o)
    kiln.set_quiet(was)
    local st = kiln.mem.stats("sim")
    kiln.mem.set_budget("sim", 0)
    local m = kiln.memory_mode()
    kiln.memory_mode("normal")
    assert(ok, img)
    return img, st, m
  end
  local auto, sa, mode = run("auto")
  local low, sl = run("low")
  eq(mode, "low")
  truthy(sa.peak_reserved <= room, ("auto: peak %d over the budget %d"):format(sa.peak_reserved, room))
  truthy(sa.copied_in < sl.copied_in, ("auto copied %d bytes, plain low %d"):format(sa.copied_in, sl.copied_in))
  eq(H.maxdiff(auto, low), 0, "same picture")
  auto:free(); low:free()
  -- an explicit mode drops the plan
  local img = pipeline.txt2img(ck, base)
  eq(ck.unet.resident_plan, nil, "no plan after an explicit run")
  img:free()
end)

test("residency: bad values are named", function()
  raises(function() ck.unet:load("sim", { resident = -1 }) end, "resident must be a number of bytes")
  raises(function() ck.unet:load("sim", { resident = "lots" }) end, "resident 'lots'")
  raises(function() ck.clip:load("sim", { resident = 0 }) end, "resident needs a network streamed block by block")
  raises(function() ck.unet.model:load("sim", { resident = 0 }) end, "resident applies to a network")
end)

test("residency: low mode on the demo model: all of it loads whole, half streams half, 0 streams all", function()
  if not has_sim then H.skip("no sim device in this build") end
  local demo <close> = kiln.load_checkpoint(H.demo_model("residency on the demo model"))
  local unet = demo.unet
  kiln.memory_mode("low")
  local total = unet.streamer:total_bytes(unet.model)
  -- the bytes the second of two forwards copies onto sim (the first fetches the
  -- resident blocks); the inputs are on the host, so they are copied in too
  local function second(resident)
    unet:load("sim", { resident = resident })
    unet:forward(x, t, ctx):free()
    kiln.mem.reset_peak("sim")
    unet:forward(x, t, ctx):free()
    local c = kiln.mem.stats("sim").copied_in
    local on = unet:bytes("sim")
    unet:unload()
    return c, on
  end
  local ok, err = pcall(function()
    local c0 = second(0)
    local inputs = c0 - total
    truthy(inputs >= 0 and inputs < total / 4, ("resident 0 copies every block (%d of %d)"):format(c0, total))
    local call, on = second(total)
    eq(call, inputs, ("resident = the model's bytes: a forward copies only its inputs (%d of %d)"):format(call, total))
    truthy(on >= total, ("resident = the model's bytes stays on sim (%d of %d)"):format(on, total))
    eq(second(2 * total), inputs, "resident above the model's bytes: nothing streamed")
    local chalf = second(math.floor(total / 2))
    truthy(chalf - inputs >= total / 2 - total / 8 and chalf - inputs <= total / 2 + total / 4,
      ("resident = half copies about the other half (%d of %d)"):format(chalf - inputs, total))
  end)
  kiln.memory_mode("normal")
  assert(ok, err)
end)

x:free(); t:free(); ctx:free()
T.cleanup()
H.done()
