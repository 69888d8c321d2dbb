-- kiln.lora: LoRA-family adapter files (kohya / A1111, diffusers / PEFT, LyCORIS LoHa
-- and LoKr, full differences, DoRA) read, their format told from the keys, their keys
-- mapped onto a checkpoint's weights and added as patches of the weight stores
-- (model:add_patch): the store builds every copy of a patched weight as the mapped
-- file plus the deltas, so nothing is merged or written and removal is exact.
--   local h = ckpt:add_lora(path [, {unet = 1.0, clip = 1.0, name = NAME}])
--   h.patched, h.unmatched, h.format, h.family, h:remove()
--   kiln.lora.inspect(path) -> {format, family, parts = {unet, clip}, keys}
--
-- Key mapping. No table of names is pasted here: the names a LoRA may use are derived
-- from the checkpoint's own tensors. Each weight's module path is written in every
-- spelling a trainer uses (the original CompVis / sgm path, its diffusers path, the
-- Hugging Face CLIP path of an OpenCLIP tensor; '.' kept or turned into '_' with the
-- kohya prefixes), and a LoRA key is looked up in that set: '_' is ambiguous in a
-- kohya key ("to_q" vs a block index), an exact lookup is not.
local kiln = require "kiln"
local lfs = require "lfs"
local util = require "kiln.util"
local mf = require "kiln.model_files"
local families = require "kiln.family"
local unet = require "kiln.unet"
local clip = require "kiln.clip"
local few_step_kind = require "kiln.few_step_kind"

local M = {}
-- the key mapping's parts, for the tests and for tools that inspect a mapping
local K = {}
M.mapping = K
local fmt = string.format

local shape_str = util.shape_str

local function numel(s)
  local n = 1
  for i = 1, #s do n = n * s[i] end
  return n
end

local sorted_keys = util.sorted_keys

local function stem(path) return (path:match("([^/]+)$") or path):gsub("%.[^.]*$", "") end

-- ---------------------------------------------------------------- the keys of a file

-- Key endings -> {role, naming}. A key is module .. ending; the role says what the
-- tensor is, the naming which trainer writes it so.
local ENDINGS = {
  { ".lora_up.weight", "up", "kohya" }, { ".lora_down.weight", "down", "kohya" },
  { ".lora_mid.weight", "mid", "kohya" },
  { ".lora_B.default.weight", "up", "peft" }, { ".lora_A.default.weight", "down", "peft" },
  { ".lora_B.weight", "up", "peft" }, { ".lora_A.weight", "down", "peft" },
  { ".lora.up.weight", "up", "diffusers" }, { ".lora.down.weight", "down", "diffusers" },
  { "_lora.up.weight", "up", "diffusers" }, { "_lora.down.weight", "down", "diffusers" },
  { ".lora_linear_layer.up.weight", "up", "diffusers" }, { ".lora_linear_layer.down.weight", "down", "diffusers" },
  { ".alpha", "alpha" }, { ".dora_scale", "dora_scale" },
  { ".hada_w1_a", "hada_w1_a", "lycoris-loha" }, { ".hada_w1_b", "hada_w1_b", "lycoris-loha" },
  { ".hada_w2_a", "hada_w2_a", "lycoris-loha" }, { ".hada_w2_b", "hada_w2_b", "lycoris-loha" },
  { ".hada_t1", "hada_t1", "lycoris-loha" }, { ".hada_t2", "hada_t2", "lycoris-loha" },
  { ".lokr_w1", "lokr_w1", "lycoris-lokr" }, { ".lokr_w2", "lokr_w2", "lycoris-lokr" },
  { ".lokr_w1_a", "lokr_w1_a", "lycoris-lokr" }, { ".lokr_w1_b", "lokr_w1_b", "lycoris-lokr" },
  { ".lokr_w2_a", "lokr_w2_a", "lycoris-lokr" }, { ".lokr_w2_b", "lokr_w2_b", "lycoris-lokr" },
  { ".lokr_t2", "lokr_t2", "lycoris-lokr" },
  { ".diff", "diff", "lycoris-full" }, { ".diff_b", "diff_b", "lycoris-full" },
  { ".set_weight", "set_weight", "lycoris-full" },
  { ".w_norm", "diff", "lycoris-full" }, { ".b_norm", "diff_b", "lycoris-full" },
}

-- key -> module, role, naming (nil when the ending is not an adapter's).
function K.split_key(key)
  -- XLabs' Flux LoRAs: double_blocks.0.processor.qkv_lora1.down.weight (the module is
  -- the processor's layer; "qkv_lora.down" must not read as diffusers' "_lora.down")
  local xmod, which = key:match("^(.*%.processor%.%a+_lora%d*)%.(%a+)%.weight$")
  if xmod and (which == "down" or which == "up") then return xmod, which, "xlabs" end
  for _, e in ipairs(ENDINGS) do
    local suf = e[1]
    if #key > #suf and key:sub(-#suf) == suf then return key:sub(1, -#suf - 1), e[2], e[3] end
  end
  return nil
end

