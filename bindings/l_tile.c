/* l_tile.c - kiln.tile: kiln.tile.map runs a Lua function over overlapping tiles of a
 * tensor and blends the outputs (runtime/tile.h); kiln.tile.plan shows the grid.
 * Also installs kiln.mem.estimate, which scripts/kiln/tiling.lua registers (the hook
 * "mem_estimate", l_aux.h).
 *
 * The C loop holds native memory (the plan, the result) while Lua code runs, so
 * every call into Lua from inside it is protected (lua_pcall): an error in fn is
 * caught, the loop frees what it holds, then the same error value is raised again. */
#include "l_tensor.h"
#include "l_parts.h"
#include "../runtime/tile.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define KILN_IDX lua_upvalueindex(1) /* the kiln module table */

static const char *const blend_valid[] = {"linear", "cosine", NULL};
static const char *const known_opts[] = {"tile", "overlap", "scale", "blend", "multiple", "gc", "progress", NULL};

/* scale: a positive number (8, 0.125, 4) or a string "num/den" -> reduced fraction */
static void check_scale(lua_State *L, int idx, const char *what, int64_t *num, int64_t *den)
{
    int t = lua_getfield(L, idx, "scale");
    *num = *den = 1;
    if (t == LUA_TNIL) { lua_pop(L, 1); return; }
    if (t == LUA_TSTRING) {
        long long a, b;
        char extra;
        if (sscanf(lua_tostring(L, -1), "%lld/%lld%c", &a, &b, &extra) != 2 || a <= 0 || b <= 0 || a > 4096 || b > 4096)
            luaL_error(L, "%s: option 'scale' \"%s\" is not a fraction \"num/den\" of positive integers up to 4096", what,
                       lua_tostring(L, -1));
        *num = a;
        *den = b;
        lua_pop(L, 1);
        return;
    }
    if (t != LUA_TNUMBER) luaL_error(L, "%s: option 'scale' must be a number or \"num/den\", got %s", what, luaL_typename(L, -1));
    double s = lua_tonumber(L, -1);
    lua_pop(L, 1);
    if (!(s > 0) || !isfinite(s) || s > 4096) luaL_error(L, "%s: option 'scale' must be in (0, 4096], got %f", what, s);
    for (int64_t d = 1; d <= 4096; d++) {
        double v = s * (double)d, r = floor(v + 0.5);
        if (r >= 1 && fabs(v - r) <= 1e-9 * v) { *num = (int64_t)r; *den = d; return; }
    }
    luaL_error(L, "%s: option 'scale' %f is not a fraction with a denominator up to 4096 (use e.g. 8 or 0.125)", what, s);
}

/* Reads the options table at idx (may be absent) into o; gc and label when asked. */
static void check_opts(lua_State *L, int idx, const char *what, kiln_tile_opts *o, int *gc, char *label, size_t nlabel)
{
    if (!lua_isnoneornil(L, idx) && !lua_istable(L, idx)) luaL_typeerror(L, idx, "options table");
    if (lua_istable(L, idx)) {
        lua_pushnil(L);
        while (lua_next(L, idx)) {
            int ok = 0;
            if (lua_type(L, -2) == LUA_TSTRING)
                for (int i = 0; known_opts[i]; i++) ok |= strcmp(lua_tostring(L, -2), known_opts[i]) == 0;
            if (!ok) {
                lua_pushvalue(L, -2);
                luaL_error(L, "%s: unknown option '%s' (known: tile, overlap, scale, blend, multiple, gc, progress)", what,
                           luaL_tolstring(L, -1, NULL));
            }
            lua_pop(L, 1);
        }
    }
    lua_Integer tile = l_opt_int_field(L, idx, "tile", 64);
    if (tile <= 0) luaL_error(L, "%s: option 'tile' must be a positive integer, got %I", what, tile);
    lua_Integer overlap = l_opt_int_field(L, idx, "overlap", tile / 4);
    if (overlap < 0 || overlap >= tile)
        luaL_error(L, "%s: option 'overlap' must be in [0, tile) = [0, %I), got %I", what, tile, overlap);
    kiln_tile_opts_init(o, tile, overlap);
    check_scale(L, idx, what, &o->scale_num, &o->scale_den);
    const char *b = l_opt_str_field(L, idx, "blend", "linear");
    int bi = kiln_blend_from_name(b);
    if (bi < 0) l_enum_error(L, idx, "blend", b, blend_valid);
    o->blend = (kiln_blend)bi;
    lua_Integer m = l_opt_int_field(L, idx, "multiple", 0);
    if (m < 0 || m > 4096) luaL_error(L, "%s: option 'multiple' must be in [0, 4096], got %I", what, m);
    o->multiple = m;
    if (gc) *gc = l_opt_bool_field(L, idx, "gc", 1);
    if (label) {
        const char *s = l_opt_str_field(L, idx, "progress", NULL);
        snprintf(label, nlabel, "%s", s ? s : "");
    }
}

