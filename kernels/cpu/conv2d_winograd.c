/* conv2d_winograd.c - Winograd convolutions with tiles in the vector lanes (AVX-512): the
 * VAE and the UNet's 64x64 level. Y = A^T [ (G g G^T) . (B^T d B) ] A over a x a input
 * tiles that give m x m outputs of an r x r kernel (a = m + r - 1): the channel sums
 * become P = a^2 independent GEMMs U[P][K][C] x V[P][C][tiles] (gemm.c).
 *  - F(4x4, 3x3): 36 products for 16 outputs, 4x fewer multiply-adds than the direct
 *    convolution;
 *  - F(6x6, 3x3): 64 for 36, 5.06x fewer (edges aside), at a larger rounding error
 *    than F(4,3)'s, where it is faster (see pick_tile());
 *  - F(4x4, 2x2) for a nearest 2x upsampling fused with a 3x3 convolution (the decoders'
 *    Upsample blocks, kiln_cpu_conv2d_up2): one 2x2 kernel per output parity on the small
 *    image, 25 products per 16 outputs, the outputs written to every other pixel.
 * Under kiln.precision("bf16") the weight transform writes U as the GEMM's bf16 pairs,
 * but for the points F(4,3) keeps in f32 (wino_f32_point).
 * Scratch is bounded (about 32 MB for F(4,3)): output channels go in blocks and tiles
 * in strips (see plan()). */
#define _GNU_SOURCE
#include "cpu_internal.h"
#include "threadpool.h"
#include "../../runtime/tunables.h"
#include "../../runtime/precision.h"

#include <stdlib.h>
#include <string.h>


#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include "simd_transpose.h"
#include "winograd_transforms.h"
#include "simd_bf16.h"
#define AVX512 __attribute__((target("avx512f")))

/* Lanes of a 16-tile block that lie in one tile row: [l0, l1), row ty, first column tx. */
typedef struct {
    int n;
    int l0[16], l1[16];
    int64_t ty[16], tx[16];
} tile_runs;

enum { MAXA = 8, MAXP = 64, MAXNV = 7 }; /* input tile side, points, window vectors (F(6,3)) */

/* Where the input transform of one 16-tile block loads from (same for every channel).
 * An input row of the block is a window of 16 m + r - 1 floats (nv = 5 or 7 vectors). */
typedef struct {
    tile_runs runs;
    int64_t col0[16];             /* input column of float m*l0 of each run's window */
    __mmask16 wm[16][MAXNV], zm[16][MAXNV]; /* window floats inside the image / covered by the run */
    __mmask16 fix, fcolA, fcolB;  /* lanes patched by a gather, and their valid columns m, m + 1 (r = 3) */
    int32_t foff[16], fiy[16];    /* patched lanes: offset of row 0 column m, and input row */
} blk_setup;

typedef struct wino_ctx {
    const kiln_conv2d_params *p; /* r x r kernel (pads and oh, ow may be set for an upsampling parity) */
    const float *x;             /* image n: [C, H, W] */
    float *y;                   /* image n: [K, yh, yw] */
    const void *w;              /* [K][C][3][3] (for r = 2 too: weight_tiles makes the parity's 2x2 kernel) */
    kiln_dtype w_dt;
    const float *bias;
    int m, r, a, P, nv;         /* F(m x m, r x r): input tile a = m + r - 1, P = a * a points, nv window vectors */
    int up, py, px;             /* up: output (oy, ox) goes to (2 oy + py, 2 ox + px) of y */
    int64_t yw, yhw;            /* row length and plane size of y */
    int64_t C, K, TW, TH;       /* tiles per row and column of one image */
    int64_t t0, nt, tp;         /* strip: first tile, tiles, padded to 32 (row length of M) */
    int64_t k0, kb, ns;         /* block of output channels; ns = ceil(kb/12) slivers */
    int64_t su, sv, sm;         /* floats from one xi to the next in U, V, M */
    /* U[P][ns][C][12] and V[P][tp/32][C][32] in the GEMM's sliver layout (no packing
     * there); M[P][kb][tp] row-major */
    float *U, *V, *M;
    int u_bf16;                 /* U rounded to bf16 pairs (kiln.precision "bf16") */
    float *wbuf;                /* kiln_cpu_threads() x 12*144 floats: converted weights */
    blk_setup *blk;             /* tp/16 blocks of the strip */
} wino_ctx;

/* bf16 products (kiln.precision "bf16") keep 12 of F(4,3)'s 36 points in f32: xi = 6i + j
 * with i = 0 or i = 5 (the first coordinate at 0 or infinity: xi 0..5 and 30..35, two
 * runs, so two batched f32 calls beside one bf16 call). Their U and V stay unrounded and
 * their products run in f32 (twice a bf16 product's time). With the points of
 * winograd_transforms.h the rounding error spreads about evenly over the 36 points, so
 * which 12 matters little (a simulation of random operands: each row of 6 removes about
 * a tenth of the error); these two rows are contiguous. Only this path keeps them: the
 * UNet's bf16 error against f32 comes from its 64x64 level, which runs here; every point
 * of the few-tiles path in f32 bought almost nothing (README: bf16 accuracy). */
static inline int wino_f32_point(int A, int xi) { return A == 6 && (xi < 6 || xi >= 30); }

/* ---- weight transform: U[xi] = (G g G^T)[xi] for every (k, c), in A sliver layout ---- */


/* For bf16 products U is written as the GEMM's pairs: a sliver row j holds input
 * channels 2j (low half) and 2j+1 (high half) of its 12 outputs. The 48 floats of 4
 * channels x 12 outputs (3 vectors, element 16q + l) give two such rows: even / odd
 * channel of pair 01 from vectors 0-1, of pair 23 from vectors 1-2 (vpermt2ps). */
typedef struct { __m512i e01, o01, e23, o23; } pair_idx;

static void pair_idx_init(pair_idx *t)
{
    int32_t e01[16], o01[16], e23[16], o23[16];
    for (int l = 0; l < 16; l++) {
        int k = l < 12 ? l : 11;
        e01[l] = k;          /* elements 0..11 */
        o01[l] = 12 + k;     /* elements 12..23 */
        e23[l] = 24 + k - 16; /* elements 24..35, counted from vector 1 */
        o23[l] = 36 + k - 16; /* elements 36..47 */
    }
    memcpy(&t->e01, e01, 64); memcpy(&t->o01, o01, 64); memcpy(&t->e23, e23, 64); memcpy(&t->o23, o23, 64);
}

/* Task: one A sliver (output channels kk in [12s, 12s+12) of the block) times 16 input
 * channels from c0. The 12 weight rows (16 channels x 9 taps each) are transposed so a
 * vector holds one tap of the 12 outputs; vectors then pair 4 input channels x 12
 * outputs, so that for each xi three whole vectors fill U[xi][s][c0+cq .. +3][0..11]
 * (192 contiguous bytes): plain stores, no gathers, no partial lines. */
#define BF16_WINO static __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define BF16_WINO_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))

/* native: the bf16 pairs by vcvtne2ps2bf16 (same bits as bf16_pair); the other variant
 * is compiled for the same target but executes no bf16 instruction. */
