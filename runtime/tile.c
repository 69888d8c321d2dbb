/* tile.c - the tile primitive: tile grids with evenly spread overlapping tiles,
 * separable feather weights normalized to a partition of unity, and in-place
 * accumulation of each tile's output into the result (see tile.h). */
#include "tile.h"
#include "meta.h"
#include "ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ORDER BLEND */
static const char *const blend_names[] = {"linear", "cosine"};

const char *kiln_blend_name(kiln_blend b)
{
    return (unsigned)b < KILN_BLEND_COUNT ? blend_names[b] : "?";
}

int kiln_blend_from_name(const char *name)
{
    for (int i = 0; name && i < KILN_BLEND_COUNT; i++)
        if (strcmp(name, blend_names[i]) == 0) return i;
    return -1;
}

void kiln_tile_opts_init(kiln_tile_opts *o, int64_t tile, int64_t overlap)
{
    memset(o, 0, sizeof *o);
    o->tile = tile;
    o->overlap = overlap;
    o->scale_num = o->scale_den = 1;
    o->blend = KILN_BLEND_LINEAR;
}

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) { int64_t t = a % b; a = b; b = t; }
    return a;
}

/* Weight of a pixel d steps inside a ramp of length a (d >= a: past the ramp).
 * Samples at pixel centres, so a weight is never 0 and two complementary ramps over
 * the same a pixels sum to exactly 1 in real arithmetic. */
static double ramp(kiln_blend b, int64_t d, int64_t a)
{
    if (a <= 0 || d >= a) return 1.0;
    double t = ((double)d + 0.5) / (double)a;
    return b == KILN_BLEND_COSINE ? 0.5 - 0.5 * cos(3.14159265358979323846 * t) : t;
}

/* Spans of one axis of n input pixels, and their normalized weights. */
static kiln_status plan_axis(kiln_tile_axis *ax, int64_t n, int64_t T, int64_t O, const kiln_tile_opts *o)
{
    int64_t den = o->scale_den, num = o->scale_num;
    ax->in_size = n;
    ax->out_size = n / den * num;
    int64_t k = 1, N = n / den, Tu = T / den, Ou = (O + den - 1) / den;
    if (n > T) k = (N - Tu + (Tu - Ou) - 1) / (Tu - Ou) + 1;
    if (k > (1 << 20))
        return kiln_error(KILN_ERR_ARG, "tile: %lld tiles along an axis of %lld (tile %lld, overlap %lld): too many",
                          (long long)k, (long long)n, (long long)T, (long long)O);
    ax->n = (int)k;
    ax->span = calloc((size_t)k, sizeof *ax->span);
    if (!ax->span) return kiln_error_oom("cpu", (uint64_t)k * sizeof *ax->span, 0, 0, "tile: out of host memory planning %lld tiles", (long long)k);
    /* The k tiles are as short as the overlap allows: a multiple of the tile multiple,
     * at most T, with consecutive starts (spread evenly, at most ceil((N-L)/(k-1))
     * apart) still overlapping by Ou. Tiles of T where k*T is well over N would
     * overlap by far more than asked (128 px, tile 64, overlap 8: 3 tiles of 64
     * overlapping by 32; here 3 tiles of 48 overlapping by 8) - work for nothing. */
    int64_t Lu = N < Tu ? N : Tu;
    if (k > 1) {
        int64_t mu = o->multiple / den > 0 ? o->multiple / den : 1;
        int64_t L = (N + (k - 1) * Ou + k - 1) / k;
        L = (L + mu - 1) / mu * mu;
        while (L < Tu && L - Ou < (N - L + k - 2) / (k - 1)) L += mu;
        Lu = L < Tu ? L : Tu;
    }
    int64_t total = 0;
    for (int64_t i = 0; i < k; i++) {
        kiln_tile_span *s = &ax->span[i];
        int64_t len = n > T ? Lu * den : n;
        /* even spread: consecutive starts differ by at most ceil((N-Lu)/(k-1)) <= Lu-Ou */
        int64_t start = k == 1 ? 0 : i * (N - Lu) / (k - 1) * den;
        s->in_start = start;
        s->in_len = len;
        s->out_start = start / den * num;
        s->out_len = len / den * num;
        s->w_offset = total;
        total += s->out_len;
    }
    ax->weight = malloc((size_t)(total ? total : 1) * sizeof(float));
    double *sum = calloc((size_t)(ax->out_size ? ax->out_size : 1), sizeof(double));
    if (!ax->weight || !sum) {
        free(sum);
        return kiln_error_oom("cpu", (uint64_t)total * sizeof(float), 0, 0, "tile: out of host memory for the weights of %lld tiles", (long long)k);
    }
    for (int64_t i = 0; i < k; i++) {
        const kiln_tile_span *s = &ax->span[i];
        /* ramps over the whole overlap with each neighbour; none at the image borders */
        int64_t al = i > 0 ? ax->span[i - 1].out_start + ax->span[i - 1].out_len - s->out_start : 0;
        int64_t ar = i < k - 1 ? s->out_start + s->out_len - ax->span[i + 1].out_start : 0;
        for (int64_t p = 0; p < s->out_len; p++) {
            double w = ramp(o->blend, p, al) * ramp(o->blend, s->out_len - 1 - p, ar);
            ax->weight[s->w_offset + p] = (float)w;
            sum[s->out_start + p] += w;
        }
    }
    for (int64_t i = 0; i < k; i++) {
        const kiln_tile_span *s = &ax->span[i];
        for (int64_t p = 0; p < s->out_len; p++) {
            float *w = &ax->weight[s->w_offset + p];
            *w = (float)((double)*w / sum[s->out_start + p]);
        }
    }
    free(sum);
    return KILN_OK;
}

