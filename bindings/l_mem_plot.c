/* l_mem_plot.c - the memory picture from Lua: kiln.mem.plot (draw a device's
 * timeline into a PNG), kiln.mem.stage_table, kiln.mem.timeline (the raw frames and
 * stages) and kiln.mem.clear_timeline. */
#include "l_parts.h"
#include "../runtime/mem_plot.h"

#include <stdlib.h>
#include <string.h>

#define SET_INT(L, name, v) (lua_pushinteger((L), (lua_Integer)(v)), lua_setfield((L), -2, (name)))
#define SET_NUM(L, name, v) (lua_pushnumber((L), (lua_Number)(v)), lua_setfield((L), -2, (name)))

/* The device whose timeline to read: the one named, else the default device unless it
 * recorded nothing while another did (a script that names its device per call). */
static kiln_device *pick_device(lua_State *L, const char *name)
{
    if (name) {
        kiln_device *d = kiln_device_get(name);
        if (!d) l_raise(L, KILN_ERR_ARG);
        return d;
    }
    kiln_device *d = l_default_device(L);
    kiln_mem_timeline tl;
    if (kiln_mem_timeline_get(d, &tl) != KILN_OK) return d;
    uint64_t best = tl.peak;
    kiln_mem_timeline_release(&tl);
    if (best) return d;
    for (int i = 0; i < kiln_device_count(); i++) {
        kiln_device *o = kiln_device_at(i);
        if (kiln_mem_timeline_get(o, &tl) != KILN_OK) continue;
        if (tl.peak > best) { best = tl.peak; d = o; }
        kiln_mem_timeline_release(&tl);
    }
    return d;
}

static void push_rgb(lua_State *L, const unsigned char *c)
{
    lua_createtable(L, 3, 0);
    for (int k = 0; k < 3; k++) {
        lua_pushinteger(L, c[k]);
        lua_rawseti(L, -2, k + 1);
    }
}

/* kiln.mem.plot(path [, {device =, width =, height =, title =}]) -> table, layout
 * [-0, +2, e]: writes the picture, returns the stage table (text) and where things
 * were drawn: {device, width, height, x0, x1, y0, y1 (pixels from 0; the plot area
 * is [x0, x1) x [y0, y1), y1 = 0 bytes), t0, t1 (times at x0 and x1, on the clock
 * of kiln.mem.timeline), ymax (bytes at y0), owners = {{name =, color = {r, g, b}},
 * ...} bottom of the stack first, budget_color}. */
static int mp_plot(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
    kiln_device *dev = pick_device(L, l_opt_str_field(L, 2, "device", NULL));
    kiln_mem_plot_options o;
    memset(&o, 0, sizeof o);
    lua_Integer w = l_opt_int_field(L, 2, "width", 0), h = l_opt_int_field(L, 2, "height", 0);
    if (w < 0 || w > 8192 || h < 0 || h > 8192) luaL_argerror(L, 2, "width and height: from 480x240 to 8192x8192");
    o.width = (int)w;
    o.height = (int)h;
    o.title = l_opt_str_field(L, 2, "title", NULL);
    kiln_mem_timeline tl;
    L_TRY(L, kiln_mem_timeline_get(dev, &tl));
    kiln_mem_plot_layout lay;
    kiln_status st = kiln_mem_plot_write(&tl, path, &o, &lay);
    char *table = st == KILN_OK ? kiln_mem_plot_table(&tl) : NULL;
    kiln_mem_timeline_release(&tl);
    if (st != KILN_OK) return l_raise(L, st);
    if (!table) return luaL_error(L, "kiln.mem.plot: out of host memory for the stage table");
    lua_pushstring(L, table);
    free(table);
    lua_createtable(L, 0, 16);
    lua_pushstring(L, dev->name);
    lua_setfield(L, -2, "device");
    SET_INT(L, "width", lay.width);
    SET_INT(L, "height", lay.height);
    SET_INT(L, "x0", lay.x0);
    SET_INT(L, "x1", lay.x1);
    SET_INT(L, "y0", lay.y0);
    SET_INT(L, "y1", lay.y1);
    SET_NUM(L, "t0", lay.t0);
    SET_NUM(L, "t1", lay.t1);
    SET_NUM(L, "ymax", lay.ymax);
    lua_createtable(L, lay.n_order, 0);
    for (int k = 0; k < lay.n_order; k++) {
        int i = lay.order[k];
        lua_createtable(L, 0, 2);
        lua_pushstring(L, tl.owners[i]);
        lua_setfield(L, -2, "name");
        push_rgb(L, lay.color[i]);
        lua_setfield(L, -2, "color");
        lua_rawseti(L, -2, k + 1);
    }
    lua_setfield(L, -2, "owners");
    push_rgb(L, lay.budget_color);
    lua_setfield(L, -2, "budget_color");
    return 2;
}

/* kiln.mem.stage_table([device]) -> text: the stages with the device's peak in each */
static int mp_stage_table(lua_State *L)
{
    kiln_device *dev = pick_device(L, luaL_optstring(L, 1, NULL));
    kiln_mem_timeline tl;
    L_TRY(L, kiln_mem_timeline_get(dev, &tl));
    char *table = kiln_mem_plot_table(&tl);
    kiln_mem_timeline_release(&tl);
    if (!table) return luaL_error(L, "kiln.mem.stage_table: out of host memory");
    lua_pushstring(L, table);
    free(table);
    return 1;
}

