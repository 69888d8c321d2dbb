/* norm.c - group_norm (+ fused SiLU), layer_norm and softmax on the CPU.
 * Statistics are accumulated in short float runs folded into doubles, around a
 * shift near the mean, so a 512x512 VAE group (1M elements) keeps ~1e-7 accuracy.
 * AVX-512 / AVX2 paths chosen at run time, portable path otherwise. */
#include "cpu_isa.h"
#include "cpu_kernels.h"
#include "threadpool.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define NORM_X86 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))
#define AVX512_INLINE static inline __attribute__((always_inline, target("avx512f")))
#include "simd_exp.h"
#endif


static int use_avx512(void) { return kiln_cpu_isa() == ISA_AVX512; }

static inline float silu_f(float v) { return v / (1.0f + expf(-v)); }

#ifdef NORM_X86

AVX512_INLINE __m512 silu_avx512(__m512 v)
{
    __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), v));
    return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

AVX512_INLINE __mmask16 tail_mask(int64_t left)
{
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* sum(x - s) and sum((x - s)^2) over n floats: float partial sums over 512-element
 * runs (each lane adds 16 values), folded into doubles after every run. */
AVX512 static void moments_avx512(const float *x, int64_t n, float s, double *sum, double *sq)
{
    __m512d ds = _mm512_setzero_pd(), dq = _mm512_setzero_pd();
    __m512 sh = _mm512_set1_ps(s);
    int64_t i = 0;
    while (i < n) {
        int64_t end = n - i > 512 ? i + 512 : n;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        __m512 q0 = _mm512_setzero_ps(), q1 = _mm512_setzero_ps();
        for (; i + 32 <= end; i += 32) {
            __m512 v0 = _mm512_sub_ps(_mm512_loadu_ps(x + i), sh);
            __m512 v1 = _mm512_sub_ps(_mm512_loadu_ps(x + i + 16), sh);
            a0 = _mm512_add_ps(a0, v0); q0 = _mm512_fmadd_ps(v0, v0, q0);
            a1 = _mm512_add_ps(a1, v1); q1 = _mm512_fmadd_ps(v1, v1, q1);
        }
        for (; i < end; i += 16) {
            __mmask16 m = tail_mask(end - i);
            __m512 v = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, x + i), sh);
            a0 = _mm512_add_ps(a0, v); q0 = _mm512_fmadd_ps(v, v, q0);
        }
        a0 = _mm512_add_ps(a0, a1); q0 = _mm512_add_ps(q0, q1);
        ds = _mm512_add_pd(ds, _mm512_cvtps_pd(_mm512_castps512_ps256(a0)));
        ds = _mm512_add_pd(ds, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a0), 1))));
        dq = _mm512_add_pd(dq, _mm512_cvtps_pd(_mm512_castps512_ps256(q0)));
        dq = _mm512_add_pd(dq, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(q0), 1))));
    }
    *sum = _mm512_reduce_add_pd(ds);
    *sq = _mm512_reduce_add_pd(dq);
}

/* y = ((x - mean.hi) - mean.lo)*a + b, then SiLU if asked */
AVX512 static void affine_avx512(float *y, const float *x, int64_t n, const float *mean, float a, float b, int silu)
{
    __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    __m512 mh = _mm512_set1_ps(mean[0]), ml = _mm512_set1_ps(mean[1]);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 d = _mm512_sub_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), mh), ml);
        __m512 v = _mm512_fmadd_ps(d, va, vb);
        if (silu) v = silu_avx512(v);
        _mm512_mask_storeu_ps(y + i, m, v);
    }
}

/* ---- AVX2 + FMA: the group/layer norm hot loops (softmax stays portable there) ---- */
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))


