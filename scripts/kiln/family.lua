-- kiln.family: the registry of model families. Each family is one module under
-- scripts/kiln/families/ declaring, as data plus a few functions (as ComfyUI's
-- supported_models.py lists model classes), how it is recognised, its parts and their
-- name maps, its conditioning, its defaults and its latent format; this module lists
-- them in detection order and tells which one a file is. kiln.load_checkpoint asks it
-- (kiln.checkpoint assembles the parts); `kiln.families` is the list of names.
--
-- Detection tries kinds of evidence from the strongest, each over the families in
-- registry order; the first family that matches wins:
--   1. a single file's names under one of `recognise.prefixes` (its text encoders), or
--      a diffusers folder having one of `recognise.diffusers_folders`;
--   2. (nothing claimed yet) `refuse(shapes)`: a family's message for files it knows
--      kiln does not run (the SDXL refiner);
--   3. UNet names only the family has (`recognise.unet_names`);
--   4. the UNet's cross-attention width (`recognise.context_dim`, measured by
--      `recognise.context_of(shapes, prefix)`);
--   5. a GGUF file's general.architecture (`recognise.gguf_architectures`);
--   6. a diffusers text encoder's hidden_act (`recognise.text_activation`).
-- Text-encoder files alone: `recognise.text_encoders(cfgs)`. The file's __metadata__
-- `kiln.family` (a string KV in GGUF files) or the `family` option overrides all of
-- it, for files whose shapes say nothing (tiny test models); an unknown name there is
-- an error listing the known families.
--
-- A new family: a file under families/ with the fields M.REQUIRED names, and its line
-- in ORDER below (or M.register(def) at run time).
local util = require "kiln.util"
local mf = require "kiln.model_files"

local M = {}
local fmt = string.format

-- ORDER: detection order; `kiln.families` lists them so.
local ORDER = { "sd1", "sd2", "sdxl", "flux", "sd3" }

-- The fields every family declares (a family is checked when registered).
M.REQUIRED = {
  name = "string", label = "string", recognise = "table", parts = "table", unet = "table",
  conditioning = "table", defaults = "table", latent = "table",
}
M.REQUIRED_DEFAULTS = { "sampler", "scheduler", "cfg", "steps", "image_size", "prediction" }
M.REQUIRED_LATENT = { "channels", "scale_factor", "shift_factor" }

local defs, list = {}, {}
M.names = {} -- the public list (kiln.families), rebuilt on each change

local function rebuild()
  local n = {}
  for i, d in ipairs(list) do n[i] = d.name end
  M.names = n
end

--- Raises naming the first missing or mistyped field of a family definition.
function M.check(def)
  if type(def) ~= "table" then error("kiln.family: a family definition must be a table, got " .. type(def), 3) end
  local who = fmt("kiln.family: family '%s'", tostring(def.name))
  for _, k in ipairs(util.sorted_keys(M.REQUIRED)) do
    if type(def[k]) ~= M.REQUIRED[k] then
      error(fmt("%s: field '%s' must be a %s, got %s", who, k, M.REQUIRED[k], type(def[k])), 3)
    end
  end
  for _, k in ipairs(M.REQUIRED_DEFAULTS) do
    if def.defaults[k] == nil then error(fmt("%s: defaults.%s is missing", who, k), 3) end
  end
  for _, k in ipairs(M.REQUIRED_LATENT) do
    if type(def.latent[k]) ~= "number" then error(fmt("%s: latent.%s must be a number", who, k), 3) end
  end
  local encs = def.conditioning.encoders
  if type(encs) ~= "table" or #encs == 0 then error(who .. ": conditioning.encoders must list its text encoders", 3) end
  for i, e in ipairs(encs) do
    if type(e.role) ~= "string" or type(e.options) ~= "table" or type(e.meta) ~= "string" then
      error(fmt("%s: conditioning.encoders[%d] needs role, options and meta", who, i), 3)
    end
  end
  if type(def.parts.ldm) ~= "table" or type(def.parts.ldm.find_unet) ~= "function" then
    error(who .. ": parts.ldm.find_unet must be a function (where a single file keeps the UNet)", 3)
  end
  return def
end

--- Adds a family (a definition as the files under families/ declare). opts.before =
-- NAME puts it ahead of that family in detection order (default: last).
function M.register(def, opts)
  M.check(def)
  if defs[def.name] then error(fmt("kiln.family.register: family '%s' is already registered", def.name), 2) end
  local at = #list + 1
  if opts and opts.before then
    at = nil
    for i, d in ipairs(list) do if d.name == opts.before then at = i end end
    if not at then error(fmt("kiln.family.register: no family '%s' to put '%s' before", opts.before, def.name), 2) end
  end
  table.insert(list, at, def)
  defs[def.name] = def
  rebuild()
  return def
end

