/* l_aux.c - the bindings' shared helpers (see l_aux.h): error raising and the typed
 * error tables, argument and option checks, byte counts and JSON string escapes.
 * Every binding file uses these instead of its own copy, as Lua's libraries use
 * lauxlib. */
#include "l_aux.h"

#include <stdio.h>
#include <string.h>

#define DEFAULT_DEVICE_KEY "kiln.default_device" /* registry: the default device's name */

/* ---------- errors ---------- */

static int err_tostring(lua_State *L)
{
    lua_getfield(L, 1, "message");
    return 1;
}

/* Sets KILN_ERROR_MT on the table at the top, creating the metatable on first use. */
static void set_error_mt(lua_State *L)
{
    if (luaL_newmetatable(L, KILN_ERROR_MT)) {
        lua_pushcfunction(L, err_tostring);
        lua_setfield(L, -2, "__tostring");
    }
    lua_setmetatable(L, -2);
}

int l_raise(lua_State *L, kiln_status st)
{
    const char *msg = kiln_last_error();
    if (st != KILN_ERR_OOM) {
        luaL_where(L, 1);
        lua_pushstring(L, msg && *msg ? msg : kiln_status_name(st));
        lua_concat(L, 2);
        return lua_error(L);
    }
    const kiln_oom_info *o = kiln_last_oom();
    lua_createtable(L, 0, 6);
    lua_pushstring(L, "oom");
    lua_setfield(L, -2, "kind");
    lua_pushstring(L, o->device);
    lua_setfield(L, -2, "device");
    lua_pushinteger(L, (lua_Integer)o->requested);
    lua_setfield(L, -2, "requested");
    lua_pushinteger(L, (lua_Integer)o->free);
    lua_setfield(L, -2, "free");
    lua_pushinteger(L, (lua_Integer)o->budget);
    lua_setfield(L, -2, "budget");
    luaL_where(L, 1);
    lua_pushstring(L, msg);
    lua_concat(L, 2);
    lua_setfield(L, -2, "message");
    set_error_mt(L);
    return lua_error(L);
}

int l_raise_cancelled(lua_State *L, const char *detail)
{
    lua_createtable(L, 0, 2);
    lua_pushstring(L, "cancelled");
    lua_setfield(L, -2, "kind");
    luaL_where(L, 1);
    lua_pushstring(L, "cancelled");
    lua_pushstring(L, detail ? detail : "");
    lua_concat(L, 3);
    lua_setfield(L, -2, "message");
    set_error_mt(L);
    return lua_error(L);
}

void l_where_string(lua_State *L, char *buf, size_t n)
{
    luaL_where(L, 1);
    const char *w = lua_tostring(L, -1);
    size_t len = strlen(w);
    while (len && (w[len - 1] == ' ' || w[len - 1] == ':')) len--;
    snprintf(buf, n, "%.*s", (int)len, len ? w : "?");
    lua_pop(L, 1);
}

int l_enum_error(lua_State *L, int arg, const char *what, const char *value, const char *const *valid)
{
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    lua_pushfstring(L, "invalid %s '%s' (expected one of: ", what, value);
    luaL_addvalue(&b);
    for (int i = 0; valid[i]; i++) {
        if (i) luaL_addstring(&b, ", ");
        luaL_addstring(&b, valid[i]);
    }
    luaL_addstring(&b, ")");
    luaL_pushresult(&b);
    return luaL_argerror(L, arg, lua_tostring(L, -1));
}

/* ---------- arguments ---------- */

int l_check_dim(lua_State *L, int arg, int ndim, int allow_end)
{
    lua_Integer d = luaL_checkinteger(L, arg);
    int n = ndim + (allow_end ? 1 : 0);
    lua_Integer z = d < 0 ? n + d : d - 1;
    if (d == 0 || z < 0 || z >= n)
        luaL_argerror(L, arg, lua_pushfstring(L, "dimension %d out of range for a %d-d tensor", (int)d, ndim));
    return (int)z;
}

