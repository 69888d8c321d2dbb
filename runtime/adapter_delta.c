/* adapter_delta.c - deltas of weight adapters on f32 host buffers: LoRA (up @ down,
 * LoCon's CP middle folded into down first), LoHa ((w1a @ w1b) * (w2a @ w2b), CP
 * through t1/t2), LoKr (kron(w1, w2)), full differences, and DoRA's normalization
 * (ComfyUI's weight_decompose: a norm per dim-1 column). Matrix products go through
 * the host backend's gemm_f32 entry, so a rank-32 LoRA over a UNet is a few hundred
 * GEMMs, not loops; a naive loop remains for a backend without it. */
#include "adapter_delta.h"
#include "backend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ORDER ADAPTER */
static const char *const kind_names[KILN_ADAPTER_COUNT] = {"lora", "loha", "lokr", "diff"};
/* ORDER FACTOR */
static const char *const factor_names[KILN_AF_COUNT] = {"up", "down", "mid", "w1a", "w1b", "w2a", "w2b",
                                                         "t1", "t2", "w1", "w2", "diff", "dora_scale"};

#define BIT(f) (1u << (f))
/* the factors each kind may carry (ORDER ADAPTER) */
static const unsigned allowed[KILN_ADAPTER_COUNT] = {
    BIT(KILN_AF_UP) | BIT(KILN_AF_DOWN) | BIT(KILN_AF_MID) | BIT(KILN_AF_DORA_SCALE),
    BIT(KILN_AF_W1A) | BIT(KILN_AF_W1B) | BIT(KILN_AF_W2A) | BIT(KILN_AF_W2B) | BIT(KILN_AF_T1) | BIT(KILN_AF_T2) |
        BIT(KILN_AF_DORA_SCALE),
    BIT(KILN_AF_W1) | BIT(KILN_AF_W1A) | BIT(KILN_AF_W1B) | BIT(KILN_AF_W2) | BIT(KILN_AF_W2A) | BIT(KILN_AF_W2B) |
        BIT(KILN_AF_T2) | BIT(KILN_AF_DORA_SCALE),
    BIT(KILN_AF_DIFF),
};

const char *kiln_adapter_kind_name(kiln_adapter_kind k)
{
    return (unsigned)k < KILN_ADAPTER_COUNT ? kind_names[k] : "?";
}

int kiln_adapter_kind_from_name(const char *name)
{
    for (int i = 0; name && i < KILN_ADAPTER_COUNT; i++)
        if (strcmp(name, kind_names[i]) == 0) return i;
    return -1;
}

const char *kiln_adapter_factor_name(kiln_adapter_factor f)
{
    return (unsigned)f < KILN_AF_COUNT ? factor_names[f] : "?";
}

/* ---- shapes ---- */

static int64_t numel(const kiln_tensor *t) { return kiln_tensor_numel(t); }

static const char *shp(const kiln_tensor *t, char *buf, size_t cap) { return kiln_shape_str(t, buf, cap); }

static kiln_status need(const kiln_adapter *a, kiln_adapter_factor f)
{
    if (a->f[f]) return KILN_OK;
    return kiln_error(KILN_ERR_ARG, "a %s patch needs the factor '%s'", kind_names[a->kind], factor_names[f]);
}

/* 'x' [a,b] and 'y' [c,d] disagree on the rank (b vs c) */
static kiln_status rank_error(const kiln_adapter *a, kiln_adapter_factor x, int64_t rx, kiln_adapter_factor y,
                              int64_t ry)
{
    char b1[96], b2[96];
    return kiln_error(KILN_ERR_ARG, "%s factors '%s' %s and '%s' %s disagree on the rank (%lld vs %lld)",
                      kind_names[a->kind], factor_names[x], shp(a->f[x], b1, sizeof b1), factor_names[y],
                      shp(a->f[y], b2, sizeof b2), (long long)rx, (long long)ry);
}

