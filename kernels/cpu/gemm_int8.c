/* gemm_int8.c - the int8 linear layer (kiln.precision "int8", W8A8) on AVX512-VNNI:
 * y = x w^T + b with the weights quantized per output channel and the activations per
 * row, each in groups of G depths along K with one scale per group (G = GROUP below, or
 * all of K when that is shorter). vpdpbusd multiplies 4 byte pairs a lane, twice the
 * products of vdpbf16ps, and is all the inner loop does: a group's integer sum is
 * scaled into f32 once per output and group. (Scales every 32 depths, the q8_0 block,
 * cost a convert, a multiply and an FMA per 8 vpdpbusd and capped the gain over bf16.)
 *
 * The quantization (both operands, groups of G along K, the last one what is left; the
 * test generator tests/golden/gen_int8.py reimplements it): amax = max |v| over the
 * group, d = amax / 127 (in f32; 0 for an all-zero group), q = nearest-even(v * (127 /
 * amax)) in [-127, 127], so v = d q + e with |e| <= d / 2 (plus the f32 roundings of
 * 127 / amax and of the product, a few 2^-24 |v|). Weights are quantized from their f32
 * values whatever their dtype: a q8_0 file's from its dequantized values (f16 d times q,
 * exact in f32), so against the file's own values its weights take the same bound as
 * any; against the weights the file was made from, the file's own rounding (half its
 * block's step, <= W_g / 254) comes on top, at most doubling the weight term below.
 * The product of row i and column n: y = sum_g (d_a[i,g] d_w[n,g]) S_g + bias[n], S_g =
 * the group's sum of q_a q_w, exact in int32; each S_g converted to f32 and the groups
 * summed in f32 (FMA, in order of g).
 *
 * Error against the f32 product of the same f32 operands: with A_g, W_g the groups'
 * largest magnitudes and L_g their lengths, |y - y_f32| <= sum_g (W_g/254 sum_k |x_k| +
 * A_g/254 sum_k |w_k| + L_g A_g W_g / 254^2) + the f32 roundings (each S_g's conversion,
 * exact below 2^24, its product and the sum: a few 2^-24 of sum_g |d_a d_w S_g|). Each
 * term follows its group's largest magnitude, so one outlier activation (a DiT's massive
 * channels) coarsens the steps of the G depths around it: the longer the group, the more
 * depths share it. The average error is far below the bound: the roundings are
 * independent, so they grow with sqrt(K).
 *
 * Layout: vpdpbusd takes one unsigned operand, so the activations are stored as q + 128
 * (u8) and each group's sum starts from -128 sum(q_w), precomputed with the weights
 * (exact). The weights are packed per panel of 32 columns: for each group, its depths in
 * steps of 4 (4 depths x 32 columns: two vectors of 16 columns x 4 bytes), then the
 * group's 32 scales d_w (f32) and 32 starting sums (int32): 1 + 8 / G bytes a weight.
 * K is padded to a multiple of 4 with zero weights (the activations' padding then adds
 * nothing). That packed form is what a model keeps with a weight between calls
 * (kiln_cpu_int8_pack; backend_cpu.c caches it beside the weight's storage), so only the
 * activations are quantized per call, read as they are (f32, bf16 or f16). */
#define _GNU_SOURCE
#include "cpu_internal.h"
#include "threadpool.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 32                            /* columns per packed panel */
#define SCALE_BYTES (PANEL * 4 + PANEL * 4) /* a group's d_w and starting sums in a panel */
#define PANELS_PER_TASK 4                   /* panels a task sweeps for each tile of rows */
#define ROWS_PER_TASK 64

static atomic_int vnni_off; /* tests: the kernel reported absent */

void kiln_cpu_int8_set_disabled(int off) { atomic_store(&vnni_off, off != 0); }

/* Depths per scale: the group length. 256 keeps the scaling off the inner loop (one
 * convert, multiply and FMA per 64 vpdpbusd of an accumulator) while an outlier
 * coarsens only the 256 depths around it; all of K was little faster and less accurate
 * (README: int8). A group's int32 sum holds |start| + |running sum| <= (128 + 255) 127
 * G, below 2^31 up to G = 44000. */
#define GROUP 256

int64_t kiln_cpu_int8_group(int64_t K)
{
    int64_t Kp = (K + 3) / 4 * 4;
    return GROUP < Kp ? GROUP : Kp;
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 9)

/* The shapes of a product's quantized operands */
typedef struct {
    int64_t K, Kp, G, ng, npanel;
    size_t panel_bytes;
} int8_shape;

