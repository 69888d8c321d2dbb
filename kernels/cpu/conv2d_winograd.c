/* conv2d_winograd.c - Winograd F(4x4, 3x3) for 3x3 stride-1 convolutions (AVX-512).
 * Y = A^T [ (G g G^T) . (B^T d B) ] A over 6x6 input tiles that give 4x4 outputs: the
 * channel sums become 36 independent GEMMs U[36][K][C] x V[36][C][tiles] (gemm.c) with
 * 4x fewer multiply-adds than the direct convolution. Scratch is bounded by
 * WINO_SCRATCH_BYTES: output channels go in blocks and tiles in strips when needed. */
#define _GNU_SOURCE
#include "cpu_kernels.h"
#include "threadpool.h"

#include <stdlib.h>
#include <string.h>

int kiln_cpu_conv2d_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                             const kiln_conv2d_params *p);
int kiln_cpu_gemm_have_simd(void);

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))

/* Upper bound of U (weights), V (input tiles) and M (products) together. */
static const size_t WINO_SCRATCH_BYTES = (size_t)48 << 20;

typedef struct {
    const kiln_conv2d_params *p;
    const float *x;             /* image n: [C, H, W] */
    float *y;                   /* image n: [K, OH, OW] */
    const void *w;
    kiln_dtype w_dt;
    const float *bias;
    int64_t C, K, TW, TH;       /* tiles per row and column of one image */
    int64_t t0, nt, tp;         /* strip: first tile, tiles, padded to 16 (row length of V and M) */
    int64_t k0, kb;             /* block of output channels */
    float *U, *V, *M;           /* [36][kb][C], [36][C][tp], [36][kb][tp] */
    float *wrow;                /* kiln_threads() x C*9 floats: one converted weight row */
} wino_ctx;

/* ---- weight transform: U[xi][k][c] = (G g G^T)[xi] ---- */

/* G (6x3) applied to the 3 values of one column, for 16 lanes. */
#define G_APPLY(g0, g1, g2, o)                                                                                  \
    do {                                                                                                        \
        __m512 s02 = _mm512_add_ps(g0, g2);                                                                     \
        o[0] = _mm512_mul_ps(g0, _mm512_set1_ps(0.25f));                                                        \
        o[1] = _mm512_mul_ps(_mm512_add_ps(s02, g1), _mm512_set1_ps(-1.0f / 6));                                \
        o[2] = _mm512_mul_ps(_mm512_sub_ps(s02, g1), _mm512_set1_ps(-1.0f / 6));                                \
        __m512 e = _mm512_fmadd_ps(g0, _mm512_set1_ps(1.0f / 24), _mm512_mul_ps(g2, _mm512_set1_ps(1.0f / 6))); \
        __m512 f = _mm512_mul_ps(g1, _mm512_set1_ps(1.0f / 12));                                                \
        o[3] = _mm512_add_ps(e, f);                                                                             \
        o[4] = _mm512_sub_ps(e, f);                                                                             \
        o[5] = g2;                                                                                              \
    } while (0)

AVX512 static void weight_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    const int64_t C = c->C;
    float *row = c->wrow + (size_t)kiln_thread_index() * (size_t)(C * 9);
    const __m512i idx9 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(9));
    for (int64_t kk = begin; kk < end; kk++) {
        int64_t k = c->k0 + kk;
        kiln_to_f32(row, (const char *)c->w + (size_t)(k * C * 9) * kiln_dtype_size(c->w_dt), c->w_dt, (size_t)(C * 9));
        for (int64_t c0 = 0; c0 < C; c0 += 16) {
            int cn = C - c0 < 16 ? (int)(C - c0) : 16;
            __mmask16 mk = cn == 16 ? (__mmask16)0xffff : (__mmask16)((1u << cn) - 1);
            __m512 g[9];
            for (int e = 0; e < 9; e++)
                g[e] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, idx9, row + c0 * 9 + e, 4);
            __m512 t[3][6]; /* t[s][i] = (G g)[i][s] */
            for (int s = 0; s < 3; s++) G_APPLY(g[s], g[3 + s], g[6 + s], t[s]);
            for (int i = 0; i < 6; i++) {
                __m512 u[6];
                G_APPLY(t[0][i], t[1][i], t[2][i], u);
                for (int j = 0; j < 6; j++)
                    _mm512_mask_storeu_ps(c->U + ((i * 6 + j) * c->kb + kk) * C + c0, mk, u[j]);
            }
        }
    }
}

/* ---- input transform: V[xi][c][t] = (B^T d B)[xi] ---- */

