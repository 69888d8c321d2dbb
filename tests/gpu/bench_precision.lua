-- tests/gpu/bench_precision.lua - the SD 1.5-architecture UNet step (batch 2,
-- 512x512 -> 64x64 latents) and VAE decode (512x512) on a GPU in each precision
-- (kiln.precision f32, f16, bf16): time per call, it/s, and the activation peak (the
-- device's peak above the weights and inputs) with its ratio to f32's. Random weights
-- made on the device in the precision's dtype (no checkpoint needed); the inputs are
-- f32 as a sampler hands them, the networks convert at their edges. Run by
-- tests/gpu/run.sh. Usage: kiln tests/gpu/bench_precision.lua [device] [precisions...]
local kiln = require "kiln"
local unet, vae = require "kiln.unet", require "kiln.vae"
local stream = require "kiln.stream"

local dev = arg[1] or "cuda:0"
local precs = {}
for i = 2, #arg do precs[#precs + 1] = arg[i] end
if #precs == 0 then precs = { "f32", "f16", "bf16" } end
kiln.set_quiet(true)

local function numel(s) local n = 1 for _, d in ipairs(s) do n = n * d end return n end
local pool = kiln.randn({ 32 * 1024 * 1024 }, { seed = 1 }):to(dev)

-- every weight a scaled copy of a slice of the pool, in dtype dt
local function make(list, dt)
  local W, bytes = {}, 0
  for _, e in ipairs(list) do
    local shape = e[2]
    local n = numel(shape)
    local v = pool:narrow(1, 1, n)
    local r = v:reshape(shape)
    local s = r * (1 / math.sqrt(math.max(n // shape[1], 1)))
    W[e[1]] = s.dtype == dt and s or s:to(dt)
    if W[e[1]] ~= s then s:free() end
    v:free(); r:free()
    bytes = bytes + W[e[1]]:nbytes()
  end
  return W, bytes
end

local function weights(W)
  local store = { tensor = function(_, name)
    local t = W[name] or error("bench: no tensor " .. name)
    return t:reshape(t.shape) -- a new handle: networks free the handles they are given
  end }
  return stream.weights and stream.weights(store, "") or store
end

local function free_all(W) for _, t in pairs(W) do t:free() end end
local function sync(t) local h = t:to("cpu"); h:free() end -- device->host waits for the compute stream

-- ms per call and the peak above what was allocated before the timed calls
local function bench(fn, iters)
  local r = fn(); sync(r); r:free() -- warm-up: cuDNN/cuBLAS choices, first allocations
  collectgarbage(); collectgarbage()
  local base = kiln.mem.stats(dev).allocated
  kiln.mem.reset_peak(dev)
  local t0 = kiln.time()
  for i = 1, iters do r = fn(); if i < iters then r:free() end end
  sync(r); r:free()
  local ms = (kiln.time() - t0) / iters * 1000
  return ms, kiln.mem.stats(dev).peak - base
end

local ucfg = { model_channels = 320, in_channels = 4, out_channels = 4, time_embed_dim = 1280, num_res_blocks = 2,
  levels = 4, channel_mult = { 1, 2, 4, 4 }, attention = { true, true, true, false }, transformer_depth = { 1, 1, 1, 0 },
  transformer_depth_middle = 1, context_dim = 768, linear_proj = false, heads = 8 }
local vcfg = { has_encoder = false, has_decoder = true, z_channels = 4, levels = 4, num_res_blocks = 2, out_ch = 3,
  ch = 128, ch_mult = { 1, 2, 4, 4 }, embed_dim = 4, in_channels = 3, factor = 8, scale_factor = 0.18215, shift_factor = 0 }
-- KILN_BENCH_TINY=1: the same networks 10x narrower on 16x16 latents (checks this
-- script on the CPU emulation of CUDA; its numbers mean nothing)
local LAT, CTX = 64, 768
local TINY = os.getenv("KILN_BENCH_TINY") == "1"
if TINY then
  ucfg.model_channels, ucfg.time_embed_dim, ucfg.context_dim, ucfg.heads = 32, 128, 64, 2
  vcfg.ch = 32
  LAT, CTX = 16, 64
end

local first, ratios = {}, {}
local function report(what, p, act, ms, peak, wbytes)
  first[what] = first[what] or peak
  if act ~= "f32" and precs[1] == "f32" and not TINY then ratios[#ratios + 1] = { what = what, p = p, r = peak / first[what] } end
  local line = ("  %-34s %-5s (act. %-4s) %8.1f ms %7.2f it/s   weights %6.0f MiB   activation peak %7.0f MiB (x%.2f)")
    :format(what, p, act, ms, 1000 / ms, wbytes / 2^20, peak / 2^20, peak / first[what])
  print(line)
end

local prev = kiln.precision()
for _, p in ipairs(precs) do
  kiln.precision(p)
  local act = kiln.activation_dtype(dev)
  local wdt = act -- the weights in the activations' dtype, as a half network loads them
  local ok, err = pcall(function()
    local W, bytes = make(unet.expected(ucfg), wdt)
    local u = unet.new(weights(W), ucfg)
    local x = kiln.randn({ 2, 4, LAT, LAT }, { seed = 2 }):to(dev)
    local ctx = kiln.randn({ 2, 77, CTX }, { seed = 3 }):to(dev)
    local t = kiln.tensor({ 999, 999 })
    local ms, peak = bench(function() return u:forward(x, t, ctx) end, 3)
    report("UNet step (SD 1.5, batch 2, 64x64)", p, act, ms, peak, bytes)
    x:free(); ctx:free(); t:free(); free_all(W)
  end)
  if not ok then print(("  UNet %s failed: %s"):format(p, tostring(err))) end
  ok, err = pcall(function()
    local W, bytes = make(vae.expected(vcfg), wdt)
    local v = vae.new(weights(W), vcfg)
    local z = kiln.randn({ 1, 4, LAT, LAT }, { seed = 4 }):to(dev)
    local ms, peak = bench(function() return v:decode_raw(z) end, 2)
    report("VAE decode (512x512)", p, act, ms, peak, bytes)
    z:free(); free_all(W)
  end)
  if not ok then print(("  VAE %s failed: %s"):format(p, tostring(err))) end
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache(dev)
end
kiln.precision(prev)
pool:free()
-- half activations take half the bytes: allow a little for the f32 inputs and outputs
-- at the edges and the f32 statistics of the norms
local failed = false
for _, r in ipairs(ratios) do
  if r.r > 0.6 then
    print(("FAIL %s in %s: activation peak %.2f of f32's (expected about 0.5)"):format(r.what, r.p, r.r))
    failed = true
  end
end
if failed then os.exit(1) end
