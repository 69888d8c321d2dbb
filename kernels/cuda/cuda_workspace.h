/* cuda_workspace.h - the sizes of the scratch the CUDA kernels take from the device's
 * allocator (partial sums of the row statistics and reductions, the cuBLAS workspace,
 * the cap on a convolution's cuDNN workspace): one formula, compiled by nvcc for the
 * kernels and by cc for the meta device, whose dry runs take the same blocks. */
#ifndef KILN_CUDA_WORKSPACE_H
#define KILN_CUDA_WORKSPACE_H

#include <stddef.h>
#include <stdint.h>

/* A dry run does not know the GPU's multiprocessor count, which sets how many chunks a
 * row is split into; it sizes the partial sums for this many (no GPU has more), so its
 * blocks are never smaller than the kernels'. */
#define KILN_CUDA_SM_MODEL_MAX 1024

/* Chunks a row of len elements is split into (at least per_chunk elements each) so that
 * rows x chunks blocks fill sm_count multiprocessors four times over. */
static inline int64_t kiln_cuda_row_chunks(int64_t rows, int64_t len, int sm_count, int64_t per_chunk)
{
    int64_t want = (int64_t)(sm_count > 0 ? sm_count : 16) * 4;
    int64_t nchunks = rows >= want ? 1 : (want + rows - 1) / rows;
    int64_t maxc = (len + per_chunk - 1) / per_chunk;
    if (nchunks > maxc) nchunks = maxc;
    return nchunks < 1 ? 1 : nchunks;
}

/* Row statistics (GroupNorm, LayerNorm): the mean / rstd output, 2 floats a row, and
 * the partial sums of its chunks, 3 floats each, both live while the kernel runs. */
#define KILN_CUDA_STATS_CHUNK 2048
static inline size_t kiln_cuda_stats_bytes(int64_t rows) { return (size_t)rows * 2 * sizeof(float); }
static inline size_t kiln_cuda_stats_part_bytes(int64_t rows, int64_t len, int sm_count)
{
    return (size_t)(rows * kiln_cuda_row_chunks(rows, len, sm_count, KILN_CUDA_STATS_CHUNK)) * 3 * sizeof(float);
}

/* A reduction over contiguous rows (inner == 1): one partial state (3 doubles) per
 * chunk where a row is split; none for more rows than a grid's y dimension holds. */
#define KILN_CUDA_REDUCE_CHUNK 4096
#define KILN_CUDA_REDUCE_STATE_BYTES (3 * sizeof(double))
static inline size_t kiln_cuda_reduce_part_bytes(int64_t rows, int64_t len, int sm_count)
{
    if (rows > 65535 || len == 0) return 0;
    int64_t n = kiln_cuda_row_chunks(rows, len, sm_count, KILN_CUDA_REDUCE_CHUNK);
    return n > 1 ? (size_t)(rows * n) * KILN_CUDA_REDUCE_STATE_BYTES : 0;
}

/* cuBLAS's workspace (NVIDIA's recommendation: 32 MiB on Hopper and later, 4 MiB
 * before), taken once a context starts and after every release, only where it fits
 * the budget without evicting; the largest is what a dry run assumes. */
static inline size_t kiln_cuda_blas_workspace_bytes(int cc_major)
{
    return cc_major >= 9 ? ((size_t)32 << 20) : ((size_t)4 << 20);
}
#define KILN_CUDA_BLAS_WORKSPACE_MAX ((size_t)32 << 20)
#define KILN_CUDA_BLAS_WORKSPACE_MIN ((size_t)4 << 20)

/* The most workspace one convolution may take: as much as its input and output, and
 * at least 64 MiB. cuDNN's fastest algorithm can ask for more (FFT, non-fused
 * Winograd); those are skipped, so that the workspace, never taken where it does not
 * fit without evicting, is also bounded by what a dry run can compute from shapes. */
static inline size_t kiln_cuda_conv_workspace_cap(size_t x_bytes, size_t y_bytes)
{
    size_t n = x_bytes + y_bytes, floor = (size_t)64 << 20;
    return n > floor ? n : floor;
}

#endif
