-- kiln.serve: `kiln serve --models DIR --output DIR [--listen 127.0.0.1] [--port 8188]
-- [--token T]`, ComfyUI's and AUTOMATIC1111's HTTP + WebSocket APIs over the kiln
-- context of this process. The sockets are kiln.serve_http's (civetweb's threads, in
-- C); everything here runs on the context's one thread: a loop takes the requests as
-- events, answers what needs no generation at once, and queues the rest. One
-- generation runs at a time; while it runs, every progress report (each sampler step,
-- each node of a graph) and a count hook between the networks' ops every 20 ms answer
-- the requests that came in meanwhile, so /queue, /history, /sdapi/v1/progress and
-- /interrupt are served during a run, and an interrupt or SIGTERM cancels it through
-- kiln.cancel at the next progress report.
--
-- Nothing of a request outlives it: its tensors are freed by the runner that made
-- them (kiln.comfy's lifetimes, the pipelines' stages), the answer's strings are
-- handed to C and dropped, and the history keeps the last --history entries. What
-- stays between requests is the checkpoints opened (the A1111 one, and the files the
-- graphs name), their weights resident on a device with a budget until an allocation
-- the budget cannot hold evicts them (Server:checkpoint), and the last run's memory
-- curve.
local kiln = require "kiln"
local util = require "kiln.util"
local lfs = require "lfs"
local H = require "kiln.serve.http"

local M = {}
local fmt = string.format

local USAGE = [[
usage: kiln serve --models DIR --output DIR [--listen 127.0.0.1] [--port 8188] [--token T]
  --models DIR        ComfyUI's models folder (checkpoints/, vae/, loras/, ...)
  --output DIR        where pictures are written (ComfyUI's output/)
  --input DIR         uploads and LoadImage's folder (default: DIR of --models /input)
  --temp DIR          ComfyUI's temp/ folder for /view (default: --output/../temp)
  --listen ADDR       address to bind (default 127.0.0.1: this machine only)
  --port N            port (default 8188; 0: any free port, printed)
  --token T           require 'Authorization: Bearer T' on every request
  --history N         finished prompts kept for /history (default 100)
  --max-body SIZE     largest request body (default 64M)
  --max-size N        largest width or height in pixels (default 4096)
  --max-batch N       largest batch (default 16)
  --max-steps N       most sampling steps (default 200)
  --max-tokens N      most CLIP tokens in one prompt (default 1024)
  --max-queue N       most prompts waiting (default 256)
  --keep-checkpoints N  checkpoints kept open with no weights resident (default 2);
                      those with weights resident stay open until the budget evicts them
  --device D --mode M --vram SIZE --quiet   as for every kiln command
Prints "kiln serve: listening on http://HOST:PORT" once it accepts connections.]]

M.USAGE = USAGE

-- ------------------------------------------------------------------ the server state

local Server = {}
Server.__index = Server
M.Server = Server

local function now() return os.time() * 1000 end  -- ComfyUI's timestamps: ms since the epoch
M.now = now

--- A new id in uuid4's text form (ComfyUI's prompt ids).
local seeded = false
function M.uuid()
  if not seeded then math.randomseed(os.time(), math.floor(kiln.time() * 1e6) % 1000003); seeded = true end
  local function hex(n)
    local t = {}
    for i = 1, n do t[i] = fmt("%x", math.random(0, 15)) end
    return table.concat(t)
  end
  return fmt("%s-%s-4%s-%x%s-%s", hex(8), hex(4), hex(3), math.random(8, 11), hex(3), hex(12))
end

--- Sends a ComfyUI message {type, data} to client (nil: to every client).
function Server:ws(client, type_, data)
  if client == "" then client = nil end
  self.srv:ws_send(client, kiln.json.encode({ type = type_, data = data }))
end

function Server:queue_remaining() return #self.queue + (self.running and 1 or 0) end

--- The status message (to one client with its sid, or to all).
function Server:status(client)
  local data = { status = { exec_info = { queue_remaining = self:queue_remaining() } } }
  if client then data.sid = client end
  self:ws(client, "status", data)
end

