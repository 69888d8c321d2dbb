/* gemm.c - f32 matrix products (gemm, batched gemm, linear) on the shared thread pool,
 * and their bf16 form (bf16 inputs, f32 sums) under kiln.precision("bf16").
 * On CPUs with AVX-512 a packed, cache-blocked kernel of our own runs (`make bench`
 * compares it with OpenBLAS; it shares our pool instead of a second set of spinning
 * threads); elsewhere OpenBLAS sgemm does the work. The same kernel serves
 * conv2d (conv2d.c) through kiln_cpu_gemm_ex, which takes f16/bf16 A and a callback
 * that packs B straight from the image (implicit im2col). */
#define _GNU_SOURCE
#include "cpu_isa.h"
#include "cpu_internal.h"
#include "threadpool.h"
#include "../../runtime/precision.h"

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define GEMM_X86 1
#include <immintrin.h>
#include "simd_bf16.h"
#include "simd_transpose.h"
#define AVX512 __attribute__((target("avx512f")))
#endif

/* Microkernel tile: MR rows of A (broadcast) times NR = 2 vectors of 16 columns. KC is
 * the depth of one packed panel: an MR x KC sliver of A stays in L1 while the KC x NB
 * panel of B (<= 480 KB: L2 is 1 MB on Zen 4; larger panels are slower)
 * is reused from L2 by every sliver. */
enum { MR = 12, NR = 32, KC = 384, NB_MAX = 320 };


/* ---------- scratch cache ---------- */

/* Kernels that run again and again with the same shapes (every UNet step) reuse their
 * scratch instead of taking fresh pages from the OS on every call: the page faults on
 * a 40 MB Winograd buffer cost as much as the convolution itself. A few blocks of at
 * most SCRATCH_CACHE_MAX bytes stay cached until kiln_cpu_scratch_trim() (the CPU
 * backend's workspace_release: kiln.mem.empty_cache, model unload) hands the idle ones back. */
enum { SCRATCH_SLOTS = 4 };
static const size_t SCRATCH_CACHE_MAX = (size_t)64 << 20;
static pthread_mutex_t scratch_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { void *p; size_t cap; int busy; } scratch_slots[SCRATCH_SLOTS];

/* Blocks of 2 MB and more are backed by transparent huge pages where the kernel offers
 * them on request (enabled = madvise, Debian's default): the Winograd transforms write
 * and read 36 or 64 streams a matrix apart, which with 4 KB pages miss the L1 TLB. */
static void *scratch_alloc(size_t bytes)
{
    const size_t huge = (size_t)2 << 20;
    if (bytes < huge) return aligned_alloc(64, bytes);
    size_t n = (bytes + huge - 1) / huge * huge;
    void *p = aligned_alloc(huge, n);
#ifdef MADV_HUGEPAGE
    if (p) madvise(p, n, MADV_HUGEPAGE);
#endif
    return p;
}

/* 64-byte aligned, uninitialized; NULL when out of memory. Give back with _put. */
void *kiln_cpu_scratch_get(size_t bytes)
{
    bytes = bytes ? (bytes + 63) / 64 * 64 : 64;
    if (bytes > SCRATCH_CACHE_MAX) return scratch_alloc(bytes);
    pthread_mutex_lock(&scratch_lock);
    int best = -1, victim = -1;
    for (int i = 0; i < SCRATCH_SLOTS; i++) {
        if (scratch_slots[i].busy) continue;
        if (scratch_slots[i].p && scratch_slots[i].cap >= bytes &&
            (best < 0 || scratch_slots[i].cap < scratch_slots[best].cap))
            best = i;
        if (victim < 0 || scratch_slots[i].cap < scratch_slots[victim].cap) victim = i;
    }
    void *r = NULL;
    if (best >= 0) {
        scratch_slots[best].busy = 1;
        r = scratch_slots[best].p;
    } else if (victim >= 0) { /* replace the smallest free block by a bigger one */
        free(scratch_slots[victim].p);
        scratch_slots[victim].p = r = scratch_alloc(bytes);
        scratch_slots[victim].cap = r ? bytes : 0;
        scratch_slots[victim].busy = r != NULL;
    }
    pthread_mutex_unlock(&scratch_lock);
    return best >= 0 || victim >= 0 ? r : scratch_alloc(bytes);
}

void kiln_cpu_scratch_put(void *p)
{
    if (!p) return;
    pthread_mutex_lock(&scratch_lock);
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (scratch_slots[i].p == p) {
            scratch_slots[i].busy = 0;
            pthread_mutex_unlock(&scratch_lock);
            return;
        }
    pthread_mutex_unlock(&scratch_lock);
    free(p);
}

size_t kiln_cpu_scratch_cached(void)
{
    size_t n = 0;
    pthread_mutex_lock(&scratch_lock);
    for (int i = 0; i < SCRATCH_SLOTS; i++) n += scratch_slots[i].cap;
    pthread_mutex_unlock(&scratch_lock);
    return n;
}

