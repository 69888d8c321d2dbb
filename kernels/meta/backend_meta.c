/* backend_meta.c - the operation table of the shape-only device: every entry returns
 * at once (runtime/ops.c has checked the arguments and allocated the output), after
 * allocating and freeing, on the meta device, the temporaries the modelled device's
 * backend would (the CPU backend's f32 copies of strided or half-precision operands and
 * its f32 staging outputs), so a dry run's peak is the real one. The kernels' own
 * scratch is modelled too: the CPU's host scratch, outside any allocator, is noted at
 * its bound for each op (kiln_meta_note_scratch, from the kernels' own sizing); the
 * CUDA kernels' scratch, taken from the device's allocator, is taken and given back on
 * meta as the kernels do (cuda_workspace.h). Transfers move nothing; a read back gives
 * zeros. */
#include "meta_backend.h"
#include "../../runtime/backend.h"
#include "../../runtime/meta.h"
#include "../cpu/cpu_backend.h"
#include "../cpu/cpu_kernels.h"
#include "../cuda/cuda_workspace.h"

#include <string.h>

/* Whether the modelled backend is the CPU's (sim, cpu): its temporaries are mirrored
 * and its host scratch noted. */
static int models_cpu(void)
{
    const kiln_backend *b = kiln_meta_modelled_backend();
    return b && strcmp(b->name, "cpu") == 0;
}

/* Whether it is CUDA's: its kernels' scratch and cuBLAS's workspace are taken on meta.
 * (The casts CUDA's kernels make of operands in another dtype are not modelled.) */
static int models_cuda(void)
{
    const kiln_backend *b = kiln_meta_modelled_backend();
    return b && strcmp(b->name, "cuda") == 0;
}

/* ---- CUDA: scratch from the device's allocator, on meta ---- */

static kiln_device *meta_dev(void) { return kiln_device_meta(); }

/* Blocks taken in order and given back in reverse, as the kernel does. */
static kiln_status cuda_scratch_pair(size_t a, size_t b)
{
    kiln_device *m = meta_dev();
    void *pa = NULL, *pb = NULL;
    kiln_status st = a ? kiln_device_scratch_alloc(m, a, 0, &pa) : KILN_OK;
    if (!st && b) st = kiln_device_scratch_alloc(m, b, 0, &pb);
    if (pb) kiln_device_scratch_free(m, pb);
    if (pa) kiln_device_scratch_free(m, pa);
    return st;
}

/* cuBLAS's workspace: held from the first op of a context (and again after a release)
 * where it fits without evicting; the Hopper size first, then the older one. */
static void *blas_ws;
static size_t blas_ws_size;

static void cuda_blas_workspace(void)
{
    if (blas_ws) return;
    kiln_device *m = meta_dev();
    if (kiln_device_scratch_alloc(m, KILN_CUDA_BLAS_WORKSPACE_MAX, KILN_SCRATCH_NO_EVICT, &blas_ws) == KILN_OK)
        blas_ws_size = KILN_CUDA_BLAS_WORKSPACE_MAX;
    else if (kiln_device_scratch_alloc(m, KILN_CUDA_BLAS_WORKSPACE_MIN, KILN_SCRATCH_NO_EVICT, &blas_ws) == KILN_OK)
        blas_ws_size = KILN_CUDA_BLAS_WORKSPACE_MIN;
    else blas_ws = NULL;
}

static uint64_t meta_workspace_bytes(kiln_device *dev)
{
    (void)dev;
    return blas_ws ? blas_ws_size : 0;
}

static void meta_workspace_release(kiln_device *dev)
{
    (void)dev;
    if (blas_ws) kiln_device_scratch_free(meta_dev(), blas_ws);
    blas_ws = NULL;
    blas_ws_size = 0;
}

/* Every op of a CUDA context starts it (and so its cuBLAS workspace). */
static void cuda_op(void)
{
    if (models_cuda()) cuda_blas_workspace();
}

/* The most a convolution's cuDNN workspace can take: the cap, or what fits without
 * evicting where that is less (the kernel takes nothing that does not fit). Taken and
 * given back. */
