-- examples/controlnet.lua - text to image guided by a ControlNet and its hint picture
-- (an edge map, a depth map, a pose...), as ComfyUI's ControlNetApplyAdvanced.
--   kiln examples/controlnet.lua --control CN.safetensors --control-image in.png
--     [--canny] [--control-strength 1] [--control-start 0] [--control-stop 1] [options of txt2img]
-- --canny turns the picture into its Canny edge map first (kiln.image.canny), for a
-- Canny ControlNet given an ordinary picture.
local kiln = require "kiln"
local cli = require "kiln.cli"
local util = require "kiln.util"
local pipeline = require "kiln.pipeline"

local o = cli.parse(arg, {
  control = "", control_image = "", canny = false, control_strength = 1.0, control_start = 0.0, control_stop = 1.0,
}, {
  control = "the ControlNet (.safetensors, or a diffusers folder)",
  control_image = "the hint picture (PNG), resized to the image size",
  canny = "use the Canny edge map of --control-image as the hint",
  control_strength = "scale of the ControlNet's residuals (0: no effect)",
  control_start = "fraction of the schedule where the ControlNet starts, in [0, 1]",
  control_stop = "fraction of the schedule where it stops, in [0, 1]",
})
if o.control == "" then util.usage_error("controlnet needs --control CONTROLNET.safetensors") end
if o.control_image == "" then util.usage_error("controlnet needs --control-image IMAGE.png") end
for _, k in ipairs({ "control", "control_image" }) do
  local f = io.open(o[k], "rb")
  if not f then util.usage_error(("--%s %s: no such file or folder"):format(k:gsub("_", "-"), o[k])) end
  f:close()
end
for _, k in ipairs({ "control_start", "control_stop" }) do
  if not (o[k] >= 0 and o[k] <= 1) then
    util.usage_error(("--%s %g: must lie in [0, 1]"):format(k:gsub("_", "-"), o[k]))
  end
end
if o.out == "" then o.out = "controlnet.png" end

local ckpt <close> = kiln.load_checkpoint(o.model, cli.checkpoint_options(o))
cli.image_size(o, ckpt)                                -- the model's size unless given; checked
cli.check_clip_skip(o, ckpt)
cli.check_reference(o, ckpt)                           -- --reference: Flux Kontext only
local cn <close> = kiln.load_controlnet(o.control)

-- the hint as [1, 3, H, W]: alpha dropped, grey repeated
local loaded <close> = kiln.load_png(o.control_image)
local c = loaded.shape[2]
local rgb = (c == 4 or c == 3) and loaded:narrow(2, 1, 3) or loaded:narrow(2, 1, 1)
local hint = (rgb.shape[2] == 1 and kiln.cat({ rgb, rgb, rgb }, 2) or rgb:contiguous())
local edges = o.canny and kiln.image.canny(hint, 0.4, 0.8) or nil

local file = o.control
o.control = { { net = cn, image = edges or hint, strength = o.control_strength,
  start = o.control_start, stop = o.control_stop } }
-- the ControlNet loads with the UNet; the pipeline takes its own options of the command line's
local img <close> = pipeline.txt2img(ckpt, pipeline.options_of("txt2img", o))
o.control = file
cli.report(cli.save(img, o, ckpt), o)                  -- one PNG per image of the batch
