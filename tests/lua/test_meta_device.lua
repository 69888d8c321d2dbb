-- The shape-only device `meta` and kiln.dry_run: the demo model's pipelines run on
-- sim for real and again as a dry run modelling sim (same budget, same memory mode);
-- the predicted peak must be the measured one within 2%. Also: a budget too small is
-- reported (fits = false, naming the stage), a dry run reads no weight data (the file
-- is truncated after its header before the run), and meta tensors read back zeros.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"
local dry = require "kiln.dry_run"
local test, eq, truthy = H.test, H.eq, H.truthy

local MODEL = H.demo_model("dry runs of the demo pipelines")
kiln.set_quiet(true)
-- Tensors a script leaves to the garbage collector are freed at its pace, which
-- depends on the Lua heap, not on the device, and the two runs' heaps differ (the dry
-- run's stage records): the collector is stopped in both runs (real_peak, predicted),
-- so what is compared is the allocation decisions, garbage included in both. With it
-- running, the demo's peaks moved by up to 0.8 MiB (hires fix, 16 MiB budget) with
-- the collector's phase, either way.
collectgarbage("incremental", 140, 200)
local TOKENIZER = MODEL:match("^(.*)/[^/]*$") or "."

local has_sim, has_meta = false, false
for _, d in ipairs(kiln.devices()) do
  has_sim = has_sim or d == "sim"
  has_meta = has_meta or d == "meta"
end

local MiB = 1024 * 1024
local BASE = { prompt = "a red circle on a blue background", steps = 2, seed = 1, width = 64, height = 64,
  device = "sim" }
local function opts(extra)
  local t = {}
  for k, v in pairs(BASE) do t[k] = v end
  for k, v in pairs(extra or {}) do t[k] = v end
  return t
end

local function settle()
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
end

-- The measured peak of run(ckpt) on sim under budget and mode, from nothing resident,
-- the collector stopped. Prefetches copy at once, as a dry run's do: on the copy thread
-- they land when it gets a core, before or after the block that runs meanwhile peaks
-- (the dry run counts them resident through it).
local function real_peak(run, mode, budget, on_copy_thread)
  local ck <close> = kiln.load_checkpoint(MODEL)
  settle()
  local old_budget = kiln.mem.stats("sim").budget
  local old_mode = kiln.memory_mode()
  kiln.memory_mode(mode)
  kiln.mem.set_budget("sim", budget)
  kiln.mem.reset_peak("sim")
  kiln.mem.prefetch_at_once(not on_copy_thread)
  collectgarbage("stop")
  local ok, err = pcall(run, ck)
  collectgarbage("restart")
  kiln.mem.prefetch_at_once(false)
  local st = kiln.mem.stats("sim")
  kiln.mem.set_budget("sim", old_budget)
  kiln.memory_mode(old_mode)
  if not ok then error(err, 0) end
  ck.unet:unload(); ck.vae:unload(); ck.clip:unload()
  settle()
  return st.peak
end

local function predicted(run, mode, budget)
  local ck <close> = kiln.load_checkpoint(MODEL)
  settle()
  return kiln.dry_run(function()
    collectgarbage("stop")
    local ok, err = pcall(run, ck)
    collectgarbage("restart")
    if not ok then error(err, 0) end
  end, { device = "sim", budget = budget, mode = mode })
end

local function compare(what, run, mode, budget)
  local real = real_peak(run, mode, budget)
  local r = predicted(run, mode, budget)
  truthy(r.fits, what .. ": the dry run did not fit: " .. tostring(r.oom))
  local err = (r.peak - real) / real
  print(("# %s (%s mode): measured %.2f MiB, predicted %.2f MiB (%+.2f%%), dry run %.3f s"):format(what, mode,
    real / MiB, r.peak / MiB, err * 100, r.seconds))
  truthy(math.abs(err) <= 0.02, ("%s: predicted %d vs measured %d bytes"):format(what, r.peak, real))
  eq(r.leaked, 0, what .. ": bytes left on meta")
  return r
end

if not (has_sim and has_meta) then
  test("dry runs", function() H.skip("no sim or no meta device") end)
  H.done()
end
kiln.set_default_device("sim") -- as `kiln --device sim`: the run's tensors start there

test("meta tensors: shapes and bytes, no data; reads give zeros", function()
  local x = kiln.randn({ 2, 3, 8, 8 }, { seed = 1 }):to("meta")
  eq(x.device, "meta")
  eq(x:nbytes(), 2 * 3 * 8 * 8 * 4)
  local y = kiln.nn.conv2d(x, kiln.zeros({ 5, 3, 3, 3 }, { device = "meta" }), nil, { padding = 1 })
  eq(table.concat(y.shape, ","), "2,5,8,8")
  eq(y:sum(), 0)
  eq(y:to("cpu"):table()[1][1][1][1], 0)
  H.raises(function() kiln.nn.conv2d(x, kiln.zeros({ 5, 4, 3, 3 }, { device = "meta" })) end, "input channels")
end)

