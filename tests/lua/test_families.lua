-- Families as modules (kiln.family, scripts/kiln/families/): kiln.families lists the
-- families in detection order, every family file declares the fields the registry
-- needs, __metadata__ kiln.family (a string KV in GGUF files) overrides what the shapes
-- say and an unknown name there is refused by name, a family registered at run time is
-- reached by detection and assembly with no other module edited, and the loaders'
-- requires form no loop.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local family = require "kiln.family"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local function copy(t)
  local r = {}
  for k, v in pairs(t) do r[k] = v end
  return r
end

test("kiln.families is the list of family names, in detection order", function()
  local f = kiln.families
  eq(type(f), "table")
  eq(table.concat(f, ","), "sd1,sd2,sdxl,flux,sd3")
  local n = 0
  for _ in pairs(f) do n = n + 1 end
  eq(n, #f, "a plain list")
  eq(table.concat(family.names, ","), table.concat(f, ","))
end)

test("every family module declares the required fields", function()
  for _, name in ipairs(kiln.families) do
    local def = require("kiln.families." .. name)
    eq(def.name, name, "file and name agree")
    family.check(def) -- raises naming a missing field
    for k, ty in pairs(family.REQUIRED) do eq(type(def[k]), ty, name .. "." .. k) end
    for _, k in ipairs(family.REQUIRED_DEFAULTS) do truthy(def.defaults[k] ~= nil, name .. ".defaults." .. k) end
    eq(def.latent.channels, def.dit and 16 or 4, name .. " latent channels")
    truthy(def.latent.scale_factor > 0, name .. " scale factor")
    local r = def.recognise
    truthy(r.prefixes or r.context_dim or r.unet_names, name .. " says how it is recognised")
    if not def.dit then -- the UNet families' text encoders and diffusers maps
      truthy(type(r.text_encoders) == "function", name .. " tells text encoders given alone")
      eq(#def.parts.ldm.clip, #def.conditioning.encoders, name .. ": one conditioning entry per text encoder")
      eq(#def.parts.diffusers.clip, #def.conditioning.encoders, name .. ": diffusers text encoder folders")
      eq(type(def.parts.diffusers.unet_map), "function", name .. " diffusers UNet map")
    end
    eq(family.get(name), def)
  end
  eq(family.get("sdxl").conditioning.size, true)
  eq(family.get("sdxl").latent.scale_factor, 0.13025)
  eq(family.get("sd1").unet.heads, 8)
  -- a definition without a field is refused naming it
  local bad = copy(family.get("sd1"))
  bad.name, bad.latent = "bad", nil
  raises(function() family.register(bad) end, "family 'bad'", "latent")
  raises(function() family.register(family.get("sd1")) end, "already registered")
  eq(#kiln.families, 5)
end)

test("the bundled demo model is sd1", function()
  local path = os.getenv("KILN_DEMO_MODEL") or "examples/models/kiln-shapes.safetensors"
  local f = io.open(path, "rb")
  if not f then H.skip(path .. " is missing") end
  f:close()
  local ckpt <close> = kiln.load_checkpoint(path, { tokenizer = "examples/models" })
  eq(ckpt.family, "sd1")
  truthy(ckpt.unet and ckpt.vae and ckpt.clip, "all three parts")
end)

-- the tiny SD 1.x checkpoint of the goldens, metadata changed
local function sd1_file(name, meta_changes, rename)
  local tensors, meta = T.from_recipe("sd1")
  for k, v in pairs(meta_changes or {}) do meta[k] = v end
  if rename then
    local r = {}
    for n, t in pairs(tensors) do r[rename(n)] = t end
    tensors = r
  end
  local p = T.tmp(name)
  kiln.save_safetensors(p, tensors, meta)
  return p
end

test("__metadata__ kiln.family overrides what the shapes say", function()
  local plain = sd1_file("plain.safetensors")
  local c1 <close> = kiln.load_checkpoint(plain)
  eq(c1.family, "sd1", "the shapes say sd1")
  local p = sd1_file("as_sd2.safetensors", { ["kiln.family"] = "sd2" })
  local c2 <close> = kiln.load_checkpoint(p)
  eq(c2.family, "sd2")
  eq(c2.clip.encoders[1].layer, -2, "SD 2.x conditioning: the penultimate layer")
  eq(c1.clip.encoders[1].layer, -1)
  -- a GGUF string KV: a UNet alone whose context width (tiny) says nothing
  local tensors = T.from_recipe("sd1")
  local u = {}
  for n, t in pairs(tensors) do
    local s = n:match("^model%.diffusion_model%.(.*)$")
    if s then u[s] = t end
  end
  local g = T.tmp("unet.gguf")
  kiln.save_gguf(g, u, { metadata = { ["general.architecture"] = "sd1", ["kiln.family"] = "sd2",
    ["kiln.heads.unet"] = "2" } })
  local c3 <close> = kiln.load_checkpoint(g)
  eq(c3.family, "sd2")
  truthy(rawget(c3, "unet") and not rawget(c3, "clip"), "the UNet alone")
end)

test("an unknown family name is a clear error", function()
  local p = sd1_file("sd9.safetensors", { ["kiln.family"] = "sd9" })
  raises(function() kiln.load_checkpoint(p) end, "kiln.load_checkpoint", p, "unknown family \"sd9\"",
    "__metadata__ kiln.family", "sd1, sd2, sdxl")
  local plain = sd1_file("plain2.safetensors")
  raises(function() kiln.load_checkpoint(plain, { family = "nope" }) end, "unknown family \"nope\"",
    "the family option", "sd1, sd2, sdxl")
end)

test("a family registered at run time is detected and assembled", function()
  -- SD 1.x's networks under a text-encoder prefix no shipped family has
  local toy = copy(family.get("sd1"))
  toy.name, toy.label = "toy", "Toy"
  toy.recognise = { prefixes = { "toy_text." }, text_encoders = function() return false end }
  toy.parts = copy(toy.parts)
  toy.parts.ldm = copy(toy.parts.ldm)
  toy.parts.ldm.clip = { { prefix = "toy_text.", role = "l" } }
  toy.latent = { channels = 4, scale_factor = 0.5, shift_factor = 0 }
  local p = sd1_file("toy.safetensors", nil, function(n) return (n:gsub("^cond_stage_model%.transformer%.", "toy_text.")) end)
  -- before: nothing claims the file (its tiny UNet's width says nothing either)
  raises(function() kiln.load_checkpoint(p) end, "a UNet without a recognizable text encoder")
  family.register(toy)
  local ok, err = pcall(function()
    eq(table.concat(kiln.families, ","), "sd1,sd2,sdxl,flux,sd3,toy")
    local ckpt <close> = kiln.load_checkpoint(p)
    eq(ckpt.family, "toy")
    eq(ckpt.scale_factor, 0.5)
    eq(ckpt.vae.scale_factor, 0.5)
    truthy(rawget(ckpt, "clip"), "its text encoder found under toy_text.")
    local info = require("kiln.checkpoint").inspect(require("kiln.model_files").shapes_of(kiln.load_safetensors(p)), {})
    eq(info.family, "toy")
  end)
  family.unregister("toy")
  if not ok then error(err, 0) end
  eq(table.concat(kiln.families, ","), "sd1,sd2,sdxl,flux,sd3")
  raises(function() kiln.load_checkpoint(p) end, "a UNet without a recognizable text encoder")
end)

test("families told by the UNet alone, GGUF architectures", function()
  eq(family.detect_unet({ ["label_emb.0.0.weight"] = { 8, 16 } }), "sdxl")
  eq(family.detect_unet({ ["input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"] = { 320, 1024 } }), "sd2")
  eq(family.detect_unet({ ["input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"] = { 320, 768 } }), "sd1")
  eq(family.detect_unet({ ["input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"] = { 320, 32 } }), nil)
  raises(function() family.check_gguf({ ["general.architecture"] = "hidream" }, "x.gguf") end,
    "unknown architecture 'hidream'", "SD 1.x, SD 2.x, SDXL, Flux.1 and SD 3.5", "(sd1, sd2, sdxl, flux, sd3)")
  family.check_gguf({ ["general.architecture"] = "sd3" }, "x.gguf")
  eq(family.label("sdxl"), "SDXL")
end)

-- kiln.X -> the kiln.Y its file requires (deferred requires in function bodies too)
local function requires_of(module)
  local path = "scripts/" .. module:gsub("%.", "/") .. ".lua"
  local f = io.open(path, "r")
  if not f then return {} end
  local text = f:read("a")
  f:close()
  local r = {}
  for m in text:gmatch("require%s*%(?%s*[\"'](kiln%.[%w_%.]+)[\"']") do r[#r + 1] = m end
  if text:find("require%(\"kiln%.families%.\" %.%.") then
    for _, n in ipairs(kiln.families) do r[#r + 1] = "kiln.families." .. n end
  end
  return r
end

test("the loaders' requires form no loop (checkpoint, lora, taesd, plumbing, families)", function()
  local state, path = {}, {}
  local function visit(m)
    if state[m] == "done" then return end
    if state[m] == "open" then
      local i = #path
      while path[i] ~= m do i = i - 1 end
      error("require loop: " .. table.concat(path, " -> ", i) .. " -> " .. m, 0)
    end
    state[m] = "open"
    path[#path + 1] = m
    for _, d in ipairs(requires_of(m)) do visit(d) end
    path[#path] = nil
    state[m] = "done"
  end
  for _, m in ipairs({ "kiln.checkpoint", "kiln.lora", "kiln.taesd", "kiln.controlnet", "kiln.upscaler",
    "kiln.embedding", "kiln.model_files", "kiln.family" }) do
    visit(m)
  end
  for _, m in ipairs({ "kiln.lora", "kiln.taesd", "kiln.controlnet", "kiln.upscaler", "kiln.embedding",
    "kiln.model_files", "kiln.part", "kiln.family" }) do
    for _, d in ipairs(requires_of(m)) do truthy(d ~= "kiln.checkpoint", m .. " requires kiln.checkpoint") end
  end
end)

T.cleanup()
H.done()
