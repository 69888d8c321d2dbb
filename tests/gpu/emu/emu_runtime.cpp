// emu_runtime.cpp - a CPU stand-in for the CUDA runtime, cuBLAS and cuDNN, enough to
// run kiln's CUDA backend and its kernels (translated by translate.lua) on a machine
// without a GPU (x86-64). Kernels run block by block; each thread of a block is a
// coroutine, so __syncthreads and warp shuffles are real barriers and a missing
// barrier shows up as wrong results. "Device" memory is host memory, poisoned when
// allocated. cuBLAS/cuDNN calls are checked against their documented argument rules
// and computed by reference loops; the fake heuristics offer algorithms with large
// and small workspaces so the budget fallback runs. Streams and events are no-ops:
// ordering between streams is NOT exercised here, nor real numerics or speed.
#include <cuda_runtime_api.h>
#include <cublas_v2.h>
#include <cudnn.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <vector>
#include <functional>

struct emu_thread_info { uint3 tid; };
emu_thread_info *emu_cur;
uint3 emu_blockIdx;
dim3 emu_blockDim, emu_gridDim;

enum { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
struct EThread {
    emu_thread_info info;
    void *sp;           /* saved stack pointer (emu_switch) */
    int state;
    uint64_t slot;
    char *stack;
};
/* a minimal x86-64 context switch: callee-saved registers on the stack (no signal
 * mask syscall, unlike swapcontext) */
extern "C" void emu_switch(void **save_sp, void *new_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");
static void *sched_sp;
static std::vector<EThread> threads;
static const std::function<void()> *cur_body;
static EThread *cur_t;
static const size_t STACK = 256 << 10;
long emu_launches, emu_switches;

static void yield_to_sched()
{
    emu_switches++;
    emu_switch(&cur_t->sp, sched_sp);
}

static void trampoline()
{
    (*cur_body)();
    cur_t->state = DONE;
    for (;;) yield_to_sched();
}

static void *initial_sp(char *stack)
{
    uintptr_t top = ((uintptr_t)stack + STACK) & ~(uintptr_t)15;
    void **p = (void **)top;
    *--p = 0;                    /* fake return address of the trampoline */
    *--p = (void *)trampoline;   /* where emu_switch's ret goes */
    for (int i = 0; i < 6; i++) *--p = 0;
    return p;
}

void emu_syncthreads()
{
    cur_t->state = WAIT_BLOCK;
    yield_to_sched();
}

uint64_t emu_shfl_raw(uint64_t v, int mode, int arg)
{
    EThread *t = cur_t;
    size_t me = (size_t)(t - threads.data());
    size_t warp = me / 32, lane = me % 32;
    t->slot = v;
    t->state = WAIT_WARP;
    yield_to_sched();
    size_t src = mode == 0 ? (lane ^ (size_t)arg) : (lane + (size_t)arg < 32 ? lane + (size_t)arg : lane);
    size_t idx = warp * 32 + src;
    if (idx >= threads.size() || src >= 32) { fprintf(stderr, "emu: shuffle source lane out of range\n"); abort(); }
    uint64_t r = threads[idx].slot;
    t->state = WAIT_WARP;
    yield_to_sched();
    return r;
}

void emu_launch(dim3 grid, dim3 block, size_t smem, cudaStream_t s, const std::function<void()> &body)
{
    (void)smem; (void)s;
    emu_launches++;
    size_t n = (size_t)block.x * block.y * block.z;
    if (n == 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
        fprintf(stderr, "emu: bad launch grid (%u,%u,%u) block (%u,%u,%u)\n", grid.x, grid.y, grid.z, block.x, block.y, block.z);
        abort();
    }
    if (threads.size() < n) {
        size_t old = threads.size();
        threads.resize(n);
        for (size_t i = old; i < n; i++) threads[i].stack = (char *)malloc(STACK);
    }
    emu_blockDim = block;
    emu_gridDim = grid;
    cur_body = &body;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                emu_blockIdx = make_uint3(bx, by, bz);
                for (size_t i = 0; i < n; i++) {
                    EThread &t = threads[i];
                    t.info.tid = make_uint3((unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / (block.x * block.y)));
                    t.state = RUN;
                    t.sp = initial_sp(t.stack);
                }
                for (;;) {
                    for (size_t i = 0; i < n; i++) {
                        if (threads[i].state != RUN) continue;
                        cur_t = &threads[i];
                        emu_cur = &threads[i].info;
                        emu_switch(&sched_sp, threads[i].sp);
                    }
                    size_t done = 0, wb = 0;
                    for (size_t i = 0; i < n; i++) { done += threads[i].state == DONE; wb += threads[i].state == WAIT_BLOCK; }
                    if (done == n) break;
                    int released = 0;
                    if (wb + done == n) {
                        if (done) { fprintf(stderr, "emu: __syncthreads after some threads exited (block %u)\n", bx); }
                        for (size_t i = 0; i < n; i++) if (threads[i].state == WAIT_BLOCK) threads[i].state = RUN;
                        released = 1;
                    } else {
                        for (size_t w = 0; w * 32 < n; w++) {
                            size_t lo = w * 32, hi = lo + 32 < n ? lo + 32 : n, ww = 0, wd = 0;
                            for (size_t i = lo; i < hi; i++) { ww += threads[i].state == WAIT_WARP; wd += threads[i].state == DONE; }
                            if (ww && ww + wd == hi - lo) {
                                if (wd) { fprintf(stderr, "emu: shuffle with exited lanes\n"); abort(); }
                                for (size_t i = lo; i < hi; i++) threads[i].state = RUN;
                                released = 1;
                            }
                        }
                    }
                    if (!released) { fprintf(stderr, "emu: deadlock (threads wait on different barriers)\n"); abort(); }
                }
            }
}

// ---------------------------------------------------------------- CUDA runtime
static cudaError_t last_err = cudaSuccess;
static cudaError_t ret(cudaError_t e) { if (e) last_err = e; return e; }

extern "C" {
cudaError_t cudaGetDeviceCount(int *n) { *n = getenv("EMU_NO_GPU") ? 0 : 1; return *n ? cudaSuccess : ret(cudaErrorNoDevice); }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d)
{
    if (d != 0) return ret(cudaErrorInvalidDevice);
    memset(p, 0, sizeof *p);
    strcpy(p->name, "emulated GPU");
    p->totalGlobalMem = (size_t)8 << 30;
    p->multiProcessorCount = 1;
    /* EMU_CC=75 (say) emulates an older card: what depends on the compute capability */
    const char *cc = getenv("EMU_CC");
    int v = cc && atoi(cc) > 0 ? atoi(cc) : 90;
    p->major = v / 10; p->minor = v % 10;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : ret(cudaErrorInvalidDevice); }
static size_t live_bytes, limit_bytes = (size_t)-1;
cudaError_t cudaMalloc(void **p, size_t n)
{
    if (getenv("EMU_MEM_LIMIT") && live_bytes + n > (size_t)atoll(getenv("EMU_MEM_LIMIT"))) { *p = NULL; return ret(cudaErrorMemoryAllocation); }
    (void)limit_bytes;
    size_t *b = (size_t *)aligned_alloc(256, (n + 256 + 255) / 256 * 256);
    if (!b) return ret(cudaErrorMemoryAllocation);
    b[0] = n; live_bytes += n;
    memset(b + 1, 0xCD, 0); // content undefined, as on a GPU
    char *q = (char *)b + 256;
    for (size_t i = 0; i < n; i++) q[i] = (char)0xCD; // poison: reads of unwritten memory show
    *p = q;
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) { if (p) { size_t *b = (size_t *)((char *)p - 256); live_bytes -= b[0]; free(b); } return cudaSuccess; }
cudaError_t cudaMallocHost(void **p, size_t n) { *p = malloc(n); return *p ? cudaSuccess : ret(cudaErrorMemoryAllocation); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned f) { (void)f; *s = (cudaStream_t)malloc(8); return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned f) { (void)f; *e = (cudaEvent_t)malloc(8); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { (void)e; (void)s; return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f) { (void)s; (void)e; (void)f; return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t e) { (void)e; static int k; return (++k % 3) ? cudaSuccess : ret(cudaErrorNotReady); }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) { (void)k; (void)st; memmove(d, s, n); return cudaSuccess; }
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st) { (void)st; memset(d, v, n); return cudaSuccess; }
cudaError_t cudaGetLastError(void) { cudaError_t e = last_err; last_err = cudaSuccess; return e; }
const char *cudaGetErrorString(cudaError_t e) { return e == cudaErrorNoDevice ? "no CUDA-capable device is detected" : e == cudaErrorMemoryAllocation ? "out of memory" : "emulated error"; }
const char *cudaGetErrorName(cudaError_t e) { (void)e; return "cudaErrorEmulated"; }
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) { (void)p; memset(a, 0, sizeof *a); a->device = 0; a->type = cudaMemoryTypeDevice; return cudaSuccess; }
}

