-- The bundled demo model against PyTorch: tests/golden/model/* are written by
-- tests/golden/gen_model_golden.py from the same checkpoint with the reference
-- modules of examples/models/sd_modules.py (f32). Token ids must be equal; the text
-- encoder, UNet and VAE outputs equal within the stated relative tolerances (kiln
-- computes in f32 from the same f16 weights).
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"

local MODEL = H.demo_model("demo model goldens")
local DIR = "tests/golden/model/"

local ckpt <close> = kiln.load_checkpoint(MODEL)
local notes = {}

local function golden(name)
  local t, meta = kiln.load_safetensors(DIR .. name .. ".safetensors")
  return t, meta
end

-- max |a - b| / max |b|
local function rel(a, b)
  H.eq(table.concat(a.shape, ","), table.concat(b.shape, ","), "shape")
  local d = (a - b):abs():max()
  local m = b:abs():max()
  return d / math.max(m, 1e-12)
end

local function check(what, got, want, tol)
  local r = rel(got, want)
  notes[#notes + 1] = ("%s %.2g"):format(what, r)
  H.truthy(r <= tol, ("%s: relative error %.3g > %.3g"):format(what, r, tol))
end

H.test("tokenizer ids equal the reference tokenizer's", function()
  local g, meta = golden("tokenizer")
  local ids = g.ids:table()
  for i = 0, 2 do
    local got = ckpt.clip:tokenize(meta["prompt." .. i])
    H.eq(#got, 77, "window")
    for j = 1, 77 do H.eq(got[j], math.tointeger(ids[i + 1][j]), ("prompt %d token %d"):format(i, j)) end
  end
  local u = ckpt.clip:tokenize("")
  local uids = g.uncond_ids:table()[1]
  for j = 1, 77 do H.eq(u[j], math.tointeger(uids[j]), "empty prompt token " .. j) end
end)

H.test("text encoder matches PyTorch", function()
  local g, meta = golden("clip")
  for i = 0, 2 do
    local c = ckpt.clip:encode(meta["prompt." .. i])
    check("clip prompt " .. i, c, g.out:narrow(1, i + 1, 1), 1e-5)
    c:free()
  end
  local u = ckpt.clip:encode("")
  check("clip empty", u, g.uncond_out, 1e-5)
  u:free()
end)

H.test("UNet matches PyTorch (v-prediction output)", function()
  local g = golden("unet")
  local out = ckpt.unet:forward(g.x, g.t:to("f32"), g.context)
  check("unet", out, g.out, 1e-4)
  out:free()
end)

H.test("VAE encode and decode match PyTorch", function()
  local g = golden("vae")
  local z = ckpt.vae:encode(g.image)
  check("vae encode", z, g.encode_out, 1e-4)
  local img = ckpt.vae:decode(g.decode_in)
  check("vae decode", img, g.decode_out, 1e-4)
  z:free(); img:free()
end)

print("# max relative error: " .. table.concat(notes, ", "))
H.done()
