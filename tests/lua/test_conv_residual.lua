-- kiln.nn.conv2d's residual option: act(conv(x) + b + r) in one op, against the
-- convolution, the add and the leaky ReLU run as separate ops, on cpu and sim (each
-- shape takes another CPU path on its own: Winograd, few tiles, depthwise, few outputs,
-- 1x1, strided), with f16 weights, an f16 or strided residual, the upsampling
-- convolution (the op's fallback: conv, add, act), tileable (circular) padding; a
-- residual of the wrong shape, device or type is an error naming it; a dry run
-- predicts the fused op's memory as measured on sim. The CPU paths one by one (forced
-- with KILN_CONV_PATH) are tests/test_cpu_gemm_conv.c's t_conv_residual.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local nn = kiln.nn
local seamless = require "kiln.seamless"
local test, truthy = H.test, H.truthy

kiln.set_quiet(true)

local has_sim, has_meta = false, false
for _, d in ipairs(kiln.devices()) do
  has_sim = has_sim or d == "sim"
  has_meta = has_meta or d == "meta"
end
local DEVICES = has_sim and { "cpu", "sim" } or { "cpu" }

-- Frees every tensor of a list (and nothing else).
local function free_all(list)
  for _, t in ipairs(list) do t:free() end
end

-- max |a - b| / max |b| (as f32), then frees a.
local function rel(a, b)
  local d = a - b
  local ad = d:abs()
  local m, bm = ad:max(), b:abs()
  local s = bm:max()
  d:free(); ad:free(); bm:free(); a:free()
  return s > 0 and m / s or m
end

-- The separate ops: conv, then + r, then leaky ReLU when slope.
local function reference(x, w, b, o, r, slope)
  local plain = {}
  for k, v in pairs(o) do plain[k] = v end
  local y = nn.conv2d(x, w, b, plain)
  local s = y + r
  y:free()
  if slope then
    local a = nn.leaky_relu(s, slope)
    s:free()
    s = a
  end
  return s
end

-- n, c, h, w, k, kernel, groups, padding, stride
local CASES = {
  { 2, 64, 12, 12, 64, 3, 1, 1, 1, "few tiles" },
  { 1, 48, 20, 20, 40, 3, 1, 1, 1, "Winograd" },
  { 2, 8, 9, 11, 8, 3, 8, 1, 1, "depthwise" },
  { 1, 16, 10, 10, 3, 3, 1, 1, 1, "few outputs" },
  { 1, 16, 10, 10, 24, 1, 1, 0, 1, "1x1" },
  { 2, 16, 11, 9, 24, 3, 1, 1, 2, "strided" },
}

