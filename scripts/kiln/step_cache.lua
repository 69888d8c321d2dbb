-- kiln.step_cache: network work reused between sampler steps (opts.cache). One object
-- per run holds what the policies keep from step to step and decides, at a hook point
-- in the UNet's or Flux's forward, whether the rest of the network runs or is replaced.
--
-- The three policies, each as its published code decides:
--   fbcache   First-Block Cache (ParaAttention; Comfy-WaveSpeed's ApplyFBCacheOnModel):
--             the first block runs; when its output residual changed by less than
--             `threshold` (mean |prev - cur| / mean |prev|, against the residual of the
--             last step that ran in full) the rest of the network is replaced by the
--             residual it added at that step. UNet: the first block is input_blocks.1,
--             its residual the change over input_blocks.0's output; Flux: double block
--             0's image stream itself, as WaveSpeed's patch compares it.
--   teacache  TeaCache (Liu et al. 2024; ComfyUI-TeaCache): the relative L1 change of the
--             timestep-modulated input, rescaled by the family's polynomial, is summed
--             over steps; while the sum stays under `threshold` the whole network's
--             residual is reused, and a full step resets the sum. Flux: the modulated
--             input of double block 0 (img_norm1 + img_mod's shift and scale) with the
--             published Flux polynomial. SD UNets have no modulated input and no
--             published polynomial: kiln uses the timestep embedding every ResBlock takes
--             (as TeaCache does for the models it reads the timestep embedding of) with
--             the identity rescale, unless `coefficients` are given.
--   deepcache DeepCache (Ma et al. 2023), UNets: every `interval` steps the network runs
--             whole; between, only the input blocks up to skip branch `branch` (0 = the
--             shallowest) and the output blocks that take their skips run, the deeper
--             features coming from the last full step.
--
-- Steps are told apart by the timestep a forward is given: the same timestep again is
-- another call of the same step (cond and uncond run apart), which follows the first
-- call's decision with its own cached tensors; a larger timestep or another latent size
-- starts over (a new run, the second pass of a hires fix). Every cached tensor is owned
-- here, counted on its device like any tensor, and freed by :close() (a to-be-closed
-- value: the pipelines close it when the run ends, on an error too).
local kiln = require "kiln"
local util = require "kiln.util"

local M = {}
local Cache = {}
Cache.__index = Cache

M.MODES = { "fbcache", "teacache", "deepcache" }

-- the keys of opts.cache
M.OPTIONS = { mode = true, threshold = true, interval = true, branch = true, max_hits = true,
  coefficients = true }

-- The published rescale polynomials (highest power first), by family.
M.COEFFICIENTS = {
  flux = { 4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01 },
  unet = { 1, 0 },   -- no published fit for SD UNets: the identity
}

-- Defaults per mode and network kind: WaveSpeed's suggested FBCache threshold, TeaCache's
-- node default for Flux, DeepCache's code defaults (cache_interval 3, branch 0). The UNet
-- thresholds were chosen on the demo model and the SD 1.5-shaped checkpoint (the bench's
-- numbers are in tests/bench/JOURNAL.md).
M.DEFAULTS = {
  fbcache = { unet = 0.12, flux = 0.12 },
  teacache = { unet = 0.8, flux = 0.4 },
  deepcache = { interval = 3, branch = 0 },
}

--- The polynomial sum_i c[i] * x^(n - i) (NumPy's poly1d order).
function M.poly(c, x)
  local r = 0
  for i = 1, #c do r = r * x + c[i] end
  return r
end

--- mean |cur - prev| / mean |prev| (0 when prev is all zeros and so is the change).
function M.rel_l1(prev, cur)
  local d = cur - prev
  local a = d:abs()
  d:free()
  local num = a:mean()
  a:free()
  local p = prev:abs()
  local den = p:mean()
  p:free()
  if den == 0 then return num == 0 and 0 or math.huge end
  return num / den
end

local function check_number(v, what, who, lo, integer)
  if type(v) ~= "number" or v ~= v or v < lo or (integer and math.tointeger(v) == nil) then
    error(("%s: %s must be %s >= %s, got %s"):format(who, what, integer and "a whole number" or "a number",
      tostring(lo), tostring(v)), 4)
  end
end

--- Checks an opts.cache table (nil, false: no caching) and returns it with its defaults
-- filled for a network of kind "unet" | "flux", or nil. who names the caller in errors.
function M.spec(c, kind, who)
  if c == nil or c == false then return nil end
  who = who or "cache"
  if type(c) == "string" then c = { mode = c } end
  if type(c) ~= "table" then error(("%s: must be a table {mode = ...} or a mode name, got %s"):format(who, type(c)), 3) end
  util.check_options(c, M.OPTIONS, who, 4)
  local mode = c.mode
  if not M.DEFAULTS[mode] then
    error(("%s: unknown mode '%s' (known: %s)"):format(who, tostring(mode), table.concat(M.MODES, ", ")), 3)
  end
  if mode == "deepcache" and kind ~= "unet" then
    error(("%s: deepcache needs a UNet (this network is %s)"):format(who, tostring(kind)), 3)
  end
  local s = { mode = mode, kind = kind }
  if mode == "deepcache" then
    s.interval = c.interval or M.DEFAULTS.deepcache.interval
    s.branch = c.branch or M.DEFAULTS.deepcache.branch
    check_number(s.interval, "interval", who, 1, true)
    check_number(s.branch, "branch", who, 0, true)
  else
    s.threshold = c.threshold or M.DEFAULTS[mode][kind]
    check_number(s.threshold, "threshold", who, 0)
  end
  s.max_hits = c.max_hits or -1
  check_number(s.max_hits, "max_hits", who, -1, true)
  if mode == "teacache" then
    s.coefficients = c.coefficients or M.COEFFICIENTS[kind]
    if type(s.coefficients) ~= "table" or #s.coefficients < 1 then
      error(("%s: coefficients must be a list of numbers (highest power first)"):format(who), 3)
    end
    for i, v in ipairs(s.coefficients) do check_number(v, "coefficients[" .. i .. "]", who, -math.huge) end
  end
  return s
end

--- A cache for one run. spec: from M.spec (or an opts.cache table, checked here).
function M.new(spec, kind)
  if spec and not spec.kind then spec = M.spec(spec, kind, "cache") end
  if not spec then return nil end
  return setmetatable({
    spec = spec, mode = spec.mode, kind = spec.kind,
    calls = 0,      -- forwards made with this cache
    evals = 0,      -- of them, full network evaluations
    steps = 0,      -- distinct steps seen since the last reset
    slots = {},     -- per call of a step: the tensors it keeps
    slot = nil, t_prev = nil, key = nil,
    skip = false,   -- this step's decision (made by its first call)
    decided = false,
    acc = 0,        -- TeaCache's accumulated rescaled distance
    hits = 0,       -- consecutive cached steps (max_hits)
    trace = {},     -- per step: {value = v, skip = bool} (the tests' record)
  }, Cache)
end

local function free_slot(s)
  for k, v in pairs(s) do
    if type(v) == "userdata" then v:free() end
    s[k] = nil
  end
end

--- Frees every cached tensor (idempotent); counts stay.
function Cache:close()
  for _, s in pairs(self.slots) do free_slot(s) end
  self.slots = {}
end
Cache.__close = Cache.close

function Cache:reset()
  self:close()
  self.steps, self.acc, self.hits, self.t_prev = 0, 0, 0, nil
end

local function set(slot, k, v)
  if slot[k] then slot[k]:free() end
  slot[k] = v
end

--- Called at the start of a forward with its first timestep and x's shape.
function Cache:begin(tval, shape)
  local key = table.concat(shape, "x", 2)
  if self.t_prev == nil or key ~= self.key or tval > self.t_prev then
    self:reset()
    self.slot = 1
  elseif tval == self.t_prev then
    self.slot = self.slot + 1
  else
    self.slot = 1
  end
  self.t_prev, self.key = tval, key
  self.calls = self.calls + 1
  if self.slot == 1 then
    self.steps = self.steps + 1
    self.decided = false
    if self.mode == "deepcache" then self:_decide((self.steps - 1) % self.spec.interval ~= 0, self.steps - 1) end
  end
  self.cur = self.slots[self.slot] or {}
  self.slots[self.slot] = self.cur
  self.full = true   -- until a hook replaces part of the network
end

-- Records this step's decision (first call), applying max_hits.
function Cache:_decide(skip, value)
  local mh = self.spec.max_hits
  if skip and mh >= 0 and self.hits >= mh then skip = false end
  self.hits = skip and self.hits + 1 or 0
  self.skip, self.decided = skip, true
  self.trace[#self.trace + 1] = { value = value, skip = skip }
  return skip
end

-- Whether a decision is still to come in this forward (the streamed pass holds its
-- prefetch until then, so a skipped block is never copied).
function Cache:pending() return self.slot == 1 and not self.decided end

--- FBCache's rule on the first block's residual r (taken over). Returns true to reuse.
function Cache:fb_first(r)
  local slot = self.cur
  local skip
  if self.slot == 1 then
    local prev = slot.first
    local value = (prev and util.shape_str(prev) == util.shape_str(r)) and M.rel_l1(prev, r) or nil
    skip = self:_decide(value ~= nil and slot.residual ~= nil and value < self.spec.threshold, value)
  else
    skip = self.skip
  end
  if skip and not (slot.residual and util.shape_str(slot.residual) == util.shape_str(r)) then skip = false end
  if skip then r:free() else set(slot, "first", r) end
  return skip
end

--- TeaCache's rule on the modulated input m (taken over). Returns true to reuse.
function Cache:tea_input(m)
  local slot = self.cur
  local skip
  if self.slot == 1 then
    local prev = slot.prev_input
    local value
    if prev and util.shape_str(prev) == util.shape_str(m) then
      value = M.rel_l1(prev, m)
      self.acc = self.acc + math.abs(M.poly(self.spec.coefficients, value))
    end
    if value == nil or self.acc >= self.spec.threshold then
      skip = self:_decide(false, value)
      self.acc = 0
    else
      skip = self:_decide(true, value)
      if not skip then self.acc = 0 end   -- max_hits forced a full step
    end
  else
    skip = self.skip
  end
  set(slot, "prev_input", m)
  return skip
end

--- A policy that reuses the network's residual: h (the input the rest of the network
-- starts from) plus the cached residual, or nil when this call runs in full (h is then
-- kept to compute the new residual at the end).
function Cache:residual_or_anchor(skip, h)
  local slot = self.cur
  if skip and slot.residual and util.shape_str(slot.residual) == util.shape_str(h) then
    self.full = false
    return h + slot.residual
  end
  set(slot, "anchor", h:clone())
  return nil
end

--- At the end of a full call: the residual the network added over the anchor.
function Cache:store_residual(h)
  local slot = self.cur
  if not self.full or not slot.anchor then return end
  set(slot, "residual", h - slot.anchor)
  set(slot, "anchor", nil)
end

--- Called when the forward ends: counts a full evaluation.
function Cache:finish()
  if self.full then self.evals = self.evals + 1 end
  local slot = self.cur
  if slot then set(slot, "anchor", nil) end
end

-- ------------------------------------------------------------- UNet hook points

--- After input block i (1-based) of a UNet with outputs hs (hs[#hs] is the current h)
-- and emb_silu the time embedding. Returns nil to go on, or h and the output block to
-- resume at (#plan.output + 1: straight to the out layer); the caller frees hs.
function Cache:unet_after_input(i, hs, emb_silu, n_out)
  local mode = self.mode
  if mode == "fbcache" and i == 2 then
    local h = self:residual_or_anchor(self:fb_first(hs[2] - hs[1]), hs[2])
    if h then return h, n_out + 1 end
  elseif mode == "teacache" and i == 1 then
    local h = self:residual_or_anchor(self:tea_input(emb_silu:clone()), hs[1])
    if h then return h, n_out + 1 end
  elseif mode == "deepcache" and i == self.spec.branch + 1 then
    local deep = self.cur.deep
    if self.skip and deep and deep.shape[1] == hs[i].shape[1] then
      self.full = false
      return deep:clone(), n_out - self.spec.branch
    end
  end
  return nil
end

--- Before output block j with its input h (deepcache keeps the deep features).
function Cache:unet_before_output(j, h, n_out)
  if self.mode == "deepcache" and self.full and j == n_out - self.spec.branch then
    set(self.cur, "deep", h:clone())
  end
end

-- ------------------------------------------------------------- Flux hook points

--- Whether Flux's first double block should compute TeaCache's modulated input.
function Cache:wants_modulated_input() return self.mode == "teacache" end

return M