BF16_WINO_INLINE void weight_tiles(const wino_ctx *c, int64_t begin, int64_t end, const int A, const int native)
{
    const int64_t C = c->C, chunks = (C + 15) / 16;
    const size_t esz = kiln_dtype_size(c->w_dt), su = (size_t)c->su;
    /* f32 weights are read in place (rows C*9 floats apart); f16/bf16 rows are converted
     * into buf first (rows 144 floats apart) */
    const int f32 = c->w_dt == KILN_F32;
    const int64_t rstride = f32 ? C * 9 : 144;
    float *buf = c->wbuf + (size_t)kiln_thread_index() * (12 * 144);
    __m512 tb[144]; /* tb[c*9 + e], lane k: tap e of input channel c0+c for output 12s+k */
    pair_idx pk;
    pair_idx_init(&pk);
    const __m512i ilv = bf16_pair_index();
    for (int64_t task = begin; task < end; task++) {
        int64_t sl = task / chunks, c0 = (task % chunks) * 16;
        int64_t cn = C - c0 < 16 ? C - c0 : 16, kk0 = 12 * sl, kn = c->kb - kk0 < 12 ? c->kb - kk0 : 12;
        const float *src = f32 ? (const float *)c->w + ((c->k0 + kk0) * C + c0) * 9 : buf;
        /* whole f16 rows (16 channels): converted as they are loaded */
        const int f16_rows = c->w_dt == KILN_F16 && cn == 16;
        const char *wrow = (const char *)c->w + (size_t)(((c->k0 + kk0) * C + c0) * 9) * esz;
        if (!f32 && !f16_rows)
            for (int64_t r = 0; r < kn; r++)
                kiln_to_f32(buf + r * 144, (const char *)c->w + (size_t)(((c->k0 + kk0 + r) * C + c0) * 9) * esz,
                            c->w_dt, (size_t)(cn * 9));
        for (int b = 0; b < 9; b++) { /* columns 16b .. 16b+15 of the 12 x (cn*9) rows */
            int64_t cols = cn * 9 - 16 * b;
            __mmask16 cm = cols >= 16 ? (__mmask16)0xffff : cols <= 0 ? 0 : (__mmask16)((1u << cols) - 1);
            __m512 r[16];
            if (f16_rows) wino_f16_rows(r, wrow + 32 * b, (size_t)C * 9 * 2, kn);
            else
                for (int k = 0; k < 16; k++)
                    r[k] = k < kn && cm ? _mm512_maskz_loadu_ps(cm, src + k * rstride + 16 * b) : _mm512_setzero_ps();
            transpose16(r);
            for (int m = 0; m < 16; m++) tb[16 * b + m] = r[m];
        }
        for (int64_t cq = 0; cq < cn; cq += 4) {
            __m512 u[3][MAXP];
            for (int q = 0; q < 3; q++) {
                __m512 gv[9];
                for (int e = 0; e < 9; e++) {
                    /* lane l of vector q is element 16q + l of [4 channels][12 outputs] */
                    __m512i t0 = _mm512_castps_si512(tb[(cq + q) * 9 + e]);
                    __m512i t1 = _mm512_castps_si512(tb[(cq + q + 1) * 9 + e]);
                    __m512i x;
                    if (q == 0) /* channel 0 outputs 0..11, channel 1 outputs 0..3 */
                        x = _mm512_mask_blend_epi32(0xF000, t0, _mm512_alignr_epi32(t1, t1, 4));
                    else if (q == 1) /* channel 1 outputs 4..11, channel 2 outputs 0..7 */
                        x = _mm512_mask_blend_epi32(0xFF00, _mm512_alignr_epi32(t0, t0, 4), _mm512_alignr_epi32(t1, t1, 8));
                    else /* channel 2 outputs 8..11, channel 3 outputs 0..11 */
                        x = _mm512_mask_blend_epi32(0xFFF0, _mm512_alignr_epi32(t0, t0, 8), _mm512_alignr_epi32(t1, t1, 12));
                    gv[e] = _mm512_castsi512_ps(x);
                }
                if (A == 5) { /* the 2x2 kernel of parity (py, px), then F(4,2)'s G */
                    __m512 h[2][3], w2[2][2], t[2][5];
                    for (int s3 = 0; s3 < 3; s3++) {
                        h[0][s3] = c->py ? _mm512_add_ps(gv[s3], gv[3 + s3]) : gv[s3];
                        h[1][s3] = c->py ? gv[6 + s3] : _mm512_add_ps(gv[3 + s3], gv[6 + s3]);
                    }
                    for (int a2 = 0; a2 < 2; a2++) {
                        w2[a2][0] = c->px ? _mm512_add_ps(h[a2][0], h[a2][1]) : h[a2][0];
                        w2[a2][1] = c->px ? h[a2][2] : _mm512_add_ps(h[a2][1], h[a2][2]);
                    }
                    for (int b2 = 0; b2 < 2; b2++) G5_APPLY(w2[0][b2], w2[1][b2], t[b2]);
                    for (int i = 0; i < 5; i++) {
                        __m512 o[5];
                        G5_APPLY(t[0][i], t[1][i], o);
                        for (int j = 0; j < 5; j++) u[q][i * 5 + j] = o[j];
                    }
                } else {
                    __m512 t[3][MAXA]; /* t[s][i] = (G g)[i][s] */
                    for (int s3 = 0; s3 < 3; s3++) g_apply(A, gv[s3], gv[3 + s3], gv[6 + s3], t[s3]);
                    for (int i = 0; i < A; i++) {
                        __m512 o[MAXA];
                        g_apply(A, t[0][i], t[1][i], t[2][i], o);
                        for (int j = 0; j < A; j++) u[q][i * A + j] = o[j];
                    }
                }
            }
            if (c->u_bf16) { /* straight to the GEMM's bf16 pairs: channels (cq, cq+1) and (cq+2, cq+3) */
                uint32_t *dp = (uint32_t *)(void *)(c->U + sl * C * 12) + ((c0 + cq) / 2) * 12;
                int pairs = cn - cq >= 3 ? 2 : 1;
                for (int xi = 0; xi < A * A; xi++) {
                    if (wino_f32_point(A, xi)) {
                        float *dst = c->U + (sl * C + c0 + cq) * 12 + xi * su;
                        int64_t valid = 12 * (cn - cq < 4 ? cn - cq : 4);
                        for (int q = 0; q < 3; q++) {
                            int64_t v = valid - 16 * q;
                            __mmask16 mk = v >= 16 ? (__mmask16)0xffff : v <= 0 ? 0 : (__mmask16)((1u << v) - 1);
                            _mm512_mask_storeu_ps(dst + 16 * q, mk, u[q][xi]);
                        }
                        continue;
                    }
                    uint32_t *d = dp + xi * su;
                    __m512 e01 = _mm512_permutex2var_ps(u[0][xi], pk.e01, u[1][xi]);
                    __m512 o01 = _mm512_permutex2var_ps(u[0][xi], pk.o01, u[1][xi]);
                    __m512i p01 = native ? bf16_pair_native(e01, o01, ilv) : bf16_pair(e01, o01);
                    if (pairs == 2) {
                        __m512 e23 = _mm512_permutex2var_ps(u[1][xi], pk.e23, u[2][xi]);
                        __m512 o23 = _mm512_permutex2var_ps(u[1][xi], pk.o23, u[2][xi]);
                        __m512i p23 = native ? bf16_pair_native(e23, o23, ilv) : bf16_pair(e23, o23);
                        /* whole-vector stores where the next one overwrites the 4 extra
                         * lanes (masked stores that split cache lines are slow): pair 01
                         * always, pair 23 unless it is this task's last */
                        _mm512_storeu_si512(d, p01);
                        if (cq + 4 < cn) _mm512_storeu_si512(d + 12, p23);
                        else _mm512_mask_storeu_epi32(d + 12, 0x0FFF, p23);
                    } else _mm512_mask_storeu_epi32(d, 0x0FFF, p01);
                }
                continue;
            }
            float *dst = c->U + (sl * C + c0 + cq) * 12;
            if (cn - cq >= 4) {
                for (int xi = 0; xi < A * A; xi++)
                    for (int q = 0; q < 3; q++) _mm512_storeu_ps(dst + xi * su + 16 * q, u[q][xi]);
            } else { /* channels past C: lanes whose element 16q + l belongs to channel >= cn - cq */
                int64_t valid = 12 * (cn - cq);
                for (int q = 0; q < 3; q++) {
                    int64_t v = valid - 16 * q;
                    __mmask16 mk = v >= 16 ? (__mmask16)0xffff : v <= 0 ? 0 : (__mmask16)((1u << v) - 1);
                    for (int xi = 0; xi < A * A; xi++) _mm512_mask_storeu_ps(dst + xi * su + 16 * q, mk, u[q][xi]);
                }
            }
        }
    }
}

