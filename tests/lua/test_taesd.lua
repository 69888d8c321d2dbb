-- kiln.taesd: a real-width TAESD rebuilt from the recipes of tests/golden/gen_taesd.py
-- (seeded kiln.randn = torch.randn) with the real key names, compared with that
-- independent PyTorch TAESD: decode and encode, tiled decode, f16 weights, a combined
-- ComfyUI-style file, TAESD as the checkpoint's VAE (vae = "taesd" found beside it, a
-- path, an object), and bad input named (wrong latent channels, a full VAE given as a
-- TAESD, an encoder given as a decoder); tileable runs (circular padding, wrapped
-- tiles, no seam at the wrap, --vae taesd and the previews in tileable pipelines).
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local imgcmp = require "imgcmp"
local roll, seam_ratio = imgcmp.roll, imgcmp.seam_ratio
local taesd = require "kiln.taesd"
local test, eq, raises = H.test, H.eq, H.raises

local T = require "tiny_sd"
local G = kiln.load_safetensors("tests/golden/taesd/io.safetensors")
local TOL = 1e-4

local DEC_T = T.build_recipe("../taesd/decoder")
local ENC_T = T.build_recipe("../taesd/encoder")

local function save(name, tensors, prefix)
  local out = {}
  for k, v in pairs(tensors) do out[(prefix or "") .. k] = v end
  local p = T.tmp(name)
  kiln.save_safetensors(p, out)
  return p
end

-- a folder laid out as ComfyUI's models/ (checkpoints/ beside vae_approx/)
os.execute("mkdir -p '" .. T.TMP .. "/models/checkpoints' '" .. T.TMP .. "/models/vae_approx'")
local DEC = save("models/vae_approx/taesd_decoder.safetensors", DEC_T)
local ENC = save("models/vae_approx/taesd_encoder.safetensors", ENC_T)

