/* l_json.c - kiln.json: decode (the runtime's strict RFC 8259 reader, runtime/json.c,
 * into Lua values) and encode (Lua values to compact JSON text), and kiln.json.null,
 * the value JSON's null decodes to. Both directions stop at the reader's nesting
 * depth, so what encode writes decode reads back. */
#include "l_parts.h"
#include "../runtime/json.h"
#include "../runtime/unicode.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The reader's depth limit (runtime/json.c): containers nest at most this deep. */
#define JSON_MAX_DEPTH 64

#define TREE_MT "kiln.json.tree"     /* a parsed tree waiting to become Lua values */
#define OUTPUT_MT "kiln.json.output" /* encode's growing text */
#define NULL_KEY "kiln.json.null"    /* registry: the null sentinel */

/* kiln.json.null: one empty userdata per state (a table could be mistaken for an
 * empty object); it prints as "null" in the REPL and in tostring. */
static void push_null(lua_State *L) { lua_getfield(L, LUA_REGISTRYINDEX, NULL_KEY); }

static int is_null(lua_State *L, int idx)
{
    push_null(L);
    int eq = lua_rawequal(L, idx, -1);
    lua_pop(L, 1);
    return eq;
}

static int null_tostring(lua_State *L)
{
    lua_pushliteral(L, "null");
    return 1;
}

/* ---------- decode ---------- */

/* The tree lives in a userdata until its values are pushed, so an error raised on the
 * way (out of memory, a stack overflow) frees it through __gc. */
static int tree_gc(lua_State *L)
{
    kiln_json **box = luaL_checkudata(L, 1, TREE_MT);
    kiln_json_free(*box);
    *box = NULL;
    return 0;
}

/* Empty arrays keep their kind through a metatable ({__jsontype = "array"}, as
 * dkjson marks them), so "[]" encodes back as "[]" and not as "{}". */
static void set_array_mt(lua_State *L)
{
    if (luaL_newmetatable(L, "kiln.json.array")) {
        lua_pushliteral(L, "array");
        lua_setfield(L, -2, "__jsontype");
    }
    lua_setmetatable(L, -2);
}

static void push_value(lua_State *L, const kiln_json *v)
{
    luaL_checkstack(L, 4, "kiln.json.decode: nesting too deep");
    switch (v->type) {
    case KILN_JSON_NULL: push_null(L); break;
    case KILN_JSON_BOOL: lua_pushboolean(L, v->boolean); break;
    case KILN_JSON_NUMBER:
        if (v->is_integer) lua_pushinteger(L, (lua_Integer)v->integer);
        else lua_pushnumber(L, (lua_Number)v->number);
        break;
    case KILN_JSON_STRING: lua_pushlstring(L, v->string, v->string_len); break;
    case KILN_JSON_ARRAY: {
        lua_createtable(L, v->count > 0x7fffffff ? 0 : (int)v->count, 0);
        lua_Integer i = 1;
        for (const kiln_json *c = v->child; c; c = c->next) {
            push_value(L, c);
            lua_rawseti(L, -2, i++);
        }
        if (!v->child) set_array_mt(L);
        break;
    }
    case KILN_JSON_OBJECT:
        lua_createtable(L, 0, v->count > 0x7fffffff ? 0 : (int)v->count);
        for (const kiln_json *c = v->child; c; c = c->next) {
            lua_pushlstring(L, c->key, c->key_len);
            push_value(L, c);
            lua_rawset(L, -3); /* a repeated key: the last one wins */
        }
        break;
    }
}

/* kiln.json.decode(text) -> value. Objects become tables, arrays lists, null
 * kiln.json.null; integers within 64 bits stay integers. Malformed text raises an
 * error that gives the byte offset. [-0, +1, e] */
static int json_decode(lua_State *L)
{
    size_t len;
    const char *text = luaL_checklstring(L, 1, &len);
    kiln_json **box = lua_newuserdatauv(L, sizeof *box, 0);
    *box = NULL;
    luaL_setmetatable(L, TREE_MT);
    kiln_status st = kiln_json_parse(text, len, box);
    if (st) l_raise(L, st); /* the parser freed its partial tree */
    push_value(L, *box);
    kiln_json_free(*box);
    *box = NULL;
    return 1;
}

/* ---------- encode ---------- */

typedef struct {
    char *p;
    size_t n, cap;
} output;

static int output_gc(lua_State *L)
{
    output *o = luaL_checkudata(L, 1, OUTPUT_MT);
    free(o->p);
    o->p = NULL;
    return 0;
}

static void out_add(lua_State *L, output *o, const char *s, size_t n)
{
    if (o->cap - o->n < n) {
        size_t cap = o->cap ? o->cap : 256;
        while (cap - o->n < n) {
            if (cap > ((size_t)-1) / 2) luaL_error(L, "kiln.json.encode: text too large");
            cap *= 2;
        }
        char *p = realloc(o->p, cap);
        if (!p) luaL_error(L, "kiln.json.encode: out of host memory (%d MiB of text)", (int)(cap >> 20));
        o->p = p;
        o->cap = cap;
    }
    memcpy(o->p + o->n, s, n);
    o->n += n;
}