typedef struct {
    lua_State *L;
    int fn, holder;        /* tile_map's stack slots: the function, a table holding the live
                            * tile input (pcall_fn gets both as arguments) */
    int gc;
    char label[64];        /* kiln.progress label; "" polls kiln.cancelled() only */
    int err;               /* 1: the error value of a failed Lua call is on top of the stack */
    kiln_tensor *y;        /* fn's output, taken from its userdata */
    int index, total;
} map_ctx;

static void mark_freed(l_tensor *u, const char *why)
{
    kiln_tensor_free(u->t);
    u->t = NULL;
    snprintf(u->freed_at, sizeof u->freed_at, "%s", why);
}

/* [-4, +0, e] protected: (ctx, tile, fn, holder) -> calls fn(tile) and takes its
 * output; fn gets the tile and its 1-based index in the plan */
static int pcall_fn(lua_State *L)
{
    map_ctx *c = lua_touserdata(L, 1);
    const kiln_tensor *tile = lua_touserdata(L, 2);
    l_push_tensor(L, kiln_tensor_view_of(tile));
    lua_pushvalue(L, -1);
    lua_rawseti(L, 4, 1); /* found and freed by the caller even when fn raises */
    lua_pushvalue(L, 3);
    lua_pushvalue(L, -2);
    lua_pushinteger(L, c->index + 1); /* the tile's index in kiln.tile.plan's list */
    lua_call(L, 2, 1);
    l_tensor *u = luaL_testudata(L, -1, KILN_TENSOR_MT);
    if (!u)
        return luaL_error(L, "kiln.tile.map: fn must return a kiln.Tensor for tile %d of %d, got %s", c->index + 1,
                          c->total, luaL_typename(L, -1));
    if (!u->t) return luaL_error(L, "kiln.tile.map: fn returned a freed tensor for tile %d of %d", c->index + 1, c->total);
    /* the output is consumed by the blend: its memory goes back now, not at the next GC */
    c->y = u->t;
    u->t = NULL;
    snprintf(u->freed_at, sizeof u->freed_at, "kiln.tile.map (a tile's output is consumed by the blend)");
    return 0;
}

static void release_tile_input(map_ctx *c)
{
    lua_State *L = c->L;
    lua_rawgeti(L, c->holder, 1);
    l_tensor *u = luaL_testudata(L, -1, KILN_TENSOR_MT);
    if (u && u->t) mark_freed(u, "kiln.tile.map (a tile input lives only during fn; clone it to keep it)");
    lua_pop(L, 1);
    lua_pushnil(L);
    lua_rawseti(L, c->holder, 1);
}

static kiln_status call_fn(void *ud, int index, const kiln_tensor *tile, kiln_tensor **out)
{
    map_ctx *c = ud;
    lua_State *L = c->L;
    *out = NULL;
    c->y = NULL;
    c->index = index;
    lua_pushcfunction(L, pcall_fn);
    lua_pushlightuserdata(L, c);
    lua_pushlightuserdata(L, (void *)tile);
    lua_pushvalue(L, c->fn);
    lua_pushvalue(L, c->holder);
    int rc = lua_pcall(L, 4, 0, 0);
    release_tile_input(c);
    if (rc != LUA_OK) {
        c->err = 1; /* the error value stays on top for the caller to raise */
        return kiln_error(KILN_ERR_STATE, "kiln.tile.map: fn raised an error");
    }
    if (c->gc) lua_gc(L, LUA_GCCOLLECT); /* intermediates of this tile die before the next */
    *out = c->y;
    c->y = NULL;
    return KILN_OK;
}

