-- kiln.upscaler: tiny RRDBNet (both key layouts, scales 1, 2, 4, 8) and SRVGGNetCompact
-- models against the independent PyTorch implementations of tests/golden/gen_upscale.py;
-- tiled against untiled, odd sizes, RGBA and grey images, the sim device and its OOM
-- retry, wrapper prefixes, the errors for other architectures, the example and the
-- hires fix with a model upscaler; tileable runs (circular padding, wrapped tiles, no
-- seam at the wrap, the hires fix's mode passed on).
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local imgcmp = require "imgcmp"
local roll, seam_ratio = imgcmp.roll, imgcmp.seam_ratio
local upscaler = require "kiln.upscaler"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

kiln.set_quiet(true)
local GOLD = "tests/golden/upscale/"
local G = kiln.load_safetensors(GOLD .. "io.safetensors")
local TOL = 1e-4
local close = H.close_rel

local TMP = os.tmpname()
os.remove(TMP)
os.execute("mkdir -p '" .. TMP .. "'")
local function tmp(name) return TMP .. "/" .. name end

local MODELS = {
  { "rrdb_x4_new", "RRDBNet", 4 }, { "rrdb_x2_new", "RRDBNet", 2 }, { "rrdb_x1_new", "RRDBNet", 1 },
  { "rrdb_x8_new", "RRDBNet", 8 }, { "rrdb_x4_old", "RRDBNet", 4 }, { "rrdb_x2_old", "RRDBNet", 2 },
  { "compact_x4", "SRVGGNetCompact", 4 }, { "compact_x2", "SRVGGNetCompact", 2 }, { "rrdb_x1_old", "RRDBNet", 1 },
}

for _, m in ipairs(MODELS) do
  test("upscaler: " .. m[1] .. " against PyTorch", function()
    local up <close> = kiln.load_upscaler(GOLD .. m[1] .. ".safetensors")
    eq(up.arch, m[2])
    eq(up.scale, m[3])
    local y = up:forward(G.input)
    close(y, G["out." .. m[1]], TOL, m[1])
    y:free()
  end)
end

test("upscaler: hyper-parameters read from the shapes", function()
  local up <close> = kiln.load_upscaler(GOLD .. "rrdb_x2_old.safetensors")
  local c = up.config
  eq(c.nf, 6); eq(c.gc, 5); eq(c.nb, 1); eq(c.unshuffle, 2); eq(c.steps, 2); eq(c.layout, "old")
  local v <close> = kiln.load_upscaler(GOLD .. "compact_x4.safetensors")
  eq(v.config.nconv, 3); eq(v.config.nf, 8)
  truthy(tostring(up):find("RRDBNet x2", 1, true), tostring(up))
end)

test("upscaler: pixel shuffle and unshuffle are inverse", function()
  local x = kiln.randn({ 1, 3, 8, 12 }, { seed = 3 })
  local u = upscaler.pixel_unshuffle(x, 2)
  eq(H.shape_of(u), "1,12,4,6")
  -- torch: channel c*4 + i*2 + j holds x[c, 2h+i, 2w+j]
  local near = H.near
  local function at(t, c, h, w) return t:narrow(2, c, 1):narrow(3, h, 1):narrow(4, w, 1):item() end
  near(at(u, 2, 1, 1), at(x, 1, 1, 2), 0)
  near(at(u, 3, 1, 1), at(x, 1, 2, 1), 0)
  near(at(u, 12, 4, 6), at(x, 3, 8, 12), 0)
  local back = upscaler.pixel_shuffle(u, 2)
  eq(H.maxdiff(back, x), 0)
end)

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

test("upscaler ops: leaky_relu, conv2d with leaky_relu = slope, min / max / relu / clamp", function()
  local x = kiln.randn({ 2, 5, 7, 9 }, { seed = 4 })
  local ref = x:relu() + x:minimum(0) * 0.2
  -- (a float times 0.2 rounds once here, twice in the reference)
  truthy(H.maxdiff(kiln.nn.leaky_relu(x, 0.2), ref) < 1e-6, "leaky_relu 0.2")
  truthy(H.maxdiff(kiln.nn.leaky_relu(x), x:relu() + x:minimum(0) * 0.01) < 1e-6, "leaky_relu default slope")
  local t = x:transpose(2, 4) -- strided: the generic path
  truthy(H.maxdiff(kiln.nn.leaky_relu(t, 0.2):contiguous(), ref:transpose(2, 4):contiguous()) < 1e-6, "strided")
  eq(H.maxdiff(x:maximum(0.5), kiln.tensor(x:table()):maximum(kiln.full(x.shape, 0.5))), 0)
  eq(H.maxdiff(x:clamp(-0.5, 0.25), x:maximum(-0.5):minimum(0.25)), 0)
  local w, b = kiln.randn({ 6, 5, 3, 3 }, { seed = 5 }), kiln.randn({ 6 }, { seed = 6 })
  local devs = { "cpu" }
  if has_sim then devs[2] = "sim" end
  for _, d in ipairs(devs) do
    local xd, wd, bd = x:to(d), w:to(d), b:to(d)
    local plain = kiln.nn.conv2d(xd, wd, bd, { padding = 1 })
    local fused = kiln.nn.conv2d(xd, wd, bd, { padding = 1, leaky_relu = 0.2 })
    eq(H.maxdiff(fused:to("cpu"), kiln.nn.leaky_relu(plain, 0.2):to("cpu")), 0, d)
    local up = kiln.nn.conv2d(xd, wd, bd, { padding = 1, upsample = 2, leaky_relu = 0.1 })
    local u = kiln.nn.conv2d(kiln.nn.upsample_nearest(xd, 2), wd, bd, { padding = 1 })
    truthy(H.maxdiff(up:to("cpu"), kiln.nn.leaky_relu(u, 0.1):to("cpu")) < 1e-4, d .. " upsample + leaky")
  end
  raises(function() kiln.nn.conv2d(x, w, b, { leaky_relu = "yes" }) end, "leaky_relu")
end)

test("conv2d's fused activation equals the separate pass on every CPU path", function()
  -- the CPU backend applies leaky_relu / ReLU where each path writes its output (the
  -- Winograd output transform) or in one pass after: the same bits as conv then the op
  local cases = { -- {N, C, H, W, K, kernel, stride, groups}: the shapes pick the path
    { 1, 64, 32, 32, 64, 3, 1, 1 },  -- Winograd (tiles in lanes)
    { 2, 64, 8, 8, 64, 3, 1, 1 },    -- Winograd, few tiles
    { 1, 5, 7, 9, 6, 3, 1, 1 },      -- few channels
    { 1, 8, 12, 12, 8, 3, 1, 8 },    -- depthwise
    { 1, 32, 16, 16, 48, 3, 2, 1 },  -- strided: implicit GEMM
    { 1, 32, 16, 16, 40, 1, 1, 1 },  -- 1x1
  }
  for i, c in ipairs(cases) do
    local x = kiln.randn({ c[1], c[2], c[3], c[4] }, { seed = 10 + i })
    local w = kiln.randn({ c[5], c[2] // c[8], c[6], c[6] }, { seed = 20 + i }) * 0.2
    local b = kiln.randn({ c[5] }, { seed = 30 + i })
    local o = { padding = c[6] // 2, stride = c[7], groups = c[8] }
    local plain = kiln.nn.conv2d(x, w, b, o)
    for _, slope in ipairs({ 0, 0.2 }) do
      o.leaky_relu = slope
      local fused = kiln.nn.conv2d(x, w, b, o)
      local ref = slope == 0 and plain:relu() or kiln.nn.leaky_relu(plain, slope)
      eq(H.maxdiff(fused, ref), 0, ("case %d slope %g"):format(i, slope))
    end
  end
end)

-- an image larger than the tiles
local IMG = kiln.rand({ 1, 3, 40, 36 }, { seed = 7 })

-- The tiny random models see far (every conv adds a pixel of reach, nothing damps it as
-- trained weights do), so the bound holds for tiles a few times their overlap; the x1
-- model (4x4-pixel cells after unshuffle) needs tiles larger than these images.
test("upscaler: tiled equals untiled within a small bound", function()
  local big = kiln.rand({ 1, 3, 96, 96 }, { seed = 8 })
  for _, c in ipairs({ { "rrdb_x4_new", IMG, 24, 8 }, { "compact_x4", IMG, 24, 8 }, { "rrdb_x2_new", big, 64, 16 } }) do
    local name = c[1]
    local up <close> = kiln.load_upscaler(GOLD .. name .. ".safetensors")
    local full = up:upscale(c[2], { tile = false })
    local tiled = up:upscale(c[2], { tile = c[3], overlap = c[4] })
    eq(H.shape_of(tiled), H.shape_of(full))
    local d = (tiled - full):abs()
    local mean, max = d:mean(), d:max()
    truthy(mean < 1e-3 and max < 0.06, ("%s: tiled vs untiled mean %g, max %g"):format(name, mean, max))
    full:free(); tiled:free(); d:free()
  end
end)

test("upscaler: output in [0, 1], sizes not multiple of the unshuffle factor", function()
  for _, name in ipairs({ "rrdb_x1_new", "rrdb_x2_new" }) do
    local up <close> = kiln.load_upscaler(GOLD .. name .. ".safetensors")
    local x = kiln.rand({ 1, 3, 13, 11 }, { seed = 9 })
    local y = up:upscale(x)
    eq(H.shape_of(y), ("1,3,%d,%d"):format(13 * up.scale, 11 * up.scale))
    truthy(y:min() >= 0 and y:max() <= 1, "clamped")
  end
end)

test("upscaler: RGBA keeps its alpha, upscaled bilinearly; grey runs as RGB", function()
  local up <close> = kiln.load_upscaler(GOLD .. "compact_x2.safetensors")
  local alpha = kiln.rand({ 1, 1, 12, 12 }, { seed = 5 })
  local rgba = kiln.cat({ G.input, alpha }, 2)
  local y = up:upscale(rgba)
  eq(H.shape_of(y), "1,4,24,24")
  local rgb = up:upscale(G.input)
  eq(H.maxdiff(y:narrow(2, 1, 3), rgb), 0)
  local a = kiln.nn.interpolate(alpha, { size = { 24, 24 }, mode = "bilinear" })
  truthy(H.maxdiff(y:narrow(2, 4, 1), a) < 1e-6, "alpha bilinear")
  local grey = up:upscale(G.input:narrow(2, 1, 1))
  eq(H.shape_of(grey), "1,3,24,24")
end)

test("upscaler: on sim, the same as on the cpu; a small budget retries with smaller tiles", function()
  if not has_sim then H.skip("no sim device") end
  local up <close> = kiln.load_upscaler(GOLD .. "rrdb_x4_new.safetensors")
  local ref = up:upscale(IMG, { tile = 16, overlap = 8 })
  up:load("sim")
  local y = up:upscale(IMG, { tile = 16, overlap = 8 })
  eq(y.device, "cpu", "the result comes back where the image is")
  truthy(H.maxdiff(y, ref) < 1e-5, "sim vs cpu")
  -- a budget too small for the untiled run: the first try runs out of memory, the
  -- retries halve the tile
  kiln.mem.empty_cache("sim")
  local base = kiln.mem.stats("sim").allocated
  kiln.mem.set_budget("sim", base + 1536 * 1024)
  local ok, r = pcall(up.upscale, up, IMG, { tile = 40, overlap = 4, min_tile = 8 })
  kiln.mem.set_budget("sim", 0)
  truthy(ok, "tiled retry: " .. tostring(r))
  eq(H.shape_of(r), "1,3,160,144")
  -- auto: the tile from the free budget
  kiln.mem.set_budget("sim", base + 2 * 1024 * 1024)
  local ok2, r2 = pcall(up.upscale, up, IMG)
  kiln.mem.set_budget("sim", 0)
  truthy(ok2, "auto tile: " .. tostring(r2))
  truthy((r2 - ref):abs():mean() < 2e-3, "auto-tiled close to the reference")
  up:unload()
end)

test("upscaler: memory mode low (streamed blocks) and a batch of two", function()
  if not has_sim then H.skip("no sim device") end
  local up <close> = kiln.load_upscaler(GOLD .. "rrdb_x2_new.safetensors")
  local ref = up:forward(G.input)
  local old = kiln.memory_mode()
  kiln.memory_mode("low")
  local ok, err = pcall(function()
    up:load("sim")
    local y = up:forward(G.input)
    truthy(H.maxdiff(y:to("cpu"), ref) < 1e-5, "low mode on sim")
    eq(up:bytes("sim"), 0, "no weights left on sim after the forward")
    up:unload()
  end)
  kiln.memory_mode(old)
  assert(ok, err)
  local two = kiln.cat({ G.input, G.input * 0.5 }, 1)
  local y2 = up:upscale(two, { tile = false })
  eq(H.shape_of(y2), "2,3,24,24")
  local second = up:upscale(two:narrow(1, 2, 1), { tile = false })
  truthy(H.maxdiff(y2:narrow(1, 2, 1), second) < 1e-6, "batch item 2")
end)

test("upscaler: a wrapper prefix (params_ema.) is stripped", function()
  local w = kiln.load_safetensors(GOLD .. "compact_x2.safetensors")
  local out = {}
  for k, v in pairs(w) do out["params_ema." .. k] = v end
  local p = tmp("wrapped.safetensors")
  kiln.save_safetensors(p, out)
  local up <close> = kiln.load_upscaler(p)
  close(up:forward(G.input), G["out.compact_x2"], TOL, "wrapped")
end)

local function fake(name, tensors)
  local p = tmp(name .. ".safetensors")
  local t = {}
  for _, n in ipairs(tensors) do t[n] = kiln.zeros({ 4 }) end
  kiln.save_safetensors(p, t)
  return p
end

test("upscaler: other architectures are named", function()
  local swin = fake("swinir", { "conv_first.weight", "patch_embed.norm.weight",
    "layers.0.residual_group.blocks.0.attn.relative_position_bias_table" })
  raises(function() kiln.load_upscaler(swin) end, swin, "SwinIR", "does not run")
  local hat = fake("hat", { "conv_first.weight", "layers.0.residual_group.blocks.0.conv_block.cab.0.weight" })
  raises(function() kiln.load_upscaler(hat) end, "HAT")
  local dat = fake("dat", { "conv_first.weight", "layers.0.blocks.0.attn.attns.0.pos.pos_proj.weight" })
  raises(function() kiln.load_upscaler(dat) end, "DAT")
  local omni = fake("omnisr", { "residual_layer.0.residual_layer.0.layer.0.fn.0.weight" })
  raises(function() kiln.load_upscaler(omni) end, "OmniSR")
  local junk = fake("junk", { "foo.weight" })
  raises(function() kiln.load_upscaler(junk) end, junk, "not an upscale model")
  local pth = tmp("model.pth")
  local f = assert(io.open(pth, "wb"))
  f:write("PK\3\4 a zip")
  f:close()
  raises(function() kiln.load_upscaler(pth) end, "model.pth", ".safetensors")
end)

test("upscaler: a tensor of the wrong shape is named", function()
  local w = kiln.load_safetensors(GOLD .. "rrdb_x4_new.safetensors")
  local out = {}
  for k, v in pairs(w) do out[k] = v end
  out["body.1.rdb2.conv3.weight"] = kiln.zeros({ 4, 9, 3, 3 })
  local p = tmp("bad.safetensors")
  kiln.save_safetensors(p, out)
  raises(function() kiln.load_upscaler(p) end, "body.1.rdb2.conv3.weight", "[4, 16, 3, 3]")
end)

test("upscaler: examples/upscale.lua writes the upscaled PNG", function()
  local inp, out = tmp("in.png"), tmp("out.png")
  kiln.save_png(IMG, inp)
  local kbin = arg and arg[-1] or "kiln"
  local cmd = ("'%s' examples/upscale.lua --input '%s' --model '%s' --out '%s' --tile 16 --quiet"):format(kbin, inp,
    GOLD .. "compact_x2.safetensors", out)
  truthy(os.execute(cmd), cmd)
  local y = kiln.load_png(out)
  eq(H.shape_of(y), "1,3,80,72")
end)

test("upscaler: hires fix with a model upscaler", function()
  local MODEL = os.getenv("KILN_DEMO_MODEL") or "examples/models/kiln-shapes.safetensors"
  if not io.open(MODEL, "rb") then H.skip(MODEL .. " is missing") end
  local pipeline = require "kiln.pipeline"
  local ckpt <close> = kiln.load_checkpoint(MODEL)
  local o = { prompt = "a red circle", steps = 1, hires_steps = 1, seed = 1, width = 64, height = 64, scale = 1.5,
    upscale = "model:" .. GOLD .. "compact_x2.safetensors" }
  local img = pipeline.hires_fix(ckpt, o)
  eq(H.shape_of(img), "1,3,96,96")
  local up <close> = kiln.load_upscaler(GOLD .. "rrdb_x4_new.safetensors")
  o.upscale = up
  local img2 = pipeline.hires_fix(ckpt, o)
  eq(H.shape_of(img2), "1,3,96,96")
  raises(function() pipeline.hires_fix(ckpt, { prompt = "x", steps = 1, width = 64, height = 64,
    upscale = "model:" .. tmp("missing.safetensors") }) end, "missing.safetensors")
  -- the command line: --upscale model:FILE, and a missing file as a usage error
  local kbin = arg and arg[-1] or "kiln"
  local out = tmp("hires.png")
  local cmd = ("'%s' examples/hires_fix.lua --quiet --steps 1 --hires-steps 1 --width 64 --height 64 --scale 2 " ..
    "--upscale 'model:%s' --out '%s'"):format(kbin, GOLD .. "rrdb_x4_new.safetensors", out)
  truthy(os.execute(cmd), cmd)
  eq(H.shape_of(kiln.load_png(out)), "1,3,128,128")
  local p = io.popen(("'%s' examples/hires_fix.lua --quiet --steps 1 --upscale model:%s 2>&1"):format(kbin,
    tmp("none.safetensors")))
  local text = p:read("a")
  p:close()
  truthy(text:find("no such file", 1, true), text)
end)

-- A smooth picture that tiles [1, 3, h, w] (sums of whole periods).
local function periodic(h, w)
  local t = {}
  for c = 1, 3 do
    t[c] = {}
    for y = 1, h do
      local row = {}
      for x = 1, w do
        local u, v = 2 * math.pi * (x - 1) / w, 2 * math.pi * (y - 1) / h
        row[x] = 0.5 + 0.2 * math.sin(u + c) * math.cos(2 * v) + 0.15 * math.cos(3 * u - v + c)
      end
      t[c][y] = row
    end
  end
  return kiln.tensor({ t })
end

test("upscaler: tileable pads circularly (shift-equivariant), tiles wrap around, no seam at the wrap", function()
  local x = periodic(24, 32)
  local notes = {}
  for _, name in ipairs({ "rrdb_x4_new", "rrdb_x2_new", "compact_x4", "rrdb_x1_old" }) do
    local up <close> = kiln.load_upscaler(GOLD .. name .. ".safetensors")
    local s = up.scale
    local zeros = up:upscale(x, { tile = false })
    local a = up:upscale(x, { tile = false, tileable = "xy" })
    eq(up.tileable, nil, name .. ": the mode is the call's")
    -- a circular shift of the input (by whole unshuffle cells) shifts the output
    local xr = roll(roll(x, 8, 4), 4, 3)
    local b = up:upscale(xr, { tile = false, tileable = "xy" })
    local ar = roll(roll(a, 8 * s, 4), 4 * s, 3)
    truthy(H.maxdiff(b, ar) <= 1e-5, name .. ": tileable is equivariant to circular shifts")
    -- tiled: as close to the untiled tileable run as an ordinary tiled run to its own
    local t = up:upscale(x, { tile = 16, overlap = 4, tileable = "xy" })
    local t0 = up:upscale(x, { tile = 16, overlap = 4 })
    local ew, e0 = (t - a):abs():mean(), (t0 - zeros):abs():mean()
    truthy(ew <= 1.2 * e0, ("%s: tiled tileable %.3g vs ordinary tiled %.3g"):format(name, ew, e0))
    local wx, wy, zx, zy = seam_ratio(a, 4), seam_ratio(a, 3), seam_ratio(zeros, 4), seam_ratio(zeros, 3)
    notes[#notes + 1] = ("%s seam x/y zeros %.2f/%.2f tileable %.2f/%.2f, tiled error %.2g (ordinary %.2g)"):format(
      name, zx, zy, wx, wy, ew, e0)
    if name == "rrdb_x4_new" or name == "compact_x4" then
      truthy(wx <= 1.5 and wy <= 1.5, ("%s: tileable seam %.2f / %.2f"):format(name, wx, wy))
    end
    if name == "rrdb_x4_new" then truthy(zx > 2 and zy > 2, ("zeros: seam %.2f / %.2f should be strong"):format(zx, zy)) end
    -- one axis only: the other keeps zero padding
    local ox = up:upscale(x, { tile = false, tileable = "x" })
    local ox2 = up:upscale(roll(x, 8, 4), { tile = false, tileable = "x" })
    local oxr = roll(ox, 8 * s, 4)
    truthy(H.maxdiff(ox2, oxr) <= 1e-5, name .. ": tileable x wraps columns")
    for _, v in ipairs({ zeros, a, xr, b, ar, t, t0, ox, ox2, oxr }) do v:free() end
  end
  -- up.tileable (as kiln.seamless.use sets it) is the default; a bad mode is named
  local up <close> = kiln.load_upscaler(GOLD .. "compact_x2.safetensors")
  up.tileable = "xy"
  local a = up:upscale(x, { tile = false })
  local b = up:upscale(x, { tile = false, tileable = "xy" })
  eq(H.maxdiff(a, b), 0)
  up.tileable = nil
  raises(function() up:upscale(x, { tileable = "z" }) end, "tileable", "x, y, xy")
  -- RGBA: the alpha plane wraps as well
  local rgba = kiln.cat({ x, x:narrow(2, 1, 1) }, 2)
  local y = up:upscale(rgba, { tile = false, tileable = "xy" })
  local al = y:narrow(2, 4, 1)
  truthy(seam_ratio(al, 4) <= 1.5 and seam_ratio(al, 3) <= 1.5, "alpha has no seam")
  for _, l in ipairs(notes) do print("# " .. l) end
end)

test("upscaler: the hires fix's model upscale honours a tileable run", function()
  local MODEL = os.getenv("KILN_DEMO_MODEL") or "examples/models/kiln-shapes.safetensors"
  if not io.open(MODEL, "rb") then H.skip(MODEL .. " is missing") end
  local pipeline = require "kiln.pipeline"
  local ckpt <close> = kiln.load_checkpoint(MODEL)
  local up <close> = kiln.load_upscaler(GOLD .. "compact_x2.safetensors")
  local seen = {}
  local real = up.upscale
  up.upscale = function(self, img, o)
    seen[#seen + 1] = o and o.tileable or self.tileable or "none"
    return real(self, img, o)
  end
  local o = { prompt = "a red circle", steps = 1, hires_steps = 1, seed = 1, width = 64, height = 64, scale = 2,
    upscale = up }
  pipeline.hires_fix(ckpt, o):free()
  o.tileable = "xy"
  pipeline.hires_fix(ckpt, o):free()
  eq(table.concat(seen, ","), "none,xy")
end)

os.execute("rm -rf '" .. TMP .. "'")
H.done()