static int8_shape shape_of(int64_t N, int64_t K)
{
    int8_shape s = {.K = K, .Kp = (K + 3) / 4 * 4, .G = kiln_cpu_int8_group(K), .npanel = (N + PANEL - 1) / PANEL};
    s.ng = (s.Kp + s.G - 1) / s.G;
    s.panel_bytes = (size_t)s.Kp * PANEL + (size_t)s.ng * SCALE_BYTES;
    return s;
}

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
    int64_t M, N;
    int8_shape s;
    const void *x;
    const void *w;
    kiln_dtype w_dt;
    const float *bias;
    void *y;         /* [M][N] */
    kiln_dtype x_dt; /* f32, bf16 or f16 */
    kiln_dtype y_dt; /* the same choice */
    uint8_t *aq; /* [M][Kp] q + 128 */
    float *ad;   /* [M][ng] */
    uint8_t *bp; /* [npanel][panel_bytes] */
} int8_ctx;

/* 16 values v[j, j + 16) of dtype dt (f32, bf16, f16) as f32, lanes off the mask 0 */
VNNI static inline __m512 load16(const void *v, kiln_dtype dt, int64_t j, __mmask16 k)
{
    if (dt == KILN_F32) return _mm512_maskz_loadu_ps(k, (const float *)v + j);
    __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)v + j);
    if (dt == KILN_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __mmask16 lanes(int64_t len, int64_t j)
{
    return len - j >= 16 ? (__mmask16)0xffff : len > j ? (__mmask16)((1u << (len - j)) - 1) : 0;
}

/* max |v| over v[0, len) */
VNNI static inline float max_abs(const void *v, kiln_dtype dt, int64_t len)
{
    __m512 m = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(v, dt, j, lanes(len, j))));
    return _mm512_reduce_max_ps(m);
}

/* 16 values (lanes off the mask read as 0) to q in [-127, 127], nearest even (the
 * default rounding mode) */
VNNI static inline __m512i quant16(const void *v, kiln_dtype dt, int64_t j, __mmask16 k, __m512 inv)
{
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(v, dt, j, k), inv));
    return _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
}

VNNI static void quant_rows(void *vctx, int64_t begin, int64_t end)
{
    const int8_ctx *c = vctx;
    const int8_shape *s = &c->s;
    const __m512i off = _mm512_set1_epi32(128);
    for (int64_t i = begin; i < end; i++)
        for (int64_t g = 0; g < s->ng; g++) {
            const int64_t k0 = g * s->G, len = s->K - k0 < s->G ? s->K - k0 : s->G;
            const int64_t lenp = s->Kp - k0 < s->G ? s->Kp - k0 : s->G; /* padded to 4: the padding's q is 0 */
            const void *v = (const char *)c->x + (size_t)(i * s->K + k0) * kiln_dtype_size(c->x_dt);
            const float amax = max_abs(v, c->x_dt, len);
            c->ad[i * s->ng + g] = amax / 127.0f;
            const __m512 vi = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            uint8_t *dst = c->aq + i * s->Kp + k0;
            for (int64_t j = 0; j < lenp; j += 16)
                _mm512_mask_cvtepi32_storeu_epi8(dst + j, lanes(lenp, j),
                                                 _mm512_add_epi32(quant16(v, c->x_dt, j, lanes(len, j), vi), off));
        }
}

/* Weight row n's values [k, k + cnt) as f32 (k and cnt multiples of 32 for q8_0) */
static inline void weight_values(const int8_ctx *c, int64_t n, int64_t k, int64_t cnt, float *dst)
{
    size_t at = (size_t)(n * c->s.K + k);
    kiln_to_f32(dst, (const uint8_t *)c->w + kiln_dtype_nbytes(c->w_dt, at), c->w_dt, (size_t)cnt);
}


/* Panel p: for each group, column j's dwords (4 depths each) go to lane j % 16 of
 * vector j / 16 of each depth step; then the group's 32 d_w (f32) and 32 starting sums
 * -128 sum(q_w) (int32). Columns past N: zero weights, scales and sums. */
