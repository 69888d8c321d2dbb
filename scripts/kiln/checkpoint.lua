-- kiln.checkpoint: kiln.load_checkpoint(path [, opts]) -> {clip, unet, vae, family, ...}
-- for the Stable Diffusion files users already have: single-file .safetensors in the
-- original naming (SD 1.x, 2.x, SDXL), diffusers folders, separate VAE / text encoder
-- files. The family and every hyper-parameter the tensors reveal are read from names
-- and shapes (checkpoint.inspect works on a name -> shape table alone); heads,
-- activations, scale factor and prediction type come from the family unless the
-- file's __metadata__ says otherwise (keys below). Each part is a network object that
-- is also its weight store, a kiln.Model named "unet", "vae" or "clip" over exactly the
-- tensors the network reads (one file's part through the model's prefix list):
-- :load(device, {dtype}), :offload(), :unload(), :bytes(dev), :pin(), :stats(),
-- :where(name), .device, .residency, :close() and <close> reach it; the networks read
-- their weights through it in every memory mode (streamed per block in "low", see
-- kiln.stream).
--
-- __metadata__ keys read: kiln.family, kiln.heads.unet, kiln.head_dim.unet,
-- kiln.heads.clip, kiln.heads.clip_g, kiln.clip.activation, kiln.clip_g.activation,
-- kiln.clip.layer, kiln.scale_factor, kiln.shift_factor, kiln.prediction.
local kiln = require "kiln"
local lfs = require "lfs"
local util = require "kiln.util"
local unet = require "kiln.unet"
local vae = require "kiln.vae"
local clip = require "kiln.clip"
local stream = require "kiln.stream"

local M = {}
local fmt = string.format

-- ---------------------------------------------------------------- small helpers

-- (symbolic links followed: lfs.attributes stats the target)
local function file_exists(p) return lfs.attributes(p, "mode") == "file" end

local function is_dir(p) return lfs.attributes(p, "mode") == "directory" end

