-- kiln.comfy.sd3: ComfyUI's nodes for SD 3.5 (comfy_extras/nodes_sd3.py,
-- nodes_model_advanced.py, nodes_slg.py): TripleCLIPLoader (CLIP-L, bigG, T5-XXL in any
-- order), CLIPTextEncodeSD3 and CLIPTextEncode on an SD 3.5 CLIP (ComfyUI's sd3_clip:
-- both CLIPs' penultimate states side by side zero-padded to 4096 features, then T5's
-- states of the prompt padded to at least 77 tokens; without a T5 the CLIP block alone,
-- as ComfyUI), ModelSamplingSD3 (the flow's shift) and SkipLayerGuidanceSD3. Sampling
-- goes through kiln.comfy.flux's flow path (KSampler, SamplerCustomAdvanced), which
-- reads the shift and the skip-layer guidance these nodes put on the MODEL value.
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"
local registry = require "kiln.comfy.registry"
local sd3 = require "kiln.families.sd3"
local t5 = require "kiln.t5"
local V = require "kiln.comfy.values"

local M = {}
M.nodes = {}
local N = M.nodes
local fail, cond_value = V.fail, V.conditioning

-- ComfyUI's SD3 T5 tokenizer pads to at least this many tokens, and does not cut
M.T5_MIN_LENGTH = 77
-- the context's width (T5-XXL's): ComfyUI pads the CLIP states to it
M.WIDTH = 4096

local function is_sd3(ckpt) return ckpt and ckpt.family == "sd3" end

