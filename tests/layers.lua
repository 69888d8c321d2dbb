-- tests/layers.lua - the layer test's checker (tests/test_layers.sh runs it with lua5.4).
-- Builds the file-level dependency graph of runtime/, kernels/ and bindings/ from two
-- sources: the objects' symbols (`nm`: an undefined symbol of one object defined by
-- another is a call or a data reference, exact for what links) and the `#include "..."`
-- lines of every .c/.h/.cu. A .c and the .h of the same name in the same folder are
-- one node ("runtime/alloc"), and so are the files of a module split around a private
-- X_internal.h (see node_of). Then checks:
--   loops     no cycle among the nodes (each one found is named, edge by edge);
--   lua       runtime/ and kernels/ never include lua.h (or its siblings) nor depend
--             on anything in bindings/;
--   kernels   runtime/ never depends on kernels/: the backends reach the runtime
--             through runtime/backend.h (their tables), and the initialisation code
--             (luaopen_kiln, a test's main) hands them in;
--   stack     the memory core's declared order: a file whose opening comment says
--             "layer N of the memory core: uses a, b; never calls c" depends on no
--             other layered file but a and b, each of a lower layer, and never on c.
-- Edges listed in the allowance file (tests/layers_known.txt: known problems being
-- fixed on another branch) are reported as KNOWN and left out of the checks; an
-- allowance whose edge no longer exists fails, so the list is emptied as fixes land.
-- Prints PASS/FAIL lines for tests/run.sh.
--
-- usage: lua5.4 tests/layers.lua BUILD_DIR [ALLOWANCE_FILE]

local build = arg[1] or "build"
local known_file = arg[2] or "tests/layers_known.txt"
local DIRS = { "runtime", "kernels", "bindings" }
local LUA_HEADERS = { ["lua.h"] = true, ["lauxlib.h"] = true, ["lualib.h"] = true, ["luaconf.h"] = true }

local n_fail = 0
local function pass(name) print("PASS " .. name) end
local function fail(name, msg) n_fail = n_fail + 1; print("FAIL " .. name .. ": " .. msg) end
local function note(msg) print("# " .. msg) end

local function lines_of(cmd)
  local p = assert(io.popen(cmd))
  local t = {}
  for l in p:lines() do t[#t + 1] = l end
  p:close()
  return t
end

local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- a/b/../c -> a/c
local function normalize(path)
  local out = {}
  for part in path:gmatch("[^/]+") do
    if part == ".." and #out > 0 and out[#out] ~= ".." then out[#out] = nil
    elseif part ~= "." then out[#out + 1] = part end
  end
  return table.concat(out, "/")
end

local function top_of(node) return node:match("^([^/]+)") end

-- ---- the files ----------------------------------------------------------------

local files, is_file = {}, {}
for _, l in ipairs(lines_of("find " .. table.concat(DIRS, " ") ..
    " -type f \\( -name '*.c' -o -name '*.h' -o -name '*.cu' \\) | sort")) do
  files[#files + 1] = l
  is_file[l] = true
end

-- A .c and its .h are one node; so is a module split into several files around a
-- private header: X.c, X_<part>.c and X_internal.h (runtime/model*.c, kernels/cpu/gemm*.c)
-- are the one node X, since the header says they are one unit and nothing else includes it.
local function node_of(path)
  local base = path:gsub("%.[ch]u?$", "")
  local dir, name = base:match("^(.*)/([^/]+)$")
  if not dir then return base end
  local p = name
  while p do
    if is_file[dir .. "/" .. p .. "_internal.h"] and is_file[dir .. "/" .. p .. ".c"] then return dir .. "/" .. p end
    p = p:match("^(.*)_[^_]+$")
  end
  return base
end

-- edges[from][to] = { calls = {sym=true...}, includes = {"a.c includes b.h", ...} }
local edges, nodes = {}, {}
local function add_node(n) nodes[n] = true end
local function edge(from, to)
  edges[from] = edges[from] or {}
  local e = edges[from][to]
  if not e then e = { calls = {}, includes = {} }; edges[from][to] = e end
  return e
end

-- ---- includes -----------------------------------------------------------------

local lua_includes = {} -- runtime/kernels files that include a Lua header
for _, path in ipairs(files) do
  add_node(node_of(path))
  local src = read(path) or ""
  local dir = path:match("^(.*)/") or "."
  for line in src:gmatch("[^\n]*") do
    local inc = line:match('^%s*#%s*include%s*"([^"]+)"')
    if inc then
      local target = normalize(dir .. "/" .. inc)
      local from_top = top_of(path)
      if LUA_HEADERS[inc:match("[^/]+$")] and (from_top == "runtime" or from_top == "kernels") then
        lua_includes[#lua_includes + 1] = path .. " includes " .. inc
      end
      if is_file[target] then
        local a, b = node_of(path), node_of(target)
        if a ~= b then
          local e = edge(a, b)
          e.includes[#e.includes + 1] = path .. " includes " .. inc
        end
      end
    end
  end
end

-- ---- objects --------------------------------------------------------------------

-- Which objects make the library: every source's object, except that kernels/cuda
-- holds either cuda_none.c (a build without CUDA) or cuda_backend.c, cuda_context.c and
-- the .cu files,
-- as libkiln.a's members say (both may lie in the build folder from earlier builds).
local members = {}
for _, m in ipairs(lines_of("ar t " .. build .. "/libkiln.a 2>/dev/null")) do members[m] = true end
if not next(members) then
  fail("layers_objects", build .. "/libkiln.a is missing: build first (make CUDA=0)")
  os.exit(1)
end
local cuda_built = members["cuda_backend.o"]
local objects = {}
for _, path in ipairs(files) do
  if path:match("%.cu?$") and not path:match("^bindings/kiln_main%.c$") and not path:match("^bindings/repl_") then
    local in_cuda = path:match("^kernels/cuda/")
    local keep = true
    if in_cuda then
      if path:match("cuda_none%.c$") then keep = not cuda_built else keep = cuda_built end
    end
    local obj = build .. "/obj/" .. path:gsub("%.cu?$", "") .. ".o"
    if keep and exists(obj) then objects[#objects + 1] = { obj = obj, node = node_of(path) } end
  end
end
for _, l in ipairs(lines_of("ls " .. build .. "/obj/gen/*.o 2>/dev/null")) do
  local n = "gen/" .. l:match("([^/]+)%.o$")
  objects[#objects + 1] = { obj = l, node = n }
  add_node(n)
end

local defined_by, undefined = {}, {}
local obj_node = {}
for _, o in ipairs(objects) do obj_node[o.obj] = o.node end
local list = {}
for _, o in ipairs(objects) do list[#list + 1] = o.obj end
local cur
for _, l in ipairs(lines_of("nm -g " .. table.concat(list, " "))) do
  local f = l:match("^(.-):$")
  if f then cur = obj_node[f]
  elseif cur then
    local ty, sym = l:match("^%s*%x*%s+(%a)%s+(%S+)$")
    if ty == "U" or ty == "w" then
      undefined[#undefined + 1] = { node = cur, sym = sym }
    elseif ty then
      defined_by[sym] = defined_by[sym] or cur
    end
  end
end
local n_calls = 0
for _, u in ipairs(undefined) do
  local to = defined_by[u.sym]
  if to and to ~= u.node then
    edge(u.node, to).calls[u.sym] = true
    n_calls = n_calls + 1
  end
end
note(string.format("%d objects, %d cross-object symbol references", #objects, n_calls))

-- ---- the allowance ----------------------------------------------------------------

-- each line "from -> to  reason": an edge left out of the checks; `*` in a name
-- stands for any characters but "/" (bindings/l_* is every l_ file of bindings/)
local allowed = {}
for line in (read(known_file) or ""):gmatch("[^\n]+") do
  local from, to, reason = line:match("^%s*([^#%s]%S*)%s*%->%s*(%S+)%s*(.*)$")
  if from then
    local function pat(x) return "^" .. x:gsub("[%-%.%+%?%^%$%(%)%%]", "%%%0"):gsub("%*", "[^/]*") .. "$" end
    allowed[#allowed + 1] = { key = from .. " -> " .. to, from = pat(from), to = pat(to), reason = reason, hits = {} }
  end
end

local function allowance(from, to)
  for _, a in ipairs(allowed) do
    if from:match(a.from) and to:match(a.to) then return a end
  end
end

local function describe(from, to)
  local e = edges[from][to]
  local parts = {}
  local syms = {}
  for s in pairs(e.calls) do syms[#syms + 1] = s end
  table.sort(syms)
  if #syms > 0 then
    local shown = {}
    for i = 1, math.min(3, #syms) do shown[i] = syms[i] end
    parts[#parts + 1] = "calls " .. table.concat(shown, ", ") .. (#syms > 3 and (" +" .. (#syms - 3)) or "")
  end
  if #e.includes > 0 then parts[#parts + 1] = e.includes[1] end
  return table.concat(parts, "; ")
end

for from, tos in pairs(edges) do
  for to in pairs(tos) do
    local a = allowance(from, to)
    if a then a.hits[#a.hits + 1] = from .. " -> " .. to end
  end
end
local stale = 0
for _, a in ipairs(allowed) do
  if #a.hits == 0 then
    stale = stale + 1
    fail("layers_allowance_current", a.key .. " no longer exists: remove its line from " .. known_file)
  else
    table.sort(a.hits)
    note("KNOWN " .. a.key .. " (" .. #a.hits .. " edge" .. (#a.hits > 1 and "s" or "") .. ", e.g. " .. a.hits[1] ..
      ": " .. describe(a.hits[1]:match("^(%S+) %-> (%S+)$")) .. "): " .. a.reason)
  end
end
if stale == 0 then pass("layers_allowance_current") end

local function live(from, to) return not allowance(from, to) end

-- ---- (a) loops ------------------------------------------------------------------------

local sorted_nodes = {}
for n in pairs(nodes) do sorted_nodes[#sorted_nodes + 1] = n end
table.sort(sorted_nodes)
local function succ(n)
  local t = {}
  for to in pairs(edges[n] or {}) do if live(n, to) then t[#t + 1] = to end end
  table.sort(t)
  return t
end

-- Tarjan's strongly connected components
local index, low, on_stack, stack, sccs, counter = {}, {}, {}, {}, {}, 0
local function strong(v)
  counter = counter + 1
  index[v], low[v] = counter, counter
  stack[#stack + 1] = v
  on_stack[v] = true
  for _, w in ipairs(succ(v)) do
    if not index[w] then
      strong(w)
      low[v] = math.min(low[v], low[w])
    elseif on_stack[w] then
      low[v] = math.min(low[v], index[w])
    end
  end
  if low[v] == index[v] then
    local comp = {}
    repeat
      local w = table.remove(stack)
      on_stack[w] = nil
      comp[#comp + 1] = w
    until w == v
    if #comp > 1 then table.sort(comp); sccs[#sccs + 1] = comp end
  end
end
for _, n in ipairs(sorted_nodes) do if not index[n] then strong(n) end end

-- the shortest cycle through start inside its component (breadth first)
local function cycle_through(start, comp)
  local inside = {}
  for _, n in ipairs(comp) do inside[n] = true end
  local prev, queue, head = { [start] = false }, { start }, 1
  while head <= #queue do
    local v = queue[head]; head = head + 1
    for _, w in ipairs(succ(v)) do
      if w == start then
        local path = { start }
        local x = v
        while x ~= start do table.insert(path, 2, x); x = prev[x] end
        path[#path + 1] = start
        return path
      end
      if inside[w] and prev[w] == nil then prev[w] = v; queue[#queue + 1] = w end
    end
  end
end

if #sccs == 0 then pass("layers_no_loops") end
for _, comp in ipairs(sccs) do
  -- every node of the knot in one line, then each node's shortest loop once
  fail("layers_no_loops", "files in one loop: " .. table.concat(comp, ", "))
  local seen = {}
  for _, start in ipairs(comp) do
    local path = cycle_through(start, comp)
    local key = {}
    for i = 1, #path - 1 do key[#key + 1] = path[i] end
    table.sort(key)
    key = table.concat(key, " ")
    if path and not seen[key] then
      seen[key] = true
      local steps = {}
      for i = 1, #path - 1 do
        steps[#steps + 1] = path[i] .. " -> " .. path[i + 1] .. " (" .. describe(path[i], path[i + 1]) .. ")"
      end
      print("     loop: " .. table.concat(steps, "; "))
    end
  end
end

-- ---- (b) the core never reaches Lua or bindings/; (c) runtime/ never reaches kernels/ ----

local bad_lua, bad_kernels = {}, {}
for _, from in ipairs(sorted_nodes) do
  local ft = top_of(from)
  for to in pairs(edges[from] or {}) do
    if live(from, to) then
      local tt = top_of(to)
      if (ft == "runtime" or ft == "kernels") and tt == "bindings" then
        bad_lua[#bad_lua + 1] = from .. " -> " .. to .. " (" .. describe(from, to) .. ")"
      end
      if ft == "runtime" and tt == "kernels" then
        bad_kernels[#bad_kernels + 1] = from .. " -> " .. to .. " (" .. describe(from, to) .. ")"
      end
    end
  end
end
for _, l in ipairs(lua_includes) do bad_lua[#bad_lua + 1] = l end
table.sort(bad_lua)
table.sort(bad_kernels)
if #bad_lua == 0 then pass("layers_core_without_lua") end
for _, l in ipairs(bad_lua) do fail("layers_core_without_lua", l) end
if #bad_kernels == 0 then pass("layers_runtime_below_kernels") end
for _, l in ipairs(bad_kernels) do fail("layers_runtime_below_kernels", l) end

-- ---- (d) the memory core's declared order ---------------------------------------------

-- "layer N of the memory core: uses a, b; never calls c, d." in a file's opening
-- comment (the .h or the .c of a node; both must agree when both say it)
local layer, uses, never, declared_in = {}, {}, {}, {}
local bad_decl = {}
local function names(s)
  local t = {}
  for w in (s or ""):gmatch("[%w_/]+") do
    if w ~= "nothing" and w ~= "and" then t[#t + 1] = w:match("/") and w or ("runtime/" .. w) end
  end
  return t
end
for _, path in ipairs(files) do
  local head = (read(path) or ""):match("^/%*(.-)%*/") or ""
  head = head:gsub("\n%s*%*", " ")
  local n, rest = head:match("layer (%d+) of the memory core:%s*(.-)%.%s")
  if not n then n, rest = head:match("layer (%d+) of the memory core:%s*(.-)%.$") end
  if n then
    local node = node_of(path)
    n = tonumber(n)
    if layer[node] and layer[node] ~= n then
      bad_decl[#bad_decl + 1] = path .. " says layer " .. n .. ", " .. declared_in[node] .. " says " .. layer[node]
    end
    layer[node], declared_in[node] = n, path
    local u = rest:match("uses%s+([^;]*)")
    local nv = rest:match("never calls%s+([^;]*)")
    uses[node] = uses[node] or {}
    never[node] = never[node] or {}
    for _, x in ipairs(names(u)) do uses[node][x] = true end
    for _, x in ipairs(names(nv)) do never[node][x] = true end
  end
end
local layered = {}
for n in pairs(layer) do layered[#layered + 1] = n end
table.sort(layered, function(a, b) return layer[a] < layer[b] or (layer[a] == layer[b] and a < b) end)
local order = {}
for _, n in ipairs(layered) do order[#order + 1] = layer[n] .. ":" .. n end
note("memory core, bottom up: " .. table.concat(order, " "))

local bad_order = {}
for _, l in ipairs(bad_decl) do bad_order[#bad_order + 1] = l end
if #layered == 0 then bad_order[#bad_order + 1] = "no file declares a layer of the memory core" end
for _, from in ipairs(layered) do
  for x in pairs(uses[from]) do
    if not nodes[x] then bad_order[#bad_order + 1] = declared_in[from] .. " uses " .. x .. ", which is no file"
    elseif layer[x] and layer[x] >= layer[from] then
      bad_order[#bad_order + 1] = declared_in[from] .. " (layer " .. layer[from] .. ") declares it uses " .. x ..
        " (layer " .. layer[x] .. ")"
    end
  end
  for to in pairs(edges[from] or {}) do
    if live(from, to) then
      local why = describe(from, to)
      if never[from][to] then
        bad_order[#bad_order + 1] = from .. " depends on " .. to .. ", which it says it never calls (" .. why .. ")"
      elseif layer[to] and layer[to] >= layer[from] then
        bad_order[#bad_order + 1] = from .. " (layer " .. layer[from] .. ") depends on " .. to .. " (layer " ..
          layer[to] .. "): " .. why
      elseif layer[to] and not uses[from][to] then
        bad_order[#bad_order + 1] = from .. " depends on " .. to .. " but its opening comment does not list it (" ..
          why .. ")"
      end
    end
  end
end
table.sort(bad_order)
if #bad_order == 0 then pass("layers_memory_core_order") end
for _, l in ipairs(bad_order) do fail("layers_memory_core_order", l) end

os.exit(n_fail == 0 and 0 or 1)
