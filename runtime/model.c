/* model.c - model weight stores: residency of every tensor (mapped / host /
 * device), load / offload / unload, LRU eviction through the allocators' evict hook,
 * memory modes, streaming (fetch / prefetch on a copy thread per device / release),
 * and the patch lists every copy of a weight is built with (adapter_delta.c has the
 * arithmetic).
 *
 * Locking: one registry mutex (reg_mu) guards every model's state, the registry and
 * the copy queues. Nothing allocates from a device allocator while holding it: an
 * allocation may call the evict hook, which takes reg_mu. Freeing under reg_mu is
 * fine (releasing never calls back), and the events lock is a leaf. */
#define _GNU_SOURCE
#include "model.h"
#include "backend.h"
#include "events.h"
#include "trace.h"
#include "format_bytes.h"
#include "safetensors.h"
#include "gguf.h"
#include "meta.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_QUEUES 16
/* Staging buffer of a converting copy to a device with its own memory (cuda): the
 * conversion never holds a second full host copy of a tensor. */
#define STAGE_BYTES ((size_t)8 << 20)

typedef struct {
    const char *name;        /* in the file's entry (the model retains the file) */
    kiln_st_file *file;
    int index;
    kiln_tensor *mapped;     /* view of the file (cpu, wrapped storage) */
    kiln_tensor *host;       /* host copy in the cpu allocator, or NULL */
    kiln_tensor *dev;        /* device copy, or NULL */
    kiln_tensor *parked;     /* the real device copy set aside while a dry run's copy on
                              * meta stands in its slot (put back when the run ends) */
    unsigned char streamed;  /* dev came from fetch/prefetch: release frees it */
    unsigned char fetched;   /* in use after fetch: not evictable until release */
    unsigned char prefetched;/* dev came from the copy thread and was not fetched yet */
    unsigned char inflight;  /* a prefetch is queued or copying */
    unsigned char patch_host;/* host exists only to show patched values (model_tensor) */
    struct patchset *ps;     /* patches, NULL when none (replaced whole, never edited) */
    unsigned gen;            /* bumped when ps changes: a copy built from an older ps is stale */
} mtensor;

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
typedef struct patchset {
    atomic_int refs;
    int n;
    patch *p[];
} patchset;

struct kiln_model {
    char name[58];
    char owner[64];          /* "model:<name>" */
    int n;
    mtensor *t;
    int *slots;              /* open addressing: name -> index */
    size_t slot_mask;
    int n_files;
    kiln_st_file **files;
    kiln_device *target;     /* load target / streaming target, NULL when none */
    int dtype;               /* load dtype or -1 */
    int stream_always;       /* 1: loads keep the weights on the host for streaming, whatever
                              * the memory mode (a partial residency: the caller keeps some
                              * blocks fetched and streams the rest) */
    int pinned, busy, inflight;
    uint64_t last_used;
    uint64_t n_fetch, n_prefetch, n_waits, n_hits;
    int prefetch_tid;
    int next_patch_id;
    kiln_model *prev, *next;
};

typedef struct job { kiln_model *m; int idx; struct job *next; } job;
typedef struct { pthread_t th; kiln_device *dev; int slot; int quit; } worker;

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER; /* a prefetch finished */
static kiln_model *models;
static uint64_t lru_clock;
static atomic_int memory_mode = KILN_MEM_NORMAL;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static struct {
    job *head, *tail;
    worker *w;
    pthread_cond_t cv;
} queues[MAX_QUEUES];

/* ORDER MEMMODE */
static const char *const memory_mode_names[KILN_MEM_MODE_COUNT] = {"high", "normal", "low", "none"};
/* ORDER RESIDENCY */
static const char *const residency_names[KILN_RES_COUNT] = {"mapped", "host", "device"};

/* ---- modes ---- */

void kiln_memory_mode_set(kiln_memory_mode mode)
{
    if ((unsigned)mode < KILN_MEM_MODE_COUNT) atomic_store(&memory_mode, (int)mode);
}

kiln_memory_mode kiln_memory_mode_get(void) { return (kiln_memory_mode)atomic_load(&memory_mode); }

const char *kiln_memory_mode_name(kiln_memory_mode mode)
{
    return (unsigned)mode < KILN_MEM_MODE_COUNT ? memory_mode_names[mode] : "?";
}

int kiln_memory_mode_from_name(const char *name)
{
    if (!name) return -1;
    if (strcmp(name, "cpu") == 0) return KILN_MEM_NONE;
    for (int i = 0; i < KILN_MEM_MODE_COUNT; i++)
        if (strcmp(name, memory_mode_names[i]) == 0) return i;
    return -1;
}

const char *kiln_residency_name(kiln_residency r)
{
    return (unsigned)r < KILN_RES_COUNT ? residency_names[r] : "?";
}

/* ---- helpers ---- */

static kiln_device *tensor_device(const kiln_tensor *t) { return t->storage->device; }
static size_t tensor_bytes(const kiln_tensor *t) { return t ? t->storage->nbytes : 0; }

/* Where a model streams to: its load target, or meta while a dry run models that
 * device (a target taken before the run would otherwise be the real device). */
static kiln_device *target_of(const kiln_model *m)
{
    kiln_device *mt = m->target ? kiln_meta_target() : NULL;
    return mt && m->target == mt ? kiln_device_meta() : m->target;
}

static void drop(kiln_tensor **t)
{
    kiln_tensor_free(*t);
    *t = NULL;
}

/* t->dev = r (under reg_mu). A dry run's copy on meta does not free a real device
 * copy it replaces: that one is parked and comes back when the run ends. */
static void set_dev_locked(mtensor *t, kiln_tensor *r)
{
    if (t->dev && r && kiln_device_is_meta(tensor_device(r)) && !kiln_device_is_meta(tensor_device(t->dev)) &&
        !t->parked)
        t->parked = t->dev;
    else
        kiln_tensor_free(t->dev);
    t->dev = r;
}

/* The copy new copies are made from: the host copy, else the file. */
static const kiln_tensor *source_of(const mtensor *t) { return t->host ? t->host : t->mapped; }

/* Load dtype for a tensor: floating-point tensors convert, integer ones (CLIP's
 * position_ids) keep theirs. A low-bit load dtype (fp8, a block type) is for the
 * weights of linear and convolution layers: vectors (biases, norms) keep their dtype,
 * and a block type also needs the last dimension in whole blocks. */
static kiln_dtype want_dtype(int dtype, const kiln_tensor *t)
{
    kiln_dtype src = t->dtype;
    if (dtype < 0 || !kiln_dtype_is_float(src)) return src;
    kiln_dtype d = (kiln_dtype)dtype;
    if (d == KILN_F8_E4M3FN || d == KILN_F8_E5M2 || kiln_dtype_is_blocked(d)) {
        if (t->ndim < 2) return src;
        if (t->shape[t->ndim - 1] % kiln_dtype_block(d)) return src;
    }
    return d;
}

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

int kiln_model_find(const kiln_model *m, const char *name)
{
    if (!m || !name) return -1;
    for (size_t s = (size_t)hash_str(name) & m->slot_mask; m->slots[s] >= 0; s = (s + 1) & m->slot_mask)
        if (strcmp(m->t[m->slots[s]].name, name) == 0) return m->slots[s];
    return -1;
}

static void slot_insert(kiln_model *m, int idx)
{
    size_t s = (size_t)hash_str(m->t[idx].name) & m->slot_mask;
    while (m->slots[s] >= 0) s = (s + 1) & m->slot_mask;
    m->slots[s] = idx;
}

