/* cpu_kernels.h - the CPU compute kernels over raw, contiguous buffers.
 * Argument order (the house's, for every kernel): output first (allocated by the caller), then inputs,
 * weights, scratch, scalar parameters. Activations are f32; weights may be f32, f16
 * or bf16 and are converted to f32 block by block inside the kernel (never the
 * whole tensor at once). All kernels use the shared thread pool (threadpool.h).
 * Shapes are validated by the caller (the backend table); kernels assume them. */
#ifndef KILN_CPU_KERNELS_H
#define KILN_CPU_KERNELS_H

#include "../../runtime/backend.h" /* kiln_pad_mode, dtypes */

/* C[M,N] = alpha * op(A) * op(B) + beta * C, row-major, f32 (BLAS sgemm semantics). */
void kiln_cpu_gemm_f32(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const float *A, int64_t lda, const float *B, int64_t ldb,
                       float beta, float *C, int64_t ldc);

/* Batched: for b in [0,batch): C_b = alpha * op(A_b) op(B_b) + beta*C_b, with element
 * strides between batches (stride 0 broadcasts). */
void kiln_cpu_gemm_batched_f32(int trans_a, int trans_b, int64_t batch, int64_t M, int64_t N, int64_t K,
                               float alpha, const float *A, int64_t lda, int64_t stride_a,
                               const float *B, int64_t ldb, int64_t stride_b,
                               float beta, float *C, int64_t ldc, int64_t stride_c);

/* y[M,N] = x[M,K] * W[N,K]^T (+ bias[N]); W is f32/f16/bf16. */
kiln_status kiln_cpu_linear(float *y, const float *x, const void *w, kiln_dtype w_dtype,
                            const float *bias, int64_t M, int64_t N, int64_t K);

typedef struct {
    int64_t n, c, h, w;        /* input [N, C, H, W] */
    int64_t k, r, s;           /* weight [K, C/groups, R, S] */
    int64_t stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups;
    int64_t oh, ow;            /* output [N, K, OH, OW]; filled by kiln_conv2d_out_size */
    /* act 1: leaky ReLU (x < 0: x * act_slope; 0 gives ReLU) over the output, applied by
     * the kernel where it writes the output (Winograd) or in one pass after; 0 none */
    int act;
    float act_slope;
    /* NULL, or [N, K, OH, OW] contiguous (like y, never y itself) added after the bias
     * and before act (a residual block's skip), in the one pass over the output that
     * then applies act too */
    const float *residual;
    /* NULL, or where the caller keeps this layer's weights transformed between calls
     * (kiln_cpu_conv2d_weight_cache_plan says whether a path would use one, and its size) */
    struct kiln_conv2d_cache *cache;
} kiln_conv2d_params;

/* A convolution's transformed weights kept by the caller: data of the planned bytes;
 * ready 1 when it holds them (the kernel reads them instead of transforming the
 * weights), 0 when the kernel is to fill it as it goes; the kernel sets filled when it
 * did (else, a path that declined or ran out of scratch, the buffer holds nothing). */
typedef struct kiln_conv2d_cache {
    void *data;
    int variant;         /* the plan's */
    int ready, filled;
} kiln_conv2d_cache;

/* Bytes of the transformed weights of p's layer that kiln_cpu_conv2d keeps in p->cache
 * under the current precision, and *variant (what else the bytes depend on: the tile,
 * the product kind), or 0 where it keeps none. Today the few-tiles Winograd path's U in
 * bf16 pairs (conv2d_winograd_few.c). */
size_t kiln_cpu_conv2d_weight_cache_plan(const kiln_conv2d_params *p, kiln_dtype w_dt, int *variant);

/* Computes p->oh, p->ow; KILN_ERR_ARG when the output would be empty. */
kiln_status kiln_conv2d_out_size(kiln_conv2d_params *p);
/* y[N,K,OH,OW] = act(conv2d(x, w) + bias + residual), as torch.nn.functional.conv2d
 * (then + p->residual where given, then leaky_relu when p->act). w is f32/f16/bf16. */
kiln_status kiln_cpu_conv2d(float *y, const float *x, const void *w, kiln_dtype w_dtype,
                            const float *bias, const kiln_conv2d_params *p);
/* y[N,K,2H,2W] = conv2d(upsample_nearest(x[N,C,H,W], 2), w[K,C,3,3], padding 1) + bias
 * without the upsampled image (the decoders' Upsample blocks); results as the two ops
 * in a row, to rounding. */
kiln_status kiln_cpu_conv2d_up2(float *y, const float *x, const void *w, kiln_dtype w_dtype, const float *bias,
                                int64_t N, int64_t C, int64_t H, int64_t W, int64_t K);
/* Whether kiln_cpu_conv2d_up2 fuses this shape (else it upsamples into scratch first:
 * callers that track memory upsample into their own tensor instead). */
