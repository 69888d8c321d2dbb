/* attention.cu - memory-efficient attention: out = softmax(q k^T * scale) v, tiled
 * as FlashAttention (forward): a block holds QPB queries of one (batch, head), streams
 * K and V through shared memory in tiles of BK keys and keeps an online softmax
 * (running max, running sum, rescaled accumulator) in registers. Extra memory is
 * O(tile), never Lq x Lk. TPQ threads share a query: each holds every TPQ-th element
 * of q and of the output row (so shared-memory reads are conflict-free) and the dot
 * products are summed with warp shuffles. Head sizes up to 1024 (SD uses 40..160;
 * the VAE's single-head attention 512). causal: query i sees keys j <= i (as the
 * CPU kernel). Inputs may be strided in batch, head and sequence (the last dim must
 * be contiguous, else it is copied); storage f32/f16/bf16, math f32. */
#include "cuda_dev.h"

typedef struct {
    int64_t H, Lq, Lk, n_qtiles;
    int D, Dv, causal;
    float scale;
    int64_t qs[3], ks[3], vs[3]; /* element strides: batch, head, position */
} attn_args;

template <typename T, int TPQ, int DS, int BK>
__global__ void __launch_bounds__(128) flash_k(T *__restrict__ out, const T *__restrict__ q, const T *__restrict__ k,
                                               const T *__restrict__ v, attn_args a)
{
    constexpr int NT = 128, QPB = NT / TPQ, DP = TPQ * DS;
    __shared__ float ks[BK][DP];
    __shared__ float vs[BK][DP];

    int64_t tile = blockIdx.x % a.n_qtiles, bh = blockIdx.x / a.n_qtiles;
    int64_t b = bh / a.H, h = bh % a.H;
    int tid = threadIdx.x, part = tid % TPQ;
    int64_t q0 = tile * QPB, qi = q0 + tid / TPQ;
    int valid = qi < a.Lq;
    const T *qp = q + b * a.qs[0] + h * a.qs[1] + qi * a.qs[2];
    const T *kp = k + b * a.ks[0] + h * a.ks[1];
    const T *vp = v + b * a.vs[0] + h * a.vs[1];

    float qr[DS], acc[DS];
#pragma unroll
    for (int i = 0; i < DS; i++) {
        int d = i * TPQ + part;
        qr[i] = valid && d < a.D ? kf_to<T>(qp[d]) * a.scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    int64_t kend = a.Lk;
    if (a.causal && q0 + QPB < kend) kend = q0 + QPB; /* the block's last query sees keys < q0 + QPB */

    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        __syncthreads(); /* the previous tile is no longer read */
        for (int idx = tid; idx < BK * DP; idx += NT) {
            int j = idx / DP, d = idx % DP;
            int64_t kj = k0 + j;
            ks[j][d] = kj < a.Lk && d < a.D ? kf_to<T>(kp[kj * a.ks[2] + d]) : 0.0f;
            vs[j][d] = kj < a.Lk && d < a.Dv ? kf_to<T>(vp[kj * a.vs[2] + d]) : 0.0f;
        }
        __syncthreads();
        float s[BK];
        float tmax = -INFINITY;
#pragma unroll
        for (int j = 0; j < BK; j++) {
            float p = 0.0f;
#pragma unroll
            for (int i = 0; i < DS; i++) p += qr[i] * ks[j][i * TPQ + part];
#pragma unroll
            for (int off = TPQ / 2; off > 0; off >>= 1) p += __shfl_xor_sync(0xffffffffu, p, off);
            int64_t kj = k0 + j;
            s[j] = kj < a.Lk && (!a.causal || kj <= qi) ? p : -INFINITY;
            tmax = fmaxf(tmax, s[j]);
        }
        if (tmax != -INFINITY) { /* else every key of the tile is masked for this query */
            float mnew = fmaxf(m, tmax);
            float corr = expf(m - mnew); /* 0 on the first tile (m = -inf) */
            l *= corr;
#pragma unroll
            for (int i = 0; i < DS; i++) acc[i] *= corr;
#pragma unroll
            for (int j = 0; j < BK; j++) {
                float p = expf(s[j] - mnew);
                l += p;
#pragma unroll
                for (int i = 0; i < DS; i++) acc[i] += p * vs[j][i * TPQ + part];
            }
            m = mnew;
        }
    }
    if (!valid) return;
    float inv = 1.0f / l;
    T *op = out + (bh * a.Lq + qi) * a.Dv;
#pragma unroll
    for (int i = 0; i < DS; i++) {
        int d = i * TPQ + part;
        if (d < a.Dv) op[d] = kf_from<T>(acc[i] * inv);
    }
}

template <typename T, int TPQ, int DS, int BK>
static void launch(cudaStream_t s, T *out, const T *q, const T *k, const T *v, attn_args a, int64_t BH)
{
    constexpr int QPB = 128 / TPQ;
    a.n_qtiles = (a.Lq + QPB - 1) / QPB;
    flash_k<T, TPQ, DS, BK><<<(unsigned)(a.n_qtiles * BH), 128, 0, s>>>(out, q, k, v, a);
}