/* Edit distance on at most the first 96 bytes (enough to rank suggestions). */
static int edit_distance(const char *a, const char *b)
{
    int la = (int)strnlen(a, 96), lb = (int)strnlen(b, 96);
    int row[97];
    for (int j = 0; j <= lb; j++) row[j] = j;
    for (int i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

static kiln_status missing_error(const kiln_model *m, const char *name)
{
    if (m->n == 0) return kiln_error(KILN_ERR_ARG, "model '%s': no tensor '%s' (the model has no tensors)", m->name, name);
    int best[3] = {-1, -1, -1}, dist[3] = {1 << 30, 1 << 30, 1 << 30};
    for (int i = 0; i < m->n; i++) {
        int d = edit_distance(name, m->t[i].name);
        for (int k = 0; k < 3; k++) {
            if (d < dist[k]) {
                for (int j = 2; j > k; j--) { dist[j] = dist[j - 1]; best[j] = best[j - 1]; }
                dist[k] = d;
                best[k] = i;
                break;
            }
        }
    }
    char list[400] = "";
    for (int k = 0; k < 3 && best[k] >= 0; k++) {
        size_t used = strlen(list);
        snprintf(list + used, sizeof list - used, "%s'%s'", k ? ", " : "", m->t[best[k]].name);
    }
    return kiln_error(KILN_ERR_ARG, "model '%s': no tensor '%s' (closest: %s)", m->name, name, list);
}

/* Re-raises the pending error with a prefix, keeping out-of-memory details. */
static kiln_status prefix_error(kiln_status st, const char *prefix)
{
    char msg[800];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    if (st == KILN_ERR_OOM) {
        kiln_oom_info o = *kiln_last_oom();
        return kiln_error_oom(o.device, o.requested, o.free, o.budget, "%s%s", prefix, msg);
    }
    return kiln_error(st, "%s%s", prefix, msg);
}

static void count_transfer(kiln_device *dev, int to_device, size_t n, double secs)
{
    kiln_device_count_transfer(dev, to_device, n, secs);
}

static kiln_status fill_from_host(kiln_tensor *dst, const void *src, kiln_dtype sdt);
static void release_mapped(kiln_storage *s);

/* Every copy read from a file's mapping first checks that the file on disk is still
 * the one mapped: a file truncated under us faults (SIGBUS) on the first page past
 * its new end, where an error value is still possible here. */
static kiln_status check_source(const kiln_tensor *src)
{
    if (src->storage->release != release_mapped) return KILN_OK;
    return kiln_st_check(src->storage->ctx);
}

/* A copy onto dev that must not read its source: dev is meta, or a dry run is on and
 * the copy is a host one (the file is never read during a dry run; the host copy
 * reads as zeros and is dropped when the run ends). *out is the copy, its bytes
 * accounted as a real one's; 0 when the copy is an ordinary one. */
static int dry_copy(const kiln_tensor *src, kiln_device *dev, kiln_dtype dt, const char *owner,
                    kiln_tensor **out, kiln_status *st)
{
    *out = NULL;
    *st = KILN_OK;
    if (kiln_device_is_meta(dev)) {
        if ((*st = kiln_tensor_new(dev, dt, src->ndim, src->shape, out))) return 1;
        kiln_storage_set_owner((*out)->storage, owner);
        count_transfer(dev, 1, kiln_tensor_nbytes(*out), 0);
        return 1;
    }
    if (dev->type != KILN_DEV_CPU || !kiln_meta_target()) return 0;
    size_t n = kiln_dtype_nbytes(dt, kiln_tensor_numel(src));
    kiln_storage *s = kiln_meta_host_storage(n);
    if (!s) { *st = kiln_error(KILN_ERR_OOM, "dry run: no address space for a host copy of %zu bytes", n); return 1; }
    kiln_storage_set_owner(s, owner);
    *out = kiln_tensor_from_storage(s, 0, dt, src->ndim, src->shape, NULL);
    kiln_storage_release(s);
    if (!*out) *st = kiln_error(KILN_ERR_OOM, "out of host memory");
    return 1;
}

/* A new copy of src on dev in dtype dt, accounted to owner. Host sources (the file
 * or a host copy) are converted straight into the new copy (through a bounded
 * staging buffer for devices with their own memory); anything else goes through
 * kiln_tensor_to. Must not be called with reg_mu held (it allocates). */
static kiln_status copy_to(const kiln_tensor *src, kiln_device *dev, kiln_dtype dt, const char *owner,
                           kiln_tensor **out)
{
    *out = NULL;
    kiln_status st;
    kiln_tensor *r;
    if (dry_copy(src, dev, dt, owner, out, &st)) return st;
    if (tensor_device(src)->type != KILN_DEV_CPU || !kiln_tensor_is_contiguous(src)) {
        if ((st = kiln_tensor_to(src, dev, dt, &r))) return st;
        kiln_storage_set_owner(r->storage, owner);
        *out = r;
        return KILN_OK;
    }
    if ((st = kiln_tensor_new(dev, dt, src->ndim, src->shape, &r))) return st;
    kiln_storage_set_owner(r->storage, owner);
    double t0 = kiln_events_now();
    st = fill_from_host(r, kiln_tensor_data(src), src->dtype);
    if (st) { kiln_tensor_free(r); return st; }
    count_transfer(dev, 1, kiln_tensor_nbytes(r), kiln_events_now() - t0);
    *out = r;
    return KILN_OK;
}

/* ---- patches ---- */

static void patch_release(patch *p)
{
    if (!p || atomic_fetch_sub(&p->refs, 1) != 1) return;
    for (int f = 0; f < KILN_AF_COUNT; f++) kiln_tensor_free(p->own[f]);
    free(p);
}

static patchset *ps_retain(patchset *ps)
{
    if (ps) atomic_fetch_add(&ps->refs, 1);
    return ps;
}

static void ps_release(patchset *ps)
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

/* dst (contiguous, on any device) = n elements at src (host memory, dtype sdt),
 * converted to dst's dtype; devices with their own memory get them through a
 * bounded staging buffer. */
static kiln_status fill_from_host(kiln_tensor *dst, const void *src, kiln_dtype sdt)
{
    kiln_device *dev = tensor_device(dst);
    kiln_dtype dt = dst->dtype;
    size_t n = (size_t)kiln_tensor_numel(dst);
    kiln_status st = KILN_OK;
    if (n == 0 || kiln_device_is_meta(dev)) return KILN_OK;
    if (!dev->backend->to_device) {
        kiln_convert(kiln_tensor_data(dst), dt, src, sdt, n);
    } else if (dt == sdt) {
        st = dev->backend->to_device(kiln_tensor_data(dst), src, kiln_tensor_nbytes(dst));
    } else {
        /* pieces in whole blocks of any block type (256 elements), byte offsets by dtype */
        size_t chunk = STAGE_BYTES / 8 / 256 * 256;
        if (chunk > n) chunk = n;
        void *stage = NULL;
        st = kiln_allocator_alloc(kiln_device_cpu()->alloc, kiln_dtype_nbytes(dt, (int64_t)chunk), &stage);
        for (size_t off = 0; !st && off < n; off += chunk) {
            size_t k = n - off < chunk ? n - off : chunk;
            kiln_convert(stage, dt, (const char *)src + kiln_dtype_nbytes(sdt, (int64_t)off), sdt, k);
            st = dev->backend->to_device((char *)kiln_tensor_data(dst) + kiln_dtype_nbytes(dt, (int64_t)off), stage,
                                         kiln_dtype_nbytes(dt, (int64_t)k));
        }
        if (stage) kiln_allocator_release(kiln_device_cpu()->alloc, stage);
    }
    return st;
}

/* dst (a copy of the tensor whose file view is `mapped`: same shape, contiguous, any
 * dtype and device) = f32(mapped) + the deltas of ps, cast to dst's dtype. In place:
 * views of dst see the new values. The f32 sum is built in dst itself when dst is
 * f32 in host memory, else in scratch from the cpu allocator, freed before return.
 * Must not be called with reg_mu held (it allocates). */
/* build_into a block of rows at a time, for a copy in host memory whose patches are all
 * row by row (kiln_adapter_rows): the f32 rows stay in cache between the conversion from
 * the file, the deltas and the conversion to the copy's dtype. KILN_ERR_UNSUPPORTED
 * (nothing written) when a patch is not row by row. */
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
        kiln_convert(w, KILN_F32, (const char *)kiln_tensor_data(mapped) + kiln_dtype_nbytes(mapped->dtype, r0 * row),
                     mapped->dtype, (size_t)(nr * row));
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

static kiln_status build_into(kiln_tensor *dst, const kiln_tensor *mapped, const patchset *ps)
{
    /* a dry run's copy (meta, or zero host memory) holds no values to rebuild */
    if (kiln_device_is_meta(tensor_device(dst)) || kiln_meta_is_host_storage(dst->storage)) return KILN_OK;
    kiln_status cs = check_source(mapped);
    if (cs) return cs;
    if (!ps || ps->n == 0) return fill_from_host(dst, kiln_tensor_data(mapped), mapped->dtype);
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
    kiln_convert(w, KILN_F32, kiln_tensor_data(mapped), mapped->dtype, (size_t)n);
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
    if (!st && !direct) st = fill_from_host(dst, w, KILN_F32);
    if (!direct) kiln_device_scratch_free(cpu, w);
    return st;
}

/* Under reg_mu: what a new copy of t in dtype want is made from. Unpatched: the host
 * copy, else the file. Patched: the host copy when it already has that dtype (it
 * carries the patches), else the file plus the patch set (*ps retained). */
static kiln_tensor *source_locked(const mtensor *t, kiln_dtype want, patchset **ps)
{
    *ps = NULL;
    if (t->ps && !(t->host && t->host->dtype == want)) {
        *ps = ps_retain(t->ps);
        return kiln_tensor_view_of(t->mapped);
    }
    return kiln_tensor_view_of(source_of(t));
}

/* A new copy on dev in dtype dt from what source_locked gave. */
static kiln_status make_copy(const kiln_tensor *src, const patchset *ps, kiln_device *dev, kiln_dtype dt,
                             const char *owner, kiln_tensor **out)
{
    *out = NULL;
    kiln_status cs;
    if (dry_copy(src, dev, dt, owner, out, &cs)) return cs; /* patches too: nothing is computed */
    if ((cs = check_source(src))) return cs;
    if (!ps) return copy_to(src, dev, dt, owner, out);
    kiln_tensor *r;
    kiln_status st = kiln_tensor_new(dev, dt, src->ndim, src->shape, &r);
    if (st) return st;
    kiln_storage_set_owner(r->storage, owner);
    double t0 = kiln_events_now();
    if ((st = build_into(r, src, ps))) { kiln_tensor_free(r); return st; }
    count_transfer(dev, 1, kiln_tensor_nbytes(r), kiln_events_now() - t0);
    *out = r;
    return KILN_OK;
}

/* ---- eviction ---- */

static int evictable_on(const kiln_model *m, const kiln_device *dev)
{
    for (int i = 0; i < m->n; i++) {
        const mtensor *t = &m->t[i];
        if (t->dev && tensor_device(t->dev) == dev && !t->fetched) return 1;
        if (t->host && tensor_device(t->host) == dev) return 1;
    }
    return 0;
}

/* Drops *slot, returning the bytes that really go back to the allocator. */
static size_t drop_counted(kiln_tensor **slot, uint64_t *bytes)
{
    kiln_storage *s = (*slot)->storage;
    size_t n = s->nbytes;
    int alone = atomic_load((atomic_int *)&s->refcount) == 1;
    *bytes += n;
    drop(slot);
    return alone ? n : 0;
}

/* Evicts whole models (their copies on dev), least recently used first. With
 * one_step it stops after the first model that gave memory back: the allocator
 * retries and asks again if that was not enough, so no more is evicted than the
 * allocation needs (`need` is what the allocator would need in fresh segments,
 * an overestimate when freed blocks can be reused). */
static size_t evict_locked(kiln_device *dev, size_t need, int one_step)
{
    size_t freed = 0;
    while (freed < need) {
        kiln_model *victim = NULL;
        for (kiln_model *m = models; m; m = m->next) {
            if (m->pinned || m->busy || !evictable_on(m, dev)) continue;
            if (!victim || m->last_used < victim->last_used) victim = m;
        }
        if (!victim) break;
        uint64_t bytes = 0;
        size_t really = 0;
        int count = 0;
        for (int i = 0; i < victim->n; i++) {
            mtensor *t = &victim->t[i];
            if (t->dev && tensor_device(t->dev) == dev && !t->fetched) {
                really += drop_counted(&t->dev, &bytes);
                t->streamed = t->prefetched = 0;
                count++;
            }
            if (t->host && tensor_device(t->host) == dev) {
                really += drop_counted(&t->host, &bytes);
                count++;
            }
        }
        freed += really;
        char nb[32], rb[32];
        kiln_format_bytes(nb, sizeof nb, (double)need);
        kiln_format_bytes(rb, sizeof rb, (double)(bytes - really));
        kiln_event_emit(KILN_EV_EVICT, dev->name, bytes, victim->owner,
                        "%d tensors, least recently used, for an allocation short of %s%s%s", count, nb,
                        bytes > really ? "; still referenced elsewhere: " : "", bytes > really ? rb : "");
        if (one_step && really) break;
    }
    return freed;
}

size_t kiln_model_evict(kiln_device *dev, size_t need)
{
    if (!dev) return 0;
    pthread_mutex_lock(&reg_mu);
    size_t freed = evict_locked(dev, need ? need : 1, 0);
    pthread_mutex_unlock(&reg_mu);
    return freed;
}

/* The allocators' evict hook (called without the allocator's lock). */
static size_t evict_hook(void *ctx, kiln_allocator *a, size_t need)
{
    (void)a;
    if (kiln_memory_mode_get() == KILN_MEM_HIGH) return 0;
    pthread_mutex_lock(&reg_mu);
    size_t freed = evict_locked(ctx, need ? need : 1, 1);
    pthread_mutex_unlock(&reg_mu);
    return freed;
}

static void init_runtime(void)
{
    for (int i = 0; i < MAX_QUEUES; i++) pthread_cond_init(&queues[i].cv, NULL);
    for (int i = 0; i < kiln_device_count(); i++)
        kiln_allocator_set_evict_hook(kiln_device_at(i)->alloc, evict_hook, kiln_device_at(i));
}

/* ---- open / close ---- */

static void release_mapped(kiln_storage *s) { kiln_st_release(s->ctx); }

static void base_name(const char *path, char *out, size_t cap)
{
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t n = strlen(b);
    static const char *const exts[] = {".safetensors", ".gguf"};
    for (int i = 0; i < 2; i++) {
        size_t k = strlen(exts[i]);
        if (n > k && strcmp(b + n - k, exts[i]) == 0) n -= k;
    }
    if (n >= cap) n = cap - 1;
    memcpy(out, b, n);
    out[n] = 0;
}

static void model_free_all(kiln_model *m)
{
    for (int i = 0; i < m->n; i++) {
        mtensor *t = &m->t[i];
        kiln_tensor_free(t->dev);
        kiln_tensor_free(t->parked);
        kiln_tensor_free(t->host);
        kiln_tensor_free(t->mapped);
        ps_release(t->ps);
    }
    for (int i = 0; i < m->n_files; i++) kiln_st_release(m->files[i]);
    free(m->files);
    free(m->t);
    free(m->slots);
    free(m);
}

static int has_prefix(const char *s, const char *const *prefixes, int n)
{
    if (n == 0) return 1;
    for (int i = 0; i < n; i++)
        if (prefixes[i] && strncmp(s, prefixes[i], strlen(prefixes[i])) == 0) return 1;
    return 0;
}

kiln_status kiln_model_open(const char *const *paths, int n, const char *name, kiln_model **out)
{
    return kiln_model_open_prefixed(paths, n, name, NULL, 0, out);
}

kiln_status kiln_model_open_prefixed(const char *const *paths, int n, const char *name,
                                     const char *const *prefixes, int n_prefixes, kiln_model **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "kiln_model_open: out is NULL");
    if (n_prefixes < 0 || (n_prefixes > 0 && !prefixes)) return kiln_error(KILN_ERR_ARG, "model: bad prefix list");
    *out = NULL;
    if (!paths || n < 1) return kiln_error(KILN_ERR_ARG, "model: at least one safetensors file is required");
    for (int i = 0; i < n; i++)
        if (!paths[i]) return kiln_error(KILN_ERR_ARG, "model: file %d of %d is NULL", i + 1, n);
    pthread_once(&init_once, init_runtime);
    kiln_model *m = calloc(1, sizeof *m);
    if (!m || !(m->files = calloc((size_t)n, sizeof *m->files))) {
        free(m);
        return kiln_error(KILN_ERR_OOM, "model: out of host memory");
    }
    kiln_status st;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if ((st = kiln_weights_open(paths[i], &m->files[i]))) { model_free_all(m); return st; }
        m->n_files++;
        total += (size_t)m->files[i]->n;
    }
    size_t cap = 8;
    while (cap < total * 2) cap *= 2;
    m->t = calloc(total ? total : 1, sizeof *m->t);
    m->slots = malloc(cap * sizeof *m->slots);
    if (!m->t || !m->slots) { model_free_all(m); return kiln_error(KILN_ERR_OOM, "model: out of host memory"); }
    for (size_t s = 0; s < cap; s++) m->slots[s] = -1;
    m->slot_mask = cap - 1;
    for (int f = 0; f < m->n_files; f++) {
        kiln_st_file *file = m->files[f];
        for (int e = 0; e < file->n; e++) {
            if (!has_prefix(file->entries[e].name, prefixes, n_prefixes)) continue;
            int idx = kiln_model_find(m, file->entries[e].name);
            if (idx < 0) {
                idx = m->n++;
                m->t[idx].name = file->entries[e].name;
                slot_insert(m, idx);
            }
            m->t[idx].name = file->entries[e].name; /* a later file overrides */
            m->t[idx].file = file;
            m->t[idx].index = e;
        }
    }
    if (name && *name) snprintf(m->name, sizeof m->name, "%s", name);
    else base_name(paths[0], m->name, sizeof m->name);
    if (n_prefixes > 0 && m->n == 0 && total > 0) {
        char list[256] = "";
        for (int i = 0; i < n_prefixes; i++) {
            size_t used = strlen(list);
            snprintf(list + used, sizeof list - used, "%s'%s'", i ? ", " : "", prefixes[i] ? prefixes[i] : "");
        }
        kiln_status err = kiln_error(KILN_ERR_ARG, "model '%s': no tensor of %s%s starts with %s", m->name, paths[0],
                                     n > 1 ? " (and the other files)" : "", list);
        model_free_all(m);
        return err;
    }
    snprintf(m->owner, sizeof m->owner, "model:%s", m->name);
    static char empty_data[KILN_ALLOC_ALIGN];
    for (int i = 0; i < m->n; i++) {
        mtensor *t = &m->t[i];
        const kiln_st_entry *e = &t->file->entries[t->index];
        void *data = t->file->data ? (void *)kiln_st_data(t->file, t->index) : (void *)empty_data;
        kiln_st_retain(t->file);
        kiln_storage *s = kiln_storage_wrap(kiln_device_cpu(), data, (size_t)(e->end - e->begin), release_mapped, t->file);
        if (!s) { kiln_st_release(t->file); model_free_all(m); return kiln_error(KILN_ERR_OOM, "model: out of host memory"); }
        kiln_storage_set_owner(s, m->owner);
        t->mapped = kiln_tensor_from_storage(s, 0, e->dtype, e->ndim, e->shape, NULL);
        kiln_storage_release(s);
        if (!t->mapped) { model_free_all(m); return kiln_error(KILN_ERR_OOM, "model: out of host memory"); }
    }
    m->dtype = -1;
    pthread_mutex_lock(&reg_mu);
    m->last_used = ++lru_clock;
    m->next = models;
    if (models) models->prev = m;
    models = m;
    pthread_mutex_unlock(&reg_mu);
    *out = m;
    return KILN_OK;
}

