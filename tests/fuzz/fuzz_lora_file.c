/* fuzz_lora_file.c - a whole LoRA file as ckpt:add_lora reads it, on arbitrary bytes:
 * kiln.lora.inspect (the sniffing, the safetensors header, grouping and the family
 * guess), then the file opened as a weight store (kiln.model, owner "lora") and its
 * keys planned against fuzz_lora.h's index with the tensors read from the store, as
 * scripts/kiln/lora.lua's add does before it patches. A refusal of inspect names the
 * file; a Lua runtime error ("attempt to ...") anywhere is a broken invariant. */
#include "fuzz_lora.h"

static const char driver[] =
    FUZZ_LORA_INDEX
    "local lora = require('kiln.lora')\n"
    "local function internal(e)\n"
    "  if type(e) ~= 'string' then broken('a non-string error: ' .. tostring(e)) end\n"
    /* a runtime error carries its script's position; a refusal may quote the file's
     * own names, which can hold any text ("...lorattempt to " in a tensor name) */
    "  if e:find('%.lua:%d+: attempt to ') or e:find('%.lua:%d+: stack overflow') or e:find('C stack overflow', 1, true) then broken(e) end\n"
    "end\n"
    "return function(path)\n"
    "  local ok, info = pcall(lora.inspect, path)\n"
    "  if not ok then\n"
    "    internal(info)\n"
    "    if not info:find(path, 1, true) then broken('a refusal without the file name: ' .. info) end\n"
    "    return\n"
    "  end\n"
    "  if type(info.format) ~= 'string' or info.modules < 1 or info.keys < info.modules then broken('inspect result') end\n"
    "  local okm, store = pcall(kiln.model, path, { name = 'fuzz', owner = 'lora' })\n"
    "  if not okm then internal(store) return end\n"
    "  local okp, err = pcall(function()\n"
    "    local cache = {}\n"
    "    local src = {}\n"
    "    function src.tensor(k) local t = cache[k] or store:tensor(k) cache[k] = t return t end\n"
    "    function src.shape(k) return src.tensor(k).shape end\n"
    "    function src.value(k) return src.tensor(k):to('f32'):item() end\n"
    "    function src.set_delta(_, _, d) return d end\n"
    "    local names = store:names()\n"
    "    local modules, others = K.group(names)\n"
    "    K.family_of(modules, src.shape)\n"
    "    local plan, unmatched = K.plan(modules, others, INDEX, src, { unet = 1, clip = 0.5 }, function(m) error(m, 0) end)\n"
    "    for _, p in ipairs(plan) do\n"
    "      if type(p.target) ~= 'string' or not store:has(p.key) then broken('plan entry without a target or key') end\n"
    "    end\n"
    "    for _, k in ipairs(unmatched) do if not store:has(k) then broken('unmatched key not in the file') end end\n"
    "  end)\n"
    "  store:close()\n"
    "  if not okp then\n"
    "    if type(err) == 'table' then error(err, 0) end\n"
    "    internal(err)\n"
    "  end\n"
    "end\n";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_file("f.safetensors", data, size);
    fuzz_lua_run(driver, (const uint8_t *)path, strlen(path));
    return 0;
}
