-- kiln.unet: the CompVis / Stability UNetModel of SD 1.x, 2.x and SDXL, over kiln.nn.
-- Hyper-parameters come from the tensors (unet.config); the block plan mirrors
-- openaimodel.UNetModel.__init__, so unet.expected(cfg) lists every tensor it needs
-- with its shape, and the loader checks a file against it before anything runs.
--
--   local u = unet.new(weights, cfg)      -- weights:tensor(name) with names relative to
--                                          -- the UNet root ("input_blocks.1.0.in_layers.0.weight")
--   local eps = u:forward(x, t, context [, y])
--   u.tileable = "x" | "y" | "xy"            -- circular padding in the convolutions
--                                          -- (kiln.seamless); nil: zeros, as trained
local kiln = require "kiln"
local util = require "kiln.util"
local stream = require "kiln.stream"
local seamless = require "kiln.seamless"
local nn = kiln.nn

local M = {}
local UNet = {}
UNet.__index = UNet
M.UNet = UNet

local fmt = string.format

-- ---------------------------------------------------------------- configuration

local count_indices = util.count_indices

local function need(shapes, name, what) return util.need_shape(shapes, name, what, "UNet") end

-- Reads the architecture from a table of name -> shape (names relative to the UNet
-- root). opts: heads = n (every transformer) or head_dim = d (heads = channels / d).
function M.config(shapes, opts)
  opts = opts or {}
  local cfg = {}
  local ci = need(shapes, "input_blocks.0.0.weight", "in_channels and model_channels")
  cfg.model_channels, cfg.in_channels = ci[1], ci[2]
  cfg.time_embed_dim = need(shapes, "time_embed.0.weight", "the time embedding width")[1]
  cfg.out_channels = need(shapes, "out.2.weight", "out_channels")[1]
  local n_in = count_indices(shapes, "^input_blocks%.(%d+)%.")
  local downs = {}
  for i = 1, n_in - 1 do
    if shapes[fmt("input_blocks.%d.0.op.weight", i)] then downs[#downs + 1] = i end
  end
  local nrb = (downs[1] or n_in) - 1
  local levels = #downs + 1
  if nrb < 1 or n_in ~= 1 + levels * nrb + (levels - 1) then
    error(fmt("UNet: %d input blocks with downsamplers at %s do not form levels of equal size",
      n_in, table.concat(downs, ",")), 0)
  end
  cfg.num_res_blocks, cfg.levels = nrb, levels
  cfg.channel_mult, cfg.attention, cfg.transformer_depth = {}, {}, {}
  local mc = cfg.model_channels
  for l = 0, levels - 1 do
    local b = 1 + l * (nrb + 1)
    local out = need(shapes, fmt("input_blocks.%d.0.in_layers.2.weight", b), "channel_mult")[1]
    if out % mc ~= 0 then error(fmt("UNet: level %d has %d channels, not a multiple of %d", l + 1, out, mc), 0) end
    cfg.channel_mult[l + 1] = out // mc
    local depth = count_indices(shapes, fmt("^input_blocks%%.%d%%.1%%.transformer_blocks%%.(%%d+)%%.", b))
    cfg.attention[l + 1] = depth > 0
    cfg.transformer_depth[l + 1] = depth
  end
  cfg.transformer_depth_middle = count_indices(shapes, "^middle_block%.1%.transformer_blocks%.(%d+)%.")
  -- context width and projection kind from the first transformer
  for name, s in pairs(shapes) do
    if name:match("%.1%.transformer_blocks%.0%.attn2%.to_k%.weight$") then cfg.context_dim = s[2] end
    if name:match("%.1%.proj_in%.weight$") then cfg.linear_proj = #s == 2 end
  end
  local le = shapes["label_emb.0.0.weight"]
  cfg.adm_in_channels = le and le[2] or nil
  cfg.heads, cfg.head_dim = opts.heads, opts.head_dim
  if not cfg.heads and not cfg.head_dim then cfg.head_dim = 64 end
  return cfg
end

-- Attention heads for a transformer of ch channels.
function M.heads_for(cfg, ch)
  if cfg.heads then return cfg.heads end
  local h = ch // cfg.head_dim
  if h < 1 or ch % cfg.head_dim ~= 0 then
    error(fmt("UNet: %d channels do not split into heads of %d (set metadata kiln.heads.unet or kiln.head_dim.unet)",
      ch, cfg.head_dim), 0)
  end
  return h
end

-- ---------------------------------------------------------------- block plan

-- The blocks as UNetModel.__init__ builds them: each a list of layers
-- {kind = "conv"|"res"|"attn"|"down"|"up", prefix = "input_blocks.1.0.", ...}.
function M.plan(cfg)
  local mc, nrb, mult = cfg.model_channels, cfg.num_res_blocks, cfg.channel_mult
  local plan = { input = {}, middle = nil, output = {} }
  local function res(prefix, cin, cout) return { kind = "res", prefix = prefix, cin = cin, cout = cout } end
  local function attn(prefix, ch, depth)
    return { kind = "attn", prefix = prefix, ch = ch, depth = depth, heads = M.heads_for(cfg, ch) }
  end
  plan.input[1] = { prefix = "input_blocks.0.", { kind = "conv", prefix = "input_blocks.0.0.", cin = cfg.in_channels, cout = mc } }
  local chans, ch, idx = { mc }, mc, 1
  for l = 1, cfg.levels do
    for _ = 1, nrb do
      local p = fmt("input_blocks.%d.", idx)
      local blk = { prefix = p, res(p .. "0.", ch, mult[l] * mc) }
      ch = mult[l] * mc
      if cfg.attention[l] then blk[2] = attn(p .. "1.", ch, cfg.transformer_depth[l]) end
      plan.input[#plan.input + 1] = blk
      chans[#chans + 1] = ch
      idx = idx + 1
    end
    if l ~= cfg.levels then
      local p = fmt("input_blocks.%d.", idx)
      plan.input[#plan.input + 1] = { prefix = p, { kind = "down", prefix = p .. "0.", ch = ch } }
      chans[#chans + 1] = ch
      idx = idx + 1
    end
  end
  plan.middle = { prefix = "middle_block.", res("middle_block.0.", ch, ch) }
  if cfg.transformer_depth_middle > 0 then
    plan.middle[2] = attn("middle_block.1.", ch, cfg.transformer_depth_middle)
    plan.middle[3] = res("middle_block.2.", ch, ch)
  else
    plan.middle[2] = res("middle_block.1.", ch, ch)
  end
  idx = 0
  for l = cfg.levels, 1, -1 do
    for i = 0, nrb do
      local p = fmt("output_blocks.%d.", idx)
      local skip = table.remove(chans)
      local blk = { prefix = p, res(p .. "0.", ch + skip, mc * mult[l]) }
      ch = mc * mult[l]
      if cfg.attention[l] then blk[#blk + 1] = attn(p .. #blk .. ".", ch, cfg.transformer_depth[l]) end
      if l > 1 and i == nrb then blk[#blk + 1] = { kind = "up", prefix = p .. #blk .. ".", ch = ch } end
      plan.output[#plan.output + 1] = blk
      idx = idx + 1
    end
  end
  plan.out_channels = ch
  return plan
end

-- Every tensor the network reads, in order: a list of {name, shape}.
function M.expected(cfg)
  local list = {}
  local function add(name, shape) list[#list + 1] = { name, shape } end
  local ted, mc = cfg.time_embed_dim, cfg.model_channels
  add("time_embed.0.weight", { ted, mc }); add("time_embed.0.bias", { ted })
  add("time_embed.2.weight", { ted, ted }); add("time_embed.2.bias", { ted })
  if cfg.adm_in_channels then
    add("label_emb.0.0.weight", { ted, cfg.adm_in_channels }); add("label_emb.0.0.bias", { ted })
    add("label_emb.0.2.weight", { ted, ted }); add("label_emb.0.2.bias", { ted })
  end
  local function layer(ly)
    local p = ly.prefix
    if ly.kind == "conv" then
      add(p .. "weight", { ly.cout, ly.cin, 3, 3 }); add(p .. "bias", { ly.cout })
    elseif ly.kind == "res" then
      add(p .. "in_layers.0.weight", { ly.cin }); add(p .. "in_layers.0.bias", { ly.cin })
      add(p .. "in_layers.2.weight", { ly.cout, ly.cin, 3, 3 }); add(p .. "in_layers.2.bias", { ly.cout })
      add(p .. "emb_layers.1.weight", { ly.cout, ted }); add(p .. "emb_layers.1.bias", { ly.cout })
      add(p .. "out_layers.0.weight", { ly.cout }); add(p .. "out_layers.0.bias", { ly.cout })
      add(p .. "out_layers.3.weight", { ly.cout, ly.cout, 3, 3 }); add(p .. "out_layers.3.bias", { ly.cout })
      if ly.cin ~= ly.cout then
        add(p .. "skip_connection.weight", { ly.cout, ly.cin, 1, 1 }); add(p .. "skip_connection.bias", { ly.cout })
      end
    elseif ly.kind == "attn" then
      local c = ly.ch
      local proj = cfg.linear_proj and { c, c } or { c, c, 1, 1 }
      add(p .. "norm.weight", { c }); add(p .. "norm.bias", { c })
      add(p .. "proj_in.weight", proj); add(p .. "proj_in.bias", { c })
      for d = 0, ly.depth - 1 do
        local b = fmt("%stransformer_blocks.%d.", p, d)
        add(b .. "attn1.to_q.weight", { c, c }); add(b .. "attn1.to_k.weight", { c, c })
        add(b .. "attn1.to_v.weight", { c, c })
        add(b .. "attn1.to_out.0.weight", { c, c }); add(b .. "attn1.to_out.0.bias", { c })
        add(b .. "ff.net.0.proj.weight", { 8 * c, c }); add(b .. "ff.net.0.proj.bias", { 8 * c })
        add(b .. "ff.net.2.weight", { c, 4 * c }); add(b .. "ff.net.2.bias", { c })
        add(b .. "attn2.to_q.weight", { c, c }); add(b .. "attn2.to_k.weight", { c, cfg.context_dim })
        add(b .. "attn2.to_v.weight", { c, cfg.context_dim })
        add(b .. "attn2.to_out.0.weight", { c, c }); add(b .. "attn2.to_out.0.bias", { c })
        for n = 1, 3 do
          add(fmt("%snorm%d.weight", b, n), { c }); add(fmt("%snorm%d.bias", b, n), { c })
        end
      end
      add(p .. "proj_out.weight", proj); add(p .. "proj_out.bias", { c })
    elseif ly.kind == "down" then
      add(p .. "op.weight", { ly.ch, ly.ch, 3, 3 }); add(p .. "op.bias", { ly.ch })
    elseif ly.kind == "up" then
      add(p .. "conv.weight", { ly.ch, ly.ch, 3, 3 }); add(p .. "conv.bias", { ly.ch })
    end
  end
  local plan = M.plan(cfg)
  for _, blk in ipairs(plan.input) do for _, ly in ipairs(blk) do layer(ly) end end
  for _, ly in ipairs(plan.middle) do layer(ly) end
  for _, blk in ipairs(plan.output) do for _, ly in ipairs(blk) do layer(ly) end end
  add("out.0.weight", { plan.out_channels }); add("out.0.bias", { plan.out_channels })
  add("out.2.weight", { cfg.out_channels, mc, 3, 3 }); add("out.2.bias", { cfg.out_channels })
  return list
end

-- ---------------------------------------------------------------- network

-- The streaming block a tensor belongs to (its name relative to the UNet root):
-- "time_embed." (with SDXL's label_emb), "input_blocks.N.", "middle_block.",
-- "output_blocks.N.", "out.".
function M.block_of(name)
  local k = name:match("^(input_blocks%.%d+%.)") or name:match("^(output_blocks%.%d+%.)")
  if k then return k end
  if name:match("^middle_block%.") then return "middle_block." end
  if name:match("^time_embed%.") or name:match("^label_emb%.") then return "time_embed." end
  if name:match("^out%.") then return "out." end
  return nil
end

function M.new(weights, cfg)
  local self = setmetatable({ weights = weights, config = cfg }, UNet)
  self.plan = M.plan(cfg)
  self.streamer = stream.new(weights, stream.blocks(M.expected(cfg), M.block_of), "unet")
  return self
end

function UNet:w(name) return self.weights:tensor(name) end

-- A padded convolution: circular on the axes of self.tileable (kiln.seamless).
function UNet:_conv(x, w, b, opts) return seamless.conv2d(x, w, b, opts, self.tileable) end

-- The device the network runs on (the streaming target in mode "low").
function UNet:_device()
  local w = self.weights
  if w.device then return w:device("time_embed.0.weight") end
  local t = w:tensor("time_embed.0.weight")
  return t.device
end

-- CompVis timestep_embedding: [cos(t f), sin(t f)] with f_i = exp(-ln(10000) i / half).
function M.timestep_embedding(t, dim, device)
  local half = dim // 2
  -- the same f32 arithmetic as the reference; every temporary is freed at once
  local tmp = {}
  local function k(v) tmp[#tmp + 1] = v; return v end
  local r = k(k(kiln.arange(half)):to("f32"))
  if device and device ~= r.device then r = k(r:to(device)) end
  local freqs = k(k(k(r * -math.log(10000)) / half):exp())
  local n = t.shape[1]
  local tf = t.dtype == "f32" and t or k(t:to("f32"))
  if tf.device ~= r.device then tf = k(tf:to(r.device)) end
  local args = k(k(tf:reshape({ n, 1 })) * k(freqs:reshape({ 1, half })))
  local emb = kiln.cat({ k(args:cos()), k(args:sin()) }, 2)
  if dim % 2 == 1 then
    k(emb)
    emb = kiln.cat({ emb, k(k(kiln.zeros({ n, 1 })):to(emb.device)) }, 2)
  end
  for i = #tmp, 1, -1 do tmp[i]:free() end
  return emb
end

-- t:reshape(shape):transpose(a, b) as one new view (no handle left for the GC: a
-- view keeps its storage alive until it is freed or collected).
local function reshape_transpose(t, shape, a, b)
  local r = t:reshape(shape)
  local v = r:transpose(a, b)
  r:free()
  return v
end

-- A 1x1 convolution weight [out, in, 1, 1] as a linear weight [out, in]: always a new
-- view, which the caller frees (a streamed weight's storage must not outlive its block).
local function linear2d(w)
  return w:reshape({ w.shape[1], w.shape[2] })
end

function UNet:_resblock(ly, x, emb_silu)
  local p = ly.prefix
  local h = nn.group_norm(x, 32, self:w(p .. "in_layers.0.weight"), self:w(p .. "in_layers.0.bias"), 1e-5, { silu = true })
  local h2 = self:_conv(h, self:w(p .. "in_layers.2.weight"), self:w(p .. "in_layers.2.bias"), { padding = 1 })
  h:free()
  local e = nn.linear(emb_silu, self:w(p .. "emb_layers.1.weight"), self:w(p .. "emb_layers.1.bias"))
  local e4 = e:reshape({ e.shape[1], e.shape[2], 1, 1 })
  local h3 = h2 + e4
  h2:free(); e4:free(); e:free()
  local h4 = nn.group_norm(h3, 32, self:w(p .. "out_layers.0.weight"), self:w(p .. "out_layers.0.bias"), 1e-5, { silu = true })
  h3:free()
  local h5 = self:_conv(h4, self:w(p .. "out_layers.3.weight"), self:w(p .. "out_layers.3.bias"), { padding = 1 })
  h4:free()
  local out
  if ly.cin ~= ly.cout then
    local s = nn.conv2d(x, self:w(p .. "skip_connection.weight"), self:w(p .. "skip_connection.bias"))
    out = s + h5
    s:free()
  else
    out = x + h5
  end
  h5:free()
  return out
end

-- CrossAttention on x [B, L, C] (context [B, Lc, Cc], or x itself for attn1).
function UNet:_attention(p, x, context, heads)
  local ctx = context or x
  local q = nn.linear(x, self:w(p .. "to_q.weight"))
  local k = nn.linear(ctx, self:w(p .. "to_k.weight"))
  local v = nn.linear(ctx, self:w(p .. "to_v.weight"))
  local B, L, inner = q.shape[1], q.shape[2], q.shape[3]
  local Lk, d = k.shape[2], inner // heads
  local qh = reshape_transpose(q, { B, L, heads, d }, 2, 3)
  local kh = reshape_transpose(k, { B, Lk, heads, d }, 2, 3)
  local vh = reshape_transpose(v, { B, Lk, heads, d }, 2, 3)
  local o = nn.attention(qh, kh, vh)
  qh:free(); kh:free(); vh:free(); q:free(); k:free(); v:free()
  local ot = o:transpose(2, 3)
  local o2 = ot:contiguous()
  ot:free(); o:free()
  local o3 = o2:reshape({ B, L, inner })
  local r = nn.linear(o3, self:w(p .. "to_out.0.weight"), self:w(p .. "to_out.0.bias"))
  o3:free(); o2:free()
  return r
end

function UNet:_transformer_block(p, x, context, heads)
  local h = nn.layer_norm(x, self:w(p .. "norm1.weight"), self:w(p .. "norm1.bias"), 1e-5)
  local a = self:_attention(p .. "attn1.", h, nil, heads)
  h:free()
  local x1 = a + x
  a:free()
  h = nn.layer_norm(x1, self:w(p .. "norm2.weight"), self:w(p .. "norm2.bias"), 1e-5)
  a = self:_attention(p .. "attn2.", h, context, heads)
  h:free()
  local x2 = a + x1
  a:free(); x1:free()
  h = nn.layer_norm(x2, self:w(p .. "norm3.weight"), self:w(p .. "norm3.bias"), 1e-5)
  local g = nn.linear(h, self:w(p .. "ff.net.0.proj.weight"), self:w(p .. "ff.net.0.proj.bias"))
  h:free()
  local gg = nn.geglu(g)
  g:free()
  local f = nn.linear(gg, self:w(p .. "ff.net.2.weight"), self:w(p .. "ff.net.2.bias"))
  gg:free()
  local x3 = f + x2
  f:free(); x2:free()
  return x3
end

-- SpatialTransformer: both the 1x1-conv (SD 1.x) and linear (SD 2.x, SDXL) projections
-- are the same matrix product on [B, HW, C], so one path serves both.
function UNet:_spatial_transformer(ly, x, context)
  local p = ly.prefix
  local B, C, H, W = x.shape[1], x.shape[2], x.shape[3], x.shape[4]
  local n = nn.group_norm(x, 32, self:w(p .. "norm.weight"), self:w(p .. "norm.bias"), 1e-6)
  local pin = linear2d(self:w(p .. "proj_in.weight"))
  local nt = reshape_transpose(n, { B, C, H * W }, 2, 3)
  local h = nn.linear(nt, pin, self:w(p .. "proj_in.bias"))
  pin:free(); nt:free(); n:free()
  for d = 0, ly.depth - 1 do
    local h2 = self:_transformer_block(fmt("%stransformer_blocks.%d.", p, d), h, context, ly.heads)
    h:free()
    h = h2
  end
  local pout = linear2d(self:w(p .. "proj_out.weight"))
  local o = nn.linear(h, pout, self:w(p .. "proj_out.bias"))
  pout:free(); h:free()
  local ot = o:transpose(2, 3)
  local o2 = ot:contiguous()
  ot:free(); o:free()
  local o4 = o2:reshape({ B, C, H, W })
  local r = o4 + x
  o4:free(); o2:free()
  return r
end

-- up_hw {h, w}: the size of the skip connection the next output block concatenates,
-- which an "up" layer upsamples to (nearest), as ComfyUI's Upsample with output_shape;
-- it is twice x's size except where a downsampler rounded an odd size up.
function UNet:_layer(ly, x, emb_silu, context, up_hw)
  local p = ly.prefix
  if ly.kind == "res" then return self:_resblock(ly, x, emb_silu) end
  if ly.kind == "attn" then return self:_spatial_transformer(ly, x, context) end
  if ly.kind == "conv" then return self:_conv(x, self:w(p .. "weight"), self:w(p .. "bias"), { padding = 1 }) end
  if ly.kind == "down" then return self:_conv(x, self:w(p .. "op.weight"), self:w(p .. "op.bias"), { stride = 2, padding = 1 }) end
  if ly.kind == "up" then -- nearest 2x then the conv, fused where that is faster
    if up_hw and (up_hw[1] ~= 2 * x.shape[3] or up_hw[2] ~= 2 * x.shape[4]) then
      local u = nn.interpolate(x, { size = up_hw, mode = "nearest" })
      local r = self:_conv(u, self:w(p .. "conv.weight"), self:w(p .. "conv.bias"), { padding = 1 })
      u:free()
      return r
    end
    return self:_conv(x, self:w(p .. "conv.weight"), self:w(p .. "conv.bias"), { padding = 1, upsample = 2 })
  end
  error("UNet: unknown layer kind " .. tostring(ly.kind))
end

-- Runs one block; frees every intermediate but never the block's input.
function UNet:_block(blk, x, emb_silu, context, up_hw)
  local h = x
  for _, ly in ipairs(blk) do
    local nxt = self:_layer(ly, h, emb_silu, context, up_hw)
    if h ~= x then h:free() end
    h = nxt
  end
  return h
end

local function as_timesteps(t, B, device)
  if type(t) == "number" then t = kiln.tensor({ t }) end
  if type(t) == "table" and getmetatable(t) == nil then t = kiln.tensor(t) end
  if #t.shape == 0 then t = t:reshape({ 1 }) end
  if #t.shape ~= 1 then error(fmt("unet:forward: t must be a 1-D tensor of timesteps, got %d dims", #t.shape), 3) end
  if t.shape[1] == 1 and B > 1 then t = t:expand({ B }) end
  if t.shape[1] ~= B then error(fmt("unet:forward: %d timesteps for a batch of %d", t.shape[1], B), 3) end
  if t.device ~= device then t = t:to(device) end
  return t
end

-- x [B, in_channels, h, w], t (1-D, B timesteps 0..999), context [B, L, context_dim],
-- y [B, adm_in_channels] (SDXL). Returns the raw network output [B, out_channels, h, w].
-- opts.control: a ControlNet's residuals (one per input block, then the middle block),
-- added as ControlledUnetModel does: the last to the middle block's output, the others
-- to the skip connections the output blocks take. opts.free_control: the UNet takes
-- the residuals over and frees each at its last use (the list's entries become
-- false), so the largest, at full latent size, are gone before the last output blocks
-- run; on an error the rest are freed too.
function UNet:forward(x, t, context, y, opts)
  local cfg = self.config
  local control = opts and opts.control
  local _ <close> = opts and opts.free_control and control and setmetatable({}, { __close = function()
    for i, r in ipairs(control) do if r then r:free(); control[i] = false end end
  end }) or nil
  if control and #control ~= #self.plan.input + 1 then
    error(fmt("unet:forward: control has %d residuals, this UNet takes %d (one per input block and the middle block)",
      #control, #self.plan.input + 1), 2)
  end
  if #x.shape ~= 4 or x.shape[2] ~= cfg.in_channels then
    error(fmt("unet:forward: x must be [B, %d, h, w], got [%s]", cfg.in_channels, table.concat(x.shape, ", ")), 2)
  end
  if not context or #context.shape ~= 3 or context.shape[3] ~= cfg.context_dim then
    error(fmt("unet:forward: context must be [B, L, %d], got %s", cfg.context_dim,
      context and ("[" .. table.concat(context.shape, ", ") .. "]") or "nil"), 2)
  end
  local B = x.shape[1]
  if context.shape[1] ~= B then
    if context.shape[1] == 1 then context = context:expand({ B, context.shape[2], context.shape[3] })
    else error(fmt("unet:forward: context batch %d does not match x batch %d", context.shape[1], B), 2) end
  end
  if cfg.adm_in_channels and not y then
    error(fmt("unet:forward: this UNet (SDXL) needs y [B, %d] (pooled text + size conditioning)", cfg.adm_in_channels), 2)
  end
  if y and not cfg.adm_in_channels then error("unet:forward: y given but this UNet has no label embedding", 2) end
  if y and (#y.shape ~= 2 or y.shape[2] ~= cfg.adm_in_channels) then
    error(fmt("unet:forward: y must be [B, %d], got [%s]", cfg.adm_in_channels, table.concat(y.shape, ", ")), 2)
  end
  local pass <close> = self.streamer:pass()
  local dev = self:_device()
  -- the activations' dtype: the device's under a half precision (f16 / bf16 on a GPU,
  -- kiln.activation_dtype), else x's own; the output goes back to x's dtype
  local xdt = x.dtype
  local act = kiln.activation_dtype(dev)
  local dt = act ~= "f32" and act or xdt
  -- copies made here are freed when the pass ends (x itself is the caller's)
  local copies <close> = setmetatable({}, { __close = function(c) for _, v in ipairs(c) do v:free() end end })
  local function own(v) copies[#copies + 1] = v; return v end
  if x.device ~= dev then x = own(x:to(dev)) end
  if x.dtype ~= dt then x = own(x:to(dt)) end
  if context.device ~= dev then context = own(context:to(dev)) end
  if context.dtype ~= dt then context = own(context:to(dt)) end
  local t0 = t
  t = as_timesteps(t, B, dev)
  if t ~= t0 then own(t) end

  -- opts.cache_state (kiln.step_cache): may replace the deeper blocks by what an earlier
  -- step computed; a streamed pass holds its prefetch until the cache has decided, so
  -- the blocks it skips are never copied
  local cs = opts and opts.cache_state
  if cs then cs:begin(t:table()[1], x.shape) end
  local _cs <close> = cs and setmetatable({}, { __close = function() cs:finish(); pass:hold_prefetch(false) end }) or nil
  if cs and cs:pending() then pass:hold_prefetch(true) end
  local n_out = #self.plan.output
  local resume = 1

  local emb_silu = pass:run("time_embed.", self._embed, self, t, y, dev, dt)
  local hs = {}
  local h = x
  for i, blk in ipairs(self.plan.input) do
    h = pass:run(blk.prefix, self._block, self, blk, h, emb_silu, context)
    hs[#hs + 1] = h
    if cs then
      local hc, j = cs:unet_after_input(i, hs, emb_silu, n_out)
      if not cs:pending() then pass:hold_prefetch(false) end
      if hc then
        h, resume = hc, j
        break
      end
    end
  end
  if resume > 1 then
    -- the skips the resumed output blocks take stay; the rest go
    for k = #hs, n_out - resume + 2, -1 do hs[k]:free(); hs[k] = nil end
  else
    h = pass:run(self.plan.middle.prefix, self._block, self, self.plan.middle, h, emb_silu, context)
  end
  local function add_control(v, i)
    local r0 = control[i]
    local r = r0
    -- a copy on this device and in v's dtype, freed right after the sum
    if r.device ~= dev or r.dtype ~= v.dtype then r = r:to(dev, v.dtype) end
    local o = v + r
    v:free()
    if r ~= r0 then r:free() end
    if opts.free_control then
      r0:free()
      control[i] = false
    end
    return o
  end
  if control and resume == 1 then h = add_control(h, #control) end
  for j = resume, n_out do
    local blk = self.plan.output[j]
    if cs then cs:unet_before_output(j, h, n_out) end
    local skip = table.remove(hs)
    if control then skip = add_control(skip, #hs + 1) end
    local cat = kiln.cat({ h, skip }, 2)
    h:free(); skip:free()
    local nxt = hs[#hs]   -- any size: downsamplers round odd sizes up, "up" layers follow
    local up_hw = nxt and { nxt.shape[3], nxt.shape[4] } or nil
    h = pass:run(blk.prefix, self._block, self, blk, cat, emb_silu, context, up_hw)
    cat:free()
  end
  emb_silu:free()
  if cs then cs:store_residual(h) end
  local out = pass:run("out.", self._out, self, h)
  if out.dtype ~= xdt then
    local o = out:to(xdt)
    out:free()
    out = o
  end
  return out
end

-- time (and label) embedding; every ResBlock applies SiLU to it first, so do it once
function UNet:_embed(t, y, dev, dt)
  local cfg = self.config
  local te = M.timestep_embedding(t, cfg.model_channels, dev)
  local e1 = nn.linear(te, self:w("time_embed.0.weight"), self:w("time_embed.0.bias"))
  te:free()
  local e1s = nn.silu(e1)
  e1:free()
  local emb = nn.linear(e1s, self:w("time_embed.2.weight"), self:w("time_embed.2.bias"))
  e1s:free()
  if y then
    if y.device ~= dev then y = y:to(dev) end
    local l1 = nn.linear(y, self:w("label_emb.0.0.weight"), self:w("label_emb.0.0.bias"))
    local l1s = nn.silu(l1)
    l1:free()
    local l2 = nn.linear(l1s, self:w("label_emb.0.2.weight"), self:w("label_emb.0.2.bias"))
    l1s:free()
    local e2 = emb + l2
    emb:free(); l2:free()
    emb = e2
  end
  local emb_silu = nn.silu(emb)
  emb:free()
  if emb_silu.dtype ~= dt then
    local c = emb_silu:to(dt)
    emb_silu:free()
    emb_silu = c
  end
  return emb_silu
end

function UNet:_out(h)
  local n = nn.group_norm(h, 32, self:w("out.0.weight"), self:w("out.0.bias"), 1e-5, { silu = true })
  h:free()
  local out = self:_conv(n, self:w("out.2.weight"), self:w("out.2.bias"), { padding = 1 })
  n:free()
  return out
end

-- SDXL's vector conditioning y: the pooled text vector followed by the sinusoidal
-- embeddings (256 each) of original size (h, w), crop (top, left) and target size
-- (h, w), as sgm's ConcatTimestepEmbedderND. opts: width, height (image pixels),
-- orig_width/orig_height, crop_top/crop_left, target_width/target_height.
function M.sdxl_vector(pooled, opts)
  opts = opts or {}
  local w, h = opts.width or 1024, opts.height or 1024
  local vals = { opts.orig_height or h, opts.orig_width or w, opts.crop_top or 0, opts.crop_left or 0,
    opts.target_height or h, opts.target_width or w }
  local B = pooled.shape[1]
  local parts = { pooled:to("f32") }
  for _, v in ipairs(vals) do
    local e = M.timestep_embedding(kiln.tensor({ v }), 256, pooled.device)
    parts[#parts + 1] = B > 1 and e:expand({ B, 256 }) or e
  end
  return kiln.cat(parts, 2)
end

function UNet:sdxl_vector(pooled, opts) return M.sdxl_vector(pooled, opts) end

return M
