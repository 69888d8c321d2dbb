/* gemm_bf16.c - the bf16 products (kiln.precision "bf16": bf16 inputs, f32 sums) on the
 * packed AVX-512 kernel: rounding panels into pair layout, the vdpbf16ps microkernels
 * and their emulation on CPUs without AVX512_BF16, and the entry points that take
 * operands already in pairs. gemm.c's driver and gemm_f32.c's packing serve them. */
#define _GNU_SOURCE
#include "gemm_internal.h"
#include "threadpool.h"
#include "../../runtime/precision.h"

#include <stdatomic.h>
#include <stdlib.h>

#ifdef GEMM_X86
/* ---------- bf16 products (kiln.precision "bf16") ----------
 * Inputs rounded to bf16 (nearest even), products accumulated in f32. Panels are packed
 * as f32 first (the same packing code as above, custom B sources included), then
 * rounded into pair layout: one 32-bit lane holds depths k (low half) and k+1 (high
 * half), what vdpbf16ps multiplies pairwise and adds into an f32 lane. B: [kc/2][NR]
 * lanes per sliver; A: [kc/2][MR] lanes, one broadcast per row and depth pair.
 * Without AVX512_BF16 the same lanes are split back to f32 and go through two FMAs, in
 * the order the instruction is specified to add them (odd depth, then even). */

#define AVX512BF16 __attribute__((target("avx512f,avx512bf16")))
/* Depth of a bf16 panel: twice KC, so that its B panel takes the L2 bytes of an f32 one
 * and C, read and written once per panel, is streamed half as often (with the faster
 * products that traffic would otherwise show). KCB / 2 depth pairs. */
enum { KCB = 2 * KC, KCBP = KC };

/* Per-thread bf16 panel (KCBP x NB_MAX lanes) and A sliver (KCBP x MR), made on first
 * use by a thread and kept for its life: the prepacked products (Winograd) run without
 * the caller's scratch. */
static _Thread_local uint32_t *bf_buf;

static uint32_t *bf16_buffer(void)
{
    if (!bf_buf) bf_buf = aligned_alloc(64, ((size_t)KCBP * NB_MAX + (size_t)KCBP * MR + 16) * sizeof(uint32_t));
    return bf_buf;
}

/* kc x w f32 rows (row stride ld floats, w <= 16) -> kcp pair rows of w lanes (stride
 * ldo). May run in place (dst == src, ldo == ld): pair row j is written after f32 rows
 * 2j and 2j+1 are read, and no later read reaches back to it. */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void bf16_rows_native(uint32_t *dst, int64_t ldo,
                                                                                   const float *src, int64_t ld,
                                                                                   int64_t kc, __mmask16 mk)
{
    const __m512i ilv = bf16_pair_index();
    for (int64_t k = 0; k < kc; k += 2) {
        __m512 e = _mm512_maskz_loadu_ps(mk, src + k * ld);
        __m512 o = k + 1 < kc ? _mm512_maskz_loadu_ps(mk, src + (k + 1) * ld) : _mm512_setzero_ps();
        _mm512_mask_storeu_epi32(dst + (k / 2) * ldo, mk, bf16_pair_native(e, o, ilv));
    }
}

AVX512 static void bf16_rows(uint32_t *dst, int64_t ldo, const float *src, int64_t ld, int64_t kc, int w, int native)
{
    __mmask16 mk = w >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << w) - 1);
    if (native) {
        bf16_rows_native(dst, ldo, src, ld, kc, mk);
        return;
    }
    for (int64_t k = 0; k < kc; k += 2) {
        __m512 e = _mm512_maskz_loadu_ps(mk, src + k * ld);
        __m512 o = k + 1 < kc ? _mm512_maskz_loadu_ps(mk, src + (k + 1) * ld) : _mm512_setzero_ps();
        _mm512_mask_storeu_epi32(dst + (k / 2) * ldo, mk, bf16_pair(e, o));
    }
}

/* n columns of f32 slivers (sliver s at src + s*ss floats, [kc][NR]) -> bf16 pair
 * slivers ds lanes apart. */
