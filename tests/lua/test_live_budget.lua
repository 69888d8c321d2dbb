-- A budget the script itself lowers between sampler steps (kiln.mem.set_budget from a
-- step callback, without {live = true}) below what the run needs: the pipeline evicts
-- the UNet between the steps (unpinned there) and it streams from its next pass, as a
-- live lowering turns it to streaming, so a run that can still fit finishes (it failed
-- with an out-of-memory while the UNet stayed resident). Raised mid-run, the rest of the
-- run and the next one use the room. The demo model at 128x128 on sim, normal mode.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, eq, truthy = H.test, H.eq, H.truthy

local MODEL = H.demo_model("demo model present")
local ckpt <close> = kiln.load_checkpoint(MODEL)

local function txt2img(on_step)
  kiln.memory_mode("normal")
  return kiln.pipeline.txt2img(ckpt, {
    prompt = "a red circle on a blue background", seed = 7, steps = 4, width = 128, height = 128, device = "sim",
    callback = on_step and function(st) on_step(st.i) end,
  })
end

local function max_diff(a, b)
  local d = a:to("cpu") - b:to("cpu")
  local m = math.max(d:max(), -d:min())
  d:free()
  return m
end

-- the unchanged run: its picture, latents and peak (allocated bytes on sim)
kiln.mem.set_budget("sim", 0)
kiln.mem.reset_peak("sim")
local ref_img, ref_lat = txt2img()
local PEAK = kiln.mem.stats("sim").peak

local function with_budget_reset(fn)
  local ok, err = pcall(fn)
  kiln.mem.set_budget("sim", 0)
  if not ok then error(err, 0) end
end

for _, how in ipairs({ "plain", "live" }) do
  test(("lowered to 65%% of the peak at step 2 (%s): the UNet streams, the run finishes inside"):format(how), function()
    with_budget_reset(function()
      local low = math.floor(PEAK * 0.65)
      kiln.mem.reset_peak("sim")
      local held, after
      local img, lat = txt2img(function(i)
        if i == 2 then
          held = ckpt.unet:bytes("sim")
          kiln.mem.set_budget("sim", low, how == "live" and { live = true } or nil)
        end
        if i == 3 then after = ckpt.unet:bytes("sim") end
      end)
      truthy(held > 0, "the UNet was resident when the budget fell")
      -- live: turned to streaming in its next pass; plain: evicted between the steps,
      -- it streams from its next pass
      truthy(ckpt.unet.streamed or after < held, ("the UNet streams (%d of %d bytes resident at step 3)")
        :format(after, held))
      local w = kiln.mem.budget_watch("sim")
      truthy(w.compliance_seconds, "reserved fell within the new budget")
      truthy(w.peak_since <= low, ("peak after compliance %d <= budget %d"):format(w.peak_since, low))
      -- streaming computes the same numbers; the decoder may tile in the smaller budget
      eq(max_diff(lat, ref_lat), 0, "same latents as the unchanged run")
      local d = max_diff(img, ref_img)
      print(("# %s: budget %.2f MiB of a %.2f MiB peak; tiled decode differs by %.4f"):format(how, low / 1048576,
        PEAK / 1048576, d))
      truthy(d < 0.25, "the picture within a tiled decode's bound: " .. d)
      img:free(); lat:free()
    end)
  end)
end

test("lowered at step 1 and raised at step 3 (plain): finishes; the next run loads the UNet whole", function()
  with_budget_reset(function()
    local img, lat = txt2img(function(i)
      if i == 1 then kiln.mem.set_budget("sim", math.floor(PEAK * 0.65)) end
      if i == 3 then kiln.mem.set_budget("sim", 0) end
    end)
    eq(max_diff(lat, ref_lat), 0, "same latents")
    eq(max_diff(img, ref_img), 0, "same picture: the decoder had the room again")
    img:free(); lat:free()
    local whole
    img, lat = txt2img(function(i) if i == 1 then whole = ckpt.unet:bytes("sim") end end)
    truthy(whole > 0 and not ckpt.unet.streamed, "the UNet is resident in the next run")
    eq(max_diff(img, ref_img), 0, "same picture")
    img:free(); lat:free()
  end)
end)

test("lowered at step 1, raised to a larger budget (not unlimited) at step 2", function()
  with_budget_reset(function()
    local held_at_1, held_at_2
    local img, lat = txt2img(function(i)
      if i == 1 then
        held_at_1 = ckpt.unet:bytes("sim")
        kiln.mem.set_budget("sim", math.floor(PEAK * 0.65))
      end
      if i == 2 then
        held_at_2 = ckpt.unet:bytes("sim")
        kiln.mem.set_budget("sim", PEAK * 4)
      end
    end)
    truthy(held_at_2 < held_at_1, ("streaming after the lowering: %d of %d bytes"):format(held_at_2, held_at_1))
    eq(max_diff(lat, ref_lat), 0, "same latents")
    eq(max_diff(img, ref_img), 0, "same picture: the decoder had the room again")
    eq(kiln.mem.budget_watch("sim").over, false, "within the raised budget")
    img:free(); lat:free()
  end)
end)

test("a plain lowering with no run in progress adapts nothing and is enforced at once", function()
  with_budget_reset(function()
    kiln.mem.set_budget("sim", 1024 * 1024)
    local w = kiln.mem.budget_watch("sim")
    eq(w.grace, false, "no grace")
    kiln.suspend_point()                 -- nothing open: nothing to stream
    local ok, err = pcall(kiln.zeros, { 1024, 1024 }, { device = "sim" })
    truthy(not ok and type(err) == "table" and err.kind == "oom", "4 MiB over a 1 MiB budget: " .. tostring(err))
  end)
end)

ref_img:free(); ref_lat:free()
H.done()
