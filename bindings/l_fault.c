/* l_fault.c - kiln.fault: the test hook of runtime/fault.h from Lua.
 *   kiln.fault.arm("alloc" | "write", n)  -- the n-th such event from now fails (0: off)
 *   kiln.fault.count("alloc" | "write")   -- events since the last arm */
#include "l_parts.h"
#include "../runtime/fault.h"

static kiln_fault_kind check_kind(lua_State *L, int idx)
{
    const char *name = luaL_checkstring(L, idx);
    int k = kiln_fault_from_name(name);
    if (k < 0) luaL_argerror(L, idx, lua_pushfstring(L, "fault '%s': \"alloc\" or \"write\"", name));
    return (kiln_fault_kind)k;
}

static int fault_arm(lua_State *L)
{
    kiln_fault_kind k = check_kind(L, 1);
    lua_Integer n = luaL_optinteger(L, 2, 0);
    luaL_argcheck(L, n >= 0, 2, "n must be >= 0 (0 disarms)");
    kiln_fault_arm(k, (int64_t)n);
    return 0;
}

static int fault_count(lua_State *L)
{
    lua_pushinteger(L, (lua_Integer)kiln_fault_count(check_kind(L, 1)));
    return 1;
}

static const luaL_Reg fault_funcs[] = {{"arm", fault_arm}, {"count", fault_count}, {NULL, NULL}};

void l_open_fault(lua_State *L)
{
    luaL_newlib(L, fault_funcs);
    lua_setfield(L, -2, "fault");
}