AVX512 static void bf16_b_panel(uint32_t *restrict dst, int64_t ds, const float *restrict src, int64_t ss, int64_t n,
                                int64_t kc, int native)
{
    for (int64_t s = 0; s * NR < n; s++) {
        bf16_rows(dst + s * ds, NR, src + s * ss, NR, kc, 16, native);
        bf16_rows(dst + s * ds + 16, NR, src + s * ss + 16, NR, kc, 16, native);
    }
}

/* With AVX512_BF16: up to 16 rows of 32 consecutive depths (rows row_bytes apart, f32
 * / f16 / bf16, n <= 32 valid depths) rounded by vcvtne2ps2bf16, whose words come out
 * in memory order - lane i of row r is the pair (2i, 2i+1) - then transposed, so that
 * pair row p (lanes = rows, w of them) lands at dst + p * ldo. A third of the
 * instructions of rounding each pair in software (bf16_pair), with the same bits.
 * pairs_t32_full is the common case (all 32 depths) with the dtype a constant, so that
 * the 16 rows stay in registers through the transpose (the generic form kept them on the
 * stack and stalled on its own stores); pairs_t32 takes the rest. */
/* the rows' next 32 depths (many short streams the hardware prefetcher loses) */
static inline void pairs_t32_prefetch(const char *src, size_t row_bytes, int rows, size_t esz)
{
    for (int i = 0; i < rows; i++) {
        const char *nx = src + i * row_bytes + 32 * esz;
        _mm_prefetch(nx, _MM_HINT_T0);
        if (esz == 4) _mm_prefetch(nx + 64, _MM_HINT_T0);
    }
}

/* 16 half-precision values (f16, or bf16: widened exactly by a shift) as f32 */
AVX512 static inline __m512 half16(const char *p, const int f16)
{
    __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)p);
    return f16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AVX512BF16 static inline __attribute__((always_inline)) void pairs_t32_full(uint32_t *dst, int64_t ldo, const char *src,
                                                                           size_t row_bytes, const kiln_dtype dt,
                                                                           int rows, __mmask16 mk)
{
    __m512 r[16];
    pairs_t32_prefetch(src, row_bytes, rows, dt == KILN_F32 ? 4 : 2);
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        const char *row = src + i * row_bytes;
        __m512 lo = _mm512_setzero_ps(), hi = lo;
        if (i < rows) {
            if (dt == KILN_F32) {
                lo = _mm512_loadu_ps(row);
                hi = _mm512_loadu_ps(row + 64);
            } else {
                lo = half16(row, dt == KILN_F16);
                hi = half16(row + 32, dt == KILN_F16);
            }
        }
        r[i] = (__m512)_mm512_cvtne2ps_pbh(hi, lo);
    }
    transpose16(r);
    if (ldo == 12 && mk == 0x0FFF) {
        /* A slivers: the 16 pair rows are 192 contiguous words. Whole-vector stores in
         * ascending order, each one's 4 extra lanes overwritten by the next (masked
         * stores that split cache lines are slow); the last one masked. */
#pragma GCC unroll 16
        for (int pr = 0; pr < 15; pr++) _mm512_storeu_si512(dst + pr * 12, _mm512_castps_si512(r[pr]));
        _mm512_mask_storeu_epi32(dst + 15 * 12, mk, _mm512_castps_si512(r[15]));
        return;
    }
#pragma GCC unroll 16
    for (int pr = 0; pr < 16; pr++) _mm512_mask_storeu_epi32(dst + pr * ldo, mk, _mm512_castps_si512(r[pr]));
}

