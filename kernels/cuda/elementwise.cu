/* elementwise.cu - copy/convert, fill, binary, unary and geglu on CUDA tensors.
 * Any strides (broadcast = stride 0), any dtype. Float operands compute in f32;
 * when an integer is involved, in double with the CPU backend's rules (integer
 * division truncates, stores saturate), so results match kernels/cpu/elementwise.c. */
#include "cuda_dev.h"

#include <string.h>

/* ---- copy ---- */

__device__ __forceinline__ void convert_elem(char *d, int ddt, const char *s, int sdt)
{
    if (sdt == KILN_I64) { /* i64 rounds to f32 directly, and i64 -> i64 is exact (as kiln_convert) */
        long long v = *(const long long *)s;
        if (ddt == KILN_I64) *(long long *)d = v;
        else if (ddt == KILN_F32 || ddt == KILN_F16 || ddt == KILN_BF16) kd_storef(d, ddt, (float)v);
        else kd_store(d, ddt, (double)v);
        return;
    }
    int sf = sdt == KILN_F32 || sdt == KILN_F16 || sdt == KILN_BF16;
    int df = ddt == KILN_F32 || ddt == KILN_F16 || ddt == KILN_BF16;
    if (sf && df) kd_storef(d, ddt, kd_loadf(s, sdt));
    else kd_store(d, ddt, kd_load(s, sdt));
}

__global__ void copy_flat_k(char *d, int ddt, const char *s, int sdt, int64_t n)
{
    int de = kd_size(ddt), se = kd_size(sdt);
    KILN_GRID_STRIDE(i, n) convert_elem(d + i * de, ddt, s + i * se, sdt);
}

__global__ void copy_strided_k(kiln_cuda_iter it, char *d, int ddt, const char *s, int sdt, int64_t n)
{
    int de = kd_size(ddt), se = kd_size(sdt);
    KILN_GRID_STRIDE(i, n) {
        int64_t off[2];
        kiln_iter_offsets<2>(it, i, off);
        convert_elem(d + off[0] * de, ddt, s + off[1] * se, sdt);
    }
}

/* same dtype, strided: a move of E-byte elements */
template <typename E>
__global__ void move_strided_k(kiln_cuda_iter it, E *d, const E *s, int64_t n)
{
    KILN_GRID_STRIDE(i, n) {
        int64_t off[2];
        kiln_iter_offsets<2>(it, i, off);
        d[off[0]] = s[off[1]];
    }
}

extern "C" kiln_status kiln_cuda_copy(kiln_tensor *dst, const kiln_tensor *src)
{
    const char *op = "copy";
    int64_t n = kiln_tensor_numel(dst);
    if (n == 0) return KILN_OK;
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(op, &st, dst, src, NULL, NULL, NULL);
    if (!c) return st;
    const kiln_tensor *ops[2] = {dst, src};
    kiln_cuda_iter it;
    int flat = kiln_cuda_iter_init(&it, 2, ops);
    char *d = (char *)kiln_tensor_data(dst);
    const char *s = (const char *)kiln_tensor_data(src);
    unsigned blocks = kiln_cuda_blocks(c, n, KILN_CUDA_THREADS);
    if (flat && dst->dtype == src->dtype)
        return kiln_cuda_check(c, op, "cudaMemcpyAsync",
                               cudaMemcpyAsync(d, s, kiln_tensor_nbytes(dst), cudaMemcpyDeviceToDevice, c->compute));
    /* low-bit weights (fp8, block types) only decode here, into contiguous f32 / f16 /
     * bf16: what a GEMM or convolution asks for (kiln_cuda_as); quantizing is the host's */
    int low_s = src->dtype == KILN_F8_E4M3FN || src->dtype == KILN_F8_E5M2 || kiln_dtype_is_blocked(src->dtype);
    int low_d = dst->dtype == KILN_F8_E4M3FN || dst->dtype == KILN_F8_E5M2 || kiln_dtype_is_blocked(dst->dtype);
    if (low_s || low_d) {
        if (low_d || !kiln_tensor_is_contiguous(src) || !kiln_tensor_is_contiguous(dst) || !kiln_shape_equal(dst, src) ||
            (dst->dtype != KILN_F32 && dst->dtype != KILN_F16 && dst->dtype != KILN_BF16))
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: copy %s -> %s: on CUDA low-bit tensors only decode, contiguous, "
                              "to f32, f16 or bf16 (convert on the cpu)", c->dev->name, kiln_dtype_name(src->dtype),
                              kiln_dtype_name(dst->dtype));
        kiln_status ds = kiln_cuda_dequantize(c, d, dst->dtype, s, src->dtype, n);
        return ds ? ds : kiln_cuda_done(c, op);
    }
    if (flat) {
        copy_flat_k<<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(d, dst->dtype, s, src->dtype, n);
    } else if (dst->dtype == src->dtype) {
        switch (kiln_dtype_size(dst->dtype)) {
        case 1: move_strided_k<uint8_t><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, (uint8_t *)d, (const uint8_t *)s, n); break;
        case 2: move_strided_k<uint16_t><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, (uint16_t *)d, (const uint16_t *)s, n); break;
        case 4: move_strided_k<uint32_t><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, (uint32_t *)d, (const uint32_t *)s, n); break;
        default: move_strided_k<unsigned long long><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(
                     it, (unsigned long long *)d, (const unsigned long long *)s, n); break;
        }
    } else {
        copy_strided_k<<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, d, dst->dtype, s, src->dtype, n);
    }
    return kiln_cuda_done(c, op);
}

