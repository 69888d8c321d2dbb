/* gemm_int8.c - the int8 linear layer (kiln.precision "int8", W8A8) on AVX512-VNNI:
 * y = x w^T + b with the weights in q8_0 blocks (taken as they are from a q8_0 file,
 * quantized once per call from f32 / f16 / bf16 / fp8 ones) and the activations
 * quantized the same way per row, on the fly; vpdpbusd multiplies 4 byte pairs a lane,
 * twice the products of vdpbf16ps, and every block's integer sum is scaled into f32.
 *
 * The quantization (both operands, blocks of 32 along K; the test generator
 * tests/golden/gen_int8.py reimplements it): amax = max |v| over the block, d = amax /
 * 127 (in f32; 0 for an all-zero block), q = nearest-even(v * (127 / amax)) in
 * [-127, 127], so v = d q + e with |e| <= d / 2. A q8_0 weight keeps its own d (f16) and
 * q. The product of row i and column n: y = sum_b (d_a[i,b] d_w[n,b]) S_b + bias[n],
 * S_b = sum over the block of q_a q_w, exact in int32; the sum over blocks in f32 (FMA,
 * in order of b).
 *
 * Error against the f32 product of the same f32 operands: with A_b, W_b the blocks'
 * largest magnitudes, |y - y_f32| <= sum_b (W_b/254 sum_k |x_k| + A_b/254 sum_k |w_k|
 * + 32 A_b W_b / 254^2) + the f32 summation's own rounding; against the dequantized
 * weights of a q8_0 file the middle and last terms go (those weights are exact). The
 * average is far below: the roundings are independent, so they grow with sqrt(K).
 *
 * Layout: vpdpbusd takes one unsigned operand, so the activations are stored as q + 128
 * (u8) and each block's sum starts from -128 sum(q_w), precomputed with the weights
 * (exact). The weights are packed per panel of 32 columns: for each block, 8 groups of
 * 4 depths x 32 columns (two vectors of 16 columns x 4 bytes), then the 32 scales d_w
 * (f32) and the 32 starting sums (int32). That packed form is what a model keeps with a
 * weight between calls (kiln_cpu_int8_pack; backend_cpu.c caches it beside the weight's
 * storage), so only the activations are quantized per call. */
#define _GNU_SOURCE
#include "cpu_internal.h"
#include "threadpool.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define QBLK 32
#define PANEL 32                                   /* columns per packed panel */
#define BLK_BYTES (8 * 128 + PANEL * 4 + PANEL * 4) /* one block of a panel: q, d_w, start sums */
#define PANELS_PER_TASK 4                          /* panels a task sweeps for each 4 rows */
#define ROWS_PER_TASK 64

static atomic_int vnni_off; /* tests: the kernel reported absent */

void kiln_cpu_int8_set_disabled(int off) { atomic_store(&vnni_off, off != 0); }

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 9)
#define INT8_X86 1
#include <immintrin.h>
#include "cpu_isa.h"
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

int kiln_cpu_has_vnni(void)
{
    static atomic_int cached = -1;
    int c = atomic_load_explicit(&cached, memory_order_relaxed);
    if (c < 0) {
        __builtin_cpu_init();
        c = kiln_cpu_isa() == ISA_AVX512 && __builtin_cpu_supports("avx512vnni") &&
            __builtin_cpu_supports("avx512bw");
        atomic_store_explicit(&cached, c, memory_order_relaxed);
    }
    return c && !atomic_load_explicit(&vnni_off, memory_order_relaxed);
}

typedef struct {
    int64_t M, N, K, nb, npanel;
    const float *x;
    const void *w;
    kiln_dtype w_dt;
    const float *bias;
    float *y;
    uint8_t *aq;  /* [M][K] q + 128 */
    float *ad;    /* [M][nb] */
    uint8_t *bp;  /* [npanel][nb][BLK_BYTES] */
} int8_ctx;

/* One block of 32 values quantized (the header's rule): q (as int32 lanes) and d. */
VNNI static inline float quant_block(const float *v, __m512i *q0, __m512i *q1)
{
    __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    /* nearest even, the default rounding mode */
    *q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, id)), lo), hi);
    *q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, id)), lo), hi);
    return amax / 127.0f;
}