local report = {}
local function note(name, err) report[#report + 1] = ("%s %.2g"):format(name, err) end

test("taesd: decode matches the PyTorch TAESD (clamped to [0, 1])", function()
  local t <close> = kiln.load_taesd({ decoder = DEC, encoder = ENC })
  eq(t.latent_channels, 4)
  eq(t.width, 64)
  local img = t:decode(G["dec.z"])
  note("decode", H.close_rel(img, G["dec.img"], TOL, "decode"))
  H.truthy(img:min() >= 0 and img:max() <= 1, "clamped")
  img:free()
end)

test("taesd: encode matches the PyTorch TAESD (scaled latents)", function()
  local t <close> = kiln.load_taesd({ encoder = ENC })
  local z = t:encode(G["enc.img"])
  note("encode", H.close_rel(z, G["enc.z"], TOL, "encode"))
  z:free()
  raises(function() t:decode(G["dec.z"]) end, "no decoder")
end)

test("taesd: a tiled decode matches the untiled one", function()
  local t <close> = kiln.load_taesd(DEC)
  local z = kiln.randn({ 1, 4, 24, 24 }, { seed = 3 })
  local a = t:decode(z)
  local b = t:decode(z, { tile = 16, overlap = 6 })
  -- no normalization inside, but a receptive field wider than the overlap: tiles
  -- differ a little near their borders, feathered
  local d = (a - b):abs():mean()
  note("tiled (mean abs)", d)
  H.truthy(d < 0.01, "tiled vs untiled mean difference " .. d)
  a:free(); b:free()
end)

test("taesd: f16 weights and a combined file (taesd_decoder. / taesd_encoder.)", function()
  local both = {}
  for k, v in pairs(DEC_T) do both["taesd_decoder." .. k] = v:to("f16") end
  for k, v in pairs(ENC_T) do both["taesd_encoder." .. k] = v:to("f16") end
  local p = T.tmp("taesd_both.safetensors")
  kiln.save_safetensors(p, both)
  local t <close> = kiln.load_taesd({ decoder = p, encoder = p })
  local img = t:decode(G["dec.z"])
  note("f16", H.close_rel(img, G["dec.img"], 2e-2, "decode f16 weights"))
  img:free()
end)

test("taesd: load, unload, bytes and mode low as a model", function()
  local t <close> = kiln.load_taesd({ decoder = DEC, encoder = ENC })
  t:load("sim")
  H.truthy(t:bytes("sim") > 0, "bytes on sim")
  local img = t:decode(G["dec.z"])
  H.close_rel(img:to("cpu"), G["dec.img"], TOL, "decode on sim")
  img:free()
  t:unload()
  eq(t:bytes("sim"), 0)
  -- mode low: the weights stay on the host and stream block by block
  local old = kiln.memory_mode()
  kiln.memory_mode("low")
  t:load("sim")
  local z = G["dec.z"]:to("sim")
  img = t:decode(z)
  eq(img.device, "sim")
  H.close_rel(img:to("cpu"), G["dec.img"], TOL, "decode streamed")
  eq(t:bytes("sim"), 0, "nothing left on the device after a streamed pass")
  img:free(); z:free()
  t:unload()
  kiln.memory_mode(old)
end)

test("taesd: bad files are named", function()
  raises(function() kiln.load_taesd({ decoder = ENC }) end, ENC, "TAESD encoder, not a decoder")
  local vae = save("vae.safetensors", { ["decoder.conv_in.weight"] = kiln.zeros({ 8, 4, 3, 3 }) })
  raises(function() kiln.load_taesd({ decoder = vae }) end, "full VAE")
  local wrong = {}
  for k, v in pairs(DEC_T) do wrong[k] = v end
  wrong["3.conv.2.weight"] = kiln.zeros({ 64, 32, 3, 3 })
  local p = save("broken_decoder.safetensors", wrong)
  raises(function() kiln.load_taesd({ decoder = p }) end, p, "3.conv.2.weight", "[64, 32, 3, 3]")
  raises(function() kiln.load_taesd({}) end, "decoder = path")
  raises(function() kiln.load_taesd({ decodr = DEC }) end, "unknown option 'decodr'")
end)

-- a 16-channel TAESD (as taef1 / taesd3): first and last convolutions wider
local function wide_decoder()
  local t = {}
  for k, v in pairs(DEC_T) do t[k] = v end
  t["1.weight"] = kiln.randn({ 64, 16, 3, 3 }, { seed = 1 }) * 0.1
  return save("models/vae_approx/taef1_decoder.safetensors", t)
end

test("taesd: as the checkpoint's VAE (vae = \"taesd\", a path, an object)", function()
  -- the checkpoint in models/checkpoints: its TAESD found in models/vae_approx
  local src = T.ckpt_file("sd1")
  local ck = T.TMP .. "/models/checkpoints/tiny.safetensors"
  T.tmp("models/checkpoints/tiny.safetensors")
  os.execute("cp '" .. src .. "' '" .. ck .. "'")
  do
    local ckpt <close> = kiln.load_checkpoint(ck, { vae = "taesd" })
    H.truthy(ckpt.vae.is_taesd, "ckpt.vae is the TAESD")
    eq(ckpt.vae.path, DEC)
    local img = ckpt.vae:decode(G["dec.z"])
    H.close_rel(img, G["dec.img"], TOL, "ckpt.vae:decode")
    img:free()
    local z = ckpt.vae:encode(G["enc.img"])
    H.close_rel(z, G["enc.z"], TOL, "ckpt.vae:encode")
    z:free()
  end
  do -- a path: the other half found beside it
    local ckpt <close> = kiln.load_checkpoint(ck, { vae = DEC })
    H.truthy(ckpt.vae.is_taesd and ckpt.vae.encoder_half ~= nil, "TAESD with its encoder")
  end
  do -- an object: the caller keeps it
    local t <close> = kiln.load_taesd(DEC)
    do
      local ckpt <close> = kiln.load_checkpoint(ck, { vae = t })
      eq(ckpt.vae.path, DEC)
    end
    local img = t:decode(G["dec.z"]) -- still open after the checkpoint's close
    img:free()
  end
  -- wrong latent channels: named, with the file
  local wide = wide_decoder()
  raises(function() kiln.load_checkpoint(ck, { vae = wide }) end, wide, "16 latent channels", "have 4")
  -- not found: where it looked
  raises(function() kiln.load_checkpoint(src, { vae = "taesd" }) end, "taesd_decoder.safetensors", "vae_approx")
end)

test("taesd: txt2img with vae = \"taesd\" in the pipeline's options", function()
  local src = T.ckpt_file("sd1")
  local ck = T.TMP .. "/models/checkpoints/tiny.safetensors"
  local ckpt <close> = kiln.load_checkpoint(ck, { tokenizer = os.getenv("KILN_TOKENIZER") })
  local before = ckpt.vae
  local img = kiln.pipeline.txt2img(ckpt, { prompt = "a red circle", steps = 2, width = 64, height = 64, seed = 1,
    vae = "taesd" })
  -- the tiny checkpoint's VAE has factor 2 (latents 32x32); TAESD's is 8
  eq(H.shape_of(img), "1,3,256,256")
  eq(ckpt.vae, before, "the checkpoint's own VAE is back after the run")
  img:free()
  local _ = src
end)

test("taesd: tileable pads circularly (shift-equivariant), tiles wrap around, no seam at the wrap", function()
  local t <close> = kiln.load_taesd({ decoder = DEC, encoder = ENC })
  local zx, zy, wx, wy, n = 0, 0, 0, 0, 3
  for seed = 1, n do
    local z = kiln.randn({ 1, 4, 24, 24 }, { seed = seed })
    local zeros = t:decode(z)
    t.tileable = "xy"
    local a = t:decode(z)
    if seed == 1 then
      local b = t:decode(roll(roll(z, 5, 4), 3, 3))
      local ar = roll(roll(a, 40, 4), 24, 3)
      note("tileable decode shift", H.close_rel(b, ar, 1e-5, "decode equivariant to circular shifts"))
      -- tiled: as close to the untiled tileable decode as an ordinary tiled decode to its own
      local tw = t:decode(z, { tile = 16, overlap = 6 })
      t.tileable = nil
      local t0 = t:decode(z, { tile = 16, overlap = 6 })
      local ew, e0 = (tw - a):abs():mean(), (t0 - zeros):abs():mean()
      note("tiled tileable (mean abs)", ew)
      note("tiled ordinary (mean abs)", e0)
      H.truthy(ew <= e0, ("tiled tileable decode %.3g vs ordinary %.3g"):format(ew, e0))
      -- the encoder: a shift of the image by whole latent pixels shifts the latents
      t.tileable = "xy"
      local img = G["enc.img"]
      local e = t:encode(img)
      local er = t:encode(roll(roll(img, 16, 4), 8, 3))
      note("tileable encode shift", H.close_rel(er, roll(roll(e, 2, 4), 1, 3), 1e-5, "encode equivariant"))
      local te = t:encode(img, { tile = 4, overlap = 1 })
      t.tileable = nil
      local e0, te0 = t:encode(img), t:encode(img, { tile = 4, overlap = 1 })
      local dw, d0 = (te - e):abs():mean(), (te0 - e0):abs():mean()
      note("tiled tileable encode (mean abs)", dw)
      note("tiled ordinary encode (mean abs)", d0)
      H.truthy(dw <= 1.2 * d0, ("tiled tileable encode %.3g vs ordinary %.3g"):format(dw, d0))
    end
    t.tileable = nil
    zx, zy = zx + seam_ratio(zeros, 4) / n, zy + seam_ratio(zeros, 3) / n
    wx, wy = wx + seam_ratio(a, 4) / n, wy + seam_ratio(a, 3) / n
  end
  report[#report + 1] = ("seam / interior zeros %.2f/%.2f, tileable %.2f/%.2f"):format(zx, zy, wx, wy)
  H.truthy(zx > 2 and zy > 2, ("zero padding's seam %.2f / %.2f should be strong"):format(zx, zy))
  H.truthy(wx <= 1.5 and wy <= 1.5, ("tileable seam %.2f / %.2f"):format(wx, wy))
end)

test("taesd: --vae taesd and TAESD previews in a tileable run wrap around", function()
  local ck = T.TMP .. "/models/checkpoints/tiny.safetensors"
  local ckpt <close> = kiln.load_checkpoint(ck, { tokenizer = os.getenv("KILN_TOKENIZER") })
  local t <close> = kiln.load_taesd(DEC)
  local modes, pv = {}, {}
  local real = t._decode_untiled
  t._decode_untiled = function(self, z)
    modes[#modes + 1] = tostring(self.tileable)
    return real(self, z)
  end
  local img = kiln.pipeline.txt2img(ckpt, { prompt = "a red circle", steps = 2, width = 64, height = 64, seed = 1,
    vae = t, tileable = "xy" })
  img:free()
  eq(modes[#modes], "xy", "the decode wraps")
  eq(t.tileable, nil, "the mode is restored")
  modes = {}
  img = kiln.pipeline.txt2img(ckpt, { prompt = "a red circle", steps = 2, width = 64, height = 64, seed = 1,
    previewer = t, tileable = "x", preview = function(i) pv[#pv + 1] = i end })
  img:free()
  eq(#pv, 2, "a preview per step")
  eq(table.concat(modes, ","), "x,x", "the previews wrap")
  eq(t.tileable, nil, "the previewer's mode is restored")
end)

print("# taesd max relative errors: " .. table.concat(report, ", "))
T.cleanup({ "/models/checkpoints", "/models/vae_approx", "/models" })
H.done()
