/* activation.c - pointwise activations (silu, gelu erf/tanh, quick_gelu, sigmoid, geglu).
 * Each op has AVX-512 and AVX2 paths (chosen at run time; own exp with ~1e-7 relative
 * error) and a portable path over libm. They stream over 10M+ elements in the VAE, so the
 * loop runs on the thread pool in cache-sized chunks; y may equal x. */
#include "cpu_isa.h"
#include "cpu_kernels.h"
#include "threadpool.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define ACT_X86 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))
#define AVX512_INLINE static inline __attribute__((always_inline, target("avx512f")))
#include "simd_exp.h"
#endif

#define GRAIN 16384 /* elements per chunk: far above the thread hand-off cost */

enum { OP_SILU, OP_GELU, OP_GELU_TANH, OP_QUICK_GELU, OP_SIGMOID };


/* ---- portable path ---- */

static inline float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

/* 0.5 x (1 + erf(x/sqrt2)) through erfc, so the negative tail keeps its relative
 * precision (1 + erf would cancel). */
static inline float gelu_f(float x)
{
    float c = erfcf(fabsf(x) * 0.70710678118654752f);
    return 0.5f * x * (x > 0 ? 2.0f - c : c);
}

/* 0.5 x (1 + tanh(u)) == x * sigmoid(2u): no cancellation for negative x. */
static inline float gelu_tanh_f(float x)
{
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x * sigmoid_f(2.0f * u);
}

static void op_generic(int op, float *y, const float *x, int64_t n)
{
    switch (op) {
    case OP_SILU:       for (int64_t i = 0; i < n; i++) y[i] = x[i] * sigmoid_f(x[i]); break;
    case OP_GELU:       for (int64_t i = 0; i < n; i++) y[i] = gelu_f(x[i]); break;
    case OP_GELU_TANH:  for (int64_t i = 0; i < n; i++) y[i] = gelu_tanh_f(x[i]); break;
    case OP_QUICK_GELU: for (int64_t i = 0; i < n; i++) y[i] = x[i] * sigmoid_f(1.702f * x[i]); break;
    case OP_SIGMOID:    for (int64_t i = 0; i < n; i++) y[i] = sigmoid_f(x[i]); break;
    }
}

/* ---- AVX-512 path ---- */
#ifdef ACT_X86

AVX512_INLINE __m512 sigmoid_avx512(__m512 x)
{
    __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

/* erfc(|z|) for the gelu, Numerical Recipes' erfcc (Chebyshev fit, relative error
 * below 1.2e-7 for all z >= 0). */
AVX512_INLINE __m512 erfc_abs_avx512(__m512 z)
{
    z = _mm512_abs_ps(z);
    __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.0f)));
    __m512 p = _mm512_set1_ps(0.17087277f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.82215223f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.48851587f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.13520398f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.27886807f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.18628806f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.09678418f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.37409196f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.00002368f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.26551223f));
    p = _mm512_fnmadd_ps(z, z, p);
    return _mm512_mul_ps(t, exp_avx512(p));
}

AVX512_INLINE __m512 gelu_avx512(__m512 x)
{
    __m512 c = erfc_abs_avx512(_mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f)));
    __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
    __m512 f = _mm512_mask_sub_ps(c, pos, _mm512_set1_ps(2.0f), c);
    return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), f);
}

AVX512_INLINE __m512 op_vec(int op, __m512 x)
{
    switch (op) {
    case OP_SILU: return _mm512_mul_ps(x, sigmoid_avx512(x));
    case OP_GELU: return gelu_avx512(x);
    case OP_GELU_TANH: {
        __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        __m512 u2 = _mm512_mul_ps(_mm512_fmadd_ps(x3, _mm512_set1_ps(0.044715f), x),
                                  _mm512_set1_ps(2.0f * 0.7978845608028654f));
        return _mm512_mul_ps(x, sigmoid_avx512(u2));
    }
    case OP_QUICK_GELU: return _mm512_mul_ps(x, sigmoid_avx512(_mm512_mul_ps(x, _mm512_set1_ps(1.702f))));
    default: return sigmoid_avx512(x);
    }
}

