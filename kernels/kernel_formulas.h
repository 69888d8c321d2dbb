/* kernel_formulas.h - the scalar formulas the CPU and CUDA backends must compute
 * alike (ggml's ggml-common.h): pointwise unary and binary ops, the saturating
 * integer store, padding and resampling index rules, fp8 decoding. Compiled by cc
 * (kernels/cpu), nvcc (kernels/cuda) and g++ (the CUDA emulator, tests/gpu/emu), so it
 * is plain C that is also valid C++, needs nothing beyond libm and the op enums, and
 * writes each formula once; the CPU's SIMD paths keep their vector code. */
#ifndef KILN_KERNEL_FORMULAS_H
#define KILN_KERNEL_FORMULAS_H

#ifdef __cplusplus
extern "C" { /* the runtime's functions keep C linkage when nvcc or g++ reads them here first */
#endif
#include "../runtime/backend.h" /* kiln_unop, kiln_binop, kiln_pad_mode, dtypes */
#ifdef __cplusplus
}
#endif

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define KILN_FORMULA static __host__ __device__ __forceinline__
#else
#define KILN_FORMULA static inline
#endif

/* nvcc's device code contracts a * b + c into one FMA unless told not to; cc builds
 * with -std=c11 (no contraction), so spelling each rounding out keeps both sides
 * equal. The _rn intrinsics exist in device code only (__CUDA_ARCH__). */
#if defined(__CUDA_ARCH__)
#define KILN_FMUL_RN(a, b) __fmul_rn((a), (b))
#define KILN_FADD_RN(a, b) __fadd_rn((a), (b))
#define KILN_DMUL_RN(a, b) __dmul_rn((a), (b))
#define KILN_DADD_RN(a, b) __dadd_rn((a), (b))
#else
#define KILN_FMUL_RN(a, b) ((a) * (b))
#define KILN_FADD_RN(a, b) ((a) + (b))
#define KILN_DMUL_RN(a, b) ((a) * (b))
#define KILN_DADD_RN(a, b) ((a) + (b))
#endif

/* ---- pointwise ops, in double (kiln_*_d: integer operands, the CPU's general loop)
 * and in float (kiln_*_f: CUDA's float operands). One body for both: T is the type, S
 * the libm suffix (f, or nothing for double). ---- */