kiln_status kiln_tile_plan_new(int64_t height, int64_t width, const kiln_tile_opts *o, kiln_tile_plan **out)
{
    *out = NULL;
    if (!o) return kiln_error(KILN_ERR_ARG, "tile: no options");
    if (height <= 0 || width <= 0)
        return kiln_error(KILN_ERR_ARG, "tile: input size %lldx%lld is empty", (long long)height, (long long)width);
    if (o->scale_num <= 0 || o->scale_den <= 0 || o->scale_num > 4096 || o->scale_den > 4096)
        return kiln_error(KILN_ERR_ARG, "tile: scale %lld/%lld must be a positive fraction (terms up to 4096)",
                          (long long)o->scale_num, (long long)o->scale_den);
    if ((unsigned)o->blend >= KILN_BLEND_COUNT) return kiln_error(KILN_ERR_ARG, "tile: invalid blend %d", (int)o->blend);
    if (o->tile <= 0) return kiln_error(KILN_ERR_ARG, "tile: tile size %lld must be positive", (long long)o->tile);
    if (o->overlap < 0 || o->overlap >= o->tile)
        return kiln_error(KILN_ERR_ARG, "tile: overlap %lld must be in [0, tile) with tile %lld",
                          (long long)o->overlap, (long long)o->tile);
    if (o->multiple < 0 || o->multiple > 4096)
        return kiln_error(KILN_ERR_ARG, "tile: multiple %lld must be in [0, 4096]", (long long)o->multiple);
    int64_t g = gcd64(o->scale_num, o->scale_den);
    kiln_tile_opts r = *o;
    r.scale_num /= g;
    r.scale_den /= g;
    int64_t den = r.scale_den;
    if (height % den || width % den)
        return kiln_error(KILN_ERR_ARG, "tile: input size %lldx%lld is not a multiple of %lld (scale %lld/%lld)",
                          (long long)height, (long long)width, (long long)den, (long long)r.scale_num, (long long)den);
    int64_t m = r.multiple ? r.multiple : den;
    m = m / gcd64(m, den) * den; /* lcm: tile edges stay whole output pixels */
    r.multiple = m;
    int64_t T = r.tile - r.tile % m;
    if (T == 0)
        return kiln_error(KILN_ERR_ARG, "tile: tile %lld is smaller than the required multiple %lld",
                          (long long)r.tile, (long long)m);
    int64_t O = (r.overlap + den - 1) / den * den;
    if (O >= T && (height > T || width > T))
        return kiln_error(KILN_ERR_ARG, "tile: overlap %lld must be smaller than the tile %lld (after rounding to multiples of %lld)",
                          (long long)O, (long long)T, (long long)m);
    r.tile = T;
    r.overlap = O;
    kiln_tile_plan *p = calloc(1, sizeof *p);
    if (!p) return kiln_error_oom("cpu", sizeof *p, 0, 0, "tile: out of host memory");
    p->opts = r;
    kiln_status st = plan_axis(&p->axis[0], height, T, O, &r);
    if (!st) st = plan_axis(&p->axis[1], width, T, O, &r);
    if (!st && (int64_t)p->axis[0].n * p->axis[1].n > (1 << 24))
        st = kiln_error(KILN_ERR_ARG, "tile: %d x %d tiles is too many (tile %lld)", p->axis[0].n, p->axis[1].n,
                        (long long)T);
    if (st) { kiln_tile_plan_free(p); return st; }
    p->count = p->axis[0].n * p->axis[1].n;
    *out = p;
    return KILN_OK;
}

