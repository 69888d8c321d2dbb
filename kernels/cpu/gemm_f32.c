/* gemm_f32.c - the packed, cache-blocked AVX-512 kernel of the f32 products: packing of A
 * and B (f32, f16, bf16, fp8 and ggml's block types converted on the way), the
 * microkernels and the loop over one block of C (kiln_cpu_gemm_run_block). gemm.c splits products
 * into blocks and runs them on the pool; gemm_bf16.c has the bf16 form. */
#define _GNU_SOURCE
#include "gemm_internal.h"

#include <math.h>

#ifdef GEMM_X86

static inline float elem_f32(const void *base, kiln_dtype dt, int64_t idx)
{
    if (dt == KILN_F32) return ((const float *)base)[idx];
    if (dt == KILN_F16) return kiln_f16_to_f32(((const uint16_t *)base)[idx]);
    return kiln_bf16_to_f32(((const uint16_t *)base)[idx]);
}

/* Packs rows [i0, i0+m) x depth [k0, k0+kc) of op(A) into ap[k][MR] (rows past m zero). */
void kiln_cpu_gemm_pack_a(float *restrict ap, const gemm_args *g, int64_t i0, int m, int64_t k0, int64_t kc)
{
    if (g->trans_a) { /* op(A)[i][k] = A[k][i]: rows of A are contiguous in i */
        for (int64_t k = 0; k < kc; k++) {
            float *dst = ap + k * MR;
            int r = 0;
            for (; r < m; r++) dst[r] = elem_f32(g->A, g->a_dt, (k0 + k) * g->lda + i0 + r);
            for (; r < MR; r++) dst[r] = 0.0f;
        }
    } else if (g->a_dt == KILN_F32) {
        for (int r = 0; r < MR; r++) {
            if (r < m) {
                const float *src = (const float *)g->A + (i0 + r) * g->lda + k0;
                for (int64_t k = 0; k < kc; k++) ap[k * MR + r] = src[k];
            } else {
                for (int64_t k = 0; k < kc; k++) ap[k * MR + r] = 0.0f;
            }
        }
    } else {
        float row[KC];
        for (int r = 0; r < MR; r++) {
            if (r < m) kiln_to_f32(row, (const char *)g->A + (size_t)((i0 + r) * g->lda + k0) * 2, g->a_dt, (size_t)kc);
            for (int64_t k = 0; k < kc; k++) ap[k * MR + r] = r < m ? row[k] : 0.0f;
        }
    }
}

/* pack_a for a row-major A (f32/f16/bf16): 12 rows x 16 depths at a time, converted
 * on load and transposed in registers, then 16 stores of 12 floats - instead of one
 * scalar store per element (which made an f16 weight matrix cost half again as much
 * as an f32 one in skinny products such as a 1280-channel 3x3 convolution at 8x8). */
AVX512 static void pack_a_rows(float *restrict ap, const gemm_args *g, int64_t i0, int m, int64_t k0, int64_t kc)
{
    size_t esz = kiln_dtype_size(g->a_dt);
    for (int64_t kk = 0; kk < kc; kk += 16) {
        int n = kc - kk < 16 ? (int)(kc - kk) : 16;
        __m512 r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < m ? load16((const char *)g->A + (size_t)((i0 + i) * g->lda + k0 + kk) * esz, g->a_dt, n)
                         : _mm512_setzero_ps();
        transpose16(r);
        for (int j = 0; j < n; j++) _mm512_mask_storeu_ps(ap + (kk + j) * MR, (__mmask16)((1u << MR) - 1), r[j]);
    }
}

/* 16 elements (n <= 16 valid, rest zero) of a q8_0 / fp8 row from element k, k a
 * multiple of 16 (so they lie in one q8_0 block), converted in registers: the same
 * values as the scalar decoding (float(q) * d; fp8 through its exact f16 form). */
