/* model_patch.c - the patch lists (weight adapters: LoRA and its family) every copy of a
 * weight is built with: add / remove / count, and the build of a copy as the file plus
 * each patch's delta (adapter_delta.c has the arithmetic). The stores are model.c's. */
#define _GNU_SOURCE
#include "model_internal.h"
#include "mapped_read.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A patch: an adapter over views it owns, on rows [row0, row0 + rows) of dim 0
 * (rows 0: the whole tensor). Shared by the patch sets that hold it. */
typedef struct patch {
    int id;
    atomic_int refs;
    kiln_adapter a;
    kiln_tensor *own[KILN_AF_COUNT];
    int64_t row0, rows;
} patch;

/* The patches of a tensor, in the order added. Immutable once published, so a copy
 * thread builds from a retained set without holding the registry lock. */
struct patchset {
    atomic_int refs;
    int n;
    patch *p[];
};

/* ---- patches ---- */

static void patch_release(patch *p)
{
    if (!p || atomic_fetch_sub(&p->refs, 1) != 1) return;
    for (int f = 0; f < KILN_AF_COUNT; f++) kiln_tensor_free(p->own[f]);
    free(p);
}

patchset *kiln_patchset_retain(patchset *ps)
{
    if (ps) atomic_fetch_add(&ps->refs, 1);
    return ps;
}

void kiln_patchset_release(patchset *ps)
{
    if (!ps || atomic_fetch_sub(&ps->refs, 1) != 1) return;
    for (int i = 0; i < ps->n; i++) patch_release(ps->p[i]);
    free(ps);
}

/* A new set: old's patches without `drop`, plus `add` at the end (either may be NULL). */
static patchset *ps_edit(const patchset *old, const patch *drop, patch *add)
{
    int n = old ? old->n : 0;
    patchset *ps = malloc(sizeof *ps + sizeof(patch *) * (size_t)(n + 1));
    if (!ps) return NULL;
    atomic_init(&ps->refs, 1);
    ps->n = 0;
    for (int i = 0; i < n; i++) {
        if (old->p[i] == drop) continue;
        atomic_fetch_add(&old->p[i]->refs, 1);
        ps->p[ps->n++] = old->p[i];
    }
    if (add) {
        atomic_fetch_add(&add->refs, 1);
        ps->p[ps->n++] = add;
    }
    return ps;
}

/* kiln_patchset_build_into a block of rows at a time, for a copy in host memory whose
 * patches are all row by row (kiln_adapter_rows): the f32 rows stay in cache between
 * the conversion from the file, the deltas and the conversion to the copy's dtype.
 * KILN_ERR_UNSUPPORTED (nothing written) when a patch is not row by row. */
static kiln_status build_rows(kiln_tensor *dst, const kiln_tensor *mapped, const patchset *ps)
{
    enum { MAX_PATCHES = 16, BLOCK_FLOATS = 1 << 18 };
    if (ps->n > MAX_PATCHES || mapped->ndim < 1 || tensor_device(dst)->backend->to_device) return KILN_ERR_UNSUPPORTED;
    int64_t n = kiln_tensor_numel(dst), rows = mapped->shape[0];
    int64_t row = rows ? n / rows : 0;
    if (row <= 0) return KILN_ERR_UNSUPPORTED;
    kiln_adapter_rows *pr[MAX_PATCHES] = {0};
    kiln_status st = KILN_OK;
    char saved[512];
    kiln_status saved_st = kiln_last_status();
    snprintf(saved, sizeof saved, "%s", kiln_last_error());
    for (int i = 0; i < ps->n && !st; i++)
        st = kiln_adapter_rows_begin(&ps->p[i]->a, ps->p[i]->rows > 0 ? ps->p[i]->rows : rows, row, &pr[i]);
    float *w = NULL;
    int64_t block = BLOCK_FLOATS / row > 0 ? BLOCK_FLOATS / row : 1;
    if (!st) st = kiln_device_scratch_alloc(kiln_device_cpu(), (size_t)(block * row) * sizeof(float), 0, (void **)&w);
    if (st == KILN_ERR_UNSUPPORTED) kiln_error(saved_st, "%s", saved); /* not an error: the caller goes the other way */
    for (int64_t r0 = 0; !st && r0 < rows; r0 += block) {
        int64_t nr = rows - r0 < block ? rows - r0 : block;
        st = kiln_mapped_read(kiln_model_mapped_path(mapped), w, KILN_F32,
                              (const char *)kiln_tensor_data(mapped) + kiln_dtype_nbytes(mapped->dtype, r0 * row),
                              mapped->dtype, (size_t)(nr * row));
        if (st) break;
        for (int i = 0; i < ps->n; i++) {
            const patch *p = ps->p[i];
            int64_t lo = r0, hi = r0 + nr; /* the rows of this block the patch covers */
            if (p->rows > 0) {
                if (lo < p->row0) lo = p->row0;
                if (hi > p->row0 + p->rows) hi = p->row0 + p->rows;
            }
            if (lo < hi) kiln_adapter_rows_add(pr[i], w + (lo - r0) * row, lo - (p->rows > 0 ? p->row0 : 0), hi - lo);
        }
        kiln_convert((char *)kiln_tensor_data(dst) + kiln_dtype_nbytes(dst->dtype, r0 * row), dst->dtype, w, KILN_F32,
                     (size_t)(nr * row));
    }
    if (w) kiln_device_scratch_free(kiln_device_cpu(), w);
    for (int i = 0; i < ps->n; i++) kiln_adapter_rows_end(pr[i]);
    return st;
}

