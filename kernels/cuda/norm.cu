/* norm.cu - group_norm (+ fused SiLU), layer_norm and softmax on CUDA.
 * Norms: statistics of each normalized span (a group's cpg*HW elements, or a row
 * of D) by per-thread Welford in f32, merged with Chan's formula in a block, across
 * blocks in double (a 512x512 VAE group of 4M elements is split over many blocks);
 * then one elementwise pass applies (x - mean) * rstd * gamma + beta. Biased
 * variance and 1/sqrt(var + eps) in double, as the CPU kernels. Softmax: online
 * max/sum per row (a warp per row up to 1024, else a block), or a thread per
 * column when the reduced dim is not the last. Storage f32/f16/bf16, math f32. */
#include "cuda_dev.h"
#include "cuda_workspace.h"

/* ---- Welford states ---- */
struct WState { float n, mean, m2; };

__device__ __forceinline__ WState w_merge(WState a, WState b)
{
    float n = a.n + b.n;
    if (n == 0.0f) return a;
    float d = b.mean - a.mean, f = b.n / n;
    WState r;
    r.n = n;
    r.mean = a.mean + d * f;
    r.m2 = a.m2 + b.m2 + d * d * a.n * f;
    return r;
}

__device__ WState w_block(WState s)
{
    __shared__ WState ws[32];
    for (int off = 16; off > 0; off >>= 1) {
        WState o;
        o.n = __shfl_down_sync(0xffffffffu, s.n, off);
        o.mean = __shfl_down_sync(0xffffffffu, s.mean, off);
        o.m2 = __shfl_down_sync(0xffffffffu, s.m2, off);
        s = w_merge(s, o);
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads(); /* ws may still be read by a previous call */
    if (lane == 0) ws[w] = s;
    __syncthreads();
    if (w == 0) {
        WState z = {0.0f, 0.0f, 0.0f};
        s = lane < nw ? ws[lane] : z;
        for (int off = 16; off > 0; off >>= 1) {
            WState o;
            o.n = __shfl_down_sync(0xffffffffu, s.n, off);
            o.mean = __shfl_down_sync(0xffffffffu, s.mean, off);
            o.m2 = __shfl_down_sync(0xffffffffu, s.m2, off);
            s = w_merge(s, o);
        }
    }
    return s;
}

/* grid (chunks, rows): partial Welford state of chunk blockIdx.x of row blockIdx.y
 * (rows of L contiguous elements) */
template <typename T>
__global__ void stats_part_k(const T *x, int64_t L, int64_t chunk, float *part)
{
    int64_t row = blockIdx.y;
    int64_t b = (int64_t)blockIdx.x * chunk, e = b + chunk < L ? b + chunk : L;
    const T *xr = x + row * L;
    WState s = {0.0f, 0.0f, 0.0f};
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
        float v = kf_to<T>(xr[i]);
        s.n += 1.0f;
        float d = v - s.mean;
        s.mean += d / s.n;
        s.m2 += d * (v - s.mean);
    }
    s = w_block(s);
    if (threadIdx.x == 0) {
        float *p = part + (row * gridDim.x + blockIdx.x) * 3;
        p[0] = s.n;
        p[1] = s.mean;
        p[2] = s.m2;
    }
}

/* per row: merge the partials in double -> mean, rstd */
__global__ void stats_final_k(const float *part, int64_t nparts, int64_t rows, float eps, float *stats)
{
    KILN_GRID_STRIDE(r, rows) {
        double n = 0, mean = 0, m2 = 0;
        for (int64_t k = 0; k < nparts; k++) {
            const float *p = part + (r * nparts + k) * 3;
            double bn = p[0];
            if (bn == 0) continue;
            double tot = n + bn, d = (double)p[1] - mean;
            mean += d * bn / tot;
            m2 += (double)p[2] + d * d * n * bn / tot;
            n = tot;
        }
        double var = n > 0 ? m2 / n : 0;
        stats[2 * r] = (float)mean;
        stats[2 * r + 1] = (float)(1.0 / sqrt(var + (double)eps));
    }
}

