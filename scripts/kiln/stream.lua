-- kiln.stream: how a network reads its weights, and the per-block weight streaming
-- of memory mode "low". A network (UNet, VAE, CLIP encoder) names its weights
-- relative to its root; a weights accessor (stream.weights) resolves those names in
-- the part's kiln.Model, whose :tensor(name) gives a new handle per call (the device
-- copy when there is one): the networks free the handles and views they make, so no
-- storage outlives its use waiting for the GC. A network is a sequence of blocks;
-- stream.new groups its tensors by block once, and each forward pass runs its blocks
-- through a pass:
--
--   local pass <close> = self.streamer:pass(order)    -- order: block keys, in run order
--   h = pass:run("input_blocks.1.", fn, ...)          -- fn(...) with the block's weights
--
-- In mode "low" with a device target (the model was :load(dev)ed: its weights stay on
-- the host, f16 when the file is f16, and the kernels cast at use), pass:run queues
-- the blocks that follow on the device's copy thread (the next one always, more while
-- the prefetched weights stay within the two largest adjacent blocks), fetches this
-- block's tensors (waiting for their prefetch), runs fn while the copies go on, then
-- frees the tensor handles the block was given and releases its device copies.
-- A partial residency (part:load(dev, {resident = bytes}), any mode) keeps the
-- largest blocks that fit in `bytes` on the device once fetched and streams the rest.
-- Closing the pass (also on error) releases whatever it still holds, so after a
-- forward the model has no bytes on the device. In every other mode the weights are
-- wherever the pipeline loaded them and pass:run only frees the block's handles
-- after fn. In all modes the model is pinned while a pass is open (its own weights are
-- not evicted under it), and with a trace running each block is a span named
-- "<net> <block>".
--
-- Each pass:run starts with kiln.suspend_point(): a host may park the run there
-- (kiln_suspend), and a budget lowered while the run goes on takes effect there. When
-- evicting what no network holds is not enough, kiln.suspend_point calls
-- M.adapt(dev, excess) (registered below as the hook "stream_adapt"):
-- the open passes on that device whose weights are resident turn to streaming from
-- their next block (the model's device copies go, it is marked streamed with no
-- resident blocks, and the blocks are fetched one by one as in mode "low"), so the
-- numbers stay the same. It stays streamed until the pipeline loads it again (the
-- next stage, which then uses whatever budget there is).
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