AVX512 static inline __m512 load16_direct(const char *row, kiln_dtype dt, int64_t k, int n)
{
    if (n <= 0) return _mm512_setzero_ps();
    const uint8_t *src = dt == KILN_Q8_0 ? (const uint8_t *)row + (k / 32) * 34 + 2 + k % 32 : (const uint8_t *)row + k;
    __m128i v;
    if (n == 16) {
        v = _mm_loadu_si128((const __m128i *)src);
    } else {
        uint8_t b[16] = {0};
        memcpy(b, src, (size_t)n);
        v = _mm_loadu_si128((const __m128i *)b);
    }
    if (dt == KILN_Q8_0) {
        const uint8_t *blk = (const uint8_t *)row + (k / 32) * 34;
        float d = kiln_f16_to_f32((uint16_t)(blk[0] | blk[1] << 8));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), _mm512_set1_ps(d));
    }
    __m512i w = _mm512_cvtepu8_epi32(v);
    if (dt == KILN_F8_E5M2) /* the upper byte of an f16 */
        return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(w, 8)));
    /* e4m3fn: its exponent and mantissa bits placed in an f16 read 2^-8 times the value
     * (subnormals included); the sign goes to the f16's; S.1111.111 is nan */
    __m512i mag = _mm512_and_si512(w, _mm512_set1_epi32(0x7f));
    __m512i h = _mm512_or_si512(_mm512_slli_epi32(mag, 7), _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x80)), 8));
    __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_set1_ps(256.0f));
    __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f));
    return _mm512_mask_blend_ps(nan, f, _mm512_set1_ps(NAN));
}

/* pack_b for a low-bit B (fp8, ggml's block types; rows of W as trans_b, the linear
 * case): each sliver's rows are decoded over the whole blocks that cover [k0, k0+kc)
 * into a buffer on the stack, then transposed 16 x 16 in registers as f32 rows are. */
AVX512 static void pack_b_lowbit(float *restrict bp, const gemm_args *g, int64_t j0, int64_t n, int64_t k0, int64_t kc)
{
    if (g->b_dt == KILN_Q8_0 || g->b_dt == KILN_F8_E4M3FN || g->b_dt == KILN_F8_E5M2) {
        size_t row_bytes = kiln_dtype_nbytes(g->b_dt, g->ldb);
        for (int64_t js = 0; js < n; js += NR) {
            int nn = n - js < NR ? (int)(n - js) : NR;
            float *dst = bp + (js / NR) * kc * NR;
            for (int half = 0; half < 2; half++) {
                int jn = nn - half * 16;
                for (int64_t kb = 0; kb < kc; kb += 16) {
                    int kn = kc - kb < 16 ? (int)(kc - kb) : 16;
                    __m512 r[16];
                    for (int jj = 0; jj < 16; jj++)
                        r[jj] = jj < jn ? load16_direct((const char *)g->B + (size_t)(j0 + js + half * 16 + jj) * row_bytes,
                                                        g->b_dt, k0 + kb, kn)
                                        : _mm512_setzero_ps();
                    transpose16(r);
                    for (int kk = 0; kk < kn; kk++) _mm512_store_ps(dst + (kb + kk) * NR + half * 16, r[kk]);
                }
            }
        }
        return;
    }
    enum { SPAN = KC + 2 * 256 };
    float rows[NR][SPAN] __attribute__((aligned(64)));
    int64_t blk = kiln_dtype_block(g->b_dt), kb0 = k0 / blk * blk, kb1 = (k0 + kc + blk - 1) / blk * blk;
    const char *B = g->B;
    for (int64_t js = 0; js < n; js += NR) {
        int nn = n - js < NR ? (int)(n - js) : NR;
        float *dst = bp + (js / NR) * kc * NR;
        for (int jj = 0; jj < nn; jj++)
            kiln_to_f32(rows[jj], B + kiln_dtype_nbytes(g->b_dt, (j0 + js + jj) * g->ldb + kb0), g->b_dt,
                        (size_t)(kb1 - kb0));
        for (int half = 0; half < 2; half++) {
            int jn = nn - half * 16;
            for (int64_t kb = 0; kb < kc; kb += 16) {
                int kn = kc - kb < 16 ? (int)(kc - kb) : 16;
                __m512 r[16];
                for (int jj = 0; jj < 16; jj++)
                    r[jj] = jj < jn ? load16(&rows[half * 16 + jj][k0 - kb0 + kb], KILN_F32, kn) : _mm512_setzero_ps();
                transpose16(r);
                for (int kk = 0; kk < kn; kk++) _mm512_store_ps(dst + (kb + kk) * NR + half * 16, r[kk]);
            }
        }
    }
}

