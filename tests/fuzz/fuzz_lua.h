/* fuzz_lua.h - the Lua side of the harnesses for parsers written in Lua (the
 * standard library under scripts/kiln): one state with the kiln module for the
 * whole run, and a driver chunk that returns fuzz(bytes). A Lua error is a fine
 * answer to a bad input; the driver raises {broken = why} for a broken invariant,
 * which aborts like a crash. */
#ifndef KILN_FUZZ_LUA_H
#define KILN_FUZZ_LUA_H

#include "fuzz.h"

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include "l_parts.h"

static lua_State *fuzz_lua;

static inline void fuzz_lua_close(void)
{
    if (fuzz_lua) lua_close(fuzz_lua);
    fuzz_lua = NULL;
}

static inline void fuzz_lua_run(const char *driver, const uint8_t *data, size_t size)
{
    lua_State *L = fuzz_lua;
    if (!L) {
        L = fuzz_lua = luaL_newstate();
        if (!L) abort();
        atexit(fuzz_lua_close);
        luaL_openlibs(L);
        luaL_requiref(L, "kiln", luaopen_kiln, 1);
        lua_pop(L, 1);
        if (luaL_loadstring(L, driver) != LUA_OK || lua_pcall(L, 0, 1, 0) != LUA_OK) {
            fprintf(stderr, "fuzz driver: %s\n", lua_tostring(L, -1));
            abort();
        }
        lua_setfield(L, LUA_REGISTRYINDEX, "kiln.fuzz_one");
    }
    lua_getfield(L, LUA_REGISTRYINDEX, "kiln.fuzz_one");
    lua_pushlstring(L, (const char *)data, size);
    if (lua_pcall(L, 1, 0, 0) != LUA_OK) {
        if (lua_istable(L, -1) && lua_getfield(L, -1, "broken") == LUA_TSTRING) {
            fprintf(stderr, "invariant broken: %s\n", lua_tostring(L, -1));
            abort();
        }
        lua_settop(L, 0);
    }
    FUZZ_REQUIRE(lua_gettop(L) == 0);
}

#endif
