-- SD 3.5 (kiln.mmdit, kiln.families.sd3): the tiny Medium-, Large- and SD 3 Medium-style
-- networks of tests/golden/gen_sd3.py (weights rebuilt from its recipes: seeded
-- kiln.randn = torch.randn) match what Stability AI's sd3.5 reference code computes
-- (MMDiTX.forward, skip_layers, BaseModel.apply_model, CFGDenoiser,
-- SkipLayerCFGDenoiser, ModelSamplingDiscreteFlow, get_sigmas, get_cond over tiny
-- CLIP-L / bigG) in bare names and under ComfyUI's prefix; files are recognised as
-- "sd3" with their variant and configuration; an all-in-one file and separate CLIP files
-- give the same conditioning; mode "low" streams the blocks within a budget under the
-- weights to the same numbers; damaged files are refused naming the file and tensor.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local mmdit = require "kiln.mmdit"
local family = require "kiln.family"
local sample = require "kiln.sample"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local MiB = 1024 * 1024
local IO = kiln.load_safetensors("tests/golden/sd3/io.safetensors")
local TOL = 1e-4
local F = family.get("sd3")

local recipes = {}
local function recipe(name)
  if not recipes[name] then recipes[name] = { T.build_recipe("../sd3/" .. name) } end
  return recipes[name][1], recipes[name][2]
end

-- Writes a recipe (without names matching `drop`, under `prefix`) as a file, once.
local files = {}
local function file(key, name, prefix, drop, meta)
  if not files[key] then
    local base = recipe(name)
    local t = {}
    for k, v in pairs(base) do
      if not (drop and k:match(drop)) then t[(prefix or "") .. k] = v end
    end
    files[key] = T.tmp(key .. ".safetensors")
    kiln.save_safetensors(files[key], t, meta)
  end
  return files[key]
end

-- max |a - b| / max |b|
local function rel(a, b)
  eq(H.shape_of(a), H.shape_of(b), "shape")
  local d = (a:to("cpu"):to("f32") - b):abs():max()
  return d / b:abs():max()
end

local report = {}
if kiln.set_quiet then kiln.set_quiet(true) end

test("kiln.families lists sd3 after flux; the family declares SD 3.5's latent, defaults and variants", function()
  local names = table.concat(kiln.families, ",")
  truthy(names:find("flux,sd3", 1, true), names)
  eq(F.label, "SD 3.5")
  eq(F.latent.channels, 16); eq(F.latent.scale_factor, 1.5305); eq(F.latent.shift_factor, 0.0609)
  eq(F.defaults.shift, 3.0); eq(F.defaults.prediction, "flow")
  eq(F.variants.large.steps, 28); eq(F.variants.large.cfg, 4.5)
  eq(F.variants.large_turbo.steps, 4); eq(F.variants.large_turbo.cfg, 1.0)
  eq(F.variants.medium.steps, 40); eq(F.variants.medium.cfg, 4.5)
  eq(table.concat(F.variants.medium.skip_layer_guidance.layers, ","), "7,8,9")
end)

local CASES = {
  { "medium", "medium", { depth = 3, hidden = 192, heads = 3, x = "0,1", qk = true } },
  { "large", "large", { depth = 2, hidden = 128, heads = 2, x = "", qk = true } },
  { "sd3", "sd3_medium", { depth = 2, hidden = 128, heads = 2, x = "", qk = false } },
}