static kiln_status ndim_error(const kiln_adapter *a, kiln_adapter_factor f, const char *want)
{
    char b[96];
    return kiln_error(KILN_ERR_ARG, "%s factor '%s' %s: expected %s", kind_names[a->kind], factor_names[f],
                      shp(a->f[f], b, sizeof b), want);
}

/* Shape of a CP rebuild "i j k l, j r, i p -> p r k l" (t [I,J,kh,kw], wb [J,R], wa
 * [I,P]) -> [P, R, kh, kw]. */
static kiln_status cp_shape(const kiln_adapter *a, kiln_adapter_factor t, kiln_adapter_factor wa,
                            kiln_adapter_factor wb, int64_t *s)
{
    const kiln_tensor *T = a->f[t], *A = a->f[wa], *B = a->f[wb];
    if (T->ndim != 4) return ndim_error(a, t, "4 dims [r, r', kh, kw]");
    if (A->ndim != 2) return ndim_error(a, wa, "2 dims [r, out] (CP form)");
    if (B->ndim < 2) return ndim_error(a, wb, "2 dims [r', in] (CP form)");
    if (A->shape[0] != T->shape[0]) return rank_error(a, wa, A->shape[0], t, T->shape[0]);
    if (B->shape[0] != T->shape[1]) return rank_error(a, wb, B->shape[0], t, T->shape[1]);
    s[0] = A->shape[1];
    s[1] = numel(B) / B->shape[0];
    s[2] = T->shape[2];
    s[3] = T->shape[3];
    return KILN_OK;
}

/* Shape of a @ b where a is [m, r(, 1, 1)] and b [r, ...]: [m, b's other dims]. */
static kiln_status product_shape(const kiln_adapter *ad, kiln_adapter_factor fa, kiln_adapter_factor fb, int *nd,
                                 int64_t *s)
{
    const kiln_tensor *A = ad->f[fa], *B = ad->f[fb];
    if (A->ndim < 2) return ndim_error(ad, fa, "[out, rank]");
    if (B->ndim < 2) return ndim_error(ad, fb, "[rank, in, ...]");
    int64_t ra = numel(A) / (A->shape[0] ? A->shape[0] : 1);
    if (ra != B->shape[0]) return rank_error(ad, fa, ra, fb, B->shape[0]);
    *nd = B->ndim;
    s[0] = A->shape[0];
    for (int d = 1; d < B->ndim; d++) s[d] = B->shape[d];
    return KILN_OK;
}

/* LoKr's two Kronecker operands' shapes, each padded to 4 dims as torch.kron pads
 * (leading 1s), except that a 2-D w1 next to a 4-D w2 becomes [a, b, 1, 1] as
 * ComfyUI unsqueezes it. */
