/* resample.c - nearest upsampling, torch-exact interpolation (bilinear with
 * align_corners=False, nearest-exact, legacy nearest) and 2-D padding of [NC, H, W]
 * planes. Source indices and weights follow ATen's UpSample.h formulas (float scale,
 * double source index for linear), so pixels and weights are those of torch 1.13. Rows are spread over the thread pool. */
#include "../kernel_formulas.h"
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

/* the index rules themselves are kernels/kernel_formulas.h's, which CUDA shares */

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
            kiln_linear_index(oy, c->h, c->oh, c->sh, &y0, &y1, &h0, &h1);
            const float *r0 = src + y0 * c->w, *r1 = src + y1 * c->w;
            for (int64_t ox = 0; ox < c->ow; ox++) {
                int64_t x0, x1;
                float w0, w1;
                kiln_linear_index(ox, c->w, c->ow, c->sw, &x0, &x1, &w0, &w1);
                dst[ox] = kiln_bilinear_blend(r0[x0], r0[x1], r1[x0], r1[x1], w0, w1, h0, h1);
            }
        } else if (c->mode == 1) {
            const float *row = src + kiln_nearest_exact_index(oy, c->h, c->sh) * c->w;
            for (int64_t ox = 0; ox < c->ow; ox++) dst[ox] = row[kiln_nearest_exact_index(ox, c->w, c->sw)];
        } else {
            const float *row = src + kiln_nearest_index(oy, c->h, c->oh, c->sh) * c->w;
            for (int64_t ox = 0; ox < c->ow; ox++) dst[ox] = row[kiln_nearest_index(ox, c->w, c->ow, c->sw)];
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

/* border indices: kiln_pad_index (kernels/kernel_formulas.h) */

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
        int64_t sy = kiln_pad_index(oy - c->top, c->h, c->mode);
        if (sy < 0) {
            for (int64_t ox = 0; ox < c->ow; ox++) dst[ox] = c->value;
            continue;
        }
        const float *row = c->x + (plane * c->h + sy) * c->w;
        /* the interior is one copy; only the borders need the index rule */
        int64_t in0 = c->left > 0 ? c->left : 0;
        int64_t in1 = c->left + c->w < c->ow ? c->left + c->w : c->ow;
        for (int64_t ox = 0; ox < in0 && ox < c->ow; ox++) {
            int64_t sx = kiln_pad_index(ox - c->left, c->w, c->mode);
            dst[ox] = sx < 0 ? c->value : row[sx];
        }
        if (in1 > in0) memcpy(dst + in0, row + (in0 - c->left), (size_t)(in1 - in0) * sizeof(float));
        for (int64_t ox = in1 > in0 ? in1 : in0; ox < c->ow; ox++) {
            int64_t sx = kiln_pad_index(ox - c->left, c->w, c->mode);
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
