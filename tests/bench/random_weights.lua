-- tests/bench/random_weights.lua - checkpoints of real architectures with random
-- weights, for benchmarks (no model can be downloaded): every tensor named and shaped
-- as a key list of $KILN_SHARED/sd-keys gives, in f16. Tensors up to 1 Mi elements are
-- kiln.randn with their own seed; larger ones repeat a seeded 1 Mi-element randn block
-- (random enough for timing, and 5x faster to generate); weights are scaled by
-- 1/sqrt(fan_in), norm weights are 1 + 0.1 N(0, 1), biases 0.02 N(0, 1).
--
--   local rw = dofile("tests/bench/random_weights.lua")
--   rw.ensure(path, keys_file, {mark = "...", keep = function(name) ... end, seed = 1000})
local kiln = require "kiln"

local M = {}
local BLOCK = 1024 * 1024

function M.parse_shape(s)
  local r = {}
  for d in s:gmatch("%d+") do r[#r + 1] = tonumber(d) end
  return r
end

function M.tensor(name, shape, seed)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  if name:match("position_ids$") then return kiln.arange(n):reshape(shape) end
  local std, mean
  if #shape >= 2 then
    std, mean = 1 / math.sqrt(n // shape[1]), 0
  elseif name:match("%.weight$") then
    std, mean = 0.1, 1 -- norm scales
  else
    std, mean = 0.02, 0
  end
  local k = math.min(n, BLOCK)
  local r = kiln.randn({ k }, { seed = seed })
  local s = r * std
  r:free()
  if mean ~= 0 then local m = s + mean; s:free(); s = m end
  local h = s:to("f16")
  s:free()
  if k == n then
    local t = h:reshape(shape)
    h:free()
    return t
  end
  local parts = {}
  for i = 1, (n + k - 1) // k do parts[i] = h end
  local c = kiln.cat(parts, 1)
  h:free()
  local t = c:narrow(1, 1, n):contiguous():reshape(shape)
  c:free()
  return t
end

-- True when path holds a file this module wrote with the same mark.
function M.valid(path, mark)
  local ok, t, meta = pcall(kiln.load_safetensors, path)
  if not ok then return false end
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return meta and meta["kiln.bench"] == mark and n > 0
end

-- Writes the checkpoint unless a valid one is there; returns whether it wrote, the
-- tensor count, bytes and seconds. The whole checkpoint is built in memory first
-- (about 7 GB for SDXL in f16).
function M.ensure(path, keys, opts)
  opts = opts or {}
  local mark = opts.mark or "random-f16-v1"
  if not opts.fresh and M.valid(path, mark) then return false end
  local f = io.open(keys)
  if not f then error("random_weights: " .. keys .. " is missing (set KILN_SHARED to the shared folder)") end
  f:close()
  local t0 = kiln.time()
  local tensors, n, bytes, i = {}, 0, 0, 0
  for line in io.lines(keys) do
    local name, s = line:match("^([^\t]+)\t(.*)$")
    i = i + 1
    if name and (not opts.keep or opts.keep(name)) then
      local t = M.tensor(name, M.parse_shape(s), (opts.seed or 1000) + i)
      tensors[name] = t
      n = n + 1
      bytes = bytes + t:nbytes()
    end
  end
  kiln.save_safetensors(path, tensors, { ["kiln.bench"] = mark })
  for _, t in pairs(tensors) do t:free() end
  collectgarbage()
  return true, n, bytes, kiln.time() - t0
end

return M