/* Tile shape by the padded head size: DP = TPQ * DS >= max(D, Dv). */
template <typename T>
static int dispatch(cudaStream_t s, T *out, const T *q, const T *k, const T *v, const attn_args &a, int64_t BH)
{
    int dmax = a.D > a.Dv ? a.D : a.Dv;
    if (dmax <= 32) launch<T, 4, 8, 32>(s, out, q, k, v, a, BH);
    else if (dmax <= 40) launch<T, 4, 10, 32>(s, out, q, k, v, a, BH);
    else if (dmax <= 64) launch<T, 4, 16, 32>(s, out, q, k, v, a, BH);
    else if (dmax <= 80) launch<T, 4, 20, 32>(s, out, q, k, v, a, BH);
    else if (dmax <= 96) launch<T, 4, 24, 32>(s, out, q, k, v, a, BH);
    else if (dmax <= 128) launch<T, 4, 32, 32>(s, out, q, k, v, a, BH);
    else if (dmax <= 160) launch<T, 4, 40, 32>(s, out, q, k, v, a, BH);
    else if (dmax <= 256) launch<T, 8, 32, 16>(s, out, q, k, v, a, BH);
    else if (dmax <= 512) launch<T, 16, 32, 8>(s, out, q, k, v, a, BH);
    else if (dmax <= 1024) launch<T, 32, 32, 4>(s, out, q, k, v, a, BH);
    else return 0;
    return 1;
}

#define ATTN_MAX_D 1024

/* t itself when its last dim is contiguous, else a contiguous copy (in dtype dt either way) */
static kiln_status attn_operand(kiln_cuda_ctx *c, const kiln_tensor *t, kiln_dtype dt, kiln_tensor **tmp, const void **p,
                                int64_t *strides)
{
    *tmp = NULL;
    if (t->dtype == dt && (t->stride[3] == 1 || t->shape[3] == 1)) {
        *p = kiln_tensor_data(t);
        for (int i = 0; i < 3; i++) strides[i] = t->stride[i];
        return KILN_OK;
    }
    kiln_status st = kiln_cuda_as(c, t, dt, tmp, p);
    if (st) return st;
    strides[2] = t->shape[3];
    strides[1] = t->shape[2] * strides[2];
    strides[0] = t->shape[1] * strides[1];
    return KILN_OK;
}

extern "C" kiln_status kiln_cuda_attention(kiln_tensor *out, const kiln_tensor *q, const kiln_tensor *k, const kiln_tensor *v,
                                           double scale, int causal)
{
    const char *name = "attention";
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, q, k, v, NULL);
    if (!c) return st;
    int64_t B = q->shape[0], H = q->shape[1], Lq = q->shape[2], D = q->shape[3], Lk = k->shape[2], Dv = v->shape[3];
    if (B * H * Lq * Dv == 0) return KILN_OK;
    if (D > ATTN_MAX_D || Dv > ATTN_MAX_D)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s: head size %lld/%lld is above the CUDA kernel's %d", c->dev->name, name,
                          (long long)D, (long long)Dv, ATTN_MAX_D);
    kiln_dtype dt = q->dtype == k->dtype && q->dtype == v->dtype && q->dtype == out->dtype && kiln_dtype_is_float(q->dtype)
                        ? q->dtype : KILN_F32;
    attn_args a;
    a.H = H; a.Lq = Lq; a.Lk = Lk; a.D = (int)D; a.Dv = (int)Dv; a.causal = causal != 0; a.scale = (float)scale;
    a.n_qtiles = 0;
    kiln_tensor *tq = NULL, *tk = NULL, *tv = NULL, *to = NULL;
    const void *Q, *K, *V;
    void *O = kiln_tensor_data(out);
    if ((st = attn_operand(c, q, dt, &tq, &Q, a.qs)) || (st = attn_operand(c, k, dt, &tk, &K, a.ks)) ||
        (st = attn_operand(c, v, dt, &tv, &V, a.vs)))
        goto done;
    if (out->dtype != dt || !kiln_tensor_is_contiguous(out)) {
        if ((st = kiln_cuda_temp(c, dt, 4, out->shape, &to))) goto done;
        O = kiln_tensor_data(to);
    }
    {
        int64_t tiles_min = (Lq + 127) / 128; /* smallest tile is 4 queries: make sure the grid fits */
        if (tiles_min * 32 * B * H > (int64_t)INT32_MAX) {
            st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s: %lld x %lld queries are too many for one launch", c->dev->name,
                            name, (long long)(B * H), (long long)Lq);
            goto done;
        }
    }
    KILN_CUDA_FLOAT_SWITCH(dt, T, dispatch<T>(c->compute, (T *)O, (const T *)Q, (const T *)K, (const T *)V, a, B * H));
    st = kiln_cuda_done(c, name);
    if (!st && to) st = kiln_cuda_copy(out, to);
done:
    kiln_tensor_free(tq);
    kiln_tensor_free(tk);
    kiln_tensor_free(tv);
    kiln_tensor_free(to);
    return st;
}