BF16_WINO void weight_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    if (c->u_bf16 == 1) {
        if (c->a == 5) weight_tiles(c, begin, end, 5, 1);
        else if (c->a == 8) weight_tiles(c, begin, end, 8, 1);
        else weight_tiles(c, begin, end, 6, 1);
    } else {
        if (c->a == 5) weight_tiles(c, begin, end, 5, 0);
        else if (c->a == 8) weight_tiles(c, begin, end, 8, 0);
        else weight_tiles(c, begin, end, 6, 0);
    }
}

/* ---- input transform: V[xi][c][t] = (B^T d B)[xi] ---- */


static void tile_runs_init(const struct wino_ctx *c, int64_t tb, tile_runs *r)
{
    r->n = 0;
    for (int l = 0; l < 16;) {
        int64_t t = c->t0 + tb + l;
        if (t >= c->t0 + c->nt) break;
        int64_t tx = t % c->TW;
        int len = c->TW - tx < 16 - l ? (int)(c->TW - tx) : 16 - l;
        if (t + len > c->t0 + c->nt) len = (int)(c->t0 + c->nt - t);
        r->l0[r->n] = l; r->l1[r->n] = l + len; r->ty[r->n] = t / c->TW; r->tx[r->n] = tx;
        r->n++;
        l += len;
    }
}

/* Floats f in [lo, hi) of a window of nv vectors as nv lane masks. */
static inline void window_masks(int64_t lo, int64_t hi, __mmask16 *m, int nv)
{
    for (int q = 0; q < nv; q++) {
        int64_t a = lo - 16 * q, b = hi - 16 * q;
        if (a < 0) a = 0;
        if (b > 16) b = 16;
        m[q] = a >= b ? 0 : (__mmask16)(((1u << b) - 1) & ~((1u << a) - 1));
    }
}

static void blk_setup_init(const wino_ctx *c, int64_t tb, blk_setup *bs)
{
    const kiln_conv2d_params *p = c->p;
    const int64_t W = p->w, m = c->m;
    tile_runs_init(c, tb, &bs->runs);
    const tile_runs *runs = &bs->runs;
    bs->fix = bs->fcolA = bs->fcolB = 0;
    for (int l = 0; l < 16; l++) bs->foff[l] = 0, bs->fiy[l] = -1000000;
    for (int r = 0; r < runs->n; r++) {
        if (runs->l1[r] < 16) { /* the last tile of this run has no next tile in the window */
            int l = runs->l1[r] - 1;
            int64_t iy = m * runs->ty[r] - p->pad_h, ix = m * (runs->tx[r] + l - runs->l0[r]) - p->pad_w + m;
            bs->fix |= (__mmask16)(1u << l);
            if (ix >= 0 && ix < W) bs->fcolA |= (__mmask16)(1u << l);
            if (c->r == 3 && ix + 1 >= 0 && ix + 1 < W) bs->fcolB |= (__mmask16)(1u << l);
            bs->fiy[l] = (int32_t)iy;
            bs->foff[l] = (int32_t)(iy * W + ix);
        }
        bs->col0[r] = m * runs->tx[r] - p->pad_w;
        int64_t lo = m * runs->l0[r], hi = m * runs->l1[r] + c->r - 1;
        window_masks(lo, hi, bs->zm[r], c->nv);
        if (bs->col0[r] < 0) lo -= bs->col0[r];
        if (hi > m * runs->l0[r] + (W - bs->col0[r])) hi = m * runs->l0[r] + (W - bs->col0[r]);
        window_masks(lo, hi, bs->wm[r], c->nv);
    }
}

/* The stride-6 shuffles of F(6,3), both ways, as 6 outputs each drawn from 6 vectors
 * by pairs (vpermt2ps reads two vectors; its index is taken mod 32):
 *  - de-interleave (input): out[b] lane l = float 6l + b of the 96-float window x[0..5];
 *  - interleave (output): out[q] float f = in[F % 6][F / 6], F = 16q + f.
 * out[i] = in pair 0, blended with pair 1 where k23, with pair 2 where k45. */
typedef struct {
    __m512i idx[6];
    __mmask16 k23[6], k45[6];
} perm6_t;

static void perm6_init(perm6_t *t, int interleave)
{
    for (int i = 0; i < 6; i++) {
        int32_t ix[16];
        unsigned k23 = 0, k45 = 0;
        for (int l = 0; l < 16; l++) {
            int F = 16 * i + l;
            int src = interleave ? F % 6 : (6 * l + i) / 16, el = interleave ? F / 6 : (6 * l + i) % 16;
            ix[l] = el + 16 * (src & 1);
            if (src / 2 == 1) k23 |= 1u << l;
            if (src / 2 == 2) k45 |= 1u << l;
        }
        memcpy(&t->idx[i], ix, sizeof ix);
        t->k23[i] = (__mmask16)k23;
        t->k45[i] = (__mmask16)k45;
    }
}

WINO_INLINE __m512 perm6(const __m512 *in, const perm6_t *t, int i)
{
    __m512 v = _mm512_permutex2var_ps(in[0], t->idx[i], in[1]);
    v = _mm512_mask_blend_ps(t->k23[i], v, _mm512_permutex2var_ps(in[2], t->idx[i], in[3]));
    return _mm512_mask_blend_ps(t->k45[i], v, _mm512_permutex2var_ps(in[4], t->idx[i], in[5]));
}

/* (The loops over A, NV and m in the transforms carry `#pragma GCC unroll`: at -O2 GCC
 * did not unroll them and kept the tile arrays on the stack, which made the input
 * transform take twice as long.)
 *
 * Reads the a x a input tiles of 16 lanes with contiguous loads: one input row of the
 * whole block is a window of 16 m + 2 floats where tile l starts at float m l, so
 * columns j < m come out of an m-way de-interleave (F(4,3): shuffles; F(6,3): vpermt2ps
 * over vector pairs) and j = m, m + 1 are columns 0, 1 of the next tile; the last tile
 * of a run that does not end the block has no next tile and is patched by a gather.
 * Channels outer: each plane is read front to back. */
