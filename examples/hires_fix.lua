-- examples/hires_fix.lua - sample small, upscale, sample again at a partial denoise.
--   kiln examples/hires_fix.lua --prompt "..." [--scale 2]
--     [--upscale latent-bilinear|latent-nearest|image|model:UPSCALER.safetensors]
--     [--hires-denoise 0.5] [--hires-steps N] [--hires-tile T] [options of txt2img]
-- --hires-tile T samples the upscaled pass in overlapping latent tiles of T
-- (MultiDiffusion), so a pass larger than the budget allows still fits.
-- --batch N writes N pictures, OUT with _1, _2... before the extension (hires_fix_1.png...).
local kiln = require "kiln"
local cli = require "kiln.cli"
local util = require "kiln.util"
local pipeline = require "kiln.pipeline"

local o = cli.parse(arg, { scale = 2, upscale = "latent-bilinear", hires_denoise = 0.5, hires_steps = 0, hires_tile = 0 }, {
  scale = "factor of the second pass's size",
  upscale = "latent-bilinear, latent-nearest, image or model:FILE (an ESRGAN / Real-ESRGAN upscaler)",
  hires_denoise = "denoise of the second pass", hires_steps = "steps of the second pass (default: --steps)",
  hires_tile = "MultiDiffusion tile of the second pass, in latent units",
})
if o.out == "" then o.out = "hires_fix.png" end
if o.hires_steps == 0 then o.hires_steps = nil end
if o.hires_tile == 0 then o.hires_tile = nil end
if not (o.scale > 0) then util.usage_error(("--scale %g: must be above 0"):format(o.scale)) end
local UPSCALERS = { ["latent-bilinear"] = true, ["latent-nearest"] = true, image = true }
local model_file = o.upscale:match("^model:(.+)$")
if model_file then
  local f = io.open(model_file, "rb")
  if not f then util.usage_error(("--upscale %s: no such file"):format(o.upscale)) end
  f:close()
end
if not UPSCALERS[o.upscale] and not model_file then
  util.usage_error(("--upscale %s: unknown (known: latent-bilinear, latent-nearest, image, model:FILE)"):format(o.upscale))
end

local ckpt <close> = kiln.load_checkpoint(o.model, cli.checkpoint_options(o))
cli.image_size(o, ckpt, o.scale)                       -- both passes' sizes checked
cli.check_clip_skip(o, ckpt)
cli.check_reference(o, ckpt)                           -- --reference: Flux Kontext only

-- stages unload what the next one does not need; the pipeline takes its own options of the
-- command line's (an unknown one is an error)
local img <close> = pipeline.hires_fix(ckpt, pipeline.options_of("hires_fix", o))
local final = { width = img.shape[4], height = img.shape[3] }
setmetatable(final, { __index = o })
local paths = cli.save(img, final, ckpt, { ("Hires upscale: %g"):format(o.scale), "Hires upscaler: " ..
  (model_file and (model_file:match("([^/]+)$"):gsub("%.safetensors$", "")) or o.upscale) })
cli.report(paths, o)
