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

test("Kontext on sim: the dry run counts the reference tokens (>= the measured peak, <= x1.03); so does --mode auto",
  function()
  local ck <close> = load()
  local ref = kiln.rand({ 1, 3, 64, 96 }, { seed = 3 })
  local MiB = 1024 * 1024
  local function opts(refs)
    return { prompt = "a", seed = 9, width = 32, height = 32, steps = 2, t5_length = 16, reference = refs,
      reference_scale = false, device = "sim" }
  end
  -- a real run's peak in each pipeline stage, as the dry run reports its own
  local function measure(o)
    local span, peaks = kiln.trace.span, {}
    kiln.trace.span = function(name, f, ...)
      kiln.mem.reset_peak("sim")
      return (function(...)
        peaks[name] = kiln.mem.stats("sim").peak
        kiln.mem.reset_peak("sim")
        return ...
      end)(span(name, f, ...))
    end
    local ok, err = pcall(function() pipeline.txt2img(ck, o):free() end)
    kiln.trace.span = span
    if not ok then error(err, 0) end
    local all = 0
    for _, p in pairs(peaks) do all = math.max(all, p) end
    return all, peaks
  end
  local prev = kiln.memory_mode()
  local sample = {}
  for _, mode in ipairs({ "low", "normal" }) do
    kiln.memory_mode(mode)
    for _, refs in ipairs({ false, { ref }, { ref, ref } }) do
      local o = opts(refs or nil)
      local r = kiln.dry_run(function() pipeline.txt2img(ck, o):free() end, { device = "sim", mode = mode })
      local predicted = {}
      for _, st in ipairs(r.stages) do predicted[st.name] = st.peak end
      collectgarbage(); collectgarbage()
      kiln.mem.empty_cache("sim")
      -- a miss, as the dry run predicts (it counts the entry the miss keeps)
      ck.t5:clear_cache()
      local measured, stages = measure(o)
      ck.t5:clear_cache()
      local n = refs and #refs or 0
      local what = ("%s, %d references"):format(mode, n)
      -- never under; the sampling stage (where the reference tokens are) within 3 %
      truthy(r.peak >= measured, ("%s: predicted %d, measured %d"):format(what, r.peak, measured))
      truthy(predicted.sample >= stages.sample and predicted.sample <= 1.03 * stages.sample,
        ("%s, sampling: predicted %d, measured %d"):format(what, predicted.sample, stages.sample))
      if n > 0 then
        truthy(r.peak <= 1.03 * measured, ("%s: predicted %d, measured %d"):format(what, r.peak, measured))
      end
      sample[mode .. n] = stages.sample
      report[#report + 1] = ("mode %s, %d references: dry run %.3f MiB (sampling %.3f), measured %.3f (%.3f)"):format(
        mode, n, r.peak / MiB, predicted.sample / MiB, measured / MiB, stages.sample / MiB)
    end
    -- the test can fail: the reference tokens raise the sampling stage's peak
    truthy(sample[mode .. 2] > sample[mode .. 1] and sample[mode .. 1] > sample[mode .. 0],
      mode .. ": references raise the sampling peak")
  end
  kiln.memory_mode(prev)
  -- the planner: the transformer's work grows with the reference tokens, the VAE's takes the encode
  local planner = require "kiln.planner"
  kiln.mem.set_budget("sim", 64 * MiB)
  local plain = planner.choose(ck, opts(nil))
  local with = planner.choose(ck, opts({ ref, ref }))
  kiln.mem.set_budget("sim", 0)
  truthy(plain.work.dit and with.work.dit > plain.work.dit,
    ("transformer work %s -> %s"):format(tostring(plain.work.dit), tostring(with.work.dit)))
  truthy(with.work.vae > plain.work.vae, "VAE work with the references' encode")
  report[#report + 1] = ("planner: transformer work %.3f -> %.3f MiB with two references"):format(plain.work.dit / MiB,
    with.work.dit / MiB)
  -- a whole run under --mode auto plans and runs
  kiln.mem.set_budget("sim", 16 * MiB)
  local o = opts({ ref })
  o.mode = "auto"
  pipeline.txt2img(ck, o):free()
  kiln.mem.set_budget("sim", 0)
  kiln.memory_mode(prev)
  ref:free()
end)