/* [-4, +0, e] protected: (kiln, ctx, done, total) -> kiln.progress(done, total,
 * label) when there is a label, then raises "cancelled" when kiln.cancelled() says so
 * (kiln.progress raises it itself) */
static int pcall_progress(lua_State *L)
{
    map_ctx *c = lua_touserdata(L, 2);
    lua_Integer done = lua_tointeger(L, 3), total = lua_tointeger(L, 4);
    if (c->label[0]) {
        if (lua_getfield(L, 1, "progress") == LUA_TFUNCTION) {
            lua_pushinteger(L, done);
            lua_pushinteger(L, total);
            lua_pushstring(L, c->label);
            lua_call(L, 3, 0);
            return 0;
        }
        lua_pop(L, 1);
    }
    if (lua_getfield(L, 1, "cancelled") == LUA_TFUNCTION) {
        lua_call(L, 0, 1);
        if (lua_toboolean(L, -1)) {
            char detail[96];
            snprintf(detail, sizeof detail, " in kiln.tile.map after tile %lld of %lld", (long long)done, (long long)total);
            l_raise_cancelled(L, detail);
        }
    }
    return 0;
}

/* Called by the C loop after each tile (inside tile_map: its upvalue is reachable). */
static int progress_fn(void *ud, int done, int total)
{
    map_ctx *c = ud;
    lua_State *L = c->L;
    lua_pushcfunction(L, pcall_progress);
    lua_pushvalue(L, KILN_IDX);
    lua_pushlightuserdata(L, c);
    lua_pushinteger(L, done);
    lua_pushinteger(L, total);
    if (lua_pcall(L, 4, 0, 0) != LUA_OK) {
        c->err = 1;
        return 1;
    }
    return 0;
}

/* kiln.tile.map(x, fn [, {tile = 64, overlap = tile/4, scale = 1, blend = "linear",
 * multiple = 0, gc = true, progress = label}]) -> result  [-0, +1, e]
 * fn(tile) gets a contiguous copy of each tile of x (the last two dims), freed when
 * fn returns, and returns that tile's output, which the blend consumes (frees). */
static int tile_map(lua_State *L)
{
    kiln_tensor *x0 = l_check_tensor(L, 1);
    if (lua_type(L, 2) != LUA_TFUNCTION && !luaL_getmetafield(L, 2, "__call")) luaL_typeerror(L, 2, "function");
    if (lua_type(L, 2) != LUA_TFUNCTION) lua_pop(L, 1);
    if (x0->ndim < 2) luaL_argerror(L, 1, "expected a tensor with at least 2 dims (tiles cover the last two)");
    map_ctx c;
    memset(&c, 0, sizeof c);
    kiln_tile_opts o;
    check_opts(L, 3, "kiln.tile.map", &o, &c.gc, c.label, sizeof c.label);
    lua_settop(L, 3);
    lua_newtable(L);
    c.L = L;
    c.fn = 2;
    c.holder = 4;
    /* our own reference: fn may free x's userdata while the loop still reads x */
    kiln_tensor *x = kiln_tensor_view_of(x0);
    if (!x) return l_raise(L, kiln_last_status() ? kiln_last_status() : KILN_ERR_STATE);
    kiln_tile_plan *p = NULL;
    if (kiln_tile_plan_new(x->shape[x->ndim - 2], x->shape[x->ndim - 1], &o, &p) == KILN_OK) {
        c.total = p->count;
        kiln_tile_plan_free(p);
    }
    kiln_tensor *r = NULL;
    kiln_status st = kiln_tile_map(x, &o, call_fn, progress_fn, &c, &r);
    kiln_tensor_free(x);
    if (c.err) return lua_error(L); /* fn's (or progress's) own error value */
    if (st) return l_raise(L, st);
    l_push_tensor(L, r);
    return 1;
}