static kiln_status lokr_shapes(const kiln_adapter *a, int64_t s1[4], int64_t s2[4], int *nd_out)
{
    kiln_status st;
    int n1 = 0, n2 = 0;
    int64_t t1[KILN_MAX_DIMS], t2[KILN_MAX_DIMS];
    if (a->f[KILN_AF_W1]) {
        if (a->f[KILN_AF_W1A] || a->f[KILN_AF_W1B])
            return kiln_error(KILN_ERR_ARG, "lokr: give 'w1' or 'w1a' with 'w1b', not both");
        const kiln_tensor *w = a->f[KILN_AF_W1];
        if (w->ndim > 4) return ndim_error(a, KILN_AF_W1, "at most 4 dims");
        n1 = w->ndim;
        memcpy(t1, w->shape, sizeof(int64_t) * (size_t)n1);
    } else {
        if ((st = need(a, KILN_AF_W1A)) || (st = need(a, KILN_AF_W1B))) return st;
        if (a->f[KILN_AF_W1B]->ndim != 2) return ndim_error(a, KILN_AF_W1B, "2 dims [rank, b]");
        if ((st = product_shape(a, KILN_AF_W1A, KILN_AF_W1B, &n1, t1))) return st;
    }
    if (a->f[KILN_AF_W2]) {
        if (a->f[KILN_AF_W2A] || a->f[KILN_AF_W2B] || a->f[KILN_AF_T2])
            return kiln_error(KILN_ERR_ARG, "lokr: give 'w2' or 'w2a' with 'w2b' (and 't2'), not both");
        const kiln_tensor *w = a->f[KILN_AF_W2];
        if (w->ndim > 4) return ndim_error(a, KILN_AF_W2, "at most 4 dims");
        n2 = w->ndim;
        memcpy(t2, w->shape, sizeof(int64_t) * (size_t)n2);
    } else {
        if ((st = need(a, KILN_AF_W2A)) || (st = need(a, KILN_AF_W2B))) return st;
        if (a->f[KILN_AF_T2]) {
            n2 = 4;
            if ((st = cp_shape(a, KILN_AF_T2, KILN_AF_W2A, KILN_AF_W2B, t2))) return st;
        } else {
            if ((st = product_shape(a, KILN_AF_W2A, KILN_AF_W2B, &n2, t2))) return st;
            /* torch.mm: w2b flattened past its rank */
            t2[1] = numel(a->f[KILN_AF_W2B]) / a->f[KILN_AF_W2B]->shape[0];
            n2 = 2;
        }
    }
    if (n2 == 4 && n1 == 2) {
        t1[2] = t1[3] = 1;
        n1 = 4;
    }
    int nd = n1 > n2 ? n1 : n2;
    for (int d = 0; d < 4; d++) {
        int k1 = d - (4 - n1), k2 = d - (4 - n2);
        s1[d] = k1 >= 0 ? t1[k1] : 1;
        s2[d] = k2 >= 0 ? t2[k2] : 1;
    }
    *nd_out = nd;
    return KILN_OK;
}

