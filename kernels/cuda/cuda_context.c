/* cuda_context.c - the CUDA backend's devices and their contexts: registration (a
 * "cuda:N" device per GPU over a cudaMalloc/cudaFree raw memory, so kiln's caching
 * allocator gives CUDA the same budget, statistics, eviction and typed OOM as `sim`),
 * per-device contexts (streams, cuBLAS, cuDNN, pinned staging), host<->device
 * transfers and the helpers the op files share. The ops live in one .cu file each,
 * above this file; cuda_backend.c puts both in the backend's table. */
#define _GNU_SOURCE
#include "cuda_context.h"
#include "cuda_workspace.h"
#include "../../runtime/precision.h"
#include "../../runtime/tunables.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kiln_cuda_ctx ctxs[KILN_CUDA_MAX_DEVICES];
static int n_ctxs;
static char unavailable[256];

/* ---- errors ---- */

kiln_status kiln_cuda_check(kiln_cuda_ctx *c, const char *op, const char *call, cudaError_t e)
{
    if (e == cudaSuccess) return KILN_OK;
    (void)cudaGetLastError(); /* clears non-sticky errors */
    const char *dev = c && c->dev ? c->dev->name : "cuda";
    if (e == cudaErrorMemoryAllocation) {
        kiln_mem_stats s = c && c->dev ? kiln_device_stats(c->dev) : (kiln_mem_stats){0};
        return kiln_error_oom(dev, 0, 0, s.budget, "%s: %s: %s failed: %s (the CUDA runtime itself ran out of device memory)",
                              dev, op, call, cudaGetErrorString(e));
    }
    return kiln_error(KILN_ERR_STATE, "%s: %s: %s failed: %s (%s)", dev, op, call, cudaGetErrorString(e), cudaGetErrorName(e));
}

kiln_status kiln_cuda_check_blas(kiln_cuda_ctx *c, const char *op, const char *call, cublasStatus_t s)
{
    if (s == CUBLAS_STATUS_SUCCESS) return KILN_OK;
    const char *dev = c && c->dev ? c->dev->name : "cuda";
    kiln_status code = s == CUBLAS_STATUS_ALLOC_FAILED ? KILN_ERR_OOM
                     : s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_ARCH_MISMATCH ? KILN_ERR_UNSUPPORTED
                     : KILN_ERR_STATE;
    return kiln_error(code, "%s: %s: %s failed: %s", dev, op, call, cublasGetStatusString(s));
}

kiln_status kiln_cuda_check_dnn(kiln_cuda_ctx *c, const char *op, const char *call, cudnnStatus_t s)
{
    if (s == CUDNN_STATUS_SUCCESS) return KILN_OK;
    const char *dev = c && c->dev ? c->dev->name : "cuda";
    kiln_status code = s == CUDNN_STATUS_ALLOC_FAILED ? KILN_ERR_OOM
                     : s == CUDNN_STATUS_NOT_SUPPORTED ? KILN_ERR_UNSUPPORTED : KILN_ERR_STATE;
    return kiln_error(code, "%s: %s: %s failed: %s", dev, op, call, cudnnGetErrorString(s));
}

kiln_status kiln_cuda_done(kiln_cuda_ctx *c, const char *op)
{
    kiln_status st = kiln_cuda_check(c, op, "kernel launch", cudaGetLastError());
    if (!st && c->debug_sync) st = kiln_cuda_check(c, op, "cudaStreamSynchronize (KILN_CUDA_SYNC)", cudaStreamSynchronize(c->compute));
    return st;
}

/* ---- raw device memory for the allocator ---- */

static void *cuda_raw_alloc(void *ctx, size_t n)
{
    kiln_cuda_ctx *c = ctx;
    void *p = NULL;
    if (cudaSetDevice(c->index) != cudaSuccess || cudaMalloc(&p, n ? n : 1) != cudaSuccess) {
        (void)cudaGetLastError(); /* out of memory is not sticky; the allocator reports it */
        return NULL;
    }
    return p;
}

