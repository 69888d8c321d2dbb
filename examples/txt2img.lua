-- examples/txt2img.lua - text to image.
--   kiln examples/txt2img.lua --prompt "a red circle on a blue background" [--seed N]
--     [--steps N] [--cfg X] [--sampler euler] [--scheduler normal] [--negative TEXT]
--     [--width W --height H] [--out PATH] [--model FILE] [--device cpu|sim|cuda]
--     [--mode high|normal|low|none|auto] [--vram 6G] [--tile T] [--quiet]
--     [--batch N] [--clip-skip N] [--tileable x|y|xy] [--reference IMAGE.png ...]
-- --batch N writes N pictures, OUT with _1, _2... before the extension (txt2img_1.png...).
-- --tileable xy draws a seamless texture: it tiles across its left/right (x) and
-- top/bottom (y) edges without a seam.
local kiln = require "kiln"
local cli = require "kiln.cli"
local pipeline = require "kiln.pipeline"

local o = cli.parse(arg)
if o.out == "" then o.out = "txt2img.png" end

local ckpt <close> = kiln.load_checkpoint(o.model, cli.checkpoint_options(o)) -- nothing read yet: files are mapped
cli.image_size(o, ckpt)                                -- the model's size unless given; checked
cli.check_clip_skip(o, ckpt)
cli.check_reference(o, ckpt)                           -- --reference: Flux Kontext only

-- clip, unet, vae: each loaded, used, unloaded; the pipeline takes its own options of the
-- command line's (--out, --model... are the script's; an unknown one is an error)
local img <close> = pipeline.txt2img(ckpt, pipeline.options_of("txt2img", o))
cli.report(cli.save(img, o, ckpt), o)                  -- one PNG per image of the batch
