-- ComfyUI workflows (kiln.comfy): hand-written API-format graphs of each kind
-- (txt2img, img2img, inpaint, hires fix with a LoRA and an upscale model,
-- ControlNet, KSamplerAdvanced in two halves) on the bundled demo model and the tiny
-- SD 1.x checkpoint, each equal to kiln's own pipeline for the same settings; the
-- PNG's prompt chunk, ComfyUI's file numbering, a workflow read back from a PNG; the
-- liveness of a two-pass graph against keeping every result; bad graphs named.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local lfs = require "lfs"
local pipeline = require "kiln.pipeline"
local comfy = require "kiln.comfy"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local T = require "tiny_sd"
local DEMO = "examples/models/kiln-shapes.safetensors"
local ROOT = T.TMP .. "/comfy"
local MODELS, OUT = ROOT .. "/models", ROOT .. "/out"
local dirs = { "/comfy", "/comfy/models", "/comfy/out" }
for _, d in ipairs({ "checkpoints", "loras", "controlnet", "upscale_models", "input", "diffusion_models",
  "text_encoders", "text_encoders/xl", "vae", "vae_approx", "unet" }) do
  dirs[#dirs + 1] = "/comfy/models/" .. d
end
for _, d in ipairs(dirs) do lfs.mkdir(T.TMP .. d) end

local function copy(src, dst)
  local f = assert(io.open(src, "rb"))
  local data = f:read("a")
  f:close()
  local g = assert(io.open(dst, "wb"))
  g:write(data)
  g:close()
  return T.tmp(dst:sub(#T.TMP + 2))
end

-- links, so that the demo model's tokenizer beside it is found (as a folder of links to
-- a models collection is usually laid out)
local function link(src, dst)
  if lfs.symlinkattributes(dst, "mode") then return end
  local abs = src:sub(1, 1) == "/" and src or (lfs.currentdir() .. "/" .. src)
  assert(lfs.link(abs, dst, true))
  T.tmp(dst:sub(#T.TMP + 2))
end
link(DEMO, MODELS .. "/checkpoints/demo.safetensors")
link(T.ckpt_file("sd1"), MODELS .. "/checkpoints/tiny.safetensors")
copy("tests/golden/upscale/compact_x2.safetensors", MODELS .. "/upscale_models/x2.safetensors")
do -- the tiny ControlNet of tests/golden/controlnet (for the tiny checkpoint)
  local p = MODELS .. "/controlnet/cn.safetensors"
  kiln.save_safetensors(p, T.build_recipe("../controlnet/sd1"), { ["kiln.heads.unet"] = "2" })
  T.tmp(p:sub(#T.TMP + 2))
end
-- a kohya LoRA on one cross-attention of the demo UNet and one text-encoder layer
local LORA = MODELS .. "/loras/lr.safetensors"
do
  local function r(shape, seed) return kiln.randn(shape, { seed = seed }) * 0.3 end
  local k = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k"
  local te = "lora_te_text_model_encoder_layers_0_self_attn_v_proj"
  kiln.save_safetensors(LORA, {
    [k .. ".lora_down.weight"] = r({ 2, 64 }, 1), [k .. ".lora_up.weight"] = r({ 64, 2 }, 2),
    [te .. ".lora_down.weight"] = r({ 2, 64 }, 3), [te .. ".lora_up.weight"] = r({ 64, 2 }, 4),
  })
  T.tmp(LORA:sub(#T.TMP + 2))
end
-- input pictures: a 64 x 64 RGB picture, a mask (white = repaint) and a 48 x 48 hint
local PIC, MASK, HINT = MODELS .. "/input/pic.png", MODELS .. "/input/mask.png", MODELS .. "/input/hint.png"
do
  local pic = (kiln.randn({ 1, 3, 64, 64 }, { seed = 3 }) * 0.2 + 0.5):clamp(0, 1)
  kiln.save_png(pic, PIC)
  local rows = {}
  for y = 1, 64 do
    local row = {}
    for x = 1, 64 do row[x] = (x > 16 and x <= 48 and y > 16 and y <= 48) and 1 or 0 end
    rows[y] = row
  end
  kiln.save_png(kiln.tensor({ { rows } }), MASK)
  kiln.save_png((kiln.randn({ 1, 3, 48, 48 }, { seed = 7 }) * 0.25 + 0.5):clamp(0, 1), HINT)
  for _, p in ipairs({ PIC, MASK, HINT }) do T.tmp(p:sub(#T.TMP + 2)) end
end

local made_out = {}
local function run(g, opts)
  local o = { models = MODELS, output = OUT, quiet = true }
  for k, v in pairs(opts or {}) do o[k] = v end
  local files, report = comfy.run(g, o)
  for _, f in ipairs(files) do made_out[#made_out + 1] = f end
  return files, report
end

local function maxdiff(a, b)
  eq(table.concat(a.shape, ","), table.concat(b.shape, ","), "shape")
  return (a - b):abs():max()
end

-- an image as SaveImage writes it (8 bits), for comparing with a file
local function as_png(img)
  local p = T.tmp("ref" .. #made_out .. math.random(1e9) .. ".png")
  kiln.save_png(img:clamp(0, 1), p)
  return kiln.load_png(p)
end

local function same_picture(file, img, what)
  local got <close> = kiln.load_png(file)
  local want <close> = as_png(img)
  eq(maxdiff(got, want), 0, what)
end

-- the txt2img graph of ComfyUI's default workflow, at the given settings
local W64
local function txt2img_graph(s)
  return {
    ["4"] = { class_type = "CheckpointLoaderSimple", inputs = { ckpt_name = s.ckpt or "demo.safetensors" } },
    ["5"] = { class_type = "EmptyLatentImage", inputs = { width = s.w or W64, height = s.h or W64, batch_size = 1 } },
    ["6"] = { class_type = "CLIPTextEncode", inputs = { text = s.prompt, clip = { "4", 1 } } },
    ["7"] = { class_type = "CLIPTextEncode", inputs = { text = s.negative or "", clip = { "4", 1 } } },
    ["3"] = { class_type = "KSampler", inputs = { seed = s.seed, steps = s.steps, cfg = s.cfg,
      sampler_name = s.sampler or "euler", scheduler = s.scheduler or "normal", denoise = 1,
      model = { "4", 0 }, positive = { "6", 0 }, negative = { "7", 0 }, latent_image = { "5", 0 } } },
    ["8"] = { class_type = "VAEDecode", inputs = { samples = { "3", 0 }, vae = { "4", 2 } } },
    ["9"] = { class_type = "SaveImage", inputs = { filename_prefix = s.prefix or "t2i", images = { "8", 0 } } },
  }
end

local demo <close> = kiln.load_checkpoint(DEMO)
-- EmptyLatentImage's width is 8 x the latent's (ComfyUI's, whatever the VAE); the
-- demo VAE's factor is smaller, so the node is given the width that makes kiln's 64
W64 = 8 * 64 // math.tointeger(demo.vae.factor)
local S = { prompt = "a red (circle:1.2)", negative = "blur", seed = 5, steps = 4, cfg = 3,
  sampler = "euler_ancestral", scheduler = "karras" }
local function popts(extra)
  local o = { prompt = S.prompt, negative = S.negative, seed = S.seed, steps = S.steps, cfg = S.cfg,
    sampler = S.sampler, scheduler = S.scheduler, width = 64, height = 64, weighting = "comfy" }
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

local t2i_file
test("comfy: txt2img equals kiln.pipeline.txt2img; PREFIX_00001_.png with the API JSON in its prompt chunk", function()
  local g = txt2img_graph(S)
  local files = run(g)
  eq(#files, 1)
  truthy(files[1]:match("/t2i_00001_%.png$"), files[1])
  same_picture(files[1], pipeline.txt2img(demo, popts()), "txt2img")
  local chunk = comfy.png_text(files[1]).prompt
  eq(chunk, kiln.json.encode(g), "prompt chunk")
  local again = run(g)
  truthy(again[1]:match("/t2i_00002_%.png$"), "numbered after the highest: " .. again[1])
  t2i_file = files[1]
end)

test("comfy: a PNG's prompt chunk runs again (kiln comfy picture.png) to the same picture", function()
  if not t2i_file then H.skip("no picture from the txt2img test") end
  local files = run(t2i_file)
  truthy(files[1]:match("/t2i_00003_%.png$"), files[1])
  local a <close> = kiln.load_png(t2i_file)
  local b <close> = kiln.load_png(files[1])
  eq(maxdiff(a, b), 0)
end)

test("comfy: img2img (LoadImage, VAEEncode, KSampler at denoise 0.6) equals kiln.pipeline.img2img", function()
  local g = txt2img_graph(S)
  g["10"] = { class_type = "LoadImage", inputs = { image = "pic.png" } }
  g["11"] = { class_type = "VAEEncode", inputs = { pixels = { "10", 0 }, vae = { "4", 2 } } }
  g["3"].inputs.latent_image = { "11", 0 }
  g["3"].inputs.denoise = 0.6
  g["5"] = nil
  local files = run(g)
  local pic <close> = kiln.load_png(PIC)
  same_picture(files[1], pipeline.img2img(demo, pic, popts({ denoise = 0.6 })), "img2img")
end)

test("comfy: inpaint (LoadImageMask, SetLatentNoiseMask) samples kiln.pipeline.inpaint's latents", function()
  local g = txt2img_graph(S)
  g["10"] = { class_type = "LoadImage", inputs = { image = "pic.png" } }
  g["12"] = { class_type = "LoadImageMask", inputs = { image = "mask.png", channel = "red" } }
  g["11"] = { class_type = "VAEEncode", inputs = { pixels = { "10", 0 }, vae = { "4", 2 } } }
  g["13"] = { class_type = "SetLatentNoiseMask", inputs = { samples = { "11", 0 }, mask = { "12", 0 } } }
  g["3"].inputs.latent_image = { "13", 0 }
  g["5"] = nil
  local files = run(g)
  local pic <close> = kiln.load_png(PIC)
  local m <close> = kiln.load_png(MASK)
  local _, lat = pipeline.inpaint(demo, pic, m:narrow(2, 1, 1):contiguous(), popts())
  demo.vae:load(kiln.default_device())
  local img = demo.vae:decode(lat)
  demo.vae:unload()
  same_picture(files[1], img, "inpaint (ComfyUI pastes nothing back)")
end)

-- hires fix: LoRA, first pass, decode, upscale model x2, encode, second pass at 0.5
local function hires_graph()
  local g = txt2img_graph(S)
  g["20"] = { class_type = "LoraLoader", inputs = { model = { "4", 0 }, clip = { "4", 1 }, lora_name = "lr.safetensors",
    strength_model = 0.8, strength_clip = 0.6 } }
  g["6"].inputs.clip = { "20", 1 }
  g["7"].inputs.clip = { "20", 1 }
  g["3"].inputs.model = { "20", 0 }
  g["21"] = { class_type = "UpscaleModelLoader", inputs = { model_name = "x2.safetensors" } }
  g["22"] = { class_type = "ImageUpscaleWithModel", inputs = { upscale_model = { "21", 0 }, image = { "8", 0 } } }
  g["23"] = { class_type = "VAEEncode", inputs = { pixels = { "22", 0 }, vae = { "4", 2 } } }
  g["24"] = { class_type = "KSampler", inputs = { seed = S.seed + 1, steps = S.steps, cfg = S.cfg,
    sampler_name = S.sampler, scheduler = S.scheduler, denoise = 0.5, model = { "20", 0 },
    positive = { "6", 0 }, negative = { "7", 0 }, latent_image = { "23", 0 } } }
  g["25"] = { class_type = "VAEDecode", inputs = { samples = { "24", 0 }, vae = { "4", 2 } } }
  g["9"].inputs.images = { "25", 0 }
  g["9"].inputs.filename_prefix = "hires"
  return g
end

test("comfy: hires fix with a LoRA and an upscale model equals kiln.pipeline.hires_fix", function()
  local files = run(hires_graph())
  local up <close> = kiln.load_upscaler(MODELS .. "/upscale_models/x2.safetensors")
  local want = pipeline.hires_fix(demo, popts({ upscale = up, scale = 2, hires_denoise = 0.5,
    lora = { { name = "lr", path = LORA, unet = 0.8, clip = 0.6 } } }))
  eq(want.shape[3], 128)
  local h = demo:add_lora(LORA)          -- the LoRA does reach the demo's weights
  eq(h.patched, 2)
  h:remove()
  same_picture(files[1], want, "hires fix")
end)

test("comfy: liveness: the two-pass graph's peak on sim is below the same graph keeping every result", function()
  local _, live = run(hires_graph(), { device = "sim" })
  local _, kept = run(hires_graph(), { device = "sim", keep_all = true })
  truthy(live.peak > 0, "a peak was measured")
  truthy(live.peak < kept.peak, ("liveness %s, keep-all %s"):format(comfy.human(live.peak), comfy.human(kept.peak)))
  print(("# hires fix on sim: peak %s with liveness, %s keeping every result"):format(comfy.human(live.peak),
    comfy.human(kept.peak)))
  eq(#live.nodes, 13, "13 nodes ran")
  eq(kiln.mem.stats("sim").allocated, 0, "nothing left on the device")
end)

test("comfy: ControlNetApplyAdvanced equals the pipeline's control option (tiny SD 1.x)", function()
  -- ComfyUI's EmptyLatentImage divides by 8 whatever the VAE; the tiny VAE's factor is 2,
  -- so a 16 x 16 latent is "128 pixels" to the node and 32 to kiln's pipeline
  local s = { ckpt = "tiny.safetensors", prompt = "a red circle", negative = "blur", seed = 1, steps = 2, cfg = 5,
    w = 128, h = 128, prefix = "cn" }
  local g = txt2img_graph(s)
  g["30"] = { class_type = "ControlNetLoader", inputs = { control_net_name = "cn.safetensors" } }
  g["31"] = { class_type = "LoadImage", inputs = { image = "hint.png" } }
  g["32"] = { class_type = "ControlNetApplyAdvanced", inputs = { positive = { "6", 0 }, negative = { "7", 0 },
    control_net = { "30", 0 }, image = { "31", 0 }, strength = 0.8, start_percent = 0, end_percent = 1 } }
  g["3"].inputs.positive = { "32", 0 }
  g["3"].inputs.negative = { "32", 1 }
  local files = run(g)
  local ck <close> = kiln.load_checkpoint(MODELS .. "/checkpoints/tiny.safetensors")
  local cn <close> = kiln.load_controlnet(MODELS .. "/controlnet/cn.safetensors")
  local hint <close> = kiln.load_png(HINT)
  local want = pipeline.txt2img(ck, { prompt = s.prompt, negative = s.negative, seed = 1, steps = 2, cfg = 5,
    width = 32, height = 32, weighting = "comfy", control = { { net = cn, image = hint, strength = 0.8 } } })
  same_picture(files[1], want, "controlnet")
  local plain = pipeline.txt2img(ck, { prompt = s.prompt, negative = s.negative, seed = 1, steps = 2, cfg = 5,
    width = 32, height = 32, weighting = "comfy" })
  truthy(maxdiff(want, plain) > 0, "the ControlNet changes the picture")
end)

test("comfy: KSamplerAdvanced in two halves (leftover noise, then no added noise) equals one KSampler", function()
  local one = txt2img_graph({ prompt = "a blue square", seed = 9, steps = 4, cfg = 3, prefix = "one" })
  local two = txt2img_graph({ prompt = "a blue square", seed = 9, steps = 4, cfg = 3, prefix = "two" })
  local k = two["3"].inputs
  two["3"] = { class_type = "KSamplerAdvanced", inputs = { model = k.model, add_noise = "enable", noise_seed = 9,
    steps = 4, cfg = 3, sampler_name = "euler", scheduler = "normal", positive = k.positive, negative = k.negative,
    latent_image = k.latent_image, start_at_step = 0, end_at_step = 2, return_with_leftover_noise = "enable" } }
  two["40"] = { class_type = "KSamplerAdvanced", inputs = { model = k.model, add_noise = "disable", noise_seed = 9,
    steps = 4, cfg = 3, sampler_name = "euler", scheduler = "normal", positive = k.positive, negative = k.negative,
    latent_image = { "3", 0 }, start_at_step = 2, end_at_step = 10000, return_with_leftover_noise = "disable" } }
  two["8"].inputs.samples = { "40", 0 }
  local a <close> = kiln.load_png(run(one)[1])
  local b <close> = kiln.load_png(run(two)[1])
  truthy(maxdiff(a, b) <= 1 / 255, "two halves = one run")
end)

test("comfy: ConditioningCombine of one prompt twice, and an area over the whole picture, equal the plain run", function()
  local s = { prompt = "a green triangle", negative = "blur", seed = 4, steps = 3, cfg = 3 }
  local plain <close> = kiln.load_png(run(txt2img_graph(s))[1])
  local g = txt2img_graph(s)
  g["60"] = { class_type = "ConditioningCombine", inputs = { conditioning_1 = { "6", 0 }, conditioning_2 = { "6", 0 } } }
  g["3"].inputs.positive = { "60", 0 }
  local both <close> = kiln.load_png(run(g)[1])
  truthy(maxdiff(both, plain) <= 2 / 255, "combined twice = once")
  g = txt2img_graph(s)
  g["61"] = { class_type = "ConditioningSetArea", inputs = { conditioning = { "6", 0 }, width = W64, height = W64,
    x = 0, y = 0, strength = 1 } }
  g["3"].inputs.positive = { "61", 0 }
  local whole <close> = kiln.load_png(run(g)[1])
  truthy(maxdiff(whole, plain) <= 2 / 255, "an area covering everything = no area")
  -- a second prompt on the left half, and a zeroed negative: they run and change the picture
  g = txt2img_graph(s)
  g["62"] = { class_type = "CLIPTextEncode", inputs = { text = "a yellow square", clip = { "4", 1 } } }
  g["63"] = { class_type = "ConditioningSetArea", inputs = { conditioning = { "62", 0 }, width = W64 // 2, height = W64,
    x = 0, y = 0, strength = 1.5 } }
  g["64"] = { class_type = "ConditioningCombine", inputs = { conditioning_1 = { "6", 0 }, conditioning_2 = { "63", 0 } } }
  g["65"] = { class_type = "ConditioningZeroOut", inputs = { conditioning = { "7", 0 } } }
  g["3"].inputs.positive = { "64", 0 }
  g["3"].inputs.negative = { "65", 0 }
  local mixed <close> = kiln.load_png(run(g)[1])
  truthy(maxdiff(mixed, plain) > 2 / 255, "the area prompt changes the picture")
end)

test("comfy: CLIPSetLastLayer -2 and LoraLoaderModelOnly equal the pipeline's clip_skip 2 and a UNet-only LoRA", function()
  local g = txt2img_graph(S)
  g["70"] = { class_type = "CLIPSetLastLayer", inputs = { clip = { "4", 1 }, stop_at_clip_layer = -2 } }
  g["71"] = { class_type = "LoraLoaderModelOnly", inputs = { model = { "4", 0 }, lora_name = "lr.safetensors",
    strength_model = 1.0 } }
  g["6"].inputs.clip = { "70", 0 }
  g["7"].inputs.clip = { "70", 0 }
  g["3"].inputs.model = { "71", 0 }
  local files = run(g)
  same_picture(files[1], pipeline.txt2img(demo, popts({ clip_skip = 2,
    lora = { { name = "lr", path = LORA, unet = 1.0, clip = 0 } } })), "clip skip + model-only LoRA")
end)

test("comfy: outpainting and inpainting nodes, tiled VAE and image scaling run and keep their sizes", function()
  local g = txt2img_graph(S)
  g["5"] = nil
  g["80"] = { class_type = "LoadImage", inputs = { image = "pic.png" } }
  g["81"] = { class_type = "ImagePadForOutpaint", inputs = { image = { "80", 0 }, left = 16, top = 0, right = 16,
    bottom = 0, feathering = 8 } }
  g["82"] = { class_type = "VAEEncodeForInpaint", inputs = { pixels = { "81", 0 }, vae = { "4", 2 }, mask = { "81", 1 },
    grow_mask_by = 6 } }
  g["3"].inputs.latent_image = { "82", 0 }
  g["8"] = { class_type = "VAEDecodeTiled", inputs = { samples = { "3", 0 }, vae = { "4", 2 }, tile_size = 64, overlap = 16 } }
  g["83"] = { class_type = "ImageScaleBy", inputs = { image = { "8", 0 }, upscale_method = "bilinear", scale_by = 0.5 } }
  g["84"] = { class_type = "ImageScale", inputs = { image = { "83", 0 }, upscale_method = "nearest-exact", width = 96,
    height = 0, crop = "disabled" } }
  g["9"].inputs.images = { "84", 0 }
  g["85"] = { class_type = "PreviewImage", inputs = { images = { "8", 0 } } }
  -- InpaintModelConditioning + VAEEncodeTiled + LatentUpscale on a second branch
  g["86"] = { class_type = "LoadImageMask", inputs = { image = "mask.png", channel = "red" } }
  g["87"] = { class_type = "InpaintModelConditioning", inputs = { positive = { "6", 0 }, negative = { "7", 0 },
    vae = { "4", 2 }, pixels = { "80", 0 }, mask = { "86", 0 }, noise_mask = true } }
  g["88"] = { class_type = "KSampler", inputs = { seed = 2, steps = 2, cfg = 3, sampler_name = "euler",
    scheduler = "normal", denoise = 1, model = { "4", 0 }, positive = { "87", 0 }, negative = { "87", 1 },
    latent_image = { "87", 2 } } }
  g["89"] = { class_type = "LatentUpscale", inputs = { samples = { "88", 0 }, upscale_method = "bilinear", width = 0,
    height = W64 * 2, crop = "disabled" } }
  g["90"] = { class_type = "VAEDecode", inputs = { samples = { "89", 0 }, vae = { "4", 2 } } }
  g["91"] = { class_type = "VAEEncodeTiled", inputs = { pixels = { "90", 0 }, vae = { "4", 2 }, tile_size = 64, overlap = 16 } }
  g["92"] = { class_type = "VAEDecode", inputs = { samples = { "91", 0 }, vae = { "4", 2 } } }
  g["93"] = { class_type = "SaveImage", inputs = { images = { "92", 0 }, filename_prefix = "branch" } }
  local files, r = run(g)
  eq(#files, 2)
  local a <close> = kiln.load_png(files[1])
  eq(a.shape[4], 96, "ImageScale width")
  eq(a.shape[3], 64, "ImageScale keeps the aspect ratio (96 x 64 padded, halved, back to 96 wide)")
  local b <close> = kiln.load_png(files[2])
  eq(b.shape[3], 128, "LatentUpscale doubled the picture")
  eq(#r.previews, 1)
end)

-- ComfyUI's VAEDecodeTiled (nodes.py): "if tile_size < overlap * 4: overlap = tile_size // 4",
-- then tile_size and overlap divided by vae.spacial_compression_decode() -- the VAE's own
-- factor, 4 for the demo VAE (8 for SD's). tile_size 64, overlap 32: the overlap becomes
-- 64 // 4 = 16 pixels, and the latent tiles 64 // 4 = 16 with an overlap of 16 // 4 = 4.
-- kiln refused it before ("overlap must be an integer in [0, tile/2)": 32 // 8 = 4 of 8).
test("comfy: VAEDecodeTiled tile_size 64, overlap 32 runs with ComfyUI's tiles and equals VAEDecode", function()
  local f = math.tointeger(demo.vae.factor)
  eq(f, 4, "the demo VAE's factor")
  local g = txt2img_graph({ prompt = "a red circle", seed = 2, steps = 2, cfg = 3, prefix = "tiled", w = 256, h = 256 })
  g["8"] = { class_type = "VAEDecodeTiled", inputs = { samples = { "3", 0 }, vae = { "4", 2 }, tile_size = 64, overlap = 32 } }
  g["10"] = { class_type = "VAEDecode", inputs = { samples = { "3", 0 }, vae = { "4", 2 } } }
  g["11"] = { class_type = "SaveImage", inputs = { images = { "10", 0 }, filename_prefix = "whole" } }
  local vae_nodes = require "kiln.comfy.vae"
  local orig, seen = vae_nodes.decode_tiles, {}
  vae_nodes.decode_tiles = function(...)
    local t, o = orig(...)
    seen[#seen + 1] = { args = { ... }, tile = t, overlap = o }
    return t, o
  end
  local ok, files = pcall(run, g)
  vae_nodes.decode_tiles = orig
  assert(ok, files)
  eq(#seen, 1)
  eq(table.concat(seen[1].args, ","), "64,32,4", "tile_size, overlap and the VAE's own factor")
  eq(seen[1].tile, 16, "64 // 4")
  eq(seen[1].overlap, 4, "(64 // 4) // 4")
  local tiled <close> = kiln.load_png(files[1])
  local whole <close> = kiln.load_png(files[2])
  eq(tiled.shape[3], 256 // 8 * f, "the latent (256 // 8 = 32, two tiles across) times the VAE's factor")
  -- kiln's tiles normalize with the whole picture's GroupNorm statistics: close to the whole
  -- decode (ComfyUI's average of three tilings with their own statistics only approaches it)
  local psnr = require("imgcmp").psnr(tiled, whole)
  print(("# VAEDecodeTiled 64/32 on the demo VAE: PSNR %.1f dB against VAEDecode"):format(psnr))
  truthy(psnr >= 35, ("PSNR %.1f dB"):format(psnr))
  -- VAEEncodeTiled's overlap of half its tile cannot run in ComfyUI either (its halved tiling)
  g = txt2img_graph({ prompt = "x", seed = 1, steps = 1, cfg = 3, prefix = "enc", w = 256, h = 256 })
  g["12"] = { class_type = "VAEEncodeTiled", inputs = { pixels = { "8", 0 }, vae = { "4", 2 }, tile_size = 64, overlap = 32 } }
  g["13"] = { class_type = "VAEDecode", inputs = { samples = { "12", 0 }, vae = { "4", 2 } } }
  g["9"].inputs.images = { "13", 0 }
  raises(function() run(g) end, "node 12 (VAEEncodeTiled): overlap 32 must be below tile_size / 2 (32)")
  g["12"].inputs.overlap = 16
  local enc <close> = kiln.load_png(run(g)[1])
  eq(enc.shape[3], 128, "encoded in tiles and decoded again")
end)

test("comfy: comfy.run leaves the device's peak counter to the host: reset before, stats after cover the whole run", function()
  local g = txt2img_graph({ prompt = "a red circle", seed = 2, steps = 2, cfg = 3, prefix = "hostpeak" })
  kiln.mem.reset_peak("sim")
  local _, r = run(g, { device = "sim" })
  local host = kiln.mem.stats("sim").peak
  local most, last = 0, r.nodes[#r.nodes]
  for _, n in ipairs(r.nodes) do most = math.max(most, n.peak) end
  eq(r.peak, most, "the report's peak is its nodes' highest")
  truthy(most > 0, "peaks were measured")
  -- before, comfy.run reset the counter at each node: the host read the last node's (SaveImage's)
  truthy(host >= most, ("the host reads %s, the graph used %s"):format(comfy.human(host), comfy.human(most)))
  truthy(host > last.peak, ("the host's peak %s is above the last node's %s"):format(comfy.human(host), comfy.human(last.peak)))
  -- the per-node peaks nest: the KSampler (the UNet on the device) is above the loader's
  local by = {}
  for _, n in ipairs(r.nodes) do by[n.class_type] = n.peak end
  truthy(by.KSampler > by.SaveImage, "the sampler's peak is its own")
  eq(kiln.mem.stats("sim").allocated, 0, "nothing left on the device")
end)

test("comfy: built-in nodes refuse values outside ComfyUI's ranges and lists, by name", function()
  local function bad(node, name, v, ...)
    local g = txt2img_graph(S)
    g[node].inputs[name] = v
    raises(function() run(g) end, ...)
  end
  bad("3", "steps", 0, "node 3 (KSampler): input 'steps' is 0, below the minimum 1 (allowed: 1 to 10000)")
  bad("3", "denoise", 1.5, "node 3 (KSampler): input 'denoise' is 1.5, above the maximum 1.0 (allowed: 0.0 to 1.0)")
  bad("3", "cfg", -1, "node 3 (KSampler): input 'cfg' is -1, below the minimum 0.0")
  bad("3", "seed", -5, "node 3 (KSampler): input 'seed' is -5, below the minimum 0 (allowed: 0 to 18446744073709551615)")
  bad("3", "sampler_name", "nope", "node 3 (KSampler): input 'sampler_name' is 'nope', not one of ", "euler_ancestral")
  bad("3", "scheduler", "sideways", "node 3 (KSampler): input 'scheduler' is 'sideways', not one of ", "karras")
  bad("5", "width", 8, "node 5 (EmptyLatentImage): input 'width' is 8, below the minimum 16 (allowed: 16 to 16384)")
  bad("5", "batch_size", 0, "node 5 (EmptyLatentImage): input 'batch_size' is 0, below the minimum 1")
  bad("3", "model", nil, "node 3 (KSampler): input 'model' (MODEL) is missing")
  local g = txt2img_graph(S)
  g["70"] = { class_type = "CLIPSetLastLayer", inputs = { clip = { "4", 1 }, stop_at_clip_layer = 0 } }
  g["6"].inputs.clip = { "70", 0 }
  raises(function() run(g) end, "node 70 (CLIPSetLastLayer): input 'stop_at_clip_layer' is 0, above the maximum -1 (allowed: -24 to -1)")
end)

test("comfy: CLIPTextEncodeSDXL on the tiny SDXL checkpoint equals kiln.pipeline.txt2img", function()
  link(T.ckpt_file("sdxl"), MODELS .. "/checkpoints/tiny-xl.safetensors")
  local ck <close> = kiln.load_checkpoint(MODELS .. "/checkpoints/tiny-xl.safetensors")
  local f = math.tointeger(ck.vae.factor)
  local g = txt2img_graph({ ckpt = "tiny-xl.safetensors", prompt = "a red circle", negative = "blur", seed = 3,
    steps = 2, cfg = 4, w = 8 * 32 // f, h = 8 * 32 // f, prefix = "xl" })
  for _, k in ipairs({ "6", "7" }) do
    local text = g[k].inputs.text
    g[k] = { class_type = "CLIPTextEncodeSDXL", inputs = { clip = { "4", 1 }, width = 32, height = 32, crop_w = 0,
      crop_h = 0, target_width = 32, target_height = 32, text_g = text, text_l = text } }
  end
  local files = run(g)
  same_picture(files[1], pipeline.txt2img(ck, { prompt = "a red circle", negative = "blur", seed = 3, steps = 2,
    cfg = 4, width = 32, height = 32, weighting = "comfy" }), "sdxl")
end)

-- the demo checkpoint split into files as ComfyUI's folders hold them: the UNet under
-- its bare names (with the metadata that says what the shapes cannot), the text encoder
-- with the demo's tokenizer beside it, the VAE; and a tiny TAESD in vae_approx/
do
  local all = kiln.load_safetensors(DEMO)
  local meta = demo.metadata
  local parts = { unet = {}, clip = {}, vae = {} }
  for k, t in pairs(all) do
    local u = k:match("^model%.diffusion_model%.(.*)$")
    local c = k:match("^cond_stage_model%.transformer%.(.*)$")
    local v = k:match("^first_stage_model%.(.*)$")
    if u then parts.unet[u] = t elseif c then parts.clip[c] = t elseif v then parts.vae[v] = t end
  end
  local function save(rel, tensors, md)
    kiln.save_safetensors(MODELS .. "/" .. rel, tensors, md)
    T.tmp("comfy/models/" .. rel)
  end
  save("diffusion_models/demo_unet.safetensors", parts.unet, meta)
  save("text_encoders/demo_clip.safetensors", parts.clip, { ["kiln.heads.clip"] = meta["kiln.heads.clip"],
    ["kiln.clip.activation"] = meta["kiln.clip.activation"] })
  save("vae/demo_vae.safetensors", parts.vae)
  for _, f in ipairs({ "vocab.json", "merges.txt" }) do link("examples/models/" .. f, MODELS .. "/text_encoders/" .. f) end
  save("vae_approx/taesd_decoder.safetensors", T.build_recipe("../taesd/decoder"))
  save("vae_approx/taesd_encoder.safetensors", T.build_recipe("../taesd/encoder"))
end

-- the txt2img graph with the demo from separate files
local function split_graph(s)
  local g = txt2img_graph(s)
  g["4"] = { class_type = "UNETLoader", inputs = { unet_name = "demo_unet.safetensors", weight_dtype = s.dtype or "default" } }
  g["41"] = { class_type = "CLIPLoader", inputs = { clip_name = "demo_clip.safetensors", type = "stable_diffusion" } }
  g["42"] = { class_type = "VAELoader", inputs = { vae_name = s.vae or "demo_vae.safetensors" } }
  g["6"].inputs.clip = { "41", 0 }
  g["7"].inputs.clip = { "41", 0 }
  g["8"].inputs.vae = { "42", 0 }
  return g
end

test("comfy: UNETLoader + CLIPLoader + VAELoader from separate files give the checkpoint graph's picture", function()
  local s = { prompt = S.prompt, negative = S.negative, seed = S.seed, steps = S.steps, cfg = S.cfg,
    sampler = S.sampler, scheduler = S.scheduler, prefix = "split" }
  local files = run(split_graph(s))
  same_picture(files[1], pipeline.txt2img(demo, popts()), "split files")
  -- with a LoRA on both (LoraLoader over the separate MODEL and CLIP), as the hires graph's
  local g = split_graph(s)
  g["20"] = { class_type = "LoraLoader", inputs = { model = { "4", 0 }, clip = { "41", 0 }, lora_name = "lr.safetensors",
    strength_model = 0.8, strength_clip = 0.6 } }
  g["6"].inputs.clip, g["7"].inputs.clip, g["3"].inputs.model = { "20", 1 }, { "20", 1 }, { "20", 0 }
  files = run(g)
  same_picture(files[1], pipeline.txt2img(demo, popts({ lora = { { name = "lr", path = LORA, unet = 0.8, clip = 0.6 } } })),
    "split files with a LoRA")
  -- a LoRA with UNet keys only, through LoraLoader: the separate text encoder has nothing
  -- to patch and stays as it is (ComfyUI's), the UNet gets it
  local only_unet = MODELS .. "/loras/unet_only.safetensors"
  local k = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k"
  kiln.save_safetensors(only_unet, { [k .. ".lora_down.weight"] = kiln.randn({ 2, 64 }, { seed = 1 }) * 0.3,
    [k .. ".lora_up.weight"] = kiln.randn({ 64, 2 }, { seed = 2 }) * 0.3 })
  T.tmp("comfy/models/loras/unet_only.safetensors")
  g["20"].inputs.lora_name = "unet_only.safetensors"
  files = run(g)
  same_picture(files[1], pipeline.txt2img(demo, popts({ lora = { { name = "u", path = only_unet, unet = 0.8, clip = 0 } } })),
    "a UNet-only LoRA on separate files")
end)

test("comfy: UNETLoader fp8 weights run close to f32; VAELoader \"taesd\" decodes with vae_approx/'s TAESD", function()
  local s = { prompt = S.prompt, negative = S.negative, seed = S.seed, steps = S.steps, cfg = S.cfg,
    sampler = S.sampler, scheduler = S.scheduler, prefix = "fp8", dtype = "fp8_e4m3fn" }
  local f8 <close> = kiln.load_png(run(split_graph(s))[1])
  local want <close> = as_png(pipeline.txt2img(demo, popts()))
  local d = maxdiff(f8, want)
  truthy(d > 0 and d < 0.5, "fp8 weights change the picture a little: " .. d)
  s.dtype, s.prefix, s.vae = "default", "tae", "taesd"
  local g = split_graph(s)
  local files = run(g)
  local got <close> = kiln.load_png(files[1])
  eq(got.shape[3], 64 // math.tointeger(demo.vae.factor) * 8, "TAESD's factor 8 on the demo's latents")
  -- a q8_0 GGUF of the same UNet through ComfyUI-GGUF's loader (in unet/)
  local parts = {}
  for k, t in pairs(kiln.load_safetensors(MODELS .. "/diffusion_models/demo_unet.safetensors")) do parts[k] = t end
  kiln.save_gguf(MODELS .. "/unet/demo_q8.gguf", parts, { type = "q8_0", metadata = demo.metadata })
  T.tmp("comfy/models/unet/demo_q8.gguf")
  g = split_graph({ prompt = S.prompt, negative = S.negative, seed = S.seed, steps = S.steps, cfg = S.cfg,
    sampler = S.sampler, scheduler = S.scheduler, prefix = "gguf" })
  g["4"] = { class_type = "UnetLoaderGGUF", inputs = { unet_name = "demo_q8.gguf" } }
  local q8 <close> = kiln.load_png(run(g)[1])
  d = maxdiff(q8, want)
  truthy(d > 0 and d < 0.5, "q8_0 weights change the picture a little: " .. d)
  -- CLIPLoader's device cpu: the text encoder stays on the host while the rest runs on sim
  g = split_graph({ prompt = S.prompt, negative = S.negative, seed = S.seed, steps = S.steps, cfg = S.cfg,
    sampler = S.sampler, scheduler = S.scheduler, prefix = "clipcpu" })
  g["41"].inputs.device = "cpu"
  same_picture(run(g, { device = "sim" })[1], pipeline.txt2img(demo, popts()), "text encoder on the host")
  eq(kiln.mem.stats("sim").allocated, 0, "nothing left on sim")
  s.dtype = "fp16"
  raises(function() run(split_graph(s)) end, "node 4 (UNETLoader): input 'weight_dtype' is 'fp16', not one of default, fp8_e4m3fn")
  s.dtype, s.vae = "default", "taesd3"
  raises(function() run(split_graph(s)) end, "model 'taesd3' not found in " .. MODELS .. "/vae/")
  g = split_graph({ prompt = "x", seed = 1, steps = 1, cfg = 3 })
  g["41"].inputs.type = "flux"
  raises(function() run(g) end, "node 41 (CLIPLoader): input 'type' is 'flux', not one of stable_diffusion")
  g = split_graph({ prompt = "x", seed = 1, steps = 1, cfg = 3 })
  g["4"].inputs.unet_name = "none.gguf"
  raises(function() run(g) end, "model 'none.gguf' not found in " .. MODELS .. "/diffusion_models/ or " .. MODELS .. "/unet/")
end)

test("comfy: DualCLIPLoader (type sdxl) of the tiny SDXL's two text encoders, given bigG first, equals its checkpoint", function()
  link(T.ckpt_file("sdxl"), MODELS .. "/checkpoints/tiny-xl.safetensors")
  local ck <close> = kiln.load_checkpoint(MODELS .. "/checkpoints/tiny-xl.safetensors")
  local all = kiln.load_safetensors(T.ckpt_file("sdxl"))
  local l, g = {}, {}
  for k, t in pairs(all) do
    local a = k:match("^conditioner%.embedders%.0%.transformer%.(.*)$")
    local b = k:match("^conditioner%.embedders%.1%.model%.(.*)$")
    if a then l[a] = t elseif b then g[b] = t end
  end
  -- in a folder of their own: the demo's tokenizer beside the demo's encoder is not theirs
  kiln.save_safetensors(MODELS .. "/text_encoders/xl/xl_l.safetensors", l, { ["kiln.heads.clip"] = ck.metadata["kiln.heads.clip"] })
  kiln.save_safetensors(MODELS .. "/text_encoders/xl/xl_g.safetensors", g, { ["kiln.heads.clip"] = ck.metadata["kiln.heads.clip_g"] })
  T.tmp("comfy/models/text_encoders/xl/xl_l.safetensors")
  T.tmp("comfy/models/text_encoders/xl/xl_g.safetensors")
  local f = math.tointeger(ck.vae.factor)
  local s = { ckpt = "tiny-xl.safetensors", prompt = "a red circle", negative = "blur", seed = 3, steps = 2, cfg = 4,
    w = 8 * 32 // f, h = 8 * 32 // f, prefix = "xl2" }
  local gr = txt2img_graph(s)
  for _, k in ipairs({ "6", "7" }) do  -- the size the pipeline's pooled vector carries
    local text = gr[k].inputs.text
    gr[k] = { class_type = "CLIPTextEncodeSDXL", inputs = { clip = { "4", 1 }, width = 32, height = 32, crop_w = 0,
      crop_h = 0, target_width = 32, target_height = 32, text_g = text, text_l = text } }
  end
  gr["44"] = { class_type = "DualCLIPLoader", inputs = { clip_name1 = "xl/xl_g.safetensors", clip_name2 = "xl/xl_l.safetensors",
    type = "sdxl" } }
  gr["6"].inputs.clip, gr["7"].inputs.clip = { "44", 0 }, { "44", 0 }
  local files = run(gr)
  same_picture(files[1], pipeline.txt2img(ck, { prompt = "a red circle", negative = "blur", seed = 3, steps = 2,
    cfg = 4, width = 32, height = 32, weighting = "comfy" }), "sdxl with DualCLIPLoader")
end)

-- ComfyUI's other scale methods (kiln.image.resize through kiln.resample) against
-- PyTorch and Pillow (tests/golden/gen_resize.py writes resize/methods.safetensors)
do
  local rs = kiln.load_safetensors("tests/golden/resize/methods.safetensors")
  local keys = {}
  for k in pairs(rs) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, key in ipairs(keys) do
    local name, w, h, mode, crop = key:match("^(%a+)_(%d+)x(%d+)_([%a%-]+)_(%a+)$")
    if name then
      test("comfy: scale method " .. key .. " matches " .. (mode == "lanczos" and "Pillow" or "PyTorch"), function()
        local got <close> = kiln.image.resize(rs[name], tonumber(w), tonumber(h), { mode = mode, crop = crop })
        local d = maxdiff(got, rs[key])
        if mode == "lanczos" then
          eq(d, 0, "Pillow's 8-bit levels exactly")
        else
          truthy(d <= (mode == "bislerp" and 1e-4 or 1e-5), mode .. " max diff " .. d)
        end
      end)
    end
  end
end

test("comfy: LatentUpscaleBy bislerp / area and ImageScale lanczos / bicubic run; a method a node lacks is refused", function()
  local g = txt2img_graph({ prompt = "x", seed = 1, steps = 1, cfg = 3, prefix = "methods" })
  g["50"] = { class_type = "LatentUpscaleBy", inputs = { samples = { "3", 0 }, upscale_method = "bislerp", scale_by = 1.5 } }
  g["51"] = { class_type = "LatentUpscaleBy", inputs = { samples = { "50", 0 }, upscale_method = "area", scale_by = 0.5 } }
  g["8"].inputs.samples = { "51", 0 }
  g["52"] = { class_type = "ImageScale", inputs = { image = { "8", 0 }, upscale_method = "lanczos", width = 40, height = 24,
    crop = "center" } }
  g["53"] = { class_type = "ImageScaleBy", inputs = { image = { "52", 0 }, upscale_method = "bicubic", scale_by = 2 } }
  g["9"].inputs.images = { "53", 0 }
  local files = run(g)
  local img <close> = kiln.load_png(files[1])
  eq(table.concat(img.shape, "x"), "1x3x48x80")
  g["52"].inputs.upscale_method = "bislerp"
  raises(function() run(g) end, "node 52 (ImageScale): input 'upscale_method' is 'bislerp', not one of " ..
    "nearest-exact, bilinear, area, bicubic, lanczos")
  g["52"].inputs.upscale_method = "lanczos"
  g["50"].inputs.upscale_method = "lanczos"
  raises(function() run(g) end, "node 50 (LatentUpscaleBy): input 'upscale_method' is 'lanczos', not one of " ..
    "nearest-exact, bilinear, area, bicubic, bislerp")
end)

test("comfy: --dry-run prints the schedule with estimates and runs nothing", function()
  local files, r = run(hires_graph(), { dry_run = true })
  eq(#files, 0)
  truthy(r.text:find("KSampler", 1, true) and r.text:find("est. peak", 1, true), r.text)
  eq(#r.plan.order, 13)
  -- the loader comes first, the SaveImage last; the LoRA before both samplers
  eq(r.plan.graph[r.plan.order[#r.plan.order]].class_type, "SaveImage")
end)

test("comfy: --dry-run predicts each node's peak on the meta device as a real run on sim measures it", function()
  local ok, dry = pcall(function() return kiln.dry_run end)
  if not (ok and type(dry) == "function") then H.skip("this build has no kiln.dry_run") end
  local before = 0
  for _ in lfs.dir(OUT) do before = before + 1 end
  local _, r = run(hires_graph(), { dry_run = true, device = "sim" })
  truthy(r.plan.meta, "a dry run ran: " .. tostring(r.plan.meta_error))
  truthy(r.text:find("predicted by a dry run on the meta device", 1, true), r.text)
  local after = 0
  for _ in lfs.dir(OUT) do after = after + 1 end
  eq(after, before, "the dry run wrote no file")
  local _, real = run(hires_graph(), { device = "sim" })
  for _, n in ipairs(real.nodes) do
    local p = r.plan.predicted[n.id]
    truthy(p, "node " .. n.id .. " predicted")
    -- within one small picture: a temporary the collector frees at another moment
    truthy(math.abs(p - n.peak) <= 0.05 * n.peak + 512 * 1024, ("node %s %s: predicted %s, measured %s"):format(n.id,
      n.class_type, comfy.human(p), comfy.human(n.peak)))
  end
end)

test("comfy: bad graphs are named before anything runs", function()
  local g = txt2img_graph(S)
  g["3"].class_type = "KSamplerFancy"
  raises(function() run(g) end, "node 3 (KSamplerFancy): unknown node type 'KSamplerFancy'", "KSamplerAdvanced")
  g = txt2img_graph(S)
  g["4"].inputs.ckpt_name = "nope.safetensors"
  raises(function() run(g) end, "model 'nope.safetensors' not found in " .. MODELS .. "/checkpoints/")
  g = txt2img_graph(S)
  g["3"].inputs.latent_image = { "99", 0 }
  raises(function() run(g) end, "input 'latent_image' links to node 99, which does not exist")
  g = txt2img_graph(S)
  g["3"].inputs.positive = { "4", 0 }
  raises(function() run(g) end, "input 'positive' expects CONDITIONING, but output 0 of node 4 (CheckpointLoaderSimple) is MODEL")
  g = txt2img_graph(S)
  g["6"].inputs.text = 3
  raises(function() run(g) end, "node 6 (CLIPTextEncode): input 'text' must be a string")
  g = txt2img_graph(S)
  g["50"] = { class_type = "LatentUpscaleBy", inputs = { samples = { "51", 0 }, upscale_method = "bilinear", scale_by = 2 } }
  g["51"] = { class_type = "LatentUpscaleBy", inputs = { samples = { "50", 0 }, upscale_method = "bilinear", scale_by = 2 } }
  g["3"].inputs.latent_image = { "51", 0 }
  raises(function() run(g) end, "cycle", "node 50 (LatentUpscaleBy)", "node 51 (LatentUpscaleBy)")
  g = split_graph(S)
  g["4"].inputs.unet_name = nil
  raises(function() run(g) end, "node 4 (UNETLoader): input 'unet_name' (a file name in diffusion_models/ or unet/) is missing")
  raises(function() run({ nodes = {}, links = {} }) end, "UI workflow", "Export (API)")
  raises(function() run(PIC) end, "no ComfyUI workflow in it")
  g = txt2img_graph(S)
  g["9"] = nil
  raises(function() run(g) end, "no output node")
end)

test("comfy: the CLI runs `kiln comfy FILE.json --models DIR --output DIR`; a bad graph is a usage error", function()
  local exe = arg and arg[-1]
  if not exe then H.skip("no kiln program in arg[-1]") end
  local wf = T.tmp("wf.json")
  local f = assert(io.open(wf, "w"))
  f:write(kiln.json.encode(txt2img_graph({ prompt = "x", seed = 1, steps = 1, cfg = 3, prefix = "cli" })))
  f:close()
  local log = T.tmp("cli.log")
  local ok = os.execute(("'%s' comfy '%s' --models '%s' --output '%s' --quiet >'%s' 2>&1"):format(exe, wf, MODELS, OUT, log))
  local lf = assert(io.open(log))
  local text = lf:read("a")
  lf:close()
  assert(ok, text)
  local path = text:match("(%S+cli_00001_%.png)")
  truthy(path, text)
  made_out[#made_out + 1] = path
  local _, _, code = os.execute(("'%s' comfy '%s' --models '%s/none' >'%s' 2>&1"):format(exe, wf, MODELS, log))
  eq(code, 2, "exit status")
  -- --memory-plot: the device's bytes over the run, its stages the nodes (where kiln.mem.plot
  -- exists); on sim as the default device
  local png = T.tmp("comfy_mem.png")
  local okp = os.execute(("'%s' comfy '%s' --device sim --models '%s' --output '%s' --memory-plot '%s' >'%s' 2>&1"):format(exe, wf,
    MODELS, OUT, png, log))
  lf = assert(io.open(log))
  text = lf:read("a")
  lf:close()
  for p in text:gmatch("(%S+cli_%d+_%.png)") do made_out[#made_out + 1] = p end
  if kiln.mem and type(kiln.mem.plot) == "function" then
    assert(okp, text)
    truthy(lfs.attributes(png, "size"), "the plot was written: " .. text)
    truthy(text:find("3 KSampler", 1, true), "the nodes are its stages: " .. text)
  else
    truthy(not okp and text:find("kiln.mem.plot is not available", 1, true), text)
  end
end)

for _, p in ipairs(made_out) do os.remove(p) end
demo:close()
local extra = {}
for i = #dirs, 1, -1 do extra[#extra + 1] = dirs[i] end
T.cleanup(extra)
