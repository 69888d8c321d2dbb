/* ops.c - checked, device-dispatched tensor operations (see ops.h). */
#include "ops.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define SHAPE(t, buf) kiln_shape_str((t), (buf), sizeof(buf))

/* ORDER BINOP */
static const char *const binop_names[KILN_BIN_COUNT] = {"add", "sub", "mul", "div", "pow", "minimum", "maximum"};
/* ORDER UNOP */
static const char *const unop_names[KILN_UN_COUNT] = {"neg", "exp", "log", "sqrt", "abs", "tanh", "sigmoid",
    "silu", "gelu", "gelu_tanh", "quick_gelu", "relu", "sin", "cos", "clamp", "leaky_relu"};

kiln_dtype kiln_promote(kiln_dtype a, kiln_dtype b)
{
    if (a == b) return a;
    int fa = kiln_dtype_is_float(a), fb = kiln_dtype_is_float(b);
    if (fa && !fb) return a;
    if (fb && !fa) return b;
    if (fa && fb) return KILN_F32; /* f16/bf16 mixed with anything else */
    if (a == KILN_I64 || b == KILN_I64) return KILN_I64;
    return KILN_I32;
}

static kiln_status same_device(const char *op, const kiln_tensor *a, const kiln_tensor *b)
{
    if (b && a->storage->device != b->storage->device)
        return kiln_error(KILN_ERR_ARG, "%s: tensors on different devices (%s and %s); move one with :to(\"%s\")",
                          op, a->storage->device->name, b->storage->device->name, a->storage->device->name);
    return KILN_OK;
}

static const kiln_backend *be_of(const kiln_tensor *t) { return t->storage->device->backend; }

static kiln_status need(const kiln_backend *be, void *fn, const char *op)
{
    return fn ? KILN_OK : kiln_error(KILN_ERR_UNSUPPORTED, "%s: not supported by the %s backend", op, be->name);
}

static kiln_status new_like(const kiln_tensor *ref, kiln_dtype dt, int ndim, const int64_t *shape, kiln_tensor **out)
{
    return kiln_tensor_new(ref->storage->device, dt, ndim, shape, out);
}

static kiln_dtype float_of(kiln_dtype dt) { return kiln_dtype_is_float(dt) ? dt : KILN_F32; }

/* NumPy broadcasting of two shapes into shape/ndim. */
static kiln_status broadcast(const char *op, const kiln_tensor *a, const kiln_tensor *b, int *ndim, int64_t *shape)
{
    int n = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int i = 0; i < n; i++) {
        int ia = a->ndim - n + i, ib = b->ndim - n + i;
        int64_t sa = ia >= 0 ? a->shape[ia] : 1, sb = ib >= 0 ? b->shape[ib] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            char b1[128], b2[128];
            return kiln_error(KILN_ERR_ARG, "%s: shapes %s and %s do not broadcast (dimension %d: %lld vs %lld)",
                              op, SHAPE(a, b1), SHAPE(b, b2), i + 1, (long long)sa, (long long)sb);
        }
        shape[i] = sa == 1 ? sb : sa;
    }
    *ndim = n;
    return KILN_OK;
}

kiln_status kiln_op_binary(kiln_binop op, const kiln_tensor *a, const kiln_tensor *b, kiln_tensor **out)
{
    *out = NULL;
    const char *name = binop_names[op];
    kiln_status st;
    if ((st = same_device(name, a, b))) return st;
    int ndim = 0;
    int64_t shape[KILN_MAX_DIMS];
    if ((st = broadcast(name, a, b, &ndim, shape))) return st;
    kiln_dtype dt = kiln_promote(a->dtype, b->dtype);
    if (op == KILN_BIN_POW) dt = float_of(dt);
    kiln_tensor *ea = NULL, *eb = NULL, *o = NULL;
    if ((st = kiln_tensor_expand(a, ndim, shape, &ea)) || (st = kiln_tensor_expand(b, ndim, shape, &eb)) ||
        (st = new_like(a, dt, ndim, shape, &o)) || (st = be_of(a)->binary(op, o, ea, eb, 0, 0))) {
        kiln_tensor_free(o);
        o = NULL;
    }
    kiln_tensor_free(ea);
    kiln_tensor_free(eb);
    *out = o;
    return st;
}

