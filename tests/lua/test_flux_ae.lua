-- Flux's 16-channel autoencoder (kiln.vae without quant_conv / post_quant_conv, latents
-- (z - 0.1159) * 0.3611): the tiny AutoEncoder of tests/golden/gen_flux_ae.py (Black
-- Forest Labs' own autoencoder.py, weights rebuilt from its recipe) encodes and decodes
-- within 1e-4 through ckpt.vae, in BFL's names and under the prefixes single files use
-- (vae., first_stage_model.); tiled decode / encode follow the untiled ones, and mode
-- "low" on sim streams it block by block to the same numbers.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local imgcmp = require "imgcmp"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local MiB = 1024 * 1024
local IO = kiln.load_safetensors("tests/golden/flux/io.safetensors")
local AEIO = kiln.load_safetensors("tests/golden/flux/ae_io.safetensors")
local TOL = 1e-4

local flux_w, FLUX_META = T.build_recipe("../flux/flux")
local ae_w = T.build_recipe("../flux/ae")

local files = {}
local function save(name, t, meta)
  if not files[name] then
    files[name] = T.tmp(name .. ".safetensors")
    kiln.save_safetensors(files[name], t, meta)
  end
  return files[name]
end
local function dit_file() return save("flux-dit", flux_w, FLUX_META) end
local function ae_file(prefix)
  local t = {}
  for k, v in pairs(ae_w) do t[(prefix or "") .. k] = v end
  return save("ae" .. (prefix or ""), t)
end

-- max |a - b| / max |b|
local function rel(a, b)
  eq(H.shape_of(a), H.shape_of(b), "shape")
  local d = (a:to("cpu"):to("f32") - b):abs():max()
  return d / b:abs():max()
end

if kiln.set_quiet then kiln.set_quiet(true) end
local report = {}

for _, prefix in ipairs({ "", "vae.", "first_stage_model." }) do
  test("Flux AE (" .. (prefix == "" and "BFL's names" or prefix) .. "): encode and decode match BFL's AutoEncoder", function()
    local ck <close> = kiln.load_checkpoint(dit_file(), { vae = ae_file(prefix) })
    local v = ck.vae
    eq(v.latent_channels, 16)
    eq(v.factor, 8)
    eq(v.scale_factor, 0.3611)
    eq(v.shift_factor, 0.1159)
    eq(v.config.quant, false)
    local z = v:encode(AEIO.image)
    local r1 = rel(z, AEIO.latent)
    truthy(r1 <= TOL, "encode: " .. r1)
    local img = v:decode(AEIO.z)
    local r2 = rel(img, AEIO.decoded)
    truthy(r2 <= TOL, "decode: " .. r2)
    if prefix == "" then
      report[#report + 1] = ("encode %.2e, decode %.2e"):format(r1, r2)
    end
    z:free(); img:free()
  end)
end

test("Flux AE: tiled decode and encode follow the untiled ones (image-wide GroupNorm)", function()
  local ck <close> = kiln.load_checkpoint(dit_file(), { vae = ae_file() })
  -- a smooth latent of 32 x 48: tiles of 16 with an overlap of 4
  local z = kiln.nn.interpolate(AEIO.z, { size = { 32, 48 }, mode = "bilinear" })
  local full = ck.vae:decode(z)
  local img = ck.vae:decode(z, { tile = 16, overlap = 4 })
  local p = imgcmp.psnr(img, full)
  truthy(p >= 35, ("tiled decode: PSNR %.1f dB"):format(p))
  local lat = ck.vae:encode(full)
  local lat2 = ck.vae:encode(full, { tile = 16, overlap = 4 })
  local p2 = imgcmp.psnr(lat2, lat)
  truthy(p2 >= 35, ("tiled encode: PSNR %.1f dB"):format(p2))
  report[#report + 1] = ("tiled (16/4 on 32x48) decode %.1f dB, encode %.1f dB against untiled"):format(p, p2)
  img:free(); z:free(); full:free(); lat:free(); lat2:free()
end)

test("Flux AE: a latent of the wrong width is refused by name", function()
  local ck <close> = kiln.load_checkpoint(dit_file(), { vae = ae_file() })
  local err = raises(function() return ck.vae:decode(kiln.zeros({ 1, 4, 8, 8 })) end)
  truthy(err:find("16", 1, true), err)
end)

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

test("Flux AE: mode low on sim streams the blocks inside a budget, same numbers", function()
  if not has_sim then H.skip("no sim device") end
  local ck <close> = kiln.load_checkpoint(dit_file(), { vae = ae_file() })
  kiln.memory_mode("high")
  ck.vae:load("sim")
  local weights = ck.vae:bytes("sim")
  ck.vae:unload()
  kiln.memory_mode("low")
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
  local base = kiln.mem.stats("sim").allocated
  local budget = base + 16 * MiB
  kiln.mem.set_budget("sim", budget)
  kiln.mem.reset_peak("sim")
  ck.vae:load("sim")
  eq(ck.vae:bytes("sim"), 0, "low mode keeps the weights on the host")
  local ok, img = pcall(ck.vae.decode, ck.vae, AEIO.z)
  local peak = kiln.mem.stats("sim").peak
  kiln.mem.set_budget("sim", 8 * 1024 * MiB)
  kiln.memory_mode("normal")
  truthy(ok, tostring(img))
  local r = rel(img, AEIO.decoded)
  truthy(r <= TOL, "low mode: " .. r)
  truthy(peak - base <= budget - base, ("peak %d inside the budget %d"):format(peak - base, budget - base))
  report[#report + 1] = ("low mode on sim: weights %.2f MiB, peak %.2f MiB"):format(weights / MiB, (peak - base) / MiB)
  img:free()
  ck.vae:unload()
end)

H.done(function() for _, l in ipairs(report) do print("  " .. l) end end)
