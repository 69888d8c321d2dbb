/* l_mem.c - kiln.mem: per-device memory statistics, budgets and the summary table,
 * and kiln.memory_mode. (The allocators' pressure hook, a Lua GC before an
 * out-of-memory is reported, is l_config.c's.) */
#include "l_parts.h"
#include "../runtime/model.h"
#include "../runtime/settings.h"

#include <stdio.h>
#include <string.h>

#define SET_INT(L, name, v) (lua_pushinteger((L), (lua_Integer)(v)), lua_setfield((L), -2, (name)))

/* kiln.mem.stats([device]) -> {allocated, reserved, peak, peak_reserved, budget, ...} */
static int mem_stats(lua_State *L)
{
    kiln_device *d = l_opt_device(L, 1);
    kiln_mem_stats s = kiln_device_stats(d);
    lua_createtable(L, 0, 18);
    lua_pushstring(L, d->name);
    lua_setfield(L, -2, "device");
    SET_INT(L, "allocated", s.allocated);
    SET_INT(L, "reserved", s.reserved);
    SET_INT(L, "peak", s.peak_allocated);
    SET_INT(L, "peak_allocated", s.peak_allocated);
    SET_INT(L, "peak_reserved", s.peak_reserved);
    SET_INT(L, "budget", s.budget);
    SET_INT(L, "allocs", s.n_allocs);
    SET_INT(L, "frees", s.n_frees);
    SET_INT(L, "ooms", s.n_ooms);
    SET_INT(L, "segments", s.n_segments);
    SET_INT(L, "largest_free", s.largest_free);
    /* kernel scratch outside the allocator (cpu: the host scratch of cpu and sim): held
     * now (cache included), and the most in use at once since reset_peak */
    SET_INT(L, "workspace", s.workspace);
    SET_INT(L, "workspace_peak", s.workspace_peak);
    /* kernels' caches of weights (counted in allocated too) and their limit (-1: none
     * but the budget) */
    SET_INT(L, "weight_caches", __atomic_load_n(&d->derived_bytes, __ATOMIC_RELAXED));
    uint64_t limit = __atomic_load_n(&d->derived_limit, __ATOMIC_RELAXED);
    lua_pushinteger(L, limit == UINT64_MAX ? -1 : (lua_Integer)limit);
    lua_setfield(L, -2, "weight_cache_limit");
    kiln_transfer_stats x = kiln_device_transfers(d);
    SET_INT(L, "bytes_to_device", x.bytes_to_device);
    /* host -> device bytes since kiln.mem.reset_peak (weights streamed in, inputs) */
    SET_INT(L, "copied_in", x.copied_in);
    SET_INT(L, "bytes_to_host", x.bytes_to_host);
    lua_pushnumber(L, x.seconds_copying);
    lua_setfield(L, -2, "seconds_copying");
    return 1;
}

static int mem_reset_peak(lua_State *L)
{
    kiln_device_reset_peak(l_opt_device(L, 1));
    return 0;
}

static int mem_empty_cache(lua_State *L)
{
    kiln_device_empty_cache(l_opt_device(L, 1));
    return 0;
}

/* kiln.mem.set_budget(device, bytes [, {live = true}]) (0 = unlimited). live: the
 * change reaches a run in progress at its next suspend point, as kiln_memory_set_budget
 * from a host's thread does (kiln_allocator_set_budget_live) */
static int mem_set_budget(lua_State *L)
{
    kiln_device *d = l_check_device(L, 1);
    lua_Integer b = luaL_checkinteger(L, 2);
    if (b < 0) luaL_argerror(L, 2, "budget must be >= 0 bytes (0 = unlimited)");
    /* the settings route, as kiln.configure{budget =} and kiln_memory_set_budget */
    kiln_settings s = {.given = KILN_SETTING_BIT(KILN_SETTING_BUDGET), .device = d->name, .budget = (uint64_t)b,
                       .budget_live = l_opt_bool_field(L, 3, "live", 0)};
    kiln_status st = kiln_settings_apply(&s, NULL);
    if (st != KILN_OK) l_raise(L, st);
    return 0;
}

/* kiln.mem.set_weight_cache_limit(device, bytes): kernels' caches of weights (bf16's
 * and int8's forms of them, "(derived)" in the summary) on that device take at most
 * bytes from now on (0: none; -1: no limit but the budget); those over it go at once. */