// ---------------------------------------------------------------- cuBLAS
static double ld(const void *p, cudaDataType_t t, size_t i)
{
    switch (t) {
    case CUDA_R_32F: return ((const float *)p)[i];
    case CUDA_R_16F: return __half2float(((const __half *)p)[i]);
    case CUDA_R_16BF: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    default: abort();
    }
}
static void st(void *p, cudaDataType_t t, size_t i, double v)
{
    switch (t) {
    case CUDA_R_32F: ((float *)p)[i] = (float)v; break;
    case CUDA_R_16F: ((__half *)p)[i] = __float2half_rn((float)v); break;
    case CUDA_R_16BF: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)v); break;
    default: abort();
    }
}
long emu_gemms;
static cublasStatus_t gemm1(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha, const void *A,
                            cudaDataType_t at, int lda, const void *B, cudaDataType_t bt, int ldb, float beta, void *C,
                            cudaDataType_t ct, int ldc)
{
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double acc = 0;
            for (int l = 0; l < k; l++) {
                double a = ta == CUBLAS_OP_N ? ld(A, at, (size_t)i + (size_t)l * lda) : ld(A, at, (size_t)l + (size_t)i * lda);
                double b = tb == CUBLAS_OP_N ? ld(B, bt, (size_t)l + (size_t)j * ldb) : ld(B, bt, (size_t)j + (size_t)l * ldb);
                acc += (double)(float)a * (double)(float)b;
            }
            size_t ci = (size_t)i + (size_t)j * ldc;
            double prev = beta != 0 ? ld(C, ct, ci) : 0;
            st(C, ct, ci, alpha * acc + beta * prev);
        }
    return CUBLAS_STATUS_SUCCESS;
}
static cublasStatus_t check(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, cudaDataType_t at, int lda,
                            cudaDataType_t bt, int ldb, cudaDataType_t ct, int ldc, cublasComputeType_t comp)
{
    int ok = m >= 0 && n >= 0 && k >= 0 && lda >= (ta == CUBLAS_OP_N ? (m > 1 ? m : 1) : (k > 1 ? k : 1)) &&
             ldb >= (tb == CUBLAS_OP_N ? (k > 1 ? k : 1) : (n > 1 ? n : 1)) && ldc >= (m > 1 ? m : 1);
    ok = ok && at == bt && (ct == at || ct == CUDA_R_32F);
    ok = ok && (comp == CUBLAS_COMPUTE_32F || comp == CUBLAS_COMPUTE_32F_FAST_TF32);
    if (!ok) fprintf(stderr, "emu cuBLAS: invalid gemm m%d n%d k%d lda%d ldb%d ldc%d ta%d tb%d types %d %d %d\n", m, n, k, lda, ldb, ldc, ta, tb, at, bt, ct);
    return ok ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}
