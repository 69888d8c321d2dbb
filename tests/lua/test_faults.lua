-- Fault injection (kiln.fault, runtime/fault.h): the demo txt2img run once per
-- allocation index it makes (a spread of indices in make test, every index with
-- KILN_FAULTS=all: `make faults`), each index failing as if the device were full:
-- every run ends in a clean Lua error or a recovered OOM (never a crash), and the
-- bytes allocated on every device come back to the baseline. Then failed writes: a
-- PNG save that fails at its first write leaves the file already there untouched
-- and no temporary file behind. A Lua error raised from a progress handler, a preview
-- hook or a sampler callback unwinds the same way.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"
local test, eq, truthy = H.test, H.eq, H.truthy

local MODEL = H.demo_model("fault injection")
kiln.set_quiet(true)
local ck <close> = kiln.load_checkpoint(MODEL)
local O = { prompt = "a red circle on a blue background", seed = 3, steps = 2, width = 64, height = 64 }

local function allocated()
  collectgarbage(); collectgarbage()
  local r = {}
  for _, d in ipairs(kiln.devices()) do r[d] = kiln.mem.stats(d).allocated end
  return r
end

local function run()
  local ok, img = pcall(pipeline.txt2img, ck, O)
  if ok then img:free() end
  ck.clip:unload(); ck.unet:unload(); ck.vae:unload()
  return ok, img
end

test("every allocation index of the demo txt2img fails cleanly and gives its bytes back", function()
  run()                                   -- warm: tokenizer, caches, first-use tables
  local base = allocated()
  kiln.fault.arm("alloc", 0)
  local ok = run()
  local n = kiln.fault.count("alloc")
  assert(ok, "the run without a fault failed")
  truthy(n > 10, ("allocations counted: %d"):format(n))
  local idx = {}
  if os.getenv("KILN_FAULTS") == "all" then
    for i = 1, n do idx[#idx + 1] = i end
  else
    for i = 1, 12 do idx[#idx + 1] = i end                 -- the setup
    for k = 1, 48 do idx[#idx + 1] = 12 + (k * (n - 12)) // 48 end   -- spread over the run
  end
  local clean, recovered, other = 0, 0, {}
  for _, i in ipairs(idx) do
    kiln.fault.arm("alloc", i)
    local okr, err = run()
    kiln.fault.arm("alloc", 0)
    if okr then
      recovered = recovered + 1           -- an OOM caught and retried (tiled VAE, ...)
    else
      local msg = type(err) == "table" and tostring(err.message or err.kind) or tostring(err)
      if msg:find("out of memory", 1, true) then clean = clean + 1 else other[#other + 1] = i .. ": " .. msg end
    end
    local now = allocated()
    for d, b in pairs(base) do
      eq(now[d], b, ("allocation %d failed: bytes left allocated on %s"):format(i, d))
    end
  end
  print(("  %d allocations in the run; %d indices tried: %d clean OOM errors, %d recovered, %d other errors")
    :format(n, #idx, clean, recovered, #other))
  eq(#other, 0, "errors that are not the OOM: " .. table.concat(other, "; "))
  eq(clean + recovered, #idx)
end)

test("a Lua error from a progress handler, a preview hook or a step callback unwinds cleanly", function()
  -- warm: the previewer keeps its projection weights once made
  local w = {}
  for k, v in pairs(O) do w[k] = v end
  w.preview = function() end
  local img = pipeline.txt2img(ck, w)
  img:free()
  ck.clip:unload(); ck.unet:unload(); ck.vae:unload()
  local base = allocated()
  local hooks = {
    { "kiln.on_progress", function(o)
      kiln.on_progress(function(step) if step == 2 then error("boom from on_progress") end end)
      return o
    end },
    { "preview", function(o) o.preview = function() error("boom from preview") end; o.preview_every = 1; return o end },
    { "callback", function(o) o.callback = function() error("boom from callback") end; return o end },
  }
  for _, h in ipairs(hooks) do
    local o = {}
    for k, v in pairs(O) do o[k] = v end
    o = h[2](o)
    local ok, err = pcall(pipeline.txt2img, ck, o)
    kiln.on_progress(nil)
    truthy(not ok and tostring(err):find("boom", 1, true), h[1] .. ": " .. tostring(err))
    ck.clip:unload(); ck.unet:unload(); ck.vae:unload()
    local now = allocated()
    for d, b in pairs(base) do eq(now[d], b, h[1] .. ": bytes left allocated on " .. d) end
  end
  -- and the next run works
  local ok = run()
  truthy(ok, "a run after the errors")
end)

test("a failed write leaves the saved file as it was and no temporary file", function()
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p '" .. dir .. "'"))
  local path = dir .. "/keep.png"
  local img = kiln.rand({ 1, 3, 16, 16 }, { seed = 1 })
  kiln.save_png(img, path)
  local f = assert(io.open(path, "rb"))
  local before = f:read("a")
  f:close()
  local other = kiln.rand({ 1, 3, 16, 16 }, { seed = 2 })
  for i = 1, 3 do
    kiln.fault.arm("write", i)
    local ok, err = pcall(kiln.save_png, other, path)
    local hit = kiln.fault.count("write") >= i
    kiln.fault.arm("write", 0)
    if hit then
      truthy(not ok and tostring(err):find("injected", 1, true), "write " .. i .. ": " .. tostring(err))
      f = assert(io.open(path, "rb"))
      eq(f:read("a") == before, true, "the file is unchanged after a failed write " .. i)
      f:close()
    end
  end
  local p = io.popen("ls -a '" .. dir .. "'")
  local names = p:read("a")
  p:close()
  eq(names:find("%.tmp") , nil, "no temporary file left: " .. names)
  os.remove(path)
  os.remove(dir)
  img:free(); other:free()
end)

H.done()
