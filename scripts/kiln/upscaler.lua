-- kiln.upscaler: image upscale models, their architecture and every hyper-parameter
-- read from the tensors' names and shapes (as spandrel does for ComfyUI), loaded as a
-- model like a checkpoint's parts (load / offload / unload, budgets, low-mode streaming)
-- and run in tiles whose size comes from the free budget.
--
--   local up = kiln.load_upscaler(path)     -- up.scale, up.arch, up.config
--   local big = up:upscale(img [, {tile = 256, overlap = 16, tileable = "xy"}])   -- [1, 3, sH, sW] in [0, 1]
--   local y = up:forward(x)                 -- the bare network, untiled and unclamped
--
-- Architectures:
--   RRDBNet (ESRGAN, Real-ESRGAN, BSRGAN): a first conv, nb residual-in-residual dense
--     blocks (three dense blocks of five convs each, growth gc, LeakyReLU 0.2, residuals
--     scaled by 0.2), a body conv added to the first conv's features, 2x nearest
--     upsampling + conv + LeakyReLU per step, an HR conv and the last conv. Names in the
--     new layout (conv_first, body.N.rdb1.conv1, conv_body, conv_upK, conv_hr, conv_last)
--     or the original ESRGAN Sequential (model.0, model.1.sub.N.RDB1.conv1.0,
--     model.1.sub.NB, then the upsampling convs, the HR conv and the last conv at
--     increasing indices). The x1 / x2 Real-ESRGAN models fold the input with
--     pixel-unshuffle (factor 4 / 2: conv_first takes 48 / 12 channels) and then upsample
--     4x: scale = 2^steps / unshuffle.
--   SRVGGNetCompact (Real-ESRGAN compact): conv + PReLU, n x (conv + PReLU), a conv to
--     3 s^2 channels, pixel shuffle, plus the input upsampled (nearest).
-- Networks kiln does not run (SwinIR, HAT, DAT, OmniSR, ...) are named in the error.
--
-- Alpha: an RGBA image is upscaled as RGB by the network, its alpha plane bilinearly
-- (clamped to [0, 1]) on its own; the result is RGBA. A grey image (1 channel) is run as
-- RGB and comes back RGB.
--
-- Seamless pictures: with tileable = "x" | "y" | "xy" (the option, or up.tileable) the
-- convolutions pad circularly on those axes (kiln.seamless) and the tiles wrap around,
-- so a picture that tiles comes back tiling.
local kiln = require "kiln"
local util = require "kiln.util"
local stream = require "kiln.stream"
local tiling = require "kiln.tiling"
local seamless = require "kiln.seamless"
local mf = require "kiln.model_files"
local part = require "kiln.part"
local nn = kiln.nn

local M = {}
local fmt = string.format

local Upscaler = {}
Upscaler.__index = Upscaler
M.Upscaler = Upscaler

local WHO = "kiln.load_upscaler"
local function fail(path, msg) util.file_error(WHO, path, msg) end

local shape_str = util.shape_str

-- Tiles in input pixels: the default without a budget to size them from, and the overlap.
M.DEFAULT_TILE = 512
M.DEFAULT_OVERLAP = 16

-- ---------------------------------------------------------------- pixel (un)shuffle

--- x [B, C*r*r, H, W] -> [B, C, H*r, W*r] (torch.nn.functional.pixel_shuffle).
function M.pixel_shuffle(x, r)
  local B, C, H, W = x.shape[1], x.shape[2] // (r * r), x.shape[3], x.shape[4]
  local v = x:reshape({ B, C, r, r, H, W })
  local p = v:permute({ 1, 2, 5, 3, 6, 4 })
  local c = p:contiguous()
  v:free(); p:free()
  local y = c:reshape({ B, C, H * r, W * r })
  c:free()
  return y
end

--- x [B, C, H*r, W*r] -> [B, C*r*r, H, W] (torch.nn.functional.pixel_unshuffle).
function M.pixel_unshuffle(x, r)
  local B, C, H, W = x.shape[1], x.shape[2], x.shape[3] // r, x.shape[4] // r
  local v = x:reshape({ B, C, H, r, W, r })
  local p = v:permute({ 1, 2, 4, 6, 3, 5 })
  local c = p:contiguous()
  v:free(); p:free()
  local y = c:reshape({ B, C * r * r, H, W })
  c:free()
  return y
