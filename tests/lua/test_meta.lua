-- The LuaLS definition file (bindings/kiln.meta.lua) against the live module: every
-- function the kiln table, its public submodules and the methods of kiln's userdata
-- classes export must be declared there; the failure lists the missing names.
-- Declarations are read as lines: `function kiln.NAME(`, `function kiln.SUB.NAME(`,
-- and `function Class:NAME(` after `---@class kiln.Class` + `local Class = {}`.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test = H.test

local META = "bindings/kiln.meta.lua"
-- Submodules that are public API even while they load lazily (kiln.X -> require "kiln.X").
local PUBLIC_MODULES = { "nn", "mem", "trace", "sample", "tile", "pipeline", "util", "cli", "extra_networks", "lora", "image", "comfy" }

-- ---------------------------------------------------------------- the meta file

local declared, classes, problems = {}, {}, {}
local meta_lines = {}
do
  local f = assert(io.open(META, "r"))
  for line in f:lines() do meta_lines[#meta_lines + 1] = line end
  f:close()
  local pending_class -- "---@class kiln.X" waiting for its `local X = {}`
  local params = {}   -- ---@param names just above the next function
  for n, line in ipairs(meta_lines) do
    local cls = line:match("^%-%-%-@class%s+kiln%.([%w_]+)")
    if cls then pending_class = cls end
    local loc = line:match("^local%s+([%w_]+)%s*=%s*{%s*}")
    if loc and pending_class then classes[loc] = "kiln." .. pending_class; pending_class = nil end
    local p = line:match("^%-%-%-@param%s+([%w_%.]+)")
    if p then params[#params + 1] = p end
    local name, args = line:match("^function%s+([%w_%.:]+)%s*%(([^)]*)%)")
    if name then
      local owner, sep, method = name:match("^([%w_]+)([:%.])([%w_]+)$")
      if owner and classes[owner] then
        declared[classes[owner] .. ":" .. method] = n
      elseif name:match("^kiln%.") then
        declared[name] = n
      end
      -- each ---@param must name a parameter of the signature
      local have = {}
      for a in args:gmatch("[%w_%.]+") do have[a] = true end
      for _, pn in ipairs(params) do
        if not have[pn] then problems[#problems + 1] = ("%s:%d: ---@param %s is not a parameter of %s(%s)"):format(META, n, pn, name, args) end
      end
    end
    if not line:match("^%-%-%-") then params = {} end
  end
end

-- ---------------------------------------------------------------- the live module

local function functions_of(t, prefix, sep, out)
  for k, v in pairs(t) do
    if type(k) == "string" and type(v) == "function" and not k:match("^_") then
      out[#out + 1] = prefix .. sep .. k
    end
  end
end

local function missing_of(list)
  local missing = {}
  for _, name in ipairs(list) do
    if not declared[name] then missing[#missing + 1] = name end
  end
  table.sort(missing)
  return missing
end

local function check(list, what)
  local missing = missing_of(list)
  if #missing > 0 then
    error(("%d %s not declared in %s (add ---@param/---@return annotated declarations):\n  %s")
      :format(#missing, what, META, table.concat(missing, "\n  ")), 0)
  end
end

test("the meta file compiles and its ---@param names match the signatures", function()
  local chunk, err = loadfile(META) -- compiled, not run: it would replace the global kiln
  H.truthy(chunk, err)
  if #problems > 0 then error(table.concat(problems, "\n"), 0) end
  H.truthy(next(declared), "no declarations found")
end)

test("every function of the kiln table is declared", function()
  local live = {}
  functions_of(kiln, "kiln", ".", live)
  check(live, "kiln functions")
end)

test("every function of the public submodules is declared", function()
  local live, absent = {}, {}
  for _, m in ipairs(PUBLIC_MODULES) do
    local ok, t = pcall(function() return kiln[m] end)
    if not ok then error(("kiln.%s failed to load: %s"):format(m, tostring(t)), 0) end
    if type(t) == "table" then functions_of(t, "kiln." .. m, ".", live)
    else absent[#absent + 1] = "kiln." .. m end
  end
  -- C submodules and modules cached on the table by now
  for k, v in pairs(kiln) do
    if type(k) == "string" and type(v) == "table" then
      local listed = false
      for _, m in ipairs(PUBLIC_MODULES) do listed = listed or m == k end
      if not listed then functions_of(v, "kiln." .. k, ".", live) end
    end
  end
  if #absent > 0 then print("# not present in this build: " .. table.concat(absent, ", ")) end
  check(live, "submodule functions")
end)

-- Methods of a userdata class: its metatable's __methods / __index table, or the
-- tables an __index function closes over (kiln.Model keeps its methods there).
local function methods_of(mt)
  local tables = {}
  if type(rawget(mt, "__methods")) == "table" then tables[#tables + 1] = rawget(mt, "__methods") end
  local idx = rawget(mt, "__index")
  if type(idx) == "table" then tables[#tables + 1] = idx end
  if type(idx) == "function" then
    for i = 1, 32 do
      local name, v = debug.getupvalue(idx, i)
      if name == nil then break end
      if type(v) == "table" and v ~= kiln then tables[#tables + 1] = v end
    end
  end
  return tables
end

test("every method of the kiln userdata classes is declared", function()
  local live, seen = {}, {}
  for k, mt in pairs(debug.getregistry()) do
    if type(k) == "string" and k:match("^kiln%.[%w_]+$") and type(mt) == "table" and rawget(mt, "__name") == k then
      seen[#seen + 1] = k
      for _, t in ipairs(methods_of(mt)) do functions_of(t, k, ":", live) end
    end
  end
  table.sort(seen)
  H.truthy(#seen > 0, "no kiln userdata classes in the registry")
  check(live, "methods (of " .. table.concat(seen, ", ") .. ")")
end)

-- The string literals of a `---@alias kiln.NAME "a"|"b"|...` line, sorted.
local function alias_values(name)
  for _, line in ipairs(meta_lines) do
    local body = line:match("^%-%-%-@alias%s+kiln%." .. name .. "%s+(.*)$")
    if body then
      local vals = {}
      for v in body:gmatch('"([^"]*)"') do vals[#vals + 1] = v end
      table.sort(vals)
      return vals
    end
  end
end

-- The registries of kiln.sample are the one list of samplers and schedulers: the
-- editor's name aliases must list exactly their names.
for _, c in ipairs({ { "SamplerName", "names" }, { "SchedulerName", "scheduler_names" } }) do
  test(("---@alias kiln.%s lists kiln.sample.%s()"):format(c[1], c[2]), function()
    local want = table.concat(kiln.sample[c[2]](), "|")
    local have = alias_values(c[1])
    H.truthy(have, ("no ---@alias kiln.%s in %s"):format(c[1], META))
    if table.concat(have, "|") ~= want then
      local quoted = {}
      for name in want:gmatch("[^|]+") do quoted[#quoted + 1] = '"' .. name .. '"' end
      error(("%s's kiln.%s is out of step with the registry; write:\n---@alias kiln.%s %s")
        :format(META, c[1], c[1], table.concat(quoted, "|")), 0)
    end
  end)
end

test("the tensor methods seen from a tensor are declared", function()
  local t = kiln.zeros({ 1 })
  local live = {}
  functions_of(getmetatable(t).__methods or {}, "kiln.Tensor", ":", live)
  H.truthy(#live > 10, "tensor methods not found through __methods")
  check(live, "tensor methods")
end)

H.done()
