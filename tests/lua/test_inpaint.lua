-- Inpainting and outpainting (kiln.inpaint, kiln.pipeline.inpaint) on the demo model
-- and the tiny SD 1.x checkpoint: pixels outside the mask come back bit for bit, an
-- empty mask gives the input, a full mask is img2img at denoise 1, the latent mask and
-- the masked denoiser against ComfyUI's formulas written out here, sizes, bad masks,
-- and ImagePadForOutpaint's padded size and mask.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local inpaint = require "kiln.inpaint"
local pipeline = require "kiln.pipeline"
local test, eq, raises = H.test, H.eq, H.raises

local function shape_of(t) return table.concat(t.shape, ",") end

-- a square of ones [y0, y0 + n) x [x0, x0 + n) (0-based) in a [1, 1, h, w] mask
local function square_mask(h, w, y0, x0, n)
  local m = kiln.zeros({ 1, 1, h, w })
  m:narrow(3, y0 + 1, n):narrow(4, x0 + 1, n):fill(1)
  return m
end

-- ---------------------------------------------------------------- no model

-- PyTorch's bilinear interpolation (align_corners = False), which ComfyUI's
-- prepare_mask uses to bring the noise mask to latent size.
local function bilinear_ref(vals, h, w, oh, ow)
  local out = {}
  local function src(o, scale, n)
    local s = (o + 0.5) * scale - 0.5
    if s < 0 then s = 0 end
    local i0 = math.floor(s)
    if i0 > n - 1 then i0 = n - 1 end
    local i1 = math.min(i0 + 1, n - 1)
    return i0, i1, s - i0
  end
  for y = 0, oh - 1 do
    local y0, y1, fy = src(y, h / oh, h)
    for x = 0, ow - 1 do
      local x0, x1, fx = src(x, w / ow, w)
      local function v(yy, xx) return vals[yy * w + xx + 1] end
      out[#out + 1] = (1 - fy) * ((1 - fx) * v(y0, x0) + fx * v(y0, x1)) + fy * ((1 - fx) * v(y1, x0) + fx * v(y1, x1))
    end
  end
  return out
end

test("latent mask: ComfyUI's bilinear interpolation to latent size", function()
  local h, w = 24, 32
  local vals = {}
  for i = 1, h * w do vals[i] = ((i * 37) % 101) / 100 end
  local m = kiln.tensor(vals):reshape({ 1, 1, h, w })
  local lm = inpaint.latent_mask(m, 3, 4)
  eq(shape_of(lm), "1,1,3,4")
  local got, want = lm:reshape({ 12 }):table(), bilinear_ref(vals, h, w, 3, 4)
  for i = 1, 12 do H.near(got[i], want[i], 1e-5, "value " .. i) end
end)

test("masked denoiser: KSamplerX0Inpaint's blend before and after the model", function()
  local x = kiln.randn({ 1, 4, 2, 3 }, { seed = 1 })
  local lat = kiln.randn({ 1, 4, 2, 3 }, { seed = 2 })
  local noise = kiln.randn({ 1, 4, 2, 3 }, { seed = 3 })
  local m = kiln.tensor({ 1, 0, 0.25, 0.5, 1, 0 }):reshape({ 1, 1, 2, 3 })
  local seen
  local den = inpaint.masked_denoiser(function(xin) seen = xin:clone(); return xin * 0.5 end, m, lat, noise)
  local out = den(x, 2.5)
  local want_in = x * m + (lat + noise * 2.5) * (1 - m)
  local want_out = want_in * 0.5 * m + lat * (1 - m)
  H.truthy(H.maxdiff(seen, want_in) < 1e-6, "model input")
  H.truthy(H.maxdiff(out, want_out) < 1e-6, "denoised output")
end)

test("feather: inward only, 0 stays 0, 1 everywhere stays 1", function()
  local m = square_mask(16, 16, 4, 4, 8)
  local f = inpaint.feather(m, 2)
  eq(((1 - m) * f):max(), 0, "nothing outside the mask")
  eq(f:narrow(3, 8, 2):narrow(4, 8, 2):min(), 1, "the middle fully repainted")
  H.truthy(f:narrow(3, 5, 1):narrow(4, 9, 1):item() < 1, "the edge faded")
  eq(inpaint.feather(kiln.ones({ 1, 1, 8, 8 }), 3):min(), 1, "ones stay ones")
end)

test("outpaint padding: size, edge pixels, ImagePadForOutpaint's mask", function()
  local h, w = 6, 8
  local img = kiln.randn({ 1, 3, h, w }, { seed = 4 }):clamp(0, 1)
  local p = { left = 2, right = 0, top = 1, bottom = 3, feather = 2 }
  local grown, mask = inpaint.outpaint_pad(img, p)
  eq(shape_of(grown), "1,3,10,10")
  eq(shape_of(mask), "1,1,10,10")
  H.truthy(H.maxdiff(grown:narrow(3, 2, h):narrow(4, 3, w), img) == 0, "the image in place")
  H.truthy(H.maxdiff(grown:narrow(4, 1, 1):narrow(3, 2, h), img:narrow(4, 1, 1)) == 0, "left edge repeated")
  -- ComfyUI's loop, written out
  local got = mask:reshape({ 100 }):table()
  for i = 0, 9 do
    for j = 0, 9 do
      local want = 1
      local y, x = i - p.top, j - p.left
      if y >= 0 and y < h and x >= 0 and x < w then
        local d = math.min(y, h - y, x, w) -- top, bottom, left grown; right not
        want = d < p.feather and ((p.feather - d) / p.feather) ^ 2 or 0
      end
      H.near(got[i * 10 + j + 1], want, 1e-6, ("mask at %d,%d"):format(i, j))
    end
  end
end)

test("mask from a PNG: alpha (transparent = repaint), else grey", function()
  local rgba = kiln.ones({ 1, 4, 2, 2 })
  rgba:narrow(2, 4, 1):narrow(3, 1, 1):fill(0)
  local m = inpaint.mask_of_png(rgba)
  eq(shape_of(m), "1,1,2,2")
  eq(m:sum(), 2)
  local rgb = kiln.full({ 1, 3, 2, 2 }, 0.5)
  eq(shape_of(inpaint.mask_of_png(rgb)), "1,1,2,2")
end)

-- ---------------------------------------------------------------- demo model

local MODEL = os.getenv("KILN_DEMO_MODEL") or "examples/models/kiln-shapes.safetensors"
local have_demo = io.open(MODEL, "rb")
if have_demo then have_demo:close() end

local ckpt, base
local function demo()
  if not have_demo then H.skip(MODEL .. " is missing") end
  if not ckpt then
    ckpt = kiln.load_checkpoint(MODEL)
    base = pipeline.txt2img(ckpt, { prompt = "a red circle", steps = 3, width = 64, height = 64, seed = 1 })
  end
  return ckpt, base
end

local O = { prompt = "a green star", steps = 3, seed = 2 }

test("demo: outside the mask bit-identical, inside re-drawn", function()
  local ck, img = demo()
  local m = square_mask(64, 64, 16, 16, 32)
  local out = pipeline.inpaint(ck, img, m, O)
  eq(shape_of(out), "1,3,64,64")
  eq(((out - img):abs() * (1 - m)):max(), 0, "outside")
  H.truthy(((out - img):abs() * m):max() > 0.05, "inside changed")
end)

test("demo: an empty mask gives the input back", function()
  local ck, img = demo()
  local out = pipeline.inpaint(ck, img, kiln.zeros({ 1, 1, 64, 64 }), O)
  eq(H.maxdiff(out, img), 0)
end)

test("demo: a full mask is img2img at denoise 1", function()
  local ck, img = demo()
  local out, lat = pipeline.inpaint(ck, img, kiln.ones({ 1, 1, 64, 64 }), O)
  local ref, rlat = pipeline.img2img(ck, img, { prompt = O.prompt, steps = 3, seed = 2, denoise = 1 })
  eq(H.maxdiff(lat, rlat), 0, "latents")
  eq(H.maxdiff(out, ref), 0, "image")
end)

test("demo: batch and denoise below 1 keep the outside", function()
  local ck, img = demo()
  local m = square_mask(64, 64, 8, 24, 24)
  local out = pipeline.inpaint(ck, img, m, { prompt = "a blue square", steps = 4, seed = 3, batch = 2, denoise = 0.7 })
  eq(shape_of(out), "2,3,64,64")
  eq(((out - img):abs() * (1 - m)):max(), 0, "outside")
end)

test("bad masks and sizes are errors", function()
  local img = kiln.zeros({ 1, 3, 64, 64 })
  raises(function() pipeline.inpaint({}, img, "mask.png", O) end, "mask must be a tensor")
  raises(function() pipeline.inpaint({}, img, kiln.zeros({ 1, 3, 64, 64 }), O) end, "mask has 3 channels")
  raises(function() pipeline.inpaint({}, img, kiln.zeros({ 1, 1, 32, 64 }), O) end, "mask is 64x32 pixels")
  raises(function() pipeline.inpaint({}, {}, kiln.zeros({ 1, 1, 64, 64 }), O) end, "image must be a tensor")
  local ck = demo()
  local f = pipeline.size_multiple(ck)
  raises(function() pipeline.inpaint(ck, kiln.zeros({ 1, 3, 8 * f + 1, 64 }), kiln.zeros({ 1, 1, 8 * f + 1, 64 }), O) end,
    "multiples of")
end)

-- ---------------------------------------------------------------- tiny SD 1.x

test("tiny SD 1.x: outside the mask bit-identical", function()
  local T = require "tiny_sd"
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  ck.clip.tokenizer = { -- no BPE needed: every prompt is empty
    encode = function() return {} end, bos = function() return 49406 end, eos = function() return 49407 end,
    token_id = function() return nil end,
  }
  local f = math.tointeger(ck.vae.factor)
  local S = 8 * f
  local img = kiln.randn({ 1, 3, S, S }, { seed = 7 }):clamp(0, 1)
  local m = square_mask(S, S, 2 * f, 3 * f, 4 * f)
  local out = pipeline.inpaint(ck, img, m, { steps = 2, seed = 1, cfg = 2 })
  eq(shape_of(out), ("1,3,%d,%d"):format(S, S))
  eq(((out - img):abs() * (1 - m)):max(), 0, "outside")
  local full = pipeline.inpaint(ck, img, kiln.ones({ 1, 1, S, S }), { steps = 2, seed = 1, cfg = 2 })
  local ref = pipeline.img2img(ck, img, { steps = 2, seed = 1, cfg = 2, denoise = 1 })
  eq(H.maxdiff(full, ref), 0, "full mask = img2img")
end)

-- ---------------------------------------------------------------- 9-channel UNet

test("9-channel inpainting UNet: PyTorch goldens of the UNet, VAEEncodeForInpaint and the concat", function()
  local T = require "tiny_sd"
  local G = kiln.load_safetensors("tests/golden/inpaint/sd1_inpaint.safetensors")
  local t, meta = T.build_recipe("../inpaint/sd1_inpaint")
  local path = T.tmp("sd1_inpaint.safetensors")
  kiln.save_safetensors(path, t, meta)
  local ck <close> = kiln.load_checkpoint(path)
  eq(ck.unet.config.in_channels, 9, "in_channels from the shapes")
  ck.clip.tokenizer = {
    encode = function() return {} end, bos = function() return 49406 end, eos = function() return 49407 end,
    token_id = function() return nil end,
  }
  local x = kiln.randn({ 2, 9, 8, 8 }, { seed = 11 })
  local out = ck.unet:forward(x, kiln.tensor({ 10, 500 }), kiln.randn({ 2, 77, 64 }, { seed = 2 }))
  H.truthy(H.maxdiff(out, G["unet.out"]) < 1e-3, "unet: " .. H.maxdiff(out, G["unet.out"]))
  local grey = inpaint.grey_fill(G.pixels, G.mask)
  H.truthy(H.maxdiff(grey, G.grey) < 1e-6, "grey fill")
  local grown = inpaint.grow_mask(G.mask, 6)
  eq(H.maxdiff(grown, G.grown), 0, "grown mask")
  local lat = ck.vae:encode(grey)
  H.truthy(H.maxdiff(lat, G.latent) < 1e-3, "latent: " .. H.maxdiff(lat, G.latent))
  -- the pipeline's concat reaches the UNet: mask channel then the grey-filled latent
  local fwd, seen = ck.unet.forward, nil
  ck.unet.forward = function(self, xin, tt, ctx, y)
    seen = seen or xin:narrow(2, 5, 5):narrow(1, 1, 1):contiguous()
    return fwd(self, xin, tt, ctx, y)
  end
  local img = pipeline.inpaint(ck, G.pixels, G.mask, { steps = 2, seed = 1, cfg = 2 })
  ck.unet.forward = nil
  eq(H.maxdiff(seen:narrow(2, 1, 1), G.concat_mask), 0, "concat mask")
  H.truthy(H.maxdiff(seen:narrow(2, 2, 4), G.latent) < 1e-3, "concat latent")
  eq(shape_of(img), "1,3,16,16")
  local outside = 1 - (G.mask * 1e30):clamp(0, 1)
  eq(((img - G.pixels):abs() * outside):max(), 0, "outside the mask")
end)
require("tiny_sd").cleanup()

if ckpt then ckpt:close() end
H.done()
