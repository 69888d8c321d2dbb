-- examples/embed/art_tool.lua - the Lua side of the art tool host
-- (examples/embed/art_tool.c). Defines the global generate(prompt, steps, size,
-- seed [, model]), which returns an RGB image tensor [1, 3, size, size] in [0, 1]
-- and reports every step through kiln.progress, where the host shows progress and
-- where its cancel takes effect, and hands pictures of the work so far to the host's
-- preview callback (the pipelines do it by themselves; this loop with
-- kiln.preview_image).
--
-- Without a checkpoint the picture is painted with tensor ops over `steps`
-- refinement steps; switching to text-to-image is the one line marked below.

-- A sunset seen through a lens, painted in `steps` passes whose detail grows.
local function paint(o)
  local n = o.width
  local xs = kiln.linspace(-1, 1, n):reshape({ 1, n })
  local ys = kiln.linspace(-1, 1, n):reshape({ n, 1 })
  local r2 = xs * xs + ys * ys
  -- the prompt picks the palette, so different prompts give different pictures
  local h = 0
  for c in o.prompt:gmatch(".") do h = (h * 31 + c:byte()) % 1000003 end
  local warm = 0.5 + 0.5 * math.sin(h)
  local img = kiln.zeros({ 1, 3, n, n })
  for i = 1, o.steps do
    local t = i / o.steps
    local ring = ((r2 - 0.25 - 0.2 * t):abs() * (-6 - 20 * t)):exp()
    local glow = (r2 * (-2 - 2 * t)):exp()
    local grain = kiln.rand({ n, n }, { seed = o.seed * 1000 + i }) * (0.06 * (1 - t))
    local red   = (glow * (0.6 + 0.4 * warm) + ring * 0.5 + grain):clamp(0, 1)
    local green = (ring * 0.7 + (ys + 1) * 0.2 * t + grain):clamp(0, 1)
    local blue  = ((ys + 1) * (0.45 - 0.3 * warm) + ring * 0.4):clamp(0, 1)
    local layer = kiln.cat({ red:reshape({ 1, 1, n, n }), green:reshape({ 1, 1, n, n }),
                             blue:reshape({ 1, 1, n, n }) }, 2)
    img = img * (1 - 1 / i) + layer * (1 / i)   -- the running mean of the passes
    kiln.progress(i, o.steps, "paint")
    local every = kiln.preview_every()            -- nil: the host wants no previews
    if every and (i % every == 0 or i == o.steps) then kiln.preview_image(i, o.steps, img) end
  end
  return img
end

-- Text-to-image with a Stable Diffusion checkpoint (o.model: a .safetensors file).
local function txt2img(o)
  local ckpt <close> = kiln.load_checkpoint(o.model)
  return (require "kiln.pipeline").txt2img(ckpt, o)
end

local make_image = paint   -- text-to-image: local make_image = txt2img

function generate(prompt, steps, size, seed, model)
  local n = math.tointeger(tonumber(size or "256"))
  assert(n and n >= 8 and n <= 4096, "size must be an integer from 8 to 4096")
  return make_image({
    prompt = prompt or "", steps = math.tointeger(tonumber(steps or "20")) or 20,
    width = n, height = n, seed = math.tointeger(tonumber(seed or "0")) or 0, model = model,
  })
end
