/* conv2d_winograd.c - Winograd F(4x4, 3x3) for 3x3 stride-1 convolutions (AVX-512).
 * Y = A^T [ (G g G^T) . (B^T d B) ] A over 6x6 input tiles that give 4x4 outputs: the
 * channel sums become 36 independent GEMMs U[36][K][C] x V[36][C][tiles] (gemm.c) with
 * 4x fewer multiply-adds than the direct convolution. Scratch is bounded (about
 * 32 MB): output channels go in blocks and tiles in strips (see plan()). */
#define _GNU_SOURCE
#include "cpu_internal.h"
#include "threadpool.h"

#include <stdlib.h>
#include <string.h>


#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include "simd_transpose.h"
#include "winograd_transforms.h"
#define AVX512 __attribute__((target("avx512f")))

/* Lanes of a 16-tile block that lie in one tile row: [l0, l1), row ty, first column tx. */
typedef struct {
    int n;
    int l0[16], l1[16];
    int64_t ty[16], tx[16];
} tile_runs;

/* Where the input transform of one 16-tile block loads from (same for every channel). */
typedef struct {
    tile_runs runs;
    int64_t col0[16];             /* input column of float 4*l0 of each run's window */
    __mmask16 wm[16][5], zm[16][5]; /* window floats inside the image / covered by the run */
    __mmask16 fix, fcol4, fcol5;  /* lanes patched by a gather, and their valid columns 4, 5 */
    int32_t foff[16], fiy[16];    /* patched lanes: offset of row 0 column 4, and input row */
} blk_setup;

typedef struct wino_ctx {
    const kiln_conv2d_params *p;
    const float *x;             /* image n: [C, H, W] */
    float *y;                   /* image n: [K, OH, OW] */
    const void *w;
    kiln_dtype w_dt;
    const float *bias;
    int64_t C, K, TW, TH;       /* tiles per row and column of one image */
    int64_t t0, nt, tp;         /* strip: first tile, tiles, padded to 32 (row length of M) */
    int64_t k0, kb, ns;         /* block of output channels; ns = ceil(kb/12) slivers */
    int64_t su, sv, sm;         /* floats from one xi to the next in U, V, M */
    /* U[36][ns][C][12] and V[36][tp/32][C][32] in the GEMM's sliver layout (no packing
     * there); M[36][kb][tp] row-major */
    float *U, *V, *M;
    float *wbuf;                /* kiln_threads() x 12*144 floats: converted weights */
    blk_setup *blk;             /* tp/16 blocks of the strip */
} wino_ctx;

/* ---- weight transform: U[xi] = (G g G^T)[xi] for every (k, c), in A sliver layout ---- */



/* Task: one A sliver (output channels kk in [12s, 12s+12) of the block) times 16 input
 * channels from c0. The 12 weight rows (16 channels x 9 taps each) are transposed so a
 * vector holds one tap of the 12 outputs; vectors then pair 4 input channels x 12
 * outputs, so that for each xi three whole vectors fill U[xi][s][c0+cq .. +3][0..11]
 * (192 contiguous bytes): plain stores, no gathers, no partial lines. */