static kiln_status cuda_conv_workspace(const kiln_tensor *x, const kiln_tensor *out)
{
    kiln_device *m = meta_dev();
    size_t cap = kiln_cuda_conv_workspace_cap((size_t)kiln_tensor_numel(x) * 4, (size_t)kiln_tensor_numel(out) * 4);
    kiln_mem_stats s = kiln_device_stats(m);
    size_t n = cap;
    if (s.budget) {
        const uint64_t grain = 2u << 20;
        uint64_t room = s.budget > s.reserved ? (s.budget - s.reserved) / grain * grain : 0;
        if (s.largest_free > room) room = s.largest_free;
        if (room < n) n = (size_t)room;
    }
    void *p = NULL;
    if (n && kiln_device_scratch_alloc(m, n, KILN_SCRATCH_NO_EVICT, &p) == KILN_OK) kiln_device_scratch_free(m, p);
    return KILN_OK;
}

/* ---- CPU: the host scratch of an op at its bound ---- */

/* The weight dtype the CPU's kernels receive (wop_get): fp8 as f16, block types as
 * they are for linear, other non-float types as f32. */
static kiln_dtype cpu_weight_dtype(kiln_dtype dt, int lowbit_ok)
{
    if (dt == KILN_F32 || dt == KILN_F16 || dt == KILN_BF16) return dt;
    if (dt == KILN_F8_E4M3FN || dt == KILN_F8_E5M2) return KILN_F16;
    if (lowbit_ok && kiln_dtype_is_blocked(dt)) return dt;
    return KILN_F32;
}

static void note_scratch(size_t n)
{
    if (models_cpu()) kiln_meta_note_scratch(n);
}

static int is_lowbit(kiln_dtype dt)
{
    return dt == KILN_F8_E4M3FN || dt == KILN_F8_E5M2 || kiln_dtype_is_blocked(dt);
}

static kiln_status tmp_like(const kiln_tensor *t, kiln_dtype dt, kiln_tensor **tmp)
{
    return kiln_tensor_new(t->storage->device, dt, t->ndim, t->shape, tmp);
}

/* The CPU backend's f32_data / out_data: an f32 copy unless t is contiguous f32. */
static kiln_status tmp_f32(const kiln_tensor *t, kiln_tensor **tmp)
{
    *tmp = NULL;
    if (!t || (t->dtype == KILN_F32 && kiln_tensor_is_contiguous(t))) return KILN_OK;
    return tmp_like(t, KILN_F32, tmp);
}

/* The CPU backend's w_data: weights stay as stored when contiguous f32/f16/bf16 (or
 * low-bit where the kernel decodes them), fp8 becomes an f16 copy, the rest f32. */
static kiln_status tmp_weight(const kiln_tensor *w, int lowbit_ok, kiln_tensor **tmp)
{
    *tmp = NULL;
    int contig = kiln_tensor_is_contiguous(w);
    if (contig && (w->dtype == KILN_F32 || w->dtype == KILN_F16 || w->dtype == KILN_BF16 ||
                   (lowbit_ok && is_lowbit(w->dtype))))
        return KILN_OK;
    if (contig && (w->dtype == KILN_F8_E4M3FN || w->dtype == KILN_F8_E5M2)) return tmp_like(w, KILN_F16, tmp);
    return tmp_like(w, KILN_F32, tmp);
}

enum { MAX_IN = 4 };

/* Takes the temporaries of an op with inputs in[0..n) (in[wi] a weight, wi < 0: none;
 * NULL inputs skipped) and output out, in the CPU backend's order, then frees them as
 * it does: the output's staging first, then the inputs'. */
