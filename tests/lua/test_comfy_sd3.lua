-- ComfyUI's SD 3.5 graph (kiln.comfy.sd3): TripleCLIPLoader (the three files in any
-- order) + CLIPTextEncode / CLIPTextEncodeSD3 + UNETLoader + EmptySD3LatentImage +
-- KSampler / SamplerCustomAdvanced + VAELoader + VAEDecode + SaveImage on the tiny
-- Medium-style model of tests/golden/gen_sd3_pipeline.py (with a tiny 4096-wide T5)
-- gives the picture kiln.pipeline.txt2img gives with the same sigmas; ModelSamplingSD3
-- and SkipLayerGuidanceSD3 change what they should; CheckpointLoaderSimple on an
-- all-in-one file gives the same picture as the separate files.
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
local ROOT = T.TMP .. "/comfysd3"
local MODELS, OUT = ROOT .. "/models", ROOT .. "/out"
local DIRS = { "", "/models", "/out", "/models/diffusion_models", "/models/text_encoders", "/models/vae",
  "/models/checkpoints" }
for _, d in ipairs(DIRS) do lfs.mkdir(ROOT .. d) end

local function save(rel, t, meta)
  local p = MODELS .. "/" .. rel
  kiln.save_safetensors(p, t, meta)
  T.tmp(p:sub(#T.TMP + 2))
  return p
end
local DIT_W = T.from_recipe("../sd3/pipeline_dit")
local DIT = save("diffusion_models/sd35-tiny.safetensors", DIT_W)
local AE_W = T.from_recipe("../flux/ae")
local AE = save("vae/sd35-ae.safetensors", AE_W)
local CL_W, CG_W = T.from_recipe("../sd3/clip_l"), T.from_recipe("../sd3/clip_g")
local CLIP_L = save("text_encoders/clip_l.safetensors", CL_W,
  { ["kiln.heads.clip"] = "2", ["kiln.clip.activation"] = "quick_gelu" })
local CLIP_G = save("text_encoders/clip_g.safetensors", CG_W,
  -- the metadata both readers look for: a text-encoder file alone (TripleCLIPLoader) and
  -- kiln.load_checkpoint's clip_g option
  { ["kiln.heads.clip"] = "2", ["kiln.clip.activation"] = "gelu", ["kiln.heads.clip_g"] = "2",
    ["kiln.clip_g.activation"] = "gelu" })
-- a T5 v1.1 of tests/golden/t5/bare.safetensors' layout, one block, 4096 wide (the
-- MMDiT's context); its 100-id vocabulary holds the empty prompt's ids (1, then 0)
local T5_W = (function()
  local d, inner, ff = 4096, 64, 96
  local shapes = {
    ["block.0.layer.0.SelfAttention.q.weight"] = { inner, d }, ["block.0.layer.0.SelfAttention.k.weight"] = { inner, d },
    ["block.0.layer.0.SelfAttention.v.weight"] = { inner, d }, ["block.0.layer.0.SelfAttention.o.weight"] = { d, inner },
    ["block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = { 32, 4 },
    ["block.0.layer.0.layer_norm.weight"] = { d }, ["block.0.layer.1.layer_norm.weight"] = { d },
    ["block.0.layer.1.DenseReluDense.wi_0.weight"] = { ff, d },
    ["block.0.layer.1.DenseReluDense.wi_1.weight"] = { ff, d },
    ["block.0.layer.1.DenseReluDense.wo.weight"] = { d, ff },
    ["final_layer_norm.weight"] = { d }, ["shared.weight"] = { 100, d },
  }
  local t, seed = {}, 300
  for _, n in ipairs((function()
    local k = {}
    for n in pairs(shapes) do k[#k + 1] = n end
    table.sort(k)
    return k
  end)()) do
    seed = seed + 1
    local s = shapes[n]
    local r = kiln.randn(s, { seed = seed })
    if #s == 1 then
      t[n] = r * 0.1 + 1
    else
      t[n] = r * (1 / math.sqrt(s[2]))
    end
    r:free()
  end
  return t
end)()
local T5 = save("text_encoders/t5xxl_tiny.safetensors", T5_W)
local AIO = (function()
  local t = {}
  for k, v in pairs(DIT_W) do t["model.diffusion_model." .. k] = v end
  for k, v in pairs(CL_W) do t["text_encoders.clip_l.transformer." .. k] = v end
  for k, v in pairs(CG_W) do t["text_encoders.clip_g.transformer." .. k] = v end
  for k, v in pairs(T5_W) do t["text_encoders.t5xxl.transformer." .. k] = v end
  for k, v in pairs(AE_W) do t["first_stage_model." .. k] = v end
  return save("checkpoints/sd35-aio.safetensors", t, { ["kiln.heads.clip"] = "2", ["kiln.heads.clip_g"] = "2",
    ["kiln.clip.activation"] = "quick_gelu", ["kiln.clip_g.activation"] = "gelu" })
end)()

local outs = {}
local function run(g)
  local files = comfy.run(g, { models = MODELS, output = OUT, quiet = true })
  for _, f in ipairs(files) do outs[#outs + 1] = f; T.tmp(f:sub(#T.TMP + 2)) end
  return kiln.load_png(files[1])
end

local function as_png(img)
  local p = T.tmp("comfysd3-ref" .. math.random(1e9) .. ".png")
  kiln.save_png(img:clamp(0, 1), p)
  return kiln.load_png(p)
end

local function graph(o)
  o = o or {}
  return {
    ["1"] = { class_type = "UNETLoader", inputs = { unet_name = "sd35-tiny.safetensors", weight_dtype = "default" } },
    -- T5 first, bigG before CLIP-L: any order
    ["2"] = { class_type = "TripleCLIPLoader", inputs = { clip_name1 = "t5xxl_tiny.safetensors",
      clip_name2 = "clip_g.safetensors", clip_name3 = "clip_l.safetensors" } },
    ["3"] = { class_type = "CLIPTextEncode", inputs = { clip = { "2", 0 }, text = "" } },
    ["4"] = { class_type = "EmptySD3LatentImage", inputs = { width = 48, height = 32, batch_size = 1 } },
    ["5"] = { class_type = "KSampler", inputs = { model = { "1", 0 }, positive = { "3", 0 }, negative = { "3", 0 },
      latent_image = { "4", 0 }, seed = 11, steps = 4, cfg = 4.5, sampler_name = "euler", scheduler = "simple",
      denoise = 1.0 } },
    ["10"] = { class_type = "VAELoader", inputs = { vae_name = "sd35-ae.safetensors" } },
    ["11"] = { class_type = "VAEDecode", inputs = { samples = { "5", 0 }, vae = { "10", 0 } } },
    ["12"] = { class_type = "SaveImage", inputs = { images = { "11", 0 }, filename_prefix = "sd3" } },
  }
end

-- kiln's pipeline with the schedule of shift s (ComfyUI's simple over the 1000 sigmas)
local function expected(shift, extra)
  local ck <close> = kiln.load_checkpoint(DIT, { vae = AE, clip_l = CLIP_L, clip_g = CLIP_G, t5 = T5 })
  local s = flow.sigmas(flow.model_sampling({ shift = shift, multiplier = 1000, table = 1000 }), "simple", 4)
  local o = { prompt = "", negative = "", seed = 11, width = 48, height = 32, sigmas = s, cfg = 4.5 }
  for k, v in pairs(extra or {}) do o[k] = v end
  local img = pipeline.txt2img(ck, o)
  local r = as_png(img)
  img:free(); s:free()
  return r
end

test("ComfyUI SD 3.5 graph: TripleCLIPLoader + CLIPTextEncode + KSampler give the pipeline's picture", function()
  local got = run(graph())
  local want = expected(3.0)
  eq(H.shape_of(got), "1,3,32,48")
  eq((got - want):abs():max(), 0)
end)

test("ComfyUI SD 3.5: CLIPTextEncodeSD3, ModelSamplingSD3 and SkipLayerGuidanceSD3 as the pipeline's options", function()
  local g = graph()
  g["3"] = { class_type = "CLIPTextEncodeSD3", inputs = { clip = { "2", 0 }, clip_l = "", clip_g = "", t5xxl = "",
    empty_padding = "empty_prompt" } }
  g["13"] = { class_type = "ModelSamplingSD3", inputs = { model = { "1", 0 }, shift = 2.0 } }
  g["14"] = { class_type = "SkipLayerGuidanceSD3", inputs = { model = { "13", 0 }, layers = "1", scale = 3.0,
    start_percent = 0.01, end_percent = 0.5 } }
  g["5"].inputs.model = { "14", 0 }
  local got = run(g)
  local want = expected(2.0, { skip_layer_guidance = { layers = { 1 }, scale = 3.0, start = 0.01, stop = 0.5 } })
  eq((got - want):abs():max(), 0)
  local plain = expected(2.0)
  truthy((got - plain):abs():max() > 0, "skip-layer guidance changes the picture")
  -- a block the model does not have is refused by name
  g["14"].inputs.layers = "7, 8, 9"
  local err = raises(function() return run(g) end)
  truthy(err:find("layer 7", 1, true) and err:find("0 to 2", 1, true), err)
end)

test("ComfyUI SD 3.5: CheckpointLoaderSimple on an all-in-one file gives the same picture", function()
  local g = graph()
  g["1"] = { class_type = "CheckpointLoaderSimple", inputs = { ckpt_name = "sd35-aio.safetensors" } }
  g["3"].inputs.clip = { "1", 1 }
  g["11"].inputs.vae = { "1", 2 }
  g["10"] = nil
  local got = run(g)
  local want = expected(3.0)
  eq((got - want):abs():max(), 0)
  -- two files only: TripleCLIPLoader says what it needs
  local b = graph()
  b["2"].inputs.clip_name1 = "clip_g.safetensors"
  local err = raises(function() return run(b) end)
  truthy(err:find("TripleCLIPLoader", 1, true) and err:find("T5", 1, true), err)
end)

-- CLIPTextEncodeSD3's conditioning against ComfyUI's SD3ClipModel arithmetic, assembled
-- here from each encoder run alone on the ids ComfyUI's tokenizers give: CLIP-L reads
-- clip_l, bigG clip_g, T5 t5xxl (texts of ids under the tiny T5's 100).
local captured
comfy.add_node("KilnTestCaptureSD3", {
  category = "kiln/test",
  inputs = { { "conditioning", "CONDITIONING" } },
  outputs = {},
  output = true,
  run = function(_, a)
    local e = a.conditioning.entries[1]
    captured = { cond = e.cond:to("cpu"):contiguous(), pooled = e.pooled:to("cpu"):contiguous() }
    return {}
  end,
})

local held = {}
local function encode_sd3(l, g, t5text, padding)
  captured = nil
  local gr = {
    ["2"] = { class_type = "TripleCLIPLoader", inputs = { clip_name1 = "t5xxl_tiny.safetensors",
      clip_name2 = "clip_g.safetensors", clip_name3 = "clip_l.safetensors" } },
    ["3"] = { class_type = "CLIPTextEncodeSD3", inputs = { clip = { "2", 0 }, clip_l = l, clip_g = g, t5xxl = t5text,
      empty_padding = padding } },
    ["4"] = { class_type = "KilnTestCaptureSD3", inputs = { conditioning = { "3", 0 } } },
  }
  comfy.run(gr, { models = MODELS, output = OUT, quiet = true })
  held[#held + 1] = captured
  return captured
end

test("ComfyUI SD 3.5: CLIPTextEncodeSD3 gives each encoder its own text, empty_padding as ComfyUI", function()
  local ck <close> = kiln.load_checkpoint(DIT, { vae = AE, clip_l = CLIP_L, clip_g = CLIP_G, t5 = T5 })
  ck.clip:load("cpu")
  ck.t5:load("cpu")
  local BOS, EOS = 49406, 49407
  -- one encoder alone on ComfyUI's ids: start, the text, end, then CLIP-L's end token or
  -- bigG's 0 up to 77 per window; windows after the text's are the empty prompt's
  local function clip_alone(role, text, windows)
    for _, e in ipairs(ck.clip.encoders) do
      if e.enc.config.role == role then
        local pad = e.pad or EOS
        local toks = ck.clip:tokenize(text)
        local n = 0
        for _, id in ipairs(toks) do if id ~= BOS and id ~= EOS then n = n + 1 end end
        local zs, pooled = {}, nil
        for w = 1, windows do
          local ids = { BOS }
          local first = (w - 1) * 75
          local inside = w == 1 or first < n
          if inside then
            local ti = 0
            for _, id in ipairs(toks) do
              if id ~= BOS and id ~= EOS then
                ti = ti + 1
                if ti > first and ti <= first + 75 then ids[#ids + 1] = id end
              end
            end
          end
          ids[#ids + 1] = EOS
          while #ids < 77 do ids[#ids + 1] = pad end
          if #ids == 78 then table.remove(ids, 77) end
          local z, p = e.enc:forward(ids, { layer = e.layer, final_norm = e.final_norm, pooled = w == 1 and e.pooled or nil })
          zs[w] = z
          pooled = pooled or p
        end
        local z = #zs == 1 and zs[1] or kiln.cat(zs, 2)
        return z, pooled
      end
    end
  end
  local function t5_alone(text)
    if text == nil then return ck.t5:forward(kiln.tensor({ { 1 } }, "i64")) end
    local ids = require("kiln.t5").tokenize(text)
    while #ids < 77 do ids[#ids + 1] = 0 end
    return ck.t5:forward(kiln.tensor({ ids }, "i64"))
  end
  local function want(l, g, t5text, windows)
    local parts = {}
    local pooled
    if l or g then
      local zl, pl = clip_alone("l", l or "", windows or 1)
      local zg, pg = clip_alone("g", g or "", windows or 1)
      local w = zl.shape[3] + zg.shape[3]
      parts[1] = kiln.cat({ zl, zg, kiln.zeros({ 1, zl.shape[2], 4096 - w }) }, 3)
      pooled = kiln.cat({ pl, pg }, 2)
    else
      pooled = kiln.zeros({ 1, ck.clip:pooled_width() })
    end
    parts[#parts + 1] = t5_alone(t5text)
    return #parts == 1 and parts[1] or kiln.cat(parts, 2), pooled
  end
  local function same(got, l, g, t5text, windows)
    local c, p = want(l, g, t5text, windows)
    eq(H.shape_of(got.cond), H.shape_of(c))
    eq(H.shape_of(got.pooled), H.shape_of(p))
    truthy((got.cond - c):abs():max() < 1e-5, "context as ComfyUI's")
    truthy((got.pooled - p):abs():max() < 1e-5, "pooled as ComfyUI's")
  end

  -- three different texts: CLIP-L, bigG and T5 each read their own
  local got = encode_sd3("a red circle", "a blue square on a green field", "the and of", "none")
  same(got, "a red circle", "a blue square on a green field", "the and of")
  eq(H.shape_of(got.cond), "1,154,4096")
  local swapped = encode_sd3("a blue square on a green field", "a red circle", "the and of", "none")
  truthy((swapped.cond - got.cond):abs():max() > 1e-3, "clip_l and clip_g are not the same input")
  -- "none": both CLIP texts empty leave the CLIP block out (pooled zeros); an empty T5
  -- text runs T5 on its end token alone
  same(encode_sd3("", "", "a, the. to", "none"), nil, nil, "a, the. to")
  got = encode_sd3("", "", "", "none")
  eq(H.shape_of(got.cond), "1,1,4096")
  same(got, nil, nil, nil)
  -- one CLIP text empty: that encoder reads the empty prompt, with either padding
  same(encode_sd3("", "a blue square", "", "none"), "", "a blue square", nil)
  same(encode_sd3("", "a blue square", "", "empty_prompt"), "", "a blue square", "")
  -- "empty_prompt": the empty texts are the empty prompt's tokens
  got = encode_sd3("", "", "", "empty_prompt")
  eq(H.shape_of(got.cond), "1,154,4096")
  same(got, "", "", "")
  -- a clip_l of two windows: bigG's one window is followed by the empty prompt's
  local long = string.rep("a red circle and ", 22)
  got = encode_sd3(long, "a blue square", "the", "none")
  eq(H.shape_of(got.cond), "1,231,4096")
  same(got, long, "a blue square", "the", 2)
  for _, c in ipairs(held) do c.cond:free(); c.pooled:free() end
  held, captured = {}, nil
end)

local dirs = {}
for i = #DIRS, 1, -1 do dirs[#dirs + 1] = "/comfysd3" .. DIRS[i] end
T.cleanup(dirs)
H.done()
