-- kiln.encode_png: the bytes kiln.save_png writes, made in memory (kiln serve answers
-- with them); the same argument checks.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, eq, truthy, raises = H.test, H.eq, H.truthy, H.raises

test("encode_png: the same bytes as save_png's file, text chunks included, from any device and dtype", function()
  local img = kiln.rand({ 1, 3, 9, 13 }, { seed = 3 })
  local path = os.tmpname()
  local opts = { text = { parameters = "Steps: 4, Seed: 7", prompt = "un caf\u{e9}", n = 3 } }
  kiln.save_png(img, path, opts)
  local f = assert(io.open(path, "rb"))
  local file = f:read("a")
  f:close()
  os.remove(path)
  local mem = kiln.encode_png(img, opts)
  eq(#mem, #file)
  truthy(mem == file, "the bytes differ")
  eq(mem:sub(1, 8), "\137PNG\r\n\26\n")
  -- [C, H, W], f16 and sim give the same picture
  local h = img:to("f16"):to("sim")
  eq(kiln.encode_png(img:reshape({ 3, 9, 13 })), kiln.encode_png(img))
  truthy(#kiln.encode_png(h) > 0)
  h:free()
  img:free()
end)

test("encode_png: a wrong shape or text key is an error naming it", function()
  local t = kiln.zeros({ 2, 3, 4, 4 })
  raises(function() kiln.encode_png(t) end, "encode_png: expected an image tensor")
  t:free()
  local img = kiln.zeros({ 1, 3, 4, 4 })
  raises(function() kiln.encode_png(img, { text = { [1] = "x" } }) end, "text keys must be strings")
  img:free()
end)

H.done()