static kiln_status mirror(kiln_tensor *out, const kiln_tensor *const *in, int n, int wi, int lowbit_ok)
{
    if (!models_cpu()) return KILN_OK;
    kiln_tensor *tmp[MAX_IN] = {0}, *to = NULL;
    kiln_status st = KILN_OK;
    for (int i = 0; i < n && !st; i++)
        if (in[i]) st = i == wi ? tmp_weight(in[i], lowbit_ok, &tmp[i]) : tmp_f32(in[i], &tmp[i]);
    if (!st && out) st = tmp_f32(out, &to);
    kiln_tensor_free(to);
    for (int i = 0; i < n; i++) kiln_tensor_free(tmp[i]);
    return st;
}

static int meta_supports(kiln_op op, kiln_dtype dt)
{
    (void)dt;
    return op >= 0 && op < KILN_OP_COUNT;
}

static kiln_status meta_copy(kiln_tensor *dst, const kiln_tensor *src) { (void)dst; (void)src; return KILN_OK; }
static kiln_status meta_fill(kiln_tensor *t, double v) { (void)t; (void)v; return KILN_OK; }

static kiln_status meta_binary(kiln_binop op, kiln_tensor *out, const kiln_tensor *a, const kiln_tensor *b,
                               double s, int swap)
{
    (void)op; (void)out; (void)a; (void)b; (void)s; (void)swap;
    cuda_op();
    return KILN_OK;
}

static kiln_status meta_unary(kiln_unop op, kiln_tensor *out, const kiln_tensor *a, double p0, double p1)
{
    (void)op; (void)out; (void)a; (void)p0; (void)p1;
    cuda_op();
    return KILN_OK;
}

/* The CPU reduction copies a strided or non-f32 input, and stages a non-f32 output. */
static kiln_status meta_reduce(kiln_redop op, kiln_tensor *out, const kiln_tensor *a, int dim, int unbiased)
{
    (void)op; (void)unbiased;
    if (models_cuda()) {
        cuda_op();
        int64_t outer = 1, len = 1, inner = 1;
        if (dim < 0) len = kiln_tensor_numel(a);
        else {
            for (int i = 0; i < dim; i++) outer *= a->shape[i];
            len = a->shape[dim];
            for (int i = dim + 1; i < a->ndim; i++) inner *= a->shape[i];
        }
        if (inner > 1 || outer * inner == 0) return KILN_OK;
        return cuda_scratch_pair(kiln_cuda_reduce_part_bytes(outer, len, KILN_CUDA_SM_MODEL_MAX), 0);
    }
    if (!models_cpu()) return KILN_OK;
    kiln_tensor *x = NULL, *y = NULL;
    kiln_status st = tmp_f32(a, &x);
    if (!st && out->dtype != KILN_F32) st = tmp_like(out, KILN_F32, &y);
    kiln_tensor_free(y);
    kiln_tensor_free(x);
    return st;
}

static kiln_status meta_matmul(kiln_tensor *out, const kiln_tensor *a, const kiln_tensor *b)
{
    cuda_op();
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1];
    note_scratch(kiln_cpu_gemm_scratch_bound(M, N, K, KILN_F32, 1));
    const kiln_tensor *in[] = {a, b};
    return mirror(out, in, 2, -1, 0);
}

/* A cache of that key and size for w's storage, as the CPU backend keeps it */
static void derived_cache(const kiln_tensor *w, size_t bytes, const uint64_t key[4])
{
    kiln_storage *p = kiln_storage_derived_get(w->storage, key);
    if (!p && kiln_storage_derived_new(w->storage, bytes, &p) == KILN_OK) kiln_storage_derived_put(w->storage, key, p);
    if (p) kiln_storage_release(p);
}

/* The CPU's caches of a weight (precision int8's packed panels, bf16's pair slivers),
 * taken where the CPU backend takes them (the same plans: rows, precision, memory mode,
 * where the weight lives; refused where they do not fit without evicting, and given
 * back first when an allocation does not fit, as there) and kept with its storage. */
static void weight_cache(const kiln_tensor *w, int64_t M, int linear)
{
    uint64_t key[4];
    size_t bytes = 0;
    if (models_cpu()) {
        bytes = kiln_cpu_int8_cache_plan(w, M, key);
        if (!bytes && linear) bytes = kiln_cpu_bf16_cache_plan(w, M, key);
    }
    if (bytes) derived_cache(w, bytes, key);
}