-- A JSON file's value (kiln.json, the runtime's strict parser), or nil when the
-- file is absent; a malformed file is an error naming it.
local function read_json(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local text = f:read("a")
  f:close()
  local ok, v = pcall(kiln.json.decode, text)
  if not ok then error(fmt("%s: %s", path, tostring(v)), 0) end
  return v
end

-- A string field of a decoded JSON object (nil when absent, null or another type).
local function json_string(t, k)
  local v = type(t) == "table" and t[k]
  return type(v) == "string" and v or nil
end

local function json_number(t, k)
  local v = type(t) == "table" and t[k]
  return type(v) == "number" and v or nil
end

local function join(a, b) return a:sub(-1) == "/" and a .. b or a .. "/" .. b end

local function shape_str(s) return "[" .. table.concat(s, ", ") .. "]" end

local function basename(p) return p:match("([^/]+)/*$") or p end

local function copy_shape(s)
  local r = {}
  for i = 1, #s do r[i] = s[i] end
  return r
end

local sorted_keys = util.sorted_keys

-- Top-level prefixes of a name set, for "found ..." messages: "first_stage_model.* (248)".
local function summarize(shapes, depth)
  local counts = {}
  for name in pairs(shapes) do
    local parts, p = {}, 0
    for seg in name:gmatch("[^%.]+") do
      p = p + 1
      parts[p] = seg
      if p == depth then break end
    end
    local key = table.concat(parts, ".", 1, math.min(#parts, depth))
    if #parts >= depth and name ~= key then key = key .. ".*" end
    counts[key] = (counts[key] or 0) + 1
  end
  local keys = sorted_keys(counts)
  local out = {}
  for i, k in ipairs(keys) do
    if i > 12 then out[#out + 1] = fmt("... and %d more", #keys - 12); break end
    out[#out + 1] = fmt("%s (%d)", k, counts[k])
  end
  local names = sorted_keys(shapes)
  local ex = {}
  for i = 1, math.min(3, #names) do ex[i] = names[i] end
  return table.concat(out, ", ") .. "; for example " .. table.concat(ex, ", ")
end

local function fail(path, msg, level)
  error(fmt("kiln.load_checkpoint: %s%s", path and ("'" .. path .. "': ") or "", msg), level or 0)
end

-- ---------------------------------------------------------------- reading files

local PICKLE_HELP = "kiln reads .safetensors only: a .ckpt/.pt/.pth/.bin file is a Python pickle, which " ..
    "can run arbitrary code when loaded, so kiln does not open it. Convert it once with PyTorch and " ..
    "safetensors:\n  python -c \"import torch, safetensors.torch as s; d = torch.load('IN.ckpt', " ..
    "map_location='cpu'); d = d.get('state_dict', d); s.save_file({k: v.contiguous() for k, v in " ..
    "d.items() if isinstance(v, torch.Tensor)}, 'OUT.safetensors')\""
-- shared with kiln.embedding, which refuses .pt embeddings with the same hint
M.PICKLE_HELP = PICKLE_HELP

local function sniff(path)
  local f, err = io.open(path, "rb")
  if not f then fail(nil, err) end
  local head = f:read(9) or ""
  f:close()
  if head:sub(1, 4) == "GGUF" then return "gguf" end
  -- safetensors: an 8-byte header length, then the JSON header's "{"
  if head:sub(9, 9) == "{" then return end
  if head:sub(1, 2) == "PK" or head:byte(1) == 0x80 then
    fail(path, "this is a PyTorch pickle (zip) checkpoint, not safetensors. " .. PICKLE_HELP)
  end
end

-- GGUF architectures kiln runs (general.architecture; ComfyUI-GGUF labels SD 2.x "sd1"
-- too, so the family still comes from the tensors)
local GGUF_ARCHS = { sd1 = true, sd2 = true, sdxl = true }

-- path -> tensors (name -> mapped tensor), metadata. Errors name the file. A GGUF
-- file (by its magic) is read the same way: its metadata are strings as well.
function M.read_safetensors(path)
  if path:match("%.ckpt$") or path:match("%.pt$") or path:match("%.pth$") or path:match("%.bin$") then
    fail(path, PICKLE_HELP)
  end
  if sniff(path) == "gguf" then
    local ok, tensors, meta = pcall(kiln.load_gguf, path)
    if not ok then fail(path, "cannot read it as GGUF: " .. tostring(tensors)) end
    local arch = meta["general.architecture"]
    if arch and not GGUF_ARCHS[arch] then
      fail(path, fmt("unknown architecture '%s' in this GGUF file (general.architecture); kiln runs SD 1.x, " ..
        "SD 2.x and SDXL UNets (sd1, sd2, sdxl)", arch))
    end
    return tensors, meta
  end
  local ok, tensors, meta = pcall(kiln.load_safetensors, path)
  if not ok then fail(path, "cannot read it as safetensors: " .. tostring(tensors)) end
  return tensors, meta or {}
end

local function shapes_of(tensors)
  local s = {}
  for name, t in pairs(tensors) do s[name] = t.shape end
  return s
end

-- ---------------------------------------------------------------- family detection

local LORA_MARKERS = { "lora_up", "lora_down", "lora_A", "lora_B", "lora.up", "lora.down", "hada_w1", "lokr_w1" }

local function looks_like_lora(shapes)
  local n, example = 0, nil
  for name in pairs(shapes) do
    for _, m in ipairs(LORA_MARKERS) do
      if name:find(m, 1, true) then
        n = n + 1
        example = example or name
        break
      end
    end
  end
  return n, example
end

local function has_prefix(shapes, prefix)
  for name in pairs(shapes) do
    if name:sub(1, #prefix) == prefix then return true end
  end
  return false
end

-- The names below prefix, with prefix removed.
function M.sub(shapes, prefix)
  local r = {}
  for name, s in pairs(shapes) do
    if name:sub(1, #prefix) == prefix then r[name:sub(#prefix + 1)] = s end
  end
  return r
end

local DEFAULT_SCALE = { sd1 = 0.18215, sd2 = 0.18215, sdxl = 0.13025 }

local function meta_num(meta, key)
  local v = meta and meta[key]
  if v == nil then return nil end
  local n = tonumber(v)
  if not n then error(fmt("kiln.load_checkpoint: __metadata__ %s = %q is not a number", key, v), 0) end
  return n
end

-- Where the parts of a single-file checkpoint live, from its names:
-- {family, unet = prefix, vae = prefix, clip = {{prefix, layout, role}, ...}}
function M.layout(shapes, meta, path)
  local n_lora, example = looks_like_lora(shapes)
  if n_lora > 0 then
    fail(path, fmt("this looks like a LoRA (%d tensors such as '%s'), not a checkpoint: load a full " ..
      "checkpoint with kiln.load_checkpoint and apply the LoRA to it", n_lora, example))
  end
  local L = { unet = "model.diffusion_model.", vae = "first_stage_model.", clip = {} }
  local has_unet = shapes["model.diffusion_model.input_blocks.0.0.weight"] ~= nil
  if not has_unet and shapes["input_blocks.0.0.weight"] and shapes["out.2.weight"] then
    -- a UNet alone under its bare names (ComfyUI's diffusion_models files, GGUF or fp8):
    -- the VAE and text encoders come from {vae =, clip =}
    L.unet, has_unet = "", true
  end
  local has_vae = has_prefix(shapes, "first_stage_model.")
  local family
  if has_prefix(shapes, "conditioner.embedders.1.model.") then
    family = "sdxl"
    L.clip = {
      { prefix = "conditioner.embedders.0.transformer.", role = "l" },
      { prefix = "conditioner.embedders.1.model.", role = "g" },
    }
  elseif has_prefix(shapes, "conditioner.embedders.0.model.") then
    fail(path, "this is an SDXL refiner checkpoint (only the bigG text encoder, at " ..
      "conditioner.embedders.0.model.*); kiln supports SD 1.x, SD 2.x and SDXL base checkpoints")
  elseif has_prefix(shapes, "cond_stage_model.model.") then
    family = "sd2"
    L.clip = { { prefix = "cond_stage_model.model.", role = "h" } }
  elseif has_prefix(shapes, "cond_stage_model.transformer.") then
    family = "sd1"
    L.clip = { { prefix = "cond_stage_model.transformer.", role = "l" } }
  end
  if has_unet then
    local ctx
    for name, s in pairs(shapes) do
      if name:sub(1, #L.unet) == L.unet and name:match("%.attn2%.to_k%.weight$") then ctx = s[2]; break end
    end
    local by_ctx = ({ [768] = "sd1", [1024] = "sd2", [2048] = "sdxl" })[ctx or 0]
    if shapes[L.unet .. "label_emb.0.0.weight"] and not family then by_ctx = "sdxl" end
    local arch = meta and meta["general.architecture"]
    family = family or by_ctx or (arch and GGUF_ARCHS[arch] and arch or nil)
  end
  if meta and meta["kiln.family"] then
    local f = meta["kiln.family"]
    if f ~= "sd1" and f ~= "sd2" and f ~= "sdxl" then
      fail(path, fmt("__metadata__ kiln.family = %q (expected sd1, sd2 or sdxl)", f))
    end
    family = f
  end
  if not has_unet or not family then
    local what = "unknown checkpoint layout"
    if not has_unet and (has_prefix(shapes, "encoder.conv_in.") or has_prefix(shapes, "decoder.conv_in.")) then
      what = "this looks like a standalone VAE; pass it as kiln.load_checkpoint(ckpt, {vae = PATH})"
    elseif not has_unet and (has_prefix(shapes, "text_model.") or has_prefix(shapes, "token_embedding.")) then
      what = "this looks like a standalone text encoder; pass it as kiln.load_checkpoint(ckpt, {clip = PATH})"
    elseif not has_unet and shapes["input_blocks.0.0.weight"] then
      what = "this looks like a UNet without the model.diffusion_model. prefix; kiln needs a full single-file " ..
          "checkpoint or a diffusers folder"
    elseif not has_unet and shapes["conv_in.weight"] and has_prefix(shapes, "down_blocks.") then
      what = "this looks like a diffusers UNet file; pass the diffusers folder (with unet/, vae/, text_encoder/)"
    elseif has_unet then
      what = "a UNet without a recognizable text encoder and an unusual context width; set __metadata__ kiln.family"
    end
    fail(path, fmt("%s. Expected model.diffusion_model.* (UNet), first_stage_model.* (VAE) and " ..
      "cond_stage_model.* or conditioner.embedders.* (text encoders); found %d tensors: %s",
      what, (function() local n = 0; for _ in pairs(shapes) do n = n + 1 end; return n end)(), summarize(shapes, 2)))
  end
  L.family = family
  L.has_vae = has_vae
  return L
end

-- Encoder roles: "l" CLIP ViT-L (SD 1.x, SDXL 1st), "h" OpenCLIP ViT-H (SD 2.x),
-- "g" OpenCLIP bigG (SDXL 2nd). How each is used for conditioning, per family:
local function encoder_use(family, role, cfg, meta)
  if family == "sd1" then
    local layer = meta_num(meta, "kiln.clip.layer") or -1
    return { layer = layer, final_norm = true, pad = nil, pooled = false }
  elseif family == "sd2" then
    return { layer = meta_num(meta, "kiln.clip.layer") or -2, final_norm = true, pad = 0, pooled = false }
  elseif role == "l" then
    return { layer = -2, final_norm = false, pad = nil, pooled = false }
  else
    return { layer = -2, final_norm = false, pad = 0, pooled = cfg.projection ~= nil }
  end
end

-- Header-only analysis: name -> shape (+ metadata) -> {family, unet = cfg, vae = cfg,
-- clip = {cfg, ...}, prefixes}. Works on the real key lists (name and shape per line) as well as on
-- real files.
function M.inspect(shapes, meta, path)
  meta = meta or {}
  local L = M.layout(shapes, meta, path)
  local info = { family = L.family, layout = L }
  local heads = meta_num(meta, "kiln.heads.unet")
  local head_dim = meta_num(meta, "kiln.head_dim.unet")
  if not heads and not head_dim then
    if L.family == "sd1" then heads = 8 else head_dim = 64 end
  end
  local ok, cfg = pcall(unet.config, M.sub(shapes, L.unet), { heads = heads, head_dim = head_dim })
  if not ok then fail(path, tostring(cfg)) end
  info.unet = cfg
  if L.has_vae then
    local okv, vcfg = pcall(vae.config, M.sub(shapes, L.vae), {
      scale_factor = meta_num(meta, "kiln.scale_factor") or DEFAULT_SCALE[L.family],
      shift_factor = meta_num(meta, "kiln.shift_factor") or 0,
    })
    if not okv then fail(path, tostring(vcfg)) end
    info.vae = vcfg
  end
  info.clip = {}
  for i, e in ipairs(L.clip) do
    local key = e.role == "g" and "clip_g" or "clip"
    local okc, ccfg = pcall(clip.config, M.sub(shapes, e.prefix), {
      heads = meta_num(meta, "kiln.heads." .. key),
      activation = meta["kiln." .. key .. ".activation"],
    })
    if not okc then fail(path, tostring(ccfg)) end
    ccfg.role = e.role
    info.clip[i] = ccfg
  end
  return info
end

-- ---------------------------------------------------------------- diffusers names

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

-- ---------------------------------------------------------------- weight stores

-- Every part is a kiln.Model (residency, load / offload / unload, eviction, the
-- per-model summary, streaming) over exactly the tensors its network reads: the real
-- names are given as the model's prefixes, so the parts of a single-file checkpoint
-- are three models over one file and a diffusers or override file contributes only
-- what is used (not position_ids, logit_scale, ...).
local function open_store(paths, names, label)
  local ok, m = pcall(kiln.model, #paths == 1 and paths[1] or paths, { prefix = names, name = label })
  if not ok then fail(paths[1], fmt("cannot open the %s weights: %s", label, tostring(m))) end
  return m
end

local new_weights = stream.weights

-- ---------------------------------------------------------------- validation

local function same_shape(want, got)
  if #want == #got then
    for i = 1, #want do if want[i] ~= got[i] then return false end end
    return true
  end
  -- a 1x1 convolution stored as a linear weight (diffusers VAE attention)
  if #want == 4 and #got == 2 and want[3] == 1 and want[4] == 1 then
    return want[1] == got[1] and want[2] == got[2]
  end
  return false
end

-- Checks every expected tensor against the file's shapes; raises one error listing
-- the problems (missing tensors and shape mismatches, with expected vs found).
local function validate(path, what, expected, resolve, shapes)
  local problems = {}
  for _, e in ipairs(expected) do
    local real = resolve(e[1])
    local got = shapes[real]
    if not got then
      problems[#problems + 1] = fmt("missing tensor '%s' (expected shape %s)", real, shape_str(e[2]))
    elseif not same_shape(e[2], got) then
      problems[#problems + 1] = fmt("tensor '%s' has shape %s, expected %s", real, shape_str(got), shape_str(e[2]))
    end
  end
  if #problems > 0 then
    local n = #problems
    if n > 12 then
      for i = n, 13, -1 do problems[i] = nil end
      problems[13] = fmt("... and %d more", n - 12)
    end
    fail(path, fmt("the %s does not match the architecture its tensors describe (%d problem%s):\n  %s",
      what, n, n == 1 and "" or "s", table.concat(problems, "\n  ")))
  end
end

local function names_of(expected, resolve)
  local r = {}
  for i, e in ipairs(expected) do r[i] = resolve(e[1]) end
  return r
end

-- ---------------------------------------------------------------- parts as models

-- What a part forwards to its kiln.Model: methods (returning the part where the model
-- returns itself) and read-only properties. Anything else is the network's own field,
-- nil when absent (a kiln.Model would take an unknown key for a tensor name).
local MODEL_METHODS = {
  load = true, offload = true, unload = true, pin = true, unpin = true, bytes = true, fetch = true,
  prefetch = true, release = true, where = true, stats = true, names = true, has = true, tensor = true,
}
local MODEL_PROPS = { name = true, residency = true, device = true, pinned = true, closed = true, streamed = true }

-- part:load(dev, {resident = bytes, dtype = ...}): a partial residency for a network
-- streamed by blocks (kiln.stream): about `bytes` of its blocks stay on the device
-- and the rest streams at each use, in any memory mode. A value at or above the
-- model's bytes loads it whole; a value above what the device's budget leaves beside
-- the streaming window is lowered, with a note. Without `resident` a load takes the
-- part's resident_plan (set by --mode auto, kiln.planner) or else clears an earlier
-- residency (the memory mode decides again).
local function load_part(self, store, kind, dev, opts)
  local streamer = rawget(self, "streamer")
  local resident
  local asked
  if type(opts) == "table" then asked = opts.resident end
  if asked == nil then asked = rawget(self, "resident_plan") end
  if asked ~= nil then
    resident = asked
    if type(resident) == "string" then
      local ok, b = pcall(kiln.parse_size, resident)
      if not ok then error(fmt("%s:load: resident '%s': %s", kind, resident, tostring(b)), 3) end
      resident = b
    end
    if type(resident) ~= "number" or resident < 0 or resident ~= resident then
      error(fmt("%s:load: resident must be a number of bytes from 0 (or a size like \"2G\"), got %s", kind,
        tostring(asked)), 3)
    end
    if type(opts) == "table" then
      local o = {}
      for k, v in pairs(opts) do if k ~= "resident" then o[k] = v end end
      opts = o
    end
    if not streamer or not store.set_streamed then
      error(fmt("%s:load: resident needs a network streamed block by block (UNet, VAE, ControlNet)", kind), 3)
    end
    local total = streamer:total_bytes(store)
    if resident >= total then
      resident = nil
    else
      local d = dev or kiln.default_device()
      local st = kiln.mem.stats(d)
      local _, window = streamer:_sizes(store)
      local room = st.budget > 0 and math.max(0, st.budget - st.allocated - window) or math.huge
      if resident > room then
        if not kiln.quiet() then
          io.stderr:write(fmt("kiln: %s: resident %s lowered to %s (the budget of %s less what is allocated and " ..
            "the streaming window)\n", kind, kiln.format_bytes(resident), kiln.format_bytes(room), d))
        end
        resident = room
      end
      resident = math.floor(resident)
    end
  end
  if streamer and store.set_streamed then
    store:set_streamed(resident ~= nil)
    streamer:set_resident(resident)
  end
  store:load(dev, opts)
  return self
end

-- Wraps a network object so it is also its weight store: load, offload, unload, bytes,
-- ... go to the store; close and <close> too.
local function as_model(obj, store, kind)
  local class = getmetatable(obj)
  obj.model = store
  local mt = {}
  mt.__name = "kiln." .. kind
  mt.__index = function(_, k)
    local v = class[k]
    if v ~= nil then return v end
    if k == "load" and type(store.load) == "function" then
      return function(self, dev, opts) return load_part(self, store, kind, dev, opts) end
    end
    if MODEL_METHODS[k] then
      local f = store[k]
      if type(f) ~= "function" then
        error(fmt("%s: '%s' is not available on this part (its weights span several files)", kind, k), 2)
      end
      return function(self, ...)
        local r = f(store, ...)
        if r == store then return self end
        return r
      end
    end
    if MODEL_PROPS[k] then return store[k] end
    return nil
  end
  mt.__close = function(t) t:close() end
  mt.__tostring = function(t)
    local cfg = rawget(t, "config") or {}
    return fmt("%s(%s; %s)", kind, cfg.summary or "", tostring(store))
  end
  obj.close = function(self)
    local s = rawget(self, "model")
    if s then s:close() end
  end
  return setmetatable(obj, mt)
end

-- ---------------------------------------------------------------- tokenizer

local function open_tokenizer(path, where)
  if not kiln.tokenizer then
    fail(nil, fmt("a tokenizer was given (%s) but this build has no kiln.tokenizer binding", path))
  end
  local ok, t = pcall(kiln.tokenizer, path)
  if not ok then fail(nil, fmt("cannot open the tokenizer %s%s: %s", path, where or "", tostring(t))) end
  return t
end

-- The folders a checkpoint file's tokenizer may sit in: its own, then, when the path
-- is a symbolic link, the folder of each file the link leads to (a model folder of
-- links to files kept elsewhere, the tokenizer beside the real file).
local function beside_dirs(path)
  local function dirname(p) return p:match("^(.*)/[^/]*$") or "." end
  local dirs, seen = { dirname(path) }, {}
  seen[dirs[1]] = true
  local p = path
  for _ = 1, 40 do -- as the kernel's limit on nested links; a loop of links ends here
    local target = lfs.symlinkattributes(p, "target")
    if type(target) ~= "string" then break end
    p = target:sub(1, 1) == "/" and target or join(dirname(p), target)
    local d = dirname(p)
    if not seen[d] then
      seen[d] = true
      dirs[#dirs + 1] = d
    end
  end
  return dirs
end

-- The tokenizer of a checkpoint, first found of: the tokenizer option; vocab.json +
-- merges.txt or bpe_simple_vocab_16e6.txt.gz in one of dir_candidates; the path in
-- $KILN_TOKENIZER; CLIP's vocabulary built into the library. Returns it and a line
-- saying which it is (also a "tokenizer" mark in kiln.mem.events and the trace).
local builtin_tok
local function find_tokenizer(opts, dir_candidates)
  local function found(tok, why)
    local src = fmt("%s (%s)", tok.source and tok:source() or tostring(tok), why)
    if kiln.trace and kiln.trace.mark then kiln.trace.mark("tokenizer", src) end
    return tok, src
  end
  if opts.tokenizer then
    if type(opts.tokenizer) ~= "string" then return found(opts.tokenizer, "option tokenizer") end
    return found(open_tokenizer(opts.tokenizer, " (option tokenizer)"), "option tokenizer")
  end
  if not kiln.tokenizer then return nil end
  for _, d in ipairs(dir_candidates) do
    if file_exists(join(d, "vocab.json")) and file_exists(join(d, "merges.txt")) then
      return found(open_tokenizer(d), "beside the checkpoint")
    end
    if file_exists(join(d, "bpe_simple_vocab_16e6.txt.gz")) then
      return found(open_tokenizer(join(d, "bpe_simple_vocab_16e6.txt.gz")), "beside the checkpoint")
    end
  end
  local env = os.getenv("KILN_TOKENIZER")
  if env and env ~= "" then
    return found(open_tokenizer(env, " (environment variable KILN_TOKENIZER)"), "KILN_TOKENIZER")
  end
  -- one built-in tokenizer per Lua state, shared by its checkpoints (opening it
  -- inflates and parses the vocabulary); reopened if a script freed it
  if not (builtin_tok and pcall(builtin_tok.vocab_size, builtin_tok)) then builtin_tok = kiln.tokenizer() end
  return found(builtin_tok, "no tokenizer beside the checkpoint or named")
end

-- ---------------------------------------------------------------- building parts

local function summary_unet(cfg)
  return fmt("in %d, out %d, channels %d x {%s}, %d res blocks, attention {%s}, depth {%s}/%d, context %d%s%s",
    cfg.in_channels, cfg.out_channels, cfg.model_channels, table.concat(cfg.channel_mult, ","),
    cfg.num_res_blocks, table.concat((function()
      local a = {}
      for i, v in ipairs(cfg.attention) do a[i] = v and "y" or "n" end
      return a
    end)(), ","), table.concat(cfg.transformer_depth, ","), cfg.transformer_depth_middle, cfg.context_dim or 0,
    cfg.linear_proj and ", linear proj" or "", cfg.adm_in_channels and (", adm " .. cfg.adm_in_channels) or "")
end

-- One part from a source: {path(s), tensors, shapes, prefix | map}.
local function build_unet(src, cfg, family)
  cfg.summary = summary_unet(cfg)
  local resolve = function(n) return src.map and src.map[n] or (src.prefix .. n) end
  local exp = unet.expected(cfg)
  validate(src.path, family .. " UNet", exp, resolve, src.shapes)
  local store = open_store(src.paths, names_of(exp, resolve), "unet")
  return as_model(unet.new(new_weights(store, src.prefix, src.map), cfg), store, "UNet")
end

local function build_vae(src, cfg)
  cfg.summary = fmt("ch %d x {%s}, %d res blocks, z %d, factor %d, scale %g", cfg.ch, table.concat(cfg.ch_mult, ","),
    cfg.num_res_blocks, cfg.z_channels, cfg.factor, cfg.scale_factor)
  local resolve = function(n) return src.map and src.map[n] or (src.prefix .. n) end
  local exp = vae.expected(cfg)
  validate(src.path, "VAE", exp, resolve, src.shapes)
  local store = open_store(src.paths, names_of(exp, resolve), "vae")
  local v = as_model(vae.new(new_weights(store, src.prefix, src.map), cfg), store, "VAE")
  v.factor, v.scale_factor, v.shift_factor = cfg.factor, cfg.scale_factor, cfg.shift_factor
  v.latent_channels = cfg.z_channels
  return v
end

-- encs: list of {src, cfg, use}; all encoders of a part share one store (one file) or
-- each its own (diffusers folders, override files): then the part's store is a group.
local Group = {}
Group.__index = Group

local function group(stores)
  if #stores == 1 then return stores[1] end
  return setmetatable({ stores = stores }, Group)
end

for _, m in ipairs({ "load", "offload", "unload", "pin", "unpin", "close" }) do
  Group[m] = function(self, ...)
    for _, s in ipairs(self.stores) do s[m](s, ...) end
    return self
  end
end

function Group:bytes(device)
  local n = 0
  for _, s in ipairs(self.stores) do n = n + s:bytes(device) end
  return n
end

function Group:tensor(name)
  error("clip: tensor() on a multi-file part: use clip.encoders[i].enc.weights", 2)
end

Group.__tostring = function(g)
  local r = {}
  for i, st in ipairs(g.stores) do r[i] = tostring(st) end
  return table.concat(r, " + ")
end

local function build_clip(encs, family, tokenizer, hint)
  local stores, by_path, entries = {}, {}, {}
  -- encoders from the same file share one store
  local names_for = {}
  for i, e in ipairs(encs) do
    local key = e.src.path
    local resolve = function(n) return e.src.prefix .. n end
    local exp = clip.expected(e.cfg)
    validate(e.src.path, fmt("text encoder %d (%s)", i, e.cfg.layout), exp, resolve, e.src.shapes)
    names_for[key] = names_for[key] or { src = e.src, names = {} }
    for _, n in ipairs(names_of(exp, resolve)) do table.insert(names_for[key].names, n) end
  end
  for i, e in ipairs(encs) do
    local key = e.src.path
    if not by_path[key] then
      local nf = names_for[key]
      by_path[key] = open_store(nf.src.paths, nf.names, "clip")
      stores[#stores + 1] = by_path[key]
    end
    local enc = clip.new_encoder(new_weights(by_path[key], e.src.prefix), e.cfg)
    entries[i] = { enc = enc, layer = e.use.layer, final_norm = e.use.final_norm, pad = e.use.pad, pooled = e.use.pooled }
  end
  local store = group(stores)
  local text = clip.new_text({ encoders = entries, tokenizer = tokenizer, family = family, tokenizer_hint = hint })
  local parts = {}
  for i, e in ipairs(encs) do
    parts[i] = fmt("%s %s width %d x %d layers, %d heads, %s", e.cfg.role or "?", e.cfg.layout, e.cfg.width,
      e.cfg.layers, e.cfg.heads, e.cfg.activation)
  end
  text.config = { summary = table.concat(parts, "; "), encoders = (function()
    local c = {}
    for i, e in ipairs(encs) do c[i] = e.cfg end
    return c
  end)() }
  return as_model(text, store, "CLIP")
end

-- ---------------------------------------------------------------- sources

-- A file as a source: {path, paths, tensors, shapes, meta, prefix}.
local function file_source(path, prefix)
  local tensors, meta = M.read_safetensors(path)
  return { path = path, paths = { path }, tensors = tensors, shapes = shapes_of(tensors), meta = meta, prefix = prefix or "" }
end

-- The names of the files in a folder (none when it is not one).
local function list_dir(dir)
  local names = {}
  if not is_dir(dir) then return names end
  for name in lfs.dir(dir) do
    if name ~= "." and name ~= ".." then names[name] = true end
  end
  return names
end

-- diffusers component folder: its safetensors file(s), sharded or not (the index's
-- weight_map names the shards).
local function diffusers_files(dir, stem)
  local have = list_dir(dir)
  for _, name in ipairs({ stem .. ".safetensors", stem .. ".fp16.safetensors" }) do
    if have[name] and file_exists(join(dir, name)) then return { join(dir, name) } end
  end
  for _, idx in ipairs({ stem .. ".safetensors.index.json", stem .. ".safetensors.index.fp16.json" }) do
    local index = have[idx] and read_json(join(dir, idx))
    if index then
      local seen, files = {}, {}
      for _, file in pairs(type(index.weight_map) == "table" and index.weight_map or {}) do
        if type(file) == "string" and not seen[file] then seen[file] = true; files[#files + 1] = join(dir, file) end
      end
      table.sort(files)
      if #files > 0 then return files end
    end
  end
  for _, name in ipairs({ stem .. ".bin", stem .. ".fp16.bin", stem .. ".ckpt" }) do
    if have[name] then fail(join(dir, name), PICKLE_HELP) end
  end
  return nil
end

local function multi_source(paths, prefix)
  local tensors, meta = {}, {}
  for _, p in ipairs(paths) do
    local t, m = M.read_safetensors(p)
    for k, v in pairs(t) do tensors[k] = v end
    for k, v in pairs(m) do meta[k] = v end
  end
  return { path = paths[1], paths = paths, tensors = tensors, shapes = shapes_of(tensors), meta = meta, prefix = prefix or "" }
end

-- A separate VAE file: LDM names (with or without first_stage_model.) or diffusers names.
local function vae_override(path)
  local src = file_source(path)
  local s = src.shapes
  if has_prefix(s, "first_stage_model.") then
    src.prefix = "first_stage_model."
  elseif has_prefix(s, "vae.") and not s["encoder.conv_in.weight"] then
    src.prefix = "vae."
  end
  local sub = M.sub(s, src.prefix)
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
    fail(path, "not a VAE: no encoder.conv_in / decoder.conv_in tensors; found " .. summarize(s, 2))
  end
  return src, sub
end

-- A separate text-encoder file: HF CLIPTextModel names (text_model.*, with or without a
-- single-file prefix) or open_clip names.
local function clip_override(path, want)
  local src = file_source(path)
  local s = src.shapes
  for _, p in ipairs({ "cond_stage_model.transformer.", "cond_stage_model.model.", "conditioner.embedders.0.transformer.",
    "conditioner.embedders.1.model.", "transformer.", "model.", "" }) do
    local sub = M.sub(s, p)
    if sub["text_model.embeddings.token_embedding.weight"] or sub["token_embedding.weight"] then
      src.prefix = p
      return src, sub
    end
  end
  fail(path, fmt("not a CLIP text encoder (%s): no token embedding found; found %s", want, summarize(s, 2)))
end

-- ---------------------------------------------------------------- load_checkpoint

local function check_opts(opts)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error("kiln.load_checkpoint: options must be a table", 3) end
  local known = { tokenizer = true, vae = true, clip = true, clip_l = true, clip_g = true, prediction = true,
    family = true, scale_factor = true, zsnr = true, loras = true, embeddings = true }
  for k in pairs(opts) do
    if not known[k] then
      error(fmt("kiln.load_checkpoint: unknown option '%s' (known: %s)", tostring(k),
        table.concat(sorted_keys(known), ", ")), 3)
    end
  end
  if opts.zsnr ~= nil and type(opts.zsnr) ~= "boolean" then
    error(fmt("kiln.load_checkpoint: zsnr must be a boolean, got %s", type(opts.zsnr)), 3)
  end
  if opts.prediction and opts.prediction ~= "eps" and opts.prediction ~= "v" then
    error(fmt("kiln.load_checkpoint: prediction must be \"eps\" or \"v\", got %q", tostring(opts.prediction)), 3)
  end
  for _, k in ipairs({ "loras", "embeddings" }) do
    if opts[k] ~= nil and type(opts[k]) ~= "string" then
      error(fmt("kiln.load_checkpoint: %s must be a folder name, got %s", k, type(opts[k])), 3)
    end
  end
  return opts
end

-- The adapter side of a checkpoint: ckpt:add_lora / ckpt:find_lora (kiln.lora) and
-- the folders LoRAs and embeddings are found in by name (opts.loras, opts.embeddings).
local function with_adapters(ckpt, opts)
  ckpt.add_lora = function(self, path, o) return require("kiln.lora").add(self, path, o) end
  ckpt.find_lora = function(self, name) return require("kiln.lora").find(self, name) end
  ckpt.lora_dir, ckpt.embedding_dir = opts.loras, opts.embeddings
  local text = rawget(ckpt, "clip")
  if text and opts.embeddings then rawset(text, "embedding_dir", opts.embeddings) end
  return ckpt
end

-- ComfyUI's heuristic for SD 2.x: v-prediction models have a large spread in one
-- LayerNorm bias of the last output block.
local function guess_v(src, prefix)
  local t = src.tensors[prefix .. "output_blocks.11.1.transformer_blocks.0.norm1.bias"]
  if not t then return false end
  local f = t:to("f32")
  local m = f:mean()
  local d = f - m
  local var = (d * d):mean()
  return math.sqrt(var) > 0.09
end

local function finish(ckpt)
  -- textual inversion: ckpt:add_embedding(path [, name]) (see kiln.embedding)
  ckpt.add_embedding = function(self, path, name) return require("kiln.embedding").add(self, path, name) end
  ckpt.close = function(self)
    for _, k in ipairs({ "clip", "unet", "vae" }) do
      local p = rawget(self, k)
      if p then p:close() end
    end
  end
  return setmetatable(ckpt, {
    __close = function(t) t:close() end,
    __tostring = function(t) return fmt("checkpoint(%s, %s)", t.family, t.path) end,
  })
end

local function load_single(path, opts)
  local src = file_source(path)
  local meta = src.meta
  if opts.family then meta = setmetatable({ ["kiln.family"] = opts.family }, { __index = src.meta }) end
  local info = M.inspect(src.shapes, meta, path)
  local L = info.layout
  local family = info.family
  local ckpt = { family = family, path = path, metadata = src.meta, config = info }

  -- UNet
  local usrc = { path = path, paths = src.paths, tensors = src.tensors, shapes = src.shapes, prefix = L.unet }
  ckpt.unet = build_unet(usrc, info.unet, family)

  -- VAE: override file, else the checkpoint's
  local scale = opts.scale_factor or meta_num(src.meta, "kiln.scale_factor") or DEFAULT_SCALE[family]
  if opts.vae then
    local vsrc, sub = vae_override(opts.vae)
    local vcfg = vae.config(sub, { scale_factor = scale, shift_factor = meta_num(src.meta, "kiln.shift_factor") })
    ckpt.vae = build_vae(vsrc, vcfg)
  elseif info.vae then
    info.vae.scale_factor = scale
    ckpt.vae = build_vae({ path = path, paths = src.paths, tensors = src.tensors, shapes = src.shapes, prefix = L.vae }, info.vae)
  end

  -- text encoders: overrides, else the checkpoint's
  local encs = {}
  for i, e in ipairs(L.clip) do
    local key = (family == "sdxl") and (e.role == "g" and "clip_g" or "clip_l") or "clip"
    local esrc, cfg = { path = path, paths = src.paths, tensors = src.tensors, shapes = src.shapes, prefix = e.prefix },
        info.clip[i]
    local override = opts[key] or (family ~= "sdxl" and opts.clip_l) or nil
    if override then
      local sub
      esrc, sub = clip_override(override, key)
      cfg = clip.config(sub, { heads = meta_num(esrc.meta, "kiln.heads.clip") or meta_num(src.meta, "kiln.heads." .. (e.role == "g" and "clip_g" or "clip")),
        activation = esrc.meta["kiln.clip.activation"] })
      cfg.role = e.role
    end
    encs[i] = { src = esrc, cfg = cfg, use = encoder_use(family, e.role, cfg, src.meta) }
  end
  if #encs == 0 and (opts.clip or opts.clip_l) then
    local esrc, sub = clip_override(opts.clip or opts.clip_l, "clip")
    local cfg = clip.config(sub, { heads = meta_num(esrc.meta, "kiln.heads.clip") })
    cfg.role = "l"
    encs[1] = { src = esrc, cfg = cfg, use = encoder_use(family, "l", cfg, src.meta) }
  end
  if #encs > 0 then
    local tok, tok_src = find_tokenizer(opts, beside_dirs(path))
    ckpt.clip = build_clip(encs, family, tok,
      kiln.tokenizer and "" or " (this build has no kiln.tokenizer binding)")
    ckpt.clip.tokenizer_source = tok_src
  end

  ckpt.scale_factor = scale
  ckpt.prediction = opts.prediction or src.meta["kiln.prediction"] or
      (family == "sd2" and guess_v(src, L.unet) and "v") or "eps"
  if opts.zsnr ~= nil then ckpt.zsnr = opts.zsnr else ckpt.zsnr = src.meta["kiln.zsnr"] == "true" end
  return finish(ckpt)
end

local function load_diffusers(dir, opts)
  local ufiles = diffusers_files(join(dir, "unet"), "diffusion_pytorch_model")
  if not ufiles then
    fail(dir, "a folder, but not a diffusers model: no unet/diffusion_pytorch_model.safetensors (or sharded " ..
      "index) inside")
  end
  local usrc = multi_source(ufiles)
  usrc.map = M.diffusers_unet_map(usrc.shapes)
  local ushapes = {}
  for orig, real in pairs(usrc.map) do ushapes[orig] = usrc.shapes[real] end
  local te2 = diffusers_files(join(dir, "text_encoder_2"), "model")
  local ctx
  for n, s in pairs(ushapes) do if n:match("attn2%.to_k%.weight$") then ctx = s[2] end end
  local family = opts.family or usrc.meta["kiln.family"] or (te2 and "sdxl") or
      ({ [768] = "sd1", [1024] = "sd2", [2048] = "sdxl" })[ctx or 0]
  if not family then
    -- an unusual width: CLIP-L's QuickGELU says SD 1.x, OpenCLIP's GELU SD 2.x
    local act = json_string(read_json(join(join(dir, "text_encoder"), "config.json")), "hidden_act")
    family = act == "quick_gelu" and "sd1" or act == "gelu" and "sd2" or nil
  end
  if not family then
    fail(dir, fmt("cannot tell the family: cross-attention context width %s (set it with {family = ...})", tostring(ctx)))
  end
  if family ~= "sd1" and family ~= "sd2" and family ~= "sdxl" then
    fail(dir, fmt("family %q (expected sd1, sd2 or sdxl)", family))
  end
  local heads, head_dim = meta_num(usrc.meta, "kiln.heads.unet"), meta_num(usrc.meta, "kiln.head_dim.unet")
  if not heads and not head_dim then
    if family == "sd1" then heads = 8 else head_dim = 64 end
  end
  local ok, ucfg = pcall(unet.config, ushapes, { heads = heads, head_dim = head_dim })
  if not ok then fail(dir .. "/unet", tostring(ucfg)) end
  local ckpt = { family = family, path = dir, metadata = usrc.meta, config = { family = family, unet = ucfg } }
  usrc.prefix = ""
  ckpt.unet = build_unet(usrc, ucfg, family)

  local scale = opts.scale_factor or DEFAULT_SCALE[family]
  local vsrc, vsub
  if opts.vae then
    vsrc, vsub = vae_override(opts.vae)
  else
    local vfiles = diffusers_files(join(dir, "vae"), "diffusion_pytorch_model")
    if vfiles then
      vsrc = multi_source(vfiles)
      vsrc.map = M.diffusers_vae_map(vsrc.shapes)
      vsub = {}
      for orig, real in pairs(vsrc.map) do vsub[orig] = vsrc.shapes[real] end
      local sf = json_number(read_json(join(join(dir, "vae"), "config.json")), "scaling_factor")
      if sf and not opts.scale_factor then scale = sf end
    end
  end
  if vsrc then
    local ok2, vcfg = pcall(vae.config, vsub, { scale_factor = scale })
    if not ok2 then fail(vsrc.path, tostring(vcfg)) end
    ckpt.vae = build_vae(vsrc, vcfg)
    ckpt.config.vae = vcfg
  end

  local encs = {}
  local function add_encoder(files, role, override)
    local esrc, sub
    if override then
      esrc, sub = clip_override(override, role)
    elseif files then
      esrc = multi_source(files)
      sub = esrc.shapes
    else
      return
    end
    local act, nheads
    local config = files and read_json(join(files[1]:match("^(.*)/[^/]*$"), "config.json"))
    if config then
      act = json_string(config, "hidden_act")
      nheads = math.tointeger(json_number(config, "num_attention_heads"))
      if act and act ~= "quick_gelu" and act ~= "gelu" then
        fail(files[1], fmt("unsupported text-encoder activation %q (config.json)", act))
      end
    end
    local cfg = clip.config(sub, { heads = nheads, activation = act })
    cfg.role = role
    encs[#encs + 1] = { src = esrc, cfg = cfg, use = encoder_use(family, role, cfg, {}) }
  end
  if family == "sdxl" then
    add_encoder(diffusers_files(join(dir, "text_encoder"), "model"), "l", opts.clip_l)
    add_encoder(te2, "g", opts.clip_g)
  else
    add_encoder(diffusers_files(join(dir, "text_encoder"), "model"), family == "sd2" and "h" or "l", opts.clip)
  end
  if #encs > 0 then
    local tok, tok_src = find_tokenizer(opts, { join(dir, "tokenizer"), dir })
    ckpt.clip = build_clip(encs, family, tok, "")
    ckpt.clip.tokenizer_source = tok_src
  end
  ckpt.scale_factor = scale
  local pred = opts.prediction
  if not pred then
    local p = json_string(read_json(join(join(dir, "scheduler"), "scheduler_config.json")), "prediction_type")
    pred = p == "v_prediction" and "v" or nil
  end
  ckpt.prediction = pred or "eps"
  ckpt.zsnr = opts.zsnr or false
  return finish(ckpt)
end

-- kiln.load_checkpoint(path [, opts]) -> {clip, unet, vae, family, prediction,
-- scale_factor, metadata, path, config}; opts: tokenizer (folder with vocab.json +
-- merges.txt, or bpe_simple_vocab_16e6.txt.gz, or an open kiln.tokenizer; see
-- find_tokenizer for the order it is looked for in; clip.tokenizer_source says which
-- was used), vae (a VAE
-- file; or "taesd", a TAESD file or object: kiln.taesd), clip / clip_l / clip_g
-- (text encoder files), prediction ("eps" | "v"),
-- zsnr (boolean: the model was trained with a zero-terminal-SNR schedule; read
-- from the kiln.zsnr metadata otherwise), family (force "sd1" | "sd2" | "sdxl"),
-- scale_factor, loras / embeddings (folders ckpt:find_lora and embedding:NAME look in).
function M.load_checkpoint(path, opts)
  if type(path) ~= "string" then error("kiln.load_checkpoint: path must be a string, got " .. type(path), 2) end
  opts = check_opts(opts)
  local tv = opts.vae
  if tv == "taesd" or type(tv) == "table" or (type(tv) == "string" and require("kiln.taesd").is_file(tv)) then
    -- TAESD as the VAE (kiln.taesd): the checkpoint as it is, then its VAE replaced
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.vae = nil
    local ckpt = M.load_checkpoint(path, o)
    local ok, err = pcall(require("kiln.taesd").attach, ckpt, tv)
    if not ok then
      ckpt:close()
      error(err, 0)
    end
    return ckpt
  end
  if is_dir(path) then return with_adapters(load_diffusers((path:gsub("/+$", "")), opts), opts) end
  if not file_exists(path) then
    local f, err = io.open(path, "rb")
    if f then f:close() end
    fail(nil, err or (path .. ": cannot open"))
  end
  return with_adapters(load_single(path, opts), opts)
end

-- kiln.load_checkpoint is this function (bindings/l_kiln.c loads this module lazily)
M.load = M.load_checkpoint

-- ---------------------------------------------------------------- parts alone

-- A VAE file alone (LDM or diffusers names) -> the VAE part. The scale factor belongs
-- to the model whose latents it decodes, so the caller names it (opts.scale_factor,
-- opts.shift_factor); else the file's kiln.scale_factor metadata, else SD's.
function M.load_vae(path, opts)
  opts = opts or {}
  if type(path) ~= "string" or not file_exists(path) then fail(nil, tostring(path) .. ": no such file") end
  local vsrc, sub = vae_override(path)
  local ok, vcfg = pcall(vae.config, sub, {
    scale_factor = opts.scale_factor or meta_num(vsrc.meta, "kiln.scale_factor") or DEFAULT_SCALE.sd1,
    shift_factor = opts.shift_factor or meta_num(vsrc.meta, "kiln.shift_factor") or 0,
  })
  if not ok then fail(path, tostring(vcfg)) end
  return build_vae(vsrc, vcfg)
end

-- Text-encoder files alone -> a checkpoint holding only `clip` (ckpt.clip:encode,
-- ckpt:add_lora and embeddings work as on a whole one). The family: opts.family ("sd1",
-- "sd2", "sdxl"), else a file's kiln.family metadata, else told by the encoders: one is
-- SD 2.x when OpenCLIP-shaped or 1024 wide, else SD 1.x; two are SDXL (CLIP-L and bigG
-- in either order). Also tokenizer, loras, embeddings as load_checkpoint's.
function M.load_text_encoders(paths, opts)
  if type(paths) == "string" then paths = { paths } end
  opts = opts or {}
  if type(paths) ~= "table" or #paths < 1 or #paths > 2 then
    error("kiln.checkpoint.load_text_encoders: one or two text-encoder files", 2)
  end
  local encs, meta = {}, {}
  for i, p in ipairs(paths) do
    if type(p) ~= "string" or not file_exists(p) then fail(nil, tostring(p) .. ": no such file") end
    local esrc, sub = clip_override(p, "text encoder")
    local ok, cfg = pcall(clip.config, sub, { heads = meta_num(esrc.meta, "kiln.heads.clip"),
      activation = esrc.meta["kiln.clip.activation"] })
    if not ok then fail(p, tostring(cfg)) end
    encs[i] = { src = esrc, cfg = cfg }
    for k, v in pairs(esrc.meta) do if meta[k] == nil then meta[k] = v end end
  end
  local family = opts.family or meta["kiln.family"]
  if not family then
    if #encs == 2 then family = "sdxl"
    else
      local c = encs[1].cfg
      family = (c.layout == "openclip" or c.width == 1024) and "sd2" or "sd1"
    end
  end
  if (family == "sdxl") ~= (#encs == 2) then
    fail(paths[1], fmt("%s needs %s text encoder(s), got %d", family, family == "sdxl" and "two" or "one", #encs))
  end
  if family == "sdxl" then
    -- bigG is the wider one; at equal widths the OpenCLIP-shaped or projecting one
    local function g_like(c) return (c.layout == "openclip" or c.projection ~= nil) and 1 or 0 end
    local a, b = encs[1].cfg, encs[2].cfg
    if a.width > b.width or (a.width == b.width and g_like(a) > g_like(b)) then encs[1], encs[2] = encs[2], encs[1] end
    encs[1].cfg.role, encs[2].cfg.role = "l", "g"
  else
    encs[1].cfg.role = family == "sd2" and "h" or "l"
  end
  for _, e in ipairs(encs) do e.use = encoder_use(family, e.cfg.role, e.cfg, e.src.meta) end
  local tok, tok_src = find_tokenizer(opts, beside_dirs(encs[1].src.path))
  local ckpt = { family = family, path = paths[1], metadata = meta }
  ckpt.clip = build_clip(encs, family, tok, kiln.tokenizer and "" or " (this build has no kiln.tokenizer binding)")
  ckpt.clip.tokenizer_source = tok_src
  return with_adapters(finish(ckpt), opts)
end

-- The loading steps other model kinds share (kiln.controlnet).
M.internal = {
  validate = validate, open_store = open_store, as_model = as_model, names_of = names_of,
  shapes_of = shapes_of, has_prefix = has_prefix, fail = fail,
}

return M
