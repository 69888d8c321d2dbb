-- kiln.part: a network that is also its weight store. Every loaded network
-- (checkpoint parts, ControlNet, upscaler) is its module's object wrapped here so
-- :load(device, {dtype, resident}), :offload(), :unload(), :bytes(dev), :pin(),
-- :stats(), :where(name), .device, .residency, :close() and <close> reach its
-- kiln.Model; the networks read their weights through that model in every memory mode
-- (streamed per block in "low", see kiln.stream). A part over several stores (text
-- encoders from separate files) has a group of them as its store.
local kiln = require "kiln"

local M = {}
local fmt = string.format

-- What a part forwards to its kiln.Model: methods (returning the part where the model
-- returns itself) and read-only properties. Anything else is the network's own field,
-- nil when absent (a kiln.Model would take an unknown key for a tensor name).
local MODEL_METHODS = {
  load = true, offload = true, unload = true, pin = true, unpin = true, bytes = true, fetch = true,
  prefetch = true, release = true, where = true, stats = true, names = true, has = true, tensor = true,
}
local MODEL_PROPS = { name = true, residency = true, device = true, pinned = true, closed = true, streamed = true }

-- part:load(dev, {resident = bytes, dtype = ...}): a partial residency for a network
-- streamed by blocks (kiln.stream): about `bytes` of its blocks stay on the device
-- and the rest streams at each use, in any memory mode. A value at or above the
-- model's bytes loads it whole, in mode "low" too; a value above what the device's budget leaves beside
-- the streaming window is lowered, with a note. Without `resident` a load takes the
-- part's resident_plan (set by --mode auto, kiln.planner) or else clears an earlier
-- residency (the memory mode decides again).
-- A load starts with a full collection, as a dry run and each pipeline stage do: tensors
-- the caller left to the collector on the device (a probe's temporaries) would
-- otherwise stay allocated through the run, which can no longer use them, counting
-- against the budget (the resident room below) and in the run's peak, while the dry
-- run that predicted it started from a device without them.
local function load_part(self, store, kind, dev, opts)
  collectgarbage()
  local streamer = rawget(self, "streamer")
  local resident
  local asked
  if type(opts) == "table" then asked = opts.resident end
  if asked == nil then asked = rawget(self, "resident_plan") end
  if asked ~= nil then
    resident = asked
    if type(resident) == "string" then
      local ok, b = pcall(kiln.parse_size, resident)
      if not ok then error(fmt("%s:load: resident '%s': %s", kind, resident, tostring(b)), 3) end
      resident = b
    end
    if type(resident) ~= "number" or resident < 0 or resident ~= resident then
      error(fmt("%s:load: resident must be a number of bytes from 0 (or a size like \"2G\"), got %s", kind,
        tostring(asked)), 3)
    end
    if type(opts) == "table" then
      local o = {}
      for k, v in pairs(opts) do if k ~= "resident" then o[k] = v end end
      opts = o
    end
    if not streamer or not store.set_streamed then
      error(fmt("%s:load: resident needs a network streamed block by block (UNet, VAE, ControlNet)", kind), 3)
    end
    local total = streamer:total_bytes(store)
    if resident >= total then
      resident = "whole"
    else
      local d = dev or kiln.default_device()
      local st = kiln.mem.stats(d)
      local _, window = streamer:_sizes(store)
      local room = st.budget > 0 and math.max(0, st.budget - st.allocated - window) or math.huge
      if resident > room then
        if not kiln.quiet() then
          io.stderr:write(fmt("kiln: %s: resident %s lowered to %s (the budget of %s less what is allocated and " ..
            "the streaming window)\n", kind, kiln.format_bytes(resident), kiln.format_bytes(room), d))
        end
        resident = room
      end
      resident = math.floor(resident)
    end
  end
  if streamer and store.set_streamed then
    -- all of it: loaded whole onto the device in every memory mode (mode "low" would
    -- otherwise keep it on the host and stream every block at every use)
    store:set_streamed(resident == "whole" and "whole" or resident ~= nil)
    streamer:set_resident(resident ~= "whole" and resident or nil)
  end
  store:load(dev, opts)
  return self
end

-- Wraps a network object so it is also its weight store: load, offload, unload, bytes,
-- ... go to the store; close and <close> too.
function M.as_model(obj, store, kind)
  local class = getmetatable(obj)
  obj.model = store
  local mt = {}
  mt.__name = "kiln." .. kind
  mt.__index = function(_, k)
    local v = class[k]
    if v ~= nil then return v end
    if k == "load" and type(store.load) == "function" then
      return function(self, dev, opts) return load_part(self, store, kind, dev, opts) end
    end
    if MODEL_METHODS[k] then
      local f = store[k]
      if type(f) ~= "function" then
        error(fmt("%s: '%s' is not available on this part (its weights span several files)", kind, k), 2)
      end
      return function(self, ...)
        local r = f(store, ...)
        if r == store then return self end
        return r
      end
    end
    if MODEL_PROPS[k] then return store[k] end
    return nil
  end
  mt.__close = function(t) t:close() end
  mt.__tostring = function(t)
    local cfg = rawget(t, "config") or {}
    return fmt("%s(%s; %s)", kind, cfg.summary or "", tostring(store))
  end
  obj.close = function(self)
    local s = rawget(self, "model")
    if s then s:close() end
  end
  return setmetatable(obj, mt)
end

-- Several stores as one (the text encoders of a part, each from its own file): the
-- store methods reach each of them; one store is returned as it is.
local Group = {}
Group.__index = Group

function M.group(stores)
  if #stores == 1 then return stores[1] end
  return setmetatable({ stores = stores }, Group)
end

for _, m in ipairs({ "load", "offload", "unload", "pin", "unpin", "close" }) do
  Group[m] = function(self, ...)
    for _, s in ipairs(self.stores) do s[m](s, ...) end
    return self
  end
end

function Group:bytes(device)
  local n = 0
  for _, s in ipairs(self.stores) do n = n + s:bytes(device) end
  return n
end

function Group:tensor(name)
  error("clip: tensor() on a multi-file part: use clip.encoders[i].enc.weights", 2)
end

Group.__tostring = function(g)
  local r = {}
  for i, st in ipairs(g.stores) do r[i] = tostring(st) end
  return table.concat(r, " + ")
end

return M
