-- tests/bench/bench_step_cache.lua - step caching (kiln.step_cache, opts.cache): on the
-- bundled demo model, a 20-step euler txt2img uncached and under each policy at three
-- settings: full network evaluations, time, and the PSNR of the cached picture against
-- the uncached one; on the SD 1.5-shaped random checkpoint (tests/bench/random_weights.lua
-- over $KILN_SHARED/sd-keys/sd15.txt, as bench_sd.lua makes it), a 20-step euler txt2img
-- with CFG uncached and at each policy's default: evaluations and time.
--
--   build/kiln tests/bench/bench_step_cache.lua [--size 256] [--only demo,sd15] [--weights PATH]
--       [--threads N] [--steps 20] [--modes fbcache,teacache,deepcache] [--no-reference]
--
-- --size: the SD 1.5 picture's side in pixels (512 is the model's; 256 runs 4x faster
-- and the decisions follow the same trajectory shape). --modes: the SD 1.5 policies run
-- (at their defaults); --no-reference: no uncached SD 1.5 run (evaluation counts only:
-- an uncached run makes one full evaluation per step). Run it under the bench lock
-- (flock /tmp/kiln-bench.lock) and, for the SD 1.5 part, the big-memory lock.
local kiln = require "kiln"
local util = require "kiln.util"
local step_cache = require "kiln.step_cache"

local opts = util.parse_args(arg or {}, { size = 256, only = "demo,sd15", weights = "", threads = 0, steps = 20,
  modes = "fbcache,teacache,deepcache", no_reference = false })
if opts.threads > 0 then kiln.set_threads(opts.threads) end
local only = {}
for w in opts.only:gmatch("[^,]+") do only[w] = true end
local SHARED = os.getenv("KILN_SHARED") or "../shared"
local fmt = string.format
kiln.set_quiet(true)
local function say(...) print(fmt(...)); io.stdout:flush() end

local function psnr(a, b)
  local d = a - b
  local mse = (d * d):mean()
  d:free()
  return mse == 0 and math.huge or 10 * math.log(1 / mse, 10)
end

local function run(ckpt, base, cache)
  local o = {}
  for k, v in pairs(base) do o[k] = v end
  o.cache = cache
  collectgarbage()
  local t0 = kiln.time()
  local img, lat, info = kiln.pipeline.txt2img(ckpt, o)
  local dt = kiln.time() - t0
  lat:free()
  return img, info, dt
end

local function label(c)
  if not c then return "uncached" end
  local s = step_cache.spec(c, "unet")
  if s.mode == "deepcache" then return fmt("deepcache interval %d branch %d", s.interval, s.branch) end
  return fmt("%s threshold %g", s.mode, s.threshold)
end

local function table_for(name, ckpt, base, caches, no_ref)
  say("## %s: %d-step %s, cfg %s, %dx%d", name, base.steps, base.sampler, tostring(base.cfg or kiln.pipeline.default_cfg(ckpt)),
    base.width, base.height)
  say("| cache | full evaluations / calls | fewer | time (s) | speed-up | PSNR vs uncached (dB) |")
  say("|---|---|---|---|---|---|")
  -- a short untimed run first: the first run also maps the weights and warms the caches
  local warm = {}
  for k, v in pairs(base) do warm[k] = v end
  warm.steps = 2
  local w = run(ckpt, warm, nil)
  w:free()
  local ref, info0, t0
  if no_ref then
    info0 = { evals = base.steps }
  else
    ref, info0, t0 = run(ckpt, base, nil)
    say("| uncached | %d / %d | 1.00x | %.2f | 1.00x | - |", info0.evals, info0.calls, t0)
  end
  for _, c in ipairs(caches) do
    local img, info, dt = run(ckpt, base, c)
    say("| %s | %d / %d | %.2fx | %.2f | %s | %s |", label(c), info.evals, info.calls, info0.evals / info.evals,
      dt, ref and fmt("%.2fx", t0 / dt) or "-", ref and fmt("%.1f", psnr(img, ref)) or "-")
    img:free()
  end
  if ref then ref:free() end
end

say("# step cache bench (%s, %d threads)", kiln.version, kiln.threads and kiln.threads() or 0)

if only.demo then
  local ckpt <close> = kiln.load_checkpoint("examples/models/kiln-shapes.safetensors")
  table_for("demo model", ckpt, { prompt = "a red circle", steps = opts.steps, seed = 1, sampler = "euler", width = 64,
    height = 64 }, {
    { mode = "fbcache", threshold = 0.06 }, { mode = "fbcache" }, { mode = "fbcache", threshold = 0.25 },
    { mode = "teacache", threshold = 0.4 }, { mode = "teacache" }, { mode = "teacache", threshold = 1.2 },
    { mode = "deepcache", interval = 2 }, { mode = "deepcache" }, { mode = "deepcache", interval = 5 },
  })
end

if only.sd15 then
  local rw = dofile("tests/bench/random_weights.lua")
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/steps"
  os.execute("mkdir -p '" .. dir .. "'")
  local path = opts.weights ~= "" and opts.weights or (dir .. "/sd15-random-f16.safetensors")
  rw.ensure(path, SHARED .. "/sd-keys/sd15.txt", { mark = "sd15-random-f16-v1", seed = 1000,
    keep = function(name)
      return name:match("^model%.diffusion_model%.") or name:match("^first_stage_model%.")
          or name:match("^cond_stage_model%.")
    end })
  local ckpt <close> = kiln.load_checkpoint(path)
  table_for("SD 1.5-shaped random checkpoint", ckpt, { prompt = "a photo of a cat", steps = opts.steps, seed = 1,
    sampler = "euler", cfg = 7, width = opts.size, height = opts.size },
    (function()
      local l = {}
      for m in opts.modes:gmatch("[^,]+") do l[#l + 1] = { mode = m } end
      return l
    end)(), opts.no_reference)
end
