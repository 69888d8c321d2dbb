-- Tensor core through the Lua API: the API contract outside checks use, views, arithmetic
-- against PyTorch goldens (tests/golden/gen_tensor_ops.py), lifetimes, bad input.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, eq, near, raises = H.test, H.eq, H.near, H.raises

local G = kiln.load_safetensors("tests/golden/tensor_ops.safetensors")

local function close(a, b, tol, what)
  eq(table.concat(a.shape, ","), table.concat(b.shape, ","), (what or "") .. " shape")
  local d = (a:to("f32") - b:to("f32")):abs():max()
  if not (d <= (tol or 1e-5)) then error(("%s: max difference %g > %g"):format(what or "", d, tol or 1e-5), 2) end
end

test("version and devices", function()
  H.truthy(type(kiln.version) == "string" and kiln.version:match("^%d+%.%d+%.%d+"))
  local devs = kiln.devices()
  eq(devs[1], "cpu")
  local has_sim = false
  for _, d in ipairs(devs) do has_sim = has_sim or d == "sim" end
  H.truthy(has_sim, "sim device listed")
end)

test("tensor from nested table", function()
  local t = kiln.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
  eq(#t.shape, 2); eq(t.shape[1], 2); eq(t.shape[2], 3)
  eq(t.dtype, "f32"); eq(t.device, "cpu")
  eq(t:nbytes(), 24); eq(t:numel(), 6)
  eq(t:table()[2][3], 6)
  eq(t[2][1], 4)
  eq(tostring(t), "tensor(f32, cpu, [2,3], 24 B)")
  local i = kiln.tensor({ 1, 2, 3 }, "i64")
  eq(i.dtype, "i64"); eq(math.type(i:table()[1]), "integer")
end)

test("zeros, ones, full, arange, linspace", function()
  local z = kiln.zeros({ 2, 3 }, "f16")
  eq(z.dtype, "f16"); eq(z:sum(), 0)
  eq(kiln.ones({ 4 }):sum(), 4)
  eq(kiln.full({ 2, 2 }, 2.5):mean(), 2.5)
  local r = kiln.arange(5)
  eq(r.dtype, "i64"); eq(r:table()[5], 4)
  local l = kiln.linspace(0, 1, 5):table()
  near(l[2], 0.25); near(l[5], 1)
end)

test("randn matches torch.manual_seed(0); torch.randn(5)", function()
  local r = kiln.randn({ 5 }, { seed = 0 }):table()
  local want = { 1.5410, -0.2934, -2.1788, 0.5684, -1.0845 }
  for i = 1, 5 do near(r[i], want[i], 1e-4) end
  local r2 = kiln.randn({ 2, 3 }, { seed = 42 }):table()
  near(r2[1][1], 0.3367, 1e-4); near(r2[2][2], -1.1229, 1e-4)
end)

test("views share storage: narrow, reshape, transpose, select", function()
  local t = kiln.arange(12):to("f32"):reshape({ 3, 4 })
  local n = t:narrow(2, 2, 2)
  eq(n.shape[1], 3); eq(n.shape[2], 2); eq(n:table()[1][1], 1)
  n:fill(-1)
  eq(t:table()[1][2], -1, "narrow is a view")
  local tt = t:transpose(1, 2)
  eq(tt.shape[1], 4); eq(tt:table()[4][3], 11)
  local r = t:reshape({ 2, -1 }); eq(r.shape[2], 6)
  eq(t:select(1, -1):table()[4], 11)
  local u = t:unsqueeze(1); eq(#u.shape, 3); eq(u:squeeze().shape[1], 3)
  local e = kiln.tensor({ 1, 2 }):reshape({ 2, 1 }):expand({ 2, 3 })
  eq(e:table()[2][3], 2)
  -- a transposed tensor cannot be reshaped without a copy: still correct
  local flat = tt:reshape({ 12 }):table()
  eq(flat[2], 4)
end)

test("elementwise ops and broadcasting vs PyTorch", function()
  local a, b, c, pos = G.a, G.b, G.c, G.pos
  close(a + b, G.add_ab, 1e-6, "add"); close(a - b, G.sub_ab, 1e-6, "sub")
  close(a * c, G.mul_ac, 1e-6, "mul"); close(a / b, G.div_ab, 1e-5, "div")
  close(pos:pow(c), G.pow_pos_c, 1e-5, "pow"); close(a + 2.5, G.add_s, 1e-6, "add scalar")
  close(2.5 - a, G.rsub_s, 1e-6, "rsub"); close(2.0 / pos, G.rdiv_s, 1e-5, "rdiv")
  close(pos ^ 1.7, G.pow_s, 1e-5, "pow scalar"); close(-a, G.neg, 0, "neg")
  close(a:exp(), G.exp, 1e-5, "exp"); close(pos:log(), G.log, 1e-6, "log")
  close(pos:sqrt(), G.sqrt, 1e-6, "sqrt"); close(a:abs(), G.abs, 0, "abs")
  close(a:tanh(), G.tanh, 1e-6, "tanh"); close(a:sigmoid(), G.sigmoid, 1e-6, "sigmoid")
  close(a:clamp(-0.5, 0.7), G.clamp, 0, "clamp")
  close(a:minimum(b), G.minimum_ab, 0, "minimum"); close(a:maximum(c), G.maximum_ac, 0, "maximum")
end)

test("bf16 elementwise: each value is the f32 result rounded once (contiguous, broadcast, strided)", function()
  -- the vector path (bf16 / f32 operands of stride 0 or 1) and the f32-pieces path
  -- (strided) against f32 arithmetic on the same values, then one rounding to bf16;
  -- halfway cases, inf and nan among the values
  local vals = {}
  local x = kiln.randn({ 5, 37 }, { seed = 11 })
  for i, v in ipairs(x:reshape({ 185 }):table()) do vals[i] = v end
  vals[1], vals[2], vals[3], vals[4] = 1 / 0, -1 / 0, 0 / 0, 1 + 2 ^ -8
  local a32 = kiln.tensor(vals):reshape({ 5, 37 })
  local a = a32:to("bf16")
  local b = kiln.randn({ 5, 37 }, { seed = 12 }):to("bf16")
  local row = kiln.randn({ 1, 37 }, { seed = 13 }):to("bf16")
  local f = function(t) return t:to("f32") end
  local function same(got, want, what, dt)
    eq(got.dtype, dt or "bf16", what .. " dtype")
    local g, w = got:to("f32"):reshape({ got:numel() }):table(), want:to(got.dtype):to("f32"):reshape({ want:numel() }):table()
    for i = 1, #g do
      if not (g[i] == w[i] or (g[i] ~= g[i] and w[i] ~= w[i])) then
        error(("%s: element %d is %s, want %s"):format(what, i, g[i], w[i]), 2)
      end
    end
  end
  same(a + b, f(a) + f(b), "add"); same(a - b, f(a) - f(b), "sub")
  same(a * b, f(a) * f(b), "mul"); same(a / b, f(a) / f(b), "div")
  same(a * row, f(a) * f(row), "mul broadcast row"); same(row - a, f(row) - f(a), "sub broadcast row")
  same(a * 0.5, f(a) * 0.5, "mul scalar"); same(3 - a, 3 - f(a), "rsub scalar")
  -- a scalar f32 cannot hold: the sum in double, rounded to f32 (string.pack), then bf16
  local av, want = f(a):reshape({ 185 }):table(), {}
  for i, v in ipairs(av) do want[i] = string.unpack("f", string.pack("f", v + 1e-6)) end
  same(a + 1e-6, kiln.tensor(want):reshape({ 5, 37 }), "add inexact scalar")
  local at, bt = a:transpose(1, 2), b:transpose(1, 2)
  same(at * bt, f(at) * f(bt), "mul strided"); same(at + 2, f(at) + 2, "add strided scalar")
  local a32t = a32:transpose(1, 2)
  same(a:transpose(1, 2) * a32t, f(at) * a32t, "bf16 * f32, strided", "f32")
  same(a + a32, f(a) + a32, "bf16 + f32", "f32")
  same(kiln.nn.gelu(a, "tanh"), kiln.nn.gelu(f(a), "tanh"), "gelu tanh")
  same(kiln.nn.silu(at), kiln.nn.silu(f(at)), "silu strided")
end)

test("reductions over each dim vs PyTorch", function()
  local a = G.a
  for d = 1, 3 do
    close(a:sum(d), G["sum_d" .. d], 1e-5, "sum " .. d)
    close(a:mean(d), G["mean_d" .. d], 1e-6, "mean " .. d)
    close(a:max(d), G["max_d" .. d], 0, "max " .. d)
    close(a:min(d), G["min_d" .. d], 0, "min " .. d)
    close(a:var(d), G["var_d" .. d], 1e-5, "var " .. d)
  end
  near(a:sum(), G.sum_all:item(), 1e-5)
  near(a:var(), G.var_all:item(), 1e-5)
  eq(#a:sum(2, true).shape, 3, "keepdim")
end)

test("matmul, permute, softmax, cat vs PyTorch", function()
  close(G.matmul:matmul(G.matmul_b), G.matmul_out, 1e-5, "matmul")
  close(G.a:permute(1, 3, 2):contiguous(), G.permute_021, 0, "permute")
  close(kiln.nn.softmax(G.a, 2), G.softmax_d2, 1e-6, "softmax")
  close(kiln.cat({ G.a, G.a * 2 }, 2), G.cat_d2, 0, "cat")
end)

-- A transposed view made contiguous swaps its two inner dimensions (16 x 16 tiles
-- through registers for 4-byte elements): every element checked against its index,
-- with sizes off the tile, outer dimensions, an offset view, a strided destination
-- (copy into a transposed view) and 8-byte elements (the element loop).
test("transposed copies: every element where its index says", function()
  local function check(dst, O, A, B, base, what)
    local t = dst:table()
    for o = 1, O do
      for b = 1, B do
        local row = t[o][b]
        for a = 1, A do
          local want = base + (o - 1) * A * B + (a - 1) * B + (b - 1)
          if row[a] ~= want then
            error(("%s: [%d][%d][%d] = %s, want %d"):format(what, o, b, a, tostring(row[a]), want))
          end
        end
      end
    end
  end
  for _, dt in ipairs({ "f32", "i32", "i64" }) do
    for _, sz in ipairs({ { 2, 37, 53 }, { 1, 32, 48 }, { 3, 16, 17 }, { 1, 70, 300 } }) do
      local O, A, B = sz[1], sz[2], sz[3]
      local src = kiln.arange(O * A * B):to(dt):reshape({ O, A, B })
      local v = src:transpose(2, 3)
      local c = v:contiguous()
      check(c, O, A, B, 0, ("%s %dx%dx%d"):format(dt, O, A, B))
      -- into a destination whose rows are longer than A (a narrowed view)
      local d = kiln.zeros({ O, B, A + 5 }):to(dt)
      local dv = d:narrow(3, 1, A)
      dv:copy(v)
      check(dv, O, A, B, 0, ("%s %dx%dx%d into rows of %d"):format(dt, O, A, B, A + 5))
      eq(d:table()[O][B][A + 5], 0, dt .. ": past the view untouched")
      c:free(); v:free(); dv:free(); d:free(); src:free()
    end
    -- an offset view: the second image of three
    local big = kiln.arange(3 * 40 * 24):to(dt):reshape({ 3, 40, 24 })
    local one = big:narrow(1, 2, 1)
    local c = one:transpose(2, 3):contiguous()
    check(c, 1, 40, 24, 40 * 24, dt .. " offset view")
    c:free(); one:free(); big:free()
    -- a broadcast source (stride 0 along a): every row of the copy is its b
    local row = kiln.arange(50):to(dt):reshape({ 1, 1, 50 })
    local ex = row:expand({ 2, 33, 50 })
    local bt = ex:transpose(2, 3):contiguous()
    local t = bt:table()
    for o = 1, 2 do
      for b = 1, 50 do
        for a = 1, 33 do
          local v = t[o][b][a]
          if v ~= b - 1 then error(("%s broadcast: [%d][%d][%d] = %s"):format(dt, o, b, a, tostring(v))) end
        end
      end
    end
    bt:free(); ex:free(); row:free()
  end
end)

test("dtype conversion with :to", function()
  local t = kiln.tensor({ 1.5, -2.25, 65504, 1e-8 })
  local h = t:to("f16")
  eq(h.dtype, "f16"); eq(h:nbytes(), 8)
  local back = h:to("f32"):table()
  eq(back[1], 1.5); eq(back[2], -2.25); eq(back[3], 65504)
  eq(t:to("bf16"):to("f32"):table()[1], 1.5)
  eq(kiln.tensor({ 3.9, -3.9 }):to("i32"):table()[2], -3)
end)

test("devices: to sim and back; mixing devices is an error", function()
  local t = kiln.tensor({ 1, 2, 3 })
  local s = t:to("sim")
  eq(s.device, "sim")
  eq((s * 2):to("cpu"):table()[3], 6)
  raises(function() return s + t end, "different devices", "sim", "cpu")
  raises(function() return t:to("gpu7") end, "gpu7")
end)

test("move: in place to another device, views and accounting", function()
  local has_sim = false
  for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end
  if not has_sim then H.skip("no sim device") end
  collectgarbage()
  local base = kiln.mem.stats("sim").allocated
  local t = kiln.arange(0, 12):reshape({ 3, 4 })
  local same = t:move("cpu")
  H.truthy(rawequal(same, t), "returns self")
  t:move("sim")
  eq(t.device, "sim")
  H.truthy(kiln.mem.stats("sim").allocated > base, "bytes on sim")
  local v = t:transpose(1, 2) -- a strided view: moves as a contiguous copy
  v:move("cpu")
  eq(v.device, "cpu")
  H.truthy(v:is_contiguous())
  eq(v:table()[4][3], 11)
  eq(t.device, "sim", "the base tensor stays")
  t:free()
  collectgarbage()
  eq(kiln.mem.stats("sim").allocated, base, "the sim storage went back with the last holder")
  raises(function() v:move("nowhere") end, "not a device")
  v:free()
  raises(function() v:move("cpu") end, "freed")
end)

test("free, use after free names the line, <close>", function()
  local t = kiln.zeros({ 4 })
  t:free()
  local line = debug.getinfo(1, "l").currentline - 1
  raises(function() return t + 1 end, "tensor was freed at", "test_tensor.lua:" .. line)
  raises(function() return t:table() end, "freed")
  t:free() -- idempotent
  local before = kiln.mem.stats("sim").allocated
  do
    local s <close> = kiln.zeros({ 1024 }, { device = "sim" })
    H.truthy(kiln.mem.stats("sim").allocated > before)
  end
  eq(kiln.mem.stats("sim").allocated, before, "<close> released the sim memory")
end)

test("bad input: clear errors", function()
  local a = kiln.zeros({ 2, 3 })
  raises(function() return a + kiln.zeros({ 4 }) end, "do not broadcast", "[2,3]", "[4]")
  raises(function() return kiln.tensor({ { 1, 2 }, { 3 } }) end, "ragged")
  raises(function() return kiln.zeros({ 2 }, "f64") end, "invalid dtype 'f64'", "f32")
  raises(function() return a:narrow(2, 3, 2) end, "narrow", "out of range")
  raises(function() return a:reshape({ 5 }) end, "reshape")
  raises(function() return a + "x" end)
  raises(function() return a:matmul(kiln.zeros({ 2, 2 })) end, "matmul", "[2,3]", "[2,2]")
  raises(function() return kiln.nn.conv2d(kiln.zeros({ 1, 3, 8, 8 }), kiln.zeros({ 4, 2, 3, 3 }), nil, { groups = 2 }) end,
    "groups=2")
  raises(function() return kiln.zeros("x") end)
  raises(function() return a:sum(3) end, "out of range")
end)

test("thread count changes keep results identical", function()
  local x = kiln.randn({ 1, 8, 16, 16 }, { seed = 3 })
  local w = kiln.randn({ 8, 8, 3, 3 }, { seed = 4 })
  local n0 = kiln.threads()
  local a = kiln.nn.conv2d(x, w, nil, { padding = 1 })
  kiln.set_threads(1)
  local b = kiln.nn.conv2d(x, w, nil, { padding = 1 })
  kiln.set_threads(n0 + 1)
  local c = kiln.nn.conv2d(x, w, nil, { padding = 1 })
  kiln.set_threads(0)
  eq((a - b):abs():max(), 0, "1 thread")
  eq((a - c):abs():max(), 0, "more threads")
end)

-- conv2d {upsample = 2}: nearest 2x then the convolution, fused on the CPU where the shape
-- allows (3x3, stride 1, padding 1, >= 32 channels, >= 128x128 outputs), otherwise the
-- two ops in a row; the same numbers as upsample_nearest then conv2d either way.
test("conv2d upsample = 2 matches upsample_nearest then conv2d", function()
  local cases = {
    { 1, 48, 40, 36, 40, 3, 1, "f16" }, -- fused
    { 2, 32, 34, 32, 33, 3, 1, "f32" }, -- fused, batch 2
    { 1, 8, 10, 12, 5, 3, 1, "f32" },   -- few channels: unfused
    { 1, 16, 9, 9, 8, 1, 0, "f32" },    -- 1x1: unfused
  }
  for _, c in ipairs(cases) do
    local n, ch, h, w, k, ks, pad, dt = table.unpack(c)
    local x = kiln.randn({ n, ch, h, w }, { seed = 5 })
    local wt = (kiln.randn({ k, ch, ks, ks }, { seed = 6 }) * 0.1):to(dt)
    local b = kiln.randn({ k }, { seed = 7 })
    local u = kiln.nn.upsample_nearest(x, 2)
    local ref = kiln.nn.conv2d(u, wt, b, { padding = pad })
    local got = kiln.nn.conv2d(x, wt, b, { padding = pad, upsample = 2 })
    eq(table.concat(got.shape, ","), table.concat(ref.shape, ","), "shape")
    local d = (got - ref):abs():max() / ref:abs():max()
    H.truthy(d <= 1e-4, ("%d ch %dx%d k%d %s: relative difference %g"):format(ch, h, w, ks, dt, d))
  end
  raises(function() return kiln.nn.conv2d(kiln.zeros({ 1, 4, 8, 8 }), kiln.zeros({ 4, 4, 3, 3 }), nil, { upsample = 3 }) end,
    "upsample=3")
  -- errors name the tensors passed, not the upsampled input made inside
  raises(function() return kiln.nn.conv2d(kiln.zeros({ 1, 4, 8, 8 }), kiln.zeros({ 4, 2, 3, 3 }), nil,
    { padding = 1, upsample = 2 }) end, "expects 2 input channels", "[1,4,8,8]")
  raises(function() return kiln.nn.conv2d(kiln.zeros({ 1, 40, 40, 40 }), kiln.zeros({ 40, 40, 3, 3 }), kiln.zeros({ 3 }),
    { padding = 1, upsample = 2 }) end, "bias", "[3]")
end)

test("conv2d upsample = 2 does not make the upsampled image (sim peak)", function()
  local x = kiln.randn({ 1, 64, 64, 64 }, { device = "sim", seed = 8 })
  local wt = (kiln.randn({ 64, 64, 3, 3 }, { seed = 9 }) * 0.05):to("f16"):to("sim")
  local base = kiln.mem.stats("sim").allocated
  kiln.mem.reset_peak("sim")
  local y = kiln.nn.conv2d(x, wt, nil, { padding = 1, upsample = 2 })
  local fused = kiln.mem.stats("sim").peak - base
  y:free()
  kiln.mem.reset_peak("sim")
  local u = kiln.nn.upsample_nearest(x, 2)
  local y2 = kiln.nn.conv2d(u, wt, nil, { padding = 1 })
  u:free()
  local unfused = kiln.mem.stats("sim").peak - base
  y2:free()
  local out = 64 * 128 * 128 * 4
  eq(fused, out, "fused: the output only")
  eq(unfused, 2 * out, "unfused: upsampled input and output")
end)

test("group_norm inplace = true writes over its input", function()
  for _, dev in ipairs({ "cpu", "sim" }) do
    local x = kiln.randn({ 2, 64, 9, 7 }, { seed = 10, device = dev })
    local w, b = kiln.randn({ 64 }, { seed = 11 }):to(dev), kiln.randn({ 64 }, { seed = 12 }):to(dev)
    local ref = kiln.nn.group_norm(x, 32, w, b, 1e-6, { silu = true })
    local before = kiln.mem.stats(dev).allocated
    local y = kiln.nn.group_norm(x, 32, w, b, 1e-6, { silu = true, inplace = true })
    eq(kiln.mem.stats(dev).allocated, before, dev .. ": no new tensor")
    eq((y - ref):abs():max(), 0, dev .. ": same values as out of place")
    eq((x - ref):abs():max(), 0, dev .. ": x holds the result")
  end
  local x = kiln.randn({ 1, 64, 4, 4 }, { seed = 13 })
  local v = x:narrow(2, 1, 32)
  raises(function() return kiln.nn.group_norm(v, 32, nil, nil, 1e-6, { inplace = true }) end, "in place", "[1,32,4,4]")
  raises(function() return kiln.nn.group_norm(x:to("i32"), 32, nil, nil, 1e-6, { inplace = true }) end,
    "contiguous f32, f16 or bf16", "i32")
  -- half activations (a GPU's) too: out of place and copied back where the kernel
  -- writes over f32 only
  local h = x:to("f16")
  local href = kiln.nn.group_norm(h, 32, nil, nil, 1e-6, { silu = true })
  local hy = kiln.nn.group_norm(h, 32, nil, nil, 1e-6, { silu = true, inplace = true })
  eq(hy.dtype, "f16", "f16 in place keeps its dtype")
  eq((h:to("f32") - href:to("f32")):abs():max(), 0, "f16: x holds the result")
end)

test("sha256_file matches FIPS 180-4 test vector", function()
  local p = os.tmpname()
  local f = assert(io.open(p, "wb")); f:write("abc"); f:close()
  eq(kiln.sha256_file(p), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
  os.remove(p)
  raises(function() return kiln.sha256_file(p) end, p)
end)

test("relu, add, sub, mul: the contiguous vector loops agree with the strided ones", function()
  local v = {}
  for i = 1, 37 do v[i] = (i % 5 - 2) * 0.5 end -- 37: two vectors and a tail
  v[3], v[20], v[21] = 0 / 0, -0.0, 0 / 0
  local r = kiln.tensor(v):relu():table()
  for i = 1, 37 do
    if v[i] ~= v[i] then H.truthy(r[i] ~= r[i], "NaN stays NaN at " .. i)
    else eq(r[i], v[i] > 0 and v[i] or 0, "relu at " .. i)
      if v[i] <= 0 then H.truthy(1 / r[i] > 0, "relu gives +0 at " .. i) end
    end
  end
  local a, b = kiln.randn({ 3, 1001 }, { seed = 1 }), kiln.randn({ 3, 1001 }, { seed = 2 })
  local at, bt = a:transpose(1, 2), b:transpose(1, 2)
  for _, op in ipairs({ "__add", "__sub", "__mul" }) do
    local mt = getmetatable(a)
    local fast, slow = mt[op](a, b), mt[op](at, bt):transpose(1, 2):contiguous()
    eq((fast - slow):abs():max(), 0, op)
  end
end)

H.done()