#define OUT_LIT(L, o, s) out_add((L), (o), (s), sizeof(s) - 1)

static void out_string(lua_State *L, output *o, const char *s, size_t n)
{
    OUT_LIT(L, o, "\"");
    size_t run = 0; /* bytes copied as they are, added in one go */
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t k = 1;
        const char *e = NULL;
        char u[8];
        if (c >= 0x80) {
            k = kiln_unicode_utf8_seq_len((const unsigned char *)s + i, n - i);
            if (!k) luaL_error(L, "kiln.json.encode: string is not valid UTF-8 (byte %d)", (int)i + 1);
        } else if (c == '"') e = "\\\"";
        else if (c == '\\') e = "\\\\";
        else if (c == '\n') e = "\\n";
        else if (c == '\r') e = "\\r";
        else if (c == '\t') e = "\\t";
        else if (c == '\b') e = "\\b";
        else if (c == '\f') e = "\\f";
        else if (c < 0x20) {
            snprintf(u, sizeof u, "\\u%04x", c);
            e = u;
        }
        if (e) {
            out_add(L, o, s + i - run, run);
            run = 0;
            out_add(L, o, e, strlen(e));
        } else run += k;
        i += k;
    }
    out_add(L, o, s + n - run, run);
    OUT_LIT(L, o, "\"");
}

/* Integers exactly; other numbers with the fewest digits that read back as the
 * same double. NaN and infinities have no JSON form. */
static const char *format_number(lua_State *L, int idx, char buf[40])
{
    if (lua_isinteger(L, idx)) {
        snprintf(buf, 40, LUA_INTEGER_FMT, (LUAI_UACINT)lua_tointeger(L, idx));
        return buf;
    }
    double v = (double)lua_tonumber(L, idx);
    if (!isfinite(v)) luaL_error(L, "kiln.json.encode: %s has no JSON form", v != v ? "nan" : v > 0 ? "inf" : "-inf");
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, 40, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) break;
    }
    return buf;
}

static void out_number(lua_State *L, output *o, int idx)
{
    char buf[40];
    format_number(L, idx, buf);
    out_add(L, o, buf, strlen(buf));
}

/* An object member's key as text, and where its original key is (keys that are
 * numbers are written in decimal). The text is anchored in a Lua table. */
typedef struct {
    const char *s;
    size_t len;
    int original;
} member_key;

static int cmp_keys(const void *pa, const void *pb)
{
    const member_key *a = pa, *b = pb;
    int c = memcmp(a->s, b->s, a->len < b->len ? a->len : b->len);
    return c ? c : a->len < b->len ? -1 : a->len > b->len;
}

static void encode_value(lua_State *L, output *o, int idx, int depth, int visiting);

/* Whether the table at idx is written as an array (1) or an object (0): an array
 * when its keys are exactly 1..n (n >= 1); a metatable's __jsontype ("array" or
 * "object") decides for empty or ambiguous tables. *n: its number of keys. */
static int table_kind(lua_State *L, int idx, lua_Integer *n)
{
    const char *forced = NULL;
    if (luaL_getmetafield(L, idx, "__jsontype") != LUA_TNIL) {
        forced = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        lua_pop(L, 1); /* the string stays referenced by the metatable */
        if (!forced || (strcmp(forced, "array") != 0 && strcmp(forced, "object") != 0))
            luaL_error(L, "kiln.json.encode: __jsontype must be \"array\" or \"object\"");
    }
    lua_Integer count = 0, max = 0;
    int list = 1;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        count++;
        if (list && lua_isinteger(L, -1) && lua_tointeger(L, -1) >= 1) {
            lua_Integer k = lua_tointeger(L, -1);
            if (k > max) max = k;
        } else list = 0;
    }
    list = list && max == count;
    *n = count;
    if (forced && strcmp(forced, "object") == 0) return 0;
    if (forced) {
        if (!list && count) luaL_error(L, "kiln.json.encode: a table marked as an array has keys other than 1..n");
        return 1;
    }
    return list && count > 0;
}

