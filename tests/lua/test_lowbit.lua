-- Low-bit weights from Lua: kiln.load_gguf / save_gguf against the golden files
-- (tests/golden/gen_gguf.py), fp8 safetensors, linear and conv2d on fp8 and block
-- weights, model:load with an fp8 dtype, and the bundled demo model's UNet as GGUF
-- (q8_0, both name styles) and as fp8 safetensors running txt2img next to f16.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"

local G = "tests/golden/gguf/"
local TYPES = { "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k" }
local TMP = os.getenv("TMPDIR") or "/tmp"
local function tmp(name) return ("%s/kiln_lowbit_%d_%s"):format(TMP, math.random(1 << 30), name) end

local function maxdiff(a, b) return ((a:to("f32") - b:to("f32")):abs():max()) end

H.test("load_gguf decodes every type as the reference does", function()
  local g, meta = kiln.load_gguf(G .. "types.gguf")
  local e = kiln.load_safetensors(G .. "expected.safetensors")
  for _, ty in ipairs(TYPES) do
    local w = g["w." .. ty]
    H.eq(w.dtype, ty, "dtype")
    H.eq(w.shape[1], 4, ty .. " shape[1] (GGUF's dims reversed)")
    H.eq(w.shape[2], 512, ty .. " shape[2]")
    H.eq(maxdiff(w, e["y." .. ty]), 0, ty .. " decode")
    H.eq(maxdiff(e["x." .. ty]:to(ty), e["y." .. ty]), 0, ty .. " reference quantizer")
  end
  for _, ty in ipairs({ "f32", "f16", "bf16" }) do H.eq(maxdiff(g["w." .. ty], e["y." .. ty]), 0, ty) end
  H.eq(meta["general.architecture"], "sd1")
  H.eq(meta["general.alignment"], "64")
  H.eq(meta["test.bool"], "true")
  H.eq(meta["test.i64"], "-5")
  H.eq(meta["test.strings"], "[array of 2]")
  local v2 = kiln.load_gguf(G .. "v2.gguf")
  H.eq(maxdiff(v2["v2.q8_0"], e["y.v2"]), 0, "v2 file")
end)

H.test("fp8 safetensors load as f8 tensors and decode exactly", function()
  local f = kiln.load_safetensors(G .. "fp8.safetensors")
  local e = kiln.load_safetensors(G .. "expected.safetensors")
  H.eq(f.e4m3.dtype, "f8_e4m3fn")
  H.eq(f.e5m2.dtype, "f8_e5m2")
  for _, k in ipairs({ { "e4m3", "f8.e4m3fn" }, { "e5m2", "f8.e5m2" } }) do
    local got, want = f[k[1]]:to("f32"):table(), e[k[2]]:table()
    for i = 1, 256 do
      local a, b = got[i], want[i]
      H.truthy(a == b or (a ~= a and b ~= b), ("%s code %d: %s, expected %s"):format(k[1], i - 1, a, b))
    end
  end
end)

H.test("save_gguf quantizes matrices and keeps vectors", function()
  local w = kiln.randn({ 64, 256 }, { seed = 3 })
  local b = kiln.randn({ 64 }, { seed = 4 })
  local odd = kiln.randn({ 8, 3, 3, 3 }, { seed = 5 })
  local p = tmp("save.gguf")
  kiln.save_gguf(p, { w = w, b = b, odd = odd, h = w:to("f16"), e8 = w:to("f8_e4m3fn") },
    { type = "q4_k", metadata = { ["general.architecture"] = "sd1", note = "hi" } })
  local t, meta = kiln.load_gguf(p)
  H.eq(t.w.dtype, "q4_k")
  H.eq(t.h.dtype, "q4_k")
  H.eq(t.e8.dtype, "q4_k")
  H.eq(t.b.dtype, "f32")
  H.eq(t.odd.dtype, "f32", "a 3x3 kernel's rows are not whole blocks")
  H.eq(meta.note, "hi")
  H.eq(maxdiff(t.w, w:to("q4_k")), 0, "the same bytes as :to")
  H.eq(maxdiff(t.odd, odd), 0)
  os.remove(p)
  local ok, err = pcall(kiln.save_gguf, p, { w = w }, { type = "q3_k" })
  H.truthy(not ok and tostring(err):match("q3_k"), tostring(err))
end)

