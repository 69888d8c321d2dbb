-- Prompt weighting as ComfyUI computes it (weighting = "comfy": its parse, and each
-- weighted token moved from the empty prompt's state, (z - z_empty) * w + z_empty)
-- beside A1111's (the default, unchanged): clip:encode on the tiny SD 1.x, SD 2.x and
-- SDXL checkpoints against tests/golden/weighting (tests/golden/gen_weighting.py, PyTorch), the parse
-- cases where the two differ, and the option in the pipeline parameters.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local clip = require "kiln.clip"
local pipeline = require "kiln.pipeline"
local test, eq, raises = H.test, H.eq, H.raises

local T = require "tiny_sd"
local G = kiln.load_safetensors("tests/golden/weighting/golden.safetensors")
local TOL = 1e-4

local shape_of = H.shape_of

local function close(a, b, what) return H.close_rel(a, b, TOL, what) end

-- the goldens' words through the built-in vocabulary's ids (tiny_sd.lua)
local fake_tok = T.word_tokenizer

local function open(family)
  local ck = kiln.load_checkpoint(T.ckpt_file(family or "sd1"))
  ck.clip.tokenizer = fake_tok
  return ck
end

local function same_pieces(got, want, what)
  local function show(p)
    local s = {}
    for i, x in ipairs(p) do s[i] = ("%q:%.6g"):format(x[1], x[2]) end
    return table.concat(s, " ")
  end
  eq(show(got), show(want), what)
end

-- ---------------------------------------------------------------- the parse

test("comfy parse: (w:x) sets, (w) x1.1, no [ ], \\( \\) escapes", function()
  local P = clip.parse_comfy
  same_pieces(P("a (photo:1.3) of (cat)"), { { "a ", 1 }, { "photo", 1.3 }, { " of ", 1 }, { "cat", 1.1 } }, "basic")
  -- the inner weight replaces the outer (A1111 multiplies: 0.55)
  same_pieces(P("((a photo:0.5) of) cat"), { { "a photo", 0.5 }, { " of", 1.1 }, { " cat", 1 } }, "nested")
  same_pieces(P("((cat))"), { { "cat", 1.1 * 1.1 } }, "double")
  -- [ ] are text; only \( and \) escape
  same_pieces(P("[cat] \\(a\\) (b)"), { { "[cat] (a) ", 1 }, { "b", 1.1 } }, "brackets and escapes")
  same_pieces(P("a \\[b\\] \\\\"), { { "a \\[b\\] \\\\", 1 } }, "other backslashes stay")
  -- unclosed and stray parentheses are text; a weight that is not a number stays text
  same_pieces(P("a (b"), { { "a ", 1 }, { "(b", 1 } }, "unclosed")
  same_pieces(P("a) (b"), { { "a) (b", 1 } }, "stray")
  same_pieces(P("(a:x)"), { { "a:x", 1.1 } }, "not a number")
  same_pieces(P("(:1.5)"), { { ":1.5", 1.1 } }, "colon first")
  same_pieces(P("(a:b:0.8)"), { { "a:b", 0.8 } }, "last colon")
  same_pieces(P("a BREAK b"), { { "a BREAK b", 1 } }, "BREAK is a word")
  same_pieces(P(""), { { "", 1 } }, "empty")
  -- A1111's parse of the same texts, for contrast
  same_pieces(clip.parse_emphasis("((a photo:0.5) of) cat"),
    { { "a photo", 0.5 * 1.1 }, { " of", 1.1 }, { " cat", 1 } }, "a1111 nested")
  eq(clip.parse_emphasis("[cat]")[1][2], 1 / 1.1, "a1111 [ ]")
end)

-- ---------------------------------------------------------------- against PyTorch

test("SD 1.x golden: comfy weighting, up, down, nested, two chunks", function()
  local ck <close> = open()
  close(ck.clip:encode("a (photo:1.3) of (cat)", { weighting = "comfy" }), G["sd1.comfy"], "comfy")
  close(ck.clip:encode("(a photo:0.5) of (cat:1.4)", { weighting = "comfy" }), G["sd1.comfy_down"], "down")
  close(ck.clip:encode("((a photo:0.5) of) cat", { weighting = "comfy" }), G["sd1.comfy_nested"], "nested")
  close(ck.clip:encode("(a:1.2) " .. ("photo "):rep(80), { weighting = "comfy" }), G["sd1.comfy_long"], "long")
  -- the empty prompt is what z_empty is
  close(ck.clip:encode("", { weighting = "comfy" }), G["sd1.empty"], "empty")
end)

test("SD 1.x golden: a1111 (the default) unchanged; unweighted prompts agree", function()
  local ck <close> = open()
  close(ck.clip:encode("a (photo:1.3) of (cat)"), G["sd1.a1111"], "default")
  close(ck.clip:encode("a (photo:1.3) of (cat)", { weighting = "a1111" }), G["sd1.a1111"], "a1111")
  local plain = ck.clip:encode("a photo of cat", { weighting = "none" })
  close(ck.clip:encode("a photo of cat", { weighting = "comfy" }), plain, "comfy unweighted")
  close(ck.clip:encode("a photo of cat"), plain, "a1111 unweighted")
  -- the two differ once a token is weighted
  local d = (G["sd1.comfy"] - G["sd1.a1111"]):abs():max()
  if not (d > 1e-3) then error("comfy and a1111 goldens agree: the test would not tell them apart") end
end)

test("SD 2.x golden: comfy weighting against the empty prompt padded with 0, two chunks", function()
  local ck <close> = open("sd2")
  close(ck.clip:encode("a (photo:1.3) of (cat)", { weighting = "comfy" }), G["sd2.comfy"], "comfy")
  close(ck.clip:encode("(a:1.2) " .. ("photo "):rep(80), { weighting = "comfy" }), G["sd2.comfy_long"], "long")
end)

test("SDXL golden: comfy weighting per encoder (each its own empty prompt), pooled unweighted", function()
  local ck <close> = open("sdxl")
  local z, pooled = ck.clip:encode("a (photo:1.3) of (cat)", { weighting = "comfy" })
  close(z, G["sdxl.comfy"], "comfy")
  close(pooled, G["sdxl.pooled"], "pooled")
  local zl = ck.clip:encode("(a:1.2) " .. ("photo "):rep(80), { weighting = "comfy" })
  close(zl, G["sdxl.comfy_long"], "long")
end)

test("weighting: an unknown value is named", function()
  local ck <close> = open()
  raises(function() ck.clip:encode("a", { weighting = "auto" }) end, "weighting auto")
end)

-- ---------------------------------------------------------------- the pipeline

test("pipeline parameters: Weighting recorded only when not a1111", function()
  local o = { prompt = "a", steps = 1, sampler = "euler", scheduler = "normal", cfg = 7, seed = 1, width = 8, height = 8 }
  local p = pipeline.parameters(o)
  eq(p:find("Weighting", 1, true), nil, "default")
  o.weighting = "a1111"
  eq(pipeline.parameters(o):find("Weighting", 1, true), nil, "a1111")
  o.weighting = "comfy"
  assert(pipeline.parameters(o):find("Weighting: comfy", 1, true), "comfy recorded")
end)

H.done()
