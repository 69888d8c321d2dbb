-- tests/bench/bench_lcm.lua - LCM-LoRA on the SD 1.5-shaped random checkpoint, end to
-- end: kiln.pipeline.txt2img with sampler "lcm", 4 steps, cfg 1 (no negative pass), at
-- 512x512, the LoRA applied with ckpt:add_lora; the time of each stage (applying the
-- LoRA and loading the UNet, text encode, each UNet step, VAE decode), the total and the process's peak RSS,
-- then the same run without the LoRA for reference (and, unless --no-euler, the
-- ordinary 20-step euler run at cfg 7 the LoRA replaces).
--
--   build/kiln tests/bench/bench_lcm.lua [--size 512] [--steps 4] [--weights PATH]
--       [--lora PATH] [--rank 64] [--threads 2] [--repeat 1] [--precision f32] [--no-euler]
--
-- The checkpoint is bench_sd.lua's (tests/bench/random_weights.lua over
-- $KILN_SHARED/sd-keys/sd15.txt, f16; written once, then reused). The LoRA is written
-- in the published LCM-LoRA's layout (latent-consistency/lcm-lora-sdv1-5): kohya keys
-- over diffusers module names, `lora_unet_<module>.lora_down.weight` / `.lora_up.weight`
-- / `.alpha` in f16, on the modules its training script targets (to_q, to_k, to_v,
-- to_out.0, proj_in, proj_out, ff.net.0.proj, ff.net.2, conv1, conv2, conv_shortcut,
-- the down- and upsamplers' convs, time_emb_proj), rank 64, alpha 8; 3x3 convolutions
-- get a 3x3 down and a 1x1 up factor, as PEFT's Conv2d LoRA. Random factors of the
-- right shapes: the arithmetic and the bytes are the real file's, the picture is noise.
-- Run it under flock /tmp/kiln-bench.lock.
local kiln = require "kiln"
local util = require "kiln.util"
local lora = require("kiln.lora").mapping
local unet_mod = require "kiln.unet"
local rw = dofile("tests/bench/random_weights.lua")

local o = util.parse_args(arg or {}, { size = 512, steps = 4, weights = "", lora = "", rank = 64, threads = 2,
  ["repeat"] = 1, precision = "f32", no_euler = false })
local fmt = string.format
local ps = dofile("tests/bench/proc_stats.lua")
local say, rss_peak, loadavg = ps.say, ps.rss_peak, ps.loadavg
local MiB = 1024 * 1024
kiln.set_quiet(true)
kiln.set_threads(o.threads)
kiln.precision(o.precision)

local SHARED = os.getenv("KILN_SHARED") or "../shared"
local tmp = os.getenv("TMPDIR") or "/tmp"
local CKPT = o.weights ~= "" and o.weights or (tmp .. "/kiln-bench-sd15-f16.safetensors")
local LORA = o.lora ~= "" and o.lora or fmt("%s/kiln-bench-lcm-lora-sd15-r%d.safetensors", tmp, o.rank)

local function rss_reset()
  local f = io.open("/proc/self/clear_refs", "w")
  if f then f:write("5"); f:close() end
end

-- ---------------------------------------------------------------- files

rw.ensure(CKPT, SHARED .. "/sd-keys/sd15.txt", { mark = "sd15-random-f16-v1", seed = 1000,
  keep = function(name)
    return name:match("^model%.diffusion_model%.") or name:match("^first_stage_model%.")
        or name:match("^cond_stage_model%.")
  end })

-- the modules LCM-LoRA's training script adapts (diffusers names)
local TARGETS = { "to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1",
  "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj" }

local function targeted(dname)
  local mod = dname:gsub("%.weight$", "")
  for _, t in ipairs(TARGETS) do
    if mod:sub(-#t - 1) == "." .. t then return mod end
  end
  return nil
end

local function write_lora(cfg)
  local tensors, n, params = {}, 0, 0
  local alpha = kiln.tensor(8.0):to("f16")
  for i, e in ipairs(unet_mod.expected(cfg)) do
    local name, shape = e[1], e[2]
    local mod = name:match("%.weight$") and (#shape == 2 or #shape == 4) and
        targeted(lora.unet_to_diffusers(name, cfg.num_res_blocks))
    if mod then
      local key = "lora_unet_" .. mod:gsub("%.", "_")
      local k4 = #shape == 4
      local down = k4 and { o.rank, shape[2], shape[3], shape[4] } or { o.rank, shape[2] }
      local up = k4 and { shape[1], o.rank, 1, 1 } or { shape[1], o.rank }
      tensors[key .. ".lora_down.weight"] = rw.tensor(key .. ".lora_down.weight", down, 50000 + 2 * i)
      tensors[key .. ".lora_up.weight"] = rw.tensor(key .. ".lora_up.weight", up, 50001 + 2 * i)
      tensors[key .. ".alpha"] = alpha
      n = n + 1
      params = params + down[1] * down[2] * (down[3] or 1) * (down[4] or 1) + up[1] * up[2]
    end
  end
  kiln.save_safetensors(LORA, tensors, {})
  for _, t in pairs(tensors) do if t ~= alpha then t:free() end end
  return n, params
end

local function exists(p)
  local f = io.open(p, "rb")
  if f then f:close() end
  return f ~= nil
end

local ckpt <close> = kiln.load_checkpoint(CKPT)
if not exists(LORA) then
  local n, params = write_lora(rawget(ckpt.unet, "config"))
  say("wrote %s: %d modules, %.1f M parameters (%.0f MB in f16)", LORA, n, params / 1e6, params * 2 / 1e6)
end

-- ---------------------------------------------------------------- runs

-- Each stage's seconds: the pipeline's stages are kiln.trace spans; the sampling stage
-- is split into its steps by the step callback.
local function timed_run(label, opts, with_lora)
  collectgarbage()
  rss_reset()
  local times, order = {}, {}
  local span = kiln.trace.span
  kiln.trace.span = function(name, fn, ...)
    local t0 = kiln.time()
    local function done(...)
      times[name] = (times[name] or 0) + kiln.time() - t0
      order[#order + 1] = name
      return ...
    end
    return done(span(name, fn, ...))
  end
  local steps, last = {}, nil
  opts.callback = function()
    local now = kiln.time()
    steps[#steps + 1] = now - (last or now)
    last = now
  end
  local t0 = kiln.time()
  local h, t_add, t_load
  local ok, err = pcall(function()
    local a = kiln.time()
    if with_lora then h = ckpt:add_lora(LORA) end
    t_add = kiln.time() - a
    -- the UNet's copy is built here (with the LoRA: patched, row block by row block) rather
    -- than inside the sampling stage, so both runs show that cost on its own
    a = kiln.time()
    ckpt.unet:load("cpu")
    t_load = kiln.time() - a
    local img, lat = kiln.pipeline.txt2img(ckpt, opts)
    img:free(); lat:free()
  end)
  local total = kiln.time() - t0
  kiln.trace.span = span
  if h then h:remove() end
  ckpt.unet:unload()
  if not ok then error(err, 0) end
  local peak = rss_peak()
  -- the step callback fires after each step: the gaps are steps 2.., step 1 the rest
  local parts = {}
  if with_lora then parts[#parts + 1] = fmt("add_lora %.2f", t_add) end
  parts[#parts + 1] = fmt("UNet load %.2f", t_load)
  parts[#parts + 1] = fmt("encode %.2f", times.encode or 0)
  local s, rest = {}, times.sample or 0
  for i = 2, #steps do s[#s + 1] = fmt("%.2f", steps[i]); rest = rest - steps[i] end
  parts[#parts + 1] = fmt("sample %.2f (steps %.2f %s)", times.sample or 0, rest, table.concat(s, " "))
  parts[#parts + 1] = fmt("decode %.2f", times.decode or 0)
  say("| %s | %s | %.2f | %.0f MiB |", label, table.concat(parts, ", "), total, peak / MiB)
  return total
end

local base = { prompt = "a photo of a cat on a red sofa", seed = 1, width = o.size, height = o.size }
local function with(t)
  local r = {}
  for k, v in pairs(base) do r[k] = v end
  for k, v in pairs(t) do r[k] = v end
  return r
end

say("# LCM-LoRA on the SD 1.5-shaped random checkpoint (%s): %dx%d, %d threads, precision %s, load %s",
  kiln.version, o.size, o.size, kiln.threads(), o.precision, loadavg())
say("checkpoint %s; LoRA %s (rank %d)", CKPT, LORA, o.rank)
-- untimed: maps the weights' pages, warms the caches
local w, wl = kiln.pipeline.txt2img(ckpt, with({ steps = 1, sampler = "lcm", scheduler = "sgm_uniform", cfg = 1 }))
w:free(); wl:free()
say("| run | stages (s) | total (s) | peak RSS |")
say("|---|---|---|---|")
local best = { lora = math.huge, plain = math.huge, euler = math.huge }
for _ = 1, math.max(1, o["repeat"]) do
  local lcm = { steps = o.steps, sampler = "lcm", scheduler = "sgm_uniform", cfg = 1 }
  best.lora = math.min(best.lora, timed_run(fmt("LCM-LoRA, lcm %d steps, cfg 1", o.steps), with(lcm), true))
  best.plain = math.min(best.plain, timed_run(fmt("no LoRA, lcm %d steps, cfg 1", o.steps), with(lcm), false))
  if not o.no_euler then
    best.euler = math.min(best.euler, timed_run("no LoRA, euler 20 steps, cfg 7",
      with({ steps = 20, sampler = "euler", scheduler = "normal", cfg = 7 }), false))
  end
end
say("best: LCM-LoRA %.2f s, without the LoRA %.2f s (x%.2f)%s; load %s", best.lora, best.plain,
  best.lora / best.plain, o.no_euler and "" or fmt(", 20-step euler cfg 7 %.2f s (x%.1f the LCM run)", best.euler,
  best.euler / best.lora), loadavg())