kiln_status kiln_op_binary_scalar(kiln_binop op, const kiln_tensor *a, double s, int swap, kiln_tensor **out)
{
    *out = NULL;
    kiln_dtype dt = a->dtype;
    /* an integer tensor with a fractional scalar (or pow / true division) becomes f32 */
    if (!kiln_dtype_is_float(dt) && (s != floor(s) || op == KILN_BIN_POW || op == KILN_BIN_DIV)) dt = KILN_F32;
    kiln_tensor *o;
    kiln_status st = new_like(a, dt, a->ndim, a->shape, &o);
    if (st) return st;
    if ((st = be_of(a)->binary(op, o, a, NULL, s, swap))) { kiln_tensor_free(o); return st; }
    *out = o;
    return KILN_OK;
}

kiln_status kiln_op_unary(kiln_unop op, const kiln_tensor *a, double p0, double p1, kiln_tensor **out)
{
    *out = NULL;
    kiln_dtype dt = a->dtype;
    if (op != KILN_UN_NEG && op != KILN_UN_ABS && op != KILN_UN_CLAMP && op != KILN_UN_RELU) dt = float_of(dt);
    (void)unop_names;
    kiln_tensor *o;
    kiln_status st = new_like(a, dt, a->ndim, a->shape, &o);
    if (st) return st;
    if ((st = be_of(a)->unary(op, o, a, p0, p1))) { kiln_tensor_free(o); return st; }
    *out = o;
    return KILN_OK;
}

kiln_status kiln_op_reduce(kiln_redop op, const kiln_tensor *a, int dim, int keepdim, int unbiased, kiln_tensor **out)
{
    *out = NULL;
    static const char *const names[KILN_RED_COUNT] = {"sum", "mean", "max", "min", "var"};
    if (dim >= a->ndim) return kiln_error(KILN_ERR_ARG, "%s: dimension %d out of range for a %d-d tensor", names[op], dim + 1, a->ndim);
    if ((op == KILN_RED_MAX || op == KILN_RED_MIN) && (dim < 0 ? kiln_tensor_numel(a) == 0 : a->shape[dim] == 0))
        return kiln_error(KILN_ERR_ARG, "%s: cannot reduce over an empty dimension", names[op]);
    int64_t shape[KILN_MAX_DIMS];
    int ndim = 0;
    for (int i = 0; i < a->ndim; i++) {
        if (dim < 0 || i == dim) { if (keepdim) shape[ndim++] = 1; }
        else shape[ndim++] = a->shape[i];
    }
    kiln_dtype dt = (op == KILN_RED_MAX || op == KILN_RED_MIN || op == KILN_RED_SUM) && !kiln_dtype_is_float(a->dtype)
                        ? (op == KILN_RED_SUM ? KILN_I64 : a->dtype) : float_of(a->dtype);
    kiln_tensor *o;
    kiln_status st = new_like(a, dt, ndim, shape, &o);
    if (st) return st;
    if ((st = be_of(a)->reduce(op, o, a, dim, unbiased))) { kiln_tensor_free(o); return st; }
    *out = o;
    return KILN_OK;
}

