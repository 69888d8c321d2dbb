/* l_meta.c - the primitives of a dry run (kiln.dry_run, scripts/kiln/dry_run.lua):
 * kiln.mem.meta_begin / meta_end / meta_target, which make the shape-only device
 * `meta` model another device and answer to its name, then give it back. */
#include "l_parts.h"
#include "l_config.h"
#include "../runtime/meta.h"

/* kiln.mem.meta_begin(device, budget) -> name of the modelled device.
 * budget: bytes or a size string ("6G"); nil or 0: none.               [-2, +1, e] */
static int meta_begin(lua_State *L)
{
    kiln_device *d = l_check_device(L, 1);
    uint64_t budget = 0;
    if (lua_type(L, 2) == LUA_TSTRING) {
        if (l_parse_size(lua_tostring(L, 2), &budget) != KILN_OK)
            return luaL_argerror(L, 2, lua_pushfstring(L, "not a size: '%s' (e.g. 6G, 512M)", lua_tostring(L, 2)));
    } else if (!lua_isnoneornil(L, 2)) {
        lua_Integer b = luaL_checkinteger(L, 2);
        if (b < 0) return luaL_argerror(L, 2, "budget must be >= 0 bytes (0 = none)");
        budget = (uint64_t)b;
    }
    L_TRY(L, kiln_meta_begin(d, budget));
    lua_pushstring(L, d->name);
    return 1;
}

/* kiln.mem.meta_end() -> bytes still allocated on meta by tensors that outlived
 * the run (models' copies are dropped).                                [-0, +1, -] */
static int meta_end(lua_State *L)
{
    lua_pushinteger(L, (lua_Integer)kiln_meta_end());
    return 1;
}

/* kiln.mem.meta_target() -> name of the device being modelled, or nil. [-0, +1, -] */
static int meta_target(lua_State *L)
{
    kiln_device *d = kiln_meta_target();
    if (d) lua_pushstring(L, d->name);
    else lua_pushnil(L);
    return 1;
}

/* kiln.mem.meta_mark() -> peak allocated, peak reserved bytes on meta since the
 * previous mark (or meta_begin); the next interval starts now.       [-0, +2, -] */
static int meta_mark(lua_State *L)
{
    uint64_t a, r;
    kiln_meta_mark(&a, &r);
    lua_pushinteger(L, (lua_Integer)a);
    lua_pushinteger(L, (lua_Integer)r);
    return 2;
}

/* kiln.mem.meta_scratch() -> the kernel scratch outside the modelled device's
 * allocator (the CPU's host scratch) that the dry run predicts at its peak, bytes:
 * the real run's kiln.mem.stats("cpu").workspace_peak is never above it.  [-0, +1, -] */
static int meta_scratch(lua_State *L)
{
    lua_pushinteger(L, (lua_Integer)kiln_meta_scratch_peak());
    return 1;
}

static const luaL_Reg meta_funcs[] = {
    {"meta_begin", meta_begin}, {"meta_end", meta_end}, {"meta_target", meta_target}, {"meta_mark", meta_mark},
    {"meta_scratch", meta_scratch},
    {NULL, NULL},
};

void l_open_meta(lua_State *L)
{
    if (lua_getfield(L, -1, "mem") != LUA_TTABLE) luaL_error(L, "kiln.mem must be opened before the dry run's part");
    luaL_setfuncs(L, meta_funcs, 0);
    lua_pop(L, 1);
}