static kiln_status meta_linear(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *bias)
{
    cuda_op();
    int64_t K = x->shape[x->ndim - 1], N = w->shape[0], M = kiln_tensor_numel(x) / (K ? K : 1);
    note_scratch(kiln_cpu_gemm_scratch_bound(M, N, K, cpu_weight_dtype(w->dtype, 1), 0));
    if (K > 0 && N > 0) weight_cache(w, M, 1);
    const kiln_tensor *in[] = {x, w, bias};
    return mirror(out, in, 3, 1, 1);
}

/* Claims conv2d_residual as the CPU does: the residual is added inside the convolution
 * (its f32 copy, where one is made, taken with the other inputs'), no sum tensor. */
static kiln_status meta_conv2d(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                               const kiln_tensor *bias, const kiln_conv_opts *o)
{
    cuda_op();
    if (models_cuda()) return cuda_conv_workspace(x, out);
    if (models_cpu()) {
        kiln_conv2d_params p = {
            .n = x->shape[0], .c = x->shape[1], .h = x->shape[2], .w = x->shape[3],
            .k = w->shape[0], .r = w->shape[2], .s = w->shape[3],
            .stride_h = o->stride[0], .stride_w = o->stride[1], .pad_h = o->padding[0], .pad_w = o->padding[1],
            .dil_h = o->dilation[0], .dil_w = o->dilation[1], .groups = o->groups,
        };
        note_scratch(kiln_cpu_conv2d_scratch_bound(&p, cpu_weight_dtype(w->dtype, 0)));
        if (p.r == 1 && p.s == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_h == 0 && p.pad_w == 0 &&
            p.groups == 1 && p.c > 0 && p.k > 0)
            weight_cache(w, p.h * p.w, 0);
        uint64_t key[4];
        size_t bytes = kiln_cpu_conv2d_cache_plan(w, &p, key);
        if (bytes) derived_cache(w, bytes, key);
    }
    const kiln_tensor *in[] = {x, w, bias, o->residual};
    return mirror(out, in, 4, 1, 0);
}

/* Present in the table only where the modelled backend has the entry; the CPU's
 * declines shapes it does not fuse (the op then upsamples into a tensor of its own). */
static kiln_status meta_conv2d_up2(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                                   const kiln_tensor *bias)
{
    if (models_cpu() && !kiln_cpu_conv2d_up2_fuses(x->shape[1], x->shape[2], x->shape[3], w->shape[0]))
        return KILN_ERR_UNSUPPORTED;
    note_scratch(kiln_cpu_conv2d_up2_scratch_bound(x->shape[0], x->shape[1], x->shape[2], x->shape[3], w->shape[0],
                                                   cpu_weight_dtype(w->dtype, 0)));
    const kiln_tensor *in[] = {x, w, bias};
    return mirror(out, in, 3, 1, 0);
}

static kiln_status meta_group_norm(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                                   const kiln_tensor *b, int64_t groups, double eps, int silu)
{
    (void)eps; (void)silu;
    if (models_cuda()) {
        cuda_op();
        int64_t total = kiln_tensor_numel(x), N = x->shape[0], C = x->shape[1];
        if (total == 0 || groups <= 0 || C % groups) return KILN_OK;
        int64_t rows = N * groups, len = total / rows;
        return cuda_scratch_pair(kiln_cuda_stats_bytes(rows), kiln_cuda_stats_part_bytes(rows, len, KILN_CUDA_SM_MODEL_MAX));
    }
    const kiln_tensor *in[] = {x, w, b};
    return mirror(out, in, 3, -1, 0);
}

