-- kiln.t5_files: the T5 encoder files users have, mapped onto kiln.t5's names
-- (transformers' T5EncoderModel's without "encoder."): ComfyUI's t5xxl_fp16 /
-- t5xxl_fp8_e4m3fn(_scaled) and any other transformers-named file under any wrapper
-- prefix, diffusers' text_encoder_2/ (sharded, with its index and config.json), and
-- GGUF files in llama.cpp's names. It reads the hyper-parameters from the shapes,
-- checks every tensor and opens the weight store; errors name the file.
local kiln = require "kiln"
local util = require "kiln.util"
local mf = require "kiln.model_files"

local M = {}
local fmt = string.format
local WHO = "kiln.load_t5"

local function fail(path, msg) util.file_error(WHO, path, msg) end

-- The linear layers of a block (their weights may carry a scale_weight in scaled fp8).
M.LINEARS = {
  "0.SelfAttention.q.weight", "0.SelfAttention.k.weight", "0.SelfAttention.v.weight", "0.SelfAttention.o.weight",
  "1.DenseReluDense.wi_0.weight", "1.DenseReluDense.wi_1.weight", "1.DenseReluDense.wo.weight",
}

-- llama.cpp's names (LLM_ARCH_T5 / T5ENCODER) for a block's tensors.
local GGUF = {
  ["0.SelfAttention.q.weight"] = "attn_q.weight", ["0.SelfAttention.k.weight"] = "attn_k.weight",
  ["0.SelfAttention.v.weight"] = "attn_v.weight", ["0.SelfAttention.o.weight"] = "attn_o.weight",
  ["0.SelfAttention.relative_attention_bias.weight"] = "attn_rel_b.weight",
  ["0.layer_norm.weight"] = "attn_norm.weight", ["1.layer_norm.weight"] = "ffn_norm.weight",
  ["1.DenseReluDense.wi_0.weight"] = "ffn_gate.weight", ["1.DenseReluDense.wi_1.weight"] = "ffn_up.weight",
  ["1.DenseReluDense.wo.weight"] = "ffn_down.weight",
}

