-- tests/bench/pool_weights.lua - files of random tensors written at the disk's speed, for
-- the full-size benches (tests/bench/flux_weights.lua, tests/bench/sd3_weights.lua,
-- bench_t5.lua --pool): every tensor's bytes are a slice of one small pool of random
-- bytes (taken at an offset that depends on the tensor), already in the file's encoding,
-- so nothing is generated, converted or held per tensor. Timing needs only valid,
-- finite, well-scaled values, not independent ones.
--
--   local pw = dofile("tests/bench/pool_weights.lua")
--   pw.write_safetensors(path, {{name, shape}, ...}, {matrix = "F16", vector = "F16", meta = {...}})
--   pw.write_gguf(path, {{name, shape}, ...}, {architecture = "flux"})
--
-- Matrices (2-D and larger) come from the pool: F8_E4M3 with random sign and mantissa
-- and the exponent field 0 or 1 (|w| < 2^-5, finite); BF16 and F16 the pool's 16-bit
-- words with their exponent limited to the same range; GGUF Q8_0 (each 32-value block an
-- f16 scale of 2^-12 and 32 random int8: values of standard deviation near
-- 1/sqrt(3072)). Vectors (1-D) are constants: norm scales 1 (names ending in "scale",
-- "norm.weight", or matching opts.ones), everything else (biases) 0.
local M = {}
local fmt = string.format
local POOL_BYTES = 8 * 1024 * 1024

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
    error("pool_weights: unknown pool " .. tostring(kind), 2)
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

function M.numel(shape)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  return n
end
local numel = M.numel

local function is_one(name, ones)
  return name:match("scale$") ~= nil or name:match("norm[%w_]*%.weight$") ~= nil or (ones ~= nil and ones(name))
end

-- 1-D tensors: norm scales 1, biases 0.
local function const_1d(name, n, dtype, ones)
  local one = is_one(name, ones)
  if dtype == "F32" then return string.rep(string.pack("<f", one and 1 or 0), n) end
  if dtype == "F16" then return string.rep(string.pack("<I2", one and 0x3C00 or 0), n) end
  return string.rep(string.pack("<I2", one and 0x3F80 or 0), n) -- bf16
end

local function gguf_string(s) return string.pack("<I8", #s) .. s end

--- A GGUF file of `list` ({name, shape}): Q8_0 matrices, F32 vectors;
-- opts.architecture the general.architecture string, opts.ones as write_safetensors'.
-- Returns the bytes written.
function M.write_gguf(path, list, opts)
  local ALIGN = 32
  local kv = {
    gguf_string("general.architecture") .. string.pack("<I4", 8) .. gguf_string(opts.architecture),
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
    if #e[2] == 1 then f:write(const_1d(e[1], numel(e[2]), "F32", opts.ones)) else write_pool(f, p, b, i * 7919) end
    local pad = (ALIGN - b % ALIGN) % ALIGN
    if pad > 0 then f:write(string.rep("\0", pad)) end
  end
  f:close()
  assert(os.rename(path .. ".part", path))
  return #head + off
end

local POOL_OF = { F8_E4M3 = "fp8", BF16 = "bf16", F16 = "f16" }
local ESIZE = { F8_E4M3 = 1, BF16 = 2, F16 = 2 }

--- A safetensors file of `list` ({name, shape}) through PATH.part, renamed when
-- complete: 2-D and larger tensors in opts.matrix (F8_E4M3, BF16 or F16) from the pool,
-- 1-D ones in opts.vector (BF16 or F16) as constants (opts.ones(name) -> true: one more
-- kind of norm scale, set to 1); opts.dtype_of(name, shape) -> a dtype overrides
-- opts.matrix for a tensor (fp8 files keep their convolutions and tables in 16 bits);
-- opts.meta: the __metadata__ strings; opts.sparse: the header only, the data left a hole
-- (a file a dry run can open at once, taking no disk). Returns the file's size.
function M.write_safetensors(path, list, opts)
  local vdt = opts.vector or "BF16"
  local function dtype(e)
    if #e[2] == 1 then return vdt end
    return opts.dtype_of and opts.dtype_of(e[1], e[2]) or opts.matrix
  end
  for _, e in ipairs(list) do
    local d = dtype(e)
    if #e[2] > 1 and not POOL_OF[d] then error("pool_weights: no pool for " .. tostring(d), 2) end
  end
  local parts, off, sizes, dts = {}, 0, {}, {}
  for i, e in ipairs(list) do
    local n = numel(e[2])
    local d = dtype(e)
    dts[i] = d
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
  if opts.sparse then
    -- the data a hole of the right size: the header is all a dry run reads
    if off > 0 then f:seek("cur", off - 1); f:write("\0") end
    f:close()
    assert(os.rename(path .. ".part", path))
    return 8 + #header + off
  end
  for i, e in ipairs(list) do
    if #e[2] == 1 then f:write(const_1d(e[1], numel(e[2]), vdt, opts.ones))
    else write_pool(f, pool(POOL_OF[dts[i]]), sizes[i], i * 7919) end
  end
  f:close()
  assert(os.rename(path .. ".part", path))
  return 8 + #header + off
end

return M
