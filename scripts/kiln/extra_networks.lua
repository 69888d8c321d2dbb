-- kiln.extra_networks: A1111's extra-network prompt syntax and what the pipelines do
-- with it. `<lora:NAME>`, `<lora:NAME:0.8>` (both strengths), `<lora:NAME:TE:UNET>`
-- (text encoder first, then UNet, as A1111 orders them) and the named forms
-- `<lora:NAME:unet=0.8:te=0.5>` are taken out of the prompt; the pipelines apply those
-- LoRAs (found by name in the checkpoint's `loras` folder) for the run and remove
-- them after it, also on error. The PNG parameters name them in A1111's
-- `Lora hashes: "NAME: HASH, ..."` field, HASH being the first 12 hex digits of the
-- SHA-256 of the file's tensor data (the safetensors header skipped), as
-- sd-webui-additional-networks and A1111 compute it.
local kiln = require "kiln"

local M = {}

local function strength(s, what, tag)
  local v = tonumber(s)
  if not v then
    error(("%s: the %s strength '%s' is not a number"):format(tag, what, s), 0)
  end
  return v
end

-- One <lora:...> tag's body ("NAME:0.8") -> {name, unet, clip}.
local function parse_tag(body, tag)
  local parts = {}
  for p in (body .. ":"):gmatch("([^:]*):") do parts[#parts + 1] = p end
  local e = { name = parts[1], unet = 1.0, clip = 1.0 }
  if e.name == "" then error(("%s: no LoRA name"):format(tag), 0) end
  local positional = {}
  for i = 2, #parts do
    local k, v = parts[i]:match("^%s*(%a+)%s*=%s*(.-)%s*$")
    if k == "unet" then e.unet = strength(v, "unet", tag)
    elseif k == "te" then e.clip = strength(v, "te", tag)
    elseif k then error(("%s: unknown field '%s' (unet=, te=)"):format(tag, k), 0)
    else positional[#positional + 1] = parts[i] end
  end
  if positional[1] then e.clip = strength(positional[1], "te", tag); e.unet = e.clip end
  if positional[2] then e.unet = strength(positional[2], "unet", tag) end
  if positional[3] then error(("%s: too many fields (NAME:TE:UNET)"):format(tag), 0) end
  return e
end

--- The prompt without its <lora:...> tags, and the LoRAs they name (a list of
-- {name, unet, clip} in prompt order; a name given twice keeps its last strengths).
function M.parse(prompt)
  local list, index = {}, {}
  local clean = (prompt or ""):gsub("<lora:([^>]*)>", function(body)
    local e = parse_tag(body, "prompt: <lora:" .. body .. ">")
    if index[e.name] then list[index[e.name]] = e
    else list[#list + 1] = e; index[e.name] = #list end
    return ""
  end)
  if #list == 0 then return prompt or "", list end
  clean = clean:gsub("%s+,", ","):gsub("  +", " "):gsub("^%s+", ""):gsub("%s+$", "")
  return clean, list
end

--- "NAME", "NAME:0.8" or "NAME:TE:UNET" (the --lora option) -> {name, unet, clip}.
function M.parse_option(s)
  return parse_tag(s, "--lora " .. s)
end

local hashes = {} -- path -> short hash

--- A LoRA file's short hash for A1111's "Lora hashes" (nil when not a safetensors file).
function M.lora_hash(path)
  if hashes[path] == nil then
    local f = io.open(path, "rb")
    local head = f and f:read(8)
    if f then f:close() end
    if head and #head == 8 then
      local n = string.unpack("<I8", head)
      hashes[path] = kiln.sha256_file(path, 8 + n):sub(1, 12)
    else
      hashes[path] = false
    end
  end
  return hashes[path] or nil
end

--- Applies the LoRAs of a run (from the prompt and from opts.lora) to the checkpoint.
-- Returns the handles as a to-be-closed value that removes them again.
function M.apply(ckpt, list)
  local applied = {}
  local guard = setmetatable(applied, { __close = function(t)
    for i = #t, 1, -1 do t[i]:remove() end
  end })
  for _, e in ipairs(list or {}) do
    local path = e.path or ckpt:find_lora(e.name)
    local ok, h = pcall(ckpt.add_lora, ckpt, path, { unet = e.unet, clip = e.clip, name = e.name })
    if not ok then
      getmetatable(guard).__close(guard)
      error(h, 0)
    end
    applied[#applied + 1] = h
  end
  return guard
end

--- The LoRAs a run uses: opts.lora (a list of {name, unet, clip, [path]} or
-- "NAME:0.8" strings, as --lora gives them) then the prompt's tags. Returns the
-- prompt without tags and the list.
function M.of_run(opts)
  local prompt, list = M.parse(opts.prompt)
  local all = {}
  for _, e in ipairs(opts.lora or {}) do
    all[#all + 1] = type(e) == "string" and M.parse_option(e) or e
  end
  for _, e in ipairs(list) do all[#all + 1] = e end
  return prompt, all
end

--- A1111's `Lora hashes` field for the parameters text, or nil when the run used none
-- (or the checkpoint cannot find them by name).
function M.hashes_field(ckpt, opts)
  local _, list = M.of_run(opts)
  if #list == 0 or not (ckpt and ckpt.find_lora) then return nil end
  local parts = {}
  for _, e in ipairs(list) do
    local ok, path = pcall(ckpt.find_lora, ckpt, e.name)
    if e.path then ok, path = true, e.path end
    local h = ok and M.lora_hash(path)
    if h then parts[#parts + 1] = ("%s: %s"):format(e.name, h) end
  end
  if #parts == 0 then return nil end
  return ('Lora hashes: "%s"'):format(table.concat(parts, ", "))
end

return M