void kiln_tile_plan_free(kiln_tile_plan *p)
{
    if (!p) return;
    for (int a = 0; a < 2; a++) {
        free(p->axis[a].span);
        free(p->axis[a].weight);
    }
    free(p);
}

void kiln_tile_rects(const kiln_tile_plan *p, int i, kiln_tile_rect *in, kiln_tile_rect *out)
{
    const kiln_tile_span *r = &p->axis[0].span[i / p->axis[1].n];
    const kiln_tile_span *c = &p->axis[1].span[i % p->axis[1].n];
    if (in) { in->y = r->in_start; in->h = r->in_len; in->x = c->in_start; in->w = c->in_len; }
    if (out) { out->y = r->out_start; out->h = r->out_len; out->x = c->out_start; out->w = c->out_len; }
}

float kiln_tile_weight(const kiln_tile_plan *p, int i, int64_t y, int64_t x)
{
    if (i < 0 || i >= p->count) return 0;
    const kiln_tile_span *r = &p->axis[0].span[i / p->axis[1].n];
    const kiln_tile_span *c = &p->axis[1].span[i % p->axis[1].n];
    if (y < 0 || y >= r->out_len || x < 0 || x >= c->out_len) return 0;
    return p->axis[0].weight[r->w_offset + y] * p->axis[1].weight[c->w_offset + x];
}

kiln_status kiln_tile_input(const kiln_tile_plan *p, const kiln_tensor *x, int i, kiln_tensor **out)
{
    *out = NULL;
    if (i < 0 || i >= p->count) return kiln_error(KILN_ERR_ARG, "tile: index %d out of range (%d tiles)", i, p->count);
    if (x->ndim < 2) return kiln_error(KILN_ERR_ARG, "tile: input must have at least 2 dims, got %d", x->ndim);
    if (x->shape[x->ndim - 2] != p->axis[0].in_size || x->shape[x->ndim - 1] != p->axis[1].in_size) {
        char b[128];
        return kiln_error(KILN_ERR_ARG, "tile: input %s does not match the plan's %lldx%lld", kiln_shape_str(x, b, sizeof b),
                          (long long)p->axis[0].in_size, (long long)p->axis[1].in_size);
    }
    kiln_tile_rect r;
    kiln_tile_rects(p, i, &r, NULL);
    kiln_tensor *a = NULL;
    kiln_status st = kiln_tensor_narrow(x, x->ndim - 2, r.y, r.h, &a);
    if (st) return st;
    st = kiln_tensor_narrow(a, x->ndim - 1, r.x, r.w, out);
    kiln_tensor_free(a);
    return st;
}

