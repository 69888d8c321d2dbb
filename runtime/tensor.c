/* tensor.c - tensor headers and views over storages: reshape, permute, narrow,
 * expand, squeeze; contiguous copies and device/dtype transfers. Views never copy;
 * element data moves only through the device backend's copy or an explicit transfer.
 * layer 4 of the memory core: uses device, backend_table, dtype, convert; never calls meta, trace.
 * The meta device is met as a device type and its hooks (device.h), not through meta.c. */
#define _POSIX_C_SOURCE 200809L
#include "tensor.h"
#include "backend_table.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int64_t kiln_tensor_numel(const kiln_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

size_t kiln_tensor_nbytes(const kiln_tensor *t)
{
    return kiln_dtype_nbytes(t->dtype, kiln_tensor_numel(t));
}

int kiln_tensor_is_contiguous(const kiln_tensor *t)
{
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != expect) return 0;
        expect *= t->shape[i];
    }
    return 1;
}

int kiln_shape_equal(const kiln_tensor *a, const kiln_tensor *b)
{
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

int kiln_tensor_coalesce(int nops, const kiln_tensor *const *ops, int64_t *shape,
                         int64_t (*stride)[KILN_MAX_DIMS])
{
    const kiln_tensor *o = ops[0];
    int n = 0;
    for (int d = 0; d < o->ndim; d++) {
        if (o->shape[d] == 1) continue;
        shape[n] = o->shape[d];
        for (int k = 0; k < nops; k++) stride[k][n] = ops[k]->stride[d];
        n++;
    }
    if (n == 0) {
        shape[0] = 1;
        for (int k = 0; k < nops; k++) stride[k][0] = 1;
        return 1;
    }
    int m = 0;
    for (int d = 1; d < n; d++) {
        int mergeable = 1;
        for (int k = 0; k < nops; k++) {
            int64_t span; /* an empty tensor's strides may pass int64 (contiguous_strides) */
            if (__builtin_mul_overflow(stride[k][d], shape[d], &span) || stride[k][m] != span) { mergeable = 0; break; }
        }
        int64_t merged;
        if (mergeable && __builtin_mul_overflow(shape[m], shape[d], &merged)) mergeable = 0;
        if (mergeable) {
            shape[m] = merged;
            for (int k = 0; k < nops; k++) stride[k][m] = stride[k][d];
        } else {
            m++;
            shape[m] = shape[d];
            for (int k = 0; k < nops; k++) stride[k][m] = stride[k][d];
        }
    }
    return m + 1;
}

const char *kiln_shape_str(const kiln_tensor *t, char *buf, size_t n)
{
    size_t used = 0;
    used += (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < t->ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, i ? ",%lld" : "%lld", (long long)t->shape[i]);
    if (used < n) snprintf(buf + used, n - used, "]");
    return buf;
}

/* A dimension of 0 makes a tensor empty whatever the others are, so their product may
 * pass int64 (a file's header can say so): the strides saturate, never used to address
 * anything in an empty tensor. */
static void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride)
{
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        stride[i] = s;
        if (__builtin_mul_overflow(s, shape[i] > 0 ? shape[i] : 1, &s)) s = INT64_MAX;
    }
}

static kiln_status check_shape(int ndim, const int64_t *shape, kiln_dtype dt, size_t *nbytes)
{
    if (ndim < 0 || ndim > KILN_MAX_DIMS)
        return kiln_error(KILN_ERR_ARG, "tensor: %d dimensions (at most %d)", ndim, KILN_MAX_DIMS);
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return kiln_error(KILN_ERR_ARG, "tensor: negative size %lld in dim %d", (long long)shape[i], i + 1);
        if (shape[i] && n > (UINT64_MAX >> 4) / (uint64_t)shape[i])
            return kiln_error(KILN_ERR_ARG, "tensor: shape too large");
        n *= (uint64_t)shape[i];
    }
    if (n > ((uint64_t)1 << 40)) return kiln_error(KILN_ERR_ARG, "tensor: shape too large (%llu elements)", (unsigned long long)n);
    int blk = kiln_dtype_block(dt);
    /* a block type packs runs of the last dimension: rows must hold whole blocks */
    if (blk > 1 && (ndim == 0 || shape[ndim - 1] % blk))
        return kiln_error(KILN_ERR_ARG, "tensor: %s needs the last dimension a multiple of %d (got %lld)",
                          kiln_dtype_name(dt), blk, ndim ? (long long)shape[ndim - 1] : 1LL);
    *nbytes = kiln_dtype_nbytes(dt, (int64_t)n);
    return KILN_OK;
}