VNNI static void quant_rows(void *vctx, int64_t begin, int64_t end)
{
    const int8_ctx *c = vctx;
    const __m512i off = _mm512_set1_epi32(128);
    for (int64_t i = begin; i < end; i++)
        for (int64_t b = 0; b < c->nb; b++) {
            __m512i q0, q1;
            c->ad[i * c->nb + b] = quant_block(c->x + i * c->K + b * QBLK, &q0, &q1);
            uint8_t *dst = c->aq + i * c->K + b * QBLK;
            _mm_storeu_si128((__m128i *)(void *)dst, _mm512_cvtepi32_epi8(_mm512_add_epi32(q0, off)));
            _mm_storeu_si128((__m128i *)(void *)(dst + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(q1, off)));
        }
}

/* Row n's block b (32 values) as f32. */
VNNI static inline void weight_values(const int8_ctx *c, int64_t n, int64_t b, __m512 *v0, __m512 *v1)
{
    const size_t at = (size_t)(n * c->K + b * QBLK);
    switch (c->w_dt) {
    case KILN_F32:
        *v0 = _mm512_loadu_ps((const float *)c->w + at);
        *v1 = _mm512_loadu_ps((const float *)c->w + at + 16);
        return;
    case KILN_F16:
        *v0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)c->w + at)));
        *v1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)c->w + at + 16)));
        return;
    case KILN_BF16:
        *v0 = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)c->w + at))), 16));
        *v1 = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)c->w + at + 16))), 16));
        return;
    default: { /* fp8 */
        float t[QBLK];
        kiln_to_f32(t, (const uint8_t *)c->w + at, c->w_dt, QBLK);
        *v0 = _mm512_loadu_ps(t);
        *v1 = _mm512_loadu_ps(t + 16);
    }
    }
}

/* Row n's block b as 32 int8 q (8 dwords of 4 depths) and its d and sum of q: q8_0 as
 * stored, other dtypes quantized (the header's rule). */
VNNI static float weight_block(const int8_ctx *c, int64_t n, int64_t b, int32_t *q4, int32_t *sum)
{
    __m512i q0, q1;
    float d;
    if (c->w_dt == KILN_Q8_0) {
        const uint8_t *blk = (const uint8_t *)c->w + (n * c->nb + b) * 34;
        uint16_t h;
        memcpy(&h, blk, 2);
        d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
        __m256i raw = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 2));
        _mm256_storeu_si256((__m256i *)(void *)q4, raw);
        q0 = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw));
        q1 = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1));
    } else {
        __m512 v0, v1;
        weight_values(c, n, b, &v0, &v1);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
        q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), lo), hi);
        q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id)), lo), hi);
        _mm_storeu_si128((__m128i *)(void *)q4, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(void *)(q4 + 4), _mm512_cvtepi32_epi8(q1));
        d = amax / 127.0f;
    }
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    return d;
}

/* Panel p: for each block, column j's 8 dwords (4 depths each) go to lane j % 16 of
 * vector j / 16 of groups 0..7. */
VNNI static void pack_panels(void *vctx, int64_t begin, int64_t end)
{
    const int8_ctx *c = vctx;
    for (int64_t p = begin; p < end; p++) {
        uint8_t *pp = c->bp + (size_t)p * (size_t)c->nb * BLK_BYTES;
        int64_t nj = c->N - p * PANEL < PANEL ? c->N - p * PANEL : PANEL;
        if (nj < PANEL) memset(pp, 0, (size_t)c->nb * BLK_BYTES); /* columns past N: zero weights, scales, sums */
        for (int64_t b = 0; b < c->nb; b++) {
            uint8_t *blk = pp + (size_t)b * BLK_BYTES;
            int32_t *qd = (int32_t *)(void *)blk;
            float *dw = (float *)(void *)(blk + 8 * 128);
            int32_t *st = (int32_t *)(void *)(blk + 8 * 128 + PANEL * 4);
            for (int64_t j = 0; j < nj; j++) {
                int32_t q4[8], sum;
                dw[j] = weight_block(c, p * PANEL + j, b, q4, &sum);
                st[j] = -128 * sum;
                for (int g = 0; g < 8; g++) qd[g * 32 + j] = q4[g]; /* group g, vector j/16, lane j%16 */
            }
        }
    }
}

/* Rows [i0, i0 + m) (m <= 4) times panel p, all of K, stored to y with the bias. Rows
 * past m repeat row i0 (their sums are dropped). */
