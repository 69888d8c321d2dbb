/* l_config.c - the runtime settings from Lua: kiln.configure and l_settings_apply (the
 * settings route of runtime/settings.c plus what belongs to a Lua state: the quiet flag
 * and the default device; kiln_open comes here too), kiln.parse_size (the only size
 * parser), and the allocators' pressure hook: the Lua state's pressure handler, then a
 * GC of that state (the one running on the calling thread). */
#define _POSIX_C_SOURCE 200809L
#include "l_config.h"
#include "l_parts.h"
#include "../runtime/events.h"
#include "../runtime/meta.h"
#include "../runtime/model.h"
#include "../runtime/settings.h"

#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- sizes */

int l_parse_size(const char *s, uint64_t *bytes)
{
    static const char units[] = "KMGT";
    /* by hand rather than strtod: no hex, no inf/nan, no locale's decimal comma */
    while (*s == ' ' || *s == '\t') s++;
    double v = 0;
    int digits = 0;
    for (; *s >= '0' && *s <= '9'; s++, digits++) v = v * 10 + (*s - '0');
    if (*s == '.') {
        double scale = 0.1;
        for (s++; *s >= '0' && *s <= '9'; s++, digits++, scale /= 10) v += (*s - '0') * scale;
    }
    if (digits == 0) return 0;
    while (*s == ' ' || *s == '\t') s++;
    double mult = 1;
    char u = *s >= 'a' && *s <= 'z' ? (char)(*s - 'a' + 'A') : *s;
    const char *p = u != '\0' ? strchr(units, u) : NULL;
    if (p != NULL) {
        for (int k = 0; k <= p - units; k++) mult *= 1024;
        s++;
        if (*s == 'i' || *s == 'I') s++; /* KiB */
    }
    if (*s == 'b' || *s == 'B') s++;
    while (*s == ' ' || *s == '\t') s++;
    if (*s != '\0') return 0;
    v = v * mult + 0.5;
    if (v >= 9.2e18) return 0; /* beyond a Lua integer */
    *bytes = (uint64_t)v;
    return 1;
}

/* The size at idx (bytes as a number, or a size string); raises with what in the
 * message when it is neither. */
static int check_size(lua_State *L, int idx, uint64_t *out)
{
    if (lua_type(L, idx) == LUA_TNUMBER) {
        lua_Number n = lua_tonumber(L, idx);
        if (n >= 0 && n < 9.2e18) {
            *out = (uint64_t)(n + 0.5);
            return 1;
        }
        return 0;
    }
    if (lua_type(L, idx) == LUA_TSTRING) return l_parse_size(lua_tostring(L, idx), out);
    return 0;
}

#define SIZE_EXAMPLES "bytes or a size such as 6G, 512M, 1.5GiB"

/* kiln.parse_size(s) -> bytes: "6G", "512M", "1.5GiB", "100000" (binary units). */
static int l_parse_size_lua(lua_State *L)
{
    uint64_t bytes;
    if (!check_size(L, 1, &bytes))
        return luaL_argerror(L, 1, lua_pushfstring(L, "invalid size '%s' (expected " SIZE_EXAMPLES ")",
                                                   luaL_tolstring(L, 1, NULL)));
    lua_pushinteger(L, (lua_Integer)bytes);
    return 1;
}

/* ---------------------------------------------------------------- configure */

/* ORDER FIELDS: kiln.configure's fields; the runtime's are kiln_setting_name's (settings.h) */
static const char *const fields[] = {"quiet", "trace", "threads", "device", "mode", "budget", "precision", NULL};

static int error_message(lua_State *L)
{
    lua_getfield(L, 1, "message");
    return 1;
}

/* Raises {kind = "usage", field = field, detail = why, message = "field: why"} (a
 * kiln.Error): a bad option value is the caller's mistake, and the kiln program reports
 * such an error on one line, without a traceback. */
