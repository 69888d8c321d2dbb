-- kiln.controlnet: the ControlNet of SD 1.x, 2.x and SDXL (cldm.ControlNet): the UNet's
-- input and middle blocks (kiln.unet's pieces) plus the hint encoder and the zero
-- convolutions, loaded as a model like the checkpoint's parts. `cn.tileable` pads its
-- convolutions circularly as the UNet's (the pipelines set both for tileable runs).
--
--   local cn = kiln.load_controlnet(path)
--   local res = cn:forward(x, t, context, hint [, y] [, {strength = s}])
--   local eps = unet:forward(x, t, context, y, {control = res})
local kiln = require "kiln"
local util = require "kiln.util"
local stream = require "kiln.stream"
local unet = require "kiln.unet"
local mf = require "kiln.model_files"
local part = require "kiln.part"
local families = require "kiln.family"
local sd = require "kiln.families.sd"
local nn = kiln.nn

local M = {}
local fmt = string.format

-- The network: a UNet whose methods (blocks, embedding) it reuses.
local ControlNet = setmetatable({}, { __index = unet.UNet })
ControlNet.__index = ControlNet
M.ControlNet = ControlNet

local WHO = "kiln.load_controlnet"
local function fail(path, msg) util.file_error(WHO, path, msg) end

-- input_hint_block: 8 convolutions (SiLU between), the 3rd, 5th and 7th of stride 2
-- (8x down to the latent size), the last a zero convolution to model_channels.
local HINT_CONVS = 8
local HINT_STRIDE2 = { [2] = true, [4] = true, [6] = true }   -- 0-based conv index k / 2

-- ---------------------------------------------------------------- configuration

-- Hyper-parameters from a table of name -> shape (names relative to the ControlNet
-- root): unet.config's, plus the hint encoder's widths.
function M.config(shapes, opts)
  local s = {}
  for k, v in pairs(shapes) do s[k] = v end
  -- a ControlNet has no output half; unet.config reads out_channels from out.2
  local ci = util.need_shape(shapes, "input_blocks.0.0.weight", "in_channels and model_channels", "ControlNet")
  s["out.2.weight"] = { ci[2], ci[1], 3, 3 }
  local cfg = unet.config(s, opts)
  cfg.out_channels = nil
  cfg.hint = {}
  for k = 0, HINT_CONVS - 1 do
    local w = util.need_shape(shapes, fmt("input_hint_block.%d.weight", 2 * k), "the hint encoder", "ControlNet")
    cfg.hint[k + 1] = { cout = w[1], cin = w[2], stride = HINT_STRIDE2[k] and 2 or 1 }
  end
  cfg.hint_channels = cfg.hint[1].cin
  if cfg.hint[HINT_CONVS].cout ~= cfg.model_channels then
    error(fmt("ControlNet: the hint encoder ends with %d channels, the model has %d",
      cfg.hint[HINT_CONVS].cout, cfg.model_channels), 0)
  end
  return cfg
end

-- Every tensor the network reads, in first-use order: a list of {name, shape}.
function M.expected(cfg)
  local list = {}
  local body = {}
  for _, e in ipairs(unet.expected(cfg)) do
    local n = e[1]
    if n:match("^time_embed%.") or n:match("^label_emb%.") then
      list[#list + 1] = e
    elseif n:match("^input_blocks%.") or n:match("^middle_block%.") then
      body[#body + 1] = e
    end
  end
  for k, c in ipairs(cfg.hint) do
    list[#list + 1] = { fmt("input_hint_block.%d.weight", 2 * (k - 1)), { c.cout, c.cin, 3, 3 } }
    list[#list + 1] = { fmt("input_hint_block.%d.bias", 2 * (k - 1)), { c.cout } }
  end
  for _, e in ipairs(body) do list[#list + 1] = e end
  local plan = unet.plan(cfg)
  for i, blk in ipairs(plan.input) do
    local ch = blk[#blk].cout or blk[#blk].ch
    list[#list + 1] = { fmt("zero_convs.%d.0.weight", i - 1), { ch, ch, 1, 1 } }
    list[#list + 1] = { fmt("zero_convs.%d.0.bias", i - 1), { ch } }
  end
  local mid = plan.middle[#plan.middle].cout
  list[#list + 1] = { "middle_block_out.0.weight", { mid, mid, 1, 1 } }
  list[#list + 1] = { "middle_block_out.0.bias", { mid } }
  return list
end

-- The streaming block of a tensor: the UNet's, with each zero convolution in its
-- input block, middle_block_out in the middle block and the hint encoder its own.
function M.block_of(name)
  local i = name:match("^zero_convs%.(%d+)%.")
  if i then return "input_blocks." .. i .. "." end
  if name:match("^middle_block_out%.") then return "middle_block." end
  if name:match("^input_hint_block%.") then return "input_hint_block." end
  return unet.block_of(name)
end

function M.new(weights, cfg)
  local self = setmetatable({ weights = weights, config = cfg }, ControlNet)
  self.plan = unet.plan(cfg)
  self.streamer = stream.new(weights, stream.blocks(M.expected(cfg), M.block_of), "controlnet")
  return self
end

-- ---------------------------------------------------------------- network

function ControlNet:_hint(hint)
  local h = hint
  for k, c in ipairs(self.config.hint) do
    local p = fmt("input_hint_block.%d.", 2 * (k - 1))
    -- circular on the axes of self.tileable, as the UNet's convolutions (kiln.seamless)
    local o = self:_conv(h, self:w(p .. "weight"), self:w(p .. "bias"), { padding = 1, stride = c.stride })
    if h ~= hint then h:free() end
    if k < #self.config.hint then
      h = nn.silu(o)
      o:free()
    else
      h = o
    end
  end
  return h
end

local function zero_conv(self, p, h)
  return nn.conv2d(h, self:w(p .. "0.weight"), self:w(p .. "0.bias"))
end

-- One input block, the guided hint added after the first, and its zero convolution.
function ControlNet:_input(i, blk, h, emb_silu, context, guided)
  local o = self:_block(blk, h, emb_silu, context)
  if guided then
    local g = o + guided
    o:free()
    o = g
  end
  return o, zero_conv(self, fmt("zero_convs.%d.", i - 1), o)
end

function ControlNet:_middle(h, emb_silu, context)
  local o = self:_block(self.plan.middle, h, emb_silu, context)
  local r = zero_conv(self, "middle_block_out.", o)
  o:free()
  return r
end

local shape_str = util.shape_str

-- x [B, in_channels, h, w], t (B timesteps or one), context [B or 1, L, context_dim],
-- hint [B or 1, hint_channels, 8h, 8w] in [0, 1], y [B, adm] (SDXL); opts.strength
-- scales every residual. opts.cache: a table the caller keeps across the steps of a
-- sampling with the same hint: the encoded hint (input_hint_block's output, which
-- depends on nothing else) is kept there and reused, and the hint encoder's weights
-- are not streamed again; the caller frees it with controlnet.free_cache(cache).
-- Returns the residuals: one per input block, then the middle.
function ControlNet:forward(x, t, context, hint, y, opts)
  local cfg = self.config
  if type(y) == "table" and getmetatable(y) == nil then y, opts = nil, y end
  opts = opts or {}
  if #x.shape ~= 4 or x.shape[2] ~= cfg.in_channels then
    error(fmt("controlnet:forward: x must be [B, %d, h, w], got %s", cfg.in_channels, shape_str(x)), 2)
  end
  local B, H, W = x.shape[1], x.shape[3], x.shape[4]
  if not context or #context.shape ~= 3 or context.shape[3] ~= cfg.context_dim then
    error(fmt("controlnet:forward: context must be [B, L, %d], got %s", cfg.context_dim,
      context and shape_str(context) or "nil"), 2)
  end
  if context.shape[1] ~= B then
    if context.shape[1] == 1 then context = context:expand({ B, context.shape[2], context.shape[3] })
    else error(fmt("controlnet:forward: context batch %d does not match x batch %d", context.shape[1], B), 2) end
  end
  if not hint or #hint.shape ~= 4 or hint.shape[2] ~= cfg.hint_channels
      or hint.shape[3] ~= 8 * H or hint.shape[4] ~= 8 * W or (hint.shape[1] ~= 1 and hint.shape[1] ~= B) then
    error(fmt("controlnet:forward: hint must be [%d or 1, %d, %d, %d] (the image, 8x the latent), got %s",
      B, cfg.hint_channels, 8 * H, 8 * W, hint and shape_str(hint) or "nil"), 2)
  end
  if cfg.adm_in_channels and not y then
    error(fmt("controlnet:forward: this ControlNet (SDXL) needs y [B, %d]", cfg.adm_in_channels), 2)
  end
  if y and not cfg.adm_in_channels then error("controlnet:forward: y given but this ControlNet has no label embedding", 2) end
  local pass <close> = self.streamer:pass()
  local dev = self:_device()
  -- the activations' dtype as the UNet's (kiln.activation_dtype under a half precision,
  -- else x's); the residuals stay in it: the UNet adds them in its own
  local act = kiln.activation_dtype(dev)
  local dt = act ~= "f32" and act or x.dtype
  local copies <close> = setmetatable({}, { __close = function(c) for _, v in ipairs(c) do v:free() end end })
  local function own(v) copies[#copies + 1] = v; return v end
  if x.device ~= dev then x = own(x:to(dev)) end
  if x.dtype ~= dt then x = own(x:to(dt)) end
  if context.device ~= dev then context = own(context:to(dev)) end
  if context.dtype ~= dt then context = own(context:to(dt)) end
  local hint0 = hint
  if hint.device ~= dev then hint = own(hint:to(dev)) end
  if hint.dtype ~= dt then hint = own(hint:to(dt)) end
  if type(t) == "number" then t = own(kiln.tensor({ t })) end
  if type(t) == "table" and getmetatable(t) == nil then t = own(kiln.tensor(t)) end
  if #t.shape == 0 then t = own(t:reshape({ 1 })) end
  if t.shape[1] == 1 and B > 1 then t = own(t:expand({ B })) end
  if t.shape[1] ~= B then error(fmt("controlnet:forward: %d timesteps for a batch of %d", t.shape[1], B), 2) end
  if t.device ~= dev then t = own(t:to(dev)) end

  local emb_silu = own(pass:run("time_embed.", self._embed, self, t, y, dev, dt))
  local cache = opts.cache
  local guided
  if cache and cache.hint == hint0 and cache.guided and cache.guided.device == dev and cache.guided.dtype == dt then
    guided = cache.guided
  else
    guided = pass:run("input_hint_block.", self._hint, self, hint)
    if cache then
      M.free_cache(cache)
      cache.hint, cache.guided = hint0, guided
    else
      own(guided)
    end
  end
  if guided.shape[1] ~= B then guided = own(guided:expand({ B, guided.shape[2], guided.shape[3], guided.shape[4] })) end
  local outs = {}
  local h = x
  for i, blk in ipairs(self.plan.input) do
    local nxt, r = pass:run(blk.prefix, self._input, self, i, blk, h, emb_silu, context, i == 1 and guided or nil)
    if h ~= x then h:free() end
    h = nxt
    outs[i] = r
  end
  outs[#outs + 1] = pass:run(self.plan.middle.prefix, self._middle, self, h, emb_silu, context)
  if h ~= x then h:free() end
  local s = opts.strength or 1
  if s ~= 1 then
    for i, r in ipairs(outs) do
      outs[i] = r * s
      r:free()
    end
  end
  return outs
end

--- Frees what ControlNet:forward kept in opts.cache (the encoded hint).
function M.free_cache(cache)
  if cache.guided then cache.guided:free() end
  cache.hint, cache.guided = nil, nil
end

-- ---------------------------------------------------------------- loading

-- diffusers ControlNetModel name -> original name: the UNet's down and mid blocks as
-- kiln.families.sd.diffusers_unet_map maps them, plus the hint encoder and zero convolutions.
function M.diffusers_map(shapes)
  local map = sd.diffusers_unet_map(shapes)
  for name in pairs(shapes) do
    local orig
    local rest = name:match("^controlnet_cond_embedding%.conv_in%.(.*)$")
    if rest then orig = "input_hint_block.0." .. rest end
    local k
    k, rest = name:match("^controlnet_cond_embedding%.blocks%.(%d+)%.(.*)$")
    if k then orig = fmt("input_hint_block.%d.%s", 2 * (tonumber(k) + 1), rest) end
    rest = name:match("^controlnet_cond_embedding%.conv_out%.(.*)$")
    if rest then orig = fmt("input_hint_block.%d.%s", 2 * (HINT_CONVS - 1), rest) end
    k, rest = name:match("^controlnet_down_blocks%.(%d+)%.(.*)$")
    if k then orig = fmt("zero_convs.%s.0.%s", k, rest) end
    rest = name:match("^controlnet_mid_block%.(.*)$")
    if rest then orig = "middle_block_out.0." .. rest end
    if orig then map[orig] = name end
  end
  return map
end

-- The layout of a file's names: "control_model." / "" (original), or a diffusers map.
-- ControlNet-like files of other kinds or families: a marker name, what they are.
local OTHER = {
  { "lora_controlnet", "a Control-LoRA (ControlNet as LoRA factors over the UNet)" },
  { "controlnet_x_embedder.", "a Flux ControlNet" },
  { "double_blocks.", "a Flux model or ControlNet" },
  { "pos_embed.proj.", "an SD3 (MMDiT) ControlNet" },
  { "adapter.body.", "a T2I-Adapter" },
  { "body.0.resnets.", "a T2I-Adapter" },
  { "lllite_", "a ControlNet-LLLite" },
}

local function layout(shapes, path)
  for _, o in ipairs(OTHER) do
    local found = shapes[o[1]] ~= nil
    if not found then
      for name in pairs(shapes) do
        if name:find(o[1], 1, true) then found = true; break end
      end
    end
    if found then
      fail(path, fmt("this looks like %s (tensors named %s...), which kiln does not run; kiln.load_controlnet " ..
        "takes ControlNets of SD 1.x, 2.x and SDXL", o[2], o[1]))
    end
  end
  if mf.has_prefix(shapes, "control_model.input_hint_block.") then return { prefix = "control_model." } end
  if shapes["input_hint_block.0.weight"] then return { prefix = "" } end
  if shapes["controlnet_cond_embedding.conv_in.weight"] then return { map = M.diffusers_map(shapes) } end
  local n = 0
  for _ in pairs(shapes) do n = n + 1 end
  fail(path, fmt("not a ControlNet: no input_hint_block tensors among its %d tensors", n))
end

-- path: a .safetensors ControlNet (original names, with or without control_model., or
-- diffusers names). opts: heads / head_dim (as the UNet's metadata
-- kiln.heads.unet / kiln.head_dim.unet say otherwise).
function M.load(path, opts)
  if type(path) ~= "string" then error("kiln.load_controlnet: path must be a string, got " .. type(path), 2) end
  opts = opts or {}
  -- a diffusers folder: its weights file
  for _, name in ipairs({ "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors" }) do
    local f = io.open(path:gsub("/+$", "") .. "/" .. name, "rb")
    if f then f:close(); path = path:gsub("/+$", "") .. "/" .. name; break end
  end
  local tensors, meta = mf.read(path, WHO)
  local shapes = mf.shapes_of(tensors)
  local L = layout(shapes, path)
  local sub
  if L.map then
    sub = {}
    for orig, real in pairs(L.map) do sub[orig] = shapes[real] end
  else
    sub = mf.sub(shapes, L.prefix)
  end
  local heads = opts.heads or tonumber(meta["kiln.heads.unet"] or meta["kiln.heads.controlnet"])
  local head_dim = opts.head_dim or tonumber(meta["kiln.head_dim.unet"] or meta["kiln.head_dim.controlnet"])
  -- the family its UNet-shaped names say (kiln.family), and that family's heads
  local family = families.detect_unet(sub)
  if not heads and not head_dim then
    local def = family and families.get(family)
    if def then heads, head_dim = def.unet.heads, def.unet.head_dim else head_dim = 64 end
  end
  local ok, cfg = pcall(M.config, sub, { heads = heads, head_dim = head_dim })
  if not ok then fail(path, tostring(cfg)) end
  cfg.family = family
  local resolve = function(n) return L.map and (L.map[n] or n) or (L.prefix .. n) end
  local exp = M.expected(cfg)
  mf.validate(path, "ControlNet", exp, resolve, shapes, WHO)
  local store = mf.open_store({ path }, mf.names_of(exp, resolve), "controlnet", WHO)
  cfg.summary = fmt("hint %d, channels %d x {%s}, %d res blocks, context %d", cfg.hint_channels,
    cfg.model_channels, table.concat(cfg.channel_mult, ","), cfg.num_res_blocks, cfg.context_dim or 0)
  return part.as_model(M.new(stream.weights(store, L.prefix or "", L.map), cfg), store, "ControlNet")
end

return M