/* Tensor headers alive in the process: the test runners' invariant check after each
 * test (a header no one freed is a leak even when its bytes are a mapping's). */
static atomic_long live_headers;

long kiln_tensor_live_count(void) { return atomic_load(&live_headers); }

kiln_tensor *kiln_tensor_from_storage(kiln_storage *s, size_t offset, kiln_dtype dt, int ndim,
                                      const int64_t *shape, const int64_t *stride)
{
    kiln_tensor *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    atomic_fetch_add(&live_headers, 1);
    kiln_storage_retain(s);
    t->storage = s;
    t->offset = offset;
    t->dtype = dt;
    t->ndim = ndim;
    memcpy(t->shape, shape, sizeof(int64_t) * (size_t)ndim);
    if (stride) memcpy(t->stride, stride, sizeof(int64_t) * (size_t)ndim);
    else contiguous_strides(ndim, shape, t->stride);
    return t;
}

kiln_status kiln_tensor_new(kiln_device *dev, kiln_dtype dt, int ndim, const int64_t *shape, kiln_tensor **out)
{
    *out = NULL;
    if ((unsigned)dt >= KILN_DTYPE_COUNT) return kiln_error(KILN_ERR_ARG, "tensor: bad dtype %d", (int)dt);
    size_t nbytes = 0;
    kiln_status st = check_shape(ndim, shape, dt, &nbytes);
    if (st) return st;
    kiln_storage *s;
    st = kiln_storage_new(dev ? dev : kiln_device_cpu(), nbytes, &s);
    if (st) return st;
    *out = kiln_tensor_from_storage(s, 0, dt, ndim, shape, NULL);
    kiln_storage_release(s);
    if (!*out) return kiln_error(KILN_ERR_OOM, "host out of memory for a tensor header");
    return KILN_OK;
}

kiln_status kiln_tensor_zeros(kiln_device *dev, kiln_dtype dt, int ndim, const int64_t *shape, kiln_tensor **out)
{
    kiln_status st = kiln_tensor_new(dev, dt, ndim, shape, out);
    if (st) return st;
    st = kiln_tensor_fill(*out, 0);
    if (st) { kiln_tensor_free(*out); *out = NULL; }
    return st;
}

void kiln_tensor_free(kiln_tensor *t)
{
    if (!t) return;
    atomic_fetch_sub(&live_headers, 1);
    kiln_storage_release(t->storage);
    free(t);
}

kiln_tensor *kiln_tensor_view_of(const kiln_tensor *t)
{
    return kiln_tensor_from_storage(t->storage, t->offset, t->dtype, t->ndim, t->shape, t->stride);
}

static kiln_status view_result(kiln_tensor *v, kiln_tensor **out)
{
    *out = v;
    return v ? KILN_OK : kiln_error(KILN_ERR_OOM, "host out of memory for a view");
}

/* Strides for a reshape without copy (PyTorch's computeStride): NULL stride result
 * when the memory layout does not allow a view. */