test("conv2d residual: act(conv + b + r) as the separate ops, each path, cpu and sim", function()
  local worst = 0
  for _, dev in ipairs(DEVICES) do
    for ci, c in ipairs(CASES) do
      local n, ch, h, wd, k, ks, g, pad, st = table.unpack(c)
      local x = kiln.randn({ n, ch, h, wd }, { seed = ci }):to(dev)
      local w = kiln.randn({ k, ch // g, ks, ks }, { seed = 100 + ci }):to(dev)
      local b = kiln.randn({ k }, { seed = 200 + ci }):to(dev)
      local wh = w:to("f16")
      local o = { padding = pad, stride = st, groups = g }
      local shape = nn.conv2d(x, w, b, o)
      local r = kiln.randn(shape.shape, { seed = 300 + ci }):to(dev)
      shape:free()
      for _, wt in ipairs({ w, wh }) do
        for _, bias in ipairs({ b, false }) do
          for _, slope in ipairs({ false, 0, 0.2 }) do
            local f = { padding = pad, stride = st, groups = g, residual = r, leaky_relu = slope or nil }
            local got = nn.conv2d(x, wt, bias or nil, f)
            local want = reference(x, wt, bias or nil, o, r, slope)
            local e = rel(got, want)
            want:free()
            worst = math.max(worst, e)
            truthy(e <= 1e-5, ("%s on %s (%s weights, bias %s, slope %s): relative error %g"):format(
              c[10], dev, wt.dtype, tostring(bias ~= false), tostring(slope), e))
          end
        end
      end
      free_all({ x, w, b, wh, r })
    end
  end
  print(("# conv2d residual: worst relative error %.3g"):format(worst))
end)

test("conv2d residual: an f16 residual, a strided one, an f16 input", function()
  for _, dev in ipairs(DEVICES) do
    local x = kiln.randn({ 1, 32, 16, 16 }, { seed = 1 }):to(dev)
    local w = kiln.randn({ 32, 32, 3, 3 }, { seed = 2 }):to(dev)
    local b = kiln.randn({ 32 }, { seed = 3 }):to(dev)
    local o = { padding = 1 }
    local r32 = kiln.randn({ 1, 32, 16, 16 }, { seed = 4 }):to(dev)
    local rh = r32:to("f16")
    local big = kiln.randn({ 1, 32, 16, 20 }, { seed = 5 }):to(dev)
    local rs = big:narrow(4, 3, 16) -- a view: rows of 20 floats
    for _, r in ipairs({ rh, rs }) do
      local got = nn.conv2d(x, w, b, { padding = 1, residual = r, leaky_relu = 0 })
      local want = reference(x, w, b, o, r, 0)
      local e = rel(got, want)
      want:free()
      truthy(e <= 1e-5, ("%s residual on %s: relative error %g"):format(r.dtype, dev, e))
    end
    -- an f16 input (its f16 output): the same as the f16 separate ops within f16 rounding
    local xh = x:to("f16")
    local got = nn.conv2d(xh, w, b, { padding = 1, residual = r32, leaky_relu = 0 })
    truthy(got.dtype == "f16", "f16 input gives " .. got.dtype)
    local want = reference(x, w, b, o, r32, 0)
    local g32 = got:to("f32")
    got:free()
    local e = rel(g32, want)
    want:free()
    truthy(e <= 2e-3, ("f16 input on %s: relative error %g"):format(dev, e))
    free_all({ x, w, b, r32, rh, rs, big, xh })
  end
end)

test("conv2d residual with upsample = 2 (the op adds, then the activation)", function()
  for _, dev in ipairs(DEVICES) do
    for _, size in ipairs({ 8, 34 }) do -- the unfused pair and (on the CPU) the fused upsampling
      local x = kiln.randn({ 1, 32, size, size }, { seed = size }):to(dev)
      local w = kiln.randn({ 32, 32, 3, 3 }, { seed = 2 }):to(dev)
      local b = kiln.randn({ 32 }, { seed = 3 }):to(dev)
      local r = kiln.randn({ 1, 32, 2 * size, 2 * size }, { seed = 4 }):to(dev)
      local got = nn.conv2d(x, w, b, { padding = 1, upsample = 2, residual = r, leaky_relu = 0.1 })
      local want = reference(x, w, b, { padding = 1, upsample = 2 }, r, 0.1)
      local e = rel(got, want)
      want:free()
      truthy(e <= 1e-5, ("upsample 2 at %d on %s: relative error %g"):format(size, dev, e))
      free_all({ x, w, b, r })
    end
  end
end)

test("conv2d residual in a tileable convolution (circular padding, upsample 1 and 2)", function()
  local x = kiln.randn({ 1, 32, 12, 10 }, { seed = 1 })
  local w = kiln.randn({ 32, 32, 3, 3 }, { seed = 2 })
  local b = kiln.randn({ 32 }, { seed = 3 })
  for _, up in ipairs({ 1, 2 }) do
    local r = kiln.randn({ 1, 32, 12 * up, 10 * up }, { seed = 4 + up })
    for _, mode in ipairs({ "xy", "x", "y" }) do
      local got = seamless.conv2d(x, w, b, { padding = 1, upsample = up, residual = r, leaky_relu = 0 }, mode)
      local y = seamless.conv2d(x, w, b, { padding = 1, upsample = up }, mode)
      local s = y + r
      local want = s:relu()
      y:free(); s:free()
      local e = rel(got, want)
      want:free()
      truthy(e <= 1e-5, ("tileable %s, upsample %d: relative error %g"):format(mode, up, e))
    end
    r:free()
  end
  free_all({ x, w, b })
end)

test("conv2d residual: wrong shape, device or type is an error naming it", function()
  local x = kiln.randn({ 1, 8, 6, 6 }, { seed = 1 })
  local w = kiln.randn({ 4, 8, 3, 3 }, { seed = 2 })
  local r = kiln.randn({ 1, 8, 6, 6 }, { seed = 3 }) -- 8 channels where the output has 4
  H.raises(function() return nn.conv2d(x, w, nil, { padding = 1, residual = r }) end, "residual", "[1, 4, 6, 6]")
  -- the op's own add (upsampling) checks it too
  H.raises(function() return nn.conv2d(x, w, nil, { padding = 1, upsample = 2, residual = r }) end, "residual")
  H.raises(function() return nn.conv2d(x, w, nil, { padding = 1, residual = 3 }) end, "residual", "tensor")
  local ri = kiln.zeros({ 1, 4, 6, 6 }, "i32")
  H.raises(function() return nn.conv2d(x, w, nil, { padding = 1, residual = ri }) end, "residual", "dtype")
  if has_sim then
    local rsim = kiln.randn({ 1, 4, 6, 6 }, { seed = 4 }):to("sim")
    H.raises(function() return nn.conv2d(x, w, nil, { padding = 1, residual = rsim }) end, "residual", "sim")
    rsim:free()
  end
  free_all({ x, w, r, ri })
end)

test("conv2d residual: a dry run predicts its memory as measured on sim", function()
  if not (has_sim and has_meta) then H.skip("no sim or no meta device") end
  -- an f16 residual: the CPU backend takes an f32 copy of it for the fused op
  local function run(dev)
    local x = kiln.randn({ 1, 32, 32, 32 }, { seed = 1 }):to(dev)
    local w = kiln.randn({ 32, 32, 3, 3 }, { seed = 2 }):to(dev)
    local r = kiln.zeros({ 1, 32, 32, 32 }, { dtype = "f16", device = dev })
    local y = nn.conv2d(x, w, nil, { padding = 1, residual = r, leaky_relu = 0 })
    free_all({ x, w, r, y })
  end
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
  kiln.mem.reset_peak("sim")
  local base = kiln.mem.stats("sim").allocated
  run("sim")
  local real = kiln.mem.stats("sim").peak - base
  local d = kiln.dry_run(function() run("sim") end, { device = "sim" })
  truthy(d.fits, "the dry run did not fit")
  truthy(math.abs(d.peak - real) <= 0.02 * real, ("predicted %d bytes, measured %d"):format(d.peak, real))
end)

H.done()