kiln_status kiln_adapter_delta_shape(const kiln_adapter *a, int *ndim, int64_t shape[KILN_MAX_DIMS])
{
    if ((unsigned)a->kind >= KILN_ADAPTER_COUNT) return kiln_error(KILN_ERR_ARG, "adapter: bad kind %d", (int)a->kind);
    for (int f = 0; f < KILN_AF_COUNT; f++) {
        const kiln_tensor *t = a->f[f];
        if (!t) continue;
        if (!(allowed[a->kind] & BIT(f)))
            return kiln_error(KILN_ERR_ARG, "'%s' is not a factor of a %s patch", factor_names[f], kind_names[a->kind]);
        if (!kiln_dtype_is_float(t->dtype))
            return kiln_error(KILN_ERR_ARG, "factor '%s' is %s, expected a floating-point tensor", factor_names[f],
                              kiln_dtype_name(t->dtype));
        if (t->ndim < 1) return kiln_error(KILN_ERR_ARG, "factor '%s' is a scalar", factor_names[f]);
    }
    kiln_status st = KILN_OK;
    int64_t s[KILN_MAX_DIMS];
    int nd = 0;
    switch (a->kind) {
    case KILN_ADAPTER_LORA: {
        if ((st = need(a, KILN_AF_UP)) || (st = need(a, KILN_AF_DOWN))) return st;
        const kiln_tensor *up = a->f[KILN_AF_UP], *down = a->f[KILN_AF_DOWN], *mid = a->f[KILN_AF_MID];
        if (down->ndim < 2) return ndim_error(a, KILN_AF_DOWN, "[rank, in] or [rank, in, kh, kw]");
        if (up->ndim < 2) return ndim_error(a, KILN_AF_UP, "[out, rank] or [out, rank, 1, 1]");
        int64_t r_up = numel(up) / (up->shape[0] ? up->shape[0] : 1);
        if (!mid) {
            if (r_up != down->shape[0]) return rank_error(a, KILN_AF_UP, r_up, KILN_AF_DOWN, down->shape[0]);
            nd = down->ndim;
            s[0] = up->shape[0];
            for (int d = 1; d < nd; d++) s[d] = down->shape[d];
        } else {
            if (mid->ndim < 3) return ndim_error(a, KILN_AF_MID, "[rank, rank, kh, kw]");
            if (r_up != mid->shape[0]) return rank_error(a, KILN_AF_UP, r_up, KILN_AF_MID, mid->shape[0]);
            if (down->shape[0] != mid->shape[1]) return rank_error(a, KILN_AF_DOWN, down->shape[0], KILN_AF_MID, mid->shape[1]);
            if (numel(down) != down->shape[0] * down->shape[1])
                return ndim_error(a, KILN_AF_DOWN, "[rank, in, 1, 1] with a 'mid' (CP)");
            nd = mid->ndim;
            s[0] = up->shape[0];
            s[1] = down->shape[1];
            for (int d = 2; d < nd; d++) s[d] = mid->shape[d];
        }
        break;
    }
    case KILN_ADAPTER_LOHA: {
        for (int f = KILN_AF_W1A; f <= KILN_AF_W2B; f++)
            if ((st = need(a, (kiln_adapter_factor)f))) return st;
        if (!a->f[KILN_AF_T1] != !a->f[KILN_AF_T2])
            return kiln_error(KILN_ERR_ARG, "loha: 't1' and 't2' come together (CP form)");
        int64_t s2[KILN_MAX_DIMS];
        int nd2;
        if (a->f[KILN_AF_T1]) {
            if ((st = cp_shape(a, KILN_AF_T1, KILN_AF_W1A, KILN_AF_W1B, s)) ||
                (st = cp_shape(a, KILN_AF_T2, KILN_AF_W2A, KILN_AF_W2B, s2)))
                return st;
            nd = nd2 = 4;
        } else {
            if ((st = product_shape(a, KILN_AF_W1A, KILN_AF_W1B, &nd, s)) ||
                (st = product_shape(a, KILN_AF_W2A, KILN_AF_W2B, &nd2, s2)))
                return st;
        }
        int same = nd == nd2;
        for (int d = 0; same && d < nd; d++) same = s[d] == s2[d];
        if (!same) {
            char b1[96], b2[96], b3[96], b4[96];
            return kiln_error(KILN_ERR_ARG, "loha: 'w1a' %s x 'w1b' %s and 'w2a' %s x 'w2b' %s give different shapes",
                              shp(a->f[KILN_AF_W1A], b1, sizeof b1), shp(a->f[KILN_AF_W1B], b2, sizeof b2),
                              shp(a->f[KILN_AF_W2A], b3, sizeof b3), shp(a->f[KILN_AF_W2B], b4, sizeof b4));
        }
        break;
    }
    case KILN_ADAPTER_LOKR: {
        int64_t s1[4], s2[4];
        if ((st = lokr_shapes(a, s1, s2, &nd))) return st;
        for (int d = 0; d < nd; d++) s[d] = s1[4 - nd + d] * s2[4 - nd + d];
        break;
    }
    case KILN_ADAPTER_DIFF:
        if ((st = need(a, KILN_AF_DIFF))) return st;
        nd = a->f[KILN_AF_DIFF]->ndim;
        memcpy(s, a->f[KILN_AF_DIFF]->shape, sizeof(int64_t) * (size_t)nd);
        break;
    default:
        break;
    }
    *ndim = nd;
    memcpy(shape, s, sizeof(int64_t) * (size_t)nd);
    return KILN_OK;
}

/* ---- arithmetic ---- */

/* C[M,N] = alpha op(A) op(B) + beta C through the host backend's GEMM. */
static void gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                 const float *B, int64_t ldb, float beta, float *C, int64_t ldc)
{
    const kiln_backend *be = kiln_device_cpu()->backend;
    if (be && be->gemm_f32 && be->gemm_f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) == KILN_OK) return;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++)
                s += (double)A[ta ? k * lda + i : i * lda + k] * B[tb ? j * ldb + k : k * ldb + j];
            float *c = &C[i * ldc + j];
            *c = alpha * (float)s + (beta == 0.0f ? 0.0f : beta * *c);
        }
}