kiln_status kiln_op_matmul(const kiln_tensor *a, const kiln_tensor *b, kiln_tensor **out)
{
    *out = NULL;
    kiln_status st;
    char b1[128], b2[128];
    if ((st = same_device("matmul", a, b))) return st;
    if (a->ndim < 1 || b->ndim < 1) return kiln_error(KILN_ERR_ARG, "matmul: scalars are not matrices");
    /* vectors become matrices as in torch.matmul, and the extra dim is dropped after */
    kiln_tensor *va = NULL, *vb = NULL, *r = NULL, *ea = NULL, *eb = NULL;
    int squeeze_a = a->ndim == 1, squeeze_b = b->ndim == 1;
    if (squeeze_a) st = kiln_tensor_unsqueeze(a, 0, &va); else va = kiln_tensor_view_of(a);
    if (!st && squeeze_b) st = kiln_tensor_unsqueeze(b, 1, &vb); else if (!st) vb = kiln_tensor_view_of(b);
    if (st) goto done;
    if (va->shape[va->ndim - 1] != vb->shape[vb->ndim - 2]) {
        st = kiln_error(KILN_ERR_ARG, "matmul: shapes %s and %s: inner dimensions %lld and %lld differ",
                        SHAPE(a, b1), SHAPE(b, b2), (long long)va->shape[va->ndim - 1], (long long)vb->shape[vb->ndim - 2]);
        goto done;
    }
    int n = va->ndim > vb->ndim ? va->ndim : vb->ndim;
    int64_t sa[KILN_MAX_DIMS], sb[KILN_MAX_DIMS], so[KILN_MAX_DIMS];
    for (int i = 0; i < n - 2; i++) {
        int ia = va->ndim - n + i, ib = vb->ndim - n + i;
        int64_t da = ia >= 0 ? va->shape[ia] : 1, db = ib >= 0 ? vb->shape[ib] : 1;
        if (da != db && da != 1 && db != 1) {
            st = kiln_error(KILN_ERR_ARG, "matmul: batch dimensions of %s and %s do not broadcast", SHAPE(a, b1), SHAPE(b, b2));
            goto done;
        }
        sa[i] = sb[i] = so[i] = da == 1 ? db : da;
    }
    sa[n - 2] = so[n - 2] = va->shape[va->ndim - 2];
    sa[n - 1] = sb[n - 2] = va->shape[va->ndim - 1];
    sb[n - 1] = so[n - 1] = vb->shape[vb->ndim - 1];
    if ((st = kiln_tensor_expand(va, n, sa, &ea)) || (st = kiln_tensor_expand(vb, n, sb, &eb))) goto done;
    if ((st = need(be_of(a), (void *)be_of(a)->matmul, "matmul"))) goto done;
    if ((st = new_like(a, float_of(kiln_promote(a->dtype, b->dtype)), n, so, &r))) goto done;
    if ((st = be_of(a)->matmul(r, ea, eb))) goto done;
    if (squeeze_a || squeeze_b) {
        kiln_tensor *s1 = r, *s2 = NULL;
        if (squeeze_b) { st = kiln_tensor_squeeze(s1, n - 1, &s2); kiln_tensor_free(s1); s1 = s2; }
        if (!st && squeeze_a) { st = kiln_tensor_squeeze(s1, s1->ndim - (squeeze_b ? 1 : 2), &s2); kiln_tensor_free(s1); s1 = s2; }
        r = s1;
    }
done:
    kiln_tensor_free(va); kiln_tensor_free(vb); kiln_tensor_free(ea); kiln_tensor_free(eb);
    if (st) { kiln_tensor_free(r); r = NULL; }
    *out = r;
    return st;
}

static kiln_status check_vec(const char *op, const char *what, const kiln_tensor *t, int64_t n, const kiln_tensor *x)
{
    char b1[128];
    if (!t) return KILN_OK;
    kiln_status st = same_device(op, x, t);
    if (st) return st;
    if (kiln_tensor_numel(t) != n || t->ndim != 1)
        return kiln_error(KILN_ERR_ARG, "%s: %s has shape %s, expected [%lld]", op, what, SHAPE(t, b1), (long long)n);
    return KILN_OK;
}

