-- tests/bench/bench_sd.lua - the SD 1.5 architecture, end to end, with random f16
-- weights: UNet evaluation (64x64 latent, batch 1 and 2, context [B, 77, 768]), VAE
-- decode of a 64x64 latent (512x512 image), CLIP-L encode; time, GFLOP/s, peak memory
-- and the ratio to PyTorch (tests/bench/torch_sd.py, the original modules in f32 on
-- the same weights and inputs); low vs high memory mode for one UNet step on sim;
-- text encode + one UNet step with CFG + VAE decode in low mode inside a 512 MiB
-- sim budget; and a rank-32 kohya LoRA over the UNet's transformer layers and the text
-- encoder: the time to apply it to resident weights, and one low-mode UNet step with it
-- against one without; previews: latent->RGB per step and a TAESD decode against one
-- CFG step; an ESRGAN x4 upscaler (RRDBNet, 23 blocks) on a 256x256 image against PyTorch.
--
--   build/kiln tests/bench/bench_sd.lua [--quick] [--repeat N] [--only LIST]
--       [--no-torch] [--weights PATH] [--fresh] [--clean] [--threads N] [--budget MIB]
--       [--warmup N] [--control-budget MIB] [--comfy-budget MIB]
--
-- --quick: 32x32 latents (256x256 images), batch 1 only, the pipeline piece at
-- 256x256 (a few minutes instead of about ten). --only: comma-separated subset of
-- unet,vae,bf16,clip,modes,pipeline,meta,lora,control,preview,upscale,residency,comfy (a ComfyUI
-- hires-fix graph with a LoRA and a ControlNet, low mode on sim inside --comfy-budget,
-- default 768: liveness against keeping every result). --warmup: untimed evaluations before the timed ones, on
-- both sides (default 1; the per-step cost a sampler pays: kiln's first evaluation on
-- mapped weights also maps their pages, as PyTorch's load reads them; 0 times
-- the first evaluation too). The weights (SD 1.5's UNet in f16, names and shapes from
-- $KILN_SHARED/sd-keys/sd15.txt) are generated once into a temporary file and reused by
-- later runs (--fresh regenerates, --clean removes it at the end, --weights names it).
-- Tensors up to 1 Mi elements are kiln.randn with their own seed; larger ones repeat
-- a seeded 1 Mi-element randn block (random enough for timing, and 5x faster to
-- generate); weights are scaled by 1/sqrt(fan_in), norm weights are 1 + 0.1 N(0, 1).
-- bf16: kiln.precision("bf16") against "f32" in the same run, runs alternating: the UNet
-- (each batch) and the VAE decode, time ratio and relative error; bf16_e2e (opt-in, long):
-- txt2img at 8x the latent size, 20 steps, CFG, euler, in f32 and in bf16.
local kiln = require "kiln"
local util = require "kiln.util"

local opts = util.parse_args(arg or {}, {
  quick = false, ["repeat"] = 1, only = "unet,lowbit,vae,bf16,clip,modes,pipeline,meta,lora,control,preview,upscale,residency,comfy", no_torch = false, weights = "",
  fresh = false, clean = false, threads = 0, budget = 512, control_budget = 640, comfy_budget = 768, warmup = 1,
})
if opts.threads > 0 then kiln.set_threads(opts.threads) end
local SHARED = os.getenv("KILN_SHARED") or "../shared"
local PY = os.getenv("PYTHON") or "/usr/bin/python3"
local SIZE = opts.quick and 32 or 64
local BATCHES = opts.quick and { 1 } or { 1, 2 }
local REPEAT = math.max(1, math.floor(opts["repeat"]))
local WARMUP = math.max(0, math.floor(opts.warmup))
local only = {}
for w in opts.only:gmatch("[^,]+") do only[w] = true end
local fmt = string.format
local MiB, GiB = 1024 * 1024, 1024 * 1024 * 1024
kiln.set_quiet(true)

local function human(b)
  if not b then return "-" end
  if b >= GiB then return fmt("%.2f GiB", b / GiB) end
  return fmt("%.1f MiB", b / MiB)
end

local function say(...) io.stdout:write(fmt(...), "\n"); io.stdout:flush() end

local function loadavg()
  local f = io.open("/proc/loadavg")
  if not f then return "?" end
  local s = f:read("l")
  f:close()
  return s:match("^(%S+ %S+ %S+)") or "?"
end

-- Resets the peak resident set of this process (Linux: clear_refs 5); vm_hwm() reads
-- it. Mapped weight pages the forward touched count, as PyTorch's tensors do.
local function rss_reset()
  local f = io.open("/proc/self/clear_refs", "w")
  if f then f:write("5"); f:close() end
end

local function vm_hwm() -- peak resident set of this process (bytes), from /proc
  local f = io.open("/proc/self/status")
  if not f then return nil end
  for line in f:lines() do
    local kb = line:match("^VmHWM:%s+(%d+) kB")
    if kb then f:close(); return tonumber(kb) * 1024 end
  end
  f:close()
end

-- ---------------------------------------------------------------- weights

local rw = dofile("tests/bench/random_weights.lua")
local parse_shape = rw.parse_shape

local MARK = "sd15-random-f16-v1"

local function file_ok(path) return rw.valid(path, MARK) end

-- the SD 1.5 networks of the key list (the schedule buffers, betas, alphas_cumprod, ...,
-- belong to no network)
local function make_weights(path)
  local _, n, bytes, secs = rw.ensure(path, SHARED .. "/sd-keys/sd15.txt", { mark = MARK, fresh = true, seed = 1000,
    keep = function(name)
      return name:match("^model%.diffusion_model%.") or name:match("^first_stage_model%.")
          or name:match("^cond_stage_model%.")
    end })
  return n, bytes, secs
end

-- An SD 1.5 ControlNet (the real key list) with random f16 weights, written once and
-- shared by the control and comfy stages; nil when the key list is missing.
local function controlnet_file()
  local keys = SHARED .. "/sd-keys/controlnet-sd15.txt"
  if not io.open(keys) then return nil, keys end
  local cpath = (os.getenv("TMPDIR") or "/tmp") .. "/kiln-bench-controlnet-sd15-f16.safetensors"
  rw.ensure(cpath, keys, { mark = "controlnet-sd15-random-f16-v1", seed = 900000 })
  return cpath
end

-- ---------------------------------------------------------------- FLOP counts

local unet_mod = require "kiln.unet"

-- One UNet evaluation (multiply-add = 2 FLOP) from the block plan: convolutions,
-- linear layers and attention (q k^T and p v); norms and pointwise ops left out.
local function unet_flops(cfg, B, H, W, L)
  local plan = unet_mod.plan(cfg)
  local ted, mc, ctx = cfg.time_embed_dim, cfg.model_channels, cfg.context_dim
  local total = 2 * B * (mc * ted + ted * ted)
  local hw = H * W
  local function layer(ly)
    if ly.kind == "conv" then
      total = total + 2 * B * ly.cout * ly.cin * 9 * hw
    elseif ly.kind == "res" then
      total = total + 2 * B * (ly.cout * ly.cin * 9 + ly.cout * ly.cout * 9) * hw + 2 * B * ted * ly.cout
      if ly.cin ~= ly.cout then total = total + 2 * B * ly.cout * ly.cin * hw end
    elseif ly.kind == "attn" then
      local c, N = ly.ch, hw
      local per = 2 * N * c * c * 4 + 2 * 2 * N * N * c         -- self-attention
          + 2 * N * c * c * 2 + 2 * 2 * L * ctx * c + 2 * 2 * N * L * c -- cross-attention
          + 2 * N * c * 8 * c + 2 * N * 4 * c * c                 -- GEGLU feed-forward
      total = total + B * (2 * 2 * N * c * c + ly.depth * per)   -- + proj_in, proj_out
    elseif ly.kind == "down" then
      hw = hw // 4
      total = total + 2 * B * ly.ch * ly.ch * 9 * hw
    elseif ly.kind == "up" then
      hw = hw * 4
      total = total + 2 * B * ly.ch * ly.ch * 9 * hw
    end
  end
  for _, blk in ipairs(plan.input) do for _, ly in ipairs(blk) do layer(ly) end end
  for _, ly in ipairs(plan.middle) do layer(ly) end
  for _, blk in ipairs(plan.output) do for _, ly in ipairs(blk) do layer(ly) end end
  total = total + 2 * B * cfg.out_channels * mc * 9 * hw
  return total
end

