-- The memory picture: the timeline's bytes by owner against the allocator, the
-- stages' peaks against the allocator's peak within each stage, the PNG of a demo
-- txt2img run on sim read back (its size, the owners' colours where they must be),
-- the bounded frame list, and the picture of a run that raised.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"

local DIR = os.getenv("TMPDIR") or "/tmp"
local function tmp(name) return ("%s/kiln_mem_plot_%d_%s"):format(DIR, math.floor(kiln.time() * 1e6) % 1000000, name) end

local function sum(row)
  local s = 0
  for _, v in pairs(row) do s = s + v end
  return s
end

-- RGB (0-255) of pixel (x, y), 0-based, of an image [1, 3, H, W] in [0, 1]
local function pixel(img, x, y)
  local t = img:narrow(4, x + 1, 1):narrow(3, y + 1, 1):table()[1]
  return { math.floor(t[1][1][1] * 255 + 0.5), math.floor(t[2][1][1] * 255 + 0.5), math.floor(t[3][1][1] * 255 + 0.5) }
end

local function same(a, b) return a[1] == b[1] and a[2] == b[2] and a[3] == b[3] end

local function owner(layout, name)
  for _, o in ipairs(layout.owners) do
    if o.name == name then return o end
  end
end

H.test("timeline bytes by owner equal the allocator's", function()
  local a = kiln.zeros({ 256, 256 }, { device = "sim" })
  local b = kiln.zeros({ 1000 }, { device = "sim" })
  local tl = kiln.mem.timeline("sim")
  H.eq(tl.device, "sim")
  H.eq(tl.total, kiln.mem.stats("sim").allocated, "total now")
  H.eq(sum(tl.now), tl.total, "owners add up")
  H.truthy((tl.now.tensor or 0) >= 256 * 256 * 4, "tensors are the 'tensor' owner")
  a:free()
  b:free()
  tl = kiln.mem.timeline("sim")
  H.eq(tl.total, kiln.mem.stats("sim").allocated, "total after the frees")
end)

H.test("frames stay bounded and keep the peak", function()
  kiln.mem.clear_timeline()
  kiln.mem.reset_peak("sim")
  local keep = {}
  for i = 1, 6000 do
    local t = kiln.zeros({ 64 + i % 7 }, { device = "sim" })
    if i == 3000 then keep[1] = kiln.zeros({ 1 << 20 }, { device = "sim" }) end
    if i == 3001 then keep[1]:free() end
    t:free()
  end
  local tl = kiln.mem.timeline("sim")
  H.truthy(#tl.frames <= 4096 and #tl.frames >= 1024, "frames: " .. #tl.frames)
  local top = 0
  for _, f in ipairs(tl.frames) do
    H.eq(sum(f.at_peak), f.peak, "a frame's owners add up to its peak")
    if f.peak > top then top = f.peak end
  end
  H.eq(tl.peak, kiln.mem.stats("sim").peak, "peak since the clear")
  H.eq(top, tl.peak, "the highest frame keeps the peak")
end)

H.test("a stage that raised is kept and marked", function()
  kiln.mem.clear_timeline()
  local ok = pcall(kiln.trace.span, "boom", function()
    local t <close> = kiln.zeros({ 1000 }, { device = "sim" })
    error("bang")
  end)
  H.eq(ok, false)
  local tl = kiln.mem.timeline("sim")
  H.eq(#tl.stages, 1)
  H.eq(tl.stages[1].name, "boom")
  H.eq(tl.stages[1].failed, true)
  H.truthy(tl.stages[1].t1, "ended")
  local path = tmp("boom.png")
  local text = kiln.mem.plot(path, { device = "sim" })
  H.truthy(text:find("boom (error)", 1, true), text)
  local img <close> = kiln.load_png(path)
  H.eq(img.shape[4], 960)
  os.remove(path)
end)

local function wait(seconds)
  local t = kiln.time()
  while kiln.time() - t < seconds do end
end

H.test("the budget line follows budget changes", function()
  local before = kiln.mem.stats("sim").budget
  kiln.mem.clear_timeline()
  kiln.mem.set_budget("sim", 64 << 20)
  local a = kiln.zeros({ 8 << 20 }, { device = "sim" }) -- 32 MiB
  wait(0.03)
  kiln.mem.set_budget("sim", 48 << 20)
  local b = kiln.zeros({ 256 }, { device = "sim" })     -- the next change carries the new budget
  wait(0.03)
  local tl = kiln.mem.timeline("sim")
  local seen = {}
  for _, f in ipairs(tl.frames) do seen[f.budget] = true end
  H.truthy(seen[64 << 20] and seen[48 << 20], "frames carry both budgets")
  local path = tmp("budget.png")
  local _, lay = kiln.mem.plot(path, { device = "sim", width = 600, height = 300 })
  local pic <close> = kiln.load_png(path)
  local ph = lay.y1 - lay.y0
  local function y_of(bytes) return lay.y1 - math.floor(bytes / lay.ymax * ph + 0.5) end
  local function x_of(t) return lay.x0 + math.floor((t - lay.t0) / (lay.t1 - lay.t0) * (lay.x1 - lay.x0)) end
  local first
  for _, f in ipairs(tl.frames) do
    if f.budget == 64 << 20 then first = first or f end
  end
  local x_early, x_late = x_of(first.t1) + 2, lay.x1 - 3
  H.truthy(same(pixel(pic, x_early, y_of(64 << 20)), lay.budget_color), "the first budget, early")
  H.truthy(same(pixel(pic, x_late, y_of(48 << 20)), lay.budget_color), "the lowered budget, late")
  H.truthy(not same(pixel(pic, x_late, y_of(64 << 20)), lay.budget_color), "the first budget is gone")
  a:free()
  b:free()
  kiln.mem.set_budget("sim", before)
  os.remove(path)
end)

H.test("a device with nothing recorded still gets a picture", function()
  kiln.mem.clear_timeline()
  local path = tmp("empty.png")
  local text = kiln.mem.plot(path, { device = "sim", width = 480, height = 240 })
  H.truthy(text:find("memory on sim", 1, true), text)
  local pic <close> = kiln.load_png(path)
  H.eq(pic.shape[4], 480)
  os.remove(path)
end)

H.test("bad arguments", function()
  H.raises(function() kiln.mem.plot(tmp("x.png"), { width = 10 }) end, "480x240")
  H.raises(function() kiln.mem.plot(tmp("x.png"), { device = "nope" }) end, "unknown device")
  H.raises(function() kiln.mem.plot(DIR .. "/no/such/dir/x.png", { device = "sim" }) end)
end)

local MODEL = H.demo_model("demo model present")
local pipeline = require "kiln.pipeline"

H.test("demo txt2img on sim: stages, peaks, picture", function()
  local prev = kiln.default_device()
  kiln.set_default_device("sim")
  local ckpt <close> = kiln.load_checkpoint(MODEL)
  -- the allocator's peak within each pipeline stage, measured around the stage's body
  local measured, span = {}, kiln.trace.span
  kiln.trace.span = function(name, fn, ...)
    return span(name, function(...)
      kiln.mem.reset_peak("sim")
      local r = table.pack(fn(...))
      measured[name] = kiln.mem.stats("sim").peak
      return table.unpack(r, 1, r.n)
    end, ...)
  end
  kiln.mem.clear_timeline()
  local ok, img, lat = pcall(pipeline.txt2img, ckpt, { prompt = "a red circle on a blue background", seed = 3,
    steps = 4, device = "sim" })
  kiln.trace.span = span
  kiln.set_default_device(prev)
  H.truthy(ok, img)
  img:free()
  lat:free()
  collectgarbage() -- the run's garbage tensors go now, not while the timeline's tables are built
  collectgarbage()

  local tl = kiln.mem.timeline("sim")
  local by = {}
  for _, s in ipairs(tl.stages) do by[s.name] = s end
  for _, name in ipairs({ "encode", "sample", "decode" }) do
    H.truthy(by[name], "stage " .. name)
    H.eq(by[name].peak, measured[name], name .. ": the stage's peak is the allocator's")
  end
  H.eq(by.sample.top_owner, "model:unet", "the UNet holds most while sampling")
  H.eq(tl.total, kiln.mem.stats("sim").allocated, "total at the end")

  local path = tmp("txt2img.png")
  local text, layout = kiln.mem.plot(path, { device = "sim", width = 800, height = 400 })
  for _, name in ipairs({ "encode", "sample", "decode" }) do
    H.truthy(text:find("\n" .. name .. " ", 1, true), "table lists " .. name .. ":\n" .. text)
  end
  local pic <close> = kiln.load_png(path)
  H.eq(pic.shape[2], 3)
  H.eq(pic.shape[3], 400)
  H.eq(pic.shape[4], 800)
  local unet, vae = owner(layout, "model:unet"), owner(layout, "model:vae")
  H.truthy(unet and vae, "legend has the UNet and the VAE")
  local function column(t) return layout.x0 + math.floor((t - layout.t0) / (layout.t1 - layout.t0) * (layout.x1 - layout.x0)) end
  -- the bottom of the stack in the middle of each stage: the model it runs
  local xs = column((by.sample.t0 + by.sample.t1) / 2)
  H.truthy(same(pixel(pic, xs, layout.y1 - 2), unet.color), "sample column shows the UNet's colour")
  local xd = column(by.decode.t0 + (by.decode.t1 - by.decode.t0) * 0.75)
  H.truthy(same(pixel(pic, xd, layout.y1 - 2), vae.color), "decode column shows the VAE's colour")
  os.remove(path)
end)

H.done()
