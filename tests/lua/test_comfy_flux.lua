-- ComfyUI's Flux graph (kiln.comfy.flux): UNETLoader + DualCLIPLoader type flux +
-- CLIPTextEncodeFlux + EmptySD3LatentImage + RandomNoise / KSamplerSelect /
-- BasicScheduler / BasicGuider / SamplerCustomAdvanced + VAELoader (ae.safetensors) +
-- VAEDecode + SaveImage on the tiny Flux of tests/golden/gen_flux_pipeline.py gives
-- the picture kiln.pipeline.txt2img gives with ComfyUI's schedule (its Flux shift
-- 1.15 on [dev], 1.0 on [schnell]; T5 padded to 256); FluxGuidance and
-- ModelSamplingFlux change what they should; a CFGGuider with the prompt as negative
-- is the BasicGuider's picture.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local lfs = require "lfs"
local pipeline = require "kiln.pipeline"
local comfy = require "kiln.comfy"
local flow = require "kiln.flow"
local T = require "tiny_sd"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

if kiln.set_quiet then kiln.set_quiet(true) end
local ROOT = T.TMP .. "/comfyflux"
local MODELS, OUT = ROOT .. "/models", ROOT .. "/out"
for _, d in ipairs({ "", "/models", "/out", "/models/diffusion_models", "/models/text_encoders", "/models/vae" }) do
  lfs.mkdir(ROOT .. d)
end