/* Takes the queued prefetches of m off the queues and waits for a running one. */
static void cancel_prefetches_locked(kiln_model *m)
{
    for (int q = 0; q < MAX_QUEUES; q++) {
        job **pj = &queues[q].head, *last = NULL;
        while (*pj) {
            job *j = *pj;
            if (j->m == m) {
                *pj = j->next;
                m->t[j->idx].inflight = 0;
                m->inflight--;
                free(j);
            } else {
                last = j;
                pj = &j->next;
            }
        }
        queues[q].tail = last;
    }
    while (m->inflight > 0) pthread_cond_wait(&done_cv, &reg_mu);
}

static uint64_t drop_copies_locked(kiln_model *m)
{
    uint64_t bytes = 0;
    for (int i = 0; i < m->n; i++) {
        mtensor *t = &m->t[i];
        /* a real copy parked by a dry run stays until the run ends, unless the model
         * closes (an unload inside a dry run leaves the real device as it was) */
        if (!kiln_meta_target()) drop(&t->parked);
        bytes += tensor_bytes(t->dev) + tensor_bytes(t->host);
        drop(&t->dev);
        drop(&t->host);
        t->streamed = t->fetched = t->prefetched = 0;
    }
    return bytes;
}

void kiln_model_drop_dry_copies(kiln_device *meta)
{
    pthread_mutex_lock(&reg_mu);
    for (kiln_model *m = models; m; m = m->next) cancel_prefetches_locked(m);
    for (kiln_model *m = models; m; m = m->next) {
        int dropped = 0;
        kiln_device *restored = NULL;
        for (int i = 0; i < m->n; i++) {
            mtensor *t = &m->t[i];
            if (t->dev && (tensor_device(t->dev) == meta || kiln_meta_is_host_storage(t->dev->storage))) {
                drop(&t->dev);
                t->streamed = t->fetched = t->prefetched = 0;
                dropped = 1;
            }
            if (t->parked && !t->dev) {
                t->dev = t->parked;
                t->parked = NULL;
                restored = tensor_device(t->dev);
            }
            drop(&t->parked); /* a copy of its own came back meanwhile */
            if (t->host && (tensor_device(t->host) == meta || kiln_meta_is_host_storage(t->host->storage))) {
                drop(&t->host);
                t->patch_host = 0;
                dropped = 1;
            }
        }
        if (restored) m->target = restored; /* as before the run, whatever it loaded or unloaded */
        else if (dropped && m->target == meta) m->target = NULL;
    }
    pthread_mutex_unlock(&reg_mu);
}

