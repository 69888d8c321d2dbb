-- kiln.embedding: textual-inversion embeddings: reading A1111 / ComfyUI .safetensors
-- files, checking them against a checkpoint's text encoders, and the name table a
-- prompt's `embedding:NAME` is looked up in (names added by ckpt:add_embedding, then
-- NAME.safetensors in the checkpoint's embeddings folder).
--   File layouts: emb_params [n, dim] (A1111 / ComfyUI), string_to_param.* (A1111's
--   .pt dictionary flattened into safetensors), clip_l [n, 768] + clip_g [n, 1280]
--   (SDXL); a file holding one float tensor of another name is taken as the vectors,
--   as ComfyUI does.
local kiln = require "kiln"
local lfs = require "lfs"
local util = require "kiln.util"
local mf = require "kiln.model_files"

local M = {}
local fmt = string.format

local ROLE_KEY = { l = "clip_l", g = "clip_g", h = "clip_h" }
local ROLE_NAME = { l = "CLIP ViT-L", g = "OpenCLIP ViT-bigG", h = "OpenCLIP ViT-H" }
local FLOAT = { f32 = true, f16 = true, bf16 = true }

local function is_file(p) return lfs.attributes(p, "mode") == "file" end

-- The name a file gives by default: its base name without the extension.
function M.stem(path)
  local base = path:match("([^/\\]*)$")
  return base:match("^(.+)%.[^.]*$") or base
end

local function pickle_help()
  -- kiln.model_files owns the conversion hint, so the two never differ. An A1111 .pt
  -- keeps its vectors in a nested dictionary, which that one-liner (flat tensors only)
  -- would drop, hence the second line.
  return mf.PICKLE_HELP .. "\nFor an A1111 embedding (.pt): python -c \"import " ..
      "torch, safetensors.torch as s; d = torch.load('IN.pt', map_location='cpu'); s.save_file({'emb_params': " ..
      "d['string_to_param']['*'].contiguous()}, 'OUT.safetensors')\""
end

local is_pickle = mf.is_pickle_name

-- [n, dim] (a 1-D [dim] file is one vector), as a host f32 tensor.
local function as_vectors(t, where)
  if #t.shape == 1 then t = t:reshape({ 1, t.shape[1] }) end
  if #t.shape ~= 2 then
    error(fmt("%s: shape %s, expected [vectors, width]", where, util.shape_str(t)), 0)
  end
  if t.dtype ~= "f32" then t = t:to("f32") end
  return t
end

