-- examples/upscale.lua - a picture upscaled by an ESRGAN / Real-ESRGAN model (RRDBNet or
-- the compact SRVGGNetCompact), in tiles sized from the free memory of the device.
--   kiln examples/upscale.lua --input in.png --model 4x-model.safetensors --out big.png
--     [--tile T --overlap O (input pixels; --tile 0: sized from the budget)] [--device, --vram ...]
-- An RGBA picture keeps its alpha, upscaled bilinearly beside the network's RGB.
local kiln = require "kiln"
local cli = require "kiln.cli"
local util = require "kiln.util"

local given = false
for _, a in ipairs(arg or {}) do given = given or a == "--model" end
local o = cli.parse(arg, { input = "" }, { input = "the PNG to upscale" })
if o.input == "" then util.usage_error("upscale needs --input IMAGE.png") end
if not given then util.usage_error("upscale needs --model UPSCALER.safetensors (an ESRGAN / Real-ESRGAN model)") end
if o.out == "" then o.out = "upscaled.png" end
if o.tile and o.tile < 8 then util.usage_error(("--tile %d: must be at least 8 pixels"):format(o.tile)) end

local up <close> = kiln.load_upscaler(o.model)
up:load(o.device)
local img <close> = kiln.load_png(o.input)
local image = img
local grey_alpha = img.shape[2] == 2
if grey_alpha then -- grey + alpha: as RGBA
  local g = img:narrow(2, 1, 1)
  image = kiln.cat({ g, g, g, img:narrow(2, 2, 1) }, 2)
end
local t0 = kiln.time()
local big <close> = up:upscale(image, { tile = o.tile, overlap = o.overlap })
if grey_alpha then image:free() end
local out <close> = big:to("cpu")
kiln.save_png(out, o.out, { text = { parameters = ("Upscaler: %s, %s"):format(o.model:match("[^/]+$"),
  up.config.summary) } })
if not o.quiet then
  print(("wrote %s (%dx%d, x%d, %.1f s)"):format(o.out, out.shape[4], out.shape[3], up.scale, kiln.time() - t0))
end