kiln_status kiln_op_linear(const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b, kiln_tensor **out)
{
    *out = NULL;
    char b1[128], b2[128];
    kiln_status st;
    if ((st = same_device("linear", x, w))) return st;
    if (x->ndim < 1 || w->ndim != 2 || x->shape[x->ndim - 1] != w->shape[1])
        return kiln_error(KILN_ERR_ARG, "linear: input %s does not match weight %s (expected [..., %lld] and [out, in])",
                          SHAPE(x, b1), SHAPE(w, b2), w->ndim == 2 ? (long long)w->shape[1] : -1LL);
    if ((st = check_vec("linear", "bias", b, w->shape[0], x))) return st;
    int64_t shape[KILN_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = w->shape[0];
    kiln_tensor *o;
    if ((st = need(be_of(x), (void *)be_of(x)->linear, "linear"))) return st;
    if ((st = new_like(x, float_of(x->dtype), x->ndim, shape, &o))) return st;
    if ((st = be_of(x)->linear(o, x, w, b))) { kiln_tensor_free(o); return st; }
    *out = o;
    return KILN_OK;
}

/* conv2d with opts.upsample = 2: fused where the backend has conv2d_up2 and the shape is
 * the decoders' Upsample block (3x3, stride 1, padding 1, no dilation or groups); else
 * the upsampled input is made, used and freed here. */
static kiln_status conv2d_upsampled(const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b,
                                    const kiln_conv_opts *o, kiln_tensor **out)
{
    char b1[128];
    kiln_status st;
    if (x->ndim != 4) return kiln_error(KILN_ERR_ARG, "conv2d: input %s must be 4-d [N, C, H, W]", SHAPE(x, b1));
    /* the errors the convolution would give, about the tensors the caller passed (not
     * the upsampled one made below) */
    if (w->ndim == 4 && o->groups >= 1 && w->shape[1] * o->groups != x->shape[1]) {
        char b2[128];
        return kiln_error(KILN_ERR_ARG, "conv2d: weight %s expects %lld input channels, input %s has %lld",
                          SHAPE(w, b1), (long long)(w->shape[1] * o->groups), SHAPE(x, b2), (long long)x->shape[1]);
    }
    const kiln_backend *be = be_of(x);
    int fused = be->conv2d_up2 && w->ndim == 4 && w->shape[2] == 3 && w->shape[3] == 3 && w->shape[1] == x->shape[1] &&
                o->groups == 1 && o->stride[0] == 1 && o->stride[1] == 1 && o->padding[0] == 1 &&
                o->padding[1] == 1 && o->dilation[0] == 1 && o->dilation[1] == 1 && x->shape[0] >= 1;
    if (fused) {
        if ((st = same_device("conv2d", x, w))) return st;
        if ((st = check_vec("conv2d", "bias", b, w->shape[0], x))) return st;
        int64_t shape[4] = {x->shape[0], w->shape[0], 2 * x->shape[2], 2 * x->shape[3]};
        kiln_tensor *r;
        if ((st = new_like(x, float_of(x->dtype), 4, shape, &r))) return st;
        st = be->conv2d_up2(r, x, w, b);
        if (st == KILN_OK) {
            *out = r;
            return KILN_OK;
        }
        kiln_tensor_free(r);
        if (st != KILN_ERR_UNSUPPORTED) return st;
    }
    kiln_tensor *u;
    if ((st = kiln_op_resample(KILN_RS_NEAREST, x, 2 * x->shape[2], 2 * x->shape[3], &u))) return st;
    kiln_conv_opts plain = *o;
    plain.upsample = 1;
    st = kiln_op_conv2d(u, w, b, &plain, out);
    kiln_tensor_free(u);
    return st;
}

/* A convolution's residual: a float tensor on x's device with the output's shape. */
static kiln_status check_residual(const kiln_tensor *x, const kiln_tensor *r, const int64_t *shape)
{
    char b1[128];
    if (r->storage->device != x->storage->device)
        return kiln_error(KILN_ERR_ARG, "conv2d: residual is on %s, the input on %s; move it with :to(\"%s\")",
                          r->storage->device->name, x->storage->device->name, x->storage->device->name);
    if (!kiln_dtype_is_float(r->dtype))
        return kiln_error(KILN_ERR_ARG, "conv2d: residual has dtype %s (expected a float dtype)", kiln_dtype_name(r->dtype));
    if (r->ndim != 4 || r->shape[0] != shape[0] || r->shape[1] != shape[1] || r->shape[2] != shape[2] ||
        r->shape[3] != shape[3])
        return kiln_error(KILN_ERR_ARG, "conv2d: residual has shape %s, expected the output's [%lld, %lld, %lld, %lld]",
                          SHAPE(r, b1), (long long)shape[0], (long long)shape[1], (long long)shape[2],
                          (long long)shape[3]);
    return KILN_OK;
}

kiln_status kiln_op_conv2d(const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b,
                           const kiln_conv_opts *o, kiln_tensor **out)
{
    *out = NULL;
    char b1[128], b2[128];
    kiln_status st;
    if (o->act != 0 && o->act != 1) return kiln_error(KILN_ERR_ARG, "conv2d: act=%d (0 none, 1 leaky relu)", o->act);
    /* What the backend's conv2d does not apply runs here, in place over the result (one
     * pass each, no second tensor), in the same order: + residual, then the activation
     * (which therefore also runs here when the residual does). */
    const kiln_backend *be = be_of(x);
    int res_here = o->residual && (o->upsample == 2 || !be->conv2d_residual);
    int act_here = o->act && (o->upsample == 2 || !be->conv2d_act || res_here);
    if (res_here || act_here) {
        kiln_conv_opts plain = *o;
        plain.act = 0;
        if (res_here) plain.residual = NULL;
        if ((st = kiln_op_conv2d(x, w, b, &plain, out))) return st;
        if (res_here && !(st = check_residual(x, o->residual, (*out)->shape)))
            st = be_of(*out)->binary(KILN_BIN_ADD, *out, *out, o->residual, 0, 0);
        if (!st && act_here) st = be_of(*out)->unary(KILN_UN_LEAKY_RELU, *out, *out, o->act_slope, 0);
        if (st) {
            kiln_tensor_free(*out);
            *out = NULL;
        }
        return st;
    }
    if (o->upsample != 0 && o->upsample != 1 && o->upsample != 2)
        return kiln_error(KILN_ERR_ARG, "conv2d: upsample=%lld (1 or 2: nearest 2x before the convolution)",
                          (long long)o->upsample);
    if (o->upsample == 2) return conv2d_upsampled(x, w, b, o, out);
    if ((st = same_device("conv2d", x, w))) return st;
    if (x->ndim != 4) return kiln_error(KILN_ERR_ARG, "conv2d: input %s must be 4-d [N, C, H, W]", SHAPE(x, b1));
    if (w->ndim != 4) return kiln_error(KILN_ERR_ARG, "conv2d: weight %s must be 4-d [out, in/groups, kh, kw]", SHAPE(w, b1));
    if (o->groups < 1 || x->shape[1] % o->groups || w->shape[0] % o->groups)
        return kiln_error(KILN_ERR_ARG, "conv2d: groups=%lld must divide input channels %lld and output channels %lld",
                          (long long)o->groups, (long long)x->shape[1], (long long)w->shape[0]);
    if (w->shape[1] * o->groups != x->shape[1])
        return kiln_error(KILN_ERR_ARG, "conv2d: weight %s expects %lld input channels, input %s has %lld",
                          SHAPE(w, b1), (long long)(w->shape[1] * o->groups), SHAPE(x, b2), (long long)x->shape[1]);
    for (int i = 0; i < 2; i++)
        if (o->stride[i] < 1 || o->dilation[i] < 1 || o->padding[i] < 0)
            return kiln_error(KILN_ERR_ARG, "conv2d: stride and dilation must be >= 1 and padding >= 0");
    if ((st = check_vec("conv2d", "bias", b, w->shape[0], x))) return st;
    int64_t oh = (x->shape[2] + 2 * o->padding[0] - o->dilation[0] * (w->shape[2] - 1) - 1) / o->stride[0] + 1;
    int64_t ow = (x->shape[3] + 2 * o->padding[1] - o->dilation[1] * (w->shape[3] - 1) - 1) / o->stride[1] + 1;
    if (oh < 1 || ow < 1 || x->shape[0] < 1)
        return kiln_error(KILN_ERR_ARG, "conv2d: input %s with kernel %s gives an empty output (%lldx%lld)",
                          SHAPE(x, b1), SHAPE(w, b2), (long long)oh, (long long)ow);
    int64_t shape[4] = {x->shape[0], w->shape[0], oh, ow};
    if (o->residual && (st = check_residual(x, o->residual, shape))) return st;
    kiln_tensor *r;
    if ((st = need(be_of(x), (void *)be_of(x)->conv2d, "conv2d"))) return st;
    if ((st = new_like(x, float_of(x->dtype), 4, shape, &r))) return st;
    if ((st = be_of(x)->conv2d(r, x, w, b, o))) { kiln_tensor_free(r); return st; }
    *out = r;
    return KILN_OK;
}

static kiln_status check_group_norm(const kiln_tensor *x, int64_t groups, const kiln_tensor *w, const kiln_tensor *b)
{
    char b1[128];
    kiln_status st;
    if (x->ndim < 2) return kiln_error(KILN_ERR_ARG, "group_norm: input %s must have at least 2 dims [N, C, ...]", SHAPE(x, b1));
    if (groups < 1 || x->shape[1] % groups)
        return kiln_error(KILN_ERR_ARG, "group_norm: %lld groups do not divide %lld channels of %s",
                          (long long)groups, (long long)x->shape[1], SHAPE(x, b1));
    if ((st = check_vec("group_norm", "weight", w, x->shape[1], x)) || (st = check_vec("group_norm", "bias", b, x->shape[1], x)))
        return st;
    return KILN_OK;
}

kiln_status kiln_op_group_norm(const kiln_tensor *x, int64_t groups, const kiln_tensor *w,
                               const kiln_tensor *b, double eps, int silu, kiln_tensor **out)
{
    *out = NULL;
    kiln_status st;
    if ((st = check_group_norm(x, groups, w, b))) return st;
    kiln_tensor *r;
    if ((st = new_like(x, float_of(x->dtype), x->ndim, x->shape, &r))) return st;
    if ((st = be_of(x)->group_norm(r, x, w, b, groups, eps, silu))) { kiln_tensor_free(r); return st; }
    *out = r;
    return KILN_OK;
}

kiln_status kiln_op_group_norm_in_place(kiln_tensor *x, int64_t groups, const kiln_tensor *w,
                                        const kiln_tensor *b, double eps, int silu)
{
    char b1[128];
    kiln_status st;
    int half = x->dtype == KILN_F16 || x->dtype == KILN_BF16; /* half activations (a GPU's) */
    if ((x->dtype != KILN_F32 && !half) || !kiln_tensor_is_contiguous(x))
        return kiln_error(KILN_ERR_ARG, "group_norm in place: input %s must be a contiguous f32, f16 or bf16 tensor (is %s%s)",
                          SHAPE(x, b1), kiln_dtype_name(x->dtype), kiln_tensor_is_contiguous(x) ? "" : ", strided");
    if (x->storage->refcount != 1 || x->storage->release)
        return kiln_error(KILN_ERR_ARG, "group_norm in place: input %s shares its memory (a view, or a mapped file): "
                          "run it out of place", SHAPE(x, b1));
    const kiln_backend *be = be_of(x);
    if (be->group_norm_in_place && !half) { /* the flag promises f32 only */
        if ((st = check_group_norm(x, groups, w, b))) return st;
        if ((st = need(be, (void *)be->group_norm, "group_norm"))) return st;
        return be->group_norm(x, x, w, b, groups, eps, silu);
    }
    kiln_tensor *r;
    if ((st = kiln_op_group_norm(x, groups, w, b, eps, silu, &r))) return st;
    st = be->copy(x, r);
    kiln_tensor_free(r);
    return st;
}

kiln_status kiln_op_layer_norm(const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b, double eps, kiln_tensor **out)
{
    *out = NULL;
    char b1[128];
    kiln_status st;
    if (x->ndim < 1) return kiln_error(KILN_ERR_ARG, "layer_norm: input %s has no dimensions", SHAPE(x, b1));
    int64_t d = x->shape[x->ndim - 1];
    if ((st = check_vec("layer_norm", "weight", w, d, x)) || (st = check_vec("layer_norm", "bias", b, d, x))) return st;
    kiln_tensor *r;
    if ((st = new_like(x, float_of(x->dtype), x->ndim, x->shape, &r))) return st;
    if ((st = be_of(x)->layer_norm(r, x, w, b, eps))) { kiln_tensor_free(r); return st; }
    *out = r;
    return KILN_OK;
}

kiln_status kiln_op_softmax(const kiln_tensor *x, int dim, kiln_tensor **out)
{
    *out = NULL;
    if (dim < 0 || dim >= x->ndim)
        return kiln_error(KILN_ERR_ARG, "softmax: dimension %d out of range for a %d-d tensor", dim + 1, x->ndim);
    kiln_tensor *r;
    kiln_status st = new_like(x, float_of(x->dtype), x->ndim, x->shape, &r);
    if (st) return st;
    if ((st = be_of(x)->softmax(r, x, dim))) { kiln_tensor_free(r); return st; }
    *out = r;
    return KILN_OK;
}

kiln_status kiln_op_attention(const kiln_tensor *q, const kiln_tensor *k, const kiln_tensor *v,
                              double scale, int causal, kiln_tensor **out)
{
    *out = NULL;
    char b1[128], b2[128], b3[128];
    kiln_status st;
    if ((st = same_device("attention", q, k)) || (st = same_device("attention", q, v))) return st;
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4 || q->shape[0] != k->shape[0] || q->shape[1] != k->shape[1] ||
        k->shape[0] != v->shape[0] || k->shape[1] != v->shape[1] || q->shape[3] != k->shape[3] || k->shape[2] != v->shape[2] ||
        q->shape[3] < 1 || k->shape[2] < 1)
        return kiln_error(KILN_ERR_ARG, "attention: q %s, k %s, v %s must be [B, heads, Lq, D], [B, heads, Lk, D], [B, heads, Lk, Dv]",
                          SHAPE(q, b1), SHAPE(k, b2), SHAPE(v, b3));
    int64_t shape[4] = {q->shape[0], q->shape[1], q->shape[2], v->shape[3]};
    kiln_tensor *r;
    if ((st = new_like(q, float_of(q->dtype), 4, shape, &r))) return st;
    if ((st = be_of(q)->attention(r, q, k, v, scale, causal))) { kiln_tensor_free(r); return st; }
    *out = r;
    return KILN_OK;
}