-- A whole ComfyUI checkpoint of the tiny Kontext parts, as the examples load it (--model).
local function all_in_one()
  if files.aio then return files.aio end
  local t = {}
  local w, meta = T.from_recipe("../flux/pipeline_dit")
  for k, v in pairs(w) do t["model.diffusion_model." .. k] = v end
  for k, v in pairs((T.from_recipe("../flux/ae"))) do t["vae." .. k] = v end
  for k, v in pairs(T.from_recipe("sd1")) do
    local c = k:match("^cond_stage_model%.transformer%.(.*)$")
    if c then t["text_encoders.clip_l.transformer." .. c] = v end
  end
  local t5 = kiln.load_safetensors(T5)
  for k, v in pairs(t5) do t["text_encoders.t5xxl.transformer." .. k] = v end
  meta = meta or {}
  meta["kiln.heads.clip"] = "2"
  return save("kontext-aio", t, meta)
end

test("examples/txt2img.lua --reference (repeatable) runs Kontext as the pipeline; bad references are usage errors",
  function()
  local exe = arg and arg[-1]
  if not exe then H.skip("no kiln program in arg[-1]") end
  local model = all_in_one()
  local a, b = T.tmp("ref-a.png"), T.tmp("ref-b.png")
  local ra, rb = kiln.rand({ 1, 3, 24, 40 }, { seed = 4 }), kiln.rand({ 1, 3, 40, 24 }, { seed = 5 })
  kiln.save_png(ra, a); kiln.save_png(rb, b)
  ra:free(); rb:free()
  local out, log = T.tmp("kontext-cli.png"), T.tmp("kontext-cli.log")
  local base = ("'%s' examples/txt2img.lua --model '%s' --steps 2 --seed 3 --width 32 --height 32 --prompt 'a' " ..
    "--quiet"):format(exe, model)
  local function run(args)
    local _, _, code = os.execute(("%s %s >'%s' 2>&1"):format(base, args, log))
    local f = assert(io.open(log))
    local text = f:read("a")
    f:close()
    return code, text
  end
  local code, text = run(("--reference '%s' --reference '%s' --out '%s'"):format(a, b, out))
  eq(code, 0, text)
  -- the same run through the pipeline, the references read back from their PNGs
  local ck <close> = kiln.load_checkpoint(model)
  local la, lb = kiln.load_png(a), kiln.load_png(b)
  -- (sampler and scheduler unset: the examples leave them to the model, as the pipeline does)
  local want = pipeline.txt2img(ck, { prompt = "a", seed = 3, steps = 2, width = 32, height = 32, reference = { la, lb } })
  local plain = pipeline.txt2img(ck, { prompt = "a", seed = 3, steps = 2, width = 32, height = 32 })
  local got = kiln.load_png(out)
  local d = (got:narrow(2, 1, 3) - want):abs():max()
  truthy(d <= 1 / 255 + 1e-6, "the CLI's picture against the pipeline's: " .. d)
  truthy((want - plain):abs():max() > 2 / 255, "the references change the picture (the test can fail)")
  report[#report + 1] = ("CLI --reference x2 against the pipeline: %.2e"):format(d)
  for _, x in ipairs({ la, lb, want, plain, got }) do x:free() end
  -- usage errors: one line, status 2
  code, text = run("--reference no-such.png")
  eq(code, 2, text)
  truthy(text:find("kiln: --reference no-such.png: no such file", 1, true), text)
  code, text = run(("--reference '%s'"):format(log))
  eq(code, 2, text)
  truthy(text:find("--reference " .. log .. ": not a PNG image", 1, true), text)
  local sd = ("'%s' examples/txt2img.lua --model '%s' --steps 1 --quiet --reference '%s' --out '%s' >'%s' 2>&1"):format(
    exe, T.ckpt_file("sd1"), a, out, log)
  local _, _, c2 = os.execute(sd)
  local f = assert(io.open(log))
  text = f:read("a")
  f:close()
  eq(c2, 2, text)
  truthy(text:find("kiln: --reference: reference pictures are for Flux Kontext checkpoints, and this one is SD 1",
    1, true), text)
end)

for _, l in ipairs(report) do print("  " .. l) end
H.done()
