/* conv2d.c - 2-d convolution over NCHW f32 images with f32/f16/bf16 weights, as
 * torch.nn.functional.conv2d (stride, padding, dilation, groups, bias).
 * Paths, chosen per shape (measured numbers in tests/bench/bench_gemm_conv.c):
 *   - Winograd F(4x4, 3x3) for 3x3 stride-1 convolutions with enough channels
 *     (conv2d_winograd.c), the bulk of SD's UNet and VAE;
 *   - implicit GEMM: our packed GEMM kernel (gemm.c) with a B packer that reads the
 *     image directly (im2col one KC x NB panel at a time, never a column buffer);
 *     1x1 stride-1 convolutions are the plain GEMM W[K,C] x X[C,HW];
 *   - direct loops for depthwise convolutions (one input channel per group) and for
 *     <= 4 output channels per group (VAE conv_out, UNet conv_out);
 *   - without AVX-512: im2col over strips of output rows (column buffer bounded by
 *     COL_MAX_FLOATS) and OpenBLAS sgemm. */
#define _GNU_SOURCE
#include "cpu_internal.h"
#include "cpu_isa.h"
#include "threadpool.h"
#include "../../runtime/tunables.h"

#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define CONV_X86 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))
#endif


/* Column buffer bound of the fallback path: 4 Mi floats = 16 MiB. */
enum { COL_MAX_FLOATS = 4 << 20, WBLOCK_ROWS = 64 };

/* Every size must stay far from overflow in products such as n*c*h*w. */
static const int64_t DIM_MAX = (int64_t)1 << 31;

static int mul_ok(int64_t a, int64_t b, int64_t *out)
{
    if (a < 0 || b < 0) return 0;
    if (a != 0 && b > INT64_MAX / 4 / a) return 0;
    *out = a * b;
    return 1;
}

kiln_status kiln_conv2d_out_size(kiln_conv2d_params *p)
{
    if (!p) return kiln_error(KILN_ERR_ARG, "conv2d: NULL params");
    const int64_t dims[] = {p->n, p->c, p->h, p->w, p->k, p->r, p->s, p->stride_h, p->stride_w, p->dil_h, p->dil_w,
                            p->groups};
    static const char *const names[] = {"batch", "input channels", "height", "width", "output channels",
                                        "kernel height", "kernel width", "stride_h", "stride_w", "dilation_h",
                                        "dilation_w", "groups"};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i] < 1 || dims[i] > DIM_MAX)
            return kiln_error(KILN_ERR_ARG, "conv2d: %s = %lld (must be in 1..2^31)", names[i], (long long)dims[i]);
    if (p->pad_h < 0 || p->pad_w < 0 || p->pad_h > DIM_MAX || p->pad_w > DIM_MAX)
        return kiln_error(KILN_ERR_ARG, "conv2d: padding %lldx%lld must be >= 0", (long long)p->pad_h,
                          (long long)p->pad_w);
    if (p->c % p->groups || p->k % p->groups)
        return kiln_error(KILN_ERR_ARG, "conv2d: groups=%lld must divide input channels %lld and output channels %lld",
                          (long long)p->groups, (long long)p->c, (long long)p->k);
    int64_t ext_h = p->dil_h * (p->r - 1) + 1, ext_w = p->dil_w * (p->s - 1) + 1;
    int64_t in_h = p->h + 2 * p->pad_h, in_w = p->w + 2 * p->pad_w;
    if (in_h < ext_h || in_w < ext_w)
        return kiln_error(KILN_ERR_ARG,
                          "conv2d: input %lldx%lld (padded %lldx%lld) is smaller than the dilated kernel %lldx%lld: "
                          "empty output", (long long)p->h, (long long)p->w, (long long)in_h, (long long)in_w,
                          (long long)ext_h, (long long)ext_w);
    p->oh = (in_h - ext_h) / p->stride_h + 1;
    p->ow = (in_w - ext_w) / p->stride_w + 1;
    int64_t t;
    if (!mul_ok(p->n, p->c, &t) || !mul_ok(t, p->h, &t) || !mul_ok(t, p->w, &t) ||
        !mul_ok(p->n, p->k, &t) || !mul_ok(t, p->oh, &t) || !mul_ok(t, p->ow, &t) ||
        !mul_ok(p->k, p->c / p->groups, &t) || !mul_ok(t, p->r, &t) || !mul_ok(t, p->s, &t))
        return kiln_error(KILN_ERR_ARG, "conv2d: tensor sizes overflow");
    return KILN_OK;
}

/* ---------- depthwise: one input channel per group ---------- */

typedef struct {
    float *y;
    const float *x;
    const void *w;
    kiln_dtype w_dt;
    const float *bias;
    const kiln_conv2d_params *p;
    float *wscratch;              /* kiln_cpu_threads() x r*s floats */
} conv_job;

