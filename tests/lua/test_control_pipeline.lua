-- ControlNets in the pipelines (opts.control): the tiny SD 1.x checkpoint with the
-- tiny golden ControlNet (the recipe of tests/golden/controlnet/sd1.recipe): strength
-- 0 and stop = 0 leave the image as without, strength 1 and a part of the schedule
-- change it, two halves equal one whole, the denoiser's CFG step equals a hand-built
-- one, img2img and hires fix take it, and bad entries are named.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"
local test, eq, raises = H.test, H.eq, H.raises

local T = require "tiny_sd"

-- the recipe saved as a ControlNet file (original layout)
local function cn_file()
  local t = T.build_recipe("../controlnet/sd1")
  local p = T.tmp("cn.safetensors")
  kiln.save_safetensors(p, t, { ["kiln.heads.unet"] = "2" })
  return p
end

local CN = cn_file()
local CK = T.ckpt_file("sd1")
-- a hint image at another size than 8x the latent (resized by the pipeline)
local IMG = kiln.rand and kiln.rand({ 1, 3, 48, 48 }, { seed = 7 })
  or (kiln.randn({ 1, 3, 48, 48 }, { seed = 7 }) * 0.25 + 0.5):clamp(0, 1)
local BASE = { prompt = "a red circle", negative = "blur", steps = 2, width = 32, height = 32, seed = 1, cfg = 5 }

local function with(extra)
  local o = {}
  for k, v in pairs(BASE) do o[k] = v end
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

local function maxdiff(a, b)
  eq(table.concat(a.shape, ","), table.concat(b.shape, ","), "shape")
  return (a - b):abs():max()
end

local ck <close> = kiln.load_checkpoint(CK)
local cn <close> = kiln.load_controlnet(CN)
local plain = pipeline.txt2img(ck, with())

test("control pipeline: strength 0 gives the uncontrolled image", function()
  local img = pipeline.txt2img(ck, with({ control = { { net = cn, image = IMG, strength = 0 } } }))
  eq(maxdiff(img, plain), 0)
end)

test("control pipeline: stop = 0 never applies", function()
  local img = pipeline.txt2img(ck, with({ control = { { net = cn, image = IMG, start = 0, stop = 0 } } }))
  eq(maxdiff(img, plain), 0)
end)

local full
test("control pipeline: strength 1 changes the image; part of the schedule differs from both", function()
  full = pipeline.txt2img(ck, with({ control = { { net = cn, image = IMG } } }))
  assert(maxdiff(full, plain) > 1e-4, "a control changes the image")
  -- the first of the 2 steps only (sigma of the 2nd step lies below the 40% point)
  local part = pipeline.txt2img(ck, with({ control = { { net = cn, image = IMG, start = 0, stop = 0.4 } } }))
  assert(maxdiff(part, plain) > 1e-6, "the first step is controlled")
  assert(maxdiff(part, full) > 1e-6, "the last step is not")
end)

test("control pipeline: two nets at 0.5 equal one at 1", function()
  local two = pipeline.txt2img(ck, with({ control = {
    { net = cn, image = IMG, strength = 0.5 }, { net = cn, image = IMG, strength = 0.5 } } }))
  assert(maxdiff(two, full) < 1e-5, "summed residuals")
end)

