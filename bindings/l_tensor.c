/* l_tensor.c - the kiln.Tensor userdata: constructors, views, arithmetic,
 * reductions, conversion to Lua tables, and lifetime (:free, __close, __gc share
 * one idempotent release; later use says where the tensor was freed). */
#include "l_tensor.h"
#include "l_parts.h"
#include "../runtime/ops.h"
#include "../runtime/rng.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---------- userdata basics ---------- */

void l_push_tensor(lua_State *L, kiln_tensor *t)
{
    if (!t) l_raise(L, kiln_last_status() ? kiln_last_status() : KILN_ERR_STATE);
    l_tensor *u = lua_newuserdatauv(L, sizeof *u, 0);
    u->t = NULL;
    u->freed_at[0] = 0;
    luaL_setmetatable(L, KILN_TENSOR_MT);
    u->t = t;
}

l_tensor *l_check_tensor_ud(lua_State *L, int idx)
{
    return luaL_checkudata(L, idx, KILN_TENSOR_MT);
}

kiln_tensor *l_check_tensor(lua_State *L, int idx)
{
    l_tensor *u = luaL_testudata(L, idx, KILN_TENSOR_MT);
    if (!u) luaL_typeerror(L, idx, "kiln.Tensor");
    if (!u->t) {
        if (u->freed_at[0]) luaL_error(L, "tensor was freed at %s", u->freed_at);
        luaL_error(L, "tensor was freed");
    }
    return u->t;
}

kiln_tensor *l_test_tensor(lua_State *L, int idx)
{
    l_tensor *u = luaL_testudata(L, idx, KILN_TENSOR_MT);
    return u ? u->t : NULL;
}

static void release(lua_State *L, l_tensor *u, int record)
{
    if (!u->t) return;
    kiln_tensor_free(u->t);
    u->t = NULL;
    if (record) l_where_string(L, u->freed_at, sizeof u->freed_at);
}

static int t_free(lua_State *L)
{
    release(L, l_check_tensor_ud(L, 1), 1);
    return 0;
}

static int t_gc(lua_State *L)
{
    release(L, l_check_tensor_ud(L, 1), 0);
    return 0;
}

/* ---------- constructors ---------- */

/* Walks a nested table to find its shape; raises on ragged input. */
static int nested_shape(lua_State *L, int idx, int64_t *shape, int depth)
{
    if (depth >= KILN_MAX_DIMS) luaL_error(L, "kiln.tensor: more than 8 nested levels");
    int64_t n = (int64_t)luaL_len(L, idx);
    shape[depth] = n;
    if (n == 0) return depth + 1;
    lua_geti(L, idx, 1);
    int nd = depth + 1;
    if (lua_istable(L, -1)) nd = nested_shape(L, lua_gettop(L), shape, depth + 1);
    else if (!lua_isnumber(L, -1) && !lua_isboolean(L, -1))
        luaL_error(L, "kiln.tensor: element is a %s, expected a number", luaL_typename(L, -1));
    lua_pop(L, 1);
    return nd;
}

static void nested_fill(lua_State *L, int idx, const int64_t *shape, int ndim, int depth, double *out, int64_t *pos)
{
    int64_t n = (int64_t)luaL_len(L, idx);
    if (n != shape[depth]) luaL_error(L, "kiln.tensor: ragged nested table (level %d has %d and %d entries)",
                                      depth + 1, (int)shape[depth], (int)n);
    for (int64_t i = 1; i <= n; i++) {
        lua_geti(L, idx, i);
        if (depth + 1 < ndim) {
            if (!lua_istable(L, -1)) luaL_error(L, "kiln.tensor: ragged nested table at level %d", depth + 2);
            nested_fill(L, lua_gettop(L), shape, ndim, depth + 1, out, pos);
        } else {
            int ok;
            double v = lua_isboolean(L, -1) ? lua_toboolean(L, -1) : lua_tonumberx(L, -1, &ok);
            if (!lua_isboolean(L, -1) && !ok) luaL_error(L, "kiln.tensor: element is a %s, expected a number", luaL_typename(L, -1));
            out[(*pos)++] = v;
        }
        lua_pop(L, 1);
    }
}

static void opt_dtype_device(lua_State *L, int idx, kiln_dtype *dt, kiln_device **dev);