static void depthwise_fn(void *vctx, int64_t begin, int64_t end)
{
    const conv_job *j = vctx;
    const kiln_conv2d_params *p = j->p;
    int64_t kg = p->k / p->groups, rs = p->r * p->s;
    float *wbuf = j->wscratch + (size_t)kiln_thread_index() * (size_t)rs;
    for (int64_t plane = begin; plane < end; plane++) {
        int64_t n = plane / p->k, k = plane % p->k, c = k / kg;
        const float *xp = j->x + (n * p->c + c) * p->h * p->w;
        float *yp = j->y + (n * p->k + k) * p->oh * p->ow;
        kiln_to_f32(wbuf, (const char *)j->w + (size_t)(k * rs) * kiln_dtype_size(j->w_dt), j->w_dt, (size_t)rs);
        float b = j->bias ? j->bias[k] : 0.0f;
        for (int64_t oy = 0; oy < p->oh; oy++) {
            float *yr = yp + oy * p->ow;
            for (int64_t ox = 0; ox < p->ow; ox++) yr[ox] = b;
            for (int64_t rr = 0; rr < p->r; rr++) {
                int64_t iy = oy * p->stride_h - p->pad_h + rr * p->dil_h;
                if (iy < 0 || iy >= p->h) continue;
                const float *xr = xp + iy * p->w;
                for (int64_t ss = 0; ss < p->s; ss++) {
                    float wv = wbuf[rr * p->s + ss];
                    int64_t off = ss * p->dil_w - p->pad_w;
                    /* ox range with 0 <= ox*stride + off < w */
                    int64_t lo = off >= 0 ? 0 : (-off + p->stride_w - 1) / p->stride_w;
                    int64_t hi = p->w - off <= 0 ? 0 : (p->w - off - 1) / p->stride_w + 1;
                    if (hi > p->ow) hi = p->ow;
                    if (p->stride_w == 1)
                        for (int64_t ox = lo; ox < hi; ox++) yr[ox] += wv * xr[ox + off];
                    else
                        for (int64_t ox = lo; ox < hi; ox++) yr[ox] += wv * xr[ox * p->stride_w + off];
                }
            }
        }
    }
}

/* ---------- implicit GEMM (AVX-512) ---------- */
#ifdef CONV_X86

typedef struct {
    const float *x;               /* [cg, h, w] of this image and group */
    const kiln_conv2d_params *p;
} im2col_ctx;

/* Packs rows q = (c, r, s) in [k0, k0+kc) and output pixels [j0, j0+n) of the virtual
 * column matrix into 32-wide slivers (see pack_b_fn in gemm.c). */