-- The adapter of one module: its kind ("lora", "loha", "lokr", "diff") and naming,
-- from the roles present. Incomplete sets (an up without a down) give nil.
local function kind_of(roles)
  if roles.up and roles.down then return "lora" end
  if roles.hada_w1_a and roles.hada_w1_b and roles.hada_w2_a and roles.hada_w2_b then return "loha" end
  if (roles.lokr_w1 or (roles.lokr_w1_a and roles.lokr_w1_b)) and (roles.lokr_w2 or (roles.lokr_w2_a and roles.lokr_w2_b)) then
    return "lokr"
  end
  if roles.diff or roles.diff_b or roles.set_weight then return "diff" end
  return nil
end

-- names (list of keys) -> modules {module -> {roles = {role -> key}, naming}}, others
-- (keys no adapter ending explains).
function K.group(names)
  local modules, others = {}, {}
  for _, key in ipairs(names) do
    local mod, role, naming = K.split_key(key)
    if mod then
      local m = modules[mod]
      if not m then
        m = { roles = {}, namings = {} }
        modules[mod] = m
      end
      m.roles[role] = key
      if naming then m.namings[naming] = true end
    else
      others[#others + 1] = key
    end
  end
  for _, m in pairs(modules) do
    m.kind = kind_of(m.roles)
    local n = m.kind == "lora" and (m.namings.kohya and "kohya" or m.namings.peft and "peft" or
          m.namings.xlabs and "xlabs" or "diffusers")
        or m.kind == "loha" and "lycoris-loha" or m.kind == "lokr" and "lycoris-lokr" or "lycoris-full"
    m.naming = n
  end
  return modules, others
end

-- The format of a file from its modules: the naming of most of them, the others joined
-- with "+" ("kohya+lycoris-loha"); "+dora" when any carries a dora_scale.
local function format_of(modules)
  local count, dora = {}, false
  for _, m in pairs(modules) do
    if m.kind then
      count[m.naming] = (count[m.naming] or 0) + 1
      if m.roles.dora_scale then dora = true end
    end
  end
  local names = sorted_keys(count)
  table.sort(names, function(a, b)
    if count[a] ~= count[b] then return count[a] > count[b] end
    return a < b
  end)
  local f = table.concat(names, "+")
  if dora then f = f .. "+dora" end
  return f ~= "" and f or nil
end

-- ---------------------------------------------------------------- delta shapes

-- A module's delta: out (dim 1), in_width (the input features, the kernel not
-- counted) and its element count, from the factor shapes (shape_of(key) -> shape).
local function delta_dims(m, shape_of)
  local r = m.roles
  local S = function(role) return r[role] and shape_of(r[role]) end
  if m.kind == "lora" then
    local up, down, mid = S("up"), S("down"), S("mid")
    local per_out = numel(down) // down[1]
    if mid then per_out = down[2] * (mid[3] or 1) * (mid[4] or 1) end
    return up[1], down[2], up[1] * per_out, { up[1], down[2] }
  elseif m.kind == "loha" then
    local w1a, w1b, t1 = S("hada_w1_a"), S("hada_w1_b"), S("hada_t1")
    if t1 then
      local out = w1a[2]
      return out, w1b[2], out * w1b[2] * (t1[3] or 1) * (t1[4] or 1), { out, w1b[2] }
    end
    return w1a[1], w1b[2], w1a[1] * w1b[2], { w1a[1], w1b[2] }
  elseif m.kind == "lokr" then
    local a, b, c, d, k
    local w1 = S("lokr_w1")
    if w1 then a, b = w1[1], w1[2] else a, b = S("lokr_w1_a")[1], S("lokr_w1_b")[2] end
    local w2, t2 = S("lokr_w2"), S("lokr_t2")
    if w2 then
      c, d, k = w2[1], w2[2], (w2[3] or 1) * (w2[4] or 1)
    elseif t2 then
      c, d, k = S("lokr_w2_a")[2], S("lokr_w2_b")[2], (t2[3] or 1) * (t2[4] or 1)
    else
      c, d, k = S("lokr_w2_a")[1], S("lokr_w2_b")[2], 1
    end
    return a * c, b * d, a * c * b * d * k, { a * c, b * d }
  else
    local s = S("diff") or S("set_weight")
    if not s then return nil end
    return s[1], s[2], numel(s), s
  end
end

-- ---------------------------------------------------------------- the family of a LoRA

local function part_of_key(mod)
  if mod:match("^lora_te") or mod:match("^text_encoder") or mod:match("^te%d?[._]") then return "clip" end
  if mod:match("^lora_unet_") or mod:match("^unet%.") or mod:match("^diffusion_model%.") or
      mod:match("^model%.diffusion_model%.") or mod:match("^base_model%.model%.") or
      mod:match("^down_blocks%.") or mod:match("^up_blocks%.") or mod:match("^mid_block%.") or
      mod:match("^input_blocks") or mod:match("^output_blocks") or mod:match("^middle_block") or
      mod:match("^time_embed") or mod:match("^conv_in") or mod:match("^conv_out") or mod:match("^add_embedding") then
    return "unet"
  end
  return nil
end

