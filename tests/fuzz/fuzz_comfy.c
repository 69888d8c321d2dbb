/* fuzz_comfy.c - ComfyUI workflow import (scripts/kiln/comfy.lua) on arbitrary text:
 * kiln.comfy.plan reads the JSON, checks every node against its spec (known type,
 * links to an existing output of the right type, literals in range, model files
 * found), orders the nodes that lead to an output and estimates each one's memory,
 * without running a node or loading a model. The models folder holds an empty file
 * m.safetensors in every folder the nodes read (and input/pic.png, 8 x 8), so a graph
 * can pass the file checks; an empty file cannot be opened as a checkpoint, so the
 * estimate stays with the file sizes. A refusal starts with "kiln.comfy"; a plan has
 * every node after the nodes it reads, once, and estimates that are sizes. */
#include "fuzz_lua.h"

static const char driver[] =
    "local comfy = require('kiln.comfy')\n"
    "local lfs = require('lfs')\n"
    "local function broken(why) error({ broken = why }, 0) end\n"
    "local ROOT = os.getenv('KILN_FUZZ_DIR') .. '/models'\n"
    "lfs.mkdir(ROOT)\n"
    "for _, d in ipairs({ 'checkpoints', 'loras', 'vae', 'vae_approx', 'controlnet', 'upscale_models',\n"
    "    'diffusion_models', 'unet', 'text_encoders', 'clip', 'embeddings', 'input' }) do\n"
    "  lfs.mkdir(ROOT .. '/' .. d)\n"
    "  if d ~= 'input' then assert(io.open(ROOT .. '/' .. d .. '/m.safetensors', 'wb')):close() end\n"
    "end\n"
    "do\n"
    "  local pic <close> = kiln.zeros({ 1, 3, 8, 8 })\n"
    "  kiln.save_png(pic, ROOT .. '/input/pic.png')\n"
    "end\n"
    "local OPTS = { models = ROOT, input = ROOT .. '/input', estimate_only = true }\n"
    "return function(s)\n"
    "  local src = s\n"
    "  if not s:match('^%s*{') then\n"
    "    -- not an object: as a table where it decodes to one (a path is not fuzzed)\n"
    "    local ok, t = pcall(kiln.json.decode, s)\n"
    "    if not ok or type(t) ~= 'table' then return end\n"
    "    src = t\n"
    "  end\n"
    "  local ok, plan = pcall(comfy.plan, src, OPTS)\n"
    "  if not ok then\n"
    "    if type(plan) ~= 'string' then broken('a non-string error: ' .. tostring(plan)) end\n"
    "    if plan:sub(1, 10) ~= 'kiln.comfy' then broken('a refusal not from kiln.comfy: ' .. plan) end\n"
    "    return\n"
    "  end\n"
    "  local pos = {}\n"
    "  for i, id in ipairs(plan.order) do\n"
    "    if not plan.graph[id] then broken('scheduled node not in the graph: ' .. tostring(id)) end\n"
    "    if pos[id] then broken('node scheduled twice: ' .. id) end\n"
    "    pos[id] = i\n"
    "  end\n"
    "  if #plan.order == 0 then broken('an empty schedule') end\n"
    "  for i, id in ipairs(plan.order) do\n"
    "    for name, a in pairs(plan.graph[id].args) do\n"
    "      if a.link and not (pos[a.link] and pos[a.link] < i) then\n"
    "        broken(('node %s input %s reads node %s, not scheduled before it'):format(id, name, a.link))\n"
    "      end\n"
    "    end\n"
    "  end\n"
    "  if #plan.rows ~= #plan.order then broken('an estimate row per scheduled node') end\n"
    "  for _, r in ipairs(plan.rows) do\n"
    "    for _, k in ipairs({ 'peak', 'weights', 'results' }) do\n"
    "      local v = r[k]\n"
    "      if type(v) ~= 'number' or v ~= v or v < 0 then broken(('node %s: estimate %s is %s'):format(r.id, k, tostring(v))) end\n"
    "    end\n"
    "  end\n"
    "  comfy.format_plan(plan, OPTS)\n"
    "end\n";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!getenv("KILN_FUZZ_DIR")) setenv("KILN_FUZZ_DIR", fuzz_dir(), 1);
    fuzz_lua_run(driver, data, size);
    return 0;
}