-- Every tensor the encoder reads, {canonical name, shape}.
function M.expected(cfg)
  local list = {}
  local function add(name, shape) list[#list + 1] = { name, shape } end
  local D, I, F = cfg.d_model, cfg.inner, cfg.d_ff
  add("shared.weight", { cfg.vocab, D })
  for i = 0, cfg.blocks - 1 do
    local p = fmt("block.%d.layer.", i)
    add(p .. "0.layer_norm.weight", { D })
    for _, t in ipairs({ "q", "k", "v" }) do add(p .. "0.SelfAttention." .. t .. ".weight", { I, D }) end
    add(p .. "0.SelfAttention.o.weight", { D, I })
    if i == 0 then add(p .. "0.SelfAttention.relative_attention_bias.weight", { cfg.buckets, cfg.heads }) end
    add(p .. "1.layer_norm.weight", { D })
    add(p .. "1.DenseReluDense.wi_0.weight", { F, D })
    add(p .. "1.DenseReluDense.wi_1.weight", { F, D })
    add(p .. "1.DenseReluDense.wo.weight", { D, F })
  end
  add("final_layer_norm.weight", { D })
  return list
end

-- ---------------------------------------------------------------- layouts

local function escape(s) return (s:gsub("[%^%$%(%)%%%.%[%]%*%+%-%?]", "%%%0")) end

-- The file's naming: {kind = "hf" | "gguf", real = canonical -> file name, block_pattern}.
-- transformers' names under any prefix ("encoder.", none, "text_encoders.t5xxl.
-- transformer.encoder.", ...; a whole T5's "decoder." is not the encoder; `within`:
-- only under that prefix, for a T5 inside a whole checkpoint); the
-- embedding is the root's shared.weight or the stack's embed_tokens.weight.
function M.layout(shapes, path, within)
  if shapes["enc.blk.0.attn_q.weight"] or shapes["token_embd.weight"] and mf.has_prefix(shapes, "enc.blk.") then
    return {
      kind = "gguf", block_pattern = "^enc%.blk%.(%d+)%.",
      real = function(c)
        if c == "shared.weight" then return "token_embd.weight" end
        if c == "final_layer_norm.weight" then return "enc.output_norm.weight" end
        local i, rest = c:match("^block%.(%d+)%.layer%.(.*)$")
        return fmt("enc.blk.%s.%s", i, GGUF[rest] or rest)
      end,
    }
  end
  local best
  for name in pairs(shapes) do
    local p = name:match("^(.-)block%.0%.layer%.0%.SelfAttention%.q%.weight$")
    if p and not p:match("decoder%.$") and (not within or p:sub(1, #within) == within) and
        (not best or #p < #best or (#p == #best and p < best)) then best = p end
  end
  if not best then
    local what = mf.count(shapes) == 0 and "it holds no tensors" or ("it holds " .. mf.summarize(shapes, 2))
    if mf.has_prefix(shapes, "text_model.") or mf.has_prefix(shapes, "transformer.resblocks.") then
      what = "this is a CLIP text encoder; " .. what
    end
    fail(path, "not a T5 encoder: no block.0.layer.0.SelfAttention.q.weight (transformers' / ComfyUI's names) " ..
      "or enc.blk.0.attn_q.weight (llama.cpp's GGUF names) found; " .. what)
  end
  local root = best:gsub("encoder%.$", "")
  local emb = shapes[root .. "shared.weight"] and root .. "shared.weight" or best .. "embed_tokens.weight"
  if not shapes[emb] and shapes["shared.weight"] then emb = "shared.weight" end
  return {
    kind = "hf", prefix = best, block_pattern = "^" .. escape(best) .. "block%.(%d+)%.",
    real = function(c)
      if c == "shared.weight" then return emb end
      return best .. c
    end,
  }
end

-- A head count the file states: safetensors __metadata__ num_heads, a GGUF's
-- <arch>.attention.head_count, a diffusers config.json's num_heads.
local function stated_heads(meta, config_json)
  local v = meta and (meta.num_heads or meta["t5.num_heads"])
  for k, val in pairs(meta or {}) do
    if type(k) == "string" and k:match("%.attention%.head_count$") then v = v or val end
  end
  if v == nil and config_json then v = config_json.num_heads end
  v = tonumber(v)
  return v and math.tointeger(v) or nil
end

-- The architecture from the shapes (names through lay.real). The head count is the
-- relative bias table's width ([buckets, heads]); a count the file or opts.heads states
-- must agree with it. Without that table (an error later) heads default to inner / 64,
-- as every T5 v1.1 size has d_kv 64.
function M.config(shapes, lay, path, meta, opts, config_json)
  local real = lay.real
  local function shape(c) return shapes[real(c)] end
  local cfg = { layout = lay.kind, eps = 1e-6, max_distance = 128 }
  local emb = shape("shared.weight")
  local q = shape("block.0.layer.0.SelfAttention.q.weight")
  local wi0 = shape("block.0.layer.1.DenseReluDense.wi_0.weight")
  if not wi0 and shapes[real("block.0.layer.1.DenseReluDense.wi.weight")] then
    fail(path, "this is a T5 v1.0 encoder (one ReLU feed-forward, DenseReluDense.wi); kiln runs T5 v1.1 " ..
      "(gated-GELU, wi_0 and wi_1), the encoder of Flux, SD 3.5 and PixArt")
  end
  if shapes[real("block.1.layer.0.SelfAttention.relative_attention_bias.weight")] then
    fail(path, "a relative attention bias in every block: this is UMT5 (Wan's text encoder), not T5 v1.1, " ..
      "whose first block's bias serves all blocks")
  end
  if not emb then fail(path, fmt("no token embedding (%s) found", real("shared.weight"))) end
  if not q or #q ~= 2 then fail(path, fmt("%s is not a matrix", real("block.0.layer.0.SelfAttention.q.weight"))) end
  if #emb ~= 2 then fail(path, fmt("token embedding %s has shape %s, expected [vocab, d_model]",
    real("shared.weight"), util.shape_str(emb))) end
  cfg.vocab, cfg.d_model = emb[1], emb[2]
  cfg.inner = q[1]
  cfg.d_ff = wi0 and wi0[1] or 4 * cfg.d_model
  cfg.blocks = util.count_indices(shapes, lay.block_pattern)
  local rb = shape("block.0.layer.0.SelfAttention.relative_attention_bias.weight")
  local stated = opts.heads or stated_heads(meta, config_json)
  if rb and #rb == 2 then
    cfg.buckets, cfg.heads = rb[1], rb[2]
    if stated and stated ~= cfg.heads then
      fail(path, fmt("%d heads stated (%s), but the relative attention bias %s has %d (shape %s)", stated,
        opts.heads and "opts.heads" or "in the file", real("block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        cfg.heads, util.shape_str(rb)))
    end
  else
    cfg.buckets = 32
    cfg.heads = stated or math.max(1, cfg.inner // 64)
  end
  if config_json then
    cfg.max_distance = math.tointeger(config_json.relative_attention_max_distance) or cfg.max_distance
    cfg.eps = tonumber(config_json.layer_norm_epsilon) or cfg.eps
    local ff = config_json.feed_forward_proj
    if type(ff) == "string" and ff ~= "gated-gelu" then
      fail(path, fmt("feed_forward_proj \"%s\" in config.json: kiln runs T5 v1.1 (gated-gelu)", ff))
    end
  end
  if cfg.heads < 1 or cfg.inner % cfg.heads ~= 0 then
    fail(path, fmt("the attention width %d does not split into %d heads", cfg.inner, cfg.heads))
  end
  if cfg.buckets < 4 or cfg.buckets % 2 ~= 0 then fail(path, fmt("%d relative position buckets", cfg.buckets)) end
  cfg.d_kv = cfg.inner // cfg.heads
  if cfg.blocks < 1 then fail(path, "no encoder blocks found") end
  return cfg
end

-- scale_weight of each linear weight (ComfyUI's scaled fp8: weight = stored * scale),
-- canonical name -> number; nil when the file has none.
function M.scales(tensors, cfg, real, path)
  local scales
  for i = 0, cfg.blocks - 1 do
    for _, l in ipairs(M.LINEARS) do
      local c = fmt("block.%d.layer.%s", i, l)
      local sname = real(c):gsub("weight$", "scale_weight")
      local t = tensors[sname]
      if t then
        if t:numel() ~= 1 then fail(path, fmt("%s has shape %s, expected one value", sname, util.shape_str(t))) end
        local f = t:to("f32")
        local v = f:reshape({ 1 })[1]
        if f ~= t then f:free() end
        scales = scales or {}
        scales[c] = v
      end
    end
  end
  return scales
end

-- ---------------------------------------------------------------- files

-- A diffusers T5 component: the folder itself, or the pipeline folder's text_encoder_3
-- (SD 3.x), text_encoder_2 (Flux) or text_encoder whose config.json says model_type t5.
local function diffusers_component(dir)
  local function t5_dir(d)
    local cj = mf.file_exists(mf.join(d, "config.json")) and mf.read_json(mf.join(d, "config.json")) or nil
    local paths = mf.diffusers_files(d, "model", WHO)
    if paths and (not cj or cj.model_type == nil or cj.model_type == "t5") then
      return paths, cj
    end
    return nil
  end
  local paths, cj = t5_dir(dir)
  if paths then return paths, cj end
  for _, sub in ipairs({ "text_encoder_3", "text_encoder_2", "text_encoder" }) do
    local d = mf.join(dir, sub)
    if mf.is_dir(d) then
      local cjs = mf.read_json(mf.join(d, "config.json"))
      if cjs and cjs.model_type == "t5" then
        local p = mf.diffusers_files(d, "model", WHO)
        if p then return p, cjs end
      end
    end
  end
  fail(dir, "no T5 encoder in this folder: expected model.safetensors (or its index and shards) here, or a " ..
    "text_encoder_2/ (Flux) or text_encoder_3/ (SD 3.x) whose config.json has model_type \"t5\"")
end

-- path -> {store, map (canonical -> real name), config, paths}.
function M.open(path, opts)
  if type(path) ~= "string" then error(WHO .. ": path must be a string, got " .. type(path), 3) end
  local paths, config_json
  if mf.is_dir(path) then
    paths, config_json = diffusers_component(path)
  elseif not mf.file_exists(path) then
    fail(path, "no such file")
  else
    paths = { path }
  end
  local src = #paths == 1 and mf.source(paths[1], nil, WHO) or mf.multi_source(paths, nil, WHO)
  local where = #paths == 1 and paths[1] or path
  local arch = src.meta["general.architecture"]
  if arch and arch ~= "t5" and arch ~= "t5encoder" then
    fail(where, fmt("a GGUF file of architecture '%s', not a T5 encoder (t5 / t5encoder)", tostring(arch)))
  end
  local lay = M.layout(src.shapes, where, opts.prefix)
  local cfg = M.config(src.shapes, lay, where, src.meta, opts, config_json)
  local exp = M.expected(cfg)
  mf.validate(where, "T5 encoder", exp, lay.real, src.shapes, WHO)
  cfg.scales = M.scales(src.tensors, cfg, lay.real, where)
  local map = {}
  for _, e in ipairs(exp) do map[e[1]] = lay.real(e[1]) end
  local w0 = src.tensors[lay.real("block.0.layer.0.SelfAttention.q.weight")]
  cfg.dtype = w0 and w0.dtype or "?"
  cfg.summary = fmt("T5 v1.1 encoder, %d blocks, d_model %d, %d heads of %d, d_ff %d, vocab %d, %s%s (%s)",
    cfg.blocks, cfg.d_model, cfg.heads, cfg.d_kv, cfg.d_ff, cfg.vocab, cfg.dtype,
    cfg.scales and " scaled" or "", lay.kind == "gguf" and "GGUF" or (#paths > 1 and "diffusers" or "safetensors"))
  local store = mf.open_store(paths, mf.names_of(exp, lay.real), "t5", WHO)
  for _, t in pairs(src.tensors) do t:free() end
  return { store = store, map = map, config = cfg, paths = paths }
end

return M
