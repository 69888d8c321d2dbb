-- Flux.1 files as users have them (kiln.families.flux_files, kiln.dit_files): the tiny
-- transformer of tests/golden/gen_flux_files.py, written by that generator as diffusers
-- (one file and sharded), ComfyUI fp8 and scaled fp8, city96's GGUF (F16, Q8_0, Q5_K,
-- Q4_K, Q4_0) and stable-diffusion.cpp's GGUF, loads to the recipe's weights: every
-- tensor within its format's rounding (bit-identical where the format is f16), and the
-- forward close to the f32 file's. A whole ComfyUI checkpoint (model.diffusion_model.,
-- text_encoders.clip_l., text_encoders.t5xxl., vae.) gives dit, clip, t5 and vae from
-- the one file. Bad input: missing blocks named, a variant asked for that the file is
-- not, T5 / CLIP widths that do not fit the transformer; nothing stays loaded.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local DIR = "tests/golden/flux_files/"
local base, META = T.build_recipe("../flux_files/tiny")
if kiln.set_quiet then kiln.set_quiet(true) end
local report = {}

local function names_of(t)
  local r = {}
  for k in pairs(t) do r[#r + 1] = k end
  table.sort(r)
  return r
end

local files = {}
local function file(name, prefix, drop, extra)
  if not files[name] then
    local t = {}
    for k, v in pairs(base) do
      if not (drop and k:match(drop)) then t[(prefix or "") .. k] = v end
    end
    for k, v in pairs(extra or {}) do t[k] = v end
    files[name] = T.tmp(name .. ".safetensors")
    kiln.save_safetensors(files[name], t, META)
  end
  return files[name]
end
local function bfl_file() return file("tiny-dev") end

-- the forward's inputs
local X = kiln.randn({ 1, 16, 4, 6 }, { seed = 11 })
local CTX = kiln.randn({ 1, 5, 32 }, { seed = 12 })
local Y = kiln.randn({ 1, 64 }, { seed = 13 })
local function forward(ck)
  return ck.dit:forward(X, kiln.tensor({ 0.4 }), CTX, Y, { guidance = 3.5 })
end

local REF = {}
do
  local ck <close> = kiln.load_checkpoint(bfl_file())
  REF.dev = forward(ck)
  local ck2 <close> = kiln.load_checkpoint(file("tiny-schnell", "", "^guidance_in%."))
  REF.schnell = forward(ck2)
end

local function rel(a, b)
  local d = (a:to("cpu"):to("f32") - b):abs():max()
  return d / b:abs():max()
end

-- per format: how far a loaded tensor may be from the recipe's, as a function of the
-- recipe tensor (nil: equal to the recipe rounded to f16, bit for bit)
local function fp8_tol(w, scale)
  -- e4m3fn: half a step, 2^-4 relative, plus the subnormal step 2^-9 (times the scale)
  return (w:abs() * 0.0625) + (2 ^ -9) * (scale or 1)
end

-- Compares every tensor the network reads with the recipe: returns the worst
-- difference over the allowed one (<= 1 passes), and the canonical names checked.
local function compare_weights(ck, mode)
  local w = ck.dit.weights
  local worst, n = 0, 0
  for _, name in ipairs(names_of(base)) do
    if ck.dit.config.guidance or not name:match("^guidance_in%.") then
      local ref = base[name]
      local t = w:tensor(name)
      local got = t:to("cpu"):to("f32")
      t:free()
      eq(table.concat(got.shape, ","), table.concat(ref.shape, ","), name)
      local diff = (got - ref):abs()
      local one_d = #ref.shape == 1
      local r
      if mode == "f32" or (type(mode) == "number" and one_d) then
        r = diff:max() == 0 and 0 or math.huge                 -- stored f32: exact
      elseif mode == "f16" or one_d then
        -- stored f16: the recipe's value rounded to f16, bit for bit
        r = (got - ref:to("f16"):to("f32")):abs():max() == 0 and 0 or math.huge
      elseif mode == "fp8" then
        r = (diff / fp8_tol(ref)):max()
      elseif mode == "fp8s" then
        r = (diff / fp8_tol(ref, ref:abs():max() / 448)):max()
      else
        -- GGUF blocks: at worst about half a quantization step of the block's range
        -- (Q4_0's clamped end a whole step: 1/8 of it); the types fall back per
        -- tensor, so the loosest type of the file bounds them all, f16 tensors stay
        -- well within
        r = diff:max() / (ref:abs():max() * mode)
      end
      if r > 1 then error(("%s: %s is off by %.3g of its allowance"):format(mode, name, r), 2) end
      worst = math.max(worst, r)
      n = n + 1
    end
  end
  return worst, n
end

for _, case in ipairs({
  { "diffusers transformer/ folder (one file, [schnell])", DIR .. "diffusers", "f16", "schnell", 2e-3 },
  { "diffusers transformer/ folder (sharded, index.json)", DIR .. "diffusers_sharded", "f16", "dev", 2e-3 },
  { "the transformer/ folder itself", DIR .. "diffusers_sharded/transformer", "f16", "dev", 2e-3 },
  { "ComfyUI fp8 e4m3fn ([schnell])", DIR .. "comfy_fp8_e4m3fn.safetensors", "fp8", "schnell", 0.2 },
  { "ComfyUI scaled fp8", DIR .. "comfy_fp8_scaled.safetensors", "fp8s", "dev", 0.2 },
  { "city96 GGUF F16", DIR .. "city96_f16.gguf", 2 ^ -11, "dev", 2e-3 },
  { "city96 GGUF Q8_0", DIR .. "city96_q8_0.gguf", 1 / 200, "dev", 0.05 },
  { "city96 GGUF Q5_K (Q5_1 fallback)", DIR .. "city96_q5_k.gguf", 1 / 24, "dev", 0.2 },
  { "city96 GGUF Q4_K (Q5_0 fallback)", DIR .. "city96_q4_k.gguf", 1 / 12, "dev", 0.3 },
  { "city96 GGUF Q4_0", DIR .. "city96_q4_0.gguf", 1 / 7, "dev", 0.3 },
  { "stable-diffusion.cpp GGUF Q8_0 ([schnell])", DIR .. "sdcpp_q8_0.gguf", 1 / 200, "schnell", 0.05 },
}) do
  local label, path, mode, variant, ftol = case[1], case[2], case[3], case[4], case[5]
  test("Flux file layouts: " .. label .. " loads to the recipe's weights", function()
    local ck <close> = kiln.load_checkpoint(path)
    eq(ck.family, "flux")
    eq(ck.variant, variant)
    eq(ck.dit.config.hidden, 16); eq(ck.dit.config.heads, 1)
    eq(table.concat(ck.dit.config.axes_dim, ","), "4,6,6")
    local worst, n = compare_weights(ck, mode)
    eq(n, variant == "dev" and 52 or 48, "tensors compared")
    local out = forward(ck)
    local r = rel(out, REF[variant])
    truthy(r <= ftol, ("%s: forward differs by %.3g (allowed %.3g)"):format(label, r, ftol))
    report[#report + 1] = ("%s: weights %s, forward %.2e"):format(label,
      worst == 0 and "bit-identical" or ("within %.0f%% of the allowance"):format(worst * 100), r)
  end)
end

test("Flux file layouts: a diffusers transformer saved as one file (as ComfyUI's UNETLoader reads it)", function()
  local src = kiln.load_safetensors(DIR .. "diffusers/transformer/diffusion_pytorch_model.safetensors")
  local p = T.tmp("flux-diffusers-single.safetensors")
  kiln.save_safetensors(p, src, META)   -- config.json's heads and axes as the file's metadata
  for _, v in pairs(src) do v:free() end
  local ck <close> = kiln.load_checkpoint(p)
  eq(ck.family, "flux")
  eq(ck.variant, "schnell")
  eq(compare_weights(ck, "f16"), 0)
  truthy(rel(forward(ck), REF.schnell) <= 2e-3, "forward")
end)

test("Flux file layouts: the composed tensors stream with their block in mode low", function()
  local has_sim = false
  for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end
  if not has_sim then H.skip("no sim device") end
  local ck <close> = kiln.load_checkpoint(DIR .. "diffusers_sharded")
  kiln.memory_mode("low")
  ck.dit:load("sim")
  local ok, out = pcall(forward, ck)
  kiln.memory_mode("normal")
  truthy(ok, tostring(out))
  local r = rel(out, REF.dev)
  truthy(r <= 2e-3, "low mode forward " .. r)
  eq(ck.dit:bytes("sim"), 0, "nothing left on sim")
  -- every stored part of a fused tensor is in its block's plan
  local seen = {}
  for _, b in ipairs(ck.dit.streamer.blocks) do
    for _, n in ipairs(b.real) do seen[n] = b.key end
  end
  eq(seen["transformer_blocks.0.attn.to_k.weight"], "double_blocks.0.")
  eq(seen["single_transformer_blocks.0.proj_mlp.bias"], "single_blocks.0.")
  eq(seen["norm_out.linear.weight"], "final_layer.")
  out:free()
  ck.dit:unload()
end)

-- ---------------------------------------------------------------- a whole ComfyUI checkpoint

-- The tiny SD 1.x recipe's CLIP (64 wide: the tiny transformer's vector_in) and VAE
-- under ComfyUI's Flux prefixes, the T5 golden (32 wide: its txt_in) under
-- text_encoders.t5xxl.transformer.
local function all_in_one(name, opts)
  opts = opts or {}
  if files[name] then return files[name] end
  local t = {}
  for k, v in pairs(opts.dit or base) do t["model.diffusion_model." .. k] = v end
  local sd = T.from_recipe("sd1")
  for k, v in pairs(sd) do
    local c = k:match("^cond_stage_model%.transformer%.(.*)$")
    if c and not opts.no_clip then t["text_encoders.clip_l.transformer." .. c] = v end
    local vv = k:match("^first_stage_model%.(.*)$")
    if vv then t["vae." .. vv] = v end
  end
  local t5 = kiln.load_safetensors(opts.t5 or "tests/golden/t5/comfy.safetensors")
  for k, v in pairs(t5) do t["text_encoders.t5xxl.transformer." .. k] = v end
  files[name] = T.tmp(name .. ".safetensors")
  kiln.save_safetensors(files[name], t, META)
  for _, v in pairs(t5) do v:free() end
  return files[name]
end

test("Flux file layouts: a whole ComfyUI checkpoint gives dit, clip, t5 and vae from one file", function()
  local p = all_in_one("aio")
  local ck <close> = kiln.load_checkpoint(p)
  eq(ck.family, "flux")
  eq(ck.variant, "dev")
  local worst = compare_weights(ck, "f32")
  eq(worst, 0)
  local r = rel(forward(ck), REF.dev)
  eq(r, 0, "the same numbers as BFL's file")
  -- each part over its own names of the file
  truthy(ck.clip.config.encoders[1].width == 64, "CLIP found")
  eq(ck.t5.config.d_model, 32)
  local t5ref <close> = kiln.load_t5("tests/golden/t5/comfy.safetensors")
  local a, b = ck.t5:forward({ 5, 17, 1 }), t5ref:forward({ 5, 17, 1 })
  eq((a - b):abs():max(), 0, "T5 from the checkpoint = T5 from its own file")
  truthy(ck.vae.factor ~= nil, "VAE found")
  truthy(ck.vae:has("vae.decoder.conv_in.weight"), "the VAE's weights are the file's vae.*")
  eq(ck.vae.latent_channels, 4, "the tiny SD VAE's")
  -- options still override the checkpoint's own parts
  local ck2 <close> = kiln.load_checkpoint(p, { t5 = "tests/golden/t5/bare.safetensors" })
  truthy(ck2.t5:has("encoder.block.0.layer.0.SelfAttention.q.weight") or
    ck2.t5:has("block.0.layer.0.SelfAttention.q.weight"), "t5 option's file")
end)

-- ---------------------------------------------------------------- bad input

-- Every model of the state is closed: the load left nothing open.
local function models_open()
  collectgarbage(); collectgarbage()
  return kiln.mem.stats("cpu").allocated
end

test("Flux bad input: a file missing blocks names them and the file", function()
  local p = file("tiny-hole", "", "^double_blocks%.0%.img_attn%.qkv")
  local err = raises(function() return kiln.load_checkpoint(p) end)
  truthy(err:find("double_blocks.0", 1, true), err)
  truthy(err:find(p, 1, true), err)
  -- a tensor of a block missing (not the one that numbers it)
  p = file("tiny-hole2", "", "^single_blocks%.0%.modulation")
  err = raises(function() return kiln.load_checkpoint(p) end)
  truthy(err:find("single_blocks.0.modulation.lin.weight", 1, true), err)
  -- in a diffusers folder, said in its names
  local dir = T.tmp("diffusers-hole")
  local tdir = dir .. "/transformer"
  assert(os.execute("mkdir -p '" .. tdir .. "'"))
  local src = kiln.load_safetensors(DIR .. "diffusers/transformer/diffusion_pytorch_model.safetensors")
  local keep = {}
  for k, v in pairs(src) do if not k:match("^transformer_blocks%.0%.attn%.to_k%.") then keep[k] = v end end
  local tf = T.tmp("diffusers-hole/transformer/diffusion_pytorch_model.safetensors")
  kiln.save_safetensors(tf, keep)
  local cj = T.tmp("diffusers-hole/transformer/config.json")
  local f = assert(io.open(cj, "w"))
  f:write(assert(io.open(DIR .. "diffusers/transformer/config.json")):read("a"))
  f:close()
  for _, v in pairs(src) do v:free() end
  err = raises(function() return kiln.load_checkpoint(dir) end)
  truthy(err:find("transformer_blocks.0.attn.to_k.weight", 1, true), err)
  truthy(err:find(tf, 1, true), err)
  os.remove(tf); os.remove(cj); os.remove(tdir)
end)

test("Flux bad input: a [dev] file asked for as [schnell] (and back) is refused, saying why", function()
  local err = raises(function() return kiln.load_checkpoint(bfl_file(), { variant = "schnell" }) end)
  truthy(err:find("[dev]", 1, true) and err:find("guidance_in", 1, true), err)
  truthy(err:find(bfl_file(), 1, true), err)
  err = raises(function() return kiln.load_checkpoint(DIR .. "sdcpp_q8_0.gguf", { variant = "dev" }) end)
  truthy(err:find("[schnell]", 1, true), err)
  err = raises(function() return kiln.load_checkpoint(bfl_file(), { variant = "pro" }) end)
  truthy(err:find("\"dev\"", 1, true), err)
  -- the matching variant loads
  local ck <close> = kiln.load_checkpoint(bfl_file(), { variant = "dev" })
  eq(ck.variant, "dev")
  -- [schnell] has no guidance input: BFL's model ignores the argument, so does kiln's
  local ck2 <close> = kiln.load_checkpoint(DIR .. "sdcpp_q8_0.gguf", { variant = "schnell" })
  local a = ck2.dit:forward(X, 0.4, CTX, Y)
  local b = ck2.dit:forward(X, 0.4, CTX, Y, { guidance = 3.5 })
  eq((a - b):abs():max(), 0)
  -- a [dev] network run without guidance says so
  err = raises(function() return ck.dit:forward(X, 0.4, CTX, Y) end)
  truthy(err:find("guidance", 1, true), err)
end)

test("Flux bad input: T5 / CLIP widths that do not fit the transformer, nothing left loaded", function()
  local before = models_open()
  -- txt_in made 48 wide: the 32-wide T5 does not fit it
  local wide = {}
  for k, v in pairs(base) do wide[k] = v end
  wide["txt_in.weight"] = kiln.randn({ 16, 48 }, { seed = 5 })
  local p = all_in_one("aio-t5-wide", { dit = wide })
  local err = raises(function() return kiln.load_checkpoint(p) end)
  truthy(err:find("T5", 1, true) and err:find("32", 1, true) and err:find("48", 1, true), err)
  truthy(err:find("txt_in", 1, true), err)
  -- a separate T5 file of the wrong width: named
  err = raises(function() return kiln.load_checkpoint(file("tiny-t5wide", "", nil, { ["txt_in.weight"] =
    wide["txt_in.weight"] }), { t5 = "tests/golden/t5/comfy.safetensors" }) end)
  truthy(err:find("tests/golden/t5/comfy.safetensors", 1, true), err)
  -- vector_in made 24 wide: the 64-wide CLIP does not fit it
  local narrow = {}
  for k, v in pairs(base) do narrow[k] = v end
  narrow["vector_in.in_layer.weight"] = kiln.randn({ 16, 24 }, { seed = 6 })
  p = all_in_one("aio-clip-narrow", { dit = narrow })
  err = raises(function() return kiln.load_checkpoint(p) end)
  truthy(err:find("CLIP", 1, true) and err:find("vector_in", 1, true) and err:find("24", 1, true), err)
  wide["txt_in.weight"]:free()
  narrow["vector_in.in_layer.weight"]:free()
  eq(models_open(), before, "a refused load keeps no bytes")
end)

print("# " .. table.concat(report, "\n# "))
for _, v in pairs(REF) do v:free() end
X:free(); CTX:free(); Y:free()
for _, v in pairs(base) do v:free() end
T.cleanup({ "/diffusers-hole/transformer", "/diffusers-hole" })
H.done()