/* kiln.tensor(nested_table_or_number [, dtype | {dtype=, device=}]) */
static int l_tensor_new(lua_State *L)
{
    kiln_dtype want = KILN_F32;
    kiln_device *dev = l_default_device(L);
    /* a device named: host data such as a schedule stays on the cpu even while the
     * default device is another (a dry run's meta reads back only zeros) */
    if (lua_istable(L, 2)) opt_dtype_device(L, 2, &want, &dev);
    else if (!lua_isnoneornil(L, 2)) want = l_check_dtype(L, 2);
    /* a block type is quantized from f32 as a whole (its elements are not addressable) */
    kiln_dtype dt = kiln_dtype_is_blocked(want) ? KILN_F32 : want;
    int64_t shape[KILN_MAX_DIMS];
    int ndim = 0;
    if (lua_isnumber(L, 1)) ndim = 0;
    else if (lua_istable(L, 1)) ndim = nested_shape(L, 1, shape, 0);
    else return luaL_typeerror(L, 1, "table or number");
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) numel *= shape[i];
    double *vals = lua_newuserdatauv(L, (size_t)(numel ? numel : 1) * sizeof(double), 0);
    int64_t pos = 0;
    if (ndim == 0) vals[0] = lua_tonumber(L, 1);
    else nested_fill(L, 1, shape, ndim, 0, vals, &pos);
    kiln_tensor *t;
    L_TRY(L, kiln_tensor_new(kiln_device_cpu(), dt, ndim, shape, &t));
    /* store through f32 for floats (exact for f32 inputs) and i64 for integers */
    for (int64_t i = 0; i < numel; i++) {
        if (kiln_dtype_is_float(dt)) {
            float f = (float)vals[i];
            kiln_convert((char *)kiln_tensor_data(t) + i * (int64_t)kiln_dtype_size(dt), dt, &f, KILN_F32, 1);
        } else {
            double v = vals[i];
            int64_t iv = v != v ? 0 : v > 9.2e18 ? INT64_MAX : v < -9.2e18 ? INT64_MIN : (int64_t)v;
            kiln_convert((char *)kiln_tensor_data(t) + i * (int64_t)kiln_dtype_size(dt), dt, &iv, KILN_I64, 1);
        }
    }
    if (want != dt) {
        kiln_tensor *q;
        kiln_status st = kiln_tensor_to(t, kiln_device_cpu(), want, &q);
        kiln_tensor_free(t);
        if (st) l_raise(L, st);
        t = q;
        dt = want;
    }
    if (dev != kiln_device_cpu()) {
        kiln_tensor *m;
        kiln_status st = kiln_tensor_to(t, dev, dt, &m);
        kiln_tensor_free(t);
        if (st) l_raise(L, st);
        t = m;
    }
    l_push_tensor(L, t);
    return 1;
}

/* Options table: {dtype=, device=} at idx. */
static void opt_dtype_device(lua_State *L, int idx, kiln_dtype *dt, kiln_device **dev)
{
    *dev = l_default_device(L);
    if (lua_type(L, idx) == LUA_TSTRING) { *dt = l_check_dtype(L, idx); return; }
    if (!lua_istable(L, idx)) return;
    if (lua_getfield(L, idx, "dtype") != LUA_TNIL) *dt = l_check_dtype(L, -1);
    lua_pop(L, 1);
    if (lua_getfield(L, idx, "device") != LUA_TNIL) *dev = l_check_device(L, lua_gettop(L));
    lua_pop(L, 1);
}

static int fill_new(lua_State *L, double v, int has_value)
{
    int64_t shape[KILN_MAX_DIMS];
    luaL_checktype(L, 1, LUA_TTABLE);
    int ndim = l_check_shape(L, 1, shape, 0);
    int opt = has_value ? 3 : 2;
    if (has_value) v = luaL_checknumber(L, 2);
    kiln_dtype dt = KILN_F32;
    kiln_device *dev;
    opt_dtype_device(L, opt, &dt, &dev);
    kiln_tensor *t;
    L_TRY(L, kiln_tensor_new(dev, dt, ndim, shape, &t));
    kiln_status st = kiln_tensor_fill(t, v);
    if (st) { kiln_tensor_free(t); l_raise(L, st); }
    l_push_tensor(L, t);
    return 1;
}

static int l_zeros(lua_State *L) { return fill_new(L, 0, 0); }
static int l_ones(lua_State *L) { return fill_new(L, 1, 0); }
static int l_full(lua_State *L) { return fill_new(L, 0, 1); }