void kiln_cpu_scratch_trim(void)
{
    pthread_mutex_lock(&scratch_lock);
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (!scratch_slots[i].busy) {
            free(scratch_slots[i].p);
            scratch_slots[i].p = NULL;
            scratch_slots[i].cap = 0;
        }
    pthread_mutex_unlock(&scratch_lock);
}

typedef struct {
    int trans_a, trans_b;
    int64_t M, N, K;
    float alpha, beta;
    const void *A; int64_t lda; kiln_dtype a_dt;
    const void *B; int64_t ldb; kiln_dtype b_dt;
    pack_b_fn pack_b; void *pack_ctx;   /* custom B source (conv), or NULL */
    float *C; int64_t ldc;
    const float *bias_row, *bias_col;   /* C[i][j] += bias_row[i] + bias_col[j]; may be NULL */
    int a_packed, b_packed;             /* A / B already in sliver layout for all of K (see _prepacked) */
    int64_t b_sliver;                   /* packed B: floats from one sliver to the next (0: K*NR) */
    int bf16;                           /* 0 f32; bf16 inputs: 1 vdpbf16ps, 2 emulated (see bf16_mode) */
    int a_bf16;                         /* prepacked A already in bf16 pairs (the Winograd weight transform writes them) */
    int b_bf16;                         /* prepacked B already in bf16 pairs (each sliver [K/2][NR] lanes at its f32 place) */
    int64_t a_sliver;                   /* a_bf16: lanes from one A sliver to the next (0: K*MR) */
} gemm_args;

/* ---------- OpenBLAS fallback ---------- */

static atomic_int blas_threads_set;
static int have_avx512(void);

/* OpenBLAS keeps its own threads, which spin for a while after each call and would
 * steal cores from our pool. With the AVX-512 kernel BLAS only sees products too small
 * to split, so it runs on one thread; otherwise it gets as many threads as the pool. */
static void blas_init(void)
{
    if (!atomic_load(&blas_threads_set)) {
        openblas_set_num_threads(have_avx512() ? 1 : kiln_cpu_threads());
        atomic_store(&blas_threads_set, 1);
    }
}

static void scale_c(float *C, int64_t ldc, int64_t M, int64_t N, float beta)
{
    for (int64_t i = 0; i < M; i++) {
        float *c = C + i * ldc;
        if (beta == 0.0f) memset(c, 0, (size_t)N * sizeof *c);
        else if (beta != 1.0f) for (int64_t j = 0; j < N; j++) c[j] *= beta;
    }
}

static void add_bias(const gemm_args *g)
{
    for (int64_t i = 0; i < g->M; i++) {
        float *c = g->C + i * g->ldc;
        float br = g->bias_row ? g->bias_row[i] : 0.0f;
        for (int64_t j = 0; j < g->N; j++) c[j] += br + (g->bias_col ? g->bias_col[j] : 0.0f);
    }
}

/* f32 A and B through cblas; f16/bf16 B (only as trans_b, the linear case) converted
 * in panels of 256 rows so the whole weight is never converted at once. Returns -1
 * when the panel cannot be allocated. */
static int blas_gemm(const gemm_args *g)
{
    blas_init();
    if (g->b_dt == KILN_F32) {
        cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans, g->trans_b ? CblasTrans : CblasNoTrans,
                    (int)g->M, (int)g->N, (int)g->K, g->alpha, g->A, (int)g->lda, g->B, (int)g->ldb,
                    g->beta, g->C, (int)g->ldc);
    } else {
        const int64_t rows = 256;
        float *panel = malloc((size_t)rows * (size_t)g->K * sizeof *panel);
        if (!panel) return -1;
        size_t esz = kiln_dtype_size(g->b_dt);
        for (int64_t n0 = 0; n0 < g->N; n0 += rows) {
            int64_t nb = g->N - n0 < rows ? g->N - n0 : rows;
            for (int64_t j = 0; j < nb; j++)
                kiln_to_f32(panel + j * g->K, (const char *)g->B + (size_t)((n0 + j) * g->ldb) * esz, g->b_dt,
                            (size_t)g->K);
            cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans, CblasTrans, (int)g->M, (int)nb,
                        (int)g->K, g->alpha, g->A, (int)g->lda, panel, (int)g->K, g->beta, g->C + n0, (int)g->ldc);
        }
        free(panel);
    }
    if (g->bias_row || g->bias_col) add_bias(g);
    return 0;
}

/* ---------- packed AVX-512 kernel ---------- */
#ifdef GEMM_X86

/* KILN_CPU_ISA=generic|avx2 caps the kernel set (cpu_isa.h): tests and benches run
 * the OpenBLAS fallback that way */
static int have_avx512(void) { return kiln_cpu_isa() == ISA_AVX512; }

