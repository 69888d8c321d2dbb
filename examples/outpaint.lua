-- examples/outpaint.lua - grows a picture on its sides and draws the new border.
--   kiln examples/outpaint.lua --input in.png --left N --right N --top N --bottom N [--feather F] --prompt "..."
-- The image is padded with its edge pixels and masked as ComfyUI's ImagePadForOutpaint
-- does (1 in the new border, fading in over --feather pixels inside grown sides), then
-- inpainted: the old pixels beyond the feather come back as they were.
local kiln = require "kiln"
local cli = require "kiln.cli"
local util = require "kiln.util"
local pipeline = require "kiln.pipeline"
local inpaint = require "kiln.inpaint"

local o = cli.parse(arg, { input = "", left = 0, right = 0, top = 0, bottom = 0, feather = 40, mask_blur = 4 }, {
  input = "the PNG to grow", left = "pixels added on the left", right = "pixels added on the right",
  top = "pixels added at the top", bottom = "pixels added at the bottom",
  feather = "pixels inside the old edges over which the mask fades (ComfyUI's feathering)",
  mask_blur = "pixels of feather inside the mask where the result meets the input",
})
if o.input == "" then util.usage_error("outpaint needs --input IMAGE.png") end
for _, k in ipairs({ "left", "right", "top", "bottom", "feather", "mask_blur" }) do
  local v = math.tointeger(o[k])
  if not v or v < 0 then util.usage_error(("--%s %s: must be a whole number from 0"):format(k:gsub("_", "-"), tostring(o[k]))) end
  o[k] = v
end
if o.left + o.right + o.top + o.bottom == 0 then
  util.usage_error("outpaint needs at least one of --left, --right, --top, --bottom above 0")
end
if o.out == "" then o.out = "outpaint.png" end

local ckpt <close> = kiln.load_checkpoint(o.model, cli.checkpoint_options(o))
cli.check_clip_skip(o, ckpt)
cli.check_reference(o, ckpt)                           -- --reference: Flux Kontext only

local ok, image = pcall(kiln.load_png, o.input)
if not ok then util.usage_error(("--input %s: not a PNG image (%s)"):format(o.input, tostring(image):gsub("^[^:]*:%d+: ", ""))) end
local rgb <close> = image.shape[2] >= 3 and image:narrow(2, 1, 3):contiguous() or kiln.cat({ image, image, image }, 2)
image:free()
local W = rgb.shape[4] + o.left + o.right
local H = rgb.shape[3] + o.top + o.bottom
local m = pipeline.size_multiple(ckpt)
if W % m ~= 0 or H % m ~= 0 then
  util.usage_error(("--input %s (%dx%d) grown to %dx%d pixels: width and height must be multiples of %d")
    :format(o.input, rgb.shape[4], rgb.shape[3], W, H, m))
end

local grown, mask = inpaint.outpaint_pad(rgb, o)
o.width, o.height = W, H
local img <close> = pipeline.inpaint(ckpt, grown, mask, pipeline.options_of("inpaint", o))
grown:free(); mask:free()
cli.report(cli.save(img, o, ckpt), o)                  -- one PNG per image of the batch