static int l_empty(lua_State *L)
{
    int64_t shape[KILN_MAX_DIMS];
    int ndim = l_check_shape(L, 1, shape, 0);
    kiln_dtype dt = KILN_F32;
    kiln_device *dev;
    opt_dtype_device(L, 2, &dt, &dev);
    kiln_tensor *t;
    L_TRY(L, kiln_tensor_new(dev, dt, ndim, shape, &t));
    l_push_tensor(L, t);
    return 1;
}

/* The global generator lives in the registry as a full userdata (one per Lua state). */
static kiln_rng *global_rng(lua_State *L)
{
    if (lua_getfield(L, LUA_REGISTRYINDEX, "kiln.rng") == LUA_TNIL) {
        lua_pop(L, 1);
        kiln_rng *g = lua_newuserdatauv(L, sizeof *g, 0);
        kiln_rng_seed(g, 67280421310721ull); /* torch's default seed */
        lua_pushvalue(L, -1);
        lua_setfield(L, LUA_REGISTRYINDEX, "kiln.rng");
    }
    kiln_rng *g = lua_touserdata(L, -1);
    lua_pop(L, 1);
    return g;
}

static int l_manual_seed(lua_State *L)
{
    lua_Integer s = luaL_checkinteger(L, 1);
    kiln_rng_seed(global_rng(L), (uint64_t)s);
    return 0;
}

static int random_new(lua_State *L, int normal)
{
    int64_t shape[KILN_MAX_DIMS];
    int ndim = l_check_shape(L, 1, shape, 0);
    kiln_dtype dt = KILN_F32;
    kiln_device *dev;
    opt_dtype_device(L, 2, &dt, &dev);
    kiln_rng local, *g = global_rng(L);
    if (lua_istable(L, 2) && lua_getfield(L, 2, "seed") != LUA_TNIL) {
        int ok;
        lua_Integer seed = lua_tointegerx(L, -1, &ok);
        if (!ok) luaL_argerror(L, 2, "seed must be an integer");
        kiln_rng_seed(&local, (uint64_t)seed);
        g = &local;
        lua_pop(L, 1);
    } else if (lua_istable(L, 2)) {
        lua_pop(L, 1);
    }
    kiln_tensor *t;
    /* noise is drawn on the host in f32 (so seeds match PyTorch's CPU generator
     * on every device), then converted and moved */
    L_TRY(L, kiln_tensor_new(kiln_device_cpu(), KILN_F32, ndim, shape, &t));
    if (normal) kiln_rng_randn_f32(g, kiln_tensor_data(t), kiln_tensor_numel(t));
    else kiln_rng_rand_f32(g, kiln_tensor_data(t), kiln_tensor_numel(t));
    if (dt != KILN_F32 || dev != kiln_device_cpu()) {
        kiln_tensor *m;
        kiln_status st = kiln_tensor_to(t, dev, dt, &m);
        kiln_tensor_free(t);
        if (st) l_raise(L, st);
        t = m;
    }
    l_push_tensor(L, t);
    return 1;
}

static int l_randn(lua_State *L) { return random_new(L, 1); }
static int l_rand(lua_State *L) { return random_new(L, 0); }

static int l_arange(lua_State *L)
{
    double a = luaL_checknumber(L, 1), b, step = 1;
    int opt;
    if (lua_isnumber(L, 2)) { b = lua_tonumber(L, 2); step = luaL_optnumber(L, 3, 1); opt = 4; }
    else { b = a; a = 0; opt = 2; }
    int all_int = a == floor(a) && b == floor(b) && step == floor(step);
    kiln_dtype dt = all_int ? KILN_I64 : KILN_F32;
    kiln_device *dev;
    opt_dtype_device(L, opt, &dt, &dev);
    kiln_tensor *t;
    L_TRY(L, kiln_op_arange(dev, a, b, step, dt, &t));
    l_push_tensor(L, t);
    return 1;
}

static int l_linspace(lua_State *L)
{
    double a = luaL_checknumber(L, 1), b = luaL_checknumber(L, 2);
    lua_Integer n = luaL_checkinteger(L, 3);
    kiln_dtype dt = KILN_F32;
    kiln_device *dev;
    opt_dtype_device(L, 4, &dt, &dev);
    kiln_tensor *t;
    L_TRY(L, kiln_op_linspace(dev, a, b, n, dt, &t));
    l_push_tensor(L, t);
    return 1;
}

