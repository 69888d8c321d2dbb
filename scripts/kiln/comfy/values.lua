-- kiln.comfy.values: what travels on a graph's links, shared by the topic files. A value
-- is a table {type = T, ...}; the tensors and models it holds are listed in v.tensors
-- and v.res, which kiln.comfy counts so that a tensor is freed and a model unloaded when
-- the last value holding it dies (ctx:value makes them). Also the helpers more than one
-- topic needs: a node's error, LoRAs for one use, ComfyUI's scale methods.
local kiln = require "kiln"
local image = require "kiln.image"

local M = {}
local fmt = string.format

--- Raises msg for the node running now ("node ID (CLASS): msg").
function M.fail(ctx, msg) error(fmt("%s: %s", ctx.where, msg), 0) end

--- t on the host: (t, false) when it is there already, else (a copy, true).
function M.to_cpu(t)
  if t.device == "cpu" then return t, false end
  return t:to("cpu"), true
end

--- The model behind a value, loaded to the run's device for this node.
function M.use(ctx, part) ctx:use(part) return part end

-- ------------------------------------------------------------------ values

function M.image(ctx, t) return ctx:value("IMAGE", { t = t }, { t }) end

function M.mask(ctx, t) return ctx:value("MASK", { t = t }, { t }) end

function M.latent(ctx, samples, mask, extra)
  local fields = { samples = samples, noise_mask = mask }
  for k, v in pairs(extra or {}) do fields[k] = v end
  return ctx:value("LATENT", fields, { samples, mask })
end

--- ComfyUI's conditioning: a list of entries {cond [1, L, dim], pooled, ...}; an entry
-- is a table {cond =, pooled =, control = {...}, size = {...}, concat_latent =, concat_mask =,
-- reference_latents = {...}}
function M.conditioning(ctx, entries)
  local tensors = {}
  for _, e in ipairs(entries) do
    e.control = e.control or {}
    for _, k in ipairs({ "cond", "pooled", "concat_latent", "concat_mask" }) do
      if e[k] then tensors[#tensors + 1] = e[k] end
    end
    for _, c in ipairs(e.control or {}) do tensors[#tensors + 1] = c.image end
    for _, r in ipairs(e.reference_latents or {}) do tensors[#tensors + 1] = r end  -- ReferenceLatent's
  end
  local res = {}
  for _, e in ipairs(entries) do
    for _, c in ipairs(e.control or {}) do res[#res + 1] = c.net end
  end
  return ctx:value("CONDITIONING", { entries = entries }, tensors, res)
end

--- A conditioning entry copied (its control list too), for a node that changes it.
function M.copy_entry(e)
  local r = {}
  for k, v in pairs(e) do r[k] = v end
  r.control = {}
  for i, c in ipairs(e.control or {}) do r.control[i] = c end
  return r
end

-- ------------------------------------------------------------------ LoRAs

-- A LoRA on a checkpoint for one use (a handle to remove after). A part loaded alone
-- (UNETLoader, CLIPLoader) has nothing for the other part's keys: a LoRA of only those
-- changes nothing there, as in ComfyUI, instead of failing for matching no weight.
local NO_HANDLE = { remove = function() end }
function M.add_lora(ckpt, path, o)
  local alone = not (rawget(ckpt, "unet") and rawget(ckpt, "clip"))
  if not alone then return ckpt:add_lora(path, o) end
  local ok, h = pcall(ckpt.add_lora, ckpt, path, o)
  if ok then return h end
  if tostring(h):match("none of its %d+ keys matches a weight") then return NO_HANDLE end
  error(h, 0)
end

-- ------------------------------------------------------------------ pixels for a VAE

--- The VAE's spatial compression (ComfyUI's spacial_compression_decode / _encode): its
-- factor, 8 for SD's and a TAESD, whatever a test model has.
function M.compression(vae)
  local f = vae.factor or (vae.config and vae.config.factor) or 8
  return math.tointeger(f) or math.floor(f)
end

--- Pixels cropped about the centre to a multiple of f (ComfyUI's vae_encode_crop_pixels).
function M.crop_to(t, f)
  local h, w = t.shape[3], t.shape[4]
  local hf, wf = (h // f) * f, (w // f) * f
  if hf == h and wf == w then return t end
  return t:narrow(3, (h % f) // 2 + 1, hf):narrow(4, (w % f) // 2 + 1, wf)
end

--- The RGB channels of a picture (ComfyUI's pixels[:, :, :, :3]).
function M.rgb(t) return t.shape[2] == 3 and t or t:narrow(2, 1, 3) end

--- A mask at the pixels' size (bilinear, as ComfyUI's interpolate of the mask); new.
function M.mask_at(m, h, w)
  if m.shape[3] == h and m.shape[4] == w then return m:clone() end
  return kiln.nn.interpolate(m, { size = { h, w }, mode = "bilinear" })
end

-- ------------------------------------------------------------------ scaling

-- The upscale_method names each kind of node takes, as ComfyUI lists them: latents
-- have bislerp, pictures lanczos (Pillow's, on 8 bits); kiln.image.resize computes all
M.LATENT_METHODS = { "nearest-exact", "bilinear", "area", "bicubic", "bislerp" }
M.IMAGE_METHODS = { "nearest-exact", "bilinear", "area", "bicubic", "lanczos" }
M.CROP_METHODS = { "disabled", "center" }

--- common_upscale of ComfyUI (kiln.image.resize) for latents and images alike; the
-- method was checked against the node's list before the run.
function M.resize(t, w, h, method, crop)
  return image.resize(t, w, h, { mode = method, crop = crop or "disabled" })
end

--- ComfyUI rounds a scaled size to the nearest whole number (Python's round).
M.pyround = require("kiln.util").round_half_even

--- ComfyUI's MAX_RESOLUTION (nodes.py): the largest width, height or offset a node takes.
M.MAX_RESOLUTION = 16384

return M