--- Removes a family registered at run time.
function M.unregister(name)
  if not defs[name] then return end
  defs[name] = nil
  for i = #list, 1, -1 do if list[i].name == name then table.remove(list, i) end end
  rebuild()
end

for _, name in ipairs(ORDER) do M.register(require("kiln.families." .. name)) end

--- The definition of a family, or nil.
function M.get(name) return defs[name] end

--- The families' definitions in detection order (a copy).
function M.all()
  local r = {}
  for i, d in ipairs(list) do r[i] = d end
  return r
end

--- "SD 1.x" for "sd1" (the name itself when unknown).
function M.label(name)
  local d = defs[name]
  return d and d.label or tostring(name)
end

--- "sd1, sd2, sdxl"
function M.known() return table.concat(M.names, ", ") end

--- The definition of a named family; an unknown name is an error naming the file, where
-- the name came from, and the known families.
function M.resolve(name, path, where, who)
  local d = type(name) == "string" and defs[name]
  if d then return d end
  util.file_error(who or "kiln.load_checkpoint", path,
    fmt("unknown family %q (%s); kiln runs: %s", tostring(name), where or "kiln.family", M.known()))
end

-- ---------------------------------------------------------------- detection

local function any_prefix(shapes, prefixes)
  for _, p in ipairs(prefixes or {}) do
    if mf.has_prefix(shapes, p) then return true end
  end
  return false
end

-- Evidence from a UNet's names (kinds 3 to 5): unet_shapes under prefix.
local function by_unet(shapes, prefix, meta)
  for _, d in ipairs(list) do
    for _, n in ipairs(d.recognise.unet_names or {}) do
      if shapes[prefix .. n] then return d end
    end
  end
  local measured = {}
  for _, d in ipairs(list) do
    local r = d.recognise
    if r.context_dim and r.context_of then
      if measured[r.context_of] == nil then measured[r.context_of] = r.context_of(shapes, prefix) or false end
      if measured[r.context_of] == r.context_dim then return d end
    end
  end
  local arch = meta and meta["general.architecture"]
  if arch then
    for _, d in ipairs(list) do
      for _, a in ipairs(d.recognise.gguf_architectures or {}) do
        if a == arch then return d end
      end
    end
  end
  return nil
end

--- The family a UNet's shapes (its original names, no prefix) say, or nil: for files
-- that are only a UNet-shaped network (ControlNets).
function M.detect_unet(shapes)
  local d = by_unet(shapes, "", nil)
  return d and d.name or nil
end

--- A GGUF file's general.architecture must be one kiln runs.
function M.check_gguf(meta, path, who)
  local arch = meta and meta["general.architecture"]
  if not arch then return end
  for _, d in ipairs(list) do
    for _, a in ipairs(d.recognise.gguf_architectures or {}) do
      if a == arch then return end
    end
  end
  local labels = {}
  for i, d in ipairs(list) do labels[i] = d.label end
  local all = #labels > 1 and table.concat(labels, ", ", 1, #labels - 1) .. " and " .. labels[#labels] or labels[1]
  util.file_error(who or "kiln.load_checkpoint", path, fmt("unknown architecture '%s' in this GGUF file " ..
    "(general.architecture); kiln runs %s UNets (%s)", arch, all, M.known()))
end

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