VNNI static void tile4(const int8_ctx *c, int64_t i0, int m, int64_t p)
{
    const int64_t K = c->K, nb = c->nb;
    const uint8_t *ar[4];
    const float *dr[4];
    for (int r = 0; r < 4; r++) {
        int64_t i = i0 + (r < m ? r : 0);
        ar[r] = c->aq + i * K;
        dr[r] = c->ad + i * nb;
    }
    __m512 f00 = _mm512_setzero_ps(), f01 = f00, f10 = f00, f11 = f00, f20 = f00, f21 = f00, f30 = f00, f31 = f00;
    const uint8_t *blk = c->bp + (size_t)p * (size_t)nb * BLK_BYTES;
    for (int64_t b = 0; b < nb; b++, blk += BLK_BYTES) {
        const __m512i s0 = _mm512_load_si512(blk + 8 * 128 + PANEL * 4), s1 = _mm512_load_si512(blk + 8 * 128 + PANEL * 4 + 64);
        __m512i a00 = s0, a01 = s1, a10 = s0, a11 = s1, a20 = s0, a21 = s1, a30 = s0, a31 = s1;
        const int64_t k0 = b * QBLK;
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const __m512i w0 = _mm512_load_si512(blk + g * 128), w1 = _mm512_load_si512(blk + g * 128 + 64);
            int32_t v0, v1, v2, v3;
            memcpy(&v0, ar[0] + k0 + 4 * g, 4);
            memcpy(&v1, ar[1] + k0 + 4 * g, 4);
            memcpy(&v2, ar[2] + k0 + 4 * g, 4);
            memcpy(&v3, ar[3] + k0 + 4 * g, 4);
            __m512i x0 = _mm512_set1_epi32(v0), x1 = _mm512_set1_epi32(v1);
            __m512i x2 = _mm512_set1_epi32(v2), x3 = _mm512_set1_epi32(v3);
            a00 = _mm512_dpbusd_epi32(a00, x0, w0); a01 = _mm512_dpbusd_epi32(a01, x0, w1);
            a10 = _mm512_dpbusd_epi32(a10, x1, w0); a11 = _mm512_dpbusd_epi32(a11, x1, w1);
            a20 = _mm512_dpbusd_epi32(a20, x2, w0); a21 = _mm512_dpbusd_epi32(a21, x2, w1);
            a30 = _mm512_dpbusd_epi32(a30, x3, w0); a31 = _mm512_dpbusd_epi32(a31, x3, w1);
        }
        const __m512 d0 = _mm512_load_ps(blk + 8 * 128), d1 = _mm512_load_ps(blk + 8 * 128 + 64);
        __m512 e;
        e = _mm512_set1_ps(dr[0][b]);
        f00 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a00), _mm512_mul_ps(e, d0), f00);
        f01 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a01), _mm512_mul_ps(e, d1), f01);
        e = _mm512_set1_ps(dr[1][b]);
        f10 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a10), _mm512_mul_ps(e, d0), f10);
        f11 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a11), _mm512_mul_ps(e, d1), f11);
        e = _mm512_set1_ps(dr[2][b]);
        f20 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a20), _mm512_mul_ps(e, d0), f20);
        f21 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a21), _mm512_mul_ps(e, d1), f21);
        e = _mm512_set1_ps(dr[3][b]);
        f30 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a30), _mm512_mul_ps(e, d0), f30);
        f31 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a31), _mm512_mul_ps(e, d1), f31);
    }
    const int64_t n0 = p * PANEL;
    int64_t nv = c->N - n0 < PANEL ? c->N - n0 : PANEL;
    __mmask16 k0m = nv >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nv) - 1);
    __mmask16 k1m = nv >= 32 ? (__mmask16)0xffff : nv <= 16 ? 0 : (__mmask16)((1u << (nv - 16)) - 1);
    __m512 b0 = c->bias ? _mm512_maskz_loadu_ps(k0m, c->bias + n0) : _mm512_setzero_ps();
    __m512 b1 = c->bias && k1m ? _mm512_maskz_loadu_ps(k1m, c->bias + n0 + 16) : _mm512_setzero_ps();
    __m512 out[4][2] = {{f00, f01}, {f10, f11}, {f20, f21}, {f30, f31}};
    for (int r = 0; r < m; r++) {
        float *yr = c->y + (i0 + r) * c->N + n0;
        _mm512_mask_storeu_ps(yr, k0m, _mm512_add_ps(out[r][0], b0));
        if (k1m) _mm512_mask_storeu_ps(yr + 16, k1m, _mm512_add_ps(out[r][1], b1));
    }
}

