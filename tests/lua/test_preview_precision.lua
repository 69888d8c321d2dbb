-- The TAESD previews' own precision (preview_precision, --preview-precision) over
-- kiln.with_precision (a precision scoped to the calling thread): the scope's rules,
-- the option's values and default, the bf16 preview against the f32 one (PSNR >= 30 dB,
-- the house bound for bf16 pictures, and not bit-identical where the CPU has bf16
-- products), and the run's own precision untouched: its picture, the script's preview
-- function, and the process-wide setting after an error inside a preview.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local imgcmp = require "imgcmp"
local preview = require "kiln.preview"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local T = require "tiny_sd"
local DEMO = H.demo_model("TAESD previews in their own precision")
local BF16 = kiln.cpu_has_bf16()
kiln.set_quiet(true)

test("with_precision: scoped, nested, restored on return and on error", function()
  local before = kiln.precision()
  eq(before, "f32", "the CPU's default")
  local a, b, c = kiln.with_precision("bf16", function(x, y)
    eq(kiln.precision_of(), "bf16", "precision_of inside")
    eq(kiln.precision_of("sim"), "bf16", "on every device")
    eq(kiln.precision(), "bf16", "kiln.precision() inside")
    kiln.with_precision("f16", function() eq(kiln.precision_of(), "f16", "nested") end)
    eq(kiln.precision_of(), "bf16", "the outer scope again")
    kiln.with_precision("auto", function() eq(kiln.precision_of(), "f32", "auto: the process-wide one") end)
    kiln.with_precision(nil, function() eq(kiln.precision_of(), "f32", "nil: the process-wide one") end)
    return x + y, "two", nil
  end, 1, 2)
  eq(a, 3); eq(b, "two"); eq(c, nil)
  eq(select("#", kiln.with_precision("f32", function() return 1, nil, nil end)), 3, "every result")
  eq(kiln.precision_of(), "f32", "after return")
  -- the error goes on unchanged (a table stays the same table), and the scope ends
  local e = setmetatable({ kind = "mine" }, { __tostring = function() return "mine" end })
  local ok, got = pcall(kiln.with_precision, "bf16", function() error(e) end)
  truthy(not ok and got == e, "the same error value")
  eq(kiln.precision_of(), "f32", "after an error")
  ok, got = pcall(kiln.with_precision, "bf16", function() error("boom", 0) end)
  truthy(not ok and got == "boom", tostring(got))
  -- a process-wide bf16 under an f32 scope
  kiln.precision("bf16")
  kiln.with_precision("f32", function() eq(kiln.precision_of(), "f32", "the scope wins over the set one") end)
  eq(kiln.precision("auto"), "bf16", "the set one is back")
  raises(function() kiln.with_precision("fp64", function() end) end, "f32, bf16, f16 or auto")
  raises(function() kiln.with_precision("bf16") end, "function expected")
  eq(kiln.precision_of(), "f32", "unchanged by bad calls")
end)

test("preview_precision: values and default", function()
  eq(preview.precision_for("f32", "cpu"), "f32")
  eq(preview.precision_for("run", "cpu"), "run")
  eq(preview.precision_for(nil, "cpu"), BF16 and "bf16" or "run", "the CPU's default")
  eq(preview.precision_for(nil, "sim"), BF16 and "bf16" or "run", "sim runs the CPU's kernels")
  eq(preview.precision_for(nil, "cuda:0"), "run", "a GPU: the run's (already half)")
  eq(type(BF16), "boolean")
end)

-- txt2img on the demo model with TAESD previews; returns the final picture and copies
-- of the previews (step -> image)
local function run(ckpt, opts)
  local o = { prompt = "a red circle", steps = 4, width = 64, height = 64, seed = 3, preview_every = 2 }
  for k, v in pairs(opts) do o[k] = v end
  local pics = {}
  if o.preview == nil then
    o.preview = function(step, _, img)
      eq(kiln.precision_of(), "f32", "the script's preview function runs in the run's precision")
      pics[step] = img + 0
    end
  end
  return kiln.pipeline.txt2img(ckpt, o), pics
end

local function free_all(list) for _, t in pairs(list) do t:free() end end

local DEC = T.tmp("taesd_decoder.safetensors")
kiln.save_safetensors(DEC, T.build_recipe("../taesd/decoder"))

test("preview_precision: bad values named (option and command line)", function()
  local ckpt <close> = kiln.load_checkpoint(DEMO)
  raises(function() run(ckpt, { previewer = "latent2rgb", preview_precision = "bf32" }) end,
    "preview_precision must be", "'bf32'")
  raises(function() run(ckpt, { preview_precision = 16 }) end, "preview_precision must be", "number")
  local exe = arg and arg[-1]
  if not exe or not exe:match("kiln$") then H.skip("not run by the kiln program (arg[-1] = " .. tostring(exe) .. ")") end
  local p = io.popen(("'%s' examples/txt2img.lua --steps 1 --preview-precision half 2>&1"):format(exe))
  local out = p:read("a")
  local ok, _, code = p:close()
  truthy(not ok and code == 2, "usage error exit status, got " .. tostring(code))
  truthy(out:find("--preview-precision half: must be f32, bf16, f16 or run", 1, true), out)
end)

