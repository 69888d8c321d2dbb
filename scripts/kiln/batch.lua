-- kiln.batch: `kiln batch enqueue | worker | status`, batch generation on Redis
-- Streams. Jobs are JSON lines queued in one stream per model (so a worker keeps
-- taking jobs for the model it has open), read by a consumer group; a job is
-- acknowledged only after DIR/<id>.png is written atomically, a dead worker's jobs are
-- reclaimed after --claim-idle, a failing job is retried then dead-lettered.
--
-- Keys of a queue Q (--queue, default "kiln"):
--   Q:streams  set of job streams (Q:jobs:<model>), group "workers"
--   Q:ids      hash id -> stream: every job ever queued (the total)
--   Q:done     hash id -> "<redis time> <worker> <seconds>"
--   Q:failed   hash id -> error; Q:dead the dead-letter stream (id, job, error, attempts)
--   Q:workers  hash worker -> "<redis time> <job or ->" (last seen); Q:worker_done counts
--   Q:reclaims hash id -> "<redis time> <worker>" of its last reclaim
local kiln = require "kiln"
local util = require "kiln.util"

local M = {}

local GROUP = "workers"

-- Options a job may carry, with their type ("int", "number", "string") and check.
local JOB_KEYS = {
  id = "string", mode = "string", prompt = "string", negative = "string", seed = "int", steps = "int",
  cfg = "number", sampler = "string", scheduler = "string", width = "int", height = "int",
  model = "string", denoise = "number", input = "string", scale = "number",
  hires_denoise = "number", hires_steps = "int", upscale = "string", clip_skip = "int",
  tileable = "string", weighting = "string",
}
local MODES = { txt2img = true, img2img = true, hires = true }

-- ---------------------------------------------------------------- helpers

local function parse_redis(s)
  local host, port = s:match("^%[?([^%]]*)%]?:(%d+)$")
  if not host then host, port = s, "6379" end
  if host == "" then host = "127.0.0.1" end
  return host, tonumber(port)
end

local function connect(o)
  if not kiln.queue.available() then
    -- said on one line, as a command-line mistake is: nothing in a script went wrong
    util.usage_error("kiln was built without hiredis: apt-get install libhiredis-dev and rebuild")
  end
  local host, port = parse_redis(o.redis)
  local ok, q = pcall(kiln.queue.connect, host, port, { retry = math.floor((o.retry or 60) * 1000) })
  if not ok then util.usage_error(("--redis %s: %s"):format(o.redis, tostring(q):gsub("^queue: ", ""))) end
  return q
end

-- Seconds on the Redis server's clock: one clock for every host of a farm.
local function redis_time(q)
  local t = q:command("TIME")
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end

-- FNV-1a of the id: the seed of a job that names none, so a re-run draws the same noise.
local function seed_of(id)
  local h = 2166136261
  for i = 1, #id do h = ((h ~ id:byte(i)) * 16777619) & 0xffffffff end
  return h
end

local function worker_name()
  local host = "host"
  local f = io.open("/proc/sys/kernel/hostname") or io.open("/etc/hostname")
  if f then host = (f:read("l") or host); f:close() end
  local pid = "0"
  f = io.open("/proc/self/stat")
  if f then pid = f:read("l"):match("^(%d+)") or pid; f:close() end
  return host .. ":" .. pid
end

local function read_file(path)
  local f, err = io.open(path, "rb")
  if not f then util.usage_error(err) end
  local s = f:read("a")
  f:close()
  return s
end

-- ---------------------------------------------------------------- validation

