-- Seamless (tileable) pictures: circular padding in kiln.nn.pad and in the
-- convolutions of kiln.seamless against PyTorch's padding_mode "circular"
-- (tests/golden/gen_tileable.py), per axis; the UNet and the VAE run tileable are
-- equivariant to circular shifts (so their wrap-around is an ordinary neighbour); the
-- demo model's txt2img with tileable "xy" / "x" / "y": the wrap-around seam is no
-- stronger than the interior's neighbouring-pixel differences on the wrapped axes
-- (and is on the others); the tiled VAE (as close to its untiled run as an ordinary
-- tiled decode) and MultiDiffusion wrap around too; a ControlNet run tileable (the
-- pipelines set it) wraps as the UNet does.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local seamless = require "kiln.seamless"
local imgcmp = require "imgcmp"
local roll, seam_ratio, neighbour_diffs = imgcmp.roll, imgcmp.seam_ratio, imgcmp.neighbour_diffs

kiln.set_quiet(true)
-- the device the networks run on besides the cpu: sim here, cuda:0 in tests/gpu/run.sh
local DEV = os.getenv("KILN_TEST_DEVICE") or "sim"
local report = {}
local function note(fmt, ...) report[#report + 1] = fmt:format(...) end
local function pipeline_txt2img(...) return require("kiln.pipeline").txt2img(...) end

H.test("kiln.nn.pad circular: the opposite edge, per side, wrapping again when wider", function()
  local x = kiln.tensor({ { { { 1, 2, 3 }, { 4, 5, 6 } } } })
  local y = kiln.nn.pad(x, { 2, 1, 1, 0 }, "circular")
  local want = { { 5, 6, 4, 5, 6, 4 }, { 2, 3, 1, 2, 3, 1 }, { 5, 6, 4, 5, 6, 4 } }
  local got = y:table()[1][1]
  for r = 1, 3 do for c = 1, 6 do H.eq(got[r][c], want[r][c], ("pad [%d][%d]"):format(r, c)) end end
  local w = kiln.nn.pad(x, { 4, 0, 0, 0 }, "circular") -- wider than the input: wraps twice
  local row = {}
  for i, v in ipairs(w:table()[1][1][1]) do row[i] = math.tointeger(v) end
  H.eq(table.concat(row, ","), "3,1,2,3,1,2,3")
  H.raises(function() kiln.nn.pad(x, { 1, 1, 1, 1 }, "wrap") end, "circular")
  local e = kiln.zeros({ 1, 1, 0, 3 })
  H.raises(function() kiln.nn.pad(e, { 1, 1, 0, 0 }, "circular") end, "empty")
end)

local golden = kiln.load_safetensors("tests/golden/tileable/conv.safetensors")

for _, dev in ipairs({ "cpu", DEV }) do
  H.test("circular convolutions vs PyTorch, per axis, on " .. dev, function()
    local g = {}
    for k, v in pairs(golden) do g[k] = dev == "cpu" and v or v:to(dev) end
    local worst = 0
    for _, m in ipairs({ "x", "y", "xy" }) do
      local cases = {
        s1 = seamless.conv2d(g.x, g.w, g.b, { padding = 1 }, m),
        s2 = seamless.conv2d(g.x, g.w, g.b, { padding = 1, stride = 2 }, m),
        up = seamless.conv2d(g.x, g.w, g.b, { padding = 1, upsample = 2 }, m),
      }
      local pd = seamless.pad(g.x, { 0, 1, 0, 1 }, m)
      cases.enc = kiln.nn.conv2d(pd, g.w, g.b, { stride = 2 })
      pd:free()
      for k, v in pairs(cases) do
        H.eq(v.device, dev, k .. " device")
        worst = math.max(worst, H.close_rel(v, g[m .. "." .. k], 1e-5, m .. "." .. k))
        v:free()
      end
    end
    note("circular convolutions on %s: max relative difference %.2g", dev, worst)
    -- off (nil) and suspended: the plain zero-padded convolution
    local plain = kiln.nn.conv2d(g.x, g.w, g.b, { padding = 1 })
    H.eq(H.maxdiff(seamless.conv2d(g.x, g.w, g.b, { padding = 1 }, nil), plain), 0, "mode nil")
    H.eq(H.maxdiff(seamless.suspend(seamless.conv2d, g.x, g.w, g.b, { padding = 1 }, "xy"), plain), 0, "suspended")
    if dev ~= "cpu" then for _, v in pairs(g) do v:free() end end
  end)
end

H.test("seamless.check names the valid modes", function()
  H.eq(seamless.check(nil), nil); H.eq(seamless.check(""), nil); H.eq(seamless.check("xy"), "xy")
  H.raises(function() seamless.check("yx", "kiln.pipeline: tileable") end, "kiln.pipeline: tileable", "x, y, xy")
  H.raises(function() seamless.check(true) end, "x, y, xy")
end)

-- the tiny SD 1.x checkpoint and ControlNet of the ControlNet tests
local T = require "tiny_sd"
local function cn_file()
  local p = T.tmp("cn.safetensors")
  kiln.save_safetensors(p, T.build_recipe("../controlnet/sd1"), { ["kiln.heads.unet"] = "2" })
  return p
end

H.test("ControlNet run tileable: equivariant to circular shifts, no seam at the wrap; tileable pipelines set it", function()
  local cn <close> = kiln.load_controlnet(cn_file())
  -- smooth inputs that wrap around (the seam of noise would hide in its noise): noise
  -- resized bilinearly past its circular padding, the padding cropped
  local function smooth(shape, f, seed)
    local n = kiln.randn(shape, { seed = seed })
    local p = kiln.nn.pad(n, { 1, 1, 1, 1 }, "circular")
    local u = kiln.nn.interpolate(p, { size = { f * (shape[3] + 2), f * (shape[4] + 2) }, mode = "bilinear" })
    local r = u:narrow(3, f + 1, f * shape[3]):narrow(4, f + 1, f * shape[4]):contiguous()
    n:free(); p:free(); u:free()
    return r
  end
  local x = smooth({ 1, 4, 4, 4 }, 4, 4)
  local t = kiln.tensor({ 400 })
  local ctx = kiln.randn({ 1, 77, 64 }, { seed = 2 })
  local hint = smooth({ 1, 3, 8, 8 }, 16, 6)
  local s = 2 ^ (cn.config.levels - 1) // 1 -- latent pixels the network's grid keeps
  local zeros = cn:forward(x, t, ctx, hint)
  cn.tileable = "xy"
  local a = cn:forward(x, t, ctx, hint)
  local xr, hr = roll(roll(x, s, 4), s, 3), roll(roll(hint, 8 * s, 4), 8 * s, 3)
  local b = cn:forward(xr, t, ctx, hr)
  cn.tileable = nil
  local worst = 0
  for i, r in ipairs(a) do
    local k = s * r.shape[4] // x.shape[4]
    local rr = roll(roll(r, k, 4), k, 3)
    worst = math.max(worst, H.close_rel(b[i], rr, 1e-4, "residual " .. i .. " shifted"))
    rr:free()
  end
  -- the seam ratio over the residuals at the latent's size
  local wx, wy, zx, zy, n = 0, 0, 0, 0, 0
  for i, r in ipairs(a) do
    if r.shape[4] == x.shape[4] then
      n = n + 1
      wx, wy = wx + seam_ratio(r, 4), wy + seam_ratio(r, 3)
      zx, zy = zx + seam_ratio(zeros[i], 4), zy + seam_ratio(zeros[i], 3)
    end
  end
  wx, wy, zx, zy = wx / n, wy / n, zx / n, zy / n
  note("ControlNet tileable xy: shift equivariance %.2g; seam / interior of the %d latent-size residuals zeros "
    .. "%.2f/%.2f, tileable %.2f/%.2f", worst, n, zx, zy, wx, wy)
  H.truthy(wx <= 1.5 and wy <= 1.5, ("tileable seam %.2f / %.2f"):format(wx, wy))
  H.truthy(zx > 1.5 * wx and zy > 1.5 * wy, ("zero padding's seam %.2f / %.2f should be stronger"):format(zx, zy))
  -- a tileable pipeline run with the net: its convolutions wrap while it runs
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local seen = {}
  local real = cn.forward
  cn.forward = function(self, ...)
    seen[#seen + 1] = tostring(self.tileable)
    return real(self, ...)
  end
  local img = pipeline_txt2img(ck, { prompt = "a red circle", steps = 1, width = 32, height = 32, seed = 1,
    tileable = "xy", control = { { net = cn, image = hint } } })
  img:free()
  cn.forward = nil
  H.truthy(#seen > 0 and seen[1] == "xy", "the ControlNet ran tileable: " .. table.concat(seen, ","))
  H.eq(cn.tileable, nil, "its mode is restored")
end)

local MODEL = os.getenv("KILN_DEMO_MODEL") or "examples/models/kiln-shapes.safetensors"
local f = io.open(MODEL, "rb")
if not f then
  H.test("tileable demo model runs", function() H.skip(MODEL .. " is missing") end)
  for _, l in ipairs(report) do print("# " .. l) end
  T.cleanup()
  H.done()
end
f:close()

local pipeline = require "kiln.pipeline"
local tiling = require "kiln.tiling"
local ckpt <close> = kiln.load_checkpoint(MODEL)
local PROMPT = "a red circle on a blue background"

H.test("UNet and VAE run tileable are equivariant to circular shifts", function()
  local unet, vae = ckpt.unet, ckpt.vae
  unet:load(DEV); vae:load(DEV)
  local x = kiln.randn({ 1, 4, 16, 24 }, { seed = 3 }):to(DEV)
  local ctx = ckpt.clip:encode(PROMPT):to(DEV)
  local t = kiln.tensor({ 500 })
  local use <close> = seamless.use({ unet, vae }, "xy")
  -- the UNet downsamples 2^(levels-1) times: shifts by that keep its grid
  local s = 2 ^ (unet.config.levels - 1) // 1
  local a = unet:forward(x, t, ctx)
  local xr = roll(roll(x, s, 4), s, 3)
  local b = unet:forward(xr, t, ctx)
  local ar = roll(roll(a, s, 4), s, 3)
  local du = H.close_rel(b, ar, 1e-4, "unet")
  local z = a * 0.5
  local img = vae:decode(z)
  local zr = roll(z, 3, 4)
  local img2 = vae:decode(zr)
  local f8 = math.tointeger(vae.config.factor)
  local imgr = roll(img, 3 * f8, 4)
  local dv = H.close_rel(img2, imgr, 1e-4, "vae")
  note("circular shift equivariance (tileable xy): UNet %.2g, VAE decode %.2g (max relative difference)", du, dv)
  -- with zero padding the shifted run differs at the borders: the test can fail
  unet.tileable, vae.tileable = nil, nil
  local c = unet:forward(xr, t, ctx)
  local a0 = unet:forward(x, t, ctx)
  local a0r = roll(roll(a0, s, 4), s, 3)
  H.truthy(H.maxdiff(c, a0r) > 100 * du, "zero padding is not shift-equivariant")
  for _, v in ipairs({ x, ctx, a, xr, b, ar, z, img, zr, img2, imgr, c, a0, a0r }) do v:free() end
  unet:unload(); vae:unload()
end)

local function mean(t)
  local s = 0
  for _, v in ipairs(t) do s = s + v end
  return s / #t
end

-- The seam's strength relative to the interior (mean over seeds of seam / mean
-- interior difference) on x (columns) and y (rows) for a run's options.
local SEEDS = { 1, 2, 3, 4, 5, 6 }
local function seam_ratios(opts)
  local rx, ry = {}, {}
  for i, seed in ipairs(SEEDS) do
    local o = { prompt = PROMPT, seed = seed, steps = 12, device = DEV }
    for k, v in pairs(opts) do o[k] = v end
    local img = pipeline.txt2img(ckpt, o)
    local cx, sx = neighbour_diffs(img, 4)
    local cy, sy = neighbour_diffs(img, 3)
    rx[i], ry[i] = sx / mean(cx), sy / mean(cy)
    img:free()
  end
  return mean(rx), mean(ry)
end

-- A single pair of a picture of flat shapes varies much (an edge or none), so the
-- ratio is averaged over six seeds; zero padding gives the control: the seam there
-- is more than twice as strong as the interior.
local BOUND, SEAM = 1.5, 2
H.test("txt2img tileable xy on the demo model: no seam on either axis", function()
  local zx, zy = seam_ratios({})
  local wx, wy = seam_ratios({ tileable = "xy" })
  note("seam / interior neighbour difference (6 seeds): zeros x %.2f y %.2f, tileable xy x %.2f y %.2f", zx, zy, wx, wy)
  H.truthy(zx > SEAM and zy > SEAM, ("control: zero padding's seam %.2f / %.2f should be strong"):format(zx, zy))
  H.truthy(wx <= BOUND and wy <= BOUND, ("tileable xy: seam %.2f (x) / %.2f (y) > %.2f"):format(wx, wy, BOUND))
  H.eq(ckpt.unet.tileable, nil, "unet mode restored")
  H.eq(ckpt.vae.tileable, nil, "vae mode restored")
end)

H.test("tileable x wraps x only, y wraps y only", function()
  local xx, xy = seam_ratios({ tileable = "x" })
  local yx, yy = seam_ratios({ tileable = "y" })
  note("tileable x: seam x %.2f y %.2f; tileable y: seam x %.2f y %.2f", xx, xy, yx, yy)
  H.truthy(xx <= BOUND and xy > SEAM, ("tileable x: seam %.2f (x) / %.2f (y)"):format(xx, xy))
  H.truthy(yy <= BOUND and yx > SEAM, ("tileable y: seam %.2f (x) / %.2f (y)"):format(yx, yy))
end)

H.test("a bad tileable value is named; an error mid-run restores the mode", function()
  H.raises(function() pipeline.txt2img(ckpt, { prompt = PROMPT, tileable = "z" }) end, "tileable", "x, y, xy")
  ckpt.unet.tileable = "y"
  H.raises(function() pipeline.txt2img(ckpt, { prompt = PROMPT, steps = 2, tileable = "xy", sampler = "nope" }) end)
  H.eq(ckpt.unet.tileable, "y", "the previous mode is back after the error")
  ckpt.unet.tileable = nil
  H.truthy(pipeline.parameters({ prompt = "p", tileable = "xy" }, nil):find("Tileable: xy", 1, true), "parameters")
end)

-- A periodic picture of discs (wrapping around both edges), [1, 3, S, S] in [0, 1].
local function picture(S, n)
  local seed = 11
  local function rnd(k) seed = (seed * 1103515245 + 12345) % 2147483648; return seed % k end
  local discs = {}
  for i = 1, n do discs[i] = { rnd(S), rnd(S), 6 + rnd(S // 10), { rnd(256), rnd(256), rnd(256) } } end
  local t = {}
  for c = 1, 3 do
    t[c] = {}
    for y = 1, S do
      local row = {}
      for x = 1, S do
        local v = c == 3 and 200 or 40
        for _, d in ipairs(discs) do
          local dx = math.min(math.abs(x - d[1]), S - math.abs(x - d[1]))
          local dy = math.min(math.abs(y - d[2]), S - math.abs(y - d[2]))
          if dx * dx + dy * dy < d[3] ^ 2 then v = d[4][c] end
        end
        row[x] = v / 255
      end
      t[c][y] = row
    end
  end
  return kiln.tensor({ t })
end

-- The wrapped tiled decode against the ordinary one: in a wrapped run every tile edge
-- is a seam inside the picture (an ordinary run's border tiles end at the picture's
-- edge, exact by construction) and the wrapped picture's GroupNorm statistics are
-- smaller (no strong responses at a zero-padded border), which magnifies what zero
-- padding distorts at a tile's edge; the lockstep's halo (VAE:_lockstep) takes those
-- pixels out of the blend. Bound: no more than DECODE_SLACK dB below the ordinary tiled
-- decode's PSNR against its own untiled decode.
local DECODE_SLACK = 1
H.test("tiled VAE decode and encode with tileable equal the untiled tileable run", function()
  local vae = ckpt.vae
  vae:load(DEV)
  local pic = picture(256, 30):to(DEV)
  for _, m in ipairs({ "xy", "x" }) do
    local use <close> = seamless.use({ vae }, m)
    local z = vae:encode(pic)
    local full = vae:decode(z)
    vae.tileable = nil
    local full0 = vae:decode(z)
    vae.tileable = m
    for _, c in ipairs({ { 32, 8 }, { 24, 8 } }) do
      local t = vae:decode(z, { tile = c[1], overlap = c[2] })
      local p = imgcmp.psnr(t, full)
      -- the controls: an ordinary tiled decode against its untiled decode, and against
      -- the tileable one (zeros at the picture's edge: far off)
      vae.tileable = nil
      local plain = vae:decode(z, { tile = c[1], overlap = c[2] })
      vae.tileable = m
      local p0, pw = imgcmp.psnr(plain, full0), imgcmp.psnr(plain, full)
      local ze = vae:encode(pic, { tile = c[1], overlap = c[2] })
      local pe = imgcmp.psnr(ze, z)
      note("tileable %s, tile %d overlap %d: decode PSNR %.1f dB (ordinary tiled vs untiled: %.1f; "
        .. "not wrapped: %.1f), encode %.1f dB", m, c[1], c[2], p, p0, pw, pe)
      H.truthy(p >= p0 - DECODE_SLACK, ("decode tile %d: PSNR %.1f dB, ordinary %.1f"):format(c[1], p, p0))
      H.truthy(pe >= 40, ("encode tile %d: PSNR %.1f dB < 40"):format(c[1], pe))
      H.truthy(p > pw + 20, "the tiles wrap around")
      t:free(); plain:free(); ze:free()
    end
    full0:free()
    -- the estimated-statistics fallback (the whole decoder per tile, as vae:decode
    -- runs it when the parked tiles do not fit the host) wraps as well
    local function fallback()
      vae._tiling_full, vae._gn_fixed = z, nil
      local ok, r = pcall(vae._decode_tiles_estimated, vae, z,
        tiling.map_opts(24, 8, 1, math.tointeger(vae.config.factor), "cosine"), "test")
      vae._tiling_full, vae._gn_fixed = nil, nil
      if not ok then error(r, 0) end
      return r
    end
    local est = fallback()
    local pest = imgcmp.psnr(est, full)
    vae.tileable = nil
    local est0, full0 = fallback(), vae:decode(z)
    vae.tileable = m
    local pest0 = imgcmp.psnr(est0, full0)
    note("tileable %s: estimated-statistics fallback PSNR %.1f dB (not tileable: %.1f)", m, pest, pest0)
    H.truthy(pest >= 15, ("fallback: PSNR %.1f dB"):format(pest))
    est:free(); est0:free(); full0:free(); z:free(); full:free()
  end
  H.eq(vae.tileable, nil, "mode restored")
  pic:free()
  vae:unload()
end)

H.test("MultiDiffusion with tileable: a circular network tiled equals it untiled as closely as without the wrap", function()
  -- three circular 3x3 convolutions: the tiles of the wrapped run must be as exact as
  -- the tiles of a zero-padded network tiled without the wrap (blending near tile edges)
  local w = kiln.randn({ 4, 4, 3, 3 }, { seed = 2 }) * 0.2
  local function net(x, mode)
    local h = x
    for _ = 1, 3 do
      local n = seamless.conv2d(h, w, nil, { padding = 1 }, mode)
      if h ~= x then h:free() end
      h = n
    end
    return h
  end
  local x = kiln.randn({ 1, 4, 32, 40 }, { seed = 1 })
  for _, m in ipairs({ "xy", "x" }) do
    local full, full0 = net(x, m), net(x, nil)
    local wrapped = tiling.multidiffusion(function(v) return net(v, m) end, { tile = 16, overlap = 8, tileable = m })(x, 1)
    local plain = tiling.multidiffusion(function(v) return net(v, nil) end, { tile = 16, overlap = 8 })(x, 1)
    local unwrapped = tiling.multidiffusion(function(v) return net(v, m) end, { tile = 16, overlap = 8 })(x, 1)
    local ew, ep, eu = H.maxdiff(wrapped, full), H.maxdiff(plain, full0), H.maxdiff(unwrapped, full)
    note("tiled vs untiled, 3 convolutions, tile 16 overlap 8: tileable %s wrapped %.3g, unwrapped %.3g; zeros %.3g",
      m, ew, eu, ep)
    H.truthy(ew <= 1.5 * ep, ("wrapped tiles: %.3g vs %.3g for a network with zeros"):format(ew, ep))
    H.truthy(eu > 5 * ew, "tiles that do not wrap are far off")
    for _, v in ipairs({ full, full0, wrapped, plain, unwrapped }) do v:free() end
  end
end)

H.test("MultiDiffusion with tileable on the demo UNet: the border no worse than the inside", function()
  local unet = ckpt.unet
  unet:load(DEV)
  local x = kiln.randn({ 1, 4, 32, 32 }, { seed = 5 }):to(DEV)
  local ctx = ckpt.clip:encode(PROMPT):to(DEV)
  local t = kiln.tensor({ 600 })
  local use <close> = seamless.use({ unet }, "xy")
  local function den(v) return unet:forward(v, t, ctx) end
  local full = den(x)
  local wrapped = tiling.multidiffusion(den, { tile = 16, overlap = 8, tileable = "xy" })(x, 1.0)
  -- each tile's GroupNorm and attention see the tile only, so MultiDiffusion is an
  -- approximation: the mean abs error against the untiled run on the outer ring of 4
  -- latent pixels (where the wrap matters) and inside it
  local d = (wrapped - full):abs()
  local inner = d:narrow(3, 5, 24):narrow(4, 5, 24)
  local s_all, s_in = d:mean() * 32 * 32, inner:mean() * 24 * 24
  local ring, inside = (s_all - s_in) / (32 * 32 - 24 * 24), s_in / (24 * 24)
  note("MultiDiffusion on the demo UNet, tile 16 overlap 8, tileable xy: mean abs error %.3g on the border ring, %.3g inside",
    ring, inside)
  H.truthy(ring <= 1.5 * inside, ("border %.3g vs inside %.3g"):format(ring, inside))
  for _, v in ipairs({ x, ctx, full, wrapped, d, inner }) do v:free() end
  unet:unload()
end)

H.test("hires fix with MultiDiffusion and tileable runs", function()
  local img = pipeline.hires_fix(ckpt, { prompt = PROMPT, seed = 1, steps = 4, hires_steps = 3, scale = 2,
    hires_tile = 8, tileable = "xy", device = DEV })
  H.eq(H.shape_of(img), "1,3,128,128")
  img:free()
  H.eq(ckpt.unet.tileable, nil, "mode restored")
end)

H.test("examples/txt2img.lua --tileable xy writes it in the parameters; a bad value is a usage error", function()
  local exe = arg and arg[-1]
  if not exe then H.skip("no kiln program in arg[-1]") end
  local out, log = os.tmpname(), os.tmpname()
  local base = ("'%s' examples/txt2img.lua --model '%s' --steps 2 --quiet --out '%s.png'"):format(exe, MODEL, out)
  local ok = os.execute(("%s --tileable xy >'%s' 2>&1"):format(base, log))
  H.truthy(ok, "the example failed")
  local f = assert(io.open(out .. ".png", "rb"))
  local png = f:read("a")
  f:close()
  H.truthy(png:find("Tileable: xy", 1, true), "the parameters name the mode")
  local _, _, code = os.execute(("%s --tileable xz >'%s' 2>&1"):format(base, log))
  H.eq(code, 2, "exit status")
  f = assert(io.open(log))
  local text = f:read("a")
  f:close()
  H.truthy(text:find("kiln: --tileable xz: must be x, y or xy", 1, true), text)
  os.remove(out); os.remove(out .. ".png"); os.remove(log)
end)

for _, l in ipairs(report) do print("# " .. l) end
T.cleanup()
H.done()