#define KILN_UNARY_DEFINE(NAME, T, S) \
    KILN_FORMULA T NAME(int op, T x, T p0, T p1) \
    { \
        switch (op) { \
        case KILN_UN_NEG: return -x; \
        case KILN_UN_EXP: return exp##S(x); \
        case KILN_UN_LOG: return log##S(x); \
        case KILN_UN_SQRT: return sqrt##S(x); \
        case KILN_UN_ABS: return fabs##S(x); \
        case KILN_UN_TANH: return tanh##S(x); \
        case KILN_UN_SIGMOID: return (T)1 / ((T)1 + exp##S(-x)); \
        case KILN_UN_SILU: return x / ((T)1 + exp##S(-x)); \
        case KILN_UN_GELU: return (T)0.5 * x * ((T)1 + erf##S(x * (T)0.70710678118654752440)); \
        case KILN_UN_GELU_TANH: \
            return (T)0.5 * x * ((T)1 + tanh##S((T)0.79788456080286535588 * (x + (T)0.044715 * x * x * x))); \
        case KILN_UN_QUICK_GELU: return x / ((T)1 + exp##S((T)-1.702 * x)); \
        case KILN_UN_RELU: return x > 0 ? x : (x != x ? x : (T)0); \
        case KILN_UN_SIN: return sin##S(x); \
        case KILN_UN_COS: return cos##S(x); \
        case KILN_UN_CLAMP: /* NaN bounds are absent bounds; a NaN input stays NaN */ \
            if (x != x) return x; \
            if (p0 == p0 && x < p0) x = p0; \
            if (p1 == p1 && x > p1) x = p1; \
            return x; \
        case KILN_UN_LEAKY_RELU: return x < 0 ? x * p0 : x; \
        default: return 0; \
        } \
    }

/* int_div: the output is an integer type, so division truncates (and x / 0 is 0) */
#define KILN_BINARY_DEFINE(NAME, T, S) \
    KILN_FORMULA T NAME(int op, T a, T b, int int_div) \
    { \
        switch (op) { \
        case KILN_BIN_ADD: return a + b; \
        case KILN_BIN_SUB: return a - b; \
        case KILN_BIN_MUL: return a * b; \
        case KILN_BIN_DIV: return int_div ? (b == 0 ? (T)0 : trunc##S(a / b)) : a / b; \
        case KILN_BIN_POW: return pow##S(a, b); \
        case KILN_BIN_MIN: return (a != a || b != b) ? (T)NAN : (a < b ? a : b); \
        case KILN_BIN_MAX: return (a != a || b != b) ? (T)NAN : (a > b ? a : b); \
        default: return 0; \
        } \
    }

KILN_UNARY_DEFINE(kiln_unary_d, double, )
KILN_UNARY_DEFINE(kiln_unary_f, float, f)
KILN_BINARY_DEFINE(kiln_binary_d, double, )
KILN_BINARY_DEFINE(kiln_binary_f, float, f)

/* ---- stores ---- */

/* v stored as an integer dtype (u8, i32, i64): truncated toward zero, saturated, NaN
 * as 0, so no input is undefined behaviour; the upper i64 bound is the largest double
 * below 2^63. */
KILN_FORMULA void kiln_store_int(void *p, int dt, double v)
{
    double lo = dt == KILN_U8 ? 0.0 : dt == KILN_I32 ? -2147483648.0 : -9223372036854775808.0;
    double hi = dt == KILN_U8 ? 255.0 : dt == KILN_I32 ? 2147483647.0 : 9223372036854774784.0;
    double t = v != v ? 0.0 : v < lo ? lo : v > hi ? hi : trunc(v);
    if (dt == KILN_U8) *(uint8_t *)p = (uint8_t)t;
    else if (dt == KILN_I32) *(int32_t *)p = (int32_t)t;
    else *(int64_t *)p = (int64_t)t;
}

/* fp8 e4m3fn (no infinities; S.1111.111 is NaN) to f32: exact */
KILN_FORMULA float kiln_f8_e4m3fn_decode(uint8_t b)
{
    int e = (b >> 3) & 15, m = b & 7;
    float v = e == 15 && m == 7 ? NAN : e == 0 ? (float)m * 0.001953125f /* m * 2^-9 */
                                               : ldexpf(1.0f + (float)m / 8.0f, e - 7);
    return b & 0x80 ? -v : v;
}

/* ---- padding ---- */

/* Source index of output coordinate s (already shifted by the leading pad) in an
 * extent of n, or -1 for the constant border. Reflection folds repeatedly and
 * circular wraps repeatedly, so even a pad wider than the input (which F.pad rejects)
 * stays in bounds. */
KILN_FORMULA int64_t kiln_pad_index(int64_t s, int64_t n, int mode)
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

/* ---- resampling: ATen's UpSample.h index rules, float scale (in / out) ---- */

/* compute_source_index_and_lambda (align_corners=False): identity when the size is
 * unchanged, else the source index in double (ATen's acc_type of float) from the
 * float scale, clamped at 0; lambda1 rounded to float, lambda0 = 1 - lambda1 in float. */
KILN_FORMULA void kiln_linear_index(int64_t i, int64_t in, int64_t out, float scale, int64_t *i0, int64_t *i1,
                                    float *l0, float *l1)
{
    if (in == out) {
        *i0 = *i1 = i;
        *l0 = 1.0f;
        *l1 = 0.0f;
        return;
    }
    double src = KILN_DADD_RN(KILN_DMUL_RN((double)scale, KILN_DADD_RN((double)i, 0.5)), -0.5);
    if (src < 0) src = 0;
    int64_t k = (int64_t)src;
    if (k > in - 1) k = in - 1; /* never taken for align_corners=False; keeps reads in bounds */
    *i0 = k;
    *i1 = k < in - 1 ? k + 1 : k;
    *l1 = (float)KILN_DADD_RN(src, -(double)k);
    *l0 = KILN_FADD_RN(1.0f, -*l1);
}

/* the bilinear blend of the four neighbours (ATen's Interpolate<2> association:
 * inner W, then H); v<row><col> */
KILN_FORMULA float kiln_bilinear_blend(float v00, float v01, float v10, float v11, float w0, float w1, float h0, float h1)
{
    float t0 = KILN_FADD_RN(KILN_FMUL_RN(v00, w0), KILN_FMUL_RN(v01, w1));
    float t1 = KILN_FADD_RN(KILN_FMUL_RN(v10, w0), KILN_FMUL_RN(v11, w1));
    return KILN_FADD_RN(KILN_FMUL_RN(t0, h0), KILN_FMUL_RN(t1, h1));
}

/* nearest_neighbor_exact_compute_source_index: floorf((i + 0.5) * scale), the
 * product in double as in the C++ source */
KILN_FORMULA int64_t kiln_nearest_exact_index(int64_t i, int64_t in, float scale)
{
    int64_t k = (int64_t)floorf((float)KILN_DMUL_RN(KILN_DADD_RN((double)i, 0.5), (double)scale));
    return k < in - 1 ? k : in - 1;
}

/* nearest_idx (torch's legacy nearest): identity and x2 special cases, else
 * floorf(i * scale) */
KILN_FORMULA int64_t kiln_nearest_index(int64_t i, int64_t in, int64_t out, float scale)
{
    if (out == in) return i;
    if (out == 2 * in) return i >> 1;
    int64_t k = (int64_t)floorf(KILN_FMUL_RN((float)i, scale));
    return k < in - 1 ? k : in - 1;
}

#endif