int l_check_shape(lua_State *L, int idx, int64_t *shape, int varargs)
{
    int n = 0;
    if (lua_istable(L, idx)) {
        n = (int)luaL_len(L, idx);
        if (n > KILN_MAX_DIMS) luaL_argerror(L, idx, "shape has more than 8 dimensions");
        for (int i = 0; i < n; i++) {
            lua_geti(L, idx, i + 1);
            int ok;
            lua_Integer v = lua_tointegerx(L, -1, &ok);
            if (!ok) luaL_argerror(L, idx, lua_pushfstring(L, "shape[%d] is not an integer", i + 1));
            shape[i] = v;
            lua_pop(L, 1);
        }
        return n;
    }
    if (!varargs) luaL_typeerror(L, idx, "shape table");
    int top = lua_gettop(L);
    for (int i = idx; i <= top; i++) {
        if (n >= KILN_MAX_DIMS) luaL_argerror(L, i, "shape has more than 8 dimensions");
        shape[n++] = luaL_checkinteger(L, i);
    }
    return n;
}

kiln_dtype l_check_dtype(lua_State *L, int idx)
{
    const char *s = luaL_checkstring(L, idx);
    int dt = kiln_dtype_from_name(s);
    if (dt < 0) {
        static const char *const valid[] = {"f32", "f16", "bf16", "i32", "i64", "u8", "f8_e4m3fn", "f8_e5m2", "q8_0",
                                            "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", NULL};
        l_enum_error(L, idx, "dtype", s, valid);
    }
    return (kiln_dtype)dt;
}

kiln_device *l_check_device(lua_State *L, int idx)
{
    kiln_device *d = kiln_device_get(luaL_checkstring(L, idx));
    if (!d) luaL_argerror(L, idx, kiln_last_error());
    return d;
}

kiln_device *l_opt_device(lua_State *L, int idx)
{
    if (lua_isnoneornil(L, idx)) return l_default_device(L);
    return l_check_device(L, idx);
}

kiln_device *l_default_device(lua_State *L)
{
    lua_getfield(L, LUA_REGISTRYINDEX, DEFAULT_DEVICE_KEY);
    const char *name = lua_tostring(L, -1);
    kiln_device *d = name ? kiln_device_get(name) : NULL;
    lua_pop(L, 1);
    return d ? d : kiln_device_cpu();
}

void l_set_default_device(lua_State *L, const kiln_device *dev)
{
    lua_pushstring(L, dev->name);
    lua_setfield(L, LUA_REGISTRYINDEX, DEFAULT_DEVICE_KEY);
}

/* Pushes field key of the options table at idx and returns 1; returns 0 with
 * nothing pushed when idx is not a table or the field is nil. */
static int opt_field(lua_State *L, int idx, const char *key)
{
    if (!lua_istable(L, idx)) return 0;
    if (lua_getfield(L, idx, key) != LUA_TNIL) return 1;
    lua_pop(L, 1);
    return 0;
}

lua_Integer l_opt_int_field(lua_State *L, int idx, const char *key, lua_Integer def)
{
    if (!opt_field(L, idx, key)) return def;
    int ok;
    lua_Integer v = lua_tointegerx(L, -1, &ok);
    if (!ok) luaL_error(L, "option '%s' must be an integer, got %s", key, luaL_typename(L, -1));
    lua_pop(L, 1);
    return v;
}

lua_Number l_opt_num_field(lua_State *L, int idx, const char *key, lua_Number def)
{
    if (!opt_field(L, idx, key)) return def;
    int ok;
    lua_Number v = lua_tonumberx(L, -1, &ok);
    if (!ok) luaL_error(L, "option '%s' must be a number, got %s", key, luaL_typename(L, -1));
    lua_pop(L, 1);
    return v;
}

int l_opt_bool_field(lua_State *L, int idx, const char *key, int def)
{
    if (!opt_field(L, idx, key)) return def;
    int v = lua_toboolean(L, -1);
    lua_pop(L, 1);
    return v;
}