AVX512 static void weight_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    const int64_t C = c->C, chunks = (C + 15) / 16;
    const size_t esz = kiln_dtype_size(c->w_dt), su = (size_t)c->su;
    /* f32 weights are read in place (rows C*9 floats apart); f16/bf16 rows are converted
     * into buf first (rows 144 floats apart) */
    const int f32 = c->w_dt == KILN_F32;
    const int64_t rstride = f32 ? C * 9 : 144;
    float *buf = c->wbuf + (size_t)kiln_thread_index() * (12 * 144);
    __m512 tb[144]; /* tb[c*9 + e], lane k: tap e of input channel c0+c for output 12s+k */
    for (int64_t task = begin; task < end; task++) {
        int64_t sl = task / chunks, c0 = (task % chunks) * 16;
        int64_t cn = C - c0 < 16 ? C - c0 : 16, kk0 = 12 * sl, kn = c->kb - kk0 < 12 ? c->kb - kk0 : 12;
        const float *src = f32 ? (const float *)c->w + ((c->k0 + kk0) * C + c0) * 9 : buf;
        if (!f32)
            for (int64_t r = 0; r < kn; r++)
                kiln_to_f32(buf + r * 144, (const char *)c->w + (size_t)(((c->k0 + kk0 + r) * C + c0) * 9) * esz,
                            c->w_dt, (size_t)(cn * 9));
        for (int b = 0; b < 9; b++) { /* columns 16b .. 16b+15 of the 12 x (cn*9) rows */
            int64_t cols = cn * 9 - 16 * b;
            __mmask16 cm = cols >= 16 ? (__mmask16)0xffff : cols <= 0 ? 0 : (__mmask16)((1u << cols) - 1);
            __m512 r[16];
            for (int k = 0; k < 16; k++)
                r[k] = k < kn && cm ? _mm512_maskz_loadu_ps(cm, src + k * rstride + 16 * b) : _mm512_setzero_ps();
            transpose16(r);
            for (int m = 0; m < 16; m++) tb[16 * b + m] = r[m];
        }
        for (int64_t cq = 0; cq < cn; cq += 4) {
            __m512 u[3][36];
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
                __m512 t[3][6]; /* t[s][i] = (G g)[i][s] */
                for (int s3 = 0; s3 < 3; s3++) G_APPLY(gv[s3], gv[3 + s3], gv[6 + s3], t[s3]);
                for (int i = 0; i < 6; i++) {
                    __m512 o[6];
                    G_APPLY(t[0][i], t[1][i], t[2][i], o);
                    for (int j = 0; j < 6; j++) u[q][i * 6 + j] = o[j];
                }
            }
            float *dst = c->U + (sl * C + c0 + cq) * 12;
            if (cn - cq >= 4) {
                for (int xi = 0; xi < 36; xi++)
                    for (int q = 0; q < 3; q++) _mm512_storeu_ps(dst + xi * su + 16 * q, u[q][xi]);
            } else { /* channels past C: lanes whose element 16q + l belongs to channel >= cn - cq */
                int64_t valid = 12 * (cn - cq);
                for (int q = 0; q < 3; q++) {
                    int64_t v = valid - 16 * q;
                    __mmask16 mk = v >= 16 ? (__mmask16)0xffff : v <= 0 ? 0 : (__mmask16)((1u << v) - 1);
                    for (int xi = 0; xi < 36; xi++) _mm512_mask_storeu_ps(dst + xi * su + 16 * q, mk, u[q][xi]);
                }
            }
        }
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

/* Floats f in [lo, hi) of an 80-float (5-vector) window as 5 lane masks. */
static inline void window_masks(int64_t lo, int64_t hi, __mmask16 *m)
{
    for (int q = 0; q < 5; q++) {
        int64_t a = lo - 16 * q, b = hi - 16 * q;
        if (a < 0) a = 0;
        if (b > 16) b = 16;
        m[q] = a >= b ? 0 : (__mmask16)(((1u << b) - 1) & ~((1u << a) - 1));
    }
}

