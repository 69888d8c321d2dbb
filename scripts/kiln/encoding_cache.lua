-- kiln.encoding_cache: a bounded cache of text encodings, so that the same prompt through
-- the same encoder (same weights, length and precision, on the same device) is encoded
-- once. A T5-XXL encode streams 9.5 GB of weights; a hit costs nothing.
--
-- Its entries are ordinary tensors on the encoder's device, counted by that device's
-- statistics like any other. The memory budget evicts them: an allocation that does not
-- fit first evicts model weights, then gives back cached segments, then calls the
-- allocators' pressure hook, which runs this module's handler (kiln._on_pressure) before
-- its garbage collection: every entry on the device that ran short is dropped. So a run
-- never fails for the cache's sake; an evicted prompt is simply encoded again.
--
-- Ownership: get / fetch return a new handle (a view) on the cached storage. The caller
-- owns that handle and may free it whenever it likes; the storage lives until both the
-- caller's handle and the cache's entry are gone. It is a read-only reference: writing
-- into it (copy, fill) would change the cache; take :clone() for a private copy.
--
--   local c = encoding_cache.new{limit = bytes, what = "t5"}   (limit 0: off)
--   c:fetch(key, fn, ...) -> tensors    a hit's views, or fn(...)'s results, cached
--                                       (every result a tensor or nil: CLIP's
--                                       conditioning and pooled vector are one entry)
--   c:get(key) -> views | nil ; c:put(key, tensors...) ; c:clear() ; c:set_limit(bytes)
--   c:stats() -> {entries, bytes, limit, hits, misses, evicted}
--   encoding_cache.evict(device) -> bytes freed: what the pressure handler does
--   encoding_cache.on_pressure: the handler, registered when the module loads
local kiln = require "kiln"

local M = {}
local Cache = {}
Cache.__index = Cache

local fmt = string.format
M.DEFAULT_LIMIT = 64 * 1024 * 1024

-- every cache alive, for the pressure handler; weak, so a cache dies with its encoder
local caches = setmetatable({}, { __mode = "k" })

local function view_of(t)
  if t:dim() == 0 then return t:reshape({}) end
  return t:narrow(1, 1, t.shape[1])
end

local function check_limit(limit, who)
  if limit == nil then return M.DEFAULT_LIMIT end
  if type(limit) == "string" then
    local ok, b = pcall(kiln.parse_size, limit)
    if not ok then error(fmt("%s: cache limit '%s': %s", who, limit, tostring(b)), 4) end
    limit = b
  end
  if math.type(limit) ~= "integer" or limit < 0 then
    error(fmt("%s: the cache limit must be bytes (an integer >= 0, 0 turns the cache off) or a size like \"64M\", got %s",
      who, tostring(limit)), 4)
  end
  return limit
end

--- A new cache: opts.limit in bytes (default 64 MiB; 0 keeps nothing), opts.what names
-- it in errors.
function M.new(opts)
  opts = opts or {}
  local what = opts.what or "encoding cache"
  local self = setmetatable({
    what = what, limit = check_limit(opts.limit, what),
    entries = {}, -- key -> {ts = {tensors, n =}, bytes, used, device}
    bytes = 0, clock = 0, hits = 0, misses = 0, evicted = 0,
  }, Cache)
  caches[self] = true
  return self
end

local function drop(self, key)
  local e = self.entries[key]
  if not e then return 0 end
  self.entries[key] = nil
  self.bytes = self.bytes - e.bytes
  for i = 1, e.ts.n do
    if e.ts[i] then e.ts[i]:free() end
  end
  return e.bytes
end

-- least recently used first, until `bytes` more fit under the limit
local function make_room(self, bytes)
  while self.bytes + bytes > self.limit do
    local oldest, okey
    for k, e in pairs(self.entries) do
      if not oldest or e.used < oldest.used then oldest, okey = e, k end
    end
    if not oldest then return end
    drop(self, okey)
  end
end

-- A dry run's tensors live on the shape-only device: nothing is looked up then (a dry
-- run predicts a miss), and what a miss would keep is held as the real run's entry would
-- be, until the dry run ends (kiln.dry_run's ending hooks): a stage after the encode
-- (the decode) holds the cached encoding in the real run, so the prediction counts it.
local function bypass() return kiln.mem.meta_target() ~= nil end
local dry_held = {}
table.insert(require("kiln.dry_run").ending, function()
  for i = #dry_held, 1, -1 do
    dry_held[i]:free()
    dry_held[i] = nil
  end
end)

function Cache:get(key)
  if bypass() then return nil end
  local e = self.entries[key]
  if not e then return nil end
  self.clock = self.clock + 1
  e.used = self.clock
  local views = { n = e.ts.n }
  for i = 1, e.ts.n do views[i] = e.ts[i] and view_of(e.ts[i]) end
  return table.unpack(views, 1, views.n)
end

local function is_tensor(v)
  local mt = type(v) == "userdata" and getmetatable(v)
  return type(mt) == "table" and mt.__name == "kiln.Tensor"
end

--- Keeps views of the tensors given (they stay the caller's). An entry larger than the
-- limit is not kept; nor is one holding anything but tensors and nils.
function Cache:put(key, ...)
  if self.limit == 0 then return end
  local dry = bypass()
  if not dry then drop(self, key) end
  local n = select("#", ...)
  local ts, bytes, device = { n = n }, 0, nil
  for i = 1, n do
    local t = select(i, ...)
    if t ~= nil then
      if not is_tensor(t) then return end
      bytes = bytes + t:nbytes()
      device = device or t.device
    end
  end
  if n == 0 or bytes > self.limit then return end
  if dry then
    for i = 1, n do
      local t = select(i, ...)
      if t then dry_held[#dry_held + 1] = view_of(t) end
    end
    return
  end
  make_room(self, bytes)
  for i = 1, n do
    local t = select(i, ...)
    ts[i] = t and view_of(t)
  end
  self.clock = self.clock + 1
  self.entries[key] = { ts = ts, bytes = bytes, used = self.clock, device = device }
  self.bytes = self.bytes + bytes
end

local function put_through(self, key, ...)
  self:put(key, ...)
  return ...
end

--- The cached encoding of key (views) or fn(...)'s results (also cached).
function Cache:fetch(key, fn, ...)
  if not bypass() and self.entries[key] then
    self.hits = self.hits + 1
    return self:get(key)
  end
  if not bypass() then self.misses = self.misses + 1 end
  return put_through(self, key, fn(...))
end

function Cache:clear()
  for k in pairs(self.entries) do drop(self, k) end
end

function Cache:set_limit(limit)
  self.limit = check_limit(limit, self.what)
  make_room(self, 0)
end

function Cache:stats()
  local n = 0
  for _ in pairs(self.entries) do n = n + 1 end
  return { entries = n, bytes = self.bytes, limit = self.limit, hits = self.hits, misses = self.misses,
    evicted = self.evicted }
end

--- Drops every entry held on device (every entry when device is nil); returns the bytes
-- of the entries dropped (their storage is freed once no caller's view holds it).
function M.evict(device)
  local freed = 0
  for c in pairs(caches) do
    for k, e in pairs(c.entries) do
      if device == nil or e.device == device then
        freed = freed + drop(c, k)
        c.evicted = c.evicted + 1
      end
    end
  end
  return freed
end

--- The pressure handler: the allocators' pressure hook calls it with the device's name
-- before its collection (bindings/l_config.c). A dry run's pressure is the shape-only
-- device's: the entries are elsewhere.
function M.on_pressure(device)
  if kiln.mem.meta_target() then return end
  M.evict(device)
end
kiln._on_pressure(M.on_pressure)

return M