-- The Server-Timing header of an answer (milliseconds, the standard header browsers'
-- tools show): wait, from the request's arrival until this thread took it (during a
-- run, until its next progress report); queue, from the arrival until its generation
-- started (behind the generations before it); run, its own generation's pipeline calls
-- (ev.run_s); total, arrival to answer.
local function server_timing(ev)
  if not ev.arrived then return nil end
  local now = kiln.time()
  local t = { fmt("wait;dur=%.3f", ((ev.taken or now) - ev.arrived) * 1e3) }
  if ev.started then t[#t + 1] = fmt("queue;dur=%.3f", (ev.started - ev.arrived) * 1e3) end
  if ev.run_s then t[#t + 1] = fmt("run;dur=%.3f", ev.run_s * 1e3) end
  t[#t + 1] = fmt("total;dur=%.3f", (now - ev.arrived) * 1e3)
  return "Server-Timing: " .. table.concat(t, ", ") .. "\r\n"
end

--- Answers request ev: a table is sent as JSON, a string as is.
function Server:reply(ev, status, body, ctype, headers)
  if type(body) == "table" then body, ctype = kiln.json.encode(body), "application/json"
  elseif body == kiln.json.null then body, ctype = "null", "application/json" end
  local timing = server_timing(ev)
  if timing then headers = (headers or "") .. timing end
  self.srv:respond(ev.id, status, ctype or "application/json", body or "", headers)
end

--- Queues a job {kind, run = fn(server, job), finish = fn(server, job, ok, err,
-- cancelled), ...}; 503 when the queue is full.
function Server:enqueue(job)
  if #self.queue >= self.o.max_queue then
    H.refuse(503, "queue_full", fmt("the queue is full (%d waiting; --max-queue)", #self.queue))
  end
  self.number = self.number + 1
  job.number = job.number or self.number
  self.queue[#self.queue + 1] = job
  return job
end

-- the routes: "METHOD /path" -> handler(server, ev, rest) (rest: what follows a
-- route ending in "/*")
local routes = {}
M.routes = routes
function M.route(method, path, fn) routes[method .. " " .. path] = fn end

local function find_route(method, path)
  local r = routes[method .. " " .. path]
  if r then return r end
  local best, rest
  for k, fn in pairs(routes) do
    local m, p = k:match("^(%S+) (.*)/%*$")
    if m == method and path:sub(1, #p + 1) == p .. "/" and (not best or #p > best.len) then
      best, rest = { fn = fn, len = #p }, path:sub(#p + 2)
    end
  end
  if best then return best.fn, H.unescape(rest) end
end

--- Handles one event (a request, a WebSocket opening or closing, a stop); never
-- starts a generation (the loop does that), so it may run inside one.
function Server:handle(ev)
  ev.taken = kiln.time()
  if ev.kind == "stop" then
    self.stopping = true
    if self.running then self.interrupt = true; kiln.cancel() end
    return
  elseif ev.kind == "ws_open" then
    self:status(ev.client)
    return
  elseif ev.kind == "ws_close" then
    return
  end
  local fn, rest = find_route(ev.method, ev.path)
  if not fn then
    if ev.method == "GET" and (ev.path == "/" or ev.path == "/index.html") then
      return self:reply(ev, 200, M.status_page(), "text/html; charset=utf-8")
    end
    return self:reply(ev, 404, H.refusal_body({ type = "not_found", message = fmt("no such endpoint: %s %s", ev.method, ev.path) }))
  end
  local ok, err = xpcall(fn, function(e)
    if H.is_refusal(e) then return e end
    return debug.traceback(tostring(e), 2)
  end, self, ev, rest)
  if not ok then
    if H.is_refusal(err) then
      self:reply(ev, err.status, H.refusal_body(err))
    else
      io.stderr:write("kiln serve: ", ev.method, " ", ev.path, ": ", tostring(err), "\n")
      self:reply(ev, 500, H.refusal_body({ type = "server_error", message = tostring(err):match("^[^\n]*") }))
    end
  end
end

--- Handles every event waiting (a progress report's turn; no waiting).
function Server:pump()
  if self.pumping then return end   -- a handler's own Lua met the run's hook
  self.pumping = true
  local ok, err = pcall(function()
    while true do
      local ev = self.srv:next(0)
      if not ev then break end
      self:handle(ev)
    end
  end)
  self.pumping = false
  if not ok then error(err, 0) end
  if (self.interrupt or self.stopping) and self.running then kiln.cancel() end
end

-- Between two progress reports a sampler step or a stage (a VAE decode at a large
-- size) can take seconds. The networks are Lua over C ops, so a count hook runs between
-- the ops all through a run: every PUMP_INTERVAL seconds of it the requests that came
-- in meanwhile are answered (those that need a generation are queued), as at a
-- progress report. A single C op still runs to its end first.
local HOOK_COUNT, PUMP_INTERVAL = 10000, 0.02

local function pump_hook(self)
  local last = kiln.time()
  return function()
    local t = kiln.time()
    if t - last < PUMP_INTERVAL then return end
    last = t
    -- an error here would be raised in the run's code: what went wrong is the request's
    local ok, err = pcall(self.pump, self)
    if not ok then
      io.stderr:write("kiln serve: answering during a run: ", tostring(err), "\n")
    end
  end
end

local function is_cancel(err)
  if type(err) == "table" and (err.kind == "cancelled" or err.status == "cancelled") then return true end
  return tostring(err):match("cancel") ~= nil
end
M.is_cancel = is_cancel

--- Runs the next job of the queue to its end (its finish says how it went).
function Server:run_next()
  local job = table.remove(self.queue, 1)
  self.running = job
  if job.ev then job.ev.started = kiln.time() end
  self.interrupt = false
  kiln.cancel(false)
  self.srv:running(true, job.client or "")
  -- the memory timeline and event log are one run's (its picture and trace): the last
  -- run's are dropped as this one starts, its curve kept first if the status page asked
  -- for one lately (computing it costs a few ms a run that nobody needs otherwise)
  if self.last_run and not self.last_run.curve and kiln.time() - (self.curve_asked or -1e9) < 10 then
    self:last_run_memory()
  end
  if kiln.mem.clear_timeline then pcall(kiln.mem.clear_timeline) end
  if kiln.mem.clear_events then pcall(kiln.mem.clear_events) end
  self.last_run = nil
  local copied0 = M.copied_in()
  local prev = kiln.on_progress(function(step, total, what)
    if job.progress then job.progress(self, job, step, total, what) end
    self:pump()
  end)
  -- a hook of someone else's (a debugger, Ctrl-C's) is left alone
  local hooked = debug.gethook() == nil
  if hooked then debug.sethook(pump_hook(self), "", HOOK_COUNT) end
  local ok, err = xpcall(job.run, function(e)
    if is_cancel(e) or H.is_refusal(e) then return e end
    return debug.traceback(tostring(e), 2)
  end, self, job)
  if hooked then debug.sethook() end
  kiln.on_progress(prev)
  self.srv:running(false)
  local cancelled = not ok and (self.interrupt or is_cancel(err))
  kiln.cancel(false)
  self.interrupt = false
  self.running = nil
  if not ok and not cancelled and not H.is_refusal(err) then
    io.stderr:write("kiln serve: ", job.kind, " ", tostring(job.id), " failed: ", tostring(err), "\n")
  end
  local fok, ferr = pcall(job.finish, self, job, ok, err, cancelled)
  if not fok then io.stderr:write("kiln serve: finishing ", tostring(job.id), ": ", tostring(ferr), "\n") end
  local copied = M.copied_in()
  for dev, n in pairs(copied) do copied[dev] = n - (copied0[dev] or 0) end
  self.last_run = { id = job.id, copied_in = copied }
  self:trim_checkpoints()
  -- what the run left to the collector (views, copies, strings) goes once the server is
  -- idle (the main loop), not in the way of the next request: the pipelines' stages
  -- collect at each stage already
  self.collect = true
  self:status()
end

--- The last run's memory curve (M.memory_curve) with the bytes it copied onto each
-- device, computed once when asked; nil before the first run and while one runs.
function Server:last_run_memory()
  self.curve_asked = kiln.time()
  local r = self.last_run
  if not r then return nil end
  if not r.curve then
    r.curve = M.memory_curve(r.id)
    r.curve.copied_in = r.copied_in
  end
  return r.curve
end

-- ------------------------------------------------------------------ the last run's memory

--- kiln.mem.stats' copied_in of every device but the shape-only one.
function M.copied_in()
  local out = {}
  for _, name in ipairs(kiln.devices()) do
    if name ~= "meta" then out[name] = kiln.mem.stats(name).copied_in or 0 end
  end
  return out
end

local CURVE_POINTS = 120

--- The last run's memory over time per device that recorded any, from kiln.mem.timeline:
-- the highest bytes in each of CURVE_POINTS equal stretches of the run, with the
-- budget and the stages (the status page draws it). A fixed size whatever the run.
function M.memory_curve(id)
  local out = { prompt_id = id, devices = {} }
  for _, name in ipairs(kiln.devices()) do
    local ok, tl = pcall(kiln.mem.timeline, name)
    if name ~= "meta" and ok and tl and tl.peak > 0 and #tl.frames > 0 and tl.stop > tl.start then
      local bytes = {}
      for i = 1, CURVE_POINTS do bytes[i] = 0 end
      local span = tl.stop - tl.start
      for _, f in ipairs(tl.frames) do
        local a = math.max(1, math.min(CURVE_POINTS, math.floor((f.t0 - tl.start) / span * CURVE_POINTS) + 1))
        local b = math.max(a, math.min(CURVE_POINTS, math.floor((f.t1 - tl.start) / span * CURVE_POINTS) + 1))
        for i = a, b do if f.peak > bytes[i] then bytes[i] = f.peak end end
      end
      local stages = {}
      for _, st in ipairs(tl.stages) do
        if st.depth == 0 or st.depth == 1 then
          stages[#stages + 1] = { name = st.name, t0 = st.t0 - tl.start, t1 = (st.t1 or tl.stop) - tl.start, peak = st.peak }
        end
        if #stages >= 16 then break end
      end
      out.devices[name] = { seconds = span, peak = tl.peak, budget = tl.budget, bytes = bytes, stages = stages }
    end
  end
  return out
end

-- ------------------------------------------------------------------ limits

--- Refuses a request over a limit, naming it ("steps 500 is over the limit of 200 (--max-steps)").
function Server:check_limit(what, value, limit, flag, node_id, class_type)
  if type(value) ~= "number" or value <= limit then return end
  local msg = fmt("%s %s is over the limit of %d (%s)", what, tostring(value), limit, flag)
  local node_errors
  if node_id then
    node_errors = { [node_id] = { errors = { { type = "value_bigger_than_max", message = msg, details = what,
      extra_info = { limit = limit } } }, dependent_outputs = H.array(), class_type = class_type } }
  end
  H.refuse(400, "limit_exceeded", msg, what, node_errors)
end

--- Refuses a prompt of more CLIP tokens than --max-tokens.
function Server:check_tokens(text, node_id, class_type)
  if type(text) ~= "string" then return end
  if #text > self.o.max_tokens * 16 then   -- no tokenizing a megabyte to count it
    self:check_limit("prompt tokens", #text, self.o.max_tokens, "--max-tokens", node_id, class_type)
  end
  self.tok = self.tok or kiln.tokenizer()
  self:check_limit("prompt tokens", #self.tok:encode(text), self.o.max_tokens, "--max-tokens", node_id, class_type)
end

-- ------------------------------------------------------------------ checkpoints kept

local PARTS = { "clip", "t5", "unet", "dit", "vae" }

-- The share of a budget the parts kept between requests may fill: the rest is the next
-- run's working room, so that its first allocations do not evict what it needs next.
local KEEP_SHARE = 0.85

-- Whether a part's weights may stay where they are when a run is done with them: on a
-- device with a budget, in memory mode "normal" (the one that evicts), loaded whole
-- (a streamed part's blocks are the streamer's), and among the checkpoint's parts that
-- fit in KEEP_SHARE of the budget, largest first. Least-recently-used eviction in a
-- budget that holds the networks but not them and a run (SD 1.5's 2 GiB in a 2 GiB
-- budget) would evict the UNet for the text encoder at each request and copy it all
-- again; keeping the largest that fit keeps the costliest copy away. Where kept parts
-- stand in the way, an allocation the budget cannot hold evicts them (kiln's model
-- eviction); on a device without a budget nothing would ever evict them.
local function may_stay(part, ckpt)
  local ok, dev = pcall(function() return part.device end)
  if not ok or not dev or kiln.memory_mode() ~= "normal" then return false end
  local sok, streamed = pcall(function() return part.streamed end)
  if not sok or streamed then return false end
  local budget = kiln.mem.stats(dev).budget or 0
  if budget <= 0 then return false end
  local sizes = {}
  for _, name in ipairs(PARTS) do
    local p = rawget(ckpt, name)
    local bok, n = pcall(function() return p and p:bytes() end)
    if type(p) == "table" and bok and type(n) == "number" then sizes[#sizes + 1] = { part = p, bytes = n } end
  end
  table.sort(sizes, function(a, b) return a.bytes > b.bytes end)
  local room = KEEP_SHARE * budget
  for _, e in ipairs(sizes) do
    if e.bytes <= room then
      room = room - e.bytes
      if e.part == part then return true end
    elseif e.part == part then
      return false
    end
  end
  return false
end

-- A part of a checkpoint the server keeps: its unload (the pipelines' and the graph
-- runner's "done with it for now") leaves the weights resident where may_stay allows,
-- so the next request that needs them copies nothing.
local function keep_resident(part, ckpt)
  if type(part) ~= "table" then return end
  local ok, real = pcall(function() return part.unload end)
  if not ok or type(real) ~= "function" then return end
  rawset(part, "unload", function(self, ...)
    if may_stay(self, ckpt) then return self end
    return real(self, ...)
  end)
end

--- Bytes of checkpoint c's weights on each device (nil when none anywhere).
function M.resident_bytes(c)
  local out, any = {}, false
  for _, name in ipairs(PARTS) do
    local p = rawget(c, name)
    if type(p) == "table" then
      for _, dev in ipairs(kiln.devices()) do
        local ok, n = pcall(function() return p:bytes(dev) end)
        if ok and type(n) == "number" and n > 0 then out[dev] = (out[dev] or 0) + n; any = true end
      end
    end
  end
  return any and out or nil
end

--- A checkpoint file opened once and kept between requests (the runners do not close
-- it); its parts' weights stay resident while the budget allows (keep_resident).
function Server:checkpoint(path, opts)
  local c = self.ckpts[path]
  if c then
    for i, p in ipairs(self.ckpt_order) do if p == path then table.remove(self.ckpt_order, i) break end end
    self.ckpt_order[#self.ckpt_order + 1] = path
    return c
  end
  c = kiln.load_checkpoint(path, opts)
  for _, name in ipairs(PARTS) do keep_resident(rawget(c, name), c) end
  self.ckpts[path] = c
  self.ckpt_order[#self.ckpt_order + 1] = path
  return c
end

--- After a run: a checkpoint with weights resident stays open (the budget's eviction
-- decides when they go); of those with nothing resident, the --keep-checkpoints most
-- recently used stay open (their files mapped, their tokenizers read) and older ones
-- are closed.
function Server:trim_checkpoints()
  local idle = 0
  for i = #self.ckpt_order, 1, -1 do
    local path = self.ckpt_order[i]
    local c = self.ckpts[path]
    if not (c and M.resident_bytes(c)) then
      idle = idle + 1
      if idle > self.o.keep_checkpoints then
        table.remove(self.ckpt_order, i)
        self.ckpts[path] = nil
        if c then pcall(c.close, c) end
      end
    end
  end
end

function Server:close_checkpoints()
  for p, c in pairs(self.ckpts) do pcall(c.close, c); self.ckpts[p] = nil end
  self.ckpt_order = {}
end

-- ------------------------------------------------------------------ status page

function M.status_page()
  local ok, page = pcall(require, "kiln.serve.page")
  if ok and type(page) == "table" and page.html then return page.html end
  return "<!doctype html><title>kiln serve</title><h1>kiln serve</h1><p>ComfyUI API at /prompt, A1111 API at /sdapi/v1/.</p>"
end

-- ------------------------------------------------------------------ main

local function mode_of(p) return lfs.attributes(p, "mode") end

local function mkdirs(p)
  local path = ""
  for part in p:gmatch("[^/]+") do
    path = path == "" and ((p:sub(1, 1) == "/") and "/" .. part or part) or path .. "/" .. part
    if mode_of(path) == nil then lfs.mkdir(path) end
  end
  if mode_of(p) ~= "directory" then util.usage_error(fmt("cannot make the folder %s", p)) end
end

local function abs(p)
  local r = require("kiln.serve_http").realpath(p)
  return r or p
end

--- Parses the command line (a usage error names the mistake); returns the options.
function M.options(args)
  for _, a in ipairs(args) do
    if a == "--help" or a == "-h" then print(USAGE); os.exit(0) end
  end
  local o = util.parse_args(args, { models = "", output = "", input = "", temp = "", listen = "127.0.0.1", port = 8188,
    token = "", history = 100, max_body = "64M", max_size = 4096, max_batch = 16, max_steps = 200, max_tokens = 1024,
    max_queue = 256, keep_checkpoints = 2, device = "", mode = "", vram = "", quiet = false, threads = 32 })
  if o.models == "" then util.usage_error("kiln serve: --models DIR is needed\n" .. USAGE) end
  if o.output == "" then util.usage_error("kiln serve: --output DIR is needed\n" .. USAGE) end
  if mode_of(o.models) ~= "directory" then util.usage_error(fmt("--models %s: no such folder", o.models)) end
  for _, k in ipairs({ "port", "history", "max_size", "max_batch", "max_steps", "max_tokens", "max_queue",
    "keep_checkpoints", "threads" }) do
    local v = math.tointeger(o[k])
    if not v or v < 0 then util.usage_error(fmt("--%s %s: must be a whole number >= 0", k:gsub("_", "-"), tostring(o[k]))) end
    o[k] = v
  end
  if o.port > 65535 then util.usage_error(fmt("--port %d: must be 0..65535", o.port)) end
  local okb, mb = pcall(kiln.parse_size, o.max_body)
  if not okb or type(mb) ~= "number" or mb <= 0 then util.usage_error(fmt("--max-body %s: not a size (64M, 1G)", o.max_body)) end
  o.max_body = math.tointeger(mb) or math.floor(mb)
  o.token = o.token ~= "" and o.token or nil
  local cfg = { device = o.device ~= "" and o.device or nil, mode = o.mode ~= "" and o.mode or nil,
    budget = o.vram ~= "" and o.vram or nil, quiet = o.quiet or nil }
  local okc, e = pcall(kiln.configure, cfg)
  if not okc then util.usage_error(type(e) == "table" and (e.message or tostring(e)) or tostring(e)) end
  mkdirs(o.output)
  o.input = o.input ~= "" and o.input or (o.models:gsub("/+$", "") .. "/input")
  o.temp = o.temp ~= "" and o.temp or (o.output:gsub("/+$", "") .. "/../temp")
  mkdirs(o.input)
  mkdirs(o.temp)
  o.models, o.output, o.input, o.temp = abs(o.models), abs(o.output), abs(o.input), abs(o.temp)
  return o
end

--- Makes the server state over an open kiln.serve_http server.
function M.new(srv, o)
  local s = setmetatable({ srv = srv, o = o, queue = {}, history = { ids = {}, by = {} }, number = 0,
    ckpts = {}, ckpt_order = {}, a1111 = {} }, Server)
  return s
end

--- `kiln serve ...` (the arguments as the CLI gives them).
function M.main(...)
  local args = type((...)) == "table" and (...) or { ... }
  local o = M.options(args)
  local http = require "kiln.serve_http"
  if not http.available then util.usage_error("kiln serve: " .. tostring(http.why)) end
  require "kiln.serve.comfy_api"
  require "kiln.serve.a1111_api"
  local okh, srv = pcall(http.start, { listen = o.listen, port = o.port, token = o.token, max_body = o.max_body,
    threads = math.max(o.threads, 4) })
  if not okh then util.usage_error(tostring(srv)) end
  local s = M.new(srv, o)
  io.stdout:write(fmt("kiln serve: listening on http://%s:%d\n", o.listen, srv:port()))
  io.stdout:flush()
  local ok, err = pcall(function()
    while not s.stopping do
      local ev = srv:next(#s.queue > 0 and 0 or s.collect and 0.05 or 0.25)
      if not ev and s.collect and #s.queue == 0 then
        collectgarbage("collect")   -- idle for a moment after a run
        s.collect = false
      end
      if ev then
        -- a cancel requested just as a run ended would raise here: harmless, cleared
        local hok, herr = pcall(s.handle, s, ev)
        if not hok and not is_cancel(herr) then error(herr, 0) end
        kiln.cancel(false)
      end
      if not s.stopping and #s.queue > 0 and not s.running then s:run_next() end
    end
  end)
  -- stopping: what waits in the queue is answered (A1111 requests) or dropped
  for _, job in ipairs(s.queue) do
    if job.abandon then pcall(job.abandon, s, job) end
  end
  s.queue = {}
  s:close_checkpoints()
  srv:close()
  collectgarbage("collect")
  if not o.quiet then io.stderr:write("kiln serve: stopped\n") end
  if not ok then error(err, 0) end
end

return M
