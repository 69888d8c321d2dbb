/* conv2d_winograd_few.c - Winograd F(4x4, 3x3), and F(2x2, 3x3) for the smallest images,
 * for images of few tiles (AVX-512): the 8x8, 16x16 and 32x32 levels of SD's UNet, where
 * the weights are large (1280-2560 channels) and the images small.
 *
 * The other path (conv2d_winograd.c) puts tiles in the vector lanes and transforms each
 * block's weights into a U that goes through memory: U is 4x the weights in f32, 236 MB
 * for one 1280 -> 1280 layer, written and read back for only 4 or 16 tiles, so those
 * layers were memory-bound, and at 4 tiles 3/4 of every vector was empty. Here output
 * channels are the lanes. With V[xi] (tiles x C) and U[xi] (C x K) for the P points xi
 * (36 for F(4,3), 16 for F(2,3)),
 *     M[xi] (tiles x K) = V[xi] U[xi],    y = A^T M A (per tile, 16 channels at once).
 * A task owns a block of KB output channels: it transforms their weights a chunk of CC
 * input channels at a time straight into the GEMM's B layout (a U chunk of KB x CC x P
 * floats, 3.5 MB for F(4,3), half that in bf16 pairs), runs the P products of that chunk
 * (gemm.c, serially: the tiles are the rows, so 4 tiles use the 4 x 96 kernel fully),
 * and when all chunks are summed, the output transform. The weights are read once, from
 * wherever they are mapped.
 *
 * Input: a channels-last copy of x (16 channels = one vector), then V = B^T d B per
 * tile, stored [P][tiles][Cp] (row-major A for the GEMM). The transforms are those of the
 * other path (winograd_transforms.h), so F(4,3) rounds the same way.
 *
 * Under kiln.precision("bf16") the weight transform writes its U chunk as the GEMM's
 * bf16 pairs, V is rounded into pair slivers once per convolution, and the products run
 * on vdpbf16ps (kiln_cpu_gemm_serial_bf16), every point of F(4,3) included: the UNet's
 * error in bf16 comes from its 64x64 level, which takes the other path (whose
 * wino_f32_point keeps some points in f32); f32 points here bought no accuracy that
 * counts (README: bf16 accuracy). A caller may keep the U chunks of a layer between
 * calls (p->cache, bf16 only): the first call writes them there instead of into its
 * slot, later ones multiply them as they are (kiln_cpu_conv2d_winograd_few_cache: which
 * tiles keep them, and their size). */
#define _GNU_SOURCE
#include "cpu_internal.h"
#include "threadpool.h"
#include "../../runtime/tunables.h"

#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include "simd_transpose.h"
#include "winograd_transforms.h"
#include "simd_bf16.h"
#define AVX512 __attribute__((target("avx512f")))

/* On SD's UNet shapes this path beats the implicit GEMM on small images and loses from
 * 256 tiles, where M and V outgrow the caches (README: speed, path choices). So: up to
 * 16 tiles, or up to 64 when the weights are large (>= 512 Ki per tap); chunks of 256
 * input channels (each chunk's products add into M once more: 128 was slower in f32 and
 * bf16 alike, 512 no faster; README: speed, path choices). */
enum { KB = 96, CC = 256, MAX_TILES = 64, FEW_TILES = 16, LARGE_WEIGHTS = 1 << 19, TINY_TILES = 4 };

typedef struct {
    const kiln_conv2d_params *p;
    int64_t su, sm;                  /* floats from one xi to the next in U and M (see slot_floats) */
    const float *x;
    float *y;
    const void *w;
    kiln_dtype w_dt;
    const float *bias;
    int bf16;                        /* bf16 products (1 native, 2 emulated): U in pairs (kiln_cpu_gemm_serial_bf16) */
    int m, a, P;                     /* F(m x m, 3x3): output tile m (4 or 2), input tile a = m + 2,
                                      * P = a * a points xi */
    int64_t C, Cp, K, TH, TW, T, NT; /* Cp = C rounded up to 16; T tiles an image, NT all */
    int64_t cc;                      /* input channels per chunk (multiple of 16) */
    int64_t kb;                      /* output channels per task: KB (3 B slivers: the 4 x 96 kernel) */
    int64_t nkb;                     /* blocks of kb output channels */
    float *xt;                       /* [N][H][W][Cp] */
    float *V;                        /* [P][NT][Cp] */
    uint32_t *Vp;                    /* bf16: V[xi] as the GEMM's A slivers of 12 tiles, svp lanes apart */
    int64_t svp;
    float *slots;                    /* per thread: slot floats */
    size_t slot;
    uint32_t *uc;                    /* bf16: the caller's cache of every U chunk (cache_lanes), or NULL */
    int uc_ready;                    /* 1: uc holds them; 0: the weight transform writes them there */
    int64_t ucs, nch;                /* lanes from one cached point to the next; chunks of cc channels */
} few_ctx;

