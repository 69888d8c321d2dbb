-- kiln.vae: the AutoencoderKL of Stable Diffusion (LDM's Encoder / Decoder with the
-- mid-block attention, quant_conv / post_quant_conv), over kiln.nn; also Black Forest
-- Labs' 16-channel autoencoder of Flux (the same network without quant_conv /
-- post_quant_conv: cfg.quant false), latents (z - shift) * scale as its AutoEncoder.
--   vae:decode(z [, {tile=, overlap=, mid=}])  latents as samplers produce them
--       (already times the scale factor) -> images [B, 3, f*h, f*w] in [0, 1]; tiled
--       decodes match the untiled one (image-wide GroupNorm, kiln.lockstep)
--   vae:encode(img [, {tile=, overlap=}]) images in [0, 1] -> posterior mode * scale
--   vae.tileable = "x" | "y" | "xy"  circular padding (kiln.seamless), tiled runs wrap too
-- The architecture is read from the tensors (vae.config); vae.expected(cfg) lists the
-- tensors with their shapes.
local kiln = require "kiln"
local util = require "kiln.util"
local stream = require "kiln.stream"
local tiling = require "kiln.tiling"
local lockstep = require "kiln.lockstep"
local seamless = require "kiln.seamless"
local nn = kiln.nn

local M = {}
local VAE = {}
VAE.__index = VAE
M.VAE = VAE

local fmt = string.format

local count_indices = util.count_indices

local function need(shapes, name, what) return util.need_shape(shapes, name, what, "VAE") end

-- Half activations: under a half precision on a GPU the layers run in f16 / bf16
-- (kiln.activation_dtype of the device); the network's input is converted at its entry
-- and its output (and the tiles before they are blended) back to f32.
-- x in the activation dtype of dev: a new tensor, or nil when x keeps its dtype.
local function to_act(x, dev)
  local dt = kiln.activation_dtype(dev)
  if dt == "f32" or x.dtype == dt then return nil end
  return x:to(dt)
end

-- t (freed) as f32
local function to_f32(t)
  if t.dtype == "f32" then return t end
  local r = t:to("f32")
  t:free()
  return r
end

