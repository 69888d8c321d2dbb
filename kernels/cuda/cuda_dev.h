/* cuda_dev.h - device-side helpers shared by the .cu files: element loads and
 * stores for every kiln dtype (with the CPU backend's conversion rules), typed
 * float conversions for templated kernels, launch sizing and dtype dispatch.
 * Included only by nvcc-compiled files; the formulas the CPU computes alike come from
 * kernels/kernel_formulas.h. */
#ifndef KILN_CUDA_DEV_H
#define KILN_CUDA_DEV_H

#include "../kernel_formulas.h"
#include "cuda_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

typedef __nv_bfloat16 kiln_bf16_t;

/* ---- typed float conversions (f32 arithmetic, storage in T) ---- */
template <typename T> __device__ __forceinline__ float kf_to(T v);
template <> __device__ __forceinline__ float kf_to<float>(float v) { return v; }
template <> __device__ __forceinline__ float kf_to<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float kf_to<kiln_bf16_t>(kiln_bf16_t v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T kf_from(float v);
template <> __device__ __forceinline__ float kf_from<float>(float v) { return v; }
template <> __device__ __forceinline__ __half kf_from<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ kiln_bf16_t kf_from<kiln_bf16_t>(float v) { return __float2bfloat16_rn(v); }

/* ---- the dtype a GEMM or convolution computes in ----
 * Half activations (x f16 / bf16, out the same) keep theirs, whatever the weights'
 * dtype (f32, the other half, fp8, a block type: converted to it per op), so a half
 * network stays on tensor cores; anything else computes in f32. Accumulation is f32
 * either way (CUBLAS_COMPUTE_32F, cuDNN's f32 convolution type). */
static inline kiln_dtype kiln_cuda_compute_dtype(const kiln_tensor *x, const kiln_tensor *out)
{
    int half = x->dtype == KILN_F16 || x->dtype == KILN_BF16;
    return half && out->dtype == x->dtype ? x->dtype : KILN_F32;
}

/* ---- untyped access by kiln_dtype (uniform branch per launch) ---- */
__device__ __forceinline__ double kd_load(const char *p, int dt)
{
    switch (dt) {
    case KILN_F32: return *(const float *)p;
    case KILN_F16: return __half2float(*(const __half *)p);
    case KILN_BF16: return __bfloat162float(*(const kiln_bf16_t *)p);
    case KILN_I32: return *(const int32_t *)p;
    case KILN_I64: return (double)*(const long long *)p;
    case KILN_U8: return *(const uint8_t *)p;
    default: return 0;
    }
}

__device__ __forceinline__ float kd_loadf(const char *p, int dt)
{
    switch (dt) {
    case KILN_F32: return *(const float *)p;
    case KILN_F16: return __half2float(*(const __half *)p);
    case KILN_BF16: return __bfloat162float(*(const kiln_bf16_t *)p);
    default: return (float)kd_load(p, dt);
    }
}

/* Integers: truncate toward zero, saturate, nan -> 0 (the CPU backend's store, one
 * formula in kernel_formulas.h). */
__device__ __forceinline__ void kd_store(char *p, int dt, double v)
{
    switch (dt) {
    case KILN_F32: *(float *)p = (float)v; break;
    case KILN_F16: *(__half *)p = __float2half_rn((float)v); break;
    case KILN_BF16: *(kiln_bf16_t *)p = __float2bfloat16_rn((float)v); break;
    default: kiln_store_int(p, dt, v); break;
    }
}

__device__ __forceinline__ void kd_storef(char *p, int dt, float v)
{
    switch (dt) {
    case KILN_F32: *(float *)p = v; break;
    case KILN_F16: *(__half *)p = __float2half_rn(v); break;
    case KILN_BF16: *(kiln_bf16_t *)p = __float2bfloat16_rn(v); break;
    default: kd_store(p, dt, (double)v); break;
    }
}

__device__ __forceinline__ int kd_size(int dt)
{
    return dt == KILN_F32 || dt == KILN_I32 ? 4 : dt == KILN_I64 ? 8 : dt == KILN_U8 ? 1 : 2;
}

/* ---- strided iteration: up to three operands of one shape, dims merged on the host ---- */
typedef struct {
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    int64_t stride[3][KILN_MAX_DIMS]; /* elements */
} kiln_cuda_iter;

/* Element offsets of linear index i for the first n operands. */
template <int N>
__device__ __forceinline__ void kiln_iter_offsets(const kiln_cuda_iter &it, int64_t i, int64_t *off)
{
#pragma unroll
    for (int k = 0; k < N; k++) off[k] = 0;
    for (int d = it.ndim - 1; d >= 0; d--) {
        int64_t s = it.shape[d];
        int64_t q = i / s, r = i - q * s;
        i = q;
#pragma unroll
        for (int k = 0; k < N; k++) off[k] += r * it.stride[k][d];
    }
}

/* Host: fills it from tensors of one shape (ops[0] the output); returns 1 when every
 * operand is contiguous in the same order (one flat run). */
static inline int kiln_cuda_iter_init(kiln_cuda_iter *it, int nops, const kiln_tensor *const *ops)
{
    it->ndim = kiln_tensor_coalesce(nops, ops, it->shape, it->stride);
    int flat = it->ndim == 1;
    for (int k = 0; k < nops && flat; k++) flat = it->stride[k][0] == 1 || it->shape[0] == 1;
    return flat;
}

/* ---- launch sizing: grid-stride loops over n items ---- */
#define KILN_CUDA_THREADS 256
static inline unsigned kiln_cuda_blocks(const kiln_cuda_ctx *c, int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    int64_t cap = (int64_t)(c->sm_count > 0 ? c->sm_count : 16) * 32;
    if (b > cap) b = cap;
    return (unsigned)(b < 1 ? 1 : b);
}

#define KILN_GRID_STRIDE(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

/* Runs the body (the variadic part) with T bound to the storage type of float dtype DT. */
#define KILN_CUDA_FLOAT_SWITCH(DT, T, ...) \
    switch (DT) { \
    case KILN_F16: { typedef __half T; __VA_ARGS__; } break; \
    case KILN_BF16: { typedef kiln_bf16_t T; __VA_ARGS__; } break; \
    default: { typedef float T; __VA_ARGS__; } break; \
    }

#endif
