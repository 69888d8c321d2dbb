/* l_kiln.c - luaopen_kiln: the `kiln` module table. It opens the parts (one binding
 * file each, declared in l_parts.h: a header without a .c, so that the parts and this
 * file do not point at each other), lazily loads the shipped script modules on first
 * use of kiln.<name>, and installs the embedded-script searcher. */
#include "l_parts.h"
#include "l_scripts.h"
#include "../kernels/backends.h"

#include <string.h>

/* kiln.xxx for a shipped script module loads it on first use (kiln.sample ->
 * require "kiln.sample"); a few functions of those modules are reachable directly
 * from the kiln table, as the documented API names them. */
static const struct { const char *name, *module, *field; } lazy[] = {
    {"load_checkpoint", "kiln.checkpoint", "load"},
    {"families", "kiln.family", "names"}, /* the registry's list, current after a register */
    {"load_controlnet", "kiln.controlnet", "load"},
    {"load_taesd", "kiln.taesd", "load"},
    {"load_upscaler", "kiln.upscaler", "load"},
    {"load_t5", "kiln.t5", "load"},
    {"dry_run", "kiln.dry_run", "run"},
    {"show", "kiln.repl", "show"},
    {NULL, NULL, NULL},
};

static int kiln_index(lua_State *L)
{
    if (lua_type(L, 2) != LUA_TSTRING) return 0;
    const char *k = lua_tostring(L, 2);
    const char *module = NULL, *field = NULL;
    for (int i = 0; lazy[i].name; i++)
        if (strcmp(k, lazy[i].name) == 0) { module = lazy[i].module; field = lazy[i].field; }
    if (!module) {
        lua_pushfstring(L, "kiln.%s", k);
        if (!kiln_scripts_find(lua_tostring(L, -1))) return 0;
        module = lua_tostring(L, -1);
    }
    lua_getglobal(L, "require");
    lua_pushstring(L, module);
    lua_call(L, 1, 1);
    if (field) {
        lua_getfield(L, -1, field);
        return 1;
    }
    lua_pushvalue(L, -1);
    lua_setfield(L, 1, k); /* cache: later lookups are plain fields */
    return 1;
}

int luaopen_kiln(lua_State *L)
{
    kiln_backends_register_all(); /* the runtime's devices compute through these */
    lua_newtable(L);
    l_open_runtime(L);
    l_open_tensor(L);
    l_open_nn(L);
    l_open_io(L);
    l_open_mem(L);
    l_open_progress(L);
    l_open_model(L);
    l_open_trace(L);
    l_open_mem_plot(L);
    l_open_tile(L);
    l_open_tokenizer(L);
    l_open_t5(L);
    l_open_json(L);
    l_open_config(L);
    l_open_queue(L);
    l_open_meta(L);
    l_open_suspend(L);
    l_open_fault(L);
    l_open_hooks(L);

    lua_createtable(L, 0, 1);
    lua_pushcfunction(L, kiln_index);
    lua_setfield(L, -2, "__index");
    lua_setmetatable(L, -2);

    kiln_scripts_install(L);
    return 1;
}
