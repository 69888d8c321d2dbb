/* resample.c - nearest upsampling, torch-exact interpolation (bilinear with
 * align_corners=False, nearest-exact, legacy nearest) and 2-D padding of [NC, H, W]
 * planes. Source indices and weights follow ATen's UpSample.h formulas (float scale,
 * double source index for linear), so pixels and weights are those of torch 1.13. Rows are spread over the thread pool. */
#include "cpu_kernels.h"
#include "threadpool.h"

#include <math.h>
#include <string.h>

#define ROW_GRAIN(ow) ((ow) >= 8192 ? 1 : 8192 / (ow)) /* output elements per chunk ~8K */

/* ---- nearest with an integer factor ---- */

typedef struct {
    float *y;
    const float *x;
    int64_t h, w, f;
} up_ctx;

static void up_rows(void *p, int64_t b, int64_t e)
{
    const up_ctx *c = p;
    int64_t oh = c->h * c->f, ow = c->w * c->f;
    for (int64_t r = b; r < e; r++) {
        int64_t plane = r / oh, oy = r % oh;
        const float *src = c->x + (plane * c->h + oy / c->f) * c->w;
        float *dst = c->y + r * ow;
        if (c->f == 2) {
            for (int64_t i = 0; i < c->w; i++) dst[2 * i] = dst[2 * i + 1] = src[i];
        } else {
            for (int64_t i = 0; i < c->w; i++)
                for (int64_t k = 0; k < c->f; k++) dst[i * c->f + k] = src[i];
        }
    }
}

void kiln_cpu_upsample_nearest(float *y, const float *x, int64_t nc, int64_t h, int64_t w, int64_t factor)
{
    if (nc <= 0 || h <= 0 || w <= 0 || factor <= 0) return;
    up_ctx c = { y, x, h, w, factor };
    kiln_parallel_for(nc * h * factor, ROW_GRAIN(w * factor), up_rows, &c);
}

/* ---- index rules (ATen UpSample.h, float arithmetic) ---- */

static inline float scale_of(int64_t in, int64_t out) { return (float)in / (float)out; }

/* compute_source_index_and_lambda: identity when the size is unchanged, else the
 * source index in double (ATen's acc_type of float) from the float scale, clamped at
 * 0; lambda1 rounded to float, lambda0 = 1 - lambda1 in float. */
static inline void linear_index(int64_t i, int64_t in, int64_t out, float scale, int64_t *i0, int64_t *i1,
                                float *l0, float *l1)
{
    if (in == out) {
        *i0 = *i1 = i;
        *l0 = 1.0f;
        *l1 = 0.0f;
        return;
    }
    double src = (double)scale * ((double)i + 0.5) - 0.5;
    if (src < 0) src = 0;
    int64_t k = (int64_t)src;
    if (k > in - 1) k = in - 1; /* never taken for align_corners=False; keeps reads in bounds */
    *i0 = k;
    *i1 = k < in - 1 ? k + 1 : k;
    *l1 = (float)(src - (double)k);
    *l0 = 1.0f - *l1;
}

/* nearest_neighbor_exact_compute_source_index: floorf((i + 0.5) * scale), the
 * product in double as in the C++ source */
static inline int64_t nearest_exact_index(int64_t i, int64_t in, float scale)
{
    int64_t k = (int64_t)floorf((float)(((double)i + 0.5) * (double)scale));
    return k < in - 1 ? k : in - 1;
}

/* nearest_idx: identity and x2 special cases, else floorf(i * scale) */
static inline int64_t nearest_index(int64_t i, int64_t in, int64_t out, float scale)
{
    if (out == in) return i;
    if (out == 2 * in) return i >> 1;
    int64_t k = (int64_t)floorf((float)i * scale);
    return k < in - 1 ? k : in - 1;
}

typedef struct {
    float *y;
    const float *x;
    int64_t h, w, oh, ow;
    float sh, sw;
    int mode; /* 0 bilinear, 1 nearest-exact, 2 nearest */
} interp_ctx;

static void interp_rows(void *p, int64_t b, int64_t e)
{
    const interp_ctx *c = p;
    for (int64_t r = b; r < e; r++) {
        int64_t plane = r / c->oh, oy = r % c->oh;
        const float *src = c->x + plane * c->h * c->w;
        float *dst = c->y + r * c->ow;
        if (c->mode == 0) {
            int64_t y0, y1;
            float h0, h1;
            linear_index(oy, c->h, c->oh, c->sh, &y0, &y1, &h0, &h1);
            const float *r0 = src + y0 * c->w, *r1 = src + y1 * c->w;
            for (int64_t ox = 0; ox < c->ow; ox++) {
                int64_t x0, x1;
                float w0, w1;
                linear_index(ox, c->w, c->ow, c->sw, &x0, &x1, &w0, &w1);
                /* same association as ATen's Interpolate<2>: inner W, then H */
                float t0 = r0[x0] * w0 + r0[x1] * w1;
                float t1 = r1[x0] * w0 + r1[x1] * w1;
                dst[ox] = t0 * h0 + t1 * h1;
            }
        } else if (c->mode == 1) {
            const float *row = src + nearest_exact_index(oy, c->h, c->sh) * c->w;
            for (int64_t ox = 0; ox < c->ow; ox++) dst[ox] = row[nearest_exact_index(ox, c->w, c->sw)];
        } else {
            const float *row = src + nearest_index(oy, c->h, c->oh, c->sh) * c->w;
            for (int64_t ox = 0; ox < c->ow; ox++) dst[ox] = row[nearest_index(ox, c->w, c->ow, c->sw)];
        }
    }
}

