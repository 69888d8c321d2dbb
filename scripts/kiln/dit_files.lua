-- kiln.dit_files: the file plumbing the transformer families share (Flux, SD 3.5):
-- weights whose canonical tensor is stored as several (diffusers keeps a fused qkv as
-- to_q / to_k / to_v, and some halves in another order), ComfyUI's scaled fp8 (a
-- weight times its scale_weight), checking a file against a network's expected list
-- through such a layout, and building the network's part from it. A family's file
-- module (kiln.families.flux_files) says which tensors compose which; this one knows
-- no family.
--
-- A layout maps a canonical name (the reference code's, relative to the network's
-- root) either to one stored name (`map`, or the source's prefix) or to a list of
-- segments (`composite`): {{name = stored name, rows = {first, count} | nil}, ...},
-- concatenated along the first dimension in order.
local kiln = require "kiln"
local util = require "kiln.util"
local mf = require "kiln.model_files"
local stream = require "kiln.stream"
local part = require "kiln.part"

local M = {}
local fmt = string.format
local shape_str = util.shape_str

-- ---------------------------------------------------------------- weights

-- A stream.Weights that also assembles composite tensors and applies scales. The
-- streamer asks :reals(name) for every stored tensor behind a name, so the parts of a
-- composite are fetched, prefetched and released with their block.
local Weights = setmetatable({}, { __index = stream.Weights })
Weights.__index = Weights
M.Weights = Weights

--- store, prefix, map as stream.weights; composite (canonical -> segments) and scales
-- (canonical -> number) may be nil.
function M.weights(store, prefix, map, composite, scales)
  local w = stream.weights(store, prefix, map)
  w.composite, w.scales = composite, scales
  return setmetatable(w, Weights)
end

function Weights:real(name)
  local c = self.composite and self.composite[name]
  if c then return c[1].name end
  return stream.Weights.real(self, name)
end

-- Every stored name a canonical name reads (one, or a composite's parts).
function Weights:reals(name)
  local c = self.composite and self.composite[name]
  if not c then return { self:real(name) } end
  local r, seen = {}, {}
  for _, s in ipairs(c) do
    if not seen[s.name] then seen[s.name] = true; r[#r + 1] = s.name end
  end
  return r
end

function Weights:tensor(name)
  local c = self.composite and self.composite[name]
  local s = self.scales and self.scales[name]
  if not c and not s then return stream.Weights.tensor(self, name) end
  local t
  if c then
    local parts = {}
    for i, seg in ipairs(c) do
      local p = self.store:tensor(seg.name)
      if seg.rows then
        local v = p:narrow(1, seg.rows[1], seg.rows[2])
        p:free()
        p = v
      end
      parts[i] = p
    end
    t = #parts == 1 and parts[1]:contiguous() or kiln.cat(parts, 1)
    for _, p in ipairs(parts) do p:free() end
  else
    t = self.store:tensor(self:real(name))
  end
  if s then
    -- ComfyUI's scaled fp8: the weight is the stored value times scale_weight, in the
    -- dtype the network computes in (its dequantization: stored.to(dtype) * scale)
    local dt = kiln.activation_dtype and kiln.activation_dtype(t.device) or "f32"
    local f = t:to(dt)
    local r = f * s
    f:free(); t:free()
    t = r
  end
  local p = self.pass
  if p then p:_track(t) end
  return t
end

-- ---------------------------------------------------------------- layouts

local function numel(s)
  local n = 1
  for i = 1, #s do n = n * s[i] end
  return n
end

--- The shape a composite has from the stored shapes, or nil and the missing stored
-- names / a message.
function M.composite_shape(segs, shapes)
  local rows, rest, missing = 0, nil, {}
  for _, seg in ipairs(segs) do
    local s = shapes[seg.name]
    if not s then
      missing[#missing + 1] = seg.name
    else
      local r = seg.rows and seg.rows[2] or s[1]
      if seg.rows and seg.rows[1] + seg.rows[2] - 1 > s[1] then
        return nil, fmt("tensor '%s' has shape %s, too few rows for rows %d..%d", seg.name, shape_str(s),
          seg.rows[1], seg.rows[1] + seg.rows[2] - 1)
      end
      local tail = {}
      for i = 2, #s do tail[#tail + 1] = s[i] end
      local ts = table.concat(tail, ",")
      if rest and rest ~= ts then
        return nil, fmt("tensor '%s' has shape %s, the other parts of the same weight are [*, %s]", seg.name,
          shape_str(s), rest)
      end
      rest = ts
      rows = rows + r
    end
  end
  if #missing > 0 then return nil, nil, missing end
  local shape = { rows }
  for d in rest:gmatch("%d+") do shape[#shape + 1] = tonumber(d) end
  return shape
end

--- Canonical name -> shape of a layout (composites assembled), for reading the
-- configuration; names whose parts are missing are left out.
function M.canonical_shapes(shapes, map, composite)
  local r = {}
  for canon, real in pairs(map or {}) do r[canon] = shapes[real] end
  for canon, segs in pairs(composite or {}) do r[canon] = M.composite_shape(segs, shapes) end
  return r
end

--- Raises naming the stored tensors missing from composites the file has other parts
-- of (a damaged diffusers folder), before the configuration is read from the shapes.
function M.check_composites(path, src, who)
  local problems = {}
  for _, canon in ipairs(util.sorted_keys(src.composite or {})) do
    local _, _, missing = M.composite_shape(src.composite[canon], src.shapes)
    if missing and #missing < #src.composite[canon] then
      for _, n in ipairs(missing) do problems[#problems + 1] = fmt("missing tensor '%s' (part of %s)", n, canon) end
    end
  end
  if #problems > 0 then
    util.file_error(who or "kiln.load_checkpoint", path, fmt("the transformer's weights are incomplete (%d " ..
      "problem%s):\n  %s", #problems, #problems == 1 and "" or "s", table.concat(problems, "\n  ")))
  end
end

--- Checks every expected tensor against the file through the layout; raises one
-- error naming the file and the stored names (missing, or shapes that differ).
function M.validate(path, what, expected, src, who)
  local problems = {}
  local resolve = function(n) return src.map and src.map[n] or (src.prefix or "") .. n end
  for _, e in ipairs(expected) do
    local segs = src.composite and src.composite[e[1]]
    if segs then
      local shape, err, missing = M.composite_shape(segs, src.shapes)
      if missing then
        for _, n in ipairs(missing) do
          problems[#problems + 1] = fmt("missing tensor '%s' (part of %s %s)", n, e[1], shape_str(e[2]))
        end
      elseif err then
        problems[#problems + 1] = err
      elseif numel(shape) ~= numel(e[2]) or shape[1] ~= e[2][1] then
        problems[#problems + 1] = fmt("tensors %s..%s make %s, expected %s (%s)", segs[1].name, segs[#segs].name,
          shape_str(shape), shape_str(e[2]), e[1])
      end
    else
      local real = resolve(e[1])
      local got = src.shapes[real]
      if not got then
        problems[#problems + 1] = fmt("missing tensor '%s' (expected shape %s)", real, shape_str(e[2]))
      elseif shape_str(got) ~= shape_str(e[2]) then
        problems[#problems + 1] = fmt("tensor '%s' has shape %s, expected %s", real, shape_str(got), shape_str(e[2]))
      end
    end
  end
  if #problems > 0 then
    local n = #problems
    if n > 12 then
      for i = n, 13, -1 do problems[i] = nil end
      problems[13] = fmt("... and %d more", n - 12)
    end
    util.file_error(who or "kiln.load_checkpoint", path, fmt("the %s does not match the architecture its " ..
      "tensors describe (%d problem%s):\n  %s", what, n, n == 1 and "" or "s", table.concat(problems, "\n  ")))
  end
end

--- Every stored name the expected tensors read through the layout (each once).
function M.stored_names(expected, src)
  local r, seen = {}, {}
  local function add(n) if not seen[n] then seen[n] = true; r[#r + 1] = n end end
  for _, e in ipairs(expected) do
    local segs = src.composite and src.composite[e[1]]
    if segs then
      for _, s in ipairs(segs) do add(s.name) end
    else
      add(src.map and src.map[e[1]] or (src.prefix or "") .. e[1])
    end
  end
  return r
end

-- ---------------------------------------------------------------- scaled fp8

--- ComfyUI's scaled fp8 (a file with a `scaled_fp8` marker and `<weight name
-- without "weight">scale_weight` scalars): canonical weight name -> scale, or nil when
-- the file has none. Scales of composite weights are refused (no such file exists).
function M.scales(expected, src, who)
  local scales
  local resolve = function(n) return src.map and src.map[n] or (src.prefix or "") .. n end
  for _, e in ipairs(expected) do
    local name = e[1]
    if name:match("%.weight$") and not (src.composite and src.composite[name]) then
      local sname = resolve(name):gsub("weight$", "scale_weight")
      local t = src.tensors[sname]
      if t then
        if t:numel() ~= 1 then
          util.file_error(who or "kiln.load_checkpoint", src.path, fmt("%s has shape %s, expected one value",
            sname, shape_str(t)))
        end
        local f = t:to("f32")
        local v = f:reshape({ 1 })[1]
        if f ~= t then f:free() end
        if v ~= v or v == math.huge or v == -math.huge then
          util.file_error(who or "kiln.load_checkpoint", src.path, fmt("%s is %s, not a finite scale", sname, v))
        end
        if v ~= 1 then
          scales = scales or {}
          scales[name] = v
        end
      end
    end
  end
  return scales
end

-- ---------------------------------------------------------------- parts

--- The network `net` (a module with expected / new) over a source {path, paths,
-- tensors, shapes, prefix, map, composite}: validated, its scales read, its store
-- opened over exactly the stored tensors it reads. label: "Flux.1 transformer".
function M.build(net, src, cfg, label, who)
  local exp = net.expected(cfg)
  M.validate(src.path, label, exp, src, who)
  local scales = M.scales(exp, src, who)
  cfg.scaled = scales ~= nil
  local store = mf.open_store(src.paths, M.stored_names(exp, src), "dit", who)
  local w = M.weights(store, src.prefix, src.map, src.composite, scales)
  return part.as_model(net.new(w, cfg), store, "DiT")
end

return M
