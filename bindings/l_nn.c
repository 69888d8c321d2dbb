/* l_nn.c - kiln.nn: the functional neural-network ops, with the names and
 * semantics of PyTorch's torch.nn.functional (the documented API). */
#include "l_tensor.h"
#include "l_parts.h"
#include "../runtime/ops.h"

#include <math.h>
#include <string.h>

static kiln_tensor *opt_tensor(lua_State *L, int idx)
{
    if (lua_isnoneornil(L, idx)) return NULL;
    return l_check_tensor(L, idx);
}

/* rp is read after the op ran (argument evaluation order is unspecified in C). */
static int push(lua_State *L, kiln_status st, kiln_tensor **rp)
{
    if (st) l_raise(L, st);
    l_push_tensor(L, *rp);
    return 1;
}

/* linear(x, w [, b]) */
static int nn_linear(lua_State *L)
{
    kiln_tensor *x = l_check_tensor(L, 1), *w = l_check_tensor(L, 2), *b = opt_tensor(L, 3), *r;
    return push(L, kiln_op_linear(x, w, b, &r), &r);
}

/* A pair option: a number or {h, w}. */
static void pair_field(lua_State *L, int idx, const char *key, int64_t *v, int64_t def)
{
    v[0] = v[1] = def;
    if (!lua_istable(L, idx)) return;
    int t = lua_getfield(L, idx, key);
    if (t == LUA_TNUMBER) v[0] = v[1] = lua_tointeger(L, -1);
    else if (t == LUA_TTABLE) {
        lua_geti(L, -1, 1); v[0] = lua_tointeger(L, -1); lua_pop(L, 1);
        lua_geti(L, -1, 2); v[1] = lua_tointeger(L, -1); lua_pop(L, 1);
    } else if (t != LUA_TNIL) luaL_error(L, "conv2d: option '%s' must be a number or {h, w}", key);
    lua_pop(L, 1);
}

/* conv2d(x, w [, b] [, {stride=, padding=, dilation=, groups=, upsample=, leaky_relu=slope,
 *                       residual=tensor}]) */
static int nn_conv2d(lua_State *L)
{
    kiln_tensor *x = l_check_tensor(L, 1), *w = l_check_tensor(L, 2), *b = NULL, *r;
    int opt = 3;
    if (l_test_tensor(L, 3) || luaL_testudata(L, 3, KILN_TENSOR_MT)) { b = l_check_tensor(L, 3); opt = 4; }
    else if (lua_isnil(L, 3)) opt = 4;
    if (!lua_isnoneornil(L, opt) && !lua_istable(L, opt)) luaL_typeerror(L, opt, "options table");
    kiln_conv_opts o;
    pair_field(L, opt, "stride", o.stride, 1);
    pair_field(L, opt, "padding", o.padding, 0);
    pair_field(L, opt, "dilation", o.dilation, 1);
    o.groups = l_opt_int_field(L, opt, "groups", 1);
    o.upsample = l_opt_int_field(L, opt, "upsample", 1);
    /* leaky_relu = slope: the activation applied to the output by the op */
    o.act = 0;
    o.act_slope = 0;
    if (lua_istable(L, opt)) {
        if (lua_getfield(L, opt, "leaky_relu") != LUA_TNIL) {
            if (!lua_isnumber(L, -1)) luaL_error(L, "conv2d: option 'leaky_relu' must be a number (the negative slope)");
            o.act = 1;
            o.act_slope = lua_tonumber(L, -1);
        }
        lua_pop(L, 1);
    }
    /* residual = tensor: added to the output before the activation (a skip connection) */
    o.residual = NULL;
    if (lua_istable(L, opt)) {
        if (lua_getfield(L, opt, "residual") != LUA_TNIL) {
            if (!luaL_testudata(L, -1, KILN_TENSOR_MT)) luaL_error(L, "conv2d: option 'residual' must be a tensor");
            o.residual = l_check_tensor(L, -1); /* a freed one: the usual error, where it was freed */
        }
        lua_pop(L, 1); /* the options table still holds the residual */
    }
    return push(L, kiln_op_conv2d(x, w, b, &o, &r), &r);
}

