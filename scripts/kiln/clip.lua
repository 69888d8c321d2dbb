-- kiln.clip: the CLIP text encoders of Stable Diffusion over kiln.nn, and the prompt
-- front end (A1111's emphasis syntax and weighting, or ComfyUI's; 75-token chunks).
--   Encoder (one text transformer) in either layout:
--     "hf"       transformers' CLIPTextModel: text_model.embeddings.token_embedding,
--                encoder.layers.N.self_attn.{q,k,v,out}_proj, mlp.fc1/fc2, final_layer_norm
--                (SD 1.x CLIP-L, SDXL's first encoder, diffusers text_encoder[_2])
--     "openclip" open_clip's TextTransformer: token_embedding, positional_embedding,
--                transformer.resblocks.N.attn.in_proj_weight (q, k, v packed), mlp.c_fc/
--                c_proj, ln_final, text_projection (SD 2.x, SDXL's bigG)
--   Text (the `clip` part of a checkpoint): one encoder (SD 1.x/2.x) or two (SDXL),
--     with clip:tokenize(text) and clip:encode(text) -> cond [1, 77k, dim] (, pooled).
local kiln = require "kiln"
local util = require "kiln.util"
local stream = require "kiln.stream"
local embedding = require "kiln.embedding"
local nn = kiln.nn

local M = {}
local Encoder = {}
Encoder.__index = Encoder
M.Encoder = Encoder

local fmt = string.format

local count_indices = util.count_indices

-- Standard heads by width (CLIP-L 12, OpenCLIP-H 16, bigG 20: all head size 64).
local function default_heads(width)
  if width == 768 then return 12 end
  return math.max(1, width // 64)
end

-- name -> shape (relative to the encoder's root) -> architecture.
-- opts: heads, activation ("quick_gelu" | "gelu"), pad (padding token id).
function M.config(shapes, opts)
  opts = opts or {}
  local cfg = {}
  local te
  if shapes["text_model.embeddings.token_embedding.weight"] then
    cfg.layout = "hf"
    te = shapes["text_model.embeddings.token_embedding.weight"]
    cfg.positions = (shapes["text_model.embeddings.position_embedding.weight"] or { 77 })[1]
    cfg.layers = count_indices(shapes, "^text_model%.encoder%.layers%.(%d+)%.")
    cfg.mlp = (shapes["text_model.encoder.layers.0.mlp.fc1.weight"] or { 0 })[1]
    local tp = shapes["text_projection.weight"]
    cfg.projection = tp and tp[1] or nil
  elseif shapes["token_embedding.weight"] then
    cfg.layout = "openclip"
    te = shapes["token_embedding.weight"]
    cfg.positions = (shapes["positional_embedding"] or { 77 })[1]
    cfg.layers = count_indices(shapes, "^transformer%.resblocks%.(%d+)%.")
    cfg.mlp = (shapes["transformer.resblocks.0.mlp.c_fc.weight"] or { 0 })[1]
    local tp = shapes["text_projection"]
    cfg.projection = tp and tp[2] or nil
  else
    error("CLIP: no token embedding found (expected text_model.embeddings.token_embedding.weight or token_embedding.weight)", 0)
  end
  cfg.vocab, cfg.width = te[1], te[2]
  if cfg.layers < 1 then error("CLIP: no transformer layers found", 0) end
  cfg.heads = opts.heads or default_heads(cfg.width)
  if cfg.width % cfg.heads ~= 0 then
    error(fmt("CLIP: width %d does not split into %d heads", cfg.width, cfg.heads), 0)
  end
  cfg.activation = opts.activation or (cfg.layout == "hf" and cfg.width == 768 and "quick_gelu") or
      (cfg.layout == "hf" and not cfg.projection and cfg.width < 1024 and "quick_gelu") or "gelu"
  cfg.pad = opts.pad
  return cfg
end

-- Every tensor the encoder reads (all layers, final norm, projection when present).
function M.expected(cfg)
  local list = {}
  local function add(name, shape) list[#list + 1] = { name, shape } end
  local W, F = cfg.width, cfg.mlp
  if cfg.layout == "hf" then
    add("text_model.embeddings.token_embedding.weight", { cfg.vocab, W })
    add("text_model.embeddings.position_embedding.weight", { cfg.positions, W })
    for i = 0, cfg.layers - 1 do
      local p = fmt("text_model.encoder.layers.%d.", i)
      for _, n in ipairs({ "k_proj", "v_proj", "q_proj", "out_proj" }) do
        add(p .. "self_attn." .. n .. ".weight", { W, W }); add(p .. "self_attn." .. n .. ".bias", { W })
      end
      add(p .. "layer_norm1.weight", { W }); add(p .. "layer_norm1.bias", { W })
      add(p .. "mlp.fc1.weight", { F, W }); add(p .. "mlp.fc1.bias", { F })
      add(p .. "mlp.fc2.weight", { W, F }); add(p .. "mlp.fc2.bias", { W })
      add(p .. "layer_norm2.weight", { W }); add(p .. "layer_norm2.bias", { W })
    end
    add("text_model.final_layer_norm.weight", { W }); add("text_model.final_layer_norm.bias", { W })
    if cfg.projection then add("text_projection.weight", { cfg.projection, W }) end
  else
    add("token_embedding.weight", { cfg.vocab, W })
    add("positional_embedding", { cfg.positions, W })
    for i = 0, cfg.layers - 1 do
      local p = fmt("transformer.resblocks.%d.", i)
      add(p .. "ln_1.weight", { W }); add(p .. "ln_1.bias", { W })
      add(p .. "attn.in_proj_weight", { 3 * W, W }); add(p .. "attn.in_proj_bias", { 3 * W })
      add(p .. "attn.out_proj.weight", { W, W }); add(p .. "attn.out_proj.bias", { W })
      add(p .. "ln_2.weight", { W }); add(p .. "ln_2.bias", { W })
      add(p .. "mlp.c_fc.weight", { F, W }); add(p .. "mlp.c_fc.bias", { F })
      add(p .. "mlp.c_proj.weight", { W, F }); add(p .. "mlp.c_proj.bias", { W })
    end
    add("ln_final.weight", { W }); add("ln_final.bias", { W })
    if cfg.projection then add("text_projection", { W, cfg.projection }) end
  end
  return list
end

-- ---------------------------------------------------------------- encoder network

local function names(cfg, i)
  if cfg.layout == "hf" then
    local p = fmt("text_model.encoder.layers.%d.", i)
    return {
      prefix = p, ln1 = p .. "layer_norm1", ln2 = p .. "layer_norm2", out = p .. "self_attn.out_proj",
      fc1 = p .. "mlp.fc1", fc2 = p .. "mlp.fc2",
      q = p .. "self_attn.q_proj", k = p .. "self_attn.k_proj", v = p .. "self_attn.v_proj",
    }
  end
  local p = fmt("transformer.resblocks.%d.", i)
  return {
    prefix = p, ln1 = p .. "ln_1", ln2 = p .. "ln_2", out = p .. "attn.out_proj",
    fc1 = p .. "mlp.c_fc", fc2 = p .. "mlp.c_proj", packed = p .. "attn.in_proj_",
  }
end

-- The streaming block a tensor belongs to: "layers.N" (one transformer layer) or
-- "final" (final norm and projection). The embeddings belong to none: in mode "low"
-- their rows are gathered on the host and only the [B, L, W] result goes to the device.
function M.block_of(name)
  local i = name:match("^text_model%.encoder%.layers%.(%d+)%.") or name:match("^transformer%.resblocks%.(%d+)%.")
  if i then return "layers." .. i end
  if name:match("^text_model%.final_layer_norm%.") or name:match("^ln_final%.") or name:match("^text_projection") then
    return "final"
  end
  return nil
end

function M.new_encoder(weights, cfg)
  local self = setmetatable({ weights = weights, config = cfg }, Encoder)
  self.streamer = stream.new(weights, stream.blocks(M.expected(cfg), M.block_of), "clip")
  return self
end

function Encoder:w(name) return self.weights:tensor(name) end

-- The device the encoder runs on (the streaming target in mode "low").
function Encoder:_device()
  local probe = names(self.config, 0).ln1 .. ".weight"
  local w = self.weights
  if w.device then return w:device(probe) end
  local t = w:tensor(probe)
  return t.device
end

-- q, k or v weight and bias of layer n (j = 1, 2, 3): separate tensors in the HF
-- layout, rows of the packed in_proj in open_clip's.
-- (views of the packed tensors are new handles: the caller frees them, as it may
-- free the others)
function Encoder:_qkv(n, j)
  if n.packed then
    local W = self.config.width
    local w, b = self:w(n.packed .. "weight"), self:w(n.packed .. "bias")
    local wv, bv = w:narrow(1, (j - 1) * W + 1, W), b:narrow(1, (j - 1) * W + 1, W)
    w:free(); b:free()
    return wv, bv
  end
  local p = ({ n.q, n.k, n.v })[j]
  return self:w(p .. ".weight"), self:w(p .. ".bias")
end

-- Token ids (a Lua list, or a list of lists for a batch) -> embeddings [B, L, W] f32.
-- vectors (optional): {{pos = p, vectors = [n, W]}, ...}: rows p..p+n-1 of every
-- sequence take those vectors instead of their tokens' (textual inversion; the
-- position embedding is added to them as to any token).
function Encoder:embed(ids, vectors)
  local cfg = self.config
  if type(ids[1]) == "number" then ids = { ids } end
  local tok = self:w(cfg.layout == "hf" and "text_model.embeddings.token_embedding.weight" or "token_embedding.weight")
  local pos = self:w(cfg.layout == "hf" and "text_model.embeddings.position_embedding.weight" or "positional_embedding")
  local L = #ids[1]
  -- the vectors in the token table's dtype and device, and the row each position takes
  local subst, converted = {}, {}
  for _, f in ipairs(vectors or {}) do
    local v = f.vectors
    if v.shape[2] ~= cfg.width then
      error(fmt("CLIP: embedding vectors of width %d, the encoder takes %d", v.shape[2], cfg.width), 3)
    end
    if v.dtype ~= tok.dtype then v = v:to(tok.dtype); converted[#converted + 1] = v end
    if v.device ~= tok.device then
      local d = v:to(tok.device)
      converted[#converted + 1] = d
      v = d
    end
    for k = 1, v.shape[1] do subst[f.pos + k - 1] = { v, k } end
  end
  local function drop_all()
    tok:free(); pos:free()
    for _, v in ipairs(converted) do v:free() end
  end
  if L > cfg.positions then
    drop_all()
    error(fmt("CLIP: %d tokens, but the encoder has %d positions", L, cfg.positions), 3)
  end
  local rows = {}
  for b, seq in ipairs(ids) do
    if #seq ~= L then drop_all(); error("CLIP: token sequences of a batch must have the same length", 3) end
    local r = {}
    for i, id in ipairs(seq) do
      if math.type(id) ~= "integer" or id < 0 or id >= cfg.vocab then
        drop_all()
        error(fmt("CLIP: token id %s at position %d is outside the vocabulary (0..%d)", tostring(id), i, cfg.vocab - 1), 3)
      end
      local sv = subst[i]
      if sv then r[i] = sv[1]:narrow(1, sv[2], 1) else r[i] = tok:narrow(1, id + 1, 1) end
    end
    local c = kiln.cat(r, 1)
    for _, v in ipairs(r) do v:free() end
    rows[b] = c:reshape({ 1, L, cfg.width })
    c:free()
  end
  local e = #rows == 1 and rows[1] or kiln.cat(rows, 1)
  if #rows > 1 then for _, v in ipairs(rows) do v:free() end end
  local pn = pos:narrow(1, 1, L)
  local p = pn:reshape({ 1, L, cfg.width })
  pn:free()
  local ef, pf = e:to("f32"), p:to("f32")
  local x = ef + pf
  if ef ~= e then ef:free() end
  if pf ~= p then pf:free() end
  e:free(); p:free()
  drop_all()
  return x
end

-- One transformer layer (pre-LN, causal self-attention, MLP).
function Encoder:_layer(i, x)
  local cfg = self.config
  local n = names(cfg, i)
  local B, L, W = x.shape[1], x.shape[2], x.shape[3]
  local H = cfg.heads
  local d = W // H
  local h = nn.layer_norm(x, self:w(n.ln1 .. ".weight"), self:w(n.ln1 .. ".bias"), 1e-5)
  local function proj(j)
    local w, b = self:_qkv(n, j)
    local r = nn.linear(h, w, b)
    w:free(); b:free()
    return r
  end
  local q, k, v = proj(1), proj(2), proj(3)
  h:free()
  -- every view is freed as soon as it is dead (a view keeps its storage alive)
  local function heads(t)
    local r = t:reshape({ B, L, H, d })
    local v = r:transpose(2, 3)
    r:free()
    return v
  end
  local qh, kh, vh = heads(q), heads(k), heads(v)
  local o = nn.attention(qh, kh, vh, { causal = true })
  qh:free(); kh:free(); vh:free(); q:free(); k:free(); v:free()
  local ot = o:transpose(2, 3)
  local o2 = ot:contiguous()
  ot:free(); o:free()
  local o3 = o2:reshape({ B, L, W })
  local a = nn.linear(o3, self:w(n.out .. ".weight"), self:w(n.out .. ".bias"))
  o3:free(); o2:free()
  local x1 = x + a
  a:free()
  h = nn.layer_norm(x1, self:w(n.ln2 .. ".weight"), self:w(n.ln2 .. ".bias"), 1e-5)
  local f = nn.linear(h, self:w(n.fc1 .. ".weight"), self:w(n.fc1 .. ".bias"))
  h:free()
  local g = cfg.activation == "quick_gelu" and nn.quick_gelu(f) or nn.gelu(f)
  f:free()
  local m = nn.linear(g, self:w(n.fc2 .. ".weight"), self:w(n.fc2 .. ".bias"))
  g:free()
  local x2 = x1 + m
  x1:free(); m:free()
  return x2
end

function Encoder:final_norm(x)
  local p = self.config.layout == "hf" and "text_model.final_layer_norm" or "ln_final"
  return nn.layer_norm(x, self:w(p .. ".weight"), self:w(p .. ".bias"), 1e-5)
end

-- Runs the encoder on token ids. opts:
--   layer = n (hidden state after layer n, 1-based; negative counts from the end:
--           -1 the last layer, -2 the penultimate), default -1
--   final_norm = true|false (apply the final layer norm to that state), default true
--   pooled = true: also return the pooled vector (final norm of the last layer at the
--           first end-of-text token, the highest id as CLIP's argmax, times the projection;
--           "unprojected": without the projection, CLIPTextModel's pooler_output, as
--           Flux and SD 3 take CLIP-L's)
--   vectors = {{pos = p, vectors = [n, W]}, ...}: textual-inversion vectors that replace
--           the token embeddings at positions p..p+n-1 (see Encoder:embed)
-- Returns hidden [B, L, W] (f32) [, pooled [B, P]].
function Encoder:forward(ids, opts)
  opts = opts or {}
  local cfg = self.config
  local layer = opts.layer or -1
  if layer < 0 then layer = cfg.layers + 1 + layer end
  if layer < 0 or layer > cfg.layers then
    error(fmt("CLIP: layer %d out of range (the encoder has %d layers)", opts.layer, cfg.layers), 2)
  end
  local final_norm = opts.final_norm ~= false
  local want_pooled = opts.pooled
  local last = want_pooled and cfg.layers or layer
  local batch = type(ids[1]) == "number" and { ids } or ids
  local order = {}
  for i = 0, last - 1 do order[#order + 1] = "layers." .. i end
  if final_norm or want_pooled then order[#order + 1] = "final" end
  local pass <close> = self.streamer:pass(order)
  local dev = self:_device()
  local x = self:embed(batch, opts.vectors)
  if x.device ~= dev then
    local xd = x:to(dev)
    x:free()
    x = xd
  end
  -- the layers run in the device's activation dtype (f16 / bf16 on a GPU under a half
  -- precision: kiln.activation_dtype); what is returned is f32 again
  local act = kiln.activation_dtype(dev)
  if x.dtype ~= act then
    local xa = x:to(act)
    x:free()
    x = xa
  end
  local function f32(t)
    if not t or t.dtype == "f32" then return t end
    local r = t:to("f32")
    t:free()
    return r
  end
  local hidden
  for i = 0, last - 1 do
    if i == layer then hidden = x end
    local nx = pass:run("layers." .. i, self._layer, self, i, x)
    if x ~= hidden then x:free() end
    x = nx
  end
  if layer == last then hidden = x end
  if not (final_norm or want_pooled) then return f32(hidden) end
  local out, pooled = pass:run("final", self._finish, self, hidden, x, final_norm, want_pooled and batch,
    want_pooled == "unprojected")
  return f32(out), f32(pooled)
end

-- The final norm of the chosen hidden state and (pooled_batch given) the pooled vector
-- from the last layer's state x; frees what the caller does not get back.
function Encoder:_finish(hidden, x, final_norm, pooled_batch, unprojected)
  local out = final_norm and self:final_norm(hidden) or hidden
  local pooled
  if pooled_batch then pooled = self:_pooled(x, pooled_batch, unprojected) end
  if final_norm and hidden ~= out then hidden:free() end
  if x ~= hidden and x ~= out then x:free() end
  return out, pooled
end

function Encoder:_pooled(last, batch, unprojected)
  local cfg = self.config
  if not cfg.projection and not unprojected then
    error("CLIP: this encoder has no text projection (no pooled output)", 3)
  end
  local n = self:final_norm(last)
  local rows = {}
  for b, seq in ipairs(batch) do
    local best, at = -1, 1
    for i, id in ipairs(seq) do if id > best then best, at = id, i end end
    rows[b] = n:narrow(1, b, 1):narrow(2, at, 1):reshape({ 1, cfg.width })
  end
  local e = #rows == 1 and rows[1] or kiln.cat(rows, 1)
  local r
  if unprojected then -- CLIPTextModel's pooler_output (Flux)
    r = e:contiguous()
  elseif cfg.layout == "hf" then
    r = nn.linear(e, self:w("text_projection.weight"))
  else
    local p = self:w("text_projection")
    local pf = p:to("f32")
    r = e:matmul(pf)
    if pf ~= p then pf:free() end
  end
  if #rows > 1 then e:free() end
  for _, v in ipairs(rows) do v:free() end
  n:free()
  return r
end

-- ---------------------------------------------------------------- prompt parsing

-- The weights of parse_emphasis's pieces (1.0, BREAK -1) from its events {from, to, m}
-- (in the order the brackets closed): each piece's weight is the product of the
-- factors of the events covering it. One sweep over the pieces keeps the count of each
-- active factor; a piece's weight is the product over its active factors, in the
-- order they first closed, of m multiplied by itself count times (memoized, so
-- ((1.1 * 1.1) * 1.1) is the same double as applying the brackets one by one; a piece
-- under several distinct factors may differ from that by an ulp, far below the f32 the
-- weights are used in). Linear in pieces + events while a piece lies under a few
-- distinct factors, however deep the brackets.
local function weights_of(res, events)
  if #events == 0 then return end
  local starts, stops, rank, nrank = {}, {}, {}, 0
  for _, e in ipairs(events) do
    local a, b, m = e[1], e[2], e[3]
    starts[a] = starts[a] or {}; table.insert(starts[a], m)
    stops[b] = stops[b] or {}; table.insert(stops[b], m)
    if not rank[m] then nrank = nrank + 1; rank[m] = nrank end
  end
  local powers = {}                  -- powers[m][c] = (((1.0 * m) * m) ...) c times
  local function power(m, c)
    local p = powers[m]
    if not p then p = { [0] = 1.0 }; powers[m] = p end
    for i = #p + 1, c do p[i] = p[i - 1] * m end
    return p[c]
  end
  local count, active, w, dirty = {}, {}, 1.0, false
  for k = 1, #res do
    for _, m in ipairs(starts[k] or {}) do
      if not count[m] then count[m] = 0; active[#active + 1] = m end
      count[m] = count[m] + 1
      dirty = true
    end
    if dirty then
      table.sort(active, function(x, y) return rank[x] < rank[y] end)
      w = 1.0
      for _, m in ipairs(active) do w = w * power(m, count[m]) end
      dirty = false
    end
    res[k][2] = res[k][2] * w       -- 1.0, or BREAK's -1 (multiplied too, as A1111 does)
    for _, m in ipairs(stops[k] or {}) do
      count[m] = count[m] - 1
      if count[m] == 0 then
        count[m] = nil
        for i, x in ipairs(active) do if x == m then table.remove(active, i) break end end
      end
      dirty = true
    end
  end
end

-- A1111's parse_prompt_attention: "(a:1.2) [b] \(c\)" -> {{"a", 1.2}, {" ", 1}, ...}.
-- ( ) multiplies by 1.1, [ ] divides by 1.1, (text:w) multiplies by w, \( \) \[ \] \\
-- are literal, unclosed brackets apply to the rest; BREAK (upper case, own word)
-- starts a new chunk and appears as {"BREAK", -1}. Adjacent runs with equal weights
-- are merged.
function M.parse_emphasis(text)
  local res = {}
  local round, square = {}, {}
  -- A bracket's weight multiplies the pieces from its opening to now: recorded here as
  -- an event and applied once at the end (weights_of), as multiplying every piece at
  -- every closing bracket costs pieces x brackets (quadratic in unclosed brackets).
  local events = {}
  local function multiply(from, m)
    if from <= #res then events[#events + 1] = { from, #res, m } end
  end
  local function add_text(s)
    -- split on BREAK as A1111's re_break (\s*\bBREAK\b\s*)
    local pos = 1
    local first = true
    while true do
      local a, b = nil, nil
      local search = pos
      while true do
        a, b = s:find("BREAK", search, true)
        if not a then break end
        local before = a == 1 or not s:sub(a - 1, a - 1):match("[%w_]")
        local after = b == #s or not s:sub(b + 1, b + 1):match("[%w_]")
        if before and after then break end
        search = a + 1
      end
      if not a then
        if not first then res[#res + 1] = { "BREAK", -1 } end
        res[#res + 1] = { s:sub(pos), 1.0 }
        return
      end
      local pa = a
      while pa > pos and s:sub(pa - 1, pa - 1):match("%s") do pa = pa - 1 end
      local pb = b
      while pb < #s and s:sub(pb + 1, pb + 1):match("%s") do pb = pb + 1 end
      if not first then res[#res + 1] = { "BREAK", -1 } end
      res[#res + 1] = { s:sub(pos, pa - 1), 1.0 }
      first = false
      pos = pb + 1
    end
  end
  local i, n = 1, #text
  while i <= n do
    local c = text:sub(i, i)
    if c == "\\" then
      local nx = text:sub(i + 1, i + 1)
      if nx == "(" or nx == ")" or nx == "[" or nx == "]" or nx == "\\" then
        res[#res + 1] = { nx, 1.0 }
        i = i + 2
      else
        res[#res + 1] = { "", 1.0 } -- a lone backslash (A1111 keeps text[1:] = "")
        i = i + 1
      end
    elseif c == "(" then
      round[#round + 1] = #res + 1
      i = i + 1
    elseif c == "[" then
      square[#square + 1] = #res + 1
      i = i + 1
    elseif c == ":" then
      -- ":<spaces><number><spaces>)" closes a weighted round bracket
      local ws, num, we = text:match("^:(%s*)([+-]?[%.%d]+)(%s*)%)", i)
      if num and #round > 0 and tonumber(num) then
        multiply(table.remove(round), tonumber(num))
        i = i + 1 + #ws + #num + #we + 1
      elseif num then
        add_text(text:sub(i, i + #ws + #num + #we + 1))
        i = i + 1 + #ws + #num + #we + 1
      else
        add_text(":")
        i = i + 1
      end
    elseif c == ")" and #round > 0 then
      multiply(table.remove(round), 1.1)
      i = i + 1
    elseif c == "]" and #square > 0 then
      multiply(table.remove(square), 1 / 1.1)
      i = i + 1
    elseif c == ")" or c == "]" then
      add_text(c)
      i = i + 1
    else
      local j = i
      while j <= n and not text:sub(j, j):match("[\\%(%)%[%]:]") do j = j + 1 end
      add_text(text:sub(i, j - 1))
      i = j
    end
  end
  for _, p in ipairs(round) do multiply(p, 1.1) end
  for _, p in ipairs(square) do multiply(p, 1 / 1.1) end
  if #res == 0 then return { { "", 1.0 } } end
  weights_of(res, events)
  -- adjacent runs of equal weight merged in one pass (removing and concatenating one
  -- at a time is quadratic in a run of escapes or colons)
  local out, run = {}, { res[1][1] }
  local w = res[1][2]
  for k = 2, #res do
    if res[k][2] == w then
      run[#run + 1] = res[k][1]
    else
      out[#out + 1] = { table.concat(run), w }
      run, w = { res[k][1] }, res[k][2]
    end
  end
  out[#out + 1] = { table.concat(run), w }
  return out
end

-- ComfyUI's prompt parse (its token_weights), used with weighting = "comfy". Where it
-- differs from A1111's (M.parse_emphasis): "(text:w)" sets the weight to w instead of
-- multiplying the enclosing one; only \( and \) are escapes (a "\\" or "\[" stays as
-- typed); [ ] are plain text (no de-emphasis); BREAK is a plain word; an unclosed "("
-- is plain text, not a 1.1 to the end; adjacent pieces are not merged (ComfyUI
-- tokenizes each piece on its own). The weight is read as tonumber reads it (Python's
-- float also takes "inf", "nan" and "1_0"; those stay text here).
local function comfy_parentheses(s)
  local out, cur, level = {}, "", 0
  for ch in s:gmatch(".") do
    if ch == "(" then
      if level == 0 then
        if cur ~= "" then out[#out + 1] = cur end
        cur = "("
      else
        cur = cur .. ch
      end
      level = level + 1
    elseif ch == ")" then
      level = level - 1
      if level == 0 then
        out[#out + 1] = cur .. ")"
        cur = ""
      else
        cur = cur .. ch
      end
    else
      cur = cur .. ch
    end
  end
  if cur ~= "" then out[#out + 1] = cur end
  return out
end

local function comfy_weights(s, current, out)
  for _, x in ipairs(comfy_parentheses(s)) do
    if #x >= 2 and x:sub(1, 1) == "(" and x:sub(-1) == ")" then
      x = x:sub(2, -2)
      local w = current * 1.1
      local colon = x:match(".*():")
      if colon and colon > 1 then
        local num = x:sub(colon + 1)
        local v = num:match("^%s*[+-]?%d*%.?%d*[eE]?[+-]?%d*%s*$") and tonumber(num)
        if v then w, x = v, x:sub(1, colon - 1) end
      end
      comfy_weights(x, w, out)
    else
      out[#out + 1] = { x, current }
    end
  end
  return out
end

function M.parse_comfy(text)
  local s = text:gsub("\\%)", "\0\1"):gsub("\\%(", "\0\2")
  local res = comfy_weights(s, 1.0, {})
  for _, p in ipairs(res) do p[1] = p[1]:gsub("\0\1", ")"):gsub("\0\2", "(") end
  if #res == 0 then res = { { "", 1.0 } } end
  return res
end

-- ---------------------------------------------------------------- chunking

-- Splits weighted tokens into 75-token chunks as A1111's tokenize_line: a BREAK ends
-- the chunk; when a chunk fills up and a comma was seen in its last `backtrack`
-- tokens, the tokens after the comma move to the next chunk. Each chunk becomes
-- {ids = 77 ids, weights = 77 multipliers, fixes = list}: start, tokens, padding, end.
-- opts.embedding(name) -> vector count turns `embedding:NAME` in the text into that many
-- placeholder ids (0, as A1111) with a fix {pos = index in ids, name =, count =}: the
-- encoder puts the embedding's vectors there. As A1111 does, an embedding is never
-- split across chunks: one that does not fit in what is left of a chunk starts the
-- next (the rest of that chunk is padding). A1111 leaves the fixes behind when the
-- comma backtrack moves tokens; here they move with their placeholders.
function M.chunks(pieces, tok, opts)
  opts = opts or {}
  local bos, eos = opts.bos or 49406, opts.eos or 49407
  local pad = opts.pad or eos
  local comma = opts.comma
  local backtrack = opts.backtrack or 20
  local resolve = opts.embedding
  local chunks = {}
  local cur_t, cur_w, cur_f = {}, {}, {}
  local last_comma = -1
  local function next_chunk(is_last)
    local ids, ws = { bos }, { 1.0 }
    for i = 1, #cur_t do ids[#ids + 1] = cur_t[i]; ws[#ws + 1] = cur_w[i] end
    while #ids < 76 do ids[#ids + 1] = pad; ws[#ws + 1] = 1.0 end
    ids[#ids + 1] = eos; ws[#ws + 1] = 1.0
    -- A1111 pads with the end token up to 77 then (for OpenCLIP) with pad: the token
    -- right after the text is always the end token
    if pad ~= eos and #cur_t < 75 then
      ids[#cur_t + 2] = eos
      ids[77] = pad
    end
    local fixes = {}
    for i, f in ipairs(cur_f) do fixes[i] = { pos = f.at + 1, name = f.name, count = f.count } end
    chunks[#chunks + 1] = { ids = ids, weights = ws, fixes = fixes }
    cur_t, cur_w, cur_f = {}, {}, {}
    last_comma = -1
    return is_last
  end
  -- a piece's units: token ids, and {name =, count =} for an embedding
  local function units_of(text)
    if not resolve then return tok(text) end
    local units = {}
    for _, part in ipairs(embedding.split(text)) do
      if type(part) == "table" then
        units[#units + 1] = { name = part.embedding, count = resolve(part.embedding) }
      elseif part ~= "" then
        for _, id in ipairs(tok(part)) do units[#units + 1] = id end
      end
    end
    return units
  end
  for _, piece in ipairs(pieces) do
    local text, w = piece[1], piece[2]
    if text == "BREAK" and w == -1 then
      next_chunk(false)
    else
      local units = units_of(text)
      local i = 1
      while i <= #units do
        local t = units[i]
        if comma and t == comma then
          last_comma = #cur_t + 1
        elseif backtrack > 0 and #cur_t == 75 and last_comma ~= -1 and #cur_t - (last_comma - 1) <= backtrack then
          local break_at = last_comma + 1
          local rt, rw, rf, keep = {}, {}, {}, {}
          for k = break_at, #cur_t do rt[#rt + 1] = cur_t[k]; rw[#rw + 1] = cur_w[k] end
          for k = #cur_t, break_at, -1 do cur_t[k] = nil; cur_w[k] = nil end
          for _, f in ipairs(cur_f) do
            if f.at >= break_at then
              rf[#rf + 1] = { at = f.at - break_at + 1, name = f.name, count = f.count }
            else
              keep[#keep + 1] = f
            end
          end
          cur_f = keep
          next_chunk(false)
          cur_t, cur_w, cur_f = rt, rw, rf
        end
        if #cur_t == 75 then next_chunk(false) end
        if type(t) == "table" then
          if #cur_t + t.count > 75 then next_chunk(false) end
          cur_f[#cur_f + 1] = { at = #cur_t + 1, name = t.name, count = t.count }
          for _ = 1, t.count do
            cur_t[#cur_t + 1] = 0
            cur_w[#cur_w + 1] = w
          end
        else
          cur_t[#cur_t + 1] = t
          cur_w[#cur_w + 1] = w
        end
        i = i + 1
      end
    end
  end
  if #cur_t > 0 or #chunks == 0 then next_chunk(true) end
  return chunks
end

-- A1111's weighting: multiply each token's hidden state by its weight, then rescale
-- so that the mean over the chunk is unchanged.
function M.apply_weights(z, weights)
  local all_one = true
  for _, w in ipairs(weights) do if w ~= 1.0 then all_one = false; break end end
  if all_one then return z end
  local L = z.shape[2]
  local wt = kiln.tensor(weights):reshape({ 1, L, 1 })
  if wt.device ~= z.device then wt = wt:to(z.device) end
  local original_mean = z:mean()
  local zw = z * wt
  local new_mean = zw:mean()
  local r = zw * (original_mean / new_mean)
  zw:free()
  return r
end

-- ComfyUI's weighting: each weighted token's hidden state moves away from (w > 1) or
-- towards (w < 1) the empty prompt's at the same position, (z - z_empty) * w + z_empty;
-- no mean restoration. Written z + (z - z_empty) * (w - 1) so that unweighted tokens
-- keep z exactly, as ComfyUI leaves them untouched.
function M.apply_weights_comfy(z, z_empty, weights)
  local L = z.shape[2]
  local w1 = {}
  for i, w in ipairs(weights) do w1[i] = w - 1.0 end
  local flat = kiln.tensor(w1)
  local wt = flat:reshape({ 1, L, 1 })
  flat:free()
  if wt.device ~= z.device then
    local d = wt:to(z.device)
    wt:free()
    wt = d
  end
  local d = z - z_empty
  local s = d * wt
  local r = z + s
  d:free(); s:free(); wt:free()
  return r
end

-- ---------------------------------------------------------------- the clip part

--- The most 75-token chunks clip:encode takes from one prompt (opts.max_chunks for one
-- call; math.huge: no limit). A longer prompt is an error naming the limit, so that
-- one request cannot hold a server for minutes (each chunk is one encoder pass).
M.max_chunks = 32

-- The text side of a checkpoint: one encoder (SD 1.x, 2.x) or two (SDXL), sharing a
-- tokenizer. Each entry of encoders: {enc = Encoder, layer = n, final_norm = bool,
-- pad = id, pooled = bool}.
local Text = {}
Text.__index = Text
M.Text = Text

function M.new_text(spec)
  return setmetatable({ encoders = spec.encoders, tokenizer = spec.tokenizer, family = spec.family,
    tokenizer_hint = spec.tokenizer_hint, clip_skip = spec.clip_skip }, Text)
end

function Text:_tok()
  local t = self.tokenizer
  if not t then
    error("clip: no tokenizer: pass {tokenizer = PATH} to kiln.load_checkpoint (a folder with vocab.json and " ..
      "merges.txt, or CLIP's bpe_simple_vocab_16e6.txt.gz)" .. (self.tokenizer_hint or ""), 3)
  end
  return t
end

local function special_ids(t)
  return t:bos(), t:eos()
end

-- Plain CLIP tokenization in 77-token windows (start, up to 75 tokens, end, padded with
-- the end token as SD 1.x does); a longer prompt gives several windows, concatenated
-- into one flat list. The emphasis syntax is not parsed here (see clip:encode).
function Text:tokenize(text)
  if type(text) ~= "string" then error("clip:tokenize: text must be a string, got " .. type(text), 2) end
  local t = self:_tok()
  local bos, eos = special_ids(t)
  local chunks = M.chunks({ { text, 1.0 } }, function(s) return t:encode(s) end,
    { bos = bos, eos = eos, pad = eos, backtrack = 0 })
  local ids = {}
  for _, c in ipairs(chunks) do
    for _, id in ipairs(c.ids) do ids[#ids + 1] = id end
  end
  return ids
end

--- The width of the pooled vector encode gives (0 when no encoder gives one): each
-- pooled encoder's projection, or its width where it gives the unprojected vector.
function Text:pooled_width()
  local n = 0
  for _, e in ipairs(self.encoders) do
    local cfg = e.enc.config
    if e.pooled == "unprojected" then n = n + cfg.width
    elseif e.pooled then n = n + (cfg.projection or cfg.width) end
  end
  return n
end

-- Encodes already-split weighted pieces ({{text, weight}, ...}, as M.parse_emphasis
-- gives) with the A1111 chunking and weighting, or per encoder ({[role] = pieces}: each
-- encoder its own; an encoder with fewer chunks than another gets the empty prompt's
-- window after its own, as ComfyUI's CLIPTextEncodeSDXL / SD3 pad the shorter token
-- list, so the states still go side by side). Returns cond [1, 77k, dim] (, pooled).
function Text:encode_pieces(pieces, opts)
  opts = opts or {}
  local per_role = pieces[1] == nil and next(pieces) ~= nil and pieces or nil
  local t = self:_tok()
  local bos, eos = special_ids(t)
  local comma = t.token_id and t:token_id(",</w>") or nil
  if comma and comma < 0 then comma = nil end
  local tok = function(s) return t:encode(s) end
  local per_encoder, pooled = {}, nil
  -- clip_skip N (A1111's "Clip skip", ComfyUI's CLIPSetLastLayer -N): every encoder
  -- takes the hidden state N layers from the end; nil keeps the family's choice
  -- (SD 1.x the last layer, SD 2.x and SDXL the penultimate)
  local clip_skip = opts.clip_skip or self.clip_skip
  local weighting = opts.weighting or "a1111"
  if weighting ~= "a1111" and weighting ~= "comfy" and weighting ~= "none" then
    error(fmt("clip:encode: weighting %s: must be \"a1111\", \"comfy\" or \"none\"", tostring(weighting)), 3)
  end
  if clip_skip ~= nil and (math.tointeger(clip_skip) == nil or clip_skip < 1) then
    error(fmt("clip:encode: clip_skip %s: must be a whole number from 1", tostring(clip_skip)), 3)
  end
  -- `embedding:NAME`: resolved once per name (added ones, else the embeddings folder)
  local found = {}
  local function resolve(name)
    found[name] = found[name] or embedding.resolve(self, name, "clip:encode")
    return found[name].count
  end
  local max_chunks = opts.max_chunks or M.max_chunks
  if max_chunks ~= math.huge and (math.tointeger(max_chunks) == nil or max_chunks < 1) then
    error(fmt("clip:encode: max_chunks %s: must be a whole number from 1 (math.huge: no limit)",
      tostring(max_chunks)), 3)
  end
  local all_chunks, most = {}, 0
  for ei, e in ipairs(self.encoders) do
    local own = pieces
    if per_role then
      own = per_role[e.enc.config.role or "l"]
      if not own then
        error(fmt("clip:encode: no text for the %s encoder (texts are given per encoder role: %s)",
          tostring(e.enc.config.role), table.concat(self:roles(), ", ")), 3)
      end
    end
    local chunks = M.chunks(own, tok, { bos = bos, eos = eos, pad = e.pad or eos, comma = comma,
      backtrack = opts.comma_backtrack, embedding = resolve })
    all_chunks[ei] = chunks
    most = math.max(most, #chunks)
  end
  for ei, e in ipairs(self.encoders) do
    local chunks = all_chunks[ei]
    if #chunks < most then
      local empty = M.chunks({ { "", 1.0 } }, tok, { bos = bos, eos = eos, pad = e.pad or eos })[1]
      for i = #chunks + 1, most do chunks[i] = empty end
    end
    if #chunks > max_chunks then
      local n = 0
      for _, c in ipairs(chunks) do
        for _, id in ipairs(c.ids) do if id ~= bos and id ~= eos and id ~= (e.pad or eos) then n = n + 1 end end
      end
      error(fmt("clip:encode: the prompt is %d chunks of 75 tokens (%d tokens), over the limit of %d chunks; "
        .. "raise it with clip:encode(text, {max_chunks = N}) or require(\"kiln.clip\").max_chunks = N",
        #chunks, n, max_chunks), 3)
    end
    local zs = {}
    local cfg = e.enc.config
    local layer = e.layer
    if clip_skip then layer = -clip_skip end
    -- ComfyUI encodes the empty prompt (start, end, padding) once when any token of
    -- the prompt is weighted
    local z_empty
    if weighting == "comfy" then
      local weighted = false
      for _, c in ipairs(chunks) do
        for _, w in ipairs(c.weights) do if w ~= 1.0 then weighted = true end end
      end
      if weighted then
        local ids = { bos, eos }
        while #ids < #chunks[1].ids do ids[#ids + 1] = e.pad or eos end
        z_empty = e.enc:forward(ids, { layer = layer, final_norm = e.final_norm })
      end
    end
    for ci, c in ipairs(chunks) do
      local vectors
      for _, f in ipairs(c.fixes) do
        vectors = vectors or {}
        vectors[#vectors + 1] = { pos = f.pos,
          vectors = embedding.vectors_for(found[f.name], cfg.role or "l", cfg.width, #self.encoders, "clip:encode") }
      end
      local z, p = e.enc:forward(c.ids, { layer = layer, final_norm = e.final_norm, pooled = ci == 1 and e.pooled or nil,
        vectors = vectors })
      if p then
        -- several pooled encoders (SD 3.5: CLIP-L and bigG): their vectors side by side
        if pooled then
          local both = kiln.cat({ pooled, p }, 2)
          pooled:free(); p:free()
          pooled = both
        else
          pooled = p
        end
      end
      local zw = z
      if weighting == "a1111" then
        zw = M.apply_weights(z, c.weights)
      elseif z_empty then
        zw = M.apply_weights_comfy(z, z_empty, c.weights)
      end
      if zw ~= z then z:free() end
      zs[ci] = zw
    end
    if z_empty then z_empty:free() end
    per_encoder[ei] = #zs == 1 and zs[1] or kiln.cat(zs, 2)
    if #zs > 1 then for _, z in ipairs(zs) do z:free() end end
  end
  local cond = #per_encoder == 1 and per_encoder[1] or kiln.cat(per_encoder, 3)
  if #per_encoder > 1 then for _, z in ipairs(per_encoder) do z:free() end end
  if pooled then return cond, pooled end
  return cond
end

-- text -> conditioning [1, 77k, dim] (and the pooled vector [1, P] for SDXL).
-- The emphasis syntax of A1111 is applied: (word:1.2), (word) = x1.1, [word] = /1.1,
-- \( \) literal, BREAK starts a new chunk; each chunk's hidden states are multiplied
-- by the token weights and rescaled to keep their mean. opts: clip_skip (1 = the last
-- layer, 2 = the penultimate, ...; default the family's), emphasis = false (plain text),
-- weighting = "a1111" (the default, above) | "comfy" (ComfyUI's parse, M.parse_comfy, and
-- its weighting, M.apply_weights_comfy) | "none" (A1111's parse, weights ignored),
-- comma_backtrack (default 20, as A1111), max_chunks (default M.max_chunks, 32: a longer
-- prompt is an error naming the limit). `embedding:NAME` (or NAME.safetensors) puts a
-- textual-inversion embedding's vectors in the prompt, weighted like any token
-- ("(embedding:NAME:1.2)"); see kiln.embedding for where names are found.
-- `text` may also be a table of one text per encoder role ({l = "...", g = "..."}: SDXL's
-- and SD 3.5's CLIP-L and bigG, as ComfyUI's CLIPTextEncodeSDXL / CLIPTextEncodeSD3 give
-- them): each encoder reads its own, the pooled vector is each one's own first window's,
-- and an encoder with fewer 75-token windows is padded with the empty prompt's.
function Text:encode(text, opts)
  opts = opts or {}
  local function parse(s)
    if opts.emphasis == false then return { { s, 1.0 } } end
    if opts.weighting == "comfy" then return M.parse_comfy(s) end
    return M.parse_emphasis(s)
  end
  if type(text) == "table" then
    local by_role = {}
    for _, role in ipairs(self:roles()) do
      local s = text[role]
      if type(s) ~= "string" then
        error(fmt("clip:encode: text.%s must be a string (one text per encoder: %s), got %s", role,
          table.concat(self:roles(), ", "), type(s)), 2)
      end
      by_role[role] = parse(s)
    end
    for k in pairs(text) do
      if not by_role[k] then
        error(fmt("clip:encode: text.%s: no encoder of that role (this CLIP's: %s)", tostring(k),
          table.concat(self:roles(), ", ")), 2)
      end
    end
    return self:encode_pieces(by_role, opts)
  end
  if type(text) ~= "string" then error("clip:encode: text must be a string, got " .. type(text), 2) end
  return self:encode_pieces(parse(text), opts)
end

--- The encoders' roles in order ("l", "g"), the keys clip:encode's per-encoder texts take.
function Text:roles()
  local r = {}
  for _, e in ipairs(self.encoders) do r[#r + 1] = e.enc.config.role or "l" end
  return r
end

return M