static void blk_setup_init(const wino_ctx *c, int64_t tb, blk_setup *bs)
{
    const kiln_conv2d_params *p = c->p;
    const int64_t W = p->w;
    tile_runs_init(c, tb, &bs->runs);
    const tile_runs *runs = &bs->runs;
    bs->fix = bs->fcol4 = bs->fcol5 = 0;
    for (int l = 0; l < 16; l++) bs->foff[l] = 0, bs->fiy[l] = -1000000;
    for (int r = 0; r < runs->n; r++) {
        if (runs->l1[r] < 16) { /* the last tile of this run has no next tile in the window */
            int l = runs->l1[r] - 1;
            int64_t iy = 4 * runs->ty[r] - p->pad_h, ix = 4 * (runs->tx[r] + l - runs->l0[r]) - p->pad_w + 4;
            bs->fix |= (__mmask16)(1u << l);
            if (ix >= 0 && ix < W) bs->fcol4 |= (__mmask16)(1u << l);
            if (ix + 1 >= 0 && ix + 1 < W) bs->fcol5 |= (__mmask16)(1u << l);
            bs->fiy[l] = (int32_t)iy;
            bs->foff[l] = (int32_t)(iy * W + ix);
        }
        bs->col0[r] = 4 * runs->tx[r] - p->pad_w;
        int64_t lo = 4 * runs->l0[r], hi = 4 * runs->l1[r] + 2;
        window_masks(lo, hi, bs->zm[r]);
        if (bs->col0[r] < 0) lo -= bs->col0[r];
        if (hi > 4 * runs->l0[r] + (W - bs->col0[r])) hi = 4 * runs->l0[r] + (W - bs->col0[r]);
        window_masks(lo, hi, bs->wm[r]);
    }
}

/* Reads the 6x6 input tiles of 16 lanes with contiguous loads: one input row of the
 * whole block is an 80-float window where tile l starts at float 4l, so columns
 * j = 0..3 come out of a 4-way de-interleave and j = 4, 5 are columns 0, 1 of the next
 * tile; the last tile of a run that does not end the block has no next tile and
 * is patched by a gather. Channels outer: each plane is read front to back. */