AVX512 static void im2col_pack(void *vctx, float *dst, int64_t j0, int64_t n, int64_t k0, int64_t kc)
{
    const im2col_ctx *ctx = vctx;
    const kiln_conv2d_params *p = ctx->p;
    const int64_t H = p->h, W = p->w, R = p->r, S = p->s, OW = p->ow;
    const int plain = R == 1 && S == 1 && p->stride_h == 1 && p->stride_w == 1 && p->pad_h == 0 && p->pad_w == 0;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (plain) {
        /* 1x1: row q of the column matrix is channel q of the image. Channel outer: each
         * plane's run of n pixels is read front to back (channel planes are megabytes
         * apart: one sliver at a time touched a new page on every load, 20% of a VAE
         * 1x1 convolution) */
        for (int64_t k = 0; k < kc; k++) {
            const float *src = ctx->x + (k0 + k) * H * W + j0;
            for (int64_t js = 0; js < n; js += 32) {
                int nn = n - js < 32 ? (int)(n - js) : 32;
                __mmask16 m0 = nn >= 16 ? 0xffff : (__mmask16)((1u << nn) - 1);
                __mmask16 m1 = nn >= 32 ? 0xffff : nn > 16 ? (__mmask16)((1u << (nn - 16)) - 1) : 0;
                float *out = dst + (js / 32) * kc * 32 + k * 32;
                _mm512_store_ps(out, _mm512_maskz_loadu_ps(m0, src + js));
                _mm512_store_ps(out + 16, _mm512_maskz_loadu_ps(m1, src + js + 16));
            }
        }
        return;
    }
    for (int64_t js = 0; js < n; js += 32) {
        int nn = n - js < 32 ? (int)(n - js) : 32;
        float *out = dst + (js / 32) * kc * 32;
        int64_t jb = j0 + js;
        /* runs of lanes that lie in one output row */
        int run_l0[33], run_l1[33];
        int64_t run_oy[33], run_ox[33];
        int nr = 0;
        for (int l = 0; l < nn;) {
            int64_t j = jb + l, oy = j / OW, ox = j % OW;
            int len = OW - ox < nn - l ? (int)(OW - ox) : nn - l;
            run_l0[nr] = l; run_l1[nr] = l + len; run_oy[nr] = oy; run_ox[nr] = ox;
            nr++;
            l += len;
        }
        int64_t q = k0;
        int64_t c = q / (R * S), rr = (q / S) % R, ss = q % S;
        for (int64_t k = 0; k < kc; k++) {
            __m512 v0 = _mm512_setzero_ps(), v1 = v0;
            const float *plane = ctx->x + c * H * W;
            for (int t = 0; t < nr; t++) {
                int64_t iy = run_oy[t] * p->stride_h - p->pad_h + rr * p->dil_h;
                if (iy < 0 || iy >= H) continue;
                const float *row = plane + iy * W;
                int64_t ix0 = run_ox[t] * p->stride_w - p->pad_w + ss * p->dil_w; /* x column of lane run_l0 */
                int l0 = run_l0[t], l1 = run_l1[t];
                if (p->stride_w == 1) {
                    /* lanes l with 0 <= ix0 + (l - l0) < W */
                    int64_t a = ix0 < 0 ? l0 - ix0 : l0, b = l0 + (W - ix0);
                    if (b > l1) b = l1;
                    if (a >= b) continue;
                    uint32_t bits = (uint32_t)(((uint64_t)1 << b) - ((uint64_t)1 << a));
                    /* lane l reads row[ix0 - l0 + l]; masked-off lanes are never touched */
                    const float *base = row + (ix0 - l0);
                    if (bits & 0xffff) v0 = _mm512_mask_loadu_ps(v0, (__mmask16)bits, base);
                    if (bits >> 16) v1 = _mm512_mask_loadu_ps(v1, (__mmask16)(bits >> 16), base + 16);
                } else {
                    for (int half = 0; half < 2; half++) {
                        int hl0 = half * 16;
                        if (l1 <= hl0 || l0 >= hl0 + 16) continue;
                        /* lane i (global lane hl0 + i) reads ix = ix0 + (hl0 + i - l0) * stride */
                        __m512i ix = _mm512_add_epi32(_mm512_set1_epi32((int)(ix0 + (int64_t)(hl0 - l0) * p->stride_w)),
                                                      _mm512_mullo_epi32(iota, _mm512_set1_epi32((int)p->stride_w)));
                        uint32_t lanes = (uint32_t)(((uint64_t)1 << l1) - ((uint64_t)1 << l0)) >> hl0;
                        __mmask16 mk = (__mmask16)lanes & _mm512_cmpge_epi32_mask(ix, _mm512_setzero_si512()) &
                                       _mm512_cmplt_epi32_mask(ix, _mm512_set1_epi32((int)W));
                        if (!mk) continue;
                        if (half == 0) v0 = _mm512_mask_i32gather_ps(v0, mk, ix, row, 4);
                        else v1 = _mm512_mask_i32gather_ps(v1, mk, ix, row, 4);
                    }
                }
            }
            _mm512_store_ps(out + k * 32, v0);
            _mm512_store_ps(out + k * 32 + 16, v1);
            if (++ss == S) {
                ss = 0;
                if (++rr == R) { rr = 0; c++; }
            }
        }
    }
}

/* ---------- few output channels (AVX-512) ---------- */

/* With <= 4 output channels per group (the VAE's 128 -> 3 conv_out, the UNet's 320 -> 4)
 * a GEMM would pack the whole image to use each packed value for <= 4 rows. Instead:
 * 64 output pixels of a row x 4 output channels in registers, one load of the input
 * row per tap serving all 4 (stride_w 1). The f32 weights, zero-padded to 4 outputs
 * per group, are small: 4 x C x R x S floats. */
enum { SMALLK = 4, SK_VEC = 4 };

typedef struct {
    float *y;
    const float *x, *w;           /* w: [groups][SMALLK][cg][r][s] f32 */
    const float *bias;
    const kiln_conv2d_params *p;
} smallk_job;

