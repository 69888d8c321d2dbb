-- kiln.serve.comfy_api: ComfyUI's HTTP API on kiln serve (server.py's routes, in the
-- shapes its clients read): POST /prompt checks the graph with kiln.comfy.plan and
-- queues it; a run is kiln.comfy.run, whose node hook and progress reports become
-- ComfyUI's WebSocket messages (execution_start, execution_cached, executing,
-- progress, executed, execution_success / _error / _interrupted, and executing with
-- node null at the end); /history, /view, /upload/image, /object_info (from the node
-- registry's input specs), /queue, /interrupt, /system_stats.
local kiln = require "kiln"
local lfs = require "lfs"
local comfy = require "kiln.comfy"
local registry = require "kiln.comfy.registry"
local serve = require "kiln.serve"
local H = require "kiln.serve.http"

local M = {}
local fmt = string.format
local route, refuse, array = serve.route, H.refuse, H.array
local null = kiln.json.null

local function mode_of(p) return lfs.attributes(p, "mode") end

-- ------------------------------------------------------------------ checking a prompt

-- ComfyUI's node_errors entry for a message "node ID (CLASS): ..."
local function node_error(msg)
  local id, class = msg:match("node ([^%s]+) %(([^)]*)%)")
  if not id then return nil end
  local type_ = "value_not_valid"
  if msg:match("expects %u+, but output") then type_ = "return_type_mismatch"
  elseif msg:match("is missing") then type_ = "required_input_missing"
  elseif msg:match("above the maximum") then type_ = "value_bigger_than_max"
  elseif msg:match("below the minimum") then type_ = "value_smaller_than_min"
  elseif msg:match("not found in") then type_ = "value_not_in_list" end
  local input = msg:match("input '([^']+)'")
  return id, { errors = { { type = type_, message = msg:gsub("^kiln%.comfy: ", ""), details = input or "",
    extra_info = { input_name = input } } }, dependent_outputs = array(), class_type = class }
end

-- The limits on a graph's literals: sizes, batch, steps and each text's tokens.
local function check_limits(s, prompt)
  local o = s.o
  for id, n in pairs(prompt) do
    local inputs = type(n) == "table" and type(n.inputs) == "table" and n.inputs or {}
    local ct = type(n) == "table" and n.class_type or "?"
    id = tostring(id)
    for k, v in pairs(inputs) do
      if type(v) == "number" then
        if k == "width" or k == "height" then s:check_limit(k, v, o.max_size, "--max-size", id, ct)
        elseif k == "batch_size" or k == "amount" then s:check_limit(k, v, o.max_batch, "--max-batch", id, ct)
        elseif k == "steps" then s:check_limit("steps", v, o.max_steps, "--max-steps", id, ct) end
      elseif type(v) == "string" and (k == "text" or k:match("^text_") or k == "clip_l" or k == "clip_g" or k == "t5xxl") then
        s:check_tokens(v, id, ct)
      end
    end
  end
end

--- The prompt checked (ComfyUI's validate_prompt): 400 with its error shape, else the plan.
local function validate(s, prompt)
  if type(prompt) ~= "table" or getmetatable(prompt) then
    refuse(400, "invalid_prompt", "the prompt must be a JSON object: node id -> {class_type, inputs}")
  end
  for id, n in pairs(prompt) do
    if type(n) ~= "table" or type(n.class_type) ~= "string" then
      refuse(400, "invalid_prompt", fmt("Cannot execute because a node is missing the class_type property."),
        fmt("Node ID '#%s'", tostring(id)))
    end
    if not registry.get(n.class_type) then
      refuse(400, "invalid_prompt", fmt("Cannot execute because node %s does not exist.", n.class_type),
        fmt("Node ID '#%s'%s", tostring(id), registry.not_yet[n.class_type] and (": " .. registry.not_yet[n.class_type]) or ""))
    end
  end
  check_limits(s, prompt)
  local ok, plan = pcall(comfy.plan, prompt, { models = s.o.models, input = s.o.input })
  if not ok then
    local msg = tostring(plan):gsub("^kiln%.comfy: ", "")
    if msg:match("no output node") then
      refuse(400, "prompt_no_outputs", "Prompt has no outputs", msg)
    end
    local id, err = node_error(msg)
    refuse(400, "prompt_outputs_failed_validation", "Prompt outputs failed validation", msg, id and { [id] = err } or nil)
  end
  local outputs = {}
  for id, n in pairs(plan.graph) do if n.spec.output then outputs[#outputs + 1] = id end end
  table.sort(outputs)
  return plan, outputs
end

-- ------------------------------------------------------------------ running one

local function queue_item(job)
  return { job.number, job.id, job.prompt, job.extra, array(job.outputs_to_execute) }
end

local function record(s, job, status_str, messages)
  local h = s.history
  local entry = { prompt = queue_item(job), outputs = job.outputs, meta = job.meta,
    status = { status_str = status_str, completed = status_str == "success", messages = messages } }
  if not h.by[job.id] then h.ids[#h.ids + 1] = job.id end
  h.by[job.id] = entry
  while #h.ids > s.o.history do
    local old = table.remove(h.ids, 1)
    h.by[old] = nil
  end
end

-- where a written file is, as /view names it: filename, subfolder, type
local function view_ref(s, path)
  local rel = path
  local out = s.o.output
  if path:sub(1, #out + 1) == out .. "/" then rel = path:sub(#out + 2) end
  local sub, name = rel:match("^(.*)/([^/]+)$")
  return { filename = name or rel, subfolder = sub or "", type = "output" }
end

local function run(s, job)
  local client = job.client
  local t0 = serve.now()
  job.messages = { { "execution_start", { prompt_id = job.id, timestamp = t0 } } }
  s:ws(client, "execution_start", { prompt_id = job.id, timestamp = t0 })
  s:ws(client, "execution_cached", { nodes = array(), prompt_id = job.id, timestamp = t0 })
  job.executed = {}
  local abs_output = s.o.output
  comfy.run(job.prompt, { models = s.o.models, output = abs_output, input = s.o.input, quiet = true,
    checkpoint = function(path, lopts) return s:checkpoint(path, lopts) end,
    on_node = function(event, id, class_type, files)
      if event == "start" then
        job.node, job.node_type = id, class_type
        s:ws(client, "executing", { node = id, display_node = id, prompt_id = job.id })
        s:pump()
        if s.interrupt or s.stopping then kiln.cancel() end
      else
        job.executed[#job.executed + 1] = id
        job.meta[id] = { node_id = id, display_node = id, parent_node = null, real_node_id = id }
        if files and #files > 0 then
          local images = {}
          for i, p in ipairs(files) do images[i] = view_ref(s, p) end
          local output = { images = images }
          job.outputs[id] = output
          s:ws(client, "executed", { node = id, display_node = id, output = output, prompt_id = job.id })
        end
      end
    end })
end

local function finish(s, job, ok, err, cancelled)
  local client = job.client
  local t = serve.now()
  if ok then
    job.messages[#job.messages + 1] = { "execution_success", { prompt_id = job.id, timestamp = t } }
    s:ws(client, "execution_success", { prompt_id = job.id, timestamp = t })
    record(s, job, "success", job.messages)
  elseif cancelled then
    local d = { prompt_id = job.id, node_id = job.node, node_type = job.node_type, executed = array(job.executed),
      timestamp = t }
    job.messages[#job.messages + 1] = { "execution_interrupted", d }
    s:ws(client, "execution_interrupted", d)
    record(s, job, "error", job.messages)
  else
    local msg = tostring(H.is_refusal(err) and err.message or err)
    local d = { prompt_id = job.id, node_id = job.node, node_type = job.node_type, executed = array(job.executed),
      exception_message = (msg:match("^[^\n]*"):gsub("^kiln%.comfy: ", "")),
      exception_type = type(err) == "table" and err.kind == "oom" and "torch.OutOfMemoryError" or "RuntimeError",
      traceback = array({ msg }), current_inputs = {}, current_outputs = {}, timestamp = t }
    job.messages[#job.messages + 1] = { "execution_error", d }
    s:ws(client, "execution_error", d)
    record(s, job, "error", job.messages)
  end
  s:ws(client, "executing", { node = null, display_node = null, prompt_id = job.id })
end

local function progress(s, job, step, total)
  job.step, job.total = step, total
  if total and total > 0 then
    s:ws(job.client, "progress", { value = step, max = total, prompt_id = job.id, node = job.node })
  end
end

-- ------------------------------------------------------------------ routes

route("POST", "/prompt", function(s, ev)
  local body = H.json_body(ev)
  if type(body.prompt) ~= "table" then
    refuse(400, "no_prompt", "No prompt provided", "the body needs \"prompt\": {node id: {class_type, inputs}}")
  end
  local plan, outputs = validate(s, body.prompt)
  local id = type(body.prompt_id) == "string" and body.prompt_id ~= "" and body.prompt_id or serve.uuid()
  local client = type(body.client_id) == "string" and body.client_id or nil
  local extra = type(body.extra_data) == "table" and body.extra_data or {}
  if client then extra.client_id = client end
  plan = nil
  local job = s:enqueue({ kind = "comfy", id = id, prompt = body.prompt, client = client, extra = extra,
    outputs_to_execute = outputs, outputs = {}, meta = {}, run = run, finish = finish, progress = progress,
    number = type(body.number) == "number" and body.number or nil })
  if body.front then table.insert(s.queue, 1, table.remove(s.queue)) end
  s:reply(ev, 200, { prompt_id = id, number = job.number, node_errors = {} })
  s:status()
end)

route("GET", "/prompt", function(s, ev)
  s:reply(ev, 200, { exec_info = { queue_remaining = s:queue_remaining() } })
end)

route("GET", "/queue", function(s, ev)
  local running, pending = array(), array()
  if s.running and s.running.kind == "comfy" then running[1] = queue_item(s.running) end
  for _, j in ipairs(s.queue) do
    if j.kind == "comfy" then pending[#pending + 1] = queue_item(j) end
  end
  s:reply(ev, 200, { queue_running = running, queue_pending = pending })
end)

route("POST", "/queue", function(s, ev)
  local body = H.json_body(ev)
  local keep = {}
  local del = {}
  for _, id in ipairs(type(body.delete) == "table" and body.delete or {}) do del[id] = true end
  for _, j in ipairs(s.queue) do
    if not (j.kind == "comfy" and (body.clear or del[j.id])) then keep[#keep + 1] = j end
  end
  s.queue = keep
  s:reply(ev, 200, "", "text/plain")
  s:status()
end)

route("POST", "/interrupt", function(s, ev)
  local body = ev.body ~= "" and pcall(kiln.json.decode, ev.body) and kiln.json.decode(ev.body) or {}
  local want = type(body) == "table" and body.prompt_id
  if s.running and (not want or want == s.running.id) then
    s.interrupt = true
  end
  s:reply(ev, 200, "", "text/plain")
end)

route("GET", "/history", function(s, ev)
  local q = H.query(ev.query)
  local max = tonumber(q.max_items)
  local out, ids = {}, s.history.ids
  local first = max and math.max(1, #ids - max + 1) or 1
  for i = first, #ids do out[ids[i]] = s.history.by[ids[i]] end
  s:reply(ev, 200, out)
end)

route("GET", "/history/*", function(s, ev, id)
  local e = s.history.by[id]
  s:reply(ev, 200, e and { [id] = e } or {})
end)

route("POST", "/history", function(s, ev)
  local body = H.json_body(ev)
  if body.clear then s.history = { ids = {}, by = {} } end
  if type(body.delete) == "table" then
    for _, id in ipairs(body.delete) do
      if s.history.by[id] then
        s.history.by[id] = nil
        for i, x in ipairs(s.history.ids) do if x == id then table.remove(s.history.ids, i) break end end
      end
    end
  end
  s:reply(ev, 200, "", "text/plain")
end)

-- the folder of a /view or upload type; nil for another
local function type_dir(s, t)
  return ({ output = s.o.output, input = s.o.input, temp = s.o.temp })[t or "output"]
end

--- A file under one of the three folders: refused (403) when its resolved path is not
-- inside the folder's resolved path (.., absolute names, links out).
local function safe_path(s, t, subfolder, filename)
  local base = type_dir(s, t)
  if not base then refuse(400, "invalid_type", fmt("type '%s': must be output, input or temp", tostring(t))) end
  if type(filename) ~= "string" or filename == "" then refuse(400, "invalid_filename", "filename is needed") end
  subfolder = subfolder or ""
  if filename:match("^/") or subfolder:match("^/") or filename:find("\0", 1, true) or subfolder:find("\0", 1, true) then
    refuse(403, "forbidden", "absolute paths are refused")
  end
  for part in (subfolder .. "/" .. filename):gmatch("[^/]+") do
    if part == ".." then refuse(403, "forbidden", "'..' in a path is refused") end
  end
  local rbase = require("kiln.serve_http").realpath(base) or base
  local p = base .. "/" .. (subfolder ~= "" and (subfolder .. "/") or "") .. filename
  return p, rbase
end

route("GET", "/view", function(s, ev)
  local q = H.query(ev.query)
  local p, rbase = safe_path(s, q.type ~= "" and q.type or "output", q.subfolder, q.filename)
  local real = require("kiln.serve_http").realpath(p)
  if not real then refuse(404, "not_found", "no such file: " .. (q.filename or "")) end
  if real:sub(1, #rbase + 1) ~= rbase .. "/" then refuse(403, "forbidden", "the file is outside the " .. q.type .. " folder") end
  if mode_of(real) ~= "file" then refuse(404, "not_found", "not a file: " .. q.filename) end
  local f = io.open(real, "rb")
  if not f then refuse(404, "not_found", "cannot open " .. q.filename) end
  local data = f:read("a")
  f:close()
  s:reply(ev, 200, data, H.content_type(real), fmt("Content-Disposition: filename=\"%s\"\r\n", (q.filename:gsub('"', ""))))
end)

local function upload(s, ev, is_mask)
  local parts = H.multipart(ev)
  local img = parts.image
  if not img or not img.filename then refuse(400, "no_image", "the form needs an 'image' file field") end
  local t = parts.type and parts.type.value or "input"
  local sub = parts.subfolder and parts.subfolder.value or ""
  local name = img.filename:match("([^/\\]+)$") or ""
  if name == "" or name == "." or name == ".." then refuse(400, "invalid_filename", "the file needs a name") end
  local w, h = H.png_size(img.value)
  if w then
    s:check_limit("image width", w, s.o.max_size, "--max-size")
    s:check_limit("image height", h, s.o.max_size, "--max-size")
  end
  local p, rbase = safe_path(s, t, sub, name)
  local dir = p:match("^(.*)/[^/]*$")
  local path = ""
  for part in dir:gmatch("[^/]+") do
    path = path .. "/" .. part
    if mode_of(path) == nil then lfs.mkdir(path) end
  end
  local rdir = require("kiln.serve_http").realpath(dir)
  if not rdir or (rdir ~= rbase and rdir:sub(1, #rbase + 1) ~= rbase .. "/") then
    refuse(403, "forbidden", "the subfolder is outside the " .. t .. " folder")
  end
  local overwrite = parts.overwrite and (parts.overwrite.value == "true" or parts.overwrite.value == "1")
  if not overwrite and mode_of(p) then
    local stem, ext = name:match("^(.-)(%.[^.]*)$")
    stem, ext = stem or name, ext or ""
    local i = 1
    repeat
      name = fmt("%s (%d)%s", stem, i, ext)
      p = dir .. "/" .. name
      i = i + 1
    until not mode_of(p)
  end
  if is_mask and parts.original_ref then
    -- a mask upload: ComfyUI merges it into the original's alpha; kiln keeps the mask file
    local _ = parts.original_ref
  end
  local f = io.open(p, "wb")
  if not f then refuse(500, "io_error", "cannot write " .. name) end
  f:write(img.value)
  f:close()
  s:reply(ev, 200, { name = name, subfolder = sub, type = t })
end

route("POST", "/upload/image", function(s, ev) upload(s, ev, false) end)
route("POST", "/upload/mask", function(s, ev) upload(s, ev, true) end)

-- the files of a models folder ("checkpoints", "diffusion_models|unet"), sorted
local function files_in(s, folders)
  local out, seen = {}, {}
  for folder in folders:gmatch("[^|]+") do
    local dir = folder == "input" and s.o.input or (s.o.models .. "/" .. folder)
    local function walk(d, prefix, depth)
      if depth > 4 or mode_of(d) ~= "directory" then return end
      for f in lfs.dir(d) do
        if f:sub(1, 1) ~= "." then
          local p = d .. "/" .. f
          local m = mode_of(p)
          if m == "file" and not seen[prefix .. f] then out[#out + 1] = prefix .. f; seen[prefix .. f] = true
          elseif m == "directory" then walk(p, prefix .. f .. "/", depth + 1) end
        end
      end
    end
    walk(dir, "", 0)
  end
  table.sort(out)
  return out
end

-- one node type as ComfyUI's /object_info describes it
local function node_info(s, name, d)
  local required, optional, order_req, order_opt = {}, {}, array(), array()
  for _, inp in ipairs(d.inputs) do
    local ty = inp.type
    local spec
    if ty == "COMBO" then spec = array(registry.choices(inp))
    elseif ty:match("^FILE:") then spec = array(files_in(s, ty:sub(6)))
    else spec = ty end
    local o = {}
    for _, k in ipairs({ "default", "min", "max", "step", "round", "tooltip", "multiline" }) do
      if inp[k] ~= nil then o[k] = inp[k] end
    end
    local entry = next(o) and array({ spec, o }) or array({ spec })
    if inp.optional then optional[inp.name] = entry; order_opt[#order_opt + 1] = inp.name
    else required[inp.name] = entry; order_req[#order_req + 1] = inp.name end
  end
  local input = { required = required }
  if next(optional) then input.optional = optional end
  local is_list = array()
  for i = 1, #d.outputs do is_list[i] = false end
  return { input = input, input_order = { required = order_req, optional = #order_opt > 0 and order_opt or nil },
    output = array({ table.unpack(d.outputs) }), output_is_list = is_list,
    output_name = array({ table.unpack(d.outputs) }), name = name, display_name = name,
    description = d.description or "", python_module = "nodes", category = d.category or "kiln",
    output_node = d.output and true or false }
end

route("GET", "/object_info", function(s, ev)
  local out = {}
  for _, name in ipairs(registry.names()) do out[name] = node_info(s, name, registry.get(name)) end
  s:reply(ev, 200, out)
end)

route("GET", "/object_info/*", function(s, ev, name)
  local d = registry.get(name)
  s:reply(ev, 200, d and { [name] = node_info(s, name, d) } or {})
end)

route("GET", "/embeddings", function(s, ev)
  local list = array()
  for i, f in ipairs(files_in(s, "embeddings")) do list[i] = f:gsub("%.[^.]*$", "") end
  s:reply(ev, 200, list)
end)

route("GET", "/extensions", function(s, ev) s:reply(ev, 200, array()) end)

route("GET", "/models", function(s, ev)
  local list = array()
  for f in lfs.dir(s.o.models) do
    if f:sub(1, 1) ~= "." and mode_of(s.o.models .. "/" .. f) == "directory" then list[#list + 1] = f end
  end
  table.sort(list)
  s:reply(ev, 200, list)
end)

route("GET", "/models/*", function(s, ev, folder)
  if folder:match("%.%.") or folder:match("/") then refuse(403, "forbidden", "a models folder name") end
  s:reply(ev, 200, array(files_in(s, folder)))
end)

local function host_memory()
  local total, free
  local f = io.open("/proc/meminfo")
  if f then
    local text = f:read("a")
    f:close()
    total = tonumber(text:match("MemTotal:%s+(%d+)"))
    free = tonumber(text:match("MemAvailable:%s+(%d+)"))
  end
  return (total or 0) * 1024, (free or 0) * 1024
end

-- the open checkpoints' weights on each device: file name -> {device -> bytes}
local function resident(s)
  local out = {}
  for _, path in ipairs(s.ckpt_order) do
    local c = s.ckpts[path]
    out[path:match("[^/]*$")] = c and serve.resident_bytes(c) or {}
  end
  return out
end

route("GET", "/system_stats", function(s, ev)
  local total, free = host_memory()
  local devices, kdev = array(), {}
  for i, name in ipairs(kiln.devices()) do
    if name ~= "meta" then
      local st = kiln.mem.stats(name)
      local vt = (st.budget and st.budget > 0) and st.budget or (name == "cpu" and total or st.total or total)
      devices[#devices + 1] = { name = name, type = name:match("^[%a]+"), index = i - 1,
        vram_total = vt, vram_free = math.max(0, vt - (st.reserved or st.allocated or 0)),
        torch_vram_total = st.reserved or 0, torch_vram_free = math.max(0, (st.reserved or 0) - (st.allocated or 0)) }
      kdev[name] = st
    end
  end
  -- what is alive, not what waits for the collector the loop runs once idle
  if s.collect then collectgarbage("collect"); s.collect = false end
  local live = kiln.mem.live()
  s:reply(ev, 200, {
    system = { os = "posix", ram_total = total, ram_free = free, comfyui_version = "kiln " .. kiln.version,
      python_version = "", pytorch_version = "", embedded_python = false, argv = array({ "kiln", "serve" }) },
    devices = devices,
    kiln = { devices = kdev, default_device = kiln.default_device(), memory_mode = kiln.memory_mode(),
      live = { tensors = live.tensors, models = array(live.models) }, queue_remaining = s:queue_remaining(),
      checkpoints_open = array({ table.unpack(s.ckpt_order) }), checkpoints_resident = resident(s),
      last_run_memory = s:last_run_memory() or null },
  })
end)

return M