static int view_strides(const kiln_tensor *t, int ndim, const int64_t *shape, int64_t *stride)
{
    int64_t numel = kiln_tensor_numel(t);
    if (numel == 0) { contiguous_strides(ndim, shape, stride); return 1; }
    int view_d = ndim - 1;
    int64_t chunk_base_stride = t->ndim ? t->stride[t->ndim - 1] : 1;
    int64_t tensor_numel = 1, view_numel = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        tensor_numel *= t->shape[d];
        if (d == 0 || (t->shape[d - 1] != 1 && t->stride[d - 1] != tensor_numel * chunk_base_stride)) {
            while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
                stride[view_d] = view_numel * chunk_base_stride;
                view_numel *= shape[view_d];
                view_d--;
            }
            if (view_numel != tensor_numel) return 0;
            if (d > 0) {
                chunk_base_stride = t->stride[d - 1];
                tensor_numel = 1;
                view_numel = 1;
            }
        }
    }
    return view_d == -1;
}

kiln_status kiln_tensor_reshape(const kiln_tensor *t, int ndim, const int64_t *shape_in, kiln_tensor **out)
{
    *out = NULL;
    if (ndim < 0 || ndim > KILN_MAX_DIMS)
        return kiln_error(KILN_ERR_ARG, "reshape: %d dimensions (at most %d)", ndim, KILN_MAX_DIMS);
    int64_t shape[KILN_MAX_DIMS], known = 1, numel = kiln_tensor_numel(t);
    int infer = -1;
    for (int i = 0; i < ndim; i++) {
        shape[i] = shape_in[i];
        if (shape[i] == -1) {
            if (infer >= 0) return kiln_error(KILN_ERR_ARG, "reshape: only one dimension can be -1");
            infer = i;
        } else if (shape[i] < 0) {
            return kiln_error(KILN_ERR_ARG, "reshape: invalid size %lld", (long long)shape[i]);
        } else {
            known *= shape[i];
        }
    }
    if (infer >= 0) {
        if (known == 0 || numel % known)
            return kiln_error(KILN_ERR_ARG, "reshape: cannot infer dimension %d for %lld elements", infer + 1, (long long)numel);
        shape[infer] = numel / known;
        known *= shape[infer];
    }
    char b1[128];
    if (known != numel)
        return kiln_error(KILN_ERR_ARG, "reshape: shape %s has %lld elements, asked for %lld",
                          kiln_shape_str(t, b1, sizeof b1), (long long)numel, (long long)known);
    int blk = kiln_dtype_block(t->dtype);
    if (blk > 1 && (ndim == 0 || shape[ndim - 1] % blk || !kiln_tensor_is_contiguous(t)))
        return kiln_error(KILN_ERR_UNSUPPORTED, "reshape: a %s tensor keeps whole blocks of %d in its last dimension",
                          kiln_dtype_name(t->dtype), blk);
    int64_t stride[KILN_MAX_DIMS];
    if (view_strides(t, ndim, shape, stride))
        return view_result(kiln_tensor_from_storage(t->storage, t->offset, t->dtype, ndim, shape, stride), out);
    kiln_tensor *c;
    kiln_status st = kiln_tensor_contiguous(t, &c);
    if (st) return st;
    kiln_tensor *v = kiln_tensor_from_storage(c->storage, c->offset, c->dtype, ndim, shape, NULL);
    kiln_tensor_free(c);
    return view_result(v, out);
}

static kiln_status check_dim(const kiln_tensor *t, int dim, const char *op)
{
    if (dim < 0 || dim >= t->ndim)
        return kiln_error(KILN_ERR_ARG, "%s: dimension %d out of range for a %d-d tensor", op, dim + 1, t->ndim);
    return KILN_OK;
}

kiln_status kiln_tensor_permute(const kiln_tensor *t, const int *perm, kiln_tensor **out)
{
    *out = NULL;
    int seen[KILN_MAX_DIMS] = {0};
    int64_t shape[KILN_MAX_DIMS], stride[KILN_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++) {
        if (perm[i] < 0 || perm[i] >= t->ndim || seen[perm[i]])
            return kiln_error(KILN_ERR_ARG, "permute: not a permutation of %d dimensions", t->ndim);
        seen[perm[i]] = 1;
        shape[i] = t->shape[perm[i]];
        stride[i] = t->stride[perm[i]];
    }
    return view_result(kiln_tensor_from_storage(t->storage, t->offset, t->dtype, t->ndim, shape, stride), out);
}