-- VAE decoder on an h x w latent.
local function vae_decode_flops(cfg, h, w)
  local ch, mult, nrb = cfg.ch, cfg.ch_mult, cfg.num_res_blocks
  local top = ch * mult[#mult]
  local hw = h * w
  local total = 2 * cfg.z_channels * cfg.embed_dim * hw + 2 * top * cfg.z_channels * 9 * hw
  local function res(cin, cout)
    total = total + 2 * (cout * cin * 9 + cout * cout * 9) * hw
    if cin ~= cout then total = total + 2 * cout * cin * hw end
  end
  res(top, top)
  total = total + 2 * 4 * hw * top * top + 2 * 2 * hw * hw * top
  res(top, top)
  local cin = top
  for i = cfg.levels - 1, 0, -1 do
    for _ = 0, nrb do res(cin, ch * mult[i + 1]); cin = ch * mult[i + 1] end
    if i ~= 0 then hw = hw * 4; total = total + 2 * cin * cin * 9 * hw end
  end
  return total + 2 * cfg.out_ch * cin * 9 * hw
end

local function clip_flops(cfg, B, L)
  local W, F = cfg.width, cfg.mlp
  return B * cfg.layers * (2 * L * W * W * 4 + 2 * 2 * L * L * W + 2 * 2 * L * W * F)
end

-- ---------------------------------------------------------------- helpers

local results = {} -- rows of the final table

-- Best wall time of n runs, with the process CPU time (all threads) of that run: on
-- a shared machine the CPU time says what the work cost, the wall time what it took.
-- WARMUP untimed runs go first unless warmup says otherwise.
local function time_best(n, fn, warmup)
  local best, cpu, out = math.huge, 0, nil
  -- each stage starts from an empty host cache, as PyTorch's runs start in a fresh
  -- process (what the previous stage cached has other sizes)
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("cpu")
  for _ = 1, warmup or WARMUP do
    local o = fn()
    if o and o.free then o:free() end
  end
  for _ = 1, n do
    if out and out.free then out:free() end
    collectgarbage(); collectgarbage()
    kiln.mem.reset_peak("cpu")
    rss_reset()
    local t0, c0 = kiln.time(), os.clock()
    out = fn()
    local dt, dc = kiln.time() - t0, os.clock() - c0
    if dt < best then best, cpu = dt, dc end
  end
  return best, out, cpu
end

local function torch_run(path, what, args, out_path, repeat_n)
  if opts.no_torch then return nil end
  local cmd = fmt("%s tests/bench/torch_sd.py '%s' %s %s --repeat %d --warmup %d --threads 2 --out '%s' 2>&1", PY,
    path, what, args, repeat_n or REPEAT, WARMUP, out_path)
  local p = io.popen(cmd)
  local text = p:read("a")
  p:close()
  local line = text:match("(%b{})%s*$")
  if not line or not line:find('"sec"', 1, true) then
    say("  torch: no result (%s)", (text:gsub("\n", " | ")):sub(-300))
    return nil
  end
  local r = { out = out_path }
  r.sec = tonumber(line:match('"sec": ([%d%.eE+-]+)'))
  r.cpu = tonumber(line:match('"cpu": ([%d%.eE+-]+)'))
  r.peak_rss = tonumber(line:match('"peak_rss": (%d+)'))
  r.load_sec = tonumber(line:match('"load_sec": ([%d%.eE+-]+)'))
  return r
end

-- Best of n runs of fn with between() (the PyTorch run) after the first half of them:
-- the machine's speed drifts by tens of percent over minutes here, so each side keeps
-- its best run out of the same stretch of time. Returns best, its output, its CPU time,
-- and what between() returned.
local function time_around(n, fn, between)
  local first = (n + 1) // 2
  local best, out, cpu = time_best(first, fn)
  local r = between()
  if n > first then
    -- every run's output is the same: keep the last one, so that the second half's
    -- peak statistics do not count the first half's output
    if out and out.free then out:free() end
    local b2, c2
    b2, out, c2 = time_best(n - first, fn, 0) -- warm already; keep to the same stretch
    if b2 < best then best, cpu = b2, c2 end
  end
  return best, out, cpu, r
end

local function rel_err(a, b)
  local d = (a:to("cpu"):to("f32") - b:to("f32")):abs():max()
  return d / math.max(1e-12, b:to("f32"):abs():max())
end

-- peak: the device allocator's peak; rss: the process's peak resident set (cpu rows)
local function row(name, sec, cpu, flops, peak, torch, err, rss)
  results[#results + 1] = { name = name, sec = sec, cpu = cpu, flops = flops, peak = peak, torch = torch, err = err,
    rss = rss }
  say("  %-36s %7.2f s (cpu %7.2f s) %7.1f GFLOP/s  peak %s%s%s%s", name, sec, cpu, flops and flops / sec / 1e9 or 0,
    human(peak), rss and fmt(", RSS %s", human(rss)) or "",
    torch and fmt("  torch %.2f s (cpu %.2f s, RSS %s): x%.3f (cpu x%.3f)", torch.sec, torch.cpu or 0,
      human(torch.peak_rss), sec / torch.sec, cpu / (torch.cpu or 1)) or "",
    err and fmt("  rel.err %.1e", err) or "")
end

-- ---------------------------------------------------------------- main

if not opts.no_torch and not os.execute(PY .. " -c 'import torch' >/dev/null 2>&1") then
  say("# note: %s cannot import torch: no PyTorch columns", PY)
  opts.no_torch = true
end

local tmpdir = os.getenv("TMPDIR") or "/tmp"
local path = opts.weights ~= "" and opts.weights or (tmpdir .. "/kiln-bench-sd15-f16.safetensors")
local out_path = tmpdir .. "/kiln-bench-sd15-torch-out.safetensors"

-- the processor (Linux: /proc/cpuinfo): ratios between precisions depend on it (one
-- with 512-bit units at full width runs the products faster against the memory-bound
-- ops than one that splits them), so a run's numbers are read against it
local function cpu_name()
  local f = io.open("/proc/cpuinfo", "r")
  if not f then return "unknown cpu" end
  local name, fam, model
  for line in f:lines() do
    name = name or line:match("^model name%s*:%s*(.-)%s*$")
    fam = fam or line:match("^cpu family%s*:%s*(%d+)")
    model = model or line:match("^model%s*:%s*(%d+)")
    if name and fam and model then break end
  end
  f:close()
  return fmt("%s (family %s, model %s)", name or "?", fam or "?", model or "?")
end
say("# SD 1.5 architecture bench: kiln %s, %d threads, load average %s at start, %s",
  kiln.version, kiln.threads and kiln.threads() or 0, loadavg(), os.date("%Y-%m-%d %H:%M"))
local bf16_kind = kiln.cpu_has_bf16 and (kiln.cpu_has_bf16() and ", native bf16 products" or ", bf16 emulated") or ""
say("# cpu: %s%s", cpu_name(), bf16_kind)
say("# latent %dx%d (%dx%d images), batches %s, best of %d run(s)%s", SIZE, SIZE, SIZE * 8, SIZE * 8,
  table.concat(BATCHES, ","), REPEAT, opts.no_torch and ", no torch" or ", torch 1.13 CPU f32 with 2 threads")

if opts.fresh or not file_ok(path) then
  local n, bytes, secs = make_weights(path)
  say("weights: %d tensors, %s f16, generated in %.1f s -> %s", n, human(bytes), secs, path)
else
  say("weights: reusing %s", path)
end

local ck <close> = kiln.load_checkpoint(path)
assert(ck.family == "sd1", "expected an SD 1.x layout, got " .. tostring(ck.family))
local ucfg = ck.unet.config
local wbytes = { unet = 0, vae = 0, clip = 0 }
for _, part in ipairs({ "unet", "vae", "clip" }) do wbytes[part] = ck[part].model:stats().file_bytes end
say("parts: unet %s, vae %s, clip %s (f16 in the file)", human(wbytes.unet), human(wbytes.vae), human(wbytes.clip))

local function inputs(B, S)
  return kiln.randn({ B, 4, S, S }, { seed = 11 }), kiln.full({ B }, 500), kiln.randn({ B, 77, 768 }, { seed = 12 })
end

local IDS = { 49406, 320, 1125, 539, 320, 2368, 49407 }
while #IDS < 77 do IDS[#IDS + 1] = 49407 end

-- 1. compute on the cpu (memory mode normal): the weights as the file holds them (f16,
-- mapped; the kernels cast at use) and loaded to f32 first
if only.unet then
  say("\nUNet evaluation, cpu")
  for _, B in ipairs(BATCHES) do
    local x, t, ctx = inputs(B, SIZE)
    local flops = unet_flops(ucfg, B, SIZE, SIZE, 77)
    local tr
    for _, variant in ipairs(B == 1 and { "f16", "f32" } or { "f16" }) do
      if variant == "f32" then ck.unet:load("cpu", { dtype = "f32" }) end
      local fwd = function() return ck.unet:forward(x, t, ctx) end
      local sec, out, cpu
      if variant == "f16" then
        sec, out, cpu, tr = time_around(REPEAT, fwd,
          function() return torch_run(path, "unet", fmt("--batch %d --size %d", B, SIZE), out_path) end)
      else
        sec, out, cpu = time_best(REPEAT, fwd)
      end
      local peak, rss = kiln.mem.stats("cpu").peak, vm_hwm()
      local err = tr and rel_err(out, kiln.load_safetensors(tr.out).out) or nil
      row(fmt("unet b%d %dx%d, %s weights", B, SIZE, SIZE, variant == "f16" and "f16 mapped" or "f32 loaded"), sec, cpu,
        flops, peak, tr, err, rss)
      out:free()
      if variant == "f32" then ck.unet:unload() end
    end
    if tr then say("  torch: weights %s in f32, loaded in %.1f s", human(2 * wbytes.unet), tr.load_sec) end
  end
end

-- 1b. low-bit weights on the cpu: the same UNet evaluation with the weights stored in
-- fp8 (e4m3fn) and in q8_0 (ggml's reference quantizer; what a GGUF file holds), both
-- decoded inside the kernels; time against the f16 run and the outputs' difference
if only.lowbit then
  say("\nUNet evaluation, cpu, low-bit weights (latent %dx%d, batch 1)", SIZE, SIZE)
  local x, t, ctx = inputs(1, SIZE)
  local flops = unet_flops(ucfg, 1, SIZE, SIZE, 77)
  local fwd = function() return ck.unet:forward(x, t, ctx) end
  local base, ref, cpu0 = time_best(REPEAT, fwd)
  row("unet lowbit: f16 mapped", base, cpu0, flops, kiln.mem.stats("cpu").peak)
  for _, dt in ipairs({ "f8_e4m3fn", "q8_0" }) do
    local t0 = kiln.time()
    ck.unet:load("cpu", { dtype = dt })
    local conv = kiln.time() - t0
    local sec, out, cpu = time_best(REPEAT, fwd)
    local d = ((out - ref):abs():max())
    row(fmt("unet lowbit: %s", dt), sec, cpu, flops, kiln.mem.stats("cpu").peak)
    say("  %s: x%.3f the f16 time, max |out - f16 out| %.2e (|f16 out| max %.2f), weights %s (converted in %.1f s)",
      dt, sec / base, d, (ref:abs():max()), human(ck.unet:bytes("cpu")), conv)
    out:free()
    ck.unet:unload()
  end
  ref:free()
end

if only.vae then
  say("\nVAE decode, cpu")
  local z = kiln.randn({ 1, 4, SIZE, SIZE }, { seed = 13 })
  local flops = vae_decode_flops(ck.vae.config, SIZE, SIZE)
  local sec, img, cpu, tr = time_around(REPEAT, function() return ck.vae:decode(z) end,
    function() return torch_run(path, "vae", fmt("--size %d", SIZE), out_path) end)
  local peak, rss = kiln.mem.stats("cpu").peak, vm_hwm()
  local err
  if tr then
    local raw = kiln.load_safetensors(tr.out).out
    err = rel_err(img, ((raw + 1) * 0.5):clamp(0, 1))
  end
  row(fmt("vae decode %dx%d -> %dx%d", SIZE, SIZE, 8 * SIZE, 8 * SIZE), sec, cpu, flops, peak, tr, err, rss)
  img:free()
end

-- bf16 against f32: each network timed in both precisions, alternating run by run so
-- that both see the same stretch of a shared machine; the ratio of the best times, and
-- the median of each repeat's own ratio (a machine whose speed drifts over minutes moves
-- both runs of a repeat together); the error is the bf16 output's max |difference| over
-- the f32 output's max |value|
local function precision_pair(label, flops, fn)
  local best, outs, cpus, last, ratios = { f32 = math.huge, bf16 = math.huge }, {}, {}, {}, {}
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("cpu")
  for _, p in ipairs({ "f32", "bf16" }) do -- warm-up of both
    for _ = 1, WARMUP do
      kiln.precision(p)
      local o = fn()
      if o and o.free then o:free() end
    end
  end
  for _ = 1, REPEAT do
    for _, p in ipairs({ "f32", "bf16" }) do
      kiln.precision(p)
      if outs[p] then outs[p]:free() end
      collectgarbage(); collectgarbage()
      local t0, c0 = kiln.time(), os.clock()
      outs[p] = fn()
      local dt, dc = kiln.time() - t0, os.clock() - c0
      if dt < best[p] then best[p], cpus[p] = dt, dc end
      last[p] = dt
    end
    ratios[#ratios + 1] = last.bf16 / last.f32
  end
  kiln.precision("auto")
  table.sort(ratios)
  local n = #ratios
  local median = n % 2 == 1 and ratios[(n + 1) // 2] or (ratios[n // 2] + ratios[n // 2 + 1]) / 2
  local err = rel_err(outs.bf16, outs.f32)
  row(label .. ", f32", best.f32, cpus.f32, flops, kiln.mem.stats("cpu").peak)
  row(label .. ", bf16", best.bf16, cpus.bf16, flops, kiln.mem.stats("cpu").peak, nil, err)
  say("  %s: bf16 x%.3f the f32 time (best of each; median of the %d repeats' ratios x%.3f), rel.err %.1e",
    label, best.bf16 / best.f32, n, median, err)
  outs.f32:free(); outs.bf16:free()
  return best.bf16 / best.f32, err
end

if only.bf16 then
  say("\nbf16 against f32 (kiln.precision), cpu%s", kiln.precision_of and "" or ": kiln.precision missing")
  for _, B in ipairs(BATCHES) do
    local x, t, ctx = inputs(B, SIZE)
    precision_pair(fmt("unet b%d %dx%d", B, SIZE, SIZE), unet_flops(ucfg, B, SIZE, SIZE, 77),
      function() return ck.unet:forward(x, t, ctx) end)
  end
  local z = kiln.randn({ 1, 4, SIZE, SIZE }, { seed = 13 })
  precision_pair(fmt("vae decode %dx%d", SIZE, SIZE), vae_decode_flops(ck.vae.config, SIZE, SIZE),
    function() return ck.vae:decode(z) end)
end

if only.bf16_e2e then
  local pipeline = require "kiln.pipeline"
  say("\ntxt2img %dx%d, 20 steps, CFG 7, euler, cpu: f32 then bf16", 8 * SIZE, 8 * SIZE)
  local o = { prompt = "a photograph of an astronaut riding a horse", seed = 1, steps = 20, cfg = 7,
    sampler = "euler", scheduler = "normal", width = 8 * SIZE, height = 8 * SIZE }
  local imgs, secs = {}, {}
  for _, p in ipairs({ "f32", "bf16" }) do
    kiln.precision(p)
    collectgarbage(); collectgarbage()
    local t0, c0 = kiln.time(), os.clock()
    imgs[p] = pipeline.txt2img(ck, o)
    secs[p] = kiln.time() - t0
    row(fmt("txt2img %dx%d 20 steps, %s", 8 * SIZE, 8 * SIZE, p), secs[p], os.clock() - c0, nil,
      kiln.mem.stats("cpu").peak)
  end
  kiln.precision("auto")
  say("  txt2img: bf16 %.1f s, f32 %.1f s (x%.3f), rel.err %.1e", secs.bf16, secs.f32, secs.bf16 / secs.f32,
    rel_err(imgs.bf16, imgs.f32))
  imgs.f32:free(); imgs.bf16:free()
end

if only.clip then
  say("\nCLIP-L encode (77 tokens), cpu")
  local enc = ck.clip.encoders[1].enc
  local flops = clip_flops(enc.config, 1, 77)
  local sec, h, cpu, tr = time_around(math.max(REPEAT, 3), function() return enc:forward(IDS) end,
    function() return torch_run(path, "clip", "--batch 1", out_path, math.max(REPEAT, 3)) end)
  local peak, rss = kiln.mem.stats("cpu").peak, vm_hwm()
  local err = tr and rel_err(h, kiln.load_safetensors(tr.out).out) or nil
  row("clip-l encode b1", sec, cpu, flops, peak, tr, err, rss)
  h:free()
end

-- 2. low vs high mode for one UNet step on sim
local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end
local mode_rows = {}
if only.modes and has_sim then
  say("\nOne UNet step on sim (batch 1, %dx%d), low vs high memory mode", SIZE, SIZE)
  local x, t, ctx = inputs(1, SIZE)
  local flops = unet_flops(ucfg, 1, SIZE, SIZE, 77)
  for _, mode in ipairs({ "high", "low" }) do
    kiln.memory_mode(mode)
    collectgarbage(); collectgarbage()
    kiln.mem.empty_cache("sim")
    local base = kiln.mem.stats("sim").allocated
    local t0 = kiln.time()
    ck.unet:load("sim")
    local load_sec = kiln.time() - t0
    local before = ck.unet:stats()
    kiln.mem.reset_peak("sim")
    local sec, out, cpu = time_best(REPEAT, function() return ck.unet:forward(x, t, ctx) end)
    out:free()
    local st = ck.unet:stats()
    local peak = kiln.mem.stats("sim").peak - base -- weights (high) or streamed blocks (low) + activations
    mode_rows[mode] = { sec = sec, cpu = cpu, peak = peak }
    row(fmt("unet step, mode %s", mode), sec, cpu, flops, peak, nil, nil)
    if mode == "low" then
      say("  streamed over %d evaluations: %d fetched, %d prefetched (%d hits, %d waits), device bytes after %d, load %.2f s",
        REPEAT + WARMUP, st.fetches - before.fetches, st.prefetches - before.prefetches, st.prefetch_hits - before.prefetch_hits,
        st.prefetch_waits - before.prefetch_waits, ck.unet:bytes("sim"), load_sec)
    else
      say("  load to sim %.2f s", load_sec)
    end
    ck.unet:unload()
  end
  kiln.memory_mode("normal")
  say("  low / high time x%.3f (cpu x%.3f; target <= 1.3), peak %s vs %s", mode_rows.low.sec / mode_rows.high.sec,
    mode_rows.low.cpu / mode_rows.high.cpu, human(mode_rows.low.peak), human(mode_rows.high.peak))
end

-- 3. text encode + one UNet step with CFG + VAE decode, low mode, 512 MiB sim budget
local pipe
-- The pipeline piece on sim in low mode inside `budget`: encode two prompts, step(cond,
-- uncond, pipeline) -> the latent and the step's label, VAE decode in tiles. Prints the
-- stages and the peak; returns ok, the error and sim's statistics.
local function sim_piece(budget, step)
  local pipeline = require "kiln.pipeline"
  local tok_dir = SHARED .. "/clip-tokenizer"
  local tf = io.open(tok_dir .. "/vocab.json")
  if tf then
    tf:close()
    if not ck.clip.tokenizer then ck.clip.tokenizer = kiln.tokenizer(tok_dir) end
  end
  kiln.memory_mode("low")
  ck.unet:unload(); ck.clip:unload(); ck.vae:unload()
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
  local old_budget = kiln.mem.stats("sim").budget
  kiln.mem.set_budget("sim", budget)
  kiln.mem.reset_peak("sim")
  local stages = {}
  local ok, err = pcall(function()
    local t0 = kiln.time()
    ck.clip:load("sim")
    local cond, uncond
    if ck.clip.tokenizer then
      cond, uncond = pipeline.encode_prompts(ck, "a photograph of an astronaut riding a horse", "blurry")
    else
      local enc = ck.clip.encoders[1].enc
      cond, uncond = enc:forward(IDS), enc:forward(IDS)
    end
    ck.clip:unload()
    stages[#stages + 1] = fmt("encode %.1f s", kiln.time() - t0)
    t0 = kiln.time()
    local lat, label = step(cond, uncond, pipeline)
    cond:free(); uncond:free()
    stages[#stages + 1] = fmt("%s %.1f s", label, kiln.time() - t0)
    t0 = kiln.time()
    ck.vae:load("sim")
    local tile = math.min(SIZE, 32)
    local img = ck.vae:decode(lat, { tile = tile, overlap = 8 })
    ck.vae:unload()
    assert(img.shape[3] == 8 * SIZE)
    stages[#stages + 1] = fmt("VAE decode, tiles of %d latents, %.1f s", tile, kiln.time() - t0)
    img:free(); lat:free()
  end)
  local st = kiln.mem.stats("sim")
  kiln.mem.set_budget("sim", old_budget)
  kiln.memory_mode("normal")
  if ok then
    say("  %s", table.concat(stages, "; "))
    say("  peak sim: %s allocated, %s reserved, budget %s: %s", human(st.peak), human(st.peak_reserved),
      human(budget), st.peak_reserved <= budget and "inside" or "EXCEEDED")
  else
    say("  FAILED: %s (peak reserved %s)", tostring(err), human(st.peak_reserved))
  end
  return ok, err, st
end

if only.pipeline and has_sim then
  local budget = math.floor(opts.budget * MiB)
  say("\nPipeline piece on sim, mode low, budget %s: encode 2 prompts, 1 UNet step with CFG, VAE decode %dx%d " ..
    "tiled (%s)", human(budget), 8 * SIZE, 8 * SIZE, kiln.tile and "kiln.tile present" or "vae.lua's tiles, no kiln.tile")
  local ok, _, st = sim_piece(budget, function(cond, uncond, pipeline)
    ck.unet:load("sim")
    local den = pipeline.denoiser(ck, cond, uncond, 7.5, {})
    local x = kiln.randn({ 1, 4, SIZE, SIZE }, { seed = 14 }) * 14.6
    local lat = den(x, 14.6)
    ck.unet:unload()
    x:free()
    return lat, "UNet step with CFG (2 evaluations)"
  end)
  pipe = { ok = ok, peak = st.peak_reserved, budget = budget }
end

-- 3b. the shape-only device (--only meta): the same piece as a dry run modelling sim
-- (kiln.dry_run: same budget, low mode, no arithmetic, no weights read) against the
-- real run: predicted and measured peaks, the error, the dry run's time
local meta_row
if only.meta and has_sim then
  local budget = math.floor(opts.budget * MiB)
  local function step(cond, uncond, pipeline)
    ck.unet:load("sim")
    local den = pipeline.denoiser(ck, cond, uncond, 7.5, {})
    local x = kiln.randn({ 1, 4, SIZE, SIZE }, { seed = 14 }) * 14.6
    local lat = den(x, 14.6)
    ck.unet:unload()
    x:free()
    return lat, "UNet step with CFG (2 evaluations)"
  end
  say("\nDry run of the pipeline piece (kiln.dry_run modelling sim, mode low, budget %s) against the real run",
    human(budget))
  local r = kiln.dry_run(function() sim_piece(budget, step) end, { device = "sim", budget = budget })
  say("  predicted in %.2f s: peak %s allocated, %s reserved%s", r.seconds, human(r.peak_allocated),
    human(r.peak_reserved), r.fits and "" or (", does not fit: " .. tostring(r.oom)))
  local t0 = kiln.time()
  local ok, _, st = sim_piece(budget, step)
  local real_s = kiln.time() - t0
  if ok then
    local err = (r.peak_allocated - st.peak) / st.peak
    local err_r = (r.peak_reserved - st.peak_reserved) / st.peak_reserved
    say("  measured in %.1f s: peak %s allocated, %s reserved; prediction error %+.2f%% allocated, %+.2f%% reserved",
      real_s, human(st.peak), human(st.peak_reserved), 100 * err, 100 * err_r)
    meta_row = { err = err, err_r = err_r, seconds = r.seconds, real = real_s }
  end
end

-- 4. a rank-32 kohya LoRA (the layers kohya's trainer targets by default: the UNet's
-- transformer linears and 1x1 projections, the text encoder's attention and MLP)
local lora_rows
local function make_lora(lpath, rank)
  local ws = kiln.load_safetensors(path) -- mapped: only shapes are read
  local out, n, bytes, seed = {}, 0, 0, 500000
  local names = {}
  for name in pairs(ws) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    local w = ws[name]
    local key
    local u = name:match("^model%.diffusion_model%.(.+)%.weight$")
    if u and (u:match("transformer_blocks%.%d+%.attn%d%.to_[qkv]$") or u:match("transformer_blocks%.%d+%.attn%d%.to_out%.0$")
        or u:match("transformer_blocks%.%d+%.ff%.net%.0%.proj$") or u:match("transformer_blocks%.%d+%.ff%.net%.2$")
        or u:match("%.proj_in$") or u:match("%.proj_out$")) then
      key = "lora_unet_" .. u:gsub("%.", "_")
    end
    local c = name:match("^cond_stage_model%.transformer%.(text_model%.encoder%.layers%.%d+%..+)%.weight$")
    if c and (c:match("self_attn%.[qkvo]%a*_proj$") or c:match("mlp%.fc%d$")) then
      key = "lora_te_" .. c:gsub("%.", "_")
    end
    if key then
      local sh = w.shape
      local din, dout = sh[2], sh[1]
      local tail = #sh == 4 and { 1, 1 } or {}
      local dshape, ushape = { rank, din, table.unpack(tail) }, { dout, rank, table.unpack(tail) }
      local d = kiln.randn(dshape, { seed = seed }) * (1 / math.sqrt(din))
      local up = kiln.randn(ushape, { seed = seed + 1 }) * 0.01
      out[key .. ".lora_down.weight"] = d:to("f16"); d:free()
      out[key .. ".lora_up.weight"] = up:to("f16"); up:free()
      out[key .. ".alpha"] = kiln.tensor({ rank }):to("f16")
      seed = seed + 2
      n = n + 1
      bytes = bytes + (din + dout) * rank * 2
    end
  end
  kiln.save_safetensors(lpath, out)
  for _, t in pairs(out) do t:free() end
  return n, bytes
end

if only.lora and has_sim then
  local rank = 32
  local lpath = tmpdir .. "/kiln-bench-sd15-lora-r32.safetensors"
  local nmod, lbytes = make_lora(lpath, rank)
  say("\nA rank-%d kohya LoRA: %d modules (UNet transformer layers, text encoder), %s f16", rank, nmod, human(lbytes))
  lora_rows = {}
  -- resident: the UNet and the text encoder loaded on sim, then the LoRA applied (every
  -- patched copy rebuilt from the file plus its delta)
  kiln.memory_mode("normal")
  ck.unet:load("sim"); ck.clip:load("sim")
  local t0 = kiln.time()
  local h = ck:add_lora(lpath)
  lora_rows.apply = kiln.time() - t0
  say("  applied to the resident UNet and text encoder in %.2f s (%d weights; target <= 1.5 s %s)", lora_rows.apply,
    h.patched, lora_rows.apply <= 1.5 and "met" or "NOT met")
  t0 = kiln.time()
  h:remove()
  say("  removed (copies rebuilt from the file) in %.2f s", kiln.time() - t0)
  ck.unet:unload(); ck.clip:unload()
  -- low mode: one UNet step without and with the LoRA (patched as each block streams
  -- in), alternating, so both sides see the same stretch of the machine's speed
  local x, t, ctx = inputs(1, SIZE)
  kiln.memory_mode("low")
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
  local base = kiln.mem.stats("sim").allocated
  ck.unet:load("sim")
  local flops = unet_flops(ucfg, 1, SIZE, SIZE, 77)
  for _, with in ipairs({ false, true }) do lora_rows[with and "with" or "without"] = { sec = math.huge, peak = 0 } end
  for round = 1, REPEAT do
    for _, with in ipairs({ false, true }) do
      local hl = with and ck:add_lora(lpath, { clip = 0 }) or nil
      kiln.mem.reset_peak("sim")
      local sec, out, cpu = time_best(1, function() return ck.unet:forward(x, t, ctx) end, round == 1 and WARMUP or 0)
      out:free()
      local r = lora_rows[with and "with" or "without"]
      if sec < r.sec then r.sec, r.cpu = sec, cpu end
      r.peak = math.max(r.peak, kiln.mem.stats("sim").peak - base)
      if hl then hl:remove() end
    end
  end
  ck.unet:unload()
  for _, with in ipairs({ false, true }) do
    local r = lora_rows[with and "with" or "without"]
    row(fmt("unet step, low mode, %s LoRA", with and "with" or "without"), r.sec, r.cpu, flops, r.peak, nil, nil)
  end
  kiln.memory_mode("normal")
  x:free(); t:free(); ctx:free()
  local r = lora_rows.with.sec / lora_rows.without.sec
  say("  with / without: time x%.3f (target <= 1.15 %s), peak on sim %s vs %s (growth %s; the LoRA's factors %s)",
    r, r <= 1.15 and "met" or "NOT met", human(lora_rows.with.peak), human(lora_rows.without.peak),
    human(math.max(0, lora_rows.with.peak - lora_rows.without.peak)), human(lbytes))
  if opts.clean then os.remove(lpath) end
end

-- 5. one CFG step (batch 2) with an SD 1.5 ControlNet (random f16 weights from the
-- ControlNet key list) against the same step without, measured alternately; then
-- the 512x512 pipeline piece with the net in low mode inside --control-budget (sim)
local control_rows
if only.control then
  local cpath, keys = controlnet_file()
  if cpath then
    local cn <close> = kiln.load_controlnet(cpath)
    local x, t, ctx = inputs(2, SIZE)
    local hint = kiln.rand({ 1, 3, SIZE * 8, SIZE * 8 }, { seed = 13 })
    local flops = unet_flops(ucfg, 2, SIZE, SIZE, 77)
    control_rows = { without = { sec = math.huge }, with = { sec = math.huge } }
    local hint_cache = {}
    do -- the hint encoder alone: what the cache saves at each later step
      local t0 = kiln.time()
      local res = cn:forward(x, t, ctx, hint, { cache = hint_cache })
      for _, r in ipairs(res) do r:free() end
      control_rows.first = kiln.time() - t0
    end
    for round = 1, REPEAT do
      for _, with in ipairs({ false, true }) do
        local sec, out, cpu = time_best(1, function()
          if not with then return ck.unet:forward(x, t, ctx) end
          -- as in a sampling: the hint encoded at the first step and kept (cache)
          local res = cn:forward(x, t, ctx, hint, { cache = hint_cache })
          return ck.unet:forward(x, t, ctx, nil, { control = res, free_control = true })
        end, round == 1 and WARMUP or 0)
        out:free()
        local r = control_rows[with and "with" or "without"]
        if sec < r.sec then r.sec, r.cpu = sec, cpu end
      end
    end
    say("\nOne CFG step (batch 2, %dx%d) with an SD 1.5 ControlNet (random f16 weights, %s)", SIZE, SIZE,
      human(cn.model and cn.model:stats().file_bytes or 0))
    for _, with in ipairs({ false, true }) do
      local r = control_rows[with and "with" or "without"]
      row(fmt("unet b2 step, %s ControlNet", with and "with" or "without"), r.sec, r.cpu, flops, nil, nil, nil)
    end
    local rr = control_rows.with.sec / control_rows.without.sec
    say("  with / without: x%.3f (target <= 1.5 %s); the hint is encoded once per sampling (first ControlNet " ..
      "call %.2f s with it)", rr, rr <= 1.5 and "met" or "NOT met", control_rows.first)
    require("kiln.controlnet").free_cache(hint_cache)
    x:free(); t:free(); ctx:free(); hint:free()

    -- the 512x512 pipeline piece with the ControlNet, low mode, inside a sim budget:
    -- encode 2 prompts, one CFG step with the net (both streamed), tiled VAE decode
    if has_sim then
      local budget = math.floor(opts.control_budget * MiB)
      say("\nPipeline piece with the ControlNet on sim, mode low, budget %s: encode 2 prompts, 1 CFG step " ..
        "with the ControlNet, VAE decode %dx%d tiled", human(budget), 8 * SIZE, 8 * SIZE)
      local ok, _, st = sim_piece(budget, function(cond, uncond, pipeline)
        ck.unet:load("sim")
        cn:load("sim")
        local h = kiln.rand({ 1, 3, SIZE * 8, SIZE * 8 }, { seed = 13 })
        local hs = h:to("sim")
        h:free()
        local controls = { { net = cn, hint = hs, strength = 1, sigma_hi = math.huge, sigma_lo = 0, cache = {} } }
        local den = pipeline.denoiser(ck, cond, uncond, 7.5, { controls = controls })
        local xs = kiln.randn({ 1, 4, SIZE, SIZE }, { seed = 14 }) * 14.6
        local lat = den(xs, 14.6)
        require("kiln.controlnet").free_cache(controls[1].cache)
        hs:free(); xs:free()
        cn:unload(); ck.unet:unload()
        return lat, "CFG step with the ControlNet (2 + 2 evaluations)"
      end)
      control_rows.piece = { ok = ok, peak = st.peak_reserved, budget = budget }
    end
    if opts.clean then os.remove(cpath) end
  else
    say("# control: %s is missing (set KILN_SHARED): stage skipped", keys)
  end
end

-- 6. previews while sampling: the latent->RGB projection per step (target <= 1 ms),
-- and a TAESD decode of the latent (the published width, random weights from
-- tests/golden/taesd/decoder.recipe) against one SD 1.5 CFG step in f32 (the UNet at
-- batch 2), measured alternately: the decode as previews run it (the default
-- preview_precision, kiln.preview.precision_for: bf16 on a CPU with native bf16
-- products), which the target judges (<= 5 %), and in f32
local preview_rows
if only.preview then
  local pv = require "kiln.preview"
  say("\nPreviews (latent %dx%d, %dx%d images)", SIZE, SIZE, 8 * SIZE, 8 * SIZE)
  local z = kiln.randn({ 1, 4, SIZE, SIZE }, { seed = 13 })
  local n = 200
  local l2r = time_best(REPEAT, function()
    for _ = 1, n do pv.latent2rgb(z, "sd1"):free() end
  end)
  preview_rows = { l2r = l2r / n }
  local tpath = tmpdir .. "/kiln-bench-taesd-decoder.safetensors"
  if not io.open(tpath) then
    local tensors = {}
    for line in io.lines("tests/golden/taesd/decoder.recipe") do
      local name, shape, seed, std, mean = line:match("^([^#@][^\t]*)\t[^\t]+\t([^\t]+)\t([^\t]+)\t([^\t]+)\t([^\t]+)$")
      if name then
        tensors[name] = kiln.randn(parse_shape(shape), { seed = tonumber(seed) }) * tonumber(std) + tonumber(mean)
      end
    end
    kiln.save_safetensors(tpath, tensors)
  end
  local taesd <close> = kiln.load_taesd({ decoder = tpath })
  -- conv FLOP of the decoder: 3x3 convolutions at S, 2S, 4S and 8S
  local w, tflops = taesd.width, 0
  local function conv(cin, cout, r) tflops = tflops + 2 * cin * cout * 9 * r * r end
  conv(4, w, SIZE)
  for lvl = 0, 2 do
    local r = SIZE * 2 ^ lvl
    for _ = 1, 9 do conv(w, w, r) end
    conv(w, w, 2 * r)
  end
  for _ = 1, 3 do conv(w, w, 8 * SIZE) end
  conv(w, 3, 8 * SIZE)
  local x, t, ctx = inputs(2, SIZE)
  -- the previews' precision here ("run": the process's, f32 in this bench)
  local pprec = pv.precision_for(nil, kiln.default_device())
  local pname = pprec == "run" and kiln.precision_of() or pprec
  local best = { step = { sec = math.huge }, taesd = { sec = math.huge }, taesd32 = { sec = math.huge } }
  local tr, tref
  for round = 1, REPEAT do
    for _, which in ipairs({ "step", "taesd", "taesd32" }) do
      local sec, out, cpu = time_best(1, function()
        if which == "step" then return kiln.with_precision("f32", ck.unet.forward, ck.unet, x, t, ctx) end
        if which == "taesd32" then return kiln.with_precision("f32", taesd.decode, taesd, z) end
        if pprec == "run" then return taesd:decode(z) end
        return kiln.with_precision(pprec, taesd.decode, taesd, z)
      end, round == 1 and WARMUP or 0)
      local b = best[which]
      if sec < b.sec then b.sec, b.cpu = sec, cpu end
      if which ~= "step" and round == 1 then
        if not tr then
          tr = torch_run(tpath, "taesd", fmt("--size %d", SIZE), out_path)
          tref = tr and kiln.load_safetensors(tr.out).out
        end
        if tref then b.err = rel_err(out, tref) end
      end
      out:free()
    end
  end
  if tref then tref:free() end
  x:free(); t:free(); ctx:free(); z:free()
  row(fmt("latent->rgb %dx%d (per step)", SIZE, SIZE), preview_rows.l2r, preview_rows.l2r, 2 * 4 * 3 * SIZE * SIZE,
    nil, nil, nil)
  row(fmt("taesd decode %dx%d previews (%s)", 8 * SIZE, 8 * SIZE, pname), best.taesd.sec, best.taesd.cpu, tflops, nil,
    tr, best.taesd.err)
  row(fmt("taesd decode %dx%d f32", 8 * SIZE, 8 * SIZE), best.taesd32.sec, best.taesd32.cpu, tflops, nil, tr,
    best.taesd32.err)
  row(fmt("unet b2 %dx%d (one CFG step)", SIZE, SIZE), best.step.sec, best.step.cpu, unet_flops(ucfg, 2, SIZE, SIZE, 77),
    nil, nil, nil)
  preview_rows.taesd, preview_rows.taesd32, preview_rows.step = best.taesd.sec, best.taesd32.sec, best.step.sec
  preview_rows.prec = pname
  say("  latent->rgb %.3f ms per step (target <= 1 ms %s); TAESD decode / f32 CFG step: previews (%s) %.1f %% "
    .. "(target <= 5 %% %s; in CPU time %.1f %%), f32 %.1f %% (in CPU time %.1f %%)", preview_rows.l2r * 1e3,
    preview_rows.l2r <= 1e-3 and "met" or "NOT met", pname,
    100 * best.taesd.sec / best.step.sec, best.taesd.sec / best.step.sec <= 0.05 and "met" or "NOT met",
    100 * best.taesd.cpu / best.step.cpu, 100 * best.taesd32.sec / best.step.sec,
    100 * best.taesd32.cpu / best.step.cpu)
  if opts.clean then os.remove(tpath) end
end

-- 7. an ESRGAN x4 upscaler (RRDBNet: 23 blocks, 64 features, growth 32, the published
-- ESRGAN size; random f32 weights scaled by 1/sqrt(fan_in)) on a 256x256 image (128x128
-- with --quick), the bare network against tests/bench/torch_sd.py's on the same file
local upscale_row
if only.upscale then
  local S = opts.quick and 128 or 256
  local upath = tmpdir .. "/kiln-bench-rrdb-x4-f32.safetensors"
  local upscaler = require "kiln.upscaler"
  local cfg = { nf = 64, gc = 32, nb = 23, steps = 2, in_nc = 3, out_nc = 3 }
  if not io.open(upath, "rb") then
    local t = {}
    for i, e in ipairs(upscaler.expected("RRDBNet", cfg)) do
      local sh, r = e[2], kiln.randn(e[2], { seed = 500 + i })
      t[e[1]] = #sh == 4 and r * (1 / math.sqrt(sh[2] * sh[3] * sh[4])) or r * 0.02
      r:free()
    end
    kiln.save_safetensors(upath, t)
    for _, v in pairs(t) do v:free() end
  end
  local up <close> = kiln.load_upscaler(upath)
  up:load("cpu")
  local r = kiln.randn({ 1, 3, S, S }, { seed = 21 })
  local x = r * 0.25 + 0.5 -- the same values torch_sd.py makes
  r:free()
  -- multiply-adds per output pixel of each 3x3 conv, at its resolution
  local nf, gc = cfg.nf, cfg.gc
  local lr = 9 * (3 * nf + nf * nf)
  for c = 1, 5 do lr = lr + 3 * cfg.nb * 9 * (nf + (c - 1) * gc) * (c < 5 and gc or nf) end
  local flops = 2 * S * S * (lr + 4 * 9 * nf * nf + 16 * 9 * (2 * nf * nf + nf * 3))
  local uout = tmpdir .. "/kiln-bench-upscale-torch-out.safetensors"
  say("\nUpscale: RRDBNet x4 (23 blocks, 64 features, growth 32, f32) on %dx%d -> %dx%d, %.2f TFLOP", S, S, 4 * S,
    4 * S, flops / 1e12)
  local sec, out, cpu, tr = time_around(REPEAT, function() return up:forward(x) end,
    function() return torch_run(upath, "upscale", fmt("--size %d", S), uout) end)
  local peak = kiln.mem.stats("cpu").peak
  local err = tr and rel_err(out, kiln.load_safetensors(uout).out)
  row(fmt("upscale rrdb x4 %dx%d", S, S), sec, cpu, flops, peak, tr, err, vm_hwm())
  upscale_row = { sec = sec, cpu = cpu, torch = tr }
  out:free(); x:free()
  os.remove(uout)
  if opts.clean then os.remove(upath) end
end

-- 6. partial residency: one UNet evaluation on sim with 0 / 25 / 50 / 75 / 100 % of its
-- bytes resident (part:load(dev, {resident = bytes}): the largest blocks stay, the rest
-- streams), each measured alternately after a first forward that fetches the resident
-- blocks; copied_in = host -> sim bytes per evaluation (the inputs included)
local residency_rows
if only.residency and has_sim then
  say("\nOne UNet evaluation on sim (batch 1, %dx%d) by resident share (the rest streamed)", SIZE, SIZE)
  local x, t, ctx = inputs(1, SIZE)
  local flops = unet_flops(ucfg, 1, SIZE, SIZE, 77)
  local total = ck.unet.streamer:total_bytes(ck.unet.model)
  local shares = { 0, 0.25, 0.5, 0.75, 1 }
  residency_rows = {}
  for _, f in ipairs(shares) do residency_rows[f] = { sec = math.huge } end
  kiln.memory_mode("normal")
  for round = 1, REPEAT do
    for _, f in ipairs(shares) do
      collectgarbage(); collectgarbage()
      ck.unet:load("sim", { resident = f < 1 and math.floor(total * f) or nil })
      local first = ck.unet:forward(x, t, ctx)   -- fetches what stays resident
      first:free()
      kiln.mem.reset_peak("sim")
      local sec, out, cpu = time_best(1, function() return ck.unet:forward(x, t, ctx) end, 0)
      local st = kiln.mem.stats("sim")
      out:free()
      local _, kept = ck.unet.streamer:resident_blocks(ck.unet.model)
      ck.unet:unload()
      kiln.mem.empty_cache("sim")
      local r = residency_rows[f]
      if sec < r.sec then r.sec, r.cpu = sec, cpu end
      r.copied, r.peak, r.kept = st.copied_in, st.peak - 0, f < 1 and kept or total
    end
  end
  for _, f in ipairs(shares) do
    local r = residency_rows[f]
    row(fmt("unet step, %d%% resident (%s kept, %s copied in)", math.floor(f * 100 + 0.5), human(r.kept),
      human(r.copied)), r.sec, r.cpu, flops, r.peak, nil, nil)
  end
  local rr = residency_rows[0.75].sec / residency_rows[1].sec
  say("  75%% resident / all resident: time x%.3f (target <= 1.05 %s); streamed 0%%: x%.3f", rr,
    rr <= 1.05 and "met" or "NOT met", residency_rows[0].sec / residency_rows[1].sec)
  x:free(); t:free(); ctx:free()
end

-- A budget lowered live (as a host's kiln_memory_set_budget from its thread) in the
-- middle of a UNet evaluation on sim, mode normal, the UNet resident: at the next block
-- it turns to streaming; the time from the change to compliance (reserved within the
-- new budget), the evaluation against an undisturbed one, the same output. Opt-in
-- (--only live): its numbers go with the suspend / resume latencies of test_live.
if only.live and has_sim then
  say("\nA budget lowered live in the middle of a UNet evaluation on sim (batch 1, %dx%d)", SIZE, SIZE)
  local x, t, ctx = inputs(1, SIZE)
  kiln.memory_mode("normal")
  kiln.mem.set_budget("sim", 0)
  ck.unet:load("sim")
  local warm = ck.unet:forward(x, t, ctx)
  warm:free()
  kiln.mem.reset_peak("sim")
  local sec_ref, ref, cpu_ref = time_best(1, function() return ck.unet:forward(x, t, ctx) end, 0)
  local peak_ref = kiln.mem.stats("sim").peak_reserved
  local _, window = ck.unet.streamer:_sizes(ck.unet.model)
  -- what a streamed evaluation needs: the activations and two blocks' weights
  local low = peak_ref - ck.unet:bytes("sim") + window + 64 * MiB
  local sp, n = kiln.suspend_point, 0
  kiln.suspend_point = function()
    n = n + 1
    if n == 4 then kiln.mem.set_budget("sim", low, { live = true }) end
    return sp()
  end
  local ok, sec, out, cpu = pcall(time_best, 1, function() return ck.unet:forward(x, t, ctx) end, 0)
  kiln.suspend_point = sp
  local w = kiln.mem.budget_watch("sim")
  kiln.mem.set_budget("sim", 0)
  if not ok then
    say("  failed: %s", tostring(sec))
  else
    local d = out:to("cpu") - ref:to("cpu")
    local same = d:max() == 0 and d:min() == 0
    d:free()
    row("unet step, undisturbed", sec_ref, cpu_ref, unet_flops(ucfg, 1, SIZE, SIZE, 77), peak_ref, nil, nil)
    row(fmt("unet step, lowered to %s at block 4", human(low)), sec, cpu, unet_flops(ucfg, 1, SIZE, SIZE, 77),
      w.peak_since, nil, nil)
    say("  lowered to compliance: %s; peak after it %s of %s; same output: %s",
      w.compliance_seconds and fmt("%.1f ms", w.compliance_seconds * 1000) or "never", human(w.peak_since),
      human(low), tostring(same))
    out:free()
  end
  ref:free()
  ck.unet:unload()
  x:free(); t:free(); ctx:free()
end

-- 6. a ComfyUI graph (kiln.comfy): hires fix + LoRA + ControlNet on the SD 1.5-shaped
-- weights, low mode on sim inside --comfy-budget: the peak with results freed at their
-- last reader against the same graph keeping every result (ComfyUI's way)
if only.comfy and has_sim then
  local comfy = require "kiln.comfy"
  local lfs = require "lfs"
  local cpath, keys = controlnet_file()
  if not cpath then
    say("\nComfyUI graph: skipped (no %s)", keys)
  else
    local root = tmpdir .. "/kiln-bench-comfy"
    local function abs(p) return p:sub(1, 1) == "/" and p or lfs.currentdir() .. "/" .. p end
    for _, d in ipairs({ "", "/models", "/models/checkpoints", "/models/loras", "/models/controlnet", "/models/input", "/out" }) do
      lfs.mkdir(root .. d)
    end
    local function link(src, dst) os.remove(dst); assert(lfs.link(abs(src), dst, true)) end
    link(path, root .. "/models/checkpoints/sd15.safetensors")
    link(cpath, root .. "/models/controlnet/cn.safetensors")
    local lpath = root .. "/models/loras/lr.safetensors"
    if not io.open(lpath) then make_lora(lpath, 16) end
    local S1 = SIZE // 2  -- the first pass at half the size, the second at SIZE latents
    kiln.save_png(kiln.rand({ 1, 3, 8 * SIZE, 8 * SIZE }, { seed = 13 }), root .. "/models/input/hint.png")
    local g = {
      ["1"] = { class_type = "CheckpointLoaderSimple", inputs = { ckpt_name = "sd15.safetensors" } },
      ["2"] = { class_type = "LoraLoader", inputs = { model = { "1", 0 }, clip = { "1", 1 }, lora_name = "lr.safetensors",
        strength_model = 0.8, strength_clip = 0.8 } },
      ["3"] = { class_type = "CLIPTextEncode", inputs = { clip = { "2", 1 }, text = "a photograph of an astronaut riding a horse" } },
      ["4"] = { class_type = "CLIPTextEncode", inputs = { clip = { "2", 1 }, text = "blurry" } },
      ["5"] = { class_type = "ControlNetLoader", inputs = { control_net_name = "cn.safetensors" } },
      ["6"] = { class_type = "LoadImage", inputs = { image = "hint.png" } },
      ["7"] = { class_type = "ControlNetApplyAdvanced", inputs = { positive = { "3", 0 }, negative = { "4", 0 },
        control_net = { "5", 0 }, image = { "6", 0 }, strength = 0.8, start_percent = 0, end_percent = 1 } },
      ["8"] = { class_type = "EmptyLatentImage", inputs = { width = 8 * S1, height = 8 * S1, batch_size = 1 } },
      ["9"] = { class_type = "KSampler", inputs = { model = { "2", 0 }, positive = { "7", 0 }, negative = { "7", 1 },
        latent_image = { "8", 0 }, seed = 1, steps = 1, cfg = 7, sampler_name = "euler", scheduler = "normal", denoise = 1 } },
      ["10"] = { class_type = "LatentUpscaleBy", inputs = { samples = { "9", 0 }, upscale_method = "bilinear", scale_by = 2 } },
      ["11"] = { class_type = "KSampler", inputs = { model = { "2", 0 }, positive = { "7", 0 }, negative = { "7", 1 },
        latent_image = { "10", 0 }, seed = 2, steps = 1, cfg = 7, sampler_name = "euler", scheduler = "normal", denoise = 0.5 } },
      ["12"] = { class_type = "VAEDecodeTiled", inputs = { samples = { "11", 0 }, vae = { "1", 2 }, tile_size = 256, overlap = 64 } },
      ["13"] = { class_type = "SaveImage", inputs = { images = { "12", 0 }, filename_prefix = "bench" } },
    }
    local budget = math.floor(opts.comfy_budget * MiB)
    say("\nComfyUI graph on sim, mode low, budget %s: LoRA, ControlNet, KSampler %dx%d, LatentUpscaleBy 2, " ..
      "KSampler %dx%d at 0.5, VAEDecodeTiled, SaveImage", human(budget), 8 * S1, 8 * S1, 8 * SIZE, 8 * SIZE)
    kiln.memory_mode("low")
    ck.unet:unload(); ck.clip:unload(); ck.vae:unload()
    local old_budget = kiln.mem.stats("sim").budget
    kiln.mem.set_budget("sim", budget)
    local _, plan = comfy.run(g, { models = root .. "/models", output = root .. "/out", dry_run = true, device = "sim" })
    say("  dry run:\n    %s", plan.text:gsub("\n", "\n    "))
    if plan.plan.meta then say("  predicted on meta (kiln.dry_run): peak %s", human(plan.plan.meta.peak)) end
    for _, keep in ipairs({ false, true }) do
      collectgarbage(); collectgarbage()
      kiln.mem.empty_cache("sim")
      kiln.mem.reset_peak("sim") -- comfy.run leaves the device's counter to its host
      local t0 = kiln.time()
      local ok, files, rep = pcall(comfy.run, g, { models = root .. "/models", output = root .. "/out", device = "sim",
        quiet = true, keep_all = keep })
      local peak_reserved = kiln.mem.stats("sim").peak_reserved
      if ok then
        for _, f in ipairs(files) do os.remove(f) end
        local worst = { peak = 0 }
        for _, n in ipairs(rep.nodes) do if n.peak > worst.peak then worst = n end end
        say("  %-26s peak %s (node %s %s), %.1f s: %s", keep and "keeping every result:" or "liveness (the default):",
          human(rep.peak), worst.id, worst.class_type, kiln.time() - t0,
          rep.peak <= budget and "inside the budget" or "EXCEEDED")
      else
        say("  %s FAILED: %s (peak reserved %s)", keep and "keep-all" or "liveness", tostring(files), human(peak_reserved))
      end
    end
    kiln.mem.set_budget("sim", old_budget)
    kiln.memory_mode("normal")
  end
end

-- ---------------------------------------------------------------- summary

say("\n| stage | kiln s (cpu s) | GFLOP/s | kiln peak alloc / RSS | torch s (cpu s) | torch RSS | kiln/torch wall (cpu) | rel.err |")
say("|---|---|---|---|---|---|---|---|")
for _, r in ipairs(results) do
  local tr = r.torch
  say("| %s | %.2f (%.2f) | %.1f | %s / %s | %s | %s | %s | %s |", r.name, r.sec, r.cpu,
    r.flops and r.flops / r.sec / 1e9 or 0, human(r.peak), human(r.rss), tr and fmt("%.2f (%.2f)", tr.sec, tr.cpu or 0) or "-",
    tr and human(tr.peak_rss) or "-", tr and fmt("%.3f (%.3f)", r.sec / tr.sec, r.cpu / (tr.cpu or 1)) or "-",
    r.err and fmt("%.1e", r.err) or "-")
end
say("\nFLOP per evaluation: unet b1 %.3f TFLOP, vae decode %.3f TFLOP, clip-l %.1f GFLOP",
  unet_flops(ucfg, 1, SIZE, SIZE, 77) / 1e12, vae_decode_flops(ck.vae.config, SIZE, SIZE) / 1e12,
  clip_flops(ck.clip.encoders[1].enc.config, 1, 77) / 1e9)
say("targets: unet and vae decode <= 0.25x torch, peak RSS below torch's; low <= 1.3x high; pipeline piece within %d MiB",
  opts.budget)
-- The f32 multiply-add rate kiln's GEMM reaches in this run (2048^3, best of 5): the
-- hardware yardstick next to the PyTorch ratio. A stage's FLOP at this rate is the time
-- direct arithmetic needs; only the Winograd convolutions do fewer multiplications, so
-- a stage cannot go much below it in f32 (PyTorch's time moved by up to 40% between
-- runs minutes apart; this does not move with it).
-- The same product in bf16 (stage bf16 ran): the machine's own ratio of the two
-- precisions' arithmetic, which the networks' ratios approach as the products dominate.
local function gemm_rate(precision)
  local n = 2048
  local a, w = kiln.randn({ n, n }, { seed = 1 }), kiln.randn({ n, n }, { seed = 2 })
  kiln.precision(precision)
  local best = time_best(5, function() return kiln.nn.linear(a, w) end)
  kiln.precision("auto")
  a:free(); w:free()
  return 2 * n * n * n / best
end
local rate = gemm_rate("f32")
say("f32 GEMM rate in this run (kiln.nn.linear, 2048^3, best of 5): %.0f GFLOP/s", rate / 1e9)
if only.bf16 or only.bf16_e2e then
  local rate16 = gemm_rate("bf16")
  say("bf16 GEMM rate in this run (the same product under kiln.precision(\"bf16\")): %.0f GFLOP/s, x%.3f the f32 time",
    rate16 / 1e9, rate / rate16)
end
-- The verdict on each timed stage with a PyTorch run. RSS only for the UNet on mapped f16
-- weights: this one process also keeps the pages of the stages before it (the mapped
-- UNet under the VAE row, both weight copies under the f32 row), PyTorch runs each alone.
for _, r in ipairs(results) do
  local tr = r.torch
  if tr and (r.name:find("^unet b") or r.name:find("^vae decode")) then
    local x = r.sec / tr.sec
    local rss = r.name:find("f16 mapped") and r.rss and tr.peak_rss
    -- the issue's absolute reading of the target: PyTorch then took 37-41 s, so 0.25x
    -- was "about 9 s" for one batch-1 evaluation at 64x64
    local abs = r.name:find("^unet b1 64x64") and fmt(", %.2f s vs the issue's 'about 9 s' %s", r.sec,
      r.sec <= 9 and "(met)" or "(NOT met)") or ""
    say("  %s: x%.3f %s%s%s; %.2fx the time its FLOP take at the GEMM rate", r.name, x,
      x <= 0.25 and "(met)" or "(NOT met)", abs,
      rss and fmt(", RSS %s vs %s %s", human(r.rss), human(tr.peak_rss),
        r.rss < tr.peak_rss and "(met)" or "(NOT met)") or "", r.flops and r.sec / (r.flops / rate) or 0)
  end
end
if mode_rows.low then say("  low/high: x%.3f", mode_rows.low.sec / mode_rows.high.sec) end
if control_rows then
  say("  controlled CFG step / uncontrolled x%.3f (target <= 1.5)", control_rows.with.sec / control_rows.without.sec)
end
if preview_rows then
  say("  previews: latent->rgb %.3f ms per step (target <= 1 ms), TAESD decode %.1f %% of an f32 CFG step in the "
    .. "previews' %s (target <= 5 %%), %.1f %% in f32", preview_rows.l2r * 1e3,
    100 * preview_rows.taesd / preview_rows.step, preview_rows.prec, 100 * preview_rows.taesd32 / preview_rows.step)
end
if upscale_row and upscale_row.torch then
  local tr = upscale_row.torch
  say("  upscale RRDBNet x4: x%.3f of torch's time (cpu x%.3f) (target <= 0.5 %s)", upscale_row.sec / tr.sec,
    upscale_row.cpu / (tr.cpu or 1), upscale_row.sec / tr.sec <= 0.5 and "met" or "NOT met")
end
if lora_rows then
  say("  LoRA apply %.2f s (target <= 1.5 s), low-mode step with / without x%.3f (target <= 1.15)", lora_rows.apply,
    lora_rows.with.sec / lora_rows.without.sec)
end
if pipe then say("  512 MiB budget: %s", pipe.ok and (pipe.peak <= pipe.budget and "respected" or "exceeded") or "failed") end
say("# load average at end %s", loadavg())
os.remove(out_path)
ck:close()
if opts.clean and opts.weights == "" then os.remove(path) end
