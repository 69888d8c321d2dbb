-- kiln.comfy.vae: ComfyUI's VAE nodes: decode and encode, whole or tiled, and the
-- inpainting encode. Pixels are cropped about the centre to the VAE's own factor as
-- ComfyUI's VAE.encode does. The tiled nodes take ComfyUI's arguments with ComfyUI's
-- arithmetic (M.decode_tiles / M.encode_tiles); the tiles themselves are kiln's (image-wide
-- GroupNorm statistics, so a tiled result equals the whole one where ComfyUI's average
-- of three feathered tilings only approaches it).
local inpaint = require "kiln.inpaint"
local registry = require "kiln.comfy.registry"
local V = require "kiln.comfy.values"

local M = {}
local fmt = string.format
-- the node definitions, by name (registered at the end)
M.nodes = {}
local N = M.nodes

--- VAEDecodeTiled's tiles in latent units, as ComfyUI's nodes.py computes them:
--   if tile_size < overlap * 4: overlap = tile_size // 4
--   compression = vae.spacial_compression_decode()
--   decode_tiled(tile_x = tile_size // compression, overlap = overlap // compression)
function M.decode_tiles(tile_size, overlap, compression)
  if tile_size < overlap * 4 then overlap = tile_size // 4 end
  return tile_size // compression, overlap // compression
end

--- VAEEncodeTiled's tiles in latent units, or nil for a whole run. ComfyUI hands
-- tile_size and overlap to encode_tiled in pixels, unchanged, and averages three
-- tilings (tile x tile, 2 tile x tile/2, tile/2 x 2 tile) whose positions step by
-- tile - overlap; a halved tile's step is not positive once overlap >= tile_size / 2,
-- which ComfyUI cannot run (a zero step raises, a negative one leaves the output 0/0)
-- unless the picture fits in a halved tile. kiln's tiles are the same pixels in latent
-- units (// the VAE's factor); an image that fits one tile runs whole, as ComfyUI's.
-- Returns tile, overlap (latent units) or nil, or nil plus the reason it cannot run.
function M.encode_tiles(tile_size, overlap, compression, h, w)
  if (h > tile_size // 2 or w > tile_size // 2) and overlap * 2 >= tile_size then
    return nil, fmt("overlap %d must be below tile_size / 2 (%d) for a %dx%d picture: ComfyUI averages three tilings, "
      .. "one with half the tile, each stepping by tile - overlap", overlap, tile_size // 2, w, h)
  end
  local tile, ov = tile_size // compression, overlap // compression
  if tile >= math.max(h, w) // compression then return nil end
  -- only rounding can bring the overlap to half a tile here (kiln's tiler needs below)
  return tile, math.min(ov, (tile - 1) // 2)
end

local function decode(ctx, a, topts)
  local vae = V.use(ctx, a.vae.part)
  return { V.image(ctx, vae:decode(a.samples.samples, topts)) }
end

-- pixels as ComfyUI's VAE.encode takes them: RGB, cropped to the VAE's factor
local function pixels(vae, px) return V.crop_to(V.rgb(px), V.compression(vae.part)) end

local function encode_px(ctx, vae, px, topts)
  V.use(ctx, vae.part)
  return vae.part:encode(px:contiguous(), topts)
end

N.VAEDecode = {
  category = "latent",
  inputs = { { "samples", "LATENT" }, { "vae", "VAE" } },
  outputs = { "IMAGE" },
  run = function(ctx, a) return decode(ctx, a) end,
}

-- the temporal inputs are for video VAEs (ComfyUI: temporal_compression_decode() is
-- None for an image VAE, and they go unused); kiln has none: checked, then unused
local function temporal()
  return { "temporal_size", "INT", default = 64, min = 8, max = 4096, step = 4 },
    { "temporal_overlap", "INT", default = 8, min = 4, max = 4096, step = 4 }
end

N.VAEDecodeTiled = {
  category = "_for_testing",
  inputs = { { "samples", "LATENT" }, { "vae", "VAE" },
    { "tile_size", "INT", default = 512, min = 64, max = 4096, step = 32 },
    { "overlap", "INT", default = 64, min = 0, max = 4096, step = 32 }, temporal() },
  outputs = { "IMAGE" },
  run = function(ctx, a)
    local tile, overlap = M.decode_tiles(a.tile_size, a.overlap, V.compression(a.vae.part))
    return decode(ctx, a, { tile = tile, overlap = overlap })
  end,
}

N.VAEEncode = {
  category = "latent",
  inputs = { { "pixels", "IMAGE" }, { "vae", "VAE" } },
  outputs = { "LATENT" },
  run = function(ctx, a) return { V.latent(ctx, encode_px(ctx, a.vae, pixels(a.vae, a.pixels.t))) } end,
}

N.VAEEncodeTiled = {
  category = "_for_testing",
  inputs = { { "pixels", "IMAGE" }, { "vae", "VAE" },
    { "tile_size", "INT", default = 512, min = 64, max = 4096, step = 64 },
    { "overlap", "INT", default = 64, min = 0, max = 4096, step = 32 }, temporal() },
  outputs = { "LATENT" },
  run = function(ctx, a)
    local px = pixels(a.vae, a.pixels.t)
    local tile, overlap = M.encode_tiles(a.tile_size, a.overlap, V.compression(a.vae.part), px.shape[3], px.shape[4])
    if not tile and overlap then V.fail(ctx, overlap) end
    return { V.latent(ctx, encode_px(ctx, a.vae, px, tile and { tile = tile, overlap = overlap } or nil)) }
  end,
}

N.VAEEncodeForInpaint = {
  category = "latent/inpaint",
  inputs = { { "pixels", "IMAGE" }, { "vae", "VAE" }, { "mask", "MASK" },
    { "grow_mask_by", "INT", default = 6, min = 0, max = 64, step = 1 } },
  outputs = { "LATENT" },
  run = function(ctx, a)
    local px = pixels(a.vae, a.pixels.t):contiguous()
    local m = V.mask_at(a.mask.t, px.shape[3], px.shape[4])
    local grey = inpaint.grey_fill(px, m)
    local grown = inpaint.grow_mask(m, a.grow_mask_by)
    m:free()
    V.use(ctx, a.vae.part)
    local z = a.vae.part:encode(grey)
    grey:free()
    return { V.latent(ctx, z, grown) }
  end,
}

for name, def in pairs(N) do registry.add_node(name, def) end
return M