kiln_status kiln_tensor_transpose(const kiln_tensor *t, int d0, int d1, kiln_tensor **out)
{
    *out = NULL;
    kiln_status st;
    if ((st = check_dim(t, d0, "transpose")) || (st = check_dim(t, d1, "transpose"))) return st;
    int perm[KILN_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++) perm[i] = i;
    perm[d0] = d1;
    perm[d1] = d0;
    return kiln_tensor_permute(t, perm, out);
}

kiln_status kiln_tensor_narrow(const kiln_tensor *t, int dim, int64_t start, int64_t len, kiln_tensor **out)
{
    *out = NULL;
    kiln_status st = check_dim(t, dim, "narrow");
    if (st) return st;
    if (start < 0 || len < 0 || start + len > t->shape[dim])
        return kiln_error(KILN_ERR_ARG, "narrow: start %lld length %lld out of range for dimension %d of size %lld",
                          (long long)start + 1, (long long)len, dim + 1, (long long)t->shape[dim]);
    int blk = kiln_dtype_block(t->dtype);
    if (blk > 1 && (dim == t->ndim - 1 || (start * t->stride[dim]) % blk))
        return kiln_error(KILN_ERR_UNSUPPORTED, "narrow: a %s tensor narrows only in whole rows of blocks",
                          kiln_dtype_name(t->dtype));
    kiln_tensor *v = kiln_tensor_view_of(t);
    if (!v) return view_result(NULL, out);
    v->offset += kiln_dtype_nbytes(t->dtype, start * t->stride[dim]);
    v->shape[dim] = len;
    *out = v;
    return KILN_OK;
}

kiln_status kiln_tensor_expand(const kiln_tensor *t, int ndim, const int64_t *shape, kiln_tensor **out)
{
    *out = NULL;
    if (ndim < t->ndim || ndim > KILN_MAX_DIMS)
        return kiln_error(KILN_ERR_ARG, "expand: cannot expand a %d-d tensor to %d dimensions", t->ndim, ndim);
    int64_t nshape[KILN_MAX_DIMS], nstride[KILN_MAX_DIMS];
    int off = ndim - t->ndim;
    for (int i = 0; i < ndim; i++) {
        int64_t want = shape[i];
        if (i < off) {
            if (want < 0) return kiln_error(KILN_ERR_ARG, "expand: size -1 not allowed in a new leading dimension");
            nshape[i] = want;
            nstride[i] = 0;
            continue;
        }
        int64_t have = t->shape[i - off];
        if (want == -1) want = have;
        if (have == want) { nshape[i] = have; nstride[i] = t->stride[i - off]; }
        else if (have == 1) { nshape[i] = want; nstride[i] = 0; }
        else {
            char b[128];
            return kiln_error(KILN_ERR_ARG, "expand: size %lld of dimension %d of %s cannot become %lld",
                              (long long)have, i - off + 1, kiln_shape_str(t, b, sizeof b), (long long)want);
        }
    }
    return view_result(kiln_tensor_from_storage(t->storage, t->offset, t->dtype, ndim, nshape, nstride), out);
}

kiln_status kiln_tensor_squeeze(const kiln_tensor *t, int dim, kiln_tensor **out)
{
    *out = NULL;
    int64_t shape[KILN_MAX_DIMS], stride[KILN_MAX_DIMS];
    int n = 0;
    if (dim >= 0) {
        kiln_status st = check_dim(t, dim, "squeeze");
        if (st) return st;
    }
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 1 && (dim < 0 || dim == i)) continue;
        shape[n] = t->shape[i];
        stride[n++] = t->stride[i];
    }
    return view_result(kiln_tensor_from_storage(t->storage, t->offset, t->dtype, n, shape, stride), out);
}