void kiln_model_close(kiln_model *m)
{
    if (!m) return;
    pthread_mutex_lock(&reg_mu);
    cancel_prefetches_locked(m);
    if (m->prev) m->prev->next = m->next;
    else models = m->next;
    if (m->next) m->next->prev = m->prev;
    const char *dev = m->target ? m->target->name : "";
    uint64_t bytes = drop_copies_locked(m);
    if (bytes) kiln_event_emit(KILN_EV_UNLOAD, dev, bytes, m->owner, "closed");
    /* The last model gone: the copy threads have nothing left to do. */
    worker *stop[MAX_QUEUES];
    int n_stop = 0;
    if (!models) {
        for (int q = 0; q < MAX_QUEUES; q++) {
            if (!queues[q].w) continue;
            queues[q].w->quit = 1;
            stop[n_stop++] = queues[q].w;
            queues[q].w = NULL;
            pthread_cond_broadcast(&queues[q].cv);
        }
    }
    pthread_mutex_unlock(&reg_mu);
    for (int i = 0; i < n_stop; i++) {
        pthread_join(stop[i]->th, NULL);
        free(stop[i]);
    }
    model_free_all(m);
}

/* ---- queries ---- */

const char *kiln_model_name(const kiln_model *m) { return m ? m->name : "?"; }
int kiln_model_count(const kiln_model *m) { return m ? m->n : 0; }

const char *kiln_model_tensor_name(const kiln_model *m, int i)
{
    return m && i >= 0 && i < m->n ? m->t[i].name : NULL;
}

static kiln_residency residency_of(const mtensor *t)
{
    return t->dev ? KILN_RES_DEVICE : t->host ? KILN_RES_HOST : KILN_RES_MAPPED;
}