--- Where the parts of a single-file checkpoint live and which family it is, from its
-- names and metadata: {family, unet = prefix, vae = prefix, has_vae, clip = {{prefix,
-- role}, ...}}. clip lists the text encoders the file has (those of the family whose
-- encoders it carries: a kiln.family override keeps them). `forced`: the family option.
function M.layout(shapes, meta, path, forced)
  local function fail(msg) util.file_error("kiln.load_checkpoint", path, msg) end
  local n_lora, example = looks_like_lora(shapes)
  if n_lora > 0 then
    fail(fmt("this looks like a LoRA (%d tensors such as '%s'), not a checkpoint: load a full " ..
      "checkpoint with kiln.load_checkpoint and apply the LoRA to it", n_lora, example))
  end
  local L = { clip = {} }
  local unet_prefix
  for _, d in ipairs(list) do
    unet_prefix = d.parts.ldm.find_unet(shapes)
    if unet_prefix then break end
  end
  local family
  for _, d in ipairs(list) do
    if any_prefix(shapes, d.recognise.prefixes) then
      family = d
      L.clip = d.parts.ldm.clip or {}
      break
    end
  end
  if not family then
    for _, d in ipairs(list) do
      local msg = d.refuse and d.refuse(shapes)
      if msg then fail(msg) end
    end
  end
  if unet_prefix and not family then family = by_unet(shapes, unet_prefix, meta) end
  local name = forced or (meta and meta["kiln.family"])
  if name then
    family = M.resolve(name, path, forced and "the family option" or "__metadata__ kiln.family")
  end
  if not unet_prefix or not family then
    local what = "unknown checkpoint layout"
    local has = function(p) return mf.has_prefix(shapes, p) end
    if not unet_prefix and (has("encoder.conv_in.") or has("decoder.conv_in.")) then
      what = "this looks like a standalone VAE; pass it as kiln.load_checkpoint(ckpt, {vae = PATH})"
    elseif not unet_prefix and (has("text_model.") or has("token_embedding.")) then
      what = "this looks like a standalone text encoder; pass it as kiln.load_checkpoint(ckpt, {clip = PATH})"
    elseif not unet_prefix and shapes["input_blocks.0.0.weight"] then
      what = "this looks like a UNet without the model.diffusion_model. prefix; kiln needs a full single-file " ..
          "checkpoint or a diffusers folder"
    elseif not unet_prefix and shapes["conv_in.weight"] and has("down_blocks.") then
      what = "this looks like a diffusers UNet file; pass the diffusers folder (with unet/, vae/, text_encoder/)"
    elseif unet_prefix then
      what = "a UNet without a recognizable text encoder and an unusual context width; set __metadata__ kiln.family"
    end
    fail(fmt("%s. Expected model.diffusion_model.* (UNet), first_stage_model.* (VAE) and " ..
      "cond_stage_model.* or conditioner.embedders.* (text encoders); found %d tensors: %s",
      what, mf.count(shapes), mf.summarize(shapes, 2)))
  end
  if #L.clip == 0 and not name then
    -- told by its network's names: the text encoders the family's files may carry
    -- beside it (a whole ComfyUI Flux checkpoint) that this file has
    for _, e in ipairs(family.parts.ldm.clip or {}) do
      if family.dit and mf.has_prefix(shapes, e.prefix) then L.clip[#L.clip + 1] = e end
    end
  end
  L.family = family.name
  L.unet = unet_prefix
  L.vae = family.parts.ldm.vae
  L.has_vae = L.vae ~= nil and mf.has_prefix(shapes, L.vae)
  return L
end

--- The family of a diffusers folder. ev: {unet_shapes (original names), meta (the
-- UNet's), folders (set of the folder's entries), text_activation = function() ->
-- hidden_act of text_encoder/config.json}; forced: the family option. nil when nothing
-- tells.
function M.detect_diffusers(ev, forced, path)
  local name = forced or ev.meta["kiln.family"]
  if name then
    return M.resolve(name, path, forced and "the family option" or "__metadata__ kiln.family")
  end
  for _, d in ipairs(list) do
    for _, f in ipairs(d.recognise.diffusers_folders or {}) do
      if ev.folders[f] then return d end
    end
  end
  local d = by_unet(ev.unet_shapes, "", nil)
  if d then return d end
  -- an unusual width: CLIP-L's QuickGELU says SD 1.x, OpenCLIP's GELU SD 2.x
  local act = ev.text_activation()
  for _, f in ipairs(list) do
    if act and f.recognise.text_activation == act then return f end
  end
  return nil
end

--- The family of text-encoder files given alone (cfgs: their clip configurations),
-- or nil.
function M.detect_text_encoders(cfgs)
  for _, d in ipairs(list) do
    if d.recognise.text_encoders and d.recognise.text_encoders(cfgs) then return d end
  end
  return nil
end

-- ---------------------------------------------------------------- what a family says

local function meta_num(meta, key)
  local v = meta and meta[key]
  if v == nil then return nil end
  local n = tonumber(v)
  if not n then error(fmt("kiln.load_checkpoint: __metadata__ %s = %q is not a number", key, v), 0) end
  return n
end
M.meta_num = meta_num

--- The conditioning entry of an encoder role (the family's first when it has no
-- encoder of that role: an override file given for another role).
function M.encoder_spec(def, role)
  for _, e in ipairs(def.conditioning.encoders) do
    if e.role == role then return e end
  end
  return def.conditioning.encoders[1]
end

--- How an encoder of the family is used: {layer, final_norm, pad, pooled} (clip.new_text's
-- entries); kiln.clip.layer in meta overrides the layer where the family allows it.
function M.encoder_use(def, role, cfg, meta)
  local e = M.encoder_spec(def, role)
  local layer = e.layer
  if e.layer_from_metadata then layer = meta_num(meta, "kiln.clip.layer") or layer end
  -- pooled = "unprojected": the final norm at the end token without the projection (Flux's CLIP-L)
  local pooled = e.pooled == "unprojected" and "unprojected" or (e.pooled and cfg.projection ~= nil or false)
  return { layer = layer, final_norm = e.final_norm, pad = e.pad, pooled = pooled }
end

--- The UNet's heads / head_dim: the metadata's (kiln.heads.unet, kiln.head_dim.unet),
-- else the family's.
function M.unet_heads(def, meta)
  local heads, head_dim = meta_num(meta, "kiln.heads.unet"), meta_num(meta, "kiln.head_dim.unet")
  if not heads and not head_dim then heads, head_dim = def.unet.heads, def.unet.head_dim end
  return heads, head_dim
end

return M