/* dst (a copy of the tensor whose file view is `mapped`: same shape, contiguous, any
 * dtype and device) = f32(mapped) + the deltas of ps, cast to dst's dtype. In place:
 * views of dst see the new values. The f32 sum is built in dst itself when dst is
 * f32 in host memory, else in scratch from the cpu allocator, freed before return.
 * Must not be called with kiln_model_mu held (it allocates). */
kiln_status kiln_patchset_build_into(kiln_tensor *dst, const kiln_tensor *mapped, const patchset *ps)
{
    /* a dry run's copy (meta, or zero host memory) holds no values to rebuild */
    if (kiln_device_is_meta(tensor_device(dst)) || kiln_meta_is_host_storage(dst->storage)) return KILN_OK;
    kiln_status cs = kiln_model_check_source(mapped);
    if (cs) return cs;
    const char *path = kiln_model_mapped_path(mapped);
    if (!ps || ps->n == 0) return kiln_model_fill_from_host(dst, kiln_tensor_data(mapped), mapped->dtype, path);
    kiln_status rs = build_rows(dst, mapped, ps);
    if (rs != KILN_ERR_UNSUPPORTED) return rs;
    int64_t n = kiln_tensor_numel(dst);
    if (n == 0) return KILN_OK;
    kiln_device *cpu = kiln_device_cpu();
    int direct = dst->dtype == KILN_F32 && !tensor_device(dst)->backend->to_device;
    float *w = NULL;
    kiln_status st = KILN_OK;
    if (direct) w = kiln_tensor_data(dst);
    else if ((st = kiln_device_scratch_alloc(cpu, (size_t)n * sizeof(float), 0, (void **)&w))) return st;
    st = kiln_mapped_read(path, w, KILN_F32, kiln_tensor_data(mapped), mapped->dtype, (size_t)n);
    int64_t row = mapped->shape[0] ? n / mapped->shape[0] : 0;
    for (int i = 0; i < ps->n && !st; i++) {
        const patch *p = ps->p[i];
        int64_t shape[KILN_MAX_DIMS];
        memcpy(shape, mapped->shape, sizeof(int64_t) * (size_t)mapped->ndim);
        float *region = w;
        if (p->rows > 0) {
            shape[0] = p->rows;
            region += p->row0 * row;
        }
        st = kiln_adapter_apply(&p->a, region, mapped->ndim, shape);
    }
    if (!st && !direct) st = kiln_model_fill_from_host(dst, w, KILN_F32, NULL);
    if (!direct) kiln_device_scratch_free(cpu, w);
    return st;
}

/* ---- add / remove / count ---- */

/* Rebuilds copies[0..n) of t from the file and ps, in place; a copy that fails is
 * dropped from t (if still t's) so nothing stale stays. Returns the first error. */
static kiln_status rebuild_copies(mtensor *t, kiln_tensor **copies, int n, const patchset *ps)
{
    kiln_status first = KILN_OK;
    char msg[800] = "";
    for (int k = 0; k < n; k++) {
        if (!copies[k]) continue;
        kiln_storage_drop_derived(copies[k]->storage); /* cached forms of the old values */
        kiln_status st = kiln_patchset_build_into(copies[k], t->mapped, ps);
        if (!st) continue;
        if (!first) {
            first = st;
            snprintf(msg, sizeof msg, "%s", kiln_last_error());
        }
        pthread_mutex_lock(&kiln_model_mu);
        if (t->host && t->host->storage == copies[k]->storage) drop(&t->host);
        if (t->dev && t->dev->storage == copies[k]->storage) {
            drop(&t->dev);
            t->streamed = t->fetched = t->prefetched = 0;
        }
        pthread_mutex_unlock(&kiln_model_mu);
    }
    if (first) kiln_error(first, "%s", msg);
    return first;
}