static int mem_set_weight_cache_limit(lua_State *L)
{
    kiln_device *d = l_check_device(L, 1);
    lua_Integer b = luaL_checkinteger(L, 2);
    if (b < -1) luaL_argerror(L, 2, "limit must be >= 0 bytes, or -1 for none but the budget");
    kiln_device_set_derived_limit(d, b < 0 ? UINT64_MAX : (uint64_t)b);
    return 0;
}

typedef struct { char owner[64]; uint64_t bytes; int count; } owner_row;
typedef struct { owner_row rows[64]; int n; } owner_acc;

static void add_owner(void *ctx, const kiln_storage *s)
{
    owner_acc *a = ctx;
    if (s->release) return; /* wrapped memory (mapped files) is not the allocator's */
    for (int i = 0; i < a->n; i++)
        if (strcmp(a->rows[i].owner, s->owner) == 0) { a->rows[i].bytes += s->nbytes; a->rows[i].count++; return; }
    int i = a->n < 64 ? a->n++ : 63;
    snprintf(a->rows[i].owner, sizeof a->rows[i].owner, "%s", i == 63 ? "(other)" : s->owner);
    a->rows[i].bytes += s->nbytes;
    a->rows[i].count++;
}

/* The models section of the summary: one row per model and device holding its
 * copies, most recently used first (as torch.cuda.memory_summary lists segments). */
static void add_models(luaL_Buffer *b)
{
    kiln_model_usage rows[64];
    int n = kiln_model_usage_list(rows, 64);
    char line[256], v[32], t[32];
    if (n == 0) {
        luaL_addstring(b, "models: none open\n");
        return;
    }
    luaL_addstring(b, "models (most recently used first)\n");
    snprintf(line, sizeof line, "  %-24s %-8s %10s %9s  %s\n", "model", "device", "bytes", "tensors", "state");
    luaL_addstring(b, line);
    for (int i = 0; i < n && i < 64; i++) {
        const kiln_model_usage *u = &rows[i];
        kiln_format_bytes(v, sizeof v, (double)u->bytes);
        snprintf(t, sizeof t, "%d/%d", u->tensors, u->total);
        snprintf(line, sizeof line, "  %-24s %-8s %10s %9s  %s%s\n", u->model, u->device[0] ? u->device : "-",
                 u->device[0] ? v : "-", u->device[0] ? t : "-",
                 !u->device[0] ? "mapped" : u->tensors == u->total ? "resident" : "partial", u->pinned ? ", pinned" : "");
        luaL_addstring(b, line);
    }
    if (n > 64) {
        snprintf(line, sizeof line, "  ... %d more rows\n", n - 64);
        luaL_addstring(b, line);
    }
}

/* kiln.mem.summary() -> string: a table per device and per owner, then the models. */
static int mem_summary(lua_State *L)
{
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    char line[256], v[6][32];
    snprintf(line, sizeof line, "kiln memory summary (mode %s)\n", kiln_memory_mode_name(kiln_memory_mode_get()));
    luaL_addstring(&b, line);
    luaL_addstring(&b, "device      allocated       peak   reserved  peak res.     budget   allocs  ooms\n");
    for (int i = 0; i < kiln_device_count(); i++) {
        kiln_device *d = kiln_device_at(i);
        kiln_mem_stats s = kiln_allocator_stats(d->alloc);
        kiln_format_bytes(v[0], sizeof v[0], (double)s.allocated);
        kiln_format_bytes(v[1], sizeof v[1], (double)s.peak_allocated);
        kiln_format_bytes(v[2], sizeof v[2], (double)s.reserved);
        kiln_format_bytes(v[3], sizeof v[3], (double)s.peak_reserved);
        if (s.budget) kiln_format_bytes(v[4], sizeof v[4], (double)s.budget); else snprintf(v[4], 32, "unlimited");
        snprintf(line, sizeof line, "%-8s %12s %10s %10s %10s %10s %8llu %5llu\n", d->name, v[0], v[1], v[2], v[3], v[4],
                 (unsigned long long)s.n_allocs, (unsigned long long)s.n_ooms);
        luaL_addstring(&b, line);
        owner_acc acc;
        memset(&acc, 0, sizeof acc);
        kiln_storage_foreach(d, add_owner, &acc);
        for (int k = 0; k < acc.n; k++) {
            kiln_format_bytes(v[5], sizeof v[5], (double)acc.rows[k].bytes);
            snprintf(line, sizeof line, "  %-28s %10s in %d storage%s\n", acc.rows[k].owner, v[5], acc.rows[k].count,
                     acc.rows[k].count == 1 ? "" : "s");
            luaL_addstring(&b, line);
        }
    }
    add_models(&b);
    luaL_pushresult(&b);
    return 1;
}