static void encode_table(lua_State *L, output *o, int idx, int depth, int visiting)
{
    if (depth >= JSON_MAX_DEPTH)
        luaL_error(L, "kiln.json.encode: tables nested deeper than %d levels", JSON_MAX_DEPTH);
    luaL_checkstack(L, 8, "kiln.json.encode: nesting too deep");
    lua_pushvalue(L, idx);
    if (lua_rawget(L, visiting) != LUA_TNIL) luaL_error(L, "kiln.json.encode: a table contains itself (a cycle)");
    lua_pop(L, 1);
    lua_pushvalue(L, idx);
    lua_pushboolean(L, 1);
    lua_rawset(L, visiting);

    lua_Integer n;
    if (table_kind(L, idx, &n)) {
        OUT_LIT(L, o, "[");
        for (lua_Integer i = 1; i <= n; i++) {
            if (i > 1) OUT_LIT(L, o, ",");
            lua_rawgeti(L, idx, i);
            encode_value(L, o, lua_gettop(L), depth + 1, visiting);
            lua_pop(L, 1);
        }
        OUT_LIT(L, o, "]");
    } else {
        /* keys as text (number keys in their decimal form) in a table that anchors
         * them, their original keys in another, then sorted by the text's bytes */
        if (n > 0x7ffffff) luaL_error(L, "kiln.json.encode: table too large");
        lua_createtable(L, (int)n, 0);
        int texts = lua_gettop(L);
        lua_createtable(L, (int)n, 0);
        int originals = texts + 1;
        member_key *keys = lua_newuserdatauv(L, sizeof(member_key) * (size_t)(n ? n : 1), 0);
        int k = 0;
        lua_pushnil(L);
        while (lua_next(L, idx)) {
            lua_pop(L, 1);
            int kt = lua_type(L, -1);
            if (kt == LUA_TSTRING) lua_pushvalue(L, -1);
            else if (kt == LUA_TNUMBER) {
                char buf[40];
                lua_pushstring(L, format_number(L, -1, buf));
            } else luaL_error(L, "kiln.json.encode: a table key is a %s (keys must be strings or numbers)",
                              luaL_typename(L, -1));
            keys[k].s = lua_tolstring(L, -1, &keys[k].len);
            keys[k].original = k + 1;
            lua_rawseti(L, texts, k + 1);
            lua_pushvalue(L, -1);
            lua_rawseti(L, originals, k + 1);
            k++;
        }
        qsort(keys, (size_t)k, sizeof *keys, cmp_keys);
        OUT_LIT(L, o, "{");
        for (int i = 0; i < k; i++) {
            if (i > 0) {
                if (cmp_keys(&keys[i - 1], &keys[i]) == 0)
                    luaL_error(L, "kiln.json.encode: key '%s' appears twice (as a number and as a string)", keys[i].s);
                OUT_LIT(L, o, ",");
            }
            out_string(L, o, keys[i].s, keys[i].len);
            OUT_LIT(L, o, ":");
            lua_rawgeti(L, originals, keys[i].original);
            lua_rawget(L, idx);
            encode_value(L, o, lua_gettop(L), depth + 1, visiting);
            lua_pop(L, 1);
        }
        OUT_LIT(L, o, "}");
        lua_pop(L, 3);
    }

    lua_pushvalue(L, idx);
    lua_pushnil(L);
    lua_rawset(L, visiting); /* shared (not cyclic) subtables may appear again */
}

static void encode_value(lua_State *L, output *o, int idx, int depth, int visiting)
{
    switch (lua_type(L, idx)) {
    case LUA_TNIL: OUT_LIT(L, o, "null"); break;
    case LUA_TBOOLEAN:
        if (lua_toboolean(L, idx)) OUT_LIT(L, o, "true");
        else OUT_LIT(L, o, "false");
        break;
    case LUA_TNUMBER: out_number(L, o, idx); break;
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(L, idx, &n);
        out_string(L, o, s, n);
        break;
    }
    case LUA_TTABLE: encode_table(L, o, idx, depth, visiting); break;
    default:
        if (is_null(L, idx)) { OUT_LIT(L, o, "null"); break; }
        luaL_error(L, "kiln.json.encode: cannot encode a %s", luaL_typename(L, idx));
    }
}

/* kiln.json.encode(value) -> text: compact JSON. Tables with keys 1..n are arrays,
 * other tables objects with their keys sorted (so the text is reproducible);
 * kiln.json.null and nil are null. Cycles, NaN, infinities, functions and invalid
 * UTF-8 raise. [-0, +1, e] */
static int json_encode(lua_State *L)
{
    luaL_checkany(L, 1);
    lua_settop(L, 1);
    output *o = lua_newuserdatauv(L, sizeof *o, 0);
    *o = (output){0};
    luaL_setmetatable(L, OUTPUT_MT);
    lua_newtable(L); /* visiting: the tables on the way down, to find cycles */
    encode_value(L, o, 1, 0, 3);
    lua_pushlstring(L, o->p ? o->p : "", o->n);
    free(o->p);
    o->p = NULL;
    return 1;
}

static const luaL_Reg json_funcs[] = {
    {"decode", json_decode}, {"encode", json_encode},
    {NULL, NULL},
};

void l_open_json(lua_State *L)
{
    luaL_newmetatable(L, TREE_MT);
    lua_pushcfunction(L, tree_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    luaL_newmetatable(L, OUTPUT_MT);
    lua_pushcfunction(L, output_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);

    if (lua_getfield(L, LUA_REGISTRYINDEX, NULL_KEY) == LUA_TNIL) { /* one per state */
        lua_newuserdatauv(L, 0, 0);
        luaL_newmetatable(L, "kiln.json.Null");
        lua_pushcfunction(L, null_tostring);
        lua_setfield(L, -2, "__tostring");
        lua_setmetatable(L, -2);
        lua_setfield(L, LUA_REGISTRYINDEX, NULL_KEY);
    }
    lua_pop(L, 1);

    luaL_newlib(L, json_funcs);
    push_null(L);
    lua_setfield(L, -2, "null");
    lua_setfield(L, -2, "json");
}