AVX512_INLINE void op_avx512_loop(int op, float *y, const float *x, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, op_vec(op, _mm512_loadu_ps(x + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(y + i, m, op_vec(op, _mm512_maskz_loadu_ps(m, x + i)));
    }
}

/* One instance per op so the switch folds away inside the loop. */
AVX512 static void op_avx512(int op, float *y, const float *x, int64_t n)
{
    switch (op) {
    case OP_SILU:       op_avx512_loop(OP_SILU, y, x, n); break;
    case OP_GELU:       op_avx512_loop(OP_GELU, y, x, n); break;
    case OP_GELU_TANH:  op_avx512_loop(OP_GELU_TANH, y, x, n); break;
    case OP_QUICK_GELU: op_avx512_loop(OP_QUICK_GELU, y, x, n); break;
    default:            op_avx512_loop(OP_SIGMOID, y, x, n); break;
    }
}

/* geglu row: y[j] = h[j] * gelu(g[j]) */
AVX512 static void geglu_row_avx512(float *y, const float *h, const float *g, int64_t d)
{
    int64_t j = 0;
    for (; j + 16 <= d; j += 16)
        _mm512_storeu_ps(y + j, _mm512_mul_ps(_mm512_loadu_ps(h + j), gelu_avx512(_mm512_loadu_ps(g + j))));
    if (j < d) {
        __mmask16 m = (__mmask16)((1u << (d - j)) - 1);
        __m512 r = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, h + j), gelu_avx512(_mm512_maskz_loadu_ps(m, g + j)));
        _mm512_mask_storeu_ps(y + j, m, r);
    }
}

/* ---- AVX2 + FMA path: the same math 8 lanes wide ---- */
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))


AVX2_INLINE __m256 sigmoid_avx2(__m256 x)
{
    __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

AVX2_INLINE __m256 gelu_avx2(__m256 x)
{
    __m256 z = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f)));
    __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(z, _mm256_set1_ps(0.5f), _mm256_set1_ps(1.0f)));
    __m256 p = _mm256_set1_ps(0.17087277f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.82215223f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.48851587f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.13520398f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.27886807f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.18628806f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.09678418f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.37409196f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.00002368f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.26551223f));
    p = _mm256_fnmadd_ps(z, z, p);
    __m256 c = _mm256_mul_ps(t, exp_avx2(p));
    __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ);
    __m256 f = _mm256_blendv_ps(c, _mm256_sub_ps(_mm256_set1_ps(2.0f), c), pos);
    return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.5f)), f);
}

AVX2_INLINE __m256 op_vec2(int op, __m256 x)
{
    switch (op) {
    case OP_SILU: return _mm256_mul_ps(x, sigmoid_avx2(x));
    case OP_GELU: return gelu_avx2(x);
    case OP_GELU_TANH: {
        __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        __m256 u2 = _mm256_mul_ps(_mm256_fmadd_ps(x3, _mm256_set1_ps(0.044715f), x),
                                  _mm256_set1_ps(2.0f * 0.7978845608028654f));
        return _mm256_mul_ps(x, sigmoid_avx2(u2));
    }
    case OP_QUICK_GELU: return _mm256_mul_ps(x, sigmoid_avx2(_mm256_mul_ps(x, _mm256_set1_ps(1.702f))));
    default: return sigmoid_avx2(x);
    }
}

AVX2_INLINE void op_avx2_loop(int op, float *y, const float *x, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, op_vec2(op, _mm256_loadu_ps(x + i)));
    if (i < n) { /* tail through a small buffer: no masked loads needed */
        float buf[8] = { 0 };
        memcpy(buf, x + i, (size_t)(n - i) * sizeof(float));
        _mm256_storeu_ps(buf, op_vec2(op, _mm256_loadu_ps(buf)));
        memcpy(y + i, buf, (size_t)(n - i) * sizeof(float));
    }
}