--- TripleCLIPLoader: CLIP-L, bigG and T5-XXL files in any order, opened once: a
-- checkpoint of the sd3 family holding clip (both CLIPs) and t5.
function M.text_encoders(ctx, paths)
  local key = table.concat(paths, "+") .. "#sd3"
  local c = ctx.ckpts[key]
  if c then return c end
  local clips, t5_path = {}, nil
  local is_t5 = require("kiln.comfy.flux").is_t5_file
  for _, p in ipairs(paths) do
    if is_t5(p) and not t5_path then t5_path = p else clips[#clips + 1] = p end
  end
  if #clips ~= 2 or not t5_path then
    fail(ctx, "TripleCLIPLoader needs CLIP-L, CLIP-G (bigG) and T5-XXL files (clip_l.safetensors, " ..
      "clip_g.safetensors, t5xxl_fp16.safetensors); got " .. table.concat(paths, ", "))
  end
  return require("kiln.comfy.flux").open_with_t5(ctx, key, "sd3", clips, t5_path)
end

N.TripleCLIPLoader = {
  category = "advanced/loaders",
  inputs = { { "clip_name1", "FILE:text_encoders|clip" }, { "clip_name2", "FILE:text_encoders|clip" },
    { "clip_name3", "FILE:text_encoders|clip" } },
  outputs = { "CLIP" },
  run = function(ctx, a)
    local ckpt = M.text_encoders(ctx, { a.clip_name1, a.clip_name2, a.clip_name3 })
    return { ctx:value("CLIP", { ckpt = ckpt, part = ckpt.clip, loras = {} }, nil, { ckpt.clip, ckpt.t5 }) }
  end,
}

local function has_t5(ckpt)
  local t = rawget(ckpt, "t5")
  return t ~= nil and not tostring(t):match("^missing")
end

-- The conditioning entry of an SD 3.5 prompt as ComfyUI's SD3ClipModel builds it from
-- per-encoder texts (texts.l, texts.g for the two CLIPs, texts.t5; nil: no tokens, what
-- CLIPTextEncodeSD3's empty_padding "none" gives an empty text):
-- - CLIP-L and bigG: each its own text; when both have none the CLIP block is left out
--   and the pooled vector is zeros; when only one has none it reads the empty prompt (the
--   node pads the shorter token list with the empty prompt's windows);
-- - T5: its text's states, padded to at least 77 tokens; with no tokens ComfyUI's
--   encoder still runs its empty sequence, the end token alone: one token of states;
-- - the context: the CLIP states side by side zero-padded to 4096 features, then T5's
--   (either alone when the other is left out; zeros [1, 77, 4096] when both are).
local function sd3_entry(ctx, clip, texts)
  local ckpt = clip.ckpt
  local states
  if has_t5(ckpt) then
    ctx:use(ckpt.t5, { device = clip.device })
    if texts.t5 then
      local n = #t5.tokenize(texts.t5)
      states = ckpt.t5:encode(texts.t5, { length = math.max(M.T5_MIN_LENGTH, n) })
    else
      local ids = kiln.tensor({ { 1 } }, "i64")
      local ok, r = pcall(ckpt.t5.forward, ckpt.t5, ids)
      ids:free()
      if not ok then error(r, 0) end
      states = r
    end
  end
  local width = states and states.shape[3] or M.WIDTH
  if texts.l == nil and texts.g == nil then
    local cond = states or kiln.zeros({ 1, 77, width })
    return { cond = cond, pooled = kiln.zeros({ 1, clip.part:pooled_width() }) }
  end
  local hs = {}
  for _, l in ipairs(clip.loras) do hs[#hs + 1] = V.add_lora(ckpt, l.path, { unet = 0, clip = l.strength }) end
  ctx:use(clip.part, { device = clip.device })
  local ok, lg, pooled = pcall(clip.part.encode, clip.part, { l = texts.l or "", g = texts.g or "" },
    { weighting = "comfy" })
  for i = #hs, 1, -1 do hs[i]:remove() end
  if not ok then
    if states then states:free() end
    error(lg, 0)
  end
  if not pooled then
    lg:free()
    if states then states:free() end
    fail(ctx, "this CLIP gave no pooled vector: SD 3.5 needs CLIP-L and bigG (TripleCLIPLoader)")
  end
  local cond
  if states then
    cond = sd3.context(lg, states, { width = width })
    states:free()
  else
    -- ComfyUI without a T5: the CLIP block alone, zero-padded
    local full = sd3.context(lg, nil, { width = width, t5_tokens = 1 })
    local head = full:narrow(2, 1, lg.shape[2])
    cond = head:contiguous()
    head:free(); full:free()
  end
  lg:free()
  return { cond = cond, pooled = pooled }
end

--- CLIPTextEncode on an SD 3.5 CLIP: the same text to the three encoders.
function M.encode_text(ctx, clip, text) return sd3_entry(ctx, clip, { l = text, g = text, t5 = text }) end

-- ComfyUI's CLIPTextEncodeSD3: each encoder its own text; with empty_padding "none" an
-- empty text gives that encoder no tokens (sd3_entry says what that does), with
-- "empty_prompt" the empty prompt's tokens as any text.
N.CLIPTextEncodeSD3 = {
  category = "advanced/conditioning",
  inputs = { { "clip", "CLIP" }, { "clip_l", "STRING", multiline = true }, { "clip_g", "STRING", multiline = true },
    { "t5xxl", "STRING", multiline = true }, { "empty_padding", { "none", "empty_prompt" } } },
  outputs = { "CONDITIONING" },
  run = function(ctx, a)
    if not is_sd3(a.clip.ckpt) then fail(ctx, "CLIPTextEncodeSD3 needs an SD 3.5 CLIP (TripleCLIPLoader)") end
    local none = a.empty_padding == "none"
    local function own(text) if text == "" and none then return nil end return text end
    return { cond_value(ctx, { sd3_entry(ctx, a.clip, { l = own(a.clip_l), g = own(a.clip_g), t5 = own(a.t5xxl) }) }) }
  end,
}

-- a MODEL value like `model` with `fields` changed
local function model_with(ctx, model, fields)
  local f = {}
  for k, v in pairs(model) do f[k] = v end
  for k, v in pairs(fields) do f[k] = v end
  f.tensors, f.res, f.type = nil, nil, nil
  return ctx:value("MODEL", f, nil, model.res)
end

N.ModelSamplingSD3 = {
  category = "advanced/model",
  inputs = { { "model", "MODEL" }, { "shift", "FLOAT", default = 3.0, min = 0.0, max = 100.0, step = 0.01 } },
  outputs = { "MODEL" },
  run = function(ctx, a)
    if not pipeline.flow_family(a.model.ckpt) then fail(ctx, "ModelSamplingSD3 needs a flow-matching model (SD 3.5)") end
    if a.shift <= 0 then fail(ctx, "ModelSamplingSD3: shift must be positive") end
    return { model_with(ctx, a.model, { flow_shift = a.shift }) }
  end,
}

N.SkipLayerGuidanceSD3 = {
  category = "advanced/guidance",
  inputs = { { "model", "MODEL" }, { "layers", "STRING", default = "7, 8, 9" },
    { "scale", "FLOAT", default = 3.0, min = 0.0, max = 10.0, step = 0.1 },
    { "start_percent", "FLOAT", default = 0.01, min = 0.0, max = 1.0, step = 0.001 },
    { "end_percent", "FLOAT", default = 0.15, min = 0.0, max = 1.0, step = 0.001 } },
  outputs = { "MODEL" },
  run = function(ctx, a)
    local ckpt = a.model.ckpt
    if not is_sd3(ckpt) then fail(ctx, "SkipLayerGuidanceSD3 needs an SD 3.5 model") end
    local layers = {}
    for w in a.layers:gmatch("[^,%s]+") do
      local i = math.tointeger(tonumber(w))
      if not i then fail(ctx, ("SkipLayerGuidanceSD3: layers must be block numbers, got %q"):format(w)) end
      layers[#layers + 1] = i
    end
    -- ComfyUI: no layers, or scale 0, leaves the model as it is
    if #layers == 0 or a.scale == 0 then return { a.model } end
    local depth = rawget(ckpt, "dit").config.depth
    for _, i in ipairs(layers) do
      if i < 0 or i >= depth then
        fail(ctx, ("SkipLayerGuidanceSD3: layer %d is not a block of this model (0 to %d)"):format(i, depth - 1))
      end
    end
    return { model_with(ctx, a.model, { skip_layer_guidance = { layers = layers, scale = a.scale,
      start = a.start_percent, stop = a.end_percent } }) }
  end,
}

for name, def in pairs(N) do registry.add_node(name, def) end
return M
