-- kiln.t5.tokenize: every string of the golden corpus (tests/golden/gen_t5_tokenizer.py:
-- SentencePiece's own ids under T5 v1.1's model, many scripts, invalid UTF-8, spaces,
-- controls, SD prompts) gives exactly SentencePiece's ids; known ids; bad input; long text.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, eq, raises = H.test, H.eq, H.raises

local function list_str(t) return table.concat(t, " ") end

test("known ids (Hugging Face's google-t5/t5-base fixtures)", function()
  eq(list_str(kiln.t5.tokenize("Hello world")), "8774 296 1")
  eq(list_str(kiln.t5.tokenize("Hello\tworld\nagain")), "8774 296 541 1")
  eq(list_str(kiln.t5.tokenize("")), "1")
  eq(list_str(kiln.t5.tokenize("   ")), "1")
end)

test("golden corpus: SentencePiece's ids for every string", function()
  local f = assert(io.open("tests/golden/t5_tokenizer/corpus.txt", "rb"))
  local n, bad, first = 0, 0, nil
  for line in f:lines() do
    local hex, want = line:match("^(%x*)\t([%d ]+)$")
    assert(hex, "corpus line " .. (n + 1) .. " is malformed")
    local text = hex:gsub("%x%x", function(h) return string.char(tonumber(h, 16)) end)
    local got = list_str(kiln.t5.tokenize(text))
    n = n + 1
    if got ~= want then
      bad = bad + 1
      first = first or ("line %d (%q): got %s, want %s"):format(n, text, got, want)
    end
  end
  f:close()
  assert(n >= 4000, "corpus has only " .. n .. " strings")
  print(("  t5 tokenizer: %d of %d corpus strings match SentencePiece"):format(n - bad, n))
  if bad > 0 then error(("%d of %d strings differ; first: %s"):format(bad, n, first)) end
end)

test("ids end in </s>, lie in the vocabulary, merge runs of <unk>", function()
  local ids = kiln.t5.tokenize("a photo of a cat 😀😀 日本")
  eq(ids[#ids], 1)
  for _, id in ipairs(ids) do assert(math.type(id) == "integer" and id >= 0 and id < 32000, id) end
  -- invalid bytes read as U+FFFD, which is unknown: three in a row are one <unk>
  eq(list_str(kiln.t5.tokenize("\xff\xfe\xfd")), "3 2 1")
end)

test("bad input: a clear error", function()
  for _, v in ipairs({ 12, true, {}, kiln.t5 }) do
    raises(function() kiln.t5.tokenize(v) end, "bad argument #1 to 'tokenize' (string expected")
  end
  raises(function() kiln.t5.tokenize() end, "string expected, got no value")
end)

test("long text: linear time", function()
  local word = "the quick brown fox jumps over the lazy dog, naïve café 日本語 😀 "
  local small = word:rep(200)
  local big = word:rep(4000)
  local t0 = os.clock()
  local a = kiln.t5.tokenize(small)
  local t1 = os.clock()
  local b = kiln.t5.tokenize(big)
  local t2 = os.clock()
  eq((#b - 1) / 4000, (#a - 1) / 200, "tokens per repeat")
  -- 20x the text must not cost anywhere near 400x (quadratic); allow noise on a busy machine
  assert(t2 - t1 < 60 * (t1 - t0) + 0.5, ("%.3fs for 20x the text after %.3fs"):format(t2 - t1, t1 - t0))
  local x = ("x"):rep(200000) -- one long word
  eq(kiln.t5.tokenize(x)[#kiln.t5.tokenize(x)], 1)
end)

test("text past the limit: an error that says so", function()
  raises(function() kiln.t5.tokenize(("a"):rep((1 << 24) + 1)) end, "longer than the limit")
end)