/* Over the copy, hence here and not with the context: every op that needs an operand
 * contiguous in its compute dtype comes through it. */
extern "C" kiln_status kiln_cuda_as(kiln_cuda_ctx *c, const kiln_tensor *t, kiln_dtype dt, kiln_tensor **tmp, const void **data)
{
    *tmp = NULL;
    *data = NULL;
    if (t->dtype == dt && kiln_tensor_is_contiguous(t)) {
        *data = kiln_tensor_data(t);
        return KILN_OK;
    }
    kiln_status st = kiln_cuda_temp(c, dt, t->ndim, t->shape, tmp);
    if (!st) st = kiln_cuda_copy(*tmp, t);
    if (st) {
        kiln_tensor_free(*tmp);
        *tmp = NULL;
        return st;
    }
    *data = kiln_tensor_data(*tmp);
    return KILN_OK;
}

/* ---- fill ---- */

template <typename E>
__global__ void fill_k(kiln_cuda_iter it, E *d, E v, int64_t n, int flat)
{
    KILN_GRID_STRIDE(i, n) {
        if (flat) { d[i] = v; continue; }
        int64_t off[1];
        kiln_iter_offsets<1>(it, i, off);
        d[off[0]] = v;
    }
}

/* The bytes of v stored as dt, by the CPU backend's rules (dtype.c, elementwise.c). */
static void fill_pattern(kiln_dtype dt, double v, unsigned char *bytes)
{
    memset(bytes, 0, 8);
    switch (dt) {
    case KILN_F32: { float f = (float)v; memcpy(bytes, &f, 4); } break;
    case KILN_F16: { uint16_t h = kiln_f32_to_f16((float)v); memcpy(bytes, &h, 2); } break;
    case KILN_BF16: { uint16_t h = kiln_f32_to_bf16((float)v); memcpy(bytes, &h, 2); } break;
    default: kiln_store_int(bytes, dt, v); break;
    }
}

extern "C" kiln_status kiln_cuda_fill(kiln_tensor *t, double v)
{
    const char *op = "fill";
    int64_t n = kiln_tensor_numel(t);
    if (n == 0) return KILN_OK;
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(op, &st, t, NULL, NULL, NULL, NULL);
    if (!c) return st;
    unsigned char b[8];
    fill_pattern(t->dtype, v, b);
    size_t e = kiln_dtype_size(t->dtype);
    const kiln_tensor *ops[1] = {t};
    kiln_cuda_iter it;
    int flat = kiln_cuda_iter_init(&it, 1, ops);
    int zero = 1;
    for (size_t i = 0; i < e; i++) zero &= b[i] == 0;
    char *d = (char *)kiln_tensor_data(t);
    if (flat && zero) return kiln_cuda_check(c, op, "cudaMemsetAsync", cudaMemsetAsync(d, 0, (size_t)n * e, c->compute));
    unsigned blocks = kiln_cuda_blocks(c, n, KILN_CUDA_THREADS);
    switch (e) {
    case 1: fill_k<uint8_t><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, (uint8_t *)d, b[0], n, flat); break;
    case 2: { uint16_t x; memcpy(&x, b, 2); fill_k<uint16_t><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, (uint16_t *)d, x, n, flat); } break;
    case 4: { uint32_t x; memcpy(&x, b, 4); fill_k<uint32_t><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, (uint32_t *)d, x, n, flat); } break;
    default: { unsigned long long x; memcpy(&x, b, 8);
        fill_k<unsigned long long><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, (unsigned long long *)d, x, n, flat); } break;
    }
    return kiln_cuda_done(c, op);
}

