/* embed.c - kiln.h, the C API, over a Lua state: contexts, running scripts, calling
 * Lua functions with images in and out, progress / log / cancel, memory statistics.
 * A host enters Lua only through lua_pcall (no path here can reach lua_atpanic);
 * a cancel is a flag polled by a count hook and by kiln.progress. */
#include "l_tensor.h"
#include "l_config.h"
#include "l_parts.h"
#include "l_scripts.h"
#include "../runtime/events.h"
#include "../runtime/png_io.h"
#include "../runtime/settings.h"
#include "../runtime/suspend.h"
#include "../runtime/tunables.h"
#include "../kernels/backends.h"
#include "kiln.h"

#include <lualib.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Lua instructions between two looks at the cancel flag: a few microseconds. */
#define CANCEL_HOOK_COUNT 4096
/* Largest image side accepted from a host (and returned to one). */
#define MAX_SIDE 65536

struct kiln_ctx {
    lua_State *L;
    atomic_int cancel;
    int busy;                 /* inside kiln_run_* / kiln_call: no re-entry from callbacks */
    kiln_progress_fn progress;
    void *progress_user;
    kiln_preview_fn preview;  /* kiln_set_preview: every preview_every sampler steps */
    void *preview_user;
    int preview_every;
    kiln_log_fn log;
    void *log_user;
    int log_level;
    int warn_off;             /* Lua's "@off" control message */
    char warn_buf[512];       /* a warning arriving in pieces */
    l_progress_host host;
    char device[16];          /* the config's device: kiln_memory_stats(ctx, NULL) */
    char *message;            /* last failure, malloc'd ("" when NULL) */
    const char *field;        /* kiln_last_config_field: the config field it was about */
    char *detail;             /* and its reason alone */
    kiln_oom_info oom;        /* kiln_memory_last_oom: the last failure's, when has_oom */
    int has_oom;
    char *traceback;
    char *summary;
    int trace_started;        /* config.trace: kiln_close stops it */
    kiln_gate *gate;          /* kiln_suspend / kiln_resume meet the running call here */
};

/* Messages of calls made without a context (kiln_open's failures), and the config
 * field a refusal was about (kiln_last_config_field). */
static _Thread_local char thread_message[1024];
static _Thread_local const char *thread_field;
static _Thread_local char thread_detail[1024];

/* ---------------------------------------------------------------- messages */

static void set_str(char **dst, const char *s)
{
    free(*dst);
    *dst = NULL;
    if (s == NULL || *s == '\0') return;
    size_t n = strlen(s);
    *dst = malloc(n + 1);
    if (*dst) memcpy(*dst, s, n + 1);
}

/* Sets the message of ctx (or of the thread when ctx is NULL); returns code. */
static kiln_status fail(kiln_ctx *ctx, kiln_status code, const char *fmt, ...) KILN_PRINTF(3, 4);
static kiln_status fail(kiln_ctx *ctx, kiln_status code, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (ctx) {
        set_str(&ctx->message, buf);
        ctx->field = NULL;
        ctx->has_oom = 0;
    } else {
        snprintf(thread_message, sizeof thread_message, "%s", buf);
        thread_field = NULL;
    }
    return code;
}

/* A refused setting: the message "what: config.FIELD: detail", the field and the
 * detail kept apart as data. */
static kiln_status fail_field(kiln_ctx *ctx, kiln_status code, const char *what, const char *field,
                              const char *detail)
{
    fail(ctx, code, "%s: config.%s: %s", what, field, detail);
    if (ctx) {
        ctx->field = field;
        set_str(&ctx->detail, detail);
    } else {
        thread_field = field;
        snprintf(thread_detail, sizeof thread_detail, "%s", detail);
    }
    return code;
}

/* A runtime failure (kiln_last_error) with a prefix. */
static kiln_status fail_runtime(kiln_ctx *ctx, kiln_status code, const char *what)
{
    const char *m = kiln_last_error();
    return fail(ctx, code, "%s: %s", what, m && *m ? m : kiln_status_name(code));
}

const char *kiln_last_message(const kiln_ctx *ctx)
{
    if (!ctx) return thread_message;
    return ctx->message ? ctx->message : "";
}

const char *kiln_last_traceback(const kiln_ctx *ctx)
{
    return ctx && ctx->traceback ? ctx->traceback : "";
}

const char *kiln_last_config_field(const kiln_ctx *ctx, const char **detail)
{
    const char *field = ctx ? ctx->field : thread_field;
    if (detail) *detail = !field ? "" : ctx ? (ctx->detail ? ctx->detail : "") : thread_detail;
    return field;
}

const char *kiln_status_string(kiln_status status)
{
    if ((int)status == KILN_ERR_SCRIPT) return "script";
    if ((int)status < 0 || status >= KILN_STATUS_COUNT) return "unknown status";
    return kiln_status_name(status);
}

/* ---------------------------------------------------------------- logging */

static void emit(kiln_ctx *ctx, kiln_log_level level, const char *msg)
{
    if ((int)level > ctx->log_level) return;
    if (ctx->log) {
        ctx->log(ctx->log_user, level, msg);
        return;
    }
    static const char *const prefix[] = {"", "error: ", "warning: ", "", ""};
    fprintf(stderr, "kiln: %s%s\n", prefix[level >= 0 && level <= KILN_LOG_DEBUG ? level : 0], msg);
    fflush(stderr);
}

static kiln_ctx *ctx_of(lua_State *L)
{
    return *(kiln_ctx **)lua_getextraspace(L);
}

