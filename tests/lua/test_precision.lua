-- kiln.precision (bindings/l_runtime.c): the setting from Lua, what the PNG parameters
-- record, and the bundled demo model's picture in bf16 against f32 (kernels/cpu: bf16
-- inputs, f32 sums in the linear layers, convolutions and attention): PSNR >= 30 dB.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local imgcmp = require "imgcmp"

local initial = kiln.precision()

H.test("kiln.precision sets and returns the previous one", function()
  H.eq(kiln.precision("auto"), initial, "previous")
  H.eq(kiln.precision(), "f32", "the CPU's default")
  H.eq(kiln.precision("bf16"), "f32", "previous is f32")
  H.eq(kiln.precision(), "bf16", "now bf16")
  H.eq(kiln.precision_of("sim"), "bf16", "a set precision holds on every device")
  H.eq(kiln.precision("f16"), "bf16", "previous is bf16")
  H.eq(kiln.precision("f32"), "f16", "previous is f16")
  H.raises(function() kiln.precision("fp64") end, "f32, bf16, f16 or auto")
  H.eq(kiln.precision(), "f32", "unchanged by a bad name")
  kiln.precision("auto")
  H.eq(kiln.precision_of(), "f32", "auto: the device's default")
end)

H.test("the PNG parameters record the precision", function()
  local pipeline = require "kiln.pipeline"
  kiln.precision("bf16")
  local p = pipeline.parameters({ prompt = "p" }, nil)
  kiln.precision("auto")
  H.truthy(p:find("Precision: bf16", 1, true), p)
  H.truthy(pipeline.parameters({ prompt = "p" }, nil):find("Precision: f32", 1, true), "f32 by default")
end)

local MODEL = H.demo_model("demo model in bf16")

H.test("demo model: the bf16 picture against f32, PSNR >= 30 dB", function()
  local pipeline = require "kiln.pipeline"
  local ckpt <close> = kiln.load_checkpoint(MODEL)
  local opts = { prompt = "a red circle on a blue background", seed = 7, steps = 12, sampler = "euler",
    scheduler = "normal" }
  kiln.precision("f32")
  local a <close> = pipeline.txt2img(ckpt, opts)
  kiln.precision("bf16")
  local ok, b = pcall(pipeline.txt2img, ckpt, opts)
  kiln.precision("auto")
  if not ok then error(b, 0) end
  local psnr = imgcmp.psnr(b, a)
  print(("# demo model bf16 vs f32: PSNR %.1f dB"):format(psnr))
  H.truthy(psnr >= 30, ("PSNR %.1f dB < 30"):format(psnr))
  b:free()
end)

kiln.precision(initial == "f32" and "auto" or initial)
H.done()