/* group_norm(x, groups, w, b [, eps] [, {silu=true}]) */
static int nn_group_norm(lua_State *L)
{
    kiln_tensor *x = l_check_tensor(L, 1), *r;
    lua_Integer g = luaL_checkinteger(L, 2);
    kiln_tensor *w = opt_tensor(L, 3), *b = opt_tensor(L, 4);
    double eps = luaL_optnumber(L, 5, 1e-5);
    int silu = l_opt_bool_field(L, 6, "silu", 0);
    if (l_opt_bool_field(L, 6, "inplace", 0)) { /* the result is x itself */
        kiln_status st = kiln_op_group_norm_in_place(x, g, w, b, eps, silu);
        if (st) return l_raise(L, st);
        lua_pushvalue(L, 1);
        return 1;
    }
    return push(L, kiln_op_group_norm(x, g, w, b, eps, silu, &r), &r);
}

/* layer_norm(x, w, b [, eps]) over the last dimension */
static int nn_layer_norm(lua_State *L)
{
    kiln_tensor *x = l_check_tensor(L, 1), *w = opt_tensor(L, 2), *b = opt_tensor(L, 3), *r;
    double eps = luaL_optnumber(L, 4, 1e-5);
    return push(L, kiln_op_layer_norm(x, w, b, eps, &r), &r);
}

static int act(lua_State *L, kiln_unop op)
{
    kiln_tensor *x = l_check_tensor(L, 1), *r;
    return push(L, kiln_op_unary(op, x, 0, 0, &r), &r);
}

static int nn_silu(lua_State *L) { return act(L, KILN_UN_SILU); }
static int nn_sigmoid(lua_State *L) { return act(L, KILN_UN_SIGMOID); }
static int nn_quick_gelu(lua_State *L) { return act(L, KILN_UN_QUICK_GELU); }
static int nn_relu(lua_State *L) { return act(L, KILN_UN_RELU); }

/* leaky_relu(x [, negative_slope = 0.01]) as torch.nn.functional.leaky_relu */
static int nn_leaky_relu(lua_State *L)
{
    kiln_tensor *x = l_check_tensor(L, 1), *r;
    return push(L, kiln_op_unary(KILN_UN_LEAKY_RELU, x, luaL_optnumber(L, 2, 0.01), 0, &r), &r);
}

/* gelu(x [, {approximate = "none"|"tanh"}]) or gelu(x, "tanh") */
static int nn_gelu(lua_State *L)
{
    const char *approx = lua_type(L, 2) == LUA_TSTRING ? lua_tostring(L, 2) : l_opt_str_field(L, 2, "approximate", "none");
    if (strcmp(approx, "tanh") == 0) return act(L, KILN_UN_GELU_TANH);
    if (strcmp(approx, "none") != 0) {
        static const char *const valid[] = {"none", "tanh", NULL};
        l_enum_error(L, 2, "approximate", approx, valid);
    }
    return act(L, KILN_UN_GELU);
}

static int nn_geglu(lua_State *L)
{
    kiln_tensor *x = l_check_tensor(L, 1), *r;
    return push(L, kiln_op_geglu(x, &r), &r);
}

static int nn_softmax(lua_State *L)
{
    kiln_tensor *x = l_check_tensor(L, 1), *r;
    int dim = l_check_dim(L, 2, x->ndim, 0);
    return push(L, kiln_op_softmax(x, dim, &r), &r);
}

/* attention(q, k, v [, {scale=, causal=}]) with [B, heads, L, D] */
static int nn_attention(lua_State *L)
{
    kiln_tensor *q = l_check_tensor(L, 1), *k = l_check_tensor(L, 2), *v = l_check_tensor(L, 3), *r;
    double def = q->ndim == 4 && q->shape[3] > 0 ? 1.0 / sqrt((double)q->shape[3]) : 1.0;
    double scale = l_opt_num_field(L, 4, "scale", def);
    int causal = l_opt_bool_field(L, 4, "causal", 0);
    return push(L, kiln_op_attention(q, k, v, scale, causal, &r), &r);
}

static int nn_upsample_nearest(lua_State *L)
{
    kiln_tensor *x = l_check_tensor(L, 1), *r;
    lua_Integer f = luaL_optinteger(L, 2, 2);
    if (f < 1) luaL_argerror(L, 2, "factor must be a positive integer");
    if (x->ndim != 4) luaL_argerror(L, 1, "expected a 4-d tensor [N, C, H, W]");
    return push(L, kiln_op_resample(KILN_RS_NEAREST, x, x->shape[2] * f, x->shape[3] * f, &r), &r);
}

