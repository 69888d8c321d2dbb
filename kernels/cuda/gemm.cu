/* gemm.cu - matmul and linear through cuBLAS (cublasGemmEx / GemmStridedBatchedEx,
 * CUBLAS_COMPUTE_32F: f32 accumulation; f16/bf16 operands run on tensor cores).
 * matmul: operands in f16 or bf16 of one type stay in it; any other mix is computed
 * in f32 (operands converted into budgeted temporaries), as the CPU backend does.
 * linear: half activations keep their dtype and the weight is converted to it when
 * it differs (kiln_cuda_compute_dtype); f32 activations compute in f32. f32 GEMMs
 * are plain FP32 unless KILN_CUDA_TF32=1. Row-major kiln matrices are handed to
 * column-major cuBLAS as their transposes: C^T = B^T A^T. Strided views (transposes,
 * broadcast batches) are used in place when cuBLAS can describe them. */
#include "cuda_dev.h"

#include <limits.h>

static cudaDataType_t cu_type(kiln_dtype dt)
{
    return dt == KILN_F16 ? CUDA_R_16F : dt == KILN_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

static cublasComputeType_t compute_type(const kiln_cuda_ctx *c, kiln_dtype dt)
{
    return dt == KILN_F32 && c->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

/* A [.., R, C] operand as cuBLAS sees it: data, layout and one batch stride. */
typedef struct {
    const void *data;
    int trans;          /* 0: row-major rows of ld elements; 1: column-major (a transposed view) */
    int64_t ld, batch_stride;
    kiln_tensor *tmp;
} mat_view;

static int fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

/* Batch dims [0, nb) as one stride (all broadcast -> 0); 0 when impossible. */
static int batch_stride(const kiln_tensor *t, int nb, int64_t *stride)
{
    int64_t s = -1, expect = -1;
    for (int d = nb - 1; d >= 0; d--) {
        if (t->shape[d] == 1) continue;
        if (s < 0) {
            s = t->stride[d];
            expect = s * t->shape[d];
        } else if (s == 0) {
            if (t->stride[d] != 0) return 0;
        } else {
            if (t->stride[d] != expect) return 0;
            expect *= t->shape[d];
        }
    }
    *stride = s < 0 ? 0 : s;
    return 1;
}

/* t is [..., R, C] with batch dims [0, nb); in dtype dt. */
static kiln_status mat_prepare(kiln_cuda_ctx *c, const kiln_tensor *t, int nb, kiln_dtype dt, mat_view *m)
{
    m->tmp = NULL;
    int n = t->ndim;
    int64_t R = t->shape[n - 2], C = t->shape[n - 1], sr = t->stride[n - 2], sc = t->stride[n - 1];
    int64_t bs = 0;
    if (t->dtype == dt && batch_stride(t, nb, &bs) && bs >= 0) {
        if ((sc == 1 || C == 1) && (sr >= C || R == 1) && sr >= 0) {
            m->data = kiln_tensor_data(t);
            m->trans = 0;
            m->ld = R == 1 ? (C > 0 ? C : 1) : sr;
            m->batch_stride = bs;
            if (m->ld >= (C > 0 ? C : 1)) return KILN_OK;
        }
        if (sr == 1 && (sc >= R || C == 1) && sc >= 0) {
            m->data = kiln_tensor_data(t);
            m->trans = 1;
            m->ld = C == 1 ? (R > 0 ? R : 1) : sc;
            m->batch_stride = bs;
            if (m->ld >= (R > 0 ? R : 1)) return KILN_OK;
        }
    }
    const void *p;
    kiln_status st = kiln_cuda_as(c, t, dt, &m->tmp, &p);
    if (st) return st;
    m->data = p;
    m->trans = 0;
    m->ld = C > 0 ? C : 1;
    m->batch_stride = R * C;
    int64_t batch = 1;
    for (int d = 0; d < nb; d++) batch *= t->shape[d];
    if (batch == 1) m->batch_stride = 0;
    return KILN_OK;
}

extern "C" kiln_status kiln_cuda_matmul(kiln_tensor *out, const kiln_tensor *a, const kiln_tensor *b)
{
    const char *name = "matmul";
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, a, b, NULL, NULL);
    if (!c) return st;
    int n = out->ndim, nb = n - 2;
    int64_t M = out->shape[n - 2], N = out->shape[n - 1], K = a->shape[n - 1];
    int64_t batch = 1;
    for (int d = 0; d < nb; d++) batch *= out->shape[d];
    if (M * N * batch == 0) return KILN_OK;
    if (K == 0) return kiln_cuda_fill(out, 0);
    if (!fits_int(M) || !fits_int(N) || !fits_int(K) || !fits_int(batch))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s: sizes beyond cuBLAS's int range (M=%lld N=%lld K=%lld batch=%lld)",
                          c->dev->name, name, (long long)M, (long long)N, (long long)K, (long long)batch);
    kiln_dtype ct = (a->dtype == b->dtype && (a->dtype == KILN_F16 || a->dtype == KILN_BF16) && out->dtype == a->dtype)
                        ? a->dtype : KILN_F32;
    mat_view A = {}, B = {};
    kiln_tensor *to = NULL;
    void *C = kiln_tensor_data(out);
    if ((st = mat_prepare(c, a, nb, ct, &A)) || (st = mat_prepare(c, b, nb, ct, &B))) goto done;
    if (out->dtype != ct || !kiln_tensor_is_contiguous(out)) {
        if ((st = kiln_cuda_temp(c, ct, out->ndim, out->shape, &to))) goto done;
        C = kiln_tensor_data(to);
    }
    if (!fits_int(A.ld) || !fits_int(B.ld)) {
        st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s: leading dimension beyond int range", c->dev->name, name);
        goto done;
    }
    {
        /* C^T[N, M] = B^T[N, K] A^T[K, M] in column-major terms */
        const float one = 1.0f, zero = 0.0f;
        cublasOperation_t opB = B.trans ? CUBLAS_OP_T : CUBLAS_OP_N, opA = A.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
        cudaDataType_t t = cu_type(ct);
        cublasStatus_t s;
        if (batch == 1)
            s = cublasGemmEx(c->blas, opB, opA, (int)N, (int)M, (int)K, &one, B.data, t, (int)B.ld, A.data, t, (int)A.ld,
                             &zero, C, t, (int)N, compute_type(c, ct), CUBLAS_GEMM_DEFAULT);
        else
            s = cublasGemmStridedBatchedEx(c->blas, opB, opA, (int)N, (int)M, (int)K, &one, B.data, t, (int)B.ld,
                                           B.batch_stride, A.data, t, (int)A.ld, A.batch_stride, &zero, C, t, (int)N,
                                           M * N, (int)batch, compute_type(c, ct), CUBLAS_GEMM_DEFAULT);
        if ((st = kiln_cuda_check_blas(c, name, batch == 1 ? "cublasGemmEx" : "cublasGemmStridedBatchedEx", s))) goto done;
    }
    if ((st = kiln_cuda_done(c, name))) goto done;
    if (to) st = kiln_cuda_copy(out, to);
done:
    kiln_tensor_free(A.tmp);
    kiln_tensor_free(B.tmp);
    kiln_tensor_free(to);
    return st;
}

