-- tests/fuzz/gen_comfy_seeds.lua - writes the seed workflows of tests/fuzz/corpus/comfy/ (the
-- graphs of tests/lua/test_comfy.lua on a models folder of empty m.safetensors files, as
-- fuzz_comfy.c lays it out) and prints whether each plans. Rerun from the repository
-- root: build/kiln tests/fuzz/gen_comfy_seeds.lua
local comfy = require 'kiln.comfy'
local lfs = require 'lfs'
local ROOT = '/tmp/fzm/models'
lfs.mkdir(ROOT)
for _, d in ipairs({ 'checkpoints', 'loras', 'vae', 'vae_approx', 'controlnet', 'upscale_models',
    'diffusion_models', 'unet', 'text_encoders', 'clip', 'embeddings', 'input' }) do
  lfs.mkdir(ROOT .. '/' .. d)
  if d ~= 'input' then assert(io.open(ROOT .. '/' .. d .. '/m.safetensors', 'wb')):close() end
end
do local pic <close> = kiln.zeros({ 1, 3, 8, 8 }) kiln.save_png(pic, ROOT .. '/input/pic.png') end
local OPTS = { models = ROOT, input = ROOT .. '/input', estimate_only = true }
local M = 'm.safetensors'
local function t2i()
  return {
    ["4"] = { class_type = "CheckpointLoaderSimple", inputs = { ckpt_name = M } },
    ["5"] = { class_type = "EmptyLatentImage", inputs = { width = 512, height = 512, batch_size = 1 } },
    ["6"] = { class_type = "CLIPTextEncode", inputs = { text = "a (red:1.2) circle, embedding:m", clip = { "4", 1 } } },
    ["7"] = { class_type = "CLIPTextEncode", inputs = { text = "", clip = { "4", 1 } } },
    ["3"] = { class_type = "KSampler", inputs = { seed = 5, steps = 20, cfg = 7.5, sampler_name = "euler",
      scheduler = "normal", denoise = 1, model = { "4", 0 }, positive = { "6", 0 }, negative = { "7", 0 }, latent_image = { "5", 0 } } },
    ["8"] = { class_type = "VAEDecode", inputs = { samples = { "3", 0 }, vae = { "4", 2 } } },
    ["9"] = { class_type = "SaveImage", inputs = { filename_prefix = "t2i", images = { "8", 0 } } },
  }
end
local seeds = {}
seeds.txt2img = t2i()
local g = t2i()
g["10"] = { class_type = "LoraLoader", inputs = { model = { "4", 0 }, clip = { "4", 1 }, lora_name = M, strength_model = 0.8, strength_clip = 0.5 } }
g["3"].inputs.model = { "10", 0 }; g["6"].inputs.clip = { "10", 1 }; g["7"].inputs.clip = { "10", 1 }
g["11"] = { class_type = "CLIPSetLastLayer", inputs = { clip = { "10", 1 }, stop_at_clip_layer = -2 } }
seeds.lora = g
g = t2i()
g["5"] = nil
g["10"] = { class_type = "LoadImage", inputs = { image = "pic.png" } }
g["11"] = { class_type = "ImageScale", inputs = { image = { "10", 0 }, upscale_method = "bilinear", width = 64, height = 64, crop = "disabled" } }
g["12"] = { class_type = "VAEEncode", inputs = { pixels = { "11", 0 }, vae = { "4", 2 } } }
g["3"].inputs.latent_image = { "12", 0 }; g["3"].inputs.denoise = 0.6
seeds.img2img = g
g = t2i()
g["20"] = { class_type = "ControlNetLoader", inputs = { control_net_name = M } }
g["21"] = { class_type = "LoadImage", inputs = { image = "pic.png" } }
g["22"] = { class_type = "ControlNetApply", inputs = { conditioning = { "6", 0 }, control_net = { "20", 0 }, image = { "21", 0 }, strength = 0.9 } }
g["3"].inputs.positive = { "22", 0 }
g["23"] = { class_type = "UpscaleModelLoader", inputs = { model_name = M } }
g["24"] = { class_type = "ImageUpscaleWithModel", inputs = { upscale_model = { "23", 0 }, image = { "8", 0 } } }
g["25"] = { class_type = "PreviewImage", inputs = { images = { "24", 0 } } }
seeds.controlnet_upscale = g
g = t2i()
g["8"] = { class_type = "VAEDecodeTiled", inputs = { samples = { "3", 0 }, vae = { "4", 2 }, tile_size = 512, overlap = 64 } }
g["13"] = { class_type = "LatentUpscaleBy", inputs = { samples = { "3", 0 }, upscale_method = "nearest-exact", scale_by = 1.5 } }
g["14"] = { class_type = "VAEDecode", inputs = { samples = { "13", 0 }, vae = { "4", 2 } } }
g["15"] = { class_type = "SaveImage", inputs = { filename_prefix = "hires", images = { "14", 0 } } }
seeds.tiled_hires = g
g = t2i()
g["4"] = { class_type = "UNETLoader", inputs = { unet_name = M, weight_dtype = "default" } }
g["30"] = { class_type = "DualCLIPLoader", inputs = { clip_name1 = M, clip_name2 = M, type = "sdxl" } }
g["31"] = { class_type = "VAELoader", inputs = { vae_name = M } }
g["6"].inputs.clip = { "30", 0 }; g["7"].inputs.clip = { "30", 0 }; g["8"].inputs.vae = { "31", 0 }
seeds.separate_loaders = g
g = t2i()
g["10"] = { class_type = "LoadImage", inputs = { image = "pic.png" } }
g["11"] = { class_type = "LoadImageMask", inputs = { image = "pic.png", channel = "red" } }
g["12"] = { class_type = "VAEEncodeForInpaint", inputs = { pixels = { "10", 0 }, vae = { "4", 2 }, mask = { "11", 0 }, grow_mask_by = 6 } }
g["3"].inputs.latent_image = { "12", 0 }
seeds.inpaint = g
for name, graph in pairs(seeds) do
  local text = kiln.json.encode(graph)
  local ok, err = pcall(comfy.plan, text, OPTS)
  print(name, ok, ok and #err.order or err)
  local f = assert(io.open('tests/fuzz/corpus/comfy/' .. name .. '.json', 'wb')) f:write(text) f:close()
end
-- refusals: a cycle, a missing link, the UI format
g = t2i(); g["6"].inputs.clip = { "3", 0 }
local f = assert(io.open('tests/fuzz/corpus/comfy/bad_link_type.json', 'wb')) f:write(kiln.json.encode(g)) f:close()
g = t2i(); g["5"] = { class_type = "LatentUpscale", inputs = { samples = { "3", 0 }, upscale_method = "bilinear", width = 64, height = 64, crop = "disabled" } }
f = assert(io.open('tests/fuzz/corpus/comfy/cycle.json', 'wb')) f:write(kiln.json.encode(g)) f:close()
f = assert(io.open('tests/fuzz/corpus/comfy/ui_format.json', 'wb')) f:write('{"nodes":[{"id":1,"type":"KSampler"}],"links":[[1,1,0,2,0,"MODEL"]]}') f:close()
for _, n in ipairs({ 'bad_link_type', 'cycle', 'ui_format' }) do
  local ok, err = pcall(comfy.plan, 'tests/fuzz/corpus/comfy/' .. n .. '.json', OPTS)
  print(n, ok, err)
end