kiln_status kiln_tile_check_output(const kiln_tile_plan *p, const kiln_tensor *x, int i, const kiln_tensor *y,
                                   const kiln_tensor *result)
{
    kiln_tile_rect in, o;
    kiln_tile_rects(p, i, &in, &o);
    int nd = x->ndim, bad = y->ndim != nd;
    for (int d = 0; !bad && d < nd - 3; d++) bad = y->shape[d] != x->shape[d];
    if (!bad && result && nd >= 3) bad = y->shape[nd - 3] != result->shape[nd - 3];
    if (!bad) bad = y->shape[nd - 2] != o.h || y->shape[nd - 1] != o.w;
    if (bad) {
        /* expected shape: x's leading dims, the channels (C when still free), out size */
        char exp[160], got[128], xs[128];
        size_t n = 0;
        exp[n++] = '[';
        for (int d = 0; d < nd - 2 && n < sizeof exp - 40; d++) {
            if (d == nd - 3) n += (size_t)snprintf(exp + n, sizeof exp - n, result ? "%lld," : "C,",
                                                   (long long)(result ? result->shape[d] : 0));
            else n += (size_t)snprintf(exp + n, sizeof exp - n, "%lld,", (long long)x->shape[d]);
        }
        snprintf(exp + n, sizeof exp - n, "%lld,%lld]", (long long)o.h, (long long)o.w);
        return kiln_error(KILN_ERR_ARG,
                          "tile: fn returned %s for tile %d of %d (input rows %lld-%lld, cols %lld-%lld of %s); "
                          "expected %s (scale %lld/%lld)",
                          kiln_shape_str(y, got, sizeof got), i + 1, p->count, (long long)in.y + 1,
                          (long long)(in.y + in.h), (long long)in.x + 1, (long long)(in.x + in.w),
                          kiln_shape_str(x, xs, sizeof xs), exp, (long long)p->opts.scale_num,
                          (long long)p->opts.scale_den);
    }
    if (result && y->storage->device != result->storage->device)
        return kiln_error(KILN_ERR_ARG, "tile: fn returned tile %d of %d on %s, earlier tiles on %s", i + 1, p->count,
                          y->storage->device->name, result->storage->device->name);
    return KILN_OK;
}

kiln_status kiln_tile_result_new(const kiln_tile_plan *p, const kiln_tensor *y, kiln_tensor **out)
{
    int64_t shape[KILN_MAX_DIMS];
    memcpy(shape, y->shape, sizeof shape);
    shape[y->ndim - 2] = p->axis[0].out_size;
    shape[y->ndim - 1] = p->axis[1].out_size;
    return kiln_tensor_zeros(y->storage->device, y->dtype, y->ndim, shape, out);
}

/* meta answers for the device it models: the same path, without its arithmetic */
static int host_memory(const kiln_device *d) { return kiln_device_host_memory(d); }

/* result window += y * (wy x wx) on host f32 memory, no temporaries. */
static void accumulate_f32(const kiln_tile_plan *p, kiln_tensor *result, int i, const kiln_tensor *y)
{
    const kiln_tile_span *r = &p->axis[0].span[i / p->axis[1].n];
    const kiln_tile_span *c = &p->axis[1].span[i % p->axis[1].n];
    const float *wy = p->axis[0].weight + r->w_offset, *wx = p->axis[1].weight + c->w_offset;
    int64_t h = r->out_len, w = c->out_len, H = p->axis[0].out_size, W = p->axis[1].out_size;
    int64_t planes = kiln_tensor_numel(y) / (h * w);
    const float *src = kiln_tensor_data(y);
    float *dst = kiln_tensor_data(result);
    for (int64_t pl = 0; pl < planes; pl++) {
        const float *s = src + pl * h * w;
        float *d = dst + pl * H * W + r->out_start * W + c->out_start;
        for (int64_t yy = 0; yy < h; yy++) {
            float a = wy[yy];
            for (int64_t xx = 0; xx < w; xx++) d[yy * W + xx] += s[yy * w + xx] * a * wx[xx];
        }
    }
}

/* The same through ops, for device memory and other dtypes. */
static kiln_status accumulate_ops(const kiln_tile_plan *p, kiln_tensor *result, int i, const kiln_tensor *y)
{
    kiln_tile_rect o;
    kiln_tile_rects(p, i, NULL, &o);
    int nd = y->ndim;
    int64_t shape[KILN_MAX_DIMS];
    for (int d = 0; d < nd; d++) shape[d] = 1;
    shape[nd - 2] = o.h;
    shape[nd - 1] = o.w;
    kiln_tensor *wh = NULL, *wt = NULL, *prod = NULL, *va = NULL, *view = NULL, *sum = NULL;
    kiln_status st = kiln_tensor_new(kiln_device_cpu(), KILN_F32, nd, shape, &wh);
    if (st) return st;
    float *w = kiln_tensor_data(wh);
    for (int64_t yy = 0; yy < o.h; yy++)
        for (int64_t xx = 0; xx < o.w; xx++) w[yy * o.w + xx] = kiln_tile_weight(p, i, yy, xx);
    st = kiln_tensor_to(wh, result->storage->device, result->dtype, &wt);
    kiln_tensor_free(wh);
    if (!st) st = kiln_op_binary(KILN_BIN_MUL, y, wt, &prod);
    kiln_tensor_free(wt);
    if (!st) st = kiln_tensor_narrow(result, nd - 2, o.y, o.h, &va);
    if (!st) st = kiln_tensor_narrow(va, nd - 1, o.x, o.w, &view);
    kiln_tensor_free(va);
    if (!st) st = kiln_op_binary(KILN_BIN_ADD, view, prod, &sum);
    kiln_tensor_free(prod);
    if (!st) st = kiln_tensor_copy(view, sum);
    kiln_tensor_free(sum);
    kiln_tensor_free(view);
    return st;
}