-- modules, shape_of -> family ("sd1" | "sd2" | "sdxl" | nil) and the evidence, from
-- widths only the standard models have (a tiny test model shows none) and from the
-- second text encoder that only SDXL has.
function K.family_of(modules, shape_of)
  local ev = {}
  local function note(fam, why)
    ev[fam] = ev[fam] or {}
    ev[fam][why] = true
  end
  for mod, m in pairs(modules) do
    if m.kind then
      local lower = mod:lower()
      local part = part_of_key(mod)
      if mod:match("^lora_te2_") or mod:match("^text_encoder_2%.") or mod:match("clip_g%.") then
        note("sdxl", fmt("a second text encoder (%s)", mod:match("^lora_te2_") and "lora_te2_*" or "text_encoder_2.*"))
      end
      if part == "unet" and (lower:match("label_emb") or lower:match("add_embedding")) then
        note("sdxl", "the size-conditioning embedding (label_emb)")
      end
      for _, d in ipairs(families.all()) do
        local why = d.lora and require(d.lora).evidence(mod)
        if why then note(d.name, why) end
      end
      local ok, _, in_w = pcall(delta_dims, m, shape_of)
      if ok and in_w then
        if part == "clip" and (lower:match("q_proj") or lower:match("k_proj") or lower:match("fc1") or lower:match("to_q")) then
          if in_w == 1280 then note("sdxl", "text encoder width 1280")
          elseif in_w == 1024 then note("sd2", "text encoder width 1024")
          elseif in_w == 768 and not (mod:match("^lora_te1_") or mod:match("^text_encoder%.")) then
            note("sd1", "text encoder width 768")
          end
        elseif part == "unet" and (lower:match("attn2[._]to_k") or lower:match("attn2[._]to_v") or
              lower:match("attn2[._]processor[._]to_k")) then
          if in_w == 2048 then note("sdxl", "cross-attention context 2048")
          elseif in_w == 1024 then note("sd2", "cross-attention context 1024")
          elseif in_w == 768 then note("sd1", "cross-attention context 768") end
        end
      end
    end
  end
  -- the transformer families' names say more than the UNets' widths
  local order = {}
  for _, d in ipairs(families.all()) do if d.lora then order[#order + 1] = d.name end end
  for _, f in ipairs({ "sdxl", "sd2", "sd1" }) do order[#order + 1] = f end
  for _, f in ipairs(order) do
    if ev[f] then return f, table.concat(sorted_keys(ev[f]), ", ") end
  end
  return nil
end

-- What a file that is not a LoRA looks like, from its names.
local function describe_other(names)
  local set = {}
  for _, n in ipairs(names) do set[n] = true end
  local function any(pat)
    for _, n in ipairs(names) do if n:match(pat) then return n end end
  end
  local what
  if any("^model%.diffusion_model%.") or any("^conditioner%.") or any("^cond_stage_model%.") then
    what = "a full checkpoint (load it with kiln.load_checkpoint)"
  elseif set.emb_params or any("^string_to_param") or (set.clip_l and set.clip_g) then
    what = "a textual-inversion embedding (use ckpt:add_embedding)"
  elseif any("^control_model%.") or any("input_hint_block") or any("^controlnet_cond_embedding") then
    what = "a ControlNet (load it with kiln.load_controlnet)"
  elseif any("^encoder%.conv_in") or any("^decoder%.conv_in") or any("^first_stage_model%.") then
    what = "a VAE"
  elseif any("^input_blocks%.") or any("^down_blocks%.%d+%.resnets") then
    what = "a UNet's weights"
  elseif any("^text_model%.") or any("^transformer%.resblocks") then
    what = "a text encoder's weights"
  elseif any("^model%.") or any("^body%.") or any("^conv_first") then
    what = "an upscaler or other network"
  end
  local ex = {}
  table.sort(names)
  for i = 1, math.min(3, #names) do ex[i] = names[i] end
  return fmt("%s%d tensors such as %s", what and (what .. ": ") or "", #names, table.concat(ex, ", "))
end

-- ---------------------------------------------------------------- the checkpoint's names

-- original (CompVis / sgm) UNet tensor name -> diffusers name: the inverse of
-- kiln.families.sd.diffusers_unet_map (nrb: res blocks per level). nil for a name diffusers
-- does not have.
local RES_INV = {
  { "in_layers.0.", "norm1." }, { "in_layers.2.", "conv1." }, { "emb_layers.1.", "time_emb_proj." },
  { "out_layers.0.", "norm2." }, { "out_layers.3.", "conv2." }, { "skip_connection.", "conv_shortcut." },
}
local TOP_INV = {
  { "time_embed.0.", "time_embedding.linear_1." }, { "time_embed.2.", "time_embedding.linear_2." },
  { "label_emb.0.0.", "add_embedding.linear_1." }, { "label_emb.0.2.", "add_embedding.linear_2." },
  { "input_blocks.0.0.", "conv_in." }, { "out.0.", "conv_norm_out." }, { "out.2.", "conv_out." },
}

local function res_inv(rest)
  for _, p in ipairs(RES_INV) do
    if rest:sub(1, #p[1]) == p[1] then return p[2] .. rest:sub(#p[1] + 1) end
  end
  return nil
end

function K.unet_to_diffusers(name, nrb)
  for _, p in ipairs(TOP_INV) do
    if name:sub(1, #p[1]) == p[1] then return p[2] .. name:sub(#p[1] + 1) end
  end
  local per = nrb + 1
  local k, b, rest = name:match("^input_blocks%.(%d+)%.(%d)%.(.*)$")
  if k then
    k = tonumber(k)
    local i, j = (k - 1) // per, (k - 1) % per
    if b == "0" and j == nrb then
      local r = rest:match("^op%.(.*)$")
      return r and fmt("down_blocks.%d.downsamplers.0.conv.%s", i, r)
    elseif b == "0" then
      local r = res_inv(rest)
      return r and fmt("down_blocks.%d.resnets.%d.%s", i, j, r)
    elseif b == "1" then
      return fmt("down_blocks.%d.attentions.%d.%s", i, j, rest)
    end
    return nil
  end
  b, rest = name:match("^middle_block%.(%d)%.(.*)$")
  if b == "0" or b == "2" then
    local r = res_inv(rest)
    return r and fmt("mid_block.resnets.%d.%s", tonumber(b) // 2, r)
  elseif b == "1" then
    return "mid_block.attentions.0." .. rest
  end
  k, b, rest = name:match("^output_blocks%.(%d+)%.(%d)%.(.*)$")
  if k then
    k = tonumber(k)
    local i, j = k // per, k % per
    if b == "0" then
      local r = res_inv(rest)
      return r and fmt("up_blocks.%d.resnets.%d.%s", i, j, r)
    end
    -- an attention block has no direct "conv" child: a conv is the upsampler
    local r = rest:match("^conv%.(.*)$")
    if r then return fmt("up_blocks.%d.upsamplers.0.conv.%s", i, r) end
    if b == "1" then return fmt("up_blocks.%d.attentions.%d.%s", i, j, rest) end
  end
  return nil
end

-- The res blocks per level of a UNet, from its original names.
local function unet_nrb(names)
  local n_in, first_down = 0, nil
  for _, n in ipairs(names) do
    local k = tonumber(n:match("^input_blocks%.(%d+)%."))
    if k then
      n_in = math.max(n_in, k + 1)
      if n:match("^input_blocks%.%d+%.0%.op%.") and (not first_down or k < first_down) then first_down = k end
    end
  end
  return (first_down or n_in) - 1
end

-- OpenCLIP tensor name -> list of {hf module, "weight" | "bias", rows} (rows: the
-- q / k / v slice of the packed in_proj); W the width.
local OPENCLIP_BLOCK = {
  ["attn.out_proj."] = "self_attn.out_proj", ["ln_1."] = "layer_norm1", ["ln_2."] = "layer_norm2",
  ["mlp.c_fc."] = "mlp.fc1", ["mlp.c_proj."] = "mlp.fc2",
}
local function openclip_to_hf(name, W)
  local n, rest = name:match("^transformer%.resblocks%.(%d+)%.(.*)$")
  if n then
    local p = "text_model.encoder.layers." .. n .. "."
    local packed = rest:match("^attn%.in_proj_(%a+)$")
    if packed then
      return {
        { p .. "self_attn.q_proj", packed, { 1, W } },
        { p .. "self_attn.k_proj", packed, { W + 1, W } },
        { p .. "self_attn.v_proj", packed, { 2 * W + 1, W } },
      }
    end
    for from, to in pairs(OPENCLIP_BLOCK) do
      if rest:sub(1, #from) == from then return { { p .. to, rest:sub(#from + 1) } } end
    end
    return {}
  end
  if name == "token_embedding.weight" then return { { "text_model.embeddings.token_embedding", "weight" } } end
  if name == "positional_embedding" then return { { "text_model.embeddings.position_embedding", "weight" } } end
  local r = name:match("^ln_final%.(.*)$")
  if r then return { { "text_model.final_layer_norm", r } } end
  return {}
end

-- A target module: {part, store, weight = {name, shape}, bias = {name, shape}, rows}.
-- index: alias -> module.
local function add_alias(index, alias, mod)
  if not index[alias] then index[alias] = mod end
end

local function module_rec(mods, part, store, key, rows)
  local id = key .. (rows and ("#" .. rows[1]) or "")
  local m = mods[id]
  if not m then
    m = { part = part, store = store, rows = rows, module = key }
    mods[id] = m
  end
  return m
end

-- Adds one UNet's names. u = {names = {{rel, shape}, ...}, resolve = rel -> real name,
-- store, nrb (optional)}.
function K.index_unet(index, u)
  local rels = {}
  for i, e in ipairs(u.names) do rels[i] = e[1] end
  local nrb = u.nrb or unet_nrb(rels)
  local mods = {}
  for _, e in ipairs(u.names) do
    local rel, shape = e[1], e[2]
    local mod, what = rel:match("^(.*)%.(%a+)$")
    if mod and (what == "weight" or what == "bias") then
      local m = module_rec(mods, "unet", u.store, mod)
      m[what] = { name = u.resolve(rel), shape = shape }
      local d = K.unet_to_diffusers(rel, nrb)
      m.diffusers = d and d:match("^(.*)%.%a+$")
    end
  end
  for mod, m in pairs(mods) do
    local us = mod:gsub("%.", "_")
    add_alias(index, "lora_unet_" .. us, m)
    add_alias(index, "diffusion_model." .. mod, m)
    add_alias(index, "model.diffusion_model." .. mod, m)
    add_alias(index, "unet." .. mod, m)
    local d = m.diffusers
    if d then
      add_alias(index, "lora_unet_" .. d:gsub("%.", "_"), m)
      add_alias(index, "unet." .. d, m)
      add_alias(index, d, m)
    end
  end
  return index
end

-- Adds one text encoder's names. e = {names = {{rel, shape}, ...}, resolve, store,
-- layout ("hf" | "openclip"), kohya = {prefixes}, peft = {prefixes}}.
function K.index_clip(index, e)
  local mods = {}
  local W
  for _, t in ipairs(e.names) do
    if t[1]:match("attn%.in_proj_weight$") then W = t[2][1] // 3 end
  end
  for _, t in ipairs(e.names) do
    local rel, shape = t[1], t[2]
    if e.layout == "hf" then
      local mod, what = rel:match("^(.*)%.(%a+)$")
      if mod and (what == "weight" or what == "bias") then
        module_rec(mods, "clip", e.store, mod)[what] = { name = e.resolve(rel), shape = shape }
      end
    else
      for _, h in ipairs(openclip_to_hf(rel, W)) do
        local m = module_rec(mods, "clip", e.store, h[1], h[3])
        local s = shape
        if h[3] then
          s = { h[3][2] }
          for i = 2, #shape do s[i] = shape[i] end
        end
        m[h[2]] = { name = e.resolve(rel), shape = s }
      end
    end
  end
  for _, m in pairs(mods) do
    local us = m.module:gsub("%.", "_")
    for _, p in ipairs(e.kohya) do add_alias(index, p .. us, m) end
    for _, p in ipairs(e.peft) do add_alias(index, p .. m.module, m) end
  end
  return index
end

-- The prefixes a text encoder's keys carry: kohya's lora_te[N]_, diffusers'
-- text_encoder[_2]., ComfyUI's text_encoders.clip_X.transformer. (i: which of n).
function K.clip_prefixes(i, n, role)
  local comfy = "text_encoders.clip_" .. (role or "l") .. ".transformer."
  if n >= 2 and i == 2 then
    return { "lora_te2_" }, { "text_encoder_2.", comfy }
  end
  if n >= 2 then return { "lora_te1_", "lora_te_" }, { "text_encoder.", comfy } end
  return { "lora_te_", "lora_te1_" }, { "text_encoder.", comfy }
end

-- The index of a checkpoint (built once, kept on it).
local function ckpt_index(ckpt)
  local idx = rawget(ckpt, "_lora_index")
  if idx then return idx end
  idx = {}
  local u = rawget(ckpt, "unet")
  if u then
    local w, cfg = rawget(u, "weights"), rawget(u, "config")
    local names = {}
    for i, e in ipairs(unet.expected(cfg)) do names[i] = e end
    K.index_unet(idx, { names = names, resolve = function(n) return w:real(n) end, store = w.store,
      nrb = cfg.num_res_blocks })
  end
  local dit = rawget(ckpt, "dit")
  local F = families.get(rawget(ckpt, "family"))
  if dit and F and F.lora then require(F.lora).index(idx, dit) end
  local text = rawget(ckpt, "clip")
  local encs = text and rawget(text, "encoders") or {}
  for i, entry in ipairs(encs) do
    local enc = entry.enc
    local w, cfg = enc.weights, enc.config
    local kohya, peft = K.clip_prefixes(i, #encs, cfg.role)
    K.index_clip(idx, { names = clip.expected(cfg), resolve = function(n) return w:real(n) end, store = w.store,
      layout = cfg.layout, kohya = kohya, peft = peft })
  end
  rawset(ckpt, "_lora_index", idx)
  return idx
end
K.ckpt_index = ckpt_index

-- ---------------------------------------------------------------- planning

-- The spellings a module key may be looked up under: as written, and with the older
-- diffusers forms normalized (attention processors, to_out without its ".0", the
-- processor names on CLIP, PEFT's base_model.model. wrapper).
local function spellings(mod)
  local list = { mod }
  local m = mod:gsub("^base_model%.model%.", "")
  m = m:gsub("%.processor%.", ".")
  if m:match("%.to_out$") then m = m .. ".0" end
  local a, q = m:match("^(.*self_attn)%.to_([qkv])$")
  if a then m = a .. "." .. q .. "_proj" end
  a = m:match("^(.*self_attn)%.to_out%.0$")
  if a then m = a .. ".out_proj" end
  if m ~= mod then list[#list + 1] = m end
  if not m:match("^unet%.") and part_of_key(m) == "unet" and not m:match("^lora_") then list[#list + 1] = "unet." .. m end
  return list
end

local function lookup(index, mod)
  for _, s in ipairs(spellings(mod)) do
    local m = index[s]
    if m then return m end
  end
  return nil
end

-- The scale of a module's delta before the part's strength, as ComfyUI computes it
-- (alpha / rank; no alpha: 1).
local function base_scale(m, src)
  local r = m.roles
  local alpha = r.alpha and src.value(r.alpha) or nil
  if m.kind == "lora" then
    return alpha and alpha / src.shape(r.down)[1] or 1.0
  elseif m.kind == "loha" then
    return alpha and alpha / src.shape(r.hada_w1_b)[1] or 1.0
  elseif m.kind == "lokr" then
    local dim
    if r.lokr_w1_b then dim = src.shape(r.lokr_w1_b)[1] end
    if r.lokr_w2_b then dim = src.shape(r.lokr_w2_b)[1] end
    return (alpha and dim) and alpha / dim or 1.0
  end
  return 1.0
end

local FIELDS = {
  lora = { up = "up", down = "down", mid = "mid" },
  loha = { hada_w1_a = "w1a", hada_w1_b = "w1b", hada_w2_a = "w2a", hada_w2_b = "w2b", hada_t1 = "t1", hada_t2 = "t2" },
  lokr = { lokr_w1 = "w1", lokr_w1_a = "w1a", lokr_w1_b = "w1b", lokr_w2 = "w2", lokr_w2_a = "w2a",
    lokr_w2_b = "w2b", lokr_t2 = "t2" },
}

-- modules (K.group) + index + src {shape(key), tensor(key), value(key)} + strengths
-- {unet, clip} -> plan (list of {store, target, spec, key}), unmatched (keys), family
-- mismatch errors through fail(msg). Shape mismatches raise naming the key and both
-- shapes.
function K.plan(modules, others, index, src, strengths, fail)
  local plan, unmatched = {}, {}
  for _, k in ipairs(others) do unmatched[#unmatched + 1] = k end
  for _, mod in ipairs(sorted_keys(modules)) do
    local m = modules[mod]
    local t = m.kind and lookup(index, mod)
    if not t then
      for _, key in pairs(m.roles) do unmatched[#unmatched + 1] = key end
    else
      local strength = strengths[t.part] or 1.0
      local r = m.roles
      local function add(target, spec, key)
        plan[#plan + 1] = { store = t.store, target = target.name, spec = spec, key = key, part = t.part }
      end
      if m.kind == "lora" or m.kind == "loha" or m.kind == "lokr" then
        local key = r.up or r.hada_w1_a or r.lokr_w1 or r.lokr_w1_a
        if not t.weight then
          for _, k in pairs(r) do unmatched[#unmatched + 1] = k end
        else
          local out, _, n, ds = delta_dims(m, src.shape)
          local ts = t.weight.shape
          if out ~= ts[1] or n ~= numel(ts) then
            fail(fmt("key '%s' gives a delta of %s (%d values) but the weight '%s' is %s%s", key, shape_str(ds), n,
              t.weight.name, shape_str(ts),
              t.rows and fmt(" (rows %d..%d of it)", t.rows[1], t.rows[1] + t.rows[2] - 1) or ""))
          end
          local spec = { kind = m.kind, scale = strength * base_scale(m, src), rows = t.rows }
          for role, field in pairs(FIELDS[m.kind]) do
            if r[role] then spec[field] = src.tensor(r[role]) end
          end
          if r.dora_scale then
            spec.dora_scale = src.tensor(r.dora_scale)
            spec.strength = strength
          end
          if strength ~= 0 and t.split then
            -- a weight the checkpoint stores as several tensors (a diffusers folder's
            -- to_q / to_k / to_v): each gets the rows of the delta it holds
            if m.kind ~= "lora" or r.dora_scale or r.mid then
              fail(fmt("key '%s': a %s on '%s', which this checkpoint stores as %d tensors; kiln splits plain " ..
                "LoRAs only: load the transformer as one file (BFL's or ComfyUI's)", key, m.kind, t.module, #t.split))
            end
            for _, s in ipairs(t.split) do
              local part = {}
              for k, v in pairs(spec) do part[k] = v end
              local rows = spec.up:narrow(1, s.from, s.count)
              part.up = rows:contiguous()
              rows:free()
              part.rows = s.rows
              add({ name = s.name }, part, key)
            end
          elseif strength ~= 0 then
            add(t.weight, spec, key)
          end
        end
      else
        for role, what in pairs({ diff = "weight", set_weight = "weight", diff_b = "bias" }) do
          local key = r[role]
          if key then
            local tgt = t[what]
            if not tgt then
              unmatched[#unmatched + 1] = key
            else
              local ds = src.shape(key)
              if numel(ds) ~= numel(tgt.shape) or (#ds > 1 and ds[1] ~= tgt.shape[1]) then
                fail(fmt("key '%s' is %s but the %s '%s' is %s", key, shape_str(ds), what, tgt.name,
                  shape_str(tgt.shape)))
              end
              if strength ~= 0 then
                local d = src.tensor(key)
                if role == "set_weight" then d = src.set_delta(t.store, tgt.name, d, t.rows) end
                add(tgt, { kind = "diff", diff = d, scale = strength, rows = t.rows }, key)
              end
            end
          end
        end
      end
    end
  end
  table.sort(unmatched)
  return plan, unmatched
end

-- ---------------------------------------------------------------- files

local lora_fail = util.file_error

local function check_path(who, path)
  if type(path) ~= "string" then error(fmt("%s: path must be a string, got %s", who, type(path)), 3) end
end

local function check_file(who, path)
  if mf.is_pickle_name(path) then lora_fail(who, path, mf.PICKLE_HELP) end
  local kind = mf.sniff(path, who)
  if kind == "pickle" then lora_fail(who, path, "a PyTorch pickle, not safetensors. " .. mf.PICKLE_HELP) end
  if kind ~= "safetensors" then lora_fail(who, path, "not a safetensors file") end
end

-- The key list and a shape reader of a file, without reading tensor data.
local function read_names(who, path)
  check_file(who, path)
  local ok, tensors = pcall(kiln.load_safetensors, path)
  if not ok then lora_fail(who, path, "cannot read it as safetensors: " .. tostring(tensors)) end
  local names = sorted_keys(tensors)
  return names, tensors
end

local function not_a_lora(who, path, names)
  lora_fail(who, path, "not a LoRA: no lora_up/lora_down, lora_A/lora_B, hada_*, lokr_* or diff keys; it looks like " ..
    describe_other(names))
end

local function count_parts(modules)
  local parts = { unet = 0, clip = 0 }
  for mod, m in pairs(modules) do
    if m.kind then
      local p = part_of_key(mod) or "unet"
      parts[p] = parts[p] + 1
    end
  end
  return parts
end

-- The few-step kind a LoRA file says it is (kiln.few_step_kind; nil for an ordinary
-- LoRA); an unknown kiln.few_step is an error naming the file.
local function few_step_of(who, path)
  local ok, _, meta = pcall(kiln.load_safetensors, path)
  local fs, why = few_step_kind.of_file(ok and meta or nil, path)
  if fs == false then lora_fail(who, path, why) end
  return fs
end

-- kiln.lora.inspect(path) -> {format, family, family_reason, parts = {unet = n, clip =
-- n}, keys = n, modules = n, few_step = nil or {name, label, defaults, evidence}},
-- without a checkpoint.
function M.inspect(path)
  local who = "kiln.lora.inspect"
  check_path(who, path)
  local names, tensors = read_names(who, path)
  local modules = K.group(names)
  local fmt_ = format_of(modules)
  if not fmt_ then not_a_lora(who, path, names) end
  local fam, why = K.family_of(modules, function(k) return tensors[k].shape end)
  local n = 0
  for _, m in pairs(modules) do if m.kind then n = n + 1 end end
  return { format = fmt_, family = fam, family_reason = why, parts = count_parts(modules), keys = #names, modules = n,
    few_step = few_step_of(who, path) }
end

-- ---------------------------------------------------------------- handles

local Handle = {}
Handle.__index = Handle
Handle.__name = "kiln.Lora"

-- h:remove(): takes every patch of this LoRA off its weights (exact: the copies are
-- rebuilt from the mapped files) and closes the LoRA file; later calls do nothing.
function Handle:remove()
  local ids = rawget(self, "_ids")
  if not ids then return self end
  self._ids = nil
  local first_err
  for i = #ids, 1, -1 do
    local st = ids[i].store
    -- a closed store took its patches with it
    if not st.closed then
      local ok, err = pcall(st.remove_patch, st, ids[i].id)
      if not ok and not first_err then first_err = err end
    end
  end
  local store = rawget(self, "_file")
  self._file = nil
  if store and store.close then store:close() end
  local list = self._ckpt and rawget(self._ckpt, "loras_applied")
  if list then
    for i = #list, 1, -1 do if list[i] == self then table.remove(list, i) end end
  end
  self.removed = true
  if first_err then error(first_err, 0) end
  return self
end

Handle.__close = function(h) h:remove() end
Handle.__tostring = function(h)
  return fmt("lora(%s, %s%s, %d weight%s%s%s)", h.name, h.format, h.family and (", " .. h.family) or "", h.patched,
    h.patched == 1 and "" or "s",
    #h.unmatched > 0 and fmt(", %d unmatched keys", #h.unmatched) or "", h.removed and ", removed" or "")
end

local function check_opts(who, opts)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(who .. ": options must be a table", 3) end
  for k, v in pairs(opts) do
    if k == "unet" or k == "clip" then
      if type(v) ~= "number" then error(fmt("%s: option %s must be a number, got %s", who, k, type(v)), 3) end
    elseif k == "name" then
      if type(v) ~= "string" then error(fmt("%s: option name must be a string, got %s", who, type(v)), 3) end
    else
      error(fmt("%s: unknown option '%s' (known: clip, name, unet)", who, tostring(k)), 3)
    end
  end
  return opts
end

-- The file opened as a weight store accounted to "lora:NAME" (its factors are what
-- the patches hold), with the reader the planner uses.
local function open_source(who, path, name)
  local ok, store = pcall(kiln.model, path, { name = name, owner = "lora" })
  if not ok then lora_fail(who, path, tostring(store)) end
  local cache = {}
  local src = {}
  function src.tensor(key)
    local t = cache[key]
    if not t then
      t = store:tensor(key)
      cache[key] = t
    end
    return t
  end
  function src.shape(key) return src.tensor(key).shape end
  function src.value(key) return src.tensor(key):to("f32"):item() end
  -- set_weight as a difference from the weight as it is now (before this LoRA)
  function src.set_delta(tstore, target, t, rows)
    local cur = tstore:tensor(target)
    if rows then cur = cur:narrow(1, rows[1], rows[2]) end
    local d = t:to("f32"):reshape(cur.shape) - cur:to("cpu"):to("f32")
    return d
  end
  return store, src
end

-- ckpt:add_lora(path [, {unet = 1.0, clip = 1.0, name = NAME}]) -> handle.
function M.add(ckpt, path, opts)
  local who = "ckpt:add_lora"
  check_path(who, path)
  opts = check_opts(who, opts)
  check_file(who, path)
  local name = opts.name or stem(path)
  local store, src = open_source(who, path, name)
  local function bail(msg)
    store:close()
    lora_fail(who, path, msg)
  end
  local names = store:names()
  local modules, others = K.group(names)
  local format = format_of(modules)
  if not format then
    store:close()
    not_a_lora(who, path, names)
  end
  local fam, why = K.family_of(modules, src.shape)
  local ok_fs, few_step = pcall(few_step_of, who, path)
  if not ok_fs then
    store:close()
    error(few_step, 0)
  end
  local family = rawget(ckpt, "family")
  local function family_error()
    return fmt("this is an %s LoRA (%s) on an %s checkpoint", families.label(fam), why,
      families.label(family))
  end
  if fam and family and fam ~= family then bail(family_error()) end
  local index = ckpt_index(ckpt)
  local strengths = { unet = opts.unet or 1.0, clip = opts.clip or 1.0 }
  local ok, plan, unmatched = pcall(K.plan, modules, others, index, src, strengths, function(msg)
    error({ lora_msg = msg }, 0)
  end)
  if not ok then
    if type(plan) == "table" and plan.lora_msg then bail(plan.lora_msg) end
    store:close()
    error(plan, 0)
  end
  if #plan == 0 and #unmatched > 0 and (strengths.unet ~= 0 or strengths.clip ~= 0) then
    local matched_any = #unmatched < #names
    if not matched_any then
      bail(fmt("none of its %d keys matches a weight of this %s checkpoint (for example %s)", #names,
        families.label(family), table.concat({ unmatched[1], unmatched[2], unmatched[3] }, ", ")))
    end
  end
  -- patches: all or none
  local ids, patched, seen = {}, 0, {}
  for _, p in ipairs(plan) do
    if type(p.store.add_patch) ~= "function" then
      for i = #ids, 1, -1 do pcall(ids[i].store.remove_patch, ids[i].store, ids[i].id) end
      bail("this build's weight stores have no add_patch")
    end
    local okp, id = pcall(p.store.add_patch, p.store, p.target, p.spec)
    if not okp then
      for i = #ids, 1, -1 do pcall(ids[i].store.remove_patch, ids[i].store, ids[i].id) end
      bail(fmt("key '%s' on '%s': %s", p.key, p.target, tostring(id)))
    end
    ids[#ids + 1] = { store = p.store, id = id }
    seen[p.store] = seen[p.store] or {}
    if not seen[p.store][p.target] then
      seen[p.store][p.target] = true
      patched = patched + 1
    end
  end
  local h = setmetatable({
    name = name, path = path, format = format, family = fam, patched = patched, unmatched = unmatched,
    unet = strengths.unet, clip = strengths.clip, _ids = ids, _file = store, _ckpt = ckpt,
    few_step = few_step, -- an LCM-LoRA...: the pipelines sample as its kind (kiln.few_step_kind)
  }, Handle)
  if #unmatched > 0 then
    local ex = {}
    for i = 1, math.min(3, #unmatched) do ex[i] = unmatched[i] end
    warn(fmt("kiln: LoRA '%s': %d key%s match%s no weight of this checkpoint (e.g. %s)", name, #unmatched,
      #unmatched == 1 and "" or "s", #unmatched == 1 and "es" or "", table.concat(ex, ", ")))
  end
  local list = rawget(ckpt, "loras_applied")
  if not list then
    list = {}
    rawset(ckpt, "loras_applied", list)
  end
  list[#list + 1] = h
  return h
end

-- ---------------------------------------------------------------- finding by name

local function is_dir(p) return lfs.attributes(p, "mode") == "directory" end
local search = util.find_file

-- ckpt:find_lora(NAME) -> path of NAME.safetensors in the checkpoint's LoRA folder
-- (subfolders searched); an error naming the folder when it is not there.
function M.find(ckpt, name)
  local who = "ckpt:find_lora"
  if type(name) ~= "string" or name == "" then error(who .. ": name must be a non-empty string", 3) end
  local dir = rawget(ckpt, "lora_dir")
  if not dir then
    error(fmt("%s: LoRA '%s': no LoRA folder: name one with kiln.load_checkpoint(path, {loras = DIR})", who, name), 0)
  end
  if not is_dir(dir) then error(fmt("%s: LoRA '%s': the LoRA folder %s is not a folder", who, name, dir), 0) end
  local key = name:gsub("%.safetensors$", "")
  local path = search(dir, key .. ".safetensors")
  if path then return path end
  for _, ext in ipairs({ ".pt", ".ckpt", ".pth", ".bin" }) do
    local p = search(dir, key .. ext)
    if p then error(fmt("%s: LoRA '%s' is %s: %s", who, key, p, mf.PICKLE_HELP), 0) end
  end
  error(fmt("%s: LoRA '%s' not found: no %s.safetensors in the LoRA folder %s (subfolders searched)", who, key, key,
    dir), 0)
end

return M