test("control pipeline: the denoiser's CFG step = unet:forward with cn:forward's residuals", function()
  local cond = kiln.randn({ 1, 77, 64 }, { seed = 3 })
  local uncond = kiln.randn({ 1, 77, 64 }, { seed = 4 })
  local x = kiln.randn({ 1, 4, 4, 4 }, { seed = 5 })
  local sigma, cfg = 2.5, 4
  local hint = kiln.nn.interpolate(IMG, { size = { 32, 32 }, mode = "bilinear" })
  local controls = { { net = cn, hint = hint, strength = 0.8, sigma_hi = math.huge, sigma_lo = 0 } }
  local den = pipeline.denoiser(ck, cond, uncond, cfg, { controls = controls, batch_cfg = true })
  local got = den(x, sigma)
  local ms = pipeline.model_sampling(ck)
  local xs = x * (1 / math.sqrt(sigma * sigma + 1))
  local xx = kiln.cat({ xs, xs }, 1)
  local t = kiln.full({ 2 }, ms.timestep(sigma))
  local ctx = kiln.cat({ uncond, cond }, 1)
  local res = cn:forward(xx, t, ctx, hint, { strength = 0.8 })
  local eps = ck.unet:forward(xx, t, ctx, nil, { control = res })
  local u = x - eps:narrow(1, 1, 1) * sigma
  local c = x - eps:narrow(1, 2, 1) * sigma
  local want = u + (c - u) * cfg
  assert(maxdiff(got, want) < 1e-5, "batched CFG")
  -- two UNet calls (cond and uncond apart): the same
  local den2 = pipeline.denoiser(ck, cond, uncond, cfg, { controls = controls, batch_cfg = false })
  assert(maxdiff(den2(x, sigma), want) < 1e-4, "unbatched CFG")
  -- outside the net's sigma range: the plain denoiser
  controls[1].sigma_lo = 3
  local plain_den = pipeline.denoiser(ck, cond, uncond, cfg, { batch_cfg = true })
  eq(maxdiff(den(x, sigma), plain_den(x, sigma)), 0)
end)

test("control pipeline: img2img and hires fix take controls", function()
  local a = pipeline.img2img(ck, plain, with({ denoise = 0.7 }))
  local b = pipeline.img2img(ck, plain, with({ denoise = 0.7, control = { { net = cn, image = IMG } } }))
  assert(maxdiff(a, b) > 1e-6, "img2img controlled")
  local h = pipeline.hires_fix(ck, with({ scale = 2, hires_steps = 1, control = { { net = cn, image = IMG } } }))
  eq(table.concat(h.shape, ","), "1,3,64,64")
  local h0 = pipeline.hires_fix(ck, with({ scale = 2, hires_steps = 1 }))
  assert(maxdiff(h, h0) > 1e-6, "hires fix controlled")
end)

test("control pipeline: bad entries are named", function()
  raises(function() pipeline.txt2img(ck, with({ control = { { image = IMG } } })) end, "control[1]: net must be")
  raises(function() pipeline.txt2img(ck, with({ control = { { net = cn } } })) end, "control[1]: image must be")
  raises(function() pipeline.txt2img(ck, with({ control = { { net = cn, image = "in.png" } } })) end,
    "image must be an image tensor")
  raises(function() pipeline.txt2img(ck, with({ control = { { net = cn, image = kiln.zeros({ 3, 8, 8 }) } } })) end,
    "image must be an image tensor")
  local xl = { forward = cn.forward, config = { family = "sdxl" } } -- an SDXL ControlNet's config, on SD 1.x
  if ck.family == "sd1" then
    raises(function() pipeline.txt2img(ck, with({ control = { { net = xl, image = IMG } } })) end,
      "control[1]: a ControlNet for SDXL on an SD 1.x checkpoint")
  end
  raises(function() pipeline.txt2img(ck, with({ control = { { net = cn, image = IMG, stop = 2 } } })) end,
    "stop must lie in")
end)

test("control pipeline: examples/controlnet.lua writes a picture; a missing file is a usage error", function()
  local exe = arg and arg[-1]
  if not exe then H.skip("no kiln program in arg[-1]") end
  local src = T.tmp("hint.png")
  kiln.save_png(IMG, src)
  local out, log = T.tmp("cn-out.png"), T.tmp("cn.log")
  local base = ("'%s' examples/controlnet.lua --model '%s' --steps 1 --width 32 --height 32 --quiet --out '%s'")
    :format(exe, CK, out)
  local ok = os.execute(("%s --control '%s' --control-image '%s' --canny --control-strength 0.7 >'%s' 2>&1")
    :format(base, CN, src, log))
  assert(ok, "the example failed")
  local img <close> = kiln.load_png(out)
  eq(img.shape[3], 32)
  local _, _, code = os.execute(("%s --control '%s.none' --control-image '%s' >'%s' 2>&1"):format(base, CN, src, log))
  eq(code, 2, "exit status")
  local f = assert(io.open(log))
  local text = f:read("a")
  f:close()
  assert(text:find("kiln: --control " .. CN .. ".none: no such file or folder", 1, true), text)
end)