/* A cached U chunk: P points of kb/32 slivers of cc/2 pair rows (no unused half, as a
 * slot's chunk has), points a line more than that apart (the slot's reason, below). */
static int64_t cached_point_lanes(int64_t cc) { return (KB / 32) * (cc / 2) * 32 + 16; }

/* What a cache's bytes depend on besides the layer: the tile and the pair rounding */
static int cache_variant(int m, int bf16) { return m | bf16 << 4; }

/* The cache of every U chunk a layer of K output and C input channels takes: [blocks of
 * KB][chunks of cc][P] points, in bf16 pairs. */
static size_t cache_lanes(int P, int64_t K, int64_t C)
{
    int64_t Cp = (C + 15) / 16 * 16, cc = CC < Cp ? CC : Cp;
    return (size_t)((K + KB - 1) / KB) * (size_t)((C + cc - 1) / cc) * (size_t)P * (size_t)cached_point_lanes(cc);
}

/* Per-thread slot: U chunk [P][KB/32][cc][32], M [P][NT][KB], transposed taps
 * [2][cc*9][16], A sliver scratch. The P matrices of U and of M lie one 64-byte line
 * further apart than their size: P streams a multiple of 4 KB apart would share one L1
 * set (the weight transform writes all of them at once; 3x slower without). */
static size_t slot_floats(int P, int64_t su, int64_t sm, int64_t cc)
{
    size_t r = (size_t)P * (size_t)(su + sm) + (size_t)32 * (size_t)cc * 9 + KILN_CPU_GEMM_SERIAL_SCRATCH;
    return (r + 15) / 16 * 16 + 16;
}

/* ---- x [N][C][H][W] -> xt [N][H][W][Cp] (padding channels zero) ---- */
AVX512 static void to_channels_last(void *vctx, int64_t begin, int64_t end)
{
    const few_ctx *c = vctx;
    const int64_t HW = c->p->h * c->p->w, nhb = (HW + 15) / 16;
    for (int64_t task = begin; task < end; task++) {
        int64_t n = task / nhb, hw0 = (task % nhb) * 16, hn = HW - hw0 < 16 ? HW - hw0 : 16;
        __mmask16 hm = (__mmask16)((1u << hn) - 1);
        for (int64_t c0 = 0; c0 < c->Cp; c0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = c0 + i < c->C ? _mm512_maskz_loadu_ps(hm, c->x + (n * c->C + c0 + i) * HW + hw0)
                                     : _mm512_setzero_ps();
            transpose16(r);
            for (int64_t j = 0; j < hn; j++) _mm512_storeu_ps(c->xt + ((n * HW) + hw0 + j) * c->Cp + c0, r[j]);
        }
    }
}

/* ---- V[xi][t][c] = (B^T d B)[xi], one tile per task, 16 channels per vector ---- */
WINO_INLINE void input_tiles(const few_ctx *c, int64_t begin, int64_t end, const int A)
{
    const kiln_conv2d_params *p = c->p;
    const int64_t H = p->h, W = p->w, Cp = c->Cp, m = A - 2;
    for (int64_t t = begin; t < end; t++) {
        int64_t n = t / c->T, ti = t % c->T, y0 = m * (ti / c->TW) - p->pad_h, x0 = m * (ti % c->TW) - p->pad_w;
        const float *img = c->xt + n * H * W * Cp;
        for (int64_t c0 = 0; c0 < Cp; c0 += 16) {
            __m512 tmp[6][6]; /* tmp[i][j] = (B^T d)[i][j] */
            for (int j = 0; j < A; j++) {
                __m512 d[6], o[6];
                int64_t ix = x0 + j;
                for (int i = 0; i < A; i++) {
                    int64_t iy = y0 + i;
                    d[i] = iy >= 0 && iy < H && ix >= 0 && ix < W ? _mm512_loadu_ps(img + (iy * W + ix) * Cp + c0)
                                                                   : _mm512_setzero_ps();
                }
                bt_apply(A, d, o);
                for (int i = 0; i < A; i++) tmp[i][j] = o[i];
            }
            for (int i = 0; i < A; i++) {
                __m512 o[6];
                bt_apply(A, tmp[i], o);
                for (int j = 0; j < A; j++)
                    _mm512_storeu_ps(c->V + ((int64_t)(i * A + j) * c->NT + t) * Cp + c0, o[j]);
            }
        }
    }
}