/* Packs columns [j0, j0+n) x depth [k0, k0+kc) of op(B) into bp[k][NR] slivers of
 * NR columns each (columns past n zero), converting f16/bf16 to f32 on the way. */
AVX512 void kiln_cpu_gemm_pack_b(float *restrict bp, const gemm_args *g, int64_t j0, int64_t n, int64_t k0, int64_t kc)
{
    if (g->pack_b) {
        g->pack_b(g->pack_ctx, bp, j0, n, k0, kc);
        return;
    }
    if (lowbit_dt(g->b_dt)) {
        pack_b_lowbit(bp, g, j0, n, k0, kc);
        return;
    }
    size_t esz = kiln_dtype_size(g->b_dt);
    const char *B = g->B;
    for (int64_t js = 0; js < n; js += NR) {
        int nn = n - js < NR ? (int)(n - js) : NR;
        float *dst = bp + (js / NR) * kc * NR;
        if (!g->trans_b) { /* row k of B holds the columns contiguously */
            for (int64_t k = 0; k < kc; k++) {
                const char *src = B + (size_t)((k0 + k) * g->ldb + j0 + js) * esz;
                _mm512_store_ps(dst + k * NR, load16(src, g->b_dt, nn));
                _mm512_store_ps(dst + k * NR + 16, load16(src + 16 * esz, g->b_dt, nn - 16));
            }
        } else { /* op(B)[k][j] = B[j][k]: 16 x 16 blocks transposed in registers */
            for (int half = 0; half < 2; half++) {
                int jn = nn - half * 16;
                for (int64_t kb = 0; kb < kc; kb += 16) {
                    int kn = kc - kb < 16 ? (int)(kc - kb) : 16;
                    __m512 r[16];
                    for (int jj = 0; jj < 16; jj++)
                        r[jj] = jj < jn ? load16(B + (size_t)((j0 + js + half * 16 + jj) * g->ldb + k0 + kb) * esz,
                                                 g->b_dt, kn)
                                        : _mm512_setzero_ps();
                    transpose16(r);
                    for (int kk = 0; kk < kn; kk++) _mm512_store_ps(dst + (kb + kk) * NR + half * 16, r[kk]);
                }
            }
        }
    }
}

/* C = alpha*acc (+ beta*C, or + C when accumulating) (+ biases). */
AVX512 void kiln_cpu_gemm_store_tile(const tile_out *o, const __m512 *lo, const __m512 *hi)
{
    int n = o->n;
    __mmask16 m0 = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    __mmask16 m1 = n >= 32 ? (__mmask16)0xffff : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
    __m512 va = _mm512_set1_ps(o->alpha), vb = _mm512_set1_ps(o->beta);
    __m512 bc0 = _mm512_setzero_ps(), bc1 = bc0;
    if (o->bias_col) {
        bc0 = _mm512_maskz_loadu_ps(m0, o->bias_col);
        bc1 = _mm512_maskz_loadu_ps(m1, o->bias_col + 16);
    }
    for (int r = 0; r < o->m; r++) {
        float *row = o->c + r * o->ldc;
        __m512 v0 = _mm512_mul_ps(lo[r], va), v1 = _mm512_mul_ps(hi[r], va);
        if (o->accumulate) {
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, row));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, row + 16));
        } else if (o->beta != 0.0f) { /* beta == 0 never reads C (it may hold nan) */
            v0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, row), v0);
            v1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, row + 16), v1);
        }
        if (o->bias_row) {
            __m512 br = _mm512_set1_ps(o->bias_row[r]);
            v0 = _mm512_add_ps(v0, br);
            v1 = _mm512_add_ps(v1, br);
        }
        if (o->bias_col) {
            v0 = _mm512_add_ps(v0, bc0);
            v1 = _mm512_add_ps(v1, bc1);
        }
        _mm512_mask_storeu_ps(row, m0, v0);
        _mm512_mask_storeu_ps(row + 16, m1, v1);
    }
}