end

-- PReLU with one slope per channel a [C]: relu(x) + a * min(x, 0); frees x.
local function prelu(x, a)
  local av = a:reshape({ 1, a.shape[1], 1, 1 })
  local neg = x:minimum(0)
  local sn = neg * av
  neg:free(); av:free()
  local pos = x:relu()
  x:free()
  local y = pos + sn
  pos:free(); sn:free()
  return y
end

-- ---------------------------------------------------------------- architecture from names

-- Signatures of upscale networks kiln does not run: a substring of a tensor name and
-- the architecture it marks, most specific first.
local OTHER = {
  { "conv_block.cab.", "HAT" },
  { "overlap_attn.", "HAT" },
  { "attn.cpb_mlp.", "Swin2SR" },
  { "residual_group.", "SwinIR" },
  { ".attns.", "DAT" },
  { "residual_layer.", "OmniSR" },
  { "block_1.c1_r.", "SPAN" },
  { "unet1.conv1.", "Real-CUGAN" },
  { "m_head.", "SCUNet" },
  { "stylegan_decoder.", "GFPGAN (a face restorer)" },
  { "quantize.embedding.", "CodeFormer (a face restorer)" },
  { "feats.0.", "PLKSR / RealPLKSR" },
  { "patch_embed.", "a transformer upscaler (SwinIR, HAT, DAT family)" },
}

local function look_alike(shapes)
  for _, o in ipairs(OTHER) do
    for name in pairs(shapes) do
      if name:find(o[1], 1, true) then return o[2], name end
    end
  end
  return nil
end

-- The largest integer captured by pattern over the names (-1 when none).
local function max_index(shapes, pattern)
  local n = -1
  for name in pairs(shapes) do
    local i = name:match(pattern)
    if i then n = math.max(n, tonumber(i)) end
  end
  return n
end

-- unshuffle factor from conv_first's input channels and the output's: 1, 2 or 4.
local function unshuffle_of(in_nc, out_nc, where)
  for _, r in ipairs({ 1, 2, 4 }) do
    if in_nc == out_nc * r * r then return r end
  end
  error(fmt("%s: the first conv takes %d channels for %d output channels (expected 1, 4 or 16 times as many)",
    where, in_nc, out_nc), 0)
end

-- RRDBNet, new layout: names are already the canonical ones.
local function rrdb_new(s)
  local first = util.need_shape(s, "conv_first.weight", "the feature width", "RRDBNet")
  local nb = max_index(s, "^body%.(%d+)%.rdb1%.conv1%.weight$") + 1
  local steps = max_index(s, "^conv_up(%d+)%.weight$")
  local last = util.need_shape(s, "conv_last.weight", "the output channels", "RRDBNet")
  local gc = util.need_shape(s, "body.0.rdb1.conv1.weight", "the growth channels", "RRDBNet")[1]
  if steps < 1 then error("RRDBNet: no conv_up1 (an upsampling conv) found", 0) end
  return { nf = first[1], in_nc = first[2], out_nc = last[1], nb = nb, gc = gc, steps = steps, layout = "new" }
end

