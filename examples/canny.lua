-- examples/canny.lua - the Canny edge map of a picture, as ComfyUI's Canny node makes
-- it (a ControlNet hint), written as a black and white PNG.
--   kiln examples/canny.lua --input in.png --out edges.png [--low 0.4 --high 0.8]
local kiln = require "kiln"
local cli = require "kiln.cli"
local util = require "kiln.util"

local o = cli.parse(arg, { input = "", low = 0.4, high = 0.8 }, {
  input = "the PNG to find edges in",
  low = "weak-edge threshold on the gradient magnitude, in [0, 1]",
  high = "strong-edge threshold, in [low, 1]",
})
if o.input == "" then util.usage_error("canny needs --input IMAGE.png") end
if o.out == "" then o.out = "edges.png" end
for _, k in ipairs({ "low", "high" }) do
  if not (o[k] >= 0 and o[k] <= 1) then util.usage_error(("--%s %g: must lie in [0, 1]"):format(k, o[k])) end
end
if o.low > o.high then util.usage_error(("--low %g is above --high %g"):format(o.low, o.high)) end

local loaded <close> = kiln.load_png(o.input)
local image = loaded
if image.shape[2] == 4 then image = loaded:narrow(2, 1, 3) end -- the alpha plays no part
if image.shape[2] == 2 then image = loaded:narrow(2, 1, 1) end -- grey + alpha
local x <close> = image:to(kiln.default_device())
local edges <close> = kiln.image.canny(x, o.low, o.high)
local out <close> = edges:to("cpu")
kiln.save_png(out, o.out, { text = { parameters = ("Canny low %g, high %g"):format(o.low, o.high) } })
if not o.quiet then print(("wrote %s (%dx%d)"):format(o.out, out.shape[4], out.shape[3])) end
