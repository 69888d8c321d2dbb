/* l_scripts.c - the package searcher for kiln's own Lua scripts: the copies compiled
 * into the binary by bindings/gen_scripts.lua, overridden from disk by KILN_PATH
 * (development) or, for the CLI, by the source tree it runs in. */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"

#include "l_scripts.h"
#include "kiln.h"

/* Registry key of the searcher's state table: { path = "dir;dir" | nil }. The same
 * table is the searcher's upvalue, so kiln_scripts_set_path reaches it. */
#define SCRIPTS_KEY "kiln.scripts"

/* kiln.h's view of the table: the names alone (the REPL completes them). */
const char *kiln_script_name_at(int i)
{
    return i >= 0 && (size_t)i < kiln_embedded_script_count ? kiln_embedded_scripts[i].name : NULL;
}

const kiln_embedded_script *kiln_scripts_find(const char *name)
{
    for (size_t i = 0; i < kiln_embedded_script_count; i++)
        if (strcmp(kiln_embedded_scripts[i].name, name) == 0)
            return &kiln_embedded_scripts[i];
    return NULL;
}

static int readable(const char *filename)
{
    FILE *f = fopen(filename, "r");
    if (f == NULL) return 0;
    fclose(f);
    return 1;
}

/* package.searchers entry: searcher(name) -> loader, origin | message   [-1, +2, e]
 * Disk first (each directory of the state's path: dir/a/b.lua, dir/a/b/init.lua for
 * "a.b"), then the embedded copy. */
static int searcher(lua_State *L)
{
    static const char *const patterns[] = {"%s/%s.lua", "%s/%s/init.lua"};
    const char *name = luaL_checkstring(L, 1);
    lua_settop(L, 1);
    lua_getfield(L, lua_upvalueindex(1), "path");     /* 2: path or nil */
    const char *path = lua_tostring(L, 2);
    const char *modpath = luaL_gsub(L, name, ".", "/"); /* 3 */
    lua_pushliteral(L, "");                            /* 4: "not found" message */

    for (const char *p = path; p != NULL && *p != '\0';) {
        const char *end = strchr(p, ';');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len > 0) {
            lua_pushlstring(L, p, len); /* 5: directory */
            for (size_t i = 0; i < sizeof patterns / sizeof patterns[0]; i++) {
                const char *filename = lua_pushfstring(L, patterns[i], lua_tostring(L, 5), modpath);
                if (readable(filename)) {
                    if (luaL_loadfilex(L, filename, NULL) != LUA_OK)
                        return luaL_error(L, "error loading module '%s' from file '%s':\n\t%s", name,
                                          filename, lua_tostring(L, -1));
                    lua_insert(L, -2); /* loader, file name */
                    return 2;
                }
                lua_pushfstring(L, "%sno file '%s'\n\t", lua_tostring(L, 4), filename);
                lua_replace(L, 4);
                lua_pop(L, 1);
            }
            lua_pop(L, 1);
        }
        p += len;
        if (*p == ';') p++;
    }

    const kiln_embedded_script *s = kiln_scripts_find(name);
    if (s != NULL) {
        if (luaL_loadbufferx(L, (const char *)s->data, s->size, s->chunkname, "t") != LUA_OK)
            return luaL_error(L, "error loading embedded module '%s':\n\t%s", name, lua_tostring(L, -1));
        lua_pushfstring(L, "embedded:%s", s->chunkname + 1);
        return 2;
    }
    lua_pushfstring(L, "%sno embedded script '%s'", lua_tostring(L, 4), name);
    return 1;
}

/* Pushes the state table, installing the searcher first if needed; pushes nil if
 * the package library is not open. */
static int push_state(lua_State *L)
{
    if (lua_getfield(L, LUA_REGISTRYINDEX, SCRIPTS_KEY) == LUA_TTABLE) return 1;
    lua_pop(L, 1);

    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    if (lua_getfield(L, -1, LUA_LOADLIBNAME) != LUA_TTABLE ||
        lua_getfield(L, -1, "searchers") != LUA_TTABLE) {
        lua_settop(L, lua_gettop(L) - 3);
        lua_pushnil(L);
        return 0;
    }
    /* stack: loaded, package, searchers */
    lua_createtable(L, 0, 1);
    lua_getfield(L, LUA_REGISTRYINDEX, "LUA_NOENV");
    int noenv = lua_toboolean(L, -1);
    lua_pop(L, 1);
    const char *env = noenv ? NULL : getenv("KILN_PATH");
    if (env != NULL && *env != '\0') {
        lua_pushstring(L, env);
        lua_setfield(L, -2, "path");
    }
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, SCRIPTS_KEY);

    /* table.insert(searchers, 2, closure) */
    lua_pushvalue(L, -1);
    lua_pushcclosure(L, searcher, 1);
    lua_Integer n = (lua_Integer)lua_rawlen(L, -3);
    lua_Integer pos = n >= 1 ? 2 : 1;
    for (lua_Integer i = n; i >= pos; i--) {
        lua_rawgeti(L, -3, i);
        lua_rawseti(L, -4, i + 1);
    }
    lua_rawseti(L, -3, pos);
    /* stack: loaded, package, searchers, state */
    lua_replace(L, -4);
    lua_pop(L, 2);
    return 1;
}

void kiln_scripts_install(lua_State *L)
{
    push_state(L);
    lua_pop(L, 1);
}

void kiln_scripts_set_path(lua_State *L, const char *path)
{
    if (push_state(L)) {
        if (path != NULL && *path != '\0') lua_pushstring(L, path);
        else lua_pushnil(L);
        lua_setfield(L, -2, "path");
    }
    lua_pop(L, 1);
}

static int is_dir(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_file(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

int kiln_scripts_prefer_source_tree(lua_State *L)
{
    lua_getfield(L, LUA_REGISTRYINDEX, "LUA_NOENV");
    int noenv = lua_toboolean(L, -1);
    lua_pop(L, 1);
    /* an explicit KILN_PATH (even empty: "embedded only") wins */
    if (noenv || getenv("KILN_PATH") != NULL) return 0;
    if (!is_dir("scripts/kiln") || !is_file("bindings/l_scripts.h")) return 0;
    kiln_scripts_set_path(L, "scripts");
    return 1;
}
