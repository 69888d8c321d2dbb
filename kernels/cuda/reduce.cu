/* reduce.cu - sum, mean, max, min and var over one dimension or the whole tensor.
 * The input is viewed as [outer, dim, inner] and accumulated in double (var as
 * Welford/Chan states), like kernels/cpu/reduce.c. inner == 1: a block (or several,
 * for long rows, combined by a second kernel) per row; inner > 1: a thread per
 * output walking the dimension, coalesced along inner. */
#include "cuda_dev.h"
#include "cuda_workspace.h"

/* sum/mean: a = sum. max/min: a = value. var: a = count, b = mean, c = m2. */
struct RState { double a, b, c; };
static_assert(sizeof(RState) == KILN_CUDA_REDUCE_STATE_BYTES, "cuda_workspace.h sizes RState");

__device__ __forceinline__ RState r_identity(int op)
{
    RState s = {0, 0, 0};
    if (op == KILN_RED_MAX) s.a = -INFINITY;
    if (op == KILN_RED_MIN) s.a = INFINITY;
    return s;
}

__device__ __forceinline__ RState r_push(int op, RState s, double v)
{
    switch (op) {
    case KILN_RED_MAX: s.a = (v != v || s.a != s.a) ? NAN : (v > s.a ? v : s.a); break;
    case KILN_RED_MIN: s.a = (v != v || s.a != s.a) ? NAN : (v < s.a ? v : s.a); break;
    case KILN_RED_VAR: {
        s.a += 1;
        double d = v - s.b;
        s.b += d / s.a;
        s.c += d * (v - s.b);
    } break;
    default: s.a += v; break;
    }
    return s;
}

__device__ __forceinline__ RState r_merge(int op, RState x, RState y)
{
    switch (op) {
    case KILN_RED_MAX: x.a = (x.a != x.a || y.a != y.a) ? NAN : (y.a > x.a ? y.a : x.a); break;
    case KILN_RED_MIN: x.a = (x.a != x.a || y.a != y.a) ? NAN : (y.a < x.a ? y.a : x.a); break;
    case KILN_RED_VAR: {
        double n = x.a + y.a;
        if (n == 0) break;
        double d = y.b - x.b;
        x.c = x.c + y.c + d * d * x.a * y.a / n;
        x.b = x.b + d * y.a / n;
        x.a = n;
    } break;
    default: x.a += y.a; break;
    }
    return x;
}

__device__ __forceinline__ double r_final(int op, RState s, int64_t dim, int unbiased)
{
    switch (op) {
    case KILN_RED_MEAN: return dim ? s.a / (double)dim : NAN;
    case KILN_RED_VAR: return (double)dim - unbiased > 0 ? s.c / ((double)dim - unbiased) : NAN;
    default: return s.a;
    }
}

__device__ __forceinline__ RState r_shfl(RState s, int off)
{
    RState o;
    o.a = __shfl_down_sync(0xffffffffu, s.a, off);
    o.b = __shfl_down_sync(0xffffffffu, s.b, off);
    o.c = __shfl_down_sync(0xffffffffu, s.c, off);
    return o;
}

/* Block-wide merge; the result is valid in thread 0. */
__device__ RState r_block(int op, RState s)
{
    __shared__ RState warp_s[32];
    for (int off = 16; off > 0; off >>= 1) s = r_merge(op, s, r_shfl(s, off));
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) warp_s[w] = s;
    __syncthreads();
    if (w == 0) {
        s = lane < nw ? warp_s[lane] : r_identity(op);
        for (int off = 16; off > 0; off >>= 1) s = r_merge(op, s, r_shfl(s, off));
    }
    return s;
}

/* grid (chunks, rows): chunk `blockIdx.x` of row `blockIdx.y`; one chunk writes the
 * result, several write partial states */
__global__ void reduce_rows_k(int op, const char *x, int dtx, int64_t dim, int64_t chunk, char *y, int dty,
                              RState *part, int unbiased)
{
    int64_t row = blockIdx.y;
    int64_t b = (int64_t)blockIdx.x * chunk, e = b + chunk < dim ? b + chunk : dim;
    int ex = kd_size(dtx);
    const char *xr = x + row * dim * ex;
    RState s = r_identity(op);
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) s = r_push(op, s, kd_load(xr + i * ex, dtx));
    s = r_block(op, s);
    if (threadIdx.x == 0) {
        if (part) part[row * gridDim.x + blockIdx.x] = s;
        else kd_store(y + row * kd_size(dty), dty, r_final(op, s, dim, unbiased));
    }
}

