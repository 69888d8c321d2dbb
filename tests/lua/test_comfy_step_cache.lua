-- The step cache nodes (kiln.comfy.step_cache) on the demo model: KilnStepCache and
-- Comfy-WaveSpeed's ApplyFBCacheOnModel give kiln.pipeline.txt2img's picture with the
-- same opts.cache; a zero threshold leaves the model as it was (WaveSpeed's rule);
-- inputs kiln cannot honour (a partial range, TeaCache's Flux types on a UNet) are
-- refused by node and name.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local lfs = require "lfs"
local pipeline = require "kiln.pipeline"
local comfy = require "kiln.comfy"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local T = require "tiny_sd"
if kiln.set_quiet then kiln.set_quiet(true) end
local DEMO = H.demo_model("comfy step cache nodes")
local ROOT = T.TMP .. "/cc"
local MODELS, OUT = ROOT .. "/models", ROOT .. "/out"
for _, d in ipairs({ "/cc", "/cc/models", "/cc/out", "/cc/models/checkpoints" }) do lfs.mkdir(T.TMP .. d) end
do
  local dst = MODELS .. "/checkpoints/demo.safetensors"
  local abs = DEMO:sub(1, 1) == "/" and DEMO or (lfs.currentdir() .. "/" .. DEMO)
  assert(lfs.link(abs, dst, true))
  T.tmp(dst:sub(#T.TMP + 2))
end

local made = {}
local function run(g)
  local files = comfy.run(g, { models = MODELS, output = OUT, quiet = true })
  for _, f in ipairs(files) do made[#made + 1] = f end
  return files
end

local demo <close> = kiln.load_checkpoint(DEMO)
local W64 = 8 * 64 // math.tointeger(demo.vae.factor)
local function graph(cache_node, prefix)
  local g = {
    ["4"] = { class_type = "CheckpointLoaderSimple", inputs = { ckpt_name = "demo.safetensors" } },
    ["5"] = { class_type = "EmptyLatentImage", inputs = { width = W64, height = W64, batch_size = 1 } },
    ["6"] = { class_type = "CLIPTextEncode", inputs = { text = "a red circle", clip = { "4", 1 } } },
    ["7"] = { class_type = "CLIPTextEncode", inputs = { text = "", clip = { "4", 1 } } },
    ["3"] = { class_type = "KSampler", inputs = { seed = 5, steps = 10, cfg = 3, sampler_name = "euler",
      scheduler = "normal", denoise = 1, model = { cache_node and "10" or "4", 0 }, positive = { "6", 0 },
      negative = { "7", 0 }, latent_image = { "5", 0 } } },
    ["8"] = { class_type = "VAEDecode", inputs = { samples = { "3", 0 }, vae = { "4", 2 } } },
    ["9"] = { class_type = "SaveImage", inputs = { filename_prefix = prefix, images = { "8", 0 } } },
  }
  if cache_node then
    cache_node.inputs.model = { "4", 0 }
    g["10"] = cache_node
  end
  return g
end

local function as_png(img)
  local p = T.tmp("ref" .. #made .. ".png")
  kiln.save_png(img:clamp(0, 1), p)
  return kiln.load_png(p)
end
local function picture(opts)
  local o = { prompt = "a red circle", negative = "", seed = 5, steps = 10, cfg = 3, sampler = "euler",
    scheduler = "normal", width = 64, height = 64, weighting = "comfy" }
  for k, v in pairs(opts or {}) do o[k] = v end
  local img, lat, info = pipeline.txt2img(demo, o)
  lat:free()
  return as_png(img), info
end
local function maxdiff(file, want)
  local got <close> = kiln.load_png(file)
  return (got - want):abs():max()
end

test("KilnStepCache (each mode) and ApplyFBCacheOnModel give the pipeline's cached picture", function()
  local plain = picture()
  for i, c in ipairs({
    { { class_type = "KilnStepCache", inputs = { mode = "fbcache", threshold = 0.2, interval = 3, branch = 0, max_hits = -1 } },
      { mode = "fbcache", threshold = 0.2 } },
    { { class_type = "KilnStepCache", inputs = { mode = "teacache", threshold = 1, interval = 3, branch = 0, max_hits = 2 } },
      { mode = "teacache", threshold = 1, max_hits = 2 } },
    { { class_type = "KilnStepCache", inputs = { mode = "deepcache", threshold = 0, interval = 2, branch = 1, max_hits = -1 } },
      { mode = "deepcache", interval = 2, branch = 1 } },
    { { class_type = "ApplyFBCacheOnModel", inputs = { object_to_patch = "diffusion_model", residual_diff_threshold = 0.2,
      start = 0, ["end"] = 1, max_consecutive_cache_hits = 1 } }, { mode = "fbcache", threshold = 0.2, max_hits = 1 } },
  }) do
    local files = run(graph(c[1], "sc" .. i))
    local want, info = picture({ cache = c[2] })
    truthy(info.evals < info.calls, c[1].class_type .. " " .. tostring(c[2].mode) .. ": some steps reused")
    eq(maxdiff(files[1], want), 0, c[1].class_type .. " " .. c[2].mode)
    truthy(maxdiff(files[1], plain) > 0, "not the uncached picture")
    want:free()
  end
  plain:free()
end)

test("ApplyFBCacheOnModel with threshold 0 is the model as it was; bad inputs are refused by name", function()
  local plain = picture()
  local files = run(graph({ class_type = "ApplyFBCacheOnModel", inputs = { object_to_patch = "diffusion_model",
    residual_diff_threshold = 0, start = 0, ["end"] = 1, max_consecutive_cache_hits = -1 } }, "off"))
  eq(maxdiff(files[1], plain), 0)
  plain:free()
  local err = raises(function()
    run(graph({ class_type = "ApplyFBCacheOnModel", inputs = { object_to_patch = "diffusion_model",
      residual_diff_threshold = 0.1, start = 0.2, ["end"] = 1, max_consecutive_cache_hits = -1 } }, "x"))
  end)
  truthy(err:find("whole schedule", 1, true), err)
  err = raises(function()
    run(graph({ class_type = "TeaCache", inputs = { model_type = "flux", rel_l1_thresh = 0.4, start_percent = 0,
      end_percent = 1, cache_device = "cpu" } }, "x"))
  end)
  truthy(err:find("UNet", 1, true) and err:find("TeaCache", 1, true), err)
  err = raises(function()
    run(graph({ class_type = "KilnStepCache", inputs = { mode = "slowcache", threshold = 0, interval = 3, branch = 0,
      max_hits = -1 } }, "x"))
  end)
  truthy(err:find("mode", 1, true), err)
end)

for _, f in ipairs(made) do os.remove(f) end
T.cleanup({ "/cc/models/checkpoints", "/cc/models", "/cc/out", "/cc" })
H.done()