extern "C" {
cublasStatus_t cublasCreate_v2(cublasHandle_t *h) { *h = (cublasHandle_t)malloc(8); return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) { (void)h; (void)s; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void *w, size_t n) { (void)h; (void)w; (void)n; return CUBLAS_STATUS_SUCCESS; }
const char *cublasGetStatusString(cublasStatus_t s) { return s == CUBLAS_STATUS_INVALID_VALUE ? "CUBLAS_STATUS_INVALID_VALUE" : "CUBLAS_STATUS_?"; }
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                            void *C, cudaDataType ct, int ldc, cublasComputeType_t comp, cublasGemmAlgo_t algo)
{
    (void)h; (void)algo;
    emu_gemms++;
    cublasStatus_t s = check(ta, tb, m, n, k, at, lda, bt, ldb, ct, ldc, comp);
    if (s) return s;
    return gemm1(ta, tb, m, n, k, *(const float *)alpha, A, at, lda, B, bt, ldb, *(const float *)beta, C, ct, ldc);
}
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                          const void *alpha, const void *A, cudaDataType at, int lda, long long sa,
                                          const void *B, cudaDataType bt, int ldb, long long sb, const void *beta, void *C,
                                          cudaDataType ct, int ldc, long long sc, int batch, cublasComputeType_t comp,
                                          cublasGemmAlgo_t algo)
{
    (void)h; (void)algo;
    emu_gemms++;
    cublasStatus_t s = check(ta, tb, m, n, k, at, lda, bt, ldb, ct, ldc, comp);
    if (s || batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
    size_t ea = at == CUDA_R_32F ? 4 : 2, ec = ct == CUDA_R_32F ? 4 : 2;
    for (int b = 0; b < batch; b++)
        gemm1(ta, tb, m, n, k, *(const float *)alpha, (const char *)A + (size_t)(b * sa) * ea, at, lda,
              (const char *)B + (size_t)(b * sb) * ea, bt, ldb, *(const float *)beta, (char *)C + (size_t)(b * sc) * ec, ct, ldc);
    return CUBLAS_STATUS_SUCCESS;
}
}

