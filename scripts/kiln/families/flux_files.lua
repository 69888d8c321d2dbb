-- kiln.families.flux_files: the Flux.1 files users have, mapped onto Black Forest Labs'
-- names (kiln.flux reads those): BFL's single files and ComfyUI's (bare, under
-- model.diffusion_model., or a whole checkpoint with text_encoders.clip_l.,
-- text_encoders.t5xxl. and vae.), fp8 and ComfyUI's scaled fp8, GGUF from city96's
-- converter (BFL's names, architecture "flux") and from stable-diffusion.cpp (its
-- model.diffusion_model. names, no architecture), and diffusers' FluxTransformer2DModel
-- folders, whose split q / k / v and swapped final modulation are composed back into
-- BFL's fused tensors as diffusers' single-file converter
-- (convert_flux_transformer_checkpoint_to_diffusers) splits them.
local util = require "kiln.util"
local mf = require "kiln.model_files"

local M = {}
local fmt = string.format

M.KEY = "double_blocks.0.img_attn.qkv.weight"
-- ComfyUI's prefixes in a whole checkpoint (supported_models.Flux)
M.UNET_PREFIX = "model.diffusion_model."
M.CLIP_PREFIX = "text_encoders.clip_l.transformer."
M.T5_PREFIX = "text_encoders.t5xxl."
M.VAE_PREFIX = "vae."

--- Where a single file keeps the transformer: BFL's names bare or under ComfyUI's
-- prefix (also stable-diffusion.cpp's GGUF names); any double or single block tells, so
-- a file missing block 0 is still recognised and the loader can say which is missing.
function M.find_dit(shapes)
  if shapes[M.UNET_PREFIX .. M.KEY] then return M.UNET_PREFIX end
  if shapes[M.KEY] then return "" end
  if M.is_diffusers(shapes) then return "" end
  for name in pairs(shapes) do
    local p = name:match("^(.-)double_blocks%.%d+%.img_attn%.qkv%.weight$") or
        name:match("^(.-)single_blocks%.%d+%.linear1%.weight$")
    if p and (p == "" or p == M.UNET_PREFIX) then return p end
  end
  return nil
end

-- ---------------------------------------------------------------- diffusers

-- diffusers' names of the tensors BFL keeps whole (prefixes; .weight / .bias follow).
local TOP = {
  { "img_in", "x_embedder" }, { "txt_in", "context_embedder" },
  { "time_in.in_layer", "time_text_embed.timestep_embedder.linear_1" },
  { "time_in.out_layer", "time_text_embed.timestep_embedder.linear_2" },
  { "vector_in.in_layer", "time_text_embed.text_embedder.linear_1" },
  { "vector_in.out_layer", "time_text_embed.text_embedder.linear_2" },
  { "guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1" },
  { "guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2" },
  { "final_layer.linear", "proj_out" },
}
local DOUBLE = {
  { "img_mod.lin", "norm1.linear" }, { "txt_mod.lin", "norm1_context.linear" },
  { "img_attn.proj", "attn.to_out.0" }, { "txt_attn.proj", "attn.to_add_out" },
  { "img_mlp.0", "ff.net.0.proj" }, { "img_mlp.2", "ff.net.2" },
  { "txt_mlp.0", "ff_context.net.0.proj" }, { "txt_mlp.2", "ff_context.net.2" },
}
local DOUBLE_NORMS = {
  { "img_attn.norm.query_norm.scale", "attn.norm_q.weight" }, { "img_attn.norm.key_norm.scale", "attn.norm_k.weight" },
  { "txt_attn.norm.query_norm.scale", "attn.norm_added_q.weight" },
  { "txt_attn.norm.key_norm.scale", "attn.norm_added_k.weight" },
}
local SINGLE = { { "modulation.lin", "norm.linear" }, { "linear2", "proj_out" } }
local SINGLE_NORMS = {
  { "norm.query_norm.scale", "attn.norm_q.weight" }, { "norm.key_norm.scale", "attn.norm_k.weight" },
}
-- the fused tensors and the diffusers tensors they are made of, in row order
local DOUBLE_FUSED = {
  { "img_attn.qkv", { "attn.to_q", "attn.to_k", "attn.to_v" } },
  { "txt_attn.qkv", { "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj" } },
}
local SINGLE_FUSED = { { "linear1", { "attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp" } } }

--- Is this a diffusers FluxTransformer2DModel's name set?
function M.is_diffusers(shapes)
  return shapes["x_embedder.weight"] ~= nil and (mf.has_prefix(shapes, "transformer_blocks.") or
    mf.has_prefix(shapes, "single_transformer_blocks.")) and shapes["time_text_embed.timestep_embedder.linear_1.weight"] ~= nil
end

--- A diffusers transformer's names (shapes: name -> shape, prefix stripped; p: the
-- prefix they carry in the file) -> {map = canonical -> stored name, composite =
-- canonical -> segments (kiln.dit_files)}. Every canonical name of every block the
-- file numbers is mapped; which exist is the validation's business.
function M.diffusers_layout(shapes, p)
  p = p or ""
  local map, composite = {}, {}
  local function both(canon, diff)
    map[canon .. ".weight"] = p .. diff .. ".weight"
    map[canon .. ".bias"] = p .. diff .. ".bias"
  end
  local function fused(canon, parts)
    for _, what in ipairs({ ".weight", ".bias" }) do
      local segs = {}
      for i, d in ipairs(parts) do segs[i] = { name = p .. d .. what } end
      composite[canon .. what] = segs
    end
  end
  for _, e in ipairs(TOP) do both(e[1], e[2]) end
  local nd = util.count_indices(shapes, "^transformer_blocks%.(%d+)%.")
  local ns = util.count_indices(shapes, "^single_transformer_blocks%.(%d+)%.")
  for b = 0, nd - 1 do
    local c, d = fmt("double_blocks.%d.", b), fmt("transformer_blocks.%d.", b)
    for _, e in ipairs(DOUBLE) do both(c .. e[1], d .. e[2]) end
    for _, e in ipairs(DOUBLE_NORMS) do map[c .. e[1]] = p .. d .. e[2] end
    for _, e in ipairs(DOUBLE_FUSED) do
      local parts = {}
      for i, x in ipairs(e[2]) do parts[i] = d .. x end
      fused(c .. e[1], parts)
    end
  end
  for b = 0, ns - 1 do
    local c, d = fmt("single_blocks.%d.", b), fmt("single_transformer_blocks.%d.", b)
    for _, e in ipairs(SINGLE) do both(c .. e[1], d .. e[2]) end
    for _, e in ipairs(SINGLE_NORMS) do map[c .. e[1]] = p .. d .. e[2] end
    for _, e in ipairs(SINGLE_FUSED) do
      local parts = {}
      for i, x in ipairs(e[2]) do parts[i] = d .. x end
      fused(c .. e[1], parts)
    end
  end
  -- diffusers' AdaLayerNormContinuous splits (scale, shift), BFL's final layer (shift,
  -- scale): the converter swaps the halves, so BFL's rows are the second half first
  local no = shapes["norm_out.linear.weight"]
  local h = no and no[1] // 2 or 0
  for _, what in ipairs({ ".weight", ".bias" }) do
    composite["final_layer.adaLN_modulation.1" .. what] = {
      { name = p .. "norm_out.linear" .. what, rows = { h + 1, h } },
      { name = p .. "norm_out.linear" .. what, rows = { 1, h } },
    }
  end
  return { map = map, composite = composite, blocks = nd, single_blocks = ns }
