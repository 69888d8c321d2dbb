/* l_suspend.c - kiln.suspend_point: where a run may park for its host (kiln_suspend)
 * and where a budget lowered while it runs takes effect (evict, then stream, then the
 * allocator enforces it); kiln.suspend_stats; kiln.mem.budget_watch and kiln.mem.evict.
 * The pipelines call kiln.suspend_point between network blocks (kiln.stream), sampler
 * steps and tiles; a script with its own loop may call it anywhere. */
#include "l_parts.h"
#include "../runtime/model.h"
#include "../runtime/suspend.h"

#include <stdint.h>

#define GATE_KEY "kiln.suspend.gate" /* registry: userdata l_suspend_host */

typedef struct {
    kiln_gate *gate;
    int (*stop)(void *ud);
    void *ud;
} l_suspend_host;

/* One host per state; the struct is copied into a userdata kept in the registry. */
void l_suspend_set_gate(lua_State *L, kiln_gate *gate, int (*stop)(void *ud), void *ud)
{
    if (!gate) {
        lua_pushnil(L);
    } else {
        l_suspend_host *h = lua_newuserdatauv(L, sizeof *h, 0);
        h->gate = gate;
        h->stop = stop;
        h->ud = ud;
    }
    lua_setfield(L, LUA_REGISTRYINDEX, GATE_KEY);
}

static l_suspend_host *get_host(lua_State *L)
{
    lua_getfield(L, LUA_REGISTRYINDEX, GATE_KEY);
    l_suspend_host *h = lua_touserdata(L, -1);
    lua_pop(L, 1);
    return h;
}

static int parkable(const kiln_device *d)
{
    return d->type == KILN_DEV_SIM || d->type == KILN_DEV_CUDA;
}

/* A device whose budget was lowered while the run went on (in its grace): when what
 * the run needed so far (the most it reserved since the last kiln.mem.reset_peak, or
 * what it holds now) exceeds the new budget, evict what no running network holds,
 * then let kiln.stream turn the networks running on it to streaming (the hook
 * "stream_adapt"(device, excess) it registers when it loads; unloaded, no pass
 * streams and there is none to turn); a loaded model evicted between two forward
 * passes streams from its next one. Then the grace ends: from
 * here the allocator enforces the budget (evicting, else failing, which a tiled stage
 * answers with smaller tiles). */
static void adapt(lua_State *L, kiln_device *d)
{
    kiln_budget_watch w = kiln_allocator_budget_watch(d->alloc);
    kiln_mem_stats s = kiln_allocator_stats(d->alloc);
    uint64_t need = s.reserved > w.peak_before ? s.reserved : w.peak_before;
    if (s.budget && need > s.budget) {
        uint64_t held = s.reserved;
        kiln_model_evict(d, (size_t)(need - s.budget));
        s = kiln_allocator_stats(d->alloc);
        uint64_t gone = held > s.reserved ? held - s.reserved : 0;
        need = need > gone ? need - gone : 0;
    }
    if (s.budget && need > s.budget && l_hook_push(L, "stream_adapt")) {
        lua_pushstring(L, d->name);
        lua_pushinteger(L, (lua_Integer)(need - s.budget));
        lua_call(L, 2, 0);
    }
    kiln_allocator_end_grace(d->alloc);
}

/* kiln.suspend_point() [-0, +0, e]: parks here when the host asked (kiln_suspend) until
 * kiln_resume, raising "cancelled" when kiln_cancel came meanwhile; applies a budget
 * lowered live (kiln_memory_set_budget, kiln.mem.set_budget(dev, n, {live = true})).
 * Cheap when neither happened (two atomic loads). */
