/* backend_cpu.c - the CPU backend's operation table: adapts tensors (strided, any
 * float dtype) to the raw contiguous kernels of cpu_kernels.h. Activations are
 * computed in f32; weights stay in their stored dtype (f16/bf16 converted blockwise
 * inside the kernels). The sim device uses this table too. */
#include "cpu_backend.h"
#include "cpu_internal.h"
#include "cpu_isa.h"
#include "threadpool.h"
#include "../../runtime/model.h"
#include "../../runtime/precision.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* *tmp receives a contiguous f32 copy when t is not already one; returns the data. */
static const float *f32_data(const kiln_tensor *t, kiln_tensor **tmp, kiln_status *st)
{
    *tmp = NULL;
    if (t->dtype == KILN_F32 && kiln_tensor_is_contiguous(t)) return kiln_tensor_data(t);
    *st = kiln_tensor_new(t->storage->device, KILN_F32, t->ndim, t->shape, tmp);
    if (*st) return NULL;
    if ((*st = kiln_cpu_copy(*tmp, t))) return NULL; /* the caller frees *tmp */
    return kiln_tensor_data(*tmp);
}

/* fp8 -> f16 (exact) in pieces of 64 Ki elements on the pool */
typedef struct { uint16_t *dst; const uint8_t *src; kiln_dtype dt; int64_t n; } f8_job;

static void f8_to_f16_run(void *p, int64_t b0, int64_t b1)
{
    const f8_job *j = p;
    int64_t lo = b0 * 65536, hi = b1 * 65536 < j->n ? b1 * 65536 : j->n;
    if (lo < hi) kiln_convert(j->dst + lo, KILN_F16, j->src + lo, j->dt, (size_t)(hi - lo));
}

static int is_lowbit(kiln_dtype dt)
{
    return dt == KILN_F8_E4M3FN || dt == KILN_F8_E5M2 || kiln_dtype_is_blocked(dt);
}

/* Weights: contiguous in f32/f16/bf16 as stored, and low-bit ones (fp8, block types)
 * too where the kernel decodes them itself (linear: lowbit_ok); otherwise the
 * convolutions get fp8 as an f16 copy of the layer (exact) and block types as f32;
 * anything else becomes f32. */
static const void *w_data(const kiln_tensor *t, kiln_tensor **tmp, kiln_status *st, kiln_dtype *dt, int lowbit_ok)
{
    *tmp = NULL;
    if (kiln_tensor_is_contiguous(t) && (t->dtype == KILN_F32 || t->dtype == KILN_F16 || t->dtype == KILN_BF16 ||
                                         (lowbit_ok && is_lowbit(t->dtype)))) {
        *dt = t->dtype;
        return kiln_tensor_data(t);
    }
    if ((t->dtype == KILN_F8_E4M3FN || t->dtype == KILN_F8_E5M2) && kiln_tensor_is_contiguous(t)) {
        *st = kiln_tensor_new(t->storage->device, KILN_F16, t->ndim, t->shape, tmp);
        if (*st) return NULL;
        f8_job j = {kiln_tensor_data(*tmp), kiln_tensor_data(t), t->dtype, kiln_tensor_numel(t)};
        kiln_parallel_for((kiln_tensor_numel(t) + 65535) / 65536, 1, f8_to_f16_run, &j);
        *dt = KILN_F16;
        return kiln_tensor_data(*tmp);
    }
    *dt = KILN_F32;
    return f32_data(t, tmp, st);
}

/* Output: kernels write f32; a non-f32 output gets a staging buffer copied at the end. */
static float *out_data(kiln_tensor *out, kiln_tensor **tmp, kiln_status *st)
{
    *tmp = NULL;
    if (out->dtype == KILN_F32 && kiln_tensor_is_contiguous(out)) return kiln_tensor_data(out);
    *st = kiln_tensor_new(out->storage->device, KILN_F32, out->ndim, out->shape, tmp);
    if (*st) return NULL;
    return kiln_tensor_data(*tmp);
}

static void finish_out(kiln_tensor *out, kiln_tensor *tmp)
{
    if (tmp) { kiln_cpu_copy(out, tmp); kiln_tensor_free(tmp); }
}

