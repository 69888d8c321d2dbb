-- scripts/kiln/image.lua - image operations over kiln's tensor ops (kiln.image):
-- a Canny edge detector that gives the edge maps ComfyUI's Canny node gives
-- (kornia.filters.canny), for ControlNet hints without another model, and the
-- resize with an optional centre crop that ComfyUI's nodes share (common_upscale).
--
-- Canny, step by step as kornia computes it:
--   1. grey = 0.299 R + 0.587 G + 0.114 B;
--   2. Gaussian blur, kernel 5, sigma 1, separable (rows, then columns), reflect
--      padding;
--   3. Sobel gradients gx, gy (kernel [-1 0 1; -2 0 2; -1 0 1] and its transpose,
--      correlation), replicate padding;
--   4. magnitude sqrt(gx^2 + gy^2 + 1e-6);
--   5. non-maximum suppression: the angle atan2(gy, gx) rounded to a multiple of 45
--      degrees picks the two neighbours along the gradient (zero outside the image);
--      a pixel survives only if strictly greater than both;
--   6. double threshold: weak where magnitude > low, strong where > high;
--   7. hysteresis: a weak pixel touching (8-neighbourhood) a strong one becomes
--      strong, repeated until nothing changes; what stays weak is dropped.
-- kiln has no comparison, atan2 or gather op, so they are composed: a comparison
-- a > b is step(a - b) with step(d) = clamp(clamp(d * 2^100, -1, 1) * 2^100, 0, 1),
-- exact for finite f32 values (the smallest nonzero difference, a subnormal, still
-- reaches 1 after the two products); the rounded angle is read from |gy| against
-- tan(22.5 degrees) |gx| and the signs of gx and gy; neighbours are views of a
-- zero-padded copy. All of it runs on the image's device.
local kiln = require "kiln"

local M = {}

local BIG = 2.0 ^ 100
local TAN_22_5 = math.sqrt(2) - 1

local function mt_name(v)
  local mt = getmetatable(v)
  return type(mt) == "table" and rawget(mt, "__name") or nil
end

-- 1 where d > 0, else 0 (d finite)
local function step(d)
  local s <close> = (d * BIG):clamp(-1, 1)
  local t <close> = s * BIG
  return t:clamp(0, 1)
end

-- 1 where a > b (tensors or numbers, at least one a tensor)
local function gt(a, b)
  local d <close> = a - b
  return step(d)
end

-- x [N, 1, H, W] shifted so that out[y][x] = x[y + dy][x + dx], from a padded copy p
-- (padded by r on every side); a view of p.
local function shifted(p, r, h, w, dy, dx)
  return p:narrow(3, 1 + r + dy, h):narrow(4, 1 + r + dx, w)
end

-- Gaussian kernel of kornia's get_gaussian_kernel1d: exp(-x^2 / (2 sigma^2)) over
-- x = -2..2, normalized to sum 1 (in f32, as kornia builds it).
local function gaussian5(sigma)
  local g = {}
  for i = 1, 5 do
    local x = i - 3
    g[i] = math.exp(-(x * x) / (2 * sigma * sigma))
  end
  local t <close> = kiln.tensor(g, { device = "cpu" }) -- host data, read back below
  local s = t:sum()
  local n <close> = t / s
  return n:table()
end

-- 1-D filter of taps k along dim (4: rows, 3: columns) with reflect padding.
local function filter1d(x, k, dim, mode)
  local h, w = x.shape[3], x.shape[4]
  local r = #k // 2
  local pads = dim == 4 and { r, r, 0, 0 } or { 0, 0, r, r }
  local p <close> = kiln.nn.pad(x, pads, mode)
  local acc
  for i = 1, #k do
    if k[i] ~= 0 then
      local v = dim == 4 and p:narrow(4, i, w) or p:narrow(3, i, h)
      local term = v * k[i]
      if acc then
        local s = acc + term
        acc:free(); term:free()
        acc = s
      else
        acc = term
      end
    end
  end
  return acc
end