/* The next plane's lines [next, end), prefetched a share at a time over this plane's
 * n_blk tile blocks: a burst of them all at a plane's start stalled on the outstanding
 * misses. pf_spread_init gives the share; each tile block then calls pf_spread_step. */
typedef struct { const char *next, *end; int64_t step; } pf_spread;

static inline pf_spread pf_spread_init(const void *begin, const void *end, int64_t n_blk)
{
    pf_spread p = {begin, end, 0};
    p.step = ((p.end - p.next + n_blk - 1) / n_blk + 63) / 64 * 64;
    return p;
}

WINO_INLINE void pf_spread_step(pf_spread *p, int for_write)
{
    if (!p->next) return; /* no next plane */
    for (const char *e = p->next + p->step; p->next < p->end && p->next < e; p->next += 64) {
        if (for_write) __builtin_prefetch(p->next, 1, 2);
        else _mm_prefetch(p->next, _MM_HINT_T1);
    }
}

WINO_INLINE void input_tiles(const wino_ctx *c, int64_t begin, int64_t end, const int A)
{
    const kiln_conv2d_params *p = c->p;
    const int m = A == 8 ? 6 : 4, NV = A == 8 ? 7 : 5;
    const int64_t HW = p->h * p->w, W = p->w, H = p->h, C = c->C;
    perm6_t d6;
    if (A == 8) perm6_init(&d6, 0);
    /* input rows this strip reads: short runs per channel that the hardware prefetcher
     * does not see coming, so the next channel's rows are prefetched by hand */
    int64_t row0 = m * (c->t0 / c->TW) - p->pad_h, row1 = m * ((c->t0 + c->nt - 1) / c->TW) - p->pad_h + A;
    if (row0 < 0) row0 = 0;
    if (row1 > H) row1 = H;
    const int64_t n_blk = (c->tp + 15) / 16;
    for (int64_t ch = begin; ch < end; ch++) {
        const float *plane = c->x + ch * HW;
        pf_spread pf = {NULL, NULL, 0};
        if (ch + 1 < end && row1 > row0) pf = pf_spread_init(plane + HW + row0 * W, plane + HW + row1 * W, n_blk);
        for (int64_t tb = 0; tb < c->tp; tb += 16) {
            pf_spread_step(&pf, 0);
            const blk_setup *bs = &c->blk[tb / 16];
            const tile_runs *rn = &bs->runs;
            __m512 tmp[MAXA][MAXA]; /* tmp[i][j'] = (d B)[i][j'] */
            #pragma GCC unroll 8
            for (int i = 0; i < A; i++) {
                __m512 x[MAXNV];
                #pragma GCC unroll 8
                for (int q = 0; q < NV; q++) x[q] = _mm512_setzero_ps();
                for (int r = 0; r < rn->n; r++) {
                    int64_t iy = m * rn->ty[r] - p->pad_h + i;
                    if (r > 0)
                        #pragma GCC unroll 8
                        for (int q = 0; q < NV; q++) x[q] = _mm512_mask_mov_ps(x[q], bs->zm[r][q], _mm512_setzero_ps());
                    if (iy < 0 || iy >= H) continue;
                    /* float f of the window is column col0 + f - m l0; masked-off lanes are never read */
                    const float *base = plane + iy * W + bs->col0[r] - m * rn->l0[r];
                    #pragma GCC unroll 8
                    for (int q = 0; q < NV; q++)
                        if (bs->wm[r][q]) x[q] = _mm512_mask_loadu_ps(x[q], bs->wm[r][q], base + 16 * q);
                }
                __m512 e[MAXA];
                if (m == 4) {
                    /* de-interleave floats 4l + b of x[0..3] into e[b], lane l */
                    __m512 v = _mm512_shuffle_f32x4(x[0], x[1], 0x88), w = _mm512_shuffle_f32x4(x[2], x[3], 0x88);
                    __m512 v2 = _mm512_shuffle_f32x4(x[0], x[1], 0xDD), w2 = _mm512_shuffle_f32x4(x[2], x[3], 0xDD);
                    __m512 q0 = _mm512_shuffle_f32x4(v, w, 0x88), q2 = _mm512_shuffle_f32x4(v, w, 0xDD);
                    __m512 q1 = _mm512_shuffle_f32x4(v2, w2, 0x88), q3 = _mm512_shuffle_f32x4(v2, w2, 0xDD);
                    __m512 t0 = _mm512_unpacklo_ps(q0, q1), t1 = _mm512_unpackhi_ps(q0, q1);
                    __m512 t2 = _mm512_unpacklo_ps(q2, q3), t3 = _mm512_unpackhi_ps(q2, q3);
                    e[0] = _mm512_shuffle_ps(t0, t2, 0x44);
                    e[1] = _mm512_shuffle_ps(t0, t2, 0xEE);
                    e[2] = _mm512_shuffle_ps(t1, t3, 0x44);
                    e[3] = _mm512_shuffle_ps(t1, t3, 0xEE);
                } else {
                    #pragma GCC unroll 8
                    for (int b = 0; b < 6; b++) e[b] = perm6(x, &d6, b);
                }
                /* columns m (and m + 1 for 3x3): columns 0 (and 1) of the next lane;
                 * lane 15's are the first floats of the last window vector */
                __m512i xl = _mm512_castps_si512(x[NV - 1]);
                e[m] = _mm512_castsi512_ps(_mm512_alignr_epi32(xl, _mm512_castps_si512(e[0]), 1));
                if (A > m + 1)
                    e[m + 1] = _mm512_castsi512_ps(
                        _mm512_alignr_epi32(_mm512_alignr_epi32(xl, xl, 1), _mm512_castps_si512(e[1]), 1));
                if (bs->fix) {
                    __m512i ri = _mm512_add_epi32(_mm512_loadu_si512(bs->fiy), _mm512_set1_epi32(i));
                    __mmask16 rv = _mm512_cmpge_epi32_mask(ri, _mm512_setzero_si512()) &
                                   _mm512_cmplt_epi32_mask(ri, _mm512_set1_epi32((int)H));
                    __m512i oA = _mm512_add_epi32(_mm512_loadu_si512(bs->foff), _mm512_set1_epi32((int)(i * W)));
                    e[m] = _mm512_mask_mov_ps(e[m], bs->fix, _mm512_setzero_ps());
                    e[m] = _mm512_mask_i32gather_ps(e[m], bs->fcolA & rv, oA, plane, 4);
                    if (A > m + 1) {
                        e[m + 1] = _mm512_mask_mov_ps(e[m + 1], bs->fix, _mm512_setzero_ps());
                        e[m + 1] = _mm512_mask_i32gather_ps(e[m + 1], bs->fcolB & rv,
                                                            _mm512_add_epi32(oA, _mm512_set1_epi32(1)), plane, 4);
                    }
                }
                bt_apply(A, e, tmp[i]);
            }
            float *dst = c->V + ((tb / 32) * C + ch) * 32 + tb % 32;
            #pragma GCC unroll 8
            for (int j = 0; j < A; j++) {
                __m512 d[MAXA], vv[MAXA];
                #pragma GCC unroll 8
                for (int i = 0; i < A; i++) d[i] = tmp[i][j];
                bt_apply(A, d, vv);
                #pragma GCC unroll 8
                for (int i = 0; i < A; i++) _mm512_store_ps(dst + (size_t)(i * A + j) * (size_t)c->sv, vv[i]);
            }
        }
    }
}