/* ---- binary ---- */

/* the formulas: kiln_binary_f / kiln_binary_d (kernel_formulas.h), by compute type */
__device__ __forceinline__ float bin_op(int op, float a, float b, int int_div) { return kiln_binary_f(op, a, b, int_div); }
__device__ __forceinline__ double bin_op(int op, double a, double b, int int_div) { return kiln_binary_d(op, a, b, int_div); }

/* all operands of one float type T, contiguous (b may be the scalar) */
template <typename T>
__global__ void binary_flat_k(int op, T *o, const T *a, const T *b, float s, int swap, int64_t n)
{
    KILN_GRID_STRIDE(i, n) {
        float x = kf_to<T>(a[i]), y = b ? kf_to<T>(b[i]) : s;
        if (swap) { float t = x; x = y; y = t; }
        o[i] = kf_from<T>(bin_op(op, x, y, 0));
    }
}

template <typename CT>
__global__ void binary_k(kiln_cuda_iter it, int op, char *o, int dto, const char *a, int dta, const char *b, int dtb,
                         CT s, int swap, int int_div, int64_t n)
{
    int eo = kd_size(dto), ea = kd_size(dta), eb = kd_size(dtb);
    KILN_GRID_STRIDE(i, n) {
        int64_t off[3];
        kiln_iter_offsets<3>(it, i, off);
        CT x, y;
        if (sizeof(CT) == 4) {
            x = (CT)kd_loadf(a + off[1] * ea, dta);
            y = b ? (CT)kd_loadf(b + off[2] * eb, dtb) : s;
        } else {
            x = (CT)kd_load(a + off[1] * ea, dta);
            y = b ? (CT)kd_load(b + off[2] * eb, dtb) : s;
        }
        if (swap) { CT t = x; x = y; y = t; }
        CT r = bin_op(op, x, y, int_div);
        if (sizeof(CT) == 4) kd_storef(o + off[0] * eo, dto, (float)r);
        else kd_store(o + off[0] * eo, dto, (double)r);
    }
}

extern "C" kiln_status kiln_cuda_binary(kiln_binop op, kiln_tensor *out, const kiln_tensor *a, const kiln_tensor *b,
                                        double s, int swap)
{
    const char *name = "binary";
    int64_t n = kiln_tensor_numel(out);
    if (n == 0) return KILN_OK;
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, a, b, NULL, NULL);
    if (!c) return st;
    const kiln_tensor *ops[3] = {out, a, b ? b : a};
    kiln_cuda_iter it;
    int flat = kiln_cuda_iter_init(&it, 3, ops);
    int all_float = kiln_dtype_is_float(out->dtype) && kiln_dtype_is_float(a->dtype) && (!b || kiln_dtype_is_float(b->dtype));
    int int_div = !kiln_dtype_is_float(out->dtype) && op == KILN_BIN_DIV;
    unsigned blocks = kiln_cuda_blocks(c, n, KILN_CUDA_THREADS);
    char *o = (char *)kiln_tensor_data(out);
    const char *pa = (const char *)kiln_tensor_data(a), *pb = b ? (const char *)kiln_tensor_data(b) : NULL;
    if (all_float && flat && a->dtype == out->dtype && (!b || b->dtype == out->dtype)) {
        KILN_CUDA_FLOAT_SWITCH(out->dtype, T,
            binary_flat_k<T><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(op, (T *)o, (const T *)pa, (const T *)pb, (float)s, swap, n));
    } else if (all_float) {
        binary_k<float><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, op, o, out->dtype, pa, a->dtype, pb,
                                                                       b ? b->dtype : KILN_F32, (float)s, swap, 0, n);
    } else {
        binary_k<double><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, op, o, out->dtype, pa, a->dtype, pb,
                                                                        b ? b->dtype : KILN_F32, s, swap, int_div, n);
    }
    return kiln_cuda_done(c, name);
}

/* ---- unary ---- */

/* the formulas: kiln_unary_f / kiln_unary_d (kernel_formulas.h), by compute type */
__device__ __forceinline__ float un_op(int op, float x, float p0, float p1) { return kiln_unary_f(op, x, p0, p1); }
__device__ __forceinline__ double un_op(int op, double x, double p0, double p1) { return kiln_unary_d(op, x, p0, p1); }