#define ROW(lo, hi, src) s = _mm512_set1_ps(src); lo = _mm512_fmadd_ps(s, x0, lo); hi = _mm512_fmadd_ps(s, x1, hi);

/* MR x NR tile from a packed A sliver ap[k][MR] and B sliver bp[k][NR]. */
AVX512 static void ukr_packed(int64_t kc, const float *restrict ap, const float *restrict bp, const tile_out *o)
{
    UKR_ZERO()
    for (int64_t k = 0; k < kc; k++) {
        __m512 x0 = _mm512_load_ps(bp), x1 = _mm512_load_ps(bp + 16), s;
        _mm_prefetch((const char *)(bp + 8 * NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(ap + 16 * MR), _MM_HINT_T0);
        ROW(a0, b0_, ap[0]) ROW(a1, b1_, ap[1]) ROW(a2, b2_, ap[2]) ROW(a3, b3_, ap[3])
        ROW(a4, b4_, ap[4]) ROW(a5, b5_, ap[5]) ROW(a6, b6_, ap[6]) ROW(a7, b7_, ap[7])
        ROW(a8, b8_, ap[8]) ROW(a9, b9_, ap[9]) ROW(a10, b10_, ap[10]) ROW(a11, b11_, ap[11])
        ap += MR;
        bp += NR;
    }
    UKR_STORE(o)
}

/* A sliver of at most 4 rows (products with a handful of rows, such as the VAE's 3
 * output channels) times 3 B slivers: 4 x 96 accumulators keep the FMAs as busy as the
 * 12 x 32 tile, which would leave 2/3 of its rows empty. bs: floats between slivers. */
AVX512 static void ukr_wide(int64_t kc, const float *restrict ap, const float *restrict bp, int64_t bs,
                            const tile_out *o)
{
    /* fully unrolled loops over r and v keep acc in 24 registers */
    __m512 acc[4][6];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 6
        for (int v = 0; v < 6; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        __m512 x[6];
#pragma GCC unroll 6
        for (int v = 0; v < 6; v++) x[v] = _mm512_load_ps(bp + (v / 2) * bs + k * NR + (v % 2) * 16);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            __m512 s = _mm512_set1_ps(ap[k * MR + r]);
#pragma GCC unroll 6
            for (int v = 0; v < 6; v++) acc[r][v] = _mm512_fmadd_ps(s, x[v], acc[r][v]);
        }
    }
    for (int q = 0; q < 3; q++) {
        tile_out oq = *o;
        oq.c += q * NR;
        oq.n = NR;
        if (oq.bias_col) oq.bias_col += q * NR;
        __m512 lo[4] = {acc[0][2 * q], acc[1][2 * q], acc[2][2 * q], acc[3][2 * q]};
        __m512 hi[4] = {acc[0][2 * q + 1], acc[1][2 * q + 1], acc[2][2 * q + 1], acc[3][2 * q + 1]};
        kiln_cpu_gemm_store_tile(&oq, lo, hi);
    }
}