/* B^T (6x6) applied to 6 values, for 16 lanes. */
#define BT_APPLY(d, o)                                                                                          \
    do {                                                                                                        \
        __m512 four = _mm512_set1_ps(4.0f), five = _mm512_set1_ps(5.0f), two = _mm512_set1_ps(2.0f);             \
        o[0] = _mm512_add_ps(_mm512_fnmadd_ps(five, d[2], _mm512_mul_ps(four, d[0])), d[4]);                    \
        __m512 a = _mm512_fnmadd_ps(four, d[2], d[4]);   /* d4 - 4 d2 */                                        \
        __m512 b = _mm512_fnmadd_ps(four, d[1], d[3]);   /* d3 - 4 d1 */                                        \
        o[1] = _mm512_add_ps(a, b);                                                                             \
        o[2] = _mm512_sub_ps(a, b);                                                                             \
        __m512 e = _mm512_sub_ps(d[4], d[2]);                                                                   \
        __m512 f = _mm512_mul_ps(two, _mm512_sub_ps(d[3], d[1]));                                               \
        o[3] = _mm512_add_ps(e, f);                                                                             \
        o[4] = _mm512_sub_ps(e, f);                                                                             \
        o[5] = _mm512_add_ps(_mm512_fnmadd_ps(five, d[3], _mm512_mul_ps(four, d[1])), d[5]);                    \
    } while (0)

/* Lane offsets and masks of 16 tiles: tile t reads rows 4ty-pad+i, columns 4tx-pad+j. */
typedef struct {
    __m512i off;                /* (4ty - pad_h) * W + 4tx - pad_w */
    __mmask16 row[6], col[6];   /* lanes whose row i / column j lies inside the image */
} in_block;

AVX512 static void in_block_init(const wino_ctx *c, int64_t t_first, in_block *b)
{
    const kiln_conv2d_params *p = c->p;
    int32_t off[16], iy[16], ix[16];
    __mmask16 valid = 0;
    for (int l = 0; l < 16; l++) {
        int64_t t = t_first + l;
        iy[l] = ix[l] = -1000000;
        off[l] = 0;
        if (t < c->t0 + c->nt) {
            valid |= (__mmask16)(1u << l);
            iy[l] = (int32_t)(4 * (t / c->TW) - p->pad_h);
            ix[l] = (int32_t)(4 * (t % c->TW) - p->pad_w);
            off[l] = (int32_t)(iy[l] * p->w + ix[l]);
        }
    }
    b->off = _mm512_loadu_si512(off);
    __m512i viy = _mm512_loadu_si512(iy), vix = _mm512_loadu_si512(ix);
    for (int i = 0; i < 6; i++) {
        __m512i r = _mm512_add_epi32(viy, _mm512_set1_epi32(i)), q = _mm512_add_epi32(vix, _mm512_set1_epi32(i));
        b->row[i] = valid & _mm512_cmpge_epi32_mask(r, _mm512_setzero_si512()) &
                    _mm512_cmplt_epi32_mask(r, _mm512_set1_epi32((int)p->h));
        b->col[i] = valid & _mm512_cmpge_epi32_mask(q, _mm512_setzero_si512()) &
                    _mm512_cmplt_epi32_mask(q, _mm512_set1_epi32((int)p->w));
    }
}

AVX512 static void input_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    const int64_t HW = c->p->h * c->p->w, W = c->p->w;
    for (int64_t ch = begin; ch < end; ch++) {
        const float *plane = c->x + ch * HW;
        for (int64_t tb = 0; tb < c->tp; tb += 16) {
            in_block b;
            in_block_init(c, c->t0 + tb, &b);
            __m512 t[6][6]; /* t[j][i] = (B^T d)[i][j] */
            for (int j = 0; j < 6; j++) {
                __m512 d[6];
                for (int i = 0; i < 6; i++) {
                    __mmask16 mk = b.row[i] & b.col[j];
                    d[i] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk,
                                                    _mm512_add_epi32(b.off, _mm512_set1_epi32((int)(i * W + j))),
                                                    plane, 4);
                }
                BT_APPLY(d, t[j]);
            }
            for (int i = 0; i < 6; i++) {
                __m512 d[6] = {t[0][i], t[1][i], t[2][i], t[3][i], t[4][i], t[5][i]}, v[6];
                BT_APPLY(d, v);
                for (int j = 0; j < 6; j++) _mm512_store_ps(c->V + ((i * 6 + j) * c->C + ch) * c->tp + tb, v[j]);
            }
        }
    }
}