kiln_status kiln_model_tensor(kiln_model *m, const char *name, kiln_tensor **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "model tensor: out is NULL");
    *out = NULL;
    if (!m || !name) return kiln_error(KILN_ERR_ARG, "model tensor: model and name are required");
    int i = kiln_model_find(m, name);
    if (i < 0) return missing_error(m, name);
    pthread_mutex_lock(&reg_mu);
    mtensor *t = &m->t[i];
    if (t->ps && !t->dev && !t->host) {
        /* the file's view would show the weight without its patches: build a host
         * copy (accounted to the model) and hand that out */
        patchset *ps;
        kiln_tensor *src = source_locked(t, t->mapped->dtype, &ps);
        m->busy++;
        pthread_mutex_unlock(&reg_mu);
        kiln_tensor *r = NULL;
        kiln_status st = src ? make_copy(src, ps, kiln_device_cpu(), src->dtype, m->owner, &r)
                             : kiln_error(KILN_ERR_OOM, "out of host memory");
        kiln_tensor_free(src);
        ps_release(ps);
        pthread_mutex_lock(&reg_mu);
        m->busy--;
        if (st) {
            pthread_mutex_unlock(&reg_mu);
            char prefix[200];
            snprintf(prefix, sizeof prefix, "model '%s': patched tensor '%s': ", m->name, name);
            return prefix_error(st, prefix);
        }
        if (!t->dev && !t->host) {
            t->host = r;
            t->patch_host = 1;
        } else {
            kiln_tensor_free(r);
        }
    }
    const kiln_tensor *best = t->dev ? t->dev : t->host ? t->host : t->mapped;
    kiln_tensor *v = kiln_tensor_view_of(best);
    m->last_used = ++lru_clock;
    pthread_mutex_unlock(&reg_mu);
    if (!v) return kiln_error(KILN_ERR_OOM, "model '%s': out of host memory for a tensor header", m->name);
    /* the file's own view is read by whatever runs next: it must still be the file */
    kiln_status cs = check_source(v);
    if (cs) {
        kiln_tensor_free(v);
        char prefix[200];
        snprintf(prefix, sizeof prefix, "model '%s': tensor '%s': ", m->name, name);
        return prefix_error(cs, prefix);
    }
    *out = v;
    return KILN_OK;
}

kiln_status kiln_model_where(kiln_model *m, const char *name, kiln_residency *out)
{
    if (!m || !name || !out) return kiln_error(KILN_ERR_ARG, "model where: model, name and out are required");
    int i = kiln_model_find(m, name);
    if (i < 0) return missing_error(m, name);
    pthread_mutex_lock(&reg_mu);
    *out = residency_of(&m->t[i]);
    pthread_mutex_unlock(&reg_mu);
    return KILN_OK;
}

void kiln_model_get_info(kiln_model *m, kiln_model_info *o)
{
    memset(o, 0, sizeof *o);
    if (!m) return;
    pthread_mutex_lock(&reg_mu);
    o->n_tensors = m->n;
    for (int i = 0; i < m->n; i++) {
        const mtensor *t = &m->t[i];
        kiln_residency r = residency_of(t);
        o->count[r]++;
        o->bytes[r] += tensor_bytes(r == KILN_RES_DEVICE ? t->dev : r == KILN_RES_HOST ? t->host : t->mapped);
        o->file_bytes += tensor_bytes(t->mapped);
        if (t->host) o->host_bytes += tensor_bytes(t->host);
        if (t->dev) {
            if (tensor_device(t->dev)->type == KILN_DEV_CPU) o->host_bytes += tensor_bytes(t->dev);
            else o->device_bytes += tensor_bytes(t->dev);
        }
    }
    o->device = m->target;
    o->dtype = m->dtype;
    o->pinned = m->pinned;
    o->last_used = m->last_used;
    o->n_fetch_copies = m->n_fetch;
    o->n_prefetch_copies = m->n_prefetch;
    o->n_prefetch_waits = m->n_waits;
    o->n_prefetch_hits = m->n_hits;
    o->prefetch_thread = m->prefetch_tid;
    pthread_mutex_unlock(&reg_mu);
}

static uint64_t bytes_on_locked(const kiln_model *m, const kiln_device *dev, int *count)
{
    uint64_t b = 0;
    int c = 0;
    for (int i = 0; i < m->n; i++) {
        const mtensor *t = &m->t[i];
        int here = 0;
        if (t->dev && (!dev || tensor_device(t->dev) == dev)) { b += tensor_bytes(t->dev); here = 1; }
        if (t->host && (!dev || tensor_device(t->host) == dev)) { b += tensor_bytes(t->host); here = 1; }
        c += here;
    }
    if (count) *count = c;
    return b;
}

uint64_t kiln_model_bytes(kiln_model *m, const kiln_device *dev)
{
    if (!m) return 0;
    pthread_mutex_lock(&reg_mu);
    uint64_t b = bytes_on_locked(m, dev, NULL);
    pthread_mutex_unlock(&reg_mu);
    return b;
}

static int by_recent(const void *x, const void *y)
{
    const kiln_model *a = *(kiln_model *const *)x, *b = *(kiln_model *const *)y;
    return a->last_used < b->last_used ? 1 : a->last_used > b->last_used ? -1 : 0;
}

int kiln_model_usage_list(kiln_model_usage *out, int max)
{
    pthread_mutex_lock(&reg_mu);
    int n_models = 0;
    for (kiln_model *m = models; m; m = m->next) n_models++;
    kiln_model **list = malloc(sizeof *list * (size_t)(n_models ? n_models : 1));
    if (!list) { pthread_mutex_unlock(&reg_mu); return 0; }
    int k = 0;
    for (kiln_model *m = models; m; m = m->next) list[k++] = m;
    qsort(list, (size_t)n_models, sizeof *list, by_recent);
    int rows = 0;
    for (int i = 0; i < n_models; i++) {
        kiln_model *m = list[i];
        int any = 0;
        for (int d = 0; d <= kiln_device_count(); d++) {
            kiln_device *dev = d < kiln_device_count() ? kiln_device_at(d) : NULL;
            int count = 0;
            uint64_t b = dev ? bytes_on_locked(m, dev, &count) : 0;
            if (dev ? count == 0 : any) continue;
            any = 1;
            if (rows < max) {
                kiln_model_usage *u = &out[rows];
                memset(u, 0, sizeof *u);
                /* a model by its name; other owners (LoRA files) by their owner tag */
                snprintf(u->model, sizeof u->model, "%s", strncmp(m->owner, "model:", 6) == 0 ? m->name : m->owner);
                snprintf(u->device, sizeof u->device, "%s", dev ? dev->name : "");
                u->bytes = dev ? b : 0;
                u->tensors = count;
                u->total = m->n;
                u->pinned = m->pinned;
                u->last_used = m->last_used;
            }
            rows++;
        }
    }
    free(list);
    pthread_mutex_unlock(&reg_mu);
    return rows;
}

/* ---- load / offload / unload / pin ---- */

static void load_error_prefix(kiln_model *m, kiln_device *dev, char *buf, size_t cap)
{
    kiln_memory_mode mode = kiln_memory_mode_get();
    size_t used = (size_t)snprintf(buf, cap, "model '%s': loading onto %s (memory mode %s%s", m->name, dev->name,
                                   kiln_memory_mode_name(mode),
                                   mode == KILN_MEM_HIGH ? ": nothing is evicted automatically" : "");
    int first = 1;
    pthread_mutex_lock(&reg_mu);
    for (kiln_model *o = models; o && used < cap; o = o->next) {
        if (o == m || !o->pinned) continue;
        used += (size_t)snprintf(buf + used, cap - used, "%s%s", first ? "; pinned: " : ", ", o->name);
        first = 0;
    }
    pthread_mutex_unlock(&reg_mu);
    if (used < cap) snprintf(buf + used, cap - used, "): ");
}

void kiln_model_set_stream_always(kiln_model *m, int on)
{
    pthread_mutex_lock(&reg_mu);
    m->stream_always = on != 0;
    pthread_mutex_unlock(&reg_mu);
}

int kiln_model_stream_always(const kiln_model *m) { return m->stream_always; }

