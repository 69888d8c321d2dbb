-- kiln.few_step_kind: which few-step model a checkpoint or a LoRA is (LCM, TCD, Hyper-SD,
-- SDXL-Lightning, SD-Turbo / SDXL-Turbo), told from what its file says, and the sampling
-- each kind was distilled for. The pipelines take these as defaults under the caller's
-- options: an LCM-LoRA applied means sampler lcm, 4 steps, cfg 1 unless the caller says
-- otherwise. Data plus two functions, like the families: a new kind is one entry of KINDS.
--
-- What is read, strongest first (the first that names a kind decides):
--   __metadata__ kiln.few_step   kiln's own: a kind's name, or "none" (tiny test files)
--   modelspec.architecture       Stability's ModelSpec ("stable-diffusion-xl-v1-base/lora"
--                                says nothing; an architecture naming a kind does)
--   modelspec.title              e.g. "SDXL Turbo", "Hyper-SD 8-steps LoRA"
--   ss_output_name               kohya's trainer: the name the LoRA was saved as
--   the file's name              the published names (lcm-lora-sdv1-5, sd_xl_turbo_1.0,
--                                sdxl_lightning_4step_lora, Hyper-SD15-8steps-lora,
--                                TCD-SD15-LoRA) that users keep
-- A step count written beside the kind ("4step", "8-steps") replaces the kind's steps
-- (Lightning and Hyper-SD ship one file per count); Hyper-SD's "CFG" LoRAs keep guidance.
-- Flux and SD 3.5 choose their steps by variant ([schnell], Large Turbo: kiln.families);
-- on those families a kind gives its step count only, the family's sampler stays.
local M = {}

-- ORDER: the order kinds are tried against each piece of text (LCM before the others:
-- an "LCM turbo" merge is sampled as LCM). `words`: Lua patterns on the lower-cased text,
-- each bounded by frontiers so "lcm" does not match inside another word.
M.KINDS = {
  { name = "lcm", label = "LCM", words = { "lcm", "latent[%-_ ]?consistency" },
    -- the LCM-LoRA model cards: 4 steps at guidance 1 (ComfyUI: lcm, sgm_uniform)
    defaults = { sampler = "lcm", scheduler = "sgm_uniform", steps = 4, cfg = 1.0 } },
  { name = "tcd", label = "TCD", words = { "tcd" },
    -- the TCD LoRAs' card: 4 steps, no guidance, gamma (eta) 0.3
    defaults = { sampler = "tcd", scheduler = "sgm_uniform", steps = 4, cfg = 1.0 } },
  { name = "hyper", label = "Hyper-SD", words = { "hyper[%-_ ]?sd%w*" },
    -- Hyper-SD's N-step LoRAs: euler, sgm_uniform as its ComfyUI workflows, no guidance
    defaults = { sampler = "euler", scheduler = "sgm_uniform", steps = 8, cfg = 1.0 } },
  { name = "lightning", label = "SDXL-Lightning", words = { "lightning" },
    -- SDXL-Lightning's card: euler with trailing / sgm_uniform spacing, no guidance
    defaults = { sampler = "euler", scheduler = "sgm_uniform", steps = 4, cfg = 1.0 } },
  { name = "turbo", label = "SD-Turbo / SDXL-Turbo", words = { "turbo" },
    -- the Turbo cards: 1 step, no guidance; euler ancestral with diffusers' trailing spacing
    defaults = { sampler = "euler_ancestral", scheduler = "trailing", steps = 1, cfg = 1.0 } },
}

local by_name = {}
for _, k in ipairs(M.KINDS) do by_name[k.name] = k end

-- The metadata keys read, in order (README lists them).
M.KEYS = { "modelspec.architecture", "modelspec.title", "ss_output_name" }

local function has_word(text, pat)
  return text:find("%f[%w]" .. pat .. "%f[%W]") ~= nil
end

local function kind_in(text)
  for _, k in ipairs(M.KINDS) do
    for _, w in ipairs(k.words) do
      if has_word(text, w) then return k end
    end
  end
  return nil
end

-- The profile of kind k as `text` describes it: {name, label, defaults, evidence}.
local function profile(k, text, evidence)
  local d = {}
  for key, v in pairs(k.defaults) do d[key] = v end
  local n = tonumber(text:match("%f[%w](%d+)[%-_ ]?steps?%f[%W]"))
  if n and n >= 1 and n <= 50 then d.steps = math.tointeger(n) end
  if k.name == "hyper" and has_word(text, "cfg") then d.cfg = nil end
  return { name = k.name, label = k.label, defaults = d, evidence = evidence }
end

--- The few-step kind a file says it is, or nil: meta (its __metadata__ strings, may be
-- nil), path (for its name). An unknown kiln.few_step gives false and a message (the
-- caller raises it naming the file).
function M.of_file(meta, path)
  meta = meta or {}
  local forced = meta["kiln.few_step"]
  if forced ~= nil then
    if forced == "none" then return nil end
    local k = by_name[forced]
    if not k then
      local names = {}
      for i, kk in ipairs(M.KINDS) do names[i] = kk.name end
      return false, ("__metadata__ kiln.few_step = %q is not a few-step kind (known: %s, none)"):format(forced,
        table.concat(names, ", "))
    end
    return profile(k, (meta["modelspec.title"] or ""):lower(), "__metadata__ kiln.few_step")
  end
  for _, key in ipairs(M.KEYS) do
    local v = meta[key]
    if type(v) == "string" then
      local text = v:lower()
      local k = kind_in(text)
      if k then return profile(k, text, ("__metadata__ %s %q"):format(key, v)) end
    end
  end
  local base = type(path) == "string" and path:gsub("/+$", ""):match("([^/]*)$") or ""
  local text = base:lower()
  local k = kind_in(text)
  if k then return profile(k, text, ("the file name %s"):format(base)) end
  return nil
end

--- The kind a run on ckpt samples as: the last applied LoRA that is one (ckpt:add_lora,
-- also a run's own), else the checkpoint's; nil for an ordinary model. Returns the
-- profile and what it came from ("LoRA NAME" or "checkpoint"). `later`: LoRAs the run
-- applies after those ({name, few_step, unet}, in order), for a caller that asks once
-- they are removed again (the PNG's parameters).
function M.of_run(ckpt, later)
  later = later or {}
  for i = #later, 1, -1 do
    local e = later[i]
    if e.few_step and (e.unet or 1) ~= 0 then return e.few_step, "LoRA " .. tostring(e.name) end
  end
  local list = ckpt and rawget(ckpt, "loras_applied") or {}
  for i = #list, 1, -1 do
    local h = list[i]
    if h.few_step and not h.removed and (h.unet or 1) ~= 0 then return h.few_step, "LoRA " .. tostring(h.name) end
  end
  local own = ckpt and rawget(ckpt, "few_step")
  if own then return own, "checkpoint" end
  return nil
end

-- The options a kind fills (a flow family keeps its sampler, schedule and guidance).
local KEYS_UNET = { "sampler", "scheduler", "steps", "cfg" }
local KEYS_FLOW = { "steps" }

--- Fills o's sampling options from the run's kind where `given` (the caller's options)
-- has none; flow: the checkpoint samples by flow matching; later: as of_run's. Returns
-- the profile used and its source, or nil.
function M.fill(o, given, ckpt, flow, later)
  local p, from = M.of_run(ckpt, later)
  if not p then return nil end
  given = given or {}
  for _, k in ipairs(flow and KEYS_FLOW or KEYS_UNET) do
    if given[k] == nil and p.defaults[k] ~= nil then o[k] = p.defaults[k] end
  end
  return p, from
end

return M
