/* conv2d.cu - 2-D convolution through cuDNN (NCHW, groups, dilation; f32 compute).
 * Half activations (x and out f16 or bf16) run natively on tensor cores, the weight
 * converted to their dtype when it differs (kiln_cuda_compute_dtype); f32
 * activations run in f32 (half weights converted), as the CPU backend does. The
 * algorithm list is asked once per shape (cudnnGetConvolutionForwardAlgorithm_v7,
 * or cudnnFindConvolutionForwardAlgorithmEx with KILN_CUDA_CONV_BENCHMARK=1) and
 * cached per device. The workspace comes from the device's allocator and only when
 * it fits the budget without evicting anything: otherwise the next algorithm with a
 * smaller workspace is used, down to IMPLICIT_GEMM which needs none. The bias is
 * written into the output first and the convolution added with beta = 1. */
#include "cuda_dev.h"
#include "cuda_workspace.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define CONV_CACHE_MAX 512
#define N_ALGO CUDNN_CONVOLUTION_FWD_ALGO_COUNT

typedef struct {
    int n, c, h, w, k, r, s, ph, pw, sh, sw, dh, dw, g, oh, ow, dt, math;
} conv_key;

typedef struct conv_entry {
    conv_key key;
    cudnnTensorDescriptor_t xd, yd;
    cudnnFilterDescriptor_t wd;
    cudnnConvolutionDescriptor_t cd;
    int n_perf;
    cudnnConvolutionFwdAlgoPerf_t perf[N_ALGO + 1];
    int benchmarked;
    struct conv_entry *next;
} conv_entry;

typedef struct {
    conv_entry *head;
    int count;
} conv_cache;

static void entry_free(conv_entry *e)
{
    if (!e) return;
    if (e->xd) cudnnDestroyTensorDescriptor(e->xd);
    if (e->yd) cudnnDestroyTensorDescriptor(e->yd);
    if (e->wd) cudnnDestroyFilterDescriptor(e->wd);
    if (e->cd) cudnnDestroyConvolutionDescriptor(e->cd);
    free(e);
}

extern "C" void kiln_cuda_conv_cache_free(kiln_cuda_ctx *c)
{
    conv_cache *cc = (conv_cache *)c->conv_cache;
    if (!cc) return;
    for (conv_entry *e = cc->head, *nx; e; e = nx) {
        nx = e->next;
        entry_free(e);
    }
    free(cc);
    c->conv_cache = NULL;
}

static cudnnDataType_t dnn_type(kiln_dtype dt)
{
    return dt == KILN_F16 ? CUDNN_DATA_HALF : dt == KILN_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
}

