#define _POSIX_C_SOURCE 200809L
/* l_kiln.c - luaopen_kiln: the `kiln` module table, error raising (typed
 * out-of-memory tables), devices and threads, and the embedded-script searcher. */
#include "l_kiln.h"
#include "l_scripts.h"
#include "../runtime/events.h"
#include "../kernels/cpu/threadpool.h"

#include <string.h>
#include <time.h>
#include <unistd.h>

#define KILN_VERSION "0.1.0"

const char *kiln_version_string(void) { return KILN_VERSION; }

static int err_tostring(lua_State *L)
{
    lua_getfield(L, 1, "message");
    return 1;
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
    luaL_setmetatable(L, KILN_ERROR_MT);
    return lua_error(L);
}

/* kiln.devices() -> {"cpu", "sim", ...} */
static int l_devices(lua_State *L)
{
    int n = kiln_device_count();
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushstring(L, kiln_device_at(i)->name);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_set_default_device(lua_State *L)
{
    kiln_device *d = l_check_device(L, 1);
    lua_pushstring(L, d->name);
    lua_setfield(L, LUA_REGISTRYINDEX, "kiln.default_device");
    return 0;
}

static int l_default_device_name(lua_State *L)
{
    lua_pushstring(L, l_default_device(L)->name);
    return 1;
}

static int l_set_threads(lua_State *L)
{
    lua_Integer n = luaL_checkinteger(L, 1);
    if (n < 0 || n > 256) luaL_argerror(L, 1, "thread count must be 0 (default) to 256");
    kiln_set_threads((int)n);
    return 0;
}

static int l_threads(lua_State *L)
{
    lua_pushinteger(L, kiln_threads());
    return 1;
}

/* The allocators' pressure hook: a full GC may free tensors nobody references. It is
 * skipped while a finalizer runs (never collect from inside __gc). */
static int gc_pressure(void *ctx)
{
    lua_State *L = ctx;
    if (kiln_thread_is_worker()) return 0; /* a runtime copy thread: L is not ours to touch */
    if (lua_gc(L, LUA_GCISRUNNING) == 0) return 0;
    lua_gc(L, LUA_GCCOLLECT);
    return 1;
}

/* kiln.xxx for a shipped script module loads it on first use (kiln.sample ->
 * require "kiln.sample"); a few functions of those modules are reachable directly
 * from the kiln table, as DESIGN.md's contract names them. */
static const struct { const char *name, *module, *field; } lazy[] = {
    {"load_checkpoint", "kiln.checkpoint", "load"},
    {NULL, NULL, NULL},
};

static int kiln_index(lua_State *L)
{
    if (lua_type(L, 2) != LUA_TSTRING) return 0;
    const char *k = lua_tostring(L, 2);
    const char *module = NULL, *field = NULL;
    for (int i = 0; lazy[i].name; i++)
        if (strcmp(k, lazy[i].name) == 0) { module = lazy[i].module; field = lazy[i].field; }
    if (!module) {
        lua_pushfstring(L, "kiln.%s", k);
        if (!kiln_scripts_find(lua_tostring(L, -1))) return 0;
        module = lua_tostring(L, -1);
    }
    lua_getglobal(L, "require");
    lua_pushstring(L, module);
    lua_call(L, 1, 1);
    if (field) {
        lua_getfield(L, -1, field);
        return 1;
    }
    lua_pushvalue(L, -1);
    lua_setfield(L, 1, k); /* cache: later lookups are plain fields */
    return 1;
}

/* kiln.time() -> seconds on a monotonic wall clock (os.clock is CPU time, which
 * counts every thread) */
static int l_time(lua_State *L)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)ts.tv_nsec * 1e-9);
    return 1;
}

/* kiln.isatty("stdout"|"stderr"|"stdin") */
static int l_isatty(lua_State *L)
{
    static const char *const names[] = {"stdin", "stdout", "stderr", NULL};
    int fd = luaL_checkoption(L, 1, "stderr", names);
    lua_pushboolean(L, isatty(fd));
    return 1;
}

/* kiln.set_quiet(flag) / kiln.quiet(): progress displays and chatter off */
static int l_set_quiet(lua_State *L)
{
    lua_pushboolean(L, lua_toboolean(L, 1));
    lua_setfield(L, LUA_REGISTRYINDEX, "kiln.quiet");
    return 0;
}

static int l_quiet(lua_State *L)
{
    lua_getfield(L, LUA_REGISTRYINDEX, "kiln.quiet");
    lua_pushboolean(L, lua_toboolean(L, -1));
    return 1;
}

static const luaL_Reg kiln_funcs[] = {
    {"time", l_time}, {"isatty", l_isatty}, {"set_quiet", l_set_quiet}, {"quiet", l_quiet},
    {"devices", l_devices}, {"set_default_device", l_set_default_device},
    {"default_device", l_default_device_name}, {"set_threads", l_set_threads}, {"threads", l_threads},
    {NULL, NULL},
};

int luaopen_kiln(lua_State *L)
{
    luaL_newmetatable(L, KILN_ERROR_MT);
    lua_pushcfunction(L, err_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pop(L, 1);

    lua_newtable(L);
    lua_pushstring(L, KILN_VERSION);
    lua_setfield(L, -2, "version");
    luaL_setfuncs(L, kiln_funcs, 0);
    l_open_tensor(L);
    l_open_nn(L);
    l_open_io(L);
    l_open_mem(L);
    l_open_progress(L);
    l_open_model(L);
    l_open_trace(L);
    l_open_tile(L);
    l_open_tokenizer(L);

    lua_createtable(L, 0, 1);
    lua_pushcfunction(L, kiln_index);
    lua_setfield(L, -2, "__index");
    lua_setmetatable(L, -2);

    for (int i = 0; i < kiln_device_count(); i++)
        kiln_allocator_set_pressure_hook(kiln_device_at(i)->alloc, gc_pressure, L);
    kiln_scripts_install(L);
    return 1;
}
