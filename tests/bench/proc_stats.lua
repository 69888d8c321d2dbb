-- tests/bench/proc_stats.lua - what the benches print about the process and the machine
-- beside their numbers: peak and current RSS (anonymous and file-backed) from
-- /proc/self/status, the load average, a flushed printf, and the best and median time
-- of repeated runs.
--   local ps = dofile("tests/bench/proc_stats.lua")
local kiln = require "kiln"

local M = {}

function M.say(...) print(string.format(...)) io.stdout:flush() end

--- The process's peak resident set (VmHWM), bytes.
function M.rss_peak()
  for line in io.lines("/proc/self/status") do
    local kb = line:match("^VmHWM:%s*(%d+)")
    if kb then return tonumber(kb) * 1024 end
  end
  return 0
end

--- Resident anonymous and file-backed (mapped weight files' pages, which the kernel can
-- drop) memory now, bytes.
function M.rss_parts()
  local r = {}
  for line in io.lines("/proc/self/status") do
    local k, kb = line:match("^(Rss%a+):%s*(%d+)")
    if k then r[k] = tonumber(kb) * 1024 end
  end
  return r.RssAnon or 0, r.RssFile or 0
end

--- "1.00 2.00 3.00": the 1, 5 and 15 minute load averages.
function M.loadavg()
  local f = io.open("/proc/loadavg")
  local s = f and f:read("l") or "?"
  if f then f:close() end
  return s:match("^(%S+ %S+ %S+)") or s
end

--- fn() run n times, each after a full collection: its best and median seconds.
function M.best_of(n, fn)
  local ts = {}
  for i = 1, n do
    collectgarbage(); collectgarbage()
    local t0 = kiln.time()
    fn()
    ts[i] = kiln.time() - t0
  end
  table.sort(ts)
  return ts[1], ts[(n + 1) // 2]
end

return M
