/* l_scripts.h - the Lua scripts compiled into kiln and the package searcher that
 * serves them. The table is generated at build time by bindings/gen_scripts.lua;
 * KILN_PATH (or the source tree, for the CLI) overrides it from disk. */
#ifndef KILN_L_SCRIPTS_H
#define KILN_L_SCRIPTS_H

#include <stddef.h>

#include "lua.h"

typedef struct {
    const char *name;          /* module name: "kiln.unet", "kiln.nn" */
    const char *chunkname;     /* "@scripts/kiln/unet.lua": errors read like the file */
    const unsigned char *data; /* source text, NUL-terminated */
    size_t size;               /* bytes, without the NUL */
} kiln_embedded_script;

/* Generated: kiln_embedded_script_count entries, then one all-zero sentinel. */
extern const kiln_embedded_script kiln_embedded_scripts[];
extern const size_t kiln_embedded_script_count;

/* Inserts the kiln searcher at package.searchers[2] (after preload, before the
 * LUA_PATH/LUA_CPATH searchers). Idempotent per state; does nothing if the package
 * library is not open. The searcher looks in the directories of KILN_PATH first
 * (';'-separated, each holding kiln/xxx.lua: the scripts/ folder), then in the
 * embedded copies. KILN_PATH set but empty means embedded only; KILN_PATH is ignored
 * when the registry has LUA_NOENV set (lua -E).                   [-0, +0, e] */
void kiln_scripts_install(lua_State *L);

/* Replaces the directories searched before the embedded copies (';'-separated;
 * NULL: embedded only). Installs the searcher if needed.          [-0, +0, e] */
void kiln_scripts_set_path(lua_State *L, const char *path);

/* For the CLI: when KILN_PATH is not set (and the environment is not ignored) and
 * the current directory is kiln's source tree (scripts/kiln/ and
 * bindings/l_scripts.h exist), search "scripts" on disk before the embedded
 * copies, so edited scripts run without a rebuild. Returns 1 if it did. [-0, +0, e] */
int kiln_scripts_prefer_source_tree(lua_State *L);

/* Embedded script named name, or NULL. */
const kiln_embedded_script *kiln_scripts_find(const char *name);

#endif
