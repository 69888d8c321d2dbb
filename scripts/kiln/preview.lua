-- kiln.preview: pictures of a sampling in progress. Two previewers turn the sampler's
-- current prediction of the clean latents (the denoised x0 of a step) into RGB: a
-- linear projection per family (latent2rgb: one 1x1 convolution, free) and TAESD (a
-- tiny decoder, kiln.taesd: real pixels at full size for a few percent of a step).
-- preview.session is the pipelines' hook: every N steps it hands the picture to the
-- script's preview function, writes the CLI's --preview file (atomically, so a viewer
-- never reads half a PNG), and gives it to an embedding host (kiln.h's preview
-- callback, through kiln.preview_image). TAESD's decode may run in its own precision
-- (preview_precision, scoped to the preview with kiln.with_precision): a preview is a
-- throwaway picture, so by default it takes bf16 where the CPU has native bf16 products.
local kiln = require "kiln"
local nn = kiln.nn

local M = {}
local fmt = string.format

-- Latent -> RGB factors (rows: latent channels; columns: R, G, B) and biases of the
-- scaled latents samplers work on, as ComfyUI's Latent2RGB previewer takes them from
-- comfy/latent_formats.py (classes SD15 and SDXL; SD 2.x uses SD15's): fitted by
-- least squares of VAE-decoded pictures on their latents. The previewer's output
-- (rgb + 1) / 2 clamped to [0, 1] follows its preview_to_image.
M.FACTORS = {
  sd1 = {
    factors = {
      { 0.3512, 0.2297, 0.3227 },
      { 0.3250, 0.4974, 0.2350 },
      { -0.2829, 0.1762, 0.2721 },
      { -0.2120, -0.2616, -0.7177 },
    },
    bias = { 0, 0, 0 },
  },
  sdxl = {
    factors = {
      { 0.3651, 0.4232, 0.4341 },
      { -0.2533, -0.0042, 0.1068 },
      { 0.1076, 0.1111, -0.0362 },
      { -0.3165, -0.2492, -0.2188 },
    },
    bias = { 0.1084, -0.0175, -0.0011 },
  },
}
M.FACTORS.sd2 = M.FACTORS.sd1

-- The projection as a 1x1 convolution with (rgb + 1) / 2 folded in: weight [3, C, 1, 1]
-- = factors^T / 2, bias (b + 1) / 2; one per family and device, kept while in use.
-- weak: a projection no preview holds goes with the collector, as the state's other tensors do
local conv_cache = setmetatable({}, { __mode = "v" })
local function projection(family, device)
  local key = family .. "@" .. device
  local c = conv_cache[key]
  if c then return c end
  local f = M.FACTORS[family]
  if not f then
    error(fmt("kiln.preview: no latent->RGB factors for family '%s' (known: sd1, sd2, sdxl)", tostring(family)), 3)
  end
  local w, b = {}, {}
  for r = 1, 3 do
    w[r] = {}
    for ch = 1, #f.factors do w[r][ch] = { { f.factors[ch][r] / 2 } } end
    b[r] = (f.bias[r] + 1) / 2
  end
  local wt, bt = kiln.tensor(w), kiln.tensor(b)
  if device ~= "cpu" then
    local a, d = wt:to(device), bt:to(device)
    wt:free(); bt:free()
    wt, bt = a, d
  end
  c = { weight = wt, bias = bt, channels = #f.factors }
  conv_cache[key] = c
  return c
end

--- preview.latent2rgb(z, family [, {scale = s}]) -> [B, 3, h*s, w*s] in [0, 1] on z's
-- device: z [B, 4, h, w] scaled latents (as samplers produce them); scale upsamples
-- (nearest, a whole number; default 1).
function M.latent2rgb(z, family, opts)
  if type(z) ~= "userdata" or #z.shape ~= 4 then
    error("kiln.preview.latent2rgb: z must be latents [B, C, h, w]", 2)
  end
  local p = projection(family or "sd1", z.device)
  if z.shape[2] ~= p.channels then
    error(fmt("kiln.preview.latent2rgb: %s latents have %d channels, got [%s]", tostring(family), p.channels,
      table.concat(z.shape, ", ")), 2)
  end
  local zf = z.dtype ~= "f32" and z:to("f32") or nil
  local y = nn.conv2d(zf or z, p.weight, p.bias)
  if zf then zf:free() end
  local img = y:clamp(0, 1)
  y:free()
  local s = opts and opts.scale or 1
  if s ~= 1 then
    if math.type(s) ~= "integer" or s < 1 then
      error("kiln.preview.latent2rgb: scale must be a whole number >= 1, got " .. tostring(s), 2)
    end
    local u = nn.upsample_nearest(img, s)
    img:free()
    img = u
  end
  return img
end

-- ---------------------------------------------------------------- the pipelines' hook

local NOOP = setmetatable({ active = false }, { __call = function() end, __close = function() end })

local function check(o)
  local p = o.preview
  if p ~= nil and p ~= false and type(p) ~= "function" and type(p) ~= "string" then
    error("kiln.pipeline: preview must be a function(step, total, image) or a PNG file name, got " .. type(p), 4)
  end
  local e = o.preview_every
  if e ~= nil and (math.type(e) ~= "integer" or e < 1) then
    error("kiln.pipeline: preview_every must be a whole number >= 1, got " .. tostring(e), 4)
  end
  local v = o.previewer
  if v ~= nil and v ~= false and v ~= "latent2rgb" and v ~= "taesd" and not (type(v) == "table" and v.is_taesd) then
    error(fmt("kiln.pipeline: previewer must be \"latent2rgb\", \"taesd\", a TAESD (kiln.load_taesd) or false, got %s",
      type(v) == "string" and ("'" .. v .. "'") or type(v)), 4)
  end
  local pp = o.preview_precision
  if pp ~= nil and not M.PRECISIONS[pp] then
    error(fmt("kiln.pipeline: preview_precision must be \"f32\", \"bf16\", \"f16\" or \"run\", got %s",
      type(pp) == "string" and ("'" .. pp .. "'") or type(pp)), 4)
  end
end

-- ---------------------------------------------------------------- TAESD's precision

-- The values of the option preview_precision: a precision, or "run" (the run's own).
M.PRECISIONS = { f32 = true, bf16 = true, f16 = true, run = true }

--- preview.precision_for(option, device) -> "f32" | "bf16" | "f16" | "run": the
-- precision a TAESD preview decodes in on device (where its decoder computes): the
-- option when given, else "bf16" when the decode runs on the CPU's kernels (cpu, sim)
-- and the CPU has native bf16 products (kiln.cpu_has_bf16: bf16 halves the products'
-- cost there, and a preview is a throwaway picture), else "run": the run's own
-- precision (on a GPU that is already a half one; an emulated bf16 is no faster).
function M.precision_for(option, device)
  if option ~= nil then return option end
  local host = device == nil or device == "cpu" or device == "sim"
  return host and kiln.cpu_has_bf16() and "bf16" or "run"
end

-- The TAESD of a run's previews: the option's object, the checkpoint's VAE when it is
-- one, else found beside the checkpoint (kiln.taesd.find, once per checkpoint).
local function preview_taesd(ckpt, v)
  if type(v) == "table" then return v end
  local vae = rawget(ckpt, "vae")
  if vae and vae.is_taesd and vae.decoder_half then return vae end
  return require("kiln.taesd").cached(ckpt, "taesd")
end

--- preview.session(ckpt, o [, device]) -> a callable hook (hook(st) after each sampler
-- step st = {i, n, denoised, ...}) to close when sampling ends. o: preview (a function
-- (step, total, image) whose image [B, 3, H, W] is freed after it returns, or a PNG
-- path written with the first image), preview_every (N, default 1: steps N, 2N, ...
-- and the last), previewer ("latent2rgb" default | "taesd" | a TAESD | false: none),
-- preview_precision (TAESD's decode: "f32" | "bf16" | "f16" | "run"; default
-- preview.precision_for's; the run's VAE, TAESD included, is not affected).
-- The embedding host's callback (kiln_set_preview) is fed by the same hook, every N
-- of its own steps. No preview wanted: a no-op hook.
function M.session(ckpt, o, device)
  check(o)
  local host_every = kiln.preview_every and kiln.preview_every() or nil
  local fn = o.preview
  if fn == false then fn = nil end
  if o.previewer == false or (fn == nil and not host_every) then return NOOP end
  local every = o.preview_every or 1
  local v = o.previewer or "latent2rgb"
  local t, loaded
  if v ~= "latent2rgb" then
    t = preview_taesd(ckpt, v)
    if device and (t.decoder_half.model.device or "cpu") ~= device then
      t.decoder_half.model:load(device)
      loaded = true
    end
  end
  local family = ckpt.family
  local function decode(z)
    -- a tileable run's previews wrap around as its decode does
    if not o.tileable then return t:decode(z) end
    local use <close> = require("kiln.seamless").use({ t }, o.tileable, "kiln.pipeline: tileable")
    return t:decode(z)
  end
  local function picture(z)
    if not t then return M.latent2rgb(z, family) end
    -- where the decoder computes now (it may have been evicted or streamed since)
    local half = t.decoder_half
    local p = M.precision_for(o.preview_precision, half.weights:device(half.probe))
    if p == "run" then return decode(z) end
    -- the scope ends with the decode, also on an error: the script's preview function
    -- and the rest of the run keep the run's precision
    return kiln.with_precision(p, decode, z)
  end
  local hook = { active = true }
  local mt = {}
  mt.__call = function(_, st)
    local i, n = st.i, st.n
    local mine = fn and (i % every == 0 or i == n)
    local host = host_every and (i % host_every == 0 or i == n)
    if not (mine or host) then return end
    local img = picture(st.denoised or st.x)
    local ok, err = pcall(function()
      if mine and type(fn) == "function" then fn(i, n, img) end
      if mine and type(fn) == "string" then
        local first = img.shape[1] == 1 and img or img:narrow(1, 1, 1)
        kiln.save_png(first, fn)
        if first ~= img then first:free() end
      end
      if host then kiln.preview_image(i, n, img) end
    end)
    img:free()
    if not ok then error(err, 0) end
  end
  mt.__close = function()
    if loaded then t.decoder_half.model:unload() end
  end
  return setmetatable(hook, mt)
end

return M