kiln_status kiln_tensor_unsqueeze(const kiln_tensor *t, int dim, kiln_tensor **out)
{
    *out = NULL;
    if (dim < 0 || dim > t->ndim || t->ndim >= KILN_MAX_DIMS)
        return kiln_error(KILN_ERR_ARG, "unsqueeze: dimension %d out of range for a %d-d tensor", dim + 1, t->ndim);
    int64_t shape[KILN_MAX_DIMS], stride[KILN_MAX_DIMS];
    for (int i = 0, j = 0; i <= t->ndim; i++) {
        if (i == dim) {
            shape[i] = 1;
            stride[i] = j < t->ndim ? t->stride[j] * t->shape[j] : 1;
        } else {
            shape[i] = t->shape[j];
            stride[i] = t->stride[j];
            j++;
        }
    }
    return view_result(kiln_tensor_from_storage(t->storage, t->offset, t->dtype, t->ndim + 1, shape, stride), out);
}

kiln_status kiln_tensor_copy(kiln_tensor *dst, const kiln_tensor *src)
{
    if (dst->storage->device != src->storage->device)
        return kiln_error(KILN_ERR_ARG, "copy: tensors on different devices (%s and %s); use :to(device)",
                          dst->storage->device->name, src->storage->device->name);
    kiln_storage_drop_derived(dst->storage); /* a kernel's cached form of the old bytes */
    kiln_tensor *e = NULL;
    kiln_status st = kiln_tensor_expand(src, dst->ndim, dst->shape, &e);
    if (st) {
        char b1[128], b2[128];
        return kiln_error(KILN_ERR_ARG, "copy: source %s does not broadcast to destination %s",
                          kiln_shape_str(src, b1, sizeof b1), kiln_shape_str(dst, b2, sizeof b2));
    }
    const kiln_backend *be = dst->storage->device->backend;
    st = be->copy(dst, e);
    kiln_tensor_free(e);
    return st;
}

kiln_status kiln_tensor_fill(kiln_tensor *t, double v)
{
    kiln_storage_drop_derived(t->storage);
    if (kiln_dtype_is_blocked(t->dtype)) {
        /* all-zero blocks are zeros (scales of 0); other values would need quantizing */
        if (v != 0 || !kiln_tensor_is_contiguous(t))
            return kiln_error(KILN_ERR_UNSUPPORTED, "fill: a %s tensor fills only with 0 (convert from f32 instead)",
                              kiln_dtype_name(t->dtype));
        int64_t n = (int64_t)kiln_tensor_nbytes(t);
        kiln_tensor *b = kiln_tensor_from_storage(t->storage, t->offset, KILN_U8, 1, &n, NULL);
        if (!b) return kiln_error(KILN_ERR_OOM, "host out of memory for a view");
        kiln_status st = t->storage->device->backend->fill(b, 0);
        kiln_tensor_free(b);
        return st;
    }
    return t->storage->device->backend->fill(t, v);
}