static kiln_status scratch(int64_t n, float **p)
{
    return kiln_device_scratch_alloc(kiln_device_cpu(), (size_t)(n > 0 ? n : 1) * sizeof(float), 0, (void **)p);
}

static void scratch_free(float *p)
{
    if (p) kiln_device_scratch_free(kiln_device_cpu(), p);
}

/* A factor as contiguous f32 in host memory: where it lies, else a counted copy. */
typedef struct {
    const float *p;
    kiln_tensor *tmp;
} fview;

static kiln_status fget(const kiln_tensor *t, fview *v)
{
    v->p = NULL;
    v->tmp = NULL;
    kiln_device *d = t->storage->device;
    int host = !d->backend || !d->backend->to_host;
    /* a safetensors file need not align its tensors: an unaligned one is copied */
    if (t->dtype == KILN_F32 && host && kiln_tensor_is_contiguous(t) &&
        (uintptr_t)kiln_tensor_data(t) % sizeof(float) == 0) {
        v->p = kiln_tensor_data(t);
        return KILN_OK;
    }
    kiln_status st = kiln_tensor_to(t, kiln_device_cpu(), KILN_F32, &v->tmp);
    if (st) return st;
    kiln_storage_set_owner(v->tmp->storage, "adapter scratch");
    v->p = kiln_tensor_data(v->tmp);
    return KILN_OK;
}

static void fput(fview *v)
{
    kiln_tensor_free(v->tmp);
    v->tmp = NULL;
}

/* out [P, R*K] = CP rebuild of t [I, J, K], wb [J, R], wa [I, P]. */
static kiln_status cp_rebuild(const kiln_tensor *T, const kiln_tensor *WA, const kiln_tensor *WB, float *out)
{
    int64_t I = T->shape[0], J = T->shape[1], K = T->shape[2] * T->shape[3];
    int64_t P = WA->shape[1], R = numel(WB) / WB->shape[0];
    fview t, wa, wb;
    float *tmp = NULL;
    kiln_status st = fget(T, &t);
    if (st) return st;
    if ((st = fget(WA, &wa))) { fput(&t); return st; }
    if ((st = fget(WB, &wb))) { fput(&t); fput(&wa); return st; }
    if (!(st = scratch(I * R * K, &tmp))) {
        /* tmp[i] [R, K] = wb^T [R, J] @ t[i] [J, K] */
        for (int64_t i = 0; i < I; i++)
            gemm(1, 0, R, K, J, 1.0f, wb.p, R, t.p + i * J * K, K, 0.0f, tmp + i * R * K, K);
        /* out [P, R*K] = wa^T [P, I] @ tmp [I, R*K] */
        gemm(1, 0, P, R * K, I, 1.0f, wa.p, P, tmp, R * K, 0.0f, out, R * K);
    }
    scratch_free(tmp);
    fput(&t);
    fput(&wa);
    fput(&wb);
    return st;
}

/* out [M, N] = a [M, r] @ b [r, N] (both flattened past their first dim). */
static kiln_status product(const kiln_tensor *A, const kiln_tensor *B, float *out, float alpha, float beta)
{
    int64_t M = A->shape[0], R = B->shape[0], N = numel(B) / (R ? R : 1);
    fview a, b;
    kiln_status st = fget(A, &a);
    if (st) return st;
    if ((st = fget(B, &b))) { fput(&a); return st; }
    gemm(0, 0, M, N, R, alpha, a.p, R, b.p, N, beta, out, N);
    fput(&a);
    fput(&b);
    return KILN_OK;
}

