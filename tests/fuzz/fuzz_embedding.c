/* fuzz_embedding.c - scripts/kiln/embedding.lua's reading of a textual-inversion file
 * on arbitrary bytes: kiln.embedding.read either refuses naming the file or gives
 * 1..75 vectors per encoder, every encoder as many, each [count, width] in f32; the
 * vectors are then checked against an SD 1.x (l, 768) and an SDXL (l + g) encoder as a
 * prompt that uses the embedding would be. A Lua runtime error ("attempt to ...") is a
 * broken invariant. */
#include "fuzz_lua.h"

static const char driver[] =
    "local E = require('kiln.embedding')\n"
    "local function broken(why) error({ broken = why }, 0) end\n"
    "local function internal(e)\n"
    "  if type(e) ~= 'string' then broken('a non-string error: ' .. tostring(e)) end\n"
    /* a runtime error carries its script's position; a refusal may quote the file's
     * own names, which can hold any text ("...lorattempt to " in a tensor name) */
    "  if e:find('%.lua:%d+: attempt to ') or e:find('%.lua:%d+: stack overflow') or e:find('C stack overflow', 1, true) then broken(e) end\n"
    "end\n"
    "local SD1 = { encoders = { { enc = { config = { role = 'l', width = 768 } } } } }\n"
    "local SDXL = { encoders = { { enc = { config = { role = 'l', width = 768 } } },\n"
    "                            { enc = { config = { role = 'g', width = 1280 } } } } }\n"
    "return function(path)\n"
    "  local ok, emb = pcall(E.read, path, nil, 'fuzz')\n"
    "  if not ok then\n"
    "    internal(emb)\n"
    "    if not emb:find(path, 1, true) then broken('a refusal without the file name: ' .. emb) end\n"
    "    return\n"
    "  end\n"
    "  if not (math.type(emb.count) == 'integer' and emb.count >= 1 and emb.count <= 75) then broken('count') end\n"
    "  for _, v in pairs(emb.vectors) do\n"
    "    if #v.shape ~= 2 or v.shape[1] ~= emb.count or v.dtype ~= 'f32' then broken('vectors shape') end\n"
    "  end\n"
    "  for _, text in ipairs({ SD1, SDXL }) do\n"
    "    local okc, err = pcall(E.check, emb, text, 'fuzz')\n"
    "    if not okc then internal(err) end\n"
    "  end\n"
    "end\n";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_file("f.safetensors", data, size);
    fuzz_lua_run(driver, (const uint8_t *)path, strlen(path));
    return 0;
}