/* ---- output transform: y = A^T m A (+ bias) ---- */

/* A^T (4x6) applied to 6 values, for 16 lanes. */
#define AT_APPLY(m, o)                                                                                          \
    do {                                                                                                        \
        __m512 s12 = _mm512_add_ps(m[1], m[2]), d12 = _mm512_sub_ps(m[1], m[2]);                                \
        __m512 s34 = _mm512_add_ps(m[3], m[4]), d34 = _mm512_sub_ps(m[3], m[4]);                                \
        o[0] = _mm512_add_ps(_mm512_add_ps(m[0], s12), s34);                                                    \
        o[1] = _mm512_fmadd_ps(_mm512_set1_ps(2.0f), d34, d12);                                                 \
        o[2] = _mm512_fmadd_ps(_mm512_set1_ps(4.0f), s34, s12);                                                 \
        o[3] = _mm512_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(8.0f), d34, d12), m[5]);                            \
    } while (0)

AVX512 static void output_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    const kiln_conv2d_params *p = c->p;
    const int64_t OHW = p->oh * p->ow, OW = p->ow;
    for (int64_t tb = 0; tb < c->tp; tb += 16) {
        /* lanes: output offsets and row/column masks of the 4x4 tiles */
        int32_t off[16], oy[16], ox[16];
        __mmask16 valid = 0;
        for (int l = 0; l < 16; l++) {
            int64_t t = c->t0 + tb + l;
            oy[l] = ox[l] = 1 << 30;
            off[l] = 0;
            if (t < c->t0 + c->nt) {
                valid |= (__mmask16)(1u << l);
                oy[l] = (int32_t)(4 * (t / c->TW));
                ox[l] = (int32_t)(4 * (t % c->TW));
                off[l] = (int32_t)(oy[l] * OW + ox[l]);
            }
        }
        __m512i voff = _mm512_loadu_si512(off), voy = _mm512_loadu_si512(oy), vox = _mm512_loadu_si512(ox);
        __mmask16 rowm[4], colm[4];
        for (int a = 0; a < 4; a++) {
            rowm[a] = valid & _mm512_cmplt_epi32_mask(_mm512_add_epi32(voy, _mm512_set1_epi32(a)),
                                                      _mm512_set1_epi32((int)p->oh));
            colm[a] = valid & _mm512_cmplt_epi32_mask(_mm512_add_epi32(vox, _mm512_set1_epi32(a)),
                                                      _mm512_set1_epi32((int)p->ow));
        }
        for (int64_t kk = begin; kk < end; kk++) {
            int64_t k = c->k0 + kk;
            float *plane = c->y + k * OHW;
            __m512 bv = _mm512_set1_ps(c->bias ? c->bias[k] : 0.0f);
            __m512 s[6][4]; /* s[j][a] = (A^T m)[a][j] */
            for (int j = 0; j < 6; j++) {
                __m512 m[6];
                for (int i = 0; i < 6; i++) m[i] = _mm512_load_ps(c->M + ((i * 6 + j) * c->kb + kk) * c->tp + tb);
                AT_APPLY(m, s[j]);
            }
            for (int a = 0; a < 4; a++) {
                __m512 m[6] = {s[0][a], s[1][a], s[2][a], s[3][a], s[4][a], s[5][a]}, o[4];
                AT_APPLY(m, o);
                for (int bb = 0; bb < 4; bb++) {
                    __mmask16 mk = rowm[a] & colm[bb];
                    __m512i idx = _mm512_add_epi32(voff, _mm512_set1_epi32((int)(a * OW + bb)));
                    _mm512_mask_i32scatter_ps(plane, mk, idx, _mm512_add_ps(o[bb], bv), 4);
                }
            }
        }
    }
}


/* Plans the blocking; returns 0 and fills kb, tp (strip tiles, multiple of 16), or -1. */
static int plan(int64_t C, int64_t K, int64_t T, int64_t *kb, int64_t *ts)
{
    const double unit = 36.0 * 4.0, budget = (double)WINO_SCRATCH_BYTES;
    int64_t t16 = (T + 15) / 16 * 16;
    /* everything at once */
    if (unit * ((double)K * C + (double)C * t16 + (double)K * t16) <= budget) {
        *kb = K; *ts = t16;
        return 0;
    }
    /* all weights at once, tiles in strips */
    if (unit * (double)K * C <= budget / 2) {
        double per_tile = unit * (double)(C + K);
        int64_t t = (int64_t)((budget - unit * (double)K * C) / per_tile) / 16 * 16;
        if (t >= 16) { *kb = K; *ts = t; return 0; }
    }
    /* all tiles at once, output channels in blocks */
    if (unit * (double)C * t16 <= budget / 2) {
        int64_t k = (int64_t)((budget - unit * (double)C * t16) / (unit * (double)(C + t16)));
        if (k >= 16) { *kb = k / 12 * 12; *ts = t16; return 0; }
    }
    /* both: a quarter of the budget for weights, the rest for tiles */
    int64_t k = (int64_t)(budget / 4 / (unit * (double)C)) / 12 * 12;
    if (k < 12) return -1;
    if (k > K) k = K;
    int64_t t = (int64_t)((budget - unit * (double)k * C) / (unit * (double)(C + k))) / 16 * 16;
    if (t < 16) return -1;
    *kb = k; *ts = t;
    return 0;
}