// ---------------------------------------------------------------- cuDNN
struct cudnnTensorStruct { cudnnDataType_t t; int n, c, h, w; };
struct cudnnFilterStruct { cudnnDataType_t t; int k, c, r, s; };
struct cudnnConvolutionStruct { int ph, pw, sh, sw, dh, dw, g; cudnnMathType_t math; };
long emu_convs, emu_conv_ws;
/* Workspaces that scale as cuDNN's do, in the data's element size (so half precision
 * halves them too): GEMM an im2col buffer of the whole batch, FFT the padded input,
 * filter and output spectra; the implicit GEMMs none. */
static size_t ws_need(cudnnConvolutionFwdAlgo_t a, const cudnnTensorStruct *x, const cudnnFilterStruct *w,
                      const cudnnTensorStruct *y)
{
    size_t e = x->t == CUDNN_DATA_FLOAT ? 4 : 2;
    if (a == CUDNN_CONVOLUTION_FWD_ALGO_GEMM) return (size_t)y->n * w->c * w->r * w->s * y->h * y->w * e;
    if (a == CUDNN_CONVOLUTION_FWD_ALGO_FFT)
        return ((size_t)x->n * x->c + (size_t)w->k * w->c + (size_t)y->n * y->c) * (x->h + w->r) * (x->w + w->s) * 2 * e;
    return 0;
}
static double dl(const void *p, cudnnDataType_t t, size_t i)
{
    return ld(p, t == CUDNN_DATA_HALF ? CUDA_R_16F : t == CUDNN_DATA_BFLOAT16 ? CUDA_R_16BF : CUDA_R_32F, i);
}
static void ds(void *p, cudnnDataType_t t, size_t i, double v)
{
    st(p, t == CUDNN_DATA_HALF ? CUDA_R_16F : t == CUDNN_DATA_BFLOAT16 ? CUDA_R_16BF : CUDA_R_32F, i, v);
}
extern "C" {
cudnnStatus_t cudnnCreate(cudnnHandle_t *h) { *h = (cudnnHandle_t)malloc(8); return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnSetStream(cudnnHandle_t h, cudaStream_t s) { (void)h; (void)s; return CUDNN_STATUS_SUCCESS; }
const char *cudnnGetErrorString(cudnnStatus_t s) { (void)s; return "CUDNN_STATUS_EMULATED"; }
cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t *d) { *d = (cudnnTensorDescriptor_t)calloc(1, sizeof **d); return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t *d) { *d = (cudnnFilterDescriptor_t)calloc(1, sizeof **d); return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t *d) { *d = (cudnnConvolutionDescriptor_t)calloc(1, sizeof **d); (*d)->g = 1; return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d) { free(d); return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d) { free(d); return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d) { free(d); return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t d, cudnnTensorFormat_t f, cudnnDataType_t t, int n, int c, int h, int w)
{
    if (f != CUDNN_TENSOR_NCHW || n <= 0 || c <= 0 || h <= 0 || w <= 0) return CUDNN_STATUS_BAD_PARAM;
    *d = {t, n, c, h, w};
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t d, cudnnDataType_t t, cudnnTensorFormat_t f, int k, int c, int r, int s)
{
    if (f != CUDNN_TENSOR_NCHW || k <= 0 || c <= 0 || r <= 0 || s <= 0) return CUDNN_STATUS_BAD_PARAM;
    *d = {t, k, c, r, s};
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t d, int ph, int pw, int u, int v, int dh, int dw,
                                              cudnnConvolutionMode_t mode, cudnnDataType_t ct)
{
    if (mode != CUDNN_CROSS_CORRELATION || ct != CUDNN_DATA_FLOAT) return CUDNN_STATUS_BAD_PARAM;
    d->ph = ph; d->pw = pw; d->sh = u; d->sw = v; d->dh = dh; d->dw = dw;
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolutionGroupCount(cudnnConvolutionDescriptor_t d, int g) { d->g = g; return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d, cudnnMathType_t m) { d->math = m; return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnGetConvolution2dForwardOutputDim(const cudnnConvolutionDescriptor_t c, const cudnnTensorDescriptor_t x,
                                                    const cudnnFilterDescriptor_t w, int *n, int *k, int *h, int *wo)
{
    if (x->c != w->c * c->g) return CUDNN_STATUS_BAD_PARAM;
    *n = x->n; *k = w->k;
    *h = (x->h + 2 * c->ph - c->dh * (w->r - 1) - 1) / c->sh + 1;
    *wo = (x->w + 2 * c->pw - c->dw * (w->s - 1) - 1) / c->sw + 1;
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t h, const cudnnTensorDescriptor_t x, const cudnnFilterDescriptor_t w,
                                                     const cudnnConvolutionDescriptor_t c, const cudnnTensorDescriptor_t y,
                                                     const int req, int *n, cudnnConvolutionFwdAlgoPerf_t *perf)
{
    (void)h;
    cudnnConvolutionFwdAlgo_t algos[3] = {CUDNN_CONVOLUTION_FWD_ALGO_GEMM, CUDNN_CONVOLUTION_FWD_ALGO_FFT, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM};
    *n = 0;
    for (int i = 0; i < 3 && i < req; i++) {
        memset(&perf[i], 0, sizeof perf[i]);
        perf[i].algo = algos[i];
        perf[i].status = CUDNN_STATUS_SUCCESS;
        perf[i].memory = ws_need(algos[i], x, w, y);
        perf[i].mathType = c->math == CUDNN_FMA_MATH ? CUDNN_DEFAULT_MATH : c->math; // as cuDNN sometimes does
        (*n)++;
    }
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void *alpha, const cudnnTensorDescriptor_t xd, const void *x,
                                      const cudnnFilterDescriptor_t wd, const void *w, const cudnnConvolutionDescriptor_t cd,
                                      cudnnConvolutionFwdAlgo_t algo, void *ws, size_t wss, const void *beta,
                                      const cudnnTensorDescriptor_t yd, void *y)
{
    (void)h;
    emu_convs++;
    if (xd->t != wd->t || xd->t != yd->t) { fprintf(stderr, "emu cuDNN: mixed data types\n"); return CUDNN_STATUS_EXECUTION_FAILED; }
    size_t need = ws_need(algo, xd, wd, yd);
    if (wss < need || (need && !ws)) { fprintf(stderr, "emu cuDNN: workspace %zu < %zu\n", wss, need); return CUDNN_STATUS_EXECUTION_FAILED; }
    if (need) emu_conv_ws++;
    if (xd->t == CUDNN_DATA_FLOAT && cd->math != CUDNN_FMA_MATH && !getenv("KILN_CUDA_TF32")) { fprintf(stderr, "emu cuDNN: f32 conv not FMA math\n"); return CUDNN_STATUS_EXECUTION_FAILED; }
    int on, ok_, oh, ow;
    if (cudnnGetConvolution2dForwardOutputDim(cd, xd, wd, &on, &ok_, &oh, &ow) || on != yd->n || ok_ != yd->c || oh != yd->h || ow != yd->w) {
        fprintf(stderr, "emu cuDNN: y descriptor mismatch\n"); return CUDNN_STATUS_BAD_PARAM;
    }
    float a = *(const float *)alpha, b = *(const float *)beta;
    int cpg = wd->c, kpg = wd->k / cd->g;
    for (int n = 0; n < on; n++)
        for (int k = 0; k < ok_; k++) {
            int g = k / kpg;
            for (int i = 0; i < oh; i++)
                for (int j = 0; j < ow; j++) {
                    double acc = 0;
                    for (int c = 0; c < cpg; c++)
                        for (int r = 0; r < wd->r; r++)
                            for (int s = 0; s < wd->s; s++) {
                                int yy = i * cd->sh - cd->ph + r * cd->dh, xx = j * cd->sw - cd->pw + s * cd->dw;
                                if (yy < 0 || yy >= xd->h || xx < 0 || xx >= xd->w) continue;
                                int cc = g * cpg + c;
                                acc += (double)(float)dl(x, xd->t, (((size_t)n * xd->c + cc) * xd->h + yy) * xd->w + xx) *
                                       (double)(float)dl(w, wd->t, (((size_t)k * cpg + c) * wd->r + r) * wd->s + s);
                            }
                    size_t yi = (((size_t)n * yd->c + k) * yd->h + i) * yd->w + j;
                    double prev = b != 0 ? dl(y, yd->t, yi) : 0;
                    ds(y, yd->t, yi, a * acc + b * prev);
                }
        }
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnFindConvolutionForwardAlgorithmEx(cudnnHandle_t h, const cudnnTensorDescriptor_t xd, const void *x,
                                                     const cudnnFilterDescriptor_t wd, const void *w,
                                                     const cudnnConvolutionDescriptor_t cd, const cudnnTensorDescriptor_t yd,
                                                     void *y, const int req, int *n, cudnnConvolutionFwdAlgoPerf_t *perf,
                                                     void *ws, size_t wss)
{
    (void)x; (void)w; (void)y; (void)ws;
    cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, yd, req, n, perf);
    for (int i = 0; i < *n; i++) if (perf[i].memory > wss) perf[i].status = CUDNN_STATUS_ALLOC_FAILED;
    return CUDNN_STATUS_SUCCESS;
}
}

__attribute__((destructor)) static void emu_report(void)
{
    fprintf(stderr, "# emu: %ld kernel launches, %ld context switches, %ld gemms, %ld convs (%ld with a workspace)\n",
            emu_launches, emu_switches, emu_gemms, emu_convs, emu_conv_ws);
}
