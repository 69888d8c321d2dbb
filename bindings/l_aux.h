/* l_aux.h - the bindings' lauxlib: the helpers every binding file shares (raising
 * kiln_status errors and the typed error tables, argument checks for dims, shapes,
 * dtypes and devices, option-table fields, enum errors, byte counts for people).
 * It sits at the bottom of the bindings' includes: it includes runtime headers only. */
#ifndef KILN_L_AUX_H
#define KILN_L_AUX_H

#include <lua.h>
#include <lauxlib.h>

#include "../runtime/format_bytes.h"
#include "../runtime/tensor.h"

/* ---- errors ------------------------------------------------------------------ */

/* Metatable of the typed error tables (kind = "oom", "cancelled"): __tostring gives
 * the message. Created on first use, so raising works before luaopen_kiln ran. */
#define KILN_ERROR_MT "kiln.Error"

/* Raises the current kiln error (kiln_last_error) as a Lua error with the caller's
 * position; KILN_ERR_OOM becomes a table {kind="oom", device, requested, free,
 * budget, message} with KILN_ERROR_MT.                              [-0, +1, v] */
int l_raise(lua_State *L, kiln_status st);
/* Raises st when it is not KILN_OK. Free what the call owns before it. */
#define L_TRY(L, expr) do { kiln_status st_ = (expr); if (st_ != KILN_OK) l_raise((L), st_); } while (0)
/* Raises {kind = "cancelled", message = "<where>cancelled<detail>"} (KILN_ERROR_MT). */
int l_raise_cancelled(lua_State *L, const char *detail);
/* Where the running function's caller is, as "script.lua:12" ("?" when unknown),
 * into buf: for "tensor was freed at script.lua:12" messages. [-0, +0, m] */
void l_where_string(lua_State *L, char *buf, size_t n);
/* Raises "bad argument: invalid X 'v' (expected one of: a, b, c)" (LÖVE's luax_enumerror). */
int l_enum_error(lua_State *L, int arg, const char *what, const char *value, const char *const *valid);

/* ---- arguments ------------------------------------------------------------------ */

/* A Lua dimension (1-based, negative from the end) to 0-based for an ndim tensor;
 * allow_end permits ndim+1 (unsqueeze). Raises with the argument number. */
int l_check_dim(lua_State *L, int arg, int ndim, int allow_end);
/* Reads a shape: a table of integers at idx, or integers idx..top. Returns ndim. */
int l_check_shape(lua_State *L, int idx, int64_t *shape, int varargs);
kiln_dtype l_check_dtype(lua_State *L, int idx);
kiln_device *l_check_device(lua_State *L, int idx);
/* The device named at idx, or the default device when idx is none or nil. */
kiln_device *l_opt_device(lua_State *L, int idx);
/* Default device for new tensors (kiln.set_default_device). */
kiln_device *l_default_device(lua_State *L);
void l_set_default_device(lua_State *L, const kiln_device *dev);

/* Integer / number / boolean / string field of an options table at idx (absent, or
 * idx not a table -> def); a field of the wrong type raises. */
lua_Integer l_opt_int_field(lua_State *L, int idx, const char *key, lua_Integer def);
lua_Number l_opt_num_field(lua_State *L, int idx, const char *key, lua_Number def);
int l_opt_bool_field(lua_State *L, int idx, const char *key, int def);
const char *l_opt_str_field(lua_State *L, int idx, const char *key, const char *def);

/* ---- hooks: Lua functions the C side calls back -------------------------------------
 * A script module registers its callback when it loads (kiln._register_hook(name, fn),
 * kept in the registry), so C never reaches into a module's fields by name. The names
 * and their providers are one table in l_aux.c (ORDER HOOK). */

/* Pushes the function registered as name and returns 1, or pushes nothing and returns
 * 0. A hook with a provider module that is not registered yet loads that module once
 * (require) first, and raises a clear error if it still did not register; a hook
 * without one is optional (absent: nothing to call back). An unknown name raises.
 *                                                                  [-0, +(0|1), e] */
int l_hook_push(lua_State *L, const char *name);
/* Adds kiln._register_hook(name, fn) and kiln._hook(name) -> fn or nil (for tests) to
 * the kiln table at -1. */
void l_open_hooks(lua_State *L);

/* ---- output --------------------------------------------------------------------- */

/* Pushes bytes as people read them ("1.50 GiB"; kiln_format_bytes). [-0, +1, m] */
const char *l_push_bytes(lua_State *L, double bytes);
/* Adds s[0..n) to b as the body of a JSON string (RFC 8259 escapes, no quotes). */
void l_add_json_escaped(luaL_Buffer *b, const char *s, size_t n);

#endif