local function check_args(img, low, high)
  if type(img) ~= "userdata" or mt_name(img) ~= "kiln.Tensor" then
    error(("kiln.image.canny: the image must be a tensor [N, 1|3, H, W], not %s"):format(type(img)), 3)
  end
  local s = img.shape
  if #s ~= 4 or (s[2] ~= 1 and s[2] ~= 3) then
    error(("kiln.image.canny: the image must be [N, 1|3, H, W], not [%s]"):format(table.concat(s, ", ")), 3)
  end
  if img.dtype ~= "f32" then
    error(("kiln.image.canny: the image must be f32 (values in [0, 1]), not %s"):format(img.dtype), 3)
  end
  if type(low) ~= "number" or type(high) ~= "number" then
    error("kiln.image.canny: low and high must be numbers in [0, 1]", 3)
  end
  if not (low >= 0 and low <= 1 and high >= 0 and high <= 1) then
    error(("kiln.image.canny: thresholds must lie in [0, 1] (low %g, high %g)"):format(low, high), 3)
  end
  if low > high then
    error(("kiln.image.canny: low (%g) must not exceed high (%g)"):format(low, high), 3)
  end
end

--- Canny edges of img [N, 1|3, H, W] (f32 in [0, 1]) with thresholds low <= high in
-- [0, 1] on the gradient magnitude; returns [N, 3, H, W]: 1 on edges, 0 elsewhere
-- (ComfyUI's Canny node returns the edge map as an RGB image).
-- Python's round(): halves to the even neighbour (ComfyUI's crop offsets use it)
local round_half_even = require("kiln.util").round_half_even