AVX512 static void smallk_fn(void *vctx, int64_t begin, int64_t end)
{
    const smallk_job *j = vctx;
    const kiln_conv2d_params *p = j->p;
    const int64_t cg = p->c / p->groups, kg = p->k / p->groups, R = p->r, S = p->s, H = p->h, W = p->w;
    const int64_t OH = p->oh, OW = p->ow, RS = R * S;
    for (int64_t row = begin; row < end; row++) { /* row = (n * groups + g) * OH + oy */
        int64_t oy = row % OH, ng = row / OH, g = ng % p->groups, n = ng / p->groups;
        const float *xg = j->x + (n * p->c + g * cg) * H * W;
        const float *wg = j->w + g * SMALLK * cg * RS;
        for (int64_t ox0 = 0; ox0 < OW; ox0 += 16 * SK_VEC) {
            /* fully unrolled loops over k and v keep acc in 16 registers */
            __m512 acc[SMALLK][SK_VEC];
#pragma GCC unroll 4
            for (int k = 0; k < SMALLK; k++)
#pragma GCC unroll 4
                for (int v = 0; v < SK_VEC; v++)
                    acc[k][v] = _mm512_set1_ps(j->bias && k < kg ? j->bias[g * kg + k] : 0.0f);
            for (int64_t c = 0; c < cg; c++)
                for (int64_t r = 0; r < R; r++) {
                    int64_t iy = oy * p->stride_h - p->pad_h + r * p->dil_h;
                    if (iy < 0 || iy >= H) continue;
                    const float *xr = xg + (c * H + iy) * W;
                    /* this row's part for the next 64 outputs: used after all C*R rows of
                     * this block, far enough ahead to come from memory in time */
                    if (ox0 + 16 * SK_VEC < OW)
                        for (int v = 0; v < SK_VEC; v++) {
                            int64_t at = ox0 + 16 * SK_VEC - p->pad_w + 16 * v;
                            if (at >= 0 && at < W) _mm_prefetch((const char *)(xr + at), _MM_HINT_T0);
                        }
                    for (int64_t q = 0; q < S; q++) {
                        int64_t ix0 = ox0 - p->pad_w + q * p->dil_w;
                        __m512 xv[SK_VEC];
#pragma GCC unroll 4
                        for (int v = 0; v < SK_VEC; v++) {
                            /* lane l reads column ix0 + 16v + l: inside the row and for an output < OW */
                            int64_t lo = ix0 + 16 * v, a = lo < 0 ? -lo : 0, b = W - lo;
                            if (b > OW - ox0 - 16 * v) b = OW - ox0 - 16 * v;
                            if (b > 16) b = 16;
                            __mmask16 mk = a >= b ? 0 : (__mmask16)(((1u << b) - 1) & ~((1u << a) - 1));
                            xv[v] = _mm512_maskz_loadu_ps(mk, xr + lo);
                        }
                        const float *wp = wg + c * RS + r * S + q;
#pragma GCC unroll 4
                        for (int k = 0; k < SMALLK; k++) {
                            __m512 wv = _mm512_set1_ps(wp[k * cg * RS]);
#pragma GCC unroll 4
                            for (int v = 0; v < SK_VEC; v++) acc[k][v] = _mm512_fmadd_ps(wv, xv[v], acc[k][v]);
                        }
                    }
                }
            for (int64_t k = 0; k < kg; k++) {
                float *yr = j->y + ((n * p->k + g * kg + k) * OH + oy) * OW + ox0;
                for (int v = 0; v < SK_VEC; v++) {
                    int64_t b = OW - ox0 - 16 * v;
                    if (b <= 0) break;
                    _mm512_mask_storeu_ps(yr + 16 * v, b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << b) - 1),
                                          acc[k][v]);
                }
            }
        }
    }
}

/* 0 done, -1 not possible (no SIMD, not this shape, no scratch). */
static int conv_smallk(float *y, const float *x, const void *w, kiln_dtype w_dt, const float *bias,
                       const kiln_conv2d_params *p)
{
    int64_t cg = p->c / p->groups, kg = p->k / p->groups, crs = cg * p->r * p->s;
    if (!kiln_cpu_gemm_have_simd() || kg > SMALLK || p->stride_w != 1) return -1;
    size_t n = (size_t)(p->groups * SMALLK * crs);
    float *wp = kiln_cpu_scratch_get(n * sizeof *wp);
    if (!wp) return -1;
    memset(wp, 0, n * sizeof *wp);
    size_t esz = kiln_dtype_size(w_dt);
    for (int64_t g = 0; g < p->groups; g++)
        for (int64_t k = 0; k < kg; k++)
            kiln_to_f32(wp + (g * SMALLK + k) * crs, (const char *)w + (size_t)((g * kg + k) * crs) * esz, w_dt,
                        (size_t)crs);
    smallk_job j = {y, x, wp, bias, p};
    kiln_parallel_for(p->n * p->groups * p->oh, 1, smallk_fn, &j);
    kiln_cpu_scratch_put(wp);
    return 0;
}

/* 0 done, -1 not possible (no SIMD kernel or no scratch). */
static int conv_implicit_gemm(float *y, const float *x, const void *w, kiln_dtype w_dt, const float *bias,
                              const kiln_conv2d_params *p)
{
    int64_t cg = p->c / p->groups, kg = p->k / p->groups, crs = cg * p->r * p->s;
    size_t esz = kiln_dtype_size(w_dt);
    for (int64_t n = 0; n < p->n; n++)
        for (int64_t g = 0; g < p->groups; g++) {
            im2col_ctx ctx = {x + (n * p->c + g * cg) * p->h * p->w, p};
            float *yg = y + (n * p->k + g * kg) * p->oh * p->ow;
            /* -1 (no SIMD or no scratch): the caller's fallback recomputes everything */
            if (kiln_cpu_gemm_ex(kg, p->oh * p->ow, crs, (const char *)w + (size_t)(g * kg * crs) * esz, w_dt, crs,
                                 im2col_pack, &ctx, yg, p->oh * p->ow, bias ? bias + g * kg : NULL) != 0)
                return -1;
        }
    return 0;
}
#else
static int conv_implicit_gemm(float *y, const float *x, const void *w, kiln_dtype w_dt, const float *bias,
                              const kiln_conv2d_params *p)
{
    (void)y; (void)x; (void)w; (void)w_dt; (void)bias; (void)p;
    return -1;
}
static int conv_smallk(float *y, const float *x, const void *w, kiln_dtype w_dt, const float *bias,
                       const kiln_conv2d_params *p)
{
    (void)y; (void)x; (void)w; (void)w_dt; (void)bias; (void)p;
    return -1;
}
#endif