-- name -> shape (relative to the VAE root: "encoder.conv_in.weight") -> architecture.
-- opts: scale_factor, shift_factor.
function M.config(shapes, opts)
  opts = opts or {}
  local cfg = {}
  local has_enc, has_dec = shapes["encoder.conv_in.weight"] ~= nil, shapes["decoder.conv_in.weight"] ~= nil
  cfg.has_encoder, cfg.has_decoder = has_enc, has_dec
  if not has_enc and not has_dec then error("VAE: neither encoder.conv_in.weight nor decoder.conv_in.weight found", 0) end
  if has_dec then
    local s = need(shapes, "decoder.conv_in.weight", "z_channels")
    cfg.z_channels = s[2]
    cfg.levels = count_indices(shapes, "^decoder%.up%.(%d+)%.")
    cfg.num_res_blocks = count_indices(shapes, "^decoder%.up%.0%.block%.(%d+)%.") - 1
    cfg.out_ch = need(shapes, "decoder.conv_out.weight", "out_ch")[1]
    local ch = need(shapes, "decoder.conv_out.weight", "ch")[2]
    cfg.ch = ch
    cfg.ch_mult = {}
    for i = 0, cfg.levels - 1 do
      cfg.ch_mult[i + 1] = need(shapes, fmt("decoder.up.%d.block.0.conv1.weight", i), "ch_mult")[1] // ch
    end
    -- no post_quant_conv (BFL's Flux autoencoder): the latent is conv_in's input
    local pq = shapes["post_quant_conv.weight"]
    cfg.quant = pq ~= nil
    cfg.embed_dim = pq and pq[2] or cfg.z_channels
  end
  if has_enc then
    local s = need(shapes, "encoder.conv_in.weight", "ch")
    cfg.ch = cfg.ch or s[1]
    cfg.in_channels = s[2]
    local levels = count_indices(shapes, "^encoder%.down%.(%d+)%.")
    local nrb = count_indices(shapes, "^encoder%.down%.0%.block%.(%d+)%.")
    if cfg.levels and (levels ~= cfg.levels or nrb ~= cfg.num_res_blocks) then
      error(fmt("VAE: encoder has %d levels x %d blocks, decoder %d x %d", levels, nrb, cfg.levels, cfg.num_res_blocks + 1), 0)
    end
    cfg.levels, cfg.num_res_blocks = levels, nrb
    if not cfg.ch_mult then
      cfg.ch_mult = {}
      for i = 0, levels - 1 do
        cfg.ch_mult[i + 1] = need(shapes, fmt("encoder.down.%d.block.0.conv1.weight", i), "ch_mult")[1] // cfg.ch
      end
    end
    cfg.z_channels = cfg.z_channels or need(shapes, "encoder.conv_out.weight", "z_channels")[1] // 2
    local q = shapes["quant_conv.weight"]
    if cfg.quant ~= nil and cfg.quant ~= (q ~= nil) then
      error("VAE: quant_conv and post_quant_conv must both be there or both be absent", 0)
    end
    cfg.quant = q ~= nil
    cfg.embed_dim = cfg.embed_dim or (q and q[1] // 2) or cfg.z_channels
  end
  cfg.in_channels = cfg.in_channels or 3
  cfg.out_ch = cfg.out_ch or 3
  cfg.factor = 2 ^ (cfg.levels - 1) // 1
  cfg.scale_factor = opts.scale_factor or 0.18215
  cfg.shift_factor = opts.shift_factor or 0
  return cfg
end

-- Every tensor the network reads: a list of {name, shape}.
function M.expected(cfg)
  local list = {}
  local function add(name, shape) list[#list + 1] = { name, shape } end
  local function conv(p, cout, cin, k) add(p .. ".weight", { cout, cin, k, k }); add(p .. ".bias", { cout }) end
  local function norm(p, c) add(p .. ".weight", { c }); add(p .. ".bias", { c }) end
  local function res(p, cin, cout)
    norm(p .. ".norm1", cin); conv(p .. ".conv1", cout, cin, 3)
    norm(p .. ".norm2", cout); conv(p .. ".conv2", cout, cout, 3)
    if cin ~= cout then conv(p .. ".nin_shortcut", cout, cin, 1) end
  end
  local function attn(p, c)
    norm(p .. ".norm", c)
    for _, n in ipairs({ "q", "k", "v", "proj_out" }) do conv(p .. "." .. n, c, c, 1) end
  end
  local ch, mult, nrb = cfg.ch, cfg.ch_mult, cfg.num_res_blocks
  local top = ch * mult[#mult]
  if cfg.has_encoder then
    conv("encoder.conv_in", ch, cfg.in_channels, 3)
    local cin = ch
    for i = 0, cfg.levels - 1 do
      for j = 0, nrb - 1 do
        res(fmt("encoder.down.%d.block.%d", i, j), cin, ch * mult[i + 1])
        cin = ch * mult[i + 1]
      end
      if i ~= cfg.levels - 1 then conv(fmt("encoder.down.%d.downsample.conv", i), cin, cin, 3) end
    end
    res("encoder.mid.block_1", top, top); attn("encoder.mid.attn_1", top); res("encoder.mid.block_2", top, top)
    norm("encoder.norm_out", top); conv("encoder.conv_out", 2 * cfg.z_channels, top, 3)
    if cfg.quant then conv("quant_conv", 2 * cfg.embed_dim, 2 * cfg.z_channels, 1) end
  end
  if cfg.has_decoder then
    if cfg.quant then conv("post_quant_conv", cfg.z_channels, cfg.embed_dim, 1) end
    conv("decoder.conv_in", top, cfg.z_channels, 3)
    res("decoder.mid.block_1", top, top); attn("decoder.mid.attn_1", top); res("decoder.mid.block_2", top, top)
    local cin = top
    for i = cfg.levels - 1, 0, -1 do
      for j = 0, nrb do
        res(fmt("decoder.up.%d.block.%d", i, j), cin, ch * mult[i + 1])
        cin = ch * mult[i + 1]
      end
      if i ~= 0 then conv(fmt("decoder.up.%d.upsample.conv", i), cin, cin, 3) end
    end
    norm("decoder.norm_out", ch * mult[1]); conv("decoder.conv_out", cfg.out_ch, ch * mult[1], 3)
  end
  return list
end

-- ---------------------------------------------------------------- network

-- The streaming block a tensor belongs to (its name relative to the VAE root):
-- "decoder.in" (post_quant_conv, decoder.conv_in), "decoder.mid.", "decoder.up.N.",
-- "decoder.out" (norm_out, conv_out), and the encoder's "encoder.in",
-- "encoder.down.N.", "encoder.mid.", "encoder.out" (with quant_conv).
function M.block_of(name)
  local k = name:match("^(decoder%.up%.%d+%.)") or name:match("^(encoder%.down%.%d+%.)") or
      name:match("^(decoder%.mid%.)") or name:match("^(encoder%.mid%.)")
  if k then return k end
  if name:match("^post_quant_conv%.") or name:match("^decoder%.conv_in%.") then return "decoder.in" end
  if name:match("^decoder%.norm_out%.") or name:match("^decoder%.conv_out%.") then return "decoder.out" end
  if name:match("^encoder%.conv_in%.") then return "encoder.in" end
  if name:match("^encoder%.norm_out%.") or name:match("^encoder%.conv_out%.") or name:match("^quant_conv%.") then
    return "encoder.out"
  end
  return nil
end

function M.new(weights, cfg)
  local self = setmetatable({ weights = weights, config = cfg }, VAE)
  self.streamer = stream.new(weights, stream.blocks(M.expected(cfg), M.block_of), "vae")
  if cfg.has_decoder then
    local o, tail = { "decoder.in", "decoder.mid." }, {}
    for i = cfg.levels - 1, 0, -1 do tail[#tail + 1] = fmt("decoder.up.%d.", i) end
    tail[#tail + 1] = "decoder.out"
    self.decode_head_order, self.decode_tail_order = { o[1], o[2] }, tail
    for _, k in ipairs(tail) do o[#o + 1] = k end
    self.decode_order = o
  end
  if cfg.has_encoder then
    local o = { "encoder.in" }
    for i = 0, cfg.levels - 1 do o[#o + 1] = fmt("encoder.down.%d.", i) end
    local head = {}
    for i, k in ipairs(o) do head[i] = k end
    o[#o + 1] = "encoder.mid."
    o[#o + 1] = "encoder.out"
    self.encode_order, self.encode_head_order, self.encode_tail_order = o, head, { "encoder.mid.", "encoder.out" }
  end
  return self
end

function VAE:w(name) return self.weights:tensor(name) end

-- The device the network runs on (the streaming target in mode "low").
function VAE:_device(probe)
  local w = self.weights
  if w.device then return w:device(probe) end
  local t = w:tensor(probe)
  return t.device
end

-- Bytes the streamed weights take on the device at most during a pass (kiln.stream's
-- prefetch window: the two largest adjacent blocks), 0 when they are not streamed.
function VAE:stream_bytes()
  local w = self.weights
  if not (w.streaming and w:streaming()) then return 0 end
  local _, window = self.streamer:_sizes(w:model())
  return window
end

-- padded convolutions are circular on the axes of self.tileable (kiln.seamless)
local function conv(self, p, x, opts)
  return seamless.conv2d(x, self:w(p .. ".weight"), self:w(p .. ".bias"), opts, self.tileable)
end

-- GroupNorm (32 groups, eps 1e-6). A tile of a tiled decode must not normalize with
-- its own statistics (a dark tile would be brightened: seams). Tiled decodes run the
-- tiles in lockstep (mode "sync", kiln.lockstep): every GroupNorm waits for the
-- image-wide statistics, merged from all tiles; `live` names what the caller keeps
-- across the call (a ResBlock's skip), parked on the host while other tiles run.
-- When even the untiled mid block does not fit, the fallback records the statistics
-- on the whole latent scaled down to one tile ("record") and the tiles normalize
-- with those ("apply"): an estimate, ~15 dB worse than lockstep on the demo VAE.
local GN_OPTS_SILU = { silu = true }
function VAE:_gn(x, p, silu, live)
  local w, b = self:w(p .. ".weight"), self:w(p .. ".bias")
  local st = self._gn_stats
  if not st or st.mode == "off" then
    return nn.group_norm(x, 32, w, b, 1e-6, silu and GN_OPTS_SILU or nil)
  end
  local s
  if st.mode == "sync" then
    s = st.sync(x, live)
  end
  local B = x.shape[1]
  if st.mode == "record" then
    local g = x:reshape({ B, 32, -1 })
    st[#st + 1] = { mean = g:mean(3, true), var = g:var(3, true, false) }
    g:free()
    return nn.group_norm(x, 32, w, b, 1e-6, silu and GN_OPTS_SILU or nil)
  end
  if not s then
    st.i = st.i + 1
    s = st[st.i]
  end
  if not s then error("vae: tiled decode: GroupNorm statistics out of step", 2) end
  if B == 1 then return self:_gn_affine(x, s, w, b, silu) end
  -- a batch: each picture with its own statistics
  local parts = {}
  for i = 1, B do
    local xi, mi, vi = x:narrow(1, i, 1), s.mean:narrow(1, i, 1), s.var:narrow(1, i, 1)
    parts[i] = self:_gn_affine(xi, { mean = mi, var = vi }, w, b, silu)
    xi:free(); mi:free(); vi:free()
  end
  local y = kiln.cat(parts, 1)
  for _, t in ipairs(parts) do t:free() end
  return y
end

-- GroupNorm of one picture with given statistics s = {mean, var} ([1, 32, 1]) as one
-- per-channel affine map, y = x * a + c with a = w / sqrt(var + eps), c = b - mean * a
-- (computed on [C] vectors), run as a depthwise 1x1 convolution: one pass over x
-- (and one for SiLU) instead of five broadcasting ones.
function VAE:_gn_affine(x, s, w, b, silu)
  local C = x.shape[2]
  local cpg = C // 32
  local function per_channel(t) -- [1, 32, 1] -> [C]
    local e = t:expand({ 1, 32, cpg })
    local c = e:contiguous()
    e:free()
    local r = c:reshape({ C })
    c:free()
    return r
  end
  local m, v = per_channel(s.mean), per_channel(s.var)
  local v2 = v + 1e-6
  v:free()
  local sd = v2:sqrt()
  v2:free()
  local w32, b32 = w:to("f32"), b:to("f32")
  local a = w32 / sd
  w32:free(); sd:free()
  local ma = m * a
  m:free()
  local c = b32 - ma
  b32:free(); ma:free()
  local a4 = a:reshape({ C, 1, 1, 1 })
  a:free()
  if x.dtype ~= a4.dtype then -- half activations: the map in their dtype (an f32 weight would widen them)
    local a5, c5 = a4:to(x.dtype), c:to(x.dtype)
    a4:free(); c:free()
    a4, c = a5, c5
  end
  local y = nn.conv2d(x, a4, c, { groups = C })
  a4:free(); c:free()
  if silu then
    local z = nn.silu(y)
    y:free()
    y = z
  end
  return y
end

-- consume: the caller drops x after the block (its free is then a no-op). With a 1x1
-- shortcut and untiled GroupNorm, the shortcut is computed first and the first
-- GroupNorm overwrites x: one activation less at the block's peak, which is the whole
-- decode's peak (the first block at full size, 256 -> 128 channels; README's memory
-- section has the bytes).
function VAE:_resblock(p, x, consume)
  local st = self._gn_stats
  local s, h
  if consume and (not st or st.mode == "off") and self:w(p .. ".conv1.weight").shape[1] ~= x.shape[2] then
    s = conv(self, p .. ".nin_shortcut", x)
    h = nn.group_norm(x, 32, self:w(p .. ".norm1.weight"), self:w(p .. ".norm1.bias"), 1e-6,
      { silu = true, inplace = true })
  else
    h = self:_gn(x, p .. ".norm1", true)
  end
  local h2 = conv(self, p .. ".conv1", h, { padding = 1 })
  h:free() -- x itself when consumed
  h = self:_gn(h2, p .. ".norm2", true, not s and x or nil)
  h2:free()
  h2 = conv(self, p .. ".conv2", h, { padding = 1 })
  h:free()
  local out
  if s then
    out = s + h2
  elseif x.shape[2] ~= h2.shape[2] then
    s = conv(self, p .. ".nin_shortcut", x)
    out = s + h2
  else
    out = x + h2
  end
  if s then s:free() end
  h2:free()
  return out
end

-- A 1x1 convolution weight as a linear weight (diffusers files store them so): always a
-- new view, which the caller frees (a streamed weight must not outlive its block).
local function as2d(w)
  return w:reshape({ w.shape[1], w.shape[2] })
end

local function linear1x1(self, p, x)
  local w = as2d(self:w(p .. ".weight"))
  local r = nn.linear(x, w, self:w(p .. ".bias"))
  w:free()
  return r
end

-- Single-head self-attention over the h*w positions (scale c^-1/2). Every view is
-- freed as soon as it is dead (a view keeps its storage alive until then).
function VAE:_attn(p, x)
  local B, C, H, W = x.shape[1], x.shape[2], x.shape[3], x.shape[4]
  local n = self:_gn(x, p .. ".norm", false)
  local n3 = n:reshape({ B, C, H * W })
  local nt = n3:transpose(2, 3)
  local seq = nt:contiguous() -- [B, HW, C]
  nt:free(); n3:free(); n:free()
  local q = linear1x1(self, p .. ".q", seq)
  local k = linear1x1(self, p .. ".k", seq)
  local v = linear1x1(self, p .. ".v", seq)
  seq:free()
  local q4, k4, v4 = q:reshape({ B, 1, H * W, C }), k:reshape({ B, 1, H * W, C }), v:reshape({ B, 1, H * W, C })
  local o = nn.attention(q4, k4, v4)
  q4:free(); k4:free(); v4:free(); q:free(); k:free(); v:free()
  local o2 = o:reshape({ B, H * W, C })
  local pr = linear1x1(self, p .. ".proj_out", o2)
  o2:free(); o:free()
  local pt = pr:transpose(2, 3)
  local t = pt:contiguous()
  pt:free(); pr:free()
  local t4 = t:reshape({ B, C, H, W })
  local r = t4 + x
  t4:free(); t:free()
  return r
end

-- Applies f to x and frees x unless it is keep (the caller's tensor).
local function step(x, keep, y)
  if x ~= keep then x:free() end
  return y
end

function VAE:_mid(side, h)
  h = step(h, nil, self:_resblock(side .. ".mid.block_1", h))
  h = step(h, nil, self:_attn(side .. ".mid.attn_1", h))
  h = step(h, nil, self:_resblock(side .. ".mid.block_2", h))
  return h
end

function VAE:_dec_in(z)
  if not self.config.quant then return conv(self, "decoder.conv_in", z, { padding = 1 }) end
  local h = conv(self, "post_quant_conv", z)
  return step(h, nil, conv(self, "decoder.conv_in", h, { padding = 1 }))
end

function VAE:_dec_up(i, h)
  local cfg = self.config
  for j = 0, cfg.num_res_blocks do
    h = step(h, nil, self:_resblock(fmt("decoder.up.%d.block.%d", i, j), h, true))
  end
  if i ~= 0 then -- nearest 2x then the conv, fused: the upsampled image is never made
    h = step(h, nil, conv(self, fmt("decoder.up.%d.upsample.conv", i), h, { padding = 1, upsample = 2 }))
  end
  return h
end

function VAE:_dec_out(h)
  h = step(h, nil, self:_gn(h, "decoder.norm_out", true))
  return step(h, nil, conv(self, "decoder.conv_out", h, { padding = 1 }))
end

-- The decoder's head: the part at latent resolution that sees every position at
-- once (the mid block's attention), so a tiled decode runs it untiled.
function VAE:_dec_head(pass, z)
  local h = pass:run("decoder.in", self._dec_in, self, z)
  return pass:run("decoder.mid.", self._mid, self, "decoder", h)
end

-- unscaled latent z [B, z, h, w] -> decoder output (about [-1, 1]) [B, 3, fh, fw]
function VAE:decode_raw(z)
  local cfg = self.config
  if not cfg.has_decoder then error("vae:decode: this VAE has no decoder", 2) end
  local pass <close> = self.streamer:pass(self.decode_order)
  local za = to_act(z, z.device)
  local h = self:_dec_head(pass, za or z)
  if za then za:free() end
  for i = cfg.levels - 1, 0, -1 do
    h = pass:run(fmt("decoder.up.%d.", i), self._dec_up, self, i, h)
  end
  local out = pass:run("decoder.out", self._dec_out, self, h)
  return za and to_f32(out) or out
end

function VAE:_enc_down(i, h)
  local cfg = self.config
  for j = 0, cfg.num_res_blocks - 1 do
    h = step(h, nil, self:_resblock(fmt("encoder.down.%d.block.%d", i, j), h))
  end
  if i ~= cfg.levels - 1 then
    local pd = seamless.pad(h, { 0, 1, 0, 1 }, self.tileable)
    h:free()
    h = step(pd, nil, conv(self, fmt("encoder.down.%d.downsample.conv", i), pd, { stride = 2 }))
  end
  return h
end

function VAE:_enc_out(h)
  local cfg = self.config
  h = step(h, nil, self:_gn(h, "encoder.norm_out", true))
  h = step(h, nil, conv(self, "encoder.conv_out", h, { padding = 1 }))
  local moments = h
  if cfg.quant then
    moments = conv(self, "quant_conv", h)
    h:free()
  end
  local mean = moments:narrow(2, 1, cfg.embed_dim):contiguous()
  moments:free()
  return mean
end

-- image in [-1, 1] [B, 3, H, W] -> posterior mean (unscaled) [B, embed_dim, H/f, W/f]
function VAE:encode_raw(x)
  local cfg = self.config
  if not cfg.has_encoder then error("vae:encode: this VAE has no encoder", 2) end
  local pass <close> = self.streamer:pass(self.encode_order)
  local xa = to_act(x, x.device)
  local h = pass:run("encoder.in", conv, self, "encoder.conv_in", xa or x, { padding = 1 })
  if xa then xa:free() end
  for i = 0, cfg.levels - 1 do
    h = pass:run(fmt("encoder.down.%d.", i), self._enc_down, self, i, h)
  end
  h = pass:run("encoder.mid.", self._mid, self, "encoder", h)
  local m = pass:run("encoder.out", self._enc_out, self, h)
  return xa and to_f32(m) or m
end

-- ---------------------------------------------------------------- tiling options

-- Checks {tile = T | "auto", overlap = O} (latent units) before the work starts; the
-- tiling itself (feathered tiles, tile = "auto" from the measured cost, the tiled
-- retry of an untiled call that runs out of memory) is kiln.tiling's.
function M.tile_options(opts, what)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(fmt("%s: options must be a table, got %s", what, type(opts)), 3) end
  for k in pairs(opts) do
    local mid_ok = k == "mid" and what == "vae:decode"
    if k ~= "tile" and k ~= "overlap" and k ~= "blend" and k ~= "min_tile" and k ~= "retry" and not mid_ok then
      error(fmt("%s: unknown option '%s' (known: tile, overlap, blend, min_tile, retry%s)", what, tostring(k),
        what == "vae:decode" and ", mid" or ""), 3)
    end
  end
  if opts.mid ~= nil and opts.mid ~= "untiled" and opts.mid ~= "tiled" then
    error(fmt("%s: mid must be \"untiled\" or \"tiled\", got %s", what, tostring(opts.mid)), 3)
  end
  local tile, overlap = opts.tile, opts.overlap
  if tile == nil and overlap ~= nil then error(what .. ": overlap given without tile", 3) end
  if tile ~= nil and tile ~= "auto" and (math.type(tile) ~= "integer" or tile < 8) then
    error(fmt("%s: tile must be an integer >= 8 (latent units) or \"auto\", got %s", what, tostring(tile)), 3)
  end
  if overlap ~= nil and (math.type(overlap) ~= "integer" or overlap < 0 or (tile ~= "auto" and overlap * 2 >= tile)) then
    error(fmt("%s: overlap must be an integer in [0, tile/2), got %s", what, tostring(overlap)), 3)
  end
  return opts
end

-- ---------------------------------------------------------------- public API


-- decoder output (about [-1, 1]; freed) -> images in [0, 1]
local function to_image(d)
  local h = d + 1
  d:free()
  local h2 = h * 0.5
  h:free()
  local img = h2:clamp(0, 1)
  h2:free()
  return img
end

-- unscaled latents -> images in [0, 1]
function VAE:_decode_unscaled(z)
  return to_image(self:decode_raw(z))
end

-- posterior mean (freed) -> latents as samplers use them: (m - shift) * scale
function VAE:_scale_latent(m)
  local cfg = self.config
  local r
  if cfg.shift_factor ~= 0 then
    local d = m - cfg.shift_factor
    r = d * cfg.scale_factor
    d:free()
  else
    r = m * cfg.scale_factor
  end
  m:free()
  return r
end

-- latents as samplers produce them -> unscaled latents on the weights' device (new)
function VAE:_unscale(z)
  local cfg = self.config
  local dev = self:_device("decoder.conv_in.weight")
  local zd = z.device ~= dev and z:to(dev) or nil
  local zs = (zd or z) / cfg.scale_factor
  if zd then zd:free() end
  if cfg.shift_factor ~= 0 then
    local s = zs + cfg.shift_factor
    zs:free()
    zs = s
  end
  return zs, dev
end

local is_oom = util.is_oom
local HOST = "cpu"

-- A tiled decode with the untiled decode's GroupNorm statistics (kiln.tiling's
-- hook for VAEs; mo: kiln.tile.map options in latent units, scale = the factor).
-- The head (post_quant_conv, conv_in, the mid block with its attention over all
-- positions) runs untiled at latent resolution; its output is parked on the host and
-- the up blocks run over its tiles in lockstep (kiln.lockstep), one pass over the
-- weights for all tiles (low mode streams each block once). When the head does not
-- fit the device (or mid = "tiled"), the head runs in the lockstep too, with the
-- mid block's attention inside each tile: the device then holds one tile's working
-- set whatever the image size. When the parked tiles do not fit the host, it falls
-- back to tiling the whole decoder with GroupNorm statistics estimated on a
-- scaled-down latent (logged; ~15 dB less exact).
function VAE:_decode_tiles(z, mo, mid)
  local zs, dev = self:_unscale(z)
  local za = to_act(zs, dev) -- the parked tiles too are half then
  if za then zs:free(); zs = za end
  local src, order = nil, self.decode_tail_order
  if mid ~= "tiled" then
    local ok, h = pcall(function()
      local pass <close> = self.streamer:pass(self.decode_head_order)
      return self:_dec_head(pass, zs)
    end)
    if ok then
      src = h
    elseif is_oom(h) then
      tiling.log_event(fmt("vae:decode: the mid block does not fit untiled on %s (%s); its attention runs per tile",
        tostring(h.device), h.message or "out of memory"))
      collectgarbage(); collectgarbage()
    else
      zs:free()
      error(h, 0)
    end
  end
  if src then zs:free() else src, order = zs, self.decode_order end
  local ok, err = pcall(src.move, src, HOST)
  if not ok then
    src:free()
    if not is_oom(err) then error(err, 0) end
    return self:_decode_tiles_estimated(z, mo, "no host memory to park the tiles")
  end
  local fns = {
    ["decoder.in"] = function(x) return self:_dec_in(x) end,
    ["decoder.mid."] = function(x) return self:_mid("decoder", x) end,
    ["decoder.out"] = function(x) return self:_dec_out(x) end,
  }
  local raw, why = self:_lockstep(src, mo, dev, order, fns, "vae:decode")
  src:free()
  if not raw then return self:_decode_tiles_estimated(z, mo, why) end
  -- map to [0, 1] after the blend (clamped tiles blended can round to 1 + 1 ulp)
  local img = to_image(raw)
  img:move(dev)
  return img
end

-- The context a tile of a tileable lockstep run gets beyond its edges (tile units,
-- VAE:_lockstep): two latent pixels carry the distortion zero padding makes at a
-- tile's edge out of the pixels the blend weighs.
local WRAP_HALO = 2

-- The tiles of a tileable lockstep run: the plan over src padded by the margin on
-- the wrapped axes, and the cores (lockstep.cores) cut to the picture, so every
-- pixel counts once in the GroupNorm statistics. The margin is the overlap, halved
-- while a core would lie in the margin only (tiles barely longer than the overlap).
local function wrap_plan(src, mo, mode, label)
  local H, W = src.shape[3], src.shape[4]
  local wy, wx = seamless.axes(mode)
  local unit = mo.multiple or 1
  local margin = seamless.margin(mo.overlap, unit)
  while true do
    local mh, mw = wy and margin or 0, wx and margin or 0
    local plan = kiln.tile.plan(H + 2 * mh, W + 2 * mw, mo)
    local cores, empty = lockstep.cores(plan), false
    for i = 1, plan.count do
      local r, c = plan[i].input, cores[i]
      local y0, x0 = r.y - 1, r.x - 1 -- the tile's first row and column, 0-based
      c.y0 = math.max(c.y0, mh - y0); c.y1 = math.min(c.y1, mh + H - y0)
      c.x0 = math.max(c.x0, mw - x0); c.x1 = math.min(c.x1, mw + W - x0)
      if c.y1 <= c.y0 or c.x1 <= c.x0 then empty = true end
    end
    if not empty then return plan, cores, margin end
    if margin <= unit then
      error(fmt("%s: tiles of %d are too small to wrap around (tileable); use a larger tile", label, mo.tile), 0)
    end
    margin = seamless.margin(margin // 2, unit)
  end
end

-- Runs the blocks `order` (keys of the streaming plan) over the tiles of src (on the
-- host) in lockstep (kiln.lockstep) and blends the outputs with the map options mo:
-- the result, on the host. fns[key](x) runs a block on one tile; keys not in fns are
-- "decoder.up.N." / "encoder.down.N.". Returns nil and the reason when the parked
-- tiles do not fit the host (and the device is another one).
-- Tileable (self.tileable): src is padded circularly by a margin on the wrapped
-- axes, the tiles run with zero padding (their context at the border comes from the
-- other side), the GroupNorm statistics count the picture's pixels once (the cores
-- cut at the margin), and the margin is cropped from the result. Every tile edge
-- inside the picture is then a seam (an ordinary run's border tiles end at the
-- picture's edge, where zero padding is what the untiled network sees), and a
-- wrapped picture's statistics, free of the border's strong responses, are smaller,
-- which magnifies what zero padding distorts near a tile's edge: the tiles run with
-- a halo of WRAP_HALO tile units of context beyond their edges (kept inside the
-- picture on an axis that does not wrap), cropped from their outputs before the blend.
function VAE:_lockstep(src, mo, dev, order, fns, label)
  local mode = seamless.active(self.tileable)
  local plan, cores, margin
  local srch, halo = src, 0
  if mode then
    plan, cores, margin = wrap_plan(src, mo, mode, label)
    halo = WRAP_HALO * (mo.multiple or 1)
    srch = seamless.wrap_pad(src, mode, margin + halo)
    src = seamless.wrap_pad(src, mode, margin)
  else
    plan = kiln.tile.plan(src.shape[3], src.shape[4], mo)
    cores = lockstep.cores(plan)
  end
  local ctx = { device = dev, cores = cores, label = label, mode = "sync" }
  local states, ext = {}, {}
  local wy, wx = seamless.axes(mode)
  local oy, ox = wy and halo or 0, wx and halo or 0 -- srch's rows / columns before src's
  for i = 1, plan.count do
    local r, c = plan[i].input, cores[i]
    local y0, x0 = r.y + oy, r.x + ox
    local e = { t = math.min(halo, y0 - 1), b = math.min(halo, srch.shape[3] - (y0 + r.h - 1)),
      l = math.min(halo, x0 - 1), r = math.min(halo, srch.shape[4] - (x0 + r.w - 1)) }
    ext[i] = e
    c.y0, c.y1, c.x0, c.x1 = c.y0 + e.t, c.y1 + e.t, c.x0 + e.l, c.x1 + e.l
    c.h, c.w = r.h + e.t + e.b, r.w + e.l + e.r
    local a = srch:narrow(3, y0 - e.t, c.h)
    local b = a:narrow(4, x0 - e.l, c.w)
    states[i] = b:contiguous()
    b:free(); a:free()
  end
  if srch ~= src then srch:free() end
  -- a tile's output without its halo
  local function core_of(o, i)
    local e, s = ext[i], mo.scale
    if e.t + e.b + e.l + e.r == 0 then return o end
    local ph, pw = math.floor(plan[i].input.h * s + 0.5), math.floor(plan[i].input.w * s + 0.5)
    local a = o:narrow(3, math.floor(e.t * s + 0.5) + 1, ph)
    local b = a:narrow(4, math.floor(e.l * s + 0.5) + 1, pw)
    local r = b:contiguous()
    b:free(); a:free(); o:free()
    return r
  end
  self._gn_stats = ctx
  local ok, outs = pcall(seamless.suspend, function()
    local pass <close> = self.streamer:pass(order)
    for _, key in ipairs(order) do
      local fn = fns[key]
      if not fn then
        local up = tonumber(key:match("^decoder%.up%.(%d+)%.$"))
        local down = tonumber(key:match("^encoder%.down%.(%d+)%.$"))
        if up then fn = function(x) return self:_dec_up(up, x) end
        else fn = function(x) return self:_enc_down(down, x) end end
      end
      states = pass:run(key, lockstep.stage, states, fn, ctx)
    end
    return states
  end)
  self._gn_stats = nil
  if not ok then
    for _, t in pairs(states) do t:free() end
    if mode then src:free() end
    if is_oom(outs) and outs.device == HOST and dev ~= HOST then return nil, "no host memory to park the tiles" end
    error(outs, 0)
  end
  local half = kiln.activation_dtype(dev) ~= "f32"
  local ok2, r = pcall(kiln.tile.map, src, function(_, i)
    local o = core_of(outs[i], i)
    outs[i] = nil
    return half and to_f32(o) or o -- blended in f32 (half activations end here)
  end, mo)
  if mode then src:free() end
  if not ok2 then
    for _, t in pairs(outs) do t:free() end
    error(r, 0)
  end
  if mode then r = seamless.crop(r, mode, math.floor(margin * mo.scale + 0.5)) end
  return r
end

-- A tiled encode with image-wide GroupNorm statistics (kiln.tiling's hook; mo in
-- pixels, scale 1/f): conv_in and the down blocks run over the image's tiles in
-- lockstep, their latent-resolution outputs are blended, and the mid block (its
-- attention sees every position) and the output convolutions run untiled.
function VAE:_encode_tiles(img, mo)
  local dev = self:_device("encoder.conv_out.weight")
  local x2 = img * 2
  local x = x2 - 1
  x2:free()
  local xa = to_act(x, dev)
  if xa then x:free(); x = xa end
  x:move(HOST)
  local fns = { ["encoder.in"] = function(t)
    local w, b = self:w("encoder.conv_in.weight"), self:w("encoder.conv_in.bias")
    local r = nn.conv2d(t, w, b, { padding = 1 })
    t:free()
    return r
  end }
  local h, why = self:_lockstep(x, mo, dev, self.encode_head_order, fns, "vae:encode")
  x:free()
  if not h then
    tiling.log_event("vae:encode: " .. why .. "; tiles normalize with their own statistics (less exact)")
    return self:_map(img, function(t) return self:_encode_untiled(t) end, mo)
  end
  h:move(dev)
  local ha = to_act(h, dev)
  if ha then h:free(); h = ha end
  local m
  do
    local pass <close> = self.streamer:pass(self.encode_tail_order)
    h = pass:run("encoder.mid.", self._mid, self, "encoder", h)
    m = pass:run("encoder.out", self._enc_out, self, h)
  end
  return self:_scale_latent(ha and to_f32(m) or m)
end

-- The fallback: every tile runs the whole decoder, normalizing with statistics
-- recorded on the latent scaled down to one tile (VAE:_gn's "record" / "apply").
function VAE:_decode_tiles_estimated(z, mo, why)
  tiling.log_event(fmt("vae:decode: %s; tiling the whole decoder with estimated GroupNorm statistics (less exact)", why))
  collectgarbage(); collectgarbage()
  if seamless.active(self.tileable) and self._tiling_full and not self._gn_fixed then
    -- recorded now, with circular padding (the tiles run without)
    self._gn_fixed = self:_estimate_gn(self._tiling_full, mo.tile)
  end
  return self:_map(z, function(t) return self:_decode_untiled(t) end, mo)
end

-- kiln.tile.map(x, fn, mo), wrapping around when tileable (kiln.seamless.map, with
-- the lockstep's halo).
function VAE:_map(x, fn, mo)
  local mode = seamless.active(self.tileable)
  if not mode then return kiln.tile.map(x, fn, mo) end
  local unit = mo.multiple or 1
  return seamless.map(x, fn, mo, mode, seamless.margin(mo.overlap, unit), WRAP_HALO * unit)
end

-- The untiled network of vae:decode / vae:encode, per tile, as kiln.tiling expects
-- them: latents as samplers produce them -> images in [0, 1] (and back), on the
-- weights' device.
function VAE:_decode_untiled(z)
  local cfg = self.config
  local full = self._tiling_full
  local st
  if full and (z.shape[3] < full.shape[3] or z.shape[4] < full.shape[4]) then
    -- a tile of a tiled decode: normalize with the whole image's statistics
    if not self._gn_fixed then self._gn_fixed = self:_estimate_gn(full, math.max(z.shape[3], z.shape[4])) end
    st = self._gn_fixed
    st.mode, st.i = "apply", 0
    self._gn_stats = st
  end
  local zs = self:_unscale(z)
  local ok, img = pcall(self._decode_unscaled, self, zs)
  zs:free()
  if st then st.mode = "off"; self._gn_stats = nil end
  if not ok then error(img, 0) end
  return img
end

-- The GroupNorm statistics the tiles of the fallback normalize with: recorded on a
-- picture of at least 32 latent pixels (a better estimate), or the tile's size
-- (side) when that does not fit the budget.
function VAE:_estimate_gn(full, side)
  local ok, rec = pcall(self._record_gn, self, full, math.max(side, 32))
  if not ok then
    if not is_oom(rec) or side >= 32 then error(rec, 0) end
    collectgarbage()
    rec = self:_record_gn(full, side)
  end
  return rec
end

-- GroupNorm statistics of a decode of the whole latent z, run on z scaled down so
-- its longer side is at most `side` (the tile's, so recording costs what one tile
-- costs): per-group means and variances of a smaller picture of the same content.
function VAE:_record_gn(z, side)
  local H, W = z.shape[3], z.shape[4]
  local s = math.min(1, side / math.max(H, W))
  local small = s < 1 and nn.interpolate(z, { size = { math.max(1, math.floor(H * s + 0.5)),
    math.max(1, math.floor(W * s + 0.5)) }, mode = "bilinear" }) or z
  local st = { mode = "record" }
  local full = self._tiling_full
  self._gn_stats, self._tiling_full = st, nil
  local ok, img = pcall(self._decode_untiled, self, small)
  self._gn_stats, self._tiling_full = nil, full
  if small ~= z then small:free() end
  if not ok then error(img, 0) end
  img:free()
  st.mode = "off"
  return st
end

function VAE:_encode_untiled(img)
  local dev = self:_device("encoder.conv_out.weight")
  local imgd = img.device ~= dev and img:to(dev) or nil
  local x2 = (imgd or img) * 2
  if imgd then imgd:free() end
  local x = x2 - 1
  x2:free()
  local m = self:encode_raw(x)
  x:free()
  return self:_scale_latent(m)
end

-- z: latents times the scale factor [B, z, h, w] -> images [B, 3, f h, f w] in [0, 1].
-- opts: {tile = T | "auto", overlap = O} in latent units (kiln.tiling), blend
-- ("cosine" default), mid ("untiled" default when it fits | "tiled": see
-- VAE:_decode_tiles); untiled calls that run out of memory retry tiled by themselves.
function VAE:decode(z, opts)
  local cfg = self.config
  local topt = M.tile_options(opts, "vae:decode")
  if #z.shape ~= 4 or z.shape[2] ~= cfg.embed_dim then
    error(fmt("vae:decode: z must be [B, %d, h, w], got [%s]", cfg.embed_dim or -1, table.concat(z.shape, ", ")), 2)
  end
  -- tiles (chosen up front or by an out-of-memory retry) normalize with the whole
  -- image's GroupNorm statistics, recorded on first need (see VAE:_gn)
  self._tiling_full, self._gn_fixed = z, nil
  local ok, img = pcall(tiling.decode, self, z, topt)
  self._tiling_full, self._gn_fixed = nil, nil
  if not ok then error(img, 0) end
  return img
end

-- img [B, 3, H, W] in [0, 1] (H, W multiples of the factor) -> latents times the scale factor.
function VAE:encode(img, opts)
  local cfg = self.config
  local topt = M.tile_options(opts, "vae:encode")
  local f = cfg.factor
  if #img.shape ~= 4 or img.shape[2] ~= cfg.in_channels then
    error(fmt("vae:encode: image must be [B, %d, H, W], got [%s]", cfg.in_channels, table.concat(img.shape, ", ")), 2)
  end
  if img.shape[3] % f ~= 0 or img.shape[4] % f ~= 0 then
    error(fmt("vae:encode: image size %dx%d must be a multiple of %d", img.shape[3], img.shape[4], f), 2)
  end
  return (tiling.encode(self, img, topt))
end

return M
