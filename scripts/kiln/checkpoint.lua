-- kiln.checkpoint: kiln.load_checkpoint(path [, opts]) -> {clip, unet, vae, family, ...}
-- assembles a checkpoint from the files users already have: single-file .safetensors
-- or GGUF in the original naming, diffusers folders, separate VAE / text-encoder
-- files. It asks kiln.family which family a file is, the family (kiln.families.*) for
-- its parts, name maps, conditioning and latent format, kiln.model_files for reading,
-- validating and opening stores, and builds each part as a network that is also its
-- weight store (kiln.part): a kiln.Model named "unet", "vae" or "clip" over exactly the
-- tensors the network reads. Every hyper-parameter the tensors reveal is read from the
-- shapes (checkpoint.inspect works on a name -> shape table alone); heads, activations,
-- scale factor and prediction type come from the family unless the file's
-- __metadata__ says otherwise (keys below).
--
-- __metadata__ keys read: kiln.family, kiln.heads.unet, kiln.head_dim.unet,
-- kiln.heads.clip, kiln.heads.clip_g, kiln.clip.activation, kiln.clip_g.activation,
-- kiln.clip.layer, kiln.scale_factor, kiln.shift_factor, kiln.prediction, kiln.zsnr;
-- kiln.few_step, modelspec.architecture, modelspec.title, ss_output_name (what few-step
-- model it is: kiln.few_step_kind).
local kiln = require "kiln"
local util = require "kiln.util"
local mf = require "kiln.model_files"
local part = require "kiln.part"
local family = require "kiln.family"
local sd = require "kiln.families.sd"
local unet = require "kiln.unet"
local vae = require "kiln.vae"
local clip = require "kiln.clip"
local stream = require "kiln.stream"
local lora = require "kiln.lora"
local embedding = require "kiln.embedding"
local taesd = require "kiln.taesd"
local t5 = require "kiln.t5"
local dit_files = require "kiln.dit_files"
local few_step_kind = require "kiln.few_step_kind"

local M = {}
local fmt = string.format
local join = mf.join
local meta_num = family.meta_num
local new_weights = stream.weights

local function fail(path, msg) util.file_error("kiln.load_checkpoint", path, msg) end

-- Kept for callers of the names this module had before the plumbing and the name
-- maps moved out (kiln.model_files, kiln.families.sd).
M.PICKLE_HELP = mf.PICKLE_HELP
M.read_safetensors = mf.read
M.sub = mf.sub
M.diffusers_unet_map = sd.diffusers_unet_map
M.diffusers_vae_map = sd.diffusers_vae_map

-- A file as a source (kiln.model_files), its GGUF architecture checked.
local function file_source(path)
  local src = mf.source(path)
  if mf.sniff(path) == "gguf" then family.check_gguf(src.meta, path) end
  return src
end

-- ---------------------------------------------------------------- header analysis

-- Where the parts of a single-file checkpoint live and its family (kiln.family.layout):
-- {family, unet = prefix, vae = prefix, has_vae, clip = {{prefix, role}, ...}}
function M.layout(shapes, meta, path, forced) return family.layout(shapes, meta, path, forced) end

-- Header-only analysis: name -> shape (+ metadata) -> {family, unet = cfg, vae = cfg,
-- clip = {cfg, ...}, layout}. Works on the real key lists (name and shape per line) as
-- well as on real files. forced: the family option.
function M.inspect(shapes, meta, path, forced)
  meta = meta or {}
  local L = M.layout(shapes, meta, path, forced)
  local F = family.get(L.family)
  local info = { family = L.family, layout = L }
  if F.dit then -- a transformer family: its module reads the configuration (F.dit names it)
    -- in the reference's names; a file in another naming (diffusers') through its layout
    local sub = mf.sub(shapes, L.unet)
    local lay = F.parts.ldm.layout and F.parts.ldm.layout(shapes, L.unet)
    if lay then
      dit_files.check_composites(path, { composite = lay.composite, shapes = shapes })
      sub = dit_files.canonical_shapes(shapes, lay.map, lay.composite)
      info.dit_layout = lay
    end
    local ok, cfg = pcall(require(F.dit).config, sub, meta)
    if not ok then fail(path, tostring(cfg)) end
    info.dit = cfg
    info.dit_shapes = sub
  else
    local heads, head_dim = family.unet_heads(F, meta)
    local ok, cfg = pcall(unet.config, mf.sub(shapes, L.unet), { heads = heads, head_dim = head_dim })
    if not ok then fail(path, tostring(cfg)) end
    info.unet = cfg
  end
  if L.has_vae then
    local okv, vcfg = pcall(vae.config, mf.sub(shapes, L.vae), {
      scale_factor = meta_num(meta, "kiln.scale_factor") or F.latent.scale_factor,
      shift_factor = meta_num(meta, "kiln.shift_factor") or F.latent.shift_factor,
    })
    if not okv then fail(path, tostring(vcfg)) end
    info.vae = vcfg
  end
  info.clip = {}
  for i, e in ipairs(L.clip) do
    local key = family.encoder_spec(F, e.role).meta
    local okc, ccfg = pcall(clip.config, mf.sub(shapes, e.prefix), {
      heads = meta_num(meta, "kiln.heads." .. key),
      activation = meta["kiln." .. key .. ".activation"],
    })
    if not okc then fail(path, tostring(ccfg)) end
    ccfg.role = e.role
    info.clip[i] = ccfg
  end
  return info
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

