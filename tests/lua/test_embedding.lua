-- Textual-inversion embeddings: the files of tests/golden/embeddings (written by
-- tests/golden/gen_embeddings.py with the PyTorch reference's conditioning) on the
-- tiny SD 1.x and SDXL checkpoints; the three file layouts, emphasis on an
-- embedding, the 75-token chunk boundary, names found in the embeddings folder, and
-- the errors (pickles, wrong width, unknown names, not an embedding).
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local clip = require "kiln.clip"
local embedding = require "kiln.embedding"
local test, eq, raises = H.test, H.eq, H.raises

local T = require "tiny_sd"
local EMB = "tests/golden/embeddings/"
local G = kiln.load_safetensors(EMB .. "golden.safetensors")
local TOL = 1e-4

local shape_of = H.shape_of

local function close(a, b, what) return H.close_rel(a, b, TOL, what) end

-- the goldens' words through the built-in vocabulary's ids (tiny_sd.lua)
local fake_tok = T.word_tokenizer

local function open(name, opts)
  local ck = kiln.load_checkpoint(T.ckpt_file(name), opts)
  if not ck.clip.tokenizer then ck.clip.tokenizer = fake_tok end
  return ck
end

local function write(path, tensors)
  kiln.save_safetensors(path, tensors)
  return path
end

-- ---------------------------------------------------------------- the files

test("reading: emb_params, string_to_param.*, clip_l + clip_g; name from the stem", function()
  local e = embedding.read(EMB .. "tiny_neg.safetensors")
  eq(e.name, "tiny_neg"); eq(e.count, 3); eq(shape_of(e.vectors.any), "3,64"); eq(e.keys[1], "emb_params")
  e = embedding.read(EMB .. "tiny_a1111.safetensors", "other")
  eq(e.name, "other"); eq(e.count, 2); eq(e.keys[1], "string_to_param.*")
  e = embedding.read(EMB .. "tiny_xl.safetensors")
  eq(e.count, 2); eq(shape_of(e.vectors.clip_l), "2,64"); eq(shape_of(e.vectors.clip_g), "2,64")
  eq(embedding.stem("/a/b/easy.neg.safetensors"), "easy.neg")
  -- a 1-D file is one vector; f16 is read as f32
  local p = write(T.tmp("one.safetensors"), { emb_params = kiln.randn({ 64 }, { seed = 1 }):to("f16") })
  e = embedding.read(p)
  eq(e.count, 1); eq(shape_of(e.vectors.any), "1,64"); eq(e.vectors.any.dtype, "f32")
end)

test("prompt syntax: embedding:NAME split out of the text", function()
  local s = embedding.split("a photo of embedding:neg, cat embedding:x.safetensors")
  eq(#s, 4); eq(s[1], "a photo of "); eq(s[2].embedding, "neg"); eq(s[3], ", cat "); eq(s[4].embedding, "x.safetensors")
  s = embedding.split("myembedding:neg")
  eq(#s, 1); eq(s[1], "myembedding:neg")
  local pieces = clip.parse_emphasis("a (embedding:neg:1.2) b")
  eq(pieces[2][1], "embedding:neg"); eq(pieces[2][2], 1.2)
end)

-- ---------------------------------------------------------------- against PyTorch

test("SD 1.x golden: emb_params embedding, plain and with emphasis", function()
  local ck <close> = open("sd1")
  local e = ck:add_embedding(EMB .. "tiny_neg.safetensors")
  eq(e.name, "tiny_neg"); eq(e.count, 3)
  close(ck.clip:encode("a photo of embedding:tiny_neg cat"), G["sd1.plain"], "plain")
  close(ck.clip:encode("a photo of (embedding:tiny_neg:1.2) cat"), G["sd1.emphasis"], "emphasis")
  -- added under another name: same vectors
  ck:add_embedding(EMB .. "tiny_neg.safetensors", "neg2")
  close(ck.clip:encode("a photo of embedding:neg2 cat"), G["sd1.plain"], "named")
end)

test("SD 1.x golden: A1111 string_to_param layout, NAME.safetensors in the prompt", function()
  local ck <close> = open("sd1")
  ck:add_embedding(EMB .. "tiny_a1111.safetensors")
  close(ck.clip:encode("a (photo:1.1) embedding:tiny_a1111.safetensors"), G["sd1.a1111"], "a1111")
end)

test("SD 1.x golden: an embedding is not split across the 75-token chunk boundary", function()
  local ck <close> = open("sd1")
  ck:add_embedding(EMB .. "tiny_neg.safetensors")
  -- 73 tokens + 3 vectors > 75: the embedding starts the second chunk
  close(ck.clip:encode(("a "):rep(73) .. "embedding:tiny_neg"), G["sd1.boundary"], "boundary")
  -- 72 + 3 = 75: one chunk
  close(ck.clip:encode(("a "):rep(72) .. "embedding:tiny_neg"), G["sd1.fits"], "fits")
end)

test("chunks: placeholders, fixes, and the comma backtrack moving an embedding", function()
  local tok = function(s)
    local r = {}
    for w in s:gmatch("[^%s]+") do r[#r + 1] = w == "," and 267 or 320 end
    return r
  end
  local count = function() return 3 end
  local c = clip.chunks(clip.parse_emphasis("a (embedding:x:1.5) a"), tok, { embedding = count })
  eq(#c, 1); eq(#c[1].fixes, 1); eq(c[1].fixes[1].pos, 3); eq(c[1].fixes[1].name, "x")
  eq(c[1].ids[3], 0); eq(c[1].ids[5], 0); eq(c[1].ids[6], 320); eq(c[1].weights[4], 1.5); eq(c[1].weights[6], 1.0)
  -- 70 tokens, a comma, the embedding (3), one more token = 75; the next token finds
  -- the chunk full with a comma 5 back: comma and all after it move, the fix too
  c = clip.chunks({ { ("a "):rep(70) .. ", embedding:x a a", 1 } }, tok, { embedding = count, comma = 267 })
  eq(#c, 2); eq(#c[1].fixes, 0); eq(#c[2].fixes, 1)
  eq(c[2].fixes[1].pos, 2); eq(c[2].ids[2], 0); eq(c[2].ids[5], 320); eq(c[1].ids[72], 267); eq(c[1].ids[73], 49407)
  -- an embedding exactly filling the chunk, then more text: a second chunk
  c = clip.chunks({ { ("a "):rep(72) .. "embedding:x a", 1 } }, tok, { embedding = count })
  eq(#c, 2); eq(c[1].fixes[1].pos, 74); eq(c[1].ids[76], 0); eq(c[2].ids[2], 320)
end)

test("SDXL golden: clip_l to the first encoder, clip_g to the second, pooled, emphasis", function()
  local ck <close> = open("sdxl")
  ck:add_embedding(EMB .. "tiny_xl.safetensors")
  local cond, pooled = ck.clip:encode("a photo of embedding:tiny_xl cat")
  close(cond, G["sdxl.context"], "context")
  close(pooled, G["sdxl.pooled"], "pooled")
  close(ck.clip:encode("a photo of (embedding:tiny_xl:1.2) cat"), G["sdxl.emphasis"], "emphasis")
end)

test("an SDXL embedding on SD 1.x uses its clip_l vectors", function()
  local ck <close> = open("sd1")
  local p = write(T.tmp("xl_on_sd1.safetensors"), { clip_l = kiln.load_safetensors(EMB .. "tiny_neg.safetensors").emb_params,
    clip_g = kiln.zeros({ 3, 1280 }) })
  ck:add_embedding(p, "tiny_neg")
  close(ck.clip:encode("a photo of embedding:tiny_neg cat"), G["sd1.plain"], "clip_l of an SDXL file")
end)

test("on a device, in f16, and in low mode: the vectors follow the token table", function()
  local ck <close> = open("sd1")
  ck:add_embedding(EMB .. "tiny_neg.safetensors")
  local prompt = "a photo of (embedding:tiny_neg:1.2) cat"
  ck.clip:load("sim")
  local z = ck.clip:encode(prompt)
  close(z:to("cpu"), G["sd1.emphasis"], "on sim")
  ck.clip:unload()
  ck.clip:load("cpu", { dtype = "f16" })
  local d = (ck.clip:encode(prompt):to("f32") - G["sd1.emphasis"]):abs():max()
  H.truthy(d < 2e-2, "f16 weights: max difference " .. d)
  ck.clip:unload()
  local prev = kiln.memory_mode()
  kiln.memory_mode("low")
  local ok, err = pcall(function()
    ck.clip:load("sim")
    close(ck.clip:encode(prompt):to("cpu"), G["sd1.emphasis"], "low mode")
    ck.clip:unload()
  end)
  kiln.memory_mode(prev)
  if not ok then error(err, 0) end
end)

-- ---------------------------------------------------------------- the folder

test("names found in the embeddings folder (subfolders searched), then kept", function()
  local dir = T.TMP .. "/emb"
  assert(os.execute("mkdir -p '" .. dir .. "/sub'"))
  local src = kiln.load_safetensors(EMB .. "tiny_neg.safetensors")
  write(T.tmp("emb/sub/folder_neg.safetensors"), src)
  write(T.tmp("emb/top_neg.safetensors"), src)
  local f = assert(io.open(T.tmp("emb/pickled.pt"), "wb")); f:write("PK\3\4"); f:close()
  local ok, ck = pcall(kiln.load_checkpoint, T.ckpt_file("sd1"), { embeddings = dir })
  if not ok then
    if tostring(ck):find("unknown option 'embeddings'", 1, true) then
      H.skip("kiln.load_checkpoint has no embeddings option yet")
    end
    error(ck, 0)
  end
  if not ck.clip.tokenizer then ck.clip.tokenizer = fake_tok end
  close(ck.clip:encode("a photo of embedding:top_neg cat"), G["sd1.plain"], "top level")
  close(ck.clip:encode("a photo of embedding:folder_neg cat"), G["sd1.plain"], "in a subfolder")
  close(ck.clip:encode("a photo of embedding:sub/folder_neg.safetensors cat"), G["sd1.plain"], "with its subfolder")
  H.truthy(embedding.table_of(ck.clip).names.folder_neg, "kept in the name table")
  raises(function() ck.clip:encode("a embedding:nope") end, "embedding 'nope' not found", dir)
  raises(function() ck.clip:encode("a embedding:Top_neg") end, "embedding 'Top_neg' not found")
  raises(function() ck.clip:encode("a embedding:pickled") end, "pickled.pt", "kiln reads .safetensors only")
  ck:close()
end)

-- ---------------------------------------------------------------- bad input

test("errors: pickles, wrong width, unknown names, not an embedding", function()
  local ck <close> = open("sd1")
  local pt = T.tmp("neg.pt")
  local f = assert(io.open(pt, "wb")); f:write("PK\3\4"); f:close()
  raises(function() ck:add_embedding(pt) end, "ckpt:add_embedding", "neg.pt", "kiln reads .safetensors only",
    "OUT.safetensors")
  raises(function() ck:add_embedding(T.TMP .. "/missing.safetensors") end, "no such file")
  local wide = write(T.tmp("wide.safetensors"), { emb_params = kiln.zeros({ 2, 96 }) })
  raises(function() ck:add_embedding(wide) end, "embedding 'wide' has width 96, this checkpoint's text encoder takes 64")
  local junk = write(T.tmp("junk.safetensors"), { a = kiln.zeros({ 2, 64 }), b = kiln.zeros({ 2, 64 }) })
  raises(function() ck:add_embedding(junk) end, "not a textual-inversion embedding", "emb_params")
  local uneven = write(T.tmp("uneven.safetensors"), { clip_l = kiln.zeros({ 2, 64 }), clip_g = kiln.zeros({ 3, 64 }) })
  raises(function() ck:add_embedding(uneven) end, "vectors")
  local long = write(T.tmp("long.safetensors"), { emb_params = kiln.zeros({ 76, 64 }) })
  raises(function() ck:add_embedding(long) end, "76 vectors, more than a 75-token prompt chunk holds")
  raises(function() ck.clip:encode("a embedding:nobody cat") end, "embedding 'nobody' is unknown", "embeddings = DIR")
  raises(function() ck.clip:encode("a embedding:nobody.pt cat") end, "kiln reads .safetensors only")
  -- an SDXL checkpoint: the width error names the encoder; an SD 2 file has no clip_g
  local xl <close> = open("sdxl")
  local gwide = write(T.tmp("gwide.safetensors"), { clip_l = kiln.zeros({ 1, 64 }), clip_g = kiln.zeros({ 1, 1280 }) })
  raises(function() xl:add_embedding(gwide) end, "embedding 'gwide' (clip_g) has width 1280, this checkpoint's text encoder takes 64")
  local only_h = write(T.tmp("only_h.safetensors"), { clip_h = kiln.zeros({ 1, 64 }) })
  raises(function() xl:add_embedding(only_h) end, "none for this checkpoint's text encoder")
end)

T.cleanup({ "/emb/sub", "/emb" })
H.done()
