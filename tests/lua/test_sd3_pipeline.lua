-- kiln.pipeline on SD 3.5 end to end: the tiny Medium-style MMDiT, CLIP-L, bigG and
-- 16-channel decoder of tests/golden/gen_sd3_pipeline.py give the latent and picture
-- Stability AI's own sampling pieces give (do_sampling's get_sigmas, euler, CFGDenoiser
-- and SkipLayerCFGDenoiser, SD3LatentFormat, VAEDecoder), within 1e-3: CFG with the
-- negative prompt, no T5 (the empty T5's zeros), skip-layer guidance as ComfyUI's
-- SkipLayerGuidanceSD3; the family's defaults; bad options refused by name; img2img,
-- inpaint and hires fix run; in mode low on sim the encoders are unloaded while sampling.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local pipeline = require "kiln.pipeline"
local family = require "kiln.family"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local MiB = 1024 * 1024
local GOLD = kiln.load_safetensors("tests/golden/sd3/pipeline.safetensors")
local TOL = 1e-3
local F = family.get("sd3")

local files = {}
local function save(name, t, meta)
  if not files[name] then
    files[name] = T.tmp(name .. ".safetensors")
    kiln.save_safetensors(files[name], t, meta)
  end
  return files[name]
end
local function dit_file() return save("sd3-pipe-dit", (T.from_recipe("../sd3/pipeline_dit"))) end
local function ae_file() return save("sd3-pipe-ae", (T.from_recipe("../flux/ae"))) end
local function clip_file(name, key, act)
  return save("sd3-pipe-" .. name, (T.from_recipe("../sd3/" .. name)),
    { ["kiln.heads." .. key] = "2", ["kiln." .. key .. ".activation"] = act })
end
local function load(opts)
  local o = { vae = ae_file(), clip_l = clip_file("clip_l", "clip", "quick_gelu"),
    clip_g = clip_file("clip_g", "clip_g", "gelu") }
  for k, v in pairs(opts or {}) do o[k] = v end
  local ck = kiln.load_checkpoint(dit_file(), o)
  ck.clip.tokenizer = T.word_tokenizer
  return ck
end

local function rel(a, b)
  eq(H.shape_of(a), H.shape_of(b), "shape")
  local d = (a:to("cpu"):to("f32") - b):abs():max()
  return d / b:abs():max()
end

if kiln.set_quiet then kiln.set_quiet(true) end
local report = {}

local RUN = { prompt = "a photo of a cat", negative = "", seed = 11, width = 48, height = 32, steps = 4,
  scheduler = "normal" }
local function with(extra)
  local o = {}
  for k, v in pairs(RUN) do o[k] = v end
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

for _, case in ipairs({
  { "cfg", {} },
  { "slg", { skip_layer_guidance = { layers = { 1 }, scale = 3.0, start = 0.01, stop = 0.5 } } },
}) do
  test("SD 3.5 txt2img (" .. case[1] .. ") matches the reference's sampling loop and VAE", function()
    local ck <close> = load()
    eq(ck.family, "sd3"); eq(ck.variant, "medium")
    local img, lat = pipeline.txt2img(ck, with(case[2]))
    local rl = rel(lat, GOLD[case[1] .. "_latent"])
    local ri = rel(img, GOLD[case[1] .. "_image"])
    truthy(rl <= TOL, "latent: " .. rl)
    truthy(ri <= TOL, "picture: " .. ri)
    report[#report + 1] = ("%s: latent %.2e, picture %.2e"):format(case[1], rl, ri)
    img:free(); lat:free()
  end)
end

test("SD 3.5: the schedule is the reference's discrete flow (shift 3, 1000 steps, t = 1000 sigma)", function()
  local ck <close> = load()
  local ms = pipeline.flow_sampling(ck, { 1, 16, 4, 6 })
  eq(ms.timestep(0.5), 500)
  truthy(math.abs(ms.sigma_min - F.sigma(1, 3.0)) < 1e-7, "sigma_min " .. ms.sigma_min)
  eq(ms.sigma_max, 1)
  local s = pipeline.sigmas(ck, "simple", 4, 1, { 1, 16, 4, 6 }):table()
  -- ComfyUI's simple over the 1000-value table: every 250th from the top
  truthy(math.abs(s[2] - F.sigma(750, 3.0)) < 1e-6, "simple " .. s[2])
  eq(s[5], 0)
end)

test("SD 3.5: defaults per variant; bad options refused by name", function()
  local ck <close> = load()
  -- skip_layer_guidance = true takes ComfyUI's layers 7, 8, 9: this 3-block model has none
  local err = raises(function() return pipeline.txt2img(ck, with({ skip_layer_guidance = true })) end)
  truthy(err:find("skip_layer_guidance", 1, true) and err:find("0 to 2", 1, true), err)
  err = raises(function() return pipeline.txt2img(ck, with({ skip_layer_guidance = { layers = { 1 }, scael = 3 } }))
  end)
  truthy(err:find("scael", 1, true), err)
  err = raises(function() return pipeline.txt2img(ck, with({ guidance = 3.5 })) end)
  truthy(err:find("guidance", 1, true) and err:find("cfg", 1, true), err)
  err = raises(function() return pipeline.txt2img(ck, with({ width = 40 })) end)
  truthy(err:find("2x2", 1, true) or err:find("even", 1, true), err)
  err = raises(function() return pipeline.txt2img(ck, with({ sampler = "euler_ancestral" })) end)
  truthy(err:find("euler_ancestral", 1, true), err)
  local sd <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  err = raises(function() return pipeline.txt2img(sd, { width = 32, height = 32, skip_layer_guidance = true }) end)
  truthy(err:find("skip_layer_guidance", 1, true), err)
  -- without CLIP files: the missing part names what to pass
  local alone <close> = kiln.load_checkpoint(dit_file(), { vae = ae_file() })
  err = raises(function() return pipeline.txt2img(alone, with()) end)
  truthy(err:find("clip_l", 1, true), err)
  eq(pipeline.default_cfg(ck), 4.5)
end)

test("SD 3.5 cfg 1 (Turbo's default) takes no negative pass; the same negative as prompt gives cfg's c", function()
  local ck <close> = load()
  local a = pipeline.txt2img(ck, with({ cfg = 1 }))
  local b = pipeline.txt2img(ck, with({ cfg = 3, negative = "a photo of a cat" }))
  truthy(rel(b, a) <= TOL, "u + (c - u) cfg = c when u = c")
  a:free(); b:free()
end)

test("SD 3.5 img2img, inpaint and hires fix run", function()
  local ck <close> = load()
  local src = GOLD.cfg_image
  local img = pipeline.img2img(ck, src, with({ denoise = 0.5 }))
  eq(H.shape_of(img), "1,3,32,48")
  truthy((img - src):abs():max() > 0, "img2img changes the picture")
  img:free()
  local mask = kiln.zeros({ 1, 1, 32, 48 })
  local half = mask:narrow(4, 25, 24)
  half:fill(1)
  half:free()
  img = pipeline.inpaint(ck, src, mask, with())
  local keep = img:narrow(4, 1, 8):contiguous()
  local want = src:narrow(4, 1, 8):contiguous()
  eq((keep - want):abs():max(), 0)
  img:free(); keep:free(); want:free(); mask:free()
  local big = pipeline.hires_fix(ck, with({ scale = 2, hires_steps = 2 }))
  eq(H.shape_of(big), "1,3,64,96")
  big:free()
end)

-- The tiny MMDiT as diffusers' SD3Transformer2DModel stores it: q / k / v apart (rows
-- of the fused qkv), the final layer's and the last context block's modulation halves
-- swapped (diffusers' AdaLayerNormContinuous keeps scale before shift), the names of
-- kiln.families.sd3.to_diffusers.
local function diffusers_folder(recipe)
  recipe = recipe or "pipeline_dit"
  local key = "sd3-diffusers-" .. recipe
  if files[key] then return files[key] end
  local w = T.from_recipe("../sd3/" .. recipe)
  local depth = 3
  local t = {}
  for n, v in pairs(w) do
    local base, what = n:match("^(.*attn2?)%.qkv%.(%a+)$")
    local swap = n:match("^final_layer%.adaLN_modulation%.1%.") or
        n:match(("^joint_blocks%%.%d%%.context_block%%.adaLN_modulation%%.1%%."):format(depth - 1))
    if base then
      local H = v.shape[1] // 3
      for i, q in ipairs({ "q", "k", "v" }) do
        t[assert(F.to_diffusers(base .. "." .. q .. "." .. what), n)] = v:narrow(1, (i - 1) * H + 1, H):contiguous()
      end
    elseif swap then
      local H = v.shape[1] // 2
      t[assert(F.to_diffusers(n), n)] = kiln.cat({ v:narrow(1, H + 1, H), v:narrow(1, 1, H) }, 1)
    else
      t[assert(F.to_diffusers(n), n)] = v
    end
  end
  local dir = T.tmp(key)
  for _, sub in ipairs({ "transformer", "text_encoder", "text_encoder_2" }) do
    assert(os.execute("mkdir -p '" .. dir .. "/" .. sub .. "'"))
  end
  kiln.save_safetensors(T.tmp(key .. "/transformer/diffusion_pytorch_model.safetensors"), t)
  local function write(path, text)
    local f = assert(io.open(T.tmp(path:sub(#dir - #key + 1)), "w"))
    f:write(text)
    f:close()
  end
  write(dir .. "/transformer/config.json", '{"_class_name": "SD3Transformer2DModel", "num_attention_heads": 3}')
  for _, e in ipairs({ { "text_encoder", "clip_l", "quick_gelu" }, { "text_encoder_2", "clip_g", "gelu" } }) do
    kiln.save_safetensors(T.tmp(key .. "/" .. e[1] .. "/model.safetensors"), (T.from_recipe("../sd3/" .. e[2])))
    write(dir .. "/" .. e[1] .. "/config.json", ('{"hidden_act": "%s", "num_attention_heads": 2}'):format(e[3]))
  end
  files[key] = dir
  return dir
end

test("SD 3.5 diffusers folder (transformer/, text_encoder/, text_encoder_2/) loads to the same picture", function()
  local dir = diffusers_folder()
  local ck <close> = kiln.load_checkpoint(dir, { vae = ae_file() })
  eq(ck.family, "sd3"); eq(ck.variant, "medium")
  eq(ck.dit.config.heads, 3)
  ck.clip.tokenizer = T.word_tokenizer
  local img, lat = pipeline.txt2img(ck, with())
  local rl = rel(lat, GOLD.cfg_latent)
  truthy(rl <= TOL, "diffusers latent: " .. rl)
  report[#report + 1] = ("diffusers folder: latent %.2e"):format(rl)
  img:free(); lat:free()
  -- the transformer/ folder alone is a diffusion model too
  local alone <close> = kiln.load_checkpoint(dir .. "/transformer")
  eq(alone.family, "sd3")
  -- a wrong class names what kiln reads
  local bad = T.tmp("sd3-diffusers-bad")
  assert(os.execute("mkdir -p '" .. bad .. "/transformer'"))
  local f = assert(io.open(T.tmp("sd3-diffusers-bad/transformer/config.json"), "w"))
  f:write('{"_class_name": "HunyuanDiT2DModel"}')
  f:close()
  local err = raises(function() return kiln.load_checkpoint(bad) end)
  truthy(err:find("SD3Transformer2DModel", 1, true), err)
end)

-- LoRAs: the generator's merge (tests/golden/gen_sd3_lora.py) on the tiny "medium"
-- stored fused (Stability AI's file) and split (a diffusers folder's q / k / v apart)
local LGOLD = kiln.load_safetensors("tests/golden/sd3/lora_expected.safetensors")
local LORA_TOL = 2e-5

-- the weight `name` (Stability AI's, fused) of a loaded MMDiT, whatever its storage
local function fused_weight(dit, name)
  local w = dit.weights
  local base = name:match("^(.*attn2?)%.qkv%.weight$")
  if base and dit.config.split_qkv then
    local q, k, v = w:tensor(base .. ".q.weight"), w:tensor(base .. ".k.weight"), w:tensor(base .. ".v.weight")
    local r = kiln.cat({ q:to("f32"), k:to("f32"), v:to("f32") }, 1)
    q:free(); k:free(); v:free()
    return r
  end
  return w:tensor(name):to("f32")
end

for _, storage in ipairs({ "fused", "split" }) do
  for _, fmt_name in ipairs({ "kohya", "peft", "comfy" }) do
    test(("SD 3.5 LoRA (%s) on the %s MMDiT merges as the generator's W + up down alpha / rank"):format(fmt_name,
      storage), function()
      local path = storage == "fused" and save("sd3-lora-medium", (T.from_recipe("../sd3/medium")))
          or (diffusers_folder("medium") .. "/transformer")
      local ck <close> = kiln.load_checkpoint(path)
      eq(ck.dit.config.split_qkv, storage == "split")
      local before = ck.dit:forward(kiln.randn({ 1, 16, 4, 4 }, { seed = 1 }), kiln.tensor({ 500 }),
        kiln.randn({ 1, 3, 32 }, { seed = 2 }), kiln.randn({ 1, 24 }, { seed = 3 }))
      local h = ck:add_lora("tests/golden/sd3/lora_" .. fmt_name .. ".safetensors")
      eq(#h.unmatched, 0, "unmatched: " .. table.concat(h.unmatched, ", "))
      truthy(h.patched > 0, "patched")
      local n, worst = 0, 0
      for key, want in pairs(LGOLD) do
        local f, name = key:match("^(%a+)%.(.*%.weight)$")
        if f == fmt_name then
          local rr = LGOLD[key .. "#rows"]:table()
          local a, b = math.tointeger(rr[1]), math.tointeger(rr[2])
          local got = fused_weight(ck.dit, name)
          local g = kiln.cat({ got:narrow(1, a + 1, 8), got:narrow(1, b - 7, 8) }, 1)
          local d = (g - want):abs():max()
          worst = math.max(worst, d)
          truthy(d <= LORA_TOL, ("%s: %.2e"):format(name, d))
          n = n + 1
        end
      end
      truthy(n >= 2, "compared " .. n)
      local after = ck.dit:forward(kiln.randn({ 1, 16, 4, 4 }, { seed = 1 }), kiln.tensor({ 500 }),
        kiln.randn({ 1, 3, 32 }, { seed = 2 }), kiln.randn({ 1, 24 }, { seed = 3 }))
      truthy((after - before):abs():max() > 0, "the LoRA changes the forward")
      h:remove()
      local again = ck.dit:forward(kiln.randn({ 1, 16, 4, 4 }, { seed = 1 }), kiln.tensor({ 500 }),
        kiln.randn({ 1, 3, 32 }, { seed = 2 }), kiln.randn({ 1, 24 }, { seed = 3 }))
      eq((again - before):abs():max(), 0, "removed")
      -- and without it the weights are not the merge (the comparison above can fail)
      for key, want in pairs(LGOLD) do
        local f, name = key:match("^(%a+)%.(.*%.weight)$")
        if f == fmt_name then
          local rr = LGOLD[key .. "#rows"]:table()
          local a, b = math.tointeger(rr[1]), math.tointeger(rr[2])
          local got = fused_weight(ck.dit, name)
          local g = kiln.cat({ got:narrow(1, a + 1, 8), got:narrow(1, b - 7, 8) }, 1)
          truthy((g - want):abs():max() > 1e-3, name .. " unpatched differs")
        end
      end
      report[#report + 1] = ("LoRA %s on %s: %d weights, max |merged - expected| %.2e"):format(fmt_name, storage,
        h.patched, worst)
    end)
  end
end

test("SD 3.5 LoRA: a Flux LoRA on an SD 3.5 checkpoint is refused naming both", function()
  local ck <close> = kiln.load_checkpoint(save("sd3-lora-medium", (T.from_recipe("../sd3/medium"))))
  local p = T.tmp("sd3-flux-lora.safetensors")
  kiln.save_safetensors(p, { ["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"] = kiln.zeros({ 4, 8 }),
    ["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"] = kiln.zeros({ 24, 4 }) })
  local err = raises(function() return ck:add_lora(p) end)
  truthy(err:find("Flux", 1, true) and err:find("SD 3.5", 1, true), err)
end)

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

test("SD 3.5 txt2img in mode low on sim: the same picture, the text encoders unloaded while sampling", function()
  if not has_sim then H.skip("no sim device") end
  local ck <close> = load()
  kiln.memory_mode("low")
  local seen = {}
  local ok, img = pcall(pipeline.txt2img, ck, with({ device = "sim", callback = function()
    seen.clip = ck.clip:bytes("sim")
  end }))
  kiln.memory_mode("normal")
  truthy(ok, tostring(img))
  eq(seen.clip, 0, "CLIP unloaded while sampling")
  local r = rel(img, GOLD.cfg_image)
  truthy(r <= TOL, "low mode: " .. r)
  img:free()
end)

local dirs = {}
for _, r in ipairs({ "pipeline_dit", "medium" }) do
  for _, sub in ipairs({ "/transformer", "/text_encoder", "/text_encoder_2", "" }) do
    dirs[#dirs + 1] = "/sd3-diffusers-" .. r .. sub
  end
end
dirs[#dirs + 1] = "/sd3-diffusers-bad/transformer"
dirs[#dirs + 1] = "/sd3-diffusers-bad"
T.cleanup(dirs)
for _, l in ipairs(report) do print("  " .. l) end
H.done()