#define FREE3(a, b, c) do { kiln_tensor_free(a); kiln_tensor_free(b); kiln_tensor_free(c); } while (0)

static kiln_status cpu_matmul(kiln_tensor *out, const kiln_tensor *a, const kiln_tensor *b)
{
    kiln_status st = KILN_OK;
    kiln_tensor *ta, *tb, *to;
    const float *A = f32_data(a, &ta, &st);
    const float *B = A ? f32_data(b, &tb, &st) : (tb = NULL, NULL);
    float *C = B ? out_data(out, &to, &st) : (to = NULL, NULL);
    if (!C) { FREE3(ta, tb, to); return st; }
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1];
    int64_t batch = kiln_tensor_numel(out) / (M * N > 0 ? M * N : 1);
    if (M * N > 0) {
        if (K == 0) for (int64_t i = 0; i < batch * M * N; i++) C[i] = 0;
        else kiln_cpu_gemm_batched_f32(0, 0, batch, M, N, K, 1.0f, A, K, M * K, B, N, K * N, 0.0f, C, N, M * N);
    }
    finish_out(out, to);
    FREE3(ta, tb, NULL);
    return KILN_OK;
}

/* The operands of a weighted op (linear, conv2d): x and bias as contiguous f32, w in
 * its own dtype (f32/f16/bf16), out's buffer; the temporaries go back with wop_done. */
typedef struct {
    const float *X, *B;
    const void *W;
    kiln_dtype wdt;
    float *Y;
    kiln_tensor *tx, *tw, *tb, *to;
} wop;

static kiln_status wop_get(wop *o, kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                           const kiln_tensor *bias, int lowbit_ok)
{
    kiln_status st = KILN_OK;
    memset(o, 0, sizeof *o);
    o->X = f32_data(x, &o->tx, &st);
    o->W = o->X ? w_data(w, &o->tw, &st, &o->wdt, lowbit_ok) : NULL;
    if (o->W && bias) o->B = f32_data(bias, &o->tb, &st);
    o->Y = (o->W && (!bias || o->B)) ? out_data(out, &o->to, &st) : NULL;
    if (!o->Y) {
        FREE3(o->tx, o->tw, o->tb);
        kiln_tensor_free(o->to);
        return st ? st : KILN_ERR_OOM;
    }
    return KILN_OK;
}

static void wop_done(wop *o, kiln_tensor *out)
{
    finish_out(out, o->to);
    FREE3(o->tx, o->tw, o->tb);
}

/* Precision int8: the weight's packed form (gemm_int8.c), kept as a cache derived from
 * its storage (device.h) so a model's weights are quantized once, not at every call.
 * Counted in the device's budget and its limit for caches, taken only where it fits
 * without evicting, and the first memory given back when an allocation does not fit
 * (device.h), so it holds spare memory only. In memory mode low only for streamed
 * copies (it goes with the copy), not for a mapped file's weights: low's point is to
 * hold no second copy of them. The meta device takes the same cache through this plan,
 * so a dry run counts it where the real run keeps it (cpu_backend.h). */
size_t kiln_cpu_int8_cache_plan(const kiln_tensor *w, int64_t M, uint64_t key[4])
{
    if (kiln_precision_for(NULL) != KILN_PREC_INT8 || M < kiln_cpu_int8_min_rows(1) || w->ndim < 2 ||
        (w->storage->release && kiln_memory_mode_get() == KILN_MEM_LOW) || !kiln_tensor_is_contiguous(w))
        return 0;
    int64_t N = w->shape[0], K = kiln_tensor_numel(w) / (N ? N : 1); /* a 1x1 convolution's [k, c, 1, 1] too */
    key[0] = 0x696e7438u; /* "int8" */
    key[1] = (uint64_t)w->offset;
    key[2] = (uint64_t)N << 32 | (uint64_t)K;
    key[3] = (uint64_t)w->dtype;
    return kiln_cpu_int8_packed_bytes(N, K, w->dtype);
}

/* The cache of key for w's storage, retained: found, or made (bytes) and filled by fill,
 * then published; NULL where a plan gave no bytes, it does not fit, or fill failed (the
 * caller then computes without it). */