AVX2 static void moments_avx2(const float *x, int64_t n, float s, double *sum, double *sq)
{
    __m256d ds = _mm256_setzero_pd(), dq = _mm256_setzero_pd();
    __m256 sh = _mm256_set1_ps(s);
    int64_t i = 0;
    while (i + 8 <= n) {
        int64_t end = n - i > 256 ? i + 256 : n; /* each lane adds <= 32 values in float */
        __m256 a0 = _mm256_setzero_ps(), q0 = _mm256_setzero_ps();
        for (; i + 8 <= end; i += 8) {
            __m256 v = _mm256_sub_ps(_mm256_loadu_ps(x + i), sh);
            a0 = _mm256_add_ps(a0, v);
            q0 = _mm256_fmadd_ps(v, v, q0);
        }
        ds = _mm256_add_pd(ds, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a0)),
                                             _mm256_cvtps_pd(_mm256_extractf128_ps(a0, 1))));
        dq = _mm256_add_pd(dq, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(q0)),
                                             _mm256_cvtps_pd(_mm256_extractf128_ps(q0, 1))));
    }
    double t[4], u[4];
    _mm256_storeu_pd(t, ds);
    _mm256_storeu_pd(u, dq);
    double a = t[0] + t[1] + t[2] + t[3], q = u[0] + u[1] + u[2] + u[3];
    for (; i < n; i++) {
        double v = (double)x[i] - s;
        a += v;
        q += v * v;
    }
    *sum = a;
    *sq = q;
}

AVX2 static void affine_avx2(float *y, const float *x, int64_t n, const float *mean, float a, float b, int silu)
{
    __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    __m256 mh = _mm256_set1_ps(mean[0]), ml = _mm256_set1_ps(mean[1]);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 d = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mh), ml);
        __m256 v = _mm256_fmadd_ps(d, va, vb);
        if (silu)
            v = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), v))));
        _mm256_storeu_ps(y + i, v);
    }
    for (; i < n; i++) {
        float v = ((x[i] - mean[0]) - mean[1]) * a + b;
        y[i] = silu ? silu_f(v) : v;
    }
}
#endif

static void moments(const float *x, int64_t n, float s, double *sum, double *sq)
{
#ifdef NORM_X86
    if (use_avx512()) { moments_avx512(x, n, s, sum, sq); return; }
    if (kiln_cpu_isa() == ISA_AVX2) { moments_avx2(x, n, s, sum, sq); return; }
#endif
    double a = 0, q = 0;
    for (int64_t i = 0; i < n; i++) {
        double v = (double)x[i] - s;
        a += v;
        q += v * v;
    }
    *sum = a;
    *sq = q;
}

static void affine(float *y, const float *x, int64_t n, const float *mean, float a, float b, int silu)
{
#ifdef NORM_X86
    if (use_avx512()) { affine_avx512(y, x, n, mean, a, b, silu); return; }
    if (kiln_cpu_isa() == ISA_AVX2) { affine_avx2(y, x, n, mean, a, b, silu); return; }
#endif
    for (int64_t i = 0; i < n; i++) {
        float v = ((x[i] - mean[0]) - mean[1]) * a + b;
        y[i] = silu ? silu_f(v) : v;
    }
}

/* mean (as hi + lo floats) and 1/sqrt(var + eps) of n floats (biased variance, as
 * torch). The shift hi is the mean of a short prefix, so E[(x-s)^2] - E[x-s]^2 does
 * not cancel, and x - hi is (nearly) exact, so a mean far larger than the spread
 * (x = 100 + 0.01 noise) keeps its digits: y = ((x - hi) - lo) * rstd, never
 * x*a + b, whose two large terms would cancel. */
static void mean_rstd(const float *x, int64_t n, float eps, float mean[2], float *rstd)
{
    int64_t pn = n < 32 ? n : 32;
    double ps = 0;
    for (int64_t i = 0; i < pn; i++) ps += x[i];
    float s = (float)(ps / (double)pn);
    double sum, sq;
    moments(x, n, s, &sum, &sq);
    double m = sum / (double)n;
    double var = sq / (double)n - m * m;
    if (var < 0) var = 0;
    mean[0] = s;
    mean[1] = (float)m;
    *rstd = (float)(1.0 / sqrt(var + (double)eps));
}

/* ---- group norm ---- */

