-- examples/inpaint.lua - re-draws the masked part of a picture guided by a prompt.
--   kiln examples/inpaint.lua --input in.png --mask mask.png --prompt "..." [--denoise 1] [options of txt2img]
-- The mask: a PNG's alpha where it has one (transparent = repaint, as ComfyUI's
-- LoadImage), else its grey level (white = repaint); one of another size is resized.
-- Pixels outside the mask come back as they were (--mask-blur: the feather, inward).
local kiln = require "kiln"
local cli = require "kiln.cli"
local util = require "kiln.util"
local pipeline = require "kiln.pipeline"
local inpaint = require "kiln.inpaint"

local o = cli.parse(arg, { input = "", mask = "", mask_blur = 4 }, {
  input = "the PNG to re-draw", mask = "PNG of the region to re-draw (alpha, else grey; white = repaint)",
  mask_blur = "pixels of feather inside the mask where the result meets the input",
})
if o.input == "" then util.usage_error("inpaint needs --input IMAGE.png") end
if o.mask == "" then util.usage_error("inpaint needs --mask MASK.png") end
local mb = math.tointeger(o.mask_blur)
if not mb or mb < 0 then util.usage_error(("--mask-blur %s: must be a whole number from 0"):format(tostring(o.mask_blur))) end
o.mask_blur = mb
if o.out == "" then o.out = "inpaint.png" end

local function load(path, what)
  local ok, t = pcall(kiln.load_png, path)
  if not ok then util.usage_error(("%s %s: not a PNG image (%s)"):format(what, path, tostring(t):gsub("^[^:]*:%d+: ", ""))) end
  return t
end

local ckpt <close> = kiln.load_checkpoint(o.model, cli.checkpoint_options(o))
if o.width and o.height then cli.image_size(o, ckpt) end -- checked before the work starts
cli.check_clip_skip(o, ckpt)
cli.check_reference(o, ckpt)                           -- --reference: Flux Kontext only

local image = load(o.input, "--input")
if o.width and o.height then
  local r = kiln.nn.interpolate(image, { size = { o.height, o.width }, mode = "bilinear" })
  image:free()
  image = r
else
  local m = pipeline.size_multiple(ckpt)
  if image.shape[4] % m ~= 0 or image.shape[3] % m ~= 0 then
    util.usage_error(("--input %s is %dx%d pixels: width and height must be multiples of %d " ..
      "(--width and --height resize it)"):format(o.input, image.shape[4], image.shape[3], m))
  end
end
local H, W = image.shape[3], image.shape[4]
local rgb <close> = image.shape[2] >= 3 and image:narrow(2, 1, 3):contiguous() or kiln.cat({ image, image, image }, 2)
image:free()

local png = load(o.mask, "--mask")
local mask = inpaint.mask_of_png(png)
png:free()
if mask.shape[3] ~= H or mask.shape[4] ~= W then
  io.stderr:write(("inpaint: --mask %s is %dx%d pixels, resized to the image's %dx%d\n"):format(o.mask,
    mask.shape[4], mask.shape[3], W, H))
  local r = kiln.nn.interpolate(mask, { size = { H, W }, mode = "bilinear" })
  mask:free()
  mask = r
end
o.width, o.height = W, H

local img <close> = pipeline.inpaint(ckpt, rgb, mask, pipeline.options_of("inpaint", o))
mask:free()
cli.report(cli.save(img, o, ckpt), o)                  -- one PNG per image of the batch