typedef int (*form_fill_fn)(void *dst, const kiln_tensor *w);

static kiln_storage *kept_form(const kiln_tensor *w, size_t bytes, const uint64_t key[4], form_fill_fn fill)
{
    if (!bytes) return NULL;
    kiln_storage *p = kiln_storage_derived_get(w->storage, key);
    if (p) return p;
    if (kiln_storage_derived_new(w->storage, bytes, &p)) return NULL;
    if (fill(p->data, w)) { kiln_storage_release(p); return NULL; }
    kiln_storage_derived_put(w->storage, key, p);
    return p;
}

static int int8_fill(void *dst, const kiln_tensor *w)
{
    int64_t N = w->shape[0], K = kiln_tensor_numel(w) / (N ? N : 1);
    return kiln_cpu_int8_pack(dst, kiln_tensor_data(w), w->dtype, N, K);
}

/* The packed storage, retained, or NULL: then the call takes kiln_cpu_linear's own path
 * (packing per call, or bf16). */
static kiln_storage *int8_weights(const kiln_tensor *w, int64_t M)
{
    uint64_t key[4];
    return kept_form(w, kiln_cpu_int8_cache_plan(w, M, key), key, int8_fill);
}

/* Precision bf16: a linear layer's weight rounded into the product's pair slivers once
 * (gemm_bf16.c), kept as a cache derived from its storage like int8's, instead of
 * rounding it again at every call (about as long as the bf16 products of a UNet's
 * 256-token layers). Mapped weights too: the cache is counted in the device's budget,
 * taken only where it fits without evicting, and the first thing an allocation that
 * does not fit gives back (kiln_device_drop_derived), so it uses spare memory only. Not
 * in memory mode low, whose point is to hold no second copy of the weights. */
size_t kiln_cpu_bf16_cache_plan(const kiln_tensor *w, int64_t M, uint64_t key[4])
{
    if (kiln_precision_for(NULL) != KILN_PREC_BF16 || kiln_memory_mode_get() == KILN_MEM_LOW || w->ndim != 2 ||
        (w->dtype != KILN_F32 && w->dtype != KILN_F16 && w->dtype != KILN_BF16) || !kiln_tensor_is_contiguous(w))
        return 0;
    int64_t N = w->shape[0], K = w->shape[1];
    int mode = kiln_cpu_linear_bf16_pairs_mode(M, N, K);
    if (!mode) return 0;
    key[0] = 0x62663136u; /* "bf16" */
    key[1] = (uint64_t)w->offset;
    key[2] = (uint64_t)N << 32 | (uint64_t)K;
    key[3] = (uint64_t)w->dtype | (uint64_t)mode << 8;
    return kiln_cpu_bf16_weight_pairs_bytes(N, K);
}

static int bf16_fill(void *dst, const kiln_tensor *w)
{
    return kiln_cpu_bf16_weight_pairs(dst, kiln_tensor_data(w), w->dtype, w->shape[0], w->shape[1]);
}

static kiln_storage *bf16_weights(const kiln_tensor *w, int64_t M)
{
    uint64_t key[4];
    return kept_form(w, kiln_cpu_bf16_cache_plan(w, M, key), key, bf16_fill);
}

/* bf16 products: a 3x3 convolution's weights transformed as the few-tiles Winograd path
 * multiplies them (conv2d_winograd_few.c), kept like the linear layers' pairs above:
 * that transform was as long as the products it feeds at a UNet's 8x8 and 16x16
 * levels. 1.8 times the f16 weights' bytes at F(2,3), four times at F(4,3), which the
 * kernel's plan keeps only when asked (KILN_WINOGRAD_FEW_CACHE). Filled by the
 * convolution as it runs, so it does not go through kept_form. */
size_t kiln_cpu_conv2d_cache_plan(const kiln_tensor *w, const kiln_conv2d_params *p, uint64_t key[4])
{
    int variant = 0;
    if (kiln_memory_mode_get() == KILN_MEM_LOW || w->ndim != 4 || !kiln_tensor_is_contiguous(w) ||
        (w->dtype != KILN_F32 && w->dtype != KILN_F16 && w->dtype != KILN_BF16))
        return 0;
    size_t bytes = kiln_cpu_conv2d_weight_cache_plan(p, w->dtype, &variant);
    if (!bytes) return 0;
    key[0] = 0x77696e6fu; /* "wino" */
    key[1] = (uint64_t)w->offset;
    key[2] = (uint64_t)p->k << 32 | (uint64_t)p->c;
    key[3] = (uint64_t)w->dtype | (uint64_t)variant << 8;
    return bytes;
}