/* print(...) of a script: one INFO message, the values tab-separated. */
static int l_print(lua_State *L)
{
    kiln_ctx *ctx = ctx_of(L);
    int n = lua_gettop(L);
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    for (int i = 1; i <= n; i++) {
        luaL_tolstring(L, i, NULL);
        if (i > 1) luaL_addchar(&b, '\t');
        luaL_addvalue(&b);
    }
    luaL_pushresult(&b);
    emit(ctx, KILN_LOG_INFO, lua_tostring(L, -1));
    return 0;
}

/* os.exit([code]) of a script: ends the script (an error the call maps back), never
 * the host process. */
static int l_exit(lua_State *L)
{
    int code;
    if (lua_isboolean(L, 1)) code = lua_toboolean(L, 1) ? 0 : 1;
    else code = (int)luaL_optinteger(L, 1, 0);
    lua_createtable(L, 0, 3);
    lua_pushstring(L, "exit");
    lua_setfield(L, -2, "kind");
    lua_pushinteger(L, code);
    lua_setfield(L, -2, "code");
    lua_pushfstring(L, "the script called os.exit(%d)", code);
    lua_setfield(L, -2, "message");
    return lua_error(L);
}

/* Lua's warnings (warn(), errors in __gc): WARN messages; pieces are joined. */
static void warnf(void *ud, const char *msg, int tocont)
{
    kiln_ctx *ctx = ud;
    size_t used = strlen(ctx->warn_buf);
    if (used == 0 && !tocont && msg[0] == '@') { /* control message */
        if (strcmp(msg, "@off") == 0) ctx->warn_off = 1;
        else if (strcmp(msg, "@on") == 0) ctx->warn_off = 0;
        return;
    }
    snprintf(ctx->warn_buf + used, sizeof ctx->warn_buf - used, "%s", msg);
    if (tocont) return;
    if (!ctx->warn_off) emit(ctx, KILN_LOG_WARN, ctx->warn_buf);
    ctx->warn_buf[0] = '\0';
}

/* ---------------------------------------------------------------- progress, cancel */

static void host_progress(void *ud, int step, int total, const char *message)
{
    kiln_ctx *ctx = ud;
    if (ctx->progress) ctx->progress(ctx->progress_user, step, total, message);
}

/* kiln.preview_image's way to the host (defined with the image conversions below) */
static void host_preview(void *ud, int step, int total, const float *planar, int c, int h, int w);

static int host_preview_every(void *ud)
{
    kiln_ctx *ctx = ud;
    return ctx->preview ? ctx->preview_every : 0;
}

static int host_cancelled(void *ud)
{
    return atomic_load(&((kiln_ctx *)ud)->cancel);
}

static void host_cancel(void *ud, int on)
{
    atomic_store(&((kiln_ctx *)ud)->cancel, on ? 1 : 0);
}

static void cancel_hook(lua_State *L, lua_Debug *ar)
{
    (void)ar;
    kiln_ctx *ctx = ctx_of(L);
    if (ctx && atomic_load(&ctx->cancel)) l_raise_cancelled(L, NULL);
}

void kiln_cancel(kiln_ctx *ctx)
{
    if (!ctx) return;
    atomic_store(&ctx->cancel, 1);
    kiln_gate_wake(ctx->gate); /* a parked call wakes into the cancel */
}

/* The parked call's stop test (under the gate's lock: an atomic load only). */
static int gate_stop(void *ud)
{
    return atomic_load(&((kiln_ctx *)ud)->cancel);
}

kiln_status kiln_suspend(kiln_ctx *ctx)
{
    if (!ctx) return fail(NULL, KILN_ERR_ARG, "kiln_suspend: the context is NULL");
    kiln_status st = kiln_gate_suspend(ctx->gate);
    /* the message goes to the caller's thread: ctx's belongs to the running call */
    if (st) fail(NULL, st, "%s", kiln_last_error());
    return st;
}

kiln_status kiln_resume(kiln_ctx *ctx)
{
    if (!ctx) return fail(NULL, KILN_ERR_ARG, "kiln_resume: the context is NULL");
    kiln_status st = kiln_gate_resume(ctx->gate);
    if (st) fail(NULL, st, "%s", kiln_last_error());
    return st;
}

kiln_status kiln_suspend_info(kiln_ctx *ctx, kiln_suspend_stats *out)
{
    if (!ctx || !out) return fail(NULL, KILN_ERR_ARG, "kiln_suspend_info: %s is NULL", ctx ? "out" : "the context");
    kiln_gate_stats s = kiln_gate_get_stats(ctx->gate);
    out->parks = s.parks;
    out->bytes = s.bytes;
    out->park_seconds = s.park_seconds;
    out->resume_seconds = s.resume_seconds;
    out->parked = kiln_gate_parked(ctx->gate);
    return KILN_OK;
}

void kiln_set_progress(kiln_ctx *ctx, kiln_progress_fn fn, void *user)
{
    if (!ctx) return;
    ctx->progress = fn;
    ctx->progress_user = user;
}

void kiln_set_preview(kiln_ctx *ctx, kiln_preview_fn fn, void *user, int every)
{
    if (!ctx) return;
    ctx->preview = fn;
    ctx->preview_user = user;
    ctx->preview_every = every > 0 ? every : 1;
}

void kiln_set_log(kiln_ctx *ctx, kiln_log_fn fn, void *user)
{
    if (!ctx) return;
    ctx->log = fn;
    ctx->log_user = user;
}

/* ---------------------------------------------------------------- protected runs */