kiln_status kiln_model_load(kiln_model *m, kiln_device *dev, int dtype)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "model load: model is NULL");
    if (dtype >= KILN_DTYPE_COUNT || dtype < -1) return kiln_error(KILN_ERR_ARG, "model '%s': load: bad dtype %d", m->name, dtype);
    kiln_memory_mode mode = kiln_memory_mode_get();
    if (!dev || mode == KILN_MEM_NONE) dev = kiln_device_cpu();
    int low = (mode == KILN_MEM_LOW || m->stream_always) && dev->type != KILN_DEV_CPU;
    unsigned char *made = calloc((size_t)(m->n ? m->n : 1), 1);
    if (!made) return kiln_error(KILN_ERR_OOM, "model '%s': out of host memory", m->name);
    pthread_mutex_lock(&reg_mu);
    m->busy++;
    m->target = dev;
    m->dtype = dtype;
    m->last_used = ++lru_clock;
    pthread_mutex_unlock(&reg_mu);
    kiln_events_set_context(m->owner);
    double t0 = kiln_events_now();
    kiln_status st = KILN_OK;
    int copied = 0;
    for (int i = 0; i < m->n && !st; i++) {
        mtensor *t = &m->t[i];
        kiln_device *to = low ? kiln_device_cpu() : dev;
        pthread_mutex_lock(&reg_mu);
        kiln_dtype want = want_dtype(dtype, source_of(t));
        int have;
        if (low) {
            /* the host side of streaming: the file itself unless a conversion is due */
            have = t->host ? t->host->dtype == want : want == t->mapped->dtype;
        } else {
            have = t->dev && tensor_device(t->dev) == dev && (dtype < 0 || t->dev->dtype == want);
            if (have) t->streamed = t->prefetched = 0; /* load owns it now */
            if (!have && dev->type == KILN_DEV_CPU && t->host && t->host->dtype == want) {
                /* a host copy is already what a cpu load wants */
                kiln_tensor_free(t->dev);
                t->dev = t->host;
                t->host = NULL;
                t->streamed = t->fetched = t->prefetched = 0;
                have = 1;
            }
        }
        patchset *ps = NULL;
        kiln_tensor *src = have ? NULL : source_locked(t, want, &ps);
        pthread_mutex_unlock(&reg_mu);
        if (have) continue;
        if (!src) { ps_release(ps); st = kiln_error(KILN_ERR_OOM, "out of host memory"); break; }
        kiln_tensor *r;
        st = make_copy(src, ps, to, want, m->owner, &r);
        kiln_tensor_free(src);
        ps_release(ps);
        if (st) break;
        pthread_mutex_lock(&reg_mu);
        if (low) {
            kiln_tensor_free(t->host);
            t->host = r;
        } else {
            set_dev_locked(t, r);
        }
        if (low) t->patch_host = 0;
        if (!low) { t->streamed = t->fetched = t->prefetched = 0; made[i] = 1; }
        pthread_mutex_unlock(&reg_mu);
        copied++;
    }
    pthread_mutex_lock(&reg_mu);
    if (st) {
        for (int i = 0; i < m->n; i++)
            if (made[i]) drop(&m->t[i].dev);
    } else if (!low) {
        /* the device copies exist: host copies would only double the memory (the
         * mapped file can always give them back) */
        for (int i = 0; i < m->n; i++) drop(&m->t[i].host);
    }
    m->busy--;
    uint64_t bytes = bytes_on_locked(m, low ? kiln_device_cpu() : dev, NULL);
    pthread_mutex_unlock(&reg_mu);
    free(made);
    kiln_events_set_context(NULL);
    if (st) {
        char prefix[400];
        load_error_prefix(m, dev, prefix, sizeof prefix);
        return prefix_error(st, prefix);
    }
    kiln_event_emit(KILN_EV_LOAD, low ? kiln_device_cpu()->name : dev->name, bytes, m->owner,
                    "%d tensors, %d copied, dtype %s, mode %s%s%s, %.1f ms", m->n, copied,
                    dtype < 0 ? "as stored" : kiln_dtype_name((kiln_dtype)dtype), kiln_memory_mode_name(mode),
                    low ? ", streamed to " : "", low ? dev->name : "", (kiln_events_now() - t0) * 1e3);
    return KILN_OK;
}

kiln_status kiln_model_offload(kiln_model *m)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "model offload: model is NULL");
    pthread_mutex_lock(&reg_mu);
    cancel_prefetches_locked(m);
    m->busy++;
    const char *from = m->target ? m->target->name : "?";
    pthread_mutex_unlock(&reg_mu);
    kiln_events_set_context(m->owner);
    kiln_device *cpu = kiln_device_cpu();
    kiln_status st = KILN_OK;
    int moved = 0;
    for (int i = 0; i < m->n && !st; i++) {
        mtensor *t = &m->t[i];
        pthread_mutex_lock(&reg_mu);
        kiln_tensor *src = NULL;
        if (t->dev && tensor_device(t->dev) == cpu) {
            kiln_tensor_free(t->host);
            t->host = t->dev;
            t->dev = NULL;
            t->patch_host = 0;
            t->streamed = t->fetched = t->prefetched = 0;
            moved++;
        } else if (t->dev) {
            src = kiln_tensor_view_of(t->dev);
            if (!src) st = kiln_error(KILN_ERR_OOM, "out of host memory");
        }
        pthread_mutex_unlock(&reg_mu);
        if (!src) continue;
        kiln_tensor *h;
        double t0 = kiln_events_now();
        st = copy_to(src, cpu, src->dtype, m->owner, &h);
        if (!st) count_transfer(tensor_device(src), 0, tensor_bytes(h), kiln_events_now() - t0);
        kiln_tensor_free(src);
        if (st) break;
        pthread_mutex_lock(&reg_mu);
        kiln_tensor_free(t->host);
        t->host = h;
        t->patch_host = 0;
        drop(&t->dev);
        t->streamed = t->fetched = t->prefetched = 0;
        pthread_mutex_unlock(&reg_mu);
        moved++;
    }
    pthread_mutex_lock(&reg_mu);
    m->busy--;
    uint64_t bytes = bytes_on_locked(m, cpu, NULL);
    pthread_mutex_unlock(&reg_mu);
    kiln_events_set_context(NULL);
    if (st) {
        char prefix[160];
        snprintf(prefix, sizeof prefix, "model '%s': offloading to host memory: ", m->name);
        return prefix_error(st, prefix);
    }
    kiln_event_emit(KILN_EV_OFFLOAD, cpu->name, bytes, m->owner, "%d tensors moved from %s", moved, from);
    return KILN_OK;
}

void kiln_model_unload(kiln_model *m)
{
    if (!m) return;
    pthread_mutex_lock(&reg_mu);
    cancel_prefetches_locked(m);
    const char *dev = m->target ? m->target->name : "";
    uint64_t bytes = drop_copies_locked(m);
    m->target = NULL;
    m->dtype = -1;
    pthread_mutex_unlock(&reg_mu);
    /* an unload is a request for the memory: the host allocator caches what is freed,
     * so give its wholly free segments (the dropped weights among them) and the
     * kernels' idle scratch back now */
    kiln_device_empty_cache(kiln_device_cpu());
    kiln_event_emit(KILN_EV_UNLOAD, dev, bytes, m->owner, "every copy dropped but the mapped file");
}

void kiln_model_pin(kiln_model *m)
{
    if (!m) return;
    pthread_mutex_lock(&reg_mu);
    m->pinned++;
    pthread_mutex_unlock(&reg_mu);
}

kiln_status kiln_model_unpin(kiln_model *m)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "model unpin: model is NULL");
    pthread_mutex_lock(&reg_mu);
    int was = m->pinned;
    if (was) m->pinned--;
    pthread_mutex_unlock(&reg_mu);
    if (!was) return kiln_error(KILN_ERR_STATE, "model '%s': unpin without a matching pin", m->name);
    return KILN_OK;
}

/* ---- streaming ---- */

static kiln_status resolve(kiln_model *m, const char *const *names, int n, int **idx, const char *what)
{
    *idx = NULL;
    if (!m) return kiln_error(KILN_ERR_ARG, "model %s: model is NULL", what);
    if (n < 0 || (n > 0 && !names)) return kiln_error(KILN_ERR_ARG, "model '%s': %s: bad name list", m->name, what);
    int *v = malloc(sizeof *v * (size_t)(n ? n : 1));
    if (!v) return kiln_error(KILN_ERR_OOM, "model '%s': out of host memory", m->name);
    for (int i = 0; i < n; i++) {
        v[i] = names[i] ? kiln_model_find(m, names[i]) : -1;
        if (v[i] < 0) {
            free(v);
            if (!names[i]) return kiln_error(KILN_ERR_ARG, "model '%s': %s: name %d is NULL", m->name, what, i + 1);
            kiln_status st = missing_error(m, names[i]);
            char prefix[64];
            snprintf(prefix, sizeof prefix, "%s: ", what);
            return prefix_error(st, prefix);
        }
    }
    *idx = v;
    return KILN_OK;
}

static kiln_status need_target_locked(kiln_model *m, const char *what)
{
    if (m->target) return KILN_OK;
    return kiln_error(KILN_ERR_STATE, "model '%s': %s needs a device: call load(device) first", m->name, what);
}

