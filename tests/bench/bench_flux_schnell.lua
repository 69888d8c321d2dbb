-- tests/bench/bench_flux_schnell.lua - a 4-step Flux.1 [schnell] txt2img end to end
-- (kiln.pipeline.txt2img: T5-XXL and CLIP-L encode, then unload; the transformer
-- samples 4 euler steps; the 16-channel autoencoder decodes) on random full-size
-- weights: time per stage, the device's peak (sim, inside --budget MiB in memory mode
-- --mode) and the process's peak RSS.
--
--   build/kiln tests/bench/bench_flux_schnell.lua [--size 512] [--mode low] [--budget 2048]
--       [--double 19] [--single 38] [--t5_blocks 24] [--threads 2] [--dir DIR] [--fresh] [--clean]
--
-- The weights (BFL's flux1-schnell / ae.safetensors names and shapes, ComfyUI's clip_l and
-- t5xxl_fp16 names; bf16 for the transformer, f16 for the rest) are written once into
-- DIR (default $TMPDIR/kiln-bench-flux: about 24 GB for the transformer, 9.5 GB for T5,
-- 0.25 GB for CLIP-L, 0.1 GB for the decoder at full size) tensor by tensor, so writing
-- never holds more than one tensor; --double / --single / --t5_blocks make a smaller
-- model of the same widths (a quick run of this script). Run full-size benchmarks under
-- flock /tmp/kiln-bigmem.lock.
local kiln = require "kiln"
local util = require "kiln.util"
local flux = require "kiln.flux"
local vae = require "kiln.vae"
local clip = require "kiln.clip"
local pipeline = require "kiln.pipeline"
local rw = dofile("tests/bench/random_weights.lua")

local o = util.parse_args(arg or {}, { size = 512, mode = "low", budget = 2048, double = 19, single = 38,
  t5_blocks = 24, threads = 2, dir = "", fresh = false, clean = false })
local fmt = string.format
local MiB = 1024 * 1024
local function say(...) print(fmt(...)) io.stdout:flush() end

kiln.set_quiet(true)
kiln.set_threads(o.threads)
local dir = o.dir ~= "" and o.dir or ((os.getenv("TMPDIR") or "/tmp") .. "/kiln-bench-flux")
os.execute("mkdir -p '" .. dir .. "'")

local function rss_peak()
  for line in io.lines("/proc/self/status") do
    local kb = line:match("^VmHWM:%s*(%d+)")
    if kb then return tonumber(kb) * 1024 end
  end
  return 0
end

-- ---------------------------------------------------------------- writing tensor by tensor

local DT = { bf16 = "BF16", f16 = "F16" }
local SIZE = { bf16 = 2, f16 = 2 }

-- The bytes of one tensor as safetensors stores them (through a one-tensor file).
local TMP = dir .. "/one.safetensors"
local function raw(t)
  kiln.save_safetensors(TMP, { x = t })
  local f = assert(io.open(TMP, "rb"))
  local n = string.unpack("<I8", f:read(8))
  f:seek("cur", n)
  local data = f:read("a")
  f:close()
  return data
end

-- Writes a safetensors file of `list` ({name, shape}) in dtype dt, each tensor made by
-- rw.tensor when its turn comes (seeded by its position), with metadata meta.
local function write(path, list, dt, meta)
  local t0 = kiln.time()
  local parts, off = {}, 0
  local m = { '"__metadata__":{' }
  local mk = {}
  for k, v in pairs(meta or {}) do mk[#mk + 1] = fmt("%q:%q", k, v) end
  m[1] = m[1] .. table.concat(mk, ",") .. "}"
  for i, e in ipairs(list) do
    local n = 1
    for _, d in ipairs(e[2]) do n = n * d end
    local b = n * SIZE[dt]
    parts[i] = fmt('%q:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}', e[1], DT[dt], table.concat(e[2], ","),
      off, off + b)
    off = off + b
  end
  local header = "{" .. m[1] .. (#parts > 0 and "," or "") .. table.concat(parts, ",") .. "}"
  header = header .. string.rep(" ", (8 - #header % 8) % 8)
  local f = assert(io.open(path .. ".part", "wb"))
  f:write(string.pack("<I8", #header), header)
  for i, e in ipairs(list) do
    local t = rw.tensor(e[1], e[2], 7000 + i)
    local c = dt ~= t.dtype and t:to(dt) or t
    if c ~= t then t:free() end
    f:write(raw(c))
    c:free()
    if i % 50 == 0 then collectgarbage() end
  end
  f:close()
  os.rename(path .. ".part", path)
  say("wrote %s: %.2f GB in %.0f s", path, off / 1e9, kiln.time() - t0)
end

local function exists(p)
  local f = io.open(p, "rb")
  if f then f:close() end
  return f ~= nil
end

local DIT = fmt("%s/flux1-schnell-%d-%d.safetensors", dir, o.double, o.single)
local AE = dir .. "/ae-decoder.safetensors"
local CLIP = dir .. "/clip_l.safetensors"
local T5 = fmt("%s/t5xxl-%d.safetensors", dir, o.t5_blocks)

if o.fresh or not exists(DIT) then
  local cfg = { hidden = 3072, in_channels = 64, context_dim = 4096, vec_dim = 768, depth = o.double,
    depth_single = o.single, mlp_hidden = 12288, head_dim = 128, guidance = false, qkv_bias = true, out_channels = 64 }
  write(DIT, flux.expected(cfg), "bf16")
end
if o.fresh or not exists(AE) then
  write(AE, vae.expected({ has_decoder = true, quant = false, ch = 128, ch_mult = { 1, 2, 4, 4 }, num_res_blocks = 2,
    z_channels = 16, embed_dim = 16, out_ch = 3, levels = 4 }), "f16")
end
if o.fresh or not exists(CLIP) then
  local list = clip.expected({ layout = "hf", width = 768, layers = 12, mlp = 3072, vocab = 49408, positions = 77,
    heads = 12 })
  write(CLIP, list, "f16")
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
  write(T5, list, "f16", { num_heads = tostring(HEADS) })
end

-- ---------------------------------------------------------------- the run

kiln.memory_mode(o.mode)
kiln.mem.set_budget("sim", o.budget * MiB)
local ck <close> = kiln.load_checkpoint(DIT, { vae = AE, clip = CLIP, t5 = T5 })
say("Flux.1 [schnell]-shaped (%s: %d double + %d single blocks, T5 %d blocks), %dx%d, 4 euler steps, mode %s, " ..
  "sim budget %d MiB, %d threads", ck.variant, o.double, o.single, o.t5_blocks, o.size, o.size, o.mode, o.budget,
  kiln.threads())
kiln.mem.reset_peak("sim")
local stages, last = {}, kiln.time()
local t0 = last
local img = pipeline.txt2img(ck, { prompt = "a photo of a cat on a red sofa", seed = 1, width = o.size,
  height = o.size, device = "sim", callback = function(st)
    local now = kiln.time()
    stages[#stages + 1] = fmt("%sstep %d: %.1f s", st.i == 1 and "encode + " or "", st.i, now - last)
    last = now
  end })
local total = kiln.time() - t0
img:free()
for _, s in ipairs(stages) do say("  %s", s) end
say("total %.1f s (encode, 4 steps, decode); sim peak %.0f MiB (budget %d); peak RSS %.0f MiB", total,
  kiln.mem.stats("sim").peak / MiB, o.budget, rss_peak() / MiB)
if o.clean then
  for _, p in ipairs({ DIT, AE, CLIP, T5, TMP }) do os.remove(p) end
end
os.remove(TMP)