typedef struct {
    float *y;
    const float *x, *gamma, *beta;
    int64_t C, HW, G;
    float eps;
    int silu;
} gn_ctx;

static void gn_groups(void *p, int64_t b, int64_t e)
{
    const gn_ctx *c = p;
    int64_t cpg = c->C / c->G;
    for (int64_t t = b; t < e; t++) {
        int64_t n = t / c->G, g = t % c->G;
        int64_t off = (n * c->C + g * cpg) * c->HW;
        float mean[2], rstd;
        mean_rstd(c->x + off, cpg * c->HW, c->eps, mean, &rstd);
        for (int64_t ch = 0; ch < cpg; ch++) {
            int64_t cc = g * cpg + ch;
            float a = rstd * (c->gamma ? c->gamma[cc] : 1.0f);
            float bb = c->beta ? c->beta[cc] : 0.0f;
            affine(c->y + off + ch * c->HW, c->x + off + ch * c->HW, c->HW, mean, a, bb, c->silu);
        }
    }
}

void kiln_cpu_group_norm(float *y, const float *x, const float *gamma, const float *beta,
                         int64_t N, int64_t C, int64_t HW, int64_t G, float eps, int fuse_silu)
{
    if (N <= 0 || C <= 0 || HW <= 0 || G <= 0 || C % G) return; /* the caller validates */
    gn_ctx c = { y, x, gamma, beta, C, HW, G, eps, fuse_silu };
    int64_t per = C / G * HW;
    int64_t grain = per >= 65536 ? 1 : 65536 / per;
    kiln_parallel_for(N * G, grain, gn_groups, &c);
}

/* ---- layer norm ---- */

#ifdef NORM_X86
AVX512 static void ln_apply_avx512(float *y, const float *x, int64_t D, const float *mean, float rstd,
                                   const float *gamma, const float *beta)
{
    __m512 mh = _mm512_set1_ps(mean[0]), ml = _mm512_set1_ps(mean[1]), vr = _mm512_set1_ps(rstd);
    for (int64_t j = 0; j < D; j += 16) {
        __mmask16 m = tail_mask(D - j);
        __m512 v = _mm512_sub_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), mh), ml);
        v = _mm512_mul_ps(v, vr);
        if (gamma) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, gamma + j));
        if (beta) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, beta + j));
        _mm512_mask_storeu_ps(y + j, m, v);
    }
}
#endif

typedef struct {
    float *y;
    const float *x, *gamma, *beta;
    int64_t D;
    float eps;
} ln_ctx;

static void ln_rows(void *p, int64_t b, int64_t e)
{
    const ln_ctx *c = p;
    int64_t D = c->D;
    for (int64_t r = b; r < e; r++) {
        const float *x = c->x + r * D;
        float *y = c->y + r * D;
        float mean[2], rstd;
        mean_rstd(x, D, c->eps, mean, &rstd);
        if (!c->gamma && !c->beta) { affine(y, x, D, mean, rstd, 0.0f, 0); continue; }
#ifdef NORM_X86
        if (use_avx512()) { ln_apply_avx512(y, x, D, mean, rstd, c->gamma, c->beta); continue; }
#endif
        for (int64_t j = 0; j < D; j++) {
            float v = ((x[j] - mean[0]) - mean[1]) * rstd;
            if (c->gamma) v *= c->gamma[j];
            if (c->beta) v += c->beta[j];
            y[j] = v;
        }
    }
}

void kiln_cpu_layer_norm(float *y, const float *x, const float *gamma, const float *beta,
                         int64_t rows, int64_t D, float eps)
{
    if (rows <= 0 || D <= 0) return;
    ln_ctx c = { y, x, gamma, beta, D, eps };
    int64_t grain = D >= 16384 ? 1 : 16384 / D;
    kiln_parallel_for(rows, grain, ln_rows, &c);
}

/* ---- softmax over the middle dim of [outer, dim, inner] ---- */