-- True when this part's weights are streamed: a device target that is not the cpu,
-- and mode "low", a partial residency (the model was loaded with {resident = bytes}:
-- m.streamed), or no bytes left there (evicted since it was loaded).
function Weights:streaming()
  local m = self:model()
  if not m then return false end
  local dev = m.device
  if dev == nil or dev == "cpu" then return false end
  if kiln.memory_mode() == "low" or m.streamed then return true end
  -- loaded to dev and evicted since (a lowered budget, another model's room): it
  -- streams to where it was loaded rather than computing from the mapped file on
  -- the cpu
  return m:bytes(dev) == 0
end

-- The device the network computes on: the streaming target, else where the weight
-- `probe` lives now (the device it was loaded to, or the cpu for mapped weights).
function Weights:device(probe)
  if self:streaming() then return self.store.device end
  local t = self.store:tensor(self:real(probe))
  local d = t.device
  if self:model() then t:free() end
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
  -- every stored tensor behind a name: weights assembled from several (kiln.dit_files)
  -- answer :reals(name) with all of them
  local resolve = type(weights) == "table" and (weights.reals and function(n) return weights:reals(n) end or
      weights.real and function(n) return { weights:real(n) } end) or function(n) return { n } end
  for i, b in ipairs(blocks) do
    local real, seen = {}, {}
    for _, n in ipairs(b.names) do
      for _, r in ipairs(resolve(n)) do
        if not seen[r] then seen[r] = true; real[#real + 1] = r end
      end
    end
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

-- Bytes of each block's tensors as stored in the model: a list of {key, bytes}, and
-- the prefetch window (nil when the weights are not a kiln.Model).
function Streamer:block_bytes()
  local w = self.weights
  local m = type(w) == "table" and w.model and w:model()
  if not m then return nil end
  local sizes, window = self:_sizes(m)
  local r = {}
  for i, b in ipairs(self.blocks) do r[i] = { key = b.key, bytes = sizes[i] } end
  return r, window
end

-- Partial residency: about `bytes` of the model's blocks stay on the device once
-- fetched and the others stream at each pass (nil: none, every block streams). The
-- blocks kept are chosen largest first while they fit (fewest bytes copied per pass).
function Streamer:set_resident(bytes)
  self.resident_bytes = bytes
  self.resident = nil
  self.sizes, self.window = nil, nil   -- a load may change the copies' dtype (bytes)
end

-- The resident blocks (index -> true) and their bytes, for the current setting.
function Streamer:resident_blocks(m)
  if not self.resident_bytes then return {}, 0 end
  if not self.resident then
    local sizes = self:_sizes(m)
    local order = {}
    for i = 1, #sizes do order[i] = i end
    table.sort(order, function(a, b) return sizes[a] > sizes[b] or (sizes[a] == sizes[b] and a < b) end)
    local set, used = {}, 0
    for _, i in ipairs(order) do
      if used + sizes[i] <= self.resident_bytes then
        set[i] = true
        used = used + sizes[i]
      end
    end
    self.resident, self.resident_used = set, used
  end
  return self.resident, self.resident_used
end

-- Stored bytes of all the blocks.
function Streamer:total_bytes(m)
  local sizes = self:_sizes(m)
  local n = 0
  for _, b in ipairs(sizes) do n = n + b end
  return n
end

local Pass = {}
Pass.__index = Pass

-- The passes open now (M.adapt turns them to streaming).
local open = setmetatable({}, { __mode = "k" })

local function inactive_run(_, _, fn, ...) return fn(...) end
local INACTIVE = setmetatable({ run = inactive_run, streaming = false, hold_prefetch = function() end },
  { __close = function() end })

-- A forward pass over the blocks named in order (default: every block). Returns an
-- object to close when the forward ends (a to-be-closed variable). The model is pinned
-- while the pass is open: a network's own weights are never evicted under it (mode
-- "normal" would otherwise pick the model in use when its activations need room). In
-- every mode the tensor handles a block was given are freed when it ends, so an
-- :unload() after the forward gives the memory back at once, not at the next GC.
function Streamer:pass(order)
  local w = self.weights
  local m = type(w) == "table" and w.model and w:model()
  if not m then return INACTIVE end
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
  local streaming = w:streaming()
  local p = setmetatable({
    s = self, model = m, seq = seq, pos = 0, active = true, pinned = true,
    streaming = streaming,
    resident = streaming and self:resident_blocks(m) or {},  -- blocks fetched once, kept
    trace = kiln.trace and kiln.trace.active and kiln.trace.active() or false,
    held = {},       -- block index -> true while fetched or prefetched (streaming)
    handles = {},    -- block index -> tensor handles given out while it ran
    loose = {},      -- handles given out outside any block
    current = nil,
  }, Pass)
  w.pass = p
  open[p] = true
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

-- Stored bytes of each block (index -> bytes) and the prefetch window: the largest
-- two adjacent blocks of the plan. Computed once (the first streamed pass).
function Streamer:_sizes(m)
  if not self.sizes then
    local sizes, window = {}, 0
    for i, b in ipairs(self.blocks) do
      local n = 0
      for _, name in ipairs(b.real) do
        local t = m:tensor(name)
        n = n + t:nbytes()
        t:free()
      end
      sizes[i] = n
    end
    for i = 1, #sizes do window = math.max(window, sizes[i] + (sizes[i + 1] or 0)) end
    self.sizes, self.window = sizes, window
  end
  return self.sizes, self.window
end

-- Queues the blocks after position pos on the copy thread: always the next one, and
-- more while the blocks held stay within the window (small blocks are fetched ahead,
-- so the copy thread keeps working while a large block computes; the device never
-- holds more weights than the two largest adjacent blocks).
--- While held (a step cache has yet to decide which blocks run), no block is copied
-- ahead of its use: a block the cache then skips is never copied.
function Pass:hold_prefetch(on) self.held_prefetch = on or nil end

function Pass:_prefetch_after(pos)
  if self.held_prefetch then return end
  local sizes, window = self.s:_sizes(self.model)
  local held = 0
  for b in pairs(self.held) do held = held + sizes[b] end
  local j = pos + 1
  while self.seq[j] do
    local nb = self.seq[j]
    if not self.held[nb] and not self.resident[nb] then
      if j > pos + 1 and held + sizes[nb] > window then break end
      self.model:prefetch(self.s.blocks[nb].real)
      self.held[nb] = true
      held = held + sizes[nb]
    end
    j = j + 1
  end
end

-- Runs fn(...) as block `key`: its weights are on the device while fn runs and the
-- next block's are on their way.
function Pass:run(key, fn, ...)
  kiln.suspend_point()
  local b = self.s.index[key]
  if not b then error(fmt("%s: no block '%s' in the streaming plan", self.s.label, tostring(key)), 2) end
  -- position in the order: the next entry naming b at or after the current position
  local pos = self.pos + 1
  while self.seq[pos] and self.seq[pos] ~= b do pos = pos + 1 end
  if not self.seq[pos] then
    error(fmt("%s: block '%s' runs out of the pass's order", self.s.label, key), 2)
  end
  self.pos = pos
  if self.streaming then
    -- queue what follows first, so the copy thread works while this block is fetched
    -- (it waits for its own prefetch, or copies on this thread for the first block);
    -- a resident block is fetched once and never released by the pass (not held)
    if not self.resident[b] then self.held[b] = true end
    self:_prefetch_after(pos)
    self.model:fetch(self.s.blocks[b].real)
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

-- Releases what the pass still holds (an unused prefetch, a block that raised). The
-- bookkeeping comes first: a cancel is raised by a Lua hook wherever the script is, this
-- function included, and a pass left marked open (or its model pinned) would refuse
-- every later forward on these weights; what a raise here leaves unfreed, the
-- collector frees.
function Pass:close()
  if not self.active then return end
  self.active = false
  local w = self.s.weights
  if w.pass == self then w.pass = nil end
  open[self] = nil
  -- the model may have been closed by the network's caller meanwhile
  if self.pinned and not self.model.closed then pcall(self.model.unpin, self.model) end
  self.pinned = false
  for b in pairs(self.held) do self:_drop(b) end
  for b in pairs(self.handles) do free_all(self.handles[b]) end
  free_all(self.loose)
  self.handles = {}
end

Pass.__close = Pass.close

-- From here this pass streams its weights to dev block by block: the model's copies
-- are dropped (handles given out keep theirs until freed) and it loads again with
-- nothing resident, in the dtype it had.
function Pass:_to_streaming(dev)
  local m = self.model
  local dtype = m:stats().dtype
  m:unload()
  m:set_streamed(true)
  self.s:set_resident(nil)
  m:load(dev, dtype and { dtype = dtype } or nil)
  self.streaming = true
  self.resident = {}
  self.held = {}
end

-- kiln.suspend_point's answer to a lowered budget that the run's needs still exceed
-- by `excess` bytes on dev after eviction: the open passes computing there from
-- resident weights turn to streaming, the largest model first, until what they give
-- back (their weights less the streaming window) covers the excess.
function M.adapt(dev, excess)
  local list = {}
  for p in pairs(open) do
    if p.active and not p.streaming and not p.model.closed and p.model.device == dev then
      list[#list + 1] = { p = p, bytes = p.model:bytes(dev) }
    end
  end
  table.sort(list, function(a, b) return a.bytes > b.bytes end)
  for _, e in ipairs(list) do
    if excess <= 0 then return end
    local _, window = e.p.s:_sizes(e.p.model)
    e.p:_to_streaming(dev)
    excess = excess - math.max(0, e.bytes - window)
  end
end
kiln._register_hook("stream_adapt", M.adapt)

return M