for _, c in ipairs(CASES) do
  local name, variant, want = c[1], c[2], c[3]
  for _, prefix in ipairs({ "", "model.diffusion_model." }) do
    test(("SD3 %s%s: a diffusion-model file alone loads, dit matches the reference"):format(name,
      prefix == "" and "" or ", ComfyUI prefix"), function()
      local ck <close> = kiln.load_checkpoint(file(name .. prefix, name, prefix))
      eq(ck.family, "sd3")
      eq(ck.variant, variant)
      eq(ck.scale_factor, 1.5305); eq(ck.shift_factor, 0.0609)
      local cfg = ck.dit.config
      eq(cfg.depth, want.depth); eq(cfg.hidden, want.hidden); eq(cfg.heads, want.heads); eq(cfg.head_dim, 64)
      eq(cfg.patch, 2); eq(cfg.pos_embed_max_size, 6); eq(cfg.context_dim, 32); eq(cfg.adm_dim, 24)
      eq(cfg.in_channels, 16); eq(cfg.out_channels, 16); eq(cfg.mlp_hidden, 4 * want.hidden)
      eq(table.concat(cfg.x_self_attn_layers, ","), want.x); eq(cfg.qk_norm, want.qk); eq(cfg.pre_only_last, true)
      local out = ck.dit:forward(IO.x, IO.t, IO.context, IO.y)
      local r = rel(out, IO[name .. ".out"])
      truthy(r <= TOL, name .. ": relative difference " .. r)
      if prefix == "" then report[#report + 1] = ("%s: max |diff| / max |ref| = %.2e"):format(name, r) end
      -- the reference's denoised = x - sigma * v, per batch row
      local s = IO.sigma:table()
      local rows = {}
      for b = 1, 2 do
        local xb, ob = IO.x:narrow(1, b, 1), out:narrow(1, b, 1)
        rows[b] = F.denoised(xb, ob, s[b])
      end
      local den = kiln.cat(rows, 1)
      r = rel(den, IO[name .. ".denoised"])
      truthy(r <= TOL, name .. " denoised: relative difference " .. r)
      -- the parts a diffusion-model file lacks say which file to pass
      for _, p in ipairs({ { "vae", "vae" }, { "clip", "clip_l" }, { "t5", "t5xxl" } }) do
        local err = raises(function() return ck[p[1]]:decode(out) end)
        truthy(err:find(p[2], 1, true), err)
      end
    end)
  end
end

test("SD3 medium: skip_layers, CFG and skip-layer guidance as the reference's denoisers", function()
  local ck <close> = kiln.load_checkpoint(file("medium", "medium", ""))
  local out = ck.dit:forward(IO.x, IO.t, IO.context, IO.y, { skip_layers = { 1 } })
  local r = rel(out, IO["medium.skip1"])
  truthy(r <= TOL, "skip_layers {1}: " .. r)
  local cond = { context = IO.context:narrow(1, 1, 1), y = IO.y:narrow(1, 1, 1) }
  local uncond = { context = IO.context:narrow(1, 2, 1), y = IO.y:narrow(1, 2, 1) }
  local x1, s1 = IO.x:narrow(1, 1, 1), IO.sigma:table()[1]
  local d = F.denoiser(ck.dit, cond, uncond, { cfg = 4.5 })
  r = rel(d(x1, s1), IO["medium.cfg"])
  truthy(r <= TOL, "CFG: " .. r)
  -- the reference's step window: step 0 is outside it (not > 0.01 * 10), step 1 inside
  local g = F.denoiser(ck.dit, cond, uncond, { cfg = 4.5, steps = 10,
    skip_layer_guidance = { layers = { 1 }, scale = 2.5, start = 0.01, stop = 0.2, window = "steps" } })
  r = rel(g(x1, s1), IO["medium.cfg"])
  truthy(r <= TOL, "SLG step 0 = CFG: " .. r)
  r = rel(g(x1, s1), IO["medium.slg"])
  truthy(r <= TOL, "SLG step 1: " .. r)
  -- ComfyUI's sigma window (start 0.01 -> sigma ~0.9967, end 0.15 -> ~0.944): sigma 0.9
  -- is outside it, 0.95 inside
  local ms = F.model_sampling(3.0)
  truthy(math.abs(ms.percent_to_sigma(0.15) - 3 * 0.85 / (1 + 2 * 0.85)) < 1e-12)
  local c = F.denoiser(ck.dit, cond, uncond, { cfg = 4.5, skip_layer_guidance = { layers = { 1 }, scale = 2.5 } })
  r = rel(c(x1, 0.9), IO["medium.cfg"])
  truthy(r <= TOL, "ComfyUI window, sigma 0.9: plain CFG " .. r)
  local plain = F.denoiser(ck.dit, cond, uncond, { cfg = 4.5 })(x1, 0.95)
  local guided = c(x1, 0.95)
  truthy((guided - plain):abs():max() > 1e-3, "sigma 0.95 is guided")
  -- bad options are refused
  local err = raises(function() return ck.dit:forward(IO.x, IO.t, IO.context, IO.y, { skip_layers = { 1.5 } }) end)
  truthy(err:find("skip_layers", 1, true), err)
  err = raises(function() return F.denoiser(ck.dit, cond, nil, { cfg = 4.5 }) end)
  truthy(err:find("negative", 1, true), err)
end)

test("SD3 schedule: ModelSamplingDiscreteFlow(3.0) and get_sigmas as the reference", function()
  local ms = F.model_sampling(3.0)
  local ref = IO.sigmas_shift3:table()
  eq(#ms.sigmas, 1000)
  local worst = 0
  for i = 1, 1000 do worst = math.max(worst, math.abs(ms.sigmas[i] - ref[i])) end
  truthy(worst <= 1e-6, "sigmas: " .. worst)
  eq(F.timestep(0.5), 500)
  for _, n in ipairs({ 28, 4 }) do
    local got = sample.sigmas("normal", n, { model_sampling = ms }):table()
    local want = IO["sched_" .. n]:table()
    eq(#got, #want)
    for i = 1, #want do truthy(math.abs(got[i] - want[i]) <= 1e-6, ("sched %d [%d]: %g vs %g"):format(n, i, got[i],
      want[i])) end
  end
  -- ComfyUI's default scheduler over the same table
  local simple = sample.sigmas("simple", 4, { model_sampling = ms }):table()
  eq(simple[1], ms.sigmas[1000]); eq(simple[5], 0)
  local x, nz = kiln.ones({ 1, 2 }), kiln.zeros({ 1, 2 })
  eq(F.noise_scaling(0.25, x, nz):table()[1][1], 0.25)
  raises(function() return F.model_sampling(-1) end)
end)

-- The tiny CLIP-L and bigG of the golden, with the metadata their shapes do not say.
local CLIP_META = { ["kiln.heads.clip"] = "2", ["kiln.heads.clip_g"] = "2", ["kiln.clip.activation"] = "quick_gelu",
  ["kiln.clip_g.activation"] = "gelu" }

local function all_in_one()
  if not files.aio then
    local t = {}
    for k, v in pairs(recipe("medium")) do t["model.diffusion_model." .. k] = v end
    for k, v in pairs(recipe("clip_l")) do t["text_encoders.clip_l.transformer." .. k] = v end
    for k, v in pairs(recipe("clip_g")) do t["text_encoders.clip_g.transformer." .. k] = v end
    files.aio = T.tmp("sd3-aio.safetensors")
    kiln.save_safetensors(files.aio, t, CLIP_META)
  end
  return files.aio
end

local function check_cond(ck, what)
  ck.clip.tokenizer = T.word_tokenizer
  local ctx, y = F.encode(ck, "a photo of a cat")
  eq(H.shape_of(ctx), "1,154,4096", what .. " context")
  local head = ctx:narrow(2, 1, 77):narrow(3, 1, 80)
  local r = rel(head, IO["cond.lg"])
  truthy(r <= TOL, what .. " CLIP states: " .. r)
  eq(ctx:narrow(3, 81, 4096 - 80):abs():max(), 0, what .. ": zero padding")
  eq(ctx:narrow(2, 78, 77):abs():max(), 0, what .. ": the empty T5's zeros")
  r = rel(y, IO["cond.pooled"])
  truthy(r <= TOL, what .. " pooled: " .. r)
  return ctx, y
end

test("SD3 conditioning: an all-in-one file's CLIP-L and bigG give the reference's get_cond", function()
  local p = all_in_one()
  local ck <close> = kiln.load_checkpoint(p)
  eq(ck.family, "sd3"); eq(ck.variant, "medium")
  check_cond(ck, "all-in-one")
  -- the network inside works as the bare file's
  local r = rel(ck.dit:forward(IO.x, IO.t, IO.context, IO.y), IO["medium.out"])
  truthy(r <= TOL, "all-in-one dit: " .. r)
end)

test("SD3 conditioning: separate clip_l / clip_g files beside a diffusion-model file give the same", function()
  local function enc(name, key)
    local t = {}
    for k, v in pairs(recipe(name)) do t[k] = v end
    local m = { ["kiln.heads." .. key] = "2", ["kiln." .. key .. ".activation"] = CLIP_META["kiln." .. key ..
      ".activation"] }
    local p = T.tmp("sd3-" .. name .. ".safetensors")
    kiln.save_safetensors(p, t, m)
    return p
  end
  local ck <close> = kiln.load_checkpoint(file("medium", "medium", ""), { clip_l = enc("clip_l", "clip"),
    clip_g = enc("clip_g", "clip_g") })
  check_cond(ck, "separate files")
end)

test("SD3 conditioning: T5 states follow the CLIP block; bad inputs are refused", function()
  local lg = kiln.randn({ 1, 77, 80 }, { seed = 7 })
  local t5 = kiln.randn({ 1, 9, 4096 }, { seed = 8 })
  local ctx = F.context(lg, t5)
  eq(H.shape_of(ctx), "1,86,4096")
  eq((ctx:narrow(2, 1, 77):narrow(3, 1, 80) - lg):abs():max(), 0)
  eq((ctx:narrow(2, 78, 9) - t5):abs():max(), 0)
  eq(ctx:narrow(2, 1, 77):narrow(3, 81, 4016):abs():max(), 0)
  local err = raises(function() return F.context(lg, kiln.randn({ 1, 9, 100 }, { seed = 9 })) end)
  truthy(err:find("4096", 1, true), err)
  eq(H.shape_of(F.pooled(kiln.zeros({ 1, 768 }), kiln.zeros({ 1, 1280 }))), "1,2048")
  local ids = F.t5_ids and kiln.t5 and kiln.t5.tokenize and F.t5_ids("a cat")
  if ids then
    eq(#ids, 77); eq(ids[#ids], 0)
  end
end)

test("SD3: detection, variants and damaged files", function()
  local base = recipe("large")
  local shapes = {}
  for k, v in pairs(base) do shapes["model.diffusion_model." .. k] = v.shape end
  local L = family.layout(shapes, {}, "x.safetensors")
  eq(L.family, "sd3"); eq(L.unet, "model.diffusion_model.")
  eq(F.variant(shapes, L.unet, {}, "/m/sd3.5_large.safetensors"), "large")
  eq(F.variant(shapes, L.unet, {}, "/m/sd3.5_large_turbo.safetensors"), "large_turbo")
  eq(F.variant(shapes, L.unet, { ["modelspec.title"] = "Stable Diffusion 3.5 Large Turbo" }, "m.safetensors"),
    "large_turbo")
  -- neither an SD UNet nor Flux is taken for SD 3
  truthy(F.parts.ldm.find_unet({ ["model.diffusion_model.input_blocks.0.0.weight"] = { 32, 4, 3, 3 } }) == nil)
  truthy(F.parts.ldm.find_unet({ ["double_blocks.0.img_attn.qkv.weight"] = { 192, 64 } }) == nil)
  -- a missing block: refused, naming the file and the block
  local p = file("sd3-hole", "large", "", "^joint_blocks%.0%.")
  local err = raises(function() return kiln.load_checkpoint(p) end)
  truthy(err:find("joint_blocks.0", 1, true), err)
  truthy(err:find(p, 1, true), "names the file: " .. err)
  -- a missing tensor in a block: named
  p = file("sd3-hole2", "large", "", "^joint_blocks%.0%.x_block%.mlp%.fc2%.weight")
  err = raises(function() return kiln.load_checkpoint(p) end)
  truthy(err:find("joint_blocks.0.x_block.mlp.fc2.weight", 1, true), err)
  truthy(err:find(p, 1, true), "names the file: " .. err)
  -- a wrong width: named with its shapes
  local t = {}
  for k, v in pairs(base) do t[k] = v end
  t["joint_blocks.1.x_block.attn.proj.weight"] = kiln.zeros({ 128, 96 })
  p = T.tmp("sd3-width.safetensors")
  kiln.save_safetensors(p, t)
  err = raises(function() return kiln.load_checkpoint(p) end)
  truthy(err:find("joint_blocks.1.x_block.attn.proj.weight", 1, true), err)
  truthy(err:find(p, 1, true), "names the file: " .. err)
  -- a position table that is not square
  local s2 = {}
  for k, v in pairs(base) do s2[k] = v.shape end
  s2.pos_embed = { 1, 35, 128 }
  err = raises(function() return mmdit.config(s2, {}) end)
  truthy(err:find("pos_embed", 1, true), err)
  -- inputs the network cannot take
  local ck <close> = kiln.load_checkpoint(file("large", "large", ""))
  err = raises(function() return ck.dit:forward(IO.x:narrow(3, 1, 5), IO.t, IO.context, IO.y) end)
  truthy(err:find("patch", 1, true), err)
  err = raises(function() return ck.dit:forward(kiln.zeros({ 1, 16, 14, 4 }), 500, IO.context:narrow(1, 1, 1),
    IO.y:narrow(1, 1, 1)) end)
  truthy(err:find("position table", 1, true), err)
  err = raises(function() return ck.dit:forward(IO.x, IO.t, IO.y, IO.y) end)
  truthy(err:find("context", 1, true), err)
  err = raises(function() return ck.dit:forward(IO.x, IO.t, IO.context, IO.context) end)
  truthy(err:find("y must be", 1, true), err)
  -- a number serves the batch
  local a = ck.dit:forward(IO.x, 300, IO.context, IO.y)
  local b = ck.dit:forward(IO.x, kiln.tensor({ 300, 300 }), IO.context, IO.y)
  eq((a - b):abs():max(), 0)
end)

test("SD3: bf16 arithmetic stays near the f32 reference", function()
  local ck <close> = kiln.load_checkpoint(file("medium", "medium", ""))
  local prev = kiln.precision("bf16")
  local ok, out = pcall(function() return ck.dit:forward(IO.x, IO.t, IO.context, IO.y) end)
  kiln.precision(prev)
  truthy(ok, tostring(out))
  local r = rel(out, IO["medium.out"])
  truthy(r <= 5e-2, "bf16 relative difference " .. r)
  report[#report + 1] = ("medium in bf16: max |diff| / max |ref| = %.2e"):format(r)
end)

test("SD3 names: diffusers' modules cover every weight once; LoRA names in kohya, ComfyUI and PEFT forms", function()
  local shapes = {}
  for k, v in pairs(recipe("medium")) do shapes[k] = v.shape end
  local cfg = mmdit.config(shapes, {})
  local H = cfg.hidden
  -- every SAI module is covered by diffusers' names, fused rows tiled without a gap
  local covered = {}
  for _, e in ipairs(F.diffusers_modules(cfg)) do
    local sai, rows = e[2], e[3]
    local w = shapes[sai .. ".weight"]
    truthy(w, "no SAI weight for " .. e[1] .. " -> " .. sai)
    covered[sai] = (covered[sai] or 0) + (rows and rows[2] or w[1])
    if rows then truthy(rows[1] + rows[2] - 1 <= w[1], e[1] .. " rows inside " .. sai) end
  end
  for name, shape in pairs(shapes) do
    local mod = name:match("^(.*)%.weight$")
    if mod then eq(covered[mod], shape[1], "rows of " .. mod .. " covered once") end
  end
  local pos = false
  for _, e in ipairs(F.diffusers_modules(cfg)) do pos = pos or e[2] == "x_embedder.proj" end
  truthy(pos)
  local map = F.lora_names(cfg)
  local function is(alias, module, first)
    local m = map[alias]
    truthy(m, "no target for " .. alias)
    eq(m.module, module, alias)
    if first then eq(m.rows[1], first, alias .. " rows"); eq(m.rows[2], H, alias .. " row count")
    else eq(m.rows, nil, alias .. " rows") end
  end
  is("lora_unet_joint_blocks_0_x_block_attn_qkv", "joint_blocks.0.x_block.attn.qkv")
  is("lora_unet_joint_blocks_1_context_block_mlp_fc2", "joint_blocks.1.context_block.mlp.fc2")
  is("diffusion_model.joint_blocks.0.x_block.attn2.proj", "joint_blocks.0.x_block.attn2.proj")
  is("model.diffusion_model.final_layer.linear", "final_layer.linear")
  is("transformer.transformer_blocks.0.attn.to_q", "joint_blocks.0.x_block.attn.qkv", 1)
  is("transformer.transformer_blocks.0.attn.to_v", "joint_blocks.0.x_block.attn.qkv", 2 * H + 1)
  is("transformer.transformer_blocks.2.attn.add_k_proj", "joint_blocks.2.context_block.attn.qkv", H + 1)
  is("transformer_blocks.1.attn2.to_k", "joint_blocks.1.x_block.attn2.qkv", H + 1)
  is("transformer.transformer_blocks.1.ff_context.net.0.proj", "joint_blocks.1.context_block.mlp.fc1")
  is("lora_transformer_transformer_blocks_0_attn_to_out_0", "joint_blocks.0.x_block.attn.proj")
  -- the last block's context stream is pre_only: no proj, no MLP to map to
  eq(map["transformer.transformer_blocks.2.attn.to_add_out"], nil)
  eq(map["lora_unet_joint_blocks_2_context_block_mlp_fc1"], nil)
  -- halves diffusers swaps are not offered as LoRA targets
  eq(map["transformer.norm_out.linear"], nil)
  eq(map["transformer.transformer_blocks.2.norm1_context.linear"], nil)
end)

-- f32 copies of a file's tensors as kiln decodes them, saved as safetensors.
local function decoded_copy(tensors, key)
  local t = {}
  for k, v in pairs(tensors) do t[k] = v:to("f32") end
  local p = T.tmp(key .. ".safetensors")
  kiln.save_safetensors(p, t)
  return p
end

test("SD3: GGUF (q8_0, architecture sd3) and fp8 files compute as their decoded weights", function()
  local base = recipe("large")
  -- GGUF in city96's bare names, its architecture the family's
  local g = T.tmp("sd3-large.gguf")
  kiln.save_gguf(g, base, { type = "q8_0", metadata = { ["general.architecture"] = "sd3" } })
  local ck <close> = kiln.load_checkpoint(g)
  eq(ck.family, "sd3"); eq(ck.variant, "large")
  local out = ck.dit:forward(IO.x, IO.t, IO.context, IO.y)
  local ref_ck <close> = kiln.load_checkpoint(decoded_copy(kiln.load_gguf(g), "sd3-large-q8dec"))
  local r = rel(out, ref_ck.dit:forward(IO.x, IO.t, IO.context, IO.y))
  truthy(r <= TOL, "q8_0 vs its decoded weights: " .. r)
  r = rel(out, IO["large.out"])
  truthy(r <= 5e-2, "q8_0 near the f32 reference: " .. r)
  -- fp8 (e4m3fn) matrices, ComfyUI's prefix
  local t = {}
  for k, v in pairs(base) do t["model.diffusion_model." .. k] = #v.shape >= 2 and v:to("f8_e4m3fn") or v end
  local f = T.tmp("sd3-large-fp8.safetensors")
  kiln.save_safetensors(f, t)
  local ck8 <close> = kiln.load_checkpoint(f)
  eq(ck8.family, "sd3")
  local o8 = ck8.dit:forward(IO.x, IO.t, IO.context, IO.y)
  local dec <close> = kiln.load_checkpoint(decoded_copy(kiln.load_safetensors(f), "sd3-large-fp8dec"))
  r = rel(o8, dec.dit:forward(IO.x, IO.t, IO.context, IO.y))
  truthy(r <= TOL, "fp8 vs its decoded weights: " .. r)
  report[#report + 1] = ("large q8_0 vs f32 reference: %.2e"):format(rel(out, IO["large.out"]))
end)

test("SD3: a diffusers transformer (split q / k / v, swapped halves) computes as the reference", function()
  -- names as diffusers' SD3Transformer2DModel has them (ComfyUI's mmdit_to_diffusers)
  eq(F.to_diffusers("joint_blocks.0.x_block.attn.q.weight"), "transformer_blocks.0.attn.to_q.weight")
  eq(F.to_diffusers("joint_blocks.3.context_block.attn.v.bias"), "transformer_blocks.3.attn.add_v_proj.bias")
  eq(F.to_diffusers("joint_blocks.1.x_block.attn2.proj.weight"), "transformer_blocks.1.attn2.to_out.0.weight")
  eq(F.to_diffusers("joint_blocks.1.context_block.adaLN_modulation.1.weight"),
    "transformer_blocks.1.norm1_context.linear.weight")
  eq(F.to_diffusers("final_layer.adaLN_modulation.1.bias"), "norm_out.linear.bias")
  eq(F.to_diffusers("pos_embed"), "pos_embed.pos_embed")
  eq(F.from_diffusers("time_text_embed.text_embedder.linear_2.weight"), "y_embedder.mlp.2.weight")
  eq(F.from_diffusers("transformer_blocks.2.ff_context.net.0.proj.weight"),
    "joint_blocks.2.context_block.mlp.fc1.weight")
  -- the medium recipe written as diffusers stores it: q / k / v apart, the final and the
  -- pre_only context adaLN halves as (scale, shift)
  local base = recipe("medium")
  local t = {}
  local function swap(v)
    local n = v.shape[1] // 2
    return kiln.cat({ v:narrow(1, n + 1, n), v:narrow(1, 1, n) }, 1)
  end
  for k, v in pairs(base) do
    local pre, what = k:match("^(.*)%.qkv%.(%a+)$")
    if pre then
      local n = v.shape[1] // 3
      for i, q in ipairs({ "q", "k", "v" }) do
        t[F.to_diffusers(pre .. "." .. q .. "." .. what)] = v:narrow(1, (i - 1) * n + 1, n):contiguous()
      end
    else
      local d = F.to_diffusers(k)
      truthy(d, "a diffusers name for " .. k)
      if k:match("^final_layer%.adaLN") or k:match("^joint_blocks%.2%.context_block%.adaLN") then v = swap(v) end
      t[d] = v
    end
  end
  local dir = T.tmp("sd3-diffusers-transformer")
  os.execute("mkdir -p '" .. dir .. "'")
  local p = dir .. "/diffusion_pytorch_model.safetensors"
  kiln.save_safetensors(p, t)
  local dit, cfg = F.load_diffusers_transformer(dir)
  eq(cfg.split_qkv, true); eq(cfg.swapped_halves, true); eq(cfg.depth, 3)
  eq(table.concat(cfg.x_self_attn_layers, ","), "0,1")
  local out = dit:forward(IO.x, IO.t, IO.context, IO.y)
  local r = rel(out, IO["medium.out"])
  truthy(r <= TOL, "diffusers transformer: " .. r)
  dit:close()
  -- a tensor missing from the folder is named as diffusers names it, with the file
  t["transformer_blocks.1.attn.add_k_proj.weight"] = nil
  kiln.save_safetensors(p, t)
  local err = raises(function() return F.load_diffusers_transformer(dir) end)
  truthy(err:find("transformer_blocks.1.attn.add_k_proj.weight", 1, true), err)
  truthy(err:find(p, 1, true), err)
  os.remove(p)
  os.remove(dir)
end)

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

-- A larger random Medium-shaped file (hidden 256 = 4 heads of 64, 8 blocks, MMDiT-X
-- attention in the first two, q/k norms; about 70 MB): the device allocator reserves
-- 2 MiB segments, so a budget under the weights needs weights of some size.
local function big_file()
  if not files.big then
    local cfg = { hidden = 256, head_dim = 64, heads = 4, patch = 2, in_channels = 16, out_channels = 16,
      pos_embed_max_size = 8, context_dim = 64, adm_dim = 32, mlp_hidden = 1024, depth = 8, qk_norm = true,
      qkv_bias = true, x_self_attn = { [0] = true, [1] = true }, pre_only_last = true }
    local t = {}
    for i, e in ipairs(mmdit.expected(cfg)) do
      local s = e[2]
      local fan = 1
      for j = 2, #s do fan = fan * s[j] end
      t[e[1]] = kiln.randn(s, { seed = 700 + i }) * (#s >= 2 and e[1] ~= "pos_embed" and 1 / math.sqrt(fan) or 0.1)
    end
    files.big = T.tmp("sd3-big.safetensors")
    kiln.save_safetensors(files.big, t)
  end
  return files.big
end

test("SD3: mode low on sim streams block by block within a budget under the weights, same numbers", function()
  if not has_sim then H.skip("no sim device") end
  local ck <close> = kiln.load_checkpoint(big_file())
  eq(ck.family, "sd3"); eq(ck.variant, "medium")
  eq(ck.dit.config.heads, 4); eq(table.concat(ck.dit.config.x_self_attn_layers, ","), "0,1")
  local x = kiln.randn({ 1, 16, 8, 6 }, { seed = 3 })
  local ctx, y = kiln.randn({ 1, 7, 64 }, { seed = 4 }), kiln.randn({ 1, 32 }, { seed = 5 })
  local function run() return ck.dit:forward(x, 700, ctx, y) end
  local cpu_ref = run()
  kiln.memory_mode("high")
  ck.dit:load("sim")
  local ref = run()
  local refc = ref:to("cpu")
  ref:free()
  truthy((refc - cpu_ref):abs():max() <= 1e-5, "sim high = cpu")
  local weights = ck.dit:bytes("sim")
  ck.dit:unload()
  kiln.memory_mode("low")
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
  local base_alloc = kiln.mem.stats("sim").allocated
  local _, window = ck.dit.streamer:block_bytes()
  local budget = base_alloc + math.floor(window * 1.3) + 4 * MiB
  truthy(budget - base_alloc < weights * 0.7, ("budget %d well under the weights %d"):format(budget - base_alloc,
    weights))
  kiln.mem.set_budget("sim", budget)
  kiln.mem.reset_peak("sim")
  ck.dit:load("sim")
  eq(ck.dit:bytes("sim"), 0, "low mode keeps the weights on the host")
  local ok, out = pcall(run)
  local peak = kiln.mem.stats("sim").peak
  -- skip-layer passes stream only the blocks they run
  local ok2, skipped = pcall(function() return ck.dit:forward(x, 700, ctx, y, { skip_layers = { 2 } }) end)
  kiln.mem.set_budget("sim", 8 * 1024 * MiB)
  kiln.memory_mode("normal")
  truthy(ok, tostring(out))
  truthy(ok2, tostring(skipped))
  eq(out.device, "sim")
  local d = (out:to("cpu") - refc):abs():max()
  truthy(d <= 1e-5, "low vs high max difference " .. d)
  truthy(peak <= budget, ("peak %d <= budget %d"):format(peak, budget))
  truthy((skipped:to("cpu") - refc):abs():max() > 1e-4, "skipping a block changes the output")
  eq(ck.dit:bytes("sim"), 0, "no transformer bytes on sim after the forward")
  out:free(); skipped:free()
  ck.dit:unload()
  kiln.mem.empty_cache("sim")
  report[#report + 1] = ("low mode: weights %.1f MiB, budget %.1f MiB, peak %.1f MiB"):format(weights / MiB,
    (budget - base_alloc) / MiB, (peak - base_alloc) / MiB)
end)

print("# " .. table.concat(report, "\n# "))
T.cleanup()
H.done()
