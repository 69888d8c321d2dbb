-- The REPL's result printer (kiln.repl.format) and kiln.show: tensors with their
-- values, tables with their contents, checkpoints and models on one line, and the
-- picture protocols chosen from the environment (kitty, iTerm2, sixel, a PNG file).
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local repl = require "kiln.repl"
local test, eq, truthy = H.test, H.eq, H.truthy

local function has(s, part, what)
  if not s:find(part, 1, true) then error(("%s: %q not in %q"):format(what or "output", part, s), 2) end
end

-- A writer that keeps what it is given.
local function sink()
  local parts = {}
  return { write = function(self, ...) for _, s in ipairs({ ... }) do parts[#parts + 1] = s end return self end,
           text = function() return table.concat(parts) end }
end

test("small tensor shows its values", function()
  local s = repl.format(kiln.tensor({ { 1, 2 }, { 3, 4 } }))
  eq(s, "tensor(f32, cpu, [2,2], 16 B)\n[[1, 2],\n [3, 4]]")
  s = repl.format(kiln.tensor({ 0.5, -1.25 }))
  has(s, "[ 0.5000, -1.2500]")
end)

test("f16, bf16 and sim tensors are read through f32", function()
  has(repl.format(kiln.tensor({ 1.5, 2.25 }, "f16")), "[1.5000, 2.2500]", "f16")
  has(repl.format(kiln.tensor({ 1.5, 2.25 }, "bf16")), "[1.5000, 2.2500]", "bf16")
  local t = kiln.tensor({ { 1, 2 }, { 3, 4 } }):to("sim")
  local s = repl.format(t)
  has(s, "sim", "device in the summary")
  has(s, "[3, 4]]", "values")
end)

test("large tensor is elided with min, max and mean", function()
  local t = kiln.randn({ 4, 100 }, { seed = 1 })
  local s = repl.format(t)
  has(s, "...", "elision")
  has(s, "min ")
  has(s, "max ")
  has(s, "mean ")
  -- the corners are the tensor's own numbers
  local first = t:narrow(1, 1, 1):narrow(2, 1, 1):item()
  has(s, ("%.4f"):format(first), "first value")
  truthy(#s < 2000, "bounded output (" .. #s .. " characters)")
end)

test("scalar and empty tensors", function()
  has(repl.format(kiln.tensor({ 7 }):reshape({})), "\n7")
  has(repl.format(kiln.zeros({ 0 })), "[]")
end)

test("tables show their contents, nested and bounded", function()
  eq(repl.format({ 1, 2, x = "a" }), '{1, 2, x = "a"}')
  eq(repl.format({ ["not id"] = true, [false] = 1 }), '{[false] = 1, ["not id"] = true}')
  local deep = { { { { { { 1 } } } } } }
  has(repl.format(deep), "{...}", "depth bound")
  local many = {}
  for i = 1, 100 do many[i] = i end
  has(repl.format(many), "... (70 more)", "count bound")
  local cyc = { name = "c" }
  cyc.self = cyc
  eq(repl.format(cyc), '{name = "c", self = <cycle>}')
  -- a table seen twice but not inside itself is shown twice
  local shared = { 1 }
  eq(repl.format({ shared, shared }), "{{1}, {1}}")
  -- tensor values as :table() gives them
  eq(repl.format(kiln.tensor({ { 1, 2 } }):table()), "{{1.0, 2.0}}")
  -- a tensor inside a table: its summary
  has(repl.format({ t = kiln.zeros({ 2 }) }), "t = tensor(f32, cpu, [2]")
  -- strings: as themselves at the top, quoted inside
  eq(repl.format("a\nb"), "a\nb")
  eq(repl.format({ "a\nb" }), '{"a\\nb"}')
end)

test("long tables break over lines", function()
  local t = {}
  for i = 1, 12 do t["key" .. i] = ("value %d"):format(i) end
  local s = repl.format(t)
  has(s, "{\n  key1 = ", "one entry a line")
end)

test("checkpoints and models on one line", function()
  local model_path = "examples/models/kiln-shapes.safetensors"
  local f = io.open(model_path, "rb")
  if not f then H.skip(model_path .. " not found") end
  f:close()
  local m = kiln.model(model_path)
  local s = repl.format(m)
  truthy(not s:find("\n"), "one line")
  has(s, "model(")
  m:close()
  local ok, ck = pcall(kiln.load_checkpoint, model_path)
  if not ok then H.skip("kiln.load_checkpoint: " .. tostring(ck)) end
  s = repl.format(ck)
  truthy(not s:find("\n"), "one line: " .. s)
  has(s, "checkpoint(" .. ck.family)
  has(s, "kiln-shapes.safetensors")
  has(s, "unet mapped")
  ck.unet:load("cpu")
  has(repl.format(ck), "unet on cpu")
  for _, part in ipairs({ "clip", "unet", "vae" }) do ck[part]:close() end
end)

test("the protocol follows the environment", function()
  eq(repl.protocol({ KITTY_WINDOW_ID = "1", TERM = "xterm-kitty" }), "kitty")
  eq(repl.protocol({ TERM = "xterm-kitty" }), "kitty")
  eq(repl.protocol({ TERM_PROGRAM = "iTerm.app" }), "iterm")
  eq(repl.protocol({ LC_TERMINAL = "iTerm2" }), "iterm")
  eq(repl.protocol({ TERM = "mlterm" }), "sixel")
  eq(repl.protocol({ TERM = "foot" }), "sixel")
  eq(repl.protocol({ TERM = "xterm-256color" }), "file")
  eq(repl.protocol({}), "file")
  eq(repl.protocol({ TERM = "xterm-kitty", KILN_SHOW = "file" }), "file")
  eq(repl.protocol(function(k) return k == "KITTY_WINDOW_ID" and "3" or nil end), "kitty")
end)

local function image()
  local img = kiln.zeros({ 1, 3, 4, 6 })
  img:narrow(2, 1, 1):fill(1) -- red
  return img
end

test("kiln.show falls back to a PNG in the temp folder", function()
  local out = sink()
  local protocol, path = kiln.show(image(), { env = { TERM = "dumb" }, out = out })
  eq(protocol, "file")
  eq(out.text(), path .. "\n", "prints the path")
  truthy(path:match("%.png$"), path)
  local back = kiln.load_png(path)
  eq(table.concat(back.shape, ","), "1,3,4,6")
  H.near(back:narrow(2, 1, 1):min(), 1, 1e-6, "red channel")
  H.near(back:narrow(2, 2, 1):max(), 0, 1e-6, "green channel")
  os.remove(path)
  -- $TMPDIR names the folder
  local dir = os.tmpname()
  os.remove(dir)
  os.execute("mkdir -p '" .. dir .. "'")
  protocol, path = kiln.show(image(), { env = { TMPDIR = dir }, out = sink() })
  eq(path:sub(1, #dir + 1), dir .. "/", "in $TMPDIR")
  os.remove(path)
  os.remove(dir)
  -- the shapes an image may have
  local _, p2 = kiln.show(kiln.zeros({ 3, 4, 6 }), { protocol = "file", out = sink() })
  os.remove(p2)
  H.raises(function() kiln.show(kiln.zeros({ 5 }), { protocol = "file", out = sink() }) end, "kiln.show")
end)

test("kiln.show writes kitty's escape sequences", function()
  local out = sink()
  eq(kiln.show(image(), { env = { KITTY_WINDOW_ID = "1" }, out = out }), "kitty")
  local s = out.text()
  truthy(s:sub(1, 3) == "\27_G", "starts an APC graphics command")
  has(s, "a=T,f=100", "transmit-and-show a PNG")
  truthy(s:sub(-3) == "\27\\\n", "ends with ST")
  local payload = s:match("^\27_G[^;]*;([^\27]*)\27\\")
  truthy(payload and payload:sub(1, 8) == repl.base64("\137PNG\r\n\26\n"):sub(1, 8), "a base64 PNG")
  -- chunks of 4096, all but the last with m=1
  local big = string.rep("x", 7000)
  local seq = repl.kitty_sequence(big)
  local n = 0
  for keys, chunk in seq:gmatch("\27_G([^;]*);([^\27]*)\27\\") do
    n = n + 1
    truthy(#chunk <= 4096, "chunk size")
    if n == 1 then eq(keys, "a=T,f=100,m=1") end
  end
  eq(n, 3)
  has(seq, "\27_Gm=0;", "last chunk")
end)

test("kiln.show writes iTerm2 and sixel sequences", function()
  local out = sink()
  eq(kiln.show(image(), { env = { TERM_PROGRAM = "iTerm.app" }, out = out }), "iterm")
  local s = out.text()
  truthy(s:sub(1, 14) == "\27]1337;File=in", "OSC 1337")
  has(s, "inline=1")
  out = sink()
  eq(kiln.show(image(), { protocol = "sixel", out = out }), "sixel")
  s = out.text()
  truthy(s:sub(1, 3) == "\27Pq", "DCS q")
  has(s, '"1;1;6;4', "raster attributes: 6x4")
  has(s, "#180;2;100;0;0", "red in the palette")
  truthy(s:sub(-3) == "\27\\\n", "ends with ST")
end)

test("base64", function()
  eq(repl.base64(""), "")
  eq(repl.base64("f"), "Zg==")
  eq(repl.base64("fo"), "Zm8=")
  eq(repl.base64("foobar"), "Zm9vYmFy")
end)