AVX512 static void input_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    if (c->a == 8) input_tiles(c, begin, end, 8);
    else if (c->a == 5) input_tiles(c, begin, end, 5);
    else input_tiles(c, begin, end, 6);
}

/* ---- output transform: y = A^T m A (+ bias) ---- */


/* Interleaves o[b] (lane l = tile l) into r[q]: floats 4l+b of 64, i.e. the 4 outputs
 * of each tile side by side, as they lie in an output row. */
AVX512 static inline void interleave4(const __m512 *o, __m512 *r)
{
    __m512 p01l = _mm512_unpacklo_ps(o[0], o[1]), p01h = _mm512_unpackhi_ps(o[0], o[1]);
    __m512 p23l = _mm512_unpacklo_ps(o[2], o[3]), p23h = _mm512_unpackhi_ps(o[2], o[3]);
    /* q[c], 128-bit lane L: the 4 outputs of tile 4L + c */
    __m512 q0 = _mm512_shuffle_ps(p01l, p23l, 0x44), q1 = _mm512_shuffle_ps(p01l, p23l, 0xEE);
    __m512 q2 = _mm512_shuffle_ps(p01h, p23h, 0x44), q3 = _mm512_shuffle_ps(p01h, p23h, 0xEE);
    __m512 v = _mm512_shuffle_f32x4(q0, q1, 0x88), w = _mm512_shuffle_f32x4(q2, q3, 0x88);
    __m512 v2 = _mm512_shuffle_f32x4(q0, q1, 0xDD), w2 = _mm512_shuffle_f32x4(q2, q3, 0xDD);
    r[0] = _mm512_shuffle_f32x4(v, w, 0x88);
    r[2] = _mm512_shuffle_f32x4(v, w, 0xDD);
    r[1] = _mm512_shuffle_f32x4(v2, w2, 0x88);
    r[3] = _mm512_shuffle_f32x4(v2, w2, 0xDD);
}

/* Lane L of an expanded vector: bit L of the result is bit L / 2 of v (v < 256). */
static inline __mmask16 double_bits(unsigned v)
{
    v = (v | v << 4) & 0x0F0Fu; /* bit i to bit 2i */
    v = (v | v << 2) & 0x3333u;
    v = (v | v << 1) & 0x5555u;
    return (__mmask16)(v | v << 1);
}

/* Output channels outer: each plane is written front to back. With c->up (a parity of
 * an upsampling convolution), output (oy, ox) goes to (2 oy + py, 2 ox + px): each
 * vector of 16 outputs is spread over 32 floats of the row (lane pairs), and masked
 * stores write this parity's lanes only. */
WINO_INLINE void output_tiles(const wino_ctx *c, int64_t begin, int64_t end, const int A)
{
    const kiln_conv2d_params *p = c->p;
    const int m = A == 8 ? 6 : 4;
    const int64_t OW = p->ow, YW = c->yw, YHW = c->yhw, step = c->up ? 2 : 1;
    perm6_t i6;
    if (A == 8) perm6_init(&i6, 1);
    const __m512i lo_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi_idx = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    const __mmask16 par = (__mmask16)(c->px ? 0xAAAA : 0x5555);
    int64_t row0 = m * (c->t0 / c->TW), row1 = m * ((c->t0 + c->nt - 1) / c->TW) + m;
    if (row1 > p->oh) row1 = p->oh;
    row0 = step * row0 + c->py;
    row1 = step * row1;
    const int64_t n_blk = (c->tp + 15) / 16;
    for (int64_t kk = begin; kk < end; kk++) {
        int64_t k = c->k0 + kk;
        float *plane = c->y + k * YHW;
        __m512 bv = _mm512_set1_ps(c->bias ? c->bias[k] : 0.0f);
        const int act = p->act;
        const __m512 zero = _mm512_setzero_ps(), slope = _mm512_set1_ps(p->act_slope);
        /* the next plane's rows, for writing */
        pf_spread pf = {NULL, NULL, 0};
        if (kk + 1 < end && row1 > row0) pf = pf_spread_init(plane + YHW + row0 * YW, plane + YHW + row1 * YW, n_blk);
        for (int64_t tb = 0; tb < c->tp; tb += 16) {
            pf_spread_step(&pf, 1);
            const tile_runs *rn = &c->blk[tb / 16].runs;
            __m512 s[MAXA][MAXA - 2]; /* s[j][a] = (A^T m)[a][j] */
            #pragma GCC unroll 8
            for (int j = 0; j < A; j++) {
                __m512 mv[MAXA];
                #pragma GCC unroll 8
                for (int i = 0; i < A; i++) mv[i] = _mm512_load_ps(c->M + (i * A + j) * c->sm + kk * c->tp + tb);
                at_apply(A, mv, s[j]);
            }
            #pragma GCC unroll 8
            for (int a = 0; a < m; a++) {
                __m512 mv[MAXA], o[MAXA - 2], r[MAXA - 2];
                #pragma GCC unroll 8
                for (int j = 0; j < A; j++) mv[j] = s[j][a];
                at_apply(A, mv, o);
                #pragma GCC unroll 8
                for (int bb = 0; bb < m; bb++) o[bb] = _mm512_add_ps(o[bb], bv);
                if (act) /* leaky ReLU as the unary op computes it: x < 0 -> x * slope (+ 0) */
                    #pragma GCC unroll 8
                    for (int bb = 0; bb < m; bb++)
                        o[bb] = _mm512_add_ps(_mm512_mask_mul_ps(o[bb], _mm512_cmp_ps_mask(o[bb], zero, _CMP_LT_OQ),
                                                                 o[bb], slope), zero);
                if (m == 4) interleave4(o, r);
                else
                    #pragma GCC unroll 8
                    for (int q = 0; q < 6; q++) r[q] = perm6(o, &i6, q);
                for (int t = 0; t < rn->n; t++) {
                    int64_t oy = m * rn->ty[t] + a;
                    if (oy >= p->oh) continue;
                    /* float f of r (f in [m l0, m l1)) is output column m tx + f - m l0, if < OW */
                    int64_t f0 = m * rn->l0[t], f1 = m * rn->l1[t], lim = f0 + (OW - m * rn->tx[t]);
                    if (f1 > lim) f1 = lim;
                    float *base = plane + (step * oy + c->py) * YW + step * (m * rn->tx[t] - f0) + c->px;
                    #pragma GCC unroll 8
                    for (int q = 0; q < m; q++) {
                        int64_t lo = f0 - 16 * q, hi = f1 - 16 * q;
                        if (lo < 0) lo = 0;
                        if (hi > 16) hi = 16;
                        if (lo >= hi) continue;
                        unsigned mk = ((1u << hi) - 1) & ~((1u << lo) - 1);
                        if (!c->up) {
                            _mm512_mask_storeu_ps(base + 16 * q, (__mmask16)mk, r[q]);
                            continue;
                        }
                        /* lane L of the expanded vectors is output float 2f + px (f = 16q + L/2
                         * or 16q + 8 + L/2); base already adds px, so store from base - px */
                        float *b2 = base - c->px + 32 * q;
                        __mmask16 ml = double_bits(mk & 0xFF) & par, mh = double_bits(mk >> 8) & par;
                        if (ml) _mm512_mask_storeu_ps(b2, ml, _mm512_permutexvar_ps(lo_idx, r[q]));
                        if (mh) _mm512_mask_storeu_ps(b2 + 16, mh, _mm512_permutexvar_ps(hi_idx, r[q]));
                    }
                }
            }
        }
    }
}