AVX512 static void input_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    const kiln_conv2d_params *p = c->p;
    const int64_t HW = p->h * p->w, W = p->w, H = p->h, C = c->C;
    /* input rows this strip reads: short runs per channel that the hardware prefetcher
     * does not see coming, so the next channel's rows are prefetched by hand */
    int64_t row0 = 4 * (c->t0 / c->TW) - p->pad_h, row1 = 4 * ((c->t0 + c->nt - 1) / c->TW) - p->pad_h + 6;
    if (row0 < 0) row0 = 0;
    if (row1 > H) row1 = H;
    for (int64_t ch = begin; ch < end; ch++) {
        const float *plane = c->x + ch * HW;
        if (ch + 1 < end && row1 > row0) {
            const char *a = (const char *)(plane + HW + row0 * W), *b = (const char *)(plane + HW + row1 * W);
            for (; a < b; a += 64) _mm_prefetch(a, _MM_HINT_T1);
        }
        for (int64_t tb = 0; tb < c->tp; tb += 16) {
            const blk_setup *bs = &c->blk[tb / 16];
            const tile_runs *rn = &bs->runs;
            __m512 tmp[6][6]; /* tmp[i][j'] = (d B)[i][j'] */
            for (int i = 0; i < 6; i++) {
                __m512 x[5];
                for (int q = 0; q < 5; q++) x[q] = _mm512_setzero_ps();
                for (int r = 0; r < rn->n; r++) {
                    int64_t iy = 4 * rn->ty[r] - p->pad_h + i;
                    if (r > 0)
                        for (int q = 0; q < 5; q++) x[q] = _mm512_mask_mov_ps(x[q], bs->zm[r][q], _mm512_setzero_ps());
                    if (iy < 0 || iy >= H) continue;
                    /* float f of the window is column col0 + f - 4 l0; masked-off lanes are never read */
                    const float *base = plane + iy * W + bs->col0[r] - 4 * rn->l0[r];
                    for (int q = 0; q < 5; q++)
                        if (bs->wm[r][q]) x[q] = _mm512_mask_loadu_ps(x[q], bs->wm[r][q], base + 16 * q);
                }
                /* de-interleave floats 4l + b of x[0..3] into e[b], lane l */
                __m512 v = _mm512_shuffle_f32x4(x[0], x[1], 0x88), w = _mm512_shuffle_f32x4(x[2], x[3], 0x88);
                __m512 v2 = _mm512_shuffle_f32x4(x[0], x[1], 0xDD), w2 = _mm512_shuffle_f32x4(x[2], x[3], 0xDD);
                __m512 q0 = _mm512_shuffle_f32x4(v, w, 0x88), q2 = _mm512_shuffle_f32x4(v, w, 0xDD);
                __m512 q1 = _mm512_shuffle_f32x4(v2, w2, 0x88), q3 = _mm512_shuffle_f32x4(v2, w2, 0xDD);
                __m512 t0 = _mm512_unpacklo_ps(q0, q1), t1 = _mm512_unpackhi_ps(q0, q1);
                __m512 t2 = _mm512_unpacklo_ps(q2, q3), t3 = _mm512_unpackhi_ps(q2, q3);
                __m512 e[6];
                e[0] = _mm512_shuffle_ps(t0, t2, 0x44);
                e[1] = _mm512_shuffle_ps(t0, t2, 0xEE);
                e[2] = _mm512_shuffle_ps(t1, t3, 0x44);
                e[3] = _mm512_shuffle_ps(t1, t3, 0xEE);
                __m512i x4 = _mm512_castps_si512(x[4]);
                e[4] = _mm512_castsi512_ps(_mm512_alignr_epi32(x4, _mm512_castps_si512(e[0]), 1));
                e[5] = _mm512_castsi512_ps(
                    _mm512_alignr_epi32(_mm512_alignr_epi32(x4, x4, 1), _mm512_castps_si512(e[1]), 1));
                if (bs->fix) {
                    __m512i ri = _mm512_add_epi32(_mm512_loadu_si512(bs->fiy), _mm512_set1_epi32(i));
                    __mmask16 rv = _mm512_cmpge_epi32_mask(ri, _mm512_setzero_si512()) &
                                   _mm512_cmplt_epi32_mask(ri, _mm512_set1_epi32((int)H));
                    __m512i o4 = _mm512_add_epi32(_mm512_loadu_si512(bs->foff), _mm512_set1_epi32((int)(i * W)));
                    e[4] = _mm512_mask_mov_ps(e[4], bs->fix, _mm512_setzero_ps());
                    e[5] = _mm512_mask_mov_ps(e[5], bs->fix, _mm512_setzero_ps());
                    e[4] = _mm512_mask_i32gather_ps(e[4], bs->fcol4 & rv, o4, plane, 4);
                    e[5] = _mm512_mask_i32gather_ps(e[5], bs->fcol5 & rv, _mm512_add_epi32(o4, _mm512_set1_epi32(1)),
                                                    plane, 4);
                }
                BT_APPLY(e, tmp[i]);
            }
            float *dst = c->V + ((tb / 32) * C + ch) * 32 + tb % 32;
            for (int j = 0; j < 6; j++) {
                __m512 d[6] = {tmp[0][j], tmp[1][j], tmp[2][j], tmp[3][j], tmp[4][j], tmp[5][j]}, vv[6];
                BT_APPLY(d, vv);
                for (int i = 0; i < 6; i++) _mm512_store_ps(dst + (size_t)(i * 6 + j) * (size_t)c->sv, vv[i]);
            }
        }
    }
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

