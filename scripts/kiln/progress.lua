-- kiln.progress (require "kiln.progress"; the kiln.progress function is the
-- binding's event): the progress display of long loops (sampling steps, tiles).
-- A bar with step i/n, it/s and ETA on stderr when it is a terminal, a plain line
-- every few seconds otherwise, nothing when kiln is quiet (--quiet). Hosts that
-- embed kiln receive the same events through kiln.progress when it exists.
local kiln = require "kiln"

local M = {}

--- Starts a display for n steps labelled `label`; returns an object with
-- :step(i) (call after step i) .
function M.start(label, n)
  local quiet = kiln.quiet()
  local tty = kiln.isatty("stderr")
  local t0, last = kiln.time(), -math.huge
  local p = {}
  function p.step(_, i)
    if kiln.progress then kiln.progress(i, n, label) end
    if quiet then return end
    local t = kiln.time()
    local rate = i / math.max(t - t0, 1e-9)
    local eta = (n - i) / rate
    if tty then
      local w = 24
      local fill = math.floor(w * i / n + 0.5)
      io.stderr:write(("\r%-8s [%s%s] %d/%d  %.2f it/s  ETA %.0fs "):format(label,
        ("#"):rep(fill), ("."):rep(w - fill), i, n, rate, eta))
      if i == n then io.stderr:write("\n") end
    elseif t - last >= 5 or i == n then
      io.stderr:write(("%s: step %d/%d, %.2f it/s, ETA %.0fs\n"):format(label, i, n, rate, eta))
      last = t
    end
    io.stderr:flush()
  end
  return p
end

return M