static void set_rect(lua_State *L, const char *name, const kiln_tile_rect *r)
{
    lua_createtable(L, 0, 4);
    lua_pushinteger(L, (lua_Integer)r->y + 1);
    lua_setfield(L, -2, "y");
    lua_pushinteger(L, (lua_Integer)r->x + 1);
    lua_setfield(L, -2, "x");
    lua_pushinteger(L, (lua_Integer)r->h);
    lua_setfield(L, -2, "h");
    lua_pushinteger(L, (lua_Integer)r->w);
    lua_setfield(L, -2, "w");
    lua_setfield(L, -2, name);
}

/* kiln.tile.plan(height, width [, opts]) -> {count, rows, cols, tile, overlap,
 * multiple, scale_num, scale_den, out_h, out_w, [i] = {input = {y, x, h, w},
 * output = {y, x, h, w}}} with 1-based positions  [-0, +1, e] */
static int tile_plan(lua_State *L)
{
    lua_Integer h = luaL_checkinteger(L, 1), w = luaL_checkinteger(L, 2);
    kiln_tile_opts o;
    check_opts(L, 3, "kiln.tile.plan", &o, NULL, NULL, 0);
    kiln_tile_plan *p = NULL;
    kiln_status st = kiln_tile_plan_new(h, w, &o, &p);
    if (st) return l_raise(L, st);
    /* copy what Lua needs first, then free, then build tables (which may raise) */
    int n = p->count, rows = p->axis[0].n, cols = p->axis[1].n;
    kiln_tile_opts r = p->opts;
    int64_t oh = p->axis[0].out_size, ow = p->axis[1].out_size;
    kiln_tile_rect *rects = lua_newuserdatauv(L, sizeof *rects * 2 * (size_t)n, 0);
    for (int i = 0; i < n; i++) kiln_tile_rects(p, i, &rects[2 * i], &rects[2 * i + 1]);
    kiln_tile_plan_free(p);
    lua_createtable(L, n, 10);
    lua_pushinteger(L, n); lua_setfield(L, -2, "count");
    lua_pushinteger(L, rows); lua_setfield(L, -2, "rows");
    lua_pushinteger(L, cols); lua_setfield(L, -2, "cols");
    lua_pushinteger(L, (lua_Integer)r.tile); lua_setfield(L, -2, "tile");
    lua_pushinteger(L, (lua_Integer)r.overlap); lua_setfield(L, -2, "overlap");
    lua_pushinteger(L, (lua_Integer)r.multiple); lua_setfield(L, -2, "multiple");
    lua_pushinteger(L, (lua_Integer)r.scale_num); lua_setfield(L, -2, "scale_num");
    lua_pushinteger(L, (lua_Integer)r.scale_den); lua_setfield(L, -2, "scale_den");
    lua_pushinteger(L, (lua_Integer)oh); lua_setfield(L, -2, "out_h");
    lua_pushinteger(L, (lua_Integer)ow); lua_setfield(L, -2, "out_w");
    for (int i = 0; i < n; i++) {
        lua_createtable(L, 0, 2);
        set_rect(L, "input", &rects[2 * i]);
        set_rect(L, "output", &rects[2 * i + 1]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* kiln.mem.estimate(fn, inputs [, opts]) -> bytes, details: the function kiln.tiling
 * registers as the hook "mem_estimate" (see scripts/kiln/tiling.lua) */
static int mem_estimate(lua_State *L)
{
    int n = lua_gettop(L);
    l_hook_push(L, "mem_estimate"); /* it has a provider: pushed, or raised */
    lua_insert(L, 1);
    lua_call(L, n, LUA_MULTRET);
    return lua_gettop(L);
}

static const luaL_Reg tile_funcs[] = {
    {"map", tile_map}, {"plan", tile_plan},
    {NULL, NULL},
};

void l_open_tile(lua_State *L)
{
    lua_createtable(L, 0, 2);
    lua_pushvalue(L, -2);
    luaL_setfuncs(L, tile_funcs, 1);
    lua_setfield(L, -2, "tile");
    if (lua_getfield(L, -1, "mem") != LUA_TTABLE) {
        lua_pop(L, 1);
        lua_newtable(L);
        lua_pushvalue(L, -1);
        lua_setfield(L, -3, "mem");
    }
    lua_pushcfunction(L, mem_estimate);
    lua_setfield(L, -2, "estimate");
    lua_pop(L, 1);
}
