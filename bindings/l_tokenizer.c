/* l_tokenizer.c - kiln.tokenizer([path]) and the kiln.Tokenizer userdata over
 * runtime/tokenizer.h (CLIP's byte-level BPE): :encode(text) -> ids without
 * start/end, :decode(ids), :bos(), :eos(), :token_id(str), :vocab_size(), :source().
 * Lifecycle as liolib's files: :free(), __close and __gc share one idempotent release. */
#include "l_parts.h"
#include "../runtime/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KILN_TOKENIZER_MT "kiln.Tokenizer"

typedef struct {
    kiln_tokenizer *t;       /* NULL once freed */
    char path[200];          /* the file or folder, or KILN_TOKENIZER_BUILTIN_NAME */
} l_tok;

static l_tok *check_ud(lua_State *L, int idx)
{
    return luaL_checkudata(L, idx, KILN_TOKENIZER_MT);
}

static kiln_tokenizer *check_tok(lua_State *L, int idx)
{
    l_tok *u = check_ud(L, idx);
    if (!u->t) luaL_error(L, "tokenizer '%s' was freed", u->path);
    return u->t;
}

static int tk_free(lua_State *L)
{
    l_tok *u = check_ud(L, 1);
    if (u->t) {
        kiln_tokenizer_free(u->t);
        u->t = NULL;
    }
    return 0;
}

/* kiln.tokenizer([path]) -> kiln.Tokenizer   [-0, +1, e]
 * path: a folder with vocab.json + merges.txt, a vocab.json, or CLIP's
 * bpe_simple_vocab_16e6.txt.gz; none (nil): CLIP's vocabulary built into the library. */
static int l_tokenizer_new(lua_State *L)
{
    const char *path = luaL_optstring(L, 1, NULL);
    l_tok *u = lua_newuserdatauv(L, sizeof *u, 0);
    u->t = NULL;
    snprintf(u->path, sizeof u->path, "%s", path ? path : KILN_TOKENIZER_BUILTIN_NAME);
    luaL_setmetatable(L, KILN_TOKENIZER_MT);
    kiln_tokenizer *t;
    L_TRY(L, path ? kiln_tokenizer_open(path, &t) : kiln_tokenizer_open_builtin(&t));
    u->t = t;
    return 1;
}

/* tok:encode(text) -> {id, ...} (no start / end tokens)   [-0, +1, e] */
static int tk_encode(lua_State *L)
{
    kiln_tokenizer *t = check_tok(L, 1);
    size_t len;
    const char *text = luaL_checklstring(L, 2, &len);
    int *ids = NULL, n = 0;
    L_TRY(L, kiln_tokenizer_encode(t, text, len, &ids, &n));
    /* the table may raise (out of memory): copy into it, then free */
    if (!lua_checkstack(L, 2)) { free(ids); return luaL_error(L, "tokenizer: stack overflow"); }
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushinteger(L, ids[i]);
        lua_rawseti(L, -2, i + 1);
    }
    free(ids);
    return 1;
}

/* tok:decode({id, ...}) -> text   [-0, +1, e] */
static int tk_decode(lua_State *L)
{
    kiln_tokenizer *t = check_tok(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_Integer n = luaL_len(L, 2);
    if (n < 0 || n > 1 << 24) return luaL_argerror(L, 2, "too many ids");
    int *ids = lua_newuserdatauv(L, sizeof(int) * (size_t)(n ? n : 1), 0);
    int vocab = kiln_tokenizer_vocab_size(t);
    for (lua_Integer i = 0; i < n; i++) {
        lua_geti(L, 2, i + 1);
        int ok;
        lua_Integer v = lua_tointegerx(L, -1, &ok);
        if (!ok || v < 0 || v >= vocab)
            return luaL_argerror(L, 2, lua_pushfstring(L, "id %d is not a token id (0..%d)", (int)(i + 1), vocab - 1));
        ids[i] = (int)v;
        lua_pop(L, 1);
    }
    char *s = kiln_tokenizer_decode(t, ids, (int)n);
    if (!s) return luaL_error(L, "tokenizer: out of memory while decoding");
    lua_pushstring(L, s);
    free(s);
    return 1;
}

static int tk_bos(lua_State *L) { lua_pushinteger(L, kiln_tokenizer_bos(check_tok(L, 1))); return 1; }
static int tk_eos(lua_State *L) { lua_pushinteger(L, kiln_tokenizer_eos(check_tok(L, 1))); return 1; }
static int tk_vocab_size(lua_State *L) { lua_pushinteger(L, kiln_tokenizer_vocab_size(check_tok(L, 1))); return 1; }

/* tok:token_id("cat</w>") -> id, or nil when the vocabulary lacks it */
static int tk_token_id(lua_State *L)
{
    int id = kiln_tokenizer_token_id(check_tok(L, 1), luaL_checkstring(L, 2));
    if (id < 0) lua_pushnil(L);
    else lua_pushinteger(L, id);
    return 1;
}

/* tok:source() -> the path it was opened from, or "built-in CLIP vocabulary" */
static int tk_source(lua_State *L)
{
    lua_pushstring(L, check_ud(L, 1)->path);
    return 1;
}

static int tk_tostring(lua_State *L)
{
    l_tok *u = check_ud(L, 1);
    if (!u->t) lua_pushfstring(L, "tokenizer(%s, freed)", u->path);
    else lua_pushfstring(L, "tokenizer(%s, %d tokens)", u->path, kiln_tokenizer_vocab_size(u->t));
    return 1;
}

static const luaL_Reg tok_methods[] = {
    {"encode", tk_encode}, {"decode", tk_decode}, {"bos", tk_bos}, {"eos", tk_eos},
    {"token_id", tk_token_id}, {"vocab_size", tk_vocab_size}, {"source", tk_source}, {"free", tk_free},
    {NULL, NULL},
};

static const luaL_Reg tok_meta[] = {
    {"__gc", tk_free}, {"__close", tk_free}, {"__tostring", tk_tostring},
    {NULL, NULL},
};

/* Adds kiln.tokenizer to the kiln table at -1. */
void l_open_tokenizer(lua_State *L)
{
    luaL_newmetatable(L, KILN_TOKENIZER_MT);
    luaL_setfuncs(L, tok_meta, 0);
    luaL_newlib(L, tok_methods);
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    lua_pushcfunction(L, l_tokenizer_new);
    lua_setfield(L, -2, "tokenizer");
}