kiln_status kiln_model_add_patch(kiln_model *m, const char *target, const kiln_adapter *a, int64_t row_first,
                                 int64_t row_count, int *id)
{
    if (id) *id = 0;
    if (!m || !target || !a || !id) return kiln_error(KILN_ERR_ARG, "model add_patch: model, target, adapter and id are required");
    int i = kiln_model_find(m, target);
    if (i < 0) return kiln_model_prefix_error(kiln_model_missing_error(m, target), "add_patch: ");
    mtensor *t = &m->t[i];
    const kiln_tensor *w = t->mapped;
    char ws[96], ds_str[96], rs[96];
    kiln_shape_str(w, ws, sizeof ws);
    if (!kiln_dtype_is_float(w->dtype))
        return kiln_error(KILN_ERR_ARG, "model '%s': add_patch: tensor '%s' is %s, not a floating-point weight", m->name,
                          target, kiln_dtype_name(w->dtype));
    int nd;
    int64_t ds[KILN_MAX_DIMS];
    kiln_status st = kiln_adapter_delta_shape(a, &nd, ds);
    if (st) {
        char prefix[300];
        snprintf(prefix, sizeof prefix, "model '%s': add_patch on '%s': ", m->name, target);
        return kiln_model_prefix_error(st, prefix);
    }
    if (!isfinite(a->scale) || !isfinite(a->strength))
        return kiln_error(KILN_ERR_ARG, "model '%s': add_patch on '%s': scale and strength must be finite numbers", m->name, target);
    kiln_tensor region = *w;
    rs[0] = 0;
    if (row_count < 0 || (row_count > 0 && (w->ndim < 1 || row_first < 0 || row_first + row_count > w->shape[0])))
        return kiln_error(KILN_ERR_ARG, "model '%s': add_patch: rows %lld..%lld (counting from 1) are outside dim 1 of tensor '%s' %s",
                          m->name, (long long)row_first + 1, (long long)(row_first + row_count), target, ws);
    if (row_count > 0) {
        region.shape[0] = row_count;
        char b[96];
        snprintf(rs, sizeof rs, " (rows %lld..%lld: %s)", (long long)row_first + 1, (long long)(row_first + row_count),
                 kiln_shape_str(&region, b, sizeof b));
    }
    int64_t dn = 1;
    for (int d = 0; d < nd; d++) dn *= ds[d];
    kiln_tensor dshape = {0};
    dshape.ndim = nd;
    memcpy(dshape.shape, ds, sizeof(int64_t) * (size_t)nd);
    kiln_shape_str(&dshape, ds_str, sizeof ds_str);
    if (dn != kiln_tensor_numel(&region))
        return kiln_error(KILN_ERR_ARG, "model '%s': add_patch: the %s delta %s does not fit tensor '%s' %s%s", m->name,
                          kiln_adapter_kind_name(a->kind), ds_str, target, ws, rs);
    const kiln_tensor *dora = a->f[KILN_AF_DORA_SCALE];
    if (dora && (region.ndim < 2 || kiln_tensor_numel(dora) != region.shape[1])) {
        char b[96];
        return kiln_error(KILN_ERR_ARG, "model '%s': add_patch: 'dora_scale' %s does not fit tensor '%s' %s%s: it needs "
                          "one value per column (dim 2)", m->name, kiln_shape_str(dora, b, sizeof b), target, ws, rs);
    }
    patch *p = calloc(1, sizeof *p);
    if (!p) return kiln_error(KILN_ERR_OOM, "model '%s': add_patch: out of host memory", m->name);
    atomic_init(&p->refs, 1);
    p->a = *a;
    p->row0 = row_count > 0 ? row_first : 0;
    p->rows = row_count > 0 ? row_count : 0;
    for (int f = 0; f < KILN_AF_COUNT; f++) {
        if (!a->f[f]) continue;
        p->own[f] = kiln_tensor_view_of(a->f[f]);
        p->a.f[f] = p->own[f];
        if (!p->own[f]) { patch_release(p); return kiln_error(KILN_ERR_OOM, "model '%s': add_patch: out of host memory", m->name); }
    }

    pthread_mutex_lock(&kiln_model_mu);
    m->busy++;
    kiln_model_wait_tensor_locked(t); /* a prefetch builds from the old set */
    patchset *old = t->ps, *cur = ps_edit(old, NULL, p);
    if (!cur) {
        m->busy--;
        pthread_mutex_unlock(&kiln_model_mu);
        patch_release(p);
        return kiln_error(KILN_ERR_OOM, "model '%s': add_patch: out of host memory", m->name);
    }
    p->id = ++m->next_patch_id;
    t->ps = kiln_patchset_retain(cur);
    t->gen++;
    kiln_tensor *copies[2] = {t->host ? kiln_tensor_view_of(t->host) : NULL, t->dev ? kiln_tensor_view_of(t->dev) : NULL};
    pthread_mutex_unlock(&kiln_model_mu);

    kiln_events_set_context(m->owner);
    st = rebuild_copies(t, copies, 2, cur);
    kiln_events_set_context(NULL);
    pthread_mutex_lock(&kiln_model_mu);
    if (st) {
        /* nothing added: the old set back; the copies that were rebuilt are dropped
         * (the file gives them back when needed) */
        kiln_patchset_release(t->ps);
        t->ps = old;
        old = NULL;
        t->gen++;
        drop(&t->host);
        drop(&t->dev);
        t->streamed = t->fetched = t->prefetched = 0;
    } else {
        *id = p->id;
    }
    m->busy--;
    pthread_mutex_unlock(&kiln_model_mu);
    kiln_tensor_free(copies[0]);
    kiln_tensor_free(copies[1]);
    kiln_patchset_release(old);
    kiln_patchset_release(cur);
    patch_release(p);
    if (st) {
        char prefix[300];
        snprintf(prefix, sizeof prefix, "model '%s': add_patch on '%s': ", m->name, target);
        return kiln_model_prefix_error(st, prefix);
    }
    return KILN_OK;
}