static const char *const mode_names[] = {"high", "normal", "low", "none", "cpu", NULL};

/* kiln.memory_mode([mode]) -> current mode (the runtime's: it decides eviction and
 * where models load) */
static int l_memory_mode(lua_State *L)
{
    if (!lua_isnoneornil(L, 1)) {
        const char *m = luaL_checkstring(L, 1);
        int mode = kiln_memory_mode_from_name(m);
        if (mode < 0) l_enum_error(L, 1, "memory mode", m, mode_names);
        kiln_memory_mode_set((kiln_memory_mode)mode);
    }
    lua_pushstring(L, kiln_memory_mode_name(kiln_memory_mode_get()));
    return 1;
}

/* kiln.mem.prefetch_at_once([on]) -> whether prefetches copy at once on the calling
 * thread (as in a dry run) instead of on the copy thread; default false */
static int mem_prefetch_at_once(lua_State *L)
{
    if (!lua_isnoneornil(L, 1)) {
        luaL_checktype(L, 1, LUA_TBOOLEAN);
        kiln_model_set_prefetch_at_once(lua_toboolean(L, 1));
    }
    lua_pushboolean(L, kiln_model_prefetch_at_once());
    return 1;
}

/* kiln.mem.copy_delay(seconds): tests; the copy thread waits that long after each
 * prefetch copy before installing it (a copy thread that gets no core); 0 turns it off */
static int mem_copy_delay(lua_State *L)
{
    double s = luaL_checknumber(L, 1);
    if (!(s >= 0 && s <= 60)) luaL_argerror(L, 1, "seconds in [0, 60]");
    kiln_model_set_copy_delay(s);
    return 0;
}

/* kiln.mem.live() -> {tensors = n, models = {name, ...}, storages = {"owner on device", ...}}:
 * tensor headers alive in the process, the open models (one name per model) and the
 * owners of the allocators' live storages, for the test runner's leak check. */
static int mem_live(lua_State *L)
{
    lua_createtable(L, 0, 3);
    SET_INT(L, "tensors", kiln_tensor_live_count());
    kiln_model_usage rows[64];
    int n = kiln_model_usage_list(rows, 64), k = 0;
    lua_createtable(L, n < 64 ? n : 64, 0);
    for (int i = 0; i < n && i < 64; i++) {
        int seen = 0; /* a model has one row per device holding its copies */
        for (int j = 0; j < i && !seen; j++) seen = strcmp(rows[j].model, rows[i].model) == 0;
        if (seen) continue;
        lua_pushstring(L, rows[i].model);
        lua_rawseti(L, -2, ++k);
    }
    lua_setfield(L, -2, "models");
    lua_newtable(L);
    k = 0;
    for (int i = 0; i < kiln_device_count(); i++) {
        kiln_device *d = kiln_device_at(i);
        owner_acc acc = {.n = 0};
        kiln_storage_foreach(d, add_owner, &acc);
        for (int j = 0; j < acc.n; j++) {
            lua_pushfstring(L, "%s on %s (%d storage%s, %I bytes)", acc.rows[j].owner, d->name, acc.rows[j].count,
                            acc.rows[j].count == 1 ? "" : "s", (lua_Integer)acc.rows[j].bytes);
            lua_rawseti(L, -2, ++k);
        }
    }
    lua_setfield(L, -2, "storages");
    return 1;
}

static const luaL_Reg mem_funcs[] = {
    {"live", mem_live},
    {"stats", mem_stats}, {"reset_peak", mem_reset_peak}, {"empty_cache", mem_empty_cache},
    {"set_budget", mem_set_budget}, {"summary", mem_summary}, {"prefetch_at_once", mem_prefetch_at_once},
    {"copy_delay", mem_copy_delay}, {"set_weight_cache_limit", mem_set_weight_cache_limit},
    {NULL, NULL},
};

void l_open_mem(lua_State *L)
{
    luaL_newlib(L, mem_funcs);
    lua_setfield(L, -2, "mem");
    lua_pushcfunction(L, l_memory_mode);
    lua_setfield(L, -2, "memory_mode");
}