AVX512BF16 static void pairs_t32(uint32_t *dst, int64_t ldo, const char *src, size_t row_bytes, kiln_dtype dt,
                                 int rows, int n, int w)
{
    __mmask16 mk = w >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << w) - 1);
    if (n == 32 && (dt == KILN_F32 || dt == KILN_F16 || dt == KILN_BF16)) { /* the dtype a constant in each */
        if (dt == KILN_F16) pairs_t32_full(dst, ldo, src, row_bytes, KILN_F16, rows, mk);
        else if (dt == KILN_BF16) pairs_t32_full(dst, ldo, src, row_bytes, KILN_BF16, rows, mk);
        else pairs_t32_full(dst, ldo, src, row_bytes, KILN_F32, rows, mk);
        return;
    }
    size_t esz = kiln_dtype_size(dt);
    pairs_t32_prefetch(src, row_bytes, rows, esz);
    __m512 r[16];
    for (int i = 0; i < 16; i++)
        r[i] = i < rows ? (__m512)_mm512_cvtne2ps_pbh(load16(src + i * row_bytes + 16 * esz, dt, n - 16),
                                                      load16(src + i * row_bytes, dt, n))
                        : _mm512_setzero_ps();
    transpose16(r);
    for (int pr = 0; pr < (n + 1) / 2; pr++) _mm512_mask_storeu_epi32(dst + pr * ldo, mk, _mm512_castps_si512(r[pr]));
}

/* B panel (columns [j0, j0+n) x depths [k0, k0+kc), kc <= KCB) straight from an f32 /
 * f16 / bf16 B into bf16 pair slivers of ds lanes: what pack_b then bf16_b_panel do,
 * without the f32 panel in between. 0 when B is of another kind (custom source, low-bit). */
AVX512 static int pack_b_bf16(uint32_t *restrict dst, int64_t ds, const gemm_args *g, int64_t j0, int64_t n,
                              int64_t k0, int64_t kc)
{
    if (g->pack_b || lowbit_dt(g->b_dt)) return 0;
    size_t esz = kiln_dtype_size(g->b_dt);
    const char *B = g->B;
    for (int64_t js = 0; js < n; js += NR) {
        int nn = n - js < NR ? (int)(n - js) : NR;
        uint32_t *d = dst + (js / NR) * ds;
        if (!g->trans_b) { /* rows k and k+1 hold the columns contiguously */
            for (int64_t k = 0; k < kc; k += 2) {
                const char *r0 = B + (size_t)((k0 + k) * g->ldb + j0 + js) * esz, *r1 = r0 + (size_t)g->ldb * esz;
                int odd = k + 1 < kc;
                for (int h = 0; h < 2; h++) {
                    __m512 e = load16(r0 + 16 * h * esz, g->b_dt, nn - 16 * h);
                    __m512 o = odd ? load16(r1 + 16 * h * esz, g->b_dt, nn - 16 * h) : _mm512_setzero_ps();
                    _mm512_store_si512(d + (k / 2) * NR + 16 * h, bf16_pair(e, o));
                }
            }
        } else if (g->bf16 == 1) { /* 16 rows x 32 depths: paired by the instruction, then transposed */
            for (int h = 0; h < 2; h++) {
                int jn = nn - h * 16;
                for (int64_t kb = 0; kb < kc; kb += 32) {
                    int kn = kc - kb < 32 ? (int)(kc - kb) : 32;
                    pairs_t32(d + (kb / 2) * NR + 16 * h, NR, B + (size_t)((j0 + js + h * 16) * g->ldb + k0 + kb) * esz,
                              (size_t)g->ldb * esz, g->b_dt, jn < 0 ? 0 : jn, kn, 16);
                }
            }
        } else { /* 16 x 16 blocks of rows of B transposed in registers, then paired */
            for (int h = 0; h < 2; h++) {
                int jn = nn - h * 16;
                for (int64_t kb = 0; kb < kc; kb += 16) {
                    int kn = kc - kb < 16 ? (int)(kc - kb) : 16;
                    __m512 r[16];
                    for (int jj = 0; jj < 16; jj++)
                        r[jj] = jj < jn ? load16(B + (size_t)((j0 + js + h * 16 + jj) * g->ldb + k0 + kb) * esz, g->b_dt, kn)
                                        : _mm512_setzero_ps();
                    transpose16(r);
                    for (int kk = 0; kk < kn; kk += 2)
                        _mm512_store_si512(d + ((kb + kk) / 2) * NR + 16 * h, bf16_pair(r[kk], r[kk + 1]));
                }
            }
        }
    }
    return 1;
}

/* A sliver (rows [i0, i0+m) x depths [k0, k0+kc)) in bf16 pair layout [kc/2][MR]. A
 * row-major A is read 16 depths at a time, transposed in registers and rounded there;
 * other layouts go through the f32 packing (tmp: KC x MR floats). */
