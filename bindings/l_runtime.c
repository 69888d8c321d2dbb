#define _POSIX_C_SOURCE 200809L
/* l_runtime.c - the kiln table's process-wide facts and switches: kiln.version,
 * the devices and the default one, the CPU thread count, a monotonic clock,
 * isatty, the quiet flag, kiln.format_bytes, and the precision (process-wide, or
 * scoped to a call: kiln.with_precision). Also kiln.h's kiln_version(). */
#include "l_parts.h"
#include "kiln.h"
#include "../runtime/device.h"
#include "../runtime/precision.h"
#include "../runtime/activation.h"

#include <string.h>
#include <time.h>
#include <unistd.h>

#define KILN_STR_(x) #x
#define KILN_STR(x) KILN_STR_(x)

const char *kiln_version(void)
{
    return KILN_STR(KILN_VERSION_MAJOR) "." KILN_STR(KILN_VERSION_MINOR) "." KILN_STR(KILN_VERSION_PATCH);
}

const char *kiln_version_string(void) { return kiln_version(); }

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

static int l_set_default_device_fn(lua_State *L)
{
    l_set_default_device(L, l_check_device(L, 1));
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

/* kiln.format_bytes(n) -> "1.50 GiB": the runtime's one byte formatter, so scripts
 * print sizes as the memory summary and error messages do. [-0, +1, v] */
static int l_format_bytes(lua_State *L)
{
    l_push_bytes(L, (double)luaL_checknumber(L, 1));
    return 1;
}

/* kiln.precision([name]) -> the precision the default device's networks computed in
 * before the call ("f32", "bf16", "f16", "int8"). A name sets it for every device; "auto"
 * forgets the setting, so each device takes its own default again. */
static int l_precision(lua_State *L)
{
    kiln_precision before = kiln_precision_for(l_default_device(L));
    if (!lua_isnoneornil(L, 1)) {
        const char *name = luaL_checkstring(L, 1);
        int p = kiln_precision_from_name(name);
        if (p >= 0) kiln_precision_set((kiln_precision)p);
        else if (!strcmp(name, "auto")) kiln_precision_unset();
        else return luaL_argerror(L, 1, lua_pushfstring(L, "invalid precision '%s' (expected f32, bf16, f16 or auto)", name));
    }
    lua_pushstring(L, kiln_precision_name(before));
    return 1;
}

/* kiln.activation_dtype([device]) -> "f32", "f16" or "bf16": the dtype the networks
 * keep their activations in on that device (default: the default device) under the
 * precision in effect there; network scripts convert their input to it and their
 * output back. */
static int l_activation_dtype(lua_State *L)
{
    kiln_device *dev = l_opt_device(L, 1);
    lua_pushstring(L, kiln_dtype_name(kiln_activation_dtype(dev)));
    return 1;
}

/* kiln.precision_of([device]) -> the precision the networks on device (default: the
 * default device) compute in: the set one, else the device's own default. */
static int l_precision_of(lua_State *L)
{
    lua_pushstring(L, kiln_precision_name(kiln_precision_for(l_opt_device(L, 1))));
    return 1;
}

/* kiln.with_precision(name, fn, ...) -> fn(...)'s results, computed in precision name
 * ("f32", "bf16", "f16"; "auto" or nil: no override) by the calling thread only (and the
 * CPU pool's workers for its ops): other threads and the process-wide kiln.precision
 * keep theirs, and kiln.precision() / kiln.precision_of() inside fn answer the scoped
 * one. The scope ends when fn returns or raises; an error goes on unchanged. fn may not
 * yield (the scope belongs to the thread, not the coroutine). [-0, +r, e] */
static int l_with_precision(lua_State *L)
{
    int p = KILN_PREC_SCOPE_NONE;
    if (!lua_isnoneornil(L, 1)) {
        const char *name = luaL_checkstring(L, 1);
        p = kiln_precision_from_name(name);
        if (p < 0 && strcmp(name, "auto"))
            return luaL_argerror(L, 1, lua_pushfstring(L, "invalid precision '%s' (expected f32, bf16, f16 or auto)", name));
        if (p < 0) p = KILN_PREC_SCOPE_NONE;
    }
    luaL_checktype(L, 2, LUA_TFUNCTION);
    int tok = kiln_precision_scope_begin(p);
    int st = lua_pcall(L, lua_gettop(L) - 2, LUA_MULTRET, 0);
    kiln_precision_scope_end(tok);
    if (st != LUA_OK) return lua_error(L);
    return lua_gettop(L) - 1;
}

/* kiln.cpu_has_bf16() -> true when the CPU computes bf16 products natively (AVX-512
 * BF16's vdpbf16ps, as the CPU kernels use it): bf16 then halves their cost; without
 * it a bf16 precision runs emulated or as f32, no faster. */
static int l_cpu_has_bf16(lua_State *L)
{
    lua_pushboolean(L, kiln_device_native_bf16(kiln_device_cpu()));
    return 1;
}

static const luaL_Reg runtime_funcs[] = {
    {"time", l_time}, {"isatty", l_isatty}, {"set_quiet", l_set_quiet}, {"quiet", l_quiet},
    {"devices", l_devices}, {"set_default_device", l_set_default_device_fn},
    {"default_device", l_default_device_name}, {"set_threads", l_set_threads}, {"threads", l_threads},
    {"format_bytes", l_format_bytes}, {"precision", l_precision}, {"precision_of", l_precision_of}, {"activation_dtype", l_activation_dtype},
    {"with_precision", l_with_precision}, {"cpu_has_bf16", l_cpu_has_bf16},
    {NULL, NULL},
};

void l_open_runtime(lua_State *L)
{
    lua_pushstring(L, kiln_version());
    lua_setfield(L, -2, "version");
    luaL_setfuncs(L, runtime_funcs, 0);
}