/* kiln.cat(list, dim) */
static int l_cat(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    int n = (int)luaL_len(L, 1);
    if (n < 1) luaL_argerror(L, 1, "empty list of tensors");
    const kiln_tensor **list = lua_newuserdatauv(L, sizeof(kiln_tensor *) * (size_t)n, 0);
    for (int i = 0; i < n; i++) {
        lua_geti(L, 1, i + 1);
        kiln_tensor *t = l_test_tensor(L, -1);
        if (!t) luaL_argerror(L, 1, lua_pushfstring(L, "element %d is not a live tensor", i + 1));
        list[i] = t;
        lua_pop(L, 1); /* still referenced by the list table */
    }
    int dim = lua_isnoneornil(L, 2) ? 0 : l_check_dim(L, 2, list[0]->ndim, 0);
    kiln_tensor *r;
    L_TRY(L, kiln_op_cat(list, n, dim, &r));
    l_push_tensor(L, r);
    return 1;
}

/* ---------- fields and printing ---------- */

static void push_shape(lua_State *L, const kiln_tensor *t)
{
    lua_createtable(L, t->ndim, 0);
    for (int i = 0; i < t->ndim; i++) {
        lua_pushinteger(L, t->shape[i]);
        lua_rawseti(L, -2, i + 1);
    }
}

static int t_tostring(lua_State *L)
{
    l_tensor *u = l_check_tensor_ud(L, 1);
    if (!u->t) {
        lua_pushfstring(L, "tensor(freed%s%s)", u->freed_at[0] ? " at " : "", u->freed_at);
        return 1;
    }
    kiln_tensor *t = u->t;
    char shape[128], size[32];
    kiln_shape_str(t, shape, sizeof shape);
    kiln_format_bytes(size, sizeof size, (double)kiln_tensor_nbytes(t));
    lua_pushfstring(L, "tensor(%s, %s, %s, %s)", kiln_dtype_name(t->dtype), t->storage->device->name, shape, size);
    return 1;
}

static double elem_at(const kiln_tensor *t, int64_t off)
{
    return kiln_dtype_load(t->dtype, (const char *)kiln_tensor_data(t) + off * (int64_t)kiln_dtype_size(t->dtype));
}

static void push_elem(lua_State *L, const kiln_tensor *t, int64_t off)
{
    if (t->dtype == KILN_I64) {
        lua_pushinteger(L, *(const int64_t *)((const char *)kiln_tensor_data(t) + off * 8));
        return;
    }
    double v = elem_at(t, off);
    if (!kiln_dtype_is_float(t->dtype)) lua_pushinteger(L, (lua_Integer)v);
    else lua_pushnumber(L, v);
}

/* Host-readable view of t: t itself when its memory is host memory, else a copy on cpu. */
static kiln_tensor *host_readable(lua_State *L, kiln_tensor *t)
{
    if (kiln_dtype_is_blocked(t->dtype)) { /* elements of a block type are read decoded */
        kiln_tensor *c;
        L_TRY(L, kiln_tensor_to(t, kiln_device_cpu(), KILN_F32, &c));
        return c;
    }
    if (!t->storage->device->backend->to_host) return kiln_tensor_view_of(t);
    kiln_tensor *c;
    L_TRY(L, kiln_tensor_to(t, kiln_device_cpu(), t->dtype, &c));
    return c;
}

static void push_table_rec(lua_State *L, const kiln_tensor *t, int dim, int64_t off)
{
    if (dim == t->ndim) { push_elem(L, t, off); return; }
    lua_createtable(L, (int)t->shape[dim], 0);
    for (int64_t i = 0; i < t->shape[dim]; i++) {
        push_table_rec(L, t, dim + 1, off + i * t->stride[dim]);
        lua_rawseti(L, -2, i + 1);
    }
}

static int t_table(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1);
    if (kiln_tensor_numel(t) > 50000000) luaL_error(L, ":table(): tensor too large for a Lua table");
    kiln_tensor *h = host_readable(L, t);
    luaL_checkstack(L, t->ndim + 4, "nested table");
    if (t->ndim == 0) push_elem(L, h, 0);
    else push_table_rec(L, h, 0, 0);
    kiln_tensor_free(h);
    return 1;
}

