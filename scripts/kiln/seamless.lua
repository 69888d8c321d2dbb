-- kiln.seamless: seamless (tileable) pictures. A network run "tileable" pads its
-- convolutions circularly on the wrapped axes ("x": left/right take the opposite
-- edge's pixels, top/bottom stay zero; "y" the reverse; "xy" both), so the picture
-- continues across its borders and tiles without a seam (A1111's "Tiling").
--
-- The switch is a field of the network, `net.tileable = "x" | "y" | "xy" | nil`, read
-- by its convolutions (kiln.unet, kiln.vae, kiln.controlnet, kiln.taesd,
-- kiln.upscaler); seamless.use sets it for one run and restores it after. A tiled run
-- (tiled VAE, TAESD and upscalers, MultiDiffusion) cannot pad each tile circularly (a
-- tile is not periodic): it pads the whole input circularly by a margin instead, runs
-- the tiles with circular padding suspended (each border tile then takes its context
-- from the other side of the picture) and crops the margin; a halo of context around
-- each tile (seamless.map) keeps the pixels zero padding distorts out of the blend.
local kiln = require "kiln"
local nn = kiln.nn

local M = {}
local fmt = string.format

-- mode -> wraps rows (y), wraps columns (x)
local AXES = { x = { false, true }, y = { true, false }, xy = { true, true } }

--- The mode of an option value: "x", "y" or "xy"; nil for nil, false or "" (off).
-- Anything else is an error that names the valid values (what: the option's name).
function M.check(mode, what)
  if mode == nil or mode == false or mode == "" then return nil end
  if type(mode) == "string" and AXES[mode] then return mode end
  error(fmt("%s: '%s' is not a tiling mode (valid: x, y, xy)", what or "tileable", tostring(mode)), 0)
end

--- wraps_y, wraps_x of a mode (false, false when off).
function M.axes(mode)
  local a = mode and AXES[mode]
  if not a then return false, false end
  return a[1], a[2]
end

-- While above 0, convolutions pad with zeros whatever their network's mode: the
-- tiles of a tiled run over an input already padded circularly.
local suspended = 0

--- The mode a network's convolutions use now: its own, or nil while suspended.
function M.active(mode)
  if suspended > 0 then return nil end
  return mode
end

--- Runs fn(...) with circular padding suspended (restored on an error too).
function M.suspend(fn, ...)
  suspended = suspended + 1
  local r = table.pack(pcall(fn, ...))
  suspended = suspended - 1
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

local function pair(v, def)
  if v == nil then return def, def end
  if type(v) == "table" then return v[1], v[2] end
  return v, v
end

local function copy(t)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  return c
end

--- kiln.nn.conv2d(x, w, b, opts) with circular padding on the axes of mode (the
-- network's tileable field; nil: the plain convolution), as PyTorch's
-- padding_mode = "circular" on those axes and zeros on the others. The wrapped axes
-- are padded here and the convolution pads them no further. With opts.upsample = 2
-- the input is padded by ceil(p/2) before the (fused) upsampling convolution keeps
-- its padding p, and the output is cropped: the upsampled picture is never made.
function M.conv2d(x, w, b, opts, mode)
  mode = M.active(mode)
  if not mode or not opts or not opts.padding then return nn.conv2d(x, w, b, opts) end
  local ph, pw = pair(opts.padding, 0)
  local wy, wx = M.axes(mode)
  if not wy then ph = 0 end
  if not wx then pw = 0 end
  if ph == 0 and pw == 0 then return nn.conv2d(x, w, b, opts) end
  if opts.upsample == 2 then
    local qh, qw = (ph + 1) // 2, (pw + 1) // 2
    local xp = nn.pad(x, { qw, qw, qh, qh }, "circular")
    -- a residual has the cropped output's shape: added (then the activation) after the crop
    local o = opts
    if opts.residual then
      o = copy(opts)
      o.residual, o.leaky_relu = nil, nil
    end
    local ok, y = pcall(nn.conv2d, xp, w, b, o)
    xp:free()
    if not ok then error(y, 0) end
    -- the upsampled input grew by 2q a side: so did the output, the shift included
    local a = y:narrow(3, 2 * qh + 1, y.shape[3] - 4 * qh)
    local c = a:narrow(4, 2 * qw + 1, y.shape[4] - 4 * qw)
    local r = c:contiguous()
    c:free(); a:free(); y:free()
    if opts.residual then
      local ok2, s = pcall(function() return r + opts.residual end)
      r:free()
      if not ok2 then error(s, 0) end
      if opts.leaky_relu then
        local t = nn.leaky_relu(s, opts.leaky_relu)
        s:free()
        s = t
      end
      r = s
    end
    return r
  end
  local xp = nn.pad(x, { pw, pw, ph, ph }, "circular")
  local o = copy(opts)
  local zh, zw = pair(opts.padding, 0)
  o.padding = { wy and 0 or zh, wx and 0 or zw }
  local ok, y = pcall(nn.conv2d, xp, w, b, o)
  xp:free()
  if not ok then error(y, 0) end
  return y
end

--- kiln.nn.pad(x, {left, right, top, bottom}) with zeros, but circular on the axes
-- of mode (the network's tileable field): a network's explicit padding (the VAE
-- encoder's downsampler pads right and bottom) wraps as its convolutions do.
function M.pad(x, pads, mode)
  mode = M.active(mode)
  local wy, wx = M.axes(mode)
  local l, r, t, b = pads[1] or 0, pads[2] or 0, pads[3] or 0, pads[4] or 0
  if not (wx and l + r > 0) and not (wy and t + b > 0) then return nn.pad(x, pads) end
  if wx and wy then return nn.pad(x, { l, r, t, b }, "circular") end
  local c = wx and nn.pad(x, { l, r, 0, 0 }, "circular") or nn.pad(x, { 0, 0, t, b }, "circular")
  local zl, zr, zt, zb = wx and 0 or l, wx and 0 or r, wy and 0 or t, wy and 0 or b
  if zl + zr + zt + zb == 0 then return c end
  local z = nn.pad(c, { zl, zr, zt, zb })
  c:free()
  return z
end

--- x padded circularly by m on the wrapped axes of mode (a new tensor).
function M.wrap_pad(x, mode, m)
  local wy, wx = M.axes(mode)
  local mh, mw = wy and m or 0, wx and m or 0
  return nn.pad(x, { mw, mw, mh, mh }, "circular")
end

--- y without a margin of m on the wrapped axes of mode (a new tensor; y is freed).
function M.crop(y, mode, m)
  local wy, wx = M.axes(mode)
  local mh, mw = wy and m or 0, wx and m or 0
  if mh == 0 and mw == 0 then return y end
  local a = y:narrow(3, mh + 1, y.shape[3] - 2 * mh)
  local c = a:narrow(4, mw + 1, y.shape[4] - 2 * mw)
  local r = c:contiguous()
  c:free(); a:free(); y:free()
  return r
end

--- The wrap margin of a tiled run, in input units: the overlap (the distance a
-- tile's inner edge keeps from the pixels it gives most weight), at least one
-- `multiple` and rounded up to one (the UNet's downsamplers keep their phase).
function M.margin(overlap, multiple)
  multiple = multiple or 1
  local m = math.max(overlap or 0, multiple)
  return (m + multiple - 1) // multiple * multiple
end

-- fn(tile, i) of kiln.tile.map over xp (x padded by m on the wrapped axes of mode)
-- run on the tile grown by `halo` input units on every side that has pixels there
-- (xh: x padded by m + halo), its output cropped back to the tile's: the pixels next
-- to a tile's edge, which zero padding distorts, then lie outside what is blended.
local function with_halo(fn, x, xp, mo, mode, m, halo)
  local xh = M.wrap_pad(x, mode, m + halo)
  local plan = kiln.tile.plan(xp.shape[3], xp.shape[4], mo)
  local wy, wx = M.axes(mode)
  local oy, ox = wy and halo or 0, wx and halo or 0 -- xh's rows / columns before xp's
  local s = mo.scale or 1
  local function px(v) return math.floor(v * s + 0.5) end
  local run = function(_, i)
    local r = plan[i].input
    local y0, x0 = r.y + oy, r.x + ox
    local t, b = math.min(halo, y0 - 1), math.min(halo, xh.shape[3] - (y0 + r.h - 1))
    local l, rt = math.min(halo, x0 - 1), math.min(halo, xh.shape[4] - (x0 + r.w - 1))
    local a = xh:narrow(3, y0 - t, r.h + t + b)
    local c = a:narrow(4, x0 - l, r.w + l + rt)
    local tile = c:contiguous()
    c:free(); a:free()
    local ok, y = pcall(fn, tile, i)
    tile:free()
    if not ok then error(y, 0) end
    if t + b + l + rt == 0 then return y end
    local ya = y:narrow(3, px(t) + 1, px(r.h))
    local yc = ya:narrow(4, px(l) + 1, px(r.w))
    local out = yc:contiguous()
    yc:free(); ya:free(); y:free()
    return out
  end
  return run, xh
end

--- kiln.tile.map(x, fn, mo) wrapping around on the axes of mode: x padded
-- circularly by m (input units), the tiles run with circular padding suspended,
-- the output's margin (m times mo.scale) cropped. The result equals the untiled
-- tileable run within the bound of a tiled run. halo (input units, a multiple of
-- mo.multiple; default 0): each tile runs with that much more context on every side
-- inside the picture (cropped from its output before the blend). Every tile edge of a
-- wrapped run is a seam inside the picture, where an ordinary run's border tiles end
-- at the picture's edge (zero padding there is the untiled network's own); the halo
-- keeps a wrapped run as close to its untiled run as an ordinary one is to its own.
function M.map(x, fn, mo, mode, m, halo)
  local xp = M.wrap_pad(x, mode, m)
  local run, xh = fn, nil
  if halo and halo > 0 then run, xh = with_halo(fn, x, xp, mo, mode, m, halo) end
  local ok, y = pcall(M.suspend, kiln.tile.map, xp, run, mo)
  xp:free()
  if xh then xh:free() end
  if not ok then error(y, 0) end
  local s = mo.scale or 1
  return M.crop(y, mode, math.floor(m * s + 0.5))
end

--- Sets net.tileable = mode on every network of the list for a run; the value
-- returned restores the previous modes when closed (`local t <close> = ...`), on
-- an error too. mode is checked first (seamless.check).
function M.use(nets, mode, what)
  mode = M.check(mode, what)
  local prev = {}
  for i, n in ipairs(nets) do
    prev[i] = n.tileable
    n.tileable = mode
  end
  return setmetatable({}, { __close = function()
    for i, n in ipairs(nets) do n.tileable = prev[i] end
  end })
end

return M
