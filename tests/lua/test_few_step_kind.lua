-- tests/lua/test_few_step_kind.lua - kiln.few_step_kind: which few-step model a file says
-- it is (kiln.few_step, modelspec.architecture / title, kohya's ss_output_name, the
-- published file names) and the pipelines taking that kind's sampling as their defaults
-- under the caller's options: a checkpoint that says Turbo, an LCM-LoRA applied with
-- ckpt:add_lora or for one run (opts.lora), the PNG parameters recording what ran, and
-- the command line leaving steps / sampler / scheduler to the model.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local fsk = require "kiln.few_step_kind"
local T = require "tiny_sd"
local test = H.test

local DEMO = "examples/models/kiln-shapes.safetensors"

-- ---------------------------------------------------------------- what files say

test("the published files' names tell their kind (and the step count written beside it)", function()
  local cases = {
    { "models/loras/lcm-lora-sdv1-5.safetensors", "lcm", 4, "lcm", 1 },
    { "lcm_lora_sdxl.safetensors", "lcm", 4, "lcm", 1 },
    { "sd_xl_turbo_1.0_fp16.safetensors", "turbo", 1, "euler_ancestral", 1 },
    { "sd_turbo.safetensors", "turbo", 1, "euler_ancestral", 1 },
    { "sdxl_lightning_8step_lora.safetensors", "lightning", 8, "euler", 1 },
    { "sdxl_lightning_2step_unet.safetensors", "lightning", 2, "euler", 1 },
    { "Hyper-SD15-4steps-lora.safetensors", "hyper", 4, "euler", 1 },
    { "Hyper-SDXL-1step-lora.safetensors", "hyper", 1, "euler", 1 },
    { "TCD-SD15-LoRA.safetensors", "tcd", 4, "tcd", 1 },
  }
  for _, c in ipairs(cases) do
    local p = fsk.of_file({}, c[1])
    H.truthy(p, c[1])
    H.eq(p.name, c[2], c[1]); H.eq(p.defaults.steps, c[3], c[1] .. " steps")
    H.eq(p.defaults.sampler, c[4], c[1] .. " sampler"); H.eq(p.defaults.cfg, c[5], c[1] .. " cfg")
    H.truthy(p.evidence:find("file name", 1, true), p.evidence)
  end
  -- Hyper-SD's CFG-preserving LoRAs keep the caller's guidance
  local p = fsk.of_file({}, "Hyper-SDXL-8steps-CFG-lora.safetensors")
  H.eq(p.name, "hyper"); H.eq(p.defaults.steps, 8); H.eq(p.defaults.cfg, nil)
  -- ordinary files, and the words inside other words
  for _, name in ipairs({ "v1-5-pruned-emaonly.safetensors", "detail-tweaker.safetensors", "blcmx.safetensors",
    "turbofan.safetensors", "sd_xl_base_1.0.safetensors" }) do
    H.eq(fsk.of_file({}, name), nil, name)
  end
end)