/* An activation the int8 product reads or writes as it is */
static int direct_act(const kiln_tensor *t)
{
    return (t->dtype == KILN_F32 || t->dtype == KILN_BF16 || t->dtype == KILN_F16) && kiln_tensor_is_contiguous(t);
}

static kiln_status cpu_linear(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *bias)
{
    int64_t K = x->shape[x->ndim - 1], N = w->shape[0], M = kiln_tensor_numel(x) / (K ? K : 1);
    if (K == 0) M = kiln_tensor_numel(out) / (N ? N : 1);
    kiln_storage *packed = K > 0 && N > 0 ? int8_weights(w, M) : NULL;
    if (packed) {
        /* f32, bf16 or f16 activations are quantized as they are, and the output written
         * in its dtype: no f32 copies of either */
        kiln_status st = KILN_OK;
        kiln_tensor *tx = NULL, *tb = NULL, *to = NULL;
        const void *X = direct_act(x) ? kiln_tensor_data(x) : f32_data(x, &tx, &st);
        const float *B = NULL;
        if (X && bias) B = f32_data(bias, &tb, &st);
        void *Y = X && (!bias || B) ? (direct_act(out) ? kiln_tensor_data(out) : out_data(out, &to, &st)) : NULL;
        int r = Y ? kiln_cpu_linear_int8_packed(Y, to ? KILN_F32 : out->dtype, X, tx ? KILN_F32 : x->dtype,
                                                packed->data, B, M, N, K)
                  : -1;
        kiln_storage_release(packed);
        if (r == 0) { finish_out(out, to); FREE3(tx, tb, NULL); return KILN_OK; }
        FREE3(tx, tb, to);
        if (!Y) return st ? st : KILN_ERR_OOM;
        /* no scratch for the activations: the ordinary path below */
    }
    /* a weight the plan takes is contiguous in its float dtype: wop reads it in place */
    kiln_storage *pairs = K > 0 && N > 0 ? bf16_weights(w, M) : NULL;
    wop o;
    kiln_status st = wop_get(&o, out, x, w, bias, 1);
    if (st) { kiln_storage_release(pairs); return st; }
    if (!pairs || kiln_cpu_linear_bf16_pairs(o.Y, o.X, pairs->data, o.B, M, N, K))
        st = kiln_cpu_linear(o.Y, o.X, o.W, o.wdt, o.B, M, N, K);
    kiln_storage_release(pairs);
    wop_done(&o, out);
    return st;
}