/* x [..., K] as rows of one stride: 1 when no copy is needed. */
static int rows_view(const kiln_tensor *x, int64_t *ld)
{
    int n = x->ndim;
    if (n == 0) return 0;
    int64_t K = x->shape[n - 1];
    if (x->stride[n - 1] != 1 && K != 1) return 0;
    int64_t s;
    if (!batch_stride(x, n - 1, &s)) return 0;
    int64_t rows = 1;
    for (int d = 0; d < n - 1; d++) rows *= x->shape[d];
    if (rows > 1 && s < K) return 0; /* overlapping (broadcast) rows */
    *ld = rows > 1 ? s : (K > 0 ? K : 1);
    return 1;
}

extern "C" kiln_status kiln_cuda_linear(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *bias)
{
    const char *name = "linear";
    kiln_status st;
    kiln_cuda_ctx *c = kiln_cuda_enter(name, &st, out, x, w, bias, NULL);
    if (!c) return st;
    int64_t K = x->shape[x->ndim - 1], N = w->shape[0];
    int64_t M = N ? kiln_tensor_numel(out) / N : 0;
    if (M * N == 0) return KILN_OK;
    kiln_dtype ct = kiln_cuda_compute_dtype(x, out);
    kiln_tensor *tx = NULL, *tw = NULL, *to = NULL, *bv = NULL, *ov = NULL;
    const void *X = NULL, *W = NULL;
    void *Y = kiln_tensor_data(out);
    int64_t ldx = K > 0 ? K : 1, ldw = K > 0 ? K : 1;
    int wt = 1; /* w row-major [N, K]: op T */
    if (out->dtype != ct || !kiln_tensor_is_contiguous(out)) {
        if ((st = kiln_cuda_temp(c, ct, out->ndim, out->shape, &to))) return st;
        Y = kiln_tensor_data(to);
    }
    kiln_tensor *y = to ? to : out;
    /* bias: rows of y start as bias, then y = x w^T + 1 * y */
    float beta = 0.0f;
    if (bias) {
        int64_t shape[2] = {M, N}, stride[2] = {0, bias->stride[0]};
        int64_t yshape[2] = {M, N};
        bv = kiln_tensor_from_storage(bias->storage, bias->offset, bias->dtype, 2, shape, stride);
        ov = kiln_tensor_from_storage(y->storage, y->offset, y->dtype, 2, yshape, NULL);
        if (!bv || !ov) { st = kiln_error(KILN_ERR_OOM, "%s: %s: host out of memory", c->dev->name, name); goto done; }
        if ((st = kiln_cuda_copy(ov, bv))) goto done;
        beta = 1.0f;
    } else if (K == 0) {
        st = kiln_cuda_fill(y, 0);
        goto finish;
    }
    if (K == 0) goto finish;
    if (!fits_int(M) || !fits_int(N) || !fits_int(K)) {
        st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s: sizes beyond cuBLAS's int range (M=%lld N=%lld K=%lld)",
                        c->dev->name, name, (long long)M, (long long)N, (long long)K);
        goto done;
    }
    if (x->dtype == ct && rows_view(x, &ldx)) X = kiln_tensor_data(x);
    else if ((st = kiln_cuda_as(c, x, ct, &tx, &X))) goto done;
    else ldx = K;
    if (w->dtype == ct && (w->stride[1] == 1 || K == 1) && (w->stride[0] >= K || N == 1)) {
        W = kiln_tensor_data(w);
        ldw = N == 1 ? K : w->stride[0];
    } else if (w->dtype == ct && w->stride[0] == 1 && w->stride[1] >= N) {
        W = kiln_tensor_data(w);
        wt = 0;
        ldw = w->stride[1];
    } else if ((st = kiln_cuda_as(c, w, ct, &tw, &W))) {
        goto done;
    } else {
        ldw = K;
    }
    if (!fits_int(ldx) || !fits_int(ldw)) {
        st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s: leading dimension beyond int range", c->dev->name, name);
        goto done;
    }
    {
        /* Y^T[N, M] = W[N, K] X^T[K, M] column-major */
        const float one = 1.0f;
        cudaDataType_t t = cu_type(ct);
        cublasStatus_t s = cublasGemmEx(c->blas, wt ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, (int)N, (int)M, (int)K, &one,
                                        W, t, (int)ldw, X, t, (int)ldx, &beta, Y, t, (int)N, compute_type(c, ct),
                                        CUBLAS_GEMM_DEFAULT);
        if ((st = kiln_cuda_check_blas(c, name, "cublasGemmEx", s))) goto done;
    }
finish:
    if (!st) st = kiln_cuda_done(c, name);
    if (!st && to) st = kiln_cuda_copy(out, to);
done:
    kiln_tensor_free(tx);
    kiln_tensor_free(tw);
    kiln_tensor_free(to);
    kiln_tensor_free(bv);
    kiln_tensor_free(ov);
    return st;
}
