-- Flux.1 (kiln.flux, kiln.families.flux): the tiny [dev] and [schnell] networks of
-- tests/golden/gen_flux.py (weights rebuilt from its recipe: seeded kiln.randn =
-- torch.randn) match that generator's independent PyTorch forward in BFL's bare names
-- and under ComfyUI's model.diffusion_model. prefix; a diffusion-model file alone is
-- recognised as "flux" and loads as a checkpoint whose dit works while its missing
-- parts say which file to pass; mode "low" streams the blocks within a small budget
-- to the same numbers; a file missing a block is refused naming it.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local flux = require "kiln.flux"
local family = require "kiln.family"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local MiB = 1024 * 1024
local IO = kiln.load_safetensors("tests/golden/flux/io.safetensors")
local TOL = 1e-4

-- the recipe's tensors, as a name -> tensor table and its metadata
local base, META = T.build_recipe("../flux/flux")

-- Writes the recipe (without names matching `drop`, under `prefix`) as a file, once.
local files = {}
local function file(name, prefix, drop)
  if not files[name] then
    local t = {}
    for k, v in pairs(base) do
      if not (drop and k:match(drop)) then t[(prefix or "") .. k] = v end
    end
    files[name] = T.tmp(name .. ".safetensors")
    kiln.save_safetensors(files[name], t, META)
  end
  return files[name]
end

local function dev_file() return file("flux-dev") end
local function schnell_file() return file("flux-schnell", "", "^guidance_in%.") end

-- max |a - b| / max |b|
local function rel(a, b)
  eq(H.shape_of(a), H.shape_of(b), "shape")
  local d = (a:to("cpu"):to("f32") - b):abs():max()
  return d / b:abs():max()
end

local report = {}
if kiln.set_quiet then kiln.set_quiet(true) end

test("kiln.families lists flux; the family file declares Flux's latent and variants", function()
  truthy(table.concat(kiln.families, ","):find("flux", 1, true), table.concat(kiln.families, ","))
  local F = family.get("flux")
  eq(F.latent.channels, 16)
  eq(F.latent.scale_factor, 0.3611)
  eq(F.latent.shift_factor, 0.1159)
  eq(F.variants.schnell.steps, 4)
  eq(F.variants.dev.steps, 50)
  eq(F.defaults.prediction, "flow")
end)

