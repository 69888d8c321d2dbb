-- A budget that changes while a pipeline runs, on the sim device with the demo model:
-- lowered at a sampler step or between the VAE's blocks (kiln.suspend_point is where it
-- takes effect: evict, then stream, then smaller work), the run finishes inside the new
-- budget (the allocator's peak from compliance on) with the same picture where only the
-- weights' residency changed, and within a bound where the tiles had to change; raised,
-- the next stage uses the room; a model evicted between two forward passes streams to
-- its device instead of computing from the mapped file on the cpu. (Lowering from
-- another thread of a host, and suspend / resume: tests/test_live.c.)
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local imgcmp = require "imgcmp"
local test, eq, truthy = H.test, H.eq, H.truthy

local MODEL = "examples/models/kiln-shapes.safetensors"
local MiB = 1024 * 1024
local LIVE = { live = true } -- a change reaching the run in progress, as a host's from its thread

local function present(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local ckpt = present(MODEL) and kiln.load_checkpoint(MODEL) or nil
local function need_model()
  if not ckpt then H.skip("the demo model is not in examples/models (run from the source tree)") end
end

-- Largest |a - b| (0 for the same picture bit for bit).
local function max_diff(a, b)
  local d = a - b
  local m = math.max(d:max(), -d:min())
  d:free()
  return m
end

-- txt2img on sim; on_step(i) runs at each sampler step (after its suspend point).
local function txt2img(on_step)
  kiln.memory_mode("normal")
  return kiln.pipeline.txt2img(ckpt, {
    prompt = "a red circle on a blue background", seed = 7, steps = 4, width = 64, height = 64, device = "sim",
    callback = on_step and function(st) on_step(st.i) end,
  })
end

-- Sets sim's budget at the start of each test and back to unlimited at its end.
local function with_budget(bytes, fn)
  kiln.mem.set_budget("sim", bytes)
  local ok, err = pcall(fn)
  kiln.mem.set_budget("sim", 0)
  if not ok then error(err, 0) end
end

local reference
local function ref_image()
  if not reference then
    with_budget(0, function()
      local img, lat = txt2img()
      lat:free()
      reference = img
    end)
  end
  return reference
end

test("live budget: txt2img lowered at a step streams the UNet, same picture, inside the budget", function()
  need_model()
  local ref = ref_image()
  with_budget(0, function()
    local low = 6 * MiB
    local reserved_then
    local img, lat = txt2img(function(i)
      if i == 2 then
        reserved_then = kiln.mem.stats("sim").reserved
        kiln.mem.set_budget("sim", low, LIVE)
      end
    end)
    lat:free()
    truthy(reserved_then > low, "the budget was lowered below what the run held (" .. reserved_then .. ")")
    local w = kiln.mem.budget_watch("sim")
    truthy(w.compliance_seconds, "reserved fell within the new budget")
    truthy(w.peak_since <= low, ("peak after compliance %d <= budget %d"):format(w.peak_since, low))
    eq(ckpt.unet.streamed, true, "the UNet was turned to streaming")
    eq(max_diff(img, ref), 0, "same picture as the unchanged run")
    img:free()
    print(("# txt2img: budget lowered to %s, compliant after %.3f ms"):format(kiln.format_bytes(low),
      w.compliance_seconds * 1000))
  end)
end)

test("live budget: raised again mid-run, the next stage loads whole", function()
  need_model()
  local ref = ref_image()
  with_budget(0, function()
    local img, lat = txt2img(function(i)
      if i == 1 then kiln.mem.set_budget("sim", 6 * MiB, LIVE) end
      if i == 3 then kiln.mem.set_budget("sim", 0) end
    end)
    lat:free()
    eq(max_diff(img, ref), 0, "same picture")
    img:free()
    -- the next run's UNet stage has the room: loaded whole, not streamed
    local whole
    img, lat = txt2img(function(i) if i == 1 then whole = ckpt.unet:bytes("sim") end end)
    lat:free()
    truthy(whole > 0 and not ckpt.unet.streamed, "the UNet is resident in the next run")
    eq(max_diff(img, ref), 0, "same picture")
    img:free()
  end)
end)

-- A tiled VAE decode of a fixed latent; lower(n) is called at each suspend point.
local function decode(lower)
  kiln.memory_mode("normal")
  -- a smooth latent (as a picture's): tilings of it differ by little
  local z0 = kiln.randn({ 1, 4, 8, 8 }, { seed = 1 }) * 0.5
  local z = kiln.nn.upsample_nearest(z0, 8):to("sim")
  z0:free()
  ckpt.vae:load("sim")
  local sp = kiln.suspend_point
  local n = 0
  if lower then
    kiln.suspend_point = function()
      n = n + 1
      lower(n)
      return sp()
    end
  end
  local ok, img = pcall(ckpt.vae.decode, ckpt.vae, z, { tile = 16, overlap = 4 })
  kiln.suspend_point = sp
  ckpt.vae:unload()
  z:free()
  if not ok then error(img, 0) end
  local host = img:to("cpu") -- compared on the host, outside the budget
  img:free()
  return host
end

test("live budget: tiled VAE decode lowered between blocks streams the VAE, same picture", function()
  need_model()
  with_budget(0, function()
    local ref = decode()
    local low = 6 * MiB
    local img = decode(function(n) if n == 3 then kiln.mem.set_budget("sim", low, LIVE) end end)
    local w = kiln.mem.budget_watch("sim")
    truthy(w.compliance_seconds and w.peak_since <= low, ("peak after compliance %d <= %d"):format(w.peak_since, low))
    eq(max_diff(img, ref), 0, "same picture")
    img:free(); ref:free()
  end)
end)

-- Below what a tile of 16 needs even streamed: the decode runs out of memory after
-- the grace and answers with smaller tiles (its retry, and the mid block's attention
-- per tile), as a decode started at that budget does; the tiles differ, so the bound:
-- as close to the unchanged decode as the decode started at that budget, within 3 dB.
test("live budget: tiled VAE decode lowered below its tiles' needs finishes inside, as good as a run at that budget", function()
  need_model()
  local low = 3 * MiB
  local ref, at_low
  with_budget(0, function() ref = decode() end)
  with_budget(low, function() at_low = decode() end)
  with_budget(0, function()
    local img = decode(function(n) if n == 3 then kiln.mem.set_budget("sim", low, LIVE) end end)
    local w = kiln.mem.budget_watch("sim")
    truthy(w.compliance_seconds and w.peak_since <= low, ("peak after compliance %d <= %d"):format(w.peak_since, low))
    local p, p_low = imgcmp.psnr(img, ref), imgcmp.psnr(at_low, ref)
    truthy(p >= p_low - 3, ("PSNR %.1f dB against the unchanged decode; a decode started at that budget: %.1f dB")
      :format(p, p_low))
    print(("# tiled decode lowered to %s: PSNR %.1f dB (started at that budget: %.1f dB)"):format(
      kiln.format_bytes(low), p, p_low))
    img:free(); ref:free(); at_low:free()
  end)
end)

test("live budget: a loaded UNet evicted between passes streams to its device", function()
  need_model()
  kiln.memory_mode("normal")
  local x = kiln.randn({ 1, 4, 8, 8 }, { seed = 3 }):to("sim")
  local t = kiln.tensor({ 500 })
  local ctx = kiln.randn({ 1, 77, ckpt.unet.config.context_dim }, { seed = 4 }):to("sim")
  ckpt.unet:load("sim")
  local a = ckpt.unet:forward(x, t, ctx)
  kiln.mem.evict("sim", 1 << 40)
  eq(ckpt.unet:bytes("sim"), 0, "evicted")
  local b = ckpt.unet:forward(x, t, ctx)
  eq(b.device, "sim", "computed on the device it was loaded to")
  eq(max_diff(a, b), 0, "same numbers")
  ckpt.unet:unload()
  a:free(); b:free(); x:free(); ctx:free()
end)

test("suspend_point without a host and without a budget change is a no-op", function()
  kiln.suspend_point()
  local s = kiln.suspend_stats()
  eq(s.parks, 0)
  local w = kiln.mem.budget_watch("sim")
  eq(type(w.changes), "number")
  eq(w.grace, false)
end)

if reference then reference:free() end
if ckpt then ckpt.clip:close(); ckpt.unet:close(); ckpt.vae:close() end