/* mean/rstd of rows x L into stats (2 floats a row; scratch from the budget) */
template <typename T>
static kiln_status row_stats(kiln_cuda_ctx *c, const char *op, const T *x, int64_t rows, int64_t L, float eps, float *stats)
{
    int64_t nchunks = kiln_cuda_row_chunks(rows, L, c->sm_count, KILN_CUDA_STATS_CHUNK);
    int64_t chunk = (L + nchunks - 1) / nchunks;
    float *part;
    kiln_status st = kiln_cuda_scratch(c, kiln_cuda_stats_part_bytes(rows, L, c->sm_count), (void **)&part);
    if (st) return st;
    for (int64_t r0 = 0; r0 < rows; r0 += 65535) { /* gridDim.y limit */
        int64_t nr = rows - r0 < 65535 ? rows - r0 : 65535;
        dim3 grid((unsigned)nchunks, (unsigned)nr);
        stats_part_k<T><<<grid, KILN_CUDA_THREADS, 0, c->compute>>>(x + r0 * L, L, chunk, part + r0 * nchunks * 3);
    }
    stats_final_k<<<kiln_cuda_blocks(c, rows, KILN_CUDA_THREADS), KILN_CUDA_THREADS, 0, c->compute>>>(part, nchunks, rows, eps,
                                                                                                     stats);
    st = kiln_cuda_done(c, op);
    kiln_cuda_scratch_free(c, part);
    return st;
}

/* ---- group norm ---- */

template <typename T>
__global__ void gn_apply_k(T *y, const T *x, const float *stats, const float *gamma, const float *beta, int64_t C,
                           int64_t HW, int64_t cpg, int64_t total, int silu)
{
    KILN_GRID_STRIDE(i, total) {
        int64_t nc = i / HW, ch = nc % C, row = nc / cpg; /* row = n*G + g */
        float mean = stats[2 * row], rstd = stats[2 * row + 1];
        float a = rstd * (gamma ? gamma[ch] : 1.0f);
        float b = (beta ? beta[ch] : 0.0f) - mean * a;
        float v = kf_to<T>(x[i]) * a + b;
        if (silu) v = v / (1.0f + expf(-v));
        y[i] = kf_from<T>(v);
    }
}

/* affine parameters as contiguous f32 (NULL stays NULL) */
static kiln_status affine_f32(kiln_cuda_ctx *c, const kiln_tensor *t, kiln_tensor **tmp, const float **p)
{
    *tmp = NULL;
    *p = NULL;
    if (!t) return KILN_OK;
    const void *d;
    kiln_status st = kiln_cuda_as(c, t, KILN_F32, tmp, &d);
    *p = (const float *)d;
    return st;
}

/* out from a contiguous staging tensor when out itself is not contiguous */
static kiln_status out_begin(kiln_cuda_ctx *c, kiln_tensor *out, kiln_tensor **to, void **Y)
{
    *to = NULL;
    *Y = kiln_tensor_data(out);
    if (kiln_tensor_is_contiguous(out)) return KILN_OK;
    kiln_status st = kiln_cuda_temp(c, out->dtype, out->ndim, out->shape, to);
    if (!st) *Y = kiln_tensor_data(*to);
    return st;
}

extern "C" kiln_status kiln_cuda_group_norm(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b,
                                            int64_t groups, double eps, int silu)
{
    const char *name = "group_norm";
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, x, w, b, NULL);
    if (!c) return st;
    int64_t total = kiln_tensor_numel(x);
    int64_t N = x->shape[0], C = x->shape[1];
    if (total == 0 || groups <= 0 || C % groups) return KILN_OK;
    int64_t HW = total / (N * C), cpg = C / groups;
    kiln_dtype dt = out->dtype;
    kiln_tensor *tx = NULL, *tw = NULL, *tb = NULL, *to = NULL;
    const void *X;
    const float *G = NULL, *Bt = NULL;
    void *Y;
    float *stats = NULL;
    if ((st = kiln_cuda_as(c, x, dt, &tx, &X)) || (st = affine_f32(c, w, &tw, &G)) || (st = affine_f32(c, b, &tb, &Bt)) ||
        (st = out_begin(c, out, &to, &Y)) || (st = kiln_cuda_scratch(c, kiln_cuda_stats_bytes(N * groups), (void **)&stats)))
        goto done;
    KILN_CUDA_FLOAT_SWITCH(dt, T, {
        st = row_stats<T>(c, name, (const T *)X, N * groups, cpg * HW, (float)eps, stats);
        if (!st)
            gn_apply_k<T><<<kiln_cuda_blocks(c, total, KILN_CUDA_THREADS), KILN_CUDA_THREADS, 0, c->compute>>>(
                (T *)Y, (const T *)X, stats, G, Bt, C, HW, cpg, total, silu);
    });
    if (!st) st = kiln_cuda_done(c, name);
    if (!st && to) st = kiln_cuda_copy(out, to);