AVX512 static void pack_a_bf16(uint32_t *restrict ab, float *restrict tmp, const gemm_args *g, int64_t i0, int m,
                               int64_t k0, int64_t kc)
{
    if (g->a_packed) {
        bf16_rows(ab, MR, (const float *)g->A + (i0 / MR) * g->K * MR + k0 * MR, MR, kc, MR, g->bf16 == 1);
        return;
    }
    if (g->trans_a) {
        for (int64_t c = 0; c < kc; c += KC) {
            int64_t cn = kc - c < KC ? kc - c : KC;
            kiln_cpu_gemm_pack_a(tmp, g, i0, m, k0 + c, cn);
            bf16_rows(ab + (c / 2) * MR, MR, tmp, MR, cn, MR, g->bf16 == 1);
        }
        return;
    }
    size_t esz = kiln_dtype_size(g->a_dt);
    if (g->bf16 == 1) {
        for (int64_t kk = 0; kk < kc; kk += 32)
            pairs_t32(ab + (kk / 2) * MR, MR, (const char *)g->A + (size_t)(i0 * g->lda + k0 + kk) * esz,
                      (size_t)g->lda * esz, g->a_dt, m, kc - kk < 32 ? (int)(kc - kk) : 32, MR);
        return;
    }
    for (int64_t kk = 0; kk < kc; kk += 16) {
        int n = kc - kk < 16 ? (int)(kc - kk) : 16;
        __m512 r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < m ? load16((const char *)g->A + (size_t)((i0 + i) * g->lda + k0 + kk) * esz, g->a_dt, n)
                         : _mm512_setzero_ps();
        transpose16(r);
        for (int j = 0; j < n; j += 2)
            _mm512_mask_storeu_epi32(ab + ((kk + j) / 2) * MR, (__mmask16)((1u << MR) - 1), bf16_pair(r[j], r[j + 1]));
    }
}

/* The tile's lines of C, fetched for writing at the start of a bf16 tile: kiln_cpu_gemm_store_tile
 * reads them (a later depth panel adds into C) or writes them, and C is rarely still in
 * cache by then. The bf16 tile's products take half the f32 tile's time, too short to
 * hide that wait; the f32 kernels gained nothing from it, so only the bf16 kernel does it
 * (README: bf16 on the CPU). */
AVX512 static inline void prefetch_tile(const tile_out *o)
{
    for (int r = 0; r < o->m; r++) {
        const char *row = (const char *)(o->c + r * o->ldc);
        _mm_prefetch(row, _MM_HINT_ET0);
        if (o->n > 16) _mm_prefetch(row + 64, _MM_HINT_ET0);
    }
}

/* MR x NR tile over kcp depth pairs: vdpbf16ps */
#define ROW(lo, hi, src)                                                                                       \
    s = (__m512bh)_mm512_set1_epi32((int)(src));                                                               \
    lo = _mm512_dpbf16_ps(lo, s, x0);                                                                          \
    hi = _mm512_dpbf16_ps(hi, s, x1);

