-- kiln.families.sd3: Stability AI's Stable Diffusion 3.5 (Large, Large Turbo, Medium;
-- SD 3 Medium's layout too): an MMDiT (kiln.mmdit) conditioned on CLIP-L and OpenCLIP
-- bigG (penultimate states side by side, zero-padded to T5's 4096 features, then T5-XXL's
-- states after them along the tokens; y the two pooled vectors side by side, 2048 wide,
-- CLIP-L's unprojected as in the reference), trained as a discrete flow with shift 3.0;
-- the 16-channel autoencoder at scale 1.5305, shift 0.0609. Besides the family's data
-- this file holds the SD 3 arithmetic the pipelines call (the flow schedule, the
-- conditioning's assembly, CFG with skip-layer guidance as one denoise function, LoRA
-- names), as plain functions over tensors.
local kiln = require "kiln"
local mf = require "kiln.model_files"
local util = require "kiln.util"

local fmt = string.format
local KEY = "joint_blocks.0.context_block.attn.qkv.weight"

-- Where a single file keeps the MMDiT: Stability AI's names bare or under ComfyUI's
-- prefix; any block's context qkv tells (a file missing block 0 is still recognised, so
-- the loader can say which blocks are missing).
local function find_dit(shapes)
  if shapes["model.diffusion_model." .. KEY] then return "model.diffusion_model." end
  if shapes[KEY] then return "" end
  for name in pairs(shapes) do
    local p = name:match("^(.-)joint_blocks%.%d+%.context_block%.attn%.qkv%.weight$")
    if p and (p == "" or p == "model.diffusion_model.") then return p end
  end
  return nil
end