/* Output channels outer: each plane is written front to back. */
AVX512 static void output_fn(void *vctx, int64_t begin, int64_t end)
{
    const wino_ctx *c = vctx;
    const kiln_conv2d_params *p = c->p;
    const int64_t OHW = p->oh * p->ow, OW = p->ow;
    int64_t row0 = 4 * (c->t0 / c->TW), row1 = 4 * ((c->t0 + c->nt - 1) / c->TW) + 4;
    if (row1 > p->oh) row1 = p->oh;
    for (int64_t kk = begin; kk < end; kk++) {
        int64_t k = c->k0 + kk;
        float *plane = c->y + k * OHW;
        __m512 bv = _mm512_set1_ps(c->bias ? c->bias[k] : 0.0f);
        if (kk + 1 < end) { /* the next plane's rows, for writing */
            const char *a = (const char *)(plane + OHW + row0 * OW), *b = (const char *)(plane + OHW + row1 * OW);
            for (; a < b; a += 64) __builtin_prefetch(a, 1, 2);
        }
        for (int64_t tb = 0; tb < c->tp; tb += 16) {
            const tile_runs *rn = &c->blk[tb / 16].runs;
            __m512 s[6][4]; /* s[j][a] = (A^T m)[a][j] */
            for (int j = 0; j < 6; j++) {
                __m512 m[6];
                for (int i = 0; i < 6; i++) m[i] = _mm512_load_ps(c->M + (i * 6 + j) * c->sm + kk * c->tp + tb);
                AT_APPLY(m, s[j]);
            }
            for (int a = 0; a < 4; a++) {
                __m512 m[6] = {s[0][a], s[1][a], s[2][a], s[3][a], s[4][a], s[5][a]}, o[4], r[4];
                AT_APPLY(m, o);
                for (int bb = 0; bb < 4; bb++) o[bb] = _mm512_add_ps(o[bb], bv);
                interleave4(o, r);
                for (int t = 0; t < rn->n; t++) {
                    int64_t oy = 4 * rn->ty[t] + a;
                    if (oy >= p->oh) continue;
                    /* float f of r (f in [4 l0, 4 l1)) goes to column 4 tx + f - 4 l0, if < OW */
                    int64_t f0 = 4 * rn->l0[t], f1 = 4 * rn->l1[t], lim = f0 + (OW - 4 * rn->tx[t]);
                    if (f1 > lim) f1 = lim;
                    uint64_t bits = (f1 >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << f1) - 1)) & ~(((uint64_t)1 << f0) - 1);
                    float *base = plane + oy * OW + 4 * rn->tx[t] - f0;
                    for (int q = 0; q < 4; q++) {
                        __mmask16 mk = (__mmask16)(bits >> (16 * q));
                        if (mk) _mm512_mask_storeu_ps(base + 16 * q, mk, r[q]);
                    }
                }
            }
        }
    }
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
enum { MIN_STRIP = 64 };

static int64_t channel_block(size_t bytes, int64_t C, int64_t K)
{
    int64_t k = (int64_t)((double)bytes / (36.0 * 4.0 * (double)C)) / 48 * 48;
    return k >= K ? K : k < 48 ? (K < 48 ? K : 48) : k;
}

static void plan(int64_t C, int64_t K, int64_t T, int64_t *kb, int64_t *ts)
{
    const double unit = 36.0 * 4.0;
    int64_t t32 = (T + 31) / 32 * 32;
    if (unit * (double)C * (double)t32 <= (double)V_ONE_STRIP_BYTES) {
        *ts = t32;
        *kb = channel_block(U_SMALL_BYTES, C, K);
        return;
    }
    *kb = channel_block(U_MAX_BYTES, C, K);
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
    kiln_cpu_gemm_prepacked(36, c->kb, c->nt, c->C, c->U, c->su, c->V, c->sv, c->M, c->tp, c->sm);
}