static int config_error(lua_State *L, const char *field, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    const char *detail = lua_pushvfstring(L, fmt, ap);
    va_end(ap);
    lua_createtable(L, 0, 4);
    lua_pushliteral(L, "usage");
    lua_setfield(L, -2, "kind");
    lua_pushstring(L, field);
    lua_setfield(L, -2, "field");
    lua_pushstring(L, detail);
    lua_setfield(L, -2, "detail");
    lua_pushfstring(L, "%s: %s", field, detail);
    lua_setfield(L, -2, "message");
    if (luaL_newmetatable(L, KILN_ERROR_MT)) { /* no typed error was raised before */
        lua_pushcfunction(L, error_message);
        lua_setfield(L, -2, "__tostring");
    }
    lua_setmetatable(L, -2);
    return lua_error(L);
}

kiln_status l_settings_apply(lua_State *L, const kiln_settings *settings, int quiet, kiln_setting *failed)
{
    kiln_settings s = *settings;
    int set_default = (s.given & KILN_SETTING_BIT(KILN_SETTING_DEVICE)) != 0;
    if ((s.given & KILN_SETTING_BIT(KILN_SETTING_BUDGET)) && !set_default) s.device = l_default_device(L)->name;
    kiln_status st = kiln_settings_check(&s, failed);
    if (st != KILN_OK) return st;
    if (quiet >= 0) { /* first: what the others do is quiet */
        lua_pushboolean(L, quiet);
        lua_setfield(L, LUA_REGISTRYINDEX, "kiln.quiet");
    }
    st = kiln_settings_apply(&s, failed);
    if (st != KILN_OK) return st;
    if (set_default) l_set_default_device(L, kiln_device_get(s.device));
    return KILN_OK;
}

/* The string field at idx, or a usage error naming it. */
static const char *check_string(lua_State *L, int idx, const char *field, const char *what)
{
    if (lua_type(L, idx) != LUA_TSTRING) config_error(L, field, "expected %s, got %s", what, luaL_typename(L, idx));
    return lua_tostring(L, idx);
}

/* kiln.configure{device=, mode=, budget=, threads=, quiet=, trace=, precision=}: the
 * fields as a kiln_settings, checked and applied by kiln_settings_apply (the route
 * kiln_open takes too). Absent fields are left as they are. budget is bytes or a size
 * string, for the device given (else the default device); mode "auto" leaves the mode
 * to the planner of each run; trace = false stops a running trace; precision "auto"
 * gives each device its own. A bad field raises a usage error naming it (its field
 * and detail as data).                                               [-0, +0, e] */