VNNI static void pack_panels(void *vctx, int64_t begin, int64_t end)
{
    const int8_ctx *c = vctx;
    const int8_shape *s = &c->s;
    float v[GROUP];
    for (int64_t p = begin; p < end; p++) {
        uint8_t *pp = c->bp + (size_t)p * s->panel_bytes;
        int64_t nj = c->N - p * PANEL < PANEL ? c->N - p * PANEL : PANEL;
        if (nj < PANEL) memset(pp, 0, s->panel_bytes);
        for (int64_t j = 0; j < nj; j++) {
            const int64_t n = p * PANEL + j;
            for (int64_t g = 0; g < s->ng; g++) {
                const int64_t k0 = g * s->G, len = s->K - k0 < s->G ? s->K - k0 : s->G;
                const int64_t lenp = s->Kp - k0 < s->G ? s->Kp - k0 : s->G;
                uint8_t *gb = pp + (size_t)g * ((size_t)s->G * PANEL + SCALE_BYTES);
                weight_values(c, n, k0, len, v);
                const float amax = max_abs(v, KILN_F32, len);
                const __m512 vi = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
                __m512i sum = _mm512_setzero_si512();
                for (int64_t u = 0; u < lenp; u += 16) {
                    __m512i q = quant16(v, KILN_F32, u, lanes(len, u), vi);
                    sum = _mm512_add_epi32(sum, q);
                    int8_t qb[16];
                    _mm_storeu_si128((__m128i *)(void *)qb, _mm512_cvtepi32_epi8(q));
                    for (int64_t e = 0; e < 16 && u + e < lenp; e += 4) /* depth step (u + e) / 4, lane j */
                        memcpy(gb + (size_t)((u + e) / 4) * 128 + (size_t)j * 4, qb + e, 4);
                }
                float *dw = (float *)(void *)(gb + (size_t)lenp * PANEL);
                int32_t *st = (int32_t *)(void *)(gb + (size_t)lenp * PANEL + PANEL * 4);
                dw[j] = amax / 127.0f;
                st[j] = -128 * _mm512_reduce_add_epi32(sum);
            }
        }
    }
}

/* acc += the 4 byte products of x (u8) and w (s8) per lane, in place: GCC's register
 * allocator copies the accumulators around vpdpbusd's intrinsic twice a step */
#define DPBUSD(acc, x, w) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))

