/* backend_table.h - the operation table every compute backend fills (ggml's
 * ggml_backend_i), on its own: tensors and devices are only named here, so the layers
 * that dispatch through the table (device.c, tensor.c) include it without depending on
 * what sits above them. What a backend's code includes is backend.h.
 * layer 1 of the memory core: uses dtype; never calls device, tensor.
 * The runtime (runtime/ops.c) validates shapes, dtypes and devices, allocates outputs,
 * then calls the table of the tensors' device. Tensors reaching a backend are on that
 * backend's device; inputs may be strided unless noted; outputs are freshly allocated
 * and contiguous. An entry may be NULL (optional): `supports` tells callers before
 * they try, and ops.c reports "unsupported". */
#ifndef KILN_BACKEND_TABLE_H
#define KILN_BACKEND_TABLE_H

#include "dtype.h"

typedef struct kiln_tensor kiln_tensor; /* tensor.h */
typedef struct kiln_device kiln_device; /* device.h */
typedef struct kiln_backend kiln_backend;

/* ORDER BINOP: keep kiln_binop_names in ops.c in this order */
typedef enum { KILN_BIN_ADD, KILN_BIN_SUB, KILN_BIN_MUL, KILN_BIN_DIV, KILN_BIN_POW,
               KILN_BIN_MIN, KILN_BIN_MAX, KILN_BIN_COUNT } kiln_binop;
/* ORDER UNOP */
typedef enum { KILN_UN_NEG, KILN_UN_EXP, KILN_UN_LOG, KILN_UN_SQRT, KILN_UN_ABS, KILN_UN_TANH,
               KILN_UN_SIGMOID, KILN_UN_SILU, KILN_UN_GELU, KILN_UN_GELU_TANH, KILN_UN_QUICK_GELU,
               KILN_UN_RELU, KILN_UN_SIN, KILN_UN_COS, KILN_UN_CLAMP, KILN_UN_LEAKY_RELU, KILN_UN_COUNT } kiln_unop;
/* ORDER REDOP */
typedef enum { KILN_RED_SUM, KILN_RED_MEAN, KILN_RED_MAX, KILN_RED_MIN, KILN_RED_VAR,
               KILN_RED_COUNT } kiln_redop;
/* ORDER RESAMPLE */
typedef enum { KILN_RS_NEAREST, KILN_RS_NEAREST_EXACT, KILN_RS_BILINEAR, KILN_RS_COUNT } kiln_resample;

/* ORDER PADMODE */
/* CIRCULAR wraps around (the opposite edge's pixels: seamless textures) */
typedef enum { KILN_PAD_CONSTANT = 0, KILN_PAD_REFLECT, KILN_PAD_REPLICATE, KILN_PAD_CIRCULAR } kiln_pad_mode;

/* ORDER OP: for supports() */
typedef enum { KILN_OP_COPY, KILN_OP_FILL, KILN_OP_BINARY, KILN_OP_UNARY, KILN_OP_REDUCE,
               KILN_OP_MATMUL, KILN_OP_LINEAR, KILN_OP_CONV2D, KILN_OP_GROUP_NORM,
               KILN_OP_LAYER_NORM, KILN_OP_SOFTMAX, KILN_OP_ATTENTION, KILN_OP_GEGLU,
               KILN_OP_RESAMPLE, KILN_OP_PAD2D, KILN_OP_COUNT } kiln_op;

typedef struct {
    int64_t stride[2], padding[2], dilation[2], groups;
    int64_t upsample;  /* 2: the input is upsampled 2x (nearest) first; 0 or 1: not */
    /* an activation of the output: 1 leaky ReLU with slope act_slope below 0 (ESRGAN's
     * convolutions), written over the result before it is returned; 0 none */
    int act;
    double act_slope;
    /* a tensor of the output's shape (any float dtype, strided) added to the result
     * before the activation: act(conv(x) + bias + residual), a residual block's skip
     * in one op; NULL none */
    const kiln_tensor *residual;
} kiln_conv_opts;