AVX512BF16 static void ukr_bf16(int64_t kcp, const uint32_t *restrict ap, const uint32_t *restrict bp,
                                const tile_out *o)
{
    UKR_ZERO()
    prefetch_tile(o);
    for (int64_t k = 0; k < kcp; k++) {
        __m512bh x0 = (__m512bh)_mm512_load_si512(bp), x1 = (__m512bh)_mm512_load_si512(bp + 16), s;
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
#undef ROW

/* The same tile without AVX512_BF16: each pair lane split into its two f32 values
 * (exact), added as the instruction adds them. */
#define ROW(lo, hi, src)                                                                                       \
    s = _mm512_set1_epi32((int)(src));                                                                         \
    se = _mm512_castsi512_ps(_mm512_slli_epi32(s, 16));                                                        \
    so = _mm512_castsi512_ps(_mm512_and_si512(s, himask));                                                     \
    lo = _mm512_fmadd_ps(se, x0e, _mm512_fmadd_ps(so, x0o, lo));                                               \
    hi = _mm512_fmadd_ps(se, x1e, _mm512_fmadd_ps(so, x1o, hi));

AVX512 static void ukr_bf16_emulated(int64_t kcp, const uint32_t *restrict ap, const uint32_t *restrict bp,
                                     const tile_out *o)
{
    UKR_ZERO()
    const __m512i himask = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t k = 0; k < kcp; k++) {
        __m512i x0 = _mm512_load_si512(bp), x1 = _mm512_load_si512(bp + 16), s;
        __m512 x0e = _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16)), x0o = _mm512_castsi512_ps(_mm512_and_si512(x0, himask));
        __m512 x1e = _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16)), x1o = _mm512_castsi512_ps(_mm512_and_si512(x1, himask));
        __m512 se, so;
        ROW(a0, b0_, ap[0]) ROW(a1, b1_, ap[1]) ROW(a2, b2_, ap[2]) ROW(a3, b3_, ap[3])
        ROW(a4, b4_, ap[4]) ROW(a5, b5_, ap[5]) ROW(a6, b6_, ap[6]) ROW(a7, b7_, ap[7])
        ROW(a8, b8_, ap[8]) ROW(a9, b9_, ap[9]) ROW(a10, b10_, ap[10]) ROW(a11, b11_, ap[11])
        ap += MR;
        bp += NR;
    }
    UKR_STORE(o)
}
#undef ROW

/* ukr_wide in bf16: at most 4 rows (pair rows of a 12-lane sliver, ap[k*MR + r]) times
 * 3 B pair slivers bs lanes apart, kcp depth pairs; DOT is the pair product. */
#define UKR_WIDE_BF16(name, attr, DOT)                                                                         \
    attr static void name(int64_t kcp, const uint32_t *restrict ap, const uint32_t *restrict bp, int64_t bs,   \
                          const tile_out *o)                                                                   \
    {                                                                                                          \
        __m512 acc[4][6];                                                                                      \
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)                                                    \
        _Pragma("GCC unroll 6") for (int v = 0; v < 6; v++) acc[r][v] = _mm512_setzero_ps();                  \
        for (int64_t k = 0; k < kcp; k++) {                                                                    \
            __m512i x[6];                                                                                      \
            _Pragma("GCC unroll 6") for (int v = 0; v < 6; v++)                                                \
                x[v] = _mm512_load_si512(bp + (v / 2) * bs + k * NR + (v % 2) * 16);                           \
            _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {                                              \
                __m512i s = _mm512_set1_epi32((int)ap[k * MR + r]);                                            \
                _Pragma("GCC unroll 6") for (int v = 0; v < 6; v++) acc[r][v] = DOT(acc[r][v], s, x[v]);       \
            }                                                                                                  \
        }                                                                                                      \
        for (int q = 0; q < 3; q++) {                                                                          \
            tile_out oq = *o;                                                                                  \
            oq.c += q * NR;                                                                                    \
            oq.n = NR;                                                                                         \
            if (oq.bias_col) oq.bias_col += q * NR;                                                            \
            __m512 lo[4] = {acc[0][2 * q], acc[1][2 * q], acc[2][2 * q], acc[3][2 * q]};                       \
            __m512 hi[4] = {acc[0][2 * q + 1], acc[1][2 * q + 1], acc[2][2 * q + 1], acc[3][2 * q + 1]};       \
            kiln_cpu_gemm_store_tile(&oq, lo, hi);                                                             \
        }                                                                                                      \
    }

AVX512BF16 static inline __m512 dot_native(__m512 acc, __m512i s, __m512i x)
{
    return _mm512_dpbf16_ps(acc, (__m512bh)s, (__m512bh)x);
}

/* as the instruction adds: the odd depth's product, then the even one's */
AVX512 static inline __m512 dot_emulated(__m512 acc, __m512i s, __m512i x)
{
    const __m512i himask = _mm512_set1_epi32((int)0xffff0000u);
    __m512 se = _mm512_castsi512_ps(_mm512_slli_epi32(s, 16)), so = _mm512_castsi512_ps(_mm512_and_si512(s, himask));
    __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), xo = _mm512_castsi512_ps(_mm512_and_si512(x, himask));
    return _mm512_fmadd_ps(se, xe, _mm512_fmadd_ps(so, xo, acc));
}