kiln_status kiln_model_fetch(kiln_model *m, const char *const *names, int n)
{
    int *idx;
    kiln_status st = resolve(m, names, n, &idx, "fetch");
    if (st) return st;
    pthread_mutex_lock(&reg_mu);
    st = need_target_locked(m, "fetch");
    kiln_device *dev = target_of(m);
    int dtype = m->dtype;
    m->last_used = ++lru_clock;
    pthread_mutex_unlock(&reg_mu);
    if (st) { free(idx); return st; }
    kiln_events_set_context(m->owner);
    for (int k = 0; k < n && !st; k++) {
        mtensor *t = &m->t[idx[k]];
        pthread_mutex_lock(&reg_mu);
        if (t->inflight) {
            m->n_waits++;
            while (t->inflight) pthread_cond_wait(&done_cv, &reg_mu);
        }
        if (t->dev && tensor_device(t->dev) == dev) {
            if (t->prefetched) { m->n_hits++; t->prefetched = 0; }
            if (t->streamed) t->fetched = 1;
            pthread_mutex_unlock(&reg_mu);
            continue;
        }
        kiln_dtype want = want_dtype(dtype, source_of(t));
        patchset *ps;
        kiln_tensor *src = source_locked(t, want, &ps);
        pthread_mutex_unlock(&reg_mu);
        if (!src) { ps_release(ps); st = kiln_error(KILN_ERR_OOM, "out of host memory"); break; }
        kiln_tensor *r;
        st = make_copy(src, ps, dev, want, m->owner, &r);
        kiln_tensor_free(src);
        ps_release(ps);
        if (st) break;
        pthread_mutex_lock(&reg_mu);
        if (t->dev && tensor_device(t->dev) == dev) {
            kiln_tensor_free(r); /* another thread was faster */
        } else {
            set_dev_locked(t, r);
            t->streamed = 1;
            t->fetched = 1;
        }
        m->n_fetch++;
        pthread_mutex_unlock(&reg_mu);
    }
    kiln_events_set_context(NULL);
    free(idx);
    if (st) {
        char prefix[200];
        snprintf(prefix, sizeof prefix, "model '%s': fetch to %s: ", m->name, dev->name);
        return prefix_error(st, prefix);
    }
    return KILN_OK;
}

kiln_status kiln_model_release(kiln_model *m, const char *const *names, int n)
{
    int *idx;
    kiln_status st = resolve(m, names, n, &idx, "release");
    if (st) return st;
    pthread_mutex_lock(&reg_mu);
    for (int k = 0; k < n; k++) {
        mtensor *t = &m->t[idx[k]];
        if (t->inflight) {
            /* still queued: take it off; copying: wait for it */
            for (int q = 0; q < MAX_QUEUES && t->inflight; q++) {
                job *last = NULL;
                for (job **pj = &queues[q].head; *pj;) {
                    job *j = *pj;
                    if (j->m == m && j->idx == idx[k]) {
                        *pj = j->next;
                        free(j);
                        t->inflight = 0;
                        m->inflight--;
                    } else {
                        last = j;
                        pj = &j->next;
                    }
                }
                queues[q].tail = last;
            }
            while (t->inflight) pthread_cond_wait(&done_cv, &reg_mu);
        }
        if (t->dev && t->streamed) drop(&t->dev);
        t->streamed = t->fetched = t->prefetched = 0;
    }
    pthread_mutex_unlock(&reg_mu);
    free(idx);
    return KILN_OK;
}

static int queue_slot(const kiln_device *dev)
{
    for (int i = 0; i < kiln_device_count() && i < MAX_QUEUES; i++)
        if (kiln_device_at(i) == dev) return i;
    return -1;
}

/* One prefetch copy of t to dev: reg_mu held on entry and on return, released while
 * copying; the copy is installed unless t changed meanwhile. A copy that fails is not
 * an error: fetch makes its own. */
static void prefetch_copy_locked(kiln_model *m, mtensor *t, kiln_device *dev)
{
    kiln_dtype want = want_dtype(m->dtype, source_of(t));
    patchset *ps;
    kiln_tensor *src = source_locked(t, want, &ps);
    unsigned gen = t->gen;
    pthread_mutex_unlock(&reg_mu);
    kiln_tensor *r = NULL;
    kiln_status st = KILN_ERR_OOM;
    double t0 = kiln_events_now();
    if (src) {
        /* the patches' arithmetic runs here too, overlapping the compute */
        kiln_events_set_context(m->owner);
        st = make_copy(src, ps, dev, want, m->owner, &r);
        kiln_tensor_free(src);
    }
    ps_release(ps);
    if (!st && kiln_trace_active()) {
        char args[160];
        snprintf(args, sizeof args, "\"model\":\"%s\",\"bytes\":%llu", m->name,
                 (unsigned long long)tensor_bytes(r));
        kiln_trace_span(t->name, "prefetch", t0, kiln_events_now(), args);
    }
    pthread_mutex_lock(&reg_mu);
    if (!st && t->gen == gen && target_of(m) == dev && !(t->dev && tensor_device(t->dev) == dev)) {
        set_dev_locked(t, r);
        r = NULL;
        t->streamed = 1;
        t->prefetched = 1;
        m->n_prefetch++;
        m->prefetch_tid = kiln_thread_id();
    }
    kiln_tensor_free(r);
}

static void *copy_thread(void *arg)
{
    worker *w = arg;
    char name[32];
    snprintf(name, sizeof name, "copy %s", w->dev->name);
    kiln_thread_set_name(name, 1);
    pthread_mutex_lock(&reg_mu);
    for (;;) {
        while (!w->quit && !queues[w->slot].head) pthread_cond_wait(&queues[w->slot].cv, &reg_mu);
        if (w->quit) break;
        job *j = queues[w->slot].head;
        queues[w->slot].head = j->next;
        if (!j->next) queues[w->slot].tail = NULL;
        kiln_model *m = j->m; /* stays open: close waits for m->inflight */
        mtensor *t = &m->t[j->idx];
        free(j);
        if (target_of(m) == w->dev && !(t->dev && tensor_device(t->dev) == w->dev))
            prefetch_copy_locked(m, t, w->dev);
        t->inflight = 0;
        m->inflight--;
        pthread_cond_broadcast(&done_cv);
    }
    pthread_mutex_unlock(&reg_mu);
    return NULL;
}

void kiln_model_wait_copies(void)
{
    pthread_mutex_lock(&reg_mu);
    for (;;) {
        int busy = 0;
        for (kiln_model *m = models; m && !busy; m = m->next) busy = m->inflight > 0;
        if (!busy) break;
        pthread_cond_wait(&done_cv, &reg_mu);
    }
    pthread_mutex_unlock(&reg_mu);
}

/* A dry run (the meta device) prefetches at once, on the calling thread. Its arithmetic
 * takes no time, so a copy thread would land the copies at a moment that varies from
 * run to run: before, during or after the block that runs meanwhile allocates its
 * temporaries (the dry run's peak of the demo txt2img in low mode came out 0-3.4% low,
 * differently each run). Copied at once, the next block's weights are resident through
 * the block that runs meanwhile: the most a real run can hold, whose copies land when
 * the copy thread gets a core, and the dry run's peak is the same every time.
 * kiln_model_set_prefetch_at_once(1) gives real devices the same timing (tests compare
 * a real run's peak with the dry run's; it takes the overlap of copies and compute away).
 * As on the copy thread, a copy that fails is not an error: fetch makes its own. */
static atomic_int prefetch_at_once;

void kiln_model_set_prefetch_at_once(int on) { atomic_store(&prefetch_at_once, on != 0); }
int kiln_model_prefetch_at_once(void) { return atomic_load(&prefetch_at_once); }

static void prefetch_now(kiln_model *m, const int *idx, int n, kiln_device *dev)
{
    pthread_mutex_lock(&reg_mu);
    for (int k = 0; k < n; k++) {
        mtensor *t = &m->t[idx[k]];
        if (!t->inflight && !(t->dev && tensor_device(t->dev) == dev)) prefetch_copy_locked(m, t, dev);
    }
    pthread_mutex_unlock(&reg_mu);
    kiln_events_set_context(NULL);
}