H.test("linear and conv2d on fp8 and block weights equal f32 on the decoded weights", function()
  local x = kiln.randn({ 2, 37, 512 }, { seed = 1 })
  local w = kiln.randn({ 96, 512 }, { seed = 2 })
  local b = kiln.randn({ 96 }, { seed = 3 })
  local xc = kiln.randn({ 1, 4, 9, 260 }, { seed = 5 })
  local wc = kiln.randn({ 8, 4, 3, 256 }, { seed = 4 })
  local dts = { "f8_e4m3fn", "f8_e5m2" }
  for _, ty in ipairs(TYPES) do dts[#dts + 1] = ty end
  for _, ty in ipairs(dts) do
    local wq = w:to(ty)
    local ref = kiln.nn.linear(x, wq:to("f32"), b)
    local d = maxdiff(kiln.nn.linear(x, wq, b), ref)
    H.truthy(d <= 1e-4 * (ref:abs():max()), ("%s linear: %g"):format(ty, d))
    local cq = wc:to(ty)
    local cref = kiln.nn.conv2d(xc, cq:to("f32"), b:narrow(1, 1, 8), { padding = 1 })
    local dc = maxdiff(kiln.nn.conv2d(xc, cq, b:narrow(1, 1, 8), { padding = 1 }), cref)
    H.truthy(dc <= 1e-4 * (cref:abs():max()), ("%s conv2d: %g"):format(ty, dc))
  end
end)

H.test("every fp8 code through linear decodes as its value", function()
  local f = kiln.load_safetensors(G .. "fp8.safetensors")
  local rows = {}
  for i = 1, 128 do
    rows[i] = {}
    for j = 1, 32 do rows[i][j] = (i - 1) % 32 + 1 == j and 1 or 0 end
  end
  local eye = kiln.tensor(rows) -- four identities: a product big enough for the packed kernel
  for _, k in ipairs({ "e4m3", "e5m2" }) do
    local w = f[k]:reshape({ 8, 32 })
    local got, want = kiln.nn.linear(eye, w):table(), kiln.nn.linear(eye, w:to("f32")):table()
    for i = 1, 128 do
      for j = 1, 8 do
        local a, b = got[i][j], want[i][j]
        H.truthy(a == b or (a ~= a and b ~= b), ("%s [%d][%d]: %s, expected %s"):format(k, i, j, a, b))
      end
    end
  end
end)

H.test("bad GGUF files give named errors", function()
  local good = assert(io.open(G .. "v2.gguf", "rb")):read("a")
  local p = tmp("bad.gguf")
  local function write(bytes) local f = assert(io.open(p, "wb")); f:write(bytes); f:close() end
  write(good:sub(1, #good - 40))
  local ok, err = pcall(kiln.load_gguf, p)
  H.truthy(not ok and tostring(err):match("truncated") and tostring(err):match("v2%.") and tostring(err):match(p, 1, true),
    tostring(err))
  write(good:sub(1, 8) .. string.pack("<I8", 1 << 40) .. good:sub(17))
  ok, err = pcall(kiln.load_gguf, p)
  H.truthy(not ok and tostring(err):match("cannot fit"), tostring(err))
  os.remove(p)
end)

H.test("model:load with an fp8 dtype stores the matrices as fp8", function()
  local p = tmp("m.safetensors")
  kiln.save_safetensors(p, { ["a.weight"] = kiln.randn({ 32, 64 }, { seed = 1 }), ["a.bias"] = kiln.randn({ 32 }, { seed = 2 }) })
  local m = kiln.model(p)
  m:load("cpu", { dtype = "f8_e4m3fn" })
  H.eq(m:tensor("a.weight").dtype, "f8_e4m3fn")
  H.eq(m:tensor("a.bias").dtype, "f32", "vectors keep their dtype")
  H.eq(m:bytes("cpu"), 32 * 64 + 32 * 4)
  m:close()
  os.remove(p)
end)

-- the demo model's UNet as GGUF / fp8 with the rest from the original file
local MODEL = H.demo_model("demo model present")
local pipeline = require "kiln.pipeline"
kiln.set_quiet(true)

local function unet_file(kind, bare)
  local t, meta = kiln.load_safetensors(MODEL)
  local out = {}
  for k, v in pairs(t) do
    local rest = k:match("^model%.diffusion_model%.(.*)$")
    if rest then out[bare and rest or k] = v end
  end
  local p
  if kind == "fp8" then
    p = tmp("unet_fp8.safetensors")
    for k, v in pairs(out) do if #v.shape >= 2 then out[k] = v:to("f8_e4m3fn") end end
    kiln.save_safetensors(p, out, meta)
  else
    p = tmp("unet_" .. kind .. ".gguf")
    kiln.save_gguf(p, out, { type = kind, metadata = meta })
  end
  return p
end

local function render(path, opts)
  local ckpt = kiln.load_checkpoint(path, opts)
  local img = pipeline.txt2img(ckpt, { prompt = "a red circle on a blue background", seed = 7, steps = 8,
    sampler = "euler", scheduler = "normal" })
  local count = {}
  for _, n in ipairs(ckpt.unet.model:names()) do
    local dt = ckpt.unet.model:tensor(n).dtype
    count[dt] = (count[dt] or 0) + 1
  end
  local kinds = {}
  for dt, n in pairs(count) do kinds[#kinds + 1] = ("%d %s"):format(n, dt) end
  table.sort(kinds)
  ckpt:close()
  return img, table.concat(kinds, ", ")
end

H.test("txt2img with a GGUF or fp8 UNet stays close to f16", function()
  local ref = render(MODEL)
  local rest = { vae = MODEL, clip = MODEL, tokenizer = "examples/models" }
  local f16p = tmp("unet_f16.gguf")
  do
    local t, meta = kiln.load_safetensors(MODEL)
    local out = {}
    for k, v in pairs(t) do if k:match("^model%.diffusion_model%.") then out[k] = v:to("f16") end end
    kiln.save_gguf(f16p, out, { metadata = meta })
  end
  local f16 = render(f16p, rest)
  print(("# f16 GGUF UNet vs the original file: max |diff| %.4f"):format(maxdiff(f16, ref)))
  for _, case in ipairs({ { "q8_0", false }, { "q8_0", true }, { "fp8", true }, { "q4_k", false } }) do
    local p = unet_file(case[1], case[2])
    local img, dt = render(p, rest)
    local d = maxdiff(img, f16)
    local mean = ((img - f16):abs():mean())
    print(("# %s UNet (%s names, stored %s) vs f16: max |diff| %.4f, mean %.4f"):format(case[1],
      case[2] and "bare" or "model.diffusion_model.", dt, d, mean))
    H.truthy(mean < (case[1] == "q4_k" and 0.08 or 0.03), ("%s: mean |diff| %.4f"):format(case[1], mean))
    os.remove(p)
  end
  os.remove(f16p)
  -- a whole checkpoint in one GGUF (stable-diffusion.cpp's layout): every part loads,
  -- the text encoder's token table in q8_0 too
  local t, meta = kiln.load_safetensors(MODEL)
  local full = tmp("full.gguf")
  kiln.save_gguf(full, t, { type = "q8_0", metadata = meta })
  local img = render(full, { tokenizer = "examples/models" })
  local d, mean = maxdiff(img, f16), ((img - f16):abs():mean())
  print(("# whole checkpoint in q8_0 GGUF vs f16: max |diff| %.4f, mean %.4f"):format(d, mean))
  H.truthy(mean < 0.03, ("whole q8_0 checkpoint: mean |diff| %.4f"):format(mean))
  os.remove(full)
end)

H.test("a GGUF of another architecture is refused by name", function()
  local p = tmp("hidream.gguf")
  kiln.save_gguf(p, { ["img_in.weight"] = kiln.randn({ 32, 64 }, { seed = 1 }) }, { metadata = { ["general.architecture"] = "hidream" } })
  local ok, err = pcall(kiln.load_checkpoint, p)
  H.truthy(not ok and tostring(err):match("unknown architecture 'hidream'") and tostring(err):match(p, 1, true), tostring(err))
  os.remove(p)
end)

H.done()
