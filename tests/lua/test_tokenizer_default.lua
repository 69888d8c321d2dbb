-- test_tokenizer_default.lua - where a checkpoint's tokenizer comes from: the built-in
-- CLIP vocabulary (kiln.tokenizer() with no path) for a file with nothing beside it,
-- files beside the checkpoint or beside the file a symbolic link leads to, the
-- tokenizer option, and $KILN_TOKENIZER (set in a child process, since a script cannot
-- set its own environment).
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local SHARED = os.getenv("KILN_SHARED") or "../shared"
local DEMO = H.demo_model("tokenizer default")
local DEMO_DIR = DEMO:match("^(.*)/[^/]*$") or "."
local BUILTIN = "built-in CLIP vocabulary"

-- a KILN_TOKENIZER in the caller's environment takes the built-in one's place
local function builtin_expected()
  local env = os.getenv("KILN_TOKENIZER")
  if env and env ~= "" then H.skip("KILN_TOKENIZER is set in the environment (" .. env .. ")") end
end

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local TMP = os.tmpname()
os.remove(TMP)
assert(os.execute("mkdir -p " .. sh_quote(TMP)))

local function copy_file(from, to)
  local f = assert(io.open(from, "rb"))
  local data = f:read("a")
  f:close()
  local o = assert(io.open(to, "wb"))
  o:write(data)
  o:close()
end

-- the demo model alone in a folder: no vocab.json / merges.txt beside it
local LONE = TMP .. "/alone/kiln-shapes.safetensors"
assert(os.execute("mkdir -p " .. sh_quote(TMP .. "/alone")))
copy_file(DEMO, LONE)

local function first_ids(ids, n)
  local r = {}
  for i = 1, n do r[i] = ids[i] end
  return table.concat(r, " ")
end