UKR_WIDE_BF16(ukr_wide_bf16, AVX512BF16, dot_native)
UKR_WIDE_BF16(ukr_wide_bf16_emulated, AVX512, dot_emulated)
#undef UKR_WIDE_BF16

/* kiln_cpu_gemm_run_block in bf16: B panels of at most NB_MAX columns and KCB depths rounded once per
 * panel, each A sliver once per panel and column chunk. bpanel: the f32 packing scratch
 * (KC x NB_MAX floats; NULL for prepacked B), filled KC depths at a time. */
AVX512 void kiln_cpu_gemm_run_block_bf16(const gemm_args *g, float *bpanel, float *asliver, int64_t i0, int64_t i1,
                                         int64_t j0, int64_t j1)
{
    (void)asliver;
    uint32_t *bb = bf16_buffer();
    float a_tmp[KC * MR] __attribute__((aligned(64)));
    /* without the thread's buffer (no memory): one sliver of columns at a time, on the stack */
    uint32_t small[KCBP * NR + KCBP * MR] __attribute__((aligned(64)));
    int64_t chunk = bb ? NB_MAX : NR;
    uint32_t *ab = bb ? bb + (size_t)KCBP * NB_MAX : small + KCBP * NR;
    if (!bb) bb = small;
    int64_t bsl = g->b_sliver ? g->b_sliver : g->K * NR;
    int64_t npan = (g->K + KCB - 1) / KCB, step = ((g->K + npan - 1) / npan + 15) / 16 * 16;
    if (step > KCB) step = KCB;
    for (int64_t jc = j0; jc < j1; jc += chunk) {
        int64_t jce = jc + chunk < j1 ? jc + chunk : j1, n = jce - jc;
        for (int64_t k0 = 0; k0 < g->K; k0 += step) {
            int64_t kc = g->K - k0 < step ? g->K - k0 : step, kcp = (kc + 1) / 2;
            int last = k0 + kc == g->K;
            /* the panel's slivers: bsrc, bstride lanes apart */
            const uint32_t *bsrc = bb;
            int64_t bstride = kcp * NR;
            if (g->b_bf16) { /* prepacked pairs: read in place */
                bsrc = (const uint32_t *)g->B + (jc / NR) * bsl + (k0 / 2) * NR;
                bstride = bsl;
            } else if (g->b_packed) {
                bf16_b_panel(bb, kcp * NR, (const float *)g->B + (jc / NR) * bsl + k0 * NR, bsl, n, kc, g->bf16 == 1);
            } else if (!pack_b_bf16(bb, kcp * NR, g, jc, n, k0, kc)) {
                for (int64_t c = 0; c < kc; c += KC) { /* KC is even: the halves meet on a pair */
                    int64_t cn = kc - c < KC ? kc - c : KC;
                    kiln_cpu_gemm_pack_b(bpanel, g, jc, n, k0 + c, cn);
                    bf16_b_panel(bb + (c / 2) * NR, kcp * NR, bpanel, cn * NR, n, cn, g->bf16 == 1);
                }
            }
            for (int64_t i = i0; i < i1; i += MR) {
                int m = i1 - i < MR ? (int)(i1 - i) : MR;
                const uint32_t *ap = ab;
                /* a prepacked A rounded once by its owner is read in place */
                if (g->a_bf16)
                    ap = (const uint32_t *)g->A + (i / MR) * (g->a_sliver ? g->a_sliver : g->K * MR) + (k0 / 2) * MR;
                else pack_a_bf16(ab, a_tmp, g, i, m, k0, kc);
                for (int64_t js = 0; js < n; js += NR) {
                    tile_out o = {g->C + i * g->ldc + jc + js, g->ldc, m, n - js < NR ? (int)(n - js) : NR,
                                  g->alpha, g->beta, k0 > 0,
                                  last && g->bias_row ? g->bias_row + i : NULL,
                                  last && g->bias_col ? g->bias_col + jc + js : NULL};
                    const uint32_t *bp = bsrc + (js / NR) * bstride;
                    if (g->bf16 == 1) ukr_bf16(kcp, ap, bp, &o);
                    else ukr_bf16_emulated(kcp, ap, bp, &o);
                }
            }
        }
    }
}

