-- kiln.util: small helpers shared by the shipped scripts: command-line parsing and
-- its usage errors, the out-of-memory test, reading a network's shapes, and rounding
-- as Python and NumPy round.
local M = {}

--- x rounded to the nearest whole number, halves to the even neighbour (Python's
-- round, numpy.rint), as an integer when it is one.
function M.round_half_even(x)
  local f = math.floor(x)
  local d = x - f
  if d > 0.5 or (d == 0.5 and f % 2 == 1) then f = f + 1 end
  return math.tointeger(f) or f
end

-- A usage error says the command line is wrong, not the script: the kiln program
-- prints "kiln: <message>" and exits with status 2, without a traceback.
local USAGE_MT = { __tostring = function(e) return e.message end }

--- Raises a usage error: the table {kind = "usage", message = msg}.
function M.usage_error(msg)
  error(setmetatable({ kind = "usage", message = tostring(msg) }, USAGE_MT), 0)
end

--- "[a, b, c]": a shape (a Lua list of sizes) or a tensor's shape, for messages.
function M.shape_str(x)
  local s = (type(x) == "userdata" or (type(x) == "table" and x.shape)) and x.shape or x
  return "[" .. table.concat(s, ", ") .. "]"
end

--- Raises "WHO: 'path': msg" (or "WHO: msg" without a path) as a plain string error
-- at level (default 0: no position; the message names the file). How loaders say which
-- file is wrong.
function M.file_error(who, path, msg, level)
  error(string.format("%s: %s%s", who, path and ("'" .. path .. "': ") or "", msg), level or 0)
end

--- True when e is a usage error raised by util.usage_error.
function M.is_usage_error(e) return type(e) == "table" and e.kind == "usage" end

--- True when e is the runtime's out-of-memory error (a table with kind "oom").
function M.is_oom(e) return type(e) == "table" and e.kind == "oom" end