static int l_configure(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_settop(L, 1);
    /* unknown fields first: a misspelt option must not be silently ignored */
    lua_pushnil(L);
    while (lua_next(L, 1) != 0) {
        lua_pop(L, 1);
        int known = 0;
        if (lua_type(L, -1) == LUA_TSTRING)
            for (int i = 0; fields[i]; i++) known |= strcmp(lua_tostring(L, -1), fields[i]) == 0;
        if (!known) {
            luaL_Buffer b;
            luaL_buffinit(L, &b);
            for (int i = 0; fields[i]; i++) {
                if (i) luaL_addstring(&b, ", ");
                luaL_addstring(&b, fields[i]);
            }
            luaL_pushresult(&b);
            const char *list = lua_tostring(L, -1);
            return config_error(L, luaL_tolstring(L, -2, NULL), "unknown field (expected one of: %s)", list);
        }
    }
    /* 2 quiet, 3 trace, 4 threads, 5 device, 6 mode, 7 budget, 8 precision */
    for (int i = 0; fields[i]; i++) lua_getfield(L, 1, fields[i]);
    const int quiet = 2, trace = 3, threads = 4, device = 5, mode = 6, budget = 7, precision = 8;

    kiln_settings s = {0};
    if (!lua_isnil(L, quiet) && !lua_isboolean(L, quiet))
        config_error(L, "quiet", "expected a boolean, got %s", luaL_typename(L, quiet));
    if (!lua_isnil(L, trace)) {
        if (lua_type(L, trace) != LUA_TSTRING && !(lua_isboolean(L, trace) && !lua_toboolean(L, trace)))
            config_error(L, "trace", "expected a file name or false, got %s", luaL_typename(L, trace));
        s.given |= KILN_SETTING_BIT(KILN_SETTING_TRACE);
        s.trace = lua_tostring(L, trace); /* NULL for false: stop */
    }
    if (!lua_isnil(L, threads)) {
        int ok;
        lua_Integer n = lua_tointegerx(L, threads, &ok);
        if (!ok || lua_type(L, threads) != LUA_TNUMBER)
            config_error(L, "threads", "expected an integer, got %s", luaL_tolstring(L, threads, NULL));
        s.given |= KILN_SETTING_BIT(KILN_SETTING_THREADS);
        s.threads = n < INT_MIN ? INT_MIN : n > INT_MAX ? INT_MAX : (int)n; /* the range is the settings' to check */
    }
    if (!lua_isnil(L, device)) {
        s.given |= KILN_SETTING_BIT(KILN_SETTING_DEVICE);
        s.device = check_string(L, device, "device", "a device name");
    }
    if (!lua_isnil(L, mode)) {
        s.given |= KILN_SETTING_BIT(KILN_SETTING_MODE);
        s.mode = check_string(L, mode, "mode", "a memory mode");
    }
    if (!lua_isnil(L, budget)) {
        if (!check_size(L, budget, &s.budget))
            config_error(L, "budget", "invalid size '%s' (expected " SIZE_EXAMPLES ")", luaL_tolstring(L, budget, NULL));
        s.given |= KILN_SETTING_BIT(KILN_SETTING_BUDGET);
    }
    if (!lua_isnil(L, precision)) {
        s.given |= KILN_SETTING_BIT(KILN_SETTING_PRECISION);
        s.precision = check_string(L, precision, "precision", "a precision");
    }
    kiln_setting failed;
    int q = lua_isnil(L, quiet) ? -1 : lua_toboolean(L, quiet);
    if (l_settings_apply(L, &s, q, &failed) != KILN_OK)
        config_error(L, kiln_setting_name(failed), "%s", kiln_last_error());
    return 0;
}

/* ---------------------------------------------------------------- pressure hook
 * The allocators are the process's; Lua states are not. One hook function serves
 * every state, so installing it again never replaces another state's: it collects
 * the state a kiln.h call has entered on this thread, else the state most recently
 * opened on this thread. Another thread's state is never touched: its objects are
 * not ours to collect while it runs. */

#define MAX_STATES 64 /* open states tracked at once; beyond, a state's GC is not run on pressure */

typedef struct {
    lua_State *L;    /* the main thread of a state that opened kiln */
    uint64_t thread; /* thread_number() of the thread that opened kiln in it */
} tracked_state;

static tracked_state states[MAX_STATES];
static int n_states;
static pthread_mutex_t states_lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local lua_State *entered;

/* A number no other thread ever has (a pthread_t may be reused once its thread ends,
 * and a state may outlive the thread that opened it). */
static uint64_t thread_number(void)
{
    static atomic_uint_fast64_t next = 1;
    static _Thread_local uint64_t mine;
    if (mine == 0) mine = (uint64_t)atomic_fetch_add(&next, 1);
    return mine;
}

lua_State *l_pressure_enter(lua_State *L)
{
    lua_State *previous = entered;
    entered = L;
    return previous;
}

void l_pressure_leave(lua_State *previous)
{
    entered = previous;
}

static lua_State *pressure_target(void)
{
    if (entered) return entered;
    lua_State *L = NULL;
    uint64_t self = thread_number();
    pthread_mutex_lock(&states_lock);
    for (int i = n_states - 1; i >= 0 && !L; i--)
        if (states[i].thread == self) L = states[i].L;
    pthread_mutex_unlock(&states_lock);
    return L;
}

/* The state's pressure handler (kiln._on_pressure): one Lua function, called with the
 * device's name before the GC, that frees what the scripts keep by choice and can
 * rebuild (kiln.encoding_cache's encodings). Lua registers it; C never looks a module
 * up by name. */
#define HANDLER_KEY "kiln.pressure_handler"