/* Descriptors and the heuristic algorithm list of one shape. */
static kiln_status entry_new(kiln_cuda_ctx *c, const conv_key *k, conv_entry **out)
{
    const char *op = "conv2d";
    *out = NULL;
    conv_entry *e = (conv_entry *)calloc(1, sizeof *e);
    if (!e) return kiln_error(KILN_ERR_OOM, "%s: %s: host out of memory", c->dev->name, op);
    e->key = *k;
    cudnnDataType_t t = dnn_type((kiln_dtype)k->dt);
    kiln_status st;
    int on, oc, oh, ow;
    if ((st = kiln_cuda_check_dnn(c, op, "cudnnCreateTensorDescriptor", cudnnCreateTensorDescriptor(&e->xd))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnCreateTensorDescriptor", cudnnCreateTensorDescriptor(&e->yd))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnCreateFilterDescriptor", cudnnCreateFilterDescriptor(&e->wd))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnCreateConvolutionDescriptor", cudnnCreateConvolutionDescriptor(&e->cd))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnSetTensor4dDescriptor",
                                  cudnnSetTensor4dDescriptor(e->xd, CUDNN_TENSOR_NCHW, t, k->n, k->c, k->h, k->w))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnSetFilter4dDescriptor",
                                  cudnnSetFilter4dDescriptor(e->wd, t, CUDNN_TENSOR_NCHW, k->k, k->c / k->g, k->r, k->s))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnSetConvolution2dDescriptor",
                                  cudnnSetConvolution2dDescriptor(e->cd, k->ph, k->pw, k->sh, k->sw, k->dh, k->dw,
                                                                  CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnSetConvolutionGroupCount", cudnnSetConvolutionGroupCount(e->cd, k->g))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnSetConvolutionMathType",
                                  cudnnSetConvolutionMathType(e->cd, (cudnnMathType_t)k->math))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnGetConvolution2dForwardOutputDim",
                                  cudnnGetConvolution2dForwardOutputDim(e->cd, e->xd, e->wd, &on, &oc, &oh, &ow)))) {
        entry_free(e);
        return st;
    }
    if (on != k->n || oc != k->k || oh != k->oh || ow != k->ow) {
        entry_free(e);
        return kiln_error(KILN_ERR_STATE, "%s: %s: cuDNN computes output [%d,%d,%d,%d], expected [%d,%d,%d,%d]",
                          c->dev->name, op, on, oc, oh, ow, k->n, k->k, k->oh, k->ow);
    }
    if ((st = kiln_cuda_check_dnn(c, op, "cudnnSetTensor4dDescriptor",
                                  cudnnSetTensor4dDescriptor(e->yd, CUDNN_TENSOR_NCHW, t, k->n, k->k, k->oh, k->ow))) ||
        (st = kiln_cuda_check_dnn(c, op, "cudnnGetConvolutionForwardAlgorithm_v7",
                                  cudnnGetConvolutionForwardAlgorithm_v7(c->dnn, e->xd, e->wd, e->cd, e->yd, N_ALGO,
                                                                         &e->n_perf, e->perf)))) {
        entry_free(e);
        return st;
    }
    /* IMPLICIT_GEMM needs no workspace: keep it as the last resort */
    int has_ig = 0;
    for (int i = 0; i < e->n_perf; i++)
        if (e->perf[i].algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM && e->perf[i].status == CUDNN_STATUS_SUCCESS) has_ig = 1;
    if (!has_ig) {
        cudnnConvolutionFwdAlgoPerf_t p;
        memset(&p, 0, sizeof p);
        p.algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
        p.status = CUDNN_STATUS_SUCCESS;
        p.memory = 0;
        p.mathType = (cudnnMathType_t)k->math;
        e->perf[e->n_perf++] = p;
    }
    *out = e;
    return KILN_OK;
}

static kiln_status cache_get(kiln_cuda_ctx *c, const conv_key *k, conv_entry **out)
{
    conv_cache *cc = (conv_cache *)c->conv_cache;
    if (!cc) {
        cc = (conv_cache *)calloc(1, sizeof *cc);
        if (!cc) return kiln_error(KILN_ERR_OOM, "%s: conv2d: host out of memory", c->dev->name);
        c->conv_cache = cc;
    }
    conv_entry *prev = NULL;
    for (conv_entry *e = cc->head; e; prev = e, e = e->next) {
        if (memcmp(&e->key, k, sizeof *k) == 0) {
            if (prev) { /* move to front */
                prev->next = e->next;
                e->next = cc->head;
                cc->head = e;
            }
            *out = e;
            return KILN_OK;
        }
    }
    conv_entry *e;
    kiln_status st = entry_new(c, k, &e);
    if (st) return st;
    e->next = cc->head;
    cc->head = e;
    if (++cc->count > CONV_CACHE_MAX) { /* drop the least recently used */
        conv_entry *p = cc->head;
        while (p->next && p->next->next) p = p->next;
        entry_free(p->next);
        p->next = NULL;
        cc->count--;
    }
    *out = e;
    return KILN_OK;
}

