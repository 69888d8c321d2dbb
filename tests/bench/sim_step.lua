-- tests/bench/sim_step.lua - a DiT bench's step on `sim` under a budget, the way
-- bench_flux_step.lua and bench_sd3_step.lua run it: first as a dry run (kiln.dry_run,
-- the collector held as during the measured step), then measured (time, sim's peak,
-- the process's RSS), each followed by the network's unload.
--   local ss = dofile("tests/bench/sim_step.lua")
--   ss.dry(step, dit, {budget = MiB, mode = ...})
--   ss.measure(step, dit, {budget = MiB}, flops, rate)
local kiln = require "kiln"
local ps = dofile("tests/bench/proc_stats.lua")
local say, rss_peak, rss_parts, loadavg = ps.say, ps.rss_peak, ps.rss_parts, ps.loadavg
local MiB = 1024 * 1024

local M = {}

--- The dry run of step() on meta modelling sim: prints the prediction, returns the report.
function M.dry(step, dit, o)
  local r = kiln.dry_run(function()
    collectgarbage("stop")
    local ok, err = pcall(step)
    collectgarbage("restart")
    if not ok then error(err, 0) end
  end, { device = "sim", budget = o.budget * MiB, mode = o.mode })
  say("  dry run (meta): predicted peak %.1f MiB (allocated %.1f, reserved %.1f), %s, %.2f s", r.peak / MiB,
    r.peak_allocated / MiB, r.peak_reserved / MiB, r.fits and "fits" or ("does not fit: " .. tostring(r.oom)),
    r.seconds)
  dit:unload()
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
  return r
end

--- step() measured inside sim's budget (flops / rate: the step's time at the GEMM rate).
function M.measure(step, dit, o, flops, rate)
  kiln.mem.set_budget("sim", o.budget * MiB)
  kiln.mem.reset_peak("sim")
  local la0 = loadavg()
  collectgarbage("stop")
  local t0 = kiln.time()
  step()
  local s = kiln.time() - t0
  collectgarbage("restart")
  local st = kiln.mem.stats("sim")
  local anon, file = rss_parts()
  dit:unload()
  say("  measured: %.1f s; sim peak %.1f MiB (budget %d); peak RSS %.0f MiB; load average %s before, %s after", s,
    st.peak / MiB, o.budget, rss_peak() / MiB, la0, loadavg())
  say("  step / (FLOPs / GEMM rate) = x%.2f", s / (flops / rate))
  say("  after the step: RSS %.0f MiB anonymous + %.0f MiB of mapped file pages", anon / MiB, file / MiB)
  return s, st.peak
end

return M