typedef struct {
    kiln_ctx *ctx;
    kiln_status status;    /* a failure of the API's own, set before raising */
    int load_status;       /* luaL_load* result when loading failed */
    int exit_ok;           /* os.exit(0) is a normal end (kiln_run_*) */
    const kiln_config *config;
    const char *path, *code;
    int argc;
    const char *const *argv;
    const char *function;
    const kiln_image *images;
    int n_images;
    const char *const *args;
    int n_args;
    kiln_image *out;
    kiln_image result;
    const char *field;     /* kiln_open: the config field refused */
    char detail[512];      /* and why */
} job;

/* Traceback handler: records the traceback, keeps the error value (a typed table
 * stays a table). */
static int msghandler(lua_State *L)
{
    kiln_ctx *ctx = ctx_of(L);
    const char *msg = lua_tostring(L, 1);
    if (msg == NULL && lua_type(L, 1) == LUA_TTABLE && lua_getfield(L, 1, "message") == LUA_TSTRING)
        msg = lua_tostring(L, -1);
    if (msg == NULL) msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    luaL_traceback(L, L, msg, 1);
    set_str(&ctx->traceback, lua_tostring(L, -1));
    lua_settop(L, 1);
    return 1;
}

/* The field of an error table, without metamethods. */
static const char *raw_string_field(lua_State *L, int idx, const char *key)
{
    lua_pushstring(L, key);
    lua_rawget(L, idx);
    const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
    lua_pop(L, 1); /* the string stays referenced by the table */
    return s;
}

/* The numeric field of an error table, without metamethods. */
static uint64_t raw_size_field(lua_State *L, int idx, const char *key)
{
    lua_pushstring(L, key);
    lua_rawget(L, idx);
    lua_Integer v = lua_isinteger(L, -1) ? lua_tointeger(L, -1) : 0;
    lua_pop(L, 1);
    return v > 0 ? (uint64_t)v : 0;
}

/* kiln_memory_last_oom's record of the OOM error at idx: the typed table's fields
 * (device, requested, free, budget); a host allocation of the API's own (no table) is
 * "host" with nothing known. */
static void record_oom(kiln_ctx *ctx, lua_State *L, int idx)
{
    memset(&ctx->oom, 0, sizeof ctx->oom);
    const char *device = lua_type(L, idx) == LUA_TTABLE ? raw_string_field(L, idx, "device") : NULL;
    snprintf(ctx->oom.device, sizeof ctx->oom.device, "%s", device ? device : "host");
    if (device) {
        ctx->oom.requested = raw_size_field(L, idx, "requested");
        ctx->oom.free = raw_size_field(L, idx, "free");
        ctx->oom.budget = raw_size_field(L, idx, "budget");
    }
    ctx->has_oom = 1;
}

/* Turns the error value on top of the stack (from a lua_pcall that returned rc) into
 * a status and message. */
static kiln_status error_status(job *j, int rc)
{
    kiln_ctx *ctx = j->ctx;
    lua_State *L = ctx->L;
    int top = lua_gettop(L);
    if (rc == LUA_ERRMEM) {
        fail(ctx, KILN_ERR_OOM, "out of memory (Lua)");
        ctx->oom = (kiln_oom_info){.device = "lua"};
        ctx->has_oom = 1;
        return KILN_ERR_OOM;
    }
    const char *kind = NULL, *msg = NULL;
    if (lua_type(L, top) == LUA_TTABLE) {
        kind = raw_string_field(L, top, "kind");
        msg = raw_string_field(L, top, "message");
    } else if (lua_type(L, top) == LUA_TSTRING || lua_type(L, top) == LUA_TNUMBER) {
        msg = lua_tostring(L, top);
    }
    if (msg == NULL) msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, top));
    if (kind && strcmp(kind, "exit") == 0) {
        lua_pushstring(L, "code");
        lua_rawget(L, top);
        lua_Integer code = lua_tointeger(L, -1);
        if (code == 0 && j->exit_ok) {
            set_str(&ctx->traceback, NULL);
            return KILN_OK;
        }
        return fail(ctx, KILN_ERR_SCRIPT, "%s", msg);
    }
    kiln_status st;
    if ((kind && strcmp(kind, "cancelled") == 0) || atomic_load(&ctx->cancel)) st = KILN_ERR_CANCELLED;
    else if (kind && strcmp(kind, "oom") == 0) st = KILN_ERR_OOM;
    else if (j->load_status == LUA_ERRFILE) st = KILN_ERR_IO;
    else if (j->status != KILN_OK) st = j->status;
    else st = KILN_ERR_SCRIPT;
    if (j->load_status != LUA_OK) set_str(&ctx->traceback, NULL); /* nothing ran */
    fail(ctx, st, "%s", msg);
    if (st == KILN_ERR_OOM) record_oom(ctx, L, top);
    return st;
}

/* Runs fn(job) under lua_pcall with the traceback handler and the cancel hook; then
 * collects the garbage, which frees the tensors the run left unreferenced. */
static kiln_status protected_run(job *j, lua_CFunction fn, const char *what)
{
    kiln_ctx *ctx = j->ctx;
    if (!ctx) return fail(NULL, KILN_ERR_ARG, "%s: the context is NULL", what);
    if (ctx->busy)
        return fail(ctx, KILN_ERR_STATE, "%s: the context is busy (called from one of its callbacks?)", what);
    lua_State *L = ctx->L;
    ctx->busy = 1;
    set_str(&ctx->message, NULL);
    set_str(&ctx->traceback, NULL);
    atomic_store(&ctx->cancel, 0);
    /* under memory pressure, this thread collects this state's garbage */
    lua_State *outer = l_pressure_enter(L);
    kiln_gate_enter(ctx->gate);
    /* a call starts with the budgets as they are: no grace left from a live change */
    for (int i = 0; i < kiln_device_count(); i++) kiln_allocator_end_grace(kiln_device_at(i)->alloc);

    lua_settop(L, 0);
    lua_pushcfunction(L, msghandler);
    lua_pushcfunction(L, fn);
    lua_pushlightuserdata(L, j);
    lua_sethook(L, cancel_hook, LUA_MASKCOUNT, CANCEL_HOOK_COUNT);
    int rc = lua_pcall(L, 1, 0, 1);
    lua_sethook(L, NULL, 0, 0);
    kiln_status st = rc == LUA_OK ? KILN_OK : error_status(j, rc);
    if (st != KILN_OK && ctx->traceback) emit(ctx, KILN_LOG_DEBUG, ctx->traceback);
    lua_settop(L, 0);
    lua_gc(L, LUA_GCCOLLECT);

    kiln_gate_leave(ctx->gate);
    l_pressure_leave(outer);
    ctx->busy = 0;
    return st;
}