-- path [, name] -> embedding {name, path, count, vectors = {clip_l =, clip_g =, ...}
-- or {any = T}, keys (list of the keys used)}. Errors start with `who`.
function M.read(path, name, who)
  who = who or "kiln.embedding"
  if type(path) ~= "string" then error(fmt("%s: path must be a string, got %s", who, type(path)), 0) end
  if name ~= nil and (type(name) ~= "string" or name == "") then
    error(fmt("%s: name must be a non-empty string", who), 0)
  end
  if is_pickle(path) then error(fmt("%s: '%s': %s", who, path, pickle_help()), 0) end
  if not is_file(path) then error(fmt("%s: '%s': no such file", who, path), 0) end
  local ok, tensors = pcall(kiln.load_safetensors, path)
  if not ok then error(fmt("%s: '%s': cannot read it as safetensors: %s", who, path, tostring(tensors)), 0) end
  name = name or M.stem(path)
  local emb = { name = name, path = path, vectors = {}, keys = {} }
  local function take(slot, key)
    emb.vectors[slot] = as_vectors(tensors[key], fmt("%s: '%s': %s", who, path, key))
    emb.keys[#emb.keys + 1] = key
  end
  local found = {}
  for k in pairs(tensors) do found[#found + 1] = k end
  table.sort(found)
  if tensors.clip_l or tensors.clip_g or tensors.clip_h then
    for _, key in ipairs({ "clip_l", "clip_g", "clip_h" }) do
      if tensors[key] then take(key, key) end
    end
  elseif tensors.emb_params then
    take("any", "emb_params")
  else
    local params = {}
    for _, k in ipairs(found) do if k:match("^string_to_param%.") then params[#params + 1] = k end end
    local floats = {}
    for _, k in ipairs(found) do if FLOAT[tensors[k].dtype] then floats[#floats + 1] = k end end
    if #params == 1 then
      take("any", params[1])
    elseif #params == 0 and #floats == 1 then
      take("any", floats[1])
    else
      local ex = {}
      for i = 1, math.min(3, #found) do ex[i] = found[i] end
      error(fmt("%s: '%s': not a textual-inversion embedding: expected emb_params, string_to_param.*, " ..
        "or clip_l + clip_g; found %d tensors%s", who, path, #found,
        #ex > 0 and (" (" .. table.concat(ex, ", ") .. (#found > 3 and ", ..." or "") .. ")") or ""), 0)
    end
  end
  -- every encoder gets the same number of vectors: the prompt holds one placeholder
  -- per vector, shared by the encoders
  for slot, v in pairs(emb.vectors) do
    emb.count = emb.count or v.shape[1]
    if v.shape[1] ~= emb.count then
      error(fmt("%s: '%s': %s has %d vectors but %s has %d (the encoders must get as many)", who, path,
        slot, v.shape[1], emb.keys[1], emb.count), 0)
    end
  end
  if emb.count == 0 then error(fmt("%s: '%s': the embedding has no vectors", who, path), 0) end
  -- a chunk is 75 tokens and A1111 never splits an embedding across chunks
  if emb.count > 75 then
    error(fmt("%s: '%s': %d vectors, more than a 75-token prompt chunk holds", who, path, emb.count), 0)
  end
  return emb
end

-- The vectors [n, width] for a text encoder of role "l" | "g" | "h" and its width.
function M.vectors_for(emb, role, width, n_encoders, who)
  local v = emb.vectors[ROLE_KEY[role] or ""] or emb.vectors.any
  if not v then
    local have = {}
    for k in pairs(emb.vectors) do have[#have + 1] = k end
    table.sort(have)
    error(fmt("%s: embedding '%s' has vectors for %s, none for this checkpoint's text encoder (%s, %s)", who,
      emb.name, table.concat(have, ", "), ROLE_NAME[role] or "?", ROLE_KEY[role] or "?"), 0)
  end
  if v.shape[2] ~= width then
    local which = n_encoders > 1 and fmt(" (%s)", ROLE_KEY[role] or role) or ""
    error(fmt("%s: embedding '%s'%s has width %d, this checkpoint's text encoder takes %d", who, emb.name,
      which, v.shape[2], width), 0)
  end
  return v
end

-- Checks an embedding against every encoder of a clip part (kiln.clip Text).
function M.check(emb, text, who)
  for _, e in ipairs(text.encoders) do
    local cfg = e.enc.config
    M.vectors_for(emb, cfg.role or "l", cfg.width, #text.encoders, who)
  end
end

-- ---------------------------------------------------------------- the name table

-- The table of a clip part: {names = {NAME -> embedding}, dir = folder or nil}.
function M.table_of(text)
  local t = rawget(text, "embeddings")
  if not t then
    t = { names = {} }
    rawset(text, "embeddings", t)
  end
  return t
end

-- NAME.safetensors in dir or below it: util.find_file.
local search = util.find_file

-- A prompt's embedding name (`embedding:NAME`, `embedding:NAME.safetensors`) -> the
-- embedding checked against text's encoders: an added one, else NAME.safetensors in
-- the embeddings folder (then kept in the table).
function M.resolve(text, name, who)
  who = who or "clip:encode"
  local t = M.table_of(text)
  local key = name:gsub("%.safetensors$", "")
  local emb = t.names[key]
  if emb then return emb end
  local dir = t.dir or rawget(text, "embedding_dir")
  if is_pickle(name) then
    error(fmt("%s: embedding '%s': %s", who, name, pickle_help()), 0)
  end
  if not dir then
    error(fmt("%s: embedding '%s' is unknown: add it with ckpt:add_embedding(path) or name a folder with " ..
      "kiln.load_checkpoint(path, {embeddings = DIR})", who, key), 0)
  end
  local path = search(dir, key .. ".safetensors")
  if not path then
    for _, ext in ipairs({ ".pt", ".bin", ".ckpt", ".pth" }) do
      local p = search(dir, key .. ext)
      if p then error(fmt("%s: embedding '%s' is %s: %s", who, key, p, pickle_help()), 0) end
    end
    error(fmt("%s: embedding '%s' not found: no %s.safetensors in the embeddings folder %s (subfolders searched)",
      who, key, key, dir), 0)
  end
  emb = M.read(path, key, who)
  M.check(emb, text, who)
  t.names[key] = emb
  return emb
end

-- ckpt:add_embedding(path [, name]) -> the embedding (name, path, count).
function M.add(ckpt, path, name)
  local who = "ckpt:add_embedding"
  local text = rawget(ckpt, "clip")
  if not text then error(who .. ": this checkpoint has no text encoder", 2) end
  local emb = M.read(path, name, who)
  M.check(emb, text, who)
  M.table_of(text).names[emb.name] = emb
  return emb
end

-- Records the folder `embedding:NAME` looks in when NAME was not added.
function M.set_dir(text, dir)
  if text then M.table_of(text).dir = dir end
end

-- ---------------------------------------------------------------- prompts

-- Splits a prompt piece's text into runs of text and embedding references:
-- "a embedding:x, b" -> {"a ", {embedding = "x"}, ", b"}. The name runs to the next
-- space, comma, colon or bracket; "embedding:" only counts at the start of a word.
function M.split(s)
  local out, pos = {}, 1
  while true do
    local a, b, nm = s:find("embedding:([^%s,:%(%)%[%]\\]+)", pos)
    while a and a > 1 and s:sub(a - 1, a - 1):match("[%w_]") do
      a, b, nm = s:find("embedding:([^%s,:%(%)%[%]\\]+)", a + 1)
    end
    if not a then break end
    if a > pos then out[#out + 1] = s:sub(pos, a - 1) end
    out[#out + 1] = { embedding = nm }
    pos = b + 1
  end
  if pos <= #s or #out == 0 then out[#out + 1] = s:sub(pos) end
  return out
end

return M