test("control pipeline: an SDXL ControlNet steers the SDXL pipeline (y passed to the net)", function()
  local t = T.build_recipe("../controlnet/sdxl")
  local p = T.tmp("cn-sdxl.safetensors")
  kiln.save_safetensors(p, t, { ["kiln.head_dim.unet"] = "16" })
  for _, v in pairs(t) do v:free() end
  local xn <close> = kiln.load_controlnet(p)
  local xk <close> = kiln.load_checkpoint(T.ckpt_file("sdxl"))
  local a = pipeline.txt2img(xk, with())
  local b = pipeline.txt2img(xk, with({ control = { { net = xn, image = IMG } } }))
  local z = pipeline.txt2img(xk, with({ control = { { net = xn, image = IMG, strength = 0 } } }))
  H.truthy(maxdiff(a, b) > 1e-3, "the net changes the picture")
  eq(maxdiff(a, z), 0, "strength 0: the uncontrolled picture")
  raises(function() pipeline.txt2img(ck, with({ control = { { net = xn, image = IMG } } })) end,
    "a ControlNet for SDXL")
  a:free(); b:free(); z:free()
end)

test("control pipeline: --mode auto counts the ControlNet and the batch; the run stays inside its budget", function()
  local planner = require "kiln.planner"
  local MiB = 1024 * 1024
  kiln.mem.set_budget("sim", 1024 * MiB)
  local base = { device = "sim", width = 64, height = 64, cfg = 3 }
  local function plan(extra)
    local o = {}
    for k, v in pairs(base) do o[k] = v end
    for k, v in pairs(extra or {}) do o[k] = v end
    return planner.choose(ck, o)
  end
  local p0 = plan()
  local p1 = plan({ control = { { net = cn, image = IMG } } })
  local p2 = plan({ control = { { net = cn, image = IMG } }, batch = 4 })
  local pz = plan({ control = { { net = cn, image = IMG, strength = 0 } } })
  kiln.mem.set_budget("sim", 0)
  local cn_bytes = planner.part_bytes(cn)
  H.truthy(cn_bytes > 0, "the ControlNet has weights")
  -- high: all weights + the largest work; the net adds its weights and its residuals
  H.truthy(p1.need.high >= p0.need.high + cn_bytes, ("high: %.0f with, %.0f without, net %.0f"):format(p1.need.high,
    p0.need.high, cn_bytes))
  H.truthy(p1.need.normal >= p0.need.normal + cn_bytes, "normal: the UNet stage holds the net's weights too")
  H.truthy(p2.need.low > p1.need.low, ("low: a batch of 4 needs more work (%.0f, batch 1 %.0f)"):format(p2.need.low,
    p1.need.low))
  -- (the measured work moves by a few KiB from one measurement to the next)
  H.truthy(math.abs(pz.need.high - p0.need.high) < cn_bytes / 4,
    ("a net at strength 0 is not run, so not counted: %.0f with it, %.0f without"):format(pz.need.high, p0.need.high))
  local text = table.concat(p2.lines, "\n")
  H.truthy(text:find("cn1", 1, true) and text:find("with unet", 1, true), text)
  H.truthy(text:find("batch of 4", 1, true), text)
  -- a budget between what low and normal need: auto picks low and the run fits
  local room = kiln.mem.stats("sim").allocated + math.floor(((p1.need.low + p1.need.normal) / 2 + 2 * MiB) / 0.9)
  kiln.mem.set_budget("sim", room)
  kiln.mem.reset_peak("sim")
  local ok, img = pcall(pipeline.txt2img, ck, with({ device = "sim", mode = "auto", width = 64, height = 64,
    control = { { net = cn, image = IMG } } }))
  local peak, mode = kiln.mem.stats("sim").peak, kiln.memory_mode()
  kiln.mem.set_budget("sim", 0)
  kiln.memory_mode("normal")
  assert(ok, img)
  eq(mode, "low")
  H.truthy(peak <= room, ("peak %.0f over the budget %.0f"):format(peak, room))
  img:free()
end)

T.cleanup()
H.done()
