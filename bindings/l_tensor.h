/* l_tensor.h - the kiln.Tensor userdata as the other binding files reach it: push a
 * runtime tensor to Lua, check or test an argument (bindings/l_tensor.c). */
#ifndef KILN_L_TENSOR_H
#define KILN_L_TENSOR_H

#include "l_aux.h"

#define KILN_TENSOR_MT "kiln.Tensor"

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

#endif
