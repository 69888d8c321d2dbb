-- The options every pipeline takes: any size that is a multiple of the VAE's factor
-- (the UNet meets its skip connections' sizes), a batch drawn from one seed as
-- randn([N, 4, h, w]), and CLIP skip passed through to clip:encode and the PNG text.
-- Runs on the bundled demo model and the tiny SD checkpoints of tests/golden/sd.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local pipeline = require "kiln.pipeline"
local cli = require "kiln.cli"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local T = require "tiny_sd"
local MODEL = H.demo_model("demo model present")

local function shape_of(t) return table.concat(t.shape, ",") end

-- few steps: these tests are about shapes, noise and options, not pictures
local BASE = { prompt = "a red circle on a blue background", steps = 2, seed = 7 }
local function opts(extra)
  local o = {}
  for k, v in pairs(BASE) do o[k] = v end
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

test("size: multiples of the VAE factor only", function()
  local ck <close> = kiln.load_checkpoint(MODEL)
  eq(pipeline.size_multiple(ck), math.tointeger(ck.vae.factor))
  -- 72x40 and 76x44 pixels: latents 18x10 and 19x11, which the UNet's levels do not divide
  for _, wh in ipairs({ { 72, 40 }, { 76, 44 } }) do
    local img, lat = pipeline.txt2img(ck, opts({ width = wh[1], height = wh[2] }))
    eq(shape_of(img), ("1,3,%d,%d"):format(wh[2], wh[1]))
    eq(lat.shape[3] * ck.vae.factor, wh[2])
    img:free(); lat:free()
  end
  raises(function() pipeline.txt2img(ck, opts({ width = 74, height = 40 })) end, "multiples of 4")
end)

test("size: MultiDiffusion and tiled VAE at an odd latent size", function()
  local ck <close> = kiln.load_checkpoint(MODEL)
  local img, lat = pipeline.hires_fix(ck, opts({ width = 36, height = 44, scale = 2, hires_tile = 8, tile = 8 }))
  eq(shape_of(img), "1,3,88,72")
  img:free(); lat:free()
end)

test("batch: noise randn([N, 4, h, w]) from the one seed, one image each", function()
  local ck <close> = kiln.load_checkpoint(MODEL)
  local draws = {}
  local randn = kiln.randn
  kiln.randn = function(shape, o)
    draws[#draws + 1] = { shape = table.concat(shape, ","), seed = o and o.seed }
    return randn(shape, o)
  end
  local ok, img, lat = pcall(pipeline.txt2img, ck, opts({ width = 40, height = 40, batch = 3 }))
  kiln.randn = randn
  assert(ok, img)
  eq(shape_of(img), "3,3,40,40")
  eq(draws[1].shape, "3,4,10,10")
  eq(draws[1].seed, 7)
  -- image 1 of the batch is the picture of a batch of one (randn's first values)
  local one, lat1 = pipeline.txt2img(ck, opts({ width = 40, height = 40 }))
  local first = lat:narrow(1, 1, 1)
  -- up to rounding: a batch of 3 may take another convolution path than one image
  -- (the few-tiles Winograd path has a tile limit), which sums in another order
  local zero = lat1 * 0
  local scale = H.maxdiff(lat1, zero)
  zero:free()
  truthy(H.maxdiff(first, lat1) < 1e-4 * scale, "batch image 1 = the single run")
  local second = lat:narrow(1, 2, 1)
  truthy(H.maxdiff(second, lat1) > 1e-3, "batch image 2 has its own noise")
  first:free(); second:free(); one:free(); lat1:free(); img:free(); lat:free()
end)

test("batch: img2img and hires fix", function()
  local ck <close> = kiln.load_checkpoint(MODEL)
  local input <close> = kiln.rand({ 1, 3, 40, 48 }, { seed = 3 })
  local img, lat = pipeline.img2img(ck, input, opts({ batch = 2 }))
  eq(shape_of(img), "2,3,40,48")
  img:free(); lat:free()
  img, lat = pipeline.hires_fix(ck, opts({ width = 32, height = 24, scale = 2, batch = 2 }))
  eq(shape_of(img), "2,3,48,64")
  img:free(); lat:free()
  raises(function() pipeline.txt2img(ck, opts({ batch = 0 })) end, "batch 0")
end)

test("batch: file names and parameters", function()
  eq(table.concat(cli.out_paths("out.png", 1), " "), "out.png")
  eq(table.concat(cli.out_paths("dir.x/out.png", 2), " "), "dir.x/out_1.png dir.x/out_2.png")
  eq(table.concat(cli.out_paths("out", 2), " "), "out_1 out_2")
  local p = pipeline.parameters(opts({ batch = 2, width = 64, height = 64 }), nil)
  truthy(p:find("Batch size: 2", 1, true), p)
end)

test("clip skip: ComfyUI's CLIPSetLastLayer per family", function()
  local ck1 <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local text = "a photo of a cat"
  local base = ck1.clip:encode(text)
  eq(H.maxdiff(ck1.clip:encode(text, { clip_skip = 1 }), base), 0)
  local enc = ck1.clip.encoders[1].enc
  local ids = ck1.clip:tokenize(text)
  local want = enc:forward({ ids }, { layer = -2 })
  truthy(H.maxdiff(ck1.clip:encode(text, { clip_skip = 2 }), want) < 1e-5, "sd1: 2 = penultimate")
  raises(function() ck1.clip:encode(text, { clip_skip = 0 }) end, "clip_skip 0")
  raises(function() ck1.clip:encode(text, { clip_skip = 99 }) end, "out of range")
  -- SD 2.x takes the penultimate layer already: clip skip 2 changes nothing, 1 the last
  local ck2 <close> = kiln.load_checkpoint(T.ckpt_file("sd2"))
  local d2 = ck2.clip:encode(text)
  eq(H.maxdiff(ck2.clip:encode(text, { clip_skip = 2 }), d2), 0)
  truthy(H.maxdiff(ck2.clip:encode(text, { clip_skip = 1 }), d2) > 1e-4, "sd2: 1 = last layer")
  -- SDXL: both encoders move (ComfyUI sets the layer of clip_l and clip_g)
  local ckx <close> = kiln.load_checkpoint(T.ckpt_file("sdxl"))
  local dx = ckx.clip:encode(text)
  eq(H.maxdiff(ckx.clip:encode(text, { clip_skip = 2 }), dx), 0)
  truthy(H.maxdiff(ckx.clip:encode(text, { clip_skip = 1 }), dx) > 1e-4, "sdxl: 1 = last layer")
end)

test("clip skip: through the pipelines and into the PNG text", function()
  local ck <close> = kiln.load_checkpoint(MODEL)
  local seen = {}
  local encode = ck.clip.encode
  ck.clip.encode = function(self, text, o)
    seen[#seen + 1] = o and o.clip_skip or "nil"
    return encode(self, text, o)
  end
  local a = pipeline.txt2img(ck, opts({ width = 32, height = 32, clip_skip = 2 }))
  local input <close> = kiln.rand({ 1, 3, 32, 32 }, { seed = 3 })
  local b = pipeline.img2img(ck, input, opts({ clip_skip = 2 }))
  local c = pipeline.hires_fix(ck, opts({ width = 32, height = 32, clip_skip = 2 }))
  ck.clip.encode = nil
  a:free(); b:free(); c:free()
  eq(table.concat(seen, ","), "2,2,2,2,2,2")
  local p = pipeline.parameters(opts({ clip_skip = 2, width = 32, height = 32 }), nil)
  truthy(p:find("Clip skip: 2", 1, true), p)
  truthy(not pipeline.parameters(opts({ width = 32, height = 32 }), nil):find("Clip skip", 1, true), "absent by default")
end)

test("command line: txt2img --width 72 --height 40 --batch 2 --clip-skip 2", function()
  local exe = arg and arg[-1]
  if not exe or not exe:match("kiln$") then H.skip("not run by the kiln program") end
  local out = T.tmp("cli.png")
  local cmd = ("'%s' examples/txt2img.lua --quiet --steps 2 --width 72 --height 40 --batch 2 --clip-skip 2 " ..
    "--out '%s' > /dev/null"):format(exe, out)
  truthy(os.execute(cmd), cmd)
  for i = 1, 2 do
    local p = out:gsub("%.png$", "_" .. i .. ".png")
    T.tmp(p:match("[^/]*$"))   -- removed at cleanup
    local img <close> = kiln.load_png(p)
    eq(shape_of(img), "1,3,40,72")
  end
  eq(io.open(out, "rb"), nil)
end)

-- Unknown and misspelt options: an error naming the option and the nearest known name,
-- raised at the caller's line before any work, in every pipeline.
test("options: a misspelt option is an error naming it and the nearest known name", function()
  local ck <close> = kiln.load_checkpoint(MODEL)
  local img <close> = kiln.rand({ 1, 3, 32, 32 }, { seed = 3 })
  local mask <close> = kiln.ones({ 1, 1, 32, 32 })
  collectgarbage(); collectgarbage()    -- earlier tests' garbage
  local before = kiln.mem.stats("cpu").allocated
  local runs = {
    txt2img = function(o) return pipeline.txt2img(ck, o) end,
    img2img = function(o) return pipeline.img2img(ck, img, o) end,
    hires_fix = function(o) return pipeline.hires_fix(ck, o) end,
    inpaint = function(o) return pipeline.inpaint(ck, img, mask, o) end,
  }
  for name, run in pairs(runs) do
    local e = H.raises(function() run({ stpes = 8, width = 32, height = 32 }) end,
      "kiln.pipeline." .. name .. ": unknown option 'stpes' (did you mean 'steps'?)")
    -- the caller's line, not the pipeline's
    truthy(tostring(e):match("^tests/lua/test_options%.lua:%d+:"), tostring(e))
    H.raises(function() run({ sampelr = "heun" }) end, "unknown option 'sampelr' (did you mean 'sampler'?)")
    H.raises(function() run({ seeed = 1 }) end, "unknown option 'seeed' (did you mean 'seed'?)")
    H.raises(function() run({ negative_prompt = "x" }) end, "unknown option 'negative_prompt' (known: ")
  end
  -- the issue's case: two mistakes and a table; the first in order is named
  H.raises(function() pipeline.txt2img(ck, { stpes = 8, sampelr = "heun", cachee = {} }) end,
    "unknown option 'cachee' (did you mean 'cache'?)")
  -- another pipeline's option is unknown here
  H.raises(function() pipeline.txt2img(ck, { hires_steps = 4 }) end, "txt2img: unknown option 'hires_steps'")
  H.raises(function() pipeline.img2img(ck, img, { mask_blur = 4 }) end, "img2img: unknown option 'mask_blur'")
  -- hires fix and inpaint know their own
  H.raises(function() pipeline.hires_fix(ck, { hires_stpes = 4 }) end, "(did you mean 'hires_steps'?)")
  H.raises(function() pipeline.inpaint(ck, img, mask, { mask_blr = 4 }) end, "(did you mean 'mask_blur'?)")
  -- a ControlNet entry's own options, where they are consumed
  local fake_net = { forward = function() end }
  H.raises(function()
    pipeline.txt2img(ck, { control = { { net = fake_net, image = img, strenght = 0.5 } } })
  end, "control[1]: unknown option 'strenght' (did you mean 'strength'?)")
  collectgarbage(); collectgarbage()
  eq(kiln.mem.stats("cpu").allocated, before, "nothing left by the refused runs")
  eq(ck.unet:bytes("cpu") + ck.clip:bytes("cpu") + ck.vae:bytes("cpu"), 0, "nothing loaded by the refused runs")
end)

test("options: the edit distance and the nearest name", function()
  local util = require "kiln.util"
  eq(util.edit_distance("steps", "steps"), 0)
  eq(util.edit_distance("stpes", "steps"), 1)       -- a swap of neighbours
  eq(util.edit_distance("sampelr", "sampler"), 1)
  eq(util.edit_distance("", "cfg"), 3)
  eq(util.edit_distance("kitten", "sitting"), 3)
  eq(util.nearest("hieght", pipeline.OPTIONS.txt2img), "height")
  eq(util.nearest("widht", pipeline.OPTIONS.txt2img), "width")
  eq(util.nearest("zzzzzz", pipeline.OPTIONS.txt2img), nil)
end)

-- Every option a pipeline or a helper it hands its options to reads is in the
-- pipeline's table: a new option read without being declared fails here, before a
-- user's run is refused it. (Reads of the run's own fields set inside are listed.)
test("options: every option the pipelines read is declared", function()
  local internal = { y_cond = true, y_uncond = true, controls = true, concat = true, _seconds_per_step = true,
    _flow = true, _ms = true,  -- a flow family's checked options and model sampling (kiln.flow)
    _reference = true,         -- Flux Kontext's encoded reference latents
    info = true, cache_state = true, _cache_spec = true }  -- the run's record and step cache (kiln.step_cache)
  local all = {}
  for _, set in pairs(pipeline.OPTIONS) do for k in pairs(set) do all[k] = true end end
  local sources = {
    ["scripts/kiln/pipeline.lua"] = { "o", "opts", "od", "first", "second" },
    ["scripts/kiln/inpaint.lua"] = { "o", "opts" },
    ["scripts/kiln/preview.lua"] = { "o" },         -- preview.session(ckpt, o, dev)
    ["scripts/kiln/planner.lua"] = { "o" },         -- planner.apply(ckpt, o)
  }
  local seen = 0
  for path, names in pairs(sources) do
    local f = io.open(path, "r")
    if not f then H.skip(path .. " not found (run from the source tree)") end
    local src = f:read("a")
    f:close()
    for _, v in ipairs(names) do
      for k in src:gmatch("%f[%w_]" .. v .. "%.([%a_][%w_]*)") do
        seen = seen + 1
        truthy(all[k] or internal[k], ("%s reads %s.%s, which no pipeline declares"):format(path, v, k))
      end
    end
  end
  truthy(seen > 50, "the scan found the reads")
  -- inpaint's options: img2img's and its own
  for k in pairs(pipeline.OPTIONS.img2img) do
    truthy(pipeline.OPTIONS.inpaint[k] or k:match("^concat_") or k == "denoise_mask", k)
  end
end)

test("options: options_of keeps the pipeline's options of a larger table", function()
  local o = pipeline.options_of("txt2img", { steps = 3, out = "x.png", model = "m", quiet = true, scale = 2 })
  eq(o.steps, 3)
  eq(o.out, nil); eq(o.model, nil); eq(o.quiet, nil); eq(o.scale, nil)
  eq(pipeline.options_of("hires_fix", { scale = 2 }).scale, 2)
end)

test("command line: a misspelt --flag is a usage error naming the nearest", function()
  local exe = arg and arg[-1]
  if not exe or not exe:match("kiln$") then H.skip("not run by the kiln program") end
  local err = T.tmp("flag.err")
  for _, ex in ipairs({ "txt2img", "img2img", "hires_fix", "inpaint", "outpaint", "controlnet" }) do
    local cmd = ("'%s' examples/%s.lua --stpes 2 > /dev/null 2> '%s'"):format(exe, ex, err)
    local ok, how, code = os.execute(cmd)
    truthy(not ok and how == "exit" and code == 2, ex .. ": exit status 2 expected, got " .. tostring(code))
    local f = assert(io.open(err, "r"))
    local msg = f:read("a")
    f:close()
    truthy(msg:find("unknown option '--stpes' (did you mean '--steps'?)", 1, true), ex .. ": " .. msg)
  end
end)

T.cleanup()
H.done()
