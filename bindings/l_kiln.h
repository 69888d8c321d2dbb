/* l_kiln.h - shared pieces of the Lua binding: the tensor userdata, argument
 * helpers, and raising kiln_status errors (typed tables for out-of-memory). */
#ifndef KILN_L_KILN_H
#define KILN_L_KILN_H

#include <lua.h>
#include <lauxlib.h>

#include "../runtime/ops.h"

#define KILN_TENSOR_MT "kiln.Tensor"
#define KILN_ERROR_MT "kiln.Error"

typedef struct {
    kiln_tensor *t;          /* NULL once freed */
    char freed_at[128];      /* "script.lua:12" where :free() / <close> released it */
} l_tensor;

/* Pushes a new tensor userdata that takes ownership of t (t may be NULL: then the
 * call raises the pending kiln error). [-0, +1, e] */
void l_push_tensor(lua_State *L, kiln_tensor *t);
/* The live tensor at idx, or a raised error (wrong type / freed). [-0, +0, v] */
kiln_tensor *l_check_tensor(lua_State *L, int idx);
l_tensor *l_check_tensor_ud(lua_State *L, int idx);
kiln_tensor *l_test_tensor(lua_State *L, int idx); /* NULL when not a live tensor */
/* Raises the current kiln error (kiln_last_error) as a Lua error with the caller's
 * position; KILN_ERR_OOM becomes a table {kind="oom", device, requested, free, budget}. */
int l_raise(lua_State *L, kiln_status st);
/* Frees the owned tensors in list then raises when st != OK. */
#define L_TRY(L, expr) do { kiln_status st_ = (expr); if (st_ != KILN_OK) l_raise((L), st_); } while (0)

/* A Lua dimension (1-based, negative from the end) to 0-based for an ndim tensor;
 * allow_end permits ndim+1 (unsqueeze). Raises with the argument number. */
int l_check_dim(lua_State *L, int arg, int ndim, int allow_end);
/* Reads a shape: a table of integers at idx, or integers idx..top. Returns ndim. */
int l_check_shape(lua_State *L, int idx, int64_t *shape, int varargs);
kiln_dtype l_check_dtype(lua_State *L, int idx);
kiln_device *l_check_device(lua_State *L, int idx);
/* Default device for new tensors (kiln.set_default_device). */
kiln_device *l_default_device(lua_State *L);
/* Integer / number / boolean field of an options table at idx (absent -> def). */
lua_Integer l_opt_int_field(lua_State *L, int idx, const char *key, lua_Integer def);
lua_Number l_opt_num_field(lua_State *L, int idx, const char *key, lua_Number def);
int l_opt_bool_field(lua_State *L, int idx, const char *key, int def);
const char *l_opt_str_field(lua_State *L, int idx, const char *key, const char *def);
/* Raises "bad argument: invalid X 'v' (expected one of: a, b, c)" (LÖVE's luax_enumerror). */
int l_enum_error(lua_State *L, int arg, const char *what, const char *value, const char *const *valid);

KILN_API const char *kiln_version_string(void);
/* The Lua module entry point (require "kiln"). */
KILN_API int luaopen_kiln(lua_State *L);
void l_human_bytes(char *buf, size_t n, double bytes);

/* Sub-module openers: each adds its functions to the kiln table at -1. */
void l_open_tensor(lua_State *L);
void l_open_nn(lua_State *L);
void l_open_io(lua_State *L);
void l_open_mem(lua_State *L);
void l_open_progress(lua_State *L); /* kiln.progress, on_progress, cancel, cancelled */

/* An embedding host's progress and cancel (bindings/embed.c): kiln.progress reports
 * to it and kiln.cancelled() asks it. The struct outlives the host's use of L. */
typedef struct {
    void (*progress)(void *ud, int step, int total, const char *message);
    int (*cancelled)(void *ud);
    void (*cancel)(void *ud, int on); /* kiln.cancel(on) from a script */
    void *ud;
} l_progress_host;
void l_progress_set_host(lua_State *L, const l_progress_host *host); /* NULL: none */
/* Raises {kind = "cancelled", message = "<where>cancelled<detail>"} (kiln.Error). */
int l_raise_cancelled(lua_State *L, const char *detail);
void l_open_model(lua_State *L);
void l_open_trace(lua_State *L); /* after l_open_mem: adds to kiln.mem */
void l_open_tile(lua_State *L);  /* kiln.tile; adds kiln.mem.estimate */
void l_open_tokenizer(lua_State *L); /* kiln.tokenizer */

#endif