static kiln_status meta_layer_norm(kiln_tensor *out, const kiln_tensor *x, const kiln_tensor *w,
                                   const kiln_tensor *b, double eps)
{
    (void)eps;
    if (models_cuda()) {
        cuda_op();
        int64_t total = kiln_tensor_numel(x), D = x->shape[x->ndim - 1];
        if (total == 0 || D == 0) return KILN_OK;
        int64_t rows = total / D;
        return cuda_scratch_pair(kiln_cuda_stats_bytes(rows), kiln_cuda_stats_part_bytes(rows, D, KILN_CUDA_SM_MODEL_MAX));
    }
    const kiln_tensor *in[] = {x, w, b};
    return mirror(out, in, 3, -1, 0);
}

static kiln_status meta_softmax(kiln_tensor *out, const kiln_tensor *x, int dim)
{
    (void)dim;
    const kiln_tensor *in[] = {x};
    return mirror(out, in, 1, -1, 0);
}

static kiln_status meta_attention(kiln_tensor *out, const kiln_tensor *q, const kiln_tensor *k,
                                  const kiln_tensor *v, double scale, int causal)
{
    (void)scale; (void)causal;
    cuda_op();
    if (q->ndim == 4 && k->ndim == 4 && v->ndim == 4)
        note_scratch(kiln_cpu_attention_scratch_bound(q->shape[0] * q->shape[1], q->shape[2], k->shape[2], q->shape[3],
                                                      v->shape[3]));
    const kiln_tensor *in[] = {q, k, v};
    return mirror(out, in, 3, -1, 0);
}

static kiln_status meta_geglu(kiln_tensor *out, const kiln_tensor *x)
{
    const kiln_tensor *in[] = {x};
    return mirror(out, in, 1, -1, 0);
}

static kiln_status meta_resample(kiln_resample mode, kiln_tensor *out, const kiln_tensor *x)
{
    (void)mode;
    const kiln_tensor *in[] = {x};
    return mirror(out, in, 1, -1, 0);
}

static kiln_status meta_pad2d(kiln_tensor *out, const kiln_tensor *x, const int64_t *pads, int mode, double value)
{
    (void)pads; (void)mode; (void)value;
    const kiln_tensor *in[] = {x};
    return mirror(out, in, 1, -1, 0);
}

/* Always present, whatever the modelled device: the runtime then never reads or
 * writes meta memory itself (kiln_device_host_memory answers for the modelled one). */
static kiln_status meta_to_device(void *dst, const void *src, size_t n)
{
    (void)dst; (void)src; (void)n;
    return KILN_OK;
}

static kiln_status meta_to_host(void *dst, const void *src, size_t n)
{
    (void)src;
    memset(dst, 0, n);
    return KILN_OK;
}

static void meta_register_devices(void);

static const kiln_backend meta_backend = {
    .name = "meta",
    .supports = meta_supports,
    .copy = meta_copy,
    .fill = meta_fill,
    .binary = meta_binary,
    .unary = meta_unary,
    .reduce = meta_reduce,
    .matmul = meta_matmul,
    .linear = meta_linear,
    .conv2d = meta_conv2d,
    .conv2d_residual = 1,
    .conv2d_up2 = meta_conv2d_up2,
    .group_norm = meta_group_norm,
    .group_norm_in_place = 1,
    .layer_norm = meta_layer_norm,
    .softmax = meta_softmax,
    .attention = meta_attention,
    .geglu = meta_geglu,
    .resample = meta_resample,
    .pad2d = meta_pad2d,
    .workspace_bytes = meta_workspace_bytes,
    .workspace_release = meta_workspace_release,
    .to_device = meta_to_device,
    .to_host = meta_to_host,
    .register_devices = meta_register_devices,
};

/* The meta device (listed last: backends.c hands meta in last) with its hooks, so the
 * device and tensor layers need not know meta.c: the dry run's stage watermarks after
 * each allocation, and zero host memory for a copy off meta. */
static void meta_register_devices(void)
{
    kiln_device *d = kiln_device_register(KILN_DEV_META, 0, "meta", kiln_meta_raw_memory(), 0, &meta_backend);
    if (!d) return;
    d->storage_added = kiln_meta_note;
    d->host_zeros = kiln_meta_host_storage;
}

void kiln_meta_backend_register(void) { kiln_backend_register(&meta_backend); }