/* f32 -> bf16 as kiln_convert rounds (nearest even, nan made quiet), 16 lanes */
VNNI static inline __m256i to_bf16(__m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

#define TILE_ROWS 8

/* Rows [i0, i0 + m) (m <= 8) times panel p, all of K, with the bias, stored from yt (row
 * i0's column p * PANEL) at ldy values a row, in f32 or (bf16 set) bf16. Rows past m
 * repeat row i0 (their sums are dropped). 16 int32 accumulators (8 rows x 32 columns)
 * stay in registers over a group; the f32 sums of the groups wait in memory. */
VNNI static void tile8(const int8_ctx *c, int64_t i0, int m, int64_t p, void *yt, int64_t ldy, int bf16)
{
    const int8_shape *s = &c->s;
    const uint8_t *ar[TILE_ROWS];
    const float *dr[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) {
        int64_t i = i0 + (r < m ? r : 0);
        ar[r] = c->aq + i * s->Kp;
        dr[r] = c->ad + i * s->ng;
    }
    __m512 f[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    const uint8_t *blk = c->bp + (size_t)p * s->panel_bytes;
    for (int64_t g = 0; g < s->ng; g++) {
        const int64_t k0 = g * s->G, steps = (s->Kp - k0 < s->G ? s->Kp - k0 : s->G) / 4;
        const uint8_t *sc = blk + steps * 128;
        const __m512i s0 = _mm512_load_si512(sc + PANEL * 4), s1 = _mm512_load_si512(sc + PANEL * 4 + 64);
        __m512i a00 = s0, a01 = s1, a10 = s0, a11 = s1, a20 = s0, a21 = s1, a30 = s0, a31 = s1;
        __m512i a40 = s0, a41 = s1, a50 = s0, a51 = s1, a60 = s0, a61 = s1, a70 = s0, a71 = s1;
        const uint8_t *x0p = ar[0] + k0, *x1p = ar[1] + k0, *x2p = ar[2] + k0, *x3p = ar[3] + k0;
        const uint8_t *x4p = ar[4] + k0, *x5p = ar[5] + k0, *x6p = ar[6] + k0, *x7p = ar[7] + k0;
        for (int64_t t = 0; t < steps; t++) {
            const __m512i w0 = _mm512_load_si512(blk + t * 128), w1 = _mm512_load_si512(blk + t * 128 + 64);
            int32_t v;
            __m512i x;
#define ROW(r)                                        \
    memcpy(&v, x##r##p + 4 * t, 4);                   \
    x = _mm512_set1_epi32(v);                         \
    DPBUSD(a##r##0, x, w0); DPBUSD(a##r##1, x, w1);
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)
#undef ROW
        }
        const __m512 d0 = _mm512_load_ps(sc), d1 = _mm512_load_ps(sc + 64);
        __m512 e;
#define SCALE(r)                                                                        \
    e = _mm512_set1_ps(dr[r][g]);                                                       \
    f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##r##0), _mm512_mul_ps(e, d0), f[r][0]); \
    f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##r##1), _mm512_mul_ps(e, d1), f[r][1]);
        SCALE(0) SCALE(1) SCALE(2) SCALE(3) SCALE(4) SCALE(5) SCALE(6) SCALE(7)
#undef SCALE
        blk = sc + SCALE_BYTES;
    }
    const int64_t n0 = p * PANEL;
    int64_t nv = c->N - n0 < PANEL ? c->N - n0 : PANEL;
    __mmask16 k0m = nv >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nv) - 1);
    __mmask16 k1m = nv >= 32 ? (__mmask16)0xffff : nv <= 16 ? 0 : (__mmask16)((1u << (nv - 16)) - 1);
    __m512 b0 = c->bias ? _mm512_maskz_loadu_ps(k0m, c->bias + n0) : _mm512_setzero_ps();
    __m512 b1 = c->bias && k1m ? _mm512_maskz_loadu_ps(k1m, c->bias + n0 + 16) : _mm512_setzero_ps();
    for (int r = 0; r < m; r++) {
        if (bf16) {
            uint16_t *yr = (uint16_t *)yt + r * ldy;
            _mm256_mask_storeu_epi16(yr, k0m, to_bf16(_mm512_add_ps(f[r][0], b0)));
            if (k1m) _mm256_mask_storeu_epi16(yr + 16, k1m, to_bf16(_mm512_add_ps(f[r][1], b1)));
            continue;
        }
        float *yr = (float *)yt + r * ldy;
        _mm512_mask_storeu_ps(yr, k0m, _mm512_add_ps(f[r][0], b0));
        if (k1m) _mm512_mask_storeu_ps(yr + 16, k1m, _mm512_add_ps(f[r][1], b1));
    }
}

/* Task t: rows [64 r, +64) x panels [4 q, +4); for each 8 rows the 4 panels in turn, so
 * the rows' bytes stay in L1 while the panels (4 x 96 KB for K = 3072) stay in L2. A
 * bf16 output is rounded in the tile, an f16 one converted from the task's f32 results
 * while they are in cache. */
static void tasks(void *vctx, int64_t begin, int64_t end)
{
    const int8_ctx *c = vctx;
    const int64_t nq = (c->s.npanel + PANELS_PER_TASK - 1) / PANELS_PER_TASK, N = c->N;
    float tb[ROWS_PER_TASK * PANELS_PER_TASK * PANEL];
    for (int64_t t = begin; t < end; t++) {
        int64_t r = t / nq, q = t % nq;
        int64_t i0 = r * ROWS_PER_TASK, i1 = (r + 1) * ROWS_PER_TASK < c->M ? (r + 1) * ROWS_PER_TASK : c->M;
        int64_t p0 = q * PANELS_PER_TASK, p1 = (q + 1) * PANELS_PER_TASK < c->s.npanel ? (q + 1) * PANELS_PER_TASK : c->s.npanel;
        int64_t n0 = p0 * PANEL, nn = (p1 * PANEL < N ? p1 * PANEL : N) - n0;
        const int direct = c->y_dt != KILN_F16, bf16 = c->y_dt == KILN_BF16;
        for (int64_t i = i0; i < i1; i += TILE_ROWS)
            for (int64_t p = p0; p < p1; p++) {
                int m = i1 - i < TILE_ROWS ? (int)(i1 - i) : TILE_ROWS;
                if (direct)
                    tile8(c, i, m, p, (char *)c->y + (size_t)(i * N + p * PANEL) * (bf16 ? 2 : 4), N, bf16);
                else
                    tile8(c, i, m, p, tb + (i - i0) * (PANELS_PER_TASK * PANEL) + (p - p0) * PANEL,
                          PANELS_PER_TASK * PANEL, 0);
            }
        if (!direct)
            for (int64_t i = i0; i < i1; i++)
                kiln_convert((char *)c->y + (size_t)(i * N + n0) * 2, c->y_dt, tb + (i - i0) * (PANELS_PER_TASK * PANEL),
                             KILN_F32, (size_t)nn);
    }
}

static int int8_applies(int64_t N, int64_t K, kiln_dtype w_dtype)
{
    if (!kiln_cpu_has_vnni() || N <= 0 || K <= 0) return 0;
    if (w_dtype == KILN_Q8_0) return K % 32 == 0;
    return w_dtype == KILN_F32 || w_dtype == KILN_F16 || w_dtype == KILN_BF16 || w_dtype == KILN_F8_E4M3FN ||
           w_dtype == KILN_F8_E5M2;
}

size_t kiln_cpu_int8_packed_bytes(int64_t N, int64_t K, kiln_dtype w_dtype)
{
    if (!int8_applies(N, K, w_dtype)) return 0;
    int8_shape s = shape_of(N, K);
    return (size_t)s.npanel * s.panel_bytes;
}

int kiln_cpu_int8_pack(void *packed, const void *w, kiln_dtype w_dtype, int64_t N, int64_t K)
{
    if (!int8_applies(N, K, w_dtype)) return 1;
    int8_ctx c = {.N = N, .s = shape_of(N, K), .w = w, .w_dt = w_dtype, .bp = packed};
    kiln_parallel_for(c.s.npanel, 1, pack_panels, &c);
    return 0;
}

/* The product over packed weights (bp: pack_panels' layout, 64-byte aligned). */
static int linear_packed(void *y, kiln_dtype y_dt, const void *x, kiln_dtype x_dt, const uint8_t *bp,
                         const float *bias, int64_t M, int64_t N, int64_t K)
{
    int8_ctx c = {.M = M, .N = N, .s = shape_of(N, K), .x = x, .x_dt = x_dt, .bias = bias, .y = y, .y_dt = y_dt};
    size_t a_bytes = ((size_t)M * (size_t)c.s.Kp + 63) / 64 * 64, d_bytes = ((size_t)M * (size_t)c.s.ng * 4 + 63) / 64 * 64;
    uint8_t *buf = kiln_cpu_scratch_get(a_bytes + d_bytes);
    if (!buf) return -1;
    c.aq = buf;
    c.ad = (float *)(void *)(buf + a_bytes);
    c.bp = (uint8_t *)(uintptr_t)bp;
    kiln_parallel_for(M, 16, quant_rows, &c);
    int64_t ntask = ((M + ROWS_PER_TASK - 1) / ROWS_PER_TASK) * ((c.s.npanel + PANELS_PER_TASK - 1) / PANELS_PER_TASK);
    kiln_parallel_for(ntask, 1, tasks, &c);
    kiln_cpu_scratch_put(buf);
    return 0;
}

static int act_dtype(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_BF16 || dt == KILN_F16; }

int kiln_cpu_linear_int8_packed(void *y, kiln_dtype y_dt, const void *x, kiln_dtype x_dt, const void *packed,
                                const float *bias, int64_t M, int64_t N, int64_t K)
{
    if (!kiln_cpu_has_vnni() || M <= 0 || N <= 0 || K <= 0 || ((uintptr_t)packed & 63) || !act_dtype(x_dt) ||
        !act_dtype(y_dt))
        return 1;
    return linear_packed(y, y_dt, x, x_dt, packed, bias, M, N, K);
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
    if (!kiln_cpu_has_vnni() || n <= 0 || c <= 0 || hw <= 0 || k <= 0 || ((uintptr_t)packed & 63)) return 1;
    size_t xb = ((size_t)(hw * c) * 4 + 63) / 64 * 64, yb = (size_t)(hw * k) * 4;
    float *xt = kiln_cpu_scratch_get(xb + yb);
    if (!xt) return -1;
    float *yt = (float *)(void *)((char *)xt + xb);
    for (int64_t i = 0; i < n; i++) {
        transpose(xt, x + i * c * hw, c, hw); /* pixels as rows, channels along them */
        int r = linear_packed(yt, KILN_F32, xt, KILN_F32, packed, bias, hw, k, c);
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
    int r = linear_packed(y, KILN_F32, x, KILN_F32, bp, bias, M, N, K);
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

int kiln_cpu_linear_int8_packed(void *y, kiln_dtype y_dt, const void *x, kiln_dtype x_dt, const void *packed,
                                const float *bias, int64_t M, int64_t N, int64_t K)
{
    (void)y; (void)y_dt; (void)x; (void)x_dt; (void)packed; (void)bias; (void)M; (void)N; (void)K;
    return 1;
}

int kiln_cpu_linear_int8(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias, int64_t M,
                         int64_t N, int64_t K)
{
    (void)y; (void)x; (void)w; (void)w_dtype; (void)bias; (void)M; (void)N; (void)K;
    return 1;
}
#endif
