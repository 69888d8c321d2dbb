-- kiln.t5: Google's T5 v1.1 text encoder (the text side of Flux, SD 3.5, PixArt, the
-- video models) over kiln's ops, and kiln.load_t5, its loader for the files users have.
-- The network: token embedding; per block an RMS norm without mean (T5LayerNorm, in
-- f32), self-attention without biases and without the 1/sqrt(d) scaling of q.k plus a
-- relative position bias (32 buckets, max distance 128, bidirectional) that the first
-- block holds and every block adds, a gated-GELU feed-forward (gelu_tanh(wi_0 x) *
-- wi_1 x, then wo), residuals; the final RMS norm. Names here are transformers'
-- T5EncoderModel's without the "encoder." prefix ("block.N.layer.0.SelfAttention.q.weight",
-- "shared.weight", "final_layer_norm.weight"); kiln.t5_files maps them to a file's.
-- Precision: f32 or bf16 arithmetic, never f16 (T5's activations overflow it): under a
-- "f16" precision the encoder computes in f32 on the CPU and bf16 elsewhere.
-- t5:encode keeps each prompt's encoding in a kiln.encoding_cache of its own, which the
-- memory budget evicts before an allocation fails.
local kiln = require "kiln"
local stream = require "kiln.stream"
local part = require "kiln.part"
local files = require "kiln.t5_files"
local encoding_cache = require "kiln.encoding_cache"
local nn = kiln.nn

local M = {}
local Encoder = {}
Encoder.__index = Encoder
M.Encoder = Encoder

local fmt = string.format
local EPS = 1e-6

M.LINEARS = files.LINEARS

--- T5 v1.1's token ids for text, ending in 1 (</s>), no padding: SentencePiece's Unigram
-- model with T5's own vocabulary, built into libkiln (runtime/t5_tokenizer.c).
M.tokenize = kiln._t5_tokenize

-- ---------------------------------------------------------------- relative positions

local function f32(x) return (string.unpack("<f", string.pack("<f", x))) end

-- transformers' _relative_position_bucket (bidirectional) for rel = key - query. The
-- logarithmic range is computed in float32 steps as PyTorch and mesh-tensorflow do, so
-- that its boundaries (distances 16, 32 and 64 land on whole numbers) fall where theirs
-- do; test_t5 checks every distance to 400 against transformers' table.
function M.bucket(rel, buckets, max_distance)
  buckets, max_distance = buckets or 32, max_distance or 128
  local half = buckets // 2
  local b = rel > 0 and half or 0
  local n = math.abs(rel)
  local max_exact = half // 2
  if n < max_exact then return b + n end
  local ratio = f32(math.log(max_distance / max_exact))
  local v = f32(f32(f32(math.log(f32(f32(n) / max_exact))) / ratio) * (half - max_exact))
  local large = max_exact + math.floor(v)
  return b + math.min(large, half - 1)
end

-- ---------------------------------------------------------------- network

function M.block_of(name)
  local i = name:match("^block%.(%d+)%.")
  if i then return "block." .. i end
  if name == "final_layer_norm.weight" then return "final" end
  return nil -- the embedding: its rows are gathered on the host in mode "low"
end

-- weights: a stream.weights accessor (canonical names); cfg as kiln.t5_files.config.
function M.new(weights, cfg, opts)
  opts = opts or {}
  local self = setmetatable({ weights = weights, config = cfg }, Encoder)
  self.encodings = encoding_cache.new({ limit = opts.cache, what = "kiln.load_t5" })
  self.streamer = stream.new(weights, stream.blocks(files.expected(cfg), M.block_of), "t5")
  return self
end

function Encoder:w(name) return self.weights:tensor(name) end

function Encoder:_device()
  local probe = "block.0.layer.0.layer_norm.weight"
  local w = self.weights
  if w.device then return w:device(probe) end
  local t = w:tensor(probe)
  return t.device
end

-- a handle in dtype dt, freeing the one given when it converts
local function as(t, dt)
  if t.dtype == dt then return t end
  local r = t:to(dt)
  t:free()
  return r
end

-- T5LayerNorm: x * rsqrt(mean(x^2) + eps) * w, in f32 (x is f32).
function Encoder:_norm(x, name)
  local w = as(self:w(name), "f32")
  local sq = x * x
  local ms = sq:mean(x:dim(), true)
  sq:free()
  local ve = ms + EPS
  ms:free()
  local r = ve:pow(-0.5)
  ve:free()
  local y = x * r
  r:free()
  local out = y * w
  y:free(); w:free()
  return out
end

-- A linear layer without bias; a scaled fp8 weight's scale_weight multiplies the result.
function Encoder:_linear(h, name)
  local w = self:w(name)
  local y = nn.linear(h, w)
  w:free()
  local s = self.config.scales and self.config.scales[name]
  if s then
    local ys = y * s
    y:free()
    y = ys
  end
  return y
end

-- The relative position bias [1, H, n, n] (f32) from the first block's table: row r of
-- R = table[bucket(r - (n - 1))] covers every distance, and query i's keys read R's
-- columns n-1-i .. 2n-2-i.
function Encoder:_position_bias(n, dev)
  local cfg = self.config
  local tab = self:w("block.0.layer.0.SelfAttention.relative_attention_bias.weight")
  local rows = {}
  for r = 1, 2 * n - 1 do
    rows[r] = tab:narrow(1, M.bucket(r - n, cfg.buckets, cfg.max_distance) + 1, 1)
  end
  local R = kiln.cat(rows, 1)
  for _, v in ipairs(rows) do v:free() end
  tab:free()
  R = as(R, "f32")
  local Rt = R:transpose(1, 2)
  local Rc = Rt:contiguous()
  Rt:free(); R:free()
  local R3 = Rc:reshape({ cfg.heads, 1, 2 * n - 1 })
  Rc:free()
  local per = {}
  for i = 0, n - 1 do per[i + 1] = R3:narrow(3, n - i, n) end
  local b = kiln.cat(per, 2)
  for _, v in ipairs(per) do v:free() end
  R3:free()
  local b4 = b:reshape({ 1, cfg.heads, n, n })
  b:free()
  if b4.device ~= dev then b4 = as(b4, "f32"); local d = b4:to(dev); b4:free(); b4 = d end
  return b4
end

-- One block on the f32 residual stream x [B, n, D]; act: the dtype of the products.
function Encoder:_block(i, x, act, bias_ref)
  local cfg = self.config
  local B, n = x.shape[1], x.shape[2]
  local H, dk = cfg.heads, cfg.d_kv
  local p = fmt("block.%d.layer.", i)
  if i == 0 then bias_ref[1] = self:_position_bias(n, x.device) end
  local bias = bias_ref[1]
  local h = as(self:_norm(x, p .. "0.layer_norm.weight"), act)
  local function heads(name)
    local t = self:_linear(h, p .. "0.SelfAttention." .. name .. ".weight")
    local r = t:reshape({ B, n, H, dk })
    t:free()
    local v = r:transpose(2, 3)
    r:free()
    return v
  end
  local q, k, v = heads("q"), heads("k"), heads("v")
  h:free()
  local kt = k:transpose(3, 4)
  local s = as(kiln.matmul(q, kt), "f32")
  kt:free(); k:free(); q:free()
  local sb = s + bias
  s:free()
  local pr = as(nn.softmax(sb, 4), act)
  sb:free()
  local o = kiln.matmul(pr, v)
  pr:free(); v:free()
  local ot = o:transpose(2, 3)
  local oc = ot:contiguous()
  ot:free(); o:free()
  local o3 = oc:reshape({ B, n, cfg.inner })
  oc:free()
  local a = as(self:_linear(o3, p .. "0.SelfAttention.o.weight"), "f32")
  o3:free()
  local x1 = x + a
  a:free()
  h = as(self:_norm(x1, p .. "1.layer_norm.weight"), act)
  local g0 = self:_linear(h, p .. "1.DenseReluDense.wi_0.weight")
  local g = nn.gelu(g0, "tanh")
  g0:free()
  local u = self:_linear(h, p .. "1.DenseReluDense.wi_1.weight")
  h:free()
  local gu = g * u
  g:free(); u:free()
  local m = as(self:_linear(gu, p .. "1.DenseReluDense.wo.weight"), "f32")
  gu:free()
  local x2 = x1 + m
  x1:free(); m:free()
  return x2
end

-- token ids: an integer kiln tensor [B, n] or [n], or a Lua list (of lists) -> a list of
-- lists of integers, checked against the vocabulary.
local function id_lists(ids, vocab)
  local t = ids
  if type(ids) == "userdata" then
    if ids.dtype ~= "i64" and ids.dtype ~= "i32" then
      error(fmt("t5:forward: ids must be an integer tensor (i64), got %s", ids.dtype), 3)
    end
    if ids:dim() ~= 1 and ids:dim() ~= 2 then
      error(fmt("t5:forward: ids must be [B, n] or [n], got %d dimensions", ids:dim()), 3)
    end
    t = ids:table()
  elseif type(ids) ~= "table" then
    error("t5:forward: ids must be an integer tensor [B, n] or a list of token ids, got " .. type(ids), 3)
  end
  if type(t[1]) ~= "table" then t = { t } end
  local n = #t[1]
  if n == 0 then error("t5:forward: no token ids", 3) end
  for b, seq in ipairs(t) do
    if type(seq) ~= "table" or #seq ~= n then
      error("t5:forward: the sequences of a batch must have the same length", 3)
    end
    for i, id in ipairs(seq) do
      if math.type(id) ~= "integer" or id < 0 or id >= vocab then
        error(fmt("t5:forward: token id %s (sequence %d, position %d) is outside the vocabulary (0..%d)",
          tostring(id), b, i, vocab - 1), 3)
      end
    end
  end
  return t
end

-- ids (checked) -> embeddings [B, n, D] f32, gathered where the table is.
function Encoder:embed(batch)
  local cfg = self.config
  local tok = self:w("shared.weight")
  local seqs = {}
  for b, seq in ipairs(batch) do
    local r = {}
    for i, id in ipairs(seq) do r[i] = tok:narrow(1, id + 1, 1) end
    local c = kiln.cat(r, 1)
    for _, v in ipairs(r) do v:free() end
    seqs[b] = c:reshape({ 1, #seq, cfg.d_model })
    c:free()
  end
  tok:free()
  local e = #seqs == 1 and seqs[1] or kiln.cat(seqs, 1)
  if #seqs > 1 then for _, v in ipairs(seqs) do v:free() end end
  return as(e, "f32")
end

function Encoder:_run(batch)
  local cfg = self.config
  local order = {}
  for i = 0, cfg.blocks - 1 do order[#order + 1] = "block." .. i end
  order[#order + 1] = "final"
  local pass <close> = self.streamer:pass(order)
  local dev = self:_device()
  local x = self:embed(batch)
  if x.device ~= dev then
    local xd = x:to(dev)
    x:free()
    x = xd
  end
  local act = kiln.activation_dtype(dev)
  if act == "f16" then act = "bf16" end
  local bias_ref = {}
  local ok, err = pcall(function()
    for i = 0, cfg.blocks - 1 do
      local nx = pass:run("block." .. i, self._block, self, i, x, act, bias_ref)
      x:free()
      x = nx
    end
  end)
  if bias_ref[1] then bias_ref[1]:free() end
  if not ok then x:free(); error(err, 0) end
  local out = pass:run("final", self._norm, self, x, "final_layer_norm.weight")
  x:free()
  return out
end

-- ids: an integer tensor [B, n] (or [n], or Lua lists of ids) -> the last hidden state
-- [B, n, d_model] f32, as transformers' T5EncoderModel(ids).last_hidden_state (no mask).
function Encoder:forward(ids)
  local batch = id_lists(ids, self.config.vocab)
  local dev = self:_device()
  if kiln.precision_of(dev) == "f16" then
    return kiln.with_precision(dev == "cpu" and "f32" or "bf16", self._run, self, batch)
  end
  return self:_run(batch)
end

--- The ids a prompt gives at a fixed length, as the pipelines feed T5 (BFL's and
-- transformers' tokenizer with truncation and padding="max_length"): SentencePiece's
-- ids; a longer text is cut to length - 1 ids and closed with </s> (1); a shorter one
-- padded with <pad> (0). length nil: the ids as they are.
function M.ids(text, length)
  if type(text) ~= "string" then error("kiln.t5: the prompt must be a string, got " .. type(text), 3) end
  local ids = M.tokenize(text)
  if length == nil then return ids end
  if math.type(length) ~= "integer" or length < 1 then
    error(fmt("kiln.t5: length must be a positive integer, got %s", tostring(length)), 3)
  end
  if #ids > length then
    local cut = table.move(ids, 1, length - 1, 1, {})
    cut[length] = 1
    return cut
  end
  for i = #ids + 1, length do ids[i] = 0 end
  return ids
end

-- What decides an encoding besides its ids: the device and the arithmetic it runs in,
-- and the weights (the encoder object, whose cache this is, and the patches on its store).
function Encoder:_cache_key(ids)
  local dev = self:_device()
  local store = rawget(self, "model")
  local ok, patches = pcall(function() return store and store.patch_count and store:patch_count() or 0 end)
  return fmt("%s|%s|%s|%s", dev, kiln.precision_of(dev), ok and tostring(patches) or "?", table.concat(ids, ","))
end

--- t5:encode(text [, opts]): the final hidden states [1, n, d_model] f32 of a prompt;
-- opts.length pads or cuts the ids to that many (see M.ids), unmasked as BFL and
-- ComfyUI run it. The result is cached per encoder (kiln.encoding_cache): the same ids on
-- the same device in the same precision are encoded once; what a hit returns is a view
-- of the cached tensor, the caller's to free and never to write into. opts.cache =
-- false encodes without looking.
function Encoder:encode(text, opts)
  opts = opts or {}
  local ids = M.ids(text, opts.length)
  if opts.cache == false then return self:forward({ ids }) end
  return self.encodings:fetch(self:_cache_key(ids), self.forward, self, { ids })
end

--- Drops the cached encodings (their storage goes once no caller holds a view of it).
function Encoder:clear_cache()
  self.encodings:clear()
end

-- ---------------------------------------------------------------- loading

--- kiln.load_t5(path [, opts]): a T5 v1.1 encoder from a .safetensors file (ComfyUI's
-- t5xxl_fp16 / fp8_e4m3fn(_scaled), transformers' names with or without "encoder."),
-- a GGUF file (llama.cpp's names, any block type kiln decodes), or a diffusers folder
-- (text_encoder_2/ itself, or the pipeline folder holding it). opts.heads overrides the
-- head count; opts.cache limits t5:encode's cache of encodings (bytes or a size, default
-- 64 MiB, 0 off). Returns the encoder, also its weight store (a kiln.part); closing it
-- drops its cached encodings.
function M.load(path, opts)
  opts = opts or {}
  local found = files.open(path, opts)
  local enc = M.new(stream.weights(found.store, "", found.map), found.config, opts)
  enc = part.as_model(enc, found.store, "T5")
  local close = enc.close
  enc.close = function(self)
    self.encodings:clear()
    close(self)
  end
  return enc
end

return M