static int l_on_pressure(lua_State *L)
{
    if (!lua_isnoneornil(L, 1)) luaL_checktype(L, 1, LUA_TFUNCTION);
    lua_settop(L, 1);
    lua_setfield(L, LUA_REGISTRYINDEX, HANDLER_KEY);
    return 0;
}

/* An error inside the handler is dropped: the allocation that asked goes on to the GC
 * and, failing that, to its own out-of-memory error. */
static void run_handler(lua_State *L, const char *device)
{
    if (!lua_checkstack(L, 3)) return;
    int top = lua_gettop(L);
    if (lua_getfield(L, LUA_REGISTRYINDEX, HANDLER_KEY) == LUA_TFUNCTION) {
        lua_pushstring(L, device);
        (void)lua_pcall(L, 1, 0, 0);
    }
    lua_settop(L, top);
}

/* Before reporting out-of-memory, the handler and then a full GC may free tensors. It
 * is skipped on the runtime's copy threads and while a finalizer runs (never collect
 * from inside __gc). */
static int gc_pressure(void *ctx)
{
    kiln_device *dev = ctx;
    if (kiln_thread_is_worker()) return 0;
    lua_State *L = pressure_target();
    if (!L) return 0;
    if (lua_gc(L, LUA_GCISRUNNING) == 0) {
#if defined(LUA_VERSION_RELEASE_NUM) && LUA_VERSION_RELEASE_NUM >= 50404
        /* a dry run holds the collector (kiln.dry_run) and collects under pressure as
         * the real run does; inside a finalizer this Lua's lua_gc does nothing */
        if (!kiln_meta_target()) return 0;
#else
        return 0;
#endif
    }
    if (dev) run_handler(L, dev->name);
    lua_gc(L, LUA_GCCOLLECT);
    return 1;
}

/* __gc of the state's registry sentinel: the state is closing. */
static int forget_state(lua_State *L)
{
    lua_State *state = *(lua_State **)lua_touserdata(L, 1);
    pthread_mutex_lock(&states_lock);
    for (int i = 0; i < n_states; i++)
        if (states[i].L == state) {
            memmove(&states[i], &states[i + 1], (size_t)(n_states - i - 1) * sizeof states[0]);
            n_states--;
            break;
        }
    pthread_mutex_unlock(&states_lock);
    if (entered == state) entered = NULL;
    return 0;
}

#define SENTINEL_KEY "kiln.pressure_sentinel"

static void track_state(lua_State *L)
{
    if (lua_getfield(L, LUA_REGISTRYINDEX, SENTINEL_KEY) != LUA_TNIL) { /* kiln opened twice */
        lua_pop(L, 1);
        return;
    }
    lua_pop(L, 1);
    lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_MAINTHREAD);
    lua_State *state = lua_tothread(L, -1);
    lua_pop(L, 1);
    *(lua_State **)lua_newuserdatauv(L, sizeof state, 0) = state;
    lua_createtable(L, 0, 1);
    lua_pushcfunction(L, forget_state);
    lua_setfield(L, -2, "__gc");
    lua_setmetatable(L, -2);
    lua_setfield(L, LUA_REGISTRYINDEX, SENTINEL_KEY);

    pthread_mutex_lock(&states_lock);
    if (n_states < MAX_STATES) states[n_states++] = (tracked_state){state, thread_number()};
    pthread_mutex_unlock(&states_lock);
    for (int i = 0; i < kiln_device_count(); i++)
        kiln_allocator_set_pressure_hook(kiln_device_at(i)->alloc, gc_pressure, kiln_device_at(i));
}

/* ---------------------------------------------------------------- open */

void l_open_config(lua_State *L)
{
    lua_pushcfunction(L, l_configure);
    lua_setfield(L, -2, "configure");
    lua_pushcfunction(L, l_parse_size_lua);
    lua_setfield(L, -2, "parse_size");
    lua_pushcfunction(L, l_on_pressure);
    lua_setfield(L, -2, "_on_pressure");
    track_state(L);
}