/* interpolate(x, {size = {h, w}} | {scale_factor = s}, mode = "nearest"|"nearest-exact"|"bilinear") */
static int nn_interpolate(lua_State *L)
{
    kiln_tensor *x = l_check_tensor(L, 1), *r;
    luaL_checktype(L, 2, LUA_TTABLE);
    if (x->ndim != 4) luaL_argerror(L, 1, "expected a 4-d tensor [N, C, H, W]");
    int64_t oh, ow;
    if (lua_getfield(L, 2, "size") == LUA_TTABLE) {
        lua_geti(L, -1, 1); oh = lua_tointeger(L, -1); lua_pop(L, 1);
        lua_geti(L, -1, 2); ow = lua_tointeger(L, -1); lua_pop(L, 1);
    } else {
        double s = l_opt_num_field(L, 2, "scale_factor", 0);
        if (s <= 0) luaL_argerror(L, 2, "give size = {h, w} or scale_factor");
        oh = (int64_t)floor((double)x->shape[2] * s);
        ow = (int64_t)floor((double)x->shape[3] * s);
    }
    lua_pop(L, 1);
    const char *mode = l_opt_str_field(L, 2, "mode", "nearest");
    static const char *const valid[] = {"nearest", "nearest-exact", "bilinear", NULL};
    kiln_resample m = KILN_RS_COUNT;
    for (int i = 0; valid[i]; i++)
        if (strcmp(mode, valid[i]) == 0) m = (kiln_resample)i;
    if (m == KILN_RS_COUNT) l_enum_error(L, 2, "mode", mode, valid);
    if (l_opt_bool_field(L, 2, "align_corners", 0)) luaL_argerror(L, 2, "align_corners = true is not supported");
    return push(L, kiln_op_resample(m, x, oh, ow, &r), &r);
}

/* pad(x, {left, right, top, bottom} [, mode = "constant"|"reflect"|"replicate"|"circular" [, value]]);
 * circular takes the pixels of the opposite edge, on every side with a pad (a side
 * padded 0 stays as it is, so one call wraps one axis) */
static int nn_pad(lua_State *L)
{
    kiln_tensor *x = l_check_tensor(L, 1), *r;
    luaL_checktype(L, 2, LUA_TTABLE);
    int64_t pads[4] = {0, 0, 0, 0};
    int n = (int)luaL_len(L, 2);
    if (n != 2 && n != 4) luaL_argerror(L, 2, "expected {left, right} or {left, right, top, bottom}");
    for (int i = 0; i < n; i++) {
        lua_geti(L, 2, i + 1);
        pads[i] = lua_tointeger(L, -1);
        lua_pop(L, 1);
    }
    /* ORDER PADMODE */
    static const char *const valid[] = {"constant", "reflect", "replicate", "circular", NULL};
    const char *mode = luaL_optstring(L, 3, "constant");
    int m = -1;
    for (int i = 0; valid[i]; i++)
        if (strcmp(mode, valid[i]) == 0) m = i;
    if (m < 0) l_enum_error(L, 3, "mode", mode, valid);
    double value = luaL_optnumber(L, 4, 0);
    return push(L, kiln_op_pad2d(x, pads, m, value, &r), &r);
}

static const luaL_Reg nn_funcs[] = {
    {"linear", nn_linear}, {"conv2d", nn_conv2d}, {"group_norm", nn_group_norm},
    {"layer_norm", nn_layer_norm}, {"silu", nn_silu}, {"gelu", nn_gelu}, {"quick_gelu", nn_quick_gelu},
    {"sigmoid", nn_sigmoid}, {"relu", nn_relu}, {"leaky_relu", nn_leaky_relu}, {"geglu", nn_geglu}, {"softmax", nn_softmax},
    {"attention", nn_attention}, {"upsample_nearest", nn_upsample_nearest},
    {"interpolate", nn_interpolate}, {"pad", nn_pad},
    {NULL, NULL},
};

void l_open_nn(lua_State *L)
{
    luaL_newlib(L, nn_funcs);
    lua_setfield(L, -2, "nn");
}
