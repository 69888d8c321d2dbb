-- tests/lua/tiny_sd.lua - the tiny SD 1.x / 2.x / SDXL checkpoints of the Lua tests,
-- rebuilt from the recipes of tests/golden/gen_sd_golden.py (seeded kiln.randn =
-- torch.randn, so the values are the PyTorch reference's) into a temporary folder.
--   local T = require "tiny_sd"
--   local path = T.ckpt_file("sd1" [, "f16"])   -- written once per run
--   T.cleanup({ "/sub/dir", ... })              -- at the end: files, then folders
local kiln = require "kiln"

local T = {}
T.GOLD = "tests/golden/sd/"

local TMP = os.tmpname()
os.remove(TMP)
assert(os.execute("mkdir -p '" .. TMP .. "'"))
T.TMP = TMP
local made = {}

-- A path in the temporary folder, removed by cleanup.
function T.tmp(name)
  local p = TMP .. "/" .. name
  made[#made + 1] = p
  return p
end

-- Removes the files made through T.tmp, then the given sub-folders of the
-- temporary folder (deepest first), then the folder itself.
function T.cleanup(dirs)
  for i = #made, 1, -1 do os.remove(made[i]) end
  made = {}
  for _, d in ipairs(dirs or {}) do os.remove(TMP .. d) end
  os.remove(TMP)
end

function T.parse_shape(s)
  local r = {}
  for d in s:gmatch("%d+") do r[#r + 1] = tonumber(d) end
  return r
end

-- recipe -> tensors, metadata (the same values as the PyTorch reference's weights)
function T.build_recipe(name, dtype)
  local tensors, meta = {}, {}
  for line in io.lines(T.GOLD .. name .. ".recipe") do
    local c = line:sub(1, 1)
    if c == "@" then
      local k, v = line:match("^@([^\t]+)\t(.*)$")
      meta[k] = v
    elseif c ~= "#" then
      local n, dt, shape, seed, std, mean = line:match("^([^\t]+)\t([^\t]+)\t([^\t]+)\t([^\t]+)\t([^\t]+)\t([^\t]+)$")
      local s = T.parse_shape(shape)
      local t
      if dt == "i64" then
        t = kiln.arange(s[2]):reshape(s)
      elseif #s == 0 then
        t = kiln.tensor(tonumber(mean))
      else
        t = kiln.randn(s, { seed = tonumber(seed) }) * tonumber(std) + tonumber(mean)
        if dtype and dtype ~= "f32" then t = t:to(dtype) end
      end
      tensors[n] = t
    end
  end
  return tensors, meta
end

local recipes = {}
-- Copies of the recipe's tensor and metadata tables (built once per name and dtype).
function T.from_recipe(name, dtype)
  local key = name .. (dtype or "")
  if not recipes[key] then recipes[key] = { T.build_recipe(name, dtype) } end
  local t, m = {}, {}
  for k, v in pairs(recipes[key][1]) do t[k] = v end
  for k, v in pairs(recipes[key][2]) do m[k] = v end
  return t, m
end

-- Drops the recipes built so far (harness.lua's H.done calls it: the test file's
-- tensors must not outlive it, which the kiln program checks).
function T.forget() recipes = {} end

local built = {}
-- The recipe saved as a single-file checkpoint (once per run).
function T.ckpt_file(name, dtype)
  local key = name .. (dtype or "")
  if not built[key] then
    local t, m = T.from_recipe(name, dtype)
    built[key] = T.tmp(key .. ".safetensors")
    kiln.save_safetensors(built[key], t, m)
  end
  return built[key]
end

-- The UNet inputs of the goldens: x [2, 4, 8, 8], t {10, 500}, context [2, 77, ctx_dim].
function T.inputs(ctx_dim)
  return kiln.randn({ 2, 4, 8, 8 }, { seed = 1 }), kiln.tensor({ 10, 500 }), kiln.randn({ 2, 77, ctx_dim }, { seed = 2 })
end

-- A whitespace tokenizer over the goldens' words with the ids CLIP's vocabulary gives
-- them (a 320, photo 1125, of 539, cat 2368; commas dropped): stands in for the binding
-- where a test's prompts use only these words.
local WORDS = { a = 320, photo = 1125, of = 539, cat = 2368 }
T.word_tokenizer = {
  encode = function(_, s)
    local r = {}
    for w in s:gmatch("[^%s,]+") do r[#r + 1] = assert(WORDS[w], "fake tokenizer: unknown word " .. w) end
    return r
  end,
  bos = function() return 49406 end,
  eos = function() return 49407 end,
  token_id = function() return nil end,
}

return T