done:
    kiln_cuda_scratch_free(c, stats);
    kiln_tensor_free(tx);
    kiln_tensor_free(tw);
    kiln_tensor_free(tb);
    kiln_tensor_free(to);
    return st;
}

/* ---- layer norm ---- */

template <typename T>
__global__ void ln_apply_k(T *y, const T *x, const float *stats, const float *gamma, const float *beta, int64_t D, int64_t total)
{
    KILN_GRID_STRIDE(i, total) {
        int64_t r = i / D, j = i - r * D;
        float v = (kf_to<T>(x[i]) - stats[2 * r]) * stats[2 * r + 1];
        if (gamma) v *= gamma[j];
        if (beta) v += beta[j];
        y[i] = kf_from<T>(v);
    }
}

extern "C" kiln_status kiln_cuda_layer_norm(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b,
                                            double eps)
{
    const char *name = "layer_norm";
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, x, w, b, NULL);
    if (!c) return st;
    int64_t total = kiln_tensor_numel(x), D = x->shape[x->ndim - 1];
    if (total == 0 || D == 0) return KILN_OK;
    int64_t rows = total / D;
    kiln_dtype dt = out->dtype;
    kiln_tensor *tx = NULL, *tw = NULL, *tb = NULL, *to = NULL;
    const void *X;
    const float *G = NULL, *Bt = NULL;
    void *Y;
    float *stats = NULL;
    if ((st = kiln_cuda_as(c, x, dt, &tx, &X)) || (st = affine_f32(c, w, &tw, &G)) || (st = affine_f32(c, b, &tb, &Bt)) ||
        (st = out_begin(c, out, &to, &Y)) || (st = kiln_cuda_scratch(c, kiln_cuda_stats_bytes(rows), (void **)&stats)))
        goto done;
    KILN_CUDA_FLOAT_SWITCH(dt, T, {
        st = row_stats<T>(c, name, (const T *)X, rows, D, (float)eps, stats);
        if (!st)
            ln_apply_k<T><<<kiln_cuda_blocks(c, total, KILN_CUDA_THREADS), KILN_CUDA_THREADS, 0, c->compute>>>(
                (T *)Y, (const T *)X, stats, G, Bt, D, total);
    });
    if (!st) st = kiln_cuda_done(c, name);
    if (!st && to) st = kiln_cuda_copy(out, to);
done:
    kiln_cuda_scratch_free(c, stats);
    kiln_tensor_free(tx);
    kiln_tensor_free(tw);
    kiln_tensor_free(tb);
    kiln_tensor_free(to);
    return st;
}

/* ---- softmax ---- */

/* online (max, sum of exp(x - max)) */
__device__ __forceinline__ void sm_merge(float &m, float &s, float m2, float s2)
{
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) { m = m2; s = s2; return; }
    float nm = fmaxf(m, m2);
    s = s * expf(m - nm) + s2 * expf(m2 - nm);
    m = nm;
}

/* a warp per row (dim <= 1024) */
template <typename T>
__global__ void sm_warp_k(T *y, const T *x, int64_t rows, int64_t dim)
{
    int lane = threadIdx.x & 31;
    int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const T *xr = x + r * dim;
    T *yr = y + r * dim;
    float m = -INFINITY, s = 0.0f;
    for (int64_t i = lane; i < dim; i += 32) sm_merge(m, s, kf_to<T>(xr[i]), 1.0f);
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
        sm_merge(m, s, m2, s2);
    }
    float inv = 1.0f / s;
    for (int64_t i = lane; i < dim; i += 32) yr[i] = kf_from<T>(expf(kf_to<T>(xr[i]) - m) * inv);
}