kiln_status kiln_op_geglu(const kiln_tensor *x, kiln_tensor **out)
{
    *out = NULL;
    char b1[128];
    if (x->ndim < 1 || x->shape[x->ndim - 1] % 2)
        return kiln_error(KILN_ERR_ARG, "geglu: last dimension of %s must be even", SHAPE(x, b1));
    int64_t shape[KILN_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] /= 2;
    kiln_tensor *r;
    kiln_status st = new_like(x, float_of(x->dtype), x->ndim, shape, &r);
    if (st) return st;
    if ((st = be_of(x)->geglu(r, x))) { kiln_tensor_free(r); return st; }
    *out = r;
    return KILN_OK;
}

kiln_status kiln_op_resample(kiln_resample mode, const kiln_tensor *x, int64_t oh, int64_t ow, kiln_tensor **out)
{
    *out = NULL;
    char b1[128];
    if (x->ndim != 4) return kiln_error(KILN_ERR_ARG, "interpolate: input %s must be 4-d [N, C, H, W]", SHAPE(x, b1));
    if (oh < 1 || ow < 1 || x->shape[2] < 1 || x->shape[3] < 1)
        return kiln_error(KILN_ERR_ARG, "interpolate: bad size %lldx%lld for input %s", (long long)oh, (long long)ow, SHAPE(x, b1));
    int64_t shape[4] = {x->shape[0], x->shape[1], oh, ow};
    kiln_tensor *r;
    kiln_status st = new_like(x, float_of(x->dtype), 4, shape, &r);
    if (st) return st;
    if ((st = be_of(x)->resample(mode, r, x))) { kiln_tensor_free(r); return st; }
    *out = r;
    return KILN_OK;
}