kiln_status kiln_tensor_contiguous(const kiln_tensor *t, kiln_tensor **out)
{
    *out = NULL;
    if (kiln_tensor_is_contiguous(t)) return view_result(kiln_tensor_view_of(t), out);
    kiln_tensor *c;
    kiln_status st = kiln_tensor_new(t->storage->device, t->dtype, t->ndim, t->shape, &c);
    if (st) return st;
    st = kiln_tensor_copy(c, t);
    if (st) { kiln_tensor_free(c); return st; }
    *out = c;
    return KILN_OK;
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Moves bytes of a contiguous tensor between devices: host-memory devices (cpu,
 * sim) use memcpy; others use their backend's to_device/to_host. Counted per device. */
static kiln_status transfer(kiln_tensor *dst, const kiln_tensor *src)
{
    kiln_device *sd = src->storage->device, *dd = dst->storage->device;
    size_t n = kiln_tensor_nbytes(src);
    double t0 = now_seconds();
    kiln_status st = KILN_OK;
    if (dd->backend->to_device && !sd->backend->to_host)
        st = dd->backend->to_device(kiln_tensor_data(dst), kiln_tensor_data(src), n);
    else if (sd->backend->to_host && !dd->backend->to_device)
        st = sd->backend->to_host(kiln_tensor_data(dst), kiln_tensor_data(src), n);
    else if (!sd->backend->to_host && !dd->backend->to_device)
        memcpy(kiln_tensor_data(dst), kiln_tensor_data(src), n);
    else
        return kiln_error(KILN_ERR_UNSUPPORTED, "transfer %s -> %s: go through the cpu", sd->name, dd->name);
    double dt = now_seconds() - t0;
    if (dd->type != KILN_DEV_CPU) kiln_device_count_transfer(dd, 1, n, dt);
    else kiln_device_count_transfer(sd, 0, n, dt);
    return st;
}

static int is_meta(const kiln_device *d) { return d->type == KILN_DEV_META; }

/* A copy r that arrived on dev in the wire dtype becomes *out in dt (r consumed). */
static kiln_status arrived(kiln_tensor *r, kiln_device *dev, kiln_dtype wire, kiln_dtype dt, kiln_tensor **out)
{
    if (wire == dt) {
        *out = r;
        return KILN_OK;
    }
    kiln_status st = kiln_tensor_to(r, dev, dt, out);
    kiln_tensor_free(r);
    return st;
}

kiln_status kiln_tensor_to(const kiln_tensor *t, kiln_device *dev, kiln_dtype dt, kiln_tensor **out)
{
    *out = NULL;
    kiln_device *sd = t->storage->device;
    if (!dev) dev = sd;
    kiln_status st;
    if (dev == sd) {
        kiln_tensor *r;
        if ((st = kiln_tensor_new(dev, dt, t->ndim, t->shape, &r))) return st;
        if ((st = kiln_tensor_copy(r, t))) { kiln_tensor_free(r); return st; }
        *out = r;
        return KILN_OK;
    }
    /* Convert dtype on the side that is cheaper to hold: before sending when the
     * target is smaller, after arriving otherwise; the wire format is contiguous. */
    kiln_tensor *c = NULL;
    kiln_dtype wire = kiln_dtype_size(dt) <= kiln_dtype_size(t->dtype) ? dt : t->dtype;
    if (is_meta(dev) && !is_meta(sd)) {
        /* onto meta: nothing is read, so the sending side converts nothing; what the
         * device holds (the wire copy, then its conversion) is as for a real one */
        c = kiln_tensor_view_of(t);
        st = c ? KILN_OK : kiln_error(KILN_ERR_OOM, "host out of memory for a view");
    } else if (wire != t->dtype || !kiln_tensor_is_contiguous(t)) st = kiln_tensor_to(t, sd, wire, &c);
    else st = kiln_tensor_contiguous(t, &c);
    if (st) return st;
    kiln_tensor *r;
    if (is_meta(sd) && dev->type == KILN_DEV_CPU && sd->host_zeros) {
        /* off meta: host memory that reads as zeros and costs nothing until written, so
         * a dry run parks tiles and offloads weights without filling gigabytes */
        kiln_storage *hs = sd->host_zeros(kiln_dtype_nbytes(wire, kiln_tensor_numel(c)));
        r = hs ? kiln_tensor_from_storage(hs, 0, wire, c->ndim, c->shape, NULL) : NULL;
        kiln_storage_release(hs);
        kiln_tensor_free(c);
        if (!r) return kiln_error(KILN_ERR_OOM, "host out of memory for a copy off meta");
        kiln_device_count_transfer(sd, 0, kiln_tensor_nbytes(r), 0);
        return arrived(r, dev, wire, dt, out);
    }
    if ((st = kiln_tensor_new(dev, wire, c->ndim, c->shape, &r))) { kiln_tensor_free(c); return st; }
    if (is_meta(dev) && !is_meta(sd)) {
        kiln_device_count_transfer(dev, 1, kiln_tensor_nbytes(r), 0);
        st = KILN_OK;
    } else {
        st = transfer(r, c);
    }
    kiln_tensor_free(c);
    if (st) { kiln_tensor_free(r); return st; }
    return arrived(r, dev, wire, dt, out);
}