test("txt2img: predicted peak within 2% (normal and low modes)", function()
  local function run(ck) pipeline.txt2img(ck, opts()) end
  local r = compare("txt2img", run, "normal", 0)
  local names = {}
  for _, s in ipairs(r.stages) do names[#names + 1] = s.name end
  truthy(#r.stages > 0, "stages from the pipeline's spans")
  print("# stages: " .. table.concat(names, ", "))
  compare("txt2img", run, "low", 0)
end)

test("img2img and hires fix: predicted peak within 2%", function()
  local img = kiln.zeros({ 1, 3, 64, 64 }, { device = "cpu" }) + 0.5
  compare("img2img", function(ck) pipeline.img2img(ck, img, opts({ denoise = 0.6 })) end, "normal", 0)
  compare("hires fix", function(ck) pipeline.hires_fix(ck, opts({ hires_steps = 2, scale = 2 })) end, "low", 0)
end)

test("tiled VAE decode and a budget that forces eviction: within 2%", function()
  compare("txt2img, tiled decode", function(ck) pipeline.txt2img(ck, opts({ width = 128, height = 128,
    tile = 8, overlap = 2 })) end, "normal", 0)
  compare("hires fix, 16 MiB budget", function(ck) pipeline.hires_fix(ck, opts({ hires_steps = 2, scale = 4,
    tile = 16, overlap = 4 })) end, "low", 16 * MiB)
end)

-- Low mode streams the UNet's blocks with prefetches; a dry run copies them at once
-- (runtime/model.c, prefetch_now), not on the copy thread whose timing against an
-- arithmetic that takes no time varied the peak from run to run.
test("a dry run's peak is the same on every run (low mode, prefetches)", function()
  local function run(ck) pipeline.txt2img(ck, opts()) end
  local first
  for i = 1, 6 do
    local r = predicted(run, "low", 0)
    truthy(r.fits, "the dry run fits")
    if i == 1 then first = r.peak else eq(r.peak, first, "dry run " .. i .. "'s peak") end
  end
end)

-- A real run prefetches on the copy thread, which may get a core late: the copies then
-- land after the block that runs meanwhile has peaked. The copies' memory is taken
-- when the prefetch is queued (runtime/model_stream.c), so the peak is the dry run's
-- to the byte whenever they land; taken by the copy thread, a late copy left the real
-- peak below the prediction (the SD 1.5 piece in low mode: 1.064x).
test("low mode, copies landing late: the real peak is still the dry run's", function()
  local function run(ck) pipeline.txt2img(ck, opts()) end
  local want = predicted(run, "low", 0).peak
  for _, delay in ipairs({ 0, 0.004 }) do
    kiln.mem.copy_delay(delay)
    local ok, real = pcall(real_peak, run, "low", 0, true)
    kiln.mem.copy_delay(0)
    if not ok then error(real, 0) end
    print(("# copy thread, %.0f ms late: measured %.3f MiB, predicted %.3f MiB (%.4fx)"):format(delay * 1000,
      real / MiB, want / MiB, want / real))
    truthy(real <= want, ("%g s late: measured %d > predicted %d bytes"):format(delay, real, want))
    truthy(want <= 1.03 * real, ("%g s late: predicted %d > 1.03 x measured %d bytes"):format(delay, want, real))
  end
end)

test("a budget too small: fits = false, the stage named", function()
  local ck <close> = kiln.load_checkpoint(MODEL)
  local r = kiln.dry_run(function() pipeline.txt2img(ck, opts()) end,
    { device = "sim", budget = 3 * MiB, mode = "high" })
  eq(r.fits, false)
  truthy(type(r.oom) == "string" and r.oom:find("out of memory"), tostring(r.oom))
  -- where: the stage running, else (a load before the stages) the model being loaded
  truthy(r.oom:find("stage '") or r.oom:find("model '"), "where is named: " .. r.oom)
  eq(r.budget, 3 * MiB)
  eq(kiln.mem.meta_target(), nil, "the dry run ended")
  eq(kiln.mem.stats("meta").allocated, 0)
  print("# too small: " .. r.oom:sub(1, 160))
end)

test("no weight data read: the file truncated after its header still dry-runs", function()
  local src = assert(io.open(MODEL, "rb"))
  local bytes = src:read("a")
  src:close()
  local header = string.unpack("<I8", bytes) + 8
  local path = os.tmpname()
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
  local ck <close> = kiln.load_checkpoint(path, { tokenizer = TOKENIZER })
  f = assert(io.open(path, "wb")) -- truncates: a page read past the header would be SIGBUS
  f:write(bytes:sub(1, header))
  f:close()
  local r = kiln.dry_run(function() pipeline.txt2img(ck, opts()) end, { device = "sim" })
  truthy(r.fits, tostring(r.oom))
  truthy(r.peak > 0)
  os.remove(path)
  print(("# dry run of txt2img on a truncated file: %.3f s, peak %.2f MiB"):format(r.seconds, r.peak / MiB))
end)

test("after a dry run the real weights are used again", function()
  local ck <close> = kiln.load_checkpoint(MODEL)
  local a = pipeline.txt2img(ck, opts()):to("cpu")
  kiln.dry_run(function() pipeline.txt2img(ck, opts()) end, { device = "sim", mode = "low" })
  local b = pipeline.txt2img(ck, opts()):to("cpu")
  eq((a - b):abs():max(), 0)
  truthy(a:max() > 0, "a real picture")
end)

test("a model resident on sim before a dry run is resident there after it", function()
  local ck <close> = kiln.load_checkpoint(MODEL)
  local old_mode = kiln.memory_mode()
  kiln.memory_mode("normal")
  ck.vae:load("sim")
  local bytes = ck.vae:bytes("sim")
  truthy(bytes > 0)
  local copied = kiln.mem.stats("sim").bytes_to_device
  local r = kiln.dry_run(function()
    ck.vae:load("sim")
    ck.vae:decode(kiln.zeros({ 1, 4, 16, 16 }))
    ck.vae:unload()
  end, { device = "sim" })
  kiln.memory_mode(old_mode)
  truthy(r.peak >= bytes, "the dry run loaded its own copy")
  eq(ck.vae:bytes("sim"), bytes, "the real copy is back")
  eq(kiln.mem.stats("sim").bytes_to_device, copied, "nothing copied to the real device")
  ck.vae:unload()
end)

test("dry_run errors: not a function, meta modelling itself, an ordinary error raised again", function()
  H.raises(function() kiln.dry_run(42) end, "expected a function")
  H.raises(function() kiln.dry_run(function() end, { device = "meta", budget = -1 }) end, "budget")
  H.raises(function() kiln.dry_run(function() error("boom") end, { device = "sim" }) end, "boom")
  eq(kiln.mem.meta_target(), nil)
  local r = kiln.dry_run(function() return 1 end, { device = "sim", budget = "6G" })
  eq(r.budget, 6 * 1024 * MiB)
  truthy(dry.format(r):find("dry run on sim"))
end)

test("kiln --device meta:sim --vram SIZE script.lua prints the report", function()
  local exe = arg and arg[-1]
  if not exe or not exe:match("kiln$") then H.skip("not run by the kiln executable") end
  local script = os.tmpname()
  local f = assert(io.open(script, "w"))
  f:write(([[
local ck <close> = kiln.load_checkpoint(%q)
local img = require("kiln.pipeline").txt2img(ck, { prompt = "a red circle", steps = 2, width = 64, height = 64,
  seed = 1 })
print("device of the picture: " .. img.device)
]]):format(MODEL))
  f:close()
  local function run(vram)
    local p = io.popen(("%s --quiet --device meta:sim --vram %s %s 2>&1; echo \"rc=$?\""):format(exe, vram, script))
    local out = p:read("a")
    p:close()
    return out
  end
  local out = run("1G")
  truthy(out:find("device of the picture: sim", 1, true), out)
  truthy(out:find("dry run on sim: peak [%d.]+ MiB allocated") and out:find("fits") and out:find("rc=0"), out)
  truthy(out:find("\n  sample%s+peak"), out)
  out = run("2M")
  truthy(out:find("does not fit") and out:find("out of memory in stage") and out:find("rc=1"), out)
  os.remove(script)
end)

test("a dry run's saves leave the user's files as they were, and still check the folder", function()
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p '" .. dir .. "'"))
  local png, st = dir .. "/picture.png", dir .. "/weights.safetensors"
  for _, p in ipairs({ png, st }) do
    local f = assert(io.open(p, "wb"))
    f:write("the user's own file")
    f:close()
  end
  local ck <close> = kiln.load_checkpoint(MODEL)
  local r = kiln.dry_run(function()
    local o = opts()
    local img = pipeline.txt2img(ck, o)
    pipeline.save(img, png, o, ck)
    kiln.save_png(img:to("cpu"), dir .. "/new.png")
    kiln.save_safetensors(st, { w = kiln.zeros({ 4, 4 }) })
    H.raises(function() kiln.save_png(img:to("cpu"), dir .. "/no/such/folder.png") end, "no/such/folder.png")
  end, { device = "sim", budget = "1G" })
  truthy(r.fits)
  for _, p in ipairs({ png, st }) do
    local f = assert(io.open(p, "rb"))
    eq(f:read("a"), "the user's own file", p)
    f:close()
  end
  local lfs = require "lfs"
  local left = {}
  for name in lfs.dir(dir) do if name ~= "." and name ~= ".." then left[#left + 1] = name end end
  table.sort(left)
  eq(table.concat(left, " "), "picture.png weights.safetensors", "no new file, no temporary left")
  os.remove(png)
  os.remove(st)
  os.remove(dir)
end)

test("a PNG the pipelines write carries the measured peak (kiln.peak)", function()
  local ck <close> = kiln.load_checkpoint(MODEL)
  kiln.mem.reset_peak("sim")
  local o = opts()
  local img = pipeline.txt2img(ck, o)
  local path = os.tmpname() .. ".png"
  pipeline.save(img, path, o, ck)
  local text = require("kiln.comfy").png_text(path)
  os.remove(path)
  local peak = text["kiln.peak"]
  truthy(peak and peak:find("sim: %d+%.%d MiB"), "kiln.peak: " .. tostring(peak))
  print("# kiln.peak: " .. peak)
end)

H.done()
