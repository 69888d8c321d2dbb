/* gemm_internal.h - what the GEMM files share and nothing else includes (cpu_internal.h
 * is what the other kernels use): the product's arguments, the tile sizes, the tile
 * store and the packing that both the f32 and the bf16 kernels use, and the small
 * helpers they inline. Functions here are hidden like every non-API symbol. */
#ifndef KILN_GEMM_INTERNAL_H
#define KILN_GEMM_INTERNAL_H

#include "cpu_isa.h"
#include "cpu_internal.h"

#include <stdint.h>
#include <string.h>

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
    int bf16;                           /* 0 f32; bf16 inputs: 1 vdpbf16ps, 2 emulated (see kiln_cpu_bf16_mode) */
    int a_bf16;                         /* prepacked A already in bf16 pairs (the Winograd weight transform writes them) */
    int b_bf16;                         /* prepacked B already in bf16 pairs (each sliver [K/2][NR] lanes at its f32 place) */
    int64_t a_sliver;                   /* a_bf16: lanes from one A sliver to the next (0: K*MR) */
} gemm_args;

/* ---- the packed AVX-512 kernel (gemm_f32.c, gemm_bf16.c) ---- */

#ifdef GEMM_X86

/* KILN_CPU_ISA=generic|avx2 caps the kernel set (cpu_isa.h): tests and benches run
 * the OpenBLAS fallback that way */
static inline int have_avx512(void) { return kiln_cpu_isa() == ISA_AVX512; }

static inline int lowbit_dt(kiln_dtype dt)
{
    return dt == KILN_F8_E4M3FN || dt == KILN_F8_E5M2 || kiln_dtype_is_blocked(dt);
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

/* Where and how a microkernel writes its tile. */
typedef struct {
    float *c; int64_t ldc;
    int m, n;                 /* valid rows (<= MR) and columns (<= NR) */
    float alpha, beta;
    int accumulate;           /* not the first K panel: C += alpha*acc */
    const float *bias_row;    /* last K panel only: + bias_row[r], NULL if none */
    const float *bias_col;    /* last K panel only: + bias_col[j], NULL if none */
} tile_out;

#define UKR_ZERO()                                                                                             \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;            \
    __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, b0_ = a0, b1_ = a0, b2_ = a0, b3_ = a0, b4_ = a0, b5_ = a0;   \
    __m512 b6_ = a0, b7_ = a0, b8_ = a0, b9_ = a0, b10_ = a0, b11_ = a0;

#define UKR_STORE(o)                                                                                           \
    __m512 lo[MR] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};                                        \
    __m512 hi[MR] = {b0_, b1_, b2_, b3_, b4_, b5_, b6_, b7_, b8_, b9_, b10_, b11_};                            \
    kiln_cpu_gemm_store_tile(o, lo, hi);

/* gemm_f32.c */

/* C = alpha*acc (+ beta*C, or + C when accumulating) (+ biases). */
AVX512 void kiln_cpu_gemm_store_tile(const tile_out *o, const __m512 *lo, const __m512 *hi);
/* Packs rows [i0, i0+m) x depth [k0, k0+kc) of op(A) into ap[k][MR] (rows past m zero). */
void kiln_cpu_gemm_pack_a(float *restrict ap, const gemm_args *g, int64_t i0, int m, int64_t k0, int64_t kc);
/* Packs columns [j0, j0+n) x depth [k0, k0+kc) of op(B) into bp[k][NR] slivers of
 * NR columns each (columns past n zero), converting to f32 on the way. */
AVX512 void kiln_cpu_gemm_pack_b(float *restrict bp, const gemm_args *g, int64_t j0, int64_t n, int64_t k0, int64_t kc);
/* The block of C rows [i0, i1) x columns [j0, j1), all of K; bf16 products go on to
 * kiln_cpu_gemm_run_block_bf16. bpanel / asliver: the packing scratch (NULL for
 * prepacked operands). */
AVX512 void kiln_cpu_gemm_run_block(const gemm_args *g, float *bpanel, float *asliver, int64_t i0, int64_t i1,
                                    int64_t j0, int64_t j1);

/* gemm_bf16.c */

/* kiln_cpu_gemm_run_block in bf16 (g->bf16 set). */
AVX512 void kiln_cpu_gemm_run_block_bf16(const gemm_args *g, float *bpanel, float *asliver, int64_t i0, int64_t i1,
                                         int64_t j0, int64_t j1);
/* A (ns slivers of MR rows) rounded once, on the pool, into bf16 pair slivers kp * MR
 * lanes apart at dst: for products whose column blocks would each round it again. */
void kiln_cpu_gemm_round_a_bf16(const gemm_args *g, uint32_t *dst, int64_t kp, int64_t ns);

#else
static inline int have_avx512(void) { return 0; }
#endif /* GEMM_X86 */

/* gemm_bf16.c: how a product of M rows runs under the current precision: 0 f32, 1 bf16
 * on vdpbf16ps, 2 bf16 emulated. */
int kiln_cpu_bf16_mode(int64_t M);

#endif
