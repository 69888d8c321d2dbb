-- tests/bench/bench_sdxl.lua - SDXL inside a small card: the 1024x1024 pipeline piece
-- (both text encoders, one CFG UNet step at a 128x128 latent, tiled VAE decode) on the
-- sim device inside a 2 GiB budget, with SDXL-shaped random weights (names and shapes
-- of $KILN_SHARED/sd-keys/sdxl.txt, f16), the stages as kiln.pipeline.txt2img runs
-- them, planned by kiln.planner (--mode auto: the mode, the UNet's resident share and
-- the VAE tiles). Once with the UNet stored in f16 on the device, once in fp8
-- (f8_e4m3fn, when this build has it). Prints per variant: the plan, the time of each
-- stage, peak bytes on sim against the budget, bytes copied onto sim (in all and
-- during the CFG step).
--
--   KILN_SHARED=../shared build/kiln tests/bench/bench_sdxl.lua [--budget MIB] [--size PX]
--       [--variants f16,fp8] [--fresh] [--clean]
local kiln = require "kiln"
local util = require "kiln.util"
local rw = dofile("tests/bench/random_weights.lua")

local opts = util.parse_args(arg or {}, { budget = 2048, size = 1024, variants = "f16,fp8", fresh = false,
  clean = false })
local SHARED = os.getenv("KILN_SHARED") or "../shared"
local MiB = 1024 * 1024
local human = kiln.format_bytes
local fmt = string.format
local function say(...) print(fmt(...)) io.stdout:flush() end

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end
if not has_sim then say("# bench_sdxl: this build has no sim device: skipped") return end
local keys = SHARED .. "/sd-keys/sdxl.txt"
if not io.open(keys) then say("# bench_sdxl: %s is missing (set KILN_SHARED): skipped", keys) return end

local path = (os.getenv("TMPDIR") or "/tmp") .. "/kiln-bench-sdxl-f16.safetensors"
local wrote, n, bytes, sec = rw.ensure(path, keys, { mark = "sdxl-random-f16-v1", fresh = opts.fresh,
  keep = function(name)
    return name:match("^model%.diffusion_model%.") or name:match("^first_stage_model%.")
        or name:match("^conditioner%.")
  end })
if wrote then say("wrote %s: %d tensors, %s in %.0f s", path, n, human(bytes), sec) end

local ck <close> = kiln.load_checkpoint(path)
local tok = SHARED .. "/clip-tokenizer"
if io.open(tok .. "/vocab.json") then ck.clip.tokenizer = kiln.tokenizer(tok) end
local pipeline = require "kiln.pipeline"
local budget = math.floor(opts.budget * MiB)

say("\nSDXL pipeline piece on sim, --mode auto, budget %s: encode 2 prompts (CLIP-L + bigG), 1 CFG step at " ..
  "%dx%d latent, VAE decode %dx%d", human(budget), opts.size // 8, opts.size // 8, opts.size, opts.size)
local results = {}
for v in opts.variants:gmatch("[^,]+") do
  local dtype = v == "fp8" and "f8_e4m3fn" or nil
  if dtype and not pcall(kiln.zeros({ 1 }).to, kiln.zeros({ 1 }), dtype) then
    say("  %s: this build has no %s dtype: skipped", v, dtype)
  else
    collectgarbage(); collectgarbage()
    kiln.mem.empty_cache("sim")
    kiln.mem.set_budget("sim", budget)
    kiln.mem.reset_peak("sim")
    local t0 = kiln.time()
    local stages = {}
    local plan
    local step_copied
    local ok, err = xpcall(function()
      local W = opts.size
      local o = { device = "sim", width = W, height = W, cfg = 5 }
      local planner = require "kiln.planner"
      local t = kiln.time()
      plan = planner.choose(ck, o)
      kiln.memory_mode(plan.mode)
      stages[#stages + 1] = fmt("plan %.1f s", kiln.time() - t)
      kiln.mem.reset_peak("sim")
      t = kiln.time()
      ck.clip:load("sim")
      local cond, uncond, pooled, upooled = pipeline.encode_prompts(ck, "a photograph of an astronaut riding a horse",
        "blurry")
      ck.clip:unload()
      stages[#stages + 1] = fmt("encode %.1f s", kiln.time() - t)
      t = kiln.time()
      -- the planner's spare bytes keep that much of the UNet (in its device dtype) resident
      ck.unet:load("sim", { dtype = dtype, resident = plan.resident and plan.resident.unet or 0 })
      stages[#stages + 1] = fmt("UNet load%s %.1f s", dtype and (" (stored as " .. dtype .. ")") or "", kiln.time() - t)
      t = kiln.time()
      local y = ck.unet:sdxl_vector(pooled, { width = W, height = W })
      local yu = ck.unet:sdxl_vector(upooled, { width = W, height = W })
      local den = pipeline.denoiser(ck, cond, uncond, 5, { y_cond = y, y_uncond = yu })
      local x = kiln.randn({ 1, 4, W // 8, W // 8 }, { seed = 14 }) * 14.6
      local c0 = kiln.mem.stats("sim").copied_in
      local lat = den(x, 14.6)
      step_copied = kiln.mem.stats("sim").copied_in - c0
      ck.unet:unload()
      cond:free(); uncond:free(); x:free()
      for _, v in ipairs({ pooled, upooled, y, yu }) do if v then v:free() end end
      stages[#stages + 1] = fmt("CFG step (2 evaluations) %.1f s", kiln.time() - t)
      t = kiln.time()
      ck.vae:load("sim")
      local img = ck.vae:decode(lat, { tile = plan.vae_tile or 64, overlap = 16 })
      ck.vae:unload()
      img:free(); lat:free()
      stages[#stages + 1] = fmt("VAE decode (tile %s) %.1f s", tostring(plan.vae_tile or 64), kiln.time() - t)
    end, debug.traceback)
    local st = kiln.mem.stats("sim")
    kiln.mem.set_budget("sim", 0)
    kiln.memory_mode("normal")
    local r = { variant = v, ok = ok, err = err, peak = st.peak_reserved, alloc = st.peak, copied = st.copied_in,
      sec = kiln.time() - t0 }
    results[#results + 1] = r
    if plan then for _, l in ipairs(plan.lines) do say("    %s", l) end end
    if ok then
      say("  %s: %s", v, table.concat(stages, "; "))
      say("  %s: peak sim %s allocated, %s reserved (budget %s: %s); copied onto sim %s in all, %s during the CFG " ..
        "step", v, human(r.alloc), human(r.peak), human(budget), r.peak <= budget and "inside" or "EXCEEDED",
        human(r.copied), human(step_copied or 0))
    else
      say("  %s: FAILED: %s (peak reserved %s)", v, tostring(err), human(r.peak))
    end
  end
end
if opts.clean then os.remove(path) end
local failed = false
for _, r in ipairs(results) do failed = failed or not r.ok or r.peak > budget end
if failed then os.exit(1) end