typedef struct {
    float *y;
    const float *x;
    int64_t dim, inner, nblk; /* nblk: blocks of SM_IB along inner */
} sm_ctx;

#define SM_IB 64 /* inner elements handled together when inner > 1 */

#ifdef NORM_X86
AVX512 static void sm_row_avx512(float *y, const float *x, int64_t n)
{
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, x + i));
    }
    __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vm));
        e = _mm512_maskz_mov_ps(m, e);
        s = _mm512_add_ps(s, e);
        _mm512_mask_storeu_ps(y + i, m, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(s));
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + i), inv));
    }
}

/* inner > 1: w lanes (w <= 16) at x, stride `inner` between dim entries */
AVX512 static void sm_cols_avx512(float *y, const float *x, int64_t dim, int64_t inner, int64_t w)
{
    __mmask16 m = tail_mask(w);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t d = 0; d < dim; d++) mx = _mm512_max_ps(mx, _mm512_maskz_loadu_ps(m, x + d * inner));
    __m512 s = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + d * inner), mx));
        s = _mm512_add_ps(s, e);
        _mm512_mask_storeu_ps(y + d * inner, m, e);
    }
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), s);
    for (int64_t d = 0; d < dim; d++)
        _mm512_mask_storeu_ps(y + d * inner, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + d * inner), inv));
}
#endif

static void sm_row(float *y, const float *x, int64_t n)
{
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double s = 0;
    for (int64_t i = 0; i < n; i++) { y[i] = expf(x[i] - mx); s += y[i]; }
    float inv = (float)(1.0 / s);
    for (int64_t i = 0; i < n; i++) y[i] *= inv;
}

static void sm_tasks(void *p, int64_t b, int64_t e)
{
    const sm_ctx *c = p;
    for (int64_t t = b; t < e; t++) {
        int64_t o = t / c->nblk, i0 = (t % c->nblk) * SM_IB;
        const float *x = c->x + o * c->dim * c->inner + i0;
        float *y = c->y + o * c->dim * c->inner + i0;
        int64_t w = c->inner - i0 < SM_IB ? c->inner - i0 : SM_IB;
        if (c->inner == 1) {
#ifdef NORM_X86
            if (use_avx512()) { sm_row_avx512(y, x, c->dim); continue; }
#endif
            sm_row(y, x, c->dim);
            continue;
        }
#ifdef NORM_X86
        if (use_avx512()) {
            for (int64_t k = 0; k < w; k += 16)
                sm_cols_avx512(y + k, x + k, c->dim, c->inner, w - k < 16 ? w - k : 16);
            continue;
        }
#endif
        float mx[SM_IB], s[SM_IB];
        for (int64_t k = 0; k < w; k++) { mx[k] = -INFINITY; s[k] = 0; }
        for (int64_t d = 0; d < c->dim; d++)
            for (int64_t k = 0; k < w; k++) mx[k] = x[d * c->inner + k] > mx[k] ? x[d * c->inner + k] : mx[k];
        for (int64_t d = 0; d < c->dim; d++)
            for (int64_t k = 0; k < w; k++) {
                float v = expf(x[d * c->inner + k] - mx[k]);
                y[d * c->inner + k] = v;
                s[k] += v;
            }
        for (int64_t k = 0; k < w; k++) s[k] = 1.0f / s[k];
        for (int64_t d = 0; d < c->dim; d++)
            for (int64_t k = 0; k < w; k++) y[d * c->inner + k] *= s[k];
    }
}

void kiln_cpu_softmax(float *y, const float *x, int64_t outer, int64_t dim, int64_t inner)
{
    if (outer <= 0 || dim <= 0 || inner <= 0) return;
    int64_t nblk = inner == 1 ? 1 : (inner + SM_IB - 1) / SM_IB;
    sm_ctx c = { y, x, dim, inner, nblk };
    int64_t per = dim * (inner < SM_IB ? inner : SM_IB);
    int64_t grain = per >= 16384 ? 1 : 16384 / per;
    kiln_parallel_for(outer * nblk, grain, sm_tasks, &c);
}