static kiln_status add_lora(const kiln_adapter *a, float *w, int64_t n, float alpha)
{
    const kiln_tensor *up = a->f[KILN_AF_UP], *down = a->f[KILN_AF_DOWN], *mid = a->f[KILN_AF_MID];
    if (!mid) return product(up, down, w, alpha, 1.0f);
    /* LoCon CP: down' [r0, in, kh, kw] with down'[p, c, s] = sum_b down[b, c] mid[p, b, s]
     * (ComfyUI folds mid into down the same way), then up @ down' */
    int64_t r0 = mid->shape[0], r1 = mid->shape[1], in = down->shape[1], kk = numel(mid) / (r0 * r1);
    int64_t out = up->shape[0], N = in * kk;
    (void)n;
    fview u, d, m;
    float *dn = NULL;
    kiln_status st = fget(up, &u);
    if (st) return st;
    if ((st = fget(down, &d))) { fput(&u); return st; }
    if ((st = fget(mid, &m))) { fput(&u); fput(&d); return st; }
    if (!(st = scratch(r0 * N, &dn))) {
        for (int64_t p = 0; p < r0; p++)
            gemm(1, 0, in, kk, r1, 1.0f, d.p, in, m.p + p * r1 * kk, kk, 0.0f, dn + p * N, kk);
        gemm(0, 0, out, N, r0, alpha, u.p, r0, dn, N, 1.0f, w, N);
    }
    scratch_free(dn);
    fput(&u);
    fput(&d);
    fput(&m);
    return st;
}

static kiln_status add_loha(const kiln_adapter *a, float *w, int64_t n, float alpha)
{
    float *m1 = NULL, *m2 = NULL;
    kiln_status st = scratch(n, &m1);
    if (!st) st = scratch(n, &m2);
    if (!st && a->f[KILN_AF_T1]) {
        st = cp_rebuild(a->f[KILN_AF_T1], a->f[KILN_AF_W1A], a->f[KILN_AF_W1B], m1);
        if (!st) st = cp_rebuild(a->f[KILN_AF_T2], a->f[KILN_AF_W2A], a->f[KILN_AF_W2B], m2);
    } else if (!st) {
        st = product(a->f[KILN_AF_W1A], a->f[KILN_AF_W1B], m1, 1.0f, 0.0f);
        if (!st) st = product(a->f[KILN_AF_W2A], a->f[KILN_AF_W2B], m2, 1.0f, 0.0f);
    }
    if (!st)
        for (int64_t i = 0; i < n; i++) w[i] += alpha * (m1[i] * m2[i]);
    scratch_free(m1);
    scratch_free(m2);
    return st;
}

static kiln_status add_lokr(const kiln_adapter *a, float *w, float alpha)
{
    int64_t s1[4], s2[4];
    int nd;
    kiln_status st = lokr_shapes(a, s1, s2, &nd);
    if (st) return st;
    int64_t n1 = s1[0] * s1[1] * s1[2] * s1[3], n2 = s2[0] * s2[1] * s2[2] * s2[3];
    fview v1 = {0}, v2 = {0};
    float *b1 = NULL, *b2 = NULL;
    if (a->f[KILN_AF_W1]) st = fget(a->f[KILN_AF_W1], &v1);
    else if (!(st = scratch(n1, &b1))) st = product(a->f[KILN_AF_W1A], a->f[KILN_AF_W1B], b1, 1.0f, 0.0f);
    if (!st) {
        if (a->f[KILN_AF_W2]) st = fget(a->f[KILN_AF_W2], &v2);
        else if (!(st = scratch(n2, &b2))) {
            if (a->f[KILN_AF_T2]) st = cp_rebuild(a->f[KILN_AF_T2], a->f[KILN_AF_W2A], a->f[KILN_AF_W2B], b2);
            else st = product(a->f[KILN_AF_W2A], a->f[KILN_AF_W2B], b2, 1.0f, 0.0f);
        }
    }
    if (!st) {
        const float *w1 = b1 ? b1 : v1.p, *w2 = b2 ? b2 : v2.p;
        int64_t O1 = s1[1] * s2[1], O2 = s1[2] * s2[2], O3 = s1[3] * s2[3];
        /* out[i*s2 + j] (per dim) += alpha w1[i] w2[j] */
        int64_t i[4], j[4];
        for (i[0] = 0; i[0] < s1[0]; i[0]++)
        for (i[1] = 0; i[1] < s1[1]; i[1]++)
        for (i[2] = 0; i[2] < s1[2]; i[2]++)
        for (i[3] = 0; i[3] < s1[3]; i[3]++) {
            float v = alpha * w1[((i[0] * s1[1] + i[1]) * s1[2] + i[2]) * s1[3] + i[3]];
            const float *src = w2;
            for (j[0] = 0; j[0] < s2[0]; j[0]++)
            for (j[1] = 0; j[1] < s2[1]; j[1]++)
            for (j[2] = 0; j[2] < s2[2]; j[2]++) {
                float *dst = w + (((i[0] * s2[0] + j[0]) * O1 + i[1] * s2[1] + j[1]) * O2 + i[2] * s2[2] + j[2]) * O3 +
                             i[3] * s2[3];
                for (j[3] = 0; j[3] < s2[3]; j[3]++) dst[j[3]] += v * *src++;
            }
        }
    }
    scratch_free(b1);
    scratch_free(b2);
    fput(&v1);
    fput(&v2);
    return st;
}