/* ---------------------------------------------------------------- open, close */

/* kiln_config's name of each setting (ORDER SETTINGS, settings.h), for messages and
 * kiln_last_config_field */
static const char *const config_fields[KILN_SETTING_COUNT] = {
    "", "trace", "threads", "device", "mode", "memory_budget", "precision",
};

/* The runtime options of the config as kiln_settings, applied by the settings route
 * kiln.configure takes too; a refusal names the config field (j->field). */
static void configure(lua_State *L, job *j)
{
    const kiln_config *cfg = j->config;
    kiln_settings s = {.given = KILN_SETTING_BIT(KILN_SETTING_DEVICE), .device = j->ctx->device};
    if (cfg->trace) {
        s.given |= KILN_SETTING_BIT(KILN_SETTING_TRACE);
        s.trace = cfg->trace;
    }
    if (cfg->threads != 0) { /* 0: leave as is */
        s.given |= KILN_SETTING_BIT(KILN_SETTING_THREADS);
        s.threads = cfg->threads;
    }
    if (cfg->mode) {
        s.given |= KILN_SETTING_BIT(KILN_SETTING_MODE);
        s.mode = cfg->mode;
    }
    if (cfg->memory_budget) {
        s.given |= KILN_SETTING_BIT(KILN_SETTING_BUDGET);
        s.budget = cfg->memory_budget;
    }
    if (cfg->precision) {
        s.given |= KILN_SETTING_BIT(KILN_SETTING_PRECISION);
        s.precision = cfg->precision;
    }
    kiln_setting failed = KILN_SETTING_NONE;
    /* no progress bars on the host's stderr unless it asks: progress goes to the callback */
    if (l_settings_apply(L, &s, !cfg->verbose, &failed) == KILN_OK) {
        j->ctx->trace_started = cfg->trace != NULL;
        return;
    }
    j->status = KILN_ERR_ARG;
    j->field = config_fields[failed];
    snprintf(j->detail, sizeof j->detail, "%s", kiln_last_error());
    luaL_error(L, "kiln_open: config.%s: %s", j->field, j->detail);
}

static int open_state(lua_State *L)
{
    job *j = lua_touserdata(L, 1);
    const kiln_config *cfg = j->config;
    if (cfg->ignore_env) {
        lua_pushboolean(L, 1);
        lua_setfield(L, LUA_REGISTRYINDEX, "LUA_NOENV");
        kiln_tunables_use_env(0);
    }
    luaL_openlibs(L);
    kiln_scripts_install(L);
    if (cfg->script_path) kiln_scripts_set_path(L, cfg->script_path);
    else if (cfg->source_tree) kiln_scripts_prefer_source_tree(L);
    luaL_requiref(L, "kiln", luaopen_kiln, 1);
    lua_pop(L, 1);
    if (!cfg->print_stdout) lua_register(L, "print", l_print);
    if (!cfg->real_exit) {
        lua_getglobal(L, "os");
        lua_pushcfunction(L, l_exit);
        lua_setfield(L, -2, "exit");
        lua_pop(L, 1);
    }
    l_progress_set_host(L, &j->ctx->host);
    l_suspend_set_gate(L, j->ctx->gate, gate_stop, j->ctx);
    configure(L, j);
    return 0;
}

static void free_ctx(kiln_ctx *ctx)
{
    free(ctx->message);
    free(ctx->detail);
    free(ctx->traceback);
    free(ctx->summary);
    kiln_gate_free(ctx->gate);
    free(ctx);
}

/* The host's header against this library: the same major version, and while it is 0
 * the same minor (0.x minors change the ABI); from 1.0 a newer minor library serves an
 * older host. */
static kiln_status check_version(int host)
{
    int lib = KILN_VERSION_NUMBER;
    int hmajor = host / 10000, hminor = host / 100 % 100, lmajor = lib / 10000, lminor = lib / 100 % 100;
    if (host > 0 && hmajor == lmajor && (lmajor == 0 ? hminor == lminor : hminor <= lminor)) return KILN_OK;
    return fail(NULL, KILN_ERR_UNSUPPORTED,
                "kiln_open: this program was built with kiln.h %d.%d.%d, but the kiln library it loaded is %s "
                "(libkiln.so.%d): rebuild the program against the installed kiln.h",
                hmajor, hminor, host % 100, kiln_version(), lmajor);
}