test("metadata: kiln.few_step, then modelspec.architecture, modelspec.title, ss_output_name, then the name", function()
  local p = fsk.of_file({ ["modelspec.title"] = "SDXL Turbo" }, "model.safetensors")
  H.eq(p.name, "turbo"); H.truthy(p.evidence:find("modelspec.title", 1, true))
  p = fsk.of_file({ ["modelspec.architecture"] = "stable-diffusion-xl-v1-base/lora",
    ["modelspec.title"] = "Hyper-SD 8-steps" }, "x.safetensors")
  H.eq(p.name, "hyper"); H.eq(p.defaults.steps, 8)
  p = fsk.of_file({ ["modelspec.architecture"] = "stable-diffusion-xl-v1-base/lora", ["ss_network_module"] = "networks.lora",
    ["ss_output_name"] = "my_lightning_4step" }, "x.safetensors")
  H.eq(p.name, "lightning"); H.truthy(p.evidence:find("ss_output_name", 1, true))
  -- an architecture that says nothing few-step leaves the kind to the title
  H.eq(fsk.of_file({ ["modelspec.architecture"] = "stable-diffusion-xl-v1-base/lora" }, "style.safetensors"), nil)
  -- the title outranks the file name, kiln.few_step outranks everything
  H.eq(fsk.of_file({ ["modelspec.title"] = "LCM LoRA" }, "turbo.safetensors").name, "lcm")
  H.eq(fsk.of_file({ ["kiln.few_step"] = "tcd", ["modelspec.title"] = "LCM" }, "turbo.safetensors").name, "tcd")
  H.eq(fsk.of_file({ ["kiln.few_step"] = "none" }, "lcm-lora-sdv1-5.safetensors"), nil)
  local bad, msg = fsk.of_file({ ["kiln.few_step"] = "fast" }, "x.safetensors")
  H.eq(bad, false)
  H.truthy(msg:find('"fast"', 1, true) and msg:find("lcm, tcd", 1, true), msg)
end)

-- ---------------------------------------------------------------- files for the pipelines

-- The demo model again with `meta` added to its metadata.
local function demo_with(name, meta)
  local t, m = kiln.load_safetensors(DEMO)
  for k, v in pairs(meta) do m[k] = v end
  local path = T.tmp(name)
  kiln.save_safetensors(path, t, m)
  return path
end

