-- tests/lua/prediction.lua - the prediction table shared by tests/lua/test_prediction.lua
-- and tests/bench/prediction_table.lua: each pipeline of the test suite run on sim under
-- a budget and a memory mode, first as a dry run (kiln.dry_run modelling sim) and then
-- for real as a user runs it (the collector running, prefetches on the copy thread),
-- so that a prediction is checked against what a real run does, not a tamed one.
--   local P = require "prediction"
--   P.table({repeat =, budget =, only = {name = true}, progress = fn(row)}) -> rows
--     row = {name, mode, budget, predicted, measured (highest of the repeats), low
--            (lowest), ratio = predicted / measured, nodes = {...} (comfy graphs)}
--   P.format(rows) -> text;  P.cleanup()
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"
local T = require "tiny_sd"

local P = {}
local MiB = 1024 * 1024
P.MiB = MiB
P.MODEL = os.getenv("KILN_DEMO_MODEL") or "examples/models/kiln-shapes.safetensors"

local BASE = { prompt = "a red circle on a blue background", negative = "blur", steps = 2, seed = 1, width = 64,
  height = 64, device = "sim", cfg = 3 }
local function o(extra)
  local t = {}
  for k, v in pairs(BASE) do t[k] = v end
  for k, v in pairs(extra or {}) do t[k] = v end
  return t
end

-- inputs made once, on the CPU (the pipelines move them to their device)
local inputs
local function make_inputs()
  if inputs then return inputs end
  inputs = {}
  inputs.image = (kiln.randn({ 1, 3, 64, 64 }, { seed = 3 }) * 0.2 + 0.5):clamp(0, 1)
  local rows = {}
  for y = 1, 64 do
    local row = {}
    for x = 1, 64 do row[x] = (x > 16 and x <= 48 and y > 16 and y <= 48) and 1 or 0 end
    rows[y] = row
  end
  inputs.mask = kiln.tensor({ { rows } })
  inputs.hint = (kiln.randn({ 1, 3, 48, 48 }, { seed = 7 }) * 0.25 + 0.5):clamp(0, 1)
  inputs.upscaler = "tests/golden/upscale/compact_x2.safetensors"
  local cn = T.tmp("prediction_cn.safetensors")
  kiln.save_safetensors(cn, T.build_recipe("../controlnet/sd1"), { ["kiln.heads.unet"] = "2" })
  inputs.cn = cn
  inputs.tiny = T.ckpt_file("sd1")
  return inputs
end

-- The ComfyUI models folder: the demo checkpoint and the upscale model, linked.
local comfy_root
local function comfy_models()
  if comfy_root then return comfy_root end
  local lfs = require "lfs"
  comfy_root = T.TMP .. "/pred_comfy"
  for _, d in ipairs({ "", "/models", "/models/checkpoints", "/models/upscale_models", "/models/input", "/out" }) do
    lfs.mkdir(comfy_root .. d)
  end
  local function link(src, dst)
    local abs = src:sub(1, 1) == "/" and src or (lfs.currentdir() .. "/" .. src)
    if not lfs.symlinkattributes(dst, "mode") then assert(lfs.link(abs, dst, true)) end
  end
  link(P.MODEL, comfy_root .. "/models/checkpoints/demo.safetensors")
  link("tests/golden/upscale/compact_x2.safetensors", comfy_root .. "/models/upscale_models/x2.safetensors")
  return comfy_root
end

local function comfy_graph(hires)
  local ck = kiln.load_checkpoint(P.MODEL)
  local w = 8 * 64 // math.tointeger(ck.vae.factor)
  ck:close()
  local g = {
    ["4"] = { class_type = "CheckpointLoaderSimple", inputs = { ckpt_name = "demo.safetensors" } },
    ["5"] = { class_type = "EmptyLatentImage", inputs = { width = w, height = w, batch_size = 1 } },
    ["6"] = { class_type = "CLIPTextEncode", inputs = { text = BASE.prompt, clip = { "4", 1 } } },
    ["7"] = { class_type = "CLIPTextEncode", inputs = { text = "blur", clip = { "4", 1 } } },
    ["3"] = { class_type = "KSampler", inputs = { seed = 5, steps = 2, cfg = 3, sampler_name = "euler",
      scheduler = "normal", denoise = 1, model = { "4", 0 }, positive = { "6", 0 }, negative = { "7", 0 },
      latent_image = { "5", 0 } } },
    ["8"] = { class_type = "VAEDecode", inputs = { samples = { "3", 0 }, vae = { "4", 2 } } },
    ["9"] = { class_type = "SaveImage", inputs = { filename_prefix = "pred", images = { "8", 0 } } },
  }
  if hires then
    g["21"] = { class_type = "UpscaleModelLoader", inputs = { model_name = "x2.safetensors" } }
    g["22"] = { class_type = "ImageUpscaleWithModel", inputs = { upscale_model = { "21", 0 }, image = { "8", 0 } } }
    g["23"] = { class_type = "VAEEncode", inputs = { pixels = { "22", 0 }, vae = { "4", 2 } } }
    g["24"] = { class_type = "KSampler", inputs = { seed = 6, steps = 2, cfg = 3, sampler_name = "euler",
      scheduler = "normal", denoise = 0.5, model = { "4", 0 }, positive = { "6", 0 }, negative = { "7", 0 },
      latent_image = { "23", 0 } } }
    g["25"] = { class_type = "VAEDecode", inputs = { samples = { "24", 0 }, vae = { "4", 2 } } }
    g["9"].inputs.images = { "25", 0 }
  end
  return g
