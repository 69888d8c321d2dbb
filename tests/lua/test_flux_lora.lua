-- Flux.1 LoRAs (kiln.lora_flux through kiln.lora's engine): the LoRAs of
-- tests/golden/gen_flux_files.py in kohya's, diffusers / PEFT's, XLabs' and ComfyUI's
-- names patch the tiny transformer's weights to within 2e-5 of the generator's merge
-- (W[rows] + up @ down * alpha / rank), on BFL's single file and on a diffusers folder
-- (whose fused tensors are stored split: a fused LoRA is split over them); h.patched,
-- h.unmatched, h.format, h.family; h:remove() gives the weights back bit for bit; a
-- Flux LoRA on an SD checkpoint and an SD LoRA on Flux are refused by name.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local DIR = "tests/golden/flux_files/"
local base, META = T.build_recipe("../flux_files/tiny")
if kiln.set_quiet then kiln.set_quiet(true) end
local report = {}

local bfl = T.tmp("tiny-dev.safetensors")
kiln.save_safetensors(bfl, base, META)

-- The canonical tensors of a checkpoint's transformer, as f32 on the cpu.
local function weight(ck, name)
  local t = ck.dit.weights:tensor(name)
  local f = t:to("cpu"):to("f32")
  t:free()
  return f
end

local CASES = {
  -- format, file, patched weights (canonical tensors), the keys left unmatched, h.format
  { "kohya", 5, { "lora_unet_double_blocks_7_img_attn_qkv.alpha", "lora_unet_double_blocks_7_img_attn_qkv.lora_down.weight",
    "lora_unet_double_blocks_7_img_attn_qkv.lora_up.weight" }, "kohya" },
  { "peft", 6, {}, "peft" },
  { "xlabs", 3, {}, "xlabs" },
  { "comfy", 3, {}, nil },
}

for _, layout in ipairs({ { "BFL's single file", bfl, 0 }, { "a diffusers folder (split q / k / v)",
  DIR .. "diffusers_sharded", 1 } }) do
  for _, c in ipairs(CASES) do
    local fmt_name, n_patched, unmatched, format = c[1], c[2], c[3], c[4]
    test(("Flux LoRA: %s names on %s merge as the published arithmetic"):format(fmt_name, layout[1]), function()
      local ck <close> = kiln.load_checkpoint(layout[2])
      local merged = kiln.load_safetensors(DIR .. "lora_" .. fmt_name .. ".merged.safetensors")
      local before = {}
      for name in pairs(merged) do before[name] = weight(ck, name) end
      local h = ck:add_lora(DIR .. "lora_" .. fmt_name .. ".safetensors")
      eq(h.family, "flux")
      if format then eq(h.format, format) end
      eq(#h.unmatched, #unmatched, "unmatched: " .. table.concat(h.unmatched, ", "))
      for i, k in ipairs(unmatched) do eq(h.unmatched[i], k) end
      local worst = 0
      for name, want in pairs(merged) do
        local got = weight(ck, name)
        local d
        if layout[3] == 0 then
          d = (got - want):abs():max()
          truthy(d <= 2e-5, ("%s: %s differs from the merge by %.3g"):format(fmt_name, name, d))
        else
          -- the folder's weights are f16: the merge of the f16 values, rounded to f16
          -- when the patched copy is
          local w16 = base[name]:to("f16"):to("f32")
          local delta = want - base[name]
          local exp = w16 + delta
          d = (got - exp):abs():max() / exp:abs():max()
          truthy(d <= 2 ^ -10, ("%s: %s differs from the merge by %.3g of its range"):format(fmt_name, name, d))
        end
        worst = math.max(worst, d)
        -- rows the LoRA does not touch keep their values
        local changed = (got - before[name]):abs():sum(2)
        local untouched = (want - base[name]):abs():sum(2)
        for r = 1, changed.shape[1] do
          if untouched[r] == 0 then eq(changed[r], 0, name .. " row " .. r) end
        end
      end
      truthy(h.patched >= n_patched, ("patched %d >= %d"):format(h.patched, n_patched))
      -- the forward changes, and removing gives the weights back exactly
      h:remove()
      for name in pairs(merged) do
        eq((weight(ck, name) - before[name]):abs():max(), 0, name .. " after remove")
      end
      report[#report + 1] = ("%s on %s: max |merged - expected| %.2e, %d weights patched"):format(fmt_name,
        layout[1], worst, h.patched)
    end)
  end
end

test("Flux LoRA: strength scales the delta; the patched weights stream in mode low", function()
  local ck <close> = kiln.load_checkpoint(bfl)
  local merged = kiln.load_safetensors(DIR .. "lora_kohya.merged.safetensors")
  local name = "double_blocks.0.img_attn.qkv.weight"
  local h = ck:add_lora(DIR .. "lora_kohya.safetensors", { unet = 0.5 })
  local want = base[name] + (merged[name] - base[name]) * 0.5
  truthy((weight(ck, name) - want):abs():max() <= 2e-5, "half strength")
  local has_sim = false
  for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end
  if has_sim then
    local x = kiln.randn({ 1, 16, 4, 4 }, { seed = 1 })
    local ctx, y = kiln.randn({ 1, 3, 32 }, { seed = 2 }), kiln.randn({ 1, 64 }, { seed = 3 })
    local a = ck.dit:forward(x, 0.5, ctx, y, { guidance = 3.5 })
    kiln.memory_mode("low")
    ck.dit:load("sim")
    local ok, b = pcall(ck.dit.forward, ck.dit, x, 0.5, ctx, y, { guidance = 3.5 })
    kiln.memory_mode("normal")
    truthy(ok, tostring(b))
    truthy((b:to("cpu") - a):abs():max() <= 1e-5, "streamed patched weights give the same forward")
    ck.dit:unload()
  end
  h:remove()
end)

test("Flux LoRA: the wrong family is refused by name", function()
  local ck <close> = kiln.load_checkpoint(bfl)
  local info = kiln.lora.inspect(DIR .. "lora_xlabs.safetensors")
  eq(info.family, "flux")
  eq(info.format, "xlabs")
  -- an SD LoRA (cross-attention of SD 1.x's width) on Flux
  local sdl = T.tmp("sd1-lora.safetensors")
  kiln.save_safetensors(sdl, {
    ["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k.lora_down.weight"] = kiln.randn({ 2, 768 }),
    ["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k.lora_up.weight"] = kiln.randn({ 320, 2 }),
  })
  local err = raises(function() return ck:add_lora(sdl) end)
  truthy(err:find("SD 1.x", 1, true) and err:find("Flux", 1, true), err)
  -- a Flux LoRA on an SD checkpoint
  local sd <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  err = raises(function() return sd:add_lora(DIR .. "lora_kohya.safetensors") end)
  truthy(err:find("Flux", 1, true), err)
end)

print("# " .. table.concat(report, "\n# "))
for _, v in pairs(base) do v:free() end
T.cleanup()
H.done()