/* A rounded to bf16 pair slivers once, for products whose column blocks would each
 * round it again. */
typedef struct { const gemm_args *g; uint32_t *dst; int64_t kp; } a_round_ctx;

AVX512 static void a_round_fn(void *vctx, int64_t begin, int64_t end)
{
    const a_round_ctx *c = vctx;
    float tmp[KC * MR] __attribute__((aligned(64)));
    for (int64_t sl = begin; sl < end; sl++) {
        int64_t i0 = sl * MR;
        int m = c->g->M - i0 < MR ? (int)(c->g->M - i0) : MR;
        pack_a_bf16(c->dst + sl * c->kp * MR, tmp, c->g, i0, m, 0, c->g->K);
    }
}

void kiln_cpu_gemm_round_a_bf16(const gemm_args *g, uint32_t *dst, int64_t kp, int64_t ns)
{
    a_round_ctx rc = {g, dst, kp};
    kiln_parallel_for(ns, 1, a_round_fn, &rc);
}

/* A linear layer's weight (B transposed) rounded into its pair slivers once, for the
 * cache that kiln_cpu_linear_bf16_pairs reads: one sliver of 32 rows a task. */
typedef struct { const gemm_args *g; uint32_t *dst; int64_t kp; } b_pairs_ctx;

AVX512 static void b_pairs_fn(void *vctx, int64_t begin, int64_t end)
{
    const b_pairs_ctx *c = vctx;
    for (int64_t s = begin; s < end; s++) {
        int64_t j0 = s * NR, n = c->g->N - j0 < NR ? c->g->N - j0 : NR;
        pack_b_bf16(c->dst + s * c->kp * NR, c->kp * NR, c->g, j0, n, 0, c->g->K);
    }
}
#endif /* GEMM_X86 */

/* ---------- entry points ---------- */

static atomic_int bf16_emulate; /* tests: the emulated bf16 kernel even where vdpbf16ps exists */

void kiln_cpu_bf16_set_emulation(int on) { atomic_store(&bf16_emulate, on != 0); }

/* How a product of M rows runs under the current precision: 0 f32, 1 bf16 on
 * vdpbf16ps, 2 bf16 emulated. Only the packed AVX-512 kernel has a bf16 form: the
 * OpenBLAS path (CPUs without AVX-512, and products under SMALL_MACS) stays f32, and so
 * do products of at most 8 rows, bound by reading the weights (the 4 x 96 tile), which
 * rounding would not speed up. Precision int8 runs its other products (and its linear
 * layers where gemm_int8.c does not apply) in bf16. */
int kiln_cpu_bf16_mode(int64_t M)
{
    kiln_precision p = kiln_precision_for(NULL);
    if (M <= 8 || !have_avx512() || (p != KILN_PREC_BF16 && p != KILN_PREC_INT8)) return 0;
    return kiln_cpu_has_bf16() && !atomic_load_explicit(&bf16_emulate, memory_order_relaxed) ? 1 : 2;
}

int kiln_cpu_bf16_active(void) { return kiln_cpu_bf16_mode(MR); }

/* kiln_cpu_gemm_serial in bf16 with both operands in pairs (cpu_internal.h). Whole
 * 12-row slivers take the 12 x 32 tile, which reads B once a sliver instead of once
 * every 4 rows: the few-tiles Winograd's B is a U chunk larger than L2 (README: bf16 on
 * the CPU, for 16 to 64 tiles). A sliver of fewer rows goes 4 at a time through the
 * 4 x 96 tile where 96 columns remain, the rest through the 12 x 32 one. */
