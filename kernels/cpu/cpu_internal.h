/* cpu_internal.h - what the CPU kernel files share with each other and not with the
 * runtime (cpu_kernels.h is the backend's API): the GEMM entry points (gemm.c, their
 * bf16 forms in gemm_bf16.c) that the convolutions build on, the scratch cache
 * (gemm_scratch.c), and the convolution paths conv2d.c chooses between. */
#ifndef KILN_CPU_INTERNAL_H
#define KILN_CPU_INTERNAL_H

#include "cpu_kernels.h"

#include <stddef.h>
#include <stdint.h>

/* ---- gemm.c, gemm_bf16.c ---- */

/* Packs columns [j0, j0+n) x depth [k0, k0+kc) of B into ceil(n/32) slivers of kc x 32
 * floats each (dst[s][k][0..31]), zero past n: a custom B source (implicit im2col). */
typedef void (*pack_b_fn)(void *ctx, float *dst, int64_t j0, int64_t n, int64_t k0, int64_t kc);

/* C (M x N, ldc) = A (f32/f16/bf16, row-major, lda) x B (from pack_b) (+ bias_row[i]),
 * on the pool; -1 without AVX-512 or scratch. */
int kiln_cpu_gemm_ex(int64_t M, int64_t N, int64_t K, const void *A, kiln_dtype a_dt, int64_t lda,
                     pack_b_fn pack_b, void *pack_ctx, float *C, int64_t ldc, const float *bias_row);
/* 1 when the packed AVX-512 kernels run on this CPU. */
int kiln_cpu_gemm_have_simd(void);
/* 1 when products with more than 8 rows run with bf16 inputs (precision bf16 and the
 * packed AVX-512 kernel); kiln_cpu_bf16_set_emulation(1) makes them take the emulated
 * kernel even where the CPU has vdpbf16ps (tests compare the two). */
int kiln_cpu_bf16_active(void);
void kiln_cpu_bf16_set_emulation(int on);
/* batch products of A and B both already in sliver layout (A [M/12][K][12], B
 * [N/32][K][32]), each C row-major with row stride ldc. */
int kiln_cpu_gemm_prepacked(int64_t batch, int64_t M, int64_t N, int64_t K, const float *Ap, int64_t stride_a,
                            const float *Bp, int64_t stride_b, float *C, int64_t ldc, int64_t stride_c);
/* kiln_cpu_gemm_prepacked with both operands in bf16 pairs (lanes: depth 2j in the low
 * half, 2j+1 in the high half of pair row j, nearest even), each sliver at its f32
 * place: A [ceil(K/2)][12] lanes K*12 apart, B [ceil(K/2)][32] lanes K*32 apart.
 * -1 when bf16 products are not active. */
int kiln_cpu_gemm_prepacked_bf16(int64_t batch, int64_t M, int64_t N, int64_t K, const uint32_t *Ap,
                                  int64_t stride_a, const uint32_t *Bp, int64_t stride_b, float *C, int64_t ldc,
                                  int64_t stride_c);
/* Rounds the B slivers of n columns ([K][32] floats each, stride floats apart) to those
 * pairs in place. */
void kiln_cpu_bf16_pairs_b(uint32_t *B, int64_t n, int64_t K, int64_t stride);
/* One product on the calling thread (see gemm.c); scratch holds this many floats.
 * f32 products. */
enum { KILN_CPU_GEMM_SERIAL_SCRATCH = 384 * 12 + 16 };
/* The same product with bf16 inputs (kiln.precision "bf16"), both operands already in
 * bf16 pairs (32-bit lanes: depth 2r in the low half, 2r+1 in the high half of pair row
 * r, rounded to nearest even; an odd K's last high half zero): A as ceil(M/12) slivers
 * [ceil(K/2)][12], a_sliver lanes apart (kiln_cpu_bf16_pack_rows); B as ceil(N/32)
 * slivers [ceil(K/2)][32], b_sliver lanes apart. -1 when bf16 products are not active. */
int kiln_cpu_gemm_serial_bf16(int64_t M, int64_t N, int64_t K, const uint32_t *Ap, int64_t a_sliver,
                              const uint32_t *Bp, int64_t b_sliver, float *C, int64_t ldc, int accumulate);
/* A linear layer's weight W (N x K, row-major f32 / f16 / bf16) as those B slivers,
 * [ceil(N/32)][ceil(K/2)][32] lanes, one after another (kiln_cpu_bf16_weight_pairs_bytes),
 * on the pool: what the bf16 product would round at every call, kept by the backend
 * (kiln_cpu_bf16_cache_plan) and read in place by kiln_cpu_linear_bf16_pairs. -1 when bf16
 * products are not active or dt is not one of those. */
size_t kiln_cpu_bf16_weight_pairs_bytes(int64_t N, int64_t K);
int kiln_cpu_bf16_weight_pairs(uint32_t *dst, const void *W, kiln_dtype dt, int64_t N, int64_t K);
/* y[M,N] = x[M,K] (f32, row-major) W^T + bias over W in those pairs: the same sums as
 * kiln_cpu_linear in bf16 (the same kernel, panels and rounding). -1 when the bf16 kernel
 * does not take the product (bf16 not active for M rows, too small, no scratch): the
 * caller runs kiln_cpu_linear. */
int kiln_cpu_linear_bf16_pairs(float *y, const float *x, const uint32_t *Wp, const float *bias, int64_t M, int64_t N,
                               int64_t K);