static kiln_status cpu_conv2d(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                              const kiln_tensor *bias, const kiln_conv_opts *o)
{
    kiln_conv2d_params p = {
        .n = x->shape[0], .c = x->shape[1], .h = x->shape[2], .w = x->shape[3],
        .k = w->shape[0], .r = w->shape[2], .s = w->shape[3],
        .stride_h = o->stride[0], .stride_w = o->stride[1], .pad_h = o->padding[0], .pad_w = o->padding[1],
        .dil_h = o->dilation[0], .dil_w = o->dilation[1], .groups = o->groups,
        .act = o->act, .act_slope = (float)o->act_slope,
    };
    kiln_status st = kiln_conv2d_out_size(&p);
    if (st) return st;
    /* precision int8: a 1x1 convolution (a UNet's projections and skip convolutions) is
     * a linear layer over the pixels, with the same packed weights */
    kiln_storage *packed = p.r == 1 && p.s == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_h == 0 &&
                                   p.pad_w == 0 && p.groups == 1 && p.c > 0 && p.k > 0
                               ? int8_weights(w, p.h * p.w)
                               : NULL;
    if (packed) {
        kiln_tensor *tx, *tb = NULL, *tr = NULL, *to = NULL;
        const float *X = f32_data(x, &tx, &st), *B = NULL, *R = NULL;
        if (X && bias) B = f32_data(bias, &tb, &st);
        if (X && (!bias || B) && o->residual) R = f32_data(o->residual, &tr, &st);
        float *Y = X && (!bias || B) && (!o->residual || R) ? out_data(out, &to, &st) : NULL;
        int r = Y ? kiln_cpu_conv1x1_int8_packed(Y, X, packed->data, B, R, p.act, p.act_slope, p.n, p.c, p.h * p.w,
                                                 p.k)
                  : -1;
        kiln_storage_release(packed);
        kiln_tensor_free(tr);
        if (r == 0) { finish_out(out, to); FREE3(tx, tb, NULL); return KILN_OK; }
        FREE3(tx, tb, to);
        if (!Y) return st ? st : KILN_ERR_OOM;
    }
    wop ops;
    if ((st = wop_get(&ops, out, x, w, bias, 0))) return st;
    kiln_tensor *tr = NULL; /* the residual as contiguous f32, like the output */
    if (o->residual && !(p.residual = f32_data(o->residual, &tr, &st))) {
        kiln_tensor_free(tr);
        wop_done(&ops, out);
        return st;
    }
    /* the layer's transformed weights: read from the cache, or written into a new one
     * by this call and kept when the kernel did fill it */
    uint64_t key[4];
    size_t cache_bytes = kiln_cpu_conv2d_cache_plan(w, &p, key);
    kiln_conv2d_cache wc = {0};
    kiln_storage *cache = cache_bytes ? kiln_storage_derived_get(w->storage, key) : NULL;
    int cached = cache != NULL; /* wc.ready also turns 1 after a batch's first group fills it */
    if (cache) wc.ready = 1;
    else if (cache_bytes && kiln_storage_derived_new(w->storage, cache_bytes, &cache)) cache = NULL;
    if (cache) {
        wc.data = cache->data;
        wc.variant = (int)(key[3] >> 8);
        p.cache = &wc;
    }
    st = kiln_cpu_conv2d(ops.Y, ops.X, ops.W, ops.wdt, ops.B, &p);
    if (cache && !cached && wc.filled && !st) kiln_storage_derived_put(w->storage, key, cache);
    kiln_storage_release(cache);
    kiln_tensor_free(tr);
    wop_done(&ops, out);
    return st;
}

static kiln_status cpu_conv2d_up2(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                                  const kiln_tensor *bias)
{
    /* not fused: the op upsamples into a tensor of its own (counted, unlike scratch) */
    if (!kiln_cpu_conv2d_up2_fuses(x->shape[1], x->shape[2], x->shape[3], w->shape[0])) return KILN_ERR_UNSUPPORTED;
    wop o;
    kiln_status st = wop_get(&o, out, x, w, bias, 0);
    if (st) return st;
    st = kiln_cpu_conv2d_up2(o.Y, o.X, o.W, o.wdt, o.B, x->shape[0], x->shape[1], x->shape[2], x->shape[3], w->shape[0]);
    wop_done(&o, out);
    return st;
}

static kiln_status cpu_group_norm(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                                  const kiln_tensor *b, int64_t groups, double eps, int silu)
{
    kiln_status st = KILN_OK;
    kiln_tensor *tx, *tw = NULL, *tb = NULL, *to = NULL;
    const float *X = f32_data(x, &tx, &st), *Wv = NULL, *Bv = NULL;
    if (X && w) Wv = f32_data(w, &tw, &st);
    if (X && b) Bv = f32_data(b, &tb, &st);
    float *Y = (X && (!w || Wv) && (!b || Bv)) ? out_data(out, &to, &st) : NULL;
    if (!Y) { FREE3(tx, tw, tb); kiln_tensor_free(to); return st; }
    int64_t N = x->shape[0], C = x->shape[1], HW = kiln_tensor_numel(x) / (N * C != 0 ? N * C : 1);
    kiln_cpu_group_norm(Y, X, Wv, Bv, N, C, HW, groups, (float)eps, silu);
    finish_out(out, to);
    FREE3(tx, tw, tb);
    return KILN_OK;
}