end

--- The layout of a single file's transformer under `prefix` when it is in diffusers'
-- names (a FluxTransformer2DModel saved as one file, which ComfyUI's UNETLoader also
-- reads), else nil: BFL's names need no map.
function M.single_layout(shapes, prefix)
  local sub = mf.sub(shapes, prefix or "")
  if not M.is_diffusers(sub) then return nil end
  return M.diffusers_layout(sub, prefix)
end

--- What a diffusers transformer's config.json says that the shapes do not, as the
-- __metadata__ keys kiln.flux reads (num_attention_heads, axes_dims_rope).
function M.diffusers_meta(cj)
  local meta = {}
  if type(cj) ~= "table" then return meta end
  local heads = math.tointeger(mf.json_number(cj, "num_attention_heads"))
  if heads then meta["kiln.flux.heads"] = heads end
  local axes = cj.axes_dims_rope
  if type(axes) == "table" and #axes > 0 then
    local r = {}
    for i, v in ipairs(axes) do r[i] = tostring(math.tointeger(v) or v) end
    meta["kiln.flux.axes_dim"] = table.concat(r, ",")
  end
  return meta
end

-- ---------------------------------------------------------------- checks

local VARIANT_EVIDENCE = {
  dev = "it has guidance_in.*, the embedder of [dev]'s distilled guidance",
  schnell = "it has no guidance_in.*: [schnell] takes no guidance",
}

--- A loaded checkpoint's parts checked against each other (kiln.checkpoint calls it
-- once they are built, and closes them when it raises): the variant asked for
-- (opts.variant) is the file's, the T5's width is the one txt_in takes, CLIP's pooled
-- width the one vector_in takes.
function M.check_parts(ckpt, opts)
  local where = ckpt.path
  local dit = rawget(ckpt, "dit")
  local cfg = dit and dit.config
  local v = opts.variant
  if v ~= nil then
    if v ~= "dev" and v ~= "schnell" then
      util.file_error("kiln.load_checkpoint", where, fmt("variant %q: Flux.1 variants are \"dev\" and " ..
        "\"schnell\"", tostring(v)))
    end
    if v ~= ckpt.variant then
      util.file_error("kiln.load_checkpoint", where, fmt("variant %q asked, but this is a Flux.1 [%s] file (%s); " ..
        "load it without the variant option, or pass a [%s] file", v, ckpt.variant, VARIANT_EVIDENCE[ckpt.variant], v))
    end
  end
  if not cfg then return end
  local t5 = rawget(ckpt, "t5")
  if t5 and t5.config and t5.config.d_model ~= cfg.context_dim then
    util.file_error("kiln.load_checkpoint", opts.t5 or where, fmt("the T5 encoder%s gives states %d wide " ..
      "(d_model), but this Flux transformer's txt_in takes %d (txt_in.weight of %s): not the T5 it was trained with",
      opts.t5 and "" or (" under " .. M.T5_PREFIX), t5.config.d_model, cfg.context_dim, where))
  end
  local text = rawget(ckpt, "clip")
  local encs = text and text.config and text.config.encoders
  if encs and encs[1] and encs[1].width ~= cfg.vec_dim then
    util.file_error("kiln.load_checkpoint", opts.clip or opts.clip_l or where, fmt("the CLIP text encoder%s is %d " ..
      "wide, but this Flux transformer's vector_in takes a pooled vector of %d (vector_in.in_layer.weight of %s): " ..
      "Flux uses CLIP-L (768)", (opts.clip or opts.clip_l) and "" or (" under " .. M.CLIP_PREFIX), encs[1].width,
      cfg.vec_dim, where))
  end
end

-- What a message in BFL's names means in a diffusers folder.
M.DIFFUSERS_HINT = " (in diffusers' names double_blocks.N is transformer_blocks.N, single_blocks.N " ..
    "single_transformer_blocks.N)"

--- The diffusers transformer class this family reads.
M.DIFFUSERS_CLASS = "FluxTransformer2DModel"

return M
