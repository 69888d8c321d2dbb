/* fuzz_emphasis.c - the prompt parsers of scripts/kiln/clip.lua on arbitrary text:
 * A1111's emphasis syntax (parse_emphasis), ComfyUI's (parse_comfy), then the
 * 75-token chunking with embeddings (chunks, embedding.split) over a stand-in
 * tokenizer of one id per byte. Pieces must be {string, number}; every chunk holds
 * 77 ids and 77 weights. */
#include "fuzz_lua.h"

static const char driver[] =
    "local clip = require 'kiln.clip'\n"
    "local function broken(why) error({ broken = why }, 0) end\n"
    "local function tok(s)\n"
    "  local ids = {}\n"
    "  for i = 1, #s do ids[i] = s:byte(i) end\n"
    "  return ids\n"
    "end\n"
    "local function check(pieces, who)\n"
    "  if #pieces < 1 then broken(who .. ': no pieces') end\n"
    "  for _, p in ipairs(pieces) do\n"
    "    if type(p[1]) ~= 'string' or type(p[2]) ~= 'number' then broken(who .. ': bad piece') end\n"
    "  end\n"
    "end\n"
    "local function embedding(name) return #name % 7 + 1 end\n"
    "return function(s)\n"
    "  local a = clip.parse_emphasis(s)\n"
    "  check(a, 'parse_emphasis')\n"
    "  local c = clip.parse_comfy(s)\n"
    "  check(c, 'parse_comfy')\n"
    "  for _, pieces in ipairs({ a, c }) do\n"
    "    local chunks = clip.chunks(pieces, tok, { comma = 44, embedding = embedding })\n"
    "    for _, ch in ipairs(chunks) do\n"
    "      if #ch.ids ~= 77 or #ch.weights ~= 77 then broken('chunk of ' .. #ch.ids .. ' ids') end\n"
    "      for _, f in ipairs(ch.fixes) do\n"
    "        if f.pos < 2 or f.pos + f.count - 1 > 76 then broken('embedding outside its chunk') end\n"
    "      end\n"
    "    end\n"
    "  end\n"
    "end\n";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_lua_run(driver, data, size);
    return 0;
}
