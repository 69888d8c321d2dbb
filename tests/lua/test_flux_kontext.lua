-- Flux.1 Kontext [dev] (kiln.flux's reference tokens, kiln.families.flux's Kontext
-- sizes, the pipelines' opts.reference): against tests/golden/gen_flux_kontext.py,
-- which runs Black Forest Labs' own Flux, prepare_kontext and denoise. The network with
-- one reference (BFL's ids) and two (ComfyUI's "offset" placement) within 1e-4; a
-- txt2img with a reference picture within 1e-3 of BFL's loop and autoencoder; the
-- preferred resolutions as BFL's list; bad references refused by name.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local flux = require "kiln.flux"
local F = require "kiln.families.flux"
local pipeline = require "kiln.pipeline"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local G = kiln.load_safetensors("tests/golden/flux/kontext.safetensors")
local T5 = "tests/golden/t5/bare.safetensors"

local files = {}
local function save(name, t, meta)
  if not files[name] then
    files[name] = T.tmp(name .. ".safetensors")
    kiln.save_safetensors(files[name], t, meta)
  end
  return files[name]
end
local function dit_file()
  local w, meta = T.from_recipe("../flux/pipeline_dit")
  return save("kontext-dit", w, meta)
end
local function ae_file() return save("kontext-ae", (T.from_recipe("../flux/ae"))) end
local function clip_file()
  local w = T.from_recipe("sd1")
  local t = {}
  for k, v in pairs(w) do
    local n = k:match("^cond_stage_model%.transformer%.(.*)$")
    if n then t[n] = v end
  end
  return save("kontext-clip", t, { ["kiln.heads.clip"] = "2" })
end
local function load()
  return kiln.load_checkpoint(dit_file(), { vae = ae_file(), clip = clip_file(), t5 = T5 })
end

local function rel(a, b)
  eq(H.shape_of(a), H.shape_of(b), "shape")
  local d = (a:to("cpu"):to("f32") - b):abs():max()
  return d / b:abs():max()
end

if kiln.set_quiet then kiln.set_quiet(true) end
local report = {}

test("flux.reference_ids: index 1 from row and column 0; a second reference placed as ComfyUI's offset", function()
  local ids = flux.reference_ids({ { 4, 6 } })
  eq(#ids, 6)
  eq(table.concat(ids[1], ","), "1,0,0"); eq(table.concat(ids[6], ","), "1,1,2")
  -- 4x6 then 2x4: wider than tall against the space taken, so below the first
  ids = flux.reference_ids({ { 4, 6 }, { 2, 4 } })
  eq(#ids, 8)
  eq(table.concat(ids[7], ","), "1,2,0"); eq(table.concat(ids[8], ","), "1,2,1")
  -- a tall second one goes right of the first
  ids = flux.reference_ids({ { 2, 2 }, { 6, 2 } })
  eq(table.concat(ids[2], ","), "1,0,1")
  eq(table.concat(ids[#ids], ","), "1,2,1")
end)

test("Kontext network: one and two references match BFL's Flux within 1e-4", function()
  local ck <close> = load()
  local dit = ck.dit
  dit:load("cpu")
  local one = dit:forward(G.x, G.t, G.context, G.y, { guidance = G.guidance, reference = G.ref1 })
  local r1 = rel(one, G.net_one)
  truthy(r1 <= 1e-4, "one reference: " .. r1)
  local two = dit:forward(G.x, G.t, G.context, G.y, { guidance = G.guidance, reference = { G.ref1, G.ref2 } })
  local r2 = rel(two, G.net_two)
  truthy(r2 <= 1e-4, "two references: " .. r2)
  -- the references change the prediction (the test can fail)
  local none = dit:forward(G.x, G.t, G.context, G.y, { guidance = G.guidance })
  truthy(rel(none, G.net_one) > 1e-2, "a reference changes the velocity")
  -- mode low streams the blocks to the same numbers
  kiln.memory_mode("low")
  local low = dit:forward(G.x, G.t, G.context, G.y, { guidance = G.guidance, reference = { G.ref1, G.ref2 } })
  kiln.memory_mode("normal")
  local rl = rel(low, G.net_two)
  truthy(rl <= 1e-4, "mode low: " .. rl)
  report[#report + 1] = ("network: one %.2e, two %.2e, low %.2e"):format(r1, r2, rl)
  for _, t in ipairs({ one, two, none, low }) do t:free() end
  dit:unload()
end)

test("Kontext txt2img with a reference picture matches BFL's prepare_kontext + denoise", function()
  local ck <close> = load()
  local img, lat = pipeline.txt2img(ck, { prompt = "", seed = 9, width = 32, height = 32, steps = 4,
    reference = G.reference_image, reference_scale = false })
  local rl, ri = rel(lat, G.latent), rel(img, G.image)
  truthy(rl <= 1e-3, "latent: " .. rl)
  truthy(ri <= 1e-3, "picture: " .. ri)
  report[#report + 1] = ("txt2img: latent %.2e, picture %.2e"):format(rl, ri)
  img:free(); lat:free()
  -- a list of one is the same run; img2img takes references too
  local img2 = pipeline.txt2img(ck, { prompt = "", seed = 9, width = 32, height = 32, steps = 4,
    reference = { G.reference_image }, reference_scale = false })
  truthy(rel(img2, G.image) <= 1e-3, "a list of one")
  local e = pipeline.img2img(ck, img2, { prompt = "", seed = 1, steps = 2, denoise = 0.5,
    reference = G.reference_image, reference_scale = false })
  eq(H.shape_of(e), "1,3,32,32")
  -- hires fix gives both passes the references
  local hr = pipeline.hires_fix(ck, { prompt = "", seed = 9, width = 32, height = 32, steps = 2, scale = 2,
    hires_steps = 1, reference = G.reference_image, reference_scale = false })
  local hn = pipeline.hires_fix(ck, { prompt = "", seed = 9, width = 32, height = 32, steps = 2, scale = 2,
    hires_steps = 1 })
  eq(H.shape_of(hr), "1,3,64,64")
  truthy((hr - hn):abs():max() > 0, "the reference changes the hires picture")
  img2:free(); e:free(); hr:free(); hn:free()
end)

test("Kontext's preferred resolutions: BFL's list, nearest aspect ratio; the scale as FluxKontextImageScale", function()
  eq(#F.KONTEXT_RESOLUTIONS, 17)
  eq(table.concat({ F.kontext_size(512, 512) }, "x"), "1024x1024")
  eq(table.concat({ F.kontext_size(1920, 1080) }, "x"), "1392x752")
  eq(table.concat({ F.kontext_size(1080, 1920) }, "x"), "752x1392")
  eq(table.concat({ F.kontext_size(100, 1000) }, "x"), "672x1568")
  local img = kiln.rand({ 1, 3, 40, 30 })
  local s = F.kontext_scale(img)
  eq(H.shape_of(s), "1,3,1184,880")   -- 3:4 -> 880 / 1184 (0.743), the nearest
  s:free(); img:free()
end)

test("Kontext: bad references are refused by name, and on SD checkpoints", function()
  local ck <close> = load()
  local err = raises(function()
    return pipeline.txt2img(ck, { width = 32, height = 32, steps = 1, reference = "x.png" })
  end)
  truthy(err:find("reference", 1, true), err)
  local odd = kiln.rand({ 1, 3, 24, 32 })
  err = raises(function()
    return pipeline.txt2img(ck, { width = 32, height = 32, steps = 1, reference = odd, reference_scale = false })
  end)
  truthy(err:find("multiples of 16", 1, true), err)
  err = raises(function() return ck.dit:forward(G.x, G.t, G.context, G.y, { guidance = G.guidance,
    reference = kiln.zeros({ 1, 16, 3, 4 }) }) end)
  truthy(err:find("even", 1, true), err)
  err = raises(function() return ck.dit:forward(G.x, G.t, G.context, G.y, { guidance = G.guidance,
    reference = kiln.zeros({ 1, 4, 2, 2 }) }) end)
  truthy(err:find("reference[1]", 1, true), err)
  odd:free()
  local sd <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  err = raises(function() return pipeline.txt2img(sd, { width = 32, height = 32, reference = G.reference_image }) end)
  truthy(err:find("reference", 1, true) and err:find("SD 1", 1, true), err)
end)

for _, l in ipairs(report) do print("  " .. l) end
H.done()