int kiln_cpu_conv2d_up2_fuses(int64_t C, int64_t H, int64_t W, int64_t K);

/* Memory-efficient attention: out[B,Lq,Dv] = softmax(q k^T * scale) v for contiguous
 * q[B,Lq,D], k[B,Lk,D], v[B,Lk,Dv] (B = batch*heads). Streams over key blocks with an
 * online softmax: extra memory O(block), never Lq x Lk. causal = 1 hides key j from
 * query i when j > i (CLIP's causal mask). */
kiln_status kiln_cpu_attention(float *out, const float *q, const float *k, const float *v,
                               int64_t B, int64_t Lq, int64_t Lk, int64_t D, int64_t Dv,
                               float scale, int causal);

/* y = group_norm(x) over [N, C, HW] with G groups, affine gamma/beta [C] (may be NULL);
 * fuse_silu applies SiLU to the result. */
/* Scratch bytes attention allocates (all threads), for the memory planner. */
size_t kiln_cpu_attention_scratch_bytes(int64_t D, int64_t Dv);

/* ---- scratch: host memory the kernels take for themselves, outside any device's
 * allocator (gemm_scratch.c): counted here, reported in the CPU device's statistics
 * (kiln_mem_stats.workspace / workspace_peak), and bounded from above per call for a
 * dry run's model of the kernels (the *_scratch_bound functions, each beside the
 * kernel whose path choices it follows). ---- */
typedef struct {
    size_t in_use, peak_in_use; /* bytes handed to kernels (what the calls need) */
    size_t held, peak_held;     /* host bytes the scratch occupies (cache included) */
} kiln_cpu_scratch_count;
kiln_cpu_scratch_count kiln_cpu_scratch_stats(int reset_peak);
/* What one block of `bytes` counts in use at most (rounding, huge-page grains). */
size_t kiln_cpu_scratch_block_bound(size_t bytes);
size_t kiln_cpu_gemm_scratch_bound(int64_t M, int64_t N, int64_t K, kiln_dtype b_dt, int batched);
size_t kiln_cpu_attention_scratch_bound(int64_t B, int64_t Lq, int64_t Lk, int64_t D, int64_t Dv);
size_t kiln_cpu_conv2d_scratch_bound(const kiln_conv2d_params *p, kiln_dtype w_dt);
size_t kiln_cpu_conv2d_up2_scratch_bound(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, kiln_dtype w_dt);

void kiln_cpu_group_norm(float *y, const float *x, const float *gamma, const float *beta,
                         int64_t N, int64_t C, int64_t HW, int64_t G, float eps, int fuse_silu);
/* y = layer_norm over the last dim D of rows x D; gamma/beta [D] may be NULL. */
void kiln_cpu_layer_norm(float *y, const float *x, const float *gamma, const float *beta,
                         int64_t rows, int64_t D, float eps);
/* softmax over the middle dim of [outer, dim, inner]. */
void kiln_cpu_softmax(float *y, const float *x, int64_t outer, int64_t dim, int64_t inner);

/* Pointwise activations (y may equal x) */
void kiln_cpu_silu(float *y, const float *x, int64_t n);
void kiln_cpu_gelu(float *y, const float *x, int64_t n);       /* erf form */
void kiln_cpu_gelu_tanh(float *y, const float *x, int64_t n);  /* tanh approximation */
void kiln_cpu_quick_gelu(float *y, const float *x, int64_t n); /* x*sigmoid(1.702x) (CLIP) */
void kiln_cpu_sigmoid(float *y, const float *x, int64_t n);
/* geglu: x[rows, 2D] -> y[rows, D] = x[:, :D] * gelu(x[:, D:]) (diffusers GEGLU) */
void kiln_cpu_geglu(float *y, const float *x, int64_t rows, int64_t D);

/* Resampling of [NC, H, W] planes */
void kiln_cpu_upsample_nearest(float *y, const float *x, int64_t nc, int64_t h, int64_t w, int64_t factor);
/* torch interpolate mode="bilinear", align_corners=False, antialias=False */
void kiln_cpu_interpolate_bilinear(float *y, const float *x, int64_t nc, int64_t h, int64_t w, int64_t oh, int64_t ow);
/* torch interpolate mode="nearest-exact" */
void kiln_cpu_interpolate_nearest_exact(float *y, const float *x, int64_t nc, int64_t h, int64_t w, int64_t oh, int64_t ow);
/* torch interpolate mode="nearest" (legacy floor rule) */
void kiln_cpu_interpolate_nearest(float *y, const float *x, int64_t nc, int64_t h, int64_t w, int64_t oh, int64_t ow);

/* y[NC, h+top+bottom, w+left+right] = F.pad(x, (left,right,top,bottom), mode, value) */
void kiln_cpu_pad2d(float *y, const float *x, int64_t nc, int64_t h, int64_t w,
                    int64_t top, int64_t bottom, int64_t left, int64_t right,
                    kiln_pad_mode mode, float value);

#endif
