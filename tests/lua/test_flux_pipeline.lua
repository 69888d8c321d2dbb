-- kiln.pipeline.txt2img on Flux end to end: the tiny [schnell] and [dev] of
-- tests/golden/gen_flux_pipeline.py (tiny Flux, T5, CLIP-L and autoencoder) give the
-- picture Black Forest Labs' own sampling loop and autoencoder give, within 1e-3, with
-- the family's defaults (schnell: 4 steps, T5 at 256 tokens, unshifted; dev: guidance
-- 3.5, T5 at 512, schedule shifted by the token count); kiln.flow's schedule is BFL's;
-- odd sizes and [dev]-only options on [schnell] are refused by name; in mode "low" on
-- sim the run stays inside a budget smaller than its weights, the text encoders
-- unloaded before sampling.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local flow = require "kiln.flow"
local pipeline = require "kiln.pipeline"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local MiB = 1024 * 1024
local GOLD = kiln.load_safetensors("tests/golden/flux/pipeline.safetensors")
local TOL = 1e-3
local T5 = "tests/golden/t5/bare.safetensors"

local files = {}
local function save(name, t, meta)
  if not files[name] then
    files[name] = T.tmp(name .. ".safetensors")
    kiln.save_safetensors(files[name], t, meta)
  end
  return files[name]
end
local function dit_file(variant)
  local w, meta = T.from_recipe("../flux/pipeline_dit")
  if variant == "schnell" then
    for k in pairs(w) do if k:match("^guidance_in%.") then w[k] = nil end end
  end
  return save("flux-pipe-" .. variant, w, meta)
end
local function ae_file() return save("flux-pipe-ae", (T.from_recipe("../flux/ae"))) end
local function clip_file()
  local w = T.from_recipe("sd1")
  local t = {}
  for k, v in pairs(w) do
    local n = k:match("^cond_stage_model%.transformer%.(.*)$")
    if n then t[n] = v end
  end
  return save("flux-pipe-clip", t, { ["kiln.heads.clip"] = "2" })
end
local function load(variant)
  return kiln.load_checkpoint(dit_file(variant), { vae = ae_file(), clip = clip_file(), t5 = T5 })
end

local function rel(a, b)
  eq(H.shape_of(a), H.shape_of(b), "shape")
  local d = (a:to("cpu"):to("f32") - b):abs():max()
  return d / b:abs():max()
end

if kiln.set_quiet then kiln.set_quiet(true) end
local report = {}