static void cuda_raw_free(void *ctx, void *p, size_t n)
{
    kiln_cuda_ctx *c = ctx;
    (void)n;
    /* cudaFree waits for the work using p; errors here have nobody to go to */
    if (cudaSetDevice(c->index) != cudaSuccess || cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
}

/* ---- context ---- */

static kiln_status init_fail(kiln_cuda_ctx *c, kiln_status st)
{
    snprintf(c->init_error, sizeof c->init_error, "%s", kiln_last_error());
    c->init_status = st;
    return st;
}

/* cuBLAS would otherwise cudaMalloc its own workspace outside the budget. Set after
 * cublasSetStream, which resets it. NVIDIA recommends 32 MiB on Hopper. Without room
 * in the budget cuBLAS runs without a workspace. */
static kiln_status blas_workspace_take(kiln_cuda_ctx *c, const char *op)
{
    size_t ws = kiln_cuda_blas_workspace_bytes(c->cc_major);
    c->blas_ws = NULL;
    c->blas_ws_size = 0;
    c->blas_ws_released = 0;
    if (kiln_cuda_try_scratch(c, ws, &c->blas_ws)) c->blas_ws_size = ws;
    return kiln_cuda_check_blas(c, op, "cublasSetWorkspace", cublasSetWorkspace(c->blas, c->blas_ws, c->blas_ws_size));
}

static kiln_status ctx_init(kiln_cuda_ctx *c)
{
    const char *op = "init";
    kiln_status st;
    struct cudaDeviceProp p;
    if ((st = kiln_cuda_check(c, op, "cudaSetDevice", cudaSetDevice(c->index))) ||
        (st = kiln_cuda_check(c, op, "cudaGetDeviceProperties", cudaGetDeviceProperties(&p, c->index))))
        return init_fail(c, st);
    c->sm_count = p.multiProcessorCount;
    c->cc_major = p.major;
    c->cc_minor = p.minor;
    c->debug_sync = kiln_tunable_flag("KILN_CUDA_SYNC");
    c->tf32 = kiln_tunable_flag("KILN_CUDA_TF32");
    c->conv_benchmark = kiln_tunable_flag("KILN_CUDA_CONV_BENCHMARK");
    if ((st = kiln_cuda_check(c, op, "cudaStreamCreate", cudaStreamCreateWithFlags(&c->compute, cudaStreamNonBlocking))) ||
        (st = kiln_cuda_check(c, op, "cudaStreamCreate", cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking))) ||
        (st = kiln_cuda_check(c, op, "cudaEventCreate", cudaEventCreateWithFlags(&c->order_ev, cudaEventDisableTiming))))
        return init_fail(c, st);
    for (int i = 0; i < KILN_CUDA_STAGE_SLOTS; i++)
        if ((st = kiln_cuda_check(c, op, "cudaEventCreate", cudaEventCreateWithFlags(&c->stage_ev[i], cudaEventDisableTiming))))
            return init_fail(c, st);
    if ((st = kiln_cuda_check_blas(c, op, "cublasCreate", cublasCreate(&c->blas))) ||
        (st = kiln_cuda_check_blas(c, op, "cublasSetStream", cublasSetStream(c->blas, c->compute))))
        return init_fail(c, st);
    if ((st = blas_workspace_take(c, op))) return init_fail(c, st);
    if ((st = kiln_cuda_check_dnn(c, op, "cudnnCreate", cudnnCreate(&c->dnn))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnSetStream", cudnnSetStream(c->dnn, c->compute))))
        return init_fail(c, st);
    /* pinned staging: KILN_CUDA_STAGING_MB per slot (default 8); smaller on failure,
     * and plain synchronous copies when no pinned memory can be had */
    int mb = kiln_tunable_int("KILN_CUDA_STAGING_MB", 8);
    size_t slot = (size_t)(mb > 0 ? mb : 8) << 20;
    for (; slot >= (256u << 10); slot /= 4) {
        void *h = NULL;
        if (cudaMallocHost(&h, slot * KILN_CUDA_STAGE_SLOTS) == cudaSuccess) {
            c->stage = h;
            c->stage_slot = slot;
            break;
        }
        (void)cudaGetLastError();
    }
    return KILN_OK;
}

static kiln_status ctx_ready(kiln_cuda_ctx *c)
{
    if (__atomic_load_n(&c->ready, __ATOMIC_ACQUIRE) == 1) return KILN_OK;
    pthread_mutex_lock(&c->init_mu);
    if (c->ready == 0) {
        kiln_status st = ctx_init(c);
        __atomic_store_n(&c->ready, st ? -1 : 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&c->init_mu);
    if (c->ready == 1) return KILN_OK;
    return kiln_error(c->init_status ? c->init_status : KILN_ERR_STATE, "%s", c->init_error);
}

static kiln_cuda_ctx *ctx_of_tensor(const kiln_tensor *t)
{
    kiln_device *d = t->storage->device;
    if (d->type != KILN_DEV_CUDA || d->index < 0 || d->index >= n_ctxs) return NULL;
    return &ctxs[d->index];
}

/* The context owning device pointer p (transfers get no device argument). */
static kiln_cuda_ctx *ctx_of_ptr(const void *p)
{
    if (n_ctxs == 1) return &ctxs[0];
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return a.device >= 0 && a.device < n_ctxs ? &ctxs[a.device] : NULL;
}

/* ---- pending copies ----
 * Kept oldest first. The copy stream runs in order, so a newer event also stands
 * for every older copy: adjacent ranges merge into one entry, and when the list is
 * full compute waits for the oldest entry only. */

static void remove_locked(kiln_cuda_ctx *c, int i)
{
    c->spare_ev[c->n_spare_ev++] = c->pending[i].ev;
    memmove(&c->pending[i], &c->pending[i + 1], (size_t)(c->n_pending - i - 1) * sizeof c->pending[0]);
    c->n_pending--;
}

/* drops finished copies from the old end (at most `budget` queries) */
static void prune_locked(kiln_cuda_ctx *c, int budget)
{
    while (c->n_pending > 0 && budget-- > 0) {
        cudaError_t e = cudaEventQuery(c->pending[0].ev);
        if (e != cudaSuccess) {
            (void)cudaGetLastError(); /* cudaErrorNotReady is recorded as the last error */
            break;
        }
        remove_locked(c, 0);
    }
}

static void wait_ranges(kiln_cuda_ctx *c, const void *const *ptr, const size_t *len, int n)
{
    pthread_mutex_lock(&c->pend_mu);
    prune_locked(c, 4);
    /* newest first: waiting for a newer copy covers the older ones */
    for (int i = c->n_pending - 1; i >= 0; i--) {
        const kiln_cuda_pending *pp = &c->pending[i];
        int hit = 0;
        for (int k = 0; k < n && !hit; k++)
            hit = ptr[k] && (const char *)ptr[k] < pp->ptr + pp->n && pp->ptr < (const char *)ptr[k] + len[k];
        if (!hit) continue;
        if (cudaStreamWaitEvent(c->compute, pp->ev, 0) != cudaSuccess) (void)cudaGetLastError();
        while (i >= 0) remove_locked(c, i--);
        break;
    }
    pthread_mutex_unlock(&c->pend_mu);
}

void kiln_cuda_wait_range(kiln_cuda_ctx *c, const void *p, size_t n)
{
    wait_ranges(c, &p, &n, 1);
}

/* Records the end of a host->device copy of [p, p+n) on the copy stream. */
static kiln_status add_pending(kiln_cuda_ctx *c, void *p, size_t n, const char *op)
{
    kiln_status st = KILN_OK;
    pthread_mutex_lock(&c->pend_mu);
    cudaEvent_t ev = NULL;
    if (c->n_spare_ev) ev = c->spare_ev[--c->n_spare_ev];
    else st = kiln_cuda_check(c, op, "cudaEventCreate", cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    if (!st) st = kiln_cuda_check(c, op, "cudaEventRecord", cudaEventRecord(ev, c->copy));
    if (st) {
        if (ev) c->spare_ev[c->n_spare_ev++] = ev;
        pthread_mutex_unlock(&c->pend_mu);
        return st;
    }
    kiln_cuda_pending *last = c->n_pending ? &c->pending[c->n_pending - 1] : NULL;
    if (last && last->ptr + last->n == (char *)p) { /* a chunked copy continuing */
        c->spare_ev[c->n_spare_ev++] = last->ev;
        last->n += n;
        last->ev = ev;
    } else {
        if (c->n_pending == KILN_CUDA_MAX_PENDING) prune_locked(c, KILN_CUDA_MAX_PENDING);
        if (c->n_pending == KILN_CUDA_MAX_PENDING) {
            if (cudaStreamWaitEvent(c->compute, c->pending[0].ev, 0) != cudaSuccess) (void)cudaGetLastError();
            remove_locked(c, 0);
        }
        c->pending[c->n_pending++] = (kiln_cuda_pending){(char *)p, n, ev};
    }
    pthread_mutex_unlock(&c->pend_mu);
    return st;
}

/* ---- helpers for the op files ---- */

kiln_cuda_ctx *kiln_cuda_enter(const char *op, kiln_status *st, const kiln_tensor *t0, const kiln_tensor *t1,
                               const kiln_tensor *t2, const kiln_tensor *t3, const kiln_tensor *t4)
{
    kiln_cuda_ctx *c = ctx_of_tensor(t0);
    if (!c) {
        *st = kiln_error(KILN_ERR_ARG, "cuda: %s: tensor is on %s, not a CUDA device", op, t0->storage->device->name);
        return NULL;
    }
    if ((*st = ctx_ready(c))) return NULL;
    if ((*st = kiln_cuda_check(c, op, "cudaSetDevice", cudaSetDevice(c->index)))) return NULL;
    if (__atomic_load_n(&c->blas_ws_released, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&c->init_mu);
        if (c->blas_ws_released) *st = blas_workspace_take(c, op);
        pthread_mutex_unlock(&c->init_mu);
        if (*st) return NULL;
    }
    const kiln_tensor *ts[5] = {t0, t1, t2, t3, t4};
    const void *ptr[5];
    size_t len[5];
    for (int i = 0; i < 5; i++) {
        ptr[i] = ts[i] ? ts[i]->storage->data : NULL;
        len[i] = ts[i] ? ts[i]->storage->nbytes : 0;
        if (ts[i] && ts[i]->storage->device != t0->storage->device) {
            *st = kiln_error(KILN_ERR_ARG, "%s: %s: tensors on different devices (%s and %s)", c->dev->name, op,
                             t0->storage->device->name, ts[i]->storage->device->name);
            return NULL;
        }
    }
    wait_ranges(c, ptr, len, 5);
    *st = KILN_OK;
    return c;
}

kiln_status kiln_cuda_temp(kiln_cuda_ctx *c, kiln_dtype dt, int ndim, const int64_t *shape, kiln_tensor **out)
{
    kiln_status st = kiln_tensor_new(c->dev, dt, ndim, shape, out);
    if (!st) kiln_cuda_wait_range(c, (*out)->storage->data, (*out)->storage->nbytes);
    return st;
}

kiln_status kiln_cuda_scratch(kiln_cuda_ctx *c, size_t n, void **p)
{
    kiln_status st = kiln_device_scratch_alloc(c->dev, n, 0, p);
    if (!st) kiln_cuda_wait_range(c, *p, n);
    return st;
}

int kiln_cuda_try_scratch(kiln_cuda_ctx *c, size_t n, void **p)
{
    if (kiln_device_scratch_alloc(c->dev, n, KILN_SCRATCH_NO_EVICT, p) != KILN_OK) return 0;
    kiln_cuda_wait_range(c, *p, n);
    return 1;
}

void kiln_cuda_scratch_free(kiln_cuda_ctx *c, void *p)
{
    kiln_device_scratch_free(c->dev, p);
}

/* ---- transfers ---- */

static kiln_status xfer_begin(kiln_cuda_ctx *c, const char *op)
{
    kiln_status st = ctx_ready(c);
    if (st) return st;
    pthread_mutex_lock(&c->xfer_mu);
    /* the copy stream runs after the compute queued so far: the destination block may
     * have been freed by a tensor that a queued kernel still reads or writes */
    if ((st = kiln_cuda_check(c, op, "cudaSetDevice", cudaSetDevice(c->index))) ||
        (st = kiln_cuda_check(c, op, "cudaEventRecord", cudaEventRecord(c->order_ev, c->compute))) ||
        (st = kiln_cuda_check(c, op, "cudaStreamWaitEvent", cudaStreamWaitEvent(c->copy, c->order_ev, 0))))
        pthread_mutex_unlock(&c->xfer_mu);
    return st;
}

static kiln_status slot_take(kiln_cuda_ctx *c, const char *op, int *slot)
{
    int s = c->stage_next;
    c->stage_next = (s + 1) % KILN_CUDA_STAGE_SLOTS;
    *slot = s;
    if (!c->stage_busy[s]) return KILN_OK;
    c->stage_busy[s] = 0;
    return kiln_cuda_check(c, op, "cudaEventSynchronize", cudaEventSynchronize(c->stage_ev[s]));
}

/* Without a staging buffer: one copy on the copy stream, waited for. */
static kiln_status copy_unstaged(kiln_cuda_ctx *c, const char *op, void *dst, const void *src, size_t n,
                                 enum cudaMemcpyKind kind)
{
    kiln_status st = kiln_cuda_check(c, op, "cudaMemcpyAsync", cudaMemcpyAsync(dst, src, n, kind, c->copy));
    if (!st) st = kiln_cuda_check(c, op, "cudaStreamSynchronize", cudaStreamSynchronize(c->copy));
    return st;
}

/* Returns once src may be reused (staged or copied); the device side completes on
 * the copy stream and is ordered before any op touching dst. */
kiln_status kiln_cuda_to_device(void *dst, const void *src, size_t n)
{
    const char *op = "to_device";
    if (n == 0) return KILN_OK;
    kiln_cuda_ctx *c = ctx_of_ptr(dst);
    if (!c) return kiln_error(KILN_ERR_ARG, "cuda: %s: destination is not CUDA device memory", op);
    kiln_status st = xfer_begin(c, op);
    if (st) return st;
    if (!c->stage) {
        st = copy_unstaged(c, op, dst, src, n, cudaMemcpyHostToDevice);
        pthread_mutex_unlock(&c->xfer_mu);
        return st;
    }
    for (size_t off = 0; off < n && !st;) {
        size_t len = n - off < c->stage_slot ? n - off : c->stage_slot;
        int s;
        if ((st = slot_take(c, op, &s))) break;
        char *buf = c->stage + (size_t)s * c->stage_slot;
        memcpy(buf, (const char *)src + off, len);
        if ((st = kiln_cuda_check(c, op, "cudaMemcpyAsync",
                                  cudaMemcpyAsync((char *)dst + off, buf, len, cudaMemcpyHostToDevice, c->copy))) ||
            (st = kiln_cuda_check(c, op, "cudaEventRecord", cudaEventRecord(c->stage_ev[s], c->copy))))
            break;
        c->stage_busy[s] = 1;
        off += len;
    }
    if (!st) st = add_pending(c, dst, n, op);
    pthread_mutex_unlock(&c->xfer_mu);
    return st;
}

/* Complete when it returns: chunk i+1 is in flight while chunk i is unpacked. */
kiln_status kiln_cuda_to_host(void *dst, const void *src, size_t n)
{
    const char *op = "to_host";
    if (n == 0) return KILN_OK;
    kiln_cuda_ctx *c = ctx_of_ptr(src);
    if (!c) return kiln_error(KILN_ERR_ARG, "cuda: %s: source is not CUDA device memory", op);
    kiln_status st = xfer_begin(c, op);
    if (st) return st;
    if (!c->stage) {
        st = copy_unstaged(c, op, dst, src, n, cudaMemcpyDeviceToHost);
        pthread_mutex_unlock(&c->xfer_mu);
        return st;
    }
    size_t chunk = c->stage_slot, nchunks = (n + chunk - 1) / chunk;
    int slot[2] = {0, 0};
    for (size_t i = 0; i <= nchunks && !st; i++) {
        if (i < nchunks) { /* issue chunk i */
            size_t off = i * chunk, len = n - off < chunk ? n - off : chunk;
            int s;
            if ((st = slot_take(c, op, &s))) break;
            slot[i % 2] = s;
            if ((st = kiln_cuda_check(c, op, "cudaMemcpyAsync",
                                      cudaMemcpyAsync(c->stage + (size_t)s * chunk, (const char *)src + off, len,
                                                      cudaMemcpyDeviceToHost, c->copy))) ||
                (st = kiln_cuda_check(c, op, "cudaEventRecord", cudaEventRecord(c->stage_ev[s], c->copy))))
                break;
            c->stage_busy[s] = 1;
        }
        if (i > 0) { /* unpack chunk i-1 */
            size_t off = (i - 1) * chunk, len = n - off < chunk ? n - off : chunk;
            int s = slot[(i - 1) % 2];
            if ((st = kiln_cuda_check(c, op, "cudaEventSynchronize", cudaEventSynchronize(c->stage_ev[s])))) break;
            c->stage_busy[s] = 0;
            memcpy((char *)dst + off, c->stage + (size_t)s * chunk, len);
        }
    }
    pthread_mutex_unlock(&c->xfer_mu);
    return st;
}

/* ---- the device-level entries of the op table ---- */

uint64_t kiln_cuda_workspace_bytes(kiln_device *dev)
{
    if (dev->index < 0 || dev->index >= n_ctxs) return 0;
    return ctxs[dev->index].blas_ws_size;
}

/* Gives the cuBLAS workspace back to the device's allocator (the allocator's own
 * empty_cache, after this, returns it to the driver); queued GEMMs that use it are
 * ordered before any reuse by the compute stream, and cudaFree waits for them. */
void kiln_cuda_workspace_release(kiln_device *dev)
{
    if (dev->index < 0 || dev->index >= n_ctxs) return;
    kiln_cuda_ctx *c = &ctxs[dev->index];
    pthread_mutex_lock(&c->init_mu);
    if (c->ready == 1 && !c->blas_ws_released && c->blas_ws) {
        if (cudaSetDevice(c->index) != cudaSuccess || cublasSetWorkspace(c->blas, NULL, 0) != CUBLAS_STATUS_SUCCESS)
            (void)cudaGetLastError(); /* nothing to report to: the workspace stays */
        else {
            kiln_cuda_scratch_free(c, c->blas_ws);
            c->blas_ws = NULL;
            c->blas_ws_size = 0;
            __atomic_store_n(&c->blas_ws_released, 1, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&c->init_mu);
}

/* Half-precision activations: f16 on every card (tensor cores since sm_70); bf16 from
 * sm_80 (cuBLAS and cuDNN have no bf16 tensor-core path below: activations stay f32
 * there and bf16 weights are converted per op). */
kiln_dtype kiln_cuda_activation_dtype(kiln_device *dev, kiln_dtype dt)
{
    if (dev->index < 0 || dev->index >= n_ctxs) return KILN_F32;
    if (dt == KILN_F16) return KILN_F16;
    if (dt == KILN_BF16 && ctxs[dev->index].cc_major >= 8) return KILN_BF16;
    return KILN_F32;
}

/* ---- registration ---- */

void kiln_cuda_register_devices(const kiln_backend *backend)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n <= 0) {
        snprintf(unavailable, sizeof unavailable, "%s",
                 e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA-capable device is detected");
        (void)cudaGetLastError();
        return;
    }
    if (n > KILN_CUDA_MAX_DEVICES) n = KILN_CUDA_MAX_DEVICES;
    int min_major = 1 << 30;
    for (int i = 0; i < n; i++) {
        struct cudaDeviceProp p;
        uint64_t total = 0;
        memset(&p, 0, sizeof p);
        if (cudaGetDeviceProperties(&p, i) == cudaSuccess) total = p.totalGlobalMem;
        else (void)cudaGetLastError();
        kiln_cuda_ctx *c = &ctxs[n_ctxs];
        memset(c, 0, sizeof *c);
        c->index = i;
        pthread_mutex_init(&c->init_mu, NULL);
        pthread_mutex_init(&c->xfer_mu, NULL);
        pthread_mutex_init(&c->pend_mu, NULL);
        pthread_mutex_init(&c->conv_mu, NULL);
        char name[32];
        snprintf(name, sizeof name, "cuda:%d", i);
        c->cc_major = p.major; /* known before the context starts: the precision's default needs it */
        c->cc_minor = p.minor;
        if (p.major < min_major) min_major = p.major;
        kiln_raw_memory raw = {cuda_raw_alloc, cuda_raw_free, c};
        c->dev = kiln_device_register(KILN_DEV_CUDA, i, name, raw, total, backend);
        if (!c->dev) break;
        n_ctxs++;
    }
    snprintf(unavailable, sizeof unavailable, "%d CUDA device%s present", n_ctxs, n_ctxs == 1 ? "" : "s");
    /* The networks' default precision on CUDA (one per device type, so the weakest card
     * decides): bf16 from sm_80, where it runs at f16's speed with f32's range (SDXL's
     * VAE overflows f16 into NaN); f16 below. kiln.precision overrides it. */
    if (n_ctxs > 0) kiln_precision_set_default(KILN_DEV_CUDA, min_major >= 8 ? KILN_PREC_BF16 : KILN_PREC_F16);
}

const char *kiln_cuda_unavailable_reason(void)
{
    return unavailable[0] ? unavailable : "CUDA devices not probed yet";
}
