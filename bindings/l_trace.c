/* l_trace.c - kiln.trace (start / stop a Chrome trace file, named spans, marks) and
 * the event log kiln.mem.events. */
#include "l_parts.h"
#include "../runtime/events.h"
#include "../runtime/trace.h"
#include "../runtime/mem_timeline.h"

#include <stdio.h>
#include <string.h>

#define KILN_SPAN_MT "kiln.Span"

/* kiln.trace.start(path) */
static int tr_start(lua_State *L)
{
    L_TRY(L, kiln_trace_start(luaL_checkstring(L, 1)));
    return 0;
}

/* kiln.trace.stop() -> true when a trace file was written, nil when none ran */
static int tr_stop(lua_State *L)
{
    if (!kiln_trace_active()) {
        lua_pushnil(L);
        return 1;
    }
    L_TRY(L, kiln_trace_stop());
    lua_pushboolean(L, 1);
    return 1;
}

static int tr_active(lua_State *L)
{
    lua_pushboolean(L, kiln_trace_active());
    return 1;
}

typedef struct { double t0; int done; uint64_t timeline; char name[120]; } span_ud;

/* __close of the span guard: ends the span, noting the error when fn raised one. */
static int span_close(lua_State *L)
{
    span_ud *s = luaL_checkudata(L, 1, KILN_SPAN_MT);
    if (s->done) return 0;
    s->done = 1;
    double t1 = kiln_events_now();
    /* the memory picture's stages are kept whether or not a trace file runs */
    kiln_mem_timeline_span_end(s->timeline, t1, !lua_isnoneornil(L, 2));
    if (lua_isnoneornil(L, 2)) {
        kiln_trace_span(s->name, "span", s->t0, t1, NULL);
        return 0;
    }
    size_t n;
    const char *msg = luaL_tolstring(L, 2, &n);
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    luaL_addstring(&b, "\"error\":\"");
    l_add_json_escaped(&b, msg, n > 400 ? 400 : n);
    luaL_addchar(&b, '"');
    luaL_pushresult(&b);
    kiln_trace_span(s->name, "span", s->t0, t1, lua_tostring(L, -1));
    return 0;
}

/* kiln.trace.span(name, fn, ...) -> fn(...)'s results; the span covers the call and
 * is closed on error too (a to-be-closed slot, so the error keeps its traceback). */
static int tr_span(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    luaL_checktype(L, 2, LUA_TFUNCTION);
    int nargs = lua_gettop(L) - 2;
    span_ud *s = lua_newuserdatauv(L, sizeof *s, 0);
    s->done = 0;
    s->timeline = 0;
    snprintf(s->name, sizeof s->name, "%s", name);
    luaL_setmetatable(L, KILN_SPAN_MT);
    lua_insert(L, 1);
    lua_toclose(L, 1);
    s->t0 = kiln_events_now();
    s->timeline = kiln_mem_timeline_span_begin(s->name, s->t0);
    lua_call(L, nargs, LUA_MULTRET); /* stack: span, name, results... */
    return lua_gettop(L) - 2;
}

/* kiln.trace.mark(name [, detail]): an instant event in the log and the trace */
static int tr_mark(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    const char *detail = luaL_optstring(L, 2, "");
    kiln_event_emit(KILN_EV_MARK, NULL, 0, name, "%s", detail);
    return 0;
}

/* kiln.trace.counters(): samples every device's memory counters into the trace now */
static int tr_counters(lua_State *L)
{
    (void)L;
    kiln_trace_counters(NULL);
    return 0;
}

/* kiln.mem.events([since_seq]) -> list of {seq, time, kind, device, bytes, owner,
 * detail, thread}, oldest first (the last KILN_EVENTS_CAPACITY events at most) */
static int mem_events(lua_State *L)
{
    lua_Integer since = luaL_optinteger(L, 1, 0);
    size_t cap = kiln_events_count();
    kiln_event *ev = lua_newuserdatauv(L, sizeof *ev * (cap ? cap : 1), 0);
    size_t n = kiln_events_get(since < 0 ? 0 : (uint64_t)since, ev, cap);
    lua_createtable(L, (int)n, 0);
    for (size_t i = 0; i < n; i++) {
        const kiln_event *e = &ev[i];
        lua_createtable(L, 0, 8);
        lua_pushinteger(L, (lua_Integer)e->seq);
        lua_setfield(L, -2, "seq");
        lua_pushnumber(L, e->time);
        lua_setfield(L, -2, "time");
        lua_pushstring(L, kiln_event_kind_name(e->kind));
        lua_setfield(L, -2, "kind");
        lua_pushstring(L, e->device);
        lua_setfield(L, -2, "device");
        lua_pushinteger(L, (lua_Integer)e->bytes);
        lua_setfield(L, -2, "bytes");
        lua_pushstring(L, e->owner);
        lua_setfield(L, -2, "owner");
        lua_pushstring(L, e->detail);
        lua_setfield(L, -2, "detail");
        lua_pushinteger(L, e->thread);
        lua_setfield(L, -2, "thread");
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 1;
}

static int mem_clear_events(lua_State *L)
{
    (void)L;
    kiln_events_clear();
    return 0;
}

/* kiln.mem.event_threshold([bytes]) -> threshold: allocations of at least that many
 * bytes become "alloc"/"free" events (0 = off) */
static int mem_event_threshold(lua_State *L)
{
    if (!lua_isnoneornil(L, 1)) {
        lua_Integer b = luaL_checkinteger(L, 1);
        if (b < 0) luaL_argerror(L, 1, "threshold must be >= 0 bytes (0 = off)");
        kiln_events_set_alloc_threshold((uint64_t)b);
    }
    lua_pushinteger(L, (lua_Integer)kiln_events_alloc_threshold());
    return 1;
}

static const luaL_Reg trace_funcs[] = {
    {"start", tr_start}, {"stop", tr_stop}, {"active", tr_active}, {"span", tr_span},
    {"mark", tr_mark}, {"counters", tr_counters},
    {NULL, NULL},
};

static const luaL_Reg mem_funcs[] = {
    {"events", mem_events}, {"clear_events", mem_clear_events}, {"event_threshold", mem_event_threshold},
    {NULL, NULL},
};

void l_open_trace(lua_State *L)
{
    kiln_thread_set_name("lua", 0);
    luaL_newmetatable(L, KILN_SPAN_MT);
    lua_pushcfunction(L, span_close);
    lua_setfield(L, -2, "__close");
    lua_pop(L, 1);
    luaL_newlib(L, trace_funcs);
    lua_setfield(L, -2, "trace");
    if (lua_getfield(L, -1, "mem") != LUA_TTABLE) {
        lua_pop(L, 1);
        lua_newtable(L);
        lua_pushvalue(L, -1);
        lua_setfield(L, -3, "mem");
    }
    luaL_setfuncs(L, mem_funcs, 0);
    lua_pop(L, 1);
}
