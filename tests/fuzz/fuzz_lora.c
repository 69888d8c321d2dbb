/* fuzz_lora.c - the key matching of scripts/kiln/lora.lua on arbitrary key lists:
 * one key per line, optionally "<TAB>shape" as comma-separated integers (an
 * ".alpha" key's value is its first dimension). The keys are grouped into modules,
 * their family guessed and planned against a small SD 1.x-like index (original and
 * diffusers UNet names, a Hugging Face and an OpenCLIP text encoder); the same keys,
 * read as UNet and OpenCLIP tensor names, are indexed too (the name conversions). */
#include "fuzz_lora.h"

static const char driver[] =
    FUZZ_LORA_INDEX
    "return function(s)\n"
    "  local names, shapes, values = {}, {}, {}\n"
    "  for line in s:gmatch('[^\\n]+') do\n"
    "    local key, spec = line:match('^([^\\t]*)\\t(.*)$')\n"
    "    key = key or line\n"
    "    local shape = {}\n"
    "    for d in (spec or '4,4'):gmatch('-?%d+') do shape[#shape + 1] = math.tointeger(tonumber(d)) or 0 end\n"
    "    if not shapes[key] then names[#names + 1] = key end\n"
    "    shapes[key] = shape\n"
    "    values[key] = shape[1] or 1\n"
    "  end\n"
    "  local modules, others = K.group(names)\n"
    "  for _, k in ipairs(others) do if not shapes[k] then broken('other key not in the input') end end\n"
    "  local shape_of = function(k) return shapes[k] end\n"
    "  K.family_of(modules, shape_of)\n"
    "  local src = {\n"
    "    shape = shape_of,\n"
    "    tensor = function(k) return { shape = shapes[k], key = k } end,\n"
    "    value = function(k) return values[k] end,\n"
    "    set_delta = function(_, _, d) return d end,\n"
    "  }\n"
    "  local fail = function(msg) error(msg, 0) end\n"
    "  local ok, plan, unmatched = pcall(K.plan, modules, others, INDEX, src, { unet = 1, clip = 0.5 }, fail)\n"
    "  if ok then\n"
    "    for _, p in ipairs(plan) do\n"
    "      if type(p.target) ~= 'string' or not shapes[p.key] then broken('plan entry without a target or key') end\n"
    "    end\n"
    "    for _, k in ipairs(unmatched) do if not shapes[k] then broken('unmatched key not in the input') end end\n"
    "  end\n"
    "  local list = {}\n"
    "  for i, k in ipairs(names) do list[i] = { k, shapes[k] } end\n"
    "  build(list, list, list)\n"
    "end\n";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_lua_run(driver, data, size);
    return 0;
}