local function save(rel, t, meta)
  local p = MODELS .. "/" .. rel
  kiln.save_safetensors(p, t, meta)
  T.tmp(p:sub(#T.TMP + 2))
  return p
end
local function dit(variant)
  local w, meta = T.from_recipe("../flux/pipeline_dit")
  if variant == "schnell" then
    for k in pairs(w) do if k:match("^guidance_in%.") then w[k] = nil end end
  end
  return save("diffusion_models/flux-" .. variant .. ".safetensors", w, meta)
end
local DEV, SCHNELL = dit("dev"), dit("schnell")
local AE = save("vae/ae.safetensors", (T.from_recipe("../flux/ae")))
local CLIP = (function()
  local t = {}
  for k, v in pairs((T.from_recipe("sd1"))) do
    local n = k:match("^cond_stage_model%.transformer%.(.*)$")
    if n then t[n] = v end
  end
  return save("text_encoders/clip_l.safetensors", t, { ["kiln.heads.clip"] = "2" })
end)()
local T5 = (function()
  local f = assert(io.open("tests/golden/t5/bare.safetensors", "rb"))
  local data = f:read("a")
  f:close()
  local p = MODELS .. "/text_encoders/t5xxl.safetensors"
  local g = assert(io.open(p, "wb"))
  g:write(data)
  g:close()
  T.tmp(p:sub(#T.TMP + 2))
  return p
end)()

local outs = {}
local function run(g)
  local files = comfy.run(g, { models = MODELS, output = OUT, quiet = true })
  for _, f in ipairs(files) do outs[#outs + 1] = f; T.tmp(f:sub(#T.TMP + 2)) end
  return kiln.load_png(files[1])
end

local function as_png(img)
  local p = T.tmp("comfyflux-ref" .. math.random(1e9) .. ".png")
  kiln.save_png(img:clamp(0, 1), p)
  return kiln.load_png(p)
end

local function graph(variant, o)
  o = o or {}
  local g = {
    ["1"] = { class_type = "UNETLoader", inputs = { unet_name = "flux-" .. variant .. ".safetensors",
      weight_dtype = "default" } },
    -- the T5 file first: either order
    ["2"] = { class_type = "DualCLIPLoader", inputs = { clip_name1 = "t5xxl.safetensors",
      clip_name2 = "clip_l.safetensors", type = "flux" } },
    ["3"] = { class_type = "CLIPTextEncodeFlux", inputs = { clip = { "2", 0 }, clip_l = "", t5xxl = "",
      guidance = o.guidance or 3.5 } },
    ["4"] = { class_type = "EmptySD3LatentImage", inputs = { width = 48, height = 32, batch_size = 1 } },
    ["5"] = { class_type = "RandomNoise", inputs = { noise_seed = 7 } },
    ["6"] = { class_type = "KSamplerSelect", inputs = { sampler_name = "euler" } },
    ["7"] = { class_type = "BasicScheduler", inputs = { model = { "1", 0 }, scheduler = "simple", steps = 4,
      denoise = 1.0 } },
    ["8"] = { class_type = "BasicGuider", inputs = { model = { "1", 0 }, conditioning = { "3", 0 } } },
    ["9"] = { class_type = "SamplerCustomAdvanced", inputs = { noise = { "5", 0 }, guider = { "8", 0 },
      sampler = { "6", 0 }, sigmas = { "7", 0 }, latent_image = { "4", 0 } } },
    ["10"] = { class_type = "VAELoader", inputs = { vae_name = "ae.safetensors" } },
    ["11"] = { class_type = "VAEDecode", inputs = { samples = { "9", 0 }, vae = { "10", 0 } } },
    ["12"] = { class_type = "SaveImage", inputs = { images = { "11", 0 }, filename_prefix = "flux" } },
  }
  return g
end

-- kiln's pipeline with ComfyUI's schedule for the variant
local function expected(variant, mu, guidance)
  local ck <close> = kiln.load_checkpoint(variant == "dev" and DEV or SCHNELL, { vae = AE, clip = CLIP, t5 = T5 })
  local s = flow.sigmas(flow.model_sampling({ mu = mu }), "simple", 4)
  local img = pipeline.txt2img(ck, { prompt = "", seed = 7, width = 48, height = 32, sigmas = s, t5_length = 256,
    guidance = guidance })
  local r = as_png(img)
  img:free(); s:free()
  return r
end

test("ComfyUI Flux graph ([schnell]): kiln's pipeline's picture at ComfyUI's shift 1.0", function()
  local got = run(graph("schnell"))
  local want = expected("schnell", 1.0)
  eq(H.shape_of(got), "1,3,32,48")
  eq((got - want):abs():max(), 0)
end)

test("ComfyUI Flux graph ([dev]): shift 1.15, CLIPTextEncodeFlux's guidance; FluxGuidance overrides it", function()
  local got = run(graph("dev", { guidance = 2.0 }))
  local want = expected("dev", 1.15, 2.0)
  eq((got - want):abs():max(), 0)
  local g = graph("dev", { guidance = 2.0 })
  g["13"] = { class_type = "FluxGuidance", inputs = { conditioning = { "3", 0 }, guidance = 5.0 } }
  g["8"].inputs.conditioning = { "13", 0 }
  local got5 = run(g)
  local want5 = expected("dev", 1.15, 5.0)
  eq((got5 - want5):abs():max(), 0)
  truthy((got5 - got):abs():max() > 0, "the guidance changes the picture")
end)

test("ComfyUI Flux graph: ModelSamplingFlux shifts by the size; CFGGuider with the same negative", function()
  local g = graph("dev")
  g["14"] = { class_type = "ModelSamplingFlux", inputs = { model = { "1", 0 }, max_shift = 1.15, base_shift = 0.5,
    width = 1024, height = 1024 } }
  g["7"].inputs.model = { "14", 0 }
  g["8"].inputs.model = { "14", 0 }
  local got = run(g)
  local want = expected("dev", flow.mu(4096), 3.5)
  eq((got - want):abs():max(), 0)
  local c = graph("dev")
  c["8"] = { class_type = "CFGGuider", inputs = { model = { "1", 0 }, positive = { "3", 0 }, negative = { "3", 0 },
    cfg = 2.0 } }
  local gotc = run(c)
  local wantb = run(graph("dev"))
  truthy((gotc - wantb):abs():max() <= 1 / 255 + 1e-6, "cfg 2 with the same negative")
end)

test("ComfyUI Flux graph with KSampler (cfg 1) and CLIPTextEncode + FluxGuidance: the custom sampler's picture", function()
  local g = graph("dev", { guidance = 2.0 })
  g["3"] = { class_type = "CLIPTextEncode", inputs = { clip = { "2", 0 }, text = "" } }
  g["13"] = { class_type = "FluxGuidance", inputs = { conditioning = { "3", 0 }, guidance = 2.0 } }
  g["9"] = { class_type = "KSampler", inputs = { model = { "1", 0 }, seed = 7, steps = 4, cfg = 1.0,
    sampler_name = "euler", scheduler = "simple", positive = { "13", 0 }, negative = { "3", 0 },
    latent_image = { "4", 0 }, denoise = 1.0 } }
  for _, k in ipairs({ "5", "6", "7", "8" }) do g[k] = nil end
  local got = run(g)
  local want = expected("dev", 1.15, 2.0)
  eq((got - want):abs():max(), 0)
end)

test("ComfyUI Flux: DualCLIPLoader flux without a T5 file is refused by name", function()
  local g = graph("schnell")
  g["2"].inputs.clip_name1 = "clip_l.safetensors"
  local err = raises(function() return run(g) end)
  truthy(err:find("T5", 1, true), err)
end)

H.done()