AVX512 static void output_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    if (c->a == 8) output_tiles(c, begin, end, 8);
    else if (c->a == 5) output_tiles(c, begin, end, 5);
    else output_tiles(c, begin, end, 6);
}

/* Blocking, tuned on SD's shapes (tests/bench/bench_gemm_conv.c):
 *  - few tiles (V of the whole image <= V_ONE_STRIP_BYTES, the weight-heavy UNet levels):
 *    one strip, transformed once, and output channels in small blocks whose U
 *    (<= U_SMALL_BYTES) stays in cache between its transform and its GEMMs;
 *  - many tiles: strips of ts tiles (a multiple of 32) with V + M <= STRIP_MAX_BYTES,
 *    so a strip stays in cache from its transform through its GEMMs to the output
 *    transform, but at least MIN_STRIP tiles so that each U element streamed from
 *    memory is used enough; all output channels at once while U <= U_MAX_BYTES. */
static const size_t V_ONE_STRIP_BYTES = (size_t)8 << 20, U_SMALL_BYTES = (size_t)4 << 20;
static const size_t U_MAX_BYTES = (size_t)24 << 20, STRIP_MAX_BYTES = (size_t)2 << 20;
enum { MIN_STRIP = 32 };

static int64_t channel_block(double bytes, int64_t C, int64_t K, int P)
{
    int64_t k = (int64_t)(bytes / (P * 4.0 * (double)C)) / 48 * 48;
    return k >= K ? K : k < 48 ? (K < 48 ? K : 48) : k;
}

static void plan(int64_t C, int64_t K, int64_t T, int P, int64_t *kb, int64_t *ts)
{
    const double unit = P * 4.0;
    int64_t t32 = (T + 31) / 32 * 32;
    if (unit * (double)C * (double)t32 <= (double)V_ONE_STRIP_BYTES) {
        *ts = t32;
        *kb = channel_block((double)U_SMALL_BYTES, C, K, P);
        return;
    }
    *kb = channel_block((double)U_MAX_BYTES, C, K, P);
    if (*kb < K) { /* blocks of about equal size (each costs a pass of input transforms) */
        int64_t nkb = (K + *kb - 1) / *kb, even = ((K + nkb - 1) / nkb + 47) / 48 * 48;
        if (even < *kb) *kb = even;
    }
    int64_t t = (int64_t)((double)STRIP_MAX_BYTES / (unit * (double)(C + *kb)));
    if (t < MIN_STRIP) t = MIN_STRIP;
    int64_t nstrip = (T + t - 1) / t;            /* strips of equal size */
    *ts = ((T + nstrip - 1) / nstrip + 31) / 32 * 32;
}

static void set_block(wino_ctx *c, int64_t bk, int64_t kb)
{
    c->k0 = bk * kb;
    c->kb = c->K - c->k0 < kb ? c->K - c->k0 : kb;
    c->ns = (c->kb + 11) / 12;
    c->su = c->ns * 12 * c->C + 16;
    c->sm = c->kb * c->tp + 16;
}

static void set_strip(wino_ctx *c, int64_t st, int64_t ts)
{
    int64_t T = c->TH * c->TW;
    c->t0 = st * ts;
    c->nt = T - c->t0 < ts ? T - c->t0 : ts;
    c->tp = (c->nt + 31) / 32 * 32;
    c->sv = c->C * c->tp + 16;
    c->sm = c->kb * c->tp + 16;
}

static void gemms(const wino_ctx *c)
{
    if (!c->u_bf16) {
        kiln_cpu_gemm_prepacked(c->P, c->kb, c->nt, c->C, c->U, c->su, c->V, c->sv, c->M, c->tp, c->sm);
        return;
    }
    /* runs of points of one kind (f32_point), each run one batched call */
    for (int x0 = 0, x1; x0 < c->P; x0 = x1) {
        int f = wino_f32_point(c->a, x0);
        for (x1 = x0 + 1; x1 < c->P && wino_f32_point(c->a, x1) == f; x1++) {}
        const float *U = c->U + (size_t)x0 * c->su, *V = c->V + (size_t)x0 * c->sv;
        float *M = c->M + (size_t)x0 * c->sm;
        if (f) {
            int tok = kiln_precision_scope_begin(KILN_PREC_F32);
            kiln_cpu_gemm_prepacked(x1 - x0, c->kb, c->nt, c->C, U, c->su, V, c->sv, M, c->tp, c->sm);
            kiln_precision_scope_end(tok);
        } else
            kiln_cpu_gemm_prepacked_bf16(x1 - x0, c->kb, c->nt, c->C, (const uint32_t *)(const void *)U, c->su,
                                         (const uint32_t *)(const void *)V, c->sv, M, c->tp, c->sm);
    }
}

/* bf16: V[xi] rounded into the GEMM's pairs in place, once for every block of outputs
 * (rounding it inside each block's products cost as much as those products) */
static void v_pairs_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    for (int64_t xi = begin; xi < end; xi++)
        if (!wino_f32_point(c->a, (int)xi)) kiln_cpu_bf16_pairs_b((uint32_t *)(void *)(c->V + xi * c->sv), c->tp, c->C, c->C * 32);
}

/* Two ways to share the work, so that each thread runs a whole pipeline (transforms
 * and GEMMs) on data in its own cache, with one pool job per image instead of four per
 * step:
 *  - BLOCKS (one strip): V of the images is transformed once, in parallel; then each
 *    task takes a block of output channels: its U, its P GEMMs, its output transform;
 *  - STRIPS: U of a block is transformed in parallel; then each task takes a strip of
 *    tiles: its V, its P GEMMs, its output transform. */
typedef struct {
    wino_ctx base;            /* block (STRIPS) or strip (BLOCKS) already set */
    int64_t kb, ts;
    float *U, *V, *M;         /* per-thread parts: U (BLOCKS) or V (STRIPS), and M */
    size_t nU, nV, nM;        /* floats per thread (or per image for V in BLOCKS) */
    blk_setup *blk;           /* STRIPS: per thread, ts/16 each */
    size_t nB;                /* blk_setup entries per thread */
    int64_t n_img;            /* BLOCKS: images whose V is ready */
    const float *x;           /* BLOCKS: first of those images */
    float *y;
} job_ctx;

AVX512 static void block_task(void *vctx, int64_t begin, int64_t end)
{
    const job_ctx *j = vctx;
    int t = kiln_thread_index();
    wino_ctx c = j->base;
    c.U = j->U + (size_t)t * j->nU;
    c.M = j->M + (size_t)t * j->nM;
    for (int64_t bk = begin; bk < end; bk++) {
        set_block(&c, bk, j->kb);
        weight_fn(&c, 0, c.ns * ((c.C + 15) / 16));
        for (int64_t i = 0; i < j->n_img; i++) {
            c.V = j->V + (size_t)i * j->nV;
            c.y = j->y + i * c.K * c.yhw;
            gemms(&c);
            output_fn(&c, 0, c.kb);
        }
    }
}