/* Two packed A slivers (24 rows) times one vector of columns (n <= 16): for products
 * only 16 columns wide (Winograd on 16x16 images), where the 12 x 32 tile would waste
 * half its FMAs. */
AVX512 static void ukr_narrow(int64_t kc, const float *restrict a0, const float *restrict a1, const float *restrict bp,
                              const tile_out *o0, const tile_out *o1)
{
    __m512 acc[2 * MR];
#pragma GCC unroll 24
    for (int r = 0; r < 2 * MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        __m512 x = _mm512_load_ps(bp + k * NR);
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a0[k * MR + r]), x, acc[r]);
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) acc[MR + r] = _mm512_fmadd_ps(_mm512_set1_ps(a1[k * MR + r]), x, acc[MR + r]);
    }
    __m512 z[MR];
    for (int r = 0; r < MR; r++) z[r] = _mm512_setzero_ps();
    kiln_cpu_gemm_store_tile(o0, acc, z);
    kiln_cpu_gemm_store_tile(o1, acc + MR, z);
}

/* Same as ukr_packed, reading MR full rows of a row-major f32 A (stride lda) in place:
 * no packing. */
AVX512 static void ukr_rows(int64_t kc, const float *restrict a, int64_t lda, const float *restrict bp,
                            const tile_out *o)
{
    UKR_ZERO()
    const float *r0 = a, *r4 = a + 4 * lda, *r8 = a + 8 * lda;
    for (int64_t k = 0; k < kc; k++) {
        __m512 x0 = _mm512_load_ps(bp), x1 = _mm512_load_ps(bp + 16), s;
        ROW(a0, b0_, r0[k]) ROW(a1, b1_, r0[lda + k]) ROW(a2, b2_, r0[2 * lda + k]) ROW(a3, b3_, r0[3 * lda + k])
        ROW(a4, b4_, r4[k]) ROW(a5, b5_, r4[lda + k]) ROW(a6, b6_, r4[2 * lda + k]) ROW(a7, b7_, r4[3 * lda + k])
        ROW(a8, b8_, r8[k]) ROW(a9, b9_, r8[lda + k]) ROW(a10, b10_, r8[2 * lda + k]) ROW(a11, b11_, r8[3 * lda + k])
        bp += NR;
    }
    UKR_STORE(o)
}
#undef ROW

/* Whether MR rows lda floats apart crowd one L1 set: the 32 KB 8-way L1 of Zen 4 (and
 * most x86 cores) indexes sets by address bits 6-11, so rows a multiple of 4 KB apart
 * (K = 5120: 20 KB) all land in one set and evict each other on every k step. More
 * than 6 rows per set (K = 2560 puts 6 in each of two sets, where reading in place
 * still wins): pack the sliver. */
static int rows_alias(int64_t lda)
{
    int count[64] = {0}, worst = 0;
    for (int r = 0; r < MR; r++) {
        int set = (int)((((uint64_t)r * (uint64_t)lda * 4u) / 64u) % 64u);
        if (++count[set] > worst) worst = count[set];
    }
    return worst > 6;
}

