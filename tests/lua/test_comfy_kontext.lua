-- ComfyUI's Kontext and GGUF nodes through kiln.comfy: a Kontext graph (LoadImage ->
-- VAEEncode -> ReferenceLatent -> BasicGuider -> SamplerCustomAdvanced) gives the picture
-- kiln.pipeline.txt2img gives with opts.reference and ComfyUI's schedule; chained
-- ReferenceLatents give two references; FluxKontextImageScale resizes as
-- kiln.families.flux.kontext_scale; ComfyUI-GGUF's loaders (UnetLoaderGGUF,
-- UnetLoaderGGUFAdvanced, DualCLIPLoaderGGUF, CLIPLoaderGGUF) load the tiny GGUF files
-- of tests/golden/flux_files and tests/golden/t5 to the pipeline's picture;
-- LoraLoaderModelOnly patches a Flux model; bad inputs are refused before anything runs.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local lfs = require "lfs"
local pipeline = require "kiln.pipeline"
local comfy = require "kiln.comfy"
local flow = require "kiln.flow"
local F = require "kiln.families.flux"
local T = require "tiny_sd"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

if kiln.set_quiet then kiln.set_quiet(true) end
local ROOT = T.TMP .. "/comfykontext"
local MODELS, OUT, INPUT = ROOT .. "/models", ROOT .. "/out", ROOT .. "/input"
for _, d in ipairs({ "", "/models", "/out", "/input", "/models/diffusion_models", "/models/unet",
  "/models/text_encoders", "/models/clip", "/models/vae", "/models/loras" }) do
  lfs.mkdir(ROOT .. d)
end