kiln_status kiln_tile_accumulate(const kiln_tile_plan *p, kiln_tensor *result, int i, const kiln_tensor *y)
{
    if (i < 0 || i >= p->count) return kiln_error(KILN_ERR_ARG, "tile: index %d out of range (%d tiles)", i, p->count);
    int nd = result->ndim;
    if (nd < 2 || y->ndim != nd || result->shape[nd - 2] != p->axis[0].out_size ||
        result->shape[nd - 1] != p->axis[1].out_size) {
        char b1[128], b2[128];
        return kiln_error(KILN_ERR_ARG, "tile: result %s / tile output %s do not match the plan's output %lldx%lld",
                          kiln_shape_str(result, b1, sizeof b1), kiln_shape_str(y, b2, sizeof b2),
                          (long long)p->axis[0].out_size, (long long)p->axis[1].out_size);
    }
    int fast = result->dtype == KILN_F32 && y->dtype == KILN_F32 &&
               y->storage->device == result->storage->device && host_memory(result->storage->device) &&
               kiln_tensor_is_contiguous(result);
    if (!fast) return accumulate_ops(p, result, i, y);
    kiln_tensor *c = NULL;
    kiln_status st = kiln_tensor_contiguous(y, &c);
    if (st) return st;
    if (!kiln_device_is_meta(result->storage->device)) accumulate_f32(p, result, i, c);
    kiln_tensor_free(c);
    return KILN_OK;
}

kiln_status kiln_tile_map(const kiln_tensor *x, const kiln_tile_opts *o, kiln_tile_fn fn,
                          kiln_tile_progress_fn progress, void *ctx, kiln_tensor **out)
{
    *out = NULL;
    if (!x || !fn) return kiln_error(KILN_ERR_ARG, "tile.map: no input or no function");
    if (x->ndim < 2) return kiln_error(KILN_ERR_ARG, "tile.map: input must have at least 2 dims, got %d", x->ndim);
    kiln_tile_plan *p = NULL;
    kiln_status st = kiln_tile_plan_new(x->shape[x->ndim - 2], x->shape[x->ndim - 1], o, &p);
    if (st) return st;
    kiln_tensor *result = NULL;
    for (int i = 0; i < p->count && !st; i++) {
        kiln_tensor *view = NULL, *tile = NULL, *y = NULL;
        st = kiln_tile_input(p, x, i, &view);
        if (!st) st = kiln_tensor_contiguous(view, &tile);
        kiln_tensor_free(view);
        if (!st) {
            st = fn(ctx, i, tile, &y);
            if (!st && !y) st = kiln_error(KILN_ERR_ARG, "tile.map: fn returned no tensor for tile %d of %d", i + 1, p->count);
        }
        kiln_tensor_free(tile);
        if (!st) st = kiln_tile_check_output(p, x, i, y, result);
        if (!st && !result) st = kiln_tile_result_new(p, y, &result);
        if (!st) st = kiln_tile_accumulate(p, result, i, y);
        kiln_tensor_free(y);
        if (!st && progress && progress(ctx, i + 1, p->count))
            st = kiln_error(KILN_ERR_CANCELLED, "tile.map: cancelled after tile %d of %d", i + 1, p->count);
    }
    kiln_tile_plan_free(p);
    if (st) { kiln_tensor_free(result); return st; }
    *out = result;
    return KILN_OK;
}