for _, case in ipairs({
  { "dev", dev_file, "dev" },
  { "schnell", schnell_file, "schnell" },
  { "dev, ComfyUI prefix", function() return file("flux-dev-comfy", "model.diffusion_model.") end, "dev" },
  { "schnell, ComfyUI prefix", function() return file("flux-schnell-comfy", "model.diffusion_model.",
    "^guidance_in%.") end, "schnell" },
}) do
  test("Flux " .. case[1] .. ": a diffusion-model file alone loads, dit matches the reference", function()
    local ck <close> = kiln.load_checkpoint(case[2]())
    eq(ck.family, "flux")
    eq(ck.variant, case[3])
    eq(ck.scale_factor, 0.3611)
    local cfg = ck.dit.config
    eq(cfg.hidden, 64); eq(cfg.heads, 2); eq(cfg.depth, 2); eq(cfg.depth_single, 2)
    eq(cfg.context_dim, 32); eq(cfg.vec_dim, 24); eq(cfg.in_channels, 64); eq(cfg.mlp_ratio, 4)
    eq(table.concat(cfg.axes_dim, ","), "8,12,12")
    eq(cfg.guidance, case[3] == "dev")
    local out = ck.dit:forward(IO.x, IO.t, IO.context, IO.y, { guidance = IO.guidance })
    local r = rel(out, IO[case[3]])
    truthy(r <= TOL, case[1] .. ": relative difference " .. r)
    report[#report + 1] = ("%s: max |diff| / max |ref| = %.2e"):format(case[1], r)
    -- the parts a diffusion-model file lacks say which file to pass
    for _, p in ipairs({ { "vae", "ae.safetensors" }, { "clip", "clip_l" }, { "t5", "t5xxl" } }) do
      local err = raises(function() return ck[p[1]]:decode(out) end)
      truthy(err:find(p[2], 1, true), err)
    end
  end)
end

test("Flux: {t5 = PATH} gives ckpt.t5; a family without T5 refuses the option by name", function()
  local ck <close> = kiln.load_checkpoint(dev_file(), { t5 = "tests/golden/t5/comfy.safetensors" })
  local y = ck.t5:forward({ 5, 17, 1 })
  eq(H.shape_of(y), "1,3,32")
  local err = raises(function() kiln.load_checkpoint(dev_file(), { t5 = 3 }) end)
  truthy(err:find("t5 must be a file", 1, true), err)
  err = raises(function() kiln.load_checkpoint(dev_file(), { t5 = "/nonexistent/t5.safetensors" }) end)
  truthy(err:find("/nonexistent/t5.safetensors", 1, true), err)
  local demo = os.getenv("KILN_DEMO_MODEL") or "examples/models/kiln-shapes.safetensors"
  if io.open(demo, "rb") then
    err = raises(function() kiln.load_checkpoint(demo, { t5 = "tests/golden/t5/comfy.safetensors" }) end)
    truthy(err:find("no T5 encoder", 1, true), err)
  end
end)

test("Flux: [dev] needs the guidance; wrong shapes are refused by name", function()
  local ck <close> = kiln.load_checkpoint(dev_file())
  local err = raises(function() return ck.dit:forward(IO.x, IO.t, IO.context, IO.y) end)
  truthy(err:find("guidance", 1, true), err)
  err = raises(function() return ck.dit:forward(IO.x:narrow(3, 1, 5), IO.t, IO.context, IO.y, { guidance = 3.5 }) end)
  truthy(err:find("even", 1, true), err)
  err = raises(function() return ck.dit:forward(IO.x, IO.t, IO.y, IO.y, { guidance = 3.5 }) end)
  truthy(err:find("context", 1, true), err)
  -- a scalar guidance / time serves the whole batch
  local a = ck.dit:forward(IO.x, 0.3, IO.context, IO.y, { guidance = 3.5 })
  local b = ck.dit:forward(IO.x, kiln.tensor({ 0.3, 0.3 }), IO.context, IO.y, { guidance = kiln.tensor({ 3.5, 3.5 }) })
  eq((a - b):abs():max(), 0)
end)

test("Flux: detection and the file's blocks", function()
  local F = family.get("flux")
  local shapes = {}
  for k, v in pairs(base) do shapes["model.diffusion_model." .. k] = v.shape end
  local L = family.layout(shapes, META, "x.safetensors")
  eq(L.family, "flux"); eq(L.unet, "model.diffusion_model.")
  eq(F.variant(shapes, L.unet), "dev")
  -- an SD file is not taken for Flux
  truthy(F.parts.ldm.find_unet({ ["model.diffusion_model.input_blocks.0.0.weight"] = { 32, 4, 3, 3 } }) == nil)
  -- a file missing a block: refused, naming it
  local p = file("flux-hole", "", "^double_blocks%.0%.")
  local err = raises(function() return kiln.load_checkpoint(p) end)
  truthy(err:find("double_blocks.0", 1, true), err)
  truthy(err:find(p, 1, true), "names the file: " .. err)
  p = file("flux-hole2", "", "^single_blocks%.0%.linear2")
  err = raises(function() return kiln.load_checkpoint(p) end)
  truthy(err:find("single_blocks.0.linear2.weight", 1, true), err)
  -- heads that do not fit the rotary axes
  local m2 = {}
  for k, v in pairs(META) do m2[k] = v end
  m2["kiln.flux.axes_dim"] = "8,8,8"
  local s2 = {}
  for k, v in pairs(base) do s2[k] = v.shape end
  err = raises(function() return flux.config(s2, m2) end)
  truthy(err:find("8,8,8", 1, true), err)
end)

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

-- A larger random [dev]-shaped file (hidden 256, BFL's head width 128 and default
-- axes 16/56/56, 4 + 4 blocks; about 50 MB): the device allocator reserves 2 MiB
-- segments, so a budget under the weights needs weights of some size.
local function big_file()
  if not files.big then
    local cfg = { hidden = 256, in_channels = 64, context_dim = 32, vec_dim = 24, depth = 4, depth_single = 4,
      mlp_hidden = 1024, head_dim = 128, guidance = true, qkv_bias = true, out_channels = 64 }
    local t = {}
    for i, e in ipairs(flux.expected(cfg)) do
      t[e[1]] = kiln.randn(e[2], { seed = 900 + i }) * (#e[2] == 2 and 1 / math.sqrt(e[2][2]) or 0.1)
    end
    files.big = T.tmp("flux-big.safetensors")
    kiln.save_safetensors(files.big, t)
  end
  return files.big
end

test("Flux: mode low on sim streams block by block within a budget under the weights, same numbers", function()
  if not has_sim then H.skip("no sim device") end
  local ck <close> = kiln.load_checkpoint(big_file())
  eq(ck.dit.config.heads, 2)
  eq(table.concat(ck.dit.config.axes_dim, ","), "16,56,56")
  local x = kiln.randn({ 1, 16, 8, 6 }, { seed = 3 })
  local ctx, y = kiln.randn({ 1, 7, 32 }, { seed = 4 }), kiln.randn({ 1, 24 }, { seed = 5 })
  local function run() return ck.dit:forward(x, 0.5, ctx, y, { guidance = 3.5 }) end
  kiln.memory_mode("high")
  ck.dit:load("sim")
  local ref = run()
  local refc = ref:to("cpu")
  ref:free()
  local weights = ck.dit:bytes("sim")
  ck.dit:unload()
  kiln.memory_mode("low")
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
  local base_alloc = kiln.mem.stats("sim").allocated
  -- room for the streaming window (the two largest adjacent blocks, in 2 MiB
  -- segments) and the small activations, well under the whole model
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
  kiln.mem.set_budget("sim", 8 * 1024 * MiB)
  kiln.memory_mode("normal")
  truthy(ok, tostring(out))
  eq(out.device, "sim")
  local d = (out:to("cpu") - refc):abs():max()
  truthy(d <= 1e-5, "low vs high max difference " .. d)
  truthy(peak <= budget, ("peak %d <= budget %d"):format(peak, budget))
  eq(ck.dit:bytes("sim"), 0, "no transformer bytes on sim after the forward")
  out:free()
  ck.dit:unload()
  kiln.mem.empty_cache("sim")
  report[#report + 1] = ("low mode: weights %.1f MiB, budget %.1f MiB, peak %.1f MiB"):format(weights / MiB,
    (budget - base_alloc) / MiB, (peak - base_alloc) / MiB)
end)

print("# " .. table.concat(report, "\n# "))
T.cleanup()
H.done()
