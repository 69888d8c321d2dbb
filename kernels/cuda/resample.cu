/* resample.cu - interpolation of [N, C, H, W] (nearest with an integer factor,
 * torch's legacy nearest, nearest-exact, bilinear align_corners=False) and 2-D
 * padding (constant, reflect, replicate) on CUDA, a thread per output element.
 * Source indices, the bilinear blend and the padding rule are kernel_formulas.h's,
 * which kernels/cpu/resample.c uses too (its explicit roundings keep nvcc from
 * contracting them into FMAs), so pixels are bit-for-bit those of the CPU. */
#include "cuda_dev.h"

/* mode: 0 bilinear, 1 nearest-exact, 2 nearest, 3 nearest with integer factor f */
template <typename T>
__global__ void resample_k(T *y, const T *x, int64_t nc, int64_t h, int64_t w, int64_t oh, int64_t ow, float sh, float sw,
                           int mode, int64_t f)
{
    KILN_GRID_STRIDE(i, nc * oh * ow) {
        int64_t ox = i % ow, r = i / ow, oy = r % oh, plane = r / oh;
        const T *src = x + plane * h * w;
        float v;
        if (mode == 0) {
            int64_t y0, y1, x0, x1;
            float h0, h1, w0, w1;
            kiln_linear_index(oy, h, oh, sh, &y0, &y1, &h0, &h1);
            kiln_linear_index(ox, w, ow, sw, &x0, &x1, &w0, &w1);
            v = kiln_bilinear_blend(kf_to<T>(src[y0 * w + x0]), kf_to<T>(src[y0 * w + x1]), kf_to<T>(src[y1 * w + x0]),
                                    kf_to<T>(src[y1 * w + x1]), w0, w1, h0, h1);
        } else if (mode == 1) {
            v = kf_to<T>(src[kiln_nearest_exact_index(oy, h, sh) * w + kiln_nearest_exact_index(ox, w, sw)]);
        } else if (mode == 2) {
            v = kf_to<T>(src[kiln_nearest_index(oy, h, oh, sh) * w + kiln_nearest_index(ox, w, ow, sw)]);
        } else {
            v = kf_to<T>(src[(oy / f) * w + ox / f]);
        }
        y[i] = kf_from<T>(v);
    }
}

extern "C" kiln_status kiln_cuda_resample(kiln_resample mode, kiln_tensor *out, const kiln_tensor *x)
{
    const char *name = "interpolate";
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, x, NULL, NULL, NULL);
    if (!c) return st;
    int64_t nc = x->shape[0] * x->shape[1], h = x->shape[2], w = x->shape[3], oh = out->shape[2], ow = out->shape[3];
    if (nc * oh * ow == 0 || h == 0 || w == 0) return KILN_OK;
    kiln_dtype dt = out->dtype;
    kiln_tensor *tx = NULL, *to = NULL;
    const void *X;
    void *Y = kiln_tensor_data(out);
    if ((st = kiln_cuda_as(c, x, dt, &tx, &X))) return st;
    if (!kiln_tensor_is_contiguous(out)) {
        if ((st = kiln_cuda_temp(c, dt, 4, out->shape, &to))) { kiln_tensor_free(tx); return st; }
        Y = kiln_tensor_data(to);
    }
    int m = mode == KILN_RS_BILINEAR ? 0 : mode == KILN_RS_NEAREST_EXACT ? 1 : 2;
    int64_t f = 1;
    if (mode == KILN_RS_NEAREST && oh % h == 0 && ow % w == 0 && oh / h == ow / w) { m = 3; f = oh / h; }
    float sh = (float)h / (float)oh, sw = (float)w / (float)ow;
    KILN_CUDA_FLOAT_SWITCH(dt, T,
        resample_k<T><<<kiln_cuda_blocks(c, nc * oh * ow, KILN_CUDA_THREADS), KILN_CUDA_THREADS, 0, c->compute>>>(
            (T *)Y, (const T *)X, nc, h, w, oh, ow, sh, sw, m, f));
    st = kiln_cuda_done(c, name);
    if (!st && to) st = kiln_cuda_copy(out, to);
    kiln_tensor_free(tx);
    kiln_tensor_free(to);
    return st;
}

/* ---- pad2d ---- */

template <typename T>
__global__ void pad_k(T *y, const T *x, int64_t nc, int64_t h, int64_t w, int64_t top, int64_t left, int64_t oh, int64_t ow,
                      int mode, float value)
{
    KILN_GRID_STRIDE(i, nc * oh * ow) {
        int64_t ox = i % ow, r = i / ow, oy = r % oh, plane = r / oh;
        int64_t sy = h > 0 ? kiln_pad_index(oy - top, h, mode) : -1, sx = w > 0 ? kiln_pad_index(ox - left, w, mode) : -1;
        y[i] = sy < 0 || sx < 0 ? kf_from<T>(value) : x[(plane * h + sy) * w + sx];
    }
}

extern "C" kiln_status kiln_cuda_pad2d(kiln_tensor *out, const kiln_tensor *x, const int64_t *pads, int mode, double value)
{
    const char *name = "pad";
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, x, NULL, NULL, NULL);
    if (!c) return st;
    int64_t h = x->shape[x->ndim - 2], w = x->shape[x->ndim - 1];
    int64_t oh = out->shape[out->ndim - 2], ow = out->shape[out->ndim - 1];
    int64_t nc = 1;
    for (int i = 0; i < x->ndim - 2; i++) nc *= x->shape[i];
    if (nc * oh * ow == 0) return KILN_OK;
    if ((h == 0 || w == 0) && mode != KILN_PAD_CONSTANT) return KILN_OK; /* ops.c rejects these */
    kiln_dtype dt = out->dtype;
    kiln_tensor *tx = NULL, *to = NULL;
    const void *X = NULL;
    void *Y = kiln_tensor_data(out);
    if (h * w > 0 && (st = kiln_cuda_as(c, x, dt, &tx, &X))) return st;
    if (!kiln_tensor_is_contiguous(out)) {
        if ((st = kiln_cuda_temp(c, dt, out->ndim, out->shape, &to))) { kiln_tensor_free(tx); return st; }
        Y = kiln_tensor_data(to);
    }
    KILN_CUDA_FLOAT_SWITCH(dt, T,
        pad_k<T><<<kiln_cuda_blocks(c, nc * oh * ow, KILN_CUDA_THREADS), KILN_CUDA_THREADS, 0, c->compute>>>(
            (T *)Y, (const T *)X, nc, h, w, pads[2], pads[0], oh, ow, mode, (float)value));
    st = kiln_cuda_done(c, name);
    if (!st && to) st = kiln_cuda_copy(out, to);
    kiln_tensor_free(tx);
    kiln_tensor_free(to);
    return st;
}