/* ---------- fallback: im2col strips + sgemm (OpenBLAS) ---------- */

typedef struct {
    float *col;
    const float *x;               /* [cg, h, w] */
    const kiln_conv2d_params *p;
    int64_t oy0, rows;            /* output rows of this strip */
} strip_ctx;

static void im2col_rows_fn(void *vctx, int64_t begin, int64_t end)
{
    const strip_ctx *s = vctx;
    const kiln_conv2d_params *p = s->p;
    int64_t ncol = s->rows * p->ow;
    for (int64_t q = begin; q < end; q++) {
        int64_t c = q / (p->r * p->s), rr = (q / p->s) % p->r, ss = q % p->s;
        const float *plane = s->x + c * p->h * p->w;
        float *dst = s->col + q * ncol;
        for (int64_t oy = s->oy0; oy < s->oy0 + s->rows; oy++) {
            int64_t iy = oy * p->stride_h - p->pad_h + rr * p->dil_h;
            float *d = dst + (oy - s->oy0) * p->ow;
            if (iy < 0 || iy >= p->h) {
                memset(d, 0, (size_t)p->ow * sizeof *d);
                continue;
            }
            const float *row = plane + iy * p->w;
            for (int64_t ox = 0; ox < p->ow; ox++) {
                int64_t ix = ox * p->stride_w - p->pad_w + ss * p->dil_w;
                d[ox] = ix >= 0 && ix < p->w ? row[ix] : 0.0f;
            }
        }
    }
}

static kiln_status conv_im2col_blas(float *y, const float *x, const void *w, kiln_dtype w_dt, const float *bias,
                                    const kiln_conv2d_params *p)
{
    int64_t cg = p->c / p->groups, kg = p->k / p->groups, crs = cg * p->r * p->s, ohw = p->oh * p->ow;
    size_t esz = kiln_dtype_size(w_dt);
    int plain = p->r == 1 && p->s == 1 && p->stride_h == 1 && p->stride_w == 1 && p->pad_h == 0 && p->pad_w == 0;
    int64_t rows = plain ? p->oh : COL_MAX_FLOATS / (crs * p->ow > 0 ? crs * p->ow : 1);
    if (rows < 1) rows = 1;
    if (rows > p->oh) rows = p->oh;
    int64_t kb = w_dt == KILN_F32 ? kg : (kg < WBLOCK_ROWS ? kg : WBLOCK_ROWS);
    float *col = plain ? NULL : kiln_cpu_scratch_get((size_t)(crs * rows * p->ow) * sizeof *col);
    float *wbuf = w_dt == KILN_F32 ? NULL : kiln_cpu_scratch_get((size_t)(kb * crs) * sizeof *wbuf);
    if ((!plain && !col) || (w_dt != KILN_F32 && !wbuf)) {
        kiln_cpu_scratch_put(col);
        kiln_cpu_scratch_put(wbuf);
        return kiln_error_oom("cpu", (uint64_t)(crs * rows * p->ow + kb * crs) * 4, 0, 0,
                              "conv2d: no memory for the column buffer (%lld floats)", (long long)(crs * rows * p->ow));
    }
    for (int64_t n = 0; n < p->n; n++)
        for (int64_t g = 0; g < p->groups; g++) {
            const float *xg = x + (n * p->c + g * cg) * p->h * p->w;
            float *yg = y + (n * p->k + g * kg) * ohw;
            const char *wg = (const char *)w + (size_t)(g * kg * crs) * esz;
            for (int64_t oy0 = 0; oy0 < p->oh; oy0 += rows) {
                int64_t nrow = p->oh - oy0 < rows ? p->oh - oy0 : rows, ncol = nrow * p->ow;
                const float *B = xg;
                if (!plain) {
                    strip_ctx s = {col, xg, p, oy0, nrow};
                    kiln_parallel_for(crs, 1, im2col_rows_fn, &s);
                    B = col;
                }
                for (int64_t k0 = 0; k0 < kg; k0 += kb) {
                    int64_t kn = kg - k0 < kb ? kg - k0 : kb;
                    const float *A = (const float *)wg + k0 * crs;
                    if (wbuf) {
                        kiln_to_f32(wbuf, wg + (size_t)(k0 * crs) * esz, w_dt, (size_t)(kn * crs));
                        A = wbuf;
                    }
                    kiln_cpu_gemm_f32(0, 0, kn, ncol, crs, 1.0f, A, crs, B, plain ? ohw : ncol, 0.0f,
                                      yg + k0 * ohw + oy0 * p->ow, ohw);
                }
            }
            if (bias)
                for (int64_t k = 0; k < kg; k++) {
                    float b = bias[g * kg + k], *yk = yg + k * ohw;
                    for (int64_t i = 0; i < ohw; i++) yk[i] += b;
                }
        }
    kiln_cpu_scratch_put(col);
    kiln_cpu_scratch_put(wbuf);
    return KILN_OK;
}