/* Two ways to share the work, so that each thread runs a whole pipeline (transforms
 * and GEMMs) on data in its own cache, with one pool job per image instead of four per
 * step:
 *  - BLOCKS (one strip): V of the images is transformed once, in parallel; then each
 *    task takes a block of output channels: its U, its 36 GEMMs, its output transform;
 *  - STRIPS: U of a block is transformed in parallel; then each task takes a strip of
 *    tiles: its V, its 36 GEMMs, its output transform. */
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
            c.y = j->y + i * c.K * c.p->oh * c.p->ow;
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
        gemms(&c);
        output_fn(&c, 0, c.kb);
    }
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
    int64_t C = p->c, K = p->k, TH = (p->oh + 3) / 4, TW = (p->ow + 3) / 4, T = TH * TW;
    /* Measured against the implicit GEMM on one core: Winograd wins from 16 tiles (a
     * 16x16 image: 1280 ch 42 vs 71 ms, 320 ch 2.3 vs 4.4 ms) and loses at 9 tiles
     * (10x10, 1280 ch: 43 vs 35 ms); few channels are left to the GEMM. */
    if (!forced && (C < 32 || K < 32 || T < 16)) return 1;
    int threads = kiln_threads();
    int64_t kb, ts;
    plan(C, K, T, &kb, &ts);
    int64_t nkb = (K + kb - 1) / kb, nstrip = (T + ts - 1) / ts;
    int blocks_mode = nstrip == 1 && nkb >= threads;
    if (!blocks_mode && nstrip % threads && T > 32) { /* strips in a multiple of the threads */
        int64_t want = (nstrip + threads - 1) / threads * threads;
        ts = ((T + want - 1) / want + 31) / 32 * 32;
        nstrip = (T + ts - 1) / ts;
    }
    /* images whose V is held at once (BLOCKS: every block task uses them all) */
    size_t v_img = (size_t)36 * (size_t)(C * ts + 16);
    int64_t n_img = 1;
    if (blocks_mode) {
        n_img = (int64_t)(V_ONE_STRIP_BYTES * 2 / (v_img * sizeof(float)));
        if (n_img < 1) n_img = 1;
        if (n_img > p->n) n_img = p->n;
    }
    /* The 36 matrices of U, V and M sit one 64-byte line further apart than their size:
     * sizes are multiples of 4 KB, and 36 streams 4 KB apart would share one L1 set. */
    size_t nU = (size_t)36 * (size_t)((kb + 11) / 12 * 12 * C + 16), nM = (size_t)36 * (size_t)(kb * ts + 16);
    size_t nW = (size_t)threads * 12 * 144;
    size_t nB = (size_t)(ts / 16), bsz = (sizeof(blk_setup) + 63) / 64 * 16; /* floats per entry, whole lines */
    size_t tot_U = blocks_mode ? (size_t)threads * nU : nU;
    size_t tot_V = blocks_mode ? (size_t)n_img * v_img : (size_t)threads * v_img;
    size_t tot_B = (blocks_mode ? 1 : (size_t)threads) * nB * bsz;
    float *buf = kiln_cpu_scratch_get((tot_U + tot_V + (size_t)threads * nM + nW + tot_B) * sizeof(float));
    if (!buf) return -1;
    job_ctx j;
    memset(&j, 0, sizeof j);
    wino_ctx *c = &j.base;
    c->p = p; c->w = w; c->w_dt = w_dtype; c->bias = bias; c->C = C; c->K = K; c->TW = TW; c->TH = TH;
    j.kb = kb; j.ts = ts; j.nU = nU; j.nV = v_img; j.nM = nM; j.nB = nB * bsz * sizeof(float) / sizeof(blk_setup);
    j.U = buf; j.V = j.U + tot_U; j.M = j.V + tot_V; c->wbuf = j.M + (size_t)threads * nM;
    j.blk = (blk_setup *)(void *)(c->wbuf + nW); /* every part a multiple of 16 floats */
    c->blk = j.blk;
    if (blocks_mode) {
        set_strip(c, 0, ts);
        for (int64_t tb = 0; tb < c->tp; tb += 16) blk_setup_init(c, tb, &c->blk[tb / 16]);
        for (int64_t n0 = 0; n0 < p->n; n0 += n_img) {
            j.n_img = p->n - n0 < n_img ? p->n - n0 : n_img;
            j.x = x + n0 * C * p->h * p->w;
            j.y = y + n0 * K * p->oh * p->ow;
            for (int64_t i = 0; i < j.n_img; i++) {
                wino_ctx ci = *c;
                ci.x = j.x + i * C * p->h * p->w;
                ci.V = j.V + (size_t)i * v_img;
                kiln_parallel_for(C, 1, input_fn, &ci);
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
                c->y = y + n * K * p->oh * p->ow;
                kiln_parallel_for(nstrip, 1, strip_task, &j);
            }
        }
    }
    kiln_cpu_scratch_put(buf);
    return 0;
}

#else
int kiln_cpu_conv2d_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                             const kiln_conv2d_params *p, int forced)
{
    (void)y; (void)x; (void)w; (void)w_dtype; (void)bias; (void)p; (void)forced;
    return 1;
}
#endif
