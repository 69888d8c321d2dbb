-- kiln.lora_sd3: the names an SD 3.5 LoRA may give the MMDiT's weights, for kiln.lora's
-- engine (which plans and applies the patches). The spellings are
-- kiln.families.sd3.lora_names' (kohya lora_unet_joint_blocks_0_x_block_attn_qkv,
-- ComfyUI diffusion_model.joint_blocks..., Stability AI's names bare, diffusers / PEFT
-- transformer.transformer_blocks.0.attn.to_q and OneTrainer's lora_transformer_*); this
-- file finds where each lands in the checkpoint as stored: a fused qkv, or diffusers'
-- q / k / v apart (a diffusers folder, kiln.mmdit's split form), where a fused module's
-- delta is split across the three; and diffusers' swapped modulation halves, where a
-- delta in Stability AI's order crosses them.
local mmdit = require "kiln.mmdit"
local sd3 = require "kiln.families.sd3"

local M = {}

-- the modules whose two halves (shift, scale) diffusers stores the other way round
local function swapped(cfg, mod)
  if not cfg.swapped_halves then return false end
  if mod == "final_layer.adaLN_modulation.1" then return true end
  return cfg.pre_only_last and mod == ("joint_blocks.%d.context_block.adaLN_modulation.1"):format(cfg.depth - 1)
end

--- Adds the SD 3.5 MMDiT `dit` (a loaded part: weights, config) to a kiln.lora index:
-- alias -> module record {part = "unet", store, module, weight = {name, shape}, bias,
-- rows, split}.
function M.index(index, dit)
  local w, cfg = rawget(dit, "weights"), rawget(dit, "config")
  local shapes = {}
  for _, e in ipairs(mmdit.expected(cfg)) do shapes[e[1]] = e[2] end
  local H = cfg.hidden
  local recs = {}
  -- the record of rows {first, count} (nil: all) of a Stability AI module
  local function rec(mod, rows)
    local key = mod .. (rows and ("#" .. rows[1] .. "+" .. rows[2]) or "")
    if recs[key] ~= nil then return recs[key] or nil end
    local base, qkv = mod:match("^(.*attn2?)%.qkv$")
    local r
    if qkv == nil and base and cfg.split_qkv then
      -- q / k / v stored apart: a row range inside one is that tensor; all rows, three parts
      local parts = { "q", "k", "v" }
      if rows then
        local i = (rows[1] - 1) // H + 1
        local n = base .. "." .. parts[i]
        r = { part = "unet", store = w.store, module = n, weight = { name = w:real(n .. ".weight"),
          shape = shapes[n .. ".weight"] } }
        if shapes[n .. ".bias"] then r.bias = { name = w:real(n .. ".bias"), shape = shapes[n .. ".bias"] } end
      else
        local split = {}
        for i, p in ipairs(parts) do
          split[i] = { name = w:real(base .. "." .. p .. ".weight"), from = (i - 1) * H + 1, count = H }
        end
        local ws = shapes[base .. ".q.weight"]
        r = { part = "unet", store = w.store, module = mod, weight = { name = split[1].name,
          shape = { 3 * H, ws[2] } }, split = split }
      end
    else
      local ws = shapes[mod .. ".weight"]
      if not ws then
        recs[key] = false
        return nil
      end
      local real = w:real(mod .. ".weight")
      local shape = rows and { rows[2], ws[2] } or ws
      r = { part = "unet", store = w.store, module = mod, rows = rows, weight = { name = real, shape = shape } }
      if swapped(cfg, mod) then
        local h = ws[1] // 2
        r.rows = nil
        r.split = { { name = real, rows = { h + 1, h }, from = 1, count = h },
          { name = real, rows = { 1, h }, from = h + 1, count = h } }
      elseif shapes[mod .. ".bias"] then
        r.bias = { name = w:real(mod .. ".bias"), shape = rows and { rows[2] } or shapes[mod .. ".bias"] }
      end
    end
    recs[key] = r
    return r
  end
  -- the names are Stability AI's fused ones whatever the storage
  local fused = setmetatable({ split_qkv = false }, { __index = cfg })
  for alias, e in pairs(sd3.lora_names(fused)) do
    local r = rec(e.module, e.rows)
    if r and not index[alias] then index[alias] = r end
  end
  return index
end

--- Evidence that a LoRA module (its key without the ending) is an SD 3 one.
function M.evidence(mod)
  if mod:match("joint_blocks[._]%d+[._]") then return "SD 3's joint blocks" end
  return nil
end

return M
