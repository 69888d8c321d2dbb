-- tests/lua/harness.lua - the Lua test harness: test(name, fn) runs fn under
-- xpcall and prints "PASS name" / "FAIL name: error" / "SKIP name: reason" lines,
-- which tests/run.sh totals. Assertions raise with the caller's line.
local H = {}
local failed = 0

-- The names the test takes from os.tmpname (a file it may replace with a folder, or
-- use as a prefix) are removed with whatever the test put there when the program
-- ends, passed or failed: tests must not leave their models and pictures in /tmp.
local temps = {}
local tmpname = os.tmpname
function os.tmpname()
  local path = tmpname()
  temps[#temps + 1] = path
  return path
end
local function remove_temps()
  for i = #temps, 1, -1 do
    local path = temps[i]
    temps[i] = nil
    if path:match("^/tmp/lua_%w+$") then os.execute("rm -rf -- '" .. path .. "' '" .. path .. "'.* 2>/dev/null") end
  end
end
H._temps = setmetatable({}, { __gc = remove_temps }) -- runs when the Lua state closes

function H.test(name, fn)
  local skipped
  local ok, err = xpcall(fn, function(e)
    if type(e) == "table" and e.skip then return e end
    return debug.traceback(tostring(e), 2)
  end)
  if ok then
    print("PASS " .. name)
  elseif type(err) == "table" and err.skip then
    print("SKIP " .. name .. ": " .. err.reason)
    skipped = true
  else
    failed = failed + 1
    print("FAIL " .. name .. ": " .. tostring(err))
  end
  io.stdout:flush()
  return not skipped
end

function H.skip(reason) error({ skip = true, reason = reason }, 0) end

function H.eq(a, b, msg)
  if a ~= b then
    error(("%sexpected %s, got %s"):format(msg and (msg .. ": ") or "", tostring(b), tostring(a)), 2)
  end
end

function H.near(a, b, tol, msg)
  tol = tol or 1e-6
  if not (math.abs(a - b) <= tol) then
    error(("%sexpected %.9g, got %.9g (tol %g)"):format(msg and (msg .. ": ") or "", b, a, tol), 2)
  end
end

function H.truthy(v, msg)
  if not v then error(msg or "expected a true value", 2) end
end

-- Runs fn, which must raise; the message must contain each of the given strings.
function H.raises(fn, ...)
  local ok, err = pcall(fn)
  if ok then error("expected an error, none was raised", 2) end
  local msg = tostring(err)
  for _, s in ipairs({ ... }) do
    if not msg:find(s, 1, true) then
      error(("error message %q does not contain %q"):format(msg, s), 2)
    end
  end
  return err
end

-- Max absolute difference between two tensors (or nested tables).
function H.maxdiff(a, b)
  local d = (a - b):abs():max()
  return d
end

-- A tensor's shape as "1,4,8,8".
function H.shape_of(t) return table.concat(t.shape, ",") end

-- Checks the shapes agree and max |a - b| / max(1, max |b|) <= tol (a golden's scale
-- sets what "close" means); returns that relative difference.
function H.close_rel(a, b, tol, what)
  H.eq(H.shape_of(a), H.shape_of(b), (what or "") .. " shape")
  local d = (a:to("f32") - b:to("f32")):abs():max()
  local scale = math.max(1, b:to("f32"):abs():max())
  if not (d / scale <= tol) then
    error(("%s: max difference %g (relative %g) > %g"):format(what or "", d, d / scale, tol), 3)
  end
  return d / scale
end

-- The end of a test file: a failure exits at once; otherwise the file's chunk ends
-- normally, so its <close> variables close and the kiln program checks, once the
-- context is closed, that nothing was left allocated (KILN_CHECK_LEAKS, set by
-- tests/run.sh): no bytes allocated, reserved within the budget, and no tensor or model
-- still alive (held by a global or a module) once the chunk has ended. The tests'
-- own caches (tiny_sd's recipes) are dropped here for that.
function H.done()
  if failed ~= 0 then
    remove_temps()
    os.exit(1)
  end
  local tiny = package.loaded.tiny_sd
  if type(tiny) == "table" and tiny.forget then tiny.forget() end
end

-- The bundled demo model's path ($KILN_DEMO_MODEL overrides it). When the file is
-- missing, the whole test file is one SKIP line named `what` and ends here.
function H.demo_model(what)
  local path = os.getenv("KILN_DEMO_MODEL") or "examples/models/kiln-shapes.safetensors"
  local f = io.open(path, "rb")
  if f then
    f:close()
    return path
  end
  H.test(what, function() H.skip(path .. " is missing") end)
  H.done()
  os.exit(0, true) -- the rest of the file needs the model (H.done returns when nothing failed)
end

-- Each named device is present (kiln.devices()); else the whole test file is one SKIP
-- line named `what` and ends here.
function H.need_devices(what, ...)
  local have = {}
  for _, d in ipairs(require("kiln").devices()) do have[d] = true end
  local missing = {}
  for _, d in ipairs({ ... }) do if not have[d] then missing[#missing + 1] = d end end
  if #missing == 0 then return end
  H.test(what, function() H.skip("no " .. table.concat(missing, " or no ") .. " device") end)
  H.done()
  os.exit(0, true)
end

return H