-- ids of a CLIP window: start, the text's tokens, end, padding
local function window(tok, text)
  local ids = { tok:bos() }
  for _, id in ipairs(tok:encode(text)) do ids[#ids + 1] = id end
  ids[#ids + 1] = tok:eos()
  while #ids < 77 do ids[#ids + 1] = tok:eos() end
  return ids
end

test("kiln.tokenizer() is CLIP's vocabulary, built into the library", function()
  local t <close> = kiln.tokenizer()
  eq(t:vocab_size(), 49408)
  eq(t:bos(), 49406); eq(t:eos(), 49407)
  eq(t:source(), BUILTIN)
  eq(table.concat(t:encode("a photo of a cat"), " "), "320 1125 539 320 2368")
  truthy(tostring(t):find(BUILTIN, 1, true), tostring(t))
end)

test("the demo model keeps the tokenizer beside it", function()
  local ck <close> = kiln.load_checkpoint(DEMO)
  truthy(ck.clip.tokenizer_source:find("beside the checkpoint", 1, true), ck.clip.tokenizer_source)
  truthy(ck.clip.tokenizer:vocab_size() < 49408, "the demo's own small vocabulary")
end)

test("a checkpoint with no tokenizer beside it uses the built-in one", function()
  builtin_expected()
  local ck <close> = kiln.load_checkpoint(LONE)
  eq(ck.clip.tokenizer:source(), BUILTIN)
  truthy(ck.clip.tokenizer_source:find(BUILTIN, 1, true), ck.clip.tokenizer_source)
  local ids = ck.clip:tokenize("a red circle on a blue background")
  eq(#ids, 77)
  eq(first_ids(ids, 10), table.concat(window(ck.clip.tokenizer, "a red circle on a blue background"), " ", 1, 10))
  eq(first_ids(ids, 3), "49406 320 736")
  -- which tokenizer was used is in the event log (and a trace)
  local seen
  for _, e in ipairs(kiln.mem.events()) do
    if e.kind == "mark" and e.owner == "tokenizer" and e.detail:find(BUILTIN, 1, true) then seen = true end
  end
  truthy(seen, "no 'tokenizer' mark naming the built-in vocabulary in kiln.mem.events()")
  -- a second checkpoint shares the same built-in tokenizer
  local ck2 <close> = kiln.load_checkpoint(LONE)
  truthy(rawequal(ck2.clip.tokenizer, ck.clip.tokenizer), "one built-in tokenizer per state")
end)

-- the prompts of reference-ids.tsv are JSON strings
local function json_string(s)
  if kiln.json then return kiln.json.decode(s) end
  return (s:sub(2, -2):gsub("\\u(%x%x%x%x)", function(h) return utf8.char(tonumber(h, 16)) end)
    :gsub('\\(["\\/])', "%1"):gsub("\\n", "\n"):gsub("\\t", "\t"))
end

test("the built-in tokenizer gives openai/CLIP's reference ids through a checkpoint", function()
  builtin_expected()
  local path = SHARED .. "/clip-tokenizer/reference-ids.tsv"
  local f = io.open(path)
  if not f then H.skip(path .. " is absent (set KILN_SHARED to the shared data folder)") end
  f:close()
  local ck <close> = kiln.load_checkpoint(LONE)
  local n = 0
  for line in io.lines(path) do
    if line:sub(1, 1) ~= "#" then
      local prompt, want = line:match("^(.-)\t(.*)$")
      prompt = json_string(prompt)
      local got = ck.clip:tokenize(prompt)
      local i = 0
      for w in want:gmatch("%-?%d+") do
        i = i + 1
        if got[i] ~= tonumber(w) then
          error(("prompt %q: token %d is %s, expected %s"):format(prompt, i, tostring(got[i]), w))
        end
      end
      eq(i, 77, "ids in the reference line")
      n = n + 1
    end
  end
  truthy(n >= 10, "prompts checked: " .. n)
end)

test("a symlinked checkpoint finds the tokenizer beside the file it points to", function()
  builtin_expected()
  local ok, lfs = pcall(require, "lfs")
  if not ok then H.skip("LuaFileSystem (lfs) is not installed") end
  local real = DEMO:sub(1, 1) == "/" and DEMO or (lfs.currentdir() .. "/" .. DEMO)
  local links = TMP .. "/links"
  assert(os.execute("mkdir -p " .. sh_quote(links .. "/deeper")))
  -- a link with an absolute target
  assert(lfs.link(real, links .. "/direct.safetensors", true))
  local ck <close> = kiln.load_checkpoint(links .. "/direct.safetensors")
  truthy(ck.clip.tokenizer_source:find("beside the checkpoint", 1, true), ck.clip.tokenizer_source)
  truthy(ck.clip.tokenizer:source():find(DEMO_DIR:match("[^/]*$"), 1, true), ck.clip.tokenizer:source())
  truthy(ck.clip.tokenizer:vocab_size() < 49408, "the demo's own vocabulary")
  -- a chain: a relative link to a link to the real file
  assert(lfs.link(real, links .. "/deeper/hop.safetensors", true))
  assert(lfs.link("deeper/hop.safetensors", links .. "/chain.safetensors", true))
  local ck2 <close> = kiln.load_checkpoint(links .. "/chain.safetensors")
  truthy(ck2.clip.tokenizer:vocab_size() < 49408, "through two links: " .. ck2.clip.tokenizer_source)
  -- a link to the lone copy: nothing beside either file, so the built-in one
  assert(lfs.link(LONE, links .. "/lone.safetensors", true))
  local ck3 <close> = kiln.load_checkpoint(links .. "/lone.safetensors")
  eq(ck3.clip.tokenizer:source(), BUILTIN)
end)

-- Runs code in a child kiln (or lua5.4) with KILN_TOKENIZER set; returns ok, output.
local EXE = arg and arg[-1] or "build/kiln"
local function child(env_value, code)
  local cmd = ("KILN_TOKENIZER=%s %s -e %s 2>&1"):format(sh_quote(env_value), sh_quote(EXE),
    sh_quote("local kiln = require 'kiln' " .. code))
  local p = assert(io.popen(cmd))
  local out = p:read("a")
  local ok = p:close()
  return ok, out
end

test("KILN_TOKENIZER names the tokenizer when nothing beside the checkpoint does", function()
  local show = "local ck <close> = kiln.load_checkpoint(%q) print(ck.clip.tokenizer_source) " ..
      "print(ck.clip.tokenizer:vocab_size())"
  local ok, out = child(DEMO_DIR, show:format(LONE))
  truthy(ok, out)
  truthy(out:find("KILN_TOKENIZER", 1, true), out)
  truthy(not out:find("49408", 1, true), "the demo's vocabulary, not the built-in: " .. out)
  -- files beside the checkpoint come first
  ok, out = child(TMP .. "/nowhere", show:format(DEMO))
  truthy(ok, out)
  truthy(out:find("beside the checkpoint", 1, true), out)
  -- and the option before both
  ok, out = child(TMP .. "/nowhere", ("local ck <close> = kiln.load_checkpoint(%q, {tokenizer = %q}) " ..
    "print(ck.clip.tokenizer_source)"):format(LONE, DEMO_DIR))
  truthy(ok, out)
  truthy(out:find("option tokenizer", 1, true), out)
  -- an empty value is no value
  ok, out = child("", show:format(LONE))
  truthy(ok, out)
  truthy(out:find(BUILTIN, 1, true), out)
end)

test("a bad KILN_TOKENIZER is an error naming the path", function()
  local bad = TMP .. "/no-such-tokenizer"
  local ok, out = child(bad, ("kiln.load_checkpoint(%q)"):format(LONE))
  truthy(not ok, "expected the child to fail: " .. out)
  truthy(out:find(bad, 1, true), out)
  truthy(out:find("KILN_TOKENIZER", 1, true), out)
  -- a file that is not a vocabulary
  ok, out = child(LONE, ("kiln.load_checkpoint(%q)"):format(LONE))
  truthy(not ok, "expected the child to fail: " .. out)
  truthy(out:find(LONE, 1, true) and out:find("KILN_TOKENIZER", 1, true), out)
end)

test("kiln.tokenizer(path) errors name the path", function()
  raises(function() kiln.tokenizer(TMP .. "/absent") end, TMP .. "/absent")
end)

os.execute("rm -rf " .. sh_quote(TMP))
H.done()
