-- The ComfyUI node registry (kiln.comfy.add_node, kiln.comfy.registry) without model
-- files: nodes added from a script and run by a workflow given as JSON; definitions
-- refused by name; every kind of input refused before anything runs (missing, wrong
-- type, out of ComfyUI's range, not in a combo's list, a linked value out of range);
-- optional inputs taking their defaults; the tiled VAE nodes' arithmetic against
-- ComfyUI's formulas.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local lfs = require "lfs"
local comfy = require "kiln.comfy"
local registry = require "kiln.comfy.registry"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local TMP = os.tmpname()
os.remove(TMP)
assert(lfs.mkdir(TMP))
local OUT = TMP .. "/out"
local written = {}

local function run(g, opts)
  local o = { models = TMP, output = OUT, quiet = true }
  for k, v in pairs(opts or {}) do o[k] = v end
  local files, report = comfy.run(g, o)
  for _, f in ipairs(files) do written[#written + 1] = f end
  return files, report
end

-- a flat picture of one level, its size from INT inputs with ComfyUI-style specs
comfy.add_node("KilnTestFlat", {
  category = "kiln/test",
  inputs = {
    { "width", "INT", default = 16, min = 8, max = 64, step = 8 },
    { "height", "INT", default = 8, min = 8, max = 64, step = 8 },
    { "level", "FLOAT", default = 0.25, min = 0.0, max = 1.0, step = 0.01 },
    { "channel", { "all", "red" } },
  },
  outputs = { "IMAGE" },
  run = function(ctx, a)
    local t = kiln.full({ 1, 3, a.height, a.width }, a.level)
    if a.channel == "red" then
      local z = kiln.zeros({ 1, 2, a.height, a.width })
      local r = kiln.cat({ t:narrow(2, 1, 1), z }, 2)
      t:free(); z:free()
      t = r
    end
    return { ctx:image(t) }
  end,
})

-- 1 - x blended by amount (optional: 1 when left out), as a custom node pack's filter
comfy.add_node("KilnTestInvert", {
  category = "kiln/test",
  inputs = { { "image", "IMAGE" }, { "amount", "FLOAT", default = 1.0, min = 0.0, max = 1.0, optional = true },
    { "mask", "MASK", optional = true } },
  outputs = { "IMAGE" },
  run = function(ctx, a)
    if a.mask ~= nil then ctx:fail("a mask was not given, yet the node got one") end
    local x = a.image.t
    local inv = 1 - x
    local r = x * (1 - a.amount) + inv * a.amount
    inv:free()
    return { ctx:image(r) }
  end,
})

-- a number on a link (a primitive node): the reader checks it against its own spec
comfy.add_node("KilnTestNumber", {
  inputs = { { "value", "INT", default = 0, min = -1000, max = 1000 } },
  outputs = { "INT" },
  run = function(ctx, a) return { ctx:value("INT", { value = a.value }) } end,
})

local WORKFLOW = [[{
  "1": {"class_type": "KilnTestFlat", "inputs": {"width": 24, "level": 0.25}},
  "2": {"class_type": "KilnTestInvert", "inputs": {"image": ["1", 0]}},
  "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "custom"}},
  "4": {"class_type": "KilnTestNumber", "inputs": {"value": 32}},
  "5": {"class_type": "KilnTestFlat", "inputs": {"width": ["4", 0], "height": 16, "level": 1, "channel": "red"}},
  "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": "linked"}}
}]]