AVX512 static void input_fn(void *vctx, int64_t begin, int64_t end)
{
    const few_ctx *c = vctx;
    if (c->a == 6) input_tiles(c, begin, end, 6);
    else input_tiles(c, begin, end, 4);
}

/* bf16: V[xi] rounded into pair slivers once, for every block of output channels */
static void pack_v_fn(void *vctx, int64_t begin, int64_t end)
{
    const few_ctx *c = vctx;
    for (int64_t xi = begin; xi < end; xi++)
        kiln_cpu_bf16_pack_rows(c->Vp + xi * c->svp, c->Cp * 6, c->V + xi * c->NT * c->Cp, c->Cp, c->NT, c->Cp);
}

/* n <= 16 weights as f32 (zero past n), converted in registers */
AVX512 static inline __m512 load_taps(const char *p, kiln_dtype dt, int n)
{
    if (dt == KILN_F32) return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
    __m256i h;
    if (n == 16) h = _mm256_loadu_si256((const __m256i *)(const void *)p);
    else {
        uint16_t tmp[16] = {0};
        memcpy(tmp, p, (size_t)n * 2);
        h = _mm256_loadu_si256((const __m256i *)(const void *)tmp);
    }
    if (dt == KILN_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* bf16 */
}

/* U chunk for output channels [k0, k0 + KB) and input channels [c0, c0 + cn):
 * U[xi][k/32][c - c0][k % 32] = (G g G^T)[xi] of weight (k, c); zero for k >= K.
 * sliver_taps: one B sliver's taps in vectors over outputs; weight_points: their G
 * transforms. */
WINO_INLINE void sliver_taps(const few_ctx *c, float *taps, int64_t kb0, int64_t c0, int64_t run)
{
    const int64_t C = c->C, K = c->K;
    const size_t esz = kiln_dtype_size(c->w_dt), rstride = (size_t)C * 9 * esz;
    for (int h = 0; h < 2; h++) {
        int64_t kbase = kb0 + 16 * h, kn = K - kbase < 16 ? K - kbase : 16;
        float *tp = taps + (size_t)h * run * 16;
        if (kn <= 0) {
            memset(tp, 0, (size_t)run * 16 * sizeof(float));
            continue;
        }
        /* tp[e][lane k] for e in [0, run): a vector per (channel, tap) over 16
         * outputs; the rows (taps of channels c0.. of one output) are contiguous in w */
        const char *src = (const char *)c->w + (size_t)(kbase * C + c0) * 9 * esz;
        /* the next group's rows (16 short runs the hardware does not foresee), a line of
         * each row per 64 bytes of this group's, so the prefetches trickle out */
        int64_t kn2 = kn == 16 ? (K - kbase - 16 < 16 ? K - kbase - 16 : 16) : 0;
        for (int64_t b = 0; b < run; b += 16) {
            int64_t cols = run - b < 16 ? run - b : 16;
            if (((size_t)b * esz) % 64 == 0)
                for (int64_t k = 0; k < kn2; k++) _mm_prefetch(src + (16 + k) * rstride + (size_t)b * esz, _MM_HINT_T1);
            __m512 r[16];
            const char *s0 = src + (size_t)b * esz;
            if (kn == 16 && cols == 16 && c->w_dt == KILN_F16) wino_f16_rows(r, s0, rstride, 16);
            else
                for (int k = 0; k < 16; k++)
                    r[k] = k < kn ? load_taps(s0 + k * rstride, c->w_dt, (int)cols) : _mm512_setzero_ps();
            transpose16(r);
            if (cols == 16)
                for (int m = 0; m < 16; m++) _mm512_store_ps(tp + (b + m) * 16, r[m]);
            else
                for (int64_t m = 0; m < cols; m++) _mm512_store_ps(tp + (b + m) * 16, r[m]);
        }
    }
}

WINO_INLINE void weight_points(const few_ctx *c, float *U, const float *taps, int64_t ks, int64_t run, int64_t cn,
                              const int A)
{
    const int64_t su = c->su;
    for (int64_t ci = 0; ci < cn; ci++) {
        float *dst = U + (ks * c->cc + ci) * 32;
        for (int h = 0; h < 2; h++) {
            const float *tp = taps + (size_t)h * run * 16 + ci * 9 * 16;
            __m512 gv[9], t[3][6];
            for (int e = 0; e < 9; e++) gv[e] = _mm512_load_ps(tp + e * 16);
            for (int s3 = 0; s3 < 3; s3++) g_apply(A, gv[s3], gv[3 + s3], gv[6 + s3], t[s3]);
#pragma GCC unroll 8
            for (int i = 0; i < A; i++) {
                __m512 o[6];
                g_apply(A, t[0][i], t[1][i], t[2][i], o);
                float *row = dst + i * A * su + 16 * h;
#pragma GCC unroll 8
                for (int j = 0; j < A; j++) _mm512_storeu_ps(row + j * su, o[j]);
            }
        }
    }
}

/* The column transforms of one channel's taps: t[s][i] = (G g)[i][s]. */
WINO_INLINE void taps_cols(const float *tp, __m512 t[3][6], const int A)
{
    __m512 gv[9];
    for (int e = 0; e < 9; e++) gv[e] = _mm512_load_ps(tp + e * 16);
    for (int s3 = 0; s3 < 3; s3++) g_apply(A, gv[s3], gv[3 + s3], gv[6 + s3], t[s3]);
}

AVX512 static void weight_chunk(const few_ctx *c, float *U, float *taps, int64_t k0, int64_t c0, int64_t cn)
{
    const int64_t run = cn * 9;
    /* one B sliver (32 output channels, two groups of 16) at a time, so that each row
     * of 32 floats of U is written whole, right away */
    for (int64_t ks = 0; ks < c->kb / 32; ks++) {
        sliver_taps(c, taps, k0 + 32 * ks, c0, run);
        if (c->a == 6) weight_points(c, U, taps, ks, run, cn, 6);
        else weight_points(c, U, taps, ks, run, cn, 4);
    }
}

/* ---- the same U chunk as the bf16 GEMM's pairs (kiln_cpu_gemm_serial_bf16): pair row
 * ci/2 of a sliver holds channels ci (low half) and ci+1 (high half, zero past cn).
 * Native (AVX512_BF16): vcvtne2ps2bf16 rounds both channels' points at once, vpermw
 * interleaves them; emulated: bf16_pair, with the same bits. The emulated variant is
 * compiled for the same target but executes no bf16 instruction. ---- */
#define BF16_FEW static __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define BF16_FEW_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))

BF16_FEW_INLINE void weight_points_pairs(uint32_t *U, int64_t sl, int64_t su, const float *taps, int64_t ks,
                                         int64_t run, int64_t cn, const int A, const int native)
{
    const __m512i ilv = bf16_pair_index();
    for (int64_t ci = 0; ci < cn; ci += 2) {
        uint32_t *dst = U + ks * sl + (ci / 2) * 32;
        int odd = ci + 1 < cn;
        for (int h = 0; h < 2; h++) {
            const float *tp = taps + (size_t)h * run * 16 + ci * 9 * 16;
            __m512 te[3][6], to[3][6];
            taps_cols(tp, te, A);
            if (odd) taps_cols(tp + 9 * 16, to, A);
            else
                for (int s3 = 0; s3 < 3; s3++)
                    for (int i = 0; i < A; i++) to[s3][i] = _mm512_setzero_ps();
            /* unrolled, so that the points stay in registers and the stores' offsets
             * are constants (a loop kept them on the stack) */
#pragma GCC unroll 8
            for (int i = 0; i < A; i++) {
                __m512 oe[6], oo[6];
                g_apply(A, te[0][i], te[1][i], te[2][i], oe);
                g_apply(A, to[0][i], to[1][i], to[2][i], oo);
                uint32_t *row = dst + i * A * su + 16 * h;
#pragma GCC unroll 8
                for (int j = 0; j < A; j++) _mm512_storeu_si512(row + j * su, native ? bf16_pair_native(oe[j], oo[j], ilv) : bf16_pair(oe[j], oo[j]));
            }
        }
    }
}

/* U: slivers sl lanes apart, points su lanes apart (a slot's chunk or a cached one) */
BF16_FEW void weight_chunk_pairs(const few_ctx *c, uint32_t *U, int64_t sl, int64_t su, float *taps, int64_t k0,
                                 int64_t c0, int64_t cn)
{
    const int64_t run = cn * 9;
    for (int64_t ks = 0; ks < c->kb / 32; ks++) {
        sliver_taps(c, taps, k0 + 32 * ks, c0, run);
        if (c->bf16 == 1) {
            if (c->a == 6) weight_points_pairs(U, sl, su, taps, ks, run, cn, 6, 1);
            else weight_points_pairs(U, sl, su, taps, ks, run, cn, 4, 1);
        } else {
            if (c->a == 6) weight_points_pairs(U, sl, su, taps, ks, run, cn, 6, 0);
            else weight_points_pairs(U, sl, su, taps, ks, run, cn, 4, 0);
        }
    }
}

/* y for output channels [k0, k0 + kn) from M[xi][t][KB] */
WINO_INLINE void output_tiles(const few_ctx *c, const float *M, int64_t k0, int64_t kn, const int A)
{
    const kiln_conv2d_params *p = c->p;
    const int64_t OH = p->oh, OW = p->ow, K = c->K, m = A - 2;
    for (int64_t t = 0; t < c->NT; t++) {
        int64_t n = t / c->T, ti = t % c->T, oy0 = m * (ti / c->TW), ox0 = m * (ti % c->TW);
        int64_t rows = OH - oy0 < m ? OH - oy0 : m, cols = OW - ox0 < m ? OW - ox0 : m;
        for (int64_t kg = 0; kg < kn; kg += 16) {
            int64_t kv = kn - kg < 16 ? kn - kg : 16;
            __m512 s[6][4]; /* s[j][a] = (A^T m)[a][j] */
            for (int j = 0; j < A; j++) {
                __m512 mv[6];
                for (int i = 0; i < A; i++) mv[i] = _mm512_loadu_ps(M + (i * A + j) * c->sm + t * c->kb + kg);
                at_apply(A, mv, s[j]);
            }
            __m512 bv = c->bias ? _mm512_maskz_loadu_ps((__mmask16)((1u << kv) - 1), c->bias + k0 + kg)
                                : _mm512_setzero_ps();
            __m512 r[16]; /* r[4a + b]: output (a, b) of the tile, lane = channel */
            for (int i = 0; i < 16; i++) r[i] = _mm512_setzero_ps();
            for (int a = 0; a < A - 2; a++) {
                __m512 mv[6] = {s[0][a], s[1][a], s[2][a], s[3][a], s[4][a], s[5][a]}, o[4];
                at_apply(A, mv, o);
                for (int b = 0; b < A - 2; b++) r[4 * a + b] = _mm512_add_ps(o[b], bv);
            }
            transpose16(r); /* r[channel]: its outputs, row a at floats 4a.. */
            if (rows == 4 && cols == 4 && A == 6) /* a whole F(4,3) tile: four 4-float rows */
                for (int64_t ch = 0; ch < kv; ch++) {
                    float *o = c->y + (n * K + k0 + kg + ch) * OH * OW + oy0 * OW + ox0;
                    _mm_storeu_ps(o, _mm512_castps512_ps128(r[ch]));
                    _mm_storeu_ps(o + OW, _mm512_extractf32x4_ps(r[ch], 1));
                    _mm_storeu_ps(o + 2 * OW, _mm512_extractf32x4_ps(r[ch], 2));
                    _mm_storeu_ps(o + 3 * OW, _mm512_extractf32x4_ps(r[ch], 3));
                }
            else
                for (int64_t ch = 0; ch < kv; ch++) {
                    float *plane = c->y + (n * K + k0 + kg + ch) * OH * OW;
                    float tmp[16];
                    _mm512_storeu_ps(tmp, r[ch]);
                    for (int64_t a = 0; a < rows; a++) memcpy(plane + (oy0 + a) * OW + ox0, tmp + 4 * a, (size_t)cols * 4);
                }
        }
    }
}

AVX512 static void output_block(const few_ctx *c, const float *M, int64_t k0, int64_t kn)
{
    if (c->a == 6) output_tiles(c, M, k0, kn, 6);
    else output_tiles(c, M, k0, kn, 4);
}

/* One thread's share of the output-channel blocks (equal shares: the pool's chunking
 * would hand 8 blocks to one thread and 6 to the other for 14). */
AVX512 static void block_range(void *vctx, int64_t begin, int64_t end)
{
    const few_ctx *c = vctx;
    int threads = kiln_cpu_threads();
    float *slot = c->slots + (size_t)kiln_thread_index() * c->slot;
    const int64_t cc = c->cc, NT = c->NT, C = c->C, Cp = c->Cp;
    float *U = slot, *M = U + c->P * c->su, *taps = M + c->P * c->sm, *asl = taps + (size_t)32 * cc * 9;
    asl = (float *)(((uintptr_t)asl + 63) & ~(uintptr_t)63);
    for (int64_t share = begin; share < end; share++) {
        int64_t b0 = share * c->nkb / threads, b1 = (share + 1) * c->nkb / threads;
        for (int64_t b = b0; b < b1; b++) {
            int64_t k0 = b * c->kb, kn = c->K - k0 < c->kb ? c->K - k0 : c->kb;
            for (int64_t c0 = 0; c0 < C; c0 += cc) {
                int64_t cn = C - c0 < cc ? C - c0 : cc;
                /* bf16: the chunk's U in the slot, or in the cache (written at the first call) */
                uint32_t *Ub = (uint32_t *)(void *)U;
                int64_t sl = cc * 32, su = c->su;
                if (c->uc) {
                    Ub = c->uc + (size_t)((b * c->nch + c0 / cc) * c->P) * (size_t)c->ucs;
                    sl = (cc / 2) * 32;
                    su = c->ucs;
                }
                if (c->bf16) {
                    if (!c->uc_ready) weight_chunk_pairs(c, Ub, sl, su, taps, k0, c0, cn);
                } else weight_chunk(c, U, taps, k0, c0, cn);
                for (int xi = 0; xi < c->P; xi++) {
                    if (c->bf16)
                        kiln_cpu_gemm_serial_bf16(NT, kn, cn, c->Vp + xi * c->svp + c0 * 6, Cp * 6, Ub + xi * su, sl,
                                                  M + xi * c->sm, c->kb, c0 > 0);
                    else
                        kiln_cpu_gemm_serial(NT, kn, cn, c->V + (int64_t)xi * NT * Cp + c0, Cp, U + xi * c->su,
                                             cc * 32, M + xi * c->sm, c->kb, c0 > 0, asl);
                }
            }
            output_block(c, M, k0, kn);
        }
    }
}

int kiln_cpu_conv2d_winograd_few(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                                 const kiln_conv2d_params *p, int forced)
{
    if (!kiln_cpu_gemm_have_simd()) return 1;
    if (p->r != 3 || p->s != 3 || p->stride_h != 1 || p->stride_w != 1 || p->dil_h != 1 || p->dil_w != 1 ||
        p->groups != 1 || p->pad_h > 2 || p->pad_w > 2)
        return 1;
    /* A batch whose tiles outgrow MAX_TILES runs in groups of images that fit, each
     * transforming the weights again: still far cheaper than the other path's blocking
     * at these shapes (a CFG batch of 2 at 32x32).
     * The first group decides; the others follow it (forced). */
    int64_t t_img = ((p->oh + 3) / 4) * ((p->ow + 3) / 4);
    if (p->n > 1 && p->n * t_img > MAX_TILES && t_img <= MAX_TILES) {
        int64_t g = MAX_TILES / t_img;
        for (int64_t n0 = 0; n0 < p->n; n0 += g) {
            kiln_conv2d_params q = *p;
            q.n = p->n - n0 < g ? p->n - n0 : g;
            int r = kiln_cpu_conv2d_winograd_few(y + n0 * p->k * p->oh * p->ow, x + n0 * p->c * p->h * p->w, w, w_dtype,
                                                 bias, &q, forced || n0 > 0);
            if (r != 0) return r; /* declined (or out of scratch) at the first group: nothing written */
            /* the first group filled the cache (when its tile was the cache's): the others read it */
            if (p->cache && p->cache->filled) p->cache->ready = 1;
        }
        return 0;
    }
    few_ctx c;
    memset(&c, 0, sizeof c);
    c.p = p; c.x = x; c.y = y; c.w = w; c.w_dt = w_dtype; c.bias = bias;
    c.C = p->c; c.K = p->k; c.Cp = (p->c + 15) / 16 * 16;
    /* F(2,3) where F(4,3) would have at most TINY_TILES tiles an image (8x8): 4x the rows
     * for the GEMM and a U of 16 points instead of 36, for 1.8x the multiply-adds, and
     * faster at 8x8 all the same. KILN_WINOGRAD_FEW_TILE=2|4 forces one (tests). */
    int64_t t4 = ((p->oh + 3) / 4) * ((p->ow + 3) / 4), t2 = ((p->oh + 1) / 2) * ((p->ow + 1) / 2);
    c.m = t4 <= TINY_TILES && p->n * t2 <= MAX_TILES ? 2 : 4;
    const char *tile = kiln_tunable_str("KILN_WINOGRAD_FEW_TILE");
    if (tile && (!strcmp(tile, "2") || !strcmp(tile, "4"))) c.m = tile[0] - '0';
    c.a = c.m + 2; c.P = c.a * c.a;
    c.TH = (p->oh + c.m - 1) / c.m; c.TW = (p->ow + c.m - 1) / c.m; c.T = c.TH * c.TW; c.NT = p->n * c.T;
    if (c.NT > MAX_TILES || (!forced && p->n * t4 > FEW_TILES && c.C * c.K < LARGE_WEIGHTS)) return 1;
    /* 8x8 with f32 weights: the implicit GEMM reads them in place and wins; f16 / bf16
     * weights it has to convert panel by panel, and loses, with bf16 products too (on
     * one image: a tie where 512-bit products run at full width, 15 % slower where
     * they are split in two; README: speed, path choices) */
    int bf16 = kiln_cpu_bf16_active(); /* 1 vdpbf16ps, 2 emulated */
    if (!forced && c.m == 2 && w_dtype == KILN_F32) return 1;
    c.kb = KB;
    c.cc = CC < c.Cp ? CC : c.Cp;
    c.bf16 = bf16;
    c.nkb = (c.K + c.kb - 1) / c.kb;
    kiln_conv2d_cache *uc = p->cache;
    if (uc && uc->data && bf16 && uc->variant == cache_variant(c.m, bf16)) {
        c.uc = uc->data;
        c.uc_ready = uc->ready;
        c.ucs = cached_point_lanes(c.cc);
        c.nch = (c.C + c.cc - 1) / c.cc;
    }
    int threads = kiln_cpu_threads();
    c.su = (c.kb / 32) * c.cc * 32 + 16;
    c.sm = c.NT * c.kb + 16;
    c.slot = slot_floats(c.P, c.su, c.sm, c.cc);
    size_t n_xt = (size_t)(p->n * p->h * p->w) * (size_t)c.Cp, n_v = (size_t)c.P * (size_t)c.NT * (size_t)c.Cp;
    c.svp = (c.NT + 11) / 12 * c.Cp * 6;
    size_t n_vp = c.bf16 ? (size_t)c.P * (size_t)c.svp : 0;
    float *buf = kiln_cpu_scratch_get((n_xt + n_v + n_vp + (size_t)threads * c.slot + 48) * sizeof(float));
    if (!buf) return -1;
    c.xt = buf;
    c.V = c.xt + (n_xt + 15) / 16 * 16;
    c.Vp = (uint32_t *)(void *)(c.V + (n_v + 15) / 16 * 16);
    c.slots = (float *)(void *)(c.Vp + (n_vp + 15) / 16 * 16);
    kiln_parallel_for(p->n * ((p->h * p->w + 15) / 16), 1, to_channels_last, &c);
    kiln_parallel_for(c.NT, 1, input_fn, &c);
    if (c.bf16) kiln_parallel_for(c.P, 1, pack_v_fn, &c);
    kiln_parallel_for(threads, 1, block_range, &c);
    kiln_cpu_scratch_put(buf);
    if (c.uc && !c.uc_ready) uc->filled = 1;
    return 0;
}

/* Whether this path takes p (forced: KILN_CONV_PATH names it), and how: for a batch split
 * into groups of images as above, the first, largest group (*q), and its tile *m. */
static int few_plan(const kiln_conv2d_params *p, kiln_dtype w_dtype, int forced, kiln_conv2d_params *q, int *m)
{
    if (!kiln_cpu_gemm_have_simd()) return 0;
    if (p->r != 3 || p->s != 3 || p->stride_h != 1 || p->stride_w != 1 || p->dil_h != 1 || p->dil_w != 1 ||
        p->groups != 1 || p->pad_h > 2 || p->pad_w > 2)
        return 0;
    *q = *p;
    int64_t t_img = ((p->oh + 3) / 4) * ((p->ow + 3) / 4);
    if (p->n > 1 && p->n * t_img > MAX_TILES && t_img <= MAX_TILES)
        q->n = MAX_TILES / t_img; /* the first group decides (the others follow it) */
    int64_t t4 = ((q->oh + 3) / 4) * ((q->ow + 3) / 4), t2 = ((q->oh + 1) / 2) * ((q->ow + 1) / 2);
    *m = t4 <= TINY_TILES && q->n * t2 <= MAX_TILES ? 2 : 4;
    const char *tile = kiln_tunable_str("KILN_WINOGRAD_FEW_TILE");
    if (tile && (!strcmp(tile, "2") || !strcmp(tile, "4"))) *m = tile[0] - '0';
    int64_t NT = q->n * ((q->oh + *m - 1) / *m) * ((q->ow + *m - 1) / *m);
    if (NT > MAX_TILES || (!forced && q->n * t4 > FEW_TILES && q->c * q->k < LARGE_WEIGHTS)) return 0;
    if (!forced && *m == 2 && w_dtype == KILN_F32) return 0;
    return 1;
}

/* The buffer this path asks for p (its tile pick, bf16's pairs where bf16 products
 * run), for a batch split into groups of images (the first, largest group); 0 where it
 * declines the shape. */
size_t kiln_cpu_conv2d_winograd_few_scratch(const kiln_conv2d_params *p, kiln_dtype w_dtype, int forced)
{
    kiln_conv2d_params q;
    int m;
    if (!few_plan(p, w_dtype, forced, &q, &m)) return 0;
    int a = m + 2, P = a * a;
    int64_t NT = q.n * ((q.oh + m - 1) / m) * ((q.ow + m - 1) / m);
    int64_t Cp = (q.c + 15) / 16 * 16, cc = CC < Cp ? CC : Cp;
    int64_t su = (KB / 32) * cc * 32 + 16, sm = NT * KB + 16;
    size_t n_xt = (size_t)(q.n * q.h * q.w) * (size_t)Cp, n_v = (size_t)P * (size_t)NT * (size_t)Cp;
    size_t n_vp = kiln_cpu_bf16_active() ? (size_t)P * (size_t)((NT + 11) / 12 * Cp * 6) : 0;
    return (n_xt + n_v + n_vp + (size_t)kiln_cpu_threads() * slot_floats(P, su, sm, cc) + 48) * sizeof(float);
}

/* Which tiles keep their U: F(2,3)'s (16 points for 9 taps: 1.8x the f16 weights) by
 * default. F(4,3)'s is 4x them; kept, it made a UNet evaluation a few per cent faster
 * again, but writing its gigabytes at the first call (fresh pages) cost about what a
 * 20-step txt2img then saved (README: weights kept in the products' form), so only
 * KILN_WINOGRAD_FEW_CACHE=all keeps it. */
static int cache_keeps(int m)
{
    const char *e = kiln_tunable_str("KILN_WINOGRAD_FEW_CACHE");
    if (e && !strcmp(e, "none")) return 0;
    if (e && !strcmp(e, "all")) return 1;
    return m == 2;
}

size_t kiln_cpu_conv2d_winograd_few_cache(const kiln_conv2d_params *p, kiln_dtype w_dtype, int forced, int *variant)
{
    kiln_conv2d_params q;
    int m, bf16 = kiln_cpu_bf16_active();
    if (!bf16 || !few_plan(p, w_dtype, forced, &q, &m) || !cache_keeps(m)) return 0;
    *variant = cache_variant(m, bf16);
    return cache_lanes((m + 2) * (m + 2), p->k, p->c) * sizeof(uint32_t);
}

#else
int kiln_cpu_conv2d_winograd_few(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                                 const kiln_conv2d_params *p, int forced)
{
    (void)y; (void)x; (void)w; (void)w_dtype; (void)bias; (void)p; (void)forced;
    return 1;
}
size_t kiln_cpu_conv2d_winograd_few_scratch(const kiln_conv2d_params *p, kiln_dtype w_dtype, int forced)
{
    (void)p; (void)w_dtype; (void)forced;
    return 0;
}
size_t kiln_cpu_conv2d_winograd_few_cache(const kiln_conv2d_params *p, kiln_dtype w_dtype, int forced, int *variant)
{
    (void)p; (void)w_dtype; (void)forced; (void)variant;
    return 0;
}
#endif