kiln_status kiln_op_pad2d(const kiln_tensor *x, const int64_t *pads, int mode, double value, kiln_tensor **out)
{
    *out = NULL;
    char b1[128];
    if (x->ndim < 2) return kiln_error(KILN_ERR_ARG, "pad: input %s needs at least 2 dims", SHAPE(x, b1));
    int64_t h = x->shape[x->ndim - 2], w = x->shape[x->ndim - 1];
    for (int i = 0; i < 4; i++)
        if (pads[i] < 0) return kiln_error(KILN_ERR_ARG, "pad: negative padding is not supported");
    if (mode == KILN_PAD_REFLECT && (pads[0] >= w || pads[1] >= w || pads[2] >= h || pads[3] >= h))
        return kiln_error(KILN_ERR_ARG, "pad: reflect padding must be smaller than the input size (%s)", SHAPE(x, b1));
    if (mode < KILN_PAD_CONSTANT || mode > KILN_PAD_CIRCULAR)
        return kiln_error(KILN_ERR_ARG, "pad: unknown mode %d", mode);
    if ((mode == KILN_PAD_REPLICATE || mode == KILN_PAD_CIRCULAR) && (h == 0 || w == 0))
        return kiln_error(KILN_ERR_ARG, "pad: %s padding of an empty input",
                          mode == KILN_PAD_REPLICATE ? "replicate" : "circular");
    int64_t shape[KILN_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 2] = h + pads[2] + pads[3];
    shape[x->ndim - 1] = w + pads[0] + pads[1];
    kiln_tensor *r;
    kiln_status st = new_like(x, float_of(x->dtype), x->ndim, shape, &r);
    if (st) return st;
    if ((st = be_of(x)->pad2d(r, x, pads, mode, value))) { kiln_tensor_free(r); return st; }
    *out = r;
    return KILN_OK;
}

