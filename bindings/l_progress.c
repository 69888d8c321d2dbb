/* l_progress.c - progress and cancel from Lua. kiln.progress(step, total [, message])
 * reports a step to the script's handler (kiln.on_progress) and to an embedding host
 * (kiln.h's progress callback), then raises the "cancelled" error if a cancel was
 * requested (kiln.cancel, or the host's kiln_cancel). Loops call it between steps
 * and tiles: that is where a cancel takes effect. */
#include "l_kiln.h"

#include <limits.h>
#include <stdio.h>

#define HANDLER_KEY "kiln.progress.handler" /* registry: the kiln.on_progress function */
#define HOST_KEY "kiln.progress.host"       /* registry: light userdata l_progress_host */
#define CANCEL_KEY "kiln.progress.cancel"   /* registry: kiln.cancel's flag without a host */

void l_progress_set_host(lua_State *L, const l_progress_host *host)
{
    if (host) lua_pushlightuserdata(L, (void *)host);
    else lua_pushnil(L);
    lua_setfield(L, LUA_REGISTRYINDEX, HOST_KEY);
}

static const l_progress_host *get_host(lua_State *L)
{
    lua_getfield(L, LUA_REGISTRYINDEX, HOST_KEY);
    const l_progress_host *h = lua_touserdata(L, -1);
    lua_pop(L, 1);
    return h;
}

static int cancel_requested(lua_State *L)
{
    const l_progress_host *h = get_host(L);
    if (h && h->cancelled) return h->cancelled(h->ud) != 0;
    lua_getfield(L, LUA_REGISTRYINDEX, CANCEL_KEY);
    int on = lua_toboolean(L, -1);
    lua_pop(L, 1);
    return on;
}

static int clamp_int(lua_Integer v)
{
    return v > INT_MAX ? INT_MAX : v < 0 ? 0 : (int)v;
}

/* kiln.progress(step, total [, message]) [-0, +0, e]: total 0 means unknown. */
static int l_progress(lua_State *L)
{
    lua_Integer step = luaL_checkinteger(L, 1);
    lua_Integer total = luaL_optinteger(L, 2, 0);
    const char *msg = luaL_optstring(L, 3, "");
    luaL_argcheck(L, step >= 0, 1, "step must be >= 0");
    luaL_argcheck(L, total >= 0, 2, "total must be >= 0 (0 = unknown)");
    lua_settop(L, 3);
    if (lua_getfield(L, LUA_REGISTRYINDEX, HANDLER_KEY) == LUA_TFUNCTION) {
        lua_pushinteger(L, step);
        lua_pushinteger(L, total);
        lua_pushstring(L, msg);
        lua_call(L, 3, 0);
    } else {
        lua_pop(L, 1);
    }
    const l_progress_host *h = get_host(L);
    if (h && h->progress) h->progress(h->ud, clamp_int(step), clamp_int(total), msg);
    if (cancel_requested(L)) {
        char detail[96];
        if (total > 0) snprintf(detail, sizeof detail, " at step %lld of %lld", (long long)step, (long long)total);
        else snprintf(detail, sizeof detail, " at step %lld", (long long)step);
        l_raise_cancelled(L, detail);
    }
    return 0;
}

/* kiln.on_progress(fn | nil) -> the previous handler [-0, +1, -]: fn(step, total,
 * message) is called by every kiln.progress. */
static int l_on_progress(lua_State *L)
{
    if (!lua_isnoneornil(L, 1)) luaL_checktype(L, 1, LUA_TFUNCTION);
    lua_settop(L, 1);
    lua_getfield(L, LUA_REGISTRYINDEX, HANDLER_KEY);
    lua_pushvalue(L, 1);
    lua_setfield(L, LUA_REGISTRYINDEX, HANDLER_KEY);
    return 1;
}

/* kiln.cancel([on = true]): requests (or withdraws) a cancel; the next kiln.progress
 * raises the "cancelled" error. Embedded, this is the host's request: it is cleared
 * when the host's next call starts. */
static int l_cancel(lua_State *L)
{
    int on = lua_isnone(L, 1) ? 1 : lua_toboolean(L, 1);
    const l_progress_host *h = get_host(L);
    if (h && h->cancel) {
        h->cancel(h->ud, on);
    } else {
        lua_pushboolean(L, on);
        lua_setfield(L, LUA_REGISTRYINDEX, CANCEL_KEY);
    }
    return 0;
}

/* kiln.cancelled() -> boolean */
static int l_cancelled(lua_State *L)
{
    lua_pushboolean(L, cancel_requested(L));
    return 1;
}

static const luaL_Reg progress_funcs[] = {
    {"progress", l_progress}, {"on_progress", l_on_progress},
    {"cancel", l_cancel}, {"cancelled", l_cancelled},
    {NULL, NULL},
};

void l_open_progress(lua_State *L)
{
    luaL_setfuncs(L, progress_funcs, 0);
}