--- file (a name, no folder part) in dir or below it: the shallowest match, the first
-- in sorted order (case-sensitive); a name with a '/' only directly under dir. nil
-- when there is none. How LoRAs, embeddings and other models are found by name.
function M.find_file(dir, file)
  local lfs = require "lfs"
  local function join(a, b) return (a:gsub("/+$", "")) .. "/" .. b end
  local function mode(p) return lfs.attributes(p, "mode") end
  local direct = join(dir, file)
  if mode(direct) == "file" then return direct end
  if file:find("/", 1, true) then return nil end
  local level = { dir }
  for _ = 1, 16 do
    local next_level = {}
    for _, d in ipairs(level) do
      local ok, iter, state = pcall(lfs.dir, d)
      if ok then
        local entries = {}
        for n in iter, state do if n ~= "." and n ~= ".." then entries[#entries + 1] = n end end
        table.sort(entries)
        for _, n in ipairs(entries) do
          local p = join(d, n)
          if n == file and mode(p) == "file" then return p end
          if mode(p) == "directory" then next_level[#next_level + 1] = p end
        end
      end
    end
    if #next_level == 0 then return nil end
    level = next_level
  end
  return nil
end

--- The keys of a table, sorted (messages and files list names in a stable order).
function M.sorted_keys(t)
  local k = {}
  for n in pairs(t) do k[#k + 1] = n end
  table.sort(k)
  return k
end

-- Parses "--name value" / "--flag" command-line arguments into a table, with
-- defaults; a mistake (an unknown option, which lists the known ones, a missing or
-- malformed value) is a usage error.
function M.parse_args(args, defaults)
  local opts = {}
  for k, v in pairs(defaults) do opts[k] = type(v) == "table" and {} or v end -- lists: repeatable
  local i = 1
  while i <= #args do
    local a = args[i]
    local name = a:match("^%-%-([%w_%-]+)$")
    if not name then M.usage_error(("unexpected argument '%s'"):format(a)) end
    local key = name:gsub("%-", "_")
    if defaults[key] == nil then
      local known = {}
      for k in pairs(defaults) do known[#known + 1] = "--" .. k:gsub("_", "-") end
      table.sort(known)
      local near = M.nearest(key, defaults)
      M.usage_error(near and ("unknown option '--%s' (did you mean '--%s'?)"):format(name, near:gsub("_", "-"))
        or ("unknown option '--%s' (known: %s)"):format(name, table.concat(known, " ")))
    end
    if type(defaults[key]) == "boolean" then
      opts[key] = true
      i = i + 1
    else
      local v = args[i + 1]
      if v == nil then M.usage_error(("option '--%s' needs a value"):format(name)) end
      if type(defaults[key]) == "number" then
        v = tonumber(v) or M.usage_error(("--%s %s: not a number"):format(name, args[i + 1]))
      end
      if type(defaults[key]) == "table" then table.insert(opts[key], v) else opts[key] = v end
      i = i + 2
    end
  end
  return opts
end

--- The edit distance between two strings: insertions, deletions, substitutions and
-- swaps of two neighbours ("stpes" is one from "steps"), each costing one.
function M.edit_distance(a, b)
  local la, lb = #a, #b
  local d = {}
  for i = 0, la do d[i] = { [0] = i } end
  for j = 1, lb do d[0][j] = j end
  for i = 1, la do
    for j = 1, lb do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      local v = math.min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
      if i > 1 and j > 1 and a:byte(i) == b:byte(j - 1) and a:byte(i - 1) == b:byte(j) then
        v = math.min(v, d[i - 2][j - 2] + 1)
      end
      d[i][j] = v
    end
  end
  return d[la][lb]
end

--- The name of `names` (a list, or a set's keys) nearest to name, or nil when none is
-- near enough to be a likely misspelling (within a third of the longer name, at
-- least 2). Ties go to the alphabetically first, so the answer never varies.
function M.nearest(name, names)
  local list = {}
  for k, v in pairs(names) do list[#list + 1] = type(k) == "string" and k or v end
  table.sort(list)
  local best, bd
  for _, k in ipairs(list) do
    local dist = M.edit_distance(name, k)
    if not bd or dist < bd then best, bd = k, dist end
  end
  if bd and bd <= math.max(2, math.max(#name, #best) // 3) then return best end
  return nil
end

--- Checks that every key of opts (a table, or nil) is one of known (a set): an
-- unknown or misspelt option is an error "WHO: unknown option 'stpes' (did you mean
-- 'steps'?)" raised at level (default: the caller of the caller). Returns opts.
function M.check_options(opts, known, who, level)
  if opts == nil then return opts end
  if type(opts) ~= "table" then
    error(("%s: options must be a table, got %s"):format(who, type(opts)), level or 3)
  end
  local bad = {}
  for k in pairs(opts) do
    if not known[k] then bad[#bad + 1] = tostring(k) end
  end
  if #bad == 0 then return opts end
  table.sort(bad)                            -- the same message whatever the table's order
  local k = bad[1]
  local near = type(k) == "string" and M.nearest(k, known)
  local msg = ("%s: unknown option '%s'"):format(who, k)
  if near then
    msg = msg .. (" (did you mean '%s'?)"):format(near)
  else
    local names = {}
    for n in pairs(known) do names[#names + 1] = n end
    table.sort(names)
    msg = msg .. (" (known: %s)"):format(table.concat(names, ", "))
  end
  error(msg, level or 3)
end

-- Number of distinct indices matched by pattern's capture in a name -> shape table
-- (max index + 1): how many input_blocks, layers, levels a checkpoint has.
function M.count_indices(shapes, pattern)
  local n = -1
  for name in pairs(shapes) do
    local i = name:match(pattern)
    if i then n = math.max(n, tonumber(i)) end
  end
  return n + 1
end

-- The shape of a tensor a network's configuration is read from; a clear error
-- naming the network, the tensor and what it was needed for when absent.
function M.need_shape(shapes, name, what, net)
  local s = shapes[name]
  if not s then error(("%s: tensor '%s' not found (needed to read %s)"):format(net, name, what), 0) end
  return s
end

return M