static inline float elem_f32(const void *base, kiln_dtype dt, int64_t idx)
{
    if (dt == KILN_F32) return ((const float *)base)[idx];
    if (dt == KILN_F16) return kiln_f16_to_f32(((const uint16_t *)base)[idx]);
    return kiln_bf16_to_f32(((const uint16_t *)base)[idx]);
}

/* Packs rows [i0, i0+m) x depth [k0, k0+kc) of op(A) into ap[k][MR] (rows past m zero). */
static void pack_a(float *restrict ap, const gemm_args *g, int64_t i0, int m, int64_t k0, int64_t kc)
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

/* 16 elements of a f32/f16/bf16 row starting at src (n <= 16 valid, rest zero). */
AVX512 static inline __m512 load16(const void *src, kiln_dtype dt, int n)
{
    if (n <= 0) return _mm512_setzero_ps();
    __mmask16 mk = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    if (dt == KILN_F32) return _mm512_maskz_loadu_ps(mk, src);
    __m256i h = _mm256_setzero_si256();
    if (n >= 16) h = _mm256_loadu_si256((const __m256i *)src);
    else memcpy(&h, src, (size_t)n * 2);
    if (dt == KILN_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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

static int lowbit_dt(kiln_dtype dt) { return dt == KILN_F8_E4M3FN || dt == KILN_F8_E5M2 || kiln_dtype_is_blocked(dt); }

/* pack_b for a low-bit B (fp8, ggml's block types; rows of W as trans_b, the linear
 * case): each sliver's rows are decoded over the whole blocks that cover [k0, k0+kc)
 * into a buffer on the stack, then transposed 16 x 16 in registers as f32 rows are. */
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
AVX512 static void pack_b(float *restrict bp, const gemm_args *g, int64_t j0, int64_t n, int64_t k0, int64_t kc)
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

/* Where and how a microkernel writes its tile. */
typedef struct {
    float *c; int64_t ldc;
    int m, n;                 /* valid rows (<= MR) and columns (<= NR) */
    float alpha, beta;
    int accumulate;           /* not the first K panel: C += alpha*acc */
    const float *bias_row;    /* last K panel only: + bias_row[r], NULL if none */
    const float *bias_col;    /* last K panel only: + bias_col[j], NULL if none */
} tile_out;

/* C = alpha*acc (+ beta*C, or + C when accumulating) (+ biases). */
AVX512 static void store_tile(const tile_out *o, const __m512 *lo, const __m512 *hi)
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

/* The tile's lines of C, fetched for writing at the start of a bf16 tile: store_tile
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

#define UKR_ZERO()                                                                                             \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;            \
    __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, b0_ = a0, b1_ = a0, b2_ = a0, b3_ = a0, b4_ = a0, b5_ = a0;   \
    __m512 b6_ = a0, b7_ = a0, b8_ = a0, b9_ = a0, b10_ = a0, b11_ = a0;

#define UKR_STORE(o)                                                                                           \
    __m512 lo[MR] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};                                        \
    __m512 hi[MR] = {b0_, b1_, b2_, b3_, b4_, b5_, b6_, b7_, b8_, b9_, b10_, b11_};                            \
    store_tile(o, lo, hi);

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
        store_tile(&oq, lo, hi);
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
    store_tile(o0, acc, z);
    store_tile(o1, acc + MR, z);
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
#undef UKR_ZERO
#undef UKR_STORE

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

AVX512 static void run_block_bf16(const gemm_args *g, float *bpanel, float *asliver, int64_t i0, int64_t i1,
                                  int64_t j0, int64_t j1);

/* The block of C rows [i0, i1) x columns [j0, j1), all of K. */
AVX512 static void run_block(const gemm_args *g, float *bpanel, float *asliver, int64_t i0, int64_t i1, int64_t j0,
                             int64_t j1)
{
    if (g->bf16) {
        run_block_bf16(g, bpanel, asliver, i0, i1, j0, j1);
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
        if (!g->b_packed) pack_b(bpanel, g, j0, n, k0, kc);
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
                if (g->trans_a) pack_a(asliver, g, i, m, k0, kc);
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
            pack_a(tmp, g, i0, m, k0 + c, cn);
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

#define UKR_ZERO()                                                                                             \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;            \
    __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, b0_ = a0, b1_ = a0, b2_ = a0, b3_ = a0, b4_ = a0, b5_ = a0;   \
    __m512 b6_ = a0, b7_ = a0, b8_ = a0, b9_ = a0, b10_ = a0, b11_ = a0;

#define UKR_STORE(o)                                                                                           \
    __m512 lo[MR] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};                                        \
    __m512 hi[MR] = {b0_, b1_, b2_, b3_, b4_, b5_, b6_, b7_, b8_, b9_, b10_, b11_};                            \
    store_tile(o, lo, hi);

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
            store_tile(&oq, lo, hi);                                                                           \
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
#undef UKR_ZERO
#undef UKR_STORE

/* run_block in bf16: B panels of at most NB_MAX columns and KCB depths rounded once per
 * panel, each A sliver once per panel and column chunk. bpanel: the f32 packing scratch
 * (KC x NB_MAX floats; NULL for prepacked B), filled KC depths at a time. */
AVX512 static void run_block_bf16(const gemm_args *g, float *bpanel, float *asliver, int64_t i0, int64_t i1,
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
                    pack_b(bpanel, g, jc, n, k0 + c, cn);
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

typedef struct {
    const gemm_args *g;
    int64_t mb, nb, n_nblk;     /* block sizes, number of column blocks */
    float *scratch;             /* per thread: KC*nb floats of B panel + KC*MR of A sliver */
    size_t per_thread;          /* floats */
} task_ctx;

static void task_fn(void *vctx, int64_t begin, int64_t end)
{
    task_ctx *t = vctx;
    const gemm_args *g = t->g;
    /* prepacked operands need no scratch (NULL) */
    float *bpanel = t->scratch ? t->scratch + (size_t)kiln_thread_index() * t->per_thread : NULL;
    float *asliver = bpanel ? bpanel + (size_t)KC * (size_t)t->nb : NULL;
    for (int64_t task = begin; task < end; task++) {
        int64_t bi = task / t->n_nblk, bj = task % t->n_nblk;
        int64_t i0 = bi * t->mb, j0 = bj * t->nb;
        int64_t i1 = i0 + t->mb < g->M ? i0 + t->mb : g->M;
        int64_t j1 = j0 + t->nb < g->N ? j0 + t->nb : g->N;
        run_block(g, bpanel, asliver, i0, i1, j0, j1);
    }
}

static size_t per_thread_floats(int64_t nb) { return (size_t)KC * (size_t)nb + (size_t)KC * MR + 16; }

/* Block sizes, from a cost model in cycles: a task's multiply-adds (16 per cycle), the
 * tasks run in rounds of `threads`, and the overheads of a split: every row block packs
 * its column block's B panels again (f16 conversion included, ~1 cycle per element) and
 * every column block reads its rows of A again (~1/4 cycle per element). Columns go in
 * blocks of 2 .. NB_MAX/NR slivers (3 when <= 8 rows use the 4 x 96 kernel), rows in
 * halvings down to 4 slivers. At SD's shapes, splitting columns rather than rows where M
 * is small (256 tokens) and keeping the B panel <= 480 KB (NB_MAX 320) is what brings the
 * linear layers near the FMA peak (README: speed). */
static void choose_blocks(int64_t M, int64_t N, int64_t K, int threads, int64_t *mb, int64_t *nb)
{
    int64_t ns = (N + NR - 1) / NR, sm = (M + MR - 1) / MR; /* slivers of columns, of rows */
    int64_t min_s = M <= 8 ? 3 : 2, max_s = NB_MAX / NR;
    if (min_s > ns) min_s = ns;
    double best = -1;
    *nb = (min_s < 1 ? 1 : min_s) * NR;
    *mb = sm * MR;
    if (threads <= 1) { /* one task: the widest column blocks, all rows (what the model picks, without the search) */
        *nb = (ns < max_s ? ns : max_s) * NR;
        return;
    }
    for (int64_t per = min_s; per <= max_s && per <= ns; per++) {
        int64_t ncb = (ns + per - 1) / per;
        for (int64_t rows = sm;;) {
            int64_t nrb = (sm + rows - 1) / rows, tasks = ncb * nrb;
            double work = (double)rows * MR * (double)per * NR * (double)K / 16.0;
            double span = (double)((tasks + threads - 1) / threads) * work;
            double pack = (double)nrb * (double)N * (double)K;
            double aload = (double)ncb * (double)M * (double)K * 0.25;
            double cost = span + (pack + aload) / threads;
            if (best < 0 || cost < best) {
                best = cost;
                *nb = per * NR;
                *mb = rows * MR;
            }
            if (rows <= 4) break;
            rows = (rows + 1) / 2;
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

/* Runs g on the pool (serially when called from a pool worker); -1 when no scratch. */
static int packed_gemm(const gemm_args *g, float *scratch, int threads)
{
    task_ctx t;
    choose_blocks(g->M, g->N, g->K, threads, &t.mb, &t.nb);
    t.n_nblk = (g->N + t.nb - 1) / t.nb;
    gemm_args ga;
    uint32_t *a_round = NULL;
    if (g->bf16 && !g->a_packed && t.n_nblk > 1) {
        int64_t kp = (g->K + 1) / 2, ns = (g->M + MR - 1) / MR;
        a_round = kiln_cpu_scratch_get((size_t)(ns * kp * MR) * sizeof(uint32_t));
        if (a_round) { /* else every block rounds its own slivers */
            a_round_ctx rc = {g, a_round, kp};
            kiln_parallel_for(ns, 1, a_round_fn, &rc);
            ga = *g;
            ga.A = a_round;
            ga.a_packed = ga.a_bf16 = 1;
            ga.a_sliver = kp * MR;
            g = &ga;
        }
    }
    t.g = g;
    t.per_thread = g->a_packed && g->b_packed ? 0 : per_thread_floats(t.nb);
    float *own = NULL;
    if (!scratch && t.per_thread) {
        own = kiln_cpu_scratch_get((size_t)threads * t.per_thread * sizeof(float));
        if (!own) return -1;
        scratch = own;
    }
    t.scratch = scratch;
    int64_t n_tasks = ((g->M + t.mb - 1) / t.mb) * t.n_nblk;
    kiln_parallel_for(n_tasks, 1, task_fn, &t);
    kiln_cpu_scratch_put(own);
    kiln_cpu_scratch_put(a_round);
    return 0;
}

#else
static int have_avx512(void) { return 0; }
static int packed_gemm(const gemm_args *g, float *scratch, int threads)
{
    (void)g; (void)scratch; (void)threads;
    return -1;
}
static void choose_blocks(int64_t M, int64_t N, int64_t K, int threads, int64_t *mb, int64_t *nb)
{
    (void)threads; (void)K;
    *mb = M;
    *nb = N;
}
static size_t per_thread_floats(int64_t nb) { return (size_t)nb; }
#endif

/* ---------- entry points ---------- */

static atomic_int bf16_emulate; /* tests: the emulated bf16 kernel even where vdpbf16ps exists */

void kiln_cpu_bf16_set_emulation(int on) { atomic_store(&bf16_emulate, on != 0); }

/* How a product of M rows runs under the current precision: 0 f32, 1 bf16 on
 * vdpbf16ps, 2 bf16 emulated. Only the packed AVX-512 kernel has a bf16 form: the
 * OpenBLAS path (CPUs without AVX-512, and products under SMALL_MACS) stays f32, and so
 * do products of at most 8 rows, bound by reading the weights (the 4 x 96 tile), which
 * rounding would not speed up. */
static int bf16_mode(int64_t M)
{
    if (M <= 8 || !have_avx512() || kiln_precision_for(NULL) != KILN_PREC_BF16) return 0;
    return kiln_cpu_has_bf16() && !atomic_load_explicit(&bf16_emulate, memory_order_relaxed) ? 1 : 2;
}

int kiln_cpu_bf16_active(void) { return bf16_mode(MR); }

/* Handles the degenerate shapes BLAS leaves to the caller; returns 1 when done. */
static int trivial(const gemm_args *g)
{
    if (g->M <= 0 || g->N <= 0) return 1;
    if (g->K <= 0 || g->alpha == 0.0f) {
        scale_c(g->C, g->ldc, g->M, g->N, g->beta);
        if (g->bias_row || g->bias_col) add_bias(g);
        return 1;
    }
    return 0;
}

/* Below this many multiply-adds one thread of OpenBLAS wins: no packing, no pool
 * wake-up. */
static const double SMALL_MACS = 32.0 * 32.0 * 32.0;

static void gemm_dispatch(const gemm_args *g)
{
    if (trivial(g)) return;
    double macs = (double)g->M * (double)g->N * (double)g->K;
    if (have_avx512() && macs >= SMALL_MACS && packed_gemm(g, NULL, kiln_cpu_threads()) == 0) return;
    if (blas_gemm(g) == 0) return;
    /* no memory for a conversion panel: element by element (slow, but correct) */
    for (int64_t i = 0; i < g->M; i++)
        for (int64_t j = 0; j < g->N; j++) {
            double s = 0;
            for (int64_t k = 0; k < g->K; k++) {
                float a = ((const float *)g->A)[g->trans_a ? k * g->lda + i : i * g->lda + k];
                int64_t bi = g->trans_b ? j * g->ldb + k : k * g->ldb + j;
                float b = g->b_dt == KILN_F32 ? ((const float *)g->B)[bi]
                        : g->b_dt == KILN_F16 ? kiln_f16_to_f32(((const uint16_t *)g->B)[bi])
                                              : kiln_bf16_to_f32(((const uint16_t *)g->B)[bi]);
                s += (double)a * b;
            }
            float *c = g->C + i * g->ldc + j;
            *c = (float)(g->alpha * s) + (g->beta == 0.0f ? 0.0f : g->beta * *c) +
                 (g->bias_row ? g->bias_row[i] : 0.0f) + (g->bias_col ? g->bias_col[j] : 0.0f);
        }
}

int kiln_cpu_gemm_have_simd(void) { return have_avx512(); }

/* C[M,N] = A[M,K] (f32/f16/bf16, row-major, lda) * B + bias_row[i], where B is
 * produced panel by panel by pack_b. Returns -1 (nothing written) when the SIMD kernel
 * is unavailable or scratch cannot be allocated; the caller then takes another path. */
int kiln_cpu_gemm_ex(int64_t M, int64_t N, int64_t K, const void *A, kiln_dtype a_dt, int64_t lda,
                     pack_b_fn pack_b, void *pack_ctx, float *C, int64_t ldc, const float *bias_row)
{
    gemm_args g = {.M = M, .N = N, .K = K, .alpha = 1.0f, .A = A, .lda = lda, .a_dt = a_dt, .b_dt = KILN_F32,
                   .pack_b = pack_b, .pack_ctx = pack_ctx, .C = C, .ldc = ldc, .bias_row = bias_row,
                   .bf16 = bf16_mode(M)};
    if (!have_avx512()) return -1;
    if (trivial(&g)) return 0;
    return packed_gemm(&g, NULL, kiln_cpu_threads());
}

void kiln_cpu_gemm_f32(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const float *A, int64_t lda, const float *B, int64_t ldb,
                       float beta, float *C, int64_t ldc)
{
    gemm_args g = {.trans_a = trans_a, .trans_b = trans_b, .M = M, .N = N, .K = K, .alpha = alpha, .beta = beta,
                   .A = A, .lda = lda, .a_dt = KILN_F32, .B = B, .ldb = ldb, .b_dt = KILN_F32, .C = C, .ldc = ldc,
                   .bf16 = bf16_mode(M)};
    gemm_dispatch(&g);
}

typedef struct {
    gemm_args g;
    int64_t stride_a, stride_b, stride_c;
    float *scratch;
} batch_ctx;

static void batch_fn(void *vctx, int64_t begin, int64_t end)
{
    batch_ctx *b = vctx;
    for (int64_t i = begin; i < end; i++) {
        gemm_args g = b->g;
        g.A = (const float *)g.A + i * b->stride_a;
        g.B = (const float *)g.B + i * b->stride_b;
        g.C += i * b->stride_c;
        /* inside a pool job: runs serially on this thread, in its slot of the scratch;
         * prepacked operands (Winograd's 36 products a strip, thousands a layer) go
         * straight to the kernel loop */
#ifdef GEMM_X86
        if (g.a_packed && g.b_packed) {
            run_block(&g, NULL, NULL, 0, g.M, 0, g.N);
            continue;
        }
#endif
        packed_gemm(&g, b->scratch, 1);
    }
}

void kiln_cpu_gemm_batched_f32(int trans_a, int trans_b, int64_t batch, int64_t M, int64_t N, int64_t K,
                               float alpha, const float *A, int64_t lda, int64_t stride_a,
                               const float *B, int64_t ldb, int64_t stride_b,
                               float beta, float *C, int64_t ldc, int64_t stride_c)
{
    if (batch <= 0) return;
    gemm_args g = {.trans_a = trans_a, .trans_b = trans_b, .M = M, .N = N, .K = K, .alpha = alpha, .beta = beta,
                   .A = A, .lda = lda, .a_dt = KILN_F32, .B = B, .ldb = ldb, .b_dt = KILN_F32, .C = C, .ldc = ldc,
                   .bf16 = bf16_mode(M)};
    int threads = kiln_cpu_threads();
    double macs = (double)M * (double)N * (double)K;
    /* Many products (or several small ones): one whole product per task, each on one
     * thread, no sharing. Few large ones: one after another, each split over the pool. */
    int per_thread = batch >= 4 * (int64_t)threads || (batch >= threads && macs < 8.0 * 1024 * 1024);
    if (have_avx512() && threads > 1 && per_thread && !trivial(&g) && macs >= SMALL_MACS / 8) {
        int64_t mb, nb;
        choose_blocks(M, N, K, 1, &mb, &nb);
        batch_ctx b = {g, stride_a, stride_b, stride_c, NULL};
        b.scratch = kiln_cpu_scratch_get((size_t)threads * per_thread_floats(nb) * sizeof(float));
        if (b.scratch) {
            kiln_parallel_for(batch, 1, batch_fn, &b);
            kiln_cpu_scratch_put(b.scratch);
            return;
        }
    }
    for (int64_t i = 0; i < batch; i++) {
        gemm_args gi = g;
        gi.A = A + i * stride_a;
        gi.B = B + i * stride_b;
        gi.C = C + i * stride_c;
        gemm_dispatch(&gi);
    }
}

/* Batched C_b[M,N] = A_b B_b for operands already in the kernel's sliver layout: A as
 * ceil(M/12) slivers of K x 12 floats (row r of sliver s is row 12s+r, zero past M),
 * B as ceil(N/32) slivers of K x 32 floats (zero past N). Winograd writes its
 * transforms this way and skips packing. -1 without the SIMD kernel. */
/* One product on the calling thread (no pool, no blocking of its own), for kernels that
 * block their work themselves (conv2d_winograd_few.c): C (M x N, row stride ldc) = A B,
 * or C += A B when accumulate; A row-major f32 (row stride lda); B prepacked in slivers of
 * NR columns, [ceil(N/NR)][K][NR], b_sliver floats apart. scratch: KILN_CPU_GEMM_SERIAL_SCRATCH
 * floats, 64-byte aligned (the A slivers that are packed). -1 without AVX-512. */
int kiln_cpu_gemm_serial(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *Bp,
                         int64_t b_sliver, float *C, int64_t ldc, int accumulate, float *scratch)
{
#ifdef GEMM_X86
    if (!have_avx512()) return -1;
    if (M <= 0 || N <= 0 || K <= 0) return 0;
    gemm_args g = {.M = M, .N = N, .K = K, .alpha = 1.0f, .beta = accumulate ? 1.0f : 0.0f, .A = A, .lda = lda,
                   .a_dt = KILN_F32, .B = Bp, .b_dt = KILN_F32, .C = C, .ldc = ldc, .b_packed = 1,
                   .b_sliver = b_sliver};
    run_block(&g, NULL, scratch, 0, M, 0, N);
    return 0;
#else
    (void)M; (void)N; (void)K; (void)A; (void)lda; (void)Bp; (void)b_sliver; (void)C; (void)ldc;
    (void)accumulate; (void)scratch;
    return -1;
#endif
}

/* kiln_cpu_gemm_serial in bf16 with both operands in pairs (cpu_internal.h). Whole
 * 12-row slivers take the 12 x 32 tile, which reads B once a sliver instead of once
 * every 4 rows: the few-tiles Winograd's B is a U chunk larger than L2 (README: bf16 on
 * the CPU, for 16 to 64 tiles). A sliver of fewer rows goes 4 at a time through the
 * 4 x 96 tile where 96 columns remain, the rest through the 12 x 32 one. */
int kiln_cpu_gemm_serial_bf16(int64_t M, int64_t N, int64_t K, const uint32_t *Ap, int64_t a_sliver,
                              const uint32_t *Bp, int64_t b_sliver, float *C, int64_t ldc, int accumulate)
{
#ifdef GEMM_X86
    int mode = bf16_mode(MR);
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

/* batch products of prepacked operands g (A, B, C of the first; the others strides
 * apart): whole products on the threads when there are enough, else one by one. */
static void prepacked_run(const gemm_args *g, int64_t batch, int64_t stride_a, int64_t stride_b, int64_t stride_c)
{
    int threads = kiln_cpu_threads();
    if (threads > 1 && batch >= threads) {
        batch_ctx b = {*g, stride_a, stride_b, stride_c, NULL};
        kiln_parallel_for(batch, 1, batch_fn, &b);
        return;
    }
    for (int64_t i = 0; i < batch; i++) {
        gemm_args gi = *g;
        gi.A = (const float *)g->A + i * stride_a;
        gi.B = (const float *)g->B + i * stride_b;
        gi.C = g->C + i * stride_c;
        packed_gemm(&gi, NULL, threads);
    }
}

int kiln_cpu_gemm_prepacked(int64_t batch, int64_t M, int64_t N, int64_t K, const float *Ap, int64_t stride_a,
                            const float *Bp, int64_t stride_b, float *C, int64_t ldc, int64_t stride_c)
{
    if (!have_avx512()) return -1;
    gemm_args g = {.M = M, .N = N, .K = K, .alpha = 1.0f, .A = Ap, .a_dt = KILN_F32, .B = Bp, .b_dt = KILN_F32,
                   .C = C, .ldc = ldc, .a_packed = 1, .b_packed = 1, .bf16 = bf16_mode(M)};
    if (batch > 0 && !trivial(&g)) prepacked_run(&g, batch, stride_a, stride_b, stride_c);
    return 0;
}

int kiln_cpu_gemm_prepacked_bf16(int64_t batch, int64_t M, int64_t N, int64_t K, const uint32_t *Ap,
                                  int64_t stride_a, const uint32_t *Bp, int64_t stride_b, float *C, int64_t ldc,
                                  int64_t stride_c)
{
    if (!have_avx512()) return -1;
    gemm_args g = {.M = M, .N = N, .K = K, .alpha = 1.0f, .A = Ap, .a_dt = KILN_F32, .B = Bp, .b_dt = KILN_F32,
                   .C = C, .ldc = ldc, .a_packed = 1, .b_packed = 1, .bf16 = bf16_mode(MR), .a_bf16 = 1, .b_bf16 = 1};
    if (!g.bf16) return -1;
    if (batch > 0 && !trivial(&g)) prepacked_run(&g, batch, stride_a, stride_b, stride_c);
    return 0;
}

void kiln_cpu_bf16_pairs_b(uint32_t *B, int64_t n, int64_t K, int64_t stride)
{
#ifdef GEMM_X86
    if (have_avx512()) {
        int native = bf16_mode(MR) == 1;
        for (int64_t s = 0; s * NR < n; s++) { /* in place: bf16_rows reads rows 2j, 2j+1 before writing pair row j */
            bf16_rows(B + s * stride, NR, (const float *)(B + s * stride), NR, K, 16, native);
            bf16_rows(B + s * stride + 16, NR, (const float *)(B + s * stride) + 16, NR, K, 16, native);
        }
    }
#else
    (void)B; (void)n; (void)K; (void)stride;
#endif
}

/* Low-bit weights (fp8, ggml's block types): rows of W are decoded to f32 a panel
 * at a time (about 4 MB, in parallel), and each panel is one product writing its
 * columns of y, so no more than a panel of the weight ever exists in f32. */
typedef struct { float *panel; const char *w; kiln_dtype dt; int64_t n0, K; } decode_ctx;

static void decode_rows(void *p, int64_t r0, int64_t r1)
{
    const decode_ctx *c = p;
    for (int64_t r = r0; r < r1; r++)
        kiln_to_f32(c->panel + r * c->K, c->w + kiln_dtype_nbytes(c->dt, (c->n0 + r) * c->K), c->dt, (size_t)c->K);
}

static kiln_status linear_lowbit(float *y, const float *x, const void *w, kiln_dtype dt, const float *bias,
                                 int64_t M, int64_t N, int64_t K)
{
    if (K % kiln_dtype_block(dt))
        return kiln_error(KILN_ERR_ARG, "linear: %s weight rows of %lld are not whole blocks of %d", kiln_dtype_name(dt),
                          (long long)K, kiln_dtype_block(dt));
    int64_t nb = ((int64_t)1 << 20) / (K ? K : 1);
    nb = nb < 32 ? 32 : nb / 32 * 32;
    if (nb > N) nb = N;
    float *panel = kiln_cpu_scratch_get((size_t)(nb * K) * sizeof(float));
    if (!panel) return kiln_error(KILN_ERR_OOM, "linear: no memory for a %lld x %lld weight panel", (long long)nb, (long long)K);
    for (int64_t n0 = 0; n0 < N; n0 += nb) {
        int64_t rows = N - n0 < nb ? N - n0 : nb;
        decode_ctx c = {panel, w, dt, n0, K};
        kiln_parallel_for(rows, 8, decode_rows, &c);
        gemm_args g = {.trans_b = 1, .M = M, .N = rows, .K = K, .alpha = 1.0f, .A = x, .lda = K, .a_dt = KILN_F32,
                       .B = panel, .ldb = K, .b_dt = KILN_F32, .C = y + n0, .ldc = N,
                       .bias_col = bias ? bias + n0 : NULL, .bf16 = bf16_mode(M)};
        gemm_dispatch(&g);
    }
    kiln_cpu_scratch_put(panel);
    return KILN_OK;
}

kiln_status kiln_cpu_linear(float *y, const float *x, const void *w, kiln_dtype w_dtype,
                            const float *bias, int64_t M, int64_t N, int64_t K)
{
    int lowbit = w_dtype == KILN_F8_E4M3FN || w_dtype == KILN_F8_E5M2 || kiln_dtype_is_blocked(w_dtype);
    if (w_dtype != KILN_F32 && w_dtype != KILN_F16 && w_dtype != KILN_BF16 && !lowbit)
        return kiln_error(KILN_ERR_UNSUPPORTED, "linear: weight dtype %s (expected a float type: f32, f16, bf16, fp8 "
                          "or a ggml block type)", kiln_dtype_name(w_dtype));
    if (M < 0 || N < 0 || K < 0)
        return kiln_error(KILN_ERR_ARG, "linear: negative size M=%lld N=%lld K=%lld", (long long)M, (long long)N,
                          (long long)K);
    if (M == 0 || N == 0) return KILN_OK;
    if (!y || !x || (!w && K > 0)) return kiln_error(KILN_ERR_ARG, "linear: NULL buffer");
    if (lowbit) {
        /* the packed kernel decodes while packing B; elsewhere, decoded panels */
        gemm_args g = {.trans_b = 1, .M = M, .N = N, .K = K, .alpha = 1.0f, .A = x, .lda = K, .a_dt = KILN_F32,
                       .B = w, .ldb = K, .b_dt = w_dtype, .C = y, .ldc = N, .bias_col = bias, .bf16 = bf16_mode(M)};
        if (K % kiln_dtype_block(w_dtype) == 0 && have_avx512() && (double)M * (double)N * (double)K >= SMALL_MACS &&
            packed_gemm(&g, NULL, kiln_cpu_threads()) == 0)
            return KILN_OK;
        return linear_lowbit(y, x, w, w_dtype, bias, M, N, K);
    }
    /* f16/bf16 weights are converted while packing B, one KC x NB panel at a time (on
     * the BLAS path, 256 rows at a time); the bias is added as C is stored. */
    gemm_args g = {.trans_b = 1, .M = M, .N = N, .K = K, .alpha = 1.0f, .A = x, .lda = K, .a_dt = KILN_F32,
                   .B = w, .ldb = K, .b_dt = w_dtype, .C = y, .ldc = N, .bias_col = bias, .bf16 = bf16_mode(M)};
    gemm_dispatch(&g);
    return KILN_OK;
}
