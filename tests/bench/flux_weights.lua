-- tests/bench/flux_weights.lua - random full-size Flux.1-shaped weight files written at
-- the disk's speed: every tensor's bytes are a slice of one small pool of random bytes
-- (taken at an offset that depends on the tensor), already in the file's encoding, so
-- nothing is generated, converted or held per tensor. Timing needs only valid, finite,
-- well-scaled values, not independent ones.
--
--   build/kiln tests/bench/flux_weights.lua --format q8_0|fp8|bf16 --out PATH
--       [--double 19] [--single 38] [--schnell]
--
-- q8_0: city96's GGUF layout (general.architecture flux, BFL names), 2-D tensors Q8_0
-- (each 32-value block an f16 scale of 2^-12 and 32 random int8: values of standard
-- deviation near 1/sqrt(3072)), 1-D tensors F32 (norm scales 1, biases 0). fp8: a
-- ComfyUI-style safetensors file, 2-D tensors F8_E4M3 with random sign and mantissa and
-- the exponent field 0 or 1 (|w| < 2^-5, finite), 1-D tensors BF16. bf16: all BF16,
-- the pool's 16-bit words with their exponent limited to the same range.
-- As a module: local fw = dofile("tests/bench/flux_weights.lua"); fw.write(fmt, path, cfg), or
-- fw.write_safetensors(path, {{name, shape}, ...}, {matrix = "F16", vector = "F16"}) for
-- other networks (tests/bench/bench_t5.lua --pool).
local kiln = require "kiln"
local util = require "kiln.util"
local flux = require "kiln.flux"

local M = {}
local fmt = string.format
local POOL_BYTES = 8 * 1024 * 1024

-- The Flux.1 [dev] ([schnell]: no guidance_in) configuration at full width.
function M.config(double, single, schnell)
  return { hidden = 3072, in_channels = 64, context_dim = 4096, vec_dim = 768, depth = double or 19,
    depth_single = single or 38, mlp_hidden = 12288, head_dim = 128, guidance = not schnell, qkv_bias = true,
    out_channels = 64 }
end

local pool_raw
local function random_bytes()
  if pool_raw then return pool_raw end
  local rng = math.random
  math.randomseed(42, 7)
  local parts = {}
  for i = 1, POOL_BYTES // 8 do parts[i] = string.pack("<j", rng(0)) end
  pool_raw = table.concat(parts)
  return pool_raw
end

-- Pools of encoded values: the string, the grain (bytes per unit an offset must respect)
-- and the values per grain.
local pools = {}
local function pool(kind)
  if pools[kind] then return pools[kind] end
  local r = random_bytes()
  local p
  if kind == "q8_0" then
    -- f16 2^-12 = exponent field 3, mantissa 0
    local scale = string.pack("<I2", 3 << 10)
    local parts = {}
    for i = 1, #r // 32 do parts[i] = scale .. r:sub((i - 1) * 32 + 1, i * 32) end
    p = { s = table.concat(parts), grain = 34, per = 32 }
  elseif kind == "fp8" then
    -- keep sign (0x80) and mantissa (0x07); exponent field from bit 3: 0 or 1
    local map = {}
    for b = 0, 255 do map[string.char(b)] = string.char((b & 0x87) | (b & 0x08)) end
    p = { s = r:gsub(".", map), grain = 1, per = 1 }
  elseif kind == "bf16" then
    -- bf16 sign | exponent 8 bits | mantissa 7: exponent 118..121 (|w| < 2^-5)
    local parts = {}
    for i = 1, #r // 2 do
      local v = string.unpack("<I2", r, 2 * i - 1)
      local e = 118 + (v >> 7 & 3)
      parts[i] = string.pack("<I2", (v & 0x807F) | (e << 7))
    end
    p = { s = table.concat(parts), grain = 2, per = 1 }
  elseif kind == "f16" then
    -- f16 sign | exponent 5 bits | mantissa 10: exponent 8..9 (|w| < 2^-5)
    local parts = {}
    for i = 1, #r // 2 do
      local v = string.unpack("<I2", r, 2 * i - 1)
      parts[i] = string.pack("<I2", (v & 0x83FF) | ((8 + (v >> 10 & 1)) << 10))
    end
    p = { s = table.concat(parts), grain = 2, per = 1 }
  else
    error("flux_weights: unknown pool " .. tostring(kind), 2)
  end
  pools[kind] = p
  return p