kiln_status kiln_op_cat(const kiln_tensor *const *list, int n, int dim, kiln_tensor **out)
{
    *out = NULL;
    char b1[128], b2[128];
    if (n < 1) return kiln_error(KILN_ERR_ARG, "cat: empty list");
    const kiln_tensor *f = list[0];
    if (dim < 0 || dim >= f->ndim) return kiln_error(KILN_ERR_ARG, "cat: dimension %d out of range for a %d-d tensor", dim + 1, f->ndim);
    int64_t total = 0;
    kiln_dtype dt = f->dtype;
    for (int i = 0; i < n; i++) {
        const kiln_tensor *t = list[i];
        kiln_status st = same_device("cat", f, t);
        if (st) return st;
        int ok = t->ndim == f->ndim;
        for (int d = 0; ok && d < f->ndim; d++) ok = d == dim || t->shape[d] == f->shape[d];
        if (!ok) return kiln_error(KILN_ERR_ARG, "cat: tensor %d has shape %s, incompatible with %s along dimension %d",
                                   i + 1, SHAPE(t, b1), SHAPE(f, b2), dim + 1);
        total += t->shape[dim];
        dt = kiln_promote(dt, t->dtype);
    }
    int64_t shape[KILN_MAX_DIMS];
    memcpy(shape, f->shape, sizeof shape);
    shape[dim] = total;
    kiln_tensor *r;
    kiln_status st = new_like(f, dt, f->ndim, shape, &r);
    if (st) return st;
    int64_t at = 0;
    for (int i = 0; i < n && !st; i++) {
        kiln_tensor *slot;
        if (!(st = kiln_tensor_narrow(r, dim, at, list[i]->shape[dim], &slot))) {
            st = kiln_tensor_copy(slot, list[i]);
            kiln_tensor_free(slot);
        }
        at += list[i]->shape[dim];
    }
    if (st) { kiln_tensor_free(r); return st; }
    *out = r;
    return KILN_OK;
}

