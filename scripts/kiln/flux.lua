-- kiln.flux: Black Forest Labs' Flux.1 transformer ([dev], [schnell], Kontext [dev]) over kiln.nn, as
-- flux/model.py defines it: double-stream blocks (separate image and text weights,
-- joint attention) then single-stream blocks over the text and image tokens together,
-- a 3-axis rotary position embedding and adaLN modulation from a vector of the time,
-- the pooled text and ([dev]) the distilled guidance. Hyper-parameters come from the
-- tensors (flux.config); flux.expected(cfg) lists every tensor it reads, so the loader
-- checks a file before anything runs. Blocks stream one by one in memory mode "low"
-- (kiln.stream), as the UNet's.
--
--   local dit = flux.new(weights, cfg)       -- names relative to the network's root
--   local v = dit:forward(x, t, context, y, {guidance = g, reference = r})
--     x [B, 16, h, w] latent (h, w even), t [B] flow time in [0, 1], context [B, L, d]
--     (T5 states), y [B, d_vec] (CLIP's pooled output), g [B] ([dev] only) -> the
--     velocity [B, 16, h, w]
--     r (Kontext): a reference latent [1 or B, 16, hr, wr] (hr, wr even) or a list of
--     them, each appended after the image's tokens with its own position ids
--     (M.reference_ids); the prediction keeps the image's tokens only
--
-- __metadata__ keys read: kiln.flux.heads (default hidden / 128), kiln.flux.axes_dim
-- ("16,56,56"), kiln.flux.theta (10000).
local kiln = require "kiln"
local util = require "kiln.util"
local stream = require "kiln.stream"
local ops = require "kiln.dit_ops"
local unet = require "kiln.unet"
local nn = kiln.nn

local M = {}
local Flux = {}
Flux.__index = Flux
M.Flux = Flux

local fmt = string.format
local scope, rms_norm, as_batch, shape_of = ops.scope, ops.rms_norm, ops.as_batch, ops.shape_of
local function meta_int(meta, key) return ops.meta_int(meta, key, "Flux") end

M.HEAD_DIM = 128                 -- BFL's head width: heads = hidden / 128
M.AXES_DIM = { 16, 56, 56 }      -- rotary widths of the (index, row, column) axes
M.THETA = 10000
M.TIME_DIM = 256                 -- the sinusoidal embedding the MLP embedders take

-- ---------------------------------------------------------------- configuration

local function need(shapes, name, what) return util.need_shape(shapes, name, what, "Flux") end

local function meta_axes(meta)
  local s = meta and meta["kiln.flux.axes_dim"]
  if not s then return nil end
  local r = {}
  for d in tostring(s):gmatch("[^,%s]+") do
    local n = math.tointeger(tonumber(d))
    if not n or n <= 0 or n % 2 ~= 0 then
      error(fmt("Flux: __metadata__ kiln.flux.axes_dim = %q: expected positive even widths like \"16,56,56\"", s), 0)
    end
    r[#r + 1] = n
  end
  if #r == 0 then error(fmt("Flux: __metadata__ kiln.flux.axes_dim = %q names no widths", s), 0) end
  return r
end

--- Reads the architecture from name -> shape (names relative to the network root) and
-- the file's metadata: {hidden, heads, head_dim, depth, depth_single, in_channels,
-- out_channels, context_dim, vec_dim, mlp_hidden, mlp_ratio, guidance, qkv_bias,
-- axes_dim, theta}.
function M.config(shapes, meta)
  local cfg = {}
  local ii = need(shapes, "img_in.weight", "the hidden size and in_channels")
  cfg.hidden, cfg.in_channels = ii[1], ii[2]
  cfg.context_dim = need(shapes, "txt_in.weight", "the context width")[2]
  cfg.vec_dim = need(shapes, "vector_in.in_layer.weight", "the pooled vector's width")[2]
  cfg.out_channels = need(shapes, "final_layer.linear.weight", "out_channels")[1]
  cfg.depth = util.count_indices(shapes, "^double_blocks%.(%d+)%.")
  cfg.depth_single = util.count_indices(shapes, "^single_blocks%.(%d+)%.")
  if cfg.depth < 1 and cfg.depth_single < 1 then
    error("Flux: no double_blocks.N.* nor single_blocks.N.* tensors", 0)
  end
  -- a hole in the numbering: a partial or damaged file, said by block
  for _, kind in ipairs({ { "double_blocks", cfg.depth, "img_attn.qkv.weight" },
    { "single_blocks", cfg.depth_single, "linear1.weight" } }) do
    for b = 0, kind[2] - 1 do
      if not shapes[fmt("%s.%d.%s", kind[1], b, kind[3])] then
        error(fmt("Flux: block %s.%d is missing (no %s.%d.%s; the file has %s up to %d): a partial or " ..
          "damaged file?", kind[1], b, kind[1], b, kind[3], kind[1], kind[2] - 1), 0)
      end
    end
  end
  if cfg.depth > 0 then
    cfg.mlp_hidden = need(shapes, "double_blocks.0.img_mlp.0.weight", "the MLP width")[1]
    cfg.qkv_bias = shapes["double_blocks.0.img_attn.qkv.bias"] ~= nil
  else
    cfg.mlp_hidden = need(shapes, "single_blocks.0.linear1.weight", "the MLP width")[1] - 3 * cfg.hidden
    cfg.qkv_bias = true
  end
  cfg.mlp_ratio = cfg.mlp_hidden / cfg.hidden
  cfg.guidance = shapes["guidance_in.in_layer.weight"] ~= nil
  cfg.heads = meta_int(meta, "kiln.flux.heads") or cfg.hidden // M.HEAD_DIM
  if cfg.heads < 1 or cfg.hidden % cfg.heads ~= 0 then
    error(fmt("Flux: hidden size %d does not split into heads of %d (set __metadata__ kiln.flux.heads)",
      cfg.hidden, M.HEAD_DIM), 0)
  end
  cfg.head_dim = cfg.hidden // cfg.heads
  cfg.axes_dim = meta_axes(meta) or M.AXES_DIM
  local sum = 0
  for _, d in ipairs(cfg.axes_dim) do sum = sum + d end
  if sum ~= cfg.head_dim then
    error(fmt("Flux: the rotary axes {%s} sum to %d, the head width is %d (hidden %d / %d heads; set " ..
      "__metadata__ kiln.flux.axes_dim)", table.concat(cfg.axes_dim, ","), sum, cfg.head_dim, cfg.hidden,
      cfg.heads), 0)
  end
  cfg.theta = tonumber(meta and meta["kiln.flux.theta"]) or M.THETA
  if cfg.in_channels % 4 ~= 0 then
    error(fmt("Flux: img_in takes %d features, not 2x2 patches of a latent (a multiple of 4)", cfg.in_channels), 0)
  end
  cfg.latent_channels = cfg.in_channels // 4
  cfg.summary = fmt("hidden %d, %d heads, %d double + %d single blocks, mlp %d, context %d, vec %d, in %d%s",
    cfg.hidden, cfg.heads, cfg.depth, cfg.depth_single, cfg.mlp_hidden, cfg.context_dim, cfg.vec_dim,
    cfg.in_channels, cfg.guidance and ", guidance" or "")
  return cfg
end

-- Every tensor the network reads, in order: a list of {name, shape}.
function M.expected(cfg)
  local list = {}
  local H, Mh, D = cfg.hidden, cfg.mlp_hidden, cfg.head_dim
  local function add(name, shape) list[#list + 1] = { name, shape } end
  local function lin(p, o, i, bias)
    add(p .. ".weight", { o, i })
    if bias ~= false then add(p .. ".bias", { o }) end
  end
  lin("img_in", H, cfg.in_channels)
  lin("txt_in", H, cfg.context_dim)
  lin("time_in.in_layer", H, M.TIME_DIM); lin("time_in.out_layer", H, H)
  lin("vector_in.in_layer", H, cfg.vec_dim); lin("vector_in.out_layer", H, H)
  if cfg.guidance then lin("guidance_in.in_layer", H, M.TIME_DIM); lin("guidance_in.out_layer", H, H) end
  for b = 0, cfg.depth - 1 do
    for _, s in ipairs({ "img", "txt" }) do
      local p = fmt("double_blocks.%d.%s_", b, s)
      lin(p .. "mod.lin", 6 * H, H)
      lin(p .. "attn.qkv", 3 * H, H, cfg.qkv_bias)
      add(p .. "attn.norm.query_norm.scale", { D }); add(p .. "attn.norm.key_norm.scale", { D })
      lin(p .. "attn.proj", H, H)
      lin(p .. "mlp.0", Mh, H); lin(p .. "mlp.2", H, Mh)
    end
  end
  for b = 0, cfg.depth_single - 1 do
    local p = fmt("single_blocks.%d.", b)
    lin(p .. "linear1", 3 * H + Mh, H); lin(p .. "linear2", H, H + Mh)
    add(p .. "norm.query_norm.scale", { D }); add(p .. "norm.key_norm.scale", { D })
    lin(p .. "modulation.lin", 3 * H, H)
  end
  lin("final_layer.linear", cfg.out_channels, H)
  lin("final_layer.adaLN_modulation.1", 2 * H, H)
  return list
end

-- The streaming block of a tensor: "in." (the input projections and embedders),
-- "double_blocks.N.", "single_blocks.N.", "final_layer.".
function M.block_of(name)
  local k = name:match("^(double_blocks%.%d+%.)") or name:match("^(single_blocks%.%d+%.)")
  if k then return k end
  if name:match("^final_layer%.") then return "final_layer." end
  if name:match("^img_in%.") or name:match("^txt_in%.") or name:match("^time_in%.") or
      name:match("^vector_in%.") or name:match("^guidance_in%.") then
    return "in."
  end
  return nil
end

function M.new(weights, cfg)
  local self = setmetatable({ weights = weights, config = cfg }, Flux)
  self.streamer = stream.new(weights, stream.blocks(M.expected(cfg), M.block_of), "dit")
  return self
end

function Flux:w(name) return self.weights:tensor(name) end

function Flux:_device() return ops.weights_device(self.weights, "img_in.weight") end

-- ---------------------------------------------------------------- pieces

-- The rotary tables of BFL's EmbedND for position ids: cos and sin [1, 1, L, D/2, 1]
-- (each head-dim pair's angle pos_axis * theta^(-2j / d_axis), the axes' pairs in
-- order). ids: a list of L {index, row, column}.
function M.rope_tables(ids, axes_dim, theta, device, dtype)
  local half = 0
  for _, d in ipairs(axes_dim) do half = half + d // 2 end
  local c, s = {}, {}
  local omega = {}
  for a, d in ipairs(axes_dim) do
    omega[a] = {}
    for j = 0, d // 2 - 1 do
      -- f32 as the reference computes it (arange / dim, then theta ^ -that)
      omega[a][j + 1] = 1.0 / theta ^ (string.unpack("f", string.pack("f", (2 * j) / d)))
    end
  end
  local n = 0
  for _, id in ipairs(ids) do
    for a, d in ipairs(axes_dim) do
      local p = id[a]
      for j = 1, d // 2 do
        n = n + 1
        local ang = p * omega[a][j]
        c[n], s[n] = math.cos(ang), math.sin(ang)
      end
    end
  end
  local shape = { 1, 1, #ids, half, 1 }
  local ct, st = kiln.tensor(c):reshape(shape), kiln.tensor(s):reshape(shape)
  if device and device ~= "cpu" or (dtype and dtype ~= "f32") then
    local c2, s2 = ct:to(device or "cpu", dtype or "f32"), st:to(device or "cpu", dtype or "f32")
    ct:free(); st:free()
    ct, st = c2, s2
  end
  return ct, st
end

-- x [B, heads, L, D] turned pair by pair: (a, b) -> (a cos - b sin, a sin + b cos).
local function rotate(x, cos, sin)
  local S = scope()
  local k = S.k
  local B, Hh, L, D = x.shape[1], x.shape[2], x.shape[3], x.shape[4]
  local p = k(x:reshape({ B, Hh, L, D // 2, 2 }))
  local a, b = k(p:narrow(5, 1, 1)), k(p:narrow(5, 2, 1))
  local ra = k(k(a * cos) - k(b * sin))
  local rb = k(k(a * sin) + k(b * cos))
  local r = k(kiln.cat({ ra, rb }, 5))
  return S.done(r:reshape({ B, Hh, L, D }))
end

-- (1 + scale) * LayerNorm(x) + shift (LayerNorm without affine, eps 1e-6).
local function modulate(x, shift, scale)
  local n = ops.layer_norm(x)
  local r = ops.modulate(n, shift, scale)
  n:free()
  return r
end

-- The n chunks [B, 1, H] of a modulation linear over silu(vec).
function Flux:_mod(p, vec_silu, n)
  local H = self.config.hidden
  local o = nn.linear(vec_silu, self:w(p .. ".weight"), self:w(p .. ".bias"))
  local o3 = o:reshape({ o.shape[1], 1, n * H })
  o:free()
  local r = {}
  for i = 1, n do r[i] = o3:narrow(3, (i - 1) * H + 1, H):contiguous() end
  o3:free()
  return r
end

-- qkv [B, L, 3H] -> q, k, v [B, heads, L, D], q and k RMS-normed.
function Flux:_heads(qkv, qn, kn)
  local cfg = self.config
  local S = scope()
  local k = S.k
  local B, L = qkv.shape[1], qkv.shape[2]
  local c = qkv:is_contiguous() and qkv or k(qkv:contiguous())
  local r5 = k(c:reshape({ B, L, 3, cfg.heads, cfg.head_dim }))
  local pm = k(k(r5:permute({ 3, 1, 4, 2, 5 })):contiguous())   -- [3, B, heads, L, D]
  local q, kk, v = k(pm:select(1, 1)), k(pm:select(1, 2)), pm:select(1, 3)
  q = rms_norm(q, self:w(qn))
  kk = rms_norm(kk, self:w(kn))
  return S.done(q, kk, v)
end

-- Attention over [B, heads, L, D] with the rotary tables applied to q and k -> [B, L, H].
local function attend(q, k, v, cos, sin)
  local qr, kr = rotate(q, cos, sin), rotate(k, cos, sin)
  local o = nn.attention(qr, kr, v)
  qr:free(); kr:free()
  local B, Hh, L, D = o.shape[1], o.shape[2], o.shape[3], o.shape[4]
  local ot = o:transpose(2, 3)
  local oc = ot:contiguous()
  ot:free(); o:free()
  local r = oc:reshape({ B, L, Hh * D })
  oc:free()
  return r
end

local function mlp_embed(self, p, x)
  local h = nn.linear(x, self:w(p .. ".in_layer.weight"), self:w(p .. ".in_layer.bias"))
  local hs = nn.silu(h)
  h:free()
  local r = nn.linear(hs, self:w(p .. ".out_layer.weight"), self:w(p .. ".out_layer.bias"))
  hs:free()
  return r
end

-- ---------------------------------------------------------------- blocks

-- img_in, txt_in and the vector: time_in(t) [+ guidance_in(g)] + vector_in(y).
function Flux:_in(img, context, t, y, g, dev, dt)
  local S = scope()
  local k = S.k
  local x = nn.linear(img, self:w("img_in.weight"), self:w("img_in.bias"))
  local txt = nn.linear(context, self:w("txt_in.weight"), self:w("txt_in.bias"))
  local function embed(p, v)
    local e = k(unet.timestep_embedding(k(v * 1000), M.TIME_DIM, dev))
    if e.dtype ~= dt then e = k(e:to(dt)) end
    return k(mlp_embed(self, p, e))
  end
  local vec = embed("time_in", t)
  if g then vec = k(vec + embed("guidance_in", g)) end
  vec = vec + k(mlp_embed(self, "vector_in", y))
  local vs = nn.silu(vec)
  vec:free()
  return S.done(x, txt, vs)
end

function Flux:_double(p, img, txt, vs, cos, sin)
  local S = scope()
  local k = S.k
  local im = self:_mod(p .. "img_mod.lin", vs, 6)
  local tm = self:_mod(p .. "txt_mod.lin", vs, 6)
  for _, v in ipairs(im) do k(v) end
  for _, v in ipairs(tm) do k(v) end
  local function qkv_of(s, x, m)
    local h = k(modulate(x, m[1], m[2]))
    local qkv = k(nn.linear(h, self:w(p .. s .. "_attn.qkv.weight"),
      self.config.qkv_bias and self:w(p .. s .. "_attn.qkv.bias") or nil))
    local q, kk, v = self:_heads(qkv, p .. s .. "_attn.norm.query_norm.scale", p .. s .. "_attn.norm.key_norm.scale")
    return k(q), k(kk), k(v)
  end
  local tq, tk, tv = qkv_of("txt", txt, tm)
  local iq, ik, iv = qkv_of("img", img, im)
  local q = k(kiln.cat({ tq, iq }, 3))
  local kk = k(kiln.cat({ tk, ik }, 3))
  local v = k(kiln.cat({ tv, iv }, 3))
  local a = k(attend(q, kk, v, cos, sin))
  local nt, ni = txt.shape[2], img.shape[2]
  local function stream_out(s, x, m, at)
    local pr = k(nn.linear(at, self:w(p .. s .. "_attn.proj.weight"), self:w(p .. s .. "_attn.proj.bias")))
    local x1 = k(x + k(m[3] * pr))
    local h = k(modulate(x1, m[4], m[5]))
    local f = k(nn.linear(h, self:w(p .. s .. "_mlp.0.weight"), self:w(p .. s .. "_mlp.0.bias")))
    local fg = k(nn.gelu(f, "tanh"))
    local o = k(nn.linear(fg, self:w(p .. s .. "_mlp.2.weight"), self:w(p .. s .. "_mlp.2.bias")))
    return x1 + k(m[6] * o)
  end
  local img2 = stream_out("img", img, im, k(k(a:narrow(2, nt + 1, ni)):contiguous()))
  local txt2 = stream_out("txt", txt, tm, k(k(a:narrow(2, 1, nt)):contiguous()))
  return S.done(img2, txt2)
end

function Flux:_single(p, x, vs, cos, sin)
  local cfg = self.config
  local S = scope()
  local k = S.k
  local H, Mh = cfg.hidden, cfg.mlp_hidden
  local m = self:_mod(p .. "modulation.lin", vs, 3)
  for _, v in ipairs(m) do k(v) end
  local h = k(modulate(x, m[1], m[2]))
  local l1 = k(nn.linear(h, self:w(p .. "linear1.weight"), self:w(p .. "linear1.bias")))
  local qkv = k(k(l1:narrow(3, 1, 3 * H)):contiguous())
  local mlp = k(k(l1:narrow(3, 3 * H + 1, Mh)):contiguous())
  local q, kk, v = self:_heads(qkv, p .. "norm.query_norm.scale", p .. "norm.key_norm.scale")
  k(q); k(kk); k(v)
  local a = k(attend(q, kk, v, cos, sin))
  local cat = k(kiln.cat({ a, k(nn.gelu(mlp, "tanh")) }, 3))
  local o = k(nn.linear(cat, self:w(p .. "linear2.weight"), self:w(p .. "linear2.bias")))
  return S.done(x + k(m[3] * o))
end

function Flux:_final(x, vs)
  local S = scope()
  local k = S.k
  local m = self:_mod("final_layer.adaLN_modulation.1", vs, 2)
  k(m[1]); k(m[2])
  local h = k(modulate(x, m[1], m[2]))
  return S.done(nn.linear(h, self:w("final_layer.linear.weight"), self:w("final_layer.linear.bias")))
end

-- ---------------------------------------------------------------- packing

--- x [B, C, h, w] -> [B, (h/2)(w/2), C*4] ("b c (h ph) (w pw) -> b (h w) (c ph pw)").
function M.pack(x)
  local B, C, h, w = x.shape[1], x.shape[2], x.shape[3], x.shape[4]
  local r = x:reshape({ B, C, h // 2, 2, w // 2, 2 })
  local p = r:permute({ 1, 3, 5, 2, 4, 6 })
  local c = p:contiguous()
  r:free(); p:free()
  local o = c:reshape({ B, (h // 2) * (w // 2), C * 4 })
  c:free()
  return o
end

--- The inverse of pack: [B, (h/2)(w/2), C*4] -> [B, C, h, w].
function M.unpack(x, h, w)
  local B, C = x.shape[1], x.shape[3] // 4
  local r = x:reshape({ B, h // 2, w // 2, C, 2, 2 })
  local p = r:permute({ 1, 4, 2, 5, 3, 6 })
  local c = p:contiguous()
  r:free(); p:free()
  local o = c:reshape({ B, C, h, w })
  c:free()
  return o
end

--- The position ids of BFL's `prepare`: n_txt zeros, then [0, row, col] for each
-- image token in row-major order; a list of {index, row, column}.
function M.position_ids(n_txt, h2, w2)
  local ids = {}
  for _ = 1, n_txt do ids[#ids + 1] = { 0, 0, 0 } end
  for r = 0, h2 - 1 do
    for c = 0, w2 - 1 do ids[#ids + 1] = { 0, r, c } end
  end
  return ids
end

--- The position ids of Kontext's reference latents, which follow the image's tokens:
-- index 1, rows and columns from 0 (BFL's prepare_kontext for one reference). Several
-- are placed side by side or one under another as ComfyUI's default ("offset") does:
-- each goes right of those before it when it is taller than wide against the space
-- they take, else below. sizes: a list of {h, w} latent sizes (even); the ids are
-- appended to `ids` (a list of {index, row, column}), which is returned.
function M.reference_ids(sizes, ids)
  ids = ids or {}
  local H, W = 0, 0
  for _, s in ipairs(sizes) do
    local h, w = s[1], s[2]
    local ho, wo = 0, 0
    if h + H > w + W then wo = W else ho = H end
    H, W = math.max(H, h + ho), math.max(W, w + wo)
    for r = 0, h // 2 - 1 do
      for c = 0, w // 2 - 1 do ids[#ids + 1] = { 1, ho // 2 + r, wo // 2 + c } end
    end
  end
  return ids
end

-- ---------------------------------------------------------------- forward

-- Double block 0 under a step cache (kiln.step_cache): TeaCache decides from the block's
-- modulated image input (img_norm1 with img_mod's first shift and scale, as
-- ComfyUI-TeaCache), FBCache from the block's image output. A reuse returns the image
-- stream the last block would give and no text stream.
function Flux:_first_double(p, img, txt, vs, cos, sin, cs)
  if cs:wants_modulated_input() then
    local im = self:_mod(p .. "img_mod.lin", vs, 6)
    local m = modulate(img, im[1], im[2])
    for _, v in ipairs(im) do v:free() end
    local r = cs:residual_or_anchor(cs:tea_input(m), img)
    if r then return r, nil end
  end
  local i2, t2 = self:_double(p, img, txt, vs, cos, sin)
  if cs.mode == "fbcache" then
    local r = cs:residual_or_anchor(cs:fb_first(i2:clone()), i2)
    if r then
      i2:free(); t2:free()
      return r, nil
    end
  end
  return i2, t2
end

-- x [B, C, h, w] (h, w even), t [B] flow time, context [B, L, context_dim], y [B,
-- vec_dim], opts.guidance (number or [B]; [dev] only) -> velocity [B, C, h, w].
function Flux:forward(x, t, context, y, opts)
  local cfg = self.config
  opts = opts or {}
  if not x or #x.shape ~= 4 or x.shape[2] ~= cfg.latent_channels then
    error(fmt("dit:forward: x must be [B, %d, h, w], got %s", cfg.latent_channels, shape_of(x)), 2)
  end
  local B, h, w = x.shape[1], x.shape[3], x.shape[4]
  if h % 2 ~= 0 or w % 2 ~= 0 then
    error(fmt("dit:forward: the latent's height and width must be even (2x2 patches), got %dx%d", h, w), 2)
  end
  if not context or #context.shape ~= 3 or context.shape[3] ~= cfg.context_dim then
    error(fmt("dit:forward: context must be [B, L, %d] (the T5 states), got %s", cfg.context_dim, shape_of(context)), 2)
  end
  if not y or #y.shape ~= 2 or y.shape[2] ~= cfg.vec_dim then
    error(fmt("dit:forward: y must be [B, %d] (the pooled CLIP vector), got %s", cfg.vec_dim, shape_of(y)), 2)
  end
  if context.shape[1] ~= B then
    if context.shape[1] == 1 then context = context:expand({ B, context.shape[2], context.shape[3] })
    else error(fmt("dit:forward: context batch %d does not match x batch %d", context.shape[1], B), 2) end
  end
  if y.shape[1] ~= B then
    if y.shape[1] == 1 then y = y:expand({ B, y.shape[2] })
    else error(fmt("dit:forward: y batch %d does not match x batch %d", y.shape[1], B), 2) end
  end
  local g = opts.guidance
  if cfg.guidance and g == nil then
    error("dit:forward: this Flux model ([dev]) is guidance-distilled: give opts.guidance (3.5 is usual)", 2)
  end
  if not cfg.guidance then g = nil end  -- [schnell] has no guidance input: ignored, as BFL's
  local refs = opts.reference
  if type(refs) == "userdata" then refs = { refs } end
  if refs ~= nil and type(refs) ~= "table" then
    error("dit:forward: opts.reference must be a latent tensor or a list of them, got " .. type(refs), 2)
  end
  for i, r in ipairs(refs or {}) do
    if type(r) ~= "userdata" or not r.shape or #r.shape ~= 4 or r.shape[2] ~= cfg.latent_channels then
      error(fmt("dit:forward: opts.reference[%d] must be a latent [1 or B, %d, h, w], got %s", i,
        cfg.latent_channels, type(r) == "userdata" and shape_of(r) or type(r)), 2)
    end
    if r.shape[3] % 2 ~= 0 or r.shape[4] % 2 ~= 0 then
      error(fmt("dit:forward: opts.reference[%d]'s height and width must be even (2x2 patches), got %dx%d", i,
        r.shape[3], r.shape[4]), 2)
    end
    if r.shape[1] ~= 1 and r.shape[1] ~= B then
      error(fmt("dit:forward: opts.reference[%d] has a batch of %d for x's batch of %d", i, r.shape[1], B), 2)
    end
  end
  if refs and #refs == 0 then refs = nil end

  local pass <close> = self.streamer:pass()
  local dev = self:_device()
  local xdt = x.dtype
  local act = kiln.activation_dtype(dev)
  local dt = act ~= "f32" and act or xdt
  local copies <close> = setmetatable({}, { __close = function(c) for _, v in ipairs(c) do v:free() end end })
  local function own(v) copies[#copies + 1] = v; return v end
  local function place(v)
    if v.device ~= dev then v = own(v:to(dev)) end
    if v.dtype ~= dt then v = own(v:to(dt)) end
    return v
  end
  x, context, y = place(x), place(context), place(y)
  local t0 = t
  t = as_batch(t, B, "t", dev)
  if t ~= t0 then own(t) end
  if g ~= nil then
    local g0 = g
    g = as_batch(g, B, "guidance", dev)
    if g ~= g0 then own(g) end
  end

  local nt = context.shape[2]
  local ids = M.position_ids(nt, h // 2, w // 2)
  local packed = own(M.pack(x))
  local n_img = packed.shape[2]   -- the tokens the prediction keeps
  if refs then  -- Kontext: the references' tokens after the image's
    local sizes, parts = {}, { packed }
    for i, r in ipairs(refs) do
      sizes[i] = { r.shape[3], r.shape[4] }
      local p = own(M.pack(place(r)))
      if p.shape[1] ~= B then p = own(own(p:expand({ B, p.shape[2], p.shape[3] })):contiguous()) end
      parts[#parts + 1] = p
    end
    M.reference_ids(sizes, ids)
    packed = own(kiln.cat(parts, 2))
  end
  local cos, sin = M.rope_tables(ids, cfg.axes_dim, cfg.theta, dev, dt)
  own(cos); own(sin)
  -- opts.cache_state (kiln.step_cache): the first double block may decide that the rest
  -- of the network is replaced by an earlier step's residual; a streamed pass copies no
  -- block ahead until then
  local cs = cfg.depth > 0 and opts.cache_state or nil
  if cs then cs:begin(t:table()[1], x.shape) end
  local _cs <close> = cs and setmetatable({}, { __close = function() cs:finish(); pass:hold_prefetch(false) end }) or nil
  if cs and cs:pending() then pass:hold_prefetch(true) end
  local img, txt, vs = pass:run("in.", self._in, self, packed, context, t, y, g, dev, dt)
  local ic
  for b = 0, cfg.depth - 1 do
    local p = fmt("double_blocks.%d.", b)
    local i2, t2 = pass:run(p, b == 0 and cs and self._first_double or self._double, self, p, img, txt, vs, cos, sin, cs)
    if cs then pass:hold_prefetch(false) end
    img:free(); txt:free()
    img, txt = i2, t2
    if not txt then break end   -- the cache replaced the rest: img is the last block's
  end
  if txt then
    local xs = kiln.cat({ txt, img }, 2)
    local ni = img.shape[2]
    img:free(); txt:free()
    for b = 0, cfg.depth_single - 1 do
      local x2 = pass:run(fmt("single_blocks.%d.", b), self._single, self, fmt("single_blocks.%d.", b), xs, vs, cos, sin)
      xs:free()
      xs = x2
    end
    local iv = xs:narrow(2, nt + 1, ni)
    ic = iv:contiguous()
    iv:free(); xs:free()
    if cs then cs:store_residual(ic) end
  else
    ic = img
  end
  if ic.shape[2] ~= n_img then  -- the references' tokens are not predicted
    local iv = ic:narrow(2, 1, n_img)
    local c = iv:contiguous()
    iv:free(); ic:free()
    ic = c
  end
  local o = pass:run("final_layer.", self._final, self, ic, vs)
  ic:free(); vs:free()
  local out = M.unpack(o, h, w)
  o:free()
  if out.dtype ~= xdt then
    local c = out:to(xdt)
    out:free()
    out = c
  end
  return out
end

return M
