-- kiln.mmdit: Stability AI's MMDiT / MMDiT-X (Stable Diffusion 3 and 3.5) over kiln.nn,
-- as their sd3.5 code defines it: a patch embedding plus a learned 2-D position table
-- cropped to the latent's size, a vector c = t_embedder(t) + y_embedder(pooled text),
-- joint blocks that run one attention over the context tokens and the image tokens with
-- separate weights per stream (adaLN modulation from c, optional RMS q/k norms, and in
-- MMDiT-X's first blocks a second, image-only attention), the last block's context
-- stream reduced to what the attention needs (pre_only), and the final adaLN layer.
-- Files carry no configuration, so every width is read from the tensors as the
-- reference's loader does (mmdit.config); mmdit.expected(cfg) lists what it reads, so
-- the loader checks a file before anything runs. Blocks stream one by one in memory
-- mode "low" (kiln.stream), as Flux's and the UNet's.
--
--   local dit = mmdit.new(weights, cfg)       -- names relative to the network's root
--   local v = dit:forward(x, t, context, y [, {skip_layers = {7, 8, 9}}])
--     x [B, 16, h, w] latent, t [B] the model's timestep (sigma * 1000), context
--     [B, L, 4096] (CLIP-L | bigG | T5 states), y [B, 2048] (the pooled CLIP vectors)
--     -> the velocity [B, 16, h, w]; skip_layers: 0-based block indices left out, as
--     MMDiTX.forward's (skip-layer guidance)
--
-- __metadata__ keys read: kiln.mmdit.heads (default hidden / 64, the reference's
-- "head size of 64").
--
-- diffusers' SD3Transformer2DModel keeps q, k and v apart and the two halves of its
-- last adaLN norms (the final layer's, the pre_only context block's) as (scale, shift):
-- kiln.families.sd3 names its tensors in this module's names with ".q" / ".k" / ".v"
-- in place of ".qkv" (cfg.split_qkv: three products instead of one, no fused copy) and
-- loads it with config(shapes, meta, {diffusers = true}) (cfg.swapped_halves).
local kiln = require "kiln"
local util = require "kiln.util"
local stream = require "kiln.stream"
local ops = require "kiln.dit_ops"
local unet = require "kiln.unet"
local nn = kiln.nn

local M = {}
local MMDiT = {}
MMDiT.__index = MMDiT
M.MMDiT = MMDiT

local fmt = string.format
local scope, rms_norm, as_batch, shape_of = ops.scope, ops.rms_norm, ops.as_batch, ops.shape_of
local function meta_int(meta, key) return ops.meta_int(meta, key, "MMDiT") end

M.HEAD_DIM = 64     -- the reference's heads = hidden / 64
M.TIME_DIM = 256    -- the sinusoidal embedding the timestep MLP takes

-- ---------------------------------------------------------------- configuration

local function need(shapes, name, what) return util.need_shape(shapes, name, what, "MMDiT") end

local function isqrt(n)
  local r = math.floor(math.sqrt(n) + 0.5)
  if r * r == n then return r end
  return nil
end

--- Reads the architecture from name -> shape (names relative to the network root) and
-- the file's metadata: {hidden, heads, head_dim, depth, patch, in_channels,
-- out_channels, pos_embed_max_size, context_dim, adm_dim, mlp_hidden, qk_norm,
-- qkv_bias, x_self_attn = {[i] = true, ...} (0-based), x_self_attn_layers (a sorted
-- list), pre_only_last}.
function M.config(shapes, meta, opts)
  local cfg = {}
  cfg.split_qkv = shapes["joint_blocks.0.x_block.attn.q.weight"] ~= nil
  cfg.swapped_halves = opts and opts.diffusers or false
  local QKV = cfg.split_qkv and ".q" or ".qkv"
  local pe = need(shapes, "x_embedder.proj.weight", "the hidden size, in_channels and patch size")
  if #pe ~= 4 or pe[3] ~= pe[4] then
    error(fmt("MMDiT: x_embedder.proj.weight is %s, expected [hidden, channels, p, p]", util.shape_str(pe)), 0)
  end
  cfg.hidden, cfg.in_channels, cfg.patch = pe[1], pe[2], pe[3]
  local pos = need(shapes, "pos_embed", "pos_embed_max_size")
  if #pos ~= 3 or pos[1] ~= 1 or pos[3] ~= cfg.hidden then
    error(fmt("MMDiT: pos_embed is %s, expected [1, n, %d]", util.shape_str(pos), cfg.hidden), 0)
  end
  cfg.pos_embed_max_size = isqrt(pos[2])
  if not cfg.pos_embed_max_size then
    error(fmt("MMDiT: pos_embed has %d positions, not a square grid", pos[2]), 0)
  end
  cfg.context_dim = need(shapes, "context_embedder.weight", "the context width")[2]
  cfg.adm_dim = need(shapes, "y_embedder.mlp.0.weight", "the pooled vector's width")[2]
  local fl = need(shapes, "final_layer.linear.weight", "out_channels")
  if fl[1] % (cfg.patch * cfg.patch) ~= 0 then
    error(fmt("MMDiT: final_layer.linear.weight gives %d features, not %dx%d patches", fl[1], cfg.patch, cfg.patch), 0)
  end
  cfg.out_channels = fl[1] // (cfg.patch * cfg.patch)
  cfg.depth = util.count_indices(shapes, "^joint_blocks%.(%d+)%.")
  if cfg.depth < 1 then error("MMDiT: no joint_blocks.N.* tensors", 0) end
  -- a hole in the numbering: a partial or damaged file, said by block
  for b = 0, cfg.depth - 1 do
    local n = fmt("joint_blocks.%d.x_block.attn%s.weight", b, QKV)
    if not shapes[n] then
      error(fmt("MMDiT: block joint_blocks.%d is missing (no %s; the file has joint_blocks up to %d): a partial " ..
        "or damaged file?", b, n, cfg.depth - 1), 0)
    end
  end
  cfg.mlp_hidden = need(shapes, "joint_blocks.0.x_block.mlp.fc1.weight", "the MLP width")[1]
  cfg.mlp_ratio = cfg.mlp_hidden / cfg.hidden
  cfg.qkv_bias = shapes["joint_blocks.0.x_block.attn" .. QKV .. ".bias"] ~= nil
  -- as the reference: RMS q/k norms when block 0 has them (SD 3.5), MMDiT-X's second
  -- attention in the blocks whose x stream has attn2
  cfg.qk_norm = shapes["joint_blocks.0.context_block.attn.ln_k.weight"] ~= nil
  cfg.x_self_attn, cfg.x_self_attn_layers = {}, {}
  for b = 0, cfg.depth - 1 do
    if shapes[fmt("joint_blocks.%d.x_block.attn2%s.weight", b, QKV)] then
      cfg.x_self_attn[b] = true
      cfg.x_self_attn_layers[#cfg.x_self_attn_layers + 1] = b
    end
  end
  -- the reference builds the last block's context stream pre_only (no proj, no MLP)
  cfg.pre_only_last = shapes[fmt("joint_blocks.%d.context_block.mlp.fc1.weight", cfg.depth - 1)] == nil
  cfg.heads = meta_int(meta, "kiln.mmdit.heads") or cfg.hidden // M.HEAD_DIM
  if cfg.heads < 1 or cfg.hidden % cfg.heads ~= 0 then
    error(fmt("MMDiT: hidden size %d does not split into heads of %d (set __metadata__ kiln.mmdit.heads)",
      cfg.hidden, M.HEAD_DIM), 0)
  end
  cfg.head_dim = cfg.hidden // cfg.heads
  cfg.summary = fmt("hidden %d, %d heads, %d joint blocks%s, patch %d, pos %dx%d, mlp %d, context %d, pooled %d%s",
    cfg.hidden, cfg.heads, cfg.depth,
    #cfg.x_self_attn_layers > 0 and fmt(" (x self-attention in %d)", #cfg.x_self_attn_layers) or "",
    cfg.patch, cfg.pos_embed_max_size, cfg.pos_embed_max_size, cfg.mlp_hidden, cfg.context_dim, cfg.adm_dim,
    cfg.qk_norm and ", q/k RMS norm" or "")
  return cfg
end

-- Every tensor the network reads, in order: a list of {name, shape}.
function M.expected(cfg)
  local list = {}
  local H, Mh, D, p = cfg.hidden, cfg.mlp_hidden, cfg.head_dim, cfg.patch
  local function add(name, shape) list[#list + 1] = { name, shape } end
  local function lin(n, o, i, bias)
    add(n .. ".weight", { o, i })
    if bias ~= false then add(n .. ".bias", { o }) end
  end
  add("x_embedder.proj.weight", { H, cfg.in_channels, p, p }); add("x_embedder.proj.bias", { H })
  add("pos_embed", { 1, cfg.pos_embed_max_size * cfg.pos_embed_max_size, H })
  lin("t_embedder.mlp.0", H, M.TIME_DIM); lin("t_embedder.mlp.2", H, H)
  lin("y_embedder.mlp.0", H, cfg.adm_dim); lin("y_embedder.mlp.2", H, H)
  lin("context_embedder", H, cfg.context_dim)
  local function attn(n)
    if cfg.split_qkv then
      for _, q in ipairs({ ".q", ".k", ".v" }) do lin(n .. q, H, H, cfg.qkv_bias) end
    else
      lin(n .. ".qkv", 3 * H, H, cfg.qkv_bias)
    end
    if cfg.qk_norm then add(n .. ".ln_q.weight", { D }); add(n .. ".ln_k.weight", { D }) end
  end
  for b = 0, cfg.depth - 1 do
    for _, s in ipairs({ "context_block", "x_block" }) do
      local n = fmt("joint_blocks.%d.%s.", b, s)
      local pre_only = s == "context_block" and b == cfg.depth - 1 and cfg.pre_only_last
      local x2 = s == "x_block" and cfg.x_self_attn[b]
      local mods = x2 and 9 or (pre_only and 2 or 6)
      lin(n .. "adaLN_modulation.1", mods * H, H)
      attn(n .. "attn")
      if not pre_only then lin(n .. "attn.proj", H, H) end
      if x2 then attn(n .. "attn2"); lin(n .. "attn2.proj", H, H) end
      if not pre_only then lin(n .. "mlp.fc1", Mh, H); lin(n .. "mlp.fc2", H, Mh) end
    end
  end
  lin("final_layer.linear", p * p * cfg.out_channels, H)
  lin("final_layer.adaLN_modulation.1", 2 * H, H)
  return list
end

-- The streaming block of a tensor: "in." (patch, position and vector embedders),
-- "joint_blocks.N.", "final_layer.".
function M.block_of(name)
  local k = name:match("^(joint_blocks%.%d+%.)")
  if k then return k end
  if name:match("^final_layer%.") then return "final_layer." end
  if name:match("^x_embedder%.") or name == "pos_embed" or name:match("^t_embedder%.") or
      name:match("^y_embedder%.") or name:match("^context_embedder%.") then
    return "in."
  end
  return nil
end

function M.new(weights, cfg)
  local self = setmetatable({ weights = weights, config = cfg }, MMDiT)
  self.streamer = stream.new(weights, stream.blocks(M.expected(cfg), M.block_of), "dit")
  return self
end

function MMDiT:w(name) return self.weights:tensor(name) end

function MMDiT:_device() return ops.weights_device(self.weights, "x_embedder.proj.weight") end

-- ---------------------------------------------------------------- pieces

local modulate, layer_norm = ops.modulate, ops.layer_norm

-- The n chunks [B, 1, H] of an adaLN modulation linear over silu(c).
function MMDiT:_mod(n, cs, count)
  local H = self.config.hidden
  local o = nn.linear(cs, self:w(n .. ".weight"), self:w(n .. ".bias"))
  local o3 = o:reshape({ o.shape[1], 1, count * H })
  o:free()
  local r = {}
  for i = 1, count do r[i] = o3:narrow(3, (i - 1) * H + 1, H):contiguous() end
  o3:free()
  return r
end

-- A SelfAttention's pre_attention over a modulated input h [B, L, H] -> q, k, v
-- [B, heads, L, D] (q and k RMS-normed per head when the file has ln_q / ln_k).
function MMDiT:_qkv(n, h)
  local cfg = self.config
  local S = scope()
  local k = S.k
  local B, L = h.shape[1], h.shape[2]
  local q, kk, v
  if cfg.split_qkv then
    local function one(s, keep)
      local o = k(nn.linear(h, self:w(n .. s .. ".weight"), cfg.qkv_bias and self:w(n .. s .. ".bias") or nil))
      local r = k(o:reshape({ B, L, cfg.heads, cfg.head_dim }))
      local c = k(r:transpose(2, 3)):contiguous()                  -- [B, heads, L, D]
      if not keep then k(c) end
      return c
    end
    q, kk, v = one(".q"), one(".k"), one(".v", true)
  else
    local qkv = k(nn.linear(h, self:w(n .. ".qkv.weight"), cfg.qkv_bias and self:w(n .. ".qkv.bias") or nil))
    local r5 = k(qkv:reshape({ B, L, 3, cfg.heads, cfg.head_dim }))
    local pm = k(k(r5:permute({ 3, 1, 4, 2, 5 })):contiguous())   -- [3, B, heads, L, D]
    q, kk, v = k(pm:select(1, 1)), k(pm:select(1, 2)), pm:select(1, 3)
  end
  if cfg.qk_norm then
    q = rms_norm(q, self:w(n .. ".ln_q.weight"))
    kk = rms_norm(kk, self:w(n .. ".ln_k.weight"))
  else
    q, kk = q:contiguous(), kk:contiguous()
  end
  return S.done(q, kk, v)
end

-- Attention over [B, heads, L, D] -> [B, L, H].
local function attend(q, k, v)
  local o = nn.attention(q, k, v)
  local B, Hh, L, D = o.shape[1], o.shape[2], o.shape[3], o.shape[4]
  local ot = o:transpose(2, 3)
  local oc = ot:contiguous()
  ot:free(); o:free()
  local r = oc:reshape({ B, L, Hh * D })
  oc:free()
  return r
end

local function mlp2(self, n, x, a, b)
  local h = nn.linear(x, self:w(n .. a .. ".weight"), self:w(n .. a .. ".bias"))
  local hs = nn.silu(h)
  h:free()
  local r = nn.linear(hs, self:w(n .. b .. ".weight"), self:w(n .. b .. ".bias"))
  hs:free()
  return r
end

-- ---------------------------------------------------------------- blocks

-- The cropped position table [1, (h/p)(w/p), H]: the centre of the max x max grid.
function MMDiT:_pos(hp, wp)
  local S = scope()
  local k = S.k
  local m = self.config.pos_embed_max_size
  local top, left = (m - hp) // 2, (m - wp) // 2
  local w = self:w("pos_embed")
  -- a block-quantized table (GGUF) is decoded first: only plain floats narrow
  if w.dtype ~= "f32" and w.dtype ~= "f16" and w.dtype ~= "bf16" then w = k(w:to("f32")) end
  local g = k(w:reshape({ 1, m, m, self.config.hidden }))
  local c = k(k(k(g:narrow(2, top + 1, hp)):narrow(3, left + 1, wp)):contiguous())
  return S.done(c:reshape({ 1, hp * wp, self.config.hidden }))
end

-- x_embedder + the cropped positions, the context embedder, and silu(c) with
-- c = t_embedder(t) + y_embedder(y).
function MMDiT:_in(x, context, t, y, dev, dt)
  local cfg = self.config
  local S = scope()
  local k = S.k
  local p = cfg.patch
  local pe = k(nn.conv2d(x, self:w("x_embedder.proj.weight"), self:w("x_embedder.proj.bias"), { stride = p }))
  local B, hp, wp = pe.shape[1], pe.shape[3], pe.shape[4]
  local flat = k(pe:reshape({ B, cfg.hidden, hp * wp }))
  local tokens = k(k(flat:transpose(2, 3)):contiguous())   -- [B, L, H]
  local pos = k(self:_pos(hp, wp))
  if pos.dtype ~= tokens.dtype then pos = k(pos:to(tokens.dtype)) end
  local img = tokens + pos
  local ctx = nn.linear(context, self:w("context_embedder.weight"), self:w("context_embedder.bias"))
  local e = k(unet.timestep_embedding(t, M.TIME_DIM, dev))
  if e.dtype ~= dt then e = k(e:to(dt)) end
  local c = k(k(mlp2(self, "t_embedder.", e, "mlp.0", "mlp.2")) + k(mlp2(self, "y_embedder.", y, "mlp.0", "mlp.2")))
  return S.done(img, ctx, nn.silu(c))
end

-- One joint block (the reference's block_mixing): context [B, Lc, H] (nil after a
-- pre_only block), x [B, Lx, H] -> context', x'. Every temporary is freed at its last
-- use, not at the block's end: at 1024x1024 a block's image-stream temporaries held
-- together would outweigh the block's weights several times over, so the peak is what
-- one MLP needs (its input, hidden states and their GELU) beside the streams.
function MMDiT:_joint(b, context, x, cs)
  local cfg = self.config
  local S = scope()
  local k = S.k
  local cn, xn = fmt("joint_blocks.%d.context_block.", b), fmt("joint_blocks.%d.x_block.", b)
  local pre_only = b == cfg.depth - 1 and cfg.pre_only_last
  local x2 = cfg.x_self_attn[b]
  local cm = self:_mod(cn .. "adaLN_modulation.1", cs, pre_only and 2 or 6)
  if pre_only and cfg.swapped_halves then cm[1], cm[2] = cm[2], cm[1] end
  local xm = self:_mod(xn .. "adaLN_modulation.1", cs, x2 and 9 or 6)
  for _, v in ipairs(cm) do k(v) end
  for _, v in ipairs(xm) do k(v) end
  local function free(...) for i = 1, select("#", ...) do select(i, ...):free() end end
  -- modulate(layer_norm(v), shift, scale), the norm kept when `keep` (MMDiT-X reads it twice)
  local function norm_mod(v, shift, scale, keep)
    local nv = layer_norm(v)
    local r = modulate(nv, shift, scale)
    if keep then return r, nv end
    nv:free()
    return r
  end
  local function qkv_of(n, h)
    local q, kk, v = self:_qkv(n, h)
    h:free()
    return q, kk, v
  end
  local cq, ck, cv = qkv_of(cn .. "attn", norm_mod(context, cm[1], cm[2]))
  local xh, xnorm = norm_mod(x, xm[1], xm[2], x2)
  local xq, xk, xv = qkv_of(xn .. "attn", xh)
  local q = kiln.cat({ cq, xq }, 3); free(cq, xq)
  local kc = kiln.cat({ ck, xk }, 3); free(ck, xk)
  local v = kiln.cat({ cv, xv }, 3); free(cv, xv)
  local a = attend(q, kc, v)
  free(q, kc, v)
  local nc, nx = context.shape[2], x.shape[2]
  local function part(first, n)
    local view = a:narrow(2, first, n)
    local r = view:contiguous()
    view:free()
    return r
  end
  local ca = not pre_only and part(1, nc) or nil
  local xa = part(nc + 1, nx)
  a:free()
  -- the reference's post_attention: s + gate * proj(at) (+ MMDiT-X's term), then
  -- s1 + gate2 * mlp(modulate(layer_norm(s1)))
  local function post(n, s, m, at, extra)
    local pr = nn.linear(at, self:w(n .. "attn.proj.weight"), self:w(n .. "attn.proj.bias"))
    at:free()
    local g = m[3] * pr; pr:free()
    local s1 = s + g; g:free()
    if extra then
      local s2 = s1 + extra
      free(s1, extra)
      s1 = s2
    end
    local h = norm_mod(s1, m[4], m[5])
    local f = nn.linear(h, self:w(n .. "mlp.fc1.weight"), self:w(n .. "mlp.fc1.bias")); h:free()
    local gl = nn.gelu(f, "tanh"); f:free()
    local o = nn.linear(gl, self:w(n .. "mlp.fc2.weight"), self:w(n .. "mlp.fc2.bias")); gl:free()
    local go = m[6] * o; o:free()
    local r = s1 + go
    free(s1, go)
    return r
  end
  local ctx2 = nil
  if not pre_only then ctx2 = k(post(cn, context, cm, ca)) end
  local extra = nil
  if x2 then
    -- MMDiT-X: an image-only attention over the same normalised x, its own modulation
    local h2 = modulate(xnorm, xm[7], xm[8])
    xnorm:free()
    local q2, k2, v2 = qkv_of(xn .. "attn2", h2)
    local a2 = attend(q2, k2, v2)
    free(q2, k2, v2)
    local p2 = nn.linear(a2, self:w(xn .. "attn2.proj.weight"), self:w(xn .. "attn2.proj.bias"))
    a2:free()
    extra = xm[9] * p2
    p2:free()
  end
  local x2o = k(post(xn, x, xm, xa, extra))
  if ctx2 then return S.done(ctx2, x2o) end
  return nil, S.done(x2o)
end

function MMDiT:_final(x, cs)
  local S = scope()
  local k = S.k
  local m = self:_mod("final_layer.adaLN_modulation.1", cs, 2)
  k(m[1]); k(m[2])
  if self.config.swapped_halves then m[1], m[2] = m[2], m[1] end
  local h = k(modulate(k(layer_norm(x)), m[1], m[2]))
  return S.done(nn.linear(h, self:w("final_layer.linear.weight"), self:w("final_layer.linear.bias")))
end

--- [B, (h/p)(w/p), p*p*C] -> [B, C, h, w] (the reference's unpatchify: "nhwpqc->nchpwq").
function M.unpatchify(x, h, w, p, C)
  local B = x.shape[1]
  local r = x:reshape({ B, h // p, w // p, p, p, C })
  local q = r:permute({ 1, 6, 2, 4, 3, 5 })
  local c = q:contiguous()
  r:free(); q:free()
  local o = c:reshape({ B, C, h, w })
  c:free()
  return o
end

-- ---------------------------------------------------------------- forward

local function skip_set(list)
  local s = {}
  if list == nil then return s end
  if type(list) ~= "table" then error("dit:forward: opts.skip_layers must be a list of block indices", 3) end
  for _, i in ipairs(list) do
    if math.type(i) ~= "integer" then error("dit:forward: opts.skip_layers must hold integers (0-based)", 3) end
    s[i] = true
  end
  return s
end

-- x [B, C, h, w] (h, w multiples of the patch), t [B] the model's timestep (a number
-- serves the batch), context [B, L, context_dim], y [B, adm_dim]; opts.skip_layers ->
-- the velocity [B, C, h, w].
function MMDiT:forward(x, t, context, y, opts)
  local cfg = self.config
  opts = opts or {}
  local p = cfg.patch
  if not x or #x.shape ~= 4 or x.shape[2] ~= cfg.in_channels then
    error(fmt("dit:forward: x must be [B, %d, h, w], got %s", cfg.in_channels, shape_of(x)), 2)
  end
  local B, h, w = x.shape[1], x.shape[3], x.shape[4]
  if h % p ~= 0 or w % p ~= 0 then
    error(fmt("dit:forward: the latent's height and width must be multiples of the patch size %d, got %dx%d", p, h,
      w), 2)
  end
  if h // p > cfg.pos_embed_max_size or w // p > cfg.pos_embed_max_size then
    error(fmt("dit:forward: a %dx%d latent is %dx%d patches, more than the position table's %dx%d", h, w, h // p,
      w // p, cfg.pos_embed_max_size, cfg.pos_embed_max_size), 2)
  end
  if not context or #context.shape ~= 3 or context.shape[3] ~= cfg.context_dim then
    error(fmt("dit:forward: context must be [B, L, %d] (CLIP and T5 states), got %s", cfg.context_dim,
      shape_of(context)), 2)
  end
  if not y or #y.shape ~= 2 or y.shape[2] ~= cfg.adm_dim then
    error(fmt("dit:forward: y must be [B, %d] (the pooled CLIP vectors), got %s", cfg.adm_dim, shape_of(y)), 2)
  end
  if context.shape[1] ~= B then
    if context.shape[1] == 1 then context = context:expand({ B, context.shape[2], context.shape[3] })
    else error(fmt("dit:forward: context batch %d does not match x batch %d", context.shape[1], B), 2) end
  end
  if y.shape[1] ~= B then
    if y.shape[1] == 1 then y = y:expand({ B, y.shape[2] })
    else error(fmt("dit:forward: y batch %d does not match x batch %d", y.shape[1], B), 2) end
  end
  local skip = skip_set(opts.skip_layers)

  local order = nil
  if next(skip) then
    -- the skipped blocks are neither fetched nor prefetched
    order = { "in." }
    for b = 0, cfg.depth - 1 do
      if not skip[b] then order[#order + 1] = fmt("joint_blocks.%d.", b) end
    end
    order[#order + 1] = "final_layer."
  end
  local pass <close> = self.streamer:pass(order)
  local dev = self:_device()
  local xdt = x.dtype
  local act = kiln.activation_dtype(dev)
  local dt = act ~= "f32" and act or xdt
  local copies <close> = setmetatable({}, { __close = function(c) for _, v in ipairs(c) do v:free() end end })
  local function own(v) copies[#copies + 1] = v; return v end
  local function place(v)
    if v.device ~= dev then v = own(v:to(dev)) end
    if v.dtype ~= dt then v = own(v:to(dt)) end
    if not v:is_contiguous() then v = own(v:contiguous()) end
    return v
  end
  x, context, y = place(x), place(context), place(y)
  local t0 = t
  t = as_batch(t, B, "t", dev)
  if t ~= t0 then own(t) end

  local img, ctx, cs = pass:run("in.", self._in, self, x, context, t, y, dev, dt)
  for b = 0, cfg.depth - 1 do
    if not skip[b] then
      -- only the last block is pre_only (config), so ctx is there for every block
      local c2, i2 = pass:run(fmt("joint_blocks.%d.", b), self._joint, self, b, ctx, img, cs)
      img:free(); ctx:free()
      img, ctx = i2, c2
    end
  end
  if ctx then ctx:free() end
  local o = pass:run("final_layer.", self._final, self, img, cs)
  img:free(); cs:free()
  local out = M.unpatchify(o, h, w, p, cfg.out_channels)
  o:free()
  if out.dtype ~= xdt then
    local c = out:to(xdt)
    out:free()
    out = c
  end
  return out
end

return M
