-- kiln.util: small helpers shared by the shipped scripts.
local util = {}

-- Parses "--name value" / "--flag" command-line arguments into a table, with
-- defaults; unknown options are an error that lists the known ones.
function util.parse_args(args, defaults)
  local opts = {}
  for k, v in pairs(defaults) do opts[k] = v end
  local i = 1
  while i <= #args do
    local a = args[i]
    local name = a:match("^%-%-([%w_%-]+)$")
    if not name then error(("unexpected argument '%s'"):format(a), 2) end
    local key = name:gsub("%-", "_")
    if defaults[key] == nil then
      local known = {}
      for k in pairs(defaults) do known[#known + 1] = "--" .. k:gsub("_", "-") end
      table.sort(known)
      error(("unknown option '--%s' (known: %s)"):format(name, table.concat(known, " ")), 2)
    end
    if type(defaults[key]) == "boolean" then
      opts[key] = true
      i = i + 1
    else
      local v = args[i + 1]
      if v == nil then error(("option '--%s' needs a value"):format(name), 2) end
      if type(defaults[key]) == "number" then
        v = tonumber(v) or error(("option '--%s' needs a number, got '%s'"):format(name, args[i + 1]), 2)
      end
      opts[key] = v
      i = i + 2
    end
  end
  return opts
end

-- Number of distinct indices matched by pattern's capture in a name -> shape table
-- (max index + 1): how many input_blocks, layers, levels a checkpoint has.
function util.count_indices(shapes, pattern)
  local n = -1
  for name in pairs(shapes) do
    local i = name:match(pattern)
    if i then n = math.max(n, tonumber(i)) end
  end
  return n + 1
end

-- The shape of a tensor a network's configuration is read from; a clear error
-- naming the network, the tensor and what it was needed for when absent.
function util.need_shape(shapes, name, what, net)
  local s = shapes[name]
  if not s then error(("%s: tensor '%s' not found (needed to read %s)"):format(net, name, what), 0) end
  return s
end

return util