/* The block of C rows [i0, i1) x columns [j0, j1), all of K. */
AVX512 void kiln_cpu_gemm_run_block(const gemm_args *g, float *bpanel, float *asliver, int64_t i0, int64_t i1,
                                    int64_t j0, int64_t j1)
{
    if (g->bf16) {
        kiln_cpu_gemm_run_block_bf16(g, bpanel, asliver, i0, i1, j0, j1);
        return;
    }
    int64_t n = j1 - j0, bsl = g->b_sliver ? g->b_sliver : g->K * NR;
    const int in_place_ok = !g->a_packed && !g->trans_a && g->a_dt == KILN_F32 && !rows_alias(g->lda);
    /* panels of equal depth (K = 1280: 4 x 320, not 3 x 384 + 128): C is read and
     * written once per panel, which a shallow last panel would pay for few products */
    int64_t npan = (g->K + KC - 1) / KC, step = ((g->K + npan - 1) / npan + 15) / 16 * 16;
    if (step > KC) step = KC;
    for (int64_t k0 = 0; k0 < g->K; k0 += step) {
        int64_t kc = g->K - k0 < step ? g->K - k0 : step;
        int last = k0 + kc == g->K;
        if (!g->b_packed) kiln_cpu_gemm_pack_b(bpanel, g, j0, n, k0, kc);
        if (g->a_packed && n <= 16) { /* one vector of columns: two slivers of A per call */
            const float *bp = g->b_packed ? (const float *)g->B + (j0 / NR) * bsl + k0 * NR : bpanel;
            for (int64_t i = i0; i < i1; i += 2 * MR) {
                int m0 = i1 - i < MR ? (int)(i1 - i) : MR, m1 = i1 - i - MR < MR ? (int)(i1 - i - MR) : MR;
                if (m1 < 0) m1 = 0;
                tile_out o0 = {g->C + i * g->ldc + j0, g->ldc, m0, (int)n, g->alpha, g->beta, k0 > 0,
                               last && g->bias_row ? g->bias_row + i : NULL, last && g->bias_col ? g->bias_col + j0 : NULL};
                tile_out o1 = o0;
                o1.c += MR * g->ldc;
                o1.m = m1;
                if (o1.bias_row) o1.bias_row += MR;
                const float *a0 = (const float *)g->A + (i / MR) * g->K * MR + k0 * MR;
                /* past the last sliver: reuse the first (its rows are not stored) */
                const float *a1 = m1 > 0 ? a0 + g->K * MR : a0;
                ukr_narrow(kc, a0, a1, bp, &o0, &o1);
            }
            continue;
        }
        for (int64_t i = i0; i < i1; i += MR) {
            int m = i1 - i < MR ? (int)(i1 - i) : MR;
            /* full slivers of a row-major f32 A are read in place where its rows do not
             * alias in L1 (see rows_alias); the rest is packed */
            int direct = in_place_ok && m == MR;
            const float *ap = asliver;
            if (g->a_packed) ap = (const float *)g->A + (i / MR) * g->K * MR + k0 * MR;
            else if (!direct) {
                if (g->trans_a) kiln_cpu_gemm_pack_a(asliver, g, i, m, k0, kc);
                else pack_a_rows(asliver, g, i, m, k0, kc);
            }
            for (int64_t js = 0; js < n;) {
                tile_out o = {g->C + i * g->ldc + j0 + js, g->ldc, m, n - js < NR ? (int)(n - js) : NR,
                              g->alpha, g->beta, k0 > 0,
                              last && g->bias_row ? g->bias_row + i : NULL,
                              last && g->bias_col ? g->bias_col + j0 + js : NULL};
                const float *bp = g->b_packed ? (const float *)g->B + ((j0 + js) / NR) * bsl + k0 * NR
                                              : bpanel + (js / NR) * kc * NR;
                if (m <= 8 && n - js >= 3 * NR) { /* up to 8 rows: the 4 x 96 kernel, once or twice */
                    int64_t bs = g->b_packed ? bsl : kc * NR;
                    o.n = 3 * NR;
                    o.m = m < 4 ? m : 4;
                    ukr_wide(kc, ap, bp, bs, &o);
                    if (m > 4) {
                        o.c += 4 * g->ldc;
                        o.m = m - 4;
                        if (o.bias_row) o.bias_row += 4;
                        ukr_wide(kc, ap + 4, bp, bs, &o);
                    }
                    js += 3 * NR;
                    continue;
                }
                if (direct) ukr_rows(kc, (const float *)g->A + i * g->lda + k0, g->lda, bp, &o);
                else ukr_packed(kc, ap, bp, &o);
                js += NR;
            }
        }
    }
}
#endif /* GEMM_X86 */