end

-- Writes `bytes` bytes of pool p to f, starting at grain `start` and wrapping around.
local function write_pool(f, p, bytes, start)
  local n = #p.s
  local off = (start * p.grain) % (n - n % p.grain)
  while bytes > 0 do
    local take = math.min(bytes, n - off)
    f:write(off == 0 and take == n and p.s or p.s:sub(off + 1, off + take))
    bytes = bytes - take
    off = 0
  end
end

local function numel(shape)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  return n
end

-- 1-D tensors: norm scales (Flux's *.scale; T5's, CLIP's and the autoencoder's
-- *norm*.weight: layer_norm, layer_norm1, final_layer_norm, norm1, norm_out) 1, biases 0.
local function const_1d(name, n, dtype)
  local one = name:match("scale$") ~= nil or name:match("norm[%w_]*%.weight$") ~= nil
  if dtype == "F32" then return string.rep(string.pack("<f", one and 1 or 0), n) end
  if dtype == "F16" then return string.rep(string.pack("<I2", one and 0x3C00 or 0), n) end
  return string.rep(string.pack("<I2", one and 0x3F80 or 0), n) -- bf16
end

local function gguf_string(s) return string.pack("<I8", #s) .. s end

-- city96's GGUF: Q8_0 matrices, F32 vectors.
local function write_gguf(path, list)
  local ALIGN = 32
  local kv = {
    gguf_string("general.architecture") .. string.pack("<I4", 8) .. gguf_string("flux"),
    gguf_string("general.quantization_version") .. string.pack("<I4", 4) .. string.pack("<I4", 2),
  }
  local infos, off, sizes = {}, 0, {}
  for i, e in ipairs(list) do
    local shape, n = e[2], numel(e[2])
    local ty, bytes
    if #shape == 1 then ty, bytes = 0, n * 4 else
      assert(shape[#shape] % 32 == 0, e[1] .. ": rows not a multiple of 32")
      ty, bytes = 8, n // 32 * 34
    end
    local dims = {}
    for d = #shape, 1, -1 do dims[#dims + 1] = string.pack("<I8", shape[d]) end
    infos[i] = gguf_string(e[1]) .. string.pack("<I4", #shape) .. table.concat(dims) .. string.pack("<I4I8", ty, off)
    sizes[i] = bytes
    off = off + bytes + (ALIGN - bytes % ALIGN) % ALIGN
  end
  local head = "GGUF" .. string.pack("<I4I8I8", 3, #list, #kv) .. table.concat(kv) .. table.concat(infos)
  head = head .. string.rep("\0", (ALIGN - #head % ALIGN) % ALIGN)
  local f = assert(io.open(path .. ".part", "wb"))
  f:setvbuf("full", 1 << 20)
  f:write(head)
  local p = pool("q8_0")
  for i, e in ipairs(list) do
    local b = sizes[i]
    if #e[2] == 1 then f:write(const_1d(e[1], numel(e[2]), "F32")) else write_pool(f, p, b, i * 7919) end
    local pad = (ALIGN - b % ALIGN) % ALIGN
    if pad > 0 then f:write(string.rep("\0", pad)) end
  end
  f:close()
  return #head + off
end

local POOL_OF = { F8_E4M3 = "fp8", BF16 = "bf16", F16 = "f16" }
local ESIZE = { F8_E4M3 = 1, BF16 = 2, F16 = 2 }

--- A safetensors file of `list` ({name, shape}): 2-D and larger tensors in opts.matrix
-- (F8_E4M3, BF16 or F16) from the pool, 1-D ones in opts.vector (BF16 or F16) as
-- constants; opts.meta: the __metadata__ strings. Returns the bytes written.
function M.write_safetensors(path, list, opts)
  local dt, vdt = opts.matrix, opts.vector or "BF16"
  local p = pool(POOL_OF[dt] or error("flux_weights: no pool for " .. tostring(dt), 2))
  local parts, off, sizes = {}, 0, {}
  for i, e in ipairs(list) do
    local n = numel(e[2])
    local d = #e[2] == 1 and vdt or dt
    local b = n * ESIZE[d]
    parts[i] = fmt('%q:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}', e[1], d, table.concat(e[2], ","), off,
      off + b)
    sizes[i] = b
    off = off + b
  end
  local mk = {}
  for k, v in pairs(opts.meta or {}) do mk[#mk + 1] = fmt("%q:%q", k, v) end
  table.sort(mk)
  local header = '{"__metadata__":{' .. table.concat(mk, ",") .. '},' .. table.concat(parts, ",") .. "}"
  header = header .. string.rep(" ", (8 - #header % 8) % 8)
  local f = assert(io.open(path .. ".part", "wb"))
  f:setvbuf("full", 1 << 20)
  f:write(string.pack("<I8", #header), header)
  for i, e in ipairs(list) do
    if #e[2] == 1 then f:write(const_1d(e[1], numel(e[2]), vdt)) else write_pool(f, p, sizes[i], i * 7919) end
  end
  f:close()
  assert(os.rename(path .. ".part", path))
  return 8 + #header + off
end

--- The FLOPs (2 per multiply-add) of one Flux evaluation over n_img image and n_txt text
-- tokens: the linear layers and the attention products of each block, the modulations,
-- the input and output projections. Returns the step's, one double block's and one
-- single block's.
function M.step_flops(cfg, n_img, n_txt)
  local H, Mh, L = cfg.hidden, cfg.mlp_hidden, n_img + n_txt
  local att = 4 * L * L * H
  local dbl = 2 * L * (3 * H * H + H * H + 2 * H * Mh) + att
  local sgl = 2 * L * ((3 * H + Mh) * H + (H + Mh) * H) + att
  local mod = 2 * (12 * H * H * cfg.depth + 3 * H * H * cfg.depth_single)
  local io = 2 * n_img * cfg.in_channels * H + 2 * n_txt * cfg.context_dim * H + 2 * n_img * H * cfg.out_channels
  return cfg.depth * dbl + cfg.depth_single * sgl + mod + io, dbl, sgl
end

--- The bf16 GEMM rate (FLOP/s): the best of `n` [rows, 3072] x [3072, 3072] products, on
-- the cpu whatever the default device (nothing left in a budgeted device's cache).
function M.gemm_rate(rows, n)
  local H = 3072
  local x0 = kiln.randn({ rows, H }, { seed = 1, device = "cpu" })
  local w0 = kiln.randn({ H, H }, { seed = 2, device = "cpu" })
  local x, w = x0:to("bf16"), w0:to("bf16")
  x0:free(); w0:free()
  local best = math.huge
  for _ = 1, n or 5 do
    local t0 = kiln.time()
    kiln.nn.linear(x, w):free()
    best = math.min(best, kiln.time() - t0)
  end
  x:free(); w:free()
  return 2 * rows * H * H / best, best
end

--- Writes the file (through PATH.part, renamed when complete); returns bytes, seconds.
function M.write(format, path, cfg)
  local t0 = kiln.time()
  local list = flux.expected(cfg)
  local bytes
  local meta = { ["kiln.bench"] = "flux_weights" }
  if format == "q8_0" then
    bytes = write_gguf(path, list)
    assert(os.rename(path .. ".part", path))
  elseif format == "fp8" then bytes = M.write_safetensors(path, list, { matrix = "F8_E4M3", meta = meta })
  elseif format == "bf16" then bytes = M.write_safetensors(path, list, { matrix = "BF16", meta = meta })
  else error(fmt("flux_weights: --format must be q8_0, fp8 or bf16, not '%s'", tostring(format)), 2) end
  return bytes, kiln.time() - t0
end

if arg and arg[0] and arg[0]:match("flux_weights%.lua$") then
  local o = util.parse_args(arg, { format = "q8_0", out = "", double = 19, single = 38, schnell = false })
  if o.out == "" then error("flux_weights: --out PATH is required", 0) end
  local bytes, s = M.write(o.format, o.out, M.config(o.double, o.single, o.schnell))
  print(fmt("wrote %s: %.2f GB in %.1f s (%.2f s/GB)", o.out, bytes / 1e9, s, s / (bytes / 1e9)))
end

return M
