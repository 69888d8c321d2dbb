-- kiln.resample: the resize filters of ComfyUI's common_upscale that kiln.nn.interpolate
-- lacks, for kiln.image.resize: "area" (adaptive average pooling, PyTorch's "area"),
-- "bicubic" (PyTorch's cubic convolution, A = -0.75, align_corners false, edge pixels
-- repeated), "lanczos" (Pillow's LANCZOS on 8-bit pictures, as ComfyUI hands images to
-- Pillow) and "bislerp" (ComfyUI's spherical interpolation of each pixel's channel vector).
--
-- The first three are separable: a pass along the width, then one along the height, each
-- a product with an [out, in] weight matrix built here (kiln.nn.linear), so they run on
-- the image's device at matrix-product speed. Lanczos also reproduces Pillow's 8-bit
-- integer arithmetic exactly (see lanczos_pass): the input truncated to whole levels
-- (numpy's astype(uint8)), weights in Pillow's fixed point (22 fraction bits), each
-- pass rounded and clamped to 0..255 (Pillow keeps the intermediate image in 8 bits).
-- bislerp works on one channel vector per pixel (acos, sin) and is meant for latents,
-- which are small: it runs in Lua.
local kiln = require "kiln"

local M = {}
local fmt = string.format

-- ---------------------------------------------------------------- weights

-- area: output i averages input [floor(i in/out), ceil((i + 1) in/out))
local function area_rows(n_in, n_out)
  local rows = {}
  for i = 0, n_out - 1 do
    local a = (i * n_in) // n_out
    local b = -((-(i + 1) * n_in) // n_out)
    local row = {}
    for j = 1, n_in do row[j] = 0 end
    for j = a, b - 1 do row[j + 1] = 1 / (b - a) end
    rows[i + 1] = row
  end
  return rows
end

-- cubic convolution with A = -0.75 (Keys), PyTorch's upsample_bicubic2d: source
-- x = (i + 0.5) in/out - 0.5 (not clamped), taps floor(x) - 1 .. floor(x) + 2, each index
-- clamped into the picture
local A = -0.75
local function cc1(x) return ((A + 2) * x - (A + 3)) * x * x + 1 end
local function cc2(x) return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A end

local function bicubic_rows(n_in, n_out)
  local rows, scale = {}, n_in / n_out
  for i = 0, n_out - 1 do
    local x = scale * (i + 0.5) - 0.5
    local x0 = math.floor(x)
    local t = x - x0
    local w = { cc2(t + 1), cc1(t), cc1(1 - t), cc2(2 - t) }
    local row = {}
    for j = 1, n_in do row[j] = 0 end
    for k = 1, 4 do
      local j = math.min(math.max(x0 - 2 + k, 0), n_in - 1)
      row[j + 1] = row[j + 1] + w[k]
    end
    rows[i + 1] = row
  end
  return rows
end

-- Pillow's LANCZOS (support 3, widened by the scale when shrinking), its coefficients
-- normalized to sum 1 and then put in fixed point with 22 fraction bits (rounded half
-- away from zero): whole numbers, the weights times 2^22
local PREC = 1 << 22

local function sinc(x)
  if x == 0 then return 1 end
  x = x * math.pi
  return math.sin(x) / x
end

local function lanczos3(x)
  if x >= -3 and x < 3 then return sinc(x) * sinc(x / 3) end
  return 0
end

local function trunc(x) return x < 0 and math.ceil(x) or math.floor(x) end

local function lanczos_rows(n_in, n_out)
  local rows, scale = {}, n_in / n_out
  local fscale = math.max(scale, 1)
  local support = 3 * fscale
  for i = 0, n_out - 1 do
    local center = (i + 0.5) * scale
    local ss = 1 / fscale
    local xmin = math.max(trunc(center - support + 0.5), 0)
    local xmax = math.min(trunc(center + support + 0.5), n_in)
    local k, sum = {}, 0
    for x = xmin, xmax - 1 do
      local v = lanczos3((x - center + 0.5) * ss)
      k[x] = v
      sum = sum + v
    end
    local row = {}
    for j = 1, n_in do row[j] = 0 end
    for x = xmin, xmax - 1 do
      local v = sum ~= 0 and k[x] / sum or k[x]
      row[x + 1] = v < 0 and trunc(-0.5 + v * PREC) or trunc(0.5 + v * PREC)
    end
    rows[i + 1] = row
  end
  return rows
end

local ROWS = { area = area_rows, bicubic = bicubic_rows, lanczos = lanczos_rows }

-- ---------------------------------------------------------------- passes

-- x [B, C, H, W] through the weight rows ([out][in]) along dim (4: width, 3: height)
local function pass(x, rows, dim)
  local w <close> = kiln.tensor(rows)
  local dev = x.device
  local wd = w.device ~= dev and w:to(dev) or nil  -- kiln.tensor makes it on the default device
  if dim == 4 then
    local r = kiln.nn.linear(x, wd or w)
    if wd then wd:free() end
    return r
  end
  local xt <close> = x:transpose(3, 4):contiguous()
  local r <close> = kiln.nn.linear(xt, wd or w)
  if wd then wd:free() end
  return r:transpose(3, 4):contiguous()
end

-- 1 where d > 0, else 0 (d finite): two products saturate any nonzero difference
local BIG = 2.0 ^ 100
local function step(d)
  local m <close> = d * BIG
  local s <close> = m:clamp(-1, 1)
  local t <close> = s * BIG
  return t:clamp(0, 1)
end

-- floor of v (|v| < 2^22): f32 addition of 1.5 * 2^23 lands where whole numbers are
-- the representable values, so it rounds to the nearest (ties to even); one less where
-- that went up
local ROUNDER = 1.5 * 2.0 ^ 23
local function floor(v)
  local a <close> = v + ROUNDER
  local r = a - ROUNDER
  local d <close> = r - v
  local up <close> = step(d)
  local f = r - up
  r:free()
  return f
end

-- One Lanczos pass of 8-bit levels u (whole numbers in f32) as Pillow's integer
-- arithmetic: clip8((2^21 + sum u k) >> 22). The sum reaches 2^30, beyond f32's whole
-- numbers, so each weight is split k = 2048 hi + lo (0 <= lo < 2048) and the two
-- products S_hi = sum u hi, S_lo = sum u lo stay exact (below 2^24 up to 32 taps, a
-- fifth of the size); then (2^21 + 2048 S_hi + S_lo) >> 22 =
-- floor(S_hi / 2048) + floor((S_hi mod 2048 + floor(S_lo / 2048) + 1024) / 2048).
local function lanczos_pass(u, dim, n_out)
  local rows = lanczos_rows(u.shape[dim], n_out)
  local hi, lo = {}, {}
  for i, row in ipairs(rows) do
    local h, l = {}, {}
    for j, k in ipairs(row) do
      h[j] = k // 2048
      l[j] = k - h[j] * 2048
    end
    hi[i], lo[i] = h, l
  end
  local s_hi <close> = pass(u, hi, dim)
  local s_lo <close> = pass(u, lo, dim)
  local q_hi <close> = s_hi / 2048
  local a <close> = floor(q_hi)
  local a2048 <close> = a * 2048
  local b <close> = s_hi - a2048
  local q_lo <close> = s_lo / 2048
  local c <close> = floor(q_lo)
  local bc <close> = b + c
  local bc1 <close> = bc + 1024
  local q <close> = bc1 / 2048
  local carry <close> = floor(q)
  local r <close> = a + carry
  return r:clamp(0, 255)
end

local function lanczos(x, w, h)
  if x.shape[2] ~= 3 then
    error(fmt("kiln.image.resize: lanczos works on RGB pictures (Pillow's 8-bit RGB), got %d channels", x.shape[2]), 3)
  end
  local scaled <close> = x * 255
  local c <close> = scaled:clamp(0, 255)
  local levels = floor(c)
  if w ~= x.shape[4] then
    local r = lanczos_pass(levels, 4, w)
    levels:free()
    levels = r
  end
  if h ~= x.shape[3] then
    local r = lanczos_pass(levels, 3, h)
    levels:free()
    levels = r
  end
  local out = levels / 255
  levels:free()
  return out
end

-- ---------------------------------------------------------------- bislerp

-- where output j of a 1-D resize from n_in to n_out reads (ComfyUI's bislerp takes
-- them from a bilinear resize of the index ramp): left index, right index, ratio
local function bilinear_taps(n_in, n_out)
  local taps, scale = {}, n_in / n_out
  for j = 0, n_out - 1 do
    local s = math.max((j + 0.5) * scale - 0.5, 0)
    local i0 = math.floor(s)
    local r = s - i0
    if i0 >= n_in - 1 then i0, r = n_in - 1, 0 end
    taps[j + 1] = { i0, math.min(i0 + 1, n_in - 1), r }
  end
  return taps
end

-- slerp of channel vectors a, b (Lua arrays of c numbers) at ratio r, as ComfyUI's:
-- the directions slerped, the length interpolated linearly; nearly equal directions
-- give a itself, nearly opposite ones the linear mix
local function slerp(a, b, r, c, out)
  local na, nb = 0, 0
  for k = 1, c do na = na + a[k] * a[k]; nb = nb + b[k] * b[k] end
  na, nb = math.sqrt(na), math.sqrt(nb)
  local dot = 0
  for k = 1, c do
    local ua = na == 0 and 0 or a[k] / na
    local ub = nb == 0 and 0 or b[k] / nb
    dot = dot + ua * ub
  end
  if dot > 1 - 1e-5 then
    for k = 1, c do out[k] = a[k] end
    return
  end
  if dot < 1e-5 - 1 then
    for k = 1, c do out[k] = a[k] * (1 - r) + b[k] * r end
    return
  end
  local omega = math.acos(dot)
  local so = math.sin(omega)
  local fa, fb = math.sin((1 - r) * omega) / so, math.sin(r * omega) / so
  local len = na * (1 - r) + nb * r
  for k = 1, c do
    local ua = na == 0 and 0 or a[k] / na
    local ub = nb == 0 and 0 or b[k] / nb
    out[k] = (fa * ua + fb * ub) * len
  end
end

-- flat [n][c][h][w] array -> the same resized along one axis (dim 4 or 3)
local function bislerp_pass(v, n, c, h, w, dim, n_out)
  local n_in = dim == 4 and w or h
  local taps = bilinear_taps(n_in, n_out)
  local oh, ow = dim == 4 and h or n_out, dim == 4 and n_out or w
  local out = {}
  local a, b, res = {}, {}, {}
  local plane_in, plane_out = h * w, oh * ow
  for bi = 0, n - 1 do
    local base_in, base_out = bi * c * plane_in, bi * c * plane_out
    for y = 0, oh - 1 do
      for x = 0, ow - 1 do
        local t = taps[(dim == 4 and x or y) + 1]
        local p1 = dim == 4 and (y * w + t[1]) or (t[1] * w + x)
        local p2 = dim == 4 and (y * w + t[2]) or (t[2] * w + x)
        for k = 1, c do
          a[k] = v[base_in + (k - 1) * plane_in + p1 + 1]
          b[k] = v[base_in + (k - 1) * plane_in + p2 + 1]
        end
        slerp(a, b, t[3], c, res)
        local q = y * ow + x
        for k = 1, c do out[base_out + (k - 1) * plane_out + q + 1] = res[k] end
      end
    end
  end
  return out, oh, ow
end

local function flatten(t, out)
  for _, x in ipairs(t) do
    if type(x) == "table" then flatten(x, out) else out[#out + 1] = x end
  end
  return out
end

local function bislerp(x, w, h)
  local n, c, H, W = x.shape[1], x.shape[2], x.shape[3], x.shape[4]
  local src = x.device == "cpu" and x or x:to("cpu")
  local v = flatten(src:table(), {})
  if src ~= x then src:free() end
  v = bislerp_pass(v, n, c, H, W, 4, w)
  v = bislerp_pass(v, n, c, H, w, 3, h)
  local t <close> = kiln.tensor(v)
  local r = t:reshape({ n, c, h, w })
  local out = r:contiguous()
  r:free()
  if out.device ~= x.device then
    local d = out:to(x.device)
    out:free()
    return d
  end
  return out
end

-- ---------------------------------------------------------------- entry

M.modes = { "area", "bicubic", "lanczos", "bislerp" }

--- x [B, C, H, W] (f32) resized to w x h with one of M.modes; a new tensor.
function M.resize(x, w, h, mode)
  local rows = ROWS[mode]
  if not rows and mode ~= "bislerp" then
    error(fmt("kiln.resample: unknown mode '%s' (%s)", tostring(mode), table.concat(M.modes, ", ")), 2)
  end
  if x.dtype ~= "f32" then error(fmt("kiln.resample: %s needs an f32 tensor, got %s", mode, x.dtype), 2) end
  local xc <close> = x:contiguous()     -- a crop is a view; the passes read whole rows
  if mode == "lanczos" then return lanczos(xc, w, h) end
  if mode == "bislerp" then return bislerp(xc, w, h) end
  local a = w ~= xc.shape[4] and pass(xc, rows(xc.shape[4], w), 4) or xc
  local b = h ~= xc.shape[3] and pass(a, rows(xc.shape[3], h), 3) or (a == xc and xc:clone() or a)
  if a ~= xc and a ~= b then a:free() end
  return b
end

return M
