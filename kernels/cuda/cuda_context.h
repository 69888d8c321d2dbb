/* cuda_context.h - the CUDA backend's per-device context and the helpers its op
 * files share (C and C++), below them: the contexts call no op. One context per GPU: a compute stream for every op, a
 * copy stream for host<->device transfers through pinned staging buffers, cuBLAS
 * and cuDNN handles bound to the compute stream. Device memory comes only from the
 * device's kiln allocator (cudaMalloc underneath), reached through the runtime's
 * device seam (tensors, kiln_device_scratch_alloc), so budgets and statistics hold.
 *
 * Ordering rules (one compute stream keeps most of this trivial):
 * - kernels, cuBLAS and cuDNN run on `compute`, so a block freed to the caching
 *   allocator may be reused by the next op at once (stream order);
 * - a host->device copy runs on `copy` after the compute work queued before it (a
 *   reused block may still be read by a queued kernel), and is recorded as pending;
 * - an op whose tensors overlap a pending copy makes `compute` wait for it
 *   (kiln_cuda_enter), so a prefetch overlaps the compute it does not feed;
 * - device->host copies complete before to_host returns. */
#ifndef KILN_CUDA_CONTEXT_H
#define KILN_CUDA_CONTEXT_H

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>
#include <pthread.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../../runtime/backend.h"

#define KILN_CUDA_MAX_DEVICES 16
#define KILN_CUDA_STAGE_SLOTS 8
#define KILN_CUDA_MAX_PENDING 128

typedef struct {
    char *ptr;
    size_t n;
    cudaEvent_t ev;     /* recorded on the copy stream after the last chunk */
} kiln_cuda_pending;

typedef struct kiln_cuda_ctx {
    int index;                      /* CUDA ordinal */
    kiln_device *dev;
    pthread_mutex_t init_mu;
    int ready;                      /* 0 not yet, 1 ready, -1 failed (init_error) */
    char init_error[256];
    kiln_status init_status;
    int sm_count, cc_major, cc_minor;
    int debug_sync;                 /* KILN_CUDA_SYNC=1: synchronize after every op */
    int tf32;                       /* KILN_CUDA_TF32=1: f32 GEMM/conv may use TF32 */
    int conv_benchmark;             /* KILN_CUDA_CONV_BENCHMARK=1: cudnnFind once per shape */

    cudaStream_t compute, copy;
    cublasHandle_t blas;
    cudnnHandle_t dnn;
    void *blas_ws;                  /* cuBLAS workspace, from the budget (the backend's workspace) */
    size_t blas_ws_size;
    int blas_ws_released;           /* given back by empty_cache: the next op takes it again */

    /* transfers: xfer_mu serializes staging use; pend_mu guards the pending list */
    pthread_mutex_t xfer_mu, pend_mu;
    char *stage;                    /* pinned, KILN_CUDA_STAGE_SLOTS slots of stage_slot bytes */
    size_t stage_slot;
    int stage_next;
    int stage_busy[KILN_CUDA_STAGE_SLOTS];
    cudaEvent_t stage_ev[KILN_CUDA_STAGE_SLOTS];
    cudaEvent_t order_ev;           /* compute -> copy ordering */
    kiln_cuda_pending pending[KILN_CUDA_MAX_PENDING];
    int n_pending;
    cudaEvent_t spare_ev[KILN_CUDA_MAX_PENDING + 2]; /* every event ever made: pending + spare <= MAX + 1 */
    int n_spare_ev;

    void *conv_cache;               /* conv2d.cu: cuDNN algorithm choices per shape */
    pthread_mutex_t conv_mu;
} kiln_cuda_ctx;

/* Context of the tensors' device, initialized on first use, current device set, and
 * compute ordered after any pending copy into their storages. Tensors may be NULL
 * (t0 must not be). NULL with *st set on failure. */
kiln_cuda_ctx *kiln_cuda_enter(const char *op, kiln_status *st, const kiln_tensor *t0, const kiln_tensor *t1,
                               const kiln_tensor *t2, const kiln_tensor *t3, const kiln_tensor *t4);
/* Orders compute after pending copies overlapping [p, p+n). */
void kiln_cuda_wait_range(kiln_cuda_ctx *c, const void *p, size_t n);

/* Errors: "cuda:0: conv2d: cudnnConvolutionForward failed: CUDNN_STATUS_..." */
kiln_status kiln_cuda_check(kiln_cuda_ctx *c, const char *op, const char *call, cudaError_t e);
kiln_status kiln_cuda_check_blas(kiln_cuda_ctx *c, const char *op, const char *call, cublasStatus_t s);
kiln_status kiln_cuda_check_dnn(kiln_cuda_ctx *c, const char *op, const char *call, cudnnStatus_t s);
/* After an op's launches: reports launch errors (and, with KILN_CUDA_SYNC=1,
 * execution errors by synchronizing). */
kiln_status kiln_cuda_done(kiln_cuda_ctx *c, const char *op);

/* Temporaries on the context's device (budgeted, freed with kiln_tensor_free). */
kiln_status kiln_cuda_temp(kiln_cuda_ctx *c, kiln_dtype dt, int ndim, const int64_t *shape, kiln_tensor **out);
/* Raw scratch from the device's memory (kiln_device_scratch_alloc: may evict as any
 * allocation). */
kiln_status kiln_cuda_scratch(kiln_cuda_ctx *c, size_t n, void **p);
/* Scratch only if it fits the budget without evicting anything; 0 when it does not. */
int kiln_cuda_try_scratch(kiln_cuda_ctx *c, size_t n, void **p);
void kiln_cuda_scratch_free(kiln_cuda_ctx *c, void *p);

/* ---- the device table (cuda_backend.c hands in the backend's op table) ---- */
/* Registers a "cuda:N" device per GPU, each with its context and a cudaMalloc raw
 * memory for kiln's allocator, and sets CUDA's default precision. Called once by the
 * device registry (its lock held). */
void kiln_cuda_register_devices(const kiln_backend *backend);
const char *kiln_cuda_unavailable_reason(void);
/* backend.h's entries that concern the device rather than an op */
kiln_status kiln_cuda_to_device(void *dst, const void *src, size_t n);
kiln_status kiln_cuda_to_host(void *dst, const void *src, size_t n);
uint64_t kiln_cuda_workspace_bytes(kiln_device *dev);
void kiln_cuda_workspace_release(kiln_device *dev);
kiln_dtype kiln_cuda_activation_dtype(kiln_device *dev, kiln_dtype dt);

#ifdef __cplusplus
}
#endif

#endif
