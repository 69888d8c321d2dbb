-- kiln.comfy: runs ComfyUI workflows in the API format (node id -> {class_type,
-- inputs}, a link being [node id, output index]), given as a file, a PNG with a
-- `prompt` text chunk, JSON text or a decoded table. The node types live in
-- kiln.comfy.registry, filled by the topic files kiln.comfy.loaders, .conditioning,
-- .sampling, .latent, .vae and .image, and by scripts through kiln.comfy.add_node; every
-- input is checked against its node's spec (ComfyUI's types, ranges and lists) before
-- anything runs.
--
-- What ComfyUI lacks and this module adds is lifetimes taken from the graph: the
-- nodes that lead to an output run in dependency order; every result is counted by
-- the inputs still to read it and freed after its last reader; every model (a
-- checkpoint's UNet, text encoder and VAE, a ControlNet, an upscaler) is unloaded once
-- no live result holds it, and offloaded between two uses. The run stays inside the
-- device's budget and memory mode as any kiln run. opts.keep_all keeps everything to
-- the end instead (ComfyUI's way), for comparison.
--
--   local files = kiln.comfy.run("workflow.json", { models = "ComfyUI/models", output = "out" })
local kiln = require "kiln"
local lfs = require "lfs"
local util = require "kiln.util"
local registry = require "kiln.comfy.registry"
local V = require "kiln.comfy.values"
-- the built-in node types, one file per topic (as ComfyUI's categories group them);
-- each registers its nodes when loaded
for _, topic in ipairs({ "loaders", "conditioning", "sampling", "latent", "vae", "image", "flux", "gguf", "sd3",
  "step_cache" }) do
  require("kiln.comfy." .. topic)
end

local M = {}
local fmt = string.format

local function fail(msg) error("kiln.comfy: " .. msg, 0) end

local function join(a, b) return (a:gsub("/+$", "")) .. "/" .. b end
local function mode_of(p) return lfs.attributes(p, "mode") end

-- ------------------------------------------------------------------ reading

--- The text chunks of a PNG file (tEXt, and uncompressed iTXt) as key -> text.
-- ComfyUI writes the API JSON as `prompt` and its UI graph as `workflow`.
function M.png_text(path)
  local f = io.open(path, "rb")
  if not f then util.file_error("kiln.comfy", path, "cannot open") end
  local data = f:read("a")
  f:close()
  if data:sub(1, 8) ~= "\137PNG\r\n\26\n" then util.file_error("kiln.comfy", path, "not a PNG file") end
  local out, pos = {}, 9
  while pos + 8 <= #data do
    local len, kind = string.unpack(">I4c4", data, pos)
    local body = data:sub(pos + 8, pos + 7 + len)
    if kind == "tEXt" then
      local k, v = body:match("^([^%z]*)%z(.*)$")
      if k then out[k] = v end
    elseif kind == "iTXt" then
      local k, flag, rest = body:match("^([^%z]*)%z(.).(.*)$")
      if k and flag == "\0" then
        local v = rest:match("^[^%z]*%z[^%z]*%z(.*)$")
        if v then out[k] = v end
      elseif k then
        out[k] = false -- compressed: kiln does not inflate text chunks
      end
    elseif kind == "zTXt" then
      local k = body:match("^([^%z]*)%z")
      if k then out[k] = false end
    elseif kind == "IEND" then
      break
    end
    pos = pos + 12 + len
  end
  return out
end

-- A workflow from a path (.json or .png), JSON text or a table: the graph and the
-- JSON text it came as (SaveImage's `prompt` chunk).
local function read_workflow(src)
  if type(src) == "table" then
    -- a value JSON cannot write (inf, NaN, a function) is the workflow's fault
    local ok, text = pcall(kiln.json.encode, src)
    if not ok then fail("the workflow table has no JSON form: " .. tostring(text):gsub("^.-kiln%.json%.encode: ", "")) end
    return src, text
  end
  if type(src) ~= "string" then fail("a workflow is a path, JSON text or a table, got " .. type(src)) end
  local text = src
  if not src:match("^%s*{") then
    if mode_of(src) ~= "file" then util.file_error("kiln.comfy", src, "no such file") end
    if src:lower():match("%.png$") then
      local chunks = M.png_text(src)
      if chunks.prompt == false then
        util.file_error("kiln.comfy", src, "its prompt chunk is compressed (zTXt/iTXt), which kiln does not read")
      end
      if not chunks.prompt then
        util.file_error("kiln.comfy", src, chunks.workflow and "it has only ComfyUI's UI workflow, not the API format (prompt chunk)"
          or "no ComfyUI workflow in it (no prompt text chunk)")
      end
      text = chunks.prompt
    else
      local f = assert(io.open(src, "rb"))
      text = f:read("a")
      f:close()
    end
  end
  local ok, g = pcall(kiln.json.decode, text)
  if not ok then fail("the workflow is not valid JSON: " .. tostring(g)) end
  if type(g) ~= "table" then fail("the workflow must be a JSON object (node id -> {class_type, inputs})") end
  return g, text
end

-- ------------------------------------------------------------------ checking

local supported_list = registry.names

--- The node types kiln runs (the built-in ones and those added), sorted.
function M.supported() return registry.names() end

--- Adds a node type (or, with opts.replace, replaces one) for the workflows run after:
-- kiln.comfy.registry documents the definition; it is checked whole here.
function M.add_node(name, def, opts)
  local ok, d = pcall(registry.add_node, name, def, opts)
  if not ok then error(d, 2) end
  return d
end

local function is_link(v)
  return type(v) == "table" and #v == 2 and (type(v[1]) == "string" or math.tointeger(v[1]) ~= nil)
    and math.tointeger(v[2]) ~= nil
end

local function node_name(id, n) return fmt("node %s (%s)", id, n and n.class_type or "?") end

-- where a model file of `folders` (ComfyUI's folder names, "|" between a current and a
-- legacy one: "diffusion_models|unet") named `name` is: models/folder/name (or found by
-- name below it); input/ for LoadImage (opts.input overrides it). A name the nodes
-- alias (VAELoader's "taesd") is looked for as the file it stands for.
local function find_model(opts, folders, name, where)
  if type(name) ~= "string" or name == "" then fail(fmt("%s: needs a file name", where)) end
  local looked = {}
  for folder in folders:gmatch("[^|]+") do
    local cands = { name }
    local afolder, anames = registry.file_alias(folder, name)
    if afolder then folder, cands = afolder, anames end
    local dir = folder == "input" and opts.input or join(opts.models or "models", folder)
    for _, n in ipairs(cands) do
      local p = join(dir, n)
      if mode_of(p) == "file" then return p end
      local found = mode_of(dir) == "directory" and util.find_file(dir, n)
      if found then return found end
    end
    looked[#looked + 1] = dir .. "/"
  end
  fail(fmt("%s: model '%s' not found in %s", where, name, table.concat(looked, " or ")))
end

-- The graph checked: every node known, every link to an existing node's output of the
-- right type, every literal of the right kind, every file found. Returns the nodes
-- table id -> {id, class_type, spec, args (name -> literal or {link = id, index})}.
local function check(g, opts)
  local out = {}
  if g.nodes and g.links and type(g.nodes) == "table" then
    fail("this is ComfyUI's UI workflow (nodes, links), not the API format: in ComfyUI enable the "
      .. "dev mode options and use Workflow > Export (API)")
  end
  for id, n in pairs(g) do
    id = tostring(id)
    if type(n) ~= "table" or type(n.class_type) ~= "string" then
      fail(fmt("node %s: must be an object with class_type and inputs", id))
    end
    local spec = registry.get(n.class_type)
    if not spec then
      if registry.not_yet[n.class_type] then
        fail(fmt("%s: not supported yet: %s", node_name(id, n), registry.not_yet[n.class_type]))
      end
      fail(fmt("%s: unknown node type '%s' (kiln runs: %s)", node_name(id, n), n.class_type,
        table.concat(supported_list(), ", ")))
    end
    if n.inputs ~= nil and type(n.inputs) ~= "table" then fail(node_name(id, n) .. ": inputs must be an object") end
    out[id] = { id = id, class_type = n.class_type, spec = spec, raw = n.inputs or {}, args = {} }
  end
  for id, n in pairs(out) do
    local where = node_name(id, n)
    for _, inp in ipairs(n.spec.inputs) do
      local name, ty = inp.name, inp.type
      local v = n.raw[name]
      if is_link(v) then
        local src = out[tostring(v[1])]
        if not src then
          fail(fmt("%s: input '%s' links to node %s, which does not exist", where, name, tostring(v[1])))
        end
        local idx = math.tointeger(v[2])
        local produced = src.spec.outputs[idx + 1]
        if not produced then
          fail(fmt("%s: input '%s' links to output %d of %s, which has %d output(s)", where, name, idx,
            node_name(src.id, src), #src.spec.outputs))
        end
        -- a file name or a combo's value may come from a node's STRING output
        local want = (ty:match("^FILE:") or ty == "COMBO") and "STRING" or ty
        if produced ~= want then
          fail(fmt("%s: input '%s' expects %s, but output %d of %s is %s", where, name, want, idx,
            node_name(src.id, src), produced))
        end
        n.args[name] = { link = src.id, index = idx }
      else
        -- the spec's type, range or list (a default where the value is left out)
        v = registry.check_literal(where, inp, v)
        if v ~= nil and ty:match("^FILE:") then
          if type(v) ~= "string" then fail(fmt("%s: input '%s' must be a file name, got %s", where, name, type(v))) end
          v = find_model(opts, ty:sub(6), v, fmt("%s input '%s'", where, name))
        end
        if v ~= nil then n.args[name] = { value = v } end
      end
    end
  end
  return out
end

-- The nodes that lead to an output node, in dependency order (ties by node id, as
-- numbers where they are); a cycle is named with its nodes.
local function schedule(graph)
  local order, state = {}, {}
  local function key(id) return tonumber(id) or math.huge, id end
  local function sorted_deps(n)
    local deps = {}
    for _, inp in ipairs(n.spec.inputs) do
      local a = n.args[inp.name]
      if a and a.link then deps[#deps + 1] = a.link end
    end
    return deps
  end
  local stack = {}
  local function visit(id)
    if state[id] == "done" then return end
    if state[id] == "open" then
      local cyc, on = {}, false
      for _, s in ipairs(stack) do
        if s == id then on = true end
        if on then cyc[#cyc + 1] = node_name(s, graph[s]) end
      end
      cyc[#cyc + 1] = node_name(id, graph[id])
      fail("the graph has a cycle: " .. table.concat(cyc, " -> "))
    end
    state[id] = "open"
    stack[#stack + 1] = id
    for _, d in ipairs(sorted_deps(graph[id])) do visit(d) end
    stack[#stack] = nil
    state[id] = "done"
    order[#order + 1] = id
  end
  local outs = {}
  for id, n in pairs(graph) do if n.spec.output then outs[#outs + 1] = id end end
  table.sort(outs, function(a, b)
    local ka, sa = key(a)
    local kb, sb = key(b)
    if ka ~= kb then return ka < kb end
    return sa < sb
  end)
  if #outs == 0 then fail("the workflow has no output node (SaveImage, PreviewImage)") end
  for _, id in ipairs(outs) do visit(id) end
  -- a cycle not reached from an output is still a broken graph: name it too
  local all = {}
  for id in pairs(graph) do all[#all + 1] = id end
  table.sort(all)
  for _, id in ipairs(all) do
    if not state[id] then
      local saved = #order
      visit(id)
      for i = #order, saved + 1, -1 do order[i] = nil end  -- not run: it leads to no output
    end
  end
  return order
end

-- For each (node, output): the position in the schedule of its last reader (0: none).
local function last_uses(graph, order)
  local last = {}
  for pos, id in ipairs(order) do
    for _, a in pairs(graph[id].args) do
      if a.link then last[a.link .. ":" .. a.index] = pos end
    end
  end
  return last
end

-- ------------------------------------------------------------------ the run context

local Ctx = {}
Ctx.__index = Ctx

--- A value of type ty holding `tensors` and the models `res` (each counted once more).
function Ctx:value(ty, fields, tensors, res)
  local v = fields or {}
  v.type, v.tensors, v.res = ty, {}, {}
  for _, t in ipairs(tensors or {}) do
    v.tensors[#v.tensors + 1] = t
    self.tcount[t] = (self.tcount[t] or 0) + 1
  end
  for _, r in ipairs(res or {}) do
    v.res[#v.res + 1] = r
    self.rcount[r] = (self.rcount[r] or 0) + 1
  end
  return v
end

-- Drops a value: its tensors freed and its models unloaded where it was the last holder.
function Ctx:drop(v)
  for _, t in ipairs(v.tensors) do
    local c = self.tcount[t] - 1
    self.tcount[t] = c
    if c == 0 then t:free(); self.tcount[t] = nil end
  end
  for _, r in ipairs(v.res) do
    local c = self.rcount[r] - 1
    self.rcount[r] = c
    if c == 0 then
      r:unload()
      self.rcount[r] = nil
      self:log(fmt("    unloaded %s", self.names[r] or "a model"))
    end
  end
  v.tensors, v.res = {}, {}
end

function Ctx:log(s) if not self.quiet then io.stderr:write(s, "\n") end end

--- Raises msg as the node running now ("node ID (CLASS): msg"), for a node's run.
function Ctx:fail(msg) V.fail(self, msg) end

--- The values of the usual link types, for a node's run: an IMAGE [B, 3, H, W] in
-- [0, 1], a MASK [B, 1, H, W], a LATENT (samples times the scale factor, and an
-- optional noise mask); the tensors are the run's from then on (freed after their
-- last reader).
function Ctx:image(t) return V.image(self, t) end
function Ctx:mask(t) return V.mask(self, t) end
function Ctx:latent(samples, noise_mask) return V.latent(self, samples, noise_mask) end

--- Loads a model to the run's device (or opts.device) for the node running now;
-- opts.dtype: the dtype its weights take there (UNETLoader's weight_dtype).
function Ctx:use(part, opts)
  opts = opts or {}
  part:load(opts.device or self.device, opts.dtype and { dtype = opts.dtype } or nil)
  self.used[part] = true
end

function Ctx:note_use(part) self.used[part] = true end

--- A checkpoint opened once per file (its LoRAs and embeddings found in the models folder).
function Ctx:checkpoint(path)
  local c = self.ckpts[path]
  if c then return c end
  if self.shared_checkpoint then
    -- the host's (kiln serve keeps checkpoints open between runs): not closed here
    c = self.shared_checkpoint(path, self:adapter_dirs())
    self.ckpts[path] = c
    return c
  end
  c = kiln.load_checkpoint(path, self:adapter_dirs())
  self:opened(path, c)
  return c
end

-- the adapter folders of the models folder, as load_checkpoint's options
function Ctx:adapter_dirs()
  local o = {}
  local lo, em = join(self.models, "loras"), join(self.models, "embeddings")
  if mode_of(lo) == "directory" then o.loras = lo end
  if mode_of(em) == "directory" then o.embeddings = em end
  return o
end

-- a checkpoint (or parts of one) opened for key: cached, closed at the end, its parts named
function Ctx:opened(key, c)
  self.ckpts[key] = c
  self.closers[#self.closers + 1] = c
  local stem = key:match("([^/]+)$")
  for _, k in ipairs({ "unet", "clip", "vae" }) do
    local p = rawget(c, k)
    if p then self.names[p] = stem .. " " .. k end
  end
end

--- Text encoders alone (CLIPLoader, DualCLIPLoader): a checkpoint holding only `clip`,
-- opened once per list of files and family.
function Ctx:text_encoders(paths, family)
  local key = table.concat(paths, "+") .. "#" .. (family or "")
  local c = self.ckpts[key]
  if c then return c end
  local o = self:adapter_dirs()
  o.family = family
  c = require("kiln.checkpoint").load_text_encoders(paths, o)
  self:opened(key, c)
  return c
end

--- The scale factor (and shift) of the graph's latents, for a VAE loaded alone (in kiln the VAE
-- scales, in ComfyUI the model's latent format): the first model loader's (by node id),
-- else the VAE file's own or SD's.
function Ctx:latent_scale()
  if self.scale ~= nil then return self.scale or nil end
  self.scale = false
  local ids = {}
  for id, n in pairs(self.graph or {}) do
    if n.spec.model_file then ids[#ids + 1] = id end
  end
  table.sort(ids, function(a, b) return (tonumber(a) or math.huge) < (tonumber(b) or math.huge) or
    ((tonumber(a) or math.huge) == (tonumber(b) or math.huge) and a < b) end)
  for _, id in ipairs(ids) do
    local n = self.graph[id]
    local path = n.args[n.spec.model_file].value
    local ok, c = pcall(self.checkpoint, self, path)
    if ok and c.scale_factor then
      self.scale = c.scale_factor
      self.shift = c.shift_factor
      break
    end
  end
  return self.scale or nil, self.shift
end

--- A model the run closes at its end.
function Ctx:own_model(m)
  self.closers[#self.closers + 1] = m
  return m
end

function Ctx:file_bytes(path) return lfs.attributes(path, "size") or 0 end

--- The next PREFIX_NNNNN_.png in the output folder (ComfyUI's numbering: after the
-- highest number there; the prefix may name a sub-folder).
function Ctx:next_output(prefix)
  local sub, base = prefix:match("^(.*)/([^/]*)$")
  local dir = sub and join(self.output, sub) or self.output
  base = base or prefix
  if sub and (sub:match("^/") or sub:match("%.%.")) then fail("filename_prefix '" .. prefix .. "' leaves the output folder") end
  local path = ""
  for part in dir:gmatch("[^/]+") do
    path = path == "" and ((dir:sub(1, 1) == "/") and "/" .. part or part) or path .. "/" .. part
    if mode_of(path) == nil then lfs.mkdir(path) end
  end
  local high = self.counters[dir .. "\0" .. base]
  if not high then
    high = 0
    for f in lfs.dir(dir) do
      if f:sub(1, #base + 1) == base .. "_" then
        local n = f:sub(#base + 2):match("^(%d+)_%.png$")
        if n then high = math.max(high, tonumber(n)) end
      end
    end
  end
  high = high + 1
  self.counters[dir .. "\0" .. base] = high
  return fmt("%s/%s_%05d_.png", dir, base, high)
end

-- ------------------------------------------------------------------ estimates

local function human(b)
  if b >= 1 << 30 then return fmt("%.2f GiB", b / (1 << 30)) end
  if b >= 1 << 20 then return fmt("%.1f MiB", b / (1 << 20)) end
  if b >= 1 << 10 then return fmt("%.1f KiB", b / (1 << 10)) end
  return fmt("%d B", b)
end
M.human = human

-- PNG width and height from the IHDR chunk (no pixels read)
local function png_size(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local head = f:read(24)
  f:close()
  if not head or #head < 24 then return nil end
  local w, h = string.unpack(">I4I4", head, 17)
  return w, h
end

-- The schedule's estimate before anything runs: per node, the weights it needs on the
-- device (a part's stored bytes, or in low mode its streaming window, from the files'
-- headers) plus the results alive while it runs (f32 latents and images whose size
-- the graph fixes). Activations inside a network are not counted (measuring them means
-- running the networks on probes, as --mode auto's planner does): a lower bound.
local function estimate(graph, order, last, opts)
  local bytes = {}
  local lat_size = {}     -- node:index -> {b, c, h, w} of a LATENT / IMAGE output where known
  local function arg(n, name)
    local a = n.args[name]
    return a and a.value
  end
  local function src(n, name)
    local a = n.args[name]
    return a and a.link and (a.link .. ":" .. a.index)
  end
  local function numel(s) return s and s[1] * s[2] * s[3] * s[4] or 0 end
  local mode = kiln.memory_mode()
  local rows = {}
  local live = {}
  local weights_of = {}   -- the model file a MODEL/CLIP/VAE/... output comes from
  for pos, id in ipairs(order) do
    local n = graph[id]
    local c = n.class_type
    local shape
    if c == "EmptyLatentImage" then
      shape = { arg(n, "batch_size"), 4, arg(n, "height") // 8, arg(n, "width") // 8 }
    elseif c == "LoadImage" or c == "LoadImageMask" then
      local w, h = png_size(arg(n, "image"))
      if w then shape = { 1, c == "LoadImage" and 3 or 1, h, w } end
    elseif c == "LatentUpscale" or c == "LatentUpscaleBy" or c == "ImageScale" or c == "ImageScaleBy" then
      local s = lat_size[src(n, c:match("^Latent") and "samples" or "image")]
      if s then
        local f = c:match("^Latent") and 8 or 1
        if arg(n, "scale_by") then
          shape = { s[1], s[2], math.floor(s[3] * arg(n, "scale_by") + 0.5), math.floor(s[4] * arg(n, "scale_by") + 0.5) }
        elseif arg(n, "width") and arg(n, "width") > 0 and arg(n, "height") > 0 then
          shape = { s[1], s[2], arg(n, "height") // f, arg(n, "width") // f }
        end
      end
    elseif c == "VAEDecode" or c == "VAEDecodeTiled" then
      local s = lat_size[src(n, "samples")]
      if s then shape = { s[1], 3, s[3] * 8, s[4] * 8 } end
    elseif c == "VAEEncode" or c == "VAEEncodeTiled" or c == "VAEEncodeForInpaint" then
      local s = lat_size[src(n, "pixels")]
      if s then shape = { s[1], 4, s[3] // 8, s[4] // 8 } end
    elseif c == "KSampler" or c == "KSamplerAdvanced" or c == "SetLatentNoiseMask" then
      shape = lat_size[src(n, c == "SetLatentNoiseMask" and "samples" or "latent_image")]
    elseif c == "ImageUpscaleWithModel" then
      local s = lat_size[src(n, "image")]
      if s then shape = { s[1], 3, s[3] * 4, s[4] * 4 } end -- the usual 4x; the file says
    end
    if shape then lat_size[id .. ":0"] = shape end
    -- the models this node computes with
    local w = 0
    -- a loader: the bytes its models take on the device (the whole part, or in low mode
    -- its streaming window), read from the files' headers (kiln.planner.part_bytes);
    -- the file's size where a file cannot be opened so
    for _, inp in ipairs(n.spec.inputs) do
      local file = inp.type:match("^FILE:") and arg(n, inp.name)  -- nil: left out, or on a link
      if file and inp.type ~= "FILE:input" and inp.type ~= "FILE:loras" then
        weights_of[id] = (weights_of[id] or 0) + (lfs.attributes(file, "size") or 0)
      end
    end
    if weights_of[id] and (n.spec.model_file or c == "ControlNetLoader") then
      local planner = require "kiln.planner"
      local function size(part)
        local total, window = planner.part_bytes(part)
        return mode == "low" and window or total
      end
      local ok, r = pcall(function()
        if c == "ControlNetLoader" then
          local cn <close> = kiln.load_controlnet(arg(n, "control_net_name"))
          return size(cn)
        end
        local ck <close> = kiln.load_checkpoint(arg(n, n.spec.model_file))
        local function part(k) local p = rawget(ck, k) return p and size(p) or 0 end
        return { model = part("unet"), clip = part("clip"), vae = part("vae") }
      end)
      if ok then weights_of[id] = r end
    end
    local function from(name)
      local a = n.args[name]
      if not (a and a.link) then return 0 end
      local s = a.link
      while graph[s] and not weights_of[s] do  -- back through LoRAs and CLIPSetLastLayer
        local nxt = graph[s].args[name] or graph[s].args.model or graph[s].args.clip
        if not (nxt and nxt.link) then break end
        s = nxt.link
      end
      local b = weights_of[s] or 0
      if type(b) == "table" then return b[name] or 0 end
      if graph[s] and graph[s].class_type == "CheckpointLoaderSimple" then
        -- a file kiln could not open: SD's usual shares of a checkpoint
        b = math.floor(b * (({ model = 0.8, clip = 0.12, vae = 0.08 })[name] or 0.08))
      end
      return b
    end
    -- the ControlNets a conditioning carries, back through the conditioning nodes
    local function nets(link, seen)
      local m = graph[link]
      if not m or seen[link] then return 0 end
      seen[link] = true
      local b = 0
      for k, x in pairs(m.args) do
        if x.link and k == "control_net" then b = b + (tonumber(weights_of[x.link]) or 0)
        elseif x.link and (k:match("^conditioning") or k == "positive" or k == "negative") then b = b + nets(x.link, seen) end
      end
      return b
    end
    if c == "KSampler" or c == "KSamplerAdvanced" then
      w = from("model")
      local seen = {}
      for _, k in ipairs({ "positive", "negative" }) do
        local x = n.args[k]
        if x and x.link then w = w + nets(x.link, seen) end
      end
    elseif c:match("^CLIPTextEncode") then w = from("clip")
    elseif c:match("^VAE") or c == "InpaintModelConditioning" then w = from("vae")
    elseif c == "ImageUpscaleWithModel" then w = from("upscale_model") end
    if shape then bytes[id .. ":0"] = numel(shape) * 4 end
    -- results alive while the node runs: every earlier output still to be read, and its own
    local alive = 0
    for k in pairs(live) do alive = alive + (bytes[k] or 0) end
    alive = alive + (bytes[id .. ":0"] or 0)
    rows[#rows + 1] = { id = id, class_type = c, weights = w, results = alive, peak = w + alive }
    for i = 0, #n.spec.outputs - 1 do
      local k = id .. ":" .. i
      if opts.keep_all or (last[k] or 0) > pos then live[k] = true end
    end
    for k in pairs(live) do
      if not opts.keep_all and (last[k] or 0) <= pos then live[k] = nil end
    end
  end
  return rows
end

-- ------------------------------------------------------------------ running

-- The arguments of node n from the values computed so far. A link into a literal
-- input (INT, FLOAT, STRING, BOOLEAN, a combo or a file name) carries a value
-- {type = T, value = x}: x is checked against the spec now, as a literal was before
-- the run, and handed over as is.
local function collect(vals, n, where, dirs)
  local a = {}
  for _, inp in ipairs(n.spec.inputs) do
    local x = n.args[inp.name]
    if x and x.link then
      local v = vals[x.link][x.index + 1]
      local ty = inp.type
      if registry.LITERAL[ty] or ty == "COMBO" or ty:match("^FILE:") then
        v = registry.check_literal(where, inp, type(v) == "table" and v.value or nil)
        if ty:match("^FILE:") then v = find_model(dirs, ty:sub(6), v, fmt("%s input '%s'", where, inp.name)) end
      end
      a[inp.name] = v
    elseif x then
      a[inp.name] = x.value
    end
  end
  return a
end

-- The outputs a node's run returned, checked against its definition (a node added by a
-- script names what it got wrong before a reader trips over it).
local function check_outputs(where, spec, outs)
  if type(outs) ~= "table" then
    fail(fmt("%s: its run returned %s, not the list of its outputs", where, type(outs)))
  end
  for i, ty in ipairs(spec.outputs) do
    local v = outs[i]
    if type(v) ~= "table" or v.type ~= ty then
      fail(fmt("%s: output %d must be a %s value (ctx:value), got %s", where, i - 1, ty,
        type(v) == "table" and tostring(v.type) or type(v)))
    end
  end
end

-- ------------------------------------------------------------------ per-node peaks

-- A node's peak on dev without touching the device's own counter (a host measuring
-- the whole run with kiln.mem.reset_peak / stats reads the run's true peak): the memory
-- timeline keeps each stage's exact peak per device from its begin (the bytes held
-- then) to its end, so a node run as the stage "<id> <class_type>" has its peak there,
-- nested inside whatever the host measures. `since`: the timeline's clock when the run
-- began, so that a stage of an earlier run with the same name is not taken.
local function timeline_since(dev)
  local ok, tl = pcall(kiln.mem.timeline, dev)
  return ok and type(tl) == "table" and tl.stop or nil
end

local function stage_peak(dev, label, since)
  if not since then return nil end
  local ok, tl = pcall(kiln.mem.timeline, dev)
  if not (ok and type(tl) == "table" and tl.stages) then return nil end
  for i = #tl.stages, 1, -1 do
    local st = tl.stages[i]
    if st.name == label and st.t0 >= since and st.t1 then return st.peak end
  end
end

local predict

--- Plans a workflow: reads and checks it, and returns the plan {graph, order, rows
-- (each node's estimate), text} without running anything.
function M.plan(src, opts)
  opts = opts or {}
  local g, text = read_workflow(src)
  local o = { models = opts.models or "models", input = opts.input or join(opts.models or "models", "input") }
  local graph = check(g, o)
  local order = schedule(graph)
  local last = last_uses(graph, order)
  local rows = estimate(graph, order, last, opts)
  return { graph = graph, order = order, last = last, rows = rows, text = text, dirs = o }
end

--- The schedule as text: one line per node with its estimated peak and what is freed after it.
function M.format_plan(plan, opts)
  opts = opts or {}
  local dev = opts.device or kiln.default_device()
  local st = kiln.mem.stats(dev)
  local lines = { fmt("schedule: %d nodes on %s, mode %s%s", #plan.order, dev, kiln.memory_mode(),
    st.budget and st.budget > 0 and (", budget " .. human(st.budget)) or "") }
  if plan.meta then
    lines[#lines + 1] = fmt("  (peak: predicted by a dry run on the meta device modelling %s: the whole run %s%s; " ..
      "est.: the weights a node needs + the results alive then)", plan.meta.device, human(plan.meta.peak),
      plan.meta.fits and "" or (", does not fit: " .. tostring(plan.meta.oom)))
  else
    lines[#lines + 1] = "  (est. peak: the weights a node needs on the device + the results alive then; " ..
      "activations inside the networks not counted" .. (plan.meta_error and ("; no dry run: " .. plan.meta_error) or "") .. ")"
  end
  local frees = {}
  for k, pos in pairs(plan.last) do
    frees[pos] = frees[pos] or {}
    table.insert(frees[pos], k)
  end
  for pos, r in ipairs(plan.rows) do
    local f = frees[pos] or {}
    table.sort(f)
    local predicted = r.predicted and fmt("peak %10s, ", human(r.predicted)) or ""
    lines[#lines + 1] = fmt("%3d. node %-4s %-26s %sest. peak %10s (weights %s, results %s)%s", pos, r.id,
      r.class_type, predicted, human(r.peak), human(r.weights), human(r.results),
      #f > 0 and ("; frees " .. table.concat(f, " ")) or "")
  end
  return table.concat(lines, "\n")
end

-- kiln.dry_run where this build has it (it loads on first use)
local function dry_run_fn()
  local ok, f = pcall(function() return kiln.dry_run end)
  return ok and type(f) == "function" and f or nil
end

-- The dry run's prediction: the graph run on the shape-only device `meta` modelling the
-- run's device, budget and mode (SaveImage writes nothing there), every node's peak taken
-- from its trace span ("<id> <class_type>"). Sets plan.predicted (id -> bytes) and
-- plan.meta (the dry run's report), or plan.meta_error (why the estimate stands alone).
predict = function(src, plan, opts)
  local dry = dry_run_fn()
  if not dry or opts.estimate_only then
    plan.meta_error = not dry and "this build has no kiln.dry_run" or nil
    return
  end
  local dev = opts.device or kiln.default_device()
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.dry_run, o.quiet, o._on_meta, o.device = nil, true, true, dev
  local ok, rep = pcall(dry, function() M.run(src, o) end, { device = dev })
  if not ok then
    plan.meta_error = tostring(rep)
    return
  end
  plan.meta, plan.predicted = rep, {}
  for _, s in ipairs(rep.stages) do
    for pos, id in ipairs(plan.order) do
      local label = fmt("%s %s", id, plan.graph[id].class_type)
      if s.name == label or s.name:sub(-#label - 3) == " > " .. label then
        plan.predicted[id] = math.max(plan.predicted[id] or 0, s.peak)
        plan.rows[pos].predicted = plan.predicted[id]
      end
    end
  end
end

--- Runs a workflow. src: a .json / .png path, JSON text or a table. opts: models (the
-- ComfyUI models folder: checkpoints/, diffusion_models/, text_encoders/, loras/,
-- controlnet/, upscale_models/, embeddings/, vae/, vae_approx/, input/), output (where
-- SaveImage writes; "output"),
-- input (LoadImage's folder; models/input), device, keep_all (free nothing until the
-- end), quiet, on_node (a function (event, id, class_type, files) called with "start"
-- before each node runs and "done" after it, with the files it wrote), checkpoint (a
-- function (path, load_options) -> checkpoint the caller keeps open and closes itself,
-- for checkpoints that outlive the run), dry_run (only the plan, with each node's peak predicted on the meta
-- device; estimate_only: the estimate alone). Returns the list of files written and a report
-- {nodes = {{id, class_type, peak, seconds}...}, peak, previews}.
function M.run(src, opts)
  opts = opts or {}
  local plan = M.plan(src, opts)
  if opts.dry_run then
    predict(src, plan, opts)
    return {}, { plan = plan, text = M.format_plan(plan, opts) }
  end
  local dev = opts.device or kiln.default_device()
  local ctx = setmetatable({
    device = dev, models = plan.dirs.models, output = opts.output or "output",
    quiet = opts.quiet, prompt_text = plan.text, files = {}, previews = {},
    tcount = {}, rcount = {}, names = {}, ckpts = {}, closers = {}, counters = {}, used = {},
    graph = plan.graph, dry = opts._on_meta, shared_checkpoint = not opts._on_meta and opts.checkpoint or nil,
  }, Ctx)
  if not ctx.dry and mode_of(ctx.output) == nil then lfs.mkdir(ctx.output) end
  local graph, order, last = plan.graph, plan.order, plan.last
  local values = {}
  local report = { nodes = {}, peak = 0 }
  local run_peak = 0
  local since = timeline_since(dev)
  local ok, err = pcall(function()
    for pos, id in ipairs(order) do
      local n = graph[id]
      ctx.where = node_name(id, n)
      ctx.node_id = id
      ctx.used = {}
      local args = collect(values, n, ctx.where, plan.dirs)
      local label = fmt("%s %s", id, n.class_type)
      local nfiles = #ctx.files
      if opts.on_node then opts.on_node("start", id, n.class_type) end
      -- what the previous node left to the collector goes before this one starts, in a
      -- real run as in a dry run (which holds the collector between: kiln.dry_run)
      collectgarbage()
      local before = kiln.mem.stats(dev)
      local t0 = kiln.time()
      local outs = kiln.trace.span(label, n.spec.run, ctx, args)
      if type(outs) == "table" then values[id] = outs end  -- freed at the end if the check fails
      check_outputs(ctx.where, n.spec, outs)
      local peak = stage_peak(dev, label, since)
      -- results nobody reads die at once; inputs whose last reader this was die now
      for i = 1, #n.spec.outputs do
        if not opts.keep_all and (last[id .. ":" .. (i - 1)] or 0) <= pos and outs[i] then ctx:drop(outs[i]) end
      end
      if not opts.keep_all then
        for _, a in pairs(n.args) do
          if a.link and last[a.link .. ":" .. a.index] == pos then
            local v = values[a.link][a.index + 1]
            if v and v.tensors then ctx:drop(v) end
          end
        end
        -- a model still held by a live result goes back to the host until its next use
        for part in pairs(ctx.used) do
          if ctx.rcount[part] then part:offload() end
        end
      end
      if not peak then
        -- no stage kept (a timeline full of others): the device's counter since the
        -- host's reset, which is this node's peak where it rose while the node ran and
        -- a bound from below (what was held before and after) where it did not
        local after = kiln.mem.stats(dev)
        peak = after.peak > before.peak and after.peak or math.max(before.allocated, after.allocated)
      end
      run_peak = math.max(run_peak, peak)
      report.nodes[#report.nodes + 1] = { id = id, class_type = n.class_type, peak = peak, seconds = kiln.time() - t0 }
      ctx:log(fmt("%3d. node %-4s %-26s peak %s", pos, id, n.class_type, human(peak)))
      if opts.on_node then opts.on_node("done", id, n.class_type, { table.unpack(ctx.files, nfiles + 1) }) end
    end
  end)
  -- the end (or an error): everything still alive is freed, every model closed
  for _, outs in pairs(values) do
    for _, v in ipairs(outs) do if type(v) == "table" and v.tensors then ctx:drop(v) end end
  end
  for i = #ctx.closers, 1, -1 do pcall(ctx.closers[i].close, ctx.closers[i]) end
  -- what the pipelines left to the collector (views, copies) goes now, not at some later step
  collectgarbage("collect")
  if not ok then error(err, 0) end
  report.peak = run_peak
  report.previews = ctx.previews
  return ctx.files, report
end

-- ------------------------------------------------------------------ command line

local USAGE = "usage: kiln comfy FILE.json|FILE.png --models DIR [--output DIR] [--input DIR] [--dry-run] "
  .. "[--keep-all] [--device D] [--mode M] [--vram SIZE] [--memory-plot FILE.png] [--quiet]"

--- `kiln comfy FILE --models DIR --output DIR [--dry-run]`: the arguments as the CLI gives
-- them (or one list of them).
function M.main(...)
  local args = type((...)) == "table" and (...) or { ... }
  local file
  local rest = {}
  for _, a in ipairs(args) do
    if a == "--help" or a == "-h" then print(USAGE); return end
    if not file and not a:match("^%-%-") and (#rest == 0 or not rest[#rest]:match("^%-%-") or
        rest[#rest] == "--dry-run" or rest[#rest] == "--keep-all" or rest[#rest] == "--quiet") then
      file = a
    else
      rest[#rest + 1] = a
    end
  end
  if not file then util.usage_error(USAGE) end
  local o = util.parse_args(rest, { models = "models", output = "output", input = "", dry_run = false,
    keep_all = false, device = "", mode = "", vram = "", quiet = false, memory_plot = "" })
  local cfg = { device = o.device ~= "" and o.device or nil, mode = o.mode ~= "" and o.mode or nil,
    budget = o.vram ~= "" and o.vram or nil, quiet = o.quiet or nil }
  local okc, e = pcall(kiln.configure, cfg)
  if not okc then util.usage_error(type(e) == "table" and (e.message or tostring(e)) or tostring(e)) end
  if mode_of(o.models) ~= "directory" then util.usage_error(("--models %s: no such folder"):format(o.models)) end
  local plot = o.memory_plot ~= "" and o.memory_plot or nil
  if plot and not (kiln.mem and type(kiln.mem.plot) == "function") then
    util.usage_error("--memory-plot " .. plot .. ": kiln.mem.plot is not available in this build")
  end
  local ok, files, report = pcall(M.run, file, { models = o.models, output = o.output, input = o.input ~= "" and o.input or nil,
    dry_run = o.dry_run, keep_all = o.keep_all, quiet = o.quiet })
  -- the device's bytes over the run, each node a stage (its trace span "<id> <class_type>");
  -- drawn for a failed run too, to show where it failed
  if plot then
    local okp, table_text = pcall(kiln.mem.plot, plot)
    if not okp then io.stderr:write(("kiln comfy: --memory-plot %s: %s\n"):format(plot, tostring(table_text)))
    elseif type(table_text) == "string" and not o.quiet then io.stderr:write(table_text) end
  end
  if not ok then
    local msg = tostring(files)
    if msg:match("^kiln%.comfy: ") then util.usage_error((msg:gsub("^kiln%.comfy: ", "comfy: "))) end
    error(files, 0)
  end
  if o.dry_run then print(report.text); return end
  for _, f in ipairs(files) do print(f) end
  if not o.quiet then io.stderr:write(("peak %s\n"):format(human(report.peak))) end
end

return M