--- Checks one decoded job; returns nil or the problem.
function M.check_job(j)
  if type(j) ~= "table" or j[1] ~= nil then return "not a JSON object" end
  if type(j.id) ~= "string" or j.id == "" then return "no \"id\" (a non-empty string)" end
  if not j.id:match("^[%w._%-]+$") or j.id:match("^%.") then
    return ("id %q: only letters, digits, '.', '_' and '-' (it names DIR/<id>.png)"):format(j.id)
  end
  for k, v in pairs(j) do
    local t = JOB_KEYS[k]
    if not t then
      local known = util.sorted_keys(JOB_KEYS)
      return ("unknown option %q (known: %s)"):format(tostring(k), table.concat(known, ", "))
    end
    if v == kiln.json.null then return ("%s is null"):format(k) end
    local shown = type(v) == "string" and ("%q"):format(v) or type(v) == "table" and "a list or object" or tostring(v)
    if t == "string" and type(v) ~= "string" then return ("%s: a string expected, got %s"):format(k, shown) end
    if t == "number" and type(v) ~= "number" then return ("%s: a number expected, got %s"):format(k, shown) end
    if t == "int" and math.type(v) ~= "integer" then return ("%s: a whole number expected, got %s"):format(k, shown) end
  end
  local mode = j.mode or "txt2img"
  if not MODES[mode] then return ("mode %q: expected txt2img, img2img or hires"):format(mode) end
  if mode == "img2img" and not j.input then return "img2img needs \"input\" (a PNG path)" end
  if j.steps and (j.steps < 1 or j.steps > 10000) then return ("steps %d: 1 to 10000"):format(j.steps) end
  for _, k in ipairs({ "width", "height" }) do
    if j[k] and (j[k] < 8 or j[k] % 8 ~= 0) then return ("%s %d: a positive multiple of 8"):format(k, j[k]) end
  end
  if j.seed and (j.seed < 0 or j.seed > 0xffffffffffff) then return ("seed %d out of range"):format(j.seed) end
  local sample = require "kiln.sample"
  if j.sampler and not sample.sampler_info(j.sampler) then
    return ("sampler %q (known: %s)"):format(j.sampler, table.concat(sample.names(), ", "))
  end
  if j.scheduler and not sample.scheduler_info(j.scheduler) then
    return ("scheduler %q (known: %s)"):format(j.scheduler, table.concat(sample.scheduler_names(), ", "))
  end
  if j.denoise and (j.denoise <= 0 or j.denoise > 1) then return "denoise: in (0, 1]" end
  return nil
end