local function save(rel, t, meta)
  local p = MODELS .. "/" .. rel
  kiln.save_safetensors(p, t, meta)
  T.tmp(p:sub(#T.TMP + 2))
  return p
end
local function copy(src, rel)
  local f = assert(io.open(src, "rb"))
  local data = f:read("a")
  f:close()
  local p = ROOT .. "/" .. rel
  local g = assert(io.open(p, "wb"))
  g:write(data)
  g:close()
  T.tmp(p:sub(#T.TMP + 2))
  return p
end
local DEV = save("diffusion_models/flux-dev.safetensors", T.from_recipe("../flux/pipeline_dit"))
local AE = save("vae/ae.safetensors", (T.from_recipe("../flux/ae")))
local CLIP = (function()
  local t = {}
  for k, v in pairs((T.from_recipe("sd1"))) do
    local n = k:match("^cond_stage_model%.transformer%.(.*)$")
    if n then t[n] = v end
  end
  return save("text_encoders/clip_l.safetensors", t, { ["kiln.heads.clip"] = "2" })
end)()
local T5 = copy("tests/golden/t5/bare.safetensors", "models/text_encoders/t5xxl.safetensors")
local T5Q = copy("tests/golden/t5/q8_0.gguf", "models/clip/t5-q8_0.gguf")
local UQ = copy("tests/golden/flux_files/city96_q8_0.gguf", "models/unet/flux-q8_0.gguf")
local LORA = copy("tests/golden/flux_files/lora_kohya.safetensors", "models/loras/flux-kohya.safetensors")

local G = kiln.load_safetensors("tests/golden/flux/kontext.safetensors")
-- the reference picture as LoadImage reads it (a PNG's 8 bits: exactly the golden's)
local REF_PNG = INPUT .. "/ref.png"
kiln.save_png(G.reference_image, REF_PNG)
T.tmp(REF_PNG:sub(#T.TMP + 2))
local REF = kiln.load_png(REF_PNG)

local function run(g)
  local files = comfy.run(g, { models = MODELS, output = OUT, input = INPUT, quiet = true })
  for _, f in ipairs(files) do T.tmp(f:sub(#T.TMP + 2)) end
  return kiln.load_png(files[1])
end

local function as_png(img)
  local p = T.tmp("comfykontext-ref" .. math.random(1e9) .. ".png")
  kiln.save_png(img:clamp(0, 1), p)
  return kiln.load_png(p)
end

local function graph(o)
  o = o or {}
  return {
    ["1"] = { class_type = o.unet_class or "UNETLoader", inputs = o.unet_inputs or { unet_name = "flux-dev.safetensors",
      weight_dtype = "default" } },
    ["2"] = { class_type = o.clip_class or "DualCLIPLoader", inputs = { clip_name1 = o.t5 or "t5xxl.safetensors",
      clip_name2 = "clip_l.safetensors", type = "flux" } },
    ["3"] = { class_type = "CLIPTextEncodeFlux", inputs = { clip = { "2", 0 }, clip_l = "", t5xxl = "",
      guidance = 3.5 } },
    ["4"] = { class_type = "EmptySD3LatentImage", inputs = { width = 32, height = 32, batch_size = 1 } },
    ["5"] = { class_type = "RandomNoise", inputs = { noise_seed = 9 } },
    ["6"] = { class_type = "KSamplerSelect", inputs = { sampler_name = "euler" } },
    ["7"] = { class_type = "BasicScheduler", inputs = { model = { "1", 0 }, scheduler = "simple", steps = 4,
      denoise = 1.0 } },
    ["8"] = { class_type = "BasicGuider", inputs = { model = { "1", 0 }, conditioning = { o.cond or "3", 0 } } },
    ["9"] = { class_type = "SamplerCustomAdvanced", inputs = { noise = { "5", 0 }, guider = { "8", 0 },
      sampler = { "6", 0 }, sigmas = { "7", 0 }, latent_image = { "4", 0 } } },
    ["10"] = { class_type = "VAELoader", inputs = { vae_name = "ae.safetensors" } },
    ["11"] = { class_type = "VAEDecode", inputs = { samples = { "9", 0 }, vae = { "10", 0 } } },
    ["12"] = { class_type = "SaveImage", inputs = { images = { "11", 0 }, filename_prefix = "kontext" } },
  }
end

local function with_reference(g, n)
  g["20"] = { class_type = "LoadImage", inputs = { image = "ref.png" } }
  g["21"] = { class_type = "VAEEncode", inputs = { pixels = { "20", 0 }, vae = { "10", 0 } } }
  g["22"] = { class_type = "ReferenceLatent", inputs = { conditioning = { "3", 0 }, latent = { "21", 0 } } }
  g["8"].inputs.conditioning = { "22", 0 }
  if n == 2 then
    g["23"] = { class_type = "ReferenceLatent", inputs = { conditioning = { "22", 0 }, latent = { "4", 0 } } }
    g["8"].inputs.conditioning = { "23", 0 }
  end
  return g
end

-- kiln's pipeline with ComfyUI's [dev] schedule (shift 1.15) and T5 at 256 tokens
local function expected(path, t5, opts)
  local ck <close> = kiln.load_checkpoint(path, { vae = AE, clip = CLIP, t5 = t5 or T5 })
  local mu = ck.variant == "dev" and 1.15 or 1.0
  local s = flow.sigmas(flow.model_sampling({ mu = mu }), "simple", 4)
  local o = { prompt = "", seed = 9, width = 32, height = 32, sigmas = s, t5_length = 256,
    guidance = ck.variant == "dev" and 3.5 or nil }
  for k, v in pairs(opts or {}) do o[k] = v end
  local img = pipeline.txt2img(ck, o)
  local r = as_png(img)
  img:free(); s:free()
  return r
end

test("ComfyUI Kontext graph: ReferenceLatent gives kiln.pipeline.txt2img's picture with opts.reference", function()
  local got = run(with_reference(graph(), 1))
  local want = expected(DEV, nil, { reference = REF, reference_scale = false })
  eq(H.shape_of(got), "1,3,32,32")
  eq((got - want):abs():max(), 0)
  local plain = run(graph())
  truthy((plain - got):abs():max() > 0, "the reference changes the picture")
end)

test("ComfyUI Kontext: chained ReferenceLatents give two references; no latent passes the conditioning", function()
  local got = run(with_reference(graph(), 2))
  -- the second reference is EmptySD3LatentImage's zeros: the pipeline's encode of a
  -- picture would not be zeros, so the network is given both latents directly
  local ck <close> = kiln.load_checkpoint(DEV, { vae = AE, clip = CLIP, t5 = T5 })
  ck.vae:load("cpu")
  local r1 = ck.vae:encode(REF)
  ck.vae:unload()
  local s = flow.sigmas(flow.model_sampling({ mu = 1.15 }), "simple", 4)
  local fwd = ck.dit.forward
  local z = kiln.zeros({ 1, 16, 4, 4 })
  ck.dit.forward = function(self, x, t, c, y, o)
    o = { guidance = o.guidance, cache_state = o.cache_state, reference = { r1, z } }
    return fwd(self, x, t, c, y, o)
  end
  local img = pipeline.txt2img(ck, { prompt = "", seed = 9, width = 32, height = 32, sigmas = s, t5_length = 256 })
  ck.dit.forward = nil
  local want = as_png(img)
  eq((got - want):abs():max(), 0)
  img:free(); s:free(); r1:free(); z:free()
  local g = graph()
  g["22"] = { class_type = "ReferenceLatent", inputs = { conditioning = { "3", 0 } } }
  g["8"].inputs.conditioning = { "22", 0 }
  eq((run(g) - run(graph())):abs():max(), 0)
end)

test("ComfyUI FluxKontextImageScale: kiln.families.flux.kontext_scale's size and pixels", function()
  local g = {
    ["1"] = { class_type = "LoadImage", inputs = { image = "ref.png" } },
    ["2"] = { class_type = "FluxKontextImageScale", inputs = { image = { "1", 0 } } },
    ["3"] = { class_type = "SaveImage", inputs = { images = { "2", 0 }, filename_prefix = "scaled" } },
  }
  local got = run(g)
  eq(H.shape_of(got), "1,3,832,1248")   -- 3:2: 1248 / 832 exactly
  local want = as_png(F.kontext_scale(REF))
  eq((got - want):abs():max(), 0)
end)

test("ComfyUI-GGUF loaders: UnetLoaderGGUF(Advanced) + DualCLIPLoaderGGUF give the pipeline's picture", function()
  local g = graph({ unet_class = "UnetLoaderGGUF", unet_inputs = { unet_name = "flux-q8_0.gguf" },
    clip_class = "DualCLIPLoaderGGUF", t5 = "t5-q8_0.gguf" })
  local got = run(g)
  local want = expected(UQ, T5Q)
  eq(H.shape_of(got), "1,3,32,32")
  eq((got - want):abs():max(), 0)
  g["1"] = { class_type = "UnetLoaderGGUFAdvanced", inputs = { unet_name = "flux-q8_0.gguf", dequant_dtype = "target",
    patch_dtype = "default", patch_on_device = false } }
  eq((run(g) - got):abs():max(), 0)
end)

test("ComfyUI LoraLoaderModelOnly on a Flux model: the pipeline's picture with the LoRA", function()
  local g = graph({ unet_class = "UnetLoaderGGUF", unet_inputs = { unet_name = "flux-q8_0.gguf" },
    clip_class = "DualCLIPLoaderGGUF", t5 = "t5-q8_0.gguf" })
  g["30"] = { class_type = "LoraLoaderModelOnly", inputs = { model = { "1", 0 }, lora_name = "flux-kohya.safetensors",
    strength_model = 0.8 } }
  g["7"].inputs.model = { "30", 0 }
  g["8"].inputs.model = { "30", 0 }
  local got = run(g)
  local want = expected(UQ, T5Q, { lora = { { path = LORA, unet = 0.8 } } })
  eq((got - want):abs():max(), 0)
  local plain = expected(UQ, T5Q)
  truthy((got - plain):abs():max() > 0, "the LoRA changes the picture")
end)

test("ComfyUI GGUF / Kontext nodes: inputs checked by name before anything runs", function()
  local g = graph({ clip_class = "DualCLIPLoaderGGUF", t5 = "t5-q8_0.gguf" })
  g["2"].inputs.type = "sd3"
  local err = raises(function() return run(g) end)
  truthy(err:find("type", 1, true) and err:find("sd3", 1, true), err)
  g = graph({ unet_class = "UnetLoaderGGUF", unet_inputs = { unet_name = "missing.gguf" } })
  err = raises(function() return run(g) end)
  truthy(err:find("missing.gguf", 1, true), err)
  g = with_reference(graph(), 1)
  g["22"].inputs.latent = { "3", 0 }
  err = raises(function() return run(g) end)
  truthy(err:find("latent", 1, true) and err:find("LATENT", 1, true), err)
  g = graph()
  g["24"] = { class_type = "FluxKontextMultiReferenceLatentMethod", inputs = { conditioning = { "3", 0 },
    reference_latents_method = "index" } }
  err = raises(function() return run(g) end)
  truthy(err:find("reference_latents_method", 1, true), err)
  -- true CFG with references on one side only: kiln's denoiser gives both passes one list
  g = with_reference(graph(), 1)
  g["9"] = { class_type = "KSampler", inputs = { model = { "1", 0 }, seed = 9, steps = 2, cfg = 2.0,
    sampler_name = "euler", scheduler = "simple", positive = { "22", 0 }, negative = { "3", 0 },
    latent_image = { "4", 0 }, denoise = 1.0 } }
  for _, k in ipairs({ "5", "6", "7", "8" }) do g[k] = nil end
  err = raises(function() return run(g) end)
  truthy(err:find("reference latents", 1, true) and err:find("cfg", 1, true), err)
  g = graph()
  g["2"] = { class_type = "CLIPLoaderGGUF", inputs = { clip_name = "clip_l.safetensors", type = "flux" } }
  err = raises(function() return run(g) end)
  truthy(err:find("type", 1, true), err)
end)

H.done()
