-- kiln.families.sd: the pieces the Stable Diffusion families (sd1, sd2, sdxl) share:
-- the diffusers <-> original (CompVis / sgm) name maps of the UNet and the VAE, the
-- layouts of a VAE or text-encoder file given alone, and the UNet's cross-attention
-- width the families are told apart by. Data and name arithmetic only: the family
-- files (kiln.families.sd1, ...) declare what differs, kiln.family picks one.
local util = require "kiln.util"
local mf = require "kiln.model_files"

local M = {}
local fmt = string.format

-- Where a single file keeps the UNet: "model.diffusion_model." (original checkpoints,
-- stable-diffusion.cpp's GGUF names), "" for a UNet alone under its bare names
-- (ComfyUI's diffusion_models files, ComfyUI-GGUF, fp8), or nil.
function M.find_unet(shapes)
  if shapes["model.diffusion_model.input_blocks.0.0.weight"] then return "model.diffusion_model." end
  if shapes["input_blocks.0.0.weight"] and shapes["out.2.weight"] then return "" end
  return nil
end

-- The UNet's cross-attention context width (attn2.to_k's input) among the names below
-- prefix, or nil.
function M.context_dim(shapes, prefix)
  prefix = prefix or ""
  for name, s in pairs(shapes) do
    if name:sub(1, #prefix) == prefix and name:match("%.attn2%.to_k%.weight$") then return s[2] end
  end
  return nil
end

-- diffusers UNet2DConditionModel name -> CompVis name (nil when not a UNet weight).
local RES_MAP = {
  norm1 = "in_layers.0", conv1 = "in_layers.2", time_emb_proj = "emb_layers.1",
  norm2 = "out_layers.0", conv2 = "out_layers.3", conv_shortcut = "skip_connection",
}

local function map_res(rest)
  local part, tail = rest:match("^([%w_]+)%.(.*)$")
  local m = part and RES_MAP[part]
  if not m then return nil end
  return m .. "." .. tail
end

function M.diffusers_unet_map(shapes)
  local nrb = 0
  for name in pairs(shapes) do
    local j = name:match("^down_blocks%.0%.resnets%.(%d+)%.")
    if j then nrb = math.max(nrb, tonumber(j) + 1) end
  end
  local up_attn = {}
  for name in pairs(shapes) do
    local i = name:match("^up_blocks%.(%d+)%.attentions%.")
    if i then up_attn[tonumber(i)] = true end
  end
  local map = {}
  local TOP = {
    ["time_embedding.linear_1."] = "time_embed.0.", ["time_embedding.linear_2."] = "time_embed.2.",
    ["add_embedding.linear_1."] = "label_emb.0.0.", ["add_embedding.linear_2."] = "label_emb.0.2.",
    ["conv_in."] = "input_blocks.0.0.", ["conv_norm_out."] = "out.0.", ["conv_out."] = "out.2.",
  }
  for name in pairs(shapes) do
    local orig
    for from, to in pairs(TOP) do
      if name:sub(1, #from) == from then orig = to .. name:sub(#from + 1) end
    end
    if not orig then
      local i, j, rest = name:match("^down_blocks%.(%d+)%.resnets%.(%d+)%.(.*)$")
      if i then
        local r = map_res(rest)
        if r then orig = fmt("input_blocks.%d.0.%s", 1 + i * (nrb + 1) + j, r) end
      end
      i, j, rest = name:match("^down_blocks%.(%d+)%.attentions%.(%d+)%.(.*)$")
      if i then orig = fmt("input_blocks.%d.1.%s", 1 + i * (nrb + 1) + j, rest) end
      i, rest = name:match("^down_blocks%.(%d+)%.downsamplers%.0%.conv%.(.*)$")
      if i then orig = fmt("input_blocks.%d.0.op.%s", (i + 1) * (nrb + 1), rest) end
      j, rest = name:match("^mid_block%.resnets%.(%d+)%.(.*)$")
      if j then
        local r = map_res(rest)
        if r then orig = fmt("middle_block.%d.%s", j * 2, r) end
      end
      rest = name:match("^mid_block%.attentions%.0%.(.*)$")
      if rest then orig = "middle_block.1." .. rest end
      i, j, rest = name:match("^up_blocks%.(%d+)%.resnets%.(%d+)%.(.*)$")
      if i then
        local r = map_res(rest)
        if r then orig = fmt("output_blocks.%d.0.%s", i * (nrb + 1) + j, r) end
      end
      i, j, rest = name:match("^up_blocks%.(%d+)%.attentions%.(%d+)%.(.*)$")
      if i then orig = fmt("output_blocks.%d.1.%s", i * (nrb + 1) + j, rest) end
      i, rest = name:match("^up_blocks%.(%d+)%.upsamplers%.0%.conv%.(.*)$")
      if i then
        i = tonumber(i)
        orig = fmt("output_blocks.%d.%d.conv.%s", i * (nrb + 1) + nrb, up_attn[i] and 2 or 1, rest)
      end
    end
    if orig then map[orig] = name end
  end
  return map
end

local VAE_RES = { conv_shortcut = "nin_shortcut" }
local VAE_ATTN = {
  group_norm = "norm", to_q = "q", query = "q", to_k = "k", key = "k", to_v = "v", value = "v",
  ["to_out.0"] = "proj_out", proj_attn = "proj_out",
}

-- diffusers AutoencoderKL name -> LDM name.
function M.diffusers_vae_map(shapes)
  local n_up = 0
  for name in pairs(shapes) do
    local i = name:match("^decoder%.up_blocks%.(%d+)%.")
    if i then n_up = math.max(n_up, tonumber(i) + 1) end
  end
  local map = {}
  for name in pairs(shapes) do
    local orig
    local side, rest = name:match("^(%a+coder)%.(.*)$")
    if side then
      local function res(r)
        local part, tail = r:match("^([%w_]+)%.(.*)$")
        return (VAE_RES[part] or part) .. "." .. tail
      end
      if rest:match("^conv_in%.") or rest:match("^conv_out%.") then orig = name end
      local t = rest:match("^conv_norm_out%.(.*)$")
      if t then orig = side .. ".norm_out." .. t end
      local i, j, r = rest:match("^down_blocks%.(%d+)%.resnets%.(%d+)%.(.*)$")
      if i then orig = fmt("%s.down.%s.block.%s.%s", side, i, j, res(r)) end
      i, r = rest:match("^down_blocks%.(%d+)%.downsamplers%.0%.conv%.(.*)$")
      if i then orig = fmt("%s.down.%s.downsample.conv.%s", side, i, r) end
      i, j, r = rest:match("^up_blocks%.(%d+)%.resnets%.(%d+)%.(.*)$")
      if i then orig = fmt("%s.up.%d.block.%s.%s", side, n_up - 1 - tonumber(i), j, res(r)) end
      i, r = rest:match("^up_blocks%.(%d+)%.upsamplers%.0%.conv%.(.*)$")
      if i then orig = fmt("%s.up.%d.upsample.conv.%s", side, n_up - 1 - tonumber(i), r) end
      j, r = rest:match("^mid_block%.resnets%.(%d+)%.(.*)$")
      if j then orig = fmt("%s.mid.block_%d.%s", side, tonumber(j) + 1, res(r)) end
      r = rest:match("^mid_block%.attentions%.0%.(.*)$")
      if r then
        for from, to in pairs(VAE_ATTN) do
          if r:sub(1, #from + 1) == from .. "." then orig = fmt("%s.mid.attn_1.%s.%s", side, to, r:sub(#from + 2)) end
        end
      end
    elseif name:match("^quant_conv%.") or name:match("^post_quant_conv%.") then
      orig = name
    end
    if orig then map[orig] = name end
  end
  return map
end

-- ---------------------------------------------------------------- parts given alone

-- A separate VAE file: LDM names (with or without first_stage_model.) or diffusers
-- names. Returns the source (kiln.model_files) and its shapes under the original names.
function M.vae_file(path, who)
  local src = mf.source(path, nil, who)
  local s = src.shapes
  if mf.has_prefix(s, "first_stage_model.") then
    src.prefix = "first_stage_model."
  elseif mf.has_prefix(s, "vae.") and not s["encoder.conv_in.weight"] then
    src.prefix = "vae."
  end
  local sub = mf.sub(s, src.prefix)
  if sub["encoder.down_blocks.0.resnets.0.norm1.weight"] or sub["decoder.up_blocks.0.resnets.0.norm1.weight"] then
    src.map = M.diffusers_vae_map(sub)
    if src.prefix ~= "" then
      for k, v in pairs(src.map) do src.map[k] = src.prefix .. v end
    end
    local mapped = {}
    for orig, real in pairs(src.map) do mapped[orig] = s[real] end
    return src, mapped
  end
  if not sub["decoder.conv_in.weight"] and not sub["encoder.conv_in.weight"] then
    util.file_error(who or "kiln.load_checkpoint", path,
      "not a VAE: no encoder.conv_in / decoder.conv_in tensors; found " .. mf.summarize(s, 2))
  end
  return src, sub
end

-- A separate text-encoder file: HF CLIPTextModel names (text_model.*, with or without a
-- single-file prefix) or open_clip names. Returns the source and its shapes.
function M.clip_file(path, want, who)
  local src = mf.source(path, nil, who)
  local s = src.shapes
  for _, p in ipairs({ "cond_stage_model.transformer.", "cond_stage_model.model.", "conditioner.embedders.0.transformer.",
    "conditioner.embedders.1.model.", "transformer.", "model.", "" }) do
    local sub = mf.sub(s, p)
    if sub["text_model.embeddings.token_embedding.weight"] or sub["token_embedding.weight"] then
      src.prefix = p
      return src, sub
    end
  end
  util.file_error(who or "kiln.load_checkpoint", path,
    fmt("not a CLIP text encoder (%s): no token embedding found; found %s", want, mf.summarize(s, 2)))
end

return M