int kiln_cpu_gemm_serial_bf16(int64_t M, int64_t N, int64_t K, const uint32_t *Ap, int64_t a_sliver,
                              const uint32_t *Bp, int64_t b_sliver, float *C, int64_t ldc, int accumulate)
{
#ifdef GEMM_X86
    int mode = kiln_cpu_bf16_mode(MR);
    if (!mode) return -1;
    if (M <= 0 || N <= 0 || K <= 0) return 0;
    const int64_t kcp = (K + 1) / 2;
    for (int64_t i = 0; i < M; i += MR) {
        int m = M - i < MR ? (int)(M - i) : MR;
        const int64_t n96 = m == MR ? 0 : N / (3 * NR) * (3 * NR);
        const uint32_t *ap = Ap + (i / MR) * a_sliver;
        for (int r4 = 0; r4 < m; r4 += 4)
            for (int64_t js = 0; js < n96; js += 3 * NR) {
                tile_out o = {C + (i + r4) * ldc + js, ldc, m - r4 < 4 ? m - r4 : 4, 3 * NR, 1.0f, 0.0f, accumulate,
                              NULL, NULL};
                const uint32_t *bp = Bp + (js / NR) * b_sliver;
                if (mode == 1) ukr_wide_bf16(kcp, ap + r4, bp, b_sliver, &o);
                else ukr_wide_bf16_emulated(kcp, ap + r4, bp, b_sliver, &o);
            }
        for (int64_t js = n96; js < N; js += NR) {
            tile_out o = {C + i * ldc + js, ldc, m, N - js < NR ? (int)(N - js) : NR, 1.0f, 0.0f, accumulate, NULL, NULL};
            const uint32_t *bp = Bp + (js / NR) * b_sliver;
            if (mode == 1) ukr_bf16(kcp, ap, bp, &o);
            else ukr_bf16_emulated(kcp, ap, bp, &o);
        }
    }
    return 0;
#else
    (void)M; (void)N; (void)K; (void)Ap; (void)a_sliver; (void)Bp; (void)b_sliver; (void)C; (void)ldc;
    (void)accumulate;
    return -1;
#endif
}

void kiln_cpu_bf16_pack_rows(uint32_t *dst, int64_t a_sliver, const float *A, int64_t lda, int64_t M, int64_t K)
{
#ifdef GEMM_X86
    if (!have_avx512()) return;
    gemm_args g = {.M = M, .K = K, .A = A, .lda = lda, .a_dt = KILN_F32};
    for (int64_t i = 0; i < M; i += MR) pack_a_bf16(dst + (i / MR) * a_sliver, NULL, &g, i, M - i < MR ? (int)(M - i) : MR, 0, K);
#else
    (void)dst; (void)a_sliver; (void)A; (void)lda; (void)M; (void)K;
#endif
}

size_t kiln_cpu_bf16_weight_pairs_bytes(int64_t N, int64_t K)
{
    return (size_t)((N + 31) / 32) * (size_t)((K + 1) / 2) * 32 * sizeof(uint32_t);
}

int kiln_cpu_bf16_weight_pairs(uint32_t *dst, const void *W, kiln_dtype dt, int64_t N, int64_t K)
{
#ifdef GEMM_X86
    int mode = kiln_cpu_bf16_mode(MR);
    if (!mode || N <= 0 || K <= 0 || (dt != KILN_F32 && dt != KILN_F16 && dt != KILN_BF16)) return -1;
    gemm_args g = {.trans_b = 1, .N = N, .K = K, .B = W, .ldb = K, .b_dt = dt, .bf16 = mode};
    b_pairs_ctx c = {&g, dst, (K + 1) / 2};
    kiln_parallel_for((N + NR - 1) / NR, 1, b_pairs_fn, &c);
    return 0;
#else
    (void)dst; (void)W; (void)dt; (void)N; (void)K;
    return -1;
#endif
}

void kiln_cpu_bf16_pairs_b(uint32_t *B, int64_t n, int64_t K, int64_t stride)
{
#ifdef GEMM_X86
    if (have_avx512()) {
        int native = kiln_cpu_bf16_mode(MR) == 1;
        for (int64_t s = 0; s * NR < n; s++) { /* in place: bf16_rows reads rows 2j, 2j+1 before writing pair row j */
            bf16_rows(B + s * stride, NR, (const float *)(B + s * stride), NR, K, 16, native);
            bf16_rows(B + s * stride + 16, NR, (const float *)(B + s * stride) + 16, NR, K, 16, native);
        }
    }
#else
    (void)B; (void)n; (void)K; (void)stride;
#endif
}