end

-- The cases: name -> fn(ck) for the pipelines (ck: a checkpoint loaded for the run), or
-- comfy = graph for a ComfyUI workflow (it loads its own models).
function P.cases()
  local I = make_inputs()
  return {
    { name = "txt2img", run = function(ck) pipeline.txt2img(ck, o()) end },
    { name = "txt2img 128 tiled", run = function(ck) pipeline.txt2img(ck, o({ width = 128, height = 128, tile = 8,
      overlap = 2 })) end },
    { name = "img2img", run = function(ck) pipeline.img2img(ck, I.image, o({ denoise = 0.6 })) end },
    { name = "inpaint", run = function(ck) pipeline.inpaint(ck, I.image, I.mask, o()) end },
    { name = "hires fix", run = function(ck) pipeline.hires_fix(ck, o({ hires_steps = 2, scale = 2 })) end },
    { name = "upscale model", run = function(ck)
      local up <close> = kiln.load_upscaler(I.upscaler)
      pipeline.hires_fix(ck, o({ hires_steps = 2, upscale = up, denoise = 0.5 }))
    end },
    { name = "controlnet", ckpt = I.tiny, run = function(ck)
      local cn <close> = kiln.load_controlnet(I.cn)
      pipeline.txt2img(ck, o({ prompt = "a photo of a cat", negative = "a cat", width = 32, height = 32, control = { { net = cn, image = I.hint } } }))
    end },
    { name = "comfy txt2img", comfy = comfy_graph(false) },
    { name = "comfy hires", comfy = comfy_graph(true) },
  }
end

local function settle()
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
end

-- fn under mode and budget on sim, from nothing resident; returns sim's peak (and
-- fn's result)
local function measured(case, mode, budget)
  local ck = not case.comfy and kiln.load_checkpoint(case.ckpt or P.MODEL) or nil
  if ck and case.ckpt and not case.own_tokenizer then ck.clip.tokenizer = T.word_tokenizer end
  settle()
  local old_budget, old_mode = kiln.mem.stats("sim").budget, kiln.memory_mode()
  kiln.memory_mode(mode)
  kiln.mem.set_budget("sim", budget)
  kiln.mem.reset_peak("sim")
  kiln.mem.reset_peak("cpu") -- the kernels' host scratch (workspace_peak) is reported on cpu
  local ok, err = pcall(function()
    if ck then return case.run(ck) end
    local root = comfy_models()
    return select(2, require("kiln.comfy").run(case.comfy, { models = root .. "/models", output = root .. "/out",
      device = "sim", quiet = true }))
  end)
  local st = kiln.mem.stats("sim")
  local scratch = kiln.mem.stats("cpu").workspace_peak
  kiln.mem.set_budget("sim", old_budget)
  kiln.memory_mode(old_mode)
  if ck then ck:close() end
  settle()
  if not ok then error(case.name .. " (" .. mode .. "): " .. tostring(err), 0) end
  return st.peak, err, scratch
end

