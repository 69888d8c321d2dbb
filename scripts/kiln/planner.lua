-- kiln.planner: `--mode auto`. Before a pipeline runs, it sizes each stage against
-- the device's budget and picks the memory mode and the VAE tiling:
--
--   weights   the bytes each part (text encoders, UNet or a flow family's
--             transformer, VAE, and the run's ControlNets, which run in the UNet's
--             stage) takes on the device,
--             from its tensors (stored dtype), and the streaming window of "low"
--             mode (the two largest adjacent blocks, kiln.stream);
--   work      the activation peak of the stage at this run's size and batch
--             (the ControlNets' residuals included), from kiln.mem.estimate with
--             its weights streamed: a dry run of the stage at its real size on the
--             shape-only device modelling this one (kiln.dry_run: exact, the same
--             allocations without the arithmetic), or where that cannot answer,
--             small probes of its real inputs fitted and extrapolated (tiling.lua),
--             in the device's activation dtype (kiln.activation_dtype: f16 / bf16
--             on a GPU under a half precision halves it; plan.activation_dtype).
--             A transformer's stage is the family's (F.plan_work: Flux's counts
--             the run's T5 length and Kontext's reference tokens); the VAE's is the
--             larger of the decode and the reference pictures' encode.
--
-- Then: "high" when every part's weights plus the largest stage's work fit (models
-- stay resident across stages), else "normal" when each stage fits with its own
-- weights (a part is evicted when the next needs room), else "low" (weights
-- streamed block by block); a stage whose work could not be measured (its probe ran
-- out of memory) counts as not fitting. The VAE's work does not enter the choice:
-- whatever the mode, the VAE decodes tiled ("auto") when its untiled work does not
-- fit beside its weights (or its streaming window in low mode). The plan is printed, so the
-- user sees why. The runtime's mode is one for the whole run, so "per model" means:
-- this table says, for each model, where its bytes will be in the chosen mode.
--
-- Measuring loads each part (streamed) and unloads it afterwards: run it before a
-- pipeline, as the pipelines do, not while you hold parts loaded yourself.
--
--   planner.choose(ckpt, o) -> plan  {mode, vae_tile, lines = {...}, need = {high =,
--                                    normal =, low =, avail =} (bytes), work = {part
--                                    name = bytes}, ...}
--   planner.apply(ckpt, o)  -> plan  chooses, sets kiln.memory_mode, o.tile and the
--                                    UNet's resident_plan (a partial residency in low
--                                    mode: plan.resident.unet bytes), prints
local kiln = require "kiln"

local M = {}
local fmt = string.format
local SAFETY = 0.9 -- plan with 90% of the budget (fragmentation)
local GRAIN = 2 * 1024 * 1024

local human = kiln.format_bytes