/* a block per row */
template <typename T>
__global__ void sm_block_k(T *y, const T *x, int64_t dim)
{
    __shared__ float sm_m[32], sm_s[32];
    const T *xr = x + (int64_t)blockIdx.x * dim;
    T *yr = y + (int64_t)blockIdx.x * dim;
    float m = -INFINITY, s = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sm_merge(m, s, kf_to<T>(xr[i]), 1.0f);
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
        sm_merge(m, s, m2, s2);
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) { sm_m[w] = m; sm_s[w] = s; }
    __syncthreads();
    m = -INFINITY;
    s = 0.0f;
    for (int k = 0; k < nw; k++) sm_merge(m, s, sm_m[k], sm_s[k]);
    float inv = 1.0f / s;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = kf_from<T>(expf(kf_to<T>(xr[i]) - m) * inv);
}

/* reduced dim not last: a thread per (outer, inner) column */
template <typename T>
__global__ void sm_cols_k(T *y, const T *x, int64_t outer, int64_t dim, int64_t inner)
{
    KILN_GRID_STRIDE(idx, outer * inner) {
        int64_t o = idx / inner, i = idx - o * inner;
        const T *xc = x + o * dim * inner + i;
        T *yc = y + o * dim * inner + i;
        float m = -INFINITY, s = 0.0f;
        for (int64_t k = 0; k < dim; k++) sm_merge(m, s, kf_to<T>(xc[k * inner]), 1.0f);
        float inv = 1.0f / s;
        for (int64_t k = 0; k < dim; k++) yc[k * inner] = kf_from<T>(expf(kf_to<T>(xc[k * inner]) - m) * inv);
    }
}

extern "C" kiln_status kiln_cuda_softmax(kiln_tensor *out, const kiln_tensor *x, int dim)
{
    const char *name = "softmax";
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, x, NULL, NULL, NULL);
    if (!c) return st;
    int64_t outer = 1, inner = 1, len = x->shape[dim];
    for (int i = 0; i < dim; i++) outer *= x->shape[i];
    for (int i = dim + 1; i < x->ndim; i++) inner *= x->shape[i];
    if (outer * inner * len == 0) return KILN_OK;
    kiln_dtype dt = out->dtype;
    kiln_tensor *tx = NULL, *to = NULL;
    const void *X;
    void *Y;
    if ((st = kiln_cuda_as(c, x, dt, &tx, &X)) || (st = out_begin(c, out, &to, &Y))) goto done;
    KILN_CUDA_FLOAT_SWITCH(dt, T, {
        if (inner > 1) {
            sm_cols_k<T><<<kiln_cuda_blocks(c, outer * inner, KILN_CUDA_THREADS), KILN_CUDA_THREADS, 0, c->compute>>>(
                (T *)Y, (const T *)X, outer, len, inner);
        } else if (len <= 1024) {
            int64_t blocks = (outer + 7) / 8;
            for (int64_t r0 = 0; r0 < outer; r0 += (int64_t)INT32_MAX / 2 * 8) { /* 1-D grid limit */
                int64_t nr = outer - r0 < (int64_t)INT32_MAX / 2 * 8 ? outer - r0 : (int64_t)INT32_MAX / 2 * 8;
                blocks = (nr + 7) / 8;
                sm_warp_k<T><<<(unsigned)blocks, 256, 0, c->compute>>>((T *)Y + r0 * len, (const T *)X + r0 * len, nr, len);
            }
        } else {
            for (int64_t r0 = 0; r0 < outer; r0 += INT32_MAX) {
                int64_t nr = outer - r0 < INT32_MAX ? outer - r0 : INT32_MAX;
                sm_block_k<T><<<(unsigned)nr, 512, 0, c->compute>>>((T *)Y + r0 * len, (const T *)X + r0 * len, len);
            }
        }
    });
    st = kiln_cuda_done(c, name);
    if (!st && to) st = kiln_cuda_copy(out, to);
done:
    kiln_tensor_free(tx);
    kiln_tensor_free(to);
    return st;
}