kiln_status kiln_model_prefetch(kiln_model *m, const char *const *names, int n)
{
    int *idx;
    kiln_status st = resolve(m, names, n, &idx, "prefetch");
    if (st) return st;
    pthread_mutex_lock(&reg_mu);
    st = need_target_locked(m, "prefetch");
    kiln_device *dev = target_of(m);
    if (!st && (dev->type == KILN_DEV_META || atomic_load(&prefetch_at_once))) {
        m->last_used = ++lru_clock;
        pthread_mutex_unlock(&reg_mu);
        prefetch_now(m, idx, n, dev);
        free(idx);
        return KILN_OK;
    }
    int q = st ? -1 : queue_slot(dev);
    if (!st && q < 0) st = kiln_error(KILN_ERR_ARG, "model '%s': prefetch: no copy queue for %s", m->name, dev->name);
    if (!st && !queues[q].w) {
        worker *w = calloc(1, sizeof *w);
        if (w) {
            w->dev = dev;
            w->slot = q;
        }
        if (!w || pthread_create(&w->th, NULL, copy_thread, w) != 0) {
            free(w);
            st = kiln_error(KILN_ERR_STATE, "model '%s': prefetch: cannot start the copy thread for %s", m->name, dev->name);
        } else {
            queues[q].w = w;
        }
    }
    for (int k = 0; k < n && !st; k++) {
        mtensor *t = &m->t[idx[k]];
        if (t->inflight || (t->dev && tensor_device(t->dev) == dev)) continue;
        job *j = malloc(sizeof *j);
        if (!j) { st = kiln_error(KILN_ERR_OOM, "model '%s': out of host memory", m->name); break; }
        j->m = m;
        j->idx = idx[k];
        j->next = NULL;
        if (queues[q].tail) queues[q].tail->next = j;
        else queues[q].head = j;
        queues[q].tail = j;
        t->inflight = 1;
        m->inflight++;
    }
    if (q >= 0) pthread_cond_signal(&queues[q].cv);
    m->last_used = ++lru_clock;
    pthread_mutex_unlock(&reg_mu);
    free(idx);
    return st;
}

/* ---- patches: add / remove / count, the owner's kind ---- */

/* Rebuilds copies[0..n) of t from the file and ps, in place; a copy that fails is
 * dropped from t (if still t's) so nothing stale stays. Returns the first error. */
static kiln_status rebuild_copies(mtensor *t, kiln_tensor **copies, int n, const patchset *ps)
{
    kiln_status first = KILN_OK;
    char msg[800] = "";
    for (int k = 0; k < n; k++) {
        if (!copies[k]) continue;
        kiln_status st = build_into(copies[k], t->mapped, ps);
        if (!st) continue;
        if (!first) {
            first = st;
            snprintf(msg, sizeof msg, "%s", kiln_last_error());
        }
        pthread_mutex_lock(&reg_mu);
        if (t->host && t->host->storage == copies[k]->storage) drop(&t->host);
        if (t->dev && t->dev->storage == copies[k]->storage) {
            drop(&t->dev);
            t->streamed = t->fetched = t->prefetched = 0;
        }
        pthread_mutex_unlock(&reg_mu);
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
    if (i < 0) return prefix_error(missing_error(m, target), "add_patch: ");
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
        return prefix_error(st, prefix);
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

    pthread_mutex_lock(&reg_mu);
    m->busy++;
    while (t->inflight) pthread_cond_wait(&done_cv, &reg_mu); /* a prefetch builds from the old set */
    patchset *old = t->ps, *cur = ps_edit(old, NULL, p);
    if (!cur) {
        m->busy--;
        pthread_mutex_unlock(&reg_mu);
        patch_release(p);
        return kiln_error(KILN_ERR_OOM, "model '%s': add_patch: out of host memory", m->name);
    }
    p->id = ++m->next_patch_id;
    t->ps = ps_retain(cur);
    t->gen++;
    kiln_tensor *copies[2] = {t->host ? kiln_tensor_view_of(t->host) : NULL, t->dev ? kiln_tensor_view_of(t->dev) : NULL};
    pthread_mutex_unlock(&reg_mu);

    kiln_events_set_context(m->owner);
    st = rebuild_copies(t, copies, 2, cur);
    kiln_events_set_context(NULL);
    pthread_mutex_lock(&reg_mu);
    if (st) {
        /* nothing added: the old set back; the copies that were rebuilt are dropped
         * (the file gives them back when needed) */
        ps_release(t->ps);
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
    pthread_mutex_unlock(&reg_mu);
    kiln_tensor_free(copies[0]);
    kiln_tensor_free(copies[1]);
    ps_release(old);
    ps_release(cur);
    patch_release(p);
    if (st) {
        char prefix[300];
        snprintf(prefix, sizeof prefix, "model '%s': add_patch on '%s': ", m->name, target);
        return prefix_error(st, prefix);
    }
    return KILN_OK;
}

kiln_status kiln_model_remove_patch(kiln_model *m, int id)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "model remove_patch: model is NULL");
    pthread_mutex_lock(&reg_mu);
    mtensor *t = NULL;
    patch *p = NULL;
    for (int i = 0; i < m->n && !p; i++) {
        patchset *ps = m->t[i].ps;
        for (int k = 0; ps && k < ps->n; k++)
            if (ps->p[k]->id == id) { t = &m->t[i]; p = ps->p[k]; break; }
    }
    if (!p) {
        pthread_mutex_unlock(&reg_mu);
        return kiln_error(KILN_ERR_ARG, "model '%s': no patch with id %d (removed already?)", m->name, id);
    }
    m->busy++;
    while (t->inflight) pthread_cond_wait(&done_cv, &reg_mu);
    patchset *old = t->ps, *cur = NULL;
    if (old->n > 1 && !(cur = ps_edit(old, p, NULL))) {
        m->busy--;
        pthread_mutex_unlock(&reg_mu);
        return kiln_error(KILN_ERR_OOM, "model '%s': remove_patch: out of host memory", m->name);
    }
    t->ps = ps_retain(cur);
    t->gen++;
    if (!cur && t->host && t->patch_host) drop(&t->host); /* the file's view serves again */
    kiln_tensor *copies[2] = {t->host ? kiln_tensor_view_of(t->host) : NULL, t->dev ? kiln_tensor_view_of(t->dev) : NULL};
    pthread_mutex_unlock(&reg_mu);
    /* a copy that cannot be rebuilt is dropped: the removal itself always holds */
    kiln_events_set_context(m->owner);
    rebuild_copies(t, copies, 2, cur);
    kiln_events_set_context(NULL);
    pthread_mutex_lock(&reg_mu);
    m->busy--;
    pthread_mutex_unlock(&reg_mu);
    kiln_tensor_free(copies[0]);
    kiln_tensor_free(copies[1]);
    ps_release(old);
    ps_release(cur);
    return KILN_OK;
}

int kiln_model_patch_count(kiln_model *m, const char *target)
{
    if (!m) return -1;
    int i = target ? kiln_model_find(m, target) : -1;
    if (target && i < 0) return -1;
    int n = 0;
    pthread_mutex_lock(&reg_mu);
    for (int k = target ? i : 0; k < (target ? i + 1 : m->n); k++)
        if (m->t[k].ps) n += m->t[k].ps->n;
    pthread_mutex_unlock(&reg_mu);
    return n;
}

kiln_status kiln_model_set_owner_kind(kiln_model *m, const char *kind)
{
    if (!m || !kind || !*kind) return kiln_error(KILN_ERR_ARG, "model owner: model and kind are required");
    for (const char *c = kind; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '_' || *c == '-'))
            return kiln_error(KILN_ERR_ARG, "model '%s': owner kind '%s': letters, digits, '_' and '-' only", m->name, kind);
    if (strlen(kind) + 1 + strlen(m->name) >= sizeof m->owner)
        return kiln_error(KILN_ERR_ARG, "model '%s': owner kind '%s' is too long", m->name, kind);
    pthread_mutex_lock(&reg_mu);
    snprintf(m->owner, sizeof m->owner, "%s:%s", kind, m->name);
    for (int i = 0; i < m->n; i++) {
        mtensor *t = &m->t[i];
        kiln_storage_set_owner(t->mapped->storage, m->owner);
        if (t->host) kiln_storage_set_owner(t->host->storage, m->owner);
        if (t->dev) kiln_storage_set_owner(t->dev->storage, m->owner);
    }
    pthread_mutex_unlock(&reg_mu);
    return KILN_OK;
}

const char *kiln_model_owner(const kiln_model *m) { return m ? m->owner : "?"; }