/* ---------- entry ---------- */

/* Which path runs; KILN_CONV_PATH=gemm|winograd|winograd-few|im2col|direct forces one where it
 * applies (benchmarks and tests compare them). */
typedef enum { PATH_AUTO = 0, PATH_GEMM, PATH_WINOGRAD, PATH_WINOGRAD_FEW, PATH_IM2COL, PATH_DIRECT } conv_path;

static conv_path forced_path(void)
{
    const char *e = kiln_tunable_str("KILN_CONV_PATH");
    if (!e) return PATH_AUTO;
    if (!strcmp(e, "gemm")) return PATH_GEMM;
    if (!strcmp(e, "winograd")) return PATH_WINOGRAD;
    if (!strcmp(e, "winograd-few")) return PATH_WINOGRAD_FEW;
    if (!strcmp(e, "im2col")) return PATH_IM2COL;
    if (!strcmp(e, "direct")) return PATH_DIRECT;
    return PATH_AUTO;
}

/* ---- the output's residual and activation, where the path did not apply them ---- */

typedef struct { float *y; const float *r; int act; float slope; } post_job;

/* y + r (when r), then leaky ReLU (when act) as the unary op computes it: x < 0 ->
 * x * slope (+ 0: ReLU's -0 becomes 0) */
static inline float post1(float v, const float *r, int64_t i, int act, float slope)
{
    if (r) v += r[i];
    return act && v < 0.0f ? v * slope + 0.0f : v;
}

#ifdef CONV_X86
AVX512 static void post_avx512(float *y, const float *r, int64_t n, int act, float slope)
{
    const __m512 zero = _mm512_setzero_ps(), s = _mm512_set1_ps(slope);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(y + i);
        if (r) v = _mm512_add_ps(v, _mm512_loadu_ps(r + i));
        if (act) v = _mm512_add_ps(_mm512_mask_mul_ps(v, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), v, s), zero);
        _mm512_storeu_ps(y + i, v);
    }
    for (; i < n; i++) y[i] = post1(y[i], r, i, act, slope);
}
#endif

static void post_fn(void *vctx, int64_t begin, int64_t end)
{
    const post_job *j = vctx;
    float *y = j->y + begin;
    const float *r = j->r ? j->r + begin : NULL;
    int64_t n = end - begin;
#ifdef CONV_X86
    if (kiln_cpu_isa() == ISA_AVX512) { post_avx512(y, r, n, j->act, j->slope); return; }
#endif
    for (int64_t i = 0; i < n; i++) y[i] = post1(y[i], r, i, j->act, j->slope);
}

static void conv_post(float *y, const kiln_conv2d_params *p)
{
    post_job j = {y, p->residual, p->act, p->act_slope};
    kiln_parallel_for(p->n * p->k * p->oh * p->ow, 1 << 16, post_fn, &j);
}

/* The paths in order of preference; *post_done says whether the path applied
 * p->residual and p->act. */
static kiln_status conv_paths(float *y, const float *x, const void *w, kiln_dtype w_dtype,
                              const float *bias, const kiln_conv2d_params *p, int *post_done);

kiln_status kiln_cpu_conv2d(float *y, const float *x, const void *w, kiln_dtype w_dtype,
                            const float *bias, const kiln_conv2d_params *p)
{
    int post_done = 0;
    kiln_status st = conv_paths(y, x, w, w_dtype, bias, p, &post_done);
    if (!st && (p->residual || p->act) && !post_done) conv_post(y, p);
    return st;
}

