-- kiln.comfy.gguf: city96's ComfyUI-GGUF text-encoder loaders (CLIPLoaderGGUF,
-- DualCLIPLoaderGGUF) and its advanced UNet loader, with that project's node names and
-- inputs. kiln reads GGUF files itself (quantized weights decoded inside the products),
-- so these are ComfyUI's own loaders under other names: the files come from the same
-- folders (a .gguf or a .safetensors alike), and UnetLoaderGGUFAdvanced's dequantization
-- and patch dtypes have nothing to choose here. UnetLoaderGGUF is kiln.comfy.loaders'.
local registry = require "kiln.comfy.registry"
local loaders = require "kiln.comfy.loaders"

local M = {}
M.nodes = {}
local N = M.nodes
local L = loaders.nodes

-- the type combos are the ComfyUI loaders' (ComfyUI-GGUF reuses their INPUT_TYPES)
local function type_input(node)
  for _, inp in ipairs(L[node].inputs) do
    if inp[1] == "type" then return { "type", inp[2] } end
  end
  error("kiln.comfy.gguf: " .. node .. " has no type input", 0)
end

N.CLIPLoaderGGUF = {
  category = "bootleg",
  inputs = { { "clip_name", "FILE:text_encoders|clip" }, type_input("CLIPLoader") },
  outputs = { "CLIP" },
  run = function(ctx, a) return L.CLIPLoader.run(ctx, { clip_name = a.clip_name, type = a.type }) end,
}

N.DualCLIPLoaderGGUF = {
  category = "bootleg",
  inputs = { { "clip_name1", "FILE:text_encoders|clip" }, { "clip_name2", "FILE:text_encoders|clip" },
    type_input("DualCLIPLoader") },
  outputs = { "CLIP" },
  run = function(ctx, a)
    return L.DualCLIPLoader.run(ctx, { clip_name1 = a.clip_name1, clip_name2 = a.clip_name2, type = a.type })
  end,
}

local DTYPES = { "default", "target", "float32", "float16", "bfloat16" }
N.UnetLoaderGGUFAdvanced = {
  category = "bootleg",
  inputs = { { "unet_name", "FILE:unet|diffusion_models" }, { "dequant_dtype", DTYPES, default = "default" },
    { "patch_dtype", DTYPES, default = "default" }, { "patch_on_device", "BOOLEAN", default = false } },
  outputs = { "MODEL" },
  model_file = "unet_name",
  run = function(ctx, a) return L.UnetLoaderGGUF.run(ctx, { unet_name = a.unet_name }) end,
}

for name, def in pairs(N) do registry.add_node(name, def) end
return M
