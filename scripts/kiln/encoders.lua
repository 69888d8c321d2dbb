-- kiln.encoders: what a pipeline does with its text encoders (CLIP, T5) around the
-- prompt's encoding. They run once per prompt, before the sampler: release() takes them
-- off the device after encoding unless the memory mode keeps models resident or the
-- budget has room for the next stage beside them; plan() sizes an encoder's stage for
-- kiln.planner (weights, low-mode window, and the work of one encode at the run's token
-- count, from a dry run on the shape-only device).
--
--   encoders.release({ckpt.clip, ckpt.t5}, dev [, {need = bytes}]) -> parts unloaded
--   encoders.plan(part, dev, {tokens = n}) -> {bytes, window, work | nil, why}
local kiln = require "kiln"

local M = {}
local fmt = string.format

--- After encoding: each part of `parts` (nil entries skipped) leaves dev, except in
-- memory mode "high" (loaded models stay there by the user's choice) or when opts.need
-- (the bytes the next stage will take on dev) fits beside what dev holds now. Unloading
-- drops every copy but the mapped file (in mode "low" the weights were on the host:
-- that copy goes too). Cached encodings stay: the budget evicts them when it must.
-- Returns the number of parts unloaded.
function M.release(parts, dev, opts)
  if type(parts) ~= "table" then error("kiln.encoders.release: expected a list of parts, got " .. type(parts), 2) end
  opts = opts or {}
  local need = opts.need
  if need ~= nil and (type(need) ~= "number" or need < 0) then
    error(fmt("kiln.encoders.release: need must be a number of bytes >= 0, got %s", tostring(need)), 2)
  end
  dev = dev or kiln.default_device()
  if kiln.memory_mode() == "high" then return 0 end
  if need then
    local st = kiln.mem.stats(dev)
    if st.budget == 0 or st.budget - st.allocated >= need then return 0 end
  end
  local n = 0
  for i = 1, parts.n or #parts do
    local p = parts[i]
    if p then
      p:unload()
      n = n + 1
    end
  end
  return n
end

--- An encoder's row of the planner's table: its stored weight bytes, its streaming
-- window in mode "low" and the work of one encode of opts.tokens tokens (the activations
-- at their peak with the weights streamed, less the window), measured by a dry run of
-- t5:forward / clip's encoder on dev's shape-only model. work is nil (and why says
-- why) where it cannot be measured.
function M.plan(part, dev, opts)
  opts = opts or {}
  local planner = require "kiln.planner"
  local bytes, window = planner.part_bytes(part)
  local row = { bytes = bytes, window = window }
  local tokens = opts.tokens
  if not part.forward or math.type(tokens) ~= "integer" or tokens < 1 then
    row.why = "no token count"
    return row
  end
  local prev = kiln.memory_mode()
  kiln.memory_mode("low")
  part:load(dev)
  local ids = kiln.zeros({ 1, tokens }, "i64")
  local ok, peak = pcall(kiln.mem.estimate, function(x)
    local y = part:forward(x)
    y:free()
  end, { ids }, { device = dev })
  ids:free()
  part:unload()
  kiln.memory_mode(prev)
  if not ok then
    row.why = tostring(type(peak) == "table" and peak.message or peak)
    return row
  end
  row.work = math.max(0, peak - (dev ~= "cpu" and window or 0))
  return row
end

return M
