/* l_config.h - setting up a runtime from Lua (kiln.configure, kiln.parse_size) and
 * which Lua state the allocators' pressure hook collects on each thread. */
#ifndef KILN_L_CONFIG_H
#define KILN_L_CONFIG_H

#include <lua.h>
#include <stdint.h>

/* "6G", "512M", "1.5GiB", "100000", "2 KB" -> bytes, in binary units (K = 1024);
 * the only size parser. Returns 0 when text is not a size. */
int l_parse_size(const char *text, uint64_t *bytes);

/* Which state the pressure hook collects: each state that opened kiln (l_open_config)
 * is its opening thread's target until it closes; a call entered through kiln.h
 * makes its state the target of the calling thread for the call's length.
 * l_pressure_enter returns the target it replaced, for l_pressure_leave. */
lua_State *l_pressure_enter(lua_State *L);
void l_pressure_leave(lua_State *previous);

#endif
