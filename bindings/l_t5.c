/* l_t5.c - T5's tokenizer for Lua: kiln.t5.tokenize(text) (published by scripts/kiln/t5.lua)
 * over runtime/t5_tokenizer.h (T5 v1.1's SentencePiece vocabulary, compiled in). The
 * vocabulary is opened on the first call and kept by the Lua state, as an upvalue whose
 * __gc frees it. */
#include "l_parts.h"
#include "../runtime/t5_tokenizer.h"

#include <stdlib.h>

#define KILN_T5_VOCAB_MT "kiln.T5Vocabulary"

typedef struct {
    kiln_t5_tokenizer *t; /* NULL until the first call, and after __gc */
} l_t5vocab;

static int vocab_gc(lua_State *L)
{
    l_t5vocab *u = luaL_checkudata(L, 1, KILN_T5_VOCAB_MT);
    kiln_t5_tokenizer_free(u->t);
    u->t = NULL;
    return 0;
}

/* kiln.t5.tokenize(text) -> {id, ..., 1}   [-0, +1, e]
 * SentencePiece's ids under T5 v1.1's model, ending in </s> (1), no padding. */
static int t5_tokenize(lua_State *L)
{
    if (lua_type(L, 1) != LUA_TSTRING) return luaL_typeerror(L, 1, "string");
    size_t len;
    const char *text = lua_tolstring(L, 1, &len);
    l_t5vocab *u = lua_touserdata(L, lua_upvalueindex(1));
    if (!u->t) L_TRY(L, kiln_t5_tokenizer_open_builtin(&u->t));
    int *ids = NULL, n = 0;
    L_TRY(L, kiln_t5_tokenizer_encode(u->t, text, len, &ids, &n));
    /* the table may raise (out of memory): copy into it, then free */
    if (!lua_checkstack(L, 2)) { free(ids); return luaL_error(L, "kiln.t5.tokenize: stack overflow"); }
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushinteger(L, ids[i]);
        lua_rawseti(L, -2, i + 1);
    }
    free(ids);
    return 1;
}

/* Adds kiln._t5_tokenize to the kiln table at -1: the script module kiln.t5 (the encoder,
 * scripts/kiln/t5.lua) publishes it as kiln.t5.tokenize, so that the name has one owner. */
void l_open_t5(lua_State *L)
{
    l_t5vocab *u = lua_newuserdatauv(L, sizeof *u, 0);
    u->t = NULL;
    if (luaL_newmetatable(L, KILN_T5_VOCAB_MT)) {
        lua_pushcfunction(L, vocab_gc);
        lua_setfield(L, -2, "__gc");
    }
    lua_setmetatable(L, -2);
    lua_pushcclosure(L, t5_tokenize, 1);
    lua_setfield(L, -2, "_t5_tokenize");
}