/* cudnnFind once per shape, with as much workspace as fits the budget. */
static kiln_status benchmark(kiln_cuda_ctx *c, conv_entry *e, const void *x, const void *w, void *y, size_t cap)
{
    size_t want = 0;
    for (int i = 0; i < e->n_perf; i++)
        if (e->perf[i].status == CUDNN_STATUS_SUCCESS && e->perf[i].memory > want) want = e->perf[i].memory;
    if (want > cap) want = cap;
    void *ws = NULL;
    while (want > 0 && !kiln_cuda_try_scratch(c, want, &ws)) want /= 2;
    cudnnConvolutionFwdAlgoPerf_t perf[N_ALGO];
    int n = 0;
    cudnnStatus_t s = cudnnFindConvolutionForwardAlgorithmEx(c->dnn, e->xd, x, e->wd, w, e->cd, e->yd, y, N_ALGO, &n, perf,
                                                             ws, want);
    kiln_cuda_scratch_free(c, ws);
    kiln_status st = kiln_cuda_check_dnn(c, "conv2d", "cudnnFindConvolutionForwardAlgorithmEx", s);
    if (st) return st;
    int m = 0;
    for (int i = 0; i < n; i++)
        if (perf[i].status == CUDNN_STATUS_SUCCESS) e->perf[m++] = perf[i];
    if (m > 0) {
        int has_ig = 0;
        for (int i = 0; i < m; i++) has_ig |= perf[i].algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
        if (!has_ig) {
            memset(&e->perf[m], 0, sizeof e->perf[m]);
            e->perf[m].algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
            e->perf[m].status = CUDNN_STATUS_SUCCESS;
            e->perf[m].mathType = (cudnnMathType_t)e->key.math;
            m++;
        }
        e->n_perf = m;
    }
    e->benchmarked = 1;
    return KILN_OK;
}

static int fits(int64_t v) { return v >= 0 && v <= INT_MAX; }