AVX2 static void op_avx2(int op, float *y, const float *x, int64_t n)
{
    switch (op) {
    case OP_SILU:       op_avx2_loop(OP_SILU, y, x, n); break;
    case OP_GELU:       op_avx2_loop(OP_GELU, y, x, n); break;
    case OP_GELU_TANH:  op_avx2_loop(OP_GELU_TANH, y, x, n); break;
    case OP_QUICK_GELU: op_avx2_loop(OP_QUICK_GELU, y, x, n); break;
    default:            op_avx2_loop(OP_SIGMOID, y, x, n); break;
    }
}

AVX2 static void geglu_row_avx2(float *y, const float *h, const float *g, int64_t d)
{
    int64_t j = 0;
    for (; j + 8 <= d; j += 8)
        _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_loadu_ps(h + j), gelu_avx2(_mm256_loadu_ps(g + j))));
    if (j < d) {
        float hb[8] = { 0 }, gb[8] = { 0 };
        memcpy(hb, h + j, (size_t)(d - j) * sizeof(float));
        memcpy(gb, g + j, (size_t)(d - j) * sizeof(float));
        _mm256_storeu_ps(hb, _mm256_mul_ps(_mm256_loadu_ps(hb), gelu_avx2(_mm256_loadu_ps(gb))));
        memcpy(y + j, hb, (size_t)(d - j) * sizeof(float));
    }
}
#endif

static void run_op(int op, float *y, const float *x, int64_t n)
{
#ifdef ACT_X86
    int isa = kiln_cpu_isa();
    if (isa == ISA_AVX512) { op_avx512(op, y, x, n); return; }
    if (isa == ISA_AVX2) { op_avx2(op, y, x, n); return; }
#endif
    op_generic(op, y, x, n);
}

typedef struct { int op; float *y; const float *x; } act_ctx;

static void act_chunk(void *p, int64_t b, int64_t e)
{
    act_ctx *c = p;
    run_op(c->op, c->y + b, c->x + b, e - b);
}

static void act(int op, float *y, const float *x, int64_t n)
{
    act_ctx c = { op, y, x };
    kiln_parallel_for(n, GRAIN, act_chunk, &c);
}

void kiln_cpu_silu(float *y, const float *x, int64_t n) { act(OP_SILU, y, x, n); }
void kiln_cpu_gelu(float *y, const float *x, int64_t n) { act(OP_GELU, y, x, n); }
void kiln_cpu_gelu_tanh(float *y, const float *x, int64_t n) { act(OP_GELU_TANH, y, x, n); }
void kiln_cpu_quick_gelu(float *y, const float *x, int64_t n) { act(OP_QUICK_GELU, y, x, n); }
void kiln_cpu_sigmoid(float *y, const float *x, int64_t n) { act(OP_SIGMOID, y, x, n); }

typedef struct { float *y; const float *x; int64_t d; } geglu_ctx;

static void geglu_rows(void *p, int64_t b, int64_t e)
{
    geglu_ctx *c = p;
    for (int64_t r = b; r < e; r++) {
        const float *h = c->x + r * 2 * c->d, *g = h + c->d;
        float *y = c->y + r * c->d;
#ifdef ACT_X86
        if (kiln_cpu_isa() == ISA_AVX512) { geglu_row_avx512(y, h, g, c->d); continue; }
        if (kiln_cpu_isa() == ISA_AVX2) { geglu_row_avx2(y, h, g, c->d); continue; }
#endif
        for (int64_t j = 0; j < c->d; j++) y[j] = h[j] * gelu_f(g[j]);
    }
}

void kiln_cpu_geglu(float *y, const float *x, int64_t rows, int64_t D)
{
    if (rows <= 0 || D <= 0) return;
    geglu_ctx c = { y, x, D };
    int64_t grain = GRAIN / D;
    kiln_parallel_for(rows, grain < 1 ? 1 : grain, geglu_rows, &c);
}