--- Reads and checks every line of a JSONL text; returns the jobs, or raises a usage
-- error naming each bad line ("jobs.jsonl:3: ...") before anything is queued.
function M.parse_jobs(text, name)
  local jobs, bad, seen = {}, {}, {}
  local n = 0
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    line = line:gsub("\r$", "")
    if line:match("%S") then
      local ok, j = pcall(kiln.json.decode, line)
      local why = not ok and ("not JSON: " .. tostring(j):gsub("^json: ", "")) or M.check_job(j)
      if not why and seen[j.id] then why = ("id %q repeats line %d"):format(j.id, seen[j.id]) end
      if why then
        bad[#bad + 1] = ("%s:%d: %s"):format(name, n, why)
      else
        seen[j.id] = n
        if j.seed == nil then j.seed = seed_of(j.id) end -- written into the job: explicit
        jobs[#jobs + 1] = { job = j, line = line, n = n }
      end
    end
  end
  if #bad > 0 then
    local more = #bad > 20 and ("\n(%d more bad lines)"):format(#bad - 20) or ""
    while #bad > 20 do table.remove(bad) end
    util.usage_error(("%d bad line%s, nothing queued:\n%s%s"):format(#bad, #bad == 1 and "" or "s",
      table.concat(bad, "\n"), more))
  end
  return jobs
end

-- ---------------------------------------------------------------- enqueue

local function stream_of(Q, model) return Q .. ":jobs:" .. (model or "") end

local function ensure_group(q, stream)
  local ok, err = pcall(q.command, q, "XGROUP", "CREATE", stream, GROUP, "0", "MKSTREAM")
  if not ok and not tostring(err):find("BUSYGROUP", 1, true) then error(err, 0) end
end

--- Queues jobs (batch.parse_jobs's); returns (queued, skipped as already queued).
function M.enqueue(q, Q, jobs)
  local queued, skipped = 0, 0
  for _, e in ipairs(jobs) do
    local j = e.job
    local stream = stream_of(Q, j.model)
    -- HSETNX first: a job id is queued once per queue, even if enqueue runs twice
    if q:command("HSETNX", Q .. ":ids", j.id, stream) == 1 then
      q:command("SADD", Q .. ":streams", stream)
      ensure_group(q, stream)
      q:xadd(stream, { "id", j.id, "job", kiln.json.encode(j), "attempt", 1 })
      queued = queued + 1
    else
      skipped = skipped + 1
    end
  end
  return queued, skipped
end

-- ---------------------------------------------------------------- status

local function hash_pairs(reply)
  local t = {}
  for i = 1, #reply, 2 do t[reply[i]] = reply[i + 1] end
  return t
end

--- The numbers `status` prints: total, done, failed, pending, in_flight (per worker),
-- rate (jobs/s over the last minute of completions, else the whole run), eta (s).
function M.counts(q, Q)
  local c = {
    total = q:command("HLEN", Q .. ":ids"), done = q:command("HLEN", Q .. ":done"),
    failed = q:command("HLEN", Q .. ":failed"), in_flight = {}, workers = {},
  }
  c.pending = math.max(0, c.total - c.done - c.failed)
  for _, s in ipairs(q:command("SMEMBERS", Q .. ":streams")) do
    local ok, p = pcall(q.xpending, q, s, GROUP)
    if ok then for w, n in pairs(p.consumers or {}) do c.in_flight[w] = (c.in_flight[w] or 0) + n end end
  end
  local now = redis_time(q)
  local seen = hash_pairs(q:command("HGETALL", Q .. ":workers"))
  local wdone = hash_pairs(q:command("HGETALL", Q .. ":worker_done"))
  for w, v in pairs(seen) do
    local t, job = v:match("^(%S+) (%S+)")
    c.workers[w] = { seen = now - (tonumber(t) or now), job = job, done = tonumber(wdone[w]) or 0 }
  end
  local times = {}
  for _, v in ipairs(q:command("HVALS", Q .. ":done")) do times[#times + 1] = tonumber(v:match("^(%S+)")) end
  table.sort(times)
  if #times >= 2 then
    local recent = 0
    for _, t in ipairs(times) do if t >= now - 60 then recent = recent + 1 end end
    local span = times[#times] - times[1]
    if recent >= 2 and now - 60 > times[1] then c.rate = recent / 60
    elseif span > 0 then c.rate = (#times - 1) / span end
  end
  if c.rate and c.rate > 0 then c.eta = c.pending / c.rate end
  return c
end

local function print_status(c)
  print(("done: %d"):format(c.done))
  print(("pending: %d"):format(c.pending))
  print(("failed: %d"):format(c.failed))
  print(("total: %d"):format(c.total))
  local flying = 0
  for _, n in pairs(c.in_flight) do flying = flying + n end
  print(("in flight: %d"):format(flying))
  for _, w in ipairs(util.sorted_keys(c.workers)) do
    local i = c.workers[w]
    print(("  worker %s: %d in flight, %d done, seen %.0fs ago%s"):format(w, c.in_flight[w] or 0, i.done, i.seen,
      i.job ~= "-" and (", on " .. i.job) or ""))
  end
  for w, n in pairs(c.in_flight) do
    if not c.workers[w] then print(("  worker %s: %d in flight"):format(w, n)) end
  end
  print(c.rate and ("throughput: %.3g jobs/s"):format(c.rate) or "throughput: -")
  print(c.eta and ("eta: %.0fs"):format(c.eta) or "eta: -")
end

-- ---------------------------------------------------------------- worker

local Worker = {}
Worker.__index = Worker

-- The open checkpoint: kept while the jobs that come are for it (files mapped, hash
-- known); another model closes it first.
function Worker:checkpoint(model)
  model = model or require("kiln.cli").default_model()
  if self.model ~= model then
    if self.ckpt then self.ckpt:close() end
    self.ckpt, self.model = nil, nil
    self.ckpt = kiln.load_checkpoint(model)
    self.model = model
  end
  return self.ckpt
end

function Worker:close()
  if self.ckpt then self.ckpt:close() end
  self.ckpt = nil
end

function Worker:log(fmt, ...)
  if not self.o.quiet then
    io.stderr:write(("[%s] " .. fmt .. "\n"):format(self.name, ...))
  end
end

-- Removes what an earlier, killed writer of this picture left (atomic_file's
-- "<path>.<pid>.<n>.tmp"): the job is ours now, so its owner is gone.
local function remove_leftovers(dir, id)
  local ok, lfs = pcall(require, "lfs")
  if not ok then return end
  local prefix = id .. ".png."
  for f in lfs.dir(dir) do
    if f:sub(1, #prefix) == prefix and f:match("%.tmp$") then os.remove(dir .. "/" .. f) end
  end
end

-- Generates and writes one job's picture; raises on failure.
function Worker:generate(j)
  local pipeline = require "kiln.pipeline"
  local ckpt = self:checkpoint(j.model)
  local o = {}
  for k, v in pairs(j) do o[k] = v end
  o.id, o.mode, o.model, o.input = nil, nil, nil, nil
  o.width = o.width or pipeline.image_size(ckpt)
  o.height = o.height or pipeline.image_size(ckpt)
  o.device = kiln.default_device()
  local img, lat
  local mode = j.mode or "txt2img"
  if mode == "img2img" then
    local input <close> = kiln.load_png(j.input)
    img, lat = pipeline.img2img(ckpt, input, o)
  elseif mode == "hires" then
    img, lat = pipeline.hires_fix(ckpt, o)
    o.width, o.height = img.shape[4], img.shape[3]
  else
    img, lat = pipeline.txt2img(ckpt, o)
  end
  if lat then lat:free() end
  local path = self.o.output .. "/" .. j.id .. ".png"
  -- no kiln.peak: a job's picture is the same bytes whichever worker runs it
  local ok, err = pcall(pipeline.save, img, path, o, ckpt, { peak = false })
  img:free()
  if not ok then error(err, 0) end
  return path
end

function Worker:heartbeat(job)
  self.q:command("HSET", self.Q .. ":workers", self.name, ("%.3f %s"):format(redis_time(self.q), job or "-"))
end

-- Runs one delivered entry to its end: done + ack, a retry, or the dead letter.
function Worker:run(e)
  local q, Q = self.q, self.Q
  local f = e.fields
  local id = f.id or "?"
  if q:command("HEXISTS", Q .. ":done", id) == 1 or q:command("HEXISTS", Q .. ":failed", id) == 1 then
    q:xack(e.stream, GROUP, e.id)   -- finished by a worker that died before its ack
    return
  end
  local attempt = tonumber(f.attempt) or 1
  self:heartbeat(id)
  remove_leftovers(self.o.output, id)
  local t0 = kiln.time()
  -- a job longer than --claim-idle is not someone else's to take: between sampler
  -- steps its entry's idle time is reset (XCLAIM to ourselves, JUSTID)
  local touched = t0
  local prev
  prev = kiln.on_progress(function(...)
    local t = kiln.time()
    if t - touched >= self.o.claim_idle / 3 then
      touched = t
      pcall(q.command, q, "XCLAIM", e.stream, GROUP, self.name, "0", e.id, "JUSTID")
    end
    if prev then return prev(...) end
  end)
  local ok, err = pcall(function()
    local j = kiln.json.decode(f.job)
    return self:generate(j)
  end)
  kiln.on_progress(prev)
  local secs = kiln.time() - t0
  if not ok and (tostring(err):find("interrupted!", 1, true) or type(err) == "table" and err.kind == "cancelled") then
    -- Ctrl-C or a cancel stops the worker, not the job: it stays pending for the others
    self:heartbeat(nil)
    error(err, 0)
  end
  if ok then
    -- the picture is on disk: record it, then ack (a crash between the two is seen above)
    q:command("HSET", Q .. ":done", id, ("%.3f %s %.3f"):format(redis_time(q), self.name, secs))
    q:command("HINCRBY", Q .. ":worker_done", self.name, 1)
    q:xack(e.stream, GROUP, e.id)
    self.done = self.done + 1
    self:log("done %s (%.2fs)", id, secs)
  else
    local msg = tostring(err)
    if attempt <= self.o.retries then
      q:xadd(e.stream, { "id", id, "job", f.job, "attempt", attempt + 1, "error", msg })
      q:xack(e.stream, GROUP, e.id)
      self:log("failed %s (attempt %d, retried): %s", id, attempt, msg)
    else
      self:dead_letter(e, attempt, msg)
    end
  end
  self:heartbeat(nil)
end

function Worker:dead_letter(e, attempts, msg)
  local q, Q = self.q, self.Q
  local id = e.fields.id or "?"
  q:xadd(Q .. ":dead", { "id", id, "job", e.fields.job or "", "error", msg, "attempts", attempts })
  q:command("HSET", Q .. ":failed", id, msg)
  q:xack(e.stream, GROUP, e.id)
  self:log("failed %s after %d attempts: %s", id, attempts, msg)
end

-- Entries idle longer than --claim-idle in any stream (their worker died): taken
-- over; one that has killed its workers more often than the retries allow is
-- dead-lettered instead of taking the farm down with it.
function Worker:reclaim(streams)
  local got = {}
  for _, s in ipairs(streams) do
    local entries = self.q:xautoclaim(s, GROUP, self.name, math.floor(self.o.claim_idle * 1000), { count = 1 })
    for _, e in ipairs(entries) do
      local rows = self.q:xpending(s, GROUP, { start = e.id, stop = e.id, count = 1 })
      local deliveries = rows[1] and rows[1].deliveries or 1
      self:log("reclaimed %s (delivered %d times)", e.fields.id or e.id, deliveries)
      self.q:command("HSET", self.Q .. ":reclaims", e.fields.id or e.id, ("%.3f %s"):format(redis_time(self.q), self.name))
      if deliveries > self.o.retries + 1 then
        self:dead_letter(e, deliveries - 1, "its worker died on every attempt")
      else
        got[#got + 1] = e
      end
    end
    if #got > 0 then break end
  end
  return got
end

function Worker:next_entries()
  local q, Q = self.q, self.Q
  local streams = q:command("SMEMBERS", Q .. ":streams")
  table.sort(streams)
  if #streams == 0 then
    q:command("BLPOP", Q .. ":idle", "1") -- nothing queued yet: wait a second, not a busy loop
    return {}, streams
  end
  local got = self:reclaim(streams)
  if #got > 0 then return got, streams end
  -- the stream of the open model first: a model stays loaded while its jobs come
  local cur = self.model and stream_of(Q, self.model_key)
  if cur then
    for _, s in ipairs(streams) do
      if s == cur then
        got = q:xreadgroup(GROUP, self.name, { cur }, { count = 1 })
        if #got > 0 then return got, streams end
      end
    end
  end
  -- else one job of the first model that has any (one stream at a time: a read of
  -- all of them would hand this worker one job of each model at once)
  for _, s in ipairs(streams) do
    if s ~= cur then
      got = q:xreadgroup(GROUP, self.name, { s }, { count = 1 })
      if #got > 0 then return got, streams end
    end
  end
  return q:xreadgroup(GROUP, self.name, streams, { count = 1, block = 500 }), streams
end

function Worker:finished()
  local c = self.q:command("HLEN", self.Q .. ":ids")
  local d = self.q:command("HLEN", self.Q .. ":done") + self.q:command("HLEN", self.Q .. ":failed")
  return d >= c
end

function Worker:loop()
  while true do
    local entries = self:next_entries()
    if #entries == 0 then
      if self.o.drain and self:finished() then break end
      self:heartbeat(nil)
    end
    for _, e in ipairs(entries) do
      local ok, j = pcall(kiln.json.decode, e.fields.job or "")
      self.model_key = ok and type(j) == "table" and j.model or nil
      self:run(e)
    end
  end
end

-- ---------------------------------------------------------------- command line

local USAGE = [[
usage: kiln batch enqueue JOBS.jsonl [--redis HOST:PORT] [--queue NAME]
       kiln batch worker --output DIR [--redis HOST:PORT] [--queue NAME] [--drain]
                  [--device cuda:1] [--mode M] [--vram SIZE] [--claim-idle SECONDS]
                  [--retries N] [--name NAME] [--quiet]
       kiln batch status [--redis HOST:PORT] [--queue NAME]
A job is one JSON line: "id" and txt2img options (prompt, negative, seed, steps, cfg,
sampler, scheduler, width, height, model, clip_skip, tileable); "mode": "img2img" with
"input" and "denoise", or "hires" with "scale", "hires_denoise", "hires_steps",
"upscale". Its picture is DIR/<id>.png. Defaults: --redis 127.0.0.1:6379, --queue
kiln, --claim-idle 60, --retries 3.]]

local DEFAULTS = {
  redis = "127.0.0.1:6379", queue = "kiln", output = "", drain = false, device = "", mode = "",
  vram = "", claim_idle = 60, retries = 3, name = "", quiet = false, retry = 60,
}

function M.main(...)
  local args = { ... }
  local cmd = table.remove(args, 1)
  if cmd == nil or cmd == "--help" or cmd == "-h" or cmd == "help" then
    print(USAGE)
    return
  end
  local file
  if cmd == "enqueue" then
    file = table.remove(args, 1)
    if file == nil or file:match("^%-%-") then util.usage_error("kiln batch enqueue: a JOBS.jsonl file expected") end
  elseif cmd ~= "worker" and cmd ~= "status" then
    util.usage_error(("kiln batch: unknown command '%s' (enqueue, worker, status)"):format(cmd))
  end
  local o = util.parse_args(args, DEFAULTS)
  local Q = o.queue
  if cmd == "enqueue" then
    local jobs = M.parse_jobs(read_file(file), file) -- all checked before connecting
    local q <close> = connect(o)
    local n, skipped = M.enqueue(q, Q, jobs)
    print(("queued: %d%s"):format(n, skipped > 0 and (" (%d already queued, skipped)"):format(skipped) or ""))
    return
  elseif cmd == "status" then
    local q <close> = connect(o)
    print_status(M.counts(q, Q))
    return
  end
  if o.output == "" then util.usage_error("kiln batch worker: --output DIR is needed") end
  local lfs = require "lfs"
  if lfs.attributes(o.output, "mode") ~= "directory" then
    local ok, err = lfs.mkdir(o.output)
    if not ok then util.usage_error(("--output %s: %s"):format(o.output, err)) end
  end
  if o.claim_idle <= 0 then util.usage_error("--claim-idle: seconds > 0") end
  local cfg = { device = o.device ~= "" and o.device or nil, mode = o.mode ~= "" and o.mode or nil,
    budget = o.vram ~= "" and o.vram or nil, quiet = true }
  local ok, err = pcall(kiln.configure, cfg)
  if not ok then util.usage_error(util.is_usage_error(err) and err.message or tostring(err)) end
  local q <close> = connect(o)
  local w = setmetatable({ q = q, Q = Q, o = o, done = 0,
    name = o.name ~= "" and o.name or worker_name() }, Worker)
  w:log("worker on %s, Redis %s, queue %s", kiln.default_device(), q:info().server_version, Q)
  local okl, errl = pcall(w.loop, w)
  w:close()
  if not okl then error(errl, 0) end
  w:log("drained: %d done here", w.done)
end

return M