-- "medium" when MMDiT-X's second attention is there (fused or split q / k / v),
-- "sd3_medium" without q/k norms
-- (SD 3 Medium), else "large" or "large_turbo": the turbo's shapes are Large's, so only
-- the metadata (kiln.variant, or a modelspec.title naming it) or the file's name tells.
local function variant(shapes, prefix, meta, path)
  prefix = prefix or ""
  local v = meta and meta["kiln.variant"]
  if v then return v end
  for name in pairs(shapes) do
    if name:sub(1, #prefix) == prefix and name:match("^joint_blocks%.%d+%.x_block%.attn2%.qk?v?%.weight$",
      #prefix + 1) then
      return "medium"
    end
  end
  if not shapes[prefix .. "joint_blocks.0.context_block.attn.ln_k.weight"] then return "sd3_medium" end
  local title = meta and meta["modelspec.title"] or ""
  local base = type(path) == "string" and path:match("([^/]*)$") or ""
  if title:lower():find("turbo", 1, true) or base:lower():find("turbo", 1, true) then return "large_turbo" end
  return "large"
end

local M -- the family table; the diffusers hooks below call its functions
M = {
  name = "sd3",
  label = "SD 3.5",

  recognise = {
    -- an all-in-one file: its bigG under text_encoders.
    prefixes = { "text_encoders.clip_g." },
    -- names no UNet nor Flux has (the second still there when block 0 is missing)
    unet_names = { KEY, "context_embedder.weight" },
    gguf_architectures = { "sd3" },
    diffusers_class = "SD3Transformer2DModel",   -- transformer/config.json's _class_name
  },

  parts = {
    ldm = {
      find_unet = find_dit, vae = "first_stage_model.",
      clip = {
        { prefix = "text_encoders.clip_l.transformer.", role = "l" },
        { prefix = "text_encoders.clip_g.transformer.", role = "g" },
      },
      -- T5-XXL inside an all-in-one file (kiln.load_t5's names below this prefix)
      t5 = "text_encoders.t5xxl.transformer.",
    },
    -- a diffusers StableDiffusion3Pipeline folder: its transformer read in place (split
    -- q / k / v, diffusers' swapped halves; M.diffusers_layout), CLIP-L, bigG, T5-XXL
    diffusers = { transformer = "transformer", vae = "vae",
      clip = { { folder = "text_encoder", role = "l" }, { folder = "text_encoder_2", role = "g" } },
      t5 = "text_encoder_3",
      layout = function(shapes, p) return M.diffusers_layout(shapes, p) end,
      meta = function(cj) return M.diffusers_meta(cj) end,
      names_hint = " (in diffusers' names joint_blocks.N is transformer_blocks.N, x_block.attn.qkv " ..
          "attn.to_q / to_k / to_v, context_block.attn.qkv attn.add_q_proj / add_k_proj / add_v_proj)" },
  },
  unet = {},
  dit = "kiln.mmdit",     -- the module that builds the network (config, expected, new)
  variant = variant,
  -- the network's time is sigma * 1000, its schedule the 1000 shifted sigmas of the
  -- reference's ModelSamplingDiscreteFlow (what "simple" and "normal" pick from)
  flow = { multiplier = 1000, table = 1000 },
  lora = "kiln.lora_sd3",  -- the names LoRAs give the MMDiT's weights
  comfy = "kiln.comfy.sd3", -- how ComfyUI's CLIPTextEncode encodes for it (encode_text)
  -- CLIP-L and bigG files in either order: bigG is the wider one (as SDXL's pair)
  order_text_encoders = function(encs)
    if #encs == 2 and encs[1].cfg.width > encs[2].cfg.width then encs[1], encs[2] = encs[2], encs[1] end
  end,

  -- both CLIPs at their penultimate layer without the final norm; the pooled vectors:
  -- CLIP-L's final-normed end token WITHOUT its projection, bigG's projected (the
  -- reference's ClipL has return_projected_pooled=False, as ComfyUI's sd3_clip); CLIP-L
  -- pads with its end token, bigG with 0; T5-XXL's last states
  conditioning = {
    encoders = {
      { role = "l", options = { "clip_l" }, meta = "clip", layer = -2, final_norm = false, pad = nil,
        pooled = "unprojected" },
      { role = "g", options = { "clip_g" }, meta = "clip_g", layer = -2, final_norm = false, pad = 0, pooled = true },
      { role = "t5", options = { "t5" }, meta = "t5" },
    },
    pooled = true, size = false,
  },

  -- ComfyUI's SD 3.5 examples: Large 28 steps at cfg 4.5, Turbo 4 at cfg 1, Medium 40
  -- at 4.5; shift 3.0 on all (ModelSamplingSD3's default); prompts' T5 tokens padded to 77
  defaults = { sampler = "euler", scheduler = "simple", cfg = 4.5, steps = 28, image_size = 1024,
    prediction = "flow", shift = 3.0, t5_length = 77 },
  variants = {
    large = { steps = 28, cfg = 4.5 },
    large_turbo = { steps = 4, cfg = 1.0 },
    -- ComfyUI's SkipLayerGuidanceSD3 node's defaults, layers 7, 8, 9 as for Medium
    medium = { steps = 40, cfg = 4.5, skip_layer_guidance = { layers = { 7, 8, 9 }, scale = 3.0, start = 0.01,
      stop = 0.15 } },
    sd3_medium = { steps = 28, cfg = 4.5 },
  },
  latent = { channels = 16, scale_factor = 1.5305, shift_factor = 0.0609 },

  -- what a file without the part says (kiln.checkpoint puts these in the part's place)
  missing = {
    vae = "this SD 3.5 checkpoint has no autoencoder: pass an SD 3.5 VAE (or an all-in-one sd3.5 file) as " ..
        "kiln.load_checkpoint(path, {vae = PATH})",
    clip = "this SD 3.5 checkpoint has no CLIP text encoders: pass clip_l.safetensors and clip_g.safetensors as " ..
        "kiln.load_checkpoint(path, {clip_l = PATH, clip_g = PATH})",
    t5 = "this SD 3.5 checkpoint has no T5-XXL text encoder: pass t5xxl_fp16.safetensors (or the fp8 one) as " ..
        "kiln.load_checkpoint(path, {t5 = PATH})",
  },
}

M.find_dit = find_dit

-- ---------------------------------------------------------------- the flow schedule

--- The discrete flow's sigma at a timestep t in [0, 1000] (the reference's
-- ModelSamplingDiscreteFlow.sigma): shift * s / (1 + (shift - 1) * s), s = t / 1000.
function M.sigma(t, shift)
  shift = shift or M.defaults.shift
  local s = t / 1000
  if shift == 1.0 then return s end
  return shift * s / (1 + (shift - 1) * s)
end

--- The model's timestep for a sigma (what dit:forward takes): sigma * 1000.
function M.timestep(sigma) return sigma * 1000 end

local function f32(x) return (string.unpack("<f", string.pack("<f", x))) end

--- The flow's model sampling as kiln.sample's schedulers read it ({sigmas (the 1000
-- values of ModelSamplingDiscreteFlow(shift).sigmas), sigma_min, sigma_max, timestep,
-- sigma, prediction = "flow", shift}): kiln.sample.sigmas("normal", steps,
-- {model_sampling = ms}) is the reference's get_sigmas, "simple" ComfyUI's default.
function M.model_sampling(shift)
  shift = shift or M.defaults.shift
  if type(shift) ~= "number" or shift <= 0 then
    error(fmt("sd3.model_sampling: shift must be a positive number, got %s", tostring(shift)), 2)
  end
  local sig = {}
  for i = 1, 1000 do sig[i] = f32(M.sigma(i, shift)) end
  local ms = { sigmas = sig, sigma_min = sig[1], sigma_max = sig[1000], prediction = "flow", shift = shift }
  function ms.timestep(sigma) return sigma * 1000 end
  function ms.sigma(t) return M.sigma(t, shift) end
  -- ComfyUI's percent_to_sigma for the flow (start / end of a guidance window)
  function ms.percent_to_sigma(p)
    if p <= 0 then return 1.0 end
    if p >= 1 then return 0.0 end
    return M.sigma((1 - p) * 1000, shift)
  end
  return ms
end

--- denoised = x - sigma * v (the reference's calculate_denoised; sigma a number).
function M.denoised(x, v, sigma)
  local sv = v * sigma
  local r = x - sv
  sv:free()
  return r
end

--- The start of img2img: sigma * noise + (1 - sigma) * latent (noise_scaling).
function M.noise_scaling(sigma, noise, latent)
  local a, b = noise * sigma, latent * (1 - sigma)
  local r = a + b
  a:free(); b:free()
  return r
end

-- ---------------------------------------------------------------- conditioning

local function is_tensor(v) return type(v) == "userdata" and v.shape ~= nil end

--- The MMDiT's context from the encoders' states: lg [B, L, dl + dg] (CLIP-L's and
-- bigG's penultimate states side by side, as clip:encode gives them) zero-padded to
-- `width` features (4096), then T5's [B, n, width] after it along the tokens; with no T5
-- (nil) `t5_tokens` (77) tokens of zeros, as ComfyUI's sd3_clip does.
function M.context(lg, t5, opts)
  opts = opts or {}
  local width = opts.width or 4096
  if not is_tensor(lg) or #lg.shape ~= 3 then
    error("sd3.context: the CLIP states must be a [B, L, d] tensor", 2)
  end
  local B, L, d = lg.shape[1], lg.shape[2], lg.shape[3]
  if d > width then error(fmt("sd3.context: CLIP states %d wide, more than the context's %d", d, width), 2) end
  local lgf = lg
  if lg.dtype ~= "f32" then lgf = lg:to("f32") end
  local parts, tmp = { lgf }, {}
  if lgf ~= lg then tmp[#tmp + 1] = lgf end
  if d < width then
    local z = kiln.zeros({ B, L, width - d })
    if lgf.device ~= z.device then
      local z2 = z:to(lgf.device); z:free(); z = z2
    end
    tmp[#tmp + 1] = z
    local padded = kiln.cat({ lgf, z }, 3)
    tmp[#tmp + 1] = padded
    parts = { padded }
  end
  if t5 ~= nil then
    if not is_tensor(t5) or #t5.shape ~= 3 or t5.shape[3] ~= width then
      error(fmt("sd3.context: the T5 states must be [B, n, %d], got %s", width,
        is_tensor(t5) and util.shape_str(t5) or type(t5)), 2)
    end
    local t = t5
    if t.dtype ~= "f32" then t = t:to("f32"); tmp[#tmp + 1] = t end
    if t.device ~= lgf.device then t = t:to(lgf.device); tmp[#tmp + 1] = t end
    if t.shape[1] ~= B then
      if t.shape[1] ~= 1 then error(fmt("sd3.context: T5 batch %d, CLIP batch %d", t.shape[1], B), 2) end
      t = t:expand({ B, t.shape[2], width }); tmp[#tmp + 1] = t
    end
    parts[2] = t
  else
    local n = opts.t5_tokens or 77
    local z = kiln.zeros({ B, n, width })
    if z.device ~= lgf.device then
      local z2 = z:to(lgf.device); z:free(); z = z2
    end
    tmp[#tmp + 1] = z
    parts[2] = z
  end
  local r = kiln.cat(parts, 2)
  for i = #tmp, 1, -1 do tmp[i]:free() end
  return r
end

--- The pooled vector y: CLIP-L's pooled output (unprojected) then bigG's projected one
-- ([B, 768 + 1280]).
function M.pooled(l_pooled, g_pooled)
  if not is_tensor(l_pooled) or not is_tensor(g_pooled) then
    error("sd3.pooled: needs CLIP-L's and bigG's pooled vectors (tensors)", 2)
  end
  return kiln.cat({ l_pooled, g_pooled }, 2)
end

--- T5 token ids for a prompt as ComfyUI's SD3 tokenizer gives them: the ids ending in
-- 1, padded with 0 to at least min_length (77).
function M.t5_ids(text, min_length)
  local t5 = require "kiln.t5"
  local ids = t5.tokenize(text)
  for i = #ids + 1, min_length or M.defaults.t5_length do ids[i] = 0 end
  return ids
end

--- A prompt -> context [1, 77k + n, 4096], y [1, 2048] with the checkpoint's encoders:
-- ckpt.clip (CLIP-L and bigG: clip:encode gives their states side by side and the two
-- pooled vectors concatenated) and ckpt.t5 when it is there (else 77 tokens of zeros).
-- opts: clip's encode options, t5_length (77).
function M.encode(ckpt, text, opts)
  opts = opts or {}
  local lg, pooled = ckpt.clip:encode(text, opts)
  if not pooled then
    lg:free()
    error("sd3.encode: the text encoders gave no pooled vector; SD 3.5 needs CLIP-L's and bigG's", 2)
  end
  local t5states
  local t5 = rawget(ckpt, "t5")
  if t5 and getmetatable(t5) and not tostring(t5):match("^missing") then
    local ids = M.t5_ids(text, opts.t5_length)
    local it = kiln.tensor({ ids }, "i64")
    t5states = t5:forward(it)
    it:free()
  end
  local ctx = M.context(lg, t5states, opts)
  lg:free()
  if t5states then t5states:free() end
  return ctx, pooled
end

-- ---------------------------------------------------------------- guidance

--- The denoise function kiln.sample.run calls, for one MMDiT and the positive / negative
-- conditioning ({context = [1, L, 4096], y = [1, 2048]} each; uncond nil with cfg 1):
-- denoised = uncond + (cond - uncond) * cfg (the reference's CFGDenoiser; both passes in
-- one batch), and with opts.skip_layer_guidance = {layers = {...} (0-based), scale,
-- start, stop} also + (cond - cond_skip) * scale where cond_skip is the positive pass
-- without those blocks. The window: ComfyUI's SkipLayerGuidanceSD3 (the sigma between
-- percent_to_sigma(start) and percent_to_sigma(stop)), or with window = "steps" the
-- reference's SkipLayerCFGDenoiser (step index strictly between start * steps and
-- stop * steps; opts.steps needed). opts: cfg (4.5), shift (3.0), skip_layer_guidance.
function M.denoiser(dit, cond, uncond, opts)
  opts = opts or {}
  local cfg = opts.cfg or M.defaults.cfg
  local ms = M.model_sampling(opts.shift)
  local slg = opts.skip_layer_guidance
  if slg then
    if type(slg.layers) ~= "table" or #slg.layers == 0 then
      error("sd3.denoiser: skip_layer_guidance.layers must list block indices (0-based)", 2)
    end
    if slg.window == "steps" and math.type(opts.steps) ~= "integer" then
      error("sd3.denoiser: skip_layer_guidance with window \"steps\" needs opts.steps", 2)
    end
  end
  if cfg ~= 1 and not uncond then error("sd3.denoiser: cfg ~= 1 needs the negative conditioning", 2) end
  local step = 0
  return function(x, sigma)
    local B = x.shape[1]
    local t = kiln.tensor({ M.timestep(sigma) })
    local out
    if cfg == 1 then
      local v = dit:forward(x, t, cond.context, cond.y)
      out = M.denoised(x, v, sigma)
      v:free()
    else
      -- positive and negative in one batch, as the reference
      local function both(a, b)
        local ea = a.shape[1] == B and a or a:expand({ B, table.unpack(a.shape, 2) })
        local eb = b.shape[1] == B and b or b:expand({ B, table.unpack(b.shape, 2) })
        return kiln.cat({ ea, eb }, 1)
      end
      local xx = kiln.cat({ x, x }, 1)
      local ctx, y = both(cond.context, uncond.context), both(cond.y, uncond.y)
      local v = dit:forward(xx, t, ctx, y)
      xx:free(); ctx:free(); y:free()
      local vp, vn = v:narrow(1, 1, B), v:narrow(1, B + 1, B)
      local dp, dn = M.denoised(x, vp, sigma), M.denoised(x, vn, sigma)
      vp:free(); vn:free(); v:free()
      local diff = dp - dn
      local sc = diff * cfg
      out = dn + sc
      diff:free(); sc:free(); dn:free()
      if slg and (slg.scale or 3.0) > 0 then
        local on
        if slg.window == "steps" then
          on = step > (slg.start or 0.01) * opts.steps and step < (slg.stop or 0.15) * opts.steps
        else
          local s_start, s_end = ms.percent_to_sigma(slg.start or 0.01), ms.percent_to_sigma(slg.stop or 0.15)
          on = sigma <= s_start and sigma >= s_end
        end
        if on then
          local vs = dit:forward(x, t, cond.context, cond.y, { skip_layers = slg.layers })
          local ds = M.denoised(x, vs, sigma)
          vs:free()
          local d2 = dp - ds
          local s2 = d2 * (slg.scale or 3.0)
          local o2 = out + s2
          out:free(); d2:free(); s2:free(); ds:free()
          out = o2
        end
      end
      dp:free()
    end
    t:free()
    step = step + 1
    return out
  end
end

-- ---------------------------------------------------------------- pipelines

local function is_missing(part)
  return part == nil or (getmetatable(part) ~= nil and tostring(part):match("^missing") ~= nil)
end

-- skip_layer_guidance = true: the variant's settings, else ComfyUI's SkipLayerGuidanceSD3
-- defaults (layers 7, 8, 9, scale 3, 1 % to 15 % of the schedule) on any variant, as the
-- node; a table: its fields over those defaults.
local function slg_options(ckpt, v)
  if v == nil or v == false then return nil end
  local d = (M.variants[ckpt.variant] or {}).skip_layer_guidance or M.variants.medium.skip_layer_guidance
  if v == true then v = {} end
  if type(v) ~= "table" then
    error("skip_layer_guidance must be true or a table {layers, scale, start, stop}, got " .. type(v), 0)
  end
  util.check_options(v, { layers = true, scale = true, start = true, stop = true }, "skip_layer_guidance", 0)
  local r = { layers = v.layers or d.layers, scale = v.scale or d.scale, start = v.start or d.start,
    stop = v.stop or d.stop }
  if type(r.layers) ~= "table" or #r.layers == 0 then
    error("skip_layer_guidance.layers must list block indices (0-based)", 0)
  end
  local depth = ckpt.dit.config.depth
  for _, i in ipairs(r.layers) do
    if math.type(i) ~= "integer" or i < 0 or i >= depth then
      error(fmt("skip_layer_guidance.layers: %s is not a block of this MMDiT (0 to %d)", tostring(i), depth - 1), 0)
    end
  end
  for _, k in ipairs({ "scale", "start", "stop" }) do
    if type(r[k]) ~= "number" then error(fmt("skip_layer_guidance.%s must be a number", k), 0) end
  end
  return r
end

--- Checks a run's SD 3.5 options (o: the caller's) and returns what the run uses:
-- {t5_length, skip_layer_guidance = {layers, scale, start, stop} or nil}. Flux's
-- distilled guidance is refused: SD 3.5 guides with CFG (cfg, negative).
function M.run_options(ckpt, o)
  if o.guidance ~= nil then
    error("guidance is Flux [dev]'s distilled guidance; SD 3.5 guides with cfg and the negative prompt", 0)
  end
  local n = o.t5_length or M.defaults.t5_length
  if math.type(n) ~= "integer" or n < 1 then
    error(fmt("t5_length must be a positive integer, got %s", tostring(o.t5_length)), 0)
  end
  return { t5_length = n, skip_layer_guidance = slg_options(ckpt, o.skip_layer_guidance) }
end

--- The conditioning of prompts for the pipelines: per prompt the context [1, 77 + n,
-- context width] (both CLIPs' penultimate states zero-padded to the width, then T5's
-- states of its ids padded to t5_length with 0, longer prompts kept whole as ComfyUI's
-- SD3 tokenizer; 77 tokens of zeros without a T5, as the reference's empty T5) and y
-- [1, 2048]. T5 (the largest) runs and is unloaded before the CLIPs load, and they are
-- unloaded after: the sampling has the device to itself. Returns two lists.
function M.encode_prompts(ckpt, prompts, t5_length, dev)
  local _ = ckpt.clip.encode -- a missing CLIP says which files to pass, before any work
  local width = ckpt.dit.config.context_dim
  local t5 = rawget(ckpt, "t5")
  if is_missing(t5) then t5 = nil end
  local t5s, ctx, pooled = {}, {}, {}
  local ok, err = pcall(function()
    if t5 then
      t5:load(dev)
      for i, p in ipairs(prompts) do
        local n = #require("kiln.t5").tokenize(p)
        t5s[i] = t5:encode(p, { length = math.max(t5_length, n) })
      end
      t5:unload()
    end
    ckpt.clip:load(dev)
    for i, p in ipairs(prompts) do
      local lg, pl = ckpt.clip:encode(p)
      if not pl then
        lg:free()
        error("SD 3.5: the text encoders gave no pooled vector; it needs CLIP-L's and bigG's", 0)
      end
      pooled[i] = pl
      ctx[i] = M.context(lg, t5s[i], { width = width, t5_tokens = t5_length })
      lg:free()
      if t5s[i] then t5s[i]:free(); t5s[i] = nil end
    end
    ckpt.clip:unload()
  end)
  if not ok then
    for _, t in pairs(t5s) do t:free() end
    for _, t in pairs(ctx) do t:free() end
    for _, t in pairs(pooled) do t:free() end
    if t5 then pcall(t5.unload, t5) end
    pcall(ckpt.clip.unload, ckpt.clip)
    error(err, 0)
  end
  return ctx, pooled
end

-- ---------------------------------------------------------------- names

-- diffusers' SD3Transformer2DModel module -> Stability AI's, per joint block N (x the
-- image stream, c the context stream); q / k / v go to rows of the fused qkv.
local function block_modules(b, cfg)
  local H = cfg.hidden
  local j = fmt("joint_blocks.%d.", b)
  local t = fmt("transformer_blocks.%d.", b)
  local list = {}
  local function add(d, sai, rows, swap) list[#list + 1] = { d, sai, rows, swap } end
  local last_pre = b == cfg.depth - 1 and cfg.pre_only_last
  add(t .. "norm1.linear", j .. "x_block.adaLN_modulation.1")
  -- the pre_only block's context norm is diffusers' AdaLayerNormContinuous: (scale,
  -- shift) where the reference has (shift, scale)
  add(t .. "norm1_context.linear", j .. "context_block.adaLN_modulation.1", nil, last_pre or nil)
  for i, q in ipairs({ "q", "k", "v" }) do
    add(t .. "attn.to_" .. q, j .. "x_block.attn.qkv", { (i - 1) * H + 1, H })
    add(t .. "attn.add_" .. q .. "_proj", j .. "context_block.attn.qkv", { (i - 1) * H + 1, H })
  end
  add(t .. "attn.to_out.0", j .. "x_block.attn.proj")
  if not last_pre then
    add(t .. "attn.to_add_out", j .. "context_block.attn.proj")
    add(t .. "ff_context.net.0.proj", j .. "context_block.mlp.fc1")
    add(t .. "ff_context.net.2", j .. "context_block.mlp.fc2")
  end
  add(t .. "ff.net.0.proj", j .. "x_block.mlp.fc1")
  add(t .. "ff.net.2", j .. "x_block.mlp.fc2")
  if cfg.qk_norm then
    add(t .. "attn.norm_q", j .. "x_block.attn.ln_q"); add(t .. "attn.norm_k", j .. "x_block.attn.ln_k")
    add(t .. "attn.norm_added_q", j .. "context_block.attn.ln_q")
    add(t .. "attn.norm_added_k", j .. "context_block.attn.ln_k")
  end
  if cfg.x_self_attn[b] then
    for i, q in ipairs({ "q", "k", "v" }) do
      add(t .. "attn2.to_" .. q, j .. "x_block.attn2.qkv", { (i - 1) * H + 1, H })
    end
    add(t .. "attn2.to_out.0", j .. "x_block.attn2.proj")
    if cfg.qk_norm then
      add(t .. "attn2.norm_q", j .. "x_block.attn2.ln_q"); add(t .. "attn2.norm_k", j .. "x_block.attn2.ln_k")
    end
  end
  return list
end

--- The module names of diffusers' SD3Transformer2DModel against Stability AI's, for an
-- MMDiT configuration (kiln.mmdit.config): a list of {diffusers module, SAI module,
-- rows = {first, count} of the SAI weight (q / k / v of a fused qkv) or nil, swap = true
-- where diffusers keeps the two halves (scale, shift) the other way round}.
function M.diffusers_modules(cfg)
  local list = {
    { "pos_embed.proj", "x_embedder.proj" },
    { "time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0" },
    { "time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2" },
    { "time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0" },
    { "time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2" },
    { "context_embedder", "context_embedder" },
  }
  for b = 0, cfg.depth - 1 do
    for _, e in ipairs(block_modules(b, cfg)) do list[#list + 1] = e end
  end
  list[#list + 1] = { "norm_out.linear", "final_layer.adaLN_modulation.1", nil, true }
  list[#list + 1] = { "proj_out", "final_layer.linear" }
  return list
end

--- LoRA module names -> {module = SAI module (relative to the MMDiT's root), rows =
-- {first, count} or nil}: kohya's (lora_unet_joint_blocks_0_x_block_attn_qkv), ComfyUI's
-- (diffusion_model.* / model.diffusion_model.*, the SAI names) and diffusers / PEFT's
-- (transformer.transformer_blocks.0.attn.to_q, also bare, and kohya-style
-- lora_transformer_* names of them), q / k / v to rows of the fused weights. Modules
-- whose halves diffusers swaps (the final norm, the pre_only context norm) are left
-- out of the diffusers names: a LoRA's delta on them would land on the wrong halves.
function M.lora_names(cfg)
  local mmdit = require "kiln.mmdit"
  local map = {}
  local function put(alias, module, rows)
    if not map[alias] then map[alias] = { module = module, rows = rows } end
  end
  for _, e in ipairs(mmdit.expected(cfg)) do
    local mod = e[1]:match("^(.*)%.weight$")
    if mod and #e[2] >= 2 then
      put("lora_unet_" .. mod:gsub("%.", "_"), mod)
      put("diffusion_model." .. mod, mod)
      put("model.diffusion_model." .. mod, mod)
      put(mod, mod)
    end
  end
  for _, e in ipairs(M.diffusers_modules(cfg)) do
    local d, sai, rows, swap = e[1], e[2], e[3], e[4]
    if not swap and not sai:match("%.ln_[qk]$") then
      put("transformer." .. d, sai, rows)
      put(d, sai, rows)
      put("lora_transformer_" .. d:gsub("%.", "_"), sai, rows)
    end
  end
  return map
end

-- ---------------------------------------------------------------- diffusers transformer

-- diffusers module (below transformer_blocks.N.) -> kiln.mmdit's; q / k / v stay apart
-- (kiln.mmdit's split form)
local DIFFUSERS_BLOCK = {
  ["norm1.linear"] = "x_block.adaLN_modulation.1", ["norm1_context.linear"] = "context_block.adaLN_modulation.1",
  ["attn.to_q"] = "x_block.attn.q", ["attn.to_k"] = "x_block.attn.k", ["attn.to_v"] = "x_block.attn.v",
  ["attn.add_q_proj"] = "context_block.attn.q", ["attn.add_k_proj"] = "context_block.attn.k",
  ["attn.add_v_proj"] = "context_block.attn.v",
  ["attn.to_out.0"] = "x_block.attn.proj", ["attn.to_add_out"] = "context_block.attn.proj",
  ["attn.norm_q"] = "x_block.attn.ln_q", ["attn.norm_k"] = "x_block.attn.ln_k",
  ["attn.norm_added_q"] = "context_block.attn.ln_q", ["attn.norm_added_k"] = "context_block.attn.ln_k",
  ["attn2.to_q"] = "x_block.attn2.q", ["attn2.to_k"] = "x_block.attn2.k", ["attn2.to_v"] = "x_block.attn2.v",
  ["attn2.to_out.0"] = "x_block.attn2.proj", ["attn2.norm_q"] = "x_block.attn2.ln_q",
  ["attn2.norm_k"] = "x_block.attn2.ln_k",
  ["ff.net.0.proj"] = "x_block.mlp.fc1", ["ff.net.2"] = "x_block.mlp.fc2",
  ["ff_context.net.0.proj"] = "context_block.mlp.fc1", ["ff_context.net.2"] = "context_block.mlp.fc2",
}
local DIFFUSERS_TOP = {
  ["pos_embed.proj"] = "x_embedder.proj",
  ["time_text_embed.timestep_embedder.linear_1"] = "t_embedder.mlp.0",
  ["time_text_embed.timestep_embedder.linear_2"] = "t_embedder.mlp.2",
  ["time_text_embed.text_embedder.linear_1"] = "y_embedder.mlp.0",
  ["time_text_embed.text_embedder.linear_2"] = "y_embedder.mlp.2",
  ["context_embedder"] = "context_embedder",
  ["norm_out.linear"] = "final_layer.adaLN_modulation.1", ["proj_out"] = "final_layer.linear",
}

--- A diffusers SD3Transformer2DModel's tensor name -> kiln.mmdit's (split q / k / v),
-- or nil for a name it does not read.
function M.from_diffusers(name)
  if name == "pos_embed.pos_embed" then return "pos_embed" end
  local n, rest = name:match("^transformer_blocks%.(%d+)%.(.*)$")
  local mod, what
  if n then
    mod, what = rest:match("^(.*)%.(%a+)$")
    local to = mod and DIFFUSERS_BLOCK[mod]
    return to and fmt("joint_blocks.%s.%s.%s", n, to, what) or nil
  end
  mod, what = name:match("^(.*)%.(%a+)$")
  local to = mod and DIFFUSERS_TOP[mod]
  return to and (to .. "." .. what) or nil
end

local TO_BLOCK, TO_TOP = {}, {}
for d, k in pairs(DIFFUSERS_BLOCK) do TO_BLOCK[k] = d end
for d, k in pairs(DIFFUSERS_TOP) do TO_TOP[k] = d end

--- The inverse: kiln.mmdit's name (split q / k / v) -> diffusers', or nil.
function M.to_diffusers(name)
  if name == "pos_embed" then return "pos_embed.pos_embed" end
  local n, rest = name:match("^joint_blocks%.(%d+)%.(.*)$")
  local mod, what
  if n then
    mod, what = rest:match("^(.*)%.(%a+)$")
    local to = mod and TO_BLOCK[mod]
    return to and fmt("transformer_blocks.%s.%s.%s", n, to, what) or nil
  end
  mod, what = name:match("^(.*)%.(%a+)$")
  local to = mod and TO_TOP[mod]
  return to and (to .. "." .. what) or nil
end

--- The layout of a diffusers SD3Transformer2DModel's tensors below prefix p as the
-- checkpoint loader reads a transformer: {map = kiln.mmdit name -> stored name,
-- config_opts = {diffusers = true}} (kiln.mmdit reads q / k / v apart and the swapped
-- halves as they are).
function M.diffusers_layout(shapes, p)
  p = p or ""
  local map = {}
  for real in pairs(shapes) do
    if real:sub(1, #p) == p then
      local n = M.from_diffusers(real:sub(#p + 1))
      if n then map[n] = real end
    end
  end
  return { map = map, config_opts = { diffusers = true } }
end

--- What a diffusers transformer's config.json says that the shapes do not: the heads.
function M.diffusers_meta(cj)
  local meta = {}
  if type(cj) ~= "table" then return meta end
  local heads = math.tointeger(mf.json_number(cj, "num_attention_heads"))
  if heads then meta["kiln.mmdit.heads"] = tostring(heads) end
  return meta
end

--- A diffusers transformer (the transformer/ folder of an SD 3.5 pipeline folder, or its
-- diffusion_pytorch_model.safetensors) as the checkpoint's `dit` part: the same network
-- over diffusers' tensors, read in place (q / k / v as three products, the swapped
-- halves taken as they are).
function M.load_diffusers_transformer(path)
  local mmdit = require "kiln.mmdit"
  local part = require "kiln.part"
  local stream = require "kiln.stream"
  local who = "kiln.load_checkpoint"
  local files
  if mf.is_dir(path) then
    files = mf.diffusers_files(path, "diffusion_pytorch_model", who)
    if not files then
      util.file_error(who, path, "not a diffusers transformer folder: no diffusion_pytorch_model.safetensors " ..
        "(or sharded index) inside")
    end
  else
    files = { path }
  end
  local src = mf.multi_source(files, nil, who)
  local map, shapes = {}, {}
  for real, shape in pairs(src.shapes) do
    local n = M.from_diffusers(real)
    if n then map[n], shapes[n] = real, shape end
  end
  local ok, cfg = pcall(mmdit.config, shapes, src.meta, { diffusers = true })
  if not ok then util.file_error(who, files[1], tostring(cfg)) end
  local exp = mmdit.expected(cfg)
  -- a tensor the folder lacks is named as diffusers names it
  local resolve = function(n) return map[n] or M.to_diffusers(n) or n end
  mf.validate(files[1], "SD 3.5 transformer (diffusers)", exp, resolve, src.shapes)
  local store = mf.open_store(files, mf.names_of(exp, resolve), "dit")
  return part.as_model(mmdit.new(stream.weights(store, "", map), cfg), store, "DiT"), cfg
end

return M