static kiln_status conv_paths(float *y, const float *x, const void *w, kiln_dtype w_dtype,
                              const float *bias, const kiln_conv2d_params *p, int *post_done)
{
    if (!p) return kiln_error(KILN_ERR_ARG, "conv2d: NULL params");
    kiln_conv2d_params q = *p;
    kiln_status st = kiln_conv2d_out_size(&q);
    if (st) return st;
    if (q.oh != p->oh || q.ow != p->ow)
        return kiln_error(KILN_ERR_ARG, "conv2d: output size %lldx%lld does not match the parameters (%lldx%lld)",
                          (long long)p->oh, (long long)p->ow, (long long)q.oh, (long long)q.ow);
    if (w_dtype != KILN_F32 && w_dtype != KILN_F16 && w_dtype != KILN_BF16)
        return kiln_error(KILN_ERR_UNSUPPORTED, "conv2d: weight dtype %s (expected f32, f16 or bf16)",
                          kiln_dtype_name(w_dtype));
    if (!y || !x || !w) return kiln_error(KILN_ERR_ARG, "conv2d: NULL buffer");

    conv_path path = forced_path();
    int64_t cg = p->c / p->groups;
    if ((path == PATH_AUTO && cg == 1) || path == PATH_DIRECT) {
        if (cg == 1) {
            size_t bytes = (size_t)kiln_cpu_threads() * (size_t)(p->r * p->s) * sizeof(float);
            conv_job j = {y, x, w, w_dtype, bias, p, kiln_cpu_scratch_get(bytes)};
            if (!j.wscratch) return kiln_error_oom("cpu", bytes, 0, 0, "conv2d: no memory for %zu bytes of kernel", bytes);
            kiln_parallel_for(p->n * p->k, 1, depthwise_fn, &j);
            kiln_cpu_scratch_put(j.wscratch);
            return KILN_OK;
        }
    }
    if ((path == PATH_AUTO || path == PATH_DIRECT) && conv_smallk(y, x, w, w_dtype, bias, p) == 0) return KILN_OK;
    /* few tiles (8x8, 16x16 images) and many channels: output channels in the lanes */
    if ((path == PATH_AUTO && p->c >= 64 && p->k >= 64) || path == PATH_WINOGRAD_FEW) {
        int r = kiln_cpu_conv2d_winograd_few(y, x, w, w_dtype, bias, p, path == PATH_WINOGRAD_FEW);
        if (r == 0) return KILN_OK; /* out of scratch (-1): the paths below need less */
    }
    if (path == PATH_AUTO || path == PATH_WINOGRAD) {
        /* Its output transform applies the activation alone; with a residual both go to
         * the pass after, which reads the residual in order (measured faster than
         * adding it at the transform's scattered stores, or per strip while the rows
         * are in cache). */
        kiln_conv2d_params q = *p;
        if (p->residual) q.act = 0;
        q.residual = NULL;
        int r = kiln_cpu_conv2d_winograd(y, x, w, w_dtype, bias, &q, path == PATH_WINOGRAD);
        if (r == 0) {
            *post_done = !p->residual;
            return KILN_OK;
        }
    }
    if (path != PATH_IM2COL && conv_implicit_gemm(y, x, w, w_dtype, bias, p) == 0) return KILN_OK;
    return conv_im2col_blas(y, x, w, w_dtype, bias, p);
}

kiln_status kiln_cpu_conv2d_up2(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                                int64_t N, int64_t C, int64_t H, int64_t W, int64_t K)
{
    if (!y || !x || !w) return kiln_error(KILN_ERR_ARG, "conv2d (upsample 2): NULL buffer");
    if (N < 1 || C < 1 || H < 1 || W < 1 || K < 1)
        return kiln_error(KILN_ERR_ARG, "conv2d (upsample 2): bad shape N=%lld C=%lld H=%lld W=%lld K=%lld",
                          (long long)N, (long long)C, (long long)H, (long long)W, (long long)K);
    if (w_dtype != KILN_F32 && w_dtype != KILN_F16 && w_dtype != KILN_BF16)
        return kiln_error(KILN_ERR_UNSUPPORTED, "conv2d: weight dtype %s (expected f32, f16 or bf16)",
                          kiln_dtype_name(w_dtype));
    /* KILN_CONV_PATH names the 3x3 convolution's path: the unfused pair follows it */
    if (forced_path() == PATH_AUTO) {
        int r = kiln_cpu_conv2d_up2_winograd(y, x, w, w_dtype, bias, N, C, H, W, K);
        if (r == 0) return KILN_OK;
    }
    /* the two ops in a row, the upsampled image in scratch */
    size_t nu = (size_t)N * (size_t)C * (size_t)(4 * H * W);
    float *u = kiln_cpu_scratch_get(nu * sizeof(float));
    if (!u) return kiln_error_oom("cpu", nu * sizeof(float), 0, 0, "conv2d (upsample 2): no memory for the upsampled input");
    kiln_cpu_upsample_nearest(u, x, N * C, H, W, 2);
    kiln_conv2d_params p = {N, C, 2 * H, 2 * W, K, 3, 3, 1, 1, 1, 1, 1, 1, 1, 2 * H, 2 * W, 0, 0.0f, NULL, NULL};
    kiln_status st = kiln_cpu_conv2d(y, u, w, w_dtype, bias, &p);
    kiln_cpu_scratch_put(u);
    return st;
}

/* ---- the scratch of one call, bounded from above for a dry run's model ----
 * The paths in kiln_cpu_conv2d's order, each with the conditions under which it takes
 * the shape: a path that runs ends the walk; one that may decline counts and the walk
 * goes on (each gives its scratch back before the next is tried), so the result is the
 * largest block set any path the call can reach holds at once. */