test("kiln.flow: BFL's get_schedule, shifted and not", function()
  local s = flow.get_schedule(4, 4096, { shift = true })
  eq(#s, 5)
  eq(s[1], 1); eq(s[5], 0)
  -- mu at 4096 tokens is max_shift 1.15: t = 0.5 -> e^1.15 / (e^1.15 + 1)
  truthy(math.abs(s[3] - math.exp(1.15) / (math.exp(1.15) + 1)) < 1e-6, tostring(s[3]))
  local u = flow.get_schedule(4, 4096, { shift = false })
  eq(u[2], 0.75); eq(u[4], 0.25)
  truthy(math.abs(flow.mu(256) - 0.5) < 1e-12 and math.abs(flow.mu(4096) - 1.15) < 1e-12, "mu's end points")
  local ms = flow.model_sampling({ mu = flow.mu(1024) })
  local a, b = ms.schedule(8), flow.get_schedule(8, 1024)
  for i = 1, 9 do eq(a[i], b[i]) end
  eq(ms.timestep(0.25), 0.25)
end)

for _, case in ipairs({
  { "schnell", { prompt = "", seed = 7, width = 32, height = 32 } },
  { "dev", { prompt = "", seed = 8, width = 48, height = 32, steps = 4 } },
}) do
  test("Flux [" .. case[1] .. "] txt2img matches BFL's sampling loop and autoencoder", function()
    local ck <close> = load(case[1])
    eq(ck.variant, case[1])
    local img, lat = pipeline.txt2img(ck, case[2])
    local rl = rel(lat, GOLD[case[1] .. "_latent"])
    local ri = rel(img, GOLD[case[1] .. "_image"])
    truthy(rl <= TOL, "latent: " .. rl)
    truthy(ri <= TOL, "picture: " .. ri)
    report[#report + 1] = ("%s: latent %.2e, picture %.2e"):format(case[1], rl, ri)
    img:free(); lat:free()
  end)
end

test("Flux: odd sizes, [dev]-only options on [schnell], SD options are refused by name", function()
  local ck <close> = load("schnell")
  local err = raises(function() return pipeline.txt2img(ck, { width = 40, height = 32 }) end)
  truthy(err:find("2x2", 1, true) and err:find("16", 1, true), err)
  err = raises(function() return pipeline.txt2img(ck, { width = 32, height = 32, guidance = 3.5 }) end)
  truthy(err:find("[dev]", 1, true) and err:find("schnell", 1, true), err)
  err = raises(function() return pipeline.txt2img(ck, { width = 32, height = 32, sampler = "euler_ancestral" }) end)
  truthy(err:find("euler_ancestral", 1, true), err)
  err = raises(function() return pipeline.txt2img(ck, { width = 32, height = 32, t5_length = 0 }) end)
  truthy(err:find("t5_length", 1, true), err)
  -- Flux's options on an SD checkpoint
  local sd <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  err = raises(function() return pipeline.txt2img(sd, { width = 32, height = 32, guidance = 3.5 }) end)
  truthy(err:find("guidance", 1, true) and err:find("SD 1", 1, true), err)
  -- a diffusion-model file alone: the missing encoder names the file to pass
  local alone <close> = kiln.load_checkpoint(dit_file("schnell"), { vae = ae_file() })
  err = raises(function() return pipeline.txt2img(alone, { width = 32, height = 32 }) end)
  truthy(err:find("t5", 1, true), err)
end)

test("Flux img2img and true CFG run (denoise < 1 from the encoded picture; a negative pass)", function()
  local ck <close> = load("dev")
  local img = pipeline.img2img(ck, GOLD.dev_image, { prompt = "", seed = 3, steps = 4, denoise = 0.5 })
  eq(H.shape_of(img), "1,3,32,48")
  local d = (img - GOLD.dev_image):abs():max()
  truthy(d > 0, "img2img changes the picture: " .. d)
  img:free()
  local a = pipeline.txt2img(ck, { prompt = "", seed = 8, width = 48, height = 32, steps = 4, cfg = 2,
    negative = "" })
  -- the same prompt as negative: u + (c - u) * cfg = c
  local r = rel(a, GOLD.dev_image)
  truthy(r <= TOL, "cfg with the same negative prompt: " .. r)
  a:free()
end)

test("Flux inpaint (noise mask) and hires fix run", function()
  local ck <close> = load("schnell")
  local mask = kiln.zeros({ 1, 1, 32, 32 })
  local half = mask:narrow(4, 17, 16)
  half:fill(1)
  half:free()
  local img = pipeline.inpaint(ck, GOLD.schnell_image, mask, { prompt = "", seed = 5 })
  eq(H.shape_of(img), "1,3,32,32")
  -- outside the mask (and its feather) the picture comes back as it went in
  local keep = img:narrow(4, 1, 8):contiguous()
  local want = GOLD.schnell_image:narrow(4, 1, 8):contiguous()
  eq((keep - want):abs():max(), 0)
  local d = (img - GOLD.schnell_image):abs():max()
  truthy(d > 0, "the masked half is repainted")
  img:free(); keep:free(); want:free(); mask:free()
  local big = pipeline.hires_fix(ck, { prompt = "", seed = 7, width = 32, height = 32, scale = 2, hires_steps = 2 })
  eq(H.shape_of(big), "1,3,64,64")
  big:free()
end)

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

test("Flux txt2img in mode low on sim: inside a budget under the weights, encoders unloaded", function()
  if not has_sim then H.skip("no sim device") end
  local ck <close> = load("schnell")
  local weights = 0
  kiln.memory_mode("high")
  for _, p in ipairs({ ck.dit, ck.vae, ck.clip, ck.t5 }) do
    p:load("sim")
    weights = weights + p:bytes("sim")
    p:unload()
  end
  kiln.memory_mode("low")
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
  local base = kiln.mem.stats("sim").allocated
  local budget = base + math.floor(weights * 0.8)
  kiln.mem.set_budget("sim", budget)
  kiln.mem.reset_peak("sim")
  local seen = {}
  local ok, img = pcall(pipeline.txt2img, ck, { prompt = "", seed = 7, width = 32, height = 32, device = "sim",
    callback = function()
      seen.t5, seen.clip = ck.t5:bytes("sim"), ck.clip:bytes("sim")
    end })
  local peak = kiln.mem.stats("sim").peak
  kiln.mem.set_budget("sim", 8 * 1024 * MiB)
  kiln.memory_mode("normal")
  truthy(ok, tostring(img))
  eq(seen.t5, 0, "T5 unloaded while sampling")
  eq(seen.clip, 0, "CLIP unloaded while sampling")
  local r = rel(img, GOLD.schnell_image)
  truthy(r <= TOL, "low mode: " .. r)
  truthy(peak - base <= budget - base, ("peak %d inside the budget %d"):format(peak - base, budget - base))
  report[#report + 1] = ("low mode on sim: weights %.2f MiB, budget %.2f MiB, peak %.2f MiB"):format(weights / MiB,
    (budget - base) / MiB, (peak - base) / MiB)
  img:free()
end)

for _, l in ipairs(report) do print("  " .. l) end
H.done()