kiln_status kiln_open_v(int version, const kiln_config *config, kiln_ctx **out)
{
    if (!out) return fail(NULL, KILN_ERR_ARG, "kiln_open: out is NULL");
    *out = NULL;
    thread_message[0] = '\0';
    thread_field = NULL;
    if (check_version(version) != KILN_OK) return KILN_ERR_UNSUPPORTED;
    /* the fields the host's header has; the others keep their zero defaults. size 0
     * is the host header's own size: while 0.x versions must match, this header's */
    kiln_config full = {.size = sizeof full};
    if (config) {
        size_t size = config->size ? config->size : sizeof full;
        if (size > sizeof full)
            return fail(NULL, KILN_ERR_UNSUPPORTED,
                        "kiln_open: config.size is %zu bytes, larger than this library's kiln_config (%zu bytes, "
                        "kiln %s): the program was built with a newer kiln.h",
                        size, sizeof full, kiln_version());
        if (size < offsetof(kiln_config, device) + sizeof full.device)
            return fail(NULL, KILN_ERR_ARG, "kiln_open: config.size %zu is too small (start from KILN_CONFIG_INIT)",
                        size);
        memcpy(&full, config, size);
        full.size = sizeof full;
    }
    const kiln_config *cfg = &full;
    if (cfg->log_level < KILN_LOG_OFF || cfg->log_level > KILN_LOG_DEBUG)
        return fail(NULL, KILN_ERR_ARG, "kiln_open: config.log_level %d out of range (%d to %d)", (int)cfg->log_level,
                    KILN_LOG_OFF, KILN_LOG_DEBUG);
    const char *device = cfg->device ? cfg->device : "cpu";
    if (strlen(device) >= sizeof ((kiln_ctx *)0)->device) {
        char detail[96];
        snprintf(detail, sizeof detail, "unknown device '%.40s'", device);
        return fail_field(NULL, KILN_ERR_ARG, "kiln_open", "device", detail);
    }

    kiln_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return fail(NULL, KILN_ERR_OOM, "kiln_open: out of memory");
    atomic_init(&ctx->cancel, 0);
    ctx->log = cfg->log;
    ctx->log_user = cfg->log_user;
    ctx->log_level = cfg->log_level == KILN_LOG_DEFAULT ? KILN_LOG_INFO : cfg->log_level;
    ctx->host = (l_progress_host){host_progress, host_cancelled, host_cancel, ctx, host_preview, host_preview_every};
    ctx->gate = kiln_gate_new();
    if (!ctx->gate) {
        free_ctx(ctx);
        return fail(NULL, KILN_ERR_OOM, "kiln_open: out of memory");
    }
    snprintf(ctx->device, sizeof ctx->device, "%s", device);
    ctx->L = luaL_newstate();
    if (!ctx->L) {
        free_ctx(ctx);
        return fail(NULL, KILN_ERR_OOM, "kiln_open: cannot create a Lua state: out of memory");
    }
    *(kiln_ctx **)lua_getextraspace(ctx->L) = ctx;
    if (!cfg->lua_warnings) lua_setwarnf(ctx->L, warnf, ctx);
    lua_gc(ctx->L, LUA_GCSTOP); /* while building the state, as lua.c */

    job j = {.ctx = ctx, .config = cfg};
    kiln_status st = protected_run(&j, open_state, "kiln_open");
    if (st != KILN_OK) {
        if (j.field) fail_field(NULL, st, "kiln_open", j.field, j.detail);
        else fail(NULL, st, "%s", kiln_last_message(ctx));
        lua_close(ctx->L);
        free_ctx(ctx);
        return st;
    }
    lua_gc(ctx->L, LUA_GCRESTART);
    *out = ctx;
    return KILN_OK;
}

/* kiln.trace.stop(): writes the trace file config.trace started (the module's own
 * table: a script may have replaced the global). */
static int stop_trace(lua_State *L)
{
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    lua_getfield(L, -1, "kiln");
    lua_getfield(L, -1, "trace");
    lua_getfield(L, -1, "stop");
    lua_call(L, 0, 0);
    return 0;
}

void kiln_close(kiln_ctx *ctx)
{
    if (!ctx) return;
    if (ctx->busy) { /* from a callback: the running call still needs the state */
        emit(ctx, KILN_LOG_ERROR, "kiln_close called from a callback: ignored");
        return;
    }
    if (ctx->trace_started) {
        lua_State *L = ctx->L;
        lua_settop(L, 0);
        lua_pushcfunction(L, stop_trace);
        if (lua_pcall(L, 0, 0, 0) != LUA_OK) {
            lua_pushfstring(L, "config.trace: %s", luaL_tolstring(L, -1, NULL));
            emit(ctx, KILN_LOG_ERROR, lua_tostring(L, -1));
        }
    }
    lua_close(ctx->L); /* finalizers free every tensor and model */
    for (int i = 0; i < kiln_device_count(); i++) kiln_device_empty_cache(kiln_device_at(i));
    free_ctx(ctx);
}

kiln_status kiln_parse_size(const char *text, uint64_t *bytes)
{
    if (!text || !bytes) return fail(NULL, KILN_ERR_ARG, "kiln_parse_size: %s is NULL", text ? "bytes" : "text");
    if (!l_parse_size(text, bytes))
        return fail(NULL, KILN_ERR_ARG, "invalid size '%.64s' (expected bytes or a size such as 6G, 512M, 1.5GiB)",
                    text);
    return KILN_OK;
}

struct lua_State *kiln_lua_state(kiln_ctx *ctx)
{
    return ctx ? ctx->L : NULL;
}

/* ---------------------------------------------------------------- running code */

/* arg[0] = path, arg[1..argc] = argv, as the kiln program builds it. */
static int run_file(lua_State *L)
{
    job *j = lua_touserdata(L, 1);
    luaL_checkstack(L, j->argc + 8, "too many arguments to the script");
    lua_createtable(L, j->argc, 1);
    lua_pushstring(L, j->path);
    lua_rawseti(L, -2, 0);
    for (int i = 0; i < j->argc; i++) {
        lua_pushstring(L, j->argv[i] ? j->argv[i] : "");
        lua_rawseti(L, -2, i + 1);
    }
    lua_setglobal(L, "arg");
    j->load_status = luaL_loadfilex(L, j->path, NULL);
    if (j->load_status != LUA_OK) return lua_error(L);
    for (int i = 0; i < j->argc; i++) lua_pushstring(L, j->argv[i] ? j->argv[i] : "");
    lua_call(L, j->argc, 0);
    return 0;
}