test("preview_precision: bf16 previews against f32 (PSNR), the run's picture untouched", function()
  local t <close> = kiln.load_taesd({ decoder = DEC })
  local ckpt <close> = kiln.load_checkpoint(DEMO)
  local img32, p32 = run(ckpt, { previewer = t, preview_precision = "f32" })
  local img16, p16 = run(ckpt, { previewer = t, preview_precision = "bf16" })
  local imgd, pd = run(ckpt, { previewer = t })
  truthy(p32[2] and p32[4] and p16[2] and p16[4], "previews at steps 2 and 4")
  eq(H.maxdiff(img32, img16), 0, "the run's picture does not depend on the previews' precision")
  eq(H.maxdiff(img32, imgd), 0, "nor with the default")
  local identical = true
  for step, a in pairs(p32) do
    local b = p16[step]
    local psnr = imgcmp.psnr(b, a)
    print(("# TAESD preview at step %d, bf16 vs f32: PSNR %.1f dB, max diff %.3g"):format(step, psnr, H.maxdiff(a, b)))
    truthy(psnr >= 30, ("step %d: PSNR %.1f dB"):format(step, psnr))
    if H.maxdiff(a, b) > 0 then identical = false end
    -- the default is bf16 where the CPU has native bf16 products, else the run's f32
    eq(H.maxdiff(pd[step], BF16 and b or a), 0, "the default preview at step " .. step)
  end
  img32:free(); img16:free(); imgd:free()
  free_all(p32); free_all(p16); free_all(pd)
  if not BF16 then H.skip("no native bf16 products on this CPU (kiln.cpu_has_bf16): bf16 previews may equal f32") end
  truthy(not identical, "the bf16 previews differ from the f32 ones (bf16 really ran)")
end)

test("preview_precision: the process-wide precision is unchanged, also after errors", function()
  local t <close> = kiln.load_taesd({ decoder = DEC })
  local ckpt <close> = kiln.load_checkpoint(DEMO)
  for _, set in ipairs({ "auto", "f32" }) do
    kiln.precision(set)
    local before, was_set = kiln.precision_of(), set
    local img, pics = run(ckpt, { previewer = t, preview_precision = "bf16" })
    img:free(); free_all(pics)
    eq(kiln.precision_of(), before, "after the previews (" .. was_set .. ")")
    -- an error in the script's preview function
    raises(function()
      run(ckpt, { previewer = t, preview_precision = "bf16", preview = function() error("boom from preview") end })
    end, "boom from preview")
    eq(kiln.precision_of(), before, "after an error in the preview function (" .. was_set .. ")")
    -- an error inside the decode, while the bf16 scope is open
    local seen
    local failing = setmetatable({ decode = function()
      seen = kiln.precision_of()
      error("boom from decode")
    end }, { __index = t })
    raises(function() run(ckpt, { previewer = failing, preview_precision = "bf16" }) end, "boom from decode")
    eq(seen, "bf16", "the decode ran in the scope")
    eq(kiln.precision_of(), before, "after an error in the decode (" .. was_set .. ")")
  end
  kiln.precision("auto")
end)

test("preview_precision: TAESD as the run's VAE follows the run, not the option", function()
  local t <close> = kiln.load_taesd({ decoder = DEC })
  local ckpt <close> = kiln.load_checkpoint(DEMO, { vae = t })
  truthy(ckpt.vae.is_taesd, "ckpt.vae is the TAESD")
  local a, pa = run(ckpt, { previewer = "taesd", preview_precision = "bf16" })
  local den
  local b, pb = run(ckpt, { previewer = "taesd", preview_precision = "f32",
    callback = function(st) if st.i == st.n then den = st.denoised + 0 end end })
  eq(H.maxdiff(a, b), 0, "the final picture (TAESD-decoded) is the run's f32 one either way")
  -- the last preview is the f32 decode of the last step's denoised latents
  local d = t:decode(den)
  eq(H.maxdiff(pb[4], d), 0, "the f32 preview of the last step is the f32 decode of its latents")
  -- and those are the final latents up to the rounding of Euler's last step,
  -- x + (x - denoised) / sigma * (0 - sigma), which is not always bit for bit the
  -- denoised latents (it was on one machine, not on another): the same picture within
  -- f32 rounding
  local diff = H.maxdiff(pb[4], b)
  truthy(diff <= 1e-5, "the f32 preview of the last step is the picture: max diff " .. diff)
  a:free(); b:free(); d:free(); den:free(); free_all(pa); free_all(pb)
end)

T.cleanup()
H.done()