static void interp(int mode, float *y, const float *x, int64_t nc, int64_t h, int64_t w, int64_t oh, int64_t ow)
{
    if (nc <= 0 || h <= 0 || w <= 0 || oh <= 0 || ow <= 0) return;
    interp_ctx c = { y, x, h, w, oh, ow, scale_of(h, oh), scale_of(w, ow), mode };
    kiln_parallel_for(nc * oh, ROW_GRAIN(ow), interp_rows, &c);
}

void kiln_cpu_interpolate_bilinear(float *y, const float *x, int64_t nc, int64_t h, int64_t w, int64_t oh, int64_t ow)
{
    interp(0, y, x, nc, h, w, oh, ow);
}

void kiln_cpu_interpolate_nearest_exact(float *y, const float *x, int64_t nc, int64_t h, int64_t w, int64_t oh, int64_t ow)
{
    interp(1, y, x, nc, h, w, oh, ow);
}

void kiln_cpu_interpolate_nearest(float *y, const float *x, int64_t nc, int64_t h, int64_t w, int64_t oh, int64_t ow)
{
    interp(2, y, x, nc, h, w, oh, ow);
}

/* ---- pad2d ---- */

/* Source index of output coordinate i (already shifted by the leading pad), or -1
 * for the constant border. Reflection folds repeatedly and circular wraps
 * repeatedly, so even a pad wider than the input (which F.pad rejects) stays in
 * bounds. */
static inline int64_t pad_index(int64_t s, int64_t n, kiln_pad_mode mode)
{
    if (s >= 0 && s < n) return s;
    if (mode == KILN_PAD_CONSTANT) return -1;
    if (mode == KILN_PAD_REPLICATE || n == 1) return s < 0 ? 0 : n - 1;
    if (mode == KILN_PAD_CIRCULAR) {
        s %= n;
        return s < 0 ? s + n : s;
    }
    int64_t period = 2 * (n - 1);
    s %= period;
    if (s < 0) s += period;
    return s < n ? s : period - s;
}

typedef struct {
    float *y;
    const float *x;
    int64_t h, w, top, left, oh, ow;
    kiln_pad_mode mode;
    float value;
} pad_ctx;

static void pad_rows(void *p, int64_t b, int64_t e)
{
    const pad_ctx *c = p;
    for (int64_t r = b; r < e; r++) {
        int64_t plane = r / c->oh, oy = r % c->oh;
        float *dst = c->y + r * c->ow;
        int64_t sy = pad_index(oy - c->top, c->h, c->mode);
        if (sy < 0) {
            for (int64_t ox = 0; ox < c->ow; ox++) dst[ox] = c->value;
            continue;
        }
        const float *row = c->x + (plane * c->h + sy) * c->w;
        /* the interior is one copy; only the borders need the index rule */
        int64_t in0 = c->left > 0 ? c->left : 0;
        int64_t in1 = c->left + c->w < c->ow ? c->left + c->w : c->ow;
        for (int64_t ox = 0; ox < in0 && ox < c->ow; ox++) {
            int64_t sx = pad_index(ox - c->left, c->w, c->mode);
            dst[ox] = sx < 0 ? c->value : row[sx];
        }
        if (in1 > in0) memcpy(dst + in0, row + (in0 - c->left), (size_t)(in1 - in0) * sizeof(float));
        for (int64_t ox = in1 > in0 ? in1 : in0; ox < c->ow; ox++) {
            int64_t sx = pad_index(ox - c->left, c->w, c->mode);
            dst[ox] = sx < 0 ? c->value : row[sx];
        }
    }
}

void kiln_cpu_pad2d(float *y, const float *x, int64_t nc, int64_t h, int64_t w,
                    int64_t top, int64_t bottom, int64_t left, int64_t right,
                    kiln_pad_mode mode, float value)
{
    int64_t oh = h + top + bottom, ow = w + left + right;
    if (nc <= 0 || h <= 0 || w <= 0 || oh <= 0 || ow <= 0) return;
    pad_ctx c = { y, x, h, w, top, left, oh, ow, mode, value };
    kiln_parallel_for(nc * oh, ROW_GRAIN(ow), pad_rows, &c);
}