static int run_string(lua_State *L)
{
    job *j = lua_touserdata(L, 1);
    j->load_status = luaL_loadbuffer(L, j->code, strlen(j->code), j->code);
    if (j->load_status != LUA_OK) return lua_error(L);
    lua_call(L, 0, 0);
    return 0;
}

kiln_status kiln_run_file(kiln_ctx *ctx, const char *path, int argc, const char *const *argv)
{
    if (ctx && !path) return fail(ctx, KILN_ERR_ARG, "kiln_run_file: path is NULL");
    if (ctx && (argc < 0 || (argc > 0 && !argv)))
        return fail(ctx, KILN_ERR_ARG, "kiln_run_file: argc %d with argv %s", argc, argv ? "set" : "NULL");
    job j = {.ctx = ctx, .path = path, .argc = argc, .argv = argv, .exit_ok = 1};
    return protected_run(&j, run_file, "kiln_run_file");
}

kiln_status kiln_run_string(kiln_ctx *ctx, const char *code)
{
    if (ctx && !code) return fail(ctx, KILN_ERR_ARG, "kiln_run_string: code is NULL");
    job j = {.ctx = ctx, .code = code, .exit_ok = 1};
    return protected_run(&j, run_string, "kiln_run_string");
}

/* ---------------------------------------------------------------- images */

static size_t pixel_bytes(kiln_pixel_format f)
{
    return f == KILN_PIXEL_F32 ? sizeof(float) : 1;
}

/* Checks a host image; what names it in the message ("kiln_call: image 2"). */
static kiln_status check_image(kiln_ctx *ctx, const kiln_image *im, const char *what)
{
    if (!im) return fail(ctx, KILN_ERR_ARG, "%s is NULL", what);
    if (im->format != KILN_PIXEL_U8 && im->format != KILN_PIXEL_F32)
        return fail(ctx, KILN_ERR_ARG, "%s: format %d is not KILN_PIXEL_U8 or KILN_PIXEL_F32", what, (int)im->format);
    if (im->channels < 1 || im->channels > 4)
        return fail(ctx, KILN_ERR_ARG, "%s: %d channels (expected 1 to 4)", what, im->channels);
    if (im->width < 1 || im->height < 1 || im->width > MAX_SIDE || im->height > MAX_SIDE)
        return fail(ctx, KILN_ERR_ARG, "%s: size %dx%d (expected 1 to %d pixels a side)", what, im->width, im->height,
                    MAX_SIDE);
    size_t row = (size_t)im->width * (size_t)im->channels * pixel_bytes(im->format);
    if (im->stride != 0 && im->stride < row)
        return fail(ctx, KILN_ERR_ARG, "%s: stride %zu is less than a row (%zu bytes)", what, im->stride, row);
    if (!im->data) return fail(ctx, KILN_ERR_ARG, "%s: data is NULL", what);
    return KILN_OK;
}

/* Interleaved host pixels -> planar floats [C, H, W]. */
static void image_to_planar(const kiln_image *im, float *dst)
{
    size_t c = (size_t)im->channels, w = (size_t)im->width, h = (size_t)im->height;
    size_t ps = pixel_bytes(im->format);
    size_t stride = im->stride ? im->stride : w * c * ps;
    for (size_t y = 0; y < h; y++) {
        const unsigned char *row = (const unsigned char *)im->data + y * stride;
        for (size_t x = 0; x < w; x++)
            for (size_t k = 0; k < c; k++) {
                float v;
                if (im->format == KILN_PIXEL_U8) v = row[x * c + k] / 255.0f;
                else memcpy(&v, row + (x * c + k) * sizeof v, sizeof v); /* rows may be unaligned */
                dst[k * h * w + y * w + x] = v;
            }
    }
}

/* Planar floats [C, H, W] -> a new packed image in format (data malloc'd). */
static int planar_to_image(const float *src, int c, int h, int w, kiln_pixel_format format, kiln_image *out)
{
    size_t n = (size_t)c * (size_t)h * (size_t)w;
    unsigned char *data = malloc(n * pixel_bytes(format));
    if (!data) return 0;
    size_t plane = (size_t)h * (size_t)w;
    for (size_t i = 0; i < plane; i++)
        for (size_t k = 0; k < (size_t)c; k++) {
            float v = src[k * plane + i];
            if (format == KILN_PIXEL_F32) {
                memcpy(data + (i * (size_t)c + k) * sizeof v, &v, sizeof v);
            } else {
                v = v > 0 ? (v < 1 ? v : 1) : 0; /* NaN -> 0 */
                data[i * (size_t)c + k] = (unsigned char)(v * 255.0f + 0.5f);
            }
        }
    *out = (kiln_image){w, h, c, format, (size_t)w * (size_t)c * pixel_bytes(format), data};
    return 1;
}

void kiln_image_free(kiln_image *image)
{
    if (!image) return;
    free(image->data);
    memset(image, 0, sizeof *image);
}

/* A preview for the host: 8-bit interleaved pixels, valid during the callback only. A
 * preview that finds no memory is skipped (a picture of a run in progress is not worth
 * failing the run for). */
