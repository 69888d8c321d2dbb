/* cuda_ops.h - the CUDA backend's operation entries (backend.h semantics), one .cu
 * file each: declared once for the files that define them and for cuda_backend.c,
 * whose table points at them. */
#ifndef KILN_CUDA_OPS_H
#define KILN_CUDA_OPS_H

#include "cuda_context.h"

#ifdef __cplusplus
extern "C" {
#endif

/* elementwise.cu */
kiln_status kiln_cuda_copy(kiln_tensor *dst, const kiln_tensor *src);
/* t as contiguous data of dtype dt: t's own data when it already is, else a copy in
 * *tmp (free it with kiln_tensor_free; NULL when none was needed). */
kiln_status kiln_cuda_as(kiln_cuda_ctx *c, const kiln_tensor *t, kiln_dtype dt, kiln_tensor **tmp, const void **data);
/* dequant.cu: n elements of a low-bit dtype (fp8, a ggml block type) at src to f32,
 * f16 or bf16 at dst, both contiguous on c's device (launched on c's compute stream). */
kiln_status kiln_cuda_dequantize(kiln_cuda_ctx *c, void *dst, kiln_dtype ddt, const void *src, kiln_dtype sdt, int64_t n);
kiln_status kiln_cuda_fill(kiln_tensor *t, double v);
kiln_status kiln_cuda_binary(kiln_binop op, kiln_tensor *out, const kiln_tensor *a, const kiln_tensor *b, double s, int swap);
kiln_status kiln_cuda_unary(kiln_unop op, kiln_tensor *out, const kiln_tensor *a, double p0, double p1);
kiln_status kiln_cuda_geglu(kiln_tensor *out, const kiln_tensor *x);
/* reduce.cu */
kiln_status kiln_cuda_reduce(kiln_redop op, kiln_tensor *out, const kiln_tensor *a, int dim, int unbiased);
/* gemm.cu */
kiln_status kiln_cuda_matmul(kiln_tensor *out, const kiln_tensor *a, const kiln_tensor *b);
kiln_status kiln_cuda_linear(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *bias);
/* conv2d.cu */
kiln_status kiln_cuda_conv2d(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *bias,
                             const kiln_conv_opts *o);
void kiln_cuda_conv_cache_free(kiln_cuda_ctx *c);
/* norm.cu */
kiln_status kiln_cuda_group_norm(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b,
                                 int64_t groups, double eps, int silu);
kiln_status kiln_cuda_layer_norm(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b, double eps);
kiln_status kiln_cuda_softmax(kiln_tensor *out, const kiln_tensor *x, int dim);
/* attention.cu */
kiln_status kiln_cuda_attention(kiln_tensor *out, const kiln_tensor *q, const kiln_tensor *k, const kiln_tensor *v,
                                double scale, int causal);
/* resample.cu */
kiln_status kiln_cuda_resample(kiln_resample mode, kiln_tensor *out, const kiln_tensor *x);
kiln_status kiln_cuda_pad2d(kiln_tensor *out, const kiln_tensor *x, const int64_t *pads, int mode, double value);

#ifdef __cplusplus
}
#endif

#endif