const char *l_opt_str_field(lua_State *L, int idx, const char *key, const char *def)
{
    if (!opt_field(L, idx, key)) return def;
    if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "option '%s' must be a string, got %s", key, luaL_typename(L, -1));
    const char *s = lua_tostring(L, -1);
    lua_pop(L, 1); /* the string stays alive: it is referenced by the options table */
    return s;
}

/* ---------- hooks ---------- */

#define HOOKS_KEY "kiln.hooks" /* registry: table name -> registered function */

/* ORDER HOOK: the callbacks C makes into scripts, and the module that registers each
 * when it loads. NULL provider: optional (kiln.stream adapts only passes it runs, so
 * when it never loaded there is nothing to adapt). */
static const char *const hook_names[] = {
    "stream_adapt", /* kiln.suspend_point: adapt(device, excess) */
    "mem_estimate", /* kiln.mem.estimate(fn, inputs [, opts]) -> bytes, details */
    NULL,
};
static const char *const hook_providers[] = {NULL, "kiln.tiling"};

static int hook_index(const char *name)
{
    for (int i = 0; hook_names[i]; i++)
        if (strcmp(hook_names[i], name) == 0) return i;
    return -1;
}

/* [-0, +1, m] the hooks table (created on first use) */
static void push_hooks(lua_State *L)
{
    if (lua_getfield(L, LUA_REGISTRYINDEX, HOOKS_KEY) == LUA_TTABLE) return;
    lua_pop(L, 1);
    lua_newtable(L);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, HOOKS_KEY);
}

static int get_hook(lua_State *L, const char *name)
{
    push_hooks(L);
    if (lua_getfield(L, -1, name) == LUA_TFUNCTION) {
        lua_remove(L, -2);
        return 1;
    }
    lua_pop(L, 2);
    return 0;
}

int l_hook_push(lua_State *L, const char *name)
{
    int i = hook_index(name);
    if (i < 0) return luaL_error(L, "kiln: unknown hook '%s'", name);
    if (get_hook(L, name)) return 1;
    if (!hook_providers[i]) return 0;
    lua_getglobal(L, "require");
    lua_pushstring(L, hook_providers[i]);
    lua_call(L, 1, 0);
    if (get_hook(L, name)) return 1;
    return luaL_error(L, "kiln: hook '%s' is not registered: %s did not call kiln._register_hook(\"%s\", fn) when it loaded",
                      name, hook_providers[i], name);
}

/* kiln._register_hook(name, fn) [-0, +0, v]: fn replaces what name had */
static int register_hook(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    luaL_checktype(L, 2, LUA_TFUNCTION);
    if (hook_index(name) < 0) return l_enum_error(L, 1, "hook", name, hook_names);
    push_hooks(L);
    lua_pushvalue(L, 2);
    lua_setfield(L, -2, name);
    return 0;
}

/* kiln._hook(name) -> the registered function, or nil (no loading) */
static int hook_get(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    if (hook_index(name) < 0) return l_enum_error(L, 1, "hook", name, hook_names);
    if (!get_hook(L, name)) lua_pushnil(L);
    return 1;
}

void l_open_hooks(lua_State *L)
{
    lua_pushcfunction(L, register_hook);
    lua_setfield(L, -2, "_register_hook");
    lua_pushcfunction(L, hook_get);
    lua_setfield(L, -2, "_hook");
}

/* ---------- output ---------- */

const char *l_push_bytes(lua_State *L, double bytes)
{
    char buf[32];
    kiln_format_bytes(buf, sizeof buf, bytes);
    return lua_pushstring(L, buf);
}

void l_add_json_escaped(luaL_Buffer *b, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *e = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\n' ? "\\n" : c == '\r' ? "\\r"
                      : c == '\t' ? "\\t" : c == '\b' ? "\\b" : c == '\f' ? "\\f" : NULL;
        if (e) luaL_addstring(b, e);
        else if (c < 0x20) {
            char u[8];
            snprintf(u, sizeof u, "\\u%04x", c);
            luaL_addstring(b, u);
        } else luaL_addchar(b, (char)c);
    }
}