static int l_suspend_point(lua_State *L)
{
    l_suspend_host *h = get_host(L);
    if (h && kiln_gate_requested(h->gate)) {
        /* tensors the script dropped would be parked for nothing */
        lua_gc(L, LUA_GCCOLLECT);
        kiln_status st = kiln_gate_point(h->gate, h->stop, h->ud);
        if (st == KILN_ERR_CANCELLED) l_raise_cancelled(L, " while suspended");
        if (st) l_raise(L, st);
    }
    if (kiln_allocator_graced() > 0) {
        for (int i = 0; i < kiln_device_count(); i++) {
            kiln_device *d = kiln_device_at(i);
            if (parkable(d) && kiln_allocator_budget_watch(d->alloc).grace) adapt(L, d);
        }
    }
    return 0;
}

/* kiln.suspend_stats() -> {parks, bytes, park_seconds, resume_seconds} of this state's
 * host (zeros without one). */
static int l_suspend_stats(lua_State *L)
{
    l_suspend_host *h = get_host(L);
    kiln_gate_stats s = kiln_gate_get_stats(h ? h->gate : NULL);
    lua_createtable(L, 0, 4);
    lua_pushinteger(L, (lua_Integer)s.parks);
    lua_setfield(L, -2, "parks");
    lua_pushinteger(L, (lua_Integer)s.bytes);
    lua_setfield(L, -2, "bytes");
    lua_pushnumber(L, s.park_seconds);
    lua_setfield(L, -2, "park_seconds");
    lua_pushnumber(L, s.resume_seconds);
    lua_setfield(L, -2, "resume_seconds");
    return 1;
}

/* kiln.mem.budget_watch([device]) -> {changes, grace, over, lowered_at, compliant_at,
 * compliance_seconds (nil until met), peak_since, peak_before} */
static int mem_budget_watch(lua_State *L)
{
    kiln_device *d = l_opt_device(L, 1);
    kiln_budget_watch w = kiln_allocator_budget_watch(d->alloc);
    lua_createtable(L, 0, 8);
    lua_pushinteger(L, (lua_Integer)w.changes);
    lua_setfield(L, -2, "changes");
    lua_pushboolean(L, w.grace);
    lua_setfield(L, -2, "grace");
    lua_pushboolean(L, w.over);
    lua_setfield(L, -2, "over");
    lua_pushnumber(L, w.lowered_at);
    lua_setfield(L, -2, "lowered_at");
    lua_pushnumber(L, w.compliant_at);
    lua_setfield(L, -2, "compliant_at");
    if (w.lowered_at > 0 && w.compliant_at > 0) {
        lua_pushnumber(L, w.compliant_at - w.lowered_at);
        lua_setfield(L, -2, "compliance_seconds");
    }
    lua_pushinteger(L, (lua_Integer)w.peak_since);
    lua_setfield(L, -2, "peak_since");
    lua_pushinteger(L, (lua_Integer)w.peak_before);
    lua_setfield(L, -2, "peak_before");
    return 1;
}

/* kiln.mem.evict(device, bytes) -> bytes given back: unpinned models' copies on the
 * device, least recently used first, whatever the memory mode. */
static int mem_evict(lua_State *L)
{
    kiln_device *d = l_check_device(L, 1);
    lua_Integer n = luaL_checkinteger(L, 2);
    luaL_argcheck(L, n >= 0, 2, "bytes must be >= 0");
    lua_pushinteger(L, (lua_Integer)kiln_model_evict(d, (size_t)n));
    return 1;
}

void l_open_suspend(lua_State *L)
{
    lua_pushcfunction(L, l_suspend_point);
    lua_setfield(L, -2, "suspend_point");
    lua_pushcfunction(L, l_suspend_stats);
    lua_setfield(L, -2, "suspend_stats");
    if (lua_getfield(L, -1, "mem") == LUA_TTABLE) {
        lua_pushcfunction(L, mem_budget_watch);
        lua_setfield(L, -2, "budget_watch");
        lua_pushcfunction(L, mem_evict);
        lua_setfield(L, -2, "evict");
    }
    lua_pop(L, 1);
}
