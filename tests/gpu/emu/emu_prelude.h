/* emu_prelude.h - compiles CUDA kernels as host C++ for a CPU emulation of the
 * CUDA execution model (threads as coroutines, __syncthreads and warp shuffles as
 * barriers; see emu_runtime.cpp). Force-included (-include) before each .cu source
 * translated by translate.lua. */
#pragma once
#include <cuda_runtime_api.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vector_types.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <functional>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#undef __restrict__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct emu_thread_info { uint3 tid; };
extern emu_thread_info *emu_cur;
extern uint3 emu_blockIdx;
extern dim3 emu_blockDim, emu_gridDim;
#define threadIdx (emu_cur->tid)
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim

void emu_syncthreads();
uint64_t emu_shfl_raw(uint64_t v, int mode, int arg);
#define __syncthreads() emu_syncthreads()
template <typename T> static inline T emu_shfl(T v, int mode, int arg)
{
    static_assert(sizeof(T) <= 8, "shfl of a large type");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    u = emu_shfl_raw(u, mode, arg);
    T r;
    memcpy(&r, &u, sizeof r);
    return r;
}
#define __shfl_xor_sync(mask, v, off) emu_shfl((v), 0, (off))
#define __shfl_down_sync(mask, v, off) emu_shfl((v), 1, (off))

static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }

void emu_launch(dim3 grid, dim3 block, size_t smem, cudaStream_t s, const std::function<void()> &body);
