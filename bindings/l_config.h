/* l_config.h - setting up a runtime from Lua (kiln.configure, kiln.parse_size,
 * l_settings_apply) and which Lua state the allocators' pressure hook collects on each
 * thread. */
#ifndef KILN_L_CONFIG_H
#define KILN_L_CONFIG_H

#include <lua.h>
#include <stdint.h>

#include "../runtime/settings.h"

/* "6G", "512M", "1.5GiB", "100000", "2 KB" -> bytes, in binary units (K = 1024);
 * the only size parser. Returns 0 when text is not a size. */
int l_parse_size(const char *text, uint64_t *bytes);

/* kiln_settings_apply (settings.h) for the state L: a budget without a device is the
 * default device's; quiet (0 or 1; -1: leave it) sets kiln.quiet() once the settings
 * passed their check; a device given becomes L's default device once they are applied.
 * Returns the status, *failed the field refused (message: kiln_last_error(), the
 * reason alone). Raises only on a Lua memory error.                 [-0, +0, m] */
kiln_status l_settings_apply(lua_State *L, const kiln_settings *settings, int quiet, kiln_setting *failed);

/* Which state the pressure hook collects: each state that opened kiln (l_open_config)
 * is its opening thread's target until it closes; a call entered through kiln.h
 * makes its state the target of the calling thread for the call's length.
 * l_pressure_enter returns the target it replaced, for l_pressure_leave. */
lua_State *l_pressure_enter(lua_State *L);
void l_pressure_leave(lua_State *previous);

#endif