--- img [B, C, H, W] resized to w x h as ComfyUI's common_upscale does: with
-- opts.crop = "center" the image is first cut to the target's aspect ratio (the
-- same rows or columns off each side), then interpolated (opts.mode "nearest-exact"
-- by default, "nearest" or "bilinear"; "area", "bicubic", "lanczos" and "bislerp" as
-- kiln.resample computes them). Returns a new tensor (img stays the caller's).
function M.resize(img, w, h, opts)
  opts = opts or {}
  if mt_name(img) ~= "kiln.Tensor" or #img.shape ~= 4 then
    error("kiln.image.resize: img must be an image tensor [B, C, H, W], got " .. type(img), 2)
  end
  if not (math.tointeger(w) and math.tointeger(h) and w > 0 and h > 0) then
    error(("kiln.image.resize: size %s x %s must be whole numbers above 0"):format(tostring(w), tostring(h)), 2)
  end
  local src = img
  local oh, ow = img.shape[3], img.shape[4]
  if opts.crop == "center" then
    local old, new = ow / oh, w / h
    local x, y = 0, 0
    if old > new then x = round_half_even((ow - ow * (new / old)) / 2)
    elseif old < new then y = round_half_even((oh - oh * (old / new)) / 2) end
    if x > 0 or y > 0 then src = img:narrow(3, y + 1, oh - 2 * y):narrow(4, x + 1, ow - 2 * x) end
  elseif opts.crop ~= nil and opts.crop ~= "disabled" then
    error(("kiln.image.resize: crop '%s' (\"center\" or \"disabled\")"):format(tostring(opts.crop)), 2)
  end
  local mode = opts.mode or "nearest-exact"
  if mode == "area" or mode == "bicubic" or mode == "lanczos" or mode == "bislerp" then
    return require("kiln.resample").resize(src, w, h, mode)
  end
  if src.shape[3] == h and src.shape[4] == w then return src:clone() end
  return kiln.nn.interpolate(src, { size = { h, w }, mode = mode })
end

function M.canny(img, low, high)
  check_args(img, low, high)
  local n, h, w = img.shape[1], img.shape[3], img.shape[4]

  -- 1. grey
  local grey
  if img.shape[2] == 3 then
    local r <close> = img:narrow(2, 1, 1) * 0.299
    local g <close> = img:narrow(2, 2, 1) * 0.587
    local b <close> = img:narrow(2, 3, 1) * 0.114
    local rg <close> = r + g
    grey = rg + b
  else
    grey = img:clone()             -- freed below, so never the caller's tensor
  end

  -- 2. blur
  local k = gaussian5(1.0)
  local bx <close> = filter1d(grey, k, 4, "reflect")
  grey:free()
  local blurred <close> = filter1d(bx, k, 3, "reflect")

  -- 3. Sobel: gx = [1 2 1]^T (columns) * [-1 0 1] (rows), gy the transpose
  local pb <close> = kiln.nn.pad(blurred, { 1, 1, 1, 1 }, "replicate")
  local function at(dy, dx) return shifted(pb, 1, h, w, dy, dx) end
  local gx, gy
  do
    local tl, tc, tr = at(-1, -1), at(-1, 0), at(-1, 1)
    local ml, mr = at(0, -1), at(0, 1)
    local bl, bc, br = at(1, -1), at(1, 0), at(1, 1)
    local right <close> = tr + mr * 2 + br
    local left <close> = tl + ml * 2 + bl
    gx = right - left
    local down <close> = bl + bc * 2 + br
    local up <close> = tl + tc * 2 + tr
    gy = down - up
  end

  -- 4. magnitude
  local gx2 <close> = gx * gx
  local gy2 <close> = gy * gy
  local sq <close> = gx2 + gy2
  local sq_eps <close> = sq + 1e-6
  local mag <close> = sq_eps:sqrt()

  -- 5. non-maximum suppression
  local ax <close> = gx:abs()
  local ay <close> = gy:abs()
  local tax <close> = ax * TAN_22_5
  local tay <close> = ay * TAN_22_5
  local not_h <close> = gt(ay, tax)
  local horiz <close> = 1 - not_h             -- |angle| rounds to 0 or 180 (also gx = gy = 0)
  local vert <close> = gt(tay, ax)            -- rounds to +-90
  local hv <close> = horiz + vert
  local diag_any <close> = 1 - hv
  local gxp <close> = gt(gx, 0)
  local gyp <close> = gt(gy, 0)
  local gxn <close> = gt(0, gx)
  local gyn <close> = gt(0, gy)
  local pp <close> = gxp * gyp
  local nn_ <close> = gxn * gyn
  local same <close> = pp + nn_
  local diag <close> = diag_any * same        -- rounds to 45 or -135: neighbours (+1, +1), (-1, -1)
  local anti <close> = diag_any - diag        -- rounds to -45 or 135: neighbours (+1, -1), (-1, +1)
  gx:free(); gy:free()

  local pm <close> = kiln.nn.pad(mag, { 1, 1, 1, 1 }, "constant", 0)
  local function is_max(dy, dx)
    local a <close> = gt(mag, shifted(pm, 1, h, w, dy, dx))
    local b <close> = gt(mag, shifted(pm, 1, h, w, -dy, -dx))
    return a * b
  end
  local keep
  for _, c in ipairs({ { horiz, 0, 1 }, { vert, 1, 0 }, { diag, 1, 1 }, { anti, 1, -1 } }) do
    local m <close> = is_max(c[2], c[3])
    local term = c[1] * m
    if keep then
      local s = keep + term
      keep:free(); term:free()
      keep = s
    else
      keep = term
    end
  end
  local thin <close> = mag * keep
  keep:free()

  -- 6. double threshold
  local weak_or_strong <close> = gt(thin, low)
  local strong = gt(thin, high)
  local weak <close> = weak_or_strong - strong

  -- 7. hysteresis: dilate the strong set by 3x3 inside the weak set until it stops
  -- growing (each round adds at least one pixel, so at most N*H*W rounds)
  local count = strong:sum()
  for _ = 1, n * h * w do
    local ps <close> = kiln.nn.pad(strong, { 1, 1, 1, 1 }, "constant", 0)
    local rows
    do
      local a <close> = ps:narrow(4, 1, w):maximum(ps:narrow(4, 2, w))
      rows = a:maximum(ps:narrow(4, 3, w))
    end
    local grown
    do
      local a <close> = rows:narrow(3, 1, h):maximum(rows:narrow(3, 2, h))
      local dil <close> = a:maximum(rows:narrow(3, 3, h))
      rows:free()
      local reached <close> = weak * dil
      grown = strong:maximum(reached)
    end
    strong:free()
    strong = grown
    local c = strong:sum()
    if c == count then break end
    count = c
  end

  local out = kiln.cat({ strong, strong, strong }, 2)
  strong:free()
  return out
end

return M