int kiln_cpu_conv2d_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                             const kiln_conv2d_params *p)
{
    if (!kiln_cpu_gemm_have_simd()) return 1;
    if (p->r != 3 || p->s != 3 || p->stride_h != 1 || p->stride_w != 1 || p->dil_h != 1 || p->dil_w != 1 ||
        p->groups != 1)
        return 1;
    /* lane offsets are int32 */
    if (p->h * p->w >= ((int64_t)1 << 30) || p->oh * p->ow >= ((int64_t)1 << 30) || p->pad_h > 4 || p->pad_w > 4)
        return 1;
    const char *force = getenv("KILN_CONV_PATH");
    int forced = force && !strcmp(force, "winograd");
    int64_t C = p->c, K = p->k, TH = (p->oh + 3) / 4, TW = (p->ow + 3) / 4, T = TH * TW;
    /* Measured (tests/bench): below these the GEMM is too thin for the transforms to pay. */
    if (!forced && (C < 32 || K < 32 || T < 16)) return 1;
    int64_t kb, ts;
    if (plan(C, K, T, &kb, &ts)) return 1;
    if (ts > (T + 15) / 16 * 16) ts = (T + 15) / 16 * 16;
    int threads = kiln_threads();
    /* each part starts on a 64-byte line (V and M are read and written aligned) */
    size_t nU = (size_t)(36 * kb * C + 15) / 16 * 16, nV = (size_t)(36 * C * ts), nM = (size_t)(36 * kb * ts);
    size_t nrow = (size_t)threads * (size_t)(C * 9);
    float *buf = aligned_alloc(64, ((nU + nV + nM + nrow) * sizeof(float) + 63) / 64 * 64);
    if (!buf) return -1;
    wino_ctx c = {0};
    c.p = p; c.w = w; c.w_dt = w_dtype; c.bias = bias; c.C = C; c.K = K; c.TW = TW; c.TH = TH;
    c.U = buf; c.V = buf + nU; c.M = c.V + nV; c.wrow = c.M + nM;
    int64_t nkb = (K + kb - 1) / kb, nstrip = (T + ts - 1) / ts;
    /* Loop order: with one block of channels the weights are transformed once; with one
     * strip the tiles are. Otherwise the tiles are transformed again per block. */
    for (int64_t n = 0; n < p->n; n++) {
        c.x = x + n * C * p->h * p->w;
        c.y = y + n * K * p->oh * p->ow;
        for (int64_t bk = 0; bk < nkb; bk++) {
            c.k0 = bk * kb;
            c.kb = K - c.k0 < kb ? K - c.k0 : kb;
            /* U depends only on the block: transform it for the first image and strip */
            int need_u = nkb > 1 || n == 0;
            if (need_u) kiln_parallel_for(c.kb, 1, weight_fn, &c);
            for (int64_t st = 0; st < nstrip; st++) {
                c.t0 = st * ts;
                c.nt = T - c.t0 < ts ? T - c.t0 : ts;
                c.tp = (c.nt + 15) / 16 * 16;
                if (nkb == 1 || nstrip > 1 || bk == 0) kiln_parallel_for(C, 1, input_fn, &c);
                kiln_cpu_gemm_batched_f32(0, 0, 36, c.kb, c.tp, C, 1.0f, c.U, C, c.kb * C, c.V, c.tp, C * c.tp, 0.0f,
                                          c.M, c.tp, c.kb * c.tp);
                kiln_parallel_for(c.kb, 1, output_fn, &c);
            }
        }
    }
    free(buf);
    return 0;
}

#else
int kiln_cpu_conv2d_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                             const kiln_conv2d_params *p)
{
    (void)y; (void)x; (void)w; (void)w_dtype; (void)bias; (void)p;
    return 1;
}
#endif
