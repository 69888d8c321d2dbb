/* l_progress.c - progress, cancel and previews from Lua. kiln.progress(step, total [, message])
 * reports a step to the script's handler (kiln.on_progress) and to an embedding host
 * (kiln.h's progress callback), then raises the "cancelled" error if a cancel was
 * requested (kiln.cancel, or the host's kiln_cancel). Loops call it between steps
 * and tiles: that is where a cancel takes effect. kiln.preview_image hands a picture
 * of a sampling in progress to the host's preview callback (kiln.preview). */
#include "l_parts.h"
#include "l_tensor.h"

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

/* kiln.preview_every() -> N | nil [-0, +1, -]: the embedding host's preview interval
 * (kiln_set_preview), nil when no host wants previews: the pipelines then make none
 * for it. */
static int l_preview_every(lua_State *L)
{
    const l_progress_host *h = get_host(L);
    int every = h && h->preview && h->preview_every ? h->preview_every(h->ud) : 0;
    if (every > 0) lua_pushinteger(L, every);
    else lua_pushnil(L);
    return 1;
}

/* kiln.preview_image(step, total, image) [-0, +0, e]: hands the first image of a batch
 * [B, C, H, W] (any device or dtype, values in [0, 1]) to the host's preview callback,
 * on this thread; nothing without one. */
static int l_preview_image(lua_State *L)
{
    lua_Integer step = luaL_checkinteger(L, 1);
    lua_Integer total = luaL_checkinteger(L, 2);
    kiln_tensor *t = l_check_tensor(L, 3);
    const l_progress_host *h = get_host(L);
    if (!h || !h->preview) return 0;
    if (t->ndim != 4 || t->shape[0] < 1 || t->shape[1] < 1 || t->shape[1] > 4 || t->shape[2] > INT_MAX ||
        t->shape[3] > INT_MAX)
        return luaL_argerror(L, 3, "expected an image tensor [B, C, H, W] with C = 1..4");
    kiln_tensor *first, *f, *c;
    L_TRY(L, kiln_tensor_narrow(t, 0, 0, 1, &first));
    kiln_status st = kiln_tensor_to(first, kiln_device_cpu(), KILN_F32, &f);
    kiln_tensor_free(first);
    if (st) return l_raise(L, st);
    st = kiln_tensor_contiguous(f, &c);
    kiln_tensor_free(f);
    if (st) return l_raise(L, st);
    h->preview(h->ud, clamp_int(step), clamp_int(total), kiln_tensor_data(c), (int)c->shape[1], (int)c->shape[2],
               (int)c->shape[3]);
    kiln_tensor_free(c);
    return 0;
}

static const luaL_Reg progress_funcs[] = {
    {"progress", l_progress}, {"on_progress", l_on_progress},
    {"cancel", l_cancel}, {"cancelled", l_cancelled},
    {"preview_every", l_preview_every}, {"preview_image", l_preview_image},
    {NULL, NULL},
};

void l_open_progress(lua_State *L)
{
    luaL_setfuncs(L, progress_funcs, 0);
}