-- RRDBNet, original ESRGAN layout: canonical name -> real name, and the configuration.
local function rrdb_old(s)
  local first = util.need_shape(s, "model.0.weight", "the feature width", "ESRGAN")
  local nb = max_index(s, "^model%.1%.sub%.(%d+)%.RDB1%.conv1%.0%.weight$") + 1
  local gc = util.need_shape(s, "model.1.sub.0.RDB1.conv1.0.weight", "the growth channels", "ESRGAN")[1]
  local map = {}
  map["conv_first.weight"], map["conv_first.bias"] = "model.0.weight", "model.0.bias"
  for n = 0, nb - 1 do
    for r = 1, 3 do
      for c = 1, 5 do
        for _, k in ipairs({ "weight", "bias" }) do
          map[fmt("body.%d.rdb%d.conv%d.%s", n, r, c, k)] = fmt("model.1.sub.%d.RDB%d.conv%d.0.%s", n, r, c, k)
        end
      end
    end
  end
  map["conv_body.weight"], map["conv_body.bias"] = fmt("model.1.sub.%d.weight", nb), fmt("model.1.sub.%d.bias", nb)
  -- the convolutions after the trunk, in order: upsampling steps, HR conv, last conv
  local idx = {}
  for name, sh in pairs(s) do
    local i = name:match("^model%.(%d+)%.weight$")
    if i and tonumber(i) >= 2 and #sh == 4 then idx[#idx + 1] = tonumber(i) end
  end
  table.sort(idx)
  -- (x1 models of the original code have no upsampling step: HR conv and last conv only)
  if #idx < 2 then error(fmt("ESRGAN: %d convolutions after the trunk (model.2 on), expected at least 2", #idx), 0) end
  local steps = #idx - 2
  for k = 1, steps do
    local w = s[fmt("model.%d.weight", idx[k])]
    if w[1] ~= first[1] then
      error(fmt("ESRGAN: upsampling conv model.%d has %d outputs for %d features (a pixel-shuffle upsampler, " ..
        "which kiln does not run)", idx[k], w[1], first[1]), 0)
    end
    map[fmt("conv_up%d.weight", k)], map[fmt("conv_up%d.bias", k)] = fmt("model.%d.weight", idx[k]),
        fmt("model.%d.bias", idx[k])
  end
  map["conv_hr.weight"], map["conv_hr.bias"] = fmt("model.%d.weight", idx[steps + 1]), fmt("model.%d.bias", idx[steps + 1])
  map["conv_last.weight"], map["conv_last.bias"] = fmt("model.%d.weight", idx[steps + 2]),
      fmt("model.%d.bias", idx[steps + 2])
  local last = s[map["conv_last.weight"]]
  return { nf = first[1], in_nc = first[2], out_nc = last[1], nb = nb, gc = gc, steps = steps, layout = "old" }, map
end