/* Task t: rows [64 r, +64) x panels [4 q, +4); for each 4 rows the 4 panels in turn, so
 * the rows' bytes stay in L1 while the panels (4 x 120 KB for K = 3072) stay in L2. */
static void tasks(void *vctx, int64_t begin, int64_t end)
{
    const int8_ctx *c = vctx;
    const int64_t nq = (c->npanel + PANELS_PER_TASK - 1) / PANELS_PER_TASK;
    for (int64_t t = begin; t < end; t++) {
        int64_t r = t / nq, q = t % nq;
        int64_t i1 = (r + 1) * ROWS_PER_TASK < c->M ? (r + 1) * ROWS_PER_TASK : c->M;
        int64_t p1 = (q + 1) * PANELS_PER_TASK < c->npanel ? (q + 1) * PANELS_PER_TASK : c->npanel;
        for (int64_t i = r * ROWS_PER_TASK; i < i1; i += 4)
            for (int64_t p = q * PANELS_PER_TASK; p < p1; p++) tile4(c, i, i1 - i < 4 ? (int)(i1 - i) : 4, p);
    }
}

static int int8_applies(int64_t N, int64_t K, kiln_dtype w_dtype)
{
    if (!kiln_cpu_has_vnni() || N <= 0 || K <= 0 || K % QBLK) return 0;
    return w_dtype == KILN_Q8_0 || w_dtype == KILN_F32 || w_dtype == KILN_F16 || w_dtype == KILN_BF16 ||
           w_dtype == KILN_F8_E4M3FN || w_dtype == KILN_F8_E5M2;
}

size_t kiln_cpu_int8_packed_bytes(int64_t N, int64_t K, kiln_dtype w_dtype)
{
    if (!int8_applies(N, K, w_dtype)) return 0;
    return (size_t)((N + PANEL - 1) / PANEL) * (size_t)(K / QBLK) * BLK_BYTES;
}

int kiln_cpu_int8_pack(void *packed, const void *w, kiln_dtype w_dtype, int64_t N, int64_t K)
{
    if (!int8_applies(N, K, w_dtype)) return 1;
    int8_ctx c = {.N = N, .K = K, .nb = K / QBLK, .npanel = (N + PANEL - 1) / PANEL, .w = w, .w_dt = w_dtype,
                  .bp = packed};
    kiln_parallel_for(c.npanel, 1, pack_panels, &c);
    return 0;
}

/* The product over packed weights (bp: pack_panels' layout, 64-byte aligned). */
static int linear_packed(float *y, const float *x, const uint8_t *bp, const float *bias, int64_t M, int64_t N,
                         int64_t K)
{
    int8_ctx c = {.M = M, .N = N, .K = K, .nb = K / QBLK, .npanel = (N + PANEL - 1) / PANEL, .x = x,
                  .bias = bias, .y = y};
    size_t a_bytes = ((size_t)M * (size_t)K + 63) / 64 * 64, d_bytes = ((size_t)M * (size_t)c.nb * 4 + 63) / 64 * 64;
    uint8_t *buf = kiln_cpu_scratch_get(a_bytes + d_bytes);
    if (!buf) return -1;
    c.aq = buf;
    c.ad = (float *)(void *)(buf + a_bytes);
    c.bp = (uint8_t *)(uintptr_t)bp;
    kiln_parallel_for(M, 16, quant_rows, &c);
    int64_t ntask = ((M + ROWS_PER_TASK - 1) / ROWS_PER_TASK) * ((c.npanel + PANELS_PER_TASK - 1) / PANELS_PER_TASK);
    kiln_parallel_for(ntask, 1, tasks, &c);
    kiln_cpu_scratch_put(buf);
    return 0;
}

int kiln_cpu_linear_int8_packed(float *y, const float *x, const void *packed, const float *bias, int64_t M,
                                int64_t N, int64_t K)
{
    if (!kiln_cpu_has_vnni() || M <= 0 || N <= 0 || K <= 0 || K % QBLK || ((uintptr_t)packed & 63)) return 1;
    return linear_packed(y, x, packed, bias, M, N, K);
}

/* dst[cols][rows] = src[rows][cols], in 32 x 32 tiles (both sides read and written a
 * cache line at a time) on the pool */
typedef struct { float *dst; const float *src; int64_t rows, cols; } tr_ctx;