static kiln_status cpu_layer_norm(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                                  const kiln_tensor *b, double eps)
{
    kiln_status st = KILN_OK;
    kiln_tensor *tx, *tw = NULL, *tb = NULL, *to = NULL;
    const float *X = f32_data(x, &tx, &st), *Wv = NULL, *Bv = NULL;
    if (X && w) Wv = f32_data(w, &tw, &st);
    if (X && b) Bv = f32_data(b, &tb, &st);
    float *Y = (X && (!w || Wv) && (!b || Bv)) ? out_data(out, &to, &st) : NULL;
    if (!Y) { FREE3(tx, tw, tb); kiln_tensor_free(to); return st; }
    int64_t D = x->shape[x->ndim - 1], rows = kiln_tensor_numel(x) / (D ? D : 1);
    kiln_cpu_layer_norm(Y, X, Wv, Bv, rows, D, (float)eps);
    finish_out(out, to);
    FREE3(tx, tw, tb);
    return KILN_OK;
}

static kiln_status cpu_softmax(kiln_tensor *out, const kiln_tensor *x, int dim)
{
    kiln_status st = KILN_OK;
    kiln_tensor *tx, *to = NULL;
    const float *X = f32_data(x, &tx, &st);
    float *Y = X ? out_data(out, &to, &st) : NULL;
    if (!Y) { kiln_tensor_free(tx); return st; }
    int64_t outer = 1, inner = 1;
    for (int i = 0; i < dim; i++) outer *= x->shape[i];
    for (int i = dim + 1; i < x->ndim; i++) inner *= x->shape[i];
    kiln_cpu_softmax(Y, X, outer, x->shape[dim], inner);
    finish_out(out, to);
    kiln_tensor_free(tx);
    return KILN_OK;
}

static kiln_status cpu_attention(kiln_tensor *out, const kiln_tensor *q, const kiln_tensor *k,
                                 const kiln_tensor *v, double scale, int causal)
{
    kiln_status st = KILN_OK;
    kiln_tensor *tq, *tk = NULL, *tv = NULL, *to = NULL;
    const float *Q = f32_data(q, &tq, &st);
    const float *K = Q ? f32_data(k, &tk, &st) : NULL;
    const float *V = K ? f32_data(v, &tv, &st) : NULL;
    float *O = V ? out_data(out, &to, &st) : NULL;
    if (!O) { FREE3(tq, tk, tv); kiln_tensor_free(to); return st; }
    int64_t B = q->shape[0] * q->shape[1], Lq = q->shape[2], D = q->shape[3], Lk = k->shape[2], Dv = v->shape[3];
    st = kiln_cpu_attention(O, Q, K, V, B, Lq, Lk, D, Dv, (float)scale, causal);
    finish_out(out, to);
    FREE3(tq, tk, tv);
    return st;
}

static kiln_status cpu_geglu(kiln_tensor *out, const kiln_tensor *x)
{
    kiln_status st = KILN_OK;
    kiln_tensor *tx, *to = NULL;
    const float *X = f32_data(x, &tx, &st);
    float *Y = X ? out_data(out, &to, &st) : NULL;
    if (!Y) { kiln_tensor_free(tx); return st; }
    int64_t D2 = x->shape[x->ndim - 1], rows = kiln_tensor_numel(x) / (D2 ? D2 : 1);
    kiln_cpu_geglu(Y, X, rows, D2 / 2);
    finish_out(out, to);
    kiln_tensor_free(tx);
    return KILN_OK;
}

static kiln_status cpu_resample(kiln_resample mode, kiln_tensor *out, const kiln_tensor *x)
{
    kiln_status st = KILN_OK;
    kiln_tensor *tx, *to = NULL;
    const float *X = f32_data(x, &tx, &st);
    float *Y = X ? out_data(out, &to, &st) : NULL;
    if (!Y) { kiln_tensor_free(tx); return st; }
    int64_t nc = x->shape[0] * x->shape[1], h = x->shape[2], w = x->shape[3], oh = out->shape[2], ow = out->shape[3];
    if (mode == KILN_RS_NEAREST && oh % h == 0 && ow % w == 0 && oh / h == ow / w)
        kiln_cpu_upsample_nearest(Y, X, nc, h, w, oh / h);
    else if (mode == KILN_RS_NEAREST) kiln_cpu_interpolate_nearest(Y, X, nc, h, w, oh, ow);
    else if (mode == KILN_RS_NEAREST_EXACT) kiln_cpu_interpolate_nearest_exact(Y, X, nc, h, w, oh, ow);
    else kiln_cpu_interpolate_bilinear(Y, X, nc, h, w, oh, ow);
    finish_out(out, to);
    kiln_tensor_free(tx);
    return KILN_OK;
}

