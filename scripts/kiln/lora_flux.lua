-- kiln.lora_flux: the names a Flux.1 LoRA may give the transformer's weights, for
-- kiln.lora's engine (which plans and applies the patches). Every module of the
-- network (BFL's names, kiln.flux.expected) is written in each trainer's spelling:
--   kohya / sd-scripts     lora_unet_double_blocks_0_img_attn_qkv
--   ComfyUI                diffusion_model.double_blocks.0.img_attn.qkv (also with model.)
--   BFL names bare         double_blocks.0.img_attn.qkv
--   XLabs                  double_blocks.0.processor.qkv_lora1 (img) / qkv_lora2 (txt),
--                          proj_lora1 / proj_lora2; single_blocks.N.processor.qkv_lora
--                          (the q / k / v rows of linear1) and proj_lora (linear2)
--   diffusers / PEFT       transformer.transformer_blocks.0.attn.to_q (and add_q_proj,
--                          single_transformer_blocks.N.attn.to_q / proj_mlp ...): rows of
--                          BFL's fused tensors, as diffusers' converter splits them;
--                          norm_out.linear: the final modulation, halves swapped
--   OneTrainer             lora_transformer_transformer_blocks_0_attn_to_q
-- A module whose rows the checkpoint stores as several tensors (a diffusers folder)
-- targets the stored tensor when the rows are one of them, else each part in turn
-- (`split`: kiln.lora gives each the rows of the delta it covers).
local flux = require "kiln.flux"

local M = {}
local fmt = string.format

-- diffusers module -> BFL module and the part of its rows ({index, count of parts}
-- of equal parts, or "mlp" for single blocks' proj_mlp); nil parts: the whole module.
local function diffusers_modules(cfg)
  local H, Mh = cfg.hidden, cfg.mlp_hidden
  local r = {}
  local function add(d, mod, first, count) r[#r + 1] = { d, mod, first and { first, count } or nil } end
  add("x_embedder", "img_in"); add("context_embedder", "txt_in")
  add("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer")
  add("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer")
  add("time_text_embed.text_embedder.linear_1", "vector_in.in_layer")
  add("time_text_embed.text_embedder.linear_2", "vector_in.out_layer")
  if cfg.guidance then
    add("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer")
    add("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer")
  end
  add("proj_out", "final_layer.linear")
  for b = 0, cfg.depth - 1 do
    local d, c = fmt("transformer_blocks.%d.", b), fmt("double_blocks.%d.", b)
    add(d .. "norm1.linear", c .. "img_mod.lin"); add(d .. "norm1_context.linear", c .. "txt_mod.lin")
    add(d .. "attn.to_out.0", c .. "img_attn.proj"); add(d .. "attn.to_add_out", c .. "txt_attn.proj")
    add(d .. "ff.net.0.proj", c .. "img_mlp.0"); add(d .. "ff.net.2", c .. "img_mlp.2")
    add(d .. "ff_context.net.0.proj", c .. "txt_mlp.0"); add(d .. "ff_context.net.2", c .. "txt_mlp.2")
    for i, x in ipairs({ "q", "k", "v" }) do
      add(d .. "attn.to_" .. x, c .. "img_attn.qkv", (i - 1) * H + 1, H)
      add(d .. "attn.add_" .. x .. "_proj", c .. "txt_attn.qkv", (i - 1) * H + 1, H)
    end
  end
  for b = 0, cfg.depth_single - 1 do
    local d, c = fmt("single_transformer_blocks.%d.", b), fmt("single_blocks.%d.", b)
    add(d .. "norm.linear", c .. "modulation.lin"); add(d .. "proj_out", c .. "linear2")
    for i, x in ipairs({ "q", "k", "v" }) do add(d .. "attn.to_" .. x, c .. "linear1", (i - 1) * H + 1, H) end
    add(d .. "proj_mlp", c .. "linear1", 3 * H + 1, Mh)
  end
  return r
end

-- XLabs' processor names -> BFL module and rows.
local function xlabs_modules(cfg)
  local r = {}
  for b = 0, cfg.depth - 1 do
    local c = fmt("double_blocks.%d.", b)
    r[#r + 1] = { c .. "processor.qkv_lora1", c .. "img_attn.qkv" }
    r[#r + 1] = { c .. "processor.qkv_lora2", c .. "txt_attn.qkv" }
    r[#r + 1] = { c .. "processor.proj_lora1", c .. "img_attn.proj" }
    r[#r + 1] = { c .. "processor.proj_lora2", c .. "txt_attn.proj" }
  end
  for b = 0, cfg.depth_single - 1 do
    local c = fmt("single_blocks.%d.", b)
    r[#r + 1] = { c .. "processor.qkv_lora", c .. "linear1", { 1, 3 * cfg.hidden } }
    r[#r + 1] = { c .. "processor.proj_lora", c .. "linear2" }
  end
  return r
end

-- The stored target of rows {first, count} (nil: all) of a canonical tensor `name`
-- of shape `shape`: {name, shape, rows} of one stored tensor, or {split = {{name,
-- rows (stored), from, count (rows of the delta)}, ...}} when they span several.
local function target(w, name, shape, rows)
  local first, count = rows and rows[1] or 1, rows and rows[2] or shape[1]
  local tail = {}
  for i = 2, #shape do tail[#tail + 1] = shape[i] end
  local function sized(n)
    local s = { n }
    for i, v in ipairs(tail) do s[i + 1] = v end
    return s
  end
  local segs = w.composite and w.composite[name]
  if not segs then
    return { name = w:real(name), shape = sized(count), rows = rows }
  end
  local store = w.store
  local split, at = {}, 1
  for _, seg in ipairs(segs) do
    local n = seg.rows and seg.rows[2]
    if not n then
      local t = store:tensor(seg.name)
      n = t.shape[1]
      t:free()
    end
    local s0 = seg.rows and seg.rows[1] or 1
    -- the overlap of [at, at + n) with [first, first + count)
    local a, b = math.max(at, first), math.min(at + n, first + count)
    if a < b then
      split[#split + 1] = { name = seg.name, rows = { s0 + a - at, b - a }, from = a - first + 1, count = b - a,
        whole = (a == at and b == at + n and not seg.rows) }
    end
    at = at + n
  end
  if #split == 1 then
    local s = split[1]
    return { name = s.name, shape = sized(count), rows = not s.whole and s.rows or nil }
  end
  return { name = segs[1].name, shape = sized(count), split = split }
end

--- Adds the Flux transformer `dit` (a loaded part: weights, config) to a kiln.lora
-- index: alias -> module record {part = "unet", store, module, weight = {name,
-- shape}, bias, rows, split}.
function M.index(index, dit)
  local w, cfg = rawget(dit, "weights"), rawget(dit, "config")
  local shapes = {}
  for _, e in ipairs(flux.expected(cfg)) do shapes[e[1]] = e[2] end
  local recs = {}
  local function rec(mod, rows)
    local key = mod .. (rows and ("#" .. rows[1] .. "+" .. rows[2]) or "")
    if recs[key] then return recs[key] end
    local ws = shapes[mod .. ".weight"]
    if not ws then return nil end
    local t = target(w, mod .. ".weight", ws, rows)
    local r = { part = "unet", store = w.store, module = mod, rows = t.rows, split = t.split,
      weight = { name = t.name, shape = t.shape } }
    local bs = shapes[mod .. ".bias"]
    if bs and not t.split then
      local tb = target(w, mod .. ".bias", bs, rows)
      if not tb.split then r.bias = { name = tb.name, shape = tb.shape } end
    end
    recs[key] = r
    return r
  end
  local function alias(a, r) if r and not index[a] then index[a] = r end end
  -- BFL's modules in every spelling of their own names
  for _, e in ipairs(flux.expected(cfg)) do
    local mod = e[1]:match("^(.*)%.weight$")
    if mod and #e[2] == 2 then
      local r = rec(mod)
      local us = mod:gsub("%.", "_")
      alias("lora_unet_" .. us, r)
      alias("diffusion_model." .. mod, r)
      alias("model.diffusion_model." .. mod, r)
      alias("transformer." .. mod, r)
      alias(mod, r)
    end
  end
  for _, x in ipairs(xlabs_modules(cfg)) do
    local r = rec(x[2], x[3])
    alias(x[1], r)
    alias("diffusion_model." .. x[1], r)
  end
  -- diffusers' norm_out.linear: BFL's final modulation with its (shift, scale) halves
  -- swapped to (scale, shift); a folder stores it so, BFL's file gets the halves crossed
  local fin, H = "final_layer.adaLN_modulation.1", cfg.hidden
  local no
  if w.composite and w.composite[fin .. ".weight"] then
    local segs = w.composite[fin .. ".weight"]
    no = { part = "unet", store = w.store, module = fin, weight = { name = segs[1].name, shape = shapes[fin .. ".weight"] } }
  else
    local real = w:real(fin .. ".weight")
    no = { part = "unet", store = w.store, module = fin, weight = { name = real, shape = shapes[fin .. ".weight"] },
      split = { { name = real, rows = { H + 1, H }, from = 1, count = H },
        { name = real, rows = { 1, H }, from = H + 1, count = H } } }
  end
  alias("transformer.norm_out.linear", no)
  alias("norm_out.linear", no)
  alias("lora_transformer_norm_out_linear", no)
  for _, d in ipairs(diffusers_modules(cfg)) do
    local r = rec(d[2], d[3])
    local us = d[1]:gsub("%.", "_")
    alias("transformer." .. d[1], r)
    alias(d[1], r)
    alias("lora_transformer_" .. us, r)
  end
  return index
end

--- Evidence that a LoRA module (its key without the ending) is a Flux one.
function M.evidence(mod)
  if mod:match("double_blocks[._]%d+[._]") or mod:match("single_blocks[._]%d+[._]") or
      mod:match("single_transformer_blocks[._]%d+[._]") then
    return "Flux's double / single blocks"
  end
  return nil
end

return M