/* Sequences are computed in double on the host, stored as f32 (or i64 for integer
 * dtypes) and converted/moved once. */
static kiln_status sequence(kiln_device *dev, int64_t n, double start, double step, double last,
                            kiln_dtype dt, kiln_tensor **out)
{
    kiln_tensor *host;
    kiln_dtype hd = kiln_dtype_is_float(dt) ? KILN_F32 : KILN_I64;
    kiln_status st = kiln_tensor_new(kiln_device_cpu(), hd, 1, &n, &host);
    if (st) return st;
    for (int64_t i = 0; i < n; i++) {
        double v = (i == n - 1 && last == last) ? last : start + step * (double)i;
        if (hd == KILN_F32) ((float *)kiln_tensor_data(host))[i] = (float)v;
        else ((int64_t *)kiln_tensor_data(host))[i] = (int64_t)v;
    }
    if (hd == dt && dev == kiln_device_cpu()) { *out = host; return KILN_OK; }
    st = kiln_tensor_to(host, dev, dt, out);
    kiln_tensor_free(host);
    return st;
}

kiln_status kiln_op_arange(kiln_device *dev, double start, double stop, double step, kiln_dtype dt, kiln_tensor **out)
{
    *out = NULL;
    if (step == 0 || step != step) return kiln_error(KILN_ERR_ARG, "arange: step must be non-zero");
    double cnt = ceil((stop - start) / step);
    if (cnt != cnt || cnt < 0) cnt = 0;
    if (cnt > 1e10) return kiln_error(KILN_ERR_ARG, "arange: too many elements (%.0f)", cnt);
    return sequence(dev, (int64_t)cnt, start, step, NAN, dt, out);
}

kiln_status kiln_op_linspace(kiln_device *dev, double start, double stop, int64_t n, kiln_dtype dt, kiln_tensor **out)
{
    *out = NULL;
    if (n < 0 || n > 10000000000LL) return kiln_error(KILN_ERR_ARG, "linspace: bad count %lld", (long long)n);
    double step = n > 1 ? (stop - start) / (double)(n - 1) : 0;
    return sequence(dev, n, start, step, n > 1 ? stop : start, dt, out);
}