/* How kiln_cpu_linear_bf16_pairs runs a product of that size: 0 not at all (bf16 not
 * active for M rows, no AVX-512, below the packed kernel's size), 1 vdpbf16ps, 2 emulated. */
int kiln_cpu_linear_bf16_pairs_mode(int64_t M, int64_t N, int64_t K);
/* Rows of a row-major f32 A (M x K, row stride lda) into those A slivers. */
void kiln_cpu_bf16_pack_rows(uint32_t *dst, int64_t a_sliver, const float *A, int64_t lda, int64_t M, int64_t K);
int kiln_cpu_gemm_serial(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *Bp,
                         int64_t b_sliver, float *C, int64_t ldc, int accumulate, float *scratch);

/* ---- gemm_int8.c ---- */

/* 1 when the int8 products can run: AVX512-VNNI (vpdpbusd) and the AVX-512 kernels on
 * (KILN_CPU_ISA caps them), and not disabled by kiln_cpu_int8_set_disabled (tests). */
int kiln_cpu_has_vnni(void);
void kiln_cpu_int8_set_disabled(int off);
/* y[M,N] = x[M,K] w[N,K]^T + bias in W8A8 (gemm_int8.c's header: the quantization and
 * its error bound); w q8_0, f32, f16, bf16 or fp8. 0 done, 1 not applicable (no VNNI,
 * q8_0 with K not a multiple of 32, another dtype: the caller takes another path), -1 out of
 * scratch. */
int kiln_cpu_linear_int8(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias, int64_t M,
                         int64_t N, int64_t K);
/* The weights' packed form (quantized, in the kernel's panels): its bytes (0 when the
 * int8 product does not apply to N, K, w_dtype or this CPU), the packing into a 64-byte
 * aligned buffer of that size (0 done, 1 not applicable), and the product over it (as
 * kiln_cpu_linear_int8, the same result; x and y f32, bf16 or f16, contiguous: a bf16
 * x is quantized as read, a bf16 y rounded from the f32 result as kiln_convert does). */
size_t kiln_cpu_int8_packed_bytes(int64_t N, int64_t K, kiln_dtype w_dtype);
int kiln_cpu_int8_pack(void *packed, const void *w, kiln_dtype w_dtype, int64_t N, int64_t K);
int kiln_cpu_linear_int8_packed(void *y, kiln_dtype y_dt, const void *x, kiln_dtype x_dt, const void *packed,
                                const float *bias, int64_t M, int64_t N, int64_t K);
/* A 1x1 convolution (stride 1, no padding, one group) over packed weights [k, c]:
 * y[n, k, hw] = w x[n, c, hw] + bias (+ residual, then leaky ReLU when act), each image
 * turned to pixels-by-channels and back around the same product (the same result as
 * the linear layer over the transposed image). 0 done, 1 not applicable, -1 no scratch. */
int kiln_cpu_conv1x1_int8_packed(float *y, const float *x, const void *packed, const float *bias,
                                 const float *residual, int act, float act_slope, int64_t n, int64_t c, int64_t hw,
                                 int64_t k);
/* Depths per scale of the int8 product over K (gemm_int8.c's header; the tests check
 * their goldens were made for it) */
int64_t kiln_cpu_int8_group(int64_t K);
/* Fewest rows for which precision int8 takes the W8A8 product: with the weights packed
 * at the call (packed_ready 0) or already packed (1). */
int64_t kiln_cpu_int8_min_rows(int packed_ready);

/* ---- gemm_scratch.c ---- */

/* Cached, 64-byte aligned scratch (uninitialized; NULL when out of memory). */
void *kiln_cpu_scratch_get(size_t bytes);
void kiln_cpu_scratch_put(void *p);
void kiln_cpu_scratch_trim(void);
/* Bytes the cache holds (busy or idle), for tests. */
size_t kiln_cpu_scratch_cached(void);

/* ---- convolution paths: 0 done, 1 not applicable / declined, -1 out of memory;
 * forced (KILN_CONV_PATH names the path): run wherever the shape allows, past the
 * size heuristics ---- */

/* Winograd F(4,3) / F(6,3), tiles in vector lanes (conv2d_winograd.c): images of many tiles. */
int kiln_cpu_conv2d_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                             const kiln_conv2d_params *p, int forced);
/* The scratch buffer these paths ask for, bytes, following their own choices (0 where
 * they decline the shape; up2: the fused upsampling's), for kiln_cpu_conv2d_scratch_bound. */
size_t kiln_cpu_conv2d_winograd_scratch(const kiln_conv2d_params *p, int up2, int forced);
size_t kiln_cpu_conv2d_winograd_few_scratch(const kiln_conv2d_params *p, kiln_dtype w_dtype, int forced);
/* The bytes of its U chunks kept in p->cache (bf16 products only), and their variant;
 * 0 where it declines the shape or keeps none. */
size_t kiln_cpu_conv2d_winograd_few_cache(const kiln_conv2d_params *p, kiln_dtype w_dtype, int forced, int *variant);
/* The same path for kiln_cpu_conv2d_up2: F(4,2) on the four parity kernels. */
int kiln_cpu_conv2d_up2_winograd(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                                 int64_t N, int64_t C, int64_t H, int64_t W, int64_t K);
/* Winograd F(4,3), output channels in vector lanes (conv2d_winograd_few.c): few tiles. */
int kiln_cpu_conv2d_winograd_few(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                                 const kiln_conv2d_params *p, int forced);

#endif