extern "C" kiln_status kiln_cuda_conv2d(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *bias,
                                        const kiln_conv_opts *o)
{
    const char *name = "conv2d";
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, x, w, bias, NULL);
    if (!c) return st;
    if (kiln_tensor_numel(out) == 0) return KILN_OK;
    kiln_dtype ct = kiln_cuda_compute_dtype(x, out);
    int64_t xe = kiln_tensor_numel(x), ye = kiln_tensor_numel(out), we = kiln_tensor_numel(w);
    const int64_t v[] = {x->shape[0], x->shape[1], x->shape[2], x->shape[3], w->shape[0], w->shape[2], w->shape[3],
                         o->padding[0], o->padding[1], o->stride[0], o->stride[1], o->dilation[0], o->dilation[1], o->groups,
                         out->shape[2], out->shape[3], xe, ye, we};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        if (!fits(v[i]))
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s: tensors beyond cuDNN's 2^31-element limit (input %lld, output %lld "
                              "elements); run it in tiles", c->dev->name, name, (long long)xe, (long long)ye);
    conv_key key;
    memset(&key, 0, sizeof key);
    key.n = (int)x->shape[0]; key.c = (int)x->shape[1]; key.h = (int)x->shape[2]; key.w = (int)x->shape[3];
    key.k = (int)w->shape[0]; key.r = (int)w->shape[2]; key.s = (int)w->shape[3];
    key.ph = (int)o->padding[0]; key.pw = (int)o->padding[1]; key.sh = (int)o->stride[0]; key.sw = (int)o->stride[1];
    key.dh = (int)o->dilation[0]; key.dw = (int)o->dilation[1]; key.g = (int)o->groups;
    key.oh = (int)out->shape[2]; key.ow = (int)out->shape[3];
    key.dt = ct;
    key.math = ct == KILN_F32 ? (c->tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH) : CUDNN_TENSOR_OP_MATH;

    kiln_tensor *tx = NULL, *tw = NULL, *to = NULL, *bv = NULL;
    const void *X, *W;
    void *Y = kiln_tensor_data(out), *ws = NULL;
    if ((st = kiln_cuda_as(c, x, ct, &tx, &X))) return st;
    if ((st = kiln_cuda_as(c, w, ct, &tw, &W))) { kiln_tensor_free(tx); return st; }
    if (out->dtype != ct || !kiln_tensor_is_contiguous(out)) {
        if ((st = kiln_cuda_temp(c, ct, 4, out->shape, &to))) { kiln_tensor_free(tx); kiln_tensor_free(tw); return st; }
        Y = kiln_tensor_data(to);
    }
    kiln_tensor *y = to ? to : out;
    if (bias) {
        int64_t stride[4] = {0, bias->stride[0], 0, 0};
        bv = kiln_tensor_from_storage(bias->storage, bias->offset, bias->dtype, 4, y->shape, stride);
        if (!bv) {
            kiln_tensor_free(tx); kiln_tensor_free(tw); kiln_tensor_free(to);
            return kiln_error(KILN_ERR_OOM, "%s: %s: host out of memory", c->dev->name, name);
        }
    }

    pthread_mutex_lock(&c->conv_mu);
    conv_entry *e = NULL;
    /* the workspace is capped where a dry run can bound it (cuda_workspace.h) */
    size_t cap = kiln_cuda_conv_workspace_cap((size_t)xe * kiln_dtype_size(ct), (size_t)ye * kiln_dtype_size(ct));
    if (!(st = cache_get(c, &key, &e)) && c->conv_benchmark && !e->benchmarked) st = benchmark(c, e, X, W, Y, cap);
    const float one = 1.0f;
    size_t smallest = (size_t)-1;
    int done = 0;
    for (int i = 0; !st && !done && i < e->n_perf; i++) {
        const cudnnConvolutionFwdAlgoPerf_t *p = &e->perf[i];
        if (p->status != CUDNN_STATUS_SUCCESS) continue;
        size_t wsize = p->memory;
        if (wsize > cap || (wsize > 0 && !kiln_cuda_try_scratch(c, wsize, &ws))) {
            if (wsize < smallest) smallest = wsize;
            continue;
        }
        float beta = 0.0f;
        if (bv) {
            if ((st = kiln_cuda_copy(y, bv))) break;
            beta = 1.0f;
        }
        /* cuDNN may report DEFAULT_MATH (TF32 allowed) for an f32 algorithm asked with
         * FMA_MATH: keep f32 exact unless TF32 was asked for (as PyTorch does) */
        cudnnMathType_t math = e->key.math == CUDNN_FMA_MATH ? CUDNN_FMA_MATH : p->mathType;
        cudnnStatus_t s = cudnnSetConvolutionMathType(e->cd, math);
        if (s == CUDNN_STATUS_SUCCESS)
            s = cudnnConvolutionForward(c->dnn, &one, e->xd, X, e->wd, W, e->cd, p->algo, ws, wsize, &beta, e->yd, Y);
        kiln_cuda_scratch_free(c, ws);
        ws = NULL;
        if (s == CUDNN_STATUS_SUCCESS) done = 1;
        else if (s != CUDNN_STATUS_NOT_SUPPORTED && s != CUDNN_STATUS_BAD_PARAM)
            st = kiln_cuda_check_dnn(c, name, "cudnnConvolutionForward", s);
    }
    pthread_mutex_unlock(&c->conv_mu);
    if (!st && !done) {
        kiln_mem_stats ms = kiln_device_stats(c->dev);
        if (smallest != (size_t)-1)
            st = kiln_error_oom(c->dev->name, smallest, ms.budget > ms.reserved ? ms.budget - ms.reserved : 0, ms.budget,
                                "%s: %s: no cuDNN algorithm fits the memory budget (smallest workspace %zu bytes)",
                                c->dev->name, name, smallest);
        else
            st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s: cuDNN has no algorithm for input [%d,%d,%d,%d] weight [%d,%d,%d,%d] "
                            "groups %d (%s)", c->dev->name, name, key.n, key.c, key.h, key.w, key.k, key.c / key.g, key.r,
                            key.s, key.g, kiln_dtype_name(ct));
    }
    if (!st) st = kiln_cuda_done(c, name);
    if (!st && to) st = kiln_cuda_copy(out, to);
    kiln_tensor_free(tx);
    kiln_tensor_free(tw);
    kiln_tensor_free(to);
    kiln_tensor_free(bv);
    return st;
}
