-- kiln.comfy.registry: the one table of ComfyUI node types kiln runs. The topic files
-- (kiln.comfy.loaders, .conditioning, .sampling, .latent, .vae, .image) and user scripts
-- (kiln.comfy.add_node) register here; kiln.comfy reads the definitions to check a graph.
--
-- A definition carries its input spec as ComfyUI's INPUT_TYPES does, so that a bad value
-- is refused by name before anything runs:
--   { inputs = { { "width", "INT", default = 512, min = 16, max = 16384, step = 8 },
--                { "crop", { "disabled", "center" } },            -- a combo: one of a list
--                { "vae", "VAE", optional = true },               -- a link, may be left out
--                { "ckpt_name", "FILE:checkpoints" } },           -- a file in models/checkpoints/
--     outputs = { "LATENT" }, output = false, category = "latent",
--     run = function(ctx, args) return { ctx:latent(t) } end }
-- Types: INT, FLOAT, STRING, BOOLEAN, a combo (a list of values, or COMBO with
-- `choices` a list or a function returning one), FILE:<folder>[|<legacy folder>], or
-- a link type (MODEL, CLIP, VAE, LATENT, IMAGE, MASK, CONDITIONING, ...: upper case).
local M = {}
local fmt = string.format

local LITERAL = { INT = true, FLOAT = true, STRING = true, BOOLEAN = true }
M.LITERAL = LITERAL

local DEF_KEYS = { inputs = true, outputs = true, run = true, output = true, category = true, description = true,
  model_file = true }
local INPUT_KEYS = { default = true, min = true, max = true, step = true, round = true, optional = true,
  tooltip = true, multiline = true, choices = true }

local nodes = {}        -- name -> normalized definition
local aliases = {}      -- functions (folder, name) -> folder, candidate names

--- ComfyUI node types that kiln knows and cannot run yet: name -> why (a workflow using
-- one fails before anything runs and says so).
M.not_yet = {}

