-- kiln.stream: how a network reads its weights, and the per-block weight streaming
-- of memory mode "low". A network (UNet, VAE, CLIP encoder) names its weights
-- relative to its root; a weights accessor (stream.weights) resolves those names in
-- the part's kiln.Model. The network is a sequence of blocks; stream.new groups the
-- tensors by block once per network, and each forward pass runs its blocks through a
-- pass:
--
--   local pass <close> = self.streamer:pass(order)    -- order: block keys, in run order
--   h = pass:run("input_blocks.1.", fn, ...)          -- fn(...) with the block's weights
--
-- In mode "low" with a device target (the model was :load(dev)ed: its weights stay on
-- the host, f16 when the file is f16), pass:run fetches the block's tensors (waiting
-- for a prefetch in flight), queues the next block's on the device's copy thread so
-- the copy overlaps this block's compute, runs fn, then frees the tensor handles the
-- block was given and releases its device copies. Closing the pass (also on error)
-- releases whatever it still holds, so after a forward the model has no device bytes.
-- In every other case (weights resident on the device, mode "none", no target)
-- pass:run is just fn(...).
local kiln = require "kiln"

local M = {}
local fmt = string.format

-- ---------------------------------------------------------------- weights accessor

-- Names relative to a part's root, resolved with a prefix or a name map (diffusers) to
-- the names in the store (a kiln.Model, or any object with :tensor(name)).
local Weights = {}
Weights.__index = Weights
M.Weights = Weights

function M.weights(store, prefix, map)
  return setmetatable({ store = store, prefix = prefix or "", map = map, pass = nil }, Weights)
end

function Weights:real(name)
  if self.map then return self.map[name] or (self.prefix .. name) end
  return self.prefix .. name
end

function Weights:tensor(name)
  local t = self.store:tensor(self:real(name))
  local p = self.pass
  if p then p:_track(t) end
  return t
end

-- The kiln.Model underneath, or nil (a plain table of tensors, a test double).
function Weights:model()
  local s = self.store
  if type(s) == "userdata" and getmetatable(s) and getmetatable(s).__name == "kiln.Model" then return s end
  return nil
end

-- True when this part's weights are streamed: mode "low" and a device target that is
-- not the cpu.
function Weights:streaming()
  local m = self:model()
  if not m or kiln.memory_mode() ~= "low" then return false end
  local dev = m.device
  return dev ~= nil and dev ~= "cpu"
end

-- The device the network computes on: the streaming target, else where the weight
-- `probe` lives now (the device it was loaded to, or the cpu for mapped weights).
function Weights:device(probe)
  if self:streaming() then return self.store.device end
  local t = self.store:tensor(self:real(probe))
  local d = t.device
  t:free()
  return d
end

-- ---------------------------------------------------------------- block plan

