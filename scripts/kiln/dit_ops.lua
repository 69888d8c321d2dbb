-- kiln.dit_ops: the small pieces the diffusion transformers (kiln.flux, kiln.mmdit) are
-- built from — a scope that frees a block's temporaries, RMS norm, adaLN modulation,
-- the per-sample time/guidance vectors, integer metadata — so each network file holds
-- only its own architecture.
local kiln = require "kiln"
local util = require "kiln.util"
local nn = kiln.nn

local M = {}
local fmt = string.format

--- A scope of temporaries: k(v) keeps v to free, done(...) frees all but the values
-- given (the block's results) and returns them.
function M.scope()
  local list = {}
  local s = {}
  function s.k(v) list[#list + 1] = v; return v end
  function s.done(...)
    local keep = {}
    for i = 1, select("#", ...) do keep[select(i, ...)] = true end
    for i = #list, 1, -1 do
      if not keep[list[i]] then list[i]:free() end
      list[i] = nil
    end
    return ...
  end
  return s
end

--- RMS norm over the last dimension (eps 1e-6, no mean) times its weight.
function M.rms_norm(x, w)
  local S = M.scope()
  local k = S.k
  local ms = k(k(x * x):mean(#x.shape, true))
  local r = k(k(k(ms + 1e-6):sqrt()) ^ -1)
  return S.done(k(x * r) * w)
end

--- LayerNorm without affine (eps 1e-6), as both references normalise before adaLN.
function M.layer_norm(x) return nn.layer_norm(x, nil, nil, 1e-6) end

--- x * (1 + scale) + shift over an already normalised x (scale, shift [B, 1, H]).
function M.modulate(n, shift, scale)
  local S = M.scope()
  local k = S.k
  return S.done(k(k(n * scale) + n) + shift)
end

--- A positive integer from a file's __metadata__ (nil when absent); `who` names the
-- network in the error.
function M.meta_int(meta, key, who)
  local v = meta and meta[key]
  if v == nil then return nil end
  local n = math.tointeger(tonumber(v))
  if not n or n <= 0 then
    error(fmt("%s: __metadata__ %s = %q is not a positive integer", who, key, tostring(v)), 0)
  end
  return n
end

--- A per-sample value of dit:forward (a number, a Lua list, a 0-D or 1-D tensor) as
-- an f32 tensor [B] on `device`; one value serves the whole batch.
function M.as_batch(v, B, name, device)
  if type(v) == "number" then v = kiln.tensor({ v }) end
  if type(v) == "table" and getmetatable(v) == nil then v = kiln.tensor(v) end
  if #v.shape == 0 then v = v:reshape({ 1 }) end
  if #v.shape ~= 1 then error(fmt("dit:forward: %s must be a 1-D tensor, got %d dims", name, #v.shape), 3) end
  if v.shape[1] == 1 and B > 1 then v = v:expand({ B }) end
  if v.shape[1] ~= B then error(fmt("dit:forward: %d values of %s for a batch of %d", v.shape[1], name, B), 3) end
  if v.dtype ~= "f32" then v = v:to("f32") end
  if v.device ~= device then v = v:to(device) end
  return v
end

--- A tensor's shape for messages ("nil" for none).
function M.shape_of(t) return t and util.shape_str(t) or "nil" end

--- Where a network's weights are: the device of `name` (the store's answer when it
-- streams, else the tensor's).
function M.weights_device(weights, name)
  if weights.device then return weights:device(name) end
  return weights:tensor(name).device
end

return M