local function resolver(src) return function(n) return src.map and src.map[n] or (src.prefix .. n) end end

-- One part from a source: {path(s), tensors, shapes, prefix | map}.
local function build_unet(src, cfg, fam)
  cfg.summary = summary_unet(cfg)
  local resolve = resolver(src)
  local exp = unet.expected(cfg)
  mf.validate(src.path, fam .. " UNet", exp, resolve, src.shapes)
  local store = mf.open_store(src.paths, mf.names_of(exp, resolve), "unet")
  return part.as_model(unet.new(new_weights(store, src.prefix, src.map), cfg), store, "UNet")
end

-- A transformer (F.dit: its module's config / expected / new), as build_unet; the
-- source may compose tensors from several (diffusers) and carry scaled fp8 weights
-- (kiln.dit_files).
local function build_dit(src, cfg, F)
  return dit_files.build(require(F.dit), src, cfg, F.label .. " transformer")
end

-- What stands in for a part a file lacks (F.missing[name]): any use raises the
-- family's message naming the file to pass.
local function missing_part(name, msg)
  return setmetatable({}, {
    __index = function(_, k)
      if k == "close" then return function() end end
      error(fmt("kiln: %s.%s: %s", name, tostring(k), msg), 2)
    end,
    __tostring = function() return fmt("missing %s (%s)", name, msg) end,
  })
end

local function build_vae(src, cfg)
  cfg.summary = fmt("ch %d x {%s}, %d res blocks, z %d, factor %d, scale %g", cfg.ch, table.concat(cfg.ch_mult, ","),
    cfg.num_res_blocks, cfg.z_channels, cfg.factor, cfg.scale_factor)
  local resolve = resolver(src)
  local exp = vae.expected(cfg)
  mf.validate(src.path, "VAE", exp, resolve, src.shapes)
  local store = mf.open_store(src.paths, mf.names_of(exp, resolve), "vae")
  local v = part.as_model(vae.new(new_weights(store, src.prefix, src.map), cfg), store, "VAE")
  v.factor, v.scale_factor, v.shift_factor = cfg.factor, cfg.scale_factor, cfg.shift_factor
  v.latent_channels = cfg.z_channels
  return v
end

-- encs: list of {src, cfg, use}; encoders from the same file share one store, the
-- part's store is a group of them (kiln.part).
local function build_clip(encs, fam, tokenizer, hint)
  local stores, by_path, entries = {}, {}, {}
  local names_for = {}
  for i, e in ipairs(encs) do
    local key = e.src.path
    local resolve = function(n) return e.src.prefix .. n end
    local exp = clip.expected(e.cfg)
    mf.validate(e.src.path, fmt("text encoder %d (%s)", i, e.cfg.layout), exp, resolve, e.src.shapes)
    names_for[key] = names_for[key] or { src = e.src, names = {} }
    for _, n in ipairs(mf.names_of(exp, resolve)) do table.insert(names_for[key].names, n) end
  end
  for i, e in ipairs(encs) do
    local key = e.src.path
    if not by_path[key] then
      local nf = names_for[key]
      by_path[key] = mf.open_store(nf.src.paths, nf.names, "clip")
      stores[#stores + 1] = by_path[key]
    end
    local enc = clip.new_encoder(new_weights(by_path[key], e.src.prefix), e.cfg)
    entries[i] = { enc = enc, layer = e.use.layer, final_norm = e.use.final_norm, pad = e.use.pad, pooled = e.use.pooled }
  end
  local text = clip.new_text({ encoders = entries, tokenizer = tokenizer, family = fam, tokenizer_hint = hint })
  local parts, cfgs = {}, {}
  for i, e in ipairs(encs) do
    parts[i] = fmt("%s %s width %d x %d layers, %d heads, %s", e.cfg.role or "?", e.cfg.layout, e.cfg.width,
      e.cfg.layers, e.cfg.heads, e.cfg.activation)
    cfgs[i] = e.cfg
  end
  text.config = { summary = table.concat(parts, "; "), encoders = cfgs }
  return part.as_model(text, part.group(stores), "CLIP")
end

local NO_TOKENIZER_HINT = " (this build has no kiln.tokenizer binding)"

local function attach_clip(ckpt, encs, opts, dirs, hint)
  local tok, tok_src = mf.find_tokenizer(opts, dirs)
  ckpt.clip = build_clip(encs, ckpt.family, tok, hint)
  ckpt.clip.tokenizer_source = tok_src
end

-- ---------------------------------------------------------------- the checkpoint

local function check_opts(opts)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error("kiln.load_checkpoint: options must be a table", 3) end
  local known = { tokenizer = true, vae = true, clip = true, clip_l = true, clip_g = true, t5 = true,
    prediction = true, family = true, scale_factor = true, zsnr = true, loras = true, embeddings = true,
    variant = true }
  for k in pairs(opts) do
    if not known[k] then
      error(fmt("kiln.load_checkpoint: unknown option '%s' (known: %s)", tostring(k),
        table.concat(util.sorted_keys(known), ", ")), 3)
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
  if opts.t5 ~= nil and type(opts.t5) ~= "string" then
    error(fmt("kiln.load_checkpoint: t5 must be a file or folder name, got %s", type(opts.t5)), 3)
  end
  return opts
end

-- The adapter side of a checkpoint: ckpt:add_lora / ckpt:find_lora (kiln.lora) and
-- the folders LoRAs and embeddings are found in by name (opts.loras, opts.embeddings).
local function with_adapters(ckpt, opts)
  -- a few-step checkpoint (SDXL-Turbo...) as its file says: the pipelines' defaults
  local fs, why = few_step_kind.of_file(rawget(ckpt, "metadata"), rawget(ckpt, "path"))
  if fs == false then
    ckpt:close()
    fail(rawget(ckpt, "path"), why)
  end
  ckpt.few_step = fs
  ckpt.add_lora = function(self, path, o) return lora.add(self, path, o) end
  ckpt.find_lora = function(self, name) return lora.find(self, name) end
  ckpt.lora_dir, ckpt.embedding_dir = opts.loras, opts.embeddings
  local text = rawget(ckpt, "clip")
  if text and opts.embeddings then rawset(text, "embedding_dir", opts.embeddings) end
  return ckpt
end

local function finish(ckpt)
  -- textual inversion: ckpt:add_embedding(path [, name]) (see kiln.embedding)
  ckpt.add_embedding = function(self, path, name) return embedding.add(self, path, name) end
  ckpt.close = function(self)
    for _, k in ipairs({ "clip", "unet", "dit", "t5", "vae" }) do
      local p = rawget(self, k)
      if p then p:close() end
    end
  end
  return setmetatable(ckpt, {
    __close = function(t) t:close() end,
    __tostring = function(t) return fmt("checkpoint(%s, %s)", t.family, t.path) end,
  })
end

-- The first of an encoder's option names that opts gives: the file, and the name.
local function encoder_option(spec, opts)
  for _, k in ipairs(spec.options) do
    if opts[k] then return opts[k], k end
  end
  return nil, spec.options[1]
end

-- (errors raised here at level 5 point at the caller of kiln.load_checkpoint: this
-- function runs under load_single's pcall)
local function fill_single(ckpt, path, opts)
  local src = file_source(path)
  local info = M.inspect(src.shapes, src.meta, path, opts.family)
  local L = info.layout
  local fam = info.family
  local F = family.get(fam)
  if opts.variant ~= nil and not F.variants then
    error(fmt("kiln.load_checkpoint: %s is a %s checkpoint, which has no variants (variant = %s)", path, F.label,
      tostring(opts.variant)), 5)
  end
  local uses_t5 = false
  for _, e in ipairs(F.conditioning.encoders) do uses_t5 = uses_t5 or e.role == "t5" end
  if opts.t5 and not uses_t5 then
    error(fmt("kiln.load_checkpoint: %s is a %s checkpoint, which has no T5 encoder (t5 = %s)", path, F.label,
      opts.t5), 5)
  end
  ckpt.family, ckpt.path, ckpt.metadata, ckpt.config = fam, path, src.meta, info
  local function at(prefix)
    return { path = path, paths = src.paths, tensors = src.tensors, shapes = src.shapes, prefix = prefix }
  end

  if F.dit then
    local dsrc = at(L.unet)
    if info.dit_layout then
      dsrc.map, dsrc.composite = info.dit_layout.map, info.dit_layout.composite
    end
    ckpt.dit = build_dit(dsrc, info.dit, F)
  else
    ckpt.unet = build_unet(at(L.unet), info.unet, fam)
  end

  -- VAE: override file, else the checkpoint's
  local scale = opts.scale_factor or meta_num(src.meta, "kiln.scale_factor") or F.latent.scale_factor
  if opts.vae then
    local vsrc, sub = sd.vae_file(opts.vae)
    local vcfg = vae.config(sub, { scale_factor = scale,
      shift_factor = meta_num(src.meta, "kiln.shift_factor") or F.latent.shift_factor })
    ckpt.vae = build_vae(vsrc, vcfg)
  elseif info.vae then
    info.vae.scale_factor = scale
    ckpt.vae = build_vae(at(L.vae), info.vae)
  end

  -- text encoders: overrides, else the checkpoint's
  local encs = {}
  for i, e in ipairs(L.clip) do
    local spec = family.encoder_spec(F, e.role)
    local esrc, cfg = at(e.prefix), info.clip[i]
    local override, key = encoder_option(spec, opts)
    if override then
      local sub
      esrc, sub = sd.clip_file(override, key)
      cfg = clip.config(sub, { heads = meta_num(esrc.meta, "kiln.heads.clip") or
          meta_num(src.meta, "kiln.heads." .. (e.role == "g" and "clip_g" or "clip")),
        activation = esrc.meta["kiln.clip.activation"] })
      cfg.role = e.role
    end
    encs[i] = { src = esrc, cfg = cfg, use = family.encoder_use(F, e.role, cfg, src.meta) }
  end
  if #encs == 0 and F.dit and opts.clip_g then
    -- a transformer alone with several CLIP files beside it (SD 3.5: clip_l, clip_g),
    -- in the family's order
    for _, spec in ipairs(F.conditioning.encoders) do
      local file, key = encoder_option(spec, opts)
      if file and spec.role ~= "t5" then
        local esrc, sub = sd.clip_file(file, key)
        local cfg = clip.config(sub, { heads = meta_num(esrc.meta, "kiln.heads." .. spec.meta),
          activation = esrc.meta["kiln." .. spec.meta .. ".activation"] })
        cfg.role = spec.role
        encs[#encs + 1] = { src = esrc, cfg = cfg, use = family.encoder_use(F, spec.role, cfg, src.meta) }
      end
    end
  end
  if #encs == 0 and (opts.clip or opts.clip_l) then
    -- a UNet alone: one text encoder file beside it
    local esrc, sub = sd.clip_file(opts.clip or opts.clip_l, "clip")
    local cfg = clip.config(sub, { heads = meta_num(esrc.meta, "kiln.heads.clip") })
    cfg.role = "l"
    encs[1] = { src = esrc, cfg = cfg, use = family.encoder_use(F, "l", cfg, src.meta) }
  end
  if #encs > 0 then
    attach_clip(ckpt, encs, opts, mf.beside_dirs(path), kiln.tokenizer and "" or NO_TOKENIZER_HINT)
  end

  -- T5: a separate encoder file (kiln.load_t5 reads every layout users have), else
  -- the checkpoint's own (a whole ComfyUI Flux file)
  if opts.t5 then
    ckpt.t5 = t5.load(opts.t5)
  elseif uses_t5 and F.parts.ldm.t5 and mf.has_prefix(src.shapes, F.parts.ldm.t5) then
    ckpt.t5 = t5.load(path, { prefix = F.parts.ldm.t5 })
  end

  ckpt.scale_factor = scale
  ckpt.shift_factor = meta_num(src.meta, "kiln.shift_factor") or F.latent.shift_factor
  if F.variant then
    ckpt.variant = info.dit_layout and F.variant(info.dit_shapes, "", src.meta, path) or
        F.variant(src.shapes, L.unet, src.meta, path)
  end
  -- the family's checks once the parts are built (the variant asked for, the text
  -- encoders' widths)
  if F.check_parts then F.check_parts(ckpt, opts) end
  for name, msg in pairs(F.missing or {}) do
    if rawget(ckpt, name) == nil then ckpt[name] = missing_part(name, msg) end
  end
  ckpt.prediction = opts.prediction or src.meta["kiln.prediction"] or
      (F.guess_prediction and F.guess_prediction(src, L.unet)) or F.defaults.prediction
  if opts.zsnr ~= nil then ckpt.zsnr = opts.zsnr else ckpt.zsnr = src.meta["kiln.zsnr"] == "true" end
  return finish(ckpt)
end

-- Closes the parts a failed load had built (nothing stays loaded after an error).
local function close_parts(ckpt)
  for _, k in ipairs({ "clip", "unet", "dit", "t5", "vae" }) do
    local p = rawget(ckpt, k)
    if p and type(p.close) == "function" then pcall(p.close, p) end
  end
end

local function load_single(path, opts)
  local ckpt = {}
  local ok, r = pcall(fill_single, ckpt, path, opts)
  if not ok then
    close_parts(ckpt)
    error(r, 0)
  end
  return r
end

-- A diffusers component folder as a source in the original names (its map applied).
local function mapped_source(files, map_of)
  local s = mf.multi_source(files)
  s.map = map_of(s.shapes)
  local orig = {}
  for o, real in pairs(s.map) do orig[o] = s.shapes[real] end
  return s, orig
end

-- The transformer family of a diffusers folder (the pipeline's folder with its
-- transformer/, or that folder alone): the family whose recognise.diffusers_class is
-- the transformer's config.json _class_name. Returns F, the transformer's folder, its
-- config; nil when the folder has no transformer.
local function diffusers_dit(dir)
  local tdir = join(dir, "transformer")
  if not mf.is_dir(tdir) then
    if not mf.file_exists(join(dir, "config.json")) or mf.is_dir(join(dir, "unet")) then return nil end
    tdir = dir
  end
  local cj = mf.read_json(join(tdir, "config.json"))
  local cls = mf.json_string(cj, "_class_name")
  if tdir == dir and not (cls and cls:match("Transformer")) then return nil end
  for _, F in ipairs(family.all()) do
    if F.dit and F.recognise.diffusers_class == cls then return F, tdir, cj end
  end
  local known = {}
  for _, F in ipairs(family.all()) do
    if F.recognise.diffusers_class then known[#known + 1] = F.recognise.diffusers_class end
  end
  fail(tdir, fmt("a diffusers transformer of class %s (config.json _class_name); kiln reads %s", tostring(cls),
    table.concat(known, ", ")))
end

-- A transformer family's diffusers folder: transformer/ (its names composed back into
-- the reference's by the family's parts.diffusers.layout), text_encoder/ (CLIP),
-- the T5 folder and the VAE when present; options override the parts as for single
-- files.
local function fill_diffusers_dit(ckpt, dir, opts, F, tdir, cj)
  local D = F.parts.diffusers
  local tfiles = mf.diffusers_files(tdir, "diffusion_pytorch_model")
  if not tfiles then
    fail(tdir, "no diffusion_pytorch_model.safetensors (or its index and shards) in this transformer folder")
  end
  local src = mf.multi_source(tfiles)
  local lay = D.layout(src.shapes, "")
  src.map, src.composite, src.prefix = lay.map, lay.composite, ""
  local meta = D.meta(cj)
  for k, v in pairs(src.meta) do if meta[k] == nil then meta[k] = v end end
  if opts.family and opts.family ~= F.name then
    fail(tdir, fmt("family option %q, but this is a %s transformer (%s)", opts.family, F.label,
      tostring(mf.json_string(cj, "_class_name"))))
  end
  dit_files.check_composites(#tfiles == 1 and tfiles[1] or tdir, src)
  local cshapes = dit_files.canonical_shapes(src.shapes, lay.map, lay.composite)
  local ok, cfg = pcall(require(F.dit).config, cshapes, meta, lay.config_opts)
  if not ok then fail(#tfiles == 1 and tfiles[1] or tdir, tostring(cfg) .. (D.names_hint or "")) end
  ckpt.family, ckpt.path, ckpt.metadata = F.name, dir, src.meta
  ckpt.config = { family = F.name, dit = cfg }
  ckpt.dit = build_dit(src, cfg, F)
  local base = tdir ~= dir and dir or nil   -- the pipeline folder, when there is one

  -- text encoders (CLIP): an option, else the folder's
  local encs = {}
  for _, e in ipairs(D.clip or {}) do
    local spec = family.encoder_spec(F, e.role)
    local override, key = encoder_option(spec, opts)
    local files = not override and base and mf.diffusers_files(join(base, e.folder), "model")
    local esrc, sub, act, nheads
    if override then
      esrc, sub = sd.clip_file(override, key)
    elseif files then
      esrc = mf.multi_source(files)
      sub = esrc.shapes
      local config = mf.read_json(join(join(base, e.folder), "config.json"))
      act = mf.json_string(config, "hidden_act")
      nheads = math.tointeger(mf.json_number(config, "num_attention_heads"))
    end
    if esrc then
      local ccfg = clip.config(sub, { heads = nheads or meta_num(esrc.meta, "kiln.heads.clip"), activation = act })
      ccfg.role = e.role
      encs[#encs + 1] = { src = esrc, cfg = ccfg, use = family.encoder_use(F, e.role, ccfg, {}) }
    end
  end
  if #encs > 0 then
    attach_clip(ckpt, encs, opts, base and { join(base, "tokenizer"), base } or { dir }, "")
  end
  -- T5
  if opts.t5 then
    ckpt.t5 = t5.load(opts.t5)
  elseif base and D.t5 and mf.diffusers_files(join(base, D.t5), "model") then
    ckpt.t5 = t5.load(join(base, D.t5))
  end
  -- VAE
  local scale = opts.scale_factor or F.latent.scale_factor
  local vsrc, vsub
  if opts.vae then
    vsrc, vsub = sd.vae_file(opts.vae)
  elseif base and D.vae then
    local vfiles = mf.diffusers_files(join(base, D.vae), "diffusion_pytorch_model")
    if vfiles then vsrc, vsub = mapped_source(vfiles, sd.diffusers_vae_map) end
  end
  if vsrc then
    local okv, vcfg = pcall(vae.config, vsub, { scale_factor = scale, shift_factor = F.latent.shift_factor })
    if not okv then fail(vsrc.path, tostring(vcfg)) end
    ckpt.vae = build_vae(vsrc, vcfg)
  end
  ckpt.scale_factor = scale
  ckpt.shift_factor = F.latent.shift_factor
  if F.variant then ckpt.variant = F.variant(cshapes, "") end
  if F.check_parts then F.check_parts(ckpt, opts) end
  for name, msg in pairs(F.missing or {}) do
    if rawget(ckpt, name) == nil then ckpt[name] = missing_part(name, msg) end
  end
  ckpt.prediction = opts.prediction or F.defaults.prediction
  ckpt.zsnr = opts.zsnr or false
  return finish(ckpt)
end

local function load_diffusers(dir, opts)
  local F, tdir, cj = diffusers_dit(dir)
  if F then
    local ckpt = {}
    local ok, r = pcall(fill_diffusers_dit, ckpt, dir, opts, F, tdir, cj)
    if not ok then
      close_parts(ckpt)
      error(r, 0)
    end
    return r
  end
  local ufiles = mf.diffusers_files(join(dir, "unet"), "diffusion_pytorch_model")
  if not ufiles then
    fail(dir, "a folder, but not a diffusers model: no unet/diffusion_pytorch_model.safetensors (or sharded " ..
      "index) inside")
  end
  -- the UNet's names are the same diffusers names in every SD family
  local usrc, ushapes = mapped_source(ufiles, sd.diffusers_unet_map)
  local folders = mf.list_dir(dir)
  for name in pairs(folders) do
    if not mf.diffusers_files(join(dir, name), "model") and name:match("^text_encoder") then folders[name] = nil end
  end
  local F = family.detect_diffusers({
    unet_shapes = ushapes, meta = usrc.meta, folders = folders,
    text_activation = function()
      return mf.json_string(mf.read_json(join(join(dir, "text_encoder"), "config.json")), "hidden_act")
    end,
  }, opts.family, dir)
  if not F then
    fail(dir, fmt("cannot tell the family: cross-attention context width %s (set it with {family = ...})",
      tostring(sd.context_dim(ushapes))))
  end
  local fam = F.name
  local heads, head_dim = family.unet_heads(F, usrc.meta)
  local ok, ucfg = pcall(unet.config, ushapes, { heads = heads, head_dim = head_dim })
  if not ok then fail(dir .. "/unet", tostring(ucfg)) end
  local ckpt = { family = fam, path = dir, metadata = usrc.meta, config = { family = fam, unet = ucfg } }
  usrc.prefix = ""
  ckpt.unet = build_unet(usrc, ucfg, fam)

  local scale = opts.scale_factor or F.latent.scale_factor
  local vsrc, vsub
  if opts.vae then
    vsrc, vsub = sd.vae_file(opts.vae)
  else
    local vfiles = mf.diffusers_files(join(dir, F.parts.diffusers.vae), "diffusion_pytorch_model")
    if vfiles then
      vsrc, vsub = mapped_source(vfiles, F.parts.diffusers.vae_map)
      local sf = mf.json_number(mf.read_json(join(join(dir, F.parts.diffusers.vae), "config.json")), "scaling_factor")
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
  local function add_encoder(files, role, override, key)
    local esrc, sub
    if override then
      esrc, sub = sd.clip_file(override, key)
    elseif files then
      esrc = mf.multi_source(files)
      sub = esrc.shapes
    else
      return
    end
    local act, nheads
    local config = files and mf.read_json(join(files[1]:match("^(.*)/[^/]*$"), "config.json"))
    if config then
      act = mf.json_string(config, "hidden_act")
      nheads = math.tointeger(mf.json_number(config, "num_attention_heads"))
      if act and act ~= "quick_gelu" and act ~= "gelu" then
        fail(files[1], fmt("unsupported text-encoder activation %q (config.json)", act))
      end
    end
    local cfg = clip.config(sub, { heads = nheads, activation = act })
    cfg.role = role
    encs[#encs + 1] = { src = esrc, cfg = cfg, use = family.encoder_use(F, role, cfg, {}) }
  end
  for _, e in ipairs(F.parts.diffusers.clip) do
    local spec = family.encoder_spec(F, e.role)
    -- a diffusers folder's text encoder is replaced by the encoder's first option only
    add_encoder(mf.diffusers_files(join(dir, e.folder), "model"), e.role, opts[spec.options[1]], spec.options[1])
  end
  if #encs > 0 then attach_clip(ckpt, encs, opts, { join(dir, "tokenizer"), dir }, "") end
  ckpt.scale_factor = scale
  local pred = opts.prediction
  if not pred then
    local p = mf.json_string(mf.read_json(join(join(dir, "scheduler"), "scheduler_config.json")), "prediction_type")
    pred = p == "v_prediction" and "v" or nil
  end
  ckpt.prediction = pred or F.defaults.prediction
  ckpt.zsnr = opts.zsnr or false
  return finish(ckpt)
end

-- kiln.load_checkpoint(path [, opts]) -> {clip, unet, vae, family, prediction,
-- scale_factor, metadata, path, config}; opts: tokenizer (folder with vocab.json +
-- merges.txt, or bpe_simple_vocab_16e6.txt.gz, or an open kiln.tokenizer; see
-- kiln.model_files.find_tokenizer for the order it is looked for in;
-- clip.tokenizer_source says which was used), vae (a VAE file; or "taesd", a TAESD
-- file or object: kiln.taesd), clip / clip_l / clip_g (text encoder files),
-- prediction ("eps" | "v"), zsnr (boolean: the model was trained with a
-- zero-terminal-SNR schedule; read from the kiln.zsnr metadata otherwise), family
-- (force one of kiln.families), scale_factor, loras / embeddings (folders
-- ckpt:find_lora and embedding:NAME look in).
function M.load_checkpoint(path, opts)
  if type(path) ~= "string" then error("kiln.load_checkpoint: path must be a string, got " .. type(path), 2) end
  opts = check_opts(opts)
  local tv = opts.vae
  if tv == "taesd" or type(tv) == "table" or (type(tv) == "string" and taesd.is_file(tv)) then
    -- TAESD as the VAE (kiln.taesd): the checkpoint as it is, then its VAE replaced
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.vae = nil
    local ckpt = M.load_checkpoint(path, o)
    local ok, err = pcall(taesd.attach, ckpt, tv)
    if not ok then
      ckpt:close()
      error(err, 0)
    end
    return ckpt
  end
  if mf.is_dir(path) then return with_adapters(load_diffusers((path:gsub("/+$", "")), opts), opts) end
  if not mf.file_exists(path) then
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
  if type(path) ~= "string" or not mf.file_exists(path) then fail(nil, tostring(path) .. ": no such file") end
  local vsrc, sub = sd.vae_file(path)
  local sd1 = family.get("sd1")
  local ok, vcfg = pcall(vae.config, sub, {
    scale_factor = opts.scale_factor or meta_num(vsrc.meta, "kiln.scale_factor") or sd1.latent.scale_factor,
    shift_factor = opts.shift_factor or meta_num(vsrc.meta, "kiln.shift_factor") or sd1.latent.shift_factor,
  })
  if not ok then fail(path, tostring(vcfg)) end
  return build_vae(vsrc, vcfg)
end

local COUNT = { "one", "two", "three" }

-- Text-encoder files alone -> a checkpoint holding only `clip` (ckpt.clip:encode,
-- ckpt:add_lora and embeddings work as on a whole one). The family: opts.family, else a
-- file's kiln.family metadata, else told by the encoders (kiln.family: one is SD 2.x
-- when OpenCLIP-shaped or 1024 wide, else SD 1.x; two are SDXL, CLIP-L and bigG in
-- either order). Also tokenizer, loras, embeddings as load_checkpoint's.
function M.load_text_encoders(paths, opts)
  if type(paths) == "string" then paths = { paths } end
  opts = opts or {}
  if type(paths) ~= "table" or #paths < 1 or #paths > 2 then
    error("kiln.checkpoint.load_text_encoders: one or two text-encoder files", 2)
  end
  local encs, meta, cfgs = {}, {}, {}
  for i, p in ipairs(paths) do
    if type(p) ~= "string" or not mf.file_exists(p) then fail(nil, tostring(p) .. ": no such file") end
    local esrc, sub = sd.clip_file(p, "text encoder")
    local ok, cfg = pcall(clip.config, sub, { heads = meta_num(esrc.meta, "kiln.heads.clip"),
      activation = esrc.meta["kiln.clip.activation"] })
    if not ok then fail(p, tostring(cfg)) end
    encs[i], cfgs[i] = { src = esrc, cfg = cfg }, cfg
    for k, v in pairs(esrc.meta) do if meta[k] == nil then meta[k] = v end end
  end
  local F
  if opts.family then F = family.resolve(opts.family, paths[1], "the family option")
  elseif meta["kiln.family"] then F = family.resolve(meta["kiln.family"], paths[1], "__metadata__ kiln.family")
  else F = family.detect_text_encoders(cfgs) end
  if not F then fail(paths[1], fmt("cannot tell the family of %d text encoder(s); name it with {family = ...} (%s)",
    #encs, family.known())) end
  local want = 0 -- the CLIP encoders (a T5 comes as its own file: kiln.load_t5)
  for _, e in ipairs(F.conditioning.encoders) do if e.role ~= "t5" then want = want + 1 end end
  if want ~= #encs then
    fail(paths[1], fmt("%s needs %s text encoder(s), got %d", F.name, COUNT[want] or tostring(want), #encs))
  end
  if F.order_text_encoders then F.order_text_encoders(encs) end
  for i, e in ipairs(encs) do
    e.cfg.role = F.conditioning.encoders[i].role
    e.use = family.encoder_use(F, e.cfg.role, e.cfg, e.src.meta)
  end
  local ckpt = { family = F.name, path = paths[1], metadata = meta }
  attach_clip(ckpt, encs, opts, mf.beside_dirs(encs[1].src.path), kiln.tokenizer and "" or NO_TOKENIZER_HINT)
  return with_adapters(finish(ckpt), opts)
end

return M
