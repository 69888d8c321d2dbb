-- Stable Diffusion networks and checkpoint loading: tiny SD 1.x / 2.x / SDXL
-- checkpoints rebuilt from the recipes of tests/golden/gen_sd_golden.py (seeded
-- kiln.randn = torch.randn), loaded with kiln.load_checkpoint and compared with the
-- PyTorch reference outputs; family detection and hyper-parameters on the real key
-- lists of $KILN_SHARED/sd-keys; the prompt parser; diffusers folders; bad input.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local checkpoint = require "kiln.checkpoint"
local clip = require "kiln.clip"
local unet = require "kiln.unet"
local vae = require "kiln.vae"
local test, eq, near, raises = H.test, H.eq, H.near, H.raises

local T = require "tiny_sd"

local SHARED = os.getenv("KILN_SHARED") or "../shared"
local GOLD = T.GOLD
local tmp = T.tmp

local shape_of = H.shape_of

-- max |a - b| / max(1, max |b|), after checking shapes
local close = H.close_rel -- (a, b, tol, what)

local report = {}
local function note(name, err) report[#report + 1] = ("%s %.2g"):format(name, err) end

-- ---------------------------------------------------------------- recipes

local parse_shape, from_recipe, ckpt_file = T.parse_shape, T.from_recipe, T.ckpt_file

local G = {
  sd1 = kiln.load_safetensors(GOLD .. "sd1.safetensors"),
  sd2 = kiln.load_safetensors(GOLD .. "sd2.safetensors"),
  sdxl = kiln.load_safetensors(GOLD .. "sdxl.safetensors"),
}

-- the token windows of the golden: "a photo of a cat" and arbitrary ids
local function window(ids, pad)
  local r = {}
  for i, v in ipairs(ids) do r[i] = v end
  while #r < 77 do r[#r + 1] = pad end
  return r
end
local IDS_A = { 49406, 320, 1125, 539, 320, 2368, 49407 }
local IDS_B = { 49406, 1000, 2000, 3000, 40000, 49000, 7, 11, 49407 }

-- a whitespace tokenizer over a few CLIP ids (the goldens do not need the BPE)
local WORDS = { a = 320, photo = 1125, of = 539, cat = 2368, [","] = 267, red = 736 }
local fake_tok = {
  encode = function(_, s)
    local r = {}
    for w in s:gmatch("[^%s,]+,?") do
      local word, comma = w:match("^([^,]*)(,?)$")
      if word ~= "" then r[#r + 1] = assert(WORDS[word], "fake tokenizer: unknown word " .. word) end
      if comma ~= "" then r[#r + 1] = 267 end
    end
    return r
  end,
  bos = function() return 49406 end,
  eos = function() return 49407 end,
  token_id = function(_, s) return s == ",</w>" and 267 or nil end,
}

local inputs = T.inputs

-- ---------------------------------------------------------------- prompt parsing

local function pieces_eq(got, want)
  eq(#got, #want, "number of pieces")
  for i = 1, #want do
    eq(got[i][1], want[i][1], "piece " .. i .. " text")
    near(got[i][2], want[i][2], 1e-9, "piece " .. i .. " weight")
  end
end

test("emphasis parser: A1111's documented examples", function()
  local P = clip.parse_emphasis
  pieces_eq(P("normal text"), { { "normal text", 1 } })
  pieces_eq(P("an (important) word"), { { "an ", 1 }, { "important", 1.1 }, { " word", 1 } })
  pieces_eq(P("(unbalanced"), { { "unbalanced", 1.1 } })
  pieces_eq(P("\\(literal\\]"), { { "(literal]", 1 } })
  pieces_eq(P("(unnecessary)(parens)"), { { "unnecessaryparens", 1.1 } })
  pieces_eq(P("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky)))."), {
    { "a ", 1 }, { "house", 1.5730000000000004 }, { " ", 1.1 }, { "on", 1 }, { " a ", 1.1 }, { "hill", 0.55 },
    { ", sun, ", 1.1 }, { "sky", 1.4641000000000006 }, { ".", 1.1 } })
  pieces_eq(P("[a] (b:0.8) c"), { { "a", 1 / 1.1 }, { " ", 1 }, { "b", 0.8 }, { " c", 1 } })
  pieces_eq(P(""), { { "", 1 } })
  pieces_eq(P("a BREAK b"), { { "a", 1 }, { "BREAK", -1 }, { "b", 1 } })
  pieces_eq(P("BREAKFAST"), { { "BREAKFAST", 1 } })
  pieces_eq(P("x:1.5) y"), { { "x:1.5) y", 1 } })
end)

test("chunks: 75-token windows, comma backtrack, BREAK, padding", function()
  local ids = function(n, first)
    local r = {}
    for i = 1, n do r[i] = (first or 1000) + i end
    return r
  end
  local tok = function(s) return ids(tonumber(s)) end
  local c = clip.chunks({ { "3", 1.5 } }, tok, {})
  eq(#c, 1); eq(#c[1].ids, 77); eq(c[1].ids[1], 49406); eq(c[1].ids[2], 1001); eq(c[1].ids[5], 49407)
  eq(c[1].ids[77], 49407); near(c[1].weights[2], 1.5); near(c[1].weights[5], 1)
  c = clip.chunks({ { "3", 1 } }, tok, { pad = 0 })
  eq(c[1].ids[5], 49407); eq(c[1].ids[6], 0); eq(c[1].ids[77], 0)
  c = clip.chunks({ { "100", 1 } }, tok, {})
  eq(#c, 2); eq(c[1].ids[76], 1075); eq(c[1].ids[77], 49407); eq(c[2].ids[2], 1076); eq(c[2].ids[27], 49407)
  -- a comma at token 70 of 80: the 5 tokens after it move to the second window
  local with_comma = function()
    local r = ids(80)
    r[70] = 267
    return r
  end
  c = clip.chunks({ { "x", 1 } }, with_comma, { comma = 267 })
  eq(#c, 2); eq(c[1].ids[71], 267); eq(c[1].ids[72], 49407); eq(c[2].ids[2], 1071)
  c = clip.chunks({ { "x", 1 } }, with_comma, { comma = 267, backtrack = 0 })
  eq(c[1].ids[72], 1071); eq(c[1].ids[77], 49407); eq(c[2].ids[2], 1076)
  c = clip.chunks({ { "2", 1 }, { "BREAK", -1 }, { "2", 1 } }, tok, {})
  eq(#c, 2); eq(c[2].ids[2], 1001)
  c = clip.chunks({ { "", 1 } }, function() return {} end, {})
  eq(#c, 1); eq(c[1].ids[2], 49407)
end)

-- ---------------------------------------------------------------- header-only checks

local function read_keys(file)
  local shapes = {}
  for line in io.lines(file) do
    local name, s = line:match("^([^\t]+)\t(.*)$")
    shapes[name] = parse_shape(s)
  end
  return shapes
end

local function shared_file(name)
  local p = SHARED .. "/sd-keys/" .. name
  local f = io.open(p)
  if not f then H.skip(p .. " is absent (set KILN_SHARED to the shared folder)") end
  f:close()
  return p
end

-- every expected tensor exists with its shape, and every listed tensor of the part is expected
local function covers(shapes, prefix, expected, ignore)
  local seen = {}
  for _, e in ipairs(expected) do
    local real = prefix .. e[1]
    local s = shapes[real]
    H.truthy(s, "listed: " .. real)
    eq(table.concat(s, ","), table.concat(e[2], ","), real)
    seen[real] = true
  end
  for name in pairs(shapes) do
    if name:sub(1, #prefix) == prefix and not seen[name] and not (ignore and name:match(ignore)) then
      error("not read by the network: " .. name)
    end
  end
end

test("detect SD 1.5 from its key list", function()
  local shapes = read_keys(shared_file("sd15.txt"))
  local info = checkpoint.inspect(shapes, {})
  eq(info.family, "sd1")
  local u = info.unet
  eq(u.context_dim, 768); eq(u.levels, 4); eq(table.concat(u.channel_mult, ","), "1,2,4,4")
  eq(u.num_res_blocks, 2); eq(u.model_channels, 320); eq(u.linear_proj, false); eq(u.adm_in_channels, nil)
  eq(table.concat(u.transformer_depth, ","), "1,1,1,0"); eq(u.transformer_depth_middle, 1); eq(u.heads, 8)
  eq(info.vae.factor, 8); eq(info.vae.scale_factor, 0.18215)
  local c = info.clip[1]
  eq(c.layout, "hf"); eq(c.width, 768); eq(c.layers, 12); eq(c.heads, 12); eq(c.activation, "quick_gelu")
  covers(shapes, "model.diffusion_model.", unet.expected(u))
  covers(shapes, "first_stage_model.", vae.expected(info.vae))
  covers(shapes, "cond_stage_model.transformer.", clip.expected(c), "position_ids$")
end)

test("detect SD 2.1 from its key list", function()
  local shapes = read_keys(shared_file("sd21.txt"))
  local info = checkpoint.inspect(shapes, {})
  eq(info.family, "sd2")
  local u = info.unet
  eq(u.context_dim, 1024); eq(u.linear_proj, true); eq(table.concat(u.channel_mult, ","), "1,2,4,4")
  eq(u.head_dim, 64); eq(unet.heads_for(u, 640), 10)
  local c = info.clip[1]
  eq(c.layout, "openclip"); eq(c.width, 1024); eq(c.layers, 24); eq(c.heads, 16); eq(c.activation, "gelu")
  covers(shapes, "model.diffusion_model.", unet.expected(u))
  covers(shapes, "first_stage_model.", vae.expected(info.vae))
  covers(shapes, "cond_stage_model.model.", clip.expected(c), "logit_scale$")
end)

test("detect SDXL from its key list", function()
  local shapes = read_keys(shared_file("sdxl.txt"))
  local info = checkpoint.inspect(shapes, {})
  eq(info.family, "sdxl")
  local u = info.unet
  eq(u.context_dim, 2048); eq(u.adm_in_channels, 2816); eq(u.levels, 3); eq(u.linear_proj, true)
  eq(table.concat(u.transformer_depth, ","), "0,2,10"); eq(u.transformer_depth_middle, 10)
  eq(table.concat(u.channel_mult, ","), "1,2,4")
  eq(info.vae.scale_factor, 0.13025)
  eq(info.clip[1].layout, "hf"); eq(info.clip[1].heads, 12); eq(info.clip[1].activation, "quick_gelu")
  local g = info.clip[2]
  eq(g.layout, "openclip"); eq(g.width, 1280); eq(g.layers, 32); eq(g.heads, 20); eq(g.projection, 1280)
  covers(shapes, "model.diffusion_model.", unet.expected(u))
  covers(shapes, "first_stage_model.", vae.expected(info.vae))
  covers(shapes, "conditioner.embedders.0.transformer.", clip.expected(info.clip[1]), "position_ids$")
  covers(shapes, "conditioner.embedders.1.model.", clip.expected(g), "logit_scale$")
end)

-- ---------------------------------------------------------------- goldens

local TOL = 1e-4

test("SD 1.x golden: CLIP text encoder (last, penultimate, emphasis)", function()
  local ck <close> = kiln.load_checkpoint(ckpt_file("sd1"))
  eq(ck.family, "sd1")
  local enc = ck.clip.encoders[1].enc
  local a, b = window(IDS_A, 49407), window(IDS_B, 49407)
  note("sd1.clip.last", close(enc:forward({ a, b }), G.sd1["clip.last"], TOL, "last"))
  note("sd1.clip.skip2", close(enc:forward({ a, b }, { layer = -2 }), G.sd1["clip.skip2"], TOL, "clip skip 2"))
  ck.clip.tokenizer = fake_tok
  local plain = ck.clip:encode("a photo of a cat")
  close(plain, G.sd1["clip.last"]:narrow(1, 1, 1), TOL, "encode")
  note("sd1.clip.emphasis", close(ck.clip:encode("a (photo of:1.21) a [cat]"), G.sd1["clip.emphasis"], TOL, "emphasis"))
  close(ck.clip:encode("a photo of a cat", { clip_skip = 2 }), G.sd1["clip.skip2"]:narrow(1, 1, 1), TOL, "clip_skip")
  local two = ck.clip:encode("a photo BREAK of a cat")
  eq(shape_of(two), "1,154,64")
end)

test("SD 1.x golden: UNet", function()
  local ck <close> = kiln.load_checkpoint(ckpt_file("sd1"))
  local x, t, ctx = inputs(64)
  note("sd1.unet", close(ck.unet:forward(x, t, ctx), G.sd1["unet.out"], TOL, "unet"))
  eq(ck.unet.config.heads, 2)
  -- an odd latent size: the downsampler rounds up, Upsample meets the skip's size
  local odd = kiln.randn({ 2, 4, 7, 5 }, { seed = 5 })
  note("sd1.unet.odd", close(ck.unet:forward(odd, t, ctx), G.sd1["unet.odd"], TOL, "unet at 7x5"))
end)

test("SD 1.x golden: VAE decode and encode", function()
  local ck <close> = kiln.load_checkpoint(ckpt_file("sd1"))
  eq(ck.vae.factor, 2)
  local z = kiln.randn({ 1, 4, 8, 8 }, { seed = 3 })
  note("sd1.vae.decode", close(ck.vae:decode(z), G.sd1["vae.decode"], TOL, "decode"))
  close(ck.vae:decode_raw(z / 0.18215), G.sd1["vae.decode_raw"], TOL, "decode raw")
  local img = (kiln.randn({ 1, 3, 16, 16 }, { seed = 4 }) * 0.25 + 0.5):clamp(0, 1)
  note("sd1.vae.encode", close(ck.vae:encode(img), G.sd1["vae.encode"], TOL, "encode"))
  -- one tile covering everything is the untiled result; smaller tiles keep the shape
  close(ck.vae:decode(z, { tile = 8, overlap = 2 }), G.sd1["vae.decode"], TOL, "single tile")
  local big = kiln.randn({ 1, 4, 24, 20 }, { seed = 5 })
  local whole = ck.vae:decode(big)
  local tiled = ck.vae:decode(big, { tile = 16, overlap = 4 })
  eq(shape_of(tiled), "1,3,48,40")
  H.truthy(tiled:min() >= 0 and tiled:max() <= 1, "tiled decode in [0, 1]")
  H.truthy((tiled - whole):abs():mean() < 0.2, "tiled decode close to the untiled one")
  eq(shape_of(ck.vae:encode(tiled, { tile = 8, overlap = 2 })), "1,4,24,20")
  raises(function() ck.vae:decode(z, { tile = 4 }) end, "tile must be")
  raises(function() ck.vae:decode(z, { tiles = 4 }) end, "unknown option 'tiles'")
end)

test("SD 2.x golden: OpenCLIP penultimate + ln_final, linear proj_in UNet", function()
  local ck <close> = kiln.load_checkpoint(ckpt_file("sd2"))
  eq(ck.family, "sd2")
  eq(ck.clip.encoders[1].enc.config.layout, "openclip")
  local a, b = window(IDS_A, 0), window(IDS_B, 0)
  note("sd2.clip", close(ck.clip.encoders[1].enc:forward({ a, b }, { layer = -2 }), G.sd2["clip.penultimate"], TOL, "clip"))
  ck.clip.tokenizer = fake_tok
  close(ck.clip:encode("a photo of a cat"), G.sd2["clip.penultimate"]:narrow(1, 1, 1), TOL, "encode (pad 0)")
  local x, t, ctx = inputs(64)
  note("sd2.unet", close(ck.unet:forward(x, t, ctx), G.sd2["unet.out"], TOL, "unet"))
end)

test("SDXL golden: two encoders, pooled vector, size conditioning, label_emb UNet", function()
  local ck <close> = kiln.load_checkpoint(ckpt_file("sdxl"))
  eq(ck.family, "sdxl"); eq(ck.scale_factor, 0.13025)
  ck.clip.tokenizer = fake_tok
  local cond, pooled = ck.clip:encode("a photo of a cat")
  note("sdxl.clip.context", close(cond, G.sdxl["clip.context"]:narrow(1, 1, 1), TOL, "context"))
  note("sdxl.clip.pooled", close(pooled, G.sdxl["clip.pooled"]:narrow(1, 1, 1), TOL, "pooled"))
  local y = ck.unet:sdxl_vector(pooled, { orig_height = 1024, orig_width = 768, crop_top = 0, crop_left = 16,
    target_height = 1024, target_width = 768 })
  note("sdxl.y", close(y, G.sdxl["unet.y"]:narrow(1, 1, 1), TOL, "y"))
  local x, t = inputs(128)
  note("sdxl.unet", close(ck.unet:forward(x, t, G.sdxl["clip.context"], G.sdxl["unet.y"]), G.sdxl["unet.out"], TOL, "unet"))
  raises(function() ck.unet:forward(x, t, G.sdxl["clip.context"]) end, "needs y")
end)

test("f16 checkpoint, and f32 weights stored as f16 by load", function()
  local ck <close> = kiln.load_checkpoint(ckpt_file("sd1", "f16"))
  local x, t, ctx = inputs(64)
  note("sd1.unet.f16file", close(ck.unet:forward(x, t, ctx), G.sd1["unet.out"], 2e-2, "unet from an f16 file"))
  local ck2 <close> = kiln.load_checkpoint(ckpt_file("sd1"))
  eq(ck2.unet:bytes("cpu"), 0)
  H.truthy(ck2.unet:load("cpu", { dtype = "f16" }) == ck2.unet, "load returns the part")
  local n = ck2.unet:bytes("cpu")
  H.truthy(n > 1900000 and n < 2100000, "1.0 M parameters in f16: " .. n)
  eq(ck2.unet:w("out.2.weight").dtype, "f16")
  close(ck2.unet:forward(x, t, ctx), G.sd1["unet.out"], 2e-2, "unet with f16 weights")
  ck2.unet:unload()
  eq(ck2.unet:bytes("cpu"), 0)
  eq(ck2.unet:w("out.2.weight").dtype, "f32")
  local z = kiln.randn({ 1, 4, 8, 8 }, { seed = 3 })
  ck2.vae:load("cpu", { dtype = "bf16" })
  close(ck2.vae:decode(z), G.sd1["vae.decode"], 3e-2, "decode with bf16 weights")
  ck2.vae:close()
  raises(function() ck2.vae:decode(z) end, "closed")
end)

test("sim device: weights loaded there, inputs follow", function()
  local has_sim = false
  for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end
  if not has_sim then H.skip("no sim device") end
  local ck <close> = kiln.load_checkpoint(ckpt_file("sd1"))
  ck.unet:load("sim")
  H.truthy(ck.unet:bytes("sim") > 0, "bytes on sim")
  local x, t, ctx = inputs(64)
  local out = ck.unet:forward(x, t, ctx)
  eq(out.device, "sim")
  close(out:to("cpu"), G.sd1["unet.out"], TOL, "unet on sim")
  ck.unet:offload()
  eq(ck.unet:bytes("sim"), 0)
  -- an untiled decode that does not fit the budget retries in tiles by itself
  ck.vae:load("sim")
  local z = kiln.randn({ 1, 4, 64, 64 }, { seed = 5 }):to("sim")
  collectgarbage()
  local before = kiln.mem.stats("sim")
  kiln.mem.set_budget("sim", before.allocated + 6 * 2 ^ 20)
  local ok, img = pcall(ck.vae.decode, ck.vae, z)
  kiln.mem.set_budget("sim", before.budget)
  H.truthy(ok, "decode under a 6 MiB budget: " .. tostring(img))
  eq(shape_of(img), "1,3,128,128")
  H.truthy(img:min() >= 0 and img:max() <= 1, "in [0, 1]")
end)

test("SDXL end to end: txt2img and hires fix build the pooled + size conditioning", function()
  local pipeline = require "kiln.pipeline"
  local ck <close> = kiln.load_checkpoint(ckpt_file("sdxl"))
  ck.clip.tokenizer = fake_tok
  local f = math.tointeger(ck.vae.factor)
  local o = { prompt = "a photo of a cat", steps = 2, width = 16 * f, height = 16 * f, seed = 1, cfg = 5 }
  local img = pipeline.txt2img(ck, o)
  eq(shape_of(img), ("1,3,%d,%d"):format(16 * f, 16 * f))
  H.truthy(img:min() >= 0 and img:max() <= 1, "in [0, 1]")
  -- the size vector reaches the UNet: the same run conditioned on another size differs
  local unet_forward, seen = ck.unet.forward, nil
  ck.unet.forward = function(self, x, t, ctx, y)
    seen = y and y.shape[2]
    return unet_forward(self, x, t, ctx, y)
  end
  local hi = pipeline.hires_fix(ck, { prompt = "a photo of a cat", steps = 1, hires_steps = 1, width = 16 * f,
    height = 16 * f, scale = 1.5, seed = 1, cfg = 5 })
  ck.unet.forward = nil
  eq(seen, ck.unet.config.adm_in_channels, "y given to the UNet")
  eq(shape_of(hi), ("1,3,%d,%d"):format(24 * f, 24 * f))
  img:free(); hi:free()
end)

-- ---------------------------------------------------------------- diffusers folders

local function write_file(path, text)
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
end

test("diffusers folder: names mapped to the same modules", function()
  local tensors, meta = from_recipe("sd1")
  local dir = tmp("diffusers")
  local parts = { unet = {}, vae = {}, text_encoder = {} }
  for line in io.lines(GOLD .. "sd1.diffusers") do
    local orig, new = line:match("^([^\t#]+)\t(.*)$")
    if orig then
      local t = tensors[orig]
      local te = new:match("^text_encoder:(.*)$")
      if te then
        parts.text_encoder[te] = t
      elseif orig:match("^first_stage_model%.") then
        if new:match("attentions%.0%.") and #t.shape == 4 then t = t:reshape({ t.shape[1], t.shape[2] }) end
        parts.vae[new] = t
      else
        parts.unet[new] = t
      end
    end
  end
  for _, f in ipairs({ "unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
    "text_encoder/model.safetensors", "text_encoder/config.json", "vae/config.json", "scheduler/scheduler_config.json" }) do
    tmp("diffusers/" .. f)
  end
  for name in pairs(parts) do assert(os.execute("mkdir -p '" .. dir .. "/" .. name .. "'")) end
  assert(os.execute("mkdir -p '" .. dir .. "/scheduler'"))
  kiln.save_safetensors(dir .. "/unet/diffusion_pytorch_model.safetensors", parts.unet, { ["kiln.heads.unet"] = "2" })
  kiln.save_safetensors(dir .. "/vae/diffusion_pytorch_model.safetensors", parts.vae, {})
  kiln.save_safetensors(dir .. "/text_encoder/model.safetensors", parts.text_encoder, {})
  write_file(dir .. "/text_encoder/config.json", '{"hidden_act": "quick_gelu", "num_attention_heads": 2}')
  write_file(dir .. "/vae/config.json", '{"scaling_factor": 0.18215}')
  write_file(dir .. "/scheduler/scheduler_config.json", '{"prediction_type": "epsilon"}')
  local ck <close> = kiln.load_checkpoint(dir)
  eq(ck.family, "sd1"); eq(ck.prediction, "eps")
  local x, t, ctx = inputs(64)
  note("diffusers.unet", close(ck.unet:forward(x, t, ctx), G.sd1["unet.out"], TOL, "unet"))
  local z = kiln.randn({ 1, 4, 8, 8 }, { seed = 3 })
  close(ck.vae:decode(z), G.sd1["vae.decode"], TOL, "vae decode")
  local a, b = window(IDS_A, 49407), window(IDS_B, 49407)
  close(ck.clip.encoders[1].enc:forward({ a, b }), G.sd1["clip.last"], TOL, "clip")
  ck.unet:load("cpu", { dtype = "f16" })
  H.truthy(ck.unet:bytes("cpu") > 0, "diffusers unet loads")
  ck.unet:unload()
  -- the same folder's VAE as a separate file overriding a checkpoint's
  local ck2 <close> = kiln.load_checkpoint(ckpt_file("sd2"), { vae = dir .. "/vae/diffusion_pytorch_model.safetensors" })
  close(ck2.vae:decode(z), G.sd1["vae.decode"], TOL, "override VAE (diffusers names)")
  -- and a text encoder file overriding SD 1.x's
  local ck3 <close> = kiln.load_checkpoint(ckpt_file("sd1"), { clip = dir .. "/text_encoder/model.safetensors" })
  close(ck3.clip.encoders[1].enc:forward({ a, b }), G.sd1["clip.last"], TOL, "override text encoder")
end)

test("diffusers folder: a sharded UNet, configs read as JSON, bad files named", function()
  local dir = T.TMP .. "/diffusers"
  local unet_file = dir .. "/unet/diffusion_pytorch_model.safetensors"
  local ok, whole = pcall(kiln.load_safetensors, unet_file)
  if not ok then H.skip("the previous test wrote no diffusers folder") end
  -- two shards and the index that names them (as diffusers writes large UNets)
  local names = {}
  for name in pairs(whole) do names[#names + 1] = name end
  table.sort(names)
  local shards, map = { {}, {} }, {}
  for n, name in ipairs(names) do
    local i = n % 2 + 1
    shards[i][name] = whole[name]
    map[name] = ("diffusion_pytorch_model-0000%d-of-00002.safetensors"):format(i)
  end
  for i = 1, 2 do
    kiln.save_safetensors(tmp(("diffusers/unet/diffusion_pytorch_model-0000%d-of-00002.safetensors"):format(i)),
      shards[i], { ["kiln.heads.unet"] = "2" })
  end
  write_file(tmp("diffusers/unet/diffusion_pytorch_model.safetensors.index.json"),
    kiln.json.encode({ metadata = { total_size = 0 }, weight_map = map }))
  os.remove(unet_file)
  write_file(dir .. "/scheduler/scheduler_config.json", '{"prediction_type": "v_prediction", "clip_sample": null}')
  write_file(dir .. "/vae/config.json", '{"scaling_factor": 0.2, "latent_channels": 4}')
  local ck <close> = kiln.load_checkpoint(dir .. "/")
  eq(ck.prediction, "v")
  H.near(ck.scale_factor, 0.2, 1e-12)
  local x, t, ctx = inputs(64)
  close(ck.unet:forward(x, t, ctx), G.sd1["unet.out"], TOL, "sharded unet")
  -- a malformed config is an error naming the file, not a silent default
  write_file(dir .. "/vae/config.json", '{"scaling_factor": 0.2,')
  raises(function() kiln.load_checkpoint(dir) end, dir .. "/vae/config.json")
  write_file(dir .. "/vae/config.json", '{"scaling_factor": 0.18215}')
  -- a pickle where the weights should be: named, not opened
  for i = 1, 2 do os.remove(dir .. ("/unet/diffusion_pytorch_model-0000%d-of-00002.safetensors"):format(i)) end
  os.remove(dir .. "/unet/diffusion_pytorch_model.safetensors.index.json")
  write_file(tmp("diffusers/unet/diffusion_pytorch_model.bin"), "PK")
  raises(function() kiln.load_checkpoint(dir) end, "diffusion_pytorch_model.bin", "pickle")
end)

-- ---------------------------------------------------------------- tokenizer

test("clip:tokenize matches CLIP's reference ids", function()
  if not kiln.tokenizer then H.skip("this build has no kiln.tokenizer binding") end
  local dir = SHARED .. "/clip-tokenizer"
  local f = io.open(dir .. "/reference-ids.tsv")
  if not f then H.skip(dir .. " is absent (set KILN_SHARED)") end
  f:close()
  local ck <close> = kiln.load_checkpoint(ckpt_file("sd1"), { tokenizer = dir })
  local n = 0
  for line in io.lines(dir .. "/reference-ids.tsv") do
    if line:sub(1, 1) ~= "#" then
      local prompt, ids = line:match("^(.-)\t(.*)$")
      -- the prompts are JSON strings; these escapes are the ones used there
      prompt = prompt:sub(2, -2):gsub("\\u(%x%x%x%x)", function(h) return utf8.char(tonumber(h, 16)) end)
          :gsub('\\(["\\/])', "%1"):gsub("\\n", "\n"):gsub("\\t", "\t")
      local got = ck.clip:tokenize(prompt)
      local want = parse_shape(ids)
      for i = 1, 77 do
        if got[i] ~= want[i] then
          error(("prompt %q: token %d is %s, expected %s"):format(prompt, i, tostring(got[i]), tostring(want[i])))
        end
      end
      n = n + 1
    end
  end
  H.truthy(n >= 10, "prompts checked: " .. n)
  local long = ck.clip:tokenize(string.rep("cat ", 100))
  eq(#long, 154); eq(long[78], 49406); eq(long[77], 49407)
  local e = ck.clip:encode("a (red:1.2) cat, " .. string.rep("photo ", 80))
  eq(shape_of(e), "1,154,64")
end)

-- ---------------------------------------------------------------- bad input

test("bad input: pickle, truncated, LoRA, unknown layout, missing and mismatched tensors", function()
  local ck = tmp("model.ckpt")
  write_file(ck, "PK\3\4 not really a zip")
  raises(function() kiln.load_checkpoint(ck) end, "model.ckpt", "pickle", "safetensors")
  local fake = tmp("pickle.safetensors")
  write_file(fake, "PK\3\4 zip in disguise")
  raises(function() kiln.load_checkpoint(fake) end, "pickle")
  raises(function() kiln.load_checkpoint(tmp("absent.safetensors")) end, "absent.safetensors")

  local good = ckpt_file("sd1")
  local f = assert(io.open(good, "rb"))
  local data = f:read("a")
  f:close()
  local trunc = tmp("truncated.safetensors")
  write_file(trunc, data:sub(1, #data // 2))
  raises(function() kiln.load_checkpoint(trunc) end, "truncated.safetensors")

  local lora = tmp("lora.safetensors")
  kiln.save_safetensors(lora, {
    ["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"] = kiln.zeros({ 4, 320 }),
    ["lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight"] = kiln.zeros({ 320, 4 }),
  }, {})
  raises(function() kiln.load_checkpoint(lora) end, "LoRA", "lora_unet_down_blocks_0")

  local other = tmp("other.safetensors")
  kiln.save_safetensors(other, { ["foo.bar.weight"] = kiln.zeros({ 2 }), ["foo.baz"] = kiln.zeros({ 2 }) }, {})
  raises(function() kiln.load_checkpoint(other) end, "unknown checkpoint layout", "foo.bar.weight")

  local tensors, meta = from_recipe("sd1")
  tensors["first_stage_model.decoder.mid.block_1.conv1.weight"] = nil
  tensors["model.diffusion_model.input_blocks.1.0.out_layers.3.weight"] = kiln.zeros({ 32, 30, 3, 3 })
  local bad = tmp("bad.safetensors")
  kiln.save_safetensors(bad, tensors, meta)
  raises(function() kiln.load_checkpoint(bad) end,
    "model.diffusion_model.input_blocks.1.0.out_layers.3.weight' has shape [32, 30, 3, 3], expected [32, 32, 3, 3]")
  tensors["model.diffusion_model.input_blocks.1.0.out_layers.3.weight"] = kiln.zeros({ 32, 32, 3, 3 })
  kiln.save_safetensors(bad, tensors, meta)
  raises(function() kiln.load_checkpoint(bad) end,
    "missing tensor 'first_stage_model.decoder.mid.block_1.conv1.weight' (expected shape [64, 64, 3, 3])")

  local vae_only = tmp("vae_only.safetensors")
  local v = {}
  for n, t in pairs(from_recipe("sd1")) do
    local s = n:match("^first_stage_model%.(.*)$")
    if s then v[s] = t end
  end
  kiln.save_safetensors(vae_only, v, {})
  raises(function() kiln.load_checkpoint(vae_only) end, "standalone VAE", "{vae = PATH}")
  raises(function() kiln.load_checkpoint(good, { family = "hidream" }) end, "hidream")
  -- a known family forced on a file that is not one: the missing tensor named
  raises(function() kiln.load_checkpoint(good, { family = "sd3" }) end, "x_embedder.proj.weight")
  raises(function() kiln.load_checkpoint(good, { bogus = 1 }) end, "unknown option 'bogus'")
  raises(function() kiln.load_checkpoint(good, { vae = other }) end, "not a VAE")

  local c <close> = kiln.load_checkpoint(good)
  -- nothing beside the file: CLIP's vocabulary built into the library
  eq(table.concat(c.clip:tokenize("a cat"), " ", 1, 4), "49406 320 2368 49407")
  local x, t, ctx = inputs(64)
  raises(function() c.unet:forward(x, t, kiln.zeros({ 2, 77, 32 })) end, "context must be [B, L, 64]")
  raises(function() c.unet:forward(kiln.zeros({ 2, 3, 8, 8 }), t, ctx) end, "x must be [B, 4, h, w]")
  raises(function() c.unet:forward(x, kiln.tensor({ 1, 2, 3 }), ctx) end, "3 timesteps for a batch of 2")
  raises(function() c.clip.encoders[1].enc:forward({ 49406, 60000 }) end, "outside the vocabulary")
  raises(function() c.vae:encode(kiln.zeros({ 1, 3, 15, 16 })) end, "multiple of 2")
end)

test("parts are models: <close> and close release the weights", function()
  local ck = kiln.load_checkpoint(ckpt_file("sd1"))
  do
    local u <close> = ck.unet
    u:load("cpu")
    H.truthy(u:bytes("cpu") > 0)
  end
  raises(function() ck.unet:w("out.2.weight") end, "closed")
  ck:close()
  raises(function() ck.vae:w("decoder.conv_in.weight") end, "closed")
end)

-- ---------------------------------------------------------------- summary

test("SDXL: the size conditioning follows the pooled vector's device (text encoded on sim)", function()
  local has_sim = false
  for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end
  if not has_sim then H.skip("no sim device in this build") end
  local p = kiln.randn({ 1, 32 }, { seed = 3 })
  local on_cpu = unet.sdxl_vector(p, { width = 64, height = 48 })
  local ps = p:to("sim")
  local on_sim = unet.sdxl_vector(ps, { width = 64, height = 48 })
  eq(on_sim.device, "sim")
  local back = on_sim:to("cpu")
  eq(H.maxdiff(back, on_cpu), 0, "same vector")
  for _, v in ipairs({ p, on_cpu, ps, on_sim, back }) do v:free() end
end)

local summary = {}
for _, r in ipairs(report) do summary[#summary + 1] = r end
print("# max relative error: " .. table.concat(summary, ", "))
T.cleanup({ "/diffusers/unet", "/diffusers/vae", "/diffusers/text_encoder", "/diffusers/scheduler", "/diffusers" })
H.done()
