-- kiln.comfy.image: ComfyUI's "image" and "mask" nodes: loading pictures and masks from
-- the input folder, scaling, outpaint padding, an upscale model, and the output nodes
-- (SaveImage, PreviewImage). Input specs from nodes.py and comfy_extras.
local kiln = require "kiln"
local inpaint = require "kiln.inpaint"
local registry = require "kiln.comfy.registry"
local V = require "kiln.comfy.values"

local M = {}
-- the node definitions, by name (registered at the end)
M.nodes = {}
local N = M.nodes
local MAX = V.MAX_RESOLUTION
local image_value, mask_value, pyround = V.image, V.mask, V.pyround

N.LoadImage = {
  category = "image",
  inputs = { { "image", "FILE:input" } },
  outputs = { "IMAGE", "MASK" },
  run = function(ctx, a)
    local t = kiln.load_png(a.image)
    local c = t.shape[2]
    local img
    if c >= 3 then img = t:narrow(2, 1, 3):contiguous()
    else img = kiln.cat({ t:narrow(2, 1, 1), t:narrow(2, 1, 1), t:narrow(2, 1, 1) }, 2) end
    -- the mask: 1 - alpha where the file has alpha, else 64 x 64 zeros (ComfyUI's)
    local m = (c == 2 or c == 4) and inpaint.mask_of_png(t) or kiln.zeros({ 1, 1, 64, 64 })
    t:free()
    return { image_value(ctx, img), mask_value(ctx, m) }
  end,
}

N.LoadImageMask = {
  category = "mask",
  inputs = { { "image", "FILE:input" }, { "channel", { "alpha", "red", "green", "blue" } } },
  outputs = { "MASK" },
  run = function(ctx, a)
    local t = kiln.load_png(a.image)
    local c = t.shape[2]
    local idx = ({ red = 1, green = 2, blue = 3, alpha = (c == 2 or c == 4) and c or nil })[a.channel]
    if c < 3 and a.channel ~= "alpha" then idx = 1 end
    local m
    if not idx then
      m = kiln.zeros({ 1, 1, 64, 64 })  -- alpha asked of a picture without one (ComfyUI's)
    else
      m = t:narrow(2, idx, 1):contiguous()
      if a.channel == "alpha" then local r = 1 - m; m:free(); m = r end
    end
    t:free()
    return { mask_value(ctx, m) }
  end,
}

N.ImageScale = {
  category = "image/upscaling",
  inputs = { { "image", "IMAGE" }, { "upscale_method", V.IMAGE_METHODS },
    { "width", "INT", default = 512, min = 0, max = MAX, step = 1 },
    { "height", "INT", default = 512, min = 0, max = MAX, step = 1 }, { "crop", V.CROP_METHODS } },
  outputs = { "IMAGE" },
  run = function(ctx, a)
    local t = a.image.t
    local h0, w0 = t.shape[3], t.shape[4]
    local w, h = a.width, a.height
    if w == 0 and h == 0 then w, h = w0, h0
    elseif w == 0 then w = math.max(1, pyround(w0 * h / h0))
    elseif h == 0 then h = math.max(1, pyround(h0 * w / w0)) end
    return { image_value(ctx, V.resize(t, w, h, a.upscale_method, a.crop)) }
  end,
}

N.ImageScaleBy = {
  category = "image/upscaling",
  inputs = { { "image", "IMAGE" }, { "upscale_method", V.IMAGE_METHODS },
    { "scale_by", "FLOAT", default = 1.0, min = 0.01, max = 8.0, step = 0.01 } },
  outputs = { "IMAGE" },
  run = function(ctx, a)
    local t = a.image.t
    local w, h = pyround(t.shape[4] * a.scale_by), pyround(t.shape[3] * a.scale_by)
    return { image_value(ctx, V.resize(t, w, h, a.upscale_method)) }
  end,
}

local function pad(name) return { name, "INT", default = 0, min = 0, max = MAX, step = 8 } end

N.ImagePadForOutpaint = {
  category = "image",
  inputs = { { "image", "IMAGE" }, pad("left"), pad("top"), pad("right"), pad("bottom"),
    { "feathering", "INT", default = 40, min = 0, max = MAX, step = 1 } },
  outputs = { "IMAGE", "MASK" },
  run = function(ctx, a)
    local img, m = inpaint.outpaint_pad(V.to_cpu(a.image.t), { left = a.left, top = a.top, right = a.right,
      bottom = a.bottom, feather = a.feathering })
    return { image_value(ctx, img), mask_value(ctx, m) }
  end,
}

N.ImageUpscaleWithModel = {
  category = "image/upscaling",
  inputs = { { "upscale_model", "UPSCALE_MODEL" }, { "image", "IMAGE" } },
  outputs = { "IMAGE" },
  run = function(ctx, a)
    local up = V.use(ctx, a.upscale_model.up)
    return { image_value(ctx, up:upscale(a.image.t, { tile = 512, overlap = 32 })) }
  end,
}

-- SaveImage: PREFIX_00001_.png, ... in the output folder (a prefix may name a
-- sub-folder), numbered after the highest number already there, each with the
-- workflow's API JSON in its `prompt` text chunk
N.SaveImage = {
  category = "image",
  inputs = { { "images", "IMAGE" }, { "filename_prefix", "STRING", default = "ComfyUI" } },
  outputs = {},
  output = true,
  run = function(ctx, a)
    local t = a.images.t
    if ctx.dry then return {} end   -- a dry run (shapes only) writes nothing
    for i = 1, t.shape[1] do
      local one = t:narrow(1, i, 1)
      local c, copied = V.to_cpu(one)
      local path = ctx:next_output(a.filename_prefix)
      local cl = c:clamp(0, 1)
      kiln.save_png(cl, path, { text = { prompt = ctx.prompt_text } })
      cl:free()
      if copied then c:free() end
      ctx.files[#ctx.files + 1] = path
    end
    return {}
  end,
}

-- PreviewImage: ComfyUI shows it in the browser and keeps it in a temporary folder;
-- kiln keeps nothing (the run's result lists its shape)
N.PreviewImage = {
  category = "image",
  inputs = { { "images", "IMAGE" } },
  outputs = {},
  output = true,
  run = function(ctx, a)
    ctx.previews[#ctx.previews + 1] = { node = ctx.node_id, shape = a.images.t.shape }
    return {}
  end,
}

for name, def in pairs(N) do registry.add_node(name, def) end
return M
