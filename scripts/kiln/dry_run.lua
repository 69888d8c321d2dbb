-- kiln.dry_run: a script's peak memory on a device without running its arithmetic
-- or reading its weight files. The shape-only device `meta` takes the modelled
-- device's place for the duration of fn: the same caching allocator settings (grain,
-- cache limit), the budget asked for, the backend's optional entries and temporaries,
-- and the device's name, so every load, eviction, streaming window and tiling decision
-- falls as on the real device. Data read back (item, table, to("cpu")) is zeros.
-- Tensors left to the garbage collector are held until the scripts' next collection
-- point, so the prediction is the real run's peak or above it, never below.
--
--   kiln.dry_run(fn, {device = "sim" | "cuda:0" | name, budget = bytes | "6G",
--                     mode = "high" | "normal" | "low" | "none"}) -> report
--     report = {device, budget, fits, oom (nil or the message, naming the stage),
--               peak (= peak_allocated), peak_allocated, peak_reserved,
--               stages = {{name, peak, peak_reserved}, ...} (kiln.trace.span's, in
--               the order they started; nested names joined by " > "),
--               seconds, leaked, scratch (the kernels' scratch outside the
--               device's allocator at its peak: the CPU backend's host scratch,
--               which kiln.mem.stats("cpu").workspace_peak measures; 0 elsewhere)}
--   dry_run.format(report) -> text (what `kiln --device meta` prints)
--   dry_run.peak_of(fn, args, dev) -> bytes | nil, why: what fn(args...) adds at its
--     peak on dev, exact, at the real size (kiln.mem.estimate's first way)
--
-- An error other than out-of-memory is raised again after the device is given back.
local kiln = require "kiln"
local util = require "kiln.util"

local M = {}

--- Functions called (no arguments) as every dry run ends, before the shape-only device
-- is given back: modules that hold shape-only tensors for the run's length (the
-- encoding cache's stand-ins for the entries a real run would keep) free them there.
M.ending = {}

--- The device a dry run models by default: the first GPU, else sim.
function M.default_target()
  for _, d in ipairs(kiln.devices()) do
    if d:match("^cuda") then return d end
  end
  return "sim"
end

local function budget_of(b, dev)
  if b == nil then return kiln.mem.stats(dev).budget end
  if type(b) == "string" then return kiln.parse_size(b) end
  if math.type(b) ~= "integer" or b < 0 then
    error("kiln.dry_run: budget must be bytes (an integer >= 0) or a size such as \"6G\", got " .. tostring(b), 3)
  end
  return b
end

--- Runs fn(...) on meta modelling opts.device; returns the report (see above).
function M.run(fn, opts, ...)
  if type(fn) ~= "function" then error("kiln.dry_run: expected a function, got " .. type(fn), 2) end
  opts = opts or {}
  local dev = opts.device or kiln.default_device()
  if dev == "meta" then dev = M.default_target() end
  if kiln.mem.meta_target() then error("kiln.dry_run: a dry run is already running", 2) end
  local budget = budget_of(opts.budget, dev)
  local old_mode = kiln.memory_mode()
  if opts.mode then kiln.memory_mode(opts.mode) end
  local old_default = kiln.default_device()
  collectgarbage()
  local t0 = kiln.time()
  local began, name = pcall(kiln.mem.meta_begin, dev, budget)
  if not began then
    kiln.memory_mode(old_mode)
    error(name, 2)
  end
  -- the default device is redirected only where it was the modelled one (the name
  -- means meta now); a script that computes elsewhere by default still does
  if old_default == name then kiln.set_default_device(name) end

  -- stages: the watermark between boundaries goes to every open stage
  -- failed_in[error] = the stages an error left (the innermost first seen), so the
  -- report names where the error that ended the run happened
  local stages, open, failed_in = {}, {}, setmetatable({}, { __mode = "k" })
  local peak_a, peak_r = 0, 0
  local function fold()
    local a, r = kiln.mem.meta_mark()
    if a > peak_a then peak_a = a end
    if r > peak_r then peak_r = r end
    for _, s in ipairs(open) do
      if a > s.peak then s.peak = a end
      if r > s.peak_reserved then s.peak_reserved = r end
    end
  end
  local span = kiln.trace.span
  kiln.trace.span = function(sname, f, ...)
    fold()
    local path = {}
    for _, s in ipairs(open) do path[#path + 1] = s.short end
    path[#path + 1] = tostring(sname)
    local rec = { name = table.concat(path, " > "), short = tostring(sname), peak = 0, peak_reserved = 0 }
    stages[#stages + 1] = rec
    open[#open + 1] = rec
    local function close(ok, ...)
      fold()
      local e = ...
      if not ok and type(e) == "table" and not failed_in[e] then
        local path = {}
        for _, s in ipairs(open) do path[#path + 1] = s.short end
        failed_in[e] = path
      end
      for i = #open, 1, -1 do
        if open[i] == rec then table.remove(open, i) break end
      end
      if not ok then error(..., 0) end
      return ...
    end
    return close(pcall(span, sname, f, ...))
  end

  -- one outer stage: in the memory picture of a real run (the planner's dry runs) the
  -- dry run's stages nest under it instead of passing for the run's own
  -- The collector is held for the run: a tensor left to it lives until the next full
  -- collection that the scripts make themselves (each sampler evaluation, pipeline
  -- stage and ComfyUI node starts with one, in real runs as here) or that memory
  -- pressure makes (bindings/l_config.c, here too), the longest it can live in a real
  -- run, whose collector may free it sooner but never later: what the real run holds is
  -- never more than the prediction.
  local gc_was = collectgarbage("isrunning")
  collectgarbage("stop")
  local ok, err = pcall(span, "dry run on " .. name, fn, ...)
  if gc_was then collectgarbage("restart") end
  if ok then err = nil end          -- fn's results are not kept: they may hold meta tensors
  fold()
  local where = type(err) == "table" and failed_in[err] or {}
  kiln.trace.span = span
  for _, f in ipairs(M.ending) do pcall(f) end
  collectgarbage()
  collectgarbage()
  local scratch = kiln.mem.meta_scratch and kiln.mem.meta_scratch() or 0
  local leaked = kiln.mem.meta_end()
  if old_default == name then kiln.set_default_device(old_default) end
  kiln.memory_mode(old_mode)
  if not ok and not util.is_oom(err) then error(err, 0) end
  for _, s in ipairs(stages) do s.short = nil end
  local oom
  if not ok then
    oom = tostring(err):gsub("meta: out of memory", name .. " (dry run): out of memory")
    if #where > 0 then oom = "in stage '" .. table.concat(where, " > ") .. "': " .. oom end
  end
  return {
    device = name, budget = budget, fits = ok, oom = oom,
    peak = peak_a, peak_allocated = peak_a, peak_reserved = peak_r,
    stages = stages, seconds = kiln.time() - t0, leaked = leaked, scratch = scratch,
  }
end

local function is_tensor(v)
  local mt = type(v) == "userdata" and getmetatable(v)
  return type(mt) == "table" and mt.__name == "kiln.Tensor"
end

--- The bytes fn(args...) adds on dev at its peak (its intermediates and output, and
-- the weights it streams in), computed by a dry run at the inputs' real size: args'
-- tensors on dev are replaced by meta tensors of their shape and dtype, others are
-- passed as they are. Returns nil and the reason where meta cannot answer: inside a
-- dry run, no meta device, or fn touches data of dev that is not among args (a model
-- already resident there). kiln.mem.estimate and the planner use it.
function M.peak_of(fn, args, dev)
  if kiln.mem.meta_target() then return nil, "inside a dry run" end
  local present = false
  for _, d in ipairs(kiln.devices()) do present = present or d == "meta" end
  if not present then return nil, "no meta device" end
  local n = args.n or #args
  local base, peak = 0, 0
  local ok, r = pcall(M.run, function()
    local call = { n = n }
    for i = 1, n do
      local v = args[i]
      if is_tensor(v) and v.device == dev then
        call[i] = kiln.empty(v.shape, { device = dev, dtype = v.dtype })
      else
        call[i] = v
      end
    end
    collectgarbage()
    base = kiln.mem.stats(dev).allocated
    kiln.mem.meta_mark()
    fn(table.unpack(call, 1, n))
    peak = kiln.mem.meta_mark()
  end, { device = dev, budget = 0 })
  if not ok then return nil, tostring(r) end
  if not r.fits then return nil, r.oom end
  return math.max(0, peak - base)
end

--- `kiln --device meta[:NAME] [--vram SIZE] script.lua`: the script as a dry run
-- modelling NAME (default_target() when ""), its default device, under budget (0: the
-- device's own); prints the report. A run that does not fit fails (exit status 1).
function M.main(target, budget, chunk, ...)
  if target == "" then target = M.default_target() end
  local old = kiln.default_device()
  kiln.set_default_device(target)
  local ok, r = pcall(M.run, chunk, { device = target, budget = budget > 0 and budget or nil }, ...)
  kiln.set_default_device(old)
  if not ok then error(r, 0) end
  print(M.format(r))
  if not r.fits then error("dry run: does not fit on " .. r.device, 0) end
  return r
end

--- The report as text: one line for the run, one per stage.
function M.format(r)
  local fb = kiln.format_bytes
  local lines = {
    string.format("dry run on %s: peak %s allocated, %s reserved; budget %s; %s (%.2f s)", r.device,
      fb(r.peak_allocated), fb(r.peak_reserved), r.budget > 0 and fb(r.budget) or "none",
      r.fits and "fits" or "does not fit", r.seconds),
  }
  for _, s in ipairs(r.stages) do
    lines[#lines + 1] = string.format("  %-40s peak %s", s.name, fb(s.peak))
  end
  if r.oom then lines[#lines + 1] = "  out of memory " .. r.oom end
  return table.concat(lines, "\n")
end

return M