AVX512 static void strip_task(void *vctx, int64_t begin, int64_t end)
{
    const job_ctx *j = vctx;
    int t = kiln_thread_index();
    wino_ctx c = j->base;
    c.V = j->V + (size_t)t * j->nV;
    c.M = j->M + (size_t)t * j->nM;
    c.blk = j->blk + (size_t)t * j->nB;
    for (int64_t st = begin; st < end; st++) {
        set_strip(&c, st, j->ts);
        for (int64_t tb = 0; tb < c.tp; tb += 16) blk_setup_init(&c, tb, &c.blk[tb / 16]);
        input_fn(&c, 0, c.C);
        if (c.u_bf16) v_pairs_fn(&c, 0, c.P);
        gemms(&c);
        output_fn(&c, 0, c.kb);
    }
}

/* F(6,3) where its 64 points per 6x6 tiles need clearly fewer multiply-adds than
 * F(4,3)'s 36 per 4x4 (not where the tiles' overhang at the edges eats the gain: a
 * 32x32 image needs the same either way) and the weights are small (the SD VAE's large
 * levels; README's speed section has the measurements). With more channels or on
 * smaller images F(6,3) gains nothing or loses: its GEMMs run at a lower rate than F(4,3)'s (a U 1.8x larger,
 * streamed from L3 once per strip) and its input transform costs 2x as much per tile.
 * KILN_WINOGRAD_TILE=4|6 forces one (tests, benchmarks). */
static int pick_tile(const kiln_conv2d_params *p)
{
    const char *e = kiln_tunable_str("KILN_WINOGRAD_TILE");
    if (e && (!strcmp(e, "4") || !strcmp(e, "6"))) return e[0] - '0';
    /* bf16: F(6,3)'s output transform (rows up to 32 at +-2) magnifies the rounding of
     * its tiles more than F(4,3)'s does, and no few points carry most of it */
    if (kiln_cpu_bf16_active()) return 4;
    double t4 = (double)((p->oh + 3) / 4) * (double)((p->ow + 3) / 4);
    double t6 = (double)((p->oh + 5) / 6) * (double)((p->ow + 5) / 6);
    int64_t ck = p->c * p->k;
    int small_w = ck <= 128 * 256 || (ck <= 256 * 256 && p->oh * p->ow >= 512 * 512);
    return 64.0 * t6 <= 0.9 * 36.0 * t4 && small_w ? 6 : 4;
}

/* One convolution through this path: F(m x m, r x r) over the tiles of p's output (oh x
 * ow), written to y as the output map says (up, py, px; rows of yw floats, planes of
 * yhw). 0 done, -1 out of scratch. */
typedef struct {
    int m, r, up, py, px;
    int64_t yw, yhw;
} wino_map;

/* The blocking of one run and the parts of its scratch buffer (floats); the run and
 * kiln_cpu_conv2d_winograd_scratch_bound size it with the same code. */
typedef struct {
    int64_t kb, ts, nkb, nstrip, n_img;
    int blocks_mode;
    size_t v_img, nU, nM, nW, nB, bsz, tot_U, tot_V, tot_B, total;
} wino_sizes;

static void wino_size(const kiln_conv2d_params *p, int m, int r, int threads, wino_sizes *z)
{
    const int A = m + r - 1, P = A * A;
    int64_t C = p->c, K = p->k;
    int64_t TH = (p->oh + m - 1) / m, TW = (p->ow + m - 1) / m, T = TH * TW;
    int64_t kb, ts;
    plan(C, K, T, P, &kb, &ts);
    int64_t nkb = (K + kb - 1) / kb, nstrip = (T + ts - 1) / ts;
    int blocks_mode = nstrip == 1 && nkb >= threads;
    if (!blocks_mode && nstrip % threads && T > 32) { /* strips in a multiple of the threads */
        int64_t want = (nstrip + threads - 1) / threads * threads;
        ts = ((T + want - 1) / want + 31) / 32 * 32;
        nstrip = (T + ts - 1) / ts;
    }
    /* images whose V is held at once (BLOCKS: every block task uses them all) */
    size_t v_img = (size_t)P * (size_t)(C * ts + 16);
    int64_t n_img = 1;
    if (blocks_mode) {
        n_img = (int64_t)(V_ONE_STRIP_BYTES * 2 / (v_img * sizeof(float)));
        if (n_img < 1) n_img = 1;
        if (n_img > p->n) n_img = p->n;
    }
    /* The P matrices of U, V and M sit one 64-byte line further apart than their size:
     * sizes are multiples of 4 KB, and P streams 4 KB apart would share one L1 set. */
    z->nU = (size_t)P * (size_t)((kb + 11) / 12 * 12 * C + 16);
    z->nM = (size_t)P * (size_t)(kb * ts + 16);
    z->nW = (size_t)threads * 12 * 144;
    z->nB = (size_t)(ts / 16);
    z->bsz = (sizeof(blk_setup) + 63) / 64 * 16; /* floats per entry, whole lines */
    z->tot_U = blocks_mode ? (size_t)threads * z->nU : z->nU;
    z->tot_V = blocks_mode ? (size_t)n_img * v_img : (size_t)threads * v_img;
    z->tot_B = (blocks_mode ? 1 : (size_t)threads) * z->nB * z->bsz;
    z->total = z->tot_U + z->tot_V + (size_t)threads * z->nM + z->nW + z->tot_B;
    z->kb = kb; z->ts = ts; z->nkb = nkb; z->nstrip = nstrip; z->n_img = n_img;
    z->blocks_mode = blocks_mode; z->v_img = v_img;
}

static int wino_run(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                    const kiln_conv2d_params *p, const wino_map *mp)
{
    const int m = mp->m, A = m + mp->r - 1, P = A * A;
    int64_t C = p->c, K = p->k;
    int64_t TH = (p->oh + m - 1) / m, TW = (p->ow + m - 1) / m;
    int threads = kiln_cpu_threads();
    wino_sizes z;
    wino_size(p, m, mp->r, threads, &z);
    int64_t kb = z.kb, ts = z.ts, nkb = z.nkb, nstrip = z.nstrip, n_img = z.n_img;
    int blocks_mode = z.blocks_mode;
    size_t v_img = z.v_img, nU = z.nU, nM = z.nM, nW = z.nW, nB = z.nB, bsz = z.bsz, tot_U = z.tot_U, tot_V = z.tot_V;
    float *buf = kiln_cpu_scratch_get(z.total * sizeof(float));
    if (!buf) return -1;
    job_ctx j;
    memset(&j, 0, sizeof j);
    wino_ctx *c = &j.base;
    c->p = p; c->w = w; c->w_dt = w_dtype; c->bias = bias; c->C = C; c->K = K; c->TW = TW; c->TH = TH;
    c->m = m; c->r = mp->r; c->a = A; c->P = P; c->nv = (int)((16 * m + mp->r - 1 + 15) / 16);
    c->up = mp->up; c->py = mp->py; c->px = mp->px; c->yw = mp->yw; c->yhw = mp->yhw;
    c->u_bf16 = kiln_cpu_bf16_active();
    j.kb = kb; j.ts = ts; j.nU = nU; j.nV = v_img; j.nM = nM; j.nB = nB * bsz * sizeof(float) / sizeof(blk_setup);
    j.U = buf; j.V = j.U + tot_U; j.M = j.V + tot_V; c->wbuf = j.M + (size_t)threads * nM;
    j.blk = (blk_setup *)(void *)(c->wbuf + nW); /* every part a multiple of 16 floats */
    c->blk = j.blk;
    const int64_t yimg = K * mp->yhw;
    if (blocks_mode) {
        set_strip(c, 0, ts);
        for (int64_t tb = 0; tb < c->tp; tb += 16) blk_setup_init(c, tb, &c->blk[tb / 16]);
        for (int64_t n0 = 0; n0 < p->n; n0 += n_img) {
            j.n_img = p->n - n0 < n_img ? p->n - n0 : n_img;
            j.x = x + n0 * C * p->h * p->w;
            j.y = y + n0 * yimg;
            for (int64_t i = 0; i < j.n_img; i++) {
                wino_ctx ci = *c;
                ci.x = j.x + i * C * p->h * p->w;
                ci.V = j.V + (size_t)i * v_img;
                kiln_parallel_for(C, 1, input_fn, &ci);
                if (ci.u_bf16) kiln_parallel_for(ci.P, 1, v_pairs_fn, &ci);
            }
            kiln_parallel_for(nkb, 1, block_task, &j);
        }
    } else {
        c->U = j.U;
        /* blocks outside images: each block's U is transformed once for the batch (a
         * CFG step is a batch of 2) */
        for (int64_t bk = 0; bk < nkb; bk++) {
            set_block(c, bk, kb);
            kiln_parallel_for(c->ns * ((C + 15) / 16), 1, weight_fn, c);
            for (int64_t n = 0; n < p->n; n++) {
                c->x = x + n * C * p->h * p->w;
                c->y = y + n * yimg;
                kiln_parallel_for(nstrip, 1, strip_task, &j);
            }
        }
    }
    kiln_cpu_scratch_put(buf);
    return 0;
}

