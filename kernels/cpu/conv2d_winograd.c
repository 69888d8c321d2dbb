/* conv2d_winograd.c - Winograd F(4x4, 3x3) for 3x3 stride-1 convolutions (AVX-512).
 * Y = A^T [ (G g G^T) . (B^T d B) ] A over 6x6 input tiles that give 4x4 outputs: the
 * channel sums become 36 independent GEMMs U[36][K][C] x V[36][C][tiles] (gemm.c) with
 * 4x fewer multiply-adds than the direct convolution. Scratch is bounded (about
 * 32 MB): output channels go in blocks and tiles in strips (see plan()). */
#define _GNU_SOURCE
#include "cpu_kernels.h"
#include "threadpool.h"

#include <stdlib.h>
#include <string.h>

int kiln_cpu_conv2d_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                             const kiln_conv2d_params *p);
int kiln_cpu_gemm_have_simd(void);
void *kiln_cpu_scratch_get(size_t bytes);
void kiln_cpu_scratch_put(void *p);

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))

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

AVX512 static void output_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    const kiln_conv2d_params *p = c->p;
    const int64_t OHW = p->oh * p->ow, OW = p->ow;
    for (int64_t tb = 0; tb < c->tp; tb += 16) {
        /* runs of lanes (tiles) that lie in one tile row: lanes [l0, l1), row ty, first tx */
        int run_l0[16], run_l1[16], nr = 0;
        int64_t run_ty[16], run_tx[16];
        for (int l = 0; l < 16;) {
            int64_t t = c->t0 + tb + l;
            if (t >= c->t0 + c->nt) break;
            int64_t ty = t / c->TW, tx = t % c->TW;
            int len = c->TW - tx < 16 - l ? (int)(c->TW - tx) : 16 - l;
            if (t + len > c->t0 + c->nt) len = (int)(c->t0 + c->nt - t);
            run_l0[nr] = l; run_l1[nr] = l + len; run_ty[nr] = ty; run_tx[nr] = tx;
            nr++;
            l += len;
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
                __m512 m[6] = {s[0][a], s[1][a], s[2][a], s[3][a], s[4][a], s[5][a]}, o[4], r[4];
                AT_APPLY(m, o);
                for (int bb = 0; bb < 4; bb++) o[bb] = _mm512_add_ps(o[bb], bv);
                interleave4(o, r);
                for (int t = 0; t < nr; t++) {
                    int64_t oy = 4 * run_ty[t] + a;
                    if (oy >= p->oh) continue;
                    /* float f of r (f in [4 l0, 4 l1)) goes to column 4 tx + f - 4 l0, if < OW */
                    int64_t f0 = 4 * run_l0[t], f1 = 4 * run_l1[t], lim = f0 + (OW - 4 * run_tx[t]);
                    if (f1 > lim) f1 = lim;
                    uint64_t bits = (f1 >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << f1) - 1)) & ~(((uint64_t)1 << f0) - 1);
                    float *base = plane + oy * OW + 4 * run_tx[t] - f0;
                    for (int q = 0; q < 4; q++) {
                        __mmask16 mk = (__mmask16)(bits >> (16 * q));
                        if (mk) _mm512_mask_storeu_ps(base + 16 * q, mk, r[q]);
                    }
                }
            }
        }
    }
}

/* Blocking: output channels in blocks of kb (U = 36*kb*C floats <= U_MAX_BYTES) and
 * tiles in strips of ts (V + M <= STRIP_MAX_BYTES, about what L2 + L3 hold). */
static const size_t U_MAX_BYTES = (size_t)24 << 20, STRIP_MAX_BYTES = (size_t)8 << 20;

static void plan(int64_t C, int64_t K, int64_t T, int64_t *kb, int64_t *ts)
{
    const double unit = 36.0 * 4.0;
    int64_t k = (int64_t)((double)U_MAX_BYTES / (unit * (double)C));
    *kb = k >= K ? K : (k / 12 * 12 < 12 ? 12 : k / 12 * 12);
    int64_t t = (int64_t)((double)STRIP_MAX_BYTES / (unit * (double)(C + *kb))) / 16 * 16;
    int64_t t16 = (T + 15) / 16 * 16;
    *ts = t < 16 ? 16 : t > t16 ? t16 : t;
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
    plan(C, K, T, &kb, &ts);
    int threads = kiln_threads();
    /* each part starts on a 64-byte line (V and M are read and written aligned) */
    size_t nU = (size_t)(36 * kb * C + 15) / 16 * 16, nV = (size_t)(36 * C * ts), nM = (size_t)(36 * kb * ts);
    size_t nrow = (size_t)threads * (size_t)(C * 9);
    float *buf = kiln_cpu_scratch_get((nU + nV + nM + nrow) * sizeof(float));
    if (!buf) return -1;
    wino_ctx c = {0};
    c.p = p; c.w = w; c.w_dt = w_dtype; c.bias = bias; c.C = C; c.K = K; c.TW = TW; c.TH = TH;
    c.U = buf; c.V = buf + nU; c.M = c.V + nV; c.wrow = c.M + nM;
    int64_t nkb = (K + kb - 1) / kb, nstrip = (T + ts - 1) / ts;
    /* With several blocks and several strips one of the transforms is repeated: the
     * tiles once per block (blocks outer) or the weights once per strip (strips outer),
     * whichever costs less (a tile transform is about 3x a weight transform per pair). */
    int strips_outer = nkb > 1 && nstrip > 1 && 3 * nkb * T > nstrip * K;
    for (int64_t n = 0; n < p->n; n++) {
        c.x = x + n * C * p->h * p->w;
        c.y = y + n * K * p->oh * p->ow;
        int64_t n_outer = strips_outer ? nstrip : nkb, n_inner = strips_outer ? nkb : nstrip;
        for (int64_t o = 0; o < n_outer; o++)
            for (int64_t i = 0; i < n_inner; i++) {
                int64_t bk = strips_outer ? i : o, st = strips_outer ? o : i;
                c.k0 = bk * kb;
                c.kb = K - c.k0 < kb ? K - c.k0 : kb;
                c.t0 = st * ts;
                c.nt = T - c.t0 < ts ? T - c.t0 : ts;
                c.tp = (c.nt + 15) / 16 * 16;
                /* U is kept while the block stays (one block: for every image) */
                int need_u = nkb == 1 ? n == 0 && st == 0 : strips_outer || st == 0;
                /* V is kept while the strip stays */
                int need_v = nstrip == 1 ? bk == 0 : !strips_outer || bk == 0;
                if (need_u) kiln_parallel_for(c.kb, 1, weight_fn, &c);
                if (need_v) kiln_parallel_for(C, 1, input_fn, &c);
                kiln_cpu_gemm_batched_f32(0, 0, 36, c.kb, c.tp, C, 1.0f, c.U, C, c.kb * C, c.V, c.tp, C * c.tp, 0.0f,
                                          c.M, c.tp, c.kb * c.tp);
                kiln_parallel_for(c.kb, 1, output_fn, &c);
            }
    }
    kiln_cpu_scratch_put(buf);
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