-- SRVGGNetCompact: body.0 conv, body.1 PReLU, ..., body.2n+2 the last conv.
local function compact(s)
  local first = util.need_shape(s, "body.0.weight", "the feature width", "SRVGGNetCompact")
  local L = -1
  for name, sh in pairs(s) do
    local i = name:match("^body%.(%d+)%.weight$")
    if i and #sh == 4 then L = math.max(L, tonumber(i)) end
  end
  if L < 2 or L % 2 ~= 0 then error(fmt("SRVGGNetCompact: the last conv is body.%d (expected an even index)", L), 0) end
  for i = 1, L - 1, 2 do
    local a = s[fmt("body.%d.weight", i)]
    if not a or #a ~= 1 then
      error(fmt("SRVGGNetCompact: body.%d.weight (a PReLU's slopes) is missing: only PReLU activations are supported", i), 0)
    end
  end
  local in_nc = first[2]
  local last = s[fmt("body.%d.weight", L)]
  local scale = math.tointeger(math.floor(math.sqrt(last[1] / in_nc) + 0.5))
  if scale * scale * in_nc ~= last[1] then
    error(fmt("SRVGGNetCompact: the last conv has %d outputs, not %d times a square", last[1], in_nc), 0)
  end
  return { nf = first[1], in_nc = in_nc, out_nc = in_nc, nconv = (L - 2) // 2, last = L, scale = scale }
end

-- Names with a common wrapper prefix ("module.", "params_ema.", "params.") lose it.
local function strip_wrapper(shapes)
  for _, p in ipairs({ "module.", "params_ema.", "params." }) do
    local all = next(shapes) ~= nil
    for name in pairs(shapes) do
      if name:sub(1, #p) ~= p then all = false; break end
    end
    if all then return mf.sub(shapes, p), p end
  end
  return shapes, ""
end

--- The architecture of a table of name -> shape: {arch =, config =, map = (canonical ->
-- name in shapes) or nil, prefix =}. Raises naming the architecture it looks like when
-- kiln does not run it.
function M.detect(all_shapes, path)
  local shapes, prefix = strip_wrapper(all_shapes)
  local function try(f)
    local ok, cfg, map = pcall(f, shapes)
    if not ok then fail(path, tostring(cfg)) end
    return cfg, map
  end
  local arch, cfg, map
  if shapes["conv_first.weight"] and shapes["body.0.rdb1.conv1.weight"] then
    arch = "RRDBNet"
    cfg = try(rrdb_new)
  elseif shapes["model.0.weight"] and shapes["model.1.sub.0.RDB1.conv1.0.weight"] then
    arch = "RRDBNet"
    cfg, map = try(rrdb_old)
  elseif not shapes["conv_first.weight"] and shapes["body.0.weight"] and #shapes["body.0.weight"] == 4
      and shapes["body.1.weight"] and #shapes["body.1.weight"] == 1 then
    arch = "SRVGGNetCompact"
    cfg = try(compact)
  else
    local other, example = look_alike(shapes)
    if other then
      fail(path, fmt("this looks like %s (tensors such as '%s'), an architecture kiln does not run; " ..
        "kiln.load_upscaler takes ESRGAN / Real-ESRGAN RRDBNet and Real-ESRGAN compact (SRVGGNetCompact) models",
        other, example))
    end
    local n = 0
    for _ in pairs(shapes) do n = n + 1 end
    fail(path, fmt("not an upscale model kiln knows: none of conv_first + body.0.rdb1 (RRDBNet), model.0 + " ..
      "model.1.sub.0.RDB1 (ESRGAN), body.0 + a PReLU body.1 (SRVGGNetCompact) among its %d tensors", n))
  end
  if arch == "RRDBNet" then
    local ok, r = pcall(unshuffle_of, cfg.in_nc, cfg.out_nc, "RRDBNet")
    if not ok then fail(path, r) end
    cfg.unshuffle = r
    local s = (1 << cfg.steps) // r
    if s * r ~= 1 << cfg.steps then fail(path, fmt("RRDBNet: %d upsampling steps with unshuffle %d", cfg.steps, r)) end
    cfg.scale = s
  else
    cfg.unshuffle = 1
  end
  cfg.image_nc = cfg.in_nc // (cfg.unshuffle * cfg.unshuffle)
  return { arch = arch, config = cfg, map = map, prefix = prefix }
end

-- Every tensor the network reads (canonical names), in first-use order: {name, shape}.
function M.expected(arch, cfg)
  local list = {}
  local function conv(name, cout, cin)
    list[#list + 1] = { name .. ".weight", { cout, cin, 3, 3 } }
    list[#list + 1] = { name .. ".bias", { cout } }
  end
  if arch == "SRVGGNetCompact" then
    conv("body.0", cfg.nf, cfg.in_nc)
    list[#list + 1] = { "body.1.weight", { cfg.nf } }
    for k = 1, cfg.nconv do
      conv(fmt("body.%d", 2 * k), cfg.nf, cfg.nf)
      list[#list + 1] = { fmt("body.%d.weight", 2 * k + 1), { cfg.nf } }
    end
    conv(fmt("body.%d", cfg.last), cfg.out_nc * cfg.scale * cfg.scale, cfg.nf)
    return list
  end
  local nf, gc = cfg.nf, cfg.gc
  conv("conv_first", nf, cfg.in_nc)
  for n = 0, cfg.nb - 1 do
    for r = 1, 3 do
      for c = 1, 5 do
        conv(fmt("body.%d.rdb%d.conv%d", n, r, c), c < 5 and gc or nf, nf + (c - 1) * gc)
      end
    end
  end
  conv("conv_body", nf, nf)
  for k = 1, cfg.steps do conv(fmt("conv_up%d", k), nf, nf) end
  conv("conv_hr", nf, nf)
  conv("conv_last", cfg.out_nc, nf)
  return list
end

-- Streaming blocks: each residual-in-residual block, the head, the tail (compact: one).
function M.block_of(name)
  local n = name:match("^body%.(%d+)%.rdb")
  if n then return "body." .. n .. "." end
  if name:match("^conv_first%.") then return "head." end
  if name:match("^body%.") then return "body." end
  return "tail."
end

function M.new(weights, arch, cfg)
  local self = setmetatable({ weights = weights, config = cfg, arch = arch, scale = cfg.scale }, Upscaler)
  self.streamer = stream.new(weights, stream.blocks(M.expected(arch, cfg), M.block_of), "upscaler")
  return self
end

-- ---------------------------------------------------------------- network

function Upscaler:w(name) return self.weights:tensor(name) end

-- The device the network computes on: the streaming target in mode "low", else where
-- its weights are (the cpu while they are only mapped).
function Upscaler:_device()
  return self.weights:device(self.arch == "SRVGGNetCompact" and "body.0.weight" or "conv_first.weight")
end

-- A 3x3 convolution of the network; act: followed by LeakyReLU 0.2 (done by the op, in
-- place); up: x upsampled 2x (nearest) first, fused with the convolution where it can be.
-- Circular padding on the axes of self.tileable (kiln.seamless).
local function conv(self, name, x, act, up)
  return seamless.conv2d(x, self:w(name .. ".weight"), self:w(name .. ".bias"),
    { padding = 1, leaky_relu = act and 0.2 or nil, upsample = up and 2 or nil }, self.tileable)
end

-- One dense block over x [1, nf, H, W]; buf [1, nf + 4 gc, H, W] holds the input and
-- the four growth outputs side by side, so each conv reads a channel prefix of it (a
-- contiguous view) instead of a concatenation.
local function dense(self, p, x, buf)
  local cfg = self.config
  local nf, gc = cfg.nf, cfg.gc
  local head = buf:narrow(2, 1, nf)
  head:copy(x)
  head:free()
  for c = 1, 4 do
    local inp = buf:narrow(2, 1, nf + (c - 1) * gc)
    local y = conv(self, fmt("%sconv%d", p, c), inp, true)
    inp:free()
    local dst = buf:narrow(2, nf + (c - 1) * gc + 1, gc)
    dst:copy(y)
    dst:free(); y:free()
  end
  local y = conv(self, p .. "conv5", buf)
  local s = y * 0.2
  y:free()
  local r = s + x
  s:free()
  return r
end

-- One residual-in-residual block: three dense blocks, scaled by 0.2, plus its input.
function Upscaler:_rrdb(n, x, buf)
  local h = x
  for r = 1, 3 do
    local o = dense(self, fmt("body.%d.rdb%d.", n, r), h, buf)
    if h ~= x then h:free() end
    h = o
  end
  local s = h * 0.2
  h:free()
  local y = s + x
  s:free()
  return y
end

function Upscaler:_head(x)
  local h = x
  if self.config.unshuffle > 1 then h = M.pixel_unshuffle(x, self.config.unshuffle) end
  local f = conv(self, "conv_first", h)
  if h ~= x then h:free() end
  return f
end

function Upscaler:_tail(feat, trunk)
  local cfg = self.config
  local b = conv(self, "conv_body", trunk)
  local f = feat + b
  b:free()
  for k = 1, cfg.steps do
    local u = conv(self, fmt("conv_up%d", k), f, true, true)
    f:free()
    f = u
  end
  local h = conv(self, "conv_hr", f, true)
  f:free()
  local y = conv(self, "conv_last", h)
  h:free()
  return y
end

function Upscaler:_rrdb_forward(x, pass)
  local cfg = self.config
  local feat = pass:run("head.", self._head, self, x)
  local B, H, W = feat.shape[1], feat.shape[3], feat.shape[4]
  local buf = kiln.empty({ B, cfg.nf + 4 * cfg.gc, H, W }, { dtype = feat.dtype, device = feat.device })
  local h = feat
  local ok, err = pcall(function()
    for n = 0, cfg.nb - 1 do
      local o = pass:run(fmt("body.%d.", n), self._rrdb, self, n, h, buf)
      if h ~= feat then h:free() end
      h = o
    end
  end)
  buf:free()
  if not ok then
    if h ~= feat then h:free() end
    feat:free()
    error(err, 0)
  end
  local y = pass:run("tail.", self._tail, self, feat, h)
  if h ~= feat then h:free() end
  feat:free()
  return y
end

function Upscaler:_compact_body(x)
  local cfg = self.config
  local h = prelu(conv(self, "body.0", x), self:w("body.1.weight"))
  for k = 1, cfg.nconv do
    local o = conv(self, fmt("body.%d", 2 * k), h)
    h:free()
    h = prelu(o, self:w(fmt("body.%d.weight", 2 * k + 1)))
  end
  local o = conv(self, fmt("body.%d", cfg.last), h)
  h:free()
  return o
end

function Upscaler:_compact_forward(x, pass)
  local o = pass:run("body.", self._compact_body, self, x)
  local y = M.pixel_shuffle(o, self.config.scale)
  o:free()
  local base = nn.upsample_nearest(x, self.config.scale)
  local r = y + base
  y:free(); base:free()
  return r
end

--- The bare network on x [B, C, H, W] (C the model's input channels before any
-- unshuffle; H, W multiples of the unshuffle factor) on the model's device and x's
-- dtype: [B, out, sH, sW], unclamped. One image at a time (the dense buffer is per image).
function Upscaler:forward(x)
  local cfg = self.config
  if type(x) ~= "userdata" or #x.shape ~= 4 or x.shape[2] ~= cfg.image_nc then
    error(fmt("upscaler:forward: x must be [B, %d, H, W], got %s", cfg.image_nc,
      type(x) == "userdata" and shape_str(x.shape) or type(x)), 2)
  end
  local u = cfg.unshuffle
  if x.shape[3] % u ~= 0 or x.shape[4] % u ~= 0 then
    error(fmt("upscaler:forward: H and W must be multiples of %d for this model, got %s", u, shape_str(x.shape)), 2)
  end
  local dev = self:_device()
  local xin = x
  if x.device ~= dev then xin = x:to(dev) end
  local outs = {}
  local ok, err = pcall(function()
    for b = 1, x.shape[1] do
      local xb = xin.shape[1] == 1 and xin or xin:narrow(1, b, 1)
      local pass <close> = self.streamer:pass()
      if self.arch == "SRVGGNetCompact" then
        outs[b] = self:_compact_forward(xb, pass)
      else
        outs[b] = self:_rrdb_forward(xb, pass)
      end
      if xb ~= xin then xb:free() end
    end
  end)
  if xin ~= x then xin:free() end
  if not ok then
    for _, o in ipairs(outs) do o:free() end
    error(err, 0)
  end
  if #outs == 1 then return outs[1] end
  local y = kiln.cat(outs, 1)
  for _, o in ipairs(outs) do o:free() end
  return y
end

-- ---------------------------------------------------------------- upscale

-- x padded at the bottom and right to multiples of u (edge pixels repeated; the other
-- side's on a wrapped axis of mode, where the network then sees a period u-rounded: a
-- picture of such a size comes back tiling only nearly), and the pads.
local function pad_to(x, u, mode)
  local ph, pw = (-x.shape[3]) % u, (-x.shape[4]) % u
  if ph == 0 and pw == 0 then return x, 0, 0 end
  local wy, wx = seamless.axes(mode)
  if not wy and not wx then return nn.pad(x, { 0, pw, 0, ph }, "replicate"), ph, pw end
  local c = nn.pad(x, { 0, wx and pw or 0, 0, wy and ph or 0 }, "circular")
  if (wx or pw == 0) and (wy or ph == 0) then return c, ph, pw end
  local r = nn.pad(c, { 0, wx and 0 or pw, 0, wy and 0 or ph }, "replicate")
  c:free()
  return r, ph, pw
end

-- a [B, C, H, W] resized bilinearly by the whole factor s; on the wrapped axes of mode
-- the picture continues across its edges (padded circularly by one pixel, which the
-- resize turns into s, cropped).
local function bilinear_up(a, s, mode)
  local H, W = a.shape[3], a.shape[4]
  local wy, wx = seamless.axes(mode)
  local py, px = wy and 1 or 0, wx and 1 or 0
  if py + px == 0 then return nn.interpolate(a, { size = { s * H, s * W }, mode = "bilinear" }) end
  local p = nn.pad(a, { px, px, py, py }, "circular")
  local r = nn.interpolate(p, { size = { s * (H + 2 * py), s * (W + 2 * px) }, mode = "bilinear" })
  p:free()
  local v = r:narrow(3, s * py + 1, s * H)
  local c = v:narrow(4, s * px + 1, s * W)
  local out = c:contiguous()
  c:free(); v:free(); r:free()
  return out
end

--- img [B, C, H, W] in [0, 1] (C = 3; 4: RGBA, alpha upscaled bilinearly apart; 1: grey,
-- run as RGB) -> [B, 3 or 4, sH, sW] in [0, 1] on img's device. opts (input pixels):
-- tile (default: sized from the free budget of the model's device, else DEFAULT_TILE;
-- false: untiled), overlap (DEFAULT_OVERLAP times the unshuffle factor), min_tile. An
-- out-of-memory error retries with the tile halved; tiles are blended with cosine
-- feathering. H and W need not be multiples of an unshuffle factor (edges are padded).
-- tileable ("x" | "y" | "xy"; default up.tileable): circular padding on those axes and
-- tiles that wrap around (kiln.seamless), for a picture that tiles.
function Upscaler:upscale(img, opts)
  opts = opts or {}
  local mode = seamless.check(opts.tileable == nil and self.tileable or opts.tileable, "upscaler:upscale: tileable")
  local prev = self.tileable
  self.tileable = mode
  local ok, r = pcall(self._upscale, self, img, opts, mode)
  self.tileable = prev
  if not ok then error(r, 0) end
  return r
end

function Upscaler:_upscale(img, opts, mode)
  local cfg = self.config
  if type(img) ~= "userdata" or #img.shape ~= 4 then
    error("upscaler:upscale: img must be a tensor [B, C, H, W]", 2)
  end
  local C = img.shape[2]
  if C ~= 1 and C ~= 3 and C ~= 4 then
    error(fmt("upscaler:upscale: img has %d channels (1 grey, 3 RGB or 4 RGBA expected)", C), 2)
  end
  if cfg.image_nc ~= 3 then
    error(fmt("upscaler:upscale: this model takes %d-channel images (kiln runs RGB models)", cfg.image_nc), 2)
  end
  -- the default overlap is in the network's pixels (after an unshuffle), where its reach is
  local tile, overlap = opts.tile, opts.overlap or M.DEFAULT_OVERLAP * cfg.unshuffle
  if tile ~= nil and tile ~= false and tile ~= "auto" and (math.type(tile) ~= "integer" or tile < 8) then
    error(fmt("upscaler:upscale: tile must be an integer >= 8 (input pixels), \"auto\" or false, got %s",
      tostring(tile)), 2)
  end
  local s, u = cfg.scale, cfg.unshuffle
  -- views and copies made here, freed on the way out (also when the run raises)
  local tmp <close> = setmetatable({}, { __close = function(c) for _, v in ipairs(c) do v:free() end end })
  local function own(v) tmp[#tmp + 1] = v; return v end
  local rgb, alpha = img, nil
  if C == 4 then
    rgb, alpha = own(img:narrow(2, 1, 3)), own(img:narrow(2, 4, 1))
  elseif C == 1 then
    rgb = own(img:expand({ img.shape[1], 3, img.shape[3], img.shape[4] }))
  end
  local H, W = img.shape[3], img.shape[4]
  local x, ph, pw = pad_to(rgb, u, mode)
  if x ~= rgb then own(x) end
  local dev = img.device
  if tile == nil then
    tile = tiling.free_bytes(self:_device()) < math.huge and "auto" or M.DEFAULT_TILE
  end
  local function fn(t)
    local y = self:forward(t)
    if y.device ~= dev then
      local c = y:to(dev)
      y:free()
      y = c
    end
    return y
  end
  local units = tile and tile ~= "auto" and math.max(1, tile // u) or tile or nil
  -- tileable: the tiles wrap around (the input padded circularly by a margin, the tiles
  -- run with zero padding and a halo of a quarter of the overlap, the margin cropped)
  local tiled = mode and function(mo)
    local m = mo.multiple or 1
    local halo = math.max(m, (mo.overlap // 4 + m - 1) // m * m)
    return seamless.map(x, fn, mo, mode, seamless.margin(mo.overlap, m), halo)
  end or nil
  local y = tiling.apply(fn, x, {
    scale = s, unit = u, tile = units, overlap = math.max(1, overlap // u), blend = "cosine",
    min_tile = math.max(1, (opts.min_tile or 16) // u), what = "upscaler:upscale", cache = self, key = "upscale",
    tiled = tiled,
  })
  if ph > 0 or pw > 0 then
    local vh = y:narrow(3, 1, s * H)
    local v = vh:narrow(4, 1, s * W)
    local c = v:contiguous()
    v:free(); vh:free(); y:free()
    y = c
  end
  local out = y:clamp(0, 1)
  y:free()
  if alpha then
    local a = bilinear_up(alpha, s, mode)
    local ac = a:clamp(0, 1)
    a:free()
    local r = kiln.cat({ out, ac }, 2)
    out:free(); ac:free()
    out = r
  end
  return out
end

--- x [B, C, H, W] resized to [B, C, h, w] and clamped to [0, 1]: a box filter when H / h
-- and W / w are the same whole number (a 4x model's output for a 2x target: no
-- aliasing), else bilinear.
function M.resize(x, h, w)
  local H, W, C = x.shape[3], x.shape[4], x.shape[2]
  if H == h and W == w then return x:clamp(0, 1) end
  local r
  if H % h == 0 and W % w == 0 and H // h == W // w then
    local f = H // h
    local k = kiln.full({ C, 1, f, f }, 1 / (f * f), { dtype = x.dtype, device = x.device })
    r = nn.conv2d(x, k, nil, { stride = f, groups = C })
    k:free()
  else
    r = nn.interpolate(x, { size = { h, w }, mode = "bilinear" })
  end
  local c = r:clamp(0, 1)
  r:free()
  return c
end

--- The hires fix's image step: img [B, 3, H, W] through `upscale` (an upscaler from
-- kiln.load_upscaler, or "model:FILE", loaded for this call and closed after), resized
-- to h x w (M.resize). An upscaler not loaded anywhere is loaded to dev for the call and
-- unloaded after; one the caller loaded stays where it is. tileable: the run's mode
-- (Upscaler:upscale's option).
function M.upscale_to(upscale, img, h, w, dev, tileable)
  local up, own = upscale, false
  if type(upscale) == "string" then
    up, own = M.load((upscale:gsub("^model:", ""))), true
  elseif type(upscale) ~= "table" or type(upscale.upscale) ~= "function" then
    error(fmt("hires fix: upscale must be latent-nearest, latent-bilinear, image, \"model:FILE\" or an upscaler " ..
      "(kiln.load_upscaler), got %s", tostring(upscale)), 3)
  end
  local here = own or up.device == nil
  if here then up:load(dev) end
  local ok, big = pcall(up.upscale, up, img, tileable and { tileable = tileable } or nil)
  if here then up:unload() end
  if own then up:close() end
  if not ok then error(big, 0) end
  local r = M.resize(big, h, w)
  big:free()
  return r
end

-- ---------------------------------------------------------------- loading

--- path: a .safetensors upscale model (names with or without a module. / params_ema.
-- wrapper). Returns the upscaler, also a kiln model (load, offload, unload, bytes, close).
function M.load(path)
  if type(path) ~= "string" then error("kiln.load_upscaler: path must be a string, got " .. type(path), 2) end
  local f = io.open(path, "rb")
  if not f then fail(path, "no such file") end
  f:close()
  local shapes = mf.shapes_of((mf.read(path, WHO)))
  local d = M.detect(shapes, path)
  local cfg = d.config
  local map = d.map
  local resolve = function(n) return d.prefix .. (map and map[n] or n) end
  local exp = M.expected(d.arch, cfg)
  mf.validate(path, d.arch .. " upscaler", exp, resolve, shapes, WHO)
  local store = mf.open_store({ path }, mf.names_of(exp, resolve), "upscaler", WHO)
  local full = {}
  if map then for k, v in pairs(map) do full[k] = d.prefix .. v end end
  if d.arch == "RRDBNet" then
    cfg.summary = fmt("RRDBNet x%d (%s layout), %d blocks, %d features, growth %d%s", cfg.scale,
      cfg.layout, cfg.nb, cfg.nf, cfg.gc, cfg.unshuffle > 1 and fmt(", unshuffle %d", cfg.unshuffle) or "")
  else
    cfg.summary = fmt("SRVGGNetCompact x%d, %d convs, %d features", cfg.scale, cfg.nconv + 2, cfg.nf)
  end
  local weights = stream.weights(store, d.prefix, map and full or nil)
  return part.as_model(M.new(weights, d.arch, cfg), store, "Upscaler")
end

return M