int kiln_cpu_conv2d_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                             const kiln_conv2d_params *p, int forced)
{
    if (!kiln_cpu_gemm_have_simd()) return 1;
    if (p->r != 3 || p->s != 3 || p->stride_h != 1 || p->stride_w != 1 || p->dil_h != 1 || p->dil_w != 1 ||
        p->groups != 1)
        return 1;
    /* lane offsets are int32 */
    if (p->h * p->w >= ((int64_t)1 << 30) || p->oh * p->ow >= ((int64_t)1 << 30) || p->pad_h > 4 || p->pad_w > 4)
        return 1;
    int64_t T4 = ((p->oh + 3) / 4) * ((p->ow + 3) / 4);
    /* Against the implicit GEMM, Winograd wins from 16 tiles (a 16x16 image) and loses
     * at 9 (10x10); few channels are left to the GEMM (README: speed, path choices). */
    if (!forced && (p->c < 32 || p->k < 32 || T4 < 16)) return 1;
    wino_map mp = {pick_tile(p), 3, 0, 0, 0, p->ow, p->oh * p->ow};
    return wino_run(y, x, w, w_dtype, bias, p, &mp);
}

/* ---- nearest 2x upsampling and a 3x3 convolution (pad 1), fused ---- */

/* Output (2i + py, 2j + px) of the 3x3 kernel on the upsampled image reads input rows
 * i - 1 + py + a and columns j - 1 + px + b (a, b in {0, 1}) of x: a 2x2 kernel per
 * parity, whose taps sum those of the 3x3 kernel that land on the same input pixel
 * (rows: py = 0 takes {0} and {1, 2}, py = 1 takes {0, 1} and {2}; weight_tiles makes
 * them on the fly). Four 2x2 convolutions of the small image with F(4x4, 2x2): 25
 * products per 16 outputs instead of F(4x4, 3x3)'s 36 on the upsampled image, which is
 * never made (4x the input's memory). */
int kiln_cpu_conv2d_up2_fuses(int64_t C, int64_t H, int64_t W, int64_t K)
{
    /* Few channels go the plain way, as for the 3x3 path, and so do small images: with
     * fewer than 64 tiles a parity the unfused pair is faster (it runs on the few-tiles
     * path; README: speed, path choices). */
    return kiln_cpu_gemm_have_simd() && C >= 32 && K >= 32 && ((H + 3) / 4) * ((W + 3) / 4) >= 64 &&
           4 * H * W < ((int64_t)1 << 30);
}

int kiln_cpu_conv2d_up2_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                                 int64_t N, int64_t C, int64_t H, int64_t W, int64_t K)
{
    if (!kiln_cpu_conv2d_up2_fuses(C, H, W, K)) return 1;
    int rc = 0;
    for (int par = 0; par < 4 && rc == 0; par++) {
        int py = par / 2, px = par % 2;
        kiln_conv2d_params q = {N, C, H, W, K, 2, 2, 1, 1, 1 - py, 1 - px, 1, 1, 1, H, W, 0, 0.0f, NULL, NULL};
        wino_map mp = {4, 2, 1, py, px, 2 * W, 4 * H * W};
        rc = wino_run(y, x, w, w_dtype, bias, &q, &mp);
    }
    return rc;
}

/* The buffer this path asks for p (3x3, its tile pick) or for up2's parity runs (one
 * at a time); 0 where it declines the shape (forced: KILN_CONV_PATH names it). */
size_t kiln_cpu_conv2d_winograd_scratch(const kiln_conv2d_params *p, int up2, int forced)
{
    int threads = kiln_cpu_threads();
    wino_sizes z;
    if (!kiln_cpu_gemm_have_simd()) return 0;
    if (up2) {
        if (!kiln_cpu_conv2d_up2_fuses(p->c, p->h, p->w, p->k)) return 0;
        kiln_conv2d_params q = {p->n, p->c, p->h, p->w, p->k, 2, 2, 1, 1, 1, 1, 1, 1, 1, p->h, p->w, 0, 0.0f, NULL, NULL};
        wino_size(&q, 4, 2, threads, &z);
        return z.total * sizeof(float);
    }
    if (p->r != 3 || p->s != 3 || p->stride_h != 1 || p->stride_w != 1 || p->dil_h != 1 || p->dil_w != 1 ||
        p->groups != 1)
        return 0;
    if (p->h * p->w >= ((int64_t)1 << 30) || p->oh * p->ow >= ((int64_t)1 << 30) || p->pad_h > 4 || p->pad_w > 4)
        return 0;
    int64_t T4 = ((p->oh + 3) / 4) * ((p->ow + 3) / 4);
    if (!forced && (p->c < 32 || p->k < 32 || T4 < 16)) return 0;
    wino_size(p, pick_tile(p), 3, threads, &z);
    return z.total * sizeof(float);
}

#else
int kiln_cpu_conv2d_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                             const kiln_conv2d_params *p, int forced)
{
    (void)y; (void)x; (void)w; (void)w_dtype; (void)bias; (void)p; (void)forced;
    return 1;
}

int kiln_cpu_conv2d_up2_fuses(int64_t C, int64_t H, int64_t W, int64_t K)
{
    (void)C; (void)H; (void)W; (void)K;
    return 0;
}

int kiln_cpu_conv2d_up2_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                                 int64_t N, int64_t C, int64_t H, int64_t W, int64_t K)
{
    (void)y; (void)x; (void)w; (void)w_dtype; (void)bias; (void)N; (void)C; (void)H; (void)W; (void)K;
    return 1;
}

size_t kiln_cpu_conv2d_winograd_scratch(const kiln_conv2d_params *p, int up2, int forced)
{
    (void)p; (void)up2; (void)forced;
    return 0;
}
#endif