static void transpose_tiles(void *vctx, int64_t begin, int64_t end)
{
    const tr_ctx *t = vctx;
    int64_t tc = (t->cols + 31) / 32;
    for (int64_t b = begin; b < end; b++) {
        int64_t r0 = b / tc * 32, c0 = b % tc * 32;
        int64_t r1 = r0 + 32 < t->rows ? r0 + 32 : t->rows, c1 = c0 + 32 < t->cols ? c0 + 32 : t->cols;
        for (int64_t c = c0; c < c1; c++)
            for (int64_t r = r0; r < r1; r++) t->dst[c * t->rows + r] = t->src[r * t->cols + c];
    }
}

static void transpose(float *dst, const float *src, int64_t rows, int64_t cols)
{
    tr_ctx t = {dst, src, rows, cols};
    kiln_parallel_for(((rows + 31) / 32) * ((cols + 31) / 32), 4, transpose_tiles, &t);
}

int kiln_cpu_conv1x1_int8_packed(float *y, const float *x, const void *packed, const float *bias,
                                 const float *residual, int act, float act_slope, int64_t n, int64_t c, int64_t hw,
                                 int64_t k)
{
    if (!kiln_cpu_has_vnni() || n <= 0 || c <= 0 || hw <= 0 || k <= 0 || c % QBLK || ((uintptr_t)packed & 63)) return 1;
    size_t xb = ((size_t)(hw * c) * 4 + 63) / 64 * 64, yb = (size_t)(hw * k) * 4;
    float *xt = kiln_cpu_scratch_get(xb + yb);
    if (!xt) return -1;
    float *yt = (float *)(void *)((char *)xt + xb);
    for (int64_t i = 0; i < n; i++) {
        transpose(xt, x + i * c * hw, c, hw); /* pixels as rows, channels along them */
        int r = linear_packed(yt, xt, packed, bias, hw, k, c);
        if (r) { kiln_cpu_scratch_put(xt); return r; }
        float *yi = y + i * k * hw;
        transpose(yi, yt, hw, k);
        if (residual || act) {
            const float *ri = residual ? residual + i * k * hw : NULL;
            for (int64_t j = 0; j < k * hw; j++) {
                float v = yi[j] + (ri ? ri[j] : 0.0f);
                if (act && v < 0.0f) v = v * act_slope + 0.0f; /* as conv2d.c's post1 */
                yi[j] = v;
            }
        }
    }
    kiln_cpu_scratch_put(xt);
    return 0;
}

int kiln_cpu_linear_int8(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias, int64_t M,
                         int64_t N, int64_t K)
{
    if (M <= 0 || !int8_applies(N, K, w_dtype)) return 1;
    size_t b_bytes = kiln_cpu_int8_packed_bytes(N, K, w_dtype);
    uint8_t *bp = kiln_cpu_scratch_get(b_bytes);
    if (!bp) return -1;
    kiln_cpu_int8_pack(bp, w, w_dtype, N, K);
    int r = linear_packed(y, x, bp, bias, M, N, K);
    kiln_cpu_scratch_put(bp);
    return r;
}

#else
int kiln_cpu_has_vnni(void) { return 0; }

size_t kiln_cpu_int8_packed_bytes(int64_t N, int64_t K, kiln_dtype w_dtype)
{
    (void)N; (void)K; (void)w_dtype;
    return 0;
}

int kiln_cpu_int8_pack(void *packed, const void *w, kiln_dtype w_dtype, int64_t N, int64_t K)
{
    (void)packed; (void)w; (void)w_dtype; (void)N; (void)K;
    return 1;
}

int kiln_cpu_conv1x1_int8_packed(float *y, const float *x, const void *packed, const float *bias,
                                 const float *residual, int act, float act_slope, int64_t n, int64_t c, int64_t hw,
                                 int64_t k)
{
    (void)y; (void)x; (void)packed; (void)bias; (void)residual; (void)act; (void)act_slope; (void)n; (void)c;
    (void)hw; (void)k;
    return 1;
}

int kiln_cpu_linear_int8_packed(float *y, const float *x, const void *packed, const float *bias, int64_t M,
                                int64_t N, int64_t K)
{
    (void)y; (void)x; (void)packed; (void)bias; (void)M; (void)N; (void)K;
    return 1;
}

int kiln_cpu_linear_int8(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias, int64_t M,
                         int64_t N, int64_t K)
{
    (void)y; (void)x; (void)w; (void)w_dtype; (void)bias; (void)M; (void)N; (void)K;
    return 1;
}
#endif