static kiln_status cpu_pad2d(kiln_tensor *out, const kiln_tensor *x, const int64_t *pads, int mode, double value)
{
    kiln_status st = KILN_OK;
    kiln_tensor *tx, *to = NULL;
    const float *X = f32_data(x, &tx, &st);
    float *Y = X ? out_data(out, &to, &st) : NULL;
    if (!Y) { kiln_tensor_free(tx); return st; }
    int64_t h = x->shape[x->ndim - 2], w = x->shape[x->ndim - 1], nc = kiln_tensor_numel(x) / (h * w != 0 ? h * w : 1);
    kiln_cpu_pad2d(Y, X, nc, h, w, pads[2], pads[3], pads[0], pads[1], (kiln_pad_mode)mode, (float)value);
    finish_out(out, to);
    kiln_tensor_free(tx);
    return KILN_OK;
}

static int cpu_supports(kiln_op op, kiln_dtype dt)
{
    (void)dt;
    return op >= 0 && op < KILN_OP_COUNT;
}

/* The kernels' scratch is host memory shared by cpu and sim, reported once, on cpu
 * (what it holds now, cache included, and the most in use at once); emptying either
 * device's cache trims it. It stays outside the cpu allocator: the kernels serve both
 * devices and know neither, and the cached blocks, kept between ops for speed, would
 * otherwise hold budget the tensors need; a dry run models it from the kernels' own
 * sizing (kiln_cpu_*_scratch_bound). */
static uint64_t cpu_workspace_bytes(kiln_device *dev)
{
    return dev->type == KILN_DEV_CPU ? (uint64_t)kiln_cpu_scratch_stats(0).held : 0;
}

static uint64_t cpu_workspace_peak(kiln_device *dev, int reset)
{
    return dev->type == KILN_DEV_CPU ? (uint64_t)kiln_cpu_scratch_stats(reset).peak_in_use : 0;
}

static void cpu_workspace_release(kiln_device *dev)
{
    (void)dev;
    kiln_cpu_scratch_trim();
}

/* The pool takes one job at a time (a second submitter waits for the first), so a
 * copy thread's product and the compute thread's ops only take turns. */
static kiln_status cpu_gemm_f32(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                                const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                                float *C, int64_t ldc)
{
    kiln_cpu_gemm_f32(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return KILN_OK;
}

static const kiln_backend cpu_backend = {
    .name = "cpu",
    .supports = cpu_supports,
    .copy = kiln_cpu_copy,
    .fill = kiln_cpu_fill,
    .binary = kiln_cpu_binary,
    .unary = kiln_cpu_unary,
    .reduce = kiln_cpu_reduce,
    .matmul = cpu_matmul,
    .linear = cpu_linear,
    .conv2d = cpu_conv2d,
    .conv2d_act = 1,
    .conv2d_residual = 1,
    .conv2d_up2 = cpu_conv2d_up2,
    .group_norm = cpu_group_norm, /* kiln_cpu_group_norm reads each value before writing it */
    .group_norm_in_place = 1,
    .layer_norm = cpu_layer_norm,
    .softmax = cpu_softmax,
    .attention = cpu_attention,
    .geglu = cpu_geglu,
    .resample = cpu_resample,
    .pad2d = cpu_pad2d,
    .gemm_f32 = cpu_gemm_f32,
    .workspace_bytes = cpu_workspace_bytes,
    .workspace_release = cpu_workspace_release,
    .workspace_peak = cpu_workspace_peak,
    .threads = kiln_cpu_threads,
    .set_threads = kiln_cpu_set_threads,
    .native_bf16 = kiln_cpu_has_bf16,
};

void kiln_cpu_backend_register(void) { kiln_backend_register(&cpu_backend); }