static void host_preview(void *ud, int step, int total, const float *planar, int c, int h, int w)
{
    kiln_ctx *ctx = ud;
    if (!ctx->preview) return;
    kiln_image im;
    if (!planar_to_image(planar, c, h, w, KILN_PIXEL_U8, &im)) return;
    ctx->preview(ctx->preview_user, step, total, &im);
    kiln_image_free(&im);
}

/* Pushes a host image as an f32 cpu tensor [1, C, H, W]. [-0, +1, e] */
static void push_image(lua_State *L, const kiln_image *im)
{
    int64_t shape[4] = {1, im->channels, im->height, im->width};
    kiln_tensor *t;
    L_TRY(L, kiln_tensor_new(kiln_device_cpu(), KILN_F32, 4, shape, &t));
    l_push_tensor(L, t); /* owned by Lua from here: an error below frees it */
    image_to_planar(im, kiln_tensor_data(t));
}

/* Pushes the global at a dotted path ("tools.upscale"); fields may load modules. */
static int push_path(lua_State *L, const char *path)
{
    lua_pushglobaltable(L);
    for (const char *p = path;;) {
        size_t n = strcspn(p, ".");
        if (n == 0 || !lua_istable(L, -1)) return 0;
        lua_pushlstring(L, p, n);
        lua_gettable(L, -2);
        lua_remove(L, -2);
        if (p[n] == '\0') return 1;
        p += n + 1;
    }
}

static int call_function(lua_State *L)
{
    job *j = lua_touserdata(L, 1);
    if (!push_path(L, j->function) || !lua_isfunction(L, -1)) {
        j->status = KILN_ERR_ARG;
        return luaL_error(L, "kiln_call: '%s' is not a function (a %s value)", j->function,
                          luaL_typename(L, -1));
    }
    luaL_checkstack(L, j->n_images + j->n_args + 8, "kiln_call: too many arguments");
    for (int i = 0; i < j->n_images; i++) push_image(L, &j->images[i]);
    for (int i = 0; i < j->n_args; i++) lua_pushstring(L, j->args[i]);
    lua_call(L, j->n_images + j->n_args, 1);
    if (!j->out) return 0;

    kiln_tensor *t = l_test_tensor(L, -1);
    char shape[96] = "";
    if (t) kiln_shape_str(t, shape, sizeof shape);
    int nd = t ? t->ndim : 0;
    int64_t c = nd == 2 ? 1 : nd >= 3 ? t->shape[nd - 3] : 0;
    if (!t || nd < 2 || nd > 4 || (nd == 4 && t->shape[0] != 1) || c < 1 || c > 4 || t->shape[nd - 2] < 1 ||
        t->shape[nd - 1] < 1 || t->shape[nd - 2] > MAX_SIDE || t->shape[nd - 1] > MAX_SIDE)
        return luaL_error(L, "kiln_call: '%s' returned %s%s, expected an image tensor [1, C, H, W] with C = 1..4",
                          j->function,
                          t ? "a tensor " : luaL_testudata(L, -1, KILN_TENSOR_MT) ? "a freed tensor" : luaL_typename(L, -1),
                          shape);
    kiln_tensor *f;
    L_TRY(L, kiln_tensor_to(t, kiln_device_cpu(), KILN_F32, &f));
    kiln_tensor *fc;
    kiln_status st = kiln_tensor_contiguous(f, &fc);
    kiln_tensor_free(f);
    if (st) l_raise(L, st);
    int ok = planar_to_image(kiln_tensor_data(fc), (int)c, (int)t->shape[nd - 2], (int)t->shape[nd - 1],
                             j->out->format, &j->result);
    kiln_tensor_free(fc);
    if (!ok) {
        j->status = KILN_ERR_OOM;
        return luaL_error(L, "kiln_call: out of host memory for the %s result image", shape);
    }
    return 0;
}

kiln_status kiln_call(kiln_ctx *ctx, const char *function, const kiln_image *images, int n_images,
                      const char *const *args, int n_args, kiln_image *out)
{
    if (!ctx) return fail(NULL, KILN_ERR_ARG, "kiln_call: the context is NULL");
    if (!function || !*function) return fail(ctx, KILN_ERR_ARG, "kiln_call: no function name");
    if (n_images < 0 || (n_images > 0 && !images))
        return fail(ctx, KILN_ERR_ARG, "kiln_call: %d images at %s", n_images, images ? "an address" : "NULL");
    if (n_args < 0 || (n_args > 0 && !args))
        return fail(ctx, KILN_ERR_ARG, "kiln_call: %d args at %s", n_args, args ? "an address" : "NULL");
    for (int i = 0; i < n_images; i++) {
        char what[64];
        snprintf(what, sizeof what, "kiln_call: image %d", i + 1);
        if (check_image(ctx, &images[i], what) != KILN_OK) return KILN_ERR_ARG;
    }
    for (int i = 0; i < n_args; i++)
        if (!args[i]) return fail(ctx, KILN_ERR_ARG, "kiln_call: args[%d] is NULL", i);
    if (out && out->format != KILN_PIXEL_U8 && out->format != KILN_PIXEL_F32)
        return fail(ctx, KILN_ERR_ARG, "kiln_call: out->format %d is not KILN_PIXEL_U8 or KILN_PIXEL_F32",
                    (int)out->format);
    job j = {.ctx = ctx, .function = function, .images = images, .n_images = n_images,
             .args = args, .n_args = n_args, .out = out};
    kiln_status st = protected_run(&j, call_function, "kiln_call");
    if (st == KILN_OK && out) *out = j.result;
    else free(j.result.data);
    return st;
}

/* ---------------------------------------------------------------- memory */

static kiln_device *find_device(kiln_ctx *ctx, const char *name, const char *what)
{
    kiln_device *d = kiln_device_get(name ? name : ctx ? ctx->device : "cpu");
    if (!d) fail_runtime(ctx, KILN_ERR_ARG, what);
    return d;
}

