-- tests/bench/bench_flux_schnell.lua - a 4-step Flux.1 [schnell] txt2img end to end
-- (kiln.pipeline.txt2img: T5-XXL encodes and unloads, CLIP-L encodes and unloads, the
-- transformer samples 4 euler steps, the 16-channel autoencoder decodes) on random
-- full-size-shaped weights: the time of each stage, the device's peak beside the meta
-- device's prediction of it (a dry run of the same call, run first), and the process's
-- peak RSS, its anonymous part (the memory it holds) and its mapped file pages (the
-- weight files read through, which the kernel drops under pressure) sampled every 0.5 s.
--
--   build/kiln tests/bench/bench_flux_schnell.lua [--size 512] [--device sim] [--mode low]
--       [--budget 2048] [--dit q8_0] [--t5 fp8] [--double 19] [--single 38] [--t5_blocks 24]
--       [--threads 2] [--dir DIR] [--fresh] [--clean] [--no-dry] [--write-only]
--
-- The weights are written once into DIR (default $TMPDIR/kiln-bench-flux) by
-- tests/bench/flux_weights.lua's pool writer, at the disk's speed: the transformer
-- [schnell]-shaped (no guidance_in; --dit q8_0: city96's GGUF, 12.6 GB; fp8: e4m3fn
-- safetensors, 11.9 GB; bf16: 23.8 GB), T5-XXL with ComfyUI's t5xxl names (--t5 fp8:
-- t5xxl_fp8_e4m3fn-shaped, 4.8 GB; f16: t5xxl_fp16-shaped, 9.5 GB), CLIP-L (f16,
-- 0.25 GB) and the autoencoder's decoder (f16, 0.1 GB). --double / --single /
-- --t5_blocks make a smaller model of the same widths (a quick run of this script);
-- --write-only writes the files and stops (write them outside the benchmark's locks).
-- --device cpu with --budget runs inside a cpu budget instead of a sim one. Run
-- full-size benchmarks under flock /tmp/kiln-bigmem.lock, timed ones under flock
-- /tmp/kiln-bench.lock.
local kiln = require "kiln"
local util = require "kiln.util"
local vae = require "kiln.vae"
local clip = require "kiln.clip"
local pipeline = require "kiln.pipeline"
local fw = dofile("tests/bench/flux_weights.lua")

local o = util.parse_args(arg or {}, { size = 512, device = "sim", mode = "low", budget = 2048, dit = "q8_0",
  t5 = "fp8", double = 19, single = 38, t5_blocks = 24, threads = 2, dir = "", fresh = false, clean = false,
  no_dry = false, write_only = false })
local fmt = string.format
local ps = dofile("tests/bench/proc_stats.lua")
local say, loadavg = ps.say, ps.loadavg
local MiB = 1024 * 1024
if o.device ~= "sim" and o.device ~= "cpu" then error("bench_flux_schnell: --device must be sim or cpu", 0) end
local T5_MATRIX = { fp8 = "F8_E4M3", f16 = "F16" }
if not T5_MATRIX[o.t5] then error("bench_flux_schnell: --t5 must be fp8 or f16", 0) end

kiln.set_quiet(true)
kiln.set_threads(o.threads)
local dir = o.dir ~= "" and o.dir or ((os.getenv("TMPDIR") or "/tmp") .. "/kiln-bench-flux")
os.execute("mkdir -p '" .. dir .. "'")

local function status()
  local r = {}
  for line in io.lines("/proc/self/status") do
    local k, kb = line:match("^(%a+):%s*(%d+) kB")
    if k then r[k] = tonumber(kb) * 1024 end
  end
  return r
end

local function exists(p)
  local f = io.open(p, "rb")
  if f then f:close() end
  return f ~= nil
end

-- ---------------------------------------------------------------- the files

local EXT = { q8_0 = "gguf", fp8 = "safetensors", bf16 = "safetensors" }
if not EXT[o.dit] then error("bench_flux_schnell: --dit must be q8_0, fp8 or bf16", 0) end
local DIT = fmt("%s/flux1-schnell-%s-%d-%d.%s", dir, o.dit, o.double, o.single, EXT[o.dit])
local AE = dir .. "/ae-decoder-f16.safetensors"
local CLIP = dir .. "/clip_l-f16.safetensors"
local T5 = fmt("%s/t5xxl-%s-%d.safetensors", dir, o.t5, o.t5_blocks)

local function wrote(path, bytes, s) say("wrote %s: %.2f GB in %.1f s", path, bytes / 1e9, s) end

if o.fresh or not exists(DIT) then
  wrote(DIT, fw.write(o.dit, DIT, fw.config(o.double, o.single, true)))
end
local function write_st(path, list, matrix, vector, meta)
  local t0 = kiln.time()
  wrote(path, fw.write_safetensors(path, list, { matrix = matrix, vector = vector, meta = meta }), kiln.time() - t0)
end
if o.fresh or not exists(AE) then
  write_st(AE, vae.expected({ has_decoder = true, quant = false, ch = 128, ch_mult = { 1, 2, 4, 4 },
    num_res_blocks = 2, z_channels = 16, embed_dim = 16, out_ch = 3, levels = 4 }), "F16", "F16")
end
if o.fresh or not exists(CLIP) then
  write_st(CLIP, clip.expected({ layout = "hf", width = 768, layers = 12, mlp = 3072, vocab = 49408,
    positions = 77, heads = 12 }), "F16", "F16")
end
if o.fresh or not exists(T5) then
  local D, HEADS, FF = 4096, 64, 10240
  local list = { { "shared.weight", { 32128, D } } }
  for b = 0, o.t5_blocks - 1 do
    local p = fmt("encoder.block.%d.layer.", b)
    for _, n in ipairs({ "q", "k", "v", "o" }) do list[#list + 1] = { p .. "0.SelfAttention." .. n .. ".weight", { D, D } } end
    if b == 0 then list[#list + 1] = { p .. "0.SelfAttention.relative_attention_bias.weight", { 32, HEADS } } end
    list[#list + 1] = { p .. "0.layer_norm.weight", { D } }
    list[#list + 1] = { p .. "1.DenseReluDense.wi_0.weight", { FF, D } }
    list[#list + 1] = { p .. "1.DenseReluDense.wi_1.weight", { FF, D } }
    list[#list + 1] = { p .. "1.DenseReluDense.wo.weight", { D, FF } }
    list[#list + 1] = { p .. "1.layer_norm.weight", { D } }
  end
  list[#list + 1] = { "encoder.final_layer_norm.weight", { D } }
  write_st(T5, list, T5_MATRIX[o.t5], o.t5 == "fp8" and "BF16" or "F16", { num_heads = tostring(HEADS) })
end

if o.write_only then return end

-- ---------------------------------------------------------------- the run

-- The process's RssAnon and RssFile every 0.5 s, from a shell loop that ends with the process.
local pid = io.open("/proc/self/stat"):read("l"):match("^(%d+)")
local SAMPLES = fmt("%s/rss-%s.txt", dir, pid)
os.execute(fmt("sh -c 'while [ -d /proc/%s ]; do grep -E \"^Rss(Anon|File):\" /proc/%s/status 2>/dev/null; " ..
  "sleep 0.5; done' > '%s' 2>/dev/null &", pid, pid, SAMPLES))
local function sampled_peaks()
  local anon, file, total, a = 0, 0, 0, 0
  for line in io.lines(SAMPLES) do
    local k, kb = line:match("^Rss(%a+):%s*(%d+)")
    local v = tonumber(kb or 0) * 1024
    if k == "Anon" then a = v; anon = math.max(anon, v)
    elseif k == "File" then file = math.max(file, v); total = math.max(total, a + v) end
  end
  return anon, file, total
end

kiln.memory_mode(o.mode)
kiln.set_default_device(o.device)
local budget = o.budget > 0 and o.budget * MiB or nil
if budget then kiln.mem.set_budget(o.device, budget) end
local ck <close> = kiln.load_checkpoint(DIT, { vae = AE, clip = CLIP, t5 = T5, variant = "schnell" })
say("Flux.1 [schnell]-shaped, %dx%d, 4 euler steps; %s transformer (%d double + %d single blocks), T5-XXL %s " ..
  "(%d blocks), CLIP-L f16, AE f16; memory mode %s on %s, budget %s; %d threads", o.size, o.size, o.dit, o.double,
  o.single, o.t5, o.t5_blocks, o.mode, o.device, budget and fmt("%d MiB", o.budget) or "none", kiln.threads())

local prompt = "a photo of a cat on a red sofa"
local function run(callback)
  return pipeline.txt2img(ck, { prompt = prompt, seed = 1, width = o.size, height = o.size, device = o.device,
    callback = callback })
end

local predicted, predicted_stage = nil, {}
if not o.no_dry then
  local r = kiln.dry_run(function()
    local img = run(function() end) -- a callback as the real run's: the pipeline hands it the step's tensors
    img:free()
  end, { device = o.device, budget = budget, mode = o.mode })
  predicted = r.peak
  say("  dry run (meta): predicted peak %.1f MiB (reserved %.1f), %s, %.2f s", r.peak / MiB, r.peak_reserved / MiB,
    r.fits and "fits" or ("does not fit: " .. tostring(r.oom)), r.seconds)
  for _, s in ipairs(r.stages or {}) do predicted_stage[s.name] = s.peak end
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache(o.device)
end

-- The stages' times: T5's and CLIP's encodes (their streamed loads included), each
-- sampling step (the first with the transformer's placement), the decode.
local times, t_encode = {}, {}
local function timed(obj, method, key)
  local f = obj[method]
  obj[method] = function(...)
    local t0 = kiln.time()
    local r = table.pack(f(...))
    t_encode[key] = (t_encode[key] or 0) + kiln.time() - t0
    return table.unpack(r, 1, r.n)
  end
end
timed(ck.t5, "encode", "T5-XXL encode")
timed(ck.clip, "encode", "CLIP-L encode")
local span = kiln.trace.span
local stage_t, stage_peak, step_t, last, run_peak = {}, {}, {}, nil, 0
kiln.trace.span = function(name, f, ...)
  if name ~= "encode" and name ~= "sample" and name ~= "decode" then return span(name, f, ...) end
  -- each stage's own peak: the counter restarts with the stage (the run's peak kept aside)
  run_peak = math.max(run_peak, kiln.mem.stats(o.device).peak)
  kiln.mem.reset_peak(o.device)
  local t0 = kiln.time()
  if name == "sample" then last = t0 end
  return (function(...)
    stage_t[name] = kiln.time() - t0
    stage_peak[name] = kiln.mem.stats(o.device).peak
    run_peak = math.max(run_peak, stage_peak[name])
    return ...
  end)(span(name, f, ...))
end
local function on_step(st)
  local now = kiln.time()
  step_t[#step_t + 1] = now - last
  last = now
end

kiln.mem.reset_peak(o.device)
local la0 = loadavg()
local t0 = kiln.time()
local ok, err = pcall(function()
  local img = run(on_step)
  img:free()
end)
local total = kiln.time() - t0
kiln.trace.span = span
if not ok then error(err, 0) end
local peak = math.max(run_peak, kiln.mem.stats(o.device).peak)
local st = status()
local anon, file, both = sampled_peaks()
local function peaks(name)
  local p = predicted_stage[name]
  return fmt("; %s peak %.1f MiB%s", o.device, (stage_peak[name] or 0) / MiB,
    p and fmt(", predicted %.1f MiB", p / MiB) or "")
end
say("  T5-XXL encode  %7.1f s", t_encode["T5-XXL encode"] or 0)
say("  CLIP-L encode  %7.1f s", t_encode["CLIP-L encode"] or 0)
say("  encode stage   %7.1f s (both, with their loads and unloads)%s", stage_t.encode or 0, peaks("encode"))
for i, s in ipairs(step_t) do say("  step %d         %7.1f s%s", i, s, i == 1 and " (with the transformer's placement)" or "") end
say("  sample stage   %7.1f s%s", stage_t.sample or 0, peaks("sample"))
say("  AE decode      %7.1f s%s", stage_t.decode or 0, peaks("decode"))
say("total %.1f s; %s peak %.1f MiB%s (budget %s); peak RSS %.0f MiB (VmHWM); sampled every 0.5 s: anonymous " ..
  "%.0f MiB, mapped file pages %.0f MiB, both %.0f MiB; load average %s before, %s after", total, o.device,
  peak / MiB, predicted and fmt(", dry run predicted %.1f MiB (x%.4f)", predicted / MiB, predicted / peak) or "",
  budget and fmt("%d MiB", o.budget) or "none", (st.VmHWM or 0) / MiB, anon / MiB, file / MiB, both / MiB, la0,
  loadavg())
os.remove(SAMPLES)
if o.clean then
  for _, p in ipairs({ DIT, AE, CLIP, T5 }) do os.remove(p) end
end
