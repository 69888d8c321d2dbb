-- kiln.json: decode over the runtime's strict reader and encode back; round trips,
-- errors that give the byte offset, nesting bounds, what encode refuses; and
-- kiln.format_bytes, the runtime's byte formatter.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local json = kiln.json
local test, eq, raises = H.test, H.eq, H.raises

-- Deep comparison (kiln.json.null compares equal to itself).
local function same(a, b, path)
  path = path or "value"
  if type(a) ~= "table" or type(b) ~= "table" then
    if a ~= b or math.type(a) ~= math.type(b) then
      error(("%s: %s (%s) ~= %s (%s)"):format(path, tostring(a), math.type(a) or type(a),
        tostring(b), math.type(b) or type(b)), 2)
    end
    return
  end
  for k, v in pairs(a) do same(v, b[k], path .. "." .. tostring(k)) end
  for k in pairs(b) do
    if a[k] == nil then error(path .. "." .. tostring(k) .. " missing", 2) end
  end
end

test("decode: values", function()
  local v = json.decode('{"a": [1, 2.5, "x", true, false, null], "b": {"c": -7}, "e": 1e3}')
  eq(v.a[1], 1); eq(math.type(v.a[1]), "integer")
  eq(v.a[2], 2.5); eq(v.a[3], "x"); eq(v.a[4], true); eq(v.a[5], false)
  eq(v.a[6], json.null); eq(#v.a, 6)
  eq(v.b.c, -7); eq(v.e, 1000.0)
  eq(json.decode("9007199254740993"), 9007199254740993) -- exact past 2^53
  eq(json.decode('"\\u00e9\\ud83d\\ude00\\n"'), "\u{e9}\u{1F600}\n")
  eq(json.decode('"a\\u0000b"'), "a\0b")
  eq(json.decode(" null "), json.null)
  eq(tostring(json.null), "null")
end)

test("encode: values and layout", function()
  eq(json.encode({ 1, 2, 3 }), "[1,2,3]")
  eq(json.encode({ b = 1, a = { true, false }, c = json.null }), '{"a":[true,false],"b":1,"c":null}')
  eq(json.encode("quote \" back \\ nl \n tab \t bell \7 \u{e9}"),
    '"quote \\" back \\\\ nl \\n tab \\t bell \\u0007 \u{e9}"')
  eq(json.encode(nil), "null")
  eq(json.encode(json.null), "null")
  eq(json.encode(0.1), "0.1")
  eq(json.encode(1e300), "1e+300")
  eq(json.encode(math.maxinteger), "9223372036854775807")
  eq(json.encode(-3), "-3")
  eq(json.encode({}), "{}")
  eq(json.encode({ [1] = "a", [3] = "c" }), '{"1":"a","3":"c"}') -- not 1..n: an object
  eq(json.encode({ [2] = "b", x = 1 }), '{"2":"b","x":1}')
  eq(json.encode(setmetatable({}, { __jsontype = "array" })), "[]")
  eq(json.encode(setmetatable({ 1 }, { __jsontype = "object" })), '{"1":1}')
end)

test("round trip", function()
  local docs = {
    '{"a":[1,2.5,"x",true,false,null],"b":{"c":-7,"d":[]},"e":{},"f":"\\u00e9\\n"}',
    '[[],[[]],{"":0}]',
    '[0.1,0.2,0.30000000000000004,1e-300,-0.5,123456789012,3.141592653589793]',
  }
  for _, text in ipairs(docs) do
    local v = json.decode(text)
    same(json.decode(json.encode(v)), v)
  end
  -- encode of a decoded document is stable
  local text = json.encode(json.decode(docs[1]))
  eq(json.encode(json.decode(text)), text)
  eq(json.encode(json.decode("[]")), "[]") -- empty arrays stay arrays
  local t = { name = "fox", steps = 20, cfg = 7.5, sizes = { 512, 768 }, tags = { "a", "b" } }
  same(json.decode(json.encode(t)), t)
end)

test("decode errors give the byte offset", function()
  raises(function() json.decode('{"a": 1,}') end, "json:", "byte 8")
  raises(function() json.decode("[1, 2") end, "json:", "byte")
  raises(function() json.decode('{"a" 1}') end, "byte 5")
  raises(function() json.decode("[1] x") end, "after the value", "byte 4")
  raises(function() json.decode('"\255"') end, "UTF-8", "byte 1")
  raises(function() json.decode("") end, "json:")
  raises(function() json.decode("01") end, "json:")
  raises(function() json.decode("NaN") end, "json:")
  raises(function() json.decode({}) end, "string expected")
end)

test("nesting bounds", function()
  local deep_ok = string.rep("[", 64) .. string.rep("]", 64)
  local v = json.decode(deep_ok)
  eq(json.encode(v), deep_ok)
  raises(function() json.decode(string.rep("[", 65) .. string.rep("]", 65)) end, "nesting", "64")
  raises(function() json.decode(string.rep("[", 100000)) end, "nesting")
  local t = {}
  local cur = t
  for _ = 1, 64 do cur[1] = {}; cur = cur[1] end
  raises(function() json.encode(t) end, "deeper than 64")
end)

test("encode refuses what JSON cannot say", function()
  local c = {}
  c.self = c
  raises(function() json.encode(c) end, "cycle")
  local a = { 1 }
  a[2] = a
  raises(function() json.encode(a) end, "cycle")
  local shared = { 1 }
  eq(json.encode({ shared, shared }), "[[1],[1]]") -- shared is not a cycle
  raises(function() json.encode(0 / 0) end, "nan")
  raises(function() json.encode({ x = math.huge }) end, "inf")
  raises(function() json.encode(-math.huge) end, "-inf")
  raises(function() json.encode(print) end, "cannot encode a function")
  raises(function() json.encode({ [true] = 1 }) end, "key is a boolean")
  raises(function() json.encode("\255") end, "not valid UTF-8")
  raises(function() json.encode({ [1] = "a", ["1"] = "b", [3] = 0 }) end, "appears twice")
  raises(function() json.encode(setmetatable({ x = 1 }, { __jsontype = "array" })) end, "marked as an array")
  raises(function() json.encode() end, "value expected")
end)

test("kiln.format_bytes", function()
  eq(kiln.format_bytes(0), "0 B")
  eq(kiln.format_bytes(512), "512 B")
  eq(kiln.format_bytes(1536), "1.50 KiB")
  eq(kiln.format_bytes(12 * 2 ^ 20), "12.0 MiB")
  eq(kiln.format_bytes(512 * 2 ^ 20), "512 MiB")
  eq(kiln.format_bytes(1.5 * 2 ^ 30), "1.50 GiB")
  eq(kiln.format_bytes(2 * 2 ^ 40), "2.00 TiB")
  raises(function() kiln.format_bytes("lots") end, "number expected")
end)