static kiln_status add_diff(const kiln_adapter *a, float *w, int64_t n, float alpha)
{
    fview d;
    kiln_status st = fget(a->f[KILN_AF_DIFF], &d);
    if (st) return st;
    for (int64_t i = 0; i < n; i++) w[i] += alpha * d.p[i];
    fput(&d);
    return KILN_OK;
}

/* w += alpha * delta */
static kiln_status add_delta(const kiln_adapter *a, float *w, int64_t n, float alpha)
{
    switch (a->kind) {
    case KILN_ADAPTER_LORA: return add_lora(a, w, n, alpha);
    case KILN_ADAPTER_LOHA: return add_loha(a, w, n, alpha);
    case KILN_ADAPTER_LOKR: return add_lokr(a, w, alpha);
    case KILN_ADAPTER_DIFF: return add_diff(a, w, n, alpha);
    default: return kiln_error(KILN_ERR_ARG, "adapter: bad kind %d", (int)a->kind);
    }
}

struct kiln_adapter_rows {
    const kiln_adapter *a;
    fview up, down, diff;
    int64_t rank, row_len;
};

kiln_status kiln_adapter_rows_begin(const kiln_adapter *a, int64_t nrows, int64_t row_len, kiln_adapter_rows **out)
{
    *out = NULL;
    if (a->f[KILN_AF_DORA_SCALE] || row_len <= 0 || a->scale == 0) return KILN_ERR_UNSUPPORTED;
    const kiln_tensor *up = a->f[KILN_AF_UP], *down = a->f[KILN_AF_DOWN], *diff = a->f[KILN_AF_DIFF];
    int64_t rank = 0;
    if (a->kind == KILN_ADAPTER_LORA) {
        if (a->f[KILN_AF_MID] || !up || !down || down->shape[0] <= 0) return KILN_ERR_UNSUPPORTED;
        rank = down->shape[0];
        if (numel(down) != rank * row_len || numel(up) != nrows * rank || up->shape[1] != rank) return KILN_ERR_UNSUPPORTED;
    } else if (a->kind != KILN_ADAPTER_DIFF || !diff || numel(diff) != nrows * row_len) {
        return KILN_ERR_UNSUPPORTED;
    }
    kiln_adapter_rows *r = calloc(1, sizeof *r);
    if (!r) return kiln_error(KILN_ERR_OOM, "adapter: out of host memory");
    r->a = a;
    r->rank = rank;
    r->row_len = row_len;
    kiln_status st = a->kind == KILN_ADAPTER_LORA ? fget(up, &r->up) : fget(diff, &r->diff);
    if (!st && a->kind == KILN_ADAPTER_LORA) st = fget(down, &r->down);
    if (st) { kiln_adapter_rows_end(r); return st; }
    *out = r;
    return KILN_OK;
}