static int t_item(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1);
    if (kiln_tensor_numel(t) != 1)
        return luaL_error(L, ":item(): tensor has %d elements, expected 1", (int)kiln_tensor_numel(t));
    kiln_tensor *h = host_readable(L, t);
    push_elem(L, h, 0);
    kiln_tensor_free(h);
    return 1;
}

static int t_numel(lua_State *L) { lua_pushinteger(L, kiln_tensor_numel(l_check_tensor(L, 1))); return 1; }
static int t_nbytes(lua_State *L) { lua_pushinteger(L, (lua_Integer)kiln_tensor_nbytes(l_check_tensor(L, 1))); return 1; }
static int t_dim(lua_State *L) { lua_pushinteger(L, l_check_tensor(L, 1)->ndim); return 1; }
static int t_is_contiguous(lua_State *L) { lua_pushboolean(L, kiln_tensor_is_contiguous(l_check_tensor(L, 1))); return 1; }

static int t_size(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1);
    if (lua_isnoneornil(L, 2)) { push_shape(L, t); return 1; }
    lua_pushinteger(L, t->shape[l_check_dim(L, 2, t->ndim, 0)]);
    return 1;
}

static int t_stride(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1);
    lua_createtable(L, t->ndim, 0);
    for (int i = 0; i < t->ndim; i++) {
        lua_pushinteger(L, t->stride[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* ---------- views and copies ---------- */

static int t_reshape(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    int64_t shape[KILN_MAX_DIMS];
    int n = l_check_shape(L, 2, shape, 1);
    L_TRY(L, kiln_tensor_reshape(t, n, shape, &r));
    l_push_tensor(L, r);
    return 1;
}

static int t_permute(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    int perm[KILN_MAX_DIMS];
    int64_t dims[KILN_MAX_DIMS];
    int n = l_check_shape(L, 2, dims, 1);
    if (n != t->ndim) return luaL_error(L, "permute: %d dimensions given for a %d-d tensor", n, t->ndim);
    for (int i = 0; i < n; i++) {
        int64_t d = dims[i];
        perm[i] = (int)(d < 0 ? t->ndim + d : d - 1);
    }
    L_TRY(L, kiln_tensor_permute(t, perm, &r));
    l_push_tensor(L, r);
    return 1;
}

static int t_transpose(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    int a = l_check_dim(L, 2, t->ndim, 0), b = l_check_dim(L, 3, t->ndim, 0);
    L_TRY(L, kiln_tensor_transpose(t, a, b, &r));
    l_push_tensor(L, r);
    return 1;
}

static int t_narrow(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    int d = l_check_dim(L, 2, t->ndim, 0);
    lua_Integer start = luaL_checkinteger(L, 3), len = luaL_checkinteger(L, 4);
    if (start < 0) start = t->shape[d] + start + 1;
    L_TRY(L, kiln_tensor_narrow(t, d, start - 1, len, &r));
    l_push_tensor(L, r);
    return 1;
}

static int t_select(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *n, *r;
    int d = l_check_dim(L, 2, t->ndim, 0);
    lua_Integer i = luaL_checkinteger(L, 3);
    if (i < 0) i = t->shape[d] + i + 1;
    L_TRY(L, kiln_tensor_narrow(t, d, i - 1, 1, &n));
    kiln_status st = kiln_tensor_squeeze(n, d, &r);
    kiln_tensor_free(n);
    if (st) l_raise(L, st);
    l_push_tensor(L, r);
    return 1;
}

static int t_squeeze(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    int d = lua_isnoneornil(L, 2) ? -1 : l_check_dim(L, 2, t->ndim, 0);
    L_TRY(L, kiln_tensor_squeeze(t, d, &r));
    l_push_tensor(L, r);
    return 1;
}

static int t_unsqueeze(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    int d = l_check_dim(L, 2, t->ndim, 1);
    L_TRY(L, kiln_tensor_unsqueeze(t, d, &r));
    l_push_tensor(L, r);
    return 1;
}

static int t_expand(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    int64_t shape[KILN_MAX_DIMS];
    int n = l_check_shape(L, 2, shape, 1);
    L_TRY(L, kiln_tensor_expand(t, n, shape, &r));
    l_push_tensor(L, r);
    return 1;
}

static int t_contiguous(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    L_TRY(L, kiln_tensor_contiguous(t, &r));
    l_push_tensor(L, r);
    return 1;
}

static int t_clone(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    L_TRY(L, kiln_tensor_to(t, t->storage->device, t->dtype, &r));
    l_push_tensor(L, r);
    return 1;
}

/* t:copy(src): copies src (broadcast, converted) into t in place; returns t. */
static int t_copy(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *s = l_check_tensor(L, 2);
    L_TRY(L, kiln_tensor_copy(t, s));
    lua_settop(L, 1);
    return 1;
}

static int t_fill(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1);
    L_TRY(L, kiln_tensor_fill(t, luaL_checknumber(L, 2)));
    lua_settop(L, 1);
    return 1;
}

/* t:to(dtype_or_device [, dtype_or_device]) */
static int t_to(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    kiln_device *dev = t->storage->device;
    kiln_dtype dt = t->dtype;
    for (int i = 2; i <= 3 && !lua_isnoneornil(L, i); i++) {
        const char *s = luaL_checkstring(L, i);
        int d = kiln_dtype_from_name(s);
        if (d >= 0) dt = (kiln_dtype)d;
        else {
            dev = kiln_device_get(s);
            if (!dev) luaL_argerror(L, i, lua_pushfstring(L, "'%s' is neither a dtype (f32, f16, bf16, i32, i64, u8) nor a device: %s", s, kiln_last_error()));
        }
    }
    L_TRY(L, kiln_tensor_to(t, dev, dt, &r));
    l_push_tensor(L, r);
    return 1;
}

/* t:move(device) -> t: moves t's data to another device in place - the same Lua
 * object, now over a contiguous copy on `device` (its old storage is released, and
 * freed when no other view holds it). For parking a live activation on the host
 * while other work uses the device (the tiled VAE's lockstep tiles). */
static int t_move(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1), *r;
    const char *name = luaL_checkstring(L, 2);
    kiln_device *dev = kiln_device_get(name);
    if (!dev) return luaL_argerror(L, 2, lua_pushfstring(L, "'%s' is not a device: %s", name, kiln_last_error()));
    if (dev != t->storage->device) {
        L_TRY(L, kiln_tensor_to(t, dev, t->dtype, &r));
        kiln_storage *old = t->storage;
        t->storage = r->storage;
        t->offset = r->offset;
        memcpy(t->stride, r->stride, sizeof t->stride);
        r->storage = old;
        kiln_tensor_free(r);
    }
    lua_settop(L, 1);
    return 1;
}

/* ---------- arithmetic ---------- */

static int binary(lua_State *L, kiln_binop op)
{
    kiln_tensor *a = l_test_tensor(L, 1), *b = l_test_tensor(L, 2), *r;
    if (a && b) L_TRY(L, kiln_op_binary(op, a, b, &r));
    else if (a && lua_isnumber(L, 2)) L_TRY(L, kiln_op_binary_scalar(op, a, lua_tonumber(L, 2), 0, &r));
    else if (b && lua_isnumber(L, 1)) L_TRY(L, kiln_op_binary_scalar(op, b, lua_tonumber(L, 1), 1, &r));
    else {
        /* say precisely which operand is wrong (freed tensors included) */
        int bad = (a || lua_isnumber(L, 1)) ? 2 : 1;
        if (luaL_testudata(L, bad, KILN_TENSOR_MT)) l_check_tensor(L, bad);
        return luaL_error(L, "attempt to perform arithmetic on a %s value (operand %d: expected a tensor or a number)",
                          luaL_typename(L, bad), bad);
    }
    l_push_tensor(L, r);
    return 1;
}

static int t_add(lua_State *L) { return binary(L, KILN_BIN_ADD); }
static int t_sub(lua_State *L) { return binary(L, KILN_BIN_SUB); }
static int t_mul(lua_State *L) { return binary(L, KILN_BIN_MUL); }
static int t_div(lua_State *L) { return binary(L, KILN_BIN_DIV); }
static int t_pow(lua_State *L) { return binary(L, KILN_BIN_POW); }
static int t_minimum(lua_State *L) { return binary(L, KILN_BIN_MIN); }
static int t_maximum(lua_State *L) { return binary(L, KILN_BIN_MAX); }

static int unary(lua_State *L, kiln_unop op, double p0, double p1)
{
    kiln_tensor *a = l_check_tensor(L, 1), *r;
    L_TRY(L, kiln_op_unary(op, a, p0, p1, &r));
    l_push_tensor(L, r);
    return 1;
}

static int t_neg(lua_State *L) { return unary(L, KILN_UN_NEG, 0, 0); }
static int t_exp(lua_State *L) { return unary(L, KILN_UN_EXP, 0, 0); }
static int t_log(lua_State *L) { return unary(L, KILN_UN_LOG, 0, 0); }
static int t_sqrt(lua_State *L) { return unary(L, KILN_UN_SQRT, 0, 0); }
static int t_abs(lua_State *L) { return unary(L, KILN_UN_ABS, 0, 0); }
static int t_tanh(lua_State *L) { return unary(L, KILN_UN_TANH, 0, 0); }
static int t_sigmoid(lua_State *L) { return unary(L, KILN_UN_SIGMOID, 0, 0); }
static int t_sin(lua_State *L) { return unary(L, KILN_UN_SIN, 0, 0); }
static int t_cos(lua_State *L) { return unary(L, KILN_UN_COS, 0, 0); }
static int t_relu(lua_State *L) { return unary(L, KILN_UN_RELU, 0, 0); }

static int t_clamp(lua_State *L)
{
    double lo = lua_isnoneornil(L, 2) ? NAN : luaL_checknumber(L, 2);
    double hi = lua_isnoneornil(L, 3) ? NAN : luaL_checknumber(L, 3);
    return unary(L, KILN_UN_CLAMP, lo, hi);
}

static int t_unm(lua_State *L) { return unary(L, KILN_UN_NEG, 0, 0); }

static int reduce(lua_State *L, kiln_redop op)
{
    kiln_tensor *a = l_check_tensor(L, 1), *r;
    int dim = lua_isnoneornil(L, 2) ? -1 : l_check_dim(L, 2, a->ndim, 0);
    int keepdim = lua_toboolean(L, 3);
    int unbiased = lua_isnoneornil(L, 4) ? 1 : lua_toboolean(L, 4);
    L_TRY(L, kiln_op_reduce(op, a, dim, keepdim, unbiased, &r));
    if (dim < 0 && !keepdim) { /* whole-tensor reductions return a Lua number, as :item() */
        kiln_tensor *h = host_readable(L, r);
        kiln_tensor_free(r);
        push_elem(L, h, 0);
        kiln_tensor_free(h);
        return 1;
    }
    l_push_tensor(L, r);
    return 1;
}

static int t_sum(lua_State *L) { return reduce(L, KILN_RED_SUM); }
static int t_mean(lua_State *L) { return reduce(L, KILN_RED_MEAN); }
static int t_max(lua_State *L) { return reduce(L, KILN_RED_MAX); }
static int t_min(lua_State *L) { return reduce(L, KILN_RED_MIN); }
static int t_var(lua_State *L) { return reduce(L, KILN_RED_VAR); }

static int t_matmul(lua_State *L)
{
    kiln_tensor *a = l_check_tensor(L, 1), *b = l_check_tensor(L, 2), *r;
    L_TRY(L, kiln_op_matmul(a, b, &r));
    l_push_tensor(L, r);
    return 1;
}

/* ---------- metatable ---------- */

static int t_index(lua_State *L)
{
    l_tensor *u = l_check_tensor_ud(L, 1);
    if (lua_type(L, 2) == LUA_TSTRING) {
        const char *k = lua_tostring(L, 2);
        if (strcmp(k, "shape") == 0) { push_shape(L, l_check_tensor(L, 1)); return 1; }
        if (strcmp(k, "dtype") == 0) { lua_pushstring(L, kiln_dtype_name(l_check_tensor(L, 1)->dtype)); return 1; }
        if (strcmp(k, "device") == 0) { lua_pushstring(L, l_check_tensor(L, 1)->storage->device->name); return 1; }
        if (strcmp(k, "ndim") == 0) { lua_pushinteger(L, l_check_tensor(L, 1)->ndim); return 1; }
        lua_getmetatable(L, 1);
        lua_getfield(L, -1, "__methods");
        lua_getfield(L, -1, k);
        return 1;
    }
    if (lua_isinteger(L, 2)) {
        kiln_tensor *t = l_check_tensor(L, 1);
        (void)u;
        if (t->ndim == 0) return luaL_error(L, "cannot index a 0-d tensor (use :item())");
        lua_Integer i = lua_tointeger(L, 2);
        if (i < 0) i = t->shape[0] + i + 1;
        if (i < 1 || i > t->shape[0])
            return luaL_error(L, "index %d out of range for dimension 1 of size %d", (int)lua_tointeger(L, 2), (int)t->shape[0]);
        if (t->ndim == 1) {
            kiln_tensor *h = host_readable(L, t);
            push_elem(L, h, (i - 1) * t->stride[0]);
            kiln_tensor_free(h);
            return 1;
        }
        kiln_tensor *n, *r;
        L_TRY(L, kiln_tensor_narrow(t, 0, i - 1, 1, &n));
        kiln_status st = kiln_tensor_squeeze(n, 0, &r);
        kiln_tensor_free(n);
        if (st) l_raise(L, st);
        l_push_tensor(L, r);
        return 1;
    }
    return luaL_error(L, "tensors are indexed by integers or method names, not %s", luaL_typename(L, 2));
}

static int t_len(lua_State *L)
{
    kiln_tensor *t = l_check_tensor(L, 1);
    lua_pushinteger(L, t->ndim ? t->shape[0] : 0);
    return 1;
}

static const luaL_Reg tensor_methods[] = {
    {"free", t_free}, {"table", t_table}, {"item", t_item}, {"numel", t_numel}, {"nbytes", t_nbytes},
    {"dim", t_dim}, {"size", t_size}, {"stride", t_stride}, {"is_contiguous", t_is_contiguous},
    {"reshape", t_reshape}, {"view", t_reshape}, {"permute", t_permute}, {"transpose", t_transpose},
    {"narrow", t_narrow}, {"select", t_select}, {"squeeze", t_squeeze}, {"unsqueeze", t_unsqueeze},
    {"expand", t_expand}, {"contiguous", t_contiguous}, {"clone", t_clone}, {"copy", t_copy},
    {"fill", t_fill}, {"to", t_to}, {"move", t_move},
    {"add", t_add}, {"sub", t_sub}, {"mul", t_mul}, {"div", t_div}, {"pow", t_pow},
    {"minimum", t_minimum}, {"maximum", t_maximum},
    {"neg", t_neg}, {"exp", t_exp}, {"log", t_log}, {"sqrt", t_sqrt}, {"abs", t_abs}, {"tanh", t_tanh},
    {"sigmoid", t_sigmoid}, {"sin", t_sin}, {"cos", t_cos}, {"relu", t_relu}, {"clamp", t_clamp},
    {"sum", t_sum}, {"mean", t_mean}, {"max", t_max}, {"min", t_min}, {"var", t_var},
    {"matmul", t_matmul},
    {NULL, NULL},
};

static const luaL_Reg tensor_meta[] = {
    {"__index", t_index}, {"__gc", t_gc}, {"__close", t_free}, {"__tostring", t_tostring},
    {"__add", t_add}, {"__sub", t_sub}, {"__mul", t_mul}, {"__div", t_div}, {"__pow", t_pow},
    {"__unm", t_unm}, {"__len", t_len},
    {NULL, NULL},
};

static const luaL_Reg tensor_funcs[] = {
    {"tensor", l_tensor_new}, {"zeros", l_zeros}, {"ones", l_ones}, {"full", l_full}, {"empty", l_empty},
    {"randn", l_randn}, {"rand", l_rand}, {"manual_seed", l_manual_seed},
    {"arange", l_arange}, {"linspace", l_linspace}, {"cat", l_cat},
    {"add", t_add}, {"sub", t_sub}, {"mul", t_mul}, {"div", t_div}, {"pow", t_pow},
    {"minimum", t_minimum}, {"maximum", t_maximum}, {"exp", t_exp}, {"log", t_log}, {"sqrt", t_sqrt},
    {"abs", t_abs}, {"tanh", t_tanh}, {"clamp", t_clamp}, {"matmul", t_matmul},
    {NULL, NULL},
};

void l_open_tensor(lua_State *L)
{
    luaL_newmetatable(L, KILN_TENSOR_MT);
    luaL_setfuncs(L, tensor_meta, 0);
    luaL_newlib(L, tensor_methods);
    lua_setfield(L, -2, "__methods");
    lua_pushstring(L, "kiln.Tensor");
    lua_setfield(L, -2, "__name");
    lua_pop(L, 1);
    luaL_setfuncs(L, tensor_funcs, 0);
}