__global__ void reduce_parts_k(int op, const RState *part, int64_t nparts, int64_t rows, char *y, int dty, int64_t dim,
                               int unbiased)
{
    KILN_GRID_STRIDE(r, rows) {
        RState s = r_identity(op);
        for (int64_t k = 0; k < nparts; k++) s = r_merge(op, s, part[r * nparts + k]);
        kd_store(y + r * kd_size(dty), dty, r_final(op, s, dim, unbiased));
    }
}

/* inner > 1: thread per (outer, inner) output, sequential over dim (exactly the CPU order) */
__global__ void reduce_cols_k(int op, const char *x, int dtx, int64_t outer, int64_t dim, int64_t inner, char *y, int dty,
                              int unbiased)
{
    int ex = kd_size(dtx);
    KILN_GRID_STRIDE(idx, outer * inner) {
        int64_t o = idx / inner, i = idx - o * inner;
        const char *p = x + (o * dim * inner + i) * ex;
        RState s = r_identity(op);
        for (int64_t k = 0; k < dim; k++) s = r_push(op, s, kd_load(p + k * inner * ex, dtx));
        kd_store(y + idx * kd_size(dty), dty, r_final(op, s, dim, unbiased));
    }
}

extern "C" kiln_status kiln_cuda_reduce(kiln_redop op, kiln_tensor *out, const kiln_tensor *a, int dim, int unbiased)
{
    const char *name = "reduce";
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, a, NULL, NULL, NULL);
    if (!c) return st;
    int64_t outer = 1, len = 1, inner = 1;
    if (dim < 0) len = kiln_tensor_numel(a);
    else {
        for (int i = 0; i < dim; i++) outer *= a->shape[i];
        len = a->shape[dim];
        for (int i = dim + 1; i < a->ndim; i++) inner *= a->shape[i];
    }
    int64_t rows = outer * inner;
    if (rows == 0) return KILN_OK;
    kiln_tensor *tx = NULL, *to = NULL;
    const void *X;
    if ((st = kiln_cuda_as(c, a, a->dtype, &tx, &X))) return st;
    char *Y = (char *)kiln_tensor_data(out);
    if (!kiln_tensor_is_contiguous(out)) {
        if ((st = kiln_cuda_temp(c, out->dtype, out->ndim, out->shape, &to))) { kiln_tensor_free(tx); return st; }
        Y = (char *)kiln_tensor_data(to);
    }
    RState *part = NULL;
    if (inner > 1 || len == 0) {
        reduce_cols_k<<<kiln_cuda_blocks(c, rows, KILN_CUDA_THREADS), KILN_CUDA_THREADS, 0, c->compute>>>(
            op, (const char *)X, a->dtype, outer, len, inner, Y, out->dtype, unbiased);
    } else {
        /* enough blocks to fill the GPU, chunks of at least 4096 elements */
        int64_t nchunks = kiln_cuda_row_chunks(rows, len, c->sm_count, KILN_CUDA_REDUCE_CHUNK);
        if (rows > 65535) nchunks = 1;
        int64_t chunk = (len + nchunks - 1) / nchunks;
        if (nchunks > 1 && (st = kiln_cuda_scratch(c, kiln_cuda_reduce_part_bytes(rows, len, c->sm_count), (void **)&part))) {
            kiln_tensor_free(tx);
            kiln_tensor_free(to);
            return st;
        }
        if (rows <= 65535) {
            dim3 grid((unsigned)nchunks, (unsigned)rows);
            reduce_rows_k<<<grid, KILN_CUDA_THREADS, 0, c->compute>>>(op, (const char *)X, a->dtype, len, chunk, Y, out->dtype,
                                                                     part, unbiased);
            if (part)
                reduce_parts_k<<<kiln_cuda_blocks(c, rows, KILN_CUDA_THREADS), KILN_CUDA_THREADS, 0, c->compute>>>(
                    op, part, nchunks, rows, Y, out->dtype, len, unbiased);
        } else { /* many short rows: a thread per row */
            reduce_cols_k<<<kiln_cuda_blocks(c, rows, KILN_CUDA_THREADS), KILN_CUDA_THREADS, 0, c->compute>>>(
                op, (const char *)X, a->dtype, rows, len, 1, Y, out->dtype, unbiased);
        }
    }
    st = kiln_cuda_done(c, name);
    kiln_cuda_scratch_free(c, part);
    if (!st && to) st = kiln_cuda_copy(out, to);
    kiln_tensor_free(tx);
    kiln_tensor_free(to);
    return st;
}