local function keys_sorted(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = tostring(k) end
  table.sort(ks)
  return table.concat(ks, ", ")
end

-- a number as a message shows it (2^64 as ComfyUI's 0xffffffffffffffff)
local function num(v)
  if v == 18446744073709551615.0 then return "18446744073709551615" end
  if math.type(v) == "float" and v == math.floor(v) and math.abs(v) < 2 ^ 53 then return fmt("%.1f", v) end
  return tostring(v)
end
M.num = num

--- The choices of a combo input now (a function's list is asked each time: the samplers
-- a build has, the files a folder holds).
function M.choices(inp)
  local c = inp.choices
  if type(c) == "function" then c = c() end
  return c or {}
end

-- one input of a definition checked and normalized: {name, type, choices, default,
-- min, max, step, optional, ...}; bad() raises with the definition's name
local function input_spec(raw, i, bad, seen)
  if type(raw) ~= "table" then bad(fmt("input %d must be a table {name, type, ...}, got %s", i, type(raw))) end
  local name, ty = raw[1], raw[2]
  if type(name) ~= "string" or name == "" then bad(fmt("input %d: its name (first field) must be a string", i)) end
  local function ibad(msg) bad(fmt("input '%s': %s", name, msg)) end
  if seen[name] then ibad("named twice") end
  seen[name] = true
  for k in pairs(raw) do
    if not (k == 1 or k == 2 or INPUT_KEYS[k]) then
      ibad(fmt("unknown field '%s' (known: %s)", tostring(k), keys_sorted(INPUT_KEYS)))
    end
  end
  local s = { name = name, default = raw.default, min = raw.min, max = raw.max, step = raw.step, round = raw.round,
    optional = raw.optional and true or false, tooltip = raw.tooltip, multiline = raw.multiline }
  if type(ty) == "table" then
    s.type, s.choices = "COMBO", ty
  elseif ty == "COMBO" then
    s.type, s.choices = "COMBO", raw.choices
    if type(s.choices) ~= "table" and type(s.choices) ~= "function" then
      ibad("a COMBO needs choices (a list, or a function returning one)")
    end
  elseif type(ty) == "string" and (LITERAL[ty] or ty:match("^FILE:[%w_]+[%w_|]*$") or ty:match("^[%u_][%u%d_]*$")) then
    s.type = ty
  else
    ibad(fmt("type must be INT, FLOAT, STRING, BOOLEAN, a list (combo), COMBO, FILE:<folder> or an upper-case "
      .. "link type, got %s", type(ty) == "string" and ("'" .. ty .. "'") or type(ty)))
  end
  if raw.choices ~= nil and s.type ~= "COMBO" then ibad("choices are for a combo") end
  if type(s.choices) == "table" then
    if #s.choices == 0 then ibad("a combo needs at least one choice") end
    for _, c in ipairs(s.choices) do
      if type(c) ~= "string" and type(c) ~= "number" then ibad("a combo's choices are strings or numbers") end
    end
  end
  local numeric = s.type == "INT" or s.type == "FLOAT"
  for _, k in ipairs({ "min", "max", "step", "round" }) do
    if s[k] ~= nil then
      if not numeric then ibad(fmt("%s is for INT and FLOAT inputs", k)) end
      if type(s[k]) ~= "number" then ibad(fmt("%s must be a number, got %s", k, type(s[k]))) end
    end
  end
  if s.step ~= nil and s.step <= 0 then ibad("step must be > 0") end
  if s.min and s.max and s.min > s.max then ibad(fmt("min %s is above max %s", num(s.min), num(s.max))) end
  local d = s.default
  if d ~= nil then
    if s.type == "INT" then
      if math.tointeger(d) == nil then ibad(fmt("default must be a whole number, got %s", tostring(d))) end
      s.default = math.tointeger(d)
    elseif s.type == "FLOAT" then
      if type(d) ~= "number" then ibad("default must be a number") end
    elseif s.type == "STRING" or s.type:match("^FILE:") then
      if type(d) ~= "string" then ibad("default must be a string") end
    elseif s.type == "BOOLEAN" then
      if type(d) ~= "boolean" then ibad("default must be true or false") end
    elseif s.type == "COMBO" then
      if type(s.choices) == "table" then
        local ok = false
        for _, c in ipairs(s.choices) do ok = ok or c == d end
        if not ok then ibad(fmt("default '%s' is not one of its choices", tostring(d))) end
      end
    else
      ibad(fmt("a link input (%s) has no default; mark it optional instead", s.type))
    end
    if numeric and ((s.min and d < s.min) or (s.max and d > s.max)) then
      ibad(fmt("default %s is outside [%s, %s]", num(d), num(s.min or -math.huge), num(s.max or math.huge)))
    end
  elseif s.type == "COMBO" and type(s.choices) == "table" then
    s.default = s.choices[1]            -- ComfyUI's combo shows its first value
  end
  return s
end

--- Registers the node type `name` (opts.replace: replace one already there, as a custom
-- node pack may). The definition is checked whole first; returns the stored definition.
function M.add_node(name, def, opts)
  local who = "kiln.comfy.add_node"
  if type(name) ~= "string" or name == "" or name:match("[%c]") then
    error(fmt("%s: the node name must be a non-empty string, got %s", who, type(name) == "string" and ("'" .. name .. "'") or type(name)), 2)
  end
  local function bad(msg) error(fmt("%s: %s: %s", who, name, msg), 0) end
  if type(def) ~= "table" then bad("the definition must be a table, got " .. type(def)) end
  if nodes[name] and not (opts and opts.replace) then
    bad("already registered (pass {replace = true} to replace it)")
  end
  for k in pairs(def) do
    if not DEF_KEYS[k] then bad(fmt("unknown field '%s' (known: %s)", tostring(k), keys_sorted(DEF_KEYS))) end
  end
  if type(def.run) ~= "function" then bad("run must be a function(ctx, args) returning the list of outputs") end
  if def.inputs ~= nil and type(def.inputs) ~= "table" then bad("inputs must be a list") end
  if type(def.outputs) ~= "table" then bad("outputs must be a list of types ({} for none)") end
  if def.output ~= nil and type(def.output) ~= "boolean" then bad("output must be true or false") end
  if def.category ~= nil and type(def.category) ~= "string" then bad("category must be a string") end
  local d = { name = name, inputs = {}, outputs = {}, run = def.run, output = def.output or false,
    category = def.category, description = def.description, model_file = def.model_file }
  local seen = {}
  for i, raw in ipairs(def.inputs or {}) do d.inputs[i] = input_spec(raw, i, bad, seen) end
  for i, o in ipairs(def.outputs) do
    if type(o) ~= "string" or not o:match("^[%u_][%u%d_]*$") then
      bad(fmt("output %d must be an upper-case type name, got %s", i, tostring(o)))
    end
    d.outputs[i] = o
  end
  if not d.output and #d.outputs == 0 then bad("a node with no outputs must be an output node (output = true)") end
  if d.model_file ~= nil then
    local ok = false
    for _, inp in ipairs(d.inputs) do ok = ok or (inp.name == d.model_file and inp.type:match("^FILE:") ~= nil) end
    if not ok then bad("model_file must name one of its FILE: inputs") end
  end
  nodes[name] = d
  return d
end

--- The definition of a node type, or nil.
function M.get(name) return nodes[name] end

--- The node types registered, sorted.
function M.names()
  local list = {}
  for k in pairs(nodes) do list[#list + 1] = k end
  table.sort(list)
  return list
end

--- A rule for names a loader takes that stand for another file: fn(folder, name) ->
-- folder, {candidate file names} or nil (VAELoader's "taesd").
function M.add_file_alias(fn)
  if type(fn) ~= "function" then error("kiln.comfy.registry.add_file_alias: a function", 2) end
  aliases[#aliases + 1] = fn
end

function M.file_alias(folder, name)
  for _, fn in ipairs(aliases) do
    local f, cands = fn(folder, name)
    if f then return f, cands end
  end
end

--- A literal value of input `inp` checked against its spec (where: "node ID (CLASS)").
-- v nil: the default, nil where there is none and the input is optional. Raises
-- naming the node, input, value and what is allowed. FILE inputs are the caller's.
function M.check_literal(where, inp, v)
  local name, ty = inp.name, inp.type
  local function fail(msg, ...) error(fmt("kiln.comfy: %s: input '%s' " .. msg, where, name, ...), 0) end
  if v == nil then v = inp.default end
  if v == nil or (v == false and not LITERAL[ty] and ty ~= "COMBO" and not ty:match("^FILE:")) then
    if inp.optional then return nil end
    local what = ty:match("^FILE:") and ("a file name in " .. ty:sub(6):gsub("|", "/ or ") .. "/") or ty
    fail("(%s) is missing", what)
  end
  if ty == "INT" then
    if math.tointeger(v) == nil then fail("must be a whole number, got %s", tostring(v)) end
    v = math.tointeger(v)
  elseif ty == "FLOAT" then
    if type(v) ~= "number" then fail("must be a number, got %s", type(v)) end
  elseif ty == "STRING" then
    if type(v) ~= "string" then fail("must be a string, got %s", type(v)) end
  elseif ty == "BOOLEAN" then
    if type(v) ~= "boolean" then fail("must be true or false, got %s", tostring(v)) end
  elseif ty == "COMBO" then
    local list = M.choices(inp)
    local ok = false
    for _, c in ipairs(list) do ok = ok or c == v end
    if not ok then
      local shown = {}
      for i, c in ipairs(list) do shown[i] = tostring(c) end
      fail("is '%s', not one of %s", tostring(v), table.concat(shown, ", "))
    end
  elseif not ty:match("^FILE:") then
    fail("must link to a %s output, got %s", ty, require("kiln").json.encode(v))
  end
  if ty == "INT" or ty == "FLOAT" then
    local lo, hi = inp.min or -math.huge, inp.max or math.huge
    if v < lo or v > hi then
      fail("is %s, %s (allowed: %s to %s)", num(v), v < lo and ("below the minimum " .. num(lo)) or
        ("above the maximum " .. num(hi)), num(lo), num(hi))
    end
  end
  return v
end

return M