-- A kohya LoRA over one of the demo UNet's projections (zero up factor: the weights do
-- not change, only what the file says matters here).
local function tiny_lora(name, meta)
  local path = T.tmp(name)
  local ckpt <close> = kiln.load_checkpoint(DEMO)
  local cfg = rawget(ckpt.unet, "config")
  local key, w
  for _, e in ipairs(require("kiln.unet").expected(cfg)) do
    if not key and e[1]:match("proj_in%.weight$") then
      key = "lora_unet_" .. require("kiln.lora").mapping.unet_to_diffusers(e[1], cfg.num_res_blocks)
          :gsub("%.weight$", ""):gsub("%.", "_")
      w = { shape = e[2] }
    end
  end
  local cout, cin = w.shape[1], w.shape[2]
  kiln.save_safetensors(path, {
    [key .. ".lora_down.weight"] = kiln.randn({ 2, cin, 1, 1 }, { seed = 1 }):reshape(#w.shape == 4 and { 2, cin, 1, 1 }
      or { 2, cin }),
    [key .. ".lora_up.weight"] = kiln.zeros(#w.shape == 4 and { cout, 2, 1, 1 } or { cout, 2 }),
    [key .. ".alpha"] = kiln.tensor(2.0),
  }, meta)
  return path
end

local function params(opts, ckpt)
  return kiln.pipeline.parameters(opts, ckpt)
end

local function run(ckpt, opts)
  local o = { prompt = "a red circle", seed = 1, width = 64, height = 64 }
  for k, v in pairs(opts or {}) do o[k] = v end
  local img, lat, info = kiln.pipeline.txt2img(ckpt, o)
  img:free(); lat:free()
  return info
end

-- ---------------------------------------------------------------- the pipelines

test("a checkpoint whose title says Turbo samples 1 step of euler_ancestral, trailing, cfg 1 unless told", function()
  local path = demo_with("demo-turbo.safetensors", { ["modelspec.title"] = "kiln-shapes Turbo" })
  local ckpt <close> = kiln.load_checkpoint(path, { tokenizer = "examples/models" })
  H.eq(ckpt.few_step.name, "turbo")
  local info = run(ckpt)
  H.eq(info.steps, 1)
  H.truthy(info.few_step:find("Turbo", 1, true) and info.few_step:find("checkpoint", 1, true), info.few_step)
  local p = params({ prompt = "x" }, ckpt)
  H.truthy(p:find("Steps: 1,", 1, true) and p:find("Sampler: Euler a", 1, true) and p:find("CFG scale: 1,", 1, true), p)
  -- the caller's options win, each on its own
  info = run(ckpt, { steps = 2, cfg = 3 })
  H.eq(info.steps, 2)
  p = params({ prompt = "x", steps = 2, sampler = "euler" }, ckpt)
  H.truthy(p:find("Steps: 2,", 1, true) and p:find("Sampler: Euler,", 1, true) and p:find("Trailing", 1, true), p)
end)

test("an unknown kiln.few_step is an error naming the checkpoint", function()
  local path = demo_with("demo-bad.safetensors", { ["kiln.few_step"] = "warp" })
  local ok, err = pcall(kiln.load_checkpoint, path)
  H.eq(ok, false)
  H.truthy(tostring(err):find("demo-bad.safetensors", 1, true) and tostring(err):find('"warp"', 1, true), err)
end)

test("an LCM-LoRA applied: sampler lcm, 4 steps, cfg 1 by default; removed, the model's own again", function()
  local lp = tiny_lora("tiny-lcm.safetensors", { ["ss_output_name"] = "lcm-lora-kiln-shapes" })
  H.eq(kiln.lora.inspect(lp).few_step.name, "lcm")
  local ckpt <close> = kiln.load_checkpoint(DEMO)
  H.eq(ckpt.few_step, nil)
  H.truthy(params({ prompt = "x" }, ckpt):find("Steps: 20,", 1, true))
  local h = ckpt:add_lora(lp)
  H.eq(h.few_step.name, "lcm")
  local info = run(ckpt)
  H.eq(info.steps, 4)
  H.truthy(info.few_step:find("LoRA tiny-lcm", 1, true), info.few_step)
  local p = params({ prompt = "x" }, ckpt)
  H.truthy(p:find("Steps: 4,", 1, true) and p:find("Sampler: LCM", 1, true) and p:find("CFG scale: 1,", 1, true), p)
  H.eq(run(ckpt, { steps = 3 }).steps, 3)
  h:remove()
  info = run(ckpt, { steps = 2 })
  H.eq(info.few_step, nil)
  p = params({ prompt = "x" }, ckpt)
  H.truthy(p:find("Steps: 20,", 1, true) and p:find("CFG scale: 3,", 1, true), p) -- the demo's kiln.cfg
end)

test("an LCM-LoRA for one run (opts.lora) sets that run's defaults and the PNG's parameters", function()
  local lp = tiny_lora("tiny-lcm-run.safetensors", { ["modelspec.title"] = "LCM-LoRA" })
  local ckpt <close> = kiln.load_checkpoint(DEMO)
  local opts = { lora = { { name = "tiny-lcm-run", path = lp } } }
  local info = run(ckpt, opts)
  H.eq(info.steps, 4)
  H.eq(#(rawget(ckpt, "loras_applied") or {}), 0)
  local p = params({ prompt = "x", lora = opts.lora }, ckpt)
  H.truthy(p:find("Steps: 4,", 1, true) and p:find("Sampler: LCM", 1, true), p)
  -- strength 0 on the UNet: not an LCM run
  local zero = { lora = { { name = "tiny-lcm-run", path = lp, unet = 0, clip = 1 } }, steps = 1 }
  H.eq(run(ckpt, zero).few_step, nil)
end)

test("the command line leaves steps, sampler and scheduler to the model unless given", function()
  local cli = require "kiln.cli"
  local o = cli.parse({ "--quiet" })
  H.eq(o.steps, nil); H.eq(o.sampler, nil); H.eq(o.scheduler, nil)
  o = cli.parse({ "--quiet", "--steps", "3", "--sampler", "lcm", "--scheduler", "sgm_uniform" })
  H.eq(o.steps, 3); H.eq(o.sampler, "lcm"); H.eq(o.scheduler, "sgm_uniform")
end)

T.cleanup()
H.done()
