-- kiln.taesd: TAESD / TAESDXL, the tiny autoencoder of Stable Diffusion's latents (a
-- stack of 3x3 convolutions and ReLU residual blocks, no normalization, no attention),
-- as the files users download: taesd_decoder.safetensors, taesd_encoder.safetensors,
-- taesdxl_*.safetensors, whose names are the indices of two nn.Sequential stacks
-- (decoder: 0 soft clamp, 1 conv, 2 ReLU, 3-5 blocks, 6 upsample, 7 conv, ...).
--
--   local t = kiln.load_taesd{decoder = path, encoder = path}   -- either may be missing
--   local img = t:decode(z)      -- z: latents as samplers produce them (the scaled ones)
--   local z = t:encode(img)      -- images [B, 3, H, W] in [0, 1] -> scaled latents
--
-- TAESD works on the same scaled latents as vae:decode / vae:encode (ComfyUI feeds it
-- its latents times the family's scale factor), so it stands in for the checkpoint's
-- VAE: a fast, low-memory decoder (taesd.attach, `vae = "taesd"`) and the previews'
-- second previewer (kiln.preview). Both halves are kiln.Models (load, offload, unload,
-- budgets, streaming in mode "low"), one per file. `t.tileable = "x" | "y" | "xy"` pads
-- its convolutions circularly (kiln.seamless; pipelines set it for tileable runs), and
-- its tiled runs wrap around.
local kiln = require "kiln"
local lfs = require "lfs"
local stream = require "kiln.stream"
local tiling = require "kiln.tiling"
local seamless = require "kiln.seamless"
local util = require "kiln.util"
local mf = require "kiln.model_files"
local families = require "kiln.family"
local nn = kiln.nn

local M = {}
local fmt = string.format

local TAESD = {}
TAESD.__index = TAESD
M.TAESD = TAESD

local WHO = "kiln.load_taesd"
local function fail(path, msg) util.file_error(WHO, path, msg) end

-- ---------------------------------------------------------------- architecture

-- The published stacks, one entry per nn.Sequential index (0-based as in the files):
-- "clamp" (3 tanh(x / 3)), "relu", "up" (nearest 2x, fused into the next convolution),
-- {conv = cin/cout roles, bias, stride} and "block" (3 convolutions and a skip).
-- Widths are read from the file (the published width is 64); L is the latent channels.
local function decoder_layers()
  local l = { "clamp", { conv = { "L", "w" }, bias = true }, "relu" }
  for _ = 1, 3 do
    for _ = 1, 3 do l[#l + 1] = "block" end
    l[#l + 1] = "up"
    l[#l + 1] = { conv = { "w", "w" }, bias = false }
  end
  l[#l + 1] = "block"
  l[#l + 1] = { conv = { "w", 3 }, bias = true }
  return l
end

local function encoder_layers()
  local l = { { conv = { 3, "w" }, bias = true }, "block" }
  for _ = 1, 3 do
    l[#l + 1] = { conv = { "w", "w" }, bias = false, stride = 2 }
    for _ = 1, 3 do l[#l + 1] = "block" end
  end
  l[#l + 1] = { conv = { "w", "L" }, bias = true }
  return l
end
M.decoder_layers, M.encoder_layers = decoder_layers, encoder_layers

-- Every tensor a half reads, as {name, shape}, for width w and L latent channels.
function M.expected(layers, w, L)
  local list = {}
  local function dim(d) return d == "w" and w or d == "L" and L or d end
  for i, e in ipairs(layers) do
    local p = tostring(i - 1)
    if e == "block" then
      for _, k in ipairs({ 0, 2, 4 }) do
        list[#list + 1] = { fmt("%s.conv.%d.weight", p, k), { w, w, 3, 3 } }
        list[#list + 1] = { fmt("%s.conv.%d.bias", p, k), { w } }
      end
    elseif type(e) == "table" then
      local cin, cout = dim(e.conv[1]), dim(e.conv[2])
      list[#list + 1] = { p .. ".weight", { cout, cin, 3, 3 } }
      if e.bias then list[#list + 1] = { p .. ".bias", { cout } } end
    end
  end
  return list
end

-- Which half a file's shapes (names without a prefix) hold: "decoder", "encoder" or nil,
-- with the width and latent channels.
function M.kind(shapes)
  local d, e = shapes["1.weight"], shapes["0.weight"]
  if d and #d == 4 and shapes["3.conv.0.weight"] and shapes["19.weight"] then
    return "decoder", d[1], d[2]
  end
  if e and #e == 4 and e[2] == 3 and shapes["1.conv.0.weight"] and shapes["14.weight"] then
    return "encoder", e[1], shapes["14.weight"][1]
  end
  return nil
end

-- The prefix a half's names carry in a file: "" as published, or ComfyUI's
-- "taesd_decoder." / "taesd_encoder." (both halves in one file), or "decoder." /
-- "encoder.". Returns prefix, sub-shapes, kind, width, latent channels.
local function find_half(shapes, want)
  for _, p in ipairs({ "", "taesd_" .. want .. ".", want .. "." }) do
    local sub = p == "" and shapes or mf.sub(shapes, p)
    local kind, w, L = M.kind(sub)
    if kind == want then return p, sub, kind, w, L end
  end
  return nil
end

-- What a file that is not the wanted TAESD half looks like, for the error.
local function describe(shapes, want)
  local n, some = 0, {}
  for name in pairs(shapes) do
    n = n + 1
    if #some < 3 then some[#some + 1] = name end
  end
  table.sort(some)
  local other = want == "decoder" and "encoder" or "decoder"
  if find_half(shapes, other) then
    return fmt("this is a TAESD %s, not a %s (give it as %s = path)", other, want, other)
  end
  if shapes["decoder.conv_in.weight"] or shapes["encoder.conv_in.weight"] or shapes["first_stage_model.decoder.conv_in.weight"] then
    return "this is a full VAE (encoder.conv_in / decoder.conv_in), not a TAESD; load it with kiln.load_checkpoint{vae = path}"
  end
  return fmt("not a TAESD %s: no %s among its %d tensors (%s...)", want,
    want == "decoder" and "1.weight, 3.conv.0.weight, 19.weight" or "0.weight, 1.conv.0.weight, 14.weight", n,
    table.concat(some, ", "))
end

-- ---------------------------------------------------------------- one half

-- The streaming block of a name: its index in the stack ("3." for 3.conv.0.weight).
local function block_of(name) return name:match("^(%d+%.)") end

-- Opens one half from a file: {layers, weights, streamer, model, width, latent, path}.
local function open_half(path, want)
  if type(path) ~= "string" then fail(nil, fmt("%s must be a file name, got %s", want, type(path))) end
  local shapes = mf.shapes_of((mf.read(path, WHO)))
  local prefix, _, _, w, L = find_half(shapes, want)
  if not prefix then fail(path, describe(shapes, want)) end
  local layers = want == "decoder" and decoder_layers() or encoder_layers()
  local exp = M.expected(layers, w, L)
  local resolve = function(n) return prefix .. n end
  mf.validate(path, "TAESD " .. want, exp, resolve, shapes, WHO)
  local store = mf.open_store({ path }, mf.names_of(exp, resolve), "taesd_" .. want, WHO)
  local weights = stream.weights(store, prefix)
  local order = {}
  for i = 1, #layers do
    if type(layers[i]) == "table" or layers[i] == "block" then order[#order + 1] = (i - 1) .. "." end
  end
  return {
    layers = layers, weights = weights, model = store, width = w, latent = L, path = path, order = order,
    probe = exp[1][1],
    streamer = stream.new(weights, stream.blocks(exp, block_of), "taesd " .. want),
  }
end

-- A 3x3 convolution (padding 1, stride 1) to a few output channels (the decoder's last,
-- to RGB) as one 1x1 convolution to the 9 taps' outputs side by side and a sum of
-- their 9 shifted views: the 1x1 is a plain GEMM, where the CPU's direct path for a 3x3
-- convolution to <= 4 channels is the slower at full image size.
-- Circular on the wrapped axes of mode, as seamless.conv2d.
local function conv_few(x, w, b, mode)
  local K, C = w.shape[1], w.shape[2]
  local wp = w:permute({ 3, 4, 1, 2 })      -- [ky, kx, K, C]: row (3 ky + kx) K + k
  local wc = wp:contiguous()
  wp:free()
  local w1 = wc:reshape({ 9 * K, C, 1, 1 })
  wc:free()
  local b1
  if b then -- the bias rides on the centre tap's outputs
    local z = kiln.zeros({ 4 * K }, { dtype = b.dtype, device = b.device })
    b1 = kiln.cat({ z, b, z }, 1)
    z:free()
  end
  local ok, p = pcall(nn.conv2d, x, w1, b1)
  w1:free()
  if b1 then b1:free() end
  if not ok then error(p, 0) end
  local pp = seamless.pad(p, { 1, 1, 1, 1 }, mode)
  p:free()
  local H, W = x.shape[3], x.shape[4]
  local out
  for ky = 0, 2 do
    for kx = 0, 2 do
      local a = pp:narrow(2, (3 * ky + kx) * K + 1, K)
      local r = a:narrow(3, ky + 1, H)
      local v = r:narrow(4, kx + 1, W)
      if out then
        local s = out + v
        out:free()
        out = s
      else
        out = v:contiguous()
      end
      v:free(); r:free(); a:free()
    end
  end
  pp:free()
  return out
end
M.conv_few = conv_few

-- Runs a half's stack over x (not freed); returns a new tensor. ReLU is the unary op
-- (x:relu()), not x:maximum(0): the binary op's CPU loop, which reads a second operand
-- or a scalar per element, is the slower of the two at these sizes (the full-size
-- stage moves 64 channels of 512x512 floats through it). The upsampling before a
-- convolution is fused into it (conv2d's upsample option).
-- mode: the tileable mode (circular padding on those axes; nil: zeros).
local function run_half(half, x, mode)
  local wts = half.weights
  local function W(name) return wts:tensor(name) end
  local function conv(h, p, o) return seamless.conv2d(h, W(p .. ".weight"), W(p .. ".bias"), o, mode) end
  local h = x
  local function set(r)
    if h ~= x then h:free() end
    h = r
  end
  local up = 1
  local pass <close> = half.streamer:pass(half.order)
  for i, e in ipairs(half.layers) do
    local p = tostring(i - 1)
    if e == "clamp" then
      local a = h * (1 / 3)
      local t = a:tanh()
      a:free()
      set(t * 3)
      t:free()
    elseif e == "relu" then
      set(h:relu())
    elseif e == "up" then
      up = 2
    elseif e == "block" then
      set(pass:run(p .. ".", function()
        -- the ReLUs after the first two convolutions run inside them (leaky_relu = 0)
        local b = conv(h, p .. ".conv.0", { padding = 1, leaky_relu = 0 })
        local a = conv(b, p .. ".conv.2", { padding = 1, leaky_relu = 0 })
        b:free()
        -- relu(conv(a) + h) in the convolution too: the skip is the identity at the
        -- published (equal) widths
        b = conv(a, p .. ".conv.4", { padding = 1, residual = h, leaky_relu = 0 })
        a:free()
        return b
      end))
    else
      set(pass:run(p .. ".", function()
        local wt = W(p .. ".weight")
        local bt = e.bias and W(p .. ".bias") or nil
        -- (the CPU kernels' choice: on CUDA the convolution library's direct path is kept)
        if wt.shape[1] <= 4 and up == 1 and (e.stride or 1) == 1 and wt.shape[2] >= 16
            and not h.device:match("^cuda") then
          return conv_few(h, wt, bt, seamless.active(mode))
        end
        return seamless.conv2d(h, wt, bt, { padding = 1, stride = e.stride or 1, upsample = up }, mode)
      end))
      up = 1
    end
  end
  return h
end

-- The device a half computes on (the streaming target in mode "low").
local function device_of(half) return half.weights:device(half.probe) end

-- ---------------------------------------------------------------- the object

local shape_str = util.shape_str

-- The networks' untiled calls, as kiln.tiling expects them (VAE:_decode_untiled's
-- contract): scaled latents -> images in [0, 1], and back.
function TAESD:_decode_untiled(z)
  local half = self.decoder_half
  local dev = device_of(half)
  local zd = z.device ~= dev and z:to(dev) or nil
  local raw = run_half(half, zd or z, self.tileable)
  if zd then zd:free() end
  local img = raw:clamp(0, 1)
  raw:free()
  return img
end

function TAESD:_encode_untiled(img)
  local half = self.encoder_half
  local dev = device_of(half)
  local x = img.device ~= dev and img:to(dev) or nil
  local z = run_half(half, x or img, self.tileable)
  if x then x:free() end
  return z
end

-- kiln.tiling's hooks for a tiled run (mo: kiln.tile.map options): the plain map, or
-- while tileable the map that wraps around (kiln.seamless.map: the input padded
-- circularly by a margin, the tiles run with zero padding and a halo of WRAP_HALO
-- latent pixels of context, the margin cropped).
local WRAP_HALO = 2
local function map(self, x, fn, mo)
  local mode = seamless.active(self.tileable)
  if not mode then return kiln.tile.map(x, fn, mo) end
  local unit = mo.multiple or 1
  return seamless.map(x, fn, mo, mode, seamless.margin(mo.overlap, unit), WRAP_HALO * unit)
end

function TAESD:_decode_tiles(z, mo)
  return map(self, z, function(t) return self:_decode_untiled(t) end, mo)
end

function TAESD:_encode_tiles(img, mo)
  return map(self, img, function(t) return self:_encode_untiled(t) end, mo)
end

-- z [B, L, h, w] (latents as samplers produce them) -> images [B, 3, 8h, 8w] clamped
-- to [0, 1]. opts: {tile = T | "auto", overlap = O} in latent units, as vae:decode (no
-- normalization inside: tiles need no shared statistics); an untiled call that runs
-- out of memory retries tiled.
function TAESD:decode(z, opts)
  if not self.decoder_half then
    error("taesd:decode: this TAESD has no decoder (kiln.load_taesd{decoder = path})", 2)
  end
  local L = self.latent_channels
  if type(z) ~= "userdata" or #z.shape ~= 4 or z.shape[2] ~= L then
    error(fmt("taesd:decode: z must be [B, %d, h, w], got %s", L, type(z) == "userdata" and shape_str(z) or type(z)), 2)
  end
  return (tiling.decode(self, z, opts))
end

-- img [B, 3, H, W] in [0, 1] (H, W multiples of 8) -> scaled latents [B, L, H/8, W/8].
function TAESD:encode(img, opts)
  if not self.encoder_half then
    error("taesd:encode: this TAESD has no encoder (kiln.load_taesd{encoder = path}: taesd_encoder.safetensors)", 2)
  end
  if type(img) ~= "userdata" or #img.shape ~= 4 or (img.shape[2] ~= 3 and img.shape[2] ~= 4) then
    error(fmt("taesd:encode: image must be [B, 3, H, W], got %s", type(img) == "userdata" and shape_str(img) or type(img)), 2)
  end
  if img.shape[3] % 8 ~= 0 or img.shape[4] % 8 ~= 0 then
    error(fmt("taesd:encode: image size %dx%d must be a multiple of 8", img.shape[4], img.shape[3]), 2)
  end
  local rgb = img.shape[2] == 4 and img:narrow(2, 1, 3):contiguous() or img
  local z = tiling.encode(self, rgb, opts)
  if rgb ~= img then rgb:free() end
  return z
end

-- The model side: both halves' kiln.Models together.
local function halves(self)
  local l = {}
  if self.decoder_half then l[#l + 1] = self.decoder_half.model end
  if self.encoder_half then l[#l + 1] = self.encoder_half.model end
  return l
end

function TAESD:load(dev, o)
  for _, m in ipairs(halves(self)) do m:load(dev, o) end
  return self
end
function TAESD:offload()
  for _, m in ipairs(halves(self)) do m:offload() end
  return self
end
function TAESD:unload()
  for _, m in ipairs(halves(self)) do m:unload() end
  return self
end
function TAESD:pin()
  for _, m in ipairs(halves(self)) do m:pin() end
  return self
end
function TAESD:unpin()
  for _, m in ipairs(halves(self)) do m:unpin() end
  return self
end
function TAESD:bytes(dev)
  local n = 0
  for _, m in ipairs(halves(self)) do n = n + m:bytes(dev) end
  return n
end
function TAESD:close()
  for _, m in ipairs(halves(self)) do m:close() end
end
-- The streamed weights' bytes on the device during a decode (0: not streamed), the
-- planner's question to a VAE: kiln.stream's prefetch window over the decoder's blocks.
function TAESD:stream_bytes()
  local half = self.decoder_half or self.encoder_half
  local w = half.weights
  if not w:streaming() then return 0 end
  local _, window = half.streamer:_sizes(w:model())
  return window
end

TAESD.__close = TAESD.close
TAESD.__name = "kiln.TAESD"
function TAESD.__tostring(t)
  local parts = {}
  if t.decoder_half then parts[#parts + 1] = "decoder " .. t.decoder_half.path end
  if t.encoder_half then parts[#parts + 1] = "encoder " .. t.encoder_half.path end
  return fmt("TAESD(width %d, %d latent channels; %s)", t.width, t.latent_channels, table.concat(parts, ", "))
end

-- kiln.load_taesd{decoder = path, encoder = path} (or a decoder path alone) -> a TAESD.
-- Either half may be missing, not both; their latent channels must agree.
function M.load(opts)
  if type(opts) == "string" then opts = { decoder = opts } end
  if type(opts) ~= "table" then
    error("kiln.load_taesd: expected {decoder = path, encoder = path} or a decoder path, got " .. type(opts), 2)
  end
  for k in pairs(opts) do
    if k ~= "decoder" and k ~= "encoder" then
      error(fmt("kiln.load_taesd: unknown option '%s' (known: decoder, encoder)", tostring(k)), 2)
    end
  end
  if not opts.decoder and not opts.encoder then error("kiln.load_taesd: give decoder = path and/or encoder = path", 2) end
  local dec = opts.decoder and open_half(opts.decoder, "decoder")
  local enc = opts.encoder and open_half(opts.encoder, "encoder")
  if dec and enc and dec.latent ~= enc.latent then
    dec.model:close(); enc.model:close()
    fail(nil, fmt("the decoder '%s' takes %d latent channels, the encoder '%s' makes %d", dec.path, dec.latent,
      enc.path, enc.latent))
  end
  local any = dec or enc
  local t = setmetatable({
    decoder_half = dec, encoder_half = enc, latent_channels = any.latent, width = any.width,
    factor = 8, is_taesd = true, path = any.path,
  }, TAESD)
  t.config = { factor = 8, embed_dim = any.latent, z_channels = any.latent,
    summary = fmt("width %d, %d latent channels", any.width, any.latent) }
  return t
end

-- ---------------------------------------------------------------- beside a checkpoint

-- The file names of a family's TAESD (its `taesd` field, as madebyollin/taesd and
-- ComfyUI's vae_approx folder name them).
local function stem_of(name)
  local def = families.get(name)
  return def and def.taesd or "taesd"
end

local function dirname(p) return p:match("^(.*)/[^/]*$") or "." end
local function exists(p) return lfs.attributes(p, "mode") == "file" end

-- The folders a checkpoint's TAESD is looked for in, in order: beside the checkpoint,
-- its vae_approx/ folder, and ComfyUI's models layout (models/checkpoints/x.safetensors
-- beside models/vae_approx/); then $KILN_VAE_APPROX.
function M.search_dirs(ckpt_path)
  local d = ckpt_path and dirname((ckpt_path:gsub("/+$", ""))) or "."
  local list = { d, d .. "/vae_approx", dirname(d) .. "/vae_approx" }
  local env = os.getenv("KILN_VAE_APPROX")
  if env and env ~= "" then list[#list + 1] = env end
  return list
end

-- Finds and loads the TAESD of a checkpoint (its family's file names in
-- M.search_dirs); the encoder is optional. Raises, listing where it looked, when no
-- decoder is found.
function M.find(ckpt)
  local stem = stem_of(ckpt.family)
  local looked = {}
  for _, d in ipairs(M.search_dirs(ckpt.path)) do
    local dec = d .. "/" .. stem .. "_decoder.safetensors"
    looked[#looked + 1] = dec
    if exists(dec) then
      local enc = d .. "/" .. stem .. "_encoder.safetensors"
      return M.load({ decoder = dec, encoder = exists(enc) and enc or nil })
    end
  end
  error(fmt("kiln: vae = \"taesd\": no %s_decoder.safetensors found for the %s checkpoint (looked at %s); "
    .. "download it from madebyollin/taesd or give a path", stem, tostring(ckpt.family), table.concat(looked, ", ")), 0)
end

-- Is this file a TAESD half (for `vae = path`)?
function M.is_file(path)
  if type(path) ~= "string" or not exists(path) then return false end
  local ok, tensors = pcall(kiln.load_safetensors, path)
  if not ok then return false end
  local shapes = {}
  for k, v in pairs(tensors) do shapes[k] = v.shape end
  return (find_half(shapes, "decoder") or find_half(shapes, "encoder")) ~= nil
end

-- A checkpoint's `vae` option or a pipeline's made into a TAESD: "taesd" (found beside
-- the checkpoint), a TAESD file (decoder or encoder; its other half beside it), or a
-- TAESD object. Checks its latent channels against the checkpoint's. Returns the
-- TAESD and whether this call opened it (the caller then owns it).
function M.resolve(ckpt, v, want_channels)
  local t, opened = nil, false
  if type(v) == "table" and v.is_taesd then
    t = v
  elseif v == "taesd" then
    t, opened = M.find(ckpt), true
  elseif type(v) == "string" then
    local dir, base = dirname(v), v:match("[^/]*$")
    local other = base:gsub("_decoder", "_encoder")
    if other == base then other = base:gsub("_encoder", "_decoder") end
    local o = other ~= base and exists(dir .. "/" .. other) and dir .. "/" .. other or nil
    local ok, dec_first = pcall(M.load, { decoder = v, encoder = o })
    if ok then t = dec_first
    else
      local ok2, enc_first = pcall(M.load, { encoder = v, decoder = o })
      if not ok2 then error(dec_first, 0) end
      t = enc_first
    end
    opened = true
  else
    error("kiln: vae must be \"taesd\", a TAESD file or a kiln.load_taesd object, got " .. type(v), 3)
  end
  want_channels = want_channels or 4
  if t.latent_channels ~= want_channels then
    local msg = fmt("kiln: the TAESD '%s' takes %d latent channels, but the %s checkpoint's latents have %d "
      .. "(a TAESD of another model family: taesd_* is SD 1.x/2.x, taesdxl_* SDXL, taesd3_*/taef1_* 16-channel models)",
      t.path, t.latent_channels, tostring(ckpt.family), want_channels)
    if opened then t:close() end
    error(msg, 0)
  end
  return t, opened
end

-- The TAESD a value names for a checkpoint, opened once per checkpoint and value
-- (kept with the checkpoint; a TAESD object is the caller's).
function M.cached(ckpt, v)
  if type(v) == "table" then return (M.resolve(ckpt, v, M.channels(ckpt))) end
  local cache = rawget(ckpt, "_taesd")
  if not cache then
    cache = {}
    rawset(ckpt, "_taesd", cache)
  end
  if not cache[v] then cache[v] = M.resolve(ckpt, v, M.channels(ckpt)) end
  return cache[v]
end

-- The latent channels of a checkpoint's latents.
function M.channels(ckpt)
  local vae = rawget(ckpt, "vae")
  return vae and vae.latent_channels or 4
end

-- A pipeline's `vae` option for one run: the TAESD takes the checkpoint's VAE's place
-- until the result is closed (nil when the checkpoint's VAE already is that TAESD).
function M.swap(ckpt, v)
  local cur = rawget(ckpt, "vae")
  if cur and cur.is_taesd and (v == "taesd" or v == cur or v == cur.path) then return nil end
  local t = M.cached(ckpt, v)
  t.scale_factor = cur and cur.scale_factor or ckpt.scale_factor
  rawset(ckpt, "vae", t)
  return setmetatable({}, { __close = function()
    t:unload()
    rawset(ckpt, "vae", cur)
  end })
end

-- Makes a TAESD the checkpoint's VAE (closing the one it had): ckpt.vae:decode /
-- encode then run TAESD. Returns ckpt.
function M.attach(ckpt, v)
  local old = rawget(ckpt, "vae")
  local want = old and old.latent_channels or 4
  local t, opened = M.resolve(ckpt, v, want)
  t.scale_factor, t.shift_factor = old and old.scale_factor or ckpt.scale_factor, 0
  if old and old ~= t and old.close then old:close() end
  -- the caller's object stays the caller's: ckpt:close() leaves it open
  if not opened then t = setmetatable({ close = function() end }, { __index = t, __close = function() end }) end
  rawset(ckpt, "vae", t)
  return ckpt
end

return M