struct kiln_backend {
    const char *name;
    int (*supports)(kiln_op op, kiln_dtype dt);
    /* dst = src (broadcast by src strides of 0, dtype conversion), same device */
    kiln_status (*copy)(kiln_tensor *dst, const kiln_tensor *src);
    kiln_status (*fill)(kiln_tensor *t, double v);
    /* out = a op b; a and b already expanded to out's shape (strides may be 0).
     * When b is NULL the scalar s is the right operand (or the left when swap). */
    kiln_status (*binary)(kiln_binop op, kiln_tensor *out, const kiln_tensor *a,
                          const kiln_tensor *b, double s, int swap);
    kiln_status (*unary)(kiln_unop op, kiln_tensor *out, const kiln_tensor *a, double p0, double p1);
    /* out has a's shape with dim reduced to 1 (dim < 0: everything to one element) */
    kiln_status (*reduce)(kiln_redop op, kiln_tensor *out, const kiln_tensor *a, int dim, int unbiased);
    /* out[..., M, N] = a[..., M, K] @ b[..., K, N] (batch dims already broadcast) */
    kiln_status (*matmul)(kiln_tensor *out, const kiln_tensor *a, const kiln_tensor *b);
    /* out[..., N] = x[..., K] @ w[N, K]^T + bias; w may be f16/bf16 */
    kiln_status (*linear)(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *bias);
    kiln_status (*conv2d)(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                          const kiln_tensor *bias, const kiln_conv_opts *o);
    /* 1: conv2d applies o->act itself, as it writes the output (no second pass over a
     * large activation); 0: conv2d gets act = 0 and the op runs the activation after */
    int conv2d_act;
    /* 1: conv2d adds o->residual itself (before o->act); 0: conv2d gets residual = NULL
     * and act = 0, and the op adds the residual, then runs the activation */
    int conv2d_residual;
    /* out [N,K,2H,2W] = conv2d(upsample_nearest(x [N,C,H,W], 2), w [K,C,3,3], padding 1)
     * + bias, without the upsampled image; optional (NULL, or KILN_ERR_UNSUPPORTED returned
     * without touching out: the op upsamples first) */
    kiln_status (*conv2d_up2)(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                              const kiln_tensor *bias);
    kiln_status (*group_norm)(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                              const kiln_tensor *b, int64_t groups, double eps, int silu);
    /* 1: group_norm may be called with out == x (contiguous f32); 0: the op computes
     * into a new tensor and copies back */
    int group_norm_in_place;
    kiln_status (*layer_norm)(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                              const kiln_tensor *b, double eps);
    kiln_status (*softmax)(kiln_tensor *out, const kiln_tensor *x, int dim);
    /* q [B,H,Lq,D], k [B,H,Lk,D], v [B,H,Lk,Dv] -> out [B,H,Lq,Dv] */
    kiln_status (*attention)(kiln_tensor *out, const kiln_tensor *q, const kiln_tensor *k,
                             const kiln_tensor *v, double scale, int causal);
    kiln_status (*geglu)(kiln_tensor *out, const kiln_tensor *x);
    kiln_status (*resample)(kiln_resample mode, kiln_tensor *out, const kiln_tensor *x);
    /* pads = left, right, top, bottom; mode kiln_pad_mode */
    kiln_status (*pad2d)(kiln_tensor *out, const kiln_tensor *x, const int64_t *pads, int mode, double value);
    /* C[M,N] = alpha op(A) op(B) + beta C on raw row-major f32 host buffers (BLAS sgemm
     * semantics; op transposes when trans_x). For the runtime's own host arithmetic
     * (weight adapters), which may run on a copy thread while another thread computes:
     * the entry must be callable from any thread. Optional, host backends only. */
    kiln_status (*gemm_f32)(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                            const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                            float *C, int64_t ldc);
    /* Kernel workspace, one policy for every backend: the scratch its kernels keep
     * between calls (the CPU's GEMM and Winograd blocks, the cuBLAS workspace) shows
     * in the device's statistics (workspace_bytes -> kiln_mem_stats.workspace through
     * kiln_device_stats) and goes back with workspace_release (kiln_device_empty_cache:
     * kiln.mem.empty_cache, unload, kiln_close); the next op that needs it takes it
     * again. Scratch that lives for one op comes from kiln_device_scratch_alloc, so
     * the device's budget and statistics see it. Both entries optional (NULL: the
     * backend keeps nothing between calls). */
    uint64_t (*workspace_bytes)(kiln_device *dev);
    void (*workspace_release)(kiln_device *dev);
    /* Optional: the most scratch the kernels had in use at once since the last call
     * with reset (kiln_device_reset_peak resets it) -> kiln_mem_stats.workspace_peak;
     * for scratch kept outside the device's allocator (the CPU's host scratch). */
    uint64_t (*workspace_peak)(kiln_device *dev, int reset);
    /* Transfers between this device and host memory (NULL for host-memory devices). */
    kiln_status (*to_device)(void *dst_dev, const void *src_host, size_t n);
    kiln_status (*to_host)(void *dst_host, const void *src_dev, size_t n);
    /* Threads of the backend's pool (optional; kiln_threads / kiln_set_threads reach
     * the host device's backend through these). set_threads: n <= 0 means default. */
    int (*threads)(void);
    void (*set_threads)(int n);
    /* Optional: 1 when the backend computes bf16 products natively, at a higher rate
     * than f32 (the CPU with AVX512_BF16); kiln_device_native_bf16 asks it. */
    int (*native_bf16)(void);
    /* Devices of the backend's own (CUDA's GPUs), registered through
     * kiln_device_register; called once, after the host devices cpu and sim exist,
     * with the registry lock held. Optional: the CPU backend computes for cpu and
     * sim, which the runtime creates itself. */
    void (*register_devices)(void);
    /* Why the backend has no device ("built without CUDA", "no CUDA-capable device"),
     * for the message of a device name that is not present. Optional. */
    const char *(*unavailable_reason)(void);
    /* The dtype the networks' activations take on dev under a half precision (dt
     * KILN_F16 or KILN_BF16): dt where every op the networks use runs natively in it
     * (CUDA: tensor-core GEMMs and convolutions, f32 statistics), else KILN_F32.
     * Optional: NULL keeps f32 activations (the CPU rounds inside its kernels
     * instead). Read through kiln_activation_dtype (activation.h). */
    kiln_dtype (*activation_dtype)(kiln_device *dev, kiln_dtype dt);
};

#endif
