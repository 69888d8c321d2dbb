-- Every pipeline runs on opts.device alone: with the default device left on the CPU,
-- a run given device = "sim" computes there (its noise, a sampler's noise, the masks)
-- and gives the same pixels as the run on the CPU (sim runs the CPU kernels), and the
-- caller's default device is the same afterwards, after a failed run too.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"
local test, eq, truthy = H.test, H.eq, H.truthy

local MODEL = H.demo_model("demo model present")

local function opts(extra)
  local o = { prompt = "a red circle on a blue background", negative = "", steps = 2, seed = 11,
    width = 64, height = 64 }
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

-- an input picture: a bright square on grey, and a mask over its right half
local function picture()
  local img = kiln.full({ 1, 3, 64, 64 }, 0.4)
  local sq = img:narrow(3, 17, 24):narrow(4, 17, 24)
  sq:fill(0.9)
  sq:free()
  return img
end
local function right_half()
  local m = kiln.zeros({ 1, 1, 64, 64 })
  local r = m:narrow(4, 33, 32)
  r:fill(1)
  r:free()
  return m
end

-- run(device) -> image, latents; the sim run must be on sim and equal the CPU run
local function same_on_sim(run)
  eq(kiln.default_device(), "cpu", "default device before")
  local a, la = run(nil)
  local b, lb = run("sim")
  eq(kiln.default_device(), "cpu", "default device after")
  eq(a.device, "cpu", "the default run's image")
  eq(b.device, "sim", "the sim run's image")
  eq(lb.device, "sim", "the sim run's latents")
  local bc, lbc = b:to("cpu"), lb:to("cpu")
  eq(H.shape_of(bc), H.shape_of(a), "image shape")
  eq(H.maxdiff(bc, a), 0, "image: sim vs cpu")
  eq(H.maxdiff(lbc, la), 0, "latents: sim vs cpu")
  for _, t in ipairs({ a, la, b, lb, bc, lbc }) do t:free() end
end

local ck <close> = kiln.load_checkpoint(MODEL)

test("txt2img on sim, default cpu", function()
  same_on_sim(function(dev) return pipeline.txt2img(ck, opts({ device = dev })) end)
end)

test("txt2img on sim with an ancestral sampler (its noise on the run's device)", function()
  same_on_sim(function(dev)
    return pipeline.txt2img(ck, opts({ device = dev, sampler = "euler_ancestral", steps = 3 }))
  end)
end)

test("img2img on sim, default cpu (the input on the cpu)", function()
  local img <close> = picture()
  same_on_sim(function(dev) return pipeline.img2img(ck, img, opts({ device = dev, denoise = 0.7 })) end)
end)

test("hires_fix on sim, latent upscale", function()
  same_on_sim(function(dev)
    return pipeline.hires_fix(ck, opts({ device = dev, width = 32, height = 32, scale = 2, hires_steps = 2 }))
  end)
end)

test("hires_fix on sim, image upscale", function()
  same_on_sim(function(dev)
    return pipeline.hires_fix(ck, opts({ device = dev, width = 32, height = 32, scale = 2, upscale = "image" }))
  end)
end)

test("inpaint on sim, image and mask on the cpu", function()
  local img <close> = picture()
  local mask <close> = right_half()
  same_on_sim(function(dev) return pipeline.inpaint(ck, img, mask, opts({ device = dev })) end)
end)

test("tileable txt2img on sim", function()
  same_on_sim(function(dev) return pipeline.txt2img(ck, opts({ device = dev, tileable = "xy" })) end)
end)

test("a failed run on sim gives the default device back", function()
  H.raises(function() pipeline.txt2img(ck, opts({ device = "sim", width = 61 })) end, "multiples of")
  eq(kiln.default_device(), "cpu")
  local ok = pcall(pipeline.txt2img, ck, opts({ device = "sim", sampler = "no such sampler" }))
  truthy(not ok, "an unknown sampler fails")
  eq(kiln.default_device(), "cpu")
end)

H.done()
