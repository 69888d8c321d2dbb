-- kiln.inpaint: inpainting with ordinary UNets as ComfyUI's SetLatentNoiseMask +
-- KSampler do it (a latent noise mask applied around the denoiser at every step),
-- 9-channel inpainting UNets as VAEEncodeForInpaint + the model's concat do,
-- the result pasted back onto the input in pixel space, and the padding and mask of
-- ComfyUI's ImagePadForOutpaint. kiln.pipeline.inpaint is inpaint.run.
--
--   local img = pipeline.inpaint(ckpt, image, mask, { prompt = "a red circle", seed = 1 })
local kiln = require "kiln"

local M = {}

--- Checks that mask is a mask for image: a tensor [1, 1, H, W] (H, W the image's).
-- Raises at the caller's caller (level 3) otherwise.
function M.check_mask(image, mask)
  if type(image) ~= "userdata" or not image.shape or #image.shape ~= 4 then
    error("inpaint: image must be a tensor [1, 3, H, W]", 3)
  end
  if type(mask) ~= "userdata" or not mask.shape or #mask.shape ~= 4 then
    error("inpaint: mask must be a tensor [1, 1, H, W] in [0, 1]", 3)
  end
  if mask.shape[2] ~= 1 then
    error(("inpaint: mask has %d channels, must have 1 ([1, 1, H, W])"):format(mask.shape[2]), 3)
  end
  if mask.shape[3] ~= image.shape[3] or mask.shape[4] ~= image.shape[4] then
    error(("inpaint: mask is %dx%d pixels, the image %dx%d"):format(mask.shape[4], mask.shape[3],
      image.shape[4], image.shape[3]), 3)
  end
end

--- The noise mask at latent size lh x lw: ComfyUI's prepare_mask, a bilinear
-- interpolation of the pixel mask (not an area average), values kept as they come.
function M.latent_mask(mask, lh, lw)
  if mask.shape[3] == lh and mask.shape[4] == lw then return mask:clone() end
  return kiln.nn.interpolate(mask, { size = { lh, lw }, mode = "bilinear" })
end

--- The denoiser of KSamplerX0Inpaint around den: before the model, the kept region
-- (1 - m) of x is the input's latent noised to the current sigma with the noise the
-- sampler started from; after it, the kept region of the prediction is the latent.
-- noised(sigma, noise, latent): the latent noised to sigma when not latent + noise *
-- sigma (flow matching: kiln.flow.noise_scaling).
function M.masked_denoiser(den, m, latent, noise, noised)
  local keep = 1 - m
  return function(x, sigma)
    local ln = noised and noised(sigma, noise, latent) or (latent + noise * sigma)
    local xin = x * m + ln * keep
    if noised then ln:free() end
    local out = den(xin, sigma)
    xin:free()
    local r = out * m + latent * keep
    out:free()
    return r
  end
end

--- The paste-back mask: min(mask, box blur of mask over (2r+1)^2 pixels, edges
-- replicated). The fade lies inside the mask only, so a pixel where the mask is 0
-- stays exactly 0 and comes back bit for bit; where the mask is 1 well inside (and
-- everywhere when it is 1 everywhere) it is exactly 1.
function M.feather(mask, r)
  r = math.tointeger(r or 4) or 4
  if r <= 0 then return mask:clone() end
  local k = 2 * r + 1
  local padded = kiln.nn.pad(mask, { r, r, r, r }, "replicate")
  local sum = kiln.nn.conv2d(padded, kiln.ones({ 1, 1, k, k }), nil)
  padded:free()
  local blur = sum / (k * k)
  sum:free()
  local f = kiln.minimum(mask, blur)
  blur:free()
  return f
end

-- torch.round of values in [0, 1] (half to even: 0.5 -> 0)
local function round01(t)
  return ((t - 0.5) * 1e30):clamp(0, 1)
end

--- ComfyUI's VAEEncodeForInpaint, the pixels: the image with the rounded mask's
-- region filled with grey 0.5, the input of a 9-channel UNet's latent.
function M.grey_fill(image, mask)
  local keep = 1 - round01(mask)
  return (image - 0.5) * keep + 0.5
end

--- ComfyUI's VAEEncodeForInpaint, the noise mask: the rounded mask grown by a
-- g x g box (padding ceil((g - 1) / 2), cropped back to H x W), clamped, rounded.
function M.grow_mask(mask, g)
  g = math.tointeger(g or 6) or 6
  local r = round01(mask)
  if g <= 0 then return r end
  local p = math.ceil((g - 1) / 2)
  local conv = kiln.nn.conv2d(r, kiln.ones({ 1, 1, g, g }), nil, { padding = p })
  local h, w = mask.shape[3], mask.shape[4]
  local grown = round01(conv:narrow(3, 1, h):narrow(4, 1, w):clamp(0, 1))
  conv:free(); r:free()
  return grown
end

--- Pastes generated images [N, 3, H, W] onto the input [1, 3, H, W] through the
-- feathered mask fm [1, 1, H, W]: gen * fm + input * (1 - fm).
function M.paste(gen, image, fm)
  return gen * fm + image * (1 - fm)
end

--- Inpainting (kiln.pipeline.inpaint): image [1, 3, H, W] in [0, 1], mask [1, 1, H, W]
-- in [0, 1] (1 = repaint); opts as img2img's, denoise defaulting to 1, mask_blur the
-- paste-back feather in pixels (default 4). Returns images [batch, 3, H, W] and the
-- latents.
function M.run(ckpt, image, mask, opts)
  local pipeline = require "kiln.pipeline"
  M.check_mask(image, mask)
  local o = {}
  for k, v in pairs(opts or {}) do o[k] = v end
  if o.denoise == nil then o.denoise = 1 end
  local f = pipeline.size_multiple(ckpt)
  local H, W = image.shape[3], image.shape[4]
  if W % f ~= 0 or H % f ~= 0 then
    error(("image size %dx%d pixels: width and height must be multiples of %d"):format(W, H, f), 2)
  end
  -- the run's device alone (opts.device): the inputs go there, as the masks made of them
  local dev = pipeline.run_device(o.device)
  local on_dev <close> = pipeline.on_device(dev)
  local rgb = image:narrow(2, 1, 3):to(dev):contiguous()
  local m = mask:to(dev):clamp(0, 1)
  local src = rgb
  if not rawget(ckpt, "dit") and ckpt.unet.config.in_channels == 9 then
    -- an inpainting UNet: ComfyUI's VAEEncodeForInpaint (grey fill, grown noise mask)
    -- and the model's concat (the noise mask at latent size, rounded; the latent)
    src = M.grey_fill(rgb, m)
    local grown = M.grow_mask(m, o.grow_mask or 6)
    o.denoise_mask = M.latent_mask(grown, H // f, W // f)
    grown:free()
    o.concat_mask = round01(o.denoise_mask)
  else
    o.denoise_mask = M.latent_mask(m, H // f, W // f)
  end
  local blur = o.mask_blur
  o.mask_blur, o.grow_mask = nil, nil        -- inpainting's own, not img2img's
  local gen, lat = pipeline.img2img(ckpt, src, o)
  o.denoise_mask:free()
  if o.concat_mask then o.concat_mask:free(); src:free() end
  local fm = M.feather(m, blur or 4)
  local out = M.paste(gen:to(rgb.device), rgb, fm)
  gen:free(); fm:free(); m:free()
  return out, lat
end

--- ComfyUI's ImagePadForOutpaint for image [1, C, H, W]: the image grown by
-- left/right/top/bottom pixels and the mask [1, 1, H', W'] (1 in the new border;
-- inside, within `feather` pixels of a grown side, ((feather - d) / feather)^2 at
-- distance d). The new border repeats the edge pixels (ComfyUI fills it with grey).
function M.outpaint_pad(image, p)
  local left, right, top, bottom = p.left or 0, p.right or 0, p.top or 0, p.bottom or 0
  local feather = p.feather or 0
  local h, w = image.shape[3], image.shape[4]
  local H, W = h + top + bottom, w + left + right
  local grown = kiln.nn.pad(image, { left, right, top, bottom }, "replicate")
  local vals = {}
  local do_feather = feather > 0 and feather * 2 < h and feather * 2 < w
  for i = 0, H - 1 do
    for j = 0, W - 1 do
      local v = 1
      local y, x = i - top, j - left
      if y >= 0 and y < h and x >= 0 and x < w then
        v = 0
        if do_feather then
          local dt = top ~= 0 and y or h
          local db = bottom ~= 0 and h - y or h
          local dl = left ~= 0 and x or w
          local dr = right ~= 0 and w - x or w
          local d = math.min(dt, db, dl, dr)
          if d < feather then
            local t = (feather - d) / feather
            v = t * t
          end
        end
      end
      vals[#vals + 1] = v
    end
  end
  local mask = kiln.tensor(vals):reshape({ 1, 1, H, W })
  return grown, mask
end

--- A mask [1, 1, H, W] from a PNG tensor [1, C, H, W]: where it has alpha (C = 2
-- or 4) 1 - alpha (ComfyUI's LoadImage: transparent pixels are repainted), else its
-- grey level (the mean of R, G, B), white = repaint.
function M.mask_of_png(t)
  local c = t.shape[2]
  if c == 2 or c == 4 then
    return 1 - t:narrow(2, c, 1):contiguous()
  end
  if c == 1 then return t:clone() end
  return t:narrow(2, 1, 3):mean(2, true)
end

return M