local function predicted(case, mode, budget)
  if case.comfy then
    local root = comfy_models()
    local old_budget, old_mode = kiln.mem.stats("sim").budget, kiln.memory_mode()
    kiln.memory_mode(mode)
    kiln.mem.set_budget("sim", budget)
    local ok, _, r = pcall(require("kiln.comfy").run, case.comfy, { models = root .. "/models",
      output = root .. "/out", device = "sim", quiet = true, dry_run = true })
    kiln.mem.set_budget("sim", old_budget)
    kiln.memory_mode(old_mode)
    if not ok then error(_, 0) end
    if not r.plan.meta then error(case.name .. ": no dry run: " .. tostring(r.plan.meta_error), 0) end
    return r.plan.meta.peak, r.plan, r.plan.meta.scratch
  end
  local ck = kiln.load_checkpoint(case.ckpt or P.MODEL)
  if case.ckpt and not case.own_tokenizer then ck.clip.tokenizer = T.word_tokenizer end
  settle()
  local r = kiln.dry_run(function() case.run(ck) end, { device = "sim", budget = budget, mode = mode })
  ck:close()
  if not r.fits then error(case.name .. " (" .. mode .. "): the dry run does not fit: " .. tostring(r.oom), 0) end
  return r.peak, r, r.scratch
end

P.MODES = { "high", "normal", "low" }

-- The SD 1.5 piece on an SD 1.5-shaped checkpoint (tests/bench: random f16 weights,
-- real key list and CLIP tokenizer): two prompts encoded, one sampler step with CFG, a
-- tiled VAE decode, at size x size pixels; P.row(case, mode, budget, reps) runs it.
function P.sd15_case(path, size)
  return { name = ("SD 1.5 piece %d"):format(size), ckpt = path, own_tokenizer = true, run = function(ck)
    pipeline.txt2img(ck, { prompt = "a photograph of an astronaut riding a horse", negative = "blurry", steps = 1,
      seed = 1, width = size, height = size, device = "sim", cfg = 7.5, tile = math.min(size // 8, 32), overlap = 8 })
  end }
end

function P.row(case, mode, budget, reps)
  local pred, info, pred_scratch = predicted(case, mode, budget)
  local hi, lo, node_hi, scratch_hi = 0, math.huge, {}, 0
  for _ = 1, reps do
    local m, rep, sc = measured(case, mode, budget)
    hi, lo = math.max(hi, m), math.min(lo, m)
    scratch_hi = math.max(scratch_hi, sc or 0)
    if case.comfy then
      for _, n in ipairs(rep.nodes) do node_hi[n.id] = math.max(node_hi[n.id] or 0, n.peak) end
    end
  end
  -- the kernels' host scratch (outside sim's allocator): predicted bound, measured peak
  local row = { name = case.name, mode = mode, budget = budget, predicted = pred, measured = hi, low = lo,
    ratio = pred / hi, scratch_predicted = pred_scratch or 0, scratch_measured = scratch_hi }
  if case.comfy then
    row.nodes = {}
    for _, id in ipairs(info.order) do
      if node_hi[id] and node_hi[id] > 0 then
        local p = info.predicted[id] or 0
        row.nodes[#row.nodes + 1] = { id = id, class_type = info.graph[id].class_type, predicted = p,
          measured = node_hi[id], ratio = p / node_hi[id] }
      end
    end
  end
  return row
end

function P.table(opt)
  local rows = {}
  local cases = P.cases() -- its inputs on the CPU, sim left empty
  for _, case in ipairs(cases) do
    if not opt.only or opt.only[case.name] then
      for _, mode in ipairs(opt.modes or P.MODES) do
        local r = P.row(case, mode, opt.budget or 32 * MiB, opt["repeat"] or 1)
        rows[#rows + 1] = r
        if opt.progress then opt.progress(r) end
      end
    end
  end
  return rows
end

local function mib(b) return ("%.3f MiB"):format(b / MiB) end

function P.format_row(r)
  local s = ("%-18s %-6s %13s %13s %7.4f %13s %13s%s"):format(r.name, r.mode, mib(r.predicted), mib(r.measured), r.ratio,
    mib(r.scratch_predicted or 0), mib(r.scratch_measured or 0),
    r.low < r.measured and (" (measured from " .. mib(r.low) .. ")") or "")
  for _, n in ipairs(r.nodes or {}) do
    s = s .. ("\n  node %-3s %-22s %13s %13s %7.4f"):format(n.id, n.class_type, mib(n.predicted), mib(n.measured),
      n.ratio)
  end
  return s
end

function P.format(rows)
  local lines = { ("%-18s %-6s %13s %13s %7s %13s %13s"):format("pipeline", "mode", "predicted", "measured", "ratio",
    "scratch pred.", "scratch meas.") }
  for _, r in ipairs(rows) do lines[#lines + 1] = P.format_row(r) end
  return table.concat(lines, "\n")
end

function P.cleanup()
  inputs = nil
  collectgarbage()
  if comfy_root then
    os.execute("rm -rf '" .. comfy_root .. "'")
    comfy_root = nil
  end
  T.cleanup()
end

return P