template <typename T>
__global__ void unary_flat_k(int op, T *o, const T *a, float p0, float p1, int64_t n)
{
    KILN_GRID_STRIDE(i, n) o[i] = kf_from<T>(un_op(op, kf_to<T>(a[i]), p0, p1));
}

template <typename CT>
__global__ void unary_k(kiln_cuda_iter it, int op, char *o, int dto, const char *a, int dta, CT p0, CT p1, int64_t n)
{
    int eo = kd_size(dto), ea = kd_size(dta);
    KILN_GRID_STRIDE(i, n) {
        int64_t off[2];
        kiln_iter_offsets<2>(it, i, off);
        if (sizeof(CT) == 4) kd_storef(o + off[0] * eo, dto, (float)un_op(op, (CT)kd_loadf(a + off[1] * ea, dta), p0, p1));
        else kd_store(o + off[0] * eo, dto, (double)un_op(op, (CT)kd_load(a + off[1] * ea, dta), p0, p1));
    }
}

extern "C" kiln_status kiln_cuda_unary(kiln_unop op, kiln_tensor *out, const kiln_tensor *a, double p0, double p1)
{
    const char *name = "unary";
    int64_t n = kiln_tensor_numel(out);
    if (n == 0) return KILN_OK;
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, a, NULL, NULL, NULL);
    if (!c) return st;
    const kiln_tensor *ops[2] = {out, a};
    kiln_cuda_iter it;
    int flat = kiln_cuda_iter_init(&it, 2, ops);
    int all_float = kiln_dtype_is_float(out->dtype) && kiln_dtype_is_float(a->dtype);
    unsigned blocks = kiln_cuda_blocks(c, n, KILN_CUDA_THREADS);
    char *o = (char *)kiln_tensor_data(out);
    const char *pa = (const char *)kiln_tensor_data(a);
    if (all_float && flat && a->dtype == out->dtype) {
        KILN_CUDA_FLOAT_SWITCH(out->dtype, T,
            unary_flat_k<T><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(op, (T *)o, (const T *)pa, (float)p0, (float)p1, n));
    } else if (all_float) {
        unary_k<float><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, op, o, out->dtype, pa, a->dtype, (float)p0, (float)p1, n);
    } else {
        unary_k<double><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>(it, op, o, out->dtype, pa, a->dtype, p0, p1, n);
    }
    return kiln_cuda_done(c, name);
}

/* ---- geglu: y[r, :D] = x[r, :D] * gelu(x[r, D:]) (diffusers GEGLU, erf gelu) ---- */

template <typename T>
__global__ void geglu_k(T *y, const T *x, int64_t rows, int64_t D)
{
    KILN_GRID_STRIDE(i, rows * D) {
        int64_t r = i / D, j = i - r * D;
        float a = kf_to<T>(x[r * 2 * D + j]), g = kf_to<T>(x[r * 2 * D + D + j]);
        y[i] = kf_from<T>(a * kiln_unary_f(KILN_UN_GELU, g, 0.0f, 0.0f));
    }
}

extern "C" kiln_status kiln_cuda_geglu(kiln_tensor *out, const kiln_tensor *x)
{
    const char *name = "geglu";
    int64_t n = kiln_tensor_numel(out);
    if (n == 0) return KILN_OK;
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, x, NULL, NULL, NULL);
    if (!c) return st;
    kiln_dtype dt = out->dtype; /* float_of(x) */
    kiln_tensor *tx = NULL, *to = NULL;
    const void *X;
    if ((st = kiln_cuda_as(c, x, dt, &tx, &X))) return st;
    void *Y = kiln_tensor_data(out);
    if (!kiln_tensor_is_contiguous(out)) {
        if ((st = kiln_cuda_temp(c, dt, out->ndim, out->shape, &to))) { kiln_tensor_free(tx); return st; }
        Y = kiln_tensor_data(to);
    }
    int64_t D = out->shape[out->ndim - 1], rows = n / D;
    unsigned blocks = kiln_cuda_blocks(c, n, KILN_CUDA_THREADS);
    KILN_CUDA_FLOAT_SWITCH(dt, T, geglu_k<T><<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>((T *)Y, (const T *)X, rows, D));
    st = kiln_cuda_done(c, name);
    if (!st && to) st = kiln_cuda_copy(out, to);
    kiln_tensor_free(tx);
    kiln_tensor_free(to);
    return st;
}
