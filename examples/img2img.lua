-- examples/img2img.lua - re-draws an input image guided by a prompt.
--   kiln examples/img2img.lua --input in.png --prompt "..." [--denoise 0.6] [options of txt2img]
-- --batch N writes N pictures, OUT with _1, _2... before the extension (img2img_1.png...).
local kiln = require "kiln"
local cli = require "kiln.cli"
local util = require "kiln.util"
local pipeline = require "kiln.pipeline"

local o = cli.parse(arg, { input = "" }, { input = "the PNG to re-draw" })
if o.input == "" then util.usage_error("img2img needs --input IMAGE.png") end
if o.out == "" then o.out = "img2img.png" end
if o.denoise == 1.0 then o.denoise = 0.6 end

local ckpt <close> = kiln.load_checkpoint(o.model, cli.checkpoint_options(o))
if o.width and o.height then cli.image_size(o, ckpt) end -- checked before the work starts
cli.check_clip_skip(o, ckpt)
cli.check_reference(o, ckpt)                           -- --reference: Flux Kontext only
local function load_input()
  local image = kiln.load_png(o.input)
  if not (o.width and o.height) then
    local m = pipeline.size_multiple(ckpt)
    if image.shape[4] % m ~= 0 or image.shape[3] % m ~= 0 then
      util.usage_error(("--input %s is %dx%d pixels: width and height must be multiples of %d " ..
        "(--width and --height resize it)"):format(o.input, image.shape[4], image.shape[3], m))
    end
    return image
  end
  local resized = kiln.nn.interpolate(image, { size = { o.height, o.width }, mode = "bilinear" })
  image:free()                                          -- optional resize to the requested size
  return resized
end
local image <close> = load_input()
o.width, o.height = image.shape[4], image.shape[3]

local img <close> = pipeline.img2img(ckpt, image, pipeline.options_of("img2img", o))
cli.report(cli.save(img, o, ckpt), o)                  -- one PNG per image of the batch