kiln_status kiln_memory_stats(kiln_ctx *ctx, const char *device, kiln_memory_info *out)
{
    if (!out) return fail(ctx, KILN_ERR_ARG, "kiln_memory_stats: out is NULL");
    kiln_device *d = find_device(ctx, device, "kiln_memory_stats");
    if (!d) return KILN_ERR_ARG;
    kiln_mem_stats s = kiln_allocator_stats(d->alloc);
    memset(out, 0, sizeof *out);
    snprintf(out->device, sizeof out->device, "%s", d->name);
    out->allocated = s.allocated;
    out->peak_allocated = s.peak_allocated;
    out->reserved = s.reserved;
    out->peak_reserved = s.peak_reserved;
    out->budget = s.budget;
    out->total = d->total_memory;
    out->n_allocs = s.n_allocs;
    out->n_frees = s.n_frees;
    out->n_ooms = s.n_ooms;
    return KILN_OK;
}

kiln_status kiln_memory_set_budget(kiln_ctx *ctx, const char *device, uint64_t bytes)
{
    kiln_device *d = find_device(ctx, device, "kiln_memory_set_budget");
    if (!d) return KILN_ERR_ARG;
    /* a call may be running: the change reaches it at its next suspend point */
    kiln_settings s = {.given = KILN_SETTING_BIT(KILN_SETTING_BUDGET), .device = d->name, .budget = bytes,
                       .budget_live = 1};
    kiln_status st = kiln_settings_apply(&s, NULL);
    if (st != KILN_OK) return fail_runtime(ctx, st, "kiln_memory_set_budget");
    return KILN_OK;
}

kiln_status kiln_memory_last_oom(const kiln_ctx *ctx, kiln_oom_info *out)
{
    if (!ctx || !out) return fail(NULL, KILN_ERR_ARG, "kiln_memory_last_oom: %s is NULL", ctx ? "out" : "the context");
    if (!ctx->has_oom) {
        memset(out, 0, sizeof *out);
        return KILN_ERR_STATE;
    }
    *out = ctx->oom;
    return KILN_OK;
}

static int summary(lua_State *L)
{
    lua_getglobal(L, "kiln");
    lua_getfield(L, -1, "mem");
    lua_getfield(L, -1, "summary");
    lua_call(L, 0, 1);
    return 1;
}

/* Usable from a callback inside a call: it leaves the running call's stack alone. */
const char *kiln_memory_summary(kiln_ctx *ctx)
{
    if (!ctx) {
        fail(NULL, KILN_ERR_ARG, "kiln_memory_summary: the context is NULL");
        return NULL;
    }
    lua_State *L = ctx->L;
    int top = lua_gettop(L);
    if (!lua_checkstack(L, 8)) return NULL;
    lua_pushcfunction(L, summary);
    int rc = lua_pcall(L, 0, 1, 0);
    if (rc == LUA_OK && lua_type(L, -1) == LUA_TSTRING) set_str(&ctx->summary, lua_tostring(L, -1));
    else fail(ctx, KILN_ERR_SCRIPT, "kiln_memory_summary: %s", rc == LUA_OK ? "no text" : lua_tostring(L, -1));
    lua_settop(L, top);
    return rc == LUA_OK && ctx->summary ? ctx->summary : NULL;
}

const char *kiln_device_name_at(int i)
{
    kiln_backends_register_all(); /* a host may list devices before kiln_open */
    kiln_device *d = i >= 0 && i < kiln_device_count() ? kiln_device_at(i) : NULL;
    return d ? d->name : NULL;
}

/* ---------------------------------------------------------------- PNG files */

kiln_status kiln_image_load_png(kiln_ctx *ctx, const char *path, kiln_pixel_format format, kiln_image *out)
{
    if (!path || !out) return fail(ctx, KILN_ERR_ARG, "kiln_image_load_png: %s is NULL", path ? "out" : "path");
    if (format != KILN_PIXEL_U8 && format != KILN_PIXEL_F32)
        return fail(ctx, KILN_ERR_ARG, "kiln_image_load_png: format %d is not KILN_PIXEL_U8 or KILN_PIXEL_F32",
                    (int)format);
    float *px;
    int c, h, w;
    kiln_status st = kiln_png_read(path, &px, &c, &h, &w);
    if (st) return fail_runtime(ctx, st, "kiln_image_load_png");
    int ok = planar_to_image(px, c, h, w, format, out);
    free(px);
    if (!ok) return fail(ctx, KILN_ERR_OOM, "kiln_image_load_png: %s: out of host memory", path);
    return KILN_OK;
}

kiln_status kiln_image_save_png(kiln_ctx *ctx, const kiln_image *image, const char *path)
{
    if (!path) return fail(ctx, KILN_ERR_ARG, "kiln_image_save_png: path is NULL");
    if (check_image(ctx, image, "kiln_image_save_png: image") != KILN_OK) return KILN_ERR_ARG;
    size_t n = (size_t)image->channels * (size_t)image->height * (size_t)image->width;
    float *px = malloc(n * sizeof *px);
    if (!px) return fail(ctx, KILN_ERR_OOM, "kiln_image_save_png: %s: out of host memory", path);
    image_to_planar(image, px);
    char software[64];
    snprintf(software, sizeof software, "kiln %s", kiln_version());
    const char *keys[] = {"Software"}, *values[] = {software};
    kiln_status st = kiln_png_write(path, px, image->channels, image->height, image->width, 1, keys, values);
    free(px);
    if (st) return fail_runtime(ctx, st, "kiln_image_save_png");
    return KILN_OK;
}