kiln_status kiln_model_remove_patch(kiln_model *m, int id)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "model remove_patch: model is NULL");
    pthread_mutex_lock(&kiln_model_mu);
    mtensor *t = NULL;
    patch *p = NULL;
    for (int i = 0; i < m->n && !p; i++) {
        patchset *ps = m->t[i].ps;
        for (int k = 0; ps && k < ps->n; k++)
            if (ps->p[k]->id == id) { t = &m->t[i]; p = ps->p[k]; break; }
    }
    if (!p) {
        pthread_mutex_unlock(&kiln_model_mu);
        return kiln_error(KILN_ERR_ARG, "model '%s': no patch with id %d (removed already?)", m->name, id);
    }
    m->busy++;
    kiln_model_wait_tensor_locked(t);
    patchset *old = t->ps, *cur = NULL;
    if (old->n > 1 && !(cur = ps_edit(old, p, NULL))) {
        m->busy--;
        pthread_mutex_unlock(&kiln_model_mu);
        return kiln_error(KILN_ERR_OOM, "model '%s': remove_patch: out of host memory", m->name);
    }
    t->ps = kiln_patchset_retain(cur);
    t->gen++;
    if (!cur && t->host && t->patch_host) drop(&t->host); /* the file's view serves again */
    kiln_tensor *copies[2] = {t->host ? kiln_tensor_view_of(t->host) : NULL, t->dev ? kiln_tensor_view_of(t->dev) : NULL};
    pthread_mutex_unlock(&kiln_model_mu);
    /* a copy that cannot be rebuilt is dropped: the removal itself always holds */
    kiln_events_set_context(m->owner);
    rebuild_copies(t, copies, 2, cur);
    kiln_events_set_context(NULL);
    pthread_mutex_lock(&kiln_model_mu);
    m->busy--;
    pthread_mutex_unlock(&kiln_model_mu);
    kiln_tensor_free(copies[0]);
    kiln_tensor_free(copies[1]);
    kiln_patchset_release(old);
    kiln_patchset_release(cur);
    return KILN_OK;
}

int kiln_model_patch_count(kiln_model *m, const char *target)
{
    if (!m) return -1;
    int i = target ? kiln_model_find(m, target) : -1;
    if (target && i < 0) return -1;
    int n = 0;
    pthread_mutex_lock(&kiln_model_mu);
    for (int k = target ? i : 0; k < (target ? i + 1 : m->n); k++)
        if (m->t[k].ps) n += m->t[k].ps->n;
    pthread_mutex_unlock(&kiln_model_mu);
    return n;
}
