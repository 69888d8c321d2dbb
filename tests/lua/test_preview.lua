-- kiln.preview: the latent->RGB projection against the NumPy computation of
-- tests/golden/gen_taesd.py (SD 1.x/2.x and SDXL factors), and the pipelines' preview
-- hook on the bundled demo model: called every N steps (and after the last) with
-- images of the previewer's size (latent2rgb: the latent's; TAESD: 8x), a PNG file
-- written during sampling (option and --preview on the command line), no previews
-- with previewer = false, bad options named.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local preview = require "kiln.preview"
local test, eq, raises = H.test, H.eq, H.raises

local T = require "tiny_sd"
local G = kiln.load_safetensors("tests/golden/taesd/io.safetensors")
local DEMO = "examples/models/kiln-shapes.safetensors"

test("preview: latent2rgb matches NumPy (sd1, sd2, sdxl)", function()
  local z = G["l2r.z"]
  for fam, key in pairs({ sd1 = "l2r.sd1", sd2 = "l2r.sd1", sdxl = "l2r.sdxl" }) do
    local img = preview.latent2rgb(z, fam)
    H.close_rel(img, G[key], 1e-5, "latent2rgb " .. fam)
    img:free()
  end
end)

test("preview: latent2rgb upscaled, on sim, f16 latents; bad input named", function()
  local z = G["l2r.z"]
  local big = preview.latent2rgb(z, "sd1", { scale = 8 })
  eq(H.shape_of(big), "2,3,48,80")
  local small = preview.latent2rgb(z, "sd1")
  local back = kiln.nn.interpolate(small, { size = { 48, 80 }, mode = "nearest" })
  H.truthy(H.maxdiff(big, back) == 0, "scale = nearest upsampling")
  big:free(); back:free()
  local zs = z:to("sim")
  local s = preview.latent2rgb(zs, "sdxl")
  eq(s.device, "sim")
  H.close_rel(s:to("cpu"), G["l2r.sdxl"], 1e-5, "on sim")
  s:free(); zs:free()
  local zh = z:to("f16")
  local h = preview.latent2rgb(zh, "sd1")
  H.close_rel(h, small, 2e-3, "f16 latents")
  h:free(); zh:free(); small:free()
  raises(function() preview.latent2rgb(kiln.zeros({ 1, 16, 4, 4 }), "sd1") end, "4 channels")
  raises(function() preview.latent2rgb(z, "flux") end, "family 'flux'")
end)

test("preview: latent2rgb costs little at 64x64 latents", function()
  local z = kiln.randn({ 1, 4, 64, 64 }, { seed = 1 })
  preview.latent2rgb(z, "sd1"):free()
  local n, t0 = 50, kiln.time()
  for _ = 1, n do preview.latent2rgb(z, "sd1"):free() end
  local ms = (kiln.time() - t0) / n * 1000
  print(("# latent2rgb at 64x64 latents: %.3f ms"):format(ms))
  H.truthy(ms < 20, ("%.2f ms per preview"):format(ms))
end)

local function run(opts)
  local ckpt <close> = kiln.load_checkpoint(DEMO)
  local o = { prompt = "a red circle", steps = 5, width = 64, height = 64, seed = 1 }
  for k, v in pairs(opts) do o[k] = v end
  local img = kiln.pipeline.txt2img(ckpt, o)
  img:free()
end

test("preview: the pipeline's hook every N steps, latent-sized pictures", function()
  local calls = {}
  run({ preview_every = 2, batch = 2, preview = function(step, total, img)
    calls[#calls + 1] = ("%d/%d %s %.2f"):format(step, total, H.shape_of(img), img:min())
    H.truthy(img:min() >= 0 and img:max() <= 1, "in [0, 1]")
  end })
  eq(#calls, 3, table.concat(calls, "; "))
  eq(calls[1]:match("^%S+ %S+"), "2/5 2,3,16,16")
  eq(calls[2]:match("^%S+"), "4/5")
  eq(calls[3]:match("^%S+"), "5/5")
end)

test("preview: TAESD previews at full size; previewer = false: none", function()
  local dec = T.tmp("taesd_decoder.safetensors")
  kiln.save_safetensors(dec, T.build_recipe("../taesd/decoder"))
  local t <close> = kiln.load_taesd({ decoder = dec })
  local sizes = {}
  run({ previewer = t, preview_every = 4, preview = function(step, _, img)
    sizes[#sizes + 1] = step .. ":" .. H.shape_of(img)
  end })
  -- the demo's VAE has factor 4 (16x16 latents); TAESD's is 8
  eq(table.concat(sizes, " "), "4:1,3,128,128 5:1,3,128,128")
  local n = 0
  run({ previewer = false, preview = function() n = n + 1 end })
  eq(n, 0)
end)

test("preview: a PNG written during sampling (option and --preview)", function()
  local p = T.tmp("preview.png")
  local seen = 0
  run({ preview = p, preview_every = 2, callback = function(st)
    if st.i >= 2 then
      local img = kiln.load_png(p)
      eq(H.shape_of(img), "1,3,16,16")
      img:free()
      seen = seen + 1
    end
  end })
  H.truthy(seen > 0, "the file was there during sampling")
  local exe = arg and arg[-1]
  if not exe or not exe:match("kiln$") then H.skip("not run by the kiln program (arg[-1] = " .. tostring(exe) .. ")") end
  local q = T.tmp("cli-preview.png")
  local out = T.tmp("cli-out.png")
  local ok = os.execute(("'%s' examples/txt2img.lua --quiet --steps 3 --prompt 'a red circle' --preview '%s' "
    .. "--preview-every 2 --out '%s' >/dev/null"):format(exe, q, out))
  H.truthy(ok, "the CLI ran")
  local img = kiln.load_png(q)
  eq(H.shape_of(img), "1,3,16,16")
  img:free()
end)

test("preview: bad options named", function()
  raises(function() run({ preview = 3 }) end, "preview must be a function")
  raises(function() run({ preview = function() end, preview_every = 0 }) end, "preview_every")
  raises(function() run({ preview = function() end, previewer = "vae" }) end, "previewer must be", "'vae'")
  -- previewer "taesd" with no TAESD beside the checkpoint: where it looked
  raises(function() run({ preview = function() end, previewer = "taesd" }) end, "taesd_decoder.safetensors",
    "vae_approx")
end)

T.cleanup()
H.done()