void kiln_adapter_rows_add(kiln_adapter_rows *r, float *w, int64_t r0, int64_t nrows)
{
    float alpha = (float)r->a->scale;
    int64_t N = r->row_len;
    if (r->a->kind == KILN_ADAPTER_LORA) {
        gemm(0, 0, nrows, N, r->rank, alpha, r->up.p + r0 * r->rank, r->rank, r->down.p, N, 1.0f, w, N);
    } else {
        const float *d = r->diff.p + r0 * N;
        for (int64_t i = 0; i < nrows * N; i++) w[i] += alpha * d[i];
    }
}

void kiln_adapter_rows_end(kiln_adapter_rows *r)
{
    if (!r) return;
    fput(&r->up);
    fput(&r->down);
    fput(&r->diff);
    free(r);
}

kiln_status kiln_adapter_apply(const kiln_adapter *a, float *w, int ndim, const int64_t *shape)
{
    int nd;
    int64_t s[KILN_MAX_DIMS];
    kiln_status st = kiln_adapter_delta_shape(a, &nd, s);
    if (st) return st;
    int64_t n = 1, nd_el = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    for (int d = 0; d < nd; d++) nd_el *= s[d];
    if (n != nd_el) return kiln_error(KILN_ERR_ARG, "%s delta has %lld elements, the weight %lld", kind_names[a->kind],
                                      (long long)nd_el, (long long)n);
    const kiln_tensor *dora = a->f[KILN_AF_DORA_SCALE];
    if (!dora) return a->scale == 0 ? KILN_OK : add_delta(a, w, n, (float)a->scale);

    /* DoRA (weight_decompose): wc = w + (scale/strength) delta; wc *= dora / |wc|
     * (norm per dim-1 column); w += strength (wc - w) */
    if (ndim < 2) return kiln_error(KILN_ERR_ARG, "dora_scale needs a weight of 2 or more dims");
    int64_t O = shape[0], C = shape[1], R = O * C > 0 ? n / (O * C) : 0;
    if (numel(dora) != C)
        return kiln_error(KILN_ERR_ARG, "dora_scale has %lld elements, the weight has %lld columns (its dim 2)",
                          (long long)numel(dora), (long long)C);
    double strength = a->strength != 0 ? a->strength : (a->scale != 0 ? 1.0 : 0.0);
    if (strength == 0) return KILN_OK;
    float *wc = NULL;
    double *norm = NULL;
    fview dv = {0};
    if ((st = scratch(n, &wc))) return st;
    if ((st = fget(dora, &dv))) { scratch_free(wc); return st; }
    st = kiln_device_scratch_alloc(kiln_device_cpu(), sizeof *norm * (size_t)(C ? C : 1), 0, (void **)&norm);
    if (!st) {
        memset(norm, 0, sizeof *norm * (size_t)C);
        memcpy(wc, w, sizeof(float) * (size_t)n);
        st = add_delta(a, wc, n, (float)(a->scale / strength));
    }
    if (!st) {
        for (int64_t o = 0; o < O; o++)
            for (int64_t c = 0; c < C; c++) {
                const float *p = wc + (o * C + c) * R;
                double acc = 0;
                for (int64_t r = 0; r < R; r++) acc += (double)p[r] * p[r];
                norm[c] += acc;
            }
        for (int64_t c = 0; c < C; c++) norm[c] = (float)(dv.p[c] / (float)sqrt(norm[c]));
        float sf = (float)strength;
        for (int64_t o = 0; o < O; o++)
            for (int64_t c = 0; c < C; c++) {
                float k = (float)norm[c];
                float *p = wc + (o * C + c) * R, *q = w + (o * C + c) * R;
                for (int64_t r = 0; r < R; r++) {
                    float v = p[r] * k;
                    q[r] = sf == 1.0f ? v : q[r] + sf * (v - q[r]);
                }
            }
    }
    if (norm) kiln_device_scratch_free(kiln_device_cpu(), norm);
    fput(&dv);
    scratch_free(wc);
    return st;
}