/* owner name -> bytes for the nonzero entries of a row */
static void push_row(lua_State *L, const kiln_mem_timeline *tl, const uint64_t *row)
{
    lua_createtable(L, 0, 4);
    for (int i = 0; i < tl->n_owners; i++) {
        if (!row[i]) continue;
        lua_pushinteger(L, (lua_Integer)row[i]);
        lua_setfield(L, -2, tl->owners[i]);
    }
}

#define TIMELINE_COPY_MT "kiln.TimelineCopy"

static int copy_gc(lua_State *L)
{
    kiln_mem_timeline_release(luaL_checkudata(L, 1, TIMELINE_COPY_MT));
    return 0;
}

/* kiln.mem.timeline([device]) -> {device, start, stop, total, budget, peak,
 * peak_time, owners = {names}, now = {owner = bytes}, most = {owner = the most it
 * held}, frames = {{t0, t1, peak,
 * budget, at_peak = {owner = bytes}, at_end = {...}}, ...}, stages = {{name, t0, t1
 * (nil while open), depth, thread, failed, peak, peak_time, top_owner, top_bytes},
 * ...}, stages_dropped}. Times are seconds on the runtime's clock. */
static int mp_timeline(lua_State *L)
{
    kiln_device *dev = pick_device(L, luaL_optstring(L, 1, NULL));
    /* the copy lives in a userdata whose __gc frees it, so a memory error while the
     * tables are built leaks nothing */
    kiln_mem_timeline *tl = lua_newuserdatauv(L, sizeof *tl, 0);
    memset(tl, 0, sizeof *tl);
    luaL_setmetatable(L, TIMELINE_COPY_MT);
    L_TRY(L, kiln_mem_timeline_get(dev, tl));
    lua_createtable(L, 0, 16);
    lua_pushstring(L, tl->device);
    lua_setfield(L, -2, "device");
    SET_NUM(L, "start", tl->start);
    SET_NUM(L, "stop", tl->end);
    SET_INT(L, "total", tl->total);
    SET_INT(L, "budget", tl->budget);
    SET_INT(L, "peak", tl->peak);
    SET_NUM(L, "peak_time", tl->peak_time);
    SET_INT(L, "stages_dropped", tl->spans_dropped);
    lua_createtable(L, tl->n_owners, 0);
    for (int i = 0; i < tl->n_owners; i++) {
        lua_pushstring(L, tl->owners[i]);
        lua_rawseti(L, -2, i + 1);
    }
    lua_setfield(L, -2, "owners");
    push_row(L, tl, tl->now);
    lua_setfield(L, -2, "now");
    push_row(L, tl, tl->most);
    lua_setfield(L, -2, "most");
    lua_createtable(L, tl->n_frames, 0);
    for (int f = 0; f < tl->n_frames; f++) {
        const kiln_timeline_frame *fr = &tl->frames[f];
        lua_createtable(L, 0, 6);
        SET_NUM(L, "t0", fr->t0);
        SET_NUM(L, "t1", fr->t1);
        SET_INT(L, "peak", fr->peak);
        SET_INT(L, "budget", fr->budget);
        push_row(L, tl, fr->at_peak);
        lua_setfield(L, -2, "at_peak");
        push_row(L, tl, fr->at_end);
        lua_setfield(L, -2, "at_end");
        lua_rawseti(L, -2, f + 1);
    }
    lua_setfield(L, -2, "frames");
    lua_createtable(L, tl->n_spans, 0);
    for (int i = 0; i < tl->n_spans; i++) {
        const kiln_timeline_span *s = &tl->spans[i];
        lua_createtable(L, 0, 10);
        lua_pushstring(L, s->name);
        lua_setfield(L, -2, "name");
        SET_NUM(L, "t0", s->t0);
        if (s->t1 >= 0) SET_NUM(L, "t1", s->t1);
        SET_INT(L, "depth", s->depth);
        SET_INT(L, "thread", s->thread);
        lua_pushboolean(L, s->failed);
        lua_setfield(L, -2, "failed");
        SET_INT(L, "peak", s->peak);
        SET_NUM(L, "peak_time", s->peak_time);
        if (s->top_owner >= 0 && s->top_owner < tl->n_owners) {
            lua_pushstring(L, tl->owners[s->top_owner]);
            lua_setfield(L, -2, "top_owner");
            SET_INT(L, "top_bytes", s->top_bytes);
        }
        lua_rawseti(L, -2, i + 1);
    }
    lua_setfield(L, -2, "stages");
    kiln_mem_timeline_release(tl);
    return 1;
}

/* kiln.mem.clear_timeline(): forgets the frames and stages so far */
static int mp_clear(lua_State *L)
{
    (void)L;
    kiln_mem_timeline_clear();
    return 0;
}

static const luaL_Reg funcs[] = {
    {"plot", mp_plot}, {"stage_table", mp_stage_table}, {"timeline", mp_timeline},
    {"clear_timeline", mp_clear},
    {NULL, NULL},
};

void l_open_mem_plot(lua_State *L)
{
    luaL_newmetatable(L, TIMELINE_COPY_MT);
    lua_pushcfunction(L, copy_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    if (lua_getfield(L, -1, "mem") != LUA_TTABLE) {
        lua_pop(L, 1);
        lua_newtable(L);
        lua_pushvalue(L, -1);
        lua_setfield(L, -3, "mem");
    }
    luaL_setfuncs(L, funcs, 0);
    lua_pop(L, 1);
}