-- Stored weight bytes of a network part and its streaming window (a text model
-- with several encoders, SDXL's: their sum, and the largest window).
function M.part_bytes(part)
  if part.encoders then
    local total, window = 0, 0
    for _, e in ipairs(part.encoders) do
      local b, w = M.part_bytes(e.enc)
      total, window = total + b, math.max(window, w)
    end
    return total, window
  end
  local m = part.weights and part.weights.model and part.weights:model()
  if not m or not part.streamer then return 0, 0 end
  local sizes, window = part.streamer:_sizes(m)
  local total = 0
  for _, n in ipairs(sizes) do total = total + n end
  return total, window
end

-- Activation peak of fn(inputs...) on dev with the weights of `parts` (a list: the
-- UNet and the run's ControlNets run in one stage) streamed (low mode), so that only
-- a window of weights is on the device while it is measured; returns the peak minus
-- the largest window (the work), or nil and the reason when it cannot run.
local function work_of(parts, dev, fn, inputs)
  local prev = kiln.memory_mode()
  kiln.memory_mode("low")
  for _, part in ipairs(parts) do part:load(dev) end
  local ok, bytes = pcall(kiln.mem.estimate, fn, inputs, { device = dev })
  for _, part in ipairs(parts) do part:unload() end
  kiln.memory_mode(prev)
  if not ok then return nil, tostring(type(bytes) == "table" and bytes.message or bytes) end
  local window = 0
  for _, part in ipairs(parts) do window = math.max(window, select(2, M.part_bytes(part))) end
  local streamed = (dev ~= "cpu") and window or 0
  return math.max(0, bytes - streamed)
end

-- The distinct ControlNets of a run (o.control entries of nonzero strength).
local function controlnets(o)
  local nets, seen = {}, {}
  for _, c in ipairs(o.control or {}) do
    if type(c) == "table" and c.net and (c.strength or 1) ~= 0 and not seen[c.net] then
      seen[c.net] = true
      nets[#nets + 1] = c.net
    end
  end
  return nets
end

function M.choose(ckpt, o)
  local dev = o.device or kiln.default_device()
  -- tensors the scripts dropped but the GC has not yet freed would count as taken
  collectgarbage(); collectgarbage()
  local st = kiln.mem.stats(dev)
  local budget = st.budget or 0
  -- the dtype the networks' activations take there (f16 / bf16 on a GPU under a half
  -- precision): the work measured below is in it, so it halves with them
  local plan = { device = dev, budget = budget, lines = {}, activation_dtype = kiln.activation_dtype(dev) }
  local function line(...) plan.lines[#plan.lines + 1] = fmt(...) end
  if budget == 0 then
    plan.mode = "high"
    line("--mode auto: no budget on %s (set one with --vram): high", dev)
    return plan
  end
  -- 90% of what is free, less one 2 MiB grain of the caching allocators (blocks over
  -- 1 MiB are carved from 2 MiB grains; the small probes do not show that rounding)
  local avail = (budget - st.allocated) * SAFETY - GRAIN
  local f = ckpt.vae.factor or 8
  local W, H = o.width, o.height
  local lw, lh = W // f, H // f
  -- a flow family's transformer takes the UNet's row (its stage, its residency)
  local F = require("kiln.pipeline").flow_family(ckpt)
  local net_name = rawget(ckpt, "dit") and "dit" or "unet"
  local parts = {}
  for _, name in ipairs({ "clip", "t5", net_name, "vae" }) do
    local p = ckpt[name]
    if p then
      local bytes, window = M.part_bytes(p)
      parts[#parts + 1] = { name = name, part = p, bytes = bytes, window = window }
    end
  end
  local by = {}
  for _, p in ipairs(parts) do by[p.name] = p end
  -- ControlNets run beside the UNet, in its stage: their weights count with its own
  local nets = controlnets(o)
  for i, net in ipairs(nets) do
    local bytes, window = M.part_bytes(net)
    parts[#parts + 1] = { name = "cn" .. i, part = net, bytes = bytes, window = window, stage = "unet" }
  end
  -- the work of each stage at this run's size: the batch (o.batch images) and, with
  -- CFG, cond and uncond in one call (the larger of the two ways a run may call it)
  local batch = math.tointeger(o.batch or 1) or 1
  if net_name == "dit" then
    by.unet = by.dit
    if not (F and F.plan_work) then
      by.dit.why = "the family has no work measure"
    else
      local fn, inputs = F.plan_work(ckpt, o, lw, lh, dev)
      by.dit.work, by.dit.why = work_of({ ckpt.dit }, dev, fn, inputs)
      for i = 1, inputs.n do inputs[i]:free() end
    end
  elseif by.unet then
    local ucfg = ckpt.unet.config
    local B = ((o.cfg or 1) ~= 1 and 2 or 1) * batch
    local x = kiln.zeros({ B, ucfg.in_channels, lh, lw }):to(dev)
    local t = kiln.full({ B }, 999)
    local ctx = kiln.zeros({ B, 77, ucfg.context_dim or 768 }):to(dev)
    local y = ucfg.adm_in_channels and kiln.zeros({ B, ucfg.adm_in_channels }):to(dev) or nil
    local stage = { ckpt.unet }
    for _, net in ipairs(nets) do stage[#stage + 1] = net end
    -- every tensor of the stage is an argument: a dry run replaces those on dev by
    -- shape-only ones (a closure's tensor on dev would send it back to the probes)
    by.unet.work, by.unet.why = work_of(stage, dev, function(xx, tt, cc, yy)
      -- the residuals of every net, summed, handed to the UNet as the pipelines do
      -- (the hint at 8x the probe's size: the hint encoder's factor)
      local control
      local hint = #nets > 0 and kiln.zeros({ 1, 3, 8 * xx.shape[3], 8 * xx.shape[4] }):to(dev) or nil
      for _, net in ipairs(nets) do
        local xs = xx:narrow(2, 1, 4)
        local r = net:forward(xs, tt, cc, hint, yy)
        if not control then control = r
        else
          for i = 1, #control do
            local s = control[i] + r[i]
            control[i]:free(); r[i]:free()
            control[i] = s
          end
        end
      end
      if hint then hint:free() end
      local r = ckpt.unet:forward(xx, tt, cc, yy, control and { control = control, free_control = true } or nil)
      r:free()
    end, { x, t, ctx, y, n = 4 })
    x:free(); t:free(); ctx:free()
    if y then y:free() end
  end
  if by.vae then
    local z = kiln.zeros({ 1, ckpt.vae.config.embed_dim or ckpt.vae.latent_channels or 4, lh, lw }):to(dev)
    by.vae.work, by.vae.why = work_of({ ckpt.vae }, dev, function(zz)
      local r = ckpt.vae:decode(zz, { retry = false })
      r:free()
    end, { z })
    z:free()
    -- Kontext: the reference pictures go through the encoder first, with the same tiling
    local sizes = F and F.reference_sizes and F.reference_sizes(o.reference, o.reference_scale) or {}
    for _, s in ipairs(sizes) do
      if by.vae.work == nil then break end
      local img = kiln.zeros({ 1, 3, s[2], s[1] }):to(dev)
      local w, why = work_of({ ckpt.vae }, dev, function(ii)
        local r = ckpt.vae:encode(ii)
        r:free()
      end, { img })
      img:free()
      if w then by.vae.work = math.max(by.vae.work, w) else by.vae.work, by.vae.why = nil, why end
    end
  end
  if by.clip then by.clip.work = 0 end -- 77 tokens: negligible next to its weights
  -- T5: one encode of 512 tokens (the longest a pipeline pads its prompt to), measured
  -- by a dry run
  if by.t5 then
    local row = require("kiln.encoders").plan(ckpt.t5, dev, { tokens = 512 })
    by.t5.work, by.t5.why = row.work, row.why
  end
  -- the choice
  -- a stage's weights: its part's and those of the parts that run with it (ControlNets)
  local stage_bytes, stage_window = {}, {}
  for _, p in ipairs(parts) do
    local st = p.stage or p.name
    stage_bytes[st] = (stage_bytes[st] or 0) + p.bytes
    stage_window[st] = math.max(stage_window[st] or 0, p.window)
  end
  local all, worst_stage, worst_work, worst_low = 0, 0, 0, 0
  for _, p in ipairs(parts) do all = all + p.bytes end
  for _, p in ipairs(parts) do
    if not p.stage then
      -- the VAE's work does not decide the mode: when it does not fit, it tiles
      local w = p.name ~= "vae" and (p.work or math.huge) or 0
      worst_work = math.max(worst_work, w)
      worst_stage = math.max(worst_stage, stage_bytes[p.name] + w)
      worst_low = math.max(worst_low, stage_window[p.name] + w)
    end
  end
  -- what each mode needs, for callers that size budgets from it (tests, tools), and
  -- each part's work (nil where it could not be measured)
  plan.need = { high = all + worst_work, normal = worst_stage, low = worst_low, avail = avail }
  plan.work = {}
  for _, p in ipairs(parts) do plan.work[p.name] = p.work end
  if all + worst_work <= avail then plan.mode = "high"
  elseif worst_stage <= avail then plan.mode = "normal"
  else plan.mode = "low" end
  -- low mode: what the UNet's stage leaves free keeps that many bytes of the UNet on the
  -- device (its largest blocks), so each evaluation copies only the rest
  if plan.mode == "low" and by.unet and by.unet.work then
    local spare = avail - (stage_window[net_name] + by.unet.work)
    if spare > 0 then
      plan.resident = { unet = math.floor(math.min(spare, by.unet.bytes)) }
    end
  end
  -- the VAE tiles when its untiled work does not fit beside its weights (or window)
  if by.vae and by.vae.work then
    local beside = plan.mode == "low" and by.vae.window or by.vae.bytes
    if by.vae.work + beside > avail then plan.vae_tile = "auto" end
  end
  line("--mode auto on %s: budget %s, %s to plan with (90%% of the free bytes less 2 MiB), activations %s", dev,
    human(budget), human(avail), plan.activation_dtype)
  line("  %-5s %12s %12s %12s", "model", "weights", "low window", "work")
  for _, p in ipairs(parts) do
    local work = p.stage and ("with " .. p.stage) or p.work and human(p.work) or ("? (" .. tostring(p.why) .. ")")
    line("  %-5s %12s %12s %12s", p.name, human(p.bytes), human(p.window), work)
  end
  if batch > 1 then line("  work measured for a batch of %d", batch) end
  -- LoRAs in use: their factors stay in the mapped file (owner lora:NAME); their deltas
  -- are built into the copies of the weights they patch, which the rows above count
  for _, h in ipairs(rawget(ckpt, "loras_applied") or {}) do
    local file = rawget(h, "_file")
    local ok, st = pcall(function() return file:stats() end)
    line("  %-5s %12s  factors mapped from the file; patched weights built at each copy", "lora:" .. tostring(h.name),
      ok and st and human(st.file_bytes) or "?")
  end
  line("  all weights + largest work %s; largest stage (weights + work) %s; low mode needs %s",
    human(all + worst_work), human(worst_stage), human(worst_low))
  line("  -> mode %s%s", plan.mode, plan.vae_tile and ", VAE tiled (tile auto)" or "")
  if plan.resident then
    local r = plan.resident.unet
    line("     %s: %s of %s resident (its largest blocks), about %s streamed per evaluation", net_name, human(r),
      human(by.unet.bytes), human(math.max(0, by.unet.bytes - r)))
  end
  return plan
end

function M.apply(ckpt, o)
  local plan = M.choose(ckpt, o)
  kiln.memory_mode(plan.mode)
  require("kiln.pipeline").net(ckpt).resident_plan = plan.resident and plan.resident.unet or nil
  if plan.vae_tile and not o.tile then o.tile = plan.vae_tile end
  if not kiln.quiet() then
    for _, l in ipairs(plan.lines) do io.stderr:write("kiln: ", l, "\n") end
  end
  return plan
end

return M