-- expected: the network's list of {name, shape} (names relative to its root);
-- key_of(name) -> block key, or nil for a tensor no block reads. Returns the blocks in
-- first-use order: {{key = k, names = {...}}, ...}.
function M.blocks(expected, key_of)
  local blocks, at = {}, {}
  for _, e in ipairs(expected) do
    local k = key_of(e[1])
    if k then
      local b = at[k]
      if not b then
        b = { key = k, names = {} }
        at[k] = b
        blocks[#blocks + 1] = b
      end
      b.names[#b.names + 1] = e[1]
    end
  end
  return blocks
end

-- ---------------------------------------------------------------- streamer

local Streamer = {}
Streamer.__index = Streamer
M.Streamer = Streamer

-- label: "unet", "vae", "clip" (trace span names). The real names of every block are
-- resolved here, once.
function M.new(weights, blocks, label)
  local self = setmetatable({ weights = weights, blocks = {}, index = {}, label = label or "net" }, Streamer)
  local resolve = type(weights) == "table" and weights.real and function(n) return weights:real(n) end
      or function(n) return n end
  for i, b in ipairs(blocks) do
    local real = {}
    for j, n in ipairs(b.names) do real[j] = resolve(n) end
    self.blocks[i] = { key = b.key, names = b.names, real = real }
    self.index[b.key] = i
  end
  return self
end

-- Every block key, in order.
function Streamer:keys()
  local r = {}
  for i, b in ipairs(self.blocks) do r[i] = b.key end
  return r
end

-- Bytes of each block's tensors as stored in the model (nil when there is none).
function Streamer:block_bytes()
  local w = self.weights
  local m = type(w) == "table" and w.model and w:model()
  if not m then return nil end
  local r = {}
  for i, b in ipairs(self.blocks) do
    local n = 0
    for _, name in ipairs(b.real) do
      local t = m:tensor(name)
      n = n + t:nbytes()
      t:free()
    end
    r[i] = { key = b.key, bytes = n }
  end
  return r
end

local Pass = {}
Pass.__index = Pass

local function inactive_run(_, _, fn, ...) return fn(...) end
local INACTIVE = setmetatable({ run = inactive_run, streaming = false }, { __close = function() end })

-- A forward pass over the blocks named in order (default: every block). Returns an
-- object to close when the forward ends (a to-be-closed variable). The model is pinned
-- while the pass is open: a network's own weights are never evicted under it (mode
-- "normal" would otherwise pick the model in use when its activations need room).
function Streamer:pass(order)
  local w = self.weights
  local m = type(w) == "table" and w.model and w:model()
  if not m then return INACTIVE end
  local trace = kiln.trace and kiln.trace.active and kiln.trace.active() or false
  local streaming = w:streaming()
  if not streaming then
    m:pin()
    return setmetatable({ s = self, model = m, streaming = false, active = true, trace = trace, pinned = true }, Pass)
  end
  if w.pass then
    error(fmt("%s: a forward pass is already running on these weights (nested passes are not supported)",
      self.label), 2)
  end
  local seq = {}
  for i, k in ipairs(order or self:keys()) do
    local b = self.index[k]
    if not b then error(fmt("%s: no block '%s' in the streaming plan", self.label, tostring(k)), 2) end
    seq[i] = b
  end
  m:pin()
  local p = setmetatable({
    s = self, model = m, seq = seq, pos = 0, streaming = true, active = true, trace = trace, pinned = true,
    held = {},       -- block index -> true while fetched or prefetched
    handles = {},    -- block index -> tensor handles given out while it ran
    loose = {},      -- handles given out outside any block
    current = nil,
  }, Pass)
  w.pass = p
  return p
end

function Pass:_track(t)
  local c = self.current
  local list = c and self.handles[c] or self.loose
  list[#list + 1] = t
end

local function free_all(list)
  if not list then return end
  for i = #list, 1, -1 do
    list[i]:free()
    list[i] = nil
  end
end

function Pass:_drop(b)
  free_all(self.handles[b])
  self.handles[b] = nil
  if self.held[b] then
    self.held[b] = nil
    self.model:release(self.s.blocks[b].real)
  end
end

-- Runs fn(...) as block `key`: its weights are on the device while fn runs and the
-- next block's are on their way.
function Pass:run(key, fn, ...)
  if not self.streaming then
    if self.trace then return kiln.trace.span(self.s.label .. " " .. key, fn, ...) end
    return fn(...)
  end
  local b = self.s.index[key]
  if not b then error(fmt("%s: no block '%s' in the streaming plan", self.s.label, tostring(key)), 2) end
  -- position in the order: the next entry naming b at or after the current position
  local pos = self.pos + 1
  while self.seq[pos] and self.seq[pos] ~= b do pos = pos + 1 end
  if not self.seq[pos] then
    error(fmt("%s: block '%s' runs out of the pass's order", self.s.label, key), 2)
  end
  self.pos = pos
  local m = self.model
  m:fetch(self.s.blocks[b].real)
  self.held[b] = true
  local nxt = self.seq[pos + 1]
  if nxt and nxt ~= b and not self.held[nxt] then
    m:prefetch(self.s.blocks[nxt].real)
    self.held[nxt] = true
  end
  self.current = b
  self.handles[b] = self.handles[b] or {}
  local function finish(...)
    self.current = nil
    self:_drop(b)
    return ...
  end
  if self.trace then
    return finish(kiln.trace.span(self.s.label .. " " .. key, fn, ...))
  end
  return finish(fn(...))
end

-- Releases what the pass still holds (an unused prefetch, a block that raised).
function Pass:close()
  if not self.active then return end
  self.active = false
  if self.streaming then
    for b in pairs(self.held) do self:_drop(b) end
    for b in pairs(self.handles) do free_all(self.handles[b]) end
    free_all(self.loose)
    self.handles = {}
    local w = self.s.weights
    if w.pass == self then w.pass = nil end
  end
  -- the model may have been closed by the network's caller meanwhile
  if self.pinned and not self.model.closed then pcall(self.model.unpin, self.model) end
end

Pass.__close = Pass.close

return M