static size_t im2col_bound(const kiln_conv2d_params *q, kiln_dtype w_dt)
{
    int64_t cg = q->c / q->groups, kg = q->k / q->groups, crs = cg * q->r * q->s, ohw = q->oh * q->ow;
    int plain = q->r == 1 && q->s == 1 && q->stride_h == 1 && q->stride_w == 1 && q->pad_h == 0 && q->pad_w == 0;
    int64_t rows = plain ? q->oh : COL_MAX_FLOATS / (crs * q->ow > 0 ? crs * q->ow : 1);
    if (rows < 1) rows = 1;
    if (rows > q->oh) rows = q->oh;
    int64_t kb = w_dt == KILN_F32 ? kg : (kg < WBLOCK_ROWS ? kg : WBLOCK_ROWS);
    return (plain ? 0 : kiln_cpu_scratch_block_bound((size_t)(crs * rows * q->ow) * sizeof(float))) +
           (w_dt == KILN_F32 ? 0 : kiln_cpu_scratch_block_bound((size_t)(kb * crs) * sizeof(float))) +
           kiln_cpu_gemm_scratch_bound(kb, plain ? ohw : rows * q->ow, crs, KILN_F32, 0);
}

size_t kiln_cpu_conv2d_scratch_bound(const kiln_conv2d_params *p, kiln_dtype w_dt)
{
    if (!p || p->groups < 1 || p->c % p->groups || p->k % p->groups) return 0;
    kiln_conv2d_params q = *p;
    if (kiln_conv2d_out_size(&q)) return 0;
    int64_t cg = q.c / q.groups, kg = q.k / q.groups, crs = cg * q.r * q.s;
    conv_path path = forced_path();
    size_t best = 0, n;
    if (((path == PATH_AUTO && cg == 1) || path == PATH_DIRECT) && cg == 1)
        return kiln_cpu_scratch_block_bound((size_t)kiln_cpu_threads() * (size_t)(q.r * q.s) * sizeof(float));
    if ((path == PATH_AUTO || path == PATH_DIRECT) && kiln_cpu_gemm_have_simd() && kg <= SMALLK && q.stride_w == 1)
        return kiln_cpu_scratch_block_bound((size_t)(q.groups * SMALLK * crs) * sizeof(float));
    if ((path == PATH_AUTO && q.c >= 64 && q.k >= 64) || path == PATH_WINOGRAD_FEW) {
        n = kiln_cpu_scratch_block_bound(kiln_cpu_conv2d_winograd_few_scratch(&q, w_dt, path == PATH_WINOGRAD_FEW));
        if (n > best) best = n;
    }
    if (path == PATH_AUTO || path == PATH_WINOGRAD) {
        size_t wb = kiln_cpu_conv2d_winograd_scratch(&q, 0, path == PATH_WINOGRAD);
        if (wb) { /* it runs (unless the host is out of memory) */
            n = kiln_cpu_scratch_block_bound(wb);
            return n > best ? n : best;
        }
    }
    if (path != PATH_IM2COL && kiln_cpu_gemm_have_simd()) { /* the implicit GEMM runs */
        n = kiln_cpu_gemm_scratch_bound(kg, q.oh * q.ow, crs, w_dt, 0);
        return n > best ? n : best;
    }
    n = im2col_bound(&q, w_dt);
    return n > best ? n : best;
}

size_t kiln_cpu_conv2d_weight_cache_plan(const kiln_conv2d_params *p, kiln_dtype w_dt, int *variant)
{
    if (!p || p->groups < 1 || p->c % p->groups || p->k % p->groups) return 0;
    kiln_conv2d_params q = *p;
    if (kiln_conv2d_out_size(&q)) return 0;
    int64_t cg = q.c / q.groups, kg = q.k / q.groups;
    conv_path path = forced_path();
    /* the paths before the few-tiles one, as kiln_cpu_conv2d tries them */
    if ((path == PATH_AUTO && cg == 1) || path == PATH_DIRECT) return 0;
    if (path == PATH_AUTO && kiln_cpu_gemm_have_simd() && kg <= SMALLK && q.stride_w == 1) return 0;
    if ((path == PATH_AUTO && q.c >= 64 && q.k >= 64) || path == PATH_WINOGRAD_FEW)
        return kiln_cpu_conv2d_winograd_few_cache(&q, w_dt, path == PATH_WINOGRAD_FEW, variant);
    return 0;
}

/* The fused path's buffer where it takes the shape, else the upsampled image in scratch
 * and the 3x3 convolution of it (both live together). */
size_t kiln_cpu_conv2d_up2_scratch_bound(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, kiln_dtype w_dt)
{
    if (N < 1 || C < 1 || H < 1 || W < 1 || K < 1) return 0;
    kiln_conv2d_params p = {N, C, H, W, K, 3, 3, 1, 1, 1, 1, 1, 1, 1, H, W, 0, 0.0f, NULL, NULL};
    if (forced_path() == PATH_AUTO) {
        size_t fused = kiln_cpu_conv2d_winograd_scratch(&p, 1, 0);
        if (fused) return kiln_cpu_scratch_block_bound(fused);
    }
    kiln_conv2d_params q = {N, C, 2 * H, 2 * W, K, 3, 3, 1, 1, 1, 1, 1, 1, 1, 2 * H, 2 * W, 0, 0.0f, NULL, NULL};
    return kiln_cpu_scratch_block_bound((size_t)N * (size_t)C * (size_t)(4 * H * W) * sizeof(float)) +
           kiln_cpu_conv2d_scratch_bound(&q, w_dt);
}