test("comfy.add_node: nodes added from a script run in a workflow given as JSON", function()
  truthy(registry.get("KilnTestFlat"), "registered")
  local names = table.concat(comfy.supported(), " ")
  truthy(names:find("KilnTestInvert", 1, true) and names:find("KSampler", 1, true), names)
  local files = run(WORKFLOW)
  eq(#files, 2)
  eq(kiln.mem.stats("cpu").allocated, 0, "the run left nothing allocated")
  local a <close> = kiln.load_png(files[1])
  eq(table.concat(a.shape, "x"), "1x3x8x24", "the given width, the default height")
  -- 1 - 0.25 on 8 bits
  H.near(a:max(), math.floor(0.75 * 255 + 0.5) / 255, 1e-6, "inverted by the optional amount's default")
  local b <close> = kiln.load_png(files[2])
  eq(table.concat(b.shape, "x"), "1x3x16x32", "the width from the linked INT")
  eq(b:narrow(2, 1, 1):min(), 1, "red")
  eq(b:narrow(2, 2, 2):max(), 0, "only red")
end)

test("comfy.add_node: a definition is checked whole and refused by name", function()
  local function def(t)
    local d = { inputs = {}, outputs = { "IMAGE" }, run = function() end }
    for k, v in pairs(t) do d[k] = v end
    return d
  end
  raises(function() comfy.add_node("KilnTestFlat", def({})) end, "KilnTestFlat: already registered")
  raises(function() comfy.add_node("", def({})) end, "the node name must be a non-empty string")
  raises(function() comfy.add_node("Bad", def({ ouputs = {} })) end, "Bad: unknown field 'ouputs'")
  raises(function() comfy.add_node("Bad", def({ run = 3 })) end, "Bad: run must be a function")
  raises(function() comfy.add_node("Bad", def({ outputs = {} })) end, "no outputs must be an output node")
  raises(function() comfy.add_node("Bad", def({ outputs = { "image" } })) end, "output 1 must be an upper-case type")
  raises(function() comfy.add_node("Bad", def({ inputs = { { "w", "int" } } })) end, "input 'w': type must be INT")
  raises(function() comfy.add_node("Bad", def({ inputs = { { "w", "INT", min = 8, max = 4 } } })) end,
    "input 'w': min 8 is above max 4")
  raises(function() comfy.add_node("Bad", def({ inputs = { { "w", "INT", default = 2, min = 8 } } })) end,
    "input 'w': default 2 is outside [8, inf]")
  raises(function() comfy.add_node("Bad", def({ inputs = { { "w", "INT", default = 1.5 } } })) end,
    "input 'w': default must be a whole number")
  raises(function() comfy.add_node("Bad", def({ inputs = { { "w", "INT", mx = 4 } } })) end, "input 'w': unknown field 'mx'")
  raises(function() comfy.add_node("Bad", def({ inputs = { { "s", "STRING", min = 1 } } })) end,
    "input 's': min is for INT and FLOAT inputs")
  raises(function() comfy.add_node("Bad", def({ inputs = { { "m", "MODEL", default = 1 } } })) end,
    "a link input (MODEL) has no default")
  raises(function() comfy.add_node("Bad", def({ inputs = { { "c", {} } } })) end, "a combo needs at least one choice")
  raises(function() comfy.add_node("Bad", def({ inputs = { { "c", { "a", "b" }, default = "z" } } })) end,
    "default 'z' is not one of its choices")
  raises(function() comfy.add_node("Bad", def({ inputs = { { "x", "INT" }, { "x", "FLOAT" } } })) end, "input 'x': named twice")
  raises(function() comfy.add_node("Bad", def({ model_file = "x" })) end, "model_file must name one of its FILE: inputs")
  eq(registry.get("Bad"), nil, "nothing registered by a refused definition")
  -- replacing on purpose
  local d = comfy.add_node("KilnTestNumber", { inputs = { { "value", "INT", default = 0, min = -1000, max = 1000 } },
    outputs = { "INT" }, run = function(ctx, a) return { ctx:value("INT", { value = a.value }) } end }, { replace = true })
  eq(d.inputs[1].max, 1000)
end)

-- the workflow with one input of node `id` changed
local function with(id, name, v)
  local g = kiln.json.decode(WORKFLOW)
  g[id].inputs[name] = v
  return g
end

test("comfy: every kind of bad input is refused before anything runs, naming node, input, value and range", function()
  local before = 0
  if lfs.attributes(OUT, "mode") then for _ in lfs.dir(OUT) do before = before + 1 end end
  -- out of ComfyUI's range, both ends
  raises(function() run(with("1", "width", 4)) end,
    "node 1 (KilnTestFlat): input 'width' is 4, below the minimum 8 (allowed: 8 to 64)")
  raises(function() run(with("1", "level", 1.5)) end,
    "node 1 (KilnTestFlat): input 'level' is 1.5, above the maximum 1.0 (allowed: 0.0 to 1.0)")
  -- wrong type
  raises(function() run(with("1", "width", "wide")) end, "node 1 (KilnTestFlat): input 'width' must be a whole number, got wide")
  raises(function() run(with("1", "width", 12.5)) end, "input 'width' must be a whole number, got 12.5")
  raises(function() run(with("1", "level", "x")) end, "node 1 (KilnTestFlat): input 'level' must be a number, got string")
  raises(function() run(with("3", "filename_prefix", 3)) end, "node 3 (SaveImage): input 'filename_prefix' must be a string")
  raises(function() run(with("2", "image", 7)) end, "node 2 (KilnTestInvert): input 'image' must link to a IMAGE output, got 7")
  -- not in a combo's list
  raises(function() run(with("1", "channel", "green")) end, "node 1 (KilnTestFlat): input 'channel' is 'green', not one of all, red")
  -- a required input missing (a link has no default)
  raises(function() run(with("2", "image", nil)) end, "node 2 (KilnTestInvert): input 'image' (IMAGE) is missing")
  -- a link of the wrong type
  raises(function() run(with("2", "image", { "4", 0 })) end, "node 2 (KilnTestInvert): input 'image' expects IMAGE, but output 0 of node 4 (KilnTestNumber) is INT")
  -- a built-in node's ComfyUI range (ImageScale: width 0 to 16384) and list
  local g = kiln.json.decode(WORKFLOW)
  g["7"] = { class_type = "ImageScale", inputs = { image = { "1", 0 }, upscale_method = "bilinear", width = 20000,
    height = 0, crop = "disabled" } }
  g["3"].inputs.images = { "7", 0 }
  raises(function() run(g) end, "node 7 (ImageScale): input 'width' is 20000, above the maximum 16384 (allowed: 0 to 16384)")
  g["7"].inputs.width, g["7"].inputs.crop = 32, "middle"
  raises(function() run(g) end, "node 7 (ImageScale): input 'crop' is 'middle', not one of disabled, center")
  local after = 0
  if lfs.attributes(OUT, "mode") then for _ in lfs.dir(OUT) do after = after + 1 end end
  eq(after, before, "nothing was written")
end)

test("comfy: a value on a link is checked against the reader's spec before the reader runs", function()
  raises(function() run(with("4", "value", 4)) end,
    "node 5 (KilnTestFlat): input 'width' is 4, below the minimum 8 (allowed: 8 to 64)")
  raises(function() run(with("4", "value", 2000)) end,
    "node 4 (KilnTestNumber): input 'value' is 2000, above the maximum 1000")
  eq(kiln.mem.stats("cpu").allocated, 0, "what ran before the refusal was freed")
end)

test("comfy: a node's run must return its outputs' types", function()
  comfy.add_node("KilnTestBroken", { inputs = {}, outputs = { "IMAGE" },
    run = function(ctx) return { ctx:mask(kiln.zeros({ 1, 1, 8, 8 })) } end })
  local g = kiln.json.decode(WORKFLOW)
  g["1"] = { class_type = "KilnTestBroken", inputs = {} }
  raises(function() run(g) end, "node 1 (KilnTestBroken): output 0 must be a IMAGE value (ctx:value), got MASK")
  eq(kiln.mem.stats("cpu").allocated, 0, "its result was freed all the same")
end)

-- ComfyUI's nodes.py, VAEDecodeTiled.decode:
--   if tile_size < overlap * 4: overlap = tile_size // 4
--   compression = vae.spacial_compression_decode()            (8 for SD's VAE)
--   vae.decode_tiled(samples, tile_x=tile_size // compression, overlap=overlap // compression)
test("comfy: VAEDecodeTiled's tiles as ComfyUI computes them (overlap lowered to a quarter, the VAE's factor)", function()
  local vae = require "kiln.comfy.vae"
  -- tile_size 64, overlap 32, SD's VAE: 64 < 128, so overlap = 64 // 4 = 16; 64 // 8 = 8, 16 // 8 = 2
  local t, o = vae.decode_tiles(64, 32, 8)
  eq(t, 8); eq(o, 2)
  -- the same on a VAE of factor 4: 64 // 4 = 16, 16 // 4 = 4
  t, o = vae.decode_tiles(64, 32, 4)
  eq(t, 16); eq(o, 4)
  -- the defaults (512, 64): 512 >= 256 keeps the overlap; 512 // 8 = 64, 64 // 8 = 8
  t, o = vae.decode_tiles(512, 64, 8)
  eq(t, 64); eq(o, 8)
  -- ComfyUI's encode takes the pixels as given: tile 512, overlap 64 on a 1024 x 768 picture,
  -- factor 8 -> 64, 8 latent; a picture inside one tile runs whole; overlap >= tile / 2
  -- on a picture larger than half a tile is what ComfyUI cannot run (its halved tiling's
  -- step tile_size // 2 - overlap is not positive)
  t, o = vae.encode_tiles(512, 64, 8, 768, 1024)
  eq(t, 64); eq(o, 8)
  eq(vae.encode_tiles(512, 64, 8, 256, 512), nil, "one tile: a whole run")
  local none, why = vae.encode_tiles(64, 32, 8, 128, 128)
  eq(none, nil)
  truthy(why and why:find("overlap 32 must be below tile_size / 2 (32)", 1, true), why)
end)

for _, f in ipairs(written) do os.remove(f) end
os.remove(OUT)
os.remove(TMP)
H.done()
